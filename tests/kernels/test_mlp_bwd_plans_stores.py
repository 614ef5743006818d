"""Where the plans' stores go: phase 2's core barrier inside it (MatmulPlan.set_fence) with the stores before the fence
deferred, and the kernel's last tile stored in column pieces under its matmuls.

Traced kernel runs on small shapes (labelled by phase where a check reads phases); outputs must equal `mx_exact` bit
for bit, LNC1 equal to LNC2.
"""
from simkit import assert_mlp_traced_bit_exact_on_lnc1_and_lnc2, mlp_inputs_with_checkpoints


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

    S, H, I = 1024, 4096, 1536  # four m tiles per core, four W_gu n blocks: 16 phase-2 tiles
    k_tiles = 2 * I // 512
    inp = mlp_inputs_with_checkpoints(S, H, I, seed=S + H + I + 15, matmul_precision="mxfp8")

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
            # PSUM evictions only: round 35's next-words copies are SBUF -> SBUF tensor_copies of W_gu's columns
            evictions = [i for i, r in enumerate(records) if phase[i] == "phase2" and r.instr == "tensor_copy"
                         and any(o.buffer == "psum" for o in r.reads)]
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

    assert_mlp_traced_bit_exact_on_lnc1_and_lnc2(inp, check_fence_inside_phase2, phases=True, matmul_precision="mxfp8")


def test_fenced_plan_with_an_epilogue_that_cannot_defer_stores_before_the_fence(monkeypatch):
    """defer_next_store / store_deferred are the optional part of MatmulPlan's epilogue protocol: a fenced plan whose
    epilogue lacks them (StoreEpilogue's removed here) stores every tile before the fence as before round 20 (m_tiles
    - 1 dX stores before the barrier instead of m_tiles - 2) and stays bit-exact. On round 20's first code the plan
    called them unconditionally: AttributeError there. Same shape as
    test_phase2_reads_its_own_rows_so_the_barrier_goes_inside_it."""
    from nkilib.core.matmul.epilogue import StoreEpilogue

    monkeypatch.delattr(StoreEpilogue, "defer_next_store")
    monkeypatch.delattr(StoreEpilogue, "store_deferred")
    S, H, I = 1024, 4096, 1536
    inp = mlp_inputs_with_checkpoints(S, H, I, seed=S + H + I + 15, matmul_precision="mxfp8")

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

    assert_mlp_traced_bit_exact_on_lnc1_and_lnc2(inp, check_stores_before_fence, phases=True, matmul_precision="mxfp8")


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
    inp = mlp_inputs_with_checkpoints(S, H, I, seed=S + H + I + 24, matmul_precision="mxfp8")

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

    assert_mlp_traced_bit_exact_on_lnc1_and_lnc2(inp, check_pieces, matmul_precision="mxfp8")
