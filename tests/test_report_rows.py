"""What a row over seeds counts, on fabricated run dirs with known answers (a copied run
dir, a missing result, seeds paired across runs, and the statistics): a copied run dir and a seed
mislabelled are refused (rc 2, nothing written); a run without a result is named and
left out of the mean and of the interval; differences pair only common seeds; a multirun
seeds axis is one row without --label; the evaluation set's standard error with documents
as blocks and the two-level bootstrap against an independent float64 computation; the
token-weighted loss; Holm; distinct needle prompts; zero-variance differences undefined;
named contrasts with the seeds 80% power needs."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from mta_repro.report import stats
from mta_repro.report.__main__ import build_report, main

scipy_stats = pytest.importorskip("scipy.stats")


def _run(
    root: Path,
    variant: str,
    seed: int,
    avg: float,
    *,
    windows: dict | None = None,
    docs: dict | None = None,
    rid: str | None = None,
    rec_seed: int | None = None,
    needle: dict | None = None,
    sub: str | None = None,
) -> Path:
    """A run dir ``root/pretrain/<variant>/seed<seed>`` (or ``root/<sub>``) with an
    eval/ppl.json whose two domains have perplexity ``avg`` (or the given windows: per
    domain (nats per window, tokens per window)), and the run id and seed it recorded."""
    d = root / (sub or f"pretrain/{variant}/seed{seed}")
    (d / "eval").mkdir(parents=True)
    rid = rid or f"{variant}-{seed}-{sub}"
    rec = seed if rec_seed is None else rec_seed
    domains = {}
    for name in ("book", "github"):
        ce, tok = (windows or {}).get(name) or ([math.log(avg) * 8] * 4, [8] * 4)
        v = {"ppl": math.exp(sum(ce) / sum(tok)), "loss": sum(ce) / sum(tok), "tokens": sum(tok)}
        v.update(batch_ce=list(ce), batch_tokens=list(tok))
        if docs and name in docs:
            v["batch_doc"] = docs[name]
        domains[name] = v
    res = {"domains": domains, "average": float(np.mean([v["ppl"] for v in domains.values()])), "seq_len": 8}
    prov = {"run_id": rid, "run": {"seeds": {"seed": rec, "init": {"seed": rec}, "data_order": {"seed": rec}}}}
    common = {"variant": variant, "step": 10, "provenance": prov}
    (d / "eval" / "ppl.json").write_text(json.dumps({"task": "ppl", **common, "results": res}))
    (d / "provenance.json").write_text(json.dumps({"format": 1, "run_id": rid}))
    if needle is not None:
        (d / "eval" / "needle.json").write_text(
            json.dumps({"task": "needle", **common, "results": {"accuracy": {"256": {"2": needle}}}})
        )
    (d / "metrics.jsonl").write_text(json.dumps({"step": 10, "loss": math.log(avg)}) + "\n")
    return d


def _report(root: Path, runs, labels: bool = True, contrasts=()) -> dict:
    lab = {str(d): str(d.relative_to(root)) for d in runs} if labels else None
    build_report(runs, root / "report", kernels=False, labels=lab, contrasts=contrasts)
    return json.loads((root / "report" / "results.json").read_text())


def _rows(out: dict, table: str) -> dict:
    return {r["run"]: r for r in out["tables"][table]["rows"]}


def _refused(capsys, argv, out: Path) -> str:
    assert main([*argv, "--out", str(out), "--no-kernels"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("report: error:")
    assert not out.exists()  # nothing written
    return err[0]


def test_a_copied_run_dir_is_refused_not_counted_as_another_seed(tmp_path, capsys):
    """cp -a seed0 seed2 used to say 't over 3 paired seeds'."""
    runs = [_run(tmp_path, v, k, 10.0 + k + (v == "mta")) for v in ("baseline", "mta") for k in (0, 1)]
    copy = tmp_path / "pretrain/mta/seed2"
    shutil.copytree(runs[2], copy)
    argv = [str(d) for d in runs] + [str(copy)]
    labels = [f"--label={d}={d.relative_to(tmp_path)}" for d in [*runs, copy]]
    line = _refused(capsys, argv + labels, tmp_path / "report")
    assert "run id mta-0" in line and str(copy) in line and str(runs[2]) in line


def test_a_run_whose_recorded_seed_is_not_its_labels_is_refused(tmp_path, capsys):
    d = _run(tmp_path, "mta", 2, 10.0, rec_seed=1)
    line = _refused(capsys, [str(d), f"--label={d}=pretrain/mta/seed2"], tmp_path / "report")
    assert "labelled seed 2" in line and "recorded seed 1" in line


def test_a_run_without_a_result_is_named_and_left_out_of_mean_and_interval(tmp_path):
    """A deleted ppl.json or a null average left 'seeds 0,1' in the row
    while the mean was the other seed's, and a one-seed bootstrap paired another seed."""
    base = {0: 10.0, 1: 11.0, 2: 10.5}
    mta = {0: 9.0, 1: 9.7, 2: 9.6}
    runs = [_run(tmp_path, "baseline", k, v) for k, v in base.items()]
    runs += [_run(tmp_path, "mta", k, v) for k, v in mta.items()]
    (runs[4] / "eval" / "ppl.json").unlink()  # seed 1: what a failed eval job leaves
    data = json.loads((runs[5] / "eval" / "ppl.json").read_text())
    data["results"]["average"] = None  # seed 2: a null average
    (runs[5] / "eval" / "ppl.json").write_text(json.dumps(data))
    out = _report(tmp_path, runs)
    r = _rows(out, "ppl_seeds")["pretrain/mta"]
    assert (r["seeds"], r["no result"], r["n (mean)"]) == ("0", "1,2", 1)
    assert r["avg ppl (mean)"] == pytest.approx(mta[0], rel=1e-12) and r["std"] is None
    # the difference: seed 0 against seed 0 only, a bootstrap over its windows
    assert r["Δ seeds"] == "0" and r["n (Δ)"] == 1
    assert r["Δ avg ppl vs reference"] == pytest.approx(mta[0] - base[0], rel=1e-12)
    assert r["interval"].startswith("undefined")  # every window of both runs is equal: no spread
    md = (tmp_path / "report" / "report.md").read_text()
    assert "no result" in md


