"""The training data loader: mixture -> tokens -> packed windows -> shuffle buffer -> batches.

Per rank, for every document: a domain is drawn by the per-document weights (seeded
numpy Generator), the domain's stream gives its next document, the tokenizer wraps it in
BOS ... EOS, and the tokens are appended to a running sequence that is cut into
``seq_len + 1`` windows (no document masking; a document may span windows). Windows go
through a shuffle buffer (``shuffle_buffer`` windows; each output is a uniformly drawn
slot refilled with the next window) and ``batch_size`` of them form a batch:
``input = window[:-1]``, ``target = window[1:]``. ``ready`` reads ahead what the next batch
needs, with a stop check between documents. A first batch that needs more tokens than the
rank's share of the split holds is refused when the loader is built. A domain's stream
repeats its files in the same order once exhausted (epochs are counted in the state).

Every piece of the iterator's state is plain data (``state_dict``): the streams' file
positions, both RNG states, the packing remainder, the buffer's windows, counters, so
``load_state_dict`` on a fresh loader continues with exactly the batches the original would
have produced next. With ``prefetch > 0`` a background thread makes batches ahead; each
queued batch carries the state *after* it, so ``state_dict()`` is the state of the last
batch handed out. The state also says what the run read (each stream's shard, the sha256
of the text read, the files read to their end); ``load_state_dict`` checks it and leaves
its findings in ``input_check`` (docs/provenance.md).
"""

from __future__ import annotations

import bisect
import contextlib
import copy
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator

import numpy as np
import torch

from mta_repro.data.args import DataArgs, active_sources, to_data_args
from mta_repro.data.listing import check_domain, corpus_root, fingerprint, list_entries, natural_key, shard_files
from mta_repro.data.readers import ShortFileError, text_digest
from mta_repro.data.records import BAD_KINDS, SET_NAMES
from mta_repro.data.sources import BadLedger, DocStream, iter_docs, shard_texts
from mta_repro.data.tokenizers import build_tokenizer
from mta_repro.errors import CorruptFileError, UserError

log = logging.getLogger(__name__)

STATE_VERSION = 1


class _WorkerStopped(Exception):
    """The prefetch thread was asked to stop (``close``) while it read."""


# A shuffle buffer whose fill would read the rank's share of the corpus more than this many
# times is refused (a tiny corpus with the default buffer only warns: tests and demos do that).
MAX_FILL_CYCLES = 100


