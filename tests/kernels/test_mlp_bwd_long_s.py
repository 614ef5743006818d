"""Phase 2 at long S (round 40 of docs/dense-performance.md): where phase 1 spreads its along-S quantize, the fence
moves after phase 2's first W_gu panel only in an n-major order (MatmulPlan.first_panel_once). An order that comes
back to the first panel (m-major with every W_gu panel kept, or grouped n-major: Qwen3-8B TP8 at S = 8192) keeps
set_fence's FENCE_TILE; the kernel asserted at trace time there before. And a plan's first loads fit under the
previous plan's tail only with each [K, F] source's own staging ring counted (overlap.first_load_bytes own_rings):
at S = 6144 phase 4's first loads under phase 2 ran past SBUF (CapacityError) before."""
import pytest

from nkilib.core.matmul import plan as plan_module
from nkilib.core.matmul.constants import FENCE_TILE
from simkit import (assert_dense_shape_plans, assert_mlp_bit_exact_on_lnc1_and_lnc2, mlp_inputs_with_checkpoints,
                    run_mlp, spy)


def _returns_to_first_panel(order) -> bool:
    """Whether a later tile of `order` is back on tile 0's moving panel after a tile on another one."""
    n0 = [n[0] for _, n in order]
    left = next((j for j, n in enumerate(n0) if n != n0[0]), None)
    return left is not None and n0[0] in n0[left:]


@pytest.mark.parametrize("S", [6144, 8192, 16384])
def test_long_s_tp8_shapes_trace_and_plan(S):
    """Qwen3-8B TP8 (H = 4096, I = 1536) at S = 6144, 8192 and 16384: the shape-only run (as the cost model runs it)
    traces without an error and without plan errors, and takes a modeled time (main before round 40: CapacityError in
    SBUF at 6144, AssertionError from place_fence_after_first_panel at 8192 and 16384)."""
    assert_dense_shape_plans(S, 4096, 1536)


def test_fence_stays_at_fence_tile_when_phase2_returns_to_its_first_panel(monkeypatch):
    """S = 1024, H = 1536, I = 1536 (the smallest shape found with phase 1 spread and a phase 2 order that comes back
    to its first W_gu panel: W_gu kept whole, m-major, two n blocks, eight tiles per core): the fence stays before
    tile FENCE_TILE's epilogue on each core, and the outputs equal mx_exact bit for bit, LNC1 equal to LNC2, with the
    race checker silent (run_mlp raises on a race). Fails on the old code: the trace asserted."""
    fences = spy(monkeypatch, plan_module.MatmulPlan, "set_fence",
                 lambda plan, barrier: (plan.fence_tile, _returns_to_first_panel(plan.order), len(plan.order)))
    S, H, I = 1024, 1536, 1536
    inp = mlp_inputs_with_checkpoints(S, H, I, seed=S + H + I + 40, matmul_precision="mxfp8")
    out2 = run_mlp(inp, lnc=2, matmul_precision="mxfp8")
    assert fences == [(FENCE_TILE, True, 8)] * 2, fences  # phase 2's fence, one per core
    assert_mlp_bit_exact_on_lnc1_and_lnc2(inp, out2, matmul_precision="mxfp8")


@pytest.mark.parametrize("S,H,I,options", [(1024, 256, 256, {}), (2048, 128, 1024, {"phase1_tiles_n": 1})],
                         ids=["one-n-block", "spread-deferred"])
def test_kept_panels_beyond_the_separate_limit_share_one_block(monkeypatch, S, H, I, options):
    """Phase 1's d_gate_up rows kept as phase 2's stationary panels go into one PanelGroupBlock (a slot per S tile)
    where a core keeps more than PHASE2_STATIONARY_SEPARATE_PANELS of them (round 41: separate allocations strewn by
    next-fit left no gap for phase 2's 16-30 KiB tiles at S = 5120-9216, H = 2048, I = 768). The limit lowered to 1 so
    that small shapes take the path, LNC2: S = 1024, H = I = 256 (four S tiles per core, one n block) and S = 2048,
    H = 128, I = 1024 in two n blocks (eight S tiles per core; phase 1 spreads its along-S quantize, so the last S
    tile's panel is a DeferredRowPanel). One block per core with a slot per S tile, every kept panel built into it; the
    outputs equal mx_exact bit for bit on LNC1 and LNC2, LNC1 equal to LNC2, the race checker silent (run_mlp raises
    on a race)."""
    from nkilib.core.matmul import row_panels as row_panels_module
    from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8 import mlp_bwd_mxfp8_epilogue as epilogue_module

    monkeypatch.setattr(epilogue_module, "PHASE2_STATIONARY_SEPARATE_PANELS", 1)
    blocks = spy(monkeypatch, epilogue_module, "PanelGroupBlock", lambda count, k_size, f_pad, setup: (count, k_size))
    kinds = spy(monkeypatch, row_panels_module, "panel_from_rows",
                lambda rows, f_size, k_size, f_pad, setup, placement=None: getattr(placement, "kind", "own"))
    spy(monkeypatch, row_panels_module, "DeferredRowPanel",
        lambda rows, f_size, k_size, f_pad, setup, first_cols=None, placement=None: "deferred " +
        getattr(placement, "kind", "own"), into=kinds)
    tiles = S // 2 // 128
    inp = mlp_inputs_with_checkpoints(S, H, I, seed=S + H + I + 41, matmul_precision="mxfp8")
    out2 = run_mlp(inp, lnc=2, matmul_precision="mxfp8", **options)
    assert blocks == [(tiles, 2 * I)] * 2, blocks
    last = "deferred into" if options else "into"
    assert kinds == (["into"] * (tiles - 1) + [last]) * 2, kinds  # per core, each kept panel in its slot
    assert_mlp_bit_exact_on_lnc1_and_lnc2(inp, out2, matmul_precision="mxfp8", **options)



