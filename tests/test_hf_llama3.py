"""Llama 3.x checkpoints as they are: llama3 RoPE scaling, grouped-query
attention, tied and untied embeddings, sharded safetensors with an index, Appendix I
insertion on the imported weights. Tiny random models built with transformers; no downloads."""

import json
import math
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM

from mta_repro.eval.load import load_model
from mta_repro.hf import export_hf, import_hf
from mta_repro.model import MTAArgs
from mta_repro.model.args import RopeScalingArgs
from mta_repro.model.transformer import rope_inv_freq

# original_max_position_embeddings 64 with head_dim 16 and theta 5e5 puts the frequencies
# in all three bands of the llama3 rule (wavelengths 6.3 < 16, 32 in [16, 64], >= 166 > 64).
SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
THETA = 500000.0
T = 100  # > original_max_position_embeddings


def reference_llama3_freqs(head_dim, theta, factor, low, high, old_len):
    """The published rule (Meta's llama-models ``apply_scaling``), plain Python floats (fp64)."""
    out = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / theta ** (i / head_dim)
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            out.append(freq)
        elif wavelen > old_len / low:
            out.append(freq / factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return out


@pytest.mark.parametrize(
    "head_dim,factor,old_len", [(128, 8.0, 8192), (64, 32.0, 8192), (128, 32.0, 8192), (16, 8.0, 64)]
)
def test_llama3_frequencies_equal_the_published_rule_in_float64(head_dim, factor, old_len):
    """Llama 3.1 8B (d 128, factor 8), 3.2 1B (d 64) and 3B (d 128, factor 32), the tiny test model."""
    s = RopeScalingArgs(
        rope_type="llama3",
        factor=factor,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=old_len,
    )
    got = rope_inv_freq(head_dim, THETA, s, dtype=torch.float64)
    want = torch.tensor(reference_llama3_freqs(head_dim, THETA, factor, 1.0, 4.0, old_len), dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-14, atol=0)
    plain = rope_inv_freq(head_dim, THETA, RopeScalingArgs(), dtype=torch.float64)
    kept, divided = got == plain, torch.isclose(got, plain / factor, rtol=1e-14, atol=0)
    assert kept.any() and divided.any() and (~kept & ~divided).any()  # all three bands exercised


def test_rope_scaling_config_errors_name_the_field():
    with pytest.raises(ValueError, match="model.rope_scaling.rope_type"):
        RopeScalingArgs(rope_type="yarn")
    with pytest.raises(ValueError, match="model.rope_scaling"):
        RopeScalingArgs(low_freq_factor=4.0, high_freq_factor=1.0)


def tiny_llama(tmp_path, tied: bool, shard: bool = True):
    torch.manual_seed(0)
    kw = dict(
        vocab_size=258,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        bos_token_id=256,
        eos_token_id=257,
    )
    if "rope_parameters" in LlamaConfig().to_dict():
        kw["rope_parameters"] = {**SCALING, "rope_theta": THETA}
    else:
        kw.update(rope_theta=THETA, rope_scaling=SCALING)
    hf = LlamaForCausalLM(LlamaConfig(**kw)).eval()
    with torch.no_grad():  # weights large enough that the logits depend on every part
        for name, p in hf.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else torch.randn_like(p) * 0.15)
    folder = tmp_path / ("llama_tied" if tied else "llama_untied")
    hf.save_pretrained(folder, max_shard_size="100KB" if shard else "1GB")
    return hf, folder


