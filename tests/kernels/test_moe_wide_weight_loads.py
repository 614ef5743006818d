"""Wide weight super-panels of the MoE kernel (docs/moe.md section 10, round 6c): a weight loaded on use (not
resident) whose quantized panel of WIDE_WEIGHT_LOAD_WIDTH columns fits WIDE_WEIGHT_PANEL_BYTES loads in super-panels
of that width (4 KiB DMA runs; DeepSeek-V3's W_gu in pass B), staged through one ring of WIDE_WEIGHT_STAGING_BUFFERS
tiles that a block's wide loads share.

| test                              | what                                                           | fixed      |
|-----------------------------------|----------------------------------------------------------------|------------|
| test_wide_w_gu_loads_bit_exact    | W_gu per block: 2048 + 1152 (LNC1), 1664 / 1536 (LNC2) columns | LNC1, LNC2 |
| test_load_width_by_panel_bytes    | width by panel size and residency                              | host side  |
| test_dx_scattered_per_super_panel | pass B's dX rows out per W_gu super-panel, k = 1 and k = 2     | LNC1, LNC2 |
"""
from __future__ import annotations

import numpy as np
import pytest

import nki.language as nl
from nkilib.core.matmul import MatmulSetup, TensorDescriptor
from nkilib.experimental.moe_mxfp8 import constants as K
from nkilib.experimental.moe_mxfp8 import moe_bwd_mxfp8_dx as D
from nkilib.experimental.moe_mxfp8 import moe_bwd_mxfp8_kernel as kernel_module
from nkilib.experimental.moe_mxfp8.reference import moe_backward_reference
from nkilib.simulator.launcher import run_kernel
from moekit import expert_routing
from simkit import BF16, assert_outputs_identical, spy
from test_moe_bwd_kernel import moe_case, run

SETUP = MatmulSetup("mxfp8", nl.float8_e4m3fn_x4, "1x32", True)


@pytest.mark.parametrize("lnc", [1, 2])
def test_wide_w_gu_loads_bit_exact(monkeypatch, lnc):
    """No resident budget (weights loaded per block), H = 3200, 2I = 1088 (three K tiles through the ring of 2: a
    2048-column panel takes 26 KiB): W_gu's loads in pass B are this core's H columns in super-panels of 2048 (LNC1:
    2048 + 1152 through one shared ring per block; LNC2: the cores' 1664 / 1536 columns in one load each), an expert of
    two blocks (one load per 512-column resident group) beside single-block ones; outputs == mx_exact bit for bit."""
    monkeypatch.setattr(D, "RESIDENT_WEIGHT_BUDGET_BYTES", 0)
    T, E, H, I = 300, 3, 3200, 544
    widths = spy(monkeypatch, D, "load_panel",  # W_gu's (K = 2I); W_down has K = H
                 lambda op, f0, f_size, *rest, **kw: (f_size, kw.get("ring")) if op.k_size == 2 * I else None)
    ids = expert_routing([150, 100, 50], shuffle_seed=8)
    kernel, ref = moe_case(T, E, H, I, ids, seed=31, checkpoints=("gate_pre", "gate_act", "up", "intermediate"))
    assert np.diff(kernel["expert_block_offsets"]).tolist() == [2, 1, 1]
    assert_outputs_identical(run(kernel, lnc=lnc), moe_backward_reference(**ref), f"wide loads, LNC{lnc}")
    # the single-block experts load per block (two of them); the two-block expert one 512-column tile per group
    wide = [(f, r) for f, r in widths if f > K.WEIGHT_LOAD_WIDTH]
    assert all(f <= K.MOE_N_TILE and r == None for f, r in widths if f <= K.WEIGHT_LOAD_WIDTH)  # noqa: E711
    assert all(r.size == K.WIDE_WEIGHT_STAGING_BUFFERS for _, r in wide)
    if lnc == 1:  # per block: 2048 + 1152 columns through one ring
        assert [f for f, _ in wide] == [2048, 1152] * 2, widths
        assert wide[0][1] is wide[1][1] and wide[2][1] is wide[3][1] and wide[0][1] is not wide[2][1]
    else:
        assert sorted(f for f, _ in wide) == [1536, 1536, 1664, 1664], widths  # each core's columns, in one load


