"""metrics.jsonl on resume (``truncate_after``): later steps and a torn last line go, every
other line stays byte for byte (a damaged one too, named on stderr), and the rewrite is
atomic: a SIGKILL at any moment leaves the old history or the new one, never a part."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mta_repro.train.args import LoggingArgs
from mta_repro.train.metrics import MetricLogger, truncate_after

ROOT = Path(__file__).resolve().parents[1]


def _rec(step: int, **more) -> bytes:
    return json.dumps({"step": step, "loss": 3.0 - step / 100, **more}).encode()


def _write(path: Path, lines: list[bytes], end: bytes = b"\n") -> bytes:
    data = b"\n".join(lines) + end
    path.write_bytes(data)
    return data


def test_a_damaged_middle_line_is_kept_and_named(tmp_path, capsys):
    p = tmp_path / "metrics.jsonl"
    lines = [_rec(1), _rec(2), b'{"step": 3, "lo', _rec(4), _rec(5), _rec(6), _rec(7)]
    _write(p, lines)
    truncate_after(p, 5)
    assert p.read_bytes() == b"\n".join(lines[:5]) + b"\n"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert str(p) in err[0] and "kept 1 damaged line" in err[0] and "(line 3)" in err[0] and "not JSON" in err[0]


def test_an_undecodable_line_is_kept_byte_for_byte(tmp_path, capsys):
    p = tmp_path / "metrics.jsonl"
    bad = b'{"step": 2, "loss": "\xff\xfe"}'
    lines = [_rec(1), bad, _rec(3), _rec(4)]
    _write(p, lines)
    truncate_after(p, 3)  # no UnicodeDecodeError
    assert p.read_bytes() == b"\n".join(lines[:3]) + b"\n"
    err = capsys.readouterr().err
    assert str(p) in err and "(line 2)" in err and "UTF-8" in err


def test_json_lines_that_are_no_records_are_kept(tmp_path, capsys):
    """Not an object (list, number, string, null), or an object without an integer step: kept
    where they are, counted as before the resume step, all named in one line."""
    p = tmp_path / "metrics.jsonl"
    odd = [b"[1, 2]", b"3", b'"text"', b"null", b'{"loss": 1.0}', b'{"step": "4"}', b'{"step": 4.0}', b'{"step": true}']
    lines = [_rec(1), *odd, _rec(2), _rec(9)]
    _write(p, lines)
    truncate_after(p, 2)  # no AttributeError
    assert p.read_bytes() == b"\n".join(lines[:-1]) + b"\n"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert str(p) in err[0] and "kept 8 damaged lines" in err[0] and "(lines 2, 3, 4, 5, 6, 7, 8, 9)" in err[0]
    assert "list, not an object" in err[0] and 'no integer "step"' in err[0]


@pytest.mark.parametrize(
    "torn", [b'{"step": 4, "lo', b'{"step": 4, "loss": 2.9', b"\x00\x00\x00\x00", b'{"step": 4, "x": "\xe2\x82']
)
def test_a_torn_final_line_is_dropped_and_named(tmp_path, capsys, torn):
    p = tmp_path / "metrics.jsonl"
    lines = [_rec(1), _rec(2), _rec(3)]
    _write(p, [*lines, torn], end=b"")
    truncate_after(p, 10)
    assert p.read_bytes() == b"\n".join(lines) + b"\n"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(p) in err[0] and "dropped its last line 4" in err[0], err


def test_later_steps_go_and_earlier_ones_stay_byte_for_byte(tmp_path, capsys):
    """Whatever the layout of a kept line (spacing, key order, escapes, raw UTF-8, a CR, a
    blank line), it is written back unchanged; a step after the resume step goes wherever
    it is in the file."""
    p = tmp_path / "metrics.jsonl"
    lines = [
        b'{"step":1,"loss":2.5}',
        b'  {"loss": 2.4, "step": 2}  ',
        b'{"step": 3, "note": "caf\\u00e9"}',
        '{"step": 4, "note": "na\u00efve \u2713"}'.encode(),
        b'{"step": 5}\r',
        b"",
        b'{"step": 6}',
        b'{"step": 7}',
        b'{"step": 2, "val_loss": 2.0}',
        b'{"step": 8, "loss": 1e400}',
    ]
    _write(p, lines)
    truncate_after(p, 5)
    keep = [line for line in lines if not line.strip() or json.loads(line)["step"] <= 5]
    assert p.read_bytes() == b"\n".join(keep) + b"\n"
    assert len(keep) == 7
    assert capsys.readouterr().err == ""  # nothing damaged, nothing torn


def test_nothing_to_drop_means_no_rewrite(tmp_path, capsys):
    p = tmp_path / "metrics.jsonl"
    data = _write(p, [_rec(1), b"garbage", _rec(2), _rec(3)], end=b"")  # complete last line, no newline
    os.utime(p, ns=(1_000_000_000, 1_000_000_000))
    before = p.stat()
    truncate_after(p, 3)
    after = p.stat()
    assert (after.st_ino, after.st_mtime_ns, after.st_size) == (before.st_ino, before.st_mtime_ns, before.st_size)
    assert p.read_bytes() == data
    assert sorted(f.name for f in tmp_path.iterdir()) == ["metrics.jsonl"]
    assert "(line 2)" in capsys.readouterr().err  # still named


def test_a_leftover_temp_file_is_overwritten(tmp_path):
    p = tmp_path / "metrics.jsonl"
    (tmp_path / "metrics.jsonl.tmp").write_bytes(b"half of an earlier rewrite" * 1000)
    lines = [_rec(1), _rec(2), _rec(3)]
    _write(p, lines)
    truncate_after(p, 2)
    assert p.read_bytes() == b"\n".join(lines[:2]) + b"\n"
    assert sorted(f.name for f in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_the_next_logged_record_starts_its_own_line(tmp_path):
    p = tmp_path / "metrics.jsonl"
    _write(p, [_rec(1), _rec(2)], end=b"")  # nothing to drop: kept without its newline
    log = MetricLogger(tmp_path, LoggingArgs(progress_bar=False, wandb_mode="disabled"), {}, True, 10, 2)
    log.log({"step": 3, "loss": 2.0})
    log.close()
    assert [json.loads(line)["step"] for line in p.read_bytes().splitlines()] == [1, 2, 3]


def test_the_report_skips_the_kept_damaged_lines_and_names_them(tmp_path, capsys):
    from mta_repro.report.plots import loss_series
    from mta_repro.report.runs import load_run

    p = tmp_path / "metrics.jsonl"
    _write(p, [_rec(1), b'{"step": 2, "lo', b"\xff\xfe", b"[1, 2]", b"3", _rec(5), _rec(6)])
    truncate_after(p, 5)
    capsys.readouterr()
    with open(p, "ab") as f:
        f.write(b'{"step": 6, "lo')  # a write in progress while the report reads: skipped silently
    run = load_run(tmp_path)
    assert [m["step"] for m in run.metrics] == [1, 5]
    assert [s for s, _ in loss_series(run)["train"]] == [1, 5]
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"report: {p}: skipped 4 damaged lines (not a JSON object): 2, 3, 4, 5"]


# A fork server: imports the trainer's module once (seconds: torch), then for each command
# forks a child that runs truncate_after on the file and SIGKILLs it after a delay, or once
# the temp file has reached a size (or lets it finish).
SERVER = r"""
import json, os, signal, sys, time
from pathlib import Path
from mta_repro.train.metrics import truncate_after