def test_differences_pair_only_the_seeds_both_rows_have(tmp_path):
    """MTA {0,1,2} against a baseline at {0,1}; MTA {1} against {0}."""
    base = {0: 10.0, 1: 11.0}
    mta = {0: 9.0, 1: 10.6, 2: 4.0}
    runs = [_run(tmp_path, "baseline", k, v) for k, v in base.items()]
    runs += [_run(tmp_path, "mta", k, v) for k, v in mta.items()]
    runs += [_run(tmp_path, "diff", 1, 12.0)]
    out = _report(tmp_path, runs)
    rows = _rows(out, "ppl_seeds")
    r = rows["pretrain/mta"]
    assert (r["seeds"], r["n (mean)"], r["Δ seeds"], r["n (Δ)"], r["df"]) == ("0,1,2", 3, "0,1", 2, 1)
    assert r["avg ppl (mean)"] == pytest.approx(np.mean(list(mta.values())), rel=1e-12)
    diffs = np.array([mta[0] - base[0], mta[1] - base[1]])
    lo, hi = scipy_stats.t.interval(0.95, 1, loc=diffs.mean(), scale=scipy_stats.sem(diffs))
    assert r["Δ avg ppl vs reference"] == pytest.approx(diffs.mean(), rel=1e-12)
    assert (r["95% lo"], r["95% hi"]) == (pytest.approx(lo, rel=1e-9), pytest.approx(hi, rel=1e-9))
    assert r["SE seeds"] == pytest.approx(scipy_stats.sem(diffs), rel=1e-12)
    d = rows["pretrain/diff"]  # seed 1 only, the baseline has seeds 0 and 1: seed 1 against seed 1
    assert d["Δ seeds"] == "1" and d["Δ avg ppl vs reference"] == pytest.approx(12.0 - base[1], rel=1e-12)
    # the per-run table never compares mta/seed2 with another seed's baseline
    per_run = {x["run"]: x for x in out["tables"]["ppl"]["rows"]}
    assert per_run["pretrain/mta/seed2"]["Δ vs baseline"] is None
    assert per_run["pretrain/mta/seed1"]["Δ vs baseline"] == pytest.approx(mta[1] - base[1], rel=1e-12)


