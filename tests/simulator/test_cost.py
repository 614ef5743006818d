"""Cost model (nkilib.simulator.cost): hand-computed instruction costs, scheduler rules on synthetic
traces, shape-only vs numeric traces, and the calibration script on a small subset."""
import json
import math
import os

import pytest

from costkit import chip, hbm, new_id, rec
from simkit import BF16, randn
from nkilib.examples.bf16_matmul import bf16_matmul, predict_bf16_gemm_time
from nkilib.simulator import ShapeSpec, run_kernel
from nkilib.simulator.cost import CostModelError, instr_cost, model_kernel, schedule
from nkilib.simulator.hardware import TRN2, TRN3
from scriptkit import load_script
# ---------------------------------------------------------------------------------------------
# per-instruction costs, hand-computed from spec §6.2 / §8
# ---------------------------------------------------------------------------------------------
def test_matmul_bf16_cost_and_flops():
    r = rec(0, "nc_matmul", "tensor", [chip("stationary", "sbuf", "bfloat16", (128, 128)),
                                       chip("moving", "sbuf", "bfloat16", (128, 512))],
            [chip("dst", "psum", "float32", (128, 512))], K=128, M=128, N=512, in_dtype="bfloat16",
            moving_dtype="bfloat16", perf_mode="none", transpose=False)
    c = instr_cost(r, TRN3)
    assert c.cycles == 512 + 128 / 4  # max(64, N) + LoadStationary M/4
    assert c.seconds == pytest.approx(544 / 2.4e9)
    assert c.flops == 2 * 128 * 128 * 512
    # the ideal BF16 rate of this instruction is 79 TFLOPS x 512/544
    assert c.flops / c.seconds == pytest.approx(2 * 128 * 128 * 2.4e9 * 512 / 544)


def test_matmul_small_n_floor_and_fp32_factor():
    small = rec(0, "nc_matmul", "tensor", [chip("stationary", "sbuf", "bfloat16", (128, 64)),
                                           chip("moving", "sbuf", "bfloat16", (128, 32))],
                [chip("dst", "psum", "float32", (64, 32))], K=128, M=64, N=32, in_dtype="bfloat16",
                moving_dtype="bfloat16")
    assert instr_cost(small, TRN3).cycles == 64 + 16  # MM_INIT floor 64 + 64/4
    fp32 = rec(0, "nc_matmul", "tensor", [chip("stationary", "sbuf", "float32", (128, 128)),
                                          chip("moving", "sbuf", "float32", (128, 256))],
               [chip("dst", "psum", "float32", (128, 256))], K=128, M=128, N=256, in_dtype="float32",
               moving_dtype="float32")
    assert instr_cost(fp32, TRN3).cycles == 4 * (256 + 32)


def test_transpose_matmul_has_no_model_flops():
    r = rec(0, "nc_matmul", "tensor", [chip("stationary", "sbuf", "bfloat16", (128, 128)),
                                       chip("moving", "sbuf", "bfloat16", (128, 128))],
            [chip("dst", "psum", "bfloat16", (128, 128))], K=128, M=128, N=128, transpose=True)
    c = instr_cost(r, TRN3)
    assert c.flops == 0 and c.cycles == 128 + 32


def test_vector_copy_costs_and_perf_modes():
    evict = rec(0, "tensor_copy", "vector", [chip("src", "psum", "float32", (128, 512))],
                [chip("dst", "sbuf", "bfloat16", (128, 512))])
    c = instr_cost(evict, TRN3)
    assert c.cycles == 60 + 512  # access overhead + N (fp32 source: no fast mode)
    assert c.seconds == pytest.approx(572 / 1.2e9)
    fast = rec(0, "tensor_copy", "vector", [chip("src", "sbuf", "bfloat16", (128, 512))],
               [chip("dst", "sbuf", "bfloat16", (128, 512))])
    assert instr_cost(fast, TRN3).cycles == 60 + 512 / 4  # 4x BF16 SBUF->SBUF mode
    tiny = rec(0, "tensor_copy", "vector", [chip("src", "sbuf", "bfloat16", (128, 64))],
               [chip("dst", "sbuf", "bfloat16", (128, 64))])
    assert instr_cost(tiny, TRN3).cycles == 60 + 64  # MIN_II floor
    bf16_psum = rec(0, "tensor_copy", "vector", [chip("src", "psum", "bfloat16", (128, 512))],
                    [chip("dst", "sbuf", "bfloat16", (128, 512))])
    assert instr_cost(bf16_psum, TRN3).cycles == 60 + 256  # 2x with one PSUM side
    # trn2 VectorE runs at 0.96 GHz
    assert instr_cost(evict, TRN2).seconds == pytest.approx(572 / 0.96e9)
    scalar = rec(0, "tensor_copy", "scalar", [chip("src", "sbuf", "bfloat16", (128, 512))],
                 [chip("dst", "sbuf", "bfloat16", (128, 512))])
    assert instr_cost(scalar, TRN3).cycles == 60 + 256  # NC-v4 ScalarE 2x BF16 mode
    assert instr_cost(scalar, TRN2).cycles == 60 + 512  # not on NC-v3


