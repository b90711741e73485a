"""The committed small study (results/small_study) against its one command:
``scripts/check_small_study.py`` compares every run's eval numbers and training losses
exactly. Its comparison is tested here on fabricated roots; the rerun itself (one run:
~2.5 min; every run: ~40 min on 2 cores) only when MTA_REPRO_CHECK_STUDY is set (``1``: the
run pretrain/mta/seed0; ``all``: the whole study), as it is too long for every CI run."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import check_small_study
import pytest

REPO = Path(__file__).resolve().parents[1]


def _root(path: Path, avg: float, loss: float) -> Path:
    run = path / "pretrain" / "mta" / "seed0"
    (run / "eval").mkdir(parents=True)
    res = {"domains": {"book": {"ppl": avg, "batch_ce": [1.0, 2.0]}}, "average": avg}
    (run / "eval" / "ppl.json").write_text(json.dumps({"task": "ppl", "time": str(path), "results": res}))
    rows = [{"step": 10, "loss": loss, "tokens_per_s_global": 1000.0 * avg}, {"step": 20, "loss": loss / 2}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_same_numbers_match_and_a_changed_one_is_named(tmp_path):
    committed = _root(tmp_path / "a", 812.5, 6.25)
    assert check_small_study.compare(committed, _root(tmp_path / "b", 812.5, 6.25)) == []
    lines = check_small_study.compare(committed, _root(tmp_path / "c", 812.5000001, 6.25))
    assert lines == ["pretrain/mta/seed0/eval/ppl.json: average: committed 812.5, now 812.5000001"] + [
        "pretrain/mta/seed0/eval/ppl.json: domains.book.ppl: committed 812.5, now 812.5000001"
    ]
    (lines,) = [check_small_study.compare(committed, _root(tmp_path / "d", 812.5, 6.5))]
    assert len(lines) == 1 and lines[0].startswith("pretrain/mta/seed0/metrics.jsonl: 2 logged step(s) differ")
    shutil.rmtree(tmp_path / "d" / "pretrain" / "mta" / "seed0" / "eval")
    assert "missing" in check_small_study.compare(committed, tmp_path / "d")[0]


def _eval(run: Path, name: str, settings: dict, results: dict) -> None:
    (run / "eval").mkdir(parents=True, exist_ok=True)
    (run / "eval" / name).write_text(json.dumps({"task": name[:-5], "settings": settings, "results": results}))


def test_only_like_is_compared_with_like(tmp_path):
    """An eval file of another protocol (random windows against the old first ones, needle
    prompts of another seed) is skipped with a note, not a difference; fields the committed
    file predates are noted and the rest compared."""
    committed, fresh = _root(tmp_path / "a", 812.5, 6.25), _root(tmp_path / "b", 812.5, 6.25)
    run_a, run_b = committed / "pretrain" / "mta" / "seed0", fresh / "pretrain" / "mta" / "seed0"
    old_ppl = {"domains": {"book": {"ppl": 812.5, "batch_ce": [1.0, 2.0]}}, "average": 812.5}
    _eval(run_a, "ppl.json", {"batch_size": 1, "max_batches": 2}, old_ppl)
    new_ppl = {"domains": {"book": {"ppl": 700.0, "batch_ce": [1.5, 2.5], "batch_doc": [0, 3]}}, "average": 700.0}
    random_settings = {"batch_size": 1, "max_batches": 2, "window_sampling": "random", "window_seed": 0}
    _eval(run_b, "ppl.json", random_settings, {**new_ppl, "token_loss": 2.0, "tokens": 2})
    acc = {"512": {"2": {"mean": 0.5, "scores": {"0": [1.0, 0.0]}}}}
    _eval(run_a, "needle.json", {}, {"settings": {"seed": 0}, "accuracy": acc})
    ids = {"512": {"2": {**acc["512"]["2"], "prompt_ids": {"0": ["00ab", "00cd"]}}}}
    _eval(run_b, "needle.json", {}, {"settings": {"seed": 0, "seed_source": "run config seed"}, "accuracy": ids})
    notes: list = []
    assert check_small_study.compare(committed, fresh, notes=notes) == []
    assert notes == [
        "pretrain/mta/seed0/eval/needle.json: the committed file predates prompt_ids, seed_source: not compared",
        "pretrain/mta/seed0/eval/ppl.json: not compared: the committed file was evaluated with "
        "{'window_sampling': 'first', 'window_seed': None}, the rerun with {'window_sampling': 'random', "
        "'window_seed': 0}",
    ]
    # the same protocol: compared, the new fields aside; a changed score is a difference
    _eval(
        run_b,
        "ppl.json",
        {"batch_size": 1, "max_batches": 2, "window_sampling": "first", "window_seed": 7},
        {**old_ppl, "token_loss": 1.5, "tokens": 2},
    )
    other = {"512": {"2": {"mean": 0.5, "scores": {"0": [0.0, 1.0]}, "prompt_ids": {"0": ["00ab", "00cd"]}}}}
    _eval(run_b, "needle.json", {}, {"settings": {"seed": 0}, "accuracy": other})
    notes = []
    assert check_small_study.compare(committed, fresh, notes=notes) == [
        "pretrain/mta/seed0/eval/needle.json: accuracy.512.2.scores.0[0]: committed 1.0, now 0.0",
        "pretrain/mta/seed0/eval/needle.json: accuracy.512.2.scores.0[1]: committed 0.0, now 1.0",
    ]
    assert notes == [
        "pretrain/mta/seed0/eval/needle.json: the committed file predates prompt_ids: not compared",
        "pretrain/mta/seed0/eval/ppl.json: the committed file predates token_loss, tokens: not compared",
    ]
    # needle prompts of another seed: skipped, with the seeds named
    _eval(run_b, "needle.json", {}, {"settings": {"seed": 1}, "accuracy": other})
    notes = []
    assert check_small_study.compare(committed, fresh, notes=notes) == []
    assert "{'seed': 0}, the rerun with {'seed': 1}" in notes[0]


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("MTA_REPRO_CHECK_STUDY"), reason="set MTA_REPRO_CHECK_STUDY=1 (or all)")
def test_the_committed_study_is_what_its_command_gives(tmp_path):
    only = [] if os.environ["MTA_REPRO_CHECK_STUDY"] == "all" else ["--only", "pretrain/mta/seed0"]
    assert check_small_study.main([*only, "--fresh", str(tmp_path / "study")]) == 0
