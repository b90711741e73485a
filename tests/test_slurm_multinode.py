"""Jobs across nodes on the local multi-node cluster (scripts/slurm_local.sh start: n1..n4,
one slurmd each, all on this machine), under the MTA_TEST_SLURM=1 opt-in of
tests/test_slurm.py and in its ``slurm`` group (one job at a time, one worker).

Each job is the debug model on 4 CPU ranks (gloo, one thread each) with the
``batch_source`` loader, whose global batches are the same for any world size: 2 nodes x
2 ranks x batch 1, 4 x 1 x 1 and 1 x 2 x 2 all train on the same 4 rows a step as one
process with batch 4, so every shape is compared with that one process within the 2-rank
tests' tolerance. The cluster's nodes share this machine's cores: these tests show the
launch path (rendezvous across nodes, checkpoints written by ranks of several nodes,
signals reaching every node, requeue of a multi-node allocation), not speed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import test_slurm
from test_slurm import (
    COMMON,
    STEPS,
    TOL,
    _env,
    _job_field,
    _logs,
    _losses,
    _submit_train,
    _wait_job,
)

# test_slurm's fixtures: the cluster check, and one process on the global batch of 4.
cluster = test_slurm.cluster
reference = test_slurm.reference

pytestmark = pytest.mark.slurm


def _shape(nodes: int, tasks: int) -> list[str]:
    """Overrides for nodes x tasks ranks on the global batch of 4: a batch of 1 a rank, and
    the accumulation steps that make up the rest (docs/training.md, "Another world size":
    a resume on another world size keeps data.batch_size and sets trainer.grad_accum)."""
    return [
        f"slurm.nodes={nodes}",
        f"slurm.tasks_per_node={tasks}",
        "data.batch_size=1",
        f"trainer.grad_accum={4 // (nodes * tasks)}",
    ]


def _submit(run_dir, shape, *extra):
    """_submit_train with this module's node shape (its data.batch_size=2 overridden)."""
    return _submit_train(run_dir, *shape, *extra)


def _assert_matches(reference, run_dir, steps=range(1, STEPS + 1)):
    got = _losses(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1)), sorted(got)
    for s in steps:
        assert abs(reference[s]["loss"] - got[s]["loss"]) <= TOL, (s, reference[s]["loss"], got[s]["loss"])


def _starts(run_dir):
    return json.loads((Path(run_dir) / "provenance.json").read_text())["starts"]


def _checkpoint_ranks(ckpt: Path) -> int | None:
    from mta_repro.weights.layout import saved_world_size

    return saved_world_size(ckpt)


# ------------------------------------------------------------------ the rendezvous host
@pytest.mark.usefixtures("cluster")
def test_nodelist_fallback_agrees_with_scontrol():
    """The pure expansion (used where scontrol is absent) is SLURM's, on the lists SLURM
    writes; SLURM 22.05 refuses ``node[1-2]-ib`` (a suffix after the range) and writes such
    nodes uncompressed, which both expand alike."""
    from mta_repro.slurm import expand_nodelist, hostnames, node_address, rendezvous_host

    for nodelist in ("gpu-[001-004,010]", "a1,b[2-3]", "node1-ib,node2-ib", "gpu[003-005,9],cpu1", "x[1-2]y[3-4]"):
        real = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True)
        assert real.returncode == 0, real.stderr
        assert expand_nodelist(nodelist) == real.stdout.split() == hostnames(nodelist), nodelist
    compressed = subprocess.run(["scontrol", "show", "hostlist", "node1-ib,node2-ib"], capture_output=True, text=True)
    assert compressed.stdout.strip() == "node1-ib,node2-ib"
    assert expand_nodelist("node[1-2]-ib") == ["node1-ib", "node2-ib"]
    # The local nodes' names resolve nowhere: the address is SLURM's NodeAddr.
    with pytest.raises(OSError):
        socket.getaddrinfo("n2", None)
    assert node_address("n2") == "127.0.0.1" and rendezvous_host("n[2-3]") == "127.0.0.1"
    assert node_address("localhost") == "localhost"


