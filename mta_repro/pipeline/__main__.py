"""``python -m mta_repro.pipeline pipeline=<name> [root=DIR] [launcher=local|slurm] [--dry-run] [overrides]``

Runs the paper's protocol as one plan (configs/pipeline/<name>.yaml): training stages x
variants (+ sweep points), each in its own run directory under ``root``, hand-offs by
absolute paths, evaluation of each run, and a report over all of them in <root>/report.

    python -m mta_repro.pipeline pipeline=tiny root=runs/tiny            # CPU, minutes
    python -m mta_repro.pipeline pipeline=paper_880m root=/scratch/mta launcher=slurm --dry-run
    python -m mta_repro.pipeline pipeline=paper_880m root=/scratch/mta launcher=slurm

``--dry-run`` prints the plan (and with launcher=slurm every sbatch script). Rerunning the
same command skips the jobs that are done and resumes the others (training resumes from
its checkpoints); with launcher=slurm it submits what is not done and not still queued,
chained with --dependency=afterok. Overrides change the plan like any Hydra config:
``pipeline.variants=[baseline,mta]``, ``pipeline.train_overrides=[...]``.
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

from mta_repro.errors import UserError

LAUNCHERS = ("local", "slurm")


def build_plan(overrides: Sequence[str]):
    from omegaconf import OmegaConf

    from mta_repro.config import compose
    from mta_repro.pipeline.plan import Plan

    cfg = compose(list(overrides), config_name="run_pipeline")
    if cfg.launcher not in LAUNCHERS:
        raise UserError(f"launcher: expected one of {LAUNCHERS}, got {cfg.launcher!r}")
    OmegaConf.resolve(cfg)
    return Plan(cfg.pipeline, cfg.root, python=cfg.python or sys.executable), cfg


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    dry_run = "--dry-run" in argv
    overrides = [a for a in argv if a != "--dry-run"]
    bad = [a for a in overrides if a.startswith("--")]
    if bad:
        print(f"error: unknown option {bad[0]} (options: --dry-run, --help; the rest are Hydra overrides)",
              file=sys.stderr)
        return 2
    try:
        plan, cfg = build_plan(overrides)
        from mta_repro.pipeline.run import main_run

        return main_run(plan, cfg.launcher, dry_run)
    except Exception as e:  # a bad config or override (or a refused sbatch): one line
        from mta_repro.cli import describe, user_errors

        if not isinstance(e, (*user_errors(), RuntimeError)):
            raise
        print(f"error: {describe(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
