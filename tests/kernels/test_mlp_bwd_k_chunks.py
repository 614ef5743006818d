"""K-chunked weight-gradient plans (nkilib/core/matmul/k_chunks.py): the MLP backward's phases 3 and 4 (K = S) at long
sequences, where neither whole operand fits SBUF, run as chunks along S, each keeping its smaller operand resident,
the fp32 sums carried between chunks (spilled and reloaded through PE transposes). At the model shape that needs it
(S = 32768, H = 2048, I = 768) the plan decision is checked on the real budgets; the numerics on small shapes with
the budgets shrunk so that the same decision is taken, bit for bit against mx_exact with fp32 weight gradients (so
no bf16 rounding can hide a wrong fp32 sum), LNC1 = LNC2.
"""
import types

import nki.language as nl
import pytest

from nkilib.core.matmul import CoreSplit, KChunkedPlan, MatmulPlan, MatmulSetup, TensorDescriptor
from nkilib.core.matmul import constants as constants_module
from nkilib.core.matmul import k_chunks as k_chunks_module
from nkilib.core.matmul import overlap as overlap_module
from nkilib.core.matmul import tiling as tiling_module
from nkilib.core.matmul.panel_builder import words_above_whole_max
from nkilib.core.matmul.panels import k_tiles
from nkilib.core.matmul.sources import PanelSource
from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8 import mlp_bwd_mxfp8_kernel as kernel_module
from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8.config import MatmulConfig
from simkit import (assert_mlp_bit_exact, assert_outputs_identical, in_kernel, mlp_inputs_with_checkpoints, run_mlp,
                    spy_returns)

SETUP = MatmulSetup("mxfp8", nl.float8_e4m3fn_x4, "1x32", True)


def _phase4_plan(S: int, H: int = 2048, I: int = 768, shard: int = 0):
    """Phase 4's ordinary plan (dW_down [H, I] = dYᵀ @ intermediate, K = S) from shape-only descriptors, LNC2."""
    dy = TensorDescriptor(types.SimpleNamespace(shape=(S, H)), k_axis=0)
    inter = TensorDescriptor(types.SimpleNamespace(shape=(S, I)), k_axis=0)
    plan = MatmulPlan([dy], [inter], H, I, SETUP, MatmulConfig(n_tile=2048), CoreSplit(2, shard), None,
                      lead_n_major=True)
    return plan, dy, inter


@pytest.mark.parametrize("S, rows", [(8192, 0), (16384, 8192), (32768, 8192), (65536, 8192)])
def test_k_chunk_decisions_at_long_sequences(S, rows):
    """Qwen3-30B-A3B's dense comparison (H = 2048, I = 768), phase 4 per core ([1024, 768]): at S = 8192 the
    intermediate stays resident and dY loads 512 columns wide: nothing to chunk. At S = 16384 the intermediate
    (102 KiB per partition in MXFP8) still fits, but STATIONARY_PANEL_BUDGET_BYTES narrows dY's loads to 256 columns:
    two chunks of 8192 rows. At S = 32768 (204 KiB) the ordinary plan is K-streamed (the intermediate read once per
    group of dY panels): four chunks (two of 16384 would hold the intermediate but load dY 256 columns wide).
    S = 65536: eight of 8192 (seven of 10240 would fit too, with a last of 4096; chunks of one length are
    preferred)."""
    plan, dy, inter = _phase4_plan(S)
    assert k_chunks_module.k_chunk_rows(plan, [dy], [inter], SETUP) == rows
    assert (plan.stream != None) == (S > 16384)  # noqa: E711
    if rows:
        chunk, _, _ = _phase4_plan(rows)
        assert chunk.keep_moving and chunk.stream == None  # noqa: E711  each chunk: the S = `rows` plan
        assert chunk.stationary[0].load_width == 512


