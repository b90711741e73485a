"""Tile geometry and work schedule of ``model.attn_impl=triton`` (attention_triton.py),
without triton: the launcher, ``scripts/compile_triton.py`` (the static judge) and
``flops.py`` / ``memory.py`` all read it from here, so they describe what runs.

A pass of the fused kernel works on *tiles*: one (batch, row block, key block) cell block
for all heads at once. A tile is computed on a *frame* of ``er`` x ``ec`` cells (powers of
two): the owned ``bmo`` x ``bno`` block plus the halo that the pass's convolutions read
(``halo``); only owned values leave the tile, the halo is recomputed by the neighbours.
Passes without a convolution to apply have no halo (frame = owned block): the pre-softmax
key-query convolution is computed as a GEMM that needs no halo, so only the post-softmax
convolution (forward) and the adjoints (backward) widen frames.

Work items are (batch, row block, range of key blocks): the rows' tiles laid end to end are
cut into one contiguous run per program of the persistent grid, equal to the tile (``items``),
and an item is one row's share of a run; each item owns a slot of the
per-item partial buffers, which only its program adds into, and torch reduces the slots in
a fixed order after the launch (deterministic: no sum over programs for O, dq or the row
statistics; only dk and dv take atomics from several programs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from mta_repro.errors import UserError
from mta_repro.kernels.conv_pad import pad_left
from mta_repro.kernels.types import DEFAULT_TUNING, KernelTuning

# The kernel's passes, in the order they run (forward: 0, 1; backward: 2, 3).
PASSES = ("stats", "forward", "backward_rowsum", "backward")
# Persistent programs per SM on a GPU (each holds its scratch slots; registers allow one).
PROGRAMS_PER_SM = 1


# Default frames (a halo too wide for one doubles an edge): 128 rows, with 8 warps each of the
# two warpgroups owns 64 rows of a product (wgmma m64), so products, loads and stores share a
# layout (64-row frames split N between them and convert layouts at almost every hand-off);
# 128 key columns where no convolution runs (fewer accumulator adds per cell), 64 with one,
# whose passes would spill at 128 (scripts/compile_triton.py --frame; the
# figures are in docs/triton_kernel.md).
FRAME_ROWS = 128
FRAME_COLS = 128  # every pass of a layer without convolutions
FRAME_COLS_CONV = 64  # every pass of a layer with a key-query convolution
# Frame rows per head-mixing slab on a GPU: SR x ec cells x all heads per (cells, heads) x
# (heads, heads) tensor-core product; the interpreter takes whole frames (fewest interpreted
# ops). The mixing layer's backward takes one row of its 128 columns: at 2 or 4 rows it spills.
SLAB_ROWS_GPU = {"stats": 4, "forward": 4, "backward_rowsum": 4, "backward": 1}  # layers without convolutions
SLAB_ROWS_GPU_CONV = 4


def launch_config(pass_: str, pre: Optional[tuple[int, int]], post: Optional[tuple[int, int]]) -> tuple[int, int]:
    """(num_warps, num_stages) of a pass on a GPU: the one source for the launcher and
    scripts/compile_triton.py. 8 warps: two warpgroups, each owning 64 rows of a 128-row
    frame's products (wgmma m64). num_stages=2: the loops over row shifts and feature parts
    double-buffer their TMA tiles of the inputs; every loop that reads scratch written in the
    same tile says ``num_stages=1`` itself and is ordered by the barriers between phases."""
    if pass_ not in PASSES:
        raise ValueError(f"unknown pass {pass_!r}; expected one of {PASSES}")
    return 8, 2


@dataclass(frozen=True)
class Halo:
    top: int  # rows above the owned block (the post-softmax conv and the weight gradients look back)
    bot: int  # rows below (adjoints look forward)
    left: int
    right: int


def halo(pass_: str, pre: Optional[tuple[int, int]], post: Optional[tuple[int, int]], pad_key: str) -> Halo:
    """What the pass's convolutions read around the owned block, for kernels (c_q, c_k)
    ``pre``/``post`` softmax (None: off). L/R: a kernel's key taps left/right of the key."""
    cq1, ck1 = pre or (1, 1)
    cq2, ck2 = post or (1, 1)
    l1, l2 = pad_left(pad_key, ck1), pad_left(pad_key, ck2)
    r1, r2 = ck1 - 1 - l1, ck2 - 1 - l2
    h1, h2 = cq1 - 1, cq2 - 1
    if pass_ == "stats":  # Z on the owned block: the pre-softmax conv is a GEMM, no halo
        return Halo(0, 0, 0, 0)
    if pass_ == "forward":  # R = conv2(P) on the owned block: P around it
        return Halo(h2, 0, l2, r2)
    if pass_ == "backward_rowsum":  # dP = conv2^T(dR) on the owned block: dR below/beside it
        return Halo(0, h2, r2, l2)
    if pass_ == "backward":
        # dS = conv1^T(dC) on the owned block reads dC on owned + (h1 below, r1 left, l1 right);
        # dC there needs dP = conv2^T(dR), i.e. dR h2 rows further down and (r2, l2) beside.
        # The weight gradients and R = conv2(P) read P (S for the pre kernel) above/beside.
        return Halo(max(h1, h2) if (pre or post) else 0, h1 + h2,
                    max(r1 + r2, l1, l2, r1), max(l1 + l2, r1, r2, l1))
    raise ValueError(f"unknown pass {pass_!r}; expected one of {PASSES}")


