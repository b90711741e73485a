"""Compile the triton attention kernels for a GPU target without a GPU, and judge what the
compiler emitted: registers and spills (ptxas -v), shared memory, tensor-core vs CUDA-core
MACs, global loads, barriers, and a stated roofline ESTIMATE of each pass on one H200
(``roofline.py``) next to FlashAttention-2's for the same layer shape.

    python -m mta_repro.experimental.fused_triton.compile_report                 # table, sm_90, 880M shapes
    python -m mta_repro.experimental.fused_triton.compile_report --json out.json # + one record per (layer, pass, T)
    ... compile_report --layers kq_conv --passes forward --seqs 2048
    ... compile_report --layers kq_conv --passes backward_dc --by-line 15   # where it goes, by source line
    ... compile_report --frame 128x128 --slab-rows 2   # a model.kernels tuning instead of the defaults

The layers are the 880M model's two kinds: ``kq_conv`` (6x11 kernels before and after
softmax: the stored-scores kernels, ``stored.py``) and ``mixing`` (the fused kernel,
``fused.py``). Every pass is compiled with the launch configuration the launcher uses
(``tiles.launch_config``: the same num_warps/num_stages). Compiles take seconds to minutes
on a small CPU: results are cached under ``--cache`` keyed on the kernel sources, the
options and the Triton version. Lengths are not specialised, so one compile serves every
T; T and the batch only change the schedule the estimate uses.

Record keys: layer, pass, T, num_warps, num_stages, registers, spill_bytes (stores +
loads), wgmma_serialized (ptxas's C7514: it serialises the kernel's wgmma, because a
non-wgmma instruction reads a wgmma accumulator inside its pipeline stage), smem_bytes,
mma_macs / fma_macs (tensor-core / CUDA-core multiply-adds of the whole pass at
``--batch``, counted from the compiled IR's dot encodings and multiplies weighted by loop
trips), global_loads (ld.global + cp.async instructions in the PTX, per thread, static),
barriers (bar.sync in the PTX, static), est_ms (this pass, estimate), fa2_est_ms
(FlashAttention-2 forward+backward of the same layer shape, estimate; the same value on
each record of a T), est_l2_ms / fa2_est_l2_ms (the bytes charged where they go: roofline.py's docstring),
fa2_published_ms (FlashAttention-2 fwd+bwd at its published H100 rate, FlashAttention-3
paper), the memory split of est_l2_ms in bytes over the pass: io_bytes (global bytes that are
not scratch, through the L2), scratch_bytes (the IR's scratch loads and stores), of them
scratch_compulsory_bytes (one store and one reload per slot and tile), scratch_l1_bytes,
scratch_l2_bytes, scratch_hbm_bytes (where they go; the three add up to scratch_bytes),
l1_free_bytes (per SM beside the shared memory), l2_bytes and hbm_bytes (all that passes the
L2 / HBM), plus tc_share, the estimate's parts, the PTX cross-check and ``hazards``
(``ir_hazards.py``: async-proxy reads of shared memory and whether each
is fenced, the loops that store scratch and whether any is software-pipelined). Layer "sdpa" records
are FlashAttention-2's own passes under the same estimator. The report ends with each layer's
totals against FlashAttention-2 both ways and the implied 880M step ratio (``step_ratio``).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import re
import time
from pathlib import Path

from mta_repro.experimental.fused_triton import ir_hazards, options, roofline, tiles
from mta_repro.kernels.gpu_compile import compile_for_gpu, ptxas_report
from mta_repro.kernels.tuning import DEFAULT_TUNING, KernelTuning

# the 880M MTA layer kinds: (pre, post) key-query convolutions; the design follows (tiles.design)
LAYERS = {"kq_conv": ((6, 11), (6, 11)), "mixing": (None, None)}
HERE = Path(__file__).resolve().parent


def layer_passes(layer: str) -> tuple:
    return tiles.passes(LAYERS[layer][0])


def _design(layer: str):
    """The kernel module of the layer's design (imported here: it defines the kernels)."""
    if tiles.design(LAYERS[layer][0]) == "stored":
        from mta_repro.experimental.fused_triton import stored as design
    else:
        from mta_repro.experimental.fused_triton import fused as design
    return design


