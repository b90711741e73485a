"""The ``blocked`` engine of the explicit attention path: the reference's result computed in
query blocks with recomputation.

Queries in blocks of ``attn_block_size`` rows plus the halo rows their convolutions read,
each seeing only the keys up to its own last row and recomputed in backward, so nothing of
size T x T outlives its block. Its key-query convolutions run in C on CPU, in Triton on
CUDA and through ``F.conv2d`` elsewhere (``kq_conv_backend``); the query block runs under
torch.compile where ``compile_block`` says so. Its speed and memory: docs/models.md.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from mta_repro.kernels.interface import AttnMask, ExplicitAttnParams, pad_left
from mta_repro.kernels.tuning import DEFAULT_TUNING, KernelTuning
from mta_repro.model.attention_math import WEIGHT_FIELDS, kq_conv_dense, query_history


def kq_conv_backend(x: torch.Tensor, tuning: KernelTuning = DEFAULT_TUNING) -> str:
    """Which kernel runs the key-query convolutions of ``blocked`` for this tensor:
    ``c`` (kq_conv_cpu, CPU fp32/fp64), ``triton`` (kq_conv_triton: CUDA, or CPU tensors
    under TRITON_INTERPRET=1 when asked for) or ``conv2d`` (``F.conv2d``: every other
    case). ``tuning.kq_conv`` (``model.kernels.kq_conv``) = c|triton|conv2d forces one
    (``auto``, the default, picks c on CPU and triton on CUDA). On CUDA ``F.conv2d`` of a
    bf16 16-group depthwise kernel is ATen's native ``conv_depthwise2d``, not cuDNN, hence
    triton there (docs/gpu.md has the estimate)."""
    want = tuning.kq_conv
    if want in ("auto", "c"):
        from mta_repro.kernels import kq_conv_cpu

        if kq_conv_cpu.available(x):
            return "c"
    if want == "conv2d":
        return "conv2d"
    if (
        (want == "triton" or x.device.type == "cuda")
        and importlib.util.find_spec("triton") is not None
        and (x.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")
    ):
        return "triton"
    return "conv2d"


def masked_kq_conv(
    x: torch.Tensor,
    kernel: torch.Tensor,
    pad_key: str,
    allowed: torch.Tensor,
    mask: AttnMask,
    backend: str | None = None,
    tuning: KernelTuning = DEFAULT_TUNING,
) -> torch.Tensor:
    """``kq_conv_dense(x * allowed) * allowed``: both key-query convolutions in this form (before
    softmax the output mask changes nothing that survives the -inf mask; after softmax
    the input is already zero where masked). The C kernel (CPU fp32/fp64) and the Triton
    kernels (CUDA) apply the causal part themselves (no mask passes, no work above the
    diagonal), so only padding (``key_valid``) costs multiplies; ``F.conv2d`` elsewhere,
    between two multiplies (``kq_conv_backend`` picks).
    x: (B, H, Tq, Tk) rows at ``mask.q_offset``; allowed: ``mask.dense`` of that shape.
    ``tuning``: the model's (the Triton kernel's tile)."""
    backend = backend or kq_conv_backend(x, tuning)
    if backend == "conv2d":
        return kq_conv_dense(x * allowed, kernel, pad_key) * allowed
    if mask.key_valid is not None:
        x = x * allowed
    pl = pad_left(pad_key, kernel.shape[-1])
    if backend == "c":
        from mta_repro.kernels.kq_conv_cpu import kq_conv as op

        y = op(x, kernel[:, 0], pl, mask.q_offset)
    else:
        from mta_repro.kernels.kq_conv_triton import kq_conv as op

        y = op(x, kernel[:, 0], pl, mask.q_offset, *tuning.kq_tile_shape)
    return y if mask.key_valid is None else y * allowed


def head_mix_linear_fast(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``head_mix_linear`` as one batched (H, H) @ (H, Tq*Tk) GEMM: no permuted copies.
    (bmm with an expanded weight, not matmul: matmul folds a 2-D @ 3-D product through a
    transposed copy of x, in forward and in backward.)"""
    b, h, tq, tk = x.shape
    w = weight.to(x.dtype).expand(b, h, h)
    return torch.bmm(w, x.reshape(b, h, tq * tk)).view(b, h, tq, tk)