# ------------------------------------------------------------------ 2 nodes x 2 ranks
@pytest.mark.slow
@pytest.mark.usefixtures("cluster")
def test_two_nodes_four_ranks_match_one_process_then_resume_at_other_shapes(reference, tmp_path):
    """2 nodes x 2 ranks: the losses of one process, one checkpoint written by all 4 ranks,
    the node list and world size in the run's record; its step-8 checkpoint resumed on
    1 node x 2 ranks and on 4 nodes x 1 rank gives the uninterrupted run's steps 9..16."""
    run_dir = tmp_path / "two"
    job = _submit(run_dir, _shape(2, 2), "trainer.loader=batch_source:build", "checkpoint.every=8", "checkpoint.keep=2")
    assert _wait_job(job, timeout=400) == "COMPLETED", _logs(run_dir, job, "err")[-3000:]
    assert _job_field(job, "NumNodes") == "2" and _job_field(job, "NumTasks") == "4"
    _assert_matches(reference, run_dir)
    err = _logs(run_dir, job, "err")
    assert re.search(r"rendezvous: 2 node\(s\) n\[\d-\d\], rank 0 on n\d at 127\.0\.0\.1:\d+", err), err[-2000:]
    start = _starts(run_dir)[-1]
    assert start["world_size"] == 4 and start["slurm_nodes"] == 2
    assert start["slurm_nodelist"] == _job_field(job, "NodeList")
    for step in (8, STEPS):
        assert _checkpoint_ranks(run_dir / "checkpoints" / f"{step:010d}") == 4
    # The step-8 checkpoint, alone in a copy of the run dir, resumed at other shapes.
    for nodes, tasks in ((1, 2), (4, 1)):
        other = tmp_path / f"at_{nodes}x{tasks}"
        shutil.copytree(run_dir, other, ignore=shutil.ignore_patterns(f"{STEPS:010d}", "slurm", ".lock"))
        rows = (other / "metrics.jsonl").read_text().splitlines()
        (other / "metrics.jsonl").write_text("".join(r + "\n" for r in rows if json.loads(r)["step"] <= 8))
        job = _submit(
            other, _shape(nodes, tasks), "trainer.loader=batch_source:build", "checkpoint.every=8", "checkpoint.keep=2"
        )
        assert _wait_job(job, timeout=400) == "COMPLETED", _logs(other, job, "err")[-3000:]
        assert _job_field(job, "NumNodes") == str(nodes)
        err = _logs(other, job, "err")
        assert f"resumed from {other}/checkpoints/{8:010d} at step 8" in err, err[-3000:]
        _assert_matches(reference, other, steps=range(9, STEPS + 1))
        assert _starts(other)[-1]["world_size"] == nodes * tasks
        assert _checkpoint_ranks(other / "checkpoints" / f"{STEPS:010d}") == nodes * tasks


# ------------------------------------------------------------------ preemption across nodes
def _wait_steps(run_dir, job, n, timeout=240):
    metrics = Path(run_dir) / "metrics.jsonl"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= n:
            return
        time.sleep(0.05)
    pytest.fail(f"job {job} logged fewer than {n} steps: {_job_field(job, 'JobState')}")


@pytest.mark.slow
@pytest.mark.usefixtures("cluster")
def test_usr2_on_two_nodes_stops_every_rank_requeues_and_resumes_exactly(reference, tmp_path):
    """scancel --signal=USR2 on a 2-node job (SLURM signals the batch step's srun, which
    forwards to every task on every node): all 4 ranks stop at one step boundary, one
    checkpoint of all 4 ranks, the job requeues (the same 2-node shape) and resumes at that
    step; every step once, equal to the uninterrupted run."""
    run_dir = tmp_path / "pre"
    job = _submit(run_dir, _shape(2, 2), "trainer.loader=test_slurm:slow_build")
    _wait_steps(run_dir, job, 4)
    subprocess.run(["scancel", "--signal=USR2", job], check=True)
    assert _wait_job(job, timeout=400) == "COMPLETED", _logs(run_dir, job, "err")[-3000:]
    err = _logs(run_dir, job, "err")
    stopped = re.findall(r"stopped at step (\d+) after a signal and requeued the job", err)
    assert len(stopped) == 1, err[-3000:]  # rank 0's one line
    k = int(stopped[0])
    assert 4 <= k < STEPS
    assert err.index(f"requeued job {job}") < err.index("stopped at step")
    assert f"resumed from {run_dir}/checkpoints/{k:010d} at step {k}" in err
    assert _job_field(job, "Restarts") == "1" and _job_field(job, "NumNodes") == "2"
    # The stop's checkpoint holds every rank's shard: all 4 stopped at step k, none later.
    assert _checkpoint_ranks(run_dir / "checkpoints" / f"{k:010d}") == 4
    assert [s["step"] for s in _starts(run_dir)] == [0, k] and {s["world_size"] for s in _starts(run_dir)} == {4}
    _assert_matches(reference, run_dir)
    assert "Traceback" not in err, err[-3000:]


