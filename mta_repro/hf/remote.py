"""Export of MTA, talking-heads and Differential runs to a Hugging Face folder that
``transformers`` loads with ``trust_remote_code=True``.

The folder's ``modeling_mta_repro.py`` is self-contained: it is this project's own model
code (``BUNDLED``: ``mta_repro/model/args.py``, ``attention_{math,blocked,registry}.py``, ``transformer.py``, and
``mta_repro/kernels/conv_pad.py``, ``tuning.py``, ``interface.py``) bundled into one module at export time,
with the package imports rewritten to point inside it, plus a thin ``PreTrainedModel``
wrapper. So the exported model computes exactly what ours does
(the reference explicit path and ``F.conv2d``; no C kernel, no mta_repro install needed),
and the file is never a second copy of the model to keep in sync by hand.
``generate()`` decodes with the model's own cache (``MTAReproCache``: keys, values and,
for the key-query convolutions, the last c_q - 1 queries), the state ``python -m
mta_repro.eval.generate`` keeps, so each new token costs O(T) and the tokens equal a full
recompute's.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import torch

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # mta_repro/
MODULE = "modeling_mta_repro"

_HEADER = '''"""Self-contained modeling file written by mta-repro's `python -m mta_repro.hf export`
(the project's mta_repro/model/{args,attention_math,attention_blocked,attention_registry,transformer}.py and
mta_repro/kernels/{conv_pad,tuning,interface}.py bundled into one module, plus a transformers wrapper). Load with
AutoModelForCausalLM.from_pretrained(<folder>, trust_remote_code=True)."""

from __future__ import annotations

import sys as _sys
import types as _types

# The bundled sources call each other as modules (attention_ops.sdpa, ...): here they are
# all this one module. The CPU C kernel of mta-repro is not bundled (F.conv2d is used).
attention_ops = _sys.modules[__name__]
kq_conv_cpu = _types.SimpleNamespace(available=lambda x: False)
UserError = ValueError  # mta_repro.errors.UserError is a ValueError
'''

_WRAPPER = '''

# ------------------------------------------------------------------ transformers wrapper
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel  # noqa: E402
from transformers.modeling_outputs import CausalLMOutputWithPast  # noqa: E402


class MTAReproConfig(PretrainedConfig):
    model_type = "mta_repro"

    def __init__(self, mta_repro_args=None, **kwargs):
        # mta_repro's ModelArgs as a plain dict (field names of the official release)
        self.mta_repro_args = dict(mta_repro_args or {})
        a = self.mta_repro_args
        # The sizes under transformers' usual names, for tools that read them (lm-eval's
        # max length, accelerate's device maps); the model itself reads mta_repro_args.
        for name, value in (("num_hidden_layers", a.get("n_layers")), ("hidden_size", a.get("dim")),
                            ("num_attention_heads", a.get("n_heads")),
                            ("num_key_value_heads", a.get("n_kv_heads") or a.get("n_heads"))):
            kwargs.setdefault(name, value)
        kwargs.setdefault("tie_word_embeddings", False)  # tying lives inside the model
        super().__init__(**kwargs)


class MTAReproCache(KVCache):
    """The decoding state ``generate`` carries between steps: per layer the rotated keys
    and values (n_kv_heads heads) and, in MTA layers, the last c_q - 1 rotated queries
    whose score rows the key-query convolution reads; ``pos`` tokens consumed so far.
    Each new token costs one score row per kept query against the T cached keys: O(T)."""

    def get_seq_length(self, layer_idx=0):
        return self.pos

    def reorder_cache(self, beam_idx):  # beam search: keep the chosen beams' rows
        for layer in self.layers:
            for name in ("k", "v", "q"):
                t = getattr(layer, name)
                if t is not None:
                    setattr(layer, name, t.index_select(0, beam_idx.to(t.device)))
        return self


# The output's cache field: "past_key_values" in transformers 4.x, "cache" in 5.x (whose
# generate() reads only that name back into the next step).
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


class MTAReproForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = MTAReproConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _supports_cache_class = False  # transformers 4.x: no DynamicCache, ours instead

    def __init__(self, config):
        super().__init__(config)
        args = dict(config.mta_repro_args)
        args["mta"] = MTAArgs(**args.get("mta", {}))
        args["attn_impl"] = "torch"
        self.model = Transformer(ModelArgs(**args))
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls):
        # transformers' DynamicCache holds keys and values only; MTA also needs the last
        # query rows, so generate() leaves the cache to prepare_inputs_for_generation.
        return False

    def _init_weights(self, module):  # weights come from the checkpoint
        pass

    def get_input_embeddings(self):
        return self.model.tok_embeddings

    def get_output_embeddings(self):
        # the head: the token embedding itself under weight tying (every release config)
        return self.model.tok_embeddings if self.model.args.weight_tying else self.model.output

    def forward(self, input_ids=None, attention_mask=None, labels=None, cache=None, past_key_values=None,
                use_cache=None, **kwargs):
        """input_ids (B, T): the tokens after the cached ones; attention_mask (B, pos + T),
        0 at left padding. use_cache=True (or a cache passed) returns the cache."""
        state = cache if cache is not None else past_key_values
        if state is not None and not isinstance(state, KVCache):
            if getattr(state, "get_seq_length", lambda: 0)() != 0:
                raise UserError(
                    f"modeling_mta_repro: a {type(state).__name__} with tokens in it was passed; this model "
                    "keeps its own MTAReproCache (MTA needs query rows besides keys and values)")
            state = None  # an empty foreign cache: start ours
        if state is None and use_cache:
            state = MTAReproCache.empty(len(self.model.layers))
        key_valid = None
        if attention_mask is not None and not attention_mask.all():
            key_valid = attention_mask.bool()
        logits = self.model(input_ids, cache=state, key_valid=key_valid)
        loss = None
        if labels is not None:
            import torch.nn.functional as _F

            loss = _F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{_CACHE_FIELD: state})

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, cache=None, past_key_values=None,
                                      use_cache=None, **kwargs):
        state = cache if cache is not None else past_key_values
        if isinstance(state, KVCache) and state.pos:
            input_ids = input_ids[:, state.pos:]  # only the tokens the cache has not seen
        return {"input_ids": input_ids, "attention_mask": attention_mask, "cache": state, "use_cache": use_cache}

    def _reorder_cache(self, cache, beam_idx):  # transformers 5.x beam search asks the model
        return cache.reorder_cache(beam_idx)
'''


def _strip_package_imports(src: str) -> str:
    """Drop ``from __future__`` and the intra-package imports (everything is one module now)."""
    out = []
    for line in src.splitlines():
        s = line.strip()
        if s.startswith("from __future__"):
            continue
        if re.match(r"from mta_repro\.((model|kernels)(\.\w+)?|errors) import", s):
            indent = line[: len(line) - len(line.lstrip())]
            if indent:  # a function-local import: keep the block non-empty
                out.append(indent + "pass")
            continue
        out.append(line)
    return "\n".join(out)


# The model's source files, in dependency order (paths under mta_repro/).
BUNDLED = (
    "kernels/conv_pad.py",
    "kernels/tuning.py",
    "kernels/interface.py",
    "model/args.py",
    "model/attention_math.py",
    "model/attention_blocked.py",
    "model/attention_registry.py",
    "model/transformer.py",
)


def modeling_source() -> str:
    parts = [_HEADER]
    for name in BUNDLED:
        src = (PACKAGE_DIR / name).read_text()
        parts.append(f"\n# {'-' * 60} mta_repro/{name}\n" + _strip_package_imports(src))
    parts.append(_WRAPPER)
    return "\n".join(parts)


def export_remote(model, out_dir: Path, bos_id=None, eos_id=None) -> Path:
    """Write config.json (with auto_map), model.safetensors and the modeling file."""
    from safetensors.torch import save_file

    args = dataclasses.asdict(model.args)
    # How this machine's kernels were tuned (model.kernels) is no property of the model: the
    # loading side runs its defaults (the bundled reference path) whatever was set here.
    args.pop("kernels", None)
    config = {
        "architectures": ["MTAReproForCausalLM"],
        "model_type": "mta_repro",
        "auto_map": {"AutoConfig": f"{MODULE}.MTAReproConfig", "AutoModelForCausalLM": f"{MODULE}.MTAReproForCausalLM"},
        "mta_repro_args": args,
        "vocab_size": model.args.vocab_size,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "tie_word_embeddings": False,
        "use_cache": True,
        "torch_dtype": "float32",
    }
    import json

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    (out_dir / f"{MODULE}.py").write_text(modeling_source())
    sd = {f"model.{k}": v.detach().to(torch.float32).contiguous() for k, v in model.state_dict().items()}
    save_file(sd, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir
