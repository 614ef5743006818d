"""The K-streamed phase 2 (TP1: W_gu's K = 2I streamed in groups of m tiles), forced on small shapes: its own rows
prefetched before the core barrier, and the next phase's first loads under its last quad (its tail), staged
through its ring.

The budgets of the matmul plan layer (nkilib.core.matmul.plan) are shrunk so phase 2 streams on S = 512, I = 4096;
outputs must equal `mx_exact` bit for bit, LNC1 equal to LNC2, with the simulator's race check silent.
"""
import pytest

from nkilib.core.matmul import plan as plan_module
from nkilib.core.matmul import tiling as tiling_module
from simkit import (assert_mlp_bit_exact_on_lnc1_and_lnc2, assert_mlp_traced_bit_exact_on_lnc1_and_lnc2,
                    mlp_inputs_with_checkpoints, run_mlp, spy_returns)


@pytest.fixture
def k_streamed_phase2(monkeypatch):
    """Budgets that make phase 2 K-streamed on small shapes: no panel cache, one load per stationary group, only phase
    1's dY resident."""
    monkeypatch.setattr(tiling_module, "PANEL_CACHE_BUDGET_BYTES", 1)
    monkeypatch.setattr(tiling_module, "STATIONARY_GROUP_BUDGET_BYTES", 1)
    monkeypatch.setattr(tiling_module, "RESIDENT_OPERAND_BUDGET_BYTES", 4 * 1024)  # dY of phase 1 only


@pytest.mark.usefixtures("k_streamed_phase2")
def test_phase2_own_rows_prefetched_before_the_barrier_are_bit_exact(monkeypatch):
    """After phase 1's split along I, each core wrote d_gate's and d_up's columns of its I half in every row, and
    phase 2 (K-streamed, K = 2I) loads the first group's panels' natural row tiles from those columns before
    the core barrier (MatmulPlan.prefetch_own; TP1 modeled 4.567 / 4.730 -> 4.562 / 4.726 ms). Forced on S = 512,
    H = 256, I = 4096 (each core's I half is two NATURAL_LOAD_K groups of d_gate and two of d_up; phase 2 streams
    groups of two m tiles): both cores must preload exactly their own groups, the LNC2 run must pass the simulator's
    race check (the early reads are of the core's own writes) and be bit-exact against mx_exact and equal to LNC1's."""
    preloaded = spy_returns(monkeypatch, plan_module.MatmulPlan, "prefetch_own", lambda _, plan: (
        plan.own_k_ranges, [[g for g, _ in tiles] for tiles in plan.preloaded or []]))  # after the call
    S, H, I = 512, 256, 4096
    inp = mlp_inputs_with_checkpoints(S, H, I, seed=S + H + I, matmul_precision="mxfp8")
    out2 = run_mlp(inp, lnc=2, matmul_precision="mxfp8")
    # NATURAL_LOAD_K = 2048 columns per group: core 0 owns groups 0 (d_gate) and 2 (d_up), core 1 groups 1 and 3, of
    # both panels of the first group (4 row tiles, under OWN_PREFETCH_GROUPS = 6)
    assert sorted(preloaded) == [(((0, 2048), (4096, 6144)), [[0, 2], [0, 2]]),
                                 (((2048, 4096), (6144, 8192)), [[1, 3], [1, 3]])], preloaded
    assert_mlp_bit_exact_on_lnc1_and_lnc2(inp, out2, matmul_precision="mxfp8")


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

    S, H, I = 512, 256, 4096
    inp = mlp_inputs_with_checkpoints(S, H, I, seed=S + H + I + 3, matmul_precision="mxfp8")

    def check_tail(trace, lnc):
        for program in range(lnc):
            last_matmul, nxt, first, first_quantize, evictions = _tail_order(trace, program)
            assert first < last_matmul and first_quantize < last_matmul, (lnc, program, nxt, last_matmul, first,
                                                                          first_quantize)
            # the last n block evicts one tile per m tile of the last group (at least 2), otherwise alternating
            # VectorE / ScalarE
            assert evictions[-2:] == ["scalar", "scalar"], evictions

    assert_mlp_traced_bit_exact_on_lnc1_and_lnc2(inp, check_tail, phases=True, matmul_precision="mxfp8")


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

    S, H, I = 512, 512, 4096
    inp = mlp_inputs_with_checkpoints(S, H, I, seed=S + H + I + 5, matmul_precision="mxfp8")

    def check_staging(trace, lnc):
        for program in range(lnc):
            records, phase, last_matmul, nxt, early = _next_phase_sbuf_loads_under_tail(trace, program)
            ring = {r.writes[0].storage_id for i, r in enumerate(records) if phase[i] == "phase2" and
                    r.engine == "dma" and r.reads and r.reads[0].name == "gate_up_weights"}
            early = [r.writes[0].storage_id for r in early]
            assert early and all(t in ring for t in early), (lnc, program, nxt, early, sorted(ring))

    assert_mlp_traced_bit_exact_on_lnc1_and_lnc2(inp, check_staging, phases=True, matmul_precision="mxfp8")


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

    assert STREAM_STAGING_BUFFERS > STAGING_BUFFERS
    S, H, I = 512, 512, 4096
    inp = mlp_inputs_with_checkpoints(S, H, I, seed=S + H + I + 6, matmul_precision="mxfp8")

    def check_depth(trace, lnc):
        for program in range(lnc):
            records, phase, last_matmul, nxt, early = _next_phase_sbuf_loads_under_tail(trace, program)
            source = early[0].reads[0].name
            later = [r.writes[0].storage_id for i, r in enumerate(records) if i > last_matmul and phase[i] == nxt and
                     r.engine == "dma" and r.reads and r.reads[0].name == source and r.writes[0].buffer == "sbuf"]
            assert len(later) > STREAM_STAGING_BUFFERS, (lnc, program, source, len(later))
            assert len(set(later)) == STAGING_BUFFERS, (lnc, program, source, len(set(later)))

    assert_mlp_traced_bit_exact_on_lnc1_and_lnc2(inp, check_depth, phases=True, matmul_precision="mxfp8")


