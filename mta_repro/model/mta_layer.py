"""The one core of Multi-Token Attention's parameters: ``MTALayer``.

What MTA adds to an attention layer (the key-query kernels ``mta_kernel`` and
``mta_kernel_after_sm``, the head mixings ``wpsm``, ``head_kernel`` and ``wposm``, the group
norm ``subln`` and the ``gate``), declared under the release's flat attribute names, their
initialisation (the release's: identity kernels and mixings, the gate trunc-normal) and
the ``ExplicitAttnParams`` the score path (``attention_ops``) runs on. The model's
``transformer.Attention`` and the public ``mta_repro.mta.MultiTokenAttention`` both inherit
it, so their state-dict keys are the release's (``layers.N.attention.mta_kernel``,
``.wpsm.weight``, ...) without any key map. The options are checked by
``MTAArgs.check`` (``args.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mta_repro.kernels.tuning import KernelTuning
from mta_repro.model import attention_ops
from mta_repro.model.args import ModelArgs, MTAArgs
from mta_repro.model.parts import RMSNorm, copy_into, release_depth_scale, trunc_normal_


def output_tail(
    out: torch.Tensor,
    norm_weight: torch.Tensor | None,
    eps: float,
    scale: float,
    gate_weight: torch.Tensor | None,
    gate_bias: torch.Tensor | None,
) -> torch.Tensor:
    """MTA's output tail, as the release applies it to the attention output: (..., dv) head
    outputs -> the same shape. Group norm (``norm_weight`` (dv,): an RMSNorm over each head's
    output in fp32, cast back, then times the weight; release order) times a constant
    ``scale`` (the depth scaling, 1.0: none), then the output gate O * sigmoid(O W^T + b)
    (``gate_weight`` (1, dv) or (dv, dv)). None switches a part off. The model, the op
    (``mta_repro.mta.multi_token_attention``) and the Hugging Face layers all end here;
    weights are used in the dtype given (the op casts them to its output's first)."""
    if norm_weight is not None:
        out = attention_ops.rms_norm(out, norm_weight, eps)
        if scale != 1.0:
            out = out * scale
    if gate_weight is not None:
        out = out * torch.sigmoid(F.linear(out, gate_weight, gate_bias))
    return out


def explicit_params(weights: dict, **options) -> attention_ops.ExplicitAttnParams:
    """The explicit path's parameters (``ExplicitAttnParams``) from the score-path weights by
    their release names (``attention_ops.WEIGHT_FIELDS``; a missing one is None) and the
    options (pad_key, dropout, block_size, kq_backend, tuning). The model's layers and the
    op both build them here."""
    unknown = set(weights) - set(attention_ops.WEIGHT_FIELDS)
    assert not unknown, unknown
    return attention_ops.ExplicitAttnParams(**{f: weights.get(f) for f in attention_ops.WEIGHT_FIELDS}, **options)


class MTALayer(nn.Module):
    """Base of an attention layer with MTA's parameters (each None where switched off).

    ``build_mta`` declares them for a layer of ``kind`` (``ModelArgs.layer_kind``: "kq_conv"
    has the key-query kernels, "kq_conv" and "mixing" the head mixings; "diff" has the
    Differential Transformer's norm over 2 x head_dim) and the attributes the score path
    reads; ``reset_mta_parameters`` initialises them; ``explicit_params`` hands them over.
    """

    mta_kernel: nn.Parameter | None
    mta_kernel_after_sm: nn.Parameter | None
    head_kernel: nn.Parameter | None

    def build_mta(
        self,
        m: MTAArgs,
        n_heads: int,
        head_dim: int,
        kind: str,
        layer_id: int,
        *,
        model_dim: int,
        init_std: float | None = None,
        init_factor: float = 1.0,
        dropout: float = 0.0,
        attn_impl: str = "blocked",
        attn_block_size: int | None = None,
        tuning: KernelTuning | None = None,
        device=None,
        dtype=None,
    ) -> None:
        """Declare MTA's parameters (uninitialised) and the options the layer computes with.
        ``init_std`` (None: ``model_dim`` ** -0.5) and ``init_factor``: Lingua's gate init."""
        H, d = self.n_heads, self.head_dim = n_heads, head_dim
        self.kind, self.layer_id, self.model_dim = kind, layer_id, model_dim
        self.pad_key, self.init_method = m.pad_key, m.init_method
        self.init_std, self.init_factor = init_std, init_factor
        self.dropout, self.attn_impl, self.attn_block_size = dropout, attn_impl, attn_block_size
        # What the score path runs on: the defaults, unless a caller hands this module others
        # (the memory pre-flight's meta stand-ins; see attention_ops.AttnKernels), under the
        # model's tuning (model.kernels).
        self.kernels = attention_ops.AttnKernels(tuning=tuning or KernelTuning())
        fk = {"device": device, "dtype": dtype}

        def param(on: bool, *shape) -> nn.Parameter | None:
            return nn.Parameter(torch.empty(*shape, **fk)) if on else None

        # Explicit path. Layers outside mta_layers ("mixing") keep only the head mixing.
        conv = kind == "kq_conv"
        explicit = conv or kind == "mixing"
        pre, post = (m.query_kernel_size, m.key_kernel_size), (m.after_sm_query_kernel_size, m.after_sm_key_kernel_size)
        self.mta_kernel = param(conv and pre[0] is not None, H, 1, *pre)  # (H, 1, c_q, c_k)
        self.mta_kernel_after_sm = param(conv and post[0] is not None, H, 1, *post)  # (H, 1, c_q', c_k')
        self.wpsm = nn.Linear(H, H, bias=False, **fk) if explicit and m.pre_sm_linear_head else None
        c_h = m.head_kernel_size
        self.head_kernel = param(explicit and c_h is not None, H // (c_h or 1), c_h, c_h)  # (G, c_h, c_h)
        post_linear = explicit and c_h is None and m.post_sm_linear_head
        self.wposm = nn.Linear(H, H, bias=False, **fk) if post_linear else None
        # Output: per-head RMSNorm (diff: over 2d; MTA's group norm: over d), scaled by
        # 1 - lambda_init(layer) for diff and for ``layer_norm_rescale``, then the gate.
        # As in the release, group norm and gating apply in every layer when set.
        diff = kind == "diff"
        norm_dim = 2 * d if diff else d if m.group_norm else None
        self.subln = RMSNorm(norm_dim, eps=1e-5, cast_before_weight=True) if norm_dim else None
        if self.subln is not None and (device is not None or dtype is not None):
            self.subln.to(**{k: v for k, v in fk.items() if v is not None})
        # diff: unilm's lambda_init (exact); MTA's depth scaling: the release's (fp32
        # exponent, except for fp64 outputs).
        self.out_scale = self.out_scale_fp64 = 1.0
        if diff:
            self.out_scale = self.out_scale_fp64 = 1 - attention_ops.lambda_init_fn(layer_id)
        elif m.group_norm and m.layer_norm_rescale:
            self.out_scale = release_depth_scale(layer_id)
            self.out_scale_fp64 = release_depth_scale(layer_id, fp64=True)
        self.gate = nn.Linear(d, 1 if m.gate_1d else d, bias=True, **fk) if m.add_gating else None

    def explicit_params(self) -> attention_ops.ExplicitAttnParams:
        """The score-path parameters and options of this layer, for ``attention_ops``."""
        weight = lambda lin: None if lin is None else lin.weight  # noqa: E731
        weights = dict(
            mta_kernel=self.mta_kernel,
            wpsm=weight(self.wpsm),
            mta_kernel_after_sm=self.mta_kernel_after_sm,
            head_kernel=self.head_kernel,
            wposm=weight(self.wposm),
        )
        return explicit_params(
            weights,
            pad_key=self.pad_key,
            dropout=self.dropout,
            block_size=self.attn_block_size,
            kq_backend=self.kernels.kq_backend,
            tuning=self.kernels.tuning,
        )

    def reset_mta_parameters(self) -> None:
        """(Re)initialise only the parts MTA adds (Appendix I inserts exactly these)."""
        with torch.no_grad():
            if self.mta_kernel is not None:
                copy_into(self.mta_kernel, self._conv_init(self.mta_kernel.shape))
            if self.mta_kernel_after_sm is not None:
                # The release asserts an identity start for the post-softmax kernel,
                # whatever init_method says (init_method shapes the pre-softmax one).
                shape = self.mta_kernel_after_sm.shape
                copy_into(
                    self.mta_kernel_after_sm,
                    attention_ops.identity_kq_kernel(shape[0], shape[2], shape[3], self.pad_key),
                )
            for lin in (self.wpsm, self.wposm):
                if lin is not None:
                    copy_into(lin.weight, torch.eye(self.n_heads))
            if self.head_kernel is not None:
                g, c, _ = self.head_kernel.shape
                copy_into(self.head_kernel, torch.eye(c).repeat(g, 1, 1))
            if self.subln is not None and self.kind != "diff":
                self.subln.reset_parameters()
            if self.gate is not None:
                std = self.init_std or self.model_dim**-0.5
                trunc_normal_(self.gate.weight, std / self.init_factor, bound_std=std)
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
            trunc_normal_(out, 0.3)
            return out
        # "diagonal": ones on the diagonal that ends at the centre key of the last row.
        return torch.ones(shape).tril((c_k + 1) // 2 - c_q).triu((c_k + 1) // 2 - c_q)


def one_layer_args(n_heads: int, head_dim: int, mta: MTAArgs, **model) -> ModelArgs:
    """A one-layer ``ModelArgs`` around MTA options: what ``selfcheck.decide`` checks an
    implementation on for a layer that is not part of one of this project's models."""
    return ModelArgs(dim=n_heads * head_dim, n_layers=1, n_heads=n_heads, head_dim=head_dim, mta=mta, **model)
