"""Every built-in explicit-path implementation against the "torch" reference (float64), and
the registry that finds the others by name.

The reference itself is checked against plain loops in test_attention_ops.py; here each other
implementation must give the same outputs and the same gradients of q, k, v and every
score-path parameter, for every option the configs use. (The experimental "triton" runs
these same tests in tests/experimental/test_triton_parity.py.)
"""

import dataclasses
from pathlib import Path

import pytest
import torch

from mta_repro.errors import UserError
from mta_repro.kernels import kq_conv_cpu
from mta_repro.model import ModelArgs, MTAArgs, attention_ops, attention_registry, build_model

# The core's implementations but the reference.
IMPLS = ["blocked", "blocked+conv2d"]
H, D = 4, 3


def make_params(
    pad_key="both", pre=(2, 3), post=(3, 3), mix="head_kernel", wpsm=True, dropout=0.0, block_size=4, seed=0
):
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    return attention_ops.ExplicitAttnParams(
        mta_kernel=rand(H, 1, *pre) if pre else None,
        wpsm=rand(H, H) if wpsm else None,
        mta_kernel_after_sm=rand(H, 1, *post) if post else None,
        head_kernel=rand(2, 2, 2) if mix == "head_kernel" else None,
        wposm=rand(H, H) if mix == "wposm" else None,
        pad_key=pad_key,
        dropout=dropout,
        block_size=block_size,
    )


def qkv(b=2, tq=11, tk=11, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, H, t, D, generator=g, dtype=torch.float64) for t in (tq, tk, tk)]


def leaves(q, k, v, p):
    """Fresh leaf tensors for q, k, v and every present parameter (grads compared)."""
    ts = {"q": q, "k": k, "v": v}
    ts.update({f: getattr(p, f) for f in attention_ops.WEIGHT_FIELDS if getattr(p, f) is not None})
    ts = {n: t.detach().clone().requires_grad_() for n, t in ts.items()}
    p = dataclasses.replace(p, **{n: t for n, t in ts.items() if n not in "qkv"})
    return ts, p


def run(impl, q, k, v, p, mask, training=False, seed=None):
    ts, p = leaves(q, k, v, p)
    if seed is not None:
        torch.manual_seed(seed)
    out = attention_ops.attn_impl(impl).fn(ts["q"], ts["k"], ts["v"], p, mask, training)
    g = torch.Generator().manual_seed(7)
    (out * torch.randn(out.shape, generator=g, dtype=out.dtype)).sum().backward()
    return out.detach(), {n: t.grad for n, t in ts.items()}


def assert_same(impl, q, k, v, p, mask):
    want, want_g = run("torch", q, k, v, p, mask)
    got, got_g = run(impl, q, k, v, p, mask)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert set(got_g) == set(want_g)
    for name in want_g:
        torch.testing.assert_close(got_g[name], want_g[name], rtol=1e-9, atol=1e-11, msg=name)


# block_size is read by "blocked" alone (its query blocks; 4 and 5 do not divide T=11): the
# other implementations run each option once
IMPL_BLOCK_SIZES = [
    pytest.param(impl, bs, id=f"{bs}-{impl}") for impl in IMPLS for bs in (1, 4, 5, 64) if impl == "blocked" or bs == 4
]
# (pad_key, pre, post, mix, wpsm): the options the configs use
OPTIONS = [
    ("both", (2, 3), (3, 3), "head_kernel", True),  # the paper's MTA layer, small
    ("left", (3, 2), None, "wposm", False),  # pre only
    ("right", None, (2, 4), None, True),  # post only
    # post only, centred: a frame's margins can be exactly the kernel's reach
    ("both", None, (3, 3), "head_kernel", True),
    ("both", None, None, "head_kernel", True),  # talking heads (mixing-only layer)
    ("left", (2, 3), (2, 2), None, False),  # both convs, no mixing
]


