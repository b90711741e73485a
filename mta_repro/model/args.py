"""Model configuration schemas.

Field names follow the official release (facebookresearch/RAM, projects/mta, built on
Meta Lingua) so that a release YAML's ``model:`` section loads here unchanged.
Cross-field rules are checked in ``__post_init__`` and raise ``UserError`` naming the
field, so a bad combination fails when the config is turned into these objects
(``OmegaConf.to_object`` or ``build_model``), before any work starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from mta_repro.errors import UserError
from mta_repro.kernels.tuning import KernelTuning

PAD_KEY_CHOICES = ("left", "right", "both")
INIT_CHOICES = ("identity", "const", "uniform", "diagonal", "normal")
# Lingua's ``InitStdFactor`` (lingua/transformer.py): what the std of each block's output
# projections (attention ``wo``, FFN ``w2``, the gate) is divided by, at 0-based depth l
# of L layers: 1, sqrt(2 (L + 1)), sqrt(2 (l + 1)), dim / 4096.
INIT_STD_FACTORS = ("disabled", "global_depth", "current_depth", "dim_ratio")
# Where RMSNorm casts back to the model dtype (a difference only in bf16/fp16):
# "release": the block norms (attention_norm, ffn_norm) normalise in fp32, cast, then
#   multiply by the weight in the model dtype (projects/mta's RMSNorm); the final ``norm``
#   multiplies in fp32, then casts (Lingua's RMSNorm), as the release builds them;
# "lingua": every norm multiplies in fp32, then casts (Lingua's own models);
# "hf": every norm casts, then multiplies (transformers' LlamaRMSNorm).
NORM_ORDERS = ("release", "lingua", "hf")
_KERNEL_SIZES = (
    "query_kernel_size",
    "key_kernel_size",
    "after_sm_query_kernel_size",
    "after_sm_key_kernel_size",
    "head_kernel_size",
)


@dataclass
class MTAArgs:
    """Multi-Token Attention options (paper section 3, release ``model.mta``)."""

    # Master switch. Off: the plain SDPA baseline (or the Differential Transformer).
    # Talking heads is ``use_mta: true`` with head mixing and no key-query convolution.
    use_mta: bool = False
    # Key-query convolution *before* softmax: c_q (query rows, causal) x c_k (keys).
    query_kernel_size: int | None = None
    key_kernel_size: int | None = None
    # Key-query convolution *after* softmax (no renormalisation afterwards).
    after_sm_query_kernel_size: int | None = None
    after_sm_key_kernel_size: int | None = None
    # Where the key window sits: "both" = centred (c_k odd), "left" = keys j-c_k+1..j,
    # "right" = keys j..j+c_k-1.
    pad_key: str = "both"
    # Comma list of 0-based layer ids that get the key-query convolutions; None = all.
    # Layers not listed still run head mixing / group norm / gating when configured.
    mta_layers: str | None = None
    # Initialisation of conv kernels and head-mixing weights.
    init_method: str = "identity"
    # Post-softmax head convolution: heads split into n_heads/c_h contiguous groups,
    # each mixed by a c_h x c_h matrix (``head_kernel``, input-major).
    head_kernel_size: int | None = None
    # Pre-softmax full head mixing (``wpsm``, nn.Linear(H, H), output-major).
    pre_sm_linear_head: bool = False
    # Post-softmax full head mixing (``wposm``); exclusive with head_kernel_size.
    post_sm_linear_head: bool = False
    # Per-head RMSNorm of the attention output (``subln``), weight shared by heads.
    group_norm: bool = False
    # Multiply the group-normed output by (1 - lambda_init(layer)) ("depth scaling").
    layer_norm_rescale: bool = False
    # The release's ``curse_norm``: multiply the block norms' outputs (attention_norm and
    # ffn_norm) by (1 - lambda_init(layer)) ("layer-norm scaling", arXiv 2502.05795;
    # Table 5's 11.41 row). Independent of use_mta, as in the release.
    curse_norm: bool = False
    # Output gate O * sigmoid(gate(O)); gate_1d: one scalar per head and token.
    add_gating: bool = False
    gate_1d: bool = True

    def check(self, n_heads: int, max_seqlen: int | None = None, prefix: str = "model.") -> None:
        """Raise ``UserError`` on options that do not fit ``n_heads`` query heads (and
        sequences of at most ``max_seqlen``; None: no bound). Names read ``{prefix}mta.<field>``
        and ``{prefix}n_heads``: a config's ``model.mta.key_kernel_size`` (the default), a
        module's keyword ``key_kernel_size`` (``prefix=""``)."""
        opt = lambda name: f"{prefix}mta.{name}" if prefix else name  # noqa: E731
        for name in _KERNEL_SIZES:
            size = getattr(self, name)
            _positive(opt(name), size)
            # Checked before any parameter is allocated: a convolution wider than the longest
            # sequence reads nothing more (and (H, 1, c_q, c_k) of 2**33 would not fit anywhere).
            if max_seqlen is not None and size is not None and size > max_seqlen and name != "head_kernel_size":
                raise UserError(
                    f"{opt(name)}={size}: expected at most {prefix}max_seqlen={max_seqlen} "
                    "(a convolution over more positions than a sequence has)"
                )
        if self.pad_key not in PAD_KEY_CHOICES:
            raise UserError(f"{opt('pad_key')}: expected one of {PAD_KEY_CHOICES}, got {self.pad_key!r}")
        if self.init_method not in INIT_CHOICES:
            raise UserError(f"{opt('init_method')}: expected one of {INIT_CHOICES}, got {self.init_method!r}")
        for q, k in (
            ("query_kernel_size", "key_kernel_size"),
            ("after_sm_query_kernel_size", "after_sm_key_kernel_size"),
        ):
            qv, kv = getattr(self, q), getattr(self, k)
            if (qv is None) != (kv is None):
                raise UserError(f"{opt(q)} and {opt(k)} must be set together (or both null)")
            if kv is not None and self.pad_key == "both" and kv % 2 == 0:
                raise UserError(
                    f"{opt(k)}={kv}: pad_key 'both' centres the key window, so the key kernel size must be odd"
                )
        c_h = self.head_kernel_size
        if c_h is not None:
            if n_heads % c_h:
                raise UserError(f"{opt('head_kernel_size')}={c_h} must divide {prefix}n_heads={n_heads}")
            if self.post_sm_linear_head:
                raise UserError(
                    f"{opt('head_kernel_size')} and {opt('post_sm_linear_head')} are two forms "
                    "of post-softmax head mixing; set only one"
                )
        if self.layer_norm_rescale and not self.group_norm:
            raise UserError(f"{opt('layer_norm_rescale')} rescales the group norm: it needs {opt('group_norm')}")


