"""The paper's tables built from loaded runs (``mta_repro.report.runs``; rendered by
``mta_repro.report.render``): perplexity, benchmarks, LAMBADA, the Table 5 ablations,
needles and BabiLong.

Every row carries the paper's number where the paper has one for that run's variant
*and stage* (pretraining, 4K long-context finetune, Appendix I insertion), the difference
to the baseline run of the same stage and size, and whether the run is comparable with
the paper's setting (model size, steps); the notes under each table say what was counted.
Under each table a provenance block says what each row's numbers came from (checkpoint,
tokens seen, tokenizer, data, code: the eval JSONs' "provenance"), and rows that are not
comparable with the rows beside them (another tokenizer or validation set, an eval older
than the run's newest checkpoint) are marked "(!)" (docs/provenance.md).
"""

from __future__ import annotations

from pathlib import Path

from mta_repro.eval.benchmarks import BENCH_METRIC, BENCH_TASKS, LOCAL_SUFFIX, canonical_task
from mta_repro.report import paper
from mta_repro.report.render import Table
from mta_repro.report.runs import RunData, cfg_get, results_of, results_or_none

BENCH_ORDER = list(BENCH_TASKS)
# Old task names of this project -> lm-eval 0.4.x names.
STAGE_LABELS = {
    "pretrain": "pretrain",
    "long_context": "4K finetune",
    "insertion": "MTA insertion",
    "continued": "continued training",
}
# Stages compared with each other: Appendix I's MTA insertion against its control.
STAGE_GROUP = {"continued": "insertion"}


def size_name(run: RunData) -> str | None:
    shape = run.shape
    return next((n for n, s in paper.SIZES.items() if s == shape), None)


def paper_setting(run: RunData) -> dict | None:
    """What the paper's number for this run was measured on: the stage's setting; for
    Appendix I (the insertion and its control) the run's own model (1.4B or a Llama 3)."""
    size = size_name(run)
    if run.stage in paper.APPENDIX_I_STAGES and size is not None and size in paper.APPENDIX_I:
        return paper.appendix_i_setting(size, run.stage)
    return paper.PAPER_SETTING.get(run.stage)


def paper_numbers(run: RunData) -> dict:
    """{variant: avg ppl} the paper has for this run's stage (Appendix I: its own model's
    pair; none for a model the appendix did not finetune)."""
    if run.stage in paper.APPENDIX_I_STAGES:
        size = size_name(run)
        a = paper.APPENDIX_I.get(size) if size is not None else None
        if a is None:
            return {}
        return {"mta": a["mta"], "baseline": a["baseline"]} if run.stage == "insertion" else {"baseline": a["baseline"]}
    return paper.AVG_PPL_BY_STAGE.get(run.stage, {})


def comparability(run: RunData) -> str | None:
    """None when the run is in the paper's setting for its stage, else why it is not."""
    setting = paper_setting(run)
    if setting is None:
        return "no paper number for this stage"
    why = []
    if run.stage in paper.APPENDIX_I_STAGES and size_name(run) not in paper.APPENDIX_I:
        shape = run.shape
        got = f"dim {shape[0]} x {shape[1]} layers" if shape else "unknown size"
        models = ", ".join(a["label"] for a in paper.APPENDIX_I.values())
        return f"model {got}; Appendix I finetuned {models}"
    if size_name(run) != setting["size"]:
        shape = run.shape
        got = f"dim {shape[0]} x {shape[1]} layers" if shape else "unknown size"
        why.append(f"model {got}, paper {setting['label']}")
    step = run.step
    if step is None or step < setting["steps"]:
        why.append(f"{'?' if step is None else f'{step:,}'} of the paper's {setting['steps']:,} steps")
    return "; ".join(why) or None


def _model(run: RunData) -> str | None:
    return paper.VARIANT_LABELS.get(run.variant, run.variant) if run.variant is not None else None


