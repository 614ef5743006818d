"""Token-id and slot loads ([m, 1] int32, one 4-byte descriptor per row: docs/moe.md section 10, round 27a) only where
something reads them.

Under the I split pass A reads a full block's staged dY / X rows and p back by plain DMA (RowChunk's staged path): it
loaded the chunk's token ids (read by nothing there) and slots (read only by the slot layout's checkpoint gather and the
fold's scatter, which the I split leaves to ExpertISplit.scatter). Pass B's weights-per-block path with wide W_gu
super-panels scatters each chunk's dX columns once per super-panel and loaded the chunk's token ids for every one of
them; the first scatter of a chunk now loads them and the later ones take that tile.

| test                            | what                                                                       | fixed |
|---------------------------------|----------------------------------------------------------------------------|-------|
| test_staged_rows_load_no_ids    | I split, full one-block experts: RowChunk loads no ids (block and slot     | LNC2  |
|                                 | checkpoints) and slots only with slot-layout checkpoints; == mx_exact      |       |
| test_scatter_ids_once_per_chunk | super-panels of 512 columns (two per core): pass B's scatters load each    | LNC2  |
|                                 | chunk's ids once per block, not once per super-panel; == mx_exact          |       |
"""
from __future__ import annotations

import sys

import numpy as np
import pytest

from nkilib.experimental.moe_mxfp8 import moe_bwd_mxfp8_context as C
from nkilib.experimental.moe_mxfp8 import moe_bwd_mxfp8_dx as D
from nkilib.experimental.moe_mxfp8.reference import checkpoints_to_blocks, moe_backward_reference
from moekit import expert_routing
from simkit import assert_outputs_identical, spy
from test_moe_bwd_kernel import moe_case, run
from test_moe_i_split import CHECKPOINTS


def _case(monkeypatch, layout):
    """Experts of 256 / 256 / 256 pairs, one full block each (T = 768, B = 256, k = 1, H = 2048, I = 544, all four
    checkpoints in `layout`, no resident budget: W_down loaded on use, so pass A splits I and stages each full block's
    rows a fence ahead; each core's 1024 columns of H are two W_gu tiles, so pass B loads W_gu per block)."""
    monkeypatch.setattr(D, "RESIDENT_WEIGHT_BUDGET_BYTES", 0)
    T, E, H, I, B = 768, 3, 2048, 544, 256
    ids = expert_routing([256, 256, 256], shuffle_seed=41)
    kernel, ref = moe_case(T, E, H, I, ids, seed=43, block_size=B, checkpoints=CHECKPOINTS)
    assert np.diff(kernel["expert_block_offsets"]).tolist() == [1, 1, 1]
    if layout == "block":
        kernel = dict(kernel, checkpoint_layout="block")
        for n in CHECKPOINTS:
            kernel[n] = checkpoints_to_blocks(kernel[n], ref["layout"])
    return kernel, ref


def _spy_positions(monkeypatch):
    """Every MoeContext.positions call as (core, "ids" or "slots", the calling function's name)."""
    def key(ctx, table, *args, **kwargs):
        caller = sys._getframe(3).f_code.co_name  # frames: key <- simkit.spy's record <- recorder <- the caller
        return ctx.split.shard_id, "ids" if table is ctx.ids2d else "slots", caller
    return spy(monkeypatch, C.MoeContext, "positions", key)


@pytest.mark.parametrize("layout", ["block", "slot"])
def test_staged_rows_load_no_ids(monkeypatch, layout):
    """_case's routing (three full one-block experts, fence groups [0, 1], [2]: the first group gathers its rows, expert
    2's were staged a fence ahead and are read back). RowChunk (its __init__) loads no token ids on either core, and
    slots only where the slot layout's checkpoints are gathered by them (expert 2's two chunks of 128 rows: both cores
    compute every chunk of a block); the stage (ExpertISplit.stage) and the scatter (ExpertISplit.scatter) still load
    theirs. LNC2 == mx_exact bit for bit under the race detector. Fails on the old
    code (ids and slots loaded for every chunk on the staged path)."""
    kernel, ref = _case(monkeypatch, layout)
    calls = _spy_positions(monkeypatch)
    out = run(kernel, lnc=2)
    assert_outputs_identical(out, moe_backward_reference(**ref), f"LNC2 {layout}: staged rows vs mx_exact")
    for core in (0, 1):
        in_chunk = [what for c, what, fn in calls if c == core and fn == "__init__"]
        assert in_chunk == ([] if layout == "block" else ["slots"] * 2), (core, in_chunk)
        assert any(c == core and fn == "stage" for c, _, fn in calls), calls
        assert any(c == core and fn == "scatter" for c, _, fn in calls), calls


def test_scatter_ids_once_per_chunk(monkeypatch):
    """_case's routing with pass B's wide W_gu super-panels patched to 512 columns: each core's 1024 columns of dX are
    two super-panels, so every chunk's dX columns go out in two scatters. Each chunk's token ids load once per block
    (2 chunks x 3 experts per core), by its first scatter, not once per scatter (12 on the old code). LNC2 ==
    mx_exact bit for bit under the race detector (the later scatter takes the ids the first loaded: a wrong or
    unloaded tile writes the wrong dX rows)."""
    kernel, ref = _case(monkeypatch, "block")
    monkeypatch.setattr(D, "WIDE_WEIGHT_LOAD_WIDTH", 512)
    calls = _spy_positions(monkeypatch)
    out = run(kernel, lnc=2)
    assert_outputs_identical(out, moe_backward_reference(**ref), "LNC2 scatter ids once per chunk vs mx_exact")
    for core in (0, 1):
        loads = [what for c, what, fn in calls if c == core and fn == "scatter_add"]
        assert loads == ["ids"] * 6, (core, loads)
