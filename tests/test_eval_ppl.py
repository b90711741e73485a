"""Per-domain perplexity against an independent float64 computation; the windows, a
seeded random sample of the domain's, against an independent reading of the corpus."""

import json
import math
from collections import Counter

import pytest
import torch
from eval_helpers import make_tokenizer, tiny_model

from mta_repro.errors import UserError
from mta_repro.eval.ppl import domain_perplexity, pick_windows, validation_perplexity

DOCS = [
    "The cat sat on the mat. " * 3,
    "Perplexity is the exponentiated average negative log-likelihood.",
    "Short one.",
    "Windows are non-overlapping in their targets; the protocol drops a trailing partial window. " * 2,
]


def reference(model, tok, docs, seq_len, batch_size, max_batches):
    stream = []
    for d in docs:
        stream += tok.encode(d, True, True)
    # Every target position t (1 <= t < N) is scored with context stream[w*seq_len : t]
    # where w = (t-1) // seq_len, for complete windows only.
    n_windows = (len(stream) - 1) // seq_len
    n_windows = min(n_windows, batch_size * max_batches)
    nll, count = 0.0, 0
    for w in range(n_windows):
        nll += window_nll(model, stream[w * seq_len : w * seq_len + seq_len + 1])
        count += seq_len
    return math.exp(nll / count), count


def window_nll(model, window) -> float:
    """The summed negative log-likelihood of one window's targets, in float64 by hand."""
    logits = model(torch.tensor([window[:-1]]))[0].double()
    nll = 0.0
    for i in range(len(window) - 1):
        row = logits[i].tolist()
        m = max(row)
        lse = m + math.log(sum(math.exp(x - m) for x in row))
        nll += lse - row[window[i + 1]]
    return nll


def test_every_window_keeps_its_own_loss_for_the_bootstrap():
    """batch_size=1: batch_ce[i] is window i's summed loss (what the report's bootstrap
    over evaluation windows resamples), and the windows add up to the domain's loss."""
    tok = make_tokenizer()
    model = tiny_model("baseline", vocab_size=tok.n_words, dtype=torch.float64)
    seq_len = 16
    out = domain_perplexity(model, tok, DOCS, seq_len=seq_len, batch_size=1, max_batches=256, window_sampling="first")
    stream = [t for d in DOCS for t in tok.encode(d, True, True)]
    n = (len(stream) - 1) // seq_len
    assert out["batches"] == n == len(out["batch_ce"]) and out["batch_tokens"] == [seq_len] * n
    for w, ce in enumerate(out["batch_ce"]):
        assert ce == pytest.approx(window_nll(model, stream[w * seq_len : w * seq_len + seq_len + 1]), rel=1e-9)
    assert sum(out["batch_ce"]) / sum(out["batch_tokens"]) == pytest.approx(out["loss"], rel=1e-12)


@pytest.mark.parametrize("variant", ["baseline", "mta"])
def test_domain_perplexity_matches_float64_loop(variant):
    tok = make_tokenizer()
    model = tiny_model(variant, vocab_size=tok.n_words, dtype=torch.float64)
    seq_len, bs = 32, 4
    out = domain_perplexity(model, tok, DOCS, seq_len=seq_len, batch_size=bs, max_batches=256)
    ppl, count = reference(model, tok, DOCS, seq_len, bs, 256)
    assert out["tokens"] == count
    assert out["ppl"] == pytest.approx(ppl, rel=1e-9)
    # max_batches caps the windows: 2 batches of 4 windows, the first ones (the old protocol)
    capped = domain_perplexity(model, tok, DOCS, seq_len=seq_len, batch_size=bs, max_batches=2, window_sampling="first")
    ppl2, count2 = reference(model, tok, DOCS, seq_len, bs, 2)
    assert capped["tokens"] == count2 == 2 * bs * seq_len
    assert capped["ppl"] == pytest.approx(ppl2, rel=1e-9)


# Documents of different lengths: hundreds of 16-token windows, many straddling two documents.
MANY = [f"Document {i} says: " + "lorem ipsum " * (1 + (i * 7) % 23) for i in range(60)]


def stream_with_docs(tok, docs):
    """(every token of the BOS/EOS-wrapped concatenation, the index of its document), by hand."""
    ids, owner = [], []
    for i, d in enumerate(docs):
        t = tok.encode(d, True, True)
        ids += t
        owner += [i] * len(t)
    return ids, owner


def window_doc(owner, w, seq_len):
    """The document holding most of window w's targets (stream positions w*L+1 .. w*L+L), the earlier on a tie."""
    count = Counter(owner[w * seq_len + 1 : w * seq_len + seq_len + 1])
    return min(count, key=lambda d: (-count[d], d))


