"""The stored-scores kernels of ``model.attn_impl=triton``: a kq-conv layer (a pre-softmax
key-query convolution) in five launches, with its convolved scores C and their gradient dC
stored. (Every other layer runs ``fused.py``.)

The statistics pass computes C once, as S0 = q k^T followed by the convolution as banded
Toeplitz products (a halo of c_q - 1 rows above and the key taps beside the owned block), and
writes it into a store; the forward and both backward kernels read it. The backward is split
at a stored dC:

- kernel A, ``backward_rowsum`` and ``backward_dc`` (the fused kernel's rowsum and backward
  passes reading C; the second writes dC = W1^T dZ into its store instead of computing dS,
  dq, dk and the pre kernel's gradient): softmax backward, post-softmax convolution, both
  head mixings, dv. Its frame carries only the post convolution's halo;
- kernel B, ``backward_b`` (``_kernel_b``): per head, dC's frame from the store, S0 = q k^T
  (one plain product), dS0 = conv1^T(dC) (banded Toeplitz products), dq and dk
  (FA-style products), the pre kernel's gradient (the transposed products' diagonals).
  No head mixing, so no all-heads scratch slots and no slabs: one plane per program.

The stores are packed rows of the causal cells (``tiles.store_rows``), in the inputs' dtype
(bf16 on a GPU: the release's bf16 path materialises C in bf16 too). Reads are masked by the
allowed cells, so nothing outside them is ever read; writes by the causal cells. Dropout is
not supported: a kq-conv layer with training dropout runs ``blocked`` (``impl.py``).
"""

from __future__ import annotations

# Triton's DSL is not typable: tl.range loops, constexpr arguments and kernel[grid](..., num_warps=...) launches
# pyright: reportGeneralTypeIssues=false, reportArgumentType=false, reportCallIssue=false
import torch
import triton
import triton.language as tl

from mta_repro.experimental.fused_triton import launch, tiles
from mta_repro.experimental.fused_triton.jit_helpers import (
    accumulate,
    add_row_sums,
    add_taps,
    allowed_cells,
    conv_and_weight_grad,
    frame_products,
    grad_pair,
    load_slab,
    load_tile,
    mix,
    mix_weight_grad,
    mix_weights,
    plane_rows,
    qk_scores,
    row_stat,
    slab_cells,
    store_slab,
    to_scratch,
    toeplitz_conv,
)
from mta_repro.kernels.interface import AttnMask, ExplicitAttnParams, post_mix_matrix

_STATS, _FWD, _ROWSUM, _DC = (tl.constexpr(i) for i in range(4))


@triton.jit
def _store_frame_ptrs(st_ptr, rowoff_ptr, bh, i, j, Tq, Tk, q_off, plane_sz):
    """Pointers of frame cells (i (R,), j (C,)) in a packed store and which are stored (causal)."""
    iv = (i >= 0) & (i < Tq)
    ro = tl.load(rowoff_ptr + i, mask=iv, other=0)
    ok = iv[:, None] & (j[None, :] >= 0) & (j[None, :] < Tk) & (j[None, :] <= i[:, None] + q_off)
    return st_ptr + bh * plane_sz + ro[:, None] + j[None, :], ok


@triton.jit
def _store_slab_ptrs(st_ptr, rowoff_ptr, b, ci, cj, hh, Tq, Tk, q_off, plane_sz, H: tl.constexpr):
    """Pointers of a slab's (cells, HP) values in a packed store and which are stored."""
    iv = (ci >= 0) & (ci < Tq)
    ro = tl.load(rowoff_ptr + ci, mask=iv, other=0)
    ok = iv & (cj >= 0) & (cj < Tk) & (cj <= ci + q_off)
    bh = b.to(tl.int64) * H + hh
    return st_ptr + bh[None, :] * plane_sz + (ro + cj)[:, None], ok[:, None] & (hh < H)[None, :]


