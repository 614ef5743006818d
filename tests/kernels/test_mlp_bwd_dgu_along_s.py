"""d_gate_up quantized along S on chip in phase 1's epilogue (SwigluBackwardEpilogue.exchange_along_s).

When every core's S rows are whole 512-row K tiles of phase 3 and phase 1 runs S-tile-major, each core
stages its finished d_gate_up row blocks into phase 3's interleaved layout (SBUF -> SBUF DMA), quantizes
them along S and stores the MX words and scales to shared HBM (panels.store_k_tile); after the barrier,
phase 3 reads both cores' halves as they are. The MX groups are the scheme's groups along S, as when
phase 3 quantized the bf16 rows itself, so the outputs stay mx_exact bit for bit (pow2 inputs: which
elements share a group decides the result). Expected values: reference.py mode "mx_exact".
"""
from __future__ import annotations

import pytest

import nki.language as nl
from simkit import (assert_matches_mx_exact, assert_mlp_traced_bit_exact_on_lnc1_and_lnc2, mlp_checkpoints, mlp_inputs,
                    mlp_inputs_with_checkpoints, mlp_reference, run_mlp, unit_stride)

from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8 import mlp_bwd_mxfp8_epilogue as epilogue_module
from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8.constants import GATE_FIRST_S_TILES

MX_WORDS, BF16_ROWS = "mlp_bwd_d_gate_up_mx", "mlp_bwd_d_gate_up"


def _hbm_writes(res, name):
    return sum(1 for r in res.trace for o in r.writes if o.name == name)


def _spread_run(S, H, I, seed, lnc):
    """(inputs, traced run) with every checkpoint and phase 1 in n blocks of 512 columns (phase1_tiles_n=1): with
    I = 1024 two n blocks, so the along-S quantize is spread over two S tiles, four chunks per K tile."""
    inp = mlp_inputs_with_checkpoints(S, H, I, seed=seed, kind="pow2")
    return inp, run_mlp(inp, lnc=lnc, trace=True, phase1_tiles_n=1)


def _along_s_instructions(res, p):
    """Core p's trace records and the indices (program order) of its stores of d_gate_up's words along S, the
    quantize_mx that wrote the first words of each store's chunk (since round 36 a chunk may be quantized in two
    column ranges), and its MX matmuls."""
    records = [r for r in res.trace if r.program == p]
    stores = [i for i, r in enumerate(records) if r.instr == "dma_copy" and any(o.name == MX_WORDS for o in r.writes)]
    firsts = {(records[i].reads[0].storage_id, records[i].reads[0].byte_lo) for i in stores}  # each chunk's first word
    along_s = [i for i, r in enumerate(records) if r.instr == "quantize_mx" and
               (r.writes[0].storage_id, r.writes[0].byte_lo) in firsts]
    matmuls = [i for i, r in enumerate(records) if r.instr == "nc_matmul_mx"]
    return records, stores, along_s, matmuls


@pytest.mark.parametrize("scheme, lnc, packing, checkpoints, fp8", [
    ("1x32", 2, True, True, "float8_e4m3fn_x4"),
    ("wrapX", 2, True, False, "float8_e5m2_x4"),
    ("1x32", 1, False, False, "float8_e4m3fn_x4"),
])
def test_along_s_path_is_bit_exact(scheme, lnc, packing, checkpoints, fp8):
    S, H, I = 1024, 128, 64  # LNC2: 512 rows (one K tile of phase 3) per core; LNC1: two K tiles
    inp = mlp_inputs(S, H, I, seed=11, kind="pow2")
    if checkpoints:
        inp = {**inp, **mlp_checkpoints(inp, quant_scheme=scheme, fp8_x4_dtype=getattr(nl, fp8))}
    options = dict(quant_scheme=scheme, use_scale_packing=packing, fp8_x4_dtype=getattr(nl, fp8))
    res = run_mlp(inp, lnc=lnc, trace=True, **options)
    # each core stores its K tiles' words once (S / 512 K tiles in all); no bf16 d_gate_up rows go to HBM
    # (phase 2 keeps them on chip as its stationary panels)
    assert _hbm_writes(res, MX_WORDS) == S // 512
    assert _hbm_writes(res, BF16_ROWS) == 0
    assert_matches_mx_exact(res.outputs, mlp_reference(inp, **options))


