"""model.attn_impl=triton (mta_repro/experimental/fused_triton) beyond the shared parity
tests (test_triton_parity.py): many frames per row and per key axis, the shipped configs'
and Table 5's options at the 880M head count, nothing quadratic saved, the fallbacks, and
whole training runs equal to "torch". Kq-conv layers run the stored-scores kernels
(test_attn_stored.py has their own tests), every other layer the fused kernel.

Without a GPU these run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1),
which proves the kernels' semantics, not their speed or that they compile for a GPU.
"""

import dataclasses
import importlib.util
import warnings

import pytest
import torch

from mta_repro.experimental.fused_triton import impl as triton_impl
from mta_repro.experimental.fused_triton import tiles
from mta_repro.experimental.fused_triton.options import kernel_tuning
from mta_repro.kernels.interface import post_mix_matrix
from mta_repro.kernels.tuning import KernelTuning
from mta_repro.model import attention_ops, attention_registry

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed"),
    pytest.mark.triton,
]
TRITON = attention_ops.attn_impl("triton")


def params(
    h, pre, post, mix="head_kernel", wpsm=True, pad_key="both", seed=0, group=None, tuning=KernelTuning(), dropout=0.0
):
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    c_h = group or h
    return attention_ops.ExplicitAttnParams(
        mta_kernel=rand(h, 1, *pre) if pre else None,
        wpsm=rand(h, h) * h**-0.5 if wpsm else None,
        mta_kernel_after_sm=rand(h, 1, *post) * 0.5 if post else None,
        head_kernel=rand(h // c_h, c_h, c_h) * c_h**-0.5 if mix == "head_kernel" else None,
        wposm=rand(h, h) * h**-0.5 if mix == "wposm" else None,
        pad_key=pad_key,
        dropout=dropout,
        tuning=tuning,
    )


def grads_of(impl, q, k, v, p, mask):
    ts = {"q": q, "k": k, "v": v}
    ts.update({f: getattr(p, f) for f in attention_ops.WEIGHT_FIELDS if getattr(p, f) is not None})
    ts = {n: t.detach().clone().requires_grad_() for n, t in ts.items()}
    p = dataclasses.replace(p, **{n: t for n, t in ts.items() if n not in "qkv"})
    out = attention_ops.attn_impl(impl).fn(ts["q"], ts["k"], ts["v"], p, mask, False)
    gy = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64).to(out.dtype)
    (out * gy).sum().backward()
    return out.detach(), {n: t.grad for n, t in ts.items()}


def assert_matches_torch(q, k, v, p, mask=attention_ops.AttnMask()):
    want, want_g = grads_of("torch", q, k, v, p, mask)
    got, got_g = grads_of("triton", q, k, v, p, mask)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    for name, g in want_g.items():
        torch.testing.assert_close(got_g[name], g, rtol=1e-9, atol=1e-11, msg=name)


def qkv(b, h, tq, tk, d, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, t, d, generator=g, dtype=torch.float64) for t in (tq, tk, tk)]


@pytest.mark.parametrize("gpu_schedule", [False, True])
def test_many_frames_with_padding_and_offset(gpu_schedule):
    """Small frames (model.kernels.impl_options.triton.frame) put several row blocks and key blocks in
    every pass, with causal skipping, left padding across block edges and a cached-key
    offset. The GPU schedule: 4-row mixing slabs and two persistent programs, so items hold
    several tiles (partials accumulated across a row's key blocks) instead of one tile each."""
    tn = kernel_tuning(frame="16x16", **(dict(slab_rows=4, programs=2) if gpu_schedule else {}))
    h = 4
    p = params(h, (2, 3), (3, 3), group=2, tuning=tn)
    # T = 25: two row blocks (three in the kq-conv backward's dC pass) of up to two key blocks
    # in every pass, the last ones partial
    q, k, v = qkv(2, h, 25, 25, 3)
    key_valid = torch.ones(2, 25, dtype=torch.bool)
    key_valid[1, :19] = False  # the padding covers the first key block, its edge falls inside the second
    assert_matches_torch(q, k, v, p, attention_ops.AttnMask(0, key_valid))
    if gpu_schedule:
        return  # (the interpreter runs 4-row slabs several times slower)
    assert_matches_torch(q, k, v, p)
    # post only, centred: the frames' margins are exactly the kernel's reach (the convolutions
    # used on the owned block read up to the frame's edge), over several key blocks
    assert_matches_torch(q, k, v, params(h, None, (2, 3), pad_key="both", tuning=tn))
    q, _, _ = qkv(2, h, 17, 25, 3, seed=2)  # 17 new queries (two row blocks) after 8 cached keys
    assert_matches_torch(
        q,
        k,
        v,
        params(h, (3, 2), (2, 4), mix="wposm", pad_key="right", tuning=tn),
        attention_ops.AttnMask(8, key_valid),
    )


