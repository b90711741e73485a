"""A damaged latest checkpoint (a truncated .distcp, a missing file) is named with its file;
the trainer falls back to the previous complete checkpoint with a warning (or refuses with
checkpoint.on_corrupt=raise) and the resumed run is still exact; a truncated
consolidated.pt used as a stage start is named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from tiny_config import tiny_train

from mta_repro.train.checkpoint import CheckpointCorruptError, load_model_state, verify_checkpoint
from mta_repro.train.config import compose

COMMON = tiny_train(
    "trainer.steps=3",
    "checkpoint.every=1",
    "checkpoint.keep=3",
    "optim.lr=3e-3",
    "optim.warmup=1",
    omit=("checkpoint.export",),
)


def _train(run_dir, *overrides):
    from mta_repro.train.loop import train

    return train(compose([*COMMON, f"run_dir={run_dir}", *overrides]))


def _losses(run_dir):
    return {r["step"]: r["loss"] for r in map(json.loads, (Path(run_dir) / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("corrupt") / "run"
    _train(run_dir)
    return run_dir


def _truncate_latest(run: Path) -> Path:
    f = run / "checkpoints" / "0000000003" / "__0_0.distcp"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    return f


@pytest.mark.slow
def test_truncated_distcp_is_named_and_refused_with_on_corrupt_raise(base, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(base, run)
    _truncate_latest(run)
    assert "file __0_0.distcp is truncated" in verify_checkpoint(run / "checkpoints" / "0000000003")
    with pytest.raises(CheckpointCorruptError) as e:
        _train(run, "checkpoint.on_corrupt=raise")
    msg = str(e.value)
    assert "checkpoint" in msg and "0000000003" in msg and "__0_0.distcp is truncated" in msg
    assert "checkpoint.on_corrupt=fallback" in msg and "0000000002" in msg
    assert len(msg.splitlines()) == 1


@pytest.mark.slow
def test_truncated_distcp_falls_back_to_the_previous_and_resumes_exactly(base, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(base, run)
    _truncate_latest(run)
    from mta_repro.weights.read import FallbackWarning

    with pytest.warns(FallbackWarning, match=r"0000000003 is unreadable: file __0_0.distcp is truncated"):
        _train(run)
    err = capsys.readouterr().err
    assert "falling back to" in err and "resumed from" in err and "at step 2" in err
    # Said once: the line on stderr; the warning is a FallbackWarning, which Python's
    # warning display ignores by default (else the same text would print a second time).
    assert err.count("is unreadable") == 1
    import subprocess
    import sys

    shown = subprocess.run(
        [sys.executable, "-c", "from mta_repro.weights.read import notice; notice('x is bad')"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stderr
    assert shown == "[mta_repro] WARNING: x is bad\n"  # a fresh process shows the notice once
    ckpts = run / "checkpoints"
    assert (ckpts / "corrupt-0000000003").is_dir()  # kept for inspection, no longer counted
    assert (ckpts / "0000000003" / ".complete").is_file() and verify_checkpoint(ckpts / "0000000003") is None
    assert _losses(run) == _losses(base)  # step 3 trained again, the same loss


def test_missing_file_and_init_from_fall_back(base, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(base, run)
    (run / "checkpoints" / "0000000003" / "__0_0.distcp").unlink()
    assert verify_checkpoint(run / "checkpoints" / "0000000003") == "file __0_0.distcp is missing"
    shutil.rmtree(run / "export")
    # A stage start from this run dir takes the newest readable checkpoint, with a warning.
    with pytest.warns(UserWarning, match="0000000003 is unreadable"):
        _, step = load_model_state(run)
    assert step == 2


def test_truncated_consolidated_pt_is_named(base, tmp_path):
    pt = tmp_path / "consolidated.pt"
    data = (base / "export" / "consolidated.pt").read_bytes()
    pt.write_bytes(data[: len(data) // 3])
    with pytest.raises(CheckpointCorruptError, match=rf"{pt} is unreadable .*truncated or corrupt"):
        load_model_state(pt)
    good = load_model_state(base / "export" / "consolidated.pt")[0]
    assert all(torch.equal(v, good[k]) for k, v in load_model_state(base)[0].items())


@pytest.mark.parametrize("async_save", [False, True])
def test_save_hook_sees_each_save_before_it_is_complete(tmp_path, monkeypatch, async_save):
    """checkpoint.save_hook (where the kill tests inject their faults): called at
    "written" with the temporary folder holding the step's files and no completion marker
    yet, and, for an async save, at "async_writing" first; the run's numbers are those of
    a run without the hook."""
    import sys
    import types

    seen = []

    def hook(event, step, path):
        seen.append((event, step, path.name, path.is_dir(), (path / ".complete").exists()))

    mod = types.ModuleType("save_hook_recorder")
    mod.record = hook
    monkeypatch.setitem(sys.modules, "save_hook_recorder", mod)
    run = tmp_path / "run"
    _train(run, "checkpoint.save_hook=save_hook_recorder:record", f"checkpoint.async_save={str(async_save).lower()}")
    written = [s for s in seen if s[0] == "written"]
    assert [s[1] for s in written] == [1, 2, 3]
    assert all(name == f".tmp-{step:010d}" and is_dir and not complete for _, step, name, is_dir, complete in written)
    if async_save:
        assert [s[1] for s in seen if s[0] == "async_writing"] == [1, 2, 3]
        order = [(e, st) for e, st, *_ in seen]
        assert all(order.index(("async_writing", k)) < order.index(("written", k)) for k in (1, 2, 3))
    else:
        assert len(seen) == 3
    ref = tmp_path / "ref"
    _train(ref)
    assert _losses(run) == _losses(ref)


def test_a_bad_save_hook_is_one_line(tmp_path):
    from mta_repro.errors import UserError

    with pytest.raises(UserError, match=r"^checkpoint.save_hook: cannot import 'no_such_module:fn'"):
        _train(tmp_path / "run", "checkpoint.save_hook=no_such_module:fn")
    with pytest.raises(UserError, match=r"^checkpoint.save_hook: expected 'module:function', got 'fn'"):
        _train(tmp_path / "run2", "checkpoint.save_hook=fn")
