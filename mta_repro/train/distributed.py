"""Process group, FSDP2 and model materialisation: parallelism applied from outside.

One code path for 1 and N ranks: even a single process joins a 1-rank process group and
its model is ``fully_shard``-ed on a 1-rank mesh, so checkpointing (DCP), gradient
clipping (DTensor norms) and state-dict handling never branch on the world size.

Order (torchtitan's): build on meta -> activation checkpointing -> torch.compile ->
fully_shard each block, then the root -> to_empty on the device -> load the *full*
seeded init (computed once on rank 0's CPU, broadcast and sharded). Initialising the
full tensors before sharding gives bit-identical weights for any world size, which the
1-vs-2-rank test relies on.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from mta_repro.device import launcher_env, resolve_device
from mta_repro.errors import PeerFailedError, UserError
from mta_repro.slurm import rendezvous_host
from mta_repro.train.args import DistributedArgs

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from mta_repro.model import Transformer

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    # Launched by srun (one task per GPU): the job can requeue itself.
    slurm: bool

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dist_env() -> tuple[int, int, int, bool]:
    """(rank, world_size, local_rank, slurm) as ``launcher_env`` reads them (a single local
    process without a launcher), with the rendezvous: sets MASTER_ADDR/MASTER_PORT when a
    launcher did not. Under srun they come from slurm/train.sbatch, which asks SLURM for the
    first node and its address and probes the port on it; a bare ``srun`` gets the same
    host here (``mta_repro.slurm.rendezvous_host``) and the port every task derives alike
    from the job id (unprobed)."""
    env = os.environ
    found = launcher_env()
    if found is None:
        return 0, 1, 0, "SLURM_JOB_ID" in env
    rank, world, local, slurm = found
    if "RANK" in env and "WORLD_SIZE" in env:  # torchrun (or a hand-set environment)
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in env:
            if world > 1:
                raise UserError("environment: RANK/WORLD_SIZE are set but MASTER_PORT is not")
            env["MASTER_PORT"] = str(_free_port())
    else:  # srun
        if "MASTER_ADDR" not in env:
            nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
            env["MASTER_ADDR"] = rendezvous_host(nodelist) if nodelist else "127.0.0.1"
        env.setdefault("MASTER_PORT", str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))
    return rank, world, local, slurm


# A rank still waiting for the others after this long says so, once (where, and how many).
RENDEZVOUS_NOTE_S = 5.0


def _rendezvous(join: Callable[[], None], check: Callable[[str], None], rank: int, world: int) -> None:
    """``join()`` (init_process_group) in a helper thread while the main thread calls
    ``check(where)`` every 0.1 s. init_process_group blocks in C++ until every rank has
    joined (up to distributed.timeout_min), and a Python signal handler runs only in the
    main thread between bytecodes: waited on directly, Ctrl-C waited for it and SIGTERM or
    SIGUSR2 killed the rank with no line (and no requeue). ``check`` raises StopRequested
    when a stop signal has come; the thread is then left waiting (a daemon thread: the
    process exits with the stop's status all the same)."""
    where = f"the rendezvous of {world} ranks at {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    failed: list[BaseException] = []

    def target() -> None:
        try:
            join()
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
            failed.append(e)

    thread = threading.Thread(target=target, name="mta-rendezvous", daemon=True)
    thread.start()
    t0, noted = time.monotonic(), False
    while thread.is_alive():
        thread.join(0.1)
        check(where)
        if not noted and time.monotonic() - t0 > RENDEZVOUS_NOTE_S:
            noted = True
            log.info("[mta_repro.train] rank %s: waiting for %s", rank, where)
    if failed:
        raise failed[0]


def init_distributed(
    args: DistributedArgs, device_pref: str = "auto", check: Callable[[str], None] | None = None
) -> DistInfo:
    """Join (or create) the process group; idempotent. ``check(where)``: called while
    several ranks wait for each other (it raises to stop the wait: a stop signal)."""
    rank, world, local, slurm = dist_env()
    device = resolve_device(device_pref, local_rank=local, what="trainer.device")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = args.backend if args.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    if backend == "nccl" and device.type != "cuda":
        raise UserError("distributed.backend=nccl needs trainer.device cuda")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = args.allow_tf32
        torch.backends.cudnn.allow_tf32 = args.allow_tf32
    if not dist.is_initialized():
        # One rank needs no rendezvous: an in-memory store (no port, no host lookup).
        store = dist.HashStore() if world == 1 else None  # pyright: ignore[reportPrivateImportUsage]  # torch re-exports it implicitly

        def join() -> None:
            if device.type == "cuda":  # the current device is per thread: the helper's is cuda:0
                torch.cuda.set_device(device)
            dist.init_process_group(
                backend=backend,
                rank=rank,
                world_size=world,
                store=store,
                timeout=datetime.timedelta(minutes=args.timeout_min),
                device_id=device if device.type == "cuda" else None,
            )

        if world == 1 or check is None:
            join()
        else:
            _rendezvous(join, check, rank, world)
    return DistInfo(rank, world, local, device, backend, slurm)


def gather_or_peer_failed(obj: Any, what: str, rank: int, world_size: int) -> list:
    """``obj`` of every rank (all_gather_object); a peer that died or stopped answering
    (its sockets closed, the process group's timeout) is a PeerFailedError naming ``what``."""
    if world_size == 1:
        return [obj]
    every: list = [None] * world_size
    try:
        dist.all_gather_object(every, obj)
    except RuntimeError as e:  # gloo/NCCL: "Connection closed by peer", a timeout
        text = str(e).strip()
        raise PeerFailedError(
            f"rank {rank}: another rank stopped while {what} ({type(e).__name__}: "
            f"{text.splitlines()[-1][:200] if text else 'no message'}); its own error says why. Nothing of the "
            "run was changed here"
        ) from None
    return every


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def mp_policy(args: DistributedArgs, device_type: str):
    """FSDP2 mixed precision (GPU only; CPU trains in fp32): parameters gathered in
    ``param_dtype``, gradients reduced in ``reduce_dtype``. ``cast_forward_inputs=False``:
    FSDP would otherwise cast every float argument of a block's forward to param_dtype,
    the RoPE cos/sin tables included (bf16 tables are off by up to ~0.4% at long
    positions); the hidden states already arrive in param_dtype from the bf16 embedding,
    and the tables stay fp32, as the model computes them."""
    if device_type != "cuda":
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(
        param_dtype=DTYPES[args.param_dtype], reduce_dtype=DTYPES[args.reduce_dtype], cast_forward_inputs=False
    )


def parallelize(model: Transformer, info: DistInfo, args: DistributedArgs) -> Transformer:
    """Apply AC -> compile -> FSDP2 to a (meta-device) Transformer, in place."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # 1. Activation checkpointing wraps each block, so the recomputation unit is a block.
    #    (The wrapper's "_checkpoint_wrapped_module" prefix is stripped by DCP's
    #    get_state_dict, so checkpoint keys stay Lingua's.)
    #    With dropout the recomputation must draw the masks the forward drew: the RNG
    #    state is saved per block and restored for the recomputation (a small cost, paid
    #    only when there is dropout).
    if args.activation_checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        dropout = float(getattr(getattr(model, "args", None), "dropout", 0.0) or 0.0)
        for i, block in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(block, preserve_rng_state=dropout > 0)
    # 2. Compile per block, in place (Module.compile keeps parameter names, no _orig_mod),
    #    before FSDP so that its hooks stay outside the compiled graph.
    if args.compile:
        for block in model.layers:
            block.compile()
    # 3. FSDP2: one all-gather unit per block, then the root (embeddings + final norm,
    #    and the tied output head that shares the embedding).
    mesh = init_device_mesh(info.device.type, (info.world_size,))
    kwargs: dict[str, Any] = {"mesh": mesh}
    policy = mp_policy(args, info.device.type)
    if policy is not None:
        kwargs["mp_policy"] = policy
    for i, block in enumerate(model.layers):
        # The last block's parameters are needed again at once by backward: keep them.
        reshard = args.reshard_after_forward and i < len(model.layers) - 1
        fully_shard(block, reshard_after_forward=reshard, **kwargs)
    fully_shard(model, reshard_after_forward=args.reshard_after_forward, **kwargs)
    # The output head called on its own (``model.logits(h)``, as mta_repro.eval's ppl does
    # in chunks) must gather the root's parameters like a forward does.
    from torch.distributed.fsdp import register_fsdp_forward_method

    if hasattr(model, "logits"):
        register_fsdp_forward_method(model, "logits")
    return model


def materialize(
    model: nn.Module,
    info: DistInfo,
    full_state: dict | None = None,
    model_args=None,
    init: bool = True,
) -> None:
    """Allocate the sharded parameters on the device and fill them with full weights.

    ``full_state`` (needed on rank 0 only): a full state dict (CPU), e.g. a stage's
    source weights; None = the model's seeded init, computed on rank 0's CPU with
    ``build_model(model_args, "cpu")``. Rank 0 broadcasts; every rank keeps its shard.
    ``init=False`` only allocates (resuming: the checkpoint fills everything).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from mta_repro.model import build_model

    model.to_empty(device=info.device)
    if not init:  # a checkpoint is about to overwrite every parameter
        return
    if info.is_main:
        if full_state is None:
            full_state = build_model(model_args if model_args is not None else model.args, device="cpu").state_dict()
    else:
        full_state = {}
    set_model_state_dict(
        model,
        full_state,
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=True),
    )
