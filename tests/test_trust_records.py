"""Every result bound to its run and every refusal without a trace: an eval JSON copied
from another run, a refused start, accepted config changes, a tie in the report's
comparability marks, a read-only run dir, non-finite numbers in eval JSONs, the first loss
line after a resume, and the lm-eval task data a benchmark row was scored on."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
from eval_helpers import make_run
from tiny_config import tiny_train

ROOT = Path(__file__).resolve().parents[1]


def _eval_json(run: Path, tok_sha: str, step: int = 7, task: str = "ppl", **prov) -> Path:
    """An eval result of ``run`` as eval writes it (the provenance fields the report reads)."""
    provenance = {
        "checkpoint": {"path": str(run / "export" / "consolidated.pt"), "step": step, "weights_sha256": "ab" * 32},
        "tokenizer": {"name": "bytes", "sha256": tok_sha},
        "validation": {"files": 1, "bytes": 100, "sha256": "cd" * 32},
        "code": {"package": "0.1.0", "commit": "f" * 40, "dirty": False},
        "accepted": [],
        **prov,
    }
    res = {"domains": {"book": {"ppl": 20.0, "loss": 3.0, "tokens": 10}}, "average": 20.0, "seq_len": 256}
    (run / "eval").mkdir(exist_ok=True)
    f = run / "eval" / f"{task}.json"
    f.write_text(
        json.dumps({"task": task, "variant": "baseline", "step": step, "provenance": provenance, "results": res})
    )
    return f


# ------------------------------------------------------------------ the report's marks
def test_a_one_to_one_tie_of_tokenizers_marks_both_rows_and_says_there_is_no_majority(tmp_path):
    from mta_repro.report.__main__ import build_report

    runs = [make_run(tmp_path / n, attention="baseline")[0] for n in ("a", "b")]
    _eval_json(runs[0], "11" * 32)
    _eval_json(runs[1], "22" * 32)
    out = tmp_path / "rep"
    build_report(runs, out, kernels=False)
    table = json.loads((out / "results.json").read_text())["tables"]["ppl"]
    assert [r["run"] for r in table["rows"]] == ["a (!)", "b (!)"]
    for label, tok in (("a (!)", "111111111111"), ("b (!)", "222222222222")):
        why = table["provenance"][label]["comparable"]
        assert why.startswith(f"no: tokenizer {tok}; no majority among the rows")
        assert "most rows" not in why


# ------------------------------------------------------------------ non-finite numbers
def _strict(text: str):
    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def test_a_diverged_perplexity_is_written_as_null_with_a_flag_and_read_back_as_inf(tmp_path, capsys):
    import torch

    from mta_repro.eval.run import main as eval_main
    from mta_repro.files import read_json

    run_dir, _ = make_run(tmp_path / "run", attention="baseline")
    export = run_dir / "export" / "consolidated.pt"
    blob = torch.load(export, weights_only=True)
    blob["model"]["norm.weight"] = blob["model"]["norm.weight"] * 1e6  # logits x 1e6: exp(loss) overflows
    torch.save(blob, export)
    args = ["tasks=[ppl]", "ppl.seq_len=32", "ppl.max_batches=1", "ppl.domains=[book]"]
    assert eval_main([str(run_dir), *args]) == 0, capsys.readouterr().err[-2000:]
    f = run_dir / "eval" / "ppl.json"
    raw = _strict(f.read_text())  # JSON for a strict reader: no bare Infinity
    assert raw["results"]["domains"]["book"]["ppl"] is None and raw["results"]["average"] is None
    assert raw["nonfinite"] == {"/results/domains/book/ppl": "inf", "/results/average": "inf"}
    res = read_json(f)["results"]
    assert res["domains"]["book"]["ppl"] == math.inf and res["average"] == math.inf
    assert math.isfinite(res["domains"]["book"]["loss"])
    # a file written before, with the bare constants, reads the same
    old = json.loads(f.read_text())
    old.pop("nonfinite")
    old["results"]["domains"]["book"]["ppl"] = old["results"]["average"] = math.inf
    f.write_text(json.dumps(old))
    assert "Infinity" in f.read_text() and read_json(f)["results"] == res


def test_nonfinite_numbers_round_trip_in_lists_and_escaped_keys(tmp_path):
    from mta_repro.files import read_json, result_json

    obj = {"a/b": [1.0, -math.inf], "c~": {"x": math.nan, "y": None}}
    f = tmp_path / "r.json"
    f.write_bytes(result_json(obj))
    assert _strict(f.read_text())["nonfinite"] == {"/a~1b/1": "-inf", "/c~0/x": "nan"}
    back = read_json(f)
    assert back["a/b"] == [1.0, -math.inf] and math.isnan(back["c~"]["x"]) and back["c~"]["y"] is None


# ------------------------------------------------------------------ the run dir's records
TRAIN = tiny_train("trainer.steps=2", "checkpoint.every=1")


def _train(run_dir, *overrides):
    from mta_repro.train.config import compose
    from mta_repro.train.loop import train

    return train(compose([*TRAIN, f"run_dir={run_dir}", *overrides]))


def _cli(*args, timeout=300):
    import os
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)


def _snapshot(run_dir: Path) -> dict:
    return {str(p.relative_to(run_dir)): (p.read_bytes() if p.is_file() else None) for p in sorted(run_dir.rglob("*"))}


def _one_error_line(err: str, prog: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith((f"{prog}: error:", f"error: {prog}:"))]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0]


@pytest.mark.slow
def test_a_refused_start_changes_nothing_and_an_accepted_one_replaces_the_hydra_record(tmp_path):
    run = tmp_path / "run"
    p = _cli("-m", "mta_repro.train", *TRAIN, f"run_dir={run}")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "  lr: 0.00015\n" in (run / ".hydra" / "config.yaml").read_text()
    before = _snapshot(run)
    p = _cli("-m", "mta_repro.train", *TRAIN, f"run_dir={run}", "optim.lr=0.001")
    assert p.returncode == 2
    assert "optim.lr" in _one_error_line(p.stderr, "train") and "left untouched" in p.stderr
    assert _snapshot(run) == before  # .hydra/config.yaml still says the run's lr; no staged folder
    p = _cli(
        "-m", "mta_repro.train", *TRAIN, f"run_dir={run}", "trainer.steps=3", "checkpoint.allow_config_change=true"
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert "steps: 3" in (run / ".hydra" / "config.yaml").read_text()
    assert "trainer.steps=3" in (run / ".hydra" / "overrides.yaml").read_text()
    assert sorted(x.name for x in run.iterdir() if x.name.startswith(".hydra")) == [".hydra"]


def test_accepted_config_changes_are_recorded_with_their_step_and_shown_by_the_report(tmp_path, capsys):
    from mta_repro.eval.run import main as eval_main
    from mta_repro.report.__main__ import build_report

    run = tmp_path / "run"
    _train(run)
    _train(run, "trainer.steps=3", "checkpoint.allow_config_change=true")
    _train(run, "trainer.steps=4", "checkpoint.allow_config_change=true")
    accepted = json.loads((run / "provenance.json").read_text())["accepted"]
    assert [(a["what"], a["step"], a["change"], a["override"]) for a in accepted] == [
        ("config", 2, "trainer.steps: 2 -> 3", "checkpoint.allow_config_change=true"),
        ("config", 3, "trainer.steps: 3 -> 4", "checkpoint.allow_config_change=true"),
    ]
    # the checkpoint carries the run's history, so every result made of it does
    ck = json.loads((run / "checkpoints" / f"{4:010d}" / "provenance.json").read_text())
    assert [a["change"] for a in ck["accepted"]] == ["trainer.steps: 2 -> 3", "trainer.steps: 3 -> 4"]
    args = ["tasks=[ppl]", "ppl.seq_len=32", "ppl.max_batches=1", "ppl.domains=[book]"]
    assert eval_main([str(run), *args]) == 0, capsys.readouterr().err[-2000:]
    out = tmp_path / "rep"
    build_report([run], out, kernels=False)
    block = json.loads((out / "results.json").read_text())["tables"]["ppl"]["provenance"]["run"]
    assert block["accepted changes"] == (
        "config at step 2: trainer.steps: 2 -> 3; config at step 3: trainer.steps: 3 -> 4"
    )


# ------------------------------------------------------------------ a result copied from another run
def test_an_eval_json_copied_from_another_run_is_redone_by_the_pipeline_and_refused_by_the_report(tmp_path, capsys):
    import shutil

    from mta_repro.eval.run import main as eval_main
    from mta_repro.pipeline.done import done, torn
    from mta_repro.pipeline.job import Job
    from mta_repro.report.__main__ import main as report_main

    a, b = tmp_path / "a", tmp_path / "b"
    args = ["tasks=[ppl]", "ppl.seq_len=32", "ppl.max_batches=1", "ppl.domains=[book]"]
    for run in (a, b):  # two runs of one config: only their identity tells them apart
        _train(run)
        assert eval_main([str(run), *args]) == 0, capsys.readouterr().err[-2000:]
    ids = [json.loads((r / "provenance.json").read_text())["run_id"] for r in (a, b)]
    assert ids[0] != ids[1] and json.loads((a / "eval" / "ppl.json").read_text())["provenance"]["run_id"] == ids[0]
    job = Job("eval:b", "eval", b, [], steps=2, eval_tasks=["ppl"], eval_out=b / "eval")
    assert done(job) and torn(job) == []
    shutil.copy2(a / "eval" / "ppl.json", b / "eval" / "ppl.json")
    assert not done(job)  # the pipeline evaluates b again instead of "done, skipped"
    line = f"{b / 'eval' / 'ppl.json'} is not a result of {b}: it is a result of the weights of run {ids[0][:12]}"
    assert torn(job) == [f"{line}, not of this run ({ids[1][:12]})"]
    capsys.readouterr()
    assert report_main([str(a), str(b), "--out", str(tmp_path / "rep"), "--no-kernels"]) == 2
    err = _one_error_line(capsys.readouterr().err, "report")
    assert f"{b / 'eval' / 'ppl.json'}: not a result of {b}" in err and ids[0][:12] in err
    assert not (tmp_path / "rep" / "results.json").exists()


def test_a_result_of_another_variant_in_a_run_without_an_identity_is_refused(tmp_path, capsys):
    from mta_repro.report.__main__ import main as report_main

    run, _ = make_run(tmp_path / "mta", attention="mta")  # a run of a version that recorded no run_id
    f = _eval_json(run, "11" * 32)  # a baseline's result
    assert report_main([str(run), "--out", str(tmp_path / "rep"), "--no-kernels"]) == 2
    err = _one_error_line(capsys.readouterr().err, "report")
    assert f"{f}: not a result of {run}: it is a result of a baseline model, and this run trains mta" in err


# ------------------------------------------------------------------ a read-only run dir
def _read_only(path: Path, *args):
    """``python *args`` with ``path`` read-only: its mode 0555, or, for root (whom modes do
    not stop), a read-only bind mount of it in a mount namespace of the command's own."""
    import os
    import shutil
    import subprocess

    if os.geteuid() != 0:
        mode = path.stat().st_mode
        path.chmod(0o555)
        try:
            return _cli(*args)
        finally:
            path.chmod(mode)
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-rm", "true"]).returncode != 0:
        pytest.skip("root without user namespaces (unshare -rm): no way to make a folder read-only for root")
    script = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"'
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = ["unshare", "-rm", "sh", "-c", script, str(path), sys.executable, *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)


