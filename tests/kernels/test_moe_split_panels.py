"""Pass B's d_gate_up panels made by the I split's pass A, each core its own K tiles (moe_bwd_mxfp8_split_panels.py;
docs/moe.md section 10, round 25a).

Under the I split with I a multiple of 512 and the same number of I tiles per core, core c holds the gate columns I_c
and the up columns I + I_c of every row: whole K tiles of pass B's K = 2I. Pass A transposes and quantizes them into
its K tiles of each 128-row chunk's panel and stores them (a chunk of padding only: zeros); pass B, on both cores,
loads both cores' K tiles instead of building the panel from the bf16 rows (no panel_from_rows in pass B). The outputs
stay mx_exact's bit for bit under LNC2 (the race detector on).

| test                          | what                                                                     | fixed |
|-------------------------------|--------------------------------------------------------------------------|-------|
| test_split_panels_bit_exact   | I = 1024 (one I tile per core: global K tiles core 0, 1, 0, 1), H = 2048 | LNC2  |
|                               | (W_gu per block: rows read ahead), experts of one full block, one padded |       |
|                               | block, two blocks, none, one full block: == mx_exact; per core every     |       |
|                               | computed chunk stored once, every padding-only chunk zeroed, pass B      |       |
|                               | builds no panel from rows and takes every chunk's panel from the K tiles |       |
| test_split_panels_scale_rows  | the same case traced: every DMA of the panels' scales moves only the     | LNC2  |
|                               | rows quantize_mx wrote (8 = 2 K tiles x 4 at the start of each quadrant, |       |
|                               | one DMA per quadrant; round 30a), bytes as counted from the chunk events |       |
| test_pass_c_slot_tiles        | the same case traced: d_gate_up and hs stored slot-interleaved, so every | LNC2  |
|                               | DMA reading them (pass C's) loads a K tile's 4 slots at once, each       |       |
|                               | partition's 4 rows one run of 4 x 1024 columns (round 30a); bit-exact    |       |
| test_split_panels_applies     | I = 544 (a part I tile), I tiles not shared evenly, BF16: not made       | host  |
"""
from __future__ import annotations

import numpy as np

import nki.language as nl
from nkilib.core.matmul import CoreSplit, MatmulSetup
from nkilib.experimental.moe_mxfp8 import moe_bwd_mxfp8_dx as D
from nkilib.experimental.moe_mxfp8 import moe_bwd_mxfp8_kernel as kernel_module
from nkilib.experimental.moe_mxfp8 import moe_bwd_mxfp8_split_panels as P
from nkilib.experimental.moe_mxfp8.reference import moe_backward_reference
from nkilib.simulator.launcher import run_kernel
from moekit import core_of_self, expert_routing
from simkit import assert_outputs_identical, spy, spy_per_core
from test_moe_bwd_kernel import moe_case, run
from test_moe_i_split import CHECKPOINTS


def _record(monkeypatch):
    """Calls per core of the chunk panels' methods, in program order: "store" and "zero" per chunk panel pass A stored
    or zeroed, "panel" per panel pass B took from the stored K tiles; and a list with one entry per panel pass B built
    from bf16 rows (any core)."""
    events = {}
    for what in ("store", "zero", "panel"):
        spy_per_core(monkeypatch, P.SplitChunkPanels, what, core_of_self, lambda *args, _what=what: _what, into=events)
    from_rows = spy(monkeypatch, D, "panel_from_rows")
    return events, from_rows


SCALES = "moe_bwd_d_gate_up_split_panel_scales"


def _case(monkeypatch):
    """test_split_panels_bit_exact's case: (kernel kwargs, reference kwargs)."""
    monkeypatch.setattr(D, "RESIDENT_WEIGHT_BUDGET_BYTES", 0)
    T, E, H, I, B = 912, 5, 2048, 1024, 256
    ids = expert_routing([256, 100, 300, 256], experts=[0, 1, 2, 4], shuffle_seed=29)
    return moe_case(T, E, H, I, ids, seed=83, block_size=B, checkpoints=CHECKPOINTS)


def test_split_panels_bit_exact(monkeypatch):
    """T = 912, B = 256 (two 128-row chunks per block), k = 1, H = 2048, I = 1024, all four checkpoints, no resident
    budget (the I split; pass B loads W_gu per block for one-block experts and in resident groups for the two-block
    one); experts of 256 / 100 / 300 / 0 / 256 pairs: blocks 1 (full), 1 (padded: its chunk 1 padding only), 2 (the
    second holds 44 pairs: its chunk 1 padding only), 0, 1 (full). Per core pass A stores the chunks it computes (2 +
    1 + 3 + 2 = 8) and zeroes the two padding-only ones, and pass B takes 14 chunk panels from the stored K tiles
    (experts 0, 1 and 4: 2 chunks each; expert 2: 2 blocks x 2 chunks in each of its two W_gu groups, padding-only
    chunks loaded too, their matmuls skipped) and builds none from rows. == mx_exact bit for bit. Fails on the old code
    (no K tiles stored) and on a panel whose K tiles are taken from the wrong core (the outputs)."""
    kernel, ref = _case(monkeypatch)
    assert np.diff(kernel["expert_block_offsets"]).tolist() == [1, 1, 2, 0, 1]
    events, from_rows = _record(monkeypatch)
    out = run(kernel, lnc=2)
    assert_outputs_identical(out, moe_backward_reference(**ref), "LNC2 split d_gate_up panels vs mx_exact")
    for core in (0, 1):
        counts = {what: events[core].count(what) for what in ("store", "zero", "panel")}
        assert counts == {"store": 8, "zero": 2, "panel": 14}, (core, counts)
    assert from_rows == [], len(from_rows)


