"""The paper's motivating toy task (section 4.1): find the block with both query letters.

A sample is ``K`` blocks of ``N`` random lowercase letters joined by ".", then "#" and
``L`` query letters; exactly one block contains all the query letters (every other block
contains at most ``L - 1`` of them), and the model must output that block ("all"), its
first letter ("first") or its last letter ("last"). Semantics follow the release's
``toy_task/generate_data.py``: letters inside a block are distinct, the blocks of one
sample are distinct, the query letters are a random ordered subset of the target block,
and every sample of a set is unique, with the held-out set disjoint from the training set.

Token layout of one row (fixed length, character tokenizer)::

    <bos> b1 . b2 . ... . bK # q1 .. qL t1 .. tM <eos> <pad>...

The model reads ``tokens[:, :-1]`` and is scored on ``labels = tokens[:, 1:]`` at the
target positions only (``IGNORE`` elsewhere), as the release's ``no_loss_prompt``.
"""

from __future__ import annotations

import math
import string
from dataclasses import dataclass

import numpy as np
import torch

from mta_repro.errors import UserError

TARGETS = ("all", "first", "last")
IGNORE = -100  # label value of non-target positions (cross_entropy ignore_index)
LETTERS = string.ascii_lowercase


class CharTokenizer:
    """One id per character: pad 0, bos 1, eos 2, then ".", "#", "a".."z" (31 ids)."""

    PAD, BOS, EOS = 0, 1, 2
    SPECIALS = ("<pad>", "<bos>", "<eos>")
    CHARS = ".#" + LETTERS

    def __init__(self) -> None:
        self.itos = list(self.SPECIALS) + list(self.CHARS)
        self.stoi = {c: i for i, c in enumerate(self.itos)}
        self.n_words = len(self.itos)
        self.bos_id, self.eos_id, self.pad_id = self.BOS, self.EOS, self.PAD
        self.letter0 = self.stoi["a"]  # letters are contiguous: id = letter0 + (0..25)

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]:
        try:
            ids = [self.stoi[c] for c in text]
        except KeyError as e:
            raise UserError(f"CharTokenizer: character {e.args[0]!r} is not in the vocabulary") from None
        return ([self.BOS] if add_bos else []) + ids + ([self.EOS] if add_eos else [])

    def decode(self, ids) -> str:
        return "".join(self.itos[i] for i in ids if i >= len(self.SPECIALS))


@dataclass
class FindBlockArgs:
    """Data of the toy task (config section ``data``)."""

    # N: letters per block (distinct within a block; at most alphabet_size).
    block_length: int = 5
    # Letters to draw from: the first ``alphabet_size`` of a..z (release ``vocab_size``,
    # 26). Fewer letters make each query letter recur in more blocks, which keeps the
    # task hard with few blocks.
    alphabet_size: int = 26
    # K: blocks per sample. The release fills 319 characters, i.e. 52 blocks for N=5
    # (52*5 + 51 separators + "#" + 2 query + 5 target = 319).
    n_blocks: int = 52
    # L: query letters (distinct letters of the target block, random order).
    query_length: int = 2
    # What to output: the whole block ("all"), its first or its last letter.
    target: str = "all"
    # Row length in tokens including <bos>/<eos>; None = exactly what the layout needs
    # (the release: 319 characters + bos + eos = 321). Longer rows are right-padded.
    pad_len: int | None = None
    # Training / held-out set sizes (paper: 1M and 1K).
    n_train: int = 1_000_000
    n_test: int = 1000
    # Seed of the data generation (one data set shared by all training seeds).
    seed: int = 1234

    def __post_init__(self) -> None:
        n, k, q = self.block_length, self.n_blocks, self.query_length
        if not 1 <= self.alphabet_size <= 26:
            raise UserError(f"data.alphabet_size: expected 1..26, got {self.alphabet_size}")
        if not 1 <= n <= self.alphabet_size:
            raise UserError(f"data.block_length: expected 1..alphabet_size={self.alphabet_size} letters, got {n}")
        if k < 1:
            raise UserError(f"data.n_blocks: expected >= 1, got {k}")
        if not 1 <= q <= n:
            raise UserError(f"data.query_length: expected 1..block_length={n}, got {q}")
        # Other blocks must miss a query letter; there must be enough such blocks.
        a = self.alphabet_size
        free = math.perm(a, n) - math.perm(a, n) * math.comb(a - q, n - q) // math.comb(a, n)
        if free < k - 1:
            raise UserError(
                f"data: with alphabet_size={a}, block_length={n}, query_length={q} only {free} "
                f"distinct blocks lack a query letter, fewer than n_blocks-1={k - 1}"
            )
        if self.target not in TARGETS:
            raise UserError(f"data.target: expected one of {TARGETS}, got {self.target!r}")
        if self.n_train < 1 or self.n_test < 1:
            raise UserError("data.n_train and data.n_test: expected positive sizes")
        if self.pad_len is not None and self.pad_len < self.natural_len:
            raise UserError(
                f"data.pad_len={self.pad_len} is shorter than the {self.natural_len} tokens "
                f"a sample needs (N={n}, K={k}, L={q}, target={self.target})"
            )

    @property
    def target_len(self) -> int:
        return self.block_length if self.target == "all" else 1

    @property
    def natural_len(self) -> int:
        """Tokens of one sample: bos + blocks + separators + # + query + target + eos."""
        k, n = self.n_blocks, self.block_length
        return 1 + k * n + (k - 1) + 1 + self.query_length + self.target_len + 1

    @property
    def seq_len(self) -> int:
        return self.pad_len if self.pad_len is not None else self.natural_len