@dataclass
class RopeScalingArgs:
    """RoPE frequency scaling, as ``rope_scaling`` in a Hugging Face ``config.json``.
    ``rope_type: default``: plain frequencies (the other fields unused). ``llama3``
    (Llama 3.1/3.2; ``use_scaled_rope`` in Meta's params.json): dimensions whose
    wavelength is below original_max_position_embeddings / high_freq_factor keep their
    frequency, those above original_max_position_embeddings / low_freq_factor are divided
    by ``factor``, the band between is interpolated (transformer.rope_inv_freq). The
    defaults below are Llama 3.1's; Llama 3.2 uses factor 32."""

    rope_type: str = "default"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in ("default", "llama3"):
            raise UserError(f"model.rope_scaling.rope_type: expected 'default' or 'llama3', got {self.rope_type!r}")
        if not self.factor > 0 or not self.high_freq_factor > self.low_freq_factor > 0:
            raise UserError(
                "model.rope_scaling: expected factor > 0 and high_freq_factor > low_freq_factor > 0, got "
                f"{self.factor}, {self.high_freq_factor}, {self.low_freq_factor}"
            )
        if int(self.original_max_position_embeddings) < 1:
            raise UserError("model.rope_scaling.original_max_position_embeddings: expected a positive integer")


@dataclass
class ModelArgs:
    """LLaMA-style decoder (Lingua ``BaseTransformerArgs`` names)."""

    dim: int = 256
    n_layers: int = 4
    n_heads: int = 4
    # Grouped-query attention (Lingua/release ``n_kv_heads``); None: n_heads (multi-head).
    # wk/wv project to n_kv_heads heads; K/V are repeated right after RoPE (and after the
    # KV cache, which holds only the n_kv_heads heads), so query head h reads K/V head
    # h // (n_heads / n_kv_heads) and every attention implementation and every MTA
    # parameter (sized by n_heads) sees n_heads heads, as in the release. The Differential
    # Transformer repeats its value heads of size 2*head_dim (pairs of V heads), as in
    # unilm's multihead_diffattn: diff head i reads value pair i // (n_heads / n_kv_heads).
    n_kv_heads: int | None = None
    # None: dim // n_heads.
    head_dim: int | None = None
    # Must equal the tokenizer's id count; the trainer checks it.
    vocab_size: int = 8192
    # FFN hidden = multiple_of * ceil(ffn_dim_multiplier * int(8*dim/3) / multiple_of).
    ffn_dim_multiplier: float = 1.0
    multiple_of: int = 256
    norm_eps: float = 1e-5
    # Rounding order of the RMSNorms in bf16/fp16 (NORM_ORDERS above); fp32/fp64 results
    # do not depend on it. "release" is bit-identical to the official release in bf16;
    # "lingua" for checkpoints trained by Lingua's own models.
    norm_order: str = "release"
    # RoPE base: 1e5 for pretraining, 5e5 for the 4K long-context stage.
    rope_theta: float = 100_000.0
    # Longest sequence the model is meant for (the release's max_seqlen; HF export's
    # max_position_embeddings, eval's default max_length): RoPE cos/sin are computed
    # for the positions of each forward, so nothing is precomputed or limited by it.
    max_seqlen: int = 4096
    # RoPE frequency scaling (RopeScalingArgs): rope_type default (plain) or llama3.
    rope_scaling: RopeScalingArgs = field(default_factory=RopeScalingArgs)
    # Output projection shares the token embedding (as in every release config).
    weight_tying: bool = True
    # Seed of the parameter initialisation (Lingua: 42).
    seed: int = 42
    # Lingua's init options (BaseTransformerArgs). init_base_std: the std of wq/wk/wv/wo,
    # w1/w3/w2 and the gate (None: dim**-0.5, and hidden**-0.5 for w2); the embeddings
    # (and an untied output) always use dim**-0.5, as Lingua's LMTransformer does.
    # init_std_factor (INIT_STD_FACTORS): divides the std of wo, w2 and the gate; the
    # truncation bounds of wo and the gate stay at +-3 x the undivided std (Lingua's).
    init_base_std: float | None = None
    init_std_factor: str = "disabled"
    # Dropout on the attention probabilities, as in the release (0 in every paper LM
    # run; 0.1 in the toy task). Training mode only.
    dropout: float = 0.0
    # Differential Transformer (Ye et al. 2024): n_heads/2 heads of value size
    # 2*head_dim, two softmaxes per head. Exclusive with mta.use_mta.
    diff_transformer: bool = False
    # Implementation of the explicit attention path (MTA, talking heads); a name of
    # ``mta_repro.model.attention_registry.attn_impl``: "blocked" (query blocks recomputed in
    # backward, causal skipping; the default), "blocked+conv2d" (the same with F.conv2d for
    # the key-query convolutions), "torch" (the reference: the whole (B, H, T, T) score
    # matrix, kept for backward) or one an installed package declares (its entry point, e.g.
    # an experiment's; docs/models.md). Faster kernels plug in there.
    attn_impl: str = "blocked"
    # Query rows per block of attn_impl=blocked; null = per device
    # (attention_ops.DEFAULT_BLOCK_SIZE, which says why: 128 on CPU, measured in
    # docs/models.md; 512 on CUDA, an estimate scripts/gpu_acceptance.py checks). The score
    # path's working set is a few B x H x (block + halo) x T tensors.
    attn_block_size: int | None = None
    # Before training on a non-CPU device, check attn_impl there, in the run's dtype, on each
    # explicit layer kind against the float64 reference (mta_repro/model/selfcheck.py):
    # "warn" falls back along the registry's fallbacks (blocked -> blocked+conv2d -> torch)
    # with one line and records what ran (<run_dir>/attn_selfcheck.json, "attn_impl" in
    # metrics.jsonl); "strict" refuses to train (rc 2); "off" skips it.
    attn_selfcheck: str = field(default="warn", metadata={"run_dir": "free"})
    # Run that check on the CPU too (it is for devices the code was not tested on; tests).
    attn_selfcheck_cpu: bool = field(default=False, metadata={"run_dir": "free"})
    # The release's key-query convolution layers for this size. ``attention=mta``
    # points ``mta.mta_layers`` here; changing it alone changes nothing.
    kq_conv_layers: str | None = None
    mta: MTAArgs = field(default_factory=MTAArgs)
    # How the attention kernels compute (mta_repro/kernels/tuning.py KernelTuning: the kq-conv
    # backend, compiling the query block, its Triton tile, an implementation's own options;
    # docs/environment.md has the table).
    # The same numbers within float tolerance under every setting, so free to change within
    # a run dir; a saved config without it loads with the defaults.
    kernels: KernelTuning = field(default_factory=KernelTuning)

    def __post_init__(self) -> None:
        if isinstance(self.mta, dict):  # plain-dict construction, e.g. from a checkpoint
            self.mta = MTAArgs(**self.mta)
        if isinstance(self.rope_scaling, dict):
            self.rope_scaling = RopeScalingArgs(**self.rope_scaling)
        if isinstance(self.kernels, dict):
            self.kernels = KernelTuning(**self.kernels)
        validate(self)

    # Derived sizes --------------------------------------------------------------
    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.dim // self.n_heads

    @property
    def resolved_n_kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    def init_std_factor_at(self, layer_id: int) -> float:
        """Lingua's ``InitStdFactor`` value for 0-based layer ``layer_id``."""
        return {
            "disabled": 1.0,
            "global_depth": (2 * (self.n_layers + 1)) ** 0.5,
            "current_depth": (2 * (layer_id + 1)) ** 0.5,
            "dim_ratio": self.dim / 4096,
        }[self.init_std_factor]

    @property
    def ffn_hidden_dim(self) -> int:
        hidden = int(2 * 4 * self.dim / 3)
        hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    def layer_kind(self, layer_id: int) -> str:
        """What attention layer ``layer_id`` runs, the one place the model and the FLOP
        count learn it: "diff" (Differential Transformer), "kq_conv" (explicit path with
        the key-query convolutions), "mixing" (explicit path, head mixing only: the MTA
        layers outside mta_layers, talking heads) or "sdpa" (fused softmax attention)."""
        if self.diff_transformer:
            return "diff"
        m = self.mta
        if not m.use_mta:
            return "sdpa"
        has_conv = m.query_kernel_size is not None or m.after_sm_query_kernel_size is not None
        if has_conv and layer_id in self.conv_layer_ids():
            return "kq_conv"
        if m.pre_sm_linear_head or m.post_sm_linear_head or m.head_kernel_size:
            return "mixing"
        return "sdpa"

    def conv_layer_ids(self) -> list[int]:
        """0-based layers that get the key-query convolutions."""
        if not self.mta.use_mta:
            return []
        return _parse_layers(self.mta.mta_layers, self.n_layers)


