"""The key-query convolution alone, one query block at the 880M shape: the designs
measured for the blocked path, side by side (fwd+bwd, CPU fp32, median of --reps).

    python scripts/bench_kq_conv.py                 # block of 256 rows x 2048 keys, 6x11
    python scripts/bench_kq_conv.py --rows 128 --keys 4096 --compile

- conv2d:   F.conv2d, depthwise (the release's and the reference's way)
- c_kernel: mta_repro.model.kq_conv_cpu (C loops, the one the blocked path uses)
- shifted:  sum over the c_q x c_k taps of shifted slices, eager
- compiled: the same under torch.compile (inductor; --compile, minutes to compile)
- gemm_qk:  the identity sum_a shift_a(Q) . conv1d_a(K)^T (PERF_NOTES.md): its GEMM alone
            (Q K^T with a c_q x d inner dimension, fwd+bwd), a lower bound: the band
            correction near the diagonal and the key convolution come on top. Applies to
            the pre-softmax convolution only.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--keys", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=96)
    ap.add_argument("--cq", type=int, default=6)
    ap.add_argument("--ck", type=int, default=11)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--compile", action="store_true")
    a = ap.parse_args()

    from mta_repro.model import attention_ops, kq_conv_cpu

    H, n, T, cq, ck, d = a.heads, a.rows, a.keys, a.cq, a.ck, a.head_dim
    pl = (ck - 1) // 2
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, H, n + cq - 1, T, generator=g, requires_grad=True)
    w = torch.randn(H, 1, cq, ck, generator=g, requires_grad=True)

    def shifted(x, w):
        xp = F.pad(x, (pl, ck - 1 - pl, cq - 1, 0))
        rows, keys = x.shape[2], x.shape[3]
        out = 0
        for i in range(cq):
            for j in range(ck):
                out = out + w[:, 0, i, j].view(1, H, 1, 1) * xp[:, :, i : i + rows, j : j + keys]
        return out

    qs = torch.randn(1, H, n, cq * d, generator=g, requires_grad=True)
    ks = torch.randn(1, H, T, cq * d, generator=g, requires_grad=True)
    cases = {
        "conv2d": lambda: attention_ops.kq_conv(x, w, "both"),
        "shifted": lambda: shifted(x, w),
        "gemm_qk": lambda: torch.matmul(qs, ks.transpose(-1, -2)),
    }
    if kq_conv_cpu.available(x):
        cases["c_kernel"] = lambda: kq_conv_cpu.kq_conv(x, w[:, 0], pl)
    if a.compile:
        comp = torch.compile(shifted)
        cases["compiled"] = lambda: comp(x, w)

    rows = []
    for name, fn in cases.items():
        y = fn()  # warm-up (and compile)
        y.backward(torch.ones_like(y))
        times = []
        for _ in range(a.reps):
            t0 = time.perf_counter()
            y = fn()
            t1 = time.perf_counter()
            y.backward(torch.ones_like(y))
            times.append((t1 - t0, time.perf_counter() - t0))
        rows.append((name, statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)))
    ref = dict((r[0], r[2]) for r in rows).get("c_kernel")
    print(f"\nkey-query convolution, one block: {H} heads x {n} rows x {T} keys, {cq}x{ck}, CPU fp32, "
          f"{torch.get_num_threads()} threads, median of {a.reps}\n")
    print("| design | fwd s | fwd+bwd s | x c_kernel |")
    print("|---|---|---|---|")
    for name, f, fb in rows:
        print(f"| {name} | {f:.3f} | {fb:.3f} | {fb / ref:.2f} |" if ref else f"| {name} | {f:.3f} | {fb:.3f} | n/a |")


if __name__ == "__main__":
    main()
