"""One way to turn config nodes into the project's validated dataclasses."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")


def to_dataclass(cls: type[T], cfg: Any, where: str) -> T:
    """An instance of the dataclass ``cls`` from an instance, a mapping or an OmegaConf node.

    Nested dataclass fields given as mappings are converted too. An unknown field raises
    ValueError naming ``where`` (the config path, e.g. ``"model.mta"``); the dataclass's
    own ``__post_init__`` does the value checks.
    """
    if isinstance(cfg, cls):
        return cfg
    from omegaconf import DictConfig, OmegaConf

    if isinstance(cfg, DictConfig):
        cfg = OmegaConf.to_object(cfg)  # a structured node comes back as the instance
        if isinstance(cfg, cls):
            return cfg
    if not isinstance(cfg, Mapping):
        raise ValueError(f"{where}: expected a mapping of {cls.__name__} fields, got {type(cfg).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(cfg) - known
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}; expected some of {sorted(known)}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in cfg.items():
        sub = hints.get(name)
        if dataclasses.is_dataclass(sub) and isinstance(value, Mapping):
            value = to_dataclass(sub, value, f"{where}.{name}")
        kwargs[name] = value
    return cls(**kwargs)
