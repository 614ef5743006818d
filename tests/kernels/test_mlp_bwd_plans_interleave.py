"""K-interleaved spans of the matmul plans (MatmulPlan interleave_switch / interleave_lead / fenced start): the first
tiles of a new panel multiply it K tile by K tile in turn as VectorE quantizes it, and interleaved first loads.

Forced on small shapes by shrinking the plan layer's budgets (nkilib.core.matmul.plan) or by small matmul configs;
the span's matmul_panels calls are recorded per span (_record_k_interleaved) and the outputs must equal `mx_exact`
bit for bit, LNC1 equal to LNC2.
"""
import pytest

from nkilib.core.matmul import plan as plan_module
from nkilib.core.matmul import tiling as tiling_module
from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8 import config as config_module
from simkit import (assert_mlp_bit_exact, assert_mlp_bit_exact_on_lnc1_and_lnc2, assert_outputs_identical, mlp_inputs,
                    mlp_inputs_with_checkpoints, run_mlp, spy, spy_returns)


def _record_k_interleaved(monkeypatch, keep):
    """Spies on MatmulPlan._matmuls_k_interleaved: each K-interleaved span's matmul_panels calls, as (accumulator id,
    K tiles in the call, accumulate), are handed to keep(plan, i, span, calls, before, count) after the span ran;
    before = the index of the accumulator taken last before the span, count = the accumulators the plan had then."""
    from nkilib.core.matmul import span_columns as span_columns_module

    matmuls = []  # the plan layer's matmul_panels calls, in call order
    for module in (plan_module, span_columns_module):  # span_columns: a span in column pieces
        spy(monkeypatch, module, "matmul_panels", into=matmuls,
            key=lambda dst, stationary, moving, setup, t_lo=0, t_hi=-1, accumulate=False:
            (id(dst.storage), len(stationary.data), accumulate))
    # before each span: (its first call's index in matmuls, before, count); after it, keep(...) (records nothing)
    starts = spy(monkeypatch, plan_module.MatmulPlan, "_matmuls_k_interleaved",
                 lambda plan, i, span, finished: (len(matmuls), plan.acc_order[-1], len(plan.accumulators[0])))

    def span_ran(result, plan, i, span, finished):
        first, before, count = starts.pop()
        keep(plan, i, span, matmuls[first:], before, count)

    spy_returns(monkeypatch, plan_module.MatmulPlan, "_matmuls_k_interleaved", span_ran)