path, step = Path(sys.argv[1]), int(sys.argv[2])
tmp = path.with_name(path.name + ".tmp")


def start():
    pid = os.fork()
    if pid == 0:
        try:
            truncate_after(path, step)
        except BaseException:
            import traceback
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    return pid


def reply(pid, t0=None, **out):
    _, status = os.waitpid(pid, 0)
    if t0 is not None:
        out["seconds"] = time.perf_counter() - t0
    out.update(killed=os.WIFSIGNALED(status), rc=os.WEXITSTATUS(status) if os.WIFEXITED(status) else None)
    print(json.dumps(out), flush=True)


for cmd in sys.stdin:
    what, arg = cmd.split()
    if what == "run":  # a whole run, timed
        t0 = time.perf_counter()
        reply(start(), t0)
    elif what == "after":  # kill after a delay (seconds)
        pid = start()
        time.sleep(float(arg))
        os.kill(pid, signal.SIGKILL)
        reply(pid)
    elif what == "size":  # kill once the temp file (none left from before) holds this many bytes
        tmp.unlink(missing_ok=True)
        pid = start()
        seen = 0
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            try:
                seen = tmp.stat().st_size
            except FileNotFoundError:
                continue
            if seen >= int(arg):
                break
        os.kill(pid, signal.SIGKILL)
        reply(pid, seen=seen)