def kernel_constexprs(
    layer: str, name: str, heads: int, head_dim: int, pad_key: str = "both", tuning: KernelTuning = DEFAULT_TUNING
) -> dict:
    """The constexprs the launcher passes on a GPU to pass ``name`` of ``layer`` for bf16
    inputs, the pre/post-softmax mixings on (wpsm, head_kernel), no padding mask, no dropout,
    under a model's ``tuning`` (model.kernels: frame, slab rows)."""
    import torch

    pre, post = LAYERS[layer]
    f = tiles.frame(name, pre, post, pad_key, tuning)
    return _design(layer).kernel_constexprs(
        name,
        f,
        h=heads,
        d=head_dim,
        pre=pre,
        post=post,
        pad_key=pad_key,
        has_w1=True,
        has_w2=True,
        has_kv=False,
        drop=False,
        gpu=True,
        dtype=torch.bfloat16,
        tuning=tuning,
    )


# the kernel's tensor arguments in the launcher's dtypes for bf16 inputs (the rest fp32)
_BF16_ARGS = ("scr_ptr",)
_INT_ARGS = {
    "kv_ptr": "*i8",
    "tiles_ptr": "*i32",
    "starts_ptr": "*i32",
    "rowoff_ptr": "*i64",
    # the stored design's C / dC stores (bf16 in the launcher): declared fp16, the same
    # bytes, so the estimator counts them as I/O (through the L2), not as the scratch
    # (the kernels' only bf16 pointer)
    "cst_ptr": "*fp16",
    "dcs_ptr": "*fp16",
}


def _compile(layer: str, name: str, consts: dict, arch: int, num_warps: int, num_stages: int):
    import triton

    from mta_repro.experimental.fused_triton import launch

    design = _design(layer)
    fn = design.kernel_of(name)
    if not isinstance(fn, triton.runtime.JITFunction):
        raise RuntimeError(
            "compile_report: the kernels were defined under TRITON_INTERPRET=1; compile in a "
            "process without it (python -m mta_repro.experimental.fused_triton.compile_report)"
        )
    names = fn.arg_names
    descs = design.descriptor_specs(name, consts)
    sig = {}
    for n in names:
        if n in consts:
            sig[n] = "constexpr"
        elif n in descs:  # bf16 inputs and tables, fp32 accumulators, through tensor descriptors (TMA on sm_90)
            dt = "fp32" if descs[n][0] in launch.ACCUMULATORS else "bf16"
            sig[n] = f"tensordesc<{dt}[{','.join(str(x) for x in descs[n][1])}]>"
        elif n.endswith("_ptr"):
            sig[n] = _INT_ARGS.get(n, "*bf16" if n in _BF16_ARGS else "*fp32")
        elif n in ("scale", "p_drop"):
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
    # the launcher's attributes: pointers 16-byte aligned, H and d as they are (specialised)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n.endswith("_ptr")}
    return compile_for_gpu(fn, sig, consts, arch=arch, num_warps=num_warps, num_stages=num_stages, attrs=attrs)


def ptx_counts(ptx: str, num_warps: int) -> dict:
    """Static instruction counts of the PTX (per thread) and the MACs its tensor-core
    instructions do per program, to cross-check the IR count."""
    ins = [re.sub(r"^@!?%p\d+\s+", "", s.strip()) for s in ptx.splitlines()]
    mma_macs = 0
    n_mma = n_wgmma = 0
    for s in ins:
        m = re.match(r"mma\.sync\.aligned\.m(\d+)n(\d+)k(\d+)", s)
        if m:
            n_mma += 1
            mma_macs += num_warps * int(m.group(1)) * int(m.group(2)) * int(m.group(3))
        m = re.match(r"wgmma\.mma_async\.sync\.aligned\.m(\d+)n(\d+)k(\d+)", s)
        if m:
            n_wgmma += 1
            mma_macs += num_warps // 4 * int(m.group(1)) * int(m.group(2)) * int(m.group(3))
    return {
        "ld_global": sum(s.startswith("ld.global") for s in ins),
        "ld_global_vector": sum(bool(re.match(r"ld\.global\S*\.v[248]", s)) for s in ins),
        "cp_async": sum(s.startswith("cp.async.") and "shared.global" in s for s in ins),
        "atomics": sum(s.startswith(("atom.", "red.")) for s in ins),
        "bar_sync": sum(s.startswith(("bar.sync", "barrier.sync")) for s in ins),
        "mma_sync": n_mma,
        "wgmma": n_wgmma,
        "tc_macs_per_program": mma_macs,
        "fma_f32": sum(s.startswith("fma.rn.f32") for s in ins),
        "fence_proxy_async": sum(s.startswith("fence.proxy.async") for s in ins),
    }


