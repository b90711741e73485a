"""``python -m mta_repro.eval.generate``: text from a run through the KV-cache generator."""

import os
import subprocess
import sys

import pytest
import torch
from eval_helpers import make_run, make_tokenizer

from mta_repro.eval.generate import generate_from
from mta_repro.eval.load import load_model


def greedy_without_cache(model, ids, n):
    """Independent greedy decoding: a full forward pass per new token, no cache."""
    out = []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(torch.tensor([ids + out]))[0, -1].argmax())
            out.append(nxt)
    return out


@pytest.mark.slow
def test_generate_command(tmp_path):
    run_dir, _ = make_run(tmp_path / "run", attention="mta")
    tok = make_tokenizer()
    model, _ = load_model(run_dir, device="cpu")
    prompt = "The cat sat on the"
    ids = greedy_without_cache(model, tok.encode(prompt, add_bos=True, add_eos=False), 12)
    if tok.eos_id in ids:
        ids = ids[: ids.index(tok.eos_id)]
    want = tok.decode(ids)
    assert generate_from(run_dir, [prompt], max_new_tokens=12, device="cpu") == [want]
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mta_repro.eval.generate",
            str(run_dir / "export" / "consolidated.pt"),
            "--prompt",
            prompt,
            "--prompt",
            "x",
            "--max-new-tokens",
            "12",
            "--device",
            "cpu",
        ],
        capture_output=True,
        timeout=120,
        env=os.environ,
    )
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    # bytes, not text=True: universal newlines would turn a generated '\r' into '\n'
    assert r.stdout.decode("utf-8").startswith("=== prompt 0\n" + prompt + want + "\n=== prompt 1\nx")
    # sampling is reproducible from its seed
    a = generate_from(run_dir, [prompt], max_new_tokens=8, temperature=1.0, seed=3, device="cpu")
    assert a == generate_from(run_dir, [prompt], max_new_tokens=8, temperature=1.0, seed=3, device="cpu")


@pytest.mark.slow
def test_generate_errors_and_help(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "mta_repro.eval.generate", str(tmp_path / "nope"), "--prompt", "a"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and r.stderr.strip().startswith("generate: error: checkpoint:")
    assert len(r.stderr.strip().splitlines()) == 1
    r = subprocess.run(
        [sys.executable, "-m", "mta_repro.eval.generate", "--help"], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0 and "--max-new-tokens" in r.stdout and "KV-cache" in r.stdout


def test_whitespace_continuations_are_summarised_and_the_weights_named(tmp_path):
    """A model that can only say '\\n' (every embedding a multiple of one vector, the
    newline's the longest, blocks adding nothing, tied output): the command prints the
    prompt and says on stderr what the continuation was, instead of 64 blank lines; --raw
    prints it exactly. stderr names the export and its step."""
    run_dir, model = make_run(tmp_path / "run", attention="baseline")
    tok = make_tokenizer()
    nl = tok.encode("\n", add_bos=False, add_eos=False)[-1]
    pt = run_dir / "export" / "consolidated.pt"
    ck = torch.load(pt, weights_only=True)
    sd = ck["model"]
    assert "output.weight" not in sd  # tied: logits are embeddings . final state
    v = torch.rand(sd["tok_embeddings.weight"].shape[1]) + 0.5
    sd["tok_embeddings.weight"][:] = v
    sd["tok_embeddings.weight"][nl] = 10 * v
    for k in sd:
        if k.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
            sd[k].zero_()  # each block adds nothing to the residual stream
    torch.save(ck, pt)

    def cli(*extra):
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "mta_repro.eval.generate",
                str(run_dir),
                "--prompt",
                "The cat",
                "--device",
                "cpu",
                *extra,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )

    r = cli()
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout == "The cat\n"
    assert f"generate: weights {pt} (step 7), tokenizer bytes; greedy, up to 64 new tokens" in r.stderr
    assert "prompt 0: the continuation is whitespace only (64 x '\\n'); --raw prints it" in r.stderr
    r = cli("--raw", "--max-new-tokens", "5")
    assert r.returncode == 0 and r.stdout == "The cat" + "\n" * 5 + "\n"