@pytest.mark.parametrize("impl, block_size", IMPL_BLOCK_SIZES)
@pytest.mark.parametrize("pad_key, pre, post, mix, wpsm", OPTIONS)
def test_matches_reference(impl, pad_key, pre, post, mix, wpsm, block_size):
    p = make_params(pad_key, pre, post, mix, wpsm, block_size=block_size)
    assert_same(impl, *qkv(), p, attention_ops.AttnMask())


@pytest.mark.parametrize("impl", IMPLS)
def test_left_padded_batch(impl):
    """key_valid: pad keys and pad query rows behave as the reference's."""
    q, k, v = qkv(b=3, tq=9, tk=9)
    key_valid = torch.ones(3, 9, dtype=torch.bool)
    key_valid[1, :3] = False
    key_valid[2, :8] = False  # only the last position is real
    assert_same(impl, q, k, v, make_params(block_size=4), attention_ops.AttnMask(0, key_valid))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("padded", [False, True])
def test_cached_decoding_offset(impl, padded):
    """q_offset > 0: a block of queries continuing after cached keys (the decode path)."""
    q, _, _ = qkv(tq=5)
    _, k, v = qkv(tk=12, seed=2)
    key_valid = None
    if padded:
        key_valid = torch.ones(2, 12, dtype=torch.bool)
        key_valid[0, :4] = False
    assert_same(impl, q, k, v, make_params(block_size=2), attention_ops.AttnMask(7, key_valid))


@pytest.mark.parametrize("impl", IMPLS)
def test_gradcheck(impl):
    """Analytic gradients of every input against finite differences (tiny shapes)."""
    p = make_params(block_size=3)
    q, k, v = qkv(b=1, tq=5, tk=5)
    ts, p = leaves(q, k, v, p)
    names = list(ts)

    def f(*tensors):
        pp = dataclasses.replace(p, **{n: t for n, t in zip(names, tensors) if n not in "qkv"})
        return attention_ops.attn_impl(impl).fn(tensors[0], tensors[1], tensors[2], pp, attention_ops.AttnMask(), False)

    assert torch.autograd.gradcheck(f, tuple(ts.values()), fast_mode=True)


@pytest.mark.parametrize("impl", IMPLS)
def test_dropout_gradients_follow_the_forward_masks(impl):
    """With dropout on, backward must see the masks the forward drew (recomputation
    restores the RNG): finite differences of the seeded function agree."""
    p = make_params(dropout=0.3, block_size=2)
    q, k, v = qkv(b=1, tq=5, tk=5)
    ts, p = leaves(q, k, v, p)
    names = list(ts)

    def f(*tensors):
        torch.manual_seed(3)
        pp = dataclasses.replace(p, **{n: t for n, t in zip(names, tensors) if n not in "qkv"})
        return attention_ops.attn_impl(impl).fn(tensors[0], tensors[1], tensors[2], pp, attention_ops.AttnMask(), True)

    out = f(*ts.values())
    torch.testing.assert_close(out, f(*[t.detach() for t in ts.values()]), rtol=1e-12, atol=1e-14)
    no_drop = attention_ops.attn_impl(impl).fn(
        ts["q"], ts["k"], ts["v"], dataclasses.replace(p, dropout=0.0), attention_ops.AttnMask(), True
    )
    assert not torch.allclose(out, no_drop)  # dropout did act
    assert torch.autograd.gradcheck(f, tuple(ts.values()), fast_mode=True)


def test_blocked_keeps_nothing_quadratic_for_backward():
    """The blocked path saves no (B, H, T, T)-sized tensor; the reference saves several."""
    T = 64
    p = make_params(block_size=16)
    q, k, v = qkv(b=1, tq=T, tk=T)

    def saved(impl):
        sizes = []

        def pack(t):
            sizes.append(t.numel())
            return t

        ts, pp = leaves(q, k, v, p)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            attention_ops.attn_impl(impl).fn(ts["q"], ts["k"], ts["v"], pp, attention_ops.AttnMask(), True)
        return sizes

    assert max(saved("torch")) >= H * T * T
    assert max(saved("blocked")) <= H * T * D  # inputs only (q, k, v slices)