# what a cache entry holds besides the IR: a new field here starts new entries
_CACHED_FIELDS = (
    "num_warps",
    "num_stages",
    "smem_bytes",
    "compile_s",
    "ptx",
    "registers",
    "spill_bytes",
    "wgmma_serialized",
    "ptx.fence_proxy_async",
)


def compiled_pass(
    layer: str, name: str, heads: int, head_dim: int, arch: int, cache: Path, tuning: KernelTuning = DEFAULT_TUNING
) -> dict:
    """Everything the report needs from one compile, cached (the key holds the constexprs,
    so a tuning's frame or slab rows compile and cache apart)."""
    pre, post = LAYERS[layer]
    nw, ns = tiles.launch_config(name, pre, post)
    consts = kernel_constexprs(layer, name, heads, head_dim, tuning=tuning)
    import triton

    # the kernel's own cache key (its source and the jit functions it calls), not the file:
    # a docstring edit keeps the cache; the IR is stored, so the counting can change freely
    key = hashlib.sha256(
        json.dumps(
            [
                _design(layer).kernel_of(name).cache_key,
                {k: str(v) for k, v in consts.items()},
                arch,
                nw,
                ns,
                triton.__version__,
                _CACHED_FIELDS,
            ],
            sort_keys=True,
        ).encode()
    )
    path = cache / f"{layer}-{name}-{key.hexdigest()[:16]}.json.gz"
    if path.exists():
        out = json.loads(gzip.decompress(path.read_bytes()))
    else:
        t0 = time.time()
        k = _compile(layer, name, consts, arch, nw, ns)
        out = {
            "num_warps": nw,
            "num_stages": ns,
            "smem_bytes": int(k.metadata.shared),
            "compile_s": round(time.time() - t0, 1),
            "ttgir": k.asm["ttgir"],
            "ptx": ptx_counts(k.asm["ptx"], nw),
            **ptxas_report(k.asm["ptx"], arch),
        }
        cache.mkdir(parents=True, exist_ok=True)
        path.write_bytes(gzip.compress(json.dumps(out).encode()))
    # the kernel's only bf16 pointer is its scratch (_BF16_ARGS): those loads/stores are scratch bytes
    # by source line of the kernel's own file (the shared helpers under the lines that call them)
    ttgir = out.pop("ttgir")
    c = roofline.count_ttgir(ttgir, source=source_file(layer), scratch_elem="bf16")
    return dict(
        out, levels=c.levels, static=c.static, by_line=c.by_line, hazards=ir_hazards.summary(ttgir, scratch_elem="bf16")
    )