def test_disjoint_seeds_get_no_interval(tmp_path):
    runs = [_run(tmp_path, "baseline", 0, 10.0), _run(tmp_path, "mta", 1, 9.0)]
    r = _rows(_report(tmp_path, runs), "ppl_seeds")["pretrain/mta"]
    assert r["Δ avg ppl vs reference"] is None and r["95% lo"] is None and r["interval"] == "no seed in common"


def _multirun(root: Path, name: str, attention: str, seed: int, avg: float) -> Path:
    sub = f"runs/{name}/seed{seed}"
    d = _run(root, attention, seed, avg, sub=sub)
    run_dir = str(root / sub)
    cfg = {
        "run_dir": run_dir,
        "seed": seed,
        "model": {"seed": seed, "dim": 64, "n_layers": 2, "n_heads": 4, "mta": {"use_mta": attention == "mta"}},
        "data": {"seed": seed, "seq_len": 8},
        "logging": {"dir": run_dir + "/logs"},
        "run": {"stage": "pretrain", "variant": attention, "point": None},
    }
    import yaml

    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    return d


def test_a_multirun_seeds_axis_is_one_row_without_label(tmp_path):
    """``'seed=0,1' 'run_dir=runs/x/seed${seed}'``: used to show seed 1 as a difference from
    seed 0 unless given --label."""
    base = {0: 10.0, 1: 11.0, 2: 10.4}
    mta = {0: 9.0, 1: 10.1, 2: 9.9}
    runs = [_multirun(tmp_path, "base", "baseline", k, v) for k, v in base.items()]
    runs += [_multirun(tmp_path, "x", "mta", k, v) for k, v in mta.items()]
    rows = _rows(_report(tmp_path, runs, labels=False), "ppl_seeds")
    assert set(rows) == {"base", "x"}
    r = rows["x"]
    assert r["seeds"] == "0,1,2" and r["Δ seeds"] == "0,1,2"
    diffs = np.array([mta[k] - base[k] for k in base])
    lo, hi = scipy_stats.t.interval(0.95, 2, loc=diffs.mean(), scale=scipy_stats.sem(diffs))
    assert (r["95% lo"], r["95% hi"]) == (pytest.approx(lo, rel=1e-9), pytest.approx(hi, rel=1e-9))


def _block_windows(rng, n_docs: int, per_doc: int, shift: float, noise: float, doc_effect):
    """Per-token loss of each window: a document effect shared by the document's windows
    (what makes them one block), the variant's shift, window noise; 8 tokens a window."""
    lw = np.repeat(doc_effect, per_doc) + shift + rng.normal(0, noise, n_docs * per_doc)
    return [float(x) * 8 for x in lw], [8] * (n_docs * per_doc)


