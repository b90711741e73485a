"""The roofline estimator that judges the triton kernels without a GPU
(mta_repro/experimental/fused_triton/roofline.py, compile_report.py): its IR counting, its arithmetic
on hand-computed cases, FlashAttention-2's closed-form work, the report's record schema,
and (one small real compile for sm_90) that a tensor-core dot is counted as such."""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mta_repro.experimental.fused_triton import roofline, tiles

ROOT = Path(__file__).resolve().parents[2]

# A hand-written TTGIR fragment in the compiler's syntax: a runtime loop over items, a
# runtime loop over key blocks inside it, a constant loop of 4 inside that.
TTGIR = textwrap.dedent("""\
    #blocked = #ttg.blocked<{sizePerThread = [1, 1], threadsPerWarp = [1, 32], warpsPerCTA = [4, 1], order = [1, 0]}>
    #mma = #ttg.nvidia_mma<{versionMajor = 2, versionMinor = 0, warpsPerCTA = [4, 1], instrShape = [16, 8]}>
    module attributes {"ttg.num-warps" = 4 : i32} {
      tt.func public @k(%p: !tt.ptr<bf16>, %n: i32, %m: i32) attributes {noinline = false} {
        %c0_i32 = arith.constant 0 : i32 loc(#loc1)
        %c1_i32 = arith.constant 1 : i32 loc(#loc1)
        %c4_i32 = arith.constant 4 : i32 loc(#loc1)
        %x = tt.load %ptrs : tensor<64x!tt.ptr<f32>, #blocked> loc(#loc2)
        scf.for %i = %c0_i32 to %n step %c1_i32  : i32 {
          %y = tt.load %ptrs2 : tensor<16x32x!tt.ptr<bf16>, #blocked> loc(#loc3)
          scf.for %j = %c0_i32 to %m step %c1_i32  : i32 {
            scf.for %h = %c0_i32 to %c4_i32 step %c1_i32  : i32 {
              %s = tt.dot %a, %b, %c : tensor<64x32xbf16, #ttg.dot_op<{opIdx = 0, parent = #mma, kWidth = 2}>> * tensor<32x16xbf16, #ttg.dot_op<{opIdx = 1, parent = #mma, kWidth = 2}>> -> tensor<64x16xf32, #mma> loc(#loc4)
              %f = tt.dot %d, %e, %g : tensor<16x16xf32, #ttg.dot_op<{opIdx = 0, parent = #blocked}>> * tensor<16x8xf32, #ttg.dot_op<{opIdx = 1, parent = #blocked}>> -> tensor<16x8xf32, #blocked> loc(#loc5)
              %t = arith.mulf %s, %s : tensor<64x16xf32, #mma> loc(#loc6)
              %u = math.exp %t : tensor<64x16xf32, #mma> loc(#loc7)
              %r = "tt.reduce"(%u) <{axis = 1 : i32}> ({
              ^bb0(%q: f32 loc(#loc8), %w: f32 loc(#loc8)):
                %z = arith.addf %q, %w : f32 loc(#loc9)
                tt.reduce.return %z : f32 loc(#loc9)
              }) : (tensor<64x16xf32, #mma>) -> tensor<64xf32, #ttg.slice<{dim = 1, parent = #mma}>> loc(#loc9)
              ttg.barrier all loc(#loc10)
              tt.store %ptrs3, %t : tensor<64x16x!tt.ptr<f32>, #mma> loc(#loc11)
              ttg.barrier all loc(#loc12)
            } loc(#loc13)
            %o = tt.atomic_rmw fadd, relaxed, gpu, %pa, %va, %ma : (tensor<8x!tt.ptr<f32>, #blocked>, tensor<8xf32, #blocked>, tensor<8xi1, #blocked>) -> tensor<8xf32, #blocked> loc(#loc14)
          } loc(#loc15)
        } loc(#loc16)
        tt.return loc(#loc17)
      } loc(#loc18)
    } loc(#loc19)
    """)


def test_ttgir_counts_are_loop_weighted_and_split_by_unit():
    c = roofline.count_ttgir(TTGIR)
    prog, item, frame = c.levels
    assert prog["global_bytes"] == 64 * 4
    assert item["global_bytes"] == 16 * 32 * 2
    assert frame["mma_macs"] == 4 * 64 * 32 * 16  # tensor cores (nvidia_mma v2: mma.sync)
    assert frame["fma_macs"] == 4 * (16 * 16 * 8 + 64 * 16)  # the blocked dot and the multiply
    assert frame["sfu"] == 4 * 64 * 16
    assert frame["global_bytes"] == 4 * 64 * 16 * 4 + 2 * 8 * 4  # store x4, atomic read+write
    assert frame["barriers_global"] == 4 * 2 and frame["barriers_shared"] == 0
    assert c.static["mma_macs"] == 64 * 32 * 16  # unweighted
    with pytest.raises(ValueError, match="runtime bounds"):
        roofline.count_ttgir(TTGIR.replace("%c4_i32 step", "%m step"))


def test_a_kernel_with_one_runtime_loop_counts_its_body_per_key_block():
    """The kernels walk their program's tiles in one loop (tiles.TileSchedule.tiles): that
    loop's body is the per-key-block work (level 2, what the schedule multiplies by tiles and
    --by-line splits), nothing is per item; the two-loop form above keeps its levels."""
    one = "\n".join(line for line in TTGIR.splitlines() if "scf.for %j" not in line and "} loc(#loc15)" not in line)
    assert one.count("scf.for") == TTGIR.count("scf.for") - 1
    c = roofline.count_ttgir(one)
    prog, item, frame = c.levels
    assert prog["global_bytes"] == 64 * 4 and all(v == 0 for v in item.values())
    assert frame["global_bytes"] == 16 * 32 * 2 + 4 * 64 * 16 * 4 + 2 * 8 * 4  # the item's load is now per tile
    assert frame["mma_macs"] == 4 * 64 * 32 * 16
    assert sum(r["global_bytes"] for r in c.by_line.values()) == frame["global_bytes"]


