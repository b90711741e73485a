#!/usr/bin/env bash
# A multi-node SLURM cluster on this machine, to try the launch path (sbatch, srun across
# nodes, preemption-requeue, afterok chains, a node lost) without a real cluster. CI
# starts it before the tests (.ci/run); tests/test_slurm.py (one-node jobs) and
# tests/test_slurm_multinode.py (jobs on 2 and 4 nodes) run against it.
#
#   scripts/slurm_local.sh start [--nodes N] [--cpus C]
#                                   install (Debian packages, once), configure, start
#   scripts/slurm_local.sh status   daemons, node state, queue
#   scripts/slurm_local.sh stop     stop the daemons this script started (pid files)
#
# The nodes n1..nN (default 4: tests/test_slurm_multinode.py resumes on 4 nodes x 1 rank)
# are N slurmd daemons of this host (`slurmd -N nK`), each with its own port (6921+K-1),
# pid file, spool directory and log, all with NodeAddr=127.0.0.1: the names n1.. do not
# resolve, so a job asks SLURM for the address (slurm/train.sbatch does). Each node claims
# C CPUs (default 8, so the paper's 8 ranks a node fit: scripts/rehearse_32.sh). They are
# this machine's cores, shared: 4 x 8 "CPUs" on a 2-core machine is oversubscribed, which
# a test of the launch path (gloo, one thread a rank) tolerates and a benchmark does not.
# One partition holds every node; a one-node job still runs on one node.
#
# Needs root (or sudo) and apt: Debian's slurmctld slurmd slurm-client munge (SLURM
# 22.05 on bookworm). It writes /etc/slurm/slurm.conf (refusing to replace one it did not
# write), runs munged as the munge user and slurmctld/slurmd as root, and records the pid
# of every daemon it starts in $MTA_SLURM_STATE (default /run/mta-slurm-local): `stop`
# ends only those, so a site's own daemons are never touched. Idempotent: `start` on a
# running cluster of the same shape only checks it; another --nodes/--cpus restarts it.
set -euo pipefail

STATE=${MTA_SLURM_STATE:-/run/mta-slurm-local}
CONF=/etc/slurm/slurm.conf
MARKER="# written by mta_repro scripts/slurm_local.sh"
LOG=$STATE/log
PARTITION=${MTA_SLURM_PARTITION:-debug}
NODES=${MTA_SLURM_NODES:-4}
NODE_CPUS=${MTA_SLURM_CPUS:-8}
PORT0=6921

die() { echo "slurm_local.sh: $*" >&2; exit 1; }
say() { echo "slurm_local.sh: $*" >&2; }
usage="usage: $0 start|restart [--nodes N] [--cpus C] | stop | status"