def test_eval_set_error_uses_documents_as_blocks_and_a_two_level_bootstrap(tmp_path):
    """One fixed set of windows shared by every seed (30 documents of 2 windows each, in
    both domains); the difference's per-document effect varies, so the window-level SE
    understates it by about sqrt(2). The report's SE over the evaluation set and its
    two-level interval against an independent float64 computation."""
    rng = np.random.default_rng(11)
    n_docs, per_doc, seeds = 30, 2, (0, 1, 2, 3)
    doc_base = rng.normal(2.5, 0.4, n_docs)
    doc_gain = rng.normal(-0.05, 0.08, n_docs)  # MTA's gain differs per document
    docs = {name: [f"{name}.jsonl:{i}" for i in range(n_docs) for _ in range(per_doc)] for name in ("book", "github")}
    runs, lw = [], {}
    for k in seeds:
        seed_shift = rng.normal(0, 0.01)
        for v, gain in (("baseline", np.zeros(n_docs)), ("mta", doc_gain)):
            w = {}
            for name in ("book", "github"):
                ce, tok = _block_windows(rng, n_docs, per_doc, seed_shift * (v == "mta"), 0.002, doc_base + gain)
                w[name] = (ce, tok)
            runs.append(_run(tmp_path, v, k, 0.0 + 1.0, windows=w, docs=docs))
            lw[v, k] = {name: np.array(w[name][0]) / 8 for name in w}
    out = _report(tmp_path, runs)
    r = _rows(out, "loss_seeds")["pretrain/mta"]
    # independent: per document, the difference in mean loss (both domains pooled, equal tokens),
    # averaged over seeds; the bootstrap SE of a mean of B block values is their sd (ddof 0) / sqrt(B)
    blocks = []
    for name in ("book", "github"):
        d = np.mean([lw["mta", k][name] - lw["baseline", k][name] for k in seeds], axis=0)
        blocks.append(d.reshape(n_docs, per_doc).mean(axis=1))
    # each domain is a stratum of n_docs blocks with half the tokens: the pooled mean's SE
    se_blocks = math.sqrt(sum(np.var(b) / n_docs for b in blocks)) / 2
    se_windows = (
        math.sqrt(
            sum(
                np.var(np.mean([lw["mta", k][n] - lw["baseline", k][n] for k in seeds], axis=0)) / (n_docs * per_doc)
                for n in ("book", "github")
            )
        )
        / 2
    )
    assert se_blocks > 1.3 * se_windows  # the test's point: blocks matter here
    assert r["SE eval windows"] == pytest.approx(se_blocks, rel=0.08)
    # the seeds' own SE: the sample SD of the per-seed differences over sqrt(n)
    per_seed = np.array(
        [
            np.sum([lw["mta", k][n] - lw["baseline", k][n] for n in ("book", "github")]) / (2 * n_docs * per_doc)
            for k in seeds
        ]
    )
    assert r["SE seeds"] == pytest.approx(scipy_stats.sem(per_seed), rel=1e-9)
    # two-level: an independent resampling loop (another generator): seeds, then blocks per domain
    g = np.random.default_rng(123)
    per_seed_blocks = {
        k: [(lw["mta", k][n] - lw["baseline", k][n]).reshape(n_docs, per_doc).mean(axis=1) for n in ("book", "github")]
        for k in seeds
    }
    vals = []
    for _ in range(4000):
        ks = g.choice(seeds, size=len(seeds))
        picks = [g.integers(0, n_docs, n_docs) for _ in range(2)]
        vals.append(np.mean([np.mean([per_seed_blocks[k][i][picks[i]].mean() for i in range(2)]) for k in ks]))
    lo, hi = np.quantile(vals, [0.025, 0.975])
    width = hi - lo
    assert r["two-level 95% lo"] == pytest.approx(lo, abs=0.12 * width)
    assert r["two-level 95% hi"] == pytest.approx(hi, abs=0.12 * width)
    notes = " ".join(out["tables"]["loss_seeds"]["notes"])
    assert "first windows of each domain" in notes  # these files lack window_sampling: said once


