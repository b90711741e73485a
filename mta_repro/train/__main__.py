"""``python -m mta_repro.train experiment=debug run_dir=runs/debug`` (Hydra CLI).

Launch N ranks with ``torchrun --nproc_per_node N -m mta_repro.train ...`` or under
SLURM with ``srun`` (see slurm/train.sbatch); a single process needs no launcher.
Only rank 0 writes Hydra's output (``<run_dir>/.hydra`` and the job log): every other
rank runs with ``hydra.output_subdir=null`` and logs to stdout, so N ranks never write the
same files at once.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from mta_repro.config import CONFIG_DIR
from mta_repro.train.args import launcher_rank

# Appended to the command line of ranks other than 0 (a single run, not a sweep).
NON_ZERO_RANK_OVERRIDES = ("hydra.output_subdir=null", "hydra/job_logging=stdout")


def hydra_argv(argv: list[str]) -> list[str]:
    """argv with the rank-0-only output overrides added on the other ranks."""
    if launcher_rank() == 0 or any(a in ("-m", "--multirun") for a in argv):
        return argv
    return argv + [o for o in NON_ZERO_RANK_OVERRIDES if o not in argv]


@hydra.main(config_path=str(CONFIG_DIR), config_name="train", version_base=None)
def main(cfg: DictConfig) -> None:
    from mta_repro.cli import describe, user_errors
    from mta_repro.train.loop import train

    try:
        train(cfg)
    except user_errors() as e:
        # A user error (config, run directory, data, checkpoint): one line, exit 2.
        # Bugs and runtime failures keep their traceback.
        print(f"train: error: {describe(e)}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    sys.argv[1:] = hydra_argv(sys.argv[1:])
    main()