def test_float32_accumulates_through_descriptor_reductions():
    """Below float64 the kernel adds O, dq, dk and dv by descriptor reductions (TMA on a GPU;
    here the interpreter's element-wise meaning of them): with several key blocks per row,
    frames whose keys start before 0 and end past Tk, padding and an offset, the float32
    result is the float64 reference's to float32 accuracy."""
    h = 4
    p = params(h, (2, 3), (3, 3), group=2, tuning=kernel_tuning(frame="16x16", programs=2))
    q, k, v = qkv(2, h, 17, 25, 3, seed=3)  # two row blocks of two key blocks each, every pass
    key_valid = torch.ones(2, 25, dtype=torch.bool)
    key_valid[1, :19] = False
    mask = attention_ops.AttnMask(8, key_valid)
    want, want_g = grads_of("torch", q, k, v, p, mask)
    p32 = dataclasses.replace(
        p, **{f: getattr(p, f).float() for f in attention_ops.WEIGHT_FIELDS if getattr(p, f) is not None}
    )
    got, got_g = grads_of("triton", q.float(), k.float(), v.float(), p32, mask)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
    for name, g in want_g.items():
        torch.testing.assert_close(got_g[name].double(), g, rtol=1e-4, atol=1e-4 * g.abs().max().item(), msg=name)


def test_interpreter_descriptor_reduction_adds_the_box_inside_the_tensor():
    """The interpreter (Triton 3.9) has no descriptor reductions; jit_helpers gives it their
    meaning: the box is added into the elements of the tensor it covers, and the parts
    outside (a negative row offset, rows past the end) are dropped, as a TMA reduction drops
    them."""
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    from mta_repro.experimental.fused_triton import jit_helpers  # noqa: F401  (installs the interpreter's reduction)

    @triton.jit
    def add_box(desc, r0, c0, x_ptr):
        r = tl.arange(0, 4)
        c = tl.arange(0, 8)
        desc.atomic_add([r0, c0], tl.load(x_ptr + r[:, None] * 8 + c[None, :]))

    x = torch.arange(32, dtype=torch.float32).reshape(4, 8) + 1
    for r0, c0 in ((-2, 0), (4, 8), (0, 4)):
        big = torch.full((10, 16), 0.5)
        out = big[2:8, :12]  # a (6, 12) tensor inside a larger buffer, whose other elements must stay
        add_box[(1,)](TensorDescriptor.from_tensor(out, [4, 8]), r0, c0, x)
        want = torch.full((10, 16), 0.5)
        for r in range(4):
            for c in range(8):
                if 0 <= r0 + r < 6 and 0 <= c0 + c < 12:
                    want[2 + r0 + r, c0 + c] += x[r, c]
        torch.testing.assert_close(big, want, rtol=0, atol=0)


def test_float64_on_a_gpu_falls_back(monkeypatch):
    """The kernels' accumulators are 32-bit reductions: float64 on a GPU is declined (the
    registry then runs ``blocked``), float64 in the interpreter is their exact check."""
    fake = type("T", (), {"device": torch.device("cuda"), "dtype": torch.float64})()
    reason = triton_impl.supports(fake, params(4, None, None), attention_ops.AttnMask())
    assert reason is not None and "float64" in reason
    fake.dtype = torch.bfloat16
    assert triton_impl.supports(fake, params(4, None, None), attention_ops.AttnMask()) is None
    assert TRITON.fallback == "blocked"