@dataclass
class FindBlockData:
    """A generated split. ``tokens``: uint8 (S, seq_len); ``target_block``: (S,) index of
    the block holding the query; ``query``/``blocks`` are letter indices 0..25."""

    tokens: torch.Tensor  # (S, seq_len) uint8 token ids
    blocks: np.ndarray  # (S, K, N) int8 letters
    query: np.ndarray  # (S, L) int8 letters
    target_block: np.ndarray  # (S,) int64

    def __len__(self) -> int:
        return self.tokens.shape[0]


def _sample_blocks(rng: np.random.Generator, shape: tuple, n: int, alphabet: int) -> np.ndarray:
    """Blocks of ``n`` distinct letters: the first n of a random permutation."""
    return np.argsort(rng.random(shape + (alphabet,)), axis=-1)[..., :n].astype(np.int8)


def _generate_chunk(args: FindBlockArgs, size: int, rng: np.random.Generator):
    n, k, q = args.block_length, args.n_blocks, args.query_length
    blocks = _sample_blocks(rng, (size, k), n, args.alphabet_size)  # (S, K, N)
    target = rng.integers(0, k, size=size)
    rows = np.arange(size)
    # Query: a random ordered subset of the target block's letters.
    pick = np.argsort(rng.random((size, n)), axis=-1)[:, :q]
    query = np.take_along_axis(blocks[rows, target], pick, axis=1)  # (S, L)
    is_target = np.zeros((size, k), dtype=bool)
    is_target[rows, target] = True
    # Rejection: other blocks must miss at least one query letter, and blocks of a
    # sample must be distinct (the release builds them as a set).
    weights = args.alphabet_size ** np.arange(n, dtype=np.int64)
    while True:
        has = (blocks[:, :, :, None] == query[:, None, None, :]).any(axis=2)  # (S, K, L)
        bad = has.all(axis=-1) & ~is_target
        codes = (blocks.astype(np.int64) * weights).sum(-1)  # (S, K)
        order = np.argsort(codes, axis=1, kind="stable")
        sorted_codes = np.take_along_axis(codes, order, axis=1)
        dup_sorted = np.zeros_like(bad)
        dup_sorted[:, 1:] = sorted_codes[:, 1:] == sorted_codes[:, :-1]
        dup = np.zeros_like(bad)
        np.put_along_axis(dup, order, dup_sorted, axis=1)
        # Of a duplicate pair resample the non-target one (the later one if neither is).
        dup_t = dup & is_target
        if dup_t.any():  # the target's twin sorts first: resample that twin instead
            r = np.nonzero(dup_t.any(axis=1))[0]
            for i in r:
                t_code = codes[i, target[i]]
                twins = np.nonzero((codes[i] == t_code) & ~is_target[i])[0]
                dup[i, twins] = True
            dup &= ~is_target
        redo = bad | dup
        if not redo.any():
            break
        blocks[redo] = _sample_blocks(rng, (int(redo.sum()),), n, args.alphabet_size)
    return blocks, query, target