def schedule(
    layer: str,
    name: str,
    batch: int,
    heads: int,
    head_dim: int,
    seq: int,
    info: dict,
    sms: int,
    tuning: KernelTuning = DEFAULT_TUNING,
) -> roofline.PassProfile:
    """The programs ``_launch`` starts on a GPU and the key blocks each walks (its items,
    longest first, round-robin over the persistent grid), under ``tuning``."""
    pre, post = LAYERS[layer]
    f = tiles.frame(name, pre, post, "both", tuning)
    n_target = options.of(tuning).programs or tiles.PROGRAMS_PER_SM * sms
    sched = tiles.items(f, batch, seq, seq, 0, n_target)
    n_prog = len(sched.starts) - 1
    n_tiles = [it[3] - it[2] for it in sched.items]
    io = batch * heads * seq * head_dim  # elements of q (k, v, do, o alike)
    rows = batch * heads * seq
    n_slots = batch * sched.n_rt * sched.s_max
    part = n_slots * heads * f.er  # per-slot row partials (elements)
    slots = tiles.scratch_slots(name, pre is not None, post is not None)["NSLOT"]
    plane = tiles.padded_heads(heads) * f.er * f.ec * 2  # one slot: all heads x the frame, bf16
    # compulsory HBM traffic: the inputs once (bf16), the outputs and the zeroed partials (fp32)
    if pre is None:
        hbm = {
            "stats": 2 * io * 2 + 2 * part * 4 * 2,
            "forward": 3 * io * 2 + rows * 4 + part * head_dim * 4 * 2,
            "backward_rowsum": 4 * io * 2 + rows * 4 + part * 4 * 2,
            "backward": 5 * io * 2 + 2 * rows * 4 + part * head_dim * 4 * 2 + 2 * io * 4 * 2,
        }[name]
    else:
        # the stored design: the stored planes (C: written by stats, read by forward, rowsum,
        # backward_dc; dC: written by backward_dc, read by backward_b) are compulsory HBM
        # traffic too (far above the L2)
        st = batch * heads * tiles.store_plane(seq, seq, 0) * 2
        hbm = {
            "stats": 2 * io * 2 + 2 * part * 4 * 2 + st,
            "forward": io * 2 + rows * 4 + part * head_dim * 4 * 2 + st,
            "backward_rowsum": 2 * io * 2 + rows * 4 + part * 4 * 2 + st,
            "backward_dc": 2 * io * 2 + 2 * rows * 4 + io * 4 * 2 + 2 * st,
            "backward_b": 2 * io * 2 + part * head_dim * 4 * 2 + io * 4 * 2 + st,
        }[name]
        if name == "backward_b":  # one plane per program, each head's dC window stored and reloaded
            plane = f.er * f.ec * 2
            return roofline.PassProfile(
                sched.programs(),
                hbm_bytes=hbm,
                num_warps=info["num_warps"],
                registers=info["registers"],
                smem_bytes=info["smem_bytes"],
                scratch_resident=n_prog * plane,
                scratch_traffic=2 * sum(n_tiles) * heads * plane,
            )
    return roofline.PassProfile(
        sched.programs(),
        hbm_bytes=hbm,
        num_warps=info["num_warps"],
        registers=info["registers"],
        smem_bytes=info["smem_bytes"],
        scratch_resident=n_prog * slots * plane,
        scratch_traffic=2 * sum(n_tiles) * slots * plane,
    )


def source_file(layer: str) -> str:
    """The kernel source of the layer's design, the lines ``--by-line`` names."""
    return "stored.py" if tiles.design(LAYERS[layer][0]) == "stored" else "fused.py"


# the 880M model's linear layers per token, fwd+bwd = 6 x parameters (non-embedding and
# embedding/unembedding matmuls) and its attention layers by kind: 6 kq-conv, 18 mixing-only
LINEAR_PARAMS = 679.5e6 + 197.0e6
STEP_LAYERS = {"kq_conv": 6, "mixing": 18}
TENSOR_PEAK_FLOPS = 989e12  # H100/H200 SXM dense bf16


def step_ratio(
    layer_ms: dict,
    fa2_ms: float,
    tokens: int,
    mfu: float,
    n_layers: dict | None = None,
    params: float = LINEAR_PARAMS,
    peak: float = TENSOR_PEAK_FLOPS,
) -> dict:
    """The implied step-time ratio of the 880M MTA model to its baseline at ``tokens`` per
    step: both run the linear layers' 6·params·tokens FLOPs at ``mfu`` of ``peak``; the
    baseline's attention is 24 × FlashAttention-2 (``fa2_ms``, fwd+bwd of one layer), the MTA
    model's is 6 kq-conv + 18 mixing layers (``layer_ms``, fwd+bwd of one layer each). ms."""
    n_layers = n_layers or STEP_LAYERS
    linear = 1e3 * 6 * params * tokens / (mfu * peak)
    base = linear + sum(n_layers.values()) * fa2_ms
    mta = linear + sum(n * layer_ms[k] for k, n in n_layers.items())
    return {"linear_ms": linear, "baseline_ms": base, "mta_ms": mta, "ratio": mta / base}


