"""Tables over seeds: what a difference between two variants (or sweep points) resolves.

Runs are grouped by their label without the ``/seed<k>`` of a seeded pipeline
(``pretrain/mta/seed0`` and ``pretrain/mta/seed1`` are one row, ``pretrain/mta``), and
each group is compared with its stage's reference row: the baseline, else the stage's
first group (a sweep's reference point). A row carries the mean and standard deviation
over its seeds and the difference from the reference with a 95% interval:
- two seeds or more in common with the reference: the mean of the seed-paired
  differences, t-interval with n - 1 degrees of freedom (seed k against seed k: the
  same data order, so what is left is the variant);
- one seed: a paired bootstrap over the evaluation windows (perplexity, stratified by
  domain) or samples (needle), labelled so: it says how large a difference this
  evaluation set resolves, not what another seed would give.
A difference whose interval contains zero is marked ``n.r.`` (not resolved). Accuracies
carry a Wilson interval over their samples (benchmarks: lm-eval's stderr where it
reported one). ``stats`` holds the formulas.
"""

from __future__ import annotations

import math
import re

import numpy as np

from mta_repro.report import stats
from mta_repro.report.paper import VARIANT_LABELS
from mta_repro.report.render import Table
from mta_repro.report.runs import RunData

SEED_LABEL = re.compile(r"^(?P<group>.+)/seed(?P<seed>\d+)$")
NOT_RESOLVED = "n.r."


def run_seed(run: RunData) -> int | None:
    """The run's seed: its label's ``seed<k>``, else its config's ``seed``."""
    m = SEED_LABEL.match(run.label)
    if m:
        return int(m.group("seed"))
    seed = (run.config or {}).get("seed") if isinstance(run.config, dict) else None
    return int(seed) if isinstance(seed, int) else None


def group_runs(runs) -> dict:
    """{group label: {seed: run}} in the runs' order (a run without a seed label is its own group)."""
    groups: dict = {}
    for r in runs:
        m = SEED_LABEL.match(r.label)
        key = m.group("group") if m else r.label
        groups.setdefault(key, {})[run_seed(r)] = r
    return groups


def reference_of(groups: dict) -> dict:
    """{group: its reference group}: per stage (a pipeline label's first part, else the
    run's stage), the baseline group, else the stage's first group."""
    by_stage: dict = {}
    for g, seeds in groups.items():
        stage = g.split("/")[0] if "/" in g else next(iter(seeds.values())).stage
        by_stage.setdefault(stage, []).append(g)
    ref = {}
    for members in by_stage.values():
        base = [g for g in members if next(iter(groups[g].values())).variant == "baseline"]
        for g in members:
            ref[g] = base[0] if base else members[0]
    return ref


def seed_record(run: RunData) -> str:
    """The seeds a run recorded (its eval's copy of the run's provenance, else its
    config): ``seed 0 (init 0, data 0)``, ``init from <weights>`` for a stage start."""
    for e in run.evals.values():
        rec = ((e.get("provenance") or {}).get("run") or {}).get("seeds")
        if isinstance(rec, dict):
            init = rec.get("init") or {}
            how = f"init {init['seed']}" if init.get("seed") is not None else f"init from {init.get('from')}"
            return f"seed {rec.get('seed')} ({how}, data {(rec.get('data_order') or {}).get('seed')})"
    cfg = run.config if isinstance(run.config, dict) else {}
    if "seed" in cfg:
        model, data = cfg.get("model") or {}, cfg.get("data") or {}
        return f"seed {cfg['seed']} (init {model.get('seed', '?')}, data {data.get('seed', '?')}; config)"
    return "—"


def group_seeds(seeds: dict) -> str:
    """The seeds behind a row of a table over seeds, one record per run."""
    return "; ".join(seed_record(r) for _, r in sorted(seeds.items(), key=lambda kv: (kv[0] is None, kv[0] or 0)))


