"""The stored-scores kernels of kq-conv layers (mta_repro/experimental/fused_triton/stored.py)
against the float64 reference ("torch"): output and every gradient (q, k, v, both kernels,
both mixings), in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1: semantics,
not speed). Small frames (model.kernels.impl_options.triton.frame) put several row and key blocks in every
pass, so the stores' packed rows, the frames' halos and the dC window of kernel B cross tile
edges."""

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


def grads(fn, q, k, v, p, mask):
    ts = {"q": q, "k": k, "v": v}
    ts.update({f: getattr(p, f) for f in attention_ops.WEIGHT_FIELDS if getattr(p, f) is not None})
    ts = {n: t.detach().clone().requires_grad_() for n, t in ts.items()}
    p = dataclasses.replace(p, **{n: t for n, t in ts.items() if n not in "qkv"})
    out = fn(ts["q"], ts["k"], ts["v"], p, mask, False)
    gy = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64).to(out.dtype)
    (out * gy).sum().backward()
    return out.detach(), {n: t.grad for n, t in ts.items()}


def assert_matches_torch(q, k, v, p, mask=attention_ops.AttnMask(), rtol=1e-10, atol=1e-12):
    from mta_repro.experimental.fused_triton.stored import explicit_attention_stored

    want, want_g = grads(attention_ops.explicit_attention_torch, q.double(), k.double(), v.double(), p, mask)
    if q.dtype != torch.float64:
        p = dataclasses.replace(
            p, **{f: getattr(p, f).to(q.dtype) for f in attention_ops.WEIGHT_FIELDS if getattr(p, f) is not None}
        )
    got, got_g = grads(explicit_attention_stored, q, k, v, p, mask)
    assert got.dtype == q.dtype
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=atol)
    for name, g in want_g.items():
        torch.testing.assert_close(
            got_g[name].double(), g, rtol=rtol * 10, atol=atol * 10 * max(1.0, g.abs().max().item()), msg=name
        )


@pytest.mark.parametrize("pad_key", ["both", "left", "right"])
@pytest.mark.parametrize("post,mix,wpsm", [((2, 3), "head_kernel", True), (None, "wposm", True), ((3, 3), None, False)])
def test_stored_kernels_match_the_reference(pad_key, post, mix, wpsm):
    """Every pad_key; post conv with head_kernel and wpsm / wposm without post conv / post conv
    without mixings: 16 x 16 frames over T = 19 (two row blocks, several key blocks)."""
    h = 2
    q, k, v = qkv(1, h, 19, 19, 3)
    assert_matches_torch(
        q,
        k,
        v,
        params(h, (2, 3), post, mix=mix, wpsm=wpsm, pad_key=pad_key, group=2, tuning=kernel_tuning(frame="16x16")),
    )


def test_stored_kernels_with_padding_offset_and_two_programs():
    """Left padding whose edge falls inside a frame, cached keys (q_offset), 4-row mixing slabs
    and two persistent programs (items of several tiles, partials added across a row's key
    blocks), the 880M model's c_k = 11 is too wide for 16 x 16 frames: 6 x 5 kernels here."""
    tn = kernel_tuning(frame="16x32", slab_rows=4, programs=2)
    h = 4
    key_valid = torch.ones(2, 29, dtype=torch.bool)
    key_valid[1, :11] = False
    q, k, v = qkv(2, h, 13, 29, 3, seed=2)  # 13 new queries after 16 cached keys
    assert_matches_torch(
        q,
        k,
        v,
        params(h, (6, 5), (3, 5), mix="wposm", pad_key="both", tuning=tn),
        attention_ops.AttnMask(16, key_valid),
    )


def test_stored_kernels_in_float32():
    """float32 inputs: C and dC stored in float32, the accumulators through the interpreter's
    descriptor reductions; float32 accuracy against the float64 reference."""
    h = 2
    q, k, v = qkv(1, h, 21, 21, 3, seed=3)
    assert_matches_torch(
        q.float(),
        k.float(),
        v.float(),
        params(h, (3, 3), (2, 3), group=2, tuning=kernel_tuning(frame="16x16")),
        rtol=1e-4,
        atol=1e-5,
    )


