"""Every phase of a training run answers a stop signal within seconds, in real processes.

- The loader's warm-up (the shuffle buffer's first fill, here slowed to seconds a document
  by a tokenizer that sleeps): SIGINT, SIGTERM and SIGUSR2 each stop the run at the next
  document, before its first step, with one line saying that nothing was trained or saved,
  exit 128 + the signal's number and no run directory left behind; a second Ctrl-C during a
  document that takes a minute stops at once (``train: interrupted``, 130).
- A long validation (the whole validation split in 16-token windows, minutes of forward
  passes): each signal ends it at the next batch; the run saves the step it reached and
  exits 128 + the signal's number, its metrics line for that step without validation numbers.
- ``python -m mta_repro.eval`` during a long perplexity evaluation stops on each signal,
  Ctrl-C too when it was started with SIGINT ignored (in the background).

Each bound is generous (the machine is shared); the interrupted work would take minutes.
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

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
BOUND_S = 45  # from the signal to the exit; the work it interrupts takes minutes
SIGNALS = [signal.SIGINT, signal.SIGTERM, signal.SIGUSR2]
TINY = [
    "trainer.device=cpu",
    "checkpoint.export=false",
    "logging.wandb_mode=disabled",
    "logging.progress_bar=false",
    "optim.lr=3e-3",
    "optim.warmup=1",
    "data.batch_size=2",
]

SLOW_TOKENIZER = '''
import os
import time
from pathlib import Path

from mta_repro.data import build_train_loader


class _Slow:
    """The loader's tokenizer, DELAY seconds a document (its reading ahead: the warm-up)."""

    def __init__(self, tok, delay, marker):
        self.tok, self.delay, self.marker = tok, delay, marker

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def encode(self, *a, **k):
        Path(self.marker).touch()  # the warm-up has begun
        time.sleep(self.delay)
        return self.tok.encode(*a, **k)


def build(data_args, rank, world_size):
    loader = build_train_loader(data_args, rank, world_size)  # its window check reads at full speed
    loader.tokenizer = _Slow(loader.tokenizer, float(os.environ["SLOW_DOC_S"]), os.environ["WARMUP_MARKER"])
    return loader
