"""``python -m mta_repro.pipeline pipeline=<name> [root=DIR] [launcher=local|slurm] [--plan|--dry-run] [overrides]``

Runs the paper's protocol as one plan (configs/pipeline/<name>.yaml): training stages x
variants (+ sweep points), each in its own run directory under ``root``, hand-offs by
absolute paths, evaluation of each run, and a report over all of them in <root>/report.

    python -m mta_repro.pipeline pipeline=tiny root=runs/tiny            # CPU, minutes
    python -m mta_repro.pipeline pipeline=paper_880m root=/scratch/mta launcher=slurm --dry-run
    python -m mta_repro.pipeline pipeline=paper_880m root=/scratch/mta launcher=slurm

``--plan`` prints the job table alone (one line a job, done or to do, its run directory
and dependencies); ``--dry-run`` adds each job's command (and with launcher=slurm every
sbatch script). With launcher=slurm, --plan, --dry-run and the submission check what the
jobs need at their start (the data root and its domains, the tokenizer, sources, a
writable root): each missing one is a line, exit status 2, nothing queued; ``--no-check``
skips that for paths that exist only on the compute nodes. ``pipeline.slurm`` sets the
resources of the evaluation, check and report jobs, and its partition, account, qos and
constraint apply to every job (training jobs take their size from the experiment).
``paper_880m`` alone means ``pipeline=paper_880m``. Rerunning the
same command skips the jobs that are done and resumes the others (training resumes from
its checkpoints); with launcher=slurm it submits what is not done and not still queued,
chained with --dependency=afterok. Overrides change the plan like any Hydra config:
``pipeline.variants=[baseline,mta]``, ``pipeline.train_overrides=[...]``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from mta_repro.errors import UserError

LAUNCHERS = ("local", "slurm")


def build_plan(overrides: Sequence[str]):
    from omegaconf import OmegaConf

    from mta_repro.pipeline.plan import PIPELINE_KEYS, Plan
    from mta_repro.train.config import compose

    overrides = [_plan_field(o, PIPELINE_KEYS) for o in overrides]
    cfg = compose(list(overrides), config_name="run_pipeline")
    if cfg.launcher not in LAUNCHERS:
        raise UserError(f"launcher: expected one of {LAUNCHERS}, got {cfg.launcher!r}")
    OmegaConf.resolve(cfg)
    return Plan(cfg.pipeline, cfg.root, python=cfg.python or sys.executable), cfg


def _plan_field(o: str, fields) -> str:
    """``pipeline.seeds=[0,1]``, a field of the plan that a pipeline config may leave unset,
    as ``++pipeline.seeds=[0,1]`` (set or add): the plain spelling works as ``+`` does, and
    the plan's own check still names a field it does not know."""
    key = o.partition("=")[0]
    parts = key.split(".")
    return f"++{o}" if len(parts) == 2 and parts[0] == "pipeline" and parts[1] in fields else o


def _bare_name(arg: str) -> str:
    """``paper_880m`` (no ``=``) means ``pipeline=paper_880m`` when such a pipeline exists."""
    if "=" in arg or arg.startswith("~"):  # key=value, or Hydra's ~key (delete)
        return arg
    from mta_repro.cli import unknown_option_line
    from mta_repro.train.config import CONFIG_DIR

    names = sorted(p.stem for p in (CONFIG_DIR / "pipeline").glob("*.yaml"))
    if arg in names:
        return f"pipeline={arg}"
    raise UserError(
        f"{arg!r} is neither an override (key=value) nor a pipeline name; "
        + unknown_option_line("pipeline", arg, names)
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    from mta_repro.cli import check_split_lists, run_cli
    from mta_repro.runs.jobcheck import NO_CHECK, raise_problems

    flags = ("--dry-run", "--plan", NO_CHECK)
    dry_run, plan_only, check = "--dry-run" in argv, "--plan" in argv, NO_CHECK not in argv
    overrides = [a for a in argv if a not in flags]

    def go() -> int:
        bad = [a for a in overrides if a.startswith("--")]
        if bad:
            raise UserError(
                f"unknown option {bad[0]} (options: --plan, --dry-run, {NO_CHECK}, --help; the rest are "
                "Hydra overrides)"
            )
        check_split_lists(overrides)
        plan, cfg = build_plan([_bare_name(a) for a in overrides])
        # SLURM jobs wait in the queue, then start elsewhere: what each needs is checked now
        slurm = cfg.launcher == "slurm" and check
        if plan_only:
            print(plan.describe())
            print("(--dry-run adds each job's command, and with launcher=slurm its sbatch script)")
        elif not slurm or dry_run:
            from mta_repro.pipeline.run import main_run

            rc = main_run(plan, cfg.launcher, dry_run)
            if rc or not (slurm and dry_run):
                return rc
        if slurm:
            from mta_repro.pipeline.run import plan_problems

            raise_problems(plan_problems(plan))  # nothing queued
        if plan_only or dry_run:
            return 0
        from mta_repro.pipeline.run import main_run

        return main_run(plan, cfg.launcher, dry_run)

    return run_cli("pipeline", go)


if __name__ == "__main__":
    sys.exit(main())
