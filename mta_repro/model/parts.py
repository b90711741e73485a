"""Pieces the decoder (``transformer.py``) and the MTA core (``mta_layer.py``) share: the
RMSNorm of the block norms and of MTA's group norm, the release's depth scaling, and the
initialisation helpers that write into any parameter (plain, on any device, or FSDP-sharded)."""

from __future__ import annotations

import math

import torch
from torch import nn

from mta_repro.model import attention_ops


class RMSNorm(nn.Module):
    def __init__(
        self,
        dim: int,
        eps: float = 1e-5,
        cast_before_weight: bool = False,
        out_scale: float = 1.0,
        out_scale_fp64: float | None = None,
    ):
        super().__init__()
        self.eps = eps
        # A constant factor on the output (the release's ``curse_norm`` depth scaling);
        # out_scale_fp64 (if given) replaces it for fp64 inputs (``release_depth_scale``).
        self.out_scale = out_scale
        self.out_scale_fp64 = out_scale if out_scale_fp64 is None else out_scale_fp64
        # Rounding order in bf16/fp16 (``ModelArgs.norm_order``): True = normalise in fp32,
        # cast to x's dtype, then scale by the weight (the release's block norms and its
        # ``subln``); False = scale in fp32, then cast (Lingua's RMSNorm).
        self.cast_before_weight = cast_before_weight
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cast_before_weight:
            out = attention_ops.rms_norm(x, self.weight, self.eps)
        else:
            # Lingua: normalise in fp32 (fp64 stays fp64), scale by the weight, cast back.
            x32 = x.to(torch.promote_types(x.dtype, torch.float32))
            out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
            out = (out * self.weight.to(out.dtype)).type_as(x)
        scale = self.out_scale_fp64 if out.dtype == torch.float64 else self.out_scale
        return out if scale == 1.0 else out * scale

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def release_depth_scale(layer_id: int, fp64: bool = False) -> float:
    """1 - lambda_init(layer) as the release computes it for ``curse_norm`` and
    ``layer_norm_rescale``: its RMSNorm holds layer_id as a tensor, so -0.3 * layer_id is
    a tensor of the default dtype before the exp: fp32 in every real run (an fp32 ulp
    apart from the exact value at some depths, which can flip a bf16 rounding); ``fp64``:
    the exact value (the release run with default dtype float64)."""
    if fp64:
        return 1 - (0.8 - 0.6 * math.exp(-0.3 * layer_id))
    x = float(torch.tensor(-0.3, dtype=torch.float32, device="cpu") * layer_id)  # also under a meta context
    return 1 - (0.8 - 0.6 * math.exp(x))


def trunc_normal_(w: torch.Tensor, std: float, bound_std: float | None = None) -> None:
    """Truncated normal at +-3 x ``bound_std`` (default ``std``). Lingua truncates the
    output projections at 3 x the std *before* its depth factor divides it."""
    bound = 3 * (std if bound_std is None else bound_std)
    nn.init.trunc_normal_(w, mean=0.0, std=std, a=-bound, b=bound)


def copy_into(param: torch.Tensor, value: torch.Tensor) -> None:
    """Copy a full CPU tensor into a parameter that may live on any device or be an
    FSDP-sharded DTensor (the release's inits only worked on DTensors)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        value = distribute_tensor(value.to(param.device, param.dtype), param.device_mesh, param.placements)
    param.copy_(value)
