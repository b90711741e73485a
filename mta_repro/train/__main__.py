"""``python -m mta_repro.train experiment=debug run_dir=runs/debug`` (Hydra CLI).

Launch N ranks with ``torchrun --nproc_per_node N -m mta_repro.train ...`` or under
SLURM with ``srun`` (see slurm/train.sbatch); a single process needs no launcher.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from mta_repro.config import CONFIG_DIR


@hydra.main(config_path=str(CONFIG_DIR), config_name="train", version_base=None)
def main(cfg: DictConfig) -> None:
    from mta_repro.train.loop import train

    train(cfg)


if __name__ == "__main__":
    main()
