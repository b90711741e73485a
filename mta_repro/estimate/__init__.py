"""Estimates made without running the work: parameter and FLOP counts (``params``), the memory
pre-flight the trainer calls before it builds the model (``memory``: one step on ``meta``;
``memory_check``: against the device's or the process's limits; ``cpu_malloc``: glibc's mmap
threshold) and PyTorch's FSDPMemTracker beside it (``memory_tracker``). ``cli`` is the command:

    python -m mta_repro.estimate model=880m attention=mta   # counts
    python -m mta_repro.estimate experiment=pretrain_880m_mta --memory
"""
