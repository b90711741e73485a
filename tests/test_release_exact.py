"""What makes a converted release model compute what the release computes (docs/release_exact.md).

- bf16 block norms in the release's rounding order (normalise in fp32, cast, multiply by
  the weight), the final norm in Lingua's (multiply in fp32, cast): bit for bit against
  the plain formulas; ``model.norm_order`` selects Lingua's or transformers' order;
- Lingua's ``init_base_std`` / ``init_std_factor``: the model's weights equal draws made
  from Lingua's definitions with the same seed (a plain re-implementation);
- a Lingua ``params.json`` (json.dump writes ``1e-05``) through the Python API: every
  converted field has our schema's type, and the model runs forward;
- ``sliding_window`` is accepted with a note, ``n_kv_heads`` converts to GQA with
  unchanged state-dict keys, ``params --release-config`` counts FLOPs at data.seq_len;
- the bf16 key-query convolution: which taps meet which scores and where the casts are
  (the part of bf16 agreement that does not depend on the CPU): bit for bit the float64
  sum rounded once, on inputs whose every partial sum is exact in fp32.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from pathlib import Path

import pytest
import torch
from torch import nn

from mta_repro.estimate import cli as params
from mta_repro.model import ModelArgs, MTAArgs, build_model
from mta_repro.model.flops import model_flops_per_token
from mta_repro.release import load_release_config, release_model_args
from mta_repro.release import release_file_to_config as convert_file
from mta_repro.train.config import TrainConfig
from mta_repro.weights.lingua import release_state_dict_to_ours

FIX = Path(__file__).resolve().parent / "fixtures" / "release"
EPS = 1e-5


# ------------------------------------------------------------------ norms (bf16 rounding order)
def release_norm(x, w):  # projects/mta/mta_transformer.py RMSNorm, written out
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype) * w


def lingua_norm(x, w):  # lingua/transformer.py RMSNorm, written out
    xf = x.float()
    return ((xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)) * w.float()).to(x.dtype)


def bf16_model(norm_order: str, dim: int = 256):
    args = ModelArgs(dim=dim, n_layers=2, n_heads=4, vocab_size=61, norm_order=norm_order, multiple_of=32)
    model = build_model(args)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # weights away from 1, so the order matters
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=g))
    return model.to(torch.bfloat16)


@pytest.mark.parametrize(
    "order,block,final",
    [
        ("release", release_norm, lingua_norm),
        ("lingua", lingua_norm, lingua_norm),
        ("hf", release_norm, release_norm),
    ],
)
def test_bf16_norms_equal_their_formula_bit_for_bit(order, block, final):
    model = bf16_model(order)
    x = (3 * torch.randn(4, 33, 256, generator=torch.Generator().manual_seed(1))).to(torch.bfloat16)
    for layer in model.layers:
        for norm in (layer.attention_norm, layer.ffn_norm):
            got = norm(x)
            assert got.dtype == torch.bfloat16
            assert torch.equal(got, block(x, norm.weight))
    assert torch.equal(model.norm(x), final(x, model.norm.weight))
    # the two orders really differ in bf16 (so the equalities above say something)
    w = model.layers[0].attention_norm.weight
    assert (release_norm(x, w) != lingua_norm(x, w)).float().mean() > 0.05


def release_scale(layer_id: int) -> float:
    """The release's RMSNorm(layer_norm=True): layer_id is a tensor, so -0.3 * layer_id is
    an fp32 tensor before math.exp (written out as the release writes it)."""
    lambda_init = 0.8 - 0.6 * math.exp(-0.3 * torch.tensor(layer_id))
    return 1 - lambda_init


def test_depth_scaling_is_the_releases_in_bf16():
    """``curse_norm`` (block norms) and ``layer_norm_rescale`` (subln): output * (1 -
    lambda_init(l)) after the weight, lambda_init from an fp32 exponent as in the release
    (it differs from the exact value in the last fp32 bit at depths 1 and 6)."""
    mta = MTAArgs(use_mta=True, curse_norm=True, group_norm=True, layer_norm_rescale=True)
    args = ModelArgs(dim=64, n_layers=7, n_heads=4, vocab_size=61, multiple_of=32, mta=mta)
    model = build_model(args).to(torch.bfloat16)
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    for i, layer in enumerate(model.layers):
        assert layer.ffn_norm.out_scale == release_scale(i) == layer.attention.out_scale
        # fp64 (the release run with default dtype float64): the exact value
        assert layer.ffn_norm.out_scale_fp64 == 1 - (0.8 - 0.6 * math.exp(-0.3 * i)) == layer.attention.out_scale_fp64
        assert torch.equal(layer.ffn_norm(x), release_norm(x, layer.ffn_norm.weight) * release_scale(i))
    assert release_scale(1) != 1 - (0.8 - 0.6 * math.exp(-0.3))  # the fp32 exponent matters


def test_norm_order_changes_nothing_in_fp32():
    x = torch.randint(0, 61, (2, 17))
    logits = [bf16_model(o, dim=64).float()(x) for o in ("release", "lingua", "hf")]
    assert torch.equal(logits[0], logits[1]) and torch.equal(logits[0], logits[2])


# ------------------------------------------------------------------ Lingua's init options
def lingua_factor(kind: str, depth: int, n_layers: int, dim: int) -> float:
    return {
        "disabled": 1.0,
        "global_depth": math.sqrt(2 * (n_layers + 1)),
        "current_depth": math.sqrt(2 * (depth + 1)),
        "dim_ratio": dim / 4096,
    }[kind]


def lingua_draws(args: ModelArgs, hidden: int) -> dict:
    """Lingua's init (lingua/transformer.py + projects/mta) in its draw order, written out:
    trunc_normal_(w, std, a=-3*bound, b=3*bound)."""
    torch.manual_seed(args.seed)
    dim, out = args.dim, {}
    d, H, H_kv = args.resolved_head_dim, args.n_heads, args.resolved_n_kv_heads

    def draw(name, shape, std, bound):
        w = torch.empty(shape)
        nn.init.trunc_normal_(w, mean=0.0, std=std, a=-3 * bound, b=3 * bound)
        out[name] = w

    draw("tok_embeddings.weight", (args.vocab_size, dim), dim**-0.5, dim**-0.5)  # never init_base_std
    for i in range(args.n_layers):
        f = lingua_factor(args.init_std_factor, i, args.n_layers, dim)
        std = args.init_base_std or dim**-0.5
        p = f"layers.{i}."
        draw(p + "attention.wq.weight", (H * d, dim), std, std)
        draw(p + "attention.wk.weight", (H_kv * d, dim), std, std)
        draw(p + "attention.wv.weight", (H_kv * d, dim), std, std)
        draw(p + "attention.wo.weight", (dim, H * d), std / f, std)
        if args.mta.add_gating:
            draw(p + "attention.gate.weight", (1, d), std / f, std)
        out_std = (args.init_base_std or hidden**-0.5) / f
        draw(p + "feed_forward.w1.weight", (hidden, dim), std, std)
        draw(p + "feed_forward.w3.weight", (hidden, dim), std, std)
        draw(p + "feed_forward.w2.weight", (dim, hidden), out_std, out_std)
    return out


@pytest.mark.parametrize("factor", ["disabled", "global_depth", "current_depth", "dim_ratio"])
@pytest.mark.parametrize("base_std", [None, 0.02])
def test_lingua_init_options_match_their_definitions(factor, base_std):
    args = ModelArgs(
        dim=64,
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=50,
        multiple_of=32,
        init_std_factor=factor,
        init_base_std=base_std,
        mta=MTAArgs(use_mta=True, query_kernel_size=1, key_kernel_size=1, add_gating=True),
    )
    sd = build_model(args).state_dict()
    want = lingua_draws(args, hidden=args.ffn_hidden_dim)
    for name, w in want.items():
        assert torch.equal(sd[name], w), name
    # the factor as a number: layer 2 of 3 at dim 64
    expect = {"disabled": 1.0, "global_depth": 8**0.5, "current_depth": 6**0.5, "dim_ratio": 1 / 64}[factor]
    assert args.init_std_factor_at(2) == pytest.approx(expect, rel=1e-15)


def test_global_depth_shrinks_output_projections_by_its_factor():
    """Statistics of a large draw: std(wo) = dim**-0.5 / sqrt(2 (L + 1)) (truncation at
    +-3 x dim**-0.5 is far out, so the truncated std equals the nominal one to ~0.1%)."""
    args = ModelArgs(dim=256, n_layers=3, n_heads=4, vocab_size=50, multiple_of=32, init_std_factor="global_depth")
    model = build_model(args)
    wo = torch.cat([l.attention.wo.weight.flatten() for l in model.layers])
    assert wo.std().item() == pytest.approx(256**-0.5 / 8**0.5, rel=0.01)
    wq = torch.cat([l.attention.wq.weight.flatten() for l in model.layers])
    assert wq.std().item() == pytest.approx(256**-0.5 * 0.9866, rel=0.01)  # trunc at 3 std


# ------------------------------------------------------------------ converter: schema types
def _hint_types(hint) -> tuple:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return tuple(t for a in typing.get_args(hint) for t in _hint_types(a))
    if typing.get_origin(hint) is dict:
        return (dict,)
    return (type(None),) if hint is type(None) else (typing.get_origin(hint) or hint,)


def _assert_schema_types(value, cls, where=""):
    hints = typing.get_type_hints(cls)
    for key, v in value.items():
        hint, path = hints[key], f"{where}{key}"
        types = _hint_types(hint)
        sub = next((t for t in types if dataclasses.is_dataclass(t)), None)
        if sub is not None and isinstance(v, dict):
            _assert_schema_types(v, sub, path + ".")
        elif v != "???":
            assert isinstance(v, types) and not (isinstance(v, bool) and bool not in types), (path, v, types)


def _lingua_params_json(path: Path, **model) -> Path:
    """A params.json as Lingua's checkpointing writes it (json.dump: 1e-05, 1e-08)."""
    cfg = {
        "name": "tiny",
        "dump_dir": "/tmp/tiny",
        "seed": 42,
        "steps": 10,
        "optim": {"lr": 0.0003, "epsilon": 1e-08, "weight_decay": 0.1, "warmup": 2, "lr_min_ratio": 1e-06},
        "model": {
            "dim": 64,
            "n_layers": 2,
            "n_heads": 4,
            "n_kv_heads": 2,
            "norm_eps": 1e-05,
            "rope_theta": 100000.0,
            "vocab_size": 120,
            "init_base_std": 2e-02,
            "init_std_factor": "current_depth",
            "sliding_window": 512,
            "multiple_of": 64,
            "mta": {
                "use_mta": True,
                "query_kernel_size": 2,
                "key_kernel_size": 3,
                "pre_sm_linear_head": True,
                "head_kernel_size": 2,
                "mta_layers": "1",
            },
            **model,
        },
        "data": {"root_dir": "/data", "sources": {"c4": 1.0}, "seq_len": 64, "tokenizer": {"name": "bytes"}},
    }
    text = json.dumps(cfg)
    assert "1e-05" in text and "1e-08" in text  # what PyYAML 1.1 would read as strings
    path.write_text(text)
    return path