def baseline_of(run: RunData, runs) -> RunData | None:
    """The baseline run of the same stage and model shape: the one of the same seed where
    the labels name seeds (``.../seed<k>``; None when that seed has none), else the first
    one given."""
    group = STAGE_GROUP.get(run.stage, run.stage)
    same = [
        r
        for r in runs
        if r.variant == "baseline" and STAGE_GROUP.get(r.stage, r.stage) == group and r.shape == run.shape
    ]
    seed = run.label.rsplit("/", 1)[-1] if "/seed" in run.label else None
    if seed is not None and any("/seed" in r.label for r in same):
        # seeds named: only the same seed's baseline; none at that seed, no difference
        # (another seed's baseline would put the seeds' own spread into the Δ)
        return next((r for r in same if r.label.rsplit("/", 1)[-1] == seed), None)
    return (same or [None])[0]


def _diff(a, b):
    d = None if a is None or b is None else a - b
    return None if d != d else d  # inf - inf (two diverged runs): no difference to show


def _paper_note(stages, runs=()) -> str:
    parts = []
    for s in ("pretrain", "long_context", "insertion", "continued"):
        if s not in stages:
            continue
        # Appendix I: each model's own setting (1.4B, Llama 3.2 1B, ...) among the runs given
        sizes = [n for n in paper.APPENDIX_I if any(r.stage == s and size_name(r) == n for r in runs)]
        if s in paper.APPENDIX_I_STAGES and sizes:
            parts += [f"{STAGE_LABELS[s]}: the paper's {paper.appendix_i_setting(n, s)['what']}" for n in sizes]
        else:
            parts.append(f"{STAGE_LABELS[s]}: the paper's {paper.PAPER_SETTING[s]['what']}")
    return "Paper numbers: " + "; ".join(parts) + ". Rows marked in 'vs paper' are not comparable."


def ppl_length(run: RunData) -> int | None:
    """The window (tokens) a run's perplexity was measured at (eval/ppl.json)."""
    res = results_or_none(run, "ppl") or {}
    n = res.get("seq_len")
    return int(n) if isinstance(n, (int, float)) else None


def ppl_comparison(run: RunData) -> str | None:
    """None when the run's perplexity is comparable with the paper's number for its stage
    (setting and window length), else why not."""
    setting = comparability(run)
    why = [setting] if setting else []
    want, got = paper.PPL_SEQ_LEN.get(run.stage), ppl_length(run)
    if want is not None and got != want:
        why.append(f"window {'?' if got is None else got} tokens, paper {want}")
    return "; ".join(why) or None


def _paper_ppl(run: RunData, numbers: dict) -> float | None:
    """The paper's number for this run, only when measured at the same window length."""
    if ppl_length(run) is None or ppl_length(run) != paper.PPL_SEQ_LEN.get(run.stage):
        return None
    return numbers.get(run.variant)


def _trained(run: RunData) -> int | None:
    n = cfg_get(run.config, "data.seq_len")
    return int(n) if isinstance(n, int) else None


def ppl_table(runs) -> Table | None:
    have = [r for r in runs if results_or_none(r, "ppl")]
    if not have:
        return None
    domains = sorted({d for r in have for d in results_of(r, "ppl")["domains"]})
    rows = []
    for r in have:
        res = results_of(r, "ppl")
        base = baseline_of(r, have)
        numbers = paper_numbers(r)
        p = _paper_ppl(r, numbers)
        p_base = numbers.get("baseline") if p is not None else None
        avg = res["average"]
        base_avg = None
        if base is not None and ppl_length(base) == ppl_length(r):
            base_avg = results_of(base, "ppl")["average"]
        why = ppl_comparison(r)
        rows.append(
            [r.label, _model(r), STAGE_LABELS.get(r.stage, r.stage), _trained(r), ppl_length(r)]
            + [res["domains"].get(d, {}).get("ppl") for d in domains]
            + [avg, _diff(avg, base_avg), p, _diff(p, p_base), f"no: {why}" if why else "yes"]
        )
    lens = ", ".join(f"{STAGE_LABELS[s]} {n}" for s, n in paper.PPL_SEQ_LEN.items() if s in {r.stage for r in have})
    notes = [
        _paper_note({r.stage for r in have}, have),
        "trained = the context the run was trained at (data.seq_len); window = the tokens per window the "
        f"perplexity was measured at. The paper's windows: {lens}; a paper number is shown only for a run "
        "measured at the same window (docs/evaluation.md).",
        "Measured by python -m mta_repro.eval (eval/ppl.json), not the validation logged during training "
        "(metrics.jsonl val_ppl, over trainer.eval_max_batches batches): the two can differ.",
        "Δ = this run's average minus the baseline run's of the same stage, size and window; "
        "paper Δ = the same difference in the paper.",
    ]
    return Table(
        "ppl",
        "Validation perplexity per domain",
        ["run", "model", "stage", "trained", "window"]
        + domains
        + ["avg", "Δ vs baseline", "paper avg", "paper Δ", "vs paper"],
        rows,
        notes,
    )