def test_other_documented_formulas():
    mem = rec(0, "memset", "vector", writes=[chip("dst", "sbuf", "bfloat16", (128, 1024))])
    assert instr_cost(mem, TRN3).cycles == 60 + 512  # zero into bf16: N/2
    iota = rec(0, "iota", "gpsimd", writes=[chip("dst", "sbuf", "float32", (128, 100))])
    assert instr_cost(iota, TRN3).cycles == 150 + 100  # GPSIMD_START + N
    tt = rec(0, "tensor_tensor", "vector", [chip("data1", "sbuf", "float32", (128, 256)),
                                            chip("data2", "sbuf", "float32", (128, 256))],
             [chip("dst", "sbuf", "float32", (128, 256))], op="multiply")
    assert instr_cost(tt, TRN3).cycles == 60 + 2 * 256  # two SBUF fp32 inputs: 2N
    tt_psum = rec(0, "tensor_tensor", "vector", [chip("data1", "psum", "float32", (128, 256)),
                                                 chip("data2", "sbuf", "float32", (128, 256))],
                  [chip("dst", "sbuf", "float32", (128, 256))], op="multiply")
    assert instr_cost(tt_psum, TRN3).cycles == 60 + 256  # one PSUM + one SBUF input: N
    q = rec(0, "quantize_mx", "vector", [chip("src", "sbuf", "bfloat16", (128, 2048))],
            [chip("dst", "sbuf", "bfloat16", (128, 512))])
    assert instr_cost(q, TRN3).cycles == 60 + 2048 / 4  # 4 elements / partition / cycle
    act = rec(0, "activation_reduce", "scalar", [chip("data", "psum", "float32", (128, 512))],
              [chip("dst", "sbuf", "bfloat16", (128, 512)), chip("reduce_res", "sbuf", "float32", (128, 1))])
    assert instr_cost(act, TRN3).cycles == 60 + 512 + 64  # + MIN_II for the reduction
    tr = rec(0, "nc_transpose", "tensor", [chip("data", "sbuf", "bfloat16", (128, 96))],
             [chip("dst", "psum", "bfloat16", (96, 128))])
    assert instr_cost(tr, TRN3).cycles == 128 + 96 / 4  # max(P, min(64, F)) + LoadStationary of the F=96 columns


def test_dma_rate_from_payload():
    w4k = instr_cost(rec(0, "dma_copy", "dma", [hbm("src", "bfloat16", (128, 2048), 8192)],
                         [chip("dst", "sbuf", "bfloat16", (128, 2048))]), TRN3).dma
    assert w4k.payload == 4096 and w4k.engines == 16
    assert w4k.rate_per_engine == pytest.approx(33e9)  # >= 4 KiB: sustained rate [DMABW]
    w1k = instr_cost(rec(0, "dma_copy", "dma", [hbm("src", "bfloat16", (128, 512), 8192)],
                         [chip("dst", "sbuf", "bfloat16", (128, 512))]), TRN3).dma
    p0 = 4096 * (38.4 / 33 - 1)  # per-descriptor overhead that makes 4 KiB reach 33 B/ns
    assert w1k.payload == 1024
    assert w1k.rate_per_engine == pytest.approx(38.4e9 * 1024 / (1024 + p0))
    assert w1k.hbm_bytes == 128 * 512 * 2
    w16 = instr_cost(rec(0, "dma_copy", "dma", [hbm("src", "bfloat16", (16, 512), 8192)],
                         [chip("dst", "sbuf", "bfloat16", (16, 512))]), TRN3).dma
    assert w16.engines == 2  # ~8 partitions per DMA engine