def head_conv_fast(x: torch.Tensor, kernel: torch.Tensor) -> torch.Tensor:
    """``head_conv`` as batched (c_h, c_h)^T @ (c_h, Tq*Tk) GEMMs, one per (batch, group)."""
    b, h, tq, tk = x.shape
    g, c_h, _ = kernel.shape
    w = kernel.to(x.dtype).transpose(1, 2).expand(b, g, c_h, c_h).reshape(b * g, c_h, c_h)
    return torch.bmm(w, x.reshape(b * g, c_h, tq * tk)).view(b, h, tq, tk)


def _score_path_fast(q, k, v, p: ExplicitAttnParams, mask: AttnMask, training: bool, *weights):
    """``explicit_attention_torch`` with the fast pieces; one query block at a time.

    ``weights`` are the parameter tensors of ``p`` passed positionally, so that
    ``torch.utils.checkpoint`` sees them as inputs (their gradients flow through it).
    """
    p = _with_weights(p, weights)
    # Masks as one multiply / one add each (masked_fill is a copy plus a fill, and so is
    # its backward): every pass over a (B, H, rows, keys) block counts on CPU.
    allowed = mask.dense(q.shape[2], k.shape[2], q.device)  # (1 or B, 1, rows, keys)
    scores = torch.matmul(q * q.shape[-1] ** -0.5, k.transpose(-2, -1))
    if p.mta_kernel is not None:
        scores = masked_kq_conv(scores, p.mta_kernel, p.pad_key, allowed, mask, p.kq_backend, p.tuning)
    if p.wpsm is not None:
        scores = head_mix_linear_fast(scores, p.wpsm)
    ct = torch.promote_types(scores.dtype, torch.float32)
    # A pad query row (key_valid) allows nothing: leave its bias finite, so softmax and
    # its backward stay NaN-free, and zero its probabilities below.
    hide = ~allowed if mask.key_valid is None else ~allowed & allowed.any(-1, keepdim=True)
    bias = torch.where(hide, float("-inf"), 0.0).to(ct)
    probs = F.softmax(scores.to(ct) + bias, dim=-1)
    if mask.key_valid is not None:
        probs = probs * allowed
    probs = probs.type_as(q)
    if p.mta_kernel_after_sm is not None:
        probs = masked_kq_conv(probs, p.mta_kernel_after_sm, p.pad_key, allowed, mask, p.kq_backend, p.tuning)
    if p.head_kernel is not None:
        probs = head_conv_fast(probs, p.head_kernel)
    elif p.wposm is not None:
        probs = head_mix_linear_fast(probs, p.wposm)
    if p.dropout > 0.0 and training:
        probs = F.dropout(probs, p=p.dropout)
    return torch.matmul(probs, v)


def _with_weights(p: ExplicitAttnParams, weights) -> ExplicitAttnParams:
    present = [f for f in WEIGHT_FIELDS if getattr(p, f) is not None]
    return replace(p, **dict(zip(present, weights)))


def explicit_attention_blocked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    p: ExplicitAttnParams,
    mask: AttnMask,
    training: bool = False,
) -> torch.Tensor:
    """The reference's result, computed in query blocks with recomputation.

    Output rows [r0, r1) depend on score rows [r0 - w, r1) (w = ``query_history``) and,
    causally, on keys < q_offset + r1 only; rows before the first given query are zero
    in the reference too. So each block is the reference on that sub-problem, with its
    first (r0 - s0) rows dropped. Shapes as ``explicit_attention_torch``.
    """
    tq, tk = q.shape[2], k.shape[2]
    w = query_history(p)
    weights = [getattr(p, f) for f in WEIGHT_FIELDS if getattr(p, f) is not None]
    recompute = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, *weights))
    bs = resolve_block_size(p.block_size, q.device)
    # Dropout stays eager: the recomputation must draw the same mask, which the restored
    # RNG state guarantees for eager ops, not for a compiled graph's own RNG.
    block_fn = _block_fn(q.device, p.tuning) if not (p.dropout > 0.0 and training) else _score_path_fast
    if p.kq_backend is None and (p.mta_kernel is not None or p.mta_kernel_after_sm is not None):
        p = replace(p, kq_backend=kq_conv_backend(q, p.tuning))
    outs = []
    for r0 in range(0, tq, bs):
        r1 = min(r0 + bs, tq)
        s0 = max(0, r0 - w)
        kend = min(tk, mask.q_offset + r1)
        sub_mask = AttnMask(mask.q_offset + s0, None if mask.key_valid is None else mask.key_valid[:, :kend])
        args = (q[:, :, s0:r1], k[:, :, :kend], v[:, :, :kend], p, sub_mask, training, *weights)
        if recompute:
            # Only the block's inputs are saved; its (H, rows, keys) tensors are rebuilt in
            # backward. The RNG state is restored, so dropout draws the same mask again.
            out = torch.utils.checkpoint.checkpoint(block_fn, *args, use_reentrant=False)
        else:
            out = block_fn(*args)
        outs.append(out[:, :, r0 - s0 :])
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


