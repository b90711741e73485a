"""Gather run results and render the paper's tables (Markdown, CSV, LaTeX)."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from mta_repro.report import paper

BENCH_ORDER = ["boolq", "piqa", "siqa", "hellaswag", "winogrande", "arc_easy", "arc_challenge", "openbookqa", "mmlu"]


@dataclass
class RunData:
    path: Path
    label: str
    variant: Optional[str] = None
    config: Optional[dict] = None
    evals: dict = field(default_factory=dict)  # task -> parsed eval JSON
    metrics: list = field(default_factory=list)  # metrics.jsonl records


def load_run(path, label: Optional[str] = None) -> RunData:
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"report: run directory {path} does not exist")
    run = RunData(path=path, label=label or path.name)
    cfg_file = path / "config.yaml"
    if cfg_file.is_file():
        from omegaconf import OmegaConf

        run.config = OmegaConf.to_container(OmegaConf.load(cfg_file), resolve=False)
    for f in sorted((path / "eval").glob("*.json")) if (path / "eval").is_dir() else []:
        try:
            data = json.loads(f.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"report: {f} is not valid JSON ({e})") from None
        run.evals[data.get("task", f.stem)] = data
        run.variant = run.variant or data.get("variant")
    if run.variant is None and run.config and "model" in run.config:
        from mta_repro.eval.run import variant_name

        run.variant = variant_name(run.config["model"])
    m = path / "metrics.jsonl"
    if m.is_file():
        for line in m.read_text().splitlines():
            line = line.strip()
            if line:
                try:
                    run.metrics.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a line cut by a crash
    if not run.evals and not run.metrics:
        raise ValueError(f"report: {path} has no eval/*.json results and no metrics.jsonl")
    return run


@dataclass
class Table:
    name: str  # file stem
    title: str
    headers: list
    rows: list  # lists of str | float | None

    def cell(self, v, blank="—") -> str:
        if v is None:
            return blank
        if isinstance(v, float):
            return f"{v:.2f}"
        return str(v)

    def markdown(self) -> str:
        out = [f"### {self.title}", "", "| " + " | ".join(self.headers) + " |",
               "|" + "|".join("---" for _ in self.headers) + "|"]
        out += ["| " + " | ".join(self.cell(v) for v in row) + " |" for row in self.rows]
        return "\n".join(out) + "\n"

    def csv(self) -> str:
        buf = io.StringIO()
        w = csv.writer(buf)
        w.writerow(self.headers)
        for row in self.rows:
            w.writerow(["" if v is None else (f"{v:.4f}" if isinstance(v, float) else v) for v in row])
        return buf.getvalue()

    def latex(self) -> str:
        esc = lambda s: str(s).replace("\\", "\\textbackslash{}").replace("_", "\\_").replace("%", "\\%").replace("&", "\\&")  # noqa: E731
        lines = [
            "\\begin{table}[t]", "\\centering", f"\\caption{{{esc(self.title)}}}",
            "\\begin{tabular}{l" + "r" * (len(self.headers) - 1) + "}", "\\toprule",
            " & ".join(esc(h) for h in self.headers) + " \\\\", "\\midrule",
        ]
        lines += [" & ".join(esc(self.cell(v, "--")) for v in row) + " \\\\" for row in self.rows]
        lines += ["\\bottomrule", "\\end{tabular}", "\\end{table}"]
        return "\n".join(lines) + "\n"


def _res(run: RunData, task: str):
    return (run.evals.get(task) or {}).get("results")


def ppl_table(runs) -> Optional[Table]:
    have = [r for r in runs if _res(r, "ppl")]
    if not have:
        return None
    domains = sorted({d for r in have for d in _res(r, "ppl")["domains"]})
    rows = []
    for r in have:
        res = _res(r, "ppl")
        rows.append([r.label, paper.VARIANT_LABELS.get(r.variant, r.variant)]
                    + [res["domains"].get(d, {}).get("ppl") for d in domains]
                    + [res["average"], paper.AVG_PPL.get(r.variant), paper.AVG_PPL_LONG.get(r.variant)])
    return Table("ppl", "Validation perplexity per domain (paper: 880M, 105B tokens, average only)",
                 ["run", "model"] + domains + ["avg", "paper avg", "paper avg (4K ft)"], rows)


def benchmark_table(runs) -> Optional[Table]:
    have = [r for r in runs if _res(r, "benchmarks")]
    if not have:
        return None
    present = {t for r in have for t in _res(r, "benchmarks")["summary"]}
    cols = [t for t in BENCH_ORDER if t in present] + sorted(present - set(BENCH_ORDER) - {"average"})
    rows = []
    for r in have:
        s = _res(r, "benchmarks")["summary"]
        rows.append([r.label, paper.VARIANT_LABELS.get(r.variant, r.variant)] + [s.get(c) for c in cols]
                    + [s.get("average"), paper.BENCH_AVG.get(r.variant)])
    return Table("benchmarks", "Zero-shot benchmarks and MMLU 5-shot, accuracy %",
                 ["run", "model"] + cols + ["avg", "paper avg"], rows)


def lambada_table(runs) -> Optional[Table]:
    have = [r for r in runs if _res(r, "lambada")]
    if not have:
        return None
    rows = []
    for r in have:
        s = _res(r, "lambada")["summary"]
        p = paper.LAMBADA.get(r.variant, (None, None))
        rows.append([r.label, paper.VARIANT_LABELS.get(r.variant, r.variant),
                     (s.get("lambada_standard") or {}).get("ppl"), p[0],
                     (s.get("lambada_openai") or {}).get("ppl"), p[1]])
    return Table("lambada", "LAMBADA perplexity",
                 ["run", "model", "standard", "paper standard", "OpenAI", "paper OpenAI"], rows)


def describe_mta(cfg: Optional[dict]) -> tuple:
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
    if pre:
        parts.append(f"pre-sm conv {mta.get('query_kernel_size')}x{mta.get('key_kernel_size')}")
    if post:
        parts.append(f"post-sm conv {mta.get('after_sm_query_kernel_size')}x{mta.get('after_sm_key_kernel_size')}")
    if mta.get("pre_sm_linear_head") or mta.get("head_kernel_size") or mta.get("post_sm_linear_head"):
        parts.append("head mix")
    if mta.get("group_norm"):
        parts.append("group norm")
    if mta.get("layer_norm_rescale"):
        parts.append("depth scaling")
    if mta.get("add_gating"):
        parts.append("gate 1d" if mta.get("gate_1d", True) else "gate")
    key = None
    if pre and post and mta.get("add_gating") and mta.get("gate_1d", True):
        key = "pre+post-softmax conv, scalar gating" + (", depth scaling" if mta.get("layer_norm_rescale") else "")
    return ", ".join(parts) or "explicit attention", key


def ablation_table(runs) -> Optional[Table]:
    have = [r for r in runs if _res(r, "ppl")]
    if not have:
        return None
    rows = []
    for r in have:
        desc, key = describe_mta(r.config)
        rows.append([r.label, desc, _res(r, "ppl")["average"], paper.ABLATIONS.get(key) if key else None])
    return Table("ablations", "Ablations: average validation perplexity (paper Table 5 where the config matches)",
                 ["run", "attention config", "avg ppl", "paper (Table 5)"], rows)


def needle_table(runs) -> Optional[Table]:
    have = [r for r in runs if _res(r, "needle")]
    if not have:
        return None
    counts = sorted({int(n) for r in have for c in _res(r, "needle")["accuracy"].values() for n in c})
    rows = []
    for r in have:
        for ctx, per in sorted(_res(r, "needle")["accuracy"].items(), key=lambda kv: int(kv[0])):
            rows.append([r.label, int(ctx)] + [
                100 * per[str(n)]["mean"] if str(n) in per else None for n in counts])
    return Table("needle", "Multi-needle NIAH accuracy % (averaged over depths)",
                 ["run", "context"] + [f"{n} needles" for n in counts], rows)


def babilong_table(runs) -> Optional[Table]:
    have = [r for r in runs if _res(r, "babilong")]
    if not have:
        return None
    lengths = []
    for r in have:
        for length in _res(r, "babilong")["mean"]:
            if length not in lengths:
                lengths.append(length)
    rows = []
    for r in have:
        res = _res(r, "babilong")
        for task in sorted(res["accuracy"]):
            rows.append([r.label, task] + [100 * res["accuracy"][task].get(x) if x in res["accuracy"][task] else None
                                           for x in lengths])
        rows.append([r.label, "mean"] + [100 * res["mean"][x] if x in res["mean"] else None for x in lengths])
    return Table("babilong", "BabiLong QA1-QA5 accuracy % by context length", ["run", "task"] + lengths, rows)


def all_tables(runs) -> list:
    makers = (ppl_table, benchmark_table, lambada_table, ablation_table, needle_table, babilong_table)
    return [t for t in (m(runs) for m in makers) if t is not None]
