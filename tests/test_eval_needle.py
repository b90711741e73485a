"""Multi-needle NIAH: exact token budgets, placement at sentence ends, scoring."""

import random
from pathlib import Path

import pytest
from eval_helpers import make_tokenizer, tiny_model

from mta_repro.eval.args import NeedleArgs
from mta_repro.eval.needle import (
    NEEDLE,
    PREAMBLE,
    QUESTION_ONE,
    Haystack,
    NeedleGenerator,
    run_needle,
    score_answer,
    sentence_splitter,
)

BACKGROUND = [
    " ".join(f"Sentence number {i} talks about the weather in town {i % 7}." for i in range(400)),
    "A second document. It has short sentences! Does it ask questions? Yes.",
]


def sp_tokenizer():
    from mta_repro.data import DataArgs, build_tokenizer

    return build_tokenizer(DataArgs().tokenizer)


def book_docs():
    from mta_repro.data import DataArgs, iter_validation_docs

    return iter_validation_docs(DataArgs(), "book")


@pytest.mark.parametrize("which", ["bytes", "sentencepiece"])
def test_exact_lengths_and_placement(which):
    tok = make_tokenizer() if which == "bytes" else sp_tokenizer()
    docs = BACKGROUND if which == "bytes" else book_docs()
    gen = NeedleGenerator(tok, Haystack(tok, docs, max_chars=300_000))
    rng = random.Random(0)
    for ctx in (2048, 4096) if which == "sentencepiece" else (1024,):
        for n in (2, 10):
            for depth in (0, 25, 50, 75, 100):
                s = gen.sample(ctx, n, depth, rng)
                assert len(s.tokens) == ctx and s.tokens[0] == tok.bos_id
                text = tok.decode(s.tokens)
                assert len(set(s.values)) == n and all(len(v) == 7 and v.isdigit() for v in s.values)
                starts = []
                for k, v, pos in zip(s.keys, s.values, s.positions):
                    needle = NEEDLE.format(key=k, value=v)
                    assert text.count(needle) == 1
                    assert needle in tok.decode(s.tokens[pos:]).lstrip()[: len(needle)]
                    starts.append(pos)
                    # inserted right after a sentence end (or at the haystack start)
                    before = tok.decode(s.tokens[1:pos]).rstrip()
                    assert before.rstrip("'\"\u2019\u201d)]").endswith((".", "!", "?")) or before == PREAMBLE.rstrip()
                assert starts == sorted(starts)
                assert s.answers[0] in s.values and len(s.answers) == 1
                asked = s.keys[s.values.index(s.answers[0])]
                assert text.endswith(QUESTION_ONE.format(key=asked))


def test_depth_is_respected():
    tok = make_tokenizer()
    gen = NeedleGenerator(tok, Haystack(tok, BACKGROUND))
    enc = lambda t: tok.encode(t, add_bos=False, add_eos=False)  # noqa: E731
    longest_sentence = 70  # bytes of one BACKGROUND sentence, at most
    for depth in (0, 25, 50, 75, 100):
        s = gen.sample(2048, 2, depth, random.Random(depth))
        head = 1 + len(enc(PREAMBLE))
        needles = [len(enc(" " + NEEDLE.format(key=k, value=v))) for k, v in zip(s.keys, s.values)]
        n_bg = 2048 - head - sum(needles) - len(enc(QUESTION_ONE.format(key=s.keys[s.values.index(s.answers[0])])))
        target = round(n_bg * depth / 100)
        first = s.positions[0] - head  # background tokens before the first needle
        assert target - longest_sentence <= first <= target
        # the second needle at depth + (100 - depth)/2 percent, in background tokens
        second = s.positions[1] - head - needles[0]
        target2 = round(n_bg * (depth + (100 - depth) / 2) / 100)
        assert target2 - longest_sentence <= second <= target2


def test_budget_too_small_is_a_clear_error():
    tok = make_tokenizer()
    gen = NeedleGenerator(tok, Haystack(tok, BACKGROUND))
    with pytest.raises(ValueError, match="cannot hold 10 needles"):
        gen.check_budget(256, 10)
    with pytest.raises(ValueError, match="cannot hold 10 needles"):
        run_needle(
            tiny_model("baseline", vocab_size=tok.n_words),
            tok,
            NeedleArgs(context_lens=[256], needle_counts=[10]),
            BACKGROUND,
        )


