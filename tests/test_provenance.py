"""Every number traces to its inputs (docs/provenance.md).

- the data reader hashes exactly the text it read (a resume recomputes it at no extra
  read); the listing's fingerprint is that of the names, sizes and mtimes;
- a resume finds a data file whose text the run read changed (the open one, or one read to
  its end whose stat changed), says nothing of a file only touched, and warns of files
  that vanished or appeared where it has not read yet, reading the files it started with.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import shutil
import sys
from pathlib import Path

import pytest
import torch
import zstandard

from mta_repro.data import DataArgs, TokenizerArgs, build_train_loader
from mta_repro.data.sources import ShortFileError, _LineReader, fingerprint, list_entries

from test_data import domains_corpus, write_jsonl

ROOT = Path(__file__).resolve().parents[1]
BYTES = TokenizerArgs(name="bytes", path=None)
sys.path.insert(0, str(Path(__file__).parent / "fixtures" / "eval"))


def _args(root, **kw):
    return DataArgs(root_dir=str(root), layout="domains", sources={"a": 1.0}, seq_len=16, batch_size=2,
                    shuffle_buffer=2, tokenizer=BYTES, **kw)


def _state_in(loader, file_index: int, min_done: int = 0) -> dict:
    """Batches until stream "a" is inside its ``file_index``-th file (with ``min_done``
    files read to their end); the state there, through a pickle round trip."""
    for _ in range(2000):
        sd = loader.state_dict()
        s = sd["streams"]["a"]
        if s["file"].endswith(f".chunk.{file_index:02d}.jsonl.zst") and s["offset"] > 0 and len(sd["files"]) >= min_done:
            return pickle.loads(pickle.dumps(sd))
        next(loader)
    raise AssertionError("the stream never got there")


# ------------------------------------------------------------------ what is read
def test_the_reader_hashes_exactly_the_text_it_read(tmp_path):
    f = tmp_path / "x.jsonl.zst"
    write_jsonl(f, [{"text": f"doc {i} " * 30} for i in range(300)], zst=True)
    text = zstandard.ZstdDecompressor().decompressobj().decompress(f.read_bytes())  # independently
    r = _LineReader(f, 0)
    k = sum(len(r.readline()) for _ in range(7))
    assert r.pos == k and r.digest() == hashlib.sha256(text[:k]).hexdigest()
    r.close()
    # reopened at the offset (a resume): the skipped text is hashed on the way, reading goes on
    again = _LineReader(f, k)
    assert again.digest() == hashlib.sha256(text[:k]).hexdigest()
    assert again.readline() == text[k:].split(b"\n")[0] + b"\n"
    st = os.stat(f)
    assert (again.size, again.mtime_ns) == (st.st_size, st.st_mtime_ns)
    again.close()
    plain = tmp_path / "y.jsonl"
    write_jsonl(plain, [{"text": "p" * i} for i in range(1, 50)])
    assert _LineReader(plain, 100).digest() == hashlib.sha256(plain.read_bytes()[:100]).hexdigest()
    with pytest.raises(ShortFileError):
        _LineReader(f, len(text) + 1)


def test_the_listing_fingerprint_is_names_sizes_and_mtimes(tmp_path):
    domains_corpus(tmp_path / "c", {"a": (3, 5)}, zst=True)
    args = _args(tmp_path / "c")
    entries = list_entries(args, "a", "train")
    files = sorted((tmp_path / "c" / "a").glob("*.chunk.*"))
    assert [e[0] for e in entries] == [f"a/{f.name}" for f in files]
    lines = "".join(f"a/{f.name}\t{f.stat().st_size}\t{f.stat().st_mtime_ns}\n" for f in files)
    fp = fingerprint(entries)
    assert fp == {"files": 3, "bytes": sum(f.stat().st_size for f in files),
                  "sha256": hashlib.sha256(lines.encode()).hexdigest()}
    # without mtimes a copy of the corpus is the same; with them, a rewrite in place is noticed
    shutil.copytree(tmp_path / "c", tmp_path / "d", copy_function=shutil.copyfile)  # new mtimes
    copy = list_entries(_args(tmp_path / "d"), "a", "train")
    assert fingerprint(copy, with_mtime=False) == fingerprint(entries, with_mtime=False)
    assert fingerprint(copy) != fp


# ------------------------------------------------------------------ resume checks
def test_a_resume_refuses_changed_text_and_not_a_touched_file(tmp_path):
    domains_corpus(tmp_path, {"a": (3, 40)}, zst=True)
    args = _args(tmp_path)
    ref = build_train_loader(args, 0, 1)
    sd = _state_in(ref, 1, min_done=1)
    assert list(sd["files"]) == ["a/a.chunk.00.jsonl.zst"]  # read to its end
    expected = [next(ref) for _ in range(6)]
    first, open_ = tmp_path / "a" / "a.chunk.00.jsonl.zst", tmp_path / "a" / "a.chunk.01.jsonl.zst"

    # touched (a copy without -p, a backup tool): same text, new mtimes: nothing to say, exact
    for f in (first, open_):
        st = f.stat()
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 5 * 10**9))
    fresh = build_train_loader(args, 0, 1)
    fresh.load_state_dict(sd)
    assert fresh.input_check == {"refuse": [], "warn": []}
    got = [next(fresh) for _ in range(6)]
    assert all(torch.equal(a["input"], b["input"]) for a, b in zip(got, expected))
    assert fresh.state_dict()["files"]["a/a.chunk.00.jsonl.zst"][:2] == (first.stat().st_size,
                                                                         first.stat().st_mtime_ns)

    # the open file replaced by another: the text read of it differs
    keep = open_.read_bytes()
    write_jsonl(open_, [{"text": f"<other|{i}>"} for i in range(40)], zst=True)
    fresh = build_train_loader(args, 0, 1)
    fresh.load_state_dict(sd)
    (line,) = fresh.input_check["refuse"]
    n = sd["streams"]["a"]["offset"]
    assert line.startswith(f"{open_}: the {n:,} bytes of text rank 0 read of it changed (sha256 ")
    open_.write_bytes(keep)

    # a file read to its end rewritten with other text: its stat changed, so it is rehashed
    write_jsonl(first, [{"text": f"<a|0|{i}>!"} for i in range(40)], zst=True)
    fresh = build_train_loader(args, 0, 1)
    fresh.load_state_dict(sd)
    (line,) = fresh.input_check["refuse"]
    assert line.startswith(f"{first} changed (sha256 ") and "rank 0 read of it" in line
    # accepted: its record is dropped (a later read records it anew); the open file reads on
    fresh.accept_input_changes()
    assert "a/a.chunk.00.jsonl.zst" not in fresh.state_dict()["files"]


def test_files_that_vanish_or_appear_are_named_and_the_run_keeps_its_files(tmp_path):
    domains_corpus(tmp_path, {"a": (3, 30)}, zst=True)
    args = _args(tmp_path)
    ref = build_train_loader(args, 0, 1)
    sd = _state_in(ref, 0)
    (tmp_path / "a" / "a.chunk.02.jsonl.zst").unlink()
    write_jsonl(tmp_path / "a" / "a.chunk.03.jsonl.zst", [{"text": f"<a|3|{i}>"} for i in range(30)], zst=True)
    fresh = build_train_loader(args, 0, 1)
    fresh.load_state_dict(sd)
    check = fresh.input_check
    assert check["refuse"] == []
    vanished, layout = check["warn"]
    assert vanished == ("1 file(s) of rank 0's share vanished before it read them (a/a.chunk.02.jsonl.zst): it "
                        "reads its other 2 files without them")
    assert "files that appeared are not read" in layout and "(3 files," in layout
    docs = [fresh.streams["a"].next_doc() for _ in range(150)]
    assert {d.split("|")[1] for d in docs} == {"0", "1"}  # epochs over its own files, less the vanished one
    assert fresh.streams["a"].epoch >= 2 and fresh.bad_records()["corrupt_file"] == 0  # vanished is not damaged
    # a new run reads the corpus as it is now
    new = build_train_loader(args, 0, 1)
    assert {d.split("|")[1] for d in (new.streams["a"].next_doc() for _ in range(90))} == {"0", "1", "3"}


def test_an_unchanged_resume_finds_nothing_on_the_bundled_corpus():
    args = DataArgs(seq_len=32, batch_size=2, shuffle_buffer=8)
    ref = build_train_loader(args, 0, 1)
    for _ in range(12):
        next(ref)
    sd = pickle.loads(pickle.dumps(ref.state_dict()))
    expected = [next(ref) for _ in range(4)]
    fresh = build_train_loader(args, 0, 1)
    fresh.load_state_dict(sd)
    assert fresh.input_check == {"refuse": [], "warn": []}
    assert all(torch.equal(next(fresh)["input"], e["input"]) for e in expected)
    # the seven domain streams share one shard object: the state holds it once
    shards = {id(s["shard"]) for s in sd["streams"].values()}
    assert len(shards) == 1


