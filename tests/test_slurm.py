"""SLURM: the rendered scripts, the submit CLI's errors, and jobs on a real scheduler.

The tests marked ``cluster`` run one-node jobs on the local cluster of
``scripts/slurm_local.sh start`` (.ci/run starts it), and only with MTA_TEST_SLURM=1
(else skipped: a login node's sinfo answers for the site's cluster); then they FAIL when
CI=true and no cluster answers, and are skipped otherwise. They use 2 CPU ranks (gloo) and the
``batch_source`` loader of tests/distributed, whose global batches are the same for any
world size, so a SLURM job's losses can be compared with one local process within the
2-rank test's tolerance (1e-5, see tests/distributed/test_train_distributed.py).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
STEPS = 16
TOL = 1e-5  # the 2-rank test's tolerance

# Every job runs in the foreground of a 2-core machine: keep them tiny.
COMMON = [
    "data.seq_len=32",
    "data.seed=3",
    f"trainer.steps={STEPS}",
    "trainer.device=cpu",
    f"checkpoint.every={STEPS}",
    "checkpoint.export=false",
    "logging.every=1",
    "logging.wandb_mode=disabled",
    "logging.progress_bar=false",
    "optim.lr=3e-3",
    "optim.warmup=2",
    # Validation at the last step runs (on both ranks, under srun) but on one batch per
    # domain: these tests compare training losses, and the default 256 batches per domain
    # (1,012 forward batches) were 40-80 s of every job and of the reference
    "trainer.eval_max_batches=1",
]
CPU_PROFILE = [
    "slurm.gpus_per_node=0",
    "slurm.tasks_per_node=2",
    "slurm.cpus_per_task=1",
    "slurm.cpu_bind=null",
    "slurm.time_min=10",
    "slurm.signal_s=30",
]


# ------------------------------------------------------------------ helpers
def slow_build(data_args, rank, world_size):
    """batch_source's loader, 0.3 s per batch: a run long enough to signal mid-way."""
    from batch_source import build

    src = build(data_args, rank, world_size)
    nxt = src.__next__

    class Slow(type(src)):
        def __next__(self):
            time.sleep(0.3)
            return nxt()

    src.__class__ = Slow
    return src


def _env(**extra):
    path = os.pathsep.join([str(ROOT), str(HERE), str(HERE / "distributed")])
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path, **extra)


def _run(args, check=True, **kw):
    p = subprocess.run(
        [sys.executable, *args],
        cwd=kw.pop("cwd", ROOT),
        env=kw.pop("env", _env()),
        capture_output=True,
        text=True,
        timeout=kw.pop("timeout", 300),
        **kw,
    )
    if check:
        assert p.returncode == 0, p.stderr[-4000:]
    return p


def _losses(run_dir):
    rows = [json.loads(l) for l in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows}


def _job_field(job, key):
    out = subprocess.run(["scontrol", "show", "job", str(job)], capture_output=True, text=True).stdout
    m = re.search(rf"\b{key}=(\S+)", out)
    return m.group(1) if m else None


def _wait_job(job, timeout=240):
    """Wait until the job leaves the queue; its final state (kept MinJobAge=300 s)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        state = _job_field(job, "JobState")
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            return state
        time.sleep(0.5)
    subprocess.run(["scancel", str(job)])
    pytest.fail(f"job {job} did not finish within {timeout} s (state {_job_field(job, 'JobState')})")


def _submit_train(run_dir, *extra, common=COMMON, env=None):
    p = _run(
        [
            "-m",
            "mta_repro.pipeline.submit",
            *common,
            *CPU_PROFILE,
            f"run_dir={run_dir}",
            "data.batch_size=2",
            *extra,
            "--submit",
        ],
        env=env or _env(),
    )
    m = re.search(r"Submitted batch job (\d+)", p.stdout)
    assert m, p.stdout + p.stderr
    return m.group(1)


def _logs(run_dir, job, ext):
    return (Path(run_dir) / "slurm" / f"{job}.{ext}").read_text()


# Submitting from the suite needs this opt-in: without it a `make test` on a login node
# would queue jobs on the site's cluster (whatever answers sinfo). .ci/run sets it for its
# own local cluster.
OPT_IN = "MTA_TEST_SLURM"


@pytest.fixture(scope="session")
def cluster():
    """Jobs go to a scheduler only with MTA_TEST_SLURM=1 (else skip, saying so); then the
    cluster must answer: fail in CI, skip elsewhere."""
    if os.environ.get(OPT_IN) != "1":
        pytest.skip(
            f"{OPT_IN} is not 1: these tests submit jobs to whatever SLURM cluster answers sinfo; "
            f"set {OPT_IN}=1 where that is a test cluster (scripts/slurm_local.sh start)"
        )
    try:
        p = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=20)
        up = p.returncode == 0 and any(s.startswith(("idle", "mixed", "alloc")) for s in p.stdout.split())
        why = (p.stderr or p.stdout).strip() or "no node is up"
    except (OSError, subprocess.SubprocessError) as e:
        up, why = False, str(e)
    if not up:
        msg = f"no SLURM cluster answers ({why}); start one with scripts/slurm_local.sh start"
        if os.environ.get("CI") == "true":
            pytest.fail(msg)
        pytest.skip(msg)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One plain process on the global batch of 4 (2 ranks x 1 in the SLURM jobs)."""
    run_dir = tmp_path_factory.mktemp("slurm_ref") / "one"
    _run(
        [
            "-m",
            "mta_repro.train",
            *COMMON,
            f"run_dir={run_dir}",
            "trainer.loader=batch_source:build",
            "data.batch_size=4",
        ]
    )
    return _losses(run_dir)


