"""The attention kernels, apart from the model that calls them.

- ``attention_triton``: MTA's whole explicit score path fused in Triton (``model.attn_impl=triton``),
  with its tile geometry and work schedule in ``frames``;
- ``kq_conv_triton`` (CUDA) and ``kq_conv_cpu`` (C loops, ``kq_conv.c``): the key-query
  convolution of the ``blocked`` implementation;
- ``types``: what the model hands a kernel (``AttnMask``, ``ExplicitAttnParams``);
- ``triton_interp``: the fixes Triton's interpreter needs to run the kernels on CPU tensors.

Nothing here imports ``mta_repro.model``: the model picks a kernel
(``mta_repro.model.attention_ops``), a kernel only computes. Importing this package imports
neither triton nor a compiler.
"""
