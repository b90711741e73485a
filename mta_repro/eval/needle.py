"""Multi-needle needle-in-a-haystack (the paper's section 4; the template is the project's).

RULER-style needles with Kamradt-style insertion, all at the token level of the model's
tokenizer, so that every prompt is exactly ``context_len - max_new_tokens`` tokens long (the
answer is generated inside ``context_len``, as RULER counts it):

    [BOS] PREAMBLE + haystack-with-needles + QUESTION

- needle i: ``NEEDLE`` with a distinct ``adjective-noun`` key and a distinct 7-digit value;
- insertion (Kamradt's multi-needle tester): needle 0 at ``depth`` % of the haystack,
  needle i at depth + i * (100 - depth) / n_needles %, each moved back to the previous
  sentence end of the background (nltk's Punkt, as BabiLong splits, so "Dr." or "3.50" is
  no end); the background is consecutive corpus tokens from a random sentence start;
- question: ``query="one"`` (default) asks for one needle chosen at random, the others are
  distractors; ``query="all"`` asks for every number;
- score (RULER string match): the fraction of the asked-for values that occur in the
  greedy answer (``max_new_tokens`` tokens, cut at the first newline).

Results: accuracy per (context length, needle count, depth), and per needle count
averaged over depths (the paper's presentation), with every sample's score and
``prompt_id``. The prompts are drawn by ``random.Random(seed)``, the run's own seed unless
``needle.seed`` is set (``needle_seed``): runs of different seeds get different prompts.
The texts word for word: ``PREAMBLE``, ``NEEDLE``, ``QUESTION_ONE`` and ``QUESTION_ALL``
below (and docs/evaluation.md).
"""

from __future__ import annotations

import bisect
import hashlib
import random
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from mta_repro.errors import UserError

PREAMBLE = (
    "Some special magic numbers are hidden within the following text. "
    "Make sure to memorize it. I will quiz you about the numbers afterwards.\n"
)
NEEDLE = "One of the special magic numbers for {key} is: {value}."
QUESTION_ONE = (
    "\nWhat is the special magic number for {key} mentioned in the provided text? "
    "The special magic number for {key} mentioned in the provided text is"
)
QUESTION_ALL = (
    "\nWhat are all the special magic numbers mentioned in the provided text? "
    "The special magic numbers mentioned in the provided text are"
)
_ADJ = [
    "amber",
    "brave",
    "calm",
    "dusty",
    "eager",
    "fancy",
    "gentle",
    "hollow",
    "icy",
    "jolly",
    "keen",
    "lively",
    "misty",
    "noble",
    "odd",
    "proud",
    "quiet",
    "rapid",
    "silent",
    "tidy",
    "urban",
    "vivid",
    "witty",
    "young",
    "zesty",
    "bold",
    "crisp",
]
_NOUN = [
    "apple",
    "bridge",
    "candle",
    "dragon",
    "engine",
    "falcon",
    "garden",
    "harbor",
    "island",
    "jacket",
    "kettle",
    "ladder",
    "meadow",
    "needle",
    "orchard",
    "pepper",
    "quartz",
    "river",
    "saddle",
    "tiger",
    "umbrella",
    "valley",
    "window",
    "yacht",
    "zebra",
]


@dataclass
class NeedleSample:
    tokens: list  # the prompt, exactly context_len - answer_tokens ids (BOS included)
    keys: list  # needle keys, in insertion order
    values: list  # their 7-digit values (strings)
    answers: list  # the values the question asks for
    positions: list  # token index where each needle starts in ``tokens``
    depth: float
    context_len: int


def score_answer(answer: str, references: Sequence[str]) -> float:
    """RULER string match: fraction of the reference strings that occur in the answer."""
    if not references:
        raise UserError("score_answer: no reference values")
    return sum(ref in answer for ref in references) / len(references)