def _assert_matches(reference, run_dir):
    got = _losses(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))
    diff = max(abs(reference[s]["loss"] - got[s]["loss"]) for s in reference)
    print(f"max |loss 1 process - loss SLURM 2 ranks| = {diff:.2e}")
    for s in range(1, STEPS + 1):
        assert abs(reference[s]["loss"] - got[s]["loss"]) <= TOL, (s, reference[s]["loss"], got[s]["loss"])


# ------------------------------------------------------------------ rendering (no cluster)
def test_cpu_profile_renders_tasks_and_no_gpu_request():
    from mta_repro.pipeline.submit import render

    script, _ = render(["experiment=debug", *CPU_PROFILE])
    assert "--gpus" not in script and "gres" not in script
    assert "#SBATCH --ntasks-per-node=2\n" in script and "#SBATCH --cpus-per-task=1\n" in script
    srun = [l for l in script.splitlines() if l.startswith("srun ")][0]
    assert "--cpus-per-task=1 " in srun and "--cpu-bind" not in srun
    # GPU partitions keep one task per GPU, the GPU request and the binding.
    gpu, _ = render(["experiment=pretrain_880m_mta"])
    assert "#SBATCH --gpus-per-node=8\n" in gpu and "#SBATCH --ntasks-per-node=8\n" in gpu
    assert "--cpus-per-task=8 --cpu-bind=none " in [l for l in gpu.splitlines() if l.startswith("srun ")][0]
    with pytest.raises(ValueError, match="slurm.tasks_per_node"):
        render(["experiment=debug", "slurm.gpus_per_node=0"])
    with pytest.raises(ValueError, match="trainer.device=cuda but slurm.gpus_per_node=0"):
        render(["experiment=pretrain_880m_mta", *CPU_PROFILE])


def test_paths_made_absolute_and_init_from_checked(tmp_path):
    (tmp_path / "runs" / "base").mkdir(parents=True)
    args = ["-m", "mta_repro.pipeline.submit", "experiment=debug", *CPU_PROFILE, "run_dir=runs/next"]
    p = _run([*args, "checkpoint.init_from=runs/base", "--dry-run"], cwd=tmp_path)
    srun = [l for l in p.stdout.splitlines() if l.startswith("srun ")][0]
    assert f"run_dir={tmp_path}/runs/next" in srun and f"checkpoint.init_from={tmp_path}/runs/base" in srun
    assert "run_dir=runs/next" not in srun and "init_from=runs/base" not in srun
    assert f"#SBATCH --output={tmp_path}/runs/next/slurm/%j.out" in p.stdout
    # A source run given relative to the submit directory must exist there.
    p = _run(
        [
            "-m",
            "mta_repro.pipeline.submit",
            "experiment=long_context_880m_mta",
            *CPU_PROFILE,
            "trainer.device=cpu",
            "checkpoint.init_from=runs/pretrain_880m_mta",
            "--submit",
        ],
        cwd=tmp_path,
        check=False,
    )
    assert p.returncode == 2 and "Traceback" not in p.stderr
    lines = p.stderr.strip().splitlines()  # one line a missing path (the paper's corpus and tokenizer too)
    assert all(line.startswith("mta_repro.pipeline.submit: error: ") for line in lines), lines
    assert (
        f"mta_repro.pipeline.submit: error: checkpoint.init_from: {tmp_path}/runs/pretrain_880m_mta does not exist "
        "(a run dir, a checkpoint dir or a .pt file; relative paths are taken from the submit directory; add "
        "--no-check if it exists only on the compute nodes)"
    ) in lines
    assert not (tmp_path / "runs" / "long_context_880m_mta").exists()  # nothing written, nothing queued
    # ... and a stage without its source says which field to give, in one line.
    p = _run(
        ["-m", "mta_repro.pipeline.submit", "experiment=long_context_880m_mta", "--submit"], cwd=tmp_path, check=False
    )
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1
    assert p.stderr.startswith("mta_repro.pipeline.submit: error: checkpoint.init_from: required")


def test_sweep_experiments_are_refused_with_the_launcher_to_use():
    p = _run(["-m", "mta_repro.pipeline.submit", "experiment=ablation_kernels", "--dry-run"], check=False)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and p.stdout == ""
    assert "hydra.mode: MULTIRUN" in p.stderr
    assert "python -m mta_repro.train -m launcher=slurm experiment=ablation_kernels" in p.stderr


def test_submit_without_sbatch_says_so(tmp_path):
    p = _run(
        ["-m", "mta_repro.pipeline.submit", "experiment=debug", *CPU_PROFILE, f"run_dir={tmp_path}/r", "--submit"],
        env=_env(PATH=str(tmp_path)),
        check=False,
    )
    assert p.returncode == 2 and "Traceback" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mta_repro.pipeline.submit: error: sbatch is not on PATH"), lines
    assert (tmp_path / "r" / "slurm" / "train.sbatch").is_file()  # named in the message, kept to inspect


