"""Resume on another world size: a 2-rank run (torchrun, gloo, FSDP2) killed at step 4
resumes from its step-2 checkpoint in 1 process; the model and optimiser reshard through
DCP, the data continues at the same global position, and trainer.grad_accum=2 keeps the
global batch, so the losses equal an uninterrupted 1-process run's (float rounding of
the reduction order only, as in test_train_distributed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_config import tiny_train

from mta_repro.train.config import compose

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
TOL = 1e-5
COMMON = tiny_train(
    "data.seed=3",
    "trainer.steps=6",
    "trainer.loader=batch_source:build",
    "checkpoint.every=2",
    "optim.lr=3e-3",
    "optim.warmup=2",
    omit=("data.batch_size", "data.shuffle_buffer"),
)


def _losses(run_dir):
    return {r["step"]: r["loss"] for r in map(json.loads, (Path(run_dir) / "metrics.jsonl").read_text().splitlines())}


def test_two_ranks_resume_on_one_with_grad_accum(tmp_path, monkeypatch, capsys):
    from mta_repro.runs.runlock import RunDirError
    from mta_repro.train.loop import train

    monkeypatch.syspath_prepend(str(HERE))  # batch_source
    run = tmp_path / "run"
    faults = ROOT / "tests" / "fixtures" / "faults"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE), str(faults)]))
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "mta_repro.train",
            f"run_dir={run}",
            *COMMON,
            "data.batch_size=2",
            "checkpoint.save_hook=faults:kill_in_save_4",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert p.returncode != 0  # killed in the save of step 4
    assert (run / "checkpoints" / "0000000002" / ".complete").is_file()
    assert not (run / "checkpoints" / "0000000004").exists()

    # 1 rank with the same per-rank batch would halve the global batch: refused, with the fix.
    with pytest.raises(RunDirError, match=r"global batch was 4 sequences .*set trainer.grad_accum=2"):
        train(compose([f"run_dir={run}", *COMMON, "data.batch_size=2"]))
    train(compose([f"run_dir={run}", *COMMON, "data.batch_size=2", "trainer.grad_accum=2"]))
    assert "resuming a 2-rank checkpoint on 1 ranks" in capsys.readouterr().err

    ref = tmp_path / "ref"
    train(compose([f"run_dir={ref}", *COMMON, "data.batch_size=4"]))
    a, b = _losses(ref), _losses(run)
    assert sorted(b) == list(range(1, 7))
    diffs = {s: abs(a[s] - b[s]) for s in a}
    print("max |loss 1 rank - loss 2->1 ranks| =", max(diffs.values()))
    assert all(d <= TOL for d in diffs.values()), diffs
