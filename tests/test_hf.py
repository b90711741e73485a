"""Hugging Face checkpoints both ways: equal logits in transformers and here."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")  # the .[hf] extra (make test installs it)
from eval_helpers import make_run
from transformers import LlamaConfig, LlamaForCausalLM

from mta_repro.eval.load import load_model
from mta_repro.hf import export_hf, import_hf
from mta_repro.model import MTAArgs
from mta_repro.model.insertion import baseline_to_mta

TOKENS = torch.tensor([[1, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 5, 250, 3, 77]])


def hf_logits(folder):
    hf = LlamaForCausalLM.from_pretrained(str(folder), torch_dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return hf(TOKENS).logits


def ours(model):
    with torch.no_grad():
        return model(TOKENS)


def test_export_baseline_gives_equal_logits(tmp_path):
    run_dir, _ = make_run(tmp_path / "run", attention="baseline")
    model, _ = load_model(run_dir, device="cpu")
    out = export_hf(run_dir, tmp_path / "hf")
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    got = hf_logits(out)
    torch.testing.assert_close(got, ours(model), rtol=1e-5, atol=1e-5)
    cfg = LlamaConfig.from_pretrained(str(out))
    assert cfg.tie_word_embeddings and cfg.num_key_value_heads == cfg.num_attention_heads == 4
    # and back: the imported .pt is the same model
    pt = import_hf(out, tmp_path / "back.pt")
    back, _ = load_model(pt, device="cpu")
    for k, v in model.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


LOAD_EXPORT = """
import sys
import torch
from transformers import AutoModelForCausalLM

folder, tokens, out = sys.argv[1:]
hf = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, torch_dtype=torch.float32).eval()
tokens = torch.load(tokens)
with torch.no_grad():
    logits = hf(tokens).logits
    greedy = hf.generate(tokens, max_new_tokens=5, do_sample=False, pad_token_id=0)
torch.save({"logits": logits, "greedy": greedy, "model": sys.modules["mta_repro"].__file__}, out)
"""


def _fresh_python(code: str, *args, cwd: Path, tmp: Path) -> subprocess.CompletedProcess:
    """``code`` in a new interpreter started in ``cwd`` (not the repository), transformers'
    copies of remote code kept under ``tmp``."""
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp / "hf_modules")}
    return subprocess.run(
        [sys.executable, "-c", code, *map(str, args)], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize("attention", ["mta", "talking_heads", "diff"])
def test_other_variants_export_with_their_own_modeling_file(tmp_path, attention):
    """MTA / talking heads / Differential: a trust_remote_code folder whose modeling file
    imports the installed mta-repro; loaded in a fresh interpreter outside the repository it
    gives our logits, and generate() our greedy continuation."""
    import json

    import mta_repro

    run_dir, _ = make_run(tmp_path / "run", attention=attention)
    model, _ = load_model(run_dir, device="cpu")
    out = export_hf(run_dir, tmp_path / "hf")
    source = (out / "modeling_mta_repro.py").read_text()
    assert source == (Path(mta_repro.__file__).parent / "hf" / "modeling_mta_repro.py").read_text()
    assert re.search(r"^\s*from mta_repro\.model\.transformer import", source, re.M)  # the package, not a copy
    assert json.loads((out / "config.json").read_text())["mta_repro_version"] == mta_repro.__version__
    torch.save(TOKENS, tmp_path / "tokens.pt")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    p = _fresh_python(LOAD_EXPORT, out, tmp_path / "tokens.pt", tmp_path / "got.pt", cwd=elsewhere, tmp=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    got = torch.load(tmp_path / "got.pt")
    assert got["model"] == mta_repro.__file__  # the installed package, the one these tests run
    with torch.no_grad():
        torch.testing.assert_close(got["logits"], ours(model), rtol=1e-5, atol=1e-5)
        want = TOKENS
        for _ in range(5):  # greedy by hand, full recompute
            want = torch.cat([want, model(want)[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(got["greedy"], want)
    # baseline-only conversion names the way out
    with pytest.raises(ValueError, match="trust_remote_code"):
        from mta_repro.hf.convert import state_to_hf

        state_to_hf(model.state_dict(), model.args)


WITHOUT_PACKAGE = """
import sys
sys.modules["mta_repro"] = None  # as where mta-repro is not installed
from transformers import AutoModelForCausalLM
try:
    AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)
except ImportError as e:
    print("ImportError:", " ".join(str(e).split()))