@pytest.mark.parametrize("spread", [False, True], ids=["phase4", "phase3-spread"])
def test_first_load_under_tail_takes_a_shallower_ring_where_only_that_fits(monkeypatch, spread):
    """Round 45 (overlap.prefetch_staging, PREFETCH_STAGING_BUFFERS): where the next plan's first panels fit under
    phase 2's tail only with its moving staging rings PREFETCH_STAGING_BUFFERS deep instead of their own
    STAGING_BUFFERS (S = 4096, H = 7168, I = 2048: phase 4 5 KiB over, so phases 3 and 4 both started cold after phase
    2), they load there with that ring; not a spread first load (phase 3: its schedule issues each K tile's copy
    STAGING_BUFFERS K tiles after its staging DMA began; H = I = 2880 lost 1.4% with it under phase 4). S = 2048,
    H = 512, I = 256, LNC2: a shape-only probe reads phase 2's held bytes and its candidates' first loads (own rings)
    as the planner counts them, and PREFETCH_MARGIN_BYTES is set so that the budget holds phase 4's (phase 3's) with
    the shallower ring and neither with the full one. Then on each core phase 2's step "head" is followed by phase
    4's step "first" with its moving ring at that depth (later panels back to their own), or (spread) nothing loads
    under phase 2; the outputs equal mx_exact bit for bit on LNC1 and LNC2, LNC1 equal to LNC2, race checker silent
    (run_mlp raises on a race). The phase 4 case fails on the old code (no prefetch under phase 2)."""
    from nkilib.core.matmul import overlap as overlap_module
    from nkilib.core.matmul.constants import MX_PACK, PREFETCH_STAGING_BUFFERS, STAGING_BUFFERS, usable_sbuf_bytes
    from nkilib.examples.mlp_backward_cost import model_mlp_backward

    S, H, I = 2048, 512, 256
    probe = spy(monkeypatch, plan_module.MatmulPlan, "can_prefetch", lambda plan, nxt: (
        nxt.spread_first, plan.held_bytes(), nxt.first_bytes(own_rings=True),
        sum(MX_PACK * 2 * (mv.load_width or nxt.order[0][1][1]) for mv in nxt.moving if mv.can_load_ahead()))
        if plan.can_fence() else None)  # phase 2's questions about phases 3 and 4
    model_mlp_backward(S, H, I, "trn3", "mxfp8", 2, False, ("central",))
    figures = dict((event[0], event[1:]) for event in probe)
    assert len(figures) == 2 and len(set(probe)) == 2, probe  # phase 3 (spread), phase 4; alike on both cores
    held, first, ring_tile = figures[spread]
    budget = held + first - (STAGING_BUFFERS - PREFETCH_STAGING_BUFFERS) * ring_tile
    assert held + figures[not spread][1] > budget, (figures, budget)  # the other phase does not fit either
    monkeypatch.setattr(overlap_module, "PREFETCH_MARGIN_BYTES", usable_sbuf_bytes() - budget)

    steps = spy(monkeypatch, plan_module.MatmulPlan, "step", lambda plan, stage: (
        stage, len(plan.order), [(mv.staging, mv.later_staging) for mv in plan.moving]) if stage != "all" else None)
    inp = mlp_inputs_with_checkpoints(S, H, I, seed=S + H + I + 45, matmul_precision="mxfp8")
    out2 = run_mlp(inp, lnc=2, matmul_precision="mxfp8")
    phase2_tiles = S // 2 // 128
    heads = [i for i, event in enumerate(steps) if event[:2] == ("head", phase2_tiles)]
    firsts = [i for i, event in enumerate(steps) if event[0] == "first"]  # the cores' programs interleave
    if spread:
        assert heads == [] and firsts == [], steps
    else:
        assert len(heads) == 2 and len(firsts) == 2 and min(firsts) > min(heads), steps
        assert [steps[i][2] for i in firsts] == [[(PREFETCH_STAGING_BUFFERS, STAGING_BUFFERS)]] * 2, steps
    assert_mlp_bit_exact_on_lnc1_and_lnc2(inp, out2, matmul_precision="mxfp8")
