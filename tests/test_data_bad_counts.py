"""Bad records and unreadable files are counted whichever domain stream meets them first:
in the slimpajama layout every domain stream reads every file, and the
counts must not wait for one particular stream (the first domain, often a rarely drawn
one) to get there. Each fault is counted once, from the first batch on, across a resume
and a resume on another world size, and reaches metrics.jsonl as data_bad/<kind>."""

from __future__ import annotations

import json

import pytest
from test_data import write_jsonl

from mta_repro.data import DataArgs, TokenizerArgs, build_train_loader
from mta_repro.data.records import SET_NAMES

BYTES = TokenizerArgs(name="bytes", path=None)
# The faults injected by release_with_faults (per copy of the corpus, i.e. per rank shard
# when every rank holds one file set).
INJECTED = {"malformed_json": 2, "missing_meta": 1, "unknown_set": 1, "undecodable": 1, "corrupt_file": 1}


def _recs(tag, n, doms):
    return [
        {"text": f"<{doms[i % len(doms)]}|{tag}|{i}>", "meta": {"redpajama_set_name": SET_NAMES[doms[i % len(doms)]]}}
        for i in range(n)
    ]


def release_with_faults(root, big=400):
    """A release-layout corpus (domains arxiv, c4) whose faults all lie where the c4 stream
    gets first: example_train_0 is mostly arxiv (so a rare arxiv stream stays in it),
    example_train_1 holds the bad records (none of them names a set: the c4 stream cannot
    tell them apart from other domains' records by the set name), example_train_2 is a
    truncated .zst, example_train_3 is large (no stream wraps to a second epoch)."""
    train = root / "train" / "chunk1"
    write_jsonl(train / "example_train_0.jsonl", _recs("f0", 12, ["arxiv", "arxiv", "arxiv", "c4"]))
    lines = _recs("f1", 6, ["arxiv", "c4"])
    lines[1:1] = [
        b'{"text": "cut',
        {"text": "no meta"},
        {"text": "odd", "meta": {"redpajama_set_name": "RedPajamaX"}},
        b"[1, 2]",
        b'{"text": "\xff\xfe"}',
    ]
    write_jsonl(train / "example_train_1.jsonl", lines)
    bad = train / "example_train_2.jsonl.zst"
    write_jsonl(bad, _recs("f2", 50, ["arxiv", "c4"]), zst=True)
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])
    write_jsonl(train / "example_train_3.jsonl", _recs("f3", big, ["arxiv", "c4"]))
    write_jsonl(
        root / "validation" / "chunk1" / "example_holdout_0.jsonl",
        [{"text": f"<{d}|val>", "meta": {"redpajama_set_name": SET_NAMES[d]}} for d in ("arxiv", "c4")],
    )


def _args(root, **kw):
    kw = {
        "sources": {"arxiv": 0.001, "c4": 1.0},
        "seq_len": 32,
        "batch_size": 2,
        "shuffle_buffer": 4,
        "tokenizer": BYTES,
        **kw,
    }
    return DataArgs(root_dir=str(root), **kw)


def _nonzero(counts):
    return {k: v for k, v in counts.items() if v}


@pytest.mark.parametrize("prefetch", [0, 2])
def test_every_stream_counts_from_the_first_batch(tmp_path, prefetch):
    release_with_faults(tmp_path)
    loader = build_train_loader(_args(tmp_path, prefetch=prefetch), 0, 1)
    next(loader)
    assert loader.streams["arxiv"].file == 0  # the first domain's stream never got to the faults
    assert _nonzero(loader.bad_records()) == INJECTED
    assert set(loader.bad_records()) >= set(INJECTED)  # every kind named, 0 or not (same names on every rank)
    for _ in range(20):
        next(loader)
    assert _nonzero(loader.bad_records()) == INJECTED  # counted once, whichever streams read them later
    loader.close()


def test_counts_are_distinct_faults_across_epochs_and_resumes(tmp_path):
    release_with_faults(tmp_path, big=6)  # small: both streams pass many epochs
    args = _args(tmp_path, sources={"arxiv": 0.3, "c4": 1.0})
    ref = build_train_loader(args, 0, 1)
    for _ in range(40):
        next(ref)
    assert min(s.epoch for s in ref.streams.values()) >= 2
    assert _nonzero(ref.bad_records()) == INJECTED
    # a resume after the first batch (inside epoch 0, faults partly behind some streams):
    # the same counts and the same batches as the run without the stop
    first = build_train_loader(args, 0, 1)
    next(first)
    st = first.state_dict()
    again = build_train_loader(args, 0, 1)
    again.load_state_dict(st)
    assert again.bad_records() == first.bad_records()
    for _ in range(39):
        next(again)
    assert again.bad_records() == ref.bad_records()


