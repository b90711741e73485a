"""The find-block toy task: generator invariants, the error metric, smoke training."""

from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from mta_repro.toy.find_block import (
    IGNORE,
    CharTokenizer,
    FindBlockArgs,
    error_counts,
    generate_splits,
    labels_from,
    wrong_per_target,
)
from mta_repro.toy.train import model_args_for, to_toy_config, train_run
from mta_repro.train.config import compose

REPO = Path(__file__).resolve().parents[1]


def _parse(row: torch.Tensor) -> tuple[list[str], str, str]:
    """(blocks, query, target) from one token row, by string splitting only."""
    tok = CharTokenizer()
    ids = row.tolist()
    assert ids[0] == tok.bos_id
    end = ids.index(tok.eos_id)
    assert all(i == tok.pad_id for i in ids[end + 1 :])
    text = "".join(tok.itos[i] for i in ids[1:end])
    body, tail = text.split("#")
    return body.split("."), tail[:2], tail[2:]


@pytest.mark.parametrize("target,alphabet", [("all", 26), ("first", 26), ("last", 26), ("all", 7)])
def test_generator_invariants(target, alphabet):
    args = FindBlockArgs(
        block_length=4,
        n_blocks=7,
        query_length=2,
        target=target,
        alphabet_size=alphabet,
        n_train=400,
        n_test=60,
        seed=3,
        pad_len=45,
    )
    train, test = generate_splits(args)
    assert len(train) == 400 and len(test) == 60
    assert train.tokens.shape == (400, 45) and test.tokens.shape == (60, 45)
    for split in (train, test):
        for row in split.tokens:
            blocks, query, tgt = _parse(row)
            assert len(blocks) == 7 and all(len(b) == 4 for b in blocks)
            letters = set("abcdefghijklmnopqrstuvwxyz"[:alphabet])
            assert all(len(set(b)) == 4 and set(b) <= letters for b in blocks)
            assert len(set(blocks)) == 7  # distinct blocks
            assert len(query) == 2 and len(set(query)) == 2
            hits = [b for b in blocks if set(query) <= set(b)]
            assert len(hits) == 1  # exactly one block holds both query letters
            want = {"all": hits[0], "first": hits[0][0], "last": hits[0][-1]}[target]
            assert tgt == want
    # Unique samples, held-out disjoint from training.
    tr = {tuple(r.tolist()) for r in train.tokens}
    te = {tuple(r.tolist()) for r in test.tokens}
    assert len(tr) == 400 and len(te) == 60 and not tr & te


def test_generator_rejects_impossible():
    # 3 letters, blocks of 3: every block holds both query letters.
    with pytest.raises(ValueError, match="alphabet_size"):
        FindBlockArgs(block_length=3, n_blocks=4, alphabet_size=3)
    with pytest.raises(ValueError, match="data.target"):
        FindBlockArgs(target="middle")


def test_generator_seeded():
    a = FindBlockArgs(block_length=3, n_blocks=5, n_train=50, n_test=10, seed=7)
    x1, y1 = generate_splits(a)
    x2, y2 = generate_splits(a)
    assert torch.equal(x1.tokens, x2.tokens) and torch.equal(y1.tokens, y2.tokens)
    x3, _ = generate_splits(FindBlockArgs(block_length=3, n_blocks=5, n_train=50, n_test=10, seed=8))
    assert not torch.equal(x1.tokens, x3.tokens)


def test_release_length_and_query_all_letters():
    # The release's layout: 319 characters + bos + eos for N=5, L=2, 52 blocks.
    assert FindBlockArgs().seq_len == 321
    # L = N: the target block is the only one holding all its letters.
    a = FindBlockArgs(block_length=3, n_blocks=6, query_length=3, n_train=40, n_test=5, seed=1)
    train, _ = generate_splits(a)
    for row in train.tokens:
        blocks, _, _ = _parse(row)
        tok = CharTokenizer()
        text = tok.decode(row.tolist())
        query = text.split("#")[1][:3]
        assert sum(set(query) <= set(b) for b in blocks) == 1


def test_labels_only_at_targets():
    a = FindBlockArgs(block_length=5, n_blocks=4, n_train=20, n_test=5, seed=2)
    train, _ = generate_splits(a)
    labels = labels_from(train.tokens, a)
    tok = CharTokenizer()
    for row, lab in zip(train.tokens, labels):
        _, _, tgt = _parse(row)
        kept = [int(t) for t in lab if t != IGNORE]
        assert tok.decode(kept) == tgt
        # label j is token j+1: the target letters are the last ones before <eos>.
        end = row.tolist().index(tok.eos_id)
        assert (lab[end - 1 - len(tgt) : end - 1] != IGNORE).all()


