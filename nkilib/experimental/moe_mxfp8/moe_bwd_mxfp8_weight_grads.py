"""Pass C of the MoE expert backward kernel (moe_bwd_mxfp8_kernel.py): the per-expert weight gradients
dW_gu[e] = sum_b d_gate_up_bᵀ X_b and dW_down[e] = sum_b dY_bᵀ hs_b, K = the tokens of the expert's blocks
(both operands MX-quantized along tokens), from the block-ordered scratch rows pass A wrote.

Two paths, chosen per expert at run time by 0/1-trip loops (ExpertLoops in the kernel module):
    single block: both operands loaded and quantized once, every output tile one matmul;
    two or more blocks: groups of WEIGHT_GRAD_PSUM_TILES output tiles accumulate in PSUM across the
    block loop (first block overwrites, later blocks add), each group re-reading the blocks' rows;
and an expert without blocks stores zeros. Numerics and the LNC2 split: docs/moe.md, sections 3-5.
"""
from __future__ import annotations

import nki.isa as nisa
import nki.language as nl

from ...core.matmul import CoreSplit, matmul_panels, panel_columns, panel_from_row_loader
from ...core.matmul.panels import blocks
from .constants import MOE_N_TILE, PARTITIONS, SINGLE_BLOCK_LOAD_WIDTH, WEIGHT_GRAD_PSUM_TILES

__all__ = ["BlockRowSource", "compute_phase3_expert_weight_grads_mxfp8", "compute_phase3_single_block_grads_mxfp8",
           "store_zero_expert_grads"]


class BlockRowSource(nl.NKIObject):
    """A K = tokens operand of block i: rows of a [N, B, F] block-ordered scratch written by pass A.
    rows(i, f0, f_size) -> a load_rows callable for panel_from_row_loader (plain DMAs, no gather)."""

    def __init__(self, ctx, scratch):
        self.ctx, self.scratch = ctx, scratch

    def rows(self, i, f0, f_size):
        ctx, scratch = self.ctx, self.scratch

        def load_rows(dst, first, step, count):
            nisa.dma_copy(dst=dst, src=ctx.block_rows(scratch, i, first, count, step, f0, f_size))

        return load_rows


def _tile_groups(ctx, m_total, n_total):
    """This core's output tiles of an [M, N] weight gradient in groups of at most WEIGHT_GRAD_PSUM_TILES
    (their fp32 accumulators stay in PSUM across the expert's block loop). A group is a run of m tiles
    under one n tile: its stationary rows are one wide load (long DMA runs), sliced per tile. Returns
    [(n block, [m blocks])]; the group count is core 0's (the larger share), so both cores run the same
    number of block loops (a core with fewer tiles runs empty groups)."""

    def groups_of(split):
        (m_lo, m_hi), (n_lo, n_hi) = split.ranges(m_total, n_total)
        m_blocks = blocks(m_lo, m_hi, PARTITIONS)
        return [(nb, m_blocks[g:g + WEIGHT_GRAD_PSUM_TILES]) for nb in blocks(n_lo, n_hi, MOE_N_TILE)
                for g in range(0, len(m_blocks), WEIGHT_GRAD_PSUM_TILES)]

    mine = groups_of(ctx.split)
    count = len(groups_of(CoreSplit(ctx.split.num_cores, 0)))
    return mine + [((0, 0), [])] * (count - len(mine))


def compute_phase3_expert_weight_grads_mxfp8(ctx, e, out, lhs, rhs, m_total, n_total, wg_dtype):
    """out[e] [M, N] = wg(sum over expert e's blocks b of lhs_bᵀ [M, B] @ rhs_b [B, N]) (K = B tokens).

    Dimensions:
        lhs, rhs: BlockRowSource of F = M and F = N; out: [E, M, N] in wg_dtype (shared HBM).
        dW_gu: lhs = d_gate_up (F=2I), rhs = X (F=H); dW_down: lhs = dY (F=H), rhs = hs (F=I); all four
        block-ordered scratch rows written by pass A (padding rows zero).
    Runs inside the expert's "two or more blocks" loop (ExpertLoops.if_multi). Per group of output tiles, the fp32
    accumulators stay in PSUM across the block loop: the first block's matmul overwrites (a peeled loop
    of 0 or 1 trip, [lo, first)), every later block's adds ([first, hi)); each block's K tiles (MXFP8: the
    whole block, B <= 512; BF16: 128 rows) add in order, so acc = fp32(acc + mm(tile)) as the reference.
    The eviction adds +0.0 (fp32): the reference's sum starts from +0, so a first product of -0 must
    leave +0 (x + 0.0 == x otherwise).
    """
    setup, B = ctx.setup, ctx.B
    lo, first, hi = ctx.loops.bounds(e)
    for g, ((n0, nsz), m_blocks) in enumerate(_tile_groups(ctx, m_total, n_total)):
        accs = [nl.ndarray((PARTITIONS, MOE_N_TILE), dtype=nl.float32, buffer=nl.psum) for _ in m_blocks]

        def body(i, accumulate, n0=n0, nsz=nsz, m_blocks=m_blocks, accs=accs):
            if not m_blocks:
                return
            m_lo, m_hi = m_blocks[0][0], m_blocks[-1][0] + m_blocks[-1][1]
            wide = panel_from_row_loader(lhs.rows(i, m_lo, m_hi - m_lo), B, m_hi - m_lo, m_hi - m_lo, setup,
                                         stages=ctx.stages)
            b = panel_from_row_loader(rhs.rows(i, n0, nsz), B, nsz, nsz, setup, stages=ctx.stages)
            for (m0, msz), acc in zip(m_blocks, accs):
                a = panel_columns(wide, m0 - m_lo, ctx.f_pad(msz))
                # K=the block's B tokens (one MX K tile; BF16: B/128 tiles), M=msz, N=nsz
                matmul_panels(acc[:a.f_pad, :nsz], a, b, setup, accumulate=accumulate)

        nl.fori_loop(lo, first, lambda i, body=body: body(i, False))
        nl.fori_loop(first, hi, lambda i, body=body: body(i, True))
        for j, ((m0, msz), acc) in enumerate(zip(m_blocks, accs)):
            res = nl.ndarray((PARTITIONS, MOE_N_TILE), dtype=wg_dtype, buffer=nl.sbuf)
            engine = nisa.engine.scalar if (g + j) % 2 == 0 else nisa.engine.vector
            nisa.tensor_scalar(dst=res[:msz, :nsz], data=acc[:msz, :nsz], op0=nl.add, operand0=0.0, engine=engine)
            nisa.dma_copy(dst=out[e, m0:m0 + msz, n0:n0 + nsz], src=res[:msz, :nsz])
        accs = acc = body = None  # drop the group's PSUM before the next group allocates its own