def test_submit_refuses_a_run_dir_whose_lock_a_live_start_holds(tmp_path):
    """A start running here holds the run dir's lock (this test's own pid stands in): the
    submission is refused in the start's own line, rc 2, and writes no script."""
    import socket

    run_dir = tmp_path / "r"
    run_dir.mkdir()
    holder = {"host": socket.gethostname(), "pid": os.getpid(), "slurm_job_id": None, "started": "then"}
    (run_dir / ".lock").write_text(json.dumps(holder))
    p = _run(
        ["-m", "mta_repro.pipeline.submit", "experiment=debug", *CPU_PROFILE, f"run_dir={run_dir}", "--submit"],
        env=_env(PATH=str(tmp_path)),  # no sbatch, no squeue: the lock alone refuses
        check=False,
    )
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert _errors(p, "mta_repro.pipeline.submit") == [
        f"run_dir={run_dir} is in use by another job (host {holder['host']}, pid {os.getpid()}, since then, "
        f"last alive 0 min ago); wait for it, use another run_dir=..., or if that job is dead delete {run_dir}/.lock"
    ]
    assert not (run_dir / "slurm").exists()


def test_eval_sbatch_renders_the_eval_command(tmp_path):
    p = _run(["-m", "mta_repro.eval.submit", "runs/x", "tasks=[ppl]", "--gpus", "0", "--after", "42:43"], cwd=tmp_path)
    assert "#SBATCH --dependency=afterok:42:43\n" in p.stdout and "--gpus" not in p.stdout
    srun = [l for l in p.stdout.splitlines() if l.startswith("srun ")][0]
    assert srun.endswith(f"-m mta_repro.eval {tmp_path}/runs/x 'tasks=[ppl]'")
    bad = _run(["-m", "mta_repro.eval.submit", "runs/x", "tasks=[pl]"], cwd=tmp_path, check=False)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "tasks: unknown ['pl']" in bad.stderr


def test_gpu_job_hygiene_in_the_rendered_script(tmp_path):
    """The 880M training job: allocator, node-local compile caches, NCCL flight recorder,
    --mem and --exclusive from the experiment, each env setting overridable, valid bash."""
    from mta_repro.pipeline.submit import render

    script, _ = render(["experiment=pretrain_880m_mta"])
    for line in (
        "#SBATCH --mem=0\n",
        "#SBATCH --exclusive\n",
        "export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}\n",
        "export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-${SLURM_TMPDIR:-/tmp}/",
        "export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-${SLURM_TMPDIR:-/tmp}/",
        "export TORCH_NCCL_TRACE_BUFFER_SIZE=${TORCH_NCCL_TRACE_BUFFER_SIZE:-2000}\n",
        "export TORCH_NCCL_DUMP_ON_TIMEOUT=",
        "/runs/pretrain_880m_mta/slurm/nccl_trace_${SLURM_JOB_ID}_rank_}",
        "export OMP_NUM_THREADS=4\n",
    ):
        assert line in script, line
    assert "KillWait" in script  # the preemption order is explained where it is set
    # the #SBATCH lines come before the first command (sbatch stops reading them there)
    lines = script.splitlines()
    first_cmd = next(i for i, l in enumerate(lines) if l and not l.startswith("#"))
    assert all(not l.startswith("#SBATCH") for l in lines[first_cmd:])
    path = tmp_path / "t.sbatch"
    path.write_text(script)
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    # the defaults stay off where the config does not ask, and a user's setting wins
    dbg, _ = render(["experiment=debug", *CPU_PROFILE])
    assert "--mem" not in dbg and "--exclusive" not in dbg
    mem, _ = render(["experiment=debug", *CPU_PROFILE, "slurm.mem=64G"])
    assert "#SBATCH --mem=64G\n" in mem
    env = {"PATH": os.environ["PATH"], "PYTORCH_CUDA_ALLOC_CONF": "mine", "SLURM_JOB_ID": "7"}
    exports = (
        "\n".join(l for l in lines if l.startswith("export ")) + "\necho $PYTORCH_CUDA_ALLOC_CONF $TRITON_CACHE_DIR"
    )
    out = subprocess.run(["bash", "-c", exports], capture_output=True, text=True, env=env).stdout.split()
    assert out[0] == "mine" and out[1].startswith("/tmp/mta_repro_")


def test_time_limit_is_a_public_shared_helper():
    from mta_repro import slurm

    assert slurm.time_limit(2880) == "2-00:00:00" and slurm.time_limit(90) == "0-01:30:00"


def test_eval_sbatch_mem_and_exclusive(tmp_path):
    p = _run(
        [
            "-m",
            "mta_repro.eval.submit",
            "runs/x",
            "tasks=[ppl]",
            "--gpus",
            "0",
            "--mem",
            "32G",
            "--exclusive",
            "--after",
            "7",
        ],
        cwd=tmp_path,
    )
    assert "#SBATCH --mem=32G\n#SBATCH --exclusive\n" in p.stdout
    assert "export PYTORCH_CUDA_ALLOC_CONF=" in p.stdout


def test_pipeline_report_job_runs_after_all_end_and_is_small(tmp_path):
    """afterany (not afterok): a failed evaluation must not leave the report pending
    forever; it names what is missing; 2 CPUs for an hour, not a GPU job's day."""
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "mta_repro.pipeline",
            "pipeline=tiny",
            f"root={tmp_path}",
            "launcher=slurm",
            "pipeline.lm_eval_local=null",
            "--dry-run",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
    )
    assert p.returncode == 0, p.stderr[-2000:]
    head, report = p.stdout.split("# ---- report: sbatch ", 1)
    assert report.startswith("--dependency=afterany:")
    assert "--dependency=afterany" not in head  # the stages themselves still need success
    assert "#SBATCH --job-name=mta_report\n" in report and "#SBATCH --cpus-per-task=2\n" in report
    assert "#SBATCH --time=0-01:00:00\n" in report and "--gpus" not in report
    assert "report: missing: " in report and "/export (training did not finish)" in report


