"""A Triton kernel compiled for a GPU target on a machine without one, and what ``ptxas``
reports of it: how the benchmarks read registers, spills and the instruction mix of the
kernels before any GPU runs them (Triton's wheel ships the ptxas for sm_90)."""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path


def compile_for_gpu(
    fn,
    signature: dict,
    consts: dict,
    *,
    arch: int = 90,
    num_warps: int = 4,
    num_stages: int | None = None,
    attrs: dict | None = None,
):
    """``fn`` (a ``@triton.jit`` function) compiled for ``sm_<arch>``: ``signature`` maps every
    argument name to its Triton type ("*bf16", "i32", "constexpr", ...), ``consts`` the
    constexpr ones to their values. Returns Triton's compiled kernel (``.asm["ptx"]``,
    ``.metadata.shared``, ...)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    src = ASTSource(
        fn=fn,
        signature=signature,
        constexprs={(names.index(k),): v for k, v in consts.items()},
        attrs=attrs or {},
    )
    options: dict = {"num_warps": num_warps}
    if num_stages is not None:
        options["num_stages"] = num_stages
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def ptxas_report(ptx: str, arch: int = 90) -> dict:
    """Registers, spill bytes (stores + loads) and whether wgmma are serialised (ptxas's
    C7514) of a kernel's PTX, from ``ptxas -v`` run with the flags Triton's own cubin build
    passes, so the counts are those of the cubin it builds."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.ptx"
        path.write_text(ptx)
        p = subprocess.run(
            [
                str(get_ptxas(arch).path),
                "-lineinfo",
                "-v",
                "--regAllocOptLevel=2",
                f"--gpu-name=sm_{arch}a" if arch >= 90 else f"--gpu-name=sm_{arch}",
                str(path),
                "-o",
                str(Path(tmp) / "k.o"),
            ],
            capture_output=True,
            text=True,
        )
    text = p.stdout + p.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    if not (regs and spill):
        raise RuntimeError(f"ptxas -v gave no register report: {text.strip()[-400:]}")
    return {
        "registers": int(regs.group(1)),
        "spill_bytes": int(spill.group(1)) + int(spill.group(2)),
        "wgmma_serialized": "(C7514)" in text,
    }
