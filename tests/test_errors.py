"""User errors are one line and exit 2; every other exception keeps its traceback.

- ``run_cli``: a UserError (and a Hydra/OmegaConf config error) is one line and 2; a
  bug-shaped ValueError propagates with its traceback; MTA_REPRO_TRACEBACK=1 shows the
  traceback of a user error too;
- the training CLI: an unknown key with or without ``+``, an unknown experiment, a bad
  value: one line, exit 2; a ValueError raised by a plugged-in loader (a fault, not the
  user's input) prints its traceback;
- the raise sites of the package raise UserError, the configs' resolvers are registered in
  one place.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mta_repro.cli import describe, run_cli, unknown_option_line
from mta_repro.errors import TRACEBACK_ENV, UserError

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ run_cli
def test_user_error_is_one_line_and_exit_2(capsys, monkeypatch):
    monkeypatch.delenv(TRACEBACK_ENV, raising=False)

    def bad():
        raise UserError("trainer.steps: expected >= 1, got 0")

    assert run_cli("train", bad) == 2
    assert capsys.readouterr().err == "train: error: trainer.steps: expected >= 1, got 0\n"


def test_bug_shaped_value_error_keeps_its_traceback(monkeypatch):
    monkeypatch.delenv(TRACEBACK_ENV, raising=False)

    def bug():
        return int("not a number")  # a ValueError from a fault in the code, not the user's input

    with pytest.raises(ValueError, match="invalid literal"):
        run_cli("train", bug)
    with pytest.raises(FileNotFoundError):
        run_cli("train", lambda: open("/nonexistent/mta_repro_internal.json"))  # noqa: SIM115 - it raises


def test_traceback_switch_shows_user_errors_too(monkeypatch):
    monkeypatch.setenv(TRACEBACK_ENV, "1")
    with pytest.raises(UserError):
        run_cli("train", lambda: (_ for _ in ()).throw(UserError("x")))


def test_user_error_is_a_value_error():
    # Code and tests that catch ValueError around validation keep working.
    assert issubclass(UserError, ValueError)
    from mta_repro.errors import CorruptFileError
    from mta_repro.runs.runlock import RunDirError
    from mta_repro.train.checkpoint import CheckpointCorruptError

    for cls in (RunDirError, CheckpointCorruptError, CorruptFileError):
        assert issubclass(cls, UserError)


def test_config_validators_raise_user_error():
    from mta_repro.train.config import compose, to_train_config

    for override in (
        "trainer.steps=0",
        "checkpoint.keep=0",
        "model.n_layers=0",
        "optim.lr=-1",
        "model.mta.mta_layers=abc",
        "model.kernels.kq_conv=cudnn",
        "+model.kernels.impl_options.blocked.frame=16x16",
    ):
        with pytest.raises(UserError):
            to_train_config(compose([override]))


def test_unknown_option_line_names_the_nearest_public_options():
    options = ["_pretrain", "_long_context", "debug", "pretrain_880m_mta", "pretrain_880m_baseline"]
    line = unknown_option_line("experiment", "debug_typo", options)
    assert line.startswith("experiment=debug_typo: unknown experiment config; did you mean debug?")
    assert "_pretrain" not in line and "\n" not in line


def test_unknown_experiment_lists_the_choices_and_names_containing_the_value():
    """With no close spelling, names that contain the value are suggested, and the real
    folder's options (more than 8, at most 40) are all listed, the private parts not."""
    from mta_repro.train.config import CONFIG_DIR

    options = sorted(p.stem for p in (CONFIG_DIR / "experiment").glob("*.yaml"))
    line = unknown_option_line("experiment", "880m_mta", options)
    head = line.split("?")[0]
    assert head.startswith("experiment=880m_mta: unknown experiment config; did you mean ")
    assert "pretrain_880m_mta" in head and "long_context_880m_mta" in head
    line = unknown_option_line("experiment", "300m", options)  # no close spelling: the names containing it
    assert "did you mean pretrain_300m_baseline or pretrain_300m_diff or pretrain_300m_mta?" in line
    public = [o for o in options if not o.startswith("_")]
    assert 8 < len(public) <= 40
    assert line.endswith(f"({len(public)} options in configs/experiment/: {', '.join(public)})")