def test_params_json_floats_come_out_typed_and_the_model_runs(tmp_path):
    path = _lingua_params_json(tmp_path / "params.json")
    conv = convert_file(path)
    m, o = conv.config["model"], conv.config["optim"]
    assert type(m["norm_eps"]) is float and m["norm_eps"] == 1e-5
    assert type(o["eps"]) is float and o["eps"] == 1e-8 and type(o["lr_min_ratio"]) is float
    _assert_schema_types(conv.config, TrainConfig)
    args = release_model_args(path)
    assert args.norm_eps == 1e-5 and args.n_kv_heads == 2 and args.init_base_std == 0.02
    assert args.init_std_factor == "current_depth"
    assert any("sliding_window=512" in n for n in conv.notes)
    logits = build_model(args)(torch.randint(0, 120, (2, 9)))
    assert logits.shape == (2, 9, 120) and torch.isfinite(logits).all()


def test_yaml_exponent_floats_and_overrides_are_floats(tmp_path):
    src = (FIX / "tiny_mta.yaml").read_text().replace("  dim: 64\n", "  dim: 64\n  norm_eps: 1e-05\n")
    (tmp_path / "x.yaml").write_text(src)
    raw = load_release_config(tmp_path / "x.yaml", ["optim.epsilon=1e-7", "model.rope_theta=5e5"])
    assert raw["model"]["norm_eps"] == 1e-5 and raw["optim"]["epsilon"] == 1e-7 and raw["model"]["rope_theta"] == 5e5
    assert raw["model"]["mta"]["mta_layers"] == "1" and raw["model"]["rope_theta"] == 500000.0
    conv = convert_file(tmp_path / "x.yaml", overrides=["optim.epsilon=1e-7"])
    _assert_schema_types(conv.config, TrainConfig)
    with pytest.raises(ValueError, match="model.norm_eps"):
        convert_file(tmp_path / "x.yaml", overrides=["model.norm_eps=small"])


