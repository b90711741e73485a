"""scripts/prepare_slimpajama.py on a small fixture in the raw release layout (and parquet)."""

import importlib.util
import json
from collections import defaultdict

import pytest
import zstandard

from mta_repro.data import DataArgs, TokenizerArgs, build_train_loader
from mta_repro.data.args import REPO_ROOT
from mta_repro.data.records import SET_NAMES

spec = importlib.util.spec_from_file_location("prepare_slimpajama", REPO_ROOT / "scripts/prepare_slimpajama.py")
prep = importlib.util.module_from_spec(spec)
spec.loader.exec_module(prep)

DOMS = ["arxiv", "book", "c4", "github"]
N_BAD_PER_FILE = 3


def _zst(path, lines):
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = b"".join((l if isinstance(l, bytes) else json.dumps(l).encode()) + b"\n" for l in lines)
    path.write_bytes(zstandard.ZstdCompressor().compress(raw))


def release_fixture(root, n_chunks=3, files_per_chunk=2, per_file=10):
    """Raw release layout; returns {domain: set(train docs)}, {domain: set(val docs)}."""
    train, val = defaultdict(set), defaultdict(set)
    for c in range(1, n_chunks + 1):
        for f in range(files_per_chunk):
            lines = []
            for i in range(per_file):
                d = DOMS[(i + c) % len(DOMS)]
                t = f"{d} doc {c}/{f}/{i}"
                train[d].add(t)
                lines.append({"text": t, "meta": {"redpajama_set_name": SET_NAMES[d]}})
            lines[3:3] = [b"{not json", {"text": "x"}, {"meta": {"redpajama_set_name": "RedPajamaC4"}}]
            _zst(root / "train" / f"chunk{c}" / f"example_train_{f}.jsonl.zst", lines)
    lines = []
    for d in DOMS:
        for i in range(2):
            val[d].add(f"{d} val {i}")
            lines.append({"text": f"{d} val {i}", "meta": {"redpajama_set_name": SET_NAMES[d]}})
    _zst(root / "validation" / "chunk1" / "example_holdout_0.jsonl.zst", lines)
    return train, val


def read_out(out):
    """{file name: [(set name, text), ...]} of every finished output file."""
    res = {}
    for p in sorted(out.glob("*/*.jsonl.zst")):
        raw = zstandard.ZstdDecompressor().stream_reader(p.open("rb")).read().decode()
        res[str(p.relative_to(out))] = [
            (json.loads(l)["meta"]["redpajama_set_name"], json.loads(l)["text"]) for l in raw.splitlines()
        ]
    return res


def check_output(out, train, val, chunks):
    files = read_out(out)
    for d in DOMS:
        chunk_files = [f"{d}/{d}.chunk.{k:02d}.jsonl.zst" for k in range(chunks)]
        got = [t for f in chunk_files for s, t in files[f] if s == SET_NAMES[d]]
        assert all(s == SET_NAMES[d] for f in chunk_files for s, _ in files[f])
        assert len(got) == len(set(got)) and set(got) == train[d]  # every document, once
        assert {t for _, t in files[f"{d}/{d}.val.jsonl.zst"]} == val[d]
    assert not list(out.glob("*/*.tmp"))
    return files


def test_prepare_release_layout_and_loader(tmp_path):
    train, val = release_fixture(tmp_path / "raw")
    res = prep.prepare(tmp_path / "raw", tmp_path / "out", chunks=4, progress=False)
    assert res["done"] == [f"chunk.{k:02d}" for k in range(4)] + ["val"] and res["skipped"] == []
    # each of the 6 files has one malformed line, one record without meta, one without text
    assert res["bad_records"] == {"malformed_json": 6, "missing_meta": 6, "missing_text": 6}
    check_output(tmp_path / "out", train, val, 4)
    # the loader reads the result in the domains layout
    args = DataArgs(
        root_dir=str(tmp_path / "out"),
        layout="domains",
        sources={d: 1.0 for d in DOMS},
        seq_len=16,
        batch_size=2,
        shuffle_buffer=0,
        tokenizer=TokenizerArgs(name="bytes", path=None),
    )
    assert next(build_train_loader(args, 1, 3))["input"].shape == (2, 16)
    # more chunks than input files (6): files are split by line, nothing lost
    prep.prepare(tmp_path / "raw", tmp_path / "out8", chunks=8, progress=False)
    check_output(tmp_path / "out8", train, val, 8)
    assert len(list((tmp_path / "out8").glob("*/*.jsonl.zst"))) == 7 * 9  # all 7 domains, even empty


