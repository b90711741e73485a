"""The attention math of every variant, as pure functions on tensors.

One function per layer kind (``ModelArgs.layer_kind``): ``sdpa`` (the baseline),
``diff_attention`` (Differential Transformer) and ``explicit_attention`` (MTA and talking
heads: the score transforms on explicit scores). Everything here is free of parameters and
modules, so each piece can be checked against a plain formula and a faster kernel can
replace one function (register it in ``ATTN_IMPLS`` and select it with ``model.attn_impl``)
without touching the model.

Shapes: B batch, H heads, Tq queries, Tk keys, d head_dim. Query row i sits at absolute
position ``q_offset + i``; keys sit at 0..Tk-1 (a KV cache holds the earlier ones).

Two implementations of the explicit path are built in: ``torch``, the reference (the
release's computation on the whole (B, H, Tq, Tk) score matrix; every other implementation
is tested against it), and ``blocked`` (default): queries in blocks of ``attn_block_size``
rows plus the halo rows their convolutions read, each seeing only the keys up to its own
last row and recomputed in backward, so nothing of size T x T outlives its block. Its
key-query convolutions run in C on CPU, in Triton on CUDA and through ``F.conv2d``
elsewhere (``kq_conv_backend``). Others plug in by name: ``register_attn_impl``, or an
entry point of the group ``mta_repro.attn_impls`` loaded on first use (how the experimental
fused Triton kernels register as ``triton``; this module never imports them). The engine,
its speed and memory: docs/models.md.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from mta_repro.errors import UserError
from mta_repro.kernels.interface import AttnMask, ExplicitAttnParams, pad_left
from mta_repro.kernels.tuning import DEFAULT_TUNING, KernelTuning


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


_WEIGHT_FIELDS = ("mta_kernel", "wpsm", "mta_kernel_after_sm", "head_kernel", "wposm")


def _with_weights(p: ExplicitAttnParams, weights) -> ExplicitAttnParams:
    present = [f for f in _WEIGHT_FIELDS if getattr(p, f) is not None]
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
    weights = [getattr(p, f) for f in _WEIGHT_FIELDS if getattr(p, f) is not None]
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


_compiled_blocks: dict = {}


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


@dataclass(frozen=True)
class AttnImpl:
    """A registered explicit-path implementation, what it supports, and what the estimates
    (``mta_repro.estimate``) ask of one whose kernels they can neither run on the meta device
    nor count from outside (the last three fields; None: the generic rule)."""

    fn: Callable[..., torch.Tensor]
    # Returns None when (q, params, mask) are supported, else the reason (for the
    # fallback's warning); None means everything is supported. The params as the call uses
    # them: their dropout is 0 outside training.
    supports: Callable[[torch.Tensor, ExplicitAttnParams, AttnMask], str | None] | None = None
    doc: str = ""
    # What runs instead where ``supports`` declines.
    fallback: str = "torch"
    # The memory pre-flight runs the model on meta: a stand-in with fn's signature that saves
    # for backward what fn saves (None: fn itself runs on meta).
    meta_fn: Callable[..., torch.Tensor] | None = None
    # (params, batch, seq_len, n_heads, head_dim, dtype) -> bytes fn holds beyond its inputs,
    # outputs and saved tensors while one training layer's backward runs (None: none).
    workspace_bytes: Callable[..., int] | None = None
    # (ModelArgs, seq_len, layer kind) -> (forward, backward) FLOPs per token of one layer, or
    # None where ``fallback`` runs the layer (None: counted as the whole (B, H, T, T) matrix).
    flops: Callable[..., tuple[float, float] | None] | None = None


# Registry of explicit-path implementations (``model.attn_impl``). An implementation has
# the signature of ``explicit_attention_torch`` and its semantics; the parity tests in
# tests/test_attn_impls.py run every built-in name against "torch".
ATTN_IMPLS: dict[str, AttnImpl] = {
    "torch": AttnImpl(explicit_attention_torch, doc="reference: whole (B, H, Tq, Tk) matrix"),
    "blocked": AttnImpl(explicit_attention_blocked, doc="query blocks, causal skipping, recomputed"),
}

# The entry-point group of implementations that are not built in: "name = module:attribute",
# the attribute an ``AttnImpl``.
ENTRY_POINTS = "mta_repro.attn_impls"


def register_attn_impl(name: str, impl: AttnImpl) -> None:
    ATTN_IMPLS[name] = impl


def declared_attn_impls() -> dict[str, str]:
    """{name: "module:attribute"} of the implementations declared in the entry-point group
    ``ENTRY_POINTS``: by the installed packages and, where this package runs from a source
    tree (``PYTHONPATH=.``, its installed metadata absent or another tree's), by that tree's
    pyproject.toml, which wins. Nothing is imported."""
    from importlib.metadata import entry_points

    out = {ep.name: ep.value for ep in entry_points(group=ENTRY_POINTS)}
    tree = Path(__file__).resolve().parents[2] / "pyproject.toml"
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the installed metadata only
        return out
    if tree.is_file():
        project = tomllib.loads(tree.read_text()).get("project", {})
        if project.get("name") == "mta-repro":
            out.update(project.get("entry-points", {}).get(ENTRY_POINTS, {}))
    return out


def attn_impl_names() -> list[str]:
    """Every implementation ``model.attn_impl`` may name: registered or declared."""
    return sorted(set(ATTN_IMPLS) | set(declared_attn_impls()))


def attn_impl(name: str) -> AttnImpl:
    """The implementation registered as ``name``; a declared one (``declared_attn_impls``) is
    imported and registered on first use. One line naming ``model.attn_impl`` where there is
    none or it does not load."""
    entry = ATTN_IMPLS.get(name)
    if entry is not None:
        return entry
    target = declared_attn_impls().get(name)
    if target is None:
        raise UserError(f"model.attn_impl: unknown implementation {name!r}; available: {attn_impl_names()}")
    module, _, attr = target.partition(":")
    try:
        entry = importlib.import_module(module)
        for part in filter(None, attr.split(".")):
            entry = getattr(entry, part)
    except (ImportError, AttributeError) as e:
        raise UserError(
            f"model.attn_impl={name!r}: its implementation {target} (entry point of {ENTRY_POINTS}) does not load: {e}"
        ) from None
    if not isinstance(entry, AttnImpl):
        raise UserError(f"model.attn_impl={name!r}: {target} is a {type(entry).__name__}, not an AttnImpl")
    register_attn_impl(name, entry)
    return entry


def explicit_attention(
    impl: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    p: ExplicitAttnParams,
    mask: AttnMask,
    training: bool = False,
    impls: Mapping[str, AttnImpl] | None = None,
) -> torch.Tensor:
    """Dispatch to ``impls[impl]`` (default: the registry ``ATTN_IMPLS``), or to its
    fallback where it declares no support."""
    impls = ATTN_IMPLS if impls is None else impls
    entry = impls[impl] if impl in impls else attn_impl(impl)
    if entry.supports is not None:
        # the layer as this call runs it: no dropout outside training
        reason = entry.supports(q, p if training or not p.dropout else replace(p, dropout=0.0), mask)
        if reason is not None:
            _warn_fallback(impl, reason, entry.fallback)
            entry = impls[entry.fallback] if entry.fallback in impls else attn_impl(entry.fallback)
    return entry.fn(q, k, v, p, mask, training)


@dataclass(frozen=True)
class AttnKernels:
    """The functions one ``Attention`` module computes with (its ``kernels`` attribute).

    The defaults are what runs: torch's SDPA, the registry ``ATTN_IMPLS`` and the key-query
    convolution backend chosen per call (``kq_conv_backend``), under the model's tuning
    (``model.kernels``, handed to every kernel in ``ExplicitAttnParams.tuning``; two models
    in one process tune independently). Whoever needs other ones
    for one model hands them to that model's modules: the memory pre-flight gives its meta
    model stand-ins that keep what the device's kernels keep (``mta_repro.train.memory``),
    so nothing process-wide is swapped and a model next to it is untouched."""

    sdpa: Callable | None = None  # F.scaled_dot_product_attention's signature; None: that function
    impls: Mapping[str, AttnImpl] | None = None  # None: ATTN_IMPLS as it is at the call
    kq_backend: str | None = None  # c | triton | conv2d; None: kq_conv_backend per call
    tuning: KernelTuning = DEFAULT_TUNING  # the model's ``model.kernels``


_warned: set = set()


def _warn_fallback(impl: str, reason: str, fallback: str) -> None:
    if (impl, reason) not in _warned:
        _warned.add((impl, reason))
        warnings.warn(f"model.attn_impl={impl!r} does not support {reason}; using {fallback!r}", stacklevel=2)


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