# ------------------------------------------------------------------ the real scheduler


@pytest.mark.slow
@pytest.mark.usefixtures("cluster")
def test_cpu_job_two_ranks_matches_one_process(reference, tmp_path):
    run_dir = tmp_path / "two"
    job = _submit_train(run_dir, "trainer.loader=batch_source:build")
    assert _wait_job(job) == "COMPLETED", _logs(run_dir, job, "err")[-3000:]
    assert _job_field(job, "NumTasks") == "2"
    _assert_matches(reference, run_dir)
    err = _logs(run_dir, job, "err")
    assert "\r" not in err and "lacks support for cpu binding" not in err
    assert (run_dir / ".hydra" / "config.yaml").is_file() and (run_dir / "checkpoints").is_dir()


# The configs' own logging (wandb offline), as a user's job runs it.
DEFAULT_LOGGING = [a for a in COMMON if not a.startswith("logging.wandb_mode=")]


@pytest.mark.slow
@pytest.mark.usefixtures("cluster")
@pytest.mark.parametrize("common", [COMMON, DEFAULT_LOGGING], ids=["wandb-disabled", "default-logging"])
def test_usr2_requeues_then_resumes_exactly(reference, tmp_path, common):
    """scancel --signal=USR2 mid-run: requeue first, save, resume at the saved step, every
    step once and equal to an uninterrupted run; with the default logging too (wandb
    offline, whose service process SLURM's SIGTERM after the requeue ends)."""
    run_dir = tmp_path / "pre"
    job = _submit_train(run_dir, "trainer.loader=test_slurm:slow_build", common=common)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 180
    while time.time() < deadline:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 4:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"job {job} logged no steps: {_job_field(job, 'JobState')}")
    subprocess.run(["scancel", "--signal=USR2", job], check=True)
    assert _wait_job(job, timeout=300) == "COMPLETED", _logs(run_dir, job, "err")[-3000:]
    err = _logs(run_dir, job, "err")
    stopped = re.search(r"stopped at step (\d+) after a signal and requeued the job", err)
    assert stopped, err[-3000:]
    k = int(stopped.group(1))
    assert 4 <= k < STEPS
    # Requeue first, then save: the requeue is reported before the saved stop.
    assert err.index(f"requeued job {job}") < stopped.start()
    assert f"resumed from {run_dir}/checkpoints/{k:010d} at step {k}" in err
    assert _job_field(job, "Restarts") == "1"
    _assert_matches(reference, run_dir)  # every logged step, once, equal to uninterrupted
    assert "Traceback" not in err, err[-3000:]  # wandb's service gone: no rank dies of it


# A sitecustomize that holds rank 1 of a job's first run for two minutes before Python
# starts (once: a marker file), so that rank 0 waits in the rendezvous.
LATE_RANK_1 = """
import os
import time
from pathlib import Path

if os.environ.get("SLURM_PROCID") == "1" and os.environ.get("MTA_TEST_LATE_MARKER"):
    marker = Path(os.environ["MTA_TEST_LATE_MARKER"])
    if not marker.exists():
        marker.touch()
        time.sleep(120)
"""


# A sitecustomize under which rank 1 takes 5 s more to exit than rank 0.
SLOW_EXIT_RANK_1 = """
import atexit
import os
import time

if os.environ.get("SLURM_PROCID") == "1":
    atexit.register(time.sleep, 5)
"""