@triton.jit(do_not_specialize=["Tq", "Tk", "q_off", "seed", "plane_sz"])
def _stored_kernel(
    qd,
    kd,
    vd,
    dod,
    kv_ptr,
    w1t_ptr,
    w2t_ptr,
    tf2d,
    ta2d,
    tf1d,
    lse_ptr,
    dd_ptr,
    tiles_ptr,
    starts_ptr,
    pm_ptr,
    pl_ptr,
    pod,
    pd_ptr,
    dvd,
    pw1_ptr,
    pw2_ptr,
    pt2_ptr,
    scr_ptr,
    cst_ptr,
    dcs_ptr,
    rowoff_ptr,
    plane_sz,
    Tq,
    Tk,
    q_off,
    scale,
    p_drop,
    seed,
    MODE: tl.constexpr,
    H: tl.constexpr,
    HP: tl.constexpr,
    DPAD: tl.constexpr,
    ER: tl.constexpr,
    EC: tl.constexpr,
    TOP: tl.constexpr,
    LEFT: tl.constexpr,
    BMO: tl.constexpr,
    BNO: tl.constexpr,
    SR: tl.constexpr,
    CQ1: tl.constexpr,
    CK1: tl.constexpr,
    CKP1: tl.constexpr,
    PL1: tl.constexpr,
    HAS_W1: tl.constexpr,
    HAS_K2: tl.constexpr,
    CQ2: tl.constexpr,
    CK2: tl.constexpr,
    CKP2: tl.constexpr,
    PL2: tl.constexpr,
    HAS_W2: tl.constexpr,
    HAS_KV: tl.constexpr,
    DROP: tl.constexpr,
    MMA: tl.constexpr,
    ACC: tl.constexpr,
    PREC: tl.constexpr,
    RNE: tl.constexpr,
    GP: tl.constexpr,
    NSLOT: tl.constexpr,
    MARGIN: tl.constexpr,
    S_C: tl.constexpr,
    S_DA: tl.constexpr,
    S_S0: tl.constexpr,
    S_P: tl.constexpr,
    S_DR: tl.constexpr,
    S_DP: tl.constexpr,
    S_R: tl.constexpr,
    S_DC: tl.constexpr,
    S_A: tl.constexpr,
):
    """The passes of kernel A (the fused kernel's, ``fused._mta_kernel``, with C from / dC into
    the stores): MODE 0 stats (C computed and stored), 1 forward, 2 rowsum, 3 backward_dc."""
    pid = tl.program_id(0)
    hh = tl.arange(0, HP)
    u = tl.arange(0, ER)
    w = tl.arange(0, EC)
    PLANE: tl.constexpr = ER * EC
    SLOT: tl.constexpr = HP * PLANE
    scr = scr_ptr + pid.to(tl.int64) * (NSLOT * SLOT)
    R1: tl.constexpr = CK1 - 1 - PL1
    R2: tl.constexpr = CK2 - 1 - PL2
    RIGHT: tl.constexpr = EC - LEFT - BNO
    if MODE == _STATS:
        tl.static_assert(
            (LEFT >= PL1) & (RIGHT >= R1) & (TOP >= CQ1 - 1), "the frame's margins must hold the pre kernel's taps"
        )
    if HAS_K2 and (MODE == _FWD or MODE == _DC):
        tl.static_assert((LEFT >= PL2) & (RIGHT >= R2), "the frame's margins must hold the post kernel's taps")
    if HAS_K2 and (MODE == _ROWSUM or MODE == _DC):
        tl.static_assert((LEFT >= R2) & (RIGHT >= PL2), "the frame's margins must hold the post adjoint's taps")
    own_u = (u >= TOP) & (u < TOP + BMO)
    own_w = (w >= LEFT) & (w < LEFT + BNO)
    w1t, w1 = mix_weights(w1t_ptr, hh, H, HAS_W1, MMA)
    w2t, w2 = mix_weights(w2t_ptr, hh, H, HAS_W2, MMA)

    for it in tl.range(tl.load(starts_ptr + pid), tl.load(starts_ptr + pid + 1), num_stages=1):
        b = tl.load(tiles_ptr + it * 4)
        t = tl.load(tiles_ptr + it * 4 + 1)
        c = tl.load(tiles_ptr + it * 4 + 2)
        slot = tl.load(tiles_ptr + it * 4 + 3).to(tl.int64)
        row0 = t * BMO - TOP
        i = row0 + u
        col0 = c * BNO - LEFT
        j = col0 + w
        tl.debug_barrier()
        dw1 = tl.zeros([HP, HP], ACC)
        dw2 = tl.zeros([HP, HP], ACC)

        if MODE == _STATS:
            # ---- H0: S0 = q k^T * scale per head on the frame, zero off the allowed cells (mask, then conv)
            ok0 = allowed_cells(i[:, None], j[None, :], b, kv_ptr, Tq, Tk, q_off, HAS_KV)
            for h in tl.range(0, H, num_stages=1):
                bh = b.to(tl.int64) * H + h
                s0 = qk_scores(qd, kd, bh, row0, col0, scale, ER, EC, GP, DPAD, MMA, ACC, PREC, MARGIN)
                tl.store(
                    scr + S_S0 * SLOT + h * PLANE + u[:, None] * EC + w[None, :],
                    to_scratch(tl.where(ok0, s0, 0.0), scr_ptr.dtype.element_ty, RNE),
                )
            tl.debug_barrier()
        # ---- H1: C per head (stats: conv1(S0), banded Toeplitz products; the rest: read back) -> slot C
        for h in tl.range(0, H, num_stages=1):
            bh = b.to(tl.int64) * H + h
            pc = scr + S_C * SLOT + h * PLANE + u[:, None] * EC + w[None, :]
            if MODE == _STATS:  # (stored from the slabs below, owned cells only)
                cst = toeplitz_conv(
                    scr + S_S0 * SLOT + h * PLANE, tf1d, h * CQ1 * EC, CQ1, False, ER, EC, MMA, ACC, PREC
                )
            else:
                sp, sok = _store_frame_ptrs(cst_ptr, rowoff_ptr, bh, i, j, Tq, Tk, q_off, plane_sz)
                cst = tl.load(sp, mask=sok, other=0.0)
            tl.store(pc, to_scratch(cst, scr_ptr.dtype.element_ty, RNE))
            if MODE == _ROWSUM or MODE == _DC:
                da = frame_products(dod, vd, bh, row0, col0, ER, EC, GP, DPAD, MMA, ACC, PREC, MARGIN)
                tl.store(
                    scr + S_DA * SLOT + h * PLANE + u[:, None] * EC + w[None, :],
                    to_scratch(da, scr_ptr.dtype.element_ty, RNE),
                )
        tl.debug_barrier()

        # ---- M1: slabs of all heads: mixing, softmax
        for r0 in tl.range(0, ER, SR, num_stages=1):
            cu, cw, ci, cj, ok, own, i_rows = slab_cells(
                r0, row0, col0, b, kv_ptr, Tq, Tk, q_off, HAS_KV, ER, EC, TOP, LEFT, BMO, BNO, SR
            )
            xc = load_slab(scr + S_C * SLOT, cu, cw, hh, H, ER, EC, MMA)
            z = mix(xc, w1t, HAS_W1, PREC, ACC)
            if MODE == _STATS:
                # C into its store, as the slot holds it (rounded to the store's dtype once)
                # every causal cell of the owned block, padding included (the passes that read C
                # mask by the causal cells only: no cell they read is left unwritten)
                own_blk = (cu >= TOP) & (cu < TOP + BMO) & (cw >= LEFT) & (cw < LEFT + BNO)
                sp, sok = _store_slab_ptrs(cst_ptr, rowoff_ptr, b, ci, cj, hh, Tq, Tk, q_off, plane_sz, H)
                tl.store(sp, xc.to(cst_ptr.dtype.element_ty), mask=sok & own_blk[:, None])
                zm = tl.where(own[:, None], z, float("-inf"))  # the owned cells' statistics
                z3 = tl.reshape(zm, (SR, EC, HP))
                tmax = tl.max(z3, 1)
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
                lse = row_stat(lse_ptr, b, i_rows, hh, Tq, H, SR, EC)
                okh = ok[:, None] & (hh < H)[None, :]
                p = tl.where(okh, tl.exp(tl.minimum(z - lse, 0.0)), 0.0)
                if MODE == _FWD:
                    if HAS_K2:
                        store_slab(scr + S_P * SLOT, cu, cw, hh, p, H, ER, EC, RNE)
                    else:
                        a = mix(p.to(MMA), w2t, HAS_W2, PREC, ACC)
                        store_slab(scr + S_A * SLOT, cu, cw, hh, a, H, ER, EC, RNE)
                else:
                    da = load_slab(scr + S_DA * SLOT, cu, cw, hh, H, ER, EC, ACC)
                    dr = mix(tl.where(okh, da, 0.0).to(MMA), w2, HAS_W2, PREC, ACC)
                    if HAS_K2:
                        store_slab(scr + S_P * SLOT, cu, cw, hh, p, H, ER, EC, RNE)
                        store_slab(scr + S_DR * SLOT, cu, cw, hh, dr, H, ER, EC, RNE)
                    elif MODE == _ROWSUM:
                        add_row_sums(pd_ptr, slot, hh, r0, p * dr, own, SR, EC, HP, ER)
                    else:
                        dd = row_stat(dd_ptr, b, i_rows, hh, Tq, H, SR, EC)
                        dz = p * (dr - dd)
                        dp_, dok = _store_slab_ptrs(dcs_ptr, rowoff_ptr, b, ci, cj, hh, Tq, Tk, q_off, plane_sz, H)
                        tl.store(
                            dp_,
                            to_scratch(mix(dz.to(MMA), w1, HAS_W1, PREC, ACC), dcs_ptr.dtype.element_ty, RNE),
                            mask=dok & own[:, None],
                        )
                        a = mix(p.to(MMA), w2t, HAS_W2, PREC, ACC)
                        store_slab(scr + S_A * SLOT, cu, cw, hh, a, H, ER, EC, RNE)
                        dw1 = mix_weight_grad(dw1, dz, xc, own, HAS_W1, MMA, PREC, ACC)
                        dw2 = mix_weight_grad(dw2, da, p, own, HAS_W2, MMA, PREC, ACC)

        if HAS_K2 and MODE != _STATS:
            tl.debug_barrier()
            # ---- H2: the post-softmax convolution / its adjoint / its kernel's gradient, per head
            for h in tl.range(0, H, num_stages=1):
                pp = u[:, None] * EC + w[None, :]
                ok = allowed_cells(i[:, None], j[None, :], b, kv_ptr, Tq, Tk, q_off, HAS_KV)
                if MODE == _FWD:
                    rr = toeplitz_conv(
                        scr + S_P * SLOT + h * PLANE, tf2d, h * CQ2 * EC, CQ2, False, ER, EC, MMA, ACC, PREC
                    )
                if MODE == _DC:
                    g = tl.where(own_u[:, None] & own_w[None, :], tl.load(scr + S_DR * SLOT + h * PLANE + pp), 0.0)
                    rr = conv_and_weight_grad(
                        scr + S_P * SLOT + h * PLANE,
                        tf2d,
                        h * CQ2 * EC,
                        g,
                        pt2_ptr + (pid.to(tl.int64) * HP + h) * (CQ2 * CK2),
                        PL2,
                        CQ2,
                        CK2,
                        CKP2,
                        ER,
                        EC,
                        MMA,
                        ACC,
                        PREC,
                    )
                if MODE == _FWD or MODE == _DC:
                    tl.store(
                        scr + S_R * SLOT + h * PLANE + pp,
                        to_scratch(tl.where(ok, rr, 0.0), scr_ptr.dtype.element_ty, RNE),
                    )
                if MODE == _ROWSUM or MODE == _DC:
                    dp = toeplitz_conv(
                        scr + S_DR * SLOT + h * PLANE, ta2d, h * CQ2 * EC, CQ2, True, ER, EC, MMA, ACC, PREC
                    )
                    tl.store(scr + S_DP * SLOT + h * PLANE + pp, to_scratch(dp, scr_ptr.dtype.element_ty, RNE))
            tl.debug_barrier()
            # ---- M2: slabs again: the post-softmax mixing / the softmax backward (dC stored)
            for r0 in tl.range(0, ER, SR, num_stages=1):
                cu, cw, ci, cj, ok, own, i_rows = slab_cells(
                    r0, row0, col0, b, kv_ptr, Tq, Tk, q_off, HAS_KV, ER, EC, TOP, LEFT, BMO, BNO, SR
                )
                if MODE == _FWD:
                    rr = load_slab(scr + S_R * SLOT, cu, cw, hh, H, ER, EC, MMA)
                    a = mix(rr, w2t, HAS_W2, PREC, ACC)
                    store_slab(scr + S_A * SLOT, cu, cw, hh, a, H, ER, EC, RNE)
                elif MODE == _ROWSUM:
                    p = load_slab(scr + S_P * SLOT, cu, cw, hh, H, ER, EC, ACC)
                    dp = load_slab(scr + S_DP * SLOT, cu, cw, hh, H, ER, EC, ACC)
                    add_row_sums(pd_ptr, slot, hh, r0, p * dp, own, SR, EC, HP, ER)
                else:
                    p = load_slab(scr + S_P * SLOT, cu, cw, hh, H, ER, EC, ACC)
                    dp = load_slab(scr + S_DP * SLOT, cu, cw, hh, H, ER, EC, ACC)
                    dd = row_stat(dd_ptr, b, i_rows, hh, Tq, H, SR, EC)
                    dz = p * (dp - dd)
                    dp_, dok = _store_slab_ptrs(dcs_ptr, rowoff_ptr, b, ci, cj, hh, Tq, Tk, q_off, plane_sz, H)
                    tl.store(
                        dp_,
                        to_scratch(mix(dz.to(MMA), w1, HAS_W1, PREC, ACC), dcs_ptr.dtype.element_ty, RNE),
                        mask=dok & own[:, None],
                    )
                    rr = load_slab(scr + S_R * SLOT, cu, cw, hh, H, ER, EC, MMA)
                    a = mix(rr, w2t, HAS_W2, PREC, ACC)
                    store_slab(scr + S_A * SLOT, cu, cw, hh, a, H, ER, EC, RNE)
                    da = load_slab(scr + S_DA * SLOT, cu, cw, hh, H, ER, EC, ACC)
                    dw1 = mix_weight_grad(
                        dw1, dz, load_slab(scr + S_C * SLOT, cu, cw, hh, H, ER, EC, MMA), own, HAS_W1, MMA, PREC, ACC
                    )
                    dw2 = mix_weight_grad(dw2, da, rr, own, HAS_W2, MMA, PREC, ACC)

        if MODE == _DC:
            wptr = pid.to(tl.int64) * (HP * HP) + hh[:, None] * HP + hh[None, :]
            if HAS_W1:
                tl.store(pw1_ptr + wptr, tl.load(pw1_ptr + wptr) + dw1)
            if HAS_W2:
                tl.store(pw2_ptr + wptr, tl.load(pw2_ptr + wptr) + dw2)
        if MODE == _FWD or MODE == _DC:
            tl.debug_barrier()
            own2 = (
                own_u[:, None]
                & own_w[None, :]
                & allowed_cells(i[:, None], j[None, :], b, kv_ptr, Tq, Tk, q_off, HAS_KV)
            )
            # ---- H3: per-head products of the owned block: O (forward), dv (backward_dc)
            for h in tl.range(0, H, num_stages=2):
                bh = b.to(tl.int64) * H + h
                a = tl.load(scr + S_A * SLOT + h * PLANE + u[:, None] * EC + w[None, :])
                if MODE == _FWD:
                    a = tl.where(own_w[None, :], a, 0.0).to(MMA)
                    for e0 in tl.static_range(0, DPAD, GP):
                        oa = tl.dot(
                            a, load_tile(vd, bh, col0, e0, EC, GP, MMA, MARGIN), input_precision=PREC, out_dtype=ACC
                        )
                        accumulate(pod, (slot * H + h).to(tl.int32), 0, e0, oa, ER, GP, ACC)
                else:
                    ac = tl.where(own2, a, 0.0).to(MMA)
                    for e0 in tl.static_range(0, DPAD, GP):
                        grad_pair(
                            ac, dod, dod, pod, dvd, bh, row0, col0, 0, e0, GP, ER, EC, False, MMA, ACC, PREC, MARGIN
                        )