def test_error_metric_hand_made():
    I = IGNORE
    labels = torch.tensor([[I, 5, 6, I], [I, 7, 8, I], [I, 9, 9, I]])
    pred = torch.tensor([[0, 5, 6, 3], [1, 7, 0, 2], [4, 0, 0, 9]])
    # Row 0 right (errors off-target do not count), row 1 one wrong, row 2 both wrong.
    assert error_counts(pred, labels) == (2, 3, 3, 6)
    assert error_counts(labels.clamp(min=0), labels) == (0, 3, 0, 6)


def test_wrong_per_target_hand_made():
    args = FindBlockArgs(block_length=3, n_blocks=3, alphabet_size=6, n_train=8, n_test=3)
    rows = generate_splits(args)[1].tokens
    labels = labels_from(rows, args)
    pred = labels.clamp(min=0).clone()
    pred[:, 0] = 99  # off-target mistakes do not count
    first = int((labels[0] != IGNORE).nonzero()[0])  # column of the first target letter
    pred[0, first + 1] = 99  # row 0: second letter wrong
    pred[1, first] = pred[1, first + 2] = 99  # row 1: first and third wrong
    pred[2, first] = 99  # row 2: first wrong
    assert wrong_per_target(pred, labels, args) == [2, 1, 1]
    assert error_counts(pred, labels) == (3, 3, 4, 9)


def test_configs_compose():
    for name in ("toy/paper", "toy/reduced"):
        cfg = to_toy_config(compose([], config_name=name))
        assert cfg.model.vocab_size == CharTokenizer().n_words
        # The release's depth, heads and dropout at both scales; only the width shrinks.
        assert (cfg.model.n_layers, cfg.model.n_heads, cfg.model.dropout) == (4, 2, 0.1)
        assert cfg.mta.query_kernel_size == 2
        assert cfg.mta.key_kernel_size == 2 * cfg.data.block_length - 1
        assert cfg.optim.scheduler == "constant"
    paper = to_toy_config(compose([], config_name="toy/paper"))
    assert paper.data.seq_len == 321 and paper.data.n_train == 1_000_000
    assert (paper.train.steps, paper.train.batch_size, paper.optim.lr) == (100_000, 64, 1e-4)
    assert paper.model.dim == 256
    with pytest.raises(ValueError, match="vocab_size"):
        to_toy_config(compose(["model.vocab_size=8192"], config_name="toy/reduced"))


def _tiny_cfg(tmp_path, **train):
    ov = [
        "data.block_length=3",
        "data.n_blocks=4",
        "data.alphabet_size=6",
        "mta.key_kernel_size=5",
        "data.n_train=256",
        "data.n_test=32",
        "model.dim=64",
        "model.n_layers=2",
        "model.multiple_of=32",
        "train.batch_size=16",
        "train.eval_every=10",
        "train.eval_batch_size=32",
        "optim.lr=3e-3",
        "optim.warmup=0",
        "train.workers=1",
        f"out_dir={tmp_path}",
        "seeds=[5]",
    ] + [f"train.{k}={v}" for k, v in train.items()]
    return ov


@pytest.mark.parametrize("variant", ["baseline", "mta"])
def test_smoke_training(tmp_path, variant):
    cfg = to_toy_config(compose(_tiny_cfg(tmp_path, steps=40), config_name="toy/reduced"))
    margs = model_args_for(cfg, variant, 5)
    if variant == "mta":  # the pre-softmax conv in every layer, nothing else
        assert margs.conv_layer_ids() == [0, 1]
    else:
        assert not margs.mta.use_mta
    r = train_run(cfg, variant, 5, log_path=tmp_path / "log.jsonl", verbose=False)
    curve = r["curve"]
    assert [c["step"] for c in curve] == [10, 20, 30, 40]
    assert all(math.isfinite(c["loss"]) and math.isfinite(c["train_loss"]) for c in curve)
    # From ~log(31) at init the held-out target loss must fall well below it: the
    # targets use 6 of the 31 ids (log 6 = 1.8 without solving anything).
    assert curve[-1]["loss"] < math.log(31) - 0.7
    assert 0.0 <= r["seq_error"] <= 100.0 and r["token_error"] <= r["seq_error"] + 1e-9
    assert len((tmp_path / "log.jsonl").read_text().splitlines()) == 4
    # Per-letter errors: a sequence is wrong iff some letter is, so they bracket seq_error.
    pe = curve[-1]["position_error"]
    assert len(pe) == cfg.data.block_length  # (rounded to 0.01)
    assert max(pe) - 0.01 <= r["seq_error"] <= sum(pe) + 0.03


