"""How this CPU sums a bf16 key-query convolution: the part of "bf16 logits are bit-identical
to the release" that depends on the machine (docs/release_exact.md).

    python scripts/bf16_conv_order.py            # 2 x 4 heads x 256 x 256 scores, seed 0

For each kernel shape and ``pad_key`` of the release's variants, a bf16 ``F.conv2d`` of the
same scores and kernel (what the release and this project's reference path both call) is
compared with the same convolution in fp32 rounded once to bf16, and in float64 rounded
once: the share of elements that differ and the largest difference in bf16 ulps. Where
``vs fp32`` is 0 everywhere, bf16 convolutions here accumulate in fp32 in one fixed order,
and two callers of ``F.conv2d`` on the same tensors agree bit for bit; where it is not,
the order depends on the kernel the library picks for the CPU (shape, padding, ISA), and
two callers that lay out the padding differently can differ in the last bit.
"""

from __future__ import annotations

import argparse
import platform
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = ((6, 11), (6, 5), (4, 7), (2, 3))
PADS = ("both", "left", "right")


def conv(scores: torch.Tensor, kernel: torch.Tensor, pad_key: str) -> torch.Tensor:
    """The release's depthwise convolution: keys padded per pad_key, queries looking back."""
    c_q, c_k = kernel.shape[-2:]
    left = {"both": (c_k - 1) // 2, "left": c_k - 1, "right": 0}[pad_key]
    padded = F.pad(scores, (left, c_k - 1 - left, c_q - 1, 0))
    return F.conv2d(padded, kernel, groups=kernel.shape[0])


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance between two bf16 tensors in units in the last place of b."""
    diff = (a.float() - b.float()).abs()
    spacing = torch.where(b == 0, torch.tensor(2.0**-133), b.float().abs() * 2.0**-7)
    return int((diff / spacing).ceil().max().item())


def cpu_name() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    name = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), [])
    isa = (
        "AVX-512 BF16"
        if "avx512_bf16" in flags
        else "AVX-512"
        if "avx512f" in flags
        else ("AVX2" if "avx2" in flags else "no AVX2")
    )
    return f"{name} ({isa})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(f"# {cpu_name()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| kernel | pad_key | differ vs fp32 rounded once | vs float64 rounded once | max ulps |")
    print("|---|---|---:|---:|---:|")
    g = torch.Generator().manual_seed(args.seed)
    for c_q, c_k in SHAPES:
        for pad in PADS:
            s = torch.randn(2, args.heads, args.tokens, args.tokens, generator=g).to(torch.bfloat16)
            k = (0.3 * torch.randn(args.heads, 1, c_q, c_k, generator=g)).to(torch.bfloat16)
            got = conv(s, k, pad)
            r32 = conv(s.float(), k.float(), pad).to(torch.bfloat16)
            r64 = conv(s.double(), k.double(), pad).to(torch.bfloat16)
            print(
                f"| {c_q}x{c_k} | {pad} | {(got != r32).float().mean().item():.2e} | "
                f"{(got != r64).float().mean().item():.2e} | {max(ulps(got, r32), ulps(got, r64))} |"
            )


if __name__ == "__main__":
    main()
