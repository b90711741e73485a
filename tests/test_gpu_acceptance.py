"""scripts/gpu_acceptance.py --quick --device cpu: the first-GPU command's code path at toy
shapes, so it cannot rot before a GPU runs it (about a minute on 2 busy cores, most of
it the four trainer processes of the memory/preempt and resume sections, mostly their
start-up: imports, config, model; --quick trains 2-layer tiny models there)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_quick_cpu_run_writes_every_section(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)  # the fused kernels are too slow in the interpreter: recorded as unsupported
    p = subprocess.run(
        [sys.executable, "scripts/gpu_acceptance.py", "--quick", "--device", "cpu", "--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (js,) = tmp_path.glob("cpu_*.json")
    (md,) = tmp_path.glob("cpu_*.md")
    res = json.loads(js.read_text())
    for key in ("device", "parity", "layers", "pick", "step", "memory", "resume", "preempt"):
        assert key in res, key
    # Parity: the default path and ATen's convolution route ran in bf16 and fp32 and passed.
    ran = {(r["layer"], r["impl"], r["dtype"]) for r in res["parity"] if r["status"] == "ok"}
    for layer in ("kq_conv", "mixing"):
        for impl in ("blocked", "blocked+conv2d"):
            for dtype in ("bfloat16", "float32"):
                assert (layer, impl, dtype) in ran
    assert not [r for r in res["parity"] if r["status"] == "FAIL"]
    assert {r["impl"] for r in res["layers"] if r["status"] == "ok"} >= {"sdpa", "torch", "blocked"}
    assert res["pick"]["override"].startswith("model.attn_impl=")
    assert {(r["variant"], r["compile"]) for r in res["step"]["rows"]} == {("baseline", False), ("mta", False)}
    assert res["memory"]["peak_alloc_gb"] > 0 and res["memory"]["estimate_gb"] > 0
    assert res["preempt"]["ok"] and res["preempt"]["signal_to_complete_s"] > 0
    assert res["resume"]["ok"] and res["resume"]["max_rel_diff"] == 0.0  # CPU: bitwise
    text = md.read_text()
    assert "## Table 9" in text and "| Transformer |" in text and "| MTA |" in text


def _acceptance_module():
    """The script as a module; scripts/ is on pytest's pythonpath as on sys.path when it runs (benchlib)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_acceptance", ROOT / "scripts" / "gpu_acceptance.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(
    not (ROOT / "mta_repro" / "experimental").is_dir(), reason="the experimental triton implementation is absent"
)
def test_the_pick_reports_the_fastest_triton_knob_as_a_config_override():
    """On a GPU the fused kernel is timed under each setting of TRITON_KNOBS; the pick weighs
    the layers as the 880M model has them (6 kq-conv, 18 mixing) and returns the fastest
    whole-model choice with its knob in the override to train with."""
    ga = _acceptance_module()
    frame, slab = "+model.kernels.impl_options.triton.frame=128x128", "+model.kernels.impl_options.triton.slab_rows=2"
    assert {frame, slab} < set(ga.TRITON_KNOBS)
    parity = [
        {"layer": layer, "impl": impl, "dtype": "bfloat16", "status": "ok"}
        for layer in ("kq_conv", "mixing")
        for impl in ("triton", "blocked")
    ]
    t = {
        ("kq_conv", ""): 10.0,
        ("mixing", ""): 2.0,
        ("kq_conv", frame): 8.0,
        ("mixing", frame): 2.5,
        ("kq_conv", slab): 9.0,
        ("mixing", slab): 1.9,
    }
    rows = [
        {"layer": layer, "impl": "triton", "B": 1, "T": 64, "block_size": None, "knob": knob, "status": "ok", "s": s}
        for (layer, knob), s in t.items()
    ]
    rows += [
        {"layer": layer, "impl": "blocked", "B": 1, "T": 64, "block_size": 128, "knob": "", "status": "ok", "s": 99.0}
        for layer in ("kq_conv", "mixing")
    ]
    pick = ga.pick(parity, rows, "bfloat16")
    cost = {knob: 6 * t[("kq_conv", knob)] + 18 * t[("mixing", knob)] for knob in {k for _, k in t}}
    best = min(cost, key=cost.get)  # an independent argmin of the weighted sums
    assert pick["model"]["impl"] == "triton" and pick["model"]["knob"] == best == slab
    assert pick["override"] == f"model.attn_impl=triton {slab}" and "env" not in pick
    assert pick["per_layer"]["kq_conv"]["knob"] == frame  # per layer, its own fastest
    # The override composes as the trainer reads it, and the knob's tuning is the one timed.
    from mta_repro.train.config import compose, to_train_config

    kernels = to_train_config(compose(["attention=mta", *pick["override"].split()])).model.kernels
    assert kernels == ga.knob_tuning(slab) and kernels.impl_options == {"triton": {"slab_rows": 2}}
    assert ga.knob_tuning(frame).impl_options["triton"]["frame"] == "128x128" and ga.knob_tuning("") == type(kernels)()


