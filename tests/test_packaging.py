"""Packaging: the model, data and trainer work without the eval/report/wandb/SLURM/HF
extras, and the extras in pyproject.toml say which package needs what."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
EXTRAS_ONLY = (
    "lm_eval",
    "datasets",
    "wandb",
    "matplotlib",
    "nltk",
    "submitit",
    "hydra_plugins",
    "transformers",
    "safetensors",
)

# Runs in a fresh interpreter: importing any of EXTRAS_ONLY fails there, as on a machine
# where only `pip install mta-repro` (no extras) was run.
_PROBE = """
import importlib, pkgutil, sys
BLOCKED = {blocked!r}

class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError("not installed here: " + name)

sys.meta_path.insert(0, Block())
import torch
import mta_repro
for pkg in ("mta_repro.model", "mta_repro.data", "mta_repro.train"):
    mod = importlib.import_module(pkg)
    for m in pkgutil.walk_packages(mod.__path__, pkg + "."):
        if not m.name.endswith("__main__"):
            importlib.import_module(m.name)
for name in ("mta_repro.train.config", "mta_repro.estimate.params", "mta_repro.estimate.cli",
             "mta_repro.estimate.memory", "mta_repro.cli", "mta_repro.eval.generate", "mta_repro.weights"):
    importlib.import_module(name)
from mta_repro.train.config import compose, model_args_from
from mta_repro.model import build_model
model = build_model(model_args_from(compose(["model=tiny", "attention=mta"])))
logits = model(torch.zeros(1, 8, dtype=torch.long))
assert logits.shape[:2] == (1, 8)
# the shipped configs log to wandb offline: without wandb, metrics.jsonl alone (one line
# says so); online mode, which the user asked for by name, refuses
import tempfile
from mta_repro.train.args import LoggingArgs
from mta_repro.train.metrics import MetricLogger
with tempfile.TemporaryDirectory() as d:
    log = MetricLogger(d, LoggingArgs(progress_bar=False, wandb_mode="offline"), {{}}, True, 2, 0)
    assert log.wandb is None
    try:
        MetricLogger(d, LoggingArgs(progress_bar=False, wandb_mode="online"), {{}}, True, 2, 0)
        raise SystemExit("online mode without wandb did not refuse")
    except ImportError as e:
        assert "mta-repro[wandb]" in str(e)
loaded = sorted({{m.split(".")[0] for m in sys.modules}} & set(BLOCKED))
print("loaded:", loaded)
"""


@pytest.mark.slow
def test_model_data_train_import_without_the_extras():
    p = subprocess.run(
        [sys.executable, "-c", _PROBE.format(blocked=EXTRAS_ONLY)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert "loaded: []" in p.stdout
    assert "wandb is not installed: logging to metrics.jsonl only" in p.stderr


def _names(reqs):
    return {re.split(r"[<>=\[ ;]", r, maxsplit=1)[0].lower() for r in reqs}


def test_eval_stack_is_in_extras_not_core():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = _names(project["dependencies"])
    extras = project["optional-dependencies"]
    for pkg in (
        "lm-eval",
        "datasets",
        "wandb",
        "matplotlib",
        "nltk",
        "transformers",
        "safetensors",
    ):
        assert pkg not in core, pkg
        assert any(pkg in _names(reqs) for reqs in extras.values()), pkg
    assert {"eval", "report", "wandb", "hf", "all", "dev"} <= set(extras)
    # SLURM is the engine's sbatch path (no submitit launcher, no extra of its own)
    assert "slurm" not in extras and not any("submitit" in r for reqs in extras.values() for r in reqs)
    # `all` names every extra but dev
    (all_spec,) = extras["all"]
    assert set(all_spec.split("[")[1].rstrip("]").split(",")) == set(extras) - {"all", "dev"}


def test_hf_interop_needs_only_the_hf_extra():
    """`python -m mta_repro.hf export|import` with `pip install mta-repro[hf]`: the eval stack
    (lm-eval and the rest) is not imported on the way."""
    blocked = tuple(p for p in EXTRAS_ONLY if p not in ("transformers", "safetensors"))
    probe = (
        _PROBE.split("import torch\n")[0]
        + "import mta_repro.hf.convert, mta_repro.hf.cli, mta_repro.eval.load, mta_repro.train.config\n"
        + "print('loaded:', sorted({{m.split('.')[0] for m in sys.modules}} & set(BLOCKED)))\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", probe.format(blocked=blocked)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert "loaded: []" in p.stdout


@pytest.mark.parametrize("folder", ["build/lib/mta_repro", "build/bdist.linux-x86_64", "dist"])
def test_the_folders_pip_install_leaves_are_not_linted_nor_tracked(tmp_path, folder):
    """`pip install .` from a clone leaves build/lib/<a copy of the package> (and
    `python -m build` dist/): ruff, pyright and git must not see them, or `make lint`
    reports the copy's per-file-ignored lines under paths the ignores do not name."""
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    shutil.copy(ROOT / ".gitignore", tmp_path)
    left = tmp_path / folder / "left.py"
    left.parent.mkdir(parents=True)
    left.write_text("import os\n")  # F401: a lint error if ruff looked at it
    (tmp_path / "kept.py").write_text("import os\n")
    p = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format=concise", "."],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert "kept.py" in p.stdout and "left.py" not in p.stdout, p.stdout + p.stderr  # ruff still lints the rest
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    ignored = subprocess.run(["git", "check-ignore", "-q", str(left)], cwd=tmp_path)
    assert ignored.returncode == 0, f"{folder} is not in .gitignore"
    exclude = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pyright"]["exclude"]
    assert folder.split("/")[0] in exclude
