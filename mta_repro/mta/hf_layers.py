"""The layer side of MTA in a Hugging Face model: what ``apply_mta`` puts in place.

Each converted attention layer's class becomes ``MTA<Family>Attention`` (its forward with
``MultiTokenAttention`` in place of the attention function; projections, RoPE, masks and
KV cache stay the model's), and its cache layer keeps the last queries the convolutions
read. ``saved_entry`` checks config.json's ``mta_repro`` entry before a model is built;
``MTAModel`` is the mixin of the converted model classes that ``modeling_mta.py`` defines.
Imported by ``modeling_mta.py`` and ``hf_insertion.py``; imports neither.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from mta_repro.errors import UserError
from mta_repro.kernels.interface import AttnMask
from mta_repro.kernels.tuning import KernelTuning
from mta_repro.model.args import MTAArgs
from mta_repro.mta.module import MultiTokenAttention, validated_args

# The attention classes whose forward ``_MTAAttention.forward`` reproduces (transformers 5).
ATTENTION_CLASSES = ("LlamaAttention", "Qwen2Attention", "MistralAttention", "Qwen3Attention")
# apply_mta's options: the release's ``model.mta`` fields that belong to one attention layer.
OPTIONS = tuple(f.name for f in dataclasses.fields(MTAArgs) if f.name not in ("use_mta", "mta_layers", "curse_norm"))
CONV_OPTIONS = ("query_kernel_size", "key_kernel_size", "after_sm_query_kernel_size", "after_sm_key_kernel_size")
CONFIG_KEY = "mta_repro"  # config.json: {"layers": [...], "conv_layers": [...], "options": {...}}

T = TypeVar("T")

if TYPE_CHECKING:  # the classes the mixins below are mixed into
    from transformers import PreTrainedModel
    from transformers.cache_utils import DynamicLayer

    _CacheLayer, _Model = DynamicLayer, PreTrainedModel
else:
    _CacheLayer = _Model = object


def insert_layers(
    model: PreTrainedModel,
    layers: None | str | Sequence[int] = None,
    *,
    conv_layers: None | str | Sequence[int] = None,
    attn_impl: str = "blocked",
    attn_block_size: int | None = None,
    kernels: KernelTuning | None = None,
    selfcheck: str | None = None,
    **options,
) -> None:
    """``apply_mta``'s work on the layers (its arguments, checked here): each chosen
    attention layer gets its ``MultiTokenAttention`` child and the MTA forward, and
    ``model.config`` the ``mta_repro`` entry. The model's own class stays."""
    where = "apply_mta"
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        close = difflib.get_close_matches(unknown[0], OPTIONS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else f"; options: {', '.join(OPTIONS)}"
        raise UserError(f"{where}: unknown option {unknown[0]!r}{hint}")
    attns = _attention_layers(model)
    if any(isinstance(a, _MTAAttention) for a in attns):
        raise UserError(f"{where}: this model already has MTA layers; apply it once, to the original model")
    n = len(attns)
    chosen = _layer_ids(where, "layers", layers, n)
    conv = chosen if conv_layers is None else _layer_ids(where, "conv_layers", conv_layers, n)
    if not set(conv) <= set(chosen):
        raise UserError(f"{where}: conv_layers {sorted(set(conv) - set(chosen))} are not among layers {chosen}")
    config = model.config
    H = config.num_attention_heads
    dropout = float(getattr(config, "attention_dropout", 0.0) or 0.0)
    # The whole set of options, checked once here; each layer is built from the checked set.
    checked = validated_args(
        H, attns[0].head_dim, options, where, dropout=dropout, attn_impl=attn_impl, attn_block_size=attn_block_size
    )
    no_conv = dataclasses.replace(checked, **dict.fromkeys(CONV_OPTIONS))
    runtime: dict[str, Any] = dict(
        attn_impl=attn_impl, attn_block_size=attn_block_size, kernels=kernels, selfcheck=selfcheck
    )
    converted = []
    for i in chosen:
        attn = attns[i]
        w = attn.q_proj.weight
        mta = MultiTokenAttention.from_checked(
            checked if i in conv else no_conv,
            H,
            attn.head_dim,
            layer_id=i,
            dim=config.hidden_size,
            dropout=dropout,
            **runtime,
            device=w.device,
            dtype=w.dtype,
        )
        if mta.kind == "sdpa" and mta.subln is None and mta.gate is None:
            continue  # nothing of MTA in this layer (no convolution here, no mixing, norm or gate)
        attn.__class__ = _attention_class(type(attn))
        attn.mta = mta
        converted.append(i)
    if not converted:
        raise UserError(
            f"{where}: these options add nothing to layers {chosen} (no convolution, head mixing, group "
            "norm or gating): pass e.g. query_kernel_size=6, key_kernel_size=11"
        )
    setattr(
        config,
        CONFIG_KEY,
        {"layers": converted, "conv_layers": [i for i in conv if i in converted], "options": dict(options)},
    )


def saved_entry(config, where: str | None = None) -> dict:
    """config.json's ``mta_repro`` entry (what ``apply_mta`` wrote), checked before any model
    is built: its shape, the layer ids against the model's layers and the options (sizes
    included) against the model's heads and context. One line naming config.json."""
    if where is None:
        folder = getattr(config, "_name_or_path", "") or ""
        where = f"{folder}/config.json" if folder else "config.json"
    saved = getattr(config, CONFIG_KEY, None)
    keys = ("layers", "conv_layers", "options")
    if not isinstance(saved, dict) or sorted(saved) != sorted(keys):
        raise UserError(
            f"{where}: {CONFIG_KEY!r} is {saved!r}: expected an object with 'layers', 'conv_layers' and 'options', "
            "as apply_mta writes it"
        )
    n = getattr(config, "num_hidden_layers", None)
    for name in ("layers", "conv_layers"):
        ids = saved[name]
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise UserError(f"{where}: {CONFIG_KEY}.{name}={ids!r}: expected a list of 0-based layer ids")
        bad = [i for i in ids if not 0 <= i < (n if isinstance(n, int) else 0)]
        if bad:
            raise UserError(f"{where}: {CONFIG_KEY}.{name}: layer {bad[0]} is out of range for num_hidden_layers={n}")
    options = saved["options"]
    if not isinstance(options, dict) or not set(options) <= set(OPTIONS):
        unknown = sorted(set(options) - set(OPTIONS)) if isinstance(options, dict) else options
        raise UserError(
            f"{where}: {CONFIG_KEY}.options: unknown or malformed {unknown!r}; options: {', '.join(OPTIONS)}"
        )
    H, dim = getattr(config, "num_attention_heads", None), getattr(config, "hidden_size", None)
    head_dim = getattr(config, "head_dim", None) or (
        dim // H if isinstance(dim, int) and isinstance(H, int) and H else None
    )
    context = getattr(config, "max_position_embeddings", None)
    model = {"max_seqlen": context} if isinstance(context, int) and context > 0 else {}
    validated_args(H, head_dim, options, f"{where}: {CONFIG_KEY}.options", **model)  # type: ignore[arg-type]
    return saved


# --------------------------------------------------------------------------- layers
def _attention_layers(model: nn.Module) -> list[Any]:
    attns: list[Any] = [
        m for m in model.modules() if type(m).__name__ in ATTENTION_CLASSES or isinstance(m, _MTAAttention)
    ]
    if not attns:
        found = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.endswith("Attention")})
        raise UserError(
            f"apply_mta: no {' / '.join(ATTENTION_CLASSES)} layer in this {type(model).__name__} "
            f"(attention classes found: {found or 'none'}); supported: Llama, Qwen2, Mistral, Qwen3"
        )
    attns.sort(key=lambda m: m.layer_idx)
    return attns


