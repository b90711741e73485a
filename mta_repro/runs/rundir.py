"""Run-directory safety: a start's steps in its run dir, so that a second start, another
config or a failed start never damages a run.

Before a run writes anything into ``run_dir`` (rank 0, ``mta_repro.train.config_check.prepare_run_dir``):

0. The lock ``<run_dir>/.lock`` is taken first (``mta_repro/runs/runlock.py``): a live
   holder refuses and the refused start touches nothing; a stale one is taken over with a
   warning.
1. If the run dir already holds a checkpoint, the new config is compared with the run's
   saved one (``mta_repro/train/config_check.py``: what may change with
   ``checkpoint.allow_config_change=true``, and what never). A refused difference raises
   ``RunDirError`` naming the keys and the ways out.
2. Once the start passed every check (the provenance ones too), ``commit_start`` writes
   ``config.yaml`` atomically (a different previous one kept as ``config.prev.yaml``) and
   Hydra's record of the command, staged until then, becomes ``.hydra/``.

A start that took the lock on a fresh run dir and fails before it trained or saved anything
leaves no run directory behind (``remove_failed_start``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from mta_repro.files import replace_atomically
from mta_repro.runs.runlock import LOCK, RunDirError, RunLock, pid_alive

# Where rank 0 writes this start's record of its command (config.yaml, hydra.yaml,
# overrides.yaml: write_record) until the start is accepted; then it replaces .hydra/
# (settle_hydra_output).
STAGED_HYDRA = ".hydra.start-"


def check_writable(run_dir: Path) -> None:
    """Refuse a run dir this process cannot write, in one line naming the directory (or
    file) at fault, before anything is written there or done."""
    from mta_repro.files import unwritable

    run_dir = Path(run_dir)
    for folder in (run_dir, run_dir / "checkpoints", run_dir / "export"):
        if folder != run_dir and not folder.is_dir():
            continue
        logs = tuple(f.name for f in run_dir.glob("*.log")) if folder == run_dir and run_dir.is_dir() else ()
        found = unwritable(folder, ("metrics.jsonl", *logs) if folder == run_dir else ())
        if found:
            where, why = found
            raise RunDirError(
                f"run_dir={run_dir}: {where} is not writable ({why}); the run writes its checkpoints, "
                f"metrics and log there: make it writable, or use another run_dir=..."
            )


# ------------------------------------------------------------------ config.yaml
def write_config(run_dir: Path, cfg: Any) -> None:
    """``config.yaml`` (of a DictConfig or a config dataclass) atomically; a previous,
    different one is kept as config.prev.yaml."""
    path = Path(run_dir) / "config.yaml"
    if not isinstance(cfg, DictConfig):
        cfg = OmegaConf.structured(cfg)
    text = OmegaConf.to_yaml(cfg, resolve=True)
    if path.is_file():
        old = path.read_text()
        if old == text:
            return
        prev = path.with_name("config.prev.yaml")
        tmp = prev.with_name(prev.name + ".tmp")
        tmp.write_text(old)
        os.replace(tmp, prev)
    replace_atomically(path, text.encode())


# ------------------------------------------------------------------ the whole start
def commit_start(run_dir: Path, args) -> None:
    """Rank 0, once a start passed every check (and its record is written): config.yaml,
    and Hydra's record of the command as ``.hydra/``. A start refused before this has
    changed nothing in the run dir."""
    write_config(run_dir, args)
    settle_hydra_output(keep=True)


# This process's record of its command: [(folder, staged)] (``write_record``)
_RECORD: list = []


def write_record(run_dir: Path, cfg: DictConfig, overrides, subdir: str | None = ".hydra") -> None:
    """Rank 0, before the start's checks: the record of the command in Hydra's layout
    (``config.yaml``: the composed config, ``hydra.yaml``, ``overrides.yaml``; ``cfg`` composed
    with its ``hydra`` node). The default ``.hydra`` is staged at ``STAGED_HYDRA<pid>`` and
    becomes ``.hydra/`` only once the start is accepted (``commit_start``); a user's own
    ``hydra.output_subdir`` is written as it is; null writes none."""
    if not subdir:
        return
    staged = subdir == ".hydra"
    folder = Path(run_dir) / (f"{STAGED_HYDRA}{os.getpid()}" if staged else str(subdir))
    # What this call makes, so that a failed write (a full disk) leaves nothing behind: the
    # folders it created, outermost first (the run dir itself on a first start).
    made = [p for p in (folder, *folder.parents) if not p.exists()][::-1]
    try:
        folder.mkdir(parents=True, exist_ok=True)
        task = OmegaConf.masked_copy(cfg, [str(k) for k in cfg if k != "hydra"])
        OmegaConf.save(task, folder / "config.yaml")
        OmegaConf.save(OmegaConf.create({"hydra": OmegaConf.select(cfg, "hydra")}), folder / "hydra.yaml")
        OmegaConf.save(OmegaConf.create([str(o) for o in overrides]), folder / "overrides.yaml")
    except OSError:
        if made:
            shutil.rmtree(made[0], ignore_errors=True)
        elif staged:
            shutil.rmtree(folder, ignore_errors=True)
        raise
    _RECORD[:] = [(folder, staged)]


def _staged_hydra() -> Path | None:
    """This start's staged record (``write_record``), or None (none written: another rank, a
    sweep's engine, ``hydra.output_subdir`` set by the user, a caller of ``train()``)."""
    return _RECORD[0][0] if _RECORD and _RECORD[0][1] else None


