"""Finding a corpus's files, splitting them among ranks, and streaming documents from them.

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

A stream's position is plain data: shard file index, line number and byte offset (in the
decompressed stream) of the next line, epoch. A file is reopened at a saved offset by
reading its text up to it, which also recomputes the sha256 of those bytes: the reader
hashes every byte it hands out, so the state can say what the run read of each file
(``mta_repro/data/loader.py`` records and checks it; docs/provenance.md). A stream keeps
the shard it was started with: files that appear later are not read by the run, files
that vanish are skipped. A record longer than ``data.max_record_bytes`` is skipped and
counted as bad (``oversize``), never held whole.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import os
import re
import stat
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from mta_repro.data.args import DataArgs, resolve_path
from mta_repro.errors import CorruptFileError, UserError

log = logging.getLogger(__name__)

# Domain name -> the release's meta.redpajama_set_name.
SET_NAMES = {
    "arxiv": "RedPajamaArXiv",
    "book": "RedPajamaBook",
    "c4": "RedPajamaC4",
    "commoncrawl": "RedPajamaCommonCrawl",
    "github": "RedPajamaGithub",
    "stackexchange": "RedPajamaStackExchange",
    "wikipedia": "RedPajamaWikipedia",
}
DOMAIN_OF_SET = {v: k for k, v in SET_NAMES.items()}
BAD_KINDS = (
    "undecodable",
    "malformed_json",
    "missing_text",
    "missing_meta",
    "unknown_set",
    "empty",
    "corrupt_file",
    "oversize",
)
# data.max_record_bytes' default (mta_repro/data/args.py says why this size).
MAX_RECORD_BYTES = 16 << 20
# Compressed bytes fed to the zstd decompressor at a time: a zstd block of one repeated byte
# expands ~32,000x, so 512 bytes make at most ~16 MiB (measured: a 400 MB record of one
# byte, 12 KB compressed, comes out in pieces of 16 MiB); as fast as 1 MiB feeds on text.
_ZSTD_FEED = 512
SUFFIXES = (".jsonl", ".jsonl.zst")


def _natural_key(p: str):
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
    return sorted(out, key=lambda e: _natural_key(e[0]))


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


class _CheckedZstd(io.RawIOBase):
    """The decompressed bytes of a .zst file (any number of frames), raising
    CorruptFileError when the file ends inside a frame: a truncated download, which
    ``zstandard``'s stream reader would end in silence."""

    def __init__(self, raw, path: Path) -> None:
        import zstandard

        self._zstd = zstandard
        self.raw, self.path = raw, path
        self._d = zstandard.ZstdDecompressor().decompressobj()
        self._out: list = []  # decompressed pieces not yet read, each held once (no copy into a buffer)
        self._pos = 0  # read position in self._out[0]
        self._in_frame = False
        self._eof = False
        self._pending = memoryview(b"")  # compressed bytes read and not yet fed

    def readable(self) -> bool:
        return True

    def _feed(self, data: bytes) -> None:
        while data:
            try:
                out = self._d.decompress(data)
            except self._zstd.ZstdError as e:
                raise CorruptFileError(f"{self.path}: not a valid zstd stream ({e})") from e
            if out:
                self._out.append(out)
            if self._d.eof:
                data = self._d.unused_data
                self._d = self._zstd.ZstdDecompressor().decompressobj()
                self._in_frame = False
            else:
                self._in_frame = True
                data = b""

    def readinto(self, b) -> int:
        while not self._out and not self._eof:
            if not self._pending:
                chunk = self.raw.read(1 << 20)
                if not chunk:
                    self._eof = True
                    if self._in_frame:
                        raise CorruptFileError(f"{self.path}: truncated (the file ends inside a zstd frame)")
                    break
                self._pending = memoryview(chunk)
            self._feed(bytes(self._pending[:_ZSTD_FEED]))
            self._pending = self._pending[_ZSTD_FEED:]
        if not self._out:
            return 0
        piece = self._out[0]
        n = min(len(b), len(piece) - self._pos)
        b[:n] = memoryview(piece)[self._pos : self._pos + n]
        self._pos += n
        if self._pos == len(piece):
            self._out.pop(0)
            self._pos = 0
        return n


