"""The one device choice of training, eval and generation: ``resolve_device``."""

from __future__ import annotations

import os
from typing import Optional, Union

import torch

from mta_repro.errors import UserError


def resolve_device(
    device: Union[str, torch.device, None] = "auto",
    local_rank: Optional[int] = None,
    what: str = "eval device",
) -> torch.device:
    """"auto" (or None) = this rank's GPU when there is one, else the CPU; "cuda" = this
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
            raise UserError(f"{what}: {str(device)!r} was asked for but this machine has no CUDA GPU "
                            "(use auto or cpu)")
        if dev.index is None:
            return torch.device("cuda", local_rank % n)
        if dev.index >= n:
            raise UserError(f"{what}: {str(device)!r} was asked for but this machine has {n} CUDA GPU(s)")
    return dev
