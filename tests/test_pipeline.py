"""``python -m mta_repro.pipeline``: the tiny pipeline from an empty directory to the
tables on CPU (hand-offs, Appendix I check, data continued, report rows, a rerun that does
nothing), the SLURM chain against a stand-in sbatch, plans of the paper's configs."""

import csv
import io
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from mta_repro.pipeline.__main__ import build_plan, main
from mta_repro.pipeline.done import done
from mta_repro.train.config import compose

pytestmark = pytest.mark.pipeline

ROOT = Path(__file__).resolve().parents[1]


def _pipeline(*args, cwd=None, env=None, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "mta_repro.pipeline", *args],
        cwd=cwd or ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_pipeline") / "runs"
    p = _pipeline("pipeline=tiny", f"root={root}")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return root, p.stdout


def test_tiny_pipeline_hand_offs(tiny):
    root, out = tiny
    for v in ("baseline", "mta"):
        lc = OmegaConf.load(root / "long_context" / v / "config.yaml")
        # absolute hand-off to the same variant's pretraining run, fresh 4K-style settings
        assert lc.checkpoint.init_from == str(root / "pretrain" / v) and Path(lc.checkpoint.init_from).is_absolute()
        assert lc.data.seq_len == 2752 and lc.model.rope_theta == 500000
        assert lc.trainer.loader == "mta_repro.pipeline.data:build_continued_loader"
    ins = OmegaConf.load(root / "insertion" / "mta" / "config.yaml")
    assert ins.checkpoint.init_from == str(root / "pretrain" / "baseline")
    assert ins.checkpoint.init_mode == "baseline_to_mta"
    # warmup as a fraction of the few steps: the peak lr is reached (step 2 of 6 here)
    lrs = [json.loads(l)["lr"] for l in (root / "pretrain" / "mta" / "metrics.jsonl").read_text().splitlines()]
    assert max(lrs) == pytest.approx(3e-3)
    assert "report: done" in out or "report" in out