class TrainLoader:
    def __init__(self, args: DataArgs, rank: int = 0, world_size: int = 1) -> None:
        self.args = to_data_args(args)
        self.rank, self.world_size = rank, world_size
        self.tokenizer = build_tokenizer(self.args.tokenizer)
        weights = active_sources(self.args)
        for d in self.args.sources:
            check_domain(self.args, d)
        self.domains: list[str] = list(weights)
        self.cum = np.cumsum([weights[d] for d in self.domains]).tolist()
        # One listing per folder read (every domain's in the slimpajama layout: train/), and
        # one shard object per listing, shared by the streams reading it.
        self._listings: dict[str, list] = {}
        shards: dict[str, tuple] = {}
        for d in self.domains:
            key = self._listing_key(d)
            if key not in self._listings:
                self._listings[key] = list_entries(self.args, d, "train")
                shards[key] = tuple(shard_files([e[0] for e in self._listings[key]], rank, world_size))
        self.streams: dict[str, DocStream] = {
            d: DocStream(self.args, d, rank, world_size, shard=shards[self._listing_key(d)]) for d in self.domains
        }
        self.root = corpus_root(self.args)
        # What the files look like now (name -> (size, mtime_ns)) and the listing's fingerprint.
        self._listed = {name: (size, mtime) for e in self._listings.values() for name, size, mtime in e}
        entries = [(n, sz, mt) for n, (sz, mt) in self._listed.items()]
        # With mtimes (the record), and without (what a resume compares: a touched file is no change).
        self.layout = {**fingerprint(entries), "sha256_names_sizes": fingerprint(entries, with_mtime=False)["sha256"]}
        # Files read to their end on this rank: {name: (size, mtime_ns, bytes of text, sha256)}.
        self.files: dict[str, tuple] = {}
        for s in self.streams.values():
            s.files = self.files
        # What the last load found (``load_state_dict``): {"refuse": [...], "warn": [...]},
        # and the names of the files refused there (``accept_input_changes``).
        self.input_check: dict | None = None
        self._changed: set = set()
        # Streams that read the same files (every domain in the slimpajama layout) share a
        # ledger, so a bad record or file is counted once, by whichever stream reads it first.
        ledgers: dict[tuple, BadLedger] = {}
        for s in self.streams.values():
            s.use_ledger(ledgers.setdefault(tuple(s.base_shard), s.ledger))
        # Two independent generators so the document sequence does not depend on the
        # buffer size. Seeds combine the data seed with the rank.
        self.doc_rng = np.random.Generator(np.random.PCG64([self.args.seed, rank, 0]))
        self.buf_rng = np.random.Generator(np.random.PCG64([self.args.seed, rank, 1]))
        self.tokens: list[int] = []  # packing remainder: tokens[_pos:] are not yet in a window
        self.doms: list[int] = []  # the domain index of every token in self.tokens
        self._pos = 0
        self.buffer: list[np.ndarray] = []  # shuffle buffer of (seq_len + 1,) int32 windows
        self.buffer_doms: list[np.ndarray] = []  # their tokens' domain indices (int8)
        self.n_docs = {d: 0 for d in self.domains}
        # Target tokens handed out per domain (index len(domains): unknown, from an old state).
        self.n_tokens = np.zeros(len(self.domains) + 1, dtype=np.int64)
        self.n_batches = 0
        self._thread: threading.Thread | None = None
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()
        self._handed_state: dict | None = None  # prefetch: the state after the last batch out
        self._check_split_holds_a_window()

    def _check_split_holds_a_window(self) -> None:
        """Refuse, before any batch, a window (data.seq_len + 1 tokens) longer than this
        rank's share of the training split: it would hold every document more than once,
        and the loader would cycle the corpus to fill it; so is a shuffle buffer whose fill
        would cycle the share more than ``MAX_FILL_CYCLES`` times (``data.shuffle_buffer=1e9``).
        A first batch (the shuffle buffer's fill and one
        batch) that the share cannot hold is told in one warning.
        Counts only up to what the first batch needs: on a corpus that holds it, about
        one batch of reading."""
        n = self.args.seq_len + 1
        k = self.args.shuffle_buffer if self.args.shuffle_buffer > 1 else 0
        need = (k + self.args.batch_size) * n
        total, seen = 0, set()
        sets = {SET_NAMES[d] for d in self.domains} if self.args.layout == "slimpajama" else None
        for d in self.domains:
            shard = [f for f in self.streams[d].base_shard if f not in seen]
            seen.update(shard)
            for text in shard_texts(self.streams[d].root, shard, sets, self.args.max_record_bytes):
                total += len(self.tokenizer.encode(text, add_bos=self.args.add_bos, add_eos=self.args.add_eos))
                if total >= need:
                    return
        where = (
            f"the training split under {self.args.root_dir} holds {total:,} tokens for rank "
            f"{self.rank}/{self.world_size} (domains {', '.join(self.domains)})"
        )
        if total == 0:
            return  # no usable document: the domain's stream says which, with its bad records
        if total < n:
            raise UserError(
                f"data: one window of data.seq_len+1={n:,} tokens is longer than the corpus: {where}, so every "
                "window would repeat each document. Lower data.seq_len, or point data.root_dir at a larger corpus"
            )
        if k * n > MAX_FILL_CYCLES * total:  # a typo, not a choice: the fill would read the corpus ~k*n/total times
            raise UserError(
                f"data.shuffle_buffer={k:,} windows of data.seq_len+1={n:,} tokens ({k * n:,}) is more than "
                f"{MAX_FILL_CYCLES} times the corpus: {where}, {total // n:,} windows; its fill would cycle the "
                f"corpus about {-(-k * n // total):,} times. Set data.shuffle_buffer <= "
                f"{MAX_FILL_CYCLES * total // n:,}"
            )
        log.warning(
            "data: the first batch needs %s tokens (data.shuffle_buffer=%d + data.batch_size=%d windows of "
            "%d) but %s: it repeats documents, and the shuffle buffer's fill cycles the corpus about %d "
            "times; lower data.shuffle_buffer or data.seq_len",
            f"{need:,}",
            k,
            self.args.batch_size,
            n,
            where,
            -(-need // total),
        )

    def _listing_key(self, domain: str) -> str:
        return "train" if self.args.layout == "slimpajama" else domain

    # ------------------------------------------------------------------ pipeline
    def _next_doc_tokens(self) -> tuple[list[int], int]:
        u = self.doc_rng.random()
        i = min(bisect.bisect_right(self.cum, u * self.cum[-1]), len(self.domains) - 1)
        d = self.domains[i]
        text = self.streams[d].next_doc()
        self.n_docs[d] += 1
        return self.tokenizer.encode(text, add_bos=self.args.add_bos, add_eos=self.args.add_eos), i

    def _read_doc(self, interrupt: Callable[[], None] | None) -> None:
        """One more document onto the packing remainder. ``interrupt()`` first: it may raise
        to stop a long read-ahead, which leaves the loader between two documents (its state
        as valid as after any batch)."""
        if interrupt is not None:
            interrupt()
        ids, i = self._next_doc_tokens()
        self.tokens.extend(ids)
        self.doms.extend([i] * len(ids))

    def _next_window(self, interrupt: Callable[[], None] | None = None) -> tuple[np.ndarray, np.ndarray]:
        n = self.args.seq_len + 1
        while len(self.tokens) - self._pos < n:
            self._read_doc(interrupt)
        w = np.asarray(self.tokens[self._pos : self._pos + n], dtype=np.int32)
        dw = np.asarray(self.doms[self._pos : self._pos + n], dtype=np.int8)
        self._pos += n
        if self._pos > len(self.tokens) // 2:  # drop the used head now and then, not per window
            del self.tokens[: self._pos]
            del self.doms[: self._pos]
            self._pos = 0
        return w, dw

    def _next_sequence(self) -> tuple[np.ndarray, np.ndarray]:
        k = self.args.shuffle_buffer
        if k <= 1:
            return self._next_window()
        while len(self.buffer) < k:
            w, dw = self._next_window()
            self.buffer.append(w)
            self.buffer_doms.append(dw)
        i = int(self.buf_rng.integers(len(self.buffer)))
        out = self.buffer[i], self.buffer_doms[i]
        self.buffer[i], self.buffer_doms[i] = self._next_window()
        return out

    def _read_ahead(self, n_windows: int, interrupt: Callable[[], None] | None) -> None:
        """Read what the next ``n_windows`` outputs need: the shuffle buffer's first fill (the
        warm-up) and ``n_windows`` windows of tokens on the remainder. The outputs then cut
        and draw without reading, so a stop (``interrupt`` raising) can only come between
        two documents. Reading ahead changes no batch: windows are cut from the same token
        stream, and the buffer's draws use their own generator."""
        k = self.args.shuffle_buffer
        while k > 1 and len(self.buffer) < k:
            w, dw = self._next_window(interrupt)
            self.buffer.append(w)
            self.buffer_doms.append(dw)
        need = n_windows * (self.args.seq_len + 1)
        while len(self.tokens) - self._pos < need:
            self._read_doc(interrupt)

    def _make_batch(self, interrupt: Callable[[], None] | None = None) -> dict[str, torch.Tensor]:
        self._read_ahead(self.args.batch_size, interrupt)
        pairs = [self._next_sequence() for _ in range(self.args.batch_size)]
        seqs = np.stack([w for w, _ in pairs])  # (B, T+1)
        for _, dw in pairs:  # the targets' domains
            self.n_tokens += np.bincount(dw[1:].astype(np.int64), minlength=len(self.n_tokens))
        t = torch.from_numpy(seqs.astype(np.int64))
        self.n_batches += 1
        return {"input": t[:, :-1].contiguous(), "target": t[:, 1:].contiguous()}

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> TrainLoader:
        return self

    def ready(self, n_batches: int = 1, interrupt: Callable[[], None] | None = None) -> None:
        """Read ahead what the next ``n_batches`` batches need (the first call: the loader's
        warm-up, the shuffle buffer's fill), calling ``interrupt()`` between documents; it
        may raise (the trainer's stop check), leaving the loader as it was between two
        batches. Those batches then come without reading. With ``prefetch``: wait until
        the thread has them queued (up to ``prefetch``), calling ``interrupt()`` meanwhile."""
        if self.args.prefetch <= 0:
            self._read_ahead(n_batches * self.args.batch_size, interrupt)
            return
        if self._thread is None:
            self._start()
        q, thread = self._queue, self._thread
        assert q is not None and thread is not None
        want = min(n_batches, self.args.prefetch)
        while q.qsize() < want and thread.is_alive():
            if interrupt is not None:
                interrupt()
            time.sleep(0.05)

    def __next__(self) -> dict[str, torch.Tensor]:
        if self.args.prefetch <= 0:
            return self._make_batch()
        if self._thread is None:
            self._start()
        assert self._queue is not None
        item = self._queue.get()
        if isinstance(item, BaseException):
            self._join()
            raise item
        batch, state = item
        self._handed_state = state
        return batch

    def _start(self) -> None:
        self._handed_state = self._state()
        self._stop.clear()
        self._queue = queue.Queue(maxsize=self.args.prefetch)
        self._thread = threading.Thread(target=self._worker, name=f"data-prefetch-r{self.rank}", daemon=True)
        self._thread.start()

    def _worker_interrupt(self) -> None:
        if self._stop.is_set():  # close(): stop the thread between two documents
            raise _WorkerStopped

    def _worker(self) -> None:
        q = self._queue
        assert q is not None
        try:
            while not self._stop.is_set():
                item = (self._make_batch(self._worker_interrupt), self._state())
                while not self._stop.is_set():
                    try:
                        q.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except _WorkerStopped:
            return
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, raised there
            q.put(e)

    def _join(self) -> None:
        thread, q = self._thread, self._queue
        if thread is None:
            return
        assert q is not None
        self._stop.set()
        while thread.is_alive():
            with contextlib.suppress(queue.Empty):  # unblock a put
                q.get_nowait()
            thread.join(timeout=0.05)
        self._thread, self._queue = None, None

    def close(self) -> None:
        """Stop the prefetch thread (if any) and close open files."""
        if self._thread is not None:
            state = self._handed_state
            assert state is not None
            self._join()
            self._load(state)  # iterator back to the last batch handed out
        for s in self.streams.values():
            s.close()

    # ------------------------------------------------------------------ state
    def _config(self) -> dict:
        """The settings a saved state is only valid under."""
        return {
            "seq_len": self.args.seq_len,
            "batch_size": self.args.batch_size,
            "layout": self.args.layout,
            "sources": dict(active_sources(self.args)),
            "shuffle_buffer": self.args.shuffle_buffer,
            "seed": self.args.seed,
            "add_bos": self.args.add_bos,
            "add_eos": self.args.add_eos,
            "tokenizer": {"name": self.args.tokenizer.name, "n_words": self.tokenizer.n_words},
        }

    def _state(self) -> dict:
        """The pipeline's state now, as plain data (a deep copy)."""
        return {
            "version": STATE_VERSION,
            "rank": self.rank,
            "world_size": self.world_size,
            "config": self._config(),
            "streams": {d: s.state_dict() for d, s in self.streams.items()},
            "doc_rng": copy.deepcopy(self.doc_rng.bit_generator.state),
            "buf_rng": copy.deepcopy(self.buf_rng.bit_generator.state),
            "tokens": self.tokens[self._pos :],
            # (n, seq_len + 1) int32; a tensor keeps the pickle small.
            "buffer": torch.from_numpy(np.stack(self.buffer))
            if self.buffer
            else torch.zeros(0, self.args.seq_len + 1, dtype=torch.int32),
            "n_docs": dict(self.n_docs),
            "n_batches": self.n_batches,
            # Domain of every token of the remainder / buffer, and the target tokens handed
            # out per domain (token_counts).
            "doms": torch.tensor(self.doms[self._pos :], dtype=torch.int8),
            "buffer_doms": torch.from_numpy(np.stack(self.buffer_doms))
            if self.buffer_doms
            else torch.zeros(0, self.args.seq_len + 1, dtype=torch.int8),
            "n_tokens": {d: int(self.n_tokens[i]) for i, d in enumerate(self.domains)},
            # What identifies the files read to their end, and the listing at this start.
            "files": dict(self.files),
            "layout": dict(self.layout),
        }

    def token_counts(self) -> dict[str, int]:
        """Target tokens handed out so far per domain (what was trained on), this rank."""
        if self._thread is not None and self._handed_state is not None:
            return dict(self._handed_state["n_tokens"])
        return {d: int(self.n_tokens[i]) for i, d in enumerate(self.domains)}

    def state_dict(self) -> dict:
        """Picklable state: a loader given it by ``load_state_dict`` yields exactly the
        batches this one would yield next."""
        if self._thread is not None:
            assert self._handed_state is not None
            return copy.deepcopy(self._handed_state)
        return self._state()

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("version") != STATE_VERSION:
            raise UserError(f"data loader state: version {sd.get('version')!r}, expected {STATE_VERSION}")
        if (sd["rank"], sd["world_size"]) != (self.rank, self.world_size):
            raise UserError(
                f"data loader state is of rank {sd['rank']}/{sd['world_size']}, loader is rank "
                f"{self.rank}/{self.world_size} (resuming on another world size cannot be exact)"
            )
        mine = self._config()
        for key, val in sd["config"].items():
            if mine.get(key) != val:
                raise UserError(f"data loader state: data.{key} was {val!r}, the config now has {mine.get(key)!r}")
        self._join()
        self._load(sd)
        self.input_check = self._check_inputs(sd.get("layout"))

    # ------------------------------------------------------------------ inputs
    def inputs(self) -> dict:
        """What this loader reads, for the run's record: the corpus root, its layout and the
        fingerprint of the training files' listing (names, sizes, mtimes; nothing is read)."""
        return {"root": str(self.root), "layout": self.args.layout, "train": dict(self.layout)}

    def check_inputs(self) -> dict:
        """``input_check`` of the streams' current positions (set from outside, e.g. another
        run's: mta_repro/pipeline/data.py)."""
        self.input_check = self._check_inputs(None)
        return self.input_check

    def _check_inputs(self, saved_layout: dict | None) -> dict:
        """Compare what the loaded state says the run read with the files now: each
        stream's current file reopened at its offset (its text hashed on the way), every
        file read to its end checked by its stat and rehashed only if the stat changed, the
        listing's fingerprint. {"refuse": lines of files whose text the run read changed,
        "warn": lines of changes where the run has not read yet}."""
        refuse: list[str] = []
        warn: list[str] = []
        self._changed = set()
        seen: set = set()  # names already reported
        for s in self.streams.values():
            for found in [s.reopen(), *s.check_partial()]:
                if found is not None:
                    kind, name, line = found
                    (refuse if kind == "changed" else warn).append(line)
                    seen.add(name)
                    if kind == "changed":
                        self._changed.add(name)
        for name, (size, mtime, nbytes, sha) in sorted(self.files.items()):
            path = self.root / name
            if name in seen:
                continue
            seen.add(name)
            try:
                st = os.stat(path)
            except FileNotFoundError:
                warn.append(f"{path} vanished after rank {self.rank} read it to its end: later epochs skip it")
                continue
            if (st.st_size, st.st_mtime_ns) == (size, mtime):
                continue
            try:
                now, _, _ = text_digest(path, nbytes)
                what = f"changed (sha256 {sha[:12]} then, {now[:12]} now; size {size:,} -> {st.st_size:,} bytes):"
            except ShortFileError:
                now, what = None, "is now shorter than"
            except CorruptFileError as e:
                now, what = None, f"cannot be read ({e}) up to"
            if now == sha:  # touched or copied, same text: remember the new stat
                self.files[name] = (st.st_size, st.st_mtime_ns, nbytes, sha)
                continue
            refuse.append(f"{path} {what} the {nbytes:,} bytes of text rank {self.rank} read of it")
            self._changed.add(name)
        # Files of this rank's share that vanished before it read them.
        pinned = {f for s in self.streams.values() for f, _, _ in s.base_shard}
        gone = sorted((f for f in pinned if f not in self._listed and f not in seen), key=natural_key)
        if gone:
            warn.append(
                f"{len(gone)} file(s) of rank {self.rank}'s share vanished before it read them "
                f"({', '.join(gone[:3])}{', ...' if len(gone) > 3 else ''}): it reads its other "
                f"{len(pinned) - len(gone):,} files without them"
            )
        key = "sha256_names_sizes" if saved_layout and "sha256_names_sizes" in saved_layout else "sha256"
        if saved_layout and saved_layout.get(key) != self.layout[key]:
            old, new = saved_layout, self.layout
            warn.append(
                f"the training files under {self.root} changed since this checkpoint was saved "
                f"({new['files']:,} files, {new['bytes']:,} bytes now; {old.get('files', 0):,} files, "
                f"{old.get('bytes', 0):,} bytes then): the run keeps reading the files it started with "
                "(files that appeared are not read; files that vanished are skipped; files it has not "
                "read yet are read as they are now)"
            )
        return {"refuse": refuse, "warn": warn}

    def accept_input_changes(self) -> None:
        """Go on after changes ``input_check`` refused (the run was told to accept them):
        forget the records of the changed files (a later read records them anew); the
        streams already read their current files as they are now."""
        for name in self._changed & set(self.files):
            del self.files[name]

    def load_other_world_state(self, states: list[dict]) -> None:
        """Continue the data of a checkpoint saved on another world size (``states``: the
        loader state of every old rank, in rank order).

        Each domain stream skips the files the old ranks read in their current epoch and
        starts the files they read part of where they stopped (``DocStream.derive_from``),
        so no document is read twice or skipped, except: the old ranks' packing remainders
        and shuffle buffers (at most ``shuffle_buffer + 1`` windows per old rank) are
        dropped, and an old rank that was already in a later epoch of a domain loses that
        progress. The domain draws continue from new seeds. If the shards cannot be mapped
        (fewer files than ranks: line-strided parts), the data order restarts with a warning.
        Token/document and bad-record counters are carried over (on rank 0, so the sums
        stay right)."""
        if not states:
            raise UserError("data loader state: no saved ranks")
        mine = self._config()
        for key, val in states[0]["config"].items():
            if key != "batch_size" and mine.get(key) != val:
                raise UserError(f"data loader state: data.{key} was {val!r}, the config now has {mine.get(key)!r}")
        self._join()
        old_world = len(states)
        derived = True
        new_shards: dict[tuple, tuple] = {}
        for d, stream in self.streams.items():
            saved = [s["streams"][d].get("shard") for s in states]
            if all(sh is not None for sh in saved):
                # The files the run started with: the union of the old ranks' shards, dealt anew.
                shards = [[tuple(e) for e in sh] for sh in saved]
                names = tuple(sorted({e[0] for sh in shards for e in sh}, key=natural_key))
                if names not in new_shards:
                    new_shards[names] = tuple(shard_files(list(names), self.rank, self.world_size))
                stream.base_shard = new_shards[names]
            else:  # a state saved before shards were: today's listing
                names = [e[0] for e in self._listings[self._listing_key(d)]]
                shards = [shard_files(names, r, old_world) for r in range(old_world)]
            derived = stream.derive_from([s["streams"][d] for s in states], shards) and derived
        if not derived:
            log.warning(
                "data: cannot map the data positions of %d ranks onto %d (fewer files than ranks); "
                "the data order restarts from the beginning (documents will repeat)",
                old_world,
                self.world_size,
            )
            for stream in self.streams.values():
                stream.restart()
        # Bad-record counts: the old ranks' sums on rank 0 (so the sum over ranks stays
        # right), derived or not; the files found unreadable are known to every rank (not
        # counted again).
        for d, stream in self.streams.items():
            olds = [s["streams"][d] for s in states]
            stream.bad = {}
            if self.rank == 0:
                for s in olds:
                    for k, v in s["bad"].items():
                        stream.bad[k] = stream.bad.get(k, 0) + int(v)
            stream.bad_files = set().union(*(s.get("bad_files", ()) for s in olds))
            stream.ledger.invalidate()
        total_batches = sum(int(s["n_batches"]) for s in states)
        self.doc_rng = np.random.Generator(np.random.PCG64([self.args.seed, self.rank, 2, old_world, total_batches]))
        self.buf_rng = np.random.Generator(np.random.PCG64([self.args.seed, self.rank, 3, old_world, total_batches]))
        self.tokens, self.doms, self._pos = [], [], 0
        self.buffer, self.buffer_doms = [], []
        self.n_docs = {d: 0 for d in self.domains}
        self.n_tokens = np.zeros(len(self.domains) + 1, dtype=np.int64)
        if self.rank == 0:
            for s in states:
                for i, d in enumerate(self.domains):
                    self.n_docs[d] += int(s["n_docs"].get(d, 0))
                    self.n_tokens[i] += int(s.get("n_tokens", {}).get(d, 0))
        self.n_batches = 0
        self._handed_state = None
        # The files any old rank read to its end that this rank will read again.
        mine = {f for s in self.streams.values() for f, _, _ in s.base_shard}
        self.files.clear()
        for s in states:
            self.files.update({k: tuple(v) for k, v in s.get("files", {}).items() if k in mine})
        self.input_check = self._check_inputs(states[0].get("layout"))

    def _load(self, sd: dict) -> None:
        for d, s in self.streams.items():
            s.load_state_dict(sd["streams"][d])
        self.doc_rng.bit_generator.state = copy.deepcopy(sd["doc_rng"])
        self.buf_rng.bit_generator.state = copy.deepcopy(sd["buf_rng"])
        self.tokens, self._pos = list(sd["tokens"]), 0
        self.buffer = [row.copy() for row in np.asarray(sd["buffer"], dtype=np.int32)]
        unknown = len(self.domains)  # states saved before domains were tracked per token
        if "doms" in sd:
            self.doms = [int(x) for x in np.asarray(sd["doms"])]
            self.buffer_doms = [row.copy() for row in np.asarray(sd["buffer_doms"], dtype=np.int8)]
        else:
            self.doms = [unknown] * len(self.tokens)
            self.buffer_doms = [np.full(len(r), unknown, dtype=np.int8) for r in self.buffer]
        self.n_tokens = np.zeros(len(self.domains) + 1, dtype=np.int64)
        for i, d in enumerate(self.domains):
            self.n_tokens[i] = int(sd.get("n_tokens", {}).get(d, 0))
        self.n_docs = dict(sd["n_docs"])
        self.n_batches = int(sd["n_batches"])
        self.files.clear()
        self.files.update({k: tuple(v) for k, v in sd.get("files", {}).items()})
        self._handed_state = None

    # ------------------------------------------------------------------ reporting
    def bad_records(self) -> dict[str, int]:
        """Bad records skipped so far on this rank, by kind (persisted in the state): every
        kind of ``BAD_KINDS``, 0 included, so every rank has the same names. Counted by the
        domain stream that read the record first (see ``DocStream``), up to the last batch
        handed out."""
        sd = self.state_dict()
        out = {k: 0 for k in BAD_KINDS}
        for s in sd["streams"].values():
            for k, v in s["bad"].items():
                out[k] = out.get(k, 0) + v
        return out

    def stats(self) -> dict:
        sd = self.state_dict()
        return {
            "n_batches": sd["n_batches"],
            "n_docs": sd["n_docs"],
            "epochs": {d: s["epoch"] for d, s in sd["streams"].items()},
            "bad_records": {k: v for k, v in self.bad_records().items() if v},
        }

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self._stop.set()


def build_train_loader(data_args, rank: int = 0, world_size: int = 1) -> TrainLoader:
    """The training loader of ``rank`` (of ``world_size``); see the module docstring."""
    return TrainLoader(data_args, rank, world_size)


def domains(data_args) -> list[str]:
    """The domains with positive weight (sorted)."""
    return list(active_sources(to_data_args(data_args)))


def iter_validation_docs(data_args, domain: str):
    """The documents of ``domain``'s validation file(s), in file order."""
    args = to_data_args(data_args)
    check_domain(args, domain)
    return iter_docs(args, domain, "validation")


def validation_windows(docs: Iterable[str], tokenizer, seq_len: int) -> Iterator[list]:
    """Windows of seq_len+1 tokens from the BOS/EOS-delimited concatenation of docs."""
    buf: list = []
    for doc in docs:
        buf.extend(tokenizer.encode(doc, add_bos=True, add_eos=True))
        while len(buf) >= seq_len + 1:
            yield buf[: seq_len + 1]
            buf = buf[seq_len:]  # the last target is the next window's first input
