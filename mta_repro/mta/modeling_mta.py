"""Model classes of Hugging Face models converted by ``mta_repro.mta.apply_mta``.

``save_pretrained`` copies this file into the model folder and names the model's class in
config.json's auto_map, so ``AutoModelForCausalLM.from_pretrained(folder,
trust_remote_code=True)`` builds ``MTALlamaForCausalLM`` (``MTAQwen2ForCausalLM``, ...): the
transformers class, converted from the folder's ``mta_repro`` options, then loaded. The
four causal-LM classes are defined here; another head of these families
(``MTALlamaForSequenceClassification``, ...) is built on first use, in this module too.
It needs mta-repro installed where it is loaded (from a clone, or a wheel built from one).
"""

from __future__ import annotations

import transformers
from transformers import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

from mta_repro.mta.hf_layers import MTAModel, auto_class, checked_forward


class MTALlamaForCausalLM(MTAModel, LlamaForCausalLM):
    forward = checked_forward(LlamaForCausalLM)


class MTAQwen2ForCausalLM(MTAModel, Qwen2ForCausalLM):
    forward = checked_forward(Qwen2ForCausalLM)


class MTAMistralForCausalLM(MTAModel, MistralForCausalLM):
    forward = checked_forward(MistralForCausalLM)


class MTAQwen3ForCausalLM(MTAModel, Qwen3ForCausalLM):
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