def test_per_key_block_work_is_attributed_to_its_source_lines():
    """compile_report.py --by-line: every per-key-block resource lands on the source line of
    the op that spends it (through a helper's call site: the helper's line, then its caller's;
    a named location: the line it names), and the lines add up to the level's total."""
    locs = textwrap.dedent("""\
        #loc4 = loc("/src/mta_repro/experimental/fused_triton/fused.py":153:10)
        #loc20 = loc("/src/mta_repro/experimental/fused_triton/fused.py":200:5)
        #loc21 = loc("/src/mta_repro/experimental/fused_triton/fused.py":500:9)
        #loc6 = loc(callsite(#loc20 at #loc21))
        #loc7 = loc("acc"(#loc4))
        #loc11 = loc("/elsewhere/other.py":7:1)
        """)
    c = roofline.count_ttgir(TTGIR + locs)
    frame = c.levels[2]
    assert c.by_line[(153,)]["mma_macs"] == 4 * 64 * 32 * 16  # the dot at #loc4
    assert c.by_line[(153,)]["sfu"] == 4 * 64 * 16  # the exp, named after #loc4
    assert c.by_line[(200, 500)]["fma_macs"] == 4 * 64 * 16  # the multiply, inlined from line 200 called at 500
    assert c.by_line[()]["global_bytes"] == frame["global_bytes"]  # the store (another file) and the atomic (no def)
    for res in roofline.RESOURCES:
        assert sum(r[res] for r in c.by_line.values()) == pytest.approx(frame[res]), res
    gpu = roofline.H200
    ranked = roofline.line_cycles(c, gpu)
    assert ranked[0][0] == (153,)  # 131072 MACs at mma.sync's rate outweigh the rest
    assert ranked[0][1]["tensor"] == pytest.approx(4 * 64 * 32 * 16 / (gpu.wgmma_bf16 * gpu.mma_sync_fraction))


# The Hopper forms the shipped kernel compiles to (lines as the compiler prints them, loc
# dropped), inside one constant loop of 2: a TMA box copy, a warpgroup dot reading both
# operands from shared memory, a layout conversion and a gather (through shared memory),
# a select (ALU), a row reduction whose types sit on its closing line, a register tensor
# stored into shared memory, and a pipelined TMA reduction (a wait for its read of shared
# memory in the loop, one for its completion after it).
TTGIR_SM90 = textwrap.dedent("""\
    #mma = #ttg.nvidia_mma<{versionMajor = 3, versionMinor = 0, warpsPerCTA = [4, 1], instrShape = [16, 64, 16]}>
    module attributes {"ttg.num-warps" = 4 : i32} {
      tt.func public @k(%qd: !tt.tensordesc<1x128x32xbf16, #shared>) attributes {noinline = false} {
        %c0_i32 = arith.constant 0 : i32
        %c1_i32 = arith.constant 1 : i32
        %c2_i32 = arith.constant 2 : i32
        scf.for %i = %c0_i32 to %c2_i32 step %c1_i32  : i32 {
          ttng.async_tma_copy_global_to_local %qd[%a, %b, %c0_i32] %buf, %bar, %true : !tt.tensordesc<1x128x32xbf16, #shared>, !ttg.memdesc<1xi64, #shared4, #smem, mutable> -> !ttg.memdesc<128x32xbf16, #shared3, #smem, mutable>
          %acc = ttng.warp_group_dot %x, %y, %cst {inputPrecision = 0 : i32, isAsync = true} : !ttg.memdesc<128x32xbf16, #shared2, #smem> * !ttg.memdesc<32x64xbf16, #shared3, #smem> -> tensor<128x64xf32, #mma>
          %cv = ttg.convert_layout %acc : tensor<128x64xf32, #mma> -> tensor<128x64xf32, #blocked>
          %g = tt.gather %cv[%idx] {axis = 0 : i32, efficient_layout} : (tensor<128x64xf32, #blocked>, tensor<16x64xi32, #blocked>) -> tensor<16x64xf32, #blocked>
          %sel = arith.select %m, %acc, %cst : tensor<128x64xi1, #mma>, tensor<128x64xf32, #mma>
          %red = "tt.reduce"(%sel) <{axis = 1 : i32}> ({
          ^bb0(%q: f32, %w: f32):
            %z = arith.maxnumf %q, %w : f32
            tt.reduce.return %z : f32
          }) : (tensor<128x64xf32, #mma>) -> tensor<128xf32, #ttg.slice<{dim = 1, parent = #mma}>>
          %st = ttg.local_alloc %acc : (tensor<128x64xf32, #mma>) -> !ttg.memdesc<128x64xf32, #shared2, #smem>
          ttng.async_tma_store_wait {pendings = 0 : i32, read_only}
          ttng.async_tma_reduce add, %od[%a, %b, %c0_i32] %st2 : !tt.tensordesc<1x128x32xf32, #shared2>, !ttg.memdesc<1x128x32xf32, #shared2, #smem>
        }
        ttng.async_tma_store_wait {pendings = 0 : i32}
        tt.return
      }
    }
    """)


