"""Every number traces to its inputs (docs/provenance.md).

- the data reader hashes exactly the text it read (a resume recomputes it at no extra
  read); the listing's fingerprint is that of the names, sizes and mtimes;
- a resume finds a data file whose text the run read changed (the open one, or one read to
  its end whose stat changed), says nothing of a file only touched, and warns of files
  that vanished or appeared where it has not read yet, reading the files it started with;
- the weights' digest is a plain sha256 of their bytes; a tokenizer moved is no change,
  one of other content is;
- a checkpoint pruned while it is read is never "unreadable": the newest one is read;
- the report marks rows of another tokenizer or an eval older than the run's newest
  checkpoint;
- the pipeline's done check reads what it checks and names a torn file;
- an HF export records what its weights came from.

Then the probes as users run them (slow tier, real processes): a shard replaced between
a run and its resume, evaluations racing a trainer that saves and prunes every step, a
tokenizer swapped under a run, the torn eval JSON of a finished pipeline:
test_pipeline.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import zstandard
from test_data import domains_corpus, write_jsonl

from mta_repro.data import DataArgs, TokenizerArgs, build_train_loader
from mta_repro.data.listing import fingerprint, list_entries
from mta_repro.data.readers import LineReader, ShortFileError
from mta_repro.runs import provenance as pv

ROOT = Path(__file__).resolve().parents[1]
BYTES = TokenizerArgs(name="bytes", path=None)


def _args(root, **kw):
    return DataArgs(
        root_dir=str(root),
        layout="domains",
        sources={"a": 1.0},
        seq_len=16,
        batch_size=2,
        shuffle_buffer=2,
        tokenizer=BYTES,
        **kw,
    )


def _state_in(loader, file_index: int, min_done: int = 0) -> dict:
    """Batches until stream "a" is inside its ``file_index``-th file (with ``min_done``
    files read to their end); the state there, through a pickle round trip."""
    for _ in range(2000):
        sd = loader.state_dict()
        s = sd["streams"]["a"]
        if (
            s["file"].endswith(f".chunk.{file_index:02d}.jsonl.zst")
            and s["offset"] > 0
            and len(sd["files"]) >= min_done
        ):
            return pickle.loads(pickle.dumps(sd))
        next(loader)
    raise AssertionError("the stream never got there")


# ------------------------------------------------------------------ what is read
def test_the_reader_hashes_exactly_the_text_it_read(tmp_path):
    f = tmp_path / "x.jsonl.zst"
    write_jsonl(f, [{"text": f"doc {i} " * 30} for i in range(300)], zst=True)
    text = zstandard.ZstdDecompressor().decompressobj().decompress(f.read_bytes())  # independently
    r = LineReader(f, 0)
    k = sum(len(r.readline()) for _ in range(7))
    assert r.pos == k and r.digest() == hashlib.sha256(text[:k]).hexdigest()
    r.close()
    # reopened at the offset (a resume): the skipped text is hashed on the way, reading goes on
    again = LineReader(f, k)
    assert again.digest() == hashlib.sha256(text[:k]).hexdigest()
    assert again.readline() == text[k:].split(b"\n")[0] + b"\n"
    st = os.stat(f)
    assert (again.size, again.mtime_ns) == (st.st_size, st.st_mtime_ns)
    again.close()
    plain = tmp_path / "y.jsonl"
    write_jsonl(plain, [{"text": "p" * i} for i in range(1, 50)])
    assert LineReader(plain, 100).digest() == hashlib.sha256(plain.read_bytes()[:100]).hexdigest()
    with pytest.raises(ShortFileError):
        LineReader(f, len(text) + 1)


def test_the_listing_fingerprint_is_names_sizes_and_mtimes(tmp_path):
    domains_corpus(tmp_path / "c", {"a": (3, 5)}, zst=True)
    args = _args(tmp_path / "c")
    entries = list_entries(args, "a", "train")
    files = sorted((tmp_path / "c" / "a").glob("*.chunk.*"))
    assert [e[0] for e in entries] == [f"a/{f.name}" for f in files]
    lines = "".join(f"a/{f.name}\t{f.stat().st_size}\t{f.stat().st_mtime_ns}\n" for f in files)
    fp = fingerprint(entries)
    assert fp == {
        "files": 3,
        "bytes": sum(f.stat().st_size for f in files),
        "sha256": hashlib.sha256(lines.encode()).hexdigest(),
    }
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
    assert fresh.state_dict()["files"]["a/a.chunk.00.jsonl.zst"][:2] == (first.stat().st_size, first.stat().st_mtime_ns)

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
    assert vanished == (
        "1 file(s) of rank 0's share vanished before it read them (a/a.chunk.02.jsonl.zst): it "
        "reads its other 2 files without them"
    )
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


# ------------------------------------------------------------------ identities
def test_the_weights_digest_is_a_sha256_of_names_dtypes_shapes_and_bytes():
    b = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    a = torch.tensor([1, -2], dtype=torch.int64)
    h = hashlib.sha256()
    h.update(b"a\ttorch.int64\t(2,)\n" + struct.pack("<2q", 1, -2))
    h.update(b"b\ttorch.float32\t(2, 3)\n" + struct.pack("<6f", 0, 1, 2, 3, 4, 5))
    assert pv.state_digest({"b": b, "a": a}) == h.hexdigest()
    assert pv.state_digest({"a": a, "b": b.t().contiguous().t()}) == h.hexdigest()  # layout, not storage
    assert pv.state_digest({"a": a, "b": b + 1}) != h.hexdigest()


def test_a_moved_tokenizer_is_the_same_one_of_other_content_is_not(tmp_path):
    src = ROOT / "data" / "tokenizer" / "mini_sp8192.model"
    moved = tmp_path / "moved.model"
    shutil.copy(src, moved)
    rec = pv.tokenizer_identity({"name": "sentencepiece", "path": str(src)})
    assert rec["sha256"] == hashlib.sha256(src.read_bytes()).hexdigest()
    assert pv.tokenizer_change(rec, pv.tokenizer_identity({"name": "sentencepiece", "path": str(moved)})) is None
    other = _swapped_tokenizer(tmp_path / "other.model")
    change = pv.tokenizer_change(rec, pv.tokenizer_identity({"name": "sentencepiece", "path": str(other)}))
    assert change.startswith(f"data.tokenizer.path={other}: its content differs from the tokenizer recorded")
    assert pv.tokenizer_change(rec, pv.tokenizer_identity({"name": "bytes", "path": None})).startswith(
        "data.tokenizer.name is 'bytes'"
    )


def _swapped_tokenizer(out: Path) -> Path:
    """The bundled 8192-piece model with two pieces swapped: as valid, another tokenizer."""
    from sentencepiece import sentencepiece_model_pb2

    m = sentencepiece_model_pb2.ModelProto()
    m.ParseFromString((ROOT / "data" / "tokenizer" / "mini_sp8192.model").read_bytes())
    a, b = m.pieces[300].piece, m.pieces[301].piece
    m.pieces[300].piece, m.pieces[301].piece = b, a
    out.write_bytes(m.SerializeToString())
    return out


def test_a_checkpoint_pruned_while_read_is_not_called_unreadable(tmp_path, monkeypatch, capsys):
    """What a live trainer does between an eval's listing and its read, done in between
    here: it saves step 8 and prunes step 7 (renamed away, then deleted)."""
    from eval_helpers import make_run

    from mta_repro.weights import find_weights, read
    from mta_repro.weights.read import PrunedError, read_weights

    run, _ = make_run(tmp_path / "r", attention="baseline", fmt="dcp")
    ck7 = run / "checkpoints" / f"{7:010d}"
    spare = tmp_path / "spare"
    shutil.copytree(ck7, spare)
    (cand,) = find_weights(run)
    os.replace(ck7, ck7.with_name(".pruned-" + ck7.name))
    with pytest.raises(PrunedError, match="was removed while it was read"):
        read_weights(cand)
    os.replace(ck7.with_name(".pruned-" + ck7.name), ck7)

    real = read.find_weights
    calls = []

    def listing_then_prune(path):
        found = real(path)
        if not calls:  # the trainer saves 8 and prunes 7 right after this listing
            shutil.copytree(spare, run / "checkpoints" / f"{8:010d}")
            os.replace(ck7, ck7.with_name(".pruned-" + ck7.name))
            shutil.rmtree(ck7.with_name(".pruned-" + ck7.name))
        calls.append(path)
        return found

    monkeypatch.setattr(read, "find_weights", listing_then_prune)
    with pytest.warns(read.FallbackWarning, match="was removed while it was read"):
        w = read.load_weights(run, who="test")
    assert w.source.path.name == f"{8:010d}" and len(calls) == 2
    err = capsys.readouterr().err
    assert "was removed while it was read (pruned by the run's trainer" in err and "unreadable" not in err


# ------------------------------------------------------------------ report and pipeline
def _eval_json(run: Path, step: int, tok_sha: str, task: str = "ppl") -> None:
    prov = {
        "checkpoint": {
            "path": str(run / "export" / "consolidated.pt"),
            "step": step,
            "weights_sha256": "ab" * 32,
            "tokens_seen": step * 64,
        },
        "tokenizer": {"name": "bytes", "sha256": tok_sha},
        "validation": {"files": 1, "bytes": 100, "sha256": "cd" * 32},
        "code": {"package": "0.1.0", "commit": "f" * 40, "dirty": False},
        "accepted": [],
    }
    res = {"domains": {"book": {"ppl": 20.0, "loss": 3.0, "tokens": 10}}, "average": 20.0, "seq_len": 256}
    (run / "eval").mkdir(exist_ok=True)
    (run / "eval" / f"{task}.json").write_text(
        json.dumps({"task": task, "variant": "baseline", "step": step, "provenance": prov, "results": res})
    )


@pytest.mark.slow
def test_the_report_marks_rows_of_another_tokenizer_or_an_older_checkpoint(tmp_path):
    from eval_helpers import make_run

    from mta_repro.report.__main__ import build_report

    runs = [make_run(tmp_path / n, attention="baseline")[0] for n in ("a", "b", "c")]
    _eval_json(runs[0], 7, "11" * 32)
    _eval_json(runs[1], 7, "22" * 32)  # another tokenizer than the two rows beside it
    _eval_json(runs[2], 7, "11" * 32)
    (runs[2] / "checkpoints" / f"{9:010d}").mkdir(parents=True)  # the run went on after its eval
    (runs[2] / "checkpoints" / f"{9:010d}" / ".complete").touch()
    out = tmp_path / "rep"
    md = build_report(runs, out, kernels=False).read_text()
    assert "Provenance of the ppl rows" in md
    # run.stage unset (make_run starts by hand): the stage column says it was inferred
    assert "| a | pretrain (inferred: no run.stage) | step 7, weights abababababab | 448 | bytes 111111111111 |" in md
    assert "| b (!) |" in md and "no: tokenizer 222222222222, most rows 111111111111" in md
    assert "| c (!) |" in md and "no: evaluated at step 7; the run's newest checkpoint is step 9: re-evaluate" in md
    table = json.loads((out / "results.json").read_text())["tables"]["ppl"]
    assert [r["run"] for r in table["rows"]] == ["a", "b (!)", "c (!)"]
    assert table["provenance"]["a"]["comparable"] == "yes"


def test_the_done_check_reads_the_json_and_names_a_torn_one(tmp_path):
    from eval_helpers import make_run

    from mta_repro.pipeline.done import done, torn
    from mta_repro.pipeline.job import Job

    run, _ = make_run(tmp_path / "r", attention="baseline")  # an export of step 7
    job = Job("eval:x", "eval", run, [], steps=7, eval_tasks=["ppl"], eval_out=run / "eval")
    _eval_json(run, 7, "11" * 32)
    assert done(job) and torn(job) == []
    f = run / "eval" / "ppl.json"
    f.write_bytes(f.read_bytes()[:-40])  # a write cut short: newer than the export, but torn
    assert not done(job)
    assert torn(job) == [f"{f} is there but not valid JSON (a write cut short?)"]
    _eval_json(run, 5, "11" * 32)  # whole, but of an earlier checkpoint
    assert not done(job) and torn(job) == []


@pytest.mark.slow
def test_an_hf_export_records_what_its_weights_came_from(tmp_path):
    pytest.importorskip("transformers")
    from eval_helpers import make_run

    from mta_repro.hf import export_hf
    from mta_repro.weights import load_pt

    run, _ = make_run(tmp_path / "r", attention="baseline")
    out = export_hf(run, tmp_path / "hf")
    rec = json.loads((out / "provenance.json").read_text())
    assert rec["weights"]["step"] == 7 and rec["weights"]["path"] == str(run / "export" / "consolidated.pt")
    assert rec["weights"]["weights_sha256"] == pv.state_digest(load_pt(run / "export" / "consolidated.pt")["model"])
    assert rec["tokenizer"] == {"name": "bytes", "path": None, "sha256": None} and rec["code"]["package"]


# ------------------------------------------------------------------ as users run it
TRAIN = [
    "model.dim=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.multiple_of=32",
    "model.kq_conv_layers=1",
    "data.seq_len=32",
    "data.batch_size=2",
    "data.shuffle_buffer=4",
    "trainer.device=cpu",
    "trainer.eval_every=0",
    "logging.every=1",
    "logging.wandb_mode=disabled",
    "logging.progress_bar=false",
    "optim.warmup=2",
]


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


def _train(run_dir, *overrides, check=True):
    p = subprocess.run(
        [sys.executable, "-m", "mta_repro.train", f"run_dir={run_dir}", *TRAIN, *overrides],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    if check and p.returncode != 0:
        raise AssertionError(f"trainer failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return p


def _eval(run_dir, *overrides):
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mta_repro.eval",
            str(run_dir),
            "tasks=[ppl]",
            "ppl.max_batches=1",
            "ppl.batch_size=1",
            "ppl.domains=[book]",
            "device=cpu",
            *overrides,
        ],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )


def _one_line_error(p, prog):
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert lines[-1].startswith(f"{prog}: error: ")
    return lines[-1]


@pytest.mark.slow
def test_a_shard_replaced_between_run_and_resume_is_refused_then_accepted(tmp_path):
    corpus, run = tmp_path / "corpus", tmp_path / "run"
    shutil.copytree(ROOT / "data" / "mini_slimpajama", corpus)
    common = [f"data.root_dir={corpus}", "checkpoint.every=5", "trainer.steps=10"]
    _train(run, *common, "trainer.steps=5")
    ck5 = json.loads((run / "checkpoints" / f"{5:010d}" / "provenance.json").read_text())
    assert ck5["step"] == 5 and ck5["tokens_seen"] == 5 * 2 * 32
    assert ck5["inputs"]["data"]["train"]["files"] == 16
    # the file every stream was reading at step 5, replaced by another shard
    target = corpus / "train" / "chunk1" / "example_train_0.jsonl.zst"
    shutil.copy(corpus / "train" / "chunk2" / "example_train_0.jsonl.zst", target)
    records = {n: (run / n).read_bytes() for n in ("config.yaml", "provenance.json")}
    p = _train(run, *common, "checkpoint.allow_config_change=true", check=False)
    line = _one_line_error(p, "train")
    assert f"{target}: the " in line and "bytes of text rank 0 read of it changed (sha256 " in line
    assert "checkpoint.accept_changed_data=true" in line and "restore the file" in line
    assert sorted(c.name for c in (run / "checkpoints").iterdir()) == [f"{5:010d}"]  # left as it was
    assert {n: (run / n).read_bytes() for n in records} == records  # the refused start changed neither
    # accepted: it trains on and the run's history says what was accepted, and where
    _train(run, *common, "checkpoint.allow_config_change=true", "checkpoint.accept_changed_data=true")
    rec = json.loads((run / "provenance.json").read_text())
    assert [s["step"] for s in rec["starts"]] == [0, 5]
    (acc,) = [a for a in rec["accepted"] if a["what"] == "data"]
    assert acc["what"] == "data" and acc["step"] == 5 and str(target) in acc["change"]
    (cfg,) = [a for a in rec["accepted"] if a["what"] == "config"]
    assert (cfg["step"], cfg["change"]) == (5, "trainer.steps: 5 -> 10")
    assert acc["override"] == "checkpoint.accept_changed_data=true"
    ck10 = json.loads((run / "checkpoints" / f"{10:010d}" / "provenance.json").read_text())
    assert ck10["accepted"] == rec["accepted"] and ck10["step"] == 10
    # the export carries it too, with the sha256 of its weights
    from mta_repro.weights import load_pt

    blob = load_pt(run / "export" / "consolidated.pt")
    assert blob["provenance"]["weights_sha256"] == pv.state_digest(blob["model"])
    assert blob["provenance"]["accepted"] == rec["accepted"]


@pytest.mark.slow
def test_evals_beside_a_trainer_that_saves_and_prunes_every_step_succeed(tmp_path):
    run, log = tmp_path / "run", open(tmp_path / "trainer.log", "w")  # noqa: SIM115 - the trainer's, closed at the end
    trainer = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mta_repro.train",
            f"run_dir={run}",
            *TRAIN,
            "trainer.steps=100000",
            "checkpoint.every=1",
            "checkpoint.keep=1",
            "checkpoint.export=false",
            "logging.every=50",
        ],
        cwd=ROOT,
        env=_env(),
        stdout=log,
        stderr=log,
    )
    results = []
    try:
        deadline = time.time() + 300
        while not list((run / "checkpoints").glob("0*")) and time.time() < deadline:
            assert trainer.poll() is None, (tmp_path / "trainer.log").read_text()[-3000:]
            time.sleep(0.5)
        for i in range(4):
            p = _eval(run, f"out_dir={tmp_path / f'eval{i}'}")
            assert trainer.poll() is None  # still training (and pruning) all along
            results.append((p, tmp_path / f"eval{i}" / "ppl.json"))
    finally:
        trainer.terminate()
        trainer.wait(timeout=120)
        log.close()
    steps = []
    for p, out in results:
        assert p.returncode == 0, p.stderr[-3000:]
        assert "unreadable" not in p.stderr
        step = json.loads(out.read_text())["step"]
        assert f"eval: {run}: step {step} (" in p.stderr  # it names the step it used
        steps.append(step)
    assert steps == sorted(steps) and steps[-1] > steps[0]  # the newest complete one each time


@pytest.mark.slow
def test_a_swapped_tokenizer_is_refused_by_resume_eval_and_a_stage_start(tmp_path):
    tok = tmp_path / "tok.model"
    shutil.copy(ROOT / "data" / "tokenizer" / "mini_sp8192.model", tok)
    run = tmp_path / "run"
    common = [f"data.tokenizer.path={tok}", "checkpoint.every=2"]
    _train(run, *common, "trainer.steps=2")
    good = _eval(run)
    assert good.returncode == 0, good.stderr[-3000:]
    rec = json.loads((run / "eval" / "ppl.json").read_text())["provenance"]
    assert rec["tokenizer"]["sha256"] == hashlib.sha256(tok.read_bytes()).hexdigest()
    assert rec["checkpoint"]["step"] == 2 and rec["checkpoint"]["tokens_seen"] == 2 * 2 * 32
    assert rec["validation"]["files"] == 1 and rec["code"]["package"]
    _swapped_tokenizer(tok)  # same file, same vocabulary size, other pieces
    line = _one_line_error(
        _train(run, *common, "trainer.steps=4", "checkpoint.allow_config_change=true", check=False), "train"
    )
    assert line.startswith(f"train: error: data.tokenizer.path={tok}: its content differs from the tokenizer ")
    assert "checkpoint.accept_changed_tokenizer=true" in line
    line = _one_line_error(_eval(run), "eval")
    assert "its content differs" in line and "accept_changed_tokenizer=true" in line
    stage = tmp_path / "stage"
    line = _one_line_error(
        _train(stage, *common, "trainer.steps=2", f"checkpoint.init_from={run}", check=False), "train"
    )
    assert f"checkpoint.init_from={run} was trained with the recorded one" in line
    assert not stage.exists()  # a refused start leaves no run dir
    accepted = _eval(run, "accept_changed_tokenizer=true", "--force")
    assert accepted.returncode == 0, accepted.stderr[-3000:]
    (acc,) = json.loads((run / "eval" / "ppl.json").read_text())["provenance"]["accepted"]
    assert acc["what"] == "tokenizer" and acc["override"] == "accept_changed_tokenizer=true"


def test_ranks_that_list_other_training_files_or_tokenizers_are_named(tmp_path):
    """What every rank gathers at a start (``rank_inputs``): two real loaders, rank 0 and
    rank 1 of 2, over two copies of the corpus, one missing a file, and then over the same
    corpus with another tokenizer on rank 1. The line names rank 1 and both sha256."""
    from mta_repro.data import build_train_loader
    from mta_repro.train.config import compose, to_train_config

    same, short = tmp_path / "same", tmp_path / "short"
    shutil.copytree(ROOT / "data" / "mini_slimpajama", same)
    shutil.copytree(ROOT / "data" / "mini_slimpajama", short)
    gone = sorted((short / "train").rglob("*.jsonl*"))[-1]
    gone.unlink()

    def inputs(rank, root, tok=None):
        over = [f"data.root_dir={root}", "data.seq_len=32", "data.batch_size=2"]
        args = to_train_config(compose(over + ([f"data.tokenizer.path={tok}"] if tok else [])))
        loader = build_train_loader(compose(over).data, rank, 2)
        try:
            return pv.rank_inputs(args, loader)
        finally:
            loader.close()

    r0 = inputs(0, same)
    assert pv.ranks_disagree([r0, inputs(1, same)]) is None
    r1 = inputs(1, short)
    line = pv.ranks_disagree([r0, r1])
    assert line.startswith(f"rank 1 lists other training files than rank 0: {short} holds ")
    assert f"listing sha256 {pv.short(r1['data']['sha256'])}) on rank 1" in line
    assert f"({pv.short(r0['data']['sha256'])}) on rank 0" in line and r0["data"]["sha256"] != r1["data"]["sha256"]
    assert r1["data"]["files"] == r0["data"]["files"] - 1
    other = _swapped_tokenizer(tmp_path / "other.model")
    line = pv.ranks_disagree(
        [r0, {**r0, "tokenizer": pv.tokenizer_identity({"name": "sentencepiece", "path": str(other)})}]
    )
    sha = hashlib.sha256(other.read_bytes()).hexdigest()
    assert line.startswith("rank 1 reads another tokenizer than rank 0") and f"sha256 {sha[:12]} on rank 1" in line


RESUME_COMMON = [
    "data.seq_len=32",
    "data.batch_size=2",
    "data.shuffle_buffer=4",
    "trainer.device=cpu",
    "trainer.eval_every=0",
    "checkpoint.every=1",
    "checkpoint.export=false",
    "logging.every=1",
    "logging.wandb_mode=disabled",
    "logging.progress_bar=false",
]


def test_a_run_records_what_it_is_and_an_older_run_resumes_with_the_record(tmp_path):
    """run.stage / run.variant / run.point go to provenance.json (the run's and each
    checkpoint's); a run whose config.yaml predates them resumes with them set: they are
    labels, never a reason to refuse a resume."""
    from omegaconf import OmegaConf

    from mta_repro.train.config import compose
    from mta_repro.train.config_check import diff_configs
    from mta_repro.train.loop import train

    run_dir = tmp_path / "run"
    common = [*RESUME_COMMON, "trainer.steps=2", f"run_dir={run_dir}"]
    train(compose(common))
    rec = json.loads((run_dir / "provenance.json").read_text())
    # by hand: the trainer records the stage its start knows (from scratch); the rest unrecorded
    assert rec["run"] == {"stage": "pretrain", "variant": None, "point": None}
    shutil.rmtree(run_dir / "checkpoints" / f"{2:010d}")  # the run stopped after step 1
    cfg = OmegaConf.load(run_dir / "config.yaml")
    del cfg["run"]  # a run dir from before the fields existed
    OmegaConf.save(cfg, run_dir / "config.yaml")
    new = compose([*common, "run.stage=pretrain", "run.variant=baseline"])
    d = diff_configs(OmegaConf.to_container(cfg), OmegaConf.to_container(new, resolve=True))
    assert d.unsafe == {} and d.safe == {}
    train(new)
    rec = json.loads((run_dir / "provenance.json").read_text())
    want = {"stage": "pretrain", "variant": "baseline", "point": None}
    assert [s["step"] for s in rec["starts"]] == [0, 1]  # resumed at step 1, not restarted
    assert rec["run"] == want and rec["starts"][-1]["run"] == want
    assert json.loads((run_dir / "checkpoints" / f"{2:010d}" / pv.RECORD).read_text())["run"] == want
    assert OmegaConf.load(run_dir / "config.yaml").run.stage == "pretrain"
