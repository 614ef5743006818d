"""LNC2's core shares of pass B's dX columns and pass C's dW_down (docs/moe.md section 10, round 41a). Pass B: each core
owns a contiguous half of H in units of DX_SPLIT_ALIGN (32) columns instead of SPLIT_ALIGN (128), so an H that is not a
multiple of 256 splits evenly (GPT-OSS-20B's 2880: 1440 / 1440, before 1536 / 1344). Pass C: where CoreSplit leaves core
0 the larger share of both gradients, dW_down's shares go to the cores in reverse order (GPT-OSS-20B: 23 + 11 and
22 + 12 m tiles instead of 23 + 12 and 22 + 11). The bits do not change: outputs equal mx_exact, LNC1 and LNC2.

| test                        | what                                                                    | fixed      |
|-----------------------------|-------------------------------------------------------------------------|------------|
| test_dx_columns_halves      | dx_columns for LNC2: contiguous, covering [0, H), and H / 2 per core    | -          |
|                             | where H is a multiple of 64 (2880 included); LNC1 owns all of H         |            |
| test_dx_split_kernel        | H = 192 (not a multiple of 256), k = 2, B = 128: each core's writes of  | LNC1, LNC2 |
|                             | dX (zeroing and scatter-adds) cover exactly its 96 columns (fails on    |            |
|                             | main: 128 / 64); bit-exact vs mx_exact                                  |            |
| test_down_grad_reversed     | which shapes reverse dW_down's shares: GPT-OSS-20B's, not Qwen3's or    | -          |
|                             | the DeepSeek-V3 rank's (even splits)                                    |            |
| test_down_grad_rows_kernel  | H = 320, I = 96 (dW_down [320, 96] split 256 / 64 rows, dW_gu [192,     | LNC1, LNC2 |
|                             | 320] 256 / 64 columns): core 0 writes dW_down's rows [256, 320), core 1 |            |
|                             | [0, 256) (fails on main: the other way round), in experts of 2, 1 and 0 |            |
|                             | blocks (resident, single-block, zero paths); bit-exact vs mx_exact      |            |
"""
from __future__ import annotations

import numpy as np
import pytest

from nkilib.experimental.moe_mxfp8 import moe_bwd_mxfp8_kernel as kernel_module
from nkilib.experimental.moe_mxfp8.moe_bwd_mxfp8_dx import dx_columns
from nkilib.experimental.moe_mxfp8.moe_bwd_mxfp8_grad_split import down_grad_reversed
from nkilib.experimental.moe_mxfp8.reference import moe_backward_reference
from nkilib.simulator.launcher import run_kernel
from moekit import expert_routing
from simkit import assert_outputs_identical, touches
from test_moe_bwd_kernel import CLAMPS, moe_case


@pytest.mark.parametrize("H", [64, 192, 320, 2048, 2880, 7168])
def test_dx_columns_halves(H):
    assert dx_columns(H, 1, 0) == (0, H)
    ranges = [dx_columns(H, 2, c) for c in range(2)]
    assert ranges[0][0] == 0 and ranges[0][1] == ranges[1][0] and ranges[1][1] == H, (H, ranges)
    assert [hi - lo for lo, hi in ranges] == [H // 2, H // 2], (H, ranges)


def test_dx_columns_odd_units():
    # H = 160: five 32-column units, the first core takes the third
    assert [dx_columns(160, 2, c) for c in range(2)] == [(0, 96), (96, 160)]


def _dx_columns_written(records, H):
    """{(first column, last column + 1)} of every write into dX (hidden_states_grad, [T, H] bf16) among `records`."""
    cols = set()
    for r in records:
        for w in r.writes:
            if w.name == "hidden_states_grad":
                c0 = (w.byte_offset // 2) % H
                cols.add((c0, c0 + w.shape[-1]))
    return cols


@pytest.mark.parametrize("lnc", [1, 2])
def test_dx_split_kernel(lnc):
    T, E, H, I, B = 256, 4, 192, 64, 128
    rng = np.random.default_rng(4101)
    ids = np.stack([rng.permutation(E)[:2] for _ in range(T)]).astype(np.int32)  # k = 2: dX zeroed, then added to
    kernel, ref = moe_case(T, E, H, I, ids, seed=4103, block_size=B, checkpoints=(), clamp_limits=CLAMPS)
    res = run_kernel(kernel_module.moe_backward_mxfp8_nki.fn, kwargs=kernel, lnc=lnc, grid_ndim=1, trace=True)
    assert_outputs_identical(tuple(np.asarray(o) for o in res.outputs), moe_backward_reference(**ref),
                             f"dX columns split at H / 2, LNC{lnc} vs mx_exact")
    for program in range(lnc):
        records = [r for r in res.trace if r.program == program]
        scatters = [r for r in records if r.instr == "dma_compute" and touches(r, "hidden_states_grad", "writes")]
        assert scatters, f"core {program}: no dX scatter-add in the trace"
        want = (0, H) if lnc == 1 else (program * H // 2, (program + 1) * H // 2)
        assert _dx_columns_written(records, H) == {want}, (program, sorted(_dx_columns_written(records, H)))


@pytest.mark.parametrize("H, I, reversed_", [(2880, 2880, True), (2048, 768, False), (7168, 2048, False),
                                             (320, 96, True), (192, 64, False)])
def test_down_grad_reversed(H, I, reversed_):
    assert down_grad_reversed(2, H, I) == reversed_
    assert not down_grad_reversed(1, H, I)


def _rows_written(records, name, rows, cols):
    """{(first row, last row + 1)} of every write into the [E, rows, cols] output `name` among `records`."""
    out = set()
    for r in records:
        for w in r.writes:
            if w.name == name:
                r0 = (w.byte_offset // w.storage_itemsize // cols) % rows
                out.add((r0, r0 + w.shape[0]))
    return out


@pytest.mark.parametrize("lnc", [1, 2])
def test_down_grad_rows_kernel(lnc):
    T, E, H, I, B = 384, 3, 320, 96, 128
    ids = expert_routing([256, 128, 0], shuffle_seed=4107)  # k = 1: 2, 1 and 0 blocks
    kernel, ref = moe_case(T, E, H, I, ids, seed=4109, block_size=B, checkpoints=(), clamp_limits=CLAMPS)
    res = run_kernel(kernel_module.moe_backward_mxfp8_nki.fn, kwargs=kernel, lnc=lnc, grid_ndim=1, trace=True)
    assert_outputs_identical(tuple(np.asarray(o) for o in res.outputs), moe_backward_reference(**ref),
                             f"dW_down's shares reversed, LNC{lnc} vs mx_exact")
    for program in range(lnc):
        records = [r for r in res.trace if r.program == program]
        rows = _rows_written(records, "down_weight_grad", H, I)
        # 320 rows: three 128-row units, CoreSplit's 256 / 64; reversed, core 1 takes the 256
        want = (0, H) if lnc == 1 else ((256, H) if program == 0 else (0, 256))
        assert rows and min(r0 for r0, _ in rows) == want[0] and max(r1 for _, r1 in rows) == want[1], \
            (program, sorted(rows))
