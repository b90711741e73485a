"""Run-directory safety: the lock, the config check, ``config.yaml`` and the cleanup of a
failed start, so that a second start, another config or a failed start never damages a run.

Before a run writes anything into ``run_dir`` (rank 0, ``prepare_run_dir``):

0. A lock ``<run_dir>/.lock`` (host, pid, SLURM job id, start time) is taken first: a live
   holder refuses and the refused start touches nothing; a stale one (dead pid on this
   host, an earlier incarnation of this SLURM job, a SLURM job no longer running) is taken
   over with a warning.
1. If the run dir already holds a checkpoint, the new config is compared with the saved
   ``config.yaml`` (or, if that is gone, with the config the newest checkpoint carries).
   Each field's class is declared with it (``metadata={"run_dir": ...}``, a section's
   ``RUN_DIR``): ``FREE`` fields are never compared, ``SAFE`` ones may change with
   ``checkpoint.allow_config_change=true``, every other one (model, data, optimiser, seed)
   defines the run; ``trainer.grad_accum`` is compared as the global batch, so a run may
   continue on another world size (``global_batch_error``). A refused difference raises
   ``RunDirError`` naming the keys and the ways out.
2. Once the start passed every check (the provenance ones too), ``commit_start`` writes
   ``config.yaml`` atomically (a different previous one kept as ``config.prev.yaml``) and
   Hydra's record of the command, staged until then, becomes ``.hydra/``.

While it trains, rank 0 touches the lock every step (``lock_heartbeat``: its mtime says
when the holder was last alive). A start that took the lock on a fresh run dir and fails
before it trained or saved anything leaves no run directory behind (``remove_failed_start``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from mta_repro.errors import UserError
from mta_repro.files import replace_atomically

LOCK = ".lock"
# Where rank 0's Hydra writes this start's record of its command (config.yaml, hydra.yaml,
# overrides.yaml) until the start is accepted; then it replaces .hydra/ (settle_hydra_output).
STAGED_HYDRA = ".hydra.start-"


def _classified() -> tuple[tuple, tuple, tuple]:
    """(FREE, SAFE, PATHS) keys from the schema itself: a field's ``metadata={"run_dir":
    "free" | "safe"}`` (``"path": True`` for a path compared resolved), a section's
    ``RUN_DIR`` class attribute (every key under it, ``"logging."``). The classes are
    declared beside the fields they describe (mta_repro/train/args.py, data/args.py,
    model/args.py, train/config.py)."""
    import dataclasses

    from mta_repro.train.config import TrainConfig

    free, safe, paths = [], [], []
    out = {"free": free, "safe": safe}

    def walk(cls, prefix: str) -> None:
        for f in dataclasses.fields(cls):
            key = prefix + f.name
            if f.metadata.get("run_dir") in out:
                out[f.metadata["run_dir"]].append(key)
            if f.metadata.get("path"):
                paths.append(key)
            sub = f.default_factory if f.default_factory is not dataclasses.MISSING else None
            if sub is not None and dataclasses.is_dataclass(sub):
                run_dir = getattr(sub, "RUN_DIR", None)
                if run_dir in out:
                    out[run_dir].append(key + ".")
                walk(sub, key + ".")

    walk(TrainConfig, "")
    return tuple(free), tuple(safe), tuple(paths)


# FREE: never compared (where the run dir is, SLURM resources, the progress bar, prefetching,
# timeouts, the CPU allocator's policy, the memory pre-flight's switch, model.kernels, this
# check's own switches; trainer.grad_accum is compared as the global batch). SAFE: may change
# with checkpoint.allow_config_change.
# PATHS: compared as resolved paths (relative vs absolute is no change).
FREE, SAFE, PATHS = _classified()


class RunDirError(UserError):
    """A start refused to protect an existing run directory."""


def _matches(key: str, prefixes) -> bool:
    return any(key == p or (p.endswith(".") and key.startswith(p)) for p in prefixes)


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out if out or not prefix else {prefix[:-1]: {}}
    return {prefix[:-1]: d}


def _norm(key: str, value: Any) -> Any:
    if _matches(key, PATHS) and isinstance(value, str):
        from mta_repro.data.args import resolve_path

        return str(resolve_path(value).resolve())
    return value


@dataclass
class ConfigDiff:
    unsafe: dict[str, tuple]  # key -> (saved, new)
    safe: dict[str, tuple]


def diff_configs(saved: dict, new: dict) -> ConfigDiff:
    """Differences between two resolved configs, classified. A key missing from the saved
    config (a field added to the schema since) counts as its schema default (a SAFE one
    is not compared)."""
    from mta_repro.train.config import TrainConfig

    default = flatten(OmegaConf.to_container(OmegaConf.structured(TrainConfig), resolve=False))
    old, cur = flatten(saved), flatten(new)
    unsafe, safe = {}, {}
    for key in sorted(set(old) | set(cur)):
        if _matches(key, FREE):
            continue
        if key not in cur:  # a field removed from the schema: nothing to compare with
            continue
        if key not in old and _matches(key, SAFE):
            continue  # a setting added to the schema since the run started: nothing to protect
        a = old.get(key, default.get(key))
        b = cur[key]
        if _norm(key, a) == _norm(key, b):
            continue
        (safe if _matches(key, SAFE) else unsafe)[key] = (a, b)
    return ConfigDiff(unsafe, safe)


# What an ``attention=`` option (configs/attention/) sets: a changed option is reported as one
# "attention: mta -> baseline", not as the dozen model.mta.* fields it moves.
ATTENTION_KEYS = ("model.mta.", "model.diff_transformer")


def _fmt(diff: dict[str, tuple], limit: int = 6, saved: dict | None = None, new: dict | None = None) -> str:
    """Every differing key; the saved -> new values of the first ``limit``. With the two
    configs, a change of attention variant is one item."""
    items = []
    if saved is not None and new is not None:
        from mta_repro.train.config import attention_variant

        a, b = attention_variant(saved.get("model") or {}), attention_variant(new.get("model") or {})
        if a != b:
            items.append(f"attention: {a} -> {b}")
            diff = {k: v for k, v in diff.items() if not _matches(k, ATTENTION_KEYS)}
            limit = max(limit - 1, 0)
    items += [f"{k}: {a!r} -> {b!r}" for k, (a, b) in list(diff.items())[:limit]]
    rest = list(diff)[limit:]
    return "; ".join(items) + (f"; also {', '.join(rest)}" if rest else "")


def check_config(
    saved: dict,
    new: dict,
    allow_change: bool,
    run_dir: Path,
    at_step: int | None,
    source: str = "the run's config.yaml",
) -> ConfigDiff:
    """Raise RunDirError if ``new`` may not continue the run saved as ``saved`` (read from
    ``source``, named in the error)."""
    d = diff_configs(saved, new)
    where = f"{run_dir} (at step {at_step})" if at_step is not None else str(run_dir)
    if d.unsafe:
        raise RunDirError(
            f"run_dir={run_dir}: this config differs from {source} in fields that define "
            f"the model, data or optimiser state: {_fmt(d.unsafe, saved=saved, new=new)}. "
            f"The run in {where} is left untouched. "
            "Use another run_dir=..., or start a new stage from its weights with "
            f"run_dir=<new> checkpoint.init_from={run_dir}"
        )
    if d.safe and not allow_change:
        raise RunDirError(
            f"run_dir={run_dir}: this config changes {_fmt(d.safe)} of the run in {where}. "
            "Add checkpoint.allow_config_change=true to continue this run with the change, "
            "or use another run_dir=..."
        )
    return d


def global_batch_error(saved_cfg: dict, new_cfg: Any, saved_world: int, world: int) -> str | None:
    """An error text if the global batch would change, naming the grad_accum that keeps it."""
    try:
        b0, a0 = int(saved_cfg["data"]["batch_size"]), int(saved_cfg["trainer"].get("grad_accum", 1))
    except (KeyError, TypeError):
        return None
    b1, a1 = int(new_cfg.data.batch_size), int(new_cfg.trainer.grad_accum)
    g0, g1 = b0 * saved_world * a0, b1 * world * a1
    if g0 == g1:
        return None
    fix = (
        f"set trainer.grad_accum={g0 // (b1 * world)}"
        if g0 % (b1 * world) == 0
        else f"no grad_accum keeps it with data.batch_size={b1} on {world} ranks"
    )
    return (
        f"the run's global batch was {g0} sequences (data.batch_size={b0} x {saved_world} ranks x "
        f"trainer.grad_accum={a0}); this start would use {g1} ({b1} x {world} x {a1}): {fix}"
    )


# ------------------------------------------------------------------ lock
def _holder() -> dict:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()) + " UTC",
    }


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


def _slurm_job_running(job: str) -> bool | None:
    """Whether SLURM says the job is pending/running; None if it cannot tell."""
    if shutil.which("squeue") is None:
        return None
    try:
        p = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if p.returncode != 0:
        return False if "Invalid job id" in p.stderr else None
    return any(s in p.stdout for s in ("RUNNING", "PENDING", "CONFIGURING", "COMPLETING", "REQUEUED"))


def stale_reason(holder: dict) -> str | None:
    """Why the lock of ``holder`` is stale, or None if its holder may be alive."""
    me = _holder()
    job = holder.get("slurm_job_id")
    if job and job == me["slurm_job_id"]:
        return f"it was taken by an earlier run of this SLURM job {job} (requeued)"
    if holder.get("host") == me["host"]:
        pid = int(holder.get("pid", -1))
        if pid == me["pid"]:
            return "it is this process's own"
        if not _pid_alive(pid):
            return f"process {pid} on {holder['host']} is gone"
        return None
    if job:
        running = _slurm_job_running(job)
        if running is False:
            return f"SLURM job {job} is no longer running"
    return None


def _describe(holder: dict, path: Path | None = None) -> str:
    job = holder.get("slurm_job_id")
    alive = ""
    if path is not None:
        with contextlib.suppress(OSError):  # the holder touches the lock at every step
            alive = f", last alive {int((time.time() - path.stat().st_mtime) // 60)} min ago"
    return (
        f"host {holder.get('host')}, pid {holder.get('pid')}"
        f"{', SLURM job ' + job if job else ''}, since {holder.get('started')}{alive}"
    )


def in_use_line(run_dir: Path) -> str | None:
    """The line a start would refuse with because a live job holds ``run_dir``'s lock
    (read only: nothing is taken over or written), or None."""
    path = Path(run_dir) / LOCK
    try:
        holder = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return None  # no lock, or one a start would take over (empty, unreadable)
    if not isinstance(holder, dict) or not holder or stale_reason(holder) is not None:
        return None
    return (
        f"run_dir={run_dir} is in use by another job ({_describe(holder, path)}); "
        f"wait for it, use another run_dir=..., or if that job is dead delete {path}"
    )


def _create_with(path: Path, text: str) -> None:
    """Create ``path`` holding ``text``, or raise FileExistsError: the file appears whole
    (written to a private name, fsynced, then hard-linked into place), so a racing reader
    never sees it empty. Falls back to O_EXCL creation where links are not supported."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{time.monotonic_ns()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise
    except OSError:  # a filesystem without hard links: O_EXCL (a reader may see it empty)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(text)
    finally:
        tmp.unlink(missing_ok=True)