# Query rows per block where ``model.attn_block_size`` is null, per device type. CPU: 128
# was fastest for kq-conv layers at T=2048 and 4096 (scripts/bench_attention.py
# --block-sizes). CUDA: 512, an estimate, not a measurement: eager ``blocked`` is
# launch-bound there (~90 aten ops per query block and layer), so 4x fewer blocks cut the
# CPU-side dispatch ~4x, for ~1.25x the score elements of 128-row blocks at T=2048 (keys
# run to each block's last row) and a working set of ~0.27 GB per fp32 (B=4, 16 heads,
# 522 x 2048) intermediate. ``scripts/gpu_acceptance.py`` sweeps 128-1024 and prints the
# override to use.
DEFAULT_BLOCK_SIZE = {"cpu": 128, "cuda": 512}


def default_block_size(device) -> int:
    """The block size for ``device`` (a torch.device or a type name) where none is set."""
    kind = device if isinstance(device, str) else device.type
    return DEFAULT_BLOCK_SIZE.get(kind, DEFAULT_BLOCK_SIZE["cuda"] if kind != "cpu" else 128)


def resolve_block_size(block_size: int | None, device) -> int:
    return block_size if block_size else default_block_size(device)


_compiled_blocks: dict = {}  # compile_block_backend -> the compiled _score_path_fast


def reset_compiled_blocks() -> None:
    """Forget the compiled block functions (after ``torch._dynamo.reset()``, so the next
    call compiles afresh and Dynamo's counters see it)."""
    _compiled_blocks.clear()


def _block_fn(device: torch.device, tuning: KernelTuning = DEFAULT_TUNING) -> Callable:
    """``_score_path_fast``, under torch.compile where ``compile_block`` says so.

    Compiled with ``dynamic=True`` (shapes and the key offset symbolic: a block at offset 0
    or 1 gets its own graph, as Dynamo specialises 0 and 1, the other blocks of every
    length share one; training and no-grad evaluation each have theirs; a new dtype or a
    different set of parameters recompiles; tests/test_attention_ops.py counts them), Inductor fuses
    the masks, casts and softmax of a block and keeps the matmuls and the key-query
    convolution (a custom op) extern. Inside an already compiled region
    (``distributed.compile=true``) the plain function is traced in place. One compiled
    function per backend (``tuning.compile_block_backend``), shared by the models using it."""
    if not compile_block(device, tuning) or torch.compiler.is_compiling():
        return _score_path_fast
    backend = tuning.compile_block_backend
    if backend not in _compiled_blocks:
        # Two layer kinds x train/eval x first/other blocks x dtypes can pass Dynamo's
        # default of 8 graphs per function, after which it would silently run eager.
        cfg = torch._dynamo.config
        cfg.recompile_limit = max(cfg.recompile_limit, 32)
        _compiled_blocks[backend] = torch.compile(_score_path_fast, dynamic=True, backend=backend)
    return _compiled_blocks[backend]


def compile_block(device: torch.device, tuning: KernelTuning = DEFAULT_TUNING) -> bool:
    """Whether ``blocked`` runs its query block compiled: ``tuning.compile_block``
    (``model.kernels.compile_block``) true/false, null (the default): on CUDA only (eager is
    launch-bound there; on CPU the C kernel dominates and a compile costs tens of seconds)."""
    if tuning.compile_block is not None:
        return tuning.compile_block
    return device.type == "cuda"


def explicit_attention_blocked_conv2d(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    p: ExplicitAttnParams,
    mask: AttnMask,
    training: bool = False,
) -> torch.Tensor:
    """``explicit_attention_blocked`` with ATen's ``F.conv2d`` for the key-query convolutions
    whatever the device and ``model.kernels.kq_conv``: the engine without the C and Triton
    kernels (the self-check's fallback where one of those is wrong on a device)."""
    return explicit_attention_blocked(q, k, v, replace(p, kq_backend="conv2d"), mask, training)
