"""``IMPL``: the registry entry of ``model.attn_impl=triton`` (``AttnImpl``; its options,
``model.kernels.impl_options.triton``: ``options.py``), which pyproject.toml declares in the
entry-point group ``mta_repro.attn_impls``; the core loads it by that name
(``attention_registry.attn_impl``) and never imports this package.

What it holds: the dispatch by layer (a kq-conv layer to ``stored.py``, every other layer to
``fused.py``), what it supports (a CUDA GPU, or CPU tensors in Triton's interpreter; no
float64 on a GPU; no training dropout on a kq-conv layer: ``blocked`` runs those), and what
the estimates ask of it: a stand-in that saves on the meta device what the kernels save (the
memory pre-flight), the bytes the kernels hold while the backward runs, and the FLOPs their
passes compute (``tiles.py`` has the geometry all three read). Importing this module imports
neither triton nor the kernels: they load on the first call.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from mta_repro.experimental.fused_triton import options, tiles
from mta_repro.kernels.interface import AttnMask, ExplicitAttnParams, post_mix_matrix
from mta_repro.model.attention_ops import AttnImpl, explicit_attention_blocked

# SMs of the GPU the pre-flight sizes the persistent grid for: an H100 / H200
ESTIMATE_SMS = 132


def _kernels(p: ExplicitAttnParams) -> tuple:
    """(pre, post): the layer's key-query convolutions as (c_q, c_k), or None."""
    return (
        None if p.mta_kernel is None else tuple(p.mta_kernel.shape[2:]),
        None if p.mta_kernel_after_sm is None else tuple(p.mta_kernel_after_sm.shape[2:]),
    )


def explicit_attention_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: ExplicitAttnParams, mask: AttnMask, training: bool = False
) -> torch.Tensor:
    """``explicit_attention_torch`` in Triton kernels: the stored-scores kernels for a kq-conv
    layer, the fused kernel for every other. Imported on first use: triton is optional, and
    TRITON_INTERPRET is read when the kernels are defined."""
    if p.mta_kernel is not None:
        from mta_repro.experimental.fused_triton.stored import explicit_attention_stored

        return explicit_attention_stored(q, k, v, p, mask, training)
    from mta_repro.experimental.fused_triton.fused import explicit_attention_fused

    return explicit_attention_fused(q, k, v, p, mask, training)


def supports(q: torch.Tensor, p: ExplicitAttnParams, mask: AttnMask) -> str | None:
    """None where the kernels run (q, p as this call uses them), else what they lack."""
    if importlib.util.find_spec("triton") is None:
        return "this environment: the triton package is not installed (pip install triton)"
    if q.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return "CPU tensors unless TRITON_INTERPRET=1 (Triton's interpreter: for tests, slow)"
    if q.device.type not in ("cuda", "cpu"):
        return f"{q.device.type} tensors"
    if q.device.type == "cuda" and q.dtype == torch.float64:
        # its accumulators are added by TMA reductions, which stop at 32-bit floats
        return "float64 tensors on a GPU (float64 runs in the interpreter, for its checks)"
    if p.mta_kernel is not None and p.dropout > 0.0:
        return "training dropout on a kq-conv layer (the stored-scores kernels have none)"
    return None


class _SavedLike(torch.autograd.Function):
    """What the kernels keep for backward: contiguous q, k, v, the fp32 log-sum-exp per row,
    the weights as the kernels read them (in their accumulator dtype: a copy where they are in
    another, e.g. bf16 parameters) and, for a kq-conv layer, the stored C plane (the causal
    cells, q's dtype). Triton does not run on meta."""

    @staticmethod
    def forward(ctx, q, k, v, stored, q_off, *weights):
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        extra = ()
        if stored:
            b, h, tq, _ = q.shape
            spec = tiles.stored_planes(b=b, h=h, tq=tq, tk=k.shape[2], q_off=q_off, dtype=q.dtype)["cstore"]
            extra = (torch.empty(spec.shape, dtype=spec.dtype, device=q.device),)
        ctx.save_for_backward(q.contiguous(), k.contiguous(), v.contiguous(), lse, *weights, *extra)
        ctx.n_weights = len(weights)
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, g):
        q, k, v, *_ = ctx.saved_tensors
        return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None, None) + (None,) * ctx.n_weights


def meta_stand_in(q, k, v, p: ExplicitAttnParams, mask: AttnMask, training: bool = False) -> torch.Tensor:
    """What the memory pre-flight runs on meta for this implementation: ``_SavedLike``, or
    ``blocked`` itself where the registry would run it (training dropout on a kq-conv layer)."""
    if p.mta_kernel is not None and p.dropout > 0.0 and training:
        return explicit_attention_blocked(q, k, v, p, mask, training)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    weights = (
        None if p.mta_kernel is None else p.mta_kernel[:, 0],
        p.wpsm,
        None if p.mta_kernel_after_sm is None else p.mta_kernel_after_sm[:, 0],
        post_mix_matrix(p),
    )
    return _SavedLike.apply(
        q, k, v, p.mta_kernel is not None, mask.q_offset, *(w.to(acc).contiguous() for w in weights if w is not None)
    )