def test_token_weighted_loss_beside_the_papers_average(tmp_path):
    """Domains of unequal size: the token-weighted loss is sum(nats) / sum(tokens), not the
    mean of domain losses nor the log of the average perplexity."""
    rng = np.random.default_rng(5)
    runs, loss = [], {}
    for k in (0, 1, 2):
        for v, shift in (("baseline", 0.0), ("mta", -0.03)):
            w = {
                "book": ([float(x) for x in rng.normal(3.5 + shift, 0.2, 4) * 8], [8] * 4),  # few windows
                "github": ([float(x) for x in rng.normal(1.5 + shift, 0.2, 40) * 8], [8] * 40),
            }
            runs.append(_run(tmp_path, v, k, 1.0, windows=w))
            loss[v, k] = sum(sum(c) for c, _ in w.values()) / sum(sum(t) for _, t in w.values())
    out = _report(tmp_path, runs)
    r = _rows(out, "loss_seeds")["pretrain/mta"]
    assert r["loss (nats/token) (mean)"] == pytest.approx(np.mean([loss["mta", k] for k in range(3)]), rel=1e-12)
    diffs = np.array([loss["mta", k] - loss["baseline", k] for k in range(3)])
    lo, hi = scipy_stats.t.interval(0.95, 2, loc=diffs.mean(), scale=scipy_stats.sem(diffs))
    assert (r["95% lo"], r["95% hi"]) == (pytest.approx(lo, rel=1e-9), pytest.approx(hi, rel=1e-9))
    assert "Token-weighted" in out["tables"]["loss_seeds"]["title"]
    assert "mean of per-domain perplexities" in out["tables"]["ppl_seeds"]["title"]


def test_holm_over_the_tables_comparisons_and_power(tmp_path):
    base = [10.0, 10.4, 9.8, 10.1]
    rows_in = {"mta": [9.5, 9.8, 9.3, 9.7], "diff": [10.1, 10.2, 9.9, 10.3], "talking_heads": [9.6, 10.3, 9.5, 9.9]}
    runs = [_run(tmp_path, "baseline", k, v) for k, v in enumerate(base)]
    runs += [_run(tmp_path, name, k, v) for name, vals in rows_in.items() for k, v in enumerate(vals)]
    rows = _rows(_report(tmp_path, runs), "ppl_seeds")
    names = list(rows_in)
    p = [scipy_stats.ttest_1samp(np.array(rows_in[n]) - base, 0.0).pvalue for n in names]
    order = np.argsort(p)
    holm, running = {}, 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (3 - rank) * p[i]))
        holm[names[i]] = running
    for n in names:
        r = rows[f"pretrain/{n}"]
        assert r["Holm p"] == pytest.approx(holm[n], rel=1e-9)
        assert r["excludes 0 after Holm"] == ("yes" if holm[n] < 0.05 else "no")
        d = np.array(rows_in[n]) - base
        assert r["seeds for 80% power"] == stats.seeds_for_power(d.mean(), d.std(ddof=1))
        assert r["df"] == 3
    assert rows["pretrain/baseline"]["Holm p"] is None


def _needle_row(scores: dict, ids: dict | None = None) -> dict:
    flat = [x for v in scores.values() for x in v]
    row = {
        "by_depth": {k: float(np.mean(v)) for k, v in scores.items()},
        "mean": float(np.mean(flat)),
        "scores": scores,
    }
    if ids is not None:
        row["prompt_ids"] = ids
    return row


def test_needle_wilson_counts_distinct_prompts_not_repeats(tmp_path):
    """Old files (no prompt ids, no needle seed): three seeds saw the same 60 prompts; the
    Wilson interval is over 60 prompts, not 180 samples."""
    rng = np.random.default_rng(2)
    scores = {d: [float(x) for x in rng.random(20) < 0.4] for d in ("0", "50", "100")}
    runs = [_run(tmp_path, "baseline", k, 10.0, needle=_needle_row(scores)) for k in range(3)]
    rows = _rows(_report(tmp_path, runs), "needle_seeds")
    r = rows["pretrain/baseline"]
    hits = int(sum(sum(v) for v in scores.values()))
    ci = scipy_stats.binomtest(hits, 60).proportion_ci(0.95, method="wilson")
    assert (r["distinct prompts"], r["samples"]) == (60, 180)
    assert r["Wilson 95% lo"] == pytest.approx(100 * ci.low, abs=1e-9)
    assert r["Wilson 95% hi"] == pytest.approx(100 * ci.high, abs=1e-9)


