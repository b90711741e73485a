"""The attention kernels, apart from the model that calls them.

- ``kq_conv_triton`` (CUDA) and ``kq_conv_cpu`` (C loops, ``kq_conv.c``): the key-query
  convolution of the ``blocked`` implementation;
- ``types``: what the model hands a kernel (``AttnMask``, ``ExplicitAttnParams``) and the
  kernels' tuning (``KernelTuning``, ``model.kernels``);
- ``triton_interp``: the fixes Triton's interpreter needs to run Triton kernels on CPU tensors.

Attention implementations outside the core (an experiment's kernels) live apart and
register by name (``mta_repro.model.attention_registry``); nothing here knows them.

Nothing here imports ``mta_repro.model``: the model picks a kernel
(``mta_repro.model.attention_ops``), a kernel only computes. Importing this package imports
neither triton nor a compiler.
"""
