"""The pass A pipeline's padding-only row units: which block-scratch rows get zeros (docs/moe.md section 10, round 41c).

A one-block expert's pass C reads only its filled PASS_C_ROW_UNIT-row units (the 1x32 MX scheme), so the rows of a
128-row unit that starts with padding are read by nothing in hs, dY and X: the pipeline no longer stores zeros there
(d_gate_up's rows stay zeroed: pass B's one-block path reads every chunk). A staged expert's dY (round 31a) had such a
unit's zeros stored twice, a fence ahead and again by the pipeline: now once, by the pipeline, and only where pass C
reads them (experts of two or more blocks). The outputs equal mx_exact at LNC1 and LNC2 in both checkpoint layouts.

| test                                   | what                                                                | fixed      |
|----------------------------------------|---------------------------------------------------------------------|------------|
| test_padding_rows_bit_exact            | the routing below, slot and block checkpoints / weights             | LNC1, LNC2 |
| test_one_block_padding_rows_unwritten  | one-block experts 1 (group 0) and 5 (staged): the rows of their     | LNC2       |
|                                        | padding-only unit [256, 512) unwritten in hs / dY / X, d_gate_up's  |            |
|                                        | zeroed as before; expert 7's (staged, two blocks) dY / X / hs rows  |            |
|                                        | there written once each (main: dY twice; the one-block rows once)   |            |
| test_padded_chunk_zeros_only_padding_units | round 41d: the deferred X / staged dY gathers of a padded block  | LNC2       |
|                                        | store zeros only over its 32-row units holding padding (main: the   |            |
|                                        | whole 128-row chunks, every filled row written twice)               |            |
"""
from __future__ import annotations

import numpy as np
import pytest

from nkilib.experimental.moe_mxfp8 import moe_bwd_mxfp8_kernel as kernel_module
from nkilib.experimental.moe_mxfp8.reference import (checkpoints_to_blocks, moe_backward_reference, weights_from_blocks,
                                                      weights_to_blocks)
from nkilib.simulator.launcher import run_kernel
from simkit import assert_outputs_identical
from test_moe_bwd_kernel import moe_case

CHECKPOINTS = ("gate_pre", "gate_act", "up", "intermediate")
T, E, H, I, B = 2048, 8, 64, 96, 512
#: expert -> its blocks (build_block_layout: experts' blocks in order) for the routing below
BLOCKS = {0: [0], 1: [1], 2: [2, 3], 3: [4, 5], 4: [6], 5: [7], 6: [8], 7: [9, 10]}


def _routing():
    """topk_ids [T, 2], tokens 512 q .. 512 q + 511 in fence group q's segment: pairs per expert 512, 200, 824, 824,
    512, 100, 512, 612 (blocks 1, 1, 2, 2, 1, 1, 1, 2). Experts 1 (200 pairs) and 5 (100) have one block whose unit
    [256, 512) holds only padding; expert 7's last block 100 pairs (the same unit of padding only); groups {4, 5} and
    {6, 7} have their dY staged a fence ahead (the unclamped epilogue)."""
    ids = np.zeros((T, 2), np.int32)
    q = np.arange(512)
    ids[0:512] = np.stack([np.zeros(512), np.where(q < 200, 1, 2)], 1)
    ids[512:1024] = (2, 3)
    ids[1024:1536] = np.stack([np.full(512, 4), np.where(q < 100, 5, 7)], 1)
    ids[1536:2048] = np.stack([np.full(512, 6), np.where(q < 200, 7, 3)], 1)
    counts = np.bincount(ids.ravel(), minlength=E)
    assert counts.tolist() == [512, 200, 824, 824, 512, 100, 512, 612], counts
    return ids


def _run(lnc, blocked):
    """The kernel on _routing() (blocked: checkpoints and routing weights block-ordered, the study's layouts), outputs
    == mx_exact (block-ordered d_topk_weights: +0 at every padding position); returns the trace."""
    kernel, ref = moe_case(T, E, H, I, _routing(), seed=413, block_size=B, checkpoints=CHECKPOINTS)
    layout = ref["layout"]
    if blocked:
        kernel = dict(kernel, checkpoint_layout="block", weights_layout="block",
                      topk_weights_blocks=weights_to_blocks(kernel["topk_weights"], layout),
                      **{n: checkpoints_to_blocks(kernel[n], layout) for n in CHECKPOINTS})
    assert np.diff(kernel["expert_block_offsets"]).tolist() == [len(BLOCKS[e]) for e in range(E)]
    res = run_kernel(kernel_module.moe_backward_mxfp8_nki.fn, kwargs=kernel, lnc=lnc, grid_ndim=1, trace=True)
    out = tuple(np.asarray(o) for o in res.outputs)
    if blocked:
        routed = layout.token_position_to_slot < layout.num_tokens * layout.top_k
        assert not out[1][~routed].view(np.uint32).any()  # every entry written, +0 where no pair is
        out = (out[0], weights_from_blocks(out[1], layout)) + out[2:]
    assert_outputs_identical(out, moe_backward_reference(**ref), f"padding rows (blocked {blocked}), LNC{lnc} vs mx_exact")
    return res.trace


