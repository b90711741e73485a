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
import os
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
from mta_repro.train.checkpoint import CheckpointManager, complete_checkpoints, saved_world_size, verify_checkpoint
from mta_repro.train.distributed import DistInfo, destroy_distributed, init_distributed, materialize, parallelize
from mta_repro.train.metrics import MetricLogger, Throughput, device_peak_flops, mfu, peak_mem_gb
from mta_repro.train.optim import build_lr_scheduler, build_optimizer, to_optim_args
from mta_repro.train.rundir import (
    RunDirError,
    RunLock,
    check_config,
    global_batch_error,
    load_saved_config,
    write_config,
)
from mta_repro.train.signals import PreemptionHandler, requeue_if_slurm
from mta_repro.train.validation import maybe_validator


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
    from mta_repro.train.checkpoint import load_init_weights

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


def _fresh(run_dir: Path) -> bool:
    """No run has written into ``run_dir`` yet (Hydra's own files do not count)."""
    return not any((run_dir / n).exists() for n in ("config.yaml", "checkpoints", "metrics.jsonl", "export"))


def _remove_failed_start(run_dir: Path) -> None:
    """A start that failed before it trained or saved anything leaves no run dir behind:
    remove what it (and Hydra, if its output dir is the run dir) wrote, then the dir if empty."""
    metrics = run_dir / "metrics.jsonl"
    ckpts = run_dir / "checkpoints"
    if (metrics.is_file() and metrics.stat().st_size > 0) or (ckpts.is_dir() and any(ckpts.iterdir())):
        return
    import shutil

    for name in ("config.yaml", "config.prev.yaml", "metrics.jsonl", ".lock", "wandb_id.txt"):
        (run_dir / name).unlink(missing_ok=True)
    for name in ("checkpoints", "wandb"):
        shutil.rmtree(run_dir / name, ignore_errors=True)
    try:
        from hydra.core.hydra_config import HydraConfig

        hc = HydraConfig.get()
        if Path(hc.runtime.output_dir).resolve() == run_dir.resolve():
            if hc.output_subdir:
                shutil.rmtree(run_dir / hc.output_subdir, ignore_errors=True)
            (run_dir / f"{hc.job.name}.log").unlink(missing_ok=True)
    except (ImportError, ValueError):
        pass  # not under Hydra's main
    try:
        run_dir.rmdir()
    except OSError:
        pass  # not empty: something else lives there


def _launch_rank() -> int:
    import os

    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)))


def check_schema(cfg) -> None:
    """Refuse keys the schema does not know (Hydra's ``+key=`` adds them in silence)."""
    if not isinstance(cfg, DictConfig):
        return
    from mta_repro.config import TrainConfig
    from mta_repro.dataclass_config import unknown_keys, unknown_keys_error

    bad = [k for k in unknown_keys(TrainConfig, cfg, "") if k != "hydra"]
    if bad:
        raise ValueError(unknown_keys_error(TrainConfig, bad))


def train(cfg: DictConfig) -> dict[str, Any]:
    """Run (or resume) training as configured; returns a small summary."""
    run_dir = Path(cfg.run_dir)
    fresh = _fresh(run_dir)
    try:
        check_schema(cfg)
        tr = _section(cfg, "trainer", TrainerArgs)
        dargs = _section(cfg, "distributed", DistributedArgs)
        info = init_distributed(dargs, tr.device)
        try:
            return _train(cfg, info, tr, dargs)
        finally:
            destroy_distributed()
    except BaseException:
        if fresh and _launch_rank() == 0:
            _remove_failed_start(run_dir)
        raise


def _agree(info: DistInfo, fn: Callable[[], Any]) -> Any:
    """``fn()`` on rank 0, its result (or its error, re-raised) on every rank."""
    out: list = [None]
    if info.is_main:
        try:
            out[0] = ("ok", fn())
        except Exception as e:  # noqa: BLE001 - re-raised below, on every rank
            out[0] = ("err", e)
    if info.world_size > 1:
        dist.broadcast_object_list(out, src=0)
    kind, value = out[0]
    if kind == "err":
        if info.is_main:
            raise value
        raise type(value)(*value.args) if isinstance(value, ValueError) else RuntimeError(str(value))
    return value


