"""The fused kernel of ``model.attn_impl=triton``: a layer without a pre-softmax key-query
convolution (the mixing layers, and layers with the post-softmax convolution only) in four
passes of one Triton kernel, forward and backward. (A kq-conv layer runs ``stored.py``.)

Computes exactly what ``attention_ops.explicit_attention_torch`` computes (the release's
order: scores -> pre-softmax head mixing -> causal softmax -> post-softmax key-query
convolution, no renormalisation -> post-softmax head mixing -> dropout -> .V, with
``key_valid`` padding and ``q_offset``), without keeping any (B, H, Tq, Tk) tensor: saved for
backward are q, k, v, the (B, H, Tq) lse and the weights. Every product runs on tensor cores
(bf16/fp16 operands, fp32 accumulation; tf32 for fp32 inputs), none per convolution tap.

*Tiles, all heads.* Head mixing couples every head of a (query, key) cell, so a program
computes a tile (a frame of ``ER`` x ``EC`` cells: ``tiles.py``) for all heads: per-head
products (scores, dO V^T, A V, dS K, dS^T Q, A^T dO) as 128-row ``tl.dot``, their results
handed to the mixings through a private scratch slot per stage ((HP, ER, EC), compute
dtype), each mixing one tensor-core product per slab of ``SR`` frame rows. O and dq are
added into per-item partials and dk/dv into whole-layer buffers by TMA reductions
(``jit_helpers.accumulate``). The post-softmax convolution and its adjoint are Toeplitz
products, one per row shift; only they widen frames (``tiles.halo``).

*Passes.* ``stats`` (each row's max and sum, merged over key splits into the lse),
``forward`` (exact probabilities ``exp(Z - lse)``, post-softmax transforms, .V),
``backward_rowsum`` (D = rowsum(P * dP), which the post-softmax conv keeps from being
rowsum(dO * O)) and ``backward`` (dA -> dR -> dP -> dZ -> dC = dS; dq, dk, dv, the mixings'
and the post kernel's gradients).

*Dropout* on the post-mixing probabilities draws its mask with ``tl.rand`` from a seed taken
from torch's generator (saved for backward) and the int64 cell index: the same masks in
forward and backward, not the masks ``F.dropout`` would draw.

design.md has the rest of the design (inputs through tensor descriptors and their zero
margin, work and determinism, masking, launch configuration) and what the sm_90 compile
estimates it at. Exact under ``TRITON_INTERPRET=1`` (tests/experimental/); no GPU has run it.
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
    allowed_cells,
    conv_and_weight_grad,
    frame_products,
    grad_pair,
    load_slab,
    load_tile,
    mix,
    mix_weight_grad,
    mix_weights,
    qk_scores,
    row_stat,
    slab_cells,
    store_slab,
    to_scratch,
    toeplitz_conv,
)
from mta_repro.kernels.interface import AttnMask, ExplicitAttnParams, post_mix_matrix

_STATS, _FWD, _ROWSUM, _BWD = (tl.constexpr(i) for i in range(4))


@triton.jit
def _logits(
    scr_c,
    cu,
    cw,
    hh,
    w1t,
    H: tl.constexpr,
    ER: tl.constexpr,
    EC: tl.constexpr,
    HAS_W1: tl.constexpr,
    MMA: tl.constexpr,
    PREC: tl.constexpr,
    ACC: tl.constexpr,
):
    """The logits z of a slab: its (cells, HP) scores C from the scratch slot (written by
    ``qk_scores`` in the first phase) and their pre-softmax head mixing. Returns (C, z). The
    one code path every pass computes z through: the statistics' row max and sum and the
    later passes' exp(z - lse) see the same bits (tests/experimental/test_kernel_hazards.py)."""
    xc = load_slab(scr_c, cu, cw, hh, H, ER, EC, MMA)
    return xc, mix(xc, w1t, HAS_W1, PREC, ACC)


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


