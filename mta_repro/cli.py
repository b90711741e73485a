"""One clear line for command-line errors (train, slurm, eval, params, generate, hf,
pipeline), not a traceback.

User errors are ValueErrors (ours) or Hydra/OmegaConf errors from the overrides (a bad
key, a string where a list is expected, an unknown config group option).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Callable, Sequence


def user_errors() -> tuple:
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    return (ValueError, FileNotFoundError, HydraException, OmegaConfBaseException)


def describe(exc: BaseException) -> str:
    """The exception and its causes, each once, on one line."""
    parts, seen = [], set()
    e = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        msg = " ".join(str(e).split())
        # OmegaConf appends "full_key: ... object_type=..." context lines: keep the message
        msg = msg.split(" full_key:")[0].strip()
        # "ValueError raised while resolving interpolation: <the message>": keep the message
        msg = re.sub(r"^\w+ raised while resolving interpolation: ", "", msg)
        if msg and not any(msg in p for p in parts):
            parts.append(msg)
        e = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
    line = ": ".join(parts) or type(exc).__name__
    if "is not a ListConfig" in line or "is not a subclass of ListConfig" in line:
        line += " (write lists in brackets, e.g. tasks=[ppl])"
    return line


def run_cli(prog: str, fn: Callable[[], int]) -> int:
    """``fn()``'s exit code; a user error prints ``<prog>: error: <one line>`` and gives 2."""
    try:
        return fn()
    except user_errors() as e:
        print(f"{prog}: error: {describe(e)}", file=sys.stderr)
        return 2


def check_group_options(overrides: Sequence[str], groups: Sequence[str], config_dir: Path) -> None:
    """``group=option`` overrides name a YAML file of configs/<group>/ (checked before Hydra,
    whose own message for ``model=880`` is about ints)."""
    for o in overrides:
        key, _, value = o.partition("=")
        key = key.lstrip("+~")
        if key in groups:
            options = sorted(p.stem for p in (config_dir / key).glob("*.yaml"))
            if value not in options:
                raise ValueError(f"{key}={value}: unknown {key} config; expected one of {options}")