def _prepare_run_dir(cfg: DictConfig, ck: CheckpointArgs, tr: TrainerArgs, info: DistInfo, lock: RunLock):
    """Rank 0, before anything is written: config check, lock, config.yaml. Returns the
    step of the newest complete checkpoint (None if none)."""
    run_dir = Path(cfg.run_dir)
    found = complete_checkpoints(run_dir / "checkpoints") if ck.resume else []
    at_step = int(found[-1].name) if found else None
    if at_step == tr.steps and verify_checkpoint(found[-1]) is not None:
        at_step = None  # "finished", but its last checkpoint is damaged: resume decides
    saved = load_saved_config(run_dir)
    new = OmegaConf.to_container(cfg, resolve=True)
    if at_step is not None and at_step > tr.steps:
        raise RunDirError(
            f"run_dir={run_dir} is already at step {at_step} ({found[-1]}), beyond trainer.steps={tr.steps}: "
            "nothing to train. Raise trainer.steps (with checkpoint.allow_config_change=true) or use another run_dir"
        )
    if found and saved is not None:
        check_config(saved, new, ck.allow_config_change, run_dir, at_step)
        saved_world = saved_world_size(found[-1])
        if saved_world is not None:
            err = global_batch_error(saved, cfg, saved_world, info.world_size)
            if err:
                raise RunDirError(f"run_dir={run_dir}: {err}")
    if not ck.resume and (run_dir / "checkpoints").is_dir() and complete_checkpoints(run_dir / "checkpoints"):
        raise RunDirError(
            f"run_dir={run_dir} holds checkpoints and checkpoint.resume=false would train over them from "
            "step 0: use another run_dir=..., or checkpoint.resume=true"
        )
    _check_vocab(cfg, to_model_args(cfg.model).vocab_size)
    run_dir.mkdir(parents=True, exist_ok=True)
    lock.acquire()
    write_config(run_dir, cfg)
    return at_step


def _train(cfg: DictConfig, info: DistInfo, tr: TrainerArgs, dargs: DistributedArgs) -> dict[str, Any]:
    ck = _section(cfg, "checkpoint", CheckpointArgs)
    lg = _section(cfg, "logging", LoggingArgs)
    optim_args = to_optim_args(cfg.optim)
    model_args = to_model_args(cfg.model)
    run_dir = Path(cfg.run_dir)
    torch.manual_seed(cfg.seed + info.rank)  # anything stochastic in training (dropout)

    lock = RunLock(run_dir)
    try:
        at_step = _agree(info, lambda: _prepare_run_dir(cfg, ck, tr, info, lock))
        if at_step is not None and at_step == tr.steps:
            if info.is_main:
                print(f"[mta_repro.train] {run_dir} is already at trainer.steps={tr.steps}: nothing to train "
                      "(raise trainer.steps, with checkpoint.allow_config_change=true, to train on)",
                      file=sys.stderr, flush=True)
            return {"step": at_step, "loss": float("nan"), "stopped_by_signal": None, "export": None}
        return _run(cfg, info, tr, dargs, ck, lg, optim_args, model_args, run_dir)
    finally:
        lock.release()


