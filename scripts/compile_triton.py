"""Compile the triton attention kernel for a GPU target without a GPU, and report what
only a real compile shows: shared memory per program, registers and spills (ptxas -v).

    python scripts/compile_triton.py                       # sm_90 (H100/H200), 880M shapes
    python scripts/compile_triton.py --arch 80 --passes forward --layers kq_conv
    MTA_TRITON_FRAME=32x64 python scripts/compile_triton.py

Triton's wheel ships ptxas, so this runs on a CPU machine. It proves the kernel compiles
for that target and what it costs in registers; it says nothing about speed (run
scripts/bench_attention.py --device cuda on a GPU for that).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # a real compile, not the interpreter

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mta_repro.model import attention_triton as at  # noqa: E402
from mta_repro.model import frames  # noqa: E402

LAYERS = {"kq_conv": ((6, 11), (6, 11)), "mixing": (None, None)}  # the 880M MTA options


def compile_pass(name: str, pre, post, heads: int, head_dim: int, arch: int, num_warps: int, chunks):
    mode = frames.PASSES.index(name)
    g = frames.frame(name, pre, post, "both")
    cq1, ck1 = pre or (1, 1)
    cq2, ck2 = post or (1, 1)
    hp = frames.padded_heads(heads)
    consts = dict(
        MODE=mode, ACC=tl.float32, PREC="ieee", USE_DOT=hp >= 16, HP=hp, HC=min(hp, chunks[0]), SR=min(g.er, chunks[1]),
        DP=max(16, frames.pow2(head_dim)),
        ER=g.er, EC=g.ec, TOP=g.top, LEFT=g.left, BMO=g.bmo, BNO=g.bno,
        MR=frames.margins(pre, post)[0], MC=frames.margins(pre, post)[1],
        HAS_K1=pre is not None, CQ1=cq1, CK1=ck1, PL1=frames.pad_left("both", ck1), HAS_W1=True,
        HAS_K2=post is not None, CQ2=cq2, CK2=ck2, PL2=frames.pad_left("both", ck2), HAS_W2=True,
        HAS_KV=False, DROP=False, UPCAST=False,
    )
    names = at._mta_kernel.arg_names
    sig = {}
    for n in names:
        if n in consts:
            sig[n] = "constexpr"
        elif n.endswith("_ptr"):
            bf16 = n in ("q_ptr", "k_ptr", "v_ptr", "do_ptr")
            sig[n] = "*i8" if n == "kv_ptr" else ("*bf16" if bf16 else "*fp32")
        elif n in ("scale", "p_drop"):
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
    src = ASTSource(fn=at._mta_kernel, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()})
    t0 = time.time()
    kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})
    return g, kernel, time.time() - t0


def ptxas_report(ptx: str, arch: int) -> str:
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(arch).path  # the one triton itself assembles with
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.ptx"
        path.write_text(ptx)
        p = subprocess.run([str(ptxas), f"-arch=sm_{arch}a" if arch >= 90 else f"-arch=sm_{arch}", "-v", str(path), "-o", str(Path(tmp) / "k.o")],
                           capture_output=True, text=True)
    text = p.stdout + p.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    return (f"{regs.group(1) if regs else '?'} registers, spills {spill.group(1)}/{spill.group(2)} B"
            if regs and spill else text.strip()[-300:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--passes", default=",".join(frames.PASSES))
    ap.add_argument("--layers", default="mixing,kq_conv")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=96)
    ap.add_argument("--num-warps", type=int, default=8)
    ap.add_argument("--chunks", default="1x4", help="heads per chunk x frame rows per mixing slab "
                    "(the GPU default of attention_triton._tiling)")
    a = ap.parse_args()
    chunks = tuple(int(x) for x in a.chunks.split("x"))
    print(f"chunks {a.chunks}, {a.num_warps} warps, {a.heads} heads of {a.head_dim}, bf16 inputs")
    print(f"| layer | pass | frame (owned) | compile s | shared KB | ptxas (sm_{a.arch}) |")
    print("|---|---|---|---|---|---|")
    for layer in a.layers.split(","):
        pre, post = LAYERS[layer]
        for name in a.passes.split(","):
            g, k, secs = compile_pass(name, pre, post, a.heads, a.head_dim, a.arch, a.num_warps, chunks)
            print(f"| {layer} | {name} | {g.er}x{g.ec} ({g.bmo}x{g.bno}) | {secs:.0f} | "
                  f"{k.metadata.shared / 1024:.0f} | {ptxas_report(k.asm['ptx'], a.arch)} |", flush=True)


if __name__ == "__main__":
    main()
