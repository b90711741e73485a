"""Atomic, resumable checkpoints with torch.distributed.checkpoint (DCP).

Layout: ``<run_dir>/checkpoints/<step:010d>/`` holds the DCP files of

    {"model": plain model state dict (Lingua keys, sharded DTensors while saving),
     "optim": optimizer state dict (parameter-name keyed, from get_state_dict),
     "scheduler": pickled LR-scheduler state, "step": int,
     "rank{r}": pickled {"rng": ..., "data": loader state} of rank r, for every rank}

and a ``.complete`` marker. Saving writes into ``.tmp-<step>``, adds the marker, then
renames the directory (atomic on POSIX), so a save killed midway never leaves a
directory that looks complete; stale temporaries are removed at the next start.
"""

from __future__ import annotations

import os
import pickle
import random
import re
import shutil
import signal
import sys
import warnings
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from mta_repro.errors import UserError

COMPLETE = ".complete"
_STEP_DIR = re.compile(r"^\d{10}$")
# Fault injection for the killed-save tests: "kill_in_save:<step>" SIGKILLs this process
# after the DCP files of that step are written but before the save is marked complete;
# "kill_in_async_save:<step>" (checkpoint.async_save) while the background write is on.
FAULT_ENV = "MTA_REPRO_FAULT"


