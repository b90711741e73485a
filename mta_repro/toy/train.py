"""Train and evaluate one model on the find-block toy task.

The model is the project's decoder (``mta_repro.model.build_model``) and the optimiser
and schedule are the trainer's (``mta_repro.train.optim``); only the data and the loss
mask are toy-specific. ``train_run(cfg, variant, seed)`` is what ``scripts/toy_task.py``
calls for each (model, seed) pair.

With a ``ckpt_path`` a run saves its whole state at every evaluation (model, optimiser,
schedule, batch order, RNG, curve) and resumes from it, so a killed run continues
exactly as if it had never stopped; a finished run's checkpoint returns its result
without training again.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from mta_repro.errors import UserError
from mta_repro.files import save_file_atomic
from mta_repro.model import build_model
from mta_repro.model.args import ModelArgs, MTAArgs
from mta_repro.toy.find_block import (
    IGNORE,
    CharTokenizer,
    FindBlockArgs,
    FindBlockData,
    error_counts,
    generate_splits,
    labels_from,
    wrong_per_target,
)
from mta_repro.train.optim import OptimArgs, build_lr_scheduler, build_optimizer

VARIANTS = ("baseline", "mta")


@dataclass
class ToyTrainArgs:
    """Training loop of the toy task (config section ``train``)."""

    # Optimiser updates per run (paper: 100k).
    steps: int = 100_000
    # Sequences per update (paper: 64).
    batch_size: int = 64
    # Evaluate on the whole held-out set every this many steps (and at the end).
    eval_every: int = 1000
    eval_batch_size: int = 250
    # Print the running train loss every this many steps.
    log_every: int = 100
    # "cpu", "cuda", "cuda:1"...; the same code path on either.
    device: str = "cpu"
    # torch intra-op threads per training process (0 = leave torch's default).
    threads: int = 0
    # Training processes running at once (each trains one (model, seed) pair).
    workers: int = 1


@dataclass
class ToyConfig:
    """Root of ``configs/toy/*.yaml``."""

    # Where results.csv / results.md / the plot and the per-run logs go.
    out_dir: str = "results/toy_task"
    # Training seeds: model init, batch order and dropout (the data has its own seed).
    seeds: list = field(default_factory=lambda: [42, 43, 44])
    # Which models to train: "baseline" (SDPA) and/or "mta".
    variants: list = field(default_factory=lambda: list(VARIANTS))
    data: FindBlockArgs = field(default_factory=FindBlockArgs)
    train: ToyTrainArgs = field(default_factory=ToyTrainArgs)
    optim: OptimArgs = field(default_factory=OptimArgs)
    # The shared architecture; vocab_size must equal the character tokenizer's 31 ids.
    # Its ``mta`` section is ignored: the variant decides (below).
    model: ModelArgs = field(default_factory=ModelArgs)
    # The MTA variant's attention (the baseline uses ``use_mta: false``).
    mta: MTAArgs = field(default_factory=MTAArgs)


def to_toy_config(cfg: Any) -> ToyConfig:
    """Validated ``ToyConfig`` from a composed DictConfig (or a ToyConfig)."""
    from omegaconf import OmegaConf

    if isinstance(cfg, ToyConfig):
        out = cfg
    else:
        merged = OmegaConf.merge(OmegaConf.structured(ToyConfig), cfg)
        out = OmegaConf.to_object(merged)
        assert isinstance(out, ToyConfig)  # merged onto the ToyConfig schema
    for v in out.variants:
        if v not in VARIANTS:
            raise UserError(f"toy config variants: expected items of {VARIANTS}, got {v!r}")
    n_words = CharTokenizer().n_words
    if out.model.vocab_size != n_words:
        raise UserError(
            f"toy config model.vocab_size={out.model.vocab_size}: must equal the character tokenizer's {n_words} ids"
        )
    if out.data.seq_len > out.model.max_seqlen:
        raise UserError(f"toy config: data.seq_len={out.data.seq_len} exceeds model.max_seqlen")
    if out.train.steps < 1 or out.train.batch_size < 1 or out.train.eval_every < 1:
        raise UserError("toy config train.steps, train.batch_size, train.eval_every: expected >= 1")
    return out


def model_args_for(cfg: ToyConfig, variant: str, seed: int) -> ModelArgs:
    """The shared architecture with the variant's attention and the run's init seed."""
    if variant not in VARIANTS:
        raise UserError(f"variant: expected one of {VARIANTS}, got {variant!r}")
    mta = replace(cfg.mta) if variant == "mta" else MTAArgs(use_mta=False)
    if variant == "mta" and not mta.use_mta:
        raise UserError("toy config mta.use_mta: must be true for the MTA variant")
    return replace(cfg.model, mta=mta, seed=seed)


@torch.no_grad()
def evaluate(model, data: FindBlockData, dargs: FindBlockArgs, batch_size: int, device) -> dict:
    """Held-out sequence / token error (%), the error (%) at each target letter
    (``position_error``) and the target-token loss, under teacher forcing."""
    was_training = model.training
    model.eval()
    seq_wrong = n_seq = tok_wrong = n_tok = 0
    per_target = [0] * dargs.target_len
    loss_sum = 0.0
    for lo in range(0, len(data), batch_size):
        tokens = data.tokens[lo : lo + batch_size]
        labels = labels_from(tokens, dargs).to(device)
        logits = model(tokens.long().to(device)[:, :-1]).float()  # (B, T-1, V)
        loss_sum += F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum").item()
        pred = logits.argmax(-1)
        a, b, c, d = error_counts(pred, labels)
        per_target = [x + y for x, y in zip(per_target, wrong_per_target(pred, labels, dargs))]
        seq_wrong, n_seq, tok_wrong, n_tok = seq_wrong + a, n_seq + b, tok_wrong + c, n_tok + d
    model.train(was_training)
    return {
        "seq_error": 100.0 * seq_wrong / n_seq,
        "token_error": 100.0 * tok_wrong / n_tok,
        "loss": loss_sum / n_tok,
        "position_error": [round(100.0 * x / n_seq, 2) for x in per_target],
    }


def _run_identity(cfg: ToyConfig, variant: str, seed: int) -> dict:
    """What a checkpoint must match to be resumed: everything that shapes the run."""
    return {
        "variant": variant,
        "seed": seed,
        "data": asdict(cfg.data),
        "model": asdict(model_args_for(cfg, variant, seed)),
        "optim": asdict(cfg.optim),
        "steps": cfg.train.steps,
        "batch_size": cfg.train.batch_size,
        "eval_every": cfg.train.eval_every,
    }


def train_run(
    cfg: ToyConfig,
    variant: str,
    seed: int,
    data: tuple[FindBlockData, FindBlockData] | None = None,
    log_path: Path | None = None,
    verbose: bool = True,
    ckpt_path: Path | None = None,
) -> dict:
    """Train one (variant, seed); returns final errors and the held-out curve.

    ``ckpt_path``: save the run's state there at every evaluation and resume from it if
    it exists (a checkpoint of another config raises ``ValueError``).
    """
    t = cfg.train
    if t.threads > 0:
        torch.set_num_threads(t.threads)
    device = torch.device(t.device)
    train_set, test_set = data if data is not None else generate_splits(cfg.data)
    torch.manual_seed(seed)  # dropout
    model = build_model(model_args_for(cfg, variant, seed), device=device)
    model.train()
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_lr_scheduler(optimizer, cfg.optim, t.steps)
    order_gen = torch.Generator().manual_seed(seed)
    perm, cursor = torch.randperm(len(train_set), generator=order_gen), 0
    curve, first_step, elapsed0 = [], 1, 0.0
    identity = _run_identity(cfg, variant, seed)
    if ckpt_path is not None and Path(ckpt_path).exists():
        from mta_repro.weights import load_pt  # weights_only, one line naming a bad file

        state = load_pt(ckpt_path, map_location=device, mmap=False)
        if state["identity"] != identity:
            diff = sorted(k for k in identity if state["identity"].get(k) != identity[k])
            raise UserError(
                f"{ckpt_path}: checkpoint of a different run (differs in {diff}); delete it or choose another out_dir"
            )
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        order_gen.set_state(state["order_gen"])
        torch.set_rng_state(state["rng"])
        if device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda_rng"], device)
        perm, cursor, curve = state["perm"], state["cursor"], state["curve"]
        first_step, elapsed0 = state["step"] + 1, state["elapsed_s"]
        if verbose:
            print(f"[{variant} seed={seed}] resumed from {ckpt_path} at step {state['step']}", flush=True)

    log = open(log_path, "w") if log_path else None  # noqa: SIM115 - written through the loop, closed after it
    if log:  # the log always mirrors the curve, also after a resume
        for entry in curve:
            log.write(json.dumps(entry) + "\n")
        log.flush()

    def record(entry):
        curve.append(entry)
        line = json.dumps(entry)
        if log:
            log.write(line + "\n")
            log.flush()
        if verbose:
            print(f"[{variant} seed={seed}] {line}", flush=True)

    start, run_loss, run_n = time.time() - elapsed0, 0.0, 0
    for step in range(first_step, t.steps + 1):
        if cursor + t.batch_size > len(perm):  # new epoch
            perm, cursor = torch.randperm(len(train_set), generator=order_gen), 0
        idx = perm[cursor : cursor + t.batch_size]
        cursor += t.batch_size
        tokens = train_set.tokens[idx]
        labels = labels_from(tokens, cfg.data).to(device)
        logits = model(tokens.long().to(device)[:, :-1])  # (B, T-1, V)
        # Loss on the target tokens only; mean over target tokens.
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.optim.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.clip)
        optimizer.step()
        scheduler.step()
        if not math.isfinite(loss.item()):
            raise FloatingPointError(f"{variant} seed {seed}: non-finite loss at step {step}")
        run_loss, run_n = run_loss + loss.item(), run_n + 1
        if step % t.eval_every == 0 or step == t.steps:
            ev = evaluate(model, test_set, cfg.data, t.eval_batch_size, device)
            record(
                {"step": step, "train_loss": run_loss / max(run_n, 1), **ev, "elapsed_s": round(time.time() - start, 1)}
            )
            run_loss, run_n = 0.0, 0
            if ckpt_path is not None:
                save_file_atomic(
                    {
                        "identity": identity,
                        "step": step,
                        "elapsed_s": time.time() - start,
                        "model": model.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(),
                        "order_gen": order_gen.get_state(),
                        "rng": torch.get_rng_state(),
                        "cuda_rng": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
                        "perm": perm,
                        "cursor": cursor,
                        "curve": curve,
                    },
                    Path(ckpt_path),
                )
        elif verbose and step % t.log_every == 0:
            print(
                f"[{variant} seed={seed}] step {step} loss {run_loss / run_n:.4f} ({time.time() - start:.0f}s)",
                flush=True,
            )
    if log:
        log.close()
    final = curve[-1]
    return {
        "model": variant,
        "seed": seed,
        "seq_error": final["seq_error"],
        "token_error": final["token_error"],
        "curve": curve,
        "train_seconds": time.time() - start,
    }