# ------------------------------------------------------------------ a node lost
def _task_pids(job: str, node: str) -> list[int]:
    """The training processes of ``job`` that SLURM started on ``node`` (their environment)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = dict(
                kv.split("=", 1)
                for kv in (proc / "environ").read_bytes().decode(errors="replace").split("\0")
                if "=" in kv
            )
            cmd = (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if env.get("SLURM_JOB_ID") == job and env.get("SLURMD_NODENAME") == node and "mta_repro.train" in cmd:
            pids.append(int(proc.name))
    return pids


@pytest.mark.slow
@pytest.mark.usefixtures("cluster")
def test_a_node_lost_mid_run_ends_the_job_and_the_resubmission_resumes(reference, tmp_path):
    """The ranks on n2 SIGKILLed mid-run (a node dying, as its tasks see it): the job ends
    within seconds, not distributed.timeout_min, with srun's one line naming the node and
    task; the checkpoints left are complete ones (a save cut short is never marked
    complete) and the same command resubmitted resumes from the newest and ends equal to
    the uninterrupted run."""
    from mta_repro.weights.layout import complete_checkpoints, verify_checkpoint

    run_dir = tmp_path / "lost"
    args = (_shape(2, 2), "trainer.loader=test_slurm:slow_build", "checkpoint.every=4", "checkpoint.keep=3")
    job = _submit(run_dir, *args)
    _wait_steps(run_dir, job, 6)
    assert _job_field(job, "NodeList") == "n[1-2]"  # an idle cluster: the first two nodes
    victims = _task_pids(job, "n2")
    assert len(victims) == 2, (victims, _job_field(job, "NodeList"))
    t0 = time.time()
    for pid in victims:
        os.kill(pid, 9)
    state = _wait_job(job, timeout=300)
    ended_in = time.time() - t0
    assert state == "FAILED", state
    err = _logs(run_dir, job, "err")
    lost = re.findall(r"srun: error: (n\d): tasks? ([\d-]+): Killed", err)
    assert lost and lost[0][0] == "n2", err[-3000:]
    assert ended_in < 120, ended_in  # distributed.timeout_min is 30 min: not waited for
    print(f"node lost: job ended {ended_in:.0f} s after the kill; {lost[0]}")
    found = complete_checkpoints(run_dir / "checkpoints")
    assert found, err[-3000:]
    for ckpt in found:
        assert verify_checkpoint(ckpt) is None, ckpt
        assert _checkpoint_ranks(ckpt) == 4
    newest = int(found[-1].name)
    job2 = _submit(run_dir, *args)
    assert _wait_job(job2, timeout=400) == "COMPLETED", _logs(run_dir, job2, "err")[-3000:]
    assert f"resumed from {run_dir}/checkpoints/{newest:010d} at step {newest}" in _logs(run_dir, job2, "err")
    _assert_matches(reference, run_dir)


# ------------------------------------------------------------------ two jobs on the same nodes
@pytest.mark.slow
@pytest.mark.usefixtures("cluster")
def test_two_multinode_jobs_on_the_same_nodes_do_not_share_a_port(reference, tmp_path):
    """Two 2-node jobs at once on n1,n2, the first one's derived port (20000 + job id %
    20000) held by another program on the first node: it moves to a free one (stride 7919,
    not onto the next job's), the second keeps its own; both end equal to one process."""
    from mta_repro.pipeline.submit import render

    config = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True).stdout
    next_id = int(re.search(r"NEXT_JOB_ID\s*=\s*(\d+)", config).group(1))
    derived = 20000 + next_id % 20000
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    holder.bind(("127.0.0.1", derived))
    holder.listen()
    jobs, dirs = [], []
    try:
        for name in ("a", "b"):
            run_dir = tmp_path / name
            over = [
                *COMMON,
                "slurm.gpus_per_node=0",
                "slurm.cpus_per_task=1",
                "slurm.cpu_bind=null",
                "slurm.time_min=10",
                *_shape(2, 1),
                "trainer.loader=batch_source:build",
                f"run_dir={run_dir}",
            ]
            script, _ = render(over, python=sys.executable, check_paths=False)
            (run_dir / "slurm").mkdir(parents=True)
            (run_dir / "slurm" / "train.sbatch").write_text(script)
            p = subprocess.run(
                ["sbatch", "--parsable", "--nodelist=n[1-2]", str(run_dir / "slurm" / "train.sbatch")],
                capture_output=True,
                text=True,
                env=_env(),
            )
            assert p.returncode == 0, p.stderr
            jobs.append(p.stdout.strip().split(";")[0])
            dirs.append(run_dir)
        assert int(jobs[0]) == next_id
        for job in jobs:
            while _job_field(job, "JobState") in ("PENDING", "CONFIGURING"):
                time.sleep(0.2)
        overlap = all(_job_field(j, "JobState") == "RUNNING" for j in jobs)
        states = [_wait_job(j, timeout=400) for j in jobs]
    finally:
        holder.close()
    assert states == ["COMPLETED", "COMPLETED"], [_logs(d, j, "err")[-2000:] for d, j in zip(dirs, jobs)]
    assert overlap and {_job_field(j, "NodeList") for j in jobs} == {"n[1-2]"}
    ports = []
    for d, j in zip(dirs, jobs):
        m = re.search(r"rendezvous: 2 node\(s\) n\[1-2\], rank 0 on n1 at 127\.0\.0\.1:(\d+)", _logs(d, j, "err"))
        assert m, _logs(d, j, "err")[-2000:]
        ports.append(int(m.group(1)))
        _assert_matches(reference, d)
    assert ports == [20000 + (derived - 20000 + 7919) % 20000, 20000 + int(jobs[1]) % 20000]
