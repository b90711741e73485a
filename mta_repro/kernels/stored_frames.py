"""Geometry and buffers of the *stored-scores* kq-conv design (``attention_stored.py``),
without triton, so the launcher, ``scripts/compile_triton.py`` and the memory pre-flight
describe the same launches (as ``frames.py`` does for ``attention_triton.py``).

Five launches: ``stats`` (C stored, the rows' statistics), ``forward`` (from C), kernel A
as ``backward_rowsum`` (D) and ``backward_dc`` (dC stored, dv, the mixings' and the post
kernel's gradients), kernel B ``backward_b`` (dq, dk, the pre kernel's gradient from dC).

The stored planes (C and dC) are packed by rows: row i of a (batch, head) plane keeps keys
0 .. min(Tk, i + q_off + 1) - 1, the causal cells (``store_rows``), in the model's dtype.
"""

from __future__ import annotations

from typing import Optional

import torch

from mta_repro.kernels import frames
from mta_repro.kernels.conv_pad import pad_left
from mta_repro.kernels.frames import Buffer, Frame, Halo
from mta_repro.kernels.types import DEFAULT_TUNING, KernelTuning

def uses_stored(has_pre: bool, dropout_active: bool, tuning: KernelTuning = DEFAULT_TUNING) -> bool:
    """Whether ``model.attn_impl=triton`` runs a layer in the stored design: a kq-conv layer
    (a pre-softmax kernel) without active dropout, unless the model's
    ``model.kernels.triton_design`` is ``fused`` (the fused kernel for every layer: comparisons)."""
    return tuning.triton_design == "stored" and has_pre and not dropout_active


PASSES = ("stats", "forward", "backward_rowsum", "backward_dc", "backward_b")
# the fused kernel's pass whose code a stored pass runs (``_stored_kernel``'s MODE), or "b"
BASE_PASS = {"stats": "stats", "forward": "forward", "backward_rowsum": "backward_rowsum",
             "backward_dc": "backward", "backward_b": "b"}


# frame rows per head-mixing slab of backward_dc on a GPU (the other passes: the fused kernel's,
# frames.SLAB_ROWS_GPU_CONV = 4): 2 rows spill 8 B where 4 spill 72 B (8: 120 B), the same estimate
SLAB_ROWS_DC = 2

# kernel B's frame (no all-heads scratch): 256 x 64, estimated 1.367 ms against 1.432 ms at
# 128 x 64 (T = 2048, B = 4; 0 spills, 248 registers); 128 x 128 spilled 1,312 B (1.500 ms)
FRAME_B = (256, 64)


def halo(pass_: str, pre, post, pad_key: str) -> Halo:
    """What each stored pass's convolutions read around its owned block."""
    cq1, ck1 = pre or (1, 1)
    cq2, ck2 = post or (1, 1)
    l1, l2 = pad_left(pad_key, ck1), pad_left(pad_key, ck2)
    r1, r2 = ck1 - 1 - l1, ck2 - 1 - l2
    if pass_ == "stats":  # C = conv1(S0) on the owned block: S0 h1 rows above, l1 left, r1 right
        return Halo(cq1 - 1, 0, l1, r1) if pre else Halo(0, 0, 0, 0)
    if pass_ in ("forward", "backward_rowsum"):
        return frames.halo(pass_, pre, post, pad_key)
    if pass_ == "backward_dc":  # dC on the owned block: dP there (dR h2 below, r2/l2 beside); R there (P above)
        h2 = cq2 - 1
        return Halo(h2, h2, max(r2, l2), max(l2, r2)) if post else Halo(0, 0, 0, 0)
    if pass_ == "backward_b":  # dS0 = conv1^T(dC) on the owned block: dC h1 rows below, r1 left, l1 right
        return Halo(0, cq1 - 1, r1, l1) if pre else Halo(0, 0, 0, 0)
    raise ValueError(f"unknown pass {pass_!r}; expected one of {PASSES}")


