"""FLOPs per token of each variant (dense layers, attention, and MTA's convolutions and head mixing), for MFU and planning.

Counts multiply-adds as 2 FLOPs, and counts what each attention path computes
(``ModelArgs.layer_kind``):
- dense matmuls: 2 * (attention projections + SwiGLU) per layer plus the output head
  (wk/wv at n_kv_heads heads under grouped-query attention; the attention itself runs on
  all n_heads query heads, K/V repeated);
- "sdpa"/"diff": Q K^T and A V at the causal half of the T x T matrix (fused kernels
  skip the masked half; the Differential Transformer's two A V use values of size 2d);
- "kq_conv"/"mixing" (explicit path): Q K^T, A V and the score transforms (c_q x c_k
  taps per convolution, H per full head mixing, c_h per grouped head mixing) on the score
  elements the implementation visits: T x T for "torch"; for "blocked", each query block
  of b rows plus its halo of w rows against the keys up to its last row (about T^2/2).
Training = 3 x forward, plus one more forward of the explicit score path for "blocked",
which recomputes each block in backward: the FLOPs it performs, not a nominal count.
For "triton" (kernels/frames.py) every pass computes its stages on whole frames (owned
block plus halo) of the key blocks up to the diagonal; its four passes are counted stage
by stage as the kernel computes them (the pre-softmax conv as a GEMM of c_q d-long
products, the post conv and the adjoints as Toeplitz products, head mixing as a full
H x H product: the kernel expands ``head_kernel``), and training = their sum (reported as
3 x its two forward passes + the rest).
"""

from __future__ import annotations

from mta_repro.kernels import frames
from mta_repro.model.args import ModelArgs


def score_elements(args: ModelArgs, seq_len: int) -> float:
    """(query, key) pairs per head that the explicit path computes for one sequence."""
    if args.attn_impl == "triton":
        raise ValueError("score_elements: the triton path visits frames (flops._triton_passes)")
    if args.attn_impl != "blocked":
        return float(seq_len * seq_len)
    m = args.mta
    w = 0
    if m.query_kernel_size is not None:
        w += m.query_kernel_size - 1
    if m.after_sm_query_kernel_size is not None:
        w += m.after_sm_query_kernel_size - 1
    total = 0
    from mta_repro.model.attention_ops import DEFAULT_BLOCK_SIZE

    bs = args.attn_block_size or DEFAULT_BLOCK_SIZE["cuda"]  # null: the CUDA default (MFU is a GPU figure)
    for r0 in range(0, seq_len, bs):
        r1 = min(r0 + bs, seq_len)
        total += (r1 - max(0, r0 - w)) * r1
    return float(total)


def _triton_passes(args: ModelArgs, seq_len: int, kind: str) -> tuple[float, float]:
    """(FLOPs per token of the triton kernel's two forward passes, of its two backward passes)."""
    m, H, hd = args.mta, args.n_heads, args.resolved_head_dim
    pre = post = None
    if kind == "kq_conv":
        if m.query_kernel_size is not None:
            pre = (m.query_kernel_size, m.key_kernel_size)
        if m.after_sm_query_kernel_size is not None:
            post = (m.after_sm_query_kernel_size, m.after_sm_key_kernel_size)
    qk = 2 * hd  # also A V, dO V^T, dq, dk, dv: one d-long product per cell each
    mix1 = 2 * H if m.pre_sm_linear_head else 0
    mix2 = 2 * H if (m.head_kernel_size or m.post_sm_linear_head) else 0
    f_bwd = frames.frame("backward", pre, post, m.pad_key, args.kernels)  # the model's frame (model.kernels)
    # the kernel's products per frame cell (attention_triton.py): the pre-softmax conv as
    # the GEMM of shifted queries and convolved keys (c_q d-long products), the post conv
    # and every adjoint as one (frame columns)-wide Toeplitz product per row shift
    scores = qk * (pre[0] if pre else 1)

    def toe(k):
        return 2 * k[0] * f_bwd.ec if k else 0

    conv1, conv2 = toe(pre), toe(post)
    chain = scores + mix1
    per_cell = {
        "stats": chain,
        "forward": chain + conv2 + mix2 + qk,
        "backward_rowsum": chain + qk + mix2 + conv2,
        # dA, dR, (dP, R and the post kernel's gradient), dZ -> dC, A, the mixings'
        # gradients, (S, dS and the pre kernel's gradient), dq, dk, dv
        "backward": chain + qk + mix2 + 3 * conv2 + mix1 + mix2 + mix1 + mix2
        + ((qk + 2 * conv1) if pre else 0) + 3 * qk,
    }
    cost = {
        name: H * flops * frames.cells_visited(frames.frame(name, pre, post, m.pad_key, args.kernels), seq_len, seq_len) / seq_len
        for name, flops in per_cell.items()
    }
    return cost["stats"] + cost["forward"], cost["backward_rowsum"] + cost["backward"]


def _per_layer(args: ModelArgs, seq_len: int, kind: str) -> tuple[float, float]:
    """(forward attention FLOPs per token, score-path FLOPs recomputed in backward)."""
    H, hd = args.n_heads, args.resolved_head_dim
    if kind in ("sdpa", "diff"):
        av = 2 * seq_len * H * hd * (2 if kind == "diff" else 1)
        return (2 * seq_len * H * hd + av) / 2, 0.0
    if args.attn_impl == "triton":
        fwd, bwd = _triton_passes(args, seq_len, kind)
        return fwd, bwd - 2 * fwd  # training = 3 x fwd + this = fwd + bwd
    m = args.mta
    per_elem = 4 * hd  # Q K^T and A V
    if kind == "kq_conv":
        for c_q, c_k in ((m.query_kernel_size, m.key_kernel_size),
                         (m.after_sm_query_kernel_size, m.after_sm_key_kernel_size)):
            if c_q is not None:
                per_elem += 2 * c_q * c_k
    if m.pre_sm_linear_head:
        per_elem += 2 * H
    if m.head_kernel_size:
        per_elem += 2 * m.head_kernel_size
    elif m.post_sm_linear_head:
        per_elem += 2 * H
    fwd = H * per_elem * score_elements(args, seq_len) / seq_len
    return fwd, (fwd if args.attn_impl == "blocked" else 0.0)


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


def train_flops_per_token(args: ModelArgs, seq_len: int) -> float:
    f = forward_flops_per_token(args, seq_len)
    return 3.0 * f["total"] + f["recompute"]