def test_hopper_forms_are_counted_on_their_units():
    c = roofline.count_ttgir(TTGIR_SM90)
    prog = c.levels[0]
    # the TMA box copied, twice; the reduction's fp32 box read and written in global memory, twice
    assert prog["global_bytes"] == 2 * 128 * 32 * 2 + 2 * 2 * 128 * 32 * 4
    assert prog["wgmma_macs"] == 2 * 128 * 32 * 64
    # shared: the dot's two operands, the conversion's and the gather's store + load, the
    # register tensor stored, the reduction's box read by the TMA unit
    assert prog["shared_bytes"] == 2 * (
        (128 * 32 + 32 * 64) * 2 + 2 * 128 * 64 * 4 + 2 * 16 * 64 * 4 + 128 * 64 * 4 + 128 * 32 * 4
    )
    # waiting for the reduction to be read: a shared-memory wait, each trip; for it to complete: a
    # round trip to global memory, once
    assert prog["barriers_shared"] == 2 and prog["barriers_global"] == 1
    # ALU: the select and the reduction, one op per element each (scalar ops in the
    # reduction's body are not counted again)
    assert prog["alu"] == 2 * (128 * 64 + 128 * 64)


def test_estimate_arithmetic_on_a_hand_case():
    gpu = roofline.GPU(
        sms=2,
        clock_hz=1e9,
        wgmma_bf16=300.0,
        mma_sync_fraction=0.5,
        fma_fp32=10.0,
        sfu=1.0,
        lsu_bytes=100.0,
        hbm_bytes_s=1e9,
        barrier_global_cycles=7.0,
        barrier_shared_cycles=3.0,
        launch_s=1e-6,
    )
    c = roofline.Counts()
    c.levels[1]["global_bytes"] = 1000.0  # per item: 10 cycles of LSU
    c.levels[2]["mma_macs"] = 3000.0  # per frame: 3000 / 150 = 20 cycles
    c.levels[2]["fma_macs"] = 100.0  # 10 cycles (< 20: tensor cores bind)
    c.levels[2]["barriers_global"] = 1.0  # 7 cycles each on the chain
    # 3 programs: frames (5), (1, 1), (2): program work in cycles
    programs = [[5], [1, 1], [2]]
    s = roofline.PassProfile(programs, hbm_bytes=0.0, num_warps=4, registers=128, smem_bytes=0)
    assert roofline.occupancy(s, gpu) == 4  # 65536 / (128 x 128) registers
    est = roofline.estimate_pass(c, s, gpu)
    busy = [max(20 * 5, 10 * 1), max(20 * 2, 10 * 2), max(20 * 2, 10)]  # per program
    total = max(20 * 9, 10 * 4)  # mma 9 frames vs LSU 4 items
    assert est["throughput_ms"] == pytest.approx(1e3 * total / 2 / 1e9)
    # 3 programs on 2 SMs: two share an SM (share 2), list-scheduled on 8 slots
    chain = max(2 * b + 7 * f for b, f in zip(busy, (5, 2, 2)))
    assert est["chain_ms"] == pytest.approx(1e3 * chain / 1e9)
    assert est["est_ms"] == pytest.approx(1e3 * (max(total / 2, chain) / 1e9 + 1e-6))
    # HBM-bound when the compulsory bytes dominate
    s.hbm_bytes = 1e6
    assert roofline.estimate_pass(c, s, gpu)["est_ms"] == pytest.approx(1e3 * (1e-3 + 1e-6))


def test_the_free_l1_is_what_the_shared_memory_carveout_leaves():
    gpu = roofline.H200
    # 129 KB + 1 KB reserved -> the 132 KB carveout; 256 - 132 = 124 KB of L1
    assert roofline.l1_free_bytes(129 * 1024, 1, gpu) == (256 - 132) * 1024
    # two programs of 48 KB: 2 x 49 KB = 98 KB -> 100 KB
    assert roofline.l1_free_bytes(48 * 1024, 2, gpu) == (256 - 100) * 1024
    assert roofline.l1_free_bytes(0, 1, gpu) == (256 - 8) * 1024  # the 1 KB reservation needs the 8 KB carveout
    assert roofline.l1_free_bytes(228 * 1024, 1, gpu) == 28 * 1024  # + 1 KB: no carveout holds it; the largest


def _scratch_case(per_program: float, n_prog: int = 4, smem: int = 100 * 1024, traffic: float = 1e6):
    """A pass whose only work is its scratch: ``traffic`` compulsory bytes over ``n_prog``
    programs of one tile each, ``per_program`` bytes resident in each, one program per SM."""
    gpu = roofline.GPU(
        sms=4,
        clock_hz=1e9,
        lsu_bytes=100.0,
        l2_bytes_s=4 * 1e9 * 10.0,
        hbm_bytes_s=1e9,
        l2_bytes=1000.0 * 1024,
        launch_s=0.0,
    )
    c = roofline.Counts()
    c.levels[2]["global_bytes"] = c.levels[2]["scratch_bytes"] = traffic / n_prog
    s = roofline.PassProfile(
        [[1]] * n_prog,
        hbm_bytes=0.0,
        num_warps=4,
        registers=255,
        smem_bytes=smem,
        scratch_resident=n_prog * per_program,
        scratch_traffic=traffic,
    )
    return gpu, c, s


