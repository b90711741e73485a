"""Measure one CPU training step's peak memory and set it beside the pre-flight estimate.

    python scripts/measure_memory.py model=300m attention=mta model.n_layers=2 \
        model.kq_conv_layers=1 data.seq_len=2048 data.batch_size=1

Each measurement runs in a fresh process: the model (fp32, as the trainer builds it on
CPU), AdamW, one forward + loss + backward + optimizer step on random tokens. Measured =
the process's peak resident memory (``ru_maxrss``) minus its resident memory just
before the model is built: what the step holds at its peak, with the allocator's
retained pages included (as a memory limit sees it). Estimated =
``mta_repro.memory.estimate`` for the same shapes at world size 1, without the FSDP
gathered-parameter term (a single CPU process gathers nothing). Prints one JSON line.
"""

from __future__ import annotations

import json
import resource
import sys


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def measure(overrides: list) -> dict:
    import torch

    from mta_repro.config import compose, model_args_from
    from mta_repro.memory import estimate
    from mta_repro.model import build_model

    cfg = compose(list(overrides))
    args = model_args_from(cfg)
    b, t = int(cfg.data.batch_size), int(cfg.data.seq_len)
    ac = bool(cfg.distributed.activation_checkpointing)
    est = estimate(args, b, t, 1, ac, torch.float32)
    parts = {k: v for k, v in est.parts.items() if not k.startswith("gathered parameters")}
    torch.manual_seed(0)
    tokens = torch.randint(0, args.vocab_size, (b, t + 1))
    base = _rss()
    model = build_model(args, device="cpu")
    if ac:
        from torch.utils.checkpoint import checkpoint

        for layer in model.layers:
            fwd = layer.forward
            layer.forward = lambda *a, _f=fwd, **k: checkpoint(_f, *a, use_reentrant=False, **k)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    del logits
    loss.backward()
    opt.step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"overrides": list(overrides), "measured_bytes": peak - base, "estimated_bytes": sum(parts.values()),
            "parts": parts}


if __name__ == "__main__":
    print(json.dumps(measure(sys.argv[1:])))