def test_hydra_unknown_key_is_described_with_the_nearest_field():
    from mta_repro.train.config import compose

    with pytest.raises(Exception) as e:
        compose(["trainer.step=5"])
    assert describe(e.value) == (
        "unknown config key(s) trainer.step (did you mean trainer.steps?): no such field in the schema (TrainerArgs)"
    )


def test_a_mistyped_key_is_matched_to_the_field_it_abbreviates_or_spells_out():
    from mta_repro.dataclass_config import nearest_field

    optim = ["lr", "beta1", "beta2", "eps", "weight_decay", "clip", "warmup", "warmup_frac", "lr_min_ratio"]
    assert nearest_field("learning_rate", optim) == "lr"  # its words' initials
    assert nearest_field("wd", optim) == "weight_decay"
    assert nearest_field("warm", optim) == "warmup"  # cut short
    assert nearest_field("lr_min", optim) == "lr_min_ratio"
    assert nearest_field("weight_decy", optim) == "weight_decay"  # spelling
    assert nearest_field("eval_every_steps", ["steps", "eval_every", "eval_max_batches"]) == "eval_every"
    assert nearest_field("zzz", optim) is None


# ------------------------------------------------------------------ the package's raise sites
# Internal argument checks (a caller's bug, never the user's input) stay ValueError.
INTERNAL_VALUE_ERRORS = {
    "mta_repro/model/flops.py": 1,
    "mta_repro/experimental/fused_triton/tiles.py": 1,  # an unknown pass name of a layer's design
    # called by attn_impl=triton's dispatch only for what it supports (stored: a kq-conv layer,
    # no dropout; fused: any other layer)
    "mta_repro/experimental/fused_triton/stored.py": 2,
    "mta_repro/experimental/fused_triton/fused.py": 1,
    # the compiled IR has a shape its parser does not know
    "mta_repro/experimental/fused_triton/roofline.py": 1,
    # the interval formulas called with too few values or a probability outside (0, 1):
    # the report calls them only with what it checked
    "mta_repro/report/stats.py": 3,
}


def test_user_facing_raises_are_user_errors():
    """Every ``raise ValueError(`` in the package is one of the listed internal checks: a new
    user-facing check raises UserError (else the CLIs would print its traceback)."""
    found = {}
    for p in sorted((ROOT / "mta_repro").rglob("*.py")):
        n = len(re.findall(r"raise ValueError\(", p.read_text()))
        if n:
            found[str(p.relative_to(ROOT))] = n
    assert found == {
        k: n for k, n in INTERNAL_VALUE_ERRORS.items() if (ROOT / k).is_file()
    }  # (a tree may lack experiments)


def test_resolvers_are_registered_in_one_place():
    from omegaconf import OmegaConf

    import mta_repro.train.config  # noqa: F401 - registers them
    from mta_repro.resolvers import RESOLVERS

    sites = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "mta_repro").rglob("*.py")
        if "register_new_resolver(" in p.read_text()
    ]
    assert sites == ["mta_repro/resolvers.py"]
    used = set()
    for p in list((ROOT / "configs").rglob("*.yaml")) + [ROOT / "mta_repro" / "release" / "config.py"]:
        # ``\${VAR:-default}`` is an escaped shell expansion (sbatch setup lines), not a resolver.
        used |= set(re.findall(r"(?<!\\)\$\{(\w+):", p.read_text()))
    used -= {"now", "oc", "hydra"}  # Hydra's own
    assert used <= set(RESOLVERS) and all(OmegaConf.has_resolver(n) for n in RESOLVERS)


