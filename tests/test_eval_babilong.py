"""BabiLong: official metric on hand-made answers, prompt format, offline generator."""

import random
import re

import pytest
from eval_helpers import make_tokenizer, tiny_model

from mta_repro.eval.args import BabiLongArgs
from mta_repro.eval.babilong import (
    TASKS,
    BabiGenerator,
    compare_answers,
    format_prompt,
    run_babilong,
)
from mta_repro.eval.babilong_prompts import PROMPTS, TASK_LABELS

BACKGROUND = ["It was a dark night. The wind blew hard over the hills! Nobody was awake? " * 80]


def test_compare_answers_on_hand_made_answers():
    loc = TASK_LABELS["qa1"]
    assert compare_answers("bathroom", "The most recent location of Mary is bathroom.", "Where is Mary?", loc)
    assert not compare_answers("bathroom", "Mary is in the kitchen or the bathroom", "Where is Mary?", loc)
    assert not compare_answers("bathroom", "kitchen", "Where is Mary?", loc)
    # only the first sentence counts
    assert compare_answers("bathroom", "Bathroom. Then the kitchen.", "Where is Mary?", loc)
    # labels named in the question never count
    q = "Where was the apple before the kitchen?"
    assert compare_answers("bathroom", "Before the kitchen the apple was in the bathroom.", q, loc)
    # text after <example> is cut (the model imitating the examples)
    assert not compare_answers("garden", "the <example> garden", "What is west of the bedroom?", loc)
    assert compare_answers("Fred", " fred", "Who did Mary give the apple to?", TASK_LABELS["qa5"])
    assert not compare_answers("Fred", "Mary", "Who did Mary give the apple to?", TASK_LABELS["qa5"])


def test_prompt_is_the_official_template():
    text = format_prompt("qa2", "CTX facts.", "Where is the milk?")
    p = PROMPTS["qa2"]
    assert text == (
        f"{p['instruction']}\n\n{p['examples']}\n\n{p['post_prompt']}\n\n"
        "<context>\nCTX facts.\n</context>\n\nQuestion: Where is the milk?"
    )
    with pytest.raises(ValueError, match="unknown task 'qa9'"):
        format_prompt("qa9", "", "")


def solve(task, facts, question):
    """An independent solver over the fact sentences (regular expressions)."""
    if task == "qa4":
        rel = {}
        for f in facts:
            a, d, b = re.match(r"The (\w+) is (\w+) of the (\w+)\.", f).groups()
            rel[(d, b)] = a
            rel[({"north": "south", "south": "north", "east": "west", "west": "east"}[d], a)] = b
        m = re.match(r"What is (\w+) of the (\w+)\?", question)
        if m:
            return rel[(m.group(1), m.group(2))]
        b, d = re.match(r"What is the (\w+) (\w+) of\?", question).groups()
        return [y for (dd, y), x in rel.items() if dd == d and x == b][0]  # b is d of y
    person, holder, obj, gives, hist = {}, {}, {}, [], {}
    for f in facts:
        m = re.match(r"(\w+) (?:moved|went|journeyed|travelled|went back) to the (\w+)\.", f)
        if m:
            person[m.group(1)] = m.group(2)
            for o, h in holder.items():
                if h == m.group(1):
                    obj[o] = m.group(2)
                    if hist[o][-1] != m.group(2):
                        hist[o].append(m.group(2))
            continue
        m = re.match(r"(\w+) (?:got|grabbed|picked up|took) the (\w+) there\.", f)
        if m:
            holder[m.group(2)] = m.group(1)
            obj[m.group(2)] = person[m.group(1)]
            hist.setdefault(m.group(2), [])
            if not hist[m.group(2)] or hist[m.group(2)][-1] != obj[m.group(2)]:
                hist[m.group(2)].append(obj[m.group(2)])
            continue
        m = re.match(r"(\w+) (?:dropped|discarded|put down|left) the (\w+)\.", f)
        if m:
            holder.pop(m.group(2))
            continue
        m = re.match(r"(\w+) (?:gave|handed|passed) the (\w+) to (\w+)\.", f)
        holder[m.group(2)] = m.group(3)
        gives.append(m.groups())
    if task == "qa1":
        return person[re.match(r"Where is (\w+)\?", question).group(1)]
    if task == "qa2":
        return obj[re.match(r"Where is the (\w+)\?", question).group(1)]
    if task == "qa3":
        o, last = re.match(r"Where was the (\w+) before the (\w+)\?", question).groups()
        assert hist[o][-1] == last
        return hist[o][-2]
    giver, o, taker = gives[-1]
    return {"Who gave the": giver, "Who received": taker, "What did": o, "Who did": taker}[
        next(k for k in ("Who gave the", "Who received", "What did", "Who did") if question.startswith(k))
    ]


