#!/usr/bin/env python3
"""What recording and checking a run's data inputs costs at start and resume, on a tree
shaped like the SlimPajama release (docs/provenance.md).

It builds ``--files`` small ``.jsonl.zst`` files (default 59,166: the release's train
split) under ``train/chunk1..10`` of a temporary folder (``--dir`` keeps and reuses one):
what a start pays for is one stat per file, not the bytes, so the files are tiny. Then,
the median of ``--runs`` runs each:

- listing, before: the train/ listing as the loader made it before this change (a pathlib
  walk with one ``is_file`` stat per file), once per domain stream (7 in this layout);
- listing, now: one scandir walk per loader with the names, sizes and mtimes;
- fingerprint: the sha256 of that listing (no file is read);
- start: ``build_train_loader`` of rank 0 of ``--world`` ranks (listing, shard, streams);
- resume, unchanged: ``load_state_dict`` of a state whose rank read its whole share of an
  epoch to the end (``--world`` 32: 1,849 files, each record holding the file's real
  sha256): one stat per file read, the current files reopened at their offsets;
- resume, every stat changed: the same after every file's mtime moved (a copy without
  ``-p``): each file read is read again to check its text (here tiny files; a release
  file is ~15 MB of zstd, so this case costs the decompression of the share);
- state: the pickled loader state (bytes) and ``_state()``, which a prefetch thread
  builds after every batch.

  python scripts/bench_provenance.py                        # ~10 min on 2 cores, tree included
  python scripts/bench_provenance.py --files 5000 --runs 3  # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import zstandard

from mta_repro.data import DataArgs, TokenizerArgs, build_train_loader
from mta_repro.data.listing import SUFFIXES, fingerprint, list_entries
from mta_repro.data.readers import text_digest
from mta_repro.data.records import SET_NAMES


def build_tree(root: Path, n_files: int, chunks: int = 10) -> None:
    """``n_files`` files under train/chunk1..chunks (and one validation file), each a zstd
    frame of one record per domain."""
    recs = b"".join(
        json.dumps({"text": f"a document of {d} " * 20, "meta": {"redpajama_set_name": s}}).encode() + b"\n"
        for d, s in SET_NAMES.items()
    )
    blob = zstandard.ZstdCompressor().compress(recs)
    done = root / ".complete"
    if done.is_file() and done.read_text() == str(n_files):
        return
    shutil.rmtree(root, ignore_errors=True)
    for i in range(n_files):
        d = root / "train" / f"chunk{i % chunks + 1}"
        if i < chunks:
            d.mkdir(parents=True, exist_ok=True)
        (d / f"example_train_{i // chunks}.jsonl.zst").write_bytes(blob)
    (root / "validation" / "chunk1").mkdir(parents=True)
    (root / "validation" / "chunk1" / "example_holdout_0.jsonl.zst").write_bytes(blob)
    done.write_text(str(n_files))


def old_listing(root: Path) -> list:
    """The loader's listing before this change (mta_repro/data/listing.py list_files)."""
    key = lambda p: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p)]  # noqa: E731
    base = root / "train"
    files = [p for p in base.rglob("*") if p.is_file() and p.name.endswith(SUFFIXES)]
    return sorted((str(p.relative_to(root)) for p in files), key=key)


def median_s(fn, runs: int, setup=None) -> float:
    times = []
    for _ in range(runs):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=59_166)
    ap.add_argument("--world", type=int, default=32, help="ranks the files are shared among (the paper's 32 GPUs)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--dir", default=None, help="build (or reuse) the tree here instead of a temporary folder")
    args = ap.parse_args()
    tmp = None if args.dir else tempfile.mkdtemp(prefix="bench_provenance_")
    root = Path(args.dir or tmp) / "corpus"
    try:
        t0 = time.perf_counter()
        build_tree(root, args.files)
        print(f"tree: {args.files:,} files under {root} ({time.perf_counter() - t0:.0f} s to build or check)")
        data = DataArgs(
            root_dir=str(root),
            seq_len=64,
            batch_size=1,
            shuffle_buffer=0,
            tokenizer=TokenizerArgs(name="bytes", path=None),
        )
        rows = []
        n_domains = len(SET_NAMES)
        rows.append(
            (
                f"listing, before ({n_domains} walks: one per domain stream)",
                median_s(lambda: [old_listing(root) for _ in range(n_domains)], args.runs),
            )
        )
        rows.append(("listing, now (one walk per loader)", median_s(lambda: list_entries(data, "arxiv"), args.runs)))
        entries = list_entries(data, "arxiv")
        rows.append(("fingerprint of the listing", median_s(lambda: fingerprint(entries), args.runs)))
        rows.append(
            (
                f"start: build_train_loader, rank 0 of {args.world}",
                median_s(lambda: build_train_loader(data, 0, args.world), args.runs),
            )
        )

        loader = build_train_loader(data, 0, args.world)
        next(loader)  # the streams are inside their first file
        share = [f for f, _, _ in next(iter(loader.streams.values())).base_shard]
        for name in share:  # as if the rank had read its whole share of the epoch
            sha, size, mtime = text_digest(root / name, _text_len(root / name))
            loader.files[name] = (size, mtime, _text_len(root / name), sha)
        sd = loader.state_dict()
        blob = pickle.dumps(sd)

        def resume():
            fresh = build_train_loader(data, 0, args.world)
            t = time.perf_counter()
            fresh.load_state_dict(pickle.loads(blob))
            assert not fresh.input_check["refuse"], fresh.input_check
            return time.perf_counter() - t

        rows.append(
            (
                f"resume, unchanged: load_state_dict ({len(share):,} files read)",
                statistics.median(resume() for _ in range(args.runs)),
            )
        )

        def touch():
            for name in share:
                st = os.stat(root / name)
                os.utime(root / name, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))

        def resume_touched():
            touch()
            return resume()

        rows.append(
            (
                "resume, every stat changed: each file read rehashed",
                statistics.median(resume_touched() for _ in range(args.runs)),
            )
        )
        rows.append(("state: _state() (a prefetch thread, after every batch)", median_s(loader._state, args.runs * 20)))
        print()
        print(f"| what ({args.files:,} files, rank 0 of {args.world}) | median s |")
        print("|---|---|")
        for what, s in rows:
            print(f"| {what} | {s:.4f} |")
        print(f"| state: pickled loader state of rank 0 | {len(blob):,} bytes |")
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _text_len(path: Path) -> int:
    return len(zstandard.ZstdDecompressor().decompressobj().decompress(path.read_bytes()))


if __name__ == "__main__":
    main()