def save_file_atomic(obj: Any, path: Path) -> Path:
    """``torch.save`` to ``path`` through a temporary file and a rename, so a kill midway
    leaves the previous file (or none), never a truncated one."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)
    return path


def step_dir_name(step: int) -> str:
    return f"{step:010d}"


def complete_checkpoints(ckpt_root: Path) -> list[Path]:
    """Complete checkpoint directories, oldest first."""
    if not ckpt_root.is_dir():
        return []
    out = [p for p in ckpt_root.iterdir() if _STEP_DIR.match(p.name) and (p / COMPLETE).is_file()]
    return sorted(out, key=lambda p: int(p.name))


def latest_checkpoint(path: Path) -> Optional[Path]:
    """Newest complete checkpoint of a run dir (or of its checkpoints/ folder)."""
    path = Path(path)
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    found = complete_checkpoints(root)
    return found[-1] if found else None


# ------------------------------------------------------------------ RNG state
def rng_state() -> dict:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# ------------------------------------------------------------------ integrity
# Errors of a load that mean "this checkpoint is another model / world", not "damaged":
# falling back to an older checkpoint of the same run would not help.
_MISMATCH = ("Missing key", "Unexpected key", "size mismatch", "shape mismatch")


def verify_checkpoint(path: Path) -> Optional[str]:
    """None if the DCP metadata reads and every file it names is there and long enough;
    else why not, naming the file (a truncated ``.distcp`` from a full disk or a kill)."""
    path = Path(path)
    meta = path / ".metadata"
    if not meta.is_file():
        return "file .metadata is missing"
    try:
        md = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # noqa: BLE001 - any failure to parse is damage
        return f"file .metadata cannot be read ({type(e).__name__}: {e})"
    need: dict[str, int] = {}
    for info in (md.storage_data or {}).values():
        end = int(info.offset) + int(info.length)
        need[info.relative_path] = max(need.get(info.relative_path, 0), end)
    for rel in sorted(need):
        f = path / rel
        if not f.is_file():
            return f"file {rel} is missing"
        size = f.stat().st_size
        if size < need[rel]:
            return f"file {rel} is truncated ({size} bytes; the metadata needs {need[rel]})"
    return None


def saved_world_size(path: Path) -> Optional[int]:
    """The number of ranks that saved a checkpoint (its per-rank ``rank{r}`` entries)."""
    try:
        md = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception:  # noqa: BLE001
        return None
    ranks = [k for k in md.state_dict_metadata if re.fullmatch(r"rank\d+", k)]
    return len(ranks) or None


class CheckpointCorruptError(UserError):
    pass


# ------------------------------------------------------------------ manager
class CheckpointManager:
    """Save / resume the training state of every rank under ``<run_dir>/checkpoints``.

    ``async_save``: ``save`` stages the state to CPU and returns while a thread writes the
    files; the save is finalised (marked complete, renamed, old ones rotated) at the
    next ``save``/``wait`` once the write finished, so a kill at any moment leaves the
    previous complete checkpoint as the latest.
    """

    def __init__(self, run_dir: Path, keep: int, rank: int, world_size: int, async_save: bool = False):
        self.root = Path(run_dir) / "checkpoints"
        self.keep = keep
        self.rank, self.world_size = rank, world_size
        self.async_save = async_save
        self._pending = None  # (future, step, tmp, final) of an async save in flight
        self._pg = None

    def _barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    def clean_stale(self) -> None:
        """Remove temporaries of saves that never finished (rank 0)."""
        if self.rank == 0 and self.root.is_dir():
            for p in self.root.iterdir():
                if p.name.startswith(".tmp-"):
                    shutil.rmtree(p, ignore_errors=True)
        self._barrier()

    def latest(self) -> Optional[Path]:
        found = complete_checkpoints(self.root)
        return found[-1] if found else None

    def _state(self, step: int, model, optimizer, scheduler, loader) -> dict:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        per_rank = {"rng": rng_state(), "data": loader.state_dict() if loader is not None else None}
        return {
            "model": model_sd,
            "optim": optim_sd,
            "scheduler": pickle.dumps(scheduler.state_dict()),
            "step": step,
            f"rank{self.rank}": pickle.dumps(per_rank),
        }

    def _finalize(self, step: int, tmp: Path, final: Path) -> None:
        """Rank 0: mark complete, rename into place, rotate (every rank's files are written)."""
        fault = os.environ.get(FAULT_ENV, "")
        if fault == f"kill_in_save:{step}":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.rank == 0:
            (tmp / COMPLETE).write_text(f"{step}\n")
            if final.exists():  # a re-save of the same step (e.g. after a fallback): replace
                shutil.rmtree(final)
            os.replace(tmp, final)
            for old in complete_checkpoints(self.root)[: -self.keep]:
                shutil.rmtree(old, ignore_errors=True)

    def save(self, step: int, model, optimizer, scheduler, loader) -> Path:
        """Collective: every rank calls it at the same step boundary."""
        self.wait()  # DCP saves never overlap; finalises the previous async save
        final = self.root / step_dir_name(step)
        tmp = self.root / f".tmp-{step_dir_name(step)}"
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
        self._barrier()
        state = self._state(step, model, optimizer, scheduler, loader)
        if self.async_save:
            if self._pg is None and dist.is_initialized():
                # The background thread coordinates over gloo (CPU), never over NCCL.
                self._pg = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD
            fut = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self._pg)
            fut = getattr(fut, "upload_completion", fut)  # AsyncSaveResponse in newer torch
            self._pending = (fut, step, tmp, final)
            if os.environ.get(FAULT_ENV, "") == f"kill_in_async_save:{step}":
                # A save killed midway: once the background write has begun its files.
                import time

                deadline = time.time() + 30
                while time.time() < deadline and not (tmp.is_dir() and any(tmp.iterdir())):
                    time.sleep(0.001)
                os.kill(os.getpid(), signal.SIGKILL)
            return final
        dcp.save(state, checkpoint_id=str(tmp))
        self._barrier()
        self._finalize(step, tmp, final)
        self._barrier()
        return final

    def wait(self) -> None:
        """Collective: finish (and finalise) an async save in flight, if any."""
        if self._pending is None:
            return
        fut, step, tmp, final = self._pending
        self._pending = None
        fut.result()  # raises if this rank's write failed
        self._barrier()  # every rank's write (and the metadata) is on disk
        self._finalize(step, tmp, final)
        self._barrier()

    def resume(self, model, optimizer, scheduler, loader, on_corrupt: str = "fallback") -> tuple[Optional[Path], int]:
        """Load the newest readable complete checkpoint; (path, step) or (None, 0).

        An unreadable newest checkpoint (missing/truncated file, or a load failing on
        damaged data) is named in the error; with ``on_corrupt="fallback"`` it is renamed
        ``corrupt-<step>`` (kept for inspection, no longer counted) and the previous one
        is loaded with a warning."""
        found = complete_checkpoints(self.root)[::-1]
        for i, path in enumerate(found):
            why = verify_checkpoint(path)
            if why is None:
                try:
                    return path, self.load(path, model, optimizer, scheduler, loader)
                except CheckpointCorruptError as e:
                    why = str(e.__cause__ or e)
            older = found[i + 1] if i + 1 < len(found) else None
            msg = f"checkpoint {path} is unreadable: {why}"
            if on_corrupt != "fallback":
                raise CheckpointCorruptError(
                    f"{msg}. Set checkpoint.on_corrupt=fallback to resume from "
                    f"{older or 'the seeded init (no older checkpoint)'}, or move it away"
                )
            if older is None:
                raise CheckpointCorruptError(f"{msg}, and there is no older complete checkpoint to fall back to")
            if self.rank == 0:
                warnings.warn(f"{msg}; falling back to {older} (the damaged one is kept as corrupt-{path.name})",
                              stacklevel=2)
                print(f"[mta_repro.train] WARNING: {msg}; falling back to {older}", file=sys.stderr, flush=True)
            self._barrier()
            if self.rank == 0:
                dest = path.with_name(f"corrupt-{path.name}")
                if dest.exists():
                    shutil.rmtree(dest)
                os.replace(path, dest)
            self._barrier()
        return None, 0

    def load(self, path: Path, model, optimizer, scheduler, loader) -> int:
        """Restore everything saved by ``save``; returns the step."""
        model_sd, optim_sd = get_state_dict(model, optimizer)
        key = f"rank{self.rank}"
        saved_world = saved_world_size(path)
        reshard = saved_world is not None and saved_world != self.world_size
        state: dict[str, Any] = {
            "model": model_sd,
            "optim": optim_sd,
            "scheduler": b"",
            "step": -1,
        }
        if not reshard:
            state[key] = b""
        try:
            dcp.load(state, checkpoint_id=str(path))
        except Exception as e:  # noqa: BLE001 - name the checkpoint in the error
            text = str(e)
            if not any(m in text for m in _MISMATCH):
                raise CheckpointCorruptError(f"checkpoint {path}: loading failed ({type(e).__name__})") from e
            raise UserError(
                f"checkpoint {path}: cannot restore it into this run ({text.strip().splitlines()[-1][:300]}). "
                "It must come from the same model config"
            ) from e
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        scheduler.load_state_dict(pickle.loads(state["scheduler"]))
        step = int(state["step"])
        if reshard:
            self._load_other_world(path, saved_world, loader, step)
        else:
            per_rank = pickle.loads(state[key])
            set_rng_state(per_rank["rng"])
            if loader is not None and per_rank["data"] is not None:
                loader.load_state_dict(per_rank["data"])
        return step

    def _load_other_world(self, path: Path, saved_world: int, loader, step: int) -> None:
        """Resume on another world size: the model and optimiser resharded through DCP;
        the data loader re-derives this rank's position from every saved rank's state
        (``loader.load_other_world_state``), or, if it cannot, restarts its data order
        with a warning; the RNG is reseeded per rank (dropout only)."""
        states = {f"rank{r}": b"" for r in range(saved_world)}
        dcp.load(states, checkpoint_id=str(path))
        saved = [pickle.loads(states[f"rank{r}"]) for r in range(saved_world)]
        if self.rank == 0:
            print(f"[mta_repro.train] resuming a {saved_world}-rank checkpoint on {self.world_size} ranks",
                  file=sys.stderr, flush=True)
        torch.manual_seed(hash((step, self.rank)) % (2**63))
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


