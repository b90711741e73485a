"""Tables over seeds: what a difference between two variants (or sweep points) supports.

Rows: runs labelled ``<group>/seed<k>`` (a seeded pipeline's) are one row; runs without
such a label (a Hydra multirun seeds axis, ``'seed=0,1' 'run_dir=runs/x/seed${seed}'``)
whose recorded configs are equal but for the seed and run_dir are one row.
``check_runs`` refuses two runs with one run id and a run whose recorded seed is not its
label's. A run without a result for a table's quantity (no ``eval/ppl.json``, a null
average) is named in the row's "no result" column and left out of its mean and intervals.

Comparisons (each row against its stage's reference row: the baseline, else the first
point; and each named contrast, ``--contrast mta-talking_heads``):
- two seeds or more in common: the seed-paired differences over the seeds both rows have
  (the row says which, and n), a t-interval with n - 1 df, Holm's adjustment over the
  table's comparisons, the seeds 80% power needs; for perplexity and the token-weighted
  loss also the evaluation set's standard error beside the seeds' and a two-level
  bootstrap (resample seeds, then document blocks within each domain);
- one seed in common: a paired bootstrap over that seed's evaluation windows or distinct
  needle prompts, labelled so; never two different seeds paired;
- zero variance (every paired difference equal): "undefined", not a zero-width interval.
Accuracies carry a Wilson interval over distinct prompts (benchmarks: lm-eval's stderr
where it reported one). ``stats`` holds the formulas.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np

from mta_repro.errors import UserError
from mta_repro.report import stats
from mta_repro.report.paper import VARIANT_LABELS
from mta_repro.report.render import Table
from mta_repro.report.runs import RunData

SEED_LABEL = re.compile(r"^(?P<group>.+)/seed(?P<seed>\d+)$")
UNDEFINED = "undefined"
EXCLUDES = "95% CI excludes 0"
HOLM = "excludes 0 after Holm"


def _label_seed(run: RunData) -> int | None:
    m = SEED_LABEL.match(run.label)
    return int(m.group("seed")) if m else None


def recorded_seed(run: RunData) -> int | None:
    """The seed the run recorded: its evals' copy of its provenance, else its config."""
    for e in run.evals.values():
        rec = ((e.get("provenance") or {}).get("run") or {}).get("seeds")
        if isinstance(rec, dict) and isinstance(rec.get("seed"), int):
            return rec["seed"]
    seed = (run.config or {}).get("seed") if isinstance(run.config, dict) else None
    return seed if isinstance(seed, int) and not isinstance(seed, bool) else None


def run_seed(run: RunData) -> int | None:
    """The run's seed: its label's ``seed<k>``, else the seed it recorded."""
    s = _label_seed(run)
    return s if s is not None else recorded_seed(run)


def run_id(run: RunData) -> str | None:
    """The run's identity: its provenance record's ``run_id``, else its evals' copy."""
    from mta_repro.runs.provenance import RECORD, read_record

    rid = (read_record(run.path / RECORD) or {}).get("run_id")
    if rid:
        return str(rid)
    for e in run.evals.values():
        rid = (e.get("provenance") or {}).get("run_id")
        if rid:
            return str(rid)
    return None


def check_runs(runs) -> None:
    """Refuse (one line) what would count a run twice or under another seed: two runs
    with one run id (a copied run dir), a run whose recorded seed is not its label's,
    two runs of one row at one seed."""
    seen: dict = {}
    for r in runs:
        rid = run_id(r)
        if rid is not None and rid in seen:
            raise UserError(
                f"report: {r.path} and {seen[rid].path} are one run (run id {rid} in both): a copy would count "
                "its seed twice; delete the copy, or train that seed in its own run dir"
            )
        if rid is not None:
            seen[rid] = r
        label, rec = _label_seed(r), recorded_seed(r)
        if label is not None and rec is not None and label != rec:
            raise UserError(
                f"report: {r.path}: labelled seed {label} ({r.label}) but the run recorded seed {rec}; "
                f"label it .../seed{rec}, or train seed {label} in its own run dir"
            )
    for g, members in _grouped(runs).items():
        seeds = [run_seed(r) for r in members]
        dup = sorted({s for s in seeds if s is not None and seeds.count(s) > 1})
        if dup:
            paths = [str(r.path) for r in members if run_seed(r) == dup[0]]
            raise UserError(f"report: row {g}: seed {dup[0]} twice ({', '.join(paths)}); keep one of them")


def _strip_seed(node, seed, run_dir):
    """The config without what differs between the seeds of one experiment: ``seed``,
    ``run_dir``, any ``*seed`` field equal to the run's seed (``model.seed: ${seed}``) and
    any path under the run dir (``logging.dir: ${run_dir}``)."""
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            if k in ("seed", "run_dir") or (str(k).endswith("seed") and v == seed):
                continue
            out[k] = _strip_seed(v, seed, run_dir)
        return out
    if isinstance(node, list):
        return [_strip_seed(v, seed, run_dir) for v in node]
    if isinstance(node, str) and run_dir and (node == run_dir or node.startswith(run_dir.rstrip("/") + "/")):
        return "<run_dir>"
    return node


