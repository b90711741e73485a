"""Validation during training gives the number `mta_repro.eval`'s ppl gives on the same
weights; it runs every trainer.eval_every steps and at the last step; the logged loss is
the mean over the logging interval; per-domain token counts are logged."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from tiny_config import tiny_train

from mta_repro.train.config import compose

COMMON = tiny_train(
    "checkpoint.every=100",
    "optim.lr=3e-3",
    "optim.warmup=1",
    omit=("trainer.eval_every", "checkpoint.export", "logging.every"),
)


def _rows(run_dir):
    return [json.loads(l) for l in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from mta_repro.train.loop import train

    run_dir = tmp_path_factory.mktemp("val") / "run"
    train(
        compose(
            [
                *COMMON,
                f"run_dir={run_dir}",
                "trainer.steps=5",
                "logging.every=2",
                "trainer.eval_every=2",
                "trainer.eval_max_batches=3",
                "trainer.eval_batch_size=2",
            ]
        )
    )
    return run_dir


@pytest.mark.slow
def test_validation_matches_the_eval_ppl_on_the_same_weights(run):
    from mta_repro.data import build_tokenizer, to_data_args
    from mta_repro.eval.ppl import validation_perplexity
    from mta_repro.model import build_model
    from mta_repro.train.config import model_args_from

    rows = {r["step"]: r for r in _rows(run)}
    # eval_every=2 and the last step; logging.every=2 and the last step.
    assert sorted(rows) == [2, 4, 5]
    assert all("val_loss" in rows[s] for s in (2, 4, 5))
    blob = torch.load(run / "export" / "consolidated.pt", weights_only=False)
    assert blob["step"] == 5
    cfg = compose([*COMMON])
    model = build_model(model_args_from(cfg), device="cpu", init=False)
    model.load_state_dict(blob["model"])
    model.eval()
    tok = build_tokenizer(to_data_args(cfg.data).tokenizer)
    # training validates on the first windows of each domain: the eval's window_sampling=first
    want = validation_perplexity(model, tok, cfg.data, seq_len=32, batch_size=2, max_batches=3, window_sampling="first")
    got = rows[5]
    assert set(want["domains"]) == {k.split("/", 1)[1] for k in got if k.startswith("val_loss/")}
    for name, d in want["domains"].items():
        assert got[f"val_loss/{name}"] == pytest.approx(d["loss"], rel=1e-5), name
        assert got[f"val_ppl/{name}"] == pytest.approx(d["ppl"], rel=1e-5), name
    assert got["val_ppl"] == pytest.approx(want["average"], rel=1e-5)
    assert got["val_loss"] == pytest.approx(sum(d["loss"] for d in want["domains"].values()) / len(want["domains"]))
    assert got["val_tokens"] == sum(d["tokens"] for d in want["domains"].values())
    assert rows[2]["val_loss"] > got["val_loss"]  # it learns


def test_logged_loss_is_the_interval_mean(run):
    rows = {r["step"]: r for r in _rows(run)}
    # Per-step losses from a logging.every=1 twin of the same run (same data, same init).
    import tempfile

    from mta_repro.train.loop import train

    with tempfile.TemporaryDirectory() as d:
        train(
            compose(
                [
                    *COMMON,
                    f"run_dir={d}/r",
                    "trainer.steps=5",
                    "logging.every=1",
                    "trainer.eval_every=0",
                    "checkpoint.export=false",
                ]
            )
        )
        per_step = {r["step"]: r["loss"] for r in _rows(f"{d}/r")}
    assert rows[2]["loss"] == pytest.approx((per_step[1] + per_step[2]) / 2, abs=1e-6)
    assert rows[4]["loss"] == pytest.approx((per_step[3] + per_step[4]) / 2, abs=1e-6)
    assert rows[5]["loss"] == pytest.approx(per_step[5], abs=1e-6) and rows[5]["loss_last"] == rows[5]["loss"]
    assert rows[4]["loss_last"] == pytest.approx(per_step[4], abs=1e-6)


def test_throughput_and_domain_tokens_are_logged(run):
    r = _rows(run)[-1]
    assert r["tokens_per_s_global"] > 0 and r["tokens_per_s_per_gpu"] == r["tokens_per_s_global"]  # 1 rank
    counts = {k.split("/", 1)[1]: v for k, v in r.items() if k.startswith("train_tokens/")}
    # Every token trained on is counted once, in its domain: 5 steps x 2 x 32 targets.
    assert sum(counts.values()) == 5 * 2 * 32 == r["tokens_seen"]
    assert counts["commoncrawl"] > 0


@pytest.mark.slow
def test_progress_lines_without_a_tty(tmp_path):
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "mta_repro.train",
            f"run_dir={tmp_path / 'r'}",
            *COMMON,
            "trainer.steps=2",
            "logging.every=1",
            "logging.progress_bar=true",
            "trainer.eval_every=0",
            "checkpoint.export=false",
        ],
        cwd=root,
        env=dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert "\r" not in p.stderr
    lines = [l for l in p.stderr.splitlines() if l.startswith("[mta_repro.train] step ")]
    assert len(lines) == 2 and "step 2/2" in lines[1] and "per rank" in lines[1]
    assert math.isfinite(float(lines[1].split("loss ")[1].split()[0]))


def _token_counts(cfg):
    """Each domain's validation tokens, counted independently of the Validator."""
    from mta_repro import data as data_mod

    tok = data_mod.build_tokenizer(data_mod.to_data_args(cfg.data).tokenizer)
    return {
        d: sum(len(tok.encode(doc, add_bos=True, add_eos=True)) for doc in data_mod.iter_validation_docs(cfg.data, d))
        for d in data_mod.domains(cfg.data)
    }


