"""Estimates made without running the work: parameter and FLOP counts (``params``,
``flops``), the per-GPU memory pre-flight (``memory``) and the roofline judge of what the
Triton kernels compile to (``roofline``, used by ``scripts/compile_triton.py``).

    python -m mta_repro.estimate model=880m attention=mta   # counts (see ``params``)
    python -m mta_repro.estimate experiment=pretrain_880m_mta --memory
"""
