"""Running a plan: locally, one job after another, or as SLURM jobs chained with
``--dependency=afterok``; a rerun skips what is done and resumes what is not."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from string import Template

from mta_repro.errors import UserError
from mta_repro.files import read_json, replace_atomically
from mta_repro.pipeline.done import conflicts, done, missing_sources, torn, why_not_done
from mta_repro.pipeline.job import Job
from mta_repro.pipeline.plan import REPO, Plan
from mta_repro.slurm import memory_lines, sbatch, time_limit
from mta_repro.train.args import SITE_FIELDS, SlurmArgs

# Evaluation, Appendix I check and report jobs: one process on one node.
JOB_TEMPLATE = Template("""#!/bin/bash
#SBATCH --job-name=${job_name}
#SBATCH --nodes=1
#SBATCH --ntasks=1
${gpu_sbatch}#SBATCH --cpus-per-task=${cpus}
${mem_sbatch}#SBATCH --time=${time}
#SBATCH --output=${log_dir}/%j.out
#SBATCH --error=${log_dir}/%j.err
${extra_sbatch}
# Written by python -m mta_repro.pipeline (${job_id}).
set -euo pipefail
cd ${workdir}
# One process: half the CPUs for intra-op threads, the rest for its data/IO threads.
export OMP_NUM_THREADS=${omp}
export PYTORCH_CUDA_ALLOC_CONF=$${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export TRITON_CACHE_DIR=$${TRITON_CACHE_DIR:-$${SLURM_TMPDIR:-/tmp}/mta_repro_$${USER:-user}/triton}
export TORCHINDUCTOR_CACHE_DIR=$${TORCHINDUCTOR_CACHE_DIR:-$${SLURM_TMPDIR:-/tmp}/mta_repro_$${USER:-user}/inductor}
${command}
""")

# The report job runs after every other job has ended, failed ones included (afterany:
# an afterok chain would leave it pending forever after one failed evaluation); it says
# which runs lack an export or evaluation results, and reports what exists. It reads JSON
# files and draws plots: 2 CPUs for an hour.
REPORT_CPUS, REPORT_TIME_MIN = 2, 60
# The import of a Hugging Face folder (python -m mta_repro.hf import): CPU only, one
# tensor at a time from memory-mapped shards (host memory ~1.5x the checkpoint: ~24 GB for
# Llama 3.1 8B in bf16; set pipeline.slurm.mem if the cluster's default per-CPU memory
# gives less); minutes, mostly reading the files.
IMPORT_CPUS, IMPORT_TIME_MIN = 4, 120


def _missing_report_inputs(job: Job) -> str:
    """Shell lines naming every run of the report without an export or evaluation JSON."""
    lines = []
    for d in job.runs:
        q = shlex.quote(str(d))
        lines.append(
            f'[ -f {q}/export/consolidated.pt ] || echo "report: missing: {d}/export (training did not finish)" >&2'
        )
        lines.append(
            f'ls {q}/eval/*.json >/dev/null 2>&1 || echo "report: missing: {d}/eval/*.json (no evaluation results)" >&2'
        )
    return "\n".join(lines)


def job_script(job: Job, slurm: dict) -> str:
    """The sbatch script of a job: training through mta_repro.pipeline.submit's render (the
    multi-node template), the others through JOB_TEMPLATE."""
    if job.kind == "train":
        from mta_repro.pipeline.submit import render

        # check_paths=False: the source run is made by an earlier job of this plan
        script, _ = render(
            list(job.overrides) + site_overrides(slurm, job.overrides), python=job.command[0], check_paths=False
        )
        return script
    report = job.kind == "report"
    cpu_only = report or job.kind == "import"
    gpus = int(slurm.get("gpus_per_node", 1)) if not cpu_only else 0
    extra = "\n".join(f"#SBATCH --{k}={slurm[k]}" for k in SITE_FIELDS if slurm.get(k))
    cpus = (
        REPORT_CPUS
        if report
        else IMPORT_CPUS
        if job.kind == "import"
        else int(slurm.get("cpus_per_task", SlurmArgs.cpus_per_task))
    )
    name = f"{job.kind}_{job.label}".replace("/", "_") if not report else "mta_report"
    command = job.shell() if not report else _missing_report_inputs(job) + "\n" + job.shell()
    return JOB_TEMPLATE.substitute(
        job_name=shlex.quote(name)[:64],
        gpu_sbatch=f"#SBATCH --gpus-per-node={gpus}\n" if gpus > 0 else "",
        cpus=cpus,
        mem_sbatch=memory_lines(slurm.get("mem"), False) if not report else "",
        time=time_limit(
            REPORT_TIME_MIN if report else (IMPORT_TIME_MIN if job.kind == "import" else slurm.get("time_min", 720))
        ),
        log_dir=shlex.quote(str(job.run_dir / "slurm")),
        extra_sbatch=extra,
        job_id=job.id,
        workdir=shlex.quote(str(REPO)),
        omp=max(1, cpus // 2),
        command=command,
    )


def site_overrides(slurm: dict, given) -> list:
    """``pipeline.slurm``'s partition, account, QoS and constraint for a training job (whose
    own ``slurm`` section sets its size), unless its overrides set them: one place for
    the site's names, every job of the plan."""
    from mta_repro.runs.jobcheck import quote_value

    return [
        f"slurm.{k}={quote_value(slurm[k])}"
        for k in SITE_FIELDS
        if slurm.get(k) and not any(str(o).lstrip("+").startswith(f"slurm.{k}=") for o in given)
    ]


