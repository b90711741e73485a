"""The training loop: ``train(cfg)`` on every rank (1 or N, same code).

``train`` converts the composed config once into the typed ``TrainConfig``
(``mta_repro.train.config.to_train_config``) and ``run(args)`` works from that alone (Lingua's
``train(args: TrainArgs)``).

Per update (``train_step``): ``grad_accum`` micro-batches (cross entropy over all
positions, gradients reduced only on the last one), clip, AdamW, schedule. The step
leaves its loss and gradient norm on the device: the host reads them (one all-reduce and
one read for all the steps since the last read) only every ``logging.every`` steps, before
a save and at the end, and agrees on a preemption signal across ranks at the same
cadence, so the CPU runs ahead of the GPU in between (torchtitan does the same).
``trainer.nonfinite=skip`` must decide about each update and reads every step.

A run dir with complete checkpoints resumes from the latest; a fresh run may start from
another run's weights (``checkpoint.init_from``: the long-context and MTA-insertion stages).
"""

from __future__ import annotations

import dataclasses
import errno
import math
import os
import signal
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch.distributed.tensor import DTensor

from mta_repro.dataclass_config import to_dataclass
from mta_repro.device import launcher_rank
from mta_repro.errors import NoSpaceError, PeerFailedError, StopRequested, UserError
from mta_repro.estimate.cpu_malloc import fix_mmap_threshold
from mta_repro.model import build_model, to_model_args
from mta_repro.model.flops import hardware_flops_per_token, model_flops_per_token
from mta_repro.model.loss import cross_entropy
from mta_repro.runs import provenance
from mta_repro.runs.rundir import clean_failed_start, commit_start, settle_hydra_output
from mta_repro.runs.runlock import RunLock, lock_heartbeat
from mta_repro.runs.signals import PreemptionHandler, requeue_if_slurm
from mta_repro.train.args import TrainerArgs
from mta_repro.train.attn_selfcheck import attn_selfcheck
from mta_repro.train.checkpoint import CheckpointManager
from mta_repro.train.config import TrainConfig, to_train_config
from mta_repro.train.config_check import prepare_run_dir
from mta_repro.train.distributed import (
    DistInfo,
    destroy_distributed,
    gather_or_peer_failed,
    init_distributed,
    materialize,
    parallelize,
)
from mta_repro.train.metrics import MetricLogger, Throughput, device_peak_flops, mfu, peak_mem_gb
from mta_repro.train.optim import build_lr_scheduler, build_optimizer
from mta_repro.train.plugins import load_factory
from mta_repro.train.stage_weights import stage_start_weights
from mta_repro.train.state import TrainState
from mta_repro.train.validation import Validator, maybe_validator


class NonFiniteLossError(UserError, FloatingPointError):
    """A NaN/inf loss or gradient norm (``trainer.nonfinite=raise``): the message names the
    step and the last good checkpoint. One line and rc 2 on the command line: the fix is
    the config's (a lower lr, or ``trainer.nonfinite=skip``)."""


def _section(cfg: DictConfig, key: str, cls):
    """A validated dataclass from one config section (plain dicts too)."""
    node = cfg.get(key)
    if node is None:
        return cls()
    return to_dataclass(cls, node, key)


def _check_vocab(args: TrainConfig, vocab_size: int) -> None:
    """The model's vocabulary must equal the tokenizer's id count (data contract)."""
    tok = args.data.tokenizer
    if tok is None:
        return
    try:
        from mta_repro.data import build_tokenizer
    except ImportError:
        return
    n = build_tokenizer(tok).n_words
    if n != vocab_size:
        raise UserError(
            f"model.vocab_size={vocab_size} but the tokenizer data.tokenizer ({tok.name}) "
            f"has {n} ids; set model.vocab_size={n}"
        )


