"""EXPERIMENTAL: MTA's whole explicit score path in Triton kernels, ``model.attn_impl=triton``.
Exact against the float64 reference in Triton's interpreter; never run on a GPU: its speed
is an estimate from its sm_90 compile. README.md says what it is, where it stands, its owner
and when it goes; design.md the design and the estimates.

- ``impl``: the registry entry (pyproject.toml's entry point ``triton``) and what the
  memory pre-flight and the FLOP count ask of it; ``options``: its own tuning
  (``model.kernels.impl_options.triton``);
- ``stored``: kq-conv layers (the convolved scores stored); ``fused``: every other layer;
- ``jit_helpers``: their shared ``@triton.jit`` helpers; ``launch``: their shared host side;
- ``tiles``: their geometry, schedule and buffers (no triton);
- ``compile_report``, ``roofline``, ``ir_hazards``: the static judge of their sm_90 compile.

Importing this package imports nothing else.
"""