@triton.jit(do_not_specialize=["Tq", "Tk", "q_off", "plane_sz"])
def _kernel_b(
    qd,
    kd,
    kv_ptr,
    ta1d,
    tiles_ptr,
    starts_ptr,
    pdqd,
    dkd,
    pt1_ptr,
    scr_ptr,
    dcs_ptr,
    rowoff_ptr,
    plane_sz,
    Tq,
    Tk,
    q_off,
    scale,
    H: tl.constexpr,
    HP: tl.constexpr,
    DPAD: tl.constexpr,
    ER: tl.constexpr,
    EC: tl.constexpr,
    TOP: tl.constexpr,
    LEFT: tl.constexpr,
    BMO: tl.constexpr,
    BNO: tl.constexpr,
    CQ1: tl.constexpr,
    CK1: tl.constexpr,
    CKP1: tl.constexpr,
    PL1: tl.constexpr,
    HAS_KV: tl.constexpr,
    MMA: tl.constexpr,
    ACC: tl.constexpr,
    PREC: tl.constexpr,
    RNE: tl.constexpr,
    GP: tl.constexpr,
    MARGIN: tl.constexpr,
):
    """Backward kernel B: dC (its store) -> dq, dk and the pre kernel's gradient, head by head
    on frames whose margins hold dS0's taps (dC below and beside the owned block). Per head:
    dC's frame into the program's plane, S0 = q k^T * scale on the owned allowed cells,
    dS0 = conv1^T(dC) (one Toeplitz product per row shift), dq += dS0 k * scale,
    dk += dS0^T q * scale, and theta1's gradient sum S0[u, n] dC[u + rho, n - b + PL1] as the
    diagonals of (dC shifted by rho)^T S0 (tap c_k-1-b of row c_q-1-rho; the host flips)."""
    pid = tl.program_id(0)
    u = tl.arange(0, ER)
    w = tl.arange(0, EC)
    R1: tl.constexpr = CK1 - 1 - PL1
    RIGHT: tl.constexpr = EC - LEFT - BNO
    tl.static_assert(
        (LEFT >= R1) & (RIGHT >= PL1) & (ER - TOP - BMO >= CQ1 - 1),
        "the frame's margins must hold the pre adjoint's taps",
    )
    plane = scr_ptr + pid.to(tl.int64) * (ER * EC)
    own_u = (u >= TOP) & (u < TOP + BMO)
    own_w = (w >= LEFT) & (w < LEFT + BNO)
    for it in tl.range(tl.load(starts_ptr + pid), tl.load(starts_ptr + pid + 1), num_stages=1):
        b = tl.load(tiles_ptr + it * 4)
        t = tl.load(tiles_ptr + it * 4 + 1)
        c = tl.load(tiles_ptr + it * 4 + 2)
        slot = tl.load(tiles_ptr + it * 4 + 3).to(tl.int64)
        row0 = t * BMO - TOP
        i = row0 + u
        col0 = c * BNO - LEFT
        j = col0 + w
        ok = allowed_cells(i[:, None], j[None, :], b, kv_ptr, Tq, Tk, q_off, HAS_KV)
        own2 = own_u[:, None] & own_w[None, :] & ok
        for h in tl.range(0, H, num_stages=1):
            bh = b.to(tl.int64) * H + h
            sp, sok = _store_frame_ptrs(dcs_ptr, rowoff_ptr, bh, i, j, Tq, Tk, q_off, plane_sz)
            dc = tl.load(sp, mask=sok & ok, other=0.0)
            tl.debug_barrier()  # the previous head's readers of the plane are done
            tl.store(plane + u[:, None] * EC + w[None, :], to_scratch(dc, scr_ptr.dtype.element_ty, RNE))
            s0 = qk_scores(qd, kd, bh, row0, col0, scale, ER, EC, GP, DPAD, MMA, ACC, PREC, MARGIN)
            gm = tl.where(own2, s0, 0.0).to(MMA)
            tl.debug_barrier()
            ds = toeplitz_conv(plane, ta1d, h * CQ1 * EC, CQ1, True, ER, EC, MMA, ACC, PREC)
            ds = tl.where(own2, ds * scale, 0.0).to(MMA)
            part = pt1_ptr + (pid.to(tl.int64) * HP + h) * (CQ1 * CK1)
            for rho in tl.range(0, CQ1):
                add_taps(
                    plane_rows(plane, rho, ER, EC, MMA), gm, part + (CQ1 - 1 - rho) * CK1, -R1, CK1, CKP1, EC, ACC, PREC
                )
            for e0 in tl.static_range(0, DPAD, GP):
                grad_pair(
                    ds, kd, qd, pdqd, dkd, bh, row0, col0, slot * H + h, e0, GP, ER, EC, True, MMA, ACC, PREC, MARGIN
                )


