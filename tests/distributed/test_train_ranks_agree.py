"""Two real gloo ranks that do not read the same inputs, or where one fails at a resume.

Each rank is started by hand (RANK, WORLD_SIZE, MASTER_PORT) in its own working directory,
so that the same relative ``data.tokenizer.path`` names another file on each, as the same
path does on two nodes; each rank's exit status and stderr are then its own. A rank that
reads another tokenizer than rank 0 is refused on both, naming the rank and both sha256,
at a fresh start and at a resume; a rank that fails while the others resume makes them
report that rank, and no checkpoint is called damaged or renamed.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_config import tiny_model_overrides, tiny_train

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
TOKENIZER = ROOT / "data" / "tokenizer" / "mini_sp8192.model"
COMMON = [
    *tiny_train(
        "data.tokenizer.path=tok.model",  # relative: each rank's working directory has its own
        "trainer.loader=crash_loader:build",
        "checkpoint.every=2",
        "optim.warmup=1",
        omit=("data.shuffle_buffer",),
    ),
    # the smallest model of the tokenizer's 8192 ids: the starts are what is tested
    *tiny_model_overrides(n_layers=1, n_heads=2, multiple_of=16),
]

# batch_source's loader; on REFUSE_RANK it refuses to open (as a loader does whose shard
# is missing there); CRASH_RANK's process dies (as if OOM-killed) while its loader state
# is restored, i.e. inside the checkpoint load the other rank takes part in.
CRASH_LOADER = """
import os

from batch_source import build as _build
from mta_repro.errors import UserError


def build(data_args, rank, world_size):
    if os.environ.get("REFUSE_RANK") == str(rank):
        raise UserError(f"data.root: shard 7 of rank {rank} is missing")
    src = _build(data_args, rank, world_size)
    if os.environ.get("CRASH_RANK") == str(rank):
        def load_state_dict(sd):
            os._exit(9)
        src.load_state_dict = load_state_dict
    return src
