"""``python -m mta_repro.train experiment=debug run_dir=runs/debug [key=value ...]``.

The overrides are composed by ``mta_repro.train.config.compose`` (the project's one
composition, Hydra's compose API). Launch N ranks with ``torchrun --nproc_per_node N -m
mta_repro.train ...`` or under SLURM with ``srun`` (see slurm/train.sbatch); a single
process needs no launcher. Only rank 0 writes the record of the command
(``<run_dir>/.hydra/``: config.yaml, hydra.yaml, overrides.yaml), so N ranks never write
the same files at once.

    --cfg job|hydra|all [--resolve]   print the composed config, run nothing
    -m / --multirun                   a sweep (``a=1,2``, or an experiment with
                                      ``hydra.mode: MULTIRUN``): one run per point, run by
                                      the pipeline's engine (``python -m mta_repro.pipeline.sweep``)
    --plan / --dry-run / --no-check   (a sweep) its job table / every command and sbatch
                                      script / with launcher=slurm, no check of the jobs' paths

A user error (a config key or option, the run directory, data, a checkpoint) is one line
and exit status 2 (``mta_repro.cli.run_cli``). Ctrl-C (or SIGTERM, SIGUSR2) checkpoints at
the next step boundary and exits with 128 + the signal's number (130 for Ctrl-C, 143 for
SIGTERM): the run is unfinished (docs/errors_and_signals.md).
"""

from __future__ import annotations

import os
import sys

from omegaconf import OmegaConf

PROG = "train"
SWEEP_MODULE = "mta_repro.pipeline.sweep"


def help_text() -> str:
    """configs/train.yaml's help header, the config groups and their options, its footer."""
    from mta_repro.train.config import CONFIG_DIR, compose

    help_node = compose([], hydra_config=True).hydra.help
    groups = []
    for d in sorted(p for p in CONFIG_DIR.iterdir() if p.is_dir() and p.name not in ("hydra", "pipeline", "eval")):
        names = sorted(f.stem for f in d.glob("*.yaml") if not f.stem.startswith("_"))
        if names:
            groups.append(f"  {d.name}: {', '.join(names)}")
    return "\n".join([str(help_node.header), "", "Config groups (group=option):", *groups, "", str(help_node.footer)])


def is_sweep(multirun: bool, cfg) -> bool:
    """``-m``, or an experiment that is a sweep (``hydra.mode: MULTIRUN``)."""
    return multirun or str(OmegaConf.select(cfg, "hydra.mode")).endswith("MULTIRUN")


def run_sweep(argv: list[str]) -> int:
    """Hand a sweep to the pipeline's engine, this process becoming it (the same signals,
    the same exit status): ``python -m mta_repro.pipeline.sweep <argv without -m>``."""
    rest = [a for a in argv if a not in ("-m", "--multirun")]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", SWEEP_MODULE, *rest])
    return 0  # pragma: no cover - execv does not return


def cli(argv: list[str]) -> int:
    from mta_repro.cli import first_point, parse_hydra_argv, resolve_all, run_cli
    from mta_repro.device import launcher_rank
    from mta_repro.errors import UserError
    from mta_repro.runs.jobcheck import NO_CHECK
    from mta_repro.runs.rundir import check_writable, write_record
    from mta_repro.runs.signals import stop_exit_code
    from mta_repro.train.config import compose, to_train_config

    sweep: list[bool] = []

    def go() -> int:
        args = parse_hydra_argv(argv, PROG, flags=(NO_CHECK, "--plan", "--dry-run"))
        if args.help:
            print(help_text())
            return 0
        # launcher=slurm / hydra/launcher=slurm choose the engine's SLURM backend (a sweep's)
        overrides = [o for o in args.overrides if o.lstrip("+") not in ("launcher=slurm", "hydra/launcher=slurm")]
        if args.multirun and args.cfg is None:
            sweep.append(True)
            return 0
        first, swept = first_point(overrides)
        cfg = compose(first, hydra_config=True)
        if is_sweep(args.multirun, cfg) and args.cfg is None:  # the experiment is a sweep
            sweep.append(True)
            return 0
        if swept and not args.multirun:  # a swept value without -m: Hydra's one line (add --multirun)
            compose(overrides)
        if overrides != args.overrides:
            raise UserError(
                "launcher=slurm: chooses where a sweep (-m) runs; submit one run with "
                f"python -m mta_repro.pipeline.submit {' '.join(overrides)} --submit"
            )
        if args.flags:
            raise UserError(
                f"{args.flags[0]}: a sweep's (-m) option; one run's sbatch script, checked: "
                f"python -m mta_repro.pipeline.submit {' '.join(overrides)} --dry-run"
            )
        task = OmegaConf.masked_copy(cfg, [str(k) for k in cfg if k != "hydra"])
        resolve_all(task)
        to_train_config(task)  # every field's check (schema, values, data.seq_len <= model.max_seqlen)
        if args.cfg is not None:
            node = {"job": task, "hydra": OmegaConf.masked_copy(cfg, ["hydra"]), "all": cfg}[args.cfg]
            print(OmegaConf.to_yaml(node, resolve=args.resolve), end="")
            return 0
        check_writable(task.run_dir)
        if launcher_rank() == 0:
            write_record(task.run_dir, cfg, overrides, OmegaConf.select(cfg, "hydra.output_subdir"))
        from mta_repro.train.loop import train

        out = train(task)
        # Stopped by a signal (after its checkpoint): unfinished, 128 + the signal's number.
        sig = out.get("stopped_by_signal")
        return stop_exit_code(sig) if sig else 0

    rc = run_cli(PROG, go)
    if sweep and not rc:
        return run_sweep(argv)
    return rc


def main() -> None:
    sys.exit(cli(sys.argv[1:]))


if __name__ == "__main__":
    main()
