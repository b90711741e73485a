"""Check that the committed small study is what its one command gives on this machine.

    python scripts/check_small_study.py                       # every run (~40 min on 2 cores)
    python scripts/check_small_study.py --only pretrain/mta/seed0   # one run (~5 min)
    python scripts/check_small_study.py --fresh DIR --compare-only  # compare a finished root

Runs ``OMP_NUM_THREADS=1 python -m mta_repro.pipeline pipeline=small_study root=<fresh>``
(for ``--only``: just those variants and seeds) into a fresh directory, then compares
every run's numbers with the committed ones in results/small_study: the ``results`` of
each eval JSON and the training losses in metrics.jsonl, exactly (the runs are seeded
and single-threaded: the same machine gives the same bits; another CPU or torch build
may differ in the last digits, and the output says by how much). Exit status 0 when all
match, 1 with one line per difference otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMITTED = REPO / "results" / "small_study"
TIMING_KEYS = ("tokens_per_s", "mfu", "hfu", "peak_mem", "elapsed", "time", "wall")


def _numbers(obj, path=""):
    """{json path: leaf value} of a JSON value."""
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            out.update(_numbers(v, f"{path}.{k}" if path else str(k)))
        return out
    if isinstance(obj, list):
        out = {}
        for i, v in enumerate(obj):
            out.update(_numbers(v, f"{path}[{i}]"))
        return out
    return {path: obj}


def _losses(run: Path) -> dict:
    """{step: {loss fields}} of a run's metrics.jsonl, without its timings."""
    out = {}
    f = run / "metrics.jsonl"
    for line in f.read_text().splitlines() if f.is_file() else []:
        rec = json.loads(line)
        out[rec.get("step")] = {k: v for k, v in rec.items() if not any(t in k for t in TIMING_KEYS)}
    return out


def compare(committed: Path, fresh: Path, labels: list | None = None) -> list:
    """One line per number that differs between the runs of two study roots (``labels``:
    the runs to compare, e.g. ``pretrain/mta/seed0``; None: every committed run)."""
    runs = labels or sorted(str(p.parent.relative_to(committed)) for p in committed.glob("*/*/*/metrics.jsonl"))
    if not runs:
        return [f"{committed}: no runs (<stage>/<variant>/seed<k>/metrics.jsonl) to compare"]
    lines = []
    for label in runs:
        a, b = committed / label, fresh / label
        files = sorted(p.name for p in (a / "eval").glob("*.json"))
        if not files:
            lines.append(f"{label}: no eval/*.json in {a}")
        for name in files:
            if not (b / "eval" / name).is_file():
                lines.append(f"{label}/eval/{name}: missing in {fresh}")
                continue
            x = _numbers(json.loads((a / "eval" / name).read_text()).get("results"))
            y = _numbers(json.loads((b / "eval" / name).read_text()).get("results"))
            for key in sorted(set(x) | set(y)):
                if x.get(key) != y.get(key):
                    lines.append(f"{label}/eval/{name}: {key}: committed {x.get(key)!r}, now {y.get(key)!r}")
        la, lb = _losses(a), _losses(b)
        if la != lb:
            bad = [s for s in sorted(set(la) | set(lb), key=str) if la.get(s) != lb.get(s)]
            lines.append(
                f"{label}/metrics.jsonl: {len(bad)} logged step(s) differ, first step {bad[0]}: "
                f"committed {la.get(bad[0])}, now {lb.get(bad[0])}"
            )
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", action="append", default=[], metavar="STAGE/VARIANT/seedK", help="runs to redo")
    ap.add_argument("--fresh", default=None, help="where to rerun (default: a new temporary directory)")
    ap.add_argument("--committed", default=str(COMMITTED), help="the committed study root")
    ap.add_argument("--compare-only", action="store_true", help="compare --fresh with the committed runs; run nothing")
    args = ap.parse_args(argv)
    committed = Path(args.committed)
    fresh = Path(args.fresh) if args.fresh else Path(tempfile.mkdtemp(prefix="small_study_"))
    if not args.compare_only:
        cmd = [sys.executable, "-m", "mta_repro.pipeline", "pipeline=small_study", f"root={fresh}"]
        if args.only:
            parts = [label.split("/") for label in args.only]
            variants = sorted({p[1] for p in parts})
            seeds = sorted({int(p[2].removeprefix("seed")) for p in parts})
            cmd += [f"pipeline.variants=[{','.join(variants)}]", f"pipeline.seeds=[{','.join(map(str, seeds))}]"]
        print("$ OMP_NUM_THREADS=1 " + " ".join(cmd), flush=True)
        env = dict(os.environ, OMP_NUM_THREADS="1")
        rc = subprocess.run(cmd, cwd=REPO, env=env).returncode
        if rc != 0:
            print(f"check_small_study: the pipeline failed (exit {rc})", file=sys.stderr)
            return rc
    lines = compare(committed, fresh, args.only or None)
    for line in lines:
        print(line)
    print(
        f"check_small_study: {'every number matches' if not lines else f'{len(lines)} difference(s)'} "
        f"({fresh} against {committed})"
    )
    return 0 if not lines else 1


if __name__ == "__main__":
    sys.exit(main())