# ----------------------------------------------------------------------------- host side
# kernel A's MODE per pass (the fused kernel's pass whose code it runs) and both kernels' constexprs
_MODE = {"stats": 0, "forward": 1, "backward_rowsum": 2, "backward_dc": 3}
_CONSTEXPRS_A = (
    "H",
    "HP",
    "DPAD",
    "ER",
    "EC",
    "TOP",
    "LEFT",
    "BMO",
    "BNO",
    "SR",
    "CQ1",
    "CK1",
    "CKP1",
    "PL1",
    "HAS_W1",
    "HAS_K2",
    "CQ2",
    "CK2",
    "CKP2",
    "PL2",
    "HAS_W2",
    "HAS_KV",
    "DROP",
    "MMA",
    "ACC",
    "PREC",
    "RNE",
    "GP",
    "NSLOT",
    "MARGIN",
    "S_C",
    "S_DA",
    "S_S0",
    "S_P",
    "S_DR",
    "S_DP",
    "S_R",
    "S_DC",
    "S_A",
)
_CONSTEXPRS_B = (
    "H",
    "HP",
    "DPAD",
    "ER",
    "EC",
    "TOP",
    "LEFT",
    "BMO",
    "BNO",
    "CQ1",
    "CK1",
    "CKP1",
    "PL1",
    "HAS_KV",
    "MMA",
    "ACC",
    "PREC",
    "RNE",
    "GP",
    "MARGIN",
)
_DESCRIPTORS_A = ("qd", "kd", "vd", "dod", "tf2d", "ta2d", "tf1d", "pod", "dvd")
_DESCRIPTORS_B = ("qd", "kd", "ta1d", "pdqd", "dkd")


