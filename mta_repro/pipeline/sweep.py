"""``python -m mta_repro.pipeline.sweep [--plan|--dry-run|--no-check] [launcher=slurm] <train overrides>``

A training sweep as a plan of the pipeline's engine: ``python -m mta_repro.train -m ...``
(and an experiment with ``hydra.mode: MULTIRUN``, e.g. Table 5's ablations) hands its
command line here. The swept overrides (``a=1,2``, ``range(0,3)``, ``choice(a,b)``: Hydra's
override grammar, read by its public parser) and the experiment's ``hydra.sweeper.params``
(a command-line override of the same key wins) give one training job per point, each
composed by ``mta_repro.train.config.compose`` and given its absolute ``run_dir`` (the one
the point's config resolves, e.g. ``'run_dir=runs/x/seed${seed}'``). Then a report job over
every point, written to ``<the points' common parent>/report``.

The engine's guards hold for a sweep as for the paper's pipeline: two points in one run
dir are refused before anything starts (one line naming both points); a point whose run
is done (``mta_repro.pipeline.done``) is skipped and the others resume; ``launcher=slurm``
(or ``hydra/launcher=slurm``) submits the same jobs with sbatch through
``slurm/train.sbatch`` (the report after all of them), refusing a run dir another job
already owns; ``--plan`` prints the job table and ``--dry-run`` every command (and sbatch
script) without running anything.

    python -m mta_repro.train -m experiment=debug 'seed=0,1' 'run_dir=runs/x/seed${seed}'
    python -m mta_repro.train experiment=ablation_kernels launcher=slurm --dry-run
"""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from omegaconf import OmegaConf

from mta_repro.errors import UserError
from mta_repro.pipeline.job import Job
from mta_repro.pipeline.plan import Plan
from mta_repro.runs.jobcheck import NO_CHECK

PROG = "sweep"
LAUNCHER_OVERRIDES = {"launcher=slurm": "slurm", "hydra/launcher=slurm": "slurm", "launcher=local": "local"}
# Overrides of the engine itself, not of a point's config
ENGINE_FLAGS = ("--plan", "--dry-run", NO_CHECK)


def _key(o) -> str:
    """An override's key without its ``+``/``++``/``~`` prefix."""
    return str(o.get_key_element()).lstrip("+~")


