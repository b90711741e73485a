"""A stated roofline for one kernel pass on one GPU, from what the compiler emitted.

Used by ``compile_report.py`` to judge ``model.attn_impl=triton`` without a GPU,
and applied the same way to FlashAttention-2 (what SDPA runs for bf16 causal attention on
an H100/H200), so the two are compared by one model. Every figure it gives is an
ESTIMATE: a lower bound from throughput and from the programs' serial chains, not a
measurement. No triton import here (the arithmetic is testable anywhere).

Counting (``count_ttgir``): the pass's TritonGPU IR, i.e. after layout assignment and
software pipelining, where each ``tt.dot`` carries the encoding that decides its
instructions: ``#ttg.nvidia_mma`` v2 -> ``mma.sync`` (tensor cores), v3 /
``ttng.warp_group_dot`` -> ``wgmma`` (tensor cores), ``#ttg.blocked`` -> scalar FMA (CUDA
cores). Each op is weighted by the trip counts of the ``scf.for`` loops around it:
constant bounds are read from the IR; loops with runtime bounds are the kernel's work loops,
level 1 = the loop over work items of a program, level 2 = the loop over key blocks of an
item (a third runtime level is an error: the schedule would not know its trips); a kernel
with one runtime loop walks its program's tiles in it, so that loop is level 2. Ops in an
``scf.if`` are counted as always executed. Resources per op: MACs of dots by kind;
elements of tensor ``arith.mulf``/``math.fma`` (CUDA-core multiplies: convolution taps,
scalings); elements of ``math.exp``/``exp2`` (special-function unit); global bytes of
``tt.load``/``tt.store``/``tt.atomic_rmw``/async copies (an atomic counts twice); shared
bytes of ``ttg.local_load``/``local_store``/``local_alloc`` of a register tensor; a TMA
store or reduction (``ttng.async_tma_*``) as its box read from shared memory and written
(a reduction: read and written) in global memory; barriers, split into those that order
global scratch (a ``tt.store``/atomic within two ops: a round trip through L1/L2, as is
waiting for a TMA store to complete) and plain shared-memory barriers (and waits for a TMA
store's read of shared memory). ``compile_report.py`` checks the dot counts against the PTX's
``mma``/``wgmma`` instructions.

Time (``estimate``): with ``active`` = the SMs that get programs and the per-SM rates of
``GPU``, throughput time = max over resources of total / (rate x active SMs), HBM bytes at
the HBM bandwidth; chain time = the programs list-scheduled in launch order on SMs x
``occupancy`` slots, each taking its own work at its share of one SM's rates (the SM's
co-resident programs split it) plus its barrier latencies (not shared).
est = max(throughput, chain) + launch latency. Left out (so the model
is optimistic for every kernel alike): instruction issue other than the counted ops, memory
latency other than barriers, bank conflicts, tail effects inside a wave.

``est_ms`` charges every global byte at the L1 rate (``lsu_bytes``): optimistic for any
kernel whose bytes miss L1. ``est_l2_ms`` is the same bound with the global bytes charged where
they go (``scratch_split``):

- I/O bytes, every global byte that is not scratch (TMA copies of the inputs into shared
  memory, TMA reductions, the partials), pass the L2 at ``l2_bytes_s`` (a Hopper measurement,
  cited at ``GPU``): TMA copies and reductions do not go through L1;
- scratch bytes (plain loads and stores of the scratch's element type, ``count_ttgir``'s
  ``scratch_elem``): the compulsory part (``PassProfile.scratch_traffic``: each slot stored and
  reloaded once per tile) hits L1 in the share the SM's free L1 (256 KB less the shared-memory
  carveout of its resident programs, ``l1_free_bytes``) holds of its resident scratch, the
  rest passes the L2 and, in the share the L2 (50 MB) cannot hold of all programs' resident
  scratch beside the pass's compulsory bytes, goes on to HBM; the IR's further scratch bytes
  (re-reads of a plane just loaded) are L1 hits;
- the L2 bytes bind in aggregate and on each program's chain (its SM's share of the L2
  bandwidth), HBM the compulsory bytes plus the scratch the L2 cannot hold.

Still optimistic: stores are written through to the L2 on Hopper (the model keeps those it
places in L1 off the L2); a capacity fraction is an upper bound on hits; inputs always hit the
L2 after their first read. FlashAttention-2 has no scratch and barely moves.
"""

from __future__ import annotations

import heapq
import math
import re
from dataclasses import dataclass, field

RESOURCES = (
    "mma_macs",
    "wgmma_macs",
    "tf32_macs",
    "fma_macs",
    "alu",
    "sfu",
    "global_bytes",
    "scratch_bytes",
    "shared_bytes",
    "barriers_global",
    "barriers_shared",
)


