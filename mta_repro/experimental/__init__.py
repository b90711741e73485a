"""Experiments: code that has not proven itself where it matters, kept apart from the core.

Each subpackage is one experiment, with a README that says what it is, where it stands, who
owns it and when it is removed. The dependency runs one way: an experiment imports the core,
nothing outside this folder imports an experiment (tests/test_house.py walks every import,
lazy ones included), and the core runs and passes its tests without any of them. An
experiment plugs in through one of the core's extension points, e.g. an attention
implementation through the entry-point group ``mta_repro.attn_impls`` in pyproject.toml.

- ``fused_triton``: MTA's whole explicit score path in Triton kernels (``model.attn_impl=triton``).
"""
