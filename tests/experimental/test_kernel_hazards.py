"""The hazards of the kernels of model.attn_impl=triton that only hardware would show,
closed by construction and checked here (mta_repro/experimental/fused_triton/design.md,
"Hazards"):

- every buffer a launch allocates is written before it is read, or filled: the launchers' one
  allocator (``launch.empty``) is made to return NaN, and forward and backward of every
  shipped option give the unpoisoned run's results bit for bit (interpreter);
- no descriptor copy reads (or reduction writes) a negative coordinate: rows before the
  sequence and keys before 0 come from the zero margin the launcher puts in front of each
  input, not from TMA's zero fill (interpreter, the descriptor calls recorded);
- the statistics and forward passes compute the logits z through one function and get the
  same bits (interpreter);
- O, dq and the weights' gradients do not depend on the number of programs (interpreter);
- on the real sm_90 compile: shared memory written by ordinary stores is fenced
  (``fence.proxy.async``) before wgmma or a TMA store reads it, and no loop that stores
  scratch is software-pipelined: checked on the one compile of the shipped kernel that
  test_roofline.py makes (``test_the_shipped_kernel_compiles_for_an_h200_within_its_limits``),
  not on a second compile here."""

import dataclasses
import importlib.util

import pytest
import torch

from mta_repro.experimental.fused_triton import tiles
from mta_repro.experimental.fused_triton.options import kernel_tuning
from mta_repro.model import attention_ops
from tests.experimental.test_attn_triton import params, qkv

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed"),
    pytest.mark.triton,
]


def grads_of(impl, q, k, v, p, mask, training=False, seed=None):
    ts = {"q": q, "k": k, "v": v}
    ts.update({f: getattr(p, f) for f in attention_ops.WEIGHT_FIELDS if getattr(p, f) is not None})
    ts = {n: t.detach().clone().requires_grad_() for n, t in ts.items()}
    p = dataclasses.replace(p, **{n: t for n, t in ts.items() if n not in "qkv"})
    if seed is not None:
        torch.manual_seed(seed)  # the kernel's dropout seed
    out = attention_ops.attn_impl(impl).fn(ts["q"], ts["k"], ts["v"], p, mask, training)
    gy = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64).to(out.dtype)
    (out * gy).sum().backward()
    return out.detach(), {n: t.grad for n, t in ts.items()}


def poison(monkeypatch) -> list:
    """From now on the launchers' allocator returns NaN-filled buffers (-1 for integers);
    returns the list of the names it is asked for."""
    from mta_repro.experimental.fused_triton import launch

    seen = []

    def empty(name, shape, dtype, device):
        seen.append(name)
        return torch.full(shape, float("nan") if dtype.is_floating_point else -1, dtype=dtype, device=device)

    monkeypatch.setattr(launch, "empty", empty)
    return seen


def _bitwise(got, want, what):
    assert got.dtype == want.dtype and got.shape == want.shape, what
    same = (got == want) | (torch.isnan(got) & torch.isnan(want))
    assert bool(same.all()), f"{what}: {int((~same).sum())} of {got.numel()} differ"


# (frame, slab rows, programs, h, pre, post, mix, wpsm, pad_key, batch, tq, tk, q_off, key padding, dropout)
POISON_CASES = {
    # Every Triton test runs with this poisoning too (tests/experimental/conftest.py), against
    # the float64 reference: the GPU schedule (slabs, multi-item programs), the 880M layer's 16
    # heads and 6x11 kernels, offsets and key padding in test_attn_triton.py. The cases here add
    # the bitwise comparison with an unpoisoned run, one per option family. T = 21 on 16x16
    # frames: two row blocks in every pass, the second over two key blocks (partial tiles).
    "kq_conv-right": ("16x16", None, None, 4, (2, 3), (2, 3), "head_kernel", True, "right", 1, 21, 21, 0, False, 0.0),
    "pre_only-both": ("16x16", None, None, 4, (3, 3), None, None, True, "both", 1, 21, 21, 0, True, 0.0),
    "post_only-both": ("16x16", None, None, 4, None, (2, 3), "head_kernel", False, "both", 1, 21, 21, 0, False, 0.0),
    "mixing-pre_post_linear": ("16x16", None, 3, 4, None, None, "wposm", True, "both", 2, 21, 21, 0, True, 0.0),
    "head_kernel_only": (None, None, None, 4, None, None, "head_kernel", False, "both", 1, 21, 21, 0, False, 0.0),
    "dropout": ("16x16", None, None, 4, None, (2, 3), "head_kernel", True, "both", 1, 21, 21, 0, True, 0.25),
}


