"""The memory pre-flight against a measured CPU training step at real 300M shapes (dim
1024, 16 heads of 64; two layers, one with the key-query convolution; an 8K vocabulary),
baseline and MTA: scripts/measure_memory.py runs one forward + backward + AdamW step in a
fresh process and reports its peak resident memory above the process's memory before the
model was built.

The measured process runs with a fixed glibc mmap threshold (MALLOC_MMAP_THRESHOLD_=131072):
with glibc's dynamic threshold, freed buffers below 32 MB stay resident, and MTA's blocked
path frees many per query block, so the measured peak moved by ~2-3 GB between identical runs
(docs/memory.md). With the threshold fixed the step measures what its tensors need.

Stated property: the pre-flight is an upper bound of that step for the baseline and for MTA,
and MTA's extra over the baseline is not under-estimated. It is conservative: measured here
estimate/measured 1.52 (baseline) and 2.00 (MTA) at 2048 tokens, hence the 2.2 ceiling; a
tighter MTA term is open work (issue on long context, item 5)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHAPE = ["model=300m", "model.n_layers=2", "model.kq_conv_layers=1", "model.vocab_size=8192",
         "data.seq_len=2048", "data.batch_size=1"]
TOLERANCE = 2.2
# glibc: a fixed mmap threshold, so freed buffers go back to the OS (see the docstring)
ENV = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}


def _measure(attention: str) -> dict:
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "measure_memory.py"), *SHAPE, f"attention={attention}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=900, env=ENV)
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