cmd=${1:-}
(($#)) && shift
while (($#)); do
  case $1 in
    --nodes) NODES=${2:-}; shift 2 || die "--nodes needs a number" ;;
    --nodes=*) NODES=${1#*=}; shift ;;
    --cpus) NODE_CPUS=${2:-}; shift 2 || die "--cpus needs a number" ;;
    --cpus=*) NODE_CPUS=${1#*=}; shift ;;
    *) die "unknown option '$1' ($usage)" ;;
  esac
done
[[ $NODES =~ ^[1-9][0-9]*$ ]] && ((NODES <= 64)) || die "--nodes: expected 1..64, got '$NODES'"
[[ $NODE_CPUS =~ ^[1-9][0-9]*$ ]] || die "--cpus: expected a positive integer, got '$NODE_CPUS'"

if [[ $(id -u) -ne 0 ]]; then
  command -v sudo >/dev/null || die "needs root (apt-get, /etc/slurm, daemons) and sudo is not installed"
  exec sudo --preserve-env=MTA_SLURM_STATE,MTA_SLURM_PARTITION "$0" "$cmd" --nodes "$NODES" --cpus "$NODE_CPUS"
fi

install_packages() {
  local missing=()
  command -v slurmctld >/dev/null || missing+=(slurmctld)
  command -v slurmd >/dev/null || missing+=(slurmd)
  command -v sbatch >/dev/null || missing+=(slurm-client)
  command -v munged >/dev/null || missing+=(munge)
  ((${#missing[@]})) || return 0
  command -v apt-get >/dev/null || die "missing ${missing[*]} and no apt-get: install SLURM and munge yourself"
  say "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  # The package lists may be absent (fresh container) or stale: update once on failure.
  apt-get install -y -q "${missing[@]}" >"$LOG/apt.log" 2>&1 ||
    { apt-get update -q >>"$LOG/apt.log" 2>&1 && apt-get install -y -q "${missing[@]}" >>"$LOG/apt.log" 2>&1; } ||
    die "apt-get install ${missing[*]} failed (see $LOG/apt.log)"
}

write_conf() {
  local host k
  host=$(hostname -s)
  if [[ -e $CONF ]] && ! grep -qF "$MARKER" "$CONF"; then
    die "$CONF exists and was not written by this script; not replacing it"
  fi
  mkdir -p /etc/slurm /var/lib/slurm/slurmctld
  for ((k = 1; k <= NODES; k++)); do mkdir -p "/var/lib/slurm/slurmd/spool-n$k"; done
  {
    cat <<EOF
$MARKER
# $NODES nodes n[1-$NODES]: slurmd -N nK on this host ($host), $NODE_CPUS CPUs each
# (config_overrides: slurmd trusts the count, task/none binds nothing); one default
# partition of all of them, no GPUs, no cgroups (proctrack/linuxproc, task/none: works
# in containers), no accounting.
ClusterName=mta-local
SlurmctldHost=$host
SlurmUser=root
AuthType=auth/munge
# A requeued job waits for its launch credential to expire before it starts again
# (default 120 s); 10 s keeps the preemption tests short.
AuthInfo=cred_expire=10
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobRequeue=1
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
# Schedule requeued / dependent jobs within a second or two, not the default minute.
SchedulerParameters=sched_interval=2,bf_interval=1
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SlurmctldPidFile=$STATE/slurmctld.pid
# %n: the node name, so each slurmd of this host has its own pid file, spool and log.
SlurmdPidFile=$STATE/slurmd-%n.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd-%n.log
StateSaveLocation=/var/lib/slurm/slurmctld
SlurmdSpoolDir=/var/lib/slurm/slurmd/spool-%n
SlurmdParameters=config_overrides
EOF
    for ((k = 1; k <= NODES; k++)); do
      echo "NodeName=n$k NodeHostname=$host NodeAddr=127.0.0.1 Port=$((PORT0 + k - 1)) CPUs=$NODE_CPUS State=UNKNOWN"
    done
    echo "PartitionName=$PARTITION Nodes=n[1-$NODES] Default=YES MaxTime=INFINITE State=UP"
  } >"$CONF.tmp"
  if cmp -s "$CONF.tmp" "$CONF"; then rm "$CONF.tmp"; return 0; fi
  mv "$CONF.tmp" "$CONF"
  CONF_CHANGED=1
}

alive() { [[ -s $STATE/$1.pid ]] && kill -0 "$(cat "$STATE/$1.pid")" 2>/dev/null; }

# The node names of the written configuration.
conf_nodes() { sed -n 's/^NodeName=\(n[0-9]*\) .*/\1/p' "$CONF" 2>/dev/null; }

munge_works() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

start_munge() {
  if munge_works; then return 0; fi  # ours from an earlier start, or the site's
  [[ -s /etc/munge/munge.key ]] || {
    say "creating /etc/munge/munge.key"
    if command -v mungekey >/dev/null; then mungekey --create --keyfile=/etc/munge/munge.key
    else dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none; fi
  }
  chown munge:munge /etc/munge/munge.key && chmod 0400 /etc/munge/munge.key
  install -d -o munge -g munge -m 0755 /run/munge
  runuser -u munge -- munged --pid-file=/run/munge/munged.pid
  for _ in $(seq 50); do munge_works && break; sleep 0.1; done
  munge_works || die "munged does not answer (see /var/log/munge/munged.log)"
  cp /run/munge/munged.pid "$STATE/munged.pid"
}

start_daemon() {  # slurmctld | slurmd <node>
  local pidname=$1 args=()
  if [[ -n ${2:-} ]]; then pidname=$1-$2; args=(-N "$2"); fi
  if alive "$pidname"; then return 0; fi
  if [[ $1 == slurmctld ]] && pgrep -x "$1" >/dev/null; then
    die "a $1 not started by this script is running (pid $(pgrep -x "$1" | head -1)); stop it first"
  fi
  "/usr/sbin/$1" -f "$CONF" "${args[@]}" || die "$pidname failed to start (see $LOG/$pidname.log)"
  for _ in $(seq 50); do alive "$pidname" && return 0; sleep 0.1; done
  die "$pidname did not write $STATE/$pidname.pid (see $LOG/$pidname.log)"
}

wait_idle() {  # node
  local state
  for _ in $(seq 150); do
    state=$(sinfo -h -n "$1" -o %T 2>/dev/null || true)
    case $state in
      idle*|mixed*|allocated*) return 0 ;;
      down*|drain*) scontrol update nodename="$1" state=resume 2>/dev/null || true ;;
    esac
    sleep 0.2
  done
  die "node $1 is not up (state: ${state:-unknown}; see $LOG/slurmctld.log, $LOG/slurmd-$1.log)"
}

stop_pidfile() {  # pid-file name (slurmd-n1, slurmctld, munged), process name
  local pid
  [[ -s $STATE/$1.pid ]] || return 0
  pid=$(cat "$STATE/$1.pid")
  # Only a live process of that name: a stale pid file may name a reused pid.
  if [[ $(ps -o comm= -p "$pid" 2>/dev/null) == "$2" ]]; then
    kill "$pid"
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && { say "$1 ($pid) ignores SIGTERM; sending SIGKILL"; kill -9 "$pid"; }
    say "stopped $1 ($pid)"
  fi
  rm -f "$STATE/$1.pid"
}

stop_slurmds() {  # every slurmd this script started, whatever the node count was
  local f name
  for f in "$STATE"/slurmd-*.pid "$STATE"/slurmd.pid; do
    [[ -e $f ]] || continue
    name=${f##*/}
    stop_pidfile "${name%.pid}" slurmd
  done
}

start() {
  local node
  mkdir -p "$STATE" "$LOG"
  install_packages
  write_conf
  start_munge
  if [[ ${CONF_CHANGED:-0} == 1 ]]; then
    # Nodes added or removed: `scontrol reconfigure` does not take that (22.05); restart.
    if alive slurmctld; then say "slurm.conf changed: restarting the daemons"; fi
    stop_slurmds
    stop_pidfile slurmctld slurmctld
  fi
  start_daemon slurmctld
  for node in $(conf_nodes); do start_daemon slurmd "$node"; done
  for node in $(conf_nodes); do wait_idle "$node"; done
  say "up: $(sinfo -h -o '%P %D node(s) %N, %c CPUs each, %T')"
}

stop() {
  stop_slurmds
  stop_pidfile slurmctld slurmctld
  stop_pidfile munged munged
}

status() {
  local name rc=0
  for name in munged slurmctld $(conf_nodes | sed 's/^/slurmd-/'); do
    if alive "$name"; then echo "$name: running (pid $(cat "$STATE/$name.pid"), started by this script)"
    else echo "$name: not running"; rc=1; fi
  done
  if ((rc == 0)); then sinfo; squeue; fi
  return $rc
}

case $cmd in
  start) start ;;
  stop) stop ;;
  status) status ;;
  restart) stop; start ;;
  *) die "$usage" ;;
esac