def kernel_of(pass_: str):
    """The jit function a pass launches (compile_report.py compiles it)."""
    return _kernel_b if pass_ == "backward_b" else _stored_kernel


def kernel_constexprs(pass_: str, f: tiles.Frame, **kw) -> dict:
    """The constexprs of one stored pass's launch (``launch.constexprs``' arguments): the one
    source for ``_launch`` and compile_report.py."""
    consts = launch.constexprs(pass_, f, **kw)
    if pass_ == "backward_b":
        return {k: consts[k] for k in _CONSTEXPRS_B}
    return {"MODE": _MODE[pass_], **{k: consts[k] for k in _CONSTEXPRS_A}}


def descriptor_specs(pass_: str, consts: dict) -> dict:
    """{kernel argument: (input, block shape)} of a stored pass's descriptors (kernel A's also
    reads the pre kernel's forward Toeplitz table: stats computes C = conv1(S0))."""
    return launch.descriptor_specs(consts, _DESCRIPTORS_B if pass_ == "backward_b" else _DESCRIPTORS_A)


class _Stored:
    """One call's stores and problem (``launch.Problem``)."""

    def __init__(self, pb: launch.Problem):
        self.pb = pb
        rows = tiles.store_rows(pb.tq, pb.tk, pb.q_off)
        self.rowoff = torch.tensor(rows[:-1], dtype=torch.int64, device=pb.dev)
        self.plane_sz = rows[-1]
        self.cstore = self.dcstore = None  # allocated by the stats / backward_dc launches