def test_training_dropout_on_a_kq_conv_layer_runs_blocked(monkeypatch):
    """The stored-scores kernels have no dropout: a kq-conv layer with training dropout falls
    back to ``blocked`` through the registry's ``supports`` (one warning naming it), with
    blocked's result under the same seed; in evaluation (dropout off) the kernels run it, and
    a mixing layer keeps the fused kernel's own dropout in training."""
    monkeypatch.setattr(attention_registry, "_warned", set())  # (each fallback warns once per process)
    h = 4
    q, k, v = qkv(1, h, 9, 9, 3)
    p = params(h, (2, 3), (3, 3), dropout=0.3)
    torch.manual_seed(5)
    with pytest.warns(UserWarning, match="'triton' does not support training dropout on a kq-conv layer.*'blocked'"):
        got = attention_ops.explicit_attention("triton", q, k, v, p, attention_ops.AttnMask(), training=True)
    torch.manual_seed(5)
    want = attention_ops.explicit_attention_blocked(q, k, v, p, attention_ops.AttnMask(), training=True)
    assert torch.equal(got, want)
    assert triton_impl.supports(q, dataclasses.replace(p, dropout=0.0), attention_ops.AttnMask()) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = attention_ops.explicit_attention("triton", q, k, v, p, attention_ops.AttnMask(), training=False)
    torch.testing.assert_close(out, attention_ops.explicit_attention_torch(q, k, v, p, attention_ops.AttnMask()))
    assert triton_impl.supports(q, params(h, None, (3, 3), dropout=0.3), attention_ops.AttnMask()) is None


def test_overrides_are_checked():
    """Options that cannot be right are refused where they are set (TritonOptions, as the model's
    args are validated); ones that do not fit the layer, when the kernel learns the layer. One
    line each, naming the field under model.kernels.impl_options.triton."""
    h = 4
    q, k, v = qkv(1, h, 8, 8, 3)
    run = TRITON.fn
    small = kernel_tuning(frame="16x16")  # the forward halo of a 6x21 post-softmax kernel needs 6x21
    with pytest.raises(
        ValueError,
        match=r"^model\.kernels\.impl_options\.triton\.frame=16x16 leaves no owned block: the forward "
        r"pass's halo needs 6x21 at least$",
    ):
        run(q.requires_grad_(), k, v, params(h, None, (6, 21), tuning=small), attention_ops.AttnMask()).sum().backward()
    q = q.detach()
    with pytest.raises(
        ValueError,
        match=r"^model\.kernels\.impl_options\.triton\.frame: '24x32': both sizes must be powers of two, "
        r"at least 16",
    ):
        kernel_tuning(frame="24x32")
    with pytest.raises(
        ValueError, match=r"^model\.kernels\.impl_options\.triton\.slab_rows: 3: expected a power of two or null$"
    ):
        kernel_tuning(slab_rows=3)
    too_many = kernel_tuning(frame="16x16", slab_rows=32)
    with pytest.raises(
        ValueError,
        match=r"^model\.kernels\.impl_options\.triton\.slab_rows=32: a power of two dividing the "
        r"frame's 16 rows$",
    ):
        run(q, k, v, params(h, (2, 3), None, tuning=too_many), attention_ops.AttnMask())
    with pytest.raises(
        ValueError, match=r"^model\.kernels\.impl_options\.triton\.programs: 0: expected a positive integer or null$"
    ):
        kernel_tuning(programs=0)


