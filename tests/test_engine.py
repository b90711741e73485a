"""One composition and one job engine: every entry point composes through
``mta_repro.train.config.compose``; a ``-m`` sweep is a plan of the pipeline's engine."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from mta_repro.cli import parse_hydra_argv
from mta_repro.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mta_repro"


def _sources():
    return sorted(PACKAGE.rglob("*.py"))


def test_nothing_imports_hydra_internals_or_initialises_hydra_but_the_one_composition():
    internal = [p for p in _sources() if re.search(r"hydra\._internal", p.read_text())]
    assert internal == []
    # Hydra is initialised in one function; no @hydra.main entry point composes on its own
    init = [p.relative_to(ROOT).as_posix() for p in _sources() if "initialize_config_dir(" in p.read_text()]
    assert init == ["mta_repro/train/config.py"]
    mains = [p for p in _sources() if re.search(r"@hydra\.main|hydra\.main\(", p.read_text())]
    assert mains == []


def test_the_command_line_keeps_its_options_and_names_the_replacement_of_the_others():
    a = parse_hydra_argv(["experiment=debug", "--cfg", "job", "--resolve", "-m", "seed=0,1"], "train")
    assert (a.overrides, a.cfg, a.resolve, a.multirun) == (["experiment=debug", "seed=0,1"], "job", True, True)
    assert parse_hydra_argv(["--cfg=all"], "train").cfg == "all"
    with pytest.raises(UserError, match=r"option --config-dir is not supported: add a folder of configs with"):
        parse_hydra_argv(["--config-dir", "/x"], "train")
    with pytest.raises(UserError, match=r"--cfg: expected job, hydra or all, got 'jobs'"):
        parse_hydra_argv(["--cfg", "jobs"], "train")
    with pytest.raises(UserError, match=r"unknown option --bogus"):
        parse_hydra_argv(["--bogus"], "train")


def _run(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_the_plain_spelling_of_pipeline_seeds_is_accepted(tmp_path):
    # tiny sets no seeds: pipeline.seeds=[0,1] means +pipeline.seeds=[0,1]
    p = _run("mta_repro.pipeline", "pipeline=tiny", f"root={tmp_path}", "pipeline.seeds=[0,1]", "--plan")
    assert p.returncode == 0, p.stderr
    assert "train:pretrain/mta/seed1" in p.stdout and "train:pretrain/mta " not in p.stdout
    p = _run("mta_repro.pipeline", "pipeline=tiny", f"root={tmp_path}", "pipeline.seedz=[0,1]", "--plan")
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [p.stderr.strip()]
    assert "pipeline.seedz" in p.stderr
    assert not any(tmp_path.iterdir())


TINY = [
    "experiment=debug",
    "model.dim=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.multiple_of=32",
    "data.seq_len=32",
    "data.batch_size=2",
    "data.shuffle_buffer=4",
    "trainer.device=cpu",
    "trainer.eval_every=0",
    "trainer.steps=2",
    "logging.wandb_mode=disabled",
    "logging.progress_bar=false",
]


@pytest.mark.slow
@pytest.mark.pipeline
def test_a_seeds_sweep_runs_each_point_through_the_engine_and_reports_once(tmp_path):
    """The documented seeds axis: `train -m 'seed=0,1' 'run_dir=.../seed${seed}'` is a plan of
    two training jobs and a report, run by the pipeline's runner; a rerun finds them done."""
    run_dir = str(tmp_path / "x" / "seed") + "${seed}"
    p = _run("mta_repro.train", "-m", *TINY, "seed=0,1", f"run_dir={run_dir}", timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    for k in (0, 1):
        d = tmp_path / "x" / f"seed{k}"
        assert f"pipeline: train:seed{k}: done in" in p.stdout
        # each point trained its own seed, in its own run dir, with the record of its command
        assert OmegaConf_load(d / "config.yaml").seed == k
        assert (d / "export" / "consolidated.pt").is_file() and (d / ".hydra" / "overrides.yaml").is_file()
    assert (tmp_path / "x" / "report" / "report.md").is_file()
    assert p.stdout.strip().endswith(f"report: {tmp_path / 'x' / 'report' / 'report.md'}")
    again = _run("mta_repro.train", "-m", *TINY, "seed=0,1", f"run_dir={run_dir}", timeout=600)
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip() == f"pipeline: nothing to do, all 3 jobs are done ({tmp_path / 'x'})"


def OmegaConf_load(path):
    from omegaconf import OmegaConf

    return OmegaConf.load(path)


def test_two_sweep_points_in_one_run_dir_are_refused_before_anything_is_written(tmp_path):
    p = _run("mta_repro.train", "-m", *TINY, "seed=0,1", f"run_dir={tmp_path / 'one'}")
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [
        f"sweep: error: run_dir={tmp_path / 'one'}: the sweep points [seed=0] and [seed=1] share it; "
        f"run_dir={tmp_path / 'one'} names one directory for every point; interpolate the swept values "
        "(e.g. 'run_dir=runs/x/seed${seed}')"
    ]
    assert not any(tmp_path.iterdir())


def test_a_sweep_on_slurm_renders_one_train_sbatch_per_point_and_the_report_after_all(tmp_path):
    run_dir = str(tmp_path / "x" / "seed") + "${seed}"
    p = _run("mta_repro.train", "-m", *TINY, "seed=0,1", f"run_dir={run_dir}", "launcher=slurm", "--dry-run")
    assert p.returncode == 0, p.stderr
    scripts = p.stdout.split("# ---- ")[1:]
    assert [s.split(":")[0] for s in scripts] == ["train", "train", "report"]
    for k, s in zip((0, 1), scripts):
        # the one preemption protocol of slurm/train.sbatch: USR2, requeue, resume
        assert "#SBATCH --signal=USR2@120" in s and "#SBATCH --requeue" in s
        assert f"seed={k} hydra.mode=RUN" in s and f"run_dir={tmp_path}/x/seed{k}" in s
        assert subprocess.run(["bash", "-n"], input=s.split("\n", 1)[1], text=True).returncode == 0
    assert "--dependency=afterany:<train:seed0>:<train:seed1>" in scripts[2].splitlines()[0]
    assert not (tmp_path / "x").exists()


def test_the_old_submit_command_names_its_new_home(tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", "mta_repro.train.submit", "experiment=debug", "--dry-run"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (p.returncode, p.stdout) == (2, "")
    assert p.stderr.strip() == (
        "mta_repro.train.submit: error: this command moved; run "
        "python -m mta_repro.pipeline.submit experiment=debug --dry-run"
    )
    assert not any(tmp_path.iterdir())
