"""The ``@triton.jit`` building blocks both kernels share (``fused.py``, ``stored.py``):
masks, descriptor loads and reductions, the scores, the Toeplitz convolutions and their
weight gradients, the all-heads slabs of the head mixings. Importing this module defines
them, so under ``TRITON_INTERPRET=1`` it first gives Triton's interpreter what the kernels
need (descriptor reductions; ``mta_repro.kernels.triton_interp``)."""

from __future__ import annotations

# Triton's DSL is not typable: tl.range loops and constexpr arguments
# pyright: reportGeneralTypeIssues=false, reportArgumentType=false
import triton
import triton.language as tl

from mta_repro.kernels import triton_interp


def _interpreter_descriptor_reduce(builder, kind, desc, value, indices):
    """What a descriptor's ``atomic_add`` means, for Triton's interpreter, which (3.9) has no
    descriptor reductions: an atomic add of the box into the elements inside the tensor
    (``TensorDescHandle.materialize_pointers``: the box's addresses and which lie in bounds)."""
    from triton._C.libtriton import ir

    if kind != ir.DESCRIPTOR_REDUCE_KIND.ADD:
        raise NotImplementedError(f"interpreter: descriptor reduction {kind}")
    ptrs, mask = desc.materialize_pointers(indices)
    return builder.create_atomic_rmw(
        ir.ATOMIC_OP.FADD, ptrs, value, mask, ir.MEM_SEMANTIC.RELAXED, ir.MEM_SYNC_SCOPE.GPU
    )


def _install_interpreter_reduce() -> None:
    from triton.runtime import interpreter

    if not hasattr(interpreter.InterpreterBuilder, "create_descriptor_reduce"):
        interpreter.InterpreterBuilder.create_descriptor_reduce = _interpreter_descriptor_reduce  # pyright: ignore[reportAttributeAccessIssue]  # added to the interpreter


if triton_interp.interpreting():  # read when the kernels are defined, as Triton does
    _install_interpreter_reduce()
    triton_interp.install()


@triton.jit
def allowed_cells(i, j, b, kv_ptr, Tq, Tk, q_off, HAS_KV: tl.constexpr):
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
def load_tile(desc, plane, r0, e0, R: tl.constexpr, GP: tl.constexpr, MMA: tl.constexpr, M0: tl.constexpr = 0):
    """(R, GP) rows [r0, r0 + R) x features [e0, e0 + GP) of plane ``plane`` of a (planes, M0 +
    T, DPAD) input through its tensor descriptor (a TMA copy on sm_90): row r lies at row M0 + r
    of the plane, after M0 zero rows (``tiles.margin``: the launcher's copy), so rows before
    the sequence (r0 >= -M0) are read from that zero margin and every coordinate is >= 0; rows
    past its end are read as 0 by the copy's bounds. No offset tensors or bounds masks exist in
    registers (the compiler would hoist them: registers for the whole kernel)."""
    return desc.load([plane.to(tl.int32), r0 + M0, e0]).reshape(R, GP).to(MMA)  # TMA coordinates are int32


@triton.jit
def frame_products(
    ad,
    bd,
    bh,
    row0,
    col0,
    ER: tl.constexpr,
    EC: tl.constexpr,
    GP: tl.constexpr,
    DPAD: tl.constexpr,
    MMA: tl.constexpr,
    ACC: tl.constexpr,
    PREC: tl.constexpr,
    M0: tl.constexpr = 0,
):
    """(ER, EC) products a[row0 + u] . b[col0 + w] of one head (plane bh) on a frame, through
    the inputs' descriptors (M0: their zero margin, ``load_tile``): q.k for the scores, dO.v for
    dA. A runtime loop over the feature parts: one set of operand buffers, prefetched by the
    pipeliner."""
    acc = tl.zeros([ER, EC], ACC)
    for e0 in tl.range(0, DPAD, GP):
        acc = tl.dot(
            load_tile(ad, bh, row0, e0, ER, GP, MMA, M0),
            tl.trans(load_tile(bd, bh, col0, e0, EC, GP, MMA, M0)),
            acc,
            input_precision=PREC,
            out_dtype=ACC,
        )
    return acc


