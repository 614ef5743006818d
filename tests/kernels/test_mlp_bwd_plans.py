"""The kernel's large-shape execution plans, forced on small shapes, stay bit-exact.

Model shapes (e.g. Qwen3-8B TP1, K = 2I = 24576) take plans that the small default-suite shapes never
reach: panels not resident, groups of stationary loads, K-streamed groups with several PSUM
accumulators, phase 1 without the on-chip d_gate_up path. Shrinking the SBUF budgets (module
constants of the matmul plan layer, nkilib.core.matmul.plan) routes small shapes through those plans; outputs must still
equal `mx_exact` bit for bit, on LNC1 and LNC2, in both precisions.

The plans' schedules have files of their own: test_mlp_bwd_plans_interleave.py (K-interleaved spans),
test_mlp_bwd_plans_phase2_streamed.py (the K-streamed phase 2's head and tail), test_mlp_bwd_plans_staging.py
(phase 1's cold-start staging rings) and test_mlp_bwd_plans_stores.py (phase 2's fence, the last tile's stores).
"""
import pytest

from nkilib.core.matmul import panel_builder as builder_module
from nkilib.core.matmul import plan as plan_module
from nkilib.core.matmul import sources as sources_module
from nkilib.core.matmul import tiling as tiling_module
from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8 import mlp_bwd_mxfp8_kernel as kernel_module
from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8.config import MatmulConfig, MlpBwdMatmulConfig
from simkit import (assert_mlp_bit_exact, assert_mlp_bit_exact_on_lnc1_and_lnc2, count_calls, mlp_inputs,
                    mlp_inputs_with_checkpoints, run_mlp, spy_returns)


@pytest.fixture
def tiny_budgets(monkeypatch):
    """Nothing resident, one load per stationary group, K-streamed groups of 2-3 m tiles; the calls of
    MatmulPlan._run_streamed so far (count_calls)."""
    monkeypatch.setattr(tiling_module, "PANEL_CACHE_BUDGET_BYTES", 1)
    monkeypatch.setattr(tiling_module, "RESIDENT_OPERAND_BUDGET_BYTES", 1)
    monkeypatch.setattr(tiling_module, "STATIONARY_GROUP_BUDGET_BYTES", 1)
    monkeypatch.setattr(tiling_module, "STREAM_STATIONARY_BUDGET_BYTES", 3 * 128 * 8)
    monkeypatch.setattr(tiling_module, "MOVING_PANEL_BUDGET_BYTES", 64 * 1024)
    return count_calls(monkeypatch, plan_module.MatmulPlan, ["_run_streamed"])


@pytest.mark.parametrize("precision", ["mxfp8", "bf16"])
@pytest.mark.parametrize("shape", [(512, 256, 384), (260, 128, 224)])
@pytest.mark.parametrize("lnc", [1, 2])
def test_forced_large_shape_plans_are_bit_exact(tiny_budgets, precision, shape, lnc):
    S, H, I = shape
    inp = mlp_inputs(S, H, I, seed=S + H + I)
    out = run_mlp(inp, lnc=lnc, matmul_precision=precision)
    assert_mlp_bit_exact(out, inp, matmul_precision=precision)
    assert tiny_budgets["_run_streamed"] > 0, "the K-streamed plan was not exercised"


@pytest.mark.parametrize("precision", ["mxfp8", "bf16"])
@pytest.mark.parametrize("lnc", [1, 2])
def test_resident_operand_plans_are_bit_exact(monkeypatch, precision, lnc):
    """Neither operand fits the panel cache (TP1's phases 3 and 4 at model shapes): the smaller whole operand
    stays resident (moving: m-major; stationary: n-major) and the other is streamed once; outputs stay
    bit-exact. Both variants must be taken on these shapes."""
    monkeypatch.setattr(tiling_module, "PANEL_CACHE_BUDGET_BYTES", 1)
    taken = spy_returns(monkeypatch, tiling_module, "_resident_operand", lambda out, *args: out[:2])
    for S, H, I in [(512, 256, 384), (512, 384, 128)]:
        inp = mlp_inputs(S, H, I, seed=S + H + I)
        out = run_mlp(inp, lnc=lnc, matmul_precision=precision)
        assert_mlp_bit_exact(out, inp, matmul_precision=precision)
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
    monkeypatch.setattr(tiling_module, "PANEL_CACHE_BUDGET_BYTES", 1)
    taken = spy_returns(monkeypatch, kernel_module, "phase1_split_along_i",
                        lambda out, plan_s, plan_i: (out, plan_i.ranges))
    S, H, I = 256, 256, 768
    # the model shapes' checkpoints given (phase 1 then forms one product, dI, the rule's case)
    inp = mlp_inputs_with_checkpoints(S, H, I, seed=S + H + I, matmul_precision=precision)
    out2 = run_mlp(inp, lnc=2, matmul_precision=precision)
    assert [t[0] for t in taken] == [True, True], taken  # both cores
    assert {t[1] for t in taken} == {((0, S), (0, 384)), ((0, S), (384, I))}, taken
    assert_mlp_bit_exact_on_lnc1_and_lnc2(inp, out2, matmul_precision=precision)


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

    original = tiling_module.tile_order

    def lead_taken(out, m_blocks, n_blocks, m_outer, m_group=0, lead=1):
        """(lead, whether the order differs from the plain one) of an m-major call over several n blocks."""
        if m_outer and lead > 1 and len(n_blocks) > 1:
            return lead, out != original(m_blocks, n_blocks, m_outer, m_group)
        return None

    leads = spy_returns(monkeypatch, tiling_module, "tile_order", lead_taken)
    assert sources_module.tile_order is original
    small = MatmulConfig(m_tile=32, n_tile=128)
    config = MlpBwdMatmulConfig(phase3=small, phase4=small)
    S, H, I = 512, 256, 384
    inp = mlp_inputs(S, H, I, seed=S + H + I + 1)
    out = run_mlp(inp, lnc=lnc, matmul_precision=precision, matmul_config=config)
    assert_mlp_bit_exact(out, inp, matmul_precision=precision)
    assert len(leads) >= 2, leads  # phase 3 and phase 4 (LNC2: a core with one n block keeps m-major)
    assert all(changed for _, changed in leads), leads  # the order did change


