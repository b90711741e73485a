"""The fourth adversarial round: numbers with no bound, a full disk, a read-only
run directory, Ctrl-C in the report and a run from a wheel. Each case as a user meets it:
one line naming the field, file or limit, exit status 2, nothing written or changed."""

from __future__ import annotations

import json
import logging

import pytest
from eval_helpers import make_run
from test_trust_inputs import _one_line, _snapshot

from mta_repro.errors import UserError


# ------------------------------------------------------------------ numbers with no bound
@pytest.mark.parametrize(
    "overrides, says",
    [
        # each weight finite, their sum inf: every normalised weight would be 0 (one domain drawn)
        (["data.sources.book=1e308", "data.sources.github=1e308"], "data.sources: the weights sum to inf"),
        (["seed=100000000000000000000"], "seed=100000000000000000000: expected a seed, an integer with 0 <= seed"),
        (["seed=-1"], "seed=-1: expected a seed"),
        (["model.seed=4294967296"], "model.seed=4294967296: expected a seed"),
        (["data.seed=-3"], "data.seed=-3: expected a seed"),
        (["seed=1e20"], "seed=1e20"),  # Hydra's own line: a float is no int
        (["model.ffn_dim_multiplier=1e308"], "model.ffn_dim_multiplier=1e+308 gives an FFN hidden size of"),
        (["model.ffn_dim_multiplier=1e-9"], "model.ffn_dim_multiplier=1e-09 gives an FFN hidden size of"),
        (["model.init_base_std=inf"], "model.init_base_std: expected a finite positive number or null, got inf"),
        (["data.shuffle_buffer=1000000000"], "data.shuffle_buffer=1,000,000,000 windows of data.seq_len+1="),
        # within the token bound, but more windows than the bundled corpus holds
        (["data.shuffle_buffer=5000000"], "data.shuffle_buffer=5,000,000 windows of data.seq_len+1=129 tokens"),
    ],
)
def test_numbers_with_no_bound_are_one_line_and_write_nothing(tmp_path, capsys, overrides, says):
    from mta_repro.train.__main__ import cli

    run_dir = tmp_path / "run"
    argv = ["experiment=debug", f"run_dir={run_dir}", "trainer.steps=1", "logging.wandb_mode=disabled"]
    try:  # a refusal inside Hydra's job exits with the status (Hydra passes SystemExit on)
        rc = cli(argv + overrides)
    except SystemExit as e:
        rc = e.code
    assert rc == 2
    _one_line(capsys.readouterr().err, "train: error:", says)
    assert not run_dir.exists()


def test_the_shuffle_buffers_corpus_bound_names_the_largest_that_fits(tmp_path):
    """The line says how many windows the rank's share holds (counted here apart: bytes
    plus BOS and EOS per document) and the largest buffer it takes (a fill of at most
    MAX_FILL_CYCLES times the corpus); that many is accepted, one more refused."""
    from test_data import BYTES, domains_corpus

    from mta_repro.data.args import DataArgs
    from mta_repro.data.loader import MAX_FILL_CYCLES, build_train_loader

    docs = domains_corpus(tmp_path, {"a": (2, 40)})
    held = sum(len(d.encode()) + 2 for d in docs)
    most = MAX_FILL_CYCLES * held // 17  # windows of data.seq_len + 1 = 17 tokens
    base = dict(root_dir=str(tmp_path), layout="domains", sources={"a": 1}, tokenizer=BYTES, seq_len=16, batch_size=1)
    with pytest.raises(UserError, match=rf"holds {held:,} tokens .* {held // 17:,} windows; .* <= {most:,}$"):
        build_train_loader(DataArgs(shuffle_buffer=most + 1, **base), 0, 1)
    assert next(build_train_loader(DataArgs(shuffle_buffer=most, **base), 0, 1))["input"].shape == (1, 16)


