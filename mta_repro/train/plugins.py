"""The config's plugins: the functions ``module:function`` fields name (``trainer.loader``,
``checkpoint.save_hook``), imported when a run starts."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from mta_repro.errors import UserError


def load_factory(spec: str, field: str = "trainer.loader") -> Callable:
    """The function a ``module:function`` config field names."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise UserError(f"{field}: expected 'module:function', got {spec!r}")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise UserError(f"{field}: cannot import {spec!r} ({e})") from e
