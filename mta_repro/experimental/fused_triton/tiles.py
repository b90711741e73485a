"""Tile geometry, work schedule and buffers of both kernels of ``model.attn_impl=triton``,
without triton: the launchers, ``compile_report.py`` (the static judge) and the estimates
(``impl.py``: workspace and FLOPs) all read them from here, so they describe what runs.

A layer's design follows from its kernels (``design``): a kq-conv layer (a pre-softmax
kernel) runs the stored-scores kernels (``stored.py``: ``STORED_PASSES``), every other layer
the fused kernel (``fused.py``: ``FUSED_PASSES``). Every function takes the pass by name and
the layer's kernels, (c_q, c_k) before/after softmax or None.

A pass works on *tiles*: one (batch, row block, key block) cell block for all heads at once.
A tile is computed on a *frame* of ``er`` x ``ec`` cells (powers of two): the owned ``bmo``
x ``bno`` block plus the halo that the pass's convolutions read (``halo``); only owned
values leave the tile, the halo is recomputed by the neighbours.

Work items are (batch, row block, range of key blocks): the rows' tiles laid end to end are
cut into one contiguous run per program of the persistent grid, equal to the tile
(``items``), and an item is one row's share of a run; each item owns a slot of the per-item
partial buffers, which only its program adds into, and torch reduces the slots in a fixed
order after the launch (deterministic: no sum over programs for O, dq or the row statistics;
only dk and dv take atomics from several programs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from mta_repro.errors import UserError
from mta_repro.experimental.fused_triton import options
from mta_repro.kernels.interface import pad_left
from mta_repro.kernels.tuning import DEFAULT_TUNING, KernelTuning

Kernel = tuple[int, int] | None  # a key-query convolution's (c_q, c_k), None: off

# The fused kernel's passes, in the order they run (forward: 0, 1; backward: 2, 3).
FUSED_PASSES = ("stats", "forward", "backward_rowsum", "backward")
# The stored design's launches: stats (C stored, the rows' statistics), forward (from C),
# kernel A as backward_rowsum (D) and backward_dc (dC stored, dv, the mixings' and the post
# kernel's gradients), kernel B as backward_b (dq, dk, the pre kernel's gradient from dC).
STORED_PASSES = ("stats", "forward", "backward_rowsum", "backward_dc", "backward_b")
# Persistent programs per SM on a GPU (each holds its scratch slots; registers allow one).
PROGRAMS_PER_SM = 1


def design(pre: Kernel) -> str:
    """``stored`` for a kq-conv layer (a pre-softmax kernel), ``fused`` for every other."""
    return "fused" if pre is None else "stored"


def passes(pre: Kernel) -> tuple:
    """The passes of the layer's design, in launch order."""
    return FUSED_PASSES if pre is None else STORED_PASSES


def _check_pass(pass_: str, pre: Kernel) -> None:
    if pass_ not in passes(pre):
        raise ValueError(f"unknown pass {pass_!r} of the {design(pre)} design; expected one of {passes(pre)}")


# Default frames (a halo too wide for one doubles an edge): 128 rows, with 8 warps each of the
# two warpgroups owns 64 rows of a product (wgmma m64), so products, loads and stores share a
# layout (64-row frames split N between them and convert layouts at almost every hand-off);
# 128 key columns where no convolution runs (fewer accumulator adds per cell), 64 with one,
# whose passes would spill at 128 (compile_report.py --frame; the figures are in design.md).
FRAME_ROWS = 128
FRAME_COLS = 128  # every pass of a layer without convolutions
FRAME_COLS_CONV = 64  # every pass of a layer with a key-query convolution
# Kernel B's frame (no all-heads scratch): 256 x 64, estimated 1.367 ms against 1.432 ms at
# 128 x 64 (T = 2048, B = 4; 0 spills, 248 registers); 128 x 128 spilled 1,312 B (1.500 ms)
FRAME_B = (256, 64)
# Frame rows per head-mixing slab on a GPU: SR x ec cells x all heads per (cells, heads) x
# (heads, heads) tensor-core product; the interpreter takes whole frames (fewest interpreted
# ops). The mixing layer's backward takes one row of its 128 columns: at 2 or 4 rows it spills.
SLAB_ROWS_GPU = {"stats": 4, "forward": 4, "backward_rowsum": 4, "backward": 1}  # layers without convolutions
SLAB_ROWS_GPU_CONV = 4
# backward_dc's slab rows on a GPU: 2 rows spill 8 B where 4 spill 72 B (8: 120 B), the same estimate
SLAB_ROWS_DC = 2