# Common English abbreviations that end in "." without ending a sentence; nltk's
# *untrained* Punkt (which needs no downloaded data) otherwise splits after "Dr.".
ABBREVIATIONS = [
    "dr",
    "mr",
    "mrs",
    "ms",
    "prof",
    "st",
    "jr",
    "sr",
    "vs",
    "etc",
    "e.g",
    "i.e",
    "no",
    "fig",
    "gen",
    "col",
    "capt",
    "lt",
    "sgt",
    "rev",
    "hon",
    "mt",
    "ft",
    "a.m",
    "p.m",
    "jan",
    "feb",
    "mar",
    "apr",
    "jun",
    "jul",
    "aug",
    "sep",
    "sept",
    "oct",
    "nov",
    "dec",
    "inc",
    "ltd",
    "co",
    "corp",
]


def sentence_splitter():
    """nltk's Punkt sentence splitter (the one BabiLong uses), untrained, with the
    abbreviations above: "3.50", "Dr. Smith" and "e.g. this" do not end sentences."""
    from nltk.tokenize.punkt import PunktParameters, PunktSentenceTokenizer

    params = PunktParameters()
    params.abbrev_types = set(ABBREVIATIONS)
    return PunktSentenceTokenizer(params)


class Haystack:
    """Background text as token ids with its sentence boundaries, sampled by windows.

    Documents are split into sentences by ``sentence_splitter``; each sentence is
    tokenized as " " + sentence (the form it has inside running text), so every
    sentence end is a token boundary where a needle can go.
    """

    def __init__(self, tokenizer, docs: Iterable[str], max_chars: int = 2_000_000):
        split = sentence_splitter()
        ids: list = []
        ends: list = []
        n_chars = 0
        for doc in docs:
            for sent in split.tokenize(doc):
                sent = " ".join(sent.split())
                if sent:
                    ids.extend(tokenizer.encode(" " + sent, add_bos=False, add_eos=False))
                    ends.append(len(ids))
            n_chars += len(doc)
            if n_chars >= max_chars:
                break
        if not ids:
            raise UserError("needle: the background corpus is empty")
        self.ids = ids
        self.ends = ends  # token index right after each sentence (sorted)
        self.starts = [0] + ends[:-1]

    def window(self, length: int, rng: random.Random) -> tuple:
        """(``length`` consecutive tokens from a random sentence start, cycling through
        the corpus; the boundaries 0..length inside them where a sentence ends)."""
        start = self.starts[rng.randrange(len(self.starts))]
        out, cuts = [], []
        while len(out) < length:
            take = self.ids[start : start + length - len(out)]
            lo = bisect.bisect_right(self.ends, start)
            hi = bisect.bisect_right(self.ends, start + len(take))
            cuts.extend(len(out) + e - start for e in self.ends[lo:hi])
            out.extend(take)
            start = 0
        return out, cuts