def _canonical(name: str) -> tuple:
    """(paper task name, local copy?) for an lm-eval task name in a summary."""
    return canonical_task(name), name.endswith(LOCAL_SUFFIX)


def _bench_summary(run: RunData) -> tuple:
    """({paper task: accuracy}, {paper task: metric used}, [local copies seen])."""
    res = results_of(run, "benchmarks")
    out, metric, local = {}, {}, []
    for name, v in res["summary"].items():
        if name in ("average", "metrics") or not isinstance(v, (int, float)):
            continue
        task, is_local = _canonical(name)
        out[task] = v
        recorded = (res.get("metrics") or {}).get(name)
        # results written before the metric was recorded: acc, acc_norm for HellaSwag
        metric[task] = recorded or ("acc_norm" if task == "hellaswag" else "acc")
        if is_local:
            local.append(name)
    return out, metric, local


def benchmark_table(runs) -> Table | None:
    have = [r for r in runs if results_or_none(r, "benchmarks")]
    if not have:
        return None
    sums = {r.label: _bench_summary(r) for r in have}
    present = {t for s, _, _ in sums.values() for t in s}
    cols = [t for t in BENCH_ORDER if t in present] + sorted(present - set(BENCH_ORDER))
    metric = {t: next((m[t] for _, m, _ in sums.values() if t in m), BENCH_METRIC.get(t, "acc")) for t in cols}
    rows, notes = [], []
    for r in have:
        s, _, local = sums[r.label]
        accs = [s[c] for c in cols if c in s]
        avg = sum(accs) / len(accs) if accs else None
        base = baseline_of(r, have)
        base_avg = None
        if base is not None:
            bs = sums[base.label][0]
            base_avg = sum(bs.values()) / len(bs) if bs else None
        p = paper.BENCH_AVG.get(r.variant) if r.stage == "pretrain" else None
        why = comparability(r) or ""
        n_paper = sum(1 for c in BENCH_TASKS if c in s)
        if n_paper < len(BENCH_TASKS):
            why = (why + "; " if why else "") + f"avg over {n_paper} of the paper's {len(BENCH_TASKS)} tasks"
        rows.append(
            [r.label, _model(r), STAGE_LABELS.get(r.stage, r.stage)]
            + [s.get(c) for c in cols]
            + [
                avg,
                _diff(avg, base_avg),
                p,
                _diff(p, paper.BENCH_AVG.get("baseline") if p else None),
                f"no: {why}" if why else "yes",
            ]
        )
        if local:
            notes.append(
                f"{r.label}: {', '.join(sorted(local))} counted as "
                f"{', '.join(_canonical(n)[0] for n in sorted(local))} (local copies of the task's data)"
            )
        limit = results_of(r, "benchmarks").get("limit")
        if limit:
            notes.append(f"{r.label}: at most {limit} examples per task (lm_eval.limit), not a reported number")
    mismatch = [c for c in cols if c in BENCH_METRIC and metric[c] != BENCH_METRIC[c]]
    if mismatch:
        notes.append(
            "not the paper's metric for "
            + ", ".join(f"{c} ({metric[c]}, paper {BENCH_METRIC[c]})" for c in mismatch)
            + ": re-evaluate"
        )
    notes.insert(
        0,
        "Metric per task (lm-eval), the one the paper's table reports: "
        + ", ".join(f"{c} {metric[c]}" for c in cols)
        + "; MMLU 5-shot, the rest zero-shot. paper avg: the paper's mean over the nine tasks "
        f"({paper.PAPER_SETTING['pretrain']['what']}, pretrained models only).",
    )
    return Table(
        "benchmarks",
        "Zero-shot benchmarks and MMLU 5-shot, accuracy %",
        ["run", "model", "stage"]
        + [f"{c} ({metric[c]})" for c in cols]
        + ["avg", "Δ vs baseline", "paper avg", "paper Δ", "vs paper"],
        rows,
        notes,
    )