# ------------------------------------------------------------------ the training CLI
def _train_cli(*args, extra_path=()):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), *map(str, extra_path)]))
    env.pop(TRACEBACK_ENV, None)
    return subprocess.run(
        [sys.executable, "-m", "mta_repro.train", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "override, expected",
    [
        ("trainer.step=5", "unknown config key(s) trainer.step (did you mean trainer.steps?)"),
        ("+trainer.step=5", "unknown config key(s) trainer.step (did you mean trainer.steps?)"),
        ("model.n_layer=2", "unknown config key(s) model.n_layer (did you mean model.n_layers?)"),
        ("experiment=debug_typo", "experiment=debug_typo: unknown experiment config; did you mean debug?"),
        ("trainer.steps=0", "trainer.steps: expected >= 1, got 0"),
        ("model.kernels.kq_conv=cudnn", "model.kernels.kq_conv: 'cudnn': expected auto, c, triton or conv2d"),
        # a key the field abbreviates: not the nearest spelling (lr_min_ratio)
        ("optim.learning_rate=1e-3", "unknown config key(s) optim.learning_rate (did you mean optim.lr?)"),
    ],
)
def test_train_cli_user_errors_are_one_line(tmp_path, override, expected):
    run_dir = tmp_path / "run"
    p = _train_cli("experiment=debug", f"run_dir={run_dir}", override)
    assert p.returncode == 2, p.stderr[-3000:]
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"train: error: {expected}"), p.stderr[-3000:]
    assert not run_dir.exists()  # a refused start leaves nothing behind


@pytest.mark.slow
def test_train_cli_fault_in_a_loader_keeps_its_traceback(tmp_path):
    (tmp_path / "faulty_loader.py").write_text(
        "def build(data_args, rank, world_size):\n"
        "    return iter([]) if int('x') else None  # a bug: ValueError from int()\n"
    )
    p = _train_cli(
        "experiment=debug",
        f"run_dir={tmp_path / 'run'}",
        "trainer.loader=faulty_loader:build",
        "trainer.device=cpu",
        "logging.wandb_mode=disabled",
        "logging.progress_bar=false",
        extra_path=[tmp_path],
    )
    assert p.returncode not in (0, 2)
    assert "Traceback" in p.stderr and "faulty_loader.py" in p.stderr and "invalid literal" in p.stderr


@pytest.mark.slow
def test_a_sequence_longer_than_the_model_is_refused_on_every_path(tmp_path):
    """data.seq_len above model.max_seqlen: training, a finetune (its source named) and the
    evaluation of a run whose config says it trained that long: one line, exit 2, nothing run."""
    long = (
        "data.seq_len=8192 is longer than model.max_seqlen=4096, the longest sequence the model is meant for; "
        "lower data.seq_len, or set model.max_seqlen=8192 for a model meant for 8192-token sequences"
    )
    p = _train_cli("experiment=debug", f"run_dir={tmp_path}/a", "data.seq_len=8192")
    assert p.returncode == 2 and p.stderr.strip() == f"train: error: {long}", p.stderr[-3000:]
    src = tmp_path / "src.pt"
    src.write_bytes(b"")
    p = _train_cli(
        "experiment=long_context_880m_mta", f"checkpoint.init_from={src}", f"run_dir={tmp_path}/b", "data.seq_len=8192"
    )
    assert p.returncode == 2 and p.stderr.strip() == f"train: error: {long}", p.stderr[-3000:]
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    from eval_helpers import make_run

    run_dir, model = make_run(tmp_path / "old", attention="baseline", seq_len=8192)  # saved before the check
    assert model.args.max_seqlen == 4096
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop(TRACEBACK_ENV, None)
    p = subprocess.run(
        [sys.executable, "-m", "mta_repro.eval", str(run_dir), "tasks=[ppl]", "device=cpu"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 2, p.stderr[-3000:]
    assert p.stderr.strip().splitlines()[-1] == (
        f"eval: error: eval: ppl.seq_len=8192 for task 'ppl' is longer than model.max_seqlen=4096 of {run_dir}, the "
        "longest sequence the model is meant for; set extrapolate=true to evaluate beyond it on purpose"
    )
    assert not (run_dir / "eval").exists()


def test_a_tool_started_with_sigint_ignored_still_stops_on_ctrl_c():
    """A command a shell started in the background inherits SIGINT ignored; a tool run
    through run_cli takes it back, so Ctrl-C ends it as `<prog>: interrupted`, 130."""
    import signal
    import time

    code = (
        "import signal, sys, time\n"
        "from mta_repro.cli import run_cli\n"
        "assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN\n"
        "def go():\n"
        "    print('working', flush=True)\n"
        "    time.sleep(60)\n"
        "    return 0\n"
        "sys.exit(run_cli('tool', go))\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1])),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "working"
    t0 = time.time()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and err.strip() == "tool: interrupted", err
    assert time.time() - t0 < 10