def test_cpu_kq_conv_kernel_matches_conv2d_and_gradcheck():
    if not kq_conv_cpu.available(torch.zeros(1, dtype=torch.float64)):
        pytest.skip("no C compiler: the CPU kernel falls back to F.conv2d")
    g = torch.Generator().manual_seed(0)
    for pad_key, ck in (("both", 5), ("left", 4), ("right", 3)):
        x = torch.randn(2, 3, 70, 9, generator=g, dtype=torch.float64)  # 70 > the C block of 64
        w = torch.randn(3, 1, 3, ck, generator=g, dtype=torch.float64)
        pl = attention_ops.pad_left(pad_key, ck)
        torch.testing.assert_close(kq_conv_cpu.kq_conv(x, w[:, 0], pl), attention_ops.kq_conv_dense(x, w, pad_key))
        xs, ws = x[:, :, :6].clone().requires_grad_(), w[:, 0].clone().requires_grad_()
        assert torch.autograd.gradcheck(lambda a, b: kq_conv_cpu.kq_conv(a, b, pl), (xs, ws), fast_mode=True)
        # causal: entries above the diagonal (key > row + diag) are zero going in and out
        for diag in (0, 2, -1):
            keep = torch.ones(70, 9, dtype=torch.bool).tril(diag)
            want = attention_ops.kq_conv_dense(x * keep, w, pad_key) * keep
            torch.testing.assert_close(kq_conv_cpu.kq_conv(x, w[:, 0], pl, diag), want)
            assert torch.autograd.gradcheck(lambda a, b: kq_conv_cpu.kq_conv(a, b, pl, diag), (xs, ws), fast_mode=True)
    # wide rows: the register-blocked interior of the C loop, beside the diagonal band
    for diag, pad_key, ck in ((0, "both", 11), (37, "left", 6), (-3, "right", 5), (10**6, "both", 3)):
        x = torch.randn(2, 2, 40, 150, generator=g, dtype=torch.float64, requires_grad=True)
        w = torch.randn(2, 1, 4, ck, generator=g, dtype=torch.float64, requires_grad=True)
        keep = torch.ones(40, 150, dtype=torch.bool).tril(diag + 110)  # keys up to row + 110 + diag
        gy = torch.randn(2, 2, 40, 150, generator=g, dtype=torch.float64)
        want = attention_ops.kq_conv_dense(x * keep, w, pad_key) * keep
        got = kq_conv_cpu.kq_conv(x, w[:, 0], attention_ops.pad_left(pad_key, ck), diag + 110)
        torch.testing.assert_close(got, want)
        gw_want = torch.autograd.grad(want, (x, w), gy)
        gw_got = torch.autograd.grad(got, (x, w), gy)
        for a, b in zip(gw_got, gw_want):
            torch.testing.assert_close(a, b)
    # float32 agrees with the float64 result to float32 precision
    x = torch.randn(1, 2, 80, 130, generator=g)
    w = torch.randn(2, 1, 6, 11, generator=g)
    torch.testing.assert_close(
        kq_conv_cpu.kq_conv(x, w[:, 0], 5).double(),
        attention_ops.kq_conv_dense(x.double(), w.double(), "both"),
        rtol=1e-5,
        atol=1e-4,
    )


