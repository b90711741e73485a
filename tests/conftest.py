"""Test-session setup shared by every test module, and the test tiers.

Tiers are assigned here, in one place, by test module and test name (not by decorators in
each file), so that moving a test between tiers is a one-line change in this file:

    make test-fast        python -m pytest -m "not slow"   (the edit loop, < 3 min on 2 cores)
    make test             everything (what .ci/run runs)
    python -m pytest -m triton | slurm | distributed | pipeline

``slow`` = anything outside the fast tier: every test that carries one of the other
markers, plus the tests named in SLOW_TESTS (measured with ``--durations``: seconds or
more on a quiet 2-core machine, mostly training runs and subprocess command lines).
Markers are registered in pyproject.toml.
"""

import os

import pytest

# The tests run the Triton kernels (model.attn_impl=triton) on CPU tensors, in Triton's
# interpreter, GPU or not (on a GPU, scripts/bench_attention.py --device cuda runs them
# compiled). The variable must be set before the kernels are defined (first use).
os.environ.setdefault("TRITON_INTERPRET", "1")

# Whole modules (paths relative to tests/) -> markers besides `slow`.
MODULE_MARKERS = {
    "test_slurm.py": ("slurm",),
    "distributed/test_train_distributed.py": ("distributed",),
    "distributed/test_train_reshard.py": ("distributed",),
    "test_eval_data_parallel.py": ("distributed",),
    "test_attn_triton.py": ("triton",),
    "test_pipeline.py": ("pipeline",),
    "test_train_e2e.py": ("pipeline",),
}

# Single tests (module, test-function name: every parametrization) -> markers besides
# `slow`. Multi-rank tests inside otherwise fast modules, and subprocess command lines.
TEST_MARKERS = {
    ("test_data.py", "test_two_real_ranks_match_in_process_loaders"): ("distributed",),
}

# Tests (module, test-function name) that are slow for their own sake: seconds or more
# each on 2 cores (measured with --durations; see the module docstring).
SLOW_TESTS = {
}


def _where(item) -> str:
    path = os.path.relpath(str(item.path), os.path.dirname(__file__))
    return path.replace(os.sep, "/")


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = _where(item)
        name = getattr(item, "originalname", None) or item.name.split("[")[0]
        marks = set(MODULE_MARKERS.get(module, ())) | set(TEST_MARKERS.get((module, name), ()))
        # Triton's interpreter, wherever a test parametrizes over implementations
        if "triton" in item.name.split("[", 1)[-1] and "[" in item.name:
            marks.add("triton")
        if marks or (module, name) in SLOW_TESTS or item.get_closest_marker("slow"):
            marks.add("slow")
        for m in sorted(marks):
            item.add_marker(getattr(pytest.mark, m))
