"""What "done" means to ``python -m mta_repro.pipeline``: a
job is skipped only when its run dir holds the run the plan asks for now; a run dir that
holds another run is refused in one line (exit 2, nothing written); a missing or null
eval result is redone; an export copied from another run is refused by the pipeline,
``eval`` and ``checkpoint.init_from``; Ctrl-C / SIGTERM to a local pipeline let the job
checkpoint first, and no job trains on holding its lock when the pipeline dies."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from mta_repro.pipeline.__main__ import build_plan
from mta_repro.pipeline.done import done, why_not_done

pytestmark = pytest.mark.pipeline

ROOT = Path(__file__).resolve().parents[1]

# One stage, the baseline at seeds 0 and 1, a 1-layer 32-wide model for 2 steps, perplexity
# on one window: the seams of the done check in about a minute on 2 CPU cores.
MINI = {
    "name": "mini",
    "variants": ["baseline"],
    "seeds": [0, 1],
    "train_overrides": [
        "model.dim=32",
        "model.n_layers=1",
        "model.n_heads=2",
        "model.multiple_of=32",
        "data.seq_len=128",
        "data.batch_size=1",
        "data.shuffle_buffer=2",
        "trainer.device=cpu",
        "trainer.steps=2",
        "checkpoint.every=1",
        "logging.every=1",
        "trainer.eval_max_batches=1",
        "trainer.eval_batch_size=1",
        "logging.progress_bar=false",
        "logging.wandb_mode=disabled",
        "optim.lr=0.003",
    ],
    "stages": [
        {
            "name": "pretrain",
            "experiment": "debug",
            "overrides": ["attention={variant}"],
            "eval": ["tasks=[ppl]", "ppl.max_batches=1", "ppl.batch_size=1", "ppl.domains=[book]"],
        }
    ],
    "report": True,
}


def _write_pipeline(cfg_dir: Path, spec: dict) -> list:
    """``spec`` as ``<cfg_dir>/pipeline/<name>.yaml``; the overrides that select it (a
    pipeline config of one's own under hydra.searchpath)."""
    (cfg_dir / "pipeline").mkdir(parents=True, exist_ok=True)
    (cfg_dir / "pipeline" / f"{spec['name']}.yaml").write_text("# @package pipeline\n" + yaml.safe_dump(spec))
    return [f"pipeline={spec['name']}", f"hydra.searchpath=[file://{cfg_dir}]"]


def _pipeline(*args, timeout=600):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "mta_repro.pipeline", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def _snapshot(root: Path) -> dict:
    return {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(root.rglob("*")) if p.is_file()}


def _error_line(p) -> str:
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, p.stderr[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def mini(tmp_path_factory):
    base = tmp_path_factory.mktemp("pipeline_done")
    sel = _write_pipeline(base / "cfg", MINI)
    root = base / "runs"
    p = _pipeline(*sel, f"root={root}")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return root, sel


@pytest.fixture
def copy(mini, tmp_path):
    """A copy of the finished mini pipeline's root (mtimes kept), and its selection."""
    root, sel = mini
    dst = tmp_path / "runs"
    shutil.copytree(root, dst, symlinks=True)
    return dst, sel


def test_a_copied_root_with_the_same_plan_is_done(copy):
    """Case 1, the other side: a copied root (its hand-off paths under the old root) with
    the plan unchanged is done, so nothing is retrained."""
    root, sel = copy
    plan, _ = build_plan([*sel, f"root={root}"])
    assert all(done(j) for j in plan.jobs if j.kind in ("train", "eval"))


def test_a_changed_plan_is_refused_not_reused(copy, tmp_path):
    """Case 1: the plan's model.dim and lr changed, rerun on the finished root: not "done,
    skipped" with last week's runs; refused in one line naming the run dir, the field and
    both values, exit 2, nothing written."""
    root, _ = copy
    changed = dict(MINI, train_overrides=[o.replace("model.dim=32", "model.dim=64") for o in MINI["train_overrides"]])
    changed["train_overrides"] = [o.replace("optim.lr=0.003", "optim.lr=0.001") for o in changed["train_overrides"]]
    sel = _write_pipeline(tmp_path / "cfg2", changed)
    before = _snapshot(root)
    p = _pipeline(*sel, f"root={root}")
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    line = _error_line(p)
    assert f"{root}/pretrain/baseline/seed0 holds a run that is not the one the plan asks for" in line
    assert "model.dim is 32 in its config.yaml, the plan asks 64" in line and "optim.lr" in line
    assert "use another root=..., or remove that run dir" in line
    assert "done, skipped" not in p.stdout
    assert _snapshot(root) == before
    table = build_plan([*sel, f"root={root}"])[0].describe()  # --plan
    assert "[differs] train:pretrain/baseline/seed0" in table and "[done]" not in table


def test_a_copied_seed_dir_is_not_another_seed(copy):
    """Case 2: ``cp -a seed0 seed2``, rerun with seeds [0, 1, 2]: seed2 is not done (its
    recorded seed is 0, its run id seed0's); refused, exit 2, nothing written."""
    root, sel = copy
    shutil.copytree(root / "pretrain/baseline/seed0", root / "pretrain/baseline/seed2", symlinks=True)
    plan, _ = build_plan([*sel, f"root={root}", "pipeline.seeds=[0,1,2]"])
    assert not done(plan.job("train:pretrain/baseline/seed2"))
    before = _snapshot(root)
    p = _pipeline(*sel, f"root={root}", "pipeline.seeds=[0,1,2]")
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    line = _error_line(p)
    assert f"{root}/pretrain/baseline/seed2 holds a run that is not the one the plan asks for" in line
    assert "seed is 0 in its config.yaml, the plan asks 2" in line
    assert "(and 1 more run dir(s) alike)" in line  # the copy: seed0's run id twice
    assert _snapshot(root) == before


def test_a_label_or_a_field_added_at_its_default_keeps_a_run_done(copy):
    """What "same run" ignores: a field the record lacks whose value now is the schema
    default (added to the code since), and labels (logging.*); a field that defines the
    run does not keep it done."""
    root, sel = copy
    cfg_file = root / "pretrain/baseline/seed0/config.yaml"
    cfg = yaml.safe_load(cfg_file.read_text())
    from mta_repro.train.config import TrainConfig

    assert cfg["trainer"]["nonfinite"] == TrainConfig().trainer.nonfinite  # at its default here
    del cfg["trainer"]["nonfinite"]
    cfg["logging"]["every"] = 7
    cfg_file.write_text(yaml.safe_dump(cfg))
    plan, _ = build_plan([*sel, f"root={root}"])
    job = plan.job("train:pretrain/baseline/seed0")
    assert done(job)
    cfg["optim"]["weight_decay"] = float(cfg["optim"]["weight_decay"]) + 0.5
    cfg_file.write_text(yaml.safe_dump(cfg))
    assert not done(job) and "optim.weight_decay" in why_not_done(job)


def test_a_missing_or_null_eval_result_is_redone(copy):
    """Case 3 (done side): a deleted eval/ppl.json (what a failed eval job leaves) or a null
    average is not done; the rerun evaluates that seed again, the other is skipped."""
    root, sel = copy
    plan, _ = build_plan([*sel, f"root={root}"])
    job = plan.job("eval:pretrain/baseline/seed0")
    f = root / "pretrain/baseline/seed0/eval/ppl.json"
    whole = json.loads(f.read_text())
    f.unlink()
    assert not done(job) and why_not_done(job) == f"{f} is missing"
    null = json.loads(json.dumps(whole))
    null["results"]["average"] = None
    f.write_text(json.dumps(null))
    assert not done(job) and why_not_done(job) == f"{f} has a null average"
    other = json.loads(json.dumps(whole))  # a result of other weights than the export's
    other["provenance"]["checkpoint"]["weights_sha256"] = "0" * 64
    f.write_text(json.dumps(other))
    assert not done(job) and why_not_done(job).startswith(f"{f} is of weights 000000000000, the export holds")
    f.write_text(json.dumps(null))
    p = _pipeline(*sel, f"root={root}")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "pipeline: eval:pretrain/baseline/seed1: done, skipped" in p.stdout
    assert "pipeline: eval:pretrain/baseline/seed0: running" in p.stdout
    redone = json.loads(f.read_text())
    assert redone["results"]["average"] == pytest.approx(whole["results"]["average"])  # the same weights
    assert done(job)


def test_a_foreign_export_is_refused_everywhere(copy):
    """Case 5: seed 1's export copied into seed 0's run (mtime kept): the pipeline, eval and
    train checkpoint.init_from=<seed0> each refuse in one line naming both run ids, exit 2,
    nothing written."""
    root, sel = copy
    s0, s1 = root / "pretrain/baseline/seed0", root / "pretrain/baseline/seed1"
    ours = json.loads((s0 / "provenance.json").read_text())["run_id"]
    theirs = json.loads((s1 / "provenance.json").read_text())["run_id"]
    assert ours != theirs
    shutil.copy2(s1 / "export/consolidated.pt", s0 / "export/consolidated.pt")
    before = _snapshot(root)

    p = _pipeline(*sel, f"root={root}")
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    line = _error_line(p)
    assert f"{s0}/export/consolidated.pt carries run id {theirs}" in line and ours in line

    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    ev = subprocess.run(
        [sys.executable, "-m", "mta_repro.eval", str(s0), "tasks=[ppl]", "ppl.max_batches=1", "ppl.domains=[book]"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert ev.returncode == 2, ev.stdout[-2000:] + ev.stderr[-2000:]
    line = _error_line(ev)
    assert theirs in line and ours in line and "copied from another run" in line

    new = root.parent / "new_run"
    tr = subprocess.run(
        [sys.executable, "-m", "mta_repro.train", "experiment=debug", *MINI["train_overrides"], "trainer.steps=1"]
        + [f"run_dir={new}", f"checkpoint.init_from={s0}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert tr.returncode == 2, tr.stdout[-2000:] + tr.stderr[-2000:]
    line = _error_line(tr)
    assert theirs in line and ours in line
    assert not new.exists()
    assert _snapshot(root) == before


# ------------------------------------------------------------------ signals (case 6)
# One run that trains long enough to be signalled mid-way; checkpoints only at its end, so
# a checkpoint before it is the signal's.
LONG_STEPS = 100000
SIG = {
    "name": "sig",
    "variants": ["baseline"],
    "train_overrides": [o for o in MINI["train_overrides"] if not o.startswith(("trainer.steps", "checkpoint.every"))]
    + [f"trainer.steps={LONG_STEPS}", f"checkpoint.every={LONG_STEPS}"],
    "stages": [{"name": "pretrain", "experiment": "debug", "overrides": ["attention={variant}"]}],
    "report": False,
}


def _start(sel, root: Path, after: int = 0):
    """The pipeline in its own session (as at a terminal: a Ctrl-C goes to its process
    group), once its job has trained to step ``after`` + 3 (``after``: the step it resumes
    from); (process, run dir, the job's pid)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "mta_repro.pipeline", *sel, f"root={root}"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    run = root / "pretrain" / "baseline"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        m = run / "metrics.jsonl"
        text = m.read_text() if m.is_file() else ""
        steps = [json.loads(line).get("step", 0) for line in text.splitlines(keepends=True) if line.endswith("\n")]
        if steps and steps[-1] >= after + 3 and (run / ".lock").is_file():
            break
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        time.sleep(0.2)
    else:
        proc.kill()
        pytest.fail("the job did not train 3 steps in 240 s")
    pid = json.loads((run / ".lock").read_text())["pid"]
    return proc, run, pid


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (ended, not yet reaped by its dead parent's reaper) counts as ended
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _checkpoints(run: Path) -> list:
    return sorted(int(d.name) for d in (run / "checkpoints").glob("[0-9]*") if (d / ".complete").exists())


@pytest.mark.parametrize("sig,rc", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_to_the_pipeline_lets_the_job_checkpoint(tmp_path, sig, rc):
    """Case 6: Ctrl-C (SIGINT to the pipeline's process group) or SIGTERM to the pipeline
    alone: the job gets it once, checkpoints at the step boundary, lets go of its lock; the
    pipeline then exits 130 / 143. The run is unfinished (not done), and resumes there."""
    sel = _write_pipeline(tmp_path / "cfg", SIG)
    root = tmp_path / "runs"
    proc, run, pid = _start(sel, root)
    if sig == signal.SIGINT:
        os.killpg(proc.pid, sig)  # what the terminal does on Ctrl-C
    else:
        os.kill(proc.pid, sig)  # e.g. `kill <pipeline pid>`
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == rc, out[-3000:]
    assert f"{signal.Signals(sig).name} received, passed on to the job" in out and f"(exit {rc})" in out
    log = (run / "pipeline_train.log").read_text()
    assert f"received {signal.Signals(sig).name}: checkpoint at the next step boundary" in log
    assert log.count(f"received {signal.Signals(sig).name}") == 1  # passed on once: not a second Ctrl-C
    saved = _checkpoints(run)
    assert saved and 3 <= saved[-1] < LONG_STEPS, saved
    assert not _alive(pid) and not (run / ".lock").exists()
    plan, _ = build_plan([*sel, f"root={root}"])
    assert not done(plan.job("train:pretrain/baseline"))
    if sig == signal.SIGINT:  # the same command resumes from the signal's checkpoint
        proc, run, pid = _start(sel, root, after=saved[-1])
        os.killpg(proc.pid, sig)
        out, _ = proc.communicate(timeout=240)
        assert proc.returncode == rc, out[-3000:]
        log = (run / "pipeline_train.log").read_text()
        assert f"resumed from {run / 'checkpoints' / f'{saved[-1]:010d}'} at step {saved[-1]}" in log
        assert _checkpoints(run)[-1] > saved[-1] and not (run / ".lock").exists()


def test_a_killed_pipeline_leaves_no_orphan_holding_the_lock(tmp_path):
    """Case 6: the pipeline SIGKILLed (no handler can run): its job is told (SIGTERM on its
    parent's death), checkpoints at the step boundary and exits, releasing the lock."""
    sel = _write_pipeline(tmp_path / "cfg", SIG)
    root = tmp_path / "runs"
    proc, run, pid = _start(sel, root)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    deadline = time.monotonic() + 240
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(pid), "the job trains on after its pipeline died"
    assert not (run / ".lock").exists()
    log = (run / "pipeline_train.log").read_text()
    assert "received SIGTERM: checkpoint at the next step boundary" in log
    saved = _checkpoints(run)
    assert saved and 3 <= saved[-1] < LONG_STEPS, saved


def test_a_job_that_ends_well_but_is_not_done_names_the_cause(copy):
    """Case 5's message: a job that exits 0 without its output (an eval that wrote no
    result) is FAILED (exit 0) with what is missing, not a bare "rerun"."""
    from mta_repro.pipeline.run import run_local

    root, sel = copy
    plan, _ = build_plan([*sel, f"root={root}"])
    job = plan.job("eval:pretrain/baseline/seed0")
    f = root / "pretrain/baseline/seed0/eval/ppl.json"
    f.unlink()
    job.command = [sys.executable, "-c", "pass"]  # ends with status 0, writes nothing
    plan.jobs = [job]
    lines: list = []
    assert run_local(plan, log=lines.append) == 1
    failed = [line for line in lines if "FAILED" in line]
    assert len(failed) == 1
    assert f"pipeline: {job.id}: FAILED (exit 0)" in failed[0]
    assert f"it ended without error, but {f} is missing; rerun the same command" in failed[0]