# ----------------------------------------------------------------------------- the kernel
# Lengths, offsets, counts and the seed change with every batch shape: not specialised, so
# a new B or T reuses the compiled kernel (H and d stay specialised: fixed per model).
@triton.jit(do_not_specialize=["Tq", "Tk", "q_off", "seed"])
def _mta_kernel(
    qd,
    kd,
    vd,
    dod,
    kv_ptr,
    w1t_ptr,
    w2t_ptr,
    tf2d,
    ta2d,
    lse_ptr,
    dd_ptr,
    tiles_ptr,
    starts_ptr,
    pm_ptr,
    pl_ptr,
    pod,
    pd_ptr,
    pdqd,
    dkd,
    dvd,
    pw1_ptr,
    pw2_ptr,
    pt2_ptr,
    scr_ptr,
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
    S_P: tl.constexpr,
    S_DR: tl.constexpr,
    S_DP: tl.constexpr,
    S_R: tl.constexpr,
    S_DC: tl.constexpr,
    S_A: tl.constexpr,
):
    pid = tl.program_id(0)
    hh = tl.arange(0, HP)
    u = tl.arange(0, ER)
    w = tl.arange(0, EC)
    PLANE: tl.constexpr = ER * EC
    SLOT: tl.constexpr = HP * PLANE
    scr = scr_ptr + pid.to(tl.int64) * (NSLOT * SLOT)
    R2: tl.constexpr = CK2 - 1 - PL2
    # every convolution reads the frame's own columns (``toeplitz_conv``): its margins must hold
    # the key taps of each cell whose result is used (``tiles.halo`` makes them so)
    RIGHT: tl.constexpr = EC - LEFT - BNO
    if HAS_K2 and (MODE == _FWD or MODE == _BWD):
        tl.static_assert((LEFT >= PL2) & (RIGHT >= R2), "the frame's margins must hold the post kernel's taps")
    if HAS_K2 and MODE == _ROWSUM:
        tl.static_assert((LEFT >= R2) & (RIGHT >= PL2), "the frame's margins must hold the post adjoint's taps")
    if HAS_K2 and MODE == _BWD:
        tl.static_assert((LEFT >= R2) & (RIGHT >= PL2), "the frame's margins must hold dP's taps")
    own_u = (u >= TOP) & (u < TOP + BMO)
    own_w = (w >= LEFT) & (w < LEFT + BNO)
    # the (HP, HP) mixings as right factors of (cells, heads) slabs: x @ W^T mixes, x @ W is the adjoint
    w1t, w1 = mix_weights(w1t_ptr, hh, H, HAS_W1, MMA)
    w2t, w2 = mix_weights(w2t_ptr, hh, H, HAS_W2, MMA)

    # this program's tiles, one loop (tiles.TileSchedule.tiles: batch, row block, key block, its
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
            cst = qk_scores(qd, kd, bh, row0, col0, scale, ER, EC, GP, DPAD, MMA, ACC, PREC, MARGIN)
            tl.store(pc, to_scratch(cst, scr_ptr.dtype.element_ty, RNE))
            if MODE == _ROWSUM or MODE == _BWD:
                da = frame_products(dod, vd, bh, row0, col0, ER, EC, GP, DPAD, MMA, ACC, PREC, MARGIN)
                tl.store(
                    scr + S_DA * SLOT + h * PLANE + u[:, None] * EC + w[None, :],
                    to_scratch(da, scr_ptr.dtype.element_ty, RNE),
                )
        tl.debug_barrier()

        # ---- M1: slabs of all heads: mixing, softmax, (no post conv: the rest of the chain)
        for r0 in tl.range(0, ER, SR, num_stages=1):
            cu, cw, ci, cj, ok, own, i_rows = slab_cells(
                r0, row0, col0, b, kv_ptr, Tq, Tk, q_off, HAS_KV, ER, EC, TOP, LEFT, BMO, BNO, SR
            )
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
                lse = row_stat(lse_ptr, b, i_rows, hh, Tq, H, SR, EC)
                okh = ok[:, None] & (hh < H)[None, :]
                p = tl.where(okh, tl.exp(tl.minimum(z - lse, 0.0)), 0.0)
                keep = _keep(seed, b, ci, cj, hh, Tq, Tk, p_drop, H, DROP)
                if MODE == _FWD:
                    if HAS_K2:
                        store_slab(scr + S_P * SLOT, cu, cw, hh, p, H, ER, EC, RNE)
                    else:
                        a = _drop(mix(p.to(MMA), w2t, HAS_W2, PREC, ACC), keep, p_drop, DROP)
                        store_slab(scr + S_A * SLOT, cu, cw, hh, a, H, ER, EC, RNE)
                else:
                    da = _drop(load_slab(scr + S_DA * SLOT, cu, cw, hh, H, ER, EC, ACC), keep, p_drop, DROP)
                    # masked before the mixing, not after: the same values (a cell's mix is of its
                    # own heads; padded heads' weights are 0), and a select of the product's
                    # accumulator made ptxas serialise every wgmma of the kq-conv passes (C7514)
                    dr = mix(tl.where(okh, da, 0.0).to(MMA), w2, HAS_W2, PREC, ACC)
                    if HAS_K2:
                        store_slab(scr + S_P * SLOT, cu, cw, hh, p, H, ER, EC, RNE)
                        store_slab(scr + S_DR * SLOT, cu, cw, hh, dr, H, ER, EC, RNE)
                    elif MODE == _ROWSUM:
                        add_row_sums(pd_ptr, slot, hh, r0, p * dr, own, SR, EC, HP, ER)
                    else:
                        dd = row_stat(dd_ptr, b, i_rows, hh, Tq, H, SR, EC)
                        dz = p * (dr - dd)
                        store_slab(
                            scr + S_DC * SLOT, cu, cw, hh, mix(dz.to(MMA), w1, HAS_W1, PREC, ACC), H, ER, EC, RNE
                        )
                        a = _drop(mix(p.to(MMA), w2t, HAS_W2, PREC, ACC), keep, p_drop, DROP)
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
                if MODE == _BWD:  # R and the post kernel's gradient read the same shifted P planes
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
                if MODE == _FWD or MODE == _BWD:
                    tl.store(
                        scr + S_R * SLOT + h * PLANE + pp,
                        to_scratch(tl.where(ok, rr, 0.0), scr_ptr.dtype.element_ty, RNE),
                    )
                if MODE == _ROWSUM or MODE == _BWD:
                    dp = toeplitz_conv(
                        scr + S_DR * SLOT + h * PLANE, ta2d, h * CQ2 * EC, CQ2, True, ER, EC, MMA, ACC, PREC
                    )
                    tl.store(scr + S_DP * SLOT + h * PLANE + pp, to_scratch(dp, scr_ptr.dtype.element_ty, RNE))
            tl.debug_barrier()
            # ---- M2: slabs again: the post-softmax mixing / the softmax backward
            for r0 in tl.range(0, ER, SR, num_stages=1):
                cu, cw, ci, cj, ok, own, i_rows = slab_cells(
                    r0, row0, col0, b, kv_ptr, Tq, Tk, q_off, HAS_KV, ER, EC, TOP, LEFT, BMO, BNO, SR
                )
                keep = _keep(seed, b, ci, cj, hh, Tq, Tk, p_drop, H, DROP)
                if MODE == _FWD:
                    rr = load_slab(scr + S_R * SLOT, cu, cw, hh, H, ER, EC, MMA)
                    a = _drop(mix(rr, w2t, HAS_W2, PREC, ACC), keep, p_drop, DROP)
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
                    store_slab(scr + S_DC * SLOT, cu, cw, hh, mix(dz.to(MMA), w1, HAS_W1, PREC, ACC), H, ER, EC, RNE)
                    rr = load_slab(scr + S_R * SLOT, cu, cw, hh, H, ER, EC, MMA)
                    a = _drop(mix(rr, w2t, HAS_W2, PREC, ACC), keep, p_drop, DROP)
                    store_slab(scr + S_A * SLOT, cu, cw, hh, a, H, ER, EC, RNE)
                    da = _drop(load_slab(scr + S_DA * SLOT, cu, cw, hh, H, ER, EC, ACC), keep, p_drop, DROP)
                    dw1 = mix_weight_grad(
                        dw1, dz, load_slab(scr + S_C * SLOT, cu, cw, hh, H, ER, EC, MMA), own, HAS_W1, MMA, PREC, ACC
                    )
                    dw2 = mix_weight_grad(dw2, da, rr, own, HAS_W2, MMA, PREC, ACC)

        if MODE == _BWD:  # this tile's mixing gradients into the program's partials
            wptr = pid.to(tl.int64) * (HP * HP) + hh[:, None] * HP + hh[None, :]
            if HAS_W1:
                tl.store(pw1_ptr + wptr, tl.load(pw1_ptr + wptr) + dw1)
            if HAS_W2:
                tl.store(pw2_ptr + wptr, tl.load(pw2_ptr + wptr) + dw2)
        if MODE == _FWD or MODE == _BWD:
            tl.debug_barrier()
            # ---- H3: per-head products of the owned block: O; dq, dk, dv
            if MODE == _FWD:
                for h in tl.range(0, H, num_stages=2):
                    bh = b.to(tl.int64) * H + h
                    a = tl.load(scr + S_A * SLOT + h * PLANE + u[:, None] * EC + w[None, :]).to(MMA)
                    a = tl.where(own_w[None, :], a, 0.0).to(MMA)  # (rows it does not own: never read)
                    for e0 in tl.static_range(0, DPAD, GP):
                        oa = tl.dot(
                            a, load_tile(vd, bh, col0, e0, EC, GP, MMA, MARGIN), input_precision=PREC, out_dtype=ACC
                        )
                        accumulate(pod, (slot * H + h).to(tl.int32), 0, e0, oa, ER, GP, ACC)
            if MODE == _BWD:
                # the backward's products, one kind per head loop, so that no two kinds' operands
                # and results are live at once (registers): dq and dk from dS (= dC: no pre-softmax
                # kernel), dv from A. The product loops hold no inner loop, so they pipeline
                # (their TMA reductions overlap the next head; one completion wait per loop)
                # the owned, allowed cells of the tile: where dS and A are nonzero
                own2 = (
                    own_u[:, None]
                    & own_w[None, :]
                    & allowed_cells(i[:, None], j[None, :], b, kv_ptr, Tq, Tk, q_off, HAS_KV)
                )
                for h in tl.range(0, H, num_stages=2):
                    bh = b.to(tl.int64) * H + h
                    ds = tl.load(scr + S_DC * SLOT + h * PLANE + u[:, None] * EC + w[None, :]).to(ACC)
                    ds = tl.where(own2, ds * scale, 0.0).to(MMA)
                    for e0 in tl.static_range(0, DPAD, GP):
                        grad_pair(
                            ds,
                            kd,
                            qd,
                            pdqd,
                            dkd,
                            bh,
                            row0,
                            col0,
                            slot * H + h,
                            e0,
                            GP,
                            ER,
                            EC,
                            True,
                            MMA,
                            ACC,
                            PREC,
                            MARGIN,
                        )
                for h in tl.range(0, H, num_stages=2):
                    bh = b.to(tl.int64) * H + h
                    ac = tl.where(own2, tl.load(scr + S_A * SLOT + h * PLANE + u[:, None] * EC + w[None, :]), 0.0).to(
                        MMA
                    )
                    for e0 in tl.static_range(0, DPAD, GP):
                        grad_pair(
                            ac, dod, dod, pdqd, dvd, bh, row0, col0, 0, e0, GP, ER, EC, False, MMA, ACC, PREC, MARGIN
                        )


