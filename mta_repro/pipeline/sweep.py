"""Sweeps that cannot merge: the conv-layer resolver and the Hydra sweep guard.

* ``${mta_layers_every:<n_layers>,<k>}`` (an OmegaConf resolver, registered with the
  others in ``mta_repro/resolvers.py``): every k-th layer counted from layer 2 (the release's
  ``2,6,10,...`` for k=4), derived from the model's depth, so the conv-layer sweep works for
  any size. A stride that leaves the model with fewer than two distinct choices
  (k >= n_layers) is refused with the valid range.
* ``${required:<field>,<what>}``: a field that must be given (the stage configs' source
  run), an error naming it when read unset.
* ``SweepRunDirGuard`` (a Hydra callback the ablation experiments install): a multirun whose
  command line gives a plain ``run_dir=...`` would put every point in one directory (points
  2..N "resume" point 1 and exit 0). It refuses that before any job starts, and refuses a
  run dir that an earlier point of the same sweep already used.
"""

from __future__ import annotations

import sys
from typing import Any

from omegaconf import DictConfig, OmegaConf

from mta_repro.errors import UserError

FIRST_CONV_LAYER = 2  # the release's choice: 2, 6, 10, ... (0-based)


def mta_layers_every(n_layers: Any, stride: Any) -> str:
    """Comma list of the layers ``FIRST_CONV_LAYER + i*stride`` below ``n_layers`` (stride 1: all)."""
    n, k = int(n_layers), int(stride)
    if k == 1:
        return ",".join(str(i) for i in range(n))
    if k < 1 or k >= n or FIRST_CONV_LAYER >= n:
        hi = n - 1
        raise UserError(
            f"model.mta.mta_layers: every {k}th layer is not a valid choice for model.n_layers={n} "
            f"(valid strides: 1..{hi}" + ("" if FIRST_CONV_LAYER < n else f"; a model of {n} layers has no layer "
                                             f"{FIRST_CONV_LAYER}") + ")"
        )
    return ",".join(str(i) for i in range(FIRST_CONV_LAYER, n, k))


def required(field: str, what: str = "a value") -> None:
    """``${required:checkpoint.init_from,'the pretraining run'}``: a field the user (or the
    pipeline) must set; reading it unset is an error naming the field. (A YAML ``???``
    cannot override a group's default: OmegaConf merges skip missing values.)"""
    raise UserError(f"{field}: required, give {what} ({field}=<absolute path>)")


def plain_run_dir_overrides(overrides) -> list:
    """The ``run_dir=...`` overrides that name one fixed directory (no interpolation)."""
    out = []
    for o in overrides:
        key, _, val = str(o).partition("=")
        if key.lstrip("+~") == "run_dir" and "${" not in val:
            out.append(str(o))
    return out


try:
    from hydra.experimental.callback import Callback
except ImportError:  # pragma: no cover - hydra is a dependency
    Callback = object


def _refuse(msg: str) -> None:
    # Hydra turns an Exception raised in a callback into a warning and runs on; SystemExit
    # is not an Exception, so the sweep stops here with one line.
    print(f"error: {msg}", file=sys.stderr)
    raise SystemExit(2)


class SweepRunDirGuard(Callback):
    """Refuse sweeps whose points would share a run directory (see the module docstring)."""

    def __init__(self) -> None:
        self.seen: dict = {}

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        # The raw strings: reading them from the config would resolve a run_dir's own
        # interpolation of the swept fields (and make it look fixed).
        plain = plain_run_dir_overrides(OmegaConf.to_container(config.hydra.overrides.task, resolve=False))
        if plain:
            _refuse(
                f"{plain[0]}: this experiment is a sweep and a fixed run_dir would put every point in one "
                "directory (later points would 'resume' the first one's checkpoint). Leave run_dir to the "
                "experiment (it names each point from the swept values), interpolate the swept values "
                "yourself (run_dir='/root/kernel_${model.mta.query_kernel_size}x${model.mta.key_kernel_size}'), "
                "or run the sweep through `python -m mta_repro.pipeline` with root=<dir>"
            )

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        run_dir = str(config.run_dir)
        me = list(config.hydra.overrides.task)
        if run_dir in self.seen and self.seen[run_dir] != me:
            _refuse(
                f"run_dir={run_dir}: already used by the sweep point {self.seen[run_dir]}; the point {me} needs "
                "its own directory (put every swept field into run_dir)"
            )
        self.seen[run_dir] = me
