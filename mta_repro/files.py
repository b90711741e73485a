"""Files other programs, kills and power losses can damage: writes that leave the old
bytes or the new ones, never a part, and JSON reads that check what they got.

Writes: a file replaced whole through a temporary file, an fsync and a rename; after a
power loss only what was fsynced is there (the data of a file before the rename that
publishes it, the folder after it: its entries are the folder's data).

Reads: ``read_json(path, shape, what)`` returns the parsed file, or raises ``UserError`` in
one line naming the file, where in it the first fault is and what was expected there. A
shape is a type (``dict``, ``list``, ``str``, ``bool``, ``int``, ``float`` = any number,
``object`` = anything), a tuple of alternatives, or a dict spec: a JSON object whose listed
keys must be there (a key ending in ``?`` may be absent) and whose other values all match
the shape's ``"*"`` entry, if it has one. JSON's ``NaN`` and ``Infinity`` read as floats.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
from pathlib import Path
from typing import Any

import torch

from mta_repro.errors import UserError


def fsync_path(path: Path) -> None:
    """fsync a file or a folder. A folder that cannot be opened or synced (some platforms
    and filesystems) is skipped."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.EBADF, errno.ENOTSUP):  # a folder on some filesystems
            raise
    finally:
        os.close(fd)


def fsync_tree(folder: Path) -> None:
    """fsync every file under ``folder``, then the folder."""
    for p in sorted(Path(folder).rglob("*")):
        if p.is_file():
            fsync_path(p)
    fsync_path(folder)


def replace_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through ``<path>.tmp`` (flushed, fsynced, its mode copied
    from the old file), a rename and an fsync of the folder: a kill at any moment leaves
    the old bytes or the new ones, never a part (a temp file an earlier kill left is
    overwritten)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        with contextlib.suppress(OSError):
            os.chmod(tmp, stat.S_IMODE(path.stat().st_mode))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def save_file_atomic(obj: Any, path: Path) -> Path:
    """``torch.save`` to ``path`` through a temporary file, an fsync and a rename, so a kill
    or a power loss midway leaves the previous file (or none), never a truncated one."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        torch.save(obj, tmp)
        fsync_path(tmp)  # the bytes on disk before the rename publishes them (a power loss too)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a partial file on a full disk would keep it full
        raise
    fsync_path(path.parent)
    return path


def caused_by_enospc(exc: BaseException) -> bool:
    """Whether ``exc`` or an error it was raised from is a full disk (``torch.save`` reports
    one as a RuntimeError whose cause or text carries it)."""
    seen = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return True
        if "No space left on device" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


_NAMES = {
    dict: "an object",
    list: "a list",
    str: "a string",
    bool: "true/false",
    int: "an integer",
    float: "a number",
    type(None): "null",
    object: "anything",
}


def _name(shape: Any) -> str:
    if isinstance(shape, tuple):
        return " or ".join(_name(s) for s in shape)
    if isinstance(shape, dict):
        return "an object"
    return _NAMES.get(shape, getattr(shape, "__name__", str(shape)))


def _found(value: Any) -> str:
    return {
        dict: "an object",
        list: "a list",
        str: "a string",
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        type(None): "null",
    }.get(type(value), type(value).__name__)


def _matches(value: Any, shape: Any) -> bool:
    if shape is object:
        return True
    if isinstance(shape, tuple):
        return any(_matches(value, s) for s in shape)
    if isinstance(shape, dict):
        return isinstance(value, dict)
    if shape is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if shape is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, shape)


def fault(value: Any, shape: Any, where: str = "") -> str | None:
    """Where ``value`` first departs from ``shape`` and how, or None if it matches."""
    at = f" at {where}" if where else ""
    if isinstance(shape, tuple):
        dicts = [s for s in shape if isinstance(s, dict)]
        if isinstance(value, dict) and dicts:
            return fault(value, dicts[0], where)
    if not _matches(value, shape):
        return f"expected {_name(shape)}{at}, found {_found(value)}"
    if not isinstance(shape, dict):
        return None
    for key, sub in shape.items():
        if key == "*":
            continue
        name = key[:-1] if key.endswith("?") else key
        if name not in value:
            if not key.endswith("?"):
                return f"expected key {name!r}{at}"
            continue
        why = fault(value[name], sub, f"{where}.{name}" if where else name)
        if why:
            return why
    if "*" in shape:
        listed = {k.rstrip("?") for k in shape if k != "*"}
        for key, v in value.items():
            if key not in listed:
                why = fault(v, shape["*"], f"{where}.{key}" if where else str(key))
                if why:
                    return why
    return None


def read_json(path: str | Path, shape: Any = object, what: str = "JSON") -> Any:
    """The content of ``path`` if it is JSON of ``shape`` (module docstring); else
    ``UserError`` naming the file, ``what`` it should be and the first fault."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        detail = (
            f"line {e.lineno} column {e.colno}: {e.msg}" if isinstance(e, json.JSONDecodeError) else type(e).__name__
        )
        raise UserError(f"{path}: not valid JSON ({detail}); expected {what}") from None
    why = fault(data, shape)
    if why:
        raise UserError(f"{path}: not {what}: {why}")
    return data
