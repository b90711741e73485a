"""CPU runs: a fixed glibc mmap threshold, so that freed tensors leave the process.

glibc's ``malloc`` serves a block of at least its mmap threshold with its own ``mmap`` and
returns it to the OS on ``free``; smaller blocks come from the heap, and freed heap memory
mostly stays resident. The threshold starts at 128 KiB but is dynamic: each freed mmapped
block raises it to that block's size, up to 32 MiB. A training step allocates and frees
many tensors of a few MiB (MTA's blocked attention: several per query block and layer), so
after the first few the threshold has risen past them, they come from the heap, and the
resident set keeps what they leave behind: GBs above the step's tensors at 300M width,
varying between identical runs (docs/memory.md measures it).

``fix_mmap_threshold`` sets the threshold to a fixed value with ``mallopt`` (which also
turns the dynamic adjustment off): the peak resident memory of a CPU run is then what its
tensors need, which is what ``python -m mta_repro.estimate --memory`` estimates. The price
is speed: every such tensor is a fresh ``mmap`` whose pages the kernel zeroes on first
touch, most for MTA, whose query blocks allocate the most (docs/memory.md has the step
times). So the trainer leaves glibc's default alone unless asked:
``trainer.cpu_mmap_threshold=131072`` (bytes; glibc's initial value) fixes it on CPU
before the model is built. A threshold set through glibc's own ``MALLOC_MMAP_THRESHOLD_``
or ``GLIBC_TUNABLES`` is left as it is; on a C library other than glibc (musl, macOS)
nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

from mta_repro.errors import UserError

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
MAX_THRESHOLD = 32 * 1024 * 1024  # glibc refuses more (HEAP_MAX_SIZE / 2 on 64-bit)


def _glibc():
    """glibc, or None on any other C library."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        _ = libc.gnu_get_libc_version  # glibc only (musl has mallopt as a no-op stub)
    except (OSError, AttributeError):
        return None
    return libc


def check_threshold(value, what: str = "trainer.cpu_mmap_threshold") -> None:
    """A threshold glibc takes: null (its dynamic default) or 1..32 MiB bytes."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_THRESHOLD):
        raise UserError(
            f"{what}: expected null (glibc's dynamic default) or bytes in 1..{MAX_THRESHOLD} "
            f"(131072 keeps CPU memory at the pre-flight estimate), got {value!r}"
        )


def fix_mmap_threshold(threshold) -> int | None:
    """Fix glibc's mmap threshold at ``threshold`` bytes (module docstring); returns the
    bytes set, or None where nothing changed (None asked for, the user set glibc's own
    variable, not glibc)."""
    check_threshold(threshold)
    if threshold is None:
        return None
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "mmap_threshold" in os.environ.get("GLIBC_TUNABLES", ""):
        return None
    libc = _glibc()
    if libc is None or libc.mallopt(ctypes.c_int(M_MMAP_THRESHOLD), ctypes.c_int(threshold)) != 1:
        return None
    return threshold