def test_cpu_kq_conv_kernel_gives_the_same_bits_on_any_number_of_threads():
    """The C kernel's OpenMP loops split planes and rows between threads, each output written
    by one thread in a fixed order: 1 and 3 threads (the test workers run with one, see
    tests/conftest.py) give the same bits forward and backward, causal or not."""
    if not kq_conv_cpu.available(torch.zeros(1, dtype=torch.float64)):
        pytest.skip("no C compiler: the CPU kernel falls back to F.conv2d")
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 70, 150, generator=g, dtype=torch.float32)  # 70 rows > the C block of 64
    w = torch.randn(3, 6, 11, generator=g)
    gy = torch.randn(2, 3, 70, 150, generator=g)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
            outs = [kq_conv_cpu.kq_conv(xs, ws, 5, diag) for diag in (0, 2**62)]
            results.append([o.detach() for o in outs] + list(torch.autograd.grad(outs, (xs, ws), [gy, gy])))
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_unknown_impl_is_refused_with_the_registered_names():
    with pytest.raises(
        UserError,
        match=r"^model.attn_impl: unknown implementation 'flash'; available: "
        r"\[.*'blocked'.*'torch'",
    ):
        ModelArgs(attn_impl="flash")


def test_a_declared_impl_is_loaded_by_name_on_first_use(monkeypatch):
    """An implementation outside the core is declared by name (the entry-point group
    ``mta_repro.attn_impls``: "name = module:attribute") and imported only when a config names
    it; one that does not load, or is no AttnImpl, is one line naming model.attn_impl."""
    import sys
    import types

    module = types.ModuleType("declared_impl_for_test")
    module.IMPL = attention_ops.AttnImpl(attention_ops.explicit_attention_torch, doc="a declared copy")
    module.NOT_AN_IMPL = len
    monkeypatch.setitem(sys.modules, module.__name__, module)
    declared = {
        "declared": f"{module.__name__}:IMPL",
        "missing": "no_such_module_anywhere:IMPL",
        "wrong": f"{module.__name__}:NOT_AN_IMPL",
    }
    monkeypatch.setattr(attention_registry, "declared_attn_impls", lambda: declared)
    monkeypatch.setattr(attention_registry, "ATTN_IMPLS", dict(attention_registry.ATTN_IMPLS))
    assert "declared" not in attention_registry.ATTN_IMPLS and "declared" in attention_ops.attn_impl_names()
    assert ModelArgs(attn_impl="declared").attn_impl == "declared"
    assert attention_registry.ATTN_IMPLS["declared"] is module.IMPL
    q, k, v = qkv()
    p = make_params()
    torch.testing.assert_close(
        attention_ops.explicit_attention("declared", q, k, v, p, attention_ops.AttnMask()),
        attention_ops.explicit_attention_torch(q, k, v, p, attention_ops.AttnMask()),
    )
    with pytest.raises(
        UserError,
        match=r"^model.attn_impl='missing': its implementation no_such_module_anywhere:IMPL "
        r"\(entry point of mta_repro.attn_impls\) does not load: No module named",
    ):
        ModelArgs(attn_impl="missing")
    with pytest.raises(
        UserError,
        match=r"^model.attn_impl='wrong': .*:NOT_AN_IMPL is a builtin_function_or_method, "
        r"not an AttnImpl$",
    ):
        ModelArgs(attn_impl="wrong")


def test_implementations_are_declared_by_installed_metadata_only(monkeypatch):
    """The declared implementations are the installed packages' entry points of the group
    (importlib.metadata; no source tree's pyproject.toml is read), and nothing is imported to
    list them."""
    import importlib.metadata as md
    import sys

    seen = []
    fake = md.EntryPoint(name="fake", value="fake_module_not_imported:IMPL", group=attention_ops.ENTRY_POINTS)

    def entry_points(**selection):
        seen.append(selection)
        return md.EntryPoints([fake])

    monkeypatch.setattr(md, "entry_points", entry_points)
    assert attention_ops.declared_attn_impls() == {"fake": "fake_module_not_imported:IMPL"}
    assert seen == [{"group": "mta_repro.attn_impls"}] and "fake_module_not_imported" not in sys.modules