def _load_pt(path: Path):
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - a truncated/corrupt file: name it
        raise CheckpointCorruptError(
            f"{path}: cannot be read ({type(e).__name__}: {str(e).strip().splitlines()[0][:200]}); "
            "the file is truncated or corrupt (re-export it with python -m mta_repro.train.export <run_dir>)"
        ) from e


def load_model_state(path: Path) -> tuple[dict, Optional[int]]:
    """Full (unsharded) model state dict from a run dir, a DCP checkpoint dir or a
    consolidated .pt; read in this process only (no collectives). Returns (sd, step)."""
    from omegaconf import OmegaConf

    from mta_repro.model import build_model, to_model_args

    path = Path(path)
    if path.is_file():
        blob = _load_pt(path)
        if not isinstance(blob, dict) or "model" not in blob:
            raise UserError(f"{path}: expected a consolidated checkpoint (a dict with key 'model')")
        return blob["model"], blob.get("step")
    if (path / "export" / "consolidated.pt").is_file() and not (path / COMPLETE).exists():
        run_ckpt = latest_checkpoint(path)
        blob = _load_pt(path / "export" / "consolidated.pt")
        # Prefer the newer of export and the latest checkpoint.
        if run_ckpt is None or int(run_ckpt.name) <= int(blob.get("step") or 0):
            return blob["model"], blob.get("step")
    if (path / COMPLETE).exists():
        ckpt = path
        why = verify_checkpoint(ckpt)
        if why:
            raise CheckpointCorruptError(f"checkpoint {ckpt} is unreadable: {why}")
    else:
        ckpt = None
        root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        for cand in complete_checkpoints(root)[::-1]:  # the newest readable one
            why = verify_checkpoint(cand)
            if why is None:
                ckpt = cand
                break
            warnings.warn(f"checkpoint {cand} is unreadable ({why}); trying the previous one", stacklevel=2)
            print(f"[mta_repro.train] WARNING: checkpoint {cand} is unreadable ({why}); trying the previous one",
                  file=sys.stderr, flush=True)
    if ckpt is None:
        raise UserError(f"{path}: no consolidated .pt and no complete (readable) checkpoint found")
    run_dir = ckpt.parent.parent
    cfg_file = run_dir / "config.yaml"
    if not cfg_file.is_file():
        raise UserError(f"{cfg_file}: missing; needed to rebuild the model for {ckpt}")
    cfg = OmegaConf.load(cfg_file)
    model = build_model(to_model_args(cfg.model), device="cpu", init=False)
    sd = model.state_dict()
    state = {"model": sd, "step": -1}
    with warnings.catch_warnings():  # DCP warns that it loads in a single process: intended
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(ckpt), no_dist=True)
    return {k: v.float() if v.is_floating_point() else v for k, v in state["model"].items()}, int(state["step"])
