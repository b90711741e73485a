"""Reading a JSON file another program, run or person wrote, with its shape checked.

``read_json(path, shape, what)`` returns the parsed file, or raises ``UserError`` in one
line naming the file, where in it the first fault is and what was expected there (an eval
result whose ``needle.json`` is a list, a shard index whose ``weight_map`` is not an
object), instead of an ``AttributeError`` wherever the value is first used.

A shape is a type (``dict``, ``list``, ``str``, ``bool``, ``int``, ``float`` = any number,
``object`` = anything), a tuple of alternatives, or a dict spec: a JSON object whose listed
keys must be there (a key ending in ``?`` may be absent) and whose other values all match
the spec's ``"*"`` entry, if it has one. JSON's ``NaN`` and ``Infinity`` read as floats.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Union

from mta_repro.errors import UserError

_NAMES = {dict: "an object", list: "a list", str: "a string", bool: "true/false", int: "an integer",
          float: "a number", type(None): "null", object: "anything"}


def _name(shape: Any) -> str:
    if isinstance(shape, tuple):
        return " or ".join(_name(s) for s in shape)
    if isinstance(shape, dict):
        return "an object"
    return _NAMES.get(shape, getattr(shape, "__name__", str(shape)))


def _found(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


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


def fault(value: Any, shape: Any, where: str = "") -> Optional[str]:
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


def read_json(path: Union[str, Path], shape: Any = object, what: str = "JSON") -> Any:
    """The content of ``path`` if it is JSON of ``shape`` (module docstring); else
    ``UserError`` naming the file, ``what`` it should be and the first fault."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        detail = f"line {e.lineno} column {e.colno}: {e.msg}" if isinstance(e, json.JSONDecodeError) else \
            type(e).__name__
        raise UserError(f"{path}: not valid JSON ({detail}); expected {what}") from None
    why = fault(data, shape)
    if why:
        raise UserError(f"{path}: not {what}: {why}")
    return data