def _config_key(run: RunData) -> str | None:
    cfg = run.config if isinstance(run.config, dict) else None
    if cfg is None or not isinstance(cfg.get("seed"), int):
        return None
    run_dir = cfg.get("run_dir") if isinstance(cfg.get("run_dir"), str) else None
    return json.dumps(_strip_seed(cfg, cfg["seed"], run_dir), sort_keys=True, default=str)


def _grouped(runs) -> dict:
    """{row label: [runs]}: by ``<group>/seed<k>`` label, else by config without the seed
    (two runs or more with one config and distinct seeds), else the run alone."""
    groups: dict = {}
    by_key: dict = {}
    for r in runs:
        m = SEED_LABEL.match(r.label)
        if m:
            groups.setdefault(m.group("group"), []).append(r)
            continue
        key = _config_key(r)
        by_key.setdefault(key if key is not None else f"\0{id(r)}", []).append(r)
    for key, members in by_key.items():
        seeds = {run_seed(r) for r in members}
        if key.startswith("\0") or len(members) < 2 or len(seeds) < len(members):
            for r in members:
                groups.setdefault(r.label, []).append(r)
            continue
        parents = {Path(r.path).resolve().parent for r in members}
        name = parents.pop().name if len(parents) == 1 else members[0].label
        while name in groups:
            name += "'"
        groups[name] = members
    return groups


def group_runs(runs) -> dict:
    """{group label: {seed: run}} in the runs' order (``_grouped``)."""
    out = {}
    for g, members in _grouped(runs).items():
        out[g] = {run_seed(r): r for r in members}
    return out


def reference_of(groups: dict) -> dict:
    """{group: its reference group}: per stage (a pipeline label's first part, else the
    run's stage), the baseline group, else the stage's first group."""
    by_stage: dict = {}
    for g, seeds in groups.items():
        by_stage.setdefault(_stage_of(g, seeds), []).append(g)
    ref = {}
    for members in by_stage.values():
        base = [g for g in members if next(iter(groups[g].values())).variant == "baseline"]
        for g in members:
            ref[g] = base[0] if base else members[0]
    return ref


def _stage_of(g: str, seeds: dict) -> str:
    return g.split("/")[0] if "/" in g else next(iter(seeds.values())).stage


def parse_contrast(text: str) -> tuple:
    """``"mta-talking_heads"`` -> ("mta", "talking_heads") (variant or row names)."""
    a, sep, b = str(text).partition("-")
    if not sep or not a.strip() or not b.strip() or "-" in b:
        raise UserError(f"report: --contrast expects A-B (two variant or row names, e.g. mta-baseline), got {text!r}")
    return a.strip(), b.strip()


def contrast_pairs(groups: dict, contrasts) -> list:
    """[(name "A - B", group a, group b)] for each named contrast in each stage where both
    sides have a row; a side is a row whose variant is that name, or whose label (or its
    last part) is. A contrast that matches no row anywhere is refused."""
    out = []
    for a, b in contrasts or ():
        found = False
        by_stage: dict = {}
        for g, seeds in groups.items():
            by_stage.setdefault(_stage_of(g, seeds), []).append(g)
        for stage, members in by_stage.items():

            def side(name, members=members):
                hits = [
                    g
                    for g in members
                    if g == name or g.split("/")[-1] == name or next(iter(groups[g].values())).variant == name
                ]
                return hits[0] if len(hits) == 1 else None

            ga, gb = side(a), side(b)
            if ga is not None and gb is not None and ga != gb:
                out.append((f"{VARIANT_LABELS.get(a, a)} - {VARIANT_LABELS.get(b, b)} ({stage})", ga, gb))
                found = True
        if not found:
            raise UserError(
                f"report: contrast {a}-{b}: no stage has one row of each (rows: {', '.join(groups)}); "
                "name two variants (e.g. mta-baseline) or two rows"
            )
    return out


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


def _seeds_text(seeds) -> str:
    return ",".join(str(s) for s in sorted(s for s in seeds if s is not None)) or "—"


def _yes_no(v) -> str:
    return "—" if v is None else ("yes" if v else "no")


# ------------------------------------------------------------------ comparisons
def compare(values: dict, ref_values: dict) -> dict:
    """The seed-paired comparison of ``values`` ({seed: x}) with ``ref_values`` over the
    seeds both have (two or more; else {}): {"n", "seeds", "df", "mean", "sd", "lo", "hi",
    "p", "method", "power"}; lo, hi, p None and method "undefined ..." at zero variance."""
    common = sorted(set(values) & set(ref_values), key=lambda s: (s is None, s or 0))
    if len(common) < 2:
        return {}
    diffs = [values[s] - ref_values[s] for s in common]
    n = len(common)
    m, sd = stats.mean_std(diffs)
    out = {"n": n, "seeds": common, "df": n - 1, "mean": m, "sd": sd, "diffs": diffs}
    if not sd:
        return {**out, "lo": None, "hi": None, "p": None, "method": f"{UNDEFINED}: zero variance over {n} seeds"}
    _, lo, hi = stats.t_interval(diffs)
    return {
        **out,
        "lo": lo,
        "hi": hi,
        "p": stats.t_pvalue(diffs),
        "power": stats.seeds_for_power(m, sd),
        "method": f"t over {n} paired seeds ({n - 1} df)",
    }