class NeedleGenerator:
    def __init__(self, tokenizer, haystack: Haystack, query: str = "one"):
        if query not in ("one", "all"):
            raise UserError(f"eval.needle.query: expected 'one' or 'all', got {query!r}")
        self.tok, self.hay, self.query = tokenizer, haystack, query

    def _enc(self, text: str) -> list:
        return self.tok.encode(text, add_bos=False, add_eos=False)

    def fixed_tokens(self, n_needles: int) -> int:
        """Tokens that are not background, for the longest keys/values (budget check)."""
        key = max((f"{a}-{n}" for a in _ADJ for n in _NOUN), key=lambda k: len(self._enc(k)))
        needle = len(self._enc(" " + NEEDLE.format(key=key, value="9999999")))
        q = QUESTION_ONE.format(key=key) if self.query == "one" else QUESTION_ALL
        return 1 + len(self._enc(PREAMBLE)) + n_needles * needle + len(self._enc(q)) + 2

    def check_budget(self, context_len: int, n_needles: int, answer_tokens: int = 0) -> None:
        need = self.fixed_tokens(n_needles) + answer_tokens
        if need > context_len:
            raise UserError(
                f"eval.needle: a context of {context_len} tokens cannot hold {n_needles} needles "
                f"plus the preamble, question and {answer_tokens} answer tokens (needs at least {need} tokens)"
            )

    def check_all(self, context_lens, needle_counts, answer_tokens: int = 0) -> None:
        """Every (context length, needle count) setting fits, or one clear error."""
        for c in context_lens:
            for k in needle_counts:
                self.check_budget(int(c), int(k), answer_tokens)

    def sample(
        self,
        context_len: int,
        n_needles: int,
        depth: float,
        rng: random.Random,
        answer_tokens: int = 0,
    ) -> NeedleSample:
        """A prompt of ``context_len - answer_tokens`` tokens, so that the prompt and the
        generated answer fit in ``context_len`` (RULER counts the answer in the limit)."""
        if not 0 <= depth <= 100:
            raise UserError(f"eval.needle.depths: expected percentages in [0, 100], got {depth}")
        if not 1 <= n_needles <= len(_ADJ) * len(_NOUN):
            raise UserError(f"eval.needle.needle_counts: bad needle count {n_needles}")
        pairs = rng.sample([(a, n) for a in _ADJ for n in _NOUN], n_needles)
        keys = [f"{a}-{n}" for a, n in pairs]
        values = [str(v) for v in rng.sample(range(1_000_000, 10_000_000), n_needles)]
        needles = [self._enc(" " + NEEDLE.format(key=k, value=v)) for k, v in zip(keys, values)]
        asked = [rng.randrange(n_needles)] if self.query == "one" else list(range(n_needles))
        question = QUESTION_ONE.format(key=keys[asked[0]]) if self.query == "one" else QUESTION_ALL
        head = [self.tok.bos_id] + self._enc(PREAMBLE)
        tail = self._enc(question)
        prompt_len = context_len - answer_tokens
        n_bg = prompt_len - len(head) - len(tail) - sum(len(n) for n in needles)
        if n_bg < 0:
            raise UserError(
                f"eval.needle: a context of {context_len} tokens cannot hold {n_needles} needles "
                f"plus the preamble, question and {answer_tokens} answer tokens "
                f"(needs {context_len - n_bg} tokens)"
            )
        bg, bg_ends = self.hay.window(n_bg, rng)
        ends = [0] + bg_ends  # where a needle may go: the start and sentence ends
        interval = (100.0 - depth) / n_needles
        cuts = []
        for i in range(n_needles):
            target = int(round(n_bg * min(100.0, depth + i * interval) / 100.0))
            j = bisect.bisect_right(ends, target) - 1  # previous sentence end
            cut = ends[j] if j >= 0 else 0
            cuts.append(max(cut, cuts[-1] if cuts else 0))  # keep insertion order
        tokens, positions, prev = list(head), [], 0
        for cut, needle in zip(cuts, needles):
            tokens.extend(bg[prev:cut])
            positions.append(len(tokens))
            tokens.extend(needle)
            prev = cut
        tokens.extend(bg[prev:])
        tokens.extend(tail)
        assert len(tokens) == prompt_len, (len(tokens), prompt_len)
        return NeedleSample(tokens, keys, values, [values[a] for a in asked], positions, depth, context_len)


def prompt_id(tokens: Sequence[int]) -> str:
    """The first 16 hex digits of the sha256 of the prompt's token ids as little-endian
    int64 bytes: equal prompts have equal ids, in any run."""
    return hashlib.sha256(struct.pack(f"<{len(tokens)}q", *tokens)).hexdigest()[:16]


def needle_seed(explicit: int | None, run_cfg=None, record: dict | None = None) -> tuple[int, str]:
    """(the seed the prompts are drawn with, where it came from): ``needle.seed`` when set,
    else the run's ``seed`` (its config, else the provenance record of its weights), else 0
    for weights that record no seed (an export from elsewhere)."""
    if explicit is not None:
        return int(explicit), "needle.seed"
    seed = run_cfg.get("seed") if run_cfg is not None and hasattr(run_cfg, "get") else None
    if isinstance(seed, int) and not isinstance(seed, bool):
        return seed, "run config seed"
    seed = (((record or {}).get("inputs") or {}).get("seeds") or {}).get("seed")
    if isinstance(seed, int) and not isinstance(seed, bool):
        return seed, "run provenance seed"
    return 0, "no seed recorded: 0"


