"""``model.attn_impl=triton``: MTA's whole explicit score path in fused Triton kernels.

Computes exactly what ``attention_ops.explicit_attention_torch`` computes (the release's
order: pre-softmax key-query convolution -> pre-softmax head mixing -> causal softmax ->
post-softmax key-query convolution, no renormalisation -> post-softmax head mixing ->
dropout -> .V, with ``key_valid`` padding and ``q_offset``), forward and backward, without
writing any (B, H, Tq, Tk) tensor to global memory.

Design
------
*Frames.* A program owns a block of ``BMO`` query rows and walks the key axis in blocks
of ``BNO`` columns (causal skipping: only blocks that hold a key <= its last row). For
each (row block, key block) it computes on a *frame*: the owned (BMO x BNO) block grown
by the halo every convolution in the chain reads (``TOP``/``BOT`` rows, ``LEFT``/``RIGHT``
columns), rounded to powers of two (ER x EC, Triton's tile shapes). Every quantity of the
chain is computed for all heads at once on the frame as an (HP, ER, EC) tile, so the
head mixings are one (HP x HP) @ (HP x ER*EC) product; only the owned block's values are
used (everything else is halo, recomputed by the neighbouring program: the overlapping-
tile scheme, as in Gusanidas' CUDA pre-softmax kernel). Raw scores are one batched
QK^T per frame, the halo included, so Q and K are read once per frame and no score is
shifted by arithmetic on Q or K.

*Convolutions.* Triton cannot shift a register tile, so a convolution stores its input
tile in a per-program scratch slot (HP x ER x EC, in global memory but private to the
program: on a GPU it lives in L1/L2), then sums the c_q x c_k shifted reloads weighted by
the per-head kernel entries; the adjoint convolution (backward) reloads with the
opposite shifts. Each slot has zero margins as wide as the largest shift, so reloads
that leave the frame read 0 without a mask: values near the frame's edge are wrong,
and the halos are sized so that no owned value depends on them. Scratch is
O(B * T/BMO * H * ER * EC): linear in T.

*Softmax.* The post-softmax transforms mix rows of different heads and neighbouring
rows after normalisation, so one online pass does not suffice: pass 0 computes each
row's log-sum-exp (online max/sum over key blocks), pass 1 recomputes the scores,
forms exact probabilities ``exp(Z - lse)`` on the frame (halo rows included: the lse of
every row is known after pass 0), and applies the post-softmax transforms and .V.

*Backward.* Pass 2 computes ``D = rowsum(P * dP)`` (the softmax backward's row term; unlike
plain attention it is not ``rowsum(dO * O)``, since dP comes through the post-softmax
convolution's adjoint), pass 3 recomputes the forward chain from q, k, v and the lse,
runs the chain's adjoint on the frame (dA = dO V^T -> mixing^T -> masked conv^T -> dP ->
dZ = P (dP - D) -> mixing^T -> conv^T -> dS), accumulates dq in registers for the
owned rows, adds dk and dv of the owned key block atomically (fp32/fp64 buffers), and
accumulates the kernels' gradients (sums over owned (i, j) of the output gradient times
the shifted input, reloaded from the scratch slots) and the mixings' gradients
((HP x ER*EC) @ (ER*EC x HP)) in per-program slots that torch sums afterwards.
Saved for backward: q, k, v, the (B, H, Tq) lse and the weights; nothing quadratic.

*Masking.* Every masked value is selected (``tl.where``), never multiplied, so a
fully masked pad row gives exact zeros and no NaN; exp arguments are clamped at 0 (a
true probability is <= 1), so the frame's halo never overflows.

*Dropout* on the post-mixing probabilities draws its mask with ``tl.rand`` from a seed
taken from torch's generator (saved for backward): the same masks in forward and backward,
seeded runs are reproducible; the masks are not the ones ``F.dropout`` would draw.

Status: verified under ``TRITON_INTERPRET=1`` (tests/test_attn_impls.py runs it against
"torch" for every option, forward and every gradient). Its speed and its compile on a GPU
are unmeasured: no GPU was available while it was written. The tile shapes (frame
ER x EC, all heads per program) are the first thing a real compile will push back on
(registers / shared memory at H=16); ``MTA_TRITON_FRAME="ROWSxCOLS"`` overrides the frame
without code changes.
"""

from __future__ import annotations

from typing import Optional

import torch

