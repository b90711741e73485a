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

Only like is compared with like: an eval file whose protocol differs between the two
roots (ppl windows drawn otherwise: ``settings.window_sampling``, absent = ``first``, or
another ``window_seed``; needle prompts from another seed: ``results.settings.seed``,
absent = 0) is skipped with a note saying why, and fields the committed file predates
(``batch_doc``, ``token_loss``, ``tokens``, ``prompt_ids``, ``seed_source``) are not
compared, with a note. Notes are not differences.
"""

from __future__ import annotations

import argparse
import json
import os
import re
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


# Result fields added after the committed study may have been written (mta_repro/eval/ppl.py,
# needle.py): a committed file without them is compared on the rest.
NEW_FIELDS = re.compile(r"^(token_loss|tokens)$|\.batch_doc\[|\.prompt_ids\.|^settings\.seed_source$")
FIELD_NAMES = ("token_loss", "tokens", "batch_doc", "prompt_ids", "seed_source", "batch_ce", "batch_tokens")


def _protocol(name: str, rec: dict) -> dict:
    """What decides which windows or prompts an eval file scored (absent: the old protocol)."""
    settings, results = rec.get("settings") or {}, rec.get("results") or {}
    if name == "ppl.json":
        sampling = settings.get("window_sampling", "first")
        return {
            "window_sampling": sampling,
            "window_seed": settings.get("window_seed") if sampling != "first" else None,
        }
    if name == "needle.json":
        return {"seed": (results.get("settings") or {}).get("seed", 0)}
    return {}


def _compare_eval(where: str, old: dict, new: dict, notes: list) -> list:
    """The differences between two results of one eval file, like with like (module docstring)."""
    name = where.rsplit("/", 1)[-1]
    pa, pb = _protocol(name, old), _protocol(name, new)
    if pa != pb:
        notes.append(f"{where}: not compared: the committed file was evaluated with {pa}, the rerun with {pb}")
        return []
    x, y = _numbers(old.get("results")), _numbers(new.get("results"))
    skipped = sorted({k for k in set(y) - set(x) if NEW_FIELDS.search(k)})
    settings = old.get("settings") or {}
    if name == "ppl.json" and "window_sampling" not in settings and int(settings.get("batch_size") or 1) > 1:
        # written before the lists were per window: with batches of several windows they were per batch
        skipped += [k for k in set(x) | set(y) if ".batch_ce[" in k or ".batch_tokens[" in k]
    if skipped:
        fields = sorted({f for k in skipped for f in re.findall(r"[a-z_]+", k) if f in FIELD_NAMES})
        notes.append(f"{where}: the committed file predates {', '.join(fields)}: not compared")
    lines = []
    for key in sorted((set(x) | set(y)) - set(skipped)):
        if x.get(key) != y.get(key):
            lines.append(f"{where}: {key}: committed {x.get(key)!r}, now {y.get(key)!r}")
    return lines


def compare(committed: Path, fresh: Path, labels: list | None = None, notes: list | None = None) -> list:
    """One line per number that differs between the runs of two study roots (``labels``:
    the runs to compare, e.g. ``pretrain/mta/seed0``; None: every committed run).
    ``notes`` gets one line per eval file, or fields of one, not compared and why."""
    notes = [] if notes is None else notes
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
            old = json.loads((a / "eval" / name).read_text())
            new = json.loads((b / "eval" / name).read_text())
            lines += _compare_eval(f"{label}/eval/{name}", old, new, notes)
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
    notes: list = []
    lines = compare(committed, fresh, args.only or None, notes)
    for line in notes:
        print(f"note: {line}")
    for line in lines:
        print(line)
    compared = "every number compared matches" if notes else "every number matches"
    print(
        f"check_small_study: {compared if not lines else f'{len(lines)} difference(s)'} "
        f"({fresh} against {committed}{f'; {len(notes)} note(s)' if notes else ''})"
    )
    return 0 if not lines else 1


if __name__ == "__main__":
    sys.exit(main())
