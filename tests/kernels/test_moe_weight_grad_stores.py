"""Pass C's weight-gradient row stores (moe_bwd_mxfp8_pass_c_stores.RowStore; docs/moe.md section 10, round 31c):
a row's columns go out in pieces of WEIGHT_GRAD_STORE_WIDTH, a narrower last piece of at least
WEIGHT_GRAD_STORE_JOIN_MIN_COLUMNS joined to the piece before it (the DeepSeek-V3 rank's 3584 columns of H per core: one
7 KiB-run DMA, not 4 KiB + 3 KiB); a shorter last piece stays apart (GPT-OSS-20B's 2048 + 832).

| test                                  | what                                                            | fixed      |
|---------------------------------------|-----------------------------------------------------------------|------------|
| test_store_pieces                     | the pieces of a row by its width                                | host side  |
| test_dw_gu_rows_stored_without_a_     | dW_gu rows of single-block experts, 3072 columns of H per core: | LNC1, LNC2 |
| short_last_piece                      | one DMA each (2048 + 1024 before); == mx_exact                  |            |
"""
from __future__ import annotations

import numpy as np
import pytest

from nkilib.experimental.moe_mxfp8 import moe_bwd_mxfp8_kernel as kernel_module
from nkilib.experimental.moe_mxfp8.constants import WEIGHT_GRAD_STORE_JOIN_MIN_COLUMNS, WEIGHT_GRAD_STORE_WIDTH
from nkilib.experimental.moe_mxfp8.moe_bwd_mxfp8_pass_c_stores import store_pieces
from nkilib.experimental.moe_mxfp8.reference import moe_backward_reference
from nkilib.simulator.launcher import run_kernel
from moekit import expert_routing
from simkit import assert_outputs_identical
from test_moe_bwd_kernel import moe_case


def test_store_pieces():
    """Pieces of WEIGHT_GRAD_STORE_WIDTH (2048) columns from the row's start; a last piece narrower than that joins the
    one before when it has at least WEIGHT_GRAD_STORE_JOIN_MIN_COLUMNS (1024); a row of at most one piece is one."""
    assert (WEIGHT_GRAD_STORE_WIDTH, WEIGHT_GRAD_STORE_JOIN_MIN_COLUMNS) == (2048, 1024)
    assert store_pieces(0, 3584) == [(0, 3584)]  # the DeepSeek-V3 rank's core 0 half of H = 7168
    assert store_pieces(3584, 7168) == [(3584, 7168)]  # core 1's
    assert store_pieces(0, 7168) == [(0, 2048), (2048, 4096), (4096, 7168)]  # LNC1
    assert store_pieces(0, 4096) == [(0, 2048), (2048, 4096)]
    assert store_pieces(0, 3072) == [(0, 3072)]  # a last piece of exactly 1024 joins
    assert store_pieces(0, 1440) == [(0, 1440)]  # GPT-OSS-20B's core half of H = 2880
    assert store_pieces(0, 2880) == [(0, 2048), (2048, 2880)]  # GPT-OSS-20B's rows split by rows: 832 stays apart
    assert store_pieces(512, 4608) == [(512, 2560), (2560, 4608)]


@pytest.mark.parametrize("lnc,H", [(1, 3072), (2, 6144)])
def test_dw_gu_rows_stored_without_a_short_last_piece(lnc, H):
    """Three single-block experts (B = 128; the DeepSeek-V3 rank's pass C path), 3072 columns of H per core (H = 3072
    under LNC1, 6144 under LNC2): every dW_gu row store of core 0 is one 3072-column DMA (2048 + 1024 before); outputs
    == mx_exact bit for bit under LNC1 and LNC2 (the race checker on). Fails on the old code (2048- and 1024-column
    pieces)."""
    T, E, I = 250, 3, 544
    ids = expert_routing([100, 100, 50], shuffle_seed=np.random.default_rng(5))
    kernel, ref = moe_case(T, E, H, I, ids, seed=41, checkpoints=("gate_pre", "gate_act", "up", "intermediate"))
    assert np.diff(kernel["expert_block_offsets"]).tolist() == [1, 1, 1]
    res = run_kernel(kernel_module.moe_backward_mxfp8_nki.fn, kwargs=kernel, lnc=lnc, grid_ndim=1, trace=True)
    assert_outputs_identical(tuple(np.asarray(o) for o in res.outputs), moe_backward_reference(**ref),
                             f"dW_gu row stores, LNC{lnc}")
    widths = [int(o.shape[-1]) for r in res.trace if r.program == 0 and r.instr == "dma_copy"
              for o in r.writes if o.name == "gate_up_weight_grad"]
    assert set(widths) == {H // lnc} == {3072}, sorted(set(widths))
    m_tiles = -(-2 * I // 128)  # every 128-row tile of dW_gu's 2I rows stores the core's H columns once
    assert len(widths) == E * m_tiles, len(widths)