def check_against_stream(picked, ids, owner, seq_len):
    """Each picked window is the stream's window at its index and names its document."""
    for w, doc, tokens in picked:
        assert list(tokens) == ids[w * seq_len : w * seq_len + seq_len + 1]
        assert doc == window_doc(owner, w, seq_len)


def test_windows_are_a_seeded_sample_of_the_whole_stream():
    tok = make_tokenizer()
    seq_len = 16
    ids, owner = stream_with_docs(tok, MANY)
    n_all = (len(ids) - 1) // seq_len
    assert n_all > 300  # a sample of 40 windows is a small part of them
    every = pick_windows(MANY, tok, seq_len, None)
    assert [w for w, _, _ in every] == list(range(n_all))
    check_against_stream(every, ids, owner, seq_len)
    assert len({d for _, d, _ in every}) == len(MANY)  # no document is left out of the attribution
    a = pick_windows(MANY, tok, seq_len, 40, "random", 0)
    b = pick_windows(MANY, tok, seq_len, 40, "random", 0)
    c = pick_windows(MANY, tok, seq_len, 40, "random", 1)
    idx = [w for w, _, _ in a]
    assert idx == [w for w, _, _ in b]  # same seed, same windows
    assert idx != [w for w, _, _ in c]  # another seed, other windows
    assert len(set(idx)) == 40 and idx == sorted(idx)  # without replacement, in stream order
    assert idx[-1] > 40 and idx != list(range(40))  # drawn from the whole stream, not its start
    check_against_stream(a + c, ids, owner, seq_len)
    # "first" is the stream's start; a sample as large as the stream is all of it
    assert [w for w, _, _ in pick_windows(MANY, tok, seq_len, 40, "first")] == list(range(40))
    assert [w for w, _, _ in pick_windows(MANY, tok, seq_len, n_all + 5, "random", 3)] == list(range(n_all))


def test_every_window_is_equally_likely_to_be_drawn():
    """Over 1000 seeds, each of the N windows is drawn k/N of the time (chi-square, SciPy)."""
    from scipy.stats import chisquare

    tok = make_tokenizer()
    seq_len, k, seeds = 64, 10, 1000
    counts = Counter(w for seed in range(seeds) for w, _, _ in pick_windows(MANY, tok, seq_len, k, "random", seed))
    n_all = (len(stream_with_docs(tok, MANY)[0]) - 1) // seq_len
    observed = [counts[w] for w in range(n_all)]
    assert sum(observed) == k * seeds and n_all > 4 * k
    assert chisquare(observed, [k * seeds / n_all] * n_all).pvalue > 1e-3


def test_random_windows_score_their_own_tokens_and_documents():
    tok = make_tokenizer()
    model = tiny_model("baseline", vocab_size=tok.n_words, dtype=torch.float64)
    seq_len, bs = 16, 3
    ids, owner = stream_with_docs(tok, MANY)
    out = domain_perplexity(model, tok, MANY, seq_len=seq_len, batch_size=bs, max_batches=4, window_seed=5)
    picked = pick_windows(MANY, tok, seq_len, 12, "random", 5)
    check_against_stream(picked, ids, owner, seq_len)
    assert out["batches"] == 4 and out["batch_tokens"] == [seq_len] * 12 and out["tokens"] == 12 * seq_len
    assert out["batch_doc"] == [window_doc(owner, w, seq_len) for w, _, _ in picked]
    for (w, _, _), ce in zip(picked, out["batch_ce"]):
        assert ce == pytest.approx(window_nll(model, ids[w * seq_len : w * seq_len + seq_len + 1]), rel=1e-9)
    assert out["loss"] == pytest.approx(math.fsum(out["batch_ce"]) / (12 * seq_len), rel=1e-12)
    assert out["ppl"] == pytest.approx(math.exp(out["loss"]), rel=1e-12)


def read_validation(domain: str) -> list:
    """The domain's documents of the bundled validation file, read here with zstandard and json."""
    import zstandard

    from mta_repro.data import DataArgs
    from mta_repro.data.sources import SET_NAMES, corpus_root

    path = corpus_root(DataArgs()) / "validation" / "chunk1" / "example_holdout_0.jsonl.zst"
    text = zstandard.ZstdDecompressor().stream_reader(path.open("rb")).read().decode("utf-8")
    recs = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [r["text"] for r in recs if r["meta"]["redpajama_set_name"] == SET_NAMES[domain]]


