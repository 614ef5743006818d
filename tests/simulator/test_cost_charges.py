"""Cost model charges that keep it from flattering a kernel (issue 13) and the pricing of indirect /
read-modify-write DMA, dynamic loops and registers: each checked against a hand computation from the
documented figure or the labelled estimate in nkilib/simulator/hardware.py, on hand-built records."""
import pytest

from costkit import chip, chip_view, hbm, new_id, rec
from nkilib.simulator.cost import CostReport, instr_cost, schedule
from nkilib.simulator.hardware import TRN2, TRN3, with_scenario
from scriptkit import load_script

PESS = with_scenario(TRN3, "pessimistic")
DGE_S = 600e-9  # hardware DGE per DMA instruction, "about 600 ns" [TRN2]
LAT_S = 1.3e-6  # DMA semaphore-to-start latency [DMA]


# ---- TensorE ----
def test_nc_matmul_mx_cost_is_max_64_n_plus_stationary_load():
    """K=128 partitions of x4 words (512 contraction), M=128, N=512: max(64, 512) + 128/4 cycles at 2.4 GHz."""
    r = rec(0, "nc_matmul_mx", "tensor",
            [chip("stationary", "sbuf", "float8_e4m3fn_x4", (128, 128)),
             chip("moving", "sbuf", "float8_e4m3fn_x4", (128, 512))],
            [chip("dst", "psum", "float32", (128, 512))])
    c = instr_cost(r, TRN3)
    assert c.cycles == 512 + 32
    assert c.seconds == pytest.approx(544 / 2.4e9)
    assert c.flops == 2 * 512 * 128 * 512  # K=512 (4 per x4 word), M=128, N=512
    small = rec(0, "nc_matmul_mx", "tensor",
                [chip("stationary", "sbuf", "float8_e4m3fn_x4", (32, 64)),
                 chip("moving", "sbuf", "float8_e4m3fn_x4", (32, 16))],
                [chip("dst", "psum", "float32", (64, 16))])
    assert instr_cost(small, TRN3).cycles == 64 + 16  # MM_INIT floor + 64/4


def test_pe_transpose_loads_its_data_as_stationary():
    """nc_transpose on TensorE = nc_matmul(data, identity) [TRN1]: MM of P columns + LoadStationary F/4."""
    r = rec(0, "nc_transpose", "tensor", [chip("data", "sbuf", "bfloat16", (128, 128))],
            [chip("dst", "psum", "bfloat16", (128, 128))])
    assert instr_cost(r, TRN3).cycles == 128 + 32
    assert instr_cost(r, TRN3).flops == 0


# ---- VectorE: quantize_mx by access pattern ----
def _quantize(src):
    dst = chip_view("dst", "float8_e4m3fn_x4", (128, 1024), (1024, 1))
    return rec(0, "quantize_mx", "vector", [src], [dst, chip("dst_scale", "sbuf", "uint8", (4, 1024))])


def test_quantize_mx_contiguous_source_runs_4_per_cycle():
    src = chip_view("src", "bfloat16", (128, 1024, 4), (4096, 4, 1))  # the 4 packed elements adjacent
    assert instr_cost(_quantize(src), TRN3).cycles == 60 + 4096 / 4
    assert instr_cost(_quantize(src), PESS).cycles == 60 + 4096 / 4


def test_quantize_mx_strided_source_runs_slower():
    """The 4 packed elements taken from 4 rows (most-minor stride 1024 elements = 2 KiB): VectorE's 2x mode
    [TRN2] at the central estimate; also halved by the > 16 B stride rule [TRN1] at the pessimistic end."""
    src = chip_view("src", "bfloat16", (128, 1024, 4), (4096, 1, 1024))
    assert instr_cost(_quantize(src), TRN3).cycles == 60 + 4096 / 2
    assert instr_cost(_quantize(src), PESS).cycles == 60 + 4096 / 1


# ---- DMA descriptor generation ----
def _load(seq, cols=2048, **attrs):
    return rec(seq, "dma_copy", "dma", [hbm("src", "bfloat16", (128, cols), cols)],
               [chip("dst", "sbuf", "bfloat16", (128, cols))], **attrs)


