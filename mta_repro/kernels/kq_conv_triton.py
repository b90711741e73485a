"""The key-query convolution of the ``blocked`` path as Triton kernels (the CUDA route).

On CUDA, ``F.conv2d`` of a bf16 16-group depthwise kernel is not cuDNN but ATen's generic
``conv_depthwise2d``, whose weight gradient launches one block per (head, tap), each
reducing over the whole batch x rows x keys. These kernels replace it with the same
contract as the CPU C kernel (``kq_conv_cpu``):

    y[i, j] = sum_{a < c_q, b < c_k} w[a, b] * x[i + a - ro, j + b - pl]   per (batch, head) plane,

with x read as 0 outside the plane and above the diagonal (key j > row i + ``diag``) and y
written as 0 there. Forward and input gradient are this correlation (the input gradient
with the flipped kernel); the weight gradient is its own kernel.

Each of the c_q row shifts of an output tile loads one window of x (the tile plus its key
halo) once, and its c_k key taps become one ``tl.dot`` with a banded Toeplitz matrix of the
kernel (tensor cores, fp32 accumulation); tiles above the diagonal are skipped. The weight
gradient is the transposed product, reduced per program and then on the host (no atomics,
deterministic). docs/gpu.md (section 2) describes the tiles and their sm_90 compile.

``kq_conv`` is a ``torch.library.custom_op`` with a fake implementation and a registered
backward, so it traces under ``torch.compile`` without a graph break. It runs on CUDA
tensors, and on CPU tensors in Triton's interpreter (``TRITON_INTERPRET=1``, for tests).
"""

from __future__ import annotations

# Triton's DSL is not typable: tl.static_range loops and kernel[grid](..., num_warps=...) launches
# pyright: reportGeneralTypeIssues=false, reportCallIssue=false
import torch
import triton
import triton.language as tl

from mta_repro.kernels import triton_interp
from mta_repro.kernels.tuning import DEFAULT_TUNING, KernelTuning

triton_interp.install()  # Triton 3.6's interpreter with numpy >= 2.4 (mta_repro/kernels/triton_interp.py)

# "No causal mask": a diagonal beyond every column (same constant as kq_conv_cpu).
NO_DIAG = 2**62


# 8 warps: at the 64 x 64 tile, sm_90, 6x11 bf16, both kernels compile without spills
# (175 and 222 registers); at 4 warps both spill (scripts/bench_kq_conv.py --sm90).
_WARPS = 8


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def tiles(tuning: KernelTuning = DEFAULT_TUNING) -> tuple[int, int]:
    """(rows, keys) per output tile: ``model.kernels.kq_tile``. 64 x 64 by default: the key
    window is then 128 wide for a c_k <= 65 kernel, and one program holds a (64, 128) bf16
    window, a (128, 64) Toeplitz tile and a (64, 64) fp32 accumulator
    (scripts/bench_kq_conv.py --sm90 prints registers and spills; 8 warps, no spills). The
    tests use small tiles to cross many tile borders at small shapes."""
    return tuning.kq_tile_shape


DEFAULT_TILE = tiles()


def _types(dtype: torch.dtype):
    """(accumulator type, tl.dot input precision) for an input dtype."""
    if dtype == torch.float64:
        return tl.float64, "ieee"
    if dtype == torch.float32:
        return tl.float32, "ieee"  # exact fp32 products, as F.conv2d with TF32 off
    return tl.float32, "tf32"  # bf16/fp16 operands: the precision flag does not apply


@triton.jit
def _corr_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    R,
    K,
    H,
    ro,
    pl,
    diag,
    CQ: tl.constexpr,
    CK: tl.constexpr,
    BR: tl.constexpr,
    BC: tl.constexpr,
    BCH: tl.constexpr,
    CAUSAL: tl.constexpr,
    ACC: tl.constexpr,
    PREC: tl.constexpr,
):
    pid_p = tl.program_id(0)  # plane = batch * H + head
    r0 = tl.program_id(1) * BR
    c0 = tl.program_id(2) * BC
    base = pid_p.to(tl.int64) * R * K
    rows = r0 + tl.arange(0, BR)
    cols = c0 + tl.arange(0, BC)
    acc = tl.zeros((BR, BC), ACC)
    live = True
    if CAUSAL:
        live = c0 <= r0 + BR - 1 + diag  # some entry of the tile on or below the diagonal
    if live:
        h = pid_p % H
        m = tl.arange(0, BCH)
        xcols = c0 - pl + m  # the tile's key window, halo included
        tap = m[:, None] - tl.arange(0, BC)[None, :]  # (BCH, BC): key tap of window col m for output col c
        tmask = (tap >= 0) & (tap < CK)
        for a in tl.static_range(CQ):
            xr = rows + a - ro
            xm = (xr[:, None] >= 0) & (xr[:, None] < R) & (xcols[None, :] >= 0) & (xcols[None, :] < K)
            if CAUSAL:
                xm = xm & (xcols[None, :] <= xr[:, None] + diag)
            xt = tl.load(x_ptr + base + xr[:, None] * K + xcols[None, :], mask=xm, other=0.0)
            t = tl.load(w_ptr + (h * CQ + a) * CK + tap, mask=tmask, other=0.0).to(xt.dtype)
            acc += tl.dot(xt, t, input_precision=PREC, out_dtype=ACC)
    keep = (rows[:, None] < R) & (cols[None, :] < K)
    if CAUSAL:
        acc = tl.where(cols[None, :] <= rows[:, None] + diag, acc, 0.0)
    tl.store(y_ptr + base + rows[:, None] * K + cols[None, :], acc.to(y_ptr.dtype.element_ty), mask=keep)