def encode_rows(args: FindBlockArgs, blocks: np.ndarray, query: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Token rows (S, seq_len) uint8 from letter arrays (vectorised ``CharTokenizer``)."""
    tok = CharTokenizer()
    size, k, n = blocks.shape
    body = np.full((size, k, n + 1), tok.stoi["."], dtype=np.uint8)
    body[:, :, :n] = blocks + tok.letter0
    body = body.reshape(size, k * (n + 1))[:, :-1]  # drop the trailing "."
    tgt_block = blocks[np.arange(size), target] + tok.letter0  # (S, N)
    if args.target == "first":
        tgt_block = tgt_block[:, :1]
    elif args.target == "last":
        tgt_block = tgt_block[:, -1:]
    out = np.full((size, args.seq_len), tok.PAD, dtype=np.uint8)
    parts = [
        np.full((size, 1), tok.BOS, dtype=np.uint8),
        body,
        np.full((size, 1), tok.stoi["#"], dtype=np.uint8),
        (query + tok.letter0).astype(np.uint8),
        tgt_block.astype(np.uint8),
        np.full((size, 1), tok.EOS, dtype=np.uint8),
    ]
    row = np.concatenate(parts, axis=1)
    out[:, : row.shape[1]] = row
    return out


def target_positions(args: FindBlockArgs) -> torch.Tensor:
    """Indices into ``labels = tokens[:, 1:]`` where the target letters are (same for
    every row: the layout is fixed)."""
    first = args.natural_len - 1 - args.target_len  # token index of the first target
    return torch.arange(first - 1, first - 1 + args.target_len)


def _row_keys(tokens: np.ndarray) -> np.ndarray:
    t = np.ascontiguousarray(tokens)
    return t.view(np.dtype((np.void, t.shape[1]))).ravel()


def generate_splits(args: FindBlockArgs, chunk: int = 20_000) -> tuple[FindBlockData, FindBlockData]:
    """(train, held-out): unique samples, the two sets disjoint, seeded by ``args.seed``."""
    rng = np.random.default_rng(args.seed)
    want = args.n_test + args.n_train
    keys_seen: set = set()
    parts = []
    total = 0
    while total < want:
        size = min(chunk, max(1000, int((want - total) * 1.02)))
        b, q, t = _generate_chunk(args, size, rng)
        toks = encode_rows(args, b, q, t)
        keep = []
        for i, key in enumerate(_row_keys(toks).tolist()):
            if key not in keys_seen:
                keys_seen.add(key)
                keep.append(i)
        keep = np.asarray(keep[: want - total], dtype=np.int64)
        parts.append((toks[keep], b[keep], q[keep], t[keep]))
        total += len(keep)
    toks, b, q, t = (np.concatenate(x) for x in zip(*parts))

    def split(lo, hi):
        return FindBlockData(torch.from_numpy(toks[lo:hi].copy()), b[lo:hi], q[lo:hi], t[lo:hi].astype(np.int64))

    # The first n_test unique samples are held out, the rest train (as the release).
    return split(args.n_test, want), split(0, args.n_test)


def labels_from(tokens: torch.Tensor, args: FindBlockArgs) -> torch.Tensor:
    """(B, T-1) int64 next-token labels, ``IGNORE`` except at the target positions."""
    tokens = tokens.long()
    labels = torch.full((tokens.shape[0], tokens.shape[1] - 1), IGNORE, dtype=torch.long)
    pos = target_positions(args)
    labels[:, pos] = tokens[:, 1:][:, pos]
    return labels


def error_counts(pred: torch.Tensor, labels: torch.Tensor) -> tuple[int, int, int, int]:
    """Errors of greedy predictions at target positions (teacher forcing, as the
    release's ``eval_ppl``). pred, labels: (B, T); labels ``IGNORE`` off target.

    Returns (wrong sequences, sequences, wrong target tokens, target tokens); a sequence
    is wrong when any of its target tokens is wrong.
    """
    mask = labels != IGNORE
    wrong = (pred != labels) & mask
    return (
        int(wrong.any(dim=1).sum()),
        int(labels.shape[0]),
        int(wrong.sum()),
        int(mask.sum()),
    )


def wrong_per_target(pred: torch.Tensor, labels: torch.Tensor, args: FindBlockArgs) -> list[int]:
    """Wrong greedy predictions at each target position (first target letter first),
    summed over the batch; shows which letter of the block a model gets wrong."""
    pos = target_positions(args)
    return [int(n) for n in (pred[:, pos] != labels[:, pos]).sum(dim=0)]