def _launch(pass_: str, st: _Stored, bufs: dict, do: torch.Tensor | None = None):
    pb = st.pb
    f, sched, n_prog = pb.geometry(pass_)
    pb.toeplitz(f.ec)
    specs = tiles.pass_buffers(
        pass_,
        f,
        sched,
        n_prog,
        b=pb.b,
        h=pb.h,
        hp=pb.hp,
        tk=pb.tk,
        dpad=pb.dpad,
        pre=pb.pre,
        post=pb.post,
        dtype=pb.q.dtype,
        margin=pb.margin,
    )
    scratch_spec = specs.pop("scratch")
    specs.pop("tiles")
    for name, spec in specs.items():  # the one allocator (tests poison it with NaN)
        bufs[name] = launch.buffer(name, spec, pb.dev)
    if pass_ in ("stats", "backward_dc"):  # every causal cell is written before it is read
        name = "cstore" if pass_ == "stats" else "dcstore"
        spec = tiles.stored_planes(b=pb.b, h=pb.h, tq=pb.tq, tk=pb.tk, q_off=pb.q_off, dtype=pb.sdt)[name]
        setattr(st, name, launch.buffer(name, spec, pb.dev))
    if not sched.items:
        return f, sched
    consts = kernel_constexprs(
        pass_,
        f,
        h=pb.h,
        d=pb.d,
        pre=pb.pre,
        post=pb.post,
        pad_key=pb.pad_key,
        has_w1=pb.w1t is not None,
        has_w2=pb.w2t is not None,
        has_kv=pb.kv is not None,
        drop=False,
        gpu=pb.gpu,
        dtype=pb.q.dtype,
        tuning=pb.tuning,
    )
    scratch = launch.empty("scratch", (max(1, scratch_spec.shape[0]),), scratch_spec.dtype, pb.dev)
    assert pb.k1 is not None  # the stored design runs the kq-conv layers (a pre-softmax kernel)
    inputs = {
        "q": pb.qp,
        "k": pb.kp,
        "v": pb.vp,
        "do": None if do is None else pb.padded(do),
        "tf2": getattr(pb, "tf2", None),
        "ta2": getattr(pb, "ta2", None),
        "ta1": getattr(pb, "ta1", None),
        # the pre kernel's forward table (stats computes C = conv1(S0); the backward has no use for it)
        "tf1": pb.table(pb.k1, f.ec, False, pb.pl1) if pass_ == "stats" else None,
    }
    descs = launch.descriptors(descriptor_specs(pass_, consts), inputs, bufs, pb)
    tile_rows, starts = launch.schedule_tensors(sched, pb.dev)
    dm = pb.dummy

    def buf(name):
        return bufs.get(name, dm)

    num_warps, num_stages = tiles.launch_config(pass_, pb.pre, pb.post)
    dcs = st.dcstore if st.dcstore is not None else dm
    try:
        if pass_ == "backward_b":
            _kernel_b[(n_prog,)](
                descs["qd"],
                descs["kd"],
                pb.kv if pb.kv is not None else dm,
                descs["ta1d"],
                tile_rows,
                starts,
                descs["pdqd"],
                descs["dkd"],
                buf("pt1"),
                scratch,
                dcs,
                st.rowoff,
                st.plane_sz,
                pb.tq,
                pb.tk,
                pb.q_off,
                pb.scale,
                **consts,
                num_warps=num_warps,
                num_stages=num_stages,
            )
            return f, sched
        _stored_kernel[(n_prog,)](
            descs["qd"],
            descs["kd"],
            descs["vd"],
            descs["dod"],
            pb.kv if pb.kv is not None else dm,
            pb.w1t if pb.w1t is not None else dm,
            pb.w2t if pb.w2t is not None else dm,
            descs["tf2d"],
            descs["ta2d"],
            descs["tf1d"],
            buf("lse"),
            buf("dd"),
            tile_rows,
            starts,
            buf("pm"),
            buf("pl"),
            descs["pod"],
            buf("pd"),
            descs["dvd"],
            buf("pw1"),
            buf("pw2"),
            buf("pt2"),
            scratch,
            st.cstore if st.cstore is not None else dm,
            dcs,
            st.rowoff,
            st.plane_sz,
            pb.tq,
            pb.tk,
            pb.q_off,
            pb.scale,
            0.0,
            0,
            **consts,
            num_warps=num_warps,
            num_stages=num_stages,
        )
    except triton.runtime.errors.OutOfResources as e:
        raise launch.out_of_resources(e, pass_, f, pb) from e
    return f, sched


