"""Tokenizers behind one interface: ``n_words``, ``bos_id``, ``eos_id``, ``encode``, ``decode``.

- ``sentencepiece``: a SentencePiece ``.model`` (the bundled ``data/tokenizer/mini_sp8192.model``).
- ``tiktoken``: a Llama-3 style BPE ranks file (Meta's Llama-3 ``tokenizer.model``:
  128,000 ranks + 256 special tokens = 128,256 ids, ``<|begin_of_text|>`` = 128000,
  ``<|end_of_text|>`` = 128001), text encoded with ``encode_ordinary`` (special-token
  strings inside documents are plain text).
- ``bytes``: UTF-8 bytes 0..255, BOS 256, EOS 257; needs no file.

``decode`` drops BOS/EOS (and other special tokens) for all three.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Protocol

from mta_repro.data.args import TOKENIZERS, TokenizerArgs, resolve_path
from mta_repro.errors import UserError


class Tokenizer(Protocol):
    n_words: int  # vocabulary size including special tokens
    bos_id: int
    eos_id: int

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


def _wrap(ids: list[int], bos: int, eos: int, add_bos: bool, add_eos: bool) -> list[int]:
    if add_bos:
        ids.insert(0, bos)
    if add_eos:
        ids.append(eos)
    return ids


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255; BOS 256, EOS 257."""

    def __init__(self) -> None:
        self.bos_id, self.eos_id, self.n_words = 256, 257, 258

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]:
        return _wrap(list(text.encode("utf-8")), self.bos_id, self.eos_id, add_bos, add_eos)

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class SentencePieceTokenizer:
    def __init__(self, path: str) -> None:
        import sentencepiece as spm

        try:
            self.sp = spm.SentencePieceProcessor(model_file=str(path))
        except (OSError, RuntimeError) as e:  # sentencepiece's for a missing, empty or foreign file
            raise UserError(f"data.tokenizer.path={path}: not a sentencepiece model ({e})") from None
        self.n_words = self.sp.vocab_size()
        self.bos_id, self.eos_id = self.sp.bos_id(), self.sp.eos_id()
        if self.bos_id < 0 or self.eos_id < 0:
            raise UserError(f"data.tokenizer.path={path}: the sentencepiece model has no BOS/EOS pieces")

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]:
        return _wrap(self.sp.encode(text), self.bos_id, self.eos_id, add_bos, add_eos)

    def decode(self, ids: list[int]) -> str:
        return self.sp.decode(list(ids))


# Llama 3's pre-tokenisation pattern (public in Meta's llama3 repository).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
N_SPECIAL = 256


def llama3_special_tokens() -> list[str]:
    """Llama 3's 256 special tokens in id order (ids n_ranks + 0 .. n_ranks + 255)."""
    named = [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|reserved_special_token_0|>",
        "<|reserved_special_token_1|>",
        "<|reserved_special_token_2|>",
        "<|reserved_special_token_3|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|reserved_special_token_4|>",
        "<|eot_id|>",
    ]
    return named + [f"<|reserved_special_token_{i}|>" for i in range(5, N_SPECIAL - 5)]


class TikTokenTokenizer:
    # tiktoken's regex gets slow on very long texts / runs without a split point, so a
    # document is encoded in pieces (as Meta's reference tokenizer does).
    MAX_CHARS = 400_000
    MAX_RUN = 25_000

    def __init__(self, path: str) -> None:
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        try:
            ranks = load_tiktoken_bpe(str(path))
        except (OSError, ValueError) as e:  # unreadable; a line that is not `base64 rank`
            raise UserError(
                f"data.tokenizer.path={path}: not a tiktoken BPE ranks file ({type(e).__name__}: {e})"
            ) from None
        if not ranks or sorted(ranks.values()) != list(range(len(ranks))):
            raise UserError(f"data.tokenizer.path={path}: ranks must be 0..n-1 without gaps")
        missing = [b for b in range(256) if bytes([b]) not in ranks]
        if missing:
            raise UserError(f"data.tokenizer.path={path}: {len(missing)} single bytes have no rank (e.g. {missing[0]})")
        n = len(ranks)
        specials = {tok: n + i for i, tok in enumerate(llama3_special_tokens())}
        self.model = tiktoken.Encoding(
            name=Path(path).name, pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens=specials
        )
        self.n_words = n + N_SPECIAL
        self.bos_id = specials["<|begin_of_text|>"]
        self.eos_id = specials["<|end_of_text|>"]
        self._n_ranks = n

    _RUN = re.compile(rf"\s{{{MAX_RUN}}}|\S{{{MAX_RUN}}}")

    def _pieces(self, text: str):
        for i in range(0, len(text), self.MAX_CHARS):
            chunk = text[i : i + self.MAX_CHARS]
            prev = 0
            for m in self._RUN.finditer(chunk):  # cut long space / non-space runs
                yield chunk[prev : m.end()]
                prev = m.end()
            yield chunk[prev:]

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]:
        if len(text) <= self.MAX_RUN:  # fast path: no run can be too long
            ids = self.model.encode_ordinary(text)
        else:
            ids = [t for p in self._pieces(text) for t in self.model.encode_ordinary(p)]
        return _wrap(ids, self.bos_id, self.eos_id, add_bos, add_eos)

    def decode(self, ids: list[int]) -> str:
        return self.model.decode([i for i in ids if i < self._n_ranks])


def build_tokenizer(tok_args: TokenizerArgs) -> Tokenizer:
    """The tokenizer named by ``tok_args`` (``data.tokenizer``); ValueError on a bad name or file."""
    name = tok_args.name
    if name == "bytes":
        return ByteTokenizer()
    if name not in TOKENIZERS:
        raise UserError(f"data.tokenizer.name={name!r}: expected one of {TOKENIZERS}")
    if not tok_args.path:
        raise UserError(f"data.tokenizer.path is empty: the {name} tokenizer needs a file")
    path = resolve_path(tok_args.path)
    if not path.is_file():
        raise UserError(f"data.tokenizer.path={tok_args.path}: no such file")
    return SentencePieceTokenizer(str(path)) if name == "sentencepiece" else TikTokenTokenizer(str(path))
