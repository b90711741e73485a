"""apply_mta on tiny random transformers models (Llama, Qwen2, Mistral, Qwen3): unchanged
outputs at insertion, generation with the model's own cache (equal to a full recompute, one
token fed a step), save/load, training (plain PyTorch and the HF Trainer), and the same
logits as this project's Hugging Face import followed by its Appendix I insertion."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")  # the .[hf] extra (make test installs it)
import transformers

from mta_repro.errors import UserError
from mta_repro.mta import MultiTokenAttention, apply_mta, load_mta_pretrained

F64 = torch.float64
VOCAB, T = 96, 12
# The release's options at toy size: both convolutions, both head mixings.
MTA = dict(
    query_kernel_size=3,
    key_kernel_size=5,
    after_sm_query_kernel_size=2,
    after_sm_key_kernel_size=3,
    pre_sm_linear_head=True,
    head_kernel_size=2,
)
W = (3 - 1) + (2 - 1)  # queries an MTA layer keeps: (c_q - 1) + (c_q' - 1)


def tiny(family: str = "llama", dtype=torch.float32, attn="sdpa", seed=0, **extra):
    """A 3-layer, 64-wide random model of ``family`` (4 query heads, 2 K/V heads)."""
    cls = {
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
        "mistral": ("MistralConfig", "MistralForCausalLM"),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    }[family]
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    if family == "qwen3":
        kw["head_dim"] = 16
    config = getattr(transformers, cls[0])(**kw, **extra)
    config._attn_implementation = attn
    torch.manual_seed(seed)
    return getattr(transformers, cls[1])(config).to(dtype).eval()


def perturb(model, scale=0.2, seed=1):
    """Move every MTA parameter off its identity init (so that MTA changes the outputs)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".mta." in name:
                p.add_(scale * torch.randn(p.shape, generator=g).to(p.dtype))
    return model


def batch(seed=2, pad=3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (2, T), generator=g)
    mask = torch.ones(2, T, dtype=torch.long)
    mask[0, :pad] = 0  # left padding, as generate() batches prompts
    ids[0, :pad] = 0
    return ids, mask


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "qwen3"])
def test_identity_insertion_leaves_the_outputs_unchanged(family, attn):
    """A left-padded batch: the converted model's logits equal the original's at every real
    position (to rounding: float64; float32 under eager attention, whose float64 masks give
    NaN pad rows in transformers 5.25 itself); the layers not chosen keep their class."""
    dtype = F64 if attn == "sdpa" else torch.float32
    model = tiny(family, dtype, attn)
    ids, mask = batch()
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
        apply_mta(model, layers=[0, 2], **MTA)
        got = model(ids, attention_mask=mask).logits
    layers = model.model.layers
    assert [type(layer.self_attn).__name__.startswith("MTA") for layer in layers] == [True, False, True]
    assert type(model).__name__ == f"MTA{type(model).__mro__[2].__name__}"
    assert isinstance(layers[0].self_attn.mta, MultiTokenAttention) and layers[0].self_attn.mta.layer_id == 0
    real = mask.bool()
    tol = 1e-10 if dtype == F64 else 2e-5
    torch.testing.assert_close(got[real], want[real], rtol=tol, atol=tol)


def greedy_by_hand(model, ids, n):
    """Greedy decoding by full recompute (no cache), one token at a time."""
    with torch.no_grad():
        for _ in range(n):
            nxt = model(ids, use_cache=False).logits[:, -1:].argmax(-1)
            ids = torch.cat([ids, nxt], dim=1)
    return ids


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_generate_with_the_models_cache_equals_a_full_recompute(family):
    """MTA moved off identity; greedy with the model's DynamicCache == without a cache ==
    greedy by hand; a left-padded batch and beam search (the cache's rows reordered) too."""
    model = perturb(apply_mta(tiny(family), layers=[0, 2], **MTA))
    ids, mask = batch()
    kw = dict(do_sample=False, pad_token_id=0)
    with torch.no_grad():
        cached = model.generate(ids[1:], max_new_tokens=12, min_new_tokens=12, use_cache=True, **kw)
        full = model.generate(ids[1:], max_new_tokens=12, min_new_tokens=12, use_cache=False, **kw)
        a = model.generate(ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8, use_cache=True, **kw)
        b = model.generate(ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8, use_cache=False, **kw)
        c = model.generate(ids[1:], max_new_tokens=6, num_beams=3, use_cache=True, **kw)
        d = model.generate(ids[1:], max_new_tokens=6, num_beams=3, use_cache=False, **kw)
    assert torch.equal(cached, full) and torch.equal(cached, greedy_by_hand(model, ids[1:], 12))
    assert torch.equal(a, b) and torch.equal(c, d)
    # MTA changed the model: the original's greedy continuation differs
    plain = tiny(family)
    with torch.no_grad():
        assert not torch.equal(plain.generate(ids[1:], max_new_tokens=12, min_new_tokens=12, **kw), cached)


