"""Where this process runs: its rank by the launcher's variables, and the one device choice of
training, eval and generation (``resolve_device``)."""

from __future__ import annotations

import os

import torch

from mta_repro.errors import UserError


def resolve_device(
    device: str | torch.device | None = "auto",
    local_rank: int | None = None,
    what: str = "eval device",
) -> torch.device:
    """ "auto" (or None) = this rank's GPU when there is one, else the CPU; "cuda" = this
    rank's GPU; "cuda:N" = that GPU; "cpu". ``local_rank`` (default: the launcher's
    LOCAL_RANK, else 0) picks the GPU, modulo the GPUs visible. Asking for a GPU this
    machine does not have is a one-line UserError naming ``what`` (the config field), not
    a CUDA assertion."""
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device is None or str(device) == "auto":
        if not torch.cuda.is_available():
            return torch.device("cpu")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise UserError(f"{what}: expected 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}") from e
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise UserError(f"{what}: {str(device)!r} was asked for but this machine has no CUDA GPU (use auto or cpu)")
        if dev.index is None:
            return torch.device("cuda", local_rank % n)
        if dev.index >= n:
            raise UserError(f"{what}: {str(device)!r} was asked for but this machine has {n} CUDA GPU(s)")
    return dev


def launcher_env() -> tuple[int, int, int, bool] | None:
    """(rank, world_size, local_rank, slurm) from the launcher's variables, or None for a
    process no launcher started. torchrun's RANK/WORLD_SIZE win (torchrun inside an
    sbatch, one task per node) over srun's SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID (one
    task per GPU). The one place the launcher rank is read (Hydra's rank-0-only output,
    the requeue, the process group)."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        rank = int(env["RANK"])
        return rank, int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", rank)), "SLURM_JOB_ID" in env
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0)), True
    return None


def launcher_rank() -> int:
    """This process's rank by the launcher's variables (0 without a launcher)."""
    found = launcher_env()
    return found[0] if found is not None else 0
