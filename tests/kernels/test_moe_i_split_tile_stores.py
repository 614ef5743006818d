"""Pass A under the I split stores each I tile's d_gate, d_up and hs columns as the tile is done (RowChunk.store_done;
docs/moe.md section 10, round 22a), not all after the last tile: through its I tiles a core's pass A DMAs nothing
else (its rows and checkpoints are read before), so the stores went out together after the last tile's epilogue and
the DMA queues idled meanwhile. The same bytes, each written once: the outputs stay mx_exact's bit for bit.

| test                          | what                                                                     | fixed |
|-------------------------------|--------------------------------------------------------------------------|-------|
| test_i_tiles_stored_as_done   | I = 1056 (I tiles 512, 512, 32: core 0 two, core 1 one), two one-block   | LNC2  |
|                               | experts: core 0 stores columns [0, 512) of each chunk right after tile 0 |       |
|                               | and [512, 1024) at the end, core 1 its 32 columns once; == mx_exact      |       |
"""
from __future__ import annotations

from nkilib.experimental.moe_mxfp8 import moe_bwd_mxfp8_d_gate_up as G
from nkilib.experimental.moe_mxfp8 import moe_bwd_mxfp8_dx as D
from nkilib.experimental.moe_mxfp8.reference import moe_backward_reference
from moekit import expert_routing
from simkit import assert_outputs_identical, spy_per_core
from test_moe_bwd_kernel import moe_case, run
from test_moe_i_split import CHECKPOINTS


def test_i_tiles_stored_as_done(monkeypatch):
    """Two experts of one full block each (B = 256, k = 1, T = 512, H = 512, I = 1056, all four checkpoints, no
    resident budget: W_down loaded on use, so pass A splits I). Per core, program order of the chunks' epilogues (by
    I tile) and column stores: core 0 stores each chunk's [0, 512) after tile 0's epilogue of that chunk and before
    tile 1's, then [512, 1024) after tile 1's; core 1 (one tile) stores [0, 32) after it. LNC2 == mx_exact. Fails on
    the old code (no store before the last tile: every chunk's columns in one store at the end) and on a store of a
    tile before its epilogue or of the wrong columns (the outputs)."""
    monkeypatch.setattr(D, "RESIDENT_WEIGHT_BUDGET_BYTES", 0)
    T, E, H, I, B = 512, 2, 512, 1056, 256
    ids = expert_routing([256, 256], shuffle_seed=5)
    kernel, ref = moe_case(T, E, H, I, ids, seed=17, block_size=B, checkpoints=CHECKPOINTS)
    core = lambda self, ctx, *args: ctx.split.shard_id  # noqa: E731  (RowChunk's methods take the context second)
    events = spy_per_core(monkeypatch, G.RowChunk, "epilogue", core, lambda self, ctx, j, *args: ("tile", self.r0, j))
    spy_per_core(monkeypatch, G.RowChunk, "store_columns", core,
                 lambda self, ctx, i, c_lo, c_hi: ("store", self.r0, c_lo, c_hi), into=events)
    out = run(kernel, lnc=2)
    assert_outputs_identical(out, moe_backward_reference(**ref), "LNC2 I tiles stored as done vs mx_exact")
    one_block = [("tile", 0, 0), ("store", 0, 0, 512), ("tile", 128, 0), ("store", 128, 0, 512),
                 ("tile", 0, 1), ("tile", 128, 1), ("store", 0, 512, 1024), ("store", 128, 512, 1024)]
    assert events[0] == one_block * 2, events[0]
    assert events[1] == [("tile", 0, 2), ("tile", 128, 2), ("store", 0, 0, 32), ("store", 128, 0, 32)] * 2, events[1]