def plan_problems(plan: Plan) -> list:
    """What the jobs still to run would miss at their start (mta_repro/runs/jobcheck.py),
    each line once: a root the jobs cannot write, an import folder, and each training
    job's data, tokenizer and sources (a run an earlier job makes counts as there)."""
    from mta_repro.runs.jobcheck import problems, writable_dir_problem

    lines = [line for line in [writable_dir_problem(plan.root, "root")] if line]
    lines += missing_sources(plan.jobs)
    made = list(plan.train_dirs.values()) + [j.out_file for j in plan.jobs if j.kind == "import" and j.out_file]
    todo = [j for j in plan.jobs if j.kind in ("train", "check") and not done(j)]
    if todo:
        from mta_repro.train.config import compose, to_train_config

        for job in todo:
            cfg = compose(job.overrides)
            for line in problems(cfg, to_train_config(cfg), made_by_plan=made):
                if line.startswith("run_dir:"):  # under the root: said once, above
                    continue
                if line not in lines:
                    lines.append(line)
    return lines


def script_path(job: Job) -> Path:
    return job.run_dir / "slurm" / f"pipeline_{job.kind}.sbatch"


def _refuse_conflicts(plan: Plan) -> None:
    """Refuse (one line, exit 2, nothing written) a plan whose run dirs hold other runs
    than the plan's (``mta_repro.pipeline.done.conflicts``)."""
    lines = conflicts(plan.jobs)
    if lines:
        raise UserError(lines[0] + (f" (and {len(lines) - 1} more run dir(s) alike)" if len(lines) > 1 else ""))


