"""Config of the data pipeline: the root config's ``data`` field (``configs/data/*.yaml``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from mta_repro.dataclass_config import to_dataclass
from mta_repro.errors import UserError
from mta_repro.resources import ROOT

# where relative paths not under the working directory are found: the clone's root, or an
# installed wheel's copy of the bundled corpus and tokenizer (mta_repro/resources.py)
REPO_ROOT = ROOT

# The paper's per-*document* domain weights (the paper's section 4; the release's config).
PAPER_WEIGHTS = {
    "arxiv": 0.023,
    "book": 0.021,
    "c4": 0.081,
    "commoncrawl": 0.726,
    "github": 0.049,
    "stackexchange": 0.05,
    "wikipedia": 0.05,
}

LAYOUTS = ("slimpajama", "domains")
# The most tokens a shuffle buffer may hold per rank (8 GiB as int32 ids, far beyond a
# corpus's worth for any buffer that shuffles): larger is a typo, and its fill would read
# a whole corpus before the check against the corpus could refuse it.
BUFFER_TOKENS = 2**31
TOKENIZERS = ("sentencepiece", "tiktoken", "bytes")


@dataclass
class TokenizerArgs:
    # "sentencepiece" (a .model file), "tiktoken" (a Llama-3 style BPE ranks file,
    # e.g. Meta's Llama-3 `tokenizer.model`) or "bytes" (UTF-8 bytes, needs no file).
    name: str = "sentencepiece"
    # Path of the tokenizer file; relative paths are tried from the working directory,
    # then from the repository root. Ignored by "bytes".
    path: str | None = field(default="data/tokenizer/mini_sp8192.model", metadata={"run_dir": "safe", "path": True})


@dataclass
class DataArgs:
    # Corpus root. layout "slimpajama": the release, <root>/train/chunkK/*.jsonl.zst and
    # <root>/validation/chunkK/*, records {"text", "meta": {"redpajama_set_name"}}.
    # layout "domains": <root>/<domain>/*.jsonl[.zst] (train: *.chunk.NN.jsonl* if any,
    # else every *.jsonl* but *.val.jsonl*; validation: *.val.jsonl*), as written by
    # scripts/prepare_slimpajama.py and read by the official release.
    # Default: the bundled small corpus (data/README.md).
    root_dir: str = field(default="data/mini_slimpajama", metadata={"run_dir": "safe", "path": True})
    layout: str = "slimpajama"
    # Probability weights of the domains, per *document* (normalised; 0 leaves a domain
    # out). Every domain named must exist; there is no implicit default weight.
    sources: dict[str, float] = field(default_factory=lambda: dict(PAPER_WEIGHTS))
    # Tokens per training sequence; windows of seq_len + 1 tokens give input and target.
    seq_len: int = 256
    # Sequences per batch on each rank.
    batch_size: int = 4
    # Seed of domain sampling and of the shuffle buffer (combined with the rank).
    seed: int = 42
    # Packed sequences held per rank and handed out in random order (0 or 1: in order).
    # At most the windows the rank's share of the corpus holds (the loader refuses more) and
    # 2**31 tokens in all (shuffle_buffer x (seq_len + 1)).
    shuffle_buffer: int = 64
    # Batches made ahead by a background thread (0: made on demand, in the caller).
    prefetch: int = field(default=0, metadata={"run_dir": "free"})
    # Wrap every document in BOS ... EOS (the paper does both).
    add_bos: bool = True
    add_eos: bool = True
    tokenizer: TokenizerArgs = field(default_factory=TokenizerArgs)
    # Records (JSONL lines) longer than this many bytes are skipped and counted as bad
    # ("oversize", logged as data_bad/oversize): read past in pieces, never held or
    # tokenized whole. 16 MiB is ~160x the largest record of the bundled corpus, and small
    # enough to tokenize, which memory grows with (docs/trust.md has the measurements).
    max_record_bytes: int = 16 << 20


def resolve_path(p: str | Path) -> Path:
    """A path as given if absolute or present under the working directory, else under
    ``REPO_ROOT`` (the clone's root, or the installed package's bundled files).

    Lets the bundled defaults work from any directory (Hydra may change the cwd).
    """
    path = Path(p).expanduser()
    if path.is_absolute() or path.exists():
        return path
    alt = REPO_ROOT / path
    return alt if alt.exists() else path


def to_data_args(cfg) -> DataArgs:
    """DataArgs from a DictConfig / dict / DataArgs (the ``data`` node), validated."""
    args = to_dataclass(DataArgs, cfg, "data")
    validate(args)
    return args


def validate(args: DataArgs) -> None:
    """Config faults -> ValueError naming the field (files are checked when opened)."""
    if args.layout not in LAYOUTS:
        raise UserError(f"data.layout={args.layout!r}: expected one of {LAYOUTS}")
    if args.tokenizer.name not in TOKENIZERS:
        raise UserError(f"data.tokenizer.name={args.tokenizer.name!r}: expected one of {TOKENIZERS}")
    for key in ("seq_len", "batch_size"):
        v = getattr(args, key)
        if not isinstance(v, int) or v < 1:
            raise UserError(f"data.{key}={v!r}: expected a positive integer")
    if (
        isinstance(args.max_record_bytes, bool)
        or not isinstance(args.max_record_bytes, int)
        or args.max_record_bytes < 1
    ):
        raise UserError(f"data.max_record_bytes={args.max_record_bytes!r}: expected a positive integer (bytes)")
    for key in ("shuffle_buffer", "prefetch"):
        v = getattr(args, key)
        if not isinstance(v, int) or v < 0:
            raise UserError(f"data.{key}={v!r}: expected an integer >= 0")
    if args.shuffle_buffer * (args.seq_len + 1) > BUFFER_TOKENS:
        raise UserError(
            f"data.shuffle_buffer={args.shuffle_buffer:,} windows of data.seq_len+1={args.seq_len + 1:,} tokens "
            f"is {args.shuffle_buffer * (args.seq_len + 1):,} tokens per rank: expected at most 2**31 "
            f"({BUFFER_TOKENS:,}); configs/data/ sets 64 windows"
        )
    if not args.sources:
        raise UserError("data.sources is empty: expected {domain: weight, ...}")
    for name, w in args.sources.items():
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
            raise UserError(f"data.sources.{name}={w!r}: expected a finite number")
        if w < 0:
            raise UserError(f"data.sources.{name}={w!r}: weights must be >= 0")
    total = sum(float(w) for w in args.sources.values())  # inf where the weights overflow
    if total <= 0:
        raise UserError(f"data.sources: all weights are zero ({dict(args.sources)})")
    if not math.isfinite(total):  # each finite, the sum not: every normalised weight would be 0
        raise UserError(
            f"data.sources: the weights sum to {total} (too large to normalise): {dict(args.sources)}; "
            "give weights whose sum is a finite number, e.g. the paper's fractions"
        )


def active_sources(args: DataArgs) -> dict[str, float]:
    """The domains with positive weight, sorted by name, weights normalised to sum 1."""
    total = sum(float(w) for w in args.sources.values())  # inf where the weights overflow
    return {k: float(args.sources[k]) / total for k in sorted(args.sources) if args.sources[k] > 0}