@pytest.mark.parametrize("lnc", [1, 2])
def test_phase4_interleaved_first_loads_are_bit_exact(monkeypatch, lnc):
    """Phase 4 (interleave_first_loads): a cold first tile loads its dY and intermediate panels one K tile of each
    in turn (TP1 modeled 4.619 -> 4.616 ms: TensorE's first wait after the K-streamed phase 2 25.7 -> 14.2 us). Forced
    cold (phase 4 first loads not prefetched under the previous phase: PhaseGraph's prefetch refused) on a shape of
    several K tiles: the interleaved loads must be taken, with stationary and moving alternating, and the outputs stay
    bit-exact against mx_exact."""
    from nkilib.core.matmul import sources as sources_module

    monkeypatch.setattr(plan_module.MatmulPlan, "can_prefetch", lambda self, nxt: False)
    calls = spy(monkeypatch, sources_module.PanelSource, "load_ahead",
                lambda self, f0, f_size, quantized: (self.op.tensor.shape, quantized))
    S, H, I = 1024, 256, 384
    inp = mlp_inputs_with_checkpoints(S, H, I, seed=S + H + I + 2, matmul_precision="mxfp8")
    out = run_mlp(inp, lnc=lnc, matmul_precision="mxfp8")
    assert_mlp_bit_exact(out, inp, matmul_precision="mxfp8")
    # per core: dY [S, H] and the intermediate [S, I] in turn, K = S: two K tiles each
    assert calls[:4] == [((S, H), 1), ((S, I), 1), ((S, H), 2), ((S, I), 2)], calls
    assert len(calls) == 4 * lnc, calls


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

    monkeypatch.setattr(tiling_module, "PANEL_CACHE_BUDGET_BYTES", 1)
    # S = 512 is one K tile of phases 3-4: after the I split round 44 narrows them to MX_N_TILE
    # (config.fit_weight_grad_n_tile), which gives them panel switches of their own; kept wide here so the spy sees
    # phase 1's switch only (the narrowed path is test_mlp_bwd_plans.py's)
    monkeypatch.setattr(config_module, "WEIGHT_GRAD_WIDE_MIN_K_TILES_AFTER_I_SPLIT", 1)
    interleaved = []
    spans = spy_returns(monkeypatch, plan_module, "tile_spans",  # not phase 3's interleave_lead
                        lambda out, order, lo, hi, switch_span, first=0: [s for s in out if s[1] > 1]
                        if switch_span == tiling_module.SWITCH_INTERLEAVE_TILES else None)

    def keep(plan, i, span, calls, before, count):
        if plan.switch_span == tiling_module.SWITCH_INTERLEAVE_TILES:  # not phase 3's interleave_lead
            interleaved.append((calls, (count, len(plan.accumulators[0])), id(plan.accumulators[0][before].storage)))

    _record_k_interleaved(monkeypatch, keep)
    S, H, I = 512, 1024, 4096
    inp = mlp_inputs_with_checkpoints(S, H, I, seed=S + H + I + 3, matmul_precision=precision)
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
    assert_mlp_bit_exact_on_lnc1_and_lnc2(inp, out2, matmul_precision=precision, matmul_config=config)


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

    monkeypatch.setattr(tiling_module, "PANEL_CACHE_BUDGET_BYTES", 1)
    interleaved = []
    spans = spy_returns(monkeypatch, plan_module, "tile_spans",  # not phase 3's interleave_lead
                        lambda out, order, lo, hi, switch_span, first=0: out
                        if first and switch_span == tiling_module.SWITCH_INTERLEAVE_TILES else None)

    def keep(plan, i, span, calls, before, count):
        if plan.moving_ops[0].tensor.shape == (S, I):  # phase 4's intermediate
            interleaved.append((i, span, calls))

    _record_k_interleaved(monkeypatch, keep)
    S, H, I = 1024, 256, 1024
    inp = mlp_inputs_with_checkpoints(S, H, I, seed=S + H + I + 5, matmul_precision="mxfp8")
    config = MlpBwdMatmulConfig(phase4=MatmulConfig(m_tile=64, n_tile=128))
    out2 = run_mlp(inp, lnc=2, matmul_precision="mxfp8", matmul_config=config)
    blocks = 4  # n blocks per core, 4 m tiles each (n-major)
    assert spans == [[(4 * b, 3) if j == 0 else (4 * b + 3, 1) for b in range(blocks) for j in range(2)]] * 2, spans
    assert [(i, span) for i, span, _ in interleaved] == [(4 * b, 3) for b in range(blocks)] * 2, interleaved
    for _, _, calls in interleaved:
        accs = [c[0] for c in calls]
        assert len(set(accs)) == 3 and accs == accs[:3] * 2, calls  # K tile by K tile through the span's tiles
        assert [c[2] for c in calls] == [False] * 3 + [True] * 3 and all(c[1] == 1 for c in calls), calls
    assert_mlp_bit_exact_on_lnc1_and_lnc2(inp, out2, matmul_precision="mxfp8", matmul_config=config)


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

    # the panel cache keeps X (96 KiB budget): no interleave
    run_mlp(inp, lnc=2, matmul_precision=precision, matmul_config=config)
    assert interleaved == [], interleaved

    monkeypatch.setattr(tiling_module, "PANEL_CACHE_BUDGET_BYTES", 1)  # X kept whole by the resident rule instead
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
        assert_mlp_bit_exact(outs[lnc], inp, matmul_precision=precision)
    assert_outputs_identical(outs[1], outs[2], "LNC1 vs LNC2")


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

    monkeypatch.setattr(tiling_module, "PANEL_CACHE_BUDGET_BYTES", 1)  # X kept whole by the resident rule
    monkeypatch.setattr(builder_module, "MX_PANEL_WHOLE_MAX_BYTES", 1024)
    monkeypatch.setattr(tiling_module, "LEAD_PANEL_PIECE_BYTES", 512)
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
        assert_mlp_bit_exact(outs[lnc], inp, matmul_precision="mxfp8")
    assert_outputs_identical(outs[1], outs[2], "LNC1 vs LNC2")


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
    inp = mlp_inputs_with_checkpoints(S, H, I, seed=S + H + I + 17, matmul_precision="mxfp8")
    out2 = run_mlp(inp, lnc=2, matmul_precision="mxfp8")
    assert len(first_spans) == 2, [s[:2] for s in first_spans]  # one per core
    for span, accumulators, calls in first_spans:
        assert (span, accumulators) == (SWITCH_INTERLEAVE_TILES + 1, SWITCH_INTERLEAVE_TILES + 1), (span, accumulators)
        accs = [c[0] for c in calls]
        pieces = FENCED_COLUMN_PIECES  # K tile by K tile, piece by piece, every accumulator
        assert len(set(accs)) == span and accs == accs[:span] * (k_tiles * pieces), calls
        assert [c[2] for c in calls] == [t > 0 for t in range(k_tiles) for _ in range(span * pieces)], calls
        assert all(c[1] == 1 for c in calls), calls
    assert_mlp_bit_exact_on_lnc1_and_lnc2(inp, out2, matmul_precision="mxfp8")