@triton.jit
def qk_scores(
    qd,
    kd,
    bh,
    row0,
    col0,
    scale,
    ER: tl.constexpr,
    EC: tl.constexpr,
    GP: tl.constexpr,
    DPAD: tl.constexpr,
    MMA: tl.constexpr,
    ACC: tl.constexpr,
    PREC: tl.constexpr,
    M0: tl.constexpr = 0,
):
    """(ER, EC) scores q[row0 + u] . k[col0 + w] * scale of one head on a frame (``frame_products``)."""
    return frame_products(qd, kd, bh, row0, col0, ER, EC, GP, DPAD, MMA, ACC, PREC, M0) * scale


@triton.jit
def to_scratch(x, dtype: tl.constexpr, RNE: tl.constexpr):
    """x in the scratch dtype. RNE (the interpreter with bf16 scratch): round to nearest even
    first, as a GPU's conversion does; the interpreter's own fp32 -> bf16 truncates, which
    would bias every stage handed through scratch."""
    if RNE:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def plane_rows(plane, du, ER: tl.constexpr, EC: tl.constexpr, MMA: tl.constexpr):
    """A scratch plane (ER x EC) with its rows shifted by du: frame rows [du, du + ER), 0 outside
    the frame. Every convolution reads its input this way, the frame's own columns: the frame's
    margins hold the key taps of every cell whose result is used (``tiles.halo``)."""
    u = du + tl.arange(0, ER)
    w = tl.arange(0, EC)
    return tl.load(plane + u[:, None] * EC + w[None, :], mask=((u >= 0) & (u < ER))[:, None], other=0.0).to(MMA)


@triton.jit
def add_taps(
    x,
    gm,
    ptr,
    SHIFT: tl.constexpr,
    CK: tl.constexpr,
    CKP: tl.constexpr,
    EC: tl.constexpr,
    ACC: tl.constexpr,
    PREC: tl.constexpr,
):
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
def toeplitz_conv(
    plane,
    td,
    t0,
    CQ: tl.constexpr,
    ADJ: tl.constexpr,
    ER: tl.constexpr,
    EC: tl.constexpr,
    MMA: tl.constexpr,
    ACC: tl.constexpr,
    PREC: tl.constexpr,
):
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
        acc = tl.dot(
            plane_rows(plane, du, ER, EC, MMA),
            td.load([t0 + rho * EC, 0]).to(MMA),
            acc,
            input_precision=PREC,
            out_dtype=ACC,
        )
    return acc


@triton.jit
def conv_weight_grad(
    xplane,
    g,
    part,
    OFF: tl.constexpr,
    CQ: tl.constexpr,
    CK: tl.constexpr,
    CKP: tl.constexpr,
    ER: tl.constexpr,
    EC: tl.constexpr,
    MMA: tl.constexpr,
    ACC: tl.constexpr,
    PREC: tl.constexpr,
):
    """part[a, b] += sum over cells (u, w) of G[u, w] X[u - rho, w + b - OFF], a = CQ-1-rho:
    G (ER, EC) is this head's output gradient, already zero outside the owned cells; X the
    convolution's input plane."""
    gm = g.to(MMA)
    for rho in tl.range(0, CQ):
        add_taps(plane_rows(xplane, -rho, ER, EC, MMA), gm, part + (CQ - 1 - rho) * CK, -OFF, CK, CKP, EC, ACC, PREC)


