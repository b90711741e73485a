"""The paper's model family: ``build_model(model_cfg)`` returns the decoder."""

from __future__ import annotations

from typing import Any

import torch

from mta_repro.dataclass_config import to_dataclass
from mta_repro.model.args import ModelArgs, MTAArgs
from mta_repro.model.transformer import KVCache, Transformer

__all__ = ["MTAArgs", "ModelArgs", "Transformer", "KVCache", "build_model", "to_model_args"]


def to_model_args(cfg: ModelArgs | dict | Any) -> ModelArgs:
    """ModelArgs from a ModelArgs, a plain dict or an OmegaConf node (validated)."""
    return to_dataclass(ModelArgs, cfg, "model")


def build_model(
    model_cfg: ModelArgs | dict | Any,
    device: str | torch.device = "cpu",
    init: bool = True,
) -> Transformer:
    """Build on the meta device (no memory, any size), then materialise on ``device``.

    ``device="meta"`` returns the unmaterialised model (parameter counting, or a model
    that the trainer shards before materialising). ``init`` runs the seeded Lingua init.
    """
    args = to_model_args(model_cfg)
    with torch.device("meta"):
        model = Transformer(args)
    if str(device) != "meta":
        model.to_empty(device=device)
        if init:
            model.init_weights()
    return model
