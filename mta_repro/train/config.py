"""The root config schema and Hydra composition.

Each part of the project defines its own dataclass next to its code (``ModelArgs`` in
``mta_repro.model.args``, ...) and the root ``TrainConfig`` collects them, so a typo in a
field name or a wrong type fails when Hydra composes the config. ``configs/`` holds the
YAML groups; ``compose(overrides)`` gives the same config as the command line would.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from mta_repro.data.args import DataArgs
from mta_repro.model.args import ModelArgs
from mta_repro.resolvers import register_resolvers
from mta_repro.resources import CONFIG_DIR
from mta_repro.train.args import CheckpointArgs, DistributedArgs, LoggingArgs, RunArgs, SlurmArgs, TrainerArgs
from mta_repro.train.optim import OptimArgs


@dataclass
class TrainConfig:
    # Where checkpoints, metrics.jsonl and results go; a run resumes from here.
    run_dir: str = field(default="runs/debug", metadata={"run_dir": "free"})
    # Seed of everything not seeded elsewhere (the model init has model.seed).
    seed: int = 42
    model: ModelArgs = field(default_factory=ModelArgs)
    # Trainer sections (mta_repro/train/args.py, mta_repro/train/optim.py).
    optim: OptimArgs = field(default_factory=OptimArgs)
    trainer: TrainerArgs = field(default_factory=TrainerArgs)
    checkpoint: CheckpointArgs = field(default_factory=CheckpointArgs)
    logging: LoggingArgs = field(default_factory=LoggingArgs)
    distributed: DistributedArgs = field(default_factory=DistributedArgs)
    slurm: SlurmArgs = field(default_factory=SlurmArgs)
    # Corpus, mixture, packing, tokenizer (mta_repro/data/args.py; configs/data/).
    data: DataArgs = field(default_factory=DataArgs)
    # What the run is in the paper's protocol: stage, variant, sweep point (train/args.py).
    run: RunArgs = field(default_factory=RunArgs)

    def __post_init__(self) -> None:
        check_seq_len(getattr(self.data, "seq_len", None), getattr(self.model, "max_seqlen", None))


def check_seq_len(seq_len, max_seqlen, what: str = "data.seq_len") -> None:
    """Training and finetuning sequences no longer than the model is meant for: a
    ``data.seq_len`` above ``model.max_seqlen`` is a typo far more often than a plan (and
    a 100,000-token window on a 4096-token model runs for minutes before its first step)."""
    if isinstance(seq_len, int) and isinstance(max_seqlen, int) and seq_len > max_seqlen:
        from mta_repro.errors import UserError

        raise UserError(
            f"{what}={seq_len} is longer than model.max_seqlen={max_seqlen}, the longest sequence the "
            f"model is meant for; lower {what}, or set model.max_seqlen={seq_len} for a model meant for "
            f"{seq_len}-token sequences"
        )


def register_configs() -> None:
    """Make the schema and the configs' resolvers (mta_repro/resolvers.py) known to Hydra
    and OmegaConf (idempotent); run at import, before anything here composes a config."""
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)
    register_resolvers()


register_configs()


def compose(overrides: Sequence[str] = (), config_name: str = "train", hydra_config: bool = False) -> DictConfig:
    """The project's one composition: ``configs/<config_name>.yaml`` with command-line style
    overrides, through Hydra's compose API. Every entry point (train, its sweeps, eval, the
    pipeline's plan, the SLURM renderer, estimate, hf) composes here, so a command line means
    the same config wherever it is given. ``hydra_config``: keep the ``hydra`` node
    (``hydra.mode``, ``hydra.sweeper.params``, what ``.hydra/hydra.yaml`` records)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():  # a caller's own initialisation: this one is self-contained
        GlobalHydra.instance().clear()
    # Initialised per call and cleared after (Hydra's initialisation is a few ms of the ~0.5 s)
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return hydra_compose(config_name=config_name, overrides=list(overrides), return_hydra_config=hydra_config)


def model_args_from(cfg: DictConfig, key: str | None = "model") -> ModelArgs:
    """Validated ``ModelArgs`` from a composed config (raises UserError on bad fields)."""
    from mta_repro.model import to_model_args

    return to_model_args(cfg[key] if key else cfg)


def check_schema(cfg: Any) -> None:
    """Refuse keys the schema does not know (Hydra's ``+key=`` adds them in silence), with
    the nearest field for a likely typo."""
    if not isinstance(cfg, DictConfig):
        return
    from mta_repro.dataclass_config import unknown_keys, unknown_keys_error
    from mta_repro.errors import UserError

    bad = [k for k in unknown_keys(TrainConfig, cfg, "") if k != "hydra"]
    if bad:
        raise UserError(unknown_keys_error(TrainConfig, bad))


def to_train_config(cfg: Any) -> TrainConfig:
    """The typed config of a training run, converted once: the schema check, then every
    section into its dataclass (``__post_init__`` validates the values). Accepts a composed
    DictConfig, a plain mapping or a TrainConfig."""
    if isinstance(cfg, TrainConfig):
        return cfg
    from mta_repro.dataclass_config import to_dataclass

    check_schema(cfg)
    if isinstance(cfg, DictConfig) and "hydra" in cfg:
        cfg = OmegaConf.masked_copy(cfg, [str(k) for k in cfg if k != "hydra"])
    return to_dataclass(TrainConfig, cfg, "")


def trained_seq_len(cfg) -> int | None:
    """The context a run was trained at (its saved config's data.seq_len: the last training
    stage's), if the config says. Evaluation refuses longer inputs; the HF export writes it
    as max_position_embeddings."""
    try:
        return int(cfg.data.seq_len)
    except (AttributeError, KeyError, TypeError, ValueError):
        return None
