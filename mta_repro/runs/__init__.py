"""Running jobs safely in run directories, below the trainer: a run dir's lock
(``runlock``), its start and record of the command (``rundir``), its provenance record
(``provenance``: what the numbers came from), the stop signals' protocol (``signals``), and
what a job needs at its start (``jobcheck``). The trainer (``mta_repro.train``), the
evaluation and the pipeline's engine (``mta_repro.pipeline``: plans, sweeps, SLURM
submission) build on it."""
