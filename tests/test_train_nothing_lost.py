"""Nothing lost, nothing recorded wrong (real processes and real filesystems, no mocks):

- two starts on one fresh run dir at the same moment: the one refused by the lock
  touches nothing, the other finishes with all its files (20 races);
- a resume whose run dir lost config.yaml is checked against the config the checkpoint
  carries: a changed optim.lr is refused in one line, the same command resumes;
- a checkpoint's files and folder are fsynced before its ``.complete`` marker and the
  rename that publishes it (the syscalls, traced by strace);
- a full disk (a small tmpfs) ends the run with one line naming "no space", the path and
  the bytes, and leaves no ``.tmp-N`` behind; the previous checkpoint stays; a full disk
  at the end-of-run export likewise (no ``consolidated.pt.tmp``), and the rerun makes it;
- a ``${oc.env:...}`` that does not resolve and a non-finite loss are one line, rc 2.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml
from test_train_rundir import COMMON as RUNDIR_COMMON

from mta_repro.train.config import compose

ROOT = Path(__file__).resolve().parents[1]
# The tiny run of tests/test_train_rundir.py, its length left to each test.
COMMON = [o for o in RUNDIR_COMMON if not o.startswith("trainer.steps=")] + ["optim.warmup=1"]


def _env(**extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **extra)
    env.pop("MTA_REPRO_TRACEBACK", None)
    return env


def _cli(*args, timeout=300, **env):
    return subprocess.run(
        [sys.executable, "-m", "mta_repro.train", *COMMON, *args],
        cwd=ROOT,
        env=_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# ------------------------------------------------------------------ double starts
# Each worker is its own process (imports once, then trains on trial i's run dir as soon
# as go-<i> appears); the two workers race for every fresh run dir.
WORKER = textwrap.dedent("""
    import json, sys, time, traceback
    from pathlib import Path
    from mta_repro.train.config import compose
    from mta_repro.train.loop import train

    common, root, name, trials = json.loads(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    (root / f"ready-{name}").write_text("")
    for i in range(trials):
        while not (root / f"go-{i}").exists():
            time.sleep(0.0005)
        try:
            out = train(compose([*common, f"run_dir={root / f'run{i}'}"]))
            res = {"ok": True, "step": out["step"]}
        except BaseException as e:
            res = {"ok": False, "type": type(e).__name__, "msg": str(e), "tb": traceback.format_exc()}
        # Written aside, then renamed: the test polls for the name and must never read half a file.
        tmp = root / f".res-{i}-{name}.json"
        tmp.write_text(json.dumps(res))
        tmp.rename(root / f"res-{i}-{name}.json")
""")


def _wait(paths, timeout=120):
    deadline = time.time() + timeout
    while not all(p.exists() for p in paths):
        assert time.time() < deadline, f"waited {timeout}s for {[str(p) for p in paths if not p.exists()]}"
        time.sleep(0.01)


@pytest.mark.slow
def test_twenty_double_starts_never_delete_the_winners_files(tmp_path):
    trials, steps = 20, 2
    common = [*COMMON, f"trainer.steps={steps}", "checkpoint.every=2"]
    (tmp_path / "worker.py").write_text(WORKER)
    workers = [
        subprocess.Popen(
            [sys.executable, str(tmp_path / "worker.py"), json.dumps(common), str(tmp_path), n, str(trials)],
            cwd=ROOT,
            env=_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in ("a", "b")
    ]
    try:
        _wait([tmp_path / "ready-a", tmp_path / "ready-b"], timeout=180)
        refused = 0
        for i in range(trials):
            (tmp_path / f"go-{i}").write_text("")
            _wait([tmp_path / f"res-{i}-a.json", tmp_path / f"res-{i}-b.json"])
            res = [json.loads((tmp_path / f"res-{i}-{n}.json").read_text()) for n in "ab"]
            losers = [r for r in res if not r["ok"]]
            for r in losers:  # refused by the lock, in one line: nothing else may go wrong
                assert r["type"] == "RunDirError" and "is in use by another job" in r["msg"], r.get("tb")
                assert len(r["msg"].splitlines()) == 1
            assert len(losers) <= 1, res  # one of the two always trains
            refused += len(losers)
            run = tmp_path / f"run{i}"
            # The winner finished and every file of its run is there (and no lock is left).
            assert all(r["step"] == steps for r in res if r["ok"]), res
            rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            assert [r["step"] for r in rows] == list(range(1, steps + 1)), (i, rows)
            assert (run / "config.yaml").is_file()
            assert (run / "checkpoints" / f"{steps:010d}" / ".complete").is_file()
            assert sorted(p.name for p in run.iterdir()) == [
                "checkpoints",
                "config.yaml",
                "metrics.jsonl",
                "provenance.json",
            ]
    finally:
        for w in workers:
            w.kill()
            w.wait()
    # Both started within a millisecond of each other: most trials raced for the lock.
    assert refused >= trials // 4, f"only {refused} of {trials} starts were refused: the race was not exercised"


# ------------------------------------------------------------------ config.yaml gone
def _train(run_dir, *overrides):
    from mta_repro.train.loop import train

    return train(compose([*COMMON, f"run_dir={run_dir}", *overrides]))


@pytest.mark.slow
def test_resume_without_config_yaml_is_checked_against_the_checkpoints_config(tmp_path):
    from mta_repro.runs.runlock import RunDirError

    run = tmp_path / "run"
    _train(run, "trainer.steps=2")
    saved = yaml.safe_load((run / "checkpoints" / f"{2:010d}" / "config.yaml").read_text())
    assert saved["optim"]["lr"] == yaml.safe_load((run / "config.yaml").read_text())["optim"]["lr"]
    (run / "config.yaml").unlink()
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    with pytest.raises(RunDirError) as e:
        _train(run, "trainer.steps=2", "optim.lr=1e30")
    msg = str(e.value)
    assert len(msg.splitlines()) == 1
    assert "optim.lr" in msg and "1e+30" in msg and f"the config stored in {run / 'checkpoints' / f'{2:010d}'}" in msg
    # Nothing recorded: no config.yaml claiming lr 1e30, nothing else changed.
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before
    # The same command as the run's own resumes (and writes config.yaml again).
    out = _train(run, "trainer.steps=3", "checkpoint.allow_config_change=true")
    assert out["step"] == 3 and yaml.safe_load((run / "config.yaml").read_text())["optim"]["lr"] == saved["optim"]["lr"]


# ------------------------------------------------------------------ fsync before .complete
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("strace") is None and not os.environ.get("CI"), reason="needs strace")
def test_checkpoint_is_fsynced_before_it_is_marked_complete(tmp_path):
    run = tmp_path / "run"
    log = tmp_path / "strace.log"
    code = (
        f"from mta_repro.train.config import compose; from mta_repro.train.loop import train; "
        f"train(compose({[*COMMON, f'run_dir={run}', 'trainer.steps=1']!r}))"
    )
    p = subprocess.run(
        [
            "strace",
            "-f",
            "-y",
            "--seccomp-bpf",
            "-e",
            "trace=fsync,fdatasync,rename,renameat,renameat2",
            "-o",
            str(log),
            sys.executable,
            "-c",
            code,
        ],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    lines = log.read_text().splitlines()
    tmp = run / "checkpoints" / ".tmp-0000000001"
    final = run / "checkpoints" / "0000000001"

    def first(pattern):
        for n, line in enumerate(lines):
            if re.search(pattern, line):
                return n
        raise AssertionError(f"no syscall matching {pattern!r} in:\n" + "\n".join(lines[-40:]))

    published = first(rf"rename\w*\(.*\"{re.escape(str(tmp))}\".*\"{re.escape(str(final))}\"")
    marker = first(rf"fsync\(\d+<{re.escape(str(tmp / '.complete'))}>")
    folder = first(rf"fsync\(\d+<{re.escape(str(tmp))}>\)")
    for f in sorted(final.iterdir()):
        if f.name == ".complete":
            continue
        assert first(rf"fsync\(\d+<{re.escape(str(tmp / f.name))}>") < marker, f.name  # data before the marker
    assert marker < published and folder < published
    # The rename itself is made durable: the checkpoints folder is fsynced after it.
    assert any(
        re.search(rf"fsync\(\d+<{re.escape(str(run / 'checkpoints'))}>\)", line) for line in lines[published + 1 :]
    )


# ------------------------------------------------------------------ full disk
def _tmpfs(mnt: Path, size: str) -> None:
    p = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if p.returncode != 0:
        if os.environ.get("CI"):
            pytest.fail(f"cannot mount a tmpfs (CI runs as root): {p.stderr.strip()}")
        pytest.skip(f"cannot mount a tmpfs here: {p.stderr.strip()}")


@pytest.fixture
def small_disk(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    # 100 MB: the first checkpoint of this model (66 MB) fits, the second cannot.
    _tmpfs(mnt, "100m")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def export_disk(tmp_path):
    mnt = tmp_path / "export_disk"
    mnt.mkdir()
    # 80 MiB: the checkpoint (66.4 MB) fits, the export after it (22.0 MB) cannot.
    _tmpfs(mnt, "80m")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.slow
def test_a_full_disk_is_one_line_and_leaves_no_partial_checkpoint(small_disk):
    run = small_disk / "run"
    p = _cli(f"run_dir={run}", "trainer.steps=4")
    assert p.returncode == 2, p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("train: error: no space left on device:"), p.stderr[-3000:]
    assert str(run / "checkpoints") in last and re.search(r"needs about [\d,]+ bytes", last)
    assert re.search(r"[\d,]+ bytes free", last) and "is intact" in last
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == [f"{1:010d}"], names  # the first stays; no .tmp-N keeps the disk full


@pytest.mark.slow
def test_a_full_disk_at_the_export_is_one_line_and_a_rerun_makes_it(export_disk):
    run = export_disk / "run"
    args = (f"run_dir={run}", "trainer.steps=2", "checkpoint.every=2", "checkpoint.export=true")
    p = _cli(*args)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("train: error: no space left on device: the export "), last
    assert str(run / "export" / "consolidated.pt") in last and re.search(r"needs about [\d,]+ bytes", last)
    assert "is intact" in last and "rerun the same command" in last
    assert list((run / "export").iterdir()) == []  # no consolidated.pt.tmp keeps the disk full
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [f"{2:010d}"]
    # Space freed: the same command trains nothing and makes the export it lacked.
    subprocess.run(["mount", "-o", "remount,size=200m", str(export_disk)], check=True)
    p = _cli(*args)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "made the missing export" in p.stderr
    from mta_repro.weights import load_pt

    blob = load_pt(run / "export" / "consolidated.pt")
    assert blob["step"] == 2 and blob["provenance"]["checkpoint"] == str(run / "checkpoints" / f"{2:010d}")
    assert sorted(p.name for p in (run / "export").iterdir()) == ["consolidated.pt"]


# ------------------------------------------------------------------ one-line errors
@pytest.mark.slow
def test_an_unresolvable_env_var_is_one_line(tmp_path):
    # hydra.run.dir is ${run_dir}: Hydra resolves it before the job; a YAML's run_dir
    # interpolating an unset variable failed there with 155 lines.
    p = _cli("run_dir=${oc.env:MTA_REPRO_TEST_UNSET_VAR}/run", "trainer.steps=1", timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert p.stderr.strip().splitlines() == [
        "train: error: run_dir: cannot resolve \"Environment variable 'MTA_REPRO_TEST_UNSET_VAR' not found\""
    ]


@pytest.mark.slow
def test_a_non_finite_loss_is_one_line_naming_the_checkpoint(tmp_path):
    run = tmp_path / "run"
    p = _cli(f"run_dir={run}", "trainer.steps=4", "optim.lr=1e30", "optim.warmup=0")
    assert p.returncode == 2 and "Traceback" not in p.stderr and "HYDRA_FULL_ERROR" not in p.stderr, p.stderr[-3000:]
    last = p.stderr.strip().splitlines()[-1]
    assert re.match(
        r"train: error: non-finite loss \S+ \(grad norm \S+\) at step \d; the last good checkpoint is ", last
    ), p.stderr[-3000:]
    assert str(run / "checkpoints") in last
