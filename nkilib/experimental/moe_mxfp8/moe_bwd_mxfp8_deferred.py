"""Pass A's deferred transfers (moe_bwd_mxfp8_kernel.py): work the pass A pipeline
(moe_bwd_mxfp8_d_gate_up.compute_phase1_pipelined_mxfp8) leaves to another point of the segment schedule, where the
engines it needs have room: the routing-weight gradients scattered by slot after the fence (scatter_deferred_d_w), X's
block-ordered copy for pass C gathered at the segment's end (gather_deferred_x; round 8c; an expert's blocks before its
last two right after its pass A: gather_expert_x, round 39b), and dY's block-ordered copy made a fence ahead
(gather_deferred_rows with ctx.staged_dy; round 31a). docs/moe.md, sections 5 and 10.
"""
from __future__ import annotations

import nki.isa as nisa
import nki.language as nl

from ...core.kernel_helpers import kernel_assert
from .constants import X_BLOCKS_HEAD_AFTER_A, ZERO_PADDING_UNIT

__all__ = ["gather_deferred_rows", "gather_deferred_x", "gather_expert_x", "scatter_deferred_d_w"]


def scatter_deferred_d_w(ctx, b_lo, b_hi):
    """d_topk_weights of blocks [b_lo, b_hi) (registers) from ctx.d_w_partial, where the pipeline left them: this
    core's chunks (ctx.unit_rows), scattered by slot (padding slots skipped); a chunk whose unit starts with padding
    was not computed (its rows were never written) and is skipped by the same flag as in the pipeline."""
    rows = ctx.unit_rows

    def chunk(i, r0, m):
        slots = ctx.positions(ctx.slots2d, i, r0, 1, m)
        d_w = nl.ndarray((m, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=d_w, src=ctx.block_rows(ctx.d_w_partial, i, r0, m, 1, 0, 1))
        ctx.store_pair_grads(d_w, i, r0, m, slots)

    def block(i):
        flags = ctx.row_flags(i, ctx.row_unit, len(rows))
        for q, (r0, m) in enumerate(rows):
            if q == 0:  # a block's first position holds a routed pair
                chunk(i, r0, m)
                continue
            ctx.if_flag(flags, q, lambda r0=r0, m=m: chunk(i, r0, m))

    nl.fori_loop(b_lo, b_hi, block)


def gather_deferred_x(ctx, b_lo, last, b_hi):
    """x_blocks rows of blocks [b_lo, b_hi) (registers; last: the expert's last block) for this core's chunks, gathered
    by token id, where the pipeline does not gather X (ctx.defer_x: gate_pre and up given, so X serves only pass C).
    Padding rows are zero; a unit starting with padding is left to the pipeline's zero rows (_zero_rows).

    Dimensions: X [T, H] -> x_blocks [N, B, H] bf16, one [128, H] tile per chunk."""
    gather_deferred_rows(ctx, ctx.x, ctx.x_blocks, b_lo, last, b_hi)


def gather_expert_x(ctx, e, part="all"):
    """gather_deferred_x of expert e's blocks, in its if_used: part "all", or "head" (its blocks before the last two,
    all full: issued right after its pass A, X_BLOCKS_HEAD_AFTER_A) and "tail" (the last two, at the segment's end).
    With X_BLOCKS_HEAD_AFTER_A off, "head" gathers nothing and "tail" all of them. An expert of at most two blocks has
    an empty head (before_last_block is its first block)."""
    part = part if X_BLOCKS_HEAD_AFTER_A else {"head": None, "tail": "all"}.get(part, part)

    def gather():
        lo, _, hi = ctx.loops.bounds(e)
        if part == "all":
            gather_deferred_x(ctx, lo, ctx.loops.last_block(e), hi)
            return
        mid = ctx.loops.before_last_block(e)  # [lo, mid): the head; [mid, last): the tail's full block, if any
        gather_deferred_x(ctx, *((lo, mid, mid) if part == "head" else (mid, ctx.loops.last_block(e), hi)))

    if part != None:  # noqa: E711
        ctx.loops.if_used(e, gather)


def gather_deferred_rows(ctx, src, dst, b_lo, last, b_hi):
    """dst's rows of blocks [b_lo, b_hi) (registers; last: the expert's last block) <- src's rows by token id, this
    core's chunks (ctx.unit_rows), each HBM -> HBM; one with padding after stores of zeros over its padding units'
    rows (ZERO_PADDING_UNIT rows each, from the zeroed tile ctx.zeros: no engine zeroing, no SBUF round trip; round
    38c; only the units that hold padding, round 41d), which its skipped sentinels keep.
    A chunk whose unit starts with padding is left to the pipeline's zero_padding_rows: the staged dY (ctx.staged_dy)
    too, whose copy the pipeline loads for every chunk but computes on only where the unit holds a pair (round 41c:
    the zeros stored here before were stored again there, or, for a one-block expert, read by nothing).

    Dimensions: src [T, H] -> dst [N, B, H] bf16, one [128, H] tile per chunk."""
    rows, H = ctx.unit_rows, src.shape[1]

    def chunk(i, q, r0, m, padding):
        ids = ctx.positions(ctx.ids2d, i, r0, 1, m)
        if padding != None:  # noqa: E711  (zeros first, kept where the gather skips their sentinels: round 38c)
            zero_padding_units(ctx, dst, i, q, r0, m, padding)
        # HBM -> HBM, the bytes through the DMA queues once (round 8c); a chunk with padding after its zero rows (WAW
        # on the same rows: no engine zeroing, no SBUF round trip, round 38c)
        ctx.gather_to_blocks(dst, i, r0, m, src, ids)

    def block(i, full):
        flags = None if full else ctx.row_flags(i, ctx.row_unit, len(rows))
        padding = None if full else padding_unit_flags(ctx, i)
        for q, (r0, m) in enumerate(rows):
            if full or q == 0:
                chunk(i, q, r0, m, padding)
                continue
            ctx.if_flag(flags, q, lambda q=q, r0=r0, m=m: chunk(i, q, r0, m, padding))

    def last_block(i):  # full when its final position holds a routed pair: then HBM -> HBM like the blocks before
        flag = ctx.row_flags(i, ctx.B - 1, 2)  # positions 0 and B - 1
        ctx.if_flag(flag, 1, lambda: block(i, True))
        ctx.if_flag(flag, 1, lambda: block(i, False), complement=True)

    nl.fori_loop(b_lo, last, lambda i: block(i, True))
    nl.fori_loop(last, b_hi, last_block)


def padding_unit_flags(ctx, i):
    """SBUF [B / ZERO_PADDING_UNIT, 1] int32: 1 where block i's unit j (rows ZERO_PADDING_UNIT * j ..) holds padding,
    i.e. its last position does (a block's padding is its tail), else 0. max(id - (T - 1), 0): ids are at most the
    sentinel T; integers < 2^24, exact in VectorE's fp32 arithmetic. The same on both cores (the same positions)."""
    unit = ZERO_PADDING_UNIT
    kernel_assert(ctx.B % unit == 0, f"block size B={ctx.B} must be a multiple of {unit} rows")
    flags = ctx.positions(ctx.ids2d, i, unit - 1, unit, ctx.B // unit)
    nisa.tensor_scalar(dst=flags, data=flags, op0=nl.add, operand0=float(1 - ctx.T), op1=nl.maximum, operand1=0.0)
    return flags


def zero_padding_units(ctx, dst, i, q, r0, m, padding):
    """Zeros over the rows of this core's chunk r0..r0+m of block i (in row unit q, ctx.row_unit rows) that lie in
    a ZERO_PADDING_UNIT-row unit holding padding (padding_unit_flags), one 0/1-trip loop per unit of row unit q on
    both cores (a unit of the other core's chunk: an empty loop, so the trip counts stay the same on both cores)."""
    unit, u0 = ZERO_PADDING_UNIT, q * ctx.row_unit
    kernel_assert(r0 % unit == 0 and m % unit == 0 and u0 <= r0 and r0 + m <= u0 + ctx.row_unit,
                  f"chunk rows [{r0}, {r0 + m}) must be whole {unit}-row units of row unit [{u0}, {u0 + ctx.row_unit})")
    for j in range(u0 // unit, min(u0 + ctx.row_unit, ctx.B) // unit):
        mine = r0 <= j * unit < r0 + m
        ctx.if_flag(padding, j, (lambda j=j: ctx.zero_block_rows(dst, i, j * unit, unit, 0, dst.shape[2])) if mine
                    else (lambda: None))
