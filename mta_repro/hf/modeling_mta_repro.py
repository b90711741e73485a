"""The modeling file of an exported MTA, talking-heads or Differential run: ``transformers``'
``MTAReproConfig``, ``MTAReproCache`` and ``MTAReproForCausalLM`` around this project's model.

``python -m mta_repro.hf export`` copies this module whole into the folder (``remote.py``);
``AutoModelForCausalLM.from_pretrained(<folder>, trust_remote_code=True)`` runs the copy,
which imports ``mta_repro.model``: the model code is the installed mta-repro's, so the
export computes what this project does and is never a second copy of the model. Where it
loads, mta-repro must be installed (from a clone or a wheel; docs/interop.md); config.json
records the version that wrote it (``mta_repro_version``). ``generate()`` decodes with
the model's own cache (``MTAReproCache``: keys, values and, for the key-query
convolutions, the last c_q - 1 queries), so each new token costs O(T) and the tokens equal
a full recompute's.
"""

from __future__ import annotations

import torch.nn.functional as F
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

# In a try block, so transformers' own check of the file's imports leaves this one to us
# and a missing package gets this message (mta-repro is not on a package index).
try:
    from mta_repro.errors import UserError
    from mta_repro.model.args import ModelArgs, MTAArgs
    from mta_repro.model.transformer import KVCache, Transformer
except ImportError as e:
    raise ImportError(
        f"this model folder's modeling_mta_repro.py runs the installed mta-repro, which does not import here "
        f"({e}): install mta-repro where you load it (from a clone or a wheel: pip install <clone or wheel>; "
        "the config.json's mta_repro_version names the version that wrote it)"
    ) from e


class MTAReproConfig(PretrainedConfig):
    model_type = "mta_repro"

    def __init__(self, mta_repro_args=None, **kwargs):
        # mta_repro's ModelArgs as a plain dict (field names of the official release)
        self.mta_repro_args = dict(mta_repro_args or {})
        a = self.mta_repro_args
        # The sizes under transformers' usual names, for tools that read them (lm-eval's
        # max length, accelerate's device maps); the model itself reads mta_repro_args.
        for name, value in (
            ("num_hidden_layers", a.get("n_layers")),
            ("hidden_size", a.get("dim")),
            ("num_attention_heads", a.get("n_heads")),
            ("num_key_value_heads", a.get("n_kv_heads") or a.get("n_heads")),
        ):
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
        # How the run computed (its implementation, block size and kernel tuning) is no
        # property of the model: the loading side runs its own defaults.
        for name in ("attn_impl", "attn_block_size", "kernels"):
            args.pop(name, None)
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

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        labels=None,
        cache=None,
        past_key_values=None,
        use_cache=None,
        **kwargs,
    ):
        """input_ids (B, T): the tokens after the cached ones; attention_mask (B, pos + T),
        0 at left padding. use_cache=True (or a cache passed) returns the cache."""
        state = cache if cache is not None else past_key_values
        if state is not None and not isinstance(state, KVCache):
            if getattr(state, "get_seq_length", lambda: 0)() != 0:
                raise UserError(
                    f"modeling_mta_repro: a {type(state).__name__} with tokens in it was passed; this model "
                    "keeps its own MTAReproCache (MTA needs query rows besides keys and values)"
                )
            state = None  # an empty foreign cache: start ours
        if state is None and use_cache:
            state = MTAReproCache.empty(len(self.model.layers))
        key_valid = None
        if attention_mask is not None and not attention_mask.all():
            key_valid = attention_mask.bool()
        logits = self.model(input_ids, cache=state, key_valid=key_valid)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        # our cache, not a transformers Cache: generate() only hands it back to this model
        cache_out: dict = {_CACHE_FIELD: state}
        return CausalLMOutputWithPast(loss=loss, logits=logits, **cache_out)

    def prepare_inputs_for_generation(
        self, input_ids, attention_mask=None, cache=None, past_key_values=None, use_cache=None, **kwargs
    ):
        state = cache if cache is not None else past_key_values
        if isinstance(state, KVCache) and state.pos:
            input_ids = input_ids[:, state.pos :]  # only the tokens the cache has not seen
        return {"input_ids": input_ids, "attention_mask": attention_mask, "cache": state, "use_cache": use_cache}

    def _reorder_cache(self, cache, beam_idx):  # transformers 5.x beam search asks the model
        return cache.reorder_cache(beam_idx)
