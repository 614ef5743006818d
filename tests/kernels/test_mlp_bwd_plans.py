"""The kernel's large-shape execution plans, forced on small shapes, stay bit-exact.

Model shapes (e.g. Qwen3-8B TP1, K = 2I = 24576) take plans that the small default-suite shapes never
reach: panels not resident, groups of stationary loads, K-streamed groups with several PSUM
accumulators, phase 1 without the on-chip d_gate_up path. Shrinking the SBUF budgets (module
constants of the matmul plan layer, nkilib.core.matmul.plan) routes small shapes through those plans; outputs must still
equal `mx_exact` bit for bit, on LNC1 and LNC2, in both precisions.
"""
import pytest

from nkilib.core.matmul import plan as plan_module
from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8 import mlp_bwd_mxfp8_kernel as kernel_module
from simkit import assert_matches_mx_exact, count_calls, mlp_checkpoints, mlp_inputs, mlp_reference, run_mlp


@pytest.fixture
def tiny_budgets(monkeypatch):
    """Nothing resident, one load per stationary group, K-streamed groups of 2-3 m tiles; the calls of
    MatmulPlan._run_streamed so far (count_calls)."""
    monkeypatch.setattr(plan_module, "PANEL_CACHE_BUDGET_BYTES", 1)
    monkeypatch.setattr(plan_module, "RESIDENT_OPERAND_BUDGET_BYTES", 1)
    monkeypatch.setattr(plan_module, "STATIONARY_GROUP_BUDGET_BYTES", 1)
    monkeypatch.setattr(plan_module, "STREAM_STATIONARY_BUDGET_BYTES", 3 * 128 * 8)
    monkeypatch.setattr(plan_module, "MOVING_PANEL_BUDGET_BYTES", 64 * 1024)
    return count_calls(monkeypatch, plan_module.MatmulPlan, ["_run_streamed"])


@pytest.fixture
def k_streamed_phase2(monkeypatch):
    """Budgets that make phase 2 K-streamed on small shapes: no panel cache, one load per stationary group, only phase
    1's dY resident."""
    monkeypatch.setattr(plan_module, "PANEL_CACHE_BUDGET_BYTES", 1)
    monkeypatch.setattr(plan_module, "STATIONARY_GROUP_BUDGET_BYTES", 1)
    monkeypatch.setattr(plan_module, "RESIDENT_OPERAND_BUDGET_BYTES", 4 * 1024)  # dY of phase 1 only


def _mxfp8_inputs(S, H, I, seed):
    """mlp_inputs(S, H, I) with their MXFP8 checkpoints, seeded."""
    inp = mlp_inputs(S, H, I, seed=seed)
    return {**inp, **mlp_checkpoints(inp, matmul_precision="mxfp8")}


@pytest.mark.parametrize("precision", ["mxfp8", "bf16"])
@pytest.mark.parametrize("shape", [(512, 256, 384), (260, 128, 224)])
@pytest.mark.parametrize("lnc", [1, 2])
def test_forced_large_shape_plans_are_bit_exact(tiny_budgets, precision, shape, lnc):
    S, H, I = shape
    inp = mlp_inputs(S, H, I, seed=S + H + I)
    out = run_mlp(inp, lnc=lnc, matmul_precision=precision)
    measured = assert_matches_mx_exact(out, mlp_reference(inp, matmul_precision=precision))
    assert all(m == (0, 0.0) for m in measured), measured
    assert tiny_budgets["_run_streamed"] > 0, "the K-streamed plan was not exercised"


@pytest.mark.parametrize("precision", ["mxfp8", "bf16"])
@pytest.mark.parametrize("lnc", [1, 2])
def test_resident_operand_plans_are_bit_exact(monkeypatch, precision, lnc):
    """Neither operand fits the panel cache (TP1's phases 3 and 4 at model shapes): the smaller whole operand
    stays resident (moving: m-major; stationary: n-major) and the other is streamed once; outputs stay
    bit-exact. Both variants must be taken on these shapes."""
    monkeypatch.setattr(plan_module, "PANEL_CACHE_BUDGET_BYTES", 1)
    taken = []
    original = plan_module._resident_operand

    def recording(moving_bytes, stationary_bytes):
        out = original(moving_bytes, stationary_bytes)
        taken.append(out[:2])
        return out

    monkeypatch.setattr(plan_module, "_resident_operand", recording)
    for S, H, I in [(512, 256, 384), (512, 384, 128)]:
        inp = mlp_inputs(S, H, I, seed=S + H + I)
        out = run_mlp(inp, lnc=lnc, matmul_precision=precision)
        measured = assert_matches_mx_exact(out, mlp_reference(inp, matmul_precision=precision))
        assert all(m == (0, 0.0) for m in measured), measured
    assert (True, False) in taken and (False, True) in taken, taken


@pytest.mark.slow
@pytest.mark.parametrize("target, precision", [("trn3", "mxfp8"), ("trn3", "bf16"), ("trn2", "bf16")])
@pytest.mark.parametrize("model", ["qwen3-8b-tp1", "qwen3-32b-tp1", "llama3-70b-tp8"])
def test_model_shapes_fit_on_chip_memory(model, target, precision):
    """Shape-only runs of large presets at S=4096 (LNC2): the kernel's plans stay inside SBUF/PSUM on
    both targets (the simulator's capacity check raises otherwise). Regressions: trn2's 224 KiB SBUF
    and BF16 panels at K = 2I = 51200 once overflowed in the K-streamed plan.
    (The cost report may still flag that its next-fit allocator fragments at these shapes,
    `scheduled_capacity_exceeded`: a modeling caveat of the time estimate, not a kernel failure.)"""
    from nkilib.models import preset
    from nkilib.simulator import ShapeSpec
    from nkilib.simulator.cost import model_kernel

    shape = preset(model)
    S, H, I = 4096, shape.hidden, shape.intermediate
    bf16 = "bfloat16"
    inputs = {"output_grad": ShapeSpec((S, H), bf16), "hidden_states": ShapeSpec((S, H), bf16),
              "gate_up_weights": ShapeSpec((2 * I, H), bf16), "down_proj_weight": ShapeSpec((H, I), bf16),
              **{name: ShapeSpec((S, I), bf16) for name in ("gate_pre", "gate_act", "up", "intermediate")}}
    report = model_kernel(kernel_module.mlp_backward_mxfp8_nki, inputs, lnc=2, target=target,
                          kwargs={"matmul_precision": precision})
    for peak in report.memory_peak:
        assert peak["sbuf"] <= report.target.sbuf_bytes_per_partition
        assert peak["psum"] <= report.target.psum_bytes_per_partition


@pytest.mark.parametrize("precision", ["mxfp8", "bf16"])
def test_phase1_split_along_i_is_bit_exact(monkeypatch, precision):
    """W_down's panels fit no panel cache (TP1, I = 12288): under LNC2 phase 1 splits I instead of S when each
    core then keeps all of dY resident (phase1_split_along_i). Forced on a small shape (S < I / 2, so dY is the
    smaller whole operand): the split must be taken, the outputs bit-exact against mx_exact and equal to LNC1's
    (which never splits). Checkpoints given, as in the study's configurations."""
    monkeypatch.setattr(plan_module, "PANEL_CACHE_BUDGET_BYTES", 1)
    taken = []
    original = kernel_module.phase1_split_along_i

    def recording(plan_s, plan_i):
        out = original(plan_s, plan_i)
        taken.append((out, plan_i.ranges))
        return out

    monkeypatch.setattr(kernel_module, "phase1_split_along_i", recording)
    S, H, I = 256, 256, 768
    inp = mlp_inputs(S, H, I, seed=S + H + I)
    # the model shapes' checkpoints given (phase 1 then forms one product, dI, the rule's case)
    inp = {**inp, **mlp_checkpoints(inp, matmul_precision=precision)}
    out2 = run_mlp(inp, lnc=2, matmul_precision=precision)
    assert [t[0] for t in taken] == [True, True], taken  # both cores
    assert {t[1] for t in taken} == {((0, S), (0, 384)), ((0, S), (384, I))}, taken
    measured = assert_matches_mx_exact(out2, mlp_reference(inp, matmul_precision=precision))
    assert all(m == (0, 0.0) for m in measured), measured
    out1 = run_mlp(inp, lnc=1, matmul_precision=precision)
    for a, b in zip(out1, out2):
        assert a.tobytes() == b.tobytes()