def _age_s(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except OSError:
        return 0.0


class RunLock:
    """``<run_dir>/.lock``: one job per run dir (held by rank 0).

    The lock file appears with its content (``_create_with``); a stale one is taken over
    under a second, short-lived ``.lock.takeover`` file, and only if it still holds the
    holder judged stale, so two starts taking over at once never both win."""

    # An empty or unreadable lock younger than this may be a lock being written by a
    # filesystem without hard links: wait for it rather than take it over.
    EMPTY_GRACE_S = 5.0
    # A takeover file older than this belongs to a start that died while taking over.
    TAKEOVER_STALE_S = 60.0

    def __init__(self, run_dir: Path, timeout_s: float = 60.0):
        self.path = Path(run_dir) / LOCK
        self.held = False
        self.timeout_s = timeout_s
        # Whether no run had written into the run dir when this lock was taken: only then
        # may a failed start remove what is there (remove_failed_start).
        self.found_fresh = False

    def _read(self) -> str | None:
        try:
            return self.path.read_text()
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError):
            return ""

    def acquire(self) -> None:
        """Take the lock (a no-op if this object holds it); RunDirError if a live job holds it."""
        if self.held:
            return
        me = json.dumps(_holder())
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            try:
                _create_with(self.path, me)
            except FileExistsError:
                pass
            else:
                self.held = True
                self.found_fresh = is_fresh(self.path.parent)
                return
            text = self._read()
            if text is None:  # released in between: try again
                continue
            try:
                holder = json.loads(text) if text else {}
            except ValueError:
                holder = {}
            if not isinstance(holder, dict) or not holder:
                if _age_s(self.path) < self.EMPTY_GRACE_S:
                    time.sleep(0.05)
                    continue
                reason = "it is empty or unreadable"
            else:
                reason = stale_reason(holder)
            if reason is None:
                raise RunDirError(
                    f"run_dir={self.path.parent} is in use by another job ({_describe(holder, self.path)}); "
                    f"wait for it, use another run_dir=..., or if that job is dead delete {self.path}"
                )
            self._take_over(text, reason)
        raise RunDirError(
            f"{self.path}: could not take the lock within {self.timeout_s:.0f} s (other starts are racing for it)"
        )

    def _take_over(self, stale_text: str, reason: str) -> None:
        """Remove the lock if it still holds ``stale_text`` (under ``.lock.takeover``)."""
        guard = self.path.with_name(LOCK + ".takeover")
        try:
            _create_with(guard, json.dumps(_holder()))
        except FileExistsError:  # another start is taking over: let it, then look again
            if _age_s(guard) > self.TAKEOVER_STALE_S:
                guard.unlink(missing_ok=True)
            time.sleep(0.05)
            return
        try:
            if self._read() == stale_text:
                print(f"[mta_repro.train] taking over the stale lock {self.path} ({reason})", file=sys.stderr)
                self.path.unlink(missing_ok=True)
        finally:
            guard.unlink(missing_ok=True)

    def release(self) -> None:
        if not self.held:
            return
        try:
            holder = json.loads(self.path.read_text())
            if holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
                self.path.unlink()
        except (OSError, ValueError):
            pass
        self.held = False