def _wait_for_log(path: Path, text: str, job: str, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.is_file() and text in path.read_text():
            return
        time.sleep(0.2)
    subprocess.run(["scancel", job])
    pytest.fail(f"job {job} never logged {text!r}: {path.read_text()[-3000:] if path.is_file() else 'no log'}")


@pytest.mark.slow
@pytest.mark.usefixtures("cluster")
def test_usr2_during_the_rendezvous_requeues_the_job(tmp_path):
    """Rank 0 waits in init_process_group for a rank 1 that starts late: scancel
    --signal=USR2 stops it with its line and requeues the job, which then trains every
    step once (before, the signal killed the rank with no line, and no requeue)."""
    late = tmp_path / "late"
    late.mkdir()
    (late / "sitecustomize.py").write_text(LATE_RANK_1)
    env = _env(MTA_TEST_LATE_MARKER=str(tmp_path / "rank1_was_late"))
    env["PYTHONPATH"] = f"{late}{os.pathsep}{env['PYTHONPATH']}"
    run_dir = tmp_path / "rdv"
    job = _submit_train(run_dir, "trainer.loader=batch_source:build", env=env)
    _wait_for_log(run_dir / "slurm" / f"{job}.err", "rank 0: waiting for the rendezvous of 2 ranks", job)
    subprocess.run(["scancel", "--signal=USR2", job], check=True)
    assert _wait_job(job, timeout=300) == "COMPLETED", _logs(run_dir, job, "err")[-3000:]
    err = _logs(run_dir, job, "err")
    assert re.search(
        r"train: stopped by SIGUSR2 during the rendezvous of 2 ranks at \S+ \(before the first step\): "
        r"nothing trained, nothing saved; the job resumes by itself",
        err,
    ), err[-3000:]
    assert f"requeued job {job}" in err
    assert _job_field(job, "Restarts") == "1"
    assert sorted(_losses(run_dir)) == list(range(1, STEPS + 1))


@pytest.mark.slow
@pytest.mark.usefixtures("cluster")
def test_a_requeue_refused_at_start_is_recorded_with_exit_2(tmp_path):
    """The tokenizer file is damaged while the job runs; USR2 saves and requeues; the
    requeued start is refused on both ranks (one line, rc 2 each), rank 1 a few seconds
    after rank 0 (a slower exit, as on a busy node): SLURM records the job's exit as 2, a
    refusal, not 143 (srun's SIGTERM to the rank still exiting, read as a stop by a
    signal)."""
    slow = tmp_path / "slow_exit"
    slow.mkdir()
    (slow / "sitecustomize.py").write_text(SLOW_EXIT_RANK_1)
    env = _env()
    env["PYTHONPATH"] = f"{slow}{os.pathsep}{env['PYTHONPATH']}"
    tok = tmp_path / "tok.model"
    tok.write_bytes((ROOT / "data" / "tokenizer" / "mini_sp8192.model").read_bytes())
    run_dir = tmp_path / "refused"
    job = _submit_train(run_dir, "trainer.loader=test_slurm:slow_build", f"data.tokenizer.path={tok}", env=env)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 180
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 3):
        if time.time() > deadline:
            subprocess.run(["scancel", job])
            pytest.fail(f"job {job} logged no steps: {_job_field(job, 'JobState')}")
        time.sleep(0.05)
    tok.write_bytes(tok.read_bytes() + b"another tokenizer")
    subprocess.run(["scancel", "--signal=USR2", job], check=True)
    assert _wait_job(job, timeout=300) == "FAILED", _logs(run_dir, job, "err")[-3000:]
    err = _logs(run_dir, job, "err")
    assert re.search(r"stopped at step \d+ after a signal and requeued the job", err), err[-3000:]
    refusals = [line for line in err.splitlines() if line.startswith("train: error: ")]
    assert refusals and "tokenizer" in refusals[0], err[-3000:]
    assert _job_field(job, "Restarts") == "1"
    assert _job_field(job, "ExitCode") == "2:0", err[-3000:]


@pytest.mark.slow
@pytest.mark.usefixtures("cluster")
def test_eval_job_runs_after_training_with_afterok(tmp_path):
    run_dir = tmp_path / "ev"
    train = _submit_train(
        run_dir, "trainer.steps=2", "checkpoint.every=2", "slurm.tasks_per_node=1", "checkpoint.export=true"
    )
    p = _run(
        [
            "-m",
            "mta_repro.eval.submit",
            str(run_dir),
            "tasks=[ppl]",
            "ppl.max_batches=2",
            "ppl.batch_size=1",
            "--gpus",
            "0",
            "--cpus",
            "1",
            "--time-min",
            "10",
            "--after",
            train,
            "--submit",
        ]
    )
    ev = re.search(r"Submitted batch job (\d+)", p.stdout).group(1)
    assert _job_field(ev, "Dependency") in (f"afterok:{train}(unfulfilled)", "(null)")
    assert _wait_job(train) == "COMPLETED"
    assert _wait_job(ev) == "COMPLETED", _logs(run_dir, ev, "err")[-3000:]
    out = json.loads((run_dir / "eval" / "ppl.json").read_text())
    assert out["task"] == "ppl" and out["step"] == 2
    # It started only after training ended.
    assert _job_field(ev, "StartTime") >= _job_field(train, "EndTime")


@pytest.mark.slow
@pytest.mark.usefixtures("cluster")
def test_refused_sbatch_shows_its_own_message_in_one_line(tmp_path):
    p = _run(
        [
            "-m",
            "mta_repro.pipeline.submit",
            "experiment=debug",
            *CPU_PROFILE,
            f"run_dir={tmp_path}/r",
            "slurm.partition=no_such_partition",
            "--submit",
        ],
        check=False,
    )
    assert p.returncode == 2 and "Traceback" not in p.stderr  # the fix is the submitter's: a user error's code
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(
        f"mta_repro.pipeline.submit: error: sbatch refused {tmp_path}/r/slurm/train.sbatch (exit 1): "
    )
    # sbatch's own words, e.g. "Batch job submission failed: Invalid partition name specified".
    assert "Invalid partition name specified" in lines[0]


@pytest.mark.slow
@pytest.mark.usefixtures("cluster")
def test_a_second_job_on_a_queued_run_dir_is_refused_at_submission(tmp_path):
    """A job queued or running on run_dir (it has not taken the lock while it waits): a
    second submission on the same run dir is refused in one line naming the job, rc 2, and
    the queue holds one job of that name; another run dir is accepted."""
    run_dir, name = tmp_path / "owned", f"owned_{os.getpid()}"
    first = _submit_train(run_dir, "trainer.loader=test_slurm:slow_build", f"slurm.job_name={name}")
    try:
        p = _run(
            [
                "-m",
                "mta_repro.pipeline.submit",
                *COMMON,
                *CPU_PROFILE,
                f"run_dir={run_dir}",
                f"slurm.job_name={name}",
                "--submit",
            ],
            check=False,
        )
        assert p.returncode == 2 and "Submitted batch job" not in p.stdout, p.stderr[-2000:]
        [line] = _errors(p, "mta_repro.pipeline.submit")
        assert line.startswith(f"run_dir={run_dir} is already SLURM job {first}'s ("), line
        assert f"{run_dir}/slurm/train.sbatch): a second job would train the same run" in line
        assert f"scancel {first}" in line
        queued = subprocess.run(["squeue", "-h", "-n", name, "-o", "%i"], capture_output=True, text=True).stdout
        assert queued.split() == [first]
    finally:
        subprocess.run(["scancel", first])
    _wait_job(first)


