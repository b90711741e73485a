"""The host side both kernels share (``fused.py``, ``stored.py``): one call's derived inputs
(``Problem``), the launchers' one allocator (``empty``), the tensor descriptors, the
constexprs of a pass and the reduction of per-item partials after a launch.

``empty`` is the seam the tests use: every buffer a launch allocates comes from it, so a
test can fill them all with NaN and prove that nothing is read before it is written
(tests/experimental/conftest.py, tests/experimental/test_kernel_hazards.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from mta_repro.errors import UserError
from mta_repro.experimental.fused_triton import options, tiles
from mta_repro.kernels.interface import pad_left
from mta_repro.kernels.tuning import DEFAULT_TUNING, KernelTuning


def toeplitz(theta: torch.Tensor, ec: int, hp: int, adjoint: bool, off: int) -> torch.Tensor:
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


def dtypes(dtype: torch.dtype, device: torch.device):
    """(dot operand type, accumulator type, tl.dot precision, scratch dtype) for inputs of
    ``dtype``. The interpreter computes 16-bit dots wrongly, so there they run on fp32."""
    if dtype == torch.float64:
        return tl.float64, tl.float64, "ieee", torch.float64
    if device.type == "cpu":
        return tl.float32, tl.float32, "ieee", dtype
    if dtype == torch.float32:
        return tl.float32, tl.float32, "tf32", torch.float32
    return (tl.bfloat16 if dtype == torch.bfloat16 else tl.float16), tl.float32, "tf32", dtype


def empty(name: str, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every buffer a launch allocates (``tiles.pass_buffers``, the stored planes, the
    placeholders of the arguments a pass does not use): uninitialised, as ``torch.empty``. The
    one allocator of the launchers, so that a test can replace it and prove that every buffer
    is written before it is read or filled by ``buffer``: tests/experimental/conftest.py fills
    each with NaN in every Triton test, tests/experimental/test_kernel_hazards.py compares
    poisoned and clean runs bit for bit."""
    return torch.empty(shape, dtype=dtype, device=device)


def buffer(name: str, spec: tiles.Buffer, device: torch.device) -> torch.Tensor:
    """A buffer of ``spec`` from ``empty``, filled with ``spec.fill`` unless that is None
    (every cell written before it is read)."""
    x = empty(name, tuple(spec.shape), spec.dtype, device)
    return x if spec.fill is None else x.fill_(spec.fill)


def descriptor(x: torch.Tensor | None, block: list, dtype: torch.dtype, device: torch.device):
    """A host tensor descriptor of x ((planes, T, DPAD) or a 2-D table), or of an
    uninitialised placeholder of the block's shape when this pass does not use it (its loads
    and stores are compiled out: never read)."""
    if x is None:
        x = empty("placeholder", tuple(block), dtype, device)
    return TensorDescriptor.from_tensor(x, block)


