"""``python -m mta_repro.report <run_dir>... --out <dir>``: tables and plots.

Writes <out>/report.md (every table, with links to the plots), <out>/<table>.csv and
<out>/<table>.tex for each table that has data, and PNGs: needle.png, babilong.png,
loss_curves.png, kernels_<run>_{pre,post}-softmax.png (MTA runs with weights).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mta_repro.report import plots
from mta_repro.report.tables import all_tables, load_run


def build_report(run_dirs, out: Path, kernels: bool = True) -> Path:
    runs = [load_run(p) for p in run_dirs]
    labels = [r.label for r in runs]
    for r in runs:  # same basename in different parents: use parent/name
        if labels.count(r.label) > 1:
            r.label = f"{r.path.parent.name}_{r.path.name}"
    out.mkdir(parents=True, exist_ok=True)
    tables = all_tables(runs)
    for t in tables:
        (out / f"{t.name}.csv").write_text(t.csv())
        (out / f"{t.name}.tex").write_text(t.latex())
    pngs = [plots.needle_plot(runs, out), plots.babilong_plot(runs, out), plots.loss_plot(runs, out)]
    if kernels:
        for r in runs:
            if r.variant == "mta":
                try:
                    pngs += plots.kernel_plot(r, out)
                except ValueError as e:  # no weights in that run dir: tables still useful
                    print(f"report: no kernel plot for {r.label}: {e}", file=sys.stderr)
    md = ["# mta-repro report", "", "Runs: " + ", ".join(f"`{r.path}` ({r.variant})" for r in runs), ""]
    md += [t.markdown() for t in tables]
    md += [f"![{p.stem}]({p.name})\n" for p in pngs if p is not None]
    path = out / "report.md"
    path.write_text("\n".join(md))
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mta_repro.report", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dirs", nargs="+", help="run directories (with eval/*.json and/or metrics.jsonl)")
    ap.add_argument("--out", default=None, help="output directory (default: <first run>/report)")
    ap.add_argument("--no-kernels", action="store_true", help="skip loading weights for the kernel plots")
    args = ap.parse_args(argv)
    out = Path(args.out) if args.out else Path(args.run_dirs[0]) / "report"
    path = build_report(args.run_dirs, out, kernels=not args.no_kernels)
    print(path.read_text())
    print(f"report: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
