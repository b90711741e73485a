"""MTA inserted into a loaded Hugging Face model in place: the paper's Appendix I for ``transformers``.

``apply_mta(model, layers=..., **options)`` gives the chosen attention layers of a Llama,
Qwen2, Mistral or Qwen3 model (the families that share Llama's attention) a
``MultiTokenAttention`` child (``self_attn.mta``) with the release's identity
initialisation, so the model computes what it computed before until training moves the
new parameters (group norm and gating are not identities: they change it at once). The
projections, RoPE, masks and KV cache remain the model's own: an MTA layer reads the
rotated queries, the keys and values the model's ``DynamicCache`` returns, and keeps in
that cache's layer the (c_q - 1) + (c_q' - 1) last queries its convolutions read, so a new
token costs one score row per kept query (O(T)); that layer side is ``hf_layers.py``.
The converted model's class becomes ``MTA<Family>ForCausalLM`` (a subclass, defined in
``modeling_mta.py``), so ``save_pretrained`` writes that small file and the options
(``config.mta_repro``) beside the weights, and ``from_pretrained(dir,
trust_remote_code=True)`` or ``load_mta_pretrained(dir)`` rebuilds the same model
(mta-repro installed on the loading side). Imports go one way: this module ->
``modeling_mta.py`` -> ``hf_layers.py``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from torch import nn

from mta_repro.errors import UserError
from mta_repro.kernels.tuning import KernelTuning
from mta_repro.mta.hf_layers import ATTENTION_CLASSES, CONFIG_KEY, MTAModel, insert_layers, saved_entry
from mta_repro.mta.modeling_mta import CONFIG_CLASSES, mta_config_class, mta_model_class

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def apply_mta(
    model: PreTrainedModel,
    layers: None | str | Sequence[int] = None,
    *,
    conv_layers: None | str | Sequence[int] = None,
    attn_impl: str = "blocked",
    attn_block_size: int | None = None,
    kernels: KernelTuning | None = None,
    selfcheck: str | None = None,
    **options,
) -> PreTrainedModel:
    """Convert ``model`` (a loaded ``transformers`` Llama, Qwen2, Mistral or Qwen3 model) in
    place and return it.

    layers: 0-based layer ids (a list or the release's "2,6,10" string; None: every layer)
    that get MTA; the others stay as they are. conv_layers: those of them that also get the
    key-query convolutions (None: all of ``layers``), as the release's ``mta_layers`` (its
    880M config: head mixing, group norm and gating in every layer, convolutions in every
    fourth). options: ``MultiTokenAttention``'s (the release's ``model.mta`` fields:
    query_kernel_size, key_kernel_size, after_sm_*, pad_key, pre_sm_linear_head,
    head_kernel_size, post_sm_linear_head, group_norm, layer_norm_rescale, add_gating,
    gate_1d, init_method). attn_impl, attn_block_size, kernels, selfcheck: how the layers
    compute (``multi_token_attention``). The new parameters take the dtype and device of
    the layer's projections; ``model.config.attention_dropout`` is their dropout.
    """
    insert_layers(
        model,
        layers,
        conv_layers=conv_layers,
        attn_impl=attn_impl,
        attn_block_size=attn_block_size,
        kernels=kernels,
        selfcheck=selfcheck,
        **options,
    )
    if not isinstance(model, MTAModel) and hasattr(model, "save_pretrained"):
        model.__class__ = mta_model_class(type(model))
        # config.json's model_type becomes mta_<family>: no plain load builds it without MTA
        model.config.__class__ = mta_config_class(type(model.config))
    return model


def _saved_config(path):
    """The folder's config: an MTA config class of ours (model_type ``mta_<family>``), or the
    family's for a folder saved before converted configs had their own model_type."""
    import transformers

    # transformers' own reading of config.json (a local folder or a hub name), as from_pretrained's
    model_type = transformers.PretrainedConfig.get_config_dict(path)[0].get("model_type")
    ours = {c.model_type: c for c in CONFIG_CLASSES.values()}
    if model_type in ours:
        return ours[model_type].from_pretrained(path)
    return transformers.AutoConfig.from_pretrained(path)


def load_mta_pretrained(path, **kwargs) -> nn.Module:
    """A model ``save_pretrained`` wrote after ``apply_mta``, without trusting remote code:
    its ``MTA<Family>ForCausalLM`` class from the installed mta-repro, the MTA options from
    its config.json. kwargs go to ``from_pretrained`` (torch_dtype, device_map, ...)."""
    import transformers

    config = _saved_config(path)
    if not getattr(config, CONFIG_KEY, None):
        raise UserError(
            f"load_mta_pretrained: {path}/config.json has no {CONFIG_KEY!r} entry: not a model saved "
            "after apply_mta (load it with from_pretrained and call apply_mta)"
        )
    where = f"load_mta_pretrained: {path}/config.json"
    archs = getattr(config, "architectures", None)
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise UserError(
            f"{where}: architectures={archs!r}: expected a list naming the model class, as save_pretrained writes it"
        )
    arch = archs[0].removeprefix("MTA")
    base = getattr(transformers, arch, None)
    if not isinstance(base, type) or not issubclass(base, transformers.PreTrainedModel):
        raise UserError(
            f"{where} names architecture {arch!r}, which is no model class of this "
            f"transformers {transformers.__version__}"
        )
    family = sys.modules.get(base.__module__)
    if not any(hasattr(family, a) for a in ATTENTION_CLASSES):
        raise UserError(
            f"{where}: architecture {arch!r} has none of the attention layers MTA goes into "
            f"({', '.join(ATTENTION_CLASSES)})"
        )
    saved_entry(config, where)  # before from_pretrained allocates the model
    return mta_model_class(base).from_pretrained(path, config=config, **kwargs)
