"""AdamW and the learning-rate schedule of the paper (section 4) and the release's configs.

``build_optimizer(model, optim_args)`` and ``build_lr_scheduler(optimizer, optim_args,
total_steps)`` are the whole interface (the toy task uses them too). Defaults are the
paper's 880M run: AdamW (0.9, 0.98), eps 1e-8, weight decay 0.05 on *all* parameters,
warmup from 0 over 375 steps, then linear decay to 0.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mta_repro.dataclass_config import to_dataclass
from mta_repro.errors import UserError

SCHEDULERS = ("linear", "cosine", "constant")
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


@dataclass
class OptimArgs:
    """Optimiser and schedule (root config field ``optim``, group ``configs/optim``)."""

    # Peak learning rate (reached at the end of warmup).
    lr: float = 1.5e-4
    beta1: float = 0.9
    beta2: float = 0.98
    eps: float = 1e-8
    # Decoupled AdamW weight decay; applied to every parameter unless
    # ``exclude_norms_and_1d`` (the release decays everything, norms included).
    weight_decay: float = 0.05
    # Exempt norm weights, biases and other 1-D parameters from weight decay.
    exclude_norms_and_1d: bool = False
    # Global gradient-norm clip; 0 or negative disables clipping.
    clip: float = 1.0
    # Linear warmup from lr=0 at step 0 to ``lr`` at step ``warmup``.
    warmup: int = 375
    # Warmup as a fraction of trainer.steps (e.g. 0.01); when set it replaces ``warmup``,
    # so a shortened run (trainer.steps=30) keeps the same schedule shape. null = use
    # ``warmup`` steps. A warmup of >= trainer.steps never reaches ``lr``: warned.
    warmup_frac: float | None = None
    # After warmup: "linear" decays to ``lr_min_ratio * lr`` at the last step (paper: to
    # 0), "cosine" follows a half cosine to the same floor, "constant" stays at ``lr``.
    scheduler: str = "linear"
    # Floor of the decay as a fraction of ``lr`` (0 = decay to zero as in the paper).
    lr_min_ratio: float = 0.0
    # torch's fused / foreach AdamW kernels (None = torch's default choice).
    fused: Any = None

    def __post_init__(self) -> None:
        if self.scheduler not in SCHEDULERS:
            raise UserError(f"optim.scheduler: expected one of {SCHEDULERS}, got {self.scheduler!r}")
        for name in ("lr", "eps", "weight_decay", "clip"):  # nan passes every comparison: check it first
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise UserError(f"optim.{name}: expected a finite number, got {v!r}")
            # The optimiser's kernels take these as float32 scalars: a larger one is a
            # traceback there, not a divergence the loop could report.
            if abs(v) > FLOAT32_MAX:
                raise UserError(f"optim.{name}: expected at most {FLOAT32_MAX:.4g} (the largest float32), got {v!r}")
        for name in ("lr", "eps", "weight_decay"):  # AdamW's own ranges, checked before the model is built
            if getattr(self, name) < 0:
                raise UserError(f"optim.{name}: expected >= 0, got {getattr(self, name)}")
        if self.warmup < 0:
            raise UserError(f"optim.warmup: expected >= 0 steps, got {self.warmup}")
        if self.warmup_frac is not None and not 0.0 <= self.warmup_frac < 1.0:
            raise UserError(
                f"optim.warmup_frac: expected a fraction in [0, 1) of trainer.steps, got {self.warmup_frac}"
            )
        if not 0.0 <= self.lr_min_ratio <= 1.0:
            raise UserError(f"optim.lr_min_ratio: expected in [0, 1], got {self.lr_min_ratio}")
        for name in ("beta1", "beta2"):
            v = getattr(self, name)
            if not 0.0 <= v < 1.0:
                raise UserError(f"optim.{name}: expected in [0, 1), got {v}")


def to_optim_args(cfg: OptimArgs | dict | Any) -> OptimArgs:
    """OptimArgs from an OptimArgs, a plain dict or an OmegaConf node (validated)."""
    return to_dataclass(OptimArgs, cfg, "optim")


def _no_decay(name: str, p: torch.Tensor) -> bool:
    # Norm weights (RMSNorm's ``weight`` under *norm / subln), biases and any other
    # 1-D parameter (e.g. the Differential Transformer's lambda vectors).
    return p.ndim <= 1 or "norm" in name or name.endswith("subln.weight") or name.endswith(".bias")


def param_groups(model: nn.Module, args: OptimArgs) -> list[dict]:
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not args.exclude_norms_and_1d:
        return [{"params": [p for _, p in params], "weight_decay": args.weight_decay}]
    decay = [p for n, p in params if not _no_decay(n, p)]
    no_decay = [p for n, p in params if _no_decay(n, p)]
    return [
        {"params": decay, "weight_decay": args.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(model: nn.Module, optim_args: OptimArgs | dict | Any) -> torch.optim.AdamW:
    """AdamW over the model's trainable parameters (works on FSDP2-sharded models)."""
    args = to_optim_args(optim_args)
    kwargs = {}
    if args.fused is not None:
        kwargs["fused"] = bool(args.fused)
    return torch.optim.AdamW(
        param_groups(model, args),
        lr=args.lr,
        betas=(args.beta1, args.beta2),
        eps=args.eps,
        weight_decay=args.weight_decay,
        **kwargs,
    )


def warmup_steps(args: OptimArgs, total_steps: int) -> int:
    """The warmup length in steps: ``round(warmup_frac * total_steps)`` if set, else ``warmup``."""
    if args.warmup_frac is not None:
        return int(round(args.warmup_frac * total_steps))
    return args.warmup


def lr_factor(step: int, args: OptimArgs, total_steps: int) -> float:
    """Multiplier of ``args.lr`` used for the update of 0-based step ``step``.

    Warmup from 0: factor step/warmup, so the first update uses lr 0 (as Lingua's
    ``lr_linear``). After warmup the factor goes from 1 at ``warmup`` to
    ``lr_min_ratio`` at ``total_steps``.
    """
    warmup = warmup_steps(args, total_steps)
    if warmup > 0 and step < warmup:
        return step / warmup
    if args.scheduler == "constant":
        return 1.0
    span = max(1, total_steps - warmup)
    progress = min(1.0, max(0.0, (step - warmup) / span))
    floor = args.lr_min_ratio
    if args.scheduler == "linear":
        return floor + (1.0 - floor) * (1.0 - progress)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, optim_args: OptimArgs | dict | Any, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Warmup from 0, then linear (or cosine) decay; call ``.step()`` after each update.

    The scheduler's state_dict holds only the step counter, so it checkpoints trivially.
    """
    args = to_optim_args(optim_args)
    if total_steps < 1:
        raise UserError(f"trainer.steps: expected a positive number of steps, got {total_steps}")
    warmup = warmup_steps(args, total_steps)
    if warmup >= total_steps:
        peak = lr_factor(total_steps - 1, args, total_steps)
        warnings.warn(
            f"optim.warmup={warmup} >= trainer.steps={total_steps}: the learning rate never reaches "
            f"optim.lr (at most {peak:.1%} of it); set optim.warmup_frac (e.g. 0.01) or a shorter optim.warmup",
            UserWarning,
            stacklevel=2,
        )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, args, total_steps))