def test_tile_order_lead_runs_the_first_stationary_load_n_major():
    """tile_order(lead=k): the first k m blocks n-major, the rest m-major; lead=1 is the plain m-major order."""
    from nkilib.core.matmul.sources import tile_order

    m, n = [(0, 128), (128, 128), (256, 128)], [(0, 512), (512, 512)]
    assert tile_order(m, n, True) == [(a, b) for a in m for b in n]
    assert tile_order(m, n, True, lead=1) == tile_order(m, n, True)
    assert tile_order(m, n, True, lead=2) == [(m[0], n[0]), (m[1], n[0]), (m[0], n[1]), (m[1], n[1]),
                                              (m[2], n[0]), (m[2], n[1])]
    assert tile_order(m, n, False, lead=2) == tile_order(m, n, False)  # n-major plans: unchanged


@pytest.mark.parametrize("precision", ["mxfp8", "bf16"])
@pytest.mark.parametrize("lnc", [1, 2])
def test_lead_n_major_weight_grad_plans_are_bit_exact(monkeypatch, precision, lnc):
    """Phases 3 and 4 (lead_n_major): with X / the intermediate resident and several n blocks, the m tiles of the
    first stationary load run n-major (H = I = 2880 at S = 4096 modeled 1.174 -> 1.138 ms). Forced with 32-row
    m tiles and 128-column n tiles on a small shape: the lead order must be taken and the outputs stay bit-exact."""
    from nkilib.core.matmul import sources as sources_module
    from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8.config import MatmulConfig, MlpBwdMatmulConfig

    leads = []
    original = plan_module.tile_order

    def recording(m_blocks, n_blocks, m_outer, m_group=0, lead=1):
        out = original(m_blocks, n_blocks, m_outer, m_group, lead)
        if m_outer and lead > 1 and len(n_blocks) > 1:
            leads.append(lead)
            assert out != original(m_blocks, n_blocks, m_outer, m_group)  # the order did change
        return out

    monkeypatch.setattr(plan_module, "tile_order", recording)
    assert sources_module.tile_order is original
    small = MatmulConfig(m_tile=32, n_tile=128)
    config = MlpBwdMatmulConfig(phase3=small, phase4=small)
    S, H, I = 512, 256, 384
    inp = mlp_inputs(S, H, I, seed=S + H + I + 1)
    out = run_mlp(inp, lnc=lnc, matmul_precision=precision, matmul_config=config)
    measured = assert_matches_mx_exact(out, mlp_reference(inp, matmul_precision=precision))
    assert all(m == (0, 0.0) for m in measured), measured
    assert len(leads) >= 2, leads  # phase 3 and phase 4 (LNC2: a core with one n block keeps m-major)


@pytest.mark.parametrize("lnc", [1, 2])
def test_phase4_interleaved_first_loads_are_bit_exact(monkeypatch, lnc):
    """Phase 4 (interleave_first_loads): a cold first tile loads its dY and intermediate panels one K tile of each
    in turn (TP1 modeled 4.619 -> 4.616 ms: TensorE's first wait after the K-streamed phase 2 25.7 -> 14.2 us). Forced
    cold (phase 4 first loads not prefetched under the previous phase: PhaseGraph's prefetch refused) on a shape of
    several K tiles: the interleaved loads must be taken, with stationary and moving alternating, and the outputs stay
    bit-exact against mx_exact."""
    from nkilib.core.matmul import sources as sources_module

    monkeypatch.setattr(plan_module.MatmulPlan, "can_prefetch", lambda self, nxt: False)
    calls = []
    original = sources_module.PanelSource.load_ahead

    def recording(self, f0, f_size, quantized):
        calls.append((self.op.tensor.shape, quantized))
        return original(self, f0, f_size, quantized)

    monkeypatch.setattr(sources_module.PanelSource, "load_ahead", recording)
    S, H, I = 1024, 256, 384
    inp = mlp_inputs(S, H, I, seed=S + H + I + 2)
    inp = {**inp, **mlp_checkpoints(inp, matmul_precision="mxfp8")}
    out = run_mlp(inp, lnc=lnc, matmul_precision="mxfp8")
    measured = assert_matches_mx_exact(out, mlp_reference(inp, matmul_precision="mxfp8"))
    assert all(m == (0, 0.0) for m in measured), measured
    # per core: dY [S, H] and the intermediate [S, I] in turn, K = S: two K tiles each
    assert calls[:4] == [((S, H), 1), ((S, I), 1), ((S, H), 2), ((S, I), 2)], calls
    assert len(calls) == 4 * lnc, calls


@pytest.mark.usefixtures("k_streamed_phase2")
def test_phase2_own_rows_prefetched_before_the_barrier_are_bit_exact(monkeypatch):
    """After phase 1's split along I, each core wrote d_gate's and d_up's columns of its I half in every row, and
    phase 2 (K-streamed, K = 2I) loads the first group's panels' natural row tiles from those columns before
    the core barrier (MatmulPlan.prefetch_own; TP1 modeled 4.567 / 4.730 -> 4.562 / 4.726 ms). Forced on S = 512,
    H = 256, I = 4096 (each core's I half is two NATURAL_LOAD_K groups of d_gate and two of d_up; phase 2 streams
    groups of two m tiles): both cores must preload exactly their own groups, the LNC2 run must pass the simulator's
    race check (the early reads are of the core's own writes) and be bit-exact against mx_exact and equal to LNC1's."""
    preloaded = []
    original = plan_module.MatmulPlan.prefetch_own

    def recording(plan):
        original(plan)
        preloaded.append((plan.own_k_ranges, [[g for g, _ in tiles] for tiles in plan.preloaded or []]))

    monkeypatch.setattr(plan_module.MatmulPlan, "prefetch_own", recording)
    S, H, I = 512, 256, 4096
    inp = mlp_inputs(S, H, I, seed=S + H + I)
    inp = {**inp, **mlp_checkpoints(inp, matmul_precision="mxfp8")}
    out2 = run_mlp(inp, lnc=2, matmul_precision="mxfp8")
    # NATURAL_LOAD_K = 2048 columns per group: core 0 owns groups 0 (d_gate) and 2 (d_up), core 1 groups 1 and 3, of
    # both panels of the first group (4 row tiles, under OWN_PREFETCH_GROUPS = 6)
    assert sorted(preloaded) == [(((0, 2048), (4096, 6144)), [[0, 2], [0, 2]]),
                                 (((2048, 4096), (6144, 8192)), [[1, 3], [1, 3]])], preloaded
    measured = assert_matches_mx_exact(out2, mlp_reference(inp, matmul_precision="mxfp8"))
    assert all(m == (0, 0.0) for m in measured), measured
    out1 = run_mlp(inp, lnc=1, matmul_precision="mxfp8")
    for a, b in zip(out1, out2):
        assert a.tobytes() == b.tobytes()


