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
import warnings
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

COMPLETE = ".complete"
_STEP_DIR = re.compile(r"^\d{10}$")
# Fault injection for the killed-save test: "kill_in_save:<step>" SIGKILLs this process
# after the DCP files of that step are written but before the save is marked complete.
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


# ------------------------------------------------------------------ manager
class CheckpointManager:
    """Save / resume the training state of every rank under ``<run_dir>/checkpoints``."""

    def __init__(self, run_dir: Path, keep: int, rank: int, world_size: int):
        self.root = Path(run_dir) / "checkpoints"
        self.keep = keep
        self.rank, self.world_size = rank, world_size

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

    def save(self, step: int, model, optimizer, scheduler, loader) -> Path:
        """Collective: every rank calls it at the same step boundary."""
        final = self.root / step_dir_name(step)
        tmp = self.root / f".tmp-{step_dir_name(step)}"
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
        self._barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        per_rank = {"rng": rng_state(), "data": loader.state_dict() if loader is not None else None}
        state = {
            "model": model_sd,
            "optim": optim_sd,
            "scheduler": pickle.dumps(scheduler.state_dict()),
            "step": step,
            f"rank{self.rank}": pickle.dumps(per_rank),
        }
        dcp.save(state, checkpoint_id=str(tmp))
        self._barrier()
        fault = os.environ.get(FAULT_ENV, "")
        if fault == f"kill_in_save:{step}":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.rank == 0:
            (tmp / COMPLETE).write_text(f"{step}\n")
            if final.exists():  # a re-save of the same step (e.g. after a skip): replace
                shutil.rmtree(final)
            os.replace(tmp, final)
            for old in complete_checkpoints(self.root)[: -self.keep]:
                shutil.rmtree(old, ignore_errors=True)
        self._barrier()
        return final

    def load(self, path: Path, model, optimizer, scheduler, loader) -> int:
        """Restore everything saved by ``save``; returns the step."""
        model_sd, optim_sd = get_state_dict(model, optimizer)
        key = f"rank{self.rank}"
        state: dict[str, Any] = {
            "model": model_sd,
            "optim": optim_sd,
            "scheduler": b"",
            "step": -1,
            key: b"",
        }
        try:
            dcp.load(state, checkpoint_id=str(path))
        except Exception as e:  # noqa: BLE001 - name the checkpoint in the error
            raise ValueError(
                f"checkpoint {path}: cannot restore it into this run ({e}). It must come from "
                f"the same model config and the same world size ({self.world_size} ranks)"
            ) from e
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        scheduler.load_state_dict(pickle.loads(state["scheduler"]))
        per_rank = pickle.loads(state[key])
        set_rng_state(per_rank["rng"])
        if loader is not None and per_rank["data"] is not None:
            loader.load_state_dict(per_rank["data"])
        return int(state["step"])


def load_model_state(path: Path) -> tuple[dict, Optional[int]]:
    """Full (unsharded) model state dict from a run dir, a DCP checkpoint dir or a
    consolidated .pt; read in this process only (no collectives). Returns (sd, step)."""
    from omegaconf import OmegaConf

    from mta_repro.model import build_model, to_model_args

    path = Path(path)
    if path.is_file():
        blob = torch.load(path, map_location="cpu", weights_only=False)
        if not isinstance(blob, dict) or "model" not in blob:
            raise ValueError(f"{path}: expected a consolidated checkpoint (a dict with key 'model')")
        return blob["model"], blob.get("step")
    if (path / "export" / "consolidated.pt").is_file() and not (path / COMPLETE).exists():
        run_ckpt = latest_checkpoint(path)
        blob = torch.load(path / "export" / "consolidated.pt", map_location="cpu", weights_only=False)
        # Prefer the newer of export and the latest checkpoint.
        if run_ckpt is None or int(run_ckpt.name) <= int(blob.get("step") or 0):
            return blob["model"], blob.get("step")
    ckpt = path if (path / COMPLETE).exists() else latest_checkpoint(path)
    if ckpt is None:
        raise ValueError(f"{path}: no consolidated .pt and no complete checkpoint found")
    run_dir = ckpt.parent.parent
    cfg_file = run_dir / "config.yaml"
    if not cfg_file.is_file():
        raise ValueError(f"{cfg_file}: missing; needed to rebuild the model for {ckpt}")
    cfg = OmegaConf.load(cfg_file)
    model = build_model(to_model_args(cfg.model), device="cpu", init=False)
    sd = model.state_dict()
    state = {"model": sd, "step": -1}
    with warnings.catch_warnings():  # DCP warns that it loads in a single process: intended
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(ckpt), no_dist=True)
    return {k: v.float() if v.is_floating_point() else v for k, v in state["model"].items()}, int(state["step"])