@pytest.mark.slow
def test_train_and_eval_refuse_a_read_only_run_dir_in_one_line_before_any_work(tmp_path):
    run = tmp_path / "run"
    _train(run)
    before = _snapshot(run)
    p = _read_only(run, "-m", "mta_repro.train", *TRAIN, f"run_dir={run}", "trainer.steps=3")
    assert p.returncode == 2, p.stderr[-3000:]
    line = _one_error_line(p.stderr, "train")
    assert f"run_dir={run}: {run} is not writable" in line and "another run_dir=" in line
    p = _read_only(run, "-m", "mta_repro.eval", str(run), "tasks=[ppl]", "ppl.seq_len=32", "ppl.max_batches=1")
    assert p.returncode == 2, p.stderr[-3000:]
    line = _one_error_line(p.stderr, "eval")
    assert f"eval: {run} is not writable" in line and f"the results go to {run / 'eval'}" in line
    assert "eval: ppl on" not in p.stderr  # refused before the model was loaded or a domain evaluated
    assert _snapshot(run) == before


# ------------------------------------------------------------------ the first loss line after a resume
def test_the_first_loss_line_after_a_resume_between_logging_steps_averages_the_steps_it_says(tmp_path):
    import shutil

    def rows(run):
        return {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}

    cadence = ["trainer.steps=8", "logging.every=4", "checkpoint.every=3", "checkpoint.keep=5"]
    whole, per_step = tmp_path / "whole", tmp_path / "per_step"
    _train(whole, *cadence)
    _train(per_step, "trainer.steps=8", "logging.every=1")  # the same run, a line per step
    losses = {s: r["loss"] for s, r in rows(per_step).items()}
    assert rows(whole)[8]["loss_steps"] == 4
    assert rows(whole)[8]["loss"] == pytest.approx(sum(losses[s] for s in range(5, 9)) / 4, abs=1e-6)
    # stopped after step 6 (checkpoint 6; logging steps 4 and 8): resume from there
    resumed = tmp_path / "resumed"
    shutil.copytree(whole, resumed)
    shutil.rmtree(resumed / "checkpoints" / f"{8:010d}")
    _train(resumed, *cadence)
    line = rows(resumed)[8]
    assert line["loss_steps"] == 4  # steps 5 and 6 from the checkpoint, 7 and 8 trained now
    assert line["loss"] == pytest.approx(sum(losses[s] for s in range(5, 9)) / 4, abs=1e-6)


