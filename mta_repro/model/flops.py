"""FLOPs per token of each variant (MTA_SPEC section 7), for MFU and planning.

Counts multiply-adds as 2 FLOPs. Dense matmuls: 2 * (attention projections + SwiGLU)
per layer plus the output head. The attention core (Q K^T and A V) is counted at the
achieved causal work (half the T x T matrix). MTA's extras run on the full
materialised (T, T) score matrix, so they are counted at full T: two key-query
convolutions in conv layers, two head mixings in every layer that mixes heads.
Training = 3 x forward (backward ~ 2 x forward).
"""

from __future__ import annotations

from mta_repro.model.args import ModelArgs


def forward_flops_per_token(args: ModelArgs, seq_len: int) -> dict[str, float]:
    d, L, H = args.dim, args.n_layers, args.n_heads
    hd = args.resolved_head_dim
    inner = H * hd
    dense = L * 2 * (4 * d * inner + 3 * d * args.ffn_hidden_dim) + 2 * d * args.vocab_size
    # Q K^T + A V over an average causal context of T/2.
    qk = 2 * seq_len * inner
    av = 2 * seq_len * inner
    if args.diff_transformer:
        av *= 2  # two A V products, each with values of size 2*head_dim over H/2 heads
    attn = L * (qk + av) / 2
    mta = 0.0
    m = args.mta
    if m.use_mta:
        conv_layers = len(args.conv_layer_ids())
        for c_q, c_k in (
            (m.query_kernel_size, m.key_kernel_size),
            (m.after_sm_query_kernel_size, m.after_sm_key_kernel_size),
        ):
            if c_q is not None:
                mta += conv_layers * 2 * H * seq_len * c_q * c_k
        mix_layers = L if (m.pre_sm_linear_head or m.post_sm_linear_head or m.head_kernel_size) else conv_layers
        if m.pre_sm_linear_head:
            mta += mix_layers * 2 * H * seq_len * H
        if m.head_kernel_size:
            mta += mix_layers * 2 * H * seq_len * m.head_kernel_size
        elif m.post_sm_linear_head:
            mta += mix_layers * 2 * H * seq_len * H
    total = dense + attn + mta
    return {"dense": float(dense), "attention": float(attn), "mta": float(mta), "total": float(total)}


def train_flops_per_token(args: ModelArgs, seq_len: int) -> float:
    return 3.0 * forward_flops_per_token(args, seq_len)["total"]