def test_schedule_covers_every_tile_once_and_balances_the_programs():
    """tiles.items: every (batch, row block, key block) the causal mask needs, exactly once,
    with distinct partial slots; each program's items a contiguous run of the rows' tiles laid
    end to end, so no program carries more than one tile above another (the estimate's serial
    chain is the longest program), the grid is filled whenever there are tiles enough, and a
    row is cut into few items (the per-item partial slots the launcher allocates and reduces)."""
    for pass_, b, tq, tk, q_off, n_prog in (
        ("forward", 4, 2048, 2048, 0, 132),
        ("backward_dc", 1, 2048, 2048, 0, 132),
        ("forward", 2, 300, 700, 400, 7),
        ("backward_b", 4, 4096, 4096, 0, 132),
        ("stats", 1, 100, 100, 0, 132),
        ("forward", 3, 1000, 1000, 0, 1),
    ):
        f = tiles.frame(pass_, (6, 11), (6, 11), "both")
        sched = tiles.items(f, b, tq, tk, q_off, n_prog)
        seen = [(bb, t, c) for bb, t, c0, c1, _ in sched.items for c in range(c0, c1)]
        per_row = [tiles.key_blocks(f, t, tq, tk, q_off) for t in range(sched.n_rt)]
        want = [(bb, t, c) for bb in range(b) for t in range(sched.n_rt) for c in range(per_row[t])]
        assert sorted(seen) == sorted(want) and len(seen) == len(set(seen))
        assert len({it[4] for it in sched.items}) == len(sched.items)
        assert all(
            0 <= it[4] < b * sched.n_rt * sched.s_max and it[4] // sched.s_max == it[0] * sched.n_rt + it[1]
            for it in sched.items
        )  # a slot of its own row
        progs = sched.programs()
        assert len(progs) == len(sched.starts) - 1 == min(n_prog, len(want)) and sum(map(len, progs)) == len(
            sched.items
        )
        loads = [sum(p) for p in progs]
        assert max(loads) - min(loads) <= 1 and min(loads) > 0
        # a run is consecutive tiles of the concatenation: the end of a row, whole rows, the start of one
        order = {cell: g for g, cell in enumerate(want)}
        for a, z in zip(sched.starts, sched.starts[1:]):
            run = [order[(bb, t, c)] for bb, t, c0, c1, _ in sched.items[a:z] for c in range(c0, c1)]
            assert run == list(range(run[0], run[0] + len(run)))
        run_len = min(loads)
        assert sched.s_max <= max(-(-n // run_len) + 1 for n in per_row)


@pytest.mark.parametrize(
    "h, pre, post",
    [
        (16, (6, 11), (6, 11)),  # the 880M MTA layer (16 heads: mixing as a tl.dot)
        (16, None, None),  # its mixing-only layers / talking heads
        (8, (4, 7), (4, 7)),  # Table 5 kernel sizes (the 6 x 11 one is above)
        (8, (4, 11), (4, 11)),
        (8, (6, 7), (6, 7)),
    ],
)
def test_shipped_and_ablation_options(h, pre, post):
    q, k, v = qkv(1, h, 27, 27, 4)
    assert_matches_torch(q, k, v, params(h, pre, post))


def test_saves_nothing_quadratic_for_backward(monkeypatch):
    """The fused kernel (the stored design keeps its packed C plane: test_attn_stored.py)."""
    t, h, d = 48, 4, 3
    sizes = []

    def pack(x):
        sizes.append(x.numel())
        return x

    q, k, v = (x.requires_grad_() for x in qkv(1, h, t, t, d))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = TRITON.fn(q, k, v, params(h, None, (3, 3)), attention_ops.AttnMask())
    out.sum().backward()
    assert sizes and max(sizes) <= h * t * d  # q, k, v, the (B, H, T) lse, the weights


def test_without_interpreter_on_cpu_falls_back_to_blocked(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    h = 4
    q, k, v = qkv(1, h, 9, 9, 3)
    p = params(h, (2, 3), (3, 3))
    with pytest.warns(UserWarning, match="'triton' does not support CPU tensors unless TRITON_INTERPRET=1.*'blocked'"):
        out = attention_ops.explicit_attention("triton", q, k, v, p, attention_ops.AttnMask())
    torch.testing.assert_close(out, attention_ops.explicit_attention_torch(q, k, v, p, attention_ops.AttnMask()))


@pytest.mark.slow
def test_debug_experiment_with_mta_trains_as_torch(tmp_path):
    """The debug experiment with attention=mta (6x11 convolutions in layers 1 and 3, head
    mixing everywhere): training steps (the second after an update) and the validation through
    the Triton kernels give the losses of the reference path, step for step."""
    import json

    from mta_repro.train.config import compose
    from mta_repro.train.loop import train

    losses = {}
    for impl in ("torch", "triton"):
        run_dir = tmp_path / impl
        train(
            compose(
                [
                    "experiment=debug",
                    "attention=mta",
                    f"model.attn_impl={impl}",
                    f"run_dir={run_dir}",
                    # validation: one window per domain, two domains (the interpreter's time grows with
                    # the windows: 4 windows a batch of 7 domains made validation most of this test's
                    # ~160 s; commoncrawl is where the training batches come from)
                    "data.seq_len=16",
                    "data.batch_size=1",
                    "trainer.eval_max_batches=1",
                    "trainer.eval_batch_size=1",
                    *(f"data.sources.{d}=0" for d in ("arxiv", "book", "github", "stackexchange", "wikipedia")),
                    # two steps, no warmup (its first update has lr 0): step 2's loss is after one update
                    # of lr 1.5e-4, and validation after two
                    "trainer.steps=2",
                    "optim.warmup=0",
                    "optim.lr=1.5e-4",
                    "checkpoint.every=2",
                    "checkpoint.export=false",
                    "logging.every=1",
                    "logging.wandb_mode=disabled",
                    "logging.progress_bar=false",
                ]
            )
        )
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert rows[0]["step"] == 1 and rows[0]["lr"] > 0  # step 2 runs on updated weights
        losses[impl] = {
            (r["step"], key): r[key] for r in rows for key in r if "loss" in key and isinstance(r[key], float)
        }
    assert set(losses["triton"]) == set(losses["torch"]) and any(key == "val_loss" for _, key in losses["torch"])
    assert {step for step, key in losses["torch"] if key == "loss"} == {1, 2}
    assert {key for _, key in losses["torch"]} >= {"val_loss/c4", "val_loss/commoncrawl"}
    for key, want in losses["torch"].items():
        assert losses["triton"][key] == pytest.approx(want, rel=2e-5), key


def test_memory_preflight_stand_in_saves_what_the_kernel_saves(monkeypatch):
    """mta_repro.estimate.memory measures triton layers on meta through the stand-in the
    implementation registers (``AttnImpl.meta_fn``; Triton does not run on meta): it must keep
    the bytes the real kernel keeps. (The fused kernel; the stored design's kq-conv layers:
    test_attn_stored.py.)"""
    from mta_repro.estimate import memory

    h, t, d = 4, 20, 8
    p = params(h, None, (3, 3))
    weights = {getattr(p, f).untyped_storage()._cdata for f in attention_ops.WEIGHT_FIELDS if getattr(p, f) is not None}
    q, k, v = (x.float().requires_grad_() for x in qkv(2, h, t, t, d))
    real = memory._saved_bytes(lambda: TRITON.fn(q, k, v, p, attention_ops.AttnMask()), weights)
    qm, km, vm = (torch.zeros(2, h, t, d, device="meta", requires_grad=True) for _ in range(3))
    stand_in = memory._saved_bytes(lambda: TRITON.meta_fn(qm, km, vm, p, attention_ops.AttnMask()), set())
    # q, k, v and the fp32 lse, plus the fp32 copies of the (here float64) weights the kernel reads;
    # head_kernel as the (H, H) block-diagonal matrix it multiplies with
    weight_copies = 4 * (h * h + h * 3 * 3 + h * h)
    assert real == stand_in == 3 * 2 * h * t * d * 4 + 2 * h * t * 4 + weight_copies


@pytest.mark.parametrize("post, mix", [((3, 3), "head_kernel"), (None, "wposm")])
def test_the_workspace_the_preflight_counts_is_what_the_backward_launch_holds(monkeypatch, post, mix):
    """tiles.backward_workspace_bytes (what the memory pre-flight adds per layer, through
    ``AttnImpl.workspace_bytes``) equals the bytes of every tensor the fused kernel's backward
    pass's launch receives that the call itself made: its arguments' storages, counted once,
    minus the caller's q, k, v, dO and the saved lse, and minus the placeholders of
    descriptors the pass compiles out."""
    from mta_repro.experimental.fused_triton import fused, launch

    pre = None
    h, t, d, b = 4, 24, 16, 2
    # a GPU's multi-item programs (3 over the backward's 6 or 10 tiles)
    tn = kernel_tuning(programs=3, frame="16x16")
    p = params(h, pre, post, mix=mix, tuning=tn)
    q, k, v = (x.float().contiguous().requires_grad_() for x in qkv(b, h, t, t, d))
    seen, pending, placeholders = {}, [], set()
    real_descriptor, real_kernel = launch.descriptor, fused._mta_kernel

    def descriptor(x, block, dtype, device):
        out = real_descriptor(x, block, dtype, device)
        if x is None:  # this launch's placeholder (kept alive here: storage ids are addresses)
            pending.append(out.base)
        return out

    class Kernel:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                if kw["MODE"] == 3:
                    placeholders.update(t.untyped_storage()._cdata for t in pending)
                    for a in args:
                        a = getattr(a, "base", a)
                        if isinstance(a, torch.Tensor):
                            seen[a.untyped_storage()._cdata] = a.untyped_storage().nbytes()
                pending.clear()
                return real_kernel[grid](*args, **kw)

            return launch

    monkeypatch.setattr(launch, "descriptor", descriptor)
    monkeypatch.setattr(fused, "_mta_kernel", Kernel())
    out = TRITON.fn(q, k, v, p, attention_ops.AttnMask())
    grad = torch.ones_like(out)
    lse = [x for x in out.grad_fn.saved_tensors if x is not None and x.shape == (b, h, t)]
    callers = {x.untyped_storage()._cdata for x in (q, k, v, grad, *lse)}
    out.backward(grad)
    held = sum(n for key, n in seen.items() if key not in callers and key not in placeholders)
    mix_on = (p.wpsm is not None, post_mix_matrix(p) is not None)
    want = tiles.backward_workspace_bytes(
        b=b,
        h=h,
        d=d,
        seq_len=t,
        pre=pre,
        post=post,
        mix=mix_on,
        pad_key=p.pad_key,
        dtype=torch.float32,
        n_prog=3,
        gpu=False,
        tuning=tn,
    )
    assert len(lse) == 1 and held == want


def test_bfloat16_is_as_accurate_as_the_reference_in_bfloat16():
    """bf16 inputs (the training dtype): fp32 accumulation inside the kernel, so its error
    against float64 is no worse than the reference path's own bf16 error."""
    h = 4
    p = params(h, (2, 3), (3, 3), group=2)
    q, k, v = qkv(2, h, 20, 20, 8)
    want, want_g = grads_of("torch", q, k, v, p, attention_ops.AttnMask())
    p32 = dataclasses.replace(
        p, **{f: getattr(p, f).float() for f in attention_ops.WEIGHT_FIELDS if getattr(p, f) is not None}
    )
    errors = {}
    for impl in ("torch", "triton"):
        out, g = grads_of(impl, *(x.bfloat16() for x in (q, k, v)), p32, attention_ops.AttnMask())
        assert out.dtype == torch.bfloat16
        errors[impl] = [(out.double() - want).abs().max().item()] + [
            ((g[n].double() - want_g[n]).abs().max() / want_g[n].abs().max()).item() for n in "qkv"
        ]
    for got, ref in zip(errors["triton"], errors["torch"]):
        assert got <= 2 * ref + 1e-3, errors


def test_every_pass_launches_with_the_reported_configuration(monkeypatch):
    """The fused kernel's launcher takes num_warps/num_stages from tiles.launch_config, the
    function compile_report.py compiles with, for every pass (the kernel itself replaced by a
    recorder: this checks the launch, not the math)."""
    from mta_repro.experimental.fused_triton import fused

    seen = []

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append((tiles.FUSED_PASSES[kw["MODE"]], kw["num_warps"], kw["num_stages"]))

            return launch

    monkeypatch.setattr(fused, "_mta_kernel", Recorder())
    h = 2
    p = params(h, None, (2, 3))
    q, k, v = (t.requires_grad_() for t in qkv(1, h, 5, 5, 3))
    TRITON.fn(q, k, v, p, attention_ops.AttnMask(), False).sum().backward()
    assert [s[0] for s in seen] == list(tiles.FUSED_PASSES)
    for name, nw, ns in seen:
        assert (nw, ns) == tiles.launch_config(name, None, (2, 3))
