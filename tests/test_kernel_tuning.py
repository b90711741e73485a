"""model.kernels (KernelTuning, mta_repro/kernels/tuning.py): the kernels' tuning as a config
section, carried per model. What a setting asks for is what runs, two models in one process
keep their own, the section composes from the command line, a bad value or a removed
environment variable is one line naming the field, an implementation's own options
(impl_options) are checked by that implementation, a run dir may continue under another
tuning, and the memory pre-flight reads the tuning of the model it is given."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest
import torch

from mta_repro.errors import UserError
from mta_repro.kernels import kq_conv_cpu
from mta_repro.kernels.tuning import KernelTuning
from mta_repro.model import ModelArgs, attention_blocked, attention_ops, build_model
from mta_repro.train.config import compose, to_train_config

SMALL = dict(
    dim=32,
    n_layers=2,
    n_heads=2,
    vocab_size=50,
    mta=dict(use_mta=True, query_kernel_size=2, key_kernel_size=3, mta_layers="1"),
)
ROOT = Path(__file__).resolve().parents[1]
TOKENS = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(0))


def _model(**kernels):
    torch.manual_seed(0)
    return build_model(ModelArgs(**SMALL, kernels=kernels))


@pytest.fixture
def spy(monkeypatch):
    """Which key-query convolution ran: 'conv2d' (kq_conv_dense as the blocked engine calls it,
    F.conv2d), 'c' (kq_conv_cpu.kq_conv) or 'triton' with its tile (kq_conv_triton.corr), in call
    order."""
    calls = []
    conv2d, c = attention_blocked.kq_conv_dense, kq_conv_cpu.kq_conv
    monkeypatch.setattr(attention_blocked, "kq_conv_dense", lambda *a: calls.append("conv2d") or conv2d(*a))
    monkeypatch.setattr(kq_conv_cpu, "kq_conv", lambda *a: calls.append("c") or c(*a))
    if importlib.util.find_spec("triton") is not None:
        from mta_repro.kernels import kq_conv_triton

        corr = kq_conv_triton.corr
        monkeypatch.setattr(kq_conv_triton, "corr", lambda *a: calls.append(("triton", a[-1])) or corr(*a))
    return calls


def _step(model):
    model(TOKENS).sum().backward()


def test_a_model_built_with_kq_conv_conv2d_runs_conv2d(spy):
    model = _model(kq_conv="conv2d")
    assert {layer.attention.explicit_params().tuning.kq_conv for layer in model.layers} == {"conv2d"}
    _step(model)
    # one kq-conv layer, one block (T=12 < 128), the pre-softmax conv: forward and recompute
    assert spy == ["conv2d", "conv2d"]


def test_two_models_in_one_process_keep_their_own_tuning(spy):
    if not kq_conv_cpu.available(torch.zeros(1)):
        pytest.skip("the C kernel did not build here: auto would be conv2d as well")
    conv, auto = _model(kq_conv="conv2d"), _model()
    for model, want in ((conv, "conv2d"), (auto, "c"), (conv, "conv2d"), (auto, "c")):
        spy.clear()
        _step(model)
        assert spy == [want, want]
    # and the same numbers within float tolerance (the section changes how, never what)
    torch.testing.assert_close(conv(TOKENS), auto(TOKENS), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_the_triton_tile_is_the_models_own(spy):
    """Two models on the Triton convolution (the interpreter, conftest) with different
    tiles: each call gets its model's tile, forward and backward."""
    a, b = _model(kq_conv="triton", kq_tile="16x16"), _model(kq_conv="triton", kq_tile="32x16")
    for model, tile in ((a, (16, 16)), (b, (32, 16)), (a, (16, 16))):
        spy.clear()
        _step(model)
        assert spy and set(spy) == {("triton", tile)}, spy


def test_the_default_tuning_is_todays_behaviour():
    t = KernelTuning()
    cpu = torch.zeros(1)
    assert attention_ops.kq_conv_backend(cpu, t) == ("c" if kq_conv_cpu.available(cpu) else "conv2d")
    assert attention_ops.compile_block(torch.device("cpu"), t) is False
    assert attention_ops.compile_block(torch.device("cuda"), t) is True
    assert t.compile_block_backend == "inductor" and t.kq_tile_shape == (64, 64)
    assert t.impl_options == {}
    assert ModelArgs().kernels == t