class ShortFileError(EOFError):
    """A file that ends before the offset a stream saved in it (it changed since)."""


class OversizeRecord(bytes):
    """What ``_LineReader.readline`` gives for a line over the record limit: not its bytes
    but a stand-in whose ``len()`` is the line's length in the file (so byte offsets stay
    right) and which ``parse_line`` counts as a bad record ("oversize")."""

    size: int

    def __new__(cls, size: int) -> OversizeRecord:
        obj = super().__new__(cls, b"{}\n")
        obj.size = size
        return obj

    def __len__(self) -> int:
        return self.size


class _LineReader:
    """Lines of a .jsonl or .jsonl.zst file from a byte offset of the decompressed text,
    hashing every byte of text it reads: ``digest()`` is the sha256 of the first ``pos``
    bytes (the skipped prefix included), ``size``/``mtime_ns`` the file's stat when opened.

    A file shorter than ``offset`` raises ShortFileError; a truncated or corrupt .zst raises
    CorruptFileError (naming the file) when the reading gets to the damage. A line of more
    than ``max_bytes`` (its newline aside) is read past in 1 MiB pieces (hashed, never held
    whole) and returned as an ``OversizeRecord``; with the decompressor fed in small pieces,
    a record holds at most about twice the limit plus 16 MiB, however well it compresses."""

    def __init__(self, path: Path, offset: int, max_bytes: int = MAX_RECORD_BYTES) -> None:
        self.max_bytes = int(max_bytes)
        self.raw = open(path, "rb")  # noqa: SIM115 - held by the reader, closed by close()
        self.f = self.raw
        st = os.fstat(self.raw.fileno())
        self.size, self.mtime_ns = st.st_size, st.st_mtime_ns
        self.hash = hashlib.sha256()
        self.pos = 0
        try:
            if path.name.endswith(".zst"):
                self.f = io.BufferedReader(_CheckedZstd(self.raw, path), buffer_size=1 << 20)
            left = offset
            # Read and drop (no random access in a zstd frame), hashing what the run read before.
            while left > 0:
                chunk = self.f.read(min(left, 1 << 24))
                if not chunk:
                    raise ShortFileError(f"{path}: shorter than the saved offset {offset}")
                self.hash.update(chunk)
                left -= len(chunk)
        except BaseException:
            self.close()
            raise
        self.pos = offset

    def readline(self) -> bytes:
        line = self.f.readline(self.max_bytes + 1)
        self.hash.update(line)
        self.pos += len(line)
        if len(line) <= self.max_bytes or line.endswith(b"\n"):
            return line
        size = len(line)
        del line
        while True:  # the rest of the record, hashed, never held whole
            part = self.f.readline(1 << 20)
            self.hash.update(part)
            self.pos += len(part)
            size += len(part)
            if not part or part.endswith(b"\n"):
                return OversizeRecord(size)

    def digest(self) -> str:
        return self.hash.hexdigest()

    def close(self) -> None:
        self.f.close()
        self.raw.close()


def text_digest(path: Path, nbytes: int) -> tuple[str, int, int]:
    """(sha256 of the first ``nbytes`` bytes of the file's text, size, mtime_ns); raises
    FileNotFoundError, ShortFileError or CorruptFileError."""
    r = _LineReader(path, nbytes)
    try:
        return r.digest(), r.size, r.mtime_ns
    finally:
        r.close()


# Files reported unreadable in this process (warned once each, whatever stream meets them).
_WARNED_FILES: set = set()


def _bad(counts: dict[str, int] | None, kind: str) -> None:
    if counts is not None:
        counts[kind] = counts.get(kind, 0) + 1
        n = counts[kind]
        if n <= 5 or n % 1000 == 0:
            log.warning("data: skipped a bad record (%s); %d so far", kind, n)
    return None


