"""Render slurm/train.sbatch for an experiment; print it (--dry-run) or submit it.

    python -m mta_repro.train.slurm experiment=pretrain_880m_mta --dry-run
    python -m mta_repro.train.slurm experiment=pretrain_880m_mta slurm.nodes=2 --submit

The overrides are composed exactly as ``python -m mta_repro.train`` would compose them
(a typo fails here, not in the queue); nodes, GPUs, time etc. come from the config's
``slurm`` section (``configs/experiment/pretrain_*`` set 4 nodes x 8 GPUs = the paper's
32). The rendered command is ``python -m mta_repro.train <overrides> run_dir=<abs>``.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path
from string import Template

from omegaconf import OmegaConf

from mta_repro.config import compose
from mta_repro.train.args import SlurmArgs

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "slurm" / "train.sbatch"


def _time(minutes: int) -> str:
    d, rem = divmod(minutes, 24 * 60)
    h, m = divmod(rem, 60)
    return f"{d}-{h:02d}:{m:02d}:00"


def render(overrides: list[str], python: str = "python") -> tuple[str, str]:
    """(sbatch script, training command) for these Hydra overrides."""
    cfg = compose(overrides)
    s = OmegaConf.to_object(cfg.slurm)
    assert isinstance(s, SlurmArgs)
    run_dir = Path(cfg.run_dir)
    run_dir = run_dir if run_dir.is_absolute() else (Path.cwd() / run_dir)
    user = [o for o in overrides if not o.startswith("run_dir=")]
    command = " ".join(
        [shlex.quote(python), "-m", "mta_repro.train", *map(shlex.quote, user), shlex.quote(f"run_dir={run_dir}")]
    )
    extra = [f"#SBATCH --{k}={getattr(s, k)}" for k in ("partition", "account", "qos") if getattr(s, k)]
    script = Template(TEMPLATE.read_text()).substitute(
        job_name=s.job_name,
        nodes=s.nodes,
        gpus_per_node=s.gpus_per_node,
        cpus_per_task=s.cpus_per_task,
        time=_time(s.time_min),
        signal_s=s.signal_s,
        log_dir=shlex.quote(str(run_dir / "slurm")),
        extra_sbatch="\n".join(extra),
        workdir=shlex.quote(str(ROOT)),
        omp_threads=max(1, s.cpus_per_task // 2),
        command=command,
    )
    return script, command


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    submit = "--submit" in argv
    argv = [a for a in argv if a not in ("--submit", "--dry-run")]
    script, command = render(argv)
    if not submit:
        print(script)
        print(f"# command: {command}", file=sys.stderr)
        return
    cfg = compose(argv)
    run_dir = Path(cfg.run_dir).resolve()
    (run_dir / "slurm").mkdir(parents=True, exist_ok=True)
    path = run_dir / "slurm" / "train.sbatch"
    path.write_text(script)
    out = subprocess.run(["sbatch", str(path)], check=True, capture_output=True, text=True)
    print(out.stdout.strip())


if __name__ == "__main__":
    main()
