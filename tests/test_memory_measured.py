"""The memory pre-flight against a measured CPU training step at real 300M shapes (dim
1024, 16 heads of 64; two layers, one with the key-query convolution; an 8K vocabulary),
baseline and MTA: scripts/measure_memory.py runs one forward + backward + AdamW step in a
fresh process and reports its peak resident memory above the process's memory before the
model was built (allocator included).

Stated tolerance: the pre-flight is an upper bound of the measured step, at most 50%
above it (measured here: 1.30 baseline, 1.34 MTA at 2048 tokens;
1.11 and 1.20 at 4096), for the baseline and for MTA; and MTA's extra over the baseline is not
under-estimated. Per layer the estimate follows the measurement: MTA at 4096 tokens, 2 -> 4
layers, measured +1.28 GB, estimated +1.25 GB. Not covered: the trainer's own path
(blocks compiled with torch.compile, FSDP2 wrapping), where a larger MTA extra was
reported at 20 layers; the eager step here does not show it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHAPE = ["model=300m", "model.n_layers=2", "model.kq_conv_layers=1", "model.vocab_size=8192",
         "data.seq_len=2048", "data.batch_size=1"]
TOLERANCE = 1.5


def _measure(attention: str) -> dict:
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "measure_memory.py"), *SHAPE, f"attention={attention}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_preflight_bounds_a_measured_cpu_step_for_baseline_and_mta():
    base, mta = _measure("baseline"), _measure("mta")
    for name, r in (("baseline", base), ("mta", mta)):
        ratio = r["estimated_bytes"] / r["measured_bytes"]
        assert 1.0 <= ratio <= TOLERANCE, (name, ratio, r)
    extra_est = mta["estimated_bytes"] - base["estimated_bytes"]
    extra_measured = mta["measured_bytes"] - base["measured_bytes"]
    assert extra_est >= extra_measured, (extra_est, extra_measured)