def record_fields(rec, with_meta: bool, counts: dict[str, int] | None) -> tuple[str | None, str] | None:
    """(set name or None, text) of a parsed record, or None for a bad one (counted)."""
    if not isinstance(rec, dict):
        return _bad(counts, "malformed_json")
    text = rec.get("text")
    if not isinstance(text, str):
        return _bad(counts, "missing_text")
    name = None
    if with_meta:
        meta = rec.get("meta")
        if isinstance(meta, str):  # parquet exports may hold meta as a JSON string
            try:
                meta = json.loads(meta)
            except ValueError:
                meta = None
        name = meta.get("redpajama_set_name") if isinstance(meta, dict) else None
        if not isinstance(name, str):
            return _bad(counts, "missing_meta")
        if name not in DOMAIN_OF_SET:
            return _bad(counts, "unknown_set")
    if not text.strip():
        return _bad(counts, "empty")
    return name, text


def parse_line(line: bytes, with_meta: bool, counts: dict[str, int] | None) -> tuple[str | None, str] | None:
    """(set name or None, text) of a JSON line, or None for a bad record (counted)."""
    if isinstance(line, OversizeRecord):
        return _bad(counts, "oversize")
    try:
        s = line.decode("utf-8")
    except UnicodeDecodeError:
        return _bad(counts, "undecodable")
    try:
        rec = json.loads(s)
    except ValueError:
        return _bad(counts, "malformed_json")
    return record_fields(rec, with_meta, counts)


def parse_record(line: bytes, set_name: str | None, counts: dict[str, int] | None) -> str | None:
    """The document text of a JSON line, or None (a bad record, counted if ``counts``, or
    a record of another domain when ``set_name`` is given)."""
    r = parse_line(line, set_name is not None, counts)
    if r is None or (set_name is not None and r[0] != set_name):
        return None
    return r[1]


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


class BadLedger:
    """What the domain streams of one rank that read the same files (all of them in the
    slimpajama layout) have checked for bad records, so that every bad record and every
    unreadable file is counted once, by whichever stream reaches it first, and not again
    in a later epoch (the counts are of the distinct faults met so far).

    Plain bookkeeping derived from the streams' positions (rebuilt after a load), so it
    needs no state of its own: ``checked[file]`` is the number of the file's lines some
    stream has read in epoch 0 (the most any stream has read; reads are prefixes), once a
    stream is past epoch 0 every line has been read (``passed``), and ``files`` are the
    files found unreadable.
    """

    def __init__(self) -> None:
        self.streams: list[DocStream] = []
        self.files: set = set()
        self.checked: dict[str, float] = {}
        self.passed = False
        self._stale = False

    def invalidate(self) -> None:
        """A stream's position was set from outside (a load): rebuild before the next use."""
        self._stale = True

    def _rebuild(self) -> None:
        self._stale = False
        self.files = set().union(*(s.bad_files for s in self.streams))
        self.passed = any(s.epoch > 0 for s in self.streams)
        self.checked = {}
        if self.passed:
            return
        for s in self.streams:
            for i, (name, _, _) in enumerate(s.shard):
                if i < s.file or name in s.done:  # read (by this stream, or by the old ranks)
                    n = math.inf
                else:
                    n = s.partial.get(name, (0, 0))[0]
                    if i == s.file:
                        n = max(n, s.line)
                if n:
                    self.checked[name] = max(self.checked.get(name, 0), n)

    def claim(self, name: str, line: int) -> bool:
        """Whether ``line`` of ``name`` is read for the first time (then the reader counts
        its faults); marks it read."""
        if self._stale:
            self._rebuild()
        if self.passed or self.checked.get(name, 0) > line:
            return False
        self.checked[name] = line + 1
        return True

    def claim_file(self, name: str) -> bool:
        """Whether the unreadable file ``name`` is met for the first time (then it is counted)."""
        if self._stale:
            self._rebuild()
        if name in self.files:
            return False
        self.files.add(name)
        return True

    def enter_epoch(self, epoch: int) -> None:
        """A stream starts ``epoch``: past epoch 0, every line has been read once."""
        if epoch > 0:
            self.passed, self.checked = True, {}


