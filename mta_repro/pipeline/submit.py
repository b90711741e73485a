"""Render slurm/train.sbatch for an experiment; print it (--dry-run) or submit it.

    python -m mta_repro.pipeline.submit experiment=pretrain_880m_mta --dry-run
    python -m mta_repro.pipeline.submit experiment=pretrain_880m_mta slurm.nodes=2 --submit
    python -m mta_repro.pipeline.submit experiment=debug slurm.gpus_per_node=0 \\
        slurm.tasks_per_node=2 slurm.cpus_per_task=1 slurm.cpu_bind=null --submit   # CPU nodes

The overrides are composed exactly as ``python -m mta_repro.train`` would compose them
(a typo fails here, not in the queue); nodes, GPUs, CPUs, time, partition, account, QoS
and constraint come from the config's ``slurm`` section (mta_repro/train/args.py;
``configs/experiment/pretrain_*`` set 4 nodes x 8 GPUs = the paper's 32). The rendered
command is ``python -m mta_repro.train <overrides> run_dir=<abs>``: ``run_dir`` and
``checkpoint.init_from`` are made absolute against the submit directory, the data and
tokenizer paths too, and the values of fields read from environment variables are written
in (the job runs from the repository, possibly days later, in an environment that may
lack them). Both --dry-run and --submit check what the job needs at its start
(mta_repro/runs/jobcheck.py: the data root and its domains, the tokenizer, init_from, a
writable run dir): each missing one is a line, exit status 2, nothing queued;
``--no-check`` skips that for paths that exist only on the compute nodes. A run dir that a
queued or running job already trains in (``squeue``), or whose lock a live start holds, is
refused the same way: two jobs on one run dir would train the same run twice. Sweeps
(experiments with ``hydra.mode: MULTIRUN``) go through ``python -m mta_repro.train -m
launcher=slurm`` instead (the pipeline's engine: one job per point, this template).
Errors, a refused sbatch included, are one line each on stderr, exit status 2.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from string import Template

from omegaconf import DictConfig, OmegaConf

from mta_repro.errors import UserError
from mta_repro.resources import ROOT, SLURM_DIR
from mta_repro.runs.jobcheck import NO_CHECK, problems, queued_owner, raise_problems, resolved_overrides
from mta_repro.slurm import memory_lines, sbatch, time_limit
from mta_repro.train.args import SITE_FIELDS, SlurmArgs
from mta_repro.train.config import compose, to_train_config

TEMPLATE = SLURM_DIR / "train.sbatch"
PROG = "mta_repro.pipeline.submit"


def _refuse_multirun(overrides: Sequence[str]) -> None:
    """An experiment with ``hydra.mode: MULTIRUN`` is a sweep: one sbatch would train only
    its first point (or all of them in one run dir)."""
    flags = [o for o in overrides if o in ("-m", "--multirun")]
    raw = compose([o for o in overrides if o not in flags], hydra_config=True)
    mode = OmegaConf.select(raw, "hydra.mode", throw_on_resolution_failure=False)
    if flags or str(mode).endswith("MULTIRUN"):
        exp = next((o.split("=", 1)[1] for o in overrides if o.startswith("experiment=")), None)
        what = f"experiment={exp} is a sweep (hydra.mode: MULTIRUN)" if exp and not flags else "a sweep (-m)"
        raise UserError(
            f"{what}: submit it as one job per point with python -m mta_repro.train -m launcher=slurm "
            f"{' '.join(o for o in overrides if o not in flags)} (or submit one point here with hydra.mode=RUN "
            "and the swept fields set)"
        )


def _abs(path: str, base: Path) -> Path:
    p = Path(path).expanduser()
    return p if p.is_absolute() else base / p


def resolve_paths(cfg: DictConfig, base: Path | None = None) -> tuple[Path, Path | None]:
    """(run_dir, init_from) made absolute against ``base`` (the submit directory)."""
    base = Path.cwd() if base is None else base
    run_dir = _abs(str(cfg.run_dir), base)
    init = cfg.checkpoint.get("init_from")
    return run_dir, (_abs(str(init), base) if init else None)


def render(overrides: list[str], python: str = "python", check_paths: bool = True) -> tuple[str, str]:
    """(sbatch script, training command) for these Hydra overrides.

    Raises ValueError for a sweep, a bad field, or (``check_paths``) a missing
    ``checkpoint.init_from``."""
    _refuse_multirun(overrides)
    cfg = compose(overrides)
    s = OmegaConf.to_object(cfg.slurm)
    assert isinstance(s, SlurmArgs)
    device = str(cfg.trainer.get("device", "auto"))
    if s.gpus_per_node == 0 and device == "cuda":
        raise UserError(
            "trainer.device=cuda but slurm.gpus_per_node=0 (CPU nodes): set trainer.device=cpu, "
            "or request GPUs with slurm.gpus_per_node"
        )
    if s.gpus_per_node > 0 and device == "cpu":
        print(
            f"# warning: the job requests {s.gpus_per_node} GPU(s) per node but trainer.device=cpu "
            "(CPU nodes: slurm.gpus_per_node=0 slurm.tasks_per_node=N)",
            file=sys.stderr,
        )
    run_dir, init_from = resolve_paths(cfg)
    if init_from is not None and check_paths and not init_from.exists():
        raise UserError(
            f"checkpoint.init_from: {init_from} does not exist (a run dir, a checkpoint dir or a .pt file; "
            "relative paths are taken from the submit directory)"
        )
    user = [o for o in overrides if not o.startswith(("run_dir=", "checkpoint.init_from=", "+checkpoint.init_from="))]
    paths = [f"run_dir={run_dir}"] + ([f"checkpoint.init_from={init_from}"] if init_from is not None else [])
    # what the job would read from its environment and working directory, as this config resolves it here
    resolved = resolved_overrides(cfg, user)
    command = " ".join([shlex.quote(python), "-m", "mta_repro.train", *map(shlex.quote, user + resolved + paths)])
    extra = [f"#SBATCH --{k}={getattr(s, k)}" for k in SITE_FIELDS if getattr(s, k)]
    script = Template(TEMPLATE.read_text()).substitute(
        job_name=s.job_name,
        nodes=s.nodes,
        ntasks_per_node=s.ntasks_per_node,
        # CPU nodes (gpus_per_node=0) request no GPUs: --gpus-per-node=0 is refused where
        # no GPU gres is configured.
        gpu_sbatch=f"#SBATCH --gpus-per-node={s.gpus_per_node}\n" if s.gpus_per_node > 0 else "",
        cpus_per_task=s.cpus_per_task,
        mem_sbatch=memory_lines(s.mem, s.exclusive),
        cpu_bind=f" --cpu-bind={s.cpu_bind}" if s.cpu_bind else "",
        time=time_limit(s.time_min),
        signal_s=s.signal_s,
        log_dir=shlex.quote(str(run_dir / "slurm")),
        extra_sbatch="\n".join(extra),
        workdir=shlex.quote(str(ROOT)),
        omp_threads=max(1, s.cpus_per_task // 2),
        command=command,
    )
    return script, command


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    submit, check = "--submit" in argv, NO_CHECK not in argv
    argv = [a for a in argv if a not in ("--submit", "--dry-run", NO_CHECK)]
    from mta_repro.cli import check_split_lists, run_cli

    def go() -> int:
        check_split_lists(argv)
        script, command = render(argv, python=sys.executable, check_paths=False)
        cfg = compose(argv)
        run_dir, _ = resolve_paths(cfg)
        found = problems(cfg, to_train_config(cfg)) if check else []
        owner = queued_owner(run_dir)  # a scheduler's fact, not a path: --no-check does not skip it
        found += [owner] if owner else []
        if not submit:
            print(script)
            print(f"# command: {command}", file=sys.stderr)
            raise_problems(found)  # after the script: the reader sees both
            return 0
        raise_problems(found)  # nothing queued
        (run_dir / "slurm").mkdir(parents=True, exist_ok=True)
        path = run_dir / "slurm" / "train.sbatch"
        path.write_text(script)
        job = sbatch(path)
        print(f"Submitted batch job {job}")
        print(f"{run_dir}/slurm/{job}.out, {job}.err (logs); {run_dir} (run dir)", file=sys.stderr)
        return 0

    return run_cli(PROG, go)


if __name__ == "__main__":
    sys.exit(main())