def _layer_ids(where: str, name: str, spec, n: int) -> list[int]:
    if spec is None:
        return list(range(n))
    parts = spec.split(",") if isinstance(spec, str) else list(spec)
    try:
        ids = sorted({int(str(p).strip()) for p in parts if str(p).strip() != ""})
    except ValueError:
        raise UserError(f"{where}: {name}={spec!r}: expected 0-based layer ids (a list, or '2,6,10')") from None
    bad = [i for i in ids if not 0 <= i < n]
    if bad:
        raise UserError(f"{where}: {name}: layer {bad[0]} is out of range for a model of {n} layers (0-based)")
    return ids


class _MTAAttention:
    """Mixed into a converted layer's attention class: its forward with MTA in place of the
    attention function; everything else (projections, RoPE, cache) is the model's."""

    _rope: Callable[..., Any] | None = None  # the family's apply_rotary_pos_emb, set per class

    if TYPE_CHECKING:  # the attributes of the transformers attention class it is mixed into
        head_dim: int
        layer_idx: int
        scaling: float
        q_proj: nn.Linear
        k_proj: nn.Linear
        v_proj: nn.Linear
        o_proj: nn.Linear
        q_norm: nn.Module
        k_norm: nn.Module
        mta: MultiTokenAttention

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
        if cache is None:  # transformers before 5 called it past_key_value(s)
            cache = kwargs.pop("past_key_values", None) or kwargs.pop("past_key_value", None)
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(hidden_shape)
        k = self.k_proj(hidden_states).view(hidden_shape)
        if getattr(self, "q_norm", None) is not None:  # Qwen3: per-head norms before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        rope = type(self)._rope
        assert position_embeddings is not None and rope is not None
        cos, sin = position_embeddings
        q, k = rope(q, k, cos, sin)
        new = q.shape[2]
        past = 0
        if cache is not None:
            past = cache.get_seq_length(self.layer_idx)
            k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
            q = _with_query_history(cache, self.layer_idx, q, past, self.mta.query_history)
        if self.scaling != self.head_dim**-0.5:
            q = q * (self.scaling * self.head_dim**0.5)
        key_valid = _key_valid(attention_mask, q.shape[0], new, k.shape[2], past, self.layer_idx)
        out = self.mta(q, k, v, attention_mask=key_valid)[:, :, -new:]
        out = out.transpose(1, 2).reshape(*input_shape, -1).contiguous()
        return self.o_proj(out), None