def launch_config(pass_: str, pre: Kernel, post: Kernel) -> tuple[int, int]:
    """(num_warps, num_stages) of a pass on a GPU: the one source for the launchers and
    compile_report.py. 8 warps: two warpgroups, each owning 64 rows of a 128-row frame's
    products (wgmma m64). num_stages=2: the loops over row shifts and feature parts
    double-buffer their TMA tiles of the inputs; every loop that reads scratch written in the
    same tile says ``num_stages=1`` itself and is ordered by the barriers between phases."""
    _check_pass(pass_, pre)
    return 8, 2


@dataclass(frozen=True)
class Halo:
    top: int  # rows above the owned block (convolutions and the weight gradients look back)
    bot: int  # rows below (adjoints look forward)
    left: int
    right: int


def halo(pass_: str, pre: Kernel, post: Kernel, pad_key: str) -> Halo:
    """What the pass's convolutions read around the owned block, for kernels (c_q, c_k)
    ``pre``/``post`` softmax (None: off). L/R: a kernel's key taps left/right of the key."""
    _check_pass(pass_, pre)
    cq1, ck1 = pre or (1, 1)
    cq2, ck2 = post or (1, 1)
    l1, l2 = pad_left(pad_key, ck1), pad_left(pad_key, ck2)
    r1, r2 = ck1 - 1 - l1, ck2 - 1 - l2
    h1, h2 = cq1 - 1, cq2 - 1
    if pass_ == "stats":  # C = conv1(S0) on the owned block: S0 h1 rows above, l1 left, r1 right
        return Halo(h1, 0, l1, r1)
    if pass_ == "forward":  # R = conv2(P) on the owned block: P around it
        return Halo(h2, 0, l2, r2)
    if pass_ == "backward_rowsum":  # dP = conv2^T(dR) on the owned block: dR below/beside it
        return Halo(0, h2, r2, l2)
    if pass_ == "backward_b":  # dS0 = conv1^T(dC) on the owned block: dC h1 rows below, r1 left, l1 right
        return Halo(0, h1, r1, l1)
    # backward / backward_dc: dC on the owned block needs dP there (dR h2 rows below, r2/l2
    # beside) and R = conv2(P) there (P h2 rows above)
    return Halo(h2, h2, max(r2, l2), max(l2, r2))


def margin(pre: Kernel, post: Kernel, pad_key: str) -> int:
    """Rows before the sequence (and keys before 0) that any pass's descriptor copies reach:
    a frame's first row lies TOP rows above its owned block, its first column LEFT keys left
    of its block. The launcher puts this many zero rows in front of every descriptor input
    (and of dk, dv), and the kernel adds it to every row coordinate, so no TMA coordinate is
    negative and rows outside the sequence are zero because they are padding, not by the
    copy's zero fill."""
    return max(max(h.top, h.left) for h in (halo(p, pre, post, pad_key) for p in passes(pre)))


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
# kernel's input), P probabilities, DR/DP the post conv's output gradient and input
# gradient, R its output, DC the gradient of C, A the post-mixing probabilities.
STAGES = ("C", "DA", "S0", "P", "DR", "DP", "R", "DC", "A")


