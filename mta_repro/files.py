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
the shape's ``"*"`` entry, if it has one.

Non-finite numbers (a diverged model's perplexity): ``result_json`` writes each as
``null`` and lists it in a top-level ``"nonfinite"`` object, ``{"/results/average": "inf"}``
(a JSON pointer to each, and its value: ``inf``, ``-inf`` or ``nan``), so the file is JSON
for every reader and a strict one sees no number there; ``read_json`` puts the floats back,
and reads the bare ``NaN``/``Infinity`` of files written before as floats too.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
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


def unwritable(folder: Path, files: tuple = ()) -> tuple[Path, str] | None:
    """(the directory or file that stops a command writing in ``folder``, why), or None.
    ``folder`` is checked if it exists, else the nearest existing folder above it (where
    it would be created); ``files`` (names inside it, written in place) if they exist. As
    the kernel decides: a read-only mount for everyone, permissions for all but root."""
    p = Path(folder).absolute()
    while not p.exists() and p.parent != p:
        p = p.parent
    for target in [p] + [p / f for f in files if p == Path(folder).absolute() and (p / f).exists()]:
        need = os.W_OK | (os.X_OK if target.is_dir() else 0)
        if not os.access(target, need):
            try:
                ro = bool(os.statvfs(target).f_flag & os.ST_RDONLY)
            except OSError:
                ro = False
            return target, "a read-only file system" if ro else "no write permission for this user"
    return None


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


NONFINITE = "nonfinite"


def _pointer_part(key: Any) -> str:
    return str(key).replace("~", "~0").replace("/", "~1")


def result_json(obj: Any) -> bytes:
    """``obj`` (a result: a JSON object) as standard JSON (module docstring): its
    non-finite floats as ``null``, listed under ``"nonfinite"``; values JSON has no type
    for are written as their ``str``."""
    plain = json.loads(json.dumps(obj, default=str))  # tuples -> lists, paths -> strings
    found: dict[str, str] = {}

    def walk(value: Any, where: str) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            found[where] = str(value)  # "inf", "-inf", "nan"
            return None
        if isinstance(value, dict):
            return {k: walk(v, f"{where}/{_pointer_part(k)}") for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v, f"{where}/{i}") for i, v in enumerate(value)]
        return value

    clean = walk(plain, "")
    if found and isinstance(clean, dict):
        clean[NONFINITE] = found
    return json.dumps(clean, indent=1, allow_nan=False).encode()


def _child(node: Any, part: str) -> tuple[Any, Any]:
    """(the container, the key or index) ``part`` names in ``node``; (None, None) if none."""
    if isinstance(node, dict) and part in node:
        return node, part
    if isinstance(node, list) and part.isdigit() and int(part) < len(node):
        return node, int(part)
    return None, None


def _restore_nonfinite(data: Any) -> Any:
    """The floats ``result_json`` wrote as ``null`` put back (a pointer that leads nowhere,
    or to a value that is not ``null``, is left as it is)."""
    marks = data.get(NONFINITE) if isinstance(data, dict) else None
    if not isinstance(marks, dict):
        return data
    for pointer, value in marks.items():
        if not isinstance(pointer, str) or not pointer or value not in ("inf", "-inf", "nan"):
            continue
        node, key = data, None
        for part in pointer.split("/")[1:]:
            if key is not None:
                node = node[key]
            node, key = _child(node, part.replace("~1", "/").replace("~0", "~"))
            if node is None:
                break
        if node is not None and node[key] is None:
            node[key] = float(value)
    return data


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
    data = _restore_nonfinite(data)
    why = fault(data, shape)
    if why:
        raise UserError(f"{path}: not {what}: {why}")
    return data