class DocStream:
    """One domain's documents on one rank, endlessly (epoch after epoch), resumable.

    ``ledger``: shared by the streams of one loader that read the same files (in the
    slimpajama layout every domain stream reads every file of the rank's shard). Whichever
    stream reads a line first parses it and counts its faults in its ``bad``; the others
    (and later epochs) skip the lines that cannot be theirs without parsing them. So the
    sum of the streams' ``bad`` counts every bad record met so far once, from the first
    batch on, whichever domain is drawn. Without one, the stream counts alone.

    ``shard``: the rank's files as ``shard_files`` gives them (by default from today's
    listing); a loaded state replaces it by the one the run started with. ``files``: the
    files read to their end, {name: (size, mtime_ns, bytes of text, sha256)}, shared by the
    streams of a loader (its state's ``files``).
    """

    def __init__(
        self,
        args: DataArgs,
        domain: str,
        rank: int,
        world_size: int,
        ledger: BadLedger | None = None,
        shard: Sequence[tuple[str, int, int]] | None = None,
    ) -> None:
        self.domain = domain
        self.root = corpus_root(args)
        self.seed = args.seed
        if shard is None:
            shard = shard_files(list_files(args, domain, "train"), rank, world_size)
        # A tuple (never changed in place): streams of one loader share it, and so does the
        # pickle of their states.
        self.base_shard = _as_shard(shard)
        self.shard = epoch_order(self.base_shard, self.seed, domain, 0)
        self.rank = rank
        self.max_record_bytes = args.max_record_bytes
        self.set_name = SET_NAMES[domain] if args.layout == "slimpajama" else None
        self._needle = json.dumps(self.set_name).encode() if self.set_name else None
        self.where = f"domain {domain!r} on rank {rank}/{world_size}"
        self.file, self.line, self.offset, self.epoch, self.docs_in_epoch = 0, 0, 0, 0, 0
        self.bad: dict[str, int] = {}
        self.bad_files: set = set()  # files found unreadable (counted once each, by one stream)
        self._reader: _LineReader | None = None
        # Set by ``derive_from`` (a resume on another world size), for this epoch only:
        # files other ranks already read, and files they read part of ({file: (line, offset)}).
        self.done: set = set()
        self.partial: dict[str, tuple[int, int]] = {}
        # What a loaded state says the run read of files it reopens at an offset:
        # {file: (offset, sha256 of the text before it, size, mtime_ns)}.
        self.expect: dict[str, tuple[int, str, int, int]] = {}
        self.files: dict[str, tuple[int, int, int, str]] = {}
        self.ledger = BadLedger()
        self.use_ledger(ledger if ledger is not None else self.ledger)

    def use_ledger(self, ledger: BadLedger) -> None:
        """Count bad records with ``ledger`` (shared with the streams reading the same files)."""
        if self in self.ledger.streams:
            self.ledger.streams.remove(self)
            self.ledger.invalidate()
        self.ledger = ledger
        if self not in ledger.streams:
            ledger.streams.append(self)
        ledger.invalidate()

    # ------------------------------------------------------------------ state
    def _open_record(self) -> dict | None:
        """What identifies the text read of the current file: its stat when opened and the
        sha256 of its first ``offset`` bytes (None before the first line)."""
        if self.offset == 0:
            return None
        r = self._reader
        if r is not None and r.pos == self.offset:
            return {"size": r.size, "mtime_ns": r.mtime_ns, "sha256": r.digest()}
        exp = self.expect.get(self.shard[self.file][0])
        if exp is not None and exp[0] == self.offset:  # loaded, not reopened yet
            return {"size": exp[2], "mtime_ns": exp[3], "sha256": exp[1]}
        return None

    def state_dict(self) -> dict:
        return {
            "file": self.shard[self.file][0],
            "line": self.line,
            "offset": self.offset,
            "epoch": self.epoch,
            "docs_in_epoch": self.docs_in_epoch,
            "bad": dict(self.bad),
            "bad_files": sorted(self.bad_files),
            "done": sorted(self.done),
            "partial": {f: list(v) for f, v in self.partial.items()},
            "shard": self.base_shard,
            "open": self._open_record(),
        }

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("shard") is not None:  # the files the run started with (states since it is saved)
            self.base_shard = _as_shard(sd["shard"])
        self.shard = epoch_order(self.base_shard, self.seed, self.domain, int(sd["epoch"]))
        names = [f for f, _, _ in self.shard]
        if sd["file"] not in names:
            raise UserError(f"data loader state: file {sd['file']!r} is not in the shard of {self.where}")
        self.close()
        self.file = names.index(sd["file"])
        self.line, self.offset = int(sd["line"]), int(sd["offset"])
        self.epoch, self.docs_in_epoch = int(sd["epoch"]), int(sd["docs_in_epoch"])
        self.bad = dict(sd["bad"])
        self.bad_files = set(sd.get("bad_files", ()))
        self.done = set(sd.get("done", ()))
        self.partial = {f: (int(v[0]), int(v[1])) for f, v in sd.get("partial", {}).items()}
        self.expect = {}
        op = sd.get("open")
        if op and self.offset > 0:
            self.expect[sd["file"]] = (self.offset, str(op["sha256"]), int(op["size"]), int(op["mtime_ns"]))
        self.ledger.invalidate()

    def reopen(self) -> tuple[str, str, str] | None:
        """Open the current file at the saved offset now (a resume reads its text up to
        there anyway) and compare the sha256 of that text with the saved one. None when it
        matches or there is nothing to compare, else ("changed" | "warn", file, one line)."""
        if self.offset == 0:
            return None
        return self._check_prefix(self.shard[self.file][0], self.offset, keep=True)

    def _check_prefix(self, name: str, offset: int, keep: bool) -> tuple[str, str, str] | None:
        exp = self.expect.get(name)
        path = self.root / name
        read = f"the {offset:,} bytes of text rank {self.rank} read of it"
        if keep:
            self.close()
        try:
            reader = _LineReader(path, offset)
        except FileNotFoundError:
            return (
                "warn",
                name,
                (
                    f"{path} vanished after rank {self.rank} read {offset:,} bytes of its text: "
                    f"its rest is not read (domain {self.domain!r} goes on with its next file)"
                ),
            )
        except ShortFileError:
            return "changed", name, f"{path} is now shorter than {read}"
        except CorruptFileError as e:
            return "changed", name, f"{path} cannot be read up to {read} ({e})"
        if keep:
            self._reader = reader
        else:
            reader.close()
        if exp is None or exp[0] != offset:
            return None
        _, sha, size, mtime = exp
        if reader.digest() != sha:
            return (
                "changed",
                name,
                (
                    f"{path}: {read} changed (sha256 {sha[:12]} then, {reader.digest()[:12]} "
                    f"now; size {size:,} -> {reader.size:,} bytes)"
                ),
            )
        if reader.size != size:  # the same text up to the offset; what is left to read differs
            return (
                "warn",
                name,
                (
                    f"{path} changed after {read} (size {size:,} -> {reader.size:,} bytes, same "
                    "text up to there): the run reads its new rest"
                ),
            )
        return None

    def check_partial(self) -> list[tuple[str, str, str]]:
        """``reopen``'s check for the files other ranks read part of (``derive_from``)."""
        out = []
        for name, (_, offset) in sorted(self.partial.items()):
            found = self._check_prefix(name, offset, keep=False) if name in self.expect else None
            if found is not None:
                out.append(found)
        return out

    def derive_from(self, states: list[dict], shards: list[list[tuple[str, int, int]]]) -> bool:
        """Continue where the streams of another world size stopped (``states[r]`` of the
        old rank r, whose shard was ``shards[r]``): in the epoch they share, skip every file
        they read and start the files they read part of where they stopped. Only whole-file
        shards map (at least as many files as ranks, before and after): returns False if not.
        An old rank already in a later epoch counts its whole shard as read."""
        if any(st != 1 for sh in [self.shard, *shards] for _, st, _ in sh):
            return False
        epoch = min(int(s["epoch"]) for s in states)
        done, partial, expect = set(), {}, {}
        for s, sh in zip(states, shards):
            names = [f for f, _, _ in epoch_order(sh, self.seed, self.domain, int(s["epoch"]))]
            if int(s["epoch"]) > epoch:
                done.update(names)
                continue
            i = names.index(s["file"])
            done.update(names[:i])
            done.update(s.get("done", ()))  # an earlier resume on another world size
            for f, v in s.get("partial", {}).items():
                partial[f] = (int(v[0]), int(v[1]))
            if int(s["line"]) > 0:
                partial[s["file"]] = (int(s["line"]), int(s["offset"]))
                done.discard(s["file"])
                op = s.get("open")
                if op:
                    expect[s["file"]] = (int(s["offset"]), str(op["sha256"]), int(op["size"]), int(op["mtime_ns"]))
        self.close()
        self.file, self.line, self.offset, self.epoch = 0, 0, 0, epoch
        self.shard = epoch_order(self.base_shard, self.seed, self.domain, epoch)
        self.docs_in_epoch = 1 if (done or partial) else 0  # the epoch is not empty
        self.done, self.partial, self.expect = done, partial, expect
        self.bad = {}
        for s in states:
            for k, v in s["bad"].items():
                self.bad[k] = self.bad.get(k, 0) + int(v)
        # the files the old ranks found unreadable were counted: not again
        self.bad_files = set().union(*(s.get("bad_files", ()) for s in states))
        self.ledger.invalidate()
        return True

    def restart(self) -> None:
        """Back to the start of epoch 0 (the data order restarts; the counts are kept)."""
        self.close()
        self.file, self.line, self.offset, self.epoch, self.docs_in_epoch = 0, 0, 0, 0, 0
        self.shard = epoch_order(self.base_shard, self.seed, self.domain, 0)
        self.done, self.partial, self.expect = set(), {}, {}
        self.ledger.invalidate()

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    # ------------------------------------------------------------------ reading
    def _next_file(self) -> None:
        self.close()
        self.file, self.line, self.offset = self.file + 1, 0, 0
        if self.file == len(self.shard):
            if self.docs_in_epoch == 0:
                raise UserError(
                    f"data: no usable documents for {self.where} in {[f for f, _, _ in self.shard]} "
                    f"under {self.root} (bad records: {self.bad})"
                )
            self.file, self.epoch, self.docs_in_epoch = 0, self.epoch + 1, 0
            self.done, self.partial = set(), {}
            self.shard = epoch_order(self.base_shard, self.seed, self.domain, self.epoch)
            self.ledger.enter_epoch(self.epoch)
            log.info("data: %s starts epoch %d", self.where, self.epoch)

    def _skip_once(self, name: str, why: str) -> None:
        if ("skip", str(self.root / name)) not in _WARNED_FILES:
            _WARNED_FILES.add(("skip", str(self.root / name)))
            log.warning("data: %s %s", self.root / name, why)

    def _read_whole(self, name: str) -> None:
        """The reader got to the end of ``name``: record what identifies its whole text."""
        r = self._reader
        assert r is not None
        rec = (r.size, r.mtime_ns, r.pos, r.digest())
        old = self.files.get(name)
        if old is not None and old[2:] != rec[2:] and ("changed", str(self.root / name)) not in _WARNED_FILES:
            _WARNED_FILES.add(("changed", str(self.root / name)))
            log.warning(
                "data: %s changed while the run was reading the corpus: its text now differs from what "
                "rank %d read of it before (sha256 %s then, %s now)",
                self.root / name,
                self.rank,
                old[3][:12],
                rec[3][:12],
            )
        self.files[name] = rec

    def next_doc(self) -> str:
        while True:
            name, stride, sub = self.shard[self.file]
            if self._reader is None:
                if name in self.done:
                    self._next_file()
                    continue
                if name in self.partial and self.line == 0 and self.offset == 0:
                    self.line, self.offset = self.partial.pop(name)
            try:
                if self._reader is None:
                    self._reader = _LineReader(self.root / name, self.offset, self.max_record_bytes)
                line = self._reader.readline()
            except FileNotFoundError:  # vanished since the run listed it: not a damaged file
                self._skip_once(name, "vanished since the run started; it is skipped")
                self._next_file()
                continue
            except ShortFileError:  # shorter than what was read of it (a change accepted on resume)
                self._skip_once(
                    name, f"is shorter than the {self.offset:,} bytes of text read of it before; its rest is skipped"
                )
                self._next_file()
                continue
            except Exception as e:  # noqa: BLE001 - a corrupt/truncated file: skip its rest
                # counted once on this rank (the first stream to meet it) and, for a file cut
                # into line-strided parts among ranks, only by the rank of part 0
                if self.ledger.claim_file(name) and sub == 0:
                    self.bad["corrupt_file"] = self.bad.get("corrupt_file", 0) + 1
                self.bad_files.add(name)
                if str(self.root / name) not in _WARNED_FILES:
                    _WARNED_FILES.add(str(self.root / name))
                    log.warning(
                        "data: %s is truncated or corrupt (unreadable after line %d: %s); its remaining "
                        "records are skipped (counted as bad 'corrupt_file')",
                        self.root / name,
                        self.line,
                        e,
                    )
                self._next_file()
                continue
            if not line:
                self._read_whole(name)
                self._next_file()
                continue
            j = self.line
            # before this stream's position moves past line j: a ledger rebuilt now (a fresh
            # one is) counts the lines before this stream's position as read by it
            first = self.ledger.claim(name, j)  # no stream of this rank read line j yet
            self.line += 1
            self.offset += len(line)
            if j % stride != sub or not line.strip():
                continue
            if not first and self._needle is not None and self._needle not in line:
                continue  # cannot be this domain's record; its faults were counted by a stream ahead
            text = parse_record(line, self.set_name, self.bad if first else None)
            if text is not None:
                self.docs_in_epoch += 1
                return text


