"""Validation during training: per-domain loss / perplexity on the validation split.

The protocol is ``mta_repro.eval``'s ppl (mta_repro/eval/ppl.py, the release's): each
domain's validation documents, BOS/EOS-wrapped and concatenated, cut by ``data.loader.validation_windows``
into windows of ``seq_len + 1`` tokens advancing by ``seq_len``; batches of
``batch_size`` windows, at most ``max_batches`` per domain, a trailing partial batch
kept; the summed cross entropy of a batch is ``model.loss.sequence_ce``; ppl = exp(total CE /
target tokens), and the average is the arithmetic mean of the per-domain ppl.

Only the batches are dealt out across ranks (batch k to rank k % world_size; a rank with
fewer batches runs a discarded forward so that FSDP's collectives line up) and the sums
all-reduced, so N ranks give the single-process number up to summation order. The
windows are tokenized once and kept (int32) for the whole run. A stop signal ends a
validation between two batches (and the reading of the set between two documents).

A domain too small for one window (fewer than ``seq_len + 1`` validation tokens, e.g.
the bundled corpus's arxiv at 4096) is skipped with one warning naming it; the averages
are over the domains that validated. Before training, the main process prints the cost
of one validation (windows, tokens, and the equivalent in training steps), and a run
shorter than ``trainer.eval_every`` is told that it validates once, at its last step.

metrics.jsonl / wandb keys: ``val_loss`` (mean of the domains' losses), ``val_ppl`` (mean
of the domains' ppl = the eval's "average" row), ``val_loss/<domain>``,
``val_ppl/<domain>``, ``val_tokens`` (target tokens evaluated, all domains).
"""

from __future__ import annotations

import math
import sys
import time
import warnings
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

from mta_repro.data.loader import validation_windows as windows
from mta_repro.errors import StopRequested, UserError
from mta_repro.model.loss import perplexity, sequence_ce


def _batches(windows, batch_size: int, max_batches: int) -> list[np.ndarray]:
    """At most ``max_batches`` (batch_size, seq_len + 1) int32 batches of ``windows``; the last
    one may be partial."""
    rows, out = [], []
    for w in windows:
        rows.append(np.asarray(w, dtype=np.int32))
        if len(rows) == batch_size:
            out.append(np.stack(rows))
            rows = []
            if len(out) >= max_batches:
                return out
    if rows:
        out.append(np.stack(rows))
    return out