def test_hardware_dge_adds_600ns_per_dma_and_two_instances_serve_a_core():
    nbytes = 128 * 2048 * 2
    s = schedule([_load(0, dge_mode="hwdge")], TRN3, 1)
    assert s.makespan == pytest.approx(DGE_S + LAT_S + nbytes / 528e9)
    s3 = schedule([_load(i) for i in range(3)], TRN3, 1)  # dge_mode absent/unknown: the compiler's hwdge
    assert s3.start[:2] == [pytest.approx(DGE_S)] * 2 and s3.start[2] == pytest.approx(2 * DGE_S)
    static = schedule([_load(0, dge_mode="none")], TRN3, 1)
    assert static.makespan == pytest.approx(LAT_S + nbytes / 528e9)  # host-built descriptors


def test_pessimistic_end_moves_dma_at_90_percent_of_the_documented_rate():
    nbytes = 128 * 2048 * 2
    s = schedule([_load(0)], PESS, 1)
    assert s.makespan == pytest.approx(DGE_S + LAT_S + nbytes / (0.9 * 528e9))


def test_dma_transpose_at_documented_fraction_of_dma_throughput():
    """"up to 90%" from HBM, "up to 50%" SBUF->SBUF [TRN2], of each engine's sustained 33 B/ns."""
    t_hbm = rec(0, "dma_transpose", "dma", [hbm("src", "bfloat16", (512, 128), 128)],
                [chip("dst", "sbuf", "bfloat16", (128, 512))])
    t_sb = rec(0, "dma_transpose", "dma", [chip("src", "sbuf", "bfloat16", (128, 128))],
               [chip("dst", "sbuf", "bfloat16", (128, 128))])
    assert instr_cost(t_hbm, TRN3).dma.rate_per_engine == pytest.approx(0.9 * 33e9)
    assert instr_cost(t_sb, TRN3).dma.rate_per_engine == pytest.approx(0.5 * 33e9)


# ---- semaphores and the shared SBUF bus ----
def test_cross_engine_hop_costs_a_semaphore_wait_at_both_ends_of_the_band():
    x = new_id()
    t = [rec(0, "tensor_copy", "vector", [chip("src", "psum", "float32", (128, 512))],
             [chip("dst", "sbuf", "float32", (128, 512), sid=x)]),
         rec(1, "tensor_copy", "scalar", [chip("src", "sbuf", "float32", (128, 512), sid=x)],
             [chip("dst", "sbuf", "float32", (128, 512))]),
         rec(2, "tensor_copy", "scalar", [chip("src", "sbuf", "float32", (128, 512), sid=x)],
             [chip("dst", "sbuf", "float32", (128, 512))])]
    s = schedule(t, TRN3, 1)
    assert s.start[1] == pytest.approx(s.end[0] + 100 / 1.2e9)
    assert s.start[2] == pytest.approx(s.end[1])  # same engine: in order, no semaphore
    assert schedule(t, PESS, 1).start[1] == pytest.approx(s.end[0] + 200 / 1.2e9)


def test_vector_perf_mode_and_gpsimd_share_the_sbuf_bus_only_at_the_pessimistic_end():
    fast_copy = rec(0, "tensor_copy", "vector", [chip("src", "sbuf", "bfloat16", (128, 4096))],
                    [chip("dst", "sbuf", "bfloat16", (128, 4096))])  # 4x mode [TRN2]
    iota = rec(1, "iota", "gpsimd", writes=[chip("dst", "sbuf", "float32", (128, 512))])
    central = schedule([fast_copy, iota], TRN3, 1)
    assert central.start == [0.0, 0.0]
    pess = schedule([fast_copy, iota], PESS, 1)
    assert pess.start[1] == pytest.approx(pess.end[0]) and pess.end[0] == pytest.approx((60 + 1024) / 1.2e9)


# ---- indirect, read-modify-write DMA; dynamic loops; registers ----
def test_indirect_dma_builds_descriptors_on_gpsimd():
    """swdge: GPSIMD_START 150 + 32 cycles per descriptor (ESTIMATE) on GpSimd, in its program order."""
    gather = rec(0, "dma_copy", "dma", [hbm("src", "bfloat16", (128, 512), 512)],
                 [chip("dst", "sbuf", "bfloat16", (128, 512))], indirect=True, dge_mode="swdge", descriptors=128,
                 rows=128, bytes=128 * 1024)
    w = instr_cost(gather, TRN3).dma
    assert w.dge == "sw" and w.payload == 1024 and w.descriptors == 128
    assert w.dge_seconds == pytest.approx((150 + 128 * 32) / 1.2e9)
    iota = rec(1, "iota", "gpsimd", writes=[chip("dst", "sbuf", "float32", (128, 64))])
    s = schedule([gather, iota], TRN3, 1)
    assert s.start[1] == pytest.approx(w.dge_seconds)  # GpSimd first built the gather's descriptors
    assert s.start[0] == pytest.approx(w.dge_seconds)  # then the transfer took a DMA queue
    assert s.makespan == pytest.approx(w.dge_seconds + LAT_S + 128 * 1024 / w.max_rate)