def margin(pre: Optional[tuple[int, int]], post: Optional[tuple[int, int]], pad_key: str) -> int:
    """Rows before the sequence (and keys before 0) that any pass's descriptor copies reach:
    a frame's first row lies TOP rows above its owned block and the factorised pre-softmax
    conv reads c_q - 1 query rows above that; its first column LEFT keys left of its block.
    The launcher puts this many zero rows in front of every descriptor input (and of dk, dv),
    and the kernel adds it to every row coordinate, so no TMA coordinate is negative and rows
    outside the sequence are zero because they are padding, not by the copy's zero fill."""
    cq1 = pre[0] if pre else 1
    return max(max(h.top + cq1 - 1, h.left) for h in (halo(p, pre, post, pad_key) for p in PASSES))


@dataclass(frozen=True)
class Frame:
    er: int  # frame rows
    ec: int  # frame columns
    top: int  # halo rows above the owned block
    left: int  # halo columns left of it
    bmo: int  # owned rows
    bno: int  # owned columns


# The stages a pass hands between its phases through per-program scratch slots (HP x frame
# each, compute dtype): C scores (convolved), DA = dO V^T, S0 the raw masked scores (the pre
# kernel's gradient), P probabilities, DR/DP the post conv's output gradient and input
# gradient, R its output, DC the gradient of C, A the post-mixing probabilities.
STAGES = ("C", "DA", "S0", "P", "DR", "DP", "R", "DC", "A")


def scratch_slots(pass_: str, has_pre: bool, has_post: bool) -> dict:
    """{"S_<stage>": slot index or -1, "NSLOT": slots} of a pass: the kernel's constexprs."""
    need = {"stats": ["C"], "forward": ["C", "A"] + (["P", "R"] if has_post else []),
            "backward_rowsum": ["C", "DA"] + (["P", "DR", "DP"] if has_post else []),
            "backward": ["C", "DA", "DC", "A"] + (["S0"] if has_pre else []) + (["P", "DR", "DP", "R"] if has_post else [])}
    if pass_ not in need:
        raise ValueError(f"unknown pass {pass_!r}; expected one of {PASSES}")
    out = {f"S_{n}": -1 for n in STAGES}
    out.update({f"S_{n}": i for i, n in enumerate(need[pass_])})
    out["NSLOT"] = len(need[pass_])
    return out


def pow2(n: int) -> int:
    return 1 << max(0, int(n - 1).bit_length())


def frame_override(tuning: KernelTuning = DEFAULT_TUNING) -> Optional[tuple[int, int]]:
    """``model.kernels.triton_frame`` (ROWSxCOLS): the frame size instead of the default."""
    return tuning.triton_frame_shape