def test_triton_runs_the_stored_design_for_kq_conv_layers_and_the_fused_kernel_for_the_rest(monkeypatch):
    """``model.attn_impl=triton`` has one design per layer kind: a kq-conv layer (a
    pre-softmax kernel) runs the stored-scores kernels, every other layer (mixing only, or a
    post-softmax convolution only) the fused kernel; the geometry follows the same rule."""
    from mta_repro.experimental.fused_triton import fused, stored

    ran = []
    monkeypatch.setattr(stored, "explicit_attention_stored", lambda *a: ran.append("stored"))
    monkeypatch.setattr(fused, "explicit_attention_fused", lambda *a: ran.append("fused"))
    q, k, v = qkv(1, 2, 5, 5, 3)
    for pre, post in (((2, 3), (2, 3)), ((2, 3), None), (None, (2, 3)), (None, None)):
        attention_ops.attn_impl("triton").fn(q, k, v, params(2, pre, post), attention_ops.AttnMask())
    assert ran == ["stored", "stored", "fused", "fused"]
    assert [tiles.design(pre) for pre in ((2, 3), None)] == ["stored", "fused"]
    assert tiles.passes((2, 3)) == tiles.STORED_PASSES and tiles.passes(None) == tiles.FUSED_PASSES
    with pytest.raises(ValueError, match="unknown pass 'backward' of the stored design"):
        tiles.halo("backward", (2, 3), None, "both")


def test_memory_preflight_stand_in_saves_the_stored_c_plane():
    """The memory pre-flight's stand-in for a triton kq-conv layer keeps what the stored kernels
    keep for backward: q, k, v, the fp32 lse, the weights' fp32 copies and the packed causal C
    plane (B x H x T(T+1)/2 in the inputs' dtype)."""
    from mta_repro.estimate import memory

    h, t, d = 4, 20, 8
    p = params(h, (2, 3), (3, 3))
    weights = {getattr(p, f).untyped_storage()._cdata for f in attention_ops.WEIGHT_FIELDS if getattr(p, f) is not None}
    q, k, v = (x.float().requires_grad_() for x in qkv(2, h, t, t, d))
    entry = attention_ops.attn_impl("triton")
    real = memory._saved_bytes(lambda: entry.fn(q, k, v, p, attention_ops.AttnMask()), weights)
    qm, km, vm = (torch.zeros(2, h, t, d, device="meta", requires_grad=True) for _ in range(3))
    stand_in = memory._saved_bytes(lambda: entry.meta_fn(qm, km, vm, p, attention_ops.AttnMask()), set())
    weight_copies = 4 * (h * 2 * 3 + h * h + h * 3 * 3 + h * h)
    c_plane = 2 * h * (t * (t + 1) // 2) * 4
    assert real == stand_in == 3 * 2 * h * t * d * 4 + 2 * h * t * 4 + weight_copies + c_plane


def test_every_stored_pass_launches_with_its_configuration(monkeypatch):
    """The stored launcher runs stats, forward, backward_rowsum, backward_dc, backward_b in this
    order with tiles.launch_config (what compile_report.py compiles with); the kernels
    replaced by recorders: this checks the launches, not the math."""
    from mta_repro.experimental.fused_triton import stored

    seen = []

    class Recorder:
        def __init__(self, fixed=None):
            self.fixed = fixed

        def __getitem__(self, grid):
            def launch(*args, **kw):
                name = self.fixed or ("stats", "forward", "backward_rowsum", "backward_dc")[kw["MODE"]]
                seen.append((name, kw["num_warps"], kw["num_stages"]))

            return launch

    monkeypatch.setattr(stored, "_stored_kernel", Recorder())
    monkeypatch.setattr(stored, "_kernel_b", Recorder("backward_b"))
    h = 2
    q, k, v = (t.requires_grad_() for t in qkv(1, h, 5, 5, 3))
    attention_ops.attn_impl("triton").fn(q, k, v, params(h, (2, 3), (2, 3)), attention_ops.AttnMask()).sum().backward()
    assert [s[0] for s in seen] == list(tiles.STORED_PASSES)
    for name, nw, ns in seen:
        assert (nw, ns) == tiles.launch_config(name, (2, 3), (2, 3))


def test_no_unwritten_store_or_scratch_cell_is_read(monkeypatch):
    """Every buffer the launcher allocates uninitialised (the C and dC stores, the scratch)
    starts as NaN here: a read of a cell no pass wrote (e.g. a padded causal cell of C, which
    the statistics pass must still write, since its readers mask by causality only) would
    reach a gradient. Left padding inside a frame, several row and key blocks."""
    real_empty = torch.empty

    def nan_empty(*args, **kw):
        t = real_empty(*args, **kw)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", nan_empty)
    h = 4
    key_valid = torch.ones(2, 25, dtype=torch.bool)
    key_valid[1, :19] = False
    q, k, v = qkv(2, h, 25, 25, 3)  # two row blocks (three in dC's pass) of up to two key blocks
    assert_matches_torch(
        q,
        k,
        v,
        params(h, (2, 3), (3, 3), group=2, tuning=kernel_tuning(frame="16x16")),
        attention_ops.AttnMask(0, key_valid),
    )