def add_seed_provenance(tables, runs) -> None:
    """Put each run's seeds into the provenance block of every table row it is in."""
    by_label = {r.label: r for r in runs}
    for t in tables:
        for label, p in t.provenance.items():
            run = by_label.get(label) or by_label.get(label.removesuffix(" (!)"))
            if run is not None and "seed" not in p:
                p["seed"] = seed_record(run)


# ------------------------------------------------------------------ perplexity
def _ppl_domains(run: RunData) -> dict | None:
    res = (run.evals.get("ppl") or {}).get("results") or {}
    d = res.get("domains")
    return d if isinstance(d, dict) and d else None


def _avg_ppl(run: RunData) -> float | None:
    res = (run.evals.get("ppl") or {}).get("results") or {}
    v = res.get("average")
    return float(v) if isinstance(v, (int, float)) else None


def _windows(run: RunData, domains: list) -> list | None:
    """[(ce array, tokens array)] per domain, or None when the eval kept no per-batch losses."""
    per = _ppl_domains(run) or {}
    out = []
    for d in domains:
        v = per.get(d) or {}
        ce, tok = v.get("batch_ce"), v.get("batch_tokens")
        if not isinstance(ce, list) or not isinstance(tok, list) or len(ce) != len(tok) or not ce:
            return None
        out.append((np.asarray(ce, dtype=np.float64), np.asarray(tok, dtype=np.float64)))
    return out


def _avg_from(windows: list, idx: list) -> float:
    return float(np.mean([np.exp(ce[i].sum() / tok[i].sum()) for (ce, tok), i in zip(windows, idx)]))


def ppl_bootstrap(run: RunData, ref: RunData | None, domains: list) -> tuple | None:
    """(lo, hi, n windows) of the average perplexity (``ref`` None) or of its difference
    from ``ref`` (the same windows drawn for both), resampling every domain's windows."""
    a = _windows(run, domains)
    b = _windows(ref, domains) if ref is not None else None
    if a is None or (ref is not None and (b is None or [len(x[0]) for x in a] != [len(x[0]) for x in b])):
        return None
    strata = [len(ce) for ce, _ in a]
    if b is None:
        lo, hi = stats.bootstrap(lambda idx: _avg_from(a, idx), strata)
    else:
        lo, hi = stats.bootstrap(lambda idx: _avg_from(a, idx) - _avg_from(b, idx), strata)
    return lo, hi, sum(strata)


def _fmt_interval(lo, hi) -> str:
    return "—" if lo is None else f"[{lo:+.3f}, {hi:+.3f}]"


def _pm(mean, std, digits: int = 2) -> str:
    if mean is None:
        return "—"
    return f"{mean:.{digits}f}" + ("" if std is None else f" ± {std:.{digits}f}")


def compare(values: dict, ref_values: dict) -> dict:
    """The seed-paired comparison of ``values`` ({seed: x}) with ``ref_values``: {"n",
    "mean", "lo", "hi", "method"} over the seeds both have (two or more), else {}."""
    common = sorted(set(values) & set(ref_values))
    if len(common) < 2:
        return {}
    diffs = [values[s] - ref_values[s] for s in common]
    m, lo, hi = stats.t_interval(diffs)
    return {"n": len(common), "mean": m, "lo": lo, "hi": hi, "method": f"t over {len(common)} paired seeds"}


def _resolved_cell(cmp: dict, is_ref: bool) -> str:
    if is_ref:
        return "reference"
    r = stats.resolved(cmp.get("lo"), cmp.get("hi"))
    return "—" if r is None else ("yes" if r else NOT_RESOLVED)