def _as_shard(shard) -> tuple[tuple[str, int, int], ...]:
    """A shard as a tuple of (file, stride, offset) tuples (the same object if it is one)."""
    if isinstance(shard, tuple) and all(isinstance(e, tuple) for e in shard):
        return shard
    return tuple((str(f), int(st), int(off)) for f, st, off in shard)


def iter_docs(args: DataArgs, domain: str, split: str = "validation") -> Iterator[str]:
    """All documents of ``domain`` in ``split`` (one pass, one process); bad records are
    skipped, counted and the counts logged at the end."""
    root = corpus_root(args)
    set_name = SET_NAMES[domain] if args.layout == "slimpajama" else None
    counts: dict[str, int] = {}
    for name in list_files(args, domain, split):
        reader = _LineReader(root / name, 0, args.max_record_bytes)
        try:
            while line := reader.readline():
                if line.strip():
                    text = parse_record(line, set_name, counts)
                    if text is not None:
                        yield text
        finally:
            reader.close()
    if counts:
        log.warning("data: %s/%s: skipped bad records %s", domain, split, counts)


def shard_texts(
    root: Path, shard: list[tuple[str, int, int]], set_names: set | None, max_bytes: int = MAX_RECORD_BYTES
) -> Iterator[str]:
    """The document texts of a rank's shard (``shard_files``) in file order, one pass:
    records of ``set_names`` (the slimpajama layout; None: every record, the domains
    layout). Bad records are skipped uncounted, and an unreadable file is left at its
    damage (the streams count both when they read them)."""
    for name, stride, sub in shard:
        try:
            reader = _LineReader(root / name, 0, max_bytes)
        except OSError:
            continue
        try:
            j = -1
            while True:
                try:
                    line = reader.readline()
                except Exception:  # noqa: BLE001 - a corrupt/truncated file: the rest is unreadable
                    break
                if not line:
                    break
                j += 1
                if j % stride != sub or not line.strip():
                    continue
                rec = parse_line(line, set_names is not None, None)
                if rec is not None and (set_names is None or rec[0] in set_names):
                    yield rec[1]
        finally:
            reader.close()