def frame(pass_: str, pre: Optional[tuple[int, int]], post: Optional[tuple[int, int]], pad_key: str,
          tuning: KernelTuning = DEFAULT_TUNING) -> Frame:
    """The frame of one pass for kernels (c_q, c_k) ``pre``/``post`` softmax (None: off),
    under the model's ``tuning``."""
    hl = halo(pass_, pre, post, pad_key)
    override = frame_override(tuning)
    if override is not None:
        er, ec = override
        if er <= hl.top + hl.bot or ec <= hl.left + hl.right:
            raise UserError(
                f"model.kernels.triton_frame={er}x{ec} leaves no owned block: the halo needs "
                f"{hl.top + hl.bot + 1}x{hl.left + hl.right + 1} at least")
    else:
        er, ec = FRAME_ROWS, (FRAME_COLS if pre is None and post is None else FRAME_COLS_CONV)
        # at least half of the frame owned in each direction
        while 2 * (hl.top + hl.bot) > er:
            er *= 2
        while 2 * (hl.left + hl.right) > ec:
            ec *= 2
    return Frame(er, ec, hl.top, hl.left, er - hl.top - hl.bot, ec - hl.left - hl.right)


def padded_heads(n_heads: int, gpu: bool = True) -> int:
    """HP: the head axis of the mixing products, a power of two; at least 16 on a GPU
    (a tensor-core product's inner dimension), at least 2 in the interpreter."""
    return max(pow2(n_heads), 16 if gpu else 2)