def test_k_chunks_only_where_the_sums_move_no_more_bytes_than_the_rereads(monkeypatch):
    """H = 7168, I = 2048, S = 16384 (per core: dW_down [3584, 2048], dW_gu [4096, 3584]): phase 4's ordinary plan
    reads the intermediate 4 times (201 MB of re-reads per core), two chunks spill 59 MB of fp32 sums; phase 3's
    reads X 4 times (352 MB of re-reads), four chunks spill exactly as many bytes of sums and are taken (the re-reads
    also cost a quantize each; modeled 7.667 ms chunked against 8.182 with phase 3 left as it was). Sums one byte
    per element dearer than the re-reads: phase 3 is left as it is."""
    S, H, I = 16384, 7168, 2048
    plan4, dy, inter = _phase4_plan(S, H, I)
    assert k_chunks_module.k_chunk_rows(plan4, [dy], [inter], SETUP) == 8192
    dgu = TensorDescriptor(types.SimpleNamespace(shape=(S, 2 * I)), k_axis=0)
    x = TensorDescriptor(types.SimpleNamespace(shape=(S, H)), k_axis=0)
    plan3 = MatmulPlan([dgu], [x], 2 * I, H, SETUP, MatmulConfig(n_tile=2048), CoreSplit(2, 0), None,
                       lead_n_major=True)
    assert plan3.stream != None  # noqa: E711  (neither operand fits)
    assert k_chunks_module._moving_rereads(plan3, x) == 3 * S * (H // 2) * 2
    assert k_chunks_module.k_chunk_rows(plan3, [dgu], [x], SETUP) == 4096
    monkeypatch.setattr(k_chunks_module, "PARTIAL_SUM_HBM_BYTES", 9)
    assert k_chunks_module.k_chunk_rows(plan3, [dgu], [x], SETUP) == 0
    assert k_chunks_module.k_chunk_rows(plan4, [dy], [inter], SETUP) == 8192


@pytest.fixture
def shrunk_budgets(monkeypatch):
    """Phases 3 and 4 at S = 4096-6144 get the S = 32768 decision: their operands fit neither the panel cache nor
    the resident-operand budget (the ordinary plan would sweep the moving operand once per stationary panel), a
    2048-row chunk of the smaller one does. W_down still fits (phase 1 keeps it and
    quantizes d_gate_up along S on chip, so phase 3 reads it in the panel layout, K-windowed)."""
    monkeypatch.setattr(tiling_module, "PANEL_CACHE_BUDGET_BYTES", 4096)
    monkeypatch.setattr(tiling_module, "RESIDENT_OPERAND_BUDGET_BYTES", 5000)
    # one 128-column stationary panel per group, so the ordinary plan re-reads its moving operand (what chunks save)
    monkeypatch.setattr(tiling_module, "STATIONARY_PANEL_BUDGET_BYTES", 1)
    monkeypatch.setattr(tiling_module, "STATIONARY_GROUP_BUDGET_BYTES", 1)
    monkeypatch.setattr(tiling_module, "STREAM_STATIONARY_BUDGET_BYTES", 1)
    monkeypatch.setattr(k_chunks_module, "RESIDENT_OPERAND_BUDGET_BYTES", 5000)
    # each K-chunked plan's chunk starts and whether its stationary operand is read in the panel layout
    return spy_returns(monkeypatch, kernel_module, "plan_matmul", lambda plan, stationary, moving, *args, **kwargs: (
        [c.stationary_ops[0].k_base for c in plan.chunks], stationary[0].panel_layout)
        if isinstance(plan, KChunkedPlan) else None)


@pytest.mark.parametrize("S, H, I, lnc", [(4096, 256, 384, 1), (4096, 256, 512, 2), (6144, 192, 320, 1)])
def test_k_chunked_weight_grads_are_bit_exact(shrunk_budgets, S, H, I, lnc):
    """Both weight-gradient phases cut along S; fp32 weight gradients equal mx_exact exactly. (6144, 192, 320):
    three chunks (the middle one reloads and spills) and tiles narrower than 128 columns / an m tile of 64."""
    inp = mlp_inputs_with_checkpoints(S, H, I, seed=S + H + I)
    out = run_mlp(inp, lnc=lnc, weight_grad_dtype="float32")
    assert_mlp_bit_exact(out, inp, weight_grad_dtype="float32")
    starts = [0, 2048] if S == 4096 else [0, 2048, 4096]
    assert [t[0] for t in shrunk_budgets] == [starts] * (2 * lnc), shrunk_budgets  # phases 4 and 3, every core
    assert any(layout for _, layout in shrunk_budgets), "phase 3 did not read d_gate_up in the panel layout"


def test_k_chunked_lnc1_equals_lnc2(shrunk_budgets):
    """The same chunks on one core and split over two give the same bits (bf16 weight gradients, the default)."""
    S, H, I = 4096, 256, 384
    inp = mlp_inputs_with_checkpoints(S, H, I, seed=7)
    assert_outputs_identical(run_mlp(inp, lnc=1), run_mlp(inp, lnc=2), "LNC1 vs LNC2")


def test_k_chunks_of_one_length_unless_they_spill_more_than_the_rereads():
    """H = I = 2880, S = 16384, phase 3 per core (dW_gu rows [0, 2944) of 5760, all 2880 columns): X's chunk fits at
    6144 rows (three chunks, the last 4096); four equal chunks of 4096 would spill 3 x 68 MB of fp32 sums against
    2 x 94 MB of X re-reads, so the uneven three are taken."""
    S, H, I = 16384, 2880, 2880
    dgu = TensorDescriptor(types.SimpleNamespace(shape=(S, 2 * I)), k_axis=0)
    x = TensorDescriptor(types.SimpleNamespace(shape=(S, H)), k_axis=0)
    plan3 = MatmulPlan([dgu], [x], 2 * I, H, SETUP, MatmulConfig(n_tile=2048), CoreSplit(2, 0), None,
                       lead_n_major=True)
    assert plan3.ranges == ((0, 2944), (0, 2880))
    assert k_chunks_module.PARTIAL_SUM_HBM_BYTES * 2944 * 2880 * 3 > k_chunks_module._moving_rereads(plan3, x)
    assert k_chunks_module.k_chunk_rows(plan3, [dgu], [x], SETUP) == 6144


def test_a_reloading_chunk_counts_its_fetched_sums_among_the_bytes_it_holds_at_its_tail():
    """Round 48b: a chunk that reloads an earlier chunk's fp32 sums (all but the first) holds, besides its panels and
    its epilogue, the sums PartialSums.fetch DMAed for the tile it reloads: a [128, width] fp32 tile (width: a
    PartialSums HBM row). held_bytes, which decides whether the next plan's first panels load under this plan's last
    tiles, counts it; it did not, and at S = 28672, H = 2048, I = 768 phase 4's first load under phase 3's last chunk
    fitted that count with 1.5 KiB to spare while that tile was live: two of its 15 KiB words pieces found no gap (a
    plan error). Phase 4 at S = 16384 (two chunks of 8192 rows)."""
    _, dy, inter = _phase4_plan(16384)
    epilogue = types.SimpleNamespace(prepare=lambda plan: None, held_bytes=lambda n_tile: 0)

    def body():  # PartialSums allocates its HBM sums: inside a launch
        chunked = k_chunks_module.plan_matmul([dy], [inter], 2048, 768, SETUP, MatmulConfig(n_tile=2048),
                                              CoreSplit(2, 0), epilogue, k_chunks=True, lead_n_major=True)
        assert isinstance(chunked, KChunkedPlan) and len(chunked.chunks) == 2
        first, last = chunked.chunks
        assert first.reload == None and last.reload != None  # noqa: E711
        width = last.reload.hbm.shape[2]  # a fetched tile is [128, width] fp32, as a row of the HBM sums
        counted = last.held_bytes()
        last.reload = None
        return counted, last.held_bytes(), width

    counted, without, width = in_kernel(body)
    assert counted - without == width * 4, (counted, without, width)


@pytest.mark.parametrize("tiles_left", ["all", "none"])
def test_a_spread_first_load_after_a_k_chunked_plan_takes_its_copies_as_after_its_last_chunk(tiles_left):
    """Round 48b: KChunkedPlan.prefetch_point is its last chunk's (MatmulPlan.prefetch_point), so a spread first load
    begun under a K-chunked plan's tail takes its unit-stride copies only where overlap.spread_copies_fit says so (round
    47), as under any other plan; it used to repeat only the short-tail rule and leave the copies on whatever the tail.
    Phase 4 of S = 16384, H = 2048, I = 768 in two chunks, a fresh plan as the next one: with all of the last chunk's
    tiles left (more than 1 / SPREAD_COPIES_TAIL_SHARE) no copies; with none left, and room to spare, copies."""
    _, dy, inter = _phase4_plan(16384)
    epilogue = types.SimpleNamespace(prepare=lambda plan: None, held_bytes=lambda n_tile: 0)

    def body():
        chunked = k_chunks_module.plan_matmul([dy], [inter], 2048, 768, SETUP, MatmulConfig(n_tile=2048),
                                              CoreSplit(2, 0), epilogue, k_chunks=True, lead_n_major=True)
        last = chunked.chunks[-1]
        if tiles_left == "none":
            last.done = len(last.order)
        nxt, _, _ = _phase4_plan(4096)
        nxt.spread_first_load()
        fits = overlap_module.spread_copies_fit(last, nxt)
        chunked.prefetch_point(nxt)
        return nxt.spread_first, nxt.spread_copies, fits

    spread, copies, fits = in_kernel(body)
    assert spread and copies == fits == (tiles_left == "none"), (spread, copies, fits)


def _three_chunk_sum_dmas(shrunk_budgets, where):
    """Three chunks per phase (S = 6144, shrunk budgets), one core, bit-exact: the HBM sums' name -> [(spill / fetch,
    where(the SBUF side of the DMA))] in program order, one entry per phase."""
    S, H, I = 6144, 192, 320
    inp = mlp_inputs_with_checkpoints(S, H, I, seed=11)
    res = run_mlp(inp, lnc=1, trace=True, weight_grad_dtype="float32")
    assert_mlp_bit_exact(res.outputs, inp, weight_grad_dtype="float32")
    assert [t[0] for t in shrunk_budgets] == [[0, 2048, 4096]] * 2, shrunk_budgets  # phases 4 and 3
    dmas = {}
    for r in res.trace:
        if r.instr == "dma_copy" and r.writes[0].buffer == "private_hbm" and r.reads[0].buffer == "sbuf":
            dmas.setdefault(r.writes[0].name, []).append(("spill", where(r.reads[0])))
    for r in res.trace:
        if r.instr == "dma_copy" and r.reads[0].name in dmas:
            dmas[r.reads[0].name].append(("fetch", where(r.writes[0])))
    assert len(dmas) == 2, dmas
    return dmas


def test_a_spilling_chunks_tail_passes_its_sums_through_one_sbuf_ring(shrunk_budgets):
    """Round 51a: a chunk that spills (all but the last) evicts, transposes and fetches its fp32 sums from its last
    loading tile on (its tail, under which the next chunk's first panels load) through one SBUF allocation
    (PartialSums' ring of PARTIAL_RING_SLOTS tiles), the next chunk's first fetched sums included (fetched once this
    chunk's last tile was reloaded): the tail allocates no new SBUF for them after the next chunk's first loads. With a
    tile per spill and per fetch (before) 9728 x 4096 x 1536 and 10240 x 4096 x 1792 found no gap for one
    (plan errors). The last chunk, which only reloads, fetches into one allocation, reused (a new tile per fetch
    before; its slots taken in turn since round 51d).
    Three chunks per phase (S = 6144, shrunk budgets), one core, bit-exact: each later chunk's first fetch writes the
    SBUF tile that the chunk before's last spill read, and the last chunk's later fetches write one allocation."""
    dmas = _three_chunk_sum_dmas(shrunk_budgets, lambda op: op.storage_id)
    widest = 0
    for name, seen in dmas.items():
        spills = [sid for kind, sid in seen if kind == "spill"]
        fetches = [sid for kind, sid in seen if kind == "fetch"]
        tiles = len(spills) // 2  # each tile spilled by two chunks, fetched by two
        assert len(fetches) == len(spills) == 2 * tiles, (name, seen)
        for c in (1, 2):  # chunk c's first fetch: the ring of chunk c - 1's tail
            assert fetches[(c - 1) * tiles] == spills[c * tiles - 1], (name, c, seen)
        assert len(set(fetches[tiles + 1:])) == 1, (name, seen)  # the last chunk's: one allocation, reused
        widest = max(widest, tiles)
    assert widest > 2, dmas  # a last chunk with more than one fetch after its first


def test_the_last_chunks_fetches_take_two_tiles_in_turn(shrunk_budgets):
    """Round 51d: the last K chunk (it only reloads) fetches its sums into PARTIAL_LAST_FETCH_SLOTS tiles of one
    allocation in turn, where they fit beside what it holds (LAST_FETCH_RING_MAX_HELD_BYTES): a fetch does not wait
    for the reload of the tile before (one tile, reused, before: S = 9216, H = 4096, I = 1536 1.73887 -> 1.69016 ms
    central). Three chunks per phase at S = 6144: the last chunk's later fetches write one SBUF allocation at two
    offsets, each fetch at another offset than the one before (round 51a: one offset)."""
    dmas = _three_chunk_sum_dmas(shrunk_budgets, lambda op: (op.storage_id, op.byte_offset))
    widest = []
    for name, seen in dmas.items():
        fetches = [where for kind, where in seen if kind == "fetch"]
        later = fetches[len(fetches) // 2 + 1:]  # the last chunk's fetches after its first (chunk 1's ring)
        widest.append(len(later))
        if len(later) < 2:
            continue
        assert len({sid for sid, _ in later}) == 1, (name, later)
        assert len({off for _, off in later}) == constants_module.PARTIAL_LAST_FETCH_SLOTS, (name, later)
        assert all(a[1] != b[1] for a, b in zip(later, later[1:])), (name, later)
    assert max(widest) > 2, widest  # a last chunk with more than two fetches after its first


def test_a_later_chunks_first_moving_panel_goes_in_narrower_pieces():
    """Round 51a: a later K chunk's first moving panel loads under the chunk before's tail, among the holes that chunk's
    dead panels leave: its moving sources quantize that panel's words (above MX_PANEL_WHOLE_MAX_BYTES) in
    K_CHUNK_PANEL_PIECE_BYTES pieces, narrower than MX_PANEL_PIECE_BYTES (S = 32768, H = I = 2880: a 12 KiB piece of X
    against holes of 12032 B and less, refused), their later panels and the first chunk's as any plan's. Phase 4 at
    S = 16384 (two chunks of 8192 rows): the placement each chunk's moving source gives its first and second load."""
    _, dy, inter = _phase4_plan(16384)
    epilogue = types.SimpleNamespace(prepare=lambda plan: None, held_bytes=lambda n_tile: 0)

    def body():
        chunked = k_chunks_module.plan_matmul([dy], [inter], 2048, 768, SETUP, MatmulConfig(n_tile=2048),
                                              CoreSplit(2, 0), epilogue, k_chunks=True, lead_n_major=True)
        return [[chunk.moving[0]._placement(128).piece_bytes for _ in range(2)] for chunk in chunked.chunks]

    first, later = in_kernel(body)
    assert first == [0, 0] and later == [constants_module.K_CHUNK_PANEL_PIECE_BYTES, 0], (first, later)
    assert 0 < later[0] < constants_module.MX_PANEL_PIECE_BYTES


def test_a_shorter_last_chunks_panels_go_in_pieces_where_the_full_chunks_do():
    """Round 52a: a K-chunked plan's last chunk may be shorter than the others, its moving panels then narrower along K:
    at S = 27136, H = I = 2880 phase 3's last chunk has 2560 rows, 5 K tiles of X x 1536 columns (30 KiB of words, under
    MX_PANEL_WHOLE_MAX_BYTES), where the full chunks' 8 K tiles (48 KiB) go in pieces; whole, its first panel found no
    30 KiB gap among the pieces the chunk before left (refused). Its moving source now quantizes its panels in pieces as
    the full chunks' do (PanelSource._placement's rule across chunks). Phase 3 per core from shape-only descriptors:
    the last chunk's first placement in K_CHUNK_PANEL_PIECE_BYTES pieces although its panel alone would be whole (before
    round 52a: whole)."""
    S, H, I = 27136, 2880, 2880
    grad = TensorDescriptor(types.SimpleNamespace(shape=(S, 2 * I)), k_axis=0)
    x = TensorDescriptor(types.SimpleNamespace(shape=(S, H)), k_axis=0)
    epilogue = types.SimpleNamespace(prepare=lambda plan: None, held_bytes=lambda n_tile: 0)

    def body():
        chunked = k_chunks_module.plan_matmul([grad], [x], 2 * I, H, SETUP, MatmulConfig(n_tile=2048), CoreSplit(2, 0),
                                              epilogue, k_chunks=True, lead_n_major=True)
        last = chunked.chunks[-1]
        k = len(k_tiles(last.moving[0].op.k_size, SETUP))
        placement = last.moving[0]._placement(last.n_tile)
        return k, last.n_tile, placement.piece_bytes, placement.always

    k, n_tile, piece_bytes, always = in_kernel(body)
    assert not words_above_whole_max(k, n_tile), (k, n_tile)  # alone, the last chunk's panel would be whole
    assert always and piece_bytes == constants_module.K_CHUNK_PANEL_PIECE_BYTES, (always, piece_bytes)


def test_a_later_chunks_first_panel_leaves_its_last_k_tiles_for_its_first_tile(shrunk_budgets, monkeypatch):
    """Round 53a: a later K chunk's first moving panel loads under the chunk before's tail, where every live tile's last
    access depends on its quantizes: a words piece that finds no gap among them has no placement it may wait for
    (S = 28160 / 31232 / 32256, H = I = 2880: phase 3's eighth 6 KiB piece of X, refused). Its last
    K_CHUNK_FIRST_DEFERRED_K_TILES K tiles are now quantized when that chunk's first tile runs (PanelSource.load_ahead
    under the tail, the rest at the first get), after the chunk before's last matmuls. Three chunks per phase
    (S = 6144, shrunk budgets), one core, bit-exact: each later chunk of both phases begins its first moving panel with
    load_ahead, K_CHUNK_FIRST_DEFERRED_K_TILES K tiles left (before round 53a: the whole panel quantized, no
    load_ahead of a K window)."""
    begun = spy_returns(monkeypatch, PanelSource, "load_ahead", lambda result, source, *args: (
        (source.op.k_base, source.pending.remaining()) if source.op.k_base else None))
    _three_chunk_sum_dmas(shrunk_budgets, lambda op: op.storage_id)
    left = constants_module.K_CHUNK_FIRST_DEFERRED_K_TILES
    assert sorted(begun) == [(2048, left), (2048, left), (4096, left), (4096, left)], begun  # phases 4 and 3