def lambada_table(runs) -> Table | None:
    have = [r for r in runs if results_or_none(r, "lambada")]
    if not have:
        return None
    rows, notes = [], []
    for r in have:
        s = {}
        local = []
        for name, v in results_of(r, "lambada")["summary"].items():
            task, is_local = _canonical(name)
            s[task] = v
            if is_local:
                local.append(name)
        p = paper.LAMBADA.get(r.variant, (None, None)) if r.stage == "pretrain" else (None, None)
        rows.append(
            [
                r.label,
                _model(r),
                STAGE_LABELS.get(r.stage, r.stage),
                results_of(r, "lambada").get("max_length"),
                (s.get("lambada_standard") or {}).get("ppl"),
                p[0],
                (s.get("lambada_openai") or {}).get("ppl"),
                p[1],
                comparability(r) and f"no: {comparability(r)}" or "yes",
            ]
        )
        if local:
            notes.append(
                f"{r.label}: {', '.join(sorted(local))} counted as "
                f"{', '.join(_canonical(n)[0] for n in sorted(local))} (local copies of the task's data)"
            )
    notes.insert(
        0,
        "Perplexity of the last word; context = the longest input in tokens (lm_eval.max_length, "
        "the trained context by default; longer passages are left-truncated). "
        + _paper_note({"pretrain"})
        + " The paper reports the Transformer and MTA only.",
    )
    return Table(
        "lambada",
        "LAMBADA perplexity",
        ["run", "model", "stage", "context", "standard", "paper standard", "OpenAI", "paper OpenAI", "vs paper"],
        rows,
        notes,
    )


RELEASE_KERNEL = (6, 11)


def describe_mta(cfg: dict | None) -> tuple:
    """(short description of the attention config, matching Table 5 row or None)."""
    if not cfg or "model" not in cfg:
        return "?", None
    m = cfg["model"]
    mta = m.get("mta") or {}
    if m.get("diff_transformer"):
        return "diff transformer", None
    if not mta.get("use_mta"):
        return "baseline", None
    parts = []
    pre, post = bool(mta.get("query_kernel_size")), bool(mta.get("after_sm_query_kernel_size"))
    kpre = (mta.get("query_kernel_size"), mta.get("key_kernel_size"))
    kpost = (mta.get("after_sm_query_kernel_size"), mta.get("after_sm_key_kernel_size"))
    if pre:
        parts.append(f"pre-sm conv {kpre[0]}x{kpre[1]}")
    if post:
        parts.append(f"post-sm conv {kpost[0]}x{kpost[1]}")
    layers = mta.get("mta_layers")
    if layers is not None and (pre or post):
        idx = [x.strip() for x in str(layers).split(",") if x.strip()]
        of = f" of {m['n_layers']}" if isinstance(m.get("n_layers"), int) else ""
        parts.append(f"conv in {len(idx)}{of} layers (index {','.join(idx)}, from 0)")
    head_mix = bool(mta.get("pre_sm_linear_head") or mta.get("head_kernel_size") or mta.get("post_sm_linear_head"))
    if head_mix:
        parts.append("head mix")
    if mta.get("group_norm"):
        parts.append("group norm")
    if mta.get("layer_norm_rescale"):
        parts.append("depth scaling")
    if mta.get("curse_norm"):
        parts.append("layer-norm scaling")
    gate = bool(mta.get("add_gating"))
    if gate:
        parts.append("gate 1d" if mta.get("gate_1d", True) else "gate")
    key = None
    n_layers = m.get("n_layers")
    release_layers = None
    if isinstance(n_layers, int):
        from mta_repro.resolvers import mta_layers_every

        try:
            release_layers = mta_layers_every(n_layers, 4)
        except ValueError:
            release_layers = None
    release = (
        pre
        and post
        and kpre == RELEASE_KERNEL
        and kpost == RELEASE_KERNEL
        and head_mix
        and bool(mta.get("group_norm"))
        and str(layers).replace(" ", "") == str(release_layers)
    )
    if release:
        rescale, curse = bool(mta.get("layer_norm_rescale")), bool(mta.get("curse_norm"))
        if gate and mta.get("gate_1d", True) and not (rescale and curse):
            key = (
                "pre+post-softmax conv, scalar gating"
                + (", depth scaling" if rescale else "")
                + (", layer-norm scaling" if curse else "")
            )
    return ", ".join(parts) or "explicit attention", key


