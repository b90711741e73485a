"""lm-eval integration through simple_evaluate on local fixture tasks (offline)."""

import math
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import lm_eval
from eval_helpers import make_tokenizer, tiny_model
from lm_eval.api.instance import Instance
from lm_eval.api.registry import get_model

from mta_repro.eval.lm_eval_model import MTAReproLM
from mta_repro.eval.lm_eval_tasks import check_task_names, task_manager, write_local_task

FIX = Path(__file__).parent / "fixtures" / "eval"

pytestmark = pytest.mark.lm_eval


def independent_ll(model, tok, context, continuation):
    """Sum log p(continuation | BOS + context) from one full float64 forward pass."""
    n_sp = len(context) - len(context.rstrip())
    if n_sp:
        context, continuation = context[:-n_sp], context[-n_sp:] + continuation
    whole = tok.encode(context + continuation, add_bos=True, add_eos=False)
    n_ctx = len(tok.encode(context, add_bos=True, add_eos=False))
    with torch.no_grad():
        logp = torch.log_softmax(model.double()(torch.tensor([whole]))[0], -1)
    return sum(float(logp[t - 1, whole[t]]) for t in range(n_ctx, len(whole)))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lm_eval_tasks")
    data = FIX / "lm_eval"
    for name in ("rolling_local.yaml", "qa_local.yaml"):
        (tmp / name).write_text((data / name).read_text().replace("DATA_DIR", str(data.resolve())))
    manager = task_manager()
    write_local_task("arc_easy", {"test": data / "arc_easy_test.jsonl"}, tmp, manager=manager)
    write_local_task("lambada_openai", {"test": data / "lambada_test.jsonl"}, tmp, manager=manager)
    tok = make_tokenizer()
    model = tiny_model("mta", vocab_size=tok.n_words, seed=3)
    return TaskManagerHolder(task_manager(str(tmp)), model, tok)


class TaskManagerHolder:
    def __init__(self, manager, model, tok):
        self.manager, self.model, self.tok = manager, model, tok


def test_registered_under_mta_repro():
    assert get_model("mta_repro") is MTAReproLM


def test_simple_evaluate_multiple_choice_and_loglikelihood(setup):
    lm = MTAReproLM(model=setup.model, tokenizer=setup.tok, batch_size=3)
    out = lm_eval.simple_evaluate(
        model=lm,
        tasks=["arc_easy_local", "lambada_openai_local"],
        task_manager=setup.manager,
        bootstrap_iters=0,
        log_samples=True,
        num_fewshot=0,
    )
    ref_model = tiny_model("mta", vocab_size=setup.tok.n_words, seed=3, dtype=torch.float64)
    # ARC: the official prompt "Question: ...\nAnswer:" + " choice"; acc from the lls.
    correct = 0
    for s in out["samples"]["arc_easy_local"]:
        lls = [independent_ll(ref_model, setup.tok, *a) for a in s["arguments"]]
        assert s["arguments"][0][0].startswith("Question: ") and s["arguments"][0][0].endswith("\nAnswer:")
        got = [r[0][0] for r in s["resps"]]
        assert got == pytest.approx(lls, rel=1e-4, abs=1e-4)
        correct += int(max(range(len(lls)), key=lls.__getitem__) == s["target"])
    assert out["results"]["arc_easy_local"]["acc,none"] == pytest.approx(correct / 4)
    # LAMBADA: perplexity of the last word = exp(-mean ll).
    lls = []
    for s in out["samples"]["lambada_openai_local"]:
        ctx, cont = s["arguments"][0]
        assert cont.startswith(" ") and " " not in cont[1:]
        lls.append(independent_ll(ref_model, setup.tok, ctx, cont))
    ppl = out["results"]["lambada_openai_local"]["perplexity,none"]
    assert ppl == pytest.approx(math.exp(-sum(lls) / len(lls)), rel=1e-4)


def test_rolling_returns_plain_floats_and_generation_stops(setup):
    lm = MTAReproLM(model=setup.model, tokenizer=setup.tok, batch_size=2, max_length=64)
    out = lm_eval.simple_evaluate(
        model=lm,
        tasks=["rolling_local", "qa_local"],
        task_manager=setup.manager,
        bootstrap_iters=0,
        log_samples=True,
    )
    res = out["results"]["rolling_local"]
    assert res["word_perplexity,none"] > 1.0 and math.isfinite(res["bits_per_byte,none"])
    # max_length 64 < the first document: rolling windows must still score every token once.
    doc = out["samples"]["rolling_local"][0]["arguments"][0][0]
    ids = setup.tok.encode(doc, add_bos=False, add_eos=False)
    ref = tiny_model("mta", vocab_size=setup.tok.n_words, seed=3, dtype=torch.float64)
    total, prev = 0.0, [setup.tok.bos_id]
    for start in range(0, len(ids), 64):  # disjoint windows: BOS/last token as context
        chunk = ids[start : start + 64]
        seq = (prev + chunk)[-65:]
        with torch.no_grad():
            logp = torch.log_softmax(ref(torch.tensor([seq[:-1]]))[0], -1)
        total += sum(float(logp[len(seq) - 1 - len(chunk) + j, chunk[j]]) for j in range(len(chunk)))
        prev = chunk
    [val] = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (doc,), 0)])
    assert type(val) is float and val == pytest.approx(total, rel=1e-4)
    for s in out["samples"]["qa_local"]:
        text = s["resps"][0][0]
        assert "\n" not in text and "Q:" not in text
    assert 0.0 <= out["results"]["qa_local"]["exact_match,none"] <= 1.0


def test_bad_inputs_are_clear_errors(setup):
    with pytest.raises(ValueError, match="unknown lm-eval task"):
        check_task_names(["arc_easy_local", "no_such_task"], setup.manager)

    class WrongTok:
        n_words, bos_id, eos_id = 1000, 1, 2

    with pytest.raises(ValueError, match="n_words=1000"):
        MTAReproLM(model=setup.model, tokenizer=WrongTok())