def test_the_tuning_cannot_change_under_a_model():
    t = KernelTuning(kq_conv="conv2d")
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.kq_conv = "c"
    assert dataclasses.replace(t, kq_tile="32x32").kq_conv == "conv2d" and hash(t) == hash(
        KernelTuning(kq_conv="conv2d")
    )
    # an implementation's options are the tuning's own copy: the mapping it was built from may
    # change afterwards; they take part in equality (and the tuning stays hashable)
    given = {"tuned": {"frame": "128x64"}}
    o = KernelTuning(impl_options=given)
    given["tuned"]["frame"] = "16x16"
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.impl_options = {}
    assert o.impl_options == {"tuned": {"frame": "128x64"}} and o != KernelTuning() and hash(o) == hash(KernelTuning())
    assert dataclasses.replace(o, kq_conv="c").impl_options == o.impl_options


def _tuned_options(options, where):
    """A registered implementation's own options check: one option, ``frame``, ROWSxCOLS."""
    for key, value in options.items():
        if key != "frame":
            raise UserError(f"{where}.{key}: no option of attention implementation 'tuned'; its options: frame")
        if not (isinstance(value, str) and all(part.isdigit() for part in value.split("x"))):
            raise UserError(f"{where}.frame: {value!r}: expected ROWSxCOLS")
    return dict(options)


@pytest.fixture
def tuned(monkeypatch):
    """An implementation registered outside the core that takes options (``tuned``)."""
    monkeypatch.setitem(
        attention_ops.ATTN_IMPLS,
        "tuned",
        attention_ops.AttnImpl(attention_ops.explicit_attention_torch, options=_tuned_options),
    )
    return "tuned"


@pytest.mark.parametrize("overrides", [["model.kernels.kq_conv=conv2d"], ["++model.kernels.kq_conv=conv2d"]])
def test_the_section_composes_from_the_command_line(overrides, tuned):
    cfg = to_train_config(
        compose(
            [
                "attention=mta",
                *overrides,
                "+model.kernels.impl_options.tuned.frame=128x64",  # + adds a key to a mapping
                "model.kernels.compile_block=false",
            ]
        )
    )
    assert cfg.model.kernels == KernelTuning(
        kq_conv="conv2d", compile_block=False, impl_options={"tuned": {"frame": "128x64"}}
    )
    model = build_model(cfg.model, device="meta")
    assert all(layer.attention.kernels.tuning == cfg.model.kernels for layer in model.layers)


def test_plus_on_an_existing_field_is_hydras_own_refusal():
    """``+key=`` adds a key; the schema already has this one, so Hydra says to drop the + (or
    use ++), as for every field."""
    with pytest.raises(
        Exception, match=r"Could not append to config\. An item is already at 'model\.kernels\.kq_conv'"
    ):
        compose(["+model.kernels.kq_conv=conv2d"])


@pytest.mark.parametrize(
    "override, message",
    [
        ("kq_conv=cudnn", "model.kernels.kq_conv: 'cudnn': expected auto, c, triton or conv2d"),
        ("kq_tile=48x64", "model.kernels.kq_tile: '48x64': both sizes must be powers of two, at least 16 (e.g. 64x64)"),
        ("kq_tile=wide", "model.kernels.kq_tile: 'wide': expected ROWSxCOLS, e.g. 64x64"),
        ("compile_block_backend=''", "model.kernels.compile_block_backend: '': expected the name of a torch.compile"),
    ],
)
def test_a_bad_value_is_one_line_naming_the_field(override, message):
    with pytest.raises(UserError) as e:
        to_train_config(compose([f"model.kernels.{override}"]))
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "override, message",
    [
        ("tuned.frame=wide", "model.kernels.impl_options.tuned.frame: 'wide': expected ROWSxCOLS"),
        ("tuned.fram=64x64", "model.kernels.impl_options.tuned.fram: no option of attention implementation 'tuned'"),
        (
            "blocked.frame=64x64",
            "model.kernels.impl_options.blocked: implementation 'blocked' takes no options, got frame",
        ),
        ("nowhere.frame=64x64", "model.kernels.impl_options.nowhere: no attention implementation is registered as "),
    ],
)
def test_an_implementations_options_are_checked_by_it(override, message, tuned):
    """model.kernels.impl_options.<impl>: the core keeps the options unread; the implementation
    registered under that name checks them as the model's args are validated, whatever
    model.attn_impl is. A wrong one is one line naming the field and the implementation."""
    with pytest.raises(UserError) as e:
        to_train_config(compose([f"+model.kernels.impl_options.{override}"]))
    assert str(e.value).startswith(message) and "\n" not in str(e.value)
    with pytest.raises(
        UserError, match=r"^model.kernels.impl_options.tuned: 3: expected the options of implementation"
    ):
        KernelTuning(impl_options={"tuned": 3})  # (the schema's types refuse it on the command line)
    ok = to_train_config(compose(["+model.kernels.impl_options.tuned.frame=64x64"])).model
    assert ok.attn_impl == "blocked" and ok.kernels.impl_options == {"tuned": {"frame": "64x64"}}