def _key_valid(mask, batch: int, new: int, tk: int, past: int, layer_idx: int) -> torch.Tensor | None:
    """The (B, Tk) padding of the model's attention mask, which must be causal + padding.

    transformers hands the layer None (causal, no padding), a 2-D (B, Tk) mask (flash
    attention) or a 4-D (B, 1, new, Tk) one (bool: True attends; float: 0 attends), built as
    causal AND key padding. The last query row sees every real key, so its row is the
    padding; the whole mask is then compared with causal AND that padding."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise UserError(
            f"apply_mta: layer {layer_idx} got a {type(mask).__name__} attention mask; MTA layers run "
            "with attn_implementation 'sdpa', 'eager' or 'flash_attention_2'"
        )
    if mask.dim() == 2:
        return mask.bool()
    allowed = mask if mask.dtype == torch.bool else mask == 0
    if allowed.dim() != 4 or allowed.shape[-2:] != (new, tk):
        raise UserError(
            f"apply_mta: layer {layer_idx}: attention mask of shape {tuple(mask.shape)}, expected (B, 1, {new}, {tk})"
        )
    key_valid = allowed[:, 0, -1, :].expand(batch, tk)
    want = AttnMask(past).dense(new, tk, mask.device) & key_valid[:, None, None, :]
    if not torch.equal(allowed.expand_as(want), want):
        raise UserError(
            f"apply_mta: layer {layer_idx}: the model's attention mask is not causal + padding (a sliding "
            "window shorter than the sequence, packed sequences or a custom mask?); MTA layers attend to "
            "every earlier real token"
        )
    return key_valid


# ----------------------------------------------------------------------------- cache
class _QueryHistory(_CacheLayer):
    """Mixed into the cache layer of an MTA layer: besides its keys and values, the last
    ``w`` rotated queries (``mta_queries``, (B, H, <= w, d)), kept through beam search's
    reordering and batch selection. Cropping drops the cropped tokens' queries; a cache
    cropped below the history then refuses to continue (``is_croppable`` is False, so
    ``generate`` does not crop it on its own)."""

    mta_queries: torch.Tensor | None = None
    is_croppable = False

    def reorder_cache(self, beam_idx):
        super().reorder_cache(beam_idx)
        if self.mta_queries is not None:
            self.mta_queries = self.mta_queries.index_select(0, beam_idx.to(self.mta_queries.device))

    def batch_repeat_interleave(self, repeats: int):
        super().batch_repeat_interleave(repeats)
        if self.mta_queries is not None:
            self.mta_queries = self.mta_queries.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices):
        super().batch_select_indices(indices)
        if self.mta_queries is not None:
            self.mta_queries = self.mta_queries[indices, ...]

    def crop(self, tokens_to_remove: int):
        super().crop(tokens_to_remove)
        if self.mta_queries is not None and tokens_to_remove < 0:
            self.mta_queries = self.mta_queries[:, :, :tokens_to_remove]

    def reset(self):
        super().reset()
        self.mta_queries = None

    def offload(self):
        super().offload()
        if self.mta_queries is not None:
            self.mta_queries = self.mta_queries.to("cpu", non_blocking=True)

    def prefetch(self):
        super().prefetch()
        if self.mta_queries is not None and hasattr(self, "device"):
            self.mta_queries = self.mta_queries.to(self.device, non_blocking=True)


def _with_query_history(cache, layer_idx: int, q: torch.Tensor, past: int, w: int) -> torch.Tensor:
    """The new queries after the kept ones (``q_offset`` is then Tk - rows, the default), and
    the cache layer's history updated; the layer is replaced by a ``_QueryHistory`` subclass
    of its class, holding the same state, on first use."""
    if w == 0:
        return q
    layers = getattr(cache, "layers", None)
    if layers is None or layer_idx >= len(layers):
        raise UserError(
            f"apply_mta: a {type(cache).__name__} without per-layer storage (transformers >= 5's Cache "
            "with .layers); MTA layers need the model's DynamicCache"
        )
    layer = layers[layer_idx]
    from transformers.cache_utils import DynamicLayer

    if not isinstance(layer, DynamicLayer):  # a static cache's keys are padded to its length
        raise UserError(
            f"apply_mta: layer {layer_idx} got a {type(layer).__name__} cache layer; MTA layers need "
            "the model's DynamicCache (generate's default; not cache_implementation='static')"
        )
    if not isinstance(layer, _QueryHistory):
        if past:
            raise UserError(
                f"apply_mta: layer {layer_idx}'s cache holds {past} tokens but none of their queries "
                "(filled by a model without MTA?); start generation from an empty cache"
            )
        # the same state in a subclass that also keeps queries (in place of the cache's layer)
        cls = _subclass(type(layer), _QueryHistory)
        upgraded = cls.__new__(cls)
        vars(upgraded).update(vars(layer))
        layers[layer_idx] = layer = upgraded
    kept = layer.mta_queries
    need = min(w, past)
    if need:
        if kept is None or kept.shape[2] < need:
            raise UserError(
                f"apply_mta: layer {layer_idx}'s cache lost the last {need} queries MTA reads (cropped?); "
                "regenerate from the prompt"
            )
        q = torch.cat([kept[:, :, -need:], q], dim=2)
    layer.mta_queries = q[:, :, -w:]
    return q


# --------------------------------------------------------------------------- classes
_classes: dict = {}


def _subclass(base: type, mixin: type[T], **attrs) -> type[T]:
    """``MTA<base>``: ``mixin`` before ``base``, made once per base class and kept in this
    module under its name (so that pickling finds it)."""
    key = (base, mixin)
    if key not in _classes:
        name = f"MTA{base.__name__}"
        cls = type(name, (mixin, base), {"__module__": __name__, "__qualname__": name, **attrs})
        _classes[key] = cls
        setattr(sys.modules[__name__], name, cls)
    return _classes[key]


def _attention_class(base: type) -> type:
    rope = sys.modules[base.__module__].apply_rotary_pos_emb
    return _subclass(base, _MTAAttention, _rope=staticmethod(rope))


class MTAModel(_Model):
    """Mixed into a converted model's class (``modeling_mta.py`` builds them): built from a
    config that carries ``mta_repro`` (``from_pretrained``), it converts its layers."""

    def __init__(self, config, *args, **kwargs):
        if getattr(config, CONFIG_KEY, None) is None:  # the class would be the family's model, MTA left out
            folder = getattr(config, "_name_or_path", "") or ""
            raise UserError(
                f"{folder + '/' if folder else ''}config.json has no {CONFIG_KEY!r} entry: {type(self).__name__} "
                "would load it without MTA (its MTA tensors left out); restore the entry save_pretrained wrote, "
                "or load the base model with its own class and call apply_mta"
            )
        saved = saved_entry(config)  # before allocating
        super().__init__(config, *args, **kwargs)
        if saved and not any(isinstance(m, _MTAAttention) for m in self.modules()):
            insert_layers(self, saved["layers"], conv_layers=saved["conv_layers"], **saved["options"])


def checked_forward(base: type):
    """``base.forward`` behind the padding-mask check, with its signature (``wraps``): the
    HF Trainer keeps only the dataset columns that the forward's signature names."""

    @functools.wraps(base.forward)
    def forward(self, *args, **kwargs):
        _check_padding_mask(args, kwargs)
        return base.forward(self, *args, **kwargs)

    return forward


