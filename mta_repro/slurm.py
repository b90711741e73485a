"""Small SLURM helpers shared by the training, evaluation and pipeline job scripts
(``mta_repro.train.slurm``, ``mta_repro.eval.slurm``, ``mta_repro.pipeline.run``)."""

from __future__ import annotations

from typing import Optional


def time_limit(minutes: int) -> str:
    """sbatch's ``--time`` in days-hours:minutes:seconds (``2880`` -> ``2-00:00:00``)."""
    d, rem = divmod(int(minutes), 24 * 60)
    h, m = divmod(rem, 60)
    return f"{d}-{h:02d}:{m:02d}:00"


def memory_lines(mem: Optional[str], exclusive: bool) -> str:
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
