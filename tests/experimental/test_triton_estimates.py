"""What the core's estimates ask of model.attn_impl=triton through its registry entry
(``AttnImpl.flops``, ``workspace_bytes``, ``meta_fn``; mta_repro/experimental/fused_triton/
impl.py): the FLOPs of the frames its passes visit and the workspace its launches hold, both
under the model's tuning (model.kernels), and the layers that run ``blocked`` instead. No
kernel runs here (no triton needed)."""

import dataclasses

import pytest
import torch

from mta_repro.estimate import memory
from mta_repro.experimental.fused_triton import tiles
from mta_repro.model import ModelArgs, MTAArgs, attention_ops, build_model, flops

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
SMALL = dict(
    dim=32,
    n_layers=2,
    n_heads=2,
    vocab_size=50,
    mta=dict(use_mta=True, query_kernel_size=2, key_kernel_size=3, mta_layers="1"),
)


@pytest.mark.parametrize("T", [40, 2048])
@pytest.mark.parametrize("pre", [(6, 11), None])
def test_triton_counts_the_frames_its_passes_visit(T, pre):
    """cells_visited against a brute-force walk over (row block, key block) pairs that hold
    an allowed owned cell, for every pass of both designs (a kq-conv layer's stored-scores
    passes, a post-softmax-conv-only layer's fused passes); the fused kernel's statistics
    pass has no convolution to widen its frame."""
    for name in tiles.passes(pre):
        f = tiles.frame(name, pre, (6, 11), "both")
        assert f.er * f.ec >= f.bmo * f.bno > 0 and f.er & (f.er - 1) == 0 and f.ec & (f.ec - 1) == 0
        if pre is None and name == "stats":
            assert f.er * f.ec == f.bmo * f.bno
        brute = sum(
            f.er * f.ec
            for r0 in range(0, T, f.bmo)
            for c0 in range(0, T, f.bno)
            if c0 <= min(T, r0 + f.bmo) - 1  # the block's first key is at or before its last row
        )
        assert tiles.cells_visited(f, T, T) == brute >= T * T / 2
    a = dataclasses.replace(ARGS, attn_impl="triton")
    # frames cost more than the causal half the blocked path visits (halo and padding cells)
    assert flops.forward_flops_per_token(a, T)["attention"] > flops.forward_flops_per_token(ARGS, T)["attention"]
    with pytest.raises(ValueError, match="'triton' counts its own FLOPs"):
        flops.score_elements(a, T)


def test_the_flop_count_follows_the_models_frame():
    """The triton path's FLOPs are what its frames compute (halo cells, causal skipping per
    frame, Toeplitz products as wide as the frame): the default frame set explicitly counts
    the same, another frame counts otherwise."""
    args = dict(
        SMALL,
        n_heads=4,
        dim=64,
        attn_impl="triton",
        mta=dict(use_mta=True, query_kernel_size=6, key_kernel_size=11, pre_sm_linear_head=True),
    )

    def count(kind, **options):
        kernels = {"impl_options": {"triton": options}}
        return attention_ops.attn_impl("triton").flops(ModelArgs(**args, kernels=kernels), 2048, kind)

    assert count("mixing", frame="128x128") == count("mixing")  # a mixing layer's default frame
    assert count("kq_conv", frame="64x32") != count("kq_conv")
    assert count("kq_conv", frame="64x32") != count("mixing", frame="64x32")


def test_a_kq_conv_layer_with_training_dropout_counts_as_blocked():
    """Such a layer runs ``blocked`` (the stored-scores kernels have no dropout): its FLOPs are
    blocked's, recomputation included; a mixing layer keeps the fused kernel's count."""
    T = 512
    drop = dataclasses.replace(ARGS, attn_impl="triton", dropout=0.1)
    assert attention_ops.attn_impl("triton").flops(drop, T, "kq_conv") is None
    assert flops._per_layer(drop, T, "kq_conv") == flops._per_layer(
        dataclasses.replace(drop, attn_impl="blocked"), T, "kq_conv"
    )
    assert flops._per_layer(drop, T, "mixing") == flops._per_layer(dataclasses.replace(drop, dropout=0.0), T, "mixing")


def test_the_memory_preflight_asks_the_implementation_for_its_workspace():
    """The pre-flight's per-layer workspace is the implementation's own figure: the kernels'
    under the model's frame and programs, none for a kq-conv layer that runs blocked (training
    dropout) or for an implementation that declares none."""
    args = dict(SMALL, attn_impl="triton")
    ws = {}
    for name, extra in (
        ("default", {}),
        ("frame", {"kernels": {"impl_options": {"triton": {"frame": "64x64"}}}}),
        ("programs", {"kernels": {"impl_options": {"triton": {"programs": 1}}}}),
        ("dropout", {"dropout": 0.1}),
    ):
        model = build_model(ModelArgs(**args, **extra), device="meta")
        ws[name] = memory.backward_workspace(model.layers[1].attention, 2, 256)
    assert ws["frame"] != ws["default"] and 0 < ws["programs"] < ws["default"] and ws["dropout"] == 0
    blocked = build_model(ModelArgs(**SMALL), device="meta")
    assert memory.backward_workspace(blocked.layers[1].attention, 2, 256) == 0


def test_the_memory_preflight_of_a_triton_model_counts_the_stored_c_plane():
    """On meta the model runs the implementation's stand-in: a kq-conv layer (the stored-scores
    kernels) saves its packed causal C plane (B x H x T(T+1)/2 in the compute dtype) on top of
    what the same layer with its 2x3 kernel after softmax instead (the fused kernel) saves;
    with training dropout it runs blocked there, as on a GPU."""
    b, t = 2, 64

    def saved(mta, **kw):
        model = build_model(ModelArgs(**{**SMALL, "attn_impl": "triton", "mta": mta, **kw}), device="meta").train()
        return memory._step_on_meta(model, b, t, 1, "cuda", torch.float32, False, False, {})["saved"]

    pre = SMALL["mta"]
    post = dict(
        pre, query_kernel_size=None, key_kernel_size=None, after_sm_query_kernel_size=2, after_sm_key_kernel_size=3
    )
    assert saved(pre) - saved(post) == b * SMALL["n_heads"] * t * (t + 1) // 2 * 4
    blocked = build_model(ModelArgs(**{**SMALL, "dropout": 0.1}), device="meta").train()
    assert (
        saved(pre, dropout=0.1)
        == memory._step_on_meta(blocked, b, t, 1, "cuda", torch.float32, False, False, {})["saved"]
    )
