"""Atomic, resumable checkpoints with torch.distributed.checkpoint (DCP).

Layout: ``<run_dir>/checkpoints/<step:010d>/`` holds the DCP files of a
``TrainState`` (mta_repro/train/state.py), saved as one object:

    {"model": plain model state dict (Lingua keys, sharded DTensors while saving),
     "optim": optimizer state dict (parameter-name keyed, from get_state_dict),
     "scheduler": LR-scheduler state, "step": int,
     "rank{r}": {"rng": ..., "data": loader state, "tokens_seen": int} of rank r, for every rank}

a ``config.yaml`` (the resolved run config: a resume checks the command against it when
the run's own config.yaml is gone), a ``provenance.json`` (mta_repro/runs/provenance.py)
and a ``.complete`` marker. A save writes into ``.tmp-<step>``, fsyncs every file and the
folder, adds the marker, renames the directory and fsyncs its parent, so neither a kill nor
a power loss leaves a directory that looks complete with data unwritten (stale temporaries
go at the next start); checkpoints beyond ``keep`` are renamed ``.pruned-<step>``, then
deleted; a full disk removes the save's temporary and stops the run in one line.

The scheduler and per-rank entries are plain types and tensors, read back with
``weights_only=True`` (``mta_repro.weights.safe``): resuming never unpickles code
(docs/trust.md). Finding and reading weights is ``mta_repro.weights``' (the layout helpers
below come from there).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint.state_dict_saver as dcp
from torch.distributed.checkpoint.api import CheckpointException

from mta_repro.errors import NoSpaceError, PeerFailedError, UserError
from mta_repro.files import caused_by_enospc, fsync_path, fsync_tree
from mta_repro.runs.provenance import RECORD as PROVENANCE
from mta_repro.train.distributed import gather_or_peer_failed
from mta_repro.train.state import TrainState, rank_key
from mta_repro.weights import load_weights
from mta_repro.weights.layout import (
    CHECKPOINT_CONFIG,
    COMPLETE,
    complete_checkpoints,
    saved_world_size,
    step_dir_name,
    verify_checkpoint,
)
from mta_repro.weights.safe import (
    CorruptFileError,
    UnsafeFileError,
    dcp_error_line,
    dcp_load,
    decode_state,
)

log = logging.getLogger(__name__)


def state_bytes(obj: Any) -> int:
    """The bytes of the tensors and byte strings in a (nested) state dict: what a checkpoint
    of it needs on disk, about (a sharded tensor counts whole)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (bytes, bytearray)):
        return len(obj)
    if isinstance(obj, dict):
        return sum(state_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(state_bytes(v) for v in obj)
    return 0


# What a failed write raises: DCP gathers the ranks' errors into a CheckpointException,
# which is a BaseException (a Ctrl-C during a save is not caught: it stops at once).
_SAVE_ERRORS = (Exception, CheckpointException)


# ------------------------------------------------------------------ RNG state
# ------------------------------------------------------------------ integrity
# Errors of a load that mean "this checkpoint is another model / world", not "damaged":
# falling back to an older checkpoint of the same run would not help.
_MISMATCH = ("Missing key", "Unexpected key", "size mismatch", "shape mismatch")


# A damaged checkpoint or weights file (the message names it): the trainer falls back to
# the previous checkpoint on it. One class with the weights module's, so either is caught.
CheckpointCorruptError = CorruptFileError


# ------------------------------------------------------------------ manager
class CheckpointManager:
    """Save / resume the training state of every rank under ``<run_dir>/checkpoints``.

    ``async_save``: ``save`` stages the state to CPU and returns while a thread writes the
    files; the save is finalised (marked complete, renamed, old ones rotated) at the
    next ``save``/``wait`` once the write finished, so a kill at any moment leaves the
    previous complete checkpoint as the latest.
    """

    def __init__(
        self,
        run_dir: Path,
        keep: int,
        rank: int,
        world_size: int,
        async_save: bool = False,
        config_text: str | None = None,
        save_hook: Callable | None = None,
    ):
        self.root = Path(run_dir) / "checkpoints"
        # fn(event, step, tmp) at "written" and "async_writing" (checkpoint.save_hook)
        self.save_hook = save_hook
        self.keep = keep
        self.rank, self.world_size = rank, world_size
        self.async_save = async_save
        # The resolved run config (YAML) each checkpoint carries as config.yaml (rank 0).
        self.config_text = config_text
        # (future, step, tmp, final, bytes) of an async save in flight
        self._pending: tuple[Future, int, Path, Path, int] | None = None
        self._pg: dist.ProcessGroup | None = None
        # Rank 0: fn(step, tokens_seen) -> the record each checkpoint carries as provenance.json.
        self.provenance: Callable[[int, int | None], dict] | None = None
        self._record: bytes | None = None  # the record of the save in flight

    def _barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    def clean_stale(self) -> None:
        """Remove temporaries of saves that never finished (rank 0)."""
        if self.rank == 0 and self.root.is_dir():
            for p in self.root.iterdir():
                if p.name.startswith((".tmp-", ".pruned-")):
                    shutil.rmtree(p, ignore_errors=True)
        self._barrier()

    def latest(self) -> Path | None:
        found = complete_checkpoints(self.root)
        return found[-1] if found else None

    def _durable(self, tmp: Path) -> None:
        """Every rank: this rank's files (all of them, on one host) on disk; rank 0 also
        writes the config beside them."""
        if self.rank == 0 and self.config_text is not None:
            (tmp / CHECKPOINT_CONFIG).write_text(self.config_text)
        if self.rank == 0 and self._record is not None:
            (tmp / PROVENANCE).write_bytes(self._record)
        fsync_tree(tmp)

    def _finalize(self, step: int, tmp: Path, final: Path) -> None:
        """Rank 0: mark complete, rename into place, rotate (every rank's files are written
        and fsynced: the marker never reaches the disk before the data)."""
        if self.save_hook is not None:
            self.save_hook("written", step, tmp)
        if self.rank == 0:
            marker = tmp / COMPLETE
            with open(marker, "w") as f:
                f.write(f"{step}\n")
                f.flush()
                os.fsync(f.fileno())
            fsync_path(tmp)
            if final.exists():  # a re-save of the same step (e.g. after a fallback): replace
                shutil.rmtree(final)
            os.replace(tmp, final)
            fsync_path(self.root)
            for old in complete_checkpoints(self.root)[: -self.keep]:
                gone = old.with_name(f".pruned-{old.name}")  # out of every listing at once, then deleted
                shutil.rmtree(gone, ignore_errors=True)  # left by a kill during an earlier prune
                try:
                    os.replace(old, gone)
                except OSError:
                    gone = old
                shutil.rmtree(gone, ignore_errors=True)

    def _failed(self, exc: BaseException, step: int, tmp: Path, need: int) -> None:
        """A save that raised: remove its partial folder; a full disk becomes one line; a
        second Ctrl-C that DCP caught and wrapped is a KeyboardInterrupt again (stop now)."""
        shutil.rmtree(tmp, ignore_errors=True)  # every rank: idempotent
        failures = getattr(exc, "failures", None) or {}  # DCP's {rank: (exception, traceback)}
        if any(isinstance(f[0] if isinstance(f, tuple) else f, KeyboardInterrupt) for f in failures.values()):
            raise KeyboardInterrupt from None
        try:
            free = shutil.disk_usage(self.root).free
        except OSError:
            free = None
        if caused_by_enospc(exc) or (free is not None and free < need):
            have = f"{free:,} bytes free" if free is not None else "free space unknown"
            latest = self.latest()
            raise NoSpaceError(
                f"no space left on device: the checkpoint of step {step} in {self.root} needs about "
                f"{need:,} bytes and the filesystem has {have} (the partial {tmp.name} is removed; "
                f"{'the latest checkpoint ' + str(latest) + ' is intact' if latest else 'no checkpoint saved yet'}). "
                "Free space (or lower checkpoint.keep) and rerun the same command to resume"
            ) from None  # the writer's own error says nothing about space (a torch.save "unexpected pos")

    def save(self, state: TrainState) -> Path:
        """Collective: every rank calls it at the same step boundary (``state.step``)."""
        step = state.step
        self.wait()  # DCP saves never overlap; finalises the previous async save
        final = self.root / step_dir_name(step)
        tmp = self.root / f".tmp-{step_dir_name(step)}"
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
        self._barrier()
        entries = state.state_dict()
        need = state_bytes(entries)
        if self.provenance is not None:  # what the state is at this step (an async write ends later)
            self._record = (json.dumps(self.provenance(step, state.tokens_seen), indent=1, default=str) + "\n").encode()
        if self.async_save:
            if self._pg is None and dist.is_initialized():
                # The background thread coordinates over gloo (CPU), never over NCCL.
                pg = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD
                assert not isinstance(pg, int)  # new_group's marker for a rank outside it; all ranks are in
                self._pg = pg
            try:
                fut = dcp.async_save(entries, checkpoint_id=str(tmp), process_group=self._pg)
            except _SAVE_ERRORS as e:  # re-raised after _failed
                self._failed(e, step, tmp, need)
                raise
            fut = cast(Future, getattr(fut, "upload_completion", fut))  # AsyncSaveResponse in newer torch
            self._pending = (fut, step, tmp, final, need)
            if self.save_hook is not None:
                self.save_hook("async_writing", step, tmp)
            return final
        try:
            dcp.save(entries, checkpoint_id=str(tmp))
            self._durable(tmp)
        except _SAVE_ERRORS as e:  # re-raised after _failed
            self._failed(e, step, tmp, need)
            raise
        self._barrier()
        self._finalize(step, tmp, final)
        self._barrier()
        return final

    def wait(self) -> None:
        """Collective: finish (and finalise) an async save in flight, if any."""
        if self._pending is None:
            return
        fut, step, tmp, final, need = self._pending
        self._pending = None
        try:
            fut.result()  # raises if this rank's write failed
            self._durable(tmp)
        except _SAVE_ERRORS as e:  # re-raised after _failed
            self._failed(e, step, tmp, need)
            raise
        self._barrier()  # every rank's write (and the metadata) is on disk
        self._finalize(step, tmp, final)
        self._barrier()

    def resume(self, state: TrainState, on_corrupt: str = "fallback") -> Path | None:
        """Load the newest readable complete checkpoint into ``state``; its path, or None.

        An unreadable newest checkpoint (missing/truncated file, or a load failing on
        damaged data) is named in the error; with ``on_corrupt="fallback"`` it is renamed
        ``corrupt-<step>`` (kept for inspection, no longer counted) and the previous one
        is loaded with a warning."""
        found = complete_checkpoints(self.root)[::-1]
        for i, path in enumerate(found):
            # Every rank's verdict, agreed before anything is said or renamed: a load that
            # failed here because a peer died is the peer's failure, not damage.
            why = self._agreed_why(verify_checkpoint(path), path, "checking")
            if why is None:
                failed: Exception | None = None
                try:
                    self.load(path, state)
                except CheckpointCorruptError as e:
                    why = dcp_error_line(e.__cause__) if e.__cause__ is not None else str(e)  # one line
                except Exception as e:  # noqa: BLE001 - not damage: raised below, once the others know
                    failed = e
                why = self._agreed_why(why, path, "loading", failed)
                if why is None:
                    return path
            older = found[i + 1] if i + 1 < len(found) else None
            msg = f"checkpoint {path} is unreadable: {why}"
            if on_corrupt != "fallback":
                raise CheckpointCorruptError(
                    f"{msg}. Set checkpoint.on_corrupt=fallback to resume from "
                    f"{older or 'the seeded init (no older checkpoint)'}, or move it away"
                )
            if older is None:
                raise CheckpointCorruptError(f"{msg}, and there is no older complete checkpoint to fall back to")
            if self.rank == 0:  # one line on stderr (the FallbackWarning it also raises is not shown)
                from mta_repro.weights.read import notice

                notice(
                    f"{msg}; falling back to {older} (the damaged one is kept as corrupt-{path.name})",
                    "mta_repro.train",
                )
            self._barrier()
            if self.rank == 0:
                dest = path.with_name(f"corrupt-{path.name}")
                if dest.exists():
                    shutil.rmtree(dest)
                os.replace(path, dest)
            self._barrier()
        return None

    def _agreed_why(self, why: str | None, path: Path, doing: str, failed: Exception | None = None) -> str | None:
        """Why ``path`` is unreadable on some rank (None: readable on all), the same on every
        rank. A rank whose load failed for another reason than damage (``failed``) raises it;
        the others raise PeerFailedError naming it; a peer that died makes this rank's gather
        fail, which is a PeerFailedError too. Neither touches the checkpoint."""
        mine = ("failed", f"{type(failed).__name__}: {failed}") if failed is not None else ("why", why)
        every = gather_or_peer_failed(mine, f"{doing} checkpoint {path}", self.rank, self.world_size)
        if failed is not None:
            raise failed
        for r, (kind, text) in enumerate(every):
            if kind == "failed":
                raise PeerFailedError(
                    f"rank {r} failed while {doing} checkpoint {path} ({str(text).splitlines()[0][:300]}); rank "
                    f"{self.rank} stops too and leaves the checkpoint as it is"
                )
        return next((t if r == self.rank else f"{t} (on rank {r})" for r, (_, t) in enumerate(every) if t), None)

    def load(self, path: Path, state: TrainState) -> int:
        """Restore everything ``save`` saved into ``state``; returns the step."""
        saved_world = saved_world_size(path)
        reshard = saved_world is not None and saved_world != self.world_size
        entries = state.template([] if reshard else [self.rank])
        try:
            dcp_load(entries, path)
        except UnsafeFileError:
            raise  # refused: not damage, so no fallback to an older file of the same origin
        except Exception as e:  # named in the error raised below
            text = str(e)
            if not any(m in text for m in _MISMATCH):
                raise CheckpointCorruptError(f"checkpoint {path}: loading failed ({type(e).__name__})") from e
            raise UserError(
                f"checkpoint {path}: cannot restore it into this run ({text.strip().splitlines()[-1][:300]}). "
                "It must come from the same model config"
            ) from e
        state.load_state_dict(entries, f"checkpoint {path}")
        if reshard and saved_world is not None:
            self._load_other_world(path, saved_world, state)
        return state.step

    def _load_other_world(self, path: Path, saved_world: int, state: TrainState) -> None:
        """Resume on another world size: the model and optimiser resharded through DCP;
        the data loader re-derives this rank's position from every saved rank's state
        (``loader.load_other_world_state``), or, if it cannot, restarts its data order
        with a warning; the RNG is reseeded per rank (dropout only)."""
        states = {rank_key(r): b"" for r in range(saved_world)}
        dcp_load(states, path)
        saved = [decode_state(states[rank_key(r)], f"checkpoint {path}: {rank_key(r)}") for r in range(saved_world)]
        if self.rank == 0:
            log.info("[mta_repro.train] resuming a %d-rank checkpoint on %d ranks", saved_world, self.world_size)
        torch.manual_seed(hash((state.step, self.rank)) % (2**63))
        state.tokens_seen = saved[0].get("tokens_seen")  # the global count: every rank saved the same
        loader = state.loader
        if loader is None:
            return
        datas = [s["data"] for s in saved]
        if hasattr(loader, "load_other_world_state") and all(d is not None for d in datas):
            loader.load_other_world_state(datas)
        else:
            warnings.warn(
                f"checkpoint {path}: the data loader cannot continue a {saved_world}-rank position on "
                f"{self.world_size} ranks; it restarts its data order (documents may repeat)",
                stacklevel=2,
            )


def load_model_state(path: str | Path, expect=None) -> tuple[dict, int | None]:
    """Full (unsharded) model state dict and its step from a run dir, a DCP checkpoint dir,
    a consolidated .pt, or a release/Lingua checkpoint (``mta_repro.weights.load_weights``:
    the newest readable one, read in this process only, no collectives). ``expect``: the
    ModelArgs the weights must fit (keys, shapes, float dtypes), checked before any copy."""
    w = load_weights(path, who="mta_repro.train", expect=expect)
    from mta_repro.runs.provenance import check_own_weights

    check_own_weights(path, w.source.path, w.record)  # an export copied from another run: refused
    return w.state, w.step


# What ``checkpoint.init_from`` loads (ours or the release's/Lingua's, in our key layout).
load_init_weights = load_model_state
