"""Bad input from elsewhere is one line naming the file or field and changes nothing
(docs/trust.md): weights with relabelled dtypes, crafted safetensors headers, reshaped
tensors, resolver interpolations in a stored config, an oversized data record, a diverged
model's perplexity, a model too large for the machine, a non-finite learning rate, an eval
result of the wrong shape, an export into a foreign folder, and the export's file modes.

Every crafted file is made here, byte by byte where it matters (``write_safetensors`` is
the format's specification, not the library's writer); a control shows the library itself
fails on each crafted safetensors header, and that the well-formed file imports.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import stat
import struct
import sys
import tracemalloc
from pathlib import Path

import pytest
import torch
from eval_helpers import make_run

from mta_repro.cli import run_cli
from mta_repro.errors import CorruptFileError, UnsafeFileError
from mta_repro.weights import ModelMismatchError, load_weights

TRAIN = ["experiment=debug", "trainer.steps=1", "logging.wandb_mode=disabled", "logging.progress_bar=false"]


def _one_line(err: str, *expected: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    for e in expected:
        assert e in lines[0], lines[0]
    return lines[0]


def _snapshot(folder: Path) -> dict:
    """Every file under ``folder``: its bytes' hash and its mode (what "unchanged" means)."""
    if not folder.exists():
        return {}
    return {
        str(p.relative_to(folder)): (hashlib.sha256(p.read_bytes()).hexdigest(), stat.S_IMODE(p.stat().st_mode))
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


# ------------------------------------------------------------------ a Llama folder, byte by byte
HF_CONFIG = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 16,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "torch_dtype": "float32",
}
ST_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def llama_tensors(dtype=torch.float32) -> dict:
    """The tensors of HF_CONFIG's LlamaForCausalLM (q_proj [64, 32]: 4 heads x 16 over 32)."""
    g = torch.Generator().manual_seed(0)
    V, D, F, HD = 64, 32, 48, 64
    shapes = {
        "model.embed_tokens.weight": (V, D),
        "model.norm.weight": (D,),
        "lm_head.weight": (V, D),
        "model.layers.0.input_layernorm.weight": (D,),
        "model.layers.0.post_attention_layernorm.weight": (D,),
        "model.layers.0.self_attn.q_proj.weight": (HD, D),
        "model.layers.0.self_attn.k_proj.weight": (HD, D),
        "model.layers.0.self_attn.v_proj.weight": (HD, D),
        "model.layers.0.self_attn.o_proj.weight": (D, HD),
        "model.layers.0.mlp.gate_proj.weight": (F, D),
        "model.layers.0.mlp.up_proj.weight": (F, D),
        "model.layers.0.mlp.down_proj.weight": (D, F),
    }
    return {n: (0.1 * torch.randn(s, generator=g)).to(dtype) for n, s in shapes.items()}


def write_safetensors(
    path: Path,
    tensors: dict,
    labels: dict = (),
    shapes: dict = (),
    offsets: dict = (),
    header_len=None,
    tail: bytes = b"",
) -> Path:
    """A safetensors file as the format describes it: 8-byte little-endian header length,
    the JSON header, the tensors' bytes. ``labels``/``shapes``/``offsets`` override a
    tensor's header entry (the bytes stay), ``header_len`` the stated length."""
    header, blobs, at = {}, [], 0
    for name, t in tensors.items():
        data = t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
        entry = {
            "dtype": dict(labels).get(name, ST_NAMES[t.dtype]),
            "shape": list(dict(shapes).get(name, t.shape)),
            "data_offsets": list(dict(offsets).get(name, (at, at + len(data)))),
        }
        header[name] = entry
        blobs.append(data)
        at += len(data)
    raw = json.dumps(header).encode()
    n = len(raw) if header_len is None else header_len
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", n) + raw + b"".join(blobs) + tail)
    return path


def llama_folder(root: Path, dtype=torch.float32, **kw) -> Path:
    folder = root / "llama"
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {**HF_CONFIG, "torch_dtype": str(dtype).replace("torch.", "")}
    (folder / "config.json").write_text(json.dumps(cfg))
    write_safetensors(folder / "model.safetensors", llama_tensors(dtype), **kw)
    return folder


def _hf(argv, capsys):
    from mta_repro.hf.cli import main as hf_main

    rc = hf_main(argv)
    return rc, capsys.readouterr()


