"""``python -m mta_repro.report <run_dir>... --out <dir> [--label DIR=NAME ...]``: tables and plots.

Writes <out>/report.md (every table with its notes and provenance block, links to the
plots; runs labelled ``.../seed<k>``, or a multirun's runs equal in all but the seed, are
also tabled over their seeds with paired 95% intervals, and each ``--contrast A-B``,
mta_repro/report/aggregate.py), <out>/<table>.csv
and <out>/<table>.tex for each table that has data, <out>/results.json (every run's stage,
comparability and every table's rows as {header: value}), and PNGs: needle.png,
babilong.png, loss_curves.png (training loss and any val* loss logged during training),
loss_diff.png (each row's training loss minus its reference's, per seed and mean),
kernels_<run>_{pre,post}-softmax.png (MTA runs with weights; kernel minus identity).

Paper numbers are the paper's (880M models, 105B tokens; +10.5B at 4K for the finetune;
1.4B for Appendix I), chosen by each run's stage; a run of another size or fewer steps is
marked as not comparable.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mta_repro.cli import run_cli
from mta_repro.errors import UserError
from mta_repro.files import replace_atomically
from mta_repro.report import plots
from mta_repro.report.aggregate import (
    add_seed_provenance,
    check_runs,
    contrast_pairs,
    group_runs,
    parse_contrast,
    seed_tables,
)
from mta_repro.report.paper import VARIANT_LABELS
from mta_repro.report.runs import eval_command, load_run
from mta_repro.report.tables import STAGE_LABELS, all_tables, comparability


def parse_labels(items) -> dict:
    """``["runs/a=MTA", ...]`` -> {resolved path: name}."""
    out = {}
    for item in items or ():
        d, sep, name = item.rpartition("=")
        if not sep or not d or not name:
            raise UserError(f"report: --label expects DIR=NAME, got {item!r}")
        out[str(Path(d).resolve())] = name
    return out


def build_report(run_dirs, out: Path, kernels: bool = True, labels: dict | None = None, contrasts=()) -> Path:
    """Write the report of ``run_dirs`` to ``out``; ``contrasts``: [(A, B)] or ["A-B"], the
    named contrasts (variants or rows) tabled with their intervals. Every refusal comes
    before anything is written."""
    contrasts = [parse_contrast(c) if isinstance(c, str) else tuple(c) for c in contrasts or ()]
    labels = {str(Path(k).resolve()): v for k, v in (labels or {}).items()}
    unknown = set(labels) - {str(Path(p).resolve()) for p in run_dirs}
    if unknown:
        raise UserError(f"report: --label names a directory that is not among the runs: {sorted(unknown)}")
    runs = [load_run(p, labels.get(str(Path(p).resolve()))) for p in run_dirs]
    names = [r.label for r in runs]
    for r in runs:  # same basename in different parents: use parent/name
        if names.count(r.label) > 1 and str(r.path.resolve()) not in labels:
            r.label = f"{r.path.parent.name}_{r.path.name}"
    check_runs(runs)  # a run counted twice or under another seed: refused, nothing written
    if contrasts:
        contrast_pairs(group_runs(runs), contrasts)
    out.mkdir(parents=True, exist_ok=True)
    tables = all_tables(runs)
    add_seed_provenance(tables, runs)
    tables += seed_tables(runs, contrasts)
    for t in tables:  # every file whole or absent (the pipeline reads results.json)
        replace_atomically(out / f"{t.name}.csv", t.csv().encode())
        replace_atomically(out / f"{t.name}.tex", t.latex().encode())
    pngs = [plots.needle_plot(runs, out), plots.babilong_plot(runs, out), plots.loss_plot(runs, out)]
    pngs.append(plots.loss_diff_plot(runs, out))
    if kernels:
        for r in runs:
            if r.variant == "mta":
                try:
                    pngs += plots.kernel_plot(r, out)
                except ValueError as e:  # no weights in that run dir: tables still useful
                    print(f"report: no kernel plot for {r.label}: {e}", file=sys.stderr)
    missing_eval = [r for r in runs if not r.evals]
    md = [
        "# mta-repro report",
        "",
        "Paper numbers are the paper's own results: 880M-parameter models trained on 105B tokens "
        "(pretraining), then 10.5B more tokens at 4K (finetune columns), and the 1.4B model of Appendix I; "
        "a run of another size or with fewer steps is marked 'no' in the 'vs paper' column.",
        "",
        "| run | dir | model | stage | step | trained context | vs paper |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        why = comparability(r)
        trained = (r.config or {}).get("data", {}).get("seq_len") if isinstance(r.config, dict) else None
        label = VARIANT_LABELS.get(r.variant, r.variant) if r.variant is not None else None
        md.append(
            f"| {r.label} | `{r.path}` | {label} | "
            f"{STAGE_LABELS.get(r.stage, r.stage)} | {'—' if r.step is None else r.step} | "
            f"{'—' if trained is None else trained} | {'no: ' + why if why else 'yes'} |"
        )
    md.append("")
    inferred = [r.label for r in runs if not r.stage_recorded]
    if inferred:  # once for the report, not per run or per table
        md.append(
            f"- stage (inferred) for {', '.join(inferred)}: made before runs recorded their run.stage; "
            "inferred from the run's config and its source's: a source and a longer context or another "
            "RoPE theta is the 4K finetune (docs/evaluation.md)."
        )
    for r in missing_eval:
        msg = f"{r.label}: no evaluation results in {r.path / 'eval'}; run: {eval_command(r.path)}"
        md.append(f"- {msg}")
        print(f"report: {msg}", file=sys.stderr)
    md.append("")
    md += [t.markdown() for t in tables]
    md += [f"![{p.stem}]({p.name})\n" for p in pngs if p is not None]
    path = out / "report.md"
    replace_atomically(path, "\n".join(md).encode())
    results = {
        "runs": [
            {
                "label": r.label,
                "path": str(r.path),
                "variant": r.variant,
                "stage": r.stage,
                # the run's own record (run.stage / run.variant), or inferred from its config
                "placed_by": {
                    "stage": "recorded" if r.stage_recorded else "inferred",
                    "variant": "recorded" if r.variant_recorded else "inferred",
                },
                "step": r.step,
                "newest_checkpoint_step": r.final_step,
                "comparable": comparability(r) is None,
                "not_comparable_because": comparability(r),
                "evaluated": sorted(r.evals),
            }
            for r in runs
        ],
        "tables": {t.name: t.to_json() for t in tables},
        "plots": [p.name for p in pngs if p is not None],
    }
    replace_atomically(out / "results.json", json.dumps(results, indent=1, default=str).encode())
    return path


def write_report(run_dirs, out: Path, kernels: bool = True, labels: dict | None = None, contrasts=()) -> Path:
    """``build_report`` into a temporary folder beside ``out``, then its files moved into
    ``out`` (each by a rename, with Ctrl-C held back until the last one is in place): a
    report stopped or failed midway (Ctrl-C, a full disk) leaves the old report whole and
    no new file beside it. A folder it cannot write is one line before any work."""
    import errno
    import os
    import shutil
    import signal
    import threading

    from mta_repro.errors import NoSpaceError
    from mta_repro.files import caused_by_enospc, fsync_path, unwritable

    out = Path(out)
    found = unwritable(out)
    if found:
        raise UserError(
            f"{found[0]} is not writable ({found[1]}); the report goes to {out}: make it writable, "
            "or write it elsewhere with --out <dir>"
        )
    tmp = out.absolute().parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    held: list = []
    main_thread = threading.current_thread() is threading.main_thread()
    old_handler = signal.getsignal(signal.SIGINT) if main_thread else None
    try:
        built = build_report(run_dirs, tmp, kernels=kernels, labels=labels, contrasts=contrasts)
        if main_thread:  # the moves are quick: a Ctrl-C among them waits for the last
            signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
        names = sorted(p.name for p in tmp.iterdir() if p.name != built.name) + [built.name]  # report.md last
        out.mkdir(parents=True, exist_ok=True)
        for name in names:
            os.replace(tmp / name, out / name)
        fsync_path(out)
    except OSError as e:
        if caused_by_enospc(e):
            raise NoSpaceError(
                f"no space left on device writing the report for {out}: the old report there is as it was; "
                "free space and rerun"
            ) from None
        if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise UserError(
                f"cannot write {e.filename or out}: {e.strerror}; write the report elsewhere with --out"
            ) from None
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if main_thread and old_handler is not None:
            signal.signal(signal.SIGINT, old_handler)
    if held:
        raise KeyboardInterrupt
    return out / built.name


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m mta_repro.report", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("run_dirs", nargs="+", help="run directories (with eval/*.json and/or metrics.jsonl)")
    ap.add_argument("--out", default=None, help="output directory (default: <first run>/report)")
    ap.add_argument(
        "--label",
        action="append",
        default=[],
        metavar="DIR=NAME",
        help="row label for a run directory (repeatable; default: the directory's name)",
    )
    ap.add_argument(
        "--contrast",
        action="append",
        default=[],
        metavar="A-B",
        help="a named contrast, A minus B (variant or row names, e.g. mta-talking_heads; repeatable): "
        "tabled over seeds with its interval, n, Holm adjustment and the seeds 80%% power needs",
    )
    ap.add_argument("--no-kernels", action="store_true", help="skip loading weights for the kernel plots")
    args = ap.parse_args(argv)
    out = Path(args.out) if args.out else Path(args.run_dirs[0]) / "report"

    def go() -> int:
        path = write_report(
            args.run_dirs, out, kernels=not args.no_kernels, labels=parse_labels(args.label), contrasts=args.contrast
        )
        print(path.read_text())
        print(f"report: {path}")
        return 0

    # one line for a user error (rc 2) and for Ctrl-C ("report: interrupted", 130)
    return run_cli("report", go)


if __name__ == "__main__":
    sys.exit(main())
