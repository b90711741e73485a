"""Which weights a path offers, newest first (``find_weights``)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from mta_repro.errors import CorruptFileError, UserError
from mta_repro.weights.layout import COMPLETE, EXPORT, complete_checkpoints, verify_checkpoint
from mta_repro.weights.lingua import is_lingua_step, release_checkpoint_path
from mta_repro.weights.safe import load_pt


class NoWeightsError(UserError, ValueError):
    """The path holds no weights at all (missing, or a folder of another kind)."""


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One set of weights a path offers.

    kind: "consolidated" (a ``torch.save`` file: our export or a Lingua/release
    ``consolidated.pth``) or "dcp" (a DCP step folder: ours, with ``.complete``, or Lingua's).
    step: the training step when known before reading (a run's export, a step folder's name).
    problem: why it cannot be read, when that is known without reading the tensors (a
    truncated export, a missing or truncated ``.distcp``); ``read_weights`` raises it.
    """

    kind: str
    path: Path
    step: int | None = None
    problem: str | None = None


def _folder_step(path: Path) -> int | None:
    """Lingua and we name step folders <step:010d>; a consolidated.pth carries no step."""
    folder = path.parent.parent if path.name == "consolidated.pth" else path
    return int(folder.name) if re.fullmatch(r"\d{10}", folder.name) else None


def _dcp(path: Path) -> Candidate:
    why = verify_checkpoint(path)
    return Candidate(
        "dcp", path, _folder_step(path), None if why is None else f"checkpoint {path} is unreadable: {why}"
    )


def export_step(export: Path) -> int:
    """The step our export was made at (reads its small pickle; the tensors stay on disk)."""
    blob = load_pt(export)
    if not isinstance(blob, dict) or "model" not in blob:
        raise CorruptFileError(f"{export}: not a consolidated export (expected a dict with key 'model')")
    return int(blob.get("step") or 0)


def find_weights(path: str | Path) -> list[Candidate]:
    """The weights ``path`` offers, newest first.

    - a file: itself (our ``.pt`` export, a Lingua/release ``consolidated.pth``);
    - a step folder: itself (ours with ``.complete``; Lingua's DCP + ``params.json``), or its
      ``consolidated/consolidated.pth``; a Lingua/release ``consolidated/`` folder: its file;
    - a run directory (or its ``checkpoints/``): the export and every complete checkpoint,
      the newest first; the export wins a tie (training and eval agree on this order);
    - a Lingua ``dump_dir``: its step folders, newest first.

    Damaged candidates stay in the list with ``problem`` naming the file, so a caller can
    say what it skipped. A file that would need unpickling code raises ``UnsafeFileError``.
    """
    path = Path(path)
    if path.is_file():
        return [Candidate("consolidated", path, _folder_step(path))]
    if not path.exists():
        raise NoWeightsError(f"checkpoint: {path} does not exist (expected a run directory or a consolidated .pt file)")
    if (path / COMPLETE).exists():
        return [_dcp(path)]
    src = release_checkpoint_path(path)
    if src != path:  # a Lingua/release consolidated.pth or the newest step of a dump_dir
        if src.is_file():
            return [Candidate("consolidated", src, _folder_step(src))]
        return [_dcp(src)] + [c for c in _lingua_steps(path) if c.path != src]
    if is_lingua_step(path):
        return [_dcp(path)]
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    # A folder gone by the time it is checked was pruned by a running trainer (which saved a
    # newer one first): list again.
    for _ in range(20):
        ckpts = [_dcp(p) for p in complete_checkpoints(root)[::-1]]
        if all(c.problem is None or c.path.exists() for c in ckpts):
            break
    ckpts = [c for c in ckpts if c.problem is None or c.path.exists()]
    export = path / EXPORT
    if export.is_file():
        try:
            step = export_step(export)
        except CorruptFileError as e:  # named; older checkpoints may still do
            return [Candidate("consolidated", export, None, str(e))] + ckpts
        newer = [c for c in ckpts if c.step is not None and c.step > step]
        older = [c for c in ckpts if c.step is None or c.step <= step]
        return newer + [Candidate("consolidated", export, step)] + older
    if ckpts:
        return ckpts
    raise NoWeightsError(
        f"checkpoint: {path}: no weights found: neither export/consolidated.pt nor a complete DCP checkpoint under "
        "checkpoints/<step>/ (with a .complete marker), and not a checkpoint folder, a consolidated .pt/.pth "
        "file or a Lingua/release consolidated/ or step folder"
    )


def _lingua_steps(dump_dir: Path) -> list[Candidate]:
    root = dump_dir / "checkpoints"
    if not root.is_dir():
        return []
    steps = sorted(
        (p for p in root.iterdir() if re.fullmatch(r"\d{10}", p.name) and is_lingua_step(p)),
        key=lambda p: -int(p.name),
    )
    return [_dcp(p) for p in steps]
