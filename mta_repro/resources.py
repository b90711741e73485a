"""The files the package ships beside its code: the Hydra configs (``configs/``), the SLURM
templates (``slurm/``) and the bundled corpus and tokenizer (``data/``), found through
``importlib.resources`` so that a clone, an editable install and an installed wheel all
find them.

``mta_repro/share/`` holds them. In a clone its entries are links to the top-level
``configs/``, ``slurm/`` and ``data/`` (the paths users and docs name); a wheel carries
copies (pyproject.toml's package data: the bundled corpus and tokenizer only, not a corpus
prepared into a clone's ``data/``). ``ROOT`` is the folder relative paths such as
``data/mini_slimpajama`` are found under: the clone's root from a clone, ``share/`` from a
wheel.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

_PACKAGE = files("mta_repro")
if not isinstance(_PACKAGE, Path):  # a zip import: Hydra and sbatch need folders on disk
    raise ImportError(f"mta_repro is imported from {_PACKAGE}, not a folder; install it with pip instead")

SHARE = _PACKAGE / "share"
# resolve(): from a clone, the top-level folder itself (what messages and sbatch scripts show)
CONFIG_DIR = (SHARE / "configs").resolve()
SLURM_DIR = (SHARE / "slurm").resolve()
ROOT = CONFIG_DIR.parent
# From a clone, share/'s entries are links into it; an installed wheel has copies.
CLONE: Path | None = ROOT if (SHARE / "configs").is_symlink() else None
