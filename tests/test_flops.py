"""FLOP counts follow what each attention path computes."""

import dataclasses

import pytest

from mta_repro.model import ModelArgs, MTAArgs
from mta_repro.model.flops import (
    forward_flops_per_token,
    hardware_flops_per_token,
    model_flops_per_token,
    score_elements,
)

MTA = MTAArgs(
    use_mta=True,
    query_kernel_size=6,
    key_kernel_size=11,
    after_sm_query_kernel_size=6,
    after_sm_key_kernel_size=11,
    pre_sm_linear_head=True,
    head_kernel_size=16,
    mta_layers="1",
)
ARGS = ModelArgs(dim=1536, n_layers=2, n_heads=16, vocab_size=8192, mta=MTA)


def test_baseline_is_the_plain_formula():
    a = dataclasses.replace(ARGS, mta=MTAArgs())
    T, d, L, ffn = 2048, 1536, 2, a.ffn_hidden_dim
    dense = L * 2 * (4 * d * d + 3 * d * ffn) + 2 * d * 8192
    attn = L * (2 * T * d + 2 * T * d) / 2  # Q K^T + A V over the causal half
    assert forward_flops_per_token(a, T)["total"] == dense + attn
    assert hardware_flops_per_token(a, T) == model_flops_per_token(a, T) == 3 * (dense + attn)


@pytest.mark.parametrize("block", [64, 256, 1000])
def test_blocked_visits_the_causal_half_plus_block_and_halo(block):
    T, w = 2048, 10  # halo (6-1) + (6-1)
    a = dataclasses.replace(ARGS, attn_block_size=block)
    e = score_elements(a, T)
    # each block of b rows (+ w halo rows) sees keys up to its last row: the causal half
    # plus a triangle's worth per block, times (b + w) / b for the halo rows
    assert T * T / 2 <= e <= (1 + w / block) * (T * T / 2 + T * block / 2)
    assert score_elements(dataclasses.replace(a, attn_block_size=T), T) == T * T  # one block: all
    assert score_elements(dataclasses.replace(a, attn_impl="torch"), T) == T * T


def test_explicit_layers_count_their_transforms_and_the_recomputation():
    T = 2048
    ref = forward_flops_per_token(dataclasses.replace(ARGS, attn_impl="torch"), T)
    # layer 0: mixing (wpsm 16 + head conv 16), layer 1: kq_conv (+ two 6x11 convolutions),
    # each over the full T x T for the reference path.
    per_elem = (4 * 96 + 2 * 16 + 2 * 16) + (4 * 96 + 2 * 16 + 2 * 16 + 2 * 2 * 66)
    assert ref["attention"] == 16 * per_elem * T * T / T
    assert ref["recompute"] == 0
    blocked = forward_flops_per_token(ARGS, T)
    assert blocked["recompute"] == blocked["attention"] < ref["attention"]
    assert hardware_flops_per_token(ARGS, T) == 3 * blocked["total"] + blocked["recompute"]
