"""Validation during training: per-domain loss / perplexity on the validation split.

The protocol is ``mta_repro.eval``'s ppl (mta_repro/eval/ppl.py, the release's): each
domain's validation documents, BOS/EOS-wrapped and concatenated, cut by ``ppl.windows``
into windows of ``seq_len + 1`` tokens advancing by ``seq_len``; batches of
``batch_size`` windows, at most ``max_batches`` per domain, a trailing partial batch
kept; the summed cross entropy of a batch is ``ppl.sequence_ce``; ppl = exp(total CE /
target tokens), and the average is the arithmetic mean of the per-domain ppl.

Only the batches are dealt out across ranks (batch k to rank k % world_size; a rank with
fewer batches runs a discarded forward so that FSDP's collectives line up) and the sums
all-reduced, so N ranks give the single-process number up to summation order. The
windows are tokenized once and kept (int32) for the whole run.

metrics.jsonl / wandb keys: ``val_loss`` (mean of the domains' losses), ``val_ppl`` (mean
of the domains' ppl = the eval's "average" row), ``val_loss/<domain>``,
``val_ppl/<domain>``, ``val_tokens`` (target tokens evaluated, all domains).
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from mta_repro.errors import UserError
from mta_repro.eval.ppl import sequence_ce, windows


class Validator:
    def __init__(self, data_cfg, seq_len: int, batch_size: int, max_batches: int, rank: int, world_size: int):
        from mta_repro import data as data_mod

        self.rank, self.world_size = rank, world_size
        tokenizer = data_mod.build_tokenizer(data_mod.to_data_args(data_cfg).tokenizer)
        self.batches: dict[str, list[np.ndarray]] = {}
        for name in data_mod.domains(data_cfg):
            rows, out = [], []
            try:
                for w in windows(data_mod.iter_validation_docs(data_cfg, name), tokenizer, seq_len):
                    rows.append(np.asarray(w, dtype=np.int32))
                    if len(rows) == batch_size:
                        out.append(np.stack(rows))
                        rows = []
                        if len(out) >= max_batches:
                            break
            except ValueError as e:  # e.g. no validation files: say how to train without them
                raise UserError(f"validation during training: {e} (set trainer.eval_every=0 to train "
                                 "without validation)") from None
            if rows and len(out) < max_batches:
                out.append(np.stack(rows))
            if not out:
                raise UserError(
                    f"validation: the {name!r} validation documents hold fewer than data.seq_len+1="
                    f"{seq_len + 1} tokens (set trainer.eval_every=0 to train without validation)"
                )
            self.batches[name] = out

    @torch.no_grad()
    def run(self, model, device: torch.device) -> dict[str, float]:
        was_training = model.training
        model.eval()
        try:
            per: dict[str, tuple[float, int]] = {}
            for name, batches in self.batches.items():
                n_rounds = math.ceil(len(batches) / self.world_size)
                ce, tokens = 0.0, 0
                for r in range(n_rounds):
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
                out[f"val_ppl/{n}"] = math.exp(loss)
                losses.append(loss)
                ppls.append(math.exp(loss))
            out["val_loss"] = sum(losses) / len(losses)
            out["val_ppl"] = sum(ppls) / len(ppls)
            out["val_tokens"] = int(sums[:, 1].sum())
            return out
        finally:
            model.train(was_training)


def maybe_validator(cfg, tr, info, seq_len: Optional[int]) -> Optional[Validator]:
    """The run's Validator, or None (trainer.eval_every=0, or a loader without data config)."""
    if tr.eval_every == 0 or "data" not in cfg or seq_len is None:
        return None
    return Validator(cfg.data, seq_len, tr.eval_batch_size, tr.eval_max_batches, info.rank, info.world_size)