def frame(pass_: str, pre, post, pad_key: str, tuning: KernelTuning = DEFAULT_TUNING) -> Frame:
    """The pass's frame (``model.kernels.triton_frame`` overrides): 128 x 64
    (``frames.FRAME_COLS_CONV``) grown until at least half of it is owned."""
    hl = halo(pass_, pre, post, pad_key)
    override = frames.frame_override(tuning)  # model.kernels.triton_frame, as for the fused kernel
    if override is not None:
        er, ec = override
        if er <= hl.top + hl.bot or ec <= hl.left + hl.right:
            raise frames.UserError(
                f"model.kernels.triton_frame={er}x{ec} leaves no owned block: the halo needs "
                f"{hl.top + hl.bot + 1}x{hl.left + hl.right + 1} (stored design, {pass_})")
        return Frame(er, ec, hl.top, hl.left, er - hl.top - hl.bot, ec - hl.left - hl.right)
    if pre is None and post is None:  # (a mixing layer: compile_triton's "mixing_stored" estimate only)
        er, ec = frames.FRAME_ROWS, frames.FRAME_COLS
    else:
        er, ec = FRAME_B if pass_ == "backward_b" else (frames.FRAME_ROWS, frames.FRAME_COLS_CONV)
    while 2 * (hl.top + hl.bot) > er:
        er *= 2
    while 2 * (hl.left + hl.right) > ec:
        ec *= 2
    return Frame(er, ec, hl.top, hl.left, er - hl.top - hl.bot, ec - hl.left - hl.right)


def scratch_slots(pass_: str, has_pre: bool, has_post: bool) -> dict:
    """The kernel's S_<stage>/NSLOT constexprs: the fused kernel's, less what a stored pass
    does not hand through scratch (the backward_dc pass writes dC to its store, not a slot,
    and has no S0); backward_b: one plane (its dC window), no slots of all heads."""
    if pass_ == "backward_b":
        out = {f"S_{n}": -1 for n in frames.STAGES}
        out["NSLOT"] = 0
        return out
    if pass_ == "stats" and has_pre:  # S0, then C = conv1(S0)
        out = {f"S_{n}": -1 for n in frames.STAGES}
        out.update(S_C=0, S_S0=1, NSLOT=2)
        return out
    if pass_ != "backward_dc":
        return frames.scratch_slots(pass_, has_pre, has_post)
    need = ["C", "DA", "A"] + (["P", "DR", "DP", "R"] if has_post else [])
    out = {f"S_{n}": -1 for n in frames.STAGES}
    out.update({f"S_{n}": i for i, n in enumerate(need)})
    out["NSLOT"] = len(need)
    return out


def store_rows(tq: int, tk: int, q_off: int) -> list:
    """(Tq + 1) offsets of the rows of one packed plane: row i keeps min(Tk, i + q_off + 1) keys."""
    out = [0]
    for i in range(tq):
        out.append(out[-1] + max(0, min(tk, i + q_off + 1)))
    return out


def store_plane(tq: int, tk: int, q_off: int) -> int:
    """Elements of one packed (batch, head) plane."""
    return sum(max(0, min(tk, i + q_off + 1)) for i in range(tq))


def stored_planes(*, b: int, h: int, tq: int, tk: int, q_off: int, dtype: torch.dtype) -> dict:
    """{"cstore", "dcstore": Buffer}: the stored C (held from stats to backward_dc) and dC (from
    backward_dc to backward_b), in the model's dtype (bf16 rounds where the release's bf16 path
    rounds the convolved scores)."""
    n = b * h * store_plane(tq, tk, q_off)
    return {"cstore": Buffer((n,), dtype, None), "dcstore": Buffer((n,), dtype, None)}