def test_unknown_instruction_is_a_clear_error():
    with pytest.raises(CostModelError, match="no cost formula for instruction 'frobnicate'"):
        instr_cost(rec(0, "frobnicate", "vector", writes=[chip("dst", "sbuf", "float32", (128, 8))]), TRN3)


# ---------------------------------------------------------------------------------------------
# scheduler on synthetic traces
# ---------------------------------------------------------------------------------------------
def _mm(seq, st, mv, dst, program=0):
    return rec(seq, "nc_matmul", "tensor", [st, mv], [dst], program=program, K=128, M=128, N=512,
               in_dtype="bfloat16", moving_dtype="bfloat16")


MM_S = 544 / 2.4e9
COPY_S = 572 / 1.2e9  # fp32 PSUM [128, 512] -> SBUF on VectorE/ScalarE
HOP_S = 100 / 1.2e9  # semaphore hop to a 1.2 GHz engine waiting on another engine (ESTIMATE, hardware.py)
DGE_S = 600e-9  # hardware DGE time per DMA instruction [TRN2]


def test_independent_engines_overlap():
    a = chip("stationary", "sbuf", "bfloat16", (128, 128))
    b = chip("moving", "sbuf", "bfloat16", (128, 512))
    t = [_mm(0, a, b, chip("dst", "psum", "float32", (128, 512))),
         rec(1, "tensor_copy", "vector", [chip("src", "psum", "float32", (128, 512))],
             [chip("dst", "sbuf", "bfloat16", (128, 512))])]
    s = schedule(t, TRN3, 1)
    assert s.start == [0.0, 0.0]
    assert s.makespan == pytest.approx(max(MM_S, COPY_S))


def test_raw_dependency_serialises_and_disjoint_regions_do_not():
    acc = new_id()
    a = chip("stationary", "sbuf", "bfloat16", (128, 128))
    b = chip("moving", "sbuf", "bfloat16", (128, 512))
    t = [_mm(0, a, b, chip("dst", "psum", "float32", (128, 512), sid=acc)),
         rec(1, "tensor_copy", "vector", [chip("src", "psum", "float32", (128, 512), sid=acc)],
             [chip("dst", "sbuf", "bfloat16", (128, 512))]),
         # reads bytes of the same PSUM storage that the matmul does not write: no dependency
         rec(2, "tensor_copy", "scalar", [chip("src", "psum", "float32", (128, 16), sid=acc, f0=4096)],
             [chip("dst", "sbuf", "bfloat16", (128, 16))])]
    s = schedule(t, TRN3, 1)
    assert s.start[1] == pytest.approx(MM_S + HOP_S)  # TensorE -> VectorE: one semaphore hop
    assert s.blocker[1] == 0
    assert s.start[2] == 0.0
    assert s.makespan == pytest.approx(MM_S + HOP_S + COPY_S)


def test_war_and_waw_dependencies():
    x = new_id()
    t = [rec(0, "tensor_copy", "vector", [chip("src", "sbuf", "float32", (128, 512), sid=x)],
             [chip("dst", "sbuf", "bfloat16", (128, 512))]),
         # WAR: ScalarE overwrites what VectorE is reading
         rec(1, "tensor_copy", "scalar", [chip("src", "psum", "float32", (128, 512))],
             [chip("dst", "sbuf", "float32", (128, 512), sid=x)]),
         # WAW: GpSimd writes the same bytes again
         rec(2, "memset", "gpsimd", writes=[chip("dst", "sbuf", "float32", (128, 512), sid=x)])]
    s = schedule(t, TRN3, 1)
    assert s.start[1] == pytest.approx(s.end[0] + HOP_S)
    assert s.start[2] == pytest.approx(s.end[1] + HOP_S)


def test_strided_hbm_tiles_of_one_matrix_are_independent():
    c = new_id()
    t = [rec(i, "dma_copy", "dma", [chip("src", "sbuf", "bfloat16", (128, 512))],
             [hbm("dst", "bfloat16", (128, 512), 4096, r0=0, c0=512 * i, sid=c)]) for i in range(2)]
    s = schedule(t, TRN3, 1)
    assert s.start[0] == s.start[1] == pytest.approx(DGE_S)  # disjoint column blocks: no WAW; 2 DGE instances
    t2 = [rec(i, "dma_copy", "dma", [chip("src", "sbuf", "bfloat16", (128, 512))],
              [hbm("dst", "bfloat16", (128, 512), 4096, r0=64 * i, c0=0, sid=c + 1)]) for i in range(2)]
    s2 = schedule(t2, TRN3, 1)
    assert s2.start[1] == pytest.approx(s2.end[0] + DGE_S)  # overlapping rows: WAW serialises