def test_an_unknown_field_names_the_nearest():
    from mta_repro.cli import describe

    with pytest.raises(Exception) as e:
        compose(["model.kernels.kq_cnv=conv2d"])
    assert describe(e.value).startswith(
        "unknown config key(s) model.kernels.kq_cnv (did you mean model.kernels.kq_conv?)"
    )


def test_a_run_dir_may_continue_under_another_tuning():
    """model.kernels is FREE: not compared, also against a config saved before it existed."""
    from omegaconf import OmegaConf

    from mta_repro.train.config_check import FREE, diff_configs

    assert "model.kernels." in FREE
    saved = OmegaConf.to_container(compose(["attention=mta"]), resolve=True)
    del saved["model"]["kernels"]  # a run that started before the section existed
    new = OmegaConf.to_container(
        compose(["attention=mta", "model.kernels.kq_conv=conv2d", "+model.kernels.impl_options.tuned.frame=128x64"]),
        resolve=True,
    )
    d = diff_configs(saved, new)
    assert d.unsafe == {} and d.safe == {}
    # a model field beside it is still compared (the section did not make model.* free)
    new["model"]["dim"] += 1
    assert set(diff_configs(saved, new).unsafe) == {"model.dim"}


def test_the_memory_preflight_reads_the_models_tuning():
    from mta_repro.estimate import memory

    assert memory.target_kq_backend("cuda", torch.bfloat16, KernelTuning(kq_conv="conv2d")) == "conv2d"
    if importlib.util.find_spec("triton") is not None:
        assert memory.target_kq_backend("cuda", torch.bfloat16, KernelTuning()) == "triton"
    # the meta stand-ins keep each module's tuning and take its backend from it
    model = build_model(ModelArgs(**SMALL, kernels={"kq_conv": "conv2d", "kq_tile": "32x32"}), device="meta")
    with memory._run_device_impls(model, memory._LiveBytes(), "cuda", torch.bfloat16, {}):
        for layer in model.layers:
            k = layer.attention.kernels
            assert k.kq_backend == "conv2d" and k.tuning == model.args.kernels and k.sdpa is not None
    assert all(layer.attention.kernels.kq_backend is None for layer in model.layers)  # restored


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_the_compiled_block_runs_the_tuned_tile_without_graph_breaks(spy):
    """What CUDA runs by default: the query block compiled, the Triton convolution inside it.
    The tuning travels through the compiled function as plain attributes: no graph break,
    and the tile it names is the one the kernel gets (aot_eager; the interpreter)."""
    import test_attn_impls as t
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    attention_ops.reset_compiled_blocks()
    counters.clear()
    tuning = KernelTuning(kq_conv="triton", kq_tile="16x16", compile_block=True, compile_block_backend="aot_eager")
    p = dataclasses.replace(t.make_params(pre=(2, 3), post=None, block_size=8), tuning=tuning)
    q, k, v = (x.requires_grad_() for x in t.qkv(b=1, tq=16, tk=16))
    attention_ops.explicit_attention_blocked(q, k, v, p, attention_ops.AttnMask(), training=True).sum().backward()
    assert dict(counters["graph_break"]) == {} and counters["stats"]["unique_graphs"] >= 1
    assert spy and set(spy) == {("triton", (16, 16))}, spy
    torch._dynamo.reset()
    attention_ops.reset_compiled_blocks()


def test_a_saved_config_with_retired_settings_at_null_still_loads():
    """The committed study's run configs (as every run's config.yaml and checkpoint of an
    earlier version) hold model.kernels settings that no longer exist, at null: the section
    changes no result, so they read as absent; one set to a value is still an unknown field."""
    import yaml

    from mta_repro.model import to_model_args

    saved = yaml.safe_load(
        (ROOT / "results" / "small_study" / "pretrain" / "mta" / "seed0" / "config.yaml").read_text()
    )
    retired = {k for k, v in saved["model"]["kernels"].items() if v is None} - {
        f.name for f in dataclasses.fields(KernelTuning)
    }
    assert retired  # the file has some
    assert to_model_args(saved["model"]).kernels == KernelTuning()
    name = sorted(retired)[0]
    with pytest.raises(UserError, match=rf"^model\.kernels: unknown field\(s\) \['{name}'\]"):
        to_model_args({"kernels": {name: "128x64"}})