def hf_logits(folder_or_model, tokens):
    hf = folder_or_model
    if not isinstance(hf, torch.nn.Module):
        hf = LlamaForCausalLM.from_pretrained(str(hf), dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return hf(tokens).logits


TOKENS = torch.randint(0, 258, (2, T), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("tied", [False, True])
def test_llama3_imports_and_exports_with_equal_logits(tmp_path, tied):
    hf, folder = tiny_llama(tmp_path, tied)
    assert (folder / "model.safetensors.index.json").is_file()  # sharded, with an index
    assert len(list(folder.glob("*.safetensors"))) > 2
    want = hf_logits(folder, TOKENS)
    pt = import_hf(folder, tmp_path / "ours.pt")
    model, _ = load_model(pt, device="cpu")
    a = model.args
    assert a.weight_tying == tied and a.rope_theta == THETA and a.vocab_size == 258
    assert a.rope_scaling == RopeScalingArgs(**SCALING)
    assert a.n_kv_heads == 2  # grouped-query attention kept: K/V not expanded
    assert a.norm_order == "hf"  # bf16 norms round as LlamaRMSNorm
    assert model.layers[0].attention.wk.weight.shape == (2 * 16, 64)
    with torch.no_grad():
        got = model(TOKENS)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the scaling matters at these positions: plain RoPE gives other logits beyond 64
    plain, _ = load_model(pt, device="cpu")
    plain.args.rope_scaling = RopeScalingArgs()  # rope_type default
    with torch.no_grad():
        assert (plain(TOKENS)[:, 64:] - want[:, 64:]).abs().max() > 1e-2
    # and back: a LlamaForCausalLM folder with the same rope_scaling, K/V heads and logits
    out = export_hf(pt, tmp_path / "back")
    cfg = json.loads((out / "config.json").read_text())
    rope = cfg.get("rope_parameters") or {**cfg.get("rope_scaling", {}), "rope_theta": cfg.get("rope_theta")}
    assert {k: rope[k] for k in SCALING} == SCALING and rope["rope_theta"] == THETA
    assert cfg["num_key_value_heads"] == 2 and cfg["tie_word_embeddings"] == tied
    torch.testing.assert_close(hf_logits(out, TOKENS), want, rtol=1e-5, atol=1e-5)


def test_insertion_into_imported_llama_keeps_logits_and_passes_the_first_batch_check(tmp_path):
    from mta_repro.model.insertion import baseline_to_mta
    from mta_repro.pipeline.check import check

    _, folder = tiny_llama(tmp_path, tied=True, shard=False)
    pt = import_hf(folder, tmp_path / "ours.pt")
    model, _ = load_model(pt, device="cpu")
    with torch.no_grad():
        want = model(TOKENS)
    # the release's MTA options on query heads: kq conv, pre-softmax head mixing, head conv
    mta = baseline_to_mta(
        model.state_dict(),
        model.args,
        MTAArgs(
            use_mta=True,
            query_kernel_size=6,
            key_kernel_size=11,
            after_sm_query_kernel_size=6,
            after_sm_key_kernel_size=11,
            pre_sm_linear_head=True,
            head_kernel_size=2,
            mta_layers="1",
        ),
    )
    with torch.no_grad():
        torch.testing.assert_close(mta.eval()(TOKENS), want, rtol=1e-5, atol=1e-5)
    # the pipeline's Appendix I check on the imported model (first batch of the training loader)
    ov = [
        "attention=mta",
        "model.mta.group_norm=false",
        "model.mta.add_gating=false",
        "model.kq_conv_layers=1",
        "model.dim=64",
        "model.n_layers=2",
        "model.n_heads=4",
        "model.n_kv_heads=2",
        "model.head_dim=16",
        "model.vocab_size=258",
        "model.multiple_of=16",
        "model.ffn_dim_multiplier=1.0",
        "model.rope_theta=500000",
        "model.rope_scaling={rope_type: llama3, factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, "
        "original_max_position_embeddings: 64}",
        "model.weight_tying=true",
        "data.tokenizer.name=bytes",
        "data.seq_len=100",
        "data.batch_size=2",
        f"checkpoint.init_from={pt}",
        "checkpoint.init_mode=baseline_to_mta",
        f"run_dir={tmp_path / 'ins'}",
    ]
    res = check(ov, tol=1e-4, device="cpu")
    assert res["ok"] and res["abs_diff"] <= 1e-4 and res["batch_shape"] == [2, 100], res


@pytest.mark.slow
def test_import_holds_one_copy_of_the_weights(tmp_path):
    """A ~135 MB bf16 checkpoint in 5 shards: the import's peak resident memory grows by
    less than 1.5x the checkpoint (a full read followed by a converted copy would be 2x)."""
    sizes = {}
    for name, hidden, layers in (("warm", 64, 1), ("big", 1024, 8)):
        cfg = LlamaConfig(
            vocab_size=258,
            hidden_size=hidden,
            intermediate_size=hidden * 2,
            num_hidden_layers=layers,
            num_attention_heads=8,
            num_key_value_heads=2,
            tie_word_embeddings=False,
        )
        m = LlamaForCausalLM(cfg).to(torch.bfloat16)
        m.save_pretrained(tmp_path / name, max_shard_size="30MB")
        sizes[name] = sum(p.numel() * 2 for p in m.parameters())
        del m
    script = textwrap.dedent(f"""
        import json
        from pathlib import Path
        from mta_repro.hf import import_hf
        def status(field):  # kB; VmHWM is this process's peak (ru_maxrss would include the parent's)
            line = next(x for x in open("/proc/self/status") if x.startswith(field + ":"))
            return int(line.split()[1]) * 1024
        d = Path({str(tmp_path)!r})
        import_hf(d / "warm", d / "warm.pt")  # every module imported, caches filled
        before = status("VmRSS")
        import_hf(d / "big", d / "big.pt")
        print(json.dumps({{"grew": status("VmHWM") - before}}))
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    grew = json.loads(r.stdout.strip().splitlines()[-1])["grew"]
    assert len(list((tmp_path / "big").glob("*.safetensors"))) >= 4 and sizes["big"] > 120e6
    assert grew < 1.5 * sizes["big"], (grew, sizes["big"])
    sd = torch.load(tmp_path / "big.pt", map_location="cpu", mmap=True)["model"]
    assert sd["layers.0.attention.wq.weight"].dtype == torch.bfloat16  # the checkpoint's dtype kept


def test_finetuned_llama_with_mta_exports_with_its_modeling_file(tmp_path):
    """The result of Appendix I on a Llama (GQA, llama3 RoPE, MTA inserted) exported as a
    trust_remote_code folder: transformers gives our logits."""
    from transformers import AutoModelForCausalLM

    from mta_repro.model.insertion import baseline_to_mta

    _, folder = tiny_llama(tmp_path, tied=False, shard=False)
    pt = import_hf(folder, tmp_path / "ours.pt")
    model, _ = load_model(pt, device="cpu")
    mta_args = MTAArgs(
        use_mta=True,
        query_kernel_size=2,
        key_kernel_size=3,
        pre_sm_linear_head=True,
        head_kernel_size=2,
        mta_layers="0",
    )
    mta = baseline_to_mta(model.state_dict(), model.args, mta_args).eval()
    with torch.no_grad():  # move the new parts off identity, as finetuning would
        mta.layers[0].attention.mta_kernel.add_(0.05 * torch.randn_like(mta.layers[0].attention.mta_kernel))
        want = mta(TOKENS)
    blob = torch.load(pt, map_location="cpu", weights_only=False)
    import dataclasses

    blob["config"]["model"]["mta"] = dataclasses.asdict(mta_args)
    blob["model"] = mta.state_dict()
    torch.save(blob, tmp_path / "mta.pt")
    out = export_hf(tmp_path / "mta.pt", tmp_path / "hf_mta")
    hf = AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=True, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(TOKENS).logits, want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_import_names_a_missing_shard(tmp_path):
    _, folder = tiny_llama(tmp_path, tied=True)
    victim = sorted(folder.glob("model-*.safetensors"))[1]
    victim.unlink()
    r = subprocess.run(
        [sys.executable, "-m", "mta_repro.hf", "import", str(folder), str(tmp_path / "x.pt")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2 and victim.name in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
