"""Hugging Face ``transformers`` checkpoints, both ways (needs the ``.[hf]`` extra).

    python -m mta_repro.hf export <run_dir|.pt> <out_dir> [--force]  # any of our runs -> a HF folder
    python -m mta_repro.hf import <hf_dir> <out.pt>          # LlamaForCausalLM (Llama 3.x) -> our baseline

Export. A baseline run becomes a plain ``LlamaForCausalLM`` folder (config.json,
model.safetensors, the tokenizer). MTA, talking-heads and Differential runs become a
folder with our own modeling file, loaded with
``AutoModelForCausalLM.from_pretrained(<dir>, trust_remote_code=True)`` where mta-repro is
installed (the file imports ``mta_repro.model``); both give our logits.
Into a new, empty or earlier export folder only (``--force``: another), umask file modes.

Import. A Llama checkpoint folder as downloaded (sharded safetensors or not; docs/llama3.md)
becomes a consolidated ``.pt`` of our baseline: grouped-query attention, tied or untied
embeddings and Llama 3.1/3.2's ``rope_scaling`` (rope_type "llama3") kept, the weights in
the checkpoint's dtype, read one tensor at a time. Train from it with
``checkpoint.init_from=<out.pt>`` (``checkpoint.init_mode=baseline_to_mta``: Appendix I).
Our interleaved RoPE pairs (2i, 2i+1) are HF's halves (i, i + d/2) after permuting the rows
of each head of wq and wk (q.k is unchanged).

Refused in one line: rope_scaling types other than default and llama3, biases, activations
other than SiLU, ``pytorch_model.bin``; before any tensor is read, a damaged safetensors
header, a non-float or relabelled dtype, a shape that does not fit config.json (docs/trust.md).
"""

from mta_repro.hf.convert import export_hf, hf_to_state, import_hf, state_to_hf

__all__ = ["export_hf", "hf_to_state", "import_hf", "state_to_hf"]
