"""Tile geometry of ``model.attn_impl=triton`` (attention_triton.py), without triton.

A pass of the fused kernel gives each program ``bmo`` owned query rows and walks the keys
in blocks of ``bno`` owned columns; it computes on a frame of ``er`` x ``ec`` cells (powers of
two): the owned block plus the halo the convolutions of that pass read (``top``/``bot``
rows, ``left``/``right`` columns). Also used by flops.py to count the cells the kernel
visits, so MFU counts the work it does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from mta_repro.errors import UserError
from mta_repro.model.conv_pad import pad_left  # noqa: F401 (frames.pad_left for the launcher)

# The kernel's passes, in the order they run (forward: 0, 1; backward: 2, 3).
PASSES = ("stats", "forward", "backward_rowsum", "backward")
# Scratch slots per program, and programs per SM of the persistent grid on a GPU.
N_SLOTS = 7
PROGRAMS_PER_SM = 4


def launch_config(pass_: str, pre: Optional[tuple[int, int]], post: Optional[tuple[int, int]]) -> tuple[int, int]:
    """(num_warps, num_stages) of a pass on a GPU: the one source for the launcher and
    scripts/compile_triton.py, so the report describes what runs. 8 warps: at 4 the mixing
    backward spills and the kq-conv backward's compile does not finish in minutes.
    1 stage: no loop of this kernel may be software-pipelined, since each one hands data
    to the next through the scratch slots (a prefetched reload would read stale cells);
    the loops also say so themselves (``tl.range(..., num_stages=1)``)."""
    if pass_ not in PASSES:
        raise ValueError(f"unknown pass {pass_!r}; expected one of {PASSES}")
    return 8, 1


def gpu_chunks(hp: int, er: int) -> tuple[int, int]:
    """(heads per chunk, frame rows per mixing slab) on a GPU: registers and shared memory
    (``scripts/compile_triton.py``); the interpreter takes whole tiles."""
    return 1, min(er, 4)


@dataclass(frozen=True)
class Frame:
    er: int  # frame rows
    ec: int  # frame columns
    top: int  # halo rows above the owned block
    left: int  # halo columns left of it
    bmo: int  # owned rows
    bno: int  # owned columns


def pow2(n: int) -> int:
    return 1 << max(0, int(n - 1).bit_length())


def frame_override() -> Optional[tuple[int, int]]:
    """``MTA_TRITON_FRAME=ROWSxCOLS``: the frame size instead of the default."""
    spec = os.environ.get("MTA_TRITON_FRAME")
    if not spec:
        return None
    try:
        er, ec = (int(x) for x in spec.lower().split("x"))
    except ValueError:
        raise UserError(f"MTA_TRITON_FRAME={spec!r}: expected ROWSxCOLS, e.g. 64x64") from None
    if er < 1 or ec < 1 or er != pow2(er) or ec != pow2(ec):
        raise UserError(f"MTA_TRITON_FRAME={spec!r}: both sizes must be powers of two")
    return er, ec


def frame(pass_: str, pre: Optional[tuple[int, int]], post: Optional[tuple[int, int]], pad_key: str,
          min_own: int = 16) -> Frame:
    """The frame of one pass for kernels of (c_q, c_k) ``pre``/``post`` softmax (None: off)."""
    cq1, ck1 = pre or (1, 1)
    cq2, ck2 = post or (1, 1)
    h1, h2 = cq1 - 1, cq2 - 1
    l1, l2 = pad_left(pad_key, ck1), pad_left(pad_key, ck2)
    r1, r2 = ck1 - 1 - l1, ck2 - 1 - l2
    if pass_ == "stats":  # Z on the owned block
        top, bot, left, right = h1, 0, l1, r1
    elif pass_ == "forward":  # R on the owned block: P around it, S around that
        top, bot, left, right = h1 + h2, 0, l1 + l2, r1 + r2
    elif pass_ in ("backward_rowsum", "backward"):
        # dS on the owned block reads dC below/beside it (adjoint shifts), whose P reads S
        # and whose dP reads dR further on; the weight gradients read P and S above/beside it.
        top = bot = h1 + h2
        left = max(r1 + l1, r1 + r2, l2 + l1)
        right = max(l1 + r1, l1 + l2, r2 + r1)
    else:
        raise ValueError(f"unknown pass {pass_!r}; expected one of {PASSES}")
    override = frame_override()
    if override is not None:
        er, ec = override
        if er <= top + bot or ec <= left + right:
            raise UserError(
                f"MTA_TRITON_FRAME={er}x{ec} leaves no owned block: the halo needs "
                f"{top + bot + 1}x{left + right + 1} at least")
    else:
        er = max(16, pow2(top + bot + min_own))
        ec = max(16, pow2(left + right + min_own))
    return Frame(er, ec, top, left, er - top - bot, ec - left - right)


def padded_heads(n_heads: int) -> int:
    """HP: the head axis of the kernel's tiles (a power of two, at least 2)."""
    return max(pow2(n_heads), 2)


def margins(pre: Optional[tuple[int, int]], post: Optional[tuple[int, int]]) -> tuple[int, int]:
    """Zero rows and columns around each scratch slot's frame: the largest shift a
    convolution (or its adjoint) reads."""
    cq, ck = max((pre or (1, 1))[0], (post or (1, 1))[0]), max((pre or (1, 1))[1], (post or (1, 1))[1])
    return cq - 1, ck - 1


def slot_elements(f: Frame, pre, post, n_heads: int) -> int:
    """Elements of one scratch slot: all (padded) heads x the frame with its margins."""
    mr, mc = margins(pre, post)
    return padded_heads(n_heads) * (f.er + 2 * mr) * (f.ec + 2 * mc)


def cells_visited(f: Frame, tq: int, tk: int, q_offset: int = 0) -> int:
    """Frame cells one (batch, head) pass computes: every row block's frames, over the key
    blocks up to the one holding its last query (the kernel's causal skipping)."""
    return sum(f.er * f.ec * key_blocks(f, t, tq, tk, q_offset) for t in range(-(-tq // f.bmo)))


def key_blocks(f: Frame, t: int, tq: int, tk: int, q_offset: int = 0) -> int:
    """Key blocks row block ``t`` walks: up to the one holding its last query."""
    last = min(tq, (t + 1) * f.bmo) - 1 + q_offset
    return min(-(-tk // f.bno), last // f.bno + 1)