def _case(case):
    frame, slab, progs, h, pre, post, mix, wpsm, pad_key, b, tq, tk, q_off, pad, drop = POISON_CASES[case]
    tn = kernel_tuning(frame=frame, slab_rows=slab, programs=progs)
    p = params(
        h,
        pre,
        post,
        mix=mix,
        wpsm=wpsm,
        pad_key=pad_key,
        group=2 if mix == "head_kernel" else None,
        dropout=drop,
        tuning=tn,
    )
    q, k, v = qkv(b, h, tq, tk, 3)
    key_valid = None
    if pad:
        key_valid = torch.ones(b, tk, dtype=torch.bool)
        key_valid[-1, : tk // 2] = False  # left padding whose edge falls inside a frame
    return q, k, v, p, attention_ops.AttnMask(q_off, key_valid), drop > 0


@pytest.mark.parametrize("case", list(POISON_CASES))
def test_nan_poisoned_buffers_change_no_bit(monkeypatch, case):
    """Every buffer the launchers allocate (tiles.pass_buffers: scratch, partials, dk/dv,
    weight-gradient partials; the stored planes; the placeholders of unused arguments) NaN
    before each launch:
    forward and backward give the unpoisoned run's bits, finite, and (without dropout) the
    float64 reference's values."""
    q, k, v, p, mask, drop = _case(case)
    clean, clean_g = grads_of("triton", q, k, v, p, mask, training=drop, seed=3)
    seen = poison(monkeypatch)
    got, got_g = grads_of("triton", q, k, v, p, mask, training=drop, seed=3)
    # every buffer of every pass came from the poisoned allocator
    pre = None if p.mta_kernel is None else tuple(p.mta_kernel.shape[2:])
    post = None if p.mta_kernel_after_sm is None else tuple(p.mta_kernel_after_sm.shape[2:])
    want_names = {"scratch", "dummy"} | ({"cstore", "dcstore"} if pre else set())
    for pass_ in tiles.passes(pre):
        f = tiles.frame(pass_, pre, post, p.pad_key, p.tuning)
        sched = tiles.items(f, q.shape[0], q.shape[2], k.shape[2], mask.q_offset, 2)
        want_names |= set(
            tiles.pass_buffers(
                pass_,
                f,
                sched,
                2,
                b=q.shape[0],
                h=q.shape[1],
                hp=4,
                tk=k.shape[2],
                dpad=16,
                pre=pre,
                post=post,
                dtype=q.dtype,
            )
        ) - {"tiles"}
    assert want_names <= set(seen), want_names - set(seen)
    assert torch.isfinite(got).all()
    _bitwise(got, clean, "out")
    for name, g in clean_g.items():
        assert torch.isfinite(got_g[name]).all(), name
        _bitwise(got_g[name], g, name)
    if not drop:
        want, want_g = grads_of("torch", q, k, v, p, mask)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        for name, g in want_g.items():
            torch.testing.assert_close(got_g[name], g, rtol=1e-9, atol=1e-11, msg=name)


def test_poisoning_finds_a_buffer_read_before_it_is_written(monkeypatch):
    """The check can fail: a launch whose D partial is left unfilled (as if the launcher
    forgot to zero it) gives NaN under the poisoned allocator."""
    real = tiles.pass_buffers

    def unfilled(*a, **kw):
        out = real(*a, **kw)
        if "pd" in out:
            out["pd"] = out["pd"]._replace(fill=None)
        return out

    monkeypatch.setattr(tiles, "pass_buffers", unfilled)
    q, k, v, p, mask, _ = _case("kq_conv-right")
    seen = poison(monkeypatch)
    _, g = grads_of("triton", q, k, v, p, mask)
    assert "pd" in seen and not torch.isfinite(g["q"]).all()


def _value(x):
    """A value of the interpreter (a triton tensor, or a Python scalar) as numpy."""
    import numpy as np

    return np.asarray(getattr(getattr(x, "handle", None), "data", x))


def _record_logits(monkeypatch) -> dict:
    """Records, per pass, the logits z every slab of every launch of the fused kernel computes
    (``_logits``) on the cells it owns: {pass: {(b, query, key, head): z}} (the cells from the
    ``slab_cells`` call before it)."""
    from mta_repro.experimental.fused_triton import fused as at

    out, state = {}, {}
    real_cells, real_logits, real_launch = at.slab_cells, at._logits, at._launch

    def launch(pass_, *a, **kw):
        state["pass"] = pass_
        out.setdefault(state["pass"], {})
        return real_launch(pass_, *a, **kw)

    def cells(r0, row0, col0, b, *a):
        res = real_cells(r0, row0, col0, b, *a)
        state["cells"] = (int(_value(b).reshape(-1)[0]), _value(res[2]), _value(res[3]), _value(res[5]))
        return res

    def logits(*a):
        xc, z = real_logits(*a)
        b, ci, cj, own = state["cells"]
        zv = _value(z)
        rec = out[state["pass"]]
        for n in own.nonzero()[0]:
            for hd in range(zv.shape[1]):
                key = (b, int(ci[n]), int(cj[n]), hd)
                assert key not in rec, key  # each cell owned once per pass
                rec[key] = zv[n, hd]
        return xc, z

    monkeypatch.setattr(at, "_launch", launch)
    monkeypatch.setattr(at, "slab_cells", cells)
    monkeypatch.setattr(at, "_logits", logits)
    return out


def test_every_pass_computes_the_same_logits_bit_for_bit(monkeypatch):
    """The fused kernel's statistics pass (row max and sum: the lse) and its forward, rowsum
    and backward passes (exp(z - lse)) compute z through one function, on frames of different
    halos (stats: none; forward: the post conv's above and beside; backward: around): on
    every owned cell of every pass z is the same bits, so the lse the forward divides by is
    that of the z it exponentiates. Several key blocks, padding. Float64: numpy's float32
    matmul (the interpreter's tl.dot) sums a product column in an order that depends on the
    column's position in the product (up to ~4 ulp here), a CPU artefact, where a tensor
    core's order depends only on the inner dimension, the same in every pass."""
    h = 4
    # a layer without a pre-softmax kernel (a kq-conv layer's stored design computes z once, in
    # stats, from C, and every later pass reads C back from the store)
    p = params(h, None, (3, 3), group=2, tuning=kernel_tuning(frame="16x16"))
    q, k, v = qkv(1, h, 29, 29, 3)
    key_valid = torch.ones(1, 29, dtype=torch.bool)
    key_valid[0, :5] = False
    mask = attention_ops.AttnMask(0, key_valid)
    rec = _record_logits(monkeypatch)
    grads_of("triton", q, k, v, p, mask)
    assert set(rec) == set(tiles.FUSED_PASSES)
    allowed = mask.dense(29, 29, q.device).reshape(29, 29)
    n_allowed = int(allowed.sum())
    for name in tiles.FUSED_PASSES:
        cells = {(i, j) for _, i, j, _ in rec[name]}
        assert len(cells) == n_allowed and all(bool(allowed[i, j]) for i, j in cells), name
        assert rec[name].keys() == rec["stats"].keys(), name
        differ = [key for key, z in rec[name].items() if z.tobytes() != rec["stats"][key].tobytes()]
        assert not differ, (name, len(differ), differ[:3])
    # the logits are those of the reference's score path (so the comparison is of real values)
    zs = torch.tensor([rec["stats"][(0, 28, j, 0)] for j in range(5, 29)], dtype=torch.float64)
    assert zs.abs().max() > 0.1 and len(set(zs.tolist())) == len(zs)


def _record_descriptor_coordinates(monkeypatch) -> list:
    """Records every descriptor copy's coordinates (loads, stores, reductions) the interpreter
    runs: [(kind, box shape, coordinates)]."""
    from triton.runtime import interpreter

    from mta_repro.experimental.fused_triton import jit_helpers  # noqa: F401  (installs the interpreter's reduction)

    seen = []
    builder = interpreter.InterpreterBuilder

    def wrap(kind, real, at):
        def call(self, *args):
            seen.append((kind, tuple(args[0].block_shape), tuple(int(x.data.reshape(-1)[0]) for x in args[at])))
            return real(self, *args)

        return call

    for kind, at in (("load", 1), ("store", 2), ("reduce", 3)):
        name = f"create_descriptor_{kind}"
        real = getattr(builder, name)
        if kind == "reduce":  # (self, kind, desc, value, indices)

            def call(self, rkind, desc, value, indices, _real=real):
                seen.append(("reduce", tuple(desc.block_shape), tuple(int(x.data.reshape(-1)[0]) for x in indices)))
                return _real(self, rkind, desc, value, indices)

            monkeypatch.setattr(builder, name, call)
        else:
            monkeypatch.setattr(builder, name, wrap(kind, real, at))
    return seen


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_no_descriptor_copy_has_a_negative_coordinate(monkeypatch, dtype):
    """Rows before the sequence (a frame's halo above row 0) and keys before 0 (the halo
    left of key 0) are read from the zero margin the launcher puts in front of every
    descriptor input (tiles.margin), not from a TMA copy's zero fill of negative coordinates,
    and dk/dv are reduced into a buffer with the same margin: over forward and backward of a
    6x11-kernel layer (the widest halos, pad both) and a right-padded one (the stored-scores
    kernels), float64 (read-add-write accumulators) and float32 (TMA reductions), every
    coordinate of every descriptor load, store and reduction is >= 0, and the results are the
    reference's."""
    h = 2
    for pre, post, pad_key in (((6, 11), (6, 11), "both"), ((3, 4), (2, 3), "right")):
        p = params(h, pre, post, pad_key=pad_key, tuning=kernel_tuning(frame="32x32"))
        q, k, v = qkv(1, h, 40, 40, 3)
        mask = attention_ops.AttnMask()
        if dtype == torch.float32:
            q, k, v = q.float(), k.float(), v.float()
            p = dataclasses.replace(
                p, **{f: getattr(p, f).float() for f in attention_ops.WEIGHT_FIELDS if getattr(p, f) is not None}
            )
        want, want_g = grads_of(
            "torch", q.double(), k.double(), v.double(), params(h, pre, post, pad_key=pad_key), mask
        )
        seen = _record_descriptor_coordinates(monkeypatch)
        got, got_g = grads_of("triton", q, k, v, p, mask)
        monkeypatch.undo()
        kinds = {kind for kind, _, _ in seen}
        assert kinds == ({"load"} if dtype == torch.float64 else {"load", "reduce"}) | (
            {"store"} if dtype == torch.float64 else set()
        ), kinds
        neg = [s for s in seen if min(s[2]) < 0]
        assert not neg, (len(neg), neg[:3])
        # the margin is what the halos reach: the least row coordinate read is exactly 0
        assert min(s[2][1] for s in seen if len(s[2]) == 3) == 0 < tiles.margin(pre, post, pad_key)
        tol = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got.double(), want, **tol)
        for name, g in want_g.items():
            torch.testing.assert_close(
                got_g[name].double(), g, **dict(tol, atol=tol["atol"] * (1 + g.abs().max().item())), msg=name
            )