@triton.jit
def _wgrad_kernel(
    gy_ptr,
    x_ptr,
    part_ptr,
    R,
    K,
    ro,
    pl,
    diag,
    n_ct,
    CQ: tl.constexpr,
    CK: tl.constexpr,
    CKP: tl.constexpr,
    BR: tl.constexpr,
    BC: tl.constexpr,
    BCH: tl.constexpr,
    CAUSAL: tl.constexpr,
    ACC: tl.constexpr,
    PREC: tl.constexpr,
):
    pid_p = tl.program_id(0)
    pid_c = tl.program_id(1)
    c0 = pid_c * BC
    base = pid_p.to(tl.int64) * R * K
    cols = c0 + tl.arange(0, BC)
    m = tl.arange(0, BCH)
    xcols = c0 - pl + m
    tap = m[:, None] - tl.arange(0, BC)[None, :]  # (BCH, BC)
    bidx = tl.arange(0, CKP)
    r_first = 0
    if CAUSAL:
        # gy is zero in rows r < c0 - diag of this key tile: start at the first tile with any.
        r_first = (tl.maximum(c0 - diag, 0) // BR) * BR
    for a in tl.static_range(CQ):
        macc = tl.zeros((BCH, BC), ACC)
        for r0 in range(r_first, R, BR):
            rows = r0 + tl.arange(0, BR)
            gm = (rows[:, None] < R) & (cols[None, :] < K)
            if CAUSAL:
                gm = gm & (cols[None, :] <= rows[:, None] + diag)
            g = tl.load(gy_ptr + base + rows[:, None] * K + cols[None, :], mask=gm, other=0.0)
            xr = rows + a - ro
            xm = (xr[:, None] >= 0) & (xr[:, None] < R) & (xcols[None, :] >= 0) & (xcols[None, :] < K)
            if CAUSAL:
                xm = xm & (xcols[None, :] <= xr[:, None] + diag)
            xt = tl.load(x_ptr + base + xr[:, None] * K + xcols[None, :], mask=xm, other=0.0)
            macc += tl.dot(tl.trans(xt), g, input_precision=PREC, out_dtype=ACC)
        # gw[a, b] = sum_c M_a[c + b, c]: the b-th diagonal, reduced once per program.
        out = tl.zeros((CKP,), ACC)
        for b in tl.static_range(CK):
            s = tl.sum(tl.sum(tl.where(tap == b, macc, 0.0), axis=1), axis=0)
            out = tl.where(bidx == b, s, out)
        tl.store(part_ptr + ((pid_p.to(tl.int64) * n_ct + pid_c) * CQ + a) * CK + bidx, out, mask=bidx < CK)


def _causal(diag: int, K: int) -> tuple[bool, int]:
    """A diagonal at or past the last key masks nothing (and would overflow int32)."""
    return (diag < K - 1, diag) if diag < K - 1 else (False, 0)


def corr(
    x: torch.Tensor, w: torch.Tensor, ro: int, pl: int, diag: int, tile: tuple[int, int] = DEFAULT_TILE
) -> torch.Tensor:
    """y[i, j] = sum_{a, b} w[h, a, b] * x[i + a - ro, j + b - pl] per plane, 0 outside and
    above the diagonal ``diag`` on both sides. x: (B, H, R, K); w: (H, c_q, c_k); ``tile``:
    (rows, keys) per program (``tiles``)."""
    x = x.contiguous()
    B, H, R, K = x.shape
    cq, ck = w.shape[1], w.shape[2]
    y = torch.empty_like(x)
    if x.numel() == 0:
        return y
    br, bc = tile
    bch = _pow2(bc + ck - 1)
    causal, dg = _causal(diag, K)
    acc, prec = _types(x.dtype)
    wf = w.to(torch.float64 if x.dtype == torch.float64 else torch.float32).contiguous()
    grid = (B * H, triton.cdiv(R, br), triton.cdiv(K, bc))
    _corr_kernel[grid](
        x,
        wf,
        y,
        R,
        K,
        H,
        ro,
        pl,
        dg,
        CQ=cq,
        CK=ck,
        BR=br,
        BC=bc,
        BCH=bch,
        CAUSAL=causal,
        ACC=acc,
        PREC=prec,
        num_warps=_WARPS,
    )
    return y


def wgrad(
    gy: torch.Tensor,
    x: torch.Tensor,
    cq: int,
    ck: int,
    ro: int,
    pl: int,
    diag: int,
    tile: tuple[int, int] = DEFAULT_TILE,
) -> torch.Tensor:
    """gw[h, a, b] = sum over batch, rows i, keys j of gy[i, j] * x[i + a - ro, j + b - pl]
    (the masking of ``corr``), in fp32 (fp64 for fp64 inputs). Returns (H, c_q, c_k)."""
    gy, x = gy.contiguous(), x.contiguous()
    B, H, R, K = x.shape
    br, bc = tile
    bch = _pow2(bc + ck - 1)
    causal, dg = _causal(diag, K)
    acc, prec = _types(x.dtype)
    n_ct = triton.cdiv(K, bc)
    pdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    part = torch.zeros(B, H, n_ct, cq, ck, dtype=pdt, device=x.device)
    if x.numel() == 0:
        return part.sum((0, 2))
    _wgrad_kernel[(B * H, n_ct)](
        gy,
        x,
        part,
        R,
        K,
        ro,
        pl,
        dg,
        n_ct,
        CQ=cq,
        CK=ck,
        CKP=_pow2(ck),
        BR=br,
        BC=bc,
        BCH=bch,
        CAUSAL=causal,
        ACC=acc,
        PREC=prec,
        num_warps=_WARPS,
    )
    return part.sum((0, 2))


@torch.library.custom_op("mta_repro::kq_conv_triton", mutates_args=())
def kq_conv(
    x: torch.Tensor,
    w: torch.Tensor,
    pad_left: int,
    diag: int = NO_DIAG,
    tile_rows: int = DEFAULT_TILE[0],
    tile_keys: int = DEFAULT_TILE[1],
) -> torch.Tensor:
    """x: (B, H, R, K); w: (H, c_q, c_k). ``attention_ops.kq_conv_dense`` of x with its entries above
    the diagonal (key > row + diag) zeroed, zeroed there again on output (the contract of
    ``kq_conv_cpu.kq_conv``). ``tile_rows`` x ``tile_keys``: the output tile
    (``model.kernels.kq_tile``, passed per call so that two models tune independently)."""
    return corr(x, w, w.shape[1] - 1, pad_left, diag, (tile_rows, tile_keys))


@kq_conv.register_fake
def _(x, w, pad_left, diag=NO_DIAG, tile_rows=DEFAULT_TILE[0], tile_keys=DEFAULT_TILE[1]):
    return torch.empty_like(x)


@torch.library.custom_op("mta_repro::kq_conv_triton_bwd", mutates_args=())
def _kq_conv_bwd(
    gy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, pad_left: int, diag: int, tile_rows: int, tile_keys: int
) -> tuple[torch.Tensor, torch.Tensor]:
    cq, ck = w.shape[1], w.shape[2]
    tile = (tile_rows, tile_keys)
    # Input gradient: gx[r, m] = sum w[a, b] gy[r - a + c_q-1, m - b + pad_left], the same
    # correlation with the flipped kernel, rows looking forward; masked entries of x get
    # no gradient and gy's masked entries (outputs forced to 0) are not read.
    gx = corr(gy, w.flip(1, 2), 0, ck - 1 - pad_left, diag, tile)
    gw = wgrad(gy, x, cq, ck, cq - 1, pad_left, diag, tile)
    return gx, gw.to(w.dtype)


@_kq_conv_bwd.register_fake
def _(gy, x, w, pad_left, diag, tile_rows, tile_keys):
    return torch.empty_like(x), torch.empty_like(w)


def _setup(ctx, inputs, output):
    x, w, pad_left, diag, tile_rows, tile_keys = inputs
    ctx.save_for_backward(x, w)
    ctx.pad_left, ctx.diag, ctx.tile = pad_left, diag, (tile_rows, tile_keys)


def _backward(ctx, gy):
    x, w = ctx.saved_tensors
    gx, gw = _kq_conv_bwd(gy, x, w, ctx.pad_left, ctx.diag, *ctx.tile)
    return gx, gw, None, None, None, None


kq_conv.register_autograd(_backward, setup_context=_setup)
