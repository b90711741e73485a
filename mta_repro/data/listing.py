"""Which files a rank reads: a corpus's files listed by layout, their fingerprint, and the
share of each rank (whole files, or line-strided parts) in the order of each epoch.

Two layouts (``data.layout``):

- ``slimpajama``: the SlimPajama-627B release, ``<root>/<split>/chunkK/*.jsonl.zst``; every
  file mixes all domains, told apart by ``meta.redpajama_set_name``, so a domain's stream
  reads every file of the rank's shard and keeps its own records (fine for the bundled
  corpus; for the full release ``scripts/prepare_slimpajama.py`` writes the cheaper
  per-domain layout).
- ``domains``: ``<root>/<domain>/*.jsonl[.zst]``, one directory per domain.

``shard_files`` deals the files to the ranks so that every line of every file is read
exactly once per epoch across the ranks, for any world size (whole files, or line-strided
parts when there are fewer files than ranks; data/README.md).
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import stat
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from mta_repro.data.args import DataArgs, resolve_path
from mta_repro.data.records import SET_NAMES
from mta_repro.errors import UserError

SUFFIXES = (".jsonl", ".jsonl.zst")


def natural_key(p: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p)]


def _is_val(p: Path) -> bool:
    return ".val." in p.name or p.name.startswith("val.") or "validation" in p.name


def corpus_root(args: DataArgs) -> Path:
    root = resolve_path(args.root_dir)
    if not root.is_dir():
        raise UserError(f"data.root_dir={args.root_dir}: no such directory")
    return root


def check_domain(args: DataArgs, domain: str) -> None:
    if args.layout == "slimpajama" and domain not in SET_NAMES:
        raise UserError(
            f"data.sources.{domain}: unknown domain for the slimpajama layout; expected one of {sorted(SET_NAMES)}"
        )


def _walk(base: Path, recursive: bool) -> Iterator[tuple[str, os.stat_result]]:
    """(path, stat) of the .jsonl[.zst] files under ``base``: one stat per file (the
    directory entries say which are folders), so a listing of the release's ~59k files
    costs what its stats cost."""
    stack = [base]
    while stack:
        with os.scandir(stack.pop()) as it:
            for e in it:
                if e.is_dir(follow_symlinks=True):
                    if recursive:
                        stack.append(Path(e.path))
                elif e.name.endswith(SUFFIXES):
                    try:
                        st = e.stat(follow_symlinks=True)
                    except FileNotFoundError:  # removed while listing
                        continue
                    if stat.S_ISREG(st.st_mode):
                        yield e.path, st


def list_entries(args: DataArgs, domain: str, split: str = "train") -> list[tuple[str, int, int]]:
    """(file relative to the root, size, mtime in ns) of every file holding ``domain``'s
    ``split`` records, in natural order of the names."""
    root = corpus_root(args)
    check_domain(args, domain)
    if args.layout == "slimpajama":
        base = root / split
        if not base.is_dir():
            raise UserError(f"data.root_dir={args.root_dir}: no {split}/ directory in {root}")
        found = list(_walk(base, recursive=True))
        if not found:
            raise UserError(f"data.root_dir={args.root_dir}: no *.jsonl or *.jsonl.zst files under {base}")
    else:
        base = root / domain
        if not base.is_dir():
            raise UserError(f"data.sources.{domain}: no directory {base} (layout 'domains')")
        found = list(_walk(base, recursive=False))
        names = [Path(p).name for p, _ in found]
        if split == "train":
            chunked = [f for f, n in zip(found, names) if re.search(r"\.chunk\.\d+\.jsonl", n)]
            found = chunked or [f for f, n in zip(found, names) if not _is_val(Path(n))]
        else:
            found = [f for f, n in zip(found, names) if _is_val(Path(n))]
        if not found:
            what = "*.chunk.NN.jsonl[.zst] or *.jsonl[.zst]" if split == "train" else "*.val.jsonl[.zst]"
            raise UserError(f"data.sources.{domain}: no {split} files ({what}) in {base}")
    out = [(os.path.relpath(p, root), st.st_size, st.st_mtime_ns) for p, st in found]
    return sorted(out, key=lambda e: natural_key(e[0]))


def list_files(args: DataArgs, domain: str, split: str = "train") -> list[str]:
    """Files (relative to the root, natural order) holding ``domain``'s ``split`` records."""
    return [name for name, _, _ in list_entries(args, domain, split)]


def fingerprint(entries: Iterable[tuple[str, int, int]], with_mtime: bool = True) -> dict:
    """A cheap identity of a set of files from their listing alone (no file is read):
    {"files", "bytes", "sha256"} of the sorted (name, size[, mtime]) lines. With mtimes it
    notices a file rewritten in place; without, two copies of a corpus compare equal."""
    h = hashlib.sha256()
    n = size = 0
    for name, st_size, mtime in sorted(entries):
        line = f"{name}\t{st_size}\t{mtime}\n" if with_mtime else f"{name}\t{st_size}\n"
        h.update(line.encode())
        n, size = n + 1, size + st_size
    return {"files": n, "bytes": size, "sha256": h.hexdigest()}


def shard_files(files: list[str], rank: int, world_size: int) -> list[tuple[str, int, int]]:
    """Rank's share as (file, stride, offset): it reads the lines j with j % stride == offset."""
    if not 0 <= rank < world_size:
        raise UserError(f"rank {rank} outside world size {world_size}")
    n = len(files)
    if n >= world_size:
        return [(f, 1, 0) for f in files[rank::world_size]]
    # Fewer files than ranks: cut each file into k = W / gcd(n, W) line-strided parts,
    # n * k = lcm(n, W) parts in all, dealt round-robin: every rank gets n / gcd parts,
    # so the ranks' shares differ by at most one line per part.
    k = world_size // math.gcd(n, world_size)
    parts = [(f, k, j) for j in range(k) for f in files]
    return parts[rank::world_size]


def epoch_order(
    shard: Sequence[tuple[str, int, int]], seed: int, domain: str, epoch: int
) -> list[tuple[str, int, int]]:
    """A rank's files in the order of ``epoch``: epoch 0 in the corpus's order (the
    release's chunks are already shuffled), every later epoch a fresh permutation drawn
    from (data seed, domain, epoch), so repeated passes do not see the files alike."""
    if epoch == 0 or len(shard) < 2:
        return list(shard)
    import zlib

    import numpy as np

    rng = np.random.Generator(np.random.PCG64([seed, zlib.crc32(domain.encode()), epoch]))
    return [shard[i] for i in rng.permutation(len(shard))]
