"""Batched generation with a KV cache, for every attention variant.

Prompts of different lengths are left-padded; ``key_valid`` marks the pads so no real
token attends to them (RoPE is relative, so a shifted start changes nothing but
rounding). The model's cache holds keys and values at the model's n_kv_heads heads
(grouped-query attention repeats them per query head after the cache, as the release
does), and also keeps the last W rotated queries of MTA layers,
whose query-direction convolutions read earlier score rows, so cached decoding gives
the logits of a full forward pass (tested in tests/test_eval_generate.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from mta_repro.errors import UserError
from mta_repro.model import KVCache, Transformer


@dataclass
class GenerationResult:
    tokens: list  # per prompt: the new token ids (stop/eos token included if hit)
    # per prompt: (n_new, vocab) logits that chose each new token (only if asked)
    logits: list | None = None
    finished: list = field(default_factory=list)  # True when eos/stop ended the row


def sample_next(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """logits (B, V) -> next ids (B,). temperature 0 = greedy (argmax)."""
    if temperature <= 0.0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass before it already reaches top_p (keep >= 1 token).
        drop = probs.cumsum(-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | None = None,
    stop_fn: Callable[[int, list], bool] | None = None,
    pad_id: int = 0,
    generator: torch.Generator | None = None,
    return_logits: bool = False,
) -> GenerationResult:
    """Generate up to ``max_new_tokens`` after each prompt (lists of ids, non-empty).

    stop_fn(row, new_ids) -> True ends that row (e.g. a stop string was produced).
    Rows that ended keep being fed (their outputs are ignored) until all rows end.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise UserError("generate: every prompt needs at least one token")
    device = next(model.parameters()).device
    bsz = len(prompts)
    longest = max(len(p) for p in prompts)
    tokens = torch.full((bsz, longest), pad_id, dtype=torch.long, device=device)
    valid = torch.zeros((bsz, longest), dtype=torch.bool, device=device)
    for i, p in enumerate(prompts):  # left padding: the last token of every row aligns
        tokens[i, longest - len(p) :] = torch.as_tensor(list(p), dtype=torch.long)
        valid[i, longest - len(p) :] = True
    padded = not bool(valid.all())
    cache = KVCache.empty(len(model.layers))
    logits = model(tokens, cache=cache, key_valid=valid if padded else None)[:, -1]

    out = [[] for _ in range(bsz)]
    chosen_logits: list[list[torch.Tensor]] = [[] for _ in range(bsz)]
    done = [False] * bsz
    for step in range(max_new_tokens):
        nxt = sample_next(logits, temperature, top_k, top_p, generator)
        ids = nxt.tolist()  # one device-to-host copy per step for the whole batch
        step_logits = logits.cpu() if return_logits else None
        for i, tok in enumerate(ids):
            if done[i]:
                continue
            out[i].append(tok)
            if step_logits is not None:
                chosen_logits[i].append(step_logits[i])
            if (eos_id is not None and tok == eos_id) or (stop_fn is not None and stop_fn(i, out[i])):
                done[i] = True
        if all(done) or step == max_new_tokens - 1:
            break  # no forward pass for a token nobody will use
        if padded:
            valid = torch.cat([valid, torch.ones((bsz, 1), dtype=torch.bool, device=device)], dim=1)
        logits = model(nxt[:, None], cache=cache, key_valid=valid if padded else None)[:, -1]
    out_logits = [torch.stack(x) if x else torch.empty(0) for x in chosen_logits] if return_logits else None
    return GenerationResult(tokens=out, logits=out_logits, finished=done)


def _cut_at_stop(text: str, until: Sequence[str]) -> tuple[str, bool]:
    cut = [text.find(s) for s in until if s and s in text]
    if not cut:
        return text, False
    return text[: min(cut)], True


class StopStrings:
    """``stop_fn`` for :func:`generate`: True once a row's new text holds a stop string.

    Each call decodes only the ids since the last complete character (plus the ids before
    them as context, for tokenizers such as SentencePiece whose pieces' leading spaces
    depend on what precedes them), not all new ids again: the cost per token stays flat
    instead of growing with the text. A stop string that first appears must overlap the
    characters just added, so only the text's tail is searched. A hit is confirmed on the
    whole decoded text, so a row stops exactly where decoding every id would stop it.
    """

    def __init__(self, decode: Callable[[list], str], until: Sequence[str]) -> None:
        self.decode = decode
        self.until = tuple(s for s in until if s)
        self.longest = max((len(s) for s in self.until), default=0)
        # per row: [text so far, start of the context window, start of the undecoded ids]
        self.rows: dict[int, list] = {}

    def __call__(self, row: int, new_ids: list) -> bool:
        if not self.until:
            return False
        state = self.rows.setdefault(row, ["", 0, 0])
        text, prefix, read = state
        before = self.decode(new_ids[prefix:read])
        after = self.decode(new_ids[prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return False  # the new ids complete no character yet: wait for the next one
        start = max(0, len(text) - self.longest + 1)  # a new hit ends in the added text
        text += after[len(before) :]
        state[:] = [text, read, len(new_ids)]
        if not any(s in text[start:] for s in self.until):
            return False
        return _cut_at_stop(self.decode(new_ids), self.until)[1]


@torch.no_grad()
def generate_text(
    model: Transformer,
    tokenizer,
    prompts: Sequence[str],
    max_new_tokens: int,
    *,
    until: Sequence[str] = (),
    max_length: int | None = None,
    batch_size: int = 8,
    add_bos: bool = True,
    stop_at_eos: bool = True,
    **sampling,
) -> list[str]:
    """Continuations of text prompts, cut before the first stop string in ``until``.

    max_length: longest context (prompt + new tokens); longer prompts keep their end.
    Prompts are sorted by length so each batch pads little; results keep input order.
    """
    encoded = [tokenizer.encode(p, add_bos=add_bos, add_eos=False) for p in prompts]
    if max_length is not None:
        keep = max_length - max_new_tokens
        if keep < 1:
            raise UserError(f"generate: max_length={max_length} leaves no room for a prompt")
        encoded = [e[-keep:] for e in encoded]
    order = sorted(range(len(prompts)), key=lambda i: -len(encoded[i]))
    results: list = [None] * len(prompts)
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]

        res = generate(
            model,
            [encoded[i] for i in idx],
            max_new_tokens,
            eos_id=tokenizer.eos_id if stop_at_eos else None,
            stop_fn=StopStrings(tokenizer.decode, until) if any(until) else None,
            **sampling,
        )
        for row, i in enumerate(idx):
            ids = res.tokens[row]
            if stop_at_eos and ids and ids[-1] == tokenizer.eos_id:
                ids = ids[:-1]
            results[i] = _cut_at_stop(tokenizer.decode(ids), until)[0]
    return results
