"""The estimate command line: composes a training config (or reads an official-release YAML)
and prints the counts of ``mta_repro.estimate.params`` or the memory pre-flight of
``mta_repro.estimate.memory``. The one module of ``estimate`` that imports above it (the
training config's composition in ``train``, the release reader in ``release``): an entry point,
imported by nothing but ``__main__`` (pyproject.toml's import-linter contract names it).

    python -m mta_repro.estimate model=880m attention=mta      # one JSON object
    python -m mta_repro.estimate --table [seq_len=2048]        # every size x variant
    python -m mta_repro.estimate experiment=pretrain_880m_mta --memory [--world-size N]
                                                             # per-GPU memory pre-flight, with the
                                                             # seq_len/batch/world/dtype it assumes,
                                                             # beside PyTorch's FSDPMemTracker
                                                             # (--no-tracker: without it)
    python -m mta_repro.estimate --memory --experiments        # every pretrain/long-context experiment
    python -m mta_repro.estimate --release-config 830M_mta.yaml  # an official-release YAML
                                                             # (FLOPs at its data.seq_len)

Sizes (model=): tiny, 300m, 550m, 880m, 1b; variants (attention=): baseline, diff,
talking_heads, mta; any other Hydra override of configs/train.yaml (model.dim=...).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from mta_repro.errors import UserError
from mta_repro.estimate.memory import CAPACITIES, GB, estimate_from_config
from mta_repro.estimate.params import SIZES, VARIANTS, count
from mta_repro.train.config import CONFIG_DIR, compose, model_args_from


def memory_assumptions(cfg, world_size: int, overrides: list[str]) -> str:
    """The shape the memory estimate is for, in one paragraph: an estimate is only as
    good as the seq_len, micro-batch and world size it assumed, and the defaults (the
    bundled data's seq_len 256, one CPU rank, fp32) are far from a paper run's."""
    on_gpu = str(cfg.trainer.get("device", "cpu")).startswith("cuda")
    # the dtype rule of mta_repro.estimate.memory.estimate_from_config: param_dtype on GPU, fp32 on CPU
    dtype = str(cfg.distributed.param_dtype) if on_gpu else "float32"
    B, T, accum = int(cfg.data.batch_size), int(cfg.data.seq_len), int(cfg.trainer.get("grad_accum", 1))
    line = (
        f"assumes: seq_len {T}, micro-batch {B} x {T} tokens per rank, grad_accum {accum} "
        f"{'(gradients held between micro-batches)' if accum > 1 else '(no accumulation)'}, "
        f"world size {world_size}, {dtype} parameters on "
        f"{'GPU' if on_gpu else 'CPU (trainer.device)'}, attn_impl {cfg.model.get('attn_impl', 'blocked')}, "
        f"activation checkpointing {'on' if cfg.distributed.activation_checkpointing else 'off'}"
    )
    if not any(o.startswith("experiment=") for o in overrides):
        line += (
            "\nnote: no experiment= given, so this is the bundled demo data's shape; for a paper run "
            "give it, e.g. experiment=pretrain_880m_mta (or data.seq_len=, data.batch_size=, "
            "trainer.device=cuda, --world-size N)"
        )
    return line + "\n"


def cpu_process_line(pre_flight: float, mmap_threshold) -> str:
    """On CPU, what the trainer's start compares with this machine's available memory: the
    pre-flight's tensors plus the process and the allocator's slack
    (``mta_repro.estimate.memory_check``)."""
    import torch

    from mta_repro.estimate.memory_check import capacity, cpu_overheads

    extra = cpu_overheads(pre_flight, mmap_threshold)
    need = pre_flight + sum(extra.values())
    have, what = capacity(torch.device("cpu"))
    held = next(iter(extra.values()))
    terms = " + ".join(f"{v / GB:.2f} GB {k}" for k, v in extra.items())
    verdict = "fits" if need <= have + held else "DOES NOT FIT: the trainer refuses to start"
    return (
        f"on this CPU: {need / GB:.2f} GB per rank ({pre_flight / GB:.2f} GB pre-flight + {terms}); {what} "
        f"(+ the {held / GB:.2f} GB this process holds): {verdict}"
    )


def tracker_line(cfg, est) -> str:
    """PyTorch's FSDPMemTracker for the same shapes (``mta_repro.estimate.memory_tracker``),
    beside the pre-flight's figure; over 10% apart, one of them is wrong."""
    import torch

    from mta_repro.estimate.memory_tracker import tracked_peak

    on_gpu = str(cfg.trainer.get("device", "cpu")).startswith("cuda")
    fused = cfg.get("optim", {}).get("fused", None)
    peak = tracked_peak(
        model_args_from(cfg),
        int(cfg.data.batch_size),
        int(cfg.data.seq_len),
        est.world_size,
        bool(cfg.distributed.activation_checkpointing),
        getattr(torch, cfg.distributed.param_dtype) if on_gpu else torch.float32,
        "cuda" if on_gpu else "cpu",
        int(cfg.trainer.get("grad_accum", 1)),
        None if fused is None else bool(fused),
        int(cfg.trainer.get("loss_chunk", 0)),
    )
    ratio = est.total / peak.total if peak.total else float("inf")
    flag = "" if abs(ratio - 1) <= 0.10 else " (over 10% apart: docs/memory.md)"
    return f"{peak.line()}; pre-flight / tracker = {ratio:.3f}{flag}"


def experiments_table(names: list[str]) -> str:
    """A Markdown row per experiment: its per-GPU estimate and the verdicts."""
    lines = [
        "| experiment | world | act. ckpt | per-GPU estimate GB | 80 GB | H200 141 GB |",
        "|---|---:|---|---:|---|---|",
    ]
    for name in names:
        est = estimate_from_config(compose([f"experiment={name}"]))
        lines.append(
            f"| {name} | {est.world_size} | {'on' if est.activation_checkpointing else 'off'} | "
            f"{est.total / GB:.1f} | {'fits' if est.fits(CAPACITIES['80 GB']) else 'no'} | "
            f"{'fits' if est.fits(CAPACITIES['H200 141 GB']) else 'no'} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    if "--release-config" in argv:  # an official-release YAML (mta_repro/release/config.py)
        from mta_repro.release import release_file_to_config

        i = argv.index("--release-config")
        if i + 1 >= len(argv):
            raise UserError("--release-config needs the path of a release YAML")
        # [key=value ...] after the path: release field names
        conv = release_file_to_config(argv[i + 1], overrides=argv[i + 2 :])
        seq = [a for a in argv[:i] if a.startswith("seq_len=")]
        try:  # FLOPs at the config's data.seq_len unless seq_len= says otherwise
            seq_len = int(seq[0].split("=", 1)[1]) if seq else int(conv.config["data"]["seq_len"])
        except ValueError:
            raise UserError(f"{seq[0]}: expected an integer sequence length") from None
        print(json.dumps(count(conv.model_args(), seq_len)))
        return
    seq_len, world = 2048, None
    rest = []
    args_iter = iter(argv)
    for a in args_iter:
        if a.startswith("seq_len="):
            try:
                seq_len = int(a.split("=", 1)[1])
            except ValueError:
                raise UserError(f"{a}: expected an integer sequence length") from None
        elif a == "--world-size":
            value = next(args_iter, "")
            if not value.isdigit() or int(value) < 1:
                raise UserError(f"--world-size: expected a positive integer, got {value!r}")
            world = int(value)
        elif a.startswith("-") and a not in ("--table", "--memory", "--experiments", "--no-tracker"):
            raise UserError(
                f"unknown option {a!r}; expected --table, --memory [--world-size N | --experiments | --no-tracker], "
                "--help or Hydra overrides (model=880m)"
            )
        else:
            rest.append(a)
    from mta_repro.cli import check_group_options

    check_group_options(rest, ["model", "attention"], Path(CONFIG_DIR))
    if "--table" in rest:
        rows = []
        for size in SIZES:
            base = None
            for variant in VARIANTS:
                args = model_args_from(compose([f"model={size}", f"attention={variant}"]))
                c = count(args, seq_len)
                base = base if base is not None else c["total"]
                rows.append((size, variant, c["total"], c["total"] - base, c["model_flops_per_token"]))
        print(f"| size | variant | params | vs baseline | train GFLOP/token @{seq_len} |")
        print("|---|---|---:|---:|---:|")
        for size, variant, total, extra, flops in rows:
            print(f"| {size} | {variant} | {total:,} | {extra:+,} | {flops / 1e9:.3f} |")
        return
    if "--memory" in rest and "--experiments" in rest:
        names = sorted(
            p.stem
            for p in (CONFIG_DIR / "experiment").glob("[!_]*.yaml")
            if p.stem.startswith(("pretrain_", "long_context_", "mta_insertion"))
        )
        print(experiments_table(names))
        return
    if "--memory" in rest:
        overrides = [a for a in rest if not a.startswith("--")]
        cfg = compose(overrides)
        est = estimate_from_config(cfg, world)
        print(memory_assumptions(cfg, est.world_size, overrides))
        print(est.table())
        if not str(cfg.trainer.get("device", "cpu")).startswith("cuda"):
            print("\n" + cpu_process_line(est.total, cfg.trainer.get("cpu_mmap_threshold")))
        if "--no-tracker" not in rest:
            print("\n" + tracker_line(cfg, est))
        return
    args = model_args_from(compose(rest))
    out = count(args, seq_len)
    print(json.dumps(out))


def cli(argv: list[str]) -> int:
    """``main`` with --help, and user errors as one line (exit code 2)."""
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    from mta_repro.cli import run_cli

    return run_cli("estimate", lambda: main(argv) or 0)


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