def ablation_table(runs) -> Table | None:
    """Table 5: pretrained MTA runs that differ in their attention config (a sweep), or
    one that matches a Table 5 row. Absent otherwise (the ppl table has every run)."""
    have = [r for r in runs if results_or_none(r, "ppl") and r.stage == "pretrain" and r.variant == "mta"]
    described = {r.label: describe_mta(r.config) for r in have}
    if len({d for d, _ in described.values()}) < 2 and not any(k for _, k in described.values()):
        return None
    rows = []
    for r in have:
        desc, key = described[r.label]
        base = baseline_of(r, runs)
        avg = results_of(r, "ppl")["average"]
        p = paper.TABLE5.get(key) if key and ppl_length(r) == paper.PPL_SEQ_LEN["pretrain"] else None
        base_avg = None
        if base is not None and ppl_length(base) == ppl_length(r):
            base_avg = (results_or_none(base, "ppl") or {}).get("average")
        why = ppl_comparison(r)
        rows.append(
            [
                r.label,
                _model(r),
                ppl_length(r),
                desc,
                avg,
                _diff(avg, base_avg),
                p,
                key or "—",
                f"no: {why}" if why else "yes",
            ]
        )
    notes = [
        "paper (Table 5): the paper's 880M ablation (105B tokens, 2048-token windows) whose configuration "
        "this run matches (the release's MTA: 6x11 convolutions before and after softmax in every 4th layer "
        "from layer index 2, head mixing, group norm; then gating / depth scaling as named); other kernel "
        "sizes and conv-layer choices have no published number. The 11.41 row is the release's curse_norm "
        "(block norms times 1 - lambda_init(layer); 'one layer-norm-scaling configuration'), run by "
        "experiment=ablation_layer_norm_scaling. Δ vs baseline: the pretrained Transformer of the same size "
        "and window."
    ]
    return Table(
        "ablations",
        "Ablations (Table 5): average validation perplexity of MTA configurations",
        [
            "run",
            "model",
            "window",
            "attention config",
            "avg ppl",
            "Δ vs baseline",
            "paper (Table 5)",
            "Table 5 row",
            "vs paper",
        ],
        rows,
        notes,
    )


def needle_table(runs) -> Table | None:
    have = [r for r in runs if results_or_none(r, "needle")]
    if not have:
        return None
    counts = sorted({int(n) for r in have for c in results_of(r, "needle")["accuracy"].values() for n in c})
    rows = []
    for r in have:
        for ctx, per in sorted(results_of(r, "needle")["accuracy"].items(), key=lambda kv: int(kv[0])):
            rows.append(
                [r.label, _model(r), STAGE_LABELS.get(r.stage, r.stage), _trained(r), int(ctx)]
                + [100 * per[str(n)]["mean"] if str(n) in per else None for n in counts]
            )
    return Table(
        "needle",
        "Multi-needle NIAH accuracy % (averaged over depths)",
        ["run", "model", "stage", "trained", "context"] + [f"{n} needles" for n in counts],
        rows,
        [
            "The paper shows these as figures (2K after pretraining, 4K after the finetune), no table. "
            "trained = the run's data.seq_len; a context beyond it was evaluated with extrapolate=true."
        ],
    )


def babilong_source(run: RunData) -> str:
    e = run.evals.get("babilong") or {}
    src = e.get("source") or ((e.get("results") or {}).get("settings") or {}).get("source")
    return str(src) if src else "unknown"


