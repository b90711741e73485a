"""Training throughput and peak memory of every attention variant, side by side.

    python scripts/bench_train.py                       # tiny + mid, all variants, CPU
    python scripts/bench_train.py --configs mid --device cuda --steps 10

For each config and variant, a fresh subprocess builds the model, runs ``--warmup``
training steps (forward, cross entropy, backward, clip, AdamW) and then ``--steps``
timed ones; it reports the median step time as tokens/s and the peak memory of the
process (CUDA: max allocated; CPU: peak RSS, minus the RSS before the model existed).
Ratios are MTA (and the other variants) over the baseline of the same config.

Configs: ``tiny`` = configs/model/tiny.yaml at seq 256, batch 4; ``mid`` = dim 1024,
16 heads of 64 (the 300M's attention shape), 2 layers (layer 1 gets the key-query
convolutions), vocab 8192, at seq 2048, batch 1: the (B, H, T, T) cost of MTA at the
paper's sequence length, small enough for a CPU.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("baseline", "diff", "talking_heads", "mta")
CONFIGS = {
    "tiny": {"overrides": ["model=tiny"], "seq": 256, "batch": 4},
    "mid": {
        "overrides": ["model=tiny", "model.dim=1024", "model.n_heads=16", "model.n_layers=2",
                      "model.kq_conv_layers='1'"],
        "seq": 2048,
        "batch": 1,
    },
}


def _rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30


def run_one(config: str, variant: str, device: str, warmup: int, steps: int, threads: int) -> dict:
    import torch

    from mta_repro.config import compose, model_args_from
    from mta_repro.model import build_model
    from mta_repro.train.loop import cross_entropy
    from mta_repro.train.optim import OptimArgs, build_optimizer

    if threads:
        torch.set_num_threads(threads)
    spec = CONFIGS[config]
    args = model_args_from(compose([*spec["overrides"], f"attention={variant}"]))
    dev = torch.device(device)
    rss0 = _rss_gb()
    model = build_model(args, device=dev)
    n_params = sum(p.numel() for p in model.parameters())
    opt = build_optimizer(model, OptimArgs(lr=1e-4, warmup=0))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab_size, (spec["batch"], spec["seq"] + 1), generator=g).to(dev)
    x, y = tokens[:, :-1], tokens[:, 1:]
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else torch.autocast("cpu", enabled=False)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    times = []
    for i in range(warmup + steps):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        with amp:
            loss = cross_entropy(model, x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    step = statistics.median(times)
    peak = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else _rss_gb() - rss0
    return {"config": config, "variant": variant, "params": n_params, "step_s": step,
            "tokens_per_s": spec["batch"] * spec["seq"] / step, "peak_mem_gb": peak, "device": device}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="tiny,mid")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3, help="timed steps (median reported)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = default)")
    ap.add_argument("--json", default=None, help="also write the rows here")
    ap.add_argument("--one", nargs=2, metavar=("CONFIG", "VARIANT"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(run_one(*a.one, a.device, a.warmup, a.steps, a.threads)))
        return

    rows = []
    for config in a.configs.split(","):
        for variant in a.variants.split(","):
            cmd = [sys.executable, __file__, "--one", config, variant, "--device", a.device,
                   "--warmup", str(a.warmup), "--steps", str(a.steps), "--threads", str(a.threads)]
            p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            if p.returncode != 0:
                print(f"{config}/{variant} failed:\n{p.stderr[-2000:]}", file=sys.stderr)
                continue
            rows.append(json.loads(p.stdout.strip().splitlines()[-1]))
            r = rows[-1]
            print(f"  {config:5s} {variant:14s} {r['tokens_per_s']:10.1f} tok/s  {r['peak_mem_gb']:.2f} GB",
                  file=sys.stderr, flush=True)

    base = {r["config"]: r for r in rows if r["variant"] == "baseline"}
    mem_name = "peak mem GB" + (" (RSS)" if a.device == "cpu" else "")
    header = f"| config | variant | params | tokens/s | step ms | {mem_name} | tok/s vs baseline | mem vs baseline |"
    print(f"\nTraining step (fwd + CE + bwd + clip + AdamW), {a.device}, median of {a.steps} after {a.warmup} warm-up\n")
    print(header)
    print("|" + "---|" * 8)
    for r in rows:
        b = base.get(r["config"])
        tr = f"{r['tokens_per_s'] / b['tokens_per_s']:.2f}x" if b else "n/a"
        mr = f"{r['peak_mem_gb'] / b['peak_mem_gb']:.2f}x" if b and b["peak_mem_gb"] > 0 else "n/a"
        print(f"| {r['config']} | {r['variant']} | {r['params'] / 1e6:.2f}M | {r['tokens_per_s']:.0f} | "
              f"{r['step_s'] * 1e3:.0f} | {r['peak_mem_gb']:.2f} | {tr} | {mr} |")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
