"""Build every attention variant of the tiny config and run one forward/backward."""

import time

import torch

from mta_repro.config import compose, model_args_from
from mta_repro.model import build_model

torch.manual_seed(0)
print(f"| variant | params | loss | fwd+bwd s (B=2, T=256) |")
print("|---|---:|---:|---:|")
for variant in ("baseline", "diff", "talking_heads", "mta"):
    args = model_args_from(compose(["model=tiny", f"attention={variant}"]))
    model = build_model(args)
    tokens = torch.randint(0, args.vocab_size, (2, 257))
    t0 = time.perf_counter()
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    n = sum(p.numel() for p in model.parameters())
    print(f"| {variant} | {n:,} | {loss.item():.3f} | {time.perf_counter() - t0:.2f} |")