def _record_k_interleaved(monkeypatch, keep):
    """Wraps MatmulPlan._matmuls_k_interleaved: each K-interleaved span's matmul_panels calls, as (accumulator id,
    K tiles in the call, accumulate), are handed to keep(plan, i, span, calls, before, count) after the span ran;
    before = the index of the accumulator taken last before the span, count = the accumulators the plan had then."""
    from nkilib.core.matmul import span_columns as span_columns_module

    original_matmuls = plan_module.MatmulPlan._matmuls_k_interleaved
    original_matmul_panels = plan_module.matmul_panels

    def recording_matmuls(plan, i, span, finished):
        calls, count, before = [], len(plan.accumulators[0]), plan.acc_order[-1]

        def matmul_panels(dst, stationary, moving, setup, t_lo=0, t_hi=-1, accumulate=False):
            calls.append((id(dst.storage), len(stationary.data), accumulate))
            return original_matmul_panels(dst, stationary, moving, setup, t_lo, t_hi, accumulate)

        monkeypatch.setattr(plan_module, "matmul_panels", matmul_panels)
        monkeypatch.setattr(span_columns_module, "matmul_panels", matmul_panels)  # a span in column pieces
        original_matmuls(plan, i, span, finished)
        monkeypatch.setattr(plan_module, "matmul_panels", original_matmul_panels)
        monkeypatch.setattr(span_columns_module, "matmul_panels", original_matmul_panels)
        keep(plan, i, span, calls, before, count)

    monkeypatch.setattr(plan_module.MatmulPlan, "_matmuls_k_interleaved", recording_matmuls)


@pytest.mark.parametrize("precision", ["mxfp8", "bf16"])
def test_phase1_panel_switch_k_interleaved_is_bit_exact(monkeypatch, precision):
    """After phase 1's split along I (dY resident, W_down's panels streamed n-major), the first three tiles of each new
    W_down panel multiply it K tile by K tile in turn (MatmulPlan interleave_switch: TP1 modeled 4.562 / 4.726 ->
    4.537 / 4.712 ms): three PSUM accumulators of 1024 columns beside the PE transposes' banks, a fourth added at the
    first switch (dY is then all on chip). Forced on S = 512, H = 1024, I = 4096 with 1024-column phase-1 tiles (each
    core: 4 S tiles x 2 n blocks; K = H: 2 MXFP8 / 8 BF16 K tiles): both cores must interleave exactly tiles 4-6, the
    matmuls there cycle through three accumulators (none the one of tile 3, whose epilogue follows the new panel's
    quantizes) with each one's K tiles in order, and the outputs be bit-exact against mx_exact and equal to LNC1's
    (which does not split along I)."""
    from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8.config import MatmulConfig, MlpBwdMatmulConfig

    monkeypatch.setattr(plan_module, "PANEL_CACHE_BUDGET_BYTES", 1)
    spans, interleaved = [], []
    original_spans = plan_module.tile_spans

    def recording_spans(order, lo, hi, switch_span, first=0):
        out = original_spans(order, lo, hi, switch_span, first)
        if switch_span == plan_module.SWITCH_INTERLEAVE_TILES:  # not phase 3's interleave_lead
            spans.append([s for s in out if s[1] > 1])
        return out

    def keep(plan, i, span, calls, before, count):
        if plan.switch_span == plan_module.SWITCH_INTERLEAVE_TILES:  # not phase 3's interleave_lead
            interleaved.append((calls, (count, len(plan.accumulators[0])), id(plan.accumulators[0][before].storage)))

    monkeypatch.setattr(plan_module, "tile_spans", recording_spans)
    _record_k_interleaved(monkeypatch, keep)
    S, H, I = 512, 1024, 4096
    inp = mlp_inputs(S, H, I, seed=S + H + I + 3)
    inp = {**inp, **mlp_checkpoints(inp, matmul_precision=precision)}
    config = MlpBwdMatmulConfig(phase1=MatmulConfig(n_tile=1024))
    out2 = run_mlp(inp, lnc=2, matmul_precision=precision, matmul_config=config)
    # per core: tiles (m0, n0) .. (m3, n0), (m0, n1) .. (m3, n1), n-major; the switch is tile 4
    assert spans == [[(4, 3)]] * 2, spans
    k_tiles = H // (512 if precision == "mxfp8" else 128)
    assert len(interleaved) == 2, len(interleaved)
    for calls, accumulators, before in interleaved:
        accs = [c[0] for c in calls]
        assert accumulators == (3, 4), accumulators  # the fourth, added at the switch
        assert len(set(accs)) == 3 and before not in accs and len(calls) == 3 * k_tiles, calls
        assert accs == accs[:3] * k_tiles, calls  # K tile by K tile, cycling through the span's tiles
        assert [c[2] for c in calls] == [t > 0 for t in range(k_tiles) for _ in range(3)], calls
        assert all(c[1] == 1 for c in calls), calls  # one K tile per matmul_panels call
    measured = assert_matches_mx_exact(out2, mlp_reference(inp, matmul_precision=precision))
    assert all(m == (0, 0.0) for m in measured), measured
    out1 = run_mlp(inp, lnc=1, matmul_precision=precision, matmul_config=config)
    for a, b in zip(out1, out2):
        assert a.tobytes() == b.tobytes()


def test_phase4_cold_first_tiles_k_interleaved_are_bit_exact(monkeypatch):
    """Phase 4 n-major with dY kept whole (TP1, after the K-streamed phase 2): its cold first tiles and the first tiles
    of each new intermediate panel multiply that panel K tile by K tile in turn as VectorE quantizes it (MatmulPlan
    interleave_switch with interleave_first_loads: the first span too, since no operand is PE-transposed and the
    fourth accumulator can be added at tile 0). Forced on S = 1024, H = 256, I = 1024 with phase 4 in 64-row m tiles
    and 128-column n tiles (each core: 4 m tiles x 4 n blocks, K = S: two K tiles): phase 4's spans are exactly the
    first three tiles of every n block, tile 0's included (none on the old code), each span cycles through three
    accumulators with each one's K tiles in order, and the outputs are bit-exact against mx_exact, LNC1 equal to
    LNC2 (LNC1: 8 n blocks)."""
    from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8.config import MatmulConfig, MlpBwdMatmulConfig

    monkeypatch.setattr(plan_module, "PANEL_CACHE_BUDGET_BYTES", 1)
    spans, interleaved = [], []
    original_spans = plan_module.tile_spans

    def recording_spans(order, lo, hi, switch_span, first=0):
        out = original_spans(order, lo, hi, switch_span, first)
        if first and switch_span == plan_module.SWITCH_INTERLEAVE_TILES:  # not phase 3's interleave_lead
            spans.append(out)
        return out

    def keep(plan, i, span, calls, before, count):
        if plan.moving_ops[0].tensor.shape == (S, I):  # phase 4's intermediate
            interleaved.append((i, span, calls))

    monkeypatch.setattr(plan_module, "tile_spans", recording_spans)
    _record_k_interleaved(monkeypatch, keep)
    S, H, I = 1024, 256, 1024
    inp = _mxfp8_inputs(S, H, I, seed=S + H + I + 5)
    config = MlpBwdMatmulConfig(phase4=MatmulConfig(m_tile=64, n_tile=128))
    out2 = run_mlp(inp, lnc=2, matmul_precision="mxfp8", matmul_config=config)
    blocks = 4  # n blocks per core, 4 m tiles each (n-major)
    assert spans == [[(4 * b, 3) if j == 0 else (4 * b + 3, 1) for b in range(blocks) for j in range(2)]] * 2, spans
    assert [(i, span) for i, span, _ in interleaved] == [(4 * b, 3) for b in range(blocks)] * 2, interleaved
    for _, _, calls in interleaved:
        accs = [c[0] for c in calls]
        assert len(set(accs)) == 3 and accs == accs[:3] * 2, calls  # K tile by K tile through the span's tiles
        assert [c[2] for c in calls] == [False] * 3 + [True] * 3 and all(c[1] == 1 for c in calls), calls
    measured = assert_matches_mx_exact(out2, mlp_reference(inp, matmul_precision="mxfp8"))
    assert all(m == (0, 0.0) for m in measured), measured
    out1 = run_mlp(inp, lnc=1, matmul_precision="mxfp8", matmul_config=config)
    for a, b in zip(out1, out2):
        assert a.tobytes() == b.tobytes()


