"""Per-GPU memory pre-flight of a training config: will it fit 80 GB and 141 GB (H200)?

    python -m mta_repro.params experiment=long_context_880m_mta --memory
    python -m mta_repro.params experiment=pretrain_880m_mta --memory --world-size 8

Activations are not guessed: the model runs its forward and loss on the ``meta`` device
(shapes only, no memory, about a second at 880M) in the config's compute dtype, and
``saved_tensors_hooks`` add up what autograd keeps for backward, with the same activation
checkpointing the trainer would apply. The rest is counted from the parameter count:

- FSDP2 state, sharded over the world size: fp32 parameters, fp32 gradients and AdamW's
  two moments (16 bytes per parameter / world);
- gathered compute-dtype parameters: the root (embeddings) plus two blocks (the current
  one and the prefetched next), and one block's unsharded gradients before reduce-scatter;
- the backward peak on top of the saved activations: the largest of (the logits'
  gradient in fp32 + compute dtype) and (one block's recomputation, with activation
  checkpointing), plus one attention query block's recomputed tensors (blocked path) or
  one layer's backward workspace (triton path: scratch slots, fp32 dq/dk/dv).

It fits a capacity when the total is at most 90% of it (allocator fragmentation, the CUDA
context and NCCL buffers take the rest).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GB = 1e9
CAPACITIES = {"80 GB": 80 * GB, "H200 141 GB": 141 * GB}
HEADROOM = 0.9


class _FlashLikeSDPA(torch.autograd.Function):
    """What a fused (flash) SDPA keeps for backward: q, k, v, the output and the fp32
    log-sum-exp per row. On meta, F.scaled_dot_product_attention takes the math path,
    which would count the (B, H, T, T) probabilities that no GPU run keeps."""

    @staticmethod
    def forward(ctx, q, k, v):
        # (B, T, H, d) in memory as the fused kernels write it, so the model's
        # transpose-reshape before wo is a view of the same storage.
        b, h, t, _ = q.shape
        out = q.new_empty(b, t, h, v.shape[-1]).transpose(1, 2)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, g):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _sdpa_meta(q, k, v, *args, **kwargs):
    return _FlashLikeSDPA.apply(q, k, v)


class _TritonLike(torch.autograd.Function):
    """What ``attn_impl=triton`` keeps for backward: contiguous q, k, v and the fp32
    log-sum-exp per row (the weights are parameters). Triton does not run on meta."""

    @staticmethod
    def forward(ctx, q, k, v):
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q.contiguous(), k.contiguous(), v.contiguous(), lse)
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, g):
        q, k, v, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _triton_meta(q, k, v, p, mask, training=False):
    return _TritonLike.apply(q, k, v)


def triton_backward_workspace(attn, batch_size: int, seq_len: int, sms: int = 132) -> int:
    """Bytes the triton kernel's backward pass allocates for one layer (its largest pass):
    the per-program scratch slots (compute dtype, taken as 2 bytes; a persistent grid of
    PROGRAMS_PER_SM per SM, 132 SMs on an H100/H200), the per-item fp32 dq partials of the
    owned rows, the fp32 dk/dv accumulators, the convolved keys and the band table."""
    from mta_repro.model import frames

    p = attn.explicit_params()
    pre = None if p.mta_kernel is None else tuple(p.mta_kernel.shape[2:])
    post = None if p.mta_kernel_after_sm is None else tuple(p.mta_kernel_after_sm.shape[2:])
    f = frames.frame("backward", pre, post, p.pad_key)
    n_target = frames.PROGRAMS_PER_SM * sms
    sched = frames.items(f, batch_size, seq_len, seq_len, 0, n_target)
    programs = min(len(sched.items), n_target)
    hp = frames.padded_heads(attn.n_heads)
    n_slot = frames.scratch_slots("backward", pre is not None, post is not None)["NSLOT"]
    scratch = programs * n_slot * hp * f.er * f.ec * 2
    io = batch_size * attn.n_heads * seq_len * attn.head_dim
    dq_parts = batch_size * sched.n_rt * sched.s_max * attn.n_heads * f.er * attn.head_dim * 4
    khat = (pre[0] * io * 2 + batch_size * attn.n_heads * seq_len * 16 * 4) if pre else 0
    return scratch + dq_parts + 2 * io * 4 + khat


def _saved_bytes(fn, exclude: set) -> int:
    """Bytes autograd saves while running fn(), each storage once, minus ``exclude``."""
    sizes: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        sizes[s._cdata] = s.nbytes()
        return t

    from mta_repro.model import attention_ops

    sdpa = torch.nn.functional.scaled_dot_product_attention
    triton_impl = attention_ops.ATTN_IMPLS["triton"]
    torch.nn.functional.scaled_dot_product_attention = _sdpa_meta
    attention_ops.ATTN_IMPLS["triton"] = attention_ops.AttnImpl(_triton_meta)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
    finally:
        torch.nn.functional.scaled_dot_product_attention = sdpa
        attention_ops.ATTN_IMPLS["triton"] = triton_impl
    return sum(n for k, n in sizes.items() if k not in exclude)


@dataclass
class MemoryEstimate:
    world_size: int
    activation_checkpointing: bool
    parts: dict  # name -> bytes
    # What was assumed: per-GPU micro-batch, sequence length, compute dtype, optimizer.
    assumptions: str = ""

    @property
    def total(self) -> float:
        return float(sum(self.parts.values()))

    def fits(self, capacity: float) -> bool:
        return self.total <= HEADROOM * capacity

    def table(self) -> str:
        lines = ["| part | GB |", "|---|---:|"]
        lines += [f"| {k} | {v / GB:.2f} |" for k, v in self.parts.items()]
        lines.append(f"| **total** | **{self.total / GB:.2f}** |")
        verdict = ", ".join(
            f"{name}: {'fits' if self.fits(c) else 'DOES NOT FIT'}" for name, c in CAPACITIES.items()
        )
        given = f"{self.assumptions}, " if self.assumptions else ""
        return "\n".join(lines) + f"\n\n{given}world size {self.world_size}, activation checkpointing " \
            f"{'on' if self.activation_checkpointing else 'off'}; {verdict} (rule: total <= {HEADROOM:.0%} of capacity)"


def estimate(model_args, batch_size: int, seq_len: int, world_size: int, activation_checkpointing: bool,
             dtype: torch.dtype = torch.bfloat16) -> MemoryEstimate:
    from mta_repro.model import build_model
    from mta_repro.model import attention_ops

    model = build_model(model_args, device="meta").to(dtype)
    n_params = sum(p.numel() for p in model.parameters())
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    tokens = torch.zeros(batch_size, seq_len, dtype=torch.long, device="meta")
    bpe = torch.finfo(dtype).bits // 8

    def loss():
        logits = model(tokens)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())

    # One block's saved activations (no checkpointing), for the recomputation peak.
    per_block = []
    for layer in model.layers:
        x = torch.zeros(batch_size, seq_len, model_args.dim, dtype=dtype, device="meta", requires_grad=True)
        cos = torch.zeros(seq_len, model_args.resolved_head_dim // 2, device="meta")
        per_block.append(_saved_bytes(lambda: layer(x, cos, cos), params))
    if activation_checkpointing:
        from torch.utils.checkpoint import checkpoint

        # What the trainer's checkpoint_wrapper keeps: each block's input only.
        for layer in model.layers:
            forward = layer.forward
            layer.forward = lambda *a, _f=forward, **k: checkpoint(_f, *a, use_reentrant=False, **k)
    saved = _saved_bytes(loss, params)

    # One attention query block recomputed in backward (its saved tensors, largest block).
    attn_block = 0
    for layer in model.layers:
        attn = layer.attention
        if attn.kind in ("kq_conv", "mixing") and attn.attn_impl == "triton":
            attn_block = max(attn_block, triton_backward_workspace(attn, batch_size, seq_len))
        if attn.kind not in ("kq_conv", "mixing") or attn.attn_impl != "blocked":
            continue
        p = attn.explicit_params()
        rows = min(seq_len, attention_ops.resolve_block_size(p.block_size, "cuda") + attention_ops.query_history(p))
        H, d = attn.n_heads, attn.head_dim
        q = torch.zeros(batch_size, H, rows, d, dtype=dtype, device="meta", requires_grad=True)
        k = torch.zeros(batch_size, H, seq_len, d, dtype=dtype, device="meta", requires_grad=True)
        weights = [getattr(p, f) for f in attention_ops._WEIGHT_FIELDS if getattr(p, f) is not None]
        attn_block = max(attn_block, _saved_bytes(
            lambda: attention_ops._score_path_fast(q, k, k, p, attention_ops.AttnMask(seq_len - rows), True, *weights),
            params,
        ))

    block_params = max(sum(p.numel() for p in layer.parameters()) for layer in model.layers)
    root_params = n_params - sum(sum(p.numel() for p in layer.parameters()) for layer in model.layers)
    logits_grad = batch_size * seq_len * model_args.vocab_size * (4 + bpe)
    recompute = max(per_block) if activation_checkpointing else 0
    parts = {
        "parameters, gradients, AdamW (fp32, sharded)": 16 * n_params / world_size,
        "gathered parameters (root + 2 blocks) and one block's gradients": (root_params + 2 * block_params) * bpe
        + block_params * 4,
        "saved activations (measured on meta)": saved,
        "backward peak: max(logits grad, block recompute) + attention block": max(logits_grad, recompute)
        + attn_block,
    }
    assumed = (f"micro-batch {batch_size} x {seq_len} tokens per GPU, {str(dtype).replace('torch.', '')} "
               "compute, fp32 AdamW state")
    return MemoryEstimate(world_size, activation_checkpointing, parts, assumed)


def estimate_from_config(cfg, world_size: int | None = None) -> MemoryEstimate:
    """From a composed training config (Hydra DictConfig)."""
    from mta_repro.config import model_args_from

    if world_size is None:
        on_gpu = str(cfg.trainer.get("device", "cpu")).startswith("cuda")
        world_size = int(cfg.slurm.nodes) * int(cfg.slurm.gpus_per_node) if on_gpu else 1
    on_gpu = str(cfg.trainer.get("device", "cpu")).startswith("cuda")
    dtype = getattr(torch, cfg.distributed.param_dtype) if on_gpu else torch.float32
    return estimate(
        model_args_from(cfg), int(cfg.data.batch_size), int(cfg.data.seq_len), world_size,
        bool(cfg.distributed.activation_checkpointing), dtype,
    )


def experiments_table(names: list[str]) -> str:
    """A Markdown row per experiment: its per-GPU estimate and the verdicts."""
    from mta_repro.config import compose

    lines = ["| experiment | world | act. ckpt | per-GPU estimate GB | 80 GB | H200 141 GB |", "|---|---:|---|---:|---|---|"]
    for name in names:
        est = estimate_from_config(compose([f"experiment={name}"]))
        lines.append(
            f"| {name} | {est.world_size} | {'on' if est.activation_checkpointing else 'off'} | "
            f"{est.total / GB:.1f} | {'fits' if est.fits(CAPACITIES['80 GB']) else 'no'} | "
            f"{'fits' if est.fits(CAPACITIES['H200 141 GB']) else 'no'} |"
        )
    return "\n".join(lines)