def babilong_table(runs) -> Table | None:
    have = [r for r in runs if results_or_none(r, "babilong")]
    if not have:
        return None
    lengths = []
    for r in have:
        for length in results_of(r, "babilong")["mean"]:
            if length not in lengths:
                lengths.append(length)
    rows = []
    for r in have:
        res = results_of(r, "babilong")
        src = babilong_source(r)
        for task in sorted(res["accuracy"]):
            rows.append(
                [r.label, _model(r), src, task]
                + [100 * res["accuracy"][task].get(x) if x in res["accuracy"][task] else None for x in lengths]
            )
        rows.append(
            [r.label, _model(r), src, "mean"] + [100 * res["mean"][x] if x in res["mean"] else None for x in lengths]
        )
    notes = [
        "source: 'hf' = the benchmark's data (RMT-team/babilong, PG-19 haystack); 'generated' = this "
        "project's offline bAbI-style facts in the corpus's book domain (fixed fact counts, lengths in the "
        "model's tokens): not the benchmark, not comparable with the paper's figure."
    ]
    if any(babilong_source(r) == "hf" for r in have):
        notes.append("The paper shows BabiLong as a figure (QA1-QA5, 0K-4K); compare the 'hf' rows with it.")
    return Table(
        "babilong",
        "BabiLong QA1-QA5 accuracy % by context length",
        ["run", "model", "source", "task"] + lengths,
        rows,
        notes,
    )


# The eval JSON each table's rows come from; the lm-eval tables' data is lm-eval's own.
TABLE_TASK = {
    "ppl": "ppl",
    "ablations": "ppl",
    "benchmarks": "benchmarks",
    "lambada": "lambada",
    "needle": "needle",
    "babilong": "babilong",
}
LM_EVAL_TABLES = ("benchmarks", "lambada")
MARK = " (!)"


def _majority(values: list) -> tuple:
    """(the value more rows share than any other, []), or (None, the values tied for the
    most rows) when no value has more rows than every other (two rows, two tokenizers:
    neither is the odd one out). (None, []) when none is known."""
    known = [v for v in values if v is not None]
    counts = {v: known.count(v) for v in dict.fromkeys(known)}
    top = [v for v, n in counts.items() if n == max(counts.values())] if counts else []
    return (top[0], []) if len(top) == 1 else (None, top)


def _off(value, ref, tied: list, what: str, show) -> str | None:
    """Why a row's ``value`` (its tokenizer, its data) sets it apart, or None."""
    if value is None:
        return None
    if tied:
        return f"{what} {show(value)}; no majority among the rows ({', '.join(show(v) for v in tied)})"
    if ref is not None and value != ref:
        return f"{what} {show(value)}, most rows {show(ref)}"
    return None


def _lm_eval_data(data) -> str:
    """The task data an lm-eval row was scored on (the result's ``data``: eval's
    ``lm_eval_tasks.task_data`` per task), each distinct file or dataset once: a local
    file by name and sha256, a hub dataset by its revision ("unpinned" when none was
    known). Empty for a result that recorded none."""
    from mta_repro.runs.provenance import short

    if not isinstance(data, dict) or not data:
        return ""
    seen: list = []
    for d in data.values():
        if not isinstance(d, dict):
            continue
        for f in d.get("files") or []:
            if isinstance(f, dict):
                seen.append(f"{Path(str(f.get('path'))).name} {short(f.get('sha256'))}")
        if not d.get("files"):
            rev = d.get("revision")
            seen.append(f"{d.get('dataset')}@{short(rev) if rev else 'unpinned'}")
    return ("; task data " + ", ".join(dict.fromkeys(seen))) if seen else ""