class Problem:
    """Everything a launch needs that does not change between the passes of one call: the
    inputs (pad rows of q and keys of k zeroed), their descriptor copies, the mixing matrices
    and the Toeplitz tables of the layer's kernels ``k1`` (pre-softmax) and ``k2`` (post)."""

    def __init__(self, q, k, v, kv, k1, w1, k2, w2, pad_key, q_off, p_drop, seed, tuning=DEFAULT_TUNING):
        self.tuning = tuning  # the model's model.kernels (options.of: frames, programs, slab rows)
        self.b, self.h, self.tq, self.d = q.shape
        self.tk = k.shape[2]
        self.dev = q.device
        self.gpu = q.device.type != "cpu"
        self.hp = tiles.padded_heads(self.h, self.gpu)
        self.gp, self.dpad = tiles.feature_parts(self.d)
        self.mma, self.acc, self.prec, self.sdt = dtypes(q.dtype, q.device)
        self.acc_t = torch.float64 if q.dtype == torch.float64 else torch.float32
        self.pre = None if k1 is None else tuple(k1.shape[1:])
        self.post = None if k2 is None else tuple(k2.shape[1:])
        self.pad_key, self.q_off, self.p_drop, self.seed = pad_key, q_off, p_drop, seed
        self.kv = kv
        self.scale = self.d**-0.5
        if kv is not None:  # pad rows of q and keys of k give exactly the zero scores the reference masks
            vq = kv[:, q_off : q_off + self.tq].to(q.dtype)[:, None, :, None]
            vk = kv.to(k.dtype)[:, None, :, None]
            q, k = q * vq, k * vk
        self.q, self.k, self.v = q.contiguous(), k.contiguous(), v.contiguous()
        self.k1, self.k2 = k1, k2
        self.pl1 = pad_left(pad_key, self.pre[1]) if self.pre else 0
        self.pl2 = pad_left(pad_key, self.post[1]) if self.post else 0

        def padw(x):
            if x is None:
                return None
            out = torch.zeros(self.hp, self.hp, dtype=self.acc_t, device=self.dev)
            out[: self.h, : self.h] = x.t()
            return out

        self.w1t, self.w2t = padw(w1), padw(w2)
        # the argument of every pointer a pass does not use: never read
        self.dummy = buffer("dummy", tiles.Buffer((1,), self.acc_t, None), self.dev)
        # the descriptors' copies: (planes, MARGIN + T, DPAD), zero rows in front and features
        # zero-padded to whole GP parts
        self.margin = tiles.margin(self.pre, self.post, pad_key)
        self.qp, self.kp, self.vp = self.padded(self.q), self.padded(self.k), self.padded(self.v)

    def padded(self, x: torch.Tensor) -> torch.Tensor:
        """(..., T, d) -> a contiguous (planes, MARGIN + T, DPAD) copy, 16-byte aligned: the
        ``tiles.margin`` zero rows in front (the rows before the sequence the kernel's
        descriptor copies read, at coordinates >= 0) and the features zero-padded to whole
        feature parts (the tensor itself, no copy, where neither pads and it is aligned: the
        layers without convolutions have no margin)."""
        x = x.reshape(-1, x.shape[-2], x.shape[-1])
        if self.margin or self.dpad != self.d:
            x = F.pad(x, (0, self.dpad - self.d, self.margin, 0))
        x = x.contiguous()
        return x if x.data_ptr() % 16 == 0 else x.clone()

    def geometry(self, pass_: str):
        """(frame, schedule, programs) of one pass of this call."""
        f = tiles.frame(pass_, self.pre, self.post, self.pad_key, self.tuning)
        sched = tiles.items(f, self.b, self.tq, self.tk, self.q_off, programs(self.dev, self.tuning))
        return f, sched, len(sched.starts) - 1

    def table(self, theta: torch.Tensor, ec: int, adjoint: bool, pl: int) -> torch.Tensor:
        """One kernel's Toeplitz table for frames ``ec`` wide in the operand dtype (bf16 on a
        GPU), 2-D as its tensor descriptor reads it: (HP * c_q * ec, ec)."""
        dt = self.sdt if self.gpu else self.acc_t
        off = theta.shape[-1] - 1 - pl if adjoint else pl
        return toeplitz(theta.to(self.acc_t), ec, self.hp, adjoint, off).to(dt).reshape(-1, ec).contiguous()

    def toeplitz(self, ec: int):
        """The tables a backward or forward pass reads: the post kernel and its adjoint, the pre
        kernel's adjoint (kernel B)."""
        if self.k2 is not None:
            self.tf2, self.ta2 = self.table(self.k2, ec, False, self.pl2), self.table(self.k2, ec, True, self.pl2)
        if self.k1 is not None:
            self.ta1 = self.table(self.k1, ec, True, self.pl1)


def programs(device: torch.device, tuning: KernelTuning = DEFAULT_TUNING) -> int:
    """Persistent programs of a launch: ``tiles.PROGRAMS_PER_SM`` per SM on a GPU; in the
    interpreter one per item (its programs run one after another anyway).
    ``model.kernels.impl_options.triton.programs`` overrides (tests run a GPU's multi-tile items
    in the interpreter)."""
    n = options.of(tuning).programs
    if n is not None:
        return n
    if device.type == "cpu":
        return 1 << 30
    return tiles.PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count


