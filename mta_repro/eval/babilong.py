"""BabiLong QA1-QA5: the HF data, an offline generator, the official prompts and metric.

- ``load_hf(task, length)`` reads ``RMT-team/babilong`` (config = length such as "0k",
  "4k"; split = task "qa1".."qa5"; records {"input", "question", "target"}) through
  ``datasets`` (hub or local cache). Never used offline.
- ``BabiGenerator`` builds records of the same shape offline: a bAbI-style story for
  QA1-QA5 (single/two/three supporting facts, two- and three-argument relations) whose
  answer is computed by simulating the story, hidden among background sentences (split
  with nltk's untrained Punkt tokenizer) at sorted random positions, filled until the
  whole prompt (instruction, examples, context, question) plus the answer tokens fits
  in the length in tokens of the model's tokenizer (0 = facts only).
- ``format_prompt`` = the official template and prompts; the model answers greedily
  (20 new tokens); ``compare_answers`` = the official metric: lower-case, keep the first
  sentence (and the text before "<context>"/"<example>"), collect the task's labels in
  it minus those in the question; correct only when the target is the only one.
"""

from __future__ import annotations

import random
from collections.abc import Iterable

import torch

from mta_repro.errors import UserError
from mta_repro.eval.babilong_prompts import LOCATIONS, PROMPTS, TASK_LABELS, TEMPLATE

TASKS = ("qa1", "qa2", "qa3", "qa4", "qa5")
LENGTHS = {"0k": 0, "1k": 1024, "2k": 2048, "4k": 4096, "8k": 8192, "16k": 16384}
PEOPLE = ("Mary", "John", "Daniel", "Sandra")
QA5_PEOPLE = ("Bill", "Fred", "Jeff", "Mary")
OBJECTS = ("apple", "football", "milk")
MOVE = ("moved to", "went to", "journeyed to", "travelled to", "went back to")
GET = ("got", "grabbed", "picked up", "took")
DROP = ("dropped", "discarded", "put down", "left")
GIVE = ("gave", "handed", "passed")
OPPOSITE = {"north": "south", "south": "north", "east": "west", "west": "east"}


def check_task(task: str) -> None:
    if task not in TASKS:
        raise UserError(f"eval.babilong.tasks: unknown task {task!r}; expected one of {TASKS}")


def length_tokens(length) -> int:
    if isinstance(length, int):
        return length
    if length not in LENGTHS:
        raise UserError(f"eval.babilong.lengths: unknown length {length!r}; expected one of {list(LENGTHS)}")
    return LENGTHS[length]


# ------------------------------------------------------------------ official metric
def preprocess_output(output: str) -> str:
    output = output.lower().split(".")[0]
    for marker in ("<context>", "<example>", "Question"):
        # "Question" never matches after lower-casing; kept as the benchmark has it.
        output = output.split(marker)[0]
    return output


def compare_answers(target: str, output: str, question: str, task_labels: Iterable[str]) -> bool:
    out = preprocess_output(output)
    labels = {label.lower() for label in task_labels}
    in_question = {label for label in labels if label in question.lower()}
    in_output = {label for label in labels if label in out} - in_question
    return target.lower() in in_output and len(in_output) == 1


def format_prompt(task: str, context: str, question: str) -> str:
    check_task(task)
    p = PROMPTS[task]
    return TEMPLATE.format(
        instruction=p["instruction"],
        examples=p["examples"],
        post_prompt=p["post_prompt"],
        context=context,
        question=question,
    ).strip()


# ---------------------------------------------------------------------- HF loader
def load_hf(task: str, length: str, dataset: str = "RMT-team/babilong", limit: int | None = None) -> list:
    """Records of the HF BabiLong data (hub or cache); never used in the tests."""
    check_task(task)
    from datasets import load_dataset

    from mta_repro.eval.hub import hub_errors, offline_if_unreachable

    offline_if_unreachable()
    with hub_errors(
        what=f"babilong {task} at {length}", fix="set babilong.source=generated (the stories made here, no download)"
    ):
        ds = load_dataset(dataset, length, split=task)
    rows = [
        {"input": r["input"], "question": r["question"], "target": r["target"]}  # pyright: ignore[reportCallIssue, reportArgumentType]  # datasets types a row as a list too
        for r in ds
    ]
    return rows[:limit] if limit else rows


