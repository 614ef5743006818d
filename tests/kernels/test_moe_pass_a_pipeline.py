"""Pass A's chunk pipeline (docs/moe.md section 10, round 7c): with resident weights, all of I in one group and an
even number of 128-row chunks per core, an expert's chunks run one after the other and each chunk's gathers are
issued before the previous chunk's epilogue (two sets of gathered tiles alternate; block i + 1's first chunk is
gathered during block i's last chunk, the block register plus a static offset). In a last block holding padding a
chunk runs only when its unit's first position holds a routed pair. The bits do not change: the outputs equal mx_exact,
LNC1 and LNC2.

| test                              | what                                                              | fixed      |
|-----------------------------------|-------------------------------------------------------------------|------------|
| test_pipeline_bit_exact_and_order | B = 512: an expert of two full blocks, one of a full and a padded | LNC1, LNC2 |
|                                   | block, one of a padded block, one empty; the first expert's dY    |            |
|                                   | gathers run one chunk ahead of its d_gate_up stores; its          |            |
|                                   | d_topk_weights scatters come after the fence (in B's segment);    |            |
|                                   | X is gathered after the first group's pass A, before the fence    |            |
| test_pipeline_checkpoints_by_     | round 31b: block-ordered checkpoints loaded a chunk ahead by      | LNC1, LNC2 |
| column_pieces                     | column pieces of I (patched 512 of I = 1024); == mx_exact         |            |
| test_pipeline_output_tiles_       | round 37a: the chunks' d_gate_up and hs tiles, two of each per    | LNC1, LNC2 |
| alternate                         | expert, alternate (chunk q + 2 writes chunk q's); == mx_exact     |            |
"""
from __future__ import annotations

import numpy as np
import pytest

from nkilib.examples.moe_backward_cost import PHASES
from nkilib.experimental.moe_mxfp8 import moe_bwd_mxfp8_context as C
from nkilib.experimental.moe_mxfp8 import moe_bwd_mxfp8_d_gate_up as A
from nkilib.experimental.moe_mxfp8 import moe_bwd_mxfp8_kernel as kernel_module
from nkilib.experimental.moe_mxfp8.reference import checkpoints_to_blocks, moe_backward_reference
from nkilib.simulator.launcher import run_kernel
from nkilib.simulator.trace import label_phases
from simkit import assert_outputs_identical, reads_before_writes, spy
from test_moe_bwd_kernel import CLAMPS, moe_case

CHECKPOINTS = ("gate_pre", "gate_act", "up", "intermediate")


def _routing(T=1024):
    """topk_ids [T, 2]: expert 0 takes every token (1024 pairs: two full blocks of 512), expert 1 the first 700
    (a full block and a padded one), expert 2 the other 324 (one padded block), expert 3 none."""
    ids = np.zeros((T, 2), np.int32)
    ids[:700, 1], ids[700:, 1] = 1, 2
    return ids


