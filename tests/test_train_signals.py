"""Ctrl-C and the step loop's host syncs.

- Ctrl-C (SIGINT) during training saves a checkpoint at the interrupted step and prints one
  line with the step, the checkpoint and "rerun the same command to resume" (exit 130, no
  traceback); the rerun resumes there. A second Ctrl-C stops at once (exit 130, one line).
- A signal to a rank waiting in the rendezvous (init_process_group) stops it in seconds
  with the stop line and 128 + the signal's number.
- The step loop reads the loss and gradient norm, and agrees on preemption signals across
  ranks, only every ``logging.every`` steps: no ``.item()``/``.tolist()``/``bool()`` of a
  tensor from the trainer or the model and no all-reduce on the other steps (counted under
  patched torch functions, on 1 rank in this process and on 2 ranks under torchrun).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tiny_config import tiny_train

from mta_repro.train.config import compose

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
TINY = tiny_train("data.shuffle_buffer=8", "optim.lr=3e-3", "optim.warmup=2", omit=("logging.every",))

SLOW_LOADER = '''
import time

from batch_source import build as _build


def build(data_args, rank, world_size):
    """batch_source's loader, 0.1 s per batch: a run long enough to interrupt."""
    src = _build(data_args, rank, world_size)
    nxt = src.__next__

    class Slow(type(src)):
        def __next__(self):
            time.sleep(0.1)
            return nxt()

    src.__class__ = Slow
    return src
