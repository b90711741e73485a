"""Test-session setup shared by every test module."""

import os

# The tests run the Triton kernels (model.attn_impl=triton) on CPU tensors, in Triton's
# interpreter, GPU or not (on a GPU, scripts/bench_attention.py --device cuda runs them
# compiled). The variable must be set before the kernels are defined (first use).
os.environ.setdefault("TRITON_INTERPRET", "1")
