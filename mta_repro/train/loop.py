"""The training loop: ``train(cfg)`` on every rank (1 or N, same code).

Per update: ``grad_accum`` micro-batches (cross entropy over all positions, gradients
reduced only on the last one), clip, AdamW, schedule. At step boundaries: log, save,
and check for preemption. A run dir with complete checkpoints resumes from the latest;
a fresh run may start from another run's weights (``checkpoint.init_from``: the
long-context and MTA-insertion stages).
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from mta_repro.dataclass_config import to_dataclass
from mta_repro.model import build_model, to_model_args
from mta_repro.model.flops import train_flops_per_token
from mta_repro.train.args import CheckpointArgs, DistributedArgs, LoggingArgs, TrainerArgs
from mta_repro.train.checkpoint import CheckpointManager, load_model_state
from mta_repro.train.distributed import DistInfo, destroy_distributed, init_distributed, materialize, parallelize
from mta_repro.train.metrics import MetricLogger, Throughput, device_peak_flops, mfu, peak_mem_gb
from mta_repro.train.optim import build_lr_scheduler, build_optimizer, to_optim_args
from mta_repro.train.signals import PreemptionHandler, requeue_if_slurm


class NonFiniteLossError(FloatingPointError):
    pass


def _section(cfg: DictConfig, key: str, cls):
    """A validated dataclass from a config section (plain dicts from tests too)."""
    node = cfg.get(key)
    if node is None:
        return cls()
    return to_dataclass(cls, node, key)


def load_factory(spec: str) -> Callable:
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"trainer.loader: expected 'module:function', got {spec!r}")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"trainer.loader: cannot import {spec!r} ({e})") from e


def cross_entropy(model, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross entropy over all positions, computed in fp32.

    inputs, targets: (B, T) -> scalar."""
    logits = model(inputs)  # (B, T, V)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


def _check_vocab(cfg: DictConfig, vocab_size: int) -> None:
    """The model's vocabulary must equal the tokenizer's id count (data contract)."""
    data = cfg.get("data")
    if data is None or data.get("tokenizer") is None:
        return
    try:
        from mta_repro.data import build_tokenizer
    except ImportError:
        return
    n = build_tokenizer(data.tokenizer).n_words
    if n != vocab_size:
        raise ValueError(
            f"model.vocab_size={vocab_size} but the tokenizer data.tokenizer ({data.tokenizer.get('name')}) "
            f"has {n} ids; set model.vocab_size={n}"
        )


def _initial_weights(cfg: DictConfig, ckpt: CheckpointArgs, model_args, is_main: bool) -> Optional[dict]:
    """Full source weights for a stage start (rank 0 only), or None for the seeded init."""
    if ckpt.init_from is None or not is_main:
        return None
    from mta_repro.release import load_init_weights

    # Ours (load_model_state) or a release/Lingua checkpoint, in our key layout.
    sd, step = load_init_weights(ckpt.init_from)
    if ckpt.init_mode == "model":
        print(f"[mta_repro.train] initialised from {ckpt.init_from} (step {step}): model weights only",
              file=sys.stderr)
        return sd
    # Appendix I: a baseline's weights into this MTA model, new parts at identity.
    from mta_repro.model.args import MTAArgs
    from mta_repro.model.convert import baseline_to_mta

    base_args = dataclasses.replace(model_args, mta=MTAArgs(use_mta=False))
    model = baseline_to_mta(sd, base_args, model_args.mta, device="cpu")
    print(f"[mta_repro.train] inserted MTA into the baseline from {ckpt.init_from} (step {step})", file=sys.stderr)
    return model.state_dict()


def train(cfg: DictConfig) -> dict[str, Any]:
    """Run (or resume) training as configured; returns a small summary."""
    tr = _section(cfg, "trainer", TrainerArgs)
    dargs = _section(cfg, "distributed", DistributedArgs)
    info = init_distributed(dargs, tr.device)
    try:
        return _train(cfg, info, tr, dargs)
    finally:
        destroy_distributed()


