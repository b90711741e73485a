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

from mta_repro.errors import UserError
from mta_repro.kernels.tuning import KernelTuning
from mta_repro.model import attention_ops
from mta_repro.model.args import MTAArgs
from mta_repro.model.mta_layer import MTALayer
from mta_repro.mta.functional import SELFCHECK, multi_token_attention, query_history


class MultiTokenAttention(MTALayer):
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
        opts = MTAArgs(
            use_mta=True,
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
        checked = validated_args(
            n_heads, head_dim, opts, dropout=dropout, attn_impl=attn_impl, attn_block_size=attn_block_size
        )
        self._build(
            checked,
            n_heads,
            head_dim,
            layer_id=layer_id,
            dim=dim,
            init_std=init_std,
            init_factor=init_factor,
            dropout=dropout,
            attn_impl=attn_impl,
            attn_block_size=attn_block_size,
            kernels=kernels,
            selfcheck=selfcheck,
            device=device,
            dtype=dtype,
        )

    @classmethod
    def from_checked(cls, options: MTAArgs, n_heads: int, head_dim: int, **layer) -> MultiTokenAttention:
        """A layer from ``options`` that ``validated_args`` already checked, with these heads and
        the same ``dropout``, ``attn_impl`` and ``attn_block_size`` (``layer``: the constructor's
        keywords after the options). For a caller that builds many layers from one set of
        options (``apply_mta``): the options are checked once, not once per layer."""
        self = cls.__new__(cls)
        MTALayer.__init__(self)
        self._build(options, n_heads, head_dim, **layer)
        return self

    def _build(
        self,
        m: MTAArgs,
        n_heads: int,
        head_dim: int,
        *,
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
    ) -> None:
        if selfcheck not in SELFCHECK:
            raise UserError(f"MultiTokenAttention: selfcheck={selfcheck!r}: expected warn, strict, off or None")
        if isinstance(layer_id, bool) or not isinstance(layer_id, int) or layer_id < 0:
            raise UserError(f"MultiTokenAttention: layer_id={layer_id!r}: expected a 0-based layer index")
        self.options = m
        self.layer_norm_rescale, self.selfcheck = m.layer_norm_rescale, selfcheck
        # "kq_conv" (key-query convolutions), "mixing" (head mixing only) or "sdpa" (neither).
        if m.query_kernel_size or m.after_sm_query_kernel_size:
            kind = "kq_conv"
        elif m.pre_sm_linear_head or m.post_sm_linear_head or m.head_kernel_size:
            kind = "mixing"
        else:
            kind = "sdpa"
        self.build_mta(
            m,
            n_heads,
            head_dim,
            kind,
            layer_id,
            model_dim=dim or n_heads * head_dim,
            init_std=init_std,
            init_factor=init_factor,
            dropout=dropout,
            attn_impl=attn_impl,
            attn_block_size=attn_block_size,
            tuning=kernels,
            device=device,
            dtype=dtype,
        )
        if torch.device(device or torch.get_default_device()).type != "meta":
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """The release's initialisation (``MTALayer.reset_mta_parameters``): identity kernels
        and mixings, subln ones, the gate trunc-normal, its bias 0."""
        self.reset_mta_parameters()

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
            kq_kernel=self.mta_kernel,
            pre_softmax_head_mixing=weight(self.wpsm),
            kq_kernel_after_softmax=self.mta_kernel_after_sm,
            head_kernel=self.head_kernel,
            post_softmax_head_mixing=weight(self.wposm),
            pad_key=self.pad_key,
            group_norm_weight=weight(self.subln),
            layer_norm_rescale=self.layer_norm_rescale,
            layer_id=self.layer_id,
            eps=1e-5 if self.subln is None else self.subln.eps,
            gate_weight=weight(self.gate),
            gate_bias=None if self.gate is None else self.gate.bias,
            attention_mask=attention_mask,
            q_offset=q_offset,
            dropout_p=self.dropout if self.training else 0.0,
            attn_impl=self.attn_impl,
            attn_block_size=self.attn_block_size,
            kernels=self.kernels.tuning,
            selfcheck=self.selfcheck,
        )

    def extra_repr(self) -> str:
        m = self.options
        parts = [f"n_heads={self.n_heads}, head_dim={self.head_dim}, layer_id={self.layer_id}"]
        if m.query_kernel_size:
            parts.append(f"kernel={m.query_kernel_size}x{m.key_kernel_size}")
        if m.after_sm_query_kernel_size:
            parts.append(f"after_sm_kernel={m.after_sm_query_kernel_size}x{m.after_sm_key_kernel_size}")
        if m.query_kernel_size or m.after_sm_query_kernel_size:
            parts.append(f"pad_key={m.pad_key}")
        return ", ".join(parts)


def validated_args(
    n_heads: int,
    head_dim: int,
    opts: dict | MTAArgs,
    where: str = "MultiTokenAttention",
    *,
    max_seqlen: int | None = 4096,
    dropout: float = 0.0,
    attn_impl: str = "blocked",
    attn_block_size: int | None = None,
) -> MTAArgs:
    """MTA options ``opts`` (``MTAArgs`` or its fields) checked for ``n_heads`` heads of size
    ``head_dim`` by ``MTAArgs.check``, with how the layer computes; an error names each option
    as the caller wrote it. ``max_seqlen``: the longest sequence (4096, ``ModelArgs``'
    default, bounds the kernels' sizes where the caller gives none)."""
    for name, value in (("n_heads", n_heads), ("head_dim", head_dim)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"{where}: {name}={value!r}: expected a positive integer")
    if not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise UserError(f"{where}: dropout={dropout!r}: expected 0 <= p < 1")
    if attn_block_size is not None and (
        isinstance(attn_block_size, bool) or not isinstance(attn_block_size, int) or attn_block_size < 1
    ):
        raise UserError(f"{where}: attn_block_size={attn_block_size!r}: expected a positive integer or None")
    try:
        mta = opts if isinstance(opts, MTAArgs) else MTAArgs(use_mta=True, **opts)
        mta.check(n_heads, max_seqlen=max_seqlen, prefix="")
        attention_ops.attn_impl(attn_impl)  # registered, or a declared one loaded
    except UserError as e:  # "model.attn_impl: unknown ..." -> "attn_impl: unknown ..."
        raise UserError(f"{where}: " + re.sub(r"^model\.", "", str(e))) from None
    except TypeError as e:  # an option of the wrong type, or one MTAArgs does not have
        raise UserError(f"{where}: {e}") from None
    return mta
