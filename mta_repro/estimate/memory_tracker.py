"""A second opinion on the memory pre-flight: PyTorch's own FSDP2 memory tracker.

``tracked_peak`` runs the trainer's step (FSDP2 ``fully_shard`` per block and the root,
activation checkpointing as configured, the project's loss, gradient clipping, AdamW) under
``FakeTensorMode``, one warm-up step untracked (AdamW builds its moments: below) and one
tracked, on a fake process group of the run's world size
(``FakeStore``, backend "fake", a CPU device mesh made before entering the mode), and
reads the per-rank peak, by category, from ``torch.distributed._tools.fsdp2_mem_tracker
.FSDPMemTracker``. Nothing is allocated and no collective runs; 880M at world size 32 takes
seconds to a minute on 2 CPU cores. It shares no code with ``mta_repro.estimate.memory`` beyond
the model and its loss, so the two agreeing is evidence, and their gap names a term.

What it cannot see: the kernels are the CPU ones of a fake CPU tensor (CPU flash SDPA, the
CPU key-query convolution), not FlashAttention-2 or the Triton kernel of a GPU run;
``torch.compile`` is not applied; CUDA's caching allocator and NCCL's buffers are not
modelled. The model is built inside the mode (``Transformer(args)``): the trainer's route,
a meta model then ``to_empty``, fails under ``FakeTensorMode`` on torch 2.13 ("Cannot swap
t1 because it has weakref associated with it"). docs/memory.md sets both beside Table 9.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

import torch

GB = 1e9


@dataclass
class TrackedPeak:
    total: int  # bytes: the per-rank peak of the tracked (second, steady-state) step
    categories: dict  # FSDPMemTracker's category name -> bytes at that peak (non-zero ones)
    world_size: int
    seconds: float  # how long the trace took

    def line(self) -> str:
        parts = ", ".join(f"{k} {v / GB:.2f}" for k, v in self.categories.items())
        return (
            f"PyTorch's FSDPMemTracker (FakeTensorMode, a fake process group of world size {self.world_size}, "
            f"{self.seconds:.0f} s): {self.total / GB:.2f} GB per rank ({parts})"
        )


def _sharded(model_args, mesh, activation_checkpointing: bool, dtype: torch.dtype):
    """The model as the trainer wraps it on a GPU (``mta_repro.train.distributed.parallelize``,
    without compiling): each block checkpointed if asked, ``fully_shard`` per block (the last
    kept gathered after forward) and the root, gathered in ``dtype`` over fp32 shards. Call
    inside ``FakeTensorMode``, with ``mesh`` made outside it (inside, the mesh's own rank
    tensor is fake and ``DeviceMesh`` fails reading it: ``aten._local_scalar_dense``)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from mta_repro.model.transformer import Transformer

    kwargs: dict = {"mesh": mesh}
    if dtype != torch.float32:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=dtype, reduce_dtype=torch.float32, cast_forward_inputs=False
        )
    model = Transformer(model_args)
    if activation_checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, block in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(block, preserve_rng_state=False)
    for i, block in enumerate(model.layers):
        fully_shard(block, reshard_after_forward=i < len(model.layers) - 1, **kwargs)
    return fully_shard(model, **kwargs)


def tracked_peak(
    model_args,
    batch_size: int,
    seq_len: int,
    world_size: int,
    activation_checkpointing: bool,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cuda",
    grad_accum: int = 1,
    fused_adamw=None,
    loss_chunk: int = 0,
) -> TrackedPeak:
    """The per-rank peak of a steady-state training step as ``FSDPMemTracker`` counts it (module
    docstring). ``dtype`` is the gathered parameters' (FSDP2 mixed precision over fp32
    shards, as the trainer on a GPU; fp32: none); ``device`` picks the blocked path's query
    block size and AdamW's default kernels (for-each on CUDA) of the run being checked."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from mta_repro.model import attention_ops
    from mta_repro.model.loss import cross_entropy

    if dist.is_initialized():
        raise RuntimeError("tracked_peak needs a process without a process group (it makes a fake one)")
    if model_args.attn_block_size is None:
        model_args = replace(model_args, attn_block_size=attention_ops.default_block_size(device))
    start = time.perf_counter()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        with FakeTensorMode():
            model: Any = _sharded(model_args, mesh, activation_checkpointing, dtype)
            fused = bool(fused_adamw)
            opt = torch.optim.AdamW(
                model.parameters(), lr=1e-4, fused=fused or None, foreach=None if fused else device == "cuda"
            )
            tokens = torch.randint(0, model_args.vocab_size, (batch_size, seq_len + 1))

            def step():  # as mta_repro.train.loop.train_step
                for micro in range(grad_accum):
                    model.set_requires_gradient_sync(micro == grad_accum - 1)
                    loss = cross_entropy(model, tokens[:, :-1], tokens[:, 1:], loss_chunk) / grad_accum
                    loss.backward()
                    del loss
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
                opt.step()
                opt.zero_grad(set_to_none=True)

            # One step before the tracker: AdamW builds its moments in the first step, and under
            # FakeTensorMode the tracker files the DTensor global-shape tensors that construction
            # makes as OptState (about 3.1 x 4 bytes per parameter, unsharded: 10.85 GB at 880M),
            # a spike no real rank has that would be reported wherever the step's peak is smaller.
            step()
            tracker = FSDPMemTracker(model, opt)
            tracker.track_inputs((tokens,))
            with tracker:
                step()  # the steady state: AdamW's moments exist
            snapshot = tracker.get_tracker_snapshot("peak")
    finally:
        dist.destroy_process_group()
    peak = snapshot.get(torch.device("cpu"), next(iter(snapshot.values()), {}))
    categories = {getattr(k, "value", str(k)): int(v) for k, v in peak.items() if k != "Total" and v}
    return TrackedPeak(int(peak.get("Total", 0)), categories, world_size, time.perf_counter() - start)