def train(cfg: Any) -> dict[str, Any]:
    """Run (or resume) training as configured (a composed DictConfig, a mapping or a
    TrainConfig); returns a small summary. Rank 0 takes the run dir's lock before it
    decides or writes anything there (a start refused by it touches nothing); a start that
    fails before it trained or saved anything in a run dir it found fresh leaves no run
    directory behind."""
    run_dir = Path(cfg.run_dir if not isinstance(cfg, dict) else cfg["run_dir"])
    lock = RunLock(run_dir)
    # The stop signals are caught from before the rendezvous, which waits for every rank
    # (minutes when a node starts late): a stop there prints its line and, under SLURM,
    # USR2 requeues the job.
    preempt = PreemptionHandler()
    refused = False
    try:
        args = to_train_config(cfg)
        try:
            info = init_distributed(args.distributed, args.trainer.device, check=preempt.check)
        except StopRequested as e:
            raise _stopped_before_training(e, run_dir, launcher_rank() == 0) from None
        if info.device.type == "cpu":
            # Before the model is built: trainer.cpu_mmap_threshold (mta_repro/estimate/cpu_malloc.py)
            fix_mmap_threshold(args.trainer.cpu_mmap_threshold)
        try:
            return _train(args, info, lock, preempt)
        finally:
            destroy_distributed()
    except BaseException as e:
        refused = isinstance(e, UserError)
        if launcher_rank() == 0:
            clean_failed_start(run_dir, lock)
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            raise NoSpaceError(
                f"no space left on device: {e.filename or run_dir}: {e.strerror}; free space "
                "and rerun the same command to resume"
            ) from e
        raise
    finally:
        if launcher_rank() == 0:
            settle_hydra_output(keep=False)  # not accepted (refused, failed, nothing to train)
        lock.release()
        preempt.restore()
        if refused:
            _exit_as_refused()


def _exit_as_refused() -> None:
    """A refusal (exit 2) under srun with several tasks: ignore SIGTERM from here to the
    exit. The refusal is agreed, so every rank exits 2, but srun ends the other tasks with
    SIGTERM as soon as the first exits (--kill-on-bad-exit) and records the highest
    status: one task killed by it made the job's exit 143, a stop by a signal, where the
    start had been refused (2)."""
    if os.environ.get("SLURM_JOB_ID") and int(os.environ.get("SLURM_NTASKS", "1") or 1) > 1:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


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


def _every_rank(info: DistInfo, what: str, fn: Callable[[], Any], share: Callable[[Any], Any] = lambda v: None):
    """``fn()`` on every rank, then one gather: (its value, [``share(value)`` of every rank]).
    A rank whose ``fn`` failed raises its own error; every other rank a PeerFailedError naming
    it and its message, so no rank goes on into work (a resume's collective load) that
    would fail later and be read as something else (a damaged checkpoint)."""
    try:
        value, failed = fn(), None
    except Exception as e:  # noqa: BLE001 - re-raised below, after the others have heard of it
        value, failed = None, e
    mine = ("err", f"{type(failed).__name__}: {failed}") if failed is not None else ("ok", share(value))
    every = gather_or_peer_failed(mine, what, info.rank, info.world_size)
    if failed is not None:
        raise failed
    bad = next(((r, m) for r, (kind, m) in enumerate(every) if kind == "err"), None)
    if bad is not None:
        raise PeerFailedError(
            f"rank {bad[0]} failed while {what} ({bad[1].splitlines()[0][:300]}); rank {info.rank} stops too. "
            "Nothing of the run was changed here"
        )
    return value, [m for _, m in every]


def _read_alike(args: TrainConfig, info: DistInfo, what: str, fn: Callable[[], Any]) -> Any:
    """``fn()`` on every rank (``_every_rank``), then what each rank reads (its tokenizer;
    its data listing once ``fn`` returned the loader) compared with rank 0's: a rank that
    reads otherwise is refused on every rank. Returns this rank's ``fn()`` and what every
    rank reads (``provenance.rank_inputs``, by rank)."""
    value, every = _every_rank(info, what, fn, lambda v: provenance.rank_inputs(args, v))
    if (line := provenance.ranks_disagree(every)) is not None:
        raise provenance.ProvenanceError(line)
    return value, every