def test_a_domain_too_small_for_one_window_is_skipped_with_one_warning(recwarn):
    """At a window longer than the smallest domain's validation text (the bundled arxiv at
    4K), that domain is skipped with one warning naming it; the others validate; only
    when no domain fits is it an error."""
    from mta_repro.train.validation import Validator

    cfg = compose(["experiment=debug"])
    counts = _token_counts(cfg)
    smallest, second = sorted(counts.values())[:2]
    seq_len = (smallest + second) // 2  # between the two smallest domains: exactly one too small
    v = Validator(cfg.data, seq_len, batch_size=1, max_batches=1, rank=0, world_size=1)
    small = [d for d, n in counts.items() if n < seq_len + 1]
    assert len(small) == 1 and v.skipped == {small[0]: counts[small[0]]}
    assert set(v.batches) == set(counts) - set(small)
    msgs = [str(w.message) for w in recwarn if "validation: skipped" in str(w.message)]
    assert len(msgs) == 1 and repr(small[0]) in msgs[0] and f"{counts[small[0]]:,} tokens" in msgs[0]
    with pytest.raises(ValueError, match="no domain's validation documents hold data.seq_len"):
        Validator(cfg.data, max(counts.values()) + 10, batch_size=1, max_batches=1, rank=0, world_size=1)


def test_validation_states_its_cost_and_a_short_run_is_told(capsys):
    """Before training: windows, tokens and the cost in training steps; a run shorter than
    eval_every hears that it validates once, at the last step, and how to shrink it."""
    from types import SimpleNamespace

    from mta_repro.train.args import TrainerArgs
    from mta_repro.train.validation import maybe_validator

    cfg = compose(["experiment=debug", "data.seq_len=64", "data.batch_size=2"])
    tr = TrainerArgs(steps=2, eval_every=50, eval_max_batches=3, eval_batch_size=2)
    v = maybe_validator(cfg, tr, SimpleNamespace(rank=0, world_size=1), 64)
    err = capsys.readouterr().err
    n_windows = sum(b.shape[0] for bs in v.batches.values() for b in bs)
    assert n_windows == len(v.batches) * 3 * 2  # every domain fills 3 batches of 2 at 64 tokens
    tokens = n_windows * 64
    assert (
        f"validation once, at the last step (trainer.steps=2 < trainer.eval_every=50): {n_windows} windows of 64 tokens"
    ) in err
    assert f"({tokens:,} tokens, about the compute of {tokens / (3 * 2 * 64):.1f} training steps)" in err
    assert "trainer.eval_every=0 skips it" in err and len(err.strip().splitlines()) == 1
    long = TrainerArgs(steps=200, eval_every=50, eval_max_batches=3, eval_batch_size=2)
    maybe_validator(cfg, long, SimpleNamespace(rank=0, world_size=1), 64)
    assert "every 50 steps and at the last" in capsys.readouterr().err
