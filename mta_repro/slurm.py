"""Small SLURM helpers shared by the training, evaluation and pipeline job scripts
(``mta_repro.pipeline.submit``, ``mta_repro.eval.submit``, ``mta_repro.pipeline.run``)."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path

from mta_repro.errors import UserError


def time_limit(minutes: int) -> str:
    """sbatch's ``--time`` in days-hours:minutes:seconds (``2880`` -> ``2-00:00:00``)."""
    d, rem = divmod(int(minutes), 24 * 60)
    h, m = divmod(rem, 60)
    return f"{d}-{h:02d}:{m:02d}:00"


def memory_lines(mem: str | None, exclusive: bool) -> str:
    """The ``#SBATCH --mem`` / ``--exclusive`` lines (each ending in a newline), or "".

    mem: sbatch's per-node memory (``"480G"``; ``"0"`` = all of the node's memory).
    Without it a job gets the cluster's DefMemPerCPU x CPUs, which may not hold rank 0's
    full fp32 model (it broadcasts the initial weights) plus the checkpoint staging."""
    out = ""
    if mem is not None and str(mem) != "":
        out += f"#SBATCH --mem={mem}\n"
    if exclusive:
        out += "#SBATCH --exclusive\n"
    return out


class SubmitError(UserError):
    """sbatch is missing or refused the script (the message is one line, with sbatch's
    own): exit status 2, like a user error, since the fix is the submitter's (a partition,
    account or limit the cluster does not accept, a submit host)."""


def sbatch(script_path: Path, extra_args: Sequence[str] = ()) -> str:
    """Submit with ``sbatch --parsable``; the job id. SubmitError (one line) when sbatch
    is missing or refuses, quoting sbatch's own message."""
    cmd = ["sbatch", "--parsable", *extra_args, str(script_path)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise SubmitError(
            f"sbatch is not on PATH: --submit needs a SLURM submit host (the script is written to "
            f"{script_path}; --dry-run prints it; scripts/slurm_local.sh starts a one-node cluster here)"
        ) from None
    except subprocess.TimeoutExpired:
        raise SubmitError(f"sbatch {script_path} did not answer within 120 s (is slurmctld up?)") from None
    if out.returncode != 0:
        said = " | ".join(l.strip() for l in (out.stderr + out.stdout).splitlines() if l.strip())
        raise SubmitError(f"sbatch refused {script_path} (exit {out.returncode}): {said or 'no message'}")
    # --parsable prints "jobid" or "jobid;cluster".
    return out.stdout.strip().split(";")[0]
