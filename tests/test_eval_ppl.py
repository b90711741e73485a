"""Per-domain perplexity against an independent float64 computation."""

import math

import pytest
import torch
from eval_helpers import make_tokenizer, tiny_model

from mta_repro.eval.ppl import domain_perplexity

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
    out = domain_perplexity(model, tok, DOCS, seq_len=seq_len, batch_size=1, max_batches=256)
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
    # max_batches caps the windows: 2 batches of 4 windows
    capped = domain_perplexity(model, tok, DOCS, seq_len=seq_len, batch_size=bs, max_batches=2)
    ppl2, count2 = reference(model, tok, DOCS, seq_len, bs, 2)
    assert capped["tokens"] == count2 == 2 * bs * seq_len
    assert capped["ppl"] == pytest.approx(ppl2, rel=1e-9)


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