def test_the_cache_feeds_one_token_a_step_and_keeps_w_queries():
    """What makes cached generation O(T) per token, counted rather than timed: the prompt
    once, then one token per step (32 new tokens: 12 + 31 tokens fed, against 880 by full
    recompute); each MTA layer's cache keeps every key and only the last W queries."""
    model = perturb(apply_mta(tiny(), layers=[0, 2], **MTA))
    ids = batch()[0][1:]
    n, fed = 32, {True: [], False: []}
    with torch.no_grad():
        for use_cache in (False, True):
            hook = model.register_forward_pre_hook(
                lambda mod, args, kwargs, uc=use_cache: fed[uc].append(kwargs["input_ids"].shape[1]), with_kwargs=True
            )
            try:
                out = model.generate(
                    ids,
                    max_new_tokens=n,
                    min_new_tokens=n,
                    do_sample=False,
                    pad_token_id=0,
                    use_cache=use_cache,
                    return_dict_in_generate=True,
                )
            finally:
                hook.remove()
            assert out.sequences.shape[1] == T + n
    assert fed[True] == [T] + [1] * (n - 1) and sum(fed[True]) == 43
    assert fed[False] == list(range(T, T + n)) and sum(fed[False]) == 880
    cache = getattr(out, "cache", None) or out.past_key_values
    for i, layer in enumerate(cache.layers):
        assert layer.keys.shape[2] == T + n - 1
        kept = getattr(layer, "mta_queries", None)
        assert (kept.shape[2] if kept is not None else 0) == (W if i in (0, 2) else 0)


def test_save_pretrained_and_from_pretrained_round_trip(tmp_path):
    """save_pretrained writes modeling_mta.py, the auto_map and the options; from_pretrained
    with trust_remote_code, and load_mta_pretrained without it, give the same logits; the
    plain class loads the base model and names the MTA tensors it leaves out."""
    model = perturb(apply_mta(tiny(), layers="0,2", conv_layers=[2], **MTA, group_norm=True, add_gating=True))
    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["auto_map"] == {
        "AutoConfig": "modeling_mta.MTALlamaConfig",
        "AutoModelForCausalLM": "modeling_mta.MTALlamaForCausalLM",
    }
    assert cfg["model_type"] == "mta_llama"  # no plain load maps it to a model without MTA
    assert cfg["mta_repro"]["layers"] == [0, 2] and cfg["mta_repro"]["conv_layers"] == [2]
    assert (tmp_path / "modeling_mta.py").is_file()
    ids, mask = batch()
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
        for loaded in (
            transformers.AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True),
            load_mta_pretrained(tmp_path),
        ):
            assert type(loaded).__name__ == "MTALlamaForCausalLM"
            assert loaded.model.layers[0].self_attn.mta.mta_kernel is None  # no convolution in layer 0
            assert loaded.model.layers[2].self_attn.mta.mta_kernel is not None
            torch.testing.assert_close(loaded.eval()(ids, attention_mask=mask).logits, want, rtol=0, atol=0)
        plain = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
        assert not any(".mta." in k for k in plain.state_dict())


