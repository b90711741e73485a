"""Parameter and FLOP counts of a model, computed on the meta device (the command line that
composes a config and prints them: ``mta_repro.estimate.cli``)."""

from __future__ import annotations

from mta_repro.model import ModelArgs, build_model
from mta_repro.model.flops import hardware_flops_per_token, model_flops_per_token

SIZES = ("tiny", "300m", "550m", "880m", "1b")
VARIANTS = ("baseline", "diff", "talking_heads", "mta")


def count(args: ModelArgs, seq_len: int = 2048) -> dict:
    model = build_model(args, device="meta")
    # parameters() yields a tied weight once.
    total = sum(p.numel() for p in model.parameters())
    embedding = model.tok_embeddings.weight.numel()
    if not args.weight_tying:
        embedding += model.output.weight.numel()
    return {
        "total": total,
        "non_embedding": total - embedding,
        "model_flops_per_token": model_flops_per_token(args, seq_len),
        "hardware_flops_per_token": hardware_flops_per_token(args, seq_len),
        "seq_len": seq_len,
    }