def record(layer, name, seq, info, est, fa2, batch, fa2_l2, fa2_pub) -> dict:
    tot = est["total"]
    tc = tot["mma_macs"] + tot["wgmma_macs"] + tot["tf32_macs"]
    return {
        "layer": layer,
        "pass": name,
        "T": seq,
        "num_warps": info["num_warps"],
        "num_stages": info["num_stages"],
        "registers": info["registers"],
        "spill_bytes": info["spill_bytes"],
        "wgmma_serialized": info.get("wgmma_serialized"),
        "smem_bytes": info["smem_bytes"],
        "mma_macs": tc,
        "fma_macs": tot["fma_macs"],
        "global_loads": info["ptx"]["ld_global"] + info["ptx"]["cp_async"],
        "barriers": info["ptx"]["bar_sync"],
        "est_ms": round(est["est_ms"], 4),
        "fa2_est_ms": round(fa2, 4),
        "est_l2_ms": round(est["est_l2_ms"], 4),
        "fa2_est_l2_ms": round(fa2_l2, 4),
        "l2_ms": round(est["l2_ms"], 4),
        "hbm_ms": round(est["hbm_ms"], 4),
        "fa2_published_ms": round(fa2_pub, 4),
        "chain_l2_ms": round(est["chain_l2_ms"], 4),
        "io_bytes": est["io_bytes"],
        "scratch_bytes": est["scratch_bytes"],
        "scratch_compulsory_bytes": est["scratch_compulsory_bytes"],
        "scratch_l1_bytes": est["scratch_l1_bytes"],
        "scratch_l2_bytes": est["scratch_l2_bytes"],
        "scratch_hbm_bytes": est["scratch_hbm_bytes"],
        "l1_free_bytes": est["l1_free_bytes"],
        "l2_bytes": est["l2_bytes"],
        "hbm_bytes": est["hbm_bytes"],
        "tc_share": round(tc / max(1.0, tc + tot["fma_macs"]), 4),
        "batch": batch,
        "throughput_ms": round(est["throughput_ms"], 4),
        "chain_ms": round(est["chain_ms"], 4),
        "occupancy": est["occupancy"],
        "programs": est["programs"],
        "global_bytes": tot["global_bytes"],
        "ptx": info["ptx"],
        "hazards": info.get("hazards"),
        "compile_s": info.get("compile_s"),
        "estimate": True,
    }