# ------------------------------------------------------------------ story makers
def _qa1(rng: random.Random, n_facts: int):
    facts, where = [], {}
    for _ in range(n_facts):
        p, loc = rng.choice(PEOPLE), rng.choice(LOCATIONS)
        facts.append(f"{p} {rng.choice(MOVE)} the {loc}.")
        where[p] = loc
    p = rng.choice(sorted(where))
    return facts, f"Where is {p}?", where[p]


class _World:
    """People moving and carrying objects; tracks every object's location history."""

    def __init__(self, rng):
        self.rng = rng
        self.person_loc: dict = {}
        self.holder: dict = {}  # object -> person
        self.obj_loc: dict = {}  # object -> location
        self.history: dict = {o: [] for o in OBJECTS}  # distinct successive locations
        self.facts: list = []

    def _place(self, obj, loc):
        self.obj_loc[obj] = loc
        if not self.history[obj] or self.history[obj][-1] != loc:
            self.history[obj].append(loc)

    def step(self):
        rng = self.rng
        p = rng.choice(PEOPLE)
        held = [o for o, h in self.holder.items() if h == p]
        here = self.person_loc.get(p)
        # an object can be taken where it lies, or anywhere before it was first seen
        free = [o for o in OBJECTS if o not in self.holder and self.obj_loc.get(o, here) == here]
        options = ["move"]
        if p in self.person_loc and free:
            options += ["get", "get"]
        if held:
            options += ["drop"]
        act = rng.choice(options)
        if act == "move":
            loc = rng.choice([l for l in LOCATIONS if l != self.person_loc.get(p)])
            self.person_loc[p] = loc
            self.facts.append(f"{p} {rng.choice(MOVE)} the {loc}.")
            for o in held:
                self._place(o, loc)
        elif act == "get":
            o = rng.choice(free)
            self.holder[o] = p
            self._place(o, self.person_loc[p])
            self.facts.append(f"{p} {rng.choice(GET)} the {o} there.")
        else:
            o = rng.choice(held)
            del self.holder[o]
            self.facts.append(f"{p} {rng.choice(DROP)} the {o}.")


def _qa2(rng, n_facts):
    while True:
        w = _World(rng)
        for _ in range(n_facts):
            w.step()
        known = [o for o in OBJECTS if o in w.obj_loc]
        if known:
            o = rng.choice(known)
            return w.facts, f"Where is the {o}?", w.obj_loc[o]


def _qa3(rng, n_facts):
    while True:
        w = _World(rng)
        for _ in range(n_facts):
            w.step()
        known = [o for o in OBJECTS if len(w.history[o]) >= 2]
        if known:
            o = rng.choice(known)
            last, before = w.history[o][-1], w.history[o][-2]
            return w.facts, f"Where was the {o} before the {last}?", before


def _qa4(rng, n_facts):
    a, b, c = rng.sample(LOCATIONS, 3)
    d = rng.choice(sorted(OPPOSITE))
    facts = [f"The {a} is {d} of the {b}.", f"The {c} is {OPPOSITE[d]} of the {b}."]
    rng.shuffle(facts)
    if rng.random() < 0.5:
        return facts, f"What is {d} of the {b}?", a
    return facts, f"What is the {b} {d} of?", c  # b is d of c