class _MTAStored(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, k1, w1, k2, w2, key_valid, q_off, pad_key, tuning):
        kv = None if key_valid is None else key_valid.to(torch.int8).contiguous()
        pb = launch.Problem(q, k, v, kv, k1, w1, k2, w2, pad_key, q_off, 0.0, 0, tuning)
        st = _Stored(pb)
        bufs: dict = {}
        f, sched = _launch("stats", st, bufs)
        fb = {"lse": launch.lse(bufs, f, sched, pb)}
        f, sched = _launch("forward", st, fb)
        out = launch.per_row(fb["po"][..., : pb.d], f, sched, pb)
        ctx.save_for_backward(q, k, v, fb["lse"], kv, k1, w1, k2, w2, st.cstore)  # C: saved for backward
        ctx.args = (pad_key, q_off, tuning)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, do):
        q, k, v, lse, kv, k1, w1, k2, w2, cstore = ctx.saved_tensors
        pad_key, q_off, tuning = ctx.args
        do = do.contiguous()
        pb = launch.Problem(q, k, v, kv, k1, w1, k2, w2, pad_key, q_off, 0.0, 0, tuning)
        st = _Stored(pb)
        st.cstore = cstore
        bufs = {"lse": lse}
        f, sched = _launch("backward_rowsum", st, bufs, do)
        bufs["dd"] = launch.per_row(bufs["pd"], f, sched, pb)[:, : pb.h].contiguous()
        _launch("backward_dc", st, bufs, do)
        bb: dict = {}
        f, sched = _launch("backward_b", st, bb)
        dq = launch.per_row(bb["pdq"][..., : pb.d], f, sched, pb)
        dk, dv = bb["dk"][..., pb.margin :, : pb.d], bufs["dv"][..., pb.margin :, : pb.d]  # after the zero margin
        if kv is not None:
            dq = dq * kv[:, q_off : q_off + pb.tq].to(dq.dtype)[:, None, :, None]
            dk = dk * kv.to(dk.dtype)[:, None, :, None]
        h = pb.h
        g1 = bufs["pw1"].sum(0)[:h, :h] if w1 is not None else None
        g2 = bufs["pw2"].sum(0)[:h, :h] if w2 is not None else None
        t1 = bb["pt1"].sum(0)[:h].flip(-1)
        t2 = bufs["pt2"].sum(0)[:h] if k2 is not None else None
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), t1, g1, t2, g2, None, None, None, None


def explicit_attention_stored(q, k, v, p: ExplicitAttnParams, mask: AttnMask, training: bool = False):
    """``explicit_attention_torch`` for a kq-conv layer through the stored-scores kernels
    (no dropout: ``p.dropout`` must be 0 or ``training`` off)."""
    if p.mta_kernel is None:
        raise ValueError("fused_triton.stored: a kq-conv layer (a pre-softmax kernel) only")
    if p.dropout > 0.0 and training:
        raise ValueError("fused_triton.stored: no dropout (the registry runs blocked for it)")
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32

    def cast(t):
        return None if t is None else t.to(acc).contiguous()

    return _MTAStored.apply(
        q,
        k,
        v,
        cast(p.mta_kernel[:, 0]),
        cast(p.wpsm),
        cast(None if p.mta_kernel_after_sm is None else p.mta_kernel_after_sm[:, 0]),
        cast(post_mix_matrix(p)),
        mask.key_valid,
        mask.q_offset,
        p.pad_key,
        p.tuning,
    )
