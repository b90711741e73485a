#!/usr/bin/env python3
"""Turn the SlimPajama release (or the SlimPajama-6B parquet subset) into per-domain shards.

Input (``--src``), either
  - the SlimPajama-627B release: ``train/chunkK/example_train_N.jsonl.zst`` and
    ``validation/chunkK/example_holdout_N.jsonl.zst`` (``.jsonl`` also read), or
  - SlimPajama-6B (parquet): ``data/train-*.parquet``, ``data/validation-*.parquet``;
records ``{"text", "meta": {"redpajama_set_name"}}``.

Output (``--out``), the ``domains`` layout read by ``data.layout=domains`` (and, uncompressed,
by the official release):
  <out>/<domain>/<domain>.chunk.NN.jsonl.zst   NN = 00 .. chunks-1
  <out>/<domain>/<domain>.val.jsonl.zst        one validation file per domain
records keep the release format. Every unit writes a file for each of the 7 domains
(empty if the inputs hold none of its records), so the layout is the same for any input.

Output chunk k of every domain is made from the input train files of "shard" k of
``--chunks`` (input file i -> chunk i % chunks; with fewer input files than chunks, the
files are split by line as the loader splits them among ranks), so chunks are independent
units of work: each is written to ``*.tmp`` files, renamed when complete, then marked done
in ``<out>/.prepare/``. A rerun after an interruption skips the chunks marked done and
rewrites any other (``*.tmp`` leftovers of a half-written chunk are deleted, never used).
Bad records are skipped and counted (counts in the markers and the final summary).
A truncated or corrupt input file (a download cut short) is reported by name: by default
the run fails with the list of such files after every other chunk is done (their chunks
are not written, so a rerun after re-downloading them makes just those); with
``--bad-files skip`` the records read before the damage are kept, and the files are
listed in the markers and the summary (``bad_files``) and counted (``corrupt_file``).

  python scripts/prepare_slimpajama.py --src /data/SlimPajama-627B --out /data/sp_domains --chunks 32 --workers 16
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from mta_repro.data.listing import natural_key, shard_files
from mta_repro.data.readers import LineReader
from mta_repro.data.records import DOMAIN_OF_SET, parse_line, record_fields

STATE_DIR = ".prepare"


def input_files(src: Path, split: str) -> list[Path]:
    """The release's or the parquet subset's files of ``split`` ("train"/"validation")."""
    files = (
        [p for p in (src / split).rglob("*") if p.is_file() and p.name.endswith((".jsonl", ".jsonl.zst"))]
        if (src / split).is_dir()
        else []
    )
    if not files:  # SlimPajama-6B: data/<split>-00000-of-000NN*.parquet
        files = [p for p in src.rglob(f"{split}-*.parquet")]
    return sorted(files, key=lambda p: natural_key(str(p)))


def iter_records(
    path: Path, stride: int, offset: int, counts: dict[str, int], bad_files: list[dict] | None = None
) -> Iterator[tuple[str, str]]:
    """(domain, text) of the good records j of ``path`` with j % stride == offset.

    A file that cannot be read to its end is appended to ``bad_files`` (name, error,
    records read) and counted as ``corrupt_file``; the records before the damage are kept."""
    seen = [0]
    try:
        yield from _iter_records(path, stride, offset, counts, seen)
    except Exception as e:  # any read failure of this file: report it by name
        if bad_files is None:
            raise
        counts["corrupt_file"] = counts.get("corrupt_file", 0) + 1
        msg = str(e).replace(str(path) + ": ", "")
        bad_files.append({"file": str(path), "error": f"{type(e).__name__}: {msg}", "records_read": seen[0]})


def _iter_records(
    path: Path, stride: int, offset: int, counts: dict[str, int], seen: list
) -> Iterator[tuple[str, str]]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        j = 0
        for batch in pq.ParquetFile(path).iter_batches(columns=["text", "meta"], batch_size=4096):
            for rec in batch.to_pylist():
                seen[0] = j
                if j % stride == offset:
                    r = record_fields(rec, True, counts)
                    if r is not None:
                        yield DOMAIN_OF_SET[r[0]], r[1]
                j += 1
        return
    reader = LineReader(path, 0)
    try:
        j = 0
        while line := reader.readline():
            seen[0] = j + 1
            if j % stride == offset and line.strip():
                r = parse_line(line, True, counts)
                if r is not None:
                    yield DOMAIN_OF_SET[r[0]], r[1]
            j += 1
    finally:
        reader.close()


class _Writers:
    """One .tmp zstd writer per domain, opened on first use."""

    def __init__(self, out: Path, name_of) -> None:
        self.out, self.name_of, self.files = out, name_of, {}

    def write(self, domain: str, text: str | None) -> None:
        if domain not in self.files:
            import zstandard

            final = self.out / domain / self.name_of(domain)
            final.parent.mkdir(parents=True, exist_ok=True)
            raw = open(str(final) + ".tmp", "wb")  # noqa: SIM115 - one per domain, closed by close()
            self.files[domain] = (final, raw, zstandard.ZstdCompressor(level=3).stream_writer(raw))
        if text is None:
            return
        rec = {"text": text, "meta": {"redpajama_set_name": _SET_OF[domain]}}
        self.files[domain][2].write((json.dumps(rec, ensure_ascii=False) + "\n").encode("utf-8"))

    def discard(self) -> None:
        for final, _raw, w in self.files.values():
            w.close()
            Path(str(final) + ".tmp").unlink(missing_ok=True)
        self.files = {}

    def commit(self) -> list[str]:
        for d in _SET_OF:  # every domain gets its file, possibly empty: a fixed layout
            if d not in self.files:
                self.write(d, None)
        for final, _raw, w in self.files.values():
            w.flush()
            w.close()  # also closes raw
            os.replace(str(final) + ".tmp", final)
        return sorted(self.files)


_SET_OF = {d: s for s, d in DOMAIN_OF_SET.items()}


def _marker(out: Path, unit: str) -> Path:
    return out / STATE_DIR / f"{unit}.done"


def _clean_tmp(out: Path, suffix: str) -> None:
    for p in out.glob(f"*/*{suffix}.tmp"):
        p.unlink()


def make_unit(
    src: str, out: str, unit: str, parts: list[tuple[str, int, int]], max_docs: int | None, bad_files: str = "fail"
) -> dict:
    """Write one output unit ("chunk.NN" or "val") from its input parts; returns stats.

    An unreadable input with ``bad_files="fail"``: nothing is written or marked (stats
    has "failed": True and the files); with "skip" the unit is written and marked."""
    out_p = Path(out)
    suffix = f".{unit}.jsonl.zst"
    _clean_tmp(out_p, suffix)  # half-written by an earlier, interrupted run: not trusted
    writers = _Writers(out_p, lambda d: f"{d}{suffix}")
    counts: dict[str, int] = {}
    docs: dict[str, int] = {}
    bad: list[dict] = []
    for name, stride, offset in parts:
        for domain, text in iter_records(Path(src) / name, stride, offset, counts, bad):
            if max_docs is not None and docs.get(domain, 0) >= max_docs:
                continue
            writers.write(domain, text)
            docs[domain] = docs.get(domain, 0) + 1
    for b in bad:
        b["file"] = str(Path(b["file"]).relative_to(src))
    if bad and bad_files == "fail":
        writers.discard()
        return {"unit": unit, "failed": True, "bad_files": bad}
    writers.commit()
    stats = {"unit": unit, "docs": docs, "bad_records": counts, "inputs": [p[0] for p in parts], "bad_files": bad}
    tmp = _marker(out_p, unit).with_suffix(".tmp")
    tmp.write_text(json.dumps(stats))
    os.replace(tmp, _marker(out_p, unit))
    return stats


def prepare(
    src,
    out,
    chunks: int,
    workers: int = 1,
    max_val_docs: int | None = None,
    progress: bool = True,
    bad_files: str = "fail",
) -> dict:
    """Make (or finish) ``out`` from ``src``; returns {"done": [...], "skipped": [...],
    "bad_records": {...}, "bad_files": [...]}. Raises ValueError listing the truncated or
    corrupt inputs if there are any and ``bad_files="fail"`` (after all other units)."""
    src, out = Path(src), Path(out)
    if bad_files not in ("fail", "skip"):
        raise ValueError(f"--bad-files={bad_files}: expected fail or skip")
    if chunks < 1:
        raise ValueError(f"--chunks={chunks}: expected >= 1")
    if not src.is_dir():
        raise ValueError(f"--src={src}: no such directory")
    train = input_files(src, "train")
    if not train:
        raise ValueError(f"--src={src}: no train/**/*.jsonl[.zst] or *train-*.parquet files")
    val = input_files(src, "validation")
    (out / STATE_DIR).mkdir(parents=True, exist_ok=True)
    cfg_path = out / STATE_DIR / "config.json"
    cfg = {
        "src": str(src.resolve()),
        "chunks": chunks,
        "max_val_docs": max_val_docs,
        "train_files": len(train),
        "validation_files": len(val),
    }
    if cfg_path.exists():
        old = json.loads(cfg_path.read_text())
        if old != cfg:
            raise ValueError(f"--out={out} was prepared with {old}, not {cfg}: use another --out or delete it")
    else:
        cfg_path.write_text(json.dumps(cfg, indent=1))

    rel = [str(p.relative_to(src)) for p in train]
    units = [(f"chunk.{k:02d}", shard_files(rel, k, chunks), None) for k in range(chunks)]
    if val:
        units.append(("val", [(str(p.relative_to(src)), 1, 0) for p in val], max_val_docs))
    todo = [u for u in units if not _marker(out, u[0]).exists()]
    skipped = [u[0] for u in units if _marker(out, u[0]).exists()]

    from tqdm import tqdm

    bar = tqdm(total=len(units), initial=len(skipped), desc="prepare slimpajama", unit="shard", disable=not progress)
    done = []
    if workers <= 1:
        for unit, parts, mx in todo:
            done.append(make_unit(str(src), str(out), unit, parts, mx, bad_files))
            bar.update(1)
    else:
        with ProcessPoolExecutor(workers) as ex:
            futs = [ex.submit(make_unit, str(src), str(out), u, p, mx, bad_files) for u, p, mx in todo]
            for f in as_completed(futs):
                done.append(f.result())
                bar.update(1)
    bar.close()
    failed = [s for s in done if s.get("failed")]
    if failed:
        files = sorted(
            {f"{b['file']} ({b['error']}, after {b['records_read']} records)" for s in failed for b in s["bad_files"]}
        )
        raise ValueError(
            f"{len(files)} input file(s) are truncated or corrupt: " + "; ".join(files) + ". Their output "
            f"chunks ({', '.join(sorted(s['unit'] for s in failed))}) were not written; the others are done. "
            "Re-download these files and rerun, or rerun with --bad-files skip to keep the records read "
            "before the damage"
        )
    bad: dict[str, int] = {}
    bad_list: list[dict] = []
    for u, _, _ in units:
        marker = json.loads(_marker(out, u).read_text())
        for k, v in marker["bad_records"].items():
            bad[k] = bad.get(k, 0) + v
        bad_list += marker.get("bad_files", [])
    return {"done": sorted(s["unit"] for s in done), "skipped": skipped, "bad_records": bad, "bad_files": bad_list}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", required=True, help="SlimPajama-627B release root (or SlimPajama-6B)")
    ap.add_argument("--out", required=True, help="output root (per-domain layout)")
    ap.add_argument("--chunks", type=int, default=32, help="train chunks per domain (>= the GPUs is best)")
    ap.add_argument("--workers", type=int, default=1, help="processes; each writes one chunk at a time")
    ap.add_argument("--max-val-docs", type=int, default=None, help="cap on validation documents per domain")
    ap.add_argument(
        "--bad-files",
        choices=("fail", "skip"),
        default="fail",
        help="a truncated/corrupt input file: fail with the list (default) or keep what was readable",
    )
    a = ap.parse_args()
    try:
        res = prepare(a.src, a.out, a.chunks, a.workers, a.max_val_docs, bad_files=a.bad_files)
    except ValueError as e:
        sys.exit(f"error: {e}")
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
