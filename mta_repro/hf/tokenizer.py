"""The exported folder's Hugging Face tokenizer, tokenizing as training did.

Training wraps every document as BOS + text ids + EOS (``data.add_bos``/``add_eos``), and
``python -m mta_repro.eval.generate`` prompts with BOS + text ids. The exported tokenizer
(tokenizer.json + tokenizer_config.json, a ``PreTrainedTokenizerFast``) gives the same
ids for ``tok(text)``: the same text ids, BOS prepended (``add_bos_token``), no EOS.
Built here from the training tokenizer's own file:

- ``bytes``: ids 0-255 are the UTF-8 bytes, 256/257 BOS/EOS (``<|bos|>``, ``<|eos|>``);
- ``tiktoken`` (Llama 3's ranks file): transformers' TikTokenConverter with Llama 3's
  split pattern and its 256 special tokens (ids 128,000-128,255);
- ``sentencepiece``: transformers' LlamaConverter of the model file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mta_repro.errors import UserError


def _bytes_tokenizer():
    """Byte ids 0-255 through the byte-level pre-tokenizer, no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    table = _byte_to_unicode()
    tok = Tokenizer(models.BPE(vocab={table[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|bos|>", "<|eos|>"])  # ids 256, 257
    return tok


def _byte_to_unicode() -> dict:
    """GPT-2's reversible byte -> character table (what tokenizers' ByteLevel uses)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\xa1"), ord("\xac") + 1))
        + list(range(ord("\xae"), ord("\xff") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _tiktoken_tokenizer(path: str):
    import inspect

    from transformers.convert_slow_tokenizer import TikTokenConverter

    from mta_repro.data.tokenizers import LLAMA3_PATTERN, llama3_special_tokens

    # transformers 5.x names the special tokens extra_special_tokens, 4.x additional_special_tokens
    # (4.x silently drops an unknown keyword and then fails on None).
    params = inspect.signature(TikTokenConverter.__init__).parameters
    key = "extra_special_tokens" if "extra_special_tokens" in params else "additional_special_tokens"
    specials: dict[str, Any] = {key: llama3_special_tokens()}
    return TikTokenConverter(vocab_file=path, pattern=LLAMA3_PATTERN, **specials).converted()


def _sentencepiece_tokenizer(path: str):
    """A sentencepiece BPE model as a tokenizers BPE: its pieces with their ids, merges in
    the order of the merged piece's id (sentencepiece BPE ranks pieces by merge order),
    byte fallback, spaces as U+2581 (and the dummy prefix when the model adds one)."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb
    from tokenizers import Tokenizer, decoders, models, normalizers

    proto = pb.ModelProto()  # pyright: ignore[reportAttributeAccessIssue]  # protobuf builds it at import
    proto.ParseFromString(Path(path).read_bytes())
    if proto.trainer_spec.model_type != pb.TrainerSpec.BPE:  # pyright: ignore[reportAttributeAccessIssue]  # as ModelProto
        raise UserError("only sentencepiece BPE models are exported as tokenizer.json")
    ns = proto.normalizer_spec
    if ns.remove_extra_whitespaces or ns.name not in ("identity", ""):
        raise UserError(
            f"sentencepiece normalizer {ns.name!r} (remove_extra_whitespaces="
            f"{ns.remove_extra_whitespaces}) is not reproduced"
        )
    sp = spm.SentencePieceProcessor(model_file=str(path))
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    ranked = []
    for piece, pid in vocab.items():
        if sp.is_control(pid) or sp.is_unknown(pid) or sp.is_byte(pid):
            continue
        for k in range(1, len(piece)):
            a, b = piece[:k], piece[k:]
            if a in vocab and b in vocab:
                ranked.append((pid, vocab[a], vocab[b], a, b))
    ranked.sort()
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=[(a, b) for *_, a, b in ranked],
            unk_token=sp.id_to_piece(sp.unk_id()),
            byte_fallback=True,
            fuse_unk=True,
        )
    )
    norms = ([normalizers.Prepend("\u2581")] if ns.add_dummy_prefix else []) + [normalizers.Replace(" ", "\u2581")]
    tok.normalizer = normalizers.Sequence(norms)
    decs = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if ns.add_dummy_prefix:
        decs.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(decs)
    specials = [sp.id_to_piece(i) for i in range(sp.get_piece_size()) if sp.is_control(i) or sp.is_unknown(i)]
    tok.add_special_tokens(specials)
    return tok


def write_hf_tokenizer(tok_cfg: dict, tok, out_dir: Path, add_bos: bool = True) -> str | None:
    """Write tokenizer.json + tokenizer_config.json into ``out_dir`` for our tokenizer
    ``tok`` (built from ``tok_cfg``, ``data.tokenizer``): ``tok(text)`` gives BOS + the
    text's ids, as training and ``mta_repro.eval.generate`` feed the model. Returns None, or
    why no HF tokenizer was written (the tokenizer file is still copied next to it)."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    name = tok_cfg.get("name")
    try:
        if name == "bytes":
            hf = _bytes_tokenizer()
        elif name == "tiktoken":
            hf = _tiktoken_tokenizer(str(tok_cfg["path"]))
        elif name == "sentencepiece":
            hf = _sentencepiece_tokenizer(str(tok_cfg["path"]))
        else:
            return f"tokenizer {name!r} has no Hugging Face form here"
    except ValueError as e:
        return str(e)
    bos, eos = hf.id_to_token(int(tok.bos_id)), hf.id_to_token(int(tok.eos_id))
    if bos is None or eos is None:
        return f"BOS/EOS ids {tok.bos_id}/{tok.eos_id} are not in the converted vocabulary"
    if add_bos:
        hf.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, int(tok.bos_id))]
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=hf,
        bos_token=bos,
        eos_token=eos,
        model_max_length=int(1e30),
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(str(out_dir))
    # A plain PreTrainedTokenizerFast on every transformers version: 5.x writes its own
    # class name "TokenizersBackend", which 4.x cannot load; and no token_type_ids (4.x's
    # default), which the model does not take.
    import json

    path = out_dir / "tokenizer_config.json"
    tc = json.loads(path.read_text())
    tc.update(tokenizer_class="PreTrainedTokenizerFast", model_input_names=["input_ids", "attention_mask"])
    path.write_text(json.dumps(tc, indent=2) + "\n")
    return None
