"""Multi-Token Attention for any model: the op, the module, and MTA inserted into Hugging Face models.

    from mta_repro.mta import multi_token_attention, MultiTokenAttention, apply_mta

- ``multi_token_attention(q, k, v, ...)``: the whole of MTA on (B, H, T, d) tensors
  (``functional.py``), computed by this project's attention engine;
- ``MultiTokenAttention``: the parameters MTA adds to a layer, under the release's names
  and initialisations; the caller's model keeps its projections (``module.py``);
- ``apply_mta(model, layers=..., **options)``: a loaded ``transformers`` Llama, Qwen2 or
  Mistral model converted in place, the paper's Appendix I (``hf_insertion.py``; needs
  the ``hf`` extra, imported on first use).

Importing this package imports torch and the model code only: no Hydra, OmegaConf,
transformers, lm-eval or wandb. It sits on top of ``mta_repro.model`` and nothing in the
package imports it. docs/mta_op.md has the examples.
"""

from typing import TYPE_CHECKING

from mta_repro.mta.functional import multi_token_attention, query_history
from mta_repro.mta.module import MultiTokenAttention

if TYPE_CHECKING:  # imported on first use, by __getattr__ below
    from mta_repro.mta.hf_insertion import apply_mta, load_mta_pretrained

__all__ = ["MultiTokenAttention", "apply_mta", "load_mta_pretrained", "multi_token_attention", "query_history"]


def __getattr__(name: str):
    if name in ("apply_mta", "load_mta_pretrained"):  # needs transformers: imported when first asked for
        from mta_repro.mta import hf_insertion

        return getattr(hf_insertion, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
