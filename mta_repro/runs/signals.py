"""Preemption: SIGUSR2 / SIGTERM set a flag;
the loop checkpoints at the next step boundary and exits with 128 + the signal's number
(``stop_exit_code``: the run is unfinished). Ctrl-C (SIGINT) does the same (130), without
a requeue; a second Ctrl-C aborts at once (KeyboardInterrupt, no save).
On several ranks the flag is agreed (an all-reduce and a host read) only every
``logging.every`` steps, so the step loop does not wait for the device on the others: a
signal is honoured within that many steps. Under SLURM, SIGUSR2
(``#SBATCH --signal=USR2@120``: the time limit is near) also requeues the job;
SIGTERM does not, because ``scancel`` sends it too and a cancelled job must stay
cancelled (SLURM requeues preempted jobs itself).

The handler only sets the flag (and starts the requeue); the work that loops checks it:
the step loop, the loader's warm-up (``check``: between documents), validation (between
batches), so that every phase answers within seconds.

Requeue first, then save: rank 0 runs ``scontrol requeue`` as soon as the signal arrives
(in a thread, so the step in flight is not held up), so a save that overruns the warning
time cannot lose the job: it comes back and resumes from the newest complete checkpoint.
SLURM ends the current allocation after a requeue with SIGTERM, then SIGKILL after the
cluster's KillWait (default 30 s): the checkpoint at the next step boundary must fit in
that window, and a save cut short is never marked complete (checkpoint.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import torch
import torch.distributed as dist

from mta_repro.device import launcher_rank
from mta_repro.errors import StopRequested

HANDLED = (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)
REQUEUE_ON = (signal.SIGUSR2,)


def stop_exit_code(signum: int) -> int:
    """The exit status of a run stopped by ``signum`` after its checkpoint: the shell's
    128 + signal number (SIGINT 130, SIGUSR2 140, SIGTERM 143), never 0, so
    ``train && eval`` and SLURM's ``afterok`` do not take an unfinished run for a finished
    one. Rerunning the same command resumes it."""
    return 128 + int(signum)


class PreemptionHandler:
    def __init__(self) -> None:
        self.signum: int | None = None
        self.interrupts = 0  # Ctrl-Cs seen
        self._previous = {}
        for sig in HANDLED:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:  # runs between bytecodes: a flag and a thread
        if signum == signal.SIGINT and self.interrupts:
            # The second Ctrl-C: the user does not want to wait for the save.
            raise KeyboardInterrupt
        if signum == signal.SIGINT:
            self.interrupts += 1
        # Keep a requeue signal: the SIGTERM that follows our own requeue must not hide it.
        if self.signum not in REQUEUE_ON:
            self.signum = signum
        again = " (Ctrl-C again to stop at once, without saving)" if signum == signal.SIGINT else ""
        print(
            f"[mta_repro.train] received {signal.Signals(signum).name}: checkpoint at the next step boundary{again}",
            file=sys.stderr,
            flush=True,
        )
        if signum in REQUEUE_ON:
            _start_early_requeue()

    def check(self, where: str) -> None:
        """Raise ``StopRequested`` (naming ``where``) if a stop signal has arrived: called
        by work that loops, between two of its steps."""
        if self.signum is not None:
            raise StopRequested(self.signum, where)

    def agreed_signal(self, device: torch.device) -> int | None:
        """The signal seen by any rank (collective on several ranks: call it at the same
        step on every rank), so all ranks stop at the same step. One rank reads its flag
        (no device work)."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return self.signum
        local = torch.tensor([self.signum or 0], dtype=torch.int64, device=device)
        dist.all_reduce(local, op=dist.ReduceOp.MAX)
        value = int(local.item())
        return value or None

    def restore(self) -> None:
        for sig, prev in self._previous.items():
            signal.signal(sig, prev)


def _slurm_job() -> str | None:
    """This job's id for scontrol (an array task by its own id), or None outside SLURM."""
    job = os.environ.get("SLURM_JOB_ID")
    if job and os.environ.get("SLURM_ARRAY_JOB_ID") and os.environ.get("SLURM_ARRAY_TASK_ID"):
        job = f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    return job


_requeue_thread: threading.Thread | None = None
_requeued: bool | None = None  # None: not tried; True/False: the outcome


def _requeue(job: str) -> bool:
    global _requeued
    try:
        subprocess.run(["scontrol", "requeue", job], check=True, timeout=60, capture_output=True, text=True)
        ok = True
    except subprocess.CalledProcessError as e:
        print(
            f"[mta_repro.train] scontrol requeue {job} failed: {(e.stderr or '').strip() or e}",
            file=sys.stderr,
            flush=True,
        )
        ok = False
    except (OSError, subprocess.SubprocessError) as e:
        print(f"[mta_repro.train] scontrol requeue {job} failed: {e}", file=sys.stderr, flush=True)
        ok = False
    _requeued = ok
    if ok:
        print(f"[mta_repro.train] requeued job {job}; saving before SLURM stops this run", file=sys.stderr, flush=True)
    return ok


def _start_early_requeue() -> None:
    """Rank 0 under SLURM: requeue now, in the background (once per process)."""
    global _requeue_thread
    job = _slurm_job()
    # No lock: handlers run in the main thread, and one may interrupt another (a lock
    # taken here could deadlock); a second signal finds the thread already there.
    if not job or launcher_rank() != 0 or _requeue_thread is not None:
        return
    _requeue_thread = threading.Thread(target=_requeue, args=(job,), name="mta-requeue", daemon=True)
    _requeue_thread.start()


def requeue_if_slurm(signum: int | None, is_main: bool) -> bool:
    """``scontrol requeue $SLURM_JOB_ID`` from rank 0 after SIGUSR2 under SLURM; True if
    the job is requeued. Called after the checkpoint: normally the signal handler has
    already requeued (requeue first), and this waits for that and reports it."""
    job = _slurm_job()
    if not (is_main and job):
        return False
    thread = _requeue_thread
    if thread is not None:
        thread.join(timeout=90)
        if _requeued:
            return True
    if signum not in REQUEUE_ON:
        return False
    return _requeue(job)