'''


def _env(tmp_path):
    path = os.pathsep.join([str(ROOT), str(HERE), str(HERE / "helpers"), str(HERE / "distributed"), str(tmp_path)])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)
    env.pop("MTA_REPRO_TRACEBACK", None)
    return env


def _start(tmp_path, run_dir, steps):
    (tmp_path / "slow_loader.py").write_text(SLOW_LOADER)
    cmd = [
        sys.executable,
        "-m",
        "mta_repro.train",
        f"run_dir={run_dir}",
        *TINY,
        f"trainer.steps={steps}",
        "checkpoint.every=1000",
        "logging.every=1",
        "trainer.loader=slow_loader:build",
    ]
    return subprocess.Popen(
        cmd, cwd=ROOT, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _wait_for_steps(run_dir, n, proc, timeout=180):
    metrics = Path(run_dir) / "metrics.jsonl"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= n:
            return
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.02)
    proc.kill()
    raise AssertionError(f"the run never reached step {n}")


@pytest.mark.slow
def test_ctrl_c_saves_at_the_interrupted_step_and_says_how_to_resume(tmp_path):
    run_dir = tmp_path / "run"
    proc = _start(tmp_path, run_dir, steps=60)
    _wait_for_steps(run_dir, 3, proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    m = re.search(
        r"stopped at step (\d+) after a signal \(SIGINT\): checkpoint (\S+); "
        r"rerun the same command to resume",
        err,
    )
    assert m, err[-3000:]
    step = int(m.group(1))
    assert 3 <= step < 60
    ckpt = Path(m.group(2))
    assert ckpt == run_dir / "checkpoints" / f"{step:010d}" and (ckpt / ".complete").is_file()
    logged = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert logged[-1] == step  # the checkpoint is the last step trained

    # The same command resumes there (and is interrupted again, at once, twice: no save).
    again = _start(tmp_path, run_dir, steps=60)
    _wait_for_steps(run_dir, step + 2, again)
    again.send_signal(signal.SIGINT)
    time.sleep(0.02)
    again.send_signal(signal.SIGINT)
    _, err2 = again.communicate(timeout=120)
    assert f"resumed from {ckpt} at step {step}" in err2, err2[-3000:]
    assert again.returncode == 130 and "Traceback" not in err2, err2[-3000:]
    assert "train: interrupted" in err2 or "stopped at step" in err2  # the 2nd may land after the save


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGUSR2, 140)])
def test_a_stop_by_signal_is_an_unfinished_run_exit(tmp_path, sig, code):
    # scancel sends SIGTERM and SLURM's time-limit warning SIGUSR2: the run saves and exits
    # with 128 + the signal's number, so `train && eval` and afterok never go on from it.
    run_dir = tmp_path / "run"
    proc = _start(tmp_path, run_dir, steps=60)
    _wait_for_steps(run_dir, 2, proc)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err[-3000:]
    m = re.search(
        rf"stopped at step (\d+) after a signal \({sig.name}\): checkpoint (\S+); "
        r"rerun the same command to resume",
        err,
    )
    assert m and "Traceback" not in err, err[-3000:]
    assert (Path(m.group(2)) / ".complete").is_file()


# ------------------------------------------------------------------ the rendezvous
@pytest.mark.parametrize(
    ("sig", "rank"),
    [(signal.SIGINT, 0), (signal.SIGTERM, 1), (signal.SIGUSR2, 0)],
    ids=["SIGINT-rank0", "SIGTERM-rank1", "SIGUSR2-rank0"],
)
def test_a_signal_during_the_rendezvous_stops_the_rank_with_its_line(tmp_path, sig, rank):
    """One rank of two started, waiting in init_process_group for the other (rank 0 for
    its peer, rank 1 for a master that never comes): each stop signal ends it within
    seconds, with the stop line and 128 + the signal's number; rank 0 leaves no run dir."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run_dir = tmp_path / "run"
    env = dict(_env(tmp_path), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mta_repro.train", f"run_dir={run_dir}", *TINY, "distributed.timeout_min=5"],
        cwd=ROOT,
        env=dict(env, MASTER_PORT=str(port)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    where = f"the rendezvous of 2 ranks at 127.0.0.1:{port}"
    said = f"[mta_repro.train] rank {rank}: waiting for {where}"  # after 5 s of waiting
    seen = [proc.stderr.readline() for _ in range(1)]
    while seen[-1] and seen[-1].strip() != said and len(seen) < 50:
        seen.append(proc.stderr.readline())
    assert seen[-1].strip() == said, seen
    t0 = time.time()
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    took = time.time() - t0
    assert proc.returncode == 128 + sig, err[-3000:]
    assert took < 15, (took, err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    assert (
        f"train: stopped by {sig.name} during {where} (before the first step): nothing trained, "
        "nothing saved; rerun the same command to start"
    ) in err.splitlines(), err[-3000:]
    if rank == 0:
        assert not run_dir.exists()


# ------------------------------------------------------------------ host syncs
SYNCS = ("item", "tolist", "__bool__", "__float__", "__int__")


def _count_syncs(monkeypatch, events: list, state: dict) -> None:
    """Record (step, what) for every host read of a tensor made by the trainer or the model
    (mta_repro/train, mta_repro/model; AdamW's own CPU step counter is not a device read)
    and for every all-reduce."""
    import torch.distributed as dist

    from mta_repro.train import loop

    def from_ours(depth=2) -> bool:
        f = sys._getframe(depth)
        name = f.f_code.co_filename.replace(os.sep, "/")
        return "/mta_repro/train/" in name or "/mta_repro/model/" in name

    for name in SYNCS:
        orig = getattr(torch.Tensor, name)

        def patched(self, *a, _orig=orig, _name=name, **k):
            if from_ours():
                events.append((state["step"], _name))
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, patched)
    orig_ar = dist.all_reduce

    def all_reduce(*a, **k):
        events.append((state["step"], "all_reduce"))
        return orig_ar(*a, **k)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    orig_step = loop.train_step

    def counted_step(*a, **k):
        out = orig_step(*a, **k)
        state["step"] += 1
        return out

    monkeypatch.setattr(loop, "train_step", counted_step)


@pytest.mark.slow
def test_no_host_sync_between_logging_steps(tmp_path, monkeypatch):
    from mta_repro.train.loop import train

    events: list = []
    state = {"step": 0}
    _count_syncs(monkeypatch, events, state)
    out = train(
        compose([*TINY, f"run_dir={tmp_path / 'run'}", "trainer.steps=8", "logging.every=4", "checkpoint.every=8"])
    )
    assert out["step"] == 8 and out["loss"] == out["loss"]  # finite
    steps_with_reads = sorted({s for s, _ in events if s > 0})
    assert steps_with_reads == [4, 8], events
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [4, 8]


TWO_RANK_DRIVER = """
import json, os, sys
import pytest
from test_train_signals import _count_syncs, TINY
from mta_repro.train.config import compose
from mta_repro.train.loop import train

mp = pytest.MonkeyPatch()
events, state = [], {"step": 0}
_count_syncs(mp, events, state)
train(compose([*TINY, "run_dir=" + sys.argv[1], "trainer.steps=8", "logging.every=4", "checkpoint.every=8",
               "trainer.loader=batch_source:build"]))
out = os.path.join(sys.argv[1], "syncs_rank%s.json" % os.environ["RANK"])
json.dump(events, open(out, "w"))
"""


@pytest.mark.distributed
def test_two_ranks_agree_and_read_only_on_logging_steps(tmp_path):
    driver = tmp_path / "driver.py"
    driver.write_text(TWO_RANK_DRIVER)
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(driver),
        str(run_dir),
    ]
    p = subprocess.run(cmd, cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stderr[-4000:]
    for rank in (0, 1):
        events = json.loads((run_dir / f"syncs_rank{rank}.json").read_text())
        steps = sorted({s for s, _ in events if s > 0})
        assert steps == [4, 8], events
        # The agreement on a signal is an all-reduce at steps 0 and 4 (before the step).
        assert [s for s, what in events if what == "all_reduce" and s in (0, 4)]


def test_without_the_bar_a_step_line_comes_at_least_every_quiet_s(tmp_path):
    """logging.progress_bar=false (a Table 5 command's, a job's log): no line per logged step,
    but a step line whenever none came for logging.quiet_s seconds (default 60), so a long run
    is never silent; here 1 s, over 12 steps of 0.1 s and more, logged only at the end."""
    (tmp_path / "slow_loader.py").write_text(SLOW_LOADER)
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "mta_repro.train",
        f"run_dir={run_dir}",
        *TINY,
        "trainer.steps=30",
        "checkpoint.every=1000",
        "logging.every=100",
        "logging.quiet_s=1",
        "trainer.loader=slow_loader:build",
    ]
    p = subprocess.run(cmd, cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [line for line in p.stderr.splitlines() if line.startswith("[mta_repro.train] step ")]
    beats = [
        int(re.match(r"\[mta_repro.train\] step (\d+)/30 \((\d+\.\d) s a step", line).group(1))
        for line in lines
        if "s a step" in line
    ]
    assert len(beats) >= 2 and beats == sorted(set(beats)), lines  # 30 x >= 0.1 s = 3 s and more
    assert lines[-1].startswith("[mta_repro.train] step 30/30 | loss ")  # the last step, logged, with its loss