# ------------------------------------------------------------------ local
# The signals the local runner passes on to its running job: Ctrl-C (SIGINT) and SIGTERM.
FORWARDED = (signal.SIGINT, signal.SIGTERM)
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent(parent: int):
    """A ``preexec_fn``: the job gets SIGTERM when the pipeline process dies (even by
    SIGKILL), so it checkpoints at its next step boundary and lets go of its run dir's lock
    instead of training on as an orphan (Linux: prctl PR_SET_PDEATHSIG; elsewhere nothing).
    The parent may have died between fork and prctl: then the job stops at once."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)  # loaded before the fork: the child only calls it

    def set_pdeathsig() -> None:
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)

    return set_pdeathsig


def _run_job(job: Job, logf: Path, env: dict, stop: list) -> int:
    """Run ``job`` to its end, its output appended to ``logf``. The job runs in its own
    process group, so a Ctrl-C at the terminal reaches it once, through this process:
    SIGINT and SIGTERM here are passed on to it (the trainer checkpoints at the next step
    boundary and exits 128 + N) and recorded in ``stop``; this waits for it to end."""
    with open(logf, "a") as f:
        f.write(f"$ {job.shell()}\n")
        f.flush()
        proc = subprocess.Popen(
            job.command,
            cwd=str(REPO),
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=_die_with_parent(os.getpid()),
        )

        def forward(signum, frame) -> None:
            stop.append(signum)
            proc.send_signal(signum)  # nothing when it has already ended

        previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
        try:
            return proc.wait()
        finally:
            for sig, prev in previous.items():
                signal.signal(sig, prev)


def run_local(plan: Plan, log=print) -> int:
    """Run the jobs in order; skip the done ones. 0; 1 at the first failure; 128 + N when a
    job was stopped by signal N, or this process got Ctrl-C / SIGTERM (passed on to the
    running job, which saves first: unfinished, the same command resumes it). A run dir
    that holds another run than the plan's is refused before any job (one line, exit 2)."""
    _refuse_conflicts(plan)
    todo = [j for j in plan.jobs if not done(j)]
    if not todo:
        log(f"pipeline: nothing to do, all {len(plan.jobs)} jobs are done ({plan.root})")
        return 0
    _require_sources(plan)
    if any(j.kind == "eval" for j in todo):
        plan.write_lm_eval_tasks()
    env = dict(os.environ)
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    for job in plan.jobs:
        if done(job):
            log(f"pipeline: {job.id}: done, skipped")
            continue
        for line in torn(job):
            log(f"pipeline: {job.id}: {line}: redoing the job")
        job.run_dir.mkdir(parents=True, exist_ok=True)
        logf = job.run_dir / f"pipeline_{job.kind}.log"
        log(f"pipeline: {job.id}: running (log {logf})")
        t0 = time.time()
        stop: list = []
        rc = _run_job(job, logf, env, stop)
        if stop:  # Ctrl-C / SIGTERM here: passed on, the job has ended (saved); stop the plan
            sig = int(stop[0])
            tail = "\n".join(logf.read_text().splitlines()[-15:])
            log(
                f"pipeline: {job.id}: {signal.Signals(sig).name} received, passed on to the job, which ended "
                f"with exit {rc} after {time.time() - t0:.0f}s; stopping (exit {128 + sig}). Rerun the same "
                f"command to resume. Last lines of {logf}:\n{tail}"
            )
            return 128 + sig
        if rc != 0 or not done(job):
            tail = "\n".join(logf.read_text().splitlines()[-15:])
            if rc > 128 or rc < 0:  # stopped by a signal (a run saves first): unfinished, not done
                sig = rc - 128 if rc > 128 else -rc
                log(
                    f"pipeline: {job.id}: stopped by signal {sig} (exit {rc}) after {time.time() - t0:.0f}s, "
                    f"unfinished; rerun the same command to resume. Last lines of {logf}:\n{tail}"
                )
                return rc if rc > 128 else 128 + sig
            cause = "" if rc != 0 else f": it ended without error, but {why_not_done(job)}"
            log(
                f"pipeline: {job.id}: FAILED (exit {rc}) after {time.time() - t0:.0f}s{cause}; rerun the same "
                f"command to resume. Last lines of {logf}:\n{tail}"
            )
            return 1
        log(f"pipeline: {job.id}: done in {time.time() - t0:.0f}s")
    log(f"pipeline: finished; report: {plan.root / 'report' / 'report.md'}")
    return 0


# ------------------------------------------------------------------ SLURM
def _state_file(plan: Plan) -> Path:
    return plan.root / ".pipeline" / "slurm_jobs.json"


