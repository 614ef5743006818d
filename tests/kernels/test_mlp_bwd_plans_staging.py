"""Phase 1's cold start (TP8: W_down's panels resident, its first S tile waits for every K tile of W_down): W_down's
loads share a deeper staging ring, and its first K tiles are staged by one DMA per slot.

Traced kernel runs on small shapes with W_down's six K tiles (H = 3072); outputs must equal `mx_exact` bit for bit,
LNC1 equal to LNC2.
"""
from nkilib.core.matmul import tiling as tiling_module
from simkit import assert_mlp_traced_bit_exact_on_lnc1_and_lnc2, mlp_inputs_with_checkpoints, run_mlp


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
    inp = mlp_inputs_with_checkpoints(S, H, I, seed=S + H + I + 4, matmul_precision="mxfp8")

    def check_ring(trace, lnc):
        tiles = _staging_tiles_per_core(trace, "down_proj_weight")
        assert tiles == {p: min(COLD_STAGING_BUFFERS, H // 512) for p in range(lnc)}, tiles

    assert_mlp_traced_bit_exact_on_lnc1_and_lnc2(inp, check_ring, matmul_precision="mxfp8")
    # more m tiles per core than COLD_STAGING_MAX_M_TILES (S = 256 is two): the ring of STAGING_BUFFERS, as before
    monkeypatch.setattr(tiling_module, "COLD_STAGING_MAX_M_TILES", 1)
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
    inp = mlp_inputs_with_checkpoints(S, H, I, seed=S + H + I + 31, matmul_precision="mxfp8")
    k_tile_bytes = 512 * I * 2  # bf16 [512, I] rows of W_down (one n block: I = 256)
    split = [k_tile_bytes // MX_PACK] * (MX_PACK * COLD_SLOT_DMA_K_TILES)
    whole = [k_tile_bytes] * (k_tiles - COLD_SLOT_DMA_K_TILES)

    def check_dmas(trace, lnc):
        assert _w_down_dma_bytes_per_core(trace) == {p: split + whole for p in range(lnc)}

    assert_mlp_traced_bit_exact_on_lnc1_and_lnc2(inp, check_dmas, matmul_precision="mxfp8")
    monkeypatch.setattr(tiling_module, "COLD_STAGING_MAX_M_TILES", 1)  # not cold-staged: one DMA per K tile
    res = run_mlp(inp, lnc=1, trace=True, matmul_precision="mxfp8")
    assert _w_down_dma_bytes_per_core(res.trace) == {0: [k_tile_bytes] * k_tiles}


def _w_down_dma_bytes_per_core(trace):
    """{program: [bytes of each DMA from W_down, in program order]}."""
    out = {}
    for rec in trace:
        if rec.engine == "dma" and rec.reads and rec.reads[0].name == "down_proj_weight":
            out.setdefault(rec.program, []).append(rec.reads[0].nbytes)
    return out
