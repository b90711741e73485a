"""The public op and module (mta_repro.mta) against the float64 reference and this project's
attention layer, for every option: outputs and gradients; cached decoding; the release's
initialisation; one-line errors; the self-check's fallback; an import free of Hydra."""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mta_repro.errors import UserError
from mta_repro.model import ModelArgs, attention_ops, selfcheck
from mta_repro.model.args import MTAArgs
from mta_repro.model.transformer import Attention, apply_rope, rope_cos_sin
from mta_repro.mta import MultiTokenAttention, multi_token_attention, query_history
from mta_repro.mta import functional as mta_functional

ROOT = Path(__file__).resolve().parents[1]
F64 = torch.float64
B, H, T, D = 2, 4, 11, 8

# Option sets (MTAArgs fields): each part alone, the release's MTA layer, the extremes.
OPTIONS = {
    "plain": {},
    "pre_both": dict(query_kernel_size=3, key_kernel_size=5),
    "pre_left": dict(query_kernel_size=2, key_kernel_size=4, pad_key="left"),
    "pre_right": dict(query_kernel_size=3, key_kernel_size=2, pad_key="right"),
    "post": dict(after_sm_query_kernel_size=3, after_sm_key_kernel_size=3),
    "release_880m": dict(
        query_kernel_size=3,
        key_kernel_size=5,
        after_sm_query_kernel_size=2,
        after_sm_key_kernel_size=3,
        pre_sm_linear_head=True,
        head_kernel_size=2,
        group_norm=True,
        add_gating=True,
    ),
    "talking_heads": dict(pre_sm_linear_head=True, post_sm_linear_head=True),
    "full_head_conv": dict(head_kernel_size=4),
    "norm_rescale_gate_2d": dict(
        query_kernel_size=2, key_kernel_size=3, group_norm=True, layer_norm_rescale=True, add_gating=True, gate_1d=False
    ),
}


def _randomised(mod: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter moved off its (identity) init, so each part changes the output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in mod.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return mod


def _qkv(h_kv=H, t=T, dtype=F64, seed=1):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, t, D, generator=g, dtype=F64)
    k, v = (torch.randn(B, h_kv, t, D, generator=g, dtype=F64) for _ in range(2))
    return [x.to(dtype).requires_grad_() for x in (q, k, v)]


def reference(q, k, v, mod: MultiTokenAttention, key_valid=None, q_offset=0):
    """float64: K/V repeated per query head (repeat_interleave), the reference score path
    (``explicit_attention_torch``, checked against loops in test_attention_ops.py), then the
    group norm and the gate as plain formulas."""
    n_rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1)
    w = lambda lin: None if lin is None else lin.weight  # noqa: E731
    p = attention_ops.ExplicitAttnParams(
        mta_kernel=mod.mta_kernel,
        wpsm=w(mod.wpsm),
        mta_kernel_after_sm=mod.mta_kernel_after_sm,
        head_kernel=mod.head_kernel,
        wposm=w(mod.wposm),
        pad_key=mod.pad_key,
    )
    out = attention_ops.explicit_attention_torch(q, k, v, p, attention_ops.AttnMask(q_offset, key_valid))
    if mod.subln is not None:
        out = out / torch.sqrt(out.pow(2).mean(-1, keepdim=True) + 1e-5) * mod.subln.weight
        if mod.layer_norm_rescale:
            out = out * (1 - (0.8 - 0.6 * math.exp(-0.3 * mod.layer_id)))
    if mod.gate is not None:
        out = out * torch.sigmoid(out @ mod.gate.weight.T + mod.gate.bias)
    return out


def _grads(out, gy, tensors):
    return torch.autograd.grad(out, tensors, gy, allow_unused=True)


@pytest.mark.parametrize("attn_impl", ["blocked", "torch"])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_outputs_and_gradients_equal_the_float64_reference(name, attn_impl):
    """float64, GQA (2 K/V heads for 4 query heads), blocks of 4 rows crossing the halo."""
    mod = _randomised(
        MultiTokenAttention(H, D, layer_id=3, attn_impl=attn_impl, attn_block_size=4, dtype=F64, **OPTIONS[name])
    )
    q, k, v = _qkv(h_kv=2)
    gy = torch.randn(B, H, T, D, dtype=F64)
    params = list(mod.parameters())
    got = mod(q, k, v)
    want = reference(q, k, v, mod)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    for a, b in zip(_grads(got, gy, [q, k, v, *params]), _grads(want, gy, [q, k, v, *params])):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("attn_impl", ["blocked", "torch"])
