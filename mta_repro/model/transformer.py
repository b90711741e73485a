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


# --------------------------------------------------------------------------- pieces
class RMSNorm(nn.Module):
    def __init__(
        self,
        dim: int,
        eps: float = 1e-5,
        cast_before_weight: bool = False,
        out_scale: float = 1.0,
        out_scale_fp64: float | None = None,
    ):
        super().__init__()
        self.eps = eps
        # A constant factor on the output (the release's ``curse_norm`` depth scaling);
        # out_scale_fp64 (if given) replaces it for fp64 inputs (``release_depth_scale``).
        self.out_scale = out_scale
        self.out_scale_fp64 = out_scale if out_scale_fp64 is None else out_scale_fp64
        # Rounding order in bf16/fp16 (``ModelArgs.norm_order``): True = normalise in fp32,
        # cast to x's dtype, then scale by the weight (the release's block norms and its
        # ``subln``); False = scale in fp32, then cast (Lingua's RMSNorm).
        self.cast_before_weight = cast_before_weight
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cast_before_weight:
            out = attention_ops.rms_norm(x, self.weight, self.eps)
        else:
            # Lingua: normalise in fp32 (fp64 stays fp64), scale by the weight, cast back.
            x32 = x.to(torch.promote_types(x.dtype, torch.float32))
            out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
            out = (out * self.weight.to(out.dtype)).type_as(x)
        scale = self.out_scale_fp64 if out.dtype == torch.float64 else self.out_scale
        return out if scale == 1.0 else out * scale

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


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


def release_depth_scale(layer_id: int, fp64: bool = False) -> float:
    """1 - lambda_init(layer) as the release computes it for ``curse_norm`` and
    ``layer_norm_rescale``: its RMSNorm holds layer_id as a tensor, so -0.3 * layer_id is
    a tensor of the default dtype before the exp: fp32 in every real run (an fp32 ulp
    apart from the exact value at some depths, which can flip a bf16 rounding); ``fp64``:
    the exact value (the release run with default dtype float64)."""
    if fp64:
        return 1 - (0.8 - 0.6 * math.exp(-0.3 * layer_id))
    x = float(torch.tensor(-0.3, dtype=torch.float32, device="cpu") * layer_id)  # also under a meta context
    return 1 - (0.8 - 0.6 * math.exp(x))


def _trunc_normal_(w: torch.Tensor, std: float, bound_std: float | None = None) -> None:
    """Truncated normal at +-3 x ``bound_std`` (default ``std``). Lingua truncates the
    output projections at 3 x the std *before* its depth factor divides it."""
    bound = 3 * (std if bound_std is None else bound_std)
    nn.init.trunc_normal_(w, mean=0.0, std=std, a=-bound, b=bound)


