"""Per-domain token counts of what the loader hands out: exact on a corpus of known
document lengths, and the token share is w_d * L_d / sum(w * L) under per-document
weights (the release's sampling), not w_d."""

from __future__ import annotations

import json

import pytest

from mta_repro.data import DataArgs, TokenizerArgs, build_train_loader


def test_token_counts_exact_and_share_follows_document_length(tmp_path):
    for d, n in (("short", 8), ("long", 98)):  # + BOS/EOS = 10 and 100 tokens (bytes tokenizer)
        (tmp_path / d).mkdir()
        (tmp_path / d / f"{d}.chunk.00.jsonl").write_text(
            "".join(json.dumps({"text": chr(97 + i % 26) * n}) + "\n" for i in range(50))
        )
    args = DataArgs(
        root_dir=str(tmp_path),
        layout="domains",
        sources={"short": 0.5, "long": 0.5},
        seq_len=63,
        batch_size=4,
        shuffle_buffer=0,
        tokenizer=TokenizerArgs("bytes", None),
    )
    loader = build_train_loader(args, 0, 1)
    batches = [next(loader) for _ in range(300)]
    counts = loader.token_counts()
    # Independent count: the windows are consecutive (no shuffle buffer); split the token
    # stream at BOS into documents, tell each one's domain by its length, and count the
    # targets (every window token but the first) that fall in it.
    toks, is_target = [], []
    for b in batches:
        for x, y in zip(b["input"], b["target"]):
            toks += x.tolist() + y[-1:].tolist()
            is_target += [False] + [True] * 63
    want = {"short": 0, "long": 0}
    starts = [i for i, t in enumerate(toks) if t == 256] + [len(toks)]
    assert starts[0] == 0
    for s0, s1 in zip(starts, starts[1:]):
        letters = sum(1 for t in toks[s0:s1] if t < 256)
        want["long" if letters > 8 else "short"] += sum(is_target[s0:s1])
    assert counts == want
    assert sum(counts.values()) == 300 * 4 * 63
    share = counts["long"] / sum(counts.values())
    assert share == pytest.approx(100 / 110, abs=0.03)  # equal doc weights, 10x longer docs
    docs = loader.n_docs
    assert docs["short"] / (docs["short"] + docs["long"]) == pytest.approx(0.5, abs=0.05)
    # Survives a save/load.
    st = loader.state_dict()
    again = build_train_loader(args, 0, 1)
    again.load_state_dict(st)
    assert again.token_counts() == counts
    next(loader), next(again)
    assert again.token_counts() == loader.token_counts()