def test_concurrent_dmas_share_bandwidth():
    def load(i):
        return rec(i, "dma_copy", "dma", [hbm("src", "bfloat16", (128, 2048), 2048)],
                   [chip("dst", "sbuf", "bfloat16", (128, 2048))])
    nbytes = 128 * 2048 * 2
    one = schedule([load(0)], TRN3, 1)
    assert one.makespan == pytest.approx(DGE_S + 1.3e-6 + nbytes / 528e9)  # DGE + latency + bytes / (16 x 33 GB/s)
    two = schedule([load(0), load(1)], TRN3, 1)
    assert two.makespan == pytest.approx(DGE_S + 1.3e-6 + 2 * nbytes / 528e9)  # both in flight, half the rate each


def test_barrier_synchronises_two_programs():
    long_op = rec(0, "tensor_copy", "vector", [chip("src", "sbuf", "float32", (128, 8192))],
                  [chip("dst", "sbuf", "float32", (128, 8192))], program=0)
    t = [long_op,
         rec(1, "core_barrier", "gpsimd", program=0, barrier=True),
         rec(2, "core_barrier", "gpsimd", program=1, barrier=True),
         rec(3, "tensor_copy", "vector", [chip("src", "sbuf", "float32", (128, 64))],
             [chip("dst", "sbuf", "float32", (128, 64))], program=1)]
    s = schedule(t, TRN3, 2)
    long_s = (60 + 8192) / 1.2e9
    assert s.end[0] == pytest.approx(long_s)
    assert s.end[1] == s.end[2] == pytest.approx(long_s + TRN3.barrier_latency_s)
    assert s.start[3] == pytest.approx(s.end[2])  # program 1 waited for program 0's work


# ---------------------------------------------------------------------------------------------
# shape-only mode, kernel-level model, calibration
# ---------------------------------------------------------------------------------------------
def _trace_key(trace):
    return [(r.program, r.instr, r.engine, tuple((o.arg, o.buffer, o.dtype, tuple(o.shape)) for o in r.reads),
             tuple((o.arg, o.buffer, o.dtype, tuple(o.shape)) for o in r.writes)) for r in trace]


@pytest.mark.parametrize("lnc", [1, 2])
def test_shape_only_trace_equals_numeric_trace(lnc):
    a_t = randn(1, (200, 160), BF16)
    b = randn(2, (200, 600), BF16)
    num = run_kernel(bf16_matmul, (a_t, b), lnc=lnc, trace=True, numerics=True)
    shp = run_kernel(bf16_matmul, (ShapeSpec(a_t.shape, BF16), ShapeSpec(b.shape, BF16)), lnc=lnc, trace=True,
                     numerics=False)
    assert shp.outputs is None and num.outputs is not None
    assert len(num.trace) > 10
    assert _trace_key(num.trace) == _trace_key(shp.trace)
    assert schedule(num.trace, TRN3, lnc).makespan == pytest.approx(schedule(shp.trace, TRN3, lnc).makespan)


def test_model_kernel_report(tmp_path):
    M, K, N = 256, 256, 1024
    r = model_kernel(bf16_matmul, (ShapeSpec((K, M), BF16), ShapeSpec((K, N), BF16)), lnc=2,
                     model_flops=2 * M * K * N)
    j = r.to_json()
    assert j["modeled_time_s"] == pytest.approx(j["makespan_s"] + TRN3.kernel_launch_overhead_s)
    # TensorE busy time per core is the hand-computed sum of its matmuls: (M/128/2) x (N/512) x (K/128)
    assert j["engines"]["0"]["tensor"]["busy_s"] == pytest.approx(1 * 2 * 2 * MM_S)
    assert j["mfu"] == pytest.approx(2 * M * K * N / (j["modeled_time_s"] * 2 * 2 * 128 * 128 * 2.4e9))
    # LNC2 splits the 2 M tiles: each core reads its half of A, all of B, writes its half of C
    assert j["hbm_bytes"] == 2 * (M * K + 2 * K * N + M * N)
    assert 0 < j["memory_peak_bytes_per_partition"][0]["sbuf"] <= TRN3.sbuf_bytes_per_partition
    assert "TensorE MFU" in r.table()
    paths = r.plot(tmp_path)
    assert len(paths) == 3 and all(os.path.getsize(p) > 1000 for p in paths)