def test_gqa_release_state_dict_loads_with_unchanged_keys(tmp_path):
    path = _lingua_params_json(tmp_path / "params.json")
    args = release_model_args(path)
    src = build_model(args)
    sd = {("_orig_mod." + k if k.startswith("layers.1") else k): v for k, v in src.state_dict().items()}
    ours = release_state_dict_to_ours(sd)
    assert ours["layers.0.attention.wk.weight"].shape == (2 * 16, 64)
    dst = build_model(args, init=False)
    dst.load_state_dict(ours, strict=True)
    x = torch.randint(0, 120, (1, 7))
    assert torch.equal(dst(x), src(x))


def test_params_release_config_counts_flops_at_its_seq_len(tmp_path, capsys):
    path = _lingua_params_json(tmp_path / "params.json")
    params.main(["--release-config", str(path), "data.seq_len=512"])
    got = json.loads(capsys.readouterr().out)
    assert got["seq_len"] == 512
    assert got["model_flops_per_token"] == model_flops_per_token(release_model_args(path), 512)
    params.main(["seq_len=128", "--release-config", str(path)])
    assert json.loads(capsys.readouterr().out)["seq_len"] == 128


# ------------------------------------------------------------------ bf16 key-query convolution
def conv_float64(scores, kernel, pad_key):
    """The release's ``_mta_convolution`` written out as a float64 sum over the taps:
    out[i, j] = sum_{a, b} K[a, b] S[i + a - (c_q - 1), j + b - left], S = 0 outside."""
    b, h, t, u = scores.shape
    c_q, c_k = kernel.shape[-2:]
    left = {"both": (c_k - 1) // 2, "left": c_k - 1, "right": 0}[pad_key]
    s, k = scores.double(), kernel.double()
    out = torch.zeros(b, h, t, u, dtype=torch.float64)
    for a in range(c_q):
        for j in range(c_k):
            di, dj = a - (c_q - 1), j - left  # the score row/column this tap reads, relative
            src = s[:, :, max(0, di) : t + min(0, di), max(0, dj) : u + min(0, dj)]
            out[:, :, max(0, -di) : t - max(0, di), max(0, -dj) : u - max(0, dj)] += k[:, 0, a, j, None, None] * src
    return out


@pytest.mark.parametrize("pad_key", ["both", "left", "right"])
@pytest.mark.parametrize("c_q,c_k", [(6, 5), (6, 11), (4, 7), (2, 3)])
def test_bf16_kq_conv_is_the_float64_sum_rounded_once(c_q, c_k, pad_key):
    """The bf16 convolution both sides run: the kernel cast to bf16 first (a float32 kernel
    whose extra bits the cast drops gives the same result), the products summed unrounded,
    the sum rounded once to bf16. On scores and kernels with few mantissa bits every partial
    sum is exact in fp32, so any summation order gives the same bits, and they must equal the
    float64 sum rounded once; which order a CPU uses decides only the last bit of inexact sums
    (scripts/bf16_conv_order.py measures it here), bounded below by one ulp for positive
    inputs, which the second half checks."""
    from mta_repro.kernels.interface import AttnMask
    from mta_repro.model.attention_ops import kq_conv_dense as kq_conv
    from mta_repro.model.attention_ops import masked_kq_conv

    g = torch.Generator().manual_seed(100 * c_q + c_k)
    # multiples of 1/8 up to 2 and of 1/16 up to 1: products multiples of 2^-7 below 2, sums of at
    # most 66 of them below 132, 15 bits: exact in fp32's 24, not in bf16's 8
    s = (torch.randint(-16, 17, (2, 3, 40, 40), generator=g) / 8).to(torch.bfloat16)
    k = (torch.randint(-16, 17, (3, 1, c_q, c_k), generator=g) / 16).to(torch.bfloat16)
    want = conv_float64(s, k, pad_key).to(torch.bfloat16)
    assert not torch.equal(conv_float64(s, k, pad_key), want.double())  # the rounding is real
    assert torch.equal(kq_conv(s, k, pad_key), want)
    k32 = k.float() * (1 + 2.0**-10)  # below half a bf16 ulp: the cast drops it
    assert not torch.equal(k32, k.float()) and torch.equal(kq_conv(s, k32, pad_key), want)
    allowed = torch.ones(40, 40, dtype=torch.bool).tril()
    masked = masked_kq_conv(s, k, pad_key, allowed, AttnMask(), backend="conv2d")
    assert torch.equal(masked, (conv_float64(s * allowed, k, pad_key) * allowed).to(torch.bfloat16))
    # any inputs, positive (no cancellation): within one ulp of the rounded-once sum
    s = torch.rand(2, 3, 40, 40, generator=g).to(torch.bfloat16)
    k = torch.rand(3, 1, c_q, c_k, generator=g).to(torch.bfloat16)
    exact = conv_float64(s, k, pad_key)
    got = kq_conv(s, k, pad_key).double()
    assert ((got - exact).abs() <= exact.abs() * 2.0**-7).all()