def test_blocked_conv2d_runs_conv2d_under_the_tuning(monkeypatch):
    """``blocked+conv2d`` reaches F.conv2d through the params' tuning, forward and the
    recomputing backward, with nothing set in the environment."""
    import torch

    from mta_repro.model import attention_blocked

    ga = _acceptance_module()
    calls = []
    real = attention_blocked.kq_conv_dense
    monkeypatch.setattr(attention_blocked, "kq_conv_dense", lambda *a: calls.append(1) or real(*a))
    p = ga.layer_params("kq_conv", 2, (2, 3), torch.float32, torch.device("cpu"), 8)
    q, k, v = (torch.randn(1, 2, 16, 4, requires_grad=True) for _ in range(3))
    ga.call_impl("blocked+conv2d", q, k, v, p, True).sum().backward()
    assert len(calls) == 2 * 2 * 2  # pre and post conv, 2 blocks, forward + recompute


@pytest.mark.slow
def test_a_run_killed_mid_way_leaves_the_sections_it_finished(tmp_path):
    """Each section's result is in the JSON the moment it ends: a device command killed at
    its time limit still returns what it measured."""
    import signal
    import time

    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    p = subprocess.Popen(
        [
            sys.executable,
            "scripts/gpu_acceptance.py",
            "--quick",
            "--device",
            "cpu",
            "--out",
            str(tmp_path),
            "--compile",
            "off",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.time() + 300
    res = None
    while time.time() < deadline and p.poll() is None:
        found = list(tmp_path.glob("cpu_*.json"))
        if found:
            res = json.loads(found[0].read_text())  # atomic: always whole
            if "layers" in res["completed"]:
                break
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert res is not None and res["completed"][:2] == ["parity", "layers"], res and res["completed"]
    (js,) = tmp_path.glob("cpu_*.json")
    final = json.loads(js.read_text())
    assert final["completed"][0] == "parity" and final["parity"] and "resume" not in final["completed"]


@pytest.mark.skipif(
    not (ROOT / "mta_repro" / "experimental").is_dir(), reason="the experimental triton implementation is absent"
)
def test_a_parity_fail_names_the_fallback_the_trainer_takes():
    ga = _acceptance_module()
    ok = lambda impl, layer="kq_conv": {"layer": layer, "impl": impl, "dtype": "bfloat16", "status": "ok"}  # noqa: E731
    fail = lambda impl: {"layer": "kq_conv", "impl": impl, "dtype": "bfloat16", "status": "FAIL"}  # noqa: E731
    impls = ["blocked", "triton", "blocked+conv2d"]
    assert ga.fallbacks([fail("triton"), ok("blocked"), ok("blocked+conv2d")], impls, "bfloat16") == {
        "triton": "blocked"
    }
    # blocked fails too: the chain goes on to blocked+conv2d, and past it to torch
    assert ga.fallbacks([fail("triton"), fail("blocked"), ok("blocked+conv2d")], impls, "bfloat16") == {
        "triton": "blocked+conv2d",
        "blocked": "blocked+conv2d",
    }
    assert ga.fallbacks([fail("triton"), fail("blocked"), fail("blocked+conv2d")], impls, "bfloat16") == {
        "triton": "torch",
        "blocked": "torch",
        "blocked+conv2d": "torch",
    }
    assert ga.fallbacks([ok("triton"), ok("blocked")], impls, "bfloat16") == {}
