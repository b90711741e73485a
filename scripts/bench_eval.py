"""Evaluation throughput per attention variant (tiny config): tokens/s of lm-eval
loglikelihood batches and of cached greedy generation, and questions/s of a
multiple-choice set (MMLU-like: --choices one-token answers per context of --seq-len
tokens) with shared context passes (the default) and with one pass per choice (the old
behaviour, ``share_prefixes=False``). Median of --repeats runs.

    python scripts/bench_eval.py [--seq-len 256 --batch 8 --prompt-len 128 --new-tokens 32]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mta_repro.eval.lm_eval_model import MTAReproLM
from mta_repro.model import build_model
from mta_repro.model.generation import generate
from mta_repro.train.config import compose, model_args_from

VARIANTS = ("baseline", "diff", "talking_heads", "mta")


class _Tok:  # ids only; the benchmark never encodes text
    bos_id, eos_id = 1, 2

    def __init__(self, n_words: int):
        self.n_words = n_words


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--seq-len", type=int, default=256, help="tokens per loglikelihood request")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--gen-batch", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--questions", type=int, default=8, help="multiple-choice questions")
    ap.add_argument("--choices", type=int, default=4)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    rows = []
    for variant in VARIANTS:
        margs = model_args_from(compose([f"model={args.model}", f"attention={variant}"]))
        model = build_model(margs, device=args.device).to(dtype).eval()
        lm = MTAReproLM(model=model, tokenizer=_Tok(margs.vocab_size), batch_size=args.batch)
        # loglikelihood: requests of seq_len tokens, the last 8 scored as continuation
        pairs = []
        for _ in range(args.batch):
            ids = torch.randint(3, margs.vocab_size, (args.seq_len + 1,), generator=g).tolist()
            pairs.append((ids[:-8], ids[-8:]))
        t_ll = median_time(lambda: lm._score(pairs), args.repeats)
        mc = []
        for _ in range(args.questions):
            ctx = torch.randint(3, margs.vocab_size, (args.seq_len,), generator=g).tolist()
            mc += [(ctx, [3 + c]) for c in range(args.choices)]
        lm_sep = MTAReproLM(model=model, tokenizer=_Tok(margs.vocab_size), batch_size=args.batch, share_prefixes=False)
        t_mc = median_time(lambda: lm._score(mc), args.repeats)
        t_mc_sep = median_time(lambda: lm_sep._score(mc), args.repeats)
        prompts = [
            torch.randint(3, margs.vocab_size, (args.prompt_len - 7 * i,), generator=g).tolist()
            for i in range(args.gen_batch)
        ]  # different lengths: left padding on
        with torch.no_grad():
            t_gen = median_time(lambda: generate(model, prompts, args.new_tokens), args.repeats)
        rows.append(
            (
                variant,
                args.batch * args.seq_len / t_ll,
                args.gen_batch * args.new_tokens / t_gen,
                args.new_tokens / t_gen,
                args.questions / t_mc,
                args.questions / t_mc_sep,
            )
        )
    print(f"\nmodel={args.model} device={args.device} dtype={args.dtype} threads={torch.get_num_threads()}")
    print(
        f"loglikelihood: {args.batch} x {args.seq_len} tokens; generation: {args.gen_batch} prompts "
        f"~{args.prompt_len} tokens, {args.new_tokens} new tokens (KV cache)\n"
    )
    print(
        f"multiple choice: {args.questions} questions x {args.choices} one-token choices, "
        f"{args.seq_len}-token contexts\n"
    )
    print(
        "| variant | loglikelihood tok/s | generation tok/s | decode steps/s | MC q/s shared "
        "| MC q/s one pass per choice |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for v, ll, gen, steps, mcs, mcsep in rows:
        print(f"| {v} | {ll:,.0f} | {gen:,.1f} | {steps:,.1f} | {mcs:,.1f} | {mcsep:,.1f} |")


if __name__ == "__main__":
    main()
