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
