"""The paper's world size, rehearsed on the local cluster (scripts/slurm_local.sh start):
the debug model at NODES x TASKS CPU ranks (gloo, one thread each), through the same
sbatch path as the paper's 4 x 8 H200 job (python -m mta_repro.pipeline.submit).

    python scripts/rehearse_32.py [--nodes 4] [--tasks 8] [--out results/rehearsal_32]

Phases: start (submit -> first step), two checkpoints (steps 4 and 8), SIGUSR2 ->
requeue -> resume (the requeued allocation resumes at the stop's step), the end (step
16), then the step-12 checkpoint resumed at half the ranks (NODES/2 x TASKS, with
trainer.grad_accum=2: the same global batch) to step 16. It prints each phase's wall time
and the peak RSS (VmHWM) of every rank, and writes them with the checkpoints' rank count
and the run's provenance to --out. The data is the suite's ``batch_source`` loader
(tests/distributed): global batches that are the same for any world size, so the
half-size resume is compared with the full run's losses. Not run by CI (minutes, and
every rank's memory); its committed output is results/rehearsal_32/.

Before it submits, it checks that the ranks fit in MemAvailable (--rank-mb each, measured
here: 555-575 MB a rank at its peak, torch and gloo included) with --margin-mb to spare, and refuses
in one line, exit 2, naming the largest NODES x TASKS that does.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = 16
TOL = 1e-5


def mem_available_mb() -> int:
    text = Path("/proc/meminfo").read_text()
    return int(re.search(r"MemAvailable:\s+(\d+) kB", text).group(1)) // 1024


def job_field(job: str, key: str) -> str | None:
    out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
    m = re.search(rf"\b{key}=(\S+)", out)
    return m.group(1) if m else None


class RssWatch:
    """Polls every training process of the watched jobs: the last VmHWM seen per (job, rank)."""

    def __init__(self) -> None:
        self.peak: dict[tuple[str, int], int] = {}
        self.jobs: set[str] = set()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stop.wait(0.5):
            for proc in Path("/proc").iterdir():
                if not proc.name.isdigit():
                    continue
                try:
                    raw = (proc / "environ").read_bytes().decode(errors="replace").split("\0")
                    env = dict(kv.split("=", 1) for kv in raw if "=" in kv)
                    if env.get("SLURM_JOB_ID") not in self.jobs or "SLURM_PROCID" not in env:
                        continue
                    if b"mta_repro.train" not in (proc / "cmdline").read_bytes():
                        continue
                    hwm = re.search(r"VmHWM:\s+(\d+) kB", (proc / "status").read_text())
                except OSError:
                    continue
                if hwm:
                    key = (env["SLURM_JOB_ID"], int(env["SLURM_PROCID"]))
                    self.peak[key] = max(self.peak.get(key, 0), int(hwm.group(1)) // 1024)

    def of(self, job: str) -> list[int]:
        return [mb for (j, _), mb in sorted(self.peak.items()) if j == job]


def submit(run_dir: Path, nodes: int, tasks: int, ranks_total: int) -> str:
    overrides = [
        "experiment=debug",
        "data.seq_len=64",
        "data.batch_size=1",
        f"trainer.grad_accum={ranks_total // (nodes * tasks)}",
        f"trainer.steps={STEPS}",
        "trainer.device=cpu",
        "trainer.loader=batch_source:build",
        "trainer.eval_every=0",
        "trainer.eval_max_batches=1",
        "checkpoint.every=4",
        "checkpoint.keep=5",
        "checkpoint.export=false",
        "logging.every=1",
        "logging.wandb_mode=disabled",
        "logging.progress_bar=false",
        "optim.warmup=2",
        f"slurm.nodes={nodes}",
        f"slurm.tasks_per_node={tasks}",
        "slurm.gpus_per_node=0",
        "slurm.cpus_per_task=1",
        "slurm.cpu_bind=null",
        "slurm.time_min=60",
        f"run_dir={run_dir}",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests" / "distributed"), env.get("PYTHONPATH", "")])
    p = subprocess.run(
        [sys.executable, "-m", "mta_repro.pipeline.submit", *overrides, "--submit"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    m = re.search(r"Submitted batch job (\d+)", p.stdout)
    if not m:
        sys.exit(f"rehearse_32: submit failed: {p.stderr.strip()[-2000:]}")
    return m.group(1)


def steps_logged(run_dir: Path) -> dict[int, float]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def wait_for(what: str, cond, timeout: float = 3600) -> float:
    t0 = time.time()
    while not cond():
        if time.time() - t0 > timeout:
            sys.exit(f"rehearse_32: {what}: not within {timeout:.0f} s")
        time.sleep(0.2)
    return time.time() - t0


def finished(job: str) -> bool:
    return job_field(job, "JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "rehearsal_32")
    ap.add_argument("--work", type=Path, default=Path("/tmp/mta_rehearsal"))
    ap.add_argument("--rank-mb", type=int, default=575)
    ap.add_argument("--margin-mb", type=int, default=1024)
    return ap.parse_args()


def too_big(a: argparse.Namespace) -> bool:
    """The one line refusing a shape whose ranks do not fit in MemAvailable."""
    ranks, avail = a.nodes * a.tasks, mem_available_mb()
    if ranks * a.rank_mb + a.margin_mb <= avail:
        return False
    fit = max(0, (avail - a.margin_mb) // a.rank_mb)
    print(
        f"rehearse_32: error: {a.nodes} x {a.tasks} = {ranks} ranks need about {ranks * a.rank_mb} MB "
        f"(--rank-mb {a.rank_mb}) + {a.margin_mb} MB margin; MemAvailable is {avail} MB: at most {fit} "
        f"ranks fit now (e.g. --nodes 4 --tasks {max(1, fit // 4)})",
        file=sys.stderr,
    )
    return True


def main() -> int:
    a = parse()
    if too_big(a):
        return 2
    ranks = a.nodes * a.tasks
    shutil.rmtree(a.work, ignore_errors=True)
    run_dir, half_dir = a.work / "full", a.work / "half"
    watch = RssWatch()
    phases: list[tuple[str, float]] = []
    t_all = time.time()

    job = submit(run_dir, a.nodes, a.tasks, ranks)
    watch.jobs.add(job)
    phases.append(("start: submit -> step 1 logged", wait_for("step 1", lambda: 1 in steps_logged(run_dir))))
    phases.append(
        ("steps 1 -> checkpoint 8 (2 checkpoints: 4, 8)", wait_for("ckpt 8", lambda: 9 in steps_logged(run_dir)))
    )
    t0 = time.time()
    subprocess.run(["scancel", "--signal=USR2", job], check=True)
    err = run_dir / "slurm" / f"{job}.err"
    wait_for("the resume", lambda: err.is_file() and "resumed from" in err.read_text())
    phases.append(("USR2 -> stop, checkpoint, requeue -> resumed", time.time() - t0))
    t0 = time.time()
    wait_for("the end", lambda: finished(job))
    phases.append((f"resumed -> step {STEPS} (job end)", time.time() - t0))
    state = job_field(job, "JobState")
    text = err.read_text()
    stop = re.search(r"stopped at step (\d+) after a signal and requeued the job", text)
    resumed = re.search(r"resumed from \S+ at step (\d+)", text)
    full = steps_logged(run_dir)

    copy_at(run_dir, half_dir, 12)  # the step-12 checkpoint, alone in a copy, resumed at half the ranks
    t0 = time.time()
    job2 = submit(half_dir, max(1, a.nodes // 2), a.tasks, ranks)
    watch.jobs.add(job2)
    wait_for("the half-size resume", lambda: finished(job2))
    phases.append(
        (f"checkpoint 12 resumed at {max(1, a.nodes // 2)} x {a.tasks} ranks -> step {STEPS}", time.time() - t0)
    )
    watch.stop.set()
    half = steps_logged(half_dir)

    from mta_repro.weights.layout import complete_checkpoints, saved_world_size

    ckpts = {c.name: saved_world_size(c) for c in complete_checkpoints(run_dir / "checkpoints")}
    prov = json.loads((run_dir / "provenance.json").read_text())
    diff = max(abs(full[s] - half[s]) for s in range(13, STEPS + 1)) if all(s in half for s in range(13, 17)) else None
    rss = watch.of(job)
    rss2 = watch.of(job2)
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs, "
        f"{int(Path('/proc/meminfo').read_text().split()[1]) // 1024 // 1024 + 1} GiB, "
        f"{subprocess.run(['sinfo', '--version'], capture_output=True, text=True).stdout.strip()}",
        "shape": f"{a.nodes} nodes x {a.tasks} tasks = {ranks} ranks",
        "job": job,
        "job_state": state,
        "restarts": job_field(job, "Restarts"),
        "stopped_at_step": int(stop.group(1)) if stop else None,
        "resumed_at_step": int(resumed.group(1)) if resumed else None,
        "steps_logged": sorted(full),
        "checkpoint_ranks": ckpts,
        "provenance_starts": [
            {k: s.get(k) for k in ("step", "world_size", "slurm_nodelist", "slurm_nodes")} for s in prov["starts"]
        ],
        "half_job": job2,
        "half_job_state": job_field(job2, "JobState"),
        "half_world_size": json.loads((half_dir / "provenance.json").read_text())["starts"][-1]["world_size"],
        "max_abs_loss_diff_steps_13_16_full_vs_half": diff,
        "phases_s": {name: round(s, 1) for name, s in phases},
        "total_s": round(time.time() - t_all, 1),
        "peak_rss_mb_per_rank": rss,
        "peak_rss_mb_per_rank_half": rss2,
    }
    write_out(a.out, result, phases, rss, run_dir, err)
    ok = state == "COMPLETED" and result["half_job_state"] == "COMPLETED" and diff is not None and diff <= TOL
    return 0 if ok else 1


def copy_at(run_dir: Path, dst: Path, step: int) -> None:
    """A copy of ``run_dir`` as it was at ``step``: its checkpoints and metrics up to it."""
    shutil.copytree(run_dir, dst, ignore=shutil.ignore_patterns("slurm", ".lock"))
    for extra in sorted((dst / "checkpoints").iterdir()):
        if not extra.name.isdigit() or int(extra.name) > step:
            shutil.rmtree(extra)
    rows = (dst / "metrics.jsonl").read_text().splitlines()
    (dst / "metrics.jsonl").write_text("".join(r + "\n" for r in rows if json.loads(r).get("step", 0) <= step))


def write_out(a_out: Path, result: dict, phases: list, rss: list[int], run_dir: Path, err: Path) -> None:
    a_out.mkdir(parents=True, exist_ok=True)
    (a_out / "rehearsal.json").write_text(json.dumps(result, indent=1) + "\n")
    shutil.copy(run_dir / "provenance.json", a_out / "provenance.json")
    shutil.copy(err, a_out / f"job_{result['job']}.err")
    lines = [f"{k}: {v}" for k, v in result.items() if k not in ("phases_s",)]
    lines += ["", "| phase | wall s |", "|---|---:|"] + [f"| {n} | {s:.1f} |" for n, s in phases]
    if rss:
        lines += [
            "",
            f"peak RSS per rank (MB): min {min(rss)}, median {sorted(rss)[len(rss) // 2]}, max {max(rss)}, "
            f"sum {sum(rss)} over {len(rss)} ranks",
        ]
    print("\n".join(lines))
    (a_out / "summary.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
