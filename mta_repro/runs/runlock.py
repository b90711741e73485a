"""The run dir's lock, ``<run_dir>/.lock`` (host, pid, SLURM job id, start time): one job
per run dir, taken by rank 0 before a start decides or writes anything there.

A live holder refuses a start (``RunDirError``, the error of every start refused to protect
a run dir) and the refused start touches nothing; a stale one (dead pid on this host, an
earlier incarnation of this SLURM job, a SLURM job no longer running) is taken over with a
warning. While it trains, rank 0 touches the lock every step (``lock_heartbeat``: its
mtime says when the holder was last alive).
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
from pathlib import Path

from mta_repro.errors import UserError

LOCK = ".lock"


class RunDirError(UserError):
    """A start refused to protect an existing run directory."""


def _holder() -> dict:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()) + " UTC",
    }


def pid_alive(pid: int) -> bool:
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
        if not pid_alive(pid):
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


def is_fresh(run_dir: Path) -> bool:
    """No run has written into ``run_dir`` yet (Hydra's own files do not count)."""
    return not any((Path(run_dir) / n).exists() for n in ("config.yaml", "checkpoints", "metrics.jsonl", "export"))


def lock_heartbeat(run_dir: Path, is_main: bool) -> None:
    """Touch the lock (its mtime says when the holder was last alive)."""
    if is_main:
        with contextlib.suppress(OSError):
            os.utime(Path(run_dir) / LOCK)