class Validator:
    """A domain whose validation documents hold fewer than ``seq_len + 1`` tokens (one
    window; e.g. the bundled corpus's arxiv at seq_len 4096) is skipped with one warning
    naming it, and the others validate; ``skipped`` lists such domains. Only when no
    domain holds a window is it an error."""

    def __init__(
        self,
        data_cfg,
        seq_len: int,
        batch_size: int,
        max_batches: int,
        rank: int,
        world_size: int,
        check: Callable[[str], None] | None = None,
    ):
        """``check(where)``: called between documents while the validation set is read (the
        trainer's stop check, which raises to stop)."""
        from mta_repro import data as data_mod

        def docs(name):
            for doc in data_mod.iter_validation_docs(data_cfg, name):
                if check is not None:
                    check("reading the validation set")
                yield doc

        self.rank, self.world_size, self.seq_len = rank, world_size, seq_len
        self._timed = False
        tokenizer = data_mod.build_tokenizer(data_mod.to_data_args(data_cfg).tokenizer)
        self.batches: dict[str, list[np.ndarray]] = {}
        self.skipped: dict[str, int] = {}  # domain -> its validation tokens (< seq_len + 1)
        for name in data_mod.domains(data_cfg):
            try:
                out = _batches(windows(docs(name), tokenizer, seq_len), batch_size, max_batches)
            except ValueError as e:  # e.g. no validation files: say how to train without them
                raise UserError(
                    f"validation during training: {e} (set trainer.eval_every=0 to train without validation)"
                ) from None
            if not out:
                n_tokens = sum(
                    len(tokenizer.encode(d, add_bos=True, add_eos=True))
                    for d in data_mod.iter_validation_docs(data_cfg, name)
                )
                self.skipped[name] = n_tokens
                continue
            self.batches[name] = out
        if self.skipped and rank == 0:
            warnings.warn(
                "validation: skipped domain(s) "
                + ", ".join(f"{d!r} ({n:,} tokens)" for d, n in self.skipped.items())
                + f": fewer validation tokens than one window of data.seq_len+1={seq_len + 1}; "
                "val_ppl averages the other domains",
                stacklevel=2,
            )
        if not self.batches:
            raise UserError(
                f"validation: no domain's validation documents hold data.seq_len+1={seq_len + 1} tokens "
                f"({', '.join(f'{d} {n:,}' for d, n in self.skipped.items())}); set trainer.eval_every=0 to "
                "train without validation"
            )

    @property
    def n_windows(self) -> int:
        return sum(b.shape[0] for bs in self.batches.values() for b in bs)

    def cost(self, tokens_per_step: int) -> str:
        """One line: what one validation evaluates and what it costs in training steps."""
        n_batches = sum(len(b) for b in self.batches.values())
        tokens = self.n_windows * self.seq_len
        # a forward pass is about a third of a training step's work on the same tokens
        steps = tokens / (3 * tokens_per_step) if tokens_per_step else float("nan")
        return (
            f"{self.n_windows} windows of {self.seq_len} tokens in {n_batches} forward batches over "
            f"{len(self.batches)} domains ({tokens:,} tokens, about the compute of {steps:.1f} training steps)"
        )

    @torch.no_grad()
    def run(self, model, device: torch.device, preempt=None) -> dict[str, float]:
        """The metrics of one validation. ``preempt`` (the trainer's PreemptionHandler): a
        stop signal is looked for before every batch (agreed over ranks, so that all stop at
        the same batch and FSDP's collectives line up) and stops the validation with
        ``StopRequested``."""
        was_training = model.training
        model.eval()
        t0 = time.monotonic()
        try:
            per: dict[str, tuple[float, int]] = {}
            for name, batches in self.batches.items():
                n_rounds = math.ceil(len(batches) / self.world_size)
                ce, tokens = 0.0, 0
                for r in range(n_rounds):
                    if preempt is not None:
                        sig = preempt.agreed_signal(device) if self.world_size > 1 else preempt.signum
                        if sig is not None:
                            raise StopRequested(sig, "validation")
                    k = r * self.world_size + self.rank
                    b = batches[k] if k < len(batches) else batches[0]  # padding forward, discarded
                    t = torch.from_numpy(b.astype(np.int64)).to(device)
                    got = float(sequence_ce(model, t[:, :-1], t[:, 1:]))
                    if k < len(batches):
                        ce, tokens = ce + got, tokens + t[:, 1:].numel()
                per[name] = (ce, tokens)
            names = list(per)
            sums = torch.tensor([[per[n][0], per[n][1]] for n in names], dtype=torch.float64, device=device)
            if dist.is_initialized() and self.world_size > 1:
                dist.all_reduce(sums, op=dist.ReduceOp.SUM)
            out: dict[str, float] = {}
            losses, ppls = [], []
            for i, n in enumerate(names):
                loss = float(sums[i, 0] / sums[i, 1])
                out[f"val_loss/{n}"] = loss
                out[f"val_ppl/{n}"] = perplexity(loss)  # inf for a diverged model, not an OverflowError
                losses.append(loss)
                ppls.append(perplexity(loss))
            out["val_loss"] = sum(losses) / len(losses)
            out["val_ppl"] = sum(ppls) / len(ppls)
            out["val_tokens"] = int(sums[:, 1].sum())
            if self.rank == 0 and not self._timed:  # the measured cost, once
                self._timed = True
                print(f"[mta_repro.train] validation took {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
            return out
        finally:
            model.train(was_training)


def maybe_validator(cfg, tr, info, seq_len: int | None, check: Callable[[str], None] | None = None) -> Validator | None:
    """The run's Validator, or None (trainer.eval_every=0, or a loader without data config).

    Before training starts, the main process prints what one validation costs; a run
    shorter than ``eval_every`` validates once, at its last step, and is told so with
    the overrides that make it smaller or skip it."""
    if tr.eval_every == 0 or "data" not in cfg or seq_len is None:
        return None
    v = Validator(cfg.data, seq_len, tr.eval_batch_size, tr.eval_max_batches, info.rank, info.world_size, check)
    if info.rank == 0:
        per_step = int(cfg.data.batch_size) * seq_len * info.world_size * tr.grad_accum
        when = (
            f"once, at the last step (trainer.steps={tr.steps} < trainer.eval_every={tr.eval_every})"
            if tr.steps < tr.eval_every
            else f"every {tr.eval_every} steps and at the last"
        )
        line = f"[mta_repro.train] validation {when}: {v.cost(per_step)}"
        if tr.steps < tr.eval_every:
            line += "; trainer.eval_max_batches=N makes it smaller, trainer.eval_every=0 skips it"
        print(line, file=sys.stderr, flush=True)
    return v
