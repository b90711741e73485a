"""The key-query convolution alone, one query block at the 880M shape: the designs
measured for the blocked path, side by side (fwd+bwd, CPU fp32, median of --reps).

    python scripts/bench_kq_conv.py                 # block of 256 rows x 2048 keys, 6x11
    python scripts/bench_kq_conv.py --rows 128 --keys 4096 --compile
    python scripts/bench_kq_conv.py --device cuda --dtype bfloat16 --batch 4 --rows 512   # + triton
    python scripts/bench_kq_conv.py --sm90          # compile the Triton kernels for sm_90, no GPU

- conv2d:   F.conv2d, depthwise (the release's and the reference's way)
- c_kernel: mta_repro.kernels.kq_conv_cpu (C loops, the one the blocked path uses)
- shifted:  sum over the c_q x c_k taps of shifted slices, eager
- compiled: the same under torch.compile (inductor; --compile, minutes to compile)
- gemm_qk:  the identity sum_a shift_a(Q) . conv1d_a(K)^T (docs/models.md, the attention engine): its GEMM alone
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
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--sm90", action="store_true", help="compile report for sm_90 (no GPU needed), then exit")
    ap.add_argument("--tile", default="64x64", metavar="RxC", help="the Triton kernel's tile (model.kernels.kq_tile)")
    a = ap.parse_args()
    from mta_repro.kernels.tuning import KernelTuning

    tile = KernelTuning(kq_tile=a.tile).kq_tile_shape
    if a.sm90:
        return compile_report(a.cq, a.ck, tile)

    from mta_repro.kernels import kq_conv_cpu
    from mta_repro.model import attention_ops

    H, n, T, cq, ck, d = a.heads, a.rows, a.keys, a.cq, a.ck, a.head_dim
    pl = (ck - 1) // 2
    g = torch.Generator().manual_seed(0)
    dev, dt = torch.device(a.device), getattr(torch, a.dtype)
    x = torch.randn(a.batch, H, n + cq - 1, T, generator=g).to(dev, dt).requires_grad_()
    w = torch.randn(H, 1, cq, ck, generator=g).to(dev, dt).requires_grad_()

    def shifted(x, w):
        xp = F.pad(x, (pl, ck - 1 - pl, cq - 1, 0))
        rows, keys = x.shape[2], x.shape[3]
        out = 0
        for i in range(cq):
            for j in range(ck):
                out = out + w[:, 0, i, j].view(1, H, 1, 1) * xp[:, :, i : i + rows, j : j + keys]
        return out

    qs = torch.randn(a.batch, H, n, cq * d, generator=g).to(dev, dt).requires_grad_()
    ks = torch.randn(a.batch, H, T, cq * d, generator=g).to(dev, dt).requires_grad_()
    cases = {
        "conv2d": lambda: attention_ops.kq_conv_dense(x, w, "both"),
        "shifted": lambda: shifted(x, w),
        "gemm_qk": lambda: torch.matmul(qs, ks.transpose(-1, -2)),
    }
    if kq_conv_cpu.available(x):
        cases["c_kernel"] = lambda: kq_conv_cpu.kq_conv(x, w[:, 0], pl)
    if dev.type == "cuda":
        from mta_repro.kernels import kq_conv_triton

        # As the blocked path calls it for its last block: rows end at the last key.
        cases["triton"] = lambda: kq_conv_triton.kq_conv(x, w[:, 0], pl, T - x.shape[2], *tile)
    if a.compile:
        comp = torch.compile(shifted)
        cases["compiled"] = lambda: comp(x, w)

    rows = []
    for name, fn in cases.items():
        y = fn()  # warm-up (and compile)
        y.backward(torch.ones_like(y))
        times = []
        for _ in range(a.reps):
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            y = fn()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t1 = time.perf_counter()
            y.backward(torch.ones_like(y))
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times.append((t1 - t0, time.perf_counter() - t0))
        rows.append((name, statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)))
        if dev.type == "cuda":
            torch.cuda.synchronize()
    base = "c_kernel" if dev.type == "cpu" else "conv2d"
    ref = dict((r[0], r[2]) for r in rows).get(base)
    print(
        f"\nkey-query convolution, one block: B={a.batch}, {H} heads x {n} rows x {T} keys, {cq}x{ck}, "
        f"{a.device} {a.dtype}, {torch.get_num_threads()} threads, median of {a.reps}\n"
    )
    print(f"| design | fwd s | fwd+bwd s | x {base} |")
    print("|---|---|---|---|")
    for name, f, fb in rows:
        print(f"| {name} | {f:.3f} | {fb:.3f} | {fb / ref:.2f} |" if ref else f"| {name} | {f:.3f} | {fb:.3f} | n/a |")


def ptxas_line(ptx: str) -> str:
    """``ptxas -v``'s registers and spill bytes of a compiled kernel, for the table."""
    from mta_repro.kernels.gpu_compile import ptxas_report

    try:
        r = ptxas_report(ptx, 90)
    except RuntimeError as e:
        return str(e)[:160]
    return f"{r['registers']} registers, {r['spill_bytes']} B of spills"


def compile_report(cq: int, ck: int, tile: tuple[int, int]) -> None:
    """Both Triton kernels for sm_90 at ``tile`` (rows, keys), bf16 inputs, 4 and 8 warps."""
    import os

    os.environ.pop("TRITON_INTERPRET", None)
    import triton.language as tl

    from mta_repro.kernels import kq_conv_triton as kt
    from mta_repro.kernels.gpu_compile import compile_for_gpu

    br, bc = tile
    common = dict(CQ=cq, CK=ck, BR=br, BC=bc, BCH=kt._pow2(bc + ck - 1), CAUSAL=True, ACC=tl.float32, PREC="tf32")
    kernels = {
        "corr (fwd, input grad)": (kt._corr_kernel, common, {"x_ptr": "*bf16", "w_ptr": "*fp32", "y_ptr": "*bf16"}),
        "wgrad (kernel grad)": (
            kt._wgrad_kernel,
            dict(common, CKP=kt._pow2(ck)),
            {"gy_ptr": "*bf16", "x_ptr": "*bf16", "part_ptr": "*fp32"},
        ),
    }
    print(f"Triton key-query convolution, {cq}x{ck}, tile {br}x{bc} (key window {common['BCH']}), bf16, sm_90\n")
    print("| kernel | warps | compile s | shared KB | wgmma | ptxas |")
    print("|---|---|---|---|---|---|")
    for name, (fn, consts, ptrs) in kernels.items():
        names = fn.arg_names
        sig = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in names}
        for nw in (4, 8):
            t0 = time.time()
            k = compile_for_gpu(fn, sig, consts, arch=90, num_warps=nw)
            ptx = k.asm["ptx"]
            print(
                f"| {name} | {nw} | {time.time() - t0:.1f} | {k.metadata.shared / 1024:.0f} | "
                f"{ptx.count('wgmma.mma_async')} | {ptxas_line(ptx)} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
