"""Training: FSDP2 pretraining with exact checkpoint/resume (``python -m mta_repro.train``).

Modules: ``optim`` (AdamW + schedule), ``distributed`` (process group, FSDP2, init),
``checkpoint`` (DCP, atomic, keep-last-K, resume), ``export`` (consolidated file),
``metrics`` (metrics.jsonl, wandb, MFU), ``signals`` (preemption, Ctrl-C), ``rundir``
(a start's steps: config.yaml, failed-start cleanup), ``runlock`` (the run dir's lock),
``config_check`` (what may differ on resume), ``provenance`` (what a run's numbers came
from: recorded, compared), ``loop`` (the loop), ``attn_selfcheck`` (the attention
self-check at a start), ``stage_weights`` (``checkpoint.init_from``), ``plugins``
(``module:function`` fields), ``slurm`` (sbatch rendering / dry-run).
"""
