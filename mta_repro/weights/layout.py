"""Our checkpoints on disk: ``<run_dir>/checkpoints/<step:010d>/`` DCP folders with a
``.complete`` marker, ``<run_dir>/export/consolidated.pt``; which of them are complete and
intact. (Writing them is ``mta_repro.train.checkpoint``'s job.)"""

from __future__ import annotations

import re
from pathlib import Path

from mta_repro.errors import UnsafeFileError
from mta_repro.weights.safe import read_dcp_metadata

COMPLETE = ".complete"
# The resolved run config a checkpoint was trained with, beside its DCP files: what a
# resume checks the command against when the run's own config.yaml is gone.
CHECKPOINT_CONFIG = "config.yaml"
EXPORT = Path("export") / "consolidated.pt"
# What a checkpoint's weights came from (inputs, step, tokens seen), beside its DCP files
# (written by mta_repro.train.checkpoint, described in mta_repro/runs/provenance.py).
PROVENANCE = "provenance.json"
# Step folders: ten digits, ours (step_dir_name) and Lingua's alike.
_STEP_DIR = re.compile(r"^\d{10}$")


def step_dir_name(step: int) -> str:
    return f"{step:010d}"


def complete_checkpoints(ckpt_root: Path) -> list[Path]:
    """Complete checkpoint directories, oldest first."""
    ckpt_root = Path(ckpt_root)
    if not ckpt_root.is_dir():
        return []
    out = [p for p in ckpt_root.iterdir() if _STEP_DIR.match(p.name) and (p / COMPLETE).is_file()]
    return sorted(out, key=lambda p: int(p.name))


def latest_checkpoint(path: Path) -> Path | None:
    """Newest complete checkpoint of a run dir (or of its checkpoints/ folder)."""
    path = Path(path)
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    found = complete_checkpoints(root)
    return found[-1] if found else None


def verify_checkpoint(path: Path) -> str | None:
    """None if the DCP metadata reads and every file it names is there and long enough;
    else why not, naming the file (a truncated ``.distcp`` from a full disk or a kill)."""
    path = Path(path)
    meta = path / ".metadata"
    if not meta.is_file():
        return "file .metadata is missing"
    try:
        md = read_dcp_metadata(path)
    except UnsafeFileError:
        raise  # refused, not damaged: no fallback to another file of the same origin
    except Exception as e:  # noqa: BLE001 - any failure to parse is damage
        return f"file .metadata cannot be read ({type(e).__name__}: {e})"
    for key, m in (md.state_dict_metadata or {}).items():  # model weights are float (a relabelled file is not)
        dtype = getattr(getattr(m, "properties", None), "dtype", None)
        if key.startswith("model.") and dtype is not None and not dtype.is_floating_point:
            return f"tensor {key[len('model.') :]!r} is {str(dtype).replace('torch.', '')}, expected a float dtype"
    need: dict[str, int] = {}
    for info in (md.storage_data or {}).values():
        end = int(info.offset) + int(info.length)
        need[info.relative_path] = max(need.get(info.relative_path, 0), end)
    for rel in sorted(need):
        f = path / rel
        if not f.is_file():
            return f"file {rel} is missing"
        size = f.stat().st_size
        if size < need[rel]:
            return f"file {rel} is truncated ({size} bytes; the metadata needs {need[rel]})"
    return None


def saved_world_size(path: Path) -> int | None:
    """The number of ranks that saved a checkpoint (its per-rank ``rank{r}`` entries)."""
    try:
        md = read_dcp_metadata(path)
    except Exception:  # noqa: BLE001 - unreadable metadata: the world size is unknown (None)
        return None
    ranks = [k for k in md.state_dict_metadata if re.fullmatch(r"rank\d+", k)]
    return len(ranks) or None