@pytest.mark.parametrize("name", ["release_880m", "post", "plain"])
def test_no_query_gives_an_empty_result_as_no_sequence_does(name, attn_impl):
    """T = 0 (and 0 queries after 5 cached keys) gives (B, H, 0, dv), as B = 0 gives
    (0, H, T, dv); the result stays in q's graph, so a loss over it backpropagates."""
    mod = _randomised(MultiTokenAttention(H, D, attn_impl=attn_impl, dtype=F64, **OPTIONS[name]))
    for tq, tk in ((0, 0), (0, 5)):
        q = torch.randn(B, H, tq, D, dtype=F64, requires_grad=True)
        k, v = torch.randn(B, H, tk, D, dtype=F64), torch.randn(B, H, tk, D, dtype=F64)
        out = mod(q, k, v)
        assert out.shape == (B, H, 0, D) and out.dtype == F64
        out.sum().backward()
        assert q.grad is not None and q.grad.shape == q.shape
    q, k, v = (torch.randn(0, H, T, D, dtype=F64) for _ in range(3))
    assert mod(q, k, v).shape == (0, H, T, D)


@pytest.mark.parametrize("name", ["release_880m", "pre_left", "plain"])
def test_float32_is_within_rounding_of_float64(name):
    mod = _randomised(MultiTokenAttention(H, D, attn_block_size=4, **OPTIONS[name]))
    q, k, v = _qkv(dtype=torch.float32)
    want = reference(*(x.detach().double() for x in (q, k, v)), copy.deepcopy(mod).double())
    assert (mod(q, k, v).double() - want).abs().max() < 1e-5


