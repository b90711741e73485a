"""Test-session setup shared by every test module."""

import os

import torch

# Without a GPU, the Triton kernels (model.attn_impl=triton) run in Triton's interpreter on
# CPU tensors. The variable must be set before the kernels are defined (first use).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
