"""``python -m mta_repro.train experiment=debug run_dir=runs/debug`` (Hydra CLI).

Launch N ranks with ``torchrun --nproc_per_node N -m mta_repro.train ...`` or under
SLURM with ``srun`` (see slurm/train.sbatch); a single process needs no launcher.
Only rank 0 writes Hydra's output (``<run_dir>/.hydra`` and the job log): every other
rank runs with ``hydra.output_subdir=null`` and logs to stdout, so N ranks never write the
same files at once.

A user error (a config key or option, the run directory, data, a checkpoint) is one line
and exit status 2 (``mta_repro.cli.run_cli``); the overrides are checked before Hydra
starts, so an unknown key or config option is that one line too. Ctrl-C (or SIGTERM,
SIGUSR1/2) checkpoints at the next step boundary and exits with 128 + the signal's number
(130 for Ctrl-C, 143 for SIGTERM): the run is unfinished (docs/errors_and_signals.md).
"""

from __future__ import annotations

import os
import sys

import hydra
from omegaconf import DictConfig

from mta_repro.device import launcher_rank
from mta_repro.train.config import CONFIG_DIR

# Appended to the command line of ranks other than 0 (a single run, not a sweep).
NON_ZERO_RANK_OVERRIDES = ("hydra.output_subdir=null", "hydra/job_logging=stdout")
PROG = "train"


def staged_argv(argv: list[str]) -> list[str]:
    """argv with rank 0's ``.hydra/`` written to a folder of this start's own
    (``rundir.STAGED_HYDRA``), which becomes ``.hydra/`` only once the start is accepted: a
    refused start leaves the run's record of its command as it was. A sweep's jobs write
    theirs in their own output folders, not in a run dir; a user's own output_subdir is kept."""
    from mta_repro.train.rundir import STAGED_HYDRA

    if launcher_rank() != 0 or any(a in ("-m", "--multirun") for a in argv):
        return argv
    if any(a.split("=")[0].lstrip("+~") == "hydra.output_subdir" for a in argv):
        return argv
    # first: an override after an option (`--cfg job`) is not one for Hydra's argparse
    return [f"hydra.output_subdir={STAGED_HYDRA}{os.getpid()}", *argv]


def hydra_argv(argv: list[str]) -> list[str]:
    """argv with the rank-0-only output overrides added on the other ranks."""
    if launcher_rank() == 0 or any(a in ("-m", "--multirun") for a in argv):
        return argv
    return [*(o for o in NON_ZERO_RANK_OVERRIDES if o not in argv), *argv]


@hydra.main(config_path=str(CONFIG_DIR), config_name="train", version_base=None)
def main(cfg: DictConfig) -> None:
    from mta_repro.cli import run_cli
    from mta_repro.train.loop import train
    from mta_repro.train.signals import stop_exit_code

    def go() -> int:
        out = train(cfg)
        # Stopped by a signal (after its checkpoint): unfinished, 128 + the signal's number.
        sig = out.get("stopped_by_signal")
        return stop_exit_code(sig) if sig else 0

    # Inside Hydra's job (its output dir and logging stay as they are); SystemExit passes
    # through Hydra, which would print any other exception as a multi-line report.
    rc = run_cli(PROG, go)
    if rc:
        sys.exit(rc)


def cli(argv: list[str]) -> int:
    """Check the overrides (one line for an unknown key or option), then run Hydra's main."""
    from mta_repro.cli import check_hydra_overrides, run_cli
    from mta_repro.train.config import to_train_config
    from mta_repro.train.jobcheck import NO_CHECK, problems, raise_problems, resolved_overrides
    from mta_repro.train.rundir import check_writable

    check_paths = NO_CHECK not in argv
    argv = hydra_argv([a for a in argv if a != NO_CHECK])
    # A sweep submitted through submitit: its jobs wait in the queue, then start elsewhere
    slurm_sweep = any(a.lstrip("+") == "hydra/launcher=slurm" for a in argv)
    resolved: list[str] = []

    def check(cfg) -> None:
        to_train_config(cfg)  # every field's check (schema, values, data.seq_len <= model.max_seqlen)
        if not any(a in ("-m", "--multirun") for a in argv):  # before Hydra opens its log in it
            check_writable(cfg.run_dir)
        if slurm_sweep:
            if check_paths:  # what the jobs need at their start, on the first point's config
                raise_problems(problems(cfg))
            resolved.extend(resolved_overrides(cfg, argv))  # values read from the environment, written in

    rc = run_cli(PROG, lambda: check_hydra_overrides(argv, CONFIG_DIR, "train", check) or 0)
    if rc:
        return rc
    argv = staged_argv(argv + resolved)
    sys.argv[1:] = argv
    main()
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