@pytest.mark.skipif(
    not (Path(__file__).resolve().parents[1] / "mta_repro" / "experimental").is_dir(),
    reason="no experiments in this tree",
)
def test_the_installed_package_declares_its_experimental_impl_without_importing_it():
    """This package's metadata (pyproject.toml, as installed) declares "triton" in the group;
    listing it imports nothing of the experiment."""
    import subprocess
    import sys

    code = (
        "import sys; from mta_repro.model import attention_ops as a; d = a.declared_attn_impls(); "
        "print(d.get('triton'), any(m.startswith('mta_repro.experimental') for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["mta_repro.experimental.fused_triton.impl:IMPL", "False"]


def test_unsupported_case_falls_back_to_reference():
    calls = []

    def supports(q, p, mask):
        return "anything" if True else None

    attention_ops.register_attn_impl("never", attention_ops.AttnImpl(lambda *a: calls.append(a), supports))
    try:
        q, k, v = qkv()
        p = make_params()
        with pytest.warns(UserWarning, match="'never' does not support anything"):
            out = attention_ops.explicit_attention("never", q, k, v, p, attention_ops.AttnMask())
        assert not calls
        torch.testing.assert_close(out, attention_ops.explicit_attention_torch(q, k, v, p, attention_ops.AttnMask()))
    finally:
        del attention_ops.ATTN_IMPLS["never"]


MODEL_VARIANTS = {
    "mta": MTAArgs(
        use_mta=True,
        query_kernel_size=3,
        key_kernel_size=5,
        after_sm_query_kernel_size=2,
        after_sm_key_kernel_size=3,
        pre_sm_linear_head=True,
        head_kernel_size=2,
        mta_layers="0,2",
        group_norm=True,
        add_gating=True,
        init_method="normal",
    ),
    "talking_heads": MTAArgs(use_mta=True, pre_sm_linear_head=True, head_kernel_size=4),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("variant", sorted(MODEL_VARIANTS))
def test_whole_model_losses_and_gradients_match(impl, variant):
    losses, grads = {}, {}
    x = torch.randint(0, 97, (2, 21), generator=torch.Generator().manual_seed(0))
    for name in ("torch", impl):
        args = ModelArgs(
            dim=32, n_layers=3, n_heads=4, vocab_size=97, mta=MODEL_VARIANTS[variant], attn_impl=name, attn_block_size=6
        )
        model = build_model(args).double()
        with torch.no_grad():  # random (not identity) talking-heads weights
            for n, prm in model.named_parameters():
                if "wpsm" in n or "head_kernel" in n:
                    prm.add_(0.3 * torch.randn(prm.shape, generator=torch.Generator().manual_seed(1), dtype=prm.dtype))
        logits = model(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        losses[name] = loss.item()
        grads[name] = {n: prm.grad for n, prm in model.named_parameters()}
    assert losses[impl] == pytest.approx(losses["torch"], rel=1e-12)
    for n, g in grads["torch"].items():
        torch.testing.assert_close(grads[impl][n], g, rtol=1e-9, atol=1e-12, msg=n)


@pytest.mark.slow
def test_blocked_model_traces_under_torch_compile():
    """Dynamo + AOTAutograd trace the blocked path (checkpointed blocks, the C kernel as a
    custom op with its fake and backward): same loss and gradients as eager."""
    args = ModelArgs(dim=32, n_layers=3, n_heads=4, vocab_size=97, mta=MODEL_VARIANTS["mta"], attn_block_size=8)
    x = torch.randint(0, 97, (2, 17), generator=torch.Generator().manual_seed(0))
    results = []
    for compiled in (False, True):
        torch._dynamo.reset()
        model = build_model(args)
        fwd = torch.compile(model, backend="aot_eager", fullgraph=False) if compiled else model
        loss = torch.nn.functional.cross_entropy(fwd(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        results.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert results[1][0] == pytest.approx(results[0][0], rel=1e-5)
    for n, g in results[0][1].items():
        torch.testing.assert_close(results[1][1][n], g, rtol=1e-4, atol=1e-6, msg=n)
