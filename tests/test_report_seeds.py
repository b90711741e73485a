"""Reports over seeds, on fabricated result files with known answers: mean and std over
seeds, the seed-paired difference from the reference row with its 95% t-interval, the
one-seed bootstrap over evaluation windows, Wilson intervals of accuracies, unresolved
differences marked; the interval formulas against SciPy; plots that tell 12 runs
apart, band seeds, and name no curve that was not drawn."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from mta_repro.report import plots, stats
from mta_repro.report.__main__ import build_report

scipy_stats = pytest.importorskip("scipy.stats")

# per-seed average perplexity of each variant (seed-paired differences: mta clearly lower,
# diff within noise)
AVG = {"baseline": [10.0, 10.4, 9.8], "mta": [9.5, 9.7, 9.4], "diff": [10.1, 10.2, 9.9]}
DOMAINS = {"book": 1.2, "github": 0.8}  # each domain's ppl = avg x factor: their mean is avg


def _write_run(
    root: Path, variant: str, seed: int, avg: float, windows=None, needle=None, stage="pretrain", point=None
) -> Path:
    d = root / stage / (point or variant) / f"seed{seed}"
    (d / "eval").mkdir(parents=True)
    domains = {}
    for name, f in DOMAINS.items():
        ppl = avg * f
        ce, tok = windows[name] if windows else ([math.log(ppl) * 8] * 4, [8] * 4)
        domains[name] = {"ppl": ppl, "loss": math.log(ppl), "tokens": sum(tok), "batch_ce": ce, "batch_tokens": tok}
    res = {"domains": domains, "average": sum(v["ppl"] for v in domains.values()) / len(domains), "seq_len": 8}
    seeds = {"seed": seed, "init": {"seed": seed}, "data_order": {"seed": seed}}
    prov = {"run": {"seeds": seeds}}
    common = {"variant": variant, "step": 10, "provenance": prov}
    (d / "eval" / "ppl.json").write_text(json.dumps({"task": "ppl", **common, "results": res}))
    if needle is not None:
        acc = {"256": {"2": {"by_depth": {"0": float(np.mean(needle))}, "mean": float(np.mean(needle))}}}
        acc["256"]["2"]["scores"] = {"0": needle}
        (d / "eval" / "needle.json").write_text(json.dumps({"task": "needle", **common, "results": {"accuracy": acc}}))
    with open(d / "metrics.jsonl", "w") as f:
        for s in range(1, 11):
            f.write(json.dumps({"step": s, "loss": avg / s**0.3 + 0.01 * seed}) + "\n")
    return d


def _report(root: Path, runs) -> dict:
    labels = {str(d): str(d.relative_to(root)) for d in runs}
    build_report(runs, root / "report", kernels=False, labels=labels)
    return json.loads((root / "report" / "results.json").read_text())


def test_three_seeds_mean_std_and_paired_t_interval(tmp_path):
    runs = [_write_run(tmp_path, v, k, AVG[v][k]) for v in AVG for k in range(3)]
    out = _report(tmp_path, runs)
    rows = {r["run"]: r for r in out["tables"]["ppl_seeds"]["rows"]}
    assert set(rows) == {"pretrain/baseline", "pretrain/mta", "pretrain/diff"}
    for v, vals in AVG.items():
        r = rows[f"pretrain/{v}"]
        assert r["seeds"] == "0,1,2"
        assert r["avg ppl (mean)"] == pytest.approx(sum(vals) / 3, abs=1e-12)
        assert r["std"] == pytest.approx(float(np.std(vals, ddof=1)), abs=1e-12)
    assert rows["pretrain/baseline"]["95% CI excludes 0"] == "reference"
    for v, resolved in (("mta", "yes"), ("diff", "no")):
        diffs = np.array(AVG[v]) - np.array(AVG["baseline"])
        lo, hi = scipy_stats.t.interval(0.95, 2, loc=diffs.mean(), scale=scipy_stats.sem(diffs))
        r = rows[f"pretrain/{v}"]
        assert r["Δ avg ppl vs reference"] == pytest.approx(diffs.mean(), abs=1e-12)
        assert (r["95% lo"], r["95% hi"]) == (pytest.approx(lo, abs=1e-9), pytest.approx(hi, abs=1e-9))
        assert r["95% CI excludes 0"] == resolved and r["interval"] == "t over 3 paired seeds (2 df)"
    md = (tmp_path / "report" / "report.md").read_text()
    assert "Validation perplexity over seeds" in md and "no" in md
    # the per-run table compares each seed with the baseline of the same seed
    per_run = {r["run"]: r for r in out["tables"]["ppl"]["rows"]}
    for k in range(3):
        assert per_run[f"pretrain/mta/seed{k}"]["Δ vs baseline"] == pytest.approx(AVG["mta"][k] - AVG["baseline"][k])
    # the provenance block names every run's seeds behind each row, here and in the per-run table
    prov = out["tables"]["ppl_seeds"]["provenance"]["pretrain/mta"]["seed"]
    assert prov == "; ".join(f"seed {k} (init {k}, data {k})" for k in range(3))
    assert out["tables"]["ppl"]["provenance"]["pretrain/mta/seed1"]["seed"] == "seed 1 (init 1, data 1)"


def test_one_seed_difference_gets_a_labelled_bootstrap_over_windows(tmp_path):
    rng = np.random.default_rng(0)
    n = 60
    base_loss = rng.normal(2.3, 0.3, n)  # per-token loss of each window
    windows_b = {"book": ([float(x) * 8 for x in base_loss], [8] * n)}
    for name in DOMAINS:
        windows_b.setdefault(name, windows_b["book"])
    runs = []
    for variant, shift in (("baseline", 0.0), ("mta", -0.05), ("diff", 0.0)):
        noise = rng.normal(0.0, 0.01 if variant == "mta" else 0.2, n)
        lw = base_loss + shift + noise
        w = {name: ([float(x) * 8 for x in lw], [8] * n) for name in DOMAINS}
        avg = float(np.mean([math.exp(lw.mean()) for _ in DOMAINS]))
        d = _write_run(tmp_path, variant, 0, avg, windows=w)
        # the results as the eval writes them: each domain's ppl from its windows
        data = json.loads((d / "eval" / "ppl.json").read_text())
        for name in DOMAINS:
            data["results"]["domains"][name]["ppl"] = math.exp(lw.mean())
        data["results"]["average"] = math.exp(lw.mean())
        (d / "eval" / "ppl.json").write_text(json.dumps(data))
        runs.append((variant, d, lw))
    out = _report(tmp_path, [d for _, d, _ in runs])
    rows = {r["run"]: r for r in out["tables"]["ppl_seeds"]["rows"]}
    lw = {v: x for v, _, x in runs}
    for variant in ("mta", "diff"):
        r = rows[f"pretrain/{variant}"]
        assert r["interval"] == f"bootstrap over {2 * n} eval windows (1 seed)"
        # both domains hold the same windows: the stratified bootstrap's statistic is the one domain's
        ref = scipy_stats.bootstrap(
            (lw[variant], lw["baseline"]),
            lambda a, b: np.exp(a.mean()) - np.exp(b.mean()),
            paired=True,
            vectorized=False,
            n_resamples=4000,
            method="percentile",
            random_state=1,
        ).confidence_interval
        width = ref.high - ref.low
        assert r["95% lo"] == pytest.approx(ref.low, abs=0.25 * width)
        assert r["95% hi"] == pytest.approx(ref.high, abs=0.25 * width)
    assert rows["pretrain/mta"]["95% CI excludes 0"] == "yes"
    assert rows["pretrain/diff"]["95% CI excludes 0"] == "no"
    assert rows["pretrain/baseline"]["interval"].startswith("avg ppl itself: [")


def test_needle_accuracy_gets_wilson_and_a_paired_interval(tmp_path):
    rng = np.random.default_rng(3)
    base = [float(x) for x in (rng.random(80) < 0.3)]
    better = [1.0 if b == 1.0 or rng.random() < 0.5 else 0.0 for b in base]
    runs = [
        _write_run(tmp_path, "baseline", 0, 10.0, needle=base),
        _write_run(tmp_path, "mta", 0, 9.0, needle=better),
    ]
    out = _report(tmp_path, runs)
    rows = {r["run"]: r for r in out["tables"]["needle_seeds"]["rows"]}
    for name, scores in (("pretrain/baseline", base), ("pretrain/mta", better)):
        ci = scipy_stats.binomtest(int(sum(scores)), len(scores)).proportion_ci(0.95, method="wilson")
        r = rows[name]
        assert r["samples"] == 80 and r["accuracy % (mean)"] == pytest.approx(100 * np.mean(scores))
        assert r["Wilson 95% lo"] == pytest.approx(100 * ci.low, abs=1e-9)
        assert r["Wilson 95% hi"] == pytest.approx(100 * ci.high, abs=1e-9)
    r = rows["pretrain/mta"]
    assert r["Δ vs reference (points)"] == pytest.approx(100 * (np.mean(better) - np.mean(base)))
    assert r["95% lo"] > 0 and r["95% CI excludes 0"] == "yes"
    assert r["interval"] == "bootstrap over 80 distinct paired prompts (1 seed)"


@pytest.mark.parametrize("effect", [0.3, 0.8, 1.5])
def test_seeds_for_power_against_simulated_paired_t_tests(effect):
    """The seeds 80% power needs: the power a float64 simulation of paired t-tests gives
    at that n is >= 80% and at n - 1 below it (tolerance: the simulation's own SE), and
    n is within one of the normal approximation with Guenther's correction."""
    n = stats.seeds_for_power(effect, 1.0)
    assert n is not None and n >= 2
    z = scipy_stats.norm.ppf
    approx = ((z(0.975) + z(0.8)) / effect) ** 2 + z(0.975) ** 2 / 2
    assert abs(n - approx) <= 1.5
    rng = np.random.default_rng(7)

    def simulated(k, sims=40_000):
        x = rng.normal(effect, 1.0, size=(sims, k))
        t = x.mean(1) / (x.std(1, ddof=1) / math.sqrt(k))
        return float(np.mean(np.abs(t) > scipy_stats.t.ppf(0.975, k - 1)))

    tol = 3 * math.sqrt(0.8 * 0.2 / 40_000)
    assert simulated(n) >= 0.8 - tol
    if n > 2:
        assert simulated(n - 1) < 0.8 + tol
    assert stats.seeds_for_power(0.0, 1.0) is None and stats.seeds_for_power(1.0, 0.0) is None


def test_holm_against_a_float64_step_down():
    p = [0.01, 0.04, 0.03, 0.005]
    order = np.argsort(p)
    expect = np.empty(4)
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (4 - rank) * p[i]))
        expect[i] = running
    assert stats.holm(p) == pytest.approx(list(expect), abs=1e-15)
    assert stats.holm(p) == pytest.approx([0.03, 0.06, 0.06, 0.02], abs=1e-15)