def _qa5(rng, n_facts):
    while True:
        loc, holder, obj_loc, facts, gives = {}, {}, {}, [], []
        for _ in range(n_facts):
            p = rng.choice(QA5_PEOPLE)
            here = loc.get(p)
            held = [o for o, h in holder.items() if h == p]
            free = [o for o in OBJECTS if o not in holder and obj_loc.get(o, here) == here]
            # objects are handed to someone in the same place
            near = [x for x in QA5_PEOPLE if x != p and here is not None and loc.get(x) == here]
            act = rng.choice(
                ["move"] + (["get"] if free and here else []) + (["give", "give"] if held and near else [])
            )
            if act == "move":
                loc[p] = rng.choice([x for x in LOCATIONS if x != here])
                facts.append(f"{p} {rng.choice(MOVE)} the {loc[p]}.")
                for o in held:
                    obj_loc[o] = loc[p]
            elif act == "get":
                o = rng.choice(free)
                holder[o], obj_loc[o] = p, here
                facts.append(f"{p} {rng.choice(GET)} the {o} there.")
            else:
                o, q = rng.choice(held), rng.choice(near)
                holder[o] = q
                facts.append(f"{p} {rng.choice(GIVE)} the {o} to {q}.")
                gives.append((p, o, q))
        if gives:
            giver, obj, taker = gives[-1]  # the latest transfer answers every form
            kind = rng.randrange(5)
            if kind == 0:
                return facts, f"Who gave the {obj} to {taker}?", giver
            if kind == 1:
                return facts, f"Who received the {obj}?", taker
            if kind == 2:
                return facts, f"What did {giver} give to {taker}?", obj
            if kind == 3:
                return facts, f"Who did {giver} give the {obj} to?", taker
            return facts, f"Who gave the {obj}?", giver


_MAKERS = {"qa1": _qa1, "qa2": _qa2, "qa3": _qa3, "qa4": _qa4, "qa5": _qa5}
_N_FACTS = {"qa1": 6, "qa2": 12, "qa3": 14, "qa4": 2, "qa5": 16}


class BabiGenerator:
    """Offline BabiLong-style records {"input", "question", "target"} for QA1-QA5."""

    def __init__(self, tokenizer, background: Iterable[str], max_chars: int = 2_000_000):
        from mta_repro.eval.needle import sentence_splitter

        splitter = sentence_splitter()  # nltk Punkt, untrained (no downloaded data)
        sents, n = [], 0
        for doc in background:
            for s in splitter.tokenize(doc):
                s = " ".join(s.split())
                if s:
                    sents.append(s)
            n += len(doc)
            if n >= max_chars:
                break
        if not sents:
            raise UserError("babilong: the background corpus has no sentences")
        self.tok = tokenizer
        self.sents = sents
        self.sent_len = [len(tokenizer.encode(" " + s, add_bos=False, add_eos=False)) for s in sents]

    def _n_tokens(self, text: str) -> int:
        return len(self.tok.encode(text, add_bos=False, add_eos=False))

    def prompt_tokens(self, task: str, record: dict) -> int:
        """Tokens the model reads for this record: BOS + the formatted prompt."""
        return 1 + self._n_tokens(format_prompt(task, record["input"], record["question"]))

    def sample(self, task: str, length, rng: random.Random, answer_tokens: int = 0) -> dict:
        """A record whose whole prompt (BOS, instruction, examples, context, question)
        plus ``answer_tokens`` fits in ``length`` tokens of the model's tokenizer (the
        benchmark's rule: the length is the model's input, prompt included); length 0 =
        the facts alone."""
        check_task(task)
        budget = length_tokens(length)
        facts, question, target = _MAKERS[task](rng, _N_FACTS[task])
        facts_text = " ".join(facts)
        bare = {"input": facts_text, "question": question}
        if budget:
            fixed = self.prompt_tokens(task, bare) + answer_tokens
            if fixed > budget:
                raise UserError(
                    f"babilong: a {budget}-token length cannot hold the {task} prompt, facts and "
                    f"{answer_tokens} answer tokens (they need {fixed})"
                )
            room = budget - fixed
        # background sentences from a random start, as many as fit in the budget
        bg, used = [], 0
        i = rng.randrange(len(self.sents))
        while budget and used + self.sent_len[i] <= room and len(bg) < len(self.sents):
            bg.append(self.sents[i])
            used += self.sent_len[i]
            i = (i + 1) % len(self.sents)
        # facts at sorted random positions among the background sentences
        slots = sorted(rng.choices(range(len(bg) + 1), k=len(facts)))

        def build(n_bg):
            out, f = [], 0
            for pos in range(n_bg + 1):
                while f < len(facts) and (slots[f] == pos or (pos == n_bg and slots[f] > pos)):
                    out.append(facts[f])
                    f += 1
                if pos < n_bg:
                    out.append(bg[pos])
            return {"input": " ".join(out), "question": question, "target": target, "facts": facts}

        rec = build(len(bg))
        # Token counts of joined text can differ a little from the sum over sentences:
        # drop background sentences from the end until the whole prompt really fits.
        n_bg = len(bg)
        while budget and n_bg > 0 and self.prompt_tokens(task, rec) + answer_tokens > budget:
            n_bg -= 1
            rec = build(n_bg)
        return rec