def _train(args: TrainConfig, info: DistInfo, lock: RunLock, preempt: PreemptionHandler) -> dict[str, Any]:
    tr, run_dir = args.trainer, Path(args.run_dir)
    torch.manual_seed(args.seed + info.rank)  # anything stochastic in training (dropout)
    if args.run.stage is None:  # started by hand: record what this start knows it is
        from omegaconf import OmegaConf

        from mta_repro.train.stage_weights import start_stage

        args.run.stage = start_stage(OmegaConf.to_container(OmegaConf.structured(args), resolve=True))  # type: ignore[arg-type]

    def prepare():
        _check_vocab(args, to_model_args(args.model).vocab_size)
        from mta_repro.estimate.memory_check import check_fits

        check_fits(args, info.world_size, info.device)  # before the run dir is touched or anything allocated
        return prepare_run_dir(args, info, lock)

    at_step, config_changes = _agree(info, prepare)
    if at_step is not None and at_step == tr.steps:
        exported = None
        if info.is_main:
            print(
                f"[mta_repro.train] {run_dir} is already at trainer.steps={tr.steps}: nothing to train "
                "(raise trainer.steps, with checkpoint.allow_config_change=true, to train on)",
                file=sys.stderr,
                flush=True,
            )
            from mta_repro.train.export import export_consolidated, export_is_current

            # The export a finished run still lacks (a full disk stopped it): made now.
            if args.checkpoint.export and not export_is_current(run_dir):
                exported = str(export_consolidated(run_dir))
                print(f"[mta_repro.train] made the missing export {exported}", file=sys.stderr, flush=True)
        return {"step": at_step, "loss": float("nan"), "stopped_by_signal": None, "export": exported}
    return run(args, info, preempt, config_changes)


# ------------------------------------------------------------------ one update
class StepOutput(NamedTuple):
    """What one update reports, with no host sync (the tensors stay on the device)."""

    loss: torch.Tensor  # 0-d: this rank's mean loss over its micro-batches
    grad_norm: torch.Tensor  # 0-d: the global gradient norm before clipping
    n_tokens: int  # this rank's tokens in the update
    lr: float  # the learning rate the update used
    finite: bool | None  # None unless trainer.nonfinite=skip (which reads the values to decide)


def train_step(model, optimizer, scheduler, loader, tr: TrainerArgs, clip: float, device) -> StepOutput:
    """One optimiser update over ``tr.grad_accum`` micro-batches, with no host sync."""
    model.train()
    loss_sum = torch.zeros((), device=device)
    n_tokens = 0
    for micro in range(tr.grad_accum):
        batch = next(loader)
        inputs = batch["input"].to(device, non_blocking=True)  # (B, T)
        targets = batch["target"].to(device, non_blocking=True)
        # Reduce-scatter gradients only after the last micro-batch.
        model.set_requires_gradient_sync(micro == tr.grad_accum - 1)
        loss = cross_entropy(model, inputs, targets, tr.loss_chunk) / tr.grad_accum
        loss.backward()
        loss_sum += loss.detach()
        n_tokens += inputs.numel()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=True)
    if isinstance(grad_norm, DTensor):
        grad_norm = grad_norm.full_tensor()
    lr = optimizer.param_groups[0]["lr"]
    finite = None
    if tr.nonfinite == "skip":
        # The decision needs the global loss: all ranks skip the same updates.
        both = torch.stack([loss_sum, grad_norm.to(loss_sum.dtype)])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(both, op=dist.ReduceOp.SUM)  # a non-finite value on any rank spreads
        finite = bool(torch.isfinite(both).all())
    if finite is not False:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    with warnings.catch_warnings():  # a skipped update still advances the schedule
        warnings.simplefilter("ignore", UserWarning)
        scheduler.step()
    return StepOutput(loss_sum, grad_norm, n_tokens, lr, finite)