def test_two_domain_streams_in_the_domains_layout(tmp_path):
    """One directory per domain: the second domain's faults are its own stream's."""
    for d, n in (("a", 50), ("b", 5)):
        write_jsonl(tmp_path / d / f"{d}.chunk.00.jsonl", [{"text": f"<{d}|{i}>"} for i in range(n)])
    write_jsonl(tmp_path / "b" / "b.chunk.03.jsonl", [{"text": f"<b|y|{i}>"} for i in range(200)])
    write_jsonl(tmp_path / "b" / "b.chunk.01.jsonl", [b"{broken", {"text": ""}, {"txt": "x"}, {"text": "<b|x>"}])
    bad = tmp_path / "b" / "b.chunk.02.jsonl.zst"
    write_jsonl(bad, [{"text": f"<b|z|{i}>"} for i in range(50)], zst=True)
    bad.write_bytes(bad.read_bytes()[:20])
    args = DataArgs(
        root_dir=str(tmp_path),
        layout="domains",
        sources={"a": 0.01, "b": 1.0},
        seq_len=32,
        batch_size=2,
        shuffle_buffer=4,
        tokenizer=BYTES,
    )
    loader = build_train_loader(args, 0, 1)
    next(loader)
    want = {"malformed_json": 1, "empty": 1, "missing_text": 1, "corrupt_file": 1}
    assert _nonzero(loader.bad_records()) == want
    assert loader.state_dict()["streams"]["b"]["bad"] == want and not loader.streams["a"].bad


def test_a_bad_record_on_the_shards_first_line_is_counted(tmp_path):
    """The very first line a fresh loader reads (its ledger is built then) is counted too."""
    write_jsonl(tmp_path / "train" / "chunk1" / "example_train_0.jsonl", [b'{"text": "cut'] + _recs("f0", 30, ["c4"]))
    (tmp_path / "validation" / "chunk1").mkdir(parents=True)
    loader = build_train_loader(_args(tmp_path, sources={"c4": 1.0}), 0, 1)
    next(loader)
    assert _nonzero(loader.bad_records()) == {"malformed_json": 1}


@pytest.mark.parametrize("old,new", [(1, 2), (2, 1)])
def test_another_world_size_keeps_the_sum(tmp_path, old, new):
    """The summed counts of the old ranks are carried once (on the new rank 0), and the
    files they found unreadable are not counted again."""
    release_with_faults(tmp_path)
    # 4 files: whole-file shards for 1 and 2 ranks
    args = _args(tmp_path)
    olds = [build_train_loader(args, r, old) for r in range(old)]
    for loader in olds:
        for _ in range(3):
            next(loader)
    before = {k: sum(loader.bad_records()[k] for loader in olds) for k in INJECTED}
    assert before["corrupt_file"] == 1 and before["malformed_json"] == 2  # the faults were met
    news = [build_train_loader(args, r, new) for r in range(new)]
    for loader in news:
        loader.load_other_world_state([o.state_dict() for o in olds])
    assert {k: sum(loader.bad_records()[k] for loader in news) for k in INJECTED} == before
    for loader in news:
        for _ in range(30):
            next(loader)
    after = {k: sum(loader.bad_records()[k] for loader in news) for k in INJECTED}
    assert after["corrupt_file"] == 1  # the truncated file is not counted twice


@pytest.mark.slow
def test_trainer_metrics_have_the_counts_from_the_first_step(tmp_path):
    """End to end: 6 training steps (stopped and resumed at step 3) on a corpus whose faults
    only the second domain's stream reaches; every line of metrics.jsonl has
    data_bad/<kind> equal to the faults injected."""
    from mta_repro.train.config import compose
    from mta_repro.train.loop import train

    corpus = tmp_path / "corpus"
    release_with_faults(corpus)
    run = tmp_path / "run"
    common = [
        f"run_dir={run}",
        f"data.root_dir={corpus}",
        "data.layout=slimpajama",
        "data.tokenizer.name=bytes",
        "data.tokenizer.path=null",
        "data.seq_len=32",
        "data.batch_size=2",
        "data.shuffle_buffer=4",
        "model.vocab_size=258",
        "model.dim=64",
        "model.n_layers=1",
        "model.n_heads=2",
        "trainer.device=cpu",
        "trainer.eval_every=0",
        "checkpoint.every=3",
        "checkpoint.export=false",
        "logging.every=1",
        "logging.wandb_mode=disabled",
        "logging.progress_bar=false",
    ]
    for extra in (["trainer.steps=3"], ["trainer.steps=6", "checkpoint.allow_config_change=true"]):
        cfg = compose([*common, *extra])
        cfg.data.sources = {"arxiv": 0.001, "c4": 1.0}
        train(cfg)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if "loss" in r]
    assert [r["step"] for r in train_records] == [1, 2, 3, 4, 5, 6]
    for r in train_records:
        assert {k[len("data_bad/") :]: v for k, v in r.items() if k.startswith("data_bad/")} == INJECTED, r