def test_the_well_formed_folder_imports_and_the_library_reads_it(tmp_path, capsys):
    """The control for the crafted files below: the same writer's well-formed file."""
    pytest.importorskip("transformers")
    from safetensors import safe_open

    folder = llama_folder(tmp_path)
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        torch.testing.assert_close(f.get_tensor("model.norm.weight"), llama_tensors()["model.norm.weight"])
    rc, out = _hf(["import", str(folder), str(tmp_path / "ours.pt")], capsys)
    assert rc == 0, out.err[-2000:]
    sd = load_weights(tmp_path / "ours.pt").state
    torch.testing.assert_close(sd["tok_embeddings.weight"], llama_tensors()["model.embed_tokens.weight"])


# ------------------------------------------------------------------ 1: relabelled dtypes
@pytest.mark.parametrize(
    "dtype,label,says",
    [
        (torch.float32, "I32", "is I32, expected a float dtype"),  # same byte size, an integer tensor
        (torch.float16, "BF16", "is bfloat16 but config.json's torch_dtype is float16"),  # same size, another float
    ],
)
def test_hf_import_refuses_a_relabelled_tensor(tmp_path, capsys, dtype, label, says):
    pytest.importorskip("transformers")
    folder = llama_folder(tmp_path, dtype, labels={"model.embed_tokens.weight": label})
    out = tmp_path / "out" / "ours.pt"
    rc, res = _hf(["import", str(folder), str(out)], capsys)
    assert rc == 2
    _one_line(res.err, "hf: error:", str(folder / "model.safetensors"), "'model.embed_tokens.weight'", says)
    assert not out.parent.exists()


def test_init_from_refuses_integer_weights_and_writes_no_run(tmp_path, capsys):
    from mta_repro.train.config import compose
    from mta_repro.train.loop import train

    run_dir, _ = make_run(tmp_path / "src", attention="baseline")
    blob = torch.load(run_dir / "export" / "consolidated.pt", weights_only=True)
    emb = blob["model"]["tok_embeddings.weight"]
    blob["model"]["tok_embeddings.weight"] = emb.view(torch.int32)  # the bytes relabelled, as a crafted header would
    pt = tmp_path / "relabelled.pt"
    torch.save(blob, pt)
    target = tmp_path / "train"
    cfg = compose(
        TRAIN
        + [
            "model.dim=64",
            "model.n_layers=2",
            "model.n_heads=4",
            "model.multiple_of=32",
            "model.vocab_size=258",
            "data.tokenizer.name=bytes",
            f"run_dir={target}",
            f"checkpoint.init_from={pt}",
        ]
    )
    assert run_cli("train", lambda: train(cfg)) == 2
    _one_line(capsys.readouterr().err, "train: error:", str(pt), "'tok_embeddings.weight' is int32, expected a float")
    assert not target.exists()
    with pytest.raises(CorruptFileError, match="int32"):
        load_weights(pt)


def test_init_from_refuses_weights_of_another_shape_naming_the_tensor(tmp_path):
    """A checkpoint of another width: refused against the model it would go into."""
    from mta_repro.model import ModelArgs
    from mta_repro.train.checkpoint import load_init_weights

    run_dir, _ = make_run(tmp_path / "src", attention="baseline")  # dim 64
    want = ModelArgs(dim=32, n_layers=2, n_heads=4, vocab_size=258, multiple_of=32)
    says = r"'tok_embeddings.weight' has shape \[258, 64\], expected \[258, 32\]"
    with pytest.raises(ModelMismatchError, match=says):
        load_init_weights(run_dir, expect=want)


# ------------------------------------------------------------------ 2: crafted headers
def _crafted_headers():
    emb = "model.embed_tokens.weight"
    return {
        "length 2^62": ({"header_len": 2**62}, "header length 4611686018427387904 bytes is over the format's limit"),
        "length past the end": ({"header_len": 10**6}, "header length 1000000 bytes runs past the end of the file"),
        "F16 with F32 bytes": (
            {"labels": {emb: "F16"}},
            "tensor 'model.embed_tokens.weight': F16 [64, 32] needs 4096 bytes, its data_offsets hold 8192",
        ),
        "offsets outside": (
            {"offsets": {emb: (0, 1 << 40)}},
            "tensor 'model.embed_tokens.weight': bytes [0, 1099511627776) do not fit",
        ),
    }


