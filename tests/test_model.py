"""Model-level properties: causality, identity equivalences, gradients, dtypes, keys, init."""

import dataclasses

import pytest
import torch

from mta_repro.model import ModelArgs, MTAArgs, build_model
from mta_repro.model.insertion import baseline_to_mta

V = 97
BASE = ModelArgs(dim=32, n_layers=3, n_heads=4, vocab_size=V)
FULL_MTA = MTAArgs(
    use_mta=True,
    query_kernel_size=3,
    key_kernel_size=5,
    after_sm_query_kernel_size=2,
    after_sm_key_kernel_size=3,
    pre_sm_linear_head=True,
    head_kernel_size=2,
    mta_layers="0,2",
    group_norm=True,
    layer_norm_rescale=True,
    add_gating=True,
    gate_1d=False,
)
VARIANTS = {
    "baseline": BASE,
    "diff": dataclasses.replace(BASE, diff_transformer=True),
    "talking_heads": dataclasses.replace(BASE, mta=MTAArgs(use_mta=True, pre_sm_linear_head=True, head_kernel_size=4)),
    "mta": dataclasses.replace(BASE, mta=FULL_MTA),
    "mta_left_wposm": dataclasses.replace(
        BASE,
        mta=MTAArgs(
            use_mta=True,
            query_kernel_size=2,
            key_kernel_size=4,
            after_sm_query_kernel_size=3,
            after_sm_key_kernel_size=2,
            pad_key="left",
            post_sm_linear_head=True,
            add_gating=True,
        ),
    ),
    "mta_right_pre_only": dataclasses.replace(
        BASE, mta=MTAArgs(use_mta=True, query_kernel_size=2, key_kernel_size=3, pad_key="right")
    ),
}


def randomized(args, dtype=torch.float64, seed=0):
    """A model whose every parameter (MTA parts included) is random, not identity."""
    model = build_model(args).to(dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model.eval()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_causality(variant):
    model = randomized(VARIANTS[variant])
    x = torch.randint(0, V, (2, 24))
    t = 11
    y = x.clone()
    y[:, t + 1 :] = torch.randint(0, V, (2, 24 - t - 1))
    assert (y[:, t + 1 :] != x[:, t + 1 :]).any()
    lx, ly = model(x), model(y)
    torch.testing.assert_close(lx[:, : t + 1], ly[:, : t + 1], rtol=0, atol=1e-12)
    assert (lx[:, t + 1 :] - ly[:, t + 1 :]).abs().max() > 1e-3  # the future does matter there


def test_mta_at_identity_equals_baseline():
    """Every MTA part at identity, group norm and gating off: the baseline, layer for layer."""
    base = build_model(BASE).double().eval()
    mta_args = dataclasses.replace(FULL_MTA, group_norm=False, layer_norm_rescale=False, add_gating=False)
    for mta in (mta_args, dataclasses.replace(mta_args, head_kernel_size=None, post_sm_linear_head=True)):
        model = build_model(dataclasses.replace(BASE, mta=mta)).double().eval()
        missing, unexpected = model.load_state_dict(base.state_dict(), strict=False)
        assert not unexpected and missing  # the MTA parts are new, and kept at identity
        x = torch.randint(0, V, (2, 30))
        torch.testing.assert_close(model(x), base(x), rtol=1e-10, atol=1e-10)


def test_talking_heads_at_init_equals_baseline():
    base = build_model(BASE).double().eval()
    th = build_model(VARIANTS["talking_heads"]).double().eval()  # same seed -> same shared weights
    x = torch.randint(0, V, (3, 17))
    torch.testing.assert_close(th(x), base(x), rtol=1e-10, atol=1e-10)


def test_baseline_to_mta_keeps_outputs_and_rejects_non_identity_parts():
    base = randomized(BASE).float().double()  # fp32-exact weights: the converted model is fp32
    mta = dataclasses.replace(FULL_MTA, group_norm=False, layer_norm_rescale=False, add_gating=False)
    model = baseline_to_mta(base.state_dict(), BASE, mta).double().eval()
    x = torch.randint(0, V, (2, 19))
    torch.testing.assert_close(model(x), base(x), rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="add_gating"):
        baseline_to_mta(base.state_dict(), BASE, dataclasses.replace(mta, add_gating=True))


def test_gradients_reach_every_mta_parameter_in_float32():
    """A float32 backward through the post-softmax conv (the release's in-place mask broke it)."""
    model = randomized(VARIANTS["mta"], dtype=torch.float32).train()
    x = torch.randint(0, V, (2, 16))
    loss = torch.nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
    loss.backward()
    names = [n for n, _ in model.named_parameters()]
    for part in ("mta_kernel", "mta_kernel_after_sm", "wpsm", "head_kernel", "subln", "gate"):
        assert any(f".attention.{part}" in n for n in names), part
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().max() > 0, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("variant", ["baseline", "diff", "talking_heads", "mta"])
def test_every_variant_runs_in_every_dtype(variant, dtype):
    model = build_model(VARIANTS[variant]).to(dtype)
    x = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(0))
    logits = model(x)
    assert logits.dtype == dtype and logits.shape == (2, 12, V)
    logits.float().sum().backward()
    assert torch.isfinite(logits.float()).all()
    if dtype == torch.bfloat16:
        # bf16 follows the fp64 model to within a budget of 16 bf16 epsilons (2^-8) of the
        # logits' scale: each of the 3 layers rounds its activations a few times in bf16.
        # Measured over 30 token seeds: at most 0.036 x max|logit| (MTA), 0.026 (others).
        ref = build_model(VARIANTS[variant]).double()(x)
        assert (logits.double() - ref).abs().max() <= 16 * 2**-8 * ref.abs().max()


