"""A reader who follows the docs finds what they name: every repository path that README.md,
CONTRIBUTING.md, docs/*.md or an experiment's pages name exists, every relative link resolves,
and every ``python -m mta_repro.<module>`` is a module that runs (checked by path, nothing is
imported)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [
    ROOT / "README.md",
    ROOT / "CONTRIBUTING.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "mta_repro" / "experimental").rglob("*.md")),
]
TOP = ("mta_repro", "tests", "scripts", "configs", "docs", "slurm", "data")
# A repository path starts at a top folder, not inside another path (``<run_dir>/data/``).
PATH = re.compile(r"(?<![\w/.~<>{{}}$-])((?:{})/[\w./*-]*)".format("|".join(TOP)))
LINK = re.compile(r"\]\(([^)\s]+)\)")
MODULE = re.compile(r"(?<![\w-])-m\s+(mta_repro(?:\.\w+)*)(?![\w.]*<)")  # not python -m mta_repro.<module>


def _path_missing(path: str) -> bool:
    path = re.sub(r"(::\w+|:\d+)$", "", path.rstrip(".,;:"))
    if any(s in path for s in ("<", "{", "...")):
        return False  # a placeholder: configs/pipeline/<name>.yaml
    if "*" in path:
        return not any(ROOT.glob(path))
    return not (ROOT / path).exists()


def _module_missing(module: str) -> bool:
    base = ROOT.joinpath(*module.split("."))
    return not (base.with_suffix(".py").is_file() or (base / "__main__.py").is_file())


def missing(text: str, folder: Path) -> list[str]:
    """What ``text`` (a page in ``folder``) names that is not there."""
    out = [p for p in PATH.findall(text) if _path_missing(p)]
    for target in LINK.findall(text):
        target = target.split("#")[0]
        if target and not target.startswith(("http://", "https://", "mailto:")) and not (folder / target).exists():
            out.append(target)
    out += [f"python -m {m}" for m in MODULE.findall(text) if _module_missing(m)]
    return sorted(set(out))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_path_and_module_a_page_names_exists(doc):
    gone = missing(doc.read_text(), doc.parent)
    assert not gone, f"{doc.relative_to(ROOT)} names what is not in the repository: {gone}"


def test_the_check_sees_paths_links_and_modules():
    """The patterns find what a page writes, and a wrong name fails."""
    readme = (ROOT / "README.md").read_text()
    assert len(PATH.findall(readme)) > 10 and len(LINK.findall(readme)) > 10 and len(MODULE.findall(readme)) > 10
    text = (
        "See `mta_repro/train/nope.py` and [a page](nope.md); run `python -m mta_repro.eval.nope` or\n"
        "`torchrun -m mta_repro.train`, with `configs/pipeline/<name>.yaml`, `<run_dir>/data/x` and\n"
        "`python -m mta_repro.<module>`."
    )
    assert missing(text, ROOT / "docs") == ["mta_repro/train/nope.py", "nope.md", "python -m mta_repro.eval.nope"]