def _row_writes(trace, name, row_bytes, block, lo, hi):
    """Per row r in [lo, hi) of `block` of the [N, B, F] scratch `name` (row_bytes = F x 2): the DMAs (all programs)
    whose written bytes cover it (an indirect DMA that moved no byte counts for none)."""
    counts = np.zeros(hi - lo, np.int64)
    for r in trace:
        if not r.instr.startswith("dma") or r.attrs.get("bytes") == 0:
            continue
        for t in r.writes:
            if getattr(t, "name", "") != name:
                continue
            first, last = t.byte_lo // row_bytes - block * B, (t.byte_hi - 1) // row_bytes - block * B
            a, b = max(first, lo), min(last + 1, hi)
            if a < b:
                counts[a - lo:b - lo] += 1
    return counts


@pytest.mark.parametrize("blocked", [False, True])
@pytest.mark.parametrize("lnc", [1, 2])
def test_padding_rows_bit_exact(lnc, blocked):
    _run(lnc, blocked)


def test_one_block_padding_rows_unwritten():
    """LNC2 (row units of 256: a unit that starts with padding is skipped by both cores). Fails on main: experts 1
    and 5's hs / dY / X rows of [256, 512) written once (the pipeline's zeros), expert 7's dY rows there twice."""
    trace = _run(2, True)
    scratches = {"moe_bwd_weighted_inter": I * 2, "moe_bwd_dy_blocks": H * 2, "moe_bwd_x_blocks": H * 2}
    for e in (1, 5):
        (block,) = BLOCKS[e]
        for name, row_bytes in scratches.items():
            got = _row_writes(trace, name, row_bytes, block, 256, 512)
            assert not got.any(), (e, name, np.unique(got))
        # d_gate_up's rows stay zeroed (pass B's one-block path reads them): its gate and up columns, a DMA each
        assert (_row_writes(trace, "moe_bwd_d_gate_up", 2 * I * 2, block, 256, 512) == 2).all(), e
        # the filled unit's rows are written (the gathers, the epilogue's stores)
        for name, row_bytes in scratches.items():
            assert (_row_writes(trace, name, row_bytes, block, 0, 256) >= 1).all(), (e, name)
    last = BLOCKS[7][-1]
    for name, row_bytes, times in list((n, b, 1) for n, b in scratches.items()) + [("moe_bwd_d_gate_up", 2 * I * 2, 2)]:
        got = _row_writes(trace, name, row_bytes, last, 256, 512)
        assert (got == times).all(), (name, np.unique(got))


def _expected_unit_writes(pairs, hi):
    """Writes per row of [0, hi) of a padded block's X / staged dY copy holding `pairs` routed pairs from its start,
    when the deferred gather stores zeros over only the ZERO_PADDING_UNIT(32)-row units that hold padding: the
    gather of a 128-row chunk holding a pair covers the chunk's rows (one indirect DMA; a chunk of padding only moves
    no byte), and the zeros cover the rows of each 32-row unit whose last row is padding."""
    rows = np.arange(hi)
    gathered = (rows // 128 * 128) < pairs
    zeroed = (rows // 32 * 32 + 31) >= pairs
    return gathered.astype(np.int64) + zeroed


def test_padded_chunk_zeros_only_padding_units():
    """LNC2: the deferred HBM -> HBM gathers of a padded block's chunks (X for pass C; expert 5's staged dY) store
    zeros only over the 32-row units that hold padding (round 41d). Expert 1 (one block of 200 pairs: rows [0, 192)
    written once, by the gather), expert 5 (100 pairs, staged: X and dY; core 1's chunk [128, 256) only padding: its
    zeros alone), expert 7's last block (100 pairs, staged). Fails on main: the whole 128-row chunks were zeroed
    first, rows [0, 192) of expert 1 and [0, 96) of experts 5 and 7 written twice."""
    trace = _run(2, True)
    row_bytes = H * 2
    cases = [(BLOCKS[1][0], 200, ["moe_bwd_x_blocks"]),
             (BLOCKS[5][0], 100, ["moe_bwd_x_blocks", "moe_bwd_dy_blocks"]),
             (BLOCKS[7][-1], 100, ["moe_bwd_x_blocks", "moe_bwd_dy_blocks"])]
    for block, pairs, names in cases:
        want = _expected_unit_writes(pairs, 256)
        for name in names:
            got = _row_writes(trace, name, row_bytes, block, 0, 256)
            bad = np.nonzero(got != want)[0]
            assert not bad.size, (block, name, bad[:8], got[bad[:8]], want[bad[:8]])
