#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, to try the launch path (sbatch, srun,
# preemption-requeue, afterok chains) without a real cluster. CI
# starts it before the tests (.ci/run); tests/test_slurm.py runs against it.
#
#   scripts/slurm_local.sh start    install (Debian packages, once), configure, start
#   scripts/slurm_local.sh status   daemons, node state, queue
#   scripts/slurm_local.sh stop     stop the daemons this script started (pid files)
#
# Needs root (or sudo) and apt: Debian's slurmctld slurmd slurm-client munge (SLURM
# 22.05 on bookworm). It writes /etc/slurm/slurm.conf (refusing to replace one it did not
# write), runs munged as the munge user and slurmctld/slurmd as root, and records the pid
# of every daemon it starts in $MTA_SLURM_STATE (default /run/mta-slurm-local): `stop`
# ends only those, so a site's own daemons are never touched. Idempotent: `start` on a
# running cluster only checks it.
set -euo pipefail

STATE=${MTA_SLURM_STATE:-/run/mta-slurm-local}
CONF=/etc/slurm/slurm.conf
MARKER="# written by mta_repro scripts/slurm_local.sh"
LOG=$STATE/log
PARTITION=${MTA_SLURM_PARTITION:-debug}

die() { echo "slurm_local.sh: $*" >&2; exit 1; }
say() { echo "slurm_local.sh: $*" >&2; }

if [[ $(id -u) -ne 0 ]]; then
  command -v sudo >/dev/null || die "needs root (apt-get, /etc/slurm, daemons) and sudo is not installed"
  exec sudo --preserve-env=MTA_SLURM_STATE,MTA_SLURM_PARTITION "$0" "$@"
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
  local host cpus
  host=$(hostname -s)
  # At least 2, so 2-rank jobs (tests/test_slurm.py) fit on a 1-CPU machine too
  # (config_overrides below: slurmd trusts this count, task/none binds nothing).
  cpus=$(nproc); ((cpus >= 2)) || cpus=2
  if [[ -e $CONF ]] && ! grep -qF "$MARKER" "$CONF"; then
    die "$CONF exists and was not written by this script; not replacing it"
  fi
  mkdir -p /etc/slurm /var/lib/slurm/slurmctld /var/lib/slurm/slurmd
  cat >"$CONF.tmp" <<EOF
$MARKER
# One node (this host: $host, $cpus CPUs), one default partition, no GPUs, no
# cgroups (proctrack/linuxproc, task/none: works in containers), no accounting.
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
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd.log
StateSaveLocation=/var/lib/slurm/slurmctld
SlurmdSpoolDir=/var/lib/slurm/slurmd
SlurmdParameters=config_overrides
NodeName=$host CPUs=$cpus State=UNKNOWN
PartitionName=$PARTITION Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
  if cmp -s "$CONF.tmp" "$CONF"; then rm "$CONF.tmp"; return 0; fi
  mv "$CONF.tmp" "$CONF"
  CONF_CHANGED=1
}

alive() { [[ -s $STATE/$1.pid ]] && kill -0 "$(cat "$STATE/$1.pid")" 2>/dev/null; }

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

start_daemon() {  # name
  if alive "$1"; then return 0; fi
  if pgrep -x "$1" >/dev/null; then
    die "a $1 not started by this script is running (pid $(pgrep -x "$1" | head -1)); stop it first"
  fi
  "/usr/sbin/$1" -f "$CONF" || die "$1 failed to start (see $LOG/$1.log)"
  for _ in $(seq 50); do alive "$1" && return 0; sleep 0.1; done
  die "$1 did not write $STATE/$1.pid (see $LOG/$1.log)"
}

wait_idle() {
  local host state
  host=$(hostname -s)
  for _ in $(seq 150); do
    state=$(sinfo -h -n "$host" -o %T 2>/dev/null || true)
    case $state in
      idle*|mixed*|allocated*) return 0 ;;
      down*|drain*) scontrol update nodename="$host" state=resume 2>/dev/null || true ;;
    esac
    sleep 0.2
  done
  die "node $host is not up (state: ${state:-unknown}; see $LOG/slurmctld.log, $LOG/slurmd.log)"
}

start() {
  mkdir -p "$STATE" "$LOG"
  install_packages
  write_conf
  start_munge
  if [[ ${CONF_CHANGED:-0} == 1 ]] && alive slurmctld; then
    say "slurm.conf changed: scontrol reconfigure"
    scontrol reconfigure || die "scontrol reconfigure failed (see $LOG/slurmctld.log); try: $0 restart"
  fi
  start_daemon slurmctld
  start_daemon slurmd
  wait_idle
  say "up: $(sinfo -h -o '%P %D node(s) %c CPUs %T')"
}

stop() {
  local name pid
  for name in slurmd slurmctld munged; do
    [[ -s $STATE/$name.pid ]] || continue
    pid=$(cat "$STATE/$name.pid")
    # Only a live process of that name: a stale pid file may name a reused pid.
    if [[ $(ps -o comm= -p "$pid" 2>/dev/null) == "$name" ]]; then
      kill "$pid"
      for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -0 "$pid" 2>/dev/null && { say "$name ($pid) ignores SIGTERM; sending SIGKILL"; kill -9 "$pid"; }
      say "stopped $name ($pid)"
    fi
    rm -f "$STATE/$name.pid"
  done
}

status() {
  local name rc=0
  for name in munged slurmctld slurmd; do
    if alive "$name"; then echo "$name: running (pid $(cat "$STATE/$name.pid"), started by this script)"
    elif pgrep -x "$name" >/dev/null; then echo "$name: running (not started by this script)"
    else echo "$name: not running"; rc=1; fi
  done
  if ((rc == 0)); then sinfo; squeue; fi
  return $rc
}

case ${1:-} in
  start) start ;;
  stop) stop ;;
  status) status ;;
  restart) stop; start ;;
  *) die "usage: $0 start|stop|status|restart" ;;
esac