@pytest.mark.slow
def test_a_fresh_interpreter_loads_the_folder_with_the_classes_of_its_copied_file(tmp_path):
    """The class from_pretrained builds is defined in the folder's modeling_mta.py (the
    copy save_pretrained wrote), not looked up in the installed mta_repro.mta.modeling_mta,
    which a fresh interpreter that only loads the folder never imports."""
    model = perturb(apply_mta(tiny(), layers=[1], **MTA))
    model.save_pretrained(tmp_path)
    ids, mask = batch()
    with torch.no_grad():
        torch.save(model(ids, attention_mask=mask).logits, tmp_path / "want.pt")
    torch.save((ids, mask), tmp_path / "batch.pt")
    script = f"""
import sys, torch, transformers
folder = {str(tmp_path)!r}
m = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
cls = type(m)
assert cls.__name__ == "MTALlamaForCausalLM", cls
assert cls.__module__.startswith("transformers_modules.") and cls.__module__.endswith(".modeling_mta"), cls.__module__
assert "mta_repro.mta.modeling_mta" not in sys.modules
ids, mask = torch.load(folder + "/batch.pt")
with torch.no_grad():
    torch.testing.assert_close(m(ids, attention_mask=mask).logits, torch.load(folder + "/want.pt"), rtol=0, atol=0)
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_another_head_saves_under_its_auto_class_and_loads_back(tmp_path):
    """A head other than the causal LM (its MTA class is built on first use in
    modeling_mta.py) registers its own auto class: config.json's auto_map names it, and
    from_pretrained with trust_remote_code gives the same logits."""
    config = tiny().config
    config.num_labels = 3
    torch.manual_seed(0)
    model = perturb(apply_mta(transformers.LlamaForSequenceClassification(config).eval(), layers=[1], **MTA))
    assert type(model).__name__ == "MTALlamaForSequenceClassification"
    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["auto_map"] == {
        "AutoConfig": "modeling_mta.MTALlamaConfig",
        "AutoModelForSequenceClassification": "modeling_mta.MTALlamaForSequenceClassification",
    }
    ids, mask = batch()
    with torch.no_grad():
        loaded = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path, trust_remote_code=True)
        assert type(loaded).__name__ == "MTALlamaForSequenceClassification"
        want = model(ids, attention_mask=mask).logits
        torch.testing.assert_close(loaded.eval()(ids, attention_mask=mask).logits, want, rtol=0, atol=0)


def test_training_with_plain_pytorch_moves_the_mta_parameters_and_the_loss_falls():
    model = apply_mta(tiny(), layers=[0, 1, 2], conv_layers=[1], **MTA).train()
    ids = batch()[0][1:].repeat(4, 1)
    start = {n: p.detach().clone() for n, p in model.named_parameters() if ".mta." in n}
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(12):
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses
    moved = [n for n, p in model.named_parameters() if ".mta." in n and not torch.equal(p, start[n])]
    assert len(moved) == len(start) > 0


@pytest.mark.slow
def test_training_with_the_hf_trainer_lowers_the_loss(tmp_path):
    from transformers import Trainer, TrainingArguments

    model = apply_mta(tiny(), layers=[0, 2], **MTA)
    ids = batch()[0][1:]
    data = [{"input_ids": ids[0], "labels": ids[0]}] * 16

    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=12,
        learning_rate=3e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    assert len(losses) == 12 and losses[-1] < 0.7 * losses[0], losses


def test_same_logits_as_the_projects_hf_import_and_appendix_i_insertion(tmp_path):
    """A tiny random Llama saved by transformers, (a) converted by apply_mta in place and (b)
    imported by ``python -m mta_repro.hf import`` (``import_hf``) and converted by this
    project's Appendix I insertion (``baseline_to_mta``) with the release's layer rule
    (mixing in every layer, convolutions in layer 1): the same MTA weights in both give the
    same logits (float64; transformers' RoPE tables are float32)."""
    from mta_repro.eval.load import load_model
    from mta_repro.hf import import_hf
    from mta_repro.model import MTAArgs
    from mta_repro.model.insertion import baseline_to_mta

    hf = tiny("llama", F64)
    hf.to(torch.float32).save_pretrained(tmp_path / "hf")
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=F64).eval()
    pt = import_hf(tmp_path / "hf", tmp_path / "base.pt", dtype="float32")
    base, _ = load_model(pt, device="cpu", dtype="float64")
    ours = baseline_to_mta(base.state_dict(), base.args, MTAArgs(use_mta=True, mta_layers="1", **MTA)).double().eval()
    perturb(apply_mta(hf, layers=None, conv_layers=[1], **MTA))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if ".mta." in name:
                i, tail = int(name.split(".")[2]), name.split(".mta.")[1]
                dict(ours.named_parameters())[f"layers.{i}.attention.{tail}"].copy_(p)
    ids = batch()[0][1:]
    with torch.no_grad():
        got, want = hf(ids).logits, ours(ids)
        before = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=F64).eval()(ids).logits
    assert (want - before).abs().max() > 1e-2  # MTA changes the model ...
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)  # ... and both alike (4e-8 here: the RoPE tables)


BAD = [
    (lambda m: apply_mta(m, query_kernel_size=3, key_kernal_size=5), "unknown option 'key_kernal_size' (did you mean"),
    (lambda m: apply_mta(m, layers=[3], **MTA), "layer 3 is out of range for a model of 3 layers"),
    (lambda m: apply_mta(m, layers=[0], conv_layers=[1], **MTA), "conv_layers [1] are not among layers [0]"),
    (lambda m: apply_mta(m, query_kernel_size=3, key_kernel_size=4), "key_kernel_size=4: pad_key 'both'"),
    (lambda m: apply_mta(apply_mta(m, **MTA), **MTA), "already has MTA layers"),
    (lambda m: apply_mta(m, layers=[0], conv_layers=[], query_kernel_size=3, key_kernel_size=5), "add nothing"),
    (
        lambda m: apply_mta(transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2))),
        "no LlamaAttention / Qwen2Attention",
    ),
]