@dataclass(frozen=True)
class GPU:
    """One H200 SXM (H100 SXM's SMs and clocks, HBM3e). Rates per SM per clock."""

    name: str = "H200 SXM (sm_90)"
    sms: int = 132
    clock_hz: float = 1.83e9  # the clock NVIDIA's dense tensor peak is quoted at
    wgmma_bf16: float = 2048.0  # MAC/clk/SM: 132 x 2048 x 2 x 1.83 GHz = 989 TFLOP/s
    mma_sync_fraction: float = 2 / 3  # assumption: Ampere-style mma.sync reaches ~2/3 of wgmma on sm_90
    tf32_fraction: float = 0.5  # 32-bit operands on tensor cores: half the 16-bit rate
    fma_fp32: float = 128.0  # MAC/clk/SM on CUDA cores (67 TFLOP/s)
    sfu: float = 16.0  # exp/clk/SM (3.9 T/s)
    lsu_bytes: float = 128.0  # B/clk/SM through L1/shared memory (global hits and shared alike)
    hbm_bytes_s: float = 4.8e12
    # L2 bandwidth: a Hopper measurement, not A100's documented 5120 B/clk over 108 SMs (the
    # estimator's earlier figure: 47.4 B/clk/SM = 11.4 TB/s over 132 SMs). Measured H100
    # L2 bandwidth is ~5.5-7 TB/s (Chips and Cheese, "Nvidia's H100: Funny L2, and Tons of
    # Bandwidth", 2023; Luo et al., "Dissecting the NVIDIA Hopper Architecture through
    # Microbenchmarking", arXiv 2402.13499; the range as design.md quotes it). The
    # top of the range, so the bound stays a lower bound: 7.0 TB/s = 29.0 B/clk/SM at 1.83 GHz.
    l2_bytes_s: float = 7.0e12
    l2_bytes: float = 50 * 2**20
    # combined L1 / shared memory per SM, and the shared-memory carveouts sm_90 can configure
    # (KB; the driver picks the smallest that holds the resident programs' shared memory): what
    # is left is L1, where a program's scratch can stay between its store and its reload
    l1_smem_bytes: int = 256 * 1024
    smem_carveouts_kb: tuple = (0, 8, 16, 32, 64, 100, 132, 164, 196, 228)
    regs_per_sm: int = 65536
    smem_per_sm: int = 228 * 1024
    max_warps_per_sm: int = 64
    barrier_global_cycles: float = 500.0  # a store -> barrier -> reload round trip (~2 L2 latencies)
    barrier_shared_cycles: float = 25.0
    launch_s: float = 5e-6

    @property
    def l2_bytes_clk(self) -> float:
        """L2 bandwidth per SM and clock (``l2_bytes_s`` shared by all SMs)."""
        return self.l2_bytes_s / (self.sms * self.clock_hz)

    def constants(self) -> dict:
        return dict(self.__dict__, l2_bytes_clk=self.l2_bytes_clk)


H200 = GPU()


@dataclass
class Counts:
    """Resources per level: 0 = once per program, 1 = per work item, 2 = per key block."""

    levels: list = field(default_factory=lambda: [dict.fromkeys(RESOURCES, 0.0) for _ in range(3)])
    static: dict = field(default_factory=lambda: dict.fromkeys(RESOURCES, 0.0))  # no loop weights
    # the level-2 (per key block) resources by the source lines of the op that spends them:
    # {(line, caller line, ...): {resource: amount}}, innermost line first (``source_chains``)
    by_line: dict = field(default_factory=dict)
    where: tuple = ()  # the source chain of the op being counted

    def add(self, level: int, res: str, amount: float, mult: float) -> None:
        self.levels[level][res] += amount * mult
        self.static[res] += amount
        if level == 2:
            row = self.by_line.setdefault(self.where, dict.fromkeys(RESOURCES, 0.0))
            row[res] += amount * mult


_BYTES = {
    "bf16": 2,
    "f16": 2,
    "f32": 4,
    "f64": 8,
    "i1": 1,
    "i8": 1,
    "i16": 2,
    "i32": 4,
    "i64": 8,
    "f8E4M3FN": 1,
    "f8E5M2": 1,
}
_TENSOR = re.compile(r"tensor<([0-9x]+)x(!tt\.ptr<(\w+)>|(\w+))")


