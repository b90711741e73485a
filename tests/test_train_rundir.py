"""Run-directory safety: a start whose config differs from the run's saved config.yaml is
refused before anything is written; the schema refuses added keys; a failed start leaves
no run dir behind; one job per run dir (lock naming its holder, stale locks taken over).

Tiny model on the bundled corpus (seq 32, batch 2), in this process except where Hydra's
own CLI behaviour is the point."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from tiny_config import tiny_train

from mta_repro.runs.rundir import write_config
from mta_repro.runs.runlock import RunDirError, RunLock
from mta_repro.train.config import compose
from mta_repro.train.config_check import diff_configs

ROOT = Path(__file__).resolve().parents[1]
COMMON = tiny_train("trainer.steps=2", "checkpoint.every=1")


def _train(run_dir, *overrides):
    from mta_repro.train.loop import train

    return train(compose([*COMMON, f"run_dir={run_dir}", *overrides]))


def _snapshot(run_dir: Path) -> dict:
    return {str(p.relative_to(run_dir)): (p.read_bytes() if p.is_file() else None) for p in sorted(run_dir.rglob("*"))}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("base") / "run"
    _train(run_dir)
    return run_dir


@pytest.fixture
def run(base, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(base, dst)
    # The copy's saved run_dir differs (run_dir is never compared: a moved run dir resumes).
    return dst


@pytest.mark.parametrize(
    "override,key",
    [
        ("attention=mta", "attention: baseline -> mta"),  # the option, not the dozen fields it sets
        ("optim.lr=1e-2", "optim.lr"),
        ("data.sources.book=0.5", "data.sources.book"),
        ("seed=7", "seed"),
    ],
)
def test_a_config_changing_model_data_or_optimiser_is_refused_before_writing(run, override, key):
    before = _snapshot(run)
    with pytest.raises(RunDirError) as e:
        _train(run, override)
    msg = str(e.value)
    assert key in msg and "(at step 2)" in msg
    assert "another run_dir=" in msg and f"checkpoint.init_from={run}" in msg  # the two ways out
    assert len(msg.splitlines()) == 1
    assert _snapshot(run) == before  # config.yaml, metrics, checkpoints untouched; no lock left


def test_safe_fields_need_allow_config_change_and_keep_the_previous_config(run):
    before = _snapshot(run)
    with pytest.raises(RunDirError, match=r"trainer.steps: 2 -> 3.*checkpoint.allow_config_change=true"):
        _train(run, "trainer.steps=3", "logging.every=2")
    assert _snapshot(run) == before
    old = (run / "config.yaml").read_text()
    _train(run, "trainer.steps=3", "checkpoint.allow_config_change=true")
    rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert (run / "config.prev.yaml").read_text() == old
    assert "steps: 3" in (run / "config.yaml").read_text()
    assert not list(run.glob("*.tmp"))


def test_steps_below_the_run_step_says_so(run, capsys):
    before = _snapshot(run)
    for extra in ([], ["checkpoint.allow_config_change=true"]):
        with pytest.raises(RunDirError, match=r"already at step 2 .*beyond trainer.steps=1: nothing to train"):
            _train(run, "trainer.steps=1", *extra)
    assert _snapshot(run) == before
    out = _train(run)  # == the run's step: nothing to do, said on stderr, exit normally
    assert out["step"] == 2
    assert "already at trainer.steps=2: nothing to train" in capsys.readouterr().err


def test_another_model_with_fewer_steps_names_the_model_not_the_steps(run):
    """Reusing a run dir for another model: the refusal is about the model (no hint to raise
    trainer.steps or allow_config_change, which could never make it continue), in one short line."""
    before = _snapshot(run)
    for extra in ([], ["checkpoint.allow_config_change=true"]):
        with pytest.raises(RunDirError) as e:
            _train(run, "attention=talking_heads", "trainer.steps=1", *extra)
        msg = str(e.value)
        assert "in fields that define the model, data or optimiser state: attention: baseline -> talking_heads." in msg
        assert "allow_config_change" not in msg and "model.mta." not in msg
        assert len(msg.replace(str(run), "RUN")) < 350, msg
    assert _snapshot(run) == before


def test_moved_run_dir_and_relative_paths_are_no_change(run, monkeypatch):
    monkeypatch.chdir(ROOT)
    abs_root = str((ROOT / "data" / "mini_slimpajama").resolve())
    d = diff_configs(
        OmegaConf.to_container(compose([*COMMON, "run_dir=a"]), resolve=True),
        OmegaConf.to_container(
            compose([*COMMON, "run_dir=/elsewhere/b", f"data.root_dir={abs_root}", "slurm.nodes=4"]), resolve=True
        ),
    )
    assert not d.unsafe and not d.safe
    # A moved copy of the corpus is a location change (allowed with the flag), not new data.
    d = diff_configs(
        OmegaConf.to_container(compose(COMMON), resolve=True),
        OmegaConf.to_container(compose([*COMMON, "data.root_dir=/mnt/copy/mini"]), resolve=True),
    )
    assert not d.unsafe and list(d.safe) == ["data.root_dir"]


def test_resume_false_over_checkpoints_is_refused(run):
    with pytest.raises(RunDirError, match="checkpoint.resume=false would train over them"):
        _train(run, "checkpoint.resume=false")


def test_a_saved_config_that_is_no_mapping_is_refused_in_one_line(run):
    """A run's config.yaml that holds a YAML list (overwritten by hand) is named in one line,
    not met with a traceback from the config comparison."""
    (run / "config.yaml").write_text("- model\n- data\n")
    before = _snapshot(run)
    with pytest.raises(RunDirError) as e:
        _train(run)
    msg = str(e.value)
    assert len(msg.splitlines()) == 1
    assert msg.startswith(f"{run / 'config.yaml'}: cannot be read (a YAML list, not a mapping")
    assert _snapshot(run) == before


def test_added_keys_are_refused_by_the_schema(tmp_path):
    from mta_repro.train.loop import train

    run_dir = tmp_path / "typo"
    with pytest.raises(ValueError, match=r"trainer.step \(did you mean trainer.steps\?\)"):
        train(compose([*COMMON, f"run_dir={run_dir}", "+trainer.step=20"]))
    with pytest.raises(ValueError, match=r"model.mta.use_mtaa \(did you mean model.mta.use_mta\?\)"):
        train(compose([*COMMON, f"run_dir={run_dir}", "+model.mta.use_mtaa=true"]))
    with pytest.raises(ValueError, match=r"unknown config key\(s\) foo"):
        train(compose([*COMMON, f"run_dir={run_dir}", "+foo=1"]))
    assert not run_dir.exists()
    # Free-form mappings stay open: a new domain weight is a key, not a typo.
    from mta_repro.dataclass_config import unknown_keys
    from mta_repro.train.config import TrainConfig

    assert unknown_keys(TrainConfig, compose(["+data.sources.mydomain=0.1"]), "") == []


@pytest.mark.slow
def test_a_failed_start_leaves_no_run_dir(tmp_path):
    """Through the command line (it writes the record of the command before the trainer runs)."""
    run_dir = tmp_path / "failed"
    p = subprocess.run(
        [sys.executable, "-m", "mta_repro.train", f"run_dir={run_dir}", *COMMON, "model.vocab_size=100"],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode != 0 and "model.vocab_size=100" in p.stderr
    assert not run_dir.exists(), sorted(run_dir.rglob("*"))


# ------------------------------------------------------------------ lock
def _lock_file(run_dir: Path, **holder):
    run_dir.mkdir(parents=True, exist_ok=True)
    base = {"host": socket.gethostname(), "pid": os.getpid(), "slurm_job_id": None, "started": "earlier"}
    base.update(holder)
    (run_dir / ".lock").write_text(json.dumps(base))


def test_a_live_holder_refuses_naming_host_pid_and_job(run):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _lock_file(run, pid=sleeper.pid, slurm_job_id="4242")
        before = _snapshot(run)
        with pytest.raises(RunDirError) as e:
            _train(run)
        msg = str(e.value)
        assert f"host {socket.gethostname()}" in msg and f"pid {sleeper.pid}" in msg and "SLURM job 4242" in msg
        assert "last alive 0 min ago" in msg
        assert _snapshot(run) == before
    finally:
        sleeper.kill()
        sleeper.wait()


def test_stale_locks_are_taken_over(run, capsys, monkeypatch):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _lock_file(run, pid=dead.pid)
    _train(run)  # a dead pid on this host: stale
    assert f"process {dead.pid} on {socket.gethostname()} is gone" in capsys.readouterr().err
    assert not (run / ".lock").exists()  # released at the end
    # A requeued SLURM job finds the lock of its own earlier incarnation (maybe another host).
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    _lock_file(run, host="gpu-node-9", pid=1, slurm_job_id="777")
    lock = RunLock(run)
    lock.acquire()
    assert "earlier run of this SLURM job 777" in capsys.readouterr().err
    assert json.loads((run / ".lock").read_text())["pid"] == os.getpid()
    lock.release()
    assert not (run / ".lock").exists()
    # Another host, no SLURM to ask: cannot tell, refuses.
    monkeypatch.delenv("SLURM_JOB_ID")
    _lock_file(run, host="gpu-node-9", pid=1)
    with pytest.raises(RunDirError, match="in use by another job .*host gpu-node-9, pid 1"):
        RunLock(run).acquire()


def test_write_config_is_atomic_and_keeps_the_previous(tmp_path):
    write_config(tmp_path, compose(["trainer.steps=5"]))
    first = (tmp_path / "config.yaml").read_text()
    write_config(tmp_path, compose(["trainer.steps=5"]))  # unchanged: no churn
    assert not (tmp_path / "config.prev.yaml").exists()
    write_config(tmp_path, compose(["trainer.steps=6"]))
    assert (tmp_path / "config.prev.yaml").read_text() == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.prev.yaml", "config.yaml"]


def test_fields_added_to_the_schema_since_compare_as_defaults():
    saved = OmegaConf.to_container(compose(COMMON), resolve=True)
    new = OmegaConf.to_container(compose([*COMMON, "model.dropout=0.1"]), resolve=True)
    del saved["trainer"]["eval_every"], saved["model"]["dropout"]  # an older run's config.yaml
    d = diff_configs(saved, new)
    assert d.unsafe == {"model.dropout": (0.0, 0.1)} and d.safe == {}


def test_field_classes_come_from_the_schema():
    """FREE/SAFE/PATHS are read from the fields' metadata and the sections' RUN_DIR: the
    keys documented in mta_repro/train/config_check.py, each a real key of the composed config."""
    from mta_repro.train.config_check import FREE, PATHS, SAFE

    assert set(FREE) == {
        "run_dir",
        "slurm.",
        "logging.progress_bar",
        "logging.quiet_s",
        "data.prefetch",
        "distributed.timeout_min",
        "checkpoint.allow_config_change",
        "checkpoint.resume",
        "checkpoint.on_corrupt",
        "checkpoint.async_save",
        "checkpoint.save_hook",
        "checkpoint.accept_changed_data",
        "checkpoint.accept_changed_tokenizer",
        "trainer.grad_accum",
        "trainer.cpu_mmap_threshold",
        "trainer.memory_check",
        "model.attn_selfcheck",
        "model.attn_selfcheck_cpu",
        "model.kernels.",
        "run.",
    }
    assert set(SAFE) == {
        "trainer.steps",
        "trainer.nonfinite",
        "trainer.device",
        "trainer.eval_every",
        "trainer.eval_max_batches",
        "trainer.eval_batch_size",
        "trainer.loss_chunk",
        "logging.",
        "checkpoint.every",
        "checkpoint.keep",
        "checkpoint.export",
        "distributed.",
        "checkpoint.init_from",
        "data.root_dir",
        "data.tokenizer.path",
    }
    assert set(PATHS) == {"checkpoint.init_from", "data.root_dir", "data.tokenizer.path"}
    from mta_repro.train.config_check import flatten

    keys = flatten(OmegaConf.to_container(compose([]), resolve=False))
    for k in FREE + SAFE:
        assert (k in keys) if not k.endswith(".") else any(x.startswith(k) for x in keys), k


def test_printing_the_config_writes_nothing_and_shows_the_seed_it_would_use(tmp_path):
    # Hydra's own options (--cfg) after the overrides: the start's staged record must not
    # turn into an argument Hydra's parser refuses, nor write into the run dir.
    run_dir = tmp_path / "r"
    p = subprocess.run(
        [sys.executable, "-m", "mta_repro.train", "experiment=debug", f"run_dir={run_dir}", "seed=3"]
        + ["--cfg", "job", "--resolve"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    cfg = OmegaConf.create(p.stdout)
    assert (cfg.seed, cfg.model.seed, cfg.data.seed) == (3, 3, 3)
    assert not run_dir.exists()


def test_a_hand_started_run_records_its_stage_and_its_report_infers_nothing(base, tmp_path):
    """run.stage null (a run started by hand): the trainer records what the start knows:
    pretraining without checkpoint.init_from; from init_from, the 4K-finetune kind of
    stage when the context grows, continued training when it does not. The report then
    places the run by its record and prints no 'stage (inferred)' line."""
    from mta_repro.report.__main__ import build_report

    def stage(run_dir):
        return OmegaConf.load(run_dir / "config.yaml").run.stage

    assert compose(COMMON).run.stage is None  # the config leaves it null
    assert stage(base) == "pretrain"
    assert json.loads((base / "provenance.json").read_text())["run"]["stage"] == "pretrain"
    for name, extra, want in (("lc", ["data.seq_len=64"], "long_context"), ("more", [], "continued")):
        _train(tmp_path / name, f"checkpoint.init_from={base}", "trainer.steps=1", *extra)
        assert stage(tmp_path / name) == want
    _train(tmp_path / "given", "run.stage=continued", "trainer.steps=1")  # a stage given is kept
    assert stage(tmp_path / "given") == "continued"
    md = build_report([base], tmp_path / "rep", kernels=False).read_text()
    assert "stage (inferred)" not in md
    placed = json.loads((tmp_path / "rep" / "results.json").read_text())["runs"][0]["placed_by"]
    assert placed["stage"] == "recorded"
