"""Render slurm/eval.sbatch for a run; print it (--dry-run, the default) or submit it.

    python -m mta_repro.eval.submit runs/pretrain_880m_mta eval/preset=paper device=cuda \\
        dtype=bfloat16 --after 123456 --submit
    python -m mta_repro.eval.submit runs/debug eval/preset=debug --gpus 0 --dry-run

The job runs ``python -m mta_repro.eval <run_dir> <overrides>`` (the overrides are
checked here, as ``mta_repro.eval`` parses them, so a typo fails before queueing), and
so is what the job needs at its start: the run directory (unless ``--after`` names the job
that makes it), the corpus and tokenizer of its config, a writable output directory; each
missing one is a line, exit status 2, nothing queued (``--no-check``: paths that exist
only on the compute nodes).
``--after JOBID`` (or ``A:B``) adds ``--dependency=afterok:JOBID``: the evaluation starts once the
training job ends successfully (SLURM cancels it if training fails); the run's
checkpoint need not exist yet then. Resources, as flags: ``--gpus N`` (default 1;
0 = no GPU request), ``--cpus N`` (default 8), ``--time-min M`` (default 240),
``--partition/--account/--qos/--constraint`` (default: none), ``--job-name`` (default
mta-eval). Logs go to ``<run_dir>/slurm/<jobid>.{out,err}``. Errors, a refused sbatch
included, are one line each on stderr, exit status 2.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
from pathlib import Path
from string import Template

from mta_repro.errors import UserError
from mta_repro.resources import ROOT, SLURM_DIR
from mta_repro.slurm import memory_lines, sbatch, time_limit

log = logging.getLogger("mta_repro.eval.submit")  # not __main__ under python -m

TEMPLATE = SLURM_DIR / "eval.sbatch"
PROG = "mta_repro.eval.submit"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {PROG}", description=(__doc__ or "").split("\n\n")[0], add_help=True)
    p.add_argument("run_dir", help="the training run directory (made absolute against the current directory)")
    p.add_argument("overrides", nargs="*", help="mta_repro.eval overrides, e.g. eval/preset=paper tasks=[ppl]")
    p.add_argument("--after", metavar="JOBID", help="start after this job succeeds (--dependency=afterok:JOBID)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--submit", action="store_true", help="queue it with sbatch and print the job id")
    mode.add_argument("--dry-run", action="store_true", help="print the script (the default)")
    p.add_argument("--gpus", type=int, default=1, help="GPUs (0: none requested)")
    p.add_argument("--cpus", type=int, default=8, help="CPUs for the task")
    p.add_argument("--time-min", type=int, default=240, help="time limit in minutes")
    p.add_argument("--mem", help="sbatch --mem (per node, e.g. 64G; 0 = all of it)")
    p.add_argument("--exclusive", action="store_true", help="sbatch --exclusive (the whole node)")
    p.add_argument("--partition")
    p.add_argument("--account")
    p.add_argument("--qos")
    p.add_argument("--constraint", help="sbatch --constraint (node features, e.g. h100)")
    p.add_argument(
        "--no-check",
        action="store_true",
        help="do not check the run, data and tokenizer paths here (they exist only on the compute nodes)",
    )
    p.add_argument("--job-name", default="mta-eval")
    return p


def render(
    run_dir: str,
    overrides: list[str],
    *,
    gpus: int = 1,
    cpus: int = 8,
    time_min: int = 240,
    partition: str | None = None,
    account: str | None = None,
    qos: str | None = None,
    job_name: str = "mta-eval",
    python: str = "python",
    mem: str | None = None,
    exclusive: bool = False,
    constraint: str | None = None,
) -> tuple[str, str]:
    """(sbatch script, eval command). ValueError for bad resources or overrides."""
    for name, v, lo in (("--gpus", gpus, 0), ("--cpus", cpus, 1), ("--time-min", time_min, 1)):
        if v < lo:
            raise UserError(f"{name}: expected >= {lo}, got {v}")
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise UserError(f"overrides: expected key=value after the run directory, got {bad}")
    rd = Path(run_dir).expanduser()
    rd = rd if rd.is_absolute() else Path.cwd() / rd
    # The overrides as mta_repro.eval will compose them (the run dir need not exist yet).
    from mta_repro.eval.args import TASK_NAMES
    from mta_repro.eval.run import compose_eval

    cfg = compose_eval([f"run_dir={rd}", *overrides])
    unknown = [t for t in cfg.tasks if t not in TASK_NAMES]
    if unknown:
        raise UserError(f"tasks: unknown {unknown}; expected some of {list(TASK_NAMES)}")
    if gpus > 0 and str(cfg.device) == "cpu":
        log.warning(
            f"# warning: the job requests {gpus} GPU(s) but the evaluation runs on device=cpu "
            "(add device=cuda, or --gpus 0)"
        )
    command = " ".join(
        [shlex.quote(python), "-m", "mta_repro.eval", shlex.quote(str(rd)), *map(shlex.quote, overrides)]
    )
    site = (("partition", partition), ("account", account), ("qos", qos), ("constraint", constraint))
    extra = [f"#SBATCH --{k}={v}" for k, v in site if v]
    script = Template(TEMPLATE.read_text()).substitute(
        job_name=job_name,
        gpu_sbatch=f"#SBATCH --gpus-per-node={gpus}\n" if gpus > 0 else "",
        cpus_per_task=cpus,
        mem_sbatch=memory_lines(mem, exclusive),
        time=time_limit(time_min),
        log_dir=shlex.quote(str(rd / "slurm")),
        extra_sbatch="\n".join(extra),
        workdir=shlex.quote(str(ROOT)),
        command=command,
    )
    return script, command


def problems(run_dir: str, overrides: list[str], after: str | None) -> list[str]:
    """What the evaluation job would miss at its start, one line each (see the module)."""
    from omegaconf import OmegaConf

    from mta_repro.eval.run import compose_eval
    from mta_repro.runs.jobcheck import HINT, data_problems, writable_dir_problem

    rd = Path(run_dir).expanduser().absolute()
    cfg = compose_eval([f"run_dir={rd}", *overrides])
    out = Path(cfg.out_dir).expanduser().absolute() if cfg.out_dir else rd / "eval"
    lines = [line for line in [writable_dir_problem(out, "out_dir")] if line]
    if not rd.exists():
        if not after:
            lines.insert(
                0, f"run_dir: {rd} does not exist (no training run there, and no --after job to make it; {HINT})"
            )
        return lines
    saved = rd / "config.yaml"
    if saved.is_file():  # the corpus and tokenizer the evaluation reads (perplexity, needles, BabiLong)
        run_cfg = OmegaConf.load(saved)
        if "data" in run_cfg:
            lines += data_problems(run_cfg.data, validates=True)
    return lines


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    from mta_repro.cli import run_cli
    from mta_repro.runs.jobcheck import raise_problems

    def go() -> int:
        if args.after is not None and not all(j.replace("_", "").isdigit() for j in args.after.split(":")):
            raise UserError(f"--after: expected a SLURM job id (or ids joined by ':'), got {args.after!r}")
        script, command = render(
            args.run_dir,
            args.overrides,
            gpus=args.gpus,
            cpus=args.cpus,
            time_min=args.time_min,
            partition=args.partition,
            account=args.account,
            qos=args.qos,
            job_name=args.job_name,
            python=sys.executable,
            mem=args.mem,
            exclusive=args.exclusive,
            constraint=args.constraint,
        )
        found = [] if args.no_check else problems(args.run_dir, args.overrides, args.after)
        dep = [f"--dependency=afterok:{args.after}", "--kill-on-invalid-dep=yes"] if args.after else []
        if not args.submit:
            if dep:
                script = script.replace("#SBATCH --nodes=1", f"#SBATCH {dep[0]}\n#SBATCH --nodes=1", 1)
            print(script)
            print(f"# command: {command}", file=sys.stderr)
            raise_problems(found)
            return 0
        raise_problems(found)  # nothing queued
        rd = Path(args.run_dir).expanduser().absolute()
        (rd / "slurm").mkdir(parents=True, exist_ok=True)
        path = rd / "slurm" / "eval.sbatch"
        path.write_text(script)
        job = sbatch(path, dep)
        print(f"Submitted batch job {job}")
        print(f"{rd}/slurm/{job}.out, {job}.err (logs); {rd}/eval (results)", file=sys.stderr)
        return 0

    return run_cli(PROG, go)


if __name__ == "__main__":
    sys.exit(main())
