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
