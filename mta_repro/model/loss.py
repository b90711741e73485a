"""The model's loss on token sequences: the training loss, and the summed cross entropy and
perplexity that validation and evaluation count."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def cross_entropy(model, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross entropy over all positions, computed in fp32.

    inputs, targets: (B, T) -> scalar."""
    logits = model(inputs)  # (B, T, V)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


@torch.no_grad()
def sequence_ce(model, inputs: torch.Tensor, targets: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """Summed cross-entropy (fp32 or better) over all positions of (B, T) inputs."""
    h = model(inputs, return_hidden=True)  # (B, T, dim)
    total = torch.zeros((), dtype=torch.promote_types(h.dtype, torch.float32), device=h.device)
    for s in range(0, h.shape[1], chunk):  # never materialise all (B, T, V) logits
        logits = model.logits(h[:, s : s + chunk]).to(total.dtype)
        total += F.cross_entropy(logits.flatten(0, 1), targets[:, s : s + chunk].flatten(), reduction="sum")
    return total


def perplexity(loss: float) -> float:
    """exp(loss); ``inf`` past the largest float (exp overflows above ~709.78), NaN for NaN."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf
