"""The attention self-check before training (mta_repro/model/selfcheck.py), forced on the
CPU with implementations that are deliberately wrong: a 1% error and a NaN output each fall
back along the chain with one line, the trainer runs (and records) the fallback and trains
exactly as if it had been asked for, strict refuses with rc 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from mta_repro.errors import UserError
from mta_repro.model import attention_ops, selfcheck, to_model_args
from mta_repro.train.config import compose

ROOT = Path(__file__).resolve().parents[1]
MTA = ["attention=mta", "model=tiny"]

WRONG = textwrap.dedent("""
    import torch
    from mta_repro.model import attention_ops

    def scaled(q, k, v, p, mask, training=False):  # 1% off: far above fp32's error
        return attention_ops.explicit_attention_blocked(q, k, v, p, mask, training) * 1.01

    def nan(q, k, v, p, mask, training=False):
        out = attention_ops.explicit_attention_blocked(q, k, v, p, mask, training)
        return out + float("nan") * out[..., :1, :].detach()

    attention_ops.register_attn_impl("wrong_scale", attention_ops.AttnImpl(scaled, fallback="blocked"))
    attention_ops.register_attn_impl("wrong_nan", attention_ops.AttnImpl(nan, fallback="wrong_scale"))
""")


@pytest.fixture
def wrong(tmp_path, monkeypatch):
    (tmp_path / "wrong_impls.py").write_text(WRONG)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    import wrong_impls

    importlib.reload(wrong_impls)
    yield tmp_path
    for name in ("wrong_scale", "wrong_nan"):
        attention_ops.ATTN_IMPLS.pop(name, None)
    selfcheck._cache.clear()
    sys.modules.pop("wrong_impls", None)


def _args(*overrides):
    return to_model_args(compose([*MTA, *overrides]).model)


def test_the_chain_follows_the_registry_entries():
    """Each step is the registry entry's ``fallback``: the built-in chain, the documented one, and
    a registered implementation's own, which joins it where its fallback points."""
    assert attention_ops.fallback_chain("blocked") == ["blocked", "blocked+conv2d", "torch"]
    assert [selfcheck.next_impl(n) for n in ("blocked", "blocked+conv2d", "torch")] == ["blocked+conv2d", "torch", None]
    assert attention_ops.attn_impl("blocked+conv2d").fn is attention_ops.explicit_attention_blocked_conv2d
    args = _args("model.kernels.kq_tile=32x32")
    conv = selfcheck.applied(args, "blocked+conv2d")  # a config of its own, the tuning kept
    assert conv.attn_impl == "blocked+conv2d" and conv.kernels == args.kernels
    from mta_repro.model.flops import forward_flops_per_token

    # the same engine: MFU after the fallback counts what blocked counts (causal skipping, recompute)
    assert forward_flops_per_token(conv, 2048) == forward_flops_per_token(args, 2048)
    assert forward_flops_per_token(selfcheck.applied(args, "torch"), 2048) != forward_flops_per_token(args, 2048)
    assert selfcheck.applied(args, "torch").kernels == args.kernels


def test_a_registered_chain_and_a_circle(wrong, monkeypatch):
    assert attention_ops.fallback_chain("wrong_nan") == [
        "wrong_nan",
        "wrong_scale",
        "blocked",
        "blocked+conv2d",
        "torch",
    ]
    monkeypatch.setitem(
        attention_ops.ATTN_IMPLS,
        "loop",
        attention_ops.AttnImpl(attention_ops.explicit_attention_torch, fallback="loop"),
    )
    with pytest.raises(UserError, match=r"^model.attn_impl='loop': its fallbacks go round in a circle: loop -> loop$"):
        attention_ops.fallback_chain("loop")


@pytest.fixture
def wrong_c_kernel(monkeypatch):
    """The CPU C kernel 1% off: ``blocked`` fails on the CPU, ``blocked+conv2d`` (F.conv2d) passes."""
    from mta_repro.kernels import kq_conv_cpu

    if not kq_conv_cpu.available(torch.zeros(1)):
        pytest.skip("the C kernel did not build here")
    right = kq_conv_cpu.kq_conv
    monkeypatch.setattr(kq_conv_cpu, "kq_conv", lambda *a: right(*a) * 1.01)
    yield
    selfcheck._cache.clear()


def test_a_wrong_c_kernel_falls_back_to_conv2d_as_a_config(wrong_c_kernel, tmp_path, capsys):
    """blocked -> blocked+conv2d: the trainer builds its model with that implementation (recorded
    in attn_selfcheck.json), no environment variable is set, and the losses are a run's that
    asked for model.kernels.kq_conv=conv2d."""
    from mta_repro.train.loop import train

    run = tmp_path / "run"
    train(compose([*COMMON, f"run_dir={run}", "model.attn_impl=blocked", "model.attn_selfcheck_cpu=true"]))
    assert "model.attn_impl=blocked failed on cpu in float32" in capsys.readouterr().err
    rec = json.loads((run / "attn_selfcheck.json").read_text())
    assert rec[0]["requested"] == "blocked" and rec[0]["used"] == "blocked+conv2d"
    rows = _metrics(run)
    assert [r["attn_impl"] for r in rows] == ["blocked+conv2d"] * 2
    ref = tmp_path / "ref"
    train(compose([*COMMON, f"run_dir={ref}", "model.attn_impl=blocked", "model.kernels.kq_conv=conv2d"]))
    assert [r["loss"] for r in rows] == [r["loss"] for r in _metrics(ref)]


@pytest.mark.slow
def test_a_wrong_and_a_nan_implementation_fall_back_with_one_line_each(wrong):
    lines: list[str] = []
    d = selfcheck.decide(_args("model.attn_impl=wrong_nan"), torch.device("cpu"), torch.float32, log=lines.append)
    assert d.requested == "wrong_nan" and d.used == "blocked"  # wrong_nan -> wrong_scale -> blocked
    assert len(lines) == 2 and all("\n" not in line for line in lines)
    assert "model.attn_impl=wrong_nan failed on cpu in float32" in lines[0] and "NaN" in lines[0]
    assert lines[0].endswith("falling back to wrong_scale")
    assert "model.attn_impl=wrong_scale failed" in lines[1] and lines[1].endswith("falling back to blocked")
    by = {(c.impl, c.layer): c for c in d.checks}
    assert set(by) == {(i, k) for i in ("wrong_nan", "wrong_scale", "blocked") for k in ("kq_conv", "mixing")}
    # The 1% scaling is measured as what it is: relative output error 0.01 (plain formula:
    # |1.01 y - y| / |y| = 0.01 at the largest entry), within float32 rounding.
    for kind in ("kq_conv", "mixing"):
        c = by[("wrong_scale", kind)]
        assert not c.ok and c.out_err == pytest.approx(0.01, rel=1e-3)
        assert by[("blocked", kind)].ok and by[("blocked", kind)].out_err < 1e-5
        assert not by[("wrong_nan", kind)].ok


@pytest.mark.slow
def test_strict_refuses_naming_the_implementation(wrong):
    with pytest.raises(
        selfcheck.SelfCheckError,
        match=r"model.attn_impl=wrong_scale is wrong on cpu in float32 "
        r"\(.*output error 1\.0e-02.*model.attn_selfcheck=strict refuses.*fall back to blocked",
    ):
        selfcheck.decide(_args("model.attn_impl=wrong_scale"), torch.device("cpu"), torch.float32, strict=True)


COMMON = [
    "data.seq_len=32",
    "data.batch_size=2",
    "data.shuffle_buffer=4",
    "trainer.steps=2",
    "trainer.device=cpu",
    "trainer.eval_every=0",
    "checkpoint.every=2",
    "checkpoint.export=false",
    "logging.every=1",
    "logging.wandb_mode=disabled",
    "logging.progress_bar=false",
    *MTA,
]


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_the_trainer_runs_and_records_the_fallback(wrong, tmp_path, capsys):
    from mta_repro.train.loop import train

    run = tmp_path / "run"
    train(compose([*COMMON, f"run_dir={run}", "model.attn_impl=wrong_scale", "model.attn_selfcheck_cpu=true"]))
    err = capsys.readouterr().err
    assert "[mta_repro.train] attention self-check: model.attn_impl=wrong_scale failed on cpu in float32" in err
    rec = json.loads((run / "attn_selfcheck.json").read_text())
    assert len(rec) == 1 and rec[0]["requested"] == "wrong_scale" and rec[0]["used"] == "blocked"
    rows = _metrics(run)
    assert [r["attn_impl"] for r in rows] == ["blocked", "blocked"]
    # What ran is blocked: the same losses as a run that asked for it.
    ref = tmp_path / "ref"
    train(compose([*COMMON, f"run_dir={ref}", "model.attn_impl=blocked"]))
    assert [r["loss"] for r in rows] == [r["loss"] for r in _metrics(ref)]
    assert not (ref / "attn_selfcheck.json").exists()  # CPU: no check unless forced


@pytest.mark.slow
def test_strict_refuses_to_train_in_one_line_rc_2(wrong, tmp_path):
    run = tmp_path / "run"
    argv = [
        *COMMON,
        f"run_dir={run}",
        "model.attn_impl=wrong_scale",
        "model.attn_selfcheck_cpu=true",
        "model.attn_selfcheck=strict",
    ]
    code = f"import sys, wrong_impls; from mta_repro.train.__main__ import cli; sys.exit(cli({argv!r}))"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(wrong)]), OMP_NUM_THREADS="1")
    env.pop("MTA_REPRO_TRACEBACK", None)
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("train: error: attention self-check: model.attn_impl=wrong_scale is wrong on cpu"), last
    assert not run.exists()  # refused before anything was written (a fresh run dir is removed)
