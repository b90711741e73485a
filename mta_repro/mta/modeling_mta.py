"""Model classes of Hugging Face models converted by ``mta_repro.mta.apply_mta``.

``save_pretrained`` copies this file into the model folder and names its class in
config.json's auto_map, so ``AutoModelForCausalLM.from_pretrained(folder,
trust_remote_code=True)`` builds ``MTALlamaForCausalLM`` (``MTAQwen2ForCausalLM``, ...): the
transformers class, converted from the folder's ``mta_repro`` options, then loaded. It needs
mta-repro installed where it is loaded (``pip install mta-repro``).
"""

from mta_repro.mta.hf_insertion import mta_model_class


def __getattr__(name: str):
    # MTA<transformers class name>, e.g. MTALlamaForCausalLM
    if name.startswith("MTA"):
        try:
            return mta_model_class(name)
        except AttributeError:
            pass
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
