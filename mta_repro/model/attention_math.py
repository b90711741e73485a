"""The attention math of every variant, as pure functions on tensors.

One function per layer kind (``ModelArgs.layer_kind``): ``sdpa`` (the baseline),
``diff_attention`` (Differential Transformer) and ``explicit_attention_torch`` (MTA and
talking heads: the score transforms on explicit scores, the reference every other
implementation of the explicit path is tested against), with the pieces they are made of:
the key-query convolution on a dense score matrix, head mixing, RMSNorm. Everything here is
free of parameters and modules, so each piece can be checked against a plain formula.

Shapes: B batch, H heads, Tq queries, Tk keys, d head_dim. Query row i sits at absolute
position ``q_offset + i``; keys sit at 0..Tk-1 (a KV cache holds the earlier ones).
The faster engine of the explicit path is ``attention_blocked``; the registry that picks one
by ``model.attn_impl`` is ``attention_registry``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from mta_repro.kernels.interface import AttnMask, ExplicitAttnParams, pad_left

# The score-path weights of ``ExplicitAttnParams``, in the order the engines pass them.
WEIGHT_FIELDS = ("mta_kernel", "wpsm", "mta_kernel_after_sm", "head_kernel", "wposm")


def kq_conv_dense(scores: torch.Tensor, kernel: torch.Tensor, pad_key: str) -> torch.Tensor:
    """Depthwise key-query convolution (paper eq. 4/5, release ``_mta_convolution``).

    scores: (B, H, Tq, Tk), already zero where masked. kernel: (H, 1, c_q, c_k).
    out[i, j] = sum_{a<c_q, b<c_k} K[a, b] * S[i + a - (c_q - 1), j + b - p_left],
    p_left = (c_k-1)/2 ("both"), c_k-1 ("left") or 0 ("right"); out-of-range S is 0.
    The query direction only looks back: row i sees rows i-c_q+1 .. i.
    """
    n_heads, _, c_q, c_k = kernel.shape
    p_left = pad_left(pad_key, c_k)
    padded = F.pad(scores, (p_left, c_k - 1 - p_left, c_q - 1, 0))
    return F.conv2d(padded, kernel.to(scores.dtype), groups=n_heads)


def identity_kq_kernel(n_heads: int, c_q: int, c_k: int, pad_key: str) -> torch.Tensor:
    """The kernel for which ``kq_conv_dense`` is the identity: current row, offset-0 key."""
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


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim in fp32, cast back, then scaled (release/unilm order)."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)
    return out * weight if weight is not None else out


def lambda_init_fn(layer_id: int) -> float:
    """Differential Transformer's depth-dependent lambda_init (layer_id 0-based)."""
    return 0.8 - 0.6 * math.exp(-0.3 * layer_id)


# ------------------------------------------------------------ fused softmax attention
def sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttnMask, dropout: float = 0.0, fn: Callable | None = None
) -> torch.Tensor:
    """Causal softmax attention through F.scaled_dot_product_attention (flash kernels), or
    ``fn`` with its signature (``AttnKernels.sdpa``).

    q: (B, H, Tq, d); k, v: (B, H, Tk, dv) -> (B, H, Tq, dv). A dense mask only when a
    cache (q_offset) or padding needs one.
    """
    fn = fn or F.scaled_dot_product_attention
    tq, tk = q.shape[2], k.shape[2]
    if mask.q_offset == 0 and mask.key_valid is None and tq == tk:
        return fn(q, k, v, is_causal=True, dropout_p=dropout)
    allowed = mask.dense(tq, tk, q.device)
    # A pad query row would be all-masked (NaN); let it see itself. Real rows never
    # attend to pads, so this changes nothing a real token sees.
    eye = torch.zeros_like(allowed[:1, :1])
    eye[..., torch.arange(tq), mask.q_offset + torch.arange(tq)] = True
    return fn(q, k, v, attn_mask=allowed | eye, dropout_p=dropout)


def diff_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lam: torch.Tensor,
    mask: AttnMask,
    dropout: float = 0.0,
    fn: Callable | None = None,
) -> torch.Tensor:
    """Differential attention (A1 - lam A2) V = A1 V - lam A2 V: two fused calls.

    q, k, v: (B, H, T, d) of the H = 2 x H' q/k heads; diff head i uses q/k heads 2i and
    2i+1 and the values of heads 2i, 2i+1 side by side (size 2d). lam: scalar.
    Returns (B, H', Tq, 2d).
    """
    b, h, tq, d = q.shape
    tk = k.shape[2]
    q = q.view(b, h // 2, 2, tq, d)
    k = k.view(b, h // 2, 2, tk, d)
    v = v.transpose(1, 2).reshape(b, tk, h // 2, 2 * d).transpose(1, 2)  # (B, H', Tk, 2d)
    a1 = sdpa(q[:, :, 0], k[:, :, 0], v, mask, dropout, fn)
    a2 = sdpa(q[:, :, 1], k[:, :, 1], v, mask, dropout, fn)
    return a1 - lam * a2


def explicit_attention_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    p: ExplicitAttnParams,
    mask: AttnMask,
    training: bool = False,
) -> torch.Tensor:
    """Materialised-scores attention with the MTA score transforms, in release order.

    q: (B, H, Tq, d); k, v: (B, H, Tk, d). Returns (B, H, Tq, d). With every parameter
    None this is plain softmax attention. The reference every implementation must match.
    """
    masked = ~mask.dense(q.shape[2], k.shape[2], q.device)
    scores = torch.matmul(q, k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    if p.mta_kernel is not None:
        # Masked scores must be 0 so the convolution does not read the future.
        scores = kq_conv_dense(scores.masked_fill(masked, 0.0), p.mta_kernel, p.pad_key)
    if p.wpsm is not None:
        scores = head_mix_linear(scores, p.wpsm)
    scores = scores.masked_fill(masked, float("-inf"))
    probs = F.softmax(scores.to(torch.promote_types(scores.dtype, torch.float32)), dim=-1)
    # A fully masked (pad) row is NaN after softmax; it must be exactly 0.
    probs = probs.masked_fill(masked, 0.0).type_as(q)
    if p.mta_kernel_after_sm is not None:
        # No renormalisation: rows need not sum to 1 (as in the release).
        probs = kq_conv_dense(probs, p.mta_kernel_after_sm, p.pad_key).masked_fill(masked, 0.0)
    if p.head_kernel is not None:
        probs = head_conv(probs, p.head_kernel)
    elif p.wposm is not None:
        probs = head_mix_linear(probs, p.wposm)
    if p.dropout > 0.0 and training:
        probs = F.dropout(probs, p=p.dropout)
    return torch.matmul(probs, v)


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
