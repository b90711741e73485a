"""Tokens/s of cached batch generation with stop strings: the old loop (a host copy per
row per token, ``int(nxt[i])``; every new id decoded again at every step to look for the
stop strings) against ``mta_repro.model.generation`` (one host copy per step; stop strings
found by :class:`~mta_repro.model.generation.StopStrings`, which decodes a few ids per
step). Both run in this process on the same model and prompts, interleaved, median of
--repeats runs each; the ratio is of the two medians. The stop string never occurs, so
every row generates --new-tokens ids, and both loops must give the same ids (checked).

    python scripts/bench_generate.py [--batch 8 --new-tokens 256 --repeats 5 --variant mta]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mta_repro.data.tokenizers import ByteTokenizer
from mta_repro.model import KVCache, build_model
from mta_repro.model.args import ModelArgs, MTAArgs
from mta_repro.model.generation import StopStrings, generate, sample_next

NEVER = "\x00never\x00"  # a stop string no prompt here makes the model produce


@torch.no_grad()
def generate_old(model, prompts, max_new_tokens, *, stop_fn, pad_id=0):
    """The loop as it was before one host copy per step (greedy, no eos), kept as the reference."""
    device = next(model.parameters()).device
    bsz, longest = len(prompts), max(len(p) for p in prompts)
    tokens = torch.full((bsz, longest), pad_id, dtype=torch.long, device=device)
    valid = torch.zeros((bsz, longest), dtype=torch.bool, device=device)
    for i, p in enumerate(prompts):
        tokens[i, longest - len(p) :] = torch.as_tensor(list(p), dtype=torch.long)
        valid[i, longest - len(p) :] = True
    padded = not bool(valid.all())
    cache = KVCache.empty(len(model.layers))
    logits = model(tokens, cache=cache, key_valid=valid if padded else None)[:, -1]
    out = [[] for _ in range(bsz)]
    done = [False] * bsz
    for step in range(max_new_tokens):
        nxt = sample_next(logits)
        for i in range(bsz):
            if done[i]:
                continue
            tok = int(nxt[i])  # a host sync per row per token
            out[i].append(tok)
            if stop_fn(i, out[i]):
                done[i] = True
        if all(done) or step == max_new_tokens - 1:
            break
        if padded:
            valid = torch.cat([valid, torch.ones((bsz, 1), dtype=torch.bool, device=device)], dim=1)
        logits = model(nxt[:, None], cache=cache, key_valid=valid if padded else None)[:, -1]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--variant", choices=("baseline", "mta"), default="mta")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--n-layers", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()

    tok = ByteTokenizer()
    mta = MTAArgs(use_mta=True, query_kernel_size=2, key_kernel_size=3, pre_sm_linear_head=True)
    margs = ModelArgs(
        dim=args.dim,
        n_layers=args.n_layers,
        n_heads=4,
        vocab_size=tok.n_words,
        multiple_of=32,
        max_seqlen=args.prompt_len + args.new_tokens,
        mta=mta if args.variant == "mta" else MTAArgs(),
    )
    torch.manual_seed(0)
    model = build_model(margs).to(args.device).eval()
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(args.prompt_len // 2, args.prompt_len + 1, (args.batch,), generator=g).tolist()
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in lens]

    def old_stop(row, new_ids):  # the old stop_fn: decode every new id, search the whole text
        return NEVER in tok.decode(new_ids)

    def run_old():
        return generate_old(model, prompts, args.new_tokens, stop_fn=old_stop)

    def run_new():
        return generate(model, prompts, args.new_tokens, stop_fn=StopStrings(tok.decode, [NEVER])).tokens

    same = run_old() == run_new()  # also the warm-up
    times: dict[str, list[float]] = {"old": [], "new": []}
    for _ in range(args.repeats):  # interleaved, so drift in the machine's load hits both
        for name, fn in (("old", run_old), ("new", run_new)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    n_tok = args.batch * args.new_tokens
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"{args.variant}, dim {args.dim}, {args.n_layers} layers, batch {args.batch}, "
        f"{args.new_tokens} new tokens, {args.device}, median of {args.repeats}"
    )
    print(f"{'loop':<34} {'median s':>9} {'tokens/s':>10}")
    print(f"{'old: int() per row, decode all':<34} {med['old']:>9.3f} {n_tok / med['old']:>10.0f}")
    print(f"{'new: tolist() per step, StopStrings':<34} {med['new']:>9.3f} {n_tok / med['new']:>10.0f}")
    print(f"speed-up (old/new): {med['old'] / med['new']:.2f}x; same ids: {same}")
    if not same:
        raise SystemExit("the two loops gave different ids")


if __name__ == "__main__":
    main()
