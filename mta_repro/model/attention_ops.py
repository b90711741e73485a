"""The attention operations under one name: the math, the ``blocked`` engine and the
registry, each in a module of its own, re-exported here for the code that uses them
together (the model, the estimates, the scripts and tests).

- ``attention_math``: pure functions on tensors, one per layer kind (``sdpa``,
  ``diff_attention``, ``explicit_attention_torch``, the reference of the explicit path) and
  their pieces (the key-query convolution, head mixing, RMSNorm);
- ``attention_blocked``: the default engine of the explicit path, query blocks recomputed in
  backward, and the choice of its key-query convolution kernel and block size;
- ``attention_registry``: ``model.attn_impl``'s implementations by name (``AttnImpl``, the
  entry points, the fallbacks) and the dispatch to one.

Nothing is defined here: replace a function for a test where it is defined (e.g.
``attention_blocked.kq_conv_dense``), as the modules call one another by their own names.
"""

from mta_repro.kernels.interface import AttnMask, ExplicitAttnParams, pad_left
from mta_repro.model.attention_blocked import (
    DEFAULT_BLOCK_SIZE,
    compile_block,
    default_block_size,
    explicit_attention_blocked,
    explicit_attention_blocked_conv2d,
    head_conv_fast,
    head_mix_linear_fast,
    kq_conv_backend,
    masked_kq_conv,
    reset_compiled_blocks,
    resolve_block_size,
)
from mta_repro.model.attention_math import (
    WEIGHT_FIELDS,
    diff_attention,
    explicit_attention_torch,
    head_conv,
    head_mix_linear,
    identity_kq_kernel,
    kq_conv_dense,
    lambda_init_fn,
    query_history,
    rms_norm,
    sdpa,
)
from mta_repro.model.attention_registry import (
    ATTN_IMPLS,
    BLOCKED_ENGINE,
    ENTRY_POINTS,
    IMPL_OPTIONS,
    AttnImpl,
    AttnKernels,
    attn_impl,
    attn_impl_names,
    check_impl_options,
    declared_attn_impls,
    explicit_attention,
    fallback_chain,
    register_attn_impl,
)

__all__ = [
    "ATTN_IMPLS",
    "BLOCKED_ENGINE",
    "DEFAULT_BLOCK_SIZE",
    "ENTRY_POINTS",
    "IMPL_OPTIONS",
    "WEIGHT_FIELDS",
    "AttnImpl",
    "AttnKernels",
    "AttnMask",
    "ExplicitAttnParams",
    "attn_impl",
    "attn_impl_names",
    "check_impl_options",
    "compile_block",
    "declared_attn_impls",
    "default_block_size",
    "diff_attention",
    "explicit_attention",
    "explicit_attention_blocked",
    "explicit_attention_blocked_conv2d",
    "explicit_attention_torch",
    "fallback_chain",
    "head_conv",
    "head_conv_fast",
    "head_mix_linear",
    "head_mix_linear_fast",
    "identity_kq_kernel",
    "kq_conv_backend",
    "kq_conv_dense",
    "lambda_init_fn",
    "masked_kq_conv",
    "pad_left",
    "query_history",
    "register_attn_impl",
    "reset_compiled_blocks",
    "resolve_block_size",
    "rms_norm",
    "sdpa",
]
