"""Hugging Face ``transformers`` checkpoints, both ways (needs the ``.[hf]`` extra).

    python -m mta_repro.hf export <run_dir|.pt> <out_dir>    # baseline -> LlamaForCausalLM
    python -m mta_repro.hf import <hf_dir> <out.pt>          # Llama (3.x layout) -> our baseline

Layouts. Our attention rotates interleaved pairs of head dimensions (2i, 2i+1), Hugging
Face's Llama rotates the halves (i, i + d/2) with the same frequencies; permuting the
rows of each head of wq and wk maps one onto the other exactly (q.k is unchanged when q
and k are permuted alike). Grouped-query checkpoints (Llama 3: 8 key/value heads) are
imported by repeating each key/value head for its group, which computes the same
attention. Tied embeddings stay tied; RMSNorm, SwiGLU and 1/sqrt(d) scaling match.

Not supported (clear errors): exporting MTA, talking-heads or Differential runs (no
self-contained modeling file yet), importing checkpoints with ``rope_scaling`` other
than the default (Llama 3.1/3.2's "llama3" scaling changes the frequencies), biases,
or activations other than SiLU.
"""

from mta_repro.hf.convert import export_hf, hf_to_state, import_hf, state_to_hf  # noqa: F401