def ppl_seed_table(runs) -> Table | None:
    groups = {g: s for g, s in group_runs(runs).items() if any(_avg_ppl(r) is not None for r in s.values())}
    if not groups:
        return None
    refs = reference_of(groups)
    headers = [
        "run",
        "model",
        "seeds",
        "avg ppl (mean)",
        "std",
        "Δ vs reference",
        "95% lo",
        "95% hi",
        "interval",
        "resolved",
    ]
    rows, seeds_of = [], {}
    methods = set()
    for g, seeds in groups.items():
        vals: dict = {s: _avg_ppl(r) for s, r in seeds.items() if _avg_ppl(r) is not None}
        mean, std = stats.mean_std(list(vals.values()))
        ref_g = refs[g]
        ref_vals = {s: _avg_ppl(r) for s, r in groups[ref_g].items() if _avg_ppl(r) is not None}
        is_ref = ref_g == g
        cmp: dict = {}
        if not is_ref:
            cmp = compare(vals, ref_vals)
            if not cmp and len(vals) == 1 and len(ref_vals) >= 1:
                s = next(iter(vals))
                ref_run = groups[ref_g].get(s) or next(iter(groups[ref_g].values()))
                run = seeds[s]
                domains = sorted(_ppl_domains(run) or {})
                if sorted(_ppl_domains(ref_run) or {}) == domains:
                    b = ppl_bootstrap(run, ref_run, domains)
                    if b is not None:
                        cmp = {
                            "n": 1,
                            "mean": vals[s] - _avg_ppl(ref_run),  # type: ignore[operator]
                            "lo": b[0],
                            "hi": b[1],
                            "method": f"bootstrap over {b[2]} eval windows (1 seed)",
                        }
        elif len(vals) == 1:
            run = next(iter(seeds.values()))
            domains = sorted(_ppl_domains(run) or {})
            b = ppl_bootstrap(run, None, domains)
            if b is not None:
                cmp = {
                    "lo": None,
                    "hi": None,
                    "method": f"ppl itself: [{b[0]:.2f}, {b[1]:.2f}], bootstrap over {b[2]} windows",
                }
        if cmp.get("method"):
            methods.add(cmp["method"].split(" over ")[0].split(":")[0])
        seeds_of[g] = sorted(s for s in seeds if s is not None)
        model = next(iter(seeds.values())).variant
        rows.append(
            [
                g,
                VARIANT_LABELS.get(model, model) if model else None,
                ",".join(str(s) for s in seeds_of[g]) or "—",
                mean,
                std,
                None if is_ref else cmp.get("mean"),
                cmp.get("lo"),
                cmp.get("hi"),
                cmp.get("method") or ("reference row" if is_ref else "—"),
                _resolved_cell(cmp, is_ref),
            ]
        )
    notes = [
        "Average validation perplexity (mean of the per-domain perplexities) over each row's seeds; std: the "
        "sample standard deviation over seeds (n - 1).",
        "Δ: the row minus its reference (the stage's baseline, else its first row), seed by seed; the 95% "
        "interval is a t-interval over the paired seeds (n - 1 degrees of freedom) where a row has two or more "
        "seeds in common with its reference, else a paired percentile bootstrap over the evaluation windows "
        f"({stats.BOOT_DRAWS} resamples, stratified by domain), which says what the evaluation set resolves, "
        "not what another seed would give.",
        f"{NOT_RESOLVED}: not resolved, the interval contains zero.",
    ]
    t = Table("ppl_seeds", "Validation perplexity over seeds, with paired 95% intervals", headers, rows, notes)
    t.provenance = {g: {"seed": group_seeds(seeds)} for g, seeds in groups.items()}
    return t


