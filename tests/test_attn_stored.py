"""The stored-scores kq-conv kernels (``mta_repro/kernels/attention_stored.py``, issue #37
item 1) against the float64 reference ("torch"): output and every gradient (q, k, v, both
kernels, both mixings), in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1:
semantics, not speed). Small frames (MTA_TRITON_FRAME) put several row and key blocks in
every pass, so the stores' packed rows, the frames' halos and the dC window of kernel B
cross tile edges."""

import dataclasses
import importlib.util

import pytest
import torch

from mta_repro.model import attention_ops
from tests.test_attn_triton import params, qkv

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")


def grads(fn, q, k, v, p, mask):
    ts = {"q": q, "k": k, "v": v}
    ts.update({f: getattr(p, f) for f in attention_ops._WEIGHT_FIELDS if getattr(p, f) is not None})
    ts = {n: t.detach().clone().requires_grad_() for n, t in ts.items()}
    p = dataclasses.replace(p, **{n: t for n, t in ts.items() if n not in "qkv"})
    out = fn(ts["q"], ts["k"], ts["v"], p, mask, False)
    gy = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64).to(out.dtype)
    (out * gy).sum().backward()
    return out.detach(), {n: t.grad for n, t in ts.items()}


def assert_matches_torch(q, k, v, p, mask=attention_ops.AttnMask(), rtol=1e-10, atol=1e-12):
    from mta_repro.kernels.attention_stored import explicit_attention_stored

    want, want_g = grads(attention_ops.explicit_attention_torch, q.double(), k.double(), v.double(), p, mask)
    if q.dtype != torch.float64:
        p = dataclasses.replace(p, **{f: getattr(p, f).to(q.dtype) for f in attention_ops._WEIGHT_FIELDS
                                      if getattr(p, f) is not None})
    got, got_g = grads(explicit_attention_stored, q, k, v, p, mask)
    assert got.dtype == q.dtype
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=atol)
    for name, g in want_g.items():
        torch.testing.assert_close(got_g[name].double(), g, rtol=rtol * 10, atol=atol * 10 * max(1.0, g.abs().max().item()),
                                   msg=name)


@pytest.mark.parametrize("pad_key", ["both", "left", "right"])
@pytest.mark.parametrize("post,mix,wpsm", [((2, 3), "head_kernel", True), (None, "wposm", True),
                                           ((3, 3), None, False)])
def test_stored_kernels_match_the_reference(monkeypatch, pad_key, post, mix, wpsm):
    """Every pad_key; post conv with head_kernel and wpsm / wposm without post conv / post conv
    without mixings: 16 x 16 frames over T = 19 (two row blocks, several key blocks)."""
    monkeypatch.setenv("MTA_TRITON_FRAME", "16x16")
    h = 2
    q, k, v = qkv(1, h, 19, 19, 3)
    assert_matches_torch(q, k, v, params(h, (2, 3), post, mix=mix, wpsm=wpsm, pad_key=pad_key, group=2))


def test_stored_kernels_with_padding_offset_and_two_programs(monkeypatch):
    """Left padding whose edge falls inside a frame, cached keys (q_offset), 4-row mixing slabs
    and two persistent programs (items of several tiles, partials added across a row's key
    blocks), the 880M model's c_k = 11 is too wide for 16 x 16 frames: 6 x 5 kernels here."""
    monkeypatch.setenv("MTA_TRITON_FRAME", "16x32")
    monkeypatch.setenv("MTA_TRITON_SLAB_ROWS", "4")
    monkeypatch.setenv("MTA_TRITON_PROGRAMS", "2")
    h = 4
    key_valid = torch.ones(2, 29, dtype=torch.bool)
    key_valid[1, :11] = False
    q, k, v = qkv(2, h, 13, 29, 3, seed=2)  # 13 new queries after 16 cached keys
    assert_matches_torch(q, k, v, params(h, (6, 5), (3, 5), mix="wposm", pad_key="both"),
                         attention_ops.AttnMask(16, key_valid))


def test_stored_kernels_in_float32(monkeypatch):
    """float32 inputs: C and dC stored in float32, the accumulators through the interpreter's
    descriptor reductions; float32 accuracy against the float64 reference."""
    monkeypatch.setenv("MTA_TRITON_FRAME", "16x16")
    h = 2
    q, k, v = qkv(1, h, 21, 21, 3, seed=3)
    assert_matches_torch(q.float(), k.float(), v.float(), params(h, (3, 3), (2, 3), group=2), rtol=1e-4, atol=1e-5)
