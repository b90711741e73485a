"""The first hour on a GPU, in one command: is every attention path right there, which is
fastest, what a step costs against the baseline, how much memory the full model takes,
and whether a save, a kill, a resume and a preemption work (docs/gpu.md reads the output).

    python scripts/gpu_acceptance.py                        # one GPU, about 10 min on an H200
    python scripts/gpu_acceptance.py --skip triton          # without the experimental fused kernels
    python scripts/gpu_acceptance.py --quick --device cpu   # the same code at toy shapes (CI)

Sections (the JSON's top-level keys, in run order):
  parity   every registered implementation (and ``blocked`` with ATen's convolution,
           ``blocked+conv2d``) against the float64 reference on the device, bf16 and fp32:
           max error of the output and of every gradient, relative to the reference's
           largest entry, beside the ``torch`` path's own error in that dtype; a row passes
           within 4x that error + 1e-3.
  layers   one attention layer fwd+bwd (kq_conv: the 880M MTA layer, 6x11 convolutions
           before and after softmax, wpsm, head conv; mixing: wpsm + head conv) against
           SDPA: B=4 x T=2048 and B=2 x T=4096, bf16, every implementation and block size;
           median seconds, ratio to SDPA, peak allocated memory.
  pick     per layer kind the fastest implementation that passed parity in bf16 (summed
           over the shapes), and the one override for a whole 880M MTA model (6 kq_conv +
           18 mixing layers): ``model.attn_impl=... model.attn_block_size=...``.
  step     a 4-layer 880M-width model (layer 2 with the key-query convolutions), B=4 x
           T=2048, bf16 autocast, AdamW, baseline vs MTA (with the pick), torch.compile off
           and on (per block, as ``distributed.compile=true``): tokens/s and the ratio.
  memory   the full 24-layer 880M MTA, B=4 x T=2048, through the trainer (world 1): peak
           allocated and reserved of the logged steps against ``python -m mta_repro.estimate
           ... --memory --world-size 1``.
  preempt  that same run gets SIGUSR2 after its third step: seconds from the signal to the
           checkpoint's ``.complete`` marker (must be far below the cluster's KillWait).
  resume   a debug-size run saves (DCP) every 2 steps and is killed (SIGKILL) after a
           save; resumed, its next losses must match an uninterrupted run's: exactly on CPU,
           within rel 2e-2 on CUDA (FlashAttention's and the Triton kernels' backwards use
           atomics and are not bitwise deterministic).

Writes ``<out>/<device>_<date>.json`` and ``.md`` (``--out``, default results/gpu/); the
Markdown ends with "Table 9", tokens/s and memory of baseline vs MTA laid out like the
paper's Table 9 (from the ``step`` section, so a 4-layer model on one device, not the
paper's full model on 32 H200s). ``--quick`` shrinks every shape (heads, length, model)
so the whole script runs in about a minute on a CPU; the code path is the same.
Exit status 1 when a parity row or the resume check fails.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

try:
    import mta_repro  # noqa: F401 - the package the acceptance runs, checked before anything starts
except ImportError:
    sys.exit(
        "gpu_acceptance.py: the mta_repro package is not importable; run it from the repository root "
        "as PYTHONPATH=. python scripts/gpu_acceptance.py (or pip install -e . first)"
    )

from benchlib import kernel_tuning, layer_params, sync  # noqa: E402 - after the check above

ROOT = Path(__file__).resolve().parents[1]

LAYERS = ("kq_conv", "mixing")


# --quick: the tiny model cut to 2 layers, one of them with the key-query convolution (the
# step, memory and resume sections; their trainer processes are mostly start-up anyway)
TINY2 = ["model=tiny", "model.n_layers=2", "model.kq_conv_layers='1'"]


def shapes(quick: bool) -> dict:
    if quick:
        return dict(
            heads=4,
            head_dim=16,
            parity_t=24,
            layer_shapes=[(2, 64)],
            blocks=[16, 32],
            reps=1,
            step=TINY2,
            step_bt=(2, 64),
            step_reps=2,
            full=TINY2,
            full_bt=(2, 64),
            debug=TINY2,
            debug_bt=(2, 32),
            kernel=(3, 5),
        )
    return dict(
        heads=16,
        head_dim=96,
        parity_t=512,
        layer_shapes=[(4, 2048), (2, 4096)],
        blocks=[128, 256, 512, 1024],
        reps=3,
        step=["model=tiny", "model.dim=1536", "model.n_heads=16", "model.n_layers=4", "model.kq_conv_layers='2'"],
        step_bt=(4, 2048),
        step_reps=5,
        full=["model=880m"],
        full_bt=(4, 2048),
        debug=["model=tiny"],
        debug_bt=(4, 256),
        kernel=(6, 11),
    )


# ------------------------------------------------------------------ parity and layers
def implementations(skip: set) -> list[str]:
    """Every implementation ``model.attn_impl`` may name (but the reference; the experimental
    ``triton`` too, loaded by name), ``blocked+conv2d`` among them: blocked with F.conv2d for
    the key-query convolutions (ATen's native depthwise kernel on CUDA), to show what the
    Triton convolution of the default route gains."""
    from mta_repro.model import attention_ops

    names = [n for n in attention_ops.attn_impl_names() if n != "torch"]
    return [n for n in names if n not in skip]


def call_impl(name: str, q, k, v, p, training: bool, knob: str = ""):
    """Run implementation ``name`` under ``knob`` (``knob_tuning``); None when it declines
    these tensors. The tuning travels in the params, so ``blocked``'s recomputing backward
    runs the same."""
    import dataclasses

    from mta_repro.model import attention_ops

    p = dataclasses.replace(p, tuning=knob_tuning(knob, p.tuning))
    entry = attention_ops.attn_impl(name)
    if entry.supports is not None and entry.supports(q, p, attention_ops.AttnMask()) is not None:
        return None
    return entry.fn(q, k, v, p, attention_ops.AttnMask(), training)


# The fused kernel's autotune space on a GPU (docs/environment.md, the tuning table): the
# frame of every pass and the head-mixing slab rows, each timed under its config override;
# the pick adds the fastest to the override to train with. The static estimate chose the
# defaults (the empty setting); only a GPU can tell. Opt-in (--sweep-triton): each setting is a
# first compile of every pass, and the acceptance run itself should fit one 10-minute call.
TRITON_KNOBS = (
    "",
    "+model.kernels.impl_options.triton.frame=128x64",
    "+model.kernels.impl_options.triton.frame=128x128",
    "+model.kernels.impl_options.triton.slab_rows=2",
)


def knob_tuning(knob: str, base=None):
    """``base`` (a KernelTuning; None: the defaults) with one ``model.kernels.FIELD=VALUE`` (or
    ``+model.kernels.impl_options.IMPL.OPTION=VALUE``) override applied (nothing for ""), the
    value read as YAML as the command line would."""
    return kernel_tuning([knob], base)


def parity(dev, s, impls, dtypes) -> list[dict]:
    from mta_repro.model import attention_ops
    from mta_repro.model.selfcheck import within_tolerance

    rows = []
    H, D, T = s["heads"], s["head_dim"], s["parity_t"]
    for layer in LAYERS:
        g = torch.Generator().manual_seed(1)
        base = [torch.randn(1, H, T, D, generator=g, dtype=torch.float64) for _ in range(3)]
        gy = torch.randn(1, H, T, D, generator=g, dtype=torch.float64)
        p64 = layer_params(layer, H, s["kernel"], torch.float64, dev, 128)
        fields = [f for f in attention_ops.WEIGHT_FIELDS if getattr(p64, f) is not None]

        def run(impl, dtype):
            q, k, v = (x.detach().to(dev, dtype).clone().requires_grad_() for x in base)
            ws = {
                f: getattr(p64, f)
                .detach()
                .to(torch.float64 if dtype == torch.float64 else torch.float32)
                .clone()
                .requires_grad_()
                for f in fields
            }
            p = attention_ops.ExplicitAttnParams(**ws, pad_key="both", block_size=max(16, T // 4))
            out = (
                attention_ops.explicit_attention_torch(q, k, v, p, attention_ops.AttnMask())
                if impl == "torch"
                else call_impl(impl, q, k, v, p, False)
            )
            if out is None:
                return None
            out.backward(gy.to(dev, dtype))
            return out.double(), [t.grad.double() for t in (q, k, v, *ws.values())]

        want, want_g = run("torch", torch.float64)

        def err(impl, dtype):
            r = run(impl, dtype)
            if r is None:
                return None
            out, grads = r
            scale = lambda t: t.abs().max().clamp_min(1e-30)  # noqa: E731
            return (
                ((out - want).abs().max() / scale(want)).item(),
                max(((a - b).abs().max() / scale(b)).item() for a, b in zip(grads, want_g)),
            )

        for dtype in dtypes:
            ref = err("torch", dtype)
            for impl in impls:
                e = err(impl, dtype)
                row = {"layer": layer, "impl": impl, "dtype": str(dtype).split(".")[-1], "T": T, "torch_err": list(ref)}
                if e is None:
                    row.update(status="unsupported")
                else:
                    good = all(within_tolerance(x, r) for x, r in zip(e, ref))
                    row.update(out_err=e[0], grad_err=e[1], status="ok" if good else "FAIL")
                rows.append(row)
                print(
                    f"  parity {layer:8s} {impl:15s} {row['dtype']:9s} {row['status']}"
                    + (f" out {e[0]:.1e} grad {e[1]:.1e} (torch {ref[0]:.1e} {ref[1]:.1e})" if e else ""),
                    flush=True,
                )
    return rows


def fallbacks(rows: list[dict], impls: list[str], dtype: str) -> dict[str, str]:
    """{implementation with a FAIL row in ``dtype``: what the trainer's self-check would run
    instead}: the next of its chain (mta_repro/model/selfcheck.py) whose rows all passed
    here (``torch``, the reference, always runs)."""
    from mta_repro.model.selfcheck import next_impl

    def passed(name: str) -> bool:
        mine = [r for r in rows if r["impl"] == name and r["dtype"] == dtype]
        return name == "torch" or (name in impls and bool(mine) and all(r["status"] == "ok" for r in mine))

    out = {}
    for impl in impls:
        if any(r["impl"] == impl and r["dtype"] == dtype and r["status"] == "FAIL" for r in rows):
            to = next_impl(impl)
            while not passed(to):
                to = next_impl(to)
            out[impl] = to
    return out


def time_layer(dev, s, layer, impl, B, T, block, dtype, knob: str = "") -> dict:
    H, D = s["heads"], s["head_dim"]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, generator=g).to(dev, dtype).requires_grad_() for _ in range(3))
    if impl == "sdpa":
        fwd = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    else:
        p = layer_params(layer, H, s["kernel"], dtype, dev, block)
        for f in ("mta_kernel", "wpsm", "mta_kernel_after_sm", "head_kernel"):
            if getattr(p, f) is not None:
                getattr(p, f).requires_grad_()
        fwd = lambda: call_impl(impl, q, k, v, p, True, knob)  # noqa: E731
    row = {
        "layer": layer if impl != "sdpa" else "sdpa",
        "impl": impl,
        "B": B,
        "T": T,
        "block_size": block if impl.startswith("blocked") else None,
        "knob": knob,
    }
    try:
        return _time(dev, s, fwd, row)
    except torch.OutOfMemoryError:
        return {**row, "status": "oom"}


def _time(dev, s, fwd, row) -> dict:
    out = fwd()
    if out is None:
        return {**row, "status": "unsupported"}
    out.backward(torch.ones_like(out))  # warm-up: JIT, autotune, allocator
    del out
    sync(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    times = []
    for _ in range(s["reps"]):
        sync(dev)
        t0 = time.perf_counter()
        out = fwd()
        out.backward(torch.ones_like(out))
        sync(dev)
        times.append(time.perf_counter() - t0)
        del out
    peak = torch.cuda.max_memory_allocated(dev) / 1e9 if dev.type == "cuda" else None
    return {**row, "status": "ok", "s": statistics.median(times), "s_all": times, "peak_alloc_gb": peak}


def layers(dev, s, impls, dtype, sweep_triton: bool = False) -> list[dict]:
    rows = []
    for B, T in s["layer_shapes"]:
        base = time_layer(dev, s, "sdpa", "sdpa", B, T, 0, dtype)
        rows.append(base)
        for layer in LAYERS:
            for impl in impls:
                blocks = s["blocks"] if impl.startswith("blocked") else [None]
                if impl == "blocked+conv2d":
                    blocks = blocks[:1] if dev.type == "cuda" else blocks[:1]  # the comparison, not a sweep
                knobs = TRITON_KNOBS if impl == "triton" and dev.type == "cuda" and sweep_triton else ("",)
                for bs, knob in ((b_, k_) for b_ in blocks for k_ in knobs):
                    r = time_layer(dev, s, layer, impl, B, T, bs or 128, dtype, knob)
                    if r["status"] == "ok" and base.get("s"):
                        r["x_sdpa"] = r["s"] / base["s"]
                    rows.append(r)
                    print(
                        f"  layer {layer:8s} {impl:15s} B={B} T={T} block={bs} {knob} {r['status']} "
                        + (f"{r['s']:.4f} s ({r.get('x_sdpa', 0):.1f}x SDPA)" if r["status"] == "ok" else ""),
                        flush=True,
                    )
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def pick(parity_rows, layer_rows, dtype_name) -> dict:
    passed = {(r["layer"], r["impl"]) for r in parity_rows if r["dtype"] == dtype_name and r["status"] == "ok"}
    passed |= {(layer, "torch") for layer in LAYERS}  # the reference itself
    shapes_n = len({(r["B"], r["T"]) for r in layer_rows})
    best = {}
    totals: dict = {}
    for r in layer_rows:
        if r["status"] != "ok" or r["impl"] == "sdpa" or (r["layer"], r["impl"]) not in passed:
            continue
        key = (r["layer"], r["impl"], r["block_size"], r.get("knob", ""))
        totals.setdefault(key, []).append(r["s"])
    for (layer, impl, bs, knob), ts in totals.items():
        if len(ts) < shapes_n:
            continue  # failed (OOM) at some shape
        if layer not in best or sum(ts) < best[layer]["s_total"]:
            best[layer] = {"impl": impl, "block_size": bs, "knob": knob, "s_total": sum(ts)}
    # One model-wide choice (model.attn_impl is per model): 6 kq_conv + 18 mixing layers.
    weight = {"kq_conv": 6, "mixing": 18}
    model_cost: dict = {}
    for (layer, impl, bs, knob), ts in totals.items():
        if len(ts) == shapes_n:
            model_cost.setdefault((impl, bs, knob), {})[layer] = sum(ts)
    whole = [(sum(weight[l] * t for l, t in c.items()), k) for k, c in model_cost.items() if len(c) == len(LAYERS)]
    out = {"per_layer": best}
    if whole:
        cost, (impl, bs, knob) = min(whole)
        base = impl.partition("+")[0]
        ov = [f"model.attn_impl={base}"] + ([f"model.attn_block_size={bs}"] if bs else [])
        ov += (["model.kernels.kq_conv=conv2d"] if impl.endswith("+conv2d") else []) + ([knob] if knob else [])
        out.update(
            model={"impl": impl, "block_size": bs, "knob": knob, "attention_s_per_step_estimate": cost},
            override=" ".join(ov),
        )
        print(f"  pick: {' '.join(ov)}", flush=True)
    return out


# ---------------------------------------------------------------------------- step
def step_bench(dev, s, variant, compiled, picked, dtype) -> dict:
    from mta_repro.model import build_model
    from mta_repro.train.config import compose, model_args_from
    from mta_repro.train.optim import OptimArgs, build_optimizer

    over = [*s["step"], f"attention={variant}", f"trainer.device={dev.type}"]
    if variant != "baseline" and picked.get("override"):
        over += picked["override"].split()
    args = model_args_from(compose(over))
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_model(args, device=dev)
    if compiled:
        for block in model.layers:  # per block, as distributed.compile=true does
            block.compile()
    opt = build_optimizer(model, OptimArgs(lr=1e-4, warmup=0))
    B, T = s["step_bt"]
    tokens = torch.randint(0, args.vocab_size, (B, T + 1), generator=torch.Generator().manual_seed(0)).to(dev)
    x, y = tokens[:, :-1], tokens[:, 1:]
    amp = torch.autocast("cuda", dtype=dtype) if dev.type == "cuda" else torch.autocast("cpu", enabled=False)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    times, first = [], None
    for i in range(1 + s["step_reps"]):
        sync(dev)
        t0 = time.perf_counter()
        with amp:
            loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(dev)
        if i == 0:
            first = time.perf_counter() - t0  # includes compile / JIT
        else:
            times.append(time.perf_counter() - t0)
    st = statistics.median(times)
    row = {
        "variant": variant,
        "compile": compiled,
        "B": B,
        "T": T,
        "layers": args.n_layers,
        "attn_impl": args.attn_impl,
        "attn_block_size": args.attn_block_size,
        "first_step_s": first,
        "step_s": st,
        "tokens_per_s": B * T / st,
        "loss": loss.item(),
    }
    if dev.type == "cuda":
        row.update(
            peak_alloc_gb=torch.cuda.max_memory_allocated(dev) / 1e9,
            peak_reserved_gb=torch.cuda.max_memory_reserved(dev) / 1e9,
        )
    del model, opt
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    print(
        f"  step {variant:8s} compile={compiled!s:5s} {row['tokens_per_s']:.0f} tok/s (first step {first:.1f} s)",
        flush=True,
    )
    return row


def step_section(dev, s, picked, compile_modes, dtype) -> dict:
    rows = [step_bench(dev, s, v, c, picked, dtype) for c in compile_modes for v in ("baseline", "mta")]
    ratios = {}
    for c in compile_modes:
        b = next(r for r in rows if r["variant"] == "baseline" and r["compile"] == c)
        m = next(r for r in rows if r["variant"] == "mta" and r["compile"] == c)
        ratios[f"compile={c}"] = {
            "time_x": b["tokens_per_s"] / m["tokens_per_s"],
            "memory_x": (m.get("peak_reserved_gb") or 0) / b["peak_reserved_gb"] if b.get("peak_reserved_gb") else None,
        }
    return {"rows": rows, "mta_over_baseline": ratios}


# ------------------------------------------------------------- trainer runs (subprocess)
def trainer_cmd(run_dir, over):
    return [sys.executable, "-m", "mta_repro.train", f"run_dir={run_dir}", *over]


TRAIN_COMMON = [
    "data=mini",
    "logging.every=1",
    "logging.wandb_mode=disabled",
    "logging.progress_bar=false",
    "trainer.eval_every=0",
    "checkpoint.export=false",
    "optim.warmup=2",
    "optim.lr=1e-3",
]


def _env():
    return dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _rows(run_dir) -> dict:
    path = Path(run_dir) / "metrics.jsonl"
    out = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            out[r["step"]] = r
    return out


def signalled_run(run_dir, over, after_step: int, sig, kill_after_save: bool, timeout: float) -> dict:
    """Start the trainer; once ``after_step`` steps are logged, send ``sig``; time until the
    stopped step's checkpoint is complete; with ``kill_after_save``, SIGKILL right then (as
    SLURM does after KillWait), else let it exit."""
    proc = subprocess.Popen(
        trainer_cmd(run_dir, over), cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    ckpts = Path(run_dir) / "checkpoints"
    t_sig = latency = None
    deadline = time.time() + timeout
    with tempfile.TemporaryFile("w+") as log:
        import threading

        pump = threading.Thread(target=lambda: [log.write(l) for l in proc.stdout], daemon=True)
        pump.start()
        before = set()
        while time.time() < deadline and proc.poll() is None:
            if t_sig is None and len(_rows(run_dir)) >= after_step:
                before = {c.name for c in ckpts.iterdir() if (c / ".complete").exists()} if ckpts.is_dir() else set()
                proc.send_signal(sig)
                t_sig = time.perf_counter()
            if t_sig is not None and ckpts.is_dir():
                new = [c for c in ckpts.iterdir() if (c / ".complete").exists() and c.name not in before]
                if new:
                    latency = time.perf_counter() - t_sig
                    if kill_after_save:
                        proc.kill()
                    break
            time.sleep(0.01)
        if proc.poll() is None and not kill_after_save:
            proc.wait(timeout=max(1.0, deadline - time.time()))
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        pump.join(timeout=5)
        log.seek(0)
        tail = log.read()[-3000:]
    done = sorted(c.name for c in ckpts.iterdir() if (c / ".complete").exists()) if ckpts.is_dir() else []
    return {
        "signal_after_step": after_step,
        "latency_s": latency,
        "returncode": proc.returncode,
        "complete_checkpoints": done,
        "rows": _rows(run_dir),
        "log_tail": tail,
    }


def memory_and_preempt(dev, s, picked, out_dir) -> tuple[dict, dict]:
    from mta_repro.estimate.memory import estimate_from_config
    from mta_repro.train.config import compose

    B, T = s["full_bt"]
    over = [
        *TRAIN_COMMON,
        *s["full"],
        "attention=mta",
        f"trainer.device={dev.type}",
        f"data.batch_size={B}",
        f"data.seq_len={T}",
        "trainer.steps=8",
        "checkpoint.every=1000",
    ]
    if picked.get("override"):
        over += picked["override"].split()
    est = estimate_from_config(compose(over), world_size=1)
    run_dir = Path(out_dir) / "full_run"
    r = signalled_run(run_dir, over, 3, signal.SIGUSR2, False, timeout=900)
    rows = [v for k, v in sorted(r["rows"].items())]
    alloc = max((x["peak_mem_gb"] for x in rows), default=None)
    reserved = max((x.get("peak_mem_reserved_gb") or 0 for x in rows), default=None) if dev.type == "cuda" else None
    memory = {
        "model": " ".join(s["full"]) + " attention=mta",
        "B": B,
        "T": T,
        "steps_logged": len(rows),
        "peak_alloc_gb": alloc,
        "peak_reserved_gb": reserved,
        "estimate_gb": est.total / 1e9,
        # the pre-flight is the peak of a steady-state step's tensors: compare with allocated
        "estimate_over_alloc": est.total / 1e9 / alloc if alloc else None,
        "estimate_note": "python -m mta_repro.estimate ... --memory --world-size 1 (CPU: peak RSS is measured)",
        "tokens_per_s": [x["tokens_per_s_global"] for x in rows],
    }
    preempt = {
        "signal": "SIGUSR2",
        "after_step": 3,
        "signal_to_complete_s": r["latency_s"],
        "returncode": r["returncode"],
        "checkpoints": r["complete_checkpoints"],
        # stopped by the signal after its checkpoint: 128 + SIGUSR2, the unfinished run's status
        "ok": r["latency_s"] is not None and r["returncode"] == 128 + signal.SIGUSR2,
    }
    if not preempt["ok"]:
        preempt["log_tail"] = r["log_tail"]
    return memory, preempt


def resume_check(dev, s, out_dir) -> dict:
    B, T = s["debug_bt"]
    steps = 8
    over = [
        *TRAIN_COMMON,
        *s["debug"],
        "attention=mta",
        f"trainer.device={dev.type}",
        f"data.batch_size={B}",
        f"data.seq_len={T}",
        f"trainer.steps={steps}",
        "checkpoint.every=2",
        "checkpoint.keep=2",
    ]
    ref_dir, run_dir = Path(out_dir) / "resume_ref", Path(out_dir) / "resume_run"
    p = subprocess.run(trainer_cmd(ref_dir, over), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        return {"ok": False, "error": "reference run failed", "log_tail": p.stderr[-3000:]}
    # Killed right after the save its SIGUSR2 asked for: the next run must resume there.
    killed = signalled_run(run_dir, over, 3, signal.SIGUSR2, True, timeout=900)
    if not killed["complete_checkpoints"]:
        return {"ok": False, "error": "no complete checkpoint before the kill", "log_tail": killed["log_tail"]}
    resumed_at = int(killed["complete_checkpoints"][-1])
    p = subprocess.run(trainer_cmd(run_dir, over), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    ref, got = _rows(ref_dir), _rows(run_dir)
    tol = 0.0 if dev.type == "cpu" else 2e-2
    compared = {k: (got[k]["loss"], ref[k]["loss"]) for k in range(resumed_at + 1, steps + 1) if k in got and k in ref}
    worst = max((abs(a - b) / abs(b) for a, b in compared.values()), default=None)
    ok = p.returncode == 0 and len(compared) == steps - resumed_at and worst is not None and worst <= tol
    out = {
        "killed_after_checkpoint": resumed_at,
        "steps_compared": sorted(compared),
        "losses": {k: {"resumed": a, "uninterrupted": b} for k, (a, b) in compared.items()},
        "max_rel_diff": worst,
        "tolerance": tol,
        "ok": ok,
    }
    if not ok:
        out["log_tail"] = p.stderr[-3000:]
    return out


# -------------------------------------------------------------------------- report
def markdown(res: dict) -> str:
    L = [
        f"# GPU acceptance: {res['device']['name']}",
        "",
        f"{res['date']}, torch {res['device']['torch']}, {'quick (toy shapes)' if res['quick'] else 'full'}",
        "",
    ]
    L += [
        "## Parity (relative max error vs float64)",
        "",
        "| layer | impl | dtype | output | gradients | torch's own | status |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in res["parity"]:
        L.append(
            f"| {r['layer']} | {r['impl']} | {r['dtype']} | {r.get('out_err', float('nan')):.1e} | "
            f"{r.get('grad_err', float('nan')):.1e} | {r['torch_err'][0]:.1e} / {r['torch_err'][1]:.1e} | "
            f"{r['status']} |"
        )
    L += [
        "",
        "## One layer, fwd+bwd",
        "",
        "| layer | impl | block / knob | B x T | s | x SDPA | peak alloc GB |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in res["layers"]:
        s = f"{r['s']:.4f}" if r.get("s") is not None else r["status"]
        pk = f"{r['peak_alloc_gb']:.2f}" if r.get("peak_alloc_gb") is not None else "-"
        L.append(
            f"| {r['layer']} | {r['impl']} | {r['block_size'] or r.get('knob') or '-'} | {r['B']} x {r['T']} | {s} | "
            f"{r.get('x_sdpa', 1.0 if r['impl'] == 'sdpa' else float('nan')):.1f} | {pk} |"
        )
    pk = res["pick"]
    L += ["", "## Pick", "", f"Override for an 880M MTA model: `{pk.get('override', '(none passed)')}`", ""]
    for layer, b in pk.get("per_layer", {}).items():
        L.append(
            f"- {layer}: {b['impl']} (block {b['block_size']}{', ' + b['knob'] if b.get('knob') else ''}), "
            f"{b['s_total']:.4f} s summed over shapes"
        )
    L += [
        "",
        "## Step (tokens/s)",
        "",
        "| variant | compile | layers | B x T | impl | tok/s | first step s | peak reserved GB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in res["step"]["rows"]:
        pr = f"{r['peak_reserved_gb']:.2f}" if r.get("peak_reserved_gb") is not None else "-"
        L.append(
            f"| {r['variant']} | {r['compile']} | {r['layers']} | {r['B']} x {r['T']} | "
            f"{r['attn_impl']}/{r['attn_block_size']} | "
            f"{r['tokens_per_s']:.0f} | {r['first_step_s']:.1f} | {pr} |"
        )
    m = res["memory"]
    fmt = lambda x: f"{x:.2f}" if isinstance(x, (int, float)) else "-"  # noqa: E731
    L += [
        "",
        "## Memory (full model, trainer, world 1)",
        "",
        f"{m['model']}, B={m['B']} x T={m['T']}: peak allocated {fmt(m['peak_alloc_gb'])} GB, reserved "
        f"{fmt(m['peak_reserved_gb'])} GB; estimate {fmt(m['estimate_gb'])} GB, "
        f"{fmt(m.get('estimate_over_alloc'))}x allocated ({m['estimate_note']}).",
    ]
    p = res["preempt"]
    L += [
        "",
        "## Preemption",
        "",
        f"SIGUSR2 after step {p['after_step']} -> checkpoint complete in "
        f"{fmt(p['signal_to_complete_s'])} s ({'ok' if p['ok'] else 'FAILED'}); compare with the cluster's KillWait.",
    ]
    r = res["resume"]
    L += [
        "",
        "## Save, kill, resume",
        "",
        f"Killed after checkpoint {r.get('killed_after_checkpoint')}; steps "
        f"{r.get('steps_compared')} max relative loss difference {fmt(r.get('max_rel_diff'))} (tolerance "
        f"{r.get('tolerance')}): {'ok' if r['ok'] else 'FAILED'}.",
    ]
    # Table 9 of the paper: tokens/s and memory, Transformer vs MTA, and MTA's ratio.
    rows = res["step"]["rows"]
    comp = max((r["compile"] for r in rows), default=False)
    pick_rows = {r["variant"]: r for r in rows if r["compile"] == comp}
    b, mt = pick_rows.get("baseline"), pick_rows.get("mta")
    L += [
        "",
        "## Table 9",
        "",
        f"Training cost, Transformer vs MTA ({b['layers'] if b else '?'}-layer "
        f"{'toy (--quick)' if res['quick'] else '880M-width'} model, B={b['B'] if b else '?'} x "
        f"T={b['T'] if b else '?'}, one {res['device']['name']}, compile={comp}; the paper's Table 9 is the full "
        "model on 32 H200s).",
        "",
        "| Model | Tokens/s | Memory (GB) |",
        "|---|---|---|",
    ]
    for name, r in (("Transformer", b), ("MTA", mt)):
        if r:
            L.append(f"| {name} | {r['tokens_per_s']:.0f} | {fmt(r.get('peak_reserved_gb'))} |")
    if b and mt:
        mem = f"{mt['peak_reserved_gb'] / b['peak_reserved_gb']:.2f}x" if b.get("peak_reserved_gb") else "-"
        L.append(f"| MTA / Transformer | {b['tokens_per_s'] / mt['tokens_per_s']:.2f}x slower | {mem} |")
        if not b.get("peak_reserved_gb"):
            L += ["", "(Memory: CUDA reserved peak; not measured on CPU.)"]
    return "\n".join(L) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="toy shapes (CI); the same code path")
    ap.add_argument("--out", default="results/gpu")
    ap.add_argument("--skip", default="", help="comma list of implementations to leave out (e.g. triton)")
    ap.add_argument(
        "--sweep-triton",
        action="store_true",
        help="also time the fused kernel under each setting of TRITON_KNOBS (CUDA; ~20 more layer "
        "timings, each a first compile: several minutes)",
    )
    ap.add_argument(
        "--compile",
        default=None,
        choices=["off", "on", "both"],
        help="step section: torch.compile off, on or both (default: both; --quick: off)",
    )
    ap.add_argument(
        "--sections",
        default="parity,layers,step,memory,resume",
        help="comma list to run (memory includes preempt); the rest are recorded as skipped",
    )
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("gpu_acceptance: --device cuda but torch sees no CUDA device (use --device cpu --quick)", file=sys.stderr)
        return 2
    s = shapes(a.quick)
    compile_modes = {"off": [False], "on": [True], "both": [False, True]}[a.compile or ("off" if a.quick else "both")]
    sections = set(a.sections.split(","))
    impls = implementations(set(filter(None, a.skip.split(","))))
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    date = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{name.replace(' ', '_')}_{date}"
    work = out_dir / f"{stem}_runs"
    res = {
        "device": {
            "name": name,
            "type": dev.type,
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "kq_conv_backend": None,
        },
        "date": date,
        "quick": a.quick,
        "shapes": {k: v for k, v in s.items()},
    }
    from mta_repro.model import attention_ops

    probe = torch.zeros(1, device=dev, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32)
    res["device"]["kq_conv_backend"] = attention_ops.kq_conv_backend(probe)
    skipped = {"status": "skipped"}
    t0 = time.time()
    json_path, md_path = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    res["completed"] = []

    def done(section: str) -> None:
        """The JSON as it stands, written (atomically) the moment a section ends: a command
        killed at its time limit still leaves everything measured before."""
        from mta_repro.files import replace_atomically

        if section in sections:
            res["completed"].append(section)
        res["seconds"] = time.time() - t0
        replace_atomically(json_path, json.dumps(res, indent=1, default=str).encode())

    dtypes = [torch.bfloat16, torch.float32]
    print("parity", flush=True)
    res["parity"] = parity(dev, s, impls, dtypes) if "parity" in sections else []
    res["fallbacks"] = fallbacks(res["parity"], impls, "bfloat16" if dev.type == "cuda" else "float32")
    for impl, to in res["fallbacks"].items():
        print(
            f"  parity FAIL: {impl}; the trainer's self-check (model.attn_selfcheck=warn) would fall back to "
            f"{to}: model.attn_impl={to.partition('+')[0]}"
            + (f" model.kernels.kq_conv={to.partition('+')[2]}" if "+" in to else ""),
            flush=True,
        )
    done("parity")
    print("layers", flush=True)
    res["layers"] = layers(dev, s, ["torch", *impls], torch.bfloat16, a.sweep_triton) if "layers" in sections else []
    res["pick"] = pick(res["parity"], res["layers"], "bfloat16")
    done("layers")
    print("step", flush=True)
    res["step"] = (
        step_section(dev, s, res["pick"], compile_modes, torch.bfloat16)
        if "step" in sections
        else {"rows": [], "mta_over_baseline": {}}
    )
    done("step")
    print("memory + preempt", flush=True)
    if "memory" in sections:
        res["memory"], res["preempt"] = memory_and_preempt(dev, s, res["pick"], work)
    else:
        res["memory"], res["preempt"] = dict(skipped), dict(skipped)
    done("memory")
    print("resume", flush=True)
    res["resume"] = resume_check(dev, s, work) if "resume" in sections else dict(skipped)
    done("resume")
    try:
        md_path.write_text(markdown(res))
    except (KeyError, TypeError) as e:  # a skipped section: the JSON says what ran
        md_path.write_text(f"# GPU acceptance: {name}\n\n(Markdown incomplete: {e!r}; see {json_path.name})\n")
    print(f"wrote {json_path} and {md_path} ({res['seconds']:.0f} s)")
    bad = [r for r in res["parity"] if r["status"] == "FAIL"]
    resume_bad = isinstance(res["resume"], dict) and res["resume"].get("ok") is False
    return 1 if bad or resume_bad else 0


if __name__ == "__main__":
    sys.exit(main())
