"""Model classes of Hugging Face models converted by ``mta_repro.mta.apply_mta``.

``save_pretrained`` copies this file into the model folder and names the model's class in
config.json's auto_map, so ``AutoModelForCausalLM.from_pretrained(folder,
trust_remote_code=True)`` builds ``MTALlamaForCausalLM`` (``MTAQwen2ForCausalLM``, ...): the
transformers class, converted from the folder's ``mta_repro`` options, then loaded. Its
config is ``MTALlamaConfig`` (model_type ``mta_llama``, ...): a load without this file
fails instead of giving the family's model without MTA. The
four causal-LM classes are defined here; another head of these families
(``MTALlamaForSequenceClassification``, ...) is built on first use, in this module too.
It needs mta-repro installed where it is loaded (from a clone, or a wheel built from one).
"""

from __future__ import annotations

import transformers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from mta_repro.mta.hf_layers import MTAModel, auto_class, checked_forward


# The configs of converted models: the family's config under a model_type of its own
# ("mta_llama"), so that config.json names no architecture transformers knows: a plain
# ``AutoModelForCausalLM.from_pretrained(folder)`` refuses the folder (it needs this file,
# trust_remote_code=True) instead of building the family's model without MTA.
class MTALlamaConfig(LlamaConfig):
    model_type = "mta_llama"


class MTAQwen2Config(Qwen2Config):
    model_type = "mta_qwen2"


class MTAMistralConfig(MistralConfig):
    model_type = "mta_mistral"


class MTAQwen3Config(Qwen3Config):
    model_type = "mta_qwen3"


CONFIG_CLASSES: dict[type, type] = {
    LlamaConfig: MTALlamaConfig,
    Qwen2Config: MTAQwen2Config,
    MistralConfig: MTAMistralConfig,
    Qwen3Config: MTAQwen3Config,
}
for _base, _cfg in CONFIG_CLASSES.items():
    _cfg.register_for_auto_class()  # save_pretrained's auto_map entry "AutoConfig"
    # heads that build their body with AutoModel.from_config (sequence classification, ...):
    # the family's body for its MTA config (the mapping's own register: AutoModel.register
    # would refuse a body whose config_class is the family's)
    transformers.AutoModel._model_mapping.register(_cfg, transformers.AutoModel._model_mapping[_base], exist_ok=True)


def mta_config_class(base: type) -> type:
    """The MTA config class of a family's config class (itself if it is one already)."""
    if base in CONFIG_CLASSES.values():
        return base
    if base not in CONFIG_CLASSES:
        raise TypeError(f"no MTA config for {base.__name__}; families: Llama, Qwen2, Mistral, Qwen3")
    return CONFIG_CLASSES[base]


class MTALlamaForCausalLM(MTAModel, LlamaForCausalLM):
    config_class = MTALlamaConfig
    forward = checked_forward(LlamaForCausalLM)


class MTAQwen2ForCausalLM(MTAModel, Qwen2ForCausalLM):
    config_class = MTAQwen2Config
    forward = checked_forward(Qwen2ForCausalLM)


class MTAMistralForCausalLM(MTAModel, MistralForCausalLM):
    config_class = MTAMistralConfig
    forward = checked_forward(MistralForCausalLM)


class MTAQwen3ForCausalLM(MTAModel, Qwen3ForCausalLM):
    config_class = MTAQwen3Config
    forward = checked_forward(Qwen3ForCausalLM)


_classes: dict[type, type] = {
    LlamaForCausalLM: MTALlamaForCausalLM,
    Qwen2ForCausalLM: MTAQwen2ForCausalLM,
    MistralForCausalLM: MTAMistralForCausalLM,
    Qwen3ForCausalLM: MTAQwen3ForCausalLM,
}
for _cls in _classes.values():
    _cls.register_for_auto_class("AutoModelForCausalLM")  # save_pretrained's auto_map entry


def mta_model_class(base: type | str) -> type:
    """``MTA<base>`` for a transformers model class (or its name, with or without the
    prefix): what ``apply_mta`` turns a model into and ``from_pretrained`` builds. Made
    once per class and kept in this module under its name (``save_pretrained`` copies
    this file; pickling finds the class here)."""
    if isinstance(base, str):
        name = base.removeprefix("MTA")
        found = getattr(transformers, name, None)
        if not isinstance(found, type):
            raise AttributeError(f"transformers has no model class {name!r}")
        base = found
    if issubclass(base, MTAModel):
        return base
    if base not in _classes:
        name = f"MTA{base.__name__}"
        cls = type(name, (MTAModel, base), {"__module__": __name__, "__qualname__": name})
        cls.forward = checked_forward(base)
        cls.config_class = mta_config_class(base.config_class)
        auto = auto_class(base)
        if auto is not None:
            cls.register_for_auto_class(auto)
        globals()[name] = _classes[base] = cls
    return _classes[base]


def __getattr__(name: str):
    # MTA<transformers class name> of a head not defined above, e.g. MTALlamaForSequenceClassification
    if name.startswith("MTA"):
        try:
            return mta_model_class(name)
        except AttributeError:
            pass
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
