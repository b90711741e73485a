"""Per-domain validation perplexity with the release's protocol (the paper's section 4).

Each domain's validation documents are tokenized with BOS and EOS and concatenated;
the stream is cut into windows of ``seq_len + 1`` tokens that advance by ``seq_len``
(input = window[:-1], target = window[1:], so every token after the first is predicted
exactly once, as the training loader packs); a trailing partial window is dropped.
Of the domain's N windows, ``max_batches * batch_size`` (256 x 4 = 1024, i.e. 2,097,152
target tokens at seq_len 2048) are scored, in batches of ``batch_size`` (a trailing
partial batch kept), chosen by ``window_sampling``:

- ``"random"`` (default): a uniform sample without replacement of the N windows
  (reservoir sampling, one pass, ``random.Random(window_seed)`` afresh for each domain),
  scored in stream order; it depends only on the seed, the tokenizer, the documents and
  the two sizes, so every model of a study is scored on the same windows (paired);
- ``"first"``: the first windows (the release's eval, and this project's before).

ppl = exp(total cross-entropy / target tokens), ``inf`` where that overflows a float (a mean
loss above ~709.78 nats: a diverged model is a result, not a crash). The average row is
the arithmetic mean of the per-domain perplexities; ``token_loss`` is the mean nats per
token over every window of every domain. Each domain keeps every window's summed
cross-entropy, target tokens and document (``batch_ce``, ``batch_tokens``, ``batch_doc``):
what a bootstrap over evaluation windows resamples, documents as blocks
(``mta_repro.report.aggregate``).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Iterator

import numpy as np
import torch
import torch.nn.functional as F

from mta_repro.errors import UserError
from mta_repro.eval.progress import Progress
from mta_repro.model.loss import perplexity

WINDOW_SAMPLING = ("random", "first")


def check_window_args(window_sampling: str, window_seed: int, max_batches: int | None = None) -> None:
    """One line naming the ``eval.ppl`` field a user set wrong."""
    if window_sampling not in WINDOW_SAMPLING:
        raise UserError(f"eval.ppl.window_sampling: expected 'random' or 'first', got {window_sampling!r}")
    if isinstance(window_seed, bool) or not isinstance(window_seed, int) or window_seed < 0:
        raise UserError(f"eval.ppl.window_seed: expected a non-negative integer, got {window_seed!r}")
    if max_batches is not None and max_batches < 1:
        raise UserError(f"eval.ppl.max_batches: expected a positive number of batches or null, got {max_batches}")


def stream_windows(docs: Iterable[str], tokenizer, seq_len: int) -> Iterator[tuple[int, int, Callable[[], list]]]:
    """Every window of the BOS/EOS-delimited concatenation of ``docs``, lazily:
    ``(window index, document, take)``. ``take()`` returns the window's ``seq_len + 1``
    token ids; call it before drawing the next item (the buffer moves on). The document is
    the index (from 0, in ``docs`` order) of the one holding most of the window's
    ``seq_len`` target tokens, the earlier one on a tie: a window that straddles two
    documents belongs to the one it mostly scores. The windows' tokens are exactly
    ``mta_repro.data.loader.validation_windows``'."""
    buf: list = []  # stream tokens from offset `base` on
    base, off = 0, 0  # stream offset of buf[0]; the next window starts at buf[off]
    starts: list = []  # (stream offset where a document starts, its index): those the next window may reach
    end = 0  # stream length so far
    w = 0
    for i, doc in enumerate(docs):
        ids = tokenizer.encode(doc, add_bos=True, add_eos=True)
        starts.append((end, i))
        end += len(ids)
        buf.extend(ids)
        while len(buf) - off >= seq_len + 1:
            lo = base + off + 1  # the window's targets: stream offsets [lo, lo + seq_len)
            hi = lo + seq_len
            best, best_n = starts[0][1], -1
            for j, (s, d) in enumerate(starts):
                e = starts[j + 1][0] if j + 1 < len(starts) else end
                n = min(e, hi) - max(s, lo)
                if n > best_n:
                    best, best_n = d, n
            yield w, best, lambda o=off: buf[o : o + seq_len + 1]
            w += 1
            off += seq_len
            while len(starts) > 1 and starts[1][0] <= base + off + 1:
                starts.pop(0)  # ends before the next window's first target
        del buf[:off]
        base, off = base + off, 0


def pick_windows(
    docs: Iterable[str],
    tokenizer,
    seq_len: int,
    count: int | None,
    window_sampling: str = "random",
    window_seed: int = 0,
) -> list[tuple[int, int, np.ndarray]]:
    """``(window index, document, (seq_len + 1,) int64 tokens)`` of ``count`` windows of the
    stream (``None``: all), in stream order: the first ones, or a seeded uniform sample
    without replacement (module docstring)."""
    check_window_args(window_sampling, window_seed)
    chosen: list = []
    items = stream_windows(docs, tokenizer, seq_len)
    if window_sampling == "first" or count is None:
        for w, doc, take in items:
            if count is not None and len(chosen) >= count:
                break
            chosen.append((w, doc, np.asarray(take(), dtype=np.int64)))
        return chosen
    rng = random.Random(window_seed)
    for w, doc, take in items:  # Algorithm R: after window w, chosen is a uniform sample of windows 0..w
        if w < count:
            chosen.append((w, doc, np.asarray(take(), dtype=np.int64)))
            continue
        j = rng.randrange(w + 1)
        if j < count:
            chosen[j] = (w, doc, np.asarray(take(), dtype=np.int64))
    return sorted(chosen, key=lambda c: c[0])


