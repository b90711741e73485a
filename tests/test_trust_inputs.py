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
import stat
import sys
import tracemalloc
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "fixtures" / "eval"))


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
    return {str(p.relative_to(folder)): (hashlib.sha256(p.read_bytes()).hexdigest(), stat.S_IMODE(p.stat().st_mode))
            for p in sorted(folder.rglob("*")) if p.is_file()}


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
            w.write(json.dumps({"text": f"small record {i} " * 40, "meta": {"redpajama_set_name": "RedPajamaC4"}})
                    .encode() + b"\n")
    return path


def test_a_400_mb_record_is_skipped_counted_and_never_held(tmp_path):
    from mta_repro.data import DataArgs, TokenizerArgs, build_train_loader
    from mta_repro.data.sources import MAX_RECORD_BYTES

    root = tmp_path / "corpus"
    bomb = _bomb(root / "train" / "chunk1" / "example_train_0.jsonl.zst", 400_000_000)
    assert bomb.stat().st_size < 100_000  # ~12 KB on disk
    (root / "validation" / "chunk1").mkdir(parents=True)
    args = DataArgs(root_dir=str(root), sources={"c4": 1.0}, seq_len=32, batch_size=2, shuffle_buffer=0,
                    tokenizer=TokenizerArgs(name="bytes", path=None))
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
    kw = dict(root_dir=str(root), sources={"c4": 1.0}, seq_len=32, batch_size=2, shuffle_buffer=0,
              tokenizer=TokenizerArgs(name="bytes", path=None))
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
    _one_line(capsys.readouterr().err, str(needle), "(needle)",
              "expected an object at results.accuracy.2048, found a list")
    assert not out.exists()


def test_read_json_names_the_file_and_the_first_fault(tmp_path):
    from mta_repro.errors import UserError
    from mta_repro.json_files import fault, read_json

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