def settle_hydra_output(keep: bool) -> None:
    """Rank 0: an accepted start's staged Hydra record becomes ``.hydra/`` (``keep``); a
    refused or failed one is removed, so that ``.hydra/`` keeps the command the run was
    started with. Staged folders of starts killed before they settled go too."""
    staged = _staged_hydra()
    if staged is None or not staged.is_dir():
        return
    if not keep:
        shutil.rmtree(staged, ignore_errors=True)
        return
    final = staged.with_name(".hydra")
    old = staged.with_name(f".hydra.old-{os.getpid()}")
    if final.exists():
        os.replace(final, old)
    os.replace(staged, final)
    shutil.rmtree(old, ignore_errors=True)
    for other in staged.parent.glob(STAGED_HYDRA + "*"):
        pid = other.name[len(STAGED_HYDRA) :]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(other, ignore_errors=True)


def clean_failed_start(run_dir: Path, lock: RunLock) -> None:
    """After a start failed (rank 0): if the run dir was fresh when this start took its lock
    (or, failing before it got that far, is fresh now and its lock can be had), remove what
    the start wrote. A start refused by the lock, or one that found another run's files,
    touches nothing."""
    settle_hydra_output(keep=False)
    if not lock.held:
        if not Path(run_dir).is_dir():
            return
        try:
            lock.acquire()
        except RunDirError:
            return  # another job's run dir now: nothing here is ours to remove
    if lock.found_fresh:
        remove_failed_start(run_dir)
        lock.held = False  # removed with the run dir's files


def remove_failed_start(run_dir: Path) -> None:
    """A start that failed before it trained or saved anything leaves no run dir behind:
    remove what it wrote (its record of the command too), then the dir if empty.
    Only for a start that holds the run's lock and found the run dir fresh when it took it
    (``loop.train``): a start refused by the lock touches nothing."""
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    ckpts = run_dir / "checkpoints"
    if (metrics.is_file() and metrics.stat().st_size > 0) or (ckpts.is_dir() and any(ckpts.iterdir())):
        return
    for name in (
        "config.yaml",
        "config.prev.yaml",
        "metrics.jsonl",
        "metrics.jsonl.tmp",
        "wandb_id.txt",
        "provenance.json",
    ):
        (run_dir / name).unlink(missing_ok=True)
    for name in ("checkpoints", "wandb"):
        shutil.rmtree(run_dir / name, ignore_errors=True)
    for folder, staged in _RECORD:  # this start's record of its command
        if folder.parent.resolve() == run_dir.resolve():
            shutil.rmtree(folder, ignore_errors=True)
            if staged:  # settled before the failure
                shutil.rmtree(run_dir / ".hydra", ignore_errors=True)
    # The lock last: until it is gone no other start can take the run dir, so nothing
    # removed above can be another job's.
    (run_dir / LOCK).unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # not empty: something else lives there
        run_dir.rmdir()