def test_the_pipeline_plan_refuses_a_seed_training_would(tmp_path):
    from mta_repro.pipeline.__main__ import build_plan

    with pytest.raises(UserError, match=r"pipeline\.seeds: 4294967296 is not a seed; expected integers 0 <= seed"):
        build_plan(["pipeline=tiny", f"root={tmp_path}", "+pipeline.seeds=[0,4294967296]"])
    # a seed in the pipeline's own overrides: refused by the plan, before any job
    with pytest.raises(UserError, match=r"seed=-1: expected a seed"):
        build_plan(["pipeline=tiny", f"root={tmp_path}", "pipeline.train_overrides=['seed=-1']"])
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    "override, says",
    [
        ("needle.samples=0", "eval.needle.samples=0: expected a positive integer"),
        ("ppl.max_batches=0", "eval.ppl.max_batches=0: expected a positive integer or null (no limit)"),
        ("ppl.max_batches=-1", "eval.ppl.max_batches=-1: expected a positive integer or null (no limit)"),
        ("babilong.samples=-2", "eval.babilong.samples=-2: expected a positive integer"),
        ("needle.seed=-1", "eval.needle.seed=-1: expected a seed"),
    ],
)
def test_eval_counts_below_one_are_one_line_before_the_model_loads(tmp_path, capsys, override, says):
    """``needle.samples=0`` divided by zero at the end; ``ppl.max_batches=0`` or ``-1``
    scored one batch in silence. Refused (null means every window), nothing written."""
    from mta_repro.eval.run import main

    run = tmp_path / "run"
    make_run(run)
    before = _snapshot(run)
    assert main([str(run), "tasks=[ppl,needle,babilong]", override]) == 2
    _one_line(capsys.readouterr().err, "eval: error:", says)
    assert _snapshot(run) == before and not (run / "eval").exists()


# ------------------------------------------------------------------ a run from a wheel, every rank's root
def test_a_run_from_a_wheel_says_commit_unknown_and_counts_as_other_code(tmp_path):
    """A wheel records commit null: the report says so in words, and the row is marked
    not comparable beside rows of a known commit (a code difference it cannot rule out)."""
    from test_trust_records import _eval_json

    from mta_repro.report.__main__ import build_report

    runs = [make_run(tmp_path / n, attention="baseline")[0] for n in ("a", "b", "c")]
    _eval_json(runs[0], "11" * 32)
    _eval_json(runs[1], "11" * 32)
    _eval_json(runs[2], "11" * 32, code={"package": "0.1.0", "commit": None, "dirty": None, "source": "wheel"})
    out = tmp_path / "rep"
    build_report(runs, out, kernels=False)
    table = json.loads((out / "results.json").read_text())["tables"]["ppl"]
    assert [r["run"] for r in table["rows"]] == ["a", "b", "c (!)"]
    wheel = table["provenance"]["c (!)"]
    assert wheel["code"] == "0.1.0 commit unknown (installed from a wheel)"
    assert wheel["comparable"] == ("no: code 0.1.0 commit unknown (installed from a wheel), most rows 0.1.0 fffffffff")
    assert table["provenance"]["a"]["comparable"] == "yes"


def test_the_record_names_every_ranks_data_root(tmp_path):
    """Ranks whose files have the same names and sizes are accepted; the record names where
    each of them read, not only rank 0's root."""
    from mta_repro.runs import provenance
    from mta_repro.train.config import compose, to_train_config

    every = [
        {"tokenizer": {}, "data": {"root": f"/node{r}/corpus", "files": 3, "bytes": 10, "sha256": "ab"}}
        for r in range(3)
    ]
    assert provenance.data_roots(every) == ["/node0/corpus", "/node1/corpus", "/node2/corpus"]
    assert provenance.data_roots([{"tokenizer": {}}]) is None  # a loader that says nothing

    class Loader:
        def inputs(self):
            return {"root": "/node0/corpus"}

    args = to_train_config(compose(["experiment=debug", f"run_dir={tmp_path}"]))
    rec = provenance.RunRecord(args, tmp_path, Loader(), None, None, [], data_roots=provenance.data_roots(every))
    rec.begin(0, 3)
    saved = json.loads((tmp_path / provenance.RECORD).read_text())
    assert saved["starts"][0]["inputs"]["data_roots"] == ["/node0/corpus", "/node1/corpus", "/node2/corpus"]


# ------------------------------------------------------------------ the report: read-only, full, stopped
@pytest.fixture
def disk(tmp_path):
    """A real small file system (a 64 MiB tmpfs) the test may fill or remount read-only."""
    import subprocess

    from test_train_nothing_lost import _tmpfs

    mnt = tmp_path / "disk"
    mnt.mkdir()
    _tmpfs(mnt, "64m")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def _reported_run(root):
    from test_trust_records import _eval_json

    from mta_repro.report.__main__ import main as report_main

    run = make_run(root / "run", attention="baseline")[0]
    _eval_json(run, "11" * 32)
    assert report_main([str(run), "--no-kernels"]) == 0  # the default --out: <run>/report
    return run, report_main