def slab_rows(pass_: str, f: tiles.Frame, gpu: bool, conv: bool, tuning: KernelTuning = DEFAULT_TUNING) -> int:
    """Frame rows per mixing slab: ``tiles.SLAB_ROWS_GPU`` (a layer with a convolution:
    ``SLAB_ROWS_GPU_CONV``; backward_dc: ``SLAB_ROWS_DC``) on a GPU, the whole frame in the
    interpreter (fewest interpreted ops); ``model.kernels.impl_options.triton.slab_rows``
    overrides (tests run the GPU's slabs in the interpreter)."""
    opts = options.of(tuning)
    sr = opts.slab_rows
    if sr is not None:
        if f.er % sr:  # a power of two already (TritonOptions); the frame is known only here
            raise UserError(f"{opts.where}.slab_rows={sr}: a power of two dividing the frame's {f.er} rows")
        return sr
    if not gpu:
        return f.er
    if pass_ == "backward_dc":
        return min(f.er, tiles.SLAB_ROWS_DC)
    return min(f.er, tiles.SLAB_ROWS_GPU_CONV if conv else tiles.SLAB_ROWS_GPU[pass_])


def constexprs(
    pass_: str,
    f: tiles.Frame,
    *,
    h: int,
    d: int,
    pre,
    post,
    pad_key: str,
    has_w1: bool,
    has_w2: bool,
    has_kv: bool,
    drop: bool,
    gpu: bool,
    dtype: torch.dtype,
    tuning: KernelTuning = DEFAULT_TUNING,
) -> dict:
    """Every constexpr a pass of either kernel may take (each kernel's ``kernel_constexprs``
    keeps its own): the frame, the kernels' sizes, which parts are on, the types, the
    feature parts, the zero margin and the scratch slots; ``tuning``: the model's (slab rows)."""
    cq1, ck1 = pre or (1, 1)
    cq2, ck2 = post or (1, 1)
    mma, acc, prec, sdt = dtypes(dtype, torch.device("cuda" if gpu else "cpu"))
    gp, dpad = tiles.feature_parts(d)
    return dict(
        H=h,
        HP=tiles.padded_heads(h, gpu),
        DPAD=dpad,
        ER=f.er,
        EC=f.ec,
        TOP=f.top,
        LEFT=f.left,
        BMO=f.bmo,
        BNO=f.bno,
        SR=slab_rows(pass_, f, gpu, pre is not None or post is not None, tuning),
        CQ1=cq1,
        CK1=ck1,
        CKP1=tiles.pow2(ck1),
        PL1=pad_left(pad_key, ck1) if pre else 0,
        HAS_W1=has_w1,
        HAS_K2=post is not None,
        CQ2=cq2,
        CK2=ck2,
        CKP2=tiles.pow2(ck2),
        PL2=pad_left(pad_key, ck2) if post else 0,
        HAS_W2=has_w2,
        HAS_KV=has_kv,
        DROP=drop,
        MMA=mma,
        ACC=acc,
        PREC=prec,
        RNE=not gpu and sdt == torch.bfloat16,
        GP=gp,
        MARGIN=tiles.margin(pre, post, pad_key),
        **tiles.scratch_slots(pass_, pre is not None, post is not None),
    )


def descriptor_specs(consts: dict, names: tuple) -> dict:
    """{kernel argument: (input, block shape)} of the descriptors ``names`` of a kernel: rows
    x GP features of a (planes, T, DPAD) input or accumulator; the Toeplitz tables' (EC, EC)
    blocks of a (HP * c_q * EC, EC) table. The one source for the launchers and
    ``compile_report.py``."""
    er, ec, gp = consts["ER"], consts["EC"], consts["GP"]
    every = {
        "qd": ("q", [1, er, gp]),
        "kd": ("k", [1, ec, gp]),
        "vd": ("v", [1, ec, gp]),
        "dod": ("do", [1, er, gp]),
        "tf2d": ("tf2", [ec, ec]),
        "ta2d": ("ta2", [ec, ec]),
        "ta1d": ("ta1", [ec, ec]),
        "tf1d": ("tf1", [ec, ec]),
        # the accumulators (fp32; ``ACCUMULATORS``): O's and dq's per-item row partials, dk, dv
        "pod": ("po", [1, er, gp]),
        "pdqd": ("pdq", [1, er, gp]),
        "dkd": ("dk", [1, ec, gp]),
        "dvd": ("dv", [1, ec, gp]),
    }
    return {n: every[n] for n in names}