def ppl_domain_table(runs) -> Table | None:
    """Per domain: the mean over seeds and the paired difference from the reference."""
    groups = {g: s for g, s in group_runs(runs).items() if any(_ppl_domains(r) for r in s.values())}
    if not groups:
        return None
    refs = reference_of(groups)
    domains = sorted({d for s in groups.values() for r in s.values() for d in (_ppl_domains(r) or {})})
    rows = []
    for g, seeds in groups.items():
        row = [g]
        for d in domains:
            vals = {
                s: float((_ppl_domains(r) or {}).get(d, {}).get("ppl"))
                for s, r in seeds.items()
                if isinstance((_ppl_domains(r) or {}).get(d, {}).get("ppl"), (int, float))
            }
            if not vals:
                row.append(None)
                continue
            mean, std = stats.mean_std(list(vals.values()))
            cell = _pm(mean, std)
            if refs[g] != g:
                ref_vals = {
                    s: float((_ppl_domains(r) or {}).get(d, {}).get("ppl"))
                    for s, r in groups[refs[g]].items()
                    if isinstance((_ppl_domains(r) or {}).get(d, {}).get("ppl"), (int, float))
                }
                cmp = compare(vals, ref_vals)
                if not cmp and len(vals) == 1:
                    s = next(iter(vals))
                    ref_run = groups[refs[g]].get(s)
                    if ref_run is not None:
                        b = ppl_bootstrap(seeds[s], ref_run, [d])
                        if b is not None:
                            cmp = {"mean": vals[s] - ref_vals[s], "lo": b[0], "hi": b[1]}
                if cmp:
                    mark = "" if stats.resolved(cmp["lo"], cmp["hi"]) else f" {NOT_RESOLVED}"
                    cell += f"; Δ {cmp['mean']:+.2f} {_fmt_interval(cmp['lo'], cmp['hi'])}{mark}"
            row.append(cell)
        rows.append(row)
    notes = [
        "Each cell: mean ± std over seeds; Δ vs the reference row with its paired 95% interval (t over seeds, "
        f"or a bootstrap over that domain's windows with one seed); {NOT_RESOLVED}: the interval contains zero."
    ]
    t = Table("ppl_seeds_domains", "Per-domain perplexity over seeds", ["run", *domains], rows, notes)
    t.provenance = {g: {"seed": group_seeds(seeds)} for g, seeds in groups.items()}
    return t


# ------------------------------------------------------------------ needle
def _needle(run: RunData) -> list:
    """[(context, count, mean accuracy, [every sample's score] or None)]."""
    res = (run.evals.get("needle") or {}).get("results") or {}
    out = []
    for ctx, counts in sorted((res.get("accuracy") or {}).items(), key=lambda kv: int(kv[0])):
        for n, row in sorted(counts.items(), key=lambda kv: int(kv[0])):
            scores = row.get("scores")
            flat = (
                [float(v) for d in sorted(scores, key=float) for v in scores[d]] if isinstance(scores, dict) else None
            )
            out.append((str(ctx), str(n), float(row["mean"]), flat))
    return out


