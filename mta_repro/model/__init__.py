"""The paper's model family: ``build_model(model_cfg)`` returns the decoder."""

from __future__ import annotations

from typing import Any, Union

import torch

from mta_repro.model.args import MTAArgs, ModelArgs
from mta_repro.model.transformer import KVCache, Transformer

__all__ = ["MTAArgs", "ModelArgs", "Transformer", "KVCache", "build_model", "to_model_args"]


def to_model_args(cfg: Union[ModelArgs, dict, Any]) -> ModelArgs:
    """ModelArgs from a ModelArgs, a plain dict or an OmegaConf node (validated)."""
    if isinstance(cfg, ModelArgs):
        return cfg
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(cfg, DictConfig):
            obj = OmegaConf.to_object(cfg)
            if isinstance(obj, ModelArgs):
                return obj
            cfg = obj
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        pass
    if not isinstance(cfg, dict):
        raise ValueError(f"model config: expected ModelArgs, dict or DictConfig, got {type(cfg).__name__}")
    cfg = dict(cfg)
    unknown = set(cfg) - set(ModelArgs.__dataclass_fields__)
    if unknown:
        raise ValueError(f"model config: unknown field(s) {sorted(unknown)}")
    mta = cfg.pop("mta", None) or {}
    if not isinstance(mta, MTAArgs):
        unknown = set(mta) - set(MTAArgs.__dataclass_fields__)
        if unknown:
            raise ValueError(f"model.mta config: unknown field(s) {sorted(unknown)}")
        mta = MTAArgs(**mta)
    return ModelArgs(**cfg, mta=mta)


def build_model(
    model_cfg: Union[ModelArgs, dict, Any],
    device: Union[str, torch.device] = "cpu",
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