"""


def _other_tokenizer(out: Path) -> Path:
    """The bundled 8192-piece model with two pieces swapped: the same vocabulary size,
    another tokenizer (tests/test_provenance.py makes it the same way)."""
    from sentencepiece import sentencepiece_model_pb2

    m = sentencepiece_model_pb2.ModelProto()
    m.ParseFromString(TOKENIZER.read_bytes())
    m.pieces[300].piece, m.pieces[301].piece = m.pieces[301].piece, m.pieces[300].piece
    out.write_bytes(m.SerializeToString())
    return out


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _setup(tmp_path: Path) -> list[Path]:
    (tmp_path / "crash_loader.py").write_text(CRASH_LOADER)
    dirs = [tmp_path / f"rank{r}" for r in (0, 1)]
    for d in dirs:
        d.mkdir()
        shutil.copy(TOKENIZER, d / "tok.model")
    return dirs


def _two_ranks(tmp_path: Path, run_dir: Path, *args: str, **env1: str) -> list[tuple[int, str]]:
    """Both ranks of one training command: [(exit status, stderr)] of rank 0 and rank 1
    (``env1``: extra environment of rank 1)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for r in (0, 1):
        env = dict(os.environ, OMP_NUM_THREADS="1", RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2")
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **(env1 if r == 1 else {}))
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(HERE), str(tmp_path)])
        env.pop("MTA_REPRO_TRACEBACK", None)
        cmd = [sys.executable, "-m", "mta_repro.train", f"run_dir={run_dir}", *COMMON, *args]
        procs.append(
            subprocess.Popen(
                cmd, cwd=tmp_path / f"rank{r}", env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    out = []
    for p in procs:
        _, err = p.communicate(timeout=180)
        out.append((p.returncode, err))
    return out


def _last(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines and "Traceback" not in err, err[-3000:]
    return lines[-1]


def _tree(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_rank_reading_another_tokenizer_is_refused_at_the_start(tmp_path):
    """Same vocabulary size, other pieces: it trained on (rc 0, another loss at step 10)."""
    dirs = _setup(tmp_path)
    ours, other = _sha(dirs[0] / "tok.model"), _sha(_other_tokenizer(dirs[1] / "tok.model"))
    run = tmp_path / "run"
    for rc, err in _two_ranks(tmp_path, run, "trainer.steps=2"):
        assert rc == 2, err[-3000:]
        line = _last(err)
        assert line.startswith("train: error: rank 1 reads another tokenizer than rank 0: "), line
        assert f"sha256 {other[:12]} on rank 1 and {ours[:12]} on rank 0" in line, line
    assert not run.exists()  # a fresh start refused leaves no run directory


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-rank run of 2 steps with one tokenizer on both ranks (checkpoint 2), which the
    tests below try to resume; each leaves it as it found it (what they assert)."""
    tmp_path = tmp_path_factory.mktemp("trained")
    _setup(tmp_path)
    assert [rc for rc, _ in _two_ranks(tmp_path, tmp_path / "run", "trainer.steps=2")] == [0, 0]
    yield tmp_path
    shutil.copy(TOKENIZER, tmp_path / "rank1" / "tok.model")


def test_a_rank_reading_another_tokenizer_is_refused_at_a_resume(trained):
    """Both ranks trained with one tokenizer; then rank 1's copy changes (a node's disk)."""
    tmp_path, run = trained, trained / "run"
    dirs = [tmp_path / "rank0", tmp_path / "rank1"]
    before = _tree(run)
    other = _sha(_other_tokenizer(dirs[1] / "tok.model"))
    for rc, err in _two_ranks(tmp_path, run, "trainer.steps=4", "checkpoint.allow_config_change=true"):
        assert rc == 2, err[-3000:]
        assert "rank 1 reads another tokenizer than rank 0: " in _last(err) and other[:12] in _last(err)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [f"{2:010d}"]
    assert {k: v for k, v in _tree(run).items() if k.startswith("checkpoints")} == {
        k: v for k, v in before.items() if k.startswith("checkpoints")
    }


def test_a_rank_that_fails_during_a_resume_is_a_peer_failure_not_a_damaged_checkpoint(trained):
    tmp_path, run = trained, trained / "run"
    dirs = [tmp_path / "rank0", tmp_path / "rank1"]
    ckpt = run / "checkpoints" / f"{2:010d}"
    before = _tree(ckpt)
    resume = ("trainer.steps=4", "checkpoint.allow_config_change=true")

    # Rank 1's tokenizer truncated (the fault seen): named before any checkpoint is opened.
    (dirs[1] / "tok.model").write_bytes(TOKENIZER.read_bytes()[:1000])
    (rc0, err0), (rc1, err1) = _two_ranks(tmp_path, run, *resume)
    assert rc0 == 2 and rc1 == 2, err0[-3000:]
    assert _last(err0).startswith("train: error: rank 1 reads another tokenizer than rank 0"), err0[-3000:]

    # Rank 1 dies inside the checkpoint load the ranks run together.
    shutil.copy(TOKENIZER, dirs[1] / "tok.model")
    (rc0, err0), (rc1, _) = _two_ranks(tmp_path, run, *resume, CRASH_RANK="1")
    assert rc1 == 9
    assert rc0 == 2, err0[-3000:]
    line = _last(err0)
    assert "another rank stopped while loading checkpoint" in line and str(ckpt) in line, line
    for claim in ("unreadable", "corrupt", "damaged", "falling back"):
        assert claim not in err0, err0[-3000:]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [ckpt.name]  # no corrupt-0000000002
    assert _tree(ckpt) == before


def test_a_rank_that_cannot_open_its_data_at_a_resume_is_named_by_the_others(trained):
    """The other rank stops before it opens any checkpoint (the load it would wait in with
    a dead peer was read as damage), naming the rank and its error."""
    run = trained / "run"
    before = _tree(run / "checkpoints")
    (rc0, err0), (rc1, err1) = _two_ranks(
        trained, run, "trainer.steps=4", "checkpoint.allow_config_change=true", REFUSE_RANK="1"
    )
    assert rc1 == 2 and _last(err1) == "train: error: data.root: shard 7 of rank 1 is missing", err1[-3000:]
    assert rc0 == 2, err0[-3000:]
    assert _last(err0).startswith(
        "train: error: rank 1 failed while opening its data (UserError: data.root: shard 7 of rank 1 "
    ), err0[-3000:]
    assert "unreadable" not in err0 and "corrupt" not in err0
    assert _tree(run / "checkpoints") == before