def test_bundled_corpus_windows_documents_and_token_loss():
    """On the bundled validation set: every window's document against an independent
    reading of the file, and token_loss/tokens against a float64 sum of the windows."""
    from mta_repro.data import DataArgs, iter_validation_docs

    tok = make_tokenizer()
    model = tiny_model("mta", vocab_size=tok.n_words)
    seq_len, bs, mb = 64, 2, 3
    domains = ["arxiv", "book", "github"]
    out = validation_perplexity(model, tok, DataArgs(), domains, seq_len, bs, mb, window_seed=11)
    for name in domains:
        docs = read_validation(name)
        ids, owner = stream_with_docs(tok, docs)
        picked = pick_windows(iter_validation_docs(DataArgs(), name), tok, seq_len, bs * mb, "random", 11)
        check_against_stream(picked, ids, owner, seq_len)
        assert len(picked) == bs * mb < (len(ids) - 1) // seq_len
        d = out["domains"][name]
        assert d["batch_doc"] == [doc for _, doc, _ in picked]
        assert all(0 <= doc < len(docs) for doc in d["batch_doc"])
    assert len(set(out["domains"]["book"]["batch_doc"])) > 1  # windows from several books
    ce = [c for d in out["domains"].values() for c in d["batch_ce"]]
    tokens = [t for d in out["domains"].values() for t in d["batch_tokens"]]
    assert out["tokens"] == sum(tokens) == len(domains) * bs * mb * seq_len
    assert out["token_loss"] == pytest.approx(math.fsum(ce) / sum(tokens), rel=1e-12)
    # the paper's average weighs domains, token_loss weighs tokens: equal domains' sizes here
    assert out["token_loss"] == pytest.approx(sum(d["loss"] for d in out["domains"].values()) / 3, rel=1e-9)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"window_sampling": "firsts"}, "eval.ppl.window_sampling: expected 'random' or 'first'"),
        ({"window_seed": -1}, "eval.ppl.window_seed: expected a non-negative integer"),
        ({"max_batches": 0}, "eval.ppl.max_batches: expected a positive number"),
    ],
)
def test_bad_window_settings_are_one_line_naming_the_field(kwargs, field):
    tok = make_tokenizer()
    model = tiny_model("baseline", vocab_size=tok.n_words)
    with pytest.raises(UserError, match=field):
        domain_perplexity(model, tok, MANY, seq_len=16, **kwargs)


def test_too_little_text_is_a_clear_error():
    tok = make_tokenizer()
    model = tiny_model("baseline", vocab_size=tok.n_words)
    with pytest.raises(ValueError, match="fewer than seq_len"):
        domain_perplexity(model, tok, ["tiny"], seq_len=64)


def test_progress_off_a_terminal_is_plain_lines():
    """SLURM .err files and pipes get whole lines (no carriage returns) and a final one."""
    import io

    from mta_repro.eval.progress import Progress

    out = io.StringIO()  # not a TTY
    p = Progress("ppl/book", total=4, every_s=0.0, stream=out)
    for _ in range(4):
        p.update()
    p.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and len(lines) == 5
    assert lines[1].startswith("[eval] ppl/book: 2/4 (50%)") and lines[-1].endswith("done")


def test_progress_when_the_data_ends_before_the_limit_says_finished():
    """A domain with 6 batches under a limit of 16 ends with a finished line, not '38%'."""
    import io

    from mta_repro.eval.progress import Progress

    out = io.StringIO()
    p = Progress("ppl/arxiv", total=16, every_s=1e9, stream=out)
    for _ in range(6):
        p.update()
    p.close()
    last = out.getvalue().splitlines()[-1]
    assert last.startswith("[eval] ppl/arxiv: 6 of at most 16 (all the data holds)") and last.endswith("done")
    assert "%" not in last


@pytest.mark.slow
@pytest.mark.parametrize(
    "override, message",
    [
        ("ppl.window_sampling=firsts", "eval.ppl.window_sampling: expected 'random' or 'first', got 'firsts'"),
        ("ppl.window_seed=-2", "eval.ppl.window_seed: expected a non-negative integer, got -2"),
        ("needle.seed=-1", "eval.needle.seed=-1: expected a seed, an integer with 0 <= seed < 2**32 (4,294,967,296)"),
    ],
)
def test_bad_seed_or_sampling_on_the_command_line_exits_2_writing_nothing(tmp_path, override, message):
    import os
    import subprocess
    import sys

    from eval_helpers import make_run

    run_dir, _ = make_run(tmp_path / "run", attention="baseline")
    p = subprocess.run(
        [sys.executable, "-m", "mta_repro.eval", str(run_dir), "tasks=[ppl,needle]", "device=cpu", override],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [f"eval: error: {message}"], p.stderr[-2000:]
    assert not (run_dir / "eval").exists()