def test_rows_not_in_whole_k_tiles_take_the_bf16_path():
    """S = 768 under LNC2: the cores' rows (512 / 256) are not whole 512-row K tiles of phase 3, so phase 1
    stores bf16 rows and phase 3 quantizes them; same numerics."""
    S, H, I = 768, 128, 64
    inp = mlp_inputs(S, H, I, seed=12, kind="pow2")
    res = run_mlp(inp, lnc=2, trace=True)
    assert _hbm_writes(res, MX_WORDS) == 0 and _hbm_writes(res, BF16_ROWS) > 0
    assert_matches_mx_exact(res.outputs, mlp_reference(inp))


@pytest.mark.parametrize("lnc", [1, 2])
def test_along_s_quantize_spread_over_two_s_tiles_and_stored_per_chunk(lnc):
    """Phase 1 in two n blocks (phase1_tiles_n=1: 512 columns, I = 1024; the K tile's staging tile [128, 4, 2I] bf16
    is 16 KiB, within ALONG_S_SPREAD_STAGING_BYTES): each finished K tile along S is quantized in four chunks of I / 2
    columns, one per epilogue call of the next two S tiles (spreads_along_s), and each chunk's words are stored right
    after its quantize, at its columns of the panel layout (store_k_tile f0). So every K tile but the last (whose
    chunks finish() or the barrier's flush_along_s issue back to back) has phase-1 matmuls between consecutive chunks.
    Round 17's code quantized two chunks of I columns within one S tile: fails the count; two chunks per epilogue
    call fails the matmuls between them. Bit-exact against mx_exact on LNC1 and LNC2 (each column's words and scales
    do not depend on how the columns are cut or when they are quantized)."""
    S, H, I = 2048, 128, 1024
    inp, res = _spread_run(S, H, I, S + H + I + 17, lnc)
    chunks = 4  # 2 n blocks x ALONG_S_SPREAD_S_TILES
    for p in range(lnc):
        records, stores, along_s, matmuls = _along_s_instructions(res, p)
        k_tiles = S // lnc // 512
        assert len(stores) == chunks * k_tiles, (p, stores)
        assert len(along_s) == chunks * k_tiles, (p, along_s)
        for t in range(k_tiles):
            for c in range(chunks):
                j = chunks * t + c
                # each chunk's store right after its quantize, before the next chunk
                assert along_s[j] < stores[j], (p, t, c, stores, along_s)
                if c + 1 < chunks:
                    assert stores[j] < along_s[j + 1], (p, t, c, stores, along_s)
                    if t + 1 < k_tiles:  # one chunk per epilogue call: a tile's matmuls between two chunks
                        assert any(along_s[j] < m < along_s[j + 1] for m in matmuls), (p, t, c)
        widths = sorted({o.shape[1] for i in stores for o in records[i].writes if o.name == MX_WORDS})
        assert widths == [I // 2], widths
    assert_matches_mx_exact(res.outputs, mlp_reference(inp))


@pytest.mark.parametrize("lnc", [1, 2])
def test_chunks_along_s_quantized_after_their_call_products(lnc):
    """Spread over two S tiles (as in the test above: two n blocks, four chunks per K tile), a K tile's last chunk along
    S, and chunk 1 of each core's first K tile, are quantized after their epilogue call's SwiGLU products (the VectorE
    products that read the tile's PSUM accumulator), the other chunks before theirs: VectorE runs in program order, so
    the products, which GpSimd's d_gate product and the PE transposes of phase 2's panel wait for, go first (TP8
    modeled 0.6219 / 0.7005 -> 0.6208 / 0.7014 ms). Round 26's code quantizes every chunk before its call's products:
    fails; all four after them, or chunk 1 of every K tile, fails too. The K tiles whose chunks finish() or
    flush_along_s issue (the last one) are not checked. Bit-exact against mx_exact on LNC1 and LNC2 (the same
    quantize_mx and store of the same staged columns, later in program order)."""
    S, H, I = 2048, 128, 1024
    inp, res = _spread_run(S, H, I, S + H + I + 27, lnc)
    chunks = 4  # 2 n blocks x ALONG_S_SPREAD_S_TILES
    for p in range(lnc):
        records, _, along_s, matmuls = _along_s_instructions(res, p)
        products = [i for i, r in enumerate(records) if r.instr in ("tensor_tensor", "scalar_tensor_tensor") and
                    any(o.buffer == "psum" for o in r.reads)]
        k_tiles = S // lnc // 512
        assert len(along_s) == chunks * k_tiles, (p, along_s)
        for t in range(k_tiles - 1):
            for c in range(chunks):
                q = along_s[chunks * t + c]
                call = max(m for m in matmuls if m < q)  # the epilogue call after this tile's matmuls
                after_products = any(call < k < q for k in products)
                assert after_products == (c == chunks - 1 or (c == 1 and t == 0)), (p, t, c, q, call)
    assert_matches_mx_exact(res.outputs, mlp_reference(inp))


def _along_s_chunk_sources(trace, p):
    """Per chunk along S of core p (its stores of d_gate_up's words, program order): the quantize_mx that write the
    chunk's words, as (unit-stride source, source elements per partition, where the source is): "staging" (the K
    tile's [P, 4, 2I] staging tile) or ("scalar", c) (a bf16 copy of that staging tile by ScalarE, placed at words
    column c of the same words tile; x4 words are 4 bytes)."""
    records = [r for r in trace if r.program == p]
    stores = [r.reads[0] for r in records if r.instr == "dma_copy" and any(o.name == MX_WORDS for o in r.writes)]
    words_tiles = {o.storage_id for o in stores}
    copies, quantizes = {}, []
    for r in records:
        if r.instr == "tensor_copy" and r.writes[0].storage_id in words_tiles:
            w = r.writes[0]
            copies[(w.storage_id, w.byte_lo)] = (r.engine, w.dtype, r.reads[0].storage_id)
        elif r.instr == "quantize_mx" and r.writes[0].storage_id in words_tiles:
            quantizes.append((r.writes[0], next(o for o in r.reads if o.arg == "src")))
    chunks = []
    for store in stores:
        parts = [(dst, src) for dst, src in quantizes
                 if dst.storage_id == store.storage_id and store.byte_lo <= dst.byte_lo < store.byte_hi]
        staging = parts[0][1].storage_id
        sources = []
        for dst, src in parts:
            elems = src.nbytes // src.shape[0] // 2  # bf16
            if src.storage_id == staging:
                sources.append((unit_stride(src), elems, "staging"))
            else:
                engine, dtype, copied_from = copies[(src.storage_id, src.byte_lo)]
                assert src.storage_id == store.storage_id and dtype == "bfloat16" and copied_from == staging
                sources.append((unit_stride(src), elems, (engine, src.byte_lo // 4)))
        chunks.append(sources)
    return chunks


def test_along_s_chunks_quantize_their_last_half_from_a_unit_stride_copy(monkeypatch):
    """Phase 1's quantize along S reads the K tile's [P, 4, 2I] staging tile through a strided [P, cols, 4] view (half
    VectorE's quantize rate in the cost model, a quarter pessimistic), and at TP8's S tile switches those chunks pace
    TensorE. With ALONG_S_HALF_FROM_COPY, ScalarE copies each chunk's last half into words the chunk does not write, as
    a unit-stride bf16 [P, half, 4] tile, and VectorE quantizes that half from it: chunks 0-2 into the next chunk's
    words (written later by that chunk's own quantize), chunk 3 (spread over two S tiles: its first chunk was stored
    an S tile earlier) into chunk 0's. The chunks finish() / flush_along_s issue (each core's last K tile) stay whole
    and strided (at the barrier the copies waited behind phase 2's start: TP8 +6.9 us central). TP8 modeled 0.61780 /
    0.68107 -> 0.61670 / 0.67465 ms. Spread as in the tests above (S = 2048, I = 1024, four chunks of 512 columns per
    K tile). The old code (every chunk one strided quantize) fails; so does the constant off. Bit-exact against
    mx_exact on LNC1 and LNC2, LNC1 equal to LNC2 (MX groups run along S, never across columns)."""
    S, H, I = 2048, 128, 1024
    width, chunks = I // 2, 4  # columns per chunk; 2 n blocks x ALONG_S_SPREAD_S_TILES
    assert epilogue_module.ALONG_S_HALF_FROM_COPY
    whole = [(False, 4 * width, "staging")]
    halves = [[(False, 2 * width, "staging"), (True, 2 * width, ("scalar", (c + 1) % chunks * width))]
              for c in range(chunks)]

    def k_tiles(lnc):
        return S // lnc // 512

    def check(trace, lnc):
        expected = halves * (k_tiles(lnc) - 1) + [whole] * chunks
        for p in range(lnc):
            assert _along_s_chunk_sources(trace, p) == expected, (lnc, p)

    inp = mlp_inputs_with_checkpoints(S, H, I, seed=S + H + I + 36, kind="pow2")
    assert_mlp_traced_bit_exact_on_lnc1_and_lnc2(inp, check, phase1_tiles_n=1)
    monkeypatch.setattr(epilogue_module, "ALONG_S_HALF_FROM_COPY", False)
    for lnc in (1, 2):
        res = run_mlp(inp, lnc=lnc, trace=True, phase1_tiles_n=1)
        assert all(_along_s_chunk_sources(res.trace, p) == [whole] * (chunks * k_tiles(lnc)) for p in range(lnc))


@pytest.mark.parametrize("lnc", [1, 2])
def test_last_s_tile_gate_products_first_and_its_staging_copy_on_swdge(lnc):
    """Spread over two S tiles and deferred to the barrier's flush (LNC2; two n blocks as above), each core's last S
    tile computes d_gate's PSUM product (dI * uc, an fp32 temporary) before d_up's (dI * a, written as bf16) in both
    its epilogue calls, every other tile d_up's first, and that tile's along-S staging copy (the last row block of the
    core's last K tile, SBUF -> SBUF) is the one DMA with dge_mode swdge: GpSimd's d_gate product and the last panel's
    transposes start earlier, and the copy, read only by flush_along_s, waits in GpSimd's queue instead of sharing the
    DMA queues with phase 2's first W_gu K tiles (TP8 modeled 0.62082 / 0.70143 -> 0.62068 / 0.70053 ms). LNC1 (no
    deferred flush): d_up first everywhere, no swdge copy. Round 27's code: d_up first everywhere, fails under LNC2.
    Since round 29 the last GATE_FIRST_S_TILES (2) S tiles issue d_gate's product first (the swdge copy stays the
    last tile's only); round 28's code (the last tile only) fails under LNC2.
    Bit-exact against mx_exact on LNC1 and LNC2 (the same products in another order, the same copy)."""
    S, H, I = 2048, 128, 1024
    inp = mlp_inputs_with_checkpoints(S, H, I, seed=S + H + I + 28, kind="pow2")
    res = run_mlp(inp, lnc=lnc, trace=True, phase1_tiles_n=1)
    calls = S // lnc // 128 * 2  # epilogue calls per core: S tiles x 2 n blocks
    for p in range(lnc):
        records = [r for r in res.trace if r.program == p]
        products = [r for r in records if r.instr in ("tensor_tensor", "scalar_tensor_tensor") and
                    any(o.buffer == "psum" for o in r.reads)]
        assert len(products) == 2 * calls, (p, len(products))
        # per call: d_up's product writes its bf16 rows, d_gate's first one an fp32 temporary
        first = [products[2 * c].writes[0].dtype for c in range(calls)]
        gate_first_calls = 2 * GATE_FIRST_S_TILES if lnc == 2 else 0
        # since round 39 also the first n block of S tiles 0-3 (no along-S chunk to quantize there; the d_gate PSUM
        # product alone first, test_mlp_bwd_switch_engine.py::test_plain_switch_gate_psum_product_first)
        plain = [c for c in range(0, 8, 2)] if lnc == 2 else []
        assert first == [("float32" if c in plain or c >= calls - gate_first_calls else "bfloat16")
                         for c in range(calls)], (p, first)
        swdge = [r for r in records if r.instr == "dma_copy" and r.attrs.get("dge_mode") == "swdge"]
        assert len(swdge) == (1 if lnc == 2 else 0), (p, len(swdge))
        for r in swdge:  # the staging copy: SBUF rows [128, 2I] into a staging slot [32, 4, 2I]
            assert r.reads[0].buffer == "sbuf" and r.writes[0].buffer == "sbuf", r
            assert r.writes[0].shape == (32, 4, 2 * I), r.writes[0].shape
    assert_matches_mx_exact(res.outputs, mlp_reference(inp))


def _phase_labelled_runs(S, H, I, seed):
    """[(lnc, RunResult)] of the kernel on LNC1 and LNC2 with every checkpoint given, its trace's records labelled by
    phase (attrs["phase"]); asserts each run's outputs == mx_exact and LNC1's == LNC2's bit for bit first.

    Dimensions: output_grad / hidden_states [S, H], down_proj_weight [H, I], gate_up_weights [2I, H] (mlp_inputs).
    """
    return assert_mlp_traced_bit_exact_on_lnc1_and_lnc2(mlp_inputs_with_checkpoints(S, H, I, seed=seed), phases=True)


def test_last_phase2_panel_quantized_after_phase2_first_w_gu_quantize():
    """Where phase 1 spreads its along-S quantize (TP8: two n blocks, a 24 KiB staging tile), the last S tile's phase-2
    stationary panel is transposed in phase 1's finish() as before but quantized when phase 2 first reads it
    (row_panels.DeferredRowPanel, ResidentPanels.get): its first K tile right away (that write places the panel's
    words), the other K tiles after phase 2's first W_gu quantize, which VectorE (program order) then no longer runs
    behind them; phase 2's first matmuls read the first S tiles' panels, not this one (TP8 modeled 0.6272 / 0.7117 ->
    0.6248 / 0.7026 ms). The K tiles of d_up's columns [I, 2I) are staged first (VectorE's first product writes them
    while GpSimd computes d_gate's), so the one quantized right away is d_up's first, K tile I / 512 (0.6243 ms; K
    tile 0 before: fails there). Every other panel is quantized before the first W_gu quantize, and every phase-1 PE
    transpose still precedes phase 2's first matmul. On round 21's code all six K tiles of the last panel are
    quantized before the first W_gu quantize: fails there. S = 1024, H = 4096, I = 1536: four m tiles per core under
    LNC2, six K tiles (2I = 3072) per panel. Bit-exact against mx_exact on LNC1 and LNC2 (the same quantize_mx of the
    same staged K tiles, later in program order)."""
    S, H, I = 1024, 4096, 1536
    k_tiles = 2 * I // 512
    for lnc, res in _phase_labelled_runs(S, H, I, seed=S + H + I + 22):
        for p in range(lnc):
            records = [r for r in res.trace if r.program == p]
            phase = [r.attrs.get("phase") for r in records]
            matmuls = [i for i, r in enumerate(records) if phase[i] == "phase2" and r.instr == "nc_matmul_mx"]
            operand = {arg: {next(o.storage_id for o in records[i].reads if o.arg == arg) for i in matmuls}
                       for arg in ("stationary", "moving")}
            quantizes = [i for i, r in enumerate(records) if r.instr == "quantize_mx"]
            first_w_gu = min(i for i in quantizes if records[i].writes[0].storage_id in operand["moving"])
            panels = {}  # words storage -> its quantizes, in program order
            for i in quantizes:
                sid = records[i].writes[0].storage_id
                if sid in operand["stationary"]:
                    panels.setdefault(sid, []).append(i)
            m_tiles = S // lnc // 128
            assert len(panels) == m_tiles and all(len(q) == k_tiles for q in panels.values()), (p, panels)
            last = max(panels, key=lambda sid: panels[sid][-1])
            first_read = min(i for i in matmuls if any(o.storage_id == last for o in records[i].reads))
            early = [i for i in panels[last] if i < first_w_gu]
            assert len(early) == 1 and max(panels[last]) < first_read, (p, panels[last], first_w_gu, first_read)
            words = records[early[0]].writes[0]  # K tile t of the panel's words [128, K tiles, 128] x4 (4 B each)
            assert words.byte_lo // (128 * 4) == I // 512, (p, words.byte_lo)
            assert all(max(q) < first_w_gu for sid, q in panels.items() if sid != last), (p, panels, first_w_gu)
            transposes = [i for i, r in enumerate(records) if phase[i] == "phase0+1" and r.instr == "nc_transpose"]
            assert max(transposes) < min(matmuls), p


def test_phase2_first_span_in_column_pieces():
    """Where phase 1 spreads its along-S quantize (the fence after phase 2's first W_gu panel), phase 2's first W_gu
    panel is quantized K tile by K tile in two column pieces of 512 (its n block: 1024 columns) and the fenced start's
    first span (four m tiles) multiplies each K tile piece by piece, the first piece's matmuls of every tile, then the
    second's (MatmulPlan.piece_first_span, span_columns.py), and evicts its tiles piece by piece: TensorE starts on a K
    tile's first half while VectorE quantizes the second (TP8 modeled 0.62068 -> 0.62024 ms central). Every later
    panel, matmul and eviction stays whole. Round 28's code quantizes, multiplies and evicts whole: fails. S = 1024,
    H = 4096, I = 1536 (W_gu's 98 KiB panels fit no panel cache: n-major, four n blocks of six K tiles), LNC1 and LNC2;
    bit-exact against mx_exact (a column's MX groups and fp32 sums do not depend on the columns beside it), LNC1 equal
    to LNC2."""
    S, H, I = 1024, 4096, 1536
    k_tiles, n_block, span = 2 * I // 512, 1024, 4
    for lnc, res in _phase_labelled_runs(S, H, I, seed=S + H + I + 29):
        for p in range(lnc):
            records = [r for r in res.trace if r.program == p and r.attrs.get("phase") == "phase2"]
            matmuls = [r for r in records if r.instr == "nc_matmul_mx"]
            moving = {next(o.storage_id for o in r.reads if o.arg == "moving") for r in matmuls}
            w_gu = [r.writes[0].shape[1] for r in records if r.instr == "quantize_mx" and
                    r.writes[0].storage_id in moving]
            pieces = 2 * k_tiles  # the first panel's quantizes
            assert w_gu == [n_block // 2] * pieces + [n_block] * (k_tiles * (H // n_block - 1)), (p, w_gu)
            widths = [r.writes[0].shape[1] for r in matmuls]
            assert widths == [n_block // 2] * (span * pieces) + [n_block] * (len(widths) - span * pieces), (p, widths)
            for t in range(k_tiles):  # per K tile: the span's first halves (PSUM columns [0, 512)), then second halves
                cols = [r.writes[0].byte_lo % (n_block * 4) for r in matmuls[2 * span * t:2 * span * (t + 1)]]
                assert cols == [0] * span + [n_block // 2 * 4] * span, (p, t, cols)
            evictions = [r.writes[0].shape[1] for r in records if r.instr == "tensor_copy" and
                         any(o.buffer == "psum" for o in r.reads)]
            assert evictions[:2 * span] == [n_block // 2] * (2 * span), (p, evictions[:2 * span])
            assert set(evictions[2 * span:]) == {n_block}, (p, set(evictions[2 * span:]))


def test_deferred_along_s_k_tile_quantized_at_the_fence_between_the_second_w_gu_panel_k_tiles():
    """Under LNC2 phase 1 defers its last K tile's quantize along S and its stores to the core barrier inside phase 2
    (flush_along_s; the fence after phase 2's first W_gu panel, which reads nothing the barrier protects). The old code
    issued it in the barrier itself, after the second W_gu panel's loads: VectorE (program order) quantized all of that
    panel's K tiles first, and the barrier waited for the last chunk's store (TP8 pessimistic: TensorE idle 3.97 us at
    the fence). With MatmulPlan.set_fence_work (the kernel's phase 2) it goes at the fence tile after the second panel's
    first FENCE_WORK_AFTER_K_TILES quantizes (their SBUF placements first, as before) and before its other K tiles (TP8
    modeled 0.61649 / 0.65689 -> 0.61649 / 0.65422 ms). S = 1024, H = 4096, I = 1536: one K tile along S per core (all
    its chunks deferred), W_gu in n-major panels of six K tiles. Per core: FENCE_WORK_AFTER_K_TILES of the second
    panel's quantizes before the first chunk's, the rest after the last chunk's, all of them and the chunks' stores
    before the core barrier. Fails on the old code (all six before the first chunk). Bit-exact against mx_exact on
    LNC1 and LNC2, LNC1 equal to LNC2 (the same instructions in another program order); the race checker silent."""
    from nkilib.core.matmul.constants import FENCE_WORK_AFTER_K_TILES

    S, H, I = 1024, 4096, 1536
    k_tiles = 2 * I // 512

    inp = mlp_inputs_with_checkpoints(S, H, I, seed=S + H + I + 42, kind="pow2")
    (_, res), = [(lnc, res) for lnc, res in assert_mlp_traced_bit_exact_on_lnc1_and_lnc2(inp) if lnc == 2]
    for p in range(2):
        records, stores, along_s, _ = _along_s_instructions(res, p)
        barrier = next(i for i, r in enumerate(records) if r.instr == "core_barrier")
        # the second W_gu panel: the moving words of phase 2's first matmul after the barrier (the fence follows the
        # first panel's last tile's matmuls)
        after = next(r for r in records[barrier:] if r.instr == "nc_matmul_mx")
        second = next(o.storage_id for o in after.reads if o.arg == "moving")
        panel = [i for i, r in enumerate(records) if r.instr == "quantize_mx" and r.writes[0].storage_id == second]
        assert len(panel) == k_tiles and len(along_s) == 4 and max(stores) < barrier, (p, panel, along_s, stores)
        ahead = [i for i in panel if i < along_s[0]]
        assert len(ahead) == FENCE_WORK_AFTER_K_TILES, (p, panel, along_s)
        assert all(along_s[-1] < i < barrier for i in panel[len(ahead):]), (p, panel, along_s, barrier)


def test_phase2_kept_w_gu_beside_resident_panels_in_words_pieces():
    """Phase 2 beside phase 1's resident panels (ResidentPanels, one allocation per S tile, strewn over SBUF by
    next-fit) with W_gu kept whole: every W_gu panel's words go in MX_PANEL_PIECE_BYTES pieces, also below
    MX_PANEL_WHOLE_MAX_BYTES (RESIDENT_KEPT_MOVING_IN_PIECES; round 52a: S = 3584, H = 2048, I = 1536's second 24 KiB
    W_gu panel found no gap among 14 kept panels). S = 1024, H = 1024, I = 1536: one 1024-column W_gu panel of six K
    tiles (24 KiB of words) in pieces of 4 + 2 K tiles, so phase 2's matmuls read two moving allocations per core;
    before round 52a one. Bit-exact against mx_exact on LNC1 and LNC2, LNC1 equal to LNC2 (the same quantize_mx per
    K tile into other allocations)."""
    S, H, I = 1024, 1024, 1536
    for lnc, res in _phase_labelled_runs(S, H, I, seed=S + H + I + 52):
        for p in range(lnc):
            matmuls = [r for r in res.trace if r.program == p and r.attrs.get("phase") == "phase2" and
                       r.instr == "nc_matmul_mx"]
            moving = {next(o.storage_id for o in r.reads if o.arg == "moving") for r in matmuls}
            assert len(moving) == 2, (lnc, p, sorted(moving))


def test_along_s_words_in_one_allocation_per_chunk_beside_separate_kept_panels(monkeypatch):
    """Where phase 1 keeps phase 2's panels as separate allocations and quantizes more than one K tile along S per
    core, a K tile's words along S above ALONG_S_WORDS_WHOLE_MAX_BYTES go in one allocation per along-S chunk
    (SwigluBackwardEpilogue.along_s_words_per_chunk; round 52a: S = 2048, H = I = 2880's 22.5 KiB words found no gap
    among 8 kept panels). Spread as in the tests above (S = 2048, I = 1024, four chunks of 512 columns per K tile, 8 KiB
    of words) with the threshold at 4 KiB: every chunk's store reads words of its own allocation, four per K tile (the
    unit-stride copies of ALONG_S_HALF_FROM_COPY borrow the next chunk's). At the default threshold one allocation per
    K tile (before round 52a: always). Bit-exact against mx_exact on LNC1 and LNC2, LNC1 equal to LNC2
    (the same quantize_mx per column range into other allocations)."""
    S, H, I = 2048, 128, 1024
    chunks = 4  # 2 n blocks x ALONG_S_SPREAD_S_TILES

    def words_per_k_tile(res, p):
        records, stores, _, _ = _along_s_instructions(res, p)
        sids = [records[i].reads[0].storage_id for i in stores]
        return [len(set(sids[j:j + chunks])) for j in range(0, len(sids), chunks)]

    inp = mlp_inputs_with_checkpoints(S, H, I, seed=S + H + I + 52, kind="pow2")
    assert epilogue_module.ALONG_S_WORDS_WHOLE_MAX_BYTES >= 2 * I * 4  # the default keeps this shape's words whole
    res = run_mlp(inp, lnc=2, trace=True, phase1_tiles_n=1)
    assert all(words_per_k_tile(res, p) == [1] * (S // 2 // 512) for p in range(2))
    monkeypatch.setattr(epilogue_module, "ALONG_S_WORDS_WHOLE_MAX_BYTES", 4 * 1024)
    for lnc, res in assert_mlp_traced_bit_exact_on_lnc1_and_lnc2(inp, phase1_tiles_n=1):
        for p in range(lnc):
            assert words_per_k_tile(res, p) == [chunks] * (S // lnc // 512), (lnc, p)
