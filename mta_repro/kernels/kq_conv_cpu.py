"""The key-query convolution on CPU through small C loops (``kq_conv.c``).

``F.conv2d``'s depthwise convolution, its backward above all, is the largest single cost of
an MTA layer on CPU: 6.9x the C kernel's time for one query block's forward and backward
(``scripts/bench_kq_conv.py``; docs/models.md). The C file computes the forward, the input
gradient and the weight gradient with loops that vectorise along the key axis; it is compiled with the
system C compiler on first use (about a second) into ``$MTA_REPRO_KERNEL_CACHE`` (default
``~/.cache/mta_repro``), keyed by the source, the flags and the CPU, and called through
ctypes on contiguous float32/float64 tensors. The op is a ``torch.library.custom_op`` with
a fake (meta) implementation and a registered backward, so it traces under
``torch.compile``. Where it cannot run (no compiler, another device or dtype,
``MTA_REPRO_CPU_KERNELS=0``) ``available`` is False and callers use ``F.conv2d``.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

_SRC = Path(__file__).with_name("kq_conv.c")
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c99"]
_DTYPES = {torch.float32: "f32", torch.float64: "f64"}
_lib: ctypes.CDLL | None = None
_failed = False


def _cpu_id() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))][:2]
        return "\n".join(lines)
    except OSError:
        return platform.processor()


def _compile() -> ctypes.CDLL:
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler (gcc/cc) on PATH")
    src = _SRC.read_bytes()
    key = hashlib.sha256(src + " ".join([cc, *_FLAGS]).encode() + _cpu_id().encode()).hexdigest()[:16]
    cache = Path(os.environ.get("MTA_REPRO_KERNEL_CACHE", Path.home() / ".cache" / "mta_repro"))
    cache.mkdir(parents=True, exist_ok=True)
    so = cache / f"kq_conv-{key}.so"
    if not so.exists():
        # Build beside the target and rename, so concurrent ranks never load a partial file.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
        os.close(fd)
        try:
            subprocess.run([cc, *_FLAGS, str(_SRC), "-o", tmp], check=True, capture_output=True, text=True)
            os.replace(tmp, so)
        except subprocess.CalledProcessError as e:
            raise RuntimeError(f"compiling {_SRC} failed: {e.stderr.strip()[:500]}") from None
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    lib = ctypes.CDLL(str(so))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for suf in _DTYPES.values():
        for name in ("kq_corr", "kq_wgrad"):
            fn = getattr(lib, f"{name}_{suf}")
            fn.argtypes = [ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, i64, i64, i64, ctypes.c_int]
            fn.restype = None
    return lib


def _get_lib() -> ctypes.CDLL | None:
    global _lib, _failed
    if _lib is None and not _failed:
        if os.environ.get("MTA_REPRO_CPU_KERNELS", "1") == "0":
            _failed = True
            return None
        try:
            _lib = _compile()
        except (RuntimeError, OSError) as e:
            _failed = True
            warnings.warn(f"CPU key-query convolution kernel unavailable ({e}); using F.conv2d", stacklevel=2)
    return _lib


def available(x: torch.Tensor) -> bool:
    """Whether ``kq_conv`` below runs on this tensor (CPU, fp32/fp64, kernel compiled)."""
    return x.device.type == "cpu" and x.dtype in _DTYPES and _get_lib() is not None


# "No causal mask": a diagonal beyond every column.
NO_DIAG = 2**62


def _call(
    name: str, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, cq: int, ck: int, ro: int, pl: int, diag: int
) -> None:
    """a: (B, H, R, K) contiguous; the C file's layout comment says the rest."""
    B, H, R, K = a.shape
    fn = getattr(_get_lib(), f"{name}_{_DTYPES[a.dtype]}")
    fn(a.data_ptr(), b.data_ptr(), out.data_ptr(), B * H, H, R, K, cq, ck, ro, pl, diag, torch.get_num_threads())


def _corr(x: torch.Tensor, w: torch.Tensor, ro: int, pl: int, diag: int) -> torch.Tensor:
    """y[i, j] = sum_{a, b} w[a, b] * x[i + a - ro, j + b - pl] per plane (0 outside and
    above the diagonal ``diag``, on both sides)."""
    x = x.contiguous()
    y = torch.empty_like(x)
    _call("kq_corr", x, w.to(x.dtype).contiguous(), y, w.shape[1], w.shape[2], ro, pl, diag)
    return y


@torch.library.custom_op("mta_repro::kq_conv_cpu", mutates_args=(), device_types="cpu")
def kq_conv(x: torch.Tensor, w: torch.Tensor, pad_left: int, diag: int = NO_DIAG) -> torch.Tensor:
    """x: (B, H, R, K); w: (H, c_q, c_k). ``attention_ops.kq_conv_dense`` of x with its entries above
    the diagonal (key > row + diag) zeroed, zeroed there again on output: rows look back
    c_q-1, keys are padded ``pad_left`` before and c_k-1-pad_left after."""
    return _corr(x, w, w.shape[1] - 1, pad_left, diag)


@kq_conv.register_fake
def _(x, w, pad_left, diag=NO_DIAG):
    return torch.empty_like(x)


@torch.library.custom_op("mta_repro::kq_conv_cpu_bwd", mutates_args=(), device_types="cpu")
def _kq_conv_bwd(
    gy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, pad_left: int, diag: int
) -> tuple[torch.Tensor, torch.Tensor]:
    cq, ck = w.shape[1], w.shape[2]
    B, H, R, K = x.shape
    gy, x = gy.contiguous(), x.contiguous()
    # Input gradient: gx[r, m] = sum w[a, b] gy[r - a + c_q-1, m - b + pad_left], the
    # same correlation with the flipped kernel, rows looking forward; the masked entries
    # of x get no gradient, and gy's (outputs forced to 0) are not read.
    gx = _corr(gy, w.flip(1, 2), 0, ck - 1 - pad_left, diag)
    gw = torch.empty(B, H, cq, ck, dtype=torch.float64)  # per plane, summed over B below
    _call("kq_wgrad", gy, x, gw, cq, ck, cq - 1, pad_left, diag)
    return gx, gw.sum(0).to(w.dtype)


@_kq_conv_bwd.register_fake
def _(gy, x, w, pad_left, diag):
    return torch.empty_like(x), torch.empty_like(w)


def _setup(ctx, inputs, output):
    x, w, pad_left, diag = inputs
    ctx.save_for_backward(x, w)
    ctx.pad_left, ctx.diag = pad_left, diag


def _backward(ctx, gy):
    x, w = ctx.saved_tensors
    gx, gw = _kq_conv_bwd(gy, x, w, ctx.pad_left, ctx.diag)
    return gx, gw, None, None


kq_conv.register_autograd(_backward, setup_context=_setup)
