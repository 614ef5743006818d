"""Pass C's weight-gradient row stores (moe_bwd_mxfp8_pass_c_stores.RowStore; docs/moe.md section 10, round 31c):
a row's columns go out in pieces of WEIGHT_GRAD_STORE_WIDTH, a narrower last piece joined to the piece before it, so
no store of a row wider than one piece runs below 4 KiB (the DeepSeek-V3 rank's 3584 columns of H per core: one
7 KiB-run DMA, not 4 KiB + 3 KiB).

| test                                  | what                                                             | fixed      |
|---------------------------------------|------------------------------------------------------------------|------------|
| test_store_pieces                     | the pieces of a row by its width                                 | host side  |
| test_dw_gu_rows_stored_without_a_     | dW_gu rows of single-block experts, H = 4608: LNC1 2048 + 2560, | LNC1, LNC2 |
| short_last_piece                      | LNC2 one 2304-column piece per core; == mx_exact                |            |
"""
from __future__ import annotations

import numpy as np
import pytest

from nkilib.experimental.moe_mxfp8 import moe_bwd_mxfp8_kernel as kernel_module
from nkilib.experimental.moe_mxfp8.constants import WEIGHT_GRAD_STORE_WIDTH
from nkilib.experimental.moe_mxfp8.moe_bwd_mxfp8_pass_c_stores import store_pieces
from nkilib.experimental.moe_mxfp8.reference import moe_backward_reference
from nkilib.simulator.launcher import run_kernel
from moekit import expert_routing
from simkit import assert_outputs_identical
from test_moe_bwd_kernel import moe_case


def test_store_pieces():
    """Pieces of WEIGHT_GRAD_STORE_WIDTH (2048) columns from the row's start; a last piece narrower than that joins the
    one before; a row of at most one piece is one piece."""
    assert WEIGHT_GRAD_STORE_WIDTH == 2048
    assert store_pieces(0, 3584) == [(0, 3584)]  # the DeepSeek-V3 rank's core 0 half of H = 7168
    assert store_pieces(3584, 7168) == [(3584, 7168)]  # core 1's
    assert store_pieces(0, 7168) == [(0, 2048), (2048, 4096), (4096, 7168)]  # LNC1
    assert store_pieces(0, 4096) == [(0, 2048), (2048, 4096)]
    assert store_pieces(0, 1440) == [(0, 1440)]  # GPT-OSS-20B's core half of H = 2880
    assert store_pieces(512, 2560) == [(512, 2560)]


@pytest.mark.parametrize("lnc", [1, 2])
def test_dw_gu_rows_stored_without_a_short_last_piece(lnc):
    """Three single-block experts (B = 128; the DeepSeek-V3 rank's pass C path), H = 4608: every dW_gu row store of
    core 0 is 2048 or 2560 columns wide under LNC1 (2048 + 2048 + 512 before) and 2304 under LNC2 (the core's whole
    half; 2048 + 256 before); outputs == mx_exact bit for bit. Fails on the old code (a 512- or 256-column last
    piece)."""
    T, E, H, I = 250, 3, 4608, 544
    ids = expert_routing([100, 100, 50], shuffle_seed=np.random.default_rng(5))
    kernel, ref = moe_case(T, E, H, I, ids, seed=41, checkpoints=("gate_pre", "gate_act", "up", "intermediate"))
    assert np.diff(kernel["expert_block_offsets"]).tolist() == [1, 1, 1]
    res = run_kernel(kernel_module.moe_backward_mxfp8_nki.fn, kwargs=kernel, lnc=lnc, grid_ndim=1, trace=True)
    assert_outputs_identical(tuple(np.asarray(o) for o in res.outputs), moe_backward_reference(**ref),
                             f"dW_gu row stores, LNC{lnc}")
    widths = [int(o.shape[-1]) for r in res.trace if r.program == 0 and r.instr == "dma_copy"
              for o in r.writes if o.name == "gate_up_weight_grad"]
    assert widths, "no dW_gu store traced"
    expected = {2048, 2560} if lnc == 1 else {H // 2}
    assert set(widths) == expected, sorted(set(widths))
    m_tiles = -(-2 * I // 128)  # every 128-row tile of dW_gu's 2I rows stores the core's H columns once
    assert sum(widths) == E * m_tiles * (H // lnc), sum(widths)