def scratch_slots(pass_: str, has_pre: bool, has_post: bool) -> dict:
    """{"S_<stage>": slot index or -1, "NSLOT": slots} of a pass: the kernel's constexprs.
    backward_dc writes dC to its store, not a slot; backward_b has no slots of all heads (one
    plane per program, ``pass_buffers``)."""
    pre = (1, 1) if has_pre else None
    _check_pass(pass_, pre)
    post_fwd, post_bwd = (["P", "R"], ["P", "DR", "DP"]) if has_post else ([], [])
    need = {
        "stats": ["C", "S0"] if has_pre else ["C"],
        "forward": ["C", "A"] + post_fwd,
        "backward_rowsum": ["C", "DA"] + post_bwd,
        "backward": ["C", "DA", "DC", "A"] + post_bwd + post_fwd[1:],
        "backward_dc": ["C", "DA", "A"] + post_bwd + post_fwd[1:],
        "backward_b": [],
    }[pass_]
    out = {f"S_{n}": -1 for n in STAGES}
    out.update({f"S_{n}": i for i, n in enumerate(need)})
    out["NSLOT"] = len(need)
    return out


def pow2(n: int) -> int:
    return 1 << max(0, int(n - 1).bit_length())


def frame(pass_: str, pre: Kernel, post: Kernel, pad_key: str, tuning: KernelTuning = DEFAULT_TUNING) -> Frame:
    """The frame of one pass for kernels (c_q, c_k) ``pre``/``post`` softmax (None: off),
    under the model's ``tuning`` (``model.kernels.impl_options.triton.frame`` overrides the
    default)."""
    hl = halo(pass_, pre, post, pad_key)
    opts = options.of(tuning)
    override = opts.frame_shape
    if override is not None:
        er, ec = override
        if er <= hl.top + hl.bot or ec <= hl.left + hl.right:
            raise UserError(
                f"{opts.where}.frame={er}x{ec} leaves no owned block: the {pass_} pass's halo needs "
                f"{hl.top + hl.bot + 1}x{hl.left + hl.right + 1} at least"
            )
    else:
        if pass_ == "backward_b":
            er, ec = FRAME_B
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
class TileSchedule:
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


def items(f: Frame, batch: int, tq: int, tk: int, q_offset: int, n_prog: int) -> TileSchedule:
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
    return TileSchedule(
        [(b, t, c0, c1, (b * n_rt + t) * s_max + s) for lst in per_prog for b, t, c0, c1, s in lst],
        n_rt,
        s_max,
        tuple(starts),
    )