def axes(overrides: Sequence[str], params) -> tuple[list[str], list[list[str]]]:
    """(fixed overrides, one list of ``key=value`` per swept key) of a command line and the
    experiment's ``hydra.sweeper.params`` ({key: "1,2"}); a key given on the command line
    replaces the experiment's values for it, as Hydra's basic sweeper does."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    given = parser.parse_overrides(list(overrides))
    on_line = {_key(o) for o in given}
    swept: dict[str, list[str]] = {}
    for o in parser.parse_overrides([f"{k}={v}" for k, v in (params or {}).items()]):
        if _key(o) not in on_line:
            swept[_key(o)] = [f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()]
    fixed = []
    for o in given:
        if o.is_sweep_override():
            if o.is_hydra_override():
                raise UserError(f"{o.input_line}: a sweep of a hydra.* setting is not a training point")
            swept[_key(o)] = [f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()]
        else:
            fixed.append(o.input_line)
    return fixed, list(swept.values())


def _quoted(o: str) -> str:
    """``key=value`` as one override of a command line: a value with commas or brackets
    (a point's resolved list) quoted so that Hydra reads it as one value."""
    key, _, val = o.partition("=")
    if any(c in val for c in ",$[]{}()'\" "):
        return f"{key}='" + val.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return o


def _plain_run_dir(fixed: Sequence[str]) -> str | None:
    """A ``run_dir=...`` override that names one fixed directory (no interpolation)."""
    for o in fixed:
        key, _, val = o.partition("=")
        if key.lstrip("+~") == "run_dir" and "${" not in val:
            return o
    return None


def build(argv_overrides: Sequence[str], python: str = sys.executable) -> tuple[Plan, str]:
    """(the plan of a sweep command line, its launcher): one training job per point and a
    report job after all of them. Refuses, in one line, two points in one run dir."""
    from mta_repro.cli import first_point
    from mta_repro.pipeline.submit import resolve_paths
    from mta_repro.train.config import compose, to_train_config

    launcher = "local"
    overrides = []
    for o in argv_overrides:
        if o.lstrip("+") in LAUNCHER_OVERRIDES:
            launcher = LAUNCHER_OVERRIDES[o.lstrip("+")]
        else:
            overrides.append(o)
    first, _ = first_point(overrides)
    params = OmegaConf.select(compose(first, hydra_config=True), "hydra.sweeper.params")
    fixed, swept = axes(overrides, OmegaConf.to_container(params) if params is not None else {})
    jobs: list[Job] = []
    dirs: dict[str, Path] = {}
    owner: dict[Path, str] = {}
    for point in itertools.product(*swept):
        point = list(point)
        keys = [o.partition("=")[0] for o in point]
        # each swept value as one override (a quoted interpolation such as the layer list
        # for this model's depth resolves in the point's own config), composed, then checked
        cfg = compose([*fixed, *point, "hydra.mode=RUN"])
        ov = [*fixed, *(_quoted(f"{k}={OmegaConf.select(cfg, k.lstrip('+~'))}") for k in keys), "hydra.mode=RUN"]
        cfg = compose(ov)  # a typo or a bad value fails here, before any job
        args = to_train_config(cfg)
        label = " ".join(f"{k.lstrip('+~')}={OmegaConf.select(cfg, k.lstrip('+~'))}" for k in keys) or "(one point)"
        run_dir, init_from = resolve_paths(cfg)
        if run_dir in owner:
            plain = _plain_run_dir(fixed)
            hint = (
                f"{plain} names one directory for every point; interpolate the swept values "
                "(e.g. 'run_dir=runs/x/seed${seed}')"
                if plain
                else "put every swept field into run_dir"
            )
            raise UserError(f"run_dir={run_dir}: the sweep points [{owner[run_dir]}] and [{label}] share it; {hint}")
        owner[run_dir] = label
        dirs[label] = run_dir
        # absolute: the engine runs its jobs from the repository, not from here
        paths = [_quoted(f"run_dir={run_dir}")]
        paths += [_quoted(f"checkpoint.init_from={init_from}")] if init_from is not None else []
        job_ov = [o for o in ov if o.partition("=")[0].lstrip("+") not in ("run_dir", "checkpoint.init_from")]
        job_ov += paths
        jobs.append(
            Job(
                f"train:{run_dir.name}"
                if run_dir.name not in {Path(j.run_dir).name for j in jobs}
                else f"train:{run_dir}",
                "train",
                run_dir,
                [python, "-m", "mta_repro.train", *job_ov],
                [],
                "sweep",
                label,
                job_ov,
                steps=int(args.trainer.steps),
            )
        )
    runs = list(dirs.values())
    common = Path(os.path.commonpath([str(d) for d in runs])) if runs else Path.cwd()
    out = common / "report"
    jobs.append(
        Job(
            "report",
            "report",
            out,
            [python, "-m", "mta_repro.report", *map(str, runs), "--out", str(out)],
            [j.id for j in jobs],
            "report",
            "report",
            runs=runs,
        )
    )
    spec = OmegaConf.create({"name": f"sweep of {len(runs)} point(s)", "slurm": {}})
    return Plan(spec, common, python=python, jobs=jobs, train_dirs=dirs), launcher


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    from mta_repro.cli import parse_hydra_argv, run_cli
    from mta_repro.runs.jobcheck import queued_owner, raise_problems

    def go() -> int:
        args = parse_hydra_argv(argv, PROG, flags=ENGINE_FLAGS)
        if args.cfg is not None:
            raise UserError("--cfg: print one point's config with python -m mta_repro.train <its overrides> --cfg job")
        plan_only, dry_run, check = "--plan" in args.flags, "--dry-run" in args.flags, NO_CHECK not in args.flags
        plan, launcher = build(args.overrides)
        if plan_only:
            print(plan.describe())
            return 0
        from mta_repro.pipeline.run import main_run, plan_problems

        if launcher == "slurm":
            if check:
                raise_problems(plan_problems(plan))  # nothing queued
            if not dry_run:  # ownership at submission: a run dir another job trains in
                raise_problems([x for x in (queued_owner(d) for d in plan.train_dirs.values()) if x])
        return main_run(plan, launcher, dry_run)

    return run_cli(PROG, go)


if __name__ == "__main__":
    sys.exit(main())