def test_cluster_tests_fail_in_ci_and_skip_elsewhere_without_a_cluster(tmp_path):
    """No sinfo on PATH: with CI=true the cluster tests fail (CI must run them), else skip."""
    test = f"{Path(__file__)}::test_refused_sbatch_shows_its_own_message_in_one_line"
    base = {k: v for k, v in _env(PATH=str(tmp_path), MTA_TEST_SLURM="1").items() if k != "CI"}
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test, "-rs"]
    ci = subprocess.run(args, cwd=ROOT, env=dict(base, CI="true"), capture_output=True, text=True, timeout=120)
    assert ci.returncode == 1 and "1 error" in ci.stdout and "no SLURM cluster answers" in ci.stdout, ci.stdout[-2000:]
    local = subprocess.run(args, cwd=ROOT, env=base, capture_output=True, text=True, timeout=120)
    assert local.returncode == 0 and "1 skipped" in local.stdout and "slurm_local.sh start" in local.stdout


def test_cluster_tests_submit_nothing_without_the_opt_in(tmp_path):
    """A cluster answers sinfo (a login node's, here a stand-in), MTA_TEST_SLURM is unset:
    the cluster tests skip and name the variable, CI=true or not, and sbatch is never run."""
    test = f"{Path(__file__)}::test_refused_sbatch_shows_its_own_message_in_one_line"
    bin_dir, calls = tmp_path / "bin", tmp_path / "sbatch_calls"
    bin_dir.mkdir()
    for name, body in (("sinfo", "echo idle"), ("sbatch", f'echo "$@" >> {calls}; echo 1')):
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in _env(PATH=f"{bin_dir}:{os.environ['PATH']}").items() if k not in ("CI", "MTA_TEST_SLURM")}
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test, "-rs"]
    for extra in ({}, {"CI": "true"}):
        p = subprocess.run(args, cwd=ROOT, env=dict(env, **extra), capture_output=True, text=True, timeout=120)
        assert p.returncode == 0 and "1 skipped" in p.stdout, (extra, p.stdout[-2000:])
        assert "MTA_TEST_SLURM is not 1" in p.stdout, p.stdout[-2000:]
    assert not calls.exists()


@pytest.mark.usefixtures("cluster")
def test_pipeline_stages_run_in_order_on_the_scheduler(tmp_path):
    """python -m mta_repro.pipeline launcher=slurm on the real scheduler: pretrain -> its
    eval and the next stage (afterok) -> the report, each job after what it depends on."""
    root = tmp_path / "runs"
    stages = (
        "pipeline.stages=[{name:pretrain,experiment:debug,overrides:['attention={variant}'],"
        "eval:['tasks=[ppl]','ppl.max_batches=1','ppl.domains=[book]']},"
        "{name:long_context,kind:long_context,experiment:debug,init_from:pretrain,"
        "overrides:['attention={variant}','trainer.steps=3','trainer.eval_every=0']}]"
    )
    args = [
        "-m",
        "mta_repro.pipeline",
        "pipeline=tiny",
        f"root={root}",
        "launcher=slurm",
        "pipeline.variants=[baseline]",
        "pipeline.lm_eval_local=null",
        stages,
    ]
    p = _run(args, timeout=120)
    jobs = re.findall(r"submitted as job (\d+)", p.stdout)
    assert len(jobs) == 4, p.stdout  # train, eval, train (next stage), report
    for job in jobs:
        assert _wait_job(job, timeout=400) == "COMPLETED", (job, p.stdout)
    pre, lc = root / "pretrain" / "baseline", root / "long_context" / "baseline"
    ppl, report = pre / "eval" / "ppl.json", root / "report" / "report.md"
    assert ppl.is_file() and report.is_file() and (lc / "export" / "consolidated.pt").is_file()
    # afterok order, read off the files each job wrote last
    assert (pre / "export" / "consolidated.pt").stat().st_mtime <= ppl.stat().st_mtime <= report.stat().st_mtime
    assert (pre / "export" / "consolidated.pt").stat().st_mtime <= (lc / "metrics.jsonl").stat().st_mtime
    assert str(pre) in (lc / "config.yaml").read_text()  # the hand-off, absolute
    # a rerun submits nothing: every stage is done
    again = _run(args, timeout=120)
    assert "submitted as job" not in again.stdout and "0 job(s) submitted" in again.stdout, again.stdout


# ------------------------------------------------------------------ what a job needs at its start
PAPER_DOMAINS = ("arxiv", "book", "c4", "commoncrawl", "github", "stackexchange", "wikipedia")


def _paper_corpus(root: Path, without=()) -> Path:
    """The paper's data layout (``domains``) with one record a file, every domain but ``without``."""
    for d in PAPER_DOMAINS:
        if d in without:
            continue
        (root / d).mkdir(parents=True)
        for name in (f"{d}.chunk.00.jsonl", f"{d}.val.jsonl"):
            (root / d / name).write_text(json.dumps({"text": f"a {d} document"}) + "\n")
    return root