def test_plots_tell_twelve_runs_apart_and_band_seeds(tmp_path, monkeypatch):
    colours = plots.palette(12)
    assert len({tuple(round(c, 3) for c in rgba) for rgba in colours}) == 12
    assert len({tuple(round(c, 3) for c in rgba) for rgba in plots.palette(25)}) == 25
    figs = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figs.append(fig) or path)
    runs = [_write_run(tmp_path, v, k, AVG[v][k]) for v in AVG for k in range(3)]
    build_report(runs, tmp_path / "report", kernels=False, labels={str(d): str(d.relative_to(tmp_path)) for d in runs})
    (loss_fig,) = [f for f in figs if f.axes and f.axes[0].get_title() == "Training and validation loss"]
    ax = loss_fig.axes[0]
    texts = [t.get_text() for leg in [*ax.artists, ax.get_legend()] for t in leg.get_texts()]
    assert [t for t in texts if t.startswith("pretrain/")] == [f"pretrain/{v} (3 seeds)" for v in AVG]
    # no run logged validation during training: the legend names no such curve
    assert not any("validation during training" in t for t in texts)
    assert any(t.startswith("training loss (seeds: mean") for t in texts)
    assert len(ax.collections) == 3  # one band per group of seeds


def _bench_run(root: Path, variant: str, piqa: float, arc: float) -> Path:
    d = _write_run(root, variant, 0, 10.0)
    res = {
        "tasks": {
            "piqa": {"acc_norm,none": piqa / 100, "acc_norm_stderr,none": 0.02},
            "arc_easy_local": {"acc,none": arc / 100},
        },
        "summary": {"piqa": piqa, "arc_easy_local": arc, "average": (piqa + arc) / 2},
        "metrics": {"piqa": "acc_norm", "arc_easy_local": "acc"},
        "n_samples": {"piqa": 500, "arc_easy_local": 200},
    }
    (d / "eval" / "benchmarks.json").write_text(
        json.dumps({"task": "benchmarks", "variant": variant, "step": 10, "results": res})
    )
    return d