def _parse_layers(spec: str | None, n_layers: int) -> list[int]:
    if spec is None or str(spec).strip() == "":
        return list(range(n_layers))
    out = []
    for part in str(spec).split(","):
        part = part.strip()
        try:
            idx = int(part)
        except ValueError:
            raise UserError(f"model.mta.mta_layers: expected a comma list of integers, got {spec!r}") from None
        if not 0 <= idx < n_layers:
            raise UserError(
                f"model.mta.mta_layers: layer {idx} is out of range for model.n_layers={n_layers} (ids are 0-based)"
            )
        out.append(idx)
    return sorted(set(out))


def _positive(name: str, value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):  # True is an int
        raise UserError(f"{name}: expected a positive integer or null, got {value!r}")


def validate(args: ModelArgs) -> None:
    """Raise ValueError naming the field and the rule for any invalid combination."""
    for name in ("dim", "n_layers", "n_heads", "vocab_size", "multiple_of", "max_seqlen"):
        _positive(f"model.{name}", getattr(args, name))
    _positive("model.head_dim", args.head_dim)
    _positive("model.n_kv_heads", args.n_kv_heads)
    if args.n_heads % args.resolved_n_kv_heads:
        raise UserError(
            f"model.n_kv_heads={args.n_kv_heads} must divide model.n_heads={args.n_heads} "
            "(each K/V head serves n_heads / n_kv_heads query heads)"
        )
    if args.norm_order not in NORM_ORDERS:
        raise UserError(f"model.norm_order: expected one of {NORM_ORDERS}, got {args.norm_order!r}")
    if args.init_std_factor not in INIT_STD_FACTORS:
        raise UserError(
            f"model.init_std_factor: expected one of {INIT_STD_FACTORS} (Lingua's InitStdFactor), "
            f"got {args.init_std_factor!r}"
        )
    if args.init_base_std is not None and (
        isinstance(args.init_base_std, bool)
        or not isinstance(args.init_base_std, (int, float))
        or not 0 < args.init_base_std < math.inf
    ):
        raise UserError(f"model.init_base_std: expected a finite positive number or null, got {args.init_base_std!r}")
    if args.head_dim is None and args.dim % args.n_heads:
        raise UserError(
            f"model.dim={args.dim} is not divisible by model.n_heads={args.n_heads}; set model.head_dim explicitly"
        )
    from mta_repro.model import attention_ops

    attention_ops.attn_impl(args.attn_impl)  # registered, or a declared one loaded; else one line
    attention_ops.check_impl_options(args.kernels)  # each implementation checks its own options
    _positive("model.attn_block_size", args.attn_block_size)
    if args.attn_selfcheck not in ("warn", "strict", "off"):
        raise UserError(f"model.attn_selfcheck: expected warn, strict or off, got {args.attn_selfcheck!r}")
    for name, low, rule in (
        ("rope_theta", 0.0, "> 0 (the RoPE base)"),
        ("ffn_dim_multiplier", 0.0, "> 0"),
        ("norm_eps", None, ">= 0"),
    ):
        v = getattr(args, name)
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        if not ok or (v <= low if low is not None else v < 0):
            raise UserError(f"model.{name}: expected a finite number {rule}, got {v!r}")
    # the FFN's hidden size before rounding: below 1 it has no unit (an empty layer), past
    # 2**31 it is no size a tensor dimension takes (1e308 overflows to inf)
    raw = args.ffn_dim_multiplier * int(8 * args.dim / 3)
    if not 1 <= raw < 2**31:
        raise UserError(
            f"model.ffn_dim_multiplier={args.ffn_dim_multiplier!r} gives an FFN hidden size of "
            f"{args.ffn_dim_multiplier!r} x int(8*dim/3)={int(8 * args.dim / 3)} = {raw:.4g} units: expected "
            "1 to 2**31 units (the paper's models use 1.0)"
        )
    if not 0.0 <= args.dropout < 1.0:
        raise UserError(f"model.dropout: expected 0 <= p < 1, got {args.dropout}")
    if args.diff_transformer:
        if args.n_heads % 2:
            raise UserError(
                f"model.n_heads={args.n_heads}: the Differential Transformer pairs heads "
                "(n_heads/2 heads of value size 2*head_dim), so n_heads must be even"
            )
        if args.mta.use_mta:
            raise UserError("model.diff_transformer and model.mta.use_mta are exclusive")
        if args.resolved_n_kv_heads % 2:
            raise UserError(
                f"model.n_kv_heads={args.n_kv_heads}: the Differential Transformer pairs K/V "
                "heads too (n_kv_heads/2 value heads of size 2*head_dim), so it must be even"
            )
    args.mta.check(args.n_heads, max_seqlen=args.max_seqlen)
    _parse_layers(args.mta.mta_layers, args.n_layers)  # raises on bad ids


def attention_variant(model_cfg) -> str:
    """Which ``attention=`` option (configs/attention/) a model config is: baseline, diff,
    talking_heads (head mixing only) or mta (key-query convolutions)."""
    if model_cfg.get("diff_transformer"):
        return "diff"
    mta = model_cfg.get("mta") or {}
    if not mta.get("use_mta"):
        return "baseline"
    if mta.get("query_kernel_size") or mta.get("after_sm_query_kernel_size"):
        return "mta"
    return "talking_heads"