def test_predict_bf16_gemm_time_scales_with_work():
    small = predict_bf16_gemm_time(512, 512, 512)
    big = predict_bf16_gemm_time(2048, 2048, 2048)
    assert math.isfinite(small) and small > TRN3.kernel_launch_overhead_s
    flop_time = 2 * 2048 ** 3 / (2 * 2 * 128 * 128 * 2.4e9)  # ideal BF16 time on 2 cores
    assert flop_time < big < 1.3 * flop_time + TRN3.kernel_launch_overhead_s


def _load_calibration_module():
    return load_script("calibrate_bf16_gemm")


def test_calibration_script_runs_on_a_subset(tmp_path, capsys):
    mod = _load_calibration_module()
    assert os.path.exists(mod.DEFAULT_DATA), f"measured GEMM data missing: {mod.DEFAULT_DATA}"
    summary, rows = mod.main(["--subset", "3", "--max-flops", "3e9", "--out", str(tmp_path), "--quiet"])
    assert len(rows) == 3 and summary["shapes"] == 3
    for r in rows:
        assert math.isfinite(r["predicted_s"]) and r["predicted_s"] > r["makespan_s"] > 0
        assert r["measured_s"] > 0
    assert math.isfinite(summary["median_abs_error_pct"]) and summary["median_abs_error_pct"] >= 0
    assert summary["fit_set"]["shapes"] + summary["holdout"]["shapes"] == 3
    assert all(r["predicted_pessimistic_s"] >= r["predicted_s"] for r in rows)  # the band's ends are ordered
    with open(os.path.join(tmp_path, "calibrate_bf16_gemm.json")) as f:
        assert len(json.load(f)["shapes"]) == 3
    assert "median |error|" in capsys.readouterr().out