def test_tiny_pipeline_appendix_i_check(tiny):
    root, _ = tiny
    res = json.loads((root / "insertion" / "mta" / "appendix_i_check.json").read_text())
    assert res["ok"] and res["abs_diff"] <= res["tol"] == 1e-4
    # independent: the trainer's own first logged loss of the inserted model (step 1,
    # computed before any update) is the source's loss on the same first batch
    first = json.loads((root / "insertion" / "mta" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1 and first["loss"] == pytest.approx(res["source_loss"], abs=1e-4)
    # and the check fails loudly when the losses differ beyond the tolerance
    from mta_repro.pipeline.check import main as check_main

    plan, _ = build_plan(["pipeline=tiny", f"root={root}"])
    job = plan.job("check:insertion/mta")
    path = root / "insertion" / "mta" / "appendix_i_check.json"
    passed = path.read_bytes()
    try:
        assert check_main(list(job.overrides) + ["--tol=-1"]) == 1
        assert not json.loads(path.read_text())["ok"]
    finally:
        path.write_bytes(passed)  # leave it passing, as the pipeline wrote it (the rerun test reads it)


def test_tiny_pipeline_tables(tiny):
    root, _ = tiny
    rep = root / "report"
    rows = {r["run"]: r for r in csv.DictReader(io.StringIO((rep / "ppl.csv").read_text()))}
    assert set(rows) == {
        "pretrain/baseline",
        "pretrain/mta",
        "long_context/baseline",
        "long_context/mta",
        "insertion/mta",
    }
    # each stage measured at the context it was trained at; the paper's numbers are at 2048 /
    # 4096-token windows, so none is set beside these, and the row says why
    assert rows["long_context/mta"]["stage"] == "4K finetune" and rows["long_context/mta"]["window"] == "2752"
    assert rows["long_context/mta"]["trained"] == "2752" and rows["long_context/mta"]["paper avg"] == ""
    assert "window 2752 tokens, paper 4096" in rows["long_context/mta"]["vs paper"]
    assert rows["insertion/mta"]["stage"] == "MTA insertion" and rows["insertion/mta"]["window"] == "512"
    assert rows["pretrain/mta"]["paper avg"] == "" and rows["pretrain/mta"]["window"] == "512"
    assert rows["pretrain/mta"]["vs paper"].startswith("no: model dim 64 x 2 layers")
    # the finetune at 2752 validated the domains that hold a window and skipped arxiv
    val = [json.loads(x) for x in (root / "long_context" / "mta" / "metrics.jsonl").read_text().splitlines()]
    last = [m for m in val if "val_ppl" in m][-1]
    assert "val_ppl/arxiv" not in last and "val_ppl/book" in last and last["step"] == 1
    assert (
        "skipped domain(s) 'arxiv' (2,703 tokens)" in (root / "long_context" / "mta" / "pipeline_train.log").read_text()
    )
    d = float(rows["pretrain/mta"]["avg"]) - float(rows["pretrain/baseline"]["avg"])
    assert float(rows["pretrain/mta"]["Δ vs baseline"]) == pytest.approx(d, abs=1e-3)
    bench = list(csv.DictReader(io.StringIO((rep / "benchmarks.csv").read_text())))
    assert [b["run"] for b in bench] == ["pretrain/baseline", "pretrain/mta"] and "arc_easy (acc_norm)" in bench[0]
    md = (rep / "report.md").read_text()
    assert "arc_easy_local counted as arc_easy" in md and "lambada_openai_local counted as lambada_openai" in md
    assert "| pretrain/mta | MTA | generated | qa1 |" in md
    needle = list(csv.DictReader(io.StringIO((rep / "needle.csv").read_text())))
    assert {(n["run"], n["context"]) for n in needle} >= {("pretrain/mta", "256"), ("long_context/mta", "512")}
    res = json.loads((rep / "results.json").read_text())
    assert len(res["runs"]) == 5 and "babilong" in res["tables"]


def test_tiny_pipeline_data_continues_past_pretraining(tiny):
    root, _ = tiny
    from mta_repro.data import build_train_loader
    from mta_repro.pipeline.data import build_continued_loader, source_stream_state

    cfg = compose(build_plan(["pipeline=tiny", f"root={root}"])[0].job("train:long_context/mta").overrides)
    src = source_stream_state(root / "pretrain" / "mta", 0, 1)
    cont = build_continued_loader(cfg.data, 0, 1)
    fresh = build_train_loader(cfg.data, 0, 1)
    for d, s in cont.streams.items():
        assert s.state_dict()["line"] == src[d]["line"]  # where pretraining stopped
    assert sum(src[d]["line"] for d in src) > 0
    assert not torch.equal(next(cont)["input"], next(fresh)["input"])
    with pytest.raises(ValueError, match="needs checkpoint.init_from"):
        build_continued_loader(OmegaConf.create({"seq_len": 8}), 0, 1)
    with pytest.raises(ValueError, match="the same number of ranks"):
        source_stream_state(root / "pretrain" / "mta", 0, 2)


def test_tiny_pipeline_rerun_does_nothing(tiny):
    root, _ = tiny
    before = {p: p.stat().st_mtime for p in root.rglob("*") if p.is_file()}
    p = _pipeline("pipeline=tiny", f"root={root}", timeout=120)
    assert p.returncode == 0, p.stderr
    assert "nothing to do, all 12 jobs are done" in p.stdout
    after = {p: p.stat().st_mtime for p in root.rglob("*") if p.is_file()}
    assert after == before


def test_a_torn_eval_json_of_a_finished_pipeline_is_redone(tiny):
    """A kill or a full disk in the middle of writing an eval JSON: the rerun names the
    torn file, evaluates that task again (the others are up to date) and makes the report."""
    root, _ = tiny
    f = root / "pretrain" / "mta" / "eval" / "ppl.json"
    whole = json.loads(f.read_text())
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    p = _pipeline("pipeline=tiny", f"root={root}", timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert (
        f"pipeline: eval:pretrain/mta: {f} is there but not valid JSON (a write cut short?): redoing the job"
        in p.stdout
    )
    assert "pipeline: eval:pretrain/baseline: done, skipped" in p.stdout
    redone = json.loads(f.read_text())
    assert redone["results"]["average"] == pytest.approx(whole["results"]["average"])  # the same weights
    prov = redone["provenance"]
    assert prov["checkpoint"]["weights_sha256"] == whole["provenance"]["checkpoint"]["weights_sha256"]
    assert prov["checkpoint"]["step"] == 6 and prov["tokenizer"]["sha256"] and prov["validation"]["files"] == 1
    log = (root / "pretrain" / "mta" / "pipeline_eval.log").read_text().split("$ ")[-1]
    assert "eval: wrote" in log and log.count("is up to date") == 4  # needle, babilong, benchmarks, lambada
    md = (root / "report" / "report.md").read_text()
    assert "Provenance of the ppl rows" in md and "(!)" not in md


def test_unfinished_run_is_resumed_not_restarted(tiny, tmp_path):
    """A stage killed midway: the rerun trains on from its checkpoint (the trainer's
    resume), and the stages after it run."""
    root, _ = tiny
    import shutil

    copy = tmp_path / "runs"
    shutil.copytree(root / "pretrain", copy / "pretrain")
    # pretend the baseline was stopped after its step-3 checkpoint
    b = copy / "pretrain" / "baseline"
    shutil.rmtree(b / "export")
    shutil.rmtree(b / "checkpoints" / f"{6:010d}")
    plan, _ = build_plan(["pipeline=tiny", f"root={copy}"])
    assert not done(plan.job("train:pretrain/baseline")) and done(plan.job("train:pretrain/mta"))
    from mta_repro.pipeline.run import run_local

    train = plan.job("train:pretrain/baseline")
    plan.jobs = [train]  # only this job here; the full chain is covered above
    assert run_local(plan, log=lambda *_: None) == 0
    log = (b / "pipeline_train.log").read_text()
    assert "resumed from" in log and f"{3:010d}" in log
    assert done(train)


# ------------------------------------------------------------------ SLURM chain
def _fake_slurm(bin_dir: Path, log: Path, alive: str = ""):
    bin_dir.mkdir()
    sb = bin_dir / "sbatch"
    sb.write_text(f"""#!/bin/bash
n=$(( $(wc -l < {log} 2>/dev/null || echo 0) + 100 ))
echo "$n $*" >> {log}
echo "$n"
""")
    sq = bin_dir / "squeue"
    sq.write_text(f"#!/bin/bash\nfor j in {alive}; do echo $j; done\n")
    for f in (sb, sq):
        f.chmod(f.stat().st_mode | stat.S_IEXEC)


def test_slurm_submission_chains_stages(tmp_path, monkeypatch, capsys):
    log = tmp_path / "sbatch.log"
    log.touch()
    _fake_slurm(tmp_path / "bin", log)
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}
    root = tmp_path / "runs"
    fast = "pipeline.lm_eval_local=null"  # the chain is the point here, not lm-eval's task index
    p = _pipeline("pipeline=tiny", f"root={root}", "launcher=slurm", fast, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    calls = [l.split() for l in log.read_text().splitlines()]
    by_script = {c[-1]: (c[0], [a for a in c[1:-1] if a.startswith("--dependency")]) for c in calls}
    jid = lambda rel, kind: by_script[str(root / rel / "slurm" / f"pipeline_{kind}.sbatch")]  # noqa: E731
    assert len(calls) == 12
    assert jid("pretrain/mta", "train")[1] == []
    assert jid("long_context/mta", "train")[1] == [f"--dependency=afterok:{jid('pretrain/mta', 'train')[0]}"]
    chk = jid("insertion/mta", "check")
    assert chk[1] == [f"--dependency=afterok:{jid('pretrain/baseline', 'train')[0]}"]
    assert jid("insertion/mta", "train")[1] == [f"--dependency=afterok:{jid('pretrain/baseline', 'train')[0]}:{chk[0]}"]
    assert jid("pretrain/mta", "eval")[1] == [f"--dependency=afterok:{jid('pretrain/mta', 'train')[0]}"]
    report = by_script[str(root / "report" / "slurm" / "pipeline_report.sbatch")]
    assert len(report[1][0].split(":")) == 1 + 11  # after every other job
    script = (root / "long_context" / "mta" / "slurm" / "pipeline_train.sbatch").read_text()
    assert (
        f"checkpoint.init_from={root / 'pretrain' / 'mta'}" in script
        and f"run_dir={root / 'long_context' / 'mta'}" in script
    )
    ev = (root / "pretrain" / "mta" / "slurm" / "pipeline_eval.sbatch").read_text()
    assert f"-m mta_repro.eval {root / 'pretrain' / 'mta'}" in ev and "#SBATCH" in ev
    assert (
        subprocess.run(["bash", "-n", str(root / "pretrain" / "mta" / "slurm" / "pipeline_eval.sbatch")]).returncode
        == 0
    )
    # rerun while everything is still queued: nothing is submitted twice (in this process:
    # the command line ran above; this is the state file and squeue read back)
    alive = " ".join(c[0] for c in calls)
    (tmp_path / "bin" / "squeue").write_text(f"#!/bin/bash\nfor j in {alive}; do echo $j; done\n")
    monkeypatch.setenv("PATH", env["PATH"])
    assert main(["pipeline=tiny", f"root={root}", "launcher=slurm", fast]) == 0
    out = capsys.readouterr().out
    assert len(log.read_text().splitlines()) == 12 and out.count("still queued as job") == 12


# ------------------------------------------------------------------ plans
def test_paper_plan_dry_run(capsys):
    # in this process (the --dry-run command line itself runs in tests/test_llama3_configs.py)
    # --no-check: the paper's corpus and tokenizer are on the cluster, not here
    assert main(["pipeline=paper_880m", "root=/scratch/mta", "launcher=slurm", "--dry-run", "--no-check"]) == 0
    out = capsys.readouterr().out
    for v in ("baseline", "diff", "talking_heads", "mta"):
        assert f"train:pretrain/{v}" in out and f"train:long_context/{v}" in out
        assert f"checkpoint.init_from=/scratch/mta/pretrain/{v}" in out
    # every Table 5 sweep point is its own run, named by the swept values
    for point in (
        "kernel_4x7",
        "kernel_6x11",
        "gating_False_rescale_True",
        "conv_layers_2-10-18",
        "conv_layers_2-6-10-14-18-22",
    ):
        assert "/scratch/mta/ablation_" in out and f"{point} " in out, point
    assert "model.mta.mta_layers='\"'\"'2,10,18'\"'\"'" in out
    assert "--dependency=afterok:<train:pretrain/mta>" in out
    assert out.count("#!/bin/bash") == len([l for l in out.splitlines() if l.startswith("# ---- ")])
    # 4 pretrain + 4 finetune + 4 + 4 + 3 sweep points + the layer-norm-scaling run;
    # each evaluated; one report
    assert len([l for l in out.splitlines() if l.startswith("# ---- train:")]) == 20
    assert len([l for l in out.splitlines() if l.startswith("# ---- eval:")]) == 20


def test_plan_only_view_is_one_line_a_job(capsys):
    """--plan: the job table alone (the slurm --dry-run prints ~1,600 lines of scripts);
    a bare pipeline name means pipeline=<name>, an unknown one is a one-line error."""
    assert main(["paper_880m", "root=/scratch/mta", "launcher=slurm", "--plan", "--no-check"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "pipeline paper_880m: 41 jobs under /scratch/mta"
    jobs = lines[1:-1]
    assert len(jobs) == 41 and all(line.startswith("  [todo] ") for line in jobs)
    assert jobs[-1].split()[:2] == ["[todo]", "report"]
    assert lines[-1].startswith("(--dry-run adds each job's command")
    assert main(["paper880", "--plan"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pipeline: error: 'paper880' is neither an override (key=value) nor a pipeline name; ")
    assert "did you mean paper_880m?" in err and "\n" not in err
    from mta_repro.pipeline.__main__ import _bare_name

    assert _bare_name("~pipeline.lm_eval_local") == "~pipeline.lm_eval_local"  # Hydra's delete, not a name


def test_plan_errors_are_one_line():
    p = _pipeline("pipeline=tiny", "root=/tmp/x", "launcher=cloud", timeout=120)
    assert p.returncode == 2 and p.stderr.strip() == (
        "pipeline: error: launcher: expected one of ('local', 'slurm'), got 'cloud'"
    )
    assert main(["pipeline=tiny", "pipeline.variants=[mtaa]", "--dry-run"]) == 2
    assert main(["pipeline=tiny", "--bogus"]) == 2
    with pytest.raises(ValueError, match=r"pipeline.stages\[1\].init_from: 'nope' is not an earlier stage"):
        build_plan(["pipeline=tiny", "pipeline.stages.1.init_from=nope"])


def test_every_planned_run_records_its_stage_and_variant(tmp_path):
    """What each run of the tiny plan is, in the config it trains with (run.stage,
    run.variant: what the report reads), written out here from configs/pipeline/tiny.yaml."""
    want = {
        "pretrain/baseline": ("pretrain", "baseline"),
        "pretrain/mta": ("pretrain", "mta"),
        "long_context/baseline": ("long_context", "baseline"),  # the stage's kind
        "long_context/mta": ("long_context", "mta"),
        "insertion/mta": ("insertion", "mta"),  # no kind: checkpoint.init_mode=baseline_to_mta says
    }
    plan, _ = build_plan(["pipeline=tiny", f"root={tmp_path}"])
    trains = {j.label: j for j in plan.jobs if j.kind == "train"}
    assert set(trains) == set(want)
    for label, (stage, variant) in want.items():
        cfg = compose(trains[label].overrides)
        assert (cfg.run.stage, cfg.run.variant, cfg.run.point) == (stage, variant, None), label
    # the Appendix I check trains with the same record
    assert "run.stage=insertion" in plan.job("check:insertion/mta").overrides
    # a stage that starts from weights and says nothing of its kind is refused before any job
    with pytest.raises(ValueError, match=r"^pipeline.stages\[1\].kind: required for a run of baseline that starts "):
        build_plan(["pipeline=tiny", f"root={tmp_path}", "pipeline.stages.1.kind=null"])
    with pytest.raises(ValueError, match=r"^pipeline.stages\[1\].kind: 'finetune' is not a stage of the protocol"):
        build_plan(["pipeline=tiny", f"root={tmp_path}", "pipeline.stages.1.kind=finetune"])
    assert not any(tmp_path.iterdir())  # planning writes nothing


def test_a_sweep_point_records_its_name():
    plan, _ = build_plan(["pipeline=table5_small", "root=/tmp/x"])
    job = plan.job("train:ablation_kernels/kernel_4x7")
    cfg = compose(job.overrides)
    assert (cfg.run.stage, cfg.run.variant, cfg.run.point) == ("pretrain", "mta", "kernel_4x7")
    # the point's own values, as its name says
    assert (cfg.model.mta.query_kernel_size, cfg.model.mta.key_kernel_size) == (4, 7)