def window_ce(model, rows: torch.Tensor, chunk: int = 1024) -> list[float]:
    """Summed cross-entropy (fp32 or better) of each (seq_len + 1)-token row of ``rows``
    (B, seq_len + 1): B floats. A row is reduced as ``model.loss.sequence_ce`` reduces a
    batch of one, so a batch of one gives its number bit for bit."""
    inputs, targets = rows[:, :-1], rows[:, 1:]
    h = model(inputs, return_hidden=True)  # (B, T, dim)
    dtype = torch.promote_types(h.dtype, torch.float32)
    totals = [torch.zeros((), dtype=dtype, device=h.device) for _ in range(rows.shape[0])]
    for s in range(0, h.shape[1], chunk):  # never materialise all (B, T, V) logits
        logits = model.logits(h[:, s : s + chunk]).to(dtype)  # (B, chunk, V)
        for b, total in enumerate(totals):
            total += F.cross_entropy(logits[b], targets[b, s : s + chunk], reduction="sum")
    return [float(t) for t in totals]


@torch.no_grad()
def domain_perplexity(
    model,
    tokenizer,
    docs: Iterable[str],
    seq_len: int = 2048,
    batch_size: int = 4,
    max_batches: int | None = 256,
    desc: str = "ppl",
    window_sampling: str = "random",
    window_seed: int = 0,
) -> dict:
    """{"ppl", "loss" (mean CE, nats), "tokens", "batches", "batch_ce", "batch_tokens",
    "batch_doc"} for one domain's docs. The last three are per window, in stream order:
    summed CE (nats), target tokens and document index; they sum to loss x tokens and
    tokens."""
    if seq_len < 1 or batch_size < 1:
        raise UserError(f"ppl: seq_len and batch_size must be positive, got {seq_len}, {batch_size}")
    check_window_args(window_sampling, window_seed, max_batches)
    from mta_repro.eval import dist

    count = None if max_batches is None else max_batches * batch_size
    windows = pick_windows(docs, tokenizer, seq_len, count, window_sampling, window_seed)
    if not windows:
        raise UserError(f"ppl: the documents hold fewer than seq_len+1={seq_len + 1} tokens")
    device = next(model.parameters()).device
    batches = [windows[i : i + batch_size] for i in range(0, len(windows), batch_size)]
    ces: dict = {}  # batch index -> the summed CE of each of its windows, for this process's batches
    progress = Progress(desc, len(batches))
    for b, batch in enumerate(batches):
        if dist.mine(b):  # under torchrun each process scores every world_size-th batch
            rows = torch.from_numpy(np.stack([tokens for _, _, tokens in batch])).to(device)
            ces[b] = window_ce(model, rows)
        progress.update()
    progress.close()
    ces = dist.merge_dicts(ces)
    batch_ce = [ce for b in range(len(batches)) for ce in ces[b]]
    batch_tokens = [seq_len] * len(windows)
    n_tokens = sum(batch_tokens)
    loss = sum(batch_ce) / n_tokens  # in window order: as one process sums
    return {
        "ppl": perplexity(loss),
        "loss": loss,
        "tokens": n_tokens,
        "batches": len(batches),
        "batch_ce": batch_ce,
        "batch_tokens": batch_tokens,
        "batch_doc": [doc for _, doc, _ in windows],
    }


def validation_perplexity(
    model,
    tokenizer,
    data_args,
    domains: list | None = None,
    seq_len: int | None = None,
    batch_size: int = 4,
    max_batches: int | None = 256,
    window_sampling: str = "random",
    window_seed: int = 0,
) -> dict:
    """{"domains": {name: {...}}, "average": mean ppl, "token_loss": mean nats per token
    over every window of every domain, "tokens": their count, "seq_len": ...} over the
    data's domains."""
    from mta_repro import data as data_mod

    check_window_args(window_sampling, window_seed, max_batches)
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
            window_sampling=window_sampling,
            window_seed=window_seed,
        )
    tokens = sum(sum(v["batch_tokens"]) for v in per.values())
    return {
        "domains": per,
        "average": sum(v["ppl"] for v in per.values()) / len(per),
        # every target token weighs the same (the average above weighs every domain the same)
        "token_loss": math.fsum(ce for v in per.values() for ce in v["batch_ce"]) / tokens,
        "tokens": tokens,
        "seq_len": seq_len,
        "batch_size": batch_size,
        "max_batches": max_batches,
    }