def test_load_width_by_panel_bytes():
    """DeepSeek-V3's W_gu (K = 2I = 4096: 68 KiB at 2048 columns) loads wide when not resident; its W_down (K = H =
    7168: 120 KiB) and any resident panel keep WEIGHT_LOAD_WIDTH; a K-contiguous operand loads per tile (0)."""
    w_gu = TensorDescriptor(np.zeros((4096, 8), BF16), k_axis=0)
    w_down = TensorDescriptor(np.zeros((7168, 8), BF16), k_axis=0)
    w_gate = TensorDescriptor(np.zeros((8, 4096), BF16), k_axis=1)
    assert D.ExpertPanels.load_width(w_gu, SETUP, wide=True) == K.WIDE_WEIGHT_LOAD_WIDTH == 2048
    assert D.ExpertPanels.load_width(w_gu, SETUP) == K.WEIGHT_LOAD_WIDTH == 1024
    assert D.ExpertPanels.load_width(w_down, SETUP, wide=True) == 1024
    assert D.ExpertPanels.load_width(w_gate, SETUP, wide=True) == 0


@pytest.mark.parametrize("lnc,k,H", [(1, 1, 3200), (2, 1, 4608), (1, 2, 3200)])
def test_dx_scattered_per_super_panel(monkeypatch, lnc, k, H):
    """No resident budget (W_gu loaded per block in 2048-column super-panels), B = 128: a single-block expert's dX
    columns go out per super-panel, each after every chunk's tiles of it (LNC1, H = 3200: 2048 + 1152 columns per
    chunk; LNC2, H = 4608: each core's 2304 as 2048 + 256), by plain scatters for k = 1 and read-modify-writes for
    k = 2; a two-block expert (resident 512-column groups) keeps one scatter per group; outputs == mx_exact bit for
    bit. The old code scattered each chunk's whole width (3200 / 2304 columns) once, after its last tile."""
    monkeypatch.setattr(D, "RESIDENT_WEIGHT_BUDGET_BYTES", 0)
    E, I = 3, 544
    r = np.random.default_rng(8)
    if k == 1:  # experts of 2 / 1 / 1 blocks
        T, counts = 300, [150, 100, 50]
    else:  # token rows (e, e + 1 mod 3): experts of 60 + 30, 30 + 60, 30 + 30 pairs, one block each
        T, counts = 120, [60, 30, 30]
    ids = expert_routing(counts, shuffle_seed=r)
    if k == 2:
        ids = np.concatenate([ids, (ids + 1) % E], axis=1)
    kernel, ref = moe_case(T, E, H, I, ids, seed=37, checkpoints=("gate_pre", "gate_act", "up", "intermediate"))
    blocks = np.diff(kernel["expert_block_offsets"]).tolist()
    assert blocks == ([2, 1, 1] if k == 1 else [1, 1, 1]), blocks
    res = run_kernel(kernel_module.moe_backward_mxfp8_nki.fn, kwargs=kernel, lnc=lnc, grid_ndim=1, trace=True)
    assert_outputs_identical(tuple(np.asarray(o) for o in res.outputs), moe_backward_reference(**ref),
                             f"dX per super-panel, LNC{lnc}, k = {k}")
    instr = "dma_copy" if k == 1 else "dma_compute"
    widths = sorted(int(o.shape[-1]) for rec in res.trace if rec.program == 0 and rec.instr == instr
                    for o in rec.writes if o.name == "hidden_states_grad")
    per_core = H // lnc
    singles = blocks.count(1)  # one 128-row chunk each (B = 128)
    assert per_core not in widths, widths  # no chunk's whole width in one scatter
    wide = [w for w in widths if w > K.MOE_N_TILE]
    expected_wide = [2048, per_core - 2048] if per_core - 2048 > K.MOE_N_TILE else [2048]
    assert wide == sorted(expected_wide * singles), widths
    assert widths.count(per_core - 2048) >= singles, widths
