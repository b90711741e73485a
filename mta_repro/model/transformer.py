"""The LLaMA-style decoder and its four attention variants, in one file.

Variants (``ModelArgs``): the SDPA baseline; the Differential Transformer
(``diff_transformer``); Talking heads and Multi-Token Attention (``mta.use_mta``, which
runs the explicit path of ``attention_ops``). Parameter names are Lingua's and the release's,
so state dicts move between the two. Nothing here knows about training: parallelism,
compile and checkpointing are applied from outside (``mta_repro.train``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from mta_repro.model import attention_ops
from mta_repro.model.args import ModelArgs
from mta_repro.model.mta_layer import MTALayer, output_tail
from mta_repro.model.parts import RMSNorm, release_depth_scale, trunc_normal_


# --------------------------------------------------------------------------- pieces
def rope_inv_freq(head_dim: int, theta: float, scaling=None, device=None, dtype=torch.float32) -> torch.Tensor:
    """(head_dim/2,) RoPE frequencies theta^(-2i/d); with ``scaling`` (RopeScalingArgs),
    Llama 3's: as Meta's reference ``apply_scaling`` (llama-models, Llama 3.1), a
    frequency whose wavelength 2*pi/f is below L/high_freq_factor (L =
    original_max_position_embeddings) stays, one above L/low_freq_factor becomes f/factor,
    and between them f' = (1 - s) f/factor + s f with s = (L/wavelength - low) / (high - low)."""
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=dtype) / head_dim
    inv = 1.0 / (theta**exponents)
    if scaling is None or scaling.rope_type == "default":
        return inv
    low, high, factor = scaling.low_freq_factor, scaling.high_freq_factor, scaling.factor
    old_len = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_len / low, inv / factor, (1 - smooth) * inv / factor + smooth * inv)
    return torch.where(wavelen < old_len / high, inv, scaled)


def rope_cos_sin(head_dim: int, positions: torch.Tensor, theta: float, dtype=torch.float32, scaling=None):
    """cos/sin tables (T, head_dim/2) for the interleaved-pair RoPE (Lingua's frequencies,
    Llama 3's with ``scaling``)."""
    inv = rope_inv_freq(head_dim, theta, scaling, positions.device, dtype)
    angles = torch.outer(positions.to(dtype), inv)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate dimension pairs (2i, 2i+1) together, in fp32 (fp64 for fp64 x). x: (B, T, H, d)."""
    ct = torch.promote_types(x.dtype, torch.float32)
    cos, sin = cos.to(ct), sin.to(ct)
    xf = x.to(ct).unflatten(-1, (-1, 2))  # (B, T, H, d/2, 2)
    x0, x1 = xf[..., 0], xf[..., 1]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).type_as(x)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, init_std: float | None = None, init_factor: float = 1.0):
        super().__init__()
        self.dim, self.hidden_dim = dim, hidden_dim
        # Lingua's init_base_std (None: dim**-0.5 in, hidden**-0.5 out) and depth factor.
        self.init_std, self.init_factor = init_std, init_factor
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def reset_parameters(self) -> None:
        in_std = self.init_std or self.dim**-0.5
        out_std = (self.init_std or self.hidden_dim**-0.5) / self.init_factor
        trunc_normal_(self.w1.weight, in_std)
        trunc_normal_(self.w3.weight, in_std)
        trunc_normal_(self.w2.weight, out_std)


# ----------------------------------------------------------------------- KV cache
@dataclass
class LayerCache:
    # Only the n_kv_heads K/V heads are kept (grouped-query attention repeats them per
    # query head after the cache, as the release does).
    k: torch.Tensor | None = None  # (B, H_kv, Tk, d) rotated keys so far
    v: torch.Tensor | None = None  # (B, H_kv, Tk, dv)
    q: torch.Tensor | None = None  # (B, H, W, d) last W rotated queries (MTA convs)


@dataclass
class KVCache:
    """Decoding state for every layer. ``pos`` = tokens already consumed."""

    layers: list = field(default_factory=list)
    pos: int = 0

    @classmethod
    def empty(cls, n_layers: int) -> KVCache:
        return cls(layers=[LayerCache() for _ in range(n_layers)])


def _append(old: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    return new if old is None else torch.cat([old, new], dim=2)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, H_kv, T, d) -> (B, H_kv * n_rep, T, d), head h of the output being head
    h // n_rep of x (Lingua's ``repeat_kv``, i.e. ``repeat_interleave`` over heads)."""
    if n_rep == 1:
        return x
    b, h_kv, t, d = x.shape
    return x[:, :, None].expand(b, h_kv, n_rep, t, d).reshape(b, h_kv * n_rep, t, d)