# ----------------------------------------------------------------------------- host side
# the constexprs of the fused kernel (launch.constexprs has both kernels')
_CONSTEXPRS = (
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
    "S_P",
    "S_DR",
    "S_DP",
    "S_R",
    "S_DC",
    "S_A",
)
_DESCRIPTORS = ("qd", "kd", "vd", "dod", "tf2d", "ta2d", "pod", "pdqd", "dkd", "dvd")


def kernel_of(pass_: str):
    """The jit function a pass launches (compile_report.py compiles it)."""
    return _mta_kernel


def kernel_constexprs(pass_: str, f: tiles.Frame, **kw) -> dict:
    """The constexprs of one pass's launch (``launch.constexprs``' arguments; no pre-softmax
    kernel): the one source for ``_launch`` and compile_report.py, which compiles exactly what
    runs."""
    consts = launch.constexprs(pass_, f, **kw)
    return {"MODE": tiles.FUSED_PASSES.index(pass_), **{k: consts[k] for k in _CONSTEXPRS}}


def descriptor_specs(pass_: str, consts: dict) -> dict:
    """{kernel argument: (input, block shape)} of the kernel's tensor descriptors."""
    return launch.descriptor_specs(consts, _DESCRIPTORS)


def _launch(pass_: str, pb: launch.Problem, bufs: dict, do: torch.Tensor | None = None):
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
        pre=None,
        post=pb.post,
        dtype=pb.q.dtype,
        margin=pb.margin,
    )
    scratch_spec = specs.pop("scratch")
    specs.pop("tiles")  # built below from the schedule
    for name, spec in specs.items():
        bufs[name] = launch.buffer(name, spec, pb.dev)
    if not sched.items:
        return f, sched
    consts = kernel_constexprs(
        pass_,
        f,
        h=pb.h,
        d=pb.d,
        pre=None,
        post=pb.post,
        pad_key=pb.pad_key,
        has_w1=pb.w1t is not None,
        has_w2=pb.w2t is not None,
        has_kv=pb.kv is not None,
        drop=pb.p_drop > 0.0,
        gpu=pb.gpu,
        dtype=pb.q.dtype,
        tuning=pb.tuning,
    )
    # unwritten cells are never read (each phase writes whole planes before the next reads)
    scratch = launch.buffer("scratch", scratch_spec, pb.dev)
    inputs = {
        "q": pb.qp,
        "k": pb.kp,
        "v": pb.vp,
        "do": None if do is None else pb.padded(do),
        "tf2": getattr(pb, "tf2", None),
        "ta2": getattr(pb, "ta2", None),
    }
    descs = launch.descriptors(descriptor_specs(pass_, consts), inputs, bufs, pb)
    tile_rows, starts = launch.schedule_tensors(sched, pb.dev)
    dm = pb.dummy

    def buf(name):
        return bufs.get(name, dm)

    num_warps, num_stages = tiles.launch_config(pass_, None, pb.post)
    try:
        _mta_kernel[(n_prog,)](
            descs["qd"],
            descs["kd"],
            descs["vd"],
            descs["dod"],
            pb.kv if pb.kv is not None else dm,
            pb.w1t if pb.w1t is not None else dm,
            pb.w2t if pb.w2t is not None else dm,
            descs["tf2d"],
            descs["ta2d"],
            buf("lse"),
            buf("dd"),
            tile_rows,
            starts,
            buf("pm"),
            buf("pl"),
            descs["pod"],
            buf("pd"),
            descs["pdqd"],
            descs["dkd"],
            descs["dvd"],
            buf("pw1"),
            buf("pw2"),
            buf("pt2"),
            scratch,
            pb.tq,
            pb.tk,
            pb.q_off,
            pb.scale,
            pb.p_drop,
            pb.seed,
            **consts,
            num_warps=num_warps,
            num_stages=num_stages,
        )
    except triton.runtime.errors.OutOfResources as e:
        raise launch.out_of_resources(e, pass_, f, pb) from e
    return f, sched


