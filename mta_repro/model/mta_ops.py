"""The attention math as pure functions on tensors.

Everything here is free of parameters and modules, so each piece can be checked against
a plain formula and a faster kernel can replace one function (register it in
``ATTN_IMPLS`` and select it with ``model.attn_impl``) without touching the model.

Shapes: B batch, H heads, Tq queries, Tk keys, d head_dim. Query row i sits at absolute
position ``q_offset + i``; keys sit at 0..Tk-1 (a KV cache holds the earlier ones).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F


def allowed_mask(
    tq: int,
    tk: int,
    q_offset: int,
    device: torch.device,
    key_valid: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Which (query, key) pairs may interact: causal, minus padding.

    Returns bool (1, 1, Tq, Tk), or (B, 1, Tq, Tk) when ``key_valid`` (B, Tk) marks real
    (non-pad) positions. A pad query row is all False, so in the explicit path it
    contributes exactly the zeros that the convolution's own padding would.
    """
    qpos = torch.arange(tq, device=device)[:, None] + q_offset
    kpos = torch.arange(tk, device=device)[None, :]
    mask = (kpos <= qpos)[None, None]
    if key_valid is not None:
        q_valid = key_valid[:, q_offset : q_offset + tq]
        mask = mask & key_valid[:, None, None, :] & q_valid[:, None, :, None]
    return mask


def kq_conv(scores: torch.Tensor, kernel: torch.Tensor, pad_key: str) -> torch.Tensor:
    """Depthwise key-query convolution (paper eq. 4/5, release ``_mta_convolution``).

    scores: (B, H, Tq, Tk), already zero where masked. kernel: (H, 1, c_q, c_k).
    out[i, j] = sum_{a<c_q, b<c_k} K[a, b] * S[i + a - (c_q - 1), j + b - p_left],
    p_left = (c_k-1)/2 ("both"), c_k-1 ("left") or 0 ("right"); out-of-range S is 0.
    The query direction only looks back: row i sees rows i-c_q+1 .. i.
    """
    n_heads, _, c_q, c_k = kernel.shape
    p_left = {"both": (c_k - 1) // 2, "left": c_k - 1, "right": 0}[pad_key]
    padded = F.pad(scores, (p_left, c_k - 1 - p_left, c_q - 1, 0))
    return F.conv2d(padded, kernel.to(scores.dtype), groups=n_heads)


def identity_kq_kernel(n_heads: int, c_q: int, c_k: int, pad_key: str) -> torch.Tensor:
    """The kernel for which ``kq_conv`` is the identity: current row, offset-0 key."""
    kernel = torch.zeros(n_heads, 1, c_q, c_k)
    col = {"both": c_k // 2, "left": c_k - 1, "right": 0}[pad_key]
    kernel[:, :, -1, col] = 1.0
    return kernel


def head_mix_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Full head mixing, nn.Linear convention (``wpsm``/``wposm``, output-major).

    x: (B, H, Tq, Tk); weight: (H_out, H_in). out[:, g] = sum_h weight[g, h] * x[:, h].
    """
    return torch.einsum("gh,bhqk->bgqk", weight.to(x.dtype), x)


def head_conv(x: torch.Tensor, kernel: torch.Tensor) -> torch.Tensor:
    """Grouped head convolution (``head_kernel``, input-major, release ``_head_convolution``).

    x: (B, H, Tq, Tk); kernel: (G, c_h, c_h) with H = G * c_h, heads grouped contiguously.
    out[:, g*c_h + j] = sum_i x[:, g*c_h + i] * kernel[g, i, j].
    """
    b, h, tq, tk = x.shape
    g, c_h, _ = kernel.shape
    x = x.view(b, g, c_h, tq, tk)
    out = torch.einsum("bgiqk,gij->bgjqk", x, kernel.to(x.dtype))
    return out.reshape(b, h, tq, tk)


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """RMSNorm over the last dim in fp32, cast back, then scaled (release/unilm order)."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)
    return out * weight if weight is not None else out


def lambda_init_fn(layer_id: int) -> float:
    """Differential Transformer's depth-dependent lambda_init (layer_id 0-based)."""
    return 0.8 - 0.6 * math.exp(-0.3 * layer_id)


@dataclass
class ExplicitAttnParams:
    """The score-path parameters of one layer (None = that part is off)."""

    mta_kernel: Optional[torch.Tensor] = None  # (H, 1, c_q, c_k), before softmax
    wpsm: Optional[torch.Tensor] = None  # (H, H), before softmax
    mta_kernel_after_sm: Optional[torch.Tensor] = None  # (H, 1, c_q', c_k'), after softmax
    head_kernel: Optional[torch.Tensor] = None  # (H/c_h, c_h, c_h), after softmax
    wposm: Optional[torch.Tensor] = None  # (H, H), after softmax
    pad_key: str = "both"
    dropout: float = 0.0


def explicit_attention_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    p: ExplicitAttnParams,
    allowed: torch.Tensor,
    training: bool = False,
) -> torch.Tensor:
    """Materialised-scores attention with the MTA score transforms, in release order.

    q: (B, H, Tq, d); k, v: (B, H, Tk, d); allowed: bool broadcastable to (B, H, Tq, Tk).
    Returns (B, H, Tq, d). With every parameter None this is plain softmax attention.
    """
    masked = ~allowed
    scores = torch.matmul(q, k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    if p.mta_kernel is not None:
        # Masked scores must be 0 so the convolution does not read the future.
        scores = kq_conv(scores.masked_fill(masked, 0.0), p.mta_kernel, p.pad_key)
    if p.wpsm is not None:
        scores = head_mix_linear(scores, p.wpsm)
    scores = scores.masked_fill(masked, float("-inf"))
    probs = F.softmax(scores.to(torch.promote_types(scores.dtype, torch.float32)), dim=-1)
    # A fully masked (pad) row is NaN after softmax; it must be exactly 0.
    probs = probs.masked_fill(masked, 0.0).type_as(q)
    if p.mta_kernel_after_sm is not None:
        # No renormalisation: rows need not sum to 1 (as in the release).
        probs = kq_conv(probs, p.mta_kernel_after_sm, p.pad_key).masked_fill(masked, 0.0)
    if p.head_kernel is not None:
        probs = head_conv(probs, p.head_kernel)
    elif p.wposm is not None:
        probs = head_mix_linear(probs, p.wposm)
    if p.dropout > 0.0 and training:
        probs = F.dropout(probs, p=p.dropout)
    return torch.matmul(probs, v)


# Registry of explicit-path implementations (``model.attn_impl``). A fused kernel with
# the same signature and semantics registers here and is tested against "torch".
ATTN_IMPLS: dict[str, Callable[..., torch.Tensor]] = {"torch": explicit_attention_torch}


def query_history(params: ExplicitAttnParams) -> int:
    """How many earlier query rows a new row's output depends on (for KV caching).

    The post-softmax conv reads c_q'-1 earlier probability rows, each of which came from
    the pre-softmax conv reading c_q-1 rows further back.
    """
    w = 0
    if params.mta_kernel is not None:
        w += params.mta_kernel.shape[2] - 1
    if params.mta_kernel_after_sm is not None:
        w += params.mta_kernel_after_sm.shape[2] - 1
    return w