def check_writable(run_dir: Path) -> None:
    """Refuse a run dir this process cannot write, in one line naming the directory (or
    file) at fault, before Hydra opens its log there or anything is done."""
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


def load_saved_config(run_dir: Path, name: str = "config.yaml") -> dict | None:
    """The config saved as ``<run_dir>/<name>`` (a run dir's, or a checkpoint folder's own), or None."""
    path = Path(run_dir) / name
    if not path.is_file():
        return None
    try:
        config = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except Exception as e:  # noqa: BLE001 - a damaged file is a user-facing error
        raise RunDirError(f"{path}: cannot be read ({e}); use another run_dir=... or repair/delete it") from e
    if not isinstance(config, dict):
        raise RunDirError(
            f"{path}: cannot be read (a YAML {type(config).__name__}, not a mapping of config "
            "sections); use another run_dir=... or repair/delete it"
        )
    return config


# ------------------------------------------------------------------ the whole start
def prepare_run_dir(args, info, lock: RunLock) -> tuple[int | None, list[str]]:
    """Rank 0, before anything is written (``args``: the TrainConfig): the lock, the config
    check against the run's config.yaml. Returns the step of the newest complete checkpoint
    (None if none) and the config changes it accepts (``key: old -> new``), which the start
    records with config.yaml once all its checks passed (``commit_start``)."""
    from mta_repro.weights.layout import complete_checkpoints, saved_world_size, verify_checkpoint

    tr, ck = args.trainer, args.checkpoint
    run_dir = Path(args.run_dir)
    # The lock first: nothing below is decided on files another live job is writing.
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunDirError(f"run_dir={run_dir}: cannot create it ({e.strerror})") from e
    lock.acquire()
    found = complete_checkpoints(run_dir / "checkpoints") if ck.resume else []
    at_step = int(found[-1].name) if found else None
    if at_step == tr.steps and verify_checkpoint(found[-1]) is not None:
        at_step = None  # "finished", but its last checkpoint is damaged: resume decides
    saved, source = _saved_config(run_dir, found, ck.allow_config_change)
    new = OmegaConf.to_container(OmegaConf.structured(args), resolve=True)
    assert isinstance(new, dict)
    if found and saved is not None:
        # A different model or data first: that is never a matter of trainer.steps or of
        # allow_config_change, which the checks below would suggest.
        check_config(saved, new, True, run_dir, at_step, source)
    if at_step is not None and at_step > tr.steps:
        raise RunDirError(
            f"run_dir={run_dir} is already at step {at_step} ({found[-1]}), beyond trainer.steps={tr.steps}: "
            "nothing to train. Raise trainer.steps (with checkpoint.allow_config_change=true) or use another run_dir"
        )
    changes = ["no config.yaml to compare with; this command's config taken as the run's"] if found else []
    if found and saved is not None:
        diff = check_config(saved, new, ck.allow_config_change, run_dir, at_step, source)
        changes = [f"{key}: {a!r} -> {b!r}" for key, (a, b) in diff.safe.items()]
        saved_world = saved_world_size(found[-1])
        if saved_world is not None:
            err = global_batch_error(saved, args, saved_world, info.world_size)
            if err:
                raise RunDirError(f"run_dir={run_dir}: {err}")
    if not ck.resume and (run_dir / "checkpoints").is_dir() and complete_checkpoints(run_dir / "checkpoints"):
        raise RunDirError(
            f"run_dir={run_dir} holds checkpoints and checkpoint.resume=false would train over them from "
            "step 0: use another run_dir=..., or checkpoint.resume=true"
        )
    return at_step, changes


