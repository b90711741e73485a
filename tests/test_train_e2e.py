"""The trainer as users run it: real `python -m mta_repro.train` processes on the tiny
model and the bundled corpus (data=mini, seq 32, batch 2), single rank on CPU.

- interrupted by SIGUSR2 / SIGTERM and restarted == uninterrupted, loss for loss;
- a save SIGKILLed midway leaves the previous checkpoint as the one resumed;
- the long-context and MTA-insertion stages start from that run's weights: their first
  loss equals the loss of the source weights on the same batch, computed here
  independently from the exported file with a plain (unsharded) model.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tiny_config import tiny_train

from mta_repro.train.config import compose

pytestmark = [pytest.mark.slow, pytest.mark.pipeline]

ROOT = Path(__file__).resolve().parents[1]
STEPS = 8
COMMON = tiny_train(
    "data.shuffle_buffer=8",
    f"trainer.steps={STEPS}",
    "checkpoint.every=2",
    "checkpoint.keep=2",
    "optim.lr=3e-3",
    "optim.warmup=2",
    # Validation runs at the last step (the default); one batch per domain keeps it quick.
    "trainer.eval_max_batches=1",
    omit=("trainer.eval_every", "checkpoint.export"),
)


FAULTS = Path(__file__).parent / "fixtures" / "faults"  # checkpoint.save_hook=faults:<name>


def _env(extra=None):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), str(FAULTS)]))
    env.update(extra or {})
    return env


def _cmd(run_dir, *overrides):
    return [sys.executable, "-m", "mta_repro.train", f"run_dir={run_dir}", *COMMON, *overrides]


def _run(run_dir, *overrides, env=None, check=True):
    p = subprocess.run(_cmd(run_dir, *overrides), cwd=ROOT, env=_env(env), capture_output=True, text=True, timeout=300)
    if check and p.returncode != 0:
        raise AssertionError(f"trainer failed ({p.returncode}):\n{p.stderr[-4000:]}")
    return p


def _train_here(run_dir, *overrides):
    """The same run in this process (no interpreter start-up): train(compose(...))."""
    from mta_repro.train.loop import train

    return train(compose([*COMMON, f"run_dir={run_dir}", *overrides]))


def _metrics(run_dir) -> dict[int, dict]:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(l) for l in lines]
    steps = [r["step"] for r in rows]
    assert steps == sorted(set(steps)), f"steps logged twice or out of order: {steps}"
    return {r["step"]: r for r in rows}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run (also the source of the stage tests)."""
    run_dir = tmp_path_factory.mktemp("ref")
    _run(run_dir)
    return run_dir


def test_uninterrupted_run_layout(reference):
    m = _metrics(reference)
    assert sorted(m) == list(range(1, STEPS + 1))
    for row in m.values():
        for key in (
            "step",
            "loss",
            "loss_last",
            "lr",
            "grad_norm",
            "tokens_per_s_global",
            "tokens_per_s_per_gpu",
            "peak_mem_gb",
            "mfu",
        ):
            assert key in row
        assert row["mfu"] is None  # CPU: unknown peak
    # Warmup from 0 then linear decay to 0 (lr logged is the one the update used).
    assert m[1]["lr"] == 0.0 and m[3]["lr"] == pytest.approx(3e-3)
    assert m[STEPS]["lr"] == pytest.approx(3e-3 * (1 - 5 / 6))
    ckpts = sorted(p.name for p in (reference / "checkpoints").iterdir())
    assert ckpts == ["0000000006", "0000000008"]  # keep=2
    assert all((reference / "checkpoints" / c / ".complete").is_file() for c in ckpts)
    blob = torch.load(reference / "export" / "consolidated.pt", weights_only=False)
    assert blob["step"] == STEPS and blob["config"]["run_dir"] == str(reference)
    assert "layers.0.attention.wq.weight" in blob["model"]
    assert all(v.dtype == torch.float32 for v in blob["model"].values())
    assert (reference / "config.yaml").is_file()