def test_split_panels_scale_rows(monkeypatch):
    """test_split_panels_bit_exact's case traced under LNC2. Each core's panel holds 2 K tiles (I = 1024: one 512-column
    I tile per core, its gate and up halves) packed into one scale tile, so quantize_mx wrote scale rows 32 q + 0..7 of
    each quadrant q (4 rows per K tile, packing offsets 0 and 4). Every DMA reading or writing the panels' scales moves
    exactly such an 8-row quadrant start on its SBUF side, and their bytes add up to 4 quadrants x 8 rows x 128 columns
    per chunk stored or zeroed (one scale tile) and x 256 per chunk loaded (both cores' tiles): 8 + 2 stored / zeroed
    and 14 loaded per core. Outputs == mx_exact. Fails on the old code (whole 128-partition scale tiles, 4x the
    bytes)."""
    kernel, ref = _case(monkeypatch)
    events, _ = _record(monkeypatch)
    res = run_kernel(kernel_module.moe_backward_mxfp8_nki.fn, kwargs=kernel, lnc=2, grid_ndim=1, trace=True)
    out = tuple(np.asarray(o) for o in res.outputs)
    assert_outputs_identical(out, moe_backward_reference(**ref), "LNC2 split panels' scale rows vs mx_exact")
    quadrants, rows, columns, cores = 4, 8, 128, 2
    dmas = [r for r in res.trace if r.engine == "dma"
            and any(o.name == SCALES for o in (*r.reads, *r.writes))]
    for r in dmas:
        (sbuf,) = [o for o in (*r.reads, *r.writes) if o.buffer == "sbuf"]
        assert sbuf.partition_lo % 32 == 0 and sbuf.partition_hi - sbuf.partition_lo == rows, \
            (r.instr, sbuf.partition_lo, sbuf.partition_hi)
    moved = sum(o.nbytes for r in dmas for o in r.writes)
    chunks_written = sum(events[c].count("store") + events[c].count("zero") for c in (0, 1))
    chunks_read = sum(events[c].count("panel") for c in (0, 1))
    assert (chunks_written, chunks_read) == (20, 28), (chunks_written, chunks_read)
    assert moved == quadrants * rows * columns * (chunks_written + cores * chunks_read), moved


def test_pass_c_slot_tiles(monkeypatch):
    """test_split_panels_bit_exact's case traced under LNC2 (I = 1024: the I split with split panels, 1x32). d_gate_up
    [N, B, 2I] and hs [N, B, I] are stored slot-interleaved (4 rows' 1024-column pieces contiguous), so every DMA that
    reads them (pass C's: pass B takes the split panels) moves a whole K tile of 4 slots into a [P, 4, 1024] staging
    view (a 512-column tile of the multi-block expert's: [P, 4, 512]), its HBM side one contiguous run of 4 x 1024 bf16
    per partition for a whole piece, where each slot was one DMA of 1024-column runs before. Outputs == mx_exact.
    Fails on the old code (one [P, 1024] DMA per slot)."""
    kernel, ref = _case(monkeypatch)
    res = run_kernel(kernel_module.moe_backward_mxfp8_nki.fn, kwargs=kernel, lnc=2, grid_ndim=1, trace=True)
    out = tuple(np.asarray(o) for o in res.outputs)
    assert_outputs_identical(out, moe_backward_reference(**ref), "LNC2 slot-interleaved pass C loads vs mx_exact")
    piece, slots, bf16 = 1024, 4, 2
    loads = [r for r in res.trace if r.engine == "dma"
             and any(o.name in ("moe_bwd_d_gate_up", "moe_bwd_weighted_inter") for o in r.reads)]
    for r in loads:
        (sbuf,) = r.writes
        (hbm,) = r.reads
        assert sbuf.buffer == "sbuf" and sbuf.shape[1] == slots and sbuf.shape[2] <= piece, (sbuf.name, sbuf.shape)
        assert hbm.strides[-2:] == (piece * bf16, bf16), (hbm.name, hbm.shape, hbm.strides)
    whole = [r for r in loads if r.writes[0].shape[2] == piece]
    assert len(whole) >= 2 * 4, len(whole)  # the one-block experts' 1024-column pieces: one run of 4 x 1024 each


def test_split_panels_applies():
    """Made only with MXFP8, I in whole 512-column tiles, as many I tiles on each core and 128-row chunks."""
    class Ctx:
        def __init__(self, I, setup, cores=2, B=256):
            self.I, self.setup, self.B = I, setup, B
            self.split = CoreSplit(cores, 0)

    mx, bf16 = (MatmulSetup(p, nl.float8_e4m3fn_x4, "1x32", True) for p in ("mxfp8", "bf16"))
    tiles = lambda I: [(n0, min(512, I - n0)) for n0 in range(0, I, 512)]  # noqa: E731
    assert P.SplitChunkPanels.applies(Ctx(2048, mx), tiles(2048))
    assert not P.SplitChunkPanels.applies(Ctx(544, mx), tiles(544))  # a part I tile
    assert not P.SplitChunkPanels.applies(Ctx(1536, mx), tiles(1536))  # 2 + 1 I tiles
    assert not P.SplitChunkPanels.applies(Ctx(2048, bf16), tiles(2048))
    assert not P.SplitChunkPanels.applies(Ctx(2048, mx, B=64), tiles(2048))  # chunks of fewer than 128 rows
