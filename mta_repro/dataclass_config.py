"""One way to turn config nodes into the project's validated dataclasses."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeGuard, TypeVar

from mta_repro.errors import UserError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance
    from omegaconf import DictConfig

T = TypeVar("T", bound="DataclassInstance")


def _dataclass_of(hint) -> Any:
    """The dataclass type behind a field's type hint (``X`` or ``Optional[X]``), or None."""
    if dataclasses.is_dataclass(hint):
        return hint
    if typing.get_origin(hint) in (typing.Union, types.UnionType):  # Optional[X] or X | None
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(inner) == 1 and dataclasses.is_dataclass(inner[0]):
            return inner[0]
    return None


def unknown_keys(cls: type, cfg: Any, where: str) -> list[str]:
    """Dotted paths of the keys of ``cfg`` (a mapping / OmegaConf node) that are no field
    of the dataclass ``cls``, recursively through nested dataclass fields.

    Hydra's ``+key=value`` adds a key even to a structured config, and
    ``OmegaConf.to_object`` then drops it in silence; this finds such keys.
    """
    if not isinstance(cfg, Mapping) and not _is_dictconfig(cfg):
        return []
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    out = []
    for key in cfg:
        path = f"{where}.{key}" if where else str(key)
        if key not in known:
            out.append(path)
            continue
        sub = _dataclass_of(hints.get(key))
        if sub is not None:
            value = cfg[key] if not _is_dictconfig(cfg) else cfg._get_node(key)
            if value is not None and (isinstance(value, Mapping) or _is_dictconfig(value)):
                out.extend(unknown_keys(sub, value, path))
    return out


def unknown_keys_error(cls: type, bad: list[str], where: str = "") -> str:
    """One line naming the unknown keys (paths from ``unknown_keys(cls, _, where)``), with
    the closest field for a likely typo."""
    parts = []
    for full in bad:
        path = full[len(where) + 1 :] if where else full
        parent, _, name = path.rpartition(".")
        owner = cls
        for step in parent.split(".") if parent else []:
            owner = _dataclass_of(typing.get_type_hints(owner).get(step)) or owner
        fields = [f.name for f in dataclasses.fields(owner)] if dataclasses.is_dataclass(owner) else []
        close = nearest_field(name, fields)
        prefix = full[: len(full) - len(name)]
        parts.append(f"{full} (did you mean {prefix}{close}?)" if close else full)
    return f"unknown config key(s) {', '.join(parts)}: no such field in the schema ({cls.__name__})"


def nearest_field(name: str, fields: list[str]):
    """The field a mistyped key most likely meant, or None. A field that abbreviates the
    key, or that the key abbreviates, comes first (``learning_rate`` -> ``lr``, its words'
    initials; ``wd`` -> ``weight_decay``; ``warm`` -> ``warmup`` and ``eval_every_steps``
    -> ``eval_every``, prefixes), then the closest spelling (``setps`` -> ``steps``);
    spelling distance alone takes ``lr_min_ratio`` for ``learning_rate``."""
    words = [w for w in name.lower().split("_") if w]
    initials = "".join(w[0] for w in words)
    for f in fields:
        if len(words) > 1 and f.replace("_", "") == initials:
            return f
    for f in fields:  # the key is the field's initials (``wd`` -> ``weight_decay``)
        if len(name) > 1 and "_" in f and name == "".join(w[0] for w in f.split("_") if w):
            return f
    longer = [f for f in fields if len(name) >= 2 and f.startswith(name)]  # cut short: ``warm``
    if longer:
        return min(longer, key=len)
    shorter = [f for f in fields if len(f) >= 2 and name.startswith(f)]  # spelled on: ``eval_every_steps``
    if shorter:
        return max(shorter, key=len)
    close = difflib.get_close_matches(name, fields, n=1)
    return close[0] if close else None


def _is_dictconfig(x: Any) -> TypeGuard[DictConfig]:
    from omegaconf import DictConfig

    return isinstance(x, DictConfig)


def to_dataclass(cls: type[T], cfg: Any, where: str) -> T:
    """An instance of the dataclass ``cls`` from an instance, a mapping or an OmegaConf node.

    Nested dataclass fields given as mappings are converted too. An unknown field raises
    UserError naming ``where`` (the config path, e.g. ``"model.mta"``), also for keys
    added to a structured node with Hydra's ``+key=``; the dataclass's own
    ``__post_init__`` does the value checks.
    """
    if isinstance(cfg, cls):
        return cfg
    from omegaconf import DictConfig, OmegaConf

    if isinstance(cfg, DictConfig):
        bad = unknown_keys(cls, cfg, where)
        if bad:
            raise UserError(unknown_keys_error(cls, bad, where))
        cfg = OmegaConf.to_object(cfg)  # a structured node comes back as the instance
        if isinstance(cfg, cls):
            return check_values(cfg, where)
    if not isinstance(cfg, Mapping):
        raise UserError(f"{where}: expected a mapping of {cls.__name__} fields, got {type(cfg).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    if getattr(cls, "RUN_DIR", None) == "free":
        # A section no result depends on (a run may continue under other values): a saved
        # config's setting that no longer exists, left at null (its default), is as absent.
        cfg = {k: v for k, v in cfg.items() if k in known or v is not None}
    unknown = set(cfg) - known
    if unknown:
        raise UserError(f"{where}: unknown field(s) {sorted(unknown)}; expected some of {sorted(known)}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in cfg.items():
        sub = hints.get(name)
        if isinstance(sub, type) and dataclasses.is_dataclass(sub) and isinstance(value, Mapping):
            value = to_dataclass(sub, value, f"{where}.{name}")
        kwargs[name] = value
    return check_values(cls(**kwargs), where)


# Seeds are bounded by what every RNG they reach accepts: numpy's legacy seeding and many
# tools take 0 <= seed < 2**32, and the trainer adds the rank to ``seed`` for torch.
SEED_LIMIT = 2**32


def seed_error(value: Any, path: str) -> str | None:
    """Why ``value`` is not a seed (the line naming ``path``), or None."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < SEED_LIMIT:
        return f"{path}={value!r}: expected a seed, an integer with 0 <= seed < 2**32 ({SEED_LIMIT:,})"
    return None


def _bad_at(value: Any, path: str) -> str | None:
    """The first field under ``value`` that no setting may hold: a NaN anywhere, or a field
    named ``seed`` that is no seed (``seed_error``); None if none."""
    if isinstance(value, float) and value != value:
        return f"{path}: expected a number, got nan"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = ((f.name, getattr(value, f.name)) for f in dataclasses.fields(value))
    elif isinstance(value, Mapping):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return None
    for k, v in items:
        sub = f"{path}.{k}" if path else str(k)
        if k == "seed" and v is not None and not isinstance(value, Mapping):
            found = seed_error(v, sub)
        else:
            found = _bad_at(v, sub)
        if found:
            return found
    return None


def check_values(obj: T, where: str) -> T:
    """``obj``, unless a field anywhere in it is NaN or a ``seed`` out of range: no setting
    means "not a number", and NaN passes every range check (``nan < 0`` is false), so it is
    refused by name here; a seed numpy or torch would refuse (-1, 10**20) fails here, in one
    line, not in the first RNG it reaches."""
    found = _bad_at(obj, where)
    if found:
        raise UserError(found)
    return obj