def _copy_into(param: torch.Tensor, value: torch.Tensor) -> None:
    """Copy a full CPU tensor into a parameter that may live on any device or be an
    FSDP-sharded DTensor (the release's inits only worked on DTensors)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        value = distribute_tensor(value.to(param.device, param.dtype), param.device_mesh, param.placements)
    param.copy_(value)


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
        _trunc_normal_(self.w1.weight, in_std)
        _trunc_normal_(self.w3.weight, in_std)
        _trunc_normal_(self.w2.weight, out_std)


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
class Attention(nn.Module):
    """Multi-head attention. ``kind`` (``ModelArgs.layer_kind``) picks the score path, a
    pure function of ``attention_ops``: "sdpa" -> ``sdpa``, "diff" -> ``diff_attention``,
    "kq_conv"/"mixing" -> ``explicit_attention`` (MTA, talking heads). Every optional
    parameter is declared here (None when the layer has none), under Lingua's and the
    release's names, so state dicts move between them."""

    lambda_q1: nn.Parameter | None
    lambda_k1: nn.Parameter | None
    lambda_q2: nn.Parameter | None
    lambda_k2: nn.Parameter | None

    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        m = args.mta
        self.kind = args.layer_kind(layer_id)
        self.model_dim = args.dim
        self.layer_id = layer_id
        self.n_heads = H = args.n_heads
        self.n_kv_heads = H_kv = args.resolved_n_kv_heads
        self.head_dim = d = args.resolved_head_dim
        # Lingua's init options: base std (None: dim**-0.5) and this depth's factor.
        self.init_std = args.init_base_std
        self.init_factor = args.init_std_factor_at(layer_id)
        self.dropout = args.dropout
        self.pad_key = m.pad_key
        self.init_method = m.init_method
        self.attn_impl = args.attn_impl
        self.attn_block_size = args.attn_block_size
        # What the score path runs on: the defaults, unless a caller hands this module others
        # (the memory pre-flight's meta stand-ins; see attention_ops.AttnKernels), under the
        # model's tuning (model.kernels).
        self.kernels = attention_ops.AttnKernels(tuning=args.kernels)
        self.wq = nn.Linear(args.dim, H * d, bias=False)
        self.wk = nn.Linear(args.dim, H_kv * d, bias=False)
        self.wv = nn.Linear(args.dim, H_kv * d, bias=False)
        self.wo = nn.Linear(H * d, args.dim, bias=False)

        def param(on: bool, *shape) -> nn.Parameter | None:
            return nn.Parameter(torch.empty(*shape)) if on else None

        # Differential Transformer: four d-sized vectors, shared by the H/2 diff heads.
        diff = self.kind == "diff"
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            self.register_parameter(name, param(diff, d))
        # Explicit path. Layers outside mta_layers ("mixing") keep only the head mixing.
        conv = self.kind == "kq_conv"
        explicit = conv or self.kind == "mixing"
        pre, post = (m.query_kernel_size, m.key_kernel_size), (m.after_sm_query_kernel_size, m.after_sm_key_kernel_size)
        self.mta_kernel = param(conv and pre[0] is not None, H, 1, *pre)  # (H, 1, c_q, c_k)
        self.mta_kernel_after_sm = param(conv and post[0] is not None, H, 1, *post)  # (H, 1, c_q', c_k')
        self.wpsm = nn.Linear(H, H, bias=False) if explicit and m.pre_sm_linear_head else None
        c_h = m.head_kernel_size
        self.head_kernel = param(explicit and c_h is not None, H // (c_h or 1), c_h, c_h)  # (G, c_h, c_h)
        self.wposm = nn.Linear(H, H, bias=False) if explicit and c_h is None and m.post_sm_linear_head else None
        # Output: per-head RMSNorm (diff: over 2d; MTA's group norm: over d), scaled by
        # 1 - lambda_init(layer) for diff and for ``layer_norm_rescale``, then the gate.
        # As in the release, group norm and gating apply in every layer when set.
        norm_dim = 2 * d if diff else d if m.group_norm else None
        self.subln = RMSNorm(norm_dim, eps=1e-5, cast_before_weight=True) if norm_dim else None
        rescale = diff or (m.group_norm and m.layer_norm_rescale)
        # diff: unilm's lambda_init (exact); MTA's depth scaling: the release's (fp32
        # exponent, except for fp64 outputs).
        self.out_scale = self.out_scale_fp64 = 1.0
        if diff:
            self.out_scale = self.out_scale_fp64 = 1 - attention_ops.lambda_init_fn(layer_id)
        elif rescale:
            self.out_scale, self.out_scale_fp64 = (
                release_depth_scale(layer_id),
                release_depth_scale(layer_id, fp64=True),
            )
        self.gate = nn.Linear(d, 1 if m.gate_1d else d, bias=True) if m.add_gating else None

    # -- parameters ------------------------------------------------------------------
    def explicit_params(self) -> attention_ops.ExplicitAttnParams:
        weight = lambda lin: None if lin is None else lin.weight  # noqa: E731
        return attention_ops.ExplicitAttnParams(
            mta_kernel=self.mta_kernel,
            wpsm=weight(self.wpsm),
            mta_kernel_after_sm=self.mta_kernel_after_sm,
            head_kernel=self.head_kernel,
            wposm=weight(self.wposm),
            pad_key=self.pad_key,
            dropout=self.dropout,
            block_size=self.attn_block_size,
            kq_backend=self.kernels.kq_backend,
            tuning=self.kernels.tuning,
        )

    def reset_parameters(self) -> None:
        std = self.init_std or self.model_dim**-0.5
        for w in (self.wq, self.wk, self.wv):
            _trunc_normal_(w.weight, std)
        _trunc_normal_(self.wo.weight, std / self.init_factor, bound_std=std)
        self.reset_mta_parameters()
        if self.kind == "diff":
            for p in (self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2):
                assert p is not None
                nn.init.normal_(p, mean=0.0, std=0.1)
            assert self.subln is not None
            self.subln.reset_parameters()

    def reset_mta_parameters(self) -> None:
        """(Re)initialise only the parts MTA adds (Appendix I inserts exactly these)."""
        with torch.no_grad():
            if self.mta_kernel is not None:
                _copy_into(self.mta_kernel, self._conv_init(self.mta_kernel.shape))
            if self.mta_kernel_after_sm is not None:
                # The release asserts an identity start for the post-softmax kernel,
                # whatever init_method says (init_method shapes the pre-softmax one).
                shape = self.mta_kernel_after_sm.shape
                _copy_into(
                    self.mta_kernel_after_sm,
                    attention_ops.identity_kq_kernel(shape[0], shape[2], shape[3], self.pad_key),
                )
            for lin in (self.wpsm, self.wposm):
                if lin is not None:
                    _copy_into(lin.weight, torch.eye(self.n_heads))
            if self.head_kernel is not None:
                g, c, _ = self.head_kernel.shape
                _copy_into(self.head_kernel, torch.eye(c).repeat(g, 1, 1))
            if self.subln is not None and self.kind != "diff":
                self.subln.reset_parameters()
            if self.gate is not None:
                std = self.init_std or self.model_dim**-0.5
                _trunc_normal_(self.gate.weight, std / self.init_factor, bound_std=std)
                # The release never initialises this bias (meta -> to_empty); 0 here.
                self.gate.bias.zero_()

    def _conv_init(self, shape) -> torch.Tensor:
        """A kernel per ``mta.init_method``, made on CPU and copied in (any device)."""
        n_heads, _, c_q, c_k = shape
        if self.init_method == "identity":
            return attention_ops.identity_kq_kernel(n_heads, c_q, c_k, self.pad_key)
        if self.init_method == "const":
            return torch.full(shape, 0.3)
        if self.init_method == "uniform":
            return torch.empty(shape).uniform_(-1.0, 1.0)
        if self.init_method == "normal":  # what the release meant: trunc-normal, std 0.3
            out = torch.empty(shape)
            _trunc_normal_(out, 0.3)
            return out
        # "diagonal": ones on the diagonal that ends at the centre key of the last row.
        return torch.ones(shape).tril((c_k + 1) // 2 - c_q).triu((c_k + 1) // 2 - c_q)

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

        if self.subln is not None:
            out = self.subln(out)
            scale = self.out_scale_fp64 if out.dtype == torch.float64 else self.out_scale
            if scale != 1.0:
                out = out * scale
        if self.gate is not None:
            out = out * torch.sigmoid(self.gate(out))
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
    ) -> torch.Tensor:
        """tokens (B, T) -> logits (B, T, vocab).

        cache: decoding state; the tokens continue at position ``cache.pos``.
        key_valid: (B, cache.pos + T) bool, False at padding (left-padded batches).
        return_hidden: return the final normed hidden states (B, T, dim) instead, so a
        loss can be computed in chunks without materialising all logits.
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
        return h if return_hidden else self._head(h)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final normed hidden states (..., dim) -> logits (..., vocab), called on its own
        (mta_repro.eval's ppl does it in chunks; FSDP gathers for it like for a forward)."""
        return self._head(h)

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        weight = self.tok_embeddings.weight if self.args.weight_tying else self.output.weight
        return F.linear(h, weight)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Lingua's init, seeded by ``args.seed`` (the same weights on every rank)."""
        gen_state = torch.random.get_rng_state()
        torch.manual_seed(self.args.seed)
        try:
            _trunc_normal_(self.tok_embeddings.weight, self.args.dim**-0.5)
            for layer in self.layers:
                cast(TransformerBlock, layer).reset_parameters()  # ModuleList's items are typed as Module
            self.norm.reset_parameters()
            if not self.args.weight_tying:
                _trunc_normal_(self.output.weight, self.args.dim**-0.5)
        finally:
            torch.random.set_rng_state(gen_state)
