"""FLOPs per token of each variant (dense layers, attention, MTA's convolutions and head
mixing), counting a multiply-add as 2 FLOPs, two ways.

Model FLOPs (``model_flops_per_token``, what MFU divides): the work the variant defines,
whatever runs it: 3 x forward, the forward being the dense matmuls (projections at
n_kv_heads for wk/wv, SwiGLU, the head) plus, per layer, Q K^T, A V and MTA's score
transforms (c_q x c_k taps per convolution, H per full head mixing, c_h per grouped one)
on the causal half of the T x T scores: the paper's cost model.

Hardware FLOPs (``hardware_flops_per_token``, reported as ``hfu``): what the chosen
implementation performs, so it rises when an implementation does more work. Fused sdpa
visits the causal half; the explicit path visits T x T ("torch") or, for "blocked", each
query block of b rows plus its halo of w rows against the keys up to its last row, and
recomputes each block's score path in backward (one more forward of it). An implementation
that counts its own (``AttnImpl.flops``) gives its forward and backward FLOPs.
"""

from __future__ import annotations

from dataclasses import replace

from mta_repro.model import attention_ops
from mta_repro.model.args import ModelArgs


def score_elements(args: ModelArgs, seq_len: int) -> float:
    """(query, key) pairs per head that the explicit path computes for one sequence."""
    if attention_ops.attn_impl(args.attn_impl).flops is not None:
        raise ValueError(f"score_elements: {args.attn_impl!r} counts its own FLOPs (AttnImpl.flops)")
    if args.attn_impl not in attention_ops.BLOCKED_ENGINE:
        return float(seq_len * seq_len)
    m = args.mta
    w = 0
    if m.query_kernel_size is not None:
        w += m.query_kernel_size - 1
    if m.after_sm_query_kernel_size is not None:
        w += m.after_sm_query_kernel_size - 1
    total = 0
    # null: the CUDA default (MFU is a GPU figure)
    bs = args.attn_block_size or attention_ops.DEFAULT_BLOCK_SIZE["cuda"]
    for r0 in range(0, seq_len, bs):
        r1 = min(r0 + bs, seq_len)
        total += (r1 - max(0, r0 - w)) * r1
    return float(total)


def _score_flops_per_element(args: ModelArgs, kind: str) -> int:
    """FLOPs of one (query, key) score element per head on the explicit path."""
    H, m = args.n_heads, args.mta
    per_elem = 4 * args.resolved_head_dim  # Q K^T and A V
    if kind == "kq_conv":
        for c_q, c_k in (
            (m.query_kernel_size, m.key_kernel_size),
            (m.after_sm_query_kernel_size, m.after_sm_key_kernel_size),
        ):
            if c_q is not None:
                assert c_k is not None
                per_elem += 2 * c_q * c_k
    if m.pre_sm_linear_head:
        per_elem += 2 * H
    if m.head_kernel_size:
        per_elem += 2 * m.head_kernel_size
    elif m.post_sm_linear_head:
        per_elem += 2 * H
    return per_elem


def _per_layer(args: ModelArgs, seq_len: int, kind: str) -> tuple[float, float]:
    """(forward attention FLOPs per token, score-path FLOPs recomputed in backward)."""
    H, hd = args.n_heads, args.resolved_head_dim
    if kind in ("sdpa", "diff"):
        av = 2 * seq_len * H * hd * (2 if kind == "diff" else 1)
        return (2 * seq_len * H * hd + av) / 2, 0.0
    own = attention_ops.attn_impl(args.attn_impl).flops
    if own is not None:
        counted = own(args, seq_len, kind)
        if counted is None:  # its fallback runs this layer
            return _per_layer(replace(args, attn_impl=attention_ops.attn_impl(args.attn_impl).fallback), seq_len, kind)
        fwd, bwd = counted
        return fwd, bwd - 2 * fwd  # training = 3 x fwd + this = fwd + bwd
    fwd = H * _score_flops_per_element(args, kind) * score_elements(args, seq_len) / seq_len
    return fwd, (fwd if args.attn_impl in attention_ops.BLOCKED_ENGINE else 0.0)


def forward_flops_per_token(args: ModelArgs, seq_len: int) -> dict[str, float]:
    d, L = args.dim, args.n_layers
    inner = args.n_heads * args.resolved_head_dim
    kv_inner = args.resolved_n_kv_heads * args.resolved_head_dim  # wk, wv (grouped-query)
    dense = L * 2 * (2 * d * inner + 2 * d * kv_inner + 3 * d * args.ffn_hidden_dim) + 2 * d * args.vocab_size
    attn = recompute = 0.0
    for i in range(L):
        f, r = _per_layer(args, seq_len, args.layer_kind(i))
        attn, recompute = attn + f, recompute + r
    return {"dense": float(dense), "attention": attn, "recompute": recompute, "total": float(dense + attn)}


def hardware_flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Training FLOPs per token that ``args.attn_impl`` performs (3 x forward + recomputation)."""
    f = forward_flops_per_token(args, seq_len)
    return 3.0 * f["total"] + f["recompute"]


def model_flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Training FLOPs per token the variant defines (3 x forward; explicit layers on the
    causal half of the scores, as the fused sdpa path counts), the same for every
    implementation: MFU's numerator."""
    d, L = args.dim, args.n_layers
    inner = args.n_heads * args.resolved_head_dim
    kv_inner = args.resolved_n_kv_heads * args.resolved_head_dim
    total = L * 2 * (2 * d * inner + 2 * d * kv_inner + 3 * d * args.ffn_hidden_dim) + 2 * d * args.vocab_size
    for i in range(L):
        kind = args.layer_kind(i)
        if kind in ("sdpa", "diff"):
            total += _per_layer(args, seq_len, kind)[0]
        else:
            total += args.n_heads * _score_flops_per_element(args, kind) * seq_len / 2
    return 3.0 * float(total)
