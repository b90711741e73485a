"""Grouped-query attention (``model.n_kv_heads``, Lingua/release ``repeat_kv``).

The independent computation: a GQA model equals the multi-head model whose wk/wv rows are
the GQA model's K/V heads repeated per query head (query head h <- K/V head h // n_rep;
for the Differential Transformer, value pair i // n_rep, as in unilm's diff attention),
in float64, for every attention implementation, with the KV cache and in generation.
"""

import dataclasses

import pytest
import torch

from mta_repro.model import KVCache, ModelArgs, MTAArgs, build_model
from mta_repro.model.flops import forward_flops_per_token
from mta_repro.model.generation import generate

V = 89
H, H_KV, D = 8, 2, 8
BASE = ModelArgs(dim=H * D, n_layers=2, n_heads=H, n_kv_heads=H_KV, vocab_size=V, attn_block_size=8)
MTA = MTAArgs(
    use_mta=True,
    query_kernel_size=2,
    key_kernel_size=3,
    after_sm_query_kernel_size=2,
    after_sm_key_kernel_size=3,
    pre_sm_linear_head=True,
    head_kernel_size=2,
    mta_layers="1",
    group_norm=True,
    add_gating=True,
)
# (variant, attn_impl): sdpa (baseline), diff, and the explicit path in every built-in
# implementation (tests/experimental/test_triton_parity.py runs the experimental "triton").
CASES = (
    [("baseline", "blocked"), ("diff", "blocked")]
    + [("mta", impl) for impl in ("torch", "blocked")]
    + [("talking_heads", "blocked")]
)


def args_for(variant: str, impl: str = "blocked", n_kv_heads=H_KV) -> ModelArgs:
    a = dataclasses.replace(BASE, attn_impl=impl, n_kv_heads=n_kv_heads)
    if variant == "diff":
        return dataclasses.replace(a, diff_transformer=True)
    if variant == "mta":
        return dataclasses.replace(a, mta=MTA)
    if variant == "talking_heads":
        return dataclasses.replace(a, mta=MTAArgs(use_mta=True, pre_sm_linear_head=True, post_sm_linear_head=True))
    return a


def randomized(args, seed=0):
    model = build_model(args).double()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model.eval()


def expanded_state(sd: dict, diff: bool) -> dict:
    """The multi-head state dict: each K/V head's rows repeated for the query heads it
    serves, written out with plain indexing (no model code)."""
    n_rep = H // H_KV
    out = dict(sd)
    for key, w in sd.items():
        if key.endswith("attention.wk.weight") or key.endswith("attention.wv.weight"):
            heads = w.view(H_KV, D, -1)
            if diff and key.endswith("wv.weight"):
                # value head of size 2D = K/V heads (2j, 2j+1); diff head i reads pair i // n_rep
                src = [2 * (i // n_rep) + r for i in range(H // 2) for r in (0, 1)]
            else:
                src = [h // n_rep for h in range(H)]
            out[key] = torch.stack([heads[s] for s in src]).reshape(H * D, -1)
    return out


def pair(variant, impl):
    gqa = randomized(args_for(variant, impl))
    mha = build_model(args_for(variant, impl, n_kv_heads=None)).double().eval()
    mha.load_state_dict(expanded_state(gqa.state_dict(), variant == "diff"))
    return gqa, mha


@pytest.mark.parametrize("variant,impl", CASES)
def test_gqa_equals_mha_with_repeated_kv_weights(variant, impl):
    gqa, mha = pair(variant, impl)
    assert gqa.layers[0].attention.wk.weight.shape == (H_KV * D, H * D)
    x = torch.randint(0, V, (2, 21), generator=torch.Generator().manual_seed(1))
    # one forward per model, in training mode, for the outputs and the gradients (the eval-mode
    # forward, without dropout the same computation, is the next test's full forward)
    assert gqa.args.dropout == 0.0
    gqa.train(), mha.train()
    got, want = gqa(x), mha(x)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    # gradients flow into the shared K/V heads: the sum over the query heads they serve
    got.square().mean().backward()
    want.square().mean().backward()
    n_rep = H // H_KV
    for lg, lm in zip(gqa.layers, mha.layers):
        g_mha = lm.attention.wk.weight.grad.view(H, D, -1)
        g_sum = torch.stack([g_mha[k * n_rep : (k + 1) * n_rep].sum(0) for k in range(H_KV)]).reshape(H_KV * D, -1)
        torch.testing.assert_close(lg.attention.wk.weight.grad, g_sum, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("variant,impl", CASES)
def test_kv_cache_holds_only_kv_heads_and_matches_full_forward(variant, impl):
    gqa, mha = pair(variant, impl)
    x = torch.randint(0, V, (2, 14), generator=torch.Generator().manual_seed(2))
    full = mha(x)
    cache = KVCache.empty(len(gqa.layers))
    steps = [gqa(x[:, :9], cache=cache)] + [gqa(x[:, t : t + 1], cache=cache) for t in range(9, 14)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-10, atol=1e-10)
    for layer in cache.layers:
        assert layer.k.shape == (2, H_KV, 14, D) and layer.v.shape == (2, H_KV, 14, D)


def test_generation_with_padding_equals_multi_head_model():
    gqa, mha = pair("mta", "blocked")
    prompts = [[3, 5, 7, 11, 13, 2, 4], [9, 8]]
    a = generate(gqa, prompts, 6, return_logits=True)
    b = generate(mha, prompts, 6, return_logits=True)
    assert a.tokens == b.tokens
    for la, lb in zip(a.logits, b.logits):
        torch.testing.assert_close(la, lb, rtol=1e-9, atol=1e-9)


def test_parameter_and_flop_counts():
    """wk/wv shrink to n_kv_heads heads; every MTA parameter keeps n_heads (the release)."""
    gqa, mha = build_model(args_for("mta"), device="meta"), build_model(args_for("mta", n_kv_heads=None), device="meta")
    n = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    dim = H * D
    assert n(mha) - n(gqa) == BASE.n_layers * 2 * (H - H_KV) * D * dim
    att = gqa.layers[1].attention
    assert att.mta_kernel.shape == (H, 1, 2, 3) and att.wpsm.weight.shape == (H, H)
    assert att.head_kernel.shape == (H // 2, 2, 2)
    fg = forward_flops_per_token(args_for("mta"), 64)
    fm = forward_flops_per_token(args_for("mta", n_kv_heads=None), 64)
    # 2 FLOPs per multiply-add, for the rows wk and wv lose; attention itself unchanged
    assert fm["dense"] - fg["dense"] == BASE.n_layers * 2 * 2 * (H - H_KV) * D * dim
    assert fm["attention"] == fg["attention"]


@pytest.mark.parametrize(
    "kw,field",
    [
        (dict(n_kv_heads=3), "model.n_kv_heads=3 must divide"),
        (dict(n_kv_heads=0), "model.n_kv_heads"),
        (dict(n_kv_heads=1, diff_transformer=True), "model.n_kv_heads=1: the Differential"),
    ],
)
def test_bad_kv_heads_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(BASE, **kw)