# ---------------------------------------------------------------------- attention
class Attention(MTALayer):
    """Multi-head attention. ``kind`` (``ModelArgs.layer_kind``) picks the score path, a
    pure function of ``attention_ops``: "sdpa" -> ``sdpa``, "diff" -> ``diff_attention``,
    "kq_conv"/"mixing" -> ``explicit_attention`` (MTA, talking heads). Every optional
    parameter is declared here or in the MTA core (``MTALayer``; None when the layer has
    none), under Lingua's and the release's names, so state dicts move between them."""

    lambda_q1: nn.Parameter | None
    lambda_k1: nn.Parameter | None
    lambda_q2: nn.Parameter | None
    lambda_k2: nn.Parameter | None

    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        self.n_kv_heads = H_kv = args.resolved_n_kv_heads
        H, d = args.n_heads, args.resolved_head_dim
        self.wq = nn.Linear(args.dim, H * d, bias=False)
        self.wk = nn.Linear(args.dim, H_kv * d, bias=False)
        self.wv = nn.Linear(args.dim, H_kv * d, bias=False)
        self.wo = nn.Linear(H * d, args.dim, bias=False)
        # Differential Transformer: four d-sized vectors, shared by the H/2 diff heads.
        kind = args.layer_kind(layer_id)
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            self.register_parameter(name, nn.Parameter(torch.empty(d)) if kind == "diff" else None)
        # Lingua's init options: base std (None: dim**-0.5) and this depth's factor.
        self.build_mta(
            args.mta,
            H,
            d,
            kind,
            layer_id,
            model_dim=args.dim,
            init_std=args.init_base_std,
            init_factor=args.init_std_factor_at(layer_id),
            dropout=args.dropout,
            attn_impl=args.attn_impl,
            attn_block_size=args.attn_block_size,
            tuning=args.kernels,
        )

    # -- parameters ------------------------------------------------------------------
    def reset_parameters(self) -> None:
        std = self.init_std or self.model_dim**-0.5
        for w in (self.wq, self.wk, self.wv):
            trunc_normal_(w.weight, std)
        trunc_normal_(self.wo.weight, std / self.init_factor, bound_std=std)
        self.reset_mta_parameters()
        if self.kind == "diff":
            for p in (self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2):
                assert p is not None
                nn.init.normal_(p, mean=0.0, std=0.1)
            assert self.subln is not None
            self.subln.reset_parameters()

    # -- forward ---------------------------------------------------------------------
    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: LayerCache | None = None,
        key_valid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x: (B, T, dim) -> (B, T, dim). cos/sin: (T, d/2) for these T positions."""
        bsz, seqlen, _ = x.shape
        H, H_kv, d = self.n_heads, self.n_kv_heads, self.head_dim
        q = apply_rope(self.wq(x).view(bsz, seqlen, H, d), cos, sin).transpose(1, 2)
        k = apply_rope(self.wk(x).view(bsz, seqlen, H_kv, d), cos, sin).transpose(1, 2)
        v = self.wv(x).view(bsz, seqlen, H_kv, d).transpose(1, 2)  # (B, H_kv, T, d)

        q_offset = 0
        if cache is not None:
            q_offset = 0 if cache.k is None else cache.k.shape[2]
            cache.k, cache.v = _append(cache.k, k), _append(cache.v, v)
            k, v = cache.k, cache.v  # (B, H_kv, Tk, d): every key so far
        # Grouped-query attention: every implementation and MTA step sees H heads.
        k = repeat_kv(k, H // H_kv)  # (B, H, Tk, d)
        if self.kind == "diff" and H_kv != H:
            # Diff heads take values of size 2d (heads 2i, 2i+1): repeat those pairs.
            b_, _, tk, _ = v.shape
            v = repeat_kv(v.reshape(b_, H_kv // 2, 2, tk * d), H // H_kv).reshape(b_, H, tk, d)
        else:
            v = repeat_kv(v, H // H_kv)

        mask = attention_ops.AttnMask(q_offset, key_valid)
        dropout = self.dropout if self.training else 0.0
        if self.kind == "sdpa":
            out = attention_ops.sdpa(q, k, v, mask, dropout, self.kernels.sdpa)
        elif self.kind == "diff":
            out = attention_ops.diff_attention(q, k, v, self._diff_lambda(q.dtype), mask, dropout, self.kernels.sdpa)
        else:
            out = self._explicit(q, k, v, mask, cache)
        out = out.transpose(1, 2)  # (B, T, heads, head size): H x d, or H/2 x 2d for diff

        if self.subln is not None or self.gate is not None:
            scale = self.out_scale_fp64 if out.dtype == torch.float64 else self.out_scale
            out = output_tail(
                out,
                None if self.subln is None else self.subln.weight,
                1e-5 if self.subln is None else self.subln.eps,
                scale,
                None if self.gate is None else self.gate.weight,
                None if self.gate is None else self.gate.bias,
            )
        return self.wo(out.reshape(bsz, seqlen, H * d))

    def _diff_lambda(self, dtype: torch.dtype) -> torch.Tensor:
        """lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init, in fp32 as in unilm."""
        ct = torch.promote_types(dtype, torch.float32)
        q1, k1, q2, k2 = self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2
        assert q1 is not None and k1 is not None and q2 is not None and k2 is not None
        lam = (
            torch.exp(torch.sum(q1 * k1).to(ct))
            - torch.exp(torch.sum(q2 * k2).to(ct))
            + attention_ops.lambda_init_fn(self.layer_id)
        )
        return lam.to(dtype)

    def _explicit(self, q, k, v, mask: attention_ops.AttnMask, cache: LayerCache | None):
        params = self.explicit_params()
        w = attention_ops.query_history(params)
        if cache is None or w == 0:
            return attention_ops.explicit_attention(
                self.attn_impl, q, k, v, params, mask, self.training, self.kernels.impls
            )
        # Cached MTA decoding: the query-direction convolutions read the score rows of
        # the last w queries, so recompute those rows too and keep only the new ones.
        new = q.shape[2]
        q = _append(cache.q, q)  # (B, H, <= w + new, d)
        cache.q = q[:, :, -w:]
        mask = attention_ops.AttnMask(mask.q_offset + new - q.shape[2], mask.key_valid)
        return attention_ops.explicit_attention(
            self.attn_impl, q, k, v, params, mask, self.training, self.kernels.impls
        )[:, :, -new:]


# -------------------------------------------------------------------------- model
class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        self.attention = Attention(args, layer_id)
        self.feed_forward = FeedForward(
            args.dim, args.ffn_hidden_dim, args.init_base_std, args.init_std_factor_at(layer_id)
        )
        scale = scale64 = 1.0
        if args.mta.curse_norm:
            scale, scale64 = release_depth_scale(layer_id), release_depth_scale(layer_id, fp64=True)
        # The release's block norms cast before the weight (ModelArgs.norm_order).
        cast = args.norm_order in ("release", "hf")
        self.attention_norm = RMSNorm(args.dim, args.norm_eps, cast, scale, scale64)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps, cast, scale, scale64)

    def forward(self, x, cos, sin, cache=None, key_valid=None):
        h = x + self.attention(self.attention_norm(x), cos, sin, cache, key_valid)
        return h + self.feed_forward(self.ffn_norm(h))

    def reset_parameters(self) -> None:
        self.attention.reset_parameters()
        self.feed_forward.reset_parameters()
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args, i) for i in range(args.n_layers))
        # The release's final norm is Lingua's (weight in fp32, then cast).
        self.norm = RMSNorm(args.dim, args.norm_eps, cast_before_weight=args.norm_order == "hf")
        if not args.weight_tying:
            self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(
        self,
        tokens: torch.Tensor,
        cache: KVCache | None = None,
        key_valid: torch.Tensor | None = None,
        return_hidden: bool = False,
        targets: torch.Tensor | None = None,
        loss_chunk: int = 0,
    ) -> torch.Tensor:
        """tokens (B, T) -> logits (B, T, vocab).

        cache: decoding state; the tokens continue at position ``cache.pos``.
        key_valid: (B, cache.pos + T) bool, False at padding (left-padded batches).
        return_hidden: return the final normed hidden states (B, T, dim) instead, so a
        loss can be computed in chunks without materialising all logits.
        targets (B, T) with loss_chunk > 0: the mean cross entropy instead, in chunks of
        loss_chunk token rows (``mta_repro.model.loss``, trainer.loss_chunk); inside forward
        so that FSDP2 holds the output weight gathered as it does for the logits.
        """
        start = cache.pos if cache is not None else 0
        positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)
        h = self.tok_embeddings(tokens)
        rope_dtype = torch.promote_types(h.dtype, torch.float32)
        cos, sin = rope_cos_sin(
            self.args.resolved_head_dim, positions, self.args.rope_theta, rope_dtype, self.args.rope_scaling
        )
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, cache.layers[i] if cache is not None else None, key_valid)
        if cache is not None:
            cache.pos += tokens.shape[1]
        h = self.norm(h)
        # Not through self.logits: under FSDP2 that is a registered forward method, and a
        # call to it nested in this forward reshards the root's parameters when it returns
        # (torch 2.11: backward then reads the final norm's freed
        # weight, a segfault on CPU; scripts/check_versions.sh with TORCH_VERSION=2.11.0).
        if targets is not None and loss_chunk > 0:
            from mta_repro.model.loss import chunked_linear_cross_entropy

            return chunked_linear_cross_entropy(h.flatten(0, 1), self.head_weight(), targets.flatten(0, 1), loss_chunk)
        return h if return_hidden else self._head(h)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final normed hidden states (..., dim) -> logits (..., vocab), called on its own
        (mta_repro.eval's ppl does it in chunks; FSDP gathers for it like for a forward)."""
        return self._head(h)

    def head_weight(self) -> torch.Tensor:
        """The output projection's weight (V, dim): the embeddings' when tied."""
        return self.tok_embeddings.weight if self.args.weight_tying else self.output.weight

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.head_weight())

    @torch.no_grad()
    def init_weights(self) -> None:
        """Lingua's init, seeded by ``args.seed`` (the same weights on every rank)."""
        gen_state = torch.random.get_rng_state()
        torch.manual_seed(self.args.seed)
        try:
            trunc_normal_(self.tok_embeddings.weight, self.args.dim**-0.5)
            for layer in self.layers:
                cast(TransformerBlock, layer).reset_parameters()  # ModuleList's items are typed as Module
            self.norm.reset_parameters()
            if not self.args.weight_tying:
                trunc_normal_(self.output.weight, self.args.dim**-0.5)
        finally:
            torch.random.set_rng_state(gen_state)