def _alive(job_ids) -> set:
    """Those of ``job_ids`` that SLURM still has pending or running."""
    if not job_ids:
        return set()
    try:
        out = subprocess.run(
            ["squeue", "-h", "-o", "%i", "-j", ",".join(job_ids)], capture_output=True, text=True, timeout=60
        )
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return set()
    return {line.strip() for line in out.stdout.splitlines() if line.strip()}


def submit_slurm(plan: Plan, dry_run: bool = False, log=print) -> int:
    """Submit every job that is not done, each with --dependency=afterok on the jobs it
    needs that were (or still are) queued; jobs still queued from an earlier submission are
    not submitted twice. --dry-run prints the scripts instead."""
    slurm = dict(plan.spec.get("slurm") or {})
    state_f = _state_file(plan)
    try:
        previous = read_json(state_f, dict, "the pipeline's record of submitted jobs") if state_f.is_file() else {}
    except UserError as e:  # torn: its jobs cannot be told; squeue's own list decides nothing here
        log(f"pipeline: {e}: submitting as if nothing were queued")
        previous = {}
    alive = _alive(list(previous.values())) if not dry_run else set()
    if dry_run:
        for line in missing_sources(plan.jobs) + conflicts(plan.jobs):
            log(f"# note: {line}")
    else:
        _refuse_conflicts(plan)
        _require_sources(plan)
    ids: dict = {}
    if not dry_run and any(j.kind == "eval" and not done(j) for j in plan.jobs):
        plan.write_lm_eval_tasks()
    submitted = 0
    for job in plan.jobs:
        if done(job):
            log(f"pipeline: {job.id}: done, skipped")
            continue
        if previous.get(job.id) in alive:
            ids[job.id] = previous[job.id]
            log(f"pipeline: {job.id}: still queued as job {ids[job.id]}, not submitted again")
            continue
        for line in torn(job):
            log(f"pipeline: {job.id}: {line}: redoing the job")
        script = job_script(job, slurm)
        deps = [ids[d] for d in job.deps if d in ids]
        kind = "afterany" if job.kind == "report" else "afterok"  # the report: after all END
        dep_args = [f"--dependency={kind}:{':'.join(deps)}"] if deps else []
        if dry_run:
            ids[job.id] = f"<{job.id}>"
            log(f"# ---- {job.id}: sbatch {' '.join(dep_args)} {script_path(job)}")
            log(script)
            continue
        path = script_path(job)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(script)
        ids[job.id] = _submit(path, dep_args)
        submitted += 1
        log(f"pipeline: {job.id}: submitted as job {ids[job.id]}" + (f" ({dep_args[0]})" if dep_args else ""))
    if not dry_run:
        state_f.parent.mkdir(parents=True, exist_ok=True)
        replace_atomically(state_f, json.dumps({**previous, **ids}, indent=1).encode())
        log(
            f"pipeline: {submitted} job(s) submitted; rerun this command after they end (it skips what is done "
            f"and resubmits what is not); report: {plan.root / 'report' / 'report.md'}"
        )
    return 0


def _require_sources(plan: Plan) -> None:
    """Refuse to start when an import's folder is missing: before any job, not hours in."""
    missing = missing_sources(plan.jobs)
    if missing:
        raise UserError(missing[0] + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))


def _submit(path: Path, dep_args) -> str:
    return sbatch(path, dep_args)


def print_plan(plan: Plan, log=print) -> None:
    log(plan.describe())
    for j in plan.jobs:
        log(f"  {j.id}: {j.shell()}")


def main_run(plan: Plan, launcher: str, dry_run: bool, log=print) -> int:
    if dry_run:
        print_plan(plan, log)
        if launcher == "slurm":
            rc = submit_slurm(plan, dry_run=True, log=log)
            log(f"({len(plan.jobs)} jobs; --plan prints the job table alone)")
            return rc
        return 0
    if launcher == "slurm":
        return submit_slurm(plan, log=log)
    return run_local(plan, log)
