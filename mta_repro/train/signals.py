"""Preemption: SIGUSR2 / SIGTERM (and SIGUSR1, submitit's time-out signal) set a flag;
the loop checkpoints at the next step boundary and exits cleanly. Under SLURM, SIGUSR2
(``#SBATCH --signal=USR2@120``: the time limit is near) and SIGUSR1 also requeue the job;
SIGTERM does not, because ``scancel`` sends it too and a cancelled job must stay
cancelled (SLURM requeues preempted jobs itself).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Optional

import torch
import torch.distributed as dist

HANDLED = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)
REQUEUE_ON = (signal.SIGUSR1, signal.SIGUSR2)


class PreemptionHandler:
    def __init__(self) -> None:
        self.signum: Optional[int] = None
        self._previous = {}
        for sig in HANDLED:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:  # runs between bytecodes: only set a flag
        self.signum = signum
        print(f"[mta_repro.train] received {signal.Signals(signum).name}: checkpoint at the next step boundary",
              file=sys.stderr, flush=True)

    def agreed_signal(self, device: torch.device) -> Optional[int]:
        """The signal seen by any rank (collective), so all ranks stop at the same step."""
        local = torch.tensor([self.signum or 0], dtype=torch.int64, device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(local, op=dist.ReduceOp.MAX)
        value = int(local.item())
        return value or None

    def restore(self) -> None:
        for sig, prev in self._previous.items():
            signal.signal(sig, prev)


def requeue_if_slurm(signum: Optional[int], is_main: bool) -> bool:
    """``scontrol requeue $SLURM_JOB_ID`` from rank 0 after SIGUSR1/2 under SLURM."""
    job = os.environ.get("SLURM_JOB_ID")
    if not (is_main and job and signum in REQUEUE_ON):
        return False
    # An array task is requeued by its own id.
    if os.environ.get("SLURM_ARRAY_JOB_ID") and os.environ.get("SLURM_ARRAY_TASK_ID"):
        job = f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    try:
        subprocess.run(["scontrol", "requeue", job], check=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        print(f"[mta_repro.train] scontrol requeue {job} failed: {e}", file=sys.stderr, flush=True)
        return False
    return True