def _paper_env(tmp_path, **extra):
    """SLIMPAJAMA_DIR / LLAMA3_TOKENIZER as a cluster user sets them (a Llama 3 tokenizer is
    only looked for here: any file does)."""
    tok = tmp_path / "tokenizer.model"
    tok.write_text("ranks")
    return _env(SLIMPAJAMA_DIR=str(_paper_corpus(tmp_path / "corpus")), LLAMA3_TOKENIZER=str(tok), **extra)


def _errors(p, prog):
    """The error lines of stderr (a dry-run also prints its command there, as a comment)."""
    lines = [line for line in p.stderr.strip().splitlines() if not line.startswith("# ")]
    assert lines and all(line.startswith(f"{prog}: error: ") for line in lines), p.stderr[-3000:]
    return [line[len(f"{prog}: error: ") :] for line in lines]


def test_dry_run_names_each_missing_path_of_the_job_in_one_line(tmp_path):
    """The 880M run on a machine without its corpus and tokenizer: the script, then one line
    each (rc 2); --no-check renders it alone; a corpus missing one domain names that domain."""
    env = {k: v for k, v in _env().items() if k not in ("SLIMPAJAMA_DIR", "LLAMA3_TOKENIZER")}
    p = _run(
        ["-m", "mta_repro.pipeline.submit", "experiment=pretrain_880m_mta", f"run_dir={tmp_path}/r", "--dry-run"],
        env=env,
        check=False,
    )
    assert p.returncode == 2 and "#!/bin/bash" in p.stdout
    assert sorted(_errors(p, "mta_repro.pipeline.submit")) == [
        "data.root_dir: /datasets/slimpajama_domains ($SLIMPAJAMA_DIR is not set: its default) does not exist (the "
        "corpus, layout domains; add --no-check if it exists only on the compute nodes)",
        "data.tokenizer.path: /checkpoints/llama3/tokenizer.model ($LLAMA3_TOKENIZER is not set: its default) does "
        "not exist (the tiktoken tokenizer file; add --no-check if it exists only on the compute nodes)",
    ]
    ok = _run(
        [
            "-m",
            "mta_repro.pipeline.submit",
            "experiment=pretrain_880m_mta",
            f"run_dir={tmp_path}/r",
            "--dry-run",
            "--no-check",
        ],
        env=env,
    )
    assert ok.stdout == p.stdout and not (tmp_path / "r").exists()
    # a corpus without one of the domains the config reads
    corpus = _paper_corpus(tmp_path / "partial", without=("github",))
    tok = tmp_path / "tok.model"
    tok.write_text("ranks")
    p = _run(
        ["-m", "mta_repro.pipeline.submit", "experiment=pretrain_880m_mta", f"run_dir={tmp_path}/r", "--dry-run"],
        env=dict(env, SLIMPAJAMA_DIR=str(corpus), LLAMA3_TOKENIZER=str(tok)),
        check=False,
    )
    assert p.returncode == 2
    assert _errors(p, "mta_repro.pipeline.submit") == [
        f"data.sources.github: no directory {corpus}/github (layout 'domains') (add --no-check if it exists only on "
        "the compute nodes)"
    ]


def test_values_read_from_the_environment_are_written_into_the_job(tmp_path):
    """SLIMPAJAMA_DIR / LLAMA3_TOKENIZER set at submission: the script's command carries their
    values, so a job started without them (sbatch --export=NONE, another login shell) reads
    the same corpus; the command composes, without the variables, to the submitter's config."""
    env = _paper_env(tmp_path)
    p = _run(
        ["-m", "mta_repro.pipeline.submit", "experiment=pretrain_880m_mta", f"run_dir={tmp_path}/r", "--dry-run"],
        env=env,
    )
    srun = [line for line in p.stdout.splitlines() if line.startswith("srun ")][0]
    words = srun.split()
    overrides = words[words.index("mta_repro.train") + 1 :]
    assert f"data.root_dir={tmp_path}/corpus" in overrides
    assert f"data.tokenizer.path={tmp_path}/tokenizer.model" in overrides
    probe = (
        "import sys; from mta_repro.train.config import compose; c = compose(sys.argv[1:]); "
        "print(c.data.root_dir, c.data.tokenizer.path)"
    )
    bare = {k: v for k, v in env.items() if k not in ("SLIMPAJAMA_DIR", "LLAMA3_TOKENIZER")}
    got = subprocess.run(
        [sys.executable, "-c", probe, *overrides], cwd=ROOT, env=bare, capture_output=True, text=True, timeout=120
    )
    assert got.stdout.split() == [f"{tmp_path}/corpus", f"{tmp_path}/tokenizer.model"], got.stderr[-2000:]


