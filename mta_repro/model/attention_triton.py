"""``model.attn_impl=triton``: MTA's whole explicit score path in fused Triton kernels.

Computes exactly what ``attention_ops.explicit_attention_torch`` computes (the release's
order: pre-softmax key-query convolution -> pre-softmax head mixing -> causal softmax ->
post-softmax key-query convolution, no renormalisation -> post-softmax head mixing ->
dropout -> .V, with ``key_valid`` padding and ``q_offset``), forward and backward, without
writing any (B, H, Tq, Tk) tensor to global memory.

Design
------
*Frames.* A program takes (batch, block of ``BMO`` query rows) work items and walks the
key axis in blocks of ``BNO`` columns (causal skipping: only blocks that hold a key <= the
block's last row). For each (row block, key block) it computes on a *frame*: the owned
(BMO x BNO) block grown by the halo every convolution of that pass reads (TOP/BOT rows,
LEFT/RIGHT columns; ``model/frames.py``), rounded up to powers of two (ER x EC, Triton's
tile shapes). Only the owned block's values are used; the halo is recomputed by the
neighbouring program (the overlapping-tile scheme of Gusanidas' CUDA pre-softmax kernel).

*All heads, in chunks, through scratch.* Head mixing couples every head of a cell, so a
program computes all heads of its frame, ``HC`` heads at a time (per-head work: the QK^T,
A V, dO V^T, dq, dk, dv products as (HC, rows, d) tiles, the convolutions, softmax), and
hands the stages to each other through a private scratch slot per stage (HP x frame, in
global memory but touched by one program only: L1/L2 on a GPU). A mixing reads its slot
``SR`` frame rows at a time as an (HP, SR*EC) slab and multiplies it by the (HP x HP)
weight (``tl.dot`` from 16 heads, a broadcast sum below). ``_tiling``: on a GPU HC=1,
SR=4 (registers and shared memory: ``scripts/compile_triton.py``); the interpreter takes
whole tiles (fewest interpreted ops). ``MTA_TRITON_CHUNKS=HCxSR`` and
``MTA_TRITON_FRAME=ROWSxCOLS`` override them.

*Convolutions.* Triton cannot shift a register tile, so a convolution stores its input in
its slot and sums the c_q x c_k shifted reloads weighted by the per-head kernel entries;
the adjoint convolution (backward) reloads with the opposite shifts. Each slot has zero
margins as wide as the largest shift, so reloads that leave the frame read 0 without a
mask: values near the frame's edge are wrong, and the halos are sized so that no owned
value depends on them. On a GPU the grid is persistent (4 programs per SM), so the
scratch is bounded by the GPU, not by T.

*Softmax.* The post-softmax transforms mix rows of different heads and neighbouring rows
after normalisation, so one online pass does not suffice: pass 0 (``stats``) computes each
row's running max and sum over key blocks (the lse), pass 1 (``forward``) recomputes the
scores, forms exact probabilities ``exp(Z - lse)`` on the frame (halo rows included: every
row's lse is known after pass 0), and applies the post-softmax transforms and .V.

*Backward.* Pass 2 (``backward_rowsum``) computes ``D = rowsum(P * dP)`` (the softmax
backward's row term; unlike plain attention it is not ``rowsum(dO * O)``, since dP comes
through the post-softmax convolution's adjoint). Pass 3 (``backward``) recomputes the
forward chain from q, k, v and the lse, runs its adjoint on the frame (dA = dO V^T ->
mixing^T -> masked conv^T -> dP -> dZ = P (dP - D) -> mixing^T -> conv^T -> dS), and
accumulates: dq for the owned rows (each program owns its rows), dk and dv of the owned
key block (atomically: other row blocks add to the same keys), the kernels' gradients
(owned output gradient times the shifted input, reloaded from the slots) and the
mixings' gradients (slab products) per work item, summed by torch afterwards.
Accumulators (o, dq, the row statistics) live in fp32/fp64 buffers in global memory,
owned by one program each. Saved for backward: q, k, v, the (B, H, Tq) lse and the
weights; nothing quadratic.

*Masking.* Every masked value is selected (``tl.where``), never multiplied, so a fully
masked pad row gives exact zeros and no NaN; exp arguments are clamped at 0 (a true
probability is <= 1), so the frame's halo never overflows.

*Dropout* on the post-mixing probabilities draws its mask with ``tl.rand`` from a seed
taken from torch's generator (saved for backward): the same masks in forward and
backward, reproducible seeded runs; not the masks ``F.dropout`` would draw.

*Launch* (``frames.launch_config``, shared with ``scripts/compile_triton.py``): 8 warps,
1 stage, every loop ``num_stages=1`` (each hands data through scratch: a pipelined reload
would read stale cells); lengths, offsets and the seed are not specialised (a new batch
shape reuses the compiled kernel); element offsets are int64; dropout draws with the
int64 cell index ((b*H + h)*Tq + row)*Tk + col (no wrap at long T); dk/dv atomics are
relaxed.

Status: exact, verified under ``TRITON_INTERPRET=1`` (tests/test_attn_impls.py and
tests/test_attn_triton.py: every option against "torch", forward and every gradient,
bf16, chunked tiling, a whole debug training run). It compiles for sm_90 (H100/H200),
but its compiled code is slow: ``python scripts/compile_triton.py --json PATH`` counts
what it compiles to and ESTIMATES (roofline, ``model/roofline.py``; no GPU measured it)
a kq-conv layer at ~170x / ~160x FlashAttention-2's forward+backward at T=2048 / 4096 and
a mixing layer at ~100x / ~115x: per-tap scalar reloads from scratch, most products off
tensor cores, and one program walking every key block x 16 heads of its row block.
``docs/triton_kernel.md`` has the figures and the redesign's targets. GPU atomics make dk
and dv (not the rest) bitwise nondeterministic across runs.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Optional

import torch

import triton
import triton.language as tl

from mta_repro.errors import UserError
from mta_repro.model import frames

if TYPE_CHECKING:  # types only: attention_ops imports this module (lazily), not the reverse
    from mta_repro.model.attention_ops import AttnMask, ExplicitAttnParams

# Pass modes of the one kernel (they share every stage of the chain).
_STATS, _FWD, _BWD_D, _BWD = (tl.constexpr(i) for i in range(4))
# Scratch slots per program (each HP heads x the frame, with zero margins): S (raw scores),
# C (convolved), Z/A/dZ (mixing outputs in turn), P, R, dA/dC, dR.
_S, _C, _ZA, _P, _R, _DA, _DR = (tl.constexpr(i) for i in range(7))
_N_SLOTS = tl.constexpr(frames.N_SLOTS)


@triton.jit
def _load_tile(ptr, b, hc, idx, T, H, d, DP: tl.constexpr, UPCAST: tl.constexpr):
    """(HC, R, DP) tile of a contiguous (B, H, T, d) tensor: heads ``hc`` (HC,), positions
    ``idx`` (R,); zero outside [0, T), past H heads and past d. UPCAST: as fp32 (the
    interpreter's tl.dot gets 16-bit floats wrong; a GPU multiplies them natively)."""
    h = hc[:, None, None]
    r = idx[None, :, None]
    e = tl.arange(0, DP)[None, None, :]
    m = (h < H) & (r >= 0) & (r < T) & (e < d)
    # int64: B*H*T*d passes 2**31 for long eval batches (B >= 342 at 16 x 4096 x 96)
    x = tl.load(ptr + ((b.to(tl.int64) * H + h) * T + r) * d + e, mask=m, other=0.0)
    if UPCAST:
        x = x.to(tl.float32) if x.dtype.primitive_bitwidth < 32 else x
    return x


@triton.jit
def _put(ptrs, x):
    tl.debug_barrier()  # earlier readers of these cells are done
    tl.store(ptrs, x)
    tl.debug_barrier()  # every thread sees the whole tile


@triton.jit
def _mix(w, x, HP: tl.constexpr, R: tl.constexpr, EC: tl.constexpr, USE_DOT: tl.constexpr, PREC: tl.constexpr):
    """out[g] = sum_h w[g, h] x[h]: w (HP, HP), x (HP, R, EC)."""
    if USE_DOT:
        out = tl.dot(w, tl.reshape(x, [HP, R * EC]), input_precision=PREC, out_dtype=x.dtype)
        return tl.reshape(out, [HP, R, EC])
    else:  # tl.dot needs >= 16 rows on a GPU; small head counts broadcast instead
        return tl.sum(w[:, :, None, None] * x[None, :, :, :], axis=1)


@triton.jit
def _mix_slabs(src, dst, w, H, HP: tl.constexpr, ER: tl.constexpr, EC: tl.constexpr, SR: tl.constexpr,
               SC: tl.constexpr, MR: tl.constexpr, MC: tl.constexpr, USE_DOT: tl.constexpr, PREC: tl.constexpr):
    """Head mixing of a whole slot, SR frame rows at a time: dst[g] = sum_h w[g, h] src[h]."""
    h = tl.arange(0, HP)[:, None, None]
    cell = (h * (ER + 2 * MR) + MR + tl.arange(0, SR)[None, :, None]) * SC + MC + tl.arange(0, EC)[None, None, :]
    tl.debug_barrier()
    for r0 in tl.range(0, ER, SR, num_stages=1):
        x = tl.load(src + cell + r0 * SC)
        tl.store(dst + cell + r0 * SC, _mix(w, x, HP, SR, EC, USE_DOT, PREC))
    tl.debug_barrier()


@triton.jit
def _mix_grad_slabs(gsrc, xsrc, u_own0, own_c, H, HP: tl.constexpr, ER: tl.constexpr, EC: tl.constexpr,
                    SR: tl.constexpr, SC: tl.constexpr, MR: tl.constexpr, MC: tl.constexpr,
                    n_own_rows, USE_DOT: tl.constexpr, PREC: tl.constexpr):
    """d w[g, h] = sum over the owned cells of gout[g] x[h] (the gradient of a mixing weight);
    owned: frame rows [u_own0, u_own0 + n_own_rows), columns where ``own_c``."""
    hv = tl.arange(0, HP)
    h = hv[:, None, None]
    u = tl.arange(0, SR)
    cell = (h * (ER + 2 * MR) + MR + u[None, :, None]) * SC + MC + tl.arange(0, EC)[None, None, :]
    acc = tl.zeros([HP, HP], dtype=gsrc.dtype.element_ty)
    for r0 in tl.range(0, ER, SR, num_stages=1):
        rown = (r0 + u >= u_own0) & (r0 + u < u_own0 + n_own_rows)
        own = (hv < H)[:, None, None] & rown[None, :, None] & own_c[None, None, :]
        g = tl.where(own, tl.load(gsrc + cell + r0 * SC), 0.0)
        x = tl.load(xsrc + cell + r0 * SC)
        if USE_DOT:
            acc += tl.dot(tl.reshape(g, [HP, SR * EC]), tl.trans(tl.reshape(x, [HP, SR * EC])),
                          input_precision=PREC, out_dtype=acc.dtype)
        else:
            acc += tl.sum(tl.sum(g[:, None, :, :] * x[None, :, :, :], axis=3), axis=2)
    return acc


@triton.jit
def _conv(ptrs, x, kern, hmask, SC: tl.constexpr, CQ: tl.constexpr, CK: tl.constexpr, PL: tl.constexpr,
          ADJOINT: tl.constexpr):
    """Depthwise key-query convolution of the frame tile x (HC, ER, EC) through a scratch slot
    (``ptrs``: the slot's frame cells of these heads, rows SC apart, zero margins around).

    Forward: out[u, w] = sum_{a, b} kern[h, a, b] x[u + a - (CQ-1), w + b - PL] (queries look
    back only). Adjoint: out[u, w] = sum_{a, b} kern[h, a, b] x[u + (CQ-1) - a, w + PL - b].
    Reads that leave the frame land in the margins and read 0 (only the halo sees them)."""
    kbase = kern + tl.arange(0, hmask.shape[0])[:, None, None] * (CQ * CK)
    km = hmask[:, None, None]
    _put(ptrs, x)
    acc = tl.zeros(x.shape, dtype=x.dtype)
    for a in tl.static_range(CQ):
        for bb in tl.static_range(CK):
            if ADJOINT:
                shift = (CQ - 1 - a) * SC + (PL - bb)
            else:
                shift = (a - (CQ - 1)) * SC + (bb - PL)
            acc += tl.load(kbase + (a * CK + bb), mask=km, other=0.0) * tl.load(ptrs + shift)
    return acc


@triton.jit
def _conv_weight_grad(ptrs, gout, part, SC: tl.constexpr, CQ: tl.constexpr, CK: tl.constexpr, PL: tl.constexpr):
    """part[h, a, b] += sum_{u, w} gout[h, u, w] x[h, u + a - (CQ-1), w + b - PL], x the
    forward input still in the slot at ``ptrs``; gout is zero outside the owned block."""
    pbase = part + tl.arange(0, gout.shape[0]) * (CQ * CK)
    for a in tl.static_range(CQ):
        for bb in tl.static_range(CK):
            xs = tl.load(ptrs + ((a - (CQ - 1)) * SC + (bb - PL)))
            s = tl.sum(tl.sum(gout * xs, axis=2), axis=1)
            tl.store(pbase + (a * CK + bb), tl.load(pbase + (a * CK + bb)) + s)


# Lengths, offsets, counts and the seed change with every batch shape: not specialised, so
# a new B or T reuses the compiled kernel (H and d stay specialised: fixed per model).
@triton.jit(do_not_specialize=["Tq", "Tk", "q_off", "n_rt", "n_items", "seed"])
def _mta_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, dd_ptr, m_ptr, l_ptr, oacc_ptr, dqacc_ptr, dk_ptr, dv_ptr,
    kv_ptr, k1_ptr, w1_ptr, k2_ptr, w2_ptr, scr_ptr, pk1_ptr, pw1_ptr, pk2_ptr, pw2_ptr,
    Tq, Tk, q_off, H, d, n_rt, n_items, scale, p_drop, seed,
    MODE: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr, USE_DOT: tl.constexpr,
    HP: tl.constexpr, HC: tl.constexpr, SR: tl.constexpr, DP: tl.constexpr, ER: tl.constexpr, EC: tl.constexpr,
    TOP: tl.constexpr, LEFT: tl.constexpr, BMO: tl.constexpr, BNO: tl.constexpr,
    MR: tl.constexpr, MC: tl.constexpr,
    HAS_K1: tl.constexpr, CQ1: tl.constexpr, CK1: tl.constexpr, PL1: tl.constexpr,
    HAS_W1: tl.constexpr,
    HAS_K2: tl.constexpr, CQ2: tl.constexpr, CK2: tl.constexpr, PL2: tl.constexpr,
    HAS_W2: tl.constexpr, HAS_KV: tl.constexpr, DROP: tl.constexpr, UPCAST: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    hv = tl.arange(0, HP)
    hmask = hv < H
    hl = tl.arange(0, HC)  # a chunk's heads, relative to its first
    e = tl.arange(0, DP)
    u = tl.arange(0, ER)
    w = tl.arange(0, EC)
    # Scratch: _N_SLOTS slots of (HP, ER + 2 MR, SC = EC + 2 MC): the frame with zero margins
    # as wide as the largest shift, so shifted reloads need no masks.
    SC: tl.constexpr = EC + 2 * MC
    SLOTH: tl.constexpr = (ER + 2 * MR) * SC
    SLOT: tl.constexpr = HP * SLOTH
    scr = scr_ptr + pid.to(tl.int64) * (_N_SLOTS * SLOT)
    cell = (hl[:, None, None] * (ER + 2 * MR) + MR + u[None, :, None]) * SC + MC + w[None, None, :]
    if HAS_W1:
        w1 = tl.load(w1_ptr + hv[:, None] * H + hv[None, :], mask=hmask[:, None] & hmask[None, :], other=0.0)
    if HAS_W2:
        w2 = tl.load(w2_ptr + hv[:, None] * H + hv[None, :], mask=hmask[:, None] & hmask[None, :], other=0.0)

    # No loop here may be software-pipelined: each hands data through the scratch slots
    # (num_stages=1 on every loop; frames.launch_config launches with 1 stage as well).
    for item in tl.range(pid, n_items, nprog, num_stages=1):  # (batch, query block) work items
        b = item // n_rt
        t = item % n_rt
        rows = t * BMO - TOP + u  # (ER,) query index of each frame row
        own_r = (u >= TOP) & (u < TOP + BMO) & (rows < Tq)
        row_in = (rows >= 0) & (rows < Tq)
        if HAS_KV:
            row_ok = row_in & (tl.load(kv_ptr + b * Tk + rows + q_off, mask=row_in, other=0) != 0)
        else:
            row_ok = row_in
        n_own_rows = tl.minimum(BMO, Tq - t * BMO)
        if MODE == _BWD:
            dw1 = tl.zeros([HP, HP], dtype=ACC)
            dw2 = tl.zeros([HP, HP], dtype=ACC)

        # Causal skipping: key blocks up to the one holding this block's last query.
        last = tl.minimum(Tq, t * BMO + BMO) - 1 + q_off
        n_ct = tl.minimum(tl.cdiv(Tk, BNO), last // BNO + 1)
        for ct in tl.range(0, n_ct, num_stages=1):
            cols = ct * BNO - LEFT + w  # (EC,) key index of each frame column
            col_in = (cols >= 0) & (cols < Tk)
            own_c = (w >= LEFT) & (w < LEFT + BNO) & col_in
            own = own_r[:, None] & own_c[None, :]  # (ER, EC)
            allowed = row_ok[:, None] & col_in[None, :] & (cols[None, :] <= rows[:, None] + q_off)
            if HAS_KV:
                allowed = allowed & (tl.load(kv_ptr + b * Tk + cols, mask=col_in, other=0) != 0)[None, :]

            # ---- S -> C (per head chunk), Z = mix(C)
            for c0 in tl.range(0, HP, HC, num_stages=1):
                hc = c0 + hl
                hm3 = (hc < H)[:, None, None]
                q_c = _load_tile(q_ptr, b, hc, rows, Tq, H, d, DP, UPCAST)  # (HC, ER, DP)
                k_c = _load_tile(k_ptr, b, hc, cols, Tk, H, d, DP, UPCAST)  # (HC, EC, DP)
                s = tl.dot(q_c, tl.trans(k_c, 0, 2, 1), input_precision=PREC, out_dtype=ACC) * scale
                s = tl.where(allowed[None, :, :] & hm3, s, 0.0)  # the convolution must not read the future
                if HAS_K1:
                    c = _conv(scr + _S * SLOT + c0 * SLOTH + cell, s, k1_ptr + c0 * CQ1 * CK1, hc < H,
                              SC, CQ1, CK1, PL1, False)
                else:
                    c = s
                _put(scr + _C * SLOT + c0 * SLOTH + cell, c)
            if HAS_W1:
                _mix_slabs(scr + _C * SLOT, scr + _ZA * SLOT, w1, H, HP, ER, EC, SR, SC, MR, MC, USE_DOT, PREC)
                zslot = scr + _ZA * SLOT
            else:
                zslot = scr + _C * SLOT

            if MODE == _STATS:
                for c0 in tl.range(0, HP, HC, num_stages=1):
                    hc = c0 + hl
                    own3 = own[None, :, :] & allowed[None, :, :] & (hc < H)[:, None, None]
                    zm = tl.where(own3, tl.load(zslot + c0 * SLOTH + cell), float("-inf"))
                    sptr = (b.to(tl.int64) * H + hc[:, None]) * Tq + rows[None, :]
                    smask = (hc < H)[:, None] & own_r[None, :]
                    m_i = tl.load(m_ptr + sptr, mask=smask, other=float("-inf"))
                    l_i = tl.load(l_ptr + sptr, mask=smask, other=0.0)
                    m_new = tl.maximum(m_i, tl.max(zm, axis=2))
                    base = tl.where(m_new == float("-inf"), 0.0, m_new)
                    l_i = l_i * tl.exp(m_i - base) + tl.sum(tl.exp(zm - base[:, :, None]), axis=2)
                    tl.store(m_ptr + sptr, m_new, mask=smask)
                    tl.store(l_ptr + sptr, l_i, mask=smask)
            else:
                # ---- P = exp(Z - lse) exactly, R = mask * conv(P), A = mix(R)
                for c0 in tl.range(0, HP, HC, num_stages=1):
                    hc = c0 + hl
                    al3 = allowed[None, :, :] & (hc < H)[:, None, None]
                    sptr = (b.to(tl.int64) * H + hc[:, None]) * Tq + rows[None, :]
                    lse = tl.load(lse_ptr + sptr, mask=(hc < H)[:, None] & row_in[None, :], other=0.0)
                    z = tl.load(zslot + c0 * SLOTH + cell)
                    # <= 1 by construction; clamped so that halo junk cannot overflow
                    p = tl.where(al3, tl.exp(tl.minimum(z - lse[:, :, None], 0.0)), 0.0)
                    if HAS_K2:
                        r = tl.where(al3, _conv(scr + _P * SLOT + c0 * SLOTH + cell, p, k2_ptr + c0 * CQ2 * CK2,
                                                hc < H, SC, CQ2, CK2, PL2, False), 0.0)
                    else:
                        _put(scr + _P * SLOT + c0 * SLOTH + cell, p)
                        r = p
                    if MODE != _BWD_D:
                        _put(scr + _R * SLOT + c0 * SLOTH + cell, r)
                if MODE != _BWD_D:
                    if HAS_W2:
                        _mix_slabs(scr + _R * SLOT, scr + _ZA * SLOT, w2, H, HP, ER, EC, SR, SC, MR, MC, USE_DOT, PREC)
                        aslot = scr + _ZA * SLOT
                    else:
                        aslot = scr + _R * SLOT

                # ---- A V (forward); dA = dO V^T, dv (backward)
                for c0 in tl.range(0, HP, HC, num_stages=1):
                    hc = c0 + hl
                    hm3 = (hc < H)[:, None, None]
                    own3 = own[None, :, :] & hm3
                    v_c = _load_tile(v_ptr, b, hc, cols, Tk, H, d, DP, UPCAST)  # (HC, EC, DP)
                    if DROP:
                        # int64 cell index of (b, h, row, col): distinct for every cell, no wrap
                        offs = (((b.to(tl.int64) * H + hc[:, None, None]) * Tq + rows[None, :, None]) * Tk
                                + cols[None, None, :])
                        keep = tl.rand(seed, offs) >= p_drop
                    if MODE != _BWD_D:
                        a_ = tl.load(aslot + c0 * SLOTH + cell)
                        if DROP:
                            a_ = tl.where(keep, a_ / (1.0 - p_drop), 0.0)
                        a_own = tl.where(own3, a_, 0.0)
                    optr = ((b.to(tl.int64) * H + hc[:, None, None]) * Tq + rows[None, :, None]) * d + e[None, None, :]
                    omask = hm3 & own_r[None, :, None] & (e < d)[None, None, :]
                    if MODE == _FWD:
                        o_c = tl.dot(a_own.to(v_c.dtype), v_c, input_precision=PREC, out_dtype=ACC)
                        tl.store(oacc_ptr + optr, tl.load(oacc_ptr + optr, mask=omask, other=0.0) + o_c, mask=omask)
                    else:
                        do_c = _load_tile(do_ptr, b, hc, rows, Tq, H, d, DP, UPCAST)  # (HC, ER, DP)
                        da = tl.dot(do_c, tl.trans(v_c, 0, 2, 1), input_precision=PREC, out_dtype=ACC)
                        if DROP:
                            da = tl.where(keep, da / (1.0 - p_drop), 0.0)
                        _put(scr + _DA * SLOT + c0 * SLOTH + cell, da)
                        if MODE == _BWD:
                            # dv of the owned key block: other query blocks add to the same keys
                            kptr = ((b.to(tl.int64) * H + hc[:, None, None]) * Tk + cols[None, :, None]) * d + e[None, None, :]
                            kmask = hm3 & own_c[None, :, None] & (e < d)[None, None, :]
                            # A in the inputs' dtype, as for A V (tensor cores for bf16 inputs)
                            dv_c = tl.dot(tl.trans(a_own, 0, 2, 1).to(do_c.dtype), do_c, input_precision=PREC,
                                          out_dtype=ACC)
                            tl.atomic_add(dv_ptr + kptr, dv_c, mask=kmask, sem="relaxed")

                if MODE != _FWD:
                    # ---- dR = mix^T(dA); dP = conv^T(mask * dR)
                    if HAS_W2:
                        _mix_slabs(scr + _DA * SLOT, scr + _DR * SLOT, tl.trans(w2), H, HP, ER, EC, SR, SC, MR, MC,
                                   USE_DOT, PREC)
                        drslot = scr + _DR * SLOT
                        if MODE == _BWD:
                            dw2 += _mix_grad_slabs(scr + _DA * SLOT, scr + _R * SLOT, TOP, own_c, H, HP, ER, EC, SR,
                                                   SC, MR, MC, n_own_rows, USE_DOT, PREC)
                    else:
                        drslot = scr + _DA * SLOT
                    for c0 in tl.range(0, HP, HC, num_stages=1):
                        hc = c0 + hl
                        hm3 = (hc < H)[:, None, None]
                        al3 = allowed[None, :, :] & hm3
                        own3 = own[None, :, :] & hm3
                        dr = tl.where(al3, tl.load(drslot + c0 * SLOTH + cell), 0.0)
                        if HAS_K2:
                            dp = _conv(drslot + c0 * SLOTH + cell, dr, k2_ptr + c0 * CQ2 * CK2, hc < H,
                                       SC, CQ2, CK2, PL2, True)
                        else:
                            dp = dr
                        p = tl.load(scr + _P * SLOT + c0 * SLOTH + cell)
                        sptr = (b.to(tl.int64) * H + hc[:, None]) * Tq + rows[None, :]
                        if MODE == _BWD_D:
                            smask = (hc < H)[:, None] & own_r[None, :]
                            dsum = tl.sum(tl.where(own3, p * dp, 0.0), axis=2)
                            tl.store(dd_ptr + sptr, tl.load(dd_ptr + sptr, mask=smask, other=0.0) + dsum, mask=smask)
                        else:
                            dd = tl.load(dd_ptr + sptr, mask=(hc < H)[:, None] & row_in[None, :], other=0.0)
                            _put(scr + _ZA * SLOT + c0 * SLOTH + cell, p * (dp - dd[:, :, None]))  # dZ
                            if HAS_K2:
                                _conv_weight_grad(scr + _P * SLOT + c0 * SLOTH + cell, tl.where(own3, dr, 0.0),
                                                  pk2_ptr + item * (HP * CQ2 * CK2) + c0 * CQ2 * CK2, SC, CQ2, CK2, PL2)

                if MODE == _BWD:
                    # ---- dC = mix^T(dZ); dS = mask * conv^T(dC); dq, dk
                    if HAS_W1:
                        _mix_slabs(scr + _ZA * SLOT, scr + _DA * SLOT, tl.trans(w1), H, HP, ER, EC, SR, SC, MR, MC,
                                   USE_DOT, PREC)
                        dw1 += _mix_grad_slabs(scr + _ZA * SLOT, scr + _C * SLOT, TOP, own_c, H, HP, ER, EC, SR,
                                               SC, MR, MC, n_own_rows, USE_DOT, PREC)
                        dcslot = scr + _DA * SLOT
                    else:
                        dcslot = scr + _ZA * SLOT
                    for c0 in tl.range(0, HP, HC, num_stages=1):
                        hc = c0 + hl
                        hm3 = (hc < H)[:, None, None]
                        own3 = own[None, :, :] & hm3
                        dc = tl.load(dcslot + c0 * SLOTH + cell)
                        if HAS_K1:
                            ds = _conv(dcslot + c0 * SLOTH + cell, dc, k1_ptr + c0 * CQ1 * CK1, hc < H,
                                       SC, CQ1, CK1, PL1, True)
                            _conv_weight_grad(scr + _S * SLOT + c0 * SLOTH + cell, tl.where(own3, dc, 0.0),
                                              pk1_ptr + item * (HP * CQ1 * CK1) + c0 * CQ1 * CK1, SC, CQ1, CK1, PL1)
                        else:
                            ds = dc
                        ds_own = tl.where(own3 & allowed[None, :, :], ds * scale, 0.0)
                        q_c = _load_tile(q_ptr, b, hc, rows, Tq, H, d, DP, UPCAST)
                        k_c = _load_tile(k_ptr, b, hc, cols, Tk, H, d, DP, UPCAST)
                        optr = ((b.to(tl.int64) * H + hc[:, None, None]) * Tq + rows[None, :, None]) * d + e[None, None, :]
                        omask = hm3 & own_r[None, :, None] & (e < d)[None, None, :]
                        # dS in the inputs' dtype (FlashAttention's choice): tensor cores for bf16 inputs
                        dq_c = tl.dot(ds_own.to(k_c.dtype), k_c, input_precision=PREC, out_dtype=ACC)
                        tl.store(dqacc_ptr + optr, tl.load(dqacc_ptr + optr, mask=omask, other=0.0) + dq_c, mask=omask)
                        kptr = ((b.to(tl.int64) * H + hc[:, None, None]) * Tk + cols[None, :, None]) * d + e[None, None, :]
                        kmask = hm3 & own_c[None, :, None] & (e < d)[None, None, :]
                        dk_c = tl.dot(tl.trans(ds_own, 0, 2, 1).to(q_c.dtype), q_c, input_precision=PREC,
                                      out_dtype=ACC)
                        tl.atomic_add(dk_ptr + kptr, dk_c, mask=kmask, sem="relaxed")

        if MODE == _BWD:
            wptr = item * (HP * HP) + hv[:, None] * HP + hv[None, :]
            if HAS_W1:
                tl.store(pw1_ptr + wptr, dw1)
            if HAS_W2:
                tl.store(pw2_ptr + wptr, dw2)


def _tiling(hp: int, er: int, device: torch.device) -> tuple[int, int]:
    """(heads per chunk, frame rows per mixing slab). The interpreter runs whole tiles
    (fewest interpreted ops); a GPU takes small chunks (registers, shared memory).
    ``MTA_TRITON_CHUNKS=HCxSR`` overrides both."""
    spec = os.environ.get("MTA_TRITON_CHUNKS")
    if spec:
        try:
            hc, sr = (int(x) for x in spec.lower().split("x"))
        except ValueError:
            raise UserError(f"MTA_TRITON_CHUNKS={spec!r}: expected HCxSR, e.g. 2x4") from None
        if hc < 1 or sr < 1 or hp % hc or er % sr or hc & (hc - 1) or sr & (sr - 1):
            raise UserError(f"MTA_TRITON_CHUNKS={spec!r}: powers of two dividing {hp} heads and {er} frame rows")
        return hc, sr
    if device.type == "cpu":
        return hp, er
    return frames.gpu_chunks(hp, er)


def _launch(mode, q, k, v, do, bufs: dict, kv, k1, w1, k2, w2, pad_key, q_off, p_drop, seed):
    b, h, tq, d = q.shape
    tk = k.shape[2]
    pre = None if k1 is None else tuple(k1.shape[1:])
    post = None if k2 is None else tuple(k2.shape[1:])
    g = frames.frame(frames.PASSES[mode.value], pre, post, pad_key)
    cq1, ck1 = (1, 1) if k1 is None else k1.shape[1:]
    cq2, ck2 = (1, 1) if k2 is None else k2.shape[1:]
    n_rt = triton.cdiv(tq, g.bmo)
    n_items = b * n_rt
    hp = frames.padded_heads(h)
    hc, sr = _tiling(hp, g.er, q.device)
    acc = q.dtype if q.dtype == torch.float64 else torch.float32
    # A persistent grid on a GPU bounds the scratch; the interpreter runs one item each.
    n_prog = n_items if q.device.type == "cpu" else min(
        n_items, frames.PROGRAMS_PER_SM * torch.cuda.get_device_properties(q.device).multi_processor_count)
    # zeros: the margins around each slot's frame must read 0 (they are never written)
    mr, mc = frames.margins(pre, post)
    scratch = torch.zeros(n_prog * frames.N_SLOTS * frames.slot_elements(g, pre, post, h), dtype=acc,
                          device=q.device)
    dummy = scratch[:1]
    if mode == _BWD:
        for name, shape, present in (("k1", (cq1, ck1), k1 is not None), ("w1", (hp,), w1 is not None),
                                     ("k2", (cq2, ck2), k2 is not None), ("w2", (hp,), w2 is not None)):
            if present:
                bufs["part_" + name] = torch.zeros(n_items, hp, *shape, dtype=acc, device=q.device)

    def buf(name):
        return bufs.get(name, dummy)

    num_warps, num_stages = frames.launch_config(frames.PASSES[mode.value], pre, post)
    try:
        _mta_kernel[(n_prog,)](
            q, k, v, do if do is not None else q, buf("lse"), buf("dd"), buf("m"), buf("l"), buf("oacc"),
            buf("dqacc"), buf("dk"), buf("dv"), kv if kv is not None else dummy,
            k1 if k1 is not None else dummy, w1 if w1 is not None else dummy,
            k2 if k2 is not None else dummy, w2 if w2 is not None else dummy,
            scratch, buf("part_k1"), buf("part_w1"), buf("part_k2"), buf("part_w2"),
            tq, tk, q_off, h, d, n_rt, n_items, d ** -0.5, p_drop, seed,
            MODE=mode.value, ACC=tl.float64 if acc == torch.float64 else tl.float32,
            PREC="ieee", USE_DOT=hp >= 16,
            HP=hp, HC=hc, SR=sr, DP=max(16, frames.pow2(d)), ER=g.er, EC=g.ec, TOP=g.top, LEFT=g.left,
            BMO=g.bmo, BNO=g.bno, MR=mr, MC=mc,
            HAS_K1=k1 is not None, CQ1=cq1, CK1=ck1, PL1=frames.pad_left(pad_key, ck1), HAS_W1=w1 is not None,
            HAS_K2=k2 is not None, CQ2=cq2, CK2=ck2, PL2=frames.pad_left(pad_key, ck2), HAS_W2=w2 is not None,
            HAS_KV=kv is not None, DROP=p_drop > 0.0, UPCAST=q.device.type == "cpu",
            num_warps=num_warps, num_stages=num_stages,
        )
    except triton.runtime.errors.OutOfResources as e:
        # What a real compile shows and the interpreter cannot (scripts/compile_triton.py
        # reports each pass's needs without a GPU).
        raise RuntimeError(
            f"model.attn_impl=triton: its {frames.PASSES[mode.value]!r} pass does not fit this GPU "
            f"({e}); frame {g.er}x{g.ec}, {h} heads of {d}, chunks {hc}x{sr}. Use model.attn_impl=blocked, "
            f"or smaller MTA_TRITON_CHUNKS / MTA_TRITON_FRAME") from e


def _sum_parts(part: torch.Tensor, h: int) -> torch.Tensor:
    """Per-item partial gradients (items, HP, ...) -> (H, ...)."""
    out = part.sum(0)[:h]
    return out[:, :h] if out.dim() == 2 else out


class _MTATriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, k1, w1, k2, w2, key_valid, q_off, pad_key, p_drop):
        q, k, v = (t.contiguous() for t in (q, k, v))
        b, h, tq, d = q.shape
        acc = q.dtype if q.dtype == torch.float64 else torch.float32
        kv = None if key_valid is None else key_valid.to(torch.int8).contiguous()
        seed = int(torch.randint(0, 2**31 - 1, ())) if p_drop > 0.0 else 0
        args = dict(kv=kv, k1=k1, w1=w1, k2=k2, w2=w2, pad_key=pad_key, q_off=q_off, p_drop=p_drop, seed=seed)
        stats = {"m": torch.full((b, h, tq), float("-inf"), dtype=acc, device=q.device),
                 "l": torch.zeros(b, h, tq, dtype=acc, device=q.device)}
        _launch(_STATS, q, k, v, None, stats, **args)
        m, l = stats["m"], stats["l"]
        # a pad row (nothing allowed) keeps l = 0: its probabilities are masked to 0 anyway
        lse = torch.where(l > 0, m + torch.log(torch.where(l > 0, l, torch.ones_like(l))), torch.zeros_like(l))
        fwd = {"lse": lse, "oacc": torch.zeros(q.shape, dtype=acc, device=q.device)}
        _launch(_FWD, q, k, v, None, fwd, **args)
        ctx.save_for_backward(q, k, v, lse, kv, k1, w1, k2, w2)
        ctx.args = (pad_key, q_off, p_drop, seed)
        return fwd["oacc"].to(q.dtype)

    @staticmethod
    def backward(ctx, do):
        q, k, v, lse, kv, k1, w1, k2, w2 = ctx.saved_tensors
        pad_key, q_off, p_drop, seed = ctx.args
        do = do.contiguous()
        h = q.shape[1]
        acc = lse.dtype
        bufs = {"lse": lse, "dd": torch.zeros_like(lse)}
        args = dict(kv=kv, k1=k1, w1=w1, k2=k2, w2=w2, pad_key=pad_key, q_off=q_off, p_drop=p_drop, seed=seed)
        _launch(_BWD_D, q, k, v, do, bufs, **args)
        bufs.update(dqacc=torch.zeros(q.shape, dtype=acc, device=q.device),
                    dk=torch.zeros(k.shape, dtype=acc, device=k.device),
                    dv=torch.zeros(v.shape, dtype=acc, device=v.device))
        _launch(_BWD, q, k, v, do, bufs, **args)
        grads = {n[5:]: _sum_parts(t, h) for n, t in bufs.items() if n.startswith("part_")}
        return (bufs["dqacc"].to(q.dtype), bufs["dk"].to(k.dtype), bufs["dv"].to(v.dtype), grads.get("k1"),
                grads.get("w1"), grads.get("k2"), grads.get("w2"), None, None, None, None)


def post_mix_matrix(p: ExplicitAttnParams) -> Optional[torch.Tensor]:
    """The post-softmax head mixing as one (H_out, H_in) matrix: ``wposm`` itself, or the
    block-diagonal matrix of the grouped ``head_kernel`` (out g*c_h+j <- in g*c_h+i)."""
    if p.head_kernel is not None:
        return torch.block_diag(*p.head_kernel.transpose(1, 2))
    return p.wposm


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
        mask.key_valid, mask.q_offset, p.pad_key, p.dropout if training else 0.0,
    )