def _saved_config(run_dir: Path, found: list, allow_change: bool) -> tuple[dict | None, str]:
    """(the config the run was saved with, where it was read) for the config check."""
    from mta_repro.weights.layout import CHECKPOINT_CONFIG

    saved, source = load_saved_config(run_dir), "the run's config.yaml"
    if found and saved is None:
        # config.yaml is gone (deleted, or lost with a copied run dir): the checkpoint
        # carries the config it was trained with.
        saved, source = load_saved_config(found[-1], CHECKPOINT_CONFIG), f"the config stored in {found[-1]}"
        if saved is None and not allow_change:
            raise RunDirError(
                f"run_dir={run_dir} has checkpoints but no config.yaml, and {found[-1]} carries no config "
                "(saved by an older version), so this command cannot be checked against the run: restore "
                "config.yaml, or add checkpoint.allow_config_change=true to take this command's config as the run's"
            )
    return saved, source


def commit_start(run_dir: Path, args) -> None:
    """Rank 0, once a start passed every check (and its record is written): config.yaml,
    and Hydra's record of the command as ``.hydra/``. A start refused before this has
    changed nothing in the run dir."""
    write_config(run_dir, args)
    settle_hydra_output(keep=True)


def _staged_hydra() -> Path | None:
    """This start's staged Hydra record (``STAGED_HYDRA``), or None (not under Hydra's main,
    another rank, a sweep, a user's own output_subdir)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        hc = HydraConfig.get()
        sub = hc.output_subdir
        out = Path(hc.runtime.output_dir)
    except (ImportError, ValueError):
        return None
    if not sub or not str(sub).startswith(STAGED_HYDRA):
        return None
    return out / str(sub)


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
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(other, ignore_errors=True)


def is_fresh(run_dir: Path) -> bool:
    """No run has written into ``run_dir`` yet (Hydra's own files do not count)."""
    return not any((Path(run_dir) / n).exists() for n in ("config.yaml", "checkpoints", "metrics.jsonl", "export"))


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
    remove what it (and Hydra, if its output dir is the run dir) wrote, then the dir if empty.
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
    try:
        from hydra.core.hydra_config import HydraConfig

        hc = HydraConfig.get()
        if Path(hc.runtime.output_dir).resolve() == run_dir.resolve():
            if hc.output_subdir:
                shutil.rmtree(run_dir / hc.output_subdir, ignore_errors=True)
                if str(hc.output_subdir).startswith(STAGED_HYDRA):  # settled before the failure
                    shutil.rmtree(run_dir / ".hydra", ignore_errors=True)
            (run_dir / f"{hc.job.name}.log").unlink(missing_ok=True)
    except (ImportError, ValueError):
        pass  # not under Hydra's main
    # The lock last: until it is gone no other start can take the run dir, so nothing
    # removed above can be another job's.
    (run_dir / LOCK).unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # not empty: something else lives there
        run_dir.rmdir()


def lock_heartbeat(run_dir: Path, is_main: bool) -> None:
    """Touch the lock (its mtime says when the holder was last alive)."""
    if is_main:
        with contextlib.suppress(OSError):
            os.utime(Path(run_dir) / LOCK)