@pytest.mark.parametrize("name", ["release_880m", "pre_right", "plain", "post"])
def test_left_padding_and_q_offset_equal_the_reference(name):
    """A left-padded batch (attention_mask 0 at the first 3 keys of row 0) and queries that
    start after the first keys: the real rows equal the reference's; a pad row is zeros
    (the explicit path) and gets no gradient from real rows."""
    mod = _randomised(MultiTokenAttention(H, D, attn_block_size=4, dtype=F64, **OPTIONS[name]))
    q, k, v = _qkv()
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, :3] = 0
    real = mask.bool()[:, None, :, None]
    gy = torch.randn(B, H, T, D, dtype=F64) * real
    got = mod(q, k, v, attention_mask=mask)
    want = reference(q, k, v, mod, key_valid=mask.bool())
    torch.testing.assert_close(got * real, want * real, rtol=1e-10, atol=1e-10)
    for a, b in zip(_grads(got, gy, [q, k, v]), _grads(want, gy, [q, k, v])):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
    # 5 queries at positions 6..10 of 11 keys (q_offset defaults to Tk - Tq)
    q5 = q[:, :, 6:]
    torch.testing.assert_close(mod(q5, k, v), reference(q5, k, v, mod, q_offset=6), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", ["release_880m", "pre_both", "post"])
def test_cached_decoding_with_the_query_history_equals_the_full_pass(name):
    """Token by token: the new query after the last ``query_history`` ones, every key so far:
    each new row equals the full pass's row (what the Hugging Face insertion keeps)."""
    mod = _randomised(MultiTokenAttention(H, D, dtype=F64, **OPTIONS[name]))
    w = mod.query_history
    assert (
        w
        == query_history(mod.mta_kernel, mod.mta_kernel_after_sm)
        == (
            (OPTIONS[name].get("query_kernel_size") or 1)
            - 1
            + (OPTIONS[name].get("after_sm_query_kernel_size") or 1)
            - 1
        )
    )
    q, k, v = (x.detach() for x in _qkv())
    full = mod(q, k, v)
    with torch.no_grad():
        for t in range(1, T + 1):
            rows = mod(q[:, :, max(0, t - 1 - w) : t], k[:, :, :t], v[:, :, :t])
            torch.testing.assert_close(rows[:, :, -1], full[:, :, t - 1], rtol=1e-12, atol=1e-12)


LAYER_CONFIGS = {
    "mta": dict(n_kv_heads=2, mta=MTAArgs(use_mta=True, **OPTIONS["release_880m"])),
    "mta_rescale": dict(mta=MTAArgs(use_mta=True, **OPTIONS["norm_rescale_gate_2d"])),
    "talking_heads": dict(mta=MTAArgs(use_mta=True, pre_sm_linear_head=True, head_kernel_size=4)),
    "baseline_gqa": dict(n_kv_heads=1),
}


@pytest.mark.parametrize("name", list(LAYER_CONFIGS))
def test_the_module_in_a_model_equals_this_projects_attention_layer(name):
    """The project's Attention (layer 5) and the same projections around MultiTokenAttention
    carrying its MTA parameters (loaded by name: the release's names): equal outputs and
    gradients, float64."""
    args = ModelArgs(dim=H * D, n_layers=6, n_heads=H, attn_block_size=4, **LAYER_CONFIGS[name])
    attn = Attention(args, layer_id=5).double()
    attn.reset_parameters()
    _randomised(attn)
    m = args.mta
    opts = {
        f.name: getattr(m, f.name)
        for f in dataclasses.fields(MTAArgs)
        if f.name not in ("use_mta", "mta_layers", "curse_norm")
    }
    mod = MultiTokenAttention(H, D, layer_id=5, attn_block_size=4, dtype=F64, **opts)
    mta_names = set(mod.state_dict())
    assert mta_names == {k for k in attn.state_dict() if k.split(".")[0] not in ("wq", "wk", "wv", "wo")}
    mod.load_state_dict({k: v for k, v in attn.state_dict().items() if k in mta_names}, strict=True)

    x = torch.randn(B, T, H * D, dtype=F64, requires_grad=True)
    cos, sin = rope_cos_sin(D, torch.arange(T), args.rope_theta, F64)
    want = attn(x, cos, sin)
    h_kv = args.resolved_n_kv_heads
    q = apply_rope(attn.wq(x).view(B, T, H, D), cos, sin).transpose(1, 2)
    k = apply_rope(attn.wk(x).view(B, T, h_kv, D), cos, sin).transpose(1, 2)
    v = attn.wv(x).view(B, T, h_kv, D).transpose(1, 2)
    got = attn.wo(mod(q, k, v).transpose(1, 2).reshape(B, T, H * D))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    gy = torch.randn_like(want)
    ours = _grads(got, gy, [x, *mod.parameters()])
    theirs = _grads(want, gy, [x, *(dict(attn.named_parameters())[n] for n, _ in mod.named_parameters())])
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("init_method", ["identity", "const", "uniform", "diagonal", "normal"])
def test_initialisation_is_the_release_one(init_method):
    """The same draws as the project's layer (the release's init, one implementation), and at
    identity (every init for the parts after the pre-softmax kernel) the layer computes
    plain causal attention: softmax(q k^T / sqrt(d)) v, masked, by formula."""
    opts = dict(OPTIONS["release_880m"], group_norm=False, add_gating=False, init_method=init_method)
    args = ModelArgs(dim=H * D, n_layers=2, n_heads=H, mta=MTAArgs(use_mta=True, **opts))
    attn, mod = Attention(args, layer_id=1), MultiTokenAttention(H, D, layer_id=1, **opts)
    torch.manual_seed(7)
    attn.reset_mta_parameters()
    torch.manual_seed(7)
    mod.reset_parameters()
    for name, t in mod.state_dict().items():
        assert torch.equal(t, attn.state_dict()[name]), name
    if init_method != "identity":
        return
    q, k, v = (x.detach() for x in _qkv())
    s = q @ k.transpose(-1, -2) / math.sqrt(D)
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    plain = torch.softmax(s, -1) @ v
    torch.testing.assert_close(MultiTokenAttention(H, D, dtype=F64, **opts)(q, k, v), plain, rtol=1e-12, atol=1e-12)


def test_gate_init_and_dtype_device_arguments():
    mod = MultiTokenAttention(H, D, add_gating=True, group_norm=True, dim=1024, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in mod.parameters())
    assert mod.gate.bias.abs().max() == 0 and 0 < mod.gate.weight.float().std() < 2 * 1024**-0.5
    meta = MultiTokenAttention(H, D, query_kernel_size=2, key_kernel_size=3, device="meta")
    assert meta.mta_kernel.is_meta
    q = torch.randn(1, H, 5, D, dtype=torch.bfloat16)
    assert mod(q, q, q).dtype == torch.bfloat16


BAD_CALLS = [
    (lambda q, k, v: multi_token_attention(q[0], k, v), "q: expected a 4-D tensor"),
    (lambda q, k, v: multi_token_attention(q, k[:, :3], v[:, :3]), "must divide q's 4"),
    (lambda q, k, v: multi_token_attention(q, k.double(), v), "one floating dtype"),
    (lambda q, k, v: multi_token_attention(q, k[:, :, :5], v[:, :, :5]), "11 queries but 5 keys"),
    (
        lambda q, k, v: multi_token_attention(q, k, v, kq_kernel=torch.zeros(3, 1, 2, 3)),
        "kq_kernel: expected shape (4, 1",
    ),
    (lambda q, k, v: multi_token_attention(q, k, v, kq_kernel=torch.zeros(4, 1, 2, 4)), "must be odd"),
    (
        lambda q, k, v: multi_token_attention(q, k, v, pre_softmax_head_mixing=torch.zeros(4, 3)),
        "pre_softmax_head_mixing: expected shape (4, 4)",
    ),
    (lambda q, k, v: multi_token_attention(q, k, v, head_kernel=torch.zeros(2, 3, 3)), "head_kernel: expected"),
    (
        lambda q, k, v: multi_token_attention(
            q, k, v, head_kernel=torch.zeros(2, 2, 2), post_softmax_head_mixing=torch.zeros(4, 4)
        ),
        "two forms of post-softmax",
    ),
    (lambda q, k, v: multi_token_attention(q, k, v, pad_key="centre"), "pad_key='centre'"),
    (lambda q, k, v: multi_token_attention(q, k, v, layer_norm_rescale=True), "needs group_norm_weight"),
    (lambda q, k, v: multi_token_attention(q, k, v, gate_weight=torch.zeros(2, 8)), "gate_weight: expected shape"),
    (lambda q, k, v: multi_token_attention(q, k, v, attention_mask=torch.ones(2, 1, 11, 11)), "attention_mask"),
    (lambda q, k, v: multi_token_attention(q, k, v, attention_mask=torch.zeros(2, 11)), "bool or 0/1"),
    (lambda q, k, v: multi_token_attention(q, k, v, q_offset=1), "q_offset=1"),
    (lambda q, k, v: multi_token_attention(q, k, v, attn_impl="fast"), "unknown implementation 'fast'"),
    (lambda q, k, v: multi_token_attention(q, k, v, dropout_p=1.0), "dropout_p=1.0"),
    (lambda q, k, v: MultiTokenAttention(4, 8, query_kernel_size=3), "set together"),
    (lambda q, k, v: MultiTokenAttention(4, 8, head_kernel_size=3), "head_kernel_size=3 must divide n_heads=4"),
    (lambda q, k, v: MultiTokenAttention(4, 8, init_method="eye"), "init_method"),
    (lambda q, k, v: MultiTokenAttention(4, 8, layer_norm_rescale=True), "needs group_norm"),
    (lambda q, k, v: MultiTokenAttention(4, 8, attn_impl="fast"), "attn_impl"),
    (lambda q, k, v: MultiTokenAttention(4, 0), "head_dim=0"),
    (
        lambda q, k, v: MultiTokenAttention(4, 8, query_kernel_size=2, key_kernel_size=3)(q[:, :2], k[:, :2], v[:, :2]),
        "kq_kernel: expected shape (2, 1",
    ),
    (
        lambda q, k, v: multi_token_attention(
            q, k, v, kq_kernel=torch.zeros(4, 1, 2, 3), mta_kernel=torch.zeros(4, 1, 2, 3)
        ),
        "mta_kernel and kq_kernel are one weight",
    ),
    (lambda q, k, v: MultiTokenAttention(4, 8, query_kernel_size=2, key_kernel_size=4), "key_kernel_size=4: pad_key"),
]


@pytest.mark.parametrize("call, words", BAD_CALLS, ids=[w for _, w in BAD_CALLS])
def test_a_wrong_shape_or_option_is_a_one_line_user_error(call, words):
    q, k, v = (torch.zeros(2, 4, 11, 8) for _ in range(3))
    with pytest.raises(UserError) as e:
        call(q, k, v)
    msg = str(e.value)
    assert isinstance(e.value, ValueError) and "\n" not in msg and words in msg
    assert msg.startswith(("multi_token_attention: ", "MultiTokenAttention: ")), msg
    assert "model." not in msg, msg  # options named as the caller wrote them, not as a config's


WRONG_IMPL = attention_ops.AttnImpl(
    lambda q, k, v, p, mask, training=False: (
        attention_ops.explicit_attention_blocked(q, k, v, p, mask, training) * 1.01
    ),
    fallback="blocked",
)


@pytest.fixture
def wrong_impl(monkeypatch):
    monkeypatch.setitem(attention_ops.ATTN_IMPLS, "wrong_scale", WRONG_IMPL)
    monkeypatch.setattr(mta_functional, "_decisions", {})
    yield
    selfcheck._cache.clear()


def test_selfcheck_falls_back_from_a_wrong_implementation_once(wrong_impl):
    """A registered implementation 1% off: the float64 self-check (asked for on the CPU) warns
    once, falls back to blocked and the output is right; strict refuses in one line; off
    runs what was asked for."""
    opts = dict(OPTIONS["release_880m"], group_norm=False, add_gating=False)  # a norm would hide the 1%
    mod = _randomised(MultiTokenAttention(H, D, attn_impl="wrong_scale", selfcheck="warn", **opts))
    q, k, v = (x.detach() for x in _qkv(dtype=torch.float32))
    want = reference(*(x.double() for x in (q, k, v)), mod.double()).float()
    mod.float()
    with pytest.warns(
        UserWarning,
        match=r"model.attn_impl=wrong_scale failed on cpu in float32.*falling back "
        r"to blocked",
    ):
        out = mod(q, k, v)
    assert (out - want).abs().max() < 1e-5
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mod(q, k, v)  # decided once
    mod.selfcheck = "strict"
    with pytest.raises(selfcheck.SelfCheckError, match="refuses"):
        mod(q, k, v)
    mod.selfcheck = "off"
    assert (mod(q, k, v) / want).median().item() == pytest.approx(1.01, rel=1e-4)


def test_the_release_names_still_work_with_a_deprecation_warning():
    """The release's keyword names give the same result as the descriptive ones, each with a
    DeprecationWarning that names its replacement."""
    mod = _randomised(MultiTokenAttention(H, D, dtype=F64, **OPTIONS["release_880m"]))
    q, k, v = (x.detach() for x in _qkv())
    w = lambda lin: None if lin is None else lin.weight  # noqa: E731
    new = dict(
        kq_kernel=mod.mta_kernel,
        pre_softmax_head_mixing=w(mod.wpsm),
        kq_kernel_after_softmax=mod.mta_kernel_after_sm,
        head_kernel=mod.head_kernel,
        group_norm_weight=w(mod.subln),
    )
    old = dict(
        mta_kernel=mod.mta_kernel,
        wpsm=w(mod.wpsm),
        mta_kernel_after_sm=mod.mta_kernel_after_sm,
        head_kernel=mod.head_kernel,
        subln_weight=w(mod.subln),
    )
    want = multi_token_attention(q, k, v, **new)
    with pytest.warns(DeprecationWarning) as record:
        got = multi_token_attention(q, k, v, **old)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    said = " ".join(str(r.message) for r in record)
    for name in ("kq_kernel=", "pre_softmax_head_mixing=", "kq_kernel_after_softmax=", "group_norm_weight="):
        assert f"pass {name}" in said, said
    with pytest.warns(DeprecationWarning, match="pass kq_kernel="):
        assert query_history(mta_kernel=mod.mta_kernel) == query_history(mod.mta_kernel) == 2
    with pytest.raises(TypeError, match="kernel_size"):
        multi_token_attention(q, k, v, kernel_size=3)


def test_the_release_names_go_in_the_version_their_docstring_names():
    """The deprecated release keywords stay through 0.1.x (warning that 0.2.0 removes them)
    and are gone from 0.2.0 on: this fails once the package's version reaches 0.2.0 while
    multi_token_attention still takes them."""
    import mta_repro

    version = tuple(int(x) for x in mta_repro.__version__.split(".")[:2])
    q, k, v = (x.detach() for x in _qkv())
    kernel = torch.zeros(H, 1, 2, 3, dtype=F64)
    if version < (0, 2):
        assert mta_functional.RELEASE_NAMES_REMOVED_IN == "0.2.0"
        assert "0.2.0" in (multi_token_attention.__doc__ or "")
        with pytest.warns(DeprecationWarning, match=r"removed in 0\.2\.0"):
            multi_token_attention(q, k, v, mta_kernel=kernel)
    else:
        with pytest.raises(TypeError, match="mta_kernel"):
            multi_token_attention(q, k, v, mta_kernel=kernel)


def test_no_selfcheck_runs_unless_asked(monkeypatch):
    """The op and the module compute with the implementation asked for: by default neither
    runs the float64 self-check (on any device); "warn" asks for it."""
    calls = []
    monkeypatch.setattr(selfcheck, "decide", lambda *a, **kw: calls.append(a) or pytest.fail("self-check ran"))
    monkeypatch.setattr(mta_functional, "_decisions", {})
    mod = _randomised(MultiTokenAttention(H, D, **OPTIONS["release_880m"]))
    q, k, v = (x.detach().float() for x in _qkv())
    mod(q, k, v)
    multi_token_attention(q, k, v, kq_kernel=mod.mta_kernel)
    assert calls == []
    monkeypatch.setattr(
        selfcheck,
        "decide",
        lambda *a, **kw: calls.append(a) or selfcheck.Decision("blocked", "blocked", "cpu", "float32"),
    )
    multi_token_attention(q, k, v, kq_kernel=mod.mta_kernel, selfcheck="warn")
    assert len(calls) == 1


TRITON_PROBE = """
import warnings
import torch
from mta_repro.mta import multi_token_attention

warnings.simplefilter("error")  # a fallback to another implementation would warn
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 2, 6, 16, generator=g) for _ in range(3))
kernel = 0.5 * torch.randn(2, 1, 2, 3, generator=g)
want = multi_token_attention(q, k, v, kq_kernel=kernel, attn_impl="torch")
got = multi_token_attention(q, k, v, kq_kernel=kernel, attn_impl="triton")
from mta_repro.model import attention_ops

print("loaded:", attention_ops.attn_impl("triton").fn.__module__)
print("err:", (got - want).abs().max().item())
"""


@pytest.mark.slow
@pytest.mark.triton
def test_the_op_finds_the_triton_implementation_through_the_registry():
    """A fresh interpreter that imports only ``mta_repro.mta`` asks for attn_impl="triton": the
    registry loads it from its entry point, it runs (Triton's interpreter, no fallback) and
    agrees with the reference implementation."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    p = subprocess.run(
        [sys.executable, "-c", TRITON_PROBE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert "loaded: mta_repro.experimental.fused_triton" in p.stdout, p.stdout
    assert float(p.stdout.split("err:")[1]) < 1e-5, p.stdout


def test_nothing_in_the_package_imports_the_op_and_it_imports_only_the_core():
    """The op sits on top of the model (a leaf): model/ and every other package never import
    it; it imports errors, kernels and model only (transformers lazily, in its HF module)."""
    import ast

    def imports(p):
        out = set()
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Import):
                out |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                out.add(node.module)
        return out

    pkg = ROOT / "mta_repro"
    users = [
        str(p.relative_to(pkg))
        for p in pkg.rglob("*.py")
        if p.parent.name != "mta" and any(m.startswith("mta_repro.mta") for m in imports(p))
    ]
    assert not users, users
    allowed = ("mta_repro.errors", "mta_repro.kernels", "mta_repro.model", "mta_repro.mta")
    out = {
        f"{p.name} -> {m}"
        for p in (pkg / "mta").glob("*.py")
        for m in imports(p)
        if m.startswith("mta_repro") and not m.startswith(allowed)
    }
    assert not out, out


PROBE = """
import sys
import torch
from mta_repro.mta import MultiTokenAttention
mod = MultiTokenAttention(4, 8, query_kernel_size=2, key_kernel_size=3, head_kernel_size=2)
q = torch.randn(1, 4, 6, 8, requires_grad=True)
mod(q, q, q).sum().backward()
heavy = ("hydra", "omegaconf", "lm_eval", "wandb", "transformers", "datasets")
print("loaded:", sorted({m.split(".")[0] for m in sys.modules} & set(heavy)))
"""


@pytest.mark.slow
def test_the_op_imports_without_hydra_omegaconf_transformers_lm_eval_or_wandb():
    """``import mta_repro.mta`` in a clean interpreter, a forward and backward: no Hydra, no
    OmegaConf (no resolver registration at ``import mta_repro``), no transformers, lm-eval,
    wandb or datasets in ``sys.modules`` (torch's own checkpointing imports triton where it is
    installed)."""
    p = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "loaded: []" in p.stdout, p.stdout
