"""Data-parallel evaluation under torchrun: each process takes every world_size-th
unit of work (a ppl batch, a needle/BabiLong generation batch, lm-eval requests) and
the results are combined, so the numbers equal a one-process run.

Outside torchrun (WORLD_SIZE unset or 1) everything here is a no-op.
"""

from __future__ import annotations

import os

import torch


def init(device=None) -> tuple:
    """(rank, world_size); joins the torchrun process group once (gloo for CPU work,
    NCCL when the model is on a GPU)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return 0, 1
    from mta_repro.device import resolve_device

    dev = resolve_device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size()


def rank_world() -> tuple:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def mine(index: int) -> bool:
    """Whether work unit ``index`` belongs to this process (round robin)."""
    rank, world = rank_world()
    return index % world == rank


def all_gather_objects(obj) -> list:
    """[obj of rank 0, obj of rank 1, ...] on every rank ([obj] in one process)."""
    rank, world = rank_world()
    if world == 1:
        return [obj]
    import torch.distributed as dist

    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


def merge_dicts(local: dict) -> dict:
    """Union of every rank's dict (keys are disjoint work units)."""
    merged: dict = {}
    for part in all_gather_objects(local):
        merged.update(part)
    return merged


def barrier() -> None:
    if rank_world()[1] > 1:
        import torch.distributed as dist

        dist.barrier()
