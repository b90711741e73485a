"""Per-GPU memory pre-flight of a training config: will it fit 80 GB and 141 GB (H200)?

    python -m mta_repro.estimate experiment=long_context_880m_mta --memory
    python -m mta_repro.estimate experiment=pretrain_880m_mta --memory --world-size 8

The estimate is the peak of one steady-state training step (the second on: AdamW's
moments exist) on one rank. Nothing about activations is guessed: the model runs one
forward, loss and backward on the ``meta`` device (shapes only, no memory) in the config's
compute dtype, with the trainer's activation checkpointing, while a dispatch mode
(``_LiveBytes``) records every storage from its creation until it is freed; the peak of
the running sum is the step's. On meta the run's kernels are stand-ins that keep what the
real ones keep (flash-like SDPA, an implementation's own ``AttnImpl.meta_fn`` and
``workspace_bytes``, the key-query convolution the device picks), handed to the meta
model's attention modules (``Attention.kernels``): nothing process-wide is swapped.
On top of that peak, or of AdamW's step where that is larger: the fp32 parameters and
AdamW moments sharded over the world size, FSDP2's gathered parameters and the gradients
held across micro-batches. Every term, what is not counted, and the estimate against
measured steps: docs/memory.md.

It fits a capacity when the total is at most 90% of it (allocator fragmentation, the CUDA
context and NCCL buffers take the rest).
"""

from __future__ import annotations

import importlib.util
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import cast

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

GB = 1e9
CAPACITIES = {"80 GB": 80 * GB, "H200 141 GB": 141 * GB}
HEADROOM = 0.9


class _FlashLikeSDPA(torch.autograd.Function):
    """What a fused (flash) SDPA keeps for backward: q, k, v, the output and the fp32
    log-sum-exp per row. On meta, F.scaled_dot_product_attention takes the math path,
    which would count the (B, H, T, T) probabilities that no GPU run keeps. With
    ``workspace`` (CUDA runs), backward also allocates what FlashAttention-2's backward does
    beside dq, dk, dv: an fp32 dq accumulator and the fp32 row sums of dO * O."""

    @staticmethod
    def forward(ctx, q, k, v, workspace=False):
        # (B, T, H, d) in memory as the fused kernels write it, so the model's
        # transpose-reshape before wo is a view of the same storage.
        b, h, t, _ = q.shape
        out = q.new_empty(b, t, h, v.shape[-1]).transpose(1, 2)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.workspace = workspace
        return out

    @staticmethod
    def backward(ctx, g):
        q, k, v, _, lse = ctx.saved_tensors
        scratch = (torch.empty_like(q, dtype=torch.float32), torch.empty_like(lse)) if ctx.workspace else ()
        grads = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None
        del scratch
        return grads


def _sdpa_meta(q, k, v, *args, **kwargs):
    return _FlashLikeSDPA.apply(q, k, v)


def _sdpa_meta_cuda(q, k, v, *args, **kwargs):
    return _FlashLikeSDPA.apply(q, k, v, True)


def backward_workspace(attn, batch_size: int, seq_len: int) -> int:
    """Bytes the implementation of attention module ``attn`` holds beyond its inputs, outputs
    and saved tensors while one training step's backward runs through it (its
    ``AttnImpl.workspace_bytes`` under the module's parameters and tuning, in the module's
    compute dtype; 0 for one that declares none)."""
    from mta_repro.model import attention_ops

    entry = attention_ops.attn_impl(attn.attn_impl)
    if entry.workspace_bytes is None:
        return 0
    return entry.workspace_bytes(
        attn.explicit_params(), batch_size, seq_len, attn.n_heads, attn.head_dim, attn.wq.weight.dtype
    )


def _saved_bytes(fn, exclude: set) -> int:
    """Bytes autograd saves while running fn(), each storage once, minus ``exclude``."""
    sizes: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        sizes[s._cdata] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(n for k, n in sizes.items() if k not in exclude)


