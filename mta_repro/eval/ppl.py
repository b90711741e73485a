"""Per-domain validation perplexity with the release's protocol (the paper's section 4).

Each domain's validation documents are tokenized with BOS and EOS and concatenated;
the stream is cut into windows of ``seq_len + 1`` tokens that advance by ``seq_len``
(input = window[:-1], target = window[1:], so every token after the first is predicted
exactly once, as the training loader packs). Windows go in batches of ``batch_size``
(4), at most ``max_batches`` (256, i.e. 2,097,152 target tokens at seq_len 2048) per
domain; a trailing partial window is dropped, a trailing partial batch is kept.
ppl = exp(total cross-entropy / target tokens), ``inf`` where that overflows a float (a mean
loss above ~709.78 nats: a diverged model is a result, not a crash). The average row is
the arithmetic mean of the per-domain perplexities. Each domain also keeps every
batch's summed cross-entropy and target tokens (``batch_ce``, ``batch_tokens``): what a
bootstrap over evaluation windows resamples (``mta_repro.report.aggregate``; with
``batch_size=1`` a batch is one window).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from mta_repro.data.loader import validation_windows as windows
from mta_repro.errors import UserError
from mta_repro.eval.progress import Progress
from mta_repro.model.loss import perplexity, sequence_ce


@torch.no_grad()
def domain_perplexity(
    model,
    tokenizer,
    docs: Iterable[str],
    seq_len: int = 2048,
    batch_size: int = 4,
    max_batches: int | None = 256,
    desc: str = "ppl",
) -> dict:
    """{"ppl", "loss" (mean CE, nats), "tokens", "batches", "batch_ce", "batch_tokens"}
    for one domain's docs (the last two: per batch, in order; they sum to loss x tokens
    and tokens)."""
    if seq_len < 1 or batch_size < 1:
        raise UserError(f"ppl: seq_len and batch_size must be positive, got {seq_len}, {batch_size}")
    from mta_repro.eval import dist

    device = next(model.parameters()).device
    n_tokens, n_batches = 0, 0
    ces: dict = {}  # batch index -> summed CE, for this process's batches
    batch_tokens: list = []  # target tokens of every batch, in order
    batch: list = []

    progress = Progress(desc, max_batches)

    def run(rows, index):
        # under torchrun each process scores every world_size-th batch
        if dist.mine(index):
            t = torch.tensor(rows, dtype=torch.long, device=device)
            ces[index] = float(sequence_ce(model, t[:, :-1], t[:, 1:]))
        progress.update()
        batch_tokens.append(len(rows) * (len(rows[0]) - 1))
        return batch_tokens[-1]

    for w in windows(docs, tokenizer, seq_len):
        batch.append(w)
        if len(batch) == batch_size:
            n_tokens, n_batches, batch = n_tokens + run(batch, n_batches), n_batches + 1, []
            if max_batches is not None and n_batches >= max_batches:
                break
    if batch and (max_batches is None or n_batches < max_batches):
        n_tokens, n_batches = n_tokens + run(batch, n_batches), n_batches + 1
    progress.close()
    ces = dist.merge_dicts(ces)
    total = sum(ces[i] for i in range(n_batches))  # in batch order: as one process sums
    if n_tokens == 0:
        raise UserError(f"ppl: the documents hold fewer than seq_len+1={seq_len + 1} tokens")
    loss = total / n_tokens
    return {
        "ppl": perplexity(loss),
        "loss": loss,
        "tokens": n_tokens,
        "batches": n_batches,
        "batch_ce": [ces[i] for i in range(n_batches)],
        "batch_tokens": batch_tokens,
    }


def validation_perplexity(
    model,
    tokenizer,
    data_args,
    domains: list | None = None,
    seq_len: int | None = None,
    batch_size: int = 4,
    max_batches: int | None = 256,
) -> dict:
    """{"domains": {name: {...}}, "average": mean ppl, "seq_len": ...} over the data's domains."""
    from mta_repro import data as data_mod

    names = list(domains) if domains else list(data_mod.domains(data_args))
    known = set(data_mod.domains(data_args))
    unknown = [d for d in names if d not in known]
    if unknown:
        raise UserError(f"eval.ppl.domains: unknown domain(s) {unknown}; the data has {sorted(known)}")
    seq_len = seq_len or int(data_args.seq_len)
    per = {}
    for name in names:
        per[name] = domain_perplexity(
            model,
            tokenizer,
            data_mod.iter_validation_docs(data_args, name),
            seq_len,
            batch_size,
            max_batches,
            desc=f"ppl/{name}",
        )
    return {
        "domains": per,
        "average": sum(v["ppl"] for v in per.values()) / len(per),
        "seq_len": seq_len,
        "batch_size": batch_size,
        "max_batches": max_batches,
    }
