"""Phase starts where VectorE's quantizes pace TensorE: phase 1's cold start (MatmulPlan cold_staging: the MLP
backward's W_down at TP8, all of it quantized before the first S tile's matmuls), phase 2's fenced start (its first
W_gu panel, quantized in column pieces under the first span) and phase 3's first X panel (quantized over phase 2's
tail, MatmulPlan.spread_first_load), and phase 1's W_down panel switches after its split along I (TP1): how those
quantizes read their sources, bit-exact on LNC1 and LNC2.
"""
import pytest

from nkilib.core.matmul import overlap as overlap_module
from nkilib.core.matmul import plan as plan_module
from nkilib.core.matmul import tiling as tiling_module
from simkit import (assert_matches_mx_exact, assert_mlp_traced_bit_exact_on_lnc1_and_lnc2, mlp_checkpoints, mlp_inputs,
                    mlp_inputs_with_checkpoints, mlp_reference, run_mlp, spy, unit_stride)

W_DOWN, W_GU, X = "down_proj_weight", "gate_up_weights", "hidden_states"


def _quantize_sources(trace, weight=W_DOWN):
    """{program: [(unit stride, source elements per partition, engine that wrote the source)]} of every quantize_mx
    whose source holds HBM tensor `weight`: a staging tile its DMAs wrote, or a copy of one (the copy's engine)."""
    out = {}
    for p in sorted({r.program for r in trace}):
        records = [r for r in trace if r.program == p]
        staging = {r.writes[0].storage_id for r in records
                   if r.engine == "dma" and r.reads and r.reads[0].name == weight}
        copies = {r.writes[0].storage_id: r.engine for r in records
                  if r.instr == "tensor_copy" and r.reads[0].storage_id in staging}
        sources = []
        for r in records:
            if r.instr != "quantize_mx":
                continue
            src = next(o for o in r.reads if o.arg == "src")
            if src.storage_id in staging:
                sources.append((unit_stride(src), src.nbytes // src.shape[0] // 2, "dma"))
            elif src.storage_id in copies:
                sources.append((unit_stride(src), src.nbytes // src.shape[0] // 2, copies[src.storage_id]))
        out[p] = sources
    return out


def _copies_land_in_quantized_words(trace, lnc, weight) -> None:
    """Per core: ScalarE's bf16 copies of `weight`'s staging tiles exist, and each lands in a tile that quantize_mx
    later writes words into (the next K tile's words allocation)."""
    for p in range(lnc):
        staging = {r.writes[0].storage_id for r in trace
                   if r.program == p and r.engine == "dma" and r.reads and r.reads[0].name == weight}
        copy_dsts = {r.writes[0].storage_id for r in trace if r.program == p and r.instr == "tensor_copy"
                     and r.engine == "scalar" and r.writes[0].dtype == "bfloat16" and r.reads[0].storage_id in staging}
        assert copy_dsts and copy_dsts <= _quantized_words(trace, p), (p, copy_dsts)


def _traced_runs_bit_exact(inp):
    """[(lnc, trace)] of the MXFP8 kernel on LNC1 and LNC2; asserts both runs' outputs equal mx_exact bit for bit and
    each other."""
    reference = mlp_reference(inp, matmul_precision="mxfp8")
    runs = []
    for lnc in (1, 2):
        res = run_mlp(inp, lnc=lnc, trace=True, matmul_precision="mxfp8")
        measured = assert_matches_mx_exact(res.outputs, reference)
        assert all(m == (0, 0.0) for m in measured), (lnc, measured)
        runs.append((lnc, res))
    for a, b in zip(runs[0][1].outputs, runs[1][1].outputs):
        assert a.tobytes() == b.tobytes()
    return [(lnc, res.trace) for lnc, res in runs]


def _quantized_words(trace, program):
    """Storage ids of the SBUF tiles that quantize_mx writes words into on one core."""
    return {next(o for o in r.writes if o.arg == "dst").storage_id for r in trace
            if r.program == program and r.instr == "quantize_mx"}


def test_cold_start_w_down_quantizes_half_of_each_k_tile_from_a_unit_stride_copy(monkeypatch):
    """At phase 1's cold start VectorE quantizes every K tile of W_down before the first S tile's matmuls, from the
    [P, 4, F] staging tile through a strided [P, F, 4] view (half VectorE's quantize rate in the cost model, a quarter
    pessimistic). With COLD_PERMUTE_INTO_NEXT_WORDS, ScalarE copies the last F // 2 columns of each K tile but the
    panel's last into the next K tile's words allocation as a unit-stride [P, F // 2, 4] bf16 tile, and VectorE
    quantizes those columns from it (TP8 modeled 0.61912 / 0.69893 -> 0.61780 / 0.68619 ms). H = 3072, I = 256: six
    K tiles of W_down in one n block (F = 256), S = 256 cold-staged. Per core: 4F source elements per partition and K
    tile, each K tile's 4F elements quantized, half (2F) of K tiles 0-4's from ScalarE copies, unit stride, into
    words that a later quantize_mx writes; K tile 5 whole from its staging tile. The old code quantized every K tile
    whole from the strided view: fails there. Bit-exact against mx_exact on LNC1 and LNC2, LNC1 equal to LNC2.
    Without cold staging (COLD_STAGING_MAX_M_TILES = 1), or with the constant off, no W_down source is a copy."""
    S, H, I = 256, 3072, 256
    k_tiles, elems = H // 512, 4 * I  # per K tile: [128, 4, I] bf16 staged, per partition
    assert tiling_module.COLD_PERMUTE_INTO_NEXT_WORDS
    inp = mlp_inputs(S, H, I, seed=S + H + I + 33)
    inp = {**inp, **mlp_checkpoints(inp, matmul_precision="mxfp8")}
    strided_half, copied_half = (False, elems // 2, "dma"), (True, elems // 2, "scalar")
    expected = [strided_half, copied_half] * (k_tiles - 1) + [(False, elems, "dma")]
    for lnc, trace in _traced_runs_bit_exact(inp):
        sources = _quantize_sources(trace)
        assert sources == {p: expected for p in range(lnc)}, sources
        _copies_land_in_quantized_words(trace, lnc, W_DOWN)

    whole = [(False, elems, "dma")] * k_tiles
    monkeypatch.setattr(tiling_module, "COLD_PERMUTE_INTO_NEXT_WORDS", False)
    res = run_mlp(inp, lnc=1, trace=True, matmul_precision="mxfp8")
    assert _quantize_sources(res.trace) == {0: whole}
    monkeypatch.setattr(tiling_module, "COLD_PERMUTE_INTO_NEXT_WORDS", True)
    monkeypatch.setattr(tiling_module, "COLD_STAGING_MAX_M_TILES", 1)  # not cold-staged
    res = run_mlp(inp, lnc=1, trace=True, matmul_precision="mxfp8")
    assert _quantize_sources(res.trace) == {0: whole}


def test_fenced_start_first_w_gu_panel_quantizes_its_second_pieces_from_unit_stride_copies(monkeypatch):
    """Phase 2's fenced start (where phase 1 spreads its along-S quantize) quantizes its first W_gu panel K tile by K
    tile in FENCED_COLUMN_PIECES = 2 column pieces, both from the strided view of the staging tile on the old code
    (phase 2's first span is VectorE-paced: ~12 us of TensorE idle pessimistic at TP8). From K tile
    FENCED_NEXT_WORDS_FROM_K_TILE = 1 on, all but the panel's last K tile, ScalarE copies the second piece into the next
    K tile's words as a unit-stride source (K tile 0's copy would wait behind phase 1's last ScalarE evictions): TP8
    modeled 0.61780 / 0.68619 -> 0.61780 / 0.68107 ms. S = 1024, H = 4096, I = 1536 (the shape of
    test_phase2_first_span_in_column_pieces): six K tiles per W_gu panel of 1024 columns, four n blocks. Per core: K
    tile 0's two pieces and K tile 5's strided, K tiles 1-4's first piece strided and second from a ScalarE copy (unit
    stride) into words that quantize_mx writes later; every later panel's K tiles whole and strided. Fails on the old
    code (every piece strided) and with FENCED_NEXT_WORDS_FROM_K_TILE = -1. Bit-exact against mx_exact on LNC1 and
    LNC2, LNC1 equal to LNC2."""
    from nkilib.core.matmul import span_columns as span_columns_module
    from nkilib.core.matmul.constants import FENCED_COLUMN_PIECES

    S, H, I = 1024, 4096, 1536
    k_tiles, n_block = 2 * I // 512, 1024
    first = span_columns_module.FENCED_NEXT_WORDS_FROM_K_TILE
    assert FENCED_COLUMN_PIECES == 2 and 0 < first < k_tiles - 1
    piece = 4 * n_block // 2  # source elements per partition of one column piece: [128, 512, 4]
    strided, copied = (False, piece, "dma"), (True, piece, "scalar")
    expected = ([strided, strided] * first + [strided, copied] * (k_tiles - 1 - first) + [strided, strided] +
                [(False, 2 * piece, "dma")] * (k_tiles * (H // n_block - 1)))
    inp = mlp_inputs(S, H, I, seed=S + H + I + 35)
    inp = {**inp, **mlp_checkpoints(inp, matmul_precision="mxfp8")}
    for lnc, trace in _traced_runs_bit_exact(inp):
        sources = _quantize_sources(trace, W_GU)
        assert sources == {p: expected for p in range(lnc)}, sources
        _copies_land_in_quantized_words(trace, lnc, W_GU)
    monkeypatch.setattr(span_columns_module, "FENCED_NEXT_WORDS_FROM_K_TILE", -1)  # none: every piece strided
    res = run_mlp(inp, lnc=1, trace=True, matmul_precision="mxfp8")
    assert _quantize_sources(res.trace, W_GU) == {0: [strided] * (2 * k_tiles) + expected[2 * k_tiles:]}


def _evictions_between_x_quantizes(trace, p) -> int:
    """ScalarE instructions reading PSUM (phase 2's evictions) between core p's first and last quantize_mx of X in
    program order."""
    records = [r for r in trace if r.program == p]
    staging = {r.writes[0].storage_id for r in records if r.engine == "dma" and r.reads and r.reads[0].name == X}
    copies = {r.writes[0].storage_id for r in records if r.instr == "tensor_copy" and r.reads[0].storage_id in staging}
    at = [i for i, r in enumerate(records) if r.instr == "quantize_mx" and
          next(o for o in r.reads if o.arg == "src").storage_id in staging | copies]
    return sum(1 for r in records[at[0]:at[-1]] if r.engine == "scalar" and any(o.buffer == "psum" for o in r.reads))


def test_phase3_first_x_panel_quantized_over_phase2_tail_half_from_unit_stride_copies(monkeypatch):
    """Phase 3's first X panel loads under phase 2's tail (PhaseGraph prefetch). The old code quantized all its K tiles
    there at once, whole from the strided [P, F, 4] view of their staging tiles (TP8: 6.96 us of TensorE idle at phase
    3's start, pessimistic). With MatmulPlan.spread_first_load (the kernel's phase 3) the prefetch quantizes
    SPREAD_FIRST_K_TILES = 2 K tiles, phase 2's remaining tiles one more every SPREAD_TILES_PER_K_TILE = 2 (so ScalarE's
    copies follow their staging DMAs in program order, between phase 2's evictions), and from K tile
    SPREAD_NEXT_WORDS_FROM_K_TILE = 1 on, all but the last, half of each K tile from a unit-stride ScalarE copy in the
    next K tile's words (TP8 modeled 0.61649 / 0.66834 -> 0.61649 / 0.66239 ms). S = 2048, H = 2048, I = 256: four K
    tiles along S of one X panel per core (phase 3 splits H: F = H / cores), two n blocks of phase 2. Per core: K tiles
    0 and 3 whole and strided, K tiles 1-2 half strided and half from a ScalarE copy (unit stride) into words
    quantize_mx writes later; phase 2's PSUM evictions between the first and the last of them. Fails on the old code
    (four whole strided quantizes, back to back) and with spread_first_load a no-op. Bit-exact against mx_exact on LNC1
    and LNC2, LNC1 equal to LNC2."""
    from nkilib.core.matmul import constants as constants_module

    S, H, I = 2048, 2048, 256
    k_tiles = S // 512
    assert (constants_module.SPREAD_FIRST_K_TILES, constants_module.SPREAD_TILES_PER_K_TILE,
            constants_module.SPREAD_NEXT_WORDS_FROM_K_TILE) == (2, 2, 1)
    # the copies wherever the spread starts (phase 2's head ends early at H = 2048, where round 43's
    # SPREAD_COPIES_TAIL_SHARE leaves them out: test_phase3_first_x_panel_begun_at_phase2_head_quantized_whole)
    monkeypatch.setattr(overlap_module, "SPREAD_COPIES_TAIL_SHARE", 1)

    def expected(lnc):
        elems = 4 * H // lnc  # per K tile: [128, 4, F] bf16 staged, per partition
        whole, halves = (False, elems, "dma"), [(False, elems // 2, "dma"), (True, elems // 2, "scalar")]
        return [whole] + halves * (k_tiles - 2) + [whole]

    def check(trace, lnc):
        assert _quantize_sources(trace, X) == {p: expected(lnc) for p in range(lnc)}
        _copies_land_in_quantized_words(trace, lnc, X)
        assert all(_evictions_between_x_quantizes(trace, p) > 0 for p in range(lnc))

    inp = mlp_inputs_with_checkpoints(S, H, I, seed=S + H + I + 38, kind="pow2")
    assert_mlp_traced_bit_exact_on_lnc1_and_lnc2(inp, check)
    monkeypatch.setattr(plan_module.MatmulPlan, "spread_first_load", lambda self: None)
    res = run_mlp(inp, lnc=1, trace=True)
    assert _quantize_sources(res.trace, X) == {0: [(False, 4 * H, "dma")] * k_tiles}
    assert _evictions_between_x_quantizes(res.trace, 0) == 0


def test_phase3_first_x_panel_begun_at_phase2_head_quantized_whole(monkeypatch):
    """Round 43 (MatmulPlan.prefetch_point, SPREAD_COPIES_TAIL_SHARE = 2): where phase 2 has more than half of its
    tiles left at the prefetch point (H = 2048: two n blocks, its head ends at tile 2), phase 3's spread first X panel
    takes no unit-stride copies: every K tile quantized whole from its staging tile, still spread over phase 2's run
    (evictions between the first and the last quantize). Those copies, each the first access of a new words piece, left
    S = 4096, H = 2048, I = 1536 with no SBUF placement. S = 2048, H = 2048, I = 256 (the shape of the test above, whose
    copies come back with the share set to 1): per core, the decision taken once, from phase 2's (tiles left, tiles);
    bit-exact against mx_exact on LNC1 and LNC2, LNC1 equal to LNC2, the race checker silent (run_mlp raises on a
    race). Fails on the old code (K tiles 1-2 half from a ScalarE copy; no prefetch_point)."""
    points = []
    original = plan_module.MatmulPlan.prefetch_point

    def record(self, nxt):
        original(self, nxt)
        if nxt.spread_first:
            points.append((len(self.order) - self.done, len(self.order), nxt.spread_copies))

    monkeypatch.setattr(plan_module.MatmulPlan, "prefetch_point", record)
    S, H, I = 2048, 2048, 256
    k_tiles = S // 512

    def check(trace, lnc):
        elems = 4 * H // lnc  # per K tile: [128, 4, F] bf16 staged, per partition
        assert _quantize_sources(trace, X) == {p: [(False, elems, "dma")] * k_tiles for p in range(lnc)}
        assert all(_evictions_between_x_quantizes(trace, p) > 0 for p in range(lnc))

    inp = mlp_inputs_with_checkpoints(S, H, I, seed=S + H + I + 43, kind="pow2")
    assert_mlp_traced_bit_exact_on_lnc1_and_lnc2(inp, check)
    assert points and all(left * 2 > tiles and not copies for left, tiles, copies in points), points


@pytest.mark.parametrize("spare_pieces", [0, 1], ids=["piece-short", "piece-spare"])
def test_phase3_spread_copies_only_with_a_words_piece_spare(monkeypatch, spare_pieces):
    """Round 47 (overlap.spread_copies_fit, SPREAD_COPIES_SPARE_PIECES = 1): phase 3's spread first X panel takes its
    unit-stride copies under phase 2's tail only where it fits beside phase 2's held bytes with one words piece
    (MX_PANEL_PIECE_BYTES) to spare beyond PREFETCH_MARGIN_BYTES: each copy first accesses the next K tile's words piece
    before its own K tile's quantize (S = 4608, H = 4096, I = 1536 fitted with 0 B spare and that copy found no SBUF
    placement). S = 2048, H = 2048, I = 256 with the copies' tail share at 1 (the copies test above); a shape-only probe
    reads phase 2's held bytes and phase 3's first load (own rings) at LNC2 as the planner counts them, and
    PREFETCH_MARGIN_BYTES is set so that the load still fits with one byte less than a piece spare (piece-short: every
    X K tile quantized whole from its staging tile, still spread over phase 2's run) or exactly a piece (piece-spare:
    K tiles 1-2 half from ScalarE copies, as before). Bit-exact against mx_exact on LNC1 and LNC2 (LNC1's larger
    panels do not fit that budget: no spread there), LNC1 equal to LNC2, the race checker silent. piece-short fails on
    the old code (K tiles 1-2 half from copies: ran against main's package)."""
    from nkilib.core.matmul.constants import MX_PANEL_PIECE_BYTES, usable_sbuf_bytes
    from nkilib.examples.mlp_backward_cost import model_mlp_backward

    S, H, I = 2048, 2048, 256
    k_tiles = S // 512
    monkeypatch.setattr(overlap_module, "SPREAD_COPIES_TAIL_SHARE", 1)
    probe = spy(monkeypatch, plan_module.MatmulPlan, "prefetch_point", lambda plan, nxt: (
        plan.held_bytes(), nxt.first_bytes(own_rings=True)) if nxt.spread_first else None)
    model_mlp_backward(S, H, I, "trn3", "mxfp8", 2, False, ("central",))
    assert len(set(probe)) == 1, probe  # alike on both cores
    held, first = probe[0]
    margin = usable_sbuf_bytes() - held - first - MX_PANEL_PIECE_BYTES + (1 - spare_pieces)
    monkeypatch.setattr(overlap_module, "PREFETCH_MARGIN_BYTES", margin)

    def check(trace, lnc):
        if lnc == 1:
            return
        elems = 4 * H // lnc  # per K tile: [128, 4, F] bf16 staged, per partition
        whole, halves = (False, elems, "dma"), [(False, elems // 2, "dma"), (True, elems // 2, "scalar")]
        inner = halves * (k_tiles - 2) if spare_pieces else [whole] * (k_tiles - 2)
        assert _quantize_sources(trace, X) == {p: [whole] + inner + [whole] for p in range(lnc)}
        assert all(_evictions_between_x_quantizes(trace, p) > 0 for p in range(lnc))

    inp = mlp_inputs_with_checkpoints(S, H, I, seed=S + H + I + 47, kind="pow2")
    assert_mlp_traced_bit_exact_on_lnc1_and_lnc2(inp, check)


def test_phase3_first_x_panel_after_phase4_short_tail_quantized_whole(monkeypatch):
    """Round 45 (MatmulPlan.short_tail_loads_whole, overlap.spread_fits_tail): where PhaseGraph puts phase 4 before
    phase 3 and phase 4's tiles left at the prefetch point take under 1 / SHORT_TAIL_SPREAD_SHARE of the spread's
    schedule (SPREAD_TILES_PER_K_TILE per K tile beyond SPREAD_FIRST_K_TILES), phase 3's first X panel is quantized
    whole there: S = 4096, H = 7168, I = 2048 (3 of phase 4's 28 tiles left, 12 in the schedule) 1.63229 / 1.78763 ->
    1.62009 / 1.76908 ms. S = 2048, H = 512, I = 512 at LNC2: phase 4 (2 tiles per core) goes first, 1 tile left, 4 in
    the schedule (four K tiles); per core every X K tile quantized whole (strided) from its staging tile, no ScalarE
    copies (the spread there took them: K tiles 1-2 half from a copy), the decision recorded at phase 4's prefetch
    point; bit-exact against mx_exact on LNC1 and LNC2, LNC1 equal to LNC2, the race checker silent. Fails on the old
    code (the copies; no short_tail_whole)."""
    points = []
    original = plan_module.MatmulPlan.prefetch_point

    def record(self, nxt):
        spread = nxt.spread_first
        original(self, nxt)
        if spread:
            points.append((len(self.order) - self.done, self.short_tail_whole, nxt.spread_first))

    monkeypatch.setattr(plan_module.MatmulPlan, "prefetch_point", record)
    S, H, I = 2048, 512, 512
    k_tiles = S // 512

    def check(trace, lnc):
        if lnc == 2:
            elems = 4 * H  # per K tile: [128, 4, H] bf16 staged, per partition (phase 3 splits 2I here, not H)
            assert _quantize_sources(trace, X) == {p: [(False, elems, "dma")] * k_tiles for p in range(lnc)}

    inp = mlp_inputs_with_checkpoints(S, H, I, seed=S + H + I + 45, kind="pow2")
    assert_mlp_traced_bit_exact_on_lnc1_and_lnc2(inp, check)
    assert (1, True, False) in points and points.count((1, True, False)) == 2, points  # LNC2: one per core


def test_phase1_w_down_switches_quantize_half_of_each_k_tile_from_a_unit_stride_copy(monkeypatch):
    """After phase 1's split along I (dY kept whole, W_down's panels streamed one at a time, n-major: TP1), each new
    W_down panel is quantized at its switch while TensorE waits; with SWITCH_NEXT_WORDS_FROM_K_TILE (0), every K tile
    but each panel's last quantizes its last F // 2 columns from a unit-stride copy that ScalarE makes in the next K
    tile's words (TP1 modeled 4.50781 / 4.67654 -> 4.50202 / 4.63161 ms). Forced on S = 256, H = 1024, I = 768 with
    128-column phase-1 tiles (each core: 384 I columns in three W_down panels of F = 128, 2 MXFP8 K tiles each): per
    core, every panel's K tile 0 half from its staging tile (strided) and half from a ScalarE copy, K tile 1 whole
    from its staging tile, the copies landing in words a later quantize_mx writes. The old code quantized every K tile
    whole from the strided view: fails there. Bit-exact against mx_exact on LNC2 (race checker on) and LNC1 (no
    split), LNC1 equal to LNC2."""
    from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8.config import MatmulConfig, MlpBwdMatmulConfig

    monkeypatch.setattr(tiling_module, "PANEL_CACHE_BUDGET_BYTES", 1)
    assert tiling_module.SWITCH_NEXT_WORDS_FROM_K_TILE == 0
    S, H, I, F = 256, 1024, 768, 128
    elems = 4 * F  # per K tile and partition: [128, 4, F] bf16 staged
    inp = mlp_inputs_with_checkpoints(S, H, I, seed=S + H + I + 46, matmul_precision="mxfp8")
    config = MlpBwdMatmulConfig(phase1=MatmulConfig(n_tile=F))
    panel = [(False, elems // 2, "dma"), (True, elems // 2, "scalar"), (False, elems, "dma")]

    def check(trace, lnc):
        if lnc == 2:
            sources = _quantize_sources(trace)
            assert sources == {p: panel * 3 for p in range(2)}, sources
            _copies_land_in_quantized_words(trace, lnc, W_DOWN)

    assert_mlp_traced_bit_exact_on_lnc1_and_lnc2(inp, check, matmul_precision="mxfp8", matmul_config=config)


def test_phase1_next_w_down_panel_quantized_ahead_of_its_switch_in_a_words_ring(monkeypatch):
    """After phase 1's split along I (TP1), each W_down panel's words take K-tile slots of one ring per core
    (PanelWordsRing, SWITCH_AHEAD_SLOTS beyond a panel), so the next panel's first SWITCH_AHEAD_SLOTS - 1 K tiles are
    quantized into slots of their own while the tiles before its switch still read the current panel, and dY's kept
    panels take one block (PanelSource.kept_slots: one by one they left SBUF in gaps no ahead slot fitted). TP1
    modeled 4.50202 / 4.63161 -> 4.47016 / 4.61314 ms. Forced on S = 512, H = 2048, I = 1536 with 256-column
    phase-1 tiles (each core: three W_down panels of F = 256 with 4 MXFP8 K tiles, four S tiles each, so 16 dI matmuls
    per panel): per core the W_down words go to two SBUF allocations (the ring's panel slots and its ahead slots; the
    old code: one per panel), dY's words to one, and each later panel's first K tiles are quantized before the
    previous panel's last S tile's matmuls (the old code: after them, at the switch). Bit-exact against mx_exact on LNC2 (race checker
    on) and LNC1, LNC1 equal to LNC2."""
    from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8.config import MatmulConfig, MlpBwdMatmulConfig

    monkeypatch.setattr(tiling_module, "PANEL_CACHE_BUDGET_BYTES", 1)
    ahead = tiling_module.SWITCH_AHEAD_SLOTS - 1
    assert ahead >= 1
    S, H, I, F = 512, 2048, 1536, 256
    k_tiles, s_tiles, panels = H // 512, S // 128, 3
    inp = mlp_inputs_with_checkpoints(S, H, I, seed=S + H + I + 48, matmul_precision="mxfp8")
    config = MlpBwdMatmulConfig(phase1=MatmulConfig(n_tile=F))

    def check(trace, lnc):
        if lnc != 2:
            return
        for p in range(lnc):
            records = [r for r in trace if r.program == p]
            staging = {r.writes[0].storage_id for r in records
                       if r.engine == "dma" and r.reads and r.reads[0].name == W_DOWN}
            copies = {r.writes[0].storage_id for r in records
                      if r.instr == "tensor_copy" and r.reads[0].storage_id in staging}
            quantizes = [r for r in records if r.instr == "quantize_mx" and
                         next(o for o in r.reads if o.arg == "src").storage_id in staging | copies]
            words = {next(o for o in r.writes if o.arg == "dst").storage_id for r in quantizes}
            assert len(words) == 2, (p, words)
            matmuls = [r for r in records if r.instr == "nc_matmul_mx" and
                       next(o for o in r.reads if o.arg == "moving").storage_id in words]
            dy_words = {next(o for o in r.reads if o.arg == "stationary").storage_id for r in matmuls}
            assert len(dy_words) == 1, (p, dy_words)
            per_panel = s_tiles * k_tiles
            assert len(matmuls) == panels * per_panel, (p, len(matmuls))
            # K tile of each quantize (its column pieces write one K-tile slot: [128, F] x4 words, 4F bytes)
            slots = [(o.storage_id, o.byte_lo // (4 * F)) for o in
                     (next(o for o in r.writes if o.arg == "dst") for r in quantizes)]
            k_tile_of = [0]
            for a, b in zip(slots, slots[1:]):
                k_tile_of.append(k_tile_of[-1] + (a != b))
            assert k_tile_of[-1] + 1 == panels * k_tiles, (p, k_tile_of)
            for panel in range(1, panels):
                for t in range(ahead):
                    last = max(q.seq for q, k in zip(quantizes, k_tile_of) if k == panel * k_tiles + t)
                    before = sum(1 for r in matmuls if r.seq < last)
                    assert before <= panel * per_panel - k_tiles, (p, panel, t, before)

    assert_mlp_traced_bit_exact_on_lnc1_and_lnc2(inp, check, matmul_precision="mxfp8", matmul_config=config)
