"""``python -m mta_repro.eval.lm_eval_cli``: lm-eval's own command line with the model registered,
end to end in a subprocess on a local task YAML (offline)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from eval_helpers import make_run, make_tokenizer

from mta_repro.eval.lm_eval_cli import build_argv
from mta_repro.eval.lm_eval_tasks import write_local_task
from mta_repro.eval.load import load_model

FIX = Path(__file__).parent / "fixtures" / "eval"

pytestmark = pytest.mark.lm_eval

ENV = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def cli(*args, timeout=240):
    return subprocess.run(
        [sys.executable, "-m", "mta_repro.eval.lm_eval_cli", *args],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=timeout,
    )


def ll_ref(model, tok, context, continuation):
    """log p(continuation | BOS + context) from one float64 forward pass (lm-eval's
    rule: trailing context spaces move to the continuation)."""
    n_sp = len(context) - len(context.rstrip())
    if n_sp:
        context, continuation = context[:-n_sp], context[-n_sp:] + continuation
    whole = tok.encode(context + continuation, add_bos=True, add_eos=False)
    n_ctx = len(tok.encode(context, add_bos=True, add_eos=False))
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([whole]))[0].double(), -1)
    return sum(float(logp[t - 1, whole[t]]) for t in range(n_ctx, len(whole)))


@pytest.mark.slow
def test_cli_runs_lm_eval_with_its_flags(tmp_path):
    run_dir, _ = make_run(tmp_path / "run", attention="mta")
    tasks = tmp_path / "tasks"
    write_local_task("arc_easy", {"test": FIX / "lm_eval" / "arc_easy_test.jsonl"}, tasks)
    out = tmp_path / "out"
    r = cli(
        "--model_args",
        f"pretrained={run_dir},dtype=float64",
        "--tasks",
        "arc_easy_local",
        "--include_path",
        str(tasks),
        "--num_fewshot",
        "0",
        "--batch_size",
        "3",
        "--limit",
        "3",
        "--output_path",
        str(out),
        "--log_samples",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    [res_file] = list(out.rglob("results_*.json"))
    [samples_file] = list(out.rglob("samples_arc_easy_local_*.jsonl"))
    res = json.loads(res_file.read_text())
    assert res["config"]["model"] == "mta_repro" and res["config"]["limit"] == 3
    assert res["config"]["device"] == "auto" and str(res["config"]["batch_size"]) == "3"
    samples = [json.loads(line) for line in samples_file.read_text().splitlines()]
    assert len(samples) == 3  # --limit
    # Each logged log-likelihood equals an independent float64 forward pass of the saved
    # weights, and acc follows from them.
    model, _ = load_model(run_dir, device="cpu", dtype="float64")
    tok = make_tokenizer()
    correct = 0
    for s in samples:
        args = [(a["arg_0"], a["arg_1"]) for a in s["arguments"].values()]
        lls = [ll_ref(model, tok, c, x) for c, x in args]
        got = [float(r[0][0]) for r in s["resps"]]
        assert got == pytest.approx(lls, rel=1e-6, abs=1e-6)
        correct += int(max(range(len(lls)), key=lls.__getitem__) == int(s["target"]))
    assert res["results"]["arc_easy_local"]["acc,none"] == pytest.approx(correct / 3)


def test_cli_help_and_errors(tmp_path):
    r = cli("--help", timeout=120)
    assert r.returncode == 0
    for flag in (
        "--tasks",
        "--num_fewshot",
        "--batch_size",
        "--limit",
        "--include_path",
        "--output_path",
        "--log_samples",
        "--model_args",
    ):
        assert flag in r.stdout, flag
    assert "mta_repro" in r.stdout
    r = cli("--model_args", f"pretrained={tmp_path / 'nope'}", "--tasks", "arc_easy", timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("mta-lm-eval: error: checkpoint:")
    assert "Traceback" not in r.stderr


def test_argv_defaults():
    assert build_argv(["--tasks", "x"]) == ["run", "--device", "auto", "--model", "mta_repro", "--tasks", "x"]
    assert build_argv(["run", "--model", "hf", "--device=cpu"]) == ["run", "--model", "hf", "--device=cpu"]
    assert build_argv(["ls", "tasks"]) == ["ls", "tasks"]


def test_console_script_declared():
    import tomllib

    meta = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert meta["project"]["scripts"]["mta-lm-eval"] == "mta_repro.eval.lm_eval_cli:main"
