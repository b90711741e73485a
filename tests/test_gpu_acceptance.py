"""scripts/gpu_acceptance.py --quick --device cpu: the first-GPU command's code path at toy
shapes, so it cannot rot before a GPU runs it (about a minute on 2 busy cores, most of
it the three trainer processes of the memory/preempt and resume sections)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_quick_cpu_run_writes_every_section(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)  # the fused kernels are too slow in the interpreter: recorded as unsupported
    p = subprocess.run([sys.executable, "scripts/gpu_acceptance.py", "--quick", "--device", "cpu", "--out", str(tmp_path)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
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
