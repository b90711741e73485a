"""The model's loss on token sequences: the training loss, and the summed cross entropy and
perplexity that validation and evaluation count."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def cross_entropy(model, inputs: torch.Tensor, targets: torch.Tensor, chunk_rows: int = 0) -> torch.Tensor:
    """Mean token cross entropy over all positions, computed in fp32.

    inputs, targets: (B, T) -> scalar. ``chunk_rows`` > 0 (``trainer.loss_chunk``): the same
    loss from the final hidden states in chunks of that many token rows, whose logits are
    recomputed in backward (``chunked_linear_cross_entropy``), so no (B, T, V) tensor is
    saved or live at once; 0: the plain loss, as the paper trains."""
    if chunk_rows <= 0:
        logits = model(inputs)  # (B, T, V)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))
    # inside the model's forward (Transformer.forward's targets=): under FSDP2 the root's
    # parameters, the output weight among them, are gathered only there
    return model(inputs, targets=targets, loss_chunk=chunk_rows)


def chunked_linear_cross_entropy(
    h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_rows: int, ignore_index: int = -100
) -> torch.Tensor:
    """``F.cross_entropy(F.linear(h, weight).float(), targets, ignore_index=ignore_index)``
    (the mean over the rows whose target is not ``ignore_index``) with at most ``chunk_rows``
    rows of logits at a time. h: (N, D) in the compute dtype, weight: (V, D), targets: (N,).
    Saved for backward: h, weight, targets and one fp32 log-sum-exp per row, against the
    plain loss's fp32 (N, V) log-softmax; backward recomputes each chunk's logits."""
    return _ChunkedLinearCE.apply(h, weight, targets, int(chunk_rows), ignore_index)


class _ChunkedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, chunk_rows, ignore_index):
        dtype = torch.promote_types(h.dtype, torch.float32)  # fp32, or float64 for float64 inputs
        lse = torch.empty(h.shape[0], dtype=dtype, device=h.device)  # (N,)
        total = torch.zeros((), dtype=dtype, device=h.device)
        for s in range(0, h.shape[0], chunk_rows):
            logits = F.linear(h[s : s + chunk_rows], weight).to(total.dtype)  # (n, V), as the plain loss
            lse_c = torch.logsumexp(logits, dim=-1)
            lse[s : s + chunk_rows] = lse_c
            t = targets[s : s + chunk_rows]
            valid = t != ignore_index
            picked = logits.gather(1, t.clamp(min=0).unsqueeze(1)).squeeze(1)
            total += torch.where(valid, lse_c - picked, 0).sum()
        count = (targets != ignore_index).sum()
        ctx.save_for_backward(h, weight, targets, lse, count)
        ctx.chunk_rows, ctx.ignore_index = chunk_rows, ignore_index
        return total / count

    @staticmethod
    def backward(ctx, grad_out):
        h, weight, targets, lse, count = ctx.saved_tensors
        scale = grad_out / count
        grad_h = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=scale.dtype, device=weight.device) if ctx.needs_input_grad[1] else None
        for s in range(0, h.shape[0], ctx.chunk_rows):
            h_c, t = h[s : s + ctx.chunk_rows], targets[s : s + ctx.chunk_rows]
            logits = F.linear(h_c, weight).to(scale.dtype)  # recomputed: (n, V)
            g = torch.exp(logits - lse[s : s + ctx.chunk_rows, None])  # softmax
            del logits
            valid = t != ctx.ignore_index
            g.scatter_add_(1, t.clamp(min=0).unsqueeze(1), -torch.ones_like(g[:, :1]))
            g *= torch.where(valid, scale, 0).unsqueeze(1)
            g = g.to(h.dtype)  # as the plain loss casts its fp32 gradient back to the logits' dtype
            if grad_h is not None:
                grad_h[s : s + ctx.chunk_rows] = g @ weight
            if grad_w is not None:
                grad_w += (g.t() @ h_c).to(grad_w.dtype)
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None


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