def test_indirect_dma_with_every_row_skipped_moves_nothing():
    """A gather whose rows are all padding (oob_mode.skip) records bytes=0 and descriptors=0: it costs
    GPSIMD_START and one descriptor, not the full tile at the index tile's 4-byte payload."""
    gather = rec(0, "dma_copy", "dma", [hbm("src", "bfloat16", (128, 1024), 1024)],
                 [chip("dst", "sbuf", "bfloat16", (128, 1024))], indirect=True, dge_mode="swdge", descriptors=0,
                 rows=0, bytes=0)
    w = instr_cost(gather, TRN3).dma
    assert w.nbytes == 0 and w.descriptors == 1
    assert w.dge_seconds == pytest.approx((150 + 32) / 1.2e9)


def test_indirect_attrs_absent_price_as_a_plain_dma():
    plain = instr_cost(_load(0), TRN3).dma
    assert plain.dge == "hw" and plain.descriptors == 0 and plain.dge_seconds == pytest.approx(DGE_S)


def test_rmw_dma_charges_read_and_write_of_the_destination():
    n = 128 * 512 * 2
    into_hbm = rec(0, "dma_compute", "dma", [chip("src", "sbuf", "bfloat16", (128, 512))],
                   [hbm("dst", "bfloat16", (128, 512), 512)], rmw=True, bytes=n)
    w = instr_cost(into_hbm, TRN3).dma
    assert w.nbytes == 2 * n and w.hbm_bytes == 2 * n  # rows read, added, written back
    into_sbuf = rec(0, "dma_compute", "dma", [hbm("src", "bfloat16", (128, 512), 512)],
                    [chip("dst", "sbuf", "bfloat16", (128, 512))], rmw=True, bytes=n)
    assert instr_cost(into_sbuf, TRN3).dma.nbytes == n  # NC-v4 adds near SBUF at full DMA rate [TRN3]
    assert instr_cost(into_sbuf, TRN2).dma.nbytes == 2 * n
    assert instr_cost(into_sbuf, TRN3).dma.hbm_bytes == n  # the source read


def test_dynamic_loop_charges_each_iteration_taken():
    loop = rec(0, "dynamic_loop", "gpsimd", trip_count=10, loop_kind="fori_loop")
    c = instr_cost(loop, TRN3)
    assert c.cycles == 10 * 64 and c.engine == "gpsimd"
    assert instr_cost(loop, PESS).cycles == 10 * 128
    assert instr_cost(rec(0, "dynamic_loop", "sync"), TRN3).seconds == 0.0  # no trip count recorded: no charge
    assert instr_cost(rec(0, "dynamic_loop", "sync", trip_count=3), TRN3).engine == "sync"


@pytest.mark.parametrize("instr, cycles", [("register_alloc", 8), ("register_move", 8), ("register_load", 60),
                                           ("register_store", 60)])
def test_register_ops_cost_a_small_fixed_time(instr, cycles):
    c = instr_cost(rec(0, instr, "scalar"), TRN3)
    assert c.cycles == cycles and c.seconds == pytest.approx(cycles / 1.2e9)