def test_scoring_on_hand_made_answers():
    assert score_answer(" 1234567.", ["1234567"]) == 1.0
    assert score_answer(" 1234568", ["1234567"]) == 0.0
    assert score_answer("7654321 and 1234567", ["1234567", "7654321"]) == 1.0
    assert score_answer("only 1234567", ["1234567", "7654321"]) == 0.5


@pytest.mark.slow
def test_run_needle_end_to_end_on_tiny_model():
    tok = make_tokenizer()
    model = tiny_model("mta", vocab_size=tok.n_words)
    out = run_needle(
        model,
        tok,
        NeedleArgs(
            context_lens=[640], needle_counts=[2, 3], depths=[0, 100], samples=2, max_new_tokens=4, batch_size=2
        ),
        BACKGROUND,
    )
    acc = out["accuracy"]["640"]
    assert set(acc) == {"2", "3"}
    for row in acc.values():
        assert set(row["by_depth"]) == {"0", "100"}
        assert row["mean"] == pytest.approx(sum(row["by_depth"].values()) / 2)
        assert all(0.0 <= v <= 1.0 for v in row["by_depth"].values())
        # every sample's score is kept (the report's intervals resample them)
        assert {d: sum(s) / len(s) for d, s in row["scores"].items()} == row["by_depth"]
        assert all(len(s) == 2 for s in row["scores"].values())
        # one prompt id per score, 16 hex digits; no call seeded it: seed 0, said so
        assert {d: len(i) for d, i in row["prompt_ids"].items()} == {"0": 2, "100": 2}
        assert all(len(i) == 16 and int(i, 16) >= 0 for ids in row["prompt_ids"].values() for i in ids)
    assert out["settings"]["seed"] == 0 and out["settings"]["seed_source"] == "no seed given: 0"


def test_needles_never_split_abbreviations_or_decimals():
    tok = make_tokenizer()
    doc = (
        "Dr. Smith paid 3.50 dollars for e.g. bread at St. Mary's market. Then he left! "
        "Mr. Brown stayed until 4.15 p.m. and sang? "
    ) * 60
    hay = Haystack(tok, [doc])
    text = tok.decode(hay.ids)
    # the only sentence ends are after "market.", "left!" and "sang?"
    ends = {tok.decode(hay.ids[:e]).rstrip()[-7:] for e in hay.ends}
    assert ends == {"market.", "e left!", "d sang?"}, ends
    gen = NeedleGenerator(tok, hay)
    for seed in range(20):
        s = gen.sample(1024, 4, 37.0, random.Random(seed))
        for pos in s.positions:
            before = tok.decode(s.tokens[1:pos]).rstrip()
            assert not before.endswith(("Dr.", "St.", "Mr.", "3.", "4.", "e.g.")), before[-20:]
    assert text.count("Dr. Smith paid 3.50") == 60
    assert sentence_splitter().tokenize("Dr. Smith paid 3.50 dollars. Then he left.") == [
        "Dr. Smith paid 3.50 dollars.",
        "Then he left.",
    ]


def test_answer_fits_inside_the_context():
    tok = make_tokenizer()
    gen = NeedleGenerator(tok, Haystack(tok, BACKGROUND))
    for depth in (0, 50, 100):
        s = gen.sample(1024, 4, depth, random.Random(1), answer_tokens=16)
        assert len(s.tokens) + 16 == 1024 and s.context_len == 1024
    need = gen.fixed_tokens(2)
    gen.check_budget(need + 16, 2, 16)
    with pytest.raises(ValueError, match="16 answer tokens"):
        gen.check_budget(need + 15, 2, 16)


def llama3_tokenizer():
    """The paper's tokenizer: Meta's Llama-3 ranks file from the llama-models wheel
    (a dev dependency; installed --no-deps it is just data)."""
    import importlib.util

    spec = importlib.util.find_spec("llama_models")
    if spec is None:
        pytest.skip("llama-models (the Llama-3 ranks file) is not installed: pip install llama-models --no-deps")
    path = Path(list(spec.submodule_search_locations)[0]) / "llama3" / "tokenizer.model"
    from mta_repro.data import build_tokenizer
    from mta_repro.data.args import TokenizerArgs

    tok = build_tokenizer(TokenizerArgs(name="tiktoken", path=str(path)))
    assert tok.bos_id == 128000 and tok.n_words >= 128256
    return tok