def add_provenance(table: Table, runs) -> None:
    """Fill ``table.provenance`` from its rows' eval JSONs and mark (``MARK`` after the run's
    name) every row not comparable with the rows beside it: another tokenizer, another
    validation set (lm-eval tables: another lm-eval version) or other code (version, commit,
    modified; an unknown commit counts as its own) than most rows, or an evaluation older
    than the run's newest checkpoint."""
    from mta_repro.runs.provenance import code_key, code_label, short

    task = TABLE_TASK.get(table.name)
    by_label = {r.label: r for r in runs}
    labels = list(dict.fromkeys(row[0] for row in table.rows if row and row[0] in by_label))
    if task is None or not labels:
        return
    facts = {}
    for label in labels:
        e = by_label[label].evals.get(task) or {}
        p = e.get("provenance") or {}
        ck, tok, val, code = (
            p.get("checkpoint") or {},
            p.get("tokenizer") or {},
            p.get("validation") or {},
            p.get("code") or {},
        )
        data = (
            f"lm-eval {p.get('lm_eval') or '?'}{_lm_eval_data((e.get('results') or {}).get('data'))}"
            if table.name in LM_EVAL_TABLES
            else (
                f"validation {val.get('files')} file(s), {val.get('bytes'):,} bytes, {short(val.get('sha256'))}"
                if val.get("sha256")
                else None
            )
        )
        facts[label] = {
            "step": e.get("step"),
            "weights": ck.get("weights_sha256"),
            "tokens": ck.get("tokens_seen"),
            "tok": (tok.get("name"), tok.get("sha256")) if tok else None,
            "data": data,
            "code": code,
            "accepted": (p.get("run_accepted") or []) + (p.get("accepted") or []),
        }
    ref_tok, tied_tok = _majority([f["tok"] for f in facts.values()])
    ref_data, tied_data = _majority([f["data"] for f in facts.values()])
    ref_code, tied_code = _majority([code_key(f["code"]) for f in facts.values()])
    show_code = lambda k: code_label(dict(zip(("package", "commit", "dirty", "source"), k)))  # noqa: E731
    flagged = set()
    for label, f in facts.items():
        why = [
            w
            for w in (
                _off(f["tok"], ref_tok, tied_tok, "tokenizer", lambda t: short(t[1])),
                _off(f["data"], ref_data, tied_data, "data", str),
                _off(code_key(f["code"]), ref_code, tied_code, "code", show_code),
            )
            if w
        ]
        newest = by_label[label].final_step
        if isinstance(f["step"], int) and newest is not None and f["step"] < newest:
            why.append(f"evaluated at step {f['step']:,}; the run's newest checkpoint is step {newest:,}: re-evaluate")
        if why:
            flagged.add(label)
        step = "?" if f["step"] is None else f"{f['step']:,}"
        run = by_label[label]
        stage = STAGE_LABELS.get(run.stage, run.stage)
        table.provenance[label + (MARK if why else "")] = {
            "stage": f"{stage} (recorded)" if run.stage_recorded else f"{stage} (inferred: no run.stage)",
            "checkpoint": f"step {step}" + (f", weights {short(f['weights'])}" if f["weights"] else ""),
            "tokens seen": "—" if f["tokens"] is None else f"{f['tokens']:,}",
            "tokenizer": "—" if f["tok"] is None else f"{f['tok'][0]} {short(f['tok'][1])}",
            "data": f["data"] or "—",
            "code": code_label(f["code"]),
            "comparable": ("no: " + "; ".join(why))
            if why
            else ("yes" if f["tok"] is not None else "unknown (no provenance recorded)"),
            **(
                {
                    "accepted changes": "; ".join(
                        f"{a.get('what')} at step {a.get('step')}: {a.get('change')}" for a in f["accepted"]
                    )
                }
                if f["accepted"]
                else {}
            ),
        }
    for row in table.rows:
        if row and row[0] in flagged:
            row[0] = row[0] + MARK
    if flagged:
        table.notes.append(
            f"{MARK.strip()}: not comparable with the rows beside it, or evaluated before its run's "
            "newest checkpoint; the provenance block under the table says why."
        )
    if any("accepted changes" in p for p in table.provenance.values()):
        table.notes.append(
            "Some runs went on after an input changed (accepted with an override): see "
            "'accepted changes' in results.json and the run's provenance.json."
        )


def all_tables(runs) -> list:
    makers = (ppl_table, benchmark_table, lambada_table, ablation_table, needle_table, babilong_table)
    tables = [t for t in (m(runs) for m in makers) if t is not None]
    for t in tables:
        add_provenance(t, runs)
    return tables