"""


def test_an_export_needs_mta_repro_where_it_loads(tmp_path):
    """The exported modeling file depends on the installed package: where mta_repro cannot be
    imported, loading the folder fails with an ImportError that names it and says to install
    it (transformers' own import check would advise ``pip install`` from an index)."""
    run_dir, _ = make_run(tmp_path / "run", attention="mta")
    out = export_hf(run_dir, tmp_path / "hf")
    p = _fresh_python(WITHOUT_PACKAGE, out, cwd=tmp_path, tmp=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    line = p.stdout.strip().splitlines()[-1]
    assert line.startswith("ImportError:") and "mta_repro" in line and "install mta-repro" in line, p.stdout


@pytest.mark.parametrize("tied", [True, False])
def test_import_random_llama_with_gqa(tmp_path, tied):
    torch.manual_seed(0)
    kw = dict(
        vocab_size=259,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
    )
    if "rope_parameters" in LlamaConfig().to_dict():
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    else:
        kw["rope_theta"] = 500000.0
    hf = LlamaForCausalLM(LlamaConfig(**kw)).eval()
    with torch.no_grad():  # non-trivial norms too
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(tmp_path / "llama")
    want = hf_logits(tmp_path / "llama")
    pt = import_hf(tmp_path / "llama", tmp_path / "ours.pt")
    model, cfg = load_model(pt, device="cpu")
    assert model.args.rope_theta == 500000.0 and model.args.weight_tying == tied
    assert model.args.ffn_hidden_dim == 160
    torch.testing.assert_close(ours(model), want, rtol=1e-5, atol=1e-5)
    # Appendix I on imported weights: the identity-initialised MTA model computes the same
    mta = baseline_to_mta(
        model.state_dict(),
        model.args,
        MTAArgs(
            use_mta=True,
            query_kernel_size=2,
            key_kernel_size=3,
            after_sm_query_kernel_size=2,
            after_sm_key_kernel_size=3,
            pre_sm_linear_head=True,
            head_kernel_size=2,
            mta_layers="0",
        ),
    )
    torch.testing.assert_close(ours(mta.eval()), want, rtol=1e-5, atol=1e-5)


def test_unsupported_rope_scaling_is_refused(tmp_path):
    kw = dict(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 500000.0}
    if "rope_parameters" in LlamaConfig().to_dict():
        kw["rope_parameters"] = scaling
    else:
        kw["rope_scaling"] = scaling
    LlamaForCausalLM(LlamaConfig(**kw)).save_pretrained(tmp_path / "yarn")
    with pytest.raises(ValueError, match="rope_type='yarn' is not supported"):
        import_hf(tmp_path / "yarn", tmp_path / "x.pt")


@pytest.mark.slow
def test_cli(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "mta_repro.hf", "import", str(tmp_path / "none"), str(tmp_path / "x.pt")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and r.stderr.strip().startswith("hf: error: hf import:") and "config.json" in r.stderr
    r = subprocess.run([sys.executable, "-m", "mta_repro.hf", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "export" in r.stdout and "import" in r.stdout
    # the help says what works: MTA/talking-heads/Diff export (trust_remote_code), llama3 import
    assert "trust_remote_code" in r.stdout and "llama3" in r.stdout
    assert "exporting MTA" not in r.stdout and "Not supported (clear errors): exporting" not in r.stdout


TEXTS = [
    "Hello world,  this is  a test.\nNew line 123 éà 日本語 🙂",
    " leading space",
    "x",
    "  two\n\n lines\t tab",
    "the thing in the 1234 theater",
]


@pytest.mark.parametrize("attention", ["baseline", "mta"])
def test_exported_tokenizer_gives_trainings_ids(tmp_path, attention):
    """AutoTokenizer on the exported folder: tok(text) == BOS + text ids, as training and
    mta_repro.eval.generate feed the model (with BOS)."""
    from transformers import AutoTokenizer

    from mta_repro.eval.load import load_tokenizer

    run_dir, _ = make_run(tmp_path / "run", attention=attention)
    _, cfg = load_model(run_dir, device="cpu")
    ours = load_tokenizer(cfg)
    out = export_hf(run_dir, tmp_path / "hf")
    hf = AutoTokenizer.from_pretrained(str(out))
    for t in TEXTS:
        assert hf(t)["input_ids"] == ours.encode(t, add_bos=True, add_eos=False), t
        assert hf.decode(hf(t)["input_ids"], skip_special_tokens=True) == t
    assert (hf.bos_token_id, hf.eos_token_id) == (ours.bos_id, ours.eos_id)


@pytest.mark.parametrize("name", ["sentencepiece", "tiktoken"])
def test_hf_tokenizer_of_sentencepiece_and_tiktoken_files(tmp_path, name):
    """The bundled sentencepiece model and a small Llama-3-format ranks file (same code path
    as Meta's 128,000 ranks): the written tokenizer gives our ids."""
    import base64

    from transformers import AutoTokenizer

    from mta_repro.data import build_tokenizer
    from mta_repro.data.args import TokenizerArgs
    from mta_repro.hf.tokenizer import write_hf_tokenizer

    if name == "tiktoken":
        pieces = [bytes([b]) for b in range(256)] + [
            b"th",
            b"he",
            b"the",
            b" t",
            b" the",
            b"in",
            b"ing",
            b"  ",
            b"\n\n",
            b"12",
            b"123",
        ]
        path = tmp_path / "ranks.model"
        path.write_text("".join(f"{base64.b64encode(p).decode()} {i}\n" for i, p in enumerate(pieces)))
    else:
        path = Path(__file__).parents[1] / "data" / "tokenizer" / "mini_sp8192.model"
    cfg = {"name": name, "path": str(path)}
    ours = build_tokenizer(TokenizerArgs(**cfg))
    assert write_hf_tokenizer(cfg, ours, tmp_path / "hf") is None
    hf = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    for t in TEXTS:
        assert hf(t)["input_ids"] == ours.encode(t, add_bos=True, add_eos=False), t


def test_the_kernels_tuning_stays_behind_and_configs_without_it_load(tmp_path):
    """model.kernels says how this machine's kernels ran, not what the model is: the export
    leaves it out (the loading side runs its defaults) and gives the same logits; a run
    saved before the section existed (no kernels key) loads with the defaults."""
    import json

    from transformers import AutoModelForCausalLM

    from mta_repro.kernels.tuning import KernelTuning

    run_dir, _ = make_run(tmp_path / "run", attention="mta")
    pt = run_dir / "export" / "consolidated.pt"
    blob = torch.load(pt, weights_only=False)
    blob["config"]["model"]["kernels"] = {"kq_conv": "conv2d", "kq_tile": "32x32"}
    torch.save(blob, pt)
    model, _ = load_model(pt, device="cpu")
    assert model.args.kernels == KernelTuning(kq_conv="conv2d", kq_tile="32x32")
    out = export_hf(pt, tmp_path / "hf")
    assert "kernels" not in json.loads((out / "config.json").read_text())["mta_repro_args"]
    hf = AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=True, torch_dtype=torch.float32).eval()
    assert hf.model.args.kernels == type(hf.model.args.kernels)()  # the loading side's defaults
    with torch.no_grad():
        torch.testing.assert_close(hf(TOKENS).logits, ours(model), rtol=1e-5, atol=1e-5)
    del blob["config"]["model"]["kernels"]
    torch.save(blob, pt)
    old, _ = load_model(pt, device="cpu")
    assert old.args.kernels == KernelTuning()


def test_export_says_and_records_its_step_and_the_head_is_the_output_embedding(tmp_path, capsys):
    """An export of a run's latest checkpoint (step 7 here, of a run configured for more) says
    which step and run it is and records them beside the weights; the trust_remote_code
    model's get_output_embeddings() is the head its logits come from (the token embedding,
    tied): zeroing that weight zeroes every logit."""
    import json

    from transformers import AutoModelForCausalLM

    run_dir, _ = make_run(tmp_path / "run", attention="mta", fmt="dcp")
    out = export_hf(run_dir, tmp_path / "hf")
    rec = json.loads((out / "provenance.json").read_text())
    assert rec["export"]["run"] == str(run_dir.resolve()) and rec["weights"]["step"] == 7
    assert rec["weights"]["path"] == str(run_dir / "checkpoints" / f"{7:010d}")
    assert (
        f"[mta_repro.hf] exported step 7 of trainer.steps={rec['export']['trainer_steps']}" in capsys.readouterr().err
    )
    hf = AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=True, torch_dtype=torch.float32).eval()
    head = hf.get_output_embeddings()
    assert head is not None and head.weight is hf.get_input_embeddings().weight
    with torch.no_grad():
        assert hf(TOKENS).logits.abs().max() > 0
        head.weight.zero_()
        assert hf(TOKENS).logits.abs().max() == 0
