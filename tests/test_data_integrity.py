"""A truncated or corrupt .jsonl.zst (a download cut short) is reported by name and
counted: prepare_slimpajama fails with the list by default (or keeps what was readable
with --bad-files skip); the loader warns once per file and counts it."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
from test_data import domains_corpus, write_jsonl
from test_data_prepare import prep, read_out, release_fixture

from mta_repro.data import DataArgs, TokenizerArgs, build_train_loader
from mta_repro.data.args import REPO_ROOT
from mta_repro.data.readers import LineReader
from mta_repro.data.sources import DocStream
from mta_repro.errors import CorruptFileError


def _truncate(path, frac=0.5):
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * frac)])


def test_line_reader_raises_on_a_truncated_or_garbage_zst(tmp_path):
    f = tmp_path / "a.jsonl.zst"
    write_jsonl(f, [{"text": "x" * 200, "i": i} for i in range(500)], zst=True)
    _truncate(f)
    r = LineReader(f, 0)
    with pytest.raises(CorruptFileError, match=rf"{f}: truncated"):
        while r.readline():
            pass
    g = tmp_path / "g.jsonl.zst"
    g.write_bytes(b"not zstd at all" * 10)
    with pytest.raises(CorruptFileError, match=rf"{g}: not a valid zstd stream"):
        LineReader(g, 0).readline()
    # Multi-frame files (concatenated .zst) read to the end.
    import zstandard

    m = tmp_path / "m.jsonl.zst"
    m.write_bytes(
        zstandard.ZstdCompressor().compress(b'{"text": "a"}\n')
        + zstandard.ZstdCompressor().compress(b'{"text": "b"}\n')
    )
    r = LineReader(m, 0)
    assert [r.readline(), r.readline(), r.readline()] == [b'{"text": "a"}\n', b'{"text": "b"}\n', b""]


@pytest.mark.slow
def test_prepare_fails_with_the_list_then_skip_keeps_the_rest(tmp_path):
    raw = tmp_path / "raw"
    release_fixture(raw)
    bad = raw / "train" / "chunk2" / "example_train_1.jsonl.zst"
    _truncate(bad, 0.6)
    out = tmp_path / "out"
    with pytest.raises(ValueError) as e:
        prep.prepare(raw, out, chunks=3, progress=False)
    msg = str(e.value)
    assert "1 input file(s) are truncated or corrupt: train/chunk2/example_train_1.jsonl.zst" in msg
    assert "--bad-files skip" in msg
    failed_units = [u for u in ("chunk.00", "chunk.01", "chunk.02") if not (out / ".prepare" / f"{u}.done").exists()]
    assert len(failed_units) == 1  # the other chunks are done, that one was not written
    assert not list(out.glob(f"*/*.{failed_units[0]}.jsonl.zst*"))
    # The CLI: one line naming the file, exit status 1.
    p = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "scripts/prepare_slimpajama.py"),
            "--src",
            str(raw),
            "--out",
            str(out),
            "--chunks",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 1 and "example_train_1.jsonl.zst" in p.stderr and "Traceback" not in p.stderr

    res = prep.prepare(raw, out, chunks=3, progress=False, bad_files="skip")
    assert res["done"] == failed_units and res["bad_records"]["corrupt_file"] == 1
    assert [b["file"] for b in res["bad_files"]] == ["train/chunk2/example_train_1.jsonl.zst"]
    assert "truncated" in res["bad_files"][0]["error"]
    marker = json.loads((out / ".prepare" / f"{failed_units[0]}.done").read_text())
    assert marker["bad_files"][0]["file"] == "train/chunk2/example_train_1.jsonl.zst"
    assert read_out(out)  # readable output


def test_loader_warns_once_per_file_and_counts(tmp_path, caplog):
    all_docs = domains_corpus(tmp_path, {"a": (3, 40)}, zst=True)
    bad = tmp_path / "a" / "a.chunk.01.jsonl.zst"
    _truncate(bad, 0.3)
    args = DataArgs(
        root_dir=str(tmp_path), layout="domains", sources={"a": 1.0}, tokenizer=TokenizerArgs("bytes", None)
    )
    s = DocStream(args, "a", 0, 1)
    with caplog.at_level(logging.WARNING, logger="mta_repro.data.sources"):
        docs = [s.next_doc() for _ in range(3 * 80)]  # several epochs
    warnings = [r for r in caplog.records if "truncated or corrupt" in r.getMessage()]
    assert len(warnings) == 1 and str(bad) in warnings[0].getMessage()
    assert s.bad == {"corrupt_file": 1} and s.bad_files == {"a/a.chunk.01.jsonl.zst"}
    good = {d for d in all_docs if not d.startswith("<a|1|")}
    assert good <= set(docs)  # the intact files are read in full
    # the count survives a save/load (no second count for the same file)
    st = s.state_dict()
    s2 = DocStream(args, "a", 0, 1)
    s2.load_state_dict(st)
    for _ in range(200):
        s2.next_doc()
    assert s2.bad == {"corrupt_file": 1}
    # and the train loader's state carries it
    loader = build_train_loader(args, 0, 1)
    for _ in range(50):
        next(loader)
    assert loader.state_dict()["streams"]["a"]["bad"] == {"corrupt_file": 1}


@pytest.mark.slow
def test_trainer_logs_the_bad_records(tmp_path):
    """The counts reach metrics.jsonl (data_bad/<kind>), summed over ranks."""
    from mta_repro.train.config import compose
    from mta_repro.train.loop import train

    corpus = tmp_path / "corpus"
    domains_corpus(corpus, {"a": (2, 30), "b": (2, 30)}, zst=True)
    _truncate(corpus / "a" / "a.chunk.01.jsonl.zst", 0.3)
    write_jsonl(corpus / "b" / "b.chunk.02.jsonl", [b"{broken", {"text": "fine"}])
    run = tmp_path / "run"
    cfg = compose(
        [
            f"run_dir={run}",
            f"data.root_dir={corpus}",
            "data.layout=domains",
            "data.tokenizer.name=bytes",
            "data.tokenizer.path=null",
            "model.vocab_size=258",
            "data.seq_len=32",
            "data.batch_size=2",
            "trainer.steps=20",
            "trainer.device=cpu",
            "trainer.eval_every=0",
            "checkpoint.every=100",
            "checkpoint.export=false",
            "logging.every=20",
            "logging.wandb_mode=disabled",
            "logging.progress_bar=false",
        ]
    )
    cfg.data.sources = {"a": 1.0, "b": 1.0}
    train(cfg)
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["data_bad/corrupt_file"] == 1 and last["data_bad/malformed_json"] >= 1
