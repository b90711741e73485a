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


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("MTA_REPRO_CHECK_STUDY"), reason="set MTA_REPRO_CHECK_STUDY=1 (or all)")
def test_the_committed_study_is_what_its_command_gives(tmp_path):
    only = [] if os.environ["MTA_REPRO_CHECK_STUDY"] == "all" else ["--only", "pretrain/mta/seed0"]
    assert check_small_study.main([*only, "--fresh", str(tmp_path / "study")]) == 0