def test_scratch_that_fits_in_l1_costs_the_l1_rate():
    # 100 KB of shared memory (+1 KB) -> the 132 KB carveout: 124 KB of L1 holds 100 KB of scratch
    gpu, c, s = _scratch_case(per_program=100 * 1024)
    est = roofline.estimate_pass(c, s, gpu)
    assert est["l1_free_bytes"] == 124 * 1024
    assert est["scratch_l1_bytes"] == pytest.approx(1e6) and est["scratch_l2_bytes"] == 0
    assert est["scratch_hbm_bytes"] == 0
    # 1e6 B over 4 SMs at 100 B/clk, 1 GHz: 2.5 ms through L1; nothing through the L2 or HBM
    assert est["est_l2_ms"] == pytest.approx(1e3 * 1e6 / 4 / 100 / 1e9)
    assert est["est_l2_ms"] == pytest.approx(est["est_ms"])


def test_scratch_beyond_l1_costs_the_l2_rate_and_beyond_l2_the_hbm_rate():
    # 496 KB resident per program, 124 KB of it in L1 (1/4); the L2 (1000 KB) holds all 4 x 496 KB
    # for one half
    gpu, c, s = _scratch_case(per_program=496 * 1024)
    est = roofline.estimate_pass(c, s, gpu)
    f_l1, f_l2 = 124 / 496, 1000 / (4 * 496)
    assert est["scratch_l1_bytes"] == pytest.approx(1e6 * f_l1)
    assert est["scratch_l2_bytes"] == pytest.approx(1e6 * (1 - f_l1) * f_l2)
    assert est["scratch_hbm_bytes"] == pytest.approx(1e6 * (1 - f_l1) * (1 - f_l2))
    # L2: 10 B/clk/SM; the missing 3/4 pass it (HBM-bound bytes too): 0.75e6 / 4 / 10 cycles per SM
    assert est["l2_ms"] == pytest.approx(1e3 * 0.75e6 / 4 / 10 / 1e9)
    assert est["hbm_ms"] == pytest.approx(1e3 * 1e6 * 0.75 * (1 - f_l2) / 1e9)
    assert est["est_l2_ms"] == pytest.approx(max(est["hbm_ms"], est["l2_ms"], 1e3 * 1e6 / 4 / 100 / 1e9))
    # 10x the L2's capacity resident, L1 a rounding error: nearly every byte at the HBM rate
    gpu, c, s = _scratch_case(per_program=10 * 1000 * 1024 / 4, smem=0)
    est = roofline.estimate_pass(c, s, gpu)
    f_l1 = 248 / 2500
    assert est["scratch_hbm_bytes"] == pytest.approx(1e6 * (1 - f_l1) * 0.9)
    assert est["est_l2_ms"] == pytest.approx(1e3 * 1e6 * (1 - f_l1) * 0.9 / 1e9)  # 1 GB/s HBM binds


def test_scratch_rereads_beyond_the_compulsory_traffic_stay_in_l1():
    """The IR's scratch bytes beyond each slot's one store and one reload (a convolution's row
    shifts of a plane just loaded) are L1 hits whatever the resident scratch."""
    gpu, c, s = _scratch_case(per_program=496 * 1024)
    c.levels[2]["global_bytes"] = c.levels[2]["scratch_bytes"] = 3 * 1e6 / 4  # 3x the compulsory bytes
    est = roofline.estimate_pass(c, s, gpu)
    assert est["scratch_bytes"] == pytest.approx(3e6) and est["scratch_compulsory_bytes"] == pytest.approx(1e6)
    assert est["scratch_l2_bytes"] + est["scratch_hbm_bytes"] == pytest.approx(0.75e6)
    assert est["scratch_l1_bytes"] == pytest.approx(3e6 - 0.75e6)


def test_io_bytes_go_through_the_l2_and_only_scratch_is_split():
    """Global bytes that are not scratch (TMA copies of inputs, reductions) are charged at the
    L2 rate; the counter tells scratch by the scratch's element type."""
    gpu, c, s = _scratch_case(per_program=100 * 1024)  # scratch all in L1
    c.levels[2]["global_bytes"] += 2e6 / 4  # 2 MB of I/O
    est = roofline.estimate_pass(c, s, gpu)
    assert est["io_bytes"] == pytest.approx(2e6) and est["l2_bytes"] == pytest.approx(2e6)
    assert est["l2_ms"] == pytest.approx(1e3 * 2e6 / 4 / 10 / 1e9)
    assert est["est_l2_ms"] == pytest.approx(est["l2_ms"])  # 50 ms through the L2 against 7.5 through L1
    counted = roofline.count_ttgir(TTGIR, scratch_elem="bf16")
    assert counted.levels[1]["scratch_bytes"] == 16 * 32 * 2  # the bf16 pointer load is scratch
    assert counted.levels[0]["scratch_bytes"] == 0 and counted.levels[2]["scratch_bytes"] == 0  # f32 ones are not
    assert roofline.count_ttgir(TTGIR).levels[1]["scratch_bytes"] == 0  # no scratch type named: none


def test_the_l2_rate_is_the_hopper_measurement():
    gpu = roofline.H200
    assert gpu.l2_bytes_s == 7.0e12  # the top of the measured 5.5-7 TB/s, not A100's 5120 B/clk per 108 SMs
    assert gpu.l2_bytes_clk == pytest.approx(7.0e12 / (132 * 1.83e9))
    assert gpu.constants()["l2_bytes_clk"] == pytest.approx(28.98, abs=0.01)


