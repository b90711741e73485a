"""Tokenizers: round trips, special-token ids, vocabulary sizes, bad files."""

import base64

import pytest

from mta_repro.data import TokenizerArgs, build_tokenizer
from mta_repro.data.args import REPO_ROOT
from mta_repro.data.tokenizers import llama3_special_tokens

TEXTS = [
    "Hello, world!",
    "  def f(x):\n\treturn x ** 2  # two spaces before, tab inside\n\n",
    "Ünïcødé, emoji 😀, CJK 中文, RTL שלום, combining é.",
    "",
    "123456789 0.25e-3 <|begin_of_text|> </s> <s>",
]


def test_bytes_tokenizer():
    tok = build_tokenizer(TokenizerArgs(name="bytes", path=None))
    assert (tok.n_words, tok.bos_id, tok.eos_id) == (258, 256, 257)
    for t in TEXTS:
        ids = tok.encode(t)
        assert ids == [256] + list(t.encode("utf-8")) + [257]
        assert tok.decode(ids) == t
    assert tok.encode("ab", add_bos=False, add_eos=False) == [97, 98]


def test_bundled_sentencepiece():
    import sentencepiece as spm

    path = REPO_ROOT / "data/tokenizer/mini_sp8192.model"
    tok = build_tokenizer(TokenizerArgs(name="sentencepiece", path=str(path)))
    assert (tok.n_words, tok.bos_id, tok.eos_id) == (8192, 1, 2)
    sp = spm.SentencePieceProcessor(model_file=str(path))
    assert (sp.id_to_piece(1), sp.id_to_piece(2)) == ("<s>", "</s>")
    # byte fallback: all 256 byte pieces exist, so any text is representable
    assert all(sp.piece_to_id(f"<0x{b:02X}>") != sp.unk_id() for b in range(256))
    for t in TEXTS:
        ids = tok.encode(t)
        assert ids[0] == 1 and ids[-1] == 2
        assert 1 not in ids[1:-1] and 2 not in ids[1:-1]  # "<s>" in text is plain text
        assert all(0 <= i < 8192 for i in ids)
        assert tok.decode(ids) == t  # identity normalisation: exact round trip
    assert tok.encode("abc", add_bos=False, add_eos=False) == sp.encode("abc")


def _write_ranks(path, merges):
    """A tiktoken ranks file: the 256 single bytes, then ``merges`` in order."""
    toks = [bytes([b]) for b in range(256)] + merges
    path.write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(toks)))
    return {t: i for i, t in enumerate(toks)}


def test_tiktoken_llama3_layout(tmp_path):
    ranks = _write_ranks(tmp_path / "tokenizer.model", [b"th", b"he", b"the", b" t", b" the"])
    n = len(ranks)
    tok = build_tokenizer(TokenizerArgs(name="tiktoken", path=str(tmp_path / "tokenizer.model")))
    # Llama 3: n ranks + 256 specials; BOS = n, EOS = n + 1 (128000/128001 for 128,000 ranks)
    assert (tok.n_words, tok.bos_id, tok.eos_id) == (n + 256, n, n + 1)
    specials = llama3_special_tokens()
    assert len(specials) == len(set(specials)) == 256
    assert specials[:2] == ["<|begin_of_text|>", "<|end_of_text|>"] and specials[9] == "<|eot_id|>"
    # BPE by rank: t,h -> th (256); th,e -> the (258). " the" is one pre-token -> 260.
    assert tok.encode("the", add_bos=False, add_eos=False) == [ranks[b"the"]]
    assert tok.encode(" the", add_bos=False, add_eos=False) == [ranks[b" the"]]
    assert tok.encode("hi", add_bos=False, add_eos=False) == [ord("h"), ord("i")]
    for t in TEXTS:
        ids = tok.encode(t)
        assert ids[0] == n and ids[-1] == n + 1
        assert all(i < n for i in ids[1:-1])  # special-token text is encoded as ordinary text
        assert tok.decode(ids) == t
    # long whitespace runs are cut into pieces and still round-trip
    long = "x" + " " * 60_000 + "the end"
    assert tok.decode(tok.encode(long)) == long


def test_tokenizer_config_faults(tmp_path):
    with pytest.raises(ValueError, match="data.tokenizer.name"):
        build_tokenizer(TokenizerArgs(name="gpt2", path=None))
    with pytest.raises(ValueError, match="no such file"):
        build_tokenizer(TokenizerArgs(name="sentencepiece", path=str(tmp_path / "missing.model")))
    with pytest.raises(ValueError, match="needs a file"):
        build_tokenizer(TokenizerArgs(name="tiktoken", path=None))
    junk = tmp_path / "junk.model"
    junk.write_text("this is not a tokenizer\n")
    with pytest.raises(ValueError, match="junk.model.*not a sentencepiece model"):
        build_tokenizer(TokenizerArgs(name="sentencepiece", path=str(junk)))
    with pytest.raises(ValueError, match="junk.model.*not a tiktoken"):
        build_tokenizer(TokenizerArgs(name="tiktoken", path=str(junk)))
    # a sentencepiece model is not a tiktoken ranks file either
    with pytest.raises(ValueError, match="mini_sp8192.model"):
        build_tokenizer(TokenizerArgs(name="tiktoken", path=str(REPO_ROOT / "data/tokenizer/mini_sp8192.model")))
    partial = tmp_path / "partial.model"
    partial.write_text("".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(200)))
    with pytest.raises(ValueError, match="single bytes have no rank"):
        build_tokenizer(TokenizerArgs(name="tiktoken", path=str(partial)))