"""


@pytest.mark.slow
def test_a_sigkill_during_the_rewrite_leaves_the_history_whole(tmp_path):
    """A 32 MB history truncated at half its steps, the rewriting process SIGKILLed at
    delays spread over one whole run, then at two moments of the temp file's write: each
    time the file is the old bytes or the new ones, and a leftover temp file does not
    keep the next run from finishing the job."""
    p = tmp_path / "metrics.jsonl"
    tmp = tmp_path / "metrics.jsonl.tmp"
    n, pad = 80_000, "x" * 330
    lines = [_rec(i, lr=3e-4, pad=pad) for i in range(1, n + 1)]
    original = _write(p, lines)
    expected = b"\n".join(lines[: n // 2]) + b"\n"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with open(tmp_path / "server.err", "w+") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", SERVER, str(p), str(n // 2)],
            cwd=ROOT,
            env=env,
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
        )

        def ask(cmd: str) -> dict:
            proc.stdin.write(cmd + "\n")
            proc.stdin.flush()
            line = proc.stdout.readline()
            if not line:
                err.seek(0)
                pytest.fail(f"the fork server died: {err.read()[-3000:]}")
            return json.loads(line)

        try:
            t = ask("run 0")
            assert t["rc"] == 0 and p.read_bytes() == expected and not tmp.exists(), t
            # the rewrite (temp file, fsync, rename) is the last tenth or so of a run: most delays near the end
            cmds = [f"after {f * t['seconds']:.4f}" for f in (0.0, 0.4, 0.8, 0.9, 0.95, 0.99)]
            cmds += ["size 1", f"size {len(expected)}"]
            outcomes = []
            for cmd in cmds:
                p.write_bytes(original)
                r = ask(cmd)
                assert r["rc"] in (0, None), (cmd, r)
                data = p.read_bytes()
                assert data in (original, expected), (
                    f"{cmd}: {len(data)} bytes, neither the original ({len(original)}) "
                    f"nor the truncated ({len(expected)})"
                )
                outcomes.append((cmd, "old" if data == original else "new", r["killed"], tmp.exists()))
            # the size kills land between the temp file's creation and the rename: they leave it behind
            assert any(killed and left for _, _, killed, left in outcomes), (t, outcomes)
            p.write_bytes(original)
            if not tmp.exists():  # what a kill mid-write leaves, should the last one have come late
                tmp.write_bytes(expected[:12345])
            r = ask("run 0")  # a whole run, over the temp file the last kill left
            assert not r["killed"] and r["rc"] == 0, r
            assert p.read_bytes() == expected and not tmp.exists()
        finally:
            proc.stdin.close()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


WANDB_SERVICE_KILLED = """
import os, signal, subprocess, sys, time
from pathlib import Path
from mta_repro.train.args import LoggingArgs
from mta_repro.train.metrics import MetricLogger

run = Path(sys.argv[1])
log = MetricLogger(run, LoggingArgs(progress_bar=False, wandb_mode="offline"), {}, True, 4, 0)
rec = lambda s: {"step": s, "loss": 1.0, "tokens_per_s_global": 1.0}
log.log(rec(1))
# what SLURM does after a requeue: SIGTERM to every process of the job, wandb's service too
kids = subprocess.run(["pgrep", "-P", str(os.getpid())], capture_output=True, text=True).stdout.split()
assert kids, "no wandb service process"
for pid in kids:
    os.kill(int(pid), signal.SIGTERM)
time.sleep(1)
log.log(rec(2))
log.log(rec(3))
log.close()
"""


def test_a_killed_wandb_service_leaves_the_run_logging_to_metrics_jsonl(tmp_path):
    """wandb offline (the default), its service process killed mid-run: the logger says so
    in one line and goes on; every step is in metrics.jsonl, the exit is clean (no
    traceback, not even from wandb's own exit hook)."""
    pytest.importorskip("wandb")
    run = tmp_path / "run"
    run.mkdir()
    env = dict(os.environ, PYTHONPATH=str(ROOT), WANDB_SILENT="true")
    p = subprocess.run(
        [sys.executable, "-c", WANDB_SERVICE_KILLED, str(run)], env=env, capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-3000:]
    said = [line for line in p.stderr.splitlines() if "wandb stopped logging" in line]
    assert len(said) == 1 and "metrics.jsonl keeps every number" in said[0], p.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