@pytest.mark.parametrize("lnc", [1, 2])
def test_pipeline_bit_exact_and_order(lnc):
    T, E, H, I, B = 1024, 4, 64, 96, 512
    kernel, ref = moe_case(T, E, H, I, _routing(T), seed=41, block_size=B, checkpoints=CHECKPOINTS,
                           clamp_limits=CLAMPS)
    with label_phases(kernel_module, PHASES):
        res = run_kernel(kernel_module.moe_backward_mxfp8_nki.fn, kwargs=kernel, lnc=lnc, grid_ndim=1, trace=True)
    assert_outputs_identical(tuple(np.asarray(o) for o in res.outputs), moe_backward_reference(**ref),
                             f"pass A pipeline, LNC{lnc} vs mx_exact")
    # program 0 in program order: each chunk gathers dY once and stores its d_gate_up rows once. The first expert
    # (two full blocks) runs first: its chunk j + 1's gather precedes chunk j's store, also across the block
    # boundary (the unpipelined path gathers a block's chunks together: [2, 2, 4, 4] under LNC2)
    before = reads_before_writes(res.trace, "output_grad", "moe_bwd_d_gate_up")
    chunks = 2 * (B // 128) // lnc  # the first expert's chunks on this core
    assert before[:chunks] == [j + 2 for j in range(chunks - 1)] + [chunks], before[:chunks]
    # the pipeline's d_topk_weights wait in scratch until B(e)'s segment: none is scattered before the first
    # expert's last d_gate_up store, nor (LNC2) before the first fence
    seq = [r for r in res.trace if r.program == 0]

    def where(pred):
        return [n for n, r in enumerate(seq) if pred(r)]

    stores = where(lambda r: any(getattr(t, "name", "") == "moe_bwd_d_gate_up" for t in r.writes))
    scatters = where(lambda r: any(getattr(t, "name", "") == "topk_weights_grad" for t in r.writes))
    fences = where(lambda r: r.instr == "core_barrier")
    assert scatters and min(scatters) > stores[chunks - 1], (min(scatters), stores[:chunks])
    assert lnc == 1 or min(scatters) > fences[0], (min(scatters), fences[:1])
    # gate_pre and up given: X is gathered (for pass C's x_blocks only) after the first group's pass A, before the fence
    x_reads = where(lambda r: any(getattr(t, "name", "") == "hidden_states" for t in r.reads))
    assert x_reads and min(x_reads) > stores[chunks - 1], (min(x_reads), stores[:chunks])
    assert lnc == 1 or min(x_reads) < fences[0], (min(x_reads), fences[:1])


@pytest.mark.parametrize("lnc", [1, 2])
def test_pipeline_checkpoints_by_column_pieces(monkeypatch, lnc):
    """Round 31b: the pipeline loads a chunk's block-ordered checkpoints a chunk ahead into the tiles the chunk before
    last read, one DMA per PIPELINE_CHECKPOINT_COLUMNS-wide piece of I (patched to 512 here, I = 1024), so each piece
    waits only for the tile that read its columns. _routing's experts, block-layout checkpoints: == mx_exact bit for
    bit (the same bytes land in the same places); every pipelined checkpoint load (gather_pair_values) moves at most
    512 columns, and some do. Fails on the old code: one DMA of all 1024 columns per checkpoint and chunk."""
    monkeypatch.setattr(A, "PIPELINE_CHECKPOINT_COLUMNS", 512)
    T, E, H, I, B = 1024, 4, 64, 1024, 512
    kernel, ref = moe_case(T, E, H, I, _routing(T), seed=47, block_size=B, checkpoints=CHECKPOINTS)
    kernel = dict(kernel, checkpoint_layout="block", **{n: checkpoints_to_blocks(kernel[n], ref["layout"])
                                                           for n in CHECKPOINTS})
    calls = spy(monkeypatch, C.MoeContext, "checkpoint_rows",
                lambda ctx, dst, ckpt, i, first, m, slots, f0, width, full: (f0, width))
    res = run_kernel(kernel_module.moe_backward_mxfp8_nki.fn, kwargs=kernel, lnc=lnc, grid_ndim=1)
    assert_outputs_identical(tuple(np.asarray(o) for o in res.outputs), moe_backward_reference(**ref),
                             f"checkpoint column pieces, LNC{lnc} vs mx_exact")
    widths = [w for _, w in calls]
    assert 512 in widths and max(widths) <= I, widths
    pieces = [(f0, w) for f0, w in calls if w < I]
    assert {f0 for f0, _ in pieces} == {0, 512} and {w for _, w in pieces} == {512}, pieces


def _store_sources(trace, scratch, program=0):
    """The SBUF storage id each of `program`'s DMAs into HBM tensor `scratch` reads, in program order."""
    return [next(o.storage_id for o in r.reads if o.buffer == "sbuf") for r in trace
            if r.program == program and any(o.name == scratch for o in r.writes)]


@pytest.mark.parametrize("lnc", [1, 2])
def test_pipeline_output_tiles_alternate(lnc):
    """Round 37a: the pipeline keeps two pairs of epilogue output tiles per expert (d_gate_up [128, 2I] and hs
    [128, I]) and chunk q writes pair q % 2, so the tiles a chunk's stores read are rewritten only by chunk q + 2's
    epilogue, not freed at the store: under the cost model's next-fit allocator the next chunk's epilogue temporaries
    were placed over the just-stored d_gate_up and waited for its 1.5 MB store (gwb's pass A, every chunk). _routing's
    experts, GPT-OSS-like clamps, all checkpoints: == mx_exact bit for bit, and the first expert's (two full blocks)
    stores read two tiles of each kind, alternating. Fails on the old code: a fresh tile per chunk."""
    T, E, H, I, B = 1024, 4, 64, 96, 512
    kernel, ref = moe_case(T, E, H, I, _routing(T), seed=43, block_size=B, checkpoints=CHECKPOINTS,
                           clamp_limits=CLAMPS)
    res = run_kernel(kernel_module.moe_backward_mxfp8_nki.fn, kwargs=kernel, lnc=lnc, grid_ndim=1, trace=True)
    assert_outputs_identical(tuple(np.asarray(o) for o in res.outputs), moe_backward_reference(**ref),
                             f"pass A output tiles, LNC{lnc} vs mx_exact")
    chunks = 2 * (B // 128) // lnc  # the first expert's chunks on core 0
    for scratch in ("moe_bwd_d_gate_up", "moe_bwd_weighted_inter"):
        tiles = _store_sources(res.trace, scratch)[:chunks]
        assert len(tiles) == chunks and tiles[0] != tiles[1], (scratch, tiles)
        assert tiles == [tiles[q % 2] for q in range(chunks)], (scratch, tiles)