def needle_seed_table(runs) -> Table | None:
    groups = {g: s for g, s in group_runs(runs).items() if any(_needle(r) for r in s.values())}
    if not groups:
        return None
    refs = reference_of(groups)
    rows = []
    for g, seeds in groups.items():
        settings = {(c, n) for r in seeds.values() for c, n, _, _ in _needle(r)}
        for c, n in sorted(settings, key=lambda x: (int(x[0]), int(x[1]))):
            acc = {s: a for s, r in seeds.items() for cc, nn, a, _ in _needle(r) if (cc, nn) == (c, n)}
            scores = {s: sc for s, r in seeds.items() for cc, nn, _, sc in _needle(r) if (cc, nn) == (c, n)}
            mean, std = stats.mean_std(list(acc.values()))
            ref_g = refs[g]
            ref_acc = {s: a for s, r in groups[ref_g].items() for cc, nn, a, _ in _needle(r) if (cc, nn) == (c, n)}
            ref_sc = {s: sc for s, r in groups[ref_g].items() for cc, nn, _, sc in _needle(r) if (cc, nn) == (c, n)}
            pooled = [v for sc in scores.values() if sc for v in sc]
            binom = stats.wilson(sum(pooled), len(pooled)) if pooled and all(v in (0.0, 1.0) for v in pooled) else None
            cmp: dict = {}
            if ref_g != g:
                cmp = compare(acc, ref_acc)
                if not cmp and len(acc) == 1:
                    s = next(iter(acc))
                    a, b = scores.get(s), ref_sc.get(s)
                    if a and b and len(a) == len(b):
                        xa, xb = np.asarray(a), np.asarray(b)
                        lo, hi = stats.bootstrap(
                            lambda idx, xa=xa, xb=xb: float(xa[idx[0]].mean() - xb[idx[0]].mean()), [len(xa)]
                        )
                        cmp = {
                            "mean": acc[s] - ref_acc[s],
                            "lo": lo,
                            "hi": hi,
                            "method": f"bootstrap over {len(xa)} paired samples (1 seed)",
                        }
            rows.append(
                [
                    g,
                    int(c),
                    int(n),
                    ",".join(str(s) for s in sorted(k for k in acc if k is not None)) or "—",
                    100 * mean,
                    None if std is None else 100 * std,
                    None if binom is None else 100 * binom[1],
                    None if binom is None else 100 * binom[2],
                    len(pooled) or None,
                    None if cmp.get("mean") is None else 100 * cmp["mean"],
                    None if not cmp else 100 * cmp["lo"],
                    None if not cmp else 100 * cmp["hi"],
                    cmp.get("method") or ("reference row" if ref_g == g else "—"),
                    _resolved_cell(cmp, ref_g == g),
                ]
            )
    headers = [
        "run",
        "context",
        "needles",
        "seeds",
        "accuracy % (mean)",
        "std",
        "Wilson 95% lo",
        "Wilson 95% hi",
        "samples",
        "Δ vs reference (points)",
        "95% lo",
        "95% hi",
        "interval",
        "resolved",
    ]
    notes = [
        "Accuracy: mean over depths and samples, then over seeds; the Wilson interval pools every sample of "
        "the row's seeds (a binomial proportion; it says what the samples resolve, not what another seed "
        "would give).",
        "Δ: seed-paired t-interval where a row has two or more seeds in common with its reference, else a "
        f"percentile bootstrap over the paired samples (the same prompts for both); {NOT_RESOLVED}: the "
        "interval contains zero.",
    ]
    t = Table("needle_seeds", "Multi-needle accuracy over seeds, with 95% intervals", headers, rows, notes)
    t.provenance = {g: {"seed": group_seeds(seeds)} for g, seeds in groups.items()}
    return t


# ------------------------------------------------------------------ benchmarks
def _bench(run: RunData) -> dict:
    """{lm-eval task: (accuracy %, its stderr in % or None, samples or None)} of a run's
    benchmarks.json (the summary's numbers; lm-eval's stderr where it reported one)."""
    from mta_repro.eval.benchmarks import headline_metric

    res = (run.evals.get("benchmarks") or {}).get("results") or {}
    out = {}
    for name, v in (res.get("summary") or {}).items():
        if name == "average" or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        metric = (res.get("metrics") or {}).get(name) or headline_metric(name)
        se = ((res.get("tasks") or {}).get(name) or {}).get(f"{metric}_stderr,none")
        n = (res.get("n_samples") or {}).get(name)
        out[name] = (
            float(v),
            100.0 * float(se) if isinstance(se, (int, float)) and not isinstance(se, bool) else None,
            int(n) if isinstance(n, int) and n > 0 else None,
        )
    return out


def _acc_interval(acc: float, se: float | None, n: int | None) -> tuple:
    """(lo, hi, how) of one accuracy in %: lm-eval's stderr (normal), else Wilson over n."""
    if se is not None:
        z = stats.normal_ppf(0.5 + stats.LEVEL / 2)
        return max(0.0, acc - z * se), min(100.0, acc + z * se), "lm-eval stderr"
    if n is not None:
        _, lo, hi = stats.wilson(acc / 100.0 * n, n)
        return 100.0 * lo, 100.0 * hi, f"Wilson, n={n}"
    return None, None, None