def feature_parts(d: int) -> tuple[int, int]:
    """(GP, DPAD): the head dimension in parts of GP features (32; 16 below 32), padded to
    DPAD = a whole number of parts (96 = 3 x 32: no padding for 64, 96 or 128). Every product
    over the head dimension runs part by part, so no tile is padded to the next power of two
    and one tensor descriptor per input serves every product."""
    gp = 32 if d >= 32 else 16
    return gp, -(-d // gp) * gp


def key_blocks(f: Frame, t: int, tq: int, tk: int, q_offset: int = 0) -> int:
    """Key blocks row block ``t`` needs: up to the one holding its last query."""
    last = min(tq, (t + 1) * f.bmo) - 1 + q_offset
    return min(-(-tk // f.bno), last // f.bno + 1)


@dataclass(frozen=True)
class Schedule:
    items: list  # (b, t, kb_first, kb_last, slot), grouped by program: program p runs items[starts[p]:starts[p+1]]
    n_rt: int  # row blocks
    s_max: int  # key splits of the longest row block (slots per row block)
    starts: tuple = ()  # n_prog + 1 offsets into items

    def programs(self) -> list:
        """The tile counts of each program's items, in order (the roofline's schedule)."""
        return [[c1 - c0 for _, _, c0, c1, _ in self.items[a:b]] for a, b in zip(self.starts, self.starts[1:])]

    def tiles(self) -> tuple[list, list]:
        """What the kernel walks: (b, t, key block, slot) of every tile, program by program in
        item order, and the n_prog + 1 offsets of each program's tiles."""
        rows, starts = [], [0]
        for a, z in zip(self.starts, self.starts[1:]):
            rows += [(b, t, c, slot) for b, t, c0, c1, slot in self.items[a:z] for c in range(c0, c1)]
            starts.append(len(rows))
        return rows, starts


def items(f: Frame, batch: int, tq: int, tk: int, q_offset: int, n_prog: int) -> Schedule:
    """Work items of a pass, balanced to the tile: the tiles of every (batch, row block), its
    key blocks in order, laid end to end in row order (N tiles in all) and cut into
    min(n_prog, N) contiguous runs of floor or ceil(N / programs) tiles, one run per program.
    An item is one row's share of one run (the end of a row, a whole row or its start; a long
    row spans several runs, so B=1 fills the GPU), and takes the next partial slot of its row.
    No program carries more than one tile above another's (a list schedule of whole items,
    longest first, left up to a tenth more on the longest program), and a row is cut into at
    most ceil(its tiles / run) + 1 items, so the per-item partial slots stay few."""
    n_rt = -(-tq // f.bmo)
    per_row = [key_blocks(f, t, tq, tk, q_offset) for t in range(n_rt)]
    total = batch * sum(per_row)
    n = max(1, min(n_prog, total))
    bounds = [p * total // n for p in range(n + 1)]  # program p runs tiles [bounds[p], bounds[p + 1])
    per_prog: list = [[] for _ in range(n)]
    p, g = 0, 0  # the program that holds tile g of the concatenation
    for b in range(batch):
        for t, n_tiles in enumerate(per_row):
            c, s = 0, 0
            while c < n_tiles:
                while bounds[p + 1] <= g:
                    p += 1
                take = min(n_tiles - c, bounds[p + 1] - g)
                per_prog[p].append((b, t, c, c + take, s))
                c, g, s = c + take, g + take, s + 1
    s_max = max([it[4] + 1 for lst in per_prog for it in lst], default=1)
    starts = [0]
    for lst in per_prog:
        starts.append(starts[-1] + len(lst))
    return Schedule([(b, t, c0, c1, (b * n_rt + t) * s_max + s) for lst in per_prog for b, t, c0, c1, s in lst],
                    n_rt, s_max, tuple(starts))


def cells_visited(f: Frame, tq: int, tk: int, q_offset: int = 0) -> int:
    """Frame cells one (batch, head) pass computes: every row block's frames, over the key
    blocks up to the one holding its last query (the kernel's causal skipping)."""
    return sum(f.er * f.ec * key_blocks(f, t, tq, tk, q_offset) for t in range(-(-tq // f.bmo)))


# ------------------------------------------------------------------ workspace
# What a launch allocates, in one place: ``attention_triton._launch`` allocates from
# ``pass_buffers`` and the memory pre-flight (``mta_repro.estimate.memory``) sums
# ``backward_workspace_bytes``, so the two cannot drift apart.


class Buffer(NamedTuple):
    shape: tuple
    dtype: torch.dtype
    fill: Optional[float]  # None: torch.empty (every cell is written before it is read)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulators' dtype of inputs of ``dtype``: fp64 for fp64 (the interpreter's
    checks), fp32 otherwise. Scratch is in the inputs' dtype."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def pass_buffers(pass_: str, f: Frame, sched: Schedule, n_prog: int, *, b: int, h: int, hp: int, tk: int, dpad: int,
                 pre: Optional[tuple[int, int]], post: Optional[tuple[int, int]], dtype: torch.dtype,
                 margin: int = 0) -> dict:
    """{name: Buffer} a pass's launch allocates: its per-item partials (slots = B x row
    blocks x key splits; DPAD features so their rows suit a tensor descriptor), the
    backward's dk/dv (keys after ``margin`` rows: ``margin``) and per-program weight-gradient
    partials, and the per-program scratch slots of its stages (``scratch_slots``)."""
    acc, slots = acc_dtype(dtype), b * sched.n_rt * sched.s_max
    progs = max(1, n_prog)
    out = {
        "stats": lambda: {"pm": Buffer((slots, hp, f.er), acc, float("-inf")), "pl": Buffer((slots, hp, f.er), acc, 0.0)},
        "forward": lambda: {"po": Buffer((slots, h, f.er, dpad), acc, 0.0)},
        "backward_rowsum": lambda: {"pd": Buffer((slots, hp, f.er), acc, 0.0)},
        "backward": lambda: {
            "pdq": Buffer((slots, h, f.er, dpad), acc, 0.0), "dk": Buffer((b, h, margin + tk, dpad), acc, 0.0),
            "dv": Buffer((b, h, margin + tk, dpad), acc, 0.0), "pw1": Buffer((progs, hp, hp), acc, 0.0),
            "pw2": Buffer((progs, hp, hp), acc, 0.0),
            **({"pt1": Buffer((progs, hp, *pre), acc, 0.0)} if pre else {}),
            **({"pt2": Buffer((progs, hp, *post), acc, 0.0)} if post else {})},
    }[pass_]()
    nslot = scratch_slots(pass_, pre is not None, post is not None)["NSLOT"]
    n_tiles = sum(c1 - c0 for _, _, c0, c1, _ in sched.items)
    out["tiles"] = Buffer((4 * n_tiles + n_prog + 1,), torch.int32, None)  # Schedule.tiles(), as the kernel walks it
    out["scratch"] = Buffer((n_prog * nslot * hp * f.er * f.ec,), dtype, None)
    return out


def nbytes(bufs: dict) -> int:
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in bufs.values())


def problem_buffers(*, b: int, h: int, hp: int, tq: int, tk: int, d: int, pre: Optional[tuple[int, int]],
                    post: Optional[tuple[int, int]], mix: tuple[bool, bool], pad_key: str, ec: int,
                    dtype: torch.dtype, gpu: bool = True) -> dict:
    """{name: Buffer} of what one call derives from its inputs and holds through its passes
    (``attention_triton._Problem``): the keys convolved with each pre-softmax kernel row
    (B x H x c_q planes of ``margin`` + T rows of DPAD features, as its descriptor reads them), the causal band
    correction (B, H, Tq, NB), the convolutions' Toeplitz tables (HP x c_q x EC, EC) of a
    pass whose frames are ``ec`` wide, the (HP, HP) head-mixing matrices (``mix``: pre- and
    post-softmax mixing on) and the descriptors' copies of q, k, v (DPAD features, ``margin``
    zero rows in front of each plane)."""
    acc, dpad, mg = acc_dtype(dtype), feature_parts(d)[1], margin(pre, post, pad_key)
    out = {"dummy": Buffer((1,), acc, None)}  # the argument of every pointer a pass does not use: never read
    if pre is not None:
        cq, ck = pre
        out["khat"] = Buffer((b * h * cq, mg + tk, dpad), dtype, None)
        out["band"] = Buffer((b, h, tq, cq - 1 + ck - 1 - pad_left(pad_key, ck)), acc, None)  # band_width
    out.update({name: Buffer((hp, hp), acc, None) for name, on in zip(("w1t", "w2t"), mix) if on})
    table_dtype = dtype if gpu else acc
    for name, k in (("ta1", pre), ("tf2", post), ("ta2", post)):
        if k is not None:
            out[name] = Buffer((hp * k[0] * ec, ec), table_dtype, None)
    if mg or dpad != d:  # (no copies without either)
        out["padded_qkv"] = Buffer((b * h, 3 * mg + tq + 2 * tk, dpad), dtype, None)
    return out


def backward_workspace_bytes(*, b: int, h: int, d: int, seq_len: int, pre: Optional[tuple[int, int]],
                             post: Optional[tuple[int, int]], mix: tuple[bool, bool], pad_key: str,
                             dtype: torch.dtype, n_prog: int, gpu: bool = True,
                             tuning: KernelTuning = DEFAULT_TUNING) -> int:
    """Bytes the fused kernel holds beyond its inputs, outputs and saved tensors while its
    backward pass runs (its largest moment): the call's derived inputs, the descriptor's copy
    of dO, the rowsum pass's partials and their per-row reduction D (B, H, T) fp32, and the
    backward pass's own buffers. ``n_prog``: persistent programs (``PROGRAMS_PER_SM`` x SMs on
    a GPU); ``tuning``: the model's (its frame)."""
    hp, dpad = padded_heads(h, gpu), feature_parts(d)[1]
    ec = frame("backward", pre, post, pad_key, tuning).ec
    total = nbytes(problem_buffers(b=b, h=h, hp=hp, tq=seq_len, tk=seq_len, d=d, pre=pre, post=post, mix=mix,
                                   pad_key=pad_key, ec=ec, dtype=dtype, gpu=gpu))
    total += b * h * seq_len * acc_dtype(dtype).itemsize  # D
    mg = margin(pre, post, pad_key)
    if mg or dpad != d:
        total += b * h * (mg + seq_len) * dpad * dtype.itemsize  # dO's copy (``_Problem.padded``)
    for pass_ in ("backward_rowsum", "backward"):
        f = frame(pass_, pre, post, pad_key, tuning)
        sched = items(f, b, seq_len, seq_len, 0, n_prog)
        bufs = pass_buffers(pass_, f, sched, len(sched.starts) - 1, b=b, h=h, hp=hp, tk=seq_len, dpad=dpad,
                            pre=pre, post=post, dtype=dtype, margin=mg)
        if pass_ == "backward_rowsum":  # freed when its launch returns; its partials stay
            del bufs["scratch"], bufs["tiles"]
        total += nbytes(bufs)
    return total
