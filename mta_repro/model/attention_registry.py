"""The registry of explicit-path implementations (``model.attn_impl``) and the dispatch to one.

Built in: ``torch`` (``attention_math.explicit_attention_torch``, the reference), ``blocked``
(the default engine, ``attention_blocked``) and ``blocked+conv2d`` (that engine with ATen's
``F.conv2d`` for its key-query convolutions). Others plug in by name: ``register_attn_impl``,
or an entry point of the group ``mta_repro.attn_impls`` in an installed package's metadata,
loaded on first use (how the experimental fused Triton kernels register as ``triton``; this
module never imports them). Each entry names its ``fallback``: what runs where it declines a
call, and what the self-check (``mta_repro.model.selfcheck``) tries next where it is wrong;
following them from any name gives the fallback chain. An entry may take options of its own
from ``model.kernels.impl_options.<name>`` (``AttnImpl.options``, ``check_impl_options``).
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from mta_repro.errors import UserError
from mta_repro.kernels.interface import AttnMask, ExplicitAttnParams
from mta_repro.kernels.tuning import DEFAULT_TUNING, KernelTuning
from mta_repro.model.attention_blocked import explicit_attention_blocked, explicit_attention_blocked_conv2d
from mta_repro.model.attention_math import explicit_attention_torch

# The config section of the implementations' own options: ``<IMPL_OPTIONS>.<name>.<option>``.
IMPL_OPTIONS = "model.kernels.impl_options"


@dataclass(frozen=True)
class AttnImpl:
    """A registered explicit-path implementation, what it supports, and what the estimates
    (``mta_repro.estimate``) ask of one whose kernels they can neither run on the meta device
    nor count from outside (the last three fields; None: the generic rule)."""

    fn: Callable[..., torch.Tensor]
    # Returns None when (q, params, mask) are supported, else the reason (for the
    # fallback's warning); None means everything is supported. The params as the call uses
    # them: their dropout is 0 outside training.
    supports: Callable[[torch.Tensor, ExplicitAttnParams, AttnMask], str | None] | None = None
    doc: str = ""
    # What runs instead where ``supports`` declines, and what the self-check tries next where
    # this one is wrong on a device (None: nothing; only the reference ends the chain).
    fallback: str | None = "torch"
    # The memory pre-flight runs the model on meta: a stand-in with fn's signature that saves
    # for backward what fn saves (None: fn itself runs on meta).
    meta_fn: Callable[..., torch.Tensor] | None = None
    # (params, batch, seq_len, n_heads, head_dim, dtype) -> bytes fn holds beyond its inputs,
    # outputs and saved tensors while one training layer's backward runs (None: none).
    workspace_bytes: Callable[..., int] | None = None
    # (ModelArgs, seq_len, layer kind) -> (forward, backward) FLOPs per token of one layer, or
    # None where ``fallback`` runs the layer (None: counted as the whole (B, H, T, T) matrix).
    flops: Callable[..., tuple[float, float] | None] | None = None
    # (options, where) -> the implementation's own options parsed: ``options`` is the mapping
    # ``model.kernels.impl_options.<name>``, ``where`` that config path; raises a one-line
    # UserError naming ``where`` on an unknown key or a bad value (None: it takes none).
    options: Callable[[Mapping[str, Any], str], object] | None = None


# Registry of explicit-path implementations (``model.attn_impl``). An implementation has
# the signature of ``explicit_attention_torch`` and its semantics; the parity tests in
# tests/test_attn_impls.py run every built-in name against "torch".
ATTN_IMPLS: dict[str, AttnImpl] = {
    "torch": AttnImpl(explicit_attention_torch, doc="reference: whole (B, H, Tq, Tk) matrix", fallback=None),
    "blocked": AttnImpl(
        explicit_attention_blocked, doc="query blocks, causal skipping, recomputed", fallback="blocked+conv2d"
    ),
    "blocked+conv2d": AttnImpl(
        explicit_attention_blocked_conv2d, doc="blocked, its key-query convolutions through F.conv2d", fallback="torch"
    ),
}

# The names that run the blocked engine (attention_blocked): what the FLOP count credits with
# its causal skipping per query block and its recomputation in backward.
BLOCKED_ENGINE = ("blocked", "blocked+conv2d")

# The entry-point group of implementations that are not built in: "name = module:attribute",
# the attribute an ``AttnImpl``.
ENTRY_POINTS = "mta_repro.attn_impls"


def register_attn_impl(name: str, impl: AttnImpl) -> None:
    ATTN_IMPLS[name] = impl


def declared_attn_impls() -> dict[str, str]:
    """{name: "module:attribute"} of the implementations the installed packages declare in the
    entry-point group ``ENTRY_POINTS`` (their metadata, ``importlib.metadata``; an editable
    install's too). Nothing is imported."""
    from importlib.metadata import entry_points

    return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINTS)}


def attn_impl_names() -> list[str]:
    """Every implementation ``model.attn_impl`` may name: registered or declared."""
    return sorted(set(ATTN_IMPLS) | set(declared_attn_impls()))