@pytest.mark.parametrize("call, words", BAD, ids=[w[:30] for _, w in BAD])
def test_wrong_options_and_models_are_one_line_user_errors(call, words):
    with pytest.raises(UserError) as e:
        call(tiny())
    assert words in str(e.value) and "\n" not in str(e.value)


def test_a_mask_that_is_not_causal_plus_padding_and_a_foreign_cache_are_refused():
    """A sliding window shorter than the sequence (Mistral's) is no mask MTA can read, a cache
    filled without MTA's queries cannot continue, a static cache's padded keys are refused:
    one line each."""
    model = apply_mta(tiny("mistral", sliding_window=4), layers=[1], **MTA)
    with pytest.raises(UserError, match="layer 1: the model's attention mask is not causal \\+ padding"):
        model(batch()[0])
    plain, ids = tiny(), batch()[0][1:]
    with torch.no_grad():
        cache = plain(ids, use_cache=True).cache
        apply_mta(plain, layers=[0], **MTA)
        with pytest.raises(UserError, match="cache holds 12 tokens but none of their queries"):
            plain(ids[:, -1:], cache=cache, use_cache=True)
        with pytest.raises(UserError, match="got a StaticLayer cache layer; MTA layers need the model's DynamicCache"):
            plain.generate(ids, max_new_tokens=2, pad_token_id=0, cache_implementation="static")


@pytest.mark.parametrize("cut", ["shorter", "longer", "other_batch"])
def test_a_padding_mask_of_another_length_is_refused(cut):
    """A (B, T - 1) mask was read shifted (the logits moved by 0.45 here): after apply_mta
    the mask must hold one entry per key, cached ones included, or it is one line."""
    model = perturb(apply_mta(tiny(), **MTA))
    ids, mask = batch()
    bad = {
        "shorter": mask[:, 1:],
        "longer": torch.cat([torch.ones(2, 1, dtype=mask.dtype), mask], 1),
        "other_batch": mask[:1],
    }[cut]
    with torch.no_grad(), pytest.raises(UserError) as e:
        model(ids, attention_mask=bad)
    assert f"attention_mask of shape {tuple(bad.shape)}" in str(e.value) and "expected (2, 12)" in str(e.value)
    assert "\n" not in str(e.value)
    with torch.no_grad():  # the right mask, and in generation a mask covering the cache, still run
        model(ids, attention_mask=mask)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert out.shape == (2, T + 2)


def _saved(tmp_path):
    model = apply_mta(tiny(), layers="0,2", conv_layers=[2], **MTA)
    model.save_pretrained(tmp_path)
    return json.loads((tmp_path / "config.json").read_text())


BAD_CONFIGS = [
    (lambda c: {**c, "mta_repro": [1, 2]}, "'mta_repro' is [1, 2]: expected an object"),
    (lambda c: {**c, "mta_repro": {**c["mta_repro"], "layers": [0, 7]}}, "layer 7 is out of range"),
    (lambda c: {**c, "mta_repro": {**c["mta_repro"], "layers": "0,2"}}, "mta_repro.layers='0,2': expected a list"),
    (
        lambda c: {
            **c,
            "mta_repro": {**c["mta_repro"], "options": {**c["mta_repro"]["options"], "query_kernel_size": 2**33}},
        },
        "query_kernel_size=8589934592: expected at most max_seqlen=256",
    ),
    (lambda c: {**c, "mta_repro": {**c["mta_repro"], "options": {"qkernel": 3}}}, "unknown or malformed ['qkernel']"),
]


@pytest.mark.parametrize("edit, words", BAD_CONFIGS, ids=[w[:30] for _, w in BAD_CONFIGS])
@pytest.mark.parametrize("loader", ["load_mta_pretrained", "trust_remote_code"])
def test_a_malformed_mta_entry_in_config_json_is_one_line_before_the_model_is_built(tmp_path, edit, words, loader):
    """Each way of loading reads config.json's mta_repro entry before it builds the model:
    one line naming the file (a kernel of 2**33 rows is refused, never allocated)."""
    cfg = _saved(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(edit(cfg)))
    with pytest.raises(UserError) as e:
        if loader == "load_mta_pretrained":
            load_mta_pretrained(tmp_path)
        else:
            transformers.AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True)
    msg = str(e.value)
    assert f"{tmp_path}/config.json" in msg and words in msg and "\n" not in msg, msg


