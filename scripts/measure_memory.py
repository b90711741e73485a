"""Measure CPU training steps' peak memory and set it beside the pre-flight estimate.

    python scripts/measure_memory.py model=300m attention=mta model.n_layers=2 \
        model.kq_conv_layers=1 model.vocab_size=8192 data.seq_len=2048 data.batch_size=1
    python scripts/measure_memory.py --steps 3 --tensors ...   # also the live-tensor peak per phase

Each measurement runs in a fresh process: the model (fp32, as the trainer builds it on
CPU), AdamW, and ``--steps`` (default 2) steps of forward + loss + backward, gradient
clipping, optimizer step and ``zero_grad`` on random tokens, as ``train_step`` runs them
(without FSDP). Two steps, because the pre-flight is for a training run's steady state:
AdamW's moments exist from the first optimizer step on, so only later steps hold them
during forward and backward. ``trainer.cpu_mmap_threshold=131072`` fixes glibc's mmap
threshold first, as the trainer does with it (``mta_repro.estimate.cpu_malloc``); without it glibc's
dynamic default keeps freed tensors resident and the figure varies between runs.

Measured = the process's peak resident memory (``VmHWM``, its high-water mark reset just
before the model is built) minus its resident memory then: what the steps hold at their peak, allocator included (as
a memory limit sees it). With ``--tensors``, also the peak of live tensor bytes in each
phase of each step, from torch.profiler's allocation events (independent of the
allocator; the profiler's own memory shows in the RSS figure then). Estimated =
``mta_repro.estimate.memory.estimate_memory`` for the same shapes at world size 1 on CPU, without the FSDP
gathered-parameter term (a single process without FSDP gathers nothing); ``--fsdp`` runs
the trainer's FSDP2 wrapping on one gloo rank instead and keeps the term. Prints one JSON
line.
"""

from __future__ import annotations

import argparse
import json
import resource
import time

from mta_repro.train.metrics import peak_rss_bytes, reset_peak_rss


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _phase_peaks(prof) -> dict:
    """Peak live tensor bytes per ``record_function`` phase, from the allocation events."""
    from torch._C._profiler import _EventType

    allocs = []

    def walk(node, phase):
        if node.tag == _EventType.Allocation:
            allocs.append((node.start_time_ns, node.extra_fields.alloc_size, phase))
            return
        phase = node.name if node.name.startswith("step ") else phase
        for c in node.children:
            walk(c, phase)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root, "setup")
    live, peaks = 0, {}
    for _, n, phase in sorted(allocs, key=lambda a: a[0]):
        live += n
        peaks[phase] = max(peaks.get(phase, 0), live)
    return peaks


def measure(overrides: list, steps: int = 2, tensors: bool = False, fsdp: bool = False) -> dict:
    import contextlib

    import torch

    from mta_repro.estimate.cpu_malloc import fix_mmap_threshold
    from mta_repro.estimate.memory import estimate_memory
    from mta_repro.model import build_model
    from mta_repro.train.config import compose, model_args_from
    from mta_repro.train.loop import cross_entropy

    cfg = compose(list(overrides))
    threshold = fix_mmap_threshold(cfg.trainer.cpu_mmap_threshold)
    args = model_args_from(cfg)
    b, t = int(cfg.data.batch_size), int(cfg.data.seq_len)
    ac = bool(cfg.distributed.activation_checkpointing)
    est = estimate_memory(args, b, t, 1, ac, torch.float32, "cpu")
    parts = {k: v for k, v in est.parts.items() if not k.startswith("gathered parameters")}
    torch.manual_seed(0)
    tokens = torch.randint(0, args.vocab_size, (b, t + 1))
    if fsdp:  # the trainer's own path: a one-rank gloo group, FSDP2 (and its AC wrapper)
        from mta_repro.train.config import to_train_config
        from mta_repro.train.distributed import init_distributed, materialize, parallelize

        targs = to_train_config(cfg)
        info = init_distributed(targs.distributed, "cpu")
        parts = dict(est.parts)
    prof = None
    if tensors:
        from torch.profiler import ProfilerActivity, profile

        prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    phase = torch.profiler.record_function if tensors else (lambda name: contextlib.nullcontext())
    reset = reset_peak_rss()  # the peak is this process's own from here (ru_maxrss is not)
    base = _rss()
    seconds = []
    with prof or contextlib.nullcontext():
        if fsdp:
            model = build_model(args, device="meta")
            parallelize(model, info, targs.distributed)
            materialize(model, info, model_args=args)
        else:
            model = build_model(args, device="cpu")
        if ac and not fsdp:
            from torch.utils.checkpoint import checkpoint

            for layer in model.layers:
                fwd = layer.forward
                layer.forward = lambda *a, _f=fwd, **k: checkpoint(_f, *a, use_reentrant=False, **k)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for i in range(steps):
            t0 = time.perf_counter()
            with phase(f"step {i} forward"):
                loss = cross_entropy(model, tokens[:, :-1], tokens[:, 1:])
            with phase(f"step {i} backward"):
                loss.backward()
            with phase(f"step {i} optimizer"):
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
                opt.step()
                opt.zero_grad(set_to_none=True)
            del loss
            seconds.append(time.perf_counter() - t0)
    peak = peak_rss_bytes()
    out = {
        "overrides": list(overrides),
        "steps": steps,
        "fsdp": fsdp,
        "mmap_threshold": threshold,
        "measured_bytes": peak - base,
        "estimated_bytes": sum(parts.values()),
        "parts": parts,
        "details": est.details,
        "step_seconds": seconds,
        "peak_since_reset": reset,
    }  # False: VmHWM could not be reset, the peak is the process's life
    if prof is not None:
        out["tensor_peak_bytes"] = _phase_peaks(prof)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2, help="training steps (default 2: the second is steady state)")
    ap.add_argument("--tensors", action="store_true", help="also the live-tensor peak per phase (torch.profiler)")
    ap.add_argument(
        "--fsdp",
        action="store_true",
        help="the trainer's FSDP2 path on one gloo rank; the estimate then keeps its gathered-parameter term",
    )
    ns, overrides = ap.parse_known_args()
    print(json.dumps(measure(overrides, ns.steps, ns.tensors, ns.fsdp)))