ACCUMULATORS = ("po", "pdq", "dk", "dv")  # descriptor sources in the accumulator dtype, the rest in the inputs'


def descriptors(specs: dict, inputs: dict, bufs: dict, pb: Problem) -> dict:
    """The host descriptors of a launch: each spec's input (``inputs``, or the accumulator
    ``bufs`` holds, as (planes, rows, DPAD)), a placeholder where the pass has none."""
    inputs = dict(inputs)
    for name in ACCUMULATORS:  # (planes, rows, DPAD) views of the accumulators this pass adds into
        inputs[name] = bufs[name].flatten(0, 1) if name in bufs else None
    return {
        name: descriptor(inputs.get(src), block, pb.acc_t if src in ACCUMULATORS else pb.qp.dtype, pb.dev)
        for name, (src, block) in specs.items()
    }


def schedule_tensors(sched: tiles.TileSchedule, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(tiles, starts) of ``Schedule.tiles`` as the kernel walks them (int32)."""
    rows, starts = sched.tiles()
    return (
        torch.tensor(rows, dtype=torch.int32, device=device).flatten(),
        torch.tensor(starts, dtype=torch.int32, device=device),
    )


def per_row(part: torch.Tensor, f, sched, pb: Problem, reduce=lambda x: x.sum(2)) -> torch.Tensor:
    """Per-slot partials (slots, ...) -> (B, X, Tq, ...) over the owned rows, the key splits
    of a row block combined by ``reduce`` ((B, n_rt, S, ...) -> (B, n_rt, X, ER, ...); a sum
    unless told)."""
    x = part.view(pb.b, sched.n_rt, sched.s_max, *part.shape[1:])
    x = reduce(x)  # (B, n_rt, X, ER, ...)
    x = x[:, :, :, f.top : f.top + f.bmo]  # owned rows
    x = x.transpose(1, 2).reshape(pb.b, x.shape[2], sched.n_rt * f.bmo, *x.shape[4:])
    return x[:, :, : pb.tq]


def merge_stats(x: torch.Tensor) -> torch.Tensor:
    """(B, n_rt, S, 2, HP, ER) per key split (row max, sum of exp(z - max)) -> (B, n_rt, HP, ER)
    lse; a pad row (nothing allowed) gets 0, its probabilities are masked anyway."""
    m, l_ = x[:, :, :, 0], x[:, :, :, 1]
    mx = m.amax(2, keepdim=True)
    mx_safe = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
    tot = (l_ * torch.exp(m - mx_safe)).sum(2)
    return torch.where(
        tot > 0, mx_safe.squeeze(2) + torch.log(torch.where(tot > 0, tot, torch.ones_like(tot))), torch.zeros_like(tot)
    )


def lse(bufs: dict, f, sched, pb: Problem) -> torch.Tensor:
    """The (B, H, Tq) lse from the stats pass's per-split row max and sum."""
    ml = torch.stack((bufs["pm"], bufs["pl"]), 1)  # (slots, 2, HP, ER): each split's row max and sum
    return per_row(ml, f, sched, pb, merge_stats)[:, : pb.h].contiguous()


def out_of_resources(e: Exception, pass_: str, f: tiles.Frame, pb: Problem) -> RuntimeError:
    """What a real compile shows and the interpreter cannot, as one line with the way out
    (compile_report.py reports each pass's needs without a GPU)."""
    return RuntimeError(
        f"model.attn_impl=triton: its {pass_!r} pass does not fit this GPU ({e}); frame {f.er}x{f.ec}, {pb.h} heads "
        f"of {pb.d}. Use model.attn_impl=blocked, or a smaller model.kernels.impl_options.triton.frame"
    )
