"""Training: FSDP2 pretraining with exact checkpoint/resume (``python -m mta_repro.train``).

Modules: ``optim`` (AdamW + schedule), ``distributed`` (process group, FSDP2, init),
``checkpoint`` (DCP, atomic, keep-last-K, resume), ``export`` (consolidated file),
``metrics`` (metrics.jsonl, wandb, MFU), ``config_check`` (what may differ on resume; a
start's config check), ``loop`` (the loop), ``attn_selfcheck`` (the attention self-check at
a start), ``stage_weights`` (``checkpoint.init_from``), ``plugins`` (``module:function``
fields). The run directory's lock, record, provenance and stop signals are
``mta_repro.runs``'s; sweeps and SLURM submission are the pipeline's engine's.
"""