def _check_padding_mask(args: tuple, kwargs: dict) -> None:
    """A 2-D padding mask must have one entry per key: the cached tokens and the new ones
    (transformers would read a shorter or longer one shifted, and MTA's convolutions with it)."""
    mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return
    ids = kwargs.get("input_ids", args[0] if args else None)
    x = ids if isinstance(ids, torch.Tensor) else kwargs.get("inputs_embeds")
    if not isinstance(x, torch.Tensor):
        return
    cache = kwargs.get("past_key_values", kwargs.get("cache"))
    seq_length: Any = getattr(cache, "get_seq_length", None)
    past = int(seq_length()) if seq_length is not None else 0
    want = (x.shape[0], past + x.shape[1])
    if tuple(mask.shape) != want:
        raise UserError(
            f"apply_mta: attention_mask of shape {tuple(mask.shape)} for {x.shape[0]} sequences of {x.shape[1]} new "
            f"tokens after {past} cached ones: expected {want}, one entry per key (1 = token, 0 = padding)"
        )


AUTO_CLASSES = {
    "ForCausalLM": "AutoModelForCausalLM",
    "ForSequenceClassification": "AutoModelForSequenceClassification",
    "ForTokenClassification": "AutoModelForTokenClassification",
    "ForQuestionAnswering": "AutoModelForQuestionAnswering",
    "Model": "AutoModel",
}


def auto_class(base: type) -> str | None:
    """The transformers auto class that loads a model class of this head (None: another)."""
    return next((a for suffix, a in AUTO_CLASSES.items() if base.__name__.endswith(suffix)), None)