def test_the_report_on_a_read_only_run_dir_is_one_line(disk, capsys):
    import subprocess

    run, report_main = _reported_run(disk)
    before = _snapshot(disk)
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    capsys.readouterr()
    assert report_main([str(run), "--no-kernels"]) == 2
    line = _one_line(capsys.readouterr().err, "report: error:", f"{run / 'report'} is not writable")
    assert "a read-only file system" in line and "--out" in line
    assert _snapshot(disk) == before


def test_a_full_disk_during_the_report_leaves_the_old_report_whole(disk, capsys):
    import os

    run, report_main = _reported_run(disk)
    before = _snapshot(run / "report")
    filler = disk / "filler"
    with open(filler, "wb") as f:  # every free block but a few KB: the report's files do not fit
        st = os.statvfs(disk)
        f.write(b"\0" * max(0, st.f_bavail * st.f_frsize - 8192))
    capsys.readouterr()
    assert report_main([str(run), "--no-kernels"]) == 2
    _one_line(capsys.readouterr().err, "report: error: no space left on device", "the old report there is as it was")
    assert _snapshot(run / "report") == before
    assert sorted(p.name for p in run.iterdir() if p.name.startswith(".report")) == []


def test_ctrl_c_during_the_report_leaves_the_old_report_and_no_new_file(tmp_path, capsys, monkeypatch):
    """Ctrl-C while the plots are drawn (the tables' files already written): no traceback,
    "report: interrupted" and 130; the old report's files unchanged and none added."""
    from mta_repro.report import plots

    run, report_main = _reported_run(tmp_path)
    before = _snapshot(run / "report")

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(plots, "loss_plot", interrupted)
    capsys.readouterr()
    assert report_main([str(run), "--no-kernels"]) == 130
    _one_line(capsys.readouterr().err, "report: interrupted")
    assert _snapshot(run / "report") == before
    assert not any(p.name.startswith(".report") for p in run.iterdir())


def _fill(disk):
    """Every free byte of ``disk`` taken (written until the file system says no space)."""
    with open(disk / "filler", "wb", buffering=0) as f:
        for size in (1 << 20, 4096, 1):
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError:
                pass


def test_a_full_disk_during_eval_is_one_line_and_leaves_no_partial_result(disk, capsys, monkeypatch):
    """The eval JSON is written through a temporary file: a full disk leaves none of it, and
    the command says so in one line (rc 2), not a traceback."""
    from mta_repro.eval.run import main

    run = make_run(disk / "run", attention="baseline")[0]
    _fill(disk)
    # eval's logging.basicConfig: a root handler an earlier test left on its closed stderr
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    capsys.readouterr()
    assert main([str(run), "tasks=[ppl]", "ppl.max_batches=1", "ppl.domains=[book]"]) == 2
    err = capsys.readouterr().err  # after eval's progress lines, one line for the full disk
    assert "Traceback" not in err and [ln for ln in err.splitlines() if "error" in ln] == [
        "eval: error: no space left on device; files are written whole or not at all: free space and rerun"
    ], err[-3000:]
    assert not (run / "eval").exists() or not [p for p in (run / "eval").rglob("*") if p.is_file()]


@pytest.mark.pipeline
@pytest.mark.parametrize("existing", [False, True], ids=["new-run-dir", "existing-run-dir"])
def test_a_full_disk_at_a_training_start_is_one_line_and_leaves_nothing(disk, existing):
    """The start's record of its command (``.hydra.start-<pid>/``) is the first thing a
    training start writes: on a full disk the command says so in one line (rc 2, no
    traceback), and leaves neither a 0-byte staged record nor a new run dir; an existing run
    dir keeps exactly its files."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    run = disk / "run"
    if existing:
        run.mkdir()
        (run / "notes.txt").write_text("the user's\n")
    before = _snapshot(disk)
    _fill(disk)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(root))
    p = subprocess.run(
        [sys.executable, "-m", "mta_repro.train", "experiment=debug", f"run_dir={run}", "trainer.steps=2"],
        cwd=disk.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 2, p.stderr[-3000:]
    _one_line(p.stderr, "train: error: no space left on device")
    (disk / "filler").unlink()
    assert _snapshot(disk) == before
    assert run.exists() == existing
    assert not existing or sorted(p.name for p in run.iterdir()) == ["notes.txt"]
