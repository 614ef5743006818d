"""Pass A's pipeline with a block's chunks on chip together (docs/moe.md section 10, round 36a).

compute_phase1_pipelined_mxfp8 (round 7c) runs this core's 128-row chunks of a block one after the other, each chunk's
I-tile loop alone: per I tile the clamped epilogue is a chain across ScalarE, VectorE and GpSimd, and the chunk's
d_gate_up panel transposes on TensorE wait for its last gate mask product (rounds 33a, 35b, 35c). Here all of a block's
chunks share one I-tile loop (compute_phase1_chunks_mxfp8: the I tiles outside the chunks), so each engine has the
other chunk's independent epilogue work between the steps of one chunk's chain, and the chunk boundary where TensorE
waits for that chain comes once per block instead of once per chunk.

The inputs of the next block are gathered into the same ChunkInputs (one per chunk) as soon as their current reader is
issued, so that no second set of tiles is needed: its token ids and dY rows after the chunks' dY panels are built (the
first I tile's matmuls), each checkpoint column piece after the epilogue of the I tile after the piece's last (that
tile issues the gate mask product of the one before, the piece's last reader), the last piece and p after the stores.
The ids and slots the store reads must not be overwritten first: taken only without slots (block-ordered checkpoints
and weights, the study's configuration), where the store reads neither.
"""
from __future__ import annotations

import nki.language as nl

from ...core.kernel_helpers import kernel_assert
from .constants import PARTITIONS
from .moe_bwd_mxfp8_d_gate_up import ChunkInputs, compute_phase1_chunks_mxfp8, zero_padding_rows

__all__ = ["block_chunks_together", "compute_phase1_block_chunks_mxfp8"]


def block_chunks_together(ctx):
    """Whether compute_phase1_block_chunks_mxfp8 can run the pipeline (no slot tiles: their store would read the
    next block's)."""
    return ctx.checkpoints_blocked and ctx.weights_blocked


def compute_phase1_block_chunks_mxfp8(ctx, e, b_lo, before_last, last, w_down, w_gate, w_up, between=None, first=None):
    """compute_phase1_pipelined_mxfp8 (same arguments and results) with each block's chunks in one I-tile loop.

    Dimensions: per chunk as compute_phase1_block_grads_mxfp8 (m = 128 rows, dY_b [128, H], K=H); one ChunkInputs
    (ids [128, 1], dY rows [128, Hp], p [128, 1], checkpoints [128, I]) and one RowChunk's state per chunk of a block.
    """
    rows = ctx.unit_rows
    kernel_assert(block_chunks_together(ctx), "pass A's block chunks together need block-ordered checkpoints and "
                  f"weights, got checkpoints_blocked={ctx.checkpoints_blocked}, weights_blocked={ctx.weights_blocked}")
    kernel_assert(all(m == PARTITIONS for _, m in rows), f"pass A's block chunks need 128-row chunks, got {rows}")
    staged = e in ctx.staged_dy
    sets = [first or ChunkInputs(ctx, PARTITIONS, ctx.I, dy_staged=staged)] + \
        [ChunkInputs(ctx, PARTITIONS, ctx.I, dy_staged=staged) for _ in rows[1:]]

    def gather_all(i, full, qs):
        for q in qs:
            sets[q].gather(ctx, i, rows[q][0], full, pieces=True)

    if first == None:  # noqa: E711
        ctx.loops.if_multi(e, lambda: gather_all(b_lo, True, range(len(rows))))
    else:
        ctx.loops.if_multi(e, lambda: gather_all(b_lo, True, range(1, len(rows))))

    def block(i, full, next_full):
        """Block i's chunks together; next_full: block i + 1 holds no padding (None: no next block of this expert)."""
        ahead = next_full != None  # noqa: E711

        def rows_ahead():
            for q, (r0, _) in enumerate(rows):
                sets[q].gather_rows(ctx, i, r0, next_full, ahead=1)

        def values_ahead(ending, p):
            for q, (r0, _) in enumerate(rows):
                sets[q].gather_pair_values(ctx, i, ctx.B + r0, next_full, pieces=True, p=p, ending=ending)

        piece = None if between == None else (lambda: [between(q) for q in range(len(rows))])  # noqa: E711
        compute_phase1_chunks_mxfp8(ctx, e, i, rows, w_down, w_gate, w_up, full, sets, before_store=piece,
                                    at_first_tile=rows_ahead if ahead else None,
                                    after_tile=(lambda n0: values_ahead([n0], False)) if ahead else None)
        if ahead:  # p and the last piece: their last readers are the epilogues and the stores just issued
            values_ahead([ctx.I], True)

    def padded_last(i, flags):
        """The last block holding padding: chunk q > 0 runs only when its unit's first position holds a routed pair
        (its inputs were gathered with the block before, zeroed where padding)."""
        for q, (r0, m) in enumerate(rows):
            piece = None if between == None else (lambda q=q: between(q))  # noqa: E711
            if q == 0:
                compute_phase1_chunks_mxfp8(ctx, e, i, [(r0, m)], w_down, w_gate, w_up, False, [sets[0]],
                                            before_store=piece)
                continue
            ctx.if_flag(flags, q, lambda r0=r0, m=m, q=q: compute_phase1_chunks_mxfp8(
                ctx, e, i, [(r0, m)], w_down, w_gate, w_up, False, [sets[q]]))
            ctx.if_flag(flags, q, lambda r0=r0, m=m: zero_padding_rows(ctx, i, r0, m, 0, ctx.I), complement=True)
            if piece != None:  # noqa: E711
                piece()

    def last_two(next_full):
        ctx.loops.if_single(e, lambda i: [sets[q].gather(ctx, i, r0, next_full) for q, (r0, _) in enumerate(rows)])
        nl.fori_loop(before_last, last, lambda i: block(i, True, next_full))
        if next_full:
            block(last, True, None)
        else:
            padded_last(last, ctx.row_flags(last, ctx.row_unit, len(rows)))

    nl.fori_loop(b_lo, before_last, lambda i: block(i, True, True))
    full = ctx.row_flags(last, ctx.B - 1, 2)  # position B - 1 of the last block holds a routed pair: no padding
    ctx.if_flag(full, 1, lambda: last_two(True))
    ctx.if_flag(full, 1, lambda: last_two(False), complement=True)
    sets = None