class StepValues:
    """The per-step loss and gradient norm, kept on the device until ``read()`` (one
    all-reduce over ranks and one host transfer for every step since the last read)."""

    def __init__(self, info: DistInfo, losses: list[float] | None = None):
        self.info = info
        self.pending: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (step, loss, grad norm)
        # global mean loss of each step since the last record (a resumed run: those before its stop)
        self.losses: list[float] = list(losses or [])
        self.loss_last = float("nan")
        self.grad_norm_last = float("nan")

    def add(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        self.pending.append((step, loss, grad_norm))

    def read(self) -> list[tuple[int, float, float]]:
        """(step, global loss, grad norm) of the pending steps; also kept for the record."""
        if not self.pending:
            return []
        losses = torch.stack([p[1] for p in self.pending])  # (n,) this rank's means
        # Mean over ranks = the global batch's mean (equal tokens per rank).
        if self.info.world_size > 1:
            dist.all_reduce(losses, op=dist.ReduceOp.SUM)
            losses /= self.info.world_size
        norms = torch.stack([p[2].to(losses.dtype) for p in self.pending])
        values = torch.stack([losses, norms]).tolist()  # the one host sync
        out = [(p[0], lo, gn) for p, lo, gn in zip(self.pending, values[0], values[1])]
        self.pending = []
        self.losses.extend(v[1] for v in out)
        self.loss_last, self.grad_norm_last = out[-1][1], out[-1][2]
        return out

    def interval_mean(self) -> tuple[float, int]:
        """(the mean loss over the steps since the last record, how many) (and start a new
        interval)."""
        mean, n = sum(self.losses) / len(self.losses), len(self.losses)
        self.losses = []
        return mean, n

    def saved(self) -> list[float]:
        """What a checkpoint keeps of the interval (the save reads every pending step first)."""
        return list(self.losses) if not self.pending else []


def check_finite(values: list[tuple[int, float, float]], latest: Path | None) -> None:
    """``trainer.nonfinite=raise``: the first non-finite step of ``values`` stops the run."""
    for step, loss, gnorm in values:
        if not (math.isfinite(loss) and math.isfinite(gnorm)):
            raise NonFiniteLossError(
                f"non-finite loss {loss} (grad norm {gnorm}) at step {step}; "
                f"the last good checkpoint is {latest or 'none (nothing saved yet)'}. "
                "Lower optim.lr, or set trainer.nonfinite=skip to drop such updates."
            )


def metrics_record(
    state: TrainState,
    values: StepValues,
    lr: float,
    info: DistInfo,
    meter: Throughput,
    flops_tok: tuple[float, float],
    peak: float | None,
) -> dict[str, Any]:
    """The metrics.jsonl line of a logged step (collective: data counts are summed over ranks).
    ``flops_tok``: (model, hardware) training FLOPs per token, for ``mfu`` and ``hfu``."""
    tps = meter.rate()
    loader = state.loader
    loss, n = values.interval_mean()
    record = {
        "step": state.step,
        # The mean over the steps since the last record (each step's loss is the mean over
        # its global batch), loss_steps of them (fewer than logging.every where a resume
        # could not restore the steps before its stop); loss_last is this step's alone.
        "loss": loss,
        "loss_steps": n,
        "loss_last": values.loss_last,
        "lr": lr,
        "grad_norm": values.grad_norm_last,
        "tokens_per_s_global": tps,
        "tokens_per_s_per_gpu": tps / info.world_size,
        "peak_mem_gb": peak_mem_gb(info.device),
        "mfu": mfu(tps, flops_tok[0], peak, info.world_size),
        "hfu": mfu(tps, flops_tok[1], peak, info.world_size),
        "tokens_seen": state.tokens_seen,
    }
    counts = _summed(loader, "token_counts", info)  # tokens trained on per domain
    record.update({f"train_tokens/{d}": n for d, n in counts.items()})
    bad = _summed(loader, "bad_records", info)
    record.update({f"data_bad/{k}": n for k, n in bad.items() if n})
    return record


class Checkpointing:
    """The save cadence: ``maybe_save(last=)`` saves the state at every ``checkpoint.every``
    steps, at the last step and when asked (``last=True``: a stop), each step at most once."""

    def __init__(self, manager: CheckpointManager, every: int, state: TrainState, last_saved: int | None):
        self.manager, self.every, self.state = manager, every, state
        self.last_saved = last_saved
        self.last_path: Path | None = manager.latest() if last_saved is not None else None

    def due(self, last: bool = False) -> bool:
        step = self.state.step
        return self.last_saved != step and (last or step % self.every == 0)

    def maybe_save(self, last: bool = False) -> bool:
        if not self.due(last):
            return False
        self.last_path = self.manager.save(self.state)
        self.last_saved = self.state.step
        return True


# ------------------------------------------------------------------ the run
def run(
    args: TrainConfig, info: DistInfo, preempt: PreemptionHandler | None = None, config_changes: Sequence[str] = ()
) -> dict[str, Any]:
    """Train from the newest complete checkpoint (or the start) to ``trainer.steps``.

    The stop signals are caught from the start: one that arrives while the model, the
    data or the validation set are prepared, or during the loader's warm-up, stops the
    run before its first step (nothing trained, so nothing saved: ``StopRequested``, exit
    128 + the signal's number); later ones stop it at a step boundary, after a checkpoint.
    ``preempt``: the handler installed before the rendezvous (else one is installed here)."""
    own = preempt is None
    preempt = PreemptionHandler() if preempt is None else preempt
    try:
        state, manager, attn_used, resumed = build_state(args, info, preempt, config_changes)
        parts = LoopParts.create(args, info, state, manager, attn_used, resumed, preempt)
        try:
            stopped_by = train_steps(args, info, state, parts)
            finish(args, info, state, parts, stopped_by)
        finally:
            parts.close()
    except StopRequested as e:
        raise _stopped_before_training(e, Path(args.run_dir), info.is_main) from None
    finally:
        if own:
            preempt.restore()
    exported = None
    if stopped_by is None and args.checkpoint.export:
        if dist.is_initialized():
            dist.barrier()
        if info.is_main:
            from mta_repro.train.export import export_consolidated

            exported = str(export_consolidated(Path(args.run_dir)))
    return {"step": state.step, "loss": parts.values.loss_last, "stopped_by_signal": stopped_by, "export": exported}


def build_state(
    args: TrainConfig, info: DistInfo, preempt: PreemptionHandler | None = None, config_changes: Sequence[str] = ()
) -> tuple[TrainState, CheckpointManager, str | None, bool]:
    """The model (meta -> AC -> compile -> FSDP2 -> materialised with the init or the stage
    start's weights), optimizer, scheduler and loader as a TrainState, resumed from the
    newest readable checkpoint if there is one. Returns (state, manager, the attention
    implementation the self-check let run, whether it resumed). A stop signal is checked
    between these phases (``StopRequested``)."""
    ck, run_dir = args.checkpoint, Path(args.run_dir)
    check = preempt.check if preempt is not None else (lambda where: None)
    model_args, attn_used = attn_selfcheck(to_model_args(args.model), info, args.distributed.param_dtype, run_dir)
    check("the attention self-check")
    root_node = OmegaConf.structured(args)
    manager = CheckpointManager(
        run_dir,
        ck.keep,
        info.rank,
        info.world_size,
        async_save=ck.async_save,
        config_text=OmegaConf.to_yaml(root_node, resolve=True),
        save_hook=load_factory(ck.save_hook, "checkpoint.save_hook") if ck.save_hook else None,
    )
    manager.clean_stale()
    has_ckpt = ck.resume and manager.latest() is not None
    # Before any work, every rank's tokenizer against rank 0's (at a resume too: a node's
    # copy may have changed), then against the one the run (or init_from's run) recorded.
    _read_alike(args, info, "hashing its tokenizer", lambda: None)
    accepted = _agree(info, lambda: provenance.check_tokenizer(args, run_dir, manager.latest() if has_ckpt else None))

    model = build_model(model_args, device="meta")
    parallelize(model, info, args.distributed)
    init_identity: dict | None = {} if ck.init_from is not None and not has_ckpt else None
    full = None if has_ckpt else stage_start_weights(ck, model_args, info.is_main, identity=init_identity)
    materialize(model, info, full_state=full, model_args=model_args, init=not has_ckpt)
    check("building the model")
    optimizer = build_optimizer(model, args.optim)
    scheduler = build_lr_scheduler(optimizer, args.optim, args.trainer.steps)
    # The data contract (loader plugins, the validator) takes the data section as a config node,
    # a child of the whole config: plugins may read sibling sections through its parent (the
    # pipeline's continued loader reads checkpoint.init_from). Every rank opens its data
    # before any resumes (one that cannot is named on all) and their listings are compared.
    make = load_factory(args.trainer.loader)
    loader, every = _read_alike(
        args, info, "opening its data", lambda: make(root_node.data, info.rank, info.world_size)
    )
    check("opening the training data")
    state = TrainState(model, optimizer, scheduler, loader, rank=info.rank)
    resumed_from = None
    if has_ckpt:
        # The newest readable checkpoint (an unreadable one: per checkpoint.on_corrupt).
        resumed_from = manager.resume(state, ck.on_corrupt)
        if info.is_main and resumed_from is not None:
            print(f"[mta_repro.train] resumed from {resumed_from} at step {state.step}", file=sys.stderr)
    accepted += _accepted_at_start(args, info, loader, state.step, config_changes)
    if info.is_main:
        record = provenance.RunRecord(
            args,
            run_dir,
            loader,
            init_identity or None,
            resumed_from,
            accepted,
            data_roots=provenance.data_roots(every),
        )
        record.begin(state.step, info.world_size)
        commit_start(run_dir, args)  # accepted: config.yaml and .hydra/ say what it runs
        manager.provenance = record.checkpoint
    return state, manager, attn_used, resumed_from is not None


def _accepted_at_start(
    args: TrainConfig, info: DistInfo, loader, step: int, config_changes: Sequence[str]
) -> list[dict]:
    """What the loader found of the files read before (every rank), then each config change
    accepted (checkpoint.allow_config_change), from the step the run goes on at."""
    ck = args.checkpoint
    found = provenance.check_data(
        loader, ck.accept_changed_data, Path(args.run_dir), step, info.world_size, info.is_main
    )
    return found + [provenance.accepted("config", c, provenance.ACCEPT_CONFIG, step) for c in config_changes]


@dataclasses.dataclass
class LoopParts:
    """What the step loop uses besides the TrainState: logging, validation, saving,
    preemption, throughput and the per-step values."""

    manager: CheckpointManager
    logger: MetricLogger
    validator: Validator | None
    saver: Checkpointing
    preempt: PreemptionHandler
    meter: Throughput
    values: StepValues
    attn_used: str | None
    flops_tok: tuple[float, float]  # (model, hardware) training FLOPs per token
    peak: float | None
    clip: float
    loader: Any

    @classmethod
    def create(
        cls,
        args: TrainConfig,
        info: DistInfo,
        state: TrainState,
        manager: CheckpointManager,
        attn_used: str | None,
        resumed: bool,
        preempt: PreemptionHandler,
    ) -> LoopParts:
        root_node = OmegaConf.structured(args)
        config = OmegaConf.to_container(root_node, resolve=True)
        assert isinstance(config, dict)
        seq_len = args.data.seq_len
        model_args = to_model_args(args.model)
        # before the logger: a stop while the validation set is read leaves no metrics file open
        validator = maybe_validator(
            OmegaConf.create({"data": root_node.data}), args.trainer, info, seq_len, check=preempt.check
        )
        values = StepValues(info, state.restored_losses)
        state.losses = values.saved
        return cls(
            manager=manager,
            logger=MetricLogger(Path(args.run_dir), args.logging, config, info.is_main, args.trainer.steps, state.step),
            validator=validator,
            saver=Checkpointing(manager, args.checkpoint.every, state, last_saved=state.step if resumed else None),
            preempt=preempt,
            meter=Throughput(info.device),
            values=values,
            attn_used=attn_used,
            flops_tok=(model_flops_per_token(model_args, seq_len), hardware_flops_per_token(model_args, seq_len)),
            peak=device_peak_flops(info.device),
            clip=args.optim.clip if args.optim.clip > 0 else float("inf"),
            loader=state.loader,
        )

    def close(self) -> None:
        self.preempt.restore()
        self.logger.close()
        if hasattr(self.loader, "close"):
            self.loader.close()


def train_steps(args: TrainConfig, info: DistInfo, state: TrainState, parts: LoopParts) -> int | None:
    """Updates until ``trainer.steps`` or an agreed stop signal (returned, else None):
    each logged, validated and checkpointed on its cadence."""
    tr, lg, p = args.trainer, args.logging, parts
    start, agreed = state.step, None
    ready = getattr(state.loader, "ready", None)
    while state.step < tr.steps:
        # One rank reads its flag every step; several agree every logging.every steps (and
        # at once after validation stopped for a signal: every rank stopped it alike).
        if agreed is not None or info.world_size == 1 or state.step % lg.every == 0:
            stopped_by = agreed or p.preempt.agreed_signal(info.device)
            if stopped_by is not None:
                if state.step == start:  # nothing trained by this process: nothing to save
                    raise StopRequested(stopped_by, "before the first step")
                return stopped_by
        if ready is not None:
            stopped_by = read_ahead(ready, tr.grad_accum, p.preempt, info, first=state.step == start)
            if stopped_by is not None:
                return stopped_by
        out = train_step(state.model, state.optimizer, state.scheduler, state.loader, tr, p.clip, info.device)
        state.advance(out.n_tokens * info.world_size)
        step = state.step
        p.values.add(step, out.loss, out.grad_norm)
        p.meter.add(out.n_tokens * info.world_size)

        validate = p.validator is not None and (step % tr.eval_every == 0 or step == tr.steps)
        log = step % lg.every == 0 or step == tr.steps or validate
        if log or p.saver.due(last=step == tr.steps) or out.finite is not None:
            read = p.values.read()  # the host sync of this window
            if tr.nonfinite == "raise":
                check_finite(read, p.manager.latest())
        if log:
            record = metrics_record(state, p.values, out.lr, info, p.meter, p.flops_tok, p.peak)
            if out.finite is False:  # trainer.nonfinite=skip dropped this step's update
                record["skipped"] = True
            if p.attn_used is not None:  # the implementation the self-check let run
                record["attn_impl"] = p.attn_used
            if validate:
                assert p.validator is not None
                try:
                    record.update(p.validator.run(state.model, info.device, p.preempt))
                except StopRequested as e:  # every rank stopped validating at the same batch
                    agreed = e.signum
                p.meter.rate()  # validation time is not training throughput
            p.logger.log(record)
        p.logger.advance()  # after the step's line, if it had one (the bar; a line when none came for a minute)
        p.saver.maybe_save(last=step == tr.steps)
        lock_heartbeat(Path(args.run_dir), info.is_main)
    return None


def read_ahead(ready: Callable, n_batches: int, preempt: PreemptionHandler, info: DistInfo, first: bool) -> int | None:
    """The loader reads what the next step needs here (``loader.ready``), where a stop can
    still be honoured (the warm-up: the shuffle buffer's first fill): the signal that
    stopped it, or None. Before the first step a stop raises (nothing to save). On several
    ranks only the first step's reading is interruptible: later, the ranks must agree on a
    stop, at the step loop's cadence."""
    if not first and info.world_size > 1:
        ready(n_batches)
        return None
    where = "the data loader's warm-up" if first else "reading the training data"
    try:
        ready(n_batches, lambda: preempt.check(where))
    except StopRequested as e:
        if first:
            raise
        return e.signum
    return None


def finish(args: TrainConfig, info: DistInfo, state: TrainState, parts: LoopParts, stopped_by: int | None) -> None:
    """After the loop: a stop saves the state it reached (then requeues under SLURM); every
    async save in flight is finalised."""
    if stopped_by is not None:
        read = parts.values.read()
        if args.trainer.nonfinite == "raise":
            check_finite(read, parts.manager.latest())
        parts.saver.maybe_save(last=True)
    parts.manager.wait()
    if stopped_by is not None:
        requeued = requeue_if_slurm(stopped_by, info.is_main)
        if info.is_main:
            _print_stop(state.step, stopped_by, requeued, parts.saver.last_path)


def _stopped_before_training(e: StopRequested, run_dir: Path, is_main: bool) -> StopRequested:
    """The one line of a stop before the first step (``e``: where it was seen), after the
    requeue under SLURM: nothing was trained, so nothing was saved."""
    from mta_repro.weights.layout import latest_checkpoint

    requeued = requeue_if_slurm(e.signum, is_main)
    latest = latest_checkpoint(run_dir) if run_dir.is_dir() else None
    then = (
        "the job resumes by itself"
        if requeued
        else f"rerun the same command to {'resume from ' + str(latest) if latest else 'start'}"
    )
    return StopRequested(
        e.signum,
        f"stopped by {signal.Signals(e.signum).name} during {e} (before the first "
        f"step): nothing trained, nothing saved; {then}",
    )


def _print_stop(step: int, signum: int, requeued: bool, ckpt: Path | None) -> None:
    """The one line a stop by a signal leaves: the step, the checkpoint, what to do next."""
    name = signal.Signals(signum).name
    where = f"checkpoint {ckpt}" if ckpt is not None else "no checkpoint"
    then = "the job resumes by itself" if requeued else "rerun the same command to resume"
    print(
        f"[mta_repro.train] stopped at step {step} after a signal{' and requeued the job' if requeued else ''} "
        f"({name}): {where}; {then}",
        file=sys.stderr,
        flush=True,
    )


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