def test_eval_and_pipeline_and_sweep_submissions_check_too(tmp_path):
    """The other SLURM paths: an evaluation of a run that is not there (and no --after job to
    make it); the paper's pipeline (--plan) and a Table 5 sweep through the engine without the
    corpus: one line each, rc 2, and nothing written or queued (no sbatch is on PATH here)."""
    env = {
        k: v
        for k, v in _env(PATH=f"{tmp_path}/bin:{os.environ['PATH']}").items()
        if k not in ("SLIMPAJAMA_DIR", "LLAMA3_TOKENIZER")
    }
    (tmp_path / "bin").mkdir()
    calls = tmp_path / "sbatch_calls"
    (tmp_path / "bin" / "sbatch").write_text(f'#!/bin/bash\necho "$@" >> {calls}\necho 1\n')
    (tmp_path / "bin" / "sbatch").chmod(0o755)
    p = _run(
        ["-m", "mta_repro.eval.submit", "runs/none", "tasks=[ppl]", "--submit"], cwd=tmp_path, env=env, check=False
    )
    assert p.returncode == 2 and _errors(p, "mta_repro.eval.submit") == [
        f"run_dir: {tmp_path}/runs/none does not exist (no training run there, and no --after job to make it; add "
        "--no-check if it exists only on the compute nodes)"
    ]
    p = _run(
        ["-m", "mta_repro.pipeline", "pipeline=paper_880m", f"root={tmp_path}/mta", "launcher=slurm", "--plan"],
        env=env,
        check=False,
    )
    assert p.returncode == 2 and "pipeline paper_880m: 41 jobs" in p.stdout
    lines = _errors(p, "pipeline")
    assert len(lines) == 2 and lines[0].startswith("data.root_dir: /datasets/slimpajama_domains")
    p = _run(
        ["-m", "mta_repro.pipeline", "pipeline=paper_880m", f"root={tmp_path}/mta", "launcher=slurm"],
        env=env,
        check=False,
    )
    assert p.returncode == 2 and _errors(p, "pipeline") == lines
    p = _run(
        [
            "-m",
            "mta_repro.train",
            "-m",
            "launcher=slurm",
            "experiment=ablation_kernels",
            f"run_dir={tmp_path}/sweep/k" + "${model.mta.query_kernel_size}x${model.mta.key_kernel_size}",
        ],
        env=env,
        check=False,
    )
    assert p.returncode == 2 and [line.split(":")[0] for line in _errors(p, "sweep")] == [
        "data.root_dir",
        "data.tokenizer.path",
    ]
    assert not calls.exists() and not (tmp_path / "mta").exists() and not (tmp_path / "sweep").exists()


def test_the_880m_job_fits_an_8_gpu_64_core_node():
    """Every paper experiment's sbatch asks for at most 64 CPUs and 8 GPUs a node (8 ranks x
    slurm.cpus_per_task), what the smallest common 8-GPU node has."""
    from mta_repro.pipeline.submit import render

    for exp in ("pretrain_880m_mta", "pretrain_1b_baseline", "long_context_880m_mta", "mta_insertion"):
        ov = [f"experiment={exp}"] + (["checkpoint.init_from=/src"] if not exp.startswith("pretrain") else [])
        script, _ = render(ov, check_paths=False)
        sb = dict(re.findall(r"#SBATCH --([\w-]+)=(\S+)", script))
        tasks, cpus, gpus = int(sb["ntasks-per-node"]), int(sb["cpus-per-task"]), int(sb["gpus-per-node"])
        assert (tasks, gpus) == (8, 8) and tasks * cpus <= 64, (exp, tasks, cpus)
        srun = [line for line in script.splitlines() if line.startswith("srun ")][0]
        assert f"--cpus-per-task={cpus} " in srun  # srun asks for the same


def test_site_fields_reach_every_job_of_the_pipeline(tmp_path):
    """pipeline.slurm.partition/account/qos/constraint: one place, every job's script (the
    training jobs' own size from their experiments); a list the shell split at its spaces is
    the project's one line."""
    from mta_repro.pipeline.__main__ import main

    p = _run(
        [
            "-m",
            "mta_repro.pipeline",
            "pipeline=tiny",
            f"root={tmp_path}",
            "launcher=slurm",
            "--dry-run",
            "pipeline.slurm.partition=gpu",
            "pipeline.slurm.account=proj",
            "pipeline.slurm.qos=high",
            "pipeline.slurm.constraint=h100",
        ]
    )
    scripts = p.stdout.split("# ---- ")[1:]
    assert scripts and len(scripts) == p.stdout.count("#!/bin/bash")
    for s in scripts:
        for line in (
            "#SBATCH --partition=gpu\n",
            "#SBATCH --account=proj\n",
            "#SBATCH --qos=high\n",
            "#SBATCH --constraint=h100\n",
        ):
            assert line in s, (line, s[:300])
    assert main(["pipeline=tiny", "pipeline.variants=[baseline,", "mta]", "--plan"]) == 2


@pytest.mark.slow
@pytest.mark.usefixtures("cluster")
def test_a_job_without_its_tokenizer_is_refused_before_sbatch(tmp_path):
    """On the scheduler: the job would fail at start (its tokenizer is not there), so nothing
    is queued: rc 2, one line, no job of its name in squeue or sacct, no script written."""
    name = f"no_tok_{os.getpid()}"
    p = _run(
        [
            "-m",
            "mta_repro.pipeline.submit",
            "experiment=debug",
            *CPU_PROFILE,
            f"run_dir={tmp_path}/r",
            f"data.tokenizer.path={tmp_path}/missing.model",
            f"slurm.job_name={name}",
            "--submit",
        ],
        check=False,
    )
    assert p.returncode == 2 and "Submitted batch job" not in p.stdout
    assert _errors(p, "mta_repro.pipeline.submit") == [
        f"data.tokenizer.path: {tmp_path}/missing.model does not exist (the sentencepiece tokenizer file; add "
        "--no-check if it exists only on the compute nodes)"
    ]
    assert subprocess.run(["squeue", "-h", "-n", name], capture_output=True, text=True).stdout.strip() == ""
    acct = subprocess.run(["sacct", "-n", "-X", "--name", name, "-S", "now-1hour"], capture_output=True, text=True)
    assert acct.stdout.strip() == ""  # (the local cluster keeps no accounting: empty either way)
    assert not (tmp_path / "r").exists()