def test_tile_spans_mark_the_first_tiles_of_each_new_moving_panel():
    """tile_spans: the first switch_span tiles of each n block after the first (capped by the block and by hi) form one
    span; the plan's first tile (unless `first` > 1: its first `first` tiles) and every other tile are spans of 1;
    switch_span 1 gives all 1."""
    from nkilib.core.matmul.sources import tile_order, tile_spans

    m, n = [(0, 128), (128, 128), (256, 128), (384, 128)], [(0, 512), (512, 512), (1024, 512)]
    order = tile_order(m, n, False)  # n-major: tiles 0-3 n block 0, 4-7 n block 1, 8-11 n block 2
    assert tile_spans(order, 0, 12, 3) == [(0, 1), (1, 1), (2, 1), (3, 1), (4, 3), (7, 1), (8, 3), (11, 1)]
    assert tile_spans(order, 0, 12, 1) == [(i, 1) for i in range(12)]
    assert tile_spans(order, 0, 10, 3) == [(0, 1), (1, 1), (2, 1), (3, 1), (4, 3), (7, 1), (8, 2)]
    two = tile_order(m[:2], n, False)  # blocks of 2 tiles: a span of 3 is capped at 2
    assert tile_spans(two, 0, 6, 3) == [(0, 1), (1, 1), (2, 2), (4, 2)]
    # first (MatmulPlan first_span): the plan's first `first` tiles form a span too, of their own length (a fenced
    # start's takes one tile more than switch_span: no tile precedes it)
    assert tile_spans(order, 0, 12, 3, 3) == [(0, 3), (3, 1), (4, 3), (7, 1), (8, 3), (11, 1)]
    assert tile_spans(order, 0, 12, 3, 4) == [(0, 4), (4, 3), (7, 1), (8, 3), (11, 1)]
    assert tile_spans(order, 0, 12, 3, 5) == [(0, 4), (4, 3), (7, 1), (8, 3), (11, 1)]  # capped by the n block
    assert tile_spans(order, 0, 12, 1, 1) == [(i, 1) for i in range(12)]


@pytest.mark.parametrize("precision", ["mxfp8", "bf16"])
def test_phase3_lead_k_interleaved_is_bit_exact(monkeypatch, precision):
    """Phase 3 with X kept whole by the resident rule (TP1; H = 7168, I = 2048 too): the first LEAD_INTERLEAVE_TILES = 2
    tiles of the lead's second n block multiply X's new panel K tile by K tile in turn (MatmulPlan interleave_lead; TP1
    modeled 4.537 / 4.712 -> 4.533 / 4.707 ms), with the PSUM_BUFFERS accumulators (the StoreEpilogue evicts on ScalarE,
    so the span takes the accumulator of the tile before it, for its second tile, which trails the first by
    LEAD_INTERLEAVE_SKEW K tiles). Forced on S = 2048, H = 256, I = 384 with 32-row m tiles and 128-column n tiles
    (phase 3: 2 n blocks, K = S: 4 MXFP8 / 16 BF16 K tiles): each core interleaves exactly the plan's cold first two
    tiles (n block 0, a first span: TP1 modeled 4.5239 / 4.6974 -> 4.5195 / 4.6875 ms) and the lead's first two tiles of
    n block 1 (one span on the old code), the matmuls alternate between the two accumulators (skewed) with each one's K
    tiles in order, and the outputs are bit-exact against mx_exact and equal to LNC1's. Off where the panel cache keeps
    X."""
    from nkilib.core.matmul.constants import LEAD_INTERLEAVE_SKEW, LEAD_INTERLEAVE_TILES, PSUM_BUFFERS
    from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8.config import MatmulConfig, MlpBwdMatmulConfig

    interleaved = []

    def keep(plan, i, span, calls, before, count):
        (_, _), (n0, _) = plan.order[i]
        if len(plan.accumulators[0]) == PSUM_BUFFERS:  # not phase 1's interleave_switch (one accumulator more)
            interleaved.append((i, span, n0, calls, id(plan.accumulators[0][before].storage),
                                [o for o in plan.order[:i + span]]))

    _record_k_interleaved(monkeypatch, keep)
    S, H, I = 2048, 256, 384
    inp = mlp_inputs(S, H, I, seed=S + H + I + 5)
    small = MatmulConfig(m_tile=32, n_tile=128)
    config = MlpBwdMatmulConfig(phase3=small, phase4=small)
    k_tiles = S // (512 if precision == "mxfp8" else 128)
    reference = mlp_reference(inp, matmul_precision=precision)

    # the panel cache keeps X (96 KiB budget): no interleave
    run_mlp(inp, lnc=2, matmul_precision=precision, matmul_config=config)
    assert interleaved == [], interleaved

    monkeypatch.setattr(plan_module, "PANEL_CACHE_BUDGET_BYTES", 1)  # X kept whole by the resident rule instead
    outs = {}
    for lnc, cores in ((2, 2), (1, 1)):
        interleaved.clear()
        outs[lnc] = run_mlp(inp, lnc=lnc, matmul_precision=precision, matmul_config=config)
        # per core: the plan's cold first tiles (n block 0) and the lead's second n block
        assert [(i == 0, n0) for i, _, n0, _, _, _ in interleaved] == [(True, 0), (False, 128)] * cores, interleaved
        for i, span, n0, calls, before, head in interleaved:
            assert span == LEAD_INTERLEAVE_TILES, (i, span, n0)
            # the second span starts at the lead's second n block: every tile before it is n block 0 (n-major)
            assert i == 0 or (all(n == 0 for _, (n, _) in head[:i]) and i > 1), head
            assert all(n == n0 for _, (n, _) in head[i:]), head
            accs = [c[0] for c in calls]
            assert len(set(accs)) == 2 and accs[0] != before and len(calls) == 2 * k_tiles, calls
            # K tile by K tile across the span's tiles, the second (which takes the accumulator of the tile before
            # the span) LEAD_INTERLEAVE_SKEW K tiles behind the first
            expected = [(j, t) for step in range(k_tiles + LEAD_INTERLEAVE_SKEW) for j in range(2)
                        for t in [step - j * LEAD_INTERLEAVE_SKEW] if 0 <= t < k_tiles]
            assert [(accs[0], before)[j] for j, _ in expected] == accs, calls
            assert [c[2] for c in calls] == [t > 0 for _, t in expected], calls
            assert all(c[1] == 1 for c in calls), calls  # one K tile per matmul_panels call
        measured = assert_matches_mx_exact(outs[lnc], reference)
        assert all(m == (0, 0.0) for m in measured), measured
    for a, b in zip(outs[1], outs[2]):
        assert a.tobytes() == b.tobytes()


