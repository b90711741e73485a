"""``model.attn_impl=triton``: MTA's whole explicit score path in fused Triton kernels.

Computes exactly what ``attention_ops.explicit_attention_torch`` computes (the release's
order: pre-softmax key-query convolution -> pre-softmax head mixing -> causal softmax ->
post-softmax key-query convolution, no renormalisation -> post-softmax head mixing ->
dropout -> .V, with ``key_valid`` padding and ``q_offset``), forward and backward, without
keeping any (B, H, Tq, Tk) tensor: saved for backward are q, k, v, the (B, H, Tq) lse and
the weights. Every product runs on tensor cores (bf16/fp16 operands, fp32 accumulation;
tf32 for fp32 inputs), none per convolution tap.

Design
------
*Tiles, all heads.* Head mixing couples every head of a (query, key) cell, so a program
computes a tile (a frame of ``ER`` x ``EC`` cells, 128 x 64 or 128 x 128: ``kernels/frames.py``)
for all heads. The per-head products (the scores, dO V^T, A V, dS K, dS^T Q, A^T dO) are
2-D ``tl.dot`` of 128-row tiles, one head after another (wgmma on sm_90, each of the two
warpgroups owning 64 rows, so products, loads and stores share one layout). Their results
meet in a private scratch slot per stage ((HP, ER, EC) in the compute dtype: L1/L2 on a
GPU), and each head mixing reads ``SR`` frame rows of all heads as one (cells, heads)
matrix and multiplies it by the (heads, heads) weight: one tensor-core product per slab.
Why scratch and not registers: one tile's 16 heads at 128 x 64 are 131K values, and the
per-row accumulators of 16 heads (O, dq: 16 x d per row) cannot stay on chip either, so
O and dq are added into per-item partials and dk/dv into whole-layer buffers, by TMA
reductions of (rows, GP) boxes through fp32 tensor descriptors (``_accumulate``): no
per-thread addresses or masks, whose registers spilled, and no layout change for an atomic
(``docs/triton_kernel.md``).

*Inputs through tensor descriptors.* q, k, v, dO, the convolved keys and the Toeplitz
tables are read through ``TensorDescriptor`` tiles of (rows, GP features) (TMA copies on
sm_90, double-buffered by the pipeliner). Rows before the sequence (a frame's halo above
row 0, the shifted query rows; keys left of 0) are read from ``frames.margin`` zero rows the
launcher puts in front of each input's copy, the kernel adding the margin to every row
coordinate (``_tile``), so no copy has a negative coordinate and none relies on TMA's zero
fill for them (rows past the end are read as 0 by the copy's bounds); no offset tensors or
bounds masks live in registers (hoisted out of every loop, they spilled). Scratch hand-offs
stay plain stores and loads ordered by barriers (global memory, one proxy); only Triton's
own shared-memory staging meets the async proxy (wgmma operands, TMA store/reduction
sources), and Triton fences it (``fence.proxy.async``; checked on the sm_90 compile by
tests/test_kernel_hazards.py). The head dimension runs in parts of
GP = 32 features (96 = 3 x 32), so no tile is padded to a power of two.

*Pre-softmax convolution as a GEMM.* Without the causal zeroing, conv(QK^T) factorises:
C[i, j] = sum_rho q[i - rho] . Khat_rho[j], Khat_rho = the keys convolved along the key axis
with the kernel's row c_q-1-rho (``_khat``, computed by torch before the launch). So the
convolved scores of any tile are one product of inner dimension c_q*d (shifted query rows
against convolved keys): no halo, no taps. The causal zeroing only changes cells within
NB = (c_q-1) + (c_k-1-pad_left) diagonals of the diagonal; their exact correction (the
kernel applied to the few "future" scores next to the diagonal, ``_band``, an O(T) table)
is subtracted on the tiles that touch the band. Padding (``key_valid``) zeroes the pad rows
of q and k first, which zeroes exactly the scores the reference masks.

*Post-softmax convolution and every adjoint as Toeplitz products.* The c_k key taps of one
row shift are a banded Toeplitz matrix: a frame's output = (its input plane, rows shifted by
rho) x T_rho (EC x EC, the frame's columns to its columns), one tensor-core product per row
shift, T built per head by torch (``_toeplitz``). The backward's adjoints use the flipped
kernel and look forward. A kernel's gradient is the transposed product (shifted input^T x
output gradient) whose diagonals are the taps: summed once per tile (a gather and a row
sum), not per tap.

*Frames.* Only convolutions need a halo: the forward's post-softmax conv reads P above and
beside the owned block, the backward's adjoints read below and beside (``frames.halo``).
The halo is recomputed by the neighbouring tile. Every convolution reads only its frame's
columns: the margins hold the taps of every cell whose result is used (the owned block, and
in the backward the cells around it that the adjoint of the pre-softmax conv reads), so no
window reaches past the frame; results nearer its edge are wrong and never read (checked
per pass by ``tl.static_assert``).

*Passes.* The post-softmax transforms mix rows of different heads after normalisation, so
the forward is two passes: ``stats`` (each row's max and sum over its keys, merged over
key splits into the lse) and ``forward`` (exact probabilities ``exp(Z - lse)``, post-softmax
transforms, .V). The backward: ``backward_rowsum`` (D = rowsum(P * dP), the softmax
backward's row term, which the post-softmax conv keeps from being rowsum(dO * O)) and
``backward`` (the adjoint chain dA -> dR -> dP -> dZ -> dC -> dS; dq, dk, dv, the
kernels' and mixings' gradients, each kind of product in its own head loop).

*Work and determinism.* Items are (batch, row block, range of key blocks) on a persistent
grid (``frames.items``): the rows' tiles laid end to end are cut into one run per program,
equal to the tile, so long rows split across programs and B=1 fills the GPU; a program walks
its run in one loop over tiles (``Schedule.tiles``). Each item adds into its own slot of per-item partial buffers
(row statistics, O, D, dq), which torch reduces in a fixed order; one program writes a slot,
and its reductions into O and dq run in a pipelined head loop that ends by waiting for them
to complete, so each element's adds happen in tile order: deterministic. Weight gradients
are per-program partials, added once per tile. Only dk and dv are accumulated across
programs, so they alone are bitwise nondeterministic on a GPU (for a given program count: another
count cuts the rows into other items, and O and dq then agree to rounding, not bitwise;
tests/test_kernel_hazards.py checks who adds into what). A float64 accumulator (the
interpreter's float64 checks) is read, added and written back instead: TMA reductions stop at
32 bits, so float64 on a GPU runs ``blocked``.

*Masking.* Every masked value is selected (``tl.where``), never multiplied: a fully masked
pad row gives exact zeros and no NaN; exp arguments are clamped at 0 (a true probability is
<= 1), so halo rows never overflow.

*Dropout* on the post-mixing probabilities draws its mask with ``tl.rand`` from a seed
taken from torch's generator (saved for backward) and the int64 cell index
((b*H + h)*Tq + row)*Tk + col: the same masks in forward and backward, reproducible seeded
runs, no wrap at long T; not the masks ``F.dropout`` would draw.

*Launch* (``frames.launch_config``, shared with ``scripts/compile_triton.py``, which also
takes the constexprs from ``kernel_constexprs`` and the descriptors from
``descriptor_specs``): 8 warps; lengths, offsets, counts and the seed are not specialised
(a new batch shape reuses the compiled kernel; H and d are, fixed per model); element
offsets are int64; scratch written in a tile is read only by later loops, after a barrier
(a pipeliner's prefetch sits after it, before its loop); loops that write scratch are
``num_stages=1``. The per-head product loops of the last phase are pipelined
(``num_stages=2``, their feature parts unrolled), so a TMA reduction overlaps the next head's
work and only the loop's end waits for completion.

Status: exact under ``TRITON_INTERPRET=1`` (tests/test_attn_impls.py, tests/test_attn_triton.py:
every option against "torch" in float64, forward and every gradient; bf16; a debug training
run; the identities above in float64). Its compiled code for sm_90 is judged by
``scripts/compile_triton.py`` (registers, spills, tensor-core share, a roofline ESTIMATE: no
GPU has measured it yet); ``docs/triton_kernel.md`` has the figures.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from mta_repro.errors import UserError
from mta_repro.kernels import frames, triton_interp
from mta_repro.kernels.types import DEFAULT_TUNING, AttnMask, ExplicitAttnParams, KernelTuning, post_mix_matrix


_STATS, _FWD, _ROWSUM, _BWD = (tl.constexpr(i) for i in range(4))


def _interpreter_descriptor_reduce(builder, kind, desc, value, indices):
    """What a descriptor's ``atomic_add`` means, for Triton's interpreter, which (3.9) has no
    descriptor reductions: an atomic add of the box into the elements inside the tensor
    (``TensorDescHandle.materialize_pointers``: the box's addresses and which lie in bounds)."""
    from triton._C.libtriton import ir

    if kind != ir.DESCRIPTOR_REDUCE_KIND.ADD:
        raise NotImplementedError(f"interpreter: descriptor reduction {kind}")
    ptrs, mask = desc.materialize_pointers(indices)
    return builder.create_atomic_rmw(ir.ATOMIC_OP.FADD, ptrs, value, mask, ir.MEM_SEMANTIC.RELAXED,
                                     ir.MEM_SYNC_SCOPE.GPU)


def _install_interpreter_reduce() -> None:
    from triton.runtime import interpreter

    if not hasattr(interpreter.InterpreterBuilder, "create_descriptor_reduce"):
        interpreter.InterpreterBuilder.create_descriptor_reduce = _interpreter_descriptor_reduce


if triton_interp.interpreting():  # read when the kernels are defined, as Triton does
    _install_interpreter_reduce()
    triton_interp.install()


# ----------------------------------------------------------------------------- helpers
@triton.jit
def _allowed(i, j, b, kv_ptr, Tq, Tk, q_off, HAS_KV: tl.constexpr):
    """Which (query i, key j) cells interact: causal from q_off, in range, not padding.
    i and j broadcast against each other (e.g. (R, 1) and (1, C))."""
    ok = (i >= 0) & (i < Tq) & (j >= 0) & (j < Tk) & (j <= i + q_off)
    if HAS_KV:
        iq = (i >= 0) & (i < Tq)
        jk = (j >= 0) & (j < Tk)
        vq = tl.load(kv_ptr + b.to(tl.int64) * Tk + i + q_off, mask=iq, other=0) != 0
        vk = tl.load(kv_ptr + b.to(tl.int64) * Tk + j, mask=jk, other=0) != 0
        ok = ok & vq & vk
    return ok


@triton.jit
def _tile(desc, plane, r0, e0, R: tl.constexpr, GP: tl.constexpr, MMA: tl.constexpr, M0: tl.constexpr = 0):
    """(R, GP) rows [r0, r0 + R) x features [e0, e0 + GP) of plane ``plane`` of a (planes, M0 +
    T, DPAD) input through its tensor descriptor (a TMA copy on sm_90): row r lies at row M0 + r
    of the plane, after M0 zero rows (``frames.margin``: the launcher's copy), so rows before
    the sequence (r0 >= -M0) are read from that zero margin and every coordinate is >= 0; rows
    past its end are read as 0 by the copy's bounds. No offset tensors or bounds masks exist in
    registers (the compiler would hoist them: registers for the whole kernel)."""
    return desc.load([plane.to(tl.int32), r0 + M0, e0]).reshape(R, GP).to(MMA)  # TMA coordinates are int32


@triton.jit
def _scores(qd, khd, band_ptr, bh, i, j, row0, col0, Tq, q_off, scale, CQ: tl.constexpr, NB: tl.constexpr,
            ER: tl.constexpr, EC: tl.constexpr, GP: tl.constexpr, DPAD: tl.constexpr, MMA: tl.constexpr,
            ACC: tl.constexpr, PREC: tl.constexpr, M0: tl.constexpr = 0):
    """(ER, EC) scores of frame rows i (from row0) and columns j (from col0) for one head (bh):
    sum_rho q[i - rho] . khat_rho[j] * scale (khd: the (B*H*CQ, Tk, DPAD) convolved keys; CQ = 1
    and the keys themselves: the plain scores), minus the band correction (NB > 0) on a tile
    that touches the diagonal band. M0: the inputs' zero margin (``_tile``). Runtime loops over the shifts and feature parts: one set of
    operand buffers, prefetched by the pipeliner (unrolled, every shift's would be resident)."""
    acc = tl.zeros([ER, EC], ACC)
    for rho in tl.range(0, CQ):
        for e0 in tl.range(0, DPAD, GP):
            acc = tl.dot(_tile(qd, bh, row0 - rho, e0, ER, GP, MMA, M0),
                         tl.trans(_tile(khd, bh * CQ + rho, col0, e0, EC, GP, MMA, M0)), acc, input_precision=PREC,
                         out_dtype=ACC)
    acc = acc * scale
    if NB > 0:
        # cells with 0 <= t = i + q_off - j < NB: their future taps are in the sum above
        if (row0 + ER - 1 + q_off - col0 >= 0) & (row0 + q_off - (col0 + EC - 1) < NB):
            tt = i[:, None] + q_off - j[None, :]
            bm = (tt >= 0) & (tt < NB) & (i[:, None] >= 0) & (i[:, None] < Tq)
            acc -= tl.load((band_ptr + bh * Tq * NB) + (i[:, None] * NB + tt), mask=bm, other=0.0)
    return acc


@triton.jit
def _to_scratch(x, dtype: tl.constexpr, RNE: tl.constexpr):
    """x in the scratch dtype. RNE (the interpreter with bf16 scratch): round to nearest even
    first, as a GPU's conversion does; the interpreter's own fp32 -> bf16 truncates, which
    would bias every stage handed through scratch."""
    if RNE:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _plane_rows(plane, du, ER: tl.constexpr, EC: tl.constexpr, MMA: tl.constexpr):
    """A scratch plane (ER x EC) with its rows shifted by du: frame rows [du, du + ER), 0 outside
    the frame. Every convolution reads its input this way, the frame's own columns: the frame's
    margins hold the key taps of every cell whose result is used (``frames.halo``)."""
    u = du + tl.arange(0, ER)
    w = tl.arange(0, EC)
    return tl.load(plane + u[:, None] * EC + w[None, :], mask=((u >= 0) & (u < ER))[:, None], other=0.0).to(MMA)


@triton.jit
def _add_taps(x, gm, ptr, SHIFT: tl.constexpr, CK: tl.constexpr, CKP: tl.constexpr, EC: tl.constexpr,
              ACC: tl.constexpr, PREC: tl.constexpr):
    """ptr[b] += tap b of one kernel row's gradient, b < CK: the product x^T G (x the input
    plane's frame columns at one row shift, G = gm the output gradient, zero outside the owned
    columns) holds tap b of column n at row n + b + SHIFT (SHIFT = -OFF, the kernel's reach left
    of its key), summed by a gather (skew) and a row sum, once per tile and row shift (not per
    tap). The frame holds every column an owned cell's taps read, so the gather needs no
    mask: an owned column's rows n + b + SHIFT (b < CK) lie in the frame, and every other
    column of the product is zero (G is; x is finite), whatever row its wrapped index reads.
    (A mask and a clamped index, hoisted out of every loop, spilled: 124 -> 96 B.)"""
    tl.static_assert((EC & (EC - 1)) == 0, "the tap gather wraps its row index modulo EC")
    r = tl.arange(0, CKP)
    sk = r[:, None] + tl.arange(0, EC)[None, :] + SHIFT  # (CKP, EC): row n + b + SHIFT of the product
    mm = tl.dot(tl.trans(x), gm, input_precision=PREC, out_dtype=ACC)  # (EC, EC)
    taps = tl.sum(tl.gather(mm, sk & (EC - 1), 0), 1)  # rows b >= CK: not stored
    tl.store(ptr + r, tl.load(ptr + r, mask=r < CK, other=0.0) + taps, mask=r < CK)


@triton.jit
def _conv(plane, td, t0, CQ: tl.constexpr, ADJ: tl.constexpr, ER: tl.constexpr, EC: tl.constexpr,
          MMA: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr):
    """(ER, EC) key-query convolution (ADJ: its adjoint) of one head's scratch plane: for each
    row shift rho (back for the convolution, forward for the adjoint), the shifted plane times
    that shift's (EC, EC) Toeplitz matrix (rows t0 + rho * EC of the (HP * CQ * EC, EC) table,
    read through its descriptor td): one tensor-core product per shift. A cell's result is
    exact where its taps lie in the frame: on every cell whose result is used (the owned block,
    and for dP the cells dS reads); the rest is never read."""
    acc = tl.zeros([ER, EC], ACC)
    # a runtime loop: one set of operand buffers (an unrolled loop would hold all shifts')
    for rho in tl.range(0, CQ):
        if ADJ:
            du = rho
        else:
            du = -rho
        acc = tl.dot(_plane_rows(plane, du, ER, EC, MMA), td.load([t0 + rho * EC, 0]).to(MMA), acc,
                     input_precision=PREC, out_dtype=ACC)
    return acc


@triton.jit
def _conv_weight_grad(xplane, g, part, OFF: tl.constexpr, CQ: tl.constexpr, CK: tl.constexpr, CKP: tl.constexpr,
                      ER: tl.constexpr, EC: tl.constexpr, MMA: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr):
    """part[a, b] += sum over cells (u, w) of G[u, w] X[u - rho, w + b - OFF], a = CQ-1-rho:
    G (ER, EC) is this head's output gradient, already zero outside the owned cells; X the
    convolution's input plane."""
    gm = g.to(MMA)
    for rho in tl.range(0, CQ):
        _add_taps(_plane_rows(xplane, -rho, ER, EC, MMA), gm, part + (CQ - 1 - rho) * CK, -OFF, CK, CKP, EC, ACC,
                  PREC)


@triton.jit
def _conv_and_weight_grad(plane, td, t0, g, part, OFF: tl.constexpr, CQ: tl.constexpr, CK: tl.constexpr,
                          CKP: tl.constexpr, ER: tl.constexpr, EC: tl.constexpr, MMA: tl.constexpr,
                          ACC: tl.constexpr, PREC: tl.constexpr):
    """``_conv`` (forward) of the plane and ``_conv_weight_grad`` with gradient g, from the same
    shifted planes (each loaded once for both)."""
    acc = tl.zeros([ER, EC], ACC)
    gm = g.to(MMA)
    for rho in tl.range(0, CQ):
        x = _plane_rows(plane, -rho, ER, EC, MMA)
        acc = tl.dot(x, td.load([t0 + rho * EC, 0]).to(MMA), acc, input_precision=PREC, out_dtype=ACC)
        _add_taps(x, gm, part + (CQ - 1 - rho) * CK, -OFF, CK, CKP, EC, ACC, PREC)
    return acc


@triton.jit
def _accumulate(desc, plane, r0, e0, x, R: tl.constexpr, GP: tl.constexpr, ACC: tl.constexpr):
    """desc[plane, r0 : r0 + R, e0 : e0 + GP] += x (R, GP): a bulk tensor reduction (a TMA
    reduction on sm_90: no per-thread addresses, masks or layout change for it; rows past the
    descriptor's end, e.g. keys beyond Tk, are not written; dk and dv take keys before 0 in
    their zero margin, ``frames.margin``, so r0 >= 0). Reductions are 32 bits
    wide at most, so a float64 accumulator (the interpreter's float64 checks; on a GPU the
    registry runs ``blocked`` for float64, ``attention_ops._triton_supports``) is read, added
    and written back: exact there, where programs run one after another."""
    if ACC == tl.float64:
        desc.store([plane, r0, e0], desc.load([plane, r0, e0]) + x.reshape(1, R, GP))
    else:
        desc.atomic_add([plane, r0, e0], x.reshape(1, R, GP))


@triton.jit
def _grad_pair(g, xd, yd, xod, yod, bh, row0, col0, xo_plane, E0, GP: tl.constexpr, ER: tl.constexpr,
               EC: tl.constexpr, HAS_XO: tl.constexpr, MMA: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr,
               M0: tl.constexpr = 0):
    """Features [E0, E0 + GP) (one feature part) of one head's products of a tile
    gradient g (ER x EC, zero outside the owned cells, so the rest adds 0): yo += g^T @ y[rows]
    into keys [col0, col0 + EC) of plane bh of yod, and (HAS_XO) xo += g @ x[cols] into plane
    xo_plane of xod, its item's row partial. dS gives dk from q and dq from k, A gives dv from dO.
    M0: the zero margin in front of the inputs' rows and of yod's keys (``_tile``)."""
    if HAS_XO:
        xo = tl.dot(g, _tile(xd, bh, col0, E0, EC, GP, MMA, M0), input_precision=PREC, out_dtype=ACC)
        _accumulate(xod, xo_plane.to(tl.int32), 0, E0, xo, ER, GP, ACC)
    yo = tl.dot(tl.trans(g), _tile(yd, bh, row0, E0, ER, GP, MMA, M0), input_precision=PREC, out_dtype=ACC)
    _accumulate(yod, bh.to(tl.int32), col0 + M0, E0, yo, EC, GP, ACC)


@triton.jit
def _slab_cells(r0, row0, col0, b, kv_ptr, Tq, Tk, q_off, HAS_KV: tl.constexpr, ER: tl.constexpr, EC: tl.constexpr,
                TOP: tl.constexpr, LEFT: tl.constexpr, BMO: tl.constexpr, BNO: tl.constexpr, SR: tl.constexpr):
    """The cells of the slab of SR frame rows from r0: frame rows cu and columns cw, query and
    key indices ci and cj, which interact (ok), which are owned and interact (own), and the
    slab's query rows."""
    cell = tl.arange(0, SR * EC)
    cu = r0 + cell // EC
    cw = cell % EC
    ci = row0 + cu
    cj = col0 + cw
    ok = _allowed(ci, cj, b, kv_ptr, Tq, Tk, q_off, HAS_KV)
    own = (cu >= TOP) & (cu < TOP + BMO) & (cw >= LEFT) & (cw < LEFT + BNO) & ok
    return cu, cw, ci, cj, ok, own, row0 + r0 + tl.arange(0, SR)


@triton.jit
def _slab(plane_base, cu, cw, hh, H: tl.constexpr, ER: tl.constexpr, EC: tl.constexpr, MMA: tl.constexpr):
    """(cells, HP) slab of a scratch slot: cells at frame rows cu, columns cw, all heads."""
    return tl.load(plane_base + (hh[None, :] * ER + cu[:, None]) * EC + cw[:, None], mask=(hh < H)[None, :],
                   other=0.0).to(MMA)


@triton.jit
def _logits(scr_c, cu, cw, hh, w1t, H: tl.constexpr, ER: tl.constexpr, EC: tl.constexpr, HAS_W1: tl.constexpr,
            MMA: tl.constexpr, PREC: tl.constexpr, ACC: tl.constexpr):
    """The logits z of a slab: its (cells, HP) convolved scores C from the scratch slot (written
    by ``_scores`` in the first phase) and their pre-softmax head mixing. Returns (C, z). The
    one code path every pass computes z through: the statistics' row max and sum and the
    later passes' exp(z - lse) see the same bits (tests/test_kernel_hazards.py)."""
    xc = _slab(scr_c, cu, cw, hh, H, ER, EC, MMA)
    return xc, _mix(xc, w1t, HAS_W1, PREC, ACC)


@triton.jit
def _slab_store(plane_base, cu, cw, hh, x, H: tl.constexpr, ER: tl.constexpr, EC: tl.constexpr, RNE: tl.constexpr):
    tl.store(plane_base + (hh[None, :] * ER + cu[:, None]) * EC + cw[:, None],
             _to_scratch(x, plane_base.dtype.element_ty, RNE), mask=(hh < H)[None, :])


@triton.jit
def _row_stat(ptr, b, i_rows, hh, Tq, H: tl.constexpr, SR: tl.constexpr, EC: tl.constexpr):
    """A (B, H, Tq) per-row statistic (lse, D) broadcast to the slab's (SR*EC, HP) cells."""
    m = (hh[None, :] < H) & (i_rows[:, None] >= 0) & (i_rows[:, None] < Tq)
    x = tl.load((ptr + b.to(tl.int64) * H * Tq) + (hh[None, :] * Tq + i_rows[:, None]), mask=m, other=0.0)
    return tl.reshape(tl.broadcast_to(x[:, None, :], (SR, EC, x.shape[1])), (SR * EC, x.shape[1]))


@triton.jit
def _keep(seed, b, i, j, hh, Tq, Tk, p_drop, H: tl.constexpr, DROP: tl.constexpr):
    """Dropout's keep mask of (cells, HP), drawn from the int64 cell index (no wrap); without
    dropout a placeholder that ``_drop`` ignores."""
    keep = 0
    if DROP:
        offs = ((b.to(tl.int64) * H + hh[None, :]) * Tq + i[:, None]) * Tk + j[:, None]
        keep = tl.rand(seed, offs) >= p_drop
    return keep


@triton.jit
def _drop(x, keep, p_drop, DROP: tl.constexpr):
    """Inverted dropout of the post-mixing probabilities (or of their gradient) with the slab's mask."""
    if DROP:
        x = tl.where(keep, x / (1.0 - p_drop), 0.0)
    return x


@triton.jit
def _add_row_sums(pd_ptr, slot, hh, r0, x, own, SR: tl.constexpr, EC: tl.constexpr, HP: tl.constexpr,
                  ER: tl.constexpr):
    """The item's D partial (its slot, (HP, ER)) += the slab's row sums of x (cells, HP) over
    its owned cells."""
    dsum = tl.sum(tl.reshape(tl.where(own[:, None], x, 0.0), (SR, EC, HP)), 1)
    dptr = (pd_ptr + slot * HP * ER) + (hh[None, :] * ER + (r0 + tl.arange(0, SR))[:, None])
    tl.store(dptr, tl.load(dptr) + dsum)


@triton.jit
def _mix(x, w, HAS: tl.constexpr, PREC: tl.constexpr, ACC: tl.constexpr):
    """x (cells, HP) @ w (HP, HP), or x itself when the mixing is off."""
    if HAS:
        return tl.dot(x, w, input_precision=PREC, out_dtype=ACC)
    else:
        return x.to(ACC)


@triton.jit
def _wgrad(acc, g, x, own, HAS: tl.constexpr, MMA: tl.constexpr, PREC: tl.constexpr, ACC: tl.constexpr):
    """acc (HP, HP) += g_owned^T x over the slab's cells: a mixing weight's gradient."""
    if HAS:
        go = tl.where(own[:, None], g, 0.0).to(MMA)
        acc = tl.dot(tl.trans(go), x.to(MMA), acc, input_precision=PREC, out_dtype=ACC)
    return acc


@triton.jit
def _weights(wt_ptr, hh, H: tl.constexpr, HAS: tl.constexpr, MMA: tl.constexpr):
    """A (HP, HP) head mixing as right factors of (cells, heads) slabs: (W^T, W); x @ W^T
    mixes, x @ W is the adjoint. Zeros when the layer has none."""
    if HAS:
        wt = tl.load(wt_ptr + hh[:, None] * hh.shape[0] + hh[None, :], mask=(hh[:, None] < H) & (hh[None, :] < H),
                     other=0.0).to(MMA)
    else:
        wt = tl.zeros([hh.shape[0], hh.shape[0]], MMA)
    return wt, tl.trans(wt)


# ----------------------------------------------------------------------------- the kernel
# Lengths, offsets, counts and the seed change with every batch shape: not specialised, so
# a new B or T reuses the compiled kernel (H and d stay specialised: fixed per model).
@triton.jit(do_not_specialize=["Tq", "Tk", "q_off", "seed"])
def _mta_kernel(
    qd, kd, vd, dod, khd, band_ptr, kv_ptr,
    w1t_ptr, w2t_ptr, tf2d, ta2d, ta1d,
    lse_ptr, dd_ptr, tiles_ptr, starts_ptr,
    pm_ptr, pl_ptr, pod, pd_ptr, pdqd, dkd, dvd, pw1_ptr, pw2_ptr, pt1_ptr, pt2_ptr,
    scr_ptr,
    Tq, Tk, q_off, scale, p_drop, seed,
    MODE: tl.constexpr, H: tl.constexpr, HP: tl.constexpr, DPAD: tl.constexpr,
    ER: tl.constexpr, EC: tl.constexpr, TOP: tl.constexpr, LEFT: tl.constexpr, BMO: tl.constexpr,
    BNO: tl.constexpr, SR: tl.constexpr,
    HAS_K1: tl.constexpr, CQ1: tl.constexpr, CK1: tl.constexpr, CKP1: tl.constexpr, PL1: tl.constexpr,
    NB1: tl.constexpr,
    HAS_W1: tl.constexpr, HAS_K2: tl.constexpr, CQ2: tl.constexpr, CK2: tl.constexpr, CKP2: tl.constexpr,
    PL2: tl.constexpr,
    HAS_W2: tl.constexpr, HAS_KV: tl.constexpr, DROP: tl.constexpr,
    MMA: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr, RNE: tl.constexpr, GP: tl.constexpr,
    NSLOT: tl.constexpr, MARGIN: tl.constexpr,
    S_C: tl.constexpr, S_DA: tl.constexpr, S_S0: tl.constexpr, S_P: tl.constexpr, S_DR: tl.constexpr,
    S_DP: tl.constexpr, S_R: tl.constexpr, S_DC: tl.constexpr, S_A: tl.constexpr,
):
    pid = tl.program_id(0)
    hh = tl.arange(0, HP)
    u = tl.arange(0, ER)
    w = tl.arange(0, EC)
    PLANE: tl.constexpr = ER * EC
    SLOT: tl.constexpr = HP * PLANE
    scr = scr_ptr + pid.to(tl.int64) * (NSLOT * SLOT)
    R1: tl.constexpr = CK1 - 1 - PL1
    R2: tl.constexpr = CK2 - 1 - PL2
    # every convolution reads the frame's own columns (``_conv``): its margins must hold the key
    # taps of each cell whose result is used (``frames.halo`` makes them so), i.e. of the owned
    # block, and in the backward also of the cells around it that dS = conv1^T(dC) reads (dC
    # there, so dP there: R1 columns left of the block, PL1 right, each reading dR R2 / PL2 further)
    RIGHT: tl.constexpr = EC - LEFT - BNO
    if HAS_K2 and (MODE == _FWD or MODE == _BWD):
        tl.static_assert((LEFT >= PL2) & (RIGHT >= R2), "the frame's margins must hold the post kernel's taps")
    if HAS_K2 and MODE == _ROWSUM:
        tl.static_assert((LEFT >= R2) & (RIGHT >= PL2), "the frame's margins must hold the post adjoint's taps")
    if HAS_K2 and MODE == _BWD:
        tl.static_assert((LEFT >= R1 + R2) & (RIGHT >= PL1 + PL2), "the frame's margins must hold dP's taps")
    if HAS_K1 and MODE == _BWD:
        tl.static_assert((LEFT >= PL1) & (RIGHT >= R1) & (LEFT >= R1) & (RIGHT >= PL1),
                         "the frame's margins must hold the pre kernel's taps")
    own_u = (u >= TOP) & (u < TOP + BMO)
    own_w = (w >= LEFT) & (w < LEFT + BNO)
    # the (HP, HP) mixings as right factors of (cells, heads) slabs: x @ W^T mixes, x @ W is the adjoint
    w1t, w1 = _weights(w1t_ptr, hh, H, HAS_W1, MMA)
    w2t, w2 = _weights(w2t_ptr, hh, H, HAS_W2, MMA)

    # this program's tiles, one loop (frames.Schedule.tiles: batch, row block, key block, its
    # item's partial slot): an item loop around a key-block loop kept its bounds and the item's
    # values live across the whole tile (the kq-conv backward spilled 196 B, then 124 B)
    for it in tl.range(tl.load(starts_ptr + pid), tl.load(starts_ptr + pid + 1), num_stages=1):
        b = tl.load(tiles_ptr + it * 4)
        t = tl.load(tiles_ptr + it * 4 + 1)
        c = tl.load(tiles_ptr + it * 4 + 2)
        slot = tl.load(tiles_ptr + it * 4 + 3).to(tl.int64)
        row0 = t * BMO - TOP  # query index of frame row 0
        i = row0 + u
        col0 = c * BNO - LEFT  # key index of frame column 0
        j = col0 + w
        tl.debug_barrier()  # every reader of the previous tile's slots is done
        dw1 = tl.zeros([HP, HP], ACC)
        dw2 = tl.zeros([HP, HP], ACC)

        # ---- H1: per-head products on the frame -> slots
        for h in tl.range(0, H, num_stages=1):
            bh = b.to(tl.int64) * H + h
            pc = scr + S_C * SLOT + h * PLANE + u[:, None] * EC + w[None, :]
            cst = _scores(qd, khd, band_ptr, bh, i, j, row0, col0, Tq, q_off, scale, CQ1, NB1, ER, EC, GP, DPAD,
                          MMA, ACC, PREC, MARGIN)
            tl.store(pc, _to_scratch(cst, scr_ptr.dtype.element_ty, RNE))
            if MODE == _ROWSUM or MODE == _BWD:
                da = tl.zeros([ER, EC], ACC)
                for e0 in tl.range(0, DPAD, GP):
                    da = tl.dot(_tile(dod, bh, row0, e0, ER, GP, MMA, MARGIN),
                                tl.trans(_tile(vd, bh, col0, e0, EC, GP, MMA, MARGIN)),
                                da, input_precision=PREC, out_dtype=ACC)
                tl.store(scr + S_DA * SLOT + h * PLANE + u[:, None] * EC + w[None, :],
                         _to_scratch(da, scr_ptr.dtype.element_ty, RNE))
            if MODE == _BWD:
                if HAS_K1:  # the raw masked scores, the pre-softmax kernel's input (its gradient)
                    s0 = _scores(qd, kd, band_ptr, bh, i, j, row0, col0, Tq, q_off, scale, 1, 0, ER, EC, GP, DPAD,
                                 MMA, ACC, PREC, MARGIN)
                    ok = _allowed(i[:, None], j[None, :], b, kv_ptr, Tq, Tk, q_off, HAS_KV)
                    tl.store(scr + S_S0 * SLOT + h * PLANE + u[:, None] * EC + w[None, :],
                             _to_scratch(tl.where(ok, s0, 0.0), scr_ptr.dtype.element_ty, RNE))
        tl.debug_barrier()

        # ---- M1: slabs of all heads: mixing, softmax, (no post conv: the rest of the chain)
        for r0 in tl.range(0, ER, SR, num_stages=1):
            cu, cw, ci, cj, ok, own, i_rows = _slab_cells(r0, row0, col0, b, kv_ptr, Tq, Tk, q_off, HAS_KV, ER, EC,
                                                          TOP, LEFT, BMO, BNO, SR)
            xc, z = _logits(scr + S_C * SLOT, cu, cw, hh, w1t, H, ER, EC, HAS_W1, MMA, PREC, ACC)
            if MODE == _STATS:
                zm = tl.where(ok[:, None], z, float("-inf"))
                z3 = tl.reshape(zm, (SR, EC, HP))
                tmax = tl.max(z3, 1)  # (SR, HP)
                u_rows = r0 + tl.arange(0, SR)
                sptr = hh[None, :] * ER + u_rows[:, None]
                m_old = tl.load((pm_ptr + slot * HP * ER) + sptr)
                l_old = tl.load((pl_ptr + slot * HP * ER) + sptr)
                m_new = tl.maximum(m_old, tmax)
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                e3 = tl.exp(z3 - m_safe[:, None, :])
                l_new = l_old * tl.exp(tl.where(m_old == float("-inf"), float("-inf"), m_old - m_safe)) + tl.sum(e3, 1)
                tl.store((pm_ptr + slot * HP * ER) + sptr, m_new)
                tl.store((pl_ptr + slot * HP * ER) + sptr, l_new)
            else:
                lse = _row_stat(lse_ptr, b, i_rows, hh, Tq, H, SR, EC)
                okh = ok[:, None] & (hh < H)[None, :]
                p = tl.where(okh, tl.exp(tl.minimum(z - lse, 0.0)), 0.0)
                keep = _keep(seed, b, ci, cj, hh, Tq, Tk, p_drop, H, DROP)
                if MODE == _FWD:
                    if HAS_K2:
                        _slab_store(scr + S_P * SLOT, cu, cw, hh, p, H, ER, EC, RNE)
                    else:
                        a = _drop(_mix(p.to(MMA), w2t, HAS_W2, PREC, ACC), keep, p_drop, DROP)
                        _slab_store(scr + S_A * SLOT, cu, cw, hh, a, H, ER, EC, RNE)
                else:
                    da = _drop(_slab(scr + S_DA * SLOT, cu, cw, hh, H, ER, EC, ACC), keep, p_drop, DROP)
                    # masked before the mixing, not after: the same values (a cell's mix is of its
                    # own heads; padded heads' weights are 0), and a select of the product's
                    # accumulator made ptxas serialise every wgmma of the kq-conv passes (C7514)
                    dr = _mix(tl.where(okh, da, 0.0).to(MMA), w2, HAS_W2, PREC, ACC)
                    if HAS_K2:
                        _slab_store(scr + S_P * SLOT, cu, cw, hh, p, H, ER, EC, RNE)
                        _slab_store(scr + S_DR * SLOT, cu, cw, hh, dr, H, ER, EC, RNE)
                    elif MODE == _ROWSUM:
                        _add_row_sums(pd_ptr, slot, hh, r0, p * dr, own, SR, EC, HP, ER)
                    else:
                        dd = _row_stat(dd_ptr, b, i_rows, hh, Tq, H, SR, EC)
                        dz = p * (dr - dd)
                        _slab_store(scr + S_DC * SLOT, cu, cw, hh, _mix(dz.to(MMA), w1, HAS_W1, PREC, ACC),
                                    H, ER, EC, RNE)
                        a = _drop(_mix(p.to(MMA), w2t, HAS_W2, PREC, ACC), keep, p_drop, DROP)
                        _slab_store(scr + S_A * SLOT, cu, cw, hh, a, H, ER, EC, RNE)
                        dw1 = _wgrad(dw1, dz, xc, own, HAS_W1, MMA, PREC, ACC)
                        dw2 = _wgrad(dw2, da, p, own, HAS_W2, MMA, PREC, ACC)

        if HAS_K2 and MODE != _STATS:
            tl.debug_barrier()
            # ---- H2: the post-softmax convolution / its adjoint / its kernel's gradient, per head
            for h in tl.range(0, H, num_stages=1):
                pp = u[:, None] * EC + w[None, :]
                ok = _allowed(i[:, None], j[None, :], b, kv_ptr, Tq, Tk, q_off, HAS_KV)
                if MODE == _FWD:
                    rr = _conv(scr + S_P * SLOT + h * PLANE, tf2d, h * CQ2 * EC, CQ2, False, ER, EC, MMA, ACC, PREC)
                if MODE == _BWD:  # R and the post kernel's gradient read the same shifted P planes
                    g = tl.where(own_u[:, None] & own_w[None, :], tl.load(scr + S_DR * SLOT + h * PLANE + pp), 0.0)
                    rr = _conv_and_weight_grad(scr + S_P * SLOT + h * PLANE, tf2d, h * CQ2 * EC, g,
                                               pt2_ptr + (pid.to(tl.int64) * HP + h) * (CQ2 * CK2), PL2, CQ2, CK2,
                                               CKP2, ER, EC, MMA, ACC, PREC)
                if MODE == _FWD or MODE == _BWD:
                    tl.store(scr + S_R * SLOT + h * PLANE + pp,
                             _to_scratch(tl.where(ok, rr, 0.0), scr_ptr.dtype.element_ty, RNE))
                if MODE == _ROWSUM or MODE == _BWD:
                    dp = _conv(scr + S_DR * SLOT + h * PLANE, ta2d, h * CQ2 * EC, CQ2, True, ER, EC, MMA, ACC, PREC)
                    tl.store(scr + S_DP * SLOT + h * PLANE + pp, _to_scratch(dp, scr_ptr.dtype.element_ty, RNE))
            tl.debug_barrier()
            # ---- M2: slabs again: the post-softmax mixing / the softmax backward
            for r0 in tl.range(0, ER, SR, num_stages=1):
                cu, cw, ci, cj, ok, own, i_rows = _slab_cells(r0, row0, col0, b, kv_ptr, Tq, Tk, q_off, HAS_KV, ER,
                                                              EC, TOP, LEFT, BMO, BNO, SR)
                keep = _keep(seed, b, ci, cj, hh, Tq, Tk, p_drop, H, DROP)
                if MODE == _FWD:
                    rr = _slab(scr + S_R * SLOT, cu, cw, hh, H, ER, EC, MMA)
                    a = _drop(_mix(rr, w2t, HAS_W2, PREC, ACC), keep, p_drop, DROP)
                    _slab_store(scr + S_A * SLOT, cu, cw, hh, a, H, ER, EC, RNE)
                elif MODE == _ROWSUM:
                    p = _slab(scr + S_P * SLOT, cu, cw, hh, H, ER, EC, ACC)
                    dp = _slab(scr + S_DP * SLOT, cu, cw, hh, H, ER, EC, ACC)
                    _add_row_sums(pd_ptr, slot, hh, r0, p * dp, own, SR, EC, HP, ER)
                else:
                    p = _slab(scr + S_P * SLOT, cu, cw, hh, H, ER, EC, ACC)
                    dp = _slab(scr + S_DP * SLOT, cu, cw, hh, H, ER, EC, ACC)
                    dd = _row_stat(dd_ptr, b, i_rows, hh, Tq, H, SR, EC)
                    dz = p * (dp - dd)
                    _slab_store(scr + S_DC * SLOT, cu, cw, hh, _mix(dz.to(MMA), w1, HAS_W1, PREC, ACC), H, ER, EC, RNE)
                    rr = _slab(scr + S_R * SLOT, cu, cw, hh, H, ER, EC, MMA)
                    a = _drop(_mix(rr, w2t, HAS_W2, PREC, ACC), keep, p_drop, DROP)
                    _slab_store(scr + S_A * SLOT, cu, cw, hh, a, H, ER, EC, RNE)
                    da = _drop(_slab(scr + S_DA * SLOT, cu, cw, hh, H, ER, EC, ACC), keep, p_drop, DROP)
                    dw1 = _wgrad(dw1, dz, _slab(scr + S_C * SLOT, cu, cw, hh, H, ER, EC, MMA), own, HAS_W1, MMA,
                                 PREC, ACC)
                    dw2 = _wgrad(dw2, da, rr, own, HAS_W2, MMA, PREC, ACC)

        if MODE == _BWD:  # this tile's mixing gradients into the program's partials
            wptr = pid.to(tl.int64) * (HP * HP) + hh[:, None] * HP + hh[None, :]
            if HAS_W1:
                tl.store(pw1_ptr + wptr, tl.load(pw1_ptr + wptr) + dw1)
            if HAS_W2:
                tl.store(pw2_ptr + wptr, tl.load(pw2_ptr + wptr) + dw2)
        if MODE == _FWD or MODE == _BWD:
            tl.debug_barrier()
            # ---- H3: per-head products of the owned block: O; dq, dk, dv, the pre kernel's gradient
            if MODE == _FWD:
                for h in tl.range(0, H, num_stages=2):
                    bh = b.to(tl.int64) * H + h
                    a = tl.load(scr + S_A * SLOT + h * PLANE + u[:, None] * EC + w[None, :]).to(MMA)
                    a = tl.where(own_w[None, :], a, 0.0).to(MMA)  # (rows it does not own: never read)
                    for e0 in tl.static_range(0, DPAD, GP):
                        oa = tl.dot(a, _tile(vd, bh, col0, e0, EC, GP, MMA, MARGIN), input_precision=PREC,
                                    out_dtype=ACC)
                        _accumulate(pod, (slot * H + h).to(tl.int32), 0, e0, oa, ER, GP, ACC)
            if MODE == _BWD:
                # the backward's products, one kind per head loop, so that no two kinds' operands
                # and results are live at once (registers): dq and dk from dS, dv from A, the pre
                # kernel's gradient. The product loops hold no inner loop, so they pipeline
                # (their TMA reductions overlap the next head; one completion wait per loop):
                # with a pre kernel, dS (its adjoint of dC, a loop per row shift) is computed
                # first, scaled, into the DA planes, free since the mixing phase
                # the owned, allowed cells of the tile: where dS and A are nonzero
                own2 = own_u[:, None] & own_w[None, :] & _allowed(i[:, None], j[None, :], b, kv_ptr, Tq, Tk, q_off,
                                                                  HAS_KV)
                if HAS_K1:
                    for h in tl.range(0, H, num_stages=1):
                        ds = _conv(scr + S_DC * SLOT + h * PLANE, ta1d, h * CQ1 * EC, CQ1, True, ER, EC, MMA, ACC,
                                   PREC)
                        tl.store(scr + S_DA * SLOT + h * PLANE + u[:, None] * EC + w[None, :],
                                 _to_scratch(tl.where(own2, ds * scale, 0.0), scr_ptr.dtype.element_ty, RNE))
                    tl.debug_barrier()
                for h in tl.range(0, H, num_stages=2):
                    bh = b.to(tl.int64) * H + h
                    if HAS_K1:
                        ds = tl.load(scr + S_DA * SLOT + h * PLANE + u[:, None] * EC + w[None, :]).to(MMA)
                    else:
                        ds = tl.load(scr + S_DC * SLOT + h * PLANE + u[:, None] * EC + w[None, :]).to(ACC)
                        ds = tl.where(own2, ds * scale, 0.0).to(MMA)
                    for e0 in tl.static_range(0, DPAD, GP):
                        _grad_pair(ds, kd, qd, pdqd, dkd, bh, row0, col0, slot * H + h, e0, GP, ER, EC, True,
                                   MMA, ACC, PREC, MARGIN)
                for h in tl.range(0, H, num_stages=2):
                    bh = b.to(tl.int64) * H + h
                    ac = tl.where(own2, tl.load(scr + S_A * SLOT + h * PLANE + u[:, None] * EC + w[None, :]),
                                  0.0).to(MMA)
                    for e0 in tl.static_range(0, DPAD, GP):
                        _grad_pair(ac, dod, dod, pdqd, dvd, bh, row0, col0, 0, e0, GP, ER, EC, False,
                                   MMA, ACC, PREC, MARGIN)
                if HAS_K1:
                    for h in tl.range(0, H, num_stages=1):
                        g = tl.where(own_u[:, None] & own_w[None, :],
                                     tl.load(scr + S_DC * SLOT + h * PLANE + u[:, None] * EC + w[None, :]), 0.0)
                        _conv_weight_grad(scr + S_S0 * SLOT + h * PLANE, g,
                                          pt1_ptr + (pid.to(tl.int64) * HP + h) * (CQ1 * CK1), PL1, CQ1, CK1, CKP1,
                                          ER, EC, MMA, ACC, PREC)



# ----------------------------------------------------------------------------- host side
def _khat(k_m: torch.Tensor, theta: torch.Tensor, pl: int) -> torch.Tensor:
    """Keys convolved along the key axis with each kernel row: (B, H, T, d), theta (H, c_q, c_k)
    -> (B, H, c_q, T, d), khat[rho][j] = sum_b theta[c_q-1-rho, b] k[j + b - pl] (0 outside)."""
    cq, ck = theta.shape[1:]
    kp = F.pad(k_m, (0, 0, pl, ck - 1 - pl))  # (B, H, T + ck - 1, d)
    win = kp.unfold(2, ck, 1)  # (B, H, T, d, ck)
    return torch.einsum("bhtdk,hrk->bhrtd", win, theta.flip(1).to(k_m.dtype)).contiguous()


def band_width(cq: int, ck: int, pl: int) -> int:
    """Diagonals next to the diagonal whose convolved score reads a future (masked) score."""
    return cq - 1 + ck - 1 - pl


def _band(q_m: torch.Tensor, k_m: torch.Tensor, theta: torch.Tensor, pl: int, q_off: int, scale: float) -> torch.Tensor:
    """The causal correction of the factorised pre-softmax convolution: (B, H, Tq, NB) with
    [i, t] = sum of kernel x score over the taps of output (i, j = i + q_off - t) that read a
    future score (key m > row r + q_off); the kernel subtracts it on those cells."""
    b_, h_, tq, d = q_m.shape
    tk = k_m.shape[2]
    cq, ck = theta.shape[1:]
    nb = band_width(cq, ck, pl)
    acc = torch.promote_types(q_m.dtype, torch.float32)
    delta = torch.arange(1, nb + 1, device=q_m.device)
    kidx = torch.arange(tq, device=q_m.device)[:, None] + q_off + delta[None, :]  # (Tq, NB): key of (r, delta)
    kg = k_m[:, :, kidx.clamp(max=tk - 1)].to(acc) * (kidx < tk)[None, None, :, :, None]
    sband = torch.einsum("bhrd,bhrnd->bhrn", q_m.to(acc), kg) * scale  # (B, H, Tq, NB): S[r, r + q_off + delta]
    # coefficient of sband[i - rho, delta] in correction[i, t]: theta[c_q-1-rho, kappa + pl], kappa = delta + t - rho
    rho = torch.arange(cq, device=q_m.device)[:, None, None]
    t = torch.arange(nb, device=q_m.device)[None, :, None]
    kappa = delta[None, None, :] + t - rho  # (cq, NB, NB)
    valid = (kappa >= -pl) & (kappa <= ck - 1 - pl)
    th = theta.flip(1).to(acc)  # th[h, rho] = theta[c_q-1-rho]
    coef = th[:, rho.expand_as(kappa), (kappa + pl).clamp(0, ck - 1)] * valid  # (H, cq, NB, NB)
    shifted = torch.stack([F.pad(sband, (0, 0, r, 0))[:, :, :tq] for r in range(cq)], 2)  # (B, H, cq, Tq, NB)
    return torch.einsum("bhrin,hrtn->bhit", shifted, coef).contiguous()


def _toeplitz(theta: torch.Tensor, ec: int, hp: int, adjoint: bool, off: int) -> torch.Tensor:
    """Per head and row shift rho, the (ec, ec) Toeplitz matrix of one kernel row's key taps
    that maps a frame's columns m to its columns n: T[m, n] = theta[c_q-1-rho, m - n + off]
    (adjoint: theta[c_q-1-rho, c_k-1-(m - n + off)]) for 0 <= m - n + off < c_k, off the taps'
    reach left of the output column (pad_left; the adjoint's: c_k-1-pad_left).
    theta (H, c_q, c_k) -> (HP, c_q, ec, ec)."""
    h, cq, ck = theta.shape
    m = torch.arange(ec, device=theta.device)[:, None]
    n = torch.arange(ec, device=theta.device)[None, :]
    bb = m - n + off
    ok = (bb >= 0) & (bb < ck)
    tap = (ck - 1 - bb) if adjoint else bb
    th = theta.flip(1)
    out = torch.zeros(hp, cq, ec, ec, dtype=theta.dtype, device=theta.device)
    out[:h] = th[:, :, tap.clamp(0, ck - 1)] * ok
    return out


def _types(dtype: torch.dtype, device: torch.device):
    """(dot operand type, accumulator type, tl.dot precision, scratch dtype) for inputs of
    ``dtype``. The interpreter computes 16-bit dots wrongly, so there they run on fp32."""
    if dtype == torch.float64:
        return tl.float64, tl.float64, "ieee", torch.float64
    if device.type == "cpu":
        return tl.float32, tl.float32, "ieee", dtype
    if dtype == torch.float32:
        return tl.float32, tl.float32, "tf32", torch.float32
    return (tl.bfloat16 if dtype == torch.bfloat16 else tl.float16), tl.float32, "tf32", dtype


class _Problem:
    """Everything a launch needs that does not change between the passes of one call."""

    def __init__(self, q, k, v, kv, k1, w1, k2, w2, pad_key, q_off, p_drop, seed, tuning=DEFAULT_TUNING):
        self.tuning = tuning  # the model's model.kernels: frames, programs, slab rows
        self.b, self.h, self.tq, self.d = q.shape
        self.tk = k.shape[2]
        self.dev = q.device
        self.gpu = q.device.type != "cpu"
        self.hp = frames.padded_heads(self.h, self.gpu)
        self.gp, self.dpad = frames.feature_parts(self.d)
        self.mma, self.acc, self.prec, self.sdt = _types(q.dtype, q.device)
        self.acc_t = torch.float64 if q.dtype == torch.float64 else torch.float32
        self.pre = None if k1 is None else tuple(k1.shape[1:])
        self.post = None if k2 is None else tuple(k2.shape[1:])
        self.pad_key, self.q_off, self.p_drop, self.seed = pad_key, q_off, p_drop, seed
        self.kv = kv
        self.scale = self.d ** -0.5
        if kv is not None:  # pad rows of q and keys of k give exactly the zero scores the reference masks
            vq = kv[:, q_off:q_off + self.tq].to(q.dtype)[:, None, :, None]
            vk = kv.to(k.dtype)[:, None, :, None]
            q, k = q * vq, k * vk
        self.q, self.k, self.v = q.contiguous(), k.contiguous(), v.contiguous()
        self.k1, self.k2 = k1, k2
        self.pl1 = frames.pad_left(pad_key, self.pre[1]) if self.pre else 0
        self.pl2 = frames.pad_left(pad_key, self.post[1]) if self.post else 0
        if k1 is not None:
            khat = _khat(self.k, k1.to(self.acc_t), self.pl1)
            self.band = _band(self.q, self.k, k1.to(self.acc_t), self.pl1, q_off, self.scale)
            self.nb1 = self.band.shape[-1]
        else:
            khat, self.band, self.nb1 = None, None, 0

        def padw(x):
            if x is None:
                return None
            out = torch.zeros(self.hp, self.hp, dtype=self.acc_t, device=self.dev)
            out[:self.h, :self.h] = x.t()
            return out

        self.w1t, self.w2t = padw(w1), padw(w2)
        # the argument of every pointer a pass does not use: never read
        self.dummy = _buffer("dummy", frames.Buffer((1,), self.acc_t, None), self.dev)
        # the descriptors' copies: (planes, MARGIN + T, DPAD), zero rows in front and features
        # zero-padded to whole GP parts
        self.margin = frames.margin(self.pre, self.post, pad_key)
        self.qp, self.kp, self.vp = self.padded(self.q), self.padded(self.k), self.padded(self.v)
        self.khatp = self.padded(khat.flatten(1, 2)) if k1 is not None else self.kp

    def padded(self, x: torch.Tensor) -> torch.Tensor:
        """(..., T, d) -> a contiguous (planes, MARGIN + T, DPAD) copy, 16-byte aligned: the
        ``frames.margin`` zero rows in front (the rows before the sequence the kernel's
        descriptor copies read, at coordinates >= 0) and the features zero-padded to whole
        feature parts (the tensor itself, no copy, where neither pads and it is aligned: the
        layers without convolutions have no margin)."""
        x = x.reshape(-1, x.shape[-2], x.shape[-1])
        if self.margin or self.dpad != self.d:
            x = F.pad(x, (0, self.dpad - self.d, self.margin, 0))
        x = x.contiguous()
        return x if x.data_ptr() % 16 == 0 else x.clone()

    def geometry(self, mode: int):
        f = frames.frame(frames.PASSES[mode], self.pre, self.post, self.pad_key, self.tuning)
        n_prog_target = programs(self.dev, self.tuning)
        sched = frames.items(f, self.b, self.tq, self.tk, self.q_off, n_prog_target)
        return f, sched, len(sched.starts) - 1

    def toeplitz(self, ec: int):
        """The convolutions' Toeplitz tables in the operand dtype (bf16 on a GPU)."""
        dt = self.sdt if self.gpu else self.acc_t

        def table(theta, adjoint, pl):  # 2-D, as its tensor descriptor reads it: (HP * c_q * ec, ec)
            off = theta.shape[-1] - 1 - pl if adjoint else pl
            return _toeplitz(theta.to(self.acc_t), ec, self.hp, adjoint, off).to(dt).reshape(-1, ec).contiguous()

        if self.k2 is not None:
            self.tf2, self.ta2 = table(self.k2, False, self.pl2), table(self.k2, True, self.pl2)
        if self.k1 is not None:
            self.ta1 = table(self.k1, True, self.pl1)


def programs(device: torch.device, tuning: KernelTuning = DEFAULT_TUNING) -> int:
    """Persistent programs of a launch: ``frames.PROGRAMS_PER_SM`` per SM on a GPU; in the
    interpreter one per item (its programs run one after another anyway).
    ``model.kernels.triton_programs`` overrides (tests run a GPU's multi-tile items in the
    interpreter)."""
    if tuning.triton_programs is not None:
        return tuning.triton_programs
    if device.type == "cpu":
        return 1 << 30
    return frames.PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count


def slab_rows(pass_: str, f: frames.Frame, gpu: bool, conv: bool, tuning: KernelTuning = DEFAULT_TUNING) -> int:
    """Frame rows per mixing slab: ``frames.SLAB_ROWS_GPU`` (a layer with a convolution:
    ``SLAB_ROWS_GPU_CONV``) on a GPU, the whole frame in the interpreter (fewest interpreted
    ops); ``model.kernels.triton_slab_rows`` overrides (tests run the GPU's slabs in the
    interpreter)."""
    sr = tuning.triton_slab_rows
    if sr is not None:
        if f.er % sr:  # a power of two already (KernelTuning); the frame is known only here
            raise UserError(f"model.kernels.triton_slab_rows={sr}: a power of two dividing the frame's {f.er} rows")
        return sr
    return min(f.er, frames.SLAB_ROWS_GPU_CONV if conv else frames.SLAB_ROWS_GPU[pass_]) if gpu else f.er


def kernel_constexprs(mode: int, f: frames.Frame, *, h: int, d: int, pre, post, pad_key: str, has_w1: bool,
                      has_w2: bool, has_kv: bool, drop: bool, gpu: bool, dtype: torch.dtype,
                      tuning: KernelTuning = DEFAULT_TUNING) -> dict:
    """The constexprs of one pass's launch: the one source for ``_launch`` and
    ``scripts/compile_triton.py`` (which compiles exactly what runs); ``tuning``: the
    model's (slab rows)."""
    cq1, ck1 = pre or (1, 1)
    cq2, ck2 = post or (1, 1)
    pl1 = frames.pad_left(pad_key, ck1) if pre else 0
    pl2 = frames.pad_left(pad_key, ck2) if post else 0
    mma, acc, prec, sdt = _types(dtype, torch.device("cuda" if gpu else "cpu"))
    gp, dpad = frames.feature_parts(d)
    return dict(
        MODE=mode, H=h, HP=frames.padded_heads(h, gpu), DPAD=dpad,
        ER=f.er, EC=f.ec, TOP=f.top, LEFT=f.left, BMO=f.bmo, BNO=f.bno, SR=slab_rows(frames.PASSES[mode], f, gpu, pre is not None or post is not None, tuning),
        HAS_K1=pre is not None, CQ1=cq1, CK1=ck1, CKP1=frames.pow2(ck1), PL1=pl1, NB1=band_width(cq1, ck1, pl1) if pre else 0,
        HAS_W1=has_w1, HAS_K2=post is not None, CQ2=cq2, CK2=ck2, CKP2=frames.pow2(ck2), PL2=pl2, HAS_W2=has_w2,
        HAS_KV=has_kv, DROP=drop, MMA=mma, ACC=acc, PREC=prec, RNE=not gpu and sdt == torch.bfloat16,
        GP=gp, MARGIN=frames.margin(pre, post, pad_key),
        **frames.scratch_slots(frames.PASSES[mode], pre is not None, post is not None),
    )


def descriptor_specs(consts: dict) -> dict:
    """{kernel argument: (input, block shape)} of the kernel's tensor descriptors: rows x GP
    features of a (planes, T, DPAD) input or accumulator; the Toeplitz tables' (EC, EC) blocks
    of a (HP * c_q * EC, EC) table. The one source for ``_launch`` and
    ``scripts/compile_triton.py``."""
    er, ec, gp = consts["ER"], consts["EC"], consts["GP"]
    return {"qd": ("q", [1, er, gp]), "kd": ("k", [1, ec, gp]), "vd": ("v", [1, ec, gp]), "dod": ("do", [1, er, gp]),
            "khd": ("khat", [1, ec, gp]), "tf2d": ("tf2", [ec, ec]), "ta2d": ("ta2", [ec, ec]), "ta1d": ("ta1", [ec, ec]),
            # the accumulators (fp32; ``ACCUMULATORS``): O's and dq's per-item row partials, dk, dv
            "pod": ("po", [1, er, gp]), "pdqd": ("pdq", [1, er, gp]), "dkd": ("dk", [1, ec, gp]),
            "dvd": ("dv", [1, ec, gp])}


ACCUMULATORS = ("po", "pdq", "dk", "dv")  # descriptor sources in the accumulator dtype, the rest in the inputs'



def _empty(name: str, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every buffer a launch allocates (``frames.pass_buffers``, the placeholders of the
    arguments a pass does not use): uninitialised, as ``torch.empty``. The one allocator of the
    launcher, so that a test can replace it and prove that every buffer is written before it is
    read or filled by ``_buffer``: tests/conftest.py fills each with NaN in every Triton test,
    tests/test_kernel_hazards.py compares poisoned and clean runs bit for bit."""
    return torch.empty(shape, dtype=dtype, device=device)


def _buffer(name: str, spec: frames.Buffer, device: torch.device) -> torch.Tensor:
    """A buffer of ``spec`` from ``_empty``, filled with ``spec.fill`` unless that is None
    (every cell written before it is read)."""
    x = _empty(name, tuple(spec.shape), spec.dtype, device)
    return x if spec.fill is None else x.fill_(spec.fill)


def _descriptor(x: Optional[torch.Tensor], block: list, dtype: torch.dtype, device: torch.device):
    """A host tensor descriptor of x ((planes, T, DPAD) or a 2-D table), or of an
    uninitialised placeholder of the block's shape when this pass does not use it (its loads
    and stores are compiled out: never read)."""
    if x is None:
        x = _empty("placeholder", tuple(block), dtype, device)
    return TensorDescriptor.from_tensor(x, block)


def _launch(mode: int, pb: _Problem, bufs: dict, do: Optional[torch.Tensor] = None):
    f, sched, n_prog = pb.geometry(mode)
    pb.toeplitz(f.ec)
    specs = frames.pass_buffers(frames.PASSES[mode], f, sched, n_prog, b=pb.b, h=pb.h, hp=pb.hp, tk=pb.tk,
                                dpad=pb.dpad, pre=pb.pre, post=pb.post, dtype=pb.q.dtype, margin=pb.margin)
    scratch_spec = specs.pop("scratch")
    specs.pop("tiles")  # built below from the schedule
    for name, spec in specs.items():
        bufs[name] = _buffer(name, spec, pb.dev)
    if not sched.items:
        return f, sched
    consts = kernel_constexprs(mode, f, h=pb.h, d=pb.d, pre=pb.pre, post=pb.post, pad_key=pb.pad_key,
                               has_w1=pb.w1t is not None, has_w2=pb.w2t is not None, has_kv=pb.kv is not None,
                               drop=pb.p_drop > 0.0, gpu=pb.gpu, dtype=pb.q.dtype, tuning=pb.tuning)
    # unwritten cells are never read (each phase writes whole planes before the next reads)
    scratch = _buffer("scratch", scratch_spec, pb.dev)
    inputs = {"q": pb.qp, "k": pb.kp, "v": pb.vp, "do": None if do is None else pb.padded(do),
              "khat": pb.khatp, "tf2": getattr(pb, "tf2", None), "ta2": getattr(pb, "ta2", None),
              "ta1": getattr(pb, "ta1", None)}
    for name in ACCUMULATORS:  # (planes, rows, DPAD) views of the accumulators this pass adds into
        inputs[name] = bufs[name].flatten(0, 1) if name in bufs else None
    descs = {name: _descriptor(inputs[src], block, pb.acc_t if src in ACCUMULATORS else pb.qp.dtype, pb.dev)
             for name, (src, block) in descriptor_specs(consts).items()}
    tiles, tile_starts = sched.tiles()
    tile_rows = torch.tensor(tiles, dtype=torch.int32, device=pb.dev).flatten()
    starts = torch.tensor(tile_starts, dtype=torch.int32, device=pb.dev)
    dm = pb.dummy

    def buf(name):
        return bufs.get(name, dm)

    num_warps, num_stages = frames.launch_config(frames.PASSES[mode], pb.pre, pb.post)
    try:
        _mta_kernel[(n_prog,)](
            descs["qd"], descs["kd"], descs["vd"], descs["dod"], descs["khd"], pb.band if pb.band is not None else dm,
            pb.kv if pb.kv is not None else dm,
            pb.w1t if pb.w1t is not None else dm, pb.w2t if pb.w2t is not None else dm,
            descs["tf2d"], descs["ta2d"], descs["ta1d"],
            buf("lse"), buf("dd"), tile_rows, starts,
            buf("pm"), buf("pl"), descs["pod"], buf("pd"), descs["pdqd"], descs["dkd"], descs["dvd"],
            buf("pw1"), buf("pw2"), buf("pt1"), buf("pt2"), scratch,
            pb.tq, pb.tk, pb.q_off, pb.scale, pb.p_drop, pb.seed,
            **consts, num_warps=num_warps, num_stages=num_stages,
        )
    except triton.runtime.errors.OutOfResources as e:
        # What a real compile shows and the interpreter cannot (scripts/compile_triton.py
        # reports each pass's needs without a GPU).
        raise RuntimeError(
            f"model.attn_impl=triton: its {frames.PASSES[mode]!r} pass does not fit this GPU ({e}); frame "
            f"{f.er}x{f.ec}, {pb.h} heads of {pb.d}. Use model.attn_impl=blocked, or a smaller model.kernels.triton_frame"
        ) from e
    return f, sched


def _per_row(part: torch.Tensor, f, sched, pb: _Problem, reduce=lambda x: x.sum(2)) -> torch.Tensor:
    """Per-slot partials (slots, ...) -> (B, X, Tq, ...) over the owned rows, the key splits
    of a row block combined by ``reduce`` ((B, n_rt, S, ...) -> (B, n_rt, X, ER, ...); a sum
    unless told)."""
    x = part.view(pb.b, sched.n_rt, sched.s_max, *part.shape[1:])
    x = reduce(x)  # (B, n_rt, X, ER, ...)
    x = x[:, :, :, f.top:f.top + f.bmo]  # owned rows
    x = x.transpose(1, 2).reshape(pb.b, x.shape[2], sched.n_rt * f.bmo, *x.shape[4:])
    return x[:, :, :pb.tq]


def _merge_stats(x: torch.Tensor) -> torch.Tensor:
    """(B, n_rt, S, 2, HP, ER) per key split (row max, sum of exp(z - max)) -> (B, n_rt, HP, ER)
    lse; a pad row (nothing allowed) gets 0, its probabilities are masked anyway."""
    m, l_ = x[:, :, :, 0], x[:, :, :, 1]
    mx = m.amax(2, keepdim=True)
    mx_safe = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
    tot = (l_ * torch.exp(m - mx_safe)).sum(2)
    return torch.where(tot > 0, mx_safe.squeeze(2) + torch.log(torch.where(tot > 0, tot, torch.ones_like(tot))),
                       torch.zeros_like(tot))


class _MTATriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, k1, w1, k2, w2, key_valid, q_off, pad_key, p_drop, tuning):
        kv = None if key_valid is None else key_valid.to(torch.int8).contiguous()
        seed = int(torch.randint(0, 2**31 - 1, ())) if p_drop > 0.0 else 0
        pb = _Problem(q, k, v, kv, k1, w1, k2, w2, pad_key, q_off, p_drop, seed, tuning)
        bufs: dict = {}
        f, sched = _launch(_STATS.value, pb, bufs)
        ml = torch.stack((bufs["pm"], bufs["pl"]), 1)  # (slots, 2, HP, ER): each split's row max and sum
        lse = _per_row(ml, f, sched, pb, _merge_stats)[:, :pb.h].contiguous()
        fb = {"lse": lse}
        f, sched = _launch(_FWD.value, pb, fb)
        out = _per_row(fb["po"][..., :pb.d], f, sched, pb)
        ctx.save_for_backward(q, k, v, lse, kv, k1, w1, k2, w2)
        ctx.args = (pad_key, q_off, p_drop, seed, tuning)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, do):
        q, k, v, lse, kv, k1, w1, k2, w2 = ctx.saved_tensors
        pad_key, q_off, p_drop, seed, tuning = ctx.args
        do = do.contiguous()
        pb = _Problem(q, k, v, kv, k1, w1, k2, w2, pad_key, q_off, p_drop, seed, tuning)
        bufs = {"lse": lse}
        f, sched = _launch(_ROWSUM.value, pb, bufs, do)
        dd = _per_row(bufs["pd"], f, sched, pb)[:, :pb.h].contiguous()
        bufs["dd"] = dd
        f, sched = _launch(_BWD.value, pb, bufs, do)
        dq = _per_row(bufs["pdq"][..., :pb.d], f, sched, pb)
        dk, dv = bufs["dk"][..., pb.margin:, :pb.d], bufs["dv"][..., pb.margin:, :pb.d]  # after the zero margin
        if kv is not None:
            dq = dq * kv[:, q_off:q_off + pb.tq].to(dq.dtype)[:, None, :, None]
            dk = dk * kv.to(dk.dtype)[:, None, :, None]
        h = pb.h
        g1 = bufs["pw1"].sum(0)[:h, :h] if w1 is not None else None
        g2 = bufs["pw2"].sum(0)[:h, :h] if w2 is not None else None
        t1 = bufs["pt1"].sum(0)[:h] if k1 is not None else None
        t2 = bufs["pt2"].sum(0)[:h] if k2 is not None else None
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), t1, g1, t2, g2, None, None, None, None, None)


def explicit_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    p: ExplicitAttnParams,
    mask: AttnMask,
    training: bool = False,
) -> torch.Tensor:
    """``explicit_attention_torch`` in fused Triton kernels; shapes as there."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32

    def cast(t):
        return None if t is None else t.to(acc).contiguous()

    w2 = post_mix_matrix(p)
    return _MTATriton.apply(
        q, k, v,
        cast(None if p.mta_kernel is None else p.mta_kernel[:, 0]),
        cast(p.wpsm),
        cast(None if p.mta_kernel_after_sm is None else p.mta_kernel_after_sm[:, 0]),
        cast(w2),
        mask.key_valid, mask.q_offset, p.pad_key, p.dropout if training else 0.0, p.tuning,
    )

