"""Evaluation knows the context a run was trained at: lengths beyond it are refused (one
line, rc 2) unless extrapolate=true, every JSON records the trained and evaluated
lengths, and a rerun skips tasks whose results are up to date (--force reruns them)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from eval_helpers import make_run

from mta_repro.eval.run import main, parse_argv, run

ROOT = Path(__file__).resolve().parents[1]
PPL = ["tasks=[ppl]", "ppl.max_batches=1", "ppl.batch_size=1", "ppl.domains=[book]"]


@pytest.mark.parametrize(
    "override, field",
    [
        ("ppl.seq_len=512", "ppl.seq_len=512"),
        ("needle.context_lens=[128,512]", "needle.context_lens=512"),
        ("babilong.lengths=[0k,1k]", "babilong.lengths=1024"),
        ("lm_eval.max_length=300", "lm_eval.max_length=300"),
    ],
)
def test_lengths_beyond_the_trained_context_are_refused(tmp_path, override, field):
    run_dir, _ = make_run(tmp_path / "run", attention="baseline", seq_len=256)
    task = override.split(".")[0].replace("lm_eval", "benchmarks")
    with pytest.raises(
        ValueError,
        match=rf"{field} for task '{task}' is beyond the context .* "
        r"\(data.seq_len=256 in its config\); set extrapolate=true",
    ):
        run(parse_argv([str(run_dir), f"tasks=[{task}]", override]))
    assert not (run_dir / "eval").exists()  # refused before any work


@pytest.mark.slow
def test_refusal_is_one_line_rc2_and_extrapolate_allows_it(tmp_path):
    run_dir, _ = make_run(tmp_path / "run", attention="baseline", seq_len=64)
    p = subprocess.run(
        [sys.executable, "-m", "mta_repro.eval", str(run_dir), *PPL, "ppl.seq_len=128"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 2, p.stderr[-2000:]
    lines = [line for line in p.stderr.splitlines() if line.strip() and "Warning" not in line]
    assert len([line for line in lines if "beyond the context" in line]) == 1 and "Traceback" not in p.stderr
    # on purpose: evaluated, and the JSON says it was beyond the trained context
    assert main([str(run_dir), *PPL, "ppl.seq_len=128", "extrapolate=true"]) == 0
    rec = json.loads((run_dir / "eval" / "ppl.json").read_text())
    assert rec["trained_seq_len"] == 64 and rec["eval_lengths"] == {"ppl.seq_len": 128}
    assert rec["extrapolated"] is True and rec["results"]["seq_len"] == 128


def test_json_records_lengths_and_a_rerun_skips_until_forced(tmp_path, caplog):
    run_dir, _ = make_run(tmp_path / "run", attention="baseline", seq_len=64)
    written = run(parse_argv([str(run_dir), *PPL]))
    path = Path(written["ppl"])
    rec = json.loads(path.read_text())
    # default window = the trained context
    assert rec["trained_seq_len"] == 64 and rec["eval_lengths"] == {"ppl.seq_len": 64}
    assert rec["extrapolated"] is False and rec["results"]["seq_len"] == 64
    mtime = path.stat().st_mtime_ns
    caplog.set_level("INFO", logger="mta_repro.eval")
    assert run(parse_argv([str(run_dir), *PPL])) == written  # up to date: skipped
    assert path.stat().st_mtime_ns == mtime and "up to date" in caplog.text
    # other settings are not up to date
    run(parse_argv([str(run_dir), *PPL, "ppl.seq_len=32"]))
    assert json.loads(path.read_text())["eval_lengths"] == {"ppl.seq_len": 32}
    mtime = path.stat().st_mtime_ns
    run(parse_argv([str(run_dir), *PPL, "ppl.seq_len=32", "--force"]))
    assert path.stat().st_mtime_ns > mtime
