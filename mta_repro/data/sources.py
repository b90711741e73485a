"""The document streams: one domain's documents on one rank, endless and resumable
(``DocStream``, its faults counted once with a ``BadLedger``), and the one-pass readers
``iter_docs`` (a domain's split) and ``shard_texts`` (a rank's shard).

A stream's position is plain data: shard file index, line number and byte offset (in the
decompressed stream) of the next line, epoch. The file it stopped in is reopened at the
saved offset (``mta_repro/data/readers.py``), and the sha256 of the text up to there is
compared with the one saved (``mta_repro/data/loader.py`` records and checks it;
docs/provenance.md). A stream keeps the shard it was started with (``shard_files`` of
``mta_repro/data/listing.py``): files that appear later are not read by the run, files
that vanish are skipped. A bad record (``mta_repro/data/records.py``) is skipped and
counted, an oversize one never held whole.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterator, Sequence
from pathlib import Path

from mta_repro.data.args import DataArgs
from mta_repro.data.listing import corpus_root, epoch_order, list_files, shard_files
from mta_repro.data.readers import MAX_RECORD_BYTES, LineReader, ShortFileError
from mta_repro.data.records import SET_NAMES, parse_line, parse_record
from mta_repro.errors import CorruptFileError, UserError

log = logging.getLogger(__name__)

# Files reported unreadable in this process (warned once each, whatever stream meets them).
_WARNED_FILES: set = set()


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
        self._reader: LineReader | None = None
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
            reader = LineReader(path, offset)
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
                    self._reader = LineReader(self.root / name, self.offset, self.max_record_bytes)
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
        reader = LineReader(root / name, 0, args.max_record_bytes)
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
            reader = LineReader(root / name, 0, max_bytes)
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
