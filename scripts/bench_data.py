#!/usr/bin/env python3
"""Data-loader throughput per tokenizer, beside the tokens/s a training step needs.

For each tokenizer, one rank's loader (one process, no prefetch thread: the rate of the
pipeline itself) reads the bundled corpus at the paper's per-GPU shape (4 x 2048) and the
median tokens/s of ``--runs`` timed runs is printed. The "need" table gives, for the tiny
and 880M models (baseline and MTA), the training tokens/s per GPU at ``--tflops``
effective TFLOP/s (train FLOPs/token from mta_repro.model.flops), the paper's measured
880M rates (Table 9, per GPU) and, with ``--measure-step``, a measured training step of
the tiny model on ``--device``.

The Llama-3 ``tokenizer.model`` cannot be fetched here; without ``--tiktoken-path`` the
tiktoken row uses a stand-in of the same size: the first 128,000 ranks of Mistral's
Tekken BPE (``mistral_common``, Apache-2.0, fetched with ``pip download --no-deps``).

It also measures the *token* share of each domain in what the loader hands out (its
per-domain token counts, the ``train_tokens/<domain>`` metrics of training) against the
paper's per-*document* weights. The release (Lingua's ``choose_source``) draws a domain
per document, as this loader does, so a domain's token share is
w_d * L_d / sum_e(w_e * L_e) with L_d its mean document length in tokens; the
"expected" column is that formula with L_d measured on the documents drawn.

  python scripts/bench_data.py                       # CPU, ~1 minute
  python scripts/bench_data.py --mixture-only        # the token-share table only, seconds
  python scripts/bench_data.py --measure-step --device cuda
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from mta_repro.data import DataArgs, TokenizerArgs, build_train_loader
from mta_repro.data.args import REPO_ROOT

REPO = Path(__file__).resolve().parents[1]

# Paper Table 9: 880M training throughput on 32 H200, tokens/s (all GPUs).
PAPER_880M_TOKENS_PER_S = {"baseline": 54.3e3, "mta": 5.7e3}
PAPER_GPUS = 32


def tekken_standin(tmp: Path, n_ranks: int = 128_000) -> Path:
    """A tiktoken ranks file of Llama-3's size from mistral_common's Tekken vocabulary."""
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(tmp), "mistral_common==1.12.0"],
        check=True,
    )
    whl = next(tmp.glob("mistral_common-*.whl"))
    with zipfile.ZipFile(whl) as z:
        vocab = json.loads(z.read("mistral_common/data/tekken_240911.json"))["vocab"]
    out = tmp / "tekken128k.tiktoken"
    with out.open("w") as f:
        for v in vocab[:n_ranks]:
            f.write(f"{v['token_bytes']} {v['rank']}\n")
    return out


def bench_loader(tok: TokenizerArgs, seq_len: int, batch_size: int, runs: int, batches: int) -> dict:
    args = DataArgs(seq_len=seq_len, batch_size=batch_size, shuffle_buffer=64, prefetch=0, tokenizer=tok)
    loader = build_train_loader(args, 0, 1)
    next(loader)  # fills the shuffle buffer (64 windows) and opens the files
    rates = []
    for _ in range(runs):
        t0 = time.perf_counter()
        for _ in range(batches):
            next(loader)
        rates.append(batches * batch_size * seq_len / (time.perf_counter() - t0))
    loader.close()
    return {
        "median": statistics.median(rates),
        "min": min(rates),
        "max": max(rates),
        "n_words": loader.tokenizer.n_words,
    }


def mixture_share(seq_len: int, batch_size: int, batches: int) -> dict:
    """Measured doc and token shares per domain of ``batches`` batches of one rank's loader
    (bundled corpus, bundled tokenizer, the paper's weights), and the expected token share."""
    args = DataArgs(seq_len=seq_len, batch_size=batch_size, shuffle_buffer=64, prefetch=0)
    loader = build_train_loader(args, 0, 1)
    for _ in range(batches):
        next(loader)
    tokens = loader.token_counts()
    docs = dict(loader.n_docs)
    loader.close()
    weights = {d: w / sum(args.sources.values()) for d, w in args.sources.items()}
    # Mean tokens per drawn document (BOS/EOS included), from the counts (documents still
    # in the packing remainder / buffer are few against thousands drawn).
    mean_len = {d: tokens[d] / docs[d] if docs[d] else float("nan") for d in tokens}
    z = sum(weights[d] * mean_len[d] for d in tokens)
    n_tok, n_doc = sum(tokens.values()), sum(docs.values())
    return {
        d: {
            "weight": weights[d],
            "doc_share": docs[d] / n_doc,
            "mean_len": mean_len[d],
            "token_share": tokens[d] / n_tok,
            "expected": weights[d] * mean_len[d] / z,
        }
        for d in sorted(tokens)
    } | {"_total": {"tokens": n_tok, "docs": n_doc}}


def print_mixture(res: dict, seq_len: int, batch_size: int, batches: int) -> None:
    tot = res["_total"]
    print(
        f"\nDomain shares of {tot['tokens']:,} trained tokens ({tot['docs']:,} documents; {batches} batches of "
        f"{batch_size} x {seq_len}, one rank, bundled corpus + tokenizer, the paper's per-document weights)"
    )
    print("| domain | weight (per doc) | doc share | mean tokens/doc | token share | expected w*L/sum |")
    print("|---|---:|---:|---:|---:|---:|")
    for d, r in res.items():
        if d.startswith("_"):
            continue
        print(
            f"| {d} | {r['weight']:.3f} | {r['doc_share']:.3f} | {r['mean_len']:,.0f} | {r['token_share']:.3f} | "
            f"{r['expected']:.3f} |"
        )


def measure_tiny_step(device: str, seq_len: int, batch_size: int, steps: int = 10) -> float:
    """Tokens/s of a full training step (fwd + bwd + AdamW) of the tiny baseline model."""
    import torch

    from mta_repro.model import build_model
    from mta_repro.train.config import compose, model_args_from

    margs = model_args_from(compose(["model=tiny"]))
    model = build_model(margs, device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, margs.vocab_size, (batch_size, seq_len + 1), device=device)
    times = []
    for i in range(steps + 3):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16, enabled=device.startswith("cuda")):
            logits = model(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return batch_size * seq_len / statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--batches", type=int, default=10, help="batches per timed run")
    ap.add_argument("--tiktoken-path", default=None, help="Meta's Llama-3 tokenizer.model (else a same-size stand-in)")
    ap.add_argument(
        "--tflops", type=float, default=400.0, help="effective TFLOP/s per GPU for the estimate (H200 bf16)"
    )
    ap.add_argument("--measure-step", action="store_true", help="also time a tiny-model training step")
    ap.add_argument(
        "--step-seq-len", type=int, default=None, help="sequence length of the measured step (default --seq-len)"
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--mixture-batches", type=int, default=300, help="batches for the domain token-share table")
    ap.add_argument("--mixture-only", action="store_true", help="only the domain token-share table")
    a = ap.parse_args()

    mix = mixture_share(a.seq_len, a.batch_size, a.mixture_batches)
    print_mixture(mix, a.seq_len, a.batch_size, a.mixture_batches)
    if a.mixture_only:
        return

    from mta_repro.model.flops import model_flops_per_token
    from mta_repro.train.config import compose, model_args_from

    with tempfile.TemporaryDirectory() as td:
        tk_path = a.tiktoken_path or str(tekken_standin(Path(td)))
        toks = {
            "bytes": TokenizerArgs("bytes", None),
            "sentencepiece (bundled, 8192)": TokenizerArgs(
                "sentencepiece", str(REPO_ROOT / "data/tokenizer/mini_sp8192.model")
            ),
            ("tiktoken (Llama-3)" if a.tiktoken_path else "tiktoken (128k stand-in)"): TokenizerArgs(
                "tiktoken", tk_path
            ),
        }
        res = {name: bench_loader(t, a.seq_len, a.batch_size, a.runs, a.batches) for name, t in toks.items()}

    print(
        f"\nLoader throughput, one rank, batch {a.batch_size} x {a.seq_len}, bundled corpus, "
        f"median of {a.runs} runs x {a.batches} batches"
    )
    print("| tokenizer | ids | tokens/s (median) | min | max |")
    print("|---|---:|---:|---:|---:|")
    for name, r in res.items():
        print(f"| {name} | {r['n_words']} | {r['median']:,.0f} | {r['min']:,.0f} | {r['max']:,.0f} |")

    print(f"\nTokens/s one GPU's training step needs (seq {a.seq_len})")
    print(f"| model | train GFLOP/token | at {a.tflops:.0f} TFLOP/s | paper Table 9 per GPU | measured |")
    print("|---|---:|---:|---:|---:|")
    need = {}
    for size, attn in (("tiny", "baseline"), ("880m", "baseline"), ("880m", "mta")):
        m = model_args_from(compose([f"model={size}", f"attention={attn}"]))
        f = model_flops_per_token(m, a.seq_len)
        est = a.tflops * 1e12 / f
        paper = PAPER_880M_TOKENS_PER_S.get(attn) / PAPER_GPUS if size == "880m" else None
        meas = None
        if a.measure_step and size == "tiny":
            meas = measure_tiny_step(a.device, a.step_seq_len or a.seq_len, a.batch_size)
        need[(size, attn)] = max(x for x in (est, paper, meas) if x is not None)
        print(
            f"| {size} {attn} | {f / 1e9:.3f} | {est:,.0f} | {'' if paper is None else f'{paper:,.0f}'} | "
            f"{'' if meas is None else f'{meas:,.0f} ({a.device}, T={a.step_seq_len or a.seq_len})'} |"
        )

    slowest = min(r["median"] for r in res.values())
    print()
    for (size, attn), n in need.items():
        verdict = "yes" if slowest >= n else "NO"
        print(
            f"{size} {attn}: needs up to {n:,.0f} tokens/s per GPU; slowest loader {slowest:,.0f} -> "
            f"keeps a GPU fed: {verdict} ({slowest / n:.2f}x)"
        )


if __name__ == "__main__":
    main()
