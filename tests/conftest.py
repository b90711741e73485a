"""Test-session setup shared by every test module, and the rules that complete the tiers.

Each test carries its own tier marks (``@pytest.mark.slow``, or a module's ``pytestmark``);
the markers are registered in pyproject.toml:

    make test-fast        python -m pytest -m "not slow"   (the edit loop, < 3 min on 2 cores)
    make test             everything (what .ci/run runs)
    (both on TEST_WORKERS pytest-xdist workers)
    python -m pytest -m triton | slurm | distributed | pipeline | lm_eval

Rules applied here: a test marked with one of the cluster/process/interpreter markers is
also ``slow``; a parametrization whose id names ``triton`` is ``triton``; the SLURM tests and
the tests of a module that builds a module- or session-scoped fixture keep to one pytest-xdist
worker (``xdist_group``); the long tier goes out first.
"""

import os
import sys

import pytest

from mta_repro.cli import configure_logging

# The tests run the Triton kernels (the key-query convolution, the experimental
# model.attn_impl=triton) on CPU tensors, in Triton's interpreter, GPU or not (on a GPU,
# scripts/bench_attention.py --device cuda runs them compiled). The variable must be set
# before the kernels are defined (first use).
os.environ.setdefault("TRITON_INTERPRET", "1")

# The package's diagnostics on stderr as the command lines print them (a test reads them with
# capsys), and passed on to the root logger too, where pytest's caplog listens.
configure_logging().propagate = True


def _worker_threads() -> int | None:
    """Each pytest-xdist worker's share of the cores (None outside xdist). With torch's
    default, one intra-op thread per core in every worker, N workers run N x cores OpenMP
    threads that spin against each other: on 2 cores with 2 workers the same tests took
    15-25% more CPU time (test_train_rundir, test_memory, test_train and test_gqa on -n 2:
    70 s against 62 s, and 98 s against 80 s on a busier machine), the tiny pipeline's
    jobs 1.7x."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // workers)


# Set before torch starts its thread pool (and inherited by the subprocesses the tests run);
# an OMP_NUM_THREADS the caller set is left alone.
_THREADS = _worker_threads()
if _THREADS is not None and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(_THREADS)
    if "torch" in sys.modules:  # imported by a plugin before this file: too late for the variable
        sys.modules["torch"].set_num_threads(_THREADS)

TIER_MARKERS = ("slurm", "distributed", "triton", "pipeline", "lm_eval")  # each implies slow
SHARED_SCOPES = ("module", "package", "session")
# The modules with a shared fixture whose tests this session grouped on one worker (tests/test_conftest_groups.py).
GROUPED: set = set()


def _where(item) -> str:
    path = os.path.relpath(str(item.path), os.path.dirname(__file__))
    return path.replace(os.sep, "/")


def _builds_shared_fixture(item) -> bool:
    """Whether the test uses a module-or-wider fixture defined in its own module (built once
    per worker that runs one of the module's tests: minutes for a tiny pipeline)."""
    module = item.nodeid.split("::")[0]
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.values() if info is not None else ()
    return any(d.scope in SHARED_SCOPES and d.baseid == module for ds in defs for d in ds)


def _schedule_rank(item) -> int:
    """The SLURM group, then the other groups and the rest of the long tier, then the fast
    tier (sorted() keeps file order within each, so a module's tests stay together)."""
    if item.get_closest_marker("slurm"):
        return 0
    if item.get_closest_marker("xdist_group"):
        return 1
    return 2 if item.get_closest_marker("slow") else 3


# tryfirst: pytest-xdist's workers read the xdist_group marks in their own hook of this name
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    xdist = config.pluginmanager.hasplugin("xdist")
    for item in items:
        if "[" in item.name and "triton" in item.name.split("[", 1)[1] and not item.get_closest_marker("triton"):
            item.add_marker(pytest.mark.triton)  # Triton's interpreter, where a test parametrizes over impls
        if any(item.get_closest_marker(m) for m in TIER_MARKERS) and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)
        # The SLURM tests share one single-node cluster and its queue: one worker, one after the
        # other, as they would run alone. A shared fixture is built once, not once per worker.
        shared = _builds_shared_fixture(item)
        if item.get_closest_marker("slurm"):
            group = "slurm"
        elif shared:
            group = _where(item)
        else:
            continue
        if shared:
            GROUPED.add(_where(item))
        if xdist:
            item.add_marker(pytest.mark.xdist_group(group))
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: its order is the schedule's
        items[:] = sorted(items, key=_schedule_rank)