def _tensor(text: str) -> tuple[int, int] | None:
    """(elements, bytes per element) of the first tensor type in ``text``; None if scalar."""
    m = _TENSOR.search(text)
    if not m:
        return None
    n = math.prod(int(x) for x in m.group(1).split("x"))
    return n, _BYTES.get(m.group(3) or m.group(4), 4)


def _strip_loc(line: str) -> str:
    i = line.rfind(" loc(")
    return line[:i] if i >= 0 else line


_LOC_FILE = re.compile(r'(#loc\d*) = loc\("([^"]*)":(\d+):\d+\)')
_LOC_CALL = re.compile(r"(#loc\d*) = loc\(callsite\((#loc\d*) at (#loc\d*)\)\)")
_LOC_NAMED = re.compile(r'(#loc\d*) = loc\("[^"]*"\((#loc\d*)\)\)')


def source_chains(ttgir: str, source: str) -> dict:
    """{loc alias: (line, caller line, ...)} of the IR's locations in file ``source`` (a path
    suffix), innermost first: an op inlined from a ``@triton.jit`` helper carries a call-site
    location, resolved here to the helper's line and the lines that called it."""
    defs = {}
    for raw in ttgir.splitlines():
        m = _LOC_FILE.match(raw)
        if m:
            defs[m.group(1)] = ("line", int(m.group(3)) if m.group(2).endswith(source) else None)
            continue
        m = _LOC_CALL.match(raw) or _LOC_NAMED.match(raw)
        if m:
            assert m.lastindex is not None  # both patterns have groups
            defs[m.group(1)] = ("call", m.group(2), m.group(m.lastindex))

    def chain(alias, depth=0):
        d = defs.get(alias)
        if d is None or depth > 64:
            return ()
        if d[0] == "line":
            return () if d[1] is None else (d[1],)
        inner, outer = chain(d[1], depth + 1), chain(d[2], depth + 1)
        return inner + tuple(x for x in outer if not inner or x != inner[-1])

    return {alias: chain(alias) for alias in defs}


