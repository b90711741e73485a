"""The paper's protocol as one pipeline: ``python -m mta_repro.pipeline pipeline=<name>``.

Stages (pretrain -> long-context finetune / MTA insertion -> evaluation -> report) x
variants (+ sweeps), each stage in its own run directory under one root, hand-offs by
absolute paths, run locally one after another or submitted to SLURM with
``--dependency=afterok``. See ``mta_repro.pipeline.plan`` and ``configs/pipeline/``.
"""