def cells_visited(f: Frame, tq: int, tk: int, q_offset: int = 0) -> int:
    """Frame cells one (batch, head) pass computes: every row block's frames, over the key
    blocks up to the one holding its last query (the kernel's causal skipping)."""
    return sum(f.er * f.ec * key_blocks(f, t, tq, tk, q_offset) for t in range(-(-tq // f.bmo)))


# ------------------------------------------------------------------ the stored planes
def store_rows(tq: int, tk: int, q_off: int) -> list:
    """(Tq + 1) offsets of the rows of one packed plane of C or dC: row i keeps keys
    0 .. min(Tk, i + q_off + 1) - 1, the causal cells."""
    out = [0]
    for i in range(tq):
        out.append(out[-1] + max(0, min(tk, i + q_off + 1)))
    return out


def store_plane(tq: int, tk: int, q_off: int) -> int:
    """Elements of one packed (batch, head) plane."""
    return sum(max(0, min(tk, i + q_off + 1)) for i in range(tq))


# ------------------------------------------------------------------ workspace
# What a launch allocates, in one place: the launchers allocate from ``pass_buffers`` and
# ``stored_planes``, and the memory pre-flight sums ``backward_workspace_bytes`` (through
# ``impl.py``), so the two cannot drift apart.


class Buffer(NamedTuple):
    shape: tuple
    dtype: torch.dtype
    fill: float | None  # None: torch.empty (every cell is written before it is read)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulators' dtype of inputs of ``dtype``: fp64 for fp64 (the interpreter's
    checks), fp32 otherwise. Scratch is in the inputs' dtype."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def stored_planes(*, b: int, h: int, tq: int, tk: int, q_off: int, dtype: torch.dtype) -> dict:
    """{"cstore", "dcstore": Buffer}: the stored C (held from stats to backward_dc) and dC (from
    backward_dc to backward_b), in the model's dtype (bf16 rounds where the release's bf16 path
    rounds the convolved scores)."""
    n = b * h * store_plane(tq, tk, q_off)
    return {"cstore": Buffer((n,), dtype, None), "dcstore": Buffer((n,), dtype, None)}


def pass_buffers(
    pass_: str,
    f: Frame,
    sched: TileSchedule,
    n_prog: int,
    *,
    b: int,
    h: int,
    hp: int,
    tk: int,
    dpad: int,
    pre: Kernel,
    post: Kernel,
    dtype: torch.dtype,
    margin: int = 0,
) -> dict:
    """{name: Buffer} a pass's launch allocates (the stored planes apart): its per-item
    partials (slots = B x row blocks x key splits; DPAD features so their rows suit a tensor
    descriptor), the backward's dk/dv (keys after ``margin`` rows: ``margin``) and
    per-program weight-gradient partials, the schedule's tiles and the per-program scratch
    slots of its stages (``scratch_slots``; kernel B: one plane per program)."""
    _check_pass(pass_, pre)
    acc, slots = acc_dtype(dtype), b * sched.n_rt * sched.s_max
    progs = max(1, n_prog)

    def keys():
        return Buffer((b, h, margin + tk, dpad), acc, 0.0)

    def kernel_grad(name, k):
        return {name: Buffer((progs, hp, *k), acc, 0.0)} if k else {}

    mixing_grads = {"pw1": Buffer((progs, hp, hp), acc, 0.0), "pw2": Buffer((progs, hp, hp), acc, 0.0)}
    out = {
        "stats": lambda: {
            "pm": Buffer((slots, hp, f.er), acc, float("-inf")),
            "pl": Buffer((slots, hp, f.er), acc, 0.0),
        },
        "forward": lambda: {"po": Buffer((slots, h, f.er, dpad), acc, 0.0)},
        "backward_rowsum": lambda: {"pd": Buffer((slots, hp, f.er), acc, 0.0)},
        "backward": lambda: {
            "pdq": Buffer((slots, h, f.er, dpad), acc, 0.0),
            "dk": keys(),
            "dv": keys(),
            **mixing_grads,
            **kernel_grad("pt2", post),
        },
        "backward_dc": lambda: {"dv": keys(), **mixing_grads, **kernel_grad("pt2", post)},
        "backward_b": lambda: {
            "pdq": Buffer((slots, h, f.er, dpad), acc, 0.0),
            "dk": keys(),
            **kernel_grad("pt1", pre),
        },
    }[pass_]()
    n_tiles = sum(c1 - c0 for _, _, c0, c1, _ in sched.items)
    out["tiles"] = Buffer(
        (4 * n_tiles + n_prog + 1,), torch.int32, None
    )  # TileSchedule.tiles(), as the kernel walks it
    if pass_ == "backward_b":
        out["scratch"] = Buffer((n_prog * f.er * f.ec,), dtype, None)
    else:
        nslot = scratch_slots(pass_, pre is not None, post is not None)["NSLOT"]
        out["scratch"] = Buffer((n_prog * nslot * hp * f.er * f.ec,), dtype, None)
    return out


def nbytes(bufs: dict) -> int:
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in bufs.values())


def problem_buffers(
    *,
    b: int,
    h: int,
    hp: int,
    tq: int,
    tk: int,
    d: int,
    pre: Kernel,
    post: Kernel,
    mix: tuple[bool, bool],
    pad_key: str,
    ec: int,
    dtype: torch.dtype,
    gpu: bool = True,
) -> dict:
    """{name: Buffer} of what one call derives from its inputs and holds through its passes
    (``launch.Problem``): the convolutions' Toeplitz tables (HP x c_q x EC, EC) of a pass
    whose frames are ``ec`` wide (the pre kernel's adjoint, the post kernel and its adjoint),
    the (HP, HP) head-mixing matrices (``mix``: pre- and post-softmax mixing on) and the
    descriptors' copies of q, k, v (DPAD features, ``margin`` zero rows in front of each plane)."""
    dpad, mg = feature_parts(d)[1], margin(pre, post, pad_key)
    # "dummy": the argument of every pointer a pass does not use: never read
    out = {"dummy": Buffer((1,), acc_dtype(dtype), None)}
    out.update({name: Buffer((hp, hp), acc_dtype(dtype), None) for name, on in zip(("w1t", "w2t"), mix) if on})
    table_dtype = dtype if gpu else acc_dtype(dtype)
    for name, k in (("ta1", pre), ("tf2", post), ("ta2", post)):
        if k is not None:
            out[name] = Buffer((hp * k[0] * ec, ec), table_dtype, None)
    if mg or dpad != d:  # (no copies without either)
        out["padded_qkv"] = Buffer((b * h, 3 * mg + tq + 2 * tk, dpad), dtype, None)
    return out


def backward_workspace_bytes(
    *,
    b: int,
    h: int,
    d: int,
    seq_len: int,
    pre: Kernel,
    post: Kernel,
    mix: tuple[bool, bool],
    pad_key: str,
    dtype: torch.dtype,
    n_prog: int,
    gpu: bool = True,
    tuning: KernelTuning = DEFAULT_TUNING,
) -> int:
    """Bytes a layer's kernels hold beyond their inputs, outputs and saved tensors while the
    backward runs (its largest moment, the last launch): the call's derived inputs, the
    descriptor's copy of dO, the per-row reduction D (B, H, T) of the rowsum pass, and
    - fused: that pass's partials and the backward pass's own buffers;
    - stored: the dC plane, the backward_dc pass's results (dv, weight partials) and the
      backward_b pass's buffers (C is a saved tensor, ``saved_plane_bytes``).
    ``n_prog``: persistent programs (``PROGRAMS_PER_SM`` x SMs on a GPU); ``tuning``: the
    model's (its frames)."""
    hp, dpad = padded_heads(h, gpu), feature_parts(d)[1]
    first, last = passes(pre)[-2:]  # (the passes of the backward's largest moment)
    if pre is not None:
        first = "backward_dc"
    ec = frame(last, pre, post, pad_key, tuning).ec
    total = nbytes(
        problem_buffers(
            b=b,
            h=h,
            hp=hp,
            tq=seq_len,
            tk=seq_len,
            d=d,
            pre=pre,
            post=post,
            mix=mix,
            pad_key=pad_key,
            ec=ec,
            dtype=dtype,
            gpu=gpu,
        )
    )
    total += b * h * seq_len * acc_dtype(dtype).itemsize  # D
    if pre is not None:
        total += nbytes({"dcstore": stored_planes(b=b, h=h, tq=seq_len, tk=seq_len, q_off=0, dtype=dtype)["dcstore"]})
    mg = margin(pre, post, pad_key)
    if mg or dpad != d:
        total += b * h * (mg + seq_len) * dpad * dtype.itemsize  # dO's copy (``Problem.padded``)
    for pass_ in (first, last):
        f = frame(pass_, pre, post, pad_key, tuning)
        sched = items(f, b, seq_len, seq_len, 0, n_prog)
        bufs = pass_buffers(
            pass_,
            f,
            sched,
            len(sched.starts) - 1,
            b=b,
            h=h,
            hp=hp,
            tk=seq_len,
            dpad=dpad,
            pre=pre,
            post=post,
            dtype=dtype,
            margin=mg,
        )
        if pass_ == first:  # freed when its launch returns; its results stay
            del bufs["scratch"], bufs["tiles"]
        total += nbytes(bufs)
    return total


def saved_plane_bytes(*, b: int, h: int, seq_len: int, dtype: torch.dtype) -> int:
    """The stored C plane a kq-conv layer keeps from its forward to its backward."""
    return nbytes({"c": stored_planes(b=b, h=h, tq=seq_len, tk=seq_len, q_off=0, dtype=dtype)["cstore"]})