def test_prepare_rerun_after_interruption(tmp_path, monkeypatch):
    train, val = release_fixture(tmp_path / "raw")
    ref = prep.prepare(tmp_path / "raw", tmp_path / "ref", chunks=3, progress=False)
    ref_files = read_out(tmp_path / "ref")
    out = tmp_path / "out"

    real = prep.iter_records
    calls = {"n": 0}

    def crashing(path, stride, offset, counts, bad=None):  # dies in the 2nd input of the 2nd unit
        calls["n"] += 1
        for i, r in enumerate(real(path, stride, offset, counts, bad)):
            if calls["n"] == 4 and i == 2:
                raise KeyboardInterrupt
            yield r

    monkeypatch.setattr(prep, "iter_records", crashing)
    with pytest.raises(KeyboardInterrupt):
        prep.prepare(tmp_path / "raw", out, chunks=3, progress=False)
    monkeypatch.setattr(prep, "iter_records", real)
    assert (out / ".prepare" / "chunk.00.done").exists() and not (out / ".prepare" / "chunk.01.done").exists()
    assert list(out.glob("*/*.chunk.01.jsonl.zst.tmp"))  # half-written
    assert not list(out.glob("*/*.chunk.01.jsonl.zst"))
    # a stale, wrong final file of an unfinished chunk must not survive either
    (out / "arxiv" / "arxiv.chunk.02.jsonl.zst").write_bytes(b"garbage")
    done_mtime = (out / "arxiv" / "arxiv.chunk.00.jsonl.zst").stat().st_mtime_ns

    res = prep.prepare(tmp_path / "raw", out, chunks=3, progress=False)
    assert res["skipped"] == ["chunk.00"] and res["done"] == ["chunk.01", "chunk.02", "val"]
    assert (out / "arxiv" / "arxiv.chunk.00.jsonl.zst").stat().st_mtime_ns == done_mtime  # not redone
    assert read_out(out) == ref_files  # identical to an uninterrupted run
    assert res["bad_records"] == ref["bad_records"]
    check_output(out, train, val, 3)
    # a third run has nothing to do; a different --chunks on the same --out is refused
    assert prep.prepare(tmp_path / "raw", out, chunks=3, progress=False)["done"] == []
    with pytest.raises(ValueError, match="was prepared with"):
        prep.prepare(tmp_path / "raw", out, chunks=5, progress=False)


def test_prepare_parquet_subset(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "raw" / "data").mkdir(parents=True)
    for split, n in (("train", 12), ("validation", 4)):
        rows = [
            {"text": f"{DOMS[i % 4]} {split} {i}", "meta": {"redpajama_set_name": SET_NAMES[DOMS[i % 4]]}}
            for i in range(n)
        ]
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / "raw" / "data" / f"{split}-00000-of-00001.parquet")
    res = prep.prepare(tmp_path / "raw", tmp_path / "out", chunks=2, progress=False)
    assert res["bad_records"] == {}
    files = read_out(tmp_path / "out")
    got = sorted(t for f, recs in files.items() if ".chunk." in f for _, t in recs)
    assert got == sorted(f"{DOMS[i % 4]} train {i}" for i in range(12))
    assert [t for _, t in files["c4/c4.val.jsonl.zst"]] == ["c4 validation 2"]
