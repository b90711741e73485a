"""Estimates made without running the work: parameter and FLOP counts (``params``,
``flops``) and the per-GPU memory pre-flight (``memory``).

    python -m mta_repro.estimate model=880m attention=mta   # counts (see ``params``)
    python -m mta_repro.estimate experiment=pretrain_880m_mta --memory
"""