@pytest.mark.usefixtures("k_streamed_phase2")
def test_last_group_stationary_block_in_k_pieces_that_die_before_the_last_quad():
    """A K-streamed plan whose tail loads the next plan's first panels (set_tail_load) places its last group's
    stationary panels in STREAM_TAIL_PIECES K-range pieces (PanelGroupBlock pieces) instead of one block: each piece's
    last reader is the last n block's matmul of its last K tiles, so all but the last piece are dead before the last
    quad's matmuls, and the next plan's first staging tiles and words can take their SBUF (TP1 4.47016 / 4.61314 ->
    4.46345 / 4.61568 ms: phase 4's first K tile no longer waits for phase 2's last matmul). Forced on S = 512,
    H = 512, I = 4096 (the budgets of the tests above: groups of two m tiles, K = 2I = 16 K tiles, one n block): in
    each core's trace the stationary words read by phase 2's matmuls (their first operand) in storages last read before
    the trailing run of matmuls that read the last one number at least STREAM_TAIL_PIECES - 1 (LNC2 has one group:
    none on the old code, whose one block is read to the end; LNC1 has two: one), and the outputs are bit-exact against
    mx_exact, LNC1 equal to LNC2."""
    from nkilib.core.matmul.constants import STREAM_TAIL_PIECES

    assert STREAM_TAIL_PIECES > 1
    S, H, I = 512, 512, 4096
    inp = mlp_inputs_with_checkpoints(S, H, I, seed=S + H + I + 7, matmul_precision="mxfp8")

    def check_pieces(trace, lnc):
        for program in range(lnc):
            matmuls = [r for r in trace if r.program == program and r.attrs.get("phase") == "phase2" and
                       r.instr == "nc_matmul_mx"]
            words = [r.reads[0].storage_id for r in matmuls]
            run = len(words) - 1
            while run > 0 and words[run - 1] == words[-1]:
                run -= 1
            last_read = {}
            for i, sid in enumerate(words):
                last_read[sid] = i
            dead = [sid for sid, i in last_read.items() if i < run]
            assert len(dead) >= STREAM_TAIL_PIECES - 1, (lnc, program, len(words), run, last_read)

    assert_mlp_traced_bit_exact_on_lnc1_and_lnc2(inp, check_pieces, phases=True, matmul_precision="mxfp8")