def test_fa2_published_time_is_the_fa_papers_flops_at_the_published_rate():
    # B=4, H=16, T=2048, d=96: forward 4 B H T^2 d / 2 = 5.154e10 FLOP; rates midway between
    # hd64 and hd128: forward (262 + 298) / 2 = 280, backward (264 + 291) / 2 = 277.5 TFLOP/s
    fwd = 4 * 4 * 16 * 2048**2 * 96 / 2
    assert fwd == pytest.approx(5.1540e10, rel=1e-4)
    ms = roofline.fa2_published_ms(4, 16, 2048, 96)
    assert ms["forward"] == pytest.approx(1e3 * fwd / 280e12)
    assert ms["backward"] == pytest.approx(1e3 * 2.5 * fwd / 277.5e12)
    assert ms["total"] == pytest.approx(0.1841 + 0.4643, abs=2e-4)
    assert roofline.fa2_published_tflops(64) == {"forward": 262.0, "backward": 264.0}
    assert roofline.fa2_published_tflops(256) == {"forward": 298.0, "backward": 291.0}  # the nearer end
    assert roofline.fa2_published_ms(4, 16, 4096, 96)["total"] == pytest.approx(4 * ms["total"])  # T^2


def test_step_ratio_on_a_hand_computation():
    ct = _compile_script()
    # 40% of 989 TFLOP/s on 6 x 876.5M x 8192 = 4.3082e13 FLOP: 108.91 ms
    st = ct.step_ratio({"kq_conv": 10.0, "mixing": 2.0}, 0.5, 8192, 0.4)
    linear = 1e3 * 6 * 876.5e6 * 8192 / (0.4 * 989e12)
    assert linear == pytest.approx(108.91, abs=0.01) and st["linear_ms"] == pytest.approx(linear)
    assert st["baseline_ms"] == pytest.approx(linear + 24 * 0.5)
    assert st["mta_ms"] == pytest.approx(linear + 6 * 10.0 + 18 * 2.0)
    assert st["ratio"] == pytest.approx((108.91 + 96.0) / (108.91 + 12.0), abs=1e-3)
    assert ct.step_ratio({"kq_conv": 1.0, "mixing": 1.0}, 1.0, 8192, 0.6)["ratio"] == pytest.approx(1.0)


def test_persistent_programs_take_items_round_robin():
    assert roofline.persistent([1, 2, 3, 4, 5], 2) == [[1, 3, 5], [2, 4]]


@pytest.mark.parametrize("T", [2048, 4096])
def test_fa2_work_is_the_causal_flash_count(T):
    """FlashAttention-2's modelled MACs against the closed form: causal block skipping,
    2 products forward and 5 backward of d-long dot products."""
    B, H, d = 4, 16, 96
    p = roofline.fa2_passes(B, H, T, d)
    fwd = roofline.estimate_pass(*p["fa2_forward"])["total"]["mma_macs"]
    bwd = roofline.estimate_pass(*p["fa2_backward"])["total"]["mma_macs"]
    # forward: row block i of 128 sees keys [0, 128 (i+1)); backward: key block j of 128
    # sees rows [128 j, T)
    n = T // 128
    assert fwd == B * H * 2 * d * sum(128 * 128 * (i + 1) for i in range(n))
    assert bwd == B * H * 5 * d * sum(128 * (T - 128 * j) for j in range(n))
    ms = roofline.fa2_est_ms(B, H, T, d)
    flops = 2 * (fwd + bwd)
    assert ms["total"] * 1e-3 >= flops / (989e12 * 2 / 3)  # never faster than mma.sync peak
    assert ms["total"] == pytest.approx(sum(v for k, v in ms.items() if k != "total"))


def _compile_script():
    from mta_repro.experimental.fused_triton import compile_report

    return compile_report


