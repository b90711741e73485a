"""What a compiled SwiGLU feed-forward saves for backward: AOTAutograd with Inductor's
decompositions and its min-cut partitioner (what torch.compile does to a block), on a small
layer, against eager autograd. Prints the (B, T, ffn) tensors each keeps.

    python scripts/compiled_saved_bytes.py [--dim 48 --ffn 128 --tokens 64]

docs/memory.md's Table 9 section uses the count: eager keeps four (B, T, ffn) tensors per
layer (w1's and w3's outputs, silu's output, their product); the partitioner keeps three.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from functorch.compile import aot_function, make_boxed_func, min_cut_rematerialization_partition
from torch._inductor.decomposition import select_decomp_table


def ffn(x, w1, w3, w2):
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dim", type=int, default=48)
    ap.add_argument("--ffn", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=64)
    a = ap.parse_args()
    dt = torch.bfloat16
    x = torch.randn(a.tokens, a.dim, dtype=dt, requires_grad=True)
    ws = [torch.randn(s, dtype=dt, requires_grad=True) for s in ((a.ffn, a.dim), (a.ffn, a.dim), (a.dim, a.ffn))]
    big = (a.tokens, a.ffn)

    seen: list[torch.Size] = []

    def bw_compiler(gm, example_inputs):
        seen.extend(t.shape for t in example_inputs if isinstance(t, torch.Tensor))
        return make_boxed_func(gm)

    f = aot_function(
        ffn,
        fw_compiler=lambda gm, _inputs: make_boxed_func(gm),
        bw_compiler=bw_compiler,
        partition_fn=min_cut_rematerialization_partition,
        decompositions=select_decomp_table(),
    )
    f(x, *ws).sum().backward()
    compiled = sum(tuple(s) == big for s in seen)

    eager: dict[int, torch.Size] = {}

    def pack(t):
        eager[t.untyped_storage().data_ptr()] = t.shape
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ffn(x, *ws)
    eager_n = sum(tuple(s) == big for s in eager.values())
    print(f"| route | (tokens, ffn) = {big} tensors saved for backward |")
    print("|---|---:|")
    print(f"| eager autograd | {eager_n} |")
    print(f"| AOTAutograd + Inductor decompositions + min-cut partitioner | {compiled} |")


if __name__ == "__main__":
    main()