def _run(cfg, info, tr, dargs, ck, lg, optim_args, model_args, run_dir) -> dict[str, Any]:
    manager = CheckpointManager(run_dir, ck.keep, info.rank, info.world_size, async_save=ck.async_save)
    manager.clean_stale()
    has_ckpt = ck.resume and manager.latest() is not None

    # Model: meta -> AC -> compile -> FSDP2 -> materialise with the full init/weights.
    model = build_model(model_args, device="meta")
    parallelize(model, info, dargs)
    full = None if has_ckpt else _initial_weights(cfg, ck, model_args, info.is_main)
    materialize(model, info, full_state=full, model_args=model_args, init=not has_ckpt)

    optimizer = build_optimizer(model, optim_args)
    scheduler = build_lr_scheduler(optimizer, optim_args, tr.steps)
    loader = load_factory(tr.loader)(cfg.data if "data" in cfg else None, info.rank, info.world_size)
    step = 0
    resume_from = None
    if has_ckpt:
        # The newest readable checkpoint (an unreadable one raises or falls back, per
        # checkpoint.on_corrupt).
        resume_from, step = manager.resume(model, optimizer, scheduler, loader, ck.on_corrupt)
        if info.is_main:
            print(f"[mta_repro.train] resumed from {resume_from} at step {step}", file=sys.stderr)

    seq_len = int(cfg.data.seq_len) if "data" in cfg else None
    flops_tok = None
    peak = device_peak_flops(info.device)
    logger = MetricLogger(run_dir, lg, OmegaConf.to_container(cfg, resolve=True), info.is_main, tr.steps, step)
    validator = maybe_validator(cfg, tr, info, seq_len)
    preempt = PreemptionHandler()
    meter = Throughput(info.device)
    last_saved = step if resume_from is not None else None
    stopped_by = None
    loss_val = float("nan")
    interval_losses: list[float] = []
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
            interval_losses.append(loss_val)
            meter.add(n_tokens * info.world_size)
            logger.advance()

            validate = validator is not None and (step % tr.eval_every == 0 or step == tr.steps)
            if step % lg.every == 0 or step == tr.steps or validate:
                if flops_tok is None:
                    flops_tok = train_flops_per_token(model_args, seq_len)
                tps = meter.rate()
                m = mfu(tps, flops_tok, peak, info.world_size)
                record = {
                    "step": step,
                    # The mean over the steps since the last record (each step's loss is
                    # the mean over its global batch); loss_last is this step's alone.
                    "loss": sum(interval_losses) / len(interval_losses),
                    "loss_last": loss_val,
                    "lr": lr,
                    "grad_norm": gnorm_val,
                    "tokens_per_s_global": tps,
                    "tokens_per_s_per_gpu": tps / info.world_size,
                    "peak_mem_gb": peak_mem_gb(info.device),
                    "mfu": m,
                    "tokens_seen": step * n_tokens * info.world_size,
                }
                interval_losses = []
                counts = _domain_tokens(loader, info)
                if counts:
                    record.update({f"train_tokens/{d}": n for d, n in counts.items()})
                bad = _summed(loader, "bad_records", info)
                record.update({f"data_bad/{k}": n for k, n in bad.items() if n})
                if skipped:
                    record["skipped"] = True
                if validate:
                    record.update(validator.run(model, info.device))
                    meter.rate()  # validation time is not training throughput
                logger.log(record)
            if step % ck.every == 0 or step == tr.steps:
                manager.save(step, model, optimizer, scheduler, loader)
                last_saved = step
            lock_heartbeat(run_dir, info.is_main)

        if stopped_by is not None:
            if last_saved != step:
                manager.save(step, model, optimizer, scheduler, loader)
            manager.wait()
            requeued = requeue_if_slurm(stopped_by, info.is_main)
            if info.is_main:
                print(f"[mta_repro.train] stopped at step {step} after a signal"
                      f"{' and requeued the job' if requeued else ''}", file=sys.stderr)
        manager.wait()
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


def _domain_tokens(loader, info: DistInfo) -> dict[str, int]:
    """Tokens trained on per domain, summed over ranks (loaders that count them)."""
    return _summed(loader, "token_counts", info)


def _summed(loader, method: str, info: DistInfo) -> dict[str, int]:
    """``loader.<method>()`` ({name: count}, the same names on every rank) summed over ranks."""
    if not hasattr(loader, method):
        return {}
    counts = getattr(loader, method)()
    names = sorted(counts)
    if info.world_size > 1:
        t = torch.tensor([counts[n] for n in names], dtype=torch.int64, device=info.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return {n: int(v) for n, v in zip(names, t.tolist())}
    return {n: int(counts[n]) for n in names}


def lock_heartbeat(run_dir: Path, is_main: bool) -> None:
    """Touch the lock (its mtime says when the holder was last alive)."""
    if is_main:
        try:
            os.utime(run_dir / ".lock")
        except OSError:
            pass