def test_script_writes_results(tmp_path):
    import toy_task

    ov = _tiny_cfg(tmp_path, steps=4, eval_every=2) + ["seeds=[1,2]"]
    toy_task.main(["--config", "toy/reduced", *ov])
    with open(tmp_path / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["model", "seed", "seq_error", "token_error"]
    assert sorted((r["model"], r["seed"]) for r in rows) == [
        ("baseline", "1"),
        ("baseline", "2"),
        ("mta", "1"),
        ("mta", "2"),
    ]
    assert all(0.0 <= float(r["seq_error"]) <= 100.0 for r in rows)
    md = (tmp_path / "results.md").read_text()
    assert "| baseline | 1 |" in md and "**mta** | **mean**" in md
    assert (tmp_path / "errors.png").stat().st_size > 1000


@pytest.mark.slow
def test_killed_run_resumes_exactly(tmp_path, monkeypatch):
    """A run that crashes after its step-20 checkpoint and is started again ends with
    the same curve and the same weights as a run that never stopped (dropout on, so
    the RNG, the batch order and the optimiser state must all resume)."""
    cfg = to_toy_config(compose(_tiny_cfg(tmp_path, steps=40), config_name="toy/reduced"))
    full = train_run(cfg, "mta", 5, verbose=False, ckpt_path=tmp_path / "full.pt")

    calls = {"n": 0}
    real_clip = torch.nn.utils.clip_grad_norm_

    def crash_at_25(*a, **k):  # called once per optimiser step
        calls["n"] += 1
        if calls["n"] == 25:
            raise RuntimeError("simulated crash")
        return real_clip(*a, **k)

    ckpt, log = tmp_path / "run.pt", tmp_path / "run.jsonl"
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", crash_at_25)
    with pytest.raises(RuntimeError, match="simulated crash"):
        train_run(cfg, "mta", 5, verbose=False, ckpt_path=ckpt, log_path=log)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", real_clip)
    assert torch.load(ckpt, weights_only=True)["step"] == 20
    resumed = train_run(cfg, "mta", 5, verbose=False, ckpt_path=ckpt, log_path=log)

    strip = lambda curve: [{k: v for k, v in c.items() if k != "elapsed_s"} for c in curve]
    assert strip(resumed["curve"]) == strip(full["curve"])
    assert [json.loads(l)["step"] for l in log.read_text().splitlines()] == [10, 20, 30, 40]
    a, b = torch.load(ckpt, weights_only=True), torch.load(tmp_path / "full.pt", weights_only=True)
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in b["model"])

    # A finished run's checkpoint gives its result back without training again.
    again = train_run(cfg, "mta", 5, verbose=False, ckpt_path=ckpt)
    assert strip(again["curve"]) == strip(full["curve"])
    # A checkpoint of another run is refused, naming what differs.
    other = to_toy_config(compose(_tiny_cfg(tmp_path, steps=40) + ["optim.lr=1e-3"], config_name="toy/reduced"))
    with pytest.raises(ValueError, match="optim"):
        train_run(other, "mta", 5, verbose=False, ckpt_path=ckpt)


@pytest.mark.slow
def test_script_sigterm_stops_workers_and_rerun_resumes(tmp_path):
    """SIGTERM to scripts/toy_task.py ends its worker processes too (none left training
    as orphans), and running a finished command again takes its runs from the checkpoints."""
    import os
    import signal
    import subprocess
    import time

    def cmd(out, steps):
        ov = _tiny_cfg(out, steps=steps, workers=2) + ["seeds=[1]"]
        return [sys.executable, str(REPO / "scripts" / "toy_task.py"), *ov]

    # Runs far longer than the test: orphaned workers would still be training at the end.
    long_dir = tmp_path / "long"
    proc = subprocess.Popen(cmd(long_dir, 10**6), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not list((long_dir / "ckpt").glob("*.pt")):  # a run has checkpointed: mid-training
        assert proc.poll() is None and time.time() < deadline, "no checkpoint written"
        time.sleep(0.2)
    children = [int(p) for p in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]
    assert len(children) >= 2  # the two pool workers (and multiprocessing's tracker)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    assert proc.returncode != 0 and not (long_dir / "results.csv").exists()

    def alive(pid):
        try:
            os.kill(pid, 0)
            return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
        except (ProcessLookupError, FileNotFoundError):
            return False

    for _ in range(100):
        if not any(alive(p) for p in children):
            break
        time.sleep(0.1)
    leftover = [p for p in children if alive(p)]
    for p in leftover:
        os.kill(p, signal.SIGKILL)
    assert not leftover, "worker processes outlived a SIGTERMed parent"

    short = cmd(tmp_path / "short", 30)
    first = subprocess.run(short, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stdout + first.stderr
    results = (tmp_path / "short" / "results.csv").read_text()
    again = subprocess.run(short, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and again.stdout.count("resumed from") == 2
    assert (tmp_path / "short" / "results.csv").read_text() == results
    for name in ("baseline_seed1", "mta_seed1"):
        log = (tmp_path / "short" / "runs" / f"{name}.jsonl").read_text().splitlines()
        assert [json.loads(l)["step"] for l in log] == [10, 20, 30]