'''


def _env(tmp_path, **extra):
    path = os.pathsep.join([str(ROOT), str(tmp_path)])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path, **extra)
    env.pop("MTA_REPRO_TRACEBACK", None)
    return env


def _wait_for(cond, proc, what, timeout=180):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return
        if proc.poll() is not None:
            raise AssertionError(f"exited ({proc.returncode}) before {what}:\n{proc.communicate()[1][-3000:]}")
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"never reached {what}")


def _stop(proc, *signals, gap=0.5):
    """Send the signals (``gap`` s apart); (seconds from the first to the exit, stderr)."""
    t0 = time.time()
    for i, sig in enumerate(signals):
        if i:
            time.sleep(gap)
        proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=BOUND_S + 60)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"still running {BOUND_S + 60} s after {signals}:\n{err[-3000:]}") from None
    return time.time() - t0, err


def _start_warm_up(tmp_path, delay):
    (tmp_path / "slow_tokenizer.py").write_text(SLOW_TOKENIZER)
    run_dir, marker = tmp_path / "run", tmp_path / "warming_up"
    # 1000 windows of 129 tokens to fill: ~80 documents of the bundled corpus, minutes at `delay`
    cmd = [
        sys.executable,
        "-m",
        "mta_repro.train",
        f"run_dir={run_dir}",
        *TINY,
        "data.seq_len=128",
        "data.shuffle_buffer=1000",
        "trainer.steps=5",
        "trainer.eval_every=0",
        "trainer.loader=slow_tokenizer:build",
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=_env(tmp_path, SLOW_DOC_S=str(delay), WARMUP_MARKER=str(marker)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _wait_for(marker.exists, proc, "the loader's warm-up")
    return proc, run_dir


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: s.name)
def test_a_signal_during_the_loader_warm_up_stops_before_the_first_step(tmp_path, sig):
    proc, run_dir = _start_warm_up(tmp_path, delay=2.0)
    took, err = _stop(proc, sig)
    assert proc.returncode == 128 + sig, err[-3000:]
    assert took < BOUND_S, (took, err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    assert re.search(
        rf"train: stopped by {sig.name} during the data loader's warm-up \(before the first step\): "
        r"nothing trained, nothing saved; rerun the same command to start",
        err,
    ), err[-3000:]
    assert not run_dir.exists()  # a fresh run that trained nothing leaves no run directory


def test_a_second_ctrl_c_stops_at_once_inside_a_long_document(tmp_path):
    # One document takes a minute: the first Ctrl-C waits for it, the second does not.
    proc, _ = _start_warm_up(tmp_path, delay=60.0)
    took, err = _stop(proc, signal.SIGINT, signal.SIGINT, gap=1.0)
    assert proc.returncode == 130, err[-3000:]
    assert took < BOUND_S, (took, err[-3000:])
    assert "train: interrupted" in err and "Traceback" not in err, err[-3000:]


def _validation_run(tmp_path):
    """Training that validates at step 2 over the whole validation split in 16-token windows,
    one window a batch (~11,000 forward passes: minutes); metrics every step."""
    return [
        "data.seq_len=16",
        "data.shuffle_buffer=4",
        "trainer.steps=4",
        "trainer.eval_every=2",
        "trainer.eval_batch_size=1",
        "trainer.eval_max_batches=100000",
        "logging.every=1",
        "checkpoint.every=100",
    ]


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: s.name)
def test_a_signal_during_a_long_validation_stops_at_the_step_boundary(tmp_path, sig):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "mta_repro.train", f"run_dir={run_dir}", *TINY, *_validation_run(tmp_path)]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    metrics = run_dir / "metrics.jsonl"
    _wait_for(lambda: metrics.is_file() and metrics.read_text().count("\n") >= 1, proc, "step 1")
    time.sleep(5)  # step 2 takes a fraction of a second; its validation minutes
    took, err = _stop(proc, sig)
    assert proc.returncode == 128 + sig, err[-3000:]
    assert took < BOUND_S, (took, err[-3000:])
    m = re.search(
        rf"stopped at step 2 after a signal \({sig.name}\): checkpoint (\S+); rerun the same command "
        "to resume",
        err,
    )
    assert m and "Traceback" not in err, err[-3000:]
    assert (Path(m.group(1)) / ".complete").is_file()
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert "val_loss" not in rows[1]  # the validation was cut short, not finished


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stop_eval")
    run_dir = tmp / "run"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "mta_repro.train",
            f"run_dir={run_dir}",
            *TINY,
            "data.seq_len=16",
            "data.shuffle_buffer=4",
            "trainer.steps=2",
            "trainer.eval_every=0",
            "checkpoint.export=true",
        ],
        cwd=ROOT,
        env=_env(tmp),
        check=True,
        capture_output=True,
        timeout=300,
    )
    return run_dir


def _ignore_sigint():
    """What a shell does to a command it starts in the background (``cmd &``, ``nohup``
    from a script): SIGINT ignored, inherited across exec."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


# Each signal, and Ctrl-C to an eval started with SIGINT ignored (a suite run in the background).
EVAL_CASES = [pytest.param(s, False, id=s.name) for s in SIGNALS] + [
    pytest.param(signal.SIGINT, True, id="SIGINT-inherited-ignored")
]


@pytest.mark.parametrize(("sig", "ignored"), EVAL_CASES)
def test_a_signal_during_a_long_evaluation_stops_it(trained, tmp_path, sig, ignored):
    out = tmp_path / "eval"
    cmd = [
        sys.executable,
        "-m",
        "mta_repro.eval",
        str(trained),
        "tasks=[ppl]",
        "ppl.batch_size=1",
        "ppl.max_batches=100000",
        f"out_dir={out}",
        "device=cpu",
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_ignore_sigint if ignored else None,
    )
    buf = []

    def started():  # "eval: ppl on <run>" is logged when the task starts
        import select

        while select.select([proc.stderr], [], [], 0)[0]:
            line = proc.stderr.readline()
            if not line:
                break
            buf.append(line)
        return any("eval: ppl on" in line for line in buf)

    _wait_for(started, proc, "the perplexity evaluation")
    time.sleep(3)
    took, err = _stop(proc, sig)
    err = "".join(buf) + err
    assert proc.returncode in (128 + sig, -sig), err[-3000:]  # Ctrl-C: "eval: interrupted", 130
    assert took < BOUND_S, (took, err[-3000:])
    assert not (out / "ppl.json").exists()  # nothing half-written
    if sig == signal.SIGINT:
        assert "eval: interrupted" in err and "Traceback" not in err, err[-3000:]