def test_benchmark_accuracy_intervals_use_lm_eval_stderr_else_wilson(tmp_path):
    runs = [_bench_run(tmp_path, "baseline", 60.0, 30.0), _bench_run(tmp_path, "mta", 70.0, 31.0)]
    out = _report(tmp_path, runs)
    rows = {(r["run"], r["task"]): r for r in out["tables"]["benchmarks_seeds"]["rows"]}
    z = scipy_stats.norm.ppf(0.975)
    piqa = rows["pretrain/mta", "piqa"]
    assert (piqa["95% lo"], piqa["95% hi"]) == (pytest.approx(70.0 - 2.0 * z), pytest.approx(70.0 + 2.0 * z))
    assert piqa["accuracy interval"] == "lm-eval stderr"
    # the difference: both stderrs added (unpaired), 10 points against 2 * sqrt(2) * z
    assert piqa["Δ vs reference (points)"] == pytest.approx(10.0)
    assert piqa["Δ 95% lo"] == pytest.approx(10.0 - z * math.sqrt(8.0)) and piqa["95% CI excludes 0"] == "yes"
    arc = rows["pretrain/baseline", "arc_easy_local"]
    ci = scipy_stats.binomtest(60, 200).proportion_ci(0.95, method="wilson")
    assert (arc["95% lo"], arc["95% hi"]) == (pytest.approx(100 * ci.low), pytest.approx(100 * ci.high))
    assert arc["accuracy interval"] == "Wilson, n=200" and arc["95% CI excludes 0"] == "reference"
    arc_mta = rows["pretrain/mta", "arc_easy_local"]
    se = [math.sqrt(p * (100 - p) / 200) for p in (31.0, 30.0)]
    assert arc_mta["Δ 95% hi"] == pytest.approx(1.0 + z * math.hypot(*se)) and arc_mta["95% CI excludes 0"] == "no"


