"""One attention layer's core (q, k, v -> output) at the 880M shape, every implementation
side by side: fwd+bwd time, peak memory and the bytes saved for backward.

    python scripts/bench_attention.py                          # CPU fp32, T = 1024, 2048, 4096
    python scripts/bench_attention.py --seqs 2048 --reps 5
    python scripts/bench_attention.py --device cuda --dtype bfloat16   # + the triton kernel
    python scripts/bench_attention.py --block-sizes 64,128,256,512 --seqs 2048 --impls blocked
    python scripts/bench_attention.py --profile kq_conv:blocked:2048   # torch.profiler table
    python scripts/bench_attention.py --device cuda --dtype bfloat16 --check 512   # correctness first
    python scripts/bench_attention.py --kernels kq_conv=conv2d,compile_block=false   # a model.kernels tuning

Layers (the release's 830M options, 16 heads of 96, B = 1):
  kq_conv  6x11 key-query convolution before and after softmax, wpsm, head conv over 16
  mixing   wpsm + head conv over 16 (layers outside mta_layers; talking heads)
and ``sdpa`` (F.scaled_dot_product_attention, causal), the baseline's layer.

Each (layer, implementation, T) runs in fresh subprocesses, so the peak memory is its own:
CUDA max allocated, or on CPU the peak RSS minus the RSS before the inputs existed,
measured in a second process with glibc's mmap threshold fixed at 1 MiB (every large
tensor is mapped and unmapped, so the RSS follows the live tensors instead of what
malloc's heap kept; that costs page faults, so the times come from the first process).
"Saved" is the bytes autograd keeps for backward (``saved_tensors_hooks``, each storage
counted once): noise cannot move it. Times are medians of ``--reps`` after one warm-up.
Ratios are against SDPA at the same T, from the same invocation.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchlib import kernel_tuning, layer_params, median_seconds, peak_rss_gb, ratio, run_child, sync, write_rows

ROOT = Path(__file__).resolve().parents[1]
H, D = 16, 96
LAYERS = ("kq_conv", "mixing")


def run_one(
    layer: str, impl: str, seq: int, device: str, dtype_name: str, reps: int, block_size: int, tuning=None
) -> dict:
    import torch
    import torch.nn.functional as F

    from mta_repro.model import attention_ops

    dev = torch.device(device)
    dtype = getattr(torch, dtype_name)
    rss0 = peak_rss_gb()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, seq, D, generator=g).to(dev, dtype).requires_grad_() for _ in range(3))
    if impl == "sdpa":

        def fwd():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        # the release's 6x11 kernels, the pre-softmax mixing exactly the identity
        p = layer_params(
            layer, H, (6, 11), dtype, dev, block_size, requires_grad=True, mixing="identity", tuning=tuning
        )

        def fwd():
            return attention_ops.attn_impl(impl).fn(q, k, v, p, attention_ops.AttnMask(), True)

    # Bytes saved for backward, each storage once (views of q/k/v are not new memory).
    storages: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fwd()
    inputs = {t.untyped_storage().data_ptr() for t in (q, k, v)}
    saved = sum(n for ptr, n in storages.items() if ptr not in inputs)
    saved_inputs = sum(n for ptr, n in storages.items() if ptr in inputs)
    out.backward(torch.ones_like(out))
    del out

    sync(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)

    def step():
        out = fwd()
        out.backward(torch.ones_like(out))

    median, times = median_seconds(step, reps, dev, warmup=0)
    peak = torch.cuda.max_memory_allocated(dev) / 1e9 if dev.type == "cuda" else peak_rss_gb() - rss0
    return {
        "layer": layer,
        "impl": impl,
        "seq": seq,
        "block_size": block_size,
        "s": median,
        "s_all": times,
        "peak_gb": peak,
        "saved_gb": saved / 1e9,
        "saved_inputs_gb": saved_inputs / 1e9,
    }


def profile(spec: str, device: str, dtype_name: str, block_size: int, tuning=None) -> None:
    import torch

    from mta_repro.model import attention_ops

    layer, impl, seq = spec.split(":")
    dev, dtype = torch.device(device), getattr(torch, dtype_name)
    q, k, v = (torch.randn(1, H, int(seq), D).to(dev, dtype).requires_grad_() for _ in range(3))
    p = layer_params(layer, H, (6, 11), dtype, dev, block_size, requires_grad=True, mixing="identity", tuning=tuning)
    out = attention_ops.attn_impl(impl).fn(q, k, v, p, attention_ops.AttnMask(), True)
    out.backward(torch.ones_like(out))
    acts = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if dev.type == "cuda" else []
    )
    with torch.profiler.profile(activities=acts) as prof:
        out = attention_ops.attn_impl(impl).fn(q, k, v, p, attention_ops.AttnMask(), True)
        out.backward(torch.ones_like(out))
    key = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=20))


def check(device: str, dtype_name: str, seq: int, impls: list[str], tuning=None) -> bool:
    """Each implementation against the float64 reference on the device (the inputs of the
    benchmark at length ``seq``): max error of the output and of the q/k/v and parameter
    gradients, relative to the reference's largest entry, beside the ``torch`` path's own
    error in the same dtype. Prints a table; True when every implementation is within 4x
    the reference's error (+1e-3)."""
    import torch

    from mta_repro.model import attention_ops
    from mta_repro.model.selfcheck import within_tolerance

    dev, dtype = torch.device(device), getattr(torch, dtype_name)
    ok = True
    print(f"| layer | impl | {dtype_name} output err | worst gradient err (rel. to max) | vs torch |")
    print("|---|---|---|---|---|")
    for layer in LAYERS:
        g = torch.Generator().manual_seed(0)
        base = [torch.randn(1, H, seq, D, generator=g, dtype=torch.float64) for _ in range(3)]
        gy = torch.randn(1, H, seq, D, generator=g, dtype=torch.float64)
        torch.manual_seed(0)
        p64 = layer_params(
            layer, H, (6, 11), torch.float64, dev, 128, requires_grad=True, mixing="identity", tuning=tuning
        )
        fields = [f for f in attention_ops.WEIGHT_FIELDS if getattr(p64, f) is not None]

        def run(impl, dt):
            q, k, v = (x.detach().to(dev, dt).requires_grad_() for x in base)
            ws = {
                f: getattr(p64, f).detach().to(torch.float32 if dt != torch.float64 else dt).requires_grad_()
                for f in fields
            }
            p = attention_ops.ExplicitAttnParams(**ws, pad_key="both", tuning=p64.tuning)
            out = attention_ops.attn_impl(impl).fn(q, k, v, p, attention_ops.AttnMask(), False)
            out.backward(gy.to(dev, dt))
            return out.double(), [t.grad.double() for t in (q, k, v, *ws.values())]

        want, want_g = run("torch", torch.float64)

        def err(impl):
            out, grads = run(impl, dtype)
            e_out = ((out - want).abs().max() / want.abs().max()).item()
            e_g = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(grads, want_g))
            return e_out, e_g

        ref = err("torch")
        for impl in impls:
            e = err(impl)
            good = all(within_tolerance(x, r) for x, r in zip(e, ref))  # the trainer's self-check rule
            ok &= good
            print(
                f"| {layer} | {impl} | {e[0]:.2e} | {e[1]:.2e} | {'ok' if good else 'FAIL'} "
                f"(torch: {ref[0]:.2e}, {ref[1]:.2e}) |"
            )
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="1024,2048,4096")
    ap.add_argument("--layers", default=",".join(LAYERS))
    ap.add_argument("--impls", default=None, help="comma list (default: every registered one)")
    ap.add_argument("--block-sizes", default="128", help="blocked path block sizes to compare")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None, help="also write the rows here")
    ap.add_argument("--profile", default=None, metavar="LAYER:IMPL:T")
    ap.add_argument(
        "--check",
        type=int,
        default=None,
        metavar="T",
        help="correctness on the device instead of timing: every implementation "
        "against the float64 reference at length T (exit 1 on a mismatch)",
    )
    ap.add_argument(
        "--kernels",
        default="",
        metavar="FIELD=VALUE,...",
        help="the kernels' tuning (model.kernels fields, docs/environment.md), e.g. kq_conv=conv2d",
    )
    ap.add_argument("--one", nargs=4, metavar=("LAYER", "IMPL", "T", "BLOCK"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    tuning = kernel_tuning(a.kernels.split(","))
    if a.profile:
        profile(a.profile, a.device, a.dtype, int(a.block_sizes.split(",")[0]), tuning)
        return
    if a.check:
        from mta_repro.model import attention_ops

        names = a.impls.split(",") if a.impls else [n for n in attention_ops.attn_impl_names() if n != "torch"]
        sys.exit(0 if check(a.device, a.dtype, a.check, names, tuning) else 1)
    if a.one:
        layer, impl, seq, bs = a.one
        print(json.dumps(run_one(layer, impl, int(seq), a.device, a.dtype, a.reps, int(bs), tuning)))
        return

    from mta_repro.model import attention_ops

    # triton runs on GPUs (on CPU only in its interpreter, far too slow to time)
    impls = (
        a.impls.split(",")
        if a.impls
        else [n for n in attention_ops.attn_impl_names() if n != "triton" or a.device.startswith("cuda")]
    )
    cases = []
    for seq in map(int, a.seqs.split(",")):
        cases.append(("sdpa", "sdpa", seq, 0))
        for layer in a.layers.split(","):
            for impl in impls:
                for bs in map(int, a.block_sizes.split(",")) if impl == "blocked" else [0]:
                    cases.append((layer, impl, seq, bs))
    rows = []
    for layer, impl, seq, bs in cases:
        cmd = [
            sys.executable,
            __file__,
            "--one",
            layer,
            impl,
            str(seq),
            str(bs or 128),
            "--device",
            a.device,
            "--dtype",
            a.dtype,
            "--kernels",
            a.kernels,
        ]
        peak_cmd = [*cmd, "--reps", "1"] if a.device == "cpu" else None
        r = run_child([*cmd, "--reps", str(a.reps)], ROOT, f"{layer}/{impl}/T={seq}", peak_cmd)
        if r is None:
            continue
        r["block_size"] = bs
        rows.append(r)
        print(
            f"  {layer:8s} {impl:8s} T={seq:5d} bs={bs:4d} {r['s']:8.3f} s  peak {r['peak_gb']:.2f} GB  "
            f"saved {r['saved_gb']:.3f} GB",
            file=sys.stderr,
            flush=True,
        )

    sdpa = {r["seq"]: r for r in rows if r["impl"] == "sdpa"}
    mem = "peak GB" + (" (RSS)" if a.device == "cpu" else "")
    print(f"\nOne layer, fwd+bwd, B=1, {H} heads of {D}, {a.device} {a.dtype}, median of {a.reps} after 1 warm-up\n")
    print(f"| layer | impl | block | T | time s | x SDPA | {mem} | x SDPA | saved GB (beyond q,k,v) |")
    print("|" + "---|" * 9)
    for r in rows:
        b = sdpa.get(r["seq"])
        print(
            f"| {r['layer']} | {r['impl']} | {r['block_size'] or '-'} | {r['seq']} | {r['s']:.3f} | "
            f"{ratio(r, b, 's')} | {r['peak_gb']:.2f} | {ratio(r, b, 'peak_gb')} | {r['saved_gb']:.3f} |"
        )
    write_rows(a.json, rows)


if __name__ == "__main__":
    main()