def workspace_bytes(
    p: ExplicitAttnParams, batch: int, seq_len: int, n_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes the kernels hold for one training layer while its backward runs (its largest
    moment): ``tiles.backward_workspace_bytes``, the sum of what the launchers allocate (a
    persistent grid of ``PROGRAMS_PER_SM`` per SM of an H100/H200; scratch in ``dtype``), under
    the layer's tuning (``model.kernels.impl_options.triton``: frames, programs); 0 where ``blocked`` runs."""
    pre, post = _kernels(p)
    if pre is not None and p.dropout > 0.0:
        return 0
    n_prog = options.of(p.tuning).programs or tiles.PROGRAMS_PER_SM * ESTIMATE_SMS
    return tiles.backward_workspace_bytes(
        b=batch,
        h=n_heads,
        d=head_dim,
        seq_len=seq_len,
        pre=pre,
        post=post,
        mix=(p.wpsm is not None, post_mix_matrix(p) is not None),
        pad_key=p.pad_key,
        dtype=dtype,
        n_prog=n_prog,
        tuning=p.tuning,
    )


def flops(args, seq_len: int, kind: str) -> tuple[float, float] | None:
    """(FLOPs per token of one layer's forward passes, of its backward passes), or None where
    ``blocked`` runs the layer (training dropout on a kq-conv layer). Every pass computes its
    stages on whole frames (owned block plus halo) of the key blocks up to the diagonal
    (``tiles.cells_visited``), stage by stage as the kernels compute them: d-long products
    (scores, dO V^T, A V, dq, dk, dv), convolutions and their adjoints as Toeplitz products
    (c_q products as wide as the frame), head mixing as a full H x H product (the kernels
    expand ``head_kernel``). ``args``: the model's ``ModelArgs``; ``kind``: its layer kind."""
    m, H = args.mta, args.n_heads
    pre = post = None
    if kind == "kq_conv":
        if m.query_kernel_size is not None:
            pre = (m.query_kernel_size, m.key_kernel_size)
        if m.after_sm_query_kernel_size is not None:
            post = (m.after_sm_query_kernel_size, m.after_sm_key_kernel_size)
    if pre is not None and args.dropout > 0.0:
        return None
    qk = 2 * args.resolved_head_dim  # also A V, dO V^T, dq, dk, dv: one d-long product per cell each
    mix1 = 2 * H if m.pre_sm_linear_head else 0
    mix2 = 2 * H if (m.head_kernel_size or m.post_sm_linear_head) else 0
    frames = {name: tiles.frame(name, pre, post, m.pad_key, args.kernels) for name in tiles.passes(pre)}

    def toe(k, name):
        return 2 * k[0] * frames[name].ec if k else 0

    if pre is None:  # the fused kernel: every pass computes the scores again
        conv2 = toe(post, "backward")
        per_cell = {
            "stats": qk + mix1,
            "forward": qk + mix1 + conv2 + mix2 + qk,
            "backward_rowsum": qk + mix1 + qk + mix2 + conv2,
            # S, z, dA, dR, (R, the post kernel's gradient, dP), dC, A, the mixings' gradients, dq, dk, dv
            "backward": qk + mix1 + qk + mix2 + 3 * conv2 + mix1 + mix2 + mix1 + mix2 + 3 * qk,
        }
    else:  # the stored design: C once (S0, conv1), read back by the rest
        per_cell = {
            "stats": qk + toe(pre, "stats") + mix1,
            "forward": mix1 + toe(post, "forward") + mix2 + qk,
            "backward_rowsum": qk + mix1 + mix2 + toe(post, "backward_rowsum"),
            # dA, z, dR, (R, the post kernel's gradient, dP), dC, A, the mixings' gradients, dv
            "backward_dc": qk + mix1 + mix2 + 3 * toe(post, "backward_dc") + mix1 + mix2 + mix1 + mix2 + qk,
            # S0, dS0 and the pre kernel's gradient, dq, dk
            "backward_b": qk + 2 * toe(pre, "backward_b") + 2 * qk,
        }
    cost = {name: H * per_cell[name] * tiles.cells_visited(f, seq_len, seq_len) / seq_len for name, f in frames.items()}
    fwd = cost["stats"] + cost["forward"]
    return fwd, sum(cost.values()) - fwd


IMPL = AttnImpl(
    explicit_attention_triton,
    supports,
    fallback="blocked",
    doc="EXPERIMENTAL: fused Triton kernels, forward and backward (mta_repro/experimental/fused_triton; kq-conv "
    "layers: stored scores), never run on a GPU",
    meta_fn=meta_stand_in,
    workspace_bytes=workspace_bytes,
    flops=flops,
    options=options.parse,
)