def adjust_family(cmps: list) -> int:
    """Holm over the comparisons that have a p-value: sets each one's "holm" (adjusted p)
    and "holm_excludes"; returns the family's size."""
    fam = [c for c in cmps if c.get("p") is not None]
    for c, adj in zip(fam, stats.holm([c["p"] for c in fam])):
        c["holm"] = adj
        c["holm_excludes"] = adj < 1.0 - stats.LEVEL
    return len(fam)


def _excludes_cell(cmp: dict, is_ref: bool) -> str:
    if is_ref:
        return "reference"
    if cmp.get("method", "").startswith(UNDEFINED):
        return UNDEFINED
    return _yes_no(stats.excludes_zero(cmp.get("lo"), cmp.get("hi")))


def _power_cell(cmp: dict):
    if cmp.get("df") is None or cmp.get("lo") is None:
        return None
    p = cmp.get("power")
    return p if p is not None else f"> {stats.POWER_MAX_SEEDS}"


# ------------------------------------------------------------------ perplexity and loss
def _ppl_res(run: RunData) -> dict:
    return (run.evals.get("ppl") or {}).get("results") or {}


def _ppl_domains(run: RunData) -> dict | None:
    d = _ppl_res(run).get("domains")
    return d if isinstance(d, dict) and d else None