@pytest.mark.parametrize("sig", [signal.SIGUSR2, signal.SIGTERM])
def test_signal_then_resume_matches_uninterrupted(reference, tmp_path, sig):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        _cmd(run_dir), cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 3:
            proc.send_signal(sig)
            break
        time.sleep(0.02)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 128 + sig, err[-3000:]  # stopped, saved, unfinished (docs/errors_and_signals.md)
    stopped = max(_metrics(run_dir))
    assert 3 <= stopped < STEPS, f"the signal did not stop the run early (stopped at {stopped})"
    assert (run_dir / "checkpoints" / f"{stopped:010d}" / ".complete").is_file()
    assert not (run_dir / "export").exists()  # an interrupted run exports nothing

    p = _run(run_dir)
    assert "resumed from" in p.stderr and f"at step {stopped}" in p.stderr
    ref, got = _metrics(reference), _metrics(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert got[step]["loss"] == ref[step]["loss"], (step, got[step]["loss"], ref[step]["loss"])
        assert got[step]["lr"] == ref[step]["lr"]


def test_killed_save_resumes_previous_checkpoint(reference, tmp_path):
    run_dir = tmp_path / "run"
    # SIGKILL inside the save of step 6, after its DCP files are written.
    p = _run(run_dir, "checkpoint.save_hook=faults:kill_in_save_6", check=False)
    assert p.returncode == -signal.SIGKILL
    ckpt = run_dir / "checkpoints"
    assert (ckpt / ".tmp-0000000006").is_dir()  # the torn save is there ...
    assert not (ckpt / "0000000006").exists()  # ... but never looks complete
    assert (ckpt / "0000000004" / ".complete").is_file()

    p = _run(run_dir)
    assert "at step 4" in p.stderr
    assert not (ckpt / ".tmp-0000000006").exists()
    ref, got = _metrics(reference), _metrics(run_dir)  # steps 5, 6 logged once
    assert [got[s]["loss"] for s in range(1, STEPS + 1)] == [ref[s]["loss"] for s in range(1, STEPS + 1)]


@pytest.mark.parametrize("fault", ["kill_in_async_save_6", "kill_in_save_6"])
def test_async_save_killed_midway_resumes_previous_checkpoint(reference, tmp_path, fault):
    """checkpoint.async_save: the loop goes on while a thread writes; killed while the
    step-6 files are being written (or after, before it is marked complete), the run
    resumes from step 4 and matches the uninterrupted (synchronous) run loss for loss."""
    run_dir = tmp_path / "run"
    p = _run(run_dir, "checkpoint.async_save=true", f"checkpoint.save_hook=faults:{fault}", check=False)
    assert p.returncode == -signal.SIGKILL
    ckpt = run_dir / "checkpoints"
    assert not (ckpt / "0000000006").exists()
    assert (ckpt / "0000000004" / ".complete").is_file()
    if fault.startswith("kill_in_async"):
        tmp = ckpt / ".tmp-0000000006"
        assert tmp.is_dir() and not (tmp / ".complete").exists()
    p = _run(run_dir, "checkpoint.async_save=true")
    assert "at step 4" in p.stderr
    ref, got = _metrics(reference), _metrics(run_dir)
    assert [got[s]["loss"] for s in range(1, STEPS + 1)] == [ref[s]["loss"] for s in range(1, STEPS + 1)]
    assert sorted(q.name for q in ckpt.iterdir()) == ["0000000006", "0000000008"]  # keep=2, all complete
    assert all((ckpt / c / ".complete").is_file() for c in ("0000000006", "0000000008"))
    blob = torch.load(run_dir / "export" / "consolidated.pt", weights_only=False)
    ref_blob = torch.load(reference / "export" / "consolidated.pt", weights_only=False)
    assert all(torch.equal(v, ref_blob["model"][k]) for k, v in blob["model"].items())


def _first_batch(overrides):
    from mta_repro.data import build_train_loader

    cfg = compose([*COMMON, *overrides])
    loader = build_train_loader(cfg.data, 0, 1)
    batch = next(loader)
    if hasattr(loader, "close"):
        loader.close()
    return batch


def _loss_of(state_dict, model_overrides, batch):
    """CE of given weights on a batch with a plain fp32 model (no FSDP, no trainer)."""
    from mta_repro.model import build_model
    from mta_repro.train.config import model_args_from

    model = build_model(model_args_from(compose(model_overrides)), device="cpu", init=False)
    model.load_state_dict(state_dict)
    with torch.no_grad():
        logits = model(batch["input"])
    return F.cross_entropy(logits.flatten(0, 1).double(), batch["target"].flatten(0, 1)).item()


def test_long_context_stage_starts_from_source_weights(reference, tmp_path):
    src = torch.load(reference / "export" / "consolidated.pt", weights_only=False)["model"]
    stage = ["model.rope_theta=500000", "data.seq_len=64", "optim.weight_decay=0", "optim.warmup=50"]
    run_dir = tmp_path / "lc"
    _train_here(run_dir, f"checkpoint.init_from={reference}", "checkpoint.init_mode=model", "trainer.steps=1", *stage)
    first = _metrics(run_dir)[1]
    expected = _loss_of(src, ["model.rope_theta=500000"], _first_batch(stage))
    assert first["loss"] == pytest.approx(expected, rel=1e-5, abs=1e-5)
    assert first["lr"] == 0.0  # fresh optimizer and schedule: warmup from 0
    # Far below a fresh model's ~ln(8192) = 9.0: the weights really were loaded.
    assert first["loss"] < _metrics(reference)[1]["loss"] - 0.5


def test_mta_insertion_first_loss_equals_baseline(reference, tmp_path):
    src = torch.load(reference / "export" / "consolidated.pt", weights_only=False)["model"]
    mta = ["attention=mta", "model.mta.group_norm=false", "model.mta.add_gating=false"]
    run_dir = tmp_path / "ins"
    _train_here(
        run_dir, f"checkpoint.init_from={reference}", "checkpoint.init_mode=baseline_to_mta", "trainer.steps=2", *mta
    )
    got = _metrics(run_dir)
    baseline_loss = _loss_of(src, [], _first_batch([]))
    assert got[1]["loss"] == pytest.approx(baseline_loss, rel=1e-5, abs=1e-5)
    # The MTA model was trained (its export has the MTA parameters).
    blob = torch.load(run_dir / "export" / "consolidated.pt", weights_only=False)
    assert "layers.1.attention.mta_kernel" in blob["model"] and blob["step"] == 2


def test_nonfinite_loss_stops_with_clear_error_or_skips(reference, tmp_path):
    blob = torch.load(reference / "export" / "consolidated.pt", weights_only=False)
    blob["model"]["norm.weight"][0] = float("nan")  # every loss is NaN from step 1 on
    bad = tmp_path / "nan.pt"
    torch.save(blob, bad)
    run_dir = tmp_path / "nan"
    from mta_repro.train.loop import NonFiniteLossError

    with pytest.raises(
        NonFiniteLossError,
        match=r"non-finite loss nan .* at step 1; the last good checkpoint is none.*trainer.nonfinite=skip",
    ):
        _train_here(run_dir, f"checkpoint.init_from={bad}", "trainer.steps=2")
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())

    run_dir = tmp_path / "skip"
    _train_here(
        run_dir, f"checkpoint.init_from={bad}", "trainer.steps=2", "trainer.nonfinite=skip", "checkpoint.export=false"
    )
    rows = _metrics(run_dir)
    assert rows[1]["skipped"] and rows[2]["skipped"] and math.isnan(rows[2]["loss"])


def test_activation_checkpointing_changes_nothing(reference, tmp_path):
    """AC recomputes each block in backward: the same losses, step for step."""
    run_dir = tmp_path / "ac"
    _train_here(run_dir, "distributed.activation_checkpointing=true", "trainer.steps=3", "checkpoint.export=false")
    ref, got = _metrics(reference), _metrics(run_dir)
    for s in (1, 2, 3):
        assert got[s]["loss"] == pytest.approx(ref[s]["loss"], abs=1e-6)
    # Checkpoint keys stay Lingua's (no wrapper prefix).
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(str(run_dir / "checkpoints" / "0000000002")).read_metadata()
    keys = [k for k in meta.state_dict_metadata if k.startswith("model.")]
    assert "model.layers.0.attention.wq.weight" in keys and not any("_checkpoint_wrapped" in k for k in keys)