def test_each_sweep_stage_is_compared_with_its_own_first_point(tmp_path):
    runs = [
        _write_run(tmp_path, "mta", k, avg + 0.1 * k, stage=stage, point=point)
        for stage, points in (
            ("ablation_kernels", {"kernel_4x7": 10.0, "kernel_6x11": 9.0}),
            ("ablation_gating", {"on": 12.0, "off": 12.5}),
        )
        for point, avg in points.items()
        for k in range(2)
    ]
    out = _report(tmp_path, runs)
    rows = {r["run"]: r for r in out["tables"]["ppl_seeds"]["rows"]}
    assert (
        rows["ablation_kernels/kernel_4x7"]["95% CI excludes 0"]
        == rows["ablation_gating/on"]["95% CI excludes 0"]
        == "reference"
    )
    assert rows["ablation_kernels/kernel_6x11"]["Δ avg ppl vs reference"] == pytest.approx(-1.0)
    assert rows["ablation_gating/off"]["Δ avg ppl vs reference"] == pytest.approx(0.5)
    # the same difference at both seeds: no spread, no interval (not a zero-width one)
    off = rows["ablation_gating/off"]
    assert off["95% lo"] is None and off["95% hi"] is None
    assert off["95% CI excludes 0"] == "undefined" and off["interval"].startswith("undefined")
