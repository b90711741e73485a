"""Training sweeps that cannot merge.

``SweepRunDirGuard`` (a Hydra callback the ablation experiments install): a multirun whose
command line gives a plain ``run_dir=...`` would put every point in one directory (points
2..N "resume" point 1 and exit 0). It refuses that before any job starts, and refuses a
run dir that an earlier point of the same sweep already used.
"""

from __future__ import annotations

import sys
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf


def plain_run_dir_overrides(overrides) -> list:
    """The ``run_dir=...`` overrides that name one fixed directory (no interpolation)."""
    out = []
    for o in overrides:
        key, _, val = str(o).partition("=")
        if key.lstrip("+~") == "run_dir" and "${" not in val:
            out.append(str(o))
    return out


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
