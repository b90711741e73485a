"""``multi_token_attention``: the whole of MTA as one function on query, key and value tensors.

The score path is this project's (``mta_repro.model.attention_ops``): the registry picks the
implementation (``blocked`` by default: query blocks recomputed in backward, so nothing
T x T is kept for it; the key-query convolutions in the C kernel on CPU and in Triton on
CUDA; a declared one such as ``triton`` loaded through its entry point), checks it against
float64 only when asked (``selfcheck``) and falls back where it cannot run. Group norm
and gating follow as in the release's attention layer. Projections, RoPE and the KV cache
stay with the caller.
"""

from __future__ import annotations

import warnings

import torch

from mta_repro.errors import UserError
from mta_repro.kernels.interface import AttnMask, ExplicitAttnParams
from mta_repro.kernels.tuning import DEFAULT_TUNING, KernelTuning
from mta_repro.model import attention_ops
from mta_repro.model.mta_layer import explicit_params, output_tail
from mta_repro.model.transformer import release_depth_scale, repeat_kv

PAD_KEYS = ("both", "left", "right")
SELFCHECK = (None, "off", "warn", "strict")


def multi_token_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    kq_kernel: torch.Tensor | None = None,
    pre_softmax_head_mixing: torch.Tensor | None = None,
    kq_kernel_after_softmax: torch.Tensor | None = None,
    head_kernel: torch.Tensor | None = None,
    post_softmax_head_mixing: torch.Tensor | None = None,
    pad_key: str = "both",
    group_norm_weight: torch.Tensor | None = None,
    layer_norm_rescale: bool = False,
    layer_id: int = 0,
    eps: float = 1e-5,
    gate_weight: torch.Tensor | None = None,
    gate_bias: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    q_offset: int | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
    attn_impl: str = "blocked",
    attn_block_size: int | None = None,
    kernels: KernelTuning | None = None,
    selfcheck: str | None = None,
    **release_names: torch.Tensor | None,
) -> torch.Tensor:
    """Causal Multi-Token Attention (paper section 3; the release's ``Attention`` after RoPE).

    Shapes (B batch, H query heads, H_kv key/value heads dividing H, Tq queries, Tk keys,
    d head size, dv value head size):

    - q: (B, H, Tq, d); k: (B, H_kv, Tk, d); v: (B, H_kv, Tk, dv); one floating dtype,
      one device. K/V heads are repeated to H after any cache, head h reading K/V head
      h // (H / H_kv), as the release does (grouped-query attention); every weight is per
      query head. Returns (B, H, Tq, dv) in q's dtype (softmax in float32 or wider).
    - Query row i sits at absolute position ``q_offset + i``, key j at j; a query sees the
      keys at or before its position. ``q_offset`` None: Tk - Tq (the queries are the last
      positions: a prefill with Tq = Tk, or cached decoding). For cached decoding, pass the
      last ``query_history(...)`` earlier queries before the new ones (the convolutions read
      their score rows) and keep the last rows of the output.
    - attention_mask: (B, Tk), True/1 at real tokens, False/0 at padding (Hugging Face's
      2-D convention); a padded query row gives zeros. None: no padding.

    Weights (None switches the part off; any float dtype, cast to q's; in brackets the
    release's parameter name, which ``MultiTokenAttention`` keeps and which this function
    still takes, deprecated, with a DeprecationWarning, throughout 0.1.x; version 0.2.0
    (``RELEASE_NAMES_REMOVED_IN``) removes these keywords):

    - kq_kernel (H, 1, c_q, c_k) [mta_kernel]: key-query convolution before softmax; query
      rows look back only (row i reads rows i-c_q+1..i); the key window per ``pad_key``:
      "both" centred (c_k odd), "left" keys j-c_k+1..j, "right" keys j..j+c_k-1.
    - pre_softmax_head_mixing (H, H) [wpsm]: head mixing before softmax (nn.Linear's
      output-major convention).
    - kq_kernel_after_softmax (H, 1, c_q', c_k') [mta_kernel_after_sm]: key-query
      convolution after softmax, no renormalisation.
    - head_kernel (H / c_h, c_h, c_h): post-softmax convolution over groups of c_h
      contiguous heads (input-major, as the release); or post_softmax_head_mixing (H, H)
      [wposm], full mixing.
    - group_norm_weight (dv,) [subln_weight]: group norm, an RMSNorm over each head's output
      (``eps``), times 1 - lambda_init(``layer_id``) with ``layer_norm_rescale`` (the
      release's depth scaling).
    - gate_weight (1, dv) or (dv, dv) and gate_bias: output gate O * sigmoid(O W^T + b).

    ``dropout_p``: on the attention probabilities (pass 0 in evaluation). ``scale``: the
    score scale (None: d ** -0.5). ``attn_impl`` (a name of ``attention_ops.ATTN_IMPLS``:
    blocked, torch, ...), ``attn_block_size`` and ``kernels`` are the ``model.attn_impl``,
    ``model.attn_block_size`` and ``model.kernels`` settings of this project's configs.
    ``selfcheck``: None or "off" (the default) runs the implementation as asked; "warn"
    checks it against float64 on this device and dtype once per process and shape of
    options, falling back with a warning where it fails; "strict" raises instead.
    A wrong shape or option raises ``mta_repro.errors.UserError`` (a ValueError), one line.
    """
    where = "multi_token_attention"
    weights = dict(
        kq_kernel=kq_kernel,
        pre_softmax_head_mixing=pre_softmax_head_mixing,
        kq_kernel_after_softmax=kq_kernel_after_softmax,
        head_kernel=head_kernel,
        post_softmax_head_mixing=post_softmax_head_mixing,
        group_norm_weight=group_norm_weight,
    )
    weights = _renamed(where, weights, release_names)
    subln_weight = weights.pop("group_norm_weight")
    B, H, Tq, d, Tk, dv = _check_qkv(where, q, k, v)
    _check_weights(where, weights, H, pad_key)
    _check_output_weights(where, dv, subln_weight, layer_norm_rescale, gate_weight, gate_bias)
    others = {**weights, "group_norm_weight": subln_weight, "gate_weight": gate_weight, "gate_bias": gate_bias}
    for name, t in others.items():
        if t is not None and t.device != q.device:
            raise UserError(f"{where}: {name} is on {t.device}, q on {q.device}: pass every tensor on one device")
    key_valid = _check_mask(where, attention_mask, B, Tk, q.device)
    q_offset = Tk - Tq if q_offset is None else q_offset
    if isinstance(q_offset, bool) or not isinstance(q_offset, int) or not 0 <= q_offset <= Tk - Tq:
        raise UserError(
            f"{where}: q_offset={q_offset!r}: expected an integer in [0, Tk - Tq] = [0, {Tk - Tq}] "
            "(the first query's position; None: Tk - Tq)"
        )
    if not 0.0 <= dropout_p < 1.0:
        raise UserError(f"{where}: dropout_p={dropout_p!r}: expected 0 <= p < 1")
    if selfcheck not in SELFCHECK:
        raise UserError(f"{where}: selfcheck={selfcheck!r}: expected warn, strict, off or None")
    try:  # registered, or declared through the entry points and loaded now
        attention_ops.attn_impl(attn_impl)
    except UserError as e:
        raise UserError(f"{where}: " + str(e).removeprefix("model.")) from None
    if attn_block_size is not None and (
        isinstance(attn_block_size, bool) or not isinstance(attn_block_size, int) or attn_block_size < 1
    ):
        raise UserError(f"{where}: attn_block_size={attn_block_size!r}: expected a positive integer or None")

    if scale is not None:
        q = q * (scale * d**0.5)  # the score path scales by d ** -0.5
    k, v = repeat_kv(k, H // k.shape[1]), repeat_kv(v, H // v.shape[1])
    mask = AttnMask(q_offset, key_valid)
    if all(w is None for w in weights.values()):
        out = attention_ops.sdpa(q, k, v, mask, dropout_p)  # plain attention: the fused kernel
    elif Tq == 0:
        # No query: an empty result, as B = 0 gives (the convolutions have no rows to read).
        # The sum of an empty q is exactly 0; adding it keeps the result in q's graph.
        out = q.new_zeros((B, H, 0, dv)) + q.sum()
    else:
        release = {new: old for old, new in RELEASE_NAMES.items()}
        params = explicit_params(
            {release.get(name, name): w for name, w in weights.items()},
            pad_key=pad_key,
            dropout=dropout_p,
            block_size=attn_block_size,
            tuning=kernels or DEFAULT_TUNING,
        )
        attn_impl, params = _checked_impl(attn_impl, q, params, selfcheck)
        out = attention_ops.explicit_attention(attn_impl, q, k, v, params, mask, training=dropout_p > 0.0)
    cast = lambda t: None if t is None else t.to(out.dtype)  # noqa: E731
    scale = release_depth_scale(layer_id, fp64=out.dtype == torch.float64) if layer_norm_rescale else 1.0
    return output_tail(out, cast(subln_weight), eps, scale, cast(gate_weight), cast(gate_bias))


def query_history(
    kq_kernel: torch.Tensor | None = None,
    kq_kernel_after_softmax: torch.Tensor | None = None,
    **release_names: torch.Tensor | None,
) -> int:
    """How many earlier queries a new query's output depends on: (c_q - 1) + (c_q' - 1).
    Cached decoding keeps that many queries and passes them before the new ones."""
    given = dict(kq_kernel=kq_kernel, kq_kernel_after_softmax=kq_kernel_after_softmax)
    w = _renamed("query_history", given, release_names)
    return attention_ops.query_history(
        explicit_params({"mta_kernel": w["kq_kernel"], "mta_kernel_after_sm": w["kq_kernel_after_softmax"]})
    )


# The release's parameter names, still taken as keywords (deprecated): {old: new}. They stay
# for 0.1.x with their warning and go in this version (tests/test_mta_op.py fails once the
# package's version reaches it while they are still taken).
RELEASE_NAMES_REMOVED_IN = "0.2.0"
RELEASE_NAMES = {
    "mta_kernel": "kq_kernel",
    "wpsm": "pre_softmax_head_mixing",
    "mta_kernel_after_sm": "kq_kernel_after_softmax",
    "wposm": "post_softmax_head_mixing",
    "subln_weight": "group_norm_weight",
}


def _renamed(where: str, given: dict, release_names: dict) -> dict:
    """``given`` (new name: tensor) with each deprecated release name of ``release_names``
    moved to its new name, a DeprecationWarning per name; a keyword that is neither is a
    TypeError, as Python's own; a weight passed under both names is a UserError."""
    out = dict(given)
    for old, value in release_names.items():
        new = RELEASE_NAMES.get(old)
        if new is None or new not in out:
            raise TypeError(f"{where}() got an unexpected keyword argument {old!r}")
        if out[new] is not None:
            raise UserError(f"{where}: {old} and {new} are one weight (the release's name and this one); pass {new}")
        warnings.warn(
            f"{where}: {old}= is deprecated (removed in {RELEASE_NAMES_REMOVED_IN}), pass {new}= instead",
            DeprecationWarning,
            stacklevel=3,
        )
        out[new] = value
    return out


# ------------------------------------------------------------------------------ checks
def _shape(t: torch.Tensor) -> tuple:
    return tuple(t.shape)


def _check_qkv(where: str, q, k, v) -> tuple:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            got = _shape(t) if isinstance(t, torch.Tensor) else type(t).__name__
            raise UserError(f"{where}: {name}: expected a 4-D tensor (B, heads, T, head size), got {got}")
        if not t.is_floating_point() or t.dtype != q.dtype or t.device != q.device:
            raise UserError(
                f"{where}: q, k and v must share one floating dtype and device, got "
                f"{q.dtype}/{k.dtype}/{v.dtype} on {q.device}/{k.device}/{v.device}"
            )
    B, H, Tq, d = q.shape
    _, H_kv, Tk, _ = k.shape
    if k.shape[0] != B or v.shape[0] != B or k.shape[3] != d or v.shape[:3] != k.shape[:3]:
        raise UserError(
            f"{where}: expected q (B, H, Tq, d), k (B, H_kv, Tk, d), v (B, H_kv, Tk, dv), got "
            f"q {_shape(q)}, k {_shape(k)}, v {_shape(v)}"
        )
    if H % H_kv:
        raise UserError(
            f"{where}: k and v have {H_kv} heads, which must divide q's {H} "
            "(grouped-query attention: each K/V head serves H / H_kv query heads)"
        )
    if Tq > Tk:
        raise UserError(
            f"{where}: {Tq} queries but {Tk} keys: every query position needs its own key "
            "(cached decoding passes every key so far)"
        )
    return B, H, Tq, d, Tk, v.shape[3]


def _check_weights(where: str, w: dict, H: int, pad_key: str) -> None:
    if pad_key not in PAD_KEYS:
        raise UserError(f"{where}: pad_key={pad_key!r}: expected one of {PAD_KEYS}")
    for name in ("kq_kernel", "kq_kernel_after_softmax"):
        t = w[name]
        if t is None:
            continue
        if t.dim() != 4 or t.shape[0] != H or t.shape[1] != 1:
            raise UserError(f"{where}: {name}: expected shape ({H}, 1, c_q, c_k) for {H} query heads, got {_shape(t)}")
        if pad_key == "both" and t.shape[3] % 2 == 0:
            raise UserError(
                f"{where}: {name}: key kernel size {t.shape[3]} with pad_key='both' (a centred "
                "window) must be odd; use an odd size or pad_key='left'/'right'"
            )
    for name in ("pre_softmax_head_mixing", "post_softmax_head_mixing"):
        t = w[name]
        if t is not None and _shape(t) != (H, H):
            raise UserError(f"{where}: {name}: expected shape ({H}, {H}) for {H} query heads, got {_shape(t)}")
    t = w["head_kernel"]
    if t is not None:
        if t.dim() != 3 or t.shape[1] != t.shape[2] or t.shape[0] * t.shape[1] != H:
            raise UserError(
                f"{where}: head_kernel: expected shape (H / c_h, c_h, c_h) with H = {H} query heads, got {_shape(t)}"
            )
        if w["post_softmax_head_mixing"] is not None:
            raise UserError(
                f"{where}: head_kernel and post_softmax_head_mixing are two forms of post-softmax head mixing; pass one"
            )
    for name, t in w.items():
        if t is not None and not t.is_floating_point():
            raise UserError(f"{where}: {name}: expected a floating tensor, got {t.dtype}")


def _check_output_weights(where: str, dv: int, subln_weight, rescale: bool, gate_weight, gate_bias) -> None:
    if subln_weight is not None and _shape(subln_weight) != (dv,):
        raise UserError(
            f"{where}: group_norm_weight: expected shape ({dv},) (the value head size), got {_shape(subln_weight)}"
        )
    if rescale and subln_weight is None:
        raise UserError(f"{where}: layer_norm_rescale rescales the group norm: it needs group_norm_weight")
    if gate_weight is not None:
        if gate_weight.dim() != 2 or gate_weight.shape[1] != dv or gate_weight.shape[0] not in (1, dv):
            raise UserError(
                f"{where}: gate_weight: expected shape (1, {dv}) or ({dv}, {dv}), got {_shape(gate_weight)}"
            )
        if gate_bias is not None and _shape(gate_bias) != (gate_weight.shape[0],):
            raise UserError(f"{where}: gate_bias: expected shape ({gate_weight.shape[0]},), got {_shape(gate_bias)}")
    elif gate_bias is not None:
        raise UserError(f"{where}: gate_bias without gate_weight")


def _check_mask(where: str, mask, B: int, Tk: int, device) -> torch.Tensor | None:
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or _shape(mask) != (B, Tk):
        got = _shape(mask) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise UserError(
            f"{where}: attention_mask: expected (B, Tk) = ({B}, {Tk}), True/1 at real tokens, got "
            f"{got} (MTA is causal: only padding is given as a mask)"
        )
    if mask.is_floating_point():
        raise UserError(
            f"{where}: attention_mask: expected bool or 0/1 integers, got {mask.dtype} "
            "(an additive float mask is not read)"
        )
    mask = mask.to(device=device, dtype=torch.bool)
    return None if bool(mask.all()) else mask


# ------------------------------------------------------------------ implementation choice
_decisions: dict = {}


def _checked_impl(name: str, q: torch.Tensor, p: ExplicitAttnParams, selfcheck: str | None):
    """(implementation, params) to run: ``name`` as asked, or what the float64 self-check of
    ``mta_repro.model.selfcheck`` chose for these options on q's device and dtype (cached)."""
    mode = selfcheck or "off"
    if mode == "off" or torch.compiler.is_compiling():
        return name, p
    shapes = tuple(
        None if t is None else _shape(t) for t in (p.mta_kernel, p.wpsm, p.mta_kernel_after_sm, p.head_kernel, p.wposm)
    )
    key = (name, str(q.device), q.dtype, q.shape[1], q.shape[3], shapes, p.pad_key, p.block_size, p.tuning, mode)
    if key not in _decisions:
        from mta_repro.model import selfcheck as sc

        args = _model_args(q.shape[1], q.shape[3], p, name)
        _decisions[key] = sc.decide(
            args, q.device, q.dtype, strict=mode == "strict", log=lambda line: warnings.warn(line, stacklevel=4)
        ).used
    return _decisions[key], p


def _model_args(H: int, d: int, p: ExplicitAttnParams, impl: str):
    """The score-path options of ``p`` as the one-layer model the self-check runs."""
    from mta_repro.model.args import MTAArgs
    from mta_repro.model.mta_layer import one_layer_args

    pre = p.mta_kernel.shape[2:] if p.mta_kernel is not None else (None, None)
    post = p.mta_kernel_after_sm.shape[2:] if p.mta_kernel_after_sm is not None else (None, None)
    mta = MTAArgs(
        use_mta=True,
        query_kernel_size=pre[0],
        key_kernel_size=pre[1],
        after_sm_query_kernel_size=post[0],
        after_sm_key_kernel_size=post[1],
        pad_key=p.pad_key,
        head_kernel_size=None if p.head_kernel is None else p.head_kernel.shape[1],
        pre_sm_linear_head=p.wpsm is not None,
        post_sm_linear_head=p.wposm is not None,
    )
    return one_layer_args(H, d, mta, attn_impl=impl, attn_block_size=p.block_size, kernels=p.tuning)