# ---- finite on-chip memory: reuse of freed SBUF orders accesses (cost._memory_reuse_deps) ----
def _two_tile_kernel(free_elems):
    import nki.isa as nisa
    import nki.language as nl

    def kernel(a):
        out = nl.ndarray((2, 128, free_elems), dtype=nl.float32, buffer=nl.shared_hbm)
        for i in range(2):
            t = nl.ndarray((128, free_elems), dtype=nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(dst=t, src=a)
            nisa.dma_copy(dst=out[i], src=t)
            del t  # the next tile may reuse its memory
        return out

    return kernel


@pytest.mark.parametrize("kib, overlaps", [(140, False), (60, True)])
def test_freed_sbuf_reuse_serialises_only_when_two_tiles_do_not_fit(kib, overlaps):
    """trn3 has 256 KiB per partition: two 140 KiB tiles cannot coexist, so the second tile's load
    must wait for the first tile's store; two 60 KiB tiles fit side by side and may overlap."""
    from nkilib.simulator import ShapeSpec, run_kernel
    from nkilib.simulator.cost import schedule

    free = kib * 1024 // 4
    res = run_kernel(_two_tile_kernel(free), (ShapeSpec((128, free), "float32"),), lnc=1, trace=True, numerics=False)
    sched = schedule(res.trace, "trn3", 1)
    load1, store1, load2, store2 = range(4)
    assert [r.instr for r in res.trace] == ["dma_copy"] * 4
    if overlaps:
        assert sched.start[load2] < sched.end[store1]
    else:
        assert sched.start[load2] >= sched.end[store1]


def test_freed_sbuf_reuse_orders_every_access_of_the_new_tile():
    """The second tile (140 KiB, must reuse the first one's bytes) is filled by two DMAs into disjoint
    halves: no data dependency links them, so both -- not only the first in program order -- must wait
    for the first tile's store (the MoE kernel fills panels this way; before, the second DMA overlapped)."""
    import nki.isa as nisa
    import nki.language as nl
    from nkilib.simulator import ShapeSpec, run_kernel
    from nkilib.simulator.cost import schedule

    free = 140 * 1024 // 4
    half = free // 2

    def kernel(a):
        out = nl.ndarray((2, 128, free), dtype=nl.float32, buffer=nl.shared_hbm)
        t = nl.ndarray((128, free), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=a)
        nisa.dma_copy(dst=out[0], src=t)
        del t
        u = nl.ndarray((128, free), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=u[:, :half], src=a[:, :half])
        nisa.dma_copy(dst=u[:, half:], src=a[:, half:])
        nisa.dma_copy(dst=out[1], src=u)
        return out

    res = run_kernel(kernel, (ShapeSpec((128, free), "float32"),), lnc=1, trace=True, numerics=False)
    sched = schedule(res.trace, "trn3", 1)
    load1, store1, fill_a, fill_b, store2 = range(5)
    assert [r.instr for r in res.trace] == ["dma_copy"] * 5
    assert sched.start[fill_a] >= sched.end[store1] and sched.start[fill_b] >= sched.end[store1]


def test_two_four_bank_psum_accumulators_fit_wherever_next_fit_left_its_cursor():
    """PSUM has 8 banks of 2 KiB per partition. A 3-bank tile, dead before the next two, leaves next-fit's cursor at
    bank 3; then two 4-bank tiles live together (phase 4's accumulators at N = 1792 fp32, the refused 4608 x 4096 x
    1792 of docs/dense-performance.md round 50b). Placed at bank 3 the first leaves no four banks in a row for the
    second (main: a plan error); a PSUM tile of 2, 4 or 8 banks starts at a multiple of its bank count, so they take
    banks 4-7 and 0-3 (the 3-bank tile is placed next-fit, at bank 0)."""
    import nki.isa as nisa
    import nki.language as nl
    from nkilib.simulator.cost.allocator import _memory_reuse_deps

    bank = TRN3.psum_bank_bytes
    wide = 4 * bank // 4  # fp32 elements of a 4-bank tile

    def kernel(a):
        out = nl.ndarray((128, wide), dtype=nl.float32, buffer=nl.shared_hbm)
        s = nl.ndarray((128, wide), dtype=nl.float32, buffer=nl.sbuf)
        p = nl.ndarray((128, 3 * bank // 4), dtype=nl.float32, buffer=nl.psum)
        nisa.memset(dst=p, value=0.0, engine=nisa.vector_engine)
        nisa.tensor_copy(dst=s[:, :3 * bank // 4], src=p)
        del p
        acc0 = nl.ndarray((128, wide), dtype=nl.float32, buffer=nl.psum)
        acc1 = nl.ndarray((128, wide), dtype=nl.float32, buffer=nl.psum)
        nisa.memset(dst=acc0, value=0.0, engine=nisa.vector_engine)
        nisa.memset(dst=acc1, value=0.0, engine=nisa.vector_engine)
        s1 = nl.ndarray((128, wide), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=s1, src=acc1)
        nisa.tensor_tensor(dst=s, data1=acc0, data2=s1, op=nl.add)  # acc0 read last: both live together
        nisa.dma_copy(dst=out, src=s)
        return out

    res = run_kernel(kernel, (ShapeSpec((128, wide), "float32"),), lnc=1, trace=True, numerics=False)
    sched = schedule(res.trace, "trn3", 1)
    assert sched.unplaceable == [], [u.message() for u in sched.unplaceable]
    placements = {}
    _memory_reuse_deps(sched.records, TRN3, placements=placements)
    banks = sorted((lo // bank, hi // bank) for key, (lo, hi, _) in
                   ((k, v) for k, v in placements.items() if k != "fragmented") if key[1] == "psum")
    assert banks == [(0, 3), (0, 4), (4, 8)], banks  # the 3-bank tile at 0, the accumulators at 4 and 0
    assert "fragmented" not in placements


def _elementwise(instr, engine, n, dtype="float32", **attrs):
    return rec(0, instr, engine, [chip("data", "sbuf", dtype, (128, n))], [chip("dst", "sbuf", dtype, (128, n))],
               **attrs)


@pytest.mark.parametrize("record, cycles", [
    # [LEGACY] formulas + the 60-cycle access overhead [TRN1]; N = 256 elements per partition
    (_elementwise("tensor_scalar", "vector", 256), 60 + 256),  # fp32: no perf mode
    (_elementwise("tensor_scalar_reduce", "vector", 256), 60 + 256 + 64),  # max(MIN_II, N) + MIN_II
    (_elementwise("tensor_tensor_scan", "vector", 256), 60 + 512),  # max(MIN_II, 2N)
    (_elementwise("bn_stats", "vector", 256), 60 + 256),
    (_elementwise("bn_aggr", "vector", 48), 60 + 13 * 48 / 3),  # max(MIN_II, 13 N / 3)
    (_elementwise("max8", "vector", 256), 60 + 256),  # N, no MIN_II floor
    (_elementwise("nc_find_index8", "vector", 32), 60 + 32),
    (_elementwise("tensor_reduce", "vector", 256, dtype="bfloat16", op="add"), 60 + 128),  # bf16 add: N/2
    (_elementwise("tensor_reduce", "vector", 256, op="add"), 60 + 256),
    (_elementwise("reciprocal", "vector", 256), 60 + 8 * 256),  # Vector: max(MIN_II, 8N)
    (_elementwise("reciprocal", "scalar", 256), 60 + 256),
    (_elementwise("exponential", "vector", 256), 60 + 64),  # 4x ScalarE exp [TRN3]: N/4, MIN_II floor
    (_elementwise("activation", "scalar", 512), 60 + 512),
    (_elementwise("affine_select", "gpsimd", 100), 150 + 100),  # GPSIMD_START + N, no access overhead
])
def test_documented_formula_of_each_instruction(record, cycles):
    assert instr_cost(record, TRN3).cycles == pytest.approx(cycles)


def test_scalar_tensor_tensor_reduce_priced_as_tensor_tensor_plus_the_reduce_band():
    """The NKI 0.7 reduce variant: tensor_tensor's [LEGACY] formula ("approximately the same latency as a regular
    tensor_tensor", the 2.33 page) + MIN_II (central) or + a separate reduce pass, N + the access overhead
    (pessimistic: the docs give no figure)."""
    from nkilib.simulator.hardware import with_scenario

    def stt(data_buffer, reduce):
        extra = dict(reduce_op="add", reduce_cmd="reset_reduce") if reduce else {}
        return rec(0, "scalar_tensor_tensor", "vector",
                   [chip("data", data_buffer, "float32", (128, 512)), chip("operand1", "sbuf", "bfloat16", (128, 512))],
                   [chip("dst", "sbuf", "float32", (128, 512))]
                   + ([chip("reduce_res", "sbuf", "float32", (128, 1))] if reduce else []),
                   op0="multiply", op1="multiply", **extra)

    pess = with_scenario(TRN3, "pessimistic")
    # the routing gradient's (dI * 1.0) * h, dI in PSUM: tensor_tensor with one PSUM input is N
    assert instr_cost(stt("psum", True), TRN3).cycles == 60 + 512 + 64
    assert instr_cost(stt("psum", True), pess).cycles == 60 + 512 + 512 + 60  # = tensor_tensor + tensor_reduce
    assert instr_cost(stt("psum", True), TRN3).seconds == pytest.approx((60 + 512 + 64) / 1.2e9)
    # both inputs in SBUF, not all bf16: tensor_tensor's 2N
    assert instr_cost(stt("sbuf", True), TRN3).cycles == 60 + 1024 + 64
    # without reduce_op the [LEGACY] scalar_tensor_tensor formula is unchanged at both ends (2N here)
    assert instr_cost(stt("psum", False), TRN3).cycles == instr_cost(stt("psum", False), pess).cycles == 60 + 1024


def test_scalar_tensor_tensor_fast_case_and_barrier_latency():
    def stt(dtype, op0, n):
        return rec(0, "scalar_tensor_tensor", "vector",
                   [chip("data", "sbuf", dtype, (128, n)), chip("operand1", "sbuf", dtype, (128, n))],
                   [chip("dst", "sbuf", dtype, (128, n))], op0=op0, op1="multiply")
    assert instr_cost(stt("bfloat16", "subtract", 256), TRN3).cycles == 60 + 256  # bf16 sub/mul, N even: N
    assert instr_cost(stt("float32", "subtract", 256), TRN3).cycles == 60 + 512  # else 2N
    barrier = instr_cost(rec(0, "core_barrier", "gpsimd", barrier=True), TRN3)
    assert barrier.kind == "barrier" and barrier.seconds == pytest.approx(1.3e-6)