def test_phase3_lead_moving_words_in_lead_pieces_are_bit_exact(monkeypatch):
    """An interleave_lead plan (phase 3 with X kept whole by the resident rule: TP1, H = 7168, I = 2048) quantizes its
    moving panels' words into pieces of LEAD_PANEL_PIECE_BYTES (TP1: one K tile of X's 2048-column panel, 8 KiB, against
    the other plans' MX_PANEL_PIECE_BYTES = 16 KiB), so X's first panel finds gaps beside phase 4's last tiles (TP1
    modeled 4.5195 / 4.6875 -> 4.5161 / 4.6806 ms). Scaled down on the phase-3 lead shape (S = 2048: four K tiles of 128
    columns, 512 bytes per partition each): with panels above 1 KiB in pieces and LEAD_PANEL_PIECE_BYTES = 512, phase
    3's X panels are built one K tile per words allocation while every other pieces() panel keeps the default piece size
    (one allocation for its K tiles); the outputs are bit-exact against mx_exact, LNC1 equal to LNC2."""
    from nkilib.core.matmul import panel_builder as builder_module
    from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8.config import MatmulConfig, MlpBwdMatmulConfig

    monkeypatch.setattr(plan_module, "PANEL_CACHE_BUDGET_BYTES", 1)  # X kept whole by the resident rule
    monkeypatch.setattr(builder_module, "MX_PANEL_WHOLE_MAX_BYTES", 1024)
    monkeypatch.setattr(plan_module, "LEAD_PANEL_PIECE_BYTES", 512)
    builders = []
    original = builder_module.PanelBuilder.__init__

    def recording(self, f_pad, setup, t_lo, count, placement=None, quantize_columns=1):
        original(self, f_pad, setup, t_lo, count, placement, quantize_columns)
        builders.append(self)

    monkeypatch.setattr(builder_module.PanelBuilder, "__init__", recording)
    S, H, I = 2048, 256, 384
    inp = mlp_inputs(S, H, I, seed=S + H + I + 6)
    small = MatmulConfig(m_tile=32, n_tile=128)
    config = MlpBwdMatmulConfig(phase3=small, phase4=small)
    outs = {}
    for lnc in (2, 1):
        builders.clear()
        outs[lnc] = run_mlp(inp, lnc=lnc, matmul_precision="mxfp8", matmul_config=config)
        pieces = [b for b in builders if b.placement.kind == "pieces" and b.count == S // 512]
        lead = [b for b in pieces if b.placement.piece_bytes == 512]
        assert len(lead) == lnc * H // 128, [(b.f_pad, b.placement.piece_bytes) for b in pieces]  # X's n blocks
        assert all(b.tiles_per_words_allocation(True) == 1 for b in lead)
        others = [b for b in pieces if b.placement.piece_bytes != 512]
        assert others and all(b.tiles_per_words_allocation(True) == b.count for b in others)
        measured = assert_matches_mx_exact(outs[lnc], mlp_reference(inp, matmul_precision="mxfp8"))
        assert all(m == (0, 0.0) for m in measured), measured
    for a, b in zip(outs[1], outs[2]):
        assert a.tobytes() == b.tobytes()


def _traced_bit_exact_on_lnc1_and_lnc2(inp, check_trace):
    """Run the MXFP8 kernel traced on LNC1 and LNC2, call check_trace(trace, lnc) on each run, and assert both runs'
    outputs equal mx_exact bit for bit and each other."""
    reference = mlp_reference(inp, matmul_precision="mxfp8")
    outputs = []
    for lnc in (1, 2):
        res = run_mlp(inp, lnc=lnc, trace=True, matmul_precision="mxfp8")
        check_trace(res.trace, lnc)
        measured = assert_matches_mx_exact(res.outputs, reference)
        assert all(m == (0, 0.0) for m in measured), measured
        outputs.append(res.outputs)
    for a, b in zip(*outputs):
        assert a.tobytes() == b.tobytes()


def _tail_order(trace, program):
    """In one program's instruction trace: (index of phase 2's last matmul, the phase after phase 2, the index of
    that phase's first instruction and of its first quantize_mx, the engines of phase 2's last PSUM evictions)."""
    records = [r for r in trace if r.program == program]
    phase = [r.attrs.get("phase") for r in records]
    last_matmul = max(i for i, r in enumerate(records) if phase[i] == "phase2" and r.instr == "nc_matmul_mx")
    first = min(i for i in range(len(records)) if phase[i] in ("phase3", "phase4"))
    first_quantize = min(i for i, r in enumerate(records) if phase[i] == phase[first] and r.instr == "quantize_mx")
    evictions = [r.engine for i, r in enumerate(records[:-1]) if phase[i] == "phase2" and r.instr == "tensor_copy"
                 and any(o.name == "hidden_states_grad" for o in records[i + 1].writes)]
    return last_matmul, phase[first], first, first_quantize, evictions


@pytest.mark.usefixtures("k_streamed_phase2")
def test_next_stationary_loaded_under_phase2_last_quad_is_bit_exact():
    """After the K-streamed phase 2 (which holds all of SBUF until its last quad, so can_prefetch refuses), the next
    phase's first stationary panel loads and is quantized under phase 2's last quad (MatmulPlan.can_load_under_tail /
    set_tail_load, PhaseGraph step "first_stationary"; TP1: phase 4's first dY panel), and phase 2's last n block
    evicts on ScalarE only (VectorE quantizes that panel meanwhile). TP1 modeled 4.5329 / 4.7072 -> 4.5299 / 4.7053
    ms. Forced on S = 512, H = 256, I = 4096 (the budgets of the prefetch_own test: phase 2 streams groups of two m
    tiles): in each core's trace the next phase's first instruction and first quantize come before phase 2's last
    matmul (after it on the old code), its last evictions are on ScalarE (alternating with VectorE on the old
    code), and the outputs are bit-exact against mx_exact, LNC1 equal to LNC2."""
    from nkilib.examples.mlp_backward_cost import PHASES
    from nkilib.simulator.trace import label_phases

    S, H, I = 512, 256, 4096
    inp = _mxfp8_inputs(S, H, I, seed=S + H + I + 3)

    def check_tail(trace, lnc):
        for program in range(lnc):
            last_matmul, nxt, first, first_quantize, evictions = _tail_order(trace, program)
            assert first < last_matmul and first_quantize < last_matmul, (lnc, program, nxt, last_matmul, first,
                                                                          first_quantize)
            # the last n block evicts one tile per m tile of the last group (at least 2), otherwise alternating
            # VectorE / ScalarE
            assert evictions[-2:] == ["scalar", "scalar"], evictions

    with label_phases(kernel_module, PHASES):
        _traced_bit_exact_on_lnc1_and_lnc2(inp, check_tail)


def _next_phase_sbuf_loads_under_tail(trace, program):
    """(records, their phase labels, index of phase 2's last matmul, the phase after phase 2, that phase's DMAs into
    SBUF issued before phase 2's last matmul) of one program's trace."""
    records = [r for r in trace if r.program == program]
    phase = [r.attrs.get("phase") for r in records]
    last_matmul, nxt, _, _, _ = _tail_order(trace, program)
    early = [r for i, r in enumerate(records[:last_matmul]) if phase[i] == nxt and r.engine == "dma" and
             r.writes[0].buffer == "sbuf"]
    return records, phase, last_matmul, nxt, early


@pytest.mark.usefixtures("k_streamed_phase2")
def test_next_stationary_under_phase2_tail_stages_through_phase2_ring():
    """The first stationary loads issued under the K-streamed phase 2's last quad (set_tail_load) take over phase 2's
    staging ring (MatmulPlan.adopt_staging): their DMAs write SBUF tiles that phase 2's W_gu quads were staged in,
    free once the last quad is quantized, instead of fresh tiles placed over tiles that phase 2's last matmuls read
    (TP1 modeled 4.5161 / 4.6806 -> 4.5096 / 4.6716 ms: phase 4's first dY DMAs start ~7 us earlier). Forced on
    S = 512, H = 512, I = 4096 (the budgets of the tail test above; H = 512 so that phase 2's n block, and with it
    its staging tiles, is as wide as the next phase's first panel): in each core's trace every DMA of the next phase
    issued before phase 2's last matmul writes one of phase 2's W_gu staging tiles (a fresh tile on the old code),
    and the outputs are bit-exact against mx_exact, LNC1 equal to LNC2."""
    from nkilib.examples.mlp_backward_cost import PHASES
    from nkilib.simulator.trace import label_phases

    S, H, I = 512, 512, 4096
    inp = _mxfp8_inputs(S, H, I, seed=S + H + I + 5)

    def check_staging(trace, lnc):
        for program in range(lnc):
            records, phase, last_matmul, nxt, early = _next_phase_sbuf_loads_under_tail(trace, program)
            ring = {r.writes[0].storage_id for i, r in enumerate(records) if phase[i] == "phase2" and
                    r.engine == "dma" and r.reads and r.reads[0].name == "gate_up_weights"}
            early = [r.writes[0].storage_id for r in early]
            assert early and all(t in ring for t in early), (lnc, program, nxt, early, sorted(ring))

    with label_phases(kernel_module, PHASES):
        _traced_bit_exact_on_lnc1_and_lnc2(inp, check_staging)


@pytest.mark.usefixtures("k_streamed_phase2")
def test_adopted_staging_ring_returns_to_its_depth_after_the_tail_panel():
    """The staging ring a plan takes over from the K-streamed phase 2 (MatmulPlan.adopt_staging, STREAM_STAGING_BUFFERS
    = 4 tiles) is that deep only for the panel loaded under phase 2's tail: the source's later panels share it at
    STAGING_BUFFERS (PanelSource.later_staging). Kept at 4 for the whole plan, the dense kernel at S = 16384, H = I =
    2880 had no SBUF placement for a 20 KiB tile (refused); TP1 keeps 4.5097 of round 21's 4.5096 ms central. Forced as
    in the test above (S = 512, H = 512, I = 4096: the next phase, phase 3, loads one K tile per panel): in each core's
    trace that source's DMAs issued after phase 2's last matmul (seven) write STAGING_BUFFERS distinct SBUF tiles (four
    on the old code), and the outputs are bit-exact against mx_exact, LNC1 equal to LNC2."""
    from nkilib.core.matmul.constants import STAGING_BUFFERS, STREAM_STAGING_BUFFERS
    from nkilib.examples.mlp_backward_cost import PHASES
    from nkilib.simulator.trace import label_phases

    assert STREAM_STAGING_BUFFERS > STAGING_BUFFERS
    S, H, I = 512, 512, 4096
    inp = _mxfp8_inputs(S, H, I, seed=S + H + I + 6)

    def check_depth(trace, lnc):
        for program in range(lnc):
            records, phase, last_matmul, nxt, early = _next_phase_sbuf_loads_under_tail(trace, program)
            source = early[0].reads[0].name
            later = [r.writes[0].storage_id for i, r in enumerate(records) if i > last_matmul and phase[i] == nxt and
                     r.engine == "dma" and r.reads and r.reads[0].name == source and r.writes[0].buffer == "sbuf"]
            assert len(later) > STREAM_STAGING_BUFFERS, (lnc, program, source, len(later))
            assert len(set(later)) == STAGING_BUFFERS, (lnc, program, source, len(set(later)))

    with label_phases(kernel_module, PHASES):
        _traced_bit_exact_on_lnc1_and_lnc2(inp, check_depth)


def _staging_tiles_per_core(trace, source_name):
    """{program: distinct SBUF tiles that DMAs from HBM tensor `source_name` write}."""
    tiles = {}
    for rec in trace:
        if rec.engine == "dma" and rec.reads and rec.reads[0].name == source_name:
            tiles.setdefault(rec.program, set()).add(rec.writes[0].storage_id)
    return {p: len(ids) for p, ids in tiles.items()}


def test_phase1_resident_w_down_loads_share_a_deeper_staging_ring(monkeypatch):
    """Phase 1 keeps W_down's panels resident (TP8): its first S tile waits for every K tile of W_down, and its [K, F]
    loads share a ring of COLD_STAGING_BUFFERS staging tiles instead of STAGING_BUFFERS (MatmulPlan cold_staging), so
    more of its DMAs stay in flight while VectorE quantizes the first ones (TP8 modeled 0.660 / 0.740 -> 0.653 / 0.718
    ms). On H = 3072 (six K tiles of W_down, one n block) each core's W_down DMAs write six staging tiles (three on the
    old code); the outputs are bit-exact against mx_exact, LNC1 equal to LNC2. With more m tiles per core than
    COLD_STAGING_MAX_M_TILES the ring stays at STAGING_BUFFERS."""
    from nkilib.core.matmul.constants import COLD_STAGING_BUFFERS, STAGING_BUFFERS

    assert COLD_STAGING_BUFFERS > STAGING_BUFFERS
    S, H, I = 256, 3072, 256
    inp = mlp_inputs(S, H, I, seed=S + H + I + 4)
    inp = {**inp, **mlp_checkpoints(inp, matmul_precision="mxfp8")}

    def check_ring(trace, lnc):
        tiles = _staging_tiles_per_core(trace, "down_proj_weight")
        assert tiles == {p: min(COLD_STAGING_BUFFERS, H // 512) for p in range(lnc)}, tiles

    _traced_bit_exact_on_lnc1_and_lnc2(inp, check_ring)
    # more m tiles per core than COLD_STAGING_MAX_M_TILES (S = 256 is two): the ring of STAGING_BUFFERS, as before
    monkeypatch.setattr(plan_module, "COLD_STAGING_MAX_M_TILES", 1)
    res = run_mlp(inp, lnc=1, trace=True, matmul_precision="mxfp8")
    assert _staging_tiles_per_core(res.trace, "down_proj_weight") == {0: STAGING_BUFFERS}


def test_phase1_cold_start_first_w_down_k_tiles_staged_one_dma_per_slot(monkeypatch):
    """At phase 1's cold start (TP8) W_down's whole staging ring, dY's first rows and the first checkpoints are in
    flight together and share the DMA engines; the first COLD_SLOT_DMA_K_TILES K tiles of W_down's first panel are
    staged by one DMA per slot (MX_PACK DMAs of a quarter of the K tile each), so they take more of the shares and land
    first (TP8 modeled 0.62024 / 0.70017 -> 0.61912 / 0.69893 ms). On H = 3072 (six K tiles of W_down) each core's
    W_down DMAs are MX_PACK quarter-tile DMAs per such K tile, then one whole-tile DMA per K tile (one per K tile on the
    old code); bit-exact against mx_exact, LNC1 equal to LNC2. Without cold staging every K tile is one DMA."""
    from nkilib.core.matmul.constants import COLD_SLOT_DMA_K_TILES, MX_PACK

    S, H, I = 256, 3072, 256
    k_tiles = H // 512
    assert 0 < COLD_SLOT_DMA_K_TILES < k_tiles
    inp = mlp_inputs(S, H, I, seed=S + H + I + 31)
    inp = {**inp, **mlp_checkpoints(inp, matmul_precision="mxfp8")}
    k_tile_bytes = 512 * I * 2  # bf16 [512, I] rows of W_down (one n block: I = 256)
    split = [k_tile_bytes // MX_PACK] * (MX_PACK * COLD_SLOT_DMA_K_TILES)
    whole = [k_tile_bytes] * (k_tiles - COLD_SLOT_DMA_K_TILES)

    def check_dmas(trace, lnc):
        assert _w_down_dma_bytes_per_core(trace) == {p: split + whole for p in range(lnc)}

    _traced_bit_exact_on_lnc1_and_lnc2(inp, check_dmas)
    monkeypatch.setattr(plan_module, "COLD_STAGING_MAX_M_TILES", 1)  # not cold-staged: one DMA per K tile
    res = run_mlp(inp, lnc=1, trace=True, matmul_precision="mxfp8")
    assert _w_down_dma_bytes_per_core(res.trace) == {0: [k_tile_bytes] * k_tiles}


def _w_down_dma_bytes_per_core(trace):
    """{program: [bytes of each DMA from W_down, in program order]}."""
    out = {}
    for rec in trace:
        if rec.engine == "dma" and rec.reads and rec.reads[0].name == "down_proj_weight":
            out.setdefault(rec.program, []).append(rec.reads[0].nbytes)
    return out


def test_phase2_reads_its_own_rows_so_the_barrier_goes_inside_it():
    """Phase 2 with phase 1's resident d_gate_up panels (TP8) reads only the rows its own core wrote: no sync point
    before it; the one core barrier goes inside phase 2 (MatmulPlan.set_fence), and phase 1's last K tile quantized
    along S (phase 3's operand, read by both cores) is stored after phase 2's first W_gu quantizes and before the
    barrier (exchange_along_s defer_last). On round 14's code the barrier preceded every phase-2 matmul and the last
    along-S store preceded phase 2's quantizes: fails there. No phase-3 or phase-4 instruction before the barrier. Here
    phase 1 spreads its along-S quantize over two S tiles (2I = 3072: a 24 KiB staging tile, two n blocks:
    SwigluBackwardEpilogue.spreads_along_s, four chunks and stores per K tile), so phase 2's fence goes before the
    epilogue of the last tile of its first W_gu panel, after the second panel's loads (fence_after_first_panel: tile 3,
    four m tiles per core; FENCE_TILE = 6 on round 17's code: six dX stores before the barrier, fails there); the
    store of the tile before the fence (tile 2) follows the fence, which waits for its eviction only (StoreEpilogue
    defer_next_store, round 20: three stores before the barrier on round 19's code, fails there), and W_gu's later
    panels load through a ring of STAGING_BUFFERS (3) staging tiles, its first through FENCED_STAGING_BUFFERS (a ring
    of 4 for the later panels from round 20 to 26: fails there; round 27 TP8 0.6229 / 0.7011 -> 0.6219 / 0.7005). TP8
    modeled 0.6367 / 0.7194 -> 0.6302 / 0.7139 ms. S = 1024: 512 rows per core, whole K tiles along S; 2I = 3072: six
    K tiles of W_gu per panel, four n blocks. Bit-exact against mx_exact, LNC1 equal to LNC2."""
    from nkilib.core.matmul.constants import FENCED_COLUMN_PIECES, FENCED_STAGING_BUFFERS, STAGING_BUFFERS
    from nkilib.examples.mlp_backward_cost import PHASES
    from nkilib.simulator.trace import label_phases

    S, H, I = 1024, 4096, 1536  # four m tiles per core, four W_gu n blocks: 16 phase-2 tiles
    k_tiles = 2 * I // 512
    inp = mlp_inputs(S, H, I, seed=S + H + I + 15)
    inp = {**inp, **mlp_checkpoints(inp, matmul_precision="mxfp8")}

    def check_fence_inside_phase2(trace, lnc):
        for p in range(lnc):
            records = [r for r in trace if r.program == p]
            phase = [r.attrs.get("phase") for r in records]
            matmuls = [i for i, r in enumerate(records) if phase[i] == "phase2" and r.instr == "nc_matmul_mx"]
            assert matmuls, "phase 2 ran no MX matmul"
            # W_gu's first panel through FENCED_STAGING_BUFFERS staging tiles, the later panels through
            # STAGING_BUFFERS (3: not four of the second panel's loads in flight beside the first panel's last K tile)
            w_gu = [r.writes[0].storage_id for r in records if r.engine == "dma" and r.reads and
                    r.reads[0].name == "gate_up_weights"]
            assert len(w_gu) == 4 * k_tiles, len(w_gu)
            assert len(set(w_gu[:k_tiles])) == FENCED_STAGING_BUFFERS, w_gu
            assert len(set(w_gu[k_tiles:])) == STAGING_BUFFERS == 3, w_gu
            if lnc == 1:
                assert not any(r.instr == "core_barrier" for r in records)
                continue
            barriers = [i for i, r in enumerate(records) if r.instr == "core_barrier"]
            assert len(barriers) == 1, barriers
            barrier = barriers[0]
            m_tiles = S // lnc // 128
            # the second panel's W_gu loads and the first panel's matmuls before the fence, its last epilogue after it
            w_gu_loads = [i for i, r in enumerate(records) if r.engine == "dma" and r.reads and
                          r.reads[0].name == "gate_up_weights"]
            assert max(w_gu_loads[k_tiles:2 * k_tiles]) < barrier < min(w_gu_loads[2 * k_tiles:]), (p, barrier)
            assert sum(1 for i in matmuls if i < barrier) >= m_tiles * k_tiles, (p, barrier)
            dx_stores = [i for i, r in enumerate(records) if phase[i] == "phase2" and r.instr == "dma_copy" and
                         any(o.name == "hidden_states_grad" for o in r.writes)]
            evictions = [i for i, r in enumerate(records) if phase[i] == "phase2" and r.instr == "tensor_copy"]
            # tiles 0 .. m_tiles - 2 evicted before the fence (in FENCED_COLUMN_PIECES column pieces each: the first
            # span, MatmulPlan.piece_first_span), the last of them stored right after it (StoreEpilogue
            # defer_next_store: the fence waits for its eviction, not its DMA)
            early = [i for i in evictions if i < barrier]
            assert len(early) == FENCED_COLUMN_PIECES * (m_tiles - 1), (p, evictions, barrier)
            assert len({records[i].writes[0].storage_id for i in early}) == m_tiles - 1, (p, early)
            assert sum(1 for i in dx_stores if i < barrier) == m_tiles - 2, (p, dx_stores, barrier)
            after = min(i for i in dx_stores if i > barrier)
            assert records[after].reads[0].storage_id == records[max(i for i in evictions if i < barrier)] \
                .writes[0].storage_id and after < min(i for i in evictions if i > barrier), (p, after, barrier)
            assert not any(phase[i] in ("phase3", "phase4") for i in range(barrier)), p
            stores = [i for i, r in enumerate(records) if r.instr == "dma_copy" and
                      any(o.name == "mlp_bwd_d_gate_up_mx" for o in r.writes)]
            first_w_gu = min(i for i, r in enumerate(records) if phase[i] == "phase2" and r.instr == "quantize_mx")
            # each K tile's words stored per quantized chunk: two n blocks of phase 1 over two S tiles
            assert len(stores) == 4 * (S // lnc // 512) and max(stores) < barrier and max(stores) > first_w_gu, \
                (p, stores, first_w_gu, barrier)

    with label_phases(kernel_module, PHASES):
        _traced_bit_exact_on_lnc1_and_lnc2(inp, check_fence_inside_phase2)


def test_phase2_fenced_start_first_span_takes_every_accumulator(monkeypatch):
    """Phase 2's fenced start (TP8: phase 1's resident d_gate_up panels, W_gu's K tiles quantized after the fence as
    TensorE multiplies them) runs its first span over all four PSUM accumulators of 1024 columns instead of three: no
    tile of the plan precedes the span, so none holds an accumulator the span must leave (the switch spans keep one
    free for the tile before them). Four tiles x 0.44 us of matmul per K tile then match VectorE's 1.76 us quantize
    of the next W_gu K tile (three left TensorE waiting 0.44 us per K tile: TP8 modeled 0.6302 / 0.7139 -> 0.6280 /
    0.7122 ms). S = 1024, H = 4096, I = 1536: four m tiles per core (LNC2) and six W_gu K tiles per panel; on the old
    code the first span is tiles 0-2 (three accumulators): fails there. Each tile's K tiles accumulate in order, so
    the outputs are bit-exact against mx_exact and LNC1 equals LNC2. Since round 29 (MatmulPlan.piece_first_span, phase
    1 spread here) each K tile's matmuls go in FENCED_COLUMN_PIECES column pieces, every accumulator in turn per
    piece."""
    from nkilib.core.matmul.constants import FENCED_COLUMN_PIECES, SWITCH_INTERLEAVE_TILES

    first_spans = []

    def keep(plan, i, span, calls, before, count):
        if plan.fenced_start and i == 0:
            assert plan.span_columns == FENCED_COLUMN_PIECES, plan.span_columns
            first_spans.append((span, len(plan.accumulators[0]), calls))

    _record_k_interleaved(monkeypatch, keep)
    S, H, I = 1024, 4096, 1536
    k_tiles = 2 * I // 512
    inp = mlp_inputs(S, H, I, seed=S + H + I + 17)
    inp = {**inp, **mlp_checkpoints(inp, matmul_precision="mxfp8")}
    out2 = run_mlp(inp, lnc=2, matmul_precision="mxfp8")
    assert len(first_spans) == 2, [s[:2] for s in first_spans]  # one per core
    for span, accumulators, calls in first_spans:
        assert (span, accumulators) == (SWITCH_INTERLEAVE_TILES + 1, SWITCH_INTERLEAVE_TILES + 1), (span, accumulators)
        accs = [c[0] for c in calls]
        pieces = FENCED_COLUMN_PIECES  # K tile by K tile, piece by piece, every accumulator
        assert len(set(accs)) == span and accs == accs[:span] * (k_tiles * pieces), calls
        assert [c[2] for c in calls] == [t > 0 for t in range(k_tiles) for _ in range(span * pieces)], calls
        assert all(c[1] == 1 for c in calls), calls
    measured = assert_matches_mx_exact(out2, mlp_reference(inp, matmul_precision="mxfp8"))
    assert all(m == (0, 0.0) for m in measured), measured
    out1 = run_mlp(inp, lnc=1, matmul_precision="mxfp8")
    for a, b in zip(out1, out2):
        assert a.tobytes() == b.tobytes()


def test_fenced_plan_with_an_epilogue_that_cannot_defer_stores_before_the_fence(monkeypatch):
    """defer_next_store / store_deferred are the optional part of MatmulPlan's epilogue protocol: a fenced plan whose
    epilogue lacks them (StoreEpilogue's removed here) stores every tile before the fence as before round 20 (m_tiles
    - 1 dX stores before the barrier instead of m_tiles - 2) and stays bit-exact. On round 20's first code the plan
    called them unconditionally: AttributeError there. Same shape as
    test_phase2_reads_its_own_rows_so_the_barrier_goes_inside_it."""
    from nkilib.core.matmul.epilogue import StoreEpilogue
    from nkilib.examples.mlp_backward_cost import PHASES
    from nkilib.simulator.trace import label_phases

    monkeypatch.delattr(StoreEpilogue, "defer_next_store")
    monkeypatch.delattr(StoreEpilogue, "store_deferred")
    S, H, I = 1024, 4096, 1536
    inp = mlp_inputs(S, H, I, seed=S + H + I + 15)
    inp = {**inp, **mlp_checkpoints(inp, matmul_precision="mxfp8")}

    def check_stores_before_fence(trace, lnc):
        if lnc == 1:
            return
        for p in range(lnc):
            records = [r for r in trace if r.program == p]
            barriers = [i for i, r in enumerate(records) if r.instr == "core_barrier"]
            assert len(barriers) == 1, barriers
            dx_stores = [i for i, r in enumerate(records) if r.attrs.get("phase") == "phase2" and
                         r.instr == "dma_copy" and any(o.name == "hidden_states_grad" for o in r.writes)]
            assert sum(1 for i in dx_stores if i < barriers[0]) == S // lnc // 128 - 1, (p, dx_stores, barriers)

    with label_phases(kernel_module, PHASES):
        _traced_bit_exact_on_lnc1_and_lnc2(inp, check_stores_before_fence)


def test_kernel_last_tile_stored_in_column_pieces_under_its_matmuls():
    """The kernel's last plan (PhaseGraph.run -> MatmulPlan.piece_last_tile) runs its last tile in column pieces
    of LAST_TILE_COLUMN_SHARES (last_tile.py), each evicted and stored once its K tiles are summed, so only the last
    piece's eviction and store follow the kernel's last matmul (TP8 modeled 0.6243 / 0.7026 -> 0.6229 / 0.7011 ms).
    Per core: the last three stores write one tile's column windows in widths 3:2:1 (one store of the whole tile on
    the old code), the first two are issued before the last matmul (after it on the old code), no earlier phase
    is pieced; bit-exact against mx_exact, LNC1 equal to LNC2."""
    from nkilib.core.matmul.last_tile import last_tile_piece_widths

    assert last_tile_piece_widths(1536) == [768, 512, 256]
    assert last_tile_piece_widths(1440) == [720, 480, 240]
    S, H, I = 512, 512, 768
    inp = _mxfp8_inputs(S, H, I, seed=S + H + I + 24)

    def check_pieces(trace, lnc):
        for program in range(lnc):
            records = [r for r in trace if r.program == program]
            stores = [i for i, r in enumerate(records) if r.instr == "dma_copy" and r.writes
                      and r.writes[0].buffer != "sbuf"]
            out_name = records[stores[-1]].writes[0].name
            last = [i for i in stores if records[i].writes[0].name == out_name][-3:]
            widths = [records[i].writes[0].shape[1] for i in last]
            rows = {records[i].writes[0].shape[0] for i in last}
            assert widths == last_tile_piece_widths(sum(widths)), (lnc, program, out_name, widths)
            assert len(rows) == 1, rows
            starts = [records[i].writes[0].byte_offset for i in last]
            assert starts[1] - starts[0] == 2 * widths[0] and starts[2] - starts[1] == 2 * widths[1], starts
            last_matmul = max(i for i, r in enumerate(records) if r.instr == "nc_matmul_mx")
            assert last[0] < last_matmul and last[1] < last_matmul < last[2], (last, last_matmul)
            # one pieced tile per kernel: the smallest piece is narrower than every earlier store (an earlier pieced
            # tile would have stored a piece as narrow)
            other = [records[i].writes[0].shape[1] for i in stores[:-3]]
            assert other and widths[-1] < min(other), (widths, sorted(set(other))[:4])

    _traced_bit_exact_on_lnc1_and_lnc2(inp, check_pieces)