def parse_length(length):
    """A length as configured: "0k".."16k" stay names, digit strings become ints."""
    return int(length) if str(length).isdigit() else length


def check_args(args) -> None:
    """Task names, lengths and the source of ``BabiLongArgs``, before any model work."""
    for t in args.tasks:
        check_task(t)
    for length in args.lengths:
        length_tokens(parse_length(length))
    if args.source not in ("generated", "hf"):
        raise UserError(f"eval.babilong.source: expected 'generated' or 'hf', got {args.source!r}")


@torch.no_grad()
def run_babilong(model, tokenizer, args, background: Iterable[str] | None = None) -> dict:
    """Accuracy per task and length: {"accuracy": {task: {length: acc}}, "mean": {length: acc}}.

    ``args``: the settings (``mta_repro.eval.args.BabiLongArgs``); ``background``: the
    documents the generated source hides its facts in."""
    from mta_repro.model.generation import generate_text

    check_args(args)
    tasks, samples, source, dataset = list(args.tasks), args.samples, args.source, args.dataset
    lengths = [parse_length(x) for x in args.lengths]
    max_new_tokens, batch_size, seed = args.max_new_tokens, args.batch_size, args.seed
    from mta_repro.eval import dist

    gen = None
    if source == "generated":
        if background is None:
            raise UserError(
                "babilong: source=generated needs the background documents its stories are hidden in "
                "(run_babilong(..., background=...))"
            )
        gen = BabiGenerator(tokenizer, background)
    rng = random.Random(seed)
    # Every process builds every record (same seed, same order); under torchrun each
    # answers every world_size-th batch of prompts and the verdicts are gathered.
    verdicts: dict = {}  # (task, length, batch index) -> [correct?]
    n_rows: dict = {}
    unit = 0
    for task in tasks:
        for length in lengths:
            if gen is not None:
                rows = [gen.sample(task, length, rng, max_new_tokens) for _ in range(samples)]
            else:
                rows = load_hf(task, str(length), dataset, limit=samples)
            n_rows[(task, str(length))] = len(rows)
            for b, s in enumerate(range(0, len(rows), batch_size)):
                unit += 1
                if not dist.mine(unit - 1):
                    continue
                chunk = rows[s : s + batch_size]
                prompts = [format_prompt(task, r["input"], r["question"]) for r in chunk]
                answers = generate_text(model, tokenizer, prompts, max_new_tokens, batch_size=batch_size)
                verdicts[(task, str(length), b)] = [
                    compare_answers(r["target"], a, r["question"], TASK_LABELS[task]) for r, a in zip(chunk, answers)
                ]
    verdicts = dist.merge_dicts(verdicts)
    acc: dict = {}
    for (task, length), n in n_rows.items():
        ok = [v for b in range((n + batch_size - 1) // batch_size) for v in verdicts[(task, length, b)]]
        acc.setdefault(task, {})[length] = sum(ok) / len(ok)
    mean = {str(length): sum(acc[t][str(length)] for t in tasks) / len(tasks) for length in lengths}
    return {
        "accuracy": acc,
        "mean": mean,
        # "generated": this project's offline bAbI-style stories in the run's corpus
        # (lengths in the model's tokens); "hf": the benchmark's own data (`dataset`).
        # Only "hf" results are comparable with published BabiLong numbers.
        "source": source,
        "settings": {
            "source": source,
            "samples": samples,
            "seed": seed,
            "max_new_tokens": max_new_tokens,
            **({"dataset": dataset} if source == "hf" else {}),
        },
    }