def _row_panels(ctx, src, i, lo, hi):
    """[(c0, Panel)]: columns [lo, hi) of block i's rows of `src` (a BlockRowSource), loaded and quantized
    once in pieces of up to SINGLE_BLOCK_LOAD_WIDTH columns (long DMA runs), staged through ctx.stages."""
    return [(c0, panel_from_row_loader(src.rows(i, c0, csz), ctx.B, csz, csz, ctx.setup, stages=ctx.stages))
            for c0, csz in blocks(lo, hi, SINGLE_BLOCK_LOAD_WIDTH)]


def _columns(pieces, f0, width):
    """Columns [f0, f0 + width) of the pieces of _row_panels (a tile never straddles two pieces)."""
    for c0, panel in pieces:
        if c0 <= f0 < c0 + panel.f_pad:
            return panel_columns(panel, f0 - c0, width)
    return None


def compute_phase3_single_block_grads_mxfp8(ctx, e, i, out, lhs, rhs, m_total, n_total, wg_dtype):
    """out[e] = wg(lhs_iᵀ @ rhs_i) for an expert whose only block is i (ExpertLoops.if_single): both
    operands of this core's tiles are loaded and quantized once (the moving one whole, the stationary one
    piece by piece in an m-major sweep), then every output tile is one matmul
    (K = the block), evicted with +0.0 (the reference's sum from +0) and stored -- no re-read of the
    block per tile group (compute_phase3_expert_weight_grads_mxfp8's price for accumulating in PSUM).

    Dimensions: as compute_phase3_expert_weight_grads_mxfp8.
    """
    (m_lo, m_hi), (n_lo, n_hi) = ctx.split.ranges(m_total, n_total)
    if m_lo >= m_hi or n_lo >= n_hi:
        return
    b_pieces = _row_panels(ctx, rhs, i, n_lo, n_hi)
    t = 0
    a_pieces = []
    for m0, msz in blocks(m_lo, m_hi, PARTITIONS):
        if _columns(a_pieces, m0, ctx.f_pad(msz)) == None:  # noqa: E711
            # the next piece of stationary columns; the previous one is dropped (m-major sweep)
            a_pieces = None
            a_pieces = _row_panels(ctx, lhs, i, m0, min(m_hi, m0 + SINGLE_BLOCK_LOAD_WIDTH))
        a = _columns(a_pieces, m0, ctx.f_pad(msz))
        for n0, nsz in blocks(n_lo, n_hi, MOE_N_TILE):
            acc = nl.ndarray((PARTITIONS, MOE_N_TILE), dtype=nl.float32, buffer=nl.psum)
            # K=the block's B tokens (one MX K tile; BF16: B/128 tiles), M=msz, N=nsz
            matmul_panels(acc[:a.f_pad, :nsz], a, _columns(b_pieces, n0, nsz), ctx.setup)
            res = nl.ndarray((PARTITIONS, MOE_N_TILE), dtype=wg_dtype, buffer=nl.sbuf)
            engine = nisa.engine.scalar if t % 2 == 0 else nisa.engine.vector
            nisa.tensor_scalar(dst=res[:msz, :nsz], data=acc[:msz, :nsz], op0=nl.add, operand0=0.0, engine=engine)
            nisa.dma_copy(dst=out[e, m0:m0 + msz, n0:n0 + nsz], src=res[:msz, :nsz])
            t += 1
            acc = res = None


def store_zero_expert_grads(ctx, e, zeros):
    """Expert e has no blocks (runs inside ExpertLoops.if_unused): its weight gradients are +0 (the
    reference's empty sum), stored from the zeroed SBUF tile `zeros` [128, MOE_N_TILE] (this core's tiles)."""
    for out, m_total, n_total in ((ctx.d_gate_up_weight, 2 * ctx.I, ctx.H), (ctx.d_down_weight, ctx.H, ctx.I)):
        for (n0, nsz), m_blocks in _tile_groups(ctx, m_total, n_total):
            for m0, msz in m_blocks:
                nisa.dma_copy(dst=out[e, m0:m0 + msz, n0:n0 + nsz], src=zeros[:msz, :nsz])
