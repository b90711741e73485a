"""The exported MTA / talking-heads / Differential model under transformers' generate():
its own cache (keys, values and MTA's last query rows) gives the tokens of a full
recompute and of ``mta_repro``'s own cached generator, fed one token a step; lm-eval's ``hf``
model on an export gives our lm-eval model's log-likelihoods."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
from eval_helpers import make_run

from mta_repro.eval.load import load_model
from mta_repro.hf import export_hf
from mta_repro.model.generation import generate as our_generate

FIX = Path(__file__).parent / "fixtures" / "eval"

PROMPT = torch.tensor([[1, 72, 101, 108, 108, 111, 44, 32, 119, 111]])


def _export(tmp_path, attention):
    run_dir, _ = make_run(tmp_path / "run", attention=attention)
    out = export_hf(run_dir, tmp_path / "hf")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=True, torch_dtype=torch.float32).eval()
    return run_dir, out, hf


@pytest.mark.parametrize("attention", ["mta", "talking_heads", "diff"])
def test_generate_with_cache_equals_full_recompute_and_ours(tmp_path, attention):
    run_dir, _, hf = _export(tmp_path, attention)
    model, _ = load_model(run_dir, device="cpu", dtype="float32")
    kw = dict(do_sample=False, pad_token_id=0)
    with torch.no_grad():
        cached = hf.generate(PROMPT, max_new_tokens=24, min_new_tokens=24, use_cache=True, **kw)
        full = hf.generate(PROMPT, max_new_tokens=24, min_new_tokens=24, use_cache=False, **kw)
        want = PROMPT
        for _ in range(24):  # greedy by hand, our model, full recompute
            want = torch.cat([want, model(want)[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(cached, full) and torch.equal(cached, want)
    ours = our_generate(model, [PROMPT[0].tolist()], max_new_tokens=24, eos_id=None)
    assert ours.tokens[0] == cached[0, PROMPT.shape[1] :].tolist()
    # left-padded batch and beam search reorder the cache's rows
    batch = torch.tensor([[0, 0, 0, 1, 72, 101, 108, 108, 111, 44], PROMPT[0].tolist()])
    mask = (batch != 0).long()
    with torch.no_grad():
        a = hf.generate(batch, attention_mask=mask, max_new_tokens=8, use_cache=True, **kw)
        b = hf.generate(batch, attention_mask=mask, max_new_tokens=8, use_cache=False, **kw)
        c = hf.generate(PROMPT, max_new_tokens=6, num_beams=3, use_cache=True, **kw)
        d = hf.generate(PROMPT, max_new_tokens=6, num_beams=3, use_cache=False, **kw)
    assert torch.equal(a, b) and torch.equal(c, d)


def test_cache_feeds_one_token_a_step_where_a_recompute_feeds_the_whole_prefix(tmp_path):
    """What makes the cache faster, counted rather than timed (a timed test is noise on a
    shared machine; scripts/ benchmarks time): with use_cache=True, generate() runs the
    prompt once and then one new token per step, linear in the length; without, every
    step runs the whole prefix again, quadratic. 64 new tokens: 73 tokens against 2,656."""
    _, _, hf = _export(tmp_path, "mta")
    n, fed = 64, {True: [], False: []}
    with torch.no_grad():
        for use_cache in (True, False):
            hook = hf.register_forward_pre_hook(
                lambda mod, args, kwargs, uc=use_cache: fed[uc].append(kwargs["input_ids"].shape[1]), with_kwargs=True
            )
            try:
                out = hf.generate(
                    PROMPT, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, use_cache=use_cache
                )
            finally:
                hook.remove()
            assert out.shape[1] == PROMPT.shape[1] + n
    p = PROMPT.shape[1]
    assert fed[True] == [p] + [1] * (n - 1)
    assert fed[False] == list(range(p, p + n))
    assert sum(fed[True]) == 73 and sum(fed[False]) == 2656


def test_exported_tokenizer_is_plain_fast(tmp_path):
    """No remote code for the tokenizer: a PreTrainedTokenizerFast that transformers 4.x
    loads too (5.x names its own class TokenizersBackend), without token_type_ids."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    _, out, _ = _export(tmp_path, "mta")
    tc = json.loads((out / "tokenizer_config.json").read_text())
    assert tc["tokenizer_class"] == "PreTrainedTokenizerFast"
    tok = PreTrainedTokenizerFast.from_pretrained(str(out))
    assert tok("hi")["input_ids"][0] == tok.bos_token_id and "token_type_ids" not in tok("hi")
    auto = AutoTokenizer.from_pretrained(str(out), trust_remote_code=False)
    assert auto("hi")["input_ids"] == tok("hi")["input_ids"]


@pytest.mark.slow
def test_lm_eval_hf_model_on_export_matches_ours(tmp_path):
    from lm_eval.api.instance import Instance

    from mta_repro.eval.lm_eval_model import MTAReproLM
    from mta_repro.eval.lm_eval_tasks import write_local_task

    run_dir, out, _ = _export(tmp_path, "mta")
    tasks = tmp_path / "tasks"
    write_local_task("arc_easy", {"test": FIX / "lm_eval" / "arc_easy_test.jsonl"}, tasks)
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "lm_eval",
            "run",
            "--model",
            "hf",
            "--model_args",
            f"pretrained={out},trust_remote_code=True,dtype=float32,add_bos_token=True",
            "--tasks",
            "arc_easy_local",
            "--include_path",
            str(tasks),
            "--limit",
            "3",
            "--batch_size",
            "3",
            "--device",
            "cpu",
            "--output_path",
            str(tmp_path / "out"),
            "--log_samples",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    [samples_file] = list((tmp_path / "out").rglob("samples_arc_easy_local_*.jsonl"))
    samples = [json.loads(line) for line in samples_file.read_text().splitlines()]
    lm = MTAReproLM(pretrained=str(run_dir), dtype="float32", device="cpu")
    n = 0
    for s in samples:
        reqs = [
            Instance("loglikelihood", {}, (a["arg_0"], a["arg_1"]), i) for i, a in enumerate(s["arguments"].values())
        ]
        ours = [ll for ll, _ in lm.loglikelihood(reqs)]
        got = [float(x[0][0]) for x in s["resps"]]
        assert got == pytest.approx(ours, rel=1e-5, abs=1e-5)
        n += len(got)
    assert n >= 6