# ---- finite SBUF: reuse waits for every final access; capacity is a plan constraint ----
def test_reused_sbuf_waits_for_an_earlier_long_dma_not_only_the_last_access():
    """Tile A (140 KiB) is stored by a long DMA, then read by a short copy (its last access in program
    order); tile B (140 KiB) can only reuse A's bytes and must wait for the store too."""
    kib140 = 140 * 1024
    a, b = new_id(), new_id()
    big = (128, kib140 // 4)
    t = [rec(0, "dma_copy", "dma", [hbm("src", "float32", big, big[1])],
             [chip("dst", "sbuf", "float32", big, sid=a, alloc=kib140)]),
         rec(1, "dma_copy", "dma", [chip("src", "sbuf", "float32", big, sid=a, alloc=kib140)],
             [hbm("dst", "float32", big, big[1])]),
         rec(2, "tensor_copy", "vector", [chip("src", "sbuf", "float32", (128, 16), sid=a, alloc=kib140)],
             [chip("dst", "sbuf", "float32", (128, 16))]),
         rec(3, "dma_copy", "dma", [hbm("src", "float32", big, big[1])],
             [chip("dst", "sbuf", "float32", big, sid=b, alloc=kib140)])]
    s = schedule(t, TRN3, 1)
    assert s.end[2] < s.end[1]  # the copy finishes long before the store
    assert s.start[3] >= s.end[1]


def test_capacity_violation_is_a_plan_error_with_no_time(tmp_path):
    s = schedule([_load(0)], TRN3, 1)
    ok = CostReport.from_schedule(s, TRN3, memory_peak=[{"sbuf": 256 * 1024, "psum": 0}])
    assert ok.plan_errors == []
    over = CostReport.from_schedule(s, TRN3, memory_peak=[{"sbuf": 263 * 1024, "psum": 0}])
    assert over.plan_errors == ["core 0: the plan needs 263.0 KiB of SBUF per partition, the target has 256 KiB"]
    assert "PLAN ERROR" in over.table()
    study = load_script("mlp_bwd_study")
    refused = study.summarize(over)
    assert refused["modeled_time_s"] is None and refused["invalid_modeled_time_s"] == pytest.approx(over.modeled_time_s)
    assert study.summarize(ok)["modeled_time_s"] == pytest.approx(ok.modeled_time_s)


def test_hbm_traffic_against_the_compulsory_minimum():
    """Input X read twice, output Y written once, scratch Z written and read back."""
    x, y, z = new_id(), new_id(), new_id()
    tile = (128, 512)
    t = [rec(0, "dma_copy", "dma", [hbm("src", "bfloat16", tile, 512, sid=x)], [chip("dst", "sbuf", "bfloat16", tile)]),
         rec(1, "dma_copy", "dma", [hbm("src", "bfloat16", tile, 512, sid=x)], [chip("dst", "sbuf", "bfloat16", tile)]),
         rec(2, "dma_copy", "dma", [chip("src", "sbuf", "bfloat16", tile)], [hbm("dst", "bfloat16", tile, 512, sid=z)]),
         rec(3, "dma_copy", "dma", [hbm("src", "bfloat16", tile, 512, sid=z)], [chip("dst", "sbuf", "bfloat16", tile)]),
         rec(4, "dma_copy", "dma", [chip("src", "sbuf", "bfloat16", tile)], [hbm("dst", "bfloat16", tile, 512, sid=y)])]
    traffic = CostReport.from_schedule(schedule(t, TRN3, 1), TRN3).hbm_traffic()
    nbytes = 128 * 512 * 2
    assert traffic["moved_bytes"] == 5 * nbytes
    assert traffic["compulsory_bytes"] == 2 * nbytes  # X once + Y once
    assert traffic["scratch_bytes"] == 2 * nbytes


@pytest.mark.parametrize("last_read_needs_q", [False, True])
def test_fragmented_sbuf_waits_for_the_covered_tile_or_is_a_plan_error(last_read_needs_q):
    """P (200 KiB) is live when Q (100 KiB) is allocated: no gap fits. Q goes over P and waits for P's final
    access, unless that access itself needs Q (waiting would deadlock): then the overlap exceeds SBUF and
    the report has a plan error."""
    p, q = new_id(), new_id()
    kp, kq = 200 * 1024, 100 * 1024
    tp, tq = (128, kp // 4), (128, kq // 4)
    reads = [chip("src", "sbuf", "float32", (128, 16), sid=p, alloc=kp)]
    if last_read_needs_q:
        reads.append(chip("src2", "sbuf", "float32", (128, 16), sid=q, alloc=kq))
    t = [rec(0, "dma_copy", "dma", [hbm("src", "float32", tp, tp[1])],
             [chip("dst", "sbuf", "float32", tp, sid=p, alloc=kp)]),
         rec(1, "dma_copy", "dma", [hbm("src", "float32", tq, tq[1])],
             [chip("dst", "sbuf", "float32", tq, sid=q, alloc=kq)]),
         rec(2, "tensor_copy", "vector", reads, [chip("dst", "sbuf", "float32", (128, 16))])]
    s = schedule(t, TRN3, 1)
    report = CostReport.from_schedule(s, TRN3)
    if last_read_needs_q:
        assert s.start[1] < s.end[2]
        assert report.plan_errors == [
            "core 0: the modeled overlap needs 300.0 KiB of SBUF per partition, the target has 256 KiB",
            "core 0: SBUF tile 't' (100.0 KiB per partition) has no placement in the target's 256 KiB that does not "
            "overlap live tiles it cannot wait for (every placement overlaps live tiles whose final accesses "
            "depend on this tile's first access; docs/cost-model.md, Allocator)"]
    else:
        assert s.start[1] >= s.end[2]  # Q's load waited for P's last read
        assert report.plan_errors == []


def test_fragmented_sbuf_never_waits_for_a_swdge_dma_queued_behind_the_tile():
    """Q (100 KiB) is first written on GpSimd while P (200 KiB) is live: no gap fits. P's final access is a
    software-DGE DMA, whose descriptors GpSimd builds after Q's write (in-order queue): waiting for it
    would deadlock, so Q is placed without waiting and the overlap is a plan error (was a scheduler
    deadlock when the allocator ignored the sw-DGE queue)."""
    p, q = new_id(), new_id()
    kp, kq = 200 * 1024, 100 * 1024
    tp, tq = (128, kp // 4), (128, kq // 4)
    t = [rec(0, "dma_copy", "dma", [hbm("src", "float32", tp, tp[1])],
             [chip("dst", "sbuf", "float32", tp, sid=p, alloc=kp)]),
         rec(1, "tensor_copy", "gpsimd", [chip("src", "sbuf", "float32", (128, 16))],
             [chip("dst", "sbuf", "float32", tq, sid=q, alloc=kq)]),
         rec(2, "dma_copy", "dma", [chip("src", "sbuf", "float32", tp, sid=p, alloc=kp)],
             [hbm("dst", "float32", tp, tp[1])], dge_mode="swdge")]
    s = schedule(t, TRN3, 1)
    assert s.start[2] >= s.end[1]  # the DMA's descriptors wait for GpSimd's copy
    errors = CostReport.from_schedule(s, TRN3).plan_errors
    assert errors[0] == "core 0: the modeled overlap needs 300.0 KiB of SBUF per partition, the target has 256 KiB"
    assert len(errors) == 2 and errors[1].startswith("core 0: SBUF tile 't' (100.0 KiB per partition) has no placement")


@pytest.mark.parametrize("last_read_of_b_needs_d", [False, True])
def test_fragmentation_without_a_valid_wait_is_a_plan_error_although_the_bytes_fit(last_read_of_b_needs_d):
    """A (100 KiB), B (50 KiB) and C (100 KiB) are placed next-fit at 0, 100 and 150 KiB; A and C die, leaving
    B alone in the middle. D (110 KiB) fits no gap (100 and 106 KiB) although B + D = 160 KiB fit the 256 KiB:
    D can only go over B. If B's final access (on ScalarE) does not need D, D waits for it: no error. If it
    reads D, waiting would deadlock: D has no placement, a plan error naming it, while the scheduled occupancy
    (a sum of live bytes, 250 KiB at most) stays under capacity and would not show it."""
    kib = 1024
    a, b, c, d, x = new_id(), new_id(), new_id(), new_id(), new_id()

    def tile(sid, k, cols=None):
        return chip("t", "sbuf", "float32", (128, cols or k * kib // 4), sid=sid, alloc=k * kib)

    def load(seq, sid, k):
        return rec(seq, "dma_copy", "dma", [hbm("src", "float32", (128, k * kib // 4), k * kib // 4)], [tile(sid, k)])

    small = chip("x", "sbuf", "float32", (128, 16), sid=x)
    b_reads = [tile(b, 50, 16)] + ([tile(d, 110, 16)] if last_read_of_b_needs_d else [])
    t = [load(0, a, 100), load(1, b, 50), load(2, c, 100),
         rec(3, "tensor_copy", "vector", [tile(a, 100, 16), tile(c, 100, 16)], [small]),  # last access of A and C
         rec(4, "tensor_copy", "vector", [small], [tile(d, 110, 16)]),  # first access of D
         rec(5, "tensor_copy", "scalar", b_reads, [chip("y", "sbuf", "float32", (128, 16))])]  # last access of B
    s = schedule(t, TRN3, 1)
    report = CostReport.from_schedule(s, TRN3)
    assert max(p["sbuf"] for p in report.scheduled_peak) <= 256 * kib
    if last_read_of_b_needs_d:
        assert report.plan_errors == [
            "core 0: SBUF tile 't' (110.0 KiB per partition) has no placement in the target's 256 KiB that does not "
            "overlap live tiles it cannot wait for (every placement overlaps live tiles whose final accesses "
            "depend on this tile's first access; docs/cost-model.md, Allocator)"]
        assert "PLAN ERROR" in report.table()
    else:
        assert report.plan_errors == []
        assert s.start[4] >= s.end[5]  # D's first write waited for B's final read