def _train(cfg: DictConfig, info: DistInfo, tr: TrainerArgs, dargs: DistributedArgs) -> dict[str, Any]:
    ck = _section(cfg, "checkpoint", CheckpointArgs)
    lg = _section(cfg, "logging", LoggingArgs)
    optim_args = to_optim_args(cfg.optim)
    model_args = to_model_args(cfg.model)
    run_dir = Path(cfg.run_dir)
    torch.manual_seed(cfg.seed + info.rank)  # anything stochastic in training (dropout)

    if info.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(cfg, run_dir / "config.yaml", resolve=True)
        _check_vocab(cfg, model_args.vocab_size)
    manager = CheckpointManager(run_dir, ck.keep, info.rank, info.world_size)
    manager.clean_stale()
    resume_from = manager.latest() if ck.resume else None

    # Model: meta -> AC -> compile -> FSDP2 -> materialise with the full init/weights.
    model = build_model(model_args, device="meta")
    parallelize(model, info, dargs)
    full = None if resume_from is not None else _initial_weights(cfg, ck, model_args, info.is_main)
    materialize(model, info, full_state=full, model_args=model_args, init=resume_from is None)

    optimizer = build_optimizer(model, optim_args)
    scheduler = build_lr_scheduler(optimizer, optim_args, tr.steps)
    loader = load_factory(tr.loader)(cfg.data if "data" in cfg else None, info.rank, info.world_size)
    step = 0
    if resume_from is not None:
        step = manager.load(resume_from, model, optimizer, scheduler, loader)
        if info.is_main:
            print(f"[mta_repro.train] resumed from {resume_from} at step {step}", file=sys.stderr)

    seq_len = int(cfg.data.seq_len) if "data" in cfg else None
    flops_tok = None
    peak = device_peak_flops(info.device)
    logger = MetricLogger(run_dir, lg, OmegaConf.to_container(cfg, resolve=True), info.is_main, tr.steps, step)
    preempt = PreemptionHandler()
    meter = Throughput(info.device)
    last_saved = step if resume_from is not None else None
    stopped_by = None
    loss_val = float("nan")
    try:
        while step < tr.steps:
            signum = preempt.agreed_signal(info.device)
            if signum is not None:
                stopped_by = signum
                break
            model.train()
            loss_sum = torch.zeros((), device=info.device)
            n_tokens = 0
            for micro in range(tr.grad_accum):
                batch = next(loader)
                inputs = batch["input"].to(info.device, non_blocking=True)
                targets = batch["target"].to(info.device, non_blocking=True)
                if seq_len is None:
                    seq_len = inputs.shape[1]
                # Reduce-scatter gradients only after the last micro-batch.
                model.set_requires_gradient_sync(micro == tr.grad_accum - 1)
                loss = cross_entropy(model, inputs, targets) / tr.grad_accum
                loss.backward()
                loss_sum += loss.detach()
                n_tokens += inputs.numel()
            clip = optim_args.clip if optim_args.clip > 0 else float("inf")
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=True)
            if hasattr(grad_norm, "full_tensor"):
                grad_norm = grad_norm.full_tensor()
            # Mean loss over ranks = the global batch's mean (equal tokens per rank).
            if info.world_size > 1:
                dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM)
                loss_sum /= info.world_size
            loss_val, gnorm_val = loss_sum.item(), grad_norm.item()
            lr = optimizer.param_groups[0]["lr"]
            skipped = False
            if not (math.isfinite(loss_val) and math.isfinite(gnorm_val)):
                if tr.nonfinite == "raise":
                    latest = manager.latest()
                    raise NonFiniteLossError(
                        f"non-finite loss {loss_val} (grad norm {gnorm_val}) at step {step + 1}; "
                        f"the last good checkpoint is {latest or 'none (nothing saved yet)'}. "
                        "Lower optim.lr, or set trainer.nonfinite=skip to drop such updates."
                    )
                skipped = True  # trainer.nonfinite=skip: drop this update, keep going
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            with warnings.catch_warnings():  # a skipped update still advances the schedule
                warnings.simplefilter("ignore", UserWarning)
                scheduler.step()
            step += 1
            meter.add(n_tokens * info.world_size)
            logger.advance()

            if step % lg.every == 0 or step == tr.steps:
                if flops_tok is None:
                    flops_tok = train_flops_per_token(model_args, seq_len)
                tps = meter.rate()
                m = mfu(tps, flops_tok, peak, info.world_size)
                record = {
                    "step": step,
                    "loss": loss_val,
                    "lr": lr,
                    "grad_norm": gnorm_val,
                    "tokens_per_s": tps,
                    "peak_mem_gb": peak_mem_gb(info.device),
                    "mfu": m,
                }
                if skipped:
                    record["skipped"] = True
                logger.log(record)
            if step % ck.every == 0 or step == tr.steps:
                manager.save(step, model, optimizer, scheduler, loader)
                last_saved = step

        if stopped_by is not None:
            if last_saved != step:
                manager.save(step, model, optimizer, scheduler, loader)
            requeued = requeue_if_slurm(stopped_by, info.is_main)
            if info.is_main:
                print(f"[mta_repro.train] stopped at step {step} after a signal"
                      f"{' and requeued the job' if requeued else ''}", file=sys.stderr)
    finally:
        preempt.restore()
        logger.close()
        if hasattr(loader, "close"):
            loader.close()

    exported = None
    if stopped_by is None and ck.export:
        if dist.is_initialized():
            dist.barrier()
        if info.is_main:
            from mta_repro.train.export import export_consolidated

            exported = str(export_consolidated(run_dir))
    return {"step": step, "loss": loss_val, "stopped_by_signal": stopped_by, "export": exported}