def _num(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def _avg_ppl(run: RunData) -> float | None:
    return _num(_ppl_res(run).get("average"))


def token_loss(run: RunData) -> float | None:
    """Mean nats per token over every evaluated token: the eval's ``token_loss``, else the
    sum of its windows' losses over their tokens, else the domains' losses weighted by
    their token counts (files written before the field)."""
    v = _num(_ppl_res(run).get("token_loss"))
    if v is not None:
        return v
    doms = _ppl_domains(run) or {}
    ce = [x.get("batch_ce") for x in doms.values() if isinstance(x, dict)]
    tok = [x.get("batch_tokens") for x in doms.values() if isinstance(x, dict)]
    if doms and all(isinstance(c, list) and c for c in ce) and all(isinstance(t, list) and t for t in tok):
        nats = sum(float(np.sum(c)) for c in ce)  # type: ignore[arg-type]
        tokens = sum(float(np.sum(t)) for t in tok)  # type: ignore[arg-type]
        return nats / tokens
    pairs = [(_num(x.get("loss")), _num(x.get("tokens"))) for x in doms.values() if isinstance(x, dict)]
    if pairs and all(lo is not None and t for lo, t in pairs):
        return float(sum(lo * t for lo, t in pairs) / sum(t for _, t in pairs))  # type: ignore[operator]
    return None


class Windows:
    """One run's evaluation windows, per domain: summed nats ``ce`` and ``tokens`` per
    window, and ``blocks``: the window indices of each source document (``batch_doc``),
    one block per window when the eval did not record documents."""

    def __init__(self, run: RunData, domains: list):
        per = _ppl_domains(run) or {}
        self.ce, self.tok, self.blocks, self.docs = [], [], [], []
        self.ok = bool(domains)
        self.documents_known = True
        for d in domains:
            v = per.get(d) or {}
            ce, tok, doc = v.get("batch_ce"), v.get("batch_tokens"), v.get("batch_doc")
            if not isinstance(ce, list) or not isinstance(tok, list) or len(ce) != len(tok) or not ce:
                self.ok = False
                return
            if not isinstance(doc, list) or len(doc) != len(ce):
                doc = list(range(len(ce)))
                self.documents_known = False
            order: dict = {}
            for i, k in enumerate(doc):
                order.setdefault(json.dumps(k), []).append(i)
            self.ce.append(np.asarray(ce, dtype=np.float64))
            self.tok.append(np.asarray(tok, dtype=np.float64))
            self.blocks.append([np.asarray(ix) for ix in order.values()])
            self.docs.append(tuple(json.dumps(k) for k in doc))

    def block_sums(self) -> list:
        """Per domain: (nats per block, tokens per block)."""
        return [
            (np.array([ce[ix].sum() for ix in b]), np.array([tok[ix].sum() for ix in b]))
            for ce, tok, b in zip(self.ce, self.tok, self.blocks)
        ]


def _avg_ppl_of(sums: list) -> np.ndarray:
    """The paper's average: mean over domains of exp(nats / tokens); ``sums``: per domain
    (nats, tokens), each an array over resamples."""
    return np.mean([np.exp(ce / tok) for ce, tok in sums], axis=0)


def _token_loss_of(sums: list) -> np.ndarray:
    """Mean nats per token over every domain's (resampled) windows."""
    return np.sum([ce for ce, _ in sums], axis=0) / np.sum([tok for _, tok in sums], axis=0)


class Quantity:
    """What a table over seeds is on: its name, a run's value, and the same from
    resampled windows (for the bootstraps)."""

    def __init__(self, key, title, label, value, from_sums, digits):
        self.key, self.title, self.label, self.value, self.from_sums, self.digits = (
            key,
            title,
            label,
            value,
            from_sums,
            digits,
        )


AVG_PPL = Quantity(
    "ppl_seeds",
    "Validation perplexity over seeds (the paper's average: mean of per-domain perplexities)",
    "avg ppl",
    _avg_ppl,
    _avg_ppl_of,
    2,
)
TOKEN_LOSS = Quantity(
    "loss_seeds",
    "Token-weighted validation loss over seeds (mean nats per token over every window)",
    "loss (nats/token)",
    token_loss,
    _token_loss_of,
    4,
)


def _resample_counts(rng, blocks: int, draws: int) -> np.ndarray:
    """(draws, blocks) counts: how often each block is drawn in each resample."""
    idx = rng.integers(0, blocks, size=(draws, blocks))
    counts = np.zeros((draws, blocks))
    np.add.at(counts, (np.arange(draws)[:, None], idx), 1.0)
    return counts


def window_bootstrap(q: Quantity, pairs: list, draws: int = stats.BOOT_DRAWS, seed: int = stats.BOOT_SEED):
    """Resampling the evaluation set of each seed's paired runs ``pairs`` [(Windows a,
    Windows b or None)]: (per-seed statistic arrays (seeds, draws), rng) where each
    draw resamples every domain's document blocks, the same blocks for both runs of a pair
    and for every seed whose windows are the same documents (a fixed evaluation set is
    drawn once per resample, not once per seed). None when a pair's windows differ."""
    rng = np.random.Generator(np.random.PCG64(seed))
    drawn: dict = {}
    out = []
    for a, b in pairs:
        if not a.ok or (b is not None and (not b.ok or a.docs != b.docs)):
            return None
        counts = []
        for d, blocks in enumerate(a.blocks):
            key = (d, a.docs[d])
            if key not in drawn:
                drawn[key] = _resample_counts(rng, len(blocks), draws)
            counts.append(drawn[key])
        va = q.from_sums([(c @ ce, c @ tok) for c, (ce, tok) in zip(counts, a.block_sums())])
        vb = q.from_sums([(c @ ce, c @ tok) for c, (ce, tok) in zip(counts, b.block_sums())]) if b else 0.0
        out.append(va - vb)
    return np.asarray(out), rng


def _domains_of(runs) -> list | None:
    doms = [sorted(_ppl_domains(r) or {}) for r in runs]
    return doms[0] if doms and all(d == doms[0] and d for d in doms) else None


def eval_set_errors(q: Quantity, runs: dict, refs: dict, seeds: list) -> dict:
    """The evaluation set's share of a seed-paired difference over ``seeds``: {"se_windows":
    the bootstrap SD of the mean difference with the seeds fixed, "lo2", "hi2": the
    two-level percentile interval (resample seeds, then each domain's document blocks)};
    {} when a run kept no windows."""
    doms = _domains_of([runs[s] for s in seeds] + [refs[s] for s in seeds])
    if doms is None:
        return {}
    pairs = [(Windows(runs[s], doms), Windows(refs[s], doms)) for s in seeds]
    got = window_bootstrap(q, pairs)
    if got is None:
        return {}
    per_seed, rng = got  # (seeds, draws)
    n, draws = per_seed.shape
    pick = rng.integers(0, n, size=(draws, n))  # seeds drawn in each resample
    two_level = per_seed[pick, np.arange(draws)[:, None]].mean(axis=1)
    alpha = (1.0 - stats.LEVEL) / 2.0
    return {
        "se_windows": float(per_seed.mean(axis=0).std(ddof=1)),
        "lo2": float(np.quantile(two_level, alpha)),
        "hi2": float(np.quantile(two_level, 1.0 - alpha)),
        "documents_known": all(a.documents_known for a, _ in pairs),
    }


def one_seed_bootstrap(q: Quantity, run: RunData, ref: RunData | None, domains: list | None = None):
    """(lo, hi, n windows) of ``q`` of one run (``ref`` None) or of its difference from
    ``ref`` at the same seed (the same windows drawn for both); None without windows."""
    domains = domains or _domains_of([run] + ([ref] if ref is not None else []))
    if not domains:
        return None
    a = Windows(run, domains)
    got = window_bootstrap(q, [(a, Windows(ref, domains) if ref is not None else None)])
    if got is None:
        return None
    values = got[0][0]
    alpha = (1.0 - stats.LEVEL) / 2.0
    lo, hi = float(np.quantile(values, alpha)), float(np.quantile(values, 1.0 - alpha))
    return lo, hi, sum(len(ce) for ce in a.ce)


def _sampling_note(runs) -> str | None:
    """What the windows are, said once: random (seeded) or the first N of each domain, and
    whether documents are known (old files: first windows, each window its own block)."""
    sampling = set()
    docs = set()
    for r in runs:
        if _ppl_domains(r) is None:
            continue
        st = (r.evals.get("ppl") or {}).get("settings") or {}
        sampling.add(st.get("window_sampling") or "first")
        docs.add(all(isinstance(v, dict) and isinstance(v.get("batch_doc"), list) for v in _ppl_domains(r).values()))  # type: ignore[union-attr]
    parts = []
    if "first" in sampling:
        parts.append(
            "windows: the first windows of each domain for "
            + ("every run" if sampling == {"first"} else "some runs")
            + " (an eval without window_sampling), not a random sample"
        )
    if "random" in sampling:
        parts.append("windows drawn at random, seeded (settings.window_seed)")
    if False in docs:
        who = "every run" if docs == {False} else "some runs"
        parts.append(f"documents unknown (no batch_doc) for {who}: each window is its own block")
    return "; ".join(parts) + "." if parts else None


def _values(q: Quantity, seeds: dict) -> tuple:
    """({seed: value} of the runs with a result, [seeds of the runs without one])."""
    vals, missing = {}, []
    for s, r in seeds.items():
        v = q.value(r)
        if v is None:
            missing.append(s)
        else:
            vals[s] = v
    return vals, missing


def _comparison(q: Quantity, groups: dict, g: str, ref_g: str) -> dict:
    """``g`` minus ``ref_g`` on ``q``: seed-paired over their common seeds (with the
    evaluation set's errors), else a one-seed bootstrap at a seed both have."""
    vals, _ = _values(q, groups[g])
    ref_vals, _ = _values(q, groups[ref_g])
    cmp = compare(vals, ref_vals)
    if cmp:
        cmp.update(eval_set_errors(q, groups[g], groups[ref_g], cmp["seeds"]))
        cmp["se_seeds"] = cmp["sd"] / math.sqrt(cmp["n"])
        return cmp
    common = sorted(set(vals) & set(ref_vals), key=lambda s: (s is None, s or 0))
    if len(common) != 1:
        return {"seeds": [], "method": "no seed in common" if vals and ref_vals else "—"}
    s = common[0]  # never two different seeds
    b = one_seed_bootstrap(q, groups[g][s], groups[ref_g][s])
    out = {"n": 1, "seeds": [s], "mean": vals[s] - ref_vals[s]}
    if b is None:
        return {**out, "method": "one seed, no windows kept: no interval"}
    if b[0] == b[1]:
        return {**out, "method": f"{UNDEFINED}: zero variance over {b[2]} windows (1 seed)"}
    return {**out, "lo": b[0], "hi": b[1], "method": f"bootstrap over {b[2]} eval windows (1 seed)"}


SEED_HEADERS = [
    "seeds",
    "no result",
    "n (mean)",
    "mean",
    "std",
    "Δ",
    "Δ seeds",
    "n (Δ)",
    "df",
    "95% lo",
    "95% hi",
    "interval",
    EXCLUDES,
    "Holm p",
    HOLM,
    "SE seeds",
    "SE eval windows",
    "two-level 95% lo",
    "two-level 95% hi",
    "seeds for 80% power",
]


def _cmp_cells(cmp: dict, is_ref: bool) -> list:
    return [
        None if is_ref else cmp.get("mean"),
        "—" if is_ref else _seeds_text(cmp.get("seeds") or []),
        None if is_ref else cmp.get("n"),
        None if is_ref else cmp.get("df"),
        cmp.get("lo"),
        cmp.get("hi"),
        cmp.get("method") or ("reference row" if is_ref else "—"),
        _excludes_cell(cmp, is_ref),
        cmp.get("holm"),
        None if "holm" not in cmp else _yes_no(cmp["holm_excludes"]),
        cmp.get("se_seeds"),
        cmp.get("se_windows"),
        cmp.get("lo2"),
        cmp.get("hi2"),
        _power_cell(cmp),
    ]


def quantity_seed_table(runs, q: Quantity) -> Table | None:
    groups = {g: s for g, s in group_runs(runs).items() if any(q.value(r) is not None for r in s.values())}
    if not groups:
        return None
    refs = reference_of(groups)
    all_groups = group_runs(runs)
    rows, cmps = [], []
    for g in groups:
        seeds = all_groups[g]
        vals, missing = _values(q, seeds)
        mean, std = stats.mean_std(list(vals.values()))
        is_ref = refs[g] == g
        cmp = {} if is_ref else _comparison(q, groups, g, refs[g])
        if is_ref and len(vals) == 1:
            run = next(r for s, r in seeds.items() if s in vals)
            b = one_seed_bootstrap(q, run, None)
            if b is not None:
                cmp = {
                    "method": f"{q.label} itself: [{b[0]:.{q.digits}f}, {b[1]:.{q.digits}f}], "
                    f"bootstrap over {b[2]} windows"
                }
        cmps.append(cmp)
        model = next(iter(seeds.values())).variant
        rows.append(
            [
                g,
                VARIANT_LABELS.get(model, model) if model else None,
                _seeds_text(vals),
                _seeds_text(missing) if missing else "—",
                len(vals),
                mean,
                std,
            ]
            + [cmp, is_ref]
        )
    family = adjust_family(cmps)
    rows = [r[:-2] + _cmp_cells(r[-2], r[-1]) for r in rows]
    headers = ["run", "model", *SEED_HEADERS]
    headers[5] = f"{q.label} (mean)"
    headers[7] = f"Δ {q.label} vs reference"
    t = Table(q.key, q.title, headers, rows, _seed_notes(q, family, "its reference row", runs), digits=q.digits)
    t.provenance = {g: {"seed": group_seeds(all_groups[g])} for g in groups}
    return t


def _seed_notes(q: Quantity, family: int, family_of: str, runs) -> list:
    notes = [
        f"Every interval of this table is on {q.label}: "
        + (
            "the paper's average, the mean of the per-domain perplexities (comparable with the paper; "
            "dominated by high-perplexity domains with few windows; the token-weighted loss is the loss_seeds table)."
            if q is AVG_PPL
            else "mean nats per token over every evaluated window of every domain (each token counts once; "
            "the paper's average perplexity is the ppl_seeds table)."
        ),
        "seeds: the seeds with a result (mean, std over them, n - 1); no result: runs of the row whose "
        "evaluation is missing or null, named and left out of the mean and of every interval.",
        f"Δ: the row minus {family_of}, over the seeds both rows have (Δ seeds, n (Δ)); t-interval with "
        "n - 1 df where n >= 2; with one seed in common, a paired percentile bootstrap over that seed's "
        f"evaluation windows ({stats.BOOT_DRAWS} resamples, stratified by domain, documents as blocks), "
        "which says what the evaluation set resolves, not what another seed would give; "
        f"{UNDEFINED}: every paired difference is equal (zero variance), no interval.",
        f"{EXCLUDES}: yes or no, not a claim of no effect. Holm p: the t-test's p-value after Holm's adjustment "
        f"over the family of this table's {family} seed-paired comparison(s) (each row against {family_of}); "
        f"{HOLM}: Holm p < {1 - stats.LEVEL:.2f}.",
        "SE seeds: SD of the paired differences / sqrt(n) (conditional on the one evaluation set every seed "
        "shares); SE eval windows: the bootstrap SD of the mean difference over resamples of the evaluation "
        "set's document blocks (seeds fixed); two-level: percentile interval of a bootstrap that resamples "
        f"the seeds, then each domain's document blocks ({stats.BOOT_DRAWS} resamples, generator seed "
        f"{stats.BOOT_SEED}; the same blocks for every seed that shares the evaluation windows). With few "
        "seeds it is narrower than the t-interval (n seeds give few distinct resamples and no t quantile): "
        f"it shows what the evaluation set adds, while '{EXCLUDES}' and Holm are on the t-interval.",
        "seeds for 80% power: the fewest seeds at which a two-sided paired t-test (level 0.05) detects the "
        "observed mean difference at the observed paired SD with 80% power (SciPy's noncentral t, exact).",
    ]
    note = _sampling_note(runs)
    if note:
        notes.append(note)
    return notes


def contrast_table(runs, contrasts, quantities=None) -> Table | None:
    """One row per named contrast (``A - B``) and quantity, seed-paired as the seed
    tables; the family for Holm: the named contrasts of one quantity."""
    groups = group_runs(runs)
    pairs = contrast_pairs(groups, contrasts)
    if not pairs:
        return None
    rows = []
    for q in quantities or (AVG_PPL, TOKEN_LOSS):
        have = {g: s for g, s in groups.items() if any(q.value(r) is not None for r in s.values())}
        cmps = []
        for name, a, b in pairs:
            if a not in have or b not in have:
                continue
            cmp = _comparison(q, have, a, b)
            cmps.append(cmp)
            rows.append([name, q.label, a, b, cmp])
        adjust_family(cmps)
    if not rows:
        return None
    headers = ["contrast", "quantity", "row A", "row B", *SEED_HEADERS[5:]]
    headers[4] = "Δ (A - B)"
    rows = [r[:-1] + _cmp_cells(r[-1], False) for r in rows]
    notes = [
        "Contrasts named in the pipeline config (contrasts) or with --contrast, fixed before the results were "
        "seen; each quantity's contrasts are one family for Holm. Columns as the ppl_seeds table: Δ is A minus "
        "B over the seeds both rows have (n, df = n - 1); avg ppl is the paper's average (mean of per-domain "
        "perplexities), loss the token-weighted mean nats per token.",
    ]
    t = Table("contrasts", "Named contrasts over seeds, with paired 95% intervals", headers, rows, notes, digits=4)
    return t


def ppl_domain_table(runs) -> Table | None:
    """Per run row and domain: the mean over seeds and the seed-paired difference from the
    reference (numbers, one line per domain)."""
    groups = {g: s for g, s in group_runs(runs).items() if any(_ppl_domains(r) for r in s.values())}
    if not groups:
        return None
    refs = reference_of(groups)
    domains = sorted({d for s in groups.values() for r in s.values() for d in (_ppl_domains(r) or {})})
    rows, cmps = [], []
    for g, seeds in groups.items():
        for d in domains:

            def dom(r, d=d):
                return _num(((_ppl_domains(r) or {}).get(d) or {}).get("ppl"))

            q = Quantity("", "", f"{d} ppl", dom, lambda sums: np.exp(sums[0][0] / sums[0][1]), 2)
            vals, missing = _values(q, seeds)
            if not vals:
                continue
            mean, std = stats.mean_std(list(vals.values()))
            is_ref = refs[g] == g
            cmp: dict = {}
            if not is_ref:
                ref_vals, _ = _values(q, groups[refs[g]])
                cmp = compare(vals, ref_vals)
                common = sorted(set(vals) & set(ref_vals), key=lambda s: (s is None, s or 0))
                if not cmp and len(common) == 1:
                    s = common[0]
                    b = one_seed_bootstrap(q, seeds[s], groups[refs[g]][s], [d])
                    cmp = {"n": 1, "seeds": [s], "mean": vals[s] - ref_vals[s]}
                    if b is not None and b[0] != b[1]:
                        cmp.update(lo=b[0], hi=b[1], method=f"bootstrap over {b[2]} windows (1 seed)")
                    elif b is not None:
                        cmp["method"] = f"{UNDEFINED}: zero variance (1 seed)"
            cmps.append(cmp)
            rows.append(
                [g, d, _seeds_text(vals), _seeds_text(missing) if missing else "—", len(vals), mean, std, cmp, is_ref]
            )
    family = adjust_family(cmps)
    out_rows = []
    for *head, cmp, is_ref in rows:
        out_rows.append(head + _cmp_cells(cmp, is_ref)[:10])
    headers = [
        "run",
        "domain",
        "seeds",
        "no result",
        "n (mean)",
        "ppl (mean)",
        "std",
        "Δ vs reference",
        "Δ seeds",
        "n (Δ)",
        "df",
        "95% lo",
        "95% hi",
        "interval",
        EXCLUDES,
        "Holm p",
        HOLM,
    ]
    notes = [
        "Each line: one row's perplexity on one domain, mean ± std over its seeds, and its paired difference "
        "from the reference row (t over the common seeds, or a bootstrap over that domain's windows with one "
        f"seed). Holm: over the family of this table's {family} per-domain seed-paired comparisons."
    ]
    t = Table("ppl_seeds_domains", "Per-domain perplexity over seeds", headers, out_rows, notes)
    t.provenance = {g: {"seed": group_seeds(seeds)} for g, seeds in groups.items()}
    return t


# ------------------------------------------------------------------ needle
def _needle(run: RunData) -> list:
    """[(context, count, mean accuracy, {prompt id: [scores]} or None)]. A prompt's id is
    the eval's ``prompt_ids`` entry (a hash of its tokens: equal prompts, equal ids, across
    runs too), else (needle seed, context, count, depth, sample index), seed 0 when the
    eval recorded none (files written before the prompts were seeded per run)."""
    res = (run.evals.get("needle") or {}).get("results") or {}
    seed = (res.get("settings") or {}).get("seed")
    seed = seed if isinstance(seed, int) else 0
    out = []
    for ctx, counts in sorted((res.get("accuracy") or {}).items(), key=lambda kv: int(kv[0])):
        for n, row in sorted(counts.items(), key=lambda kv: int(kv[0])):
            scores, ids = row.get("scores"), row.get("prompt_ids") or {}
            by_prompt = None
            if isinstance(scores, dict):
                by_prompt = {}
                for depth in sorted(scores, key=float):
                    pid = ids.get(depth) if isinstance(ids, dict) else None
                    for i, v in enumerate(scores[depth]):
                        key = (
                            pid[i]
                            if isinstance(pid, list) and len(pid) == len(scores[depth])
                            else f"{seed}:{ctx}:{n}:{depth}:{i}"
                        )
                        by_prompt.setdefault(str(key), []).append(float(v))
            out.append((str(ctx), str(n), float(row["mean"]), by_prompt))
    return out


def _prompt_means(prompts: dict) -> dict:
    return {k: float(np.mean(v)) for k, v in prompts.items()}


def needle_seed_table(runs) -> Table | None:
    groups = {g: s for g, s in group_runs(runs).items() if any(_needle(r) for r in s.values())}
    if not groups:
        return None
    refs = reference_of(groups)
    all_groups = group_runs(runs)
    rows, cmps = [], []

    def at(members: dict, c, n):
        acc, sc = {}, {}
        for s, r in members.items():
            for cc, nn, a, p in _needle(r):
                if (cc, nn) == (c, n):
                    acc[s], sc[s] = a, p
        return acc, sc

    for g, seeds in groups.items():
        settings = {(c, n) for r in seeds.values() for c, n, _, _ in _needle(r)}
        for c, n in sorted(settings, key=lambda x: (int(x[0]), int(x[1]))):
            acc, scores = at(seeds, c, n)
            missing = [s for s in all_groups[g] if s not in acc]
            mean, std = stats.mean_std(list(acc.values()))
            ref_g = refs[g]
            ref_acc, ref_sc = at(groups[ref_g], c, n)
            pooled: dict = {}
            for p in scores.values():
                for k, v in (p or {}).items():
                    pooled.setdefault(k, []).extend(v)
            binary = pooled and all(x in (0.0, 1.0) for v in pooled.values() for x in v)
            per_prompt = _prompt_means(pooled)
            binom = stats.wilson(sum(per_prompt.values()), len(per_prompt)) if binary else None
            cmp: dict = {}
            if ref_g != g:
                cmp = compare(acc, ref_acc)
                common = sorted(set(acc) & set(ref_acc), key=lambda s: (s is None, s or 0))
                if not cmp and len(common) == 1:
                    s = common[0]  # never two different seeds
                    cmp = {"n": 1, "seeds": [s], "mean": acc[s] - ref_acc[s]}
                    a, b = _prompt_means(scores.get(s) or {}), _prompt_means(ref_sc.get(s) or {})
                    ids = sorted(set(a) & set(b))
                    if ids:
                        xa, xb = np.array([a[k] for k in ids]), np.array([b[k] for k in ids])
                        lo, hi = stats.bootstrap(
                            lambda idx, xa=xa, xb=xb: float(xa[idx[0]].mean() - xb[idx[0]].mean()), [len(ids)]
                        )
                        if lo == hi:
                            cmp["method"] = f"{UNDEFINED}: zero variance over {len(ids)} paired prompts (1 seed)"
                        else:
                            cmp.update(
                                lo=lo, hi=hi, method=f"bootstrap over {len(ids)} distinct paired prompts (1 seed)"
                            )
                    else:
                        cmp["method"] = "one seed, no common prompts: no interval"
            cmps.append(cmp)
            rows.append(
                [
                    g,
                    int(c),
                    int(n),
                    _seeds_text(acc),
                    _seeds_text(missing) if missing else "—",
                    len(acc),
                    100 * mean,
                    None if std is None else 100 * std,
                    None if binom is None else 100 * binom[1],
                    None if binom is None else 100 * binom[2],
                    len(per_prompt) or None,
                    sum(len(v) for v in pooled.values()) or None,
                    cmp,
                    ref_g == g,
                ]
            )
    adjust_family(cmps)
    out = []
    for *head, cmp, is_ref in rows:
        cells = _cmp_cells(cmp, is_ref)
        pts = [None if v is None else 100 * v for v in (cells[0], cells[4], cells[5])]
        out.append(head + [pts[0], *cells[1:4], pts[1], pts[2], *cells[6:10], _power_cell(cmp)])
    headers = [
        "run",
        "context",
        "needles",
        "seeds",
        "no result",
        "n (mean)",
        "accuracy % (mean)",
        "std",
        "Wilson 95% lo",
        "Wilson 95% hi",
        "distinct prompts",
        "samples",
        "Δ vs reference (points)",
        "Δ seeds",
        "n (Δ)",
        "df",
        "95% lo",
        "95% hi",
        "interval",
        EXCLUDES,
        "Holm p",
        HOLM,
        "seeds for 80% power",
    ]
    notes = [
        "Accuracy: mean over depths and samples, then over seeds; the Wilson interval counts distinct prompts "
        "(a prompt repeated across seeds or samples is one unit, scored by its mean over repeats: repeats "
        "of one prompt are not independent samples); it says what the prompts resolve, not what another seed "
        "would give. Prompts are identified by the eval's prompt_ids, else by (needle seed, context, needles, "
        "depth, sample index) with seed 0 where the eval recorded none.",
        "Δ: seed-paired t-interval over the seeds both rows have (n - 1 df) where n >= 2, else a percentile "
        "bootstrap over the distinct prompts both runs of that one seed were given; "
        f"{UNDEFINED}: zero variance, no interval. Holm: over this table's seed-paired comparisons.",
    ]
    t = Table("needle_seeds", "Multi-needle accuracy over seeds, with 95% intervals", headers, out, notes)
    t.provenance = {g: {"seed": group_seeds(all_groups[g])} for g in groups}
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
        common: list = []
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
                        cmp = {
                            "mean": d,
                            "seeds": common,
                            "lo": d - half,
                            "hi": d + half,
                            "method": "normal, unpaired (1 seed)",
                        }
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
                    "—" if ref_g == g else _seeds_text(cmp.get("seeds") or common),
                    cmp.get("lo"),
                    cmp.get("hi"),
                    cmp.get("method") or ("reference row" if ref_g == g else "—"),
                    _excludes_cell(cmp, ref_g == g),
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
        "Δ seeds",
        "Δ 95% lo",
        "Δ 95% hi",
        "interval",
        EXCLUDES,
    ]
    notes = [
        "One seed: the accuracy's 95% interval is lm-eval's stderr (normal) where it reported one, else a "
        "Wilson interval over the task's samples; the difference from the reference adds the two "
        "variances (unpaired: lm-eval keeps no per-sample scores here). Two seeds or more: the seed-paired "
        f"t-interval (n - 1 df). {EXCLUDES}: yes or no; {UNDEFINED}: zero variance, no interval.",
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


def seed_tables(runs, contrasts=()) -> list:
    """The tables over seeds that the runs have data for: when some row has two seeds or
    more, or some run's evals kept their windows or samples (results written before they
    did give no interval: no table). ``contrasts``: [(A, B)] named contrasts."""
    if not any(len(g) > 1 for g in group_runs(runs).values()) and not any(_has_units(r) for r in runs):
        if contrasts:
            contrast_pairs(group_runs(runs), contrasts)  # a contrast that names no row: refused
        return []
    tables = [
        quantity_seed_table(runs, AVG_PPL),
        quantity_seed_table(runs, TOKEN_LOSS),
        contrast_table(runs, contrasts),
    ]
    tables += [m(runs) for m in (ppl_domain_table, needle_seed_table, benchmark_seed_table)]
    return [t for t in tables if t is not None]
