"""configs/pipeline/table5_small.yaml: the Table 5 sweeps at small scale on CPU. Every
point is its own run with its own swept values, trains with a learning rate that leaves
warmup (the experiments' 375-step warmup would keep a 100-step run at lr ~ 0, so every
point gave the same loss), is evaluated and lands in the report's ablation table."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mta_repro.pipeline.__main__ import build_plan
from mta_repro.train.config import compose, model_args_from
from mta_repro.train.optim import OptimArgs, lr_factor, warmup_steps

ROOT = Path(__file__).resolve().parents[1]
POINTS = {  # stage -> the points Table 5 sweeps (configs/experiment/ablation_*.yaml), named by run dir
    "ablation_gating_norm": {
        "gating_True_rescale_False",
        "gating_True_rescale_True",
        "gating_False_rescale_False",
        "gating_False_rescale_True",
    },
    "ablation_kernels": {"kernel_4x7", "kernel_4x11", "kernel_6x7", "kernel_6x11"},
    # 10 layers: every 4th from layer 2, every 8th from layer 2, all
    "ablation_conv_layers": {"conv_layers_2-6", "conv_layers_2", "conv_layers_0-1-2-3-4-5-6-7-8-9"},
    "ablation_layer_norm_scaling": {"mta"},
}


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    plan, _ = build_plan(["pipeline=table5_small", f"root={tmp_path_factory.mktemp('t5')}"])
    return plan


def _train_cfg(job):
    # the job's own command line, composed as the trainer will (hydra.mode is the launcher's)
    return compose([o for o in job.overrides if not o.startswith("hydra.")])


def test_every_point_is_planned_trained_evaluated_and_reported(plan):
    trains = [j for j in plan.jobs if j.kind == "train"]
    got = {}
    for j in trains:
        stage, point = j.label.split("/")
        got.setdefault(stage, set()).add(point)
        assert j.run_dir == plan.root / stage / point
    assert got == POINTS
    evals = {j.label for j in plan.jobs if j.kind == "eval"}
    assert evals == {j.label for j in trains}
    (report,) = [j for j in plan.jobs if j.kind == "report"]
    assert sorted(report.runs) == sorted(j.run_dir for j in trains)


def test_every_point_trains_past_warmup_with_its_swept_values(plan):
    seen = set()
    for j in (j for j in plan.jobs if j.kind == "train"):
        cfg = _train_cfg(j)
        steps = int(cfg.trainer.steps)
        optim = OptimArgs(**{k: v for k, v in cfg.optim.items()})
        warm = warmup_steps(optim, steps)
        assert 0 < warm < steps // 2, (j.label, warm, steps)
        # the learning rate reaches its peak, and is still above half of it a third into the run
        assert lr_factor(warm, optim, steps) == pytest.approx(1.0)
        assert lr_factor(steps // 3, optim, steps) > 0.5
        assert cfg.trainer.device == "cpu" and cfg.data.seq_len <= 128
        m = model_args_from(cfg).mta
        seen.add(
            (
                m.add_gating,
                m.layer_norm_rescale,
                m.query_kernel_size,
                m.key_kernel_size,
                m.after_sm_query_kernel_size,
                m.after_sm_key_kernel_size,
                m.mta_layers,
                m.curse_norm,
            )
        )
        stage, point = j.label.split("/")
        if stage == "ablation_kernels":
            q, k = point.split("_")[1].split("x")
            assert (m.query_kernel_size, m.key_kernel_size) == (int(q), int(k))
            assert (m.after_sm_query_kernel_size, m.after_sm_key_kernel_size) == (int(q), int(k))
        if stage == "ablation_conv_layers":
            assert m.mta_layers.replace(",", "-") == point.removeprefix("conv_layers_")
        assert m.curse_norm == (stage == "ablation_layer_norm_scaling")
    # every point a distinct model (the gating/rescale sweep's (True, False) point is the
    # release MTA, as is kernel 6x11 and conv layers 2,6: three equal configs by design)
    assert len(seen) == 12 - 2


@pytest.mark.slow
def test_two_points_end_to_end(plan, tmp_path):
    """The kernel 4x7 and 4x11 points for 4 steps each: trained, evaluated, tabled side by
    side in the ablation table (which appears once runs differ in their attention config)."""
    avgs = []
    for point in ("kernel_4x7", "kernel_4x11"):
        train = plan.job(f"train:ablation_kernels/{point}")
        run_dir = tmp_path / point
        # the planned run_dir= swapped for this test's, wherever the plan put it (run.* follow it)
        (i,) = [i for i, a in enumerate(train.command) if a.startswith("run_dir=")]
        cmd = [*train.command[:i], f"run_dir={run_dir}", *train.command[i + 1 :]]
        cmd += ["trainer.steps=4", "checkpoint.every=4", "logging.every=1"]
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        losses = [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert len(losses) == 4 and losses[-1] < losses[0]  # the lr is not ~0: the loss moves
        ev = plan.job(f"eval:ablation_kernels/{point}")
        cmd = [ev.command[0], "-m", "mta_repro.eval", str(run_dir), *ev.command[4:], "ppl.max_batches=1"]
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        avgs.append(json.loads((run_dir / "eval" / "ppl.json").read_text())["results"]["average"])
    out = tmp_path / "report"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "mta_repro.report",
            str(tmp_path / "kernel_4x7"),
            str(tmp_path / "kernel_4x11"),
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    tables = json.loads((out / "results.json").read_text())["tables"]
    ablations = tables["ablations"] if isinstance(tables, dict) else next(t for t in tables if t["name"] == "ablations")
    rows = ablations["rows"] if isinstance(ablations, dict) else ablations
    for avg in avgs:
        assert any(isinstance(v, float) and v == pytest.approx(avg) for r in rows for v in r.values()), rows
