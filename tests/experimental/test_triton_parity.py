"""The core's parity tests run for model.attn_impl=triton: every option the configs use against
the float64 reference (tests/test_attn_impls.py), padding, a cached-decoding offset, finite
differences, dropout, whole models, and grouped-query attention with the KV cache
(tests/test_gqa.py). Triton's interpreter on CPU (tests/conftest.py sets TRITON_INTERPRET=1):
semantics, not speed."""

import importlib.util

import pytest
import test_attn_impls as core
import test_gqa as gqa

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed"),
    pytest.mark.triton,
]


@pytest.mark.parametrize("pad_key, pre, post, mix, wpsm", core.OPTIONS)
def test_matches_reference(pad_key, pre, post, mix, wpsm):
    core.test_matches_reference("triton", pad_key, pre, post, mix, wpsm, 4)


def test_left_padded_batch():
    core.test_left_padded_batch("triton")


@pytest.mark.parametrize("padded", [False, True])
def test_cached_decoding_offset(padded):
    core.test_cached_decoding_offset("triton", padded)


def test_gradcheck():
    core.test_gradcheck("triton")


def test_dropout_gradients_follow_the_forward_masks(monkeypatch):
    """The fused kernel's own dropout (a layer without a pre-softmax kernel: a kq-conv layer
    with training dropout runs blocked, test_attn_triton.py)."""
    make = core.make_params
    monkeypatch.setattr(core, "make_params", lambda **kw: make(**{"pre": None, **kw}))
    core.test_dropout_gradients_follow_the_forward_masks("triton")


@pytest.mark.parametrize("variant", sorted(core.MODEL_VARIANTS))
def test_whole_model_losses_and_gradients_match(variant):
    core.test_whole_model_losses_and_gradients_match("triton", variant)


def test_gqa_equals_mha_with_repeated_kv_weights():
    gqa.test_gqa_equals_mha_with_repeated_kv_weights("mta", "triton")


def test_kv_cache_holds_only_kv_heads_and_matches_full_forward():
    gqa.test_kv_cache_holds_only_kv_heads_and_matches_full_forward("mta", "triton")