def attn_impl(name: str) -> AttnImpl:
    """The implementation registered as ``name``; a declared one (``declared_attn_impls``) is
    imported and registered on first use. One line naming ``model.attn_impl`` where there is
    none or it does not load."""
    entry = ATTN_IMPLS.get(name)
    if entry is not None:
        return entry
    target = declared_attn_impls().get(name)
    if target is None:
        raise UserError(f"model.attn_impl: unknown implementation {name!r}; available: {attn_impl_names()}")
    module, _, attr = target.partition(":")
    try:
        entry = importlib.import_module(module)
        for part in filter(None, attr.split(".")):
            entry = getattr(entry, part)
    except (ImportError, AttributeError) as e:
        raise UserError(
            f"model.attn_impl={name!r}: its implementation {target} (entry point of {ENTRY_POINTS}) does not load: {e}"
        ) from None
    if not isinstance(entry, AttnImpl):
        raise UserError(f"model.attn_impl={name!r}: {target} is a {type(entry).__name__}, not an AttnImpl")
    register_attn_impl(name, entry)
    return entry


def fallback_chain(name: str) -> list[str]:
    """``name`` and the implementations its ``fallback`` entries lead to, in order (the
    self-check's chain), e.g. blocked -> blocked+conv2d -> torch. A fallback that leads back
    to a name already in the chain is one line naming it."""
    chain = [name]
    while (nxt := attn_impl(chain[-1]).fallback) is not None:
        if nxt in chain:
            raise UserError(
                f"model.attn_impl={name!r}: its fallbacks go round in a circle: {' -> '.join([*chain, nxt])}"
            )
        chain.append(nxt)
    return chain


def check_impl_options(tuning: KernelTuning) -> None:
    """Each implementation named in ``tuning.impl_options`` checks its own options
    (``AttnImpl.options``), loading it where it is declared. One line naming the config field
    and the implementation where the name is none, it takes no options, or a key or value is
    wrong (its own check)."""
    for name, opts in tuning.impl_options.items():
        where = f"{IMPL_OPTIONS}.{name}"
        if name not in ATTN_IMPLS and name not in declared_attn_impls():
            raise UserError(
                f"{where}: no attention implementation is registered as {name!r} (available: "
                f"{', '.join(attn_impl_names())}); remove the entry or name one of those"
            )
        entry = attn_impl(name)
        if entry.options is not None:
            entry.options(opts, where)
        elif opts:
            raise UserError(f"{where}: implementation {name!r} takes no options, got {', '.join(sorted(opts))}")


def explicit_attention(
    impl: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    p: ExplicitAttnParams,
    mask: AttnMask,
    training: bool = False,
    impls: Mapping[str, AttnImpl] | None = None,
) -> torch.Tensor:
    """Dispatch to ``impls[impl]`` (default: the registry ``ATTN_IMPLS``), or to its
    fallback where it declares no support."""
    impls = ATTN_IMPLS if impls is None else impls
    entry = impls[impl] if impl in impls else attn_impl(impl)
    if entry.supports is not None:
        # the layer as this call runs it: no dropout outside training
        reason = entry.supports(q, p if training or not p.dropout else replace(p, dropout=0.0), mask)
        if reason is not None:
            if entry.fallback is None:
                raise UserError(f"model.attn_impl={impl!r} does not support {reason} and names no fallback")
            _warn_fallback(impl, reason, entry.fallback)
            entry = impls[entry.fallback] if entry.fallback in impls else attn_impl(entry.fallback)
    return entry.fn(q, k, v, p, mask, training)


@dataclass(frozen=True)
class AttnKernels:
    """The functions one ``Attention`` module computes with (its ``kernels`` attribute).

    The defaults are what runs: torch's SDPA, the registry ``ATTN_IMPLS`` and the key-query
    convolution backend chosen per call (``kq_conv_backend``), under the model's tuning
    (``model.kernels``, handed to every kernel in ``ExplicitAttnParams.tuning``; two models
    in one process tune independently). Whoever needs other ones
    for one model hands them to that model's modules: the memory pre-flight gives its meta
    model stand-ins that keep what the device's kernels keep (``mta_repro.estimate.memory``),
    so nothing process-wide is swapped and a model next to it is untouched."""

    sdpa: Callable | None = None  # F.scaled_dot_product_attention's signature; None: that function
    impls: Mapping[str, AttnImpl] | None = None  # None: ATTN_IMPLS as it is at the call
    kq_backend: str | None = None  # c | triton | conv2d; None: kq_conv_backend per call
    tuning: KernelTuning = DEFAULT_TUNING  # the model's ``model.kernels``


_warned: set = set()


def _warn_fallback(impl: str, reason: str, fallback: str) -> None:
    if (impl, reason) not in _warned:
        _warned.add((impl, reason))
        warnings.warn(f"model.attn_impl={impl!r} does not support {reason}; using {fallback!r}", stacklevel=2)