def main() -> None:
    # a real compile, not the interpreter (set before jit_helpers defines the kernels;
    # only here, so importing this module as a library changes nothing of its process)
    os.environ.pop("TRITON_INTERPRET", None)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--passes", default=None, help="comma-separated; default: every pass of each layer")
    # every layer kind by default, so that the documented command rewrites the whole report
    ap.add_argument(
        "--layers",
        default=",".join(LAYERS),
        help=f"of {','.join(LAYERS)} (kq_conv: the stored-scores kernels, stored.py; mixing: the fused "
        "kernel, fused.py)",
    )
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=96)
    ap.add_argument("--seqs", default="2048,4096")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--json", type=Path, help="write the records here")
    ap.add_argument(
        "--by-line",
        type=int,
        default=0,
        metavar="N",
        help="also print each pass's N source lines that spend the most per key block (ESTIMATED "
        "SM cycles per unit, from the same counts): where to look before optimising",
    )
    ap.add_argument(
        "--cache",
        type=Path,
        default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "mta_repro" / "fused_triton_compile",
    )
    ap.add_argument(
        "--frame", metavar="ROWSxCOLS", help="model.kernels.impl_options.triton.frame (default: tiles.frame's)"
    )
    ap.add_argument(
        "--slab-rows", type=int, metavar="N", help="model.kernels.impl_options.triton.slab_rows (default: per pass)"
    )
    ap.add_argument(
        "--programs", type=int, metavar="N", help="model.kernels.impl_options.triton.programs (default: one per SM)"
    )
    a = ap.parse_args()
    tuning = options.kernel_tuning(frame=a.frame, slab_rows=a.slab_rows, programs=a.programs)
    gpu = roofline.H200
    print(
        f"ESTIMATES, not measurements: roofline of {gpu.name}, batch {a.batch}, {a.heads} heads of {a.head_dim}, "
        f"bf16 inputs, sm_{a.arch}. Constants: {json.dumps(gpu.constants())}"
    )
    seqs = [int(x) for x in a.seqs.split(",")]
    records, by_line = [], []
    for seq in seqs:
        fa2 = roofline.fa2_passes(a.batch, a.heads, seq, a.head_dim, gpu)
        fa2_ms = roofline.fa2_est_ms(a.batch, a.heads, seq, a.head_dim, gpu)["total"]
        fa2_l2 = roofline.fa2_est_ms(a.batch, a.heads, seq, a.head_dim, gpu, key="est_l2_ms")["total"]
        fa2_pub = roofline.fa2_published_ms(a.batch, a.heads, seq, a.head_dim)["total"]
        for name, (c, s) in fa2.items():
            est = roofline.estimate_pass(c, s, gpu)
            info = {
                "num_warps": s.num_warps,
                "num_stages": None,
                "registers": s.registers,
                "spill_bytes": 0,
                "smem_bytes": s.smem_bytes,
                "ptx": {"ld_global": 0, "cp_async": 0, "bar_sync": None},
            }
            r = record("sdpa", name, seq, info, est, fa2_ms, a.batch, fa2_l2, fa2_pub)
            r.update(global_loads=None, modelled="FlashAttention-2 tile configuration, counted by hand")
            records.append(r)
        for layer in a.layers.split(","):
            for name in a.passes.split(",") if a.passes else layer_passes(layer):
                if name not in layer_passes(layer):
                    continue
                info = compiled_pass(layer, name, a.heads, a.head_dim, a.arch, a.cache, tuning)
                c = roofline.Counts(levels=info["levels"], static=info["static"], by_line=info.get("by_line", {}))
                est = roofline.estimate_pass(
                    c, schedule(layer, name, a.batch, a.heads, a.head_dim, seq, info, gpu.sms, tuning), gpu
                )
                records.append(record(layer, name, seq, info, est, fa2_ms, a.batch, fa2_l2, fa2_pub))
                if a.by_line and seq == seqs[0]:  # per key block: the same at every T
                    by_line.append((layer, name, roofline.line_cycles(c, gpu)[: a.by_line]))
    print(
        "| layer | pass | T | warps/stages | regs | spill B | smem KB | TC share | ld.global | bar.sync "
        "| est ms | (throughput/chain) | est_l2 ms | (L2/HBM) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in records:
        print(
            f"| {r['layer']} | {r['pass']} | {r['T']} | {r['num_warps']}/{r['num_stages']} | {r['registers']} | "
            f"{r['spill_bytes']} | {r['smem_bytes'] / 1024:.0f} | {r['tc_share']:.0%} | {r['global_loads']} | "
            f"{r['barriers']} | {r['est_ms']:.3f} | {r['throughput_ms']:.3f}/{r['chain_ms']:.3f} | "
            f"{r['est_l2_ms']:.3f} | {r['l2_ms']:.3f}/{r['hbm_ms']:.3f} |"
        )
    serial = sorted({f"{r['layer']} {r['pass']}" for r in records if r.get("wgmma_serialized")})
    print(f"\nwgmma serialised by ptxas (C7514; not in the estimate): {', '.join(serial) or 'none'}")
    print(
        "\nWhere the global bytes go (GB over the pass, ESTIMATED split): I/O = every global byte that is not "
        "scratch (through the L2); scratch = the IR's scratch bytes, of them compulsory (each slot written and "
        "read once per tile) and that share's L1 / L2 / HBM split (free L1 per SM beside the shared memory)"
    )
    print(
        "| layer | pass | T | I/O | scratch | compulsory | scratch L1 | scratch L2 | scratch HBM | free L1 KB "
        "| chain (L2) ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in records:
        if r["layer"] != "sdpa":
            print(
                f"| {r['layer']} | {r['pass']} | {r['T']} | {r['io_bytes'] / 1e9:.2f} | "
                f"{r['scratch_bytes'] / 1e9:.2f} | "
                f"{r['scratch_compulsory_bytes'] / 1e9:.2f} | {r['scratch_l1_bytes'] / 1e9:.2f} | "
                f"{r['scratch_l2_bytes'] / 1e9:.2f} | {r['scratch_hbm_bytes'] / 1e9:.2f} | "
                f"{r['l1_free_bytes'] / 1024:.0f} | {r['chain_l2_ms']:.3f} |"
            )
    print(
        "\nPer layer (sum of its passes), ESTIMATES (est_ms: every global byte at the L1 rate; est_l2_ms: the "
        "bytes where they go), against FlashAttention-2 by the same estimator (fa2_est_ms / fa2_est_l2_ms) and at "
        "its published H100 rate (fa2_published_ms, FlashAttention-3 paper):"
    )
    layer_l2 = {}
    for seq in seqs:
        for layer in ["sdpa"] + a.layers.split(","):
            rs = [r for r in records if r["layer"] == layer and r["T"] == seq]
            if rs:
                r0 = rs[0]
                tot = sum(r["est_ms"] for r in rs)
                tl2 = sum(r["est_l2_ms"] for r in rs)
                layer_l2[seq, layer] = tl2
                print(
                    f"  T={seq} {layer}: est {tot:.3f} ms = {tot / r0['fa2_est_ms']:.2f}x FA2 est "
                    f"({r0['fa2_est_ms']:.3f} ms), {tot / r0['fa2_published_ms']:.2f}x FA2 published "
                    f"({r0['fa2_published_ms']:.3f} ms); est_l2 {tl2:.3f} ms = {tl2 / r0['fa2_est_l2_ms']:.2f}x FA2 "
                    f"est_l2 ({r0['fa2_est_l2_ms']:.3f} ms), {tl2 / r0['fa2_published_ms']:.2f}x FA2 published"
                )
    print(
        "\nThe 880M step (ESTIMATE): linear layers 6 x (679.5M + 197.0M) x batch x T FLOPs at an MFU of 989 TFLOP/s; "
        "attention: MTA = 6 kq-conv + 18 mixing layers (est_l2_ms), baseline = 24 x FlashAttention-2:"
    )
    for seq in seqs:
        if (seq, "kq_conv") not in layer_l2 or (seq, "mixing") not in layer_l2:
            continue
        rs = [r for r in records if r["T"] == seq]
        for mfu in (0.4, 0.6):
            for label, fa2 in (("FA2 est_l2", rs[0]["fa2_est_l2_ms"]), ("FA2 published", rs[0]["fa2_published_ms"])):
                st = step_ratio(
                    {"kq_conv": layer_l2[seq, "kq_conv"], "mixing": layer_l2[seq, "mixing"]}, fa2, a.batch * seq, mfu
                )
                print(
                    f"  T={seq} MFU {mfu:.0%}, baseline with {label}: linear {st['linear_ms']:.1f} ms, "
                    f"baseline {st['baseline_ms']:.1f} ms, MTA {st['mta_ms']:.1f} ms: {st['ratio']:.2f}x"
                )
    if by_line:
        srcs = {f: (HERE / f).read_text().splitlines() for f in ("fused.py", "stored.py")}
        print(
            "\nWhere each pass spends its work per key block, by source line of its kernel (mta_repro/experimental/"
            "fused_triton/: kq_conv stored.py, mixing fused.py) "
            "(ESTIMATED SM cycles per program and key block: tensor cores / CUDA cores / L1+shared traffic of "
            "global and shared bytes; 'via' = the lines that called the helper):"
        )
        for layer, name, rows in by_line:
            src = srcs[source_file(layer)]
            print(f"\n{layer} {name}:")
            print("| line | tensor | alu | global | shared | source | via |")
            print("|---|---|---|---|---|---|---|")
            for where, cyc in rows:
                text = src[where[0] - 1].strip()[:70] if where and where[0] <= len(src) else "(no source line)"
                via = " < ".join(str(x) for x in where[1:])
                print(
                    f"| {where[0] if where else '-'} | {cyc['tensor']:.0f} | {cyc['alu']:.0f} | {cyc['global']:.0f} | "
                    f"{cyc['shared']:.0f} | `{text}` | {via} |"
                )
    if a.json:
        a.json.write_text(
            json.dumps({"gpu": gpu.constants(), "batch": a.batch, "estimate": True, "records": records}, indent=1)
        )
        print(f"wrote {len(records)} records to {a.json}")


if __name__ == "__main__":
    main()
