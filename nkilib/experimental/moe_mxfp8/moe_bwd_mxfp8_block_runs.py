"""An expert's block loops with its weight panels (moe_bwd_mxfp8_kernel.py's passes A and B): one run-time loop over
the expert's blocks with the weights resident across it where they fit, else per block for a one-block expert and per
resident group of the weights' tiles for one with more; only an expert's last block can hold padding, and it takes
the path its fill flag selects (docs/moe.md section 10, round 3)."""
from __future__ import annotations

import nki.language as nl

from ...core.kernel_helpers import kernel_assert
from .moe_bwd_mxfp8_dx import ExpertPanels

__all__ = ["ExpertBlockRuns"]


class ExpertBlockRuns(nl.NKIObject):
    """The block loops of a MoeContext's experts (ctx.loops: the run-time bounds, ctx.setup: the matmul setup).

    A `block` callable is block(i, panels, skip, full): block register i, the weights' panels (ExpertPanels, in the
    order of the descriptors given), how its padding-only rows are skipped (False: not) and whether every position of
    the block holds a routed pair (full).
    """

    def __init__(self, ctx):
        self.ctx = ctx

    def fits(self, ops, groups) -> bool:
        """Whether every operand descriptor of `ops` fits resident for every tile group of `groups`."""
        return all(ExpertPanels.fits(op, g, self.ctx.setup) for op in ops for g in groups)

    def panels_of(self, descs, tiles, ring=None):
        """ExpertPanels of each descriptor over `tiles` (None stays None: an operand the caller gave)."""
        return [None if d == None else ExpertPanels(d, tiles, self.ctx.setup, ring) for d in descs]  # noqa: E711

    def last_block(self, i, block, panels, skip):
        """block(i, panels, skip, full) for an expert's last block, by the flag of its final position: a full
        last block takes the unskipped path (contiguous row groups) with full=True (no padding rows to zero);
        one holding padding takes `skip` (False where the weights are loaded per block) with full=False."""
        ctx = self.ctx
        full = ctx.row_flags(i, ctx.B - 1, 2)  # positions 0 and B - 1
        ctx.if_flag(full, 1, lambda: block(i, panels, False, True))
        if not skip:
            ctx.if_flag(full, 1, lambda: block(i, panels, False, False), complement=True)
            return
        ctx.if_flag(full, 1, lambda: block(i, panels, skip, False), complement=True)

    def block_loops(self, e, b_lo, b_hi, block, panels, skip):
        """block(i, panels, skip, full) over expert e's blocks [b_lo, b_hi); only the last one can hold padding (the
        blocks before it are full: every position holds a routed pair)."""
        last = self.ctx.loops.last_block(e)
        nl.fori_loop(b_lo, last, lambda i: block(i, panels, False, True))
        nl.fori_loop(last, b_hi, lambda i: self.last_block(i, block, panels, skip))

    def per_block(self, e, descs, tiles, groups, block, skip, single=None, ring=None, loaded=None):
        """The block loop(s) of expert e: one loop with the weights resident across it when they fit (`groups` None),
        else per block for an expert with one block (`single` instead of `block` when given) and, for one with more,
        one loop per resident group of the weights' tiles (loaded before it: once per expert; the block's rows are
        read again per group). skip = (whole, groups): how the last block's padding-only rows are skipped with those
        panels (False: not), decided on core 0's share (both cores: identical trip counts). ring: the resident
        weights' staging tiles (ExpertPanels); loaded: the resident panels, loaded ahead (only with `groups` None)."""
        loops = self.ctx.loops
        b_lo, _, b_hi = loops.bounds(e)
        kernel_assert(loaded == None or groups == None, f"expert {e}: loaded panels, groups {groups}")  # noqa: E711
        if groups == None:  # noqa: E711
            self.block_loops(e, b_lo, b_hi, block, loaded or self.panels_of(descs, tiles, ring), skip[0])
            return
        loops.if_single(e, lambda i: self.last_block(i, single or block, self.panels_of(descs, tiles), skip[0]))

        def per_group():
            for g in groups:
                self.block_loops(e, b_lo, b_hi, block, self.panels_of(descs, g), skip[1])

        loops.if_multi(e, per_group)