def test_report_has_one_record_per_layer_pass_and_T(tmp_path, monkeypatch, capsys):
    """The JSON schema, with the compile replaced by fixed counts (the real compiles take
    minutes on a small CPU)."""
    ct = _compile_script()
    nw, ns = tiles.launch_config("stats", None, None)
    fake = {
        "num_warps": nw,
        "num_stages": ns,
        "smem_bytes": 1024,
        "registers": 128,
        "spill_bytes": 0,
        "levels": [dict.fromkeys(roofline.RESOURCES, 0.0) for _ in range(3)],
        "static": dict.fromkeys(roofline.RESOURCES, 0.0),
        "ptx": {"ld_global": 3, "cp_async": 1, "bar_sync": 2},
    }
    fake["levels"][2].update(mma_macs=9e6, fma_macs=1e6)
    line = 1 + next(
        i
        for i, t in enumerate((ROOT / "mta_repro/experimental/fused_triton/fused.py").read_text().splitlines())
        if t.startswith("def _mta_kernel(")
    )
    fake["by_line"] = {(line, 7): dict(fake["levels"][2])}  # all of it on one line, called from line 7
    monkeypatch.setattr(ct, "compiled_pass", lambda *a, **k: fake)
    # main() clears TRITON_INTERPRET for its compiles: restored after this test for the rest of the run
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "0"))
    out = tmp_path / "r.json"
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "compile_report.py",
            "--json",
            str(out),
            "--cache",
            str(tmp_path),
            "--by-line",
            "3",
            "--layers",
            "kq_conv,mixing",
        ],
    )
    ct.main()
    printed = capsys.readouterr().out
    recs = json.loads(out.read_text())["records"]
    # --by-line: each pass's table names the line, its source and its caller, in cycles at the rates
    rate = roofline._rate(roofline.H200)
    want = f"| {line} | {9e6 / rate['mma_macs']:.0f} | {1e6 / rate['fma_macs']:.0f} | 0 | 0 | `def _mta_kernel(` | 7 |"
    assert printed.count(want) == len(tiles.FUSED_PASSES), printed[-2000:]  # the mixing layer's (fused.py)
    keys = {
        "layer",
        "pass",
        "T",
        "num_warps",
        "num_stages",
        "registers",
        "spill_bytes",
        "smem_bytes",
        "mma_macs",
        "fma_macs",
        "global_loads",
        "barriers",
        "est_ms",
        "fa2_est_ms",
        "est_l2_ms",
        "fa2_est_l2_ms",
        "fa2_published_ms",
        "io_bytes",
        "scratch_bytes",
        "scratch_l1_bytes",
        "scratch_l2_bytes",
        "scratch_hbm_bytes",
    }
    mta = [r for r in recs if r["layer"] != "sdpa"]
    assert sorted((r["layer"], r["pass"], r["T"]) for r in mta) == sorted(
        [("kq_conv", p, T) for p in tiles.STORED_PASSES for T in (2048, 4096)]
        + [("mixing", p, T) for p in tiles.FUSED_PASSES for T in (2048, 4096)]
    )
    for r in recs:
        assert keys <= set(r) and r["estimate"] is True
    for r in mta:
        assert (r["num_warps"], r["num_stages"]) == tiles.launch_config(r["pass"], *ct.LAYERS[r["layer"]])
        assert r["tc_share"] == pytest.approx(0.9)
        assert r["global_loads"] == 4 and r["barriers"] == 2
    # the split accounts for every scratch byte; fa2_published_ms, the published rate's time
    for r in mta:
        assert r["scratch_l1_bytes"] + r["scratch_l2_bytes"] + r["scratch_hbm_bytes"] == pytest.approx(
            r["scratch_bytes"]
        )
    for T in (2048, 4096):
        assert {r["fa2_published_ms"] for r in recs if r["T"] == T} == {
            round(roofline.fa2_published_ms(4, 16, T, 96)["total"], 4)
        }
    assert "The 880M step" in printed and "baseline with FA2 published" in printed
    # fa2_est_ms: the same value on every record of a T, the sum of the sdpa records
    for T in (2048, 4096):
        fa2 = {r["fa2_est_ms"] for r in recs if r["T"] == T}
        assert len(fa2) == 1
        assert fa2.pop() == pytest.approx(
            sum(r["est_ms"] for r in recs if r["T"] == T and r["layer"] == "sdpa"), abs=1e-3
        )


KERNEL = textwrap.dedent("""\
    import triton
    import triton.language as tl

    @triton.jit
    def k(a_ptr, b_ptr, c_ptr, n):
        i = tl.arange(0, 64)
        a = tl.load(a_ptr + i[:, None] * 64 + i[None, :])
        acc = tl.zeros([64, 64], dtype=tl.float32)
        for j in tl.range(0, 4, num_stages=1):
            b = tl.load(b_ptr + j * 4096 + i[:, None] * 64 + i[None, :])
            acc += tl.dot(a, b)
        tl.store(c_ptr + i[:, None] * 64 + i[None, :], acc)
    """)


