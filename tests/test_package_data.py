"""An installed package finds its configs, SLURM templates and bundled corpus and tokenizer
through ``importlib.resources`` (mta_repro/resources.py), the wheel carries every one of
them and nothing else of ``data/``, and no runtime module finds the source tree through its
own path (which is site-packages in a wheel). scripts/check_wheel.sh runs the README's
commands from an installed wheel (CI)."""

import ast
import glob
import os
import subprocess
from importlib.resources import files
from pathlib import Path

import pytest
import tomllib

from mta_repro import resources

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "mta_repro"
SHIPPED = ("configs", "slurm", "data")


def test_the_package_finds_its_files_through_importlib_resources():
    share = files("mta_repro") / "share"
    for rel in ("configs/train.yaml", "configs/eval.yaml", "configs/experiment/debug.yaml"):
        assert (share / rel).is_file(), rel
    for rel in ("slurm/train.sbatch", "slurm/eval.sbatch", "data/tokenizer/mini_sp8192.model"):
        assert (share / rel).is_file(), rel
    assert (share / "data/mini_slimpajama/manifest.json").is_file()
    # from a clone, the very folders users and the docs name (not copies that could drift);
    # a copy of the tree made without its links (shutil.copytree) has copies
    if (share / "configs").is_symlink():
        assert (ROOT / "configs").resolve() == resources.CONFIG_DIR
        assert (ROOT / "slurm").resolve() == resources.SLURM_DIR
        assert ROOT.resolve() == resources.ROOT == resources.CLONE
    for rel in ("configs/train.yaml", "slurm/train.sbatch", "data/tokenizer/mini_sp8192.model"):
        assert (resources.ROOT / rel).read_bytes() == (ROOT / rel).read_bytes(), rel


def test_every_consumer_reads_the_package_data():
    from mta_repro.data.args import REPO_ROOT, resolve_path
    from mta_repro.eval import submit as eval_submit
    from mta_repro.pipeline import submit as train_submit
    from mta_repro.train.config import CONFIG_DIR, compose

    assert CONFIG_DIR == resources.CONFIG_DIR and REPO_ROOT == resources.ROOT
    assert train_submit.TEMPLATE.read_text() == (ROOT / "slurm/train.sbatch").read_text()
    assert eval_submit.TEMPLATE.read_text() == (ROOT / "slurm/eval.sbatch").read_text()
    cfg = compose(["experiment=debug"])
    corpus = resolve_path(cfg.data.root_dir)
    assert corpus.is_dir() and corpus.resolve() == (ROOT / "data/mini_slimpajama").resolve()


def _tracked(folder: str) -> set[str]:
    """The files of a top-level folder that the clone holds (git's list; every file where
    the tree is a copy without git)."""
    if (ROOT / ".git").exists():
        out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", folder], capture_output=True, check=True)
        return {p for p in out.stdout.decode().split("\0") if p}
    return {
        os.path.relpath(os.path.join(d, f), ROOT)
        for d, _, names in os.walk(ROOT / folder)
        for f in names
        if "__pycache__" not in d
    }


def test_the_wheel_carries_the_shipped_folders_and_no_more():
    """pyproject.toml's package data, matched as setuptools matches it (glob, recursive),
    is exactly the files git holds under configs/, slurm/ and data/: a config added
    later ships too, and a corpus prepared into a clone's data/ (untracked) would not."""
    spec = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["mta_repro"]
    matched = set()
    for pattern in spec:
        for p in glob.glob(str(PKG / pattern), recursive=True):
            if os.path.isfile(p):
                matched.add(os.path.relpath(p, PKG / "share"))
    tracked = set().union(*(_tracked(f) for f in SHIPPED))
    assert tracked, "no files under configs/, slurm/, data/"
    assert matched == tracked, f"shipped but not tracked: {sorted(matched - tracked)}; tracked, not shipped: " + str(
        sorted(tracked - matched)
    )
    size = sum((ROOT / p).stat().st_size for p in matched)
    assert size < 8 << 20, f"the wheel's data files add {size / 2**20:.1f} MiB"


def _escapes(path: Path, pkg: Path = PKG) -> list[str]:
    """Where a module computes a folder above the package from its own ``__file__`` (or
    ``mta_repro.__file__``): ``.parents[N]`` or ``.parent`` chains."""
    rel = path.relative_to(pkg)
    tree = ast.parse(path.read_text())
    src = path.read_text()
    out = []
    for node in ast.walk(tree):
        levels, base = None, None
        if (
            isinstance(node, ast.Subscript)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "parents"
            and isinstance(node.slice, ast.Constant)
            and isinstance(node.slice.value, int)
        ):
            levels, base = node.slice.value + 1, node.value.value
        elif isinstance(node, ast.Attribute) and node.attr == "parent":
            levels, base = 1, node.value
            while isinstance(base, ast.Attribute) and base.attr == "parent":
                levels, base = levels + 1, base.value
        if base is None or levels is None:
            continue
        text = ast.get_source_segment(src, base) or ""
        if "__file__" not in text:
            continue
        depth = 1 if "mta_repro.__file__" in text else len(rel.parts)  # levels up to mta_repro/
        if levels > depth:
            out.append(f"mta_repro/{rel.as_posix()}:{node.lineno}")
    return out


# Reads the source tree's pyproject.toml for the entry points; that read is being removed
# from the module, and the strict xfail below says when it is gone (then drop both).
def _all_escapes() -> list[str]:
    return [hit for p in sorted(PKG.rglob("*.py")) for hit in _escapes(p)]


def test_no_runtime_module_finds_the_source_tree_by_its_own_path():
    hits = _all_escapes()
    assert not hits, f"use mta_repro.resources (package data) instead: {hits}"


def test_the_check_sees_what_it_looks_for(tmp_path):
    """The walk finds each way of climbing out of the package, and passes climbs within it."""
    cases = {
        "ROOT = Path(__file__).resolve().parents[2]\n": True,
        "ROOT = Path(__file__).parent.parent.parent\n": True,
        "import mta_repro\nROOT = Path(mta_repro.__file__).resolve().parents[1]\n": True,
        "PKG = Path(__file__).resolve().parents[1]\n": False,
        "HERE = Path(__file__).parent\n": False,
        "X = some_path.parents[5]\n": False,
    }
    fake = tmp_path / "mta_repro" / "train" / "m.py"
    fake.parent.mkdir(parents=True)
    for text, escapes in cases.items():
        fake.write_text(text)
        found = _escapes(fake, tmp_path / "mta_repro")
        assert bool(found) == escapes, (text, found)


def test_provenance_records_the_clones_commit_and_none_from_a_wheel(monkeypatch):
    from mta_repro.runs.provenance import code_version

    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
    assert code_version.__wrapped__()["commit"] == head.stdout.strip()
    # an installed wheel: share/ holds copies, no links into a checkout
    monkeypatch.setattr(resources, "CLONE", None)
    import mta_repro

    assert code_version.__wrapped__() == {
        "package": mta_repro.__version__,
        "commit": None,
        "dirty": None,
        "source": "wheel",
    }
