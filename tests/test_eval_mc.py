"""Multiple choice: continuations of one context share forward passes, same scores."""

import random

import pytest
import torch
from eval_helpers import make_tokenizer, tiny_model

from mta_repro.eval.lm_eval_model import MTAReproLM


def ref_ll(model, ctx, cont, max_length):
    whole = (ctx + cont)[-(max_length + 1) :]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([whole[:-1]]))[0].double(), -1)
    n = len(cont)
    pos = range(len(whole) - 1 - n, len(whole) - 1)
    ll = sum(float(logp[p, whole[p + 1]]) for p in pos)
    greedy = all(int(logp[p].argmax()) == whole[p + 1] for p in pos)
    return ll, greedy


@pytest.mark.parametrize("variant", ["mta", "diff"])
def test_shared_context_scores_equal_separate_passes(variant):
    tok = make_tokenizer()
    model = tiny_model(variant, vocab_size=tok.n_words, seed=5, dtype=torch.float64)
    rng = random.Random(0)
    pairs = []
    for q in range(3):  # MMLU-like: 4 one-token answers per question
        ctx = [tok.bos_id] + [rng.randrange(3, 259) for _ in range(40 + 7 * q)]
        pairs += [(ctx, [a]) for a in (40, 41, 42, 43)]
    ctx = [tok.bos_id] + [rng.randrange(3, 259) for _ in range(30)]
    pairs += [(ctx, [50, 51, 52]), (ctx, [50, 51]), (ctx, [60, 61, 62, 63])]  # one a prefix of another
    pairs += [pairs[0]]  # a duplicate
    long_ctx = [tok.bos_id] + [rng.randrange(3, 259) for _ in range(120)]
    pairs += [(long_ctx, [70]), (long_ctx, [71])]  # left-truncated at max_length: still shared
    lm = MTAReproLM(model=model, tokenizer=tok, batch_size=3, max_length=64)
    got = lm._score(pairs)
    # 3 questions + (1 row for [50,51,52] and [50,51]) + 1 for [60..63] + 1 for the long context
    assert lm.forward_rows == 3 + 2 + 1
    sep = MTAReproLM(model=model, tokenizer=tok, batch_size=3, max_length=64, share_prefixes=False)
    alone = sep._score(pairs)
    assert sep.forward_rows == len(pairs)
    for (ctx, cont), g, a in zip(pairs, got, alone):
        ll, greedy = ref_ll(model, ctx, cont, 64)
        assert g[0] == pytest.approx(ll, rel=1e-9, abs=1e-9) and g[1] == greedy
        assert a[0] == pytest.approx(ll, rel=1e-9, abs=1e-9) and a[1] == greedy
