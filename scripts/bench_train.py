"""Training throughput and peak memory of every attention variant, side by side.

    python scripts/bench_train.py                       # tiny + mid, all variants, CPU
    python scripts/bench_train.py --configs w880 --variants baseline,mta,llama_hf
    python scripts/bench_train.py --configs mid --device cuda --steps 10

For each config and variant, a fresh subprocess builds the model, runs ``--warmup``
training steps (forward, cross entropy, backward, clip, AdamW) and then ``--steps``
timed ones; it reports the median step time as tokens/s and the peak memory of the
process (CUDA: max allocated; CPU: peak RSS, minus the RSS before the model existed,
from a second process with glibc's mmap threshold fixed at 1 MiB, so that the RSS follows
the live tensors rather than what malloc's heap retained).
Ratios are MTA (and the other variants) over the baseline of the same config.

Configs: ``tiny`` = configs/model/tiny.yaml at seq 256, batch 4; ``mid`` = dim 1024,
16 heads of 64 (the 300M's attention shape), 2 layers (layer 1 gets the key-query
convolutions), vocab 8192, at seq 2048, batch 1: the (B, H, T, T) cost of MTA at the
paper's sequence length, small enough for a CPU. ``w880`` = the 880M width (dim 1536, 16
heads of 96, FFN 4096), 4 layers with layer 2 getting the key-query convolutions (6 of the
real model's 24 do), vocab 8192, seq 2048, batch 1.

Variant ``llama_hf`` is ``transformers``' LlamaForCausalLM of the config's baseline shape
(SDPA, tied embeddings), for comparing the baseline with what a user would otherwise pick
(needs ``pip install transformers``). "saved GB" is what autograd keeps for backward
(``saved_tensors_hooks``, each storage once): no noise moves it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from benchlib import peak_rss_gb, ratio, run_child, write_rows

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("baseline", "diff", "talking_heads", "mta")
CONFIGS = {
    "tiny": {"overrides": ["model=tiny"], "seq": 256, "batch": 4},
    "mid": {
        "overrides": [
            "model=tiny",
            "model.dim=1024",
            "model.n_heads=16",
            "model.n_layers=2",
            "model.kq_conv_layers='1'",
        ],
        "seq": 2048,
        "batch": 1,
    },
    "w880": {
        "overrides": [
            "model=tiny",
            "model.dim=1536",
            "model.n_heads=16",
            "model.n_layers=4",
            "model.kq_conv_layers='2'",
        ],
        "seq": 2048,
        "batch": 1,
    },
}


def _hf_llama(args, device):
    """LlamaForCausalLM with our baseline's shape (imported only for ``llama_hf``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.dim,
        intermediate_size=args.ffn_hidden_dim,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_heads,
        head_dim=args.resolved_head_dim,
        rms_norm_eps=args.norm_eps,
        rope_theta=args.rope_theta,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
        max_position_embeddings=args.max_seqlen,
    )
    return LlamaForCausalLM(cfg).to(device)


def run_one(config: str, variant: str, device: str, warmup: int, steps: int, threads: int) -> dict:
    import torch

    from mta_repro.model import build_model
    from mta_repro.train.config import compose, model_args_from
    from mta_repro.train.loop import cross_entropy
    from mta_repro.train.optim import OptimArgs, build_optimizer

    if threads:
        torch.set_num_threads(threads)
    spec = CONFIGS[config]
    hf = variant == "llama_hf"
    args = model_args_from(compose([*spec["overrides"], f"attention={'baseline' if hf else variant}"]))
    dev = torch.device(device)
    rss0 = peak_rss_gb()
    model = _hf_llama(args, dev) if hf else build_model(args, device=dev)
    n_params = sum(p.numel() for p in model.parameters())
    opt = build_optimizer(model, OptimArgs(lr=1e-4, warmup=0))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab_size, (spec["batch"], spec["seq"] + 1), generator=g).to(dev)
    x, y = tokens[:, :-1], tokens[:, 1:]
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else torch.autocast("cpu", enabled=False)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)

    def loss_fn():
        if hf:
            logits = model(input_ids=x).logits
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        return cross_entropy(model, x, y)

    storages: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    times = []
    for i in range(warmup + steps):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        if i == 0:  # count what autograd keeps for backward (not timed)
            with amp, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = loss_fn()
        else:
            with amp:
                loss = loss_fn()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    step = statistics.median(times)
    peak = torch.cuda.max_memory_allocated(dev) / 1e9 if dev.type == "cuda" else peak_rss_gb() - rss0
    saved = sum(n for ptr, n in storages.items() if ptr not in params) / 1e9
    return {
        "config": config,
        "variant": variant,
        "params": n_params,
        "step_s": step,
        "steps_s": times,
        "tokens_per_s": spec["batch"] * spec["seq"] / step,
        "peak_mem_gb": peak,
        "saved_gb": saved,
        "device": device,
    }


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
    ap.add_argument(
        "--profile",
        nargs=2,
        metavar=("CONFIG", "VARIANT"),
        help="print torch.profiler's table of one training step instead",
    )
    a = ap.parse_args()
    if a.profile:
        import torch

        with torch.profiler.profile() as prof:
            run_one(*a.profile, a.device, 1, 1, a.threads)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        return
    if a.one:
        print(json.dumps(run_one(*a.one, a.device, a.warmup, a.steps, a.threads)))
        return

    rows = []
    for config in a.configs.split(","):
        for variant in a.variants.split(","):
            cmd = [
                sys.executable,
                __file__,
                "--one",
                config,
                variant,
                "--device",
                a.device,
                "--warmup",
                str(a.warmup),
                "--steps",
                str(a.steps),
                "--threads",
                str(a.threads),
            ]
            peak_cmd = None
            if a.device == "cpu":  # one step is enough for the peak
                peak_cmd = [*cmd[: cmd.index("--steps") + 1], "1", "--threads", str(a.threads)]
            r = run_child(cmd, ROOT, f"{config}/{variant}", peak_cmd, peak_key="peak_mem_gb")
            if r is None:
                continue
            rows.append(r)
            print(
                f"  {config:5s} {variant:14s} {r['tokens_per_s']:10.1f} tok/s  {r['peak_mem_gb']:.2f} GB",
                file=sys.stderr,
                flush=True,
            )

    base = {r["config"]: r for r in rows if r["variant"] == "baseline"}
    mem_name = "peak mem GB" + (" (RSS)" if a.device == "cpu" else "")
    header = (
        f"| config | variant | params | tokens/s | step ms | {mem_name} | saved GB | step time vs baseline "
        "| mem vs baseline | saved vs baseline |"
    )
    print(
        f"\nTraining step (fwd + CE + bwd + clip + AdamW), {a.device}, median of {a.steps} after {a.warmup} warm-up\n"
    )
    print(header)
    print("|" + "---|" * 10)
    for r in rows:
        b = base.get(r["config"])
        print(
            f"| {r['config']} | {r['variant']} | {r['params'] / 1e6:.2f}M | {r['tokens_per_s']:.0f} | "
            f"{r['step_s'] * 1e3:.0f} | {r['peak_mem_gb']:.2f} | {r['saved_gb']:.2f} | {ratio(r, b, 'step_s', 'x')} | "
            f"{ratio(r, b, 'peak_mem_gb', 'x')} | {ratio(r, b, 'saved_gb', 'x')} |"
        )
    write_rows(a.json, rows)


if __name__ == "__main__":
    main()