class _MTAFused(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, w1, k2, w2, key_valid, q_off, pad_key, p_drop, tuning):
        kv = None if key_valid is None else key_valid.to(torch.int8).contiguous()
        seed = int(torch.randint(0, 2**31 - 1, ())) if p_drop > 0.0 else 0
        pb = launch.Problem(q, k, v, kv, None, w1, k2, w2, pad_key, q_off, p_drop, seed, tuning)
        bufs: dict = {}
        f, sched = _launch("stats", pb, bufs)
        fb = {"lse": launch.lse(bufs, f, sched, pb)}
        f, sched = _launch("forward", pb, fb)
        out = launch.per_row(fb["po"][..., : pb.d], f, sched, pb)
        ctx.save_for_backward(q, k, v, fb["lse"], kv, w1, k2, w2)
        ctx.args = (pad_key, q_off, p_drop, seed, tuning)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, do):
        q, k, v, lse, kv, w1, k2, w2 = ctx.saved_tensors
        pad_key, q_off, p_drop, seed, tuning = ctx.args
        do = do.contiguous()
        pb = launch.Problem(q, k, v, kv, None, w1, k2, w2, pad_key, q_off, p_drop, seed, tuning)
        bufs = {"lse": lse}
        f, sched = _launch("backward_rowsum", pb, bufs, do)
        bufs["dd"] = launch.per_row(bufs["pd"], f, sched, pb)[:, : pb.h].contiguous()
        f, sched = _launch("backward", pb, bufs, do)
        dq = launch.per_row(bufs["pdq"][..., : pb.d], f, sched, pb)
        dk, dv = bufs["dk"][..., pb.margin :, : pb.d], bufs["dv"][..., pb.margin :, : pb.d]  # after the zero margin
        if kv is not None:
            dq = dq * kv[:, q_off : q_off + pb.tq].to(dq.dtype)[:, None, :, None]
            dk = dk * kv.to(dk.dtype)[:, None, :, None]
        h = pb.h
        g1 = bufs["pw1"].sum(0)[:h, :h] if w1 is not None else None
        g2 = bufs["pw2"].sum(0)[:h, :h] if w2 is not None else None
        t2 = bufs["pt2"].sum(0)[:h] if k2 is not None else None
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), g1, t2, g2, None, None, None, None, None


def explicit_attention_fused(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: ExplicitAttnParams, mask: AttnMask, training: bool = False
) -> torch.Tensor:
    """``explicit_attention_torch`` in the fused kernel, for a layer without a pre-softmax
    kernel (a kq-conv layer runs ``stored.explicit_attention_stored``); shapes as there."""
    if p.mta_kernel is not None:
        raise ValueError("fused_triton.fused: a layer without a pre-softmax kernel only (kq-conv layers: stored.py)")
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32

    def cast(t):
        return None if t is None else t.to(acc).contiguous()

    return _MTAFused.apply(
        q,
        k,
        v,
        cast(p.wpsm),
        cast(None if p.mta_kernel_after_sm is None else p.mta_kernel_after_sm[:, 0]),
        cast(post_mix_matrix(p)),
        mask.key_valid,
        mask.q_offset,
        p.pad_key,
        p.dropout if training else 0.0,
        p.tuning,
    )
