"""Reading a file from elsewhere never runs its code (docs/trust.md), and one module owns it.

A crafted ``.pt`` (and a crafted DCP checkpoint) whose unpickling would create a marker
file is fed to every entry point that reads weights: eval of the ``.pt``, eval and HF
export of a run dir whose export it is, generate, ``checkpoint.init_from`` with the ``.pt``
and with a Lingua-style ``consolidated/`` folder holding it as ``consolidated.pth``, the
pipeline's finished-job check, and resuming a checkpoint whose run-state is a pickle. Each
refuses with one line naming the file (exit code 2 for a CLI); the marker never appears.
The control shows the same file *does* create the marker when unpickled unsafely.

Structure: ``torch.load``/``pickle.load``/``dcp.load``/DCP's metadata reader appear only in
``mta_repro/weights/safe.py``, safetensors' readers only in ``mta_repro/weights/safetensors_file.py``
(after the header is checked); nothing under ``mta_repro/train`` or ``mta_repro/eval``
imports the release converter (``mta_repro.release``).
"""

from __future__ import annotations

import ast
import io
import os
import pickle
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from eval_helpers import make_run

from mta_repro.errors import CorruptFileError, UnsafeFileError
from mta_repro.weights import find_weights, load_weights

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "mta_repro"


class _Touch:
    """Unpickling this calls ``open(marker, "w")``: the file appears if code ran."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _crafted(path: Path, marker: Path, sd=None, config=None) -> Path:
    """A consolidated-looking .pt that runs code when unpickled unsafely."""
    blob = {"model": sd or {"tok_embeddings.weight": torch.zeros(2, 2)}, "step": 7, "hook": _Touch(marker)}
    if config is not None:
        blob["config"] = config
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(blob, path)
    return path


@pytest.fixture()
def evil(tmp_path):
    marker = tmp_path / "PWNED"
    run_dir, ref = make_run(tmp_path / "run", attention="baseline")
    good = run_dir / "export" / "consolidated.pt"
    blob = torch.load(good, weights_only=True)
    pt = _crafted(tmp_path / "evil.pt", marker, blob["model"], blob["config"])
    shutil.copyfile(pt, good)  # the run's own export is the crafted file
    yield pt, run_dir, marker
    assert not marker.exists(), "unpickling ran code"


def _one_line(err: str, *expected: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err[-2000:]
    for e in expected:
        assert e in lines[0], lines[0]
    return lines[0]


def test_control_the_crafted_file_runs_code_when_unpickled_unsafely(tmp_path):
    marker = tmp_path / "PWNED"
    pt = _crafted(tmp_path / "evil.pt", marker)
    torch.load(pt, weights_only=False)  # what the project must never do
    assert marker.exists()


def test_library_entry_points_refuse(evil, tmp_path):
    pt, run_dir, marker = evil
    for path in (pt, run_dir):
        with pytest.raises(
            UnsafeFileError,
            match=rf"{re.escape(str(pt if path == pt else run_dir / 'export'))}.*"
            r"not a plain weights file.*io.open.*refusing to unpickle",
        ):
            load_weights(path)
    from mta_repro.train.checkpoint import load_init_weights

    # init_from: the .pt, and a Lingua/release consolidated/ folder (and its step folder) holding it
    step = tmp_path / "dump" / "checkpoints" / "0000000010"
    (step / "consolidated").mkdir(parents=True)
    shutil.copyfile(pt, step / "consolidated" / "consolidated.pth")
    for src in (pt, step / "consolidated", step):
        with pytest.raises(UnsafeFileError, match="consolidated.pth|evil.pt"):
            load_init_weights(src)
    from mta_repro.pipeline.done import finished_checkpoint

    with pytest.raises(UnsafeFileError, match="refusing to unpickle"):
        finished_checkpoint(run_dir, 7)


def test_init_from_in_training_refuses(evil, tmp_path):
    pt, _, marker = evil
    from mta_repro.train.config import compose
    from mta_repro.train.loop import train

    cons = tmp_path / "ck" / "consolidated"
    cons.mkdir(parents=True)
    shutil.copyfile(pt, cons / "consolidated.pth")
    for src in (pt, cons):
        cfg = compose(
            [
                "model=tiny",
                "attention=baseline",
                "trainer.steps=1",
                "trainer.device=cpu",
                "logging.wandb_mode=disabled",
                "logging.progress_bar=false",
                "data.seq_len=32",
                f"run_dir={tmp_path / 'train'}",
                f"checkpoint.init_from={src}",
            ]
        )
        with pytest.raises(UnsafeFileError, match="refusing to unpickle"):
            train(cfg)


def test_clis_refuse_with_one_line_and_exit_2(evil, tmp_path, capsys):
    pt, run_dir, marker = evil
    from mta_repro.eval.generate import main as generate_main
    from mta_repro.eval.run import main as eval_main
    from mta_repro.hf.cli import main as hf_main

    for path in (pt, run_dir):
        assert eval_main([str(path), "tasks=[ppl]"]) == 2
        _one_line(capsys.readouterr().err, "refusing to unpickle", "io.open")
    assert generate_main([str(pt), "--prompt", "a", "--max-new-tokens", "1"]) == 2
    _one_line(capsys.readouterr().err, str(pt), "refusing to unpickle")
    assert hf_main(["export", str(run_dir), str(tmp_path / "hf")]) == 2
    _one_line(capsys.readouterr().err, str(run_dir / "export" / "consolidated.pt"), "refusing to unpickle")


@pytest.mark.slow
def test_eval_pipeline_and_train_processes_refuse(evil, tmp_path):
    """As a user runs them: separate processes (the pipeline's finished check reads the export;
    the trainer's init_from)."""
    pt, run_dir, marker = evil
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    r = subprocess.run(
        [sys.executable, "-m", "mta_repro.eval", str(pt), "tasks=[ppl]"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert r.returncode == 2
    _one_line(r.stderr, str(pt), "refusing to unpickle")
    root = tmp_path / "runs"
    _crafted(root / "pretrain" / "baseline" / "export" / "consolidated.pt", marker)
    r = subprocess.run(
        [sys.executable, "-m", "mta_repro.pipeline", "pipeline=tiny", f"root={root}", "--dry-run"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    _one_line(r.stderr, "pretrain/baseline/export/consolidated.pt", "refusing to unpickle")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mta_repro.train",
            "model=tiny",
            "attention=baseline",
            "trainer.steps=1",
            "trainer.device=cpu",
            "logging.wandb_mode=disabled",
            f"run_dir={tmp_path / 'train'}",
            f"checkpoint.init_from={pt}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    _one_line(r.stderr, "train: error:", str(pt), "refusing to unpickle")
    assert not (tmp_path / "train").exists()  # a refused start leaves no run dir


def test_a_damaged_pickle_is_corrupt_not_unsafe(tmp_path):
    """Garbage bytes where the pickle should be: damage (the caller may fall back), not a refusal."""
    import zipfile

    buf = io.BytesIO()
    torch.save({"model": {}, "step": 1}, buf)
    src = zipfile.ZipFile(buf)
    bad = tmp_path / "damaged.pt"
    with zipfile.ZipFile(bad, "w", zipfile.ZIP_STORED) as z:
        for name in src.namelist():
            z.writestr(name, b"\x80\x02" + b"\x00" * 8 if name.endswith("data.pkl") else src.read(name))
    with pytest.raises(CorruptFileError, match=f"{bad} is unreadable .damaged pickle data.; the file is truncated"):
        load_weights(bad)


def test_crafted_dcp_metadata_and_entries_are_refused(tmp_path):
    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "PWNED"
    run_dir, ref = make_run(tmp_path / "run", attention="baseline", fmt="dcp")
    ck = run_dir / "checkpoints" / "0000000007"
    assert load_weights(run_dir).step == 7  # the real one reads
    # .metadata is a pickle: a crafted one is refused before DCP sees it
    meta = (ck / ".metadata").read_bytes()
    (ck / ".metadata").write_bytes(pickle.dumps(_Touch(marker)))
    with pytest.raises(UnsafeFileError, match=r"\.metadata: not a plain DCP metadata file.*open"):
        find_weights(run_dir)
    # data files named outside the folder are not read either
    md = pickle.loads(meta)  # the real metadata, ours: only to build the crafted variant
    info = next(iter(md.storage_data.values()))
    info.relative_path = "../../elsewhere.distcp"
    (ck / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(UnsafeFileError, match="outside its folder"):
        load_weights(ck)
    (ck / ".metadata").write_bytes(meta)
    # a non-tensor entry ("step") that would run code when read
    bad = run_dir / "checkpoints" / "0000000009"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": ref.state_dict(), "step": _Touch(tmp_path / "saved")}, checkpoint_id=str(bad))
    (bad / ".complete").touch()
    with pytest.raises(UnsafeFileError, match="entry 'step' would unpickle"):
        load_weights(run_dir)
    assert not marker.exists() and not (tmp_path / "saved").exists()


def test_resume_refuses_pickled_run_state_and_round_trips_the_plain_one(tmp_path):
    import random

    import numpy as np
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from mta_repro.model import build_model
    from mta_repro.model.args import ModelArgs
    from mta_repro.train.checkpoint import CheckpointManager
    from mta_repro.train.state import TrainState

    torch.manual_seed(0)
    model = build_model(ModelArgs(dim=32, n_layers=1, n_heads=2, vocab_size=64, multiple_of=16), device="cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    opt.step()
    sched.step()
    mgr = CheckpointManager(tmp_path / "run", keep=3, rank=0, world_size=1)
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    path = mgr.save(TrainState(model, opt, sched, step=1))
    expect = (random.random(), np.random.rand(), torch.rand(1))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    assert mgr.load(path, TrainState(model, opt, sched)) == 1
    assert (random.random(), np.random.rand(), torch.rand(1)) == expect  # the RNG state came back exactly

    marker = tmp_path / "PWNED"
    model_sd, optim_sd = get_state_dict(model, opt)
    for entry in ("scheduler", "rank0"):
        evil = tmp_path / "evil" / entry / "0000000001"
        blob = io.BytesIO()
        torch.save(_Touch(marker), blob)
        state = {
            "model": model_sd,
            "optim": optim_sd,
            "scheduler": blob.getvalue(),
            "step": 1,
            "rank0": pickle.dumps(_Touch(marker)),
        }  # a raw pickle, as older versions wrote run-state
        if entry == "rank0":  # a good scheduler entry, so the per-rank one is what is refused
            state["scheduler"] = _plain(sched.state_dict())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(state, checkpoint_id=str(evil))
        with pytest.raises(UnsafeFileError, match=f"{entry}.*refusing to unpickle"):
            mgr.load(evil, TrainState(model, opt, sched))
    assert not marker.exists()


def _plain(obj) -> bytes:
    from mta_repro.weights.safe import encode_state

    return encode_state(obj)


@pytest.mark.filterwarnings("ignore:.* is unreadable")
def test_eval_names_a_corrupt_checkpoint_and_its_fallback_in_one_line(tmp_path, capsys):
    """Eval names the damaged file in one line, not torch's zip error or DCP's flattened
    CheckpointException."""
    run_dir, ref = make_run(tmp_path / "run", attention="baseline", fmt="dcp")
    import torch.distributed.checkpoint as dcp

    bad = run_dir / "checkpoints" / "0000000009"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": ref.state_dict(), "step": 9}, checkpoint_id=str(bad))
    (bad / ".complete").touch()
    for f in bad.glob("*.distcp"):
        f.write_bytes(f.read_bytes()[:100])
    from mta_repro.eval.run import main as eval_main

    args = ["tasks=[ppl]", "ppl.seq_len=32", "ppl.max_batches=1", "ppl.domains=[book]"]
    assert eval_main([str(run_dir), *args]) == 0
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if "WARNING" in ln or "Traceback" in ln or "Exception" in ln]
    assert len(lines) == 1, err
    assert f"checkpoint {bad} is unreadable: file __0_0.distcp is truncated" in lines[0]
    assert f"falling back to {run_dir / 'checkpoints' / '0000000007'} (step 7)" in lines[0]
    # a truncated export: one line with the short reason, not torch's paragraph
    (run_dir / "export").mkdir()
    torch.save({"model": ref.state_dict(), "config": {}, "step": 11}, run_dir / "export" / "consolidated.pt")
    export = run_dir / "export" / "consolidated.pt"
    export.write_bytes(export.read_bytes()[:2000])
    assert eval_main([str(run_dir), *args]) == 0
    err = capsys.readouterr().err
    warn = [ln for ln in err.splitlines() if "WARNING" in ln]
    assert len(warn) == 2 and "Traceback" not in err, err
    assert warn[0].startswith(f"[mta_repro.eval] WARNING: {export} is unreadable (RuntimeError: ")
    assert warn[0].endswith(f"truncated or corrupt; falling back to {bad} (step 9)") and len(warn[0]) < 400
    with pytest.raises(CorruptFileError, match=f"{export} is unreadable"):
        load_weights(export)


# ------------------------------------------------------------------ structure
def _readers(f: Path) -> list:
    """Calls in ``f`` that turn file bytes into objects: ``torch.load``, ``pickle.load(s)``,
    an ``Unpickler``, ``dcp.load``, DCP's reader or metadata, ``weights_only=False``,
    safetensors' ``safe_open`` / ``load_file``."""
    out = []
    for node in ast.walk(ast.parse(f.read_text())):
        if not isinstance(node, ast.Call):
            continue
        fn = node.func
        name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
        owner = getattr(fn.value, "id", getattr(fn.value, "attr", "")) if isinstance(fn, ast.Attribute) else ""
        bad = (
            (name in ("load", "loads") and owner in ("torch", "pickle", "dcp", "checkpoint"))
            or name in ("Unpickler", "FileSystemReader", "read_metadata", "safe_open", "load_file")
            or any(
                k.arg in ("weights_only", "allow_pickle")
                and isinstance(k.value, ast.Constant)
                and k.value.value is (k.arg == "allow_pickle")
                for k in node.keywords
            )
        )
        if bad:
            out.append(f"{f.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)[:120]}")
    return out


def test_one_module_reads_files():
    """A second torch.load (or pickle/DCP/safetensors read) outside mta_repro/weights' two
    readers fails here."""
    owners = (PKG / "weights" / "safe.py", PKG / "weights" / "safetensors_file.py")
    offenders = [x for f in sorted(PKG.rglob("*.py")) if f not in owners for x in _readers(f)]
    assert not offenders, "read weights/run-state through mta_repro.weights:\n" + "\n".join(offenders)
    assert all(_readers(f) for f in owners)  # the scan does see them where they are


def _imports(f: Path) -> set:
    out = set()
    for node in ast.walk(ast.parse(f.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


@pytest.mark.slow
def test_train_eval_and_weights_do_not_import_the_release_converter():
    for sub in ("train", "eval", "weights"):
        for f in sorted((PKG / sub).rglob("*.py")):
            bad = sorted(m for m in _imports(f) if m == "mta_repro.release" or m.startswith("mta_repro.release."))
            assert not bad, f"{f.relative_to(ROOT)} imports {bad}"
    code = (
        "import sys, mta_repro.train.loop, mta_repro.train.export, mta_repro.eval.run, mta_repro.weights;"
        "print(sorted(m for m in sys.modules if m.startswith('mta_repro.release')))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr[-2000:]