@pytest.mark.triton
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_a_real_sm90_compile_counts_its_tensor_core_dot(tmp_path):
    """A 64x64x64 bf16 dot in a loop of 4, compiled for sm_90 (no GPU needed): 4 x 64^3
    tensor-core MACs, none on CUDA cores, and the PTX holds mma/wgmma instructions."""
    (tmp_path / "tiny_kernel.py").write_text(KERNEL)
    # The child only compiles (triton alone: no torch to import there); the IR and the PTX
    # are counted here, by the same functions compile_report.py calls. A child, not
    # this process: here triton was imported under TRITON_INTERPRET=1 (tests/conftest.py),
    # so its own library functions (tl.cdiv, ...) are the interpreter's and do not compile.
    code = textwrap.dedent(f"""\
        import json, sys
        sys.path[:0] = [{str(tmp_path)!r}]
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        import tiny_kernel
        src = ASTSource(fn=tiny_kernel.k, signature={{"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*fp32",
                                                     "n": "i32"}}, constexprs={{}})
        kern = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={{"num_warps": 4}})
        print(json.dumps({{"ttgir": kern.asm["ttgir"], "ptx": kern.asm["ptx"]}}))
        """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    prog = roofline.count_ttgir(got["ttgir"]).levels[0]
    ptx = _compile_script().ptx_counts(got["ptx"], 4)
    assert prog["mma_macs"] + prog["wgmma_macs"] == 4 * 64**3
    assert prog["fma_macs"] == 0 and prog["tf32_macs"] == 0
    assert ptx["mma_sync"] + ptx["wgmma"] > 0
    assert ptx["tc_macs_per_program"] >= 64**3  # one iteration's worth, statically


@pytest.mark.triton
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_the_shipped_kernel_compiles_for_an_h200_within_its_limits(tmp_path):
    """compile_report.py on the kernels as shipped (the 880M layer kinds, sm_90, the
    launcher's configuration): every pass fits one H200 program (shared memory <= 227 KB,
    registers <= 255), at least 90% of its multiply-adds run on tensor cores, and the mixing
    layer's passes (18 of the 880M model's 24 layers, the fused kernel) and the kq-conv
    layer's (the stored-scores kernels) but backward_dc spill nothing; ptxas serialises no
    pass's wgmma; the report carries both estimates, as estimates. The hazards (``hazards``
    from ir_hazards.py on the TritonGPU IR; one compile serves both checks), for both
    kernels: every wgmma operand and TMA store/reduction source in shared
    memory that ordinary stores (or cp.async) wrote is fenced (ttng.fence_async_shared, in the
    PTX fence.proxy.async) after the write and before the read: none is unfenced; the loops
    that store scratch say num_stages=1 and none is software-pipelined, while the pipeliner
    does pipeline other loops (the input copies, the accumulating head loops), whose scratch
    prefetches before the loop come after the barrier that ends the phase writing it."""
    out = tmp_path / "r.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "mta_repro.experimental.fused_triton.compile_report",
            "--seqs",
            "2048",
            "--json",
            str(out),
            "--layers",
            "kq_conv,mixing",
            "--cache",
            str(tmp_path / "cache"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=1500,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    recs = [r for r in json.loads(out.read_text())["records"] if r["layer"] != "sdpa"]
    assert sorted((r["layer"], r["pass"]) for r in recs) == sorted(
        [("kq_conv", name) for name in tiles.STORED_PASSES] + [("mixing", name) for name in tiles.FUSED_PASSES]
    )
    for r in recs:
        pre_post = ((6, 11), (6, 11)) if r["layer"] == "kq_conv" else (None, None)
        assert (r["num_warps"], r["num_stages"]) == tiles.launch_config(r["pass"], *pre_post), r
        assert r["smem_bytes"] <= 227 * 1024 and r["registers"] <= 255, r
        assert r["tc_share"] >= 0.9, r
        assert r["estimate"] is True and 0 < r["est_ms"] <= r["est_l2_ms"], r
        if r["layer"] == "mixing" or r["pass"] != "backward_dc":
            assert r["spill_bytes"] == 0, r
        assert r["wgmma_serialized"] is False, r  # ptxas would serialise every wgmma of the pass
        hz = r["hazards"]
        what = (r["layer"], r["pass"], hz)
        assert hz["unfenced_async_reads"] == 0 and hz["generic_async_reads"] > 0, what
        assert r["ptx"]["fence_proxy_async"] >= hz["fences"] > 0, what
        assert hz["scratch_loops"] >= 2 and hz["scratch_loops_num_stages"] == [1], what
        assert hz["pipelined_scratch_loops"] == 0 and hz["pipelined_loops"] > 0, what
        assert hz["early_prefetches"] == 0, what


# TritonGPU IR fragments in the compiler's syntax for the hazard checks (ir_hazards.py)
_HZ_HEAD = textwrap.dedent("""\
    module attributes {"ttg.num-warps" = 8 : i32} {
      tt.func public @k(%p: !tt.ptr<bf16>) attributes {noinline = false} {
        %b = ttg.local_alloc : () -> !ttg.memdesc<2x64x32xbf16, #shared, #smem, mutable> loc(#loc1)
        %b0 = ttg.memdesc_index %b[%c0_i32] : !ttg.memdesc<2x64x32xbf16, #shared, #smem, mutable> -> !ttg.memdesc<64x32xbf16, #shared, #smem, mutable> loc(#loc1)
        ttng.async_tma_copy_global_to_local %kd[%c0_i32, %c0_i32] %b0, %bar, %true : !tt.tensordesc<64x32xbf16, #shared>, !ttg.memdesc<1xi64, #shared5, #smem, mutable> -> !ttg.memdesc<64x32xbf16, #shared, #smem, mutable> loc(#loc1)
    """)
_HZ_TAIL = "    tt.return loc(#loc9)\n  } loc(#loc9)\n} loc(#loc9)\n"


def _hz(body: str):
    from mta_repro.experimental.fused_triton import ir_hazards

    return ir_hazards.analyse(_HZ_HEAD + textwrap.indent(textwrap.dedent(body), "    ") + _HZ_TAIL)


def test_a_register_tensor_stored_to_shared_memory_and_read_by_wgmma_needs_a_fence():
    """ttg.local_alloc of a register tensor (st.shared: the generic proxy) read by a wgmma (the
    async proxy) is unfenced without a ttng.fence_async_shared between them, fenced with one;
    the TMA-written operand needs none."""
    dot = (
        "%d = ttng.warp_group_dot %a, %b0, %c {inputPrecision = 0 : i32, isAsync = true} : "
        "!ttg.memdesc<128x64xbf16, #shared1, #smem> * !ttg.memdesc<64x32xbf16, #shared, #smem, mutable> -> "
        "tensor<128x32xf32, #mma> loc(#loc2)\n"
    )
    alloc = "%a = ttg.local_alloc %x : (tensor<128x64xbf16, #blocked>) -> !ttg.memdesc<128x64xbf16, #shared1, #smem> loc(#loc2)\n"
    bad = _hz(alloc + dot)
    assert bad.async_reads == 2 and bad.fenced_generic_reads == 0 and [n for n, _ in bad.unfenced] == [6]
    good = _hz(alloc + "ttng.fence_async_shared {bCluster = false} loc(#loc2)\n" + dot)
    assert good.async_reads == 2 and good.fenced_generic_reads == 1 and good.unfenced == []
    # the fence must come after the write: one before it does not count
    early = _hz("ttng.fence_async_shared {bCluster = false} loc(#loc2)\n" + alloc + dot)
    assert len(early.unfenced) == 1


def test_a_loop_carried_store_read_by_a_tma_reduction_in_the_next_iteration_needs_a_fence():
    """A ttg.local_store after the TMA reduction that reads its buffer, in the same loop: the
    next iteration reads what it wrote, so a fence is needed after the store (or before the
    read) inside the loop; one after the loop does not help. Aliases of the buffer through
    memdesc views are followed; a name MLIR reuses in a later region is not confused with it."""
    loop = textwrap.dedent("""\
        %s = ttg.local_alloc : () -> !ttg.memdesc<1x128x32xf32, #shared2, #smem, mutable> loc(#loc3)
        scf.for %i = %c0_i32 to %n step %c1_i32  : i32 {
          %v = ttg.memdesc_index %s[%c0_i32] : !ttg.memdesc<1x128x32xf32, #shared2, #smem, mutable> -> !ttg.memdesc<128x32xf32, #shared2, #smem, mutable> loc(#loc3)
          ttng.async_tma_reduce add, %pod[%i, %c0_i32, %c0_i32] %s : !tt.tensordesc<1x128x32xf32, #shared2>, !ttg.memdesc<1x128x32xf32, #shared2, #smem, mutable> loc(#loc3)
          ttg.local_store %y, %v : tensor<128x32xf32, #linear> -> !ttg.memdesc<128x32xf32, #shared2, #smem, mutable> loc(#loc3)
          FENCE_IN
        } {tt.num_stages = 1 : i32} loc(#loc4)
        FENCE_OUT
        scf.for %j = %c0_i32 to %n step %c1_i32  : i32 {
          %v = arith.addf %y, %y : tensor<128x32xf32, #linear> loc(#loc5)
        } loc(#loc5)
        """)
    fence = "ttng.fence_async_shared {bCluster = false} loc(#loc3)"
    assert len(_hz(loop.replace("FENCE_IN", "").replace("FENCE_OUT", fence)).unfenced) == 1
    ok = _hz(loop.replace("FENCE_IN", fence).replace("FENCE_OUT", ""))
    assert ok.unfenced == [] and ok.fenced_generic_reads == 1 and ok.async_reads == 1


def test_a_loop_that_stores_scratch_and_prefetches_across_its_back_edge_is_pipelined():
    """A scratch-storing loop whose body issues a cp.async into a buffer allocated outside it
    (a later iteration's prefetch) is a pipelined scratch loop; with the buffer allocated in
    the loop (its own iteration's copy) it is not; a pipelined loop storing no scratch is
    pipelined but not a hazard."""
    body = textwrap.dedent("""\
        OUTSIDE
        scf.for %i = %c0_i32 to %n step %c1_i32  : i32 {
          INSIDE
          %w = ttg.memdesc_index %buf[%i] : !ttg.memdesc<2x64x32xbf16, #shared, #smem, mutable> -> !ttg.memdesc<64x32xbf16, #shared, #smem, mutable> loc(#loc6)
          %t = ttg.async_copy_global_to_local %ptrs, %w : tensor<64x32x!tt.ptr<bf16>, #blocked> -> <64x32xbf16, #shared, #smem, mutable> loc(#loc6)
          tt.store %sp, %val : tensor<64x32x!tt.ptr<ELEM>, #blocked> loc(#loc7)
        } {tt.num_stages = 1 : i32} loc(#loc8)
        """)
    alloc = "%buf = ttg.local_alloc : () -> !ttg.memdesc<2x64x32xbf16, #shared, #smem, mutable> loc(#loc6)"
    bad = _hz(body.replace("OUTSIDE", alloc).replace("INSIDE", "").replace("ELEM", "bf16"))
    assert bad.pipelined_scratch_loops == [("#loc8", 1)]
    own = _hz(body.replace("OUTSIDE", "").replace("INSIDE", alloc).replace("ELEM", "bf16"))
    assert own.pipelined_scratch_loops == [] and not own.loops[0].pipelined and own.loops[0].scratch
    other = _hz(body.replace("OUTSIDE", alloc).replace("INSIDE", "").replace("ELEM", "f32"))
    assert other.pipelined_scratch_loops == [] and other.loops[0].pipelined and not other.loops[0].scratch


def test_a_pipelined_loops_scratch_prefetch_must_follow_the_phase_barrier():
    """A loop pipelined by its num_stages reads scratch through a prologue cp.async issued
    before it: after the barrier that follows the last scratch store it is fine, without one
    it is an early prefetch (it could read what other threads have not yet stored)."""
    body = textwrap.dedent("""\
        tt.store %sp, %val : tensor<64x32x!tt.ptr<bf16>, #blocked> loc(#loc7)
        BARRIER
        %buf = ttg.local_alloc : () -> !ttg.memdesc<2x64x32xbf16, #shared, #smem, mutable> loc(#loc6)
        %w0 = ttg.memdesc_index %buf[%c0_i32] : !ttg.memdesc<2x64x32xbf16, #shared, #smem, mutable> -> !ttg.memdesc<64x32xbf16, #shared, #smem, mutable> loc(#loc6)
        %t0 = ttg.async_copy_global_to_local %ptrs, %w0 : tensor<64x32x!tt.ptr<bf16>, #blocked> -> <64x32xbf16, #shared, #smem, mutable> loc(#loc6)
        scf.for %i = %c0_i32 to %n step %c1_i32  : i32 {
          %w = ttg.memdesc_index %buf[%i] : !ttg.memdesc<2x64x32xbf16, #shared, #smem, mutable> -> !ttg.memdesc<64x32xbf16, #shared, #smem, mutable> loc(#loc6)
          %t = ttg.async_copy_global_to_local %ptrs, %w : tensor<64x32x!tt.ptr<bf16>, #blocked> -> <64x32xbf16, #shared, #smem, mutable> loc(#loc6)
        } {tt.num_stages = 2 : i32} loc(#loc8)
        """)
    bad = _hz(body.replace("BARRIER", ""))
    assert bad.loops[0].pipelined and not bad.loops[0].scratch and bad.early_prefetches == [("#loc8", 9)]
    assert _hz(body.replace("BARRIER", "ttg.barrier local loc(#loc7)")).early_prefetches == []