def test_budgets_with_the_llama3_tokenizer():
    tok = llama3_tokenizer()
    gen = NeedleGenerator(tok, Haystack(tok, book_docs(), max_chars=200_000))
    rng = random.Random(0)
    for ctx in (2048, 4096):
        for n in (2, 10):
            for depth in (0, 100):
                s = gen.sample(ctx, n, depth, rng, answer_tokens=16)
                # the prompt re-encodes to the same count: what the model sees + 16 <= ctx
                text = tok.decode(s.tokens[1:])
                assert len(s.tokens) == ctx - 16
                assert abs(len(tok.encode(text, add_bos=True, add_eos=False)) - len(s.tokens)) <= 8
                for k, v in zip(s.keys, s.values):
                    assert text.count(NEEDLE.format(key=k, value=v)) == 1


def sha256_id(tokens) -> str:
    """The contract's prompt id, computed here with numpy: sha256 of little-endian int64 ids."""
    import hashlib

    import numpy as np

    return hashlib.sha256(np.asarray(tokens, dtype="<i8").tobytes()).hexdigest()[:16]


def test_prompt_ids_are_equal_exactly_for_equal_prompts():
    from mta_repro.eval.needle import prompt_id

    tok = make_tokenizer()
    gen = NeedleGenerator(tok, Haystack(tok, BACKGROUND))
    a = [gen.sample(512, 2, 50, random.Random(s)).tokens for s in (0, 1, 0)]
    assert a[0] == a[2] and a[0] != a[1]
    ids = [prompt_id(t) for t in a]
    assert ids == [sha256_id(t) for t in a]
    assert ids[0] == ids[2] != ids[1]
    # ids above 2**31 (a Llama-3 vocabulary is 128K; int64 keeps any id whole)
    assert prompt_id([128000, 5, 2**40]) == sha256_id([128000, 5, 2**40]) != prompt_id([128000, 5, 2**40 + 1])


def test_the_seed_comes_from_the_run_then_its_record_then_zero():
    from omegaconf import OmegaConf

    from mta_repro.eval.needle import needle_seed

    cfg = OmegaConf.create({"seed": 3, "model": {}})
    record = {"inputs": {"seeds": {"seed": 4}}}
    assert needle_seed(None, cfg, record) == (3, "run config seed")
    assert needle_seed(7, cfg, record) == (7, "needle.seed")
    assert needle_seed(0, cfg, record) == (0, "needle.seed")  # an explicit 0 is not "unset"
    assert needle_seed(None, OmegaConf.create({"model": {}}), record) == (4, "run provenance seed")
    assert needle_seed(None, OmegaConf.create({"model": {}}), None) == (0, "no seed recorded: 0")


@pytest.mark.slow
def test_runs_of_different_seeds_are_asked_different_prompts(tmp_path):
    """Through ``python -m mta_repro.eval``: two runs of seed 1 (different weights) get the
    same prompts, a run of seed 2 others, and needle.seed=2 on a seed-1 run those of seed 2."""
    import json

    from eval_helpers import make_run

    from mta_repro.eval.run import main

    runs = {}
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        runs[name], _ = make_run(tmp_path / name, attention="baseline", seq_len=512, overrides=[f"seed={seed}"])
    args = [
        "tasks=[needle]",
        "device=cpu",
        "needle.context_lens=[512]",
        "needle.needle_counts=[2]",
        "needle.depths=[0,50]",
        "needle.samples=3",
        "needle.max_new_tokens=2",
        "needle.max_background_chars=50000",
    ]

    def needle(run_dir, *extra, out="eval"):
        assert main([str(run_dir), *args, *extra, f"out_dir={run_dir / out}"]) == 0
        res = json.loads((run_dir / out / "needle.json").read_text())["results"]
        return res["settings"], res["accuracy"]["512"]["2"]["prompt_ids"]

    (sa, ia), (sb, ib), (sc, ic) = (needle(runs[n]) for n in "abc")
    assert (sa["seed"], sb["seed"], sc["seed"]) == (1, 1, 2) and sa["seed_source"] == "run config seed"
    assert ia == ib  # the same seed: the same prompts, whatever the weights
    flat_a, flat_c = [i for d in ia.values() for i in d], [i for d in ic.values() for i in d]
    assert len(flat_a) == 6 and len(set(flat_a)) == 6  # 6 distinct prompts, one id each
    assert not set(flat_a) & set(flat_c)  # another seed: no prompt in common
    sx, ix = needle(runs["a"], "needle.seed=2", out="explicit")
    assert (sx["seed"], sx["seed_source"]) == (2, "needle.seed") and ix == ic
