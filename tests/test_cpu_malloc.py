"""trainer.cpu_mmap_threshold (mta_repro/estimate/cpu_malloc.py): with glibc's dynamic threshold a
freed multi-MB block stays resident once a larger one has been freed before it; with the
threshold fixed it goes back to the OS. Each case runs in a fresh interpreter (a
threshold, once fixed, stays for the life of the process)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mta_repro.errors import UserError
from mta_repro.estimate import cpu_malloc

ROOT = Path(__file__).resolve().parents[1]

# Resident bytes a freed 8 MiB block leaves behind, after a 16 MiB block was freed (which
# raises glibc's dynamic threshold to 16 MiB).
RETAINED = """
import ctypes, resource, sys
from mta_repro.estimate.cpu_malloc import fix_mmap_threshold
set_to = fix_mmap_threshold(int(sys.argv[1]) or None)
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()
def touch_and_free(n):
    p = libc.malloc(ctypes.c_size_t(n))
    ctypes.memset(p, 1, n)
    libc.free(ctypes.c_void_p(p))
touch_and_free(16 << 20)
before = rss()
touch_and_free(8 << 20)
print(set_to, rss() - before)
"""


def _retained(threshold: int) -> tuple:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for var in ("MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES"):
        env.pop(var, None)
    out = subprocess.run(
        [sys.executable, "-c", RETAINED, str(threshold)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=True,
    ).stdout.split()
    return None if out[0] == "None" else int(out[0]), int(out[1])


@pytest.mark.skipif(cpu_malloc._glibc() is None, reason="glibc's malloc only")
def test_a_fixed_threshold_returns_freed_blocks_and_the_default_keeps_them():
    set_to, kept = _retained(0)  # 0: null, glibc's default
    assert set_to is None and kept >= 7 << 20
    set_to, kept = _retained(131072)
    assert set_to == 131072 and kept < 1 << 20


def test_a_threshold_glibc_set_by_the_user_is_left_alone(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert cpu_malloc.fix_mmap_threshold(131072) is None
    assert cpu_malloc.fix_mmap_threshold(None) is None


@pytest.mark.parametrize("bad", [0, -1, 64 << 20, True, "128k", 1.5])
def test_bad_thresholds_are_one_line_errors(bad):
    with pytest.raises(UserError) as e:
        cpu_malloc.check_threshold(bad)
    assert "trainer.cpu_mmap_threshold" in str(e.value) and "\n" not in str(e.value)


def test_the_trainer_field_is_checked_when_the_config_is_read():
    from mta_repro.train.config import compose, to_train_config

    assert to_train_config(compose(["trainer.cpu_mmap_threshold=131072"])).trainer.cpu_mmap_threshold == 131072
    with pytest.raises(UserError, match="trainer.cpu_mmap_threshold"):
        to_train_config(compose(["trainer.cpu_mmap_threshold=-5"]))
