"""``MultiTokenAttention``: the parameters MTA adds to an attention layer, and its forward.

The module owns exactly what the release's ``Attention`` adds for MTA, under the release's
names (``mta_kernel``, ``wpsm``, ``mta_kernel_after_sm``, ``head_kernel``, ``wposm``,
``subln``, ``gate``), initialised as the release does (identity kernels and mixings), so
its state dict loads into and from release and mta-repro checkpoints. The projections,
RoPE and any KV cache stay in the caller's model; ``forward(q, k, v)`` is
``multi_token_attention`` with these parameters.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from mta_repro.errors import UserError
from mta_repro.kernels.tuning import KernelTuning
from mta_repro.model.args import ModelArgs, MTAArgs
from mta_repro.model.transformer import Attention, RMSNorm
from mta_repro.mta.functional import SELFCHECK, multi_token_attention, query_history


class MultiTokenAttention(nn.Module):
    """MTA's parameters for one layer of ``n_heads`` query heads of size ``head_dim``.

    Options (the release's ``model.mta`` fields; docs/mta_op.md has the table):
    query_kernel_size / key_kernel_size (pre-softmax key-query convolution, c_q x c_k),
    after_sm_query_kernel_size / after_sm_key_kernel_size (after softmax), pad_key
    (both | left | right), pre_sm_linear_head (``wpsm``), head_kernel_size (post-softmax
    head convolution over groups of c_h heads) or post_sm_linear_head (``wposm``),
    group_norm (``subln``, with layer_norm_rescale: times 1 - lambda_init(layer_id)),
    add_gating with gate_1d (``gate``: Linear(head_dim, 1 or head_dim)), init_method
    (identity | const | uniform | diagonal | normal, for the pre-softmax kernel; every other
    part starts at identity, the gate's weight trunc-normal with std ``init_std`` (None:
    ``dim`` ** -0.5, ``dim`` the model's width, None: n_heads * head_dim) divided by
    ``init_factor``, its bias 0). dropout: on the probabilities in training mode.
    attn_impl, attn_block_size, kernels, selfcheck: how it computes (``multi_token_attention``).

    ``forward(q, k, v, attention_mask=None, q_offset=None)``: q (B, n_heads, Tq, head_dim),
    k and v (B, H_kv, Tk, head_dim) with H_kv dividing n_heads -> (B, n_heads, Tq, head_dim),
    before the output projection. ``query_history``: the earlier queries cached decoding
    passes before the new ones (``multi_token_attention`` explains).
    """

    def __init__(
        self,
        n_heads: int,
        head_dim: int,
        *,
        query_kernel_size: int | None = None,
        key_kernel_size: int | None = None,
        after_sm_query_kernel_size: int | None = None,
        after_sm_key_kernel_size: int | None = None,
        pad_key: str = "both",
        pre_sm_linear_head: bool = False,
        head_kernel_size: int | None = None,
        post_sm_linear_head: bool = False,
        group_norm: bool = False,
        layer_norm_rescale: bool = False,
        add_gating: bool = False,
        gate_1d: bool = True,
        init_method: str = "identity",
        layer_id: int = 0,
        dim: int | None = None,
        init_std: float | None = None,
        init_factor: float = 1.0,
        dropout: float = 0.0,
        attn_impl: str = "blocked",
        attn_block_size: int | None = None,
        kernels: KernelTuning | None = None,
        selfcheck: str | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        opts = dict(
            query_kernel_size=query_kernel_size,
            key_kernel_size=key_kernel_size,
            after_sm_query_kernel_size=after_sm_query_kernel_size,
            after_sm_key_kernel_size=after_sm_key_kernel_size,
            pad_key=pad_key,
            pre_sm_linear_head=pre_sm_linear_head,
            head_kernel_size=head_kernel_size,
            post_sm_linear_head=post_sm_linear_head,
            group_norm=group_norm,
            layer_norm_rescale=layer_norm_rescale,
            add_gating=add_gating,
            gate_1d=gate_1d,
            init_method=init_method,
        )
        self.args = validated_args(
            n_heads,
            head_dim,
            opts,
            dropout=dropout,
            attn_impl=attn_impl,
            attn_block_size=attn_block_size,
            kernels=kernels or KernelTuning(),
        )
        if selfcheck not in SELFCHECK:
            raise UserError(f"MultiTokenAttention: selfcheck={selfcheck!r}: expected warn, strict, off or None")
        if isinstance(layer_id, bool) or not isinstance(layer_id, int) or layer_id < 0:
            raise UserError(f"MultiTokenAttention: layer_id={layer_id!r}: expected a 0-based layer index")
        H, d = self.n_heads, self.head_dim = n_heads, head_dim
        self.layer_id, self.pad_key, self.init_method = layer_id, pad_key, init_method
        self.layer_norm_rescale = layer_norm_rescale
        self.model_dim = dim or H * d
        self.init_std, self.init_factor = init_std, init_factor
        self.dropout, self.selfcheck = dropout, selfcheck
        # "kq_conv" (key-query convolutions), "mixing" (head mixing only) or "sdpa" (neither).
        self.kind = (
            "kq_conv"
            if query_kernel_size or after_sm_query_kernel_size
            else ("mixing" if pre_sm_linear_head or post_sm_linear_head or head_kernel_size else "sdpa")
        )
        fk = {"device": device, "dtype": dtype}

        def param(on: bool, *shape) -> nn.Parameter | None:
            return nn.Parameter(torch.empty(*shape, **fk)) if on else None

        self.mta_kernel = param(query_kernel_size is not None, H, 1, query_kernel_size, key_kernel_size)
        self.wpsm = nn.Linear(H, H, bias=False, **fk) if pre_sm_linear_head else None
        self.mta_kernel_after_sm = param(
            after_sm_query_kernel_size is not None, H, 1, after_sm_query_kernel_size, after_sm_key_kernel_size
        )
        c_h = head_kernel_size
        self.head_kernel = param(c_h is not None, H // (c_h or 1), c_h, c_h)
        self.wposm = nn.Linear(H, H, bias=False, **fk) if post_sm_linear_head else None
        self.subln = RMSNorm(d, eps=1e-5, cast_before_weight=True) if group_norm else None
        if self.subln is not None and (device is not None or dtype is not None):
            self.subln.to(**{k: v for k, v in fk.items() if v is not None})
        self.gate = nn.Linear(d, 1 if gate_1d else d, bias=True, **fk) if add_gating else None
        if torch.device(device or torch.get_default_device()).type != "meta":
            self.reset_parameters()

    # The release's initialisation, shared with this project's attention layer (the same
    # attribute names): identity kernels and mixings, subln ones, the gate trunc-normal.
    reset_parameters = Attention.reset_mta_parameters
    _conv_init = Attention._conv_init

    @property
    def query_history(self) -> int:
        """Earlier queries a new query's output depends on (cached decoding keeps them)."""
        return query_history(self.mta_kernel, self.mta_kernel_after_sm)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        q_offset: int | None = None,
    ) -> torch.Tensor:
        weight = lambda lin: None if lin is None else lin.weight  # noqa: E731
        return multi_token_attention(
            q,
            k,
            v,
            mta_kernel=self.mta_kernel,
            wpsm=weight(self.wpsm),
            mta_kernel_after_sm=self.mta_kernel_after_sm,
            head_kernel=self.head_kernel,
            wposm=weight(self.wposm),
            pad_key=self.pad_key,
            subln_weight=weight(self.subln),
            layer_norm_rescale=self.layer_norm_rescale,
            layer_id=self.layer_id,
            eps=1e-5 if self.subln is None else self.subln.eps,
            gate_weight=weight(self.gate),
            gate_bias=None if self.gate is None else self.gate.bias,
            attention_mask=attention_mask,
            q_offset=q_offset,
            dropout_p=self.dropout if self.training else 0.0,
            attn_impl=self.args.attn_impl,
            attn_block_size=self.args.attn_block_size,
            kernels=self.args.kernels,
            selfcheck=self.selfcheck,
        )

    def extra_repr(self) -> str:
        m = self.args.mta
        parts = [f"n_heads={self.n_heads}, head_dim={self.head_dim}, layer_id={self.layer_id}"]
        if m.query_kernel_size:
            parts.append(f"kernel={m.query_kernel_size}x{m.key_kernel_size}")
        if m.after_sm_query_kernel_size:
            parts.append(f"after_sm_kernel={m.after_sm_query_kernel_size}x{m.after_sm_key_kernel_size}")
        if m.query_kernel_size or m.after_sm_query_kernel_size:
            parts.append(f"pad_key={m.pad_key}")
        return ", ".join(parts)


def validated_args(n_heads: int, head_dim: int, opts: dict, where: str = "MultiTokenAttention", **model) -> ModelArgs:
    """A one-layer ``ModelArgs`` with MTA options ``opts`` (``MTAArgs`` fields), checked by the
    project's config rules; an error names the option as the caller wrote it."""
    for name, value in (("n_heads", n_heads), ("head_dim", head_dim)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"{where}: {name}={value!r}: expected a positive integer")
    try:
        return ModelArgs(
            dim=n_heads * head_dim,
            n_layers=1,
            n_heads=n_heads,
            head_dim=head_dim,
            mta=MTAArgs(use_mta=True, **opts),
            **model,
        )
    except UserError as e:  # "model.mta.key_kernel_size=4: ..." -> "key_kernel_size=4: ..."
        raise UserError(f"{where}: " + re.sub(r"model\.(mta\.)?", "", str(e))) from None
    except TypeError as e:  # a field of the wrong type that the dataclass itself rejects
        raise UserError(f"{where}: {e}") from None