@pytest.mark.parametrize("case", list(_crafted_headers()))
def test_crafted_safetensors_headers_are_one_line(tmp_path, capsys, case):
    pytest.importorskip("transformers")
    from safetensors import safe_open

    kw, says = _crafted_headers()[case]
    folder = llama_folder(tmp_path, **kw)
    st = folder / "model.safetensors"
    with pytest.raises(Exception), safe_open(str(st), framework="pt") as f:  # noqa: B017 - the library refuses it
        [f.get_tensor(n) for n in f]
    out = tmp_path / "ours.pt"
    rc, res = _hf(["import", str(folder), str(out)], capsys)
    assert rc == 2
    line = _one_line(res.err, "hf: error:", f"{st}: not a valid safetensors file", says)
    assert "SafetensorError" not in line
    assert not out.exists()


def test_the_header_reader_checks_overlaps_gaps_and_json(tmp_path):
    from mta_repro.weights import read_header

    t = {"a": torch.ones(4), "b": torch.ones(4)}
    cases = {
        "overlap": ({"offsets": {"b": (8, 24)}}, "overlaps the previous tensor"),
        "gap": ({"offsets": {"b": (20, 36)}, "tail": b"\0" * 4}, "leaves a gap after byte 16"),
        "unknown dtype": ({"labels": {"a": "Q4"}}, "unknown dtype 'Q4'"),
        "negative shape": ({"shapes": {"a": (-4,)}}, "is not a list of non-negative integers"),
        "trailing bytes": ({"tail": b"\0" * 8}, "the tensors end at byte 32 of a 40-byte buffer"),
    }
    for name, (kw, says) in cases.items():
        f = write_safetensors(tmp_path / f"{name}.safetensors", t, **kw)
        with pytest.raises(CorruptFileError, match=f"{f}: not a valid safetensors file: .*{says}"):
            read_header(f)
    f = tmp_path / "not_json.safetensors"
    f.write_bytes(struct.pack("<Q", 4) + b"{{{{")
    with pytest.raises(CorruptFileError, match="the header is not JSON"):
        read_header(f)
    assert set(read_header(write_safetensors(tmp_path / "ok.safetensors", t))) == {"a", "b"}