def pass_buffers(pass_: str, f: Frame, sched: frames.Schedule, n_prog: int, *, b: int, h: int, hp: int, tk: int,
                 dpad: int, pre, post, dtype: torch.dtype, margin: int = 0) -> dict:
    """{name: Buffer} a stored pass's launch allocates (besides the stored planes); dk and dv
    with ``margin`` zero rows in front of the keys, as the fused kernel's (``frames.margin``)."""
    acc, slots = frames.acc_dtype(dtype), b * sched.n_rt * sched.s_max
    progs = max(1, n_prog)
    n_tiles = sum(c1 - c0 for _, _, c0, c1, _ in sched.items)
    if pass_ == "backward_dc":
        out = {"dv": Buffer((b, h, margin + tk, dpad), acc, 0.0), "pw1": Buffer((progs, hp, hp), acc, 0.0),
               "pw2": Buffer((progs, hp, hp), acc, 0.0),
               **({"pt2": Buffer((progs, hp, *post), acc, 0.0)} if post else {})}
    elif pass_ == "backward_b":
        out = {"pdq": Buffer((slots, h, f.er, dpad), acc, 0.0), "dk": Buffer((b, h, margin + tk, dpad), acc, 0.0),
               **({"pt1": Buffer((progs, hp, *pre), acc, 0.0)} if pre else {})}
        out["tiles"] = Buffer((4 * n_tiles + n_prog + 1,), torch.int32, None)
        out["scratch"] = Buffer((n_prog * f.er * f.ec,), dtype, None)
        return out
    else:
        out = frames.pass_buffers(pass_, f, sched, n_prog, b=b, h=h, hp=hp, tk=tk, dpad=dpad, pre=pre, post=post,
                                  dtype=dtype, margin=margin)
        del out["tiles"], out["scratch"]
    nslot = scratch_slots(pass_, pre is not None, post is not None)["NSLOT"]
    out["tiles"] = Buffer((4 * n_tiles + n_prog + 1,), torch.int32, None)
    out["scratch"] = Buffer((n_prog * nslot * hp * f.er * f.ec,), dtype, None)
    return out


def backward_workspace_bytes(*, b: int, h: int, d: int, seq_len: int, pre, post, mix: tuple[bool, bool],
                             pad_key: str, dtype: torch.dtype, n_prog: int, gpu: bool = True,
                             tuning: KernelTuning = DEFAULT_TUNING) -> int:
    """Bytes the stored design holds beyond inputs, outputs and saved tensors at its largest
    moment (the backward_b launch): the derived inputs (``frames.problem_buffers``), D, both
    stored planes (C is saved from the forward: counted here, the pre-flight's stand-in keeps
    it as a saved tensor instead, see ``saved_plane_bytes``; dC), the backward_dc pass's
    results (dv, weight partials), the descriptor's copy of dO and the backward_b pass's
    buffers, under the model's ``tuning`` (its frames)."""
    hp, dpad = frames.padded_heads(h, gpu), frames.feature_parts(d)[1]
    ec = frame("backward_b", pre, post, pad_key, tuning).ec
    total = frames.nbytes(frames.problem_buffers(b=b, h=h, hp=hp, tq=seq_len, tk=seq_len, d=d, pre=pre, post=post,
                                                 mix=mix, pad_key=pad_key, ec=ec, dtype=dtype, gpu=gpu))
    total += b * h * seq_len * frames.acc_dtype(dtype).itemsize  # D
    total += frames.nbytes({"dcstore": stored_planes(b=b, h=h, tq=seq_len, tk=seq_len, q_off=0,
                                                     dtype=dtype)["dcstore"]})
    mg = frames.margin(pre, post, pad_key)
    if mg or dpad != d:
        total += b * h * (mg + seq_len) * dpad * dtype.itemsize  # dO's copy (``_Problem.padded``)
    for pass_ in ("backward_dc", "backward_b"):
        f = frame(pass_, pre, post, pad_key, tuning)
        sched = frames.items(f, b, seq_len, seq_len, 0, n_prog)
        bufs = pass_buffers(pass_, f, sched, len(sched.starts) - 1, b=b, h=h, hp=hp, tk=seq_len, dpad=dpad,
                            pre=pre, post=post, dtype=dtype, margin=mg)
        if pass_ == "backward_dc":
            del bufs["scratch"], bufs["tiles"]
        total += frames.nbytes(bufs)
    return total


def saved_plane_bytes(*, b: int, h: int, seq_len: int, dtype: torch.dtype) -> int:
    """The stored C plane one layer keeps from its forward to its backward."""
    return frames.nbytes({"c": stored_planes(b=b, h=h, tq=seq_len, tk=seq_len, q_off=0, dtype=dtype)["cstore"]})


def launch_config(pass_: str, pre: Optional[tuple], post: Optional[tuple]) -> tuple[int, int]:
    """(num_warps, num_stages): as the fused kernel's passes."""
    if pass_ not in PASSES:
        raise ValueError(f"unknown pass {pass_!r}; expected one of {PASSES}")
    return 8, 2