@pytest.mark.parametrize("task", TASKS)
def test_generator_answers_and_lengths(task):
    tok = make_tokenizer()
    gen = BabiGenerator(tok, BACKGROUND)
    rng = random.Random(7)
    for length in ("0k", 2500, "4k"):
        for _ in range(5):
            r = gen.sample(task, length, rng, answer_tokens=20)
            assert r["target"] == solve(task, r["facts"], r["question"])
            assert r["target"].lower() in {x.lower() for x in TASK_LABELS[task]}
            # the facts appear in order inside the background
            at = 0
            for f in r["facts"]:
                at = r["input"].index(f, at) + len(f)  # raises if a fact is missing or out of order
            # the whole prompt the model reads (BOS + template) plus 20 answer tokens fits
            n = len(tok.encode(format_prompt(task, r["input"], r["question"]), add_bos=True, add_eos=False)) + 20
            budget = {"0k": 0, 2500: 2500, "4k": 4096}[length]
            if budget == 0:
                assert r["input"] == " ".join(r["facts"])
            else:
                assert budget - 40 <= n <= budget  # full up to one background sentence


def test_run_babilong_on_tiny_model():
    tok = make_tokenizer()
    model = tiny_model("baseline", vocab_size=tok.n_words, n_layers=1)
    out = run_babilong(
        model,
        tok,
        BabiLongArgs(tasks=["qa1", "qa4"], lengths=["0k", "1600"], samples=2, max_new_tokens=3, batch_size=2),
        background=BACKGROUND,
    )
    assert set(out["accuracy"]) == {"qa1", "qa4"} and set(out["mean"]) == {"0k", "1600"}
    assert out["source"] == "generated" == out["settings"]["source"]
    for length in ("0k", "1600"):
        assert out["mean"][length] == pytest.approx(
            (out["accuracy"]["qa1"][length] + out["accuracy"]["qa4"][length]) / 2
        )
    with pytest.raises(ValueError, match="unknown length"):
        run_babilong(model, tok, BabiLongArgs(tasks=["qa1"], lengths=["3k"]), background=BACKGROUND)


def test_generated_source_without_background_is_one_line():
    """The generated stories need documents to hide their facts in: without them, one line
    naming the argument, not a TypeError from iterating None."""
    from mta_repro.errors import UserError

    tok = make_tokenizer()
    model = tiny_model("baseline", vocab_size=tok.n_words, n_layers=1)
    with pytest.raises(UserError, match=r"^babilong: source=generated needs the background .*background=\.\.\."):
        run_babilong(model, tok, BabiLongArgs(tasks=["qa1"], lengths=["0k"]))


def test_prompt_too_long_for_the_length_is_a_clear_error():
    tok = make_tokenizer()
    gen = BabiGenerator(tok, BACKGROUND)
    with pytest.raises(ValueError, match="cannot hold the qa1 prompt, facts and 20 answer tokens"):
        gen.sample("qa1", 300, random.Random(0), answer_tokens=20)


def test_lengths_fit_with_the_llama3_tokenizer():
    """With the paper's tokenizer, prompt + 20 answer tokens fit every 2k/4k row."""
    from test_eval_needle import book_docs, llama3_tokenizer

    tok = llama3_tokenizer()
    gen = BabiGenerator(tok, book_docs(), max_chars=300_000)
    rng = random.Random(0)
    for task in TASKS:
        for length, budget in (("1k", 1024), ("2k", 2048), ("4k", 4096)):
            for _ in range(3):
                r = gen.sample(task, length, rng, answer_tokens=20)
                n = len(tok.encode(format_prompt(task, r["input"], r["question"]), add_bos=True, add_eos=False))
                assert budget - 120 <= n + 20 <= budget, (task, length, n)