@triton.jit
def conv_and_weight_grad(
    plane,
    td,
    t0,
    g,
    part,
    OFF: tl.constexpr,
    CQ: tl.constexpr,
    CK: tl.constexpr,
    CKP: tl.constexpr,
    ER: tl.constexpr,
    EC: tl.constexpr,
    MMA: tl.constexpr,
    ACC: tl.constexpr,
    PREC: tl.constexpr,
):
    """``toeplitz_conv`` (forward) of the plane and ``conv_weight_grad`` with gradient g, from the same
    shifted planes (each loaded once for both)."""
    acc = tl.zeros([ER, EC], ACC)
    gm = g.to(MMA)
    for rho in tl.range(0, CQ):
        x = plane_rows(plane, -rho, ER, EC, MMA)
        acc = tl.dot(x, td.load([t0 + rho * EC, 0]).to(MMA), acc, input_precision=PREC, out_dtype=ACC)
        add_taps(x, gm, part + (CQ - 1 - rho) * CK, -OFF, CK, CKP, EC, ACC, PREC)
    return acc


@triton.jit
def accumulate(desc, plane, r0, e0, x, R: tl.constexpr, GP: tl.constexpr, ACC: tl.constexpr):
    """desc[plane, r0 : r0 + R, e0 : e0 + GP] += x (R, GP): a bulk tensor reduction (a TMA
    reduction on sm_90: no per-thread addresses, masks or layout change for it; rows past the
    descriptor's end, e.g. keys beyond Tk, are not written; dk and dv take keys before 0 in
    their zero margin, ``tiles.margin``, so r0 >= 0). Reductions are 32 bits
    wide at most, so a float64 accumulator (the interpreter's float64 checks; on a GPU the
    registry runs ``blocked`` for float64, ``impl.py``) is read, added
    and written back: exact there, where programs run one after another."""
    if ACC == tl.float64:
        desc.store([plane, r0, e0], desc.load([plane, r0, e0]) + x.reshape(1, R, GP))
    else:
        desc.atomic_add([plane, r0, e0], x.reshape(1, R, GP))


@triton.jit
def grad_pair(
    g,
    xd,
    yd,
    xod,
    yod,
    bh,
    row0,
    col0,
    xo_plane,
    E0,
    GP: tl.constexpr,
    ER: tl.constexpr,
    EC: tl.constexpr,
    HAS_XO: tl.constexpr,
    MMA: tl.constexpr,
    ACC: tl.constexpr,
    PREC: tl.constexpr,
    M0: tl.constexpr = 0,
):
    """Features [E0, E0 + GP) (one feature part) of one head's products of a tile
    gradient g (ER x EC, zero outside the owned cells, so the rest adds 0): yo += g^T @ y[rows]
    into keys [col0, col0 + EC) of plane bh of yod, and (HAS_XO) xo += g @ x[cols] into plane
    xo_plane of xod, its item's row partial. dS gives dk from q and dq from k, A gives dv from dO.
    M0: the zero margin in front of the inputs' rows and of yod's keys (``load_tile``)."""
    if HAS_XO:
        xo = tl.dot(g, load_tile(xd, bh, col0, E0, EC, GP, MMA, M0), input_precision=PREC, out_dtype=ACC)
        accumulate(xod, xo_plane.to(tl.int32), 0, E0, xo, ER, GP, ACC)
    yo = tl.dot(tl.trans(g), load_tile(yd, bh, row0, E0, ER, GP, MMA, M0), input_precision=PREC, out_dtype=ACC)
    accumulate(yod, bh.to(tl.int32), col0 + M0, E0, yo, EC, GP, ACC)


@triton.jit
def slab_cells(
    r0,
    row0,
    col0,
    b,
    kv_ptr,
    Tq,
    Tk,
    q_off,
    HAS_KV: tl.constexpr,
    ER: tl.constexpr,
    EC: tl.constexpr,
    TOP: tl.constexpr,
    LEFT: tl.constexpr,
    BMO: tl.constexpr,
    BNO: tl.constexpr,
    SR: tl.constexpr,
):
    """The cells of the slab of SR frame rows from r0: frame rows cu and columns cw, query and
    key indices ci and cj, which interact (ok), which are owned and interact (own), and the
    slab's query rows."""
    cell = tl.arange(0, SR * EC)
    cu = r0 + cell // EC
    cw = cell % EC
    ci = row0 + cu
    cj = col0 + cw
    ok = allowed_cells(ci, cj, b, kv_ptr, Tq, Tk, q_off, HAS_KV)
    own = (cu >= TOP) & (cu < TOP + BMO) & (cw >= LEFT) & (cw < LEFT + BNO) & ok
    return cu, cw, ci, cj, ok, own, row0 + r0 + tl.arange(0, SR)