import triton
import triton.language as tl

from mta_repro.model import frames
from mta_repro.model.attention_ops import AttnMask, ExplicitAttnParams

# Pass modes of the one kernel (they share every stage of the chain).
_STATS, _FWD, _BWD_D, _BWD = (tl.constexpr(i) for i in range(4))


@triton.jit
def _load_tile(ptr, b, idx, T, H, d, HP: tl.constexpr, R: tl.constexpr, DP: tl.constexpr):
    """(HP, R, DP) tile of a contiguous (B, H, T, d) tensor at positions ``idx`` (R,);
    zero outside [0, T), past H heads and past d."""
    h = tl.arange(0, HP)[:, None, None]
    r = idx[None, :, None]
    e = tl.arange(0, DP)[None, None, :]
    m = (h < H) & (r >= 0) & (r < T) & (e < d)
    return tl.load(ptr + ((b * H + h) * T + r) * d + e, mask=m, other=0.0)


@triton.jit
def _mix(w, x, HP: tl.constexpr, ER: tl.constexpr, EC: tl.constexpr, USE_DOT: tl.constexpr,
         PREC: tl.constexpr):
    """out[g] = sum_h w[g, h] x[h]: w (HP, HP), x (HP, ER, EC)."""
    if USE_DOT:
        out = tl.dot(w, tl.reshape(x, [HP, ER * EC]), input_precision=PREC, out_dtype=x.dtype)
        return tl.reshape(out, [HP, ER, EC])
    else:  # tl.dot needs >= 16 rows on a GPU; small head counts broadcast instead
        return tl.sum(w[:, :, None, None] * x[None, :, :, :], axis=1)


@triton.jit
def _mix_grad(gout, x, HP: tl.constexpr, ER: tl.constexpr, EC: tl.constexpr, USE_DOT: tl.constexpr,
              PREC: tl.constexpr):
    """d w[g, h] = sum_{u, v} gout[g, u, v] x[h, u, v] (the gradient of ``_mix``'s weight)."""
    if USE_DOT:
        return tl.dot(tl.reshape(gout, [HP, ER * EC]), tl.trans(tl.reshape(x, [HP, ER * EC])),
                      input_precision=PREC, out_dtype=x.dtype)
    else:
        return tl.sum(tl.sum(gout[:, None, :, :] * x[None, :, :, :], axis=3), axis=2)


@triton.jit
def _conv(ptrs, x, kern, hmask, SC: tl.constexpr, CQ: tl.constexpr, CK: tl.constexpr, PL: tl.constexpr,
          ADJOINT: tl.constexpr):
    """Depthwise key-query convolution of the frame tile x (HP, ER, EC) through a scratch slot
    (``ptrs``: the slot's frame cells, rows SC apart; zero margins around them).

    Forward: out[u, w] = sum_{a, b} kern[h, a, b] x[u + a - (CQ-1), w + b - PL] (queries look
    back only). Adjoint: out[u, w] = sum_{a, b} kern[h, a, b] x[u + (CQ-1) - a, w + PL - b].
    Reads that leave the frame land in the margins and read 0 (only the halo sees them)."""
    kbase = kern + tl.arange(0, hmask.shape[0])[:, None, None] * (CQ * CK)
    km = hmask[:, None, None]
    tl.debug_barrier()  # earlier readers of this slot are done
    tl.store(ptrs, x)
    tl.debug_barrier()
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
def _conv_weight_grad(ptrs, gout, part, HP: tl.constexpr, SC: tl.constexpr, CQ: tl.constexpr,
                      CK: tl.constexpr, PL: tl.constexpr):
    """part[h, a, b] += sum_{u, w} gout[h, u, w] x[h, u + a - (CQ-1), w + b - PL], x the
    forward input still in the slot at ``ptrs``; gout is zero outside the owned block."""
    pbase = part + tl.arange(0, HP) * (CQ * CK)
    for a in tl.static_range(CQ):
        for bb in tl.static_range(CK):
            xs = tl.load(ptrs + ((a - (CQ - 1)) * SC + (bb - PL)))
            s = tl.sum(tl.sum(gout * xs, axis=2), axis=1)
            tl.store(pbase + (a * CK + bb), tl.load(pbase + (a * CK + bb)) + s)


