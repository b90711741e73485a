"""Two hazards of a compiled Triton kernel that only a GPU would show, read from its TritonGPU
IR (``kernel.asm["ttgir"]``, sm_90) without one: ``compile_report.py`` records them per pass
and tests/experimental/test_roofline.py asserts them (design.md, "Hazards").

*Unfenced async-proxy reads* (``unfenced_async_reads``). Shared memory written through the
generic proxy (a register tensor stored by ``ttg.local_alloc %x`` or ``ttg.local_store``,
or a ``cp.async`` copy, ``ttg.async_copy_global_to_local``) and then read through the async
proxy (a ``wgmma`` operand, ``ttng.warp_group_dot``; the source of a TMA store or reduction,
``ttng.async_tma_copy_local_to_global`` / ``ttng.async_tma_reduce``) needs a
``fence.proxy.async`` between the two (``ttng.fence_async_shared``, which Triton lowers to
it). Memory written by TMA copies (``ttng.async_tma_copy_global_to_local``) is in the async
proxy already and needs none. Each reader's shared-memory operand is traced to its
allocation through ``memdesc_*`` views; for every generic write into that allocation a fence
must lie between it and the read: textually between them when the write comes first, or,
when the write comes later in the text (a loop-carried write, read in a later iteration),
after the write or before the read inside the innermost loop holding both. Operands that
cannot be traced are reported as unfenced (the check fails closed).

*Software-pipelined scratch loops* (``pipelined_loops``). A loop is pipelined when its body
(outside its nested loops) issues an asynchronous copy (``cp.async`` or TMA) into a buffer
allocated outside the loop: a copy for a later iteration, in flight across the loop's own
back edge (the pipeliner's multi-buffered prefetch). An unpipelined loop's copies land in
buffers of its own iteration (a nested loop's prologue included). The kernel's loops that
store scratch (plain stores through its bf16 scratch pointer, directly or in a nested loop)
must not be pipelined: a prefetch of a later iteration's scratch could be issued before this
iteration's stores and the barrier that orders them (loops that only read scratch written
before them, behind a barrier, may be).

*Early prefetches* (``early_prefetches``). A pipelined loop's prologue copies of scratch
(``cp.async`` of its bf16 pointer, issued before the loop for its first iterations) must
come after a barrier (``ttg.barrier``) that follows the last scratch store before the loop,
so that they cannot read scratch this program's other threads have not yet written. (TMA
copies read only the inputs: scratch has no descriptor.) Checked for the loops the source
pipelines by name (``num_stages`` > 1: the phase-level head loops); the row-shift loops
nested in a phase (pipelined by the launch's default) read planes of another stage than the
phase stores, written in an earlier phase: that is the phase structure, which a textual check
without addresses cannot see.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_DEF = re.compile(r"^\s*(%[\w.$-]+)(?::\d+)?\s*=\s*([\w.]+)\s*(.*)$")
_VIEWS = (
    "ttg.memdesc_index",
    "ttg.memdesc_trans",
    "ttg.memdesc_reshape",
    "ttg.memdesc_subslice",
    "ttg.memdesc_subview",
    "ttg.memdesc_reinterpret",
)
_ASYNC_COPIES = ("ttg.async_copy_global_to_local", "ttng.async_tma_copy_global_to_local")
_LOC = re.compile(r"loc\((#loc\d+)\)\s*$")


@dataclass
class Loop:
    start: int  # line of the scf.for
    end: int  # line of its closing brace
    num_stages: int | None  # its tt.num_stages attribute
    loc: str  # its location alias (#locN)
    scratch: bool = False  # stores scratch (directly or in a nested loop)
    pipelined: bool = False
    children: list = field(default_factory=list)


def _operands(rest: str) -> list:
    """The SSA operands of an op (its text after the op name, types and attributes cut)."""
    return re.findall(r"%[\w.$-]+", rest.split(" : ")[0])


def parse_loops(lines: list) -> list:
    """Every scf.for of the IR with its extent (by brace depth) and tt.num_stages."""
    loops, stack, depth = [], [], 0
    for n, s in enumerate(lines):
        opens, closes = s.count("{"), s.count("}")
        if re.search(r"\bscf\.for\b", s) and s.rstrip().endswith("{"):
            stack.append((n, depth))
        depth += opens - closes
        while stack and depth <= stack[-1][1]:
            n0, _ = stack.pop()
            m = re.search(r"tt\.num_stages = (\d+)", s)
            loc = _LOC.search(s)
            loops.append(Loop(n0, n, int(m.group(1)) if m else None, loc.group(1) if loc else ""))
    loops.sort(key=lambda lp: lp.start)
    for lp in loops:
        lp.children = [c for c in loops if lp.start < c.start and c.end < lp.end]
    return loops


class _Defs:
    """SSA definitions by name, scope-aware: MLIR reuses a name in a region once an earlier
    region holding it has closed, so a use sees the nearest preceding definition whose region
    encloses it."""

    def __init__(self, lines: list):
        self.by_name: dict = {}
        self.scope: list = []
        stack: list = []
        for n, s in enumerate(lines):
            self.scope.append(tuple(stack))
            m = _DEF.match(s)
            if m:
                self.by_name.setdefault(m.group(1), []).append((n, m.group(2), m.group(3)))
            for ch in s:
                if ch == "{":
                    stack.append(n)
                elif ch == "}" and stack:
                    stack.pop()

    def get(self, v: str, at: int):
        """(line, op, rest) of the definition of v visible at line ``at``, or None."""
        best = None
        for d in self.by_name.get(v, ()):
            sd = self.scope[d[0]]
            if d[0] < at and self.scope[at][: len(sd)] == sd:
                best = d
        return best


def _root(v: str, at: int, defs: _Defs):
    """The line of the ttg.local_alloc the memdesc value v (used at line ``at``) views, or None."""
    for _ in range(64):
        d = defs.get(v, at)
        if d is None:
            return None
        at, op, rest = d
        if op == "ttg.local_alloc":
            return at
        if op not in _VIEWS:
            return None
        v = _operands(rest)[0]
    return None


def _is_memdesc(v: str, at: int, defs: _Defs) -> bool:
    d = defs.get(v, at)
    return d is not None and (d[1] == "ttg.local_alloc" or d[1] in _VIEWS)


@dataclass
class Report:
    async_reads: int  # async-proxy reads of shared memory (wgmma operands, TMA store/reduce sources)
    fenced_generic_reads: int  # of them, of memory written through the generic proxy, fenced
    unfenced: list  # (line, op) of those not fenced (or not traceable)
    loops: list  # every Loop
    pipelined_scratch_loops: list  # (loc, num_stages) of scratch loops that are pipelined
    early_prefetches: list = field(default_factory=list)  # (loc, line): prologue copies before the barrier


def analyse(ttgir: str, scratch_elem: str = "bf16") -> Report:
    lines = ttgir.splitlines()
    defs = _Defs(lines)
    loops = parse_loops(lines)
    fences = [n for n, s in enumerate(lines) if "ttng.fence_async_shared" in s]
    # generic-proxy writes per allocation
    writes: dict = {}
    for n, s in enumerate(lines):
        m = _DEF.match(s)
        op, rest = (
            (m.group(2), m.group(3)) if m else (s.strip().split(" ")[0], s.strip()[len(s.strip().split(" ")[0]) :])
        )
        if op == "ttg.local_alloc" and m and _operands(rest):  # initialised from registers
            writes.setdefault(n, []).append(n)
        elif op in ("ttg.local_store", "ttg.async_copy_global_to_local"):
            writes.setdefault(_root(_operands(rest)[1], n, defs), []).append(n)

    def innermost(a: int, b: int):
        best = None
        for lp in loops:
            if lp.start < min(a, b) and max(a, b) < lp.end and (best is None or lp.start > best.start):
                best = lp
        return best

    def fenced(w: int, r: int) -> bool:
        if w < r:
            return any(w < f < r for f in fences)
        lp = innermost(w, r)  # written later in the text: read in a later iteration of lp
        if lp is None:
            return True  # no path from the write back to the read
        return any(w < f < lp.end or lp.start < f < r for f in fences)

    n_async = n_generic = 0
    unfenced = []
    for n, s in enumerate(lines):
        m = _DEF.match(s)
        body = s.strip()
        if m and m.group(2) == "ttng.warp_group_dot":
            srcs = [v for v in _operands(m.group(3))[:2] if _is_memdesc(v, n, defs)]
        elif body.startswith(("ttng.async_tma_reduce", "ttng.async_tma_copy_local_to_global")):
            ops = _operands(body.split("]", 1)[1]) if "]" in body else []
            srcs = ops[:1]
        else:
            continue
        for v in srcs:
            n_async += 1
            root = _root(v, n, defs)
            if root is None:
                unfenced.append((n, body[:120]))
                continue
            ws = writes.get(root, [])
            if ws:
                if all(fenced(w, n) for w in ws):
                    n_generic += 1
                else:
                    unfenced.append((n, body[:120]))

    # pipelined loops: an async copy in the loop's own body into a buffer allocated outside it
    scratch_ptr = f"!tt.ptr<{scratch_elem}>"
    for lp in loops:
        own = [n for n in range(lp.start + 1, lp.end) if not any(c.start <= n <= c.end for c in lp.children)]
        lp.scratch = any(
            re.search(r"\btt\.store\b", lines[n]) and scratch_ptr in lines[n] for n in range(lp.start + 1, lp.end)
        )
        for n in own:
            m = _DEF.match(lines[n])
            op, rest = (m.group(2), m.group(3)) if m else (lines[n].strip().split(" ")[0], lines[n])
            if op in _ASYNC_COPIES:
                dst = (
                    _operands(rest)[1]
                    if op == "ttg.async_copy_global_to_local"
                    else _operands(rest.split("]", 1)[1])[0]
                )
                root = _root(dst, n, defs)
                if root is None or not (lp.start < root < lp.end):
                    lp.pipelined = True
    bad_loops = [(lp.loc, lp.num_stages) for lp in loops if lp.scratch and lp.pipelined]
    # a pipelined loop's prologue (its first iterations' copies, issued before it) must come
    # after a barrier that follows the last scratch store before the loop
    early = []
    for lp in loops:
        if not lp.pipelined or not (lp.num_stages or 0) > 1:
            continue
        last = max(
            (n for n in range(lp.start) if re.search(r"\btt\.store\b", lines[n]) and scratch_ptr in lines[n]),
            default=-1,
        )
        bars = [n for n in range(last, lp.start) if "ttg.barrier" in lines[n]]
        early += [
            (lp.loc, n)
            for n in range(last + 1, lp.start)
            if "ttg.async_copy_global_to_local" in lines[n] and scratch_ptr in lines[n] and not any(b < n for b in bars)
        ]
    return Report(n_async, n_generic, unfenced, loops, bad_loops, early)


def summary(ttgir: str, scratch_elem: str = "bf16") -> dict:
    """The per-pass record fields of ``compile_report.py`` (key ``hazards``)."""
    r = analyse(ttgir, scratch_elem)
    scratch = [lp for lp in r.loops if lp.scratch]
    return {
        "async_reads": r.async_reads,
        "generic_async_reads": r.fenced_generic_reads + len(r.unfenced),
        "unfenced_async_reads": len(r.unfenced),
        "fences": ttgir.count("ttng.fence_async_shared"),
        "scratch_loops": len(scratch),
        "scratch_loops_num_stages": sorted({lp.num_stages or 0 for lp in scratch}),
        "pipelined_loops": sum(lp.pipelined for lp in r.loops),
        "pipelined_scratch_loops": len(r.pipelined_scratch_loops),
        "early_prefetches": len(r.early_prefetches),
    }
