"""Hugging Face ``transformers`` checkpoints, both ways (needs the ``.[hf]`` extra).

    python -m mta_repro.hf export <run_dir|.pt> <out_dir>    # any of our runs -> a HF folder
    python -m mta_repro.hf import <hf_dir> <out.pt>          # LlamaForCausalLM (Llama 3.x) -> our baseline

Export. A baseline run becomes a plain ``LlamaForCausalLM`` folder (config.json,
model.safetensors, the tokenizer). MTA, talking-heads and Differential runs become a
folder with our own self-contained modeling file, loaded with
``AutoModelForCausalLM.from_pretrained(<dir>, trust_remote_code=True)``; both give our logits.

Import. A Llama checkpoint folder as downloaded (config.json, safetensors, sharded with
``model.safetensors.index.json`` or not; see docs/llama3.md) becomes a consolidated
``.pt`` of our baseline: grouped-query attention kept (``model.n_kv_heads``), tied or
untied embeddings, RoPE with Llama 3.1/3.2's ``rope_scaling`` (rope_type "llama3"), the
weights in the checkpoint's dtype, read one tensor at a time (an 8B import holds the
converted weights plus one shard, not two copies). Train from it with
``checkpoint.init_from=<out.pt>`` (``checkpoint.init_mode=baseline_to_mta``: Appendix I).

Layouts. Our attention rotates interleaved pairs of head dimensions (2i, 2i+1), Hugging
Face's Llama rotates the halves (i, i + d/2) with the same frequencies; permuting the
rows of each head of wq and wk maps one onto the other exactly (q.k is unchanged when q
and k are permuted alike). RMSNorm, SwiGLU and 1/sqrt(d) scaling match.

Refused with a clear error: rope_scaling types other than default and llama3, biases,
activations other than SiLU, ``pytorch_model.bin`` weights.
"""

from mta_repro.hf.convert import export_hf, hf_to_state, import_hf, state_to_hf

__all__ = ["export_hf", "hf_to_state", "import_hf", "state_to_hf"]