@triton.jit
def _mta_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, o_ptr, lse_ptr, dd_ptr, dq_ptr, dk_ptr, dv_ptr,
    kv_ptr, k1_ptr, w1_ptr, k2_ptr, w2_ptr, scr_ptr, pk1_ptr, pw1_ptr, pk2_ptr, pw2_ptr,
    Tq, Tk, q_off, H, d, n_rt, scale, p_drop, seed,
    MODE: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr, USE_DOT: tl.constexpr,
    HP: tl.constexpr, DP: tl.constexpr, ER: tl.constexpr, EC: tl.constexpr,
    TOP: tl.constexpr, LEFT: tl.constexpr, BMO: tl.constexpr, BNO: tl.constexpr,
    MR: tl.constexpr, MC: tl.constexpr,
    HAS_K1: tl.constexpr, CQ1: tl.constexpr, CK1: tl.constexpr, PL1: tl.constexpr,
    HAS_W1: tl.constexpr,
    HAS_K2: tl.constexpr, CQ2: tl.constexpr, CK2: tl.constexpr, PL2: tl.constexpr,
    HAS_W2: tl.constexpr, HAS_KV: tl.constexpr, DROP: tl.constexpr,
):
    t = tl.program_id(0)  # owned query block
    b = tl.program_id(1)
    hv = tl.arange(0, HP)
    hmask = hv < H
    hm3 = hmask[:, None, None]
    e = tl.arange(0, DP)

    u = tl.arange(0, ER)
    rows = t * BMO - TOP + u  # (ER,) query index of each frame row
    own_r = (u >= TOP) & (u < TOP + BMO) & (rows < Tq)
    row_in = (rows >= 0) & (rows < Tq)
    if HAS_KV:
        row_ok = row_in & (tl.load(kv_ptr + b * Tk + rows + q_off, mask=row_in, other=0) != 0)
    else:
        row_ok = row_in

    # Four scratch slots, each (HP, ER + 2 MR, SC = EC + 2 MC): the frame with zero margins
    # as wide as the largest shift, so shifted reloads need no masks.
    SC: tl.constexpr = EC + 2 * MC
    SLOT: tl.constexpr = HP * (ER + 2 * MR) * SC
    scr = scr_ptr + (b * n_rt + t).to(tl.int64) * (4 * SLOT)
    cell = ((hv[:, None, None] * (ER + 2 * MR) + MR + u[None, :, None]) * SC + MC
            + tl.arange(0, EC)[None, None, :])
    slot0 = scr + cell
    q_t = _load_tile(q_ptr, b, rows, Tq, H, d, HP, ER, DP)  # (HP, ER, DP)
    hr = (b * H + hv[:, None]) * Tq + rows[None, :]  # (HP, ER) offsets into (B, H, Tq)
    hr_ok = hmask[:, None] & row_in[None, :]
    if HAS_W1:
        w1 = tl.load(w1_ptr + hv[:, None] * H + hv[None, :], mask=hmask[:, None] & hmask[None, :], other=0.0)
    if HAS_W2:
        w2 = tl.load(w2_ptr + hv[:, None] * H + hv[None, :], mask=hmask[:, None] & hmask[None, :], other=0.0)
    if MODE != _STATS:
        lse = tl.load(lse_ptr + hr, mask=hr_ok, other=0.0)
    if MODE >= _BWD_D:
        do_t = _load_tile(do_ptr, b, rows, Tq, H, d, HP, ER, DP)
    if MODE == _BWD:
        dd = tl.load(dd_ptr + hr, mask=hr_ok, other=0.0)
        dw1 = tl.zeros([HP, HP], dtype=ACC)
        dw2 = tl.zeros([HP, HP], dtype=ACC)
        acc_dq = tl.zeros([HP, ER, DP], dtype=ACC)
        part = b * n_rt + t
    if MODE == _STATS:
        m_i = tl.full([HP, ER], float("-inf"), dtype=ACC)
        l_i = tl.zeros([HP, ER], dtype=ACC)
    if MODE == _FWD:
        acc_o = tl.zeros([HP, ER, DP], dtype=ACC)
    if MODE == _BWD_D:
        acc_d = tl.zeros([HP, ER], dtype=ACC)

    # Causal skipping: key blocks up to the one holding this block's last query.
    last = tl.minimum(Tq, t * BMO + BMO) - 1 + q_off
    n_ct = tl.minimum(tl.cdiv(Tk, BNO), last // BNO + 1)
    for ct in range(0, n_ct):
        w = tl.arange(0, EC)
        cols = ct * BNO - LEFT + w  # (EC,) key index of each frame column
        col_in = (cols >= 0) & (cols < Tk)
        own = own_r[:, None] & ((w >= LEFT) & (w < LEFT + BNO) & col_in)[None, :]  # (ER, EC)
        allowed = row_ok[:, None] & col_in[None, :] & (cols[None, :] <= rows[:, None] + q_off)
        if HAS_KV:
            allowed = allowed & (tl.load(kv_ptr + b * Tk + cols, mask=col_in, other=0) != 0)[None, :]
        al3 = allowed[None, :, :] & hm3
        own3 = own[None, :, :] & hm3

        # ---- forward chain on the frame: S -> C -> Z (pre-softmax)
        k_t = _load_tile(k_ptr, b, cols, Tk, H, d, HP, EC, DP)  # (HP, EC, DP)
        s = tl.dot(q_t, tl.trans(k_t, 0, 2, 1), input_precision=PREC, out_dtype=ACC) * scale
        s = tl.where(al3, s, 0.0)  # (HP, ER, EC); the convolution must not read the future
        if HAS_K1:
            c = _conv(slot0, s, k1_ptr, hmask, SC, CQ1, CK1, PL1, False)
        else:
            c = s
        if HAS_W1:
            z = _mix(w1, c, HP, ER, EC, USE_DOT, PREC)
        else:
            z = c

        if MODE == _STATS:
            zm = tl.where(al3 & own3, z, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(zm, axis=2))
            base = tl.where(m_new == float("-inf"), 0.0, m_new)
            l_i = l_i * tl.exp(m_i - base) + tl.sum(tl.exp(zm - base[:, :, None]), axis=2)
            m_i = m_new
        else:
            # exact probabilities; <= 1 by construction, clamped so halo junk cannot overflow
            p = tl.where(al3, tl.exp(tl.minimum(z - lse[:, :, None], 0.0)), 0.0)
            if DROP:
                offs = (hv[:, None, None] * Tq + rows[None, :, None]) * Tk + cols[None, None, :]
                keep = tl.rand(seed + b, offs) >= p_drop
            if MODE != _BWD_D:
                if HAS_K2:
                    r = tl.where(al3, _conv(slot0 + SLOT, p, k2_ptr, hmask, SC, CQ2, CK2, PL2, False), 0.0)
                else:
                    r = p
                if HAS_W2:
                    a_ = _mix(w2, r, HP, ER, EC, USE_DOT, PREC)
                else:
                    a_ = r
                if DROP:
                    a_ = tl.where(keep, a_ / (1.0 - p_drop), 0.0)
                a_own = tl.where(own3, a_, 0.0)
            v_t = _load_tile(v_ptr, b, cols, Tk, H, d, HP, EC, DP)  # (HP, EC, DP)
            if MODE == _FWD:
                acc_o += tl.dot(a_own.to(v_t.dtype), v_t, input_precision=PREC, out_dtype=ACC)
            else:
                # ---- adjoint chain: dA -> dR -> dP (-> dZ -> dC -> dS in the main pass)
                da = tl.dot(do_t, tl.trans(v_t, 0, 2, 1), input_precision=PREC, out_dtype=ACC)
                if DROP:
                    da = tl.where(keep, da / (1.0 - p_drop), 0.0)
                if HAS_W2:
                    dr = _mix(tl.trans(w2), da, HP, ER, EC, USE_DOT, PREC)
                else:
                    dr = da
                dr = tl.where(al3, dr, 0.0)
                if HAS_K2:
                    dp = _conv(slot0 + 2 * SLOT, dr, k2_ptr, hmask, SC, CQ2, CK2, PL2, True)
                else:
                    dp = dr
                if MODE == _BWD_D:
                    acc_d += tl.sum(tl.where(own3, p * dp, 0.0), axis=2)
                else:
                    dz = p * (dp - dd[:, :, None])
                    if HAS_W1:
                        dc = _mix(tl.trans(w1), dz, HP, ER, EC, USE_DOT, PREC)
                    else:
                        dc = dz
                    if HAS_K1:
                        ds = _conv(slot0 + 3 * SLOT, dc, k1_ptr, hmask, SC, CQ1, CK1, PL1, True)
                    else:
                        ds = dc
                    ds_own = tl.where(own3 & al3, ds * scale, 0.0)
                    acc_dq += tl.dot(ds_own, k_t.to(ACC), input_precision=PREC, out_dtype=ACC)
                    # dk, dv of the owned key block: other row blocks add to the same keys
                    kmask = hm3 & ((w >= LEFT) & (w < LEFT + BNO) & col_in)[None, :, None] & (e < d)[None, None, :]
                    kptr = ((b * H + hv[:, None, None]) * Tk + cols[None, :, None]) * d + e[None, None, :]
                    dk_t = tl.dot(tl.trans(ds_own, 0, 2, 1), q_t.to(ACC), input_precision=PREC, out_dtype=ACC)
                    tl.atomic_add(dk_ptr + kptr, dk_t, mask=kmask)
                    dv_t = tl.dot(tl.trans(a_own, 0, 2, 1), do_t.to(ACC), input_precision=PREC, out_dtype=ACC)
                    tl.atomic_add(dv_ptr + kptr, dv_t, mask=kmask)
                    # parameter gradients: sums over the owned (i, j) only
                    if HAS_K1:
                        _conv_weight_grad(slot0, tl.where(own3, dc, 0.0), pk1_ptr + part * (HP * CQ1 * CK1),
                                          HP, SC, CQ1, CK1, PL1)
                    if HAS_W1:
                        dw1 += _mix_grad(tl.where(own3, dz, 0.0), c, HP, ER, EC, USE_DOT, PREC)
                    if HAS_K2:
                        _conv_weight_grad(slot0 + SLOT, tl.where(own3, dr, 0.0), pk2_ptr + part * (HP * CQ2 * CK2),
                                          HP, SC, CQ2, CK2, PL2)
                    if HAS_W2:
                        dw2 += _mix_grad(tl.where(own3, da, 0.0), r, HP, ER, EC, USE_DOT, PREC)

    own_hr = hmask[:, None] & own_r[None, :]
    if MODE == _STATS:
        tl.store(lse_ptr + hr, tl.where(l_i > 0, m_i + tl.log(tl.where(l_i > 0, l_i, 1.0)), 0.0), mask=own_hr)
    if MODE == _BWD_D:
        tl.store(dd_ptr + hr, acc_d, mask=own_hr)
    if MODE == _FWD or MODE == _BWD:
        optr = ((b * H + hv[:, None, None]) * Tq + rows[None, :, None]) * d + e[None, None, :]
        omask = own_hr[:, :, None] & (e < d)[None, None, :]
        if MODE == _FWD:
            tl.store(o_ptr + optr, acc_o.to(o_ptr.dtype.element_ty), mask=omask)
        else:
            tl.store(dq_ptr + optr, acc_dq.to(dq_ptr.dtype.element_ty), mask=omask)
    if MODE == _BWD:
        wptr = part * (HP * HP) + hv[:, None] * HP + hv[None, :]
        if HAS_W1:
            tl.store(pw1_ptr + wptr, dw1)
        if HAS_W2:
            tl.store(pw2_ptr + wptr, dw2)


def _launch(mode, q, k, v, do, o, lse, dd, dq, dk, dv, kv, k1, w1, k2, w2, parts, pad_key, q_off,
            p_drop, seed):
    b, h, tq, d = q.shape
    tk = k.shape[2]
    g = frames.frame(frames.PASSES[mode.value], None if k1 is None else tuple(k1.shape[1:]),
                     None if k2 is None else tuple(k2.shape[1:]), pad_key)
    cq1, ck1 = (1, 1) if k1 is None else k1.shape[1:]
    cq2, ck2 = (1, 1) if k2 is None else k2.shape[1:]
    n_rt = triton.cdiv(tq, g.bmo)
    hp = max(frames.pow2(h), 2)
    acc = q.dtype if q.dtype == torch.float64 else torch.float32
    # zeros: the margins around each slot's frame must read 0 (they are never written)
    mr, mc = max(cq1, cq2) - 1, max(ck1, ck2) - 1
    scratch = torch.zeros(b * n_rt * 4 * hp * (g.er + 2 * mr) * (g.ec + 2 * mc), dtype=acc, device=q.device)
    dummy = scratch[:1]
    pk1 = pw1 = pk2 = pw2 = dummy
    if mode == _BWD:
        if k1 is not None:
            pk1 = parts["k1"] = torch.zeros(b * n_rt, hp, cq1, ck1, dtype=acc, device=q.device)
        if w1 is not None:
            pw1 = parts["w1"] = torch.zeros(b * n_rt, hp, hp, dtype=acc, device=q.device)
        if k2 is not None:
            pk2 = parts["k2"] = torch.zeros(b * n_rt, hp, cq2, ck2, dtype=acc, device=q.device)
        if w2 is not None:
            pw2 = parts["w2"] = torch.zeros(b * n_rt, hp, hp, dtype=acc, device=q.device)
    try:
        _mta_kernel[(n_rt, b)](
            q, k, v, do if do is not None else q, o if o is not None else dummy,
            lse, dd if dd is not None else lse, dq if dq is not None else dummy,
            dk if dk is not None else dummy, dv if dv is not None else dummy,
            kv if kv is not None else lse,
            k1 if k1 is not None else dummy, w1 if w1 is not None else dummy,
            k2 if k2 is not None else dummy, w2 if w2 is not None else dummy,
            scratch, pk1, pw1, pk2, pw2,
            tq, tk, q_off, h, d, n_rt, d ** -0.5, p_drop, seed,
            MODE=mode.value, ACC=tl.float64 if acc == torch.float64 else tl.float32,
            PREC="ieee", USE_DOT=hp >= 16,
            HP=hp, DP=max(16, frames.pow2(d)), ER=g.er, EC=g.ec, TOP=g.top, LEFT=g.left, BMO=g.bmo, BNO=g.bno, MR=mr, MC=mc,
            HAS_K1=k1 is not None, CQ1=cq1, CK1=ck1, PL1=frames.pad_left(pad_key, ck1), HAS_W1=w1 is not None,
            HAS_K2=k2 is not None, CQ2=cq2, CK2=ck2, PL2=frames.pad_left(pad_key, ck2), HAS_W2=w2 is not None,
            HAS_KV=kv is not None, DROP=p_drop > 0.0,
        )
    except triton.runtime.errors.OutOfResources as e:
        # What a real compile shows and the interpreter cannot (scripts/compile_triton.py
        # reports each pass's needs without a GPU).
        raise RuntimeError(
            f"model.attn_impl=triton: its {frames.PASSES[mode.value]!r} pass does not fit this GPU "
            f"({e}); frame {g.er}x{g.ec}, {h} heads of {d}. Use model.attn_impl=blocked, or a smaller "
            f"MTA_TRITON_FRAME where the halo allows") from e


def _sum_parts(part: torch.Tensor, h: int) -> torch.Tensor:
    """Per-program partial gradients (programs, HP, ...) -> (H, ...)."""
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
        lse = torch.empty(b, h, tq, dtype=acc, device=q.device)
        o = torch.empty_like(q)
        args = dict(kv=kv, k1=k1, w1=w1, k2=k2, w2=w2, parts=None, pad_key=pad_key, q_off=q_off,
                    p_drop=p_drop, seed=seed)
        _launch(_STATS, q, k, v, None, None, lse, None, None, None, None, **args)
        _launch(_FWD, q, k, v, None, o, lse, None, None, None, None, **args)
        ctx.save_for_backward(q, k, v, lse, kv, k1, w1, k2, w2)
        ctx.args = (pad_key, q_off, p_drop, seed)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, lse, kv, k1, w1, k2, w2 = ctx.saved_tensors
        pad_key, q_off, p_drop, seed = ctx.args
        do = do.contiguous()
        b, h, tq, d = q.shape
        acc = lse.dtype
        dd = torch.empty_like(lse)
        dq = torch.empty_like(q)
        dk = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv = torch.zeros(v.shape, dtype=acc, device=v.device)
        parts: dict = {}
        args = dict(kv=kv, k1=k1, w1=w1, k2=k2, w2=w2, parts=parts, pad_key=pad_key, q_off=q_off,
                    p_drop=p_drop, seed=seed)
        _launch(_BWD_D, q, k, v, do, None, lse, dd, None, None, None, **args)
        _launch(_BWD, q, k, v, do, None, lse, dd, dq, dk, dv, **args)
        grads = {n: _sum_parts(t, h) for n, t in parts.items()}
        return (dq, dk.to(k.dtype), dv.to(v.dtype), grads.get("k1"), grads.get("w1"), grads.get("k2"),
                grads.get("w2"), None, None, None, None)


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