# ------------------------------------------------------------------ the data of a benchmark row
@pytest.mark.lm_eval
def test_a_benchmark_row_names_the_sha256_of_the_local_task_file_it_was_scored_on(tmp_path):
    import hashlib
    import shutil

    from mta_repro.eval.lm_eval_tasks import write_local_task
    from mta_repro.eval.run import parse_argv, run
    from mta_repro.report.__main__ import build_report

    rows = tmp_path / "arc_easy_test.jsonl"  # a user's copy of the task's rows
    shutil.copy(ROOT / "data" / "lm_eval_demo" / "arc_easy_test.jsonl", rows)
    write_local_task("arc_easy", {"test": rows}, tmp_path / "tasks")
    run_dir, _ = make_run(tmp_path / "run", attention="baseline")
    args = ["tasks=[benchmarks]", "lm_eval.benchmarks=[arc_easy_local]", "lm_eval.limit=2"]
    written = run(parse_argv([str(run_dir), *args, f"lm_eval.include_path={tmp_path / 'tasks'}"]))
    data = json.loads(Path(written["benchmarks"]).read_text())["results"]["data"]
    sha = hashlib.sha256(rows.read_bytes()).hexdigest()
    assert data["arc_easy_local"]["files"] == [{"split": "test", "path": str(rows.resolve()), "sha256": sha}]
    out = tmp_path / "rep"
    build_report([run_dir], out, kernels=False)
    block = json.loads((out / "results.json").read_text())["tables"]["benchmarks"]["provenance"]["run"]
    assert block["data"].endswith(f"; task data arc_easy_test.jsonl {sha[:12]}"), block


def test_a_hub_task_records_its_pinned_revision_or_the_one_the_cache_resolved(tmp_path, monkeypatch):
    import huggingface_hub.constants

    from mta_repro.eval.lm_eval_tasks import task_data
    from mta_repro.report.tables import _lm_eval_data

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    pinned = {"dataset_path": "allenai/ai2_arc", "dataset_name": "ARC-Easy", "dataset_kwargs": {"revision": "ab" * 20}}
    assert task_data(pinned) == {"dataset": "allenai/ai2_arc", "name": "ARC-Easy", "revision": "ab" * 20}
    unpinned = {"dataset_path": "allenai/ai2_arc", "dataset_name": "ARC-Easy"}
    assert task_data(unpinned)["revision"] is None  # nothing cached: not known
    ref = tmp_path / "datasets--allenai--ai2_arc" / "refs" / "main"
    ref.parent.mkdir(parents=True)
    ref.write_text("cd" * 20)
    assert task_data(unpinned)["revision"] == "cd" * 20
    shown = _lm_eval_data({"arc_easy": task_data(unpinned), "piqa": {"dataset": "baber/piqa", "revision": None}})
    assert shown == f"; task data allenai/ai2_arc@{'cd' * 6}, baber/piqa@unpinned"