@triton.jit
def load_slab(plane_base, cu, cw, hh, H: tl.constexpr, ER: tl.constexpr, EC: tl.constexpr, MMA: tl.constexpr):
    """(cells, HP) slab of a scratch slot: cells at frame rows cu, columns cw, all heads."""
    return tl.load(
        plane_base + (hh[None, :] * ER + cu[:, None]) * EC + cw[:, None], mask=(hh < H)[None, :], other=0.0
    ).to(MMA)


@triton.jit
def store_slab(plane_base, cu, cw, hh, x, H: tl.constexpr, ER: tl.constexpr, EC: tl.constexpr, RNE: tl.constexpr):
    tl.store(
        plane_base + (hh[None, :] * ER + cu[:, None]) * EC + cw[:, None],
        to_scratch(x, plane_base.dtype.element_ty, RNE),
        mask=(hh < H)[None, :],
    )


@triton.jit
def row_stat(ptr, b, i_rows, hh, Tq, H: tl.constexpr, SR: tl.constexpr, EC: tl.constexpr):
    """A (B, H, Tq) per-row statistic (lse, D) broadcast to the slab's (SR*EC, HP) cells."""
    m = (hh[None, :] < H) & (i_rows[:, None] >= 0) & (i_rows[:, None] < Tq)
    x = tl.load((ptr + b.to(tl.int64) * H * Tq) + (hh[None, :] * Tq + i_rows[:, None]), mask=m, other=0.0)
    return tl.reshape(tl.broadcast_to(x[:, None, :], (SR, EC, x.shape[1])), (SR * EC, x.shape[1]))


@triton.jit
def add_row_sums(pd_ptr, slot, hh, r0, x, own, SR: tl.constexpr, EC: tl.constexpr, HP: tl.constexpr, ER: tl.constexpr):
    """The item's D partial (its slot, (HP, ER)) += the slab's row sums of x (cells, HP) over
    its owned cells."""
    dsum = tl.sum(tl.reshape(tl.where(own[:, None], x, 0.0), (SR, EC, HP)), 1)
    dptr = (pd_ptr + slot * HP * ER) + (hh[None, :] * ER + (r0 + tl.arange(0, SR))[:, None])
    tl.store(dptr, tl.load(dptr) + dsum)


@triton.jit
def mix(x, w, HAS: tl.constexpr, PREC: tl.constexpr, ACC: tl.constexpr):
    """x (cells, HP) @ w (HP, HP), or x itself when the mixing is off."""
    if HAS:
        return tl.dot(x, w, input_precision=PREC, out_dtype=ACC)
    else:
        return x.to(ACC)


@triton.jit
def mix_weight_grad(acc, g, x, own, HAS: tl.constexpr, MMA: tl.constexpr, PREC: tl.constexpr, ACC: tl.constexpr):
    """acc (HP, HP) += g_owned^T x over the slab's cells: a mixing weight's gradient."""
    if HAS:
        go = tl.where(own[:, None], g, 0.0).to(MMA)
        acc = tl.dot(tl.trans(go), x.to(MMA), acc, input_precision=PREC, out_dtype=ACC)
    return acc


@triton.jit
def mix_weights(wt_ptr, hh, H: tl.constexpr, HAS: tl.constexpr, MMA: tl.constexpr):
    """A (HP, HP) head mixing as right factors of (cells, heads) slabs: (W^T, W); x @ W^T
    mixes, x @ W is the adjoint. Zeros when the layer has none."""
    if HAS:
        wt = tl.load(
            wt_ptr + hh[:, None] * hh.shape[0] + hh[None, :], mask=(hh[:, None] < H) & (hh[None, :] < H), other=0.0
        ).to(MMA)
    else:
        wt = tl.zeros([hh.shape[0], hh.shape[0]], MMA)
    return wt, tl.trans(wt)
