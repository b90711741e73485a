"""Data loader: exact resume, mixture proportions, per-rank coverage, bad input, config faults."""

import json
import logging
import math
import pickle
import threading
from collections import Counter

import pytest
import torch
import zstandard

from mta_repro.data import DataArgs, TokenizerArgs, build_train_loader, domains, iter_validation_docs
from mta_repro.data.records import SET_NAMES

BYTES = TokenizerArgs(name="bytes", path=None)


# ----------------------------------------------------------------------------- fixtures
def write_jsonl(path, lines, zst=False):
    """``lines``: dicts (written as JSON) or raw bytes (written as is)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = b"".join((l if isinstance(l, bytes) else json.dumps(l).encode()) + b"\n" for l in lines)
    path.write_bytes(zstandard.ZstdCompressor().compress(raw) if zst else raw)


def domains_corpus(root, spec, zst=False):
    """Per-domain layout; spec = {domain: (n_files, docs_per_file)}; doc text names itself."""
    for d, (n_files, per_file) in spec.items():
        for f in range(n_files):
            docs = [{"text": f"<{d}|{f}|{i}>"} for i in range(per_file)]
            write_jsonl(root / d / f"{d}.chunk.{f:02d}.jsonl{'.zst' if zst else ''}", docs, zst)
        write_jsonl(root / d / f"{d}.val.jsonl", [{"text": f"<{d}|val|{i}>"} for i in range(3)])
    return {f"<{d}|{f}|{i}>" for d, (n, k) in spec.items() for f in range(n) for i in range(k)}


def release_corpus(root, n_chunks, per_file, doms=("arxiv", "c4", "wikipedia")):
    """Release layout: train/chunkK/example_train_0.jsonl.zst with domains interleaved."""
    all_docs = set()
    for c in range(1, n_chunks + 1):
        recs = []
        for i in range(per_file):
            d = doms[i % len(doms)]
            text = f"<{d}|{c}|{i}>"
            all_docs.add(text)
            recs.append({"text": text, "meta": {"redpajama_set_name": SET_NAMES[d]}})
        write_jsonl(root / "train" / f"chunk{c}" / "example_train_0.jsonl.zst", recs, zst=True)
    write_jsonl(
        root / "validation" / "chunk1" / "example_holdout_0.jsonl.zst",
        [{"text": f"<{d}|val>", "meta": {"redpajama_set_name": SET_NAMES[d]}} for d in doms],
        zst=True,
    )
    return all_docs


def docs_in(tokens):
    """Documents of a bytes-tokenizer stream: the text between BOS (256) and EOS (257)."""
    out, cur = [], None
    for t in tokens:
        if t == 256:
            cur = []
        elif t == 257:
            if cur is not None:
                out.append(bytes(cur).decode())
            cur = None
        elif cur is not None:
            cur.append(t)
    return out


def stream_of(batches):
    """The token stream of unshuffled batches (each window = input + last target)."""
    toks = []
    for b in batches:
        for x, y in zip(b["input"], b["target"]):
            toks += x.tolist() + y[-1:].tolist()
    return toks


# ----------------------------------------------------------------------------- resume
def _same(a, b):
    return len(a) == len(b) and all(
        torch.equal(x["input"], y["input"]) and torch.equal(x["target"], y["target"]) for x, y in zip(a, b)
    )


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("prefetch", [0, 2])
def test_exact_resume_bundled_corpus(world_size, prefetch):
    args = DataArgs(seq_len=32, batch_size=2, shuffle_buffer=8, prefetch=prefetch)  # bundled corpus + sp tokenizer
    n_words = 8192
    for rank in range(world_size):
        ref = build_train_loader(args, rank, world_size)
        N, M = 7, 6
        before = [next(ref) for _ in range(N)]
        # take the state mid-document: the packing remainder holds a document's tail
        while True:
            sd = ref.state_dict()
            if sd["tokens"] and sd["tokens"][0] not in (1,):  # remainder does not start at a BOS
                break
            before.append(next(ref))
        sd = pickle.loads(pickle.dumps(sd))  # it must survive serialisation
        expected = [next(ref) for _ in range(M)]
        ref.close()
        assert not any(t.name.startswith("data-prefetch") for t in threading.enumerate())
        assert len(sd["tokens"]) > 0
        for b in before + expected:
            assert b["input"].shape == (2, 32) and b["input"].dtype == torch.long
            assert torch.equal(b["input"][:, 1:], b["target"][:, :-1])
            assert int(b["input"].max()) < n_words
        fresh = build_train_loader(args, rank, world_size)
        fresh.load_state_dict(sd)
        got = [next(fresh) for _ in range(M)]
        fresh.close()
        assert _same(got, expected), f"rank {rank}/{world_size}: resumed batches differ"
        # and a loader that did not resume starts elsewhere (the test can tell them apart)
        other = build_train_loader(args, rank, world_size)
        assert not _same([next(other) for _ in range(M)], expected)
        other.close()


def test_ranks_differ_and_state_checks():
    args = DataArgs(seq_len=16, batch_size=2, shuffle_buffer=4)
    a, b = build_train_loader(args, 0, 2), build_train_loader(args, 1, 2)
    assert not torch.equal(next(a)["input"], next(b)["input"])
    with pytest.raises(ValueError, match="rank 0/2"):
        build_train_loader(args, 0, 1).load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="data.seq_len"):
        build_train_loader(DataArgs(seq_len=8, batch_size=2, shuffle_buffer=4), 0, 2).load_state_dict(a.state_dict())


def test_resume_across_epochs_and_zst(tmp_path):
    """Resume also when a stream wrapped around to its next epoch; .zst offsets."""
    domains_corpus(tmp_path, {"a": (2, 5), "b": (1, 7)}, zst=True)
    args = DataArgs(
        root_dir=str(tmp_path),
        layout="domains",
        sources={"a": 1, "b": 1},
        seq_len=16,
        batch_size=3,
        shuffle_buffer=5,
        tokenizer=BYTES,
    )
    ref = build_train_loader(args, 0, 1)
    for _ in range(40):
        next(ref)
    sd = ref.state_dict()
    assert min(s["epoch"] for s in sd["streams"].values()) >= 1
    expected = [next(ref) for _ in range(10)]
    fresh = build_train_loader(args, 0, 1)
    fresh.load_state_dict(sd)
    assert _same([next(fresh) for _ in range(10)], expected)


# ----------------------------------------------------------------------------- mixture
def test_domain_proportions_match_weights(tmp_path):
    weights = {"a": 0.6, "b": 0.3, "c": 0.1}
    domains_corpus(tmp_path, {d: (1, 50) for d in weights})
    args = DataArgs(
        root_dir=str(tmp_path),
        layout="domains",
        sources=dict(weights),
        seq_len=64,
        batch_size=8,
        shuffle_buffer=0,
        tokenizer=BYTES,
    )
    loader = build_train_loader(args, 0, 1)
    docs = docs_in(stream_of([next(loader) for _ in range(60)]))
    n = len(docs)
    assert n > 1500
    counts = Counter(d[1] for d in docs)
    for d, p in weights.items():
        # binomial: the observed share is within 4 standard deviations (p ~ 6e-5 per domain)
        tol = 4 * math.sqrt(p * (1 - p) / n)
        assert abs(counts[d] / n - p) < tol, (d, counts[d] / n, p, tol)
    # the same seed gives the same documents; another seed other ones
    again = build_train_loader(args, 0, 1)
    assert docs_in(stream_of([next(again) for _ in range(60)])) == docs
    other = build_train_loader(DataArgs(**{**vars(args), "seed": 7}), 0, 1)
    assert docs_in(stream_of([next(other) for _ in range(60)])) != docs


def test_zero_weight_domain_is_never_read(tmp_path):
    domains_corpus(tmp_path, {"a": (1, 5), "b": (1, 5)})
    args = DataArgs(
        root_dir=str(tmp_path),
        layout="domains",
        sources={"a": 1.0, "b": 0.0},
        seq_len=32,
        batch_size=2,
        shuffle_buffer=0,
        tokenizer=BYTES,
    )
    docs = docs_in(stream_of([next(build_train_loader(args, 0, 1)) for _ in range(10)]))
    assert docs and all(d.startswith("<a|") for d in docs)
    assert domains(args) == ["a"]


def _first_epoch_docs(args, rank, world_size, max_batches=400):
    """Documents a rank yields before its first repeat (= its share of one epoch)."""
    loader = build_train_loader(args, rank, world_size)
    toks = []
    for _ in range(max_batches):
        toks += stream_of([next(loader)])
        docs = docs_in(toks)
        for i, d in enumerate(docs):
            if d in docs[:i]:
                return docs[:i]
    raise AssertionError("no repeat: the epoch did not end")


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 6])
def test_every_chunk_read_for_any_world_size(tmp_path, world_size):
    """4 chunk files of one domain: ranks together read every document exactly once per
    epoch, whether the world size divides 4 (1, 2, 4), does not (3) or exceeds it (6)."""
    all_docs = domains_corpus(tmp_path, {"a": (4, 9)})
    args = DataArgs(
        root_dir=str(tmp_path),
        layout="domains",
        sources={"a": 1.0},
        seq_len=16,
        batch_size=1,
        shuffle_buffer=0,
        tokenizer=BYTES,
    )
    shares = [_first_epoch_docs(args, r, world_size) for r in range(world_size)]
    flat = [d for s in shares for d in s]
    assert len(flat) == len(set(flat)) == len(all_docs)
    assert set(flat) == all_docs
    # balance: within one file (9 docs) when files >= ranks; else within a line per part
    # (6 ranks on 4 files: 12 parts, 2 per rank)
    sizes = [len(s) for s in shares]
    assert max(sizes) - min(sizes) <= (9 if world_size <= 4 else 2)


@pytest.mark.parametrize("world_size", [1, 2, 5])
def test_release_layout_coverage_and_domain_filter(tmp_path, world_size):
    all_docs = release_corpus(tmp_path, n_chunks=3, per_file=12)
    args = DataArgs(
        root_dir=str(tmp_path),
        layout="slimpajama",
        sources={"arxiv": 1, "c4": 0, "wikipedia": 0},
        seq_len=16,
        batch_size=1,
        shuffle_buffer=0,
        tokenizer=BYTES,
    )
    flat = [d for r in range(world_size) for d in _first_epoch_docs(args, r, world_size)]
    arxiv = {d for d in all_docs if d.startswith("<arxiv|")}
    assert len(flat) == len(set(flat)) and set(flat) == arxiv
    assert list(iter_validation_docs(args, "wikipedia")) == ["<wikipedia|val>"]


def test_bundled_corpus_domains_and_validation():
    args = DataArgs()
    assert domains(args) == sorted(SET_NAMES)
    # up to 16 ranks (16 train files), every rank finds documents of every domain
    from mta_repro.data.sources import DocStream

    for r in range(16):
        for d in SET_NAMES:
            text = DocStream(args, d, r, 16).next_doc()
            assert text.strip()
    for d in domains(args):
        docs = list(iter_validation_docs(args, d))
        assert len(docs) >= 2 and all(isinstance(t, str) and t.strip() for t in docs)


# ----------------------------------------------------------------------------- bad input
def test_bad_records_skipped_counted_logged(tmp_path, caplog):
    good = [{"text": f"<good|{i}>"} for i in range(4)]
    lines = [
        good[0],
        b'{"text": "unterminated',  # malformed JSON
        {"txt": "no text field"},  # missing text
        {"text": 5},  # text not a string
        b'{"text": "bad \xff\xfe bytes"}',  # undecodable
        good[1],
        {"text": "   \n"},  # empty document
        b"[1, 2]",  # not an object
        good[2],
        good[3],
    ]
    write_jsonl(tmp_path / "a" / "a.chunk.00.jsonl", lines)
    args = DataArgs(
        root_dir=str(tmp_path),
        layout="domains",
        sources={"a": 1},
        seq_len=16,
        batch_size=1,
        shuffle_buffer=0,
        tokenizer=BYTES,
    )
    loader = build_train_loader(args, 0, 1)
    with caplog.at_level(logging.WARNING, logger="mta_repro.data"):
        # 2 windows of 17 tokens = 34 tokens: the good documents are 11 tokens each,
        # so the file is read once (no second epoch that would count the faults again)
        docs = docs_in(stream_of([next(loader) for _ in range(2)]))
    assert docs[:3] == [g["text"] for g in good[:3]]
    assert loader.state_dict()["streams"]["a"]["epoch"] == 0
    bad = {k: v for k, v in loader.bad_records().items() if v}
    assert bad == {"malformed_json": 2, "missing_text": 2, "undecodable": 1, "empty": 1}
    assert any("bad record" in r.message for r in caplog.records)
    # the counts are part of the state (they survive a resume)
    fresh = build_train_loader(args, 0, 1)
    fresh.load_state_dict(loader.state_dict())
    assert {k: v for k, v in fresh.bad_records().items() if v} == bad


def test_bad_records_release_layout_counted_once(tmp_path):
    recs = [
        {"text": "<arxiv|0>", "meta": {"redpajama_set_name": "RedPajamaArXiv"}},
        {"text": "<c4|0>", "meta": {"redpajama_set_name": "RedPajamaC4"}},
        {"text": "no meta"},
        {"text": "odd set", "meta": {"redpajama_set_name": "RedPajamaBooks3"}},
        b"{broken",
        {"text": "<arxiv|1>", "meta": {"redpajama_set_name": "RedPajamaArXiv"}},
    ]
    write_jsonl(tmp_path / "train" / "chunk1" / "example_train_0.jsonl", recs)
    args = DataArgs(
        root_dir=str(tmp_path),
        sources={"arxiv": 1, "c4": 1},
        seq_len=16,
        batch_size=1,
        shuffle_buffer=0,
        tokenizer=BYTES,
    )
    loader = build_train_loader(args, 0, 1)
    docs = docs_in(stream_of([next(loader) for _ in range(4)]))
    assert set(docs) <= {"<arxiv|0>", "<arxiv|1>", "<c4|0>"} and len(docs) > 2
    loader2 = build_train_loader(args, 0, 1)
    for _ in range(3):  # enough to read the file once
        next(loader2)
    bad = {k: v for k, v in loader2.bad_records().items() if v}
    # each bad line counted once, although two domain streams read the file
    assert bad == {"missing_meta": 1, "unknown_set": 1, "malformed_json": 1}


def test_domain_without_usable_documents_raises(tmp_path):
    write_jsonl(tmp_path / "a" / "a.chunk.00.jsonl", [b"{bad", {"text": ""}])
    args = DataArgs(
        root_dir=str(tmp_path), layout="domains", sources={"a": 1}, seq_len=16, batch_size=1, tokenizer=BYTES
    )
    with pytest.raises(ValueError, match="no usable documents for domain 'a'"):
        next(build_train_loader(args, 0, 1))


def test_config_faults(tmp_path):
    domains_corpus(tmp_path, {"a": (1, 3)})
    (tmp_path / "empty").mkdir()
    base = dict(root_dir=str(tmp_path), layout="domains", seq_len=16, batch_size=1, tokenizer=BYTES)
    cases = [
        (dict(sources={"a": 1, "zzz": 1}), r"data.sources.zzz.*no directory"),
        (dict(sources={"a": 1, "empty": 1}), r"data.sources.empty.*no train files"),
        (dict(sources={"a": -0.5}), r"data.sources.a=-0.5"),
        (dict(sources={"a": 0.0}), r"data.sources: all weights are zero"),
        (dict(sources={}), r"data.sources is empty"),
        (dict(sources={"a": "x"}), r"data.sources.a='x'"),
        (dict(sources={"a": 1}, root_dir=str(tmp_path / "nope")), r"data.root_dir=.*nope: no such directory"),
        (dict(sources={"a": 1}, layout="parquet"), r"data.layout='parquet'"),
        (dict(sources={"a": 1}, seq_len=0), r"data.seq_len=0"),
        (
            dict(sources={"a": 1}, tokenizer=TokenizerArgs("sentencepiece", str(tmp_path / "t.model"))),
            r"data.tokenizer.path=.*t.model: no such file",
        ),
    ]
    for over, msg in cases:
        with pytest.raises(ValueError, match=msg):
            build_train_loader(DataArgs(**{**base, **over}), 0, 1)
    with pytest.raises(ValueError, match=r"data.sources.wiki: unknown domain"):
        build_train_loader(DataArgs(sources={"wiki": 1.0}), 0, 1)  # slimpajama layout names
    with pytest.raises(ValueError, match=r"data.root_dir=.*no train/ directory"):
        build_train_loader(DataArgs(root_dir=str(tmp_path), sources={"c4": 1.0}, tokenizer=BYTES), 0, 1)


def test_root_config_has_data_group():
    from mta_repro.train.config import compose

    cfg = compose(["data.seq_len=8", "data.batch_size=3"])
    loader = build_train_loader(cfg.data, 0, 1)
    b = next(loader)
    assert b["input"].shape == (3, 8)
    cfg = compose(["data=slimpajama"])
    assert cfg.data.seq_len == 2048 and cfg.data.tokenizer.name == "tiktoken"
    assert dict(cfg.data.sources) == pytest.approx(
        {
            "commoncrawl": 0.726,
            "c4": 0.081,
            "github": 0.049,
            "book": 0.021,
            "arxiv": 0.023,
            "wikipedia": 0.05,
            "stackexchange": 0.05,
        }
    )


# ----------------------------------------------------------------------------- real ranks
def _rank_worker(rank, world_size, init_file, out_file):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        loader = build_train_loader(DataArgs(seq_len=16, batch_size=2, shuffle_buffer=4, prefetch=2), rank, world_size)
        mine = torch.stack([next(loader)["input"] for _ in range(3)])  # (3, B, T)
        loader.close()
        gathered = [torch.empty_like(mine) for _ in range(world_size)]
        dist.all_gather(gathered, mine)
        if rank == 0:
            torch.save(torch.stack(gathered), out_file)
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.slow
def test_two_real_ranks_match_in_process_loaders(tmp_path):
    """2 spawned gloo processes (prefetch thread on) yield what each rank's loader built
    in this process yields: the loader depends only on (config, rank, world size)."""
    import torch.multiprocessing as mp

    out = tmp_path / "batches.pt"
    mp.spawn(_rank_worker, args=(2, str(tmp_path / "init"), str(out)), nprocs=2, join=True)
    got = torch.load(out)  # (ranks, 3, B, T)
    for rank in range(2):
        loader = build_train_loader(DataArgs(seq_len=16, batch_size=2, shuffle_buffer=4), rank, 2)
        assert torch.equal(got[rank], torch.stack([next(loader)["input"] for _ in range(3)]))
    assert not torch.equal(got[0], got[1])


def test_a_window_longer_than_the_split_is_refused_before_any_batch(tmp_path, caplog):
    """A window that needs more tokens than the rank's share of the training split would
    repeat every document: refused when the loader is built, naming the counts (it would
    otherwise cycle the corpus to fill it). A window that fits but a first batch whose
    shuffle buffer does not is one warning."""
    docs = domains_corpus(tmp_path, {"a": (2, 5)})
    held = sum(len(d.encode()) + 2 for d in docs)  # bytes, BOS and EOS: 90
    base = dict(root_dir=str(tmp_path), layout="domains", sources={"a": 1}, batch_size=1, tokenizer=BYTES)
    with pytest.raises(
        ValueError,
        match=rf"one window of data.seq_len\+1={held + 1} tokens is longer than the "
        rf"corpus: the training split under .* holds {held} tokens for rank 0/1 "
        r"\(domains a\)",
    ):
        build_train_loader(DataArgs(seq_len=held, shuffle_buffer=0, **base), 0, 1)
    fits = build_train_loader(DataArgs(seq_len=held - 1, shuffle_buffer=0, **base), 0, 1)
    assert next(fits)["input"].shape == (1, held - 1)
    with caplog.at_level(logging.WARNING, logger="mta_repro.data.loader"):
        build_train_loader(DataArgs(seq_len=32, shuffle_buffer=8, **base), 0, 1)
    need = (8 + 1) * 33
    assert [r.getMessage() for r in caplog.records if "first batch needs" in r.getMessage()] == [
        f"data: the first batch needs {need} tokens (data.shuffle_buffer=8 + data.batch_size=1 windows of 33) but "
        f"the training split under {tmp_path} holds {held} tokens for rank 0/1 (domains a): it repeats documents, "
        f"and the shuffle buffer's fill cycles the corpus about {math.ceil(need / held)} times; lower "
        "data.shuffle_buffer or data.seq_len"
    ]