def count_ttgir(
    ttgir: str, source: str = "fused.py", scratch_elem: str | None = None, _tile_loop_level: int = 2
) -> Counts:
    """Loop-weighted resources of one compiled kernel (see the module docstring); the
    per-key-block ones also by source line of ``source`` (``Counts.by_line``)."""
    raw_lines = ttgir.splitlines()
    chains = source_chains(ttgir, source)
    lines = [_strip_loc(raw).rstrip() for raw in raw_lines]
    consts = {}
    for s in lines:
        m = re.match(r"\s*(%[\w-]+) = arith\.constant (-?\d+) : i(32|64)$", s)
        if m:
            consts[m.group(1)] = int(m.group(2))
    encodings = {}
    for s in lines:
        m = re.match(r"(#\w+) = #ttg\.nvidia_mma<\{versionMajor = (\d)", s)
        if m:
            encodings[m.group(1)] = "wgmma_macs" if m.group(2) == "3" else "mma_macs"
    ops = [i for i, s in enumerate(lines) if re.match(r"\s*(%\S+ = )?[\"\w.]+", s.strip()) and s.strip()]

    c = Counts()
    stack = []  # ("for", trips or None) / ("other", None)
    depth = [0]  # the deepest runtime-bounded loop nesting seen

    def weight():
        mult, level = 1.0, 0
        for kind, trips in stack:
            if kind != "for":
                continue
            if trips is None:
                level += 1
            else:
                mult *= trips
        if level > 2:
            raise ValueError("count_ttgir: more than two loops with runtime bounds; the schedule knows two")
        depth[0] = max(depth[0], level)
        return (2 if level == _tile_loop_level else level), mult

    for idx, s in enumerate(lines):
        t = s.strip()
        m = re.search(r"loc\((#loc\d*)\)\s*$", raw_lines[idx])
        c.where = chains.get(m.group(1), ()) if m else ()
        if t.startswith("}"):
            if stack:
                stack.pop()
            if t.startswith("}) : (tensor<"):
                # a region op's closing line carries its types: ``tt.reduce`` (its combine
                # body holds only scalar ops) costs one ALU op per input element
                level, mult = weight()
                tt_ = _tensor(t.split(": (", 1)[1])
                if tt_:
                    c.add(level, "alu", tt_[0], mult)
            if t.endswith("{"):
                stack.append(("other", None))
            continue
        level, mult = weight()
        if " tt.dot " in f" {t} " or "= tt.dot " in t:
            a = _tensor(t.split("*")[0])
            out = re.search(r"->\s*tensor<([0-9x]+)x\w+,\s*(#[\w.]+)", t)
            assert a is not None and out is not None  # a dot's operand and result are tensors
            n = int(out.group(1).split("x")[-1])
            enc = out.group(2)
            res = encodings.get(enc, "fma_macs")
            if res != "fma_macs" and a[1] >= 4:  # 32-bit operands on tensor cores: tf32
                res = "tf32_macs"
            c.add(level, res, a[0] * n, mult)
        elif "ttng.warp_group_dot " in t:
            shapes = re.findall(r"<([0-9x]+)x(\w+)", t)
            (m_, k_), n_ = [int(x) for x in shapes[0][0].split("x")][-2:], int(shapes[1][0].split("x")[-1])
            c.add(level, "tf32_macs" if _BYTES.get(shapes[0][1], 2) >= 4 else "wgmma_macs", m_ * k_ * n_, mult)
            # operands in shared memory are read from it by the tensor cores (as ldmatrix reads
            # them for mma.sync: FlashAttention-2's modelled shared traffic)
            types = t.split(" : ")[-1].split("->")[0]
            for mem in re.findall(r"!ttg\.memdesc<([0-9x]+)x(\w+)", types):
                c.add(level, "shared_bytes", math.prod(int(x) for x in mem[0].split("x")) * _BYTES.get(mem[1], 2), mult)
        elif re.search(r"= (arith\.mulf|math\.fma) ", t):
            tt_ = _tensor(t.split(" : ")[-1])
            if tt_:
                c.add(level, "fma_macs", tt_[0], mult)
        elif re.search(r"= math\.exp2? ", t):
            tt_ = _tensor(t.split(" : ")[-1])
            c.add(level, "sfu", tt_[0] if tt_ else 1, mult)
        elif re.search(r"= (arith|math)\.\w+ ", t) and "arith.constant" not in t:
            tt_ = _tensor(t.split(" : ")[-1])  # every other elementwise op on a tensor: masks, selects, casts
            if tt_:
                c.add(level, "alu", tt_[0], mult)
        elif re.search(r"= (tt\.gather|ttg\.convert_layout) ", t):
            tt_ = _tensor(t.split("->")[-1] if "->" in t else t.split(" : ")[-1])
            if tt_:  # through shared memory (or shuffles): a store and a load of the tensor
                c.add(level, "shared_bytes", 2 * tt_[0] * tt_[1], mult)
        elif t.startswith("ttng.async_tma_copy_global_to_local "):
            mem = re.findall(r"-> !ttg\.memdesc<([0-9x]+)x(\w+)", t)
            if mem:  # a TMA copy: global bytes of the box (then read from shared memory by its users)
                c.add(
                    level,
                    "global_bytes",
                    math.prod(int(x) for x in mem[-1][0].split("x")) * _BYTES.get(mem[-1][1], 2),
                    mult,
                )
        elif re.search(r"(= tt\.load |^tt\.store |= ttg\.async_copy_global_to_local |= tt\.atomic_rmw )", t):
            elem = re.findall(r"!tt\.ptr<(\w+)>", t)[-1]
            tt_ = _tensor(t.split(" : ")[-1]) or (1, _BYTES.get(elem, 4))
            c.add(level, "global_bytes", tt_[0] * tt_[1] * (2 if "atomic" in t else 1), mult)
            if scratch_elem is not None and elem == scratch_elem and "atomic" not in t:
                c.add(level, "scratch_bytes", tt_[0] * tt_[1], mult)
        elif re.search(r"(= ttg\.local_load |^ttg\.local_store )", t):
            tt_ = _tensor(t.split("->")[-1] if "->" in t else t.split(" : ")[-1])
            if tt_:
                c.add(level, "shared_bytes", tt_[0] * tt_[1], mult)
        elif re.search(r"= ttg\.local_alloc %\S+ : \(tensor<", t):
            tt_ = _tensor(t.split(" : ")[-1])  # a register tensor stored into a new shared buffer
            assert tt_ is not None
            c.add(level, "shared_bytes", tt_[0] * tt_[1], mult)
        elif re.match(r"ttng\.async_tma_(reduce|copy_local_to_global) ", t):
            mem = re.findall(r"!ttg\.memdesc<([0-9x]+)x(\w+)", t)
            box = math.prod(int(x) for x in mem[-1][0].split("x")) * _BYTES.get(mem[-1][1], 4)
            # a TMA store / reduction: the box read from shared memory, written (a reduction: read
            # and written, the atomics' rule) in global memory
            c.add(level, "shared_bytes", box, mult)
            c.add(level, "global_bytes", box * (2 if "reduce" in t else 1), mult)
        elif t.startswith("ttng.async_tma_store_wait "):
            # waiting for a TMA store's completion is a round trip to global memory; for its read of
            # shared memory only (read_only: the pipelined form), a shared-memory wait
            c.add(level, "barriers_shared" if "read_only" in t else "barriers_global", 1, mult)
        elif re.match(r"(ttg|gpu)\.barrier", t):
            near = [lines[j].strip() for j in ops if 0 < abs(j - idx) <= 3]
            glob = any(x.startswith("tt.store") or "tt.atomic_rmw" in x for x in near)
            c.add(level, "barriers_global" if glob else "barriers_shared", 1, mult)
        if t.endswith("{"):
            m = re.match(r"(?:%\S+ = )?scf\.for %\S+ = (%[\w-]+) to (%[\w-]+) step (%[\w-]+)", t)
            if m:
                lb, ub, st = (consts.get(g) for g in m.groups())
                trips = None if lb is None or ub is None or st is None else max(0, -(-(ub - lb) // st))
                stack.append(("for", trips))
            else:
                stack.append(("other", None))
    if depth[0] == 1 and _tile_loop_level == 2:  # one runtime loop: the tiles (per key block)
        return count_ttgir(ttgir, source, scratch_elem, _tile_loop_level=1)
    return c


@dataclass
class PassProfile:
    """How a pass's work is laid out: ``programs[p]`` = the key-block counts of the items
    program p walks, in order (an empty inner list: an item without a key-block loop)."""

    programs: list
    hbm_bytes: float  # compulsory traffic: inputs read once, outputs written, memsets
    num_warps: int
    registers: int
    smem_bytes: int
    # per-program scratch (global memory each program stores and reloads itself): bytes
    # resident at once over all programs, and the compulsory traffic over the pass, each slot
    # written and read back once per tile (``scratch_split``: what may have to leave the SM;
    # the IR's further scratch bytes are window re-reads of a plane just loaded)
    scratch_resident: float = 0.0
    scratch_traffic: float = 0.0

    @property
    def n_items(self) -> int:
        return sum(len(p) for p in self.programs)

    @property
    def n_frames(self) -> int:
        return sum(sum(p) for p in self.programs)


def persistent(items_frames: list, n_prog: int) -> list:
    """Items handed round-robin to ``n_prog`` programs (``for item in range(pid, n, nprog)``)."""
    return [items_frames[p::n_prog] for p in range(n_prog)]


def occupancy(s: PassProfile, gpu: GPU = H200) -> int:
    """Programs resident per SM: the register file, shared memory and warp slots."""
    regs = max(8, -(-s.registers // 8) * 8) * 32 * s.num_warps
    by_regs = gpu.regs_per_sm // regs if regs else 32
    by_smem = gpu.smem_per_sm // (s.smem_bytes + 1024)
    return max(1, min(by_regs, by_smem, gpu.max_warps_per_sm // s.num_warps, 32))


def l1_free_bytes(smem_bytes: int, programs_per_sm: int, gpu: GPU = H200) -> int:
    """L1 left on one SM beside the shared memory of its resident programs: the combined
    L1/shared capacity less the smallest carveout that holds ``programs_per_sm`` x
    (``smem_bytes`` + the 1 KB the driver reserves per program); the largest carveout's
    if none does (such a pass cannot launch: the slow-tier test checks the shipped passes fit)."""
    need = programs_per_sm * (smem_bytes + 1024)
    fit = [kb * 1024 for kb in gpu.smem_carveouts_kb if kb * 1024 >= need] or [max(gpu.smem_carveouts_kb) * 1024]
    return gpu.l1_smem_bytes - min(fit)


def scratch_split(scratch_bytes: float, s: PassProfile, programs_per_sm: int, gpu: GPU = H200) -> dict:
    """Where a pass's per-program scratch bytes go: ``scratch_bytes`` = the
    global bytes of its loads and stores of scratch counted in the IR (``Counts``, resource
    ``scratch_bytes``). Of these, the compulsory traffic ``s.scratch_traffic`` (each slot
    written and read back once per tile, at most the IR's count) may leave the SM; the rest
    are re-reads of a plane the program just loaded (a convolution's row shifts of one head's
    plane: a reuse distance of ~16 KB) and stay in L1. The compulsory bytes hit L1 in the
    share the SM's free L1 (``l1_free_bytes``) holds of its programs' resident scratch;
    the rest go to the L2, where they hit in the share the L2 holds of all programs' resident
    scratch beside the pass's compulsory HBM bytes, and go on to HBM otherwise. A capacity
    fraction model: optimistic against an LRU cache swept cyclically (no hits at all), and
    stores are charged as loads (Hopper's L1 writes global stores through to the L2: a store
    that the model keeps in L1 still costs L2 bandwidth; not charged)."""
    comp = min(scratch_bytes, s.scratch_traffic)
    n = max(1, len(s.programs))
    per_sm = programs_per_sm * s.scratch_resident / n
    l1 = l1_free_bytes(s.smem_bytes, programs_per_sm, gpu)
    f_l1 = 1.0 if per_sm <= 0 else min(1.0, l1 / per_sm)
    f_l2 = 1.0 if s.scratch_resident <= 0 else min(1.0, gpu.l2_bytes / (s.scratch_resident + s.hbm_bytes))
    miss = comp * (1.0 - f_l1)
    return {
        "scratch_bytes": scratch_bytes,
        "scratch_compulsory_bytes": comp,
        "l1_free_bytes": l1,
        "scratch_l1_fraction": f_l1,
        "scratch_l2_hit_fraction": f_l2,
        "scratch_l1_bytes": scratch_bytes - miss,
        "scratch_l2_bytes": miss * f_l2,
        "scratch_hbm_bytes": miss * (1.0 - f_l2),
    }


def _rate(gpu: GPU) -> dict:
    return {
        "mma_macs": gpu.wgmma_bf16 * gpu.mma_sync_fraction,
        "wgmma_macs": gpu.wgmma_bf16,
        "tf32_macs": gpu.wgmma_bf16 * gpu.mma_sync_fraction * gpu.tf32_fraction,
        "fma_macs": gpu.fma_fp32,
        "sfu": gpu.sfu,
        "lsu": gpu.lsu_bytes,
    }


def _busy_cycles(r: dict, gpu: GPU) -> float:
    """Cycles one SM needs for resources ``r`` (throughput only)."""
    rate = _rate(gpu)
    lsu = r["global_bytes"] + r["shared_bytes"]
    return max(
        r["mma_macs"] / rate["mma_macs"] + r["wgmma_macs"] / rate["wgmma_macs"] + r["tf32_macs"] / rate["tf32_macs"],
        (r["fma_macs"] + r["alu"]) / rate["fma_macs"],
        r["sfu"] / rate["sfu"],
        lsu / rate["lsu"],
    )


def line_cycles(c: Counts, gpu: GPU | None = None) -> list:
    """The per-key-block work of ``c.by_line`` as SM cycles per unit, busiest line first:
    [(source chain, {"tensor", "alu", "sfu", "global", "shared"}: cycles)]. Where a pass's
    time goes, to profile a design before changing it (estimates, like everything here)."""
    rate = _rate(gpu or H200)
    out = []
    for where, r in c.by_line.items():
        cyc = {
            "tensor": r["mma_macs"] / rate["mma_macs"]
            + r["wgmma_macs"] / rate["wgmma_macs"]
            + r["tf32_macs"] / rate["tf32_macs"],
            "alu": (r["fma_macs"] + r["alu"]) / rate["fma_macs"],
            "sfu": r["sfu"] / rate["sfu"],
            "global": r["global_bytes"] / rate["lsu"],
            "shared": r["shared_bytes"] / rate["lsu"],
        }
        out.append((where, cyc))
    return sorted(out, key=lambda x: -max(x[1]["tensor"], x[1]["alu"], x[1]["sfu"], x[1]["global"] + x[1]["shared"]))


def program_resources(c: Counts, frames_of_items: list) -> dict:
    out = dict(c.levels[0])
    n_items, n_frames = len(frames_of_items), sum(frames_of_items)
    for k in RESOURCES:
        out[k] += n_items * c.levels[1][k] + n_frames * c.levels[2][k]
    return out


def _chain_cycles(per_prog: list, occ: int, share: int, gpu: GPU, busy) -> float:
    """List schedule: programs start in launch order on the first free slot (SMs x
    occupancy), each taking ``share`` x its ``busy(resources)`` cycles (co-resident programs
    share their SM) plus its barrier latencies (not shared); the last to finish."""
    slots = [0.0] * (gpu.sms * occ)
    heapq.heapify(slots)
    for r in per_prog:
        start = heapq.heappop(slots)
        heapq.heappush(
            slots,
            start
            + share * busy(r)
            + r["barriers_global"] * gpu.barrier_global_cycles
            + r["barriers_shared"] * gpu.barrier_shared_cycles,
        )
    return max(slots)


def estimate_pass(c: Counts, s: PassProfile, gpu: GPU = H200) -> dict:
    """est_ms and est_l2_ms of one pass and their parts (see the module docstring)."""
    per_prog = [program_resources(c, p) for p in s.programs]
    total = {k: sum(r[k] for r in per_prog) for k in RESOURCES}
    occ = occupancy(s, gpu)
    active = min(gpu.sms, len(s.programs))
    tp_cycles = _busy_cycles(total, gpu) / max(1, active)
    t_tp = max(tp_cycles / gpu.clock_hz, s.hbm_bytes / gpu.hbm_bytes_s)
    share = max(1, min(occ, -(-len(s.programs) // gpu.sms)))
    t_chain = _chain_cycles(per_prog, occ, share, gpu, lambda r: _busy_cycles(r, gpu)) / gpu.clock_hz
    # est_l2_ms, the memory-honest bound: the global bytes split by where they go. I/O (every
    # global byte that is not scratch: TMA copies of the inputs into shared memory, TMA
    # reductions, partials) through the L2; scratch by ``scratch_split``: L1 hits, L2 hits,
    # and HBM (through the L2 too). The L2 bytes bind in aggregate and per program (its chain,
    # at its SM's share of the L2 bandwidth); HBM carries the compulsory bytes and the scratch
    # the L2 cannot hold.
    split = scratch_split(total["scratch_bytes"], s, share, gpu)
    miss = (
        0.0
        if total["scratch_bytes"] <= 0
        else ((split["scratch_l2_bytes"] + split["scratch_hbm_bytes"]) / total["scratch_bytes"])
    )

    def l2_bytes(r):
        return r["global_bytes"] - r["scratch_bytes"] + miss * r["scratch_bytes"]

    io = total["global_bytes"] - total["scratch_bytes"]
    t_l2 = l2_bytes(total) / (gpu.l2_bytes_clk * max(1, active)) / gpu.clock_hz
    t_chain_l2 = (
        _chain_cycles(per_prog, occ, share, gpu, lambda r: max(_busy_cycles(r, gpu), l2_bytes(r) / gpu.l2_bytes_clk))
        / gpu.clock_hz
    )
    t_hbm = (s.hbm_bytes + split["scratch_hbm_bytes"]) / gpu.hbm_bytes_s
    return {
        "est_ms": 1e3 * (max(t_tp, t_chain) + gpu.launch_s),
        "throughput_ms": 1e3 * t_tp,
        "chain_ms": 1e3 * t_chain,
        "occupancy": occ,
        "programs": len(s.programs),
        "total": total,
        "est_l2_ms": 1e3 * (max(t_tp, t_chain, t_l2, t_chain_l2, t_hbm) + gpu.launch_s),
        "l2_ms": 1e3 * t_l2,
        "chain_l2_ms": 1e3 * t_chain_l2,
        "hbm_ms": 1e3 * t_hbm,
        "io_bytes": io,
        "l2_bytes": io + split["scratch_l2_bytes"] + split["scratch_hbm_bytes"],
        "hbm_bytes": s.hbm_bytes + split["scratch_hbm_bytes"],
        **split,
    }


# --------------------------------------------------------------------------------------
# FlashAttention-2, forward + backward, counted the same way by hand from its published
# tile configuration (flash-attn 2.x, head dim 96: forward 128x64 tiles on 4 warps, K/V
# through shared memory; backward 64x128 tiles on 8 warps, programs own key blocks, dq by
# fp32 atomics), mma.sync on bf16 operands, causal block skipping.


def _res(**kw) -> dict:
    return {k: float(kw.get(k, 0.0)) for k in RESOURCES}


def fa2_passes(batch: int, heads: int, seq: int, head_dim: int, gpu: GPU = H200) -> dict:
    """{pass: (Counts, PassProfile)} of FlashAttention-2 fwd+bwd for causal self-attention."""
    d = head_dim
    out = {}
    # forward: items (b, h, row block of 128), key blocks of 64 up to the diagonal
    bm, bn = 128, 64
    fwd = Counts()
    fwd.levels[1] = _res(global_bytes=2 * bm * d * 2 + bm * 4)  # Q in, O and lse out
    fwd.levels[2] = _res(
        mma_macs=2 * bm * bn * d,
        fma_macs=2 * bm * bn,
        alu=5 * bm * bn,
        sfu=bm * bn,
        global_bytes=2 * bn * d * 2,
        shared_bytes=4 * 2 * bn * d * 2,
        barriers_shared=2,
    )
    items = [-(-min(seq, (i + 1) * bm) // bn) for i in range(-(-seq // bm))] * (batch * heads)
    io = batch * heads * seq * d * 2
    out["fa2_forward"] = (
        fwd,
        PassProfile(
            [[f] for f in items], hbm_bytes=4 * io, num_warps=4, registers=255, smem_bytes=(bm + 2 * bn) * d * 2
        ),
    )
    # backward: dO.O row sums (memory-bound), then items (b, h, key block of 128) walking
    # row blocks of 64 from the diagonal down, then dq fp32 -> bf16
    pre = Counts()
    pre.levels[1] = _res(global_bytes=2 * 128 * d * 2 + 128 * 4, fma_macs=128 * d)
    n128 = -(-seq // 128)
    out["fa2_backward_dot_do_o"] = (
        pre,
        PassProfile([[0]] * (batch * heads * n128), hbm_bytes=2 * io, num_warps=4, registers=64, smem_bytes=0),
    )
    bm, bn = 64, 128
    bwd = Counts()
    bwd.levels[1] = _res(global_bytes=4 * bn * d * 2)  # K, V in; dK, dV out
    bwd.levels[2] = _res(
        mma_macs=5 * bm * bn * d,
        fma_macs=3 * bm * bn,
        alu=6 * bm * bn,
        sfu=bm * bn,
        global_bytes=2 * bm * d * 2 + 2 * bm * 4 + 2 * bm * d * 4,
        shared_bytes=5 * (bm + bn) * d * 2,
        barriers_shared=4,
    )
    items = [-(-seq // bm) - (j * bn) // bm for j in range(-(-seq // bn))] * (batch * heads)
    out["fa2_backward"] = (
        bwd,
        PassProfile(
            [[f] for f in items],
            hbm_bytes=6 * io + 2 * 2 * io,
            num_warps=8,
            registers=255,
            smem_bytes=(2 * bn + 3 * bm) * d * 2,
        ),
    )
    conv = Counts()
    conv.levels[1] = _res(global_bytes=128 * d * 6)
    out["fa2_backward_convert_dq"] = (
        conv,
        PassProfile([[0]] * (batch * heads * n128), hbm_bytes=3 * io, num_warps=4, registers=32, smem_bytes=0),
    )
    return out


def fa2_est_ms(batch: int, heads: int, seq: int, head_dim: int, gpu: GPU = H200, key: str = "est_ms") -> dict:
    """{pass: est_ms} of FlashAttention-2 and their sum under ``"total"`` (``key="est_l2_ms"``:
    the memory-honest bound)."""
    ms = {name: estimate_pass(c, s, gpu)[key] for name, (c, s) in fa2_passes(batch, heads, seq, head_dim, gpu).items()}
    ms["total"] = sum(ms.values())
    return ms


# FlashAttention-2's published speed on an H100 SXM (FlashAttention-3 paper, Shah et al.,
# arXiv 2407.08608, its forward and backward charts, BF16, causal, seqlen 2K): TFLOP/s by head
# dim, FLOPs counted the FlashAttention papers' way (``fa_flops``). Read from the charts, so
# +-2%; the same rates are used at every T (at longer sequences the charts run a little faster).
FA2_PUBLISHED_TFLOPS = {"forward": {64: 262.0, 128: 298.0}, "backward": {64: 264.0, 128: 291.0}}


def fa_flops(batch: int, heads: int, seq: int, head_dim: int, causal: bool = True) -> dict:
    """The FlashAttention papers' FLOP count: forward 4·B·H·T²·d (two T×T×d products),
    halved when causal; backward 2.5× the forward (five products against two)."""
    fwd = 4.0 * batch * heads * seq * seq * head_dim / (2 if causal else 1)
    return {"forward": fwd, "backward": 2.5 * fwd}


def fa2_published_tflops(head_dim: int) -> dict:
    """FlashAttention-2's published H100 rates at ``head_dim``: the charts' head dims 64 and
    128, linear in the head dim between them (96: the midpoint, fwd 280, bwd 277.5 TFLOP/s),
    the nearer end outside them."""
    out = {}
    for p, by_d in FA2_PUBLISHED_TFLOPS.items():
        lo, hi = min(by_d), max(by_d)
        x = min(max(head_dim, lo), hi)
        out[p] = by_d[lo] + (by_d[hi] - by_d[lo]) * (x - lo) / (hi - lo)
    return out


def fa2_published_ms(batch: int, heads: int, seq: int, head_dim: int) -> dict:
    """{"forward", "backward", "total"}: FlashAttention-2 (causal, bf16) at its published
    H100 SXM rate (``fa2_published_tflops``) in ms: an H100 figure taken for the H200, whose
    SMs and clocks are the same (its faster HBM barely matters to a compute-bound kernel)."""
    fl, rate = fa_flops(batch, heads, seq, head_dim), fa2_published_tflops(head_dim)
    ms = {p: 1e3 * fl[p] / (rate[p] * 1e12) for p in fl}
    ms["total"] = ms["forward"] + ms["backward"]
    return ms