class _LiveBytes(TorchDispatchMode):
    """Every storage that an op creates, from its creation until it is freed, in order.

    On meta nothing is allocated, but storages still have sizes and lifetimes: each op's
    output storages are recorded once (views share them), and a finalizer on the storage
    records its release. Storages in ``known`` (parameters, inputs) are not counted."""

    def __init__(self, known=()):
        super().__init__()
        self.known = set(known)
        self.open: dict[int, int] = {}  # storage id -> serial
        self.sizes: list[int] = []  # serial -> bytes
        self.events: list[tuple[int, int, str]] = []  # (serial or -1, +/- bytes, op)

    def _track(self, t: torch.Tensor, op: str) -> None:
        st = t.untyped_storage()
        key = st._cdata
        if key in self.known or key in self.open:
            return
        serial = len(self.sizes)
        self.sizes.append(st.nbytes())
        self.open[key] = serial
        self.events.append((serial, self.sizes[serial], op))
        weakref.finalize(st, self._free, key, serial)

    def _free(self, key: int, serial: int) -> None:
        self.open.pop(key, None)
        self.events.append((serial, -self.sizes[serial], ""))

    def spike(self, nbytes: int, what: str) -> None:
        """A workspace that exists for a moment (allocated and freed by a kernel)."""
        self.events += [(-1, nbytes, what), (-1, -nbytes, "")]

    def serial_of(self, t: torch.Tensor) -> int | None:
        return self.open.get(t.untyped_storage()._cdata)

    def peak(self, weight: dict[int, int]) -> tuple[int, int, str, int]:
        """(peak bytes, index of the event, its op, bytes of ``weight``'s storages then
        live): ``weight`` replaces some storages' sizes (the parameters' gradients)."""
        live = weighted = 0
        best = (0, -1, "", 0)
        for i, (serial, n, op) in enumerate(self.events):
            if serial in weight:
                w = weight[serial] if n > 0 else -weight[serial]
                n, weighted = w, weighted + w
            live += n
            if live > best[0]:
                best = (live, i, op, weighted)
        return best

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "meta":
                self._track(t, func.__name__)
        return out


def target_kq_backend(device: str, dtype: torch.dtype, tuning=None) -> str:
    """The key-query convolution kernel that ``attention_ops.kq_conv_backend`` picks on the
    run's device under the model's ``tuning`` (``model.kernels``; its fake implementation is
    what then runs on meta): on CPU that function itself (the C kernel in fp32/fp64 where it
    compiles, ``kq_conv`` honoured); on CUDA the Triton kernel where triton is installed,
    unless ``model.kernels.kq_conv=conv2d``."""
    from mta_repro.kernels.tuning import DEFAULT_TUNING
    from mta_repro.model import attention_ops

    tuning = tuning or DEFAULT_TUNING
    if device == "cpu":
        return attention_ops.kq_conv_backend(torch.empty(0, dtype=dtype), tuning)
    if tuning.kq_conv == "conv2d" or importlib.util.find_spec("triton") is None:
        return "conv2d"
    return "triton"


@contextmanager
def _run_device_impls(model, live: _LiveBytes, device: str, dtype: torch.dtype, workspace: dict):
    """Hands ``model``'s attention modules stand-ins on meta for what runs on ``device``
    (``Attention.kernels``; nothing process-wide changes): flash-like SDPA, each registered
    implementation's own stand-in (``AttnImpl.meta_fn``; plus its backward workspace, as a
    spike when its output's gradient arrives; bytes per attention module in ``workspace``),
    the device's key-query convolution kernel under the model's tuning
    (``model.args.kernels``, kept on each module)."""
    from mta_repro.model import attention_ops

    current = {"bytes": 0}

    def on_meta(name, entry):
        def fn(q, k, v, p, mask, training=False):
            out = entry.meta_fn(q, k, v, p, mask, training)
            if out.requires_grad and current["bytes"]:
                n = current["bytes"]
                out.register_hook(lambda g: live.spike(n, f"{name} backward workspace"))
            return out

        return attention_ops.AttnImpl(fn, doc=entry.doc)

    for m in model.layers:  # the implementations the model names, loaded (a declared one on first use)
        attention_ops.attn_impl(m.attention.attn_impl)
    stand_ins = dict(
        sdpa=_sdpa_meta_cuda if device == "cuda" else _sdpa_meta,
        impls={name: on_meta(name, e) if e.meta_fn is not None else e for name, e in attention_ops.ATTN_IMPLS.items()},
    )
    modules = [layer.attention for layer in model.layers]
    before = [m.kernels for m in modules]
    hooks = [m.register_forward_pre_hook(lambda m, a, n=n: current.update(bytes=n)) for m, n in workspace.items()]
    for m in modules:
        m.kernels = replace(m.kernels, **stand_ins, kq_backend=target_kq_backend(device, dtype, m.kernels.tuning))
    try:
        yield
    finally:
        for m, k in zip(modules, before):
            m.kernels = k
        for h in hooks:
            h.remove()