def benchmark_seed_table(runs) -> Table | None:
    groups = {g: s for g, s in group_runs(runs).items() if any(_bench(r) for r in s.values())}
    if not groups:
        return None
    refs = reference_of(groups)
    rows = []
    for g, seeds in groups.items():
        per = {s: _bench(r) for s, r in seeds.items()}
        for task in sorted({t for b in per.values() for t in b}):
            vals = {s: b[task][0] for s, b in per.items() if task in b}
            mean, std = stats.mean_std(list(vals.values()))
            lo = hi = how = None
            if len(vals) == 1:
                (only,) = [b[task] for b in per.values() if task in b]
                lo, hi, how = _acc_interval(*only)
            ref_g = refs[g]
            ref_per = {s: _bench(r) for s, r in groups[ref_g].items()}
            ref_vals = {s: b[task][0] for s, b in ref_per.items() if task in b}
            cmp: dict = {}
            if ref_g != g:
                cmp = compare(vals, ref_vals)
                common = sorted(set(vals) & set(ref_vals))
                if not cmp and len(vals) == 1 and len(common) == 1:
                    a, b = per[common[0]][task], ref_per[common[0]][task]
                    ses = [
                        x[1] if x[1] is not None else (math.sqrt(x[0] * (100 - x[0]) / x[2]) if x[2] else None)
                        for x in (a, b)
                    ]
                    if all(se is not None for se in ses):
                        z = stats.normal_ppf(0.5 + stats.LEVEL / 2)
                        half = z * math.sqrt(ses[0] ** 2 + ses[1] ** 2)  # type: ignore[operator]
                        d = a[0] - b[0]
                        cmp = {"mean": d, "lo": d - half, "hi": d + half, "method": "normal, unpaired (1 seed)"}
            rows.append(
                [
                    g,
                    task,
                    ",".join(str(s) for s in sorted(k for k in vals if k is not None)) or "—",
                    mean,
                    std,
                    lo,
                    hi,
                    how or ("over seeds: see std" if len(vals) > 1 else "—"),
                    cmp.get("mean"),
                    cmp.get("lo"),
                    cmp.get("hi"),
                    cmp.get("method") or ("reference row" if ref_g == g else "—"),
                    _resolved_cell(cmp, ref_g == g),
                ]
            )
    headers = [
        "run",
        "task",
        "seeds",
        "accuracy % (mean)",
        "std",
        "95% lo",
        "95% hi",
        "accuracy interval",
        "Δ vs reference (points)",
        "Δ 95% lo",
        "Δ 95% hi",
        "interval",
        "resolved",
    ]
    notes = [
        "One seed: the accuracy's 95% interval is lm-eval's stderr (normal) where it reported one, else a "
        "Wilson interval over the task's samples; the difference from the reference adds the two "
        "variances (unpaired: lm-eval keeps no per-sample scores here). Two seeds or more: the seed-paired "
        f"t-interval. {NOT_RESOLVED}: the interval contains zero.",
    ]
    t = Table("benchmarks_seeds", "Benchmark accuracy over seeds, with 95% intervals", headers, rows, notes)
    t.provenance = {g: {"seed": group_seeds(seeds)} for g, seeds in groups.items()}
    return t


def _has_units(run: RunData) -> bool:
    """Whether the run's evals kept what a one-seed interval resamples (windows, samples)."""
    domains = _ppl_domains(run) or {}
    return (
        any(isinstance(v, dict) and "batch_ce" in v for v in domains.values())
        or any(sc is not None for *_, sc in _needle(run))
        or any(se is not None or n is not None for _, se, n in _bench(run).values())
    )


def seed_tables(runs) -> list:
    """The tables over seeds that the runs have data for: when some row has two seeds or
    more, or some run's evals kept their windows or samples (results written before they
    did give no interval: no table)."""
    if not any(len(g) > 1 for g in group_runs(runs).values()) and not any(_has_units(r) for r in runs):
        return []
    makers = (ppl_seed_table, ppl_domain_table, needle_seed_table, benchmark_seed_table)
    return [t for t in (m(runs) for m in makers) if t is not None]