@torch.no_grad()
def run_needle(
    model,
    tokenizer,
    args,
    background: Iterable[str] | None = None,
    generator: NeedleGenerator | None = None,
    seed_source: str | None = None,
) -> dict:
    """Accuracy per (context length, needle count, depth); nested dict, JSON-ready.

    ``args``: the settings (``mta_repro.eval.args.NeedleArgs``; a ``seed`` of None is 0
    here: ``eval`` passes the run's, from ``needle_seed``, and where it came from as
    ``seed_source``). The prompts come from ``generator`` when given (its budgets already
    checked, as ``eval``'s prepare step does), else from a haystack built here from the
    ``background`` documents."""
    from mta_repro.model.generation import generate

    context_lens, needle_counts, depths = args.context_lens, args.needle_counts, args.depths
    samples, query, max_new_tokens = args.samples, args.query, args.max_new_tokens
    batch_size = args.batch_size
    seed = 0 if args.seed is None else int(args.seed)
    seed_source = seed_source or ("needle.seed" if args.seed is not None else "no seed given: 0")
    gen = generator
    if gen is None:
        if background is None:
            raise TypeError("run_needle: give the background documents or a NeedleGenerator")
        gen = NeedleGenerator(tokenizer, Haystack(tokenizer, background, args.max_background_chars), query)
        gen.check_all(context_lens, needle_counts, max_new_tokens)
    from mta_repro.eval import dist

    rng = random.Random(seed)
    results: dict = {
        "settings": {
            "query": query,
            "samples": samples,
            "max_new_tokens": max_new_tokens,
            "seed": seed,
            "seed_source": seed_source,
        }
    }
    # Every process draws every sample (same seed, same order); under torchrun each
    # generates for every world_size-th batch, and the scores are gathered.
    scores: dict = {}  # (setting, batch index) -> scores
    prompt_ids: dict = {}  # setting -> every sample's prompt_id, in draw order (every process has all)
    unit = 0
    for c in context_lens:
        for n in needle_counts:
            for d in depths:
                batch = [gen.sample(int(c), int(n), float(d), rng, max_new_tokens) for _ in range(samples)]
                prompt_ids[(str(c), str(n), f"{float(d):g}")] = [prompt_id(x.tokens) for x in batch]
                for b, s in enumerate(range(0, len(batch), batch_size)):
                    unit += 1
                    if not dist.mine(unit - 1):
                        continue
                    chunk = batch[s : s + batch_size]
                    res = generate(model, [x.tokens for x in chunk], max_new_tokens, eos_id=tokenizer.eos_id)
                    got = []
                    for x, ids in zip(chunk, res.tokens):
                        answer = tokenizer.decode([i for i in ids if i != tokenizer.eos_id]).split("\n")[0]
                        got.append(score_answer(answer, x.answers))
                    scores[(str(c), str(n), f"{float(d):g}", b)] = got
    scores = dist.merge_dicts(scores)
    table: dict = {}
    for c in context_lens:
        for n in needle_counts:
            per_depth, per_sample, per_id = {}, {}, {}
            for d in depths:
                key = (str(c), str(n), f"{float(d):g}")
                got = [v for b in range((samples + batch_size - 1) // batch_size) for v in scores[(*key, b)]]
                per_depth[key[2]] = sum(got) / len(got)
                per_sample[key[2]] = got
                per_id[key[2]] = prompt_ids[key]
            table.setdefault(str(c), {})[str(n)] = {
                "by_depth": per_depth,
                "mean": sum(per_depth.values()) / len(per_depth),
                # every sample's score, in draw order (the same prompts for every model of
                # one seed and settings): what the report's intervals resample
                "scores": per_sample,
                # parallel to scores: each sample's prompt_id, so that a prompt asked in
                # several runs (the same seed) is counted once
                "prompt_ids": per_id,
            }
    results["accuracy"] = table
    return results