def test_a_folder_without_its_mta_entry_loads_as_nothing_else(tmp_path):
    """With config.json's mta_repro entry removed, trust_remote_code built the MTA
    class with no MTA layers (its tensors "unexpected", logits off) and a plain
    AutoModelForCausalLM a Llama. Now the MTA class refuses a config without the entry in
    one line naming the file, load_mta_pretrained too, and a plain load (a fresh
    interpreter, no mta-repro imported) fails on the model_type it does not know, with or
    without the entry."""
    cfg = _saved(tmp_path)
    plain = (
        "import transformers\n"
        "try:\n"
        f"    transformers.AutoModelForCausalLM.from_pretrained({str(tmp_path)!r})\n"
        "except ValueError as e:\n"
        "    print('refused:', ' '.join(str(e).split()))\n"
        "else:\n"
        "    print('loaded')\n"
    )
    for entry in (True, False):
        if not entry:
            (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "mta_repro"}))
        r = subprocess.run(
            [sys.executable, "-c", plain],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tmp_path,
            stdin=subprocess.DEVNULL,
        )
        out = r.stdout.rpartition("refused:")[2]  # after transformers' prompt, which no one answers here
        assert r.returncode == 0 and "loaded" not in r.stdout and "trust_remote_code=True" in out, (
            r.stdout + r.stderr[-2000:]
        )
    for load in (
        lambda: transformers.AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True),
        lambda: load_mta_pretrained(tmp_path),
    ):
        with pytest.raises(UserError) as e:
            load()
        msg = str(e.value)
        assert f"{tmp_path}/config.json" in msg and "no 'mta_repro' entry" in msg and "\n" not in msg, msg


@pytest.mark.parametrize("value", [True, False])
def test_a_bool_kernel_size_in_config_json_is_one_line(tmp_path, value):
    """A bool is an int to Python; as query_kernel_size it is refused like any bad entry."""
    cfg = _saved(tmp_path)
    cfg["mta_repro"]["options"]["query_kernel_size"] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for load in (
        lambda: transformers.AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True),
        lambda: load_mta_pretrained(tmp_path),
    ):
        with pytest.raises(UserError) as e:
            load()
        msg = str(e.value)
        assert (
            f"{tmp_path}/config.json" in msg
            and f"query_kernel_size: expected a positive integer or null, got {value}" in msg
        )
        assert "\n" not in msg, msg


@pytest.mark.parametrize(
    "archs, words",
    [
        (["GPT2LMHeadModel"], "has none of the attention layers MTA goes into"),
        (["LlamaConfig"], "names architecture 'LlamaConfig', which is no model class"),
        ("LlamaForCausalLM", "architectures='LlamaForCausalLM': expected a list"),
        ([3], "architectures=[3]: expected a list"),
    ],
)
def test_a_wrong_architecture_in_config_json_is_one_line(tmp_path, archs, words):
    cfg = _saved(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "architectures": archs}))
    with pytest.raises(UserError) as e:
        load_mta_pretrained(tmp_path)
    assert f"{tmp_path}/config.json" in str(e.value) and words in str(e.value), str(e.value)


def test_apply_mta_checks_the_options_once_and_builds_what_the_constructor_builds(monkeypatch):
    """The options are checked once for the whole model (not again per layer), and a layer
    built from the checked set equals one the public constructor builds from the same options."""
    from mta_repro.model.args import MTAArgs

    calls = []
    check = MTAArgs.check
    monkeypatch.setattr(MTAArgs, "check", lambda self, *a, **k: (calls.append(1), check(self, *a, **k))[1])
    torch.manual_seed(0)
    model = apply_mta(tiny(), layers=[0, 1, 2], conv_layers=[1], **MTA, group_norm=True, add_gating=True)
    assert len(calls) == 1
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    for i, conv in ((1, True), (0, False)):
        layer = model.model.layers[i].self_attn.mta
        opts = dict(MTA, group_norm=True, add_gating=True)
        if not conv:
            opts = {k: v for k, v in opts.items() if not k.endswith("kernel_size") or k == "head_kernel_size"}
        torch.manual_seed(0)
        ref = MultiTokenAttention(cfg.num_attention_heads, head_dim, **opts, layer_id=i, dim=cfg.hidden_size)
        assert layer.kind == ref.kind and layer.options == ref.options
        assert sorted(layer.state_dict()) == sorted(ref.state_dict())
        for name, tensor in ref.state_dict().items():
            if name != "gate.weight":  # trunc-normal draws: the RNG state differs by construction order
                assert torch.equal(layer.state_dict()[name], tensor), name
