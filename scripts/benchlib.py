"""What the benchmark scripts share: timing, peak memory and the one-layer attention
parameters. Imported as ``benchlib`` (a script's own folder is on its ``sys.path``); the
package itself must be importable (``pip install -e .``, or ``PYTHONPATH=.`` on a machine
where it is not installed, e.g. a GPU machine image without a package registry)."""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable

import torch

from mta_repro.errors import UserError
from mta_repro.kernels.tuning import KernelTuning
from mta_repro.train.metrics import peak_rss_bytes, reset_peak_rss  # noqa: F401 - shared with the scripts


def kernel_tuning(overrides: Iterable[str] = (), base: KernelTuning | None = None) -> KernelTuning:
    """``base`` (None: the defaults) with ``FIELD=VALUE`` overrides of ``model.kernels``
    (``kq_conv=conv2d``, ``+model.kernels.impl_options.triton.frame=128x64``: one option of an
    implementation), each value read as YAML as on the command line; an empty string is no
    override. The scripts' ``--kernels``."""
    import yaml

    out = base or KernelTuning()
    names = {f.name for f in dataclasses.fields(KernelTuning)}
    for item in overrides:
        if not item:
            continue
        key, sep, value = item.partition("=")
        name = key.strip().lstrip("+").removeprefix("model.kernels.")
        impl, _, option = name.removeprefix("impl_options.").partition(".")
        if sep and name.startswith("impl_options.") and option:  # one implementation's own option
            options = {n: dict(o) for n, o in out.impl_options.items()}
            options.setdefault(impl, {})[option] = yaml.safe_load(value)
            out = dataclasses.replace(out, impl_options=options)
            continue
        if not sep or name not in names:
            raise SystemExit(f"--kernels {item!r}: expected FIELD=VALUE with FIELD one of {sorted(names)}")
        try:
            out = dataclasses.replace(out, **{name: yaml.safe_load(value)})
        except UserError as e:
            raise SystemExit(f"--kernels: {e}") from None
    return out


def peak_rss_gb() -> float:
    """This process's peak resident set (VmHWM), GB = 1e9 bytes."""
    return peak_rss_bytes() / 1e9


def run_child(cmd: list, cwd, label: str, peak_cmd: list | None = None, peak_key: str = "peak_gb") -> dict | None:
    """One measurement in its own process: ``cmd`` prints its row as JSON on its last line.
    ``peak_cmd`` (on CPU) runs again with glibc mmapping every block over 1 MiB, so that freed
    tensors leave the resident set and its peak is the tensors' own; its ``peak_key``
    replaces the row's. A failed child is reported under ``label`` and gives None."""
    p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if p.returncode != 0:
        print(f"{label} failed:\n{p.stderr[-2000:]}", file=sys.stderr)
        return None
    row = json.loads(p.stdout.strip().splitlines()[-1])
    if peak_cmd is not None:
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(2**20))
        m = subprocess.run(peak_cmd, cwd=cwd, capture_output=True, text=True, env=env)
        if m.returncode == 0:
            row[peak_key] = json.loads(m.stdout.strip().splitlines()[-1])[peak_key]
    return row


def sync(device) -> None:
    """Wait for the device's queued work (a no-op on CPU): timings end when the work does."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], object], reps: int, device="cpu", warmup: int = 1) -> tuple[float, list]:
    """(median, all) wall seconds of ``fn()`` over ``reps`` runs after ``warmup`` runs,
    the device synchronised around each."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def layer_params(
    layer: str,
    heads: int,
    kernel,
    dtype,
    device,
    block_size: int,
    seed: int = 0,
    requires_grad: bool = False,
    mixing: str | None = "noisy",
    tuning: KernelTuning | None = None,
):
    """The MTA parameters of one attention layer: ``kq_conv`` (key-query convolutions
    before and after softmax, ``kernel`` = (c_q, c_k), and head mixing) or ``mixing``
    (head mixing only). Weights ~ 0.1 N(0, 1) from ``seed``; the pre-softmax head mixing
    is the identity plus such noise (``mixing="noisy"``, so that it mixes) or exactly the
    identity (``"identity"``). ``tuning``: the kernels' (None: the defaults)."""
    from mta_repro.model import attention_ops

    g = torch.Generator().manual_seed(seed)

    def param(*shape):
        return (torch.randn(*shape, generator=g) * 0.1).to(device, dtype).requires_grad_(requires_grad)

    conv = layer == "kq_conv"
    pre = param(heads, 1, *kernel) if conv else None  # drawn in this order: the seed fixes each
    eye = torch.eye(heads).to(device, dtype)
    wpsm = (eye + param(heads, heads).detach()) if mixing == "noisy" else eye
    post = param(heads, 1, *kernel) if conv else None
    return attention_ops.ExplicitAttnParams(
        mta_kernel=pre,
        wpsm=wpsm.requires_grad_(requires_grad),
        mta_kernel_after_sm=post,
        head_kernel=param(1, heads, heads),
        pad_key="both",
        block_size=block_size,
        tuning=tuning or KernelTuning(),
    )


def ratio(row: dict, base: dict | None, key: str, suffix: str = "") -> str:
    """``row[key] / base[key]`` for a table column, "n/a" without a positive base."""
    if not base or not base.get(key):
        return "n/a"
    return f"{row[key] / base[key]:.2f}{suffix}"


def write_rows(path: str | None, rows: list) -> None:
    """The table's rows as JSON, when ``--json PATH`` asked for them."""
    if path:
        import json
        from pathlib import Path

        Path(path).write_text(json.dumps(rows, indent=1))
