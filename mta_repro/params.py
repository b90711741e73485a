"""Parameter and FLOP counts of a composed model, computed on the meta device.

    python -m mta_repro.params model=880m attention=mta      # one JSON object
    python -m mta_repro.params --table [seq_len=2048]        # every size x variant
    python -m mta_repro.params experiment=long_context_880m_mta --memory [--world-size N]
                                                             # per-GPU memory pre-flight
    python -m mta_repro.params --release-config 830M_mta.yaml  # an official-release YAML
"""

from __future__ import annotations

import json
import sys

from mta_repro.config import compose, model_args_from
from mta_repro.model import ModelArgs, build_model
from mta_repro.model.flops import train_flops_per_token

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
        "train_flops_per_token": train_flops_per_token(args, seq_len),
        "seq_len": seq_len,
    }


def main(argv: list[str]) -> None:
    seq_len = 2048
    rest = []
    for a in argv:
        if a.startswith("seq_len="):
            seq_len = int(a.split("=", 1)[1])
        else:
            rest.append(a)
    if "--table" in rest:
        rows = []
        for size in SIZES:
            base = None
            for variant in VARIANTS:
                args = model_args_from(compose([f"model={size}", f"attention={variant}"]))
                c = count(args, seq_len)
                base = base if base is not None else c["total"]
                rows.append((size, variant, c["total"], c["total"] - base, c["train_flops_per_token"]))
        print(f"| size | variant | params | vs baseline | train GFLOP/token @{seq_len} |")
        print("|---|---|---:|---:|---:|")
        for size, variant, total, extra, flops in rows:
            print(f"| {size} | {variant} | {total:,} | {extra:+,} | {flops / 1e9:.3f} |")
        return
    if "--release-config" in rest:  # an official-release YAML (mta_repro/release.py)
        from mta_repro.release import release_model_args

        i = rest.index("--release-config")
        try:  # [key=value ...] after the path: release field names
            print(json.dumps(count(release_model_args(rest[i + 1], rest[i + 2:]), seq_len)))
        except (ValueError, IndexError) as e:
            sys.exit(f"error: {e}" if isinstance(e, ValueError) else "error: --release-config needs a path")
        return
    if "--memory" in rest:
        from mta_repro.memory import estimate_from_config

        world = None
        if "--world-size" in rest:
            world = int(rest[rest.index("--world-size") + 1])
            rest.remove(str(world))
        cfg = compose([a for a in rest if not a.startswith("--")])
        print(estimate_from_config(cfg, world).table())
        return
    args = model_args_from(compose(rest))
    out = count(args, seq_len)
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