def test_needle_prompt_ids_repeated_within_a_run_count_once(tmp_path):
    scores = {"0": [1.0, 1.0, 0.0, 0.0], "50": [1.0, 0.0, 1.0, 1.0]}
    ids = {"0": ["a", "a", "b", "c"], "50": ["d", "e", "d", "f"]}  # a twice (1, 1), d twice (1, 1)
    rows = _rows(
        _report(tmp_path, [_run(tmp_path, "baseline", 0, 10.0, needle=_needle_row(scores, ids))]), "needle_seeds"
    )
    r = rows["pretrain/baseline"]
    ci = scipy_stats.binomtest(3, 6).proportion_ci(0.95, method="wilson")  # a, d, e right; b, c, f wrong
    assert r["distinct prompts"] == 6
    assert (r["Wilson 95% lo"], r["Wilson 95% hi"]) == (pytest.approx(100 * ci.low), pytest.approx(100 * ci.high))


def test_a_zero_variance_needle_difference_is_undefined(tmp_path):
    scores = {"0": [1.0, 0.0, 1.0, 1.0], "50": [0.0, 0.0, 1.0, 0.0]}
    runs = [_run(tmp_path, v, 0, 10.0, needle=_needle_row(scores)) for v in ("baseline", "mta")]
    out = _report(tmp_path, runs)
    r = _rows(out, "needle_seeds")["pretrain/mta"]
    assert r["Δ vs reference (points)"] == 0.0
    assert r["95% lo"] is None and r["95% hi"] is None and r["95% CI excludes 0"] == "undefined"
    md = (tmp_path / "report" / "report.md").read_text()
    assert "0.00 [0.00, 0.00]" not in md and "| undefined |" in md


def test_named_contrasts_with_interval_n_and_power(tmp_path, capsys):
    vals = {"baseline": [10.0, 10.4, 9.8], "mta": [9.5, 9.7, 9.4], "talking_heads": [9.6, 9.9, 9.4]}
    runs = [_run(tmp_path, v, k, x) for v, xs in vals.items() for k, x in enumerate(xs)]
    out = _report(tmp_path, runs, contrasts=["mta-talking_heads", "mta-baseline"])
    rows = [r for r in out["tables"]["contrasts"]["rows"] if r["quantity"] == "avg ppl"]
    assert [r["contrast"] for r in rows] == ["MTA - Talking heads (pretrain)", "MTA - Transformer (pretrain)"]
    for r, other in zip(rows, ("talking_heads", "baseline")):
        d = np.array(vals["mta"]) - np.array(vals[other])
        lo, hi = scipy_stats.t.interval(0.95, 2, loc=d.mean(), scale=scipy_stats.sem(d))
        assert r["Δ (A - B)"] == pytest.approx(d.mean(), rel=1e-12) and r["n (Δ)"] == 3
        assert (r["95% lo"], r["95% hi"]) == (pytest.approx(lo, rel=1e-9), pytest.approx(hi, rel=1e-9))
        assert r["seeds for 80% power"] == stats.seeds_for_power(d.mean(), d.std(ddof=1))
    # a contrast that names no row: refused before anything is written
    labels = [f"--label={d}={d.relative_to(tmp_path)}" for d in runs]
    line = _refused(capsys, [str(d) for d in runs] + labels + ["--contrast", "mta-nope"], tmp_path / "r2")
    assert "contrast mta-nope" in line