def test_only_dk_and_dv_take_adds_from_several_programs(monkeypatch):
    """Determinism (design.md, "Hazards"): every box of O's and dq's per-item
    partials is added into by one program only (its item's, in tile order, each loop ending in
    a completion wait), so they, and torch's fixed-order sum of the slots, are deterministic on
    a GPU; the weight gradients are per-program partials. dk and dv boxes take TMA reductions
    from several programs (here 3 persistent programs over 2 x 2 row blocks, 2 x 3 in the dC
    pass): their fp32 add order is the programs' timing, so they alone may differ in the last
    bits between runs."""
    from triton.runtime import interpreter

    from mta_repro.experimental.fused_triton import launch

    bufs, adds = {}, []
    real_empty = launch.empty

    def empty(name, shape, dtype, device):
        x = real_empty(name, shape, dtype, device)
        bufs.setdefault(name, []).append(x)
        return x

    real_reduce = interpreter.InterpreterBuilder.create_descriptor_reduce

    def reduce(self, kind, desc, value, indices):
        adds.append(
            (int(desc.base.data.reshape(-1)[0]), tuple(int(x.data.reshape(-1)[0]) for x in indices), self.grid_idx[0])
        )
        return real_reduce(self, kind, desc, value, indices)

    monkeypatch.setattr(launch, "empty", empty)
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_descriptor_reduce", reduce)
    h = 4
    p = params(h, (2, 3), (3, 3), group=2, tuning=kernel_tuning(frame="16x16", programs=3))
    p = dataclasses.replace(
        p, **{f: getattr(p, f).float() for f in attention_ops.WEIGHT_FIELDS if getattr(p, f) is not None}
    )
    q, k, v = (x.float() for x in qkv(2, h, 25, 25, 3))
    grads_of("triton", q, k, v, p, attention_ops.AttnMask())
    name_of = {x.data_ptr(): name for name in ("po", "pdq", "dk", "dv") for x in bufs.get(name, ())}
    writers: dict = {}
    for ptr, (plane, row, _), pid in adds:
        writers.setdefault((name_of[ptr], plane, row), set()).add(pid)
    assert {key[0] for key in writers} == {"po", "pdq", "dk", "dv"}
    for key, pids in writers.items():
        if key[0] in ("po", "pdq"):
            assert len(pids) == 1, key
    assert max(len(pids) for key, pids in writers.items() if key[0] in ("dk", "dv")) >= 2