def test_weight_grad_phases_narrowed_after_i_split_with_one_k_tile(monkeypatch):
    """After phase 1's I split, phases 3-4 contracting over one K tile (S <= MX_K_TILE) take MX_N_TILE, not
    MX_N_TILE_WEIGHT_GRAD (fit_weight_grad_n_tile: at S = 512, H = 4096, I = 12288 the wide accumulators found no PSUM
    placement). Forced on a small shape (as test_phase1_split_along_i_is_bit_exact) with I = 2304: phase 4's [H, I]
    output, 1152 columns per core, then runs in MX_N_TILE-wide n blocks; outputs bit-exact against mx_exact on LNC2 (the race checker
    on) and LNC1 (no split: the wide default), equal to each other."""
    from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8.constants import MX_N_TILE, MX_N_TILE_WEIGHT_GRAD

    monkeypatch.setattr(tiling_module, "PANEL_CACHE_BUDGET_BYTES", 1)
    taken = spy_returns(monkeypatch, kernel_module, "phase1_split_along_i", lambda out, plan_s, plan_i: out)
    widths = spy_returns(monkeypatch, kernel_module, "plan_matmul",
                         lambda plan, st, mv, m, n, setup, config, *a, **kw: (m, n, config.n_tile,
                                                                             {nb for _, nb in plan.order}))
    S, H, I = 256, 256, 2304
    inp = mlp_inputs_with_checkpoints(S, H, I, seed=S + H + I, matmul_precision="mxfp8")
    out2 = run_mlp(inp, lnc=2, matmul_precision="mxfp8")
    assert taken == [True, True], taken
    phase4 = [w for w in widths if w[:2] == (H, I)]
    phase3 = [w for w in widths if w[:2] == (2 * I, H)]
    assert len(phase4) == 2 and len(phase3) == 2, widths  # one plan per core each
    assert all(w[2] == MX_N_TILE for w in phase4 + phase3), widths
    assert all(max(width for _, width in w[3]) == MX_N_TILE for w in phase4), widths  # 1152 in 1024 + 128
    del widths[:]
    assert_mlp_bit_exact_on_lnc1_and_lnc2(inp, out2, matmul_precision="mxfp8")
    assert {w[2] for w in widths if w[:2] in ((H, I), (2 * I, H))} == {MX_N_TILE_WEIGHT_GRAD}, widths  # LNC1


def test_narrow_panels_after_pieced_ones_go_in_pieces_and_stay_bit_exact(monkeypatch):
    """A PanelSource whose earlier panel's words went in pieces (above MX_PANEL_WHOLE_MAX_BYTES) quantizes its later,
    narrower panels in pieces too (round 50b: 9216 x 4096 x 1536's phase-4 tail panel, 27 KiB whole, found no gap).
    Scaled down (panels above 1 KiB in pieces of 512 B, one 128-column K tile each; S = 1024, H = 256, I = 640,
    phases 3-4 in 256-column tiles): some source's 128-column panels (two K tiles, 1 KiB: whole on the old code)
    follow a pieced 256-column panel and are built one K tile per words allocation; the outputs are bit-exact against
    mx_exact, LNC1 equal to LNC2."""

    monkeypatch.setattr(builder_module, "MX_PANEL_WHOLE_MAX_BYTES", 1024)
    monkeypatch.setattr(builder_module, "MX_PANEL_PIECE_BYTES", 512)
    narrow_after_pieces = []  # builders of panels not above the whole-max, placed in pieces by the source's rule
    original = builder_module.PanelBuilder.__init__

    def recording(self, f_pad, setup, t_lo, count, placement=None, quantize_columns=1):
        original(self, f_pad, setup, t_lo, count, placement, quantize_columns)
        if placement != None and placement.kind == "pieces" and not builder_module.words_above_whole_max(  # noqa: E711
                count, f_pad) and count > 1:
            narrow_after_pieces.append(self)

    monkeypatch.setattr(builder_module.PanelBuilder, "__init__", recording)
    assert sources_module.words_above_whole_max is builder_module.words_above_whole_max
    S, H, I = 1024, 256, 640
    inp = mlp_inputs(S, H, I, seed=S + H + I + 50)
    small = MatmulConfig(m_tile=32, n_tile=256)
    config = MlpBwdMatmulConfig(phase3=small, phase4=small)
    out2 = run_mlp(inp, lnc=2, matmul_precision="mxfp8", matmul_config=config)
    pieced = [b for b in narrow_after_pieces if b.tiles_per_words_allocation(True) < b.count]
    assert pieced and all(b.f_pad == 128 and b.tiles_per_words_allocation(True) == 1 for b in pieced), \
        [(b.f_pad, b.count, b.tiles_per_words_allocation(True)) for b in narrow_after_pieces]
    assert_mlp_bit_exact_on_lnc1_and_lnc2(inp, out2, matmul_precision="mxfp8", matmul_config=config)