def test_the_small_studys_contrasts_reach_its_report_job(tmp_path):
    """configs/pipeline/small_study.yaml names its contrasts; the report job gets each as
    --contrast; a narrower pipeline.variants drops the ones it no longer runs; a name that
    is no variant and no point is one error naming the field."""
    from mta_repro.errors import UserError
    from mta_repro.pipeline.__main__ import build_plan

    def contrasts(*overrides):
        plan, _ = build_plan(["pipeline=small_study", f"root={tmp_path}", *overrides])
        (job,) = [j for j in plan.jobs if j.kind == "report"]
        cmd = [str(c) for c in job.command]
        return [cmd[i + 1] for i, c in enumerate(cmd) if c == "--contrast"], plan

    got, plan = contrasts()
    assert got == ["mta-talking_heads", "mta-baseline", "diff-baseline", "talking_heads-baseline"]
    assert sorted({j.label.rsplit("/", 1)[-1] for j in plan.jobs if j.kind == "train"}) == [
        f"seed{k}" for k in range(8)
    ]
    assert contrasts("pipeline.variants=[baseline,mta]")[0] == ["mta-baseline"]
    with pytest.raises(UserError, match=r"pipeline\.contrasts: mta-talking_head names 'talking_head'"):
        contrasts("pipeline.contrasts=[[mta,talking_head]]")
    with pytest.raises(UserError, match=r"pipeline\.contrasts\[0\]: expected \[A, B\]"):
        contrasts("pipeline.contrasts=[[mta,mta]]")


def test_plots_star_the_tables_loss_draw_paired_differences_and_kernels_minus_identity(tmp_path, monkeypatch):
    import torch

    from mta_repro.report import plots
    from mta_repro.report.runs import load_run

    figs = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figs.append((path.name, fig)) or path)
    rng = np.random.default_rng(4)
    runs, train = [], {}
    for k in (0, 1, 2):
        for v in ("baseline", "mta"):
            w = {n: ([float(x) for x in rng.normal(2.0, 0.3, 6) * 8], [8] * 6) for n in ("book", "github")}
            d = _run(tmp_path, v, k, 1.0, windows=w)
            train[v, k] = [float(x) for x in rng.normal(3.0, 0.1, 5)]
            (d / "metrics.jsonl").write_text(
                "".join(json.dumps({"step": s + 1, "loss": x}) + "\n" for s, x in enumerate(train[v, k]))
            )
            runs.append(d)
    out = _report(tmp_path, runs)
    loss_fig = dict(figs)["loss_curves.png"]
    stars = [ln for ln in loss_fig.axes[0].lines if ln.get_marker() == "*"]
    rows = _rows(out, "loss_seeds")
    assert sorted(float(ln.get_ydata()[0]) for ln in stars) == pytest.approx(
        sorted(rows[f"pretrain/{v}"]["loss (nats/token) (mean)"] for v in ("baseline", "mta")), rel=1e-12
    )
    diff_ax = dict(figs)["loss_diff.png"].axes[0]
    per_seed = [np.array(train["mta", k]) - np.array(train["baseline", k]) for k in (0, 1, 2)]
    drawn = [np.asarray(ln.get_ydata(), dtype=float) for ln in diff_ax.lines if len(ln.get_ydata()) == 5]
    for expect in [*per_seed, np.mean(per_seed, axis=0)]:
        assert any(np.allclose(x, expect, rtol=0, atol=1e-12) for x in drawn)
    # kernels: the image is the kernel minus the identity init (row -1, centre column)
    kern = torch.zeros(2, 1, 3, 5)
    kern[:, :, -1, 2] = 0.9
    kern[0, 0, 0, 0] = 0.1
    figs.clear()
    plots.kernel_plot(load_run(runs[1]), tmp_path / "report", {"layers.1.attention.mta_kernel": kern})
    ((_, kfig),) = figs
    img = np.asarray(kfig.axes[0].images[0].get_array())
    expect = kern[0, 0].numpy().astype(float)
    expect[-1, 2] -= 1.0
    assert np.allclose(img, expect, atol=1e-7)
    assert "minus identity" in kfig._suptitle.get_text()