def test_state_dict_uses_lingua_and_release_names():
    keys = set(build_model(VARIANTS["mta"], device="meta").state_dict())
    for k in (
        "tok_embeddings.weight",
        "norm.weight",
        "layers.0.attention.wq.weight",
        "layers.0.attention.wk.weight",
        "layers.0.attention.wv.weight",
        "layers.0.attention.wo.weight",
        "layers.0.attention_norm.weight",
        "layers.0.feed_forward.w1.weight",
        "layers.0.feed_forward.w2.weight",
        "layers.0.feed_forward.w3.weight",
        "layers.0.ffn_norm.weight",
        "layers.0.attention.mta_kernel",
        "layers.0.attention.mta_kernel_after_sm",
        "layers.0.attention.wpsm.weight",
        "layers.0.attention.head_kernel",
        "layers.0.attention.subln.weight",
        "layers.0.attention.gate.weight",
        "layers.0.attention.gate.bias",
    ):
        assert k in keys, k
    assert "output.weight" not in keys  # tied to tok_embeddings
    assert "layers.1.attention.mta_kernel" not in keys  # not in mta_layers "0,2"
    assert "layers.1.attention.wpsm.weight" in keys  # head mixing stays in every layer


def test_lingua_init_statistics_and_seed():
    args = ModelArgs(dim=256, n_layers=2, n_heads=4, vocab_size=4096)
    a, b = build_model(args), build_model(args)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n  # seeded by model.seed
    hidden = args.ffn_hidden_dim
    assert hidden == 768  # 256 * ceil(int(8 * 256 / 3) / 256)
    for name, p, std in (
        ("wq", a.layers[0].attention.wq.weight, 256**-0.5),
        ("w2", a.layers[0].feed_forward.w2.weight, hidden**-0.5),
        ("emb", a.tok_embeddings.weight, 256**-0.5),
    ):
        # trunc-normal cut at 3 std has std 0.9866 * std
        assert abs(p.std().item() / (0.98658 * std) - 1) < 0.03, name
        assert p.abs().max().item() <= 3 * std + 1e-6, name
    assert torch.equal(a.layers[0].attention_norm.weight, torch.ones(256))


def test_identity_init_of_mta_parts():
    m = build_model(VARIANTS["mta"])
    att = m.layers[0].attention
    assert torch.equal(att.wpsm.weight, torch.eye(4))
    assert torch.equal(att.head_kernel, torch.eye(2).repeat(2, 1, 1))
    k = att.mta_kernel  # (H, 1, c_q=3, c_k=5): last query row, centre key
    assert k.sum() == 4 and torch.all(k[:, 0, -1, 2] == 1)
    assert torch.equal(att.gate.bias, torch.zeros_like(att.gate.bias))


@pytest.mark.parametrize("method", ["const", "uniform", "diagonal", "normal"])
def test_other_conv_inits(method):
    args = dataclasses.replace(BASE, mta=dataclasses.replace(FULL_MTA, init_method=method))
    k = build_model(args).layers[0].attention.mta_kernel.detach()[0, 0]  # (3, 5)
    if method == "const":
        assert torch.all(k == 0.3)
    elif method == "uniform":
        assert k.min() >= -1 and k.max() <= 1 and k.std() > 0.1
    elif method == "diagonal":  # a diagonal ending at the centre key of the last row
        want = torch.zeros(3, 5)
        want[0, 0] = want[1, 1] = want[2, 2] = 1
        assert torch.equal(k, want)
    else:  # trunc-normal, std 0.3, cut at 3 std
        assert k.abs().max() <= 0.9 and k.std() > 0.05


BAD_MTA = [
    dict(query_kernel_size=3),
    dict(query_kernel_size=2, key_kernel_size=4),
    dict(query_kernel_size=0, key_kernel_size=3),
    dict(head_kernel_size=3),
    dict(head_kernel_size=2, post_sm_linear_head=True),
    dict(init_method="eye"),
    dict(pad_key="centre"),
    dict(layer_norm_rescale=True),
]


@pytest.mark.parametrize("opts", BAD_MTA, ids=lambda o: ",".join(o))
def test_a_config_and_the_module_refuse_mta_options_by_one_rule(opts):
    """The model's config and ``MultiTokenAttention`` check MTA options by one rule
    (``MTAArgs.check``): the same message, naming ``model.mta.<option>`` (and
    ``model.n_heads``) for a config, the keyword as written for the module."""
    from mta_repro.errors import UserError
    from mta_repro.mta import MultiTokenAttention

    with pytest.raises(UserError) as config:
        ModelArgs(dim=32, n_layers=1, n_heads=4, mta=MTAArgs(use_mta=True, **opts))
    with pytest.raises(UserError) as module:
        MultiTokenAttention(4, 8, **opts)
    said = str(config.value)
    assert "model.mta." in said and "\n" not in said
    assert str(module.value) == "MultiTokenAttention: " + said.replace("model.mta.", "").replace("model.", "")