def test_a_shard_index_may_name_only_files_of_its_folder(tmp_path, capsys):
    pytest.importorskip("transformers")
    folder = llama_folder(tmp_path)
    elsewhere = write_safetensors(tmp_path / "elsewhere.safetensors", llama_tensors())
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {n: f"../{elsewhere.name}" for n in llama_tensors()}})
    )
    rc, res = _hf(["import", str(folder), str(tmp_path / "ours.pt")], capsys)
    assert rc == 2
    _one_line(res.err, "model.safetensors.index.json names shard(s) outside", "../elsewhere.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["model.safetensors"]}))
    rc, res = _hf(["import", str(folder), str(tmp_path / "ours.pt")], capsys)
    assert rc == 2
    _one_line(
        res.err, "model.safetensors.index.json: not a shard index:", "expected an object at weight_map, found a list"
    )
    assert not (tmp_path / "ours.pt").exists()


# ------------------------------------------------------------------ 3: a reshaped tensor
def test_a_reshaped_tensor_is_named_before_any_permutation(tmp_path, capsys):
    pytest.importorskip("transformers")
    q = "model.layers.0.self_attn.q_proj.weight"
    folder = llama_folder(tmp_path, shapes={q: (32, 64)})  # [64, 32] stored as [32, 64]: same element count
    rc, res = _hf(["import", str(folder), str(tmp_path / "ours.pt")], capsys)
    assert rc == 2
    _one_line(res.err, f"tensor '{q}' has shape [32, 64], expected [64, 32]", str(folder / "model.safetensors"))
    assert not (tmp_path / "ours.pt").exists()


def test_a_reshaped_tensor_in_a_pt_is_refused_against_its_own_config(tmp_path, capsys):
    from mta_repro.eval.run import main as eval_main

    run_dir, _ = make_run(tmp_path / "run", attention="baseline")
    blob = torch.load(run_dir / "export" / "consolidated.pt", weights_only=True)
    wq = blob["model"]["layers.0.attention.wq.weight"]
    blob["model"]["layers.0.attention.wq.weight"] = wq.reshape(wq.shape[1] // 2, wq.shape[0] * 2)
    pt = tmp_path / "reshaped.pt"
    torch.save(blob, pt)
    assert eval_main([str(pt), "tasks=[ppl]"]) == 2
    _one_line(
        capsys.readouterr().err,
        "eval: error:",
        str(pt),
        "'layers.0.attention.wq.weight' has shape [32, 128], expected [64, 64] (its config's model)",
    )
    assert not (tmp_path / "eval").exists()


# ------------------------------------------------------------------ 4: interpolations in a stored config
def test_a_stored_config_with_a_resolver_is_refused_by_eval(tmp_path, capsys, monkeypatch):
    from mta_repro.eval.run import main as eval_main

    run_dir, _ = make_run(tmp_path / "run", attention="baseline")
    blob = torch.load(run_dir / "export" / "consolidated.pt", weights_only=True)
    blob["config"]["data"]["tokenizer"] = {"name": "sentencepiece", "path": "${oc.env:SECRET_PATH}"}
    pt = tmp_path / "interpolated.pt"
    torch.save(blob, pt)
    # a tokenizer that would work: resolving the variable would evaluate with this machine's file
    monkeypatch.setenv("SECRET_PATH", str(Path(__file__).parents[1] / "data" / "tokenizer" / "mini_sp8192.model"))
    assert eval_main([str(pt), "tasks=[ppl]"]) == 2
    _one_line(
        capsys.readouterr().err, "eval: error:", str(pt), "data.tokenizer.path: '${oc.env:SECRET_PATH}'", "never run"
    )
    assert not (tmp_path / "eval").exists()
    with pytest.raises(UnsafeFileError):  # and not skipped for an older file either
        load_weights(pt)
    # a reference to another key of the same config is data, and reads
    blob["config"]["data"]["tokenizer"] = {"name": "bytes", "path": None}
    blob["config"]["model"]["norm_eps"] = "${model.norm_eps_copy}"
    blob["config"]["model"]["norm_eps_copy"] = 1e-5
    torch.save(blob, pt)
    assert load_weights(pt).config["model"]["norm_eps"] == "${model.norm_eps_copy}"


# ------------------------------------------------------------------ 5: an oversized record
def _bomb(path: Path, n_bytes: int, after: int = 3) -> Path:
    """A .jsonl.zst whose first record holds ``n_bytes`` of one letter, then small records."""
    import zstandard

    path.parent.mkdir(parents=True, exist_ok=True)
    with zstandard.ZstdCompressor().stream_writer(open(path, "wb")) as w:
        w.write(b'{"text": "')
        for left in range(n_bytes, 0, -(1 << 20)):
            w.write(b"a" * min(left, 1 << 20))
        w.write(b'", "meta": {"redpajama_set_name": "RedPajamaC4"}}\n')
        for i in range(after):
            w.write(
                json.dumps({"text": f"small record {i} " * 40, "meta": {"redpajama_set_name": "RedPajamaC4"}}).encode()
                + b"\n"
            )
    return path


def test_a_400_mb_record_is_skipped_counted_and_never_held(tmp_path):
    from mta_repro.data import DataArgs, TokenizerArgs, build_train_loader
    from mta_repro.data.readers import MAX_RECORD_BYTES

    root = tmp_path / "corpus"
    bomb = _bomb(root / "train" / "chunk1" / "example_train_0.jsonl.zst", 400_000_000)
    assert bomb.stat().st_size < 100_000  # ~12 KB on disk
    (root / "validation" / "chunk1").mkdir(parents=True)
    args = DataArgs(
        root_dir=str(root),
        sources={"c4": 1.0},
        seq_len=32,
        batch_size=2,
        shuffle_buffer=0,
        tokenizer=TokenizerArgs(name="bytes", path=None),
    )
    assert args.max_record_bytes == MAX_RECORD_BYTES == 16 << 20
    loader = build_train_loader(args)
    tracemalloc.start()
    try:
        batch = next(iter(loader))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    text = bytes(batch["input"][0].tolist()[1:12]).decode("utf-8", errors="replace")
    assert "small rec" in text or "record" in text, text  # the records after it are read
    assert loader.bad_records()["oversize"] == 1
    # never the record whole (400 MB): a line up to the limit and its pieces, one decompressed piece (16 MiB)
    assert peak < 2 * MAX_RECORD_BYTES + (24 << 20), peak


def test_the_record_limit_is_a_setting_and_resumes_past_the_record(tmp_path):
    from mta_repro.data import DataArgs, TokenizerArgs, build_train_loader

    root = tmp_path / "corpus"
    _bomb(root / "train" / "chunk1" / "example_train_0.jsonl.zst", 5000, after=50)
    (root / "validation" / "chunk1").mkdir(parents=True)
    kw = dict(
        root_dir=str(root),
        sources={"c4": 1.0},
        seq_len=32,
        batch_size=2,
        shuffle_buffer=0,
        tokenizer=TokenizerArgs(name="bytes", path=None),
    )
    loader = build_train_loader(DataArgs(**kw))
    next(iter(loader))
    assert loader.bad_records()["oversize"] == 0  # 5 KB: under the default
    small = build_train_loader(DataArgs(**kw, max_record_bytes=1000))
    it = iter(small)
    first = next(it)
    assert small.bad_records()["oversize"] == 1
    state = small.state_dict()
    resumed = build_train_loader(DataArgs(**kw, max_record_bytes=1000))
    resumed.load_state_dict(state)
    assert torch.equal(next(iter(resumed))["input"], next(it)["input"]) and first is not None
    from mta_repro.data.args import to_data_args

    for bad in (0, -1, "16M"):
        with pytest.raises(ValueError, match="data.max_record_bytes"):
            to_data_args({**kw, "tokenizer": {"name": "bytes", "path": None}, "max_record_bytes": bad})


# ------------------------------------------------------------------ 6: a diverged model's perplexity
def test_a_huge_loss_is_perplexity_inf_in_the_result_and_the_report(tmp_path, capsys):
    from mta_repro.eval.run import main as eval_main
    from mta_repro.files import read_json
    from mta_repro.model.loss import perplexity
    from mta_repro.report.__main__ import main as report_main

    run_dir, _ = make_run(tmp_path / "run", attention="baseline")
    export = run_dir / "export" / "consolidated.pt"
    blob = torch.load(export, weights_only=True)
    blob["model"]["norm.weight"] = blob["model"]["norm.weight"] * 1e6  # logits x 1e6: a diverged sweep point
    torch.save(blob, export)
    args = ["tasks=[ppl]", "ppl.seq_len=32", "ppl.max_batches=1", "ppl.domains=[book]"]
    assert eval_main([str(run_dir), *args]) == 0, capsys.readouterr().err[-2000:]
    res = read_json(run_dir / "eval" / "ppl.json")["results"]  # the inf written as null, flagged
    loss = res["domains"]["book"]["loss"]
    assert math.isfinite(loss) and loss > math.log(sys.float_info.max)  # exp(loss) is past the largest float
    assert res["domains"]["book"]["ppl"] == math.inf and res["average"] == math.inf
    assert report_main([str(run_dir), "--out", str(tmp_path / "report"), "--no-kernels"]) == 0
    md = (tmp_path / "report" / "report.md").read_text()
    header = next(ln for ln in md.splitlines() if ln.startswith("| run | model | stage | trained | window |"))
    row = md.splitlines()[md.splitlines().index(header) + 2]
    cells = dict(zip([c.strip() for c in header.split("|")], [c.strip() for c in row.split("|")]))
    assert cells["book"] == "inf" and cells["avg"] == "inf" and cells["Δ vs baseline"] == "—", row
    assert perplexity(math.log(7.0)) == pytest.approx(7.0, rel=1e-12) and math.isnan(perplexity(math.nan))


# ------------------------------------------------------------------ 7: a model too large for the machine
def test_a_model_that_cannot_fit_is_refused_before_anything_is_allocated(tmp_path, capsys):
    from mta_repro.train.config import compose
    from mta_repro.train.loop import train

    run_dir = tmp_path / "big"
    cfg = compose(TRAIN + ["model.dim=65536", "model.n_heads=64", "trainer.device=cpu", f"run_dir={run_dir}"])
    assert run_cli("train", lambda: train(cfg)) == 2
    line = _one_line(
        capsys.readouterr().err, "train: error:", "model.dim=65536", "of memory available", "trainer.memory_check=false"
    )
    # the floor, computed here: fp32 parameters + AdamW moments (12 bytes each) and one fp32 copy of the logits
    D, L, V, B, T = 65536, cfg.model.n_layers, cfg.model.vocab_size, cfg.data.batch_size, cfg.data.seq_len
    from mta_repro.model import to_model_args

    F = to_model_args(cfg.model).ffn_hidden_dim
    params = V * D + L * (4 * D * D + 3 * D * F + 2 * D) + D  # tied embeddings, no biases
    assert f"{params / 1e9:.2f}B parameters" in line
    assert f"needs at least {(12 * params + 4 * B * T * V) / 1e9:.2f} GB" in line
    assert not run_dir.exists()


def test_a_cpu_start_counts_the_process_and_the_allocators_slack(tmp_path, capsys, monkeypatch):
    """The 1B-width demo whose pre-flight (20.8 GB) fitted a 22 GB machine but whose process
    was OOM-killed at 22.4 GB: the interpreter, torch and the libraries already resident,
    and glibc's freed-but-kept heap, are counted, and the start is refused before the model
    is materialised."""
    from mta_repro.estimate import memory_check
    from mta_repro.estimate.memory import estimate_from_config
    from mta_repro.train import loop
    from mta_repro.train.config import compose, to_train_config

    run_dir = tmp_path / "big"
    cfg = compose(TRAIN + ["model=1b", "model.vocab_size=8192", "trainer.device=cpu", f"run_dir={run_dir}"])
    pre = estimate_from_config(cfg).total  # python -m mta_repro.estimate ... --memory
    available = 22.0e9
    assert pre < 0.95 * available  # the tensors alone fit: the old check started this run
    monkeypatch.setattr(memory_check, "_meminfo_available", lambda: available)
    monkeypatch.setattr(memory_check, "_cgroup_available", lambda: None)
    monkeypatch.setattr(loop, "run", lambda *a: pytest.fail("the model was built"))
    held_before = memory_check.resident_bytes()
    assert run_cli("train", lambda: loop.train(cfg)) == 2
    line = _one_line(
        capsys.readouterr().err,
        "train: error:",
        "1.25B parameters",
        f"{pre / 1e9:.2f} GB by the memory pre-flight",
        f"{0.15 * pre / 1e9:.2f} GB allocator slack (15%, glibc default)",
        "this machine has 22.00 GB of memory available",
        "trainer.cpu_mmap_threshold=131072",
        "trainer.memory_check=false",
    )
    need = float(re.search(r"needs ([\d.]+) GB per rank", line).group(1)) * 1e9
    held = float(re.search(r"\+ ([\d.]+) GB process \(interpreter, torch, libraries\)", line).group(1)) * 1e9
    assert held == pytest.approx(held_before, abs=0.2e9)  # this process's resident memory, as /proc says
    assert need == pytest.approx(pre + held + 0.15 * pre, abs=0.02e9)
    assert not run_dir.exists()
    # the same check with room for the slack starts (the model would be built next)
    args = to_train_config(cfg)
    cpu = torch.device("cpu")
    assert memory_check.check_fits(args, 1, cpu, (1.16 * pre, "room")).total == pre
    args.trainer.cpu_mmap_threshold = 131072  # less slack kept: 5%
    assert memory_check.check_fits(args, 1, cpu, (1.06 * pre, "room")).total == pre
    with pytest.raises(memory_check.DoesNotFitError, match="allocator slack \\(5%, mmap threshold fixed\\)"):
        memory_check.check_fits(args, 1, cpu, (1.04 * pre, "room"))


def test_the_pre_flight_runs_when_the_floor_is_near_the_capacity(tmp_path):
    from mta_repro.estimate.memory import estimate_from_config
    from mta_repro.estimate.memory_check import DoesNotFitError, check_fits
    from mta_repro.train.config import compose, to_train_config

    cfg = compose(["experiment=debug", "trainer.device=cpu", "data.batch_size=16"])
    want = estimate_from_config(cfg).total  # the pre-flight's own command (python -m mta_repro.estimate --memory)
    args = to_train_config(cfg)
    cpu = torch.device("cpu")
    with pytest.raises(
        DoesNotFitError,
        match=f"{want / 1e9:.2f} GB by the memory pre-flight.*but a 0.3 GB test machine",
    ):
        check_fits(args, 1, cpu, (0.3e9, "a 0.3 GB test machine"))
    # on CPU the allocator's slack (15% under glibc's default) comes on top of the pre-flight
    assert check_fits(args, 1, cpu, (1.15 * want / 0.95, "room")).total == want  # fits (a warning: over 90%)
    assert check_fits(args, 1, cpu, (1e15, "plenty")) is None  # the floor is tiny: no model run needed
    args.trainer.memory_check = False
    assert check_fits(args, 1, cpu, (1.0, "one byte")) is None


# ------------------------------------------------------------------ 8: non-finite settings
@pytest.mark.parametrize(
    "override,field",
    [
        ("optim.lr=nan", "optim.lr"),
        ("optim.lr=inf", "optim.lr"),
        ("optim.eps=-inf", "optim.eps"),
        ("model.norm_eps=nan", "model.norm_eps"),
    ],
)
def test_non_finite_settings_are_one_line(tmp_path, capsys, override, field):
    from mta_repro.train.config import compose
    from mta_repro.train.loop import train

    run_dir = tmp_path / "run"
    cfg = compose(TRAIN + [override, f"run_dir={run_dir}"])
    assert run_cli("train", lambda: train(cfg)) == 2
    _one_line(capsys.readouterr().err, "train: error:", f"{field}: expected a", override.split("=")[1])
    assert not run_dir.exists()


# ------------------------------------------------------------------ 9: a result file of the wrong shape
def test_report_names_a_result_file_of_the_wrong_shape(tmp_path, capsys):
    from mta_repro.report.__main__ import main as report_main

    run_dir = tmp_path / "run"
    (run_dir / "eval").mkdir(parents=True)
    needle = run_dir / "eval" / "needle.json"
    needle.write_text(json.dumps([{"accuracy": 1.0}]))
    out = tmp_path / "report"
    assert report_main([str(run_dir), "--out", str(out)]) == 2
    _one_line(capsys.readouterr().err, f"{needle}: not an eval result", "expected an object, found a list")
    needle.write_text(json.dumps({"task": "needle", "results": {"accuracy": {"2048": [0.5]}}}))
    assert report_main([str(run_dir), "--out", str(out)]) == 2
    _one_line(
        capsys.readouterr().err, str(needle), "(needle)", "expected an object at results.accuracy.2048, found a list"
    )
    assert not out.exists()


def test_read_json_names_the_file_and_the_first_fault(tmp_path):
    from mta_repro.errors import UserError
    from mta_repro.files import fault, read_json

    f = tmp_path / "x.json"
    f.write_text("[1, 2")
    with pytest.raises(UserError, match=rf"{f}: not valid JSON \(line 1 column 6: .*\); expected a thing"):
        read_json(f, dict, "a thing")
    shape = {"a": {"*": float}, "b?": str}
    assert fault({"a": {"x": 1, "y": 2.5}}, shape) is None
    assert fault({"a": {"x": True}}, shape) == "expected a number at a.x, found a boolean"
    assert fault({"a": {}, "b": 3}, shape) == "expected a string at b, found an integer"
    assert fault({}, shape) == "expected key 'a'"
    f.write_text('{"a": {"x": Infinity}}')
    assert read_json(f, shape)["a"]["x"] == math.inf


def test_eval_re_evaluates_over_a_result_file_of_the_wrong_shape(tmp_path):
    """An earlier eval/<task>.json that is not an object is not "up to date"; it is replaced."""
    from mta_repro.eval.run import _up_to_date

    weights = tmp_path / "w.pt"
    weights.write_bytes(b"x")
    f = tmp_path / "ppl.json"
    f.write_text("[]")
    assert _up_to_date(f, weights, {}) is False


# ------------------------------------------------------------------ 10, 11: the HF export's folder and modes
@pytest.mark.slow
def test_export_into_a_foreign_folder_needs_force_and_replaces_our_own(tmp_path, capsys):
    pytest.importorskip("transformers")
    run_dir, _ = make_run(tmp_path / "run", attention="baseline")
    mta_dir, _ = make_run(tmp_path / "mta", attention="mta")
    foreign = tmp_path / "someone"
    foreign.mkdir()
    (foreign / "config.json").write_text('{"theirs": true}')
    (foreign / "notes.txt").write_text("keep me")
    before = _snapshot(foreign)
    rc, res = _hf(["export", str(run_dir), str(foreign)], capsys)
    assert rc == 2
    _one_line(res.err, "hf: error:", f"{foreign} is not empty", "is not an export of ours", "--force")
    assert _snapshot(foreign) == before
    rc, res = _hf(["export", str(run_dir), str(foreign), "--force"], capsys)
    assert rc == 0, res.err[-2000:]
    assert (foreign / "notes.txt").read_text() == "keep me" and "theirs" not in (foreign / "config.json").read_text()
    # our own earlier export is replaced, without the files the new one does not write
    ours = tmp_path / "hf"
    assert _hf(["export", str(mta_dir), str(ours)], capsys)[0] == 0
    assert (ours / "modeling_mta_repro.py").is_file()
    assert _hf(["export", str(run_dir), str(ours)], capsys)[0] == 0
    assert not (ours / "modeling_mta_repro.py").exists()
    assert json.loads((ours / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


@pytest.mark.parametrize("attention", ["baseline", "mta"])
def test_every_exported_file_has_the_umask_mode(tmp_path, capsys, attention):
    pytest.importorskip("transformers")
    run_dir, _ = make_run(tmp_path / "run", attention=attention)
    old = os.umask(0o022)
    try:
        assert _hf(["export", str(run_dir), str(tmp_path / "hf")], capsys)[0] == 0
    finally:
        os.umask(old)
    modes = {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in (tmp_path / "hf").iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {"0o644"}, modes


# ------------------------------------------------------------------ one step further: DCP checkpoints
def test_a_dcp_checkpoint_with_integer_model_tensors_is_named(tmp_path):
    import warnings

    import torch.distributed.checkpoint as dcp

    run_dir, ref = make_run(tmp_path / "run", attention="baseline", fmt="dcp")
    sd = {k: v.view(torch.int32) if k == "tok_embeddings.weight" else v for k, v in ref.state_dict().items()}
    ck = run_dir / "checkpoints" / "0000000009"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": sd, "step": 9}, checkpoint_id=str(ck))
    (ck / ".complete").touch()
    with pytest.raises(
        CorruptFileError,
        match=f"checkpoint {ck} is unreadable: tensor 'tok_embeddings.weight' is int32, expected a float dtype",
    ):
        load_weights(ck)
    with pytest.warns(UserWarning, match="falling back to .*0000000007"):
        assert load_weights(run_dir).step == 7  # a run dir falls back to the previous checkpoint, with one line


# ------------------------------------------------------------------ the commands, as typed
@pytest.mark.slow
def test_the_commands_as_a_user_runs_them(tmp_path):
    """Separate processes, as typed: a model too large, a non-finite lr, a crafted header."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}

    def run(*argv):
        return subprocess.run(
            [sys.executable, "-m", *argv], capture_output=True, text=True, timeout=300, env=env, cwd=root
        )

    for extra, says in (
        (["model.dim=65536", "model.n_heads=64"], "model.dim=65536"),
        (["optim.lr=nan"], "optim.lr: expected a finite number, got nan"),
    ):
        r = run("mta_repro.train", "experiment=debug", "trainer.device=cpu", f"run_dir={tmp_path / 'run'}", *extra)
        assert r.returncode == 2, r.stderr[-3000:]
        _one_line(r.stderr, "train: error:", says)
        assert not (tmp_path / "run").exists()
    pytest.importorskip("transformers")
    folder = llama_folder(tmp_path, header_len=2**62)
    r = run("mta_repro.hf", "import", str(folder), str(tmp_path / "ours.pt"))
    assert r.returncode == 2, r.stderr[-3000:]
    _one_line(r.stderr, "hf: error:", str(folder / "model.safetensors"), "header length 4611686018427387904")
    assert not (tmp_path / "ours.pt").exists()


@pytest.mark.parametrize(
    "override, says",
    [
        ("distributed.timeout_min=0", "distributed.timeout_min: expected whole minutes from 1"),
        ("distributed.timeout_min=-5", "distributed.timeout_min: expected whole minutes from 1"),
        ("optim.lr=1e308", "optim.lr: expected at most 3.403e+38"),
        ("optim.eps=1e308", "optim.eps: expected at most"),
        ("optim.weight_decay=-0.1", "optim.weight_decay: expected >= 0"),
        ("optim.eps=-1e-8", "optim.eps: expected >= 0"),
        ("model.rope_theta=0", "model.rope_theta: expected a finite number > 0"),
        ("model.norm_eps=-1e-5", "model.norm_eps: expected a finite number >= 0"),
        ("model.ffn_dim_multiplier=-1", "model.ffn_dim_multiplier: expected a finite number > 0"),
    ],
)
def test_numbers_out_of_their_range_are_one_line_before_any_work(tmp_path, capsys, override, says):
    """Values that used to end in a traceback (the process group's timeout, AdamW's
    float32 scalars, RoPE's base): refused as the train command checks its overrides,
    before the run directory exists."""
    from mta_repro.train.__main__ import cli

    run_dir = tmp_path / "run"
    assert cli(["experiment=debug", f"run_dir={run_dir}", override]) == 2
    _one_line(capsys.readouterr().err, "train: error:", says)
    assert not run_dir.exists()