def _adamw_temporaries(model, world_size: int, device: str, fused) -> int:
    """Peak bytes AdamW's step allocates on top of parameters, gradients and moments (one
    fp32 shard per parameter, as FSDP2 hands it): torch's default there is the for-each
    kernels on CUDA (whole lists of temporaries) and the per-parameter loop on CPU (two
    temporaries of one parameter, plus the previous one's); ``fused`` has none."""
    if fused:
        return 0
    shards = []
    for p in model.parameters():
        shape = ((-(-p.shape[0] // world_size),) + tuple(p.shape[1:])) if p.dim() else ()
        shards.append(torch.nn.Parameter(torch.empty(shape, device="meta")))
        shards[-1].grad = torch.empty_like(shards[-1])
    opt = torch.optim.AdamW(shards, lr=1e-4, foreach=device == "cuda")
    opt.step()  # creates the moments: state, not temporaries
    known = [
        t.untyped_storage()._cdata
        for p in shards
        for t in (p, p.grad, *(v for v in opt.state[p].values() if isinstance(v, torch.Tensor)))
    ]
    with _LiveBytes(known) as live:
        opt.step()
    return live.peak({})[0]


def _checkpoint_blocks(model) -> None:
    """What the trainer's checkpoint_wrapper does: each block recomputed in backward, the RNG
    state kept only with dropout."""
    from torch.utils.checkpoint import checkpoint

    keep_rng = float(getattr(model.args, "dropout", 0.0) or 0.0) > 0
    for layer in model.layers:
        forward = layer.forward
        layer.forward = lambda *a, _f=forward, **k: checkpoint(
            _f, *a, use_reentrant=False, preserve_rng_state=keep_rng, **k
        )


@contextmanager
def _blocks_backward(model, live: _LiveBytes):
    """Yields a dict that gets, under "event", the index of ``live``'s event at which the
    blocks' backward starts (the last block's output gradient arrives): before it, the
    loss's backward, when FSDP2 has gathered the root and the last block only."""
    mark: dict = {}

    def on_grad(g) -> None:
        mark.setdefault("event", len(live.events))

    def on_output(module, inputs, out) -> None:
        out.register_hook(on_grad)

    handle = model.layers[-1].register_forward_hook(on_output)
    try:
        yield mark
    finally:
        handle.remove()


def _step_on_meta(
    model,
    batch_size: int,
    seq_len: int,
    world_size: int,
    device: str,
    dtype: torch.dtype,
    activation_checkpointing: bool,
    grads_held: bool,
    workspace: dict,
    loss_chunk: int = 0,
) -> dict:
    """One forward + loss + backward on meta, as the trainer runs it, through ``_LiveBytes``.

    Returns the peak of live bytes (and when it happens), with each parameter's gradient
    counted at what the run keeps: fp32, sharded over the world size (FSDP2's reduced
    gradient), from the moment backward creates it; 0 when ``grads_held`` (the gradients
    of earlier micro-batches are counted outside, and this one accumulates into them)."""
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    tokens = torch.zeros(batch_size, seq_len, dtype=torch.long, device="meta")
    saved: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s._cdata not in params:
            saved[s._cdata] = s.nbytes()
        return t

    def loss():
        # the trainer's loss: logits in the compute dtype, the loss in fp32 (trainer.loss_chunk:
        # in chunks of token rows, the logits recomputed in backward)
        from mta_repro.model.loss import cross_entropy

        return cross_entropy(model, tokens, tokens, loss_chunk)

    if activation_checkpointing:
        _checkpoint_blocks(model)
    live = _LiveBytes(params | {tokens.untyped_storage()._cdata})
    with _run_device_impls(model, live, device, dtype, workspace), live, _blocks_backward(model, live) as blocks_from:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = loss()
        end_of_forward = len(live.events)
        out.backward()
        del out
    grads = {}
    for p in model.parameters():
        serial = None if p.grad is None else live.serial_of(p.grad)
        if serial is not None:
            grads[serial] = 0 if grads_held else 4 * -(-p.numel() // world_size)
    peak, at, op, grad_bytes = live.peak(grads)
    return {
        "peak": peak,
        "op": op,
        "in_backward": at >= end_of_forward,
        "in_blocks_backward": at >= blocks_from.get("event", end_of_forward),
        "gradients_at_peak": grad_bytes,
        "saved": sum(saved.values()),
    }


@dataclass
class MemoryEstimate:
    world_size: int
    activation_checkpointing: bool
    parts: dict  # name -> bytes, summing to the total
    # What was assumed: per-GPU micro-batch, sequence length, compute dtype, optimizer.
    assumptions: str = ""
    # Figures behind the parts, not added to the total (name -> bytes or text).
    details: dict = field(default_factory=dict)

    @property
    def total(self) -> float:
        return float(sum(self.parts.values()))

    def fits(self, capacity: float) -> bool:
        return self.total <= HEADROOM * capacity

    def table(self) -> str:
        lines = ["| part | GB |", "|---|---:|"]
        lines += [f"| {k} | {v / GB:.2f} |" for k, v in self.parts.items()]
        lines.append(f"| **total** | **{self.total / GB:.2f}** |")
        verdict = ", ".join(f"{name}: {'fits' if self.fits(c) else 'DOES NOT FIT'}" for name, c in CAPACITIES.items())
        given = f"{self.assumptions}, " if self.assumptions else ""
        notes = "; ".join(
            f"{k} {v / GB:.2f} GB" if isinstance(v, (int, float)) else f"{k}: {v}" for k, v in self.details.items()
        )
        return (
            "\n".join(lines) + f"\n\n{given}world size {self.world_size}, activation checkpointing "
            f"{'on' if self.activation_checkpointing else 'off'}; {verdict} (rule: total <= {HEADROOM:.0%} of capacity)"
            + (f"\n\n{notes}" if notes else "")
        )


def estimate_memory(
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
) -> MemoryEstimate:
    """The peak of one steady-state training step per rank (module docstring)."""
    from mta_repro.model import attention_ops, build_model
    from mta_repro.model.transformer import TransformerBlock

    if model_args.attn_block_size is None:  # the blocked path's rows per query block on the run's device
        model_args = replace(model_args, attn_block_size=attention_ops.default_block_size(device))
    model = build_model(model_args, device="meta").to(dtype)
    n_params = sum(p.numel() for p in model.parameters())
    bpe = torch.finfo(dtype).bits // 8
    attns = [cast(TransformerBlock, layer).attention for layer in model.layers]  # ModuleList's items are Modules
    workspace = {a: backward_workspace(a, batch_size, seq_len) for a in attns if a.kind in ("kq_conv", "mixing")}
    workspace = {m: n for m, n in workspace.items() if n}
    step = _step_on_meta(
        model,
        batch_size,
        seq_len,
        world_size,
        device,
        dtype,
        activation_checkpointing,
        grad_accum > 1,
        workspace,
        loss_chunk,
    )
    grads = 4 * n_params / world_size
    optimizer = grads + _adamw_temporaries(model, world_size, device, fused_adamw)

    block_params = max(sum(p.numel() for p in layer.parameters()) for layer in model.layers)
    root_params = n_params - sum(sum(p.numel() for p in layer.parameters()) for layer in model.layers)
    parts = {"parameters and AdamW moments (fp32, sharded)": 12 * n_params / world_size}
    if step["in_backward"] and not step["in_blocks_backward"]:
        # the loss's backward: the root and the last block (kept after forward), no block gradient yet
        parts["gathered parameters (root + the last block) at that peak"] = (root_params + block_params) * bpe
    else:  # inside the blocks: the current and the prefetched block, and one block's unsharded gradients
        blocks = min(2, len(model.layers))
        parts[f"gathered parameters (root + {blocks} blocks) and one block's gradients"] = (
            root_params + blocks * block_params
        ) * bpe + block_params * 4
    if grad_accum > 1:
        # FSDP2 keeps gradients unsharded in fp32 between reductions (no-sync micro-batches)
        parts["gradients held across micro-batches (fp32, unsharded)"] = 4 * n_params
    if step["peak"] >= optimizer:
        where = "backward" if step["in_backward"] else "forward"
        parts[f"step peak: {where} (measured on meta: activations, transients, gradients)"] = step["peak"]
    else:
        parts["step peak: optimizer step (gradients, AdamW temporaries)"] = optimizer
    assumed = (
        f"micro-batch {batch_size} x {seq_len} tokens per GPU, {str(dtype).replace('torch.', '')} "
        "compute, fp32 AdamW state"
    )
    return MemoryEstimate(world_size, activation_checkpointing, parts, assumed, _details(step, optimizer, device))


def _details(step: dict, optimizer: float, device: str) -> dict:
    """What the estimate prints below its parts: the step's peak and where it happens."""
    details = {
        "saved activations at the end of forward": step["saved"],
        "forward/backward peak": step["peak"],
        "gradients live at that peak": step["gradients_at_peak"],
        "peak op": step["op"],
        "optimizer step peak": optimizer,
    }
    if device == "cpu":
        details["CPU"] = (
            "this counts tensors; glibc's default heap keeps freed ones resident on top "
            "(GBs at 300M width, docs/memory.md) unless trainer.cpu_mmap_threshold=131072"
        )
    return details


def estimate_from_config(cfg, world_size: int | None = None) -> MemoryEstimate:
    """From a composed training config (Hydra DictConfig)."""
    from mta_repro.model import to_model_args

    on_gpu = str(cfg.trainer.get("device", "cpu")).startswith("cuda")
    if world_size is None:
        world_size = int(cfg.slurm.nodes) * int(cfg.slurm.gpus_per_node) if on_gpu else 1
    dtype = getattr(torch, cfg.distributed.param_dtype) if on_gpu else torch.float32
    fused = cfg.get("optim", {}).get("fused", None)
    return estimate_memory(
        to_model_args(cfg.model),
        int(cfg.data.batch_size),
        int(cfg.data.seq_len),
        world_size,
        bool(cfg.distributed.activation_checkpointing),
        dtype,
        "cuda" if on_gpu else "cpu",
        int(cfg.trainer.get("grad_accum", 1)),
        None if fused is None else bool(fused),
        int(cfg.trainer.get("loss_chunk", 0)),
    )
