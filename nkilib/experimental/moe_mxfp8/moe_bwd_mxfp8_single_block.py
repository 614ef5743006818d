"""Pass C of the MoE expert backward kernel for an expert of one block (ExpertLoops.if_single): both operands of this
core's output tiles loaded and quantized once (K = the block's filled 128-row units, one traced variant per count),
every output tile one matmul. The paths of larger experts are moe_bwd_mxfp8_weight_grads.py's; numerics and the LNC2
split: docs/moe.md, sections 3-5.
"""
from __future__ import annotations

import nki.isa as nisa
import nki.language as nl

from ...core.matmul import matmul_panels, panel_columns, panel_from_row_loader
from ...core.matmul.sources import blocks
from .constants import MOE_N_TILE, PARTITIONS, PASS_C_ROW_UNIT, SINGLE_BLOCK_LOAD_WIDTH
from .moe_bwd_mxfp8_pass_c_stores import RowStore
from .moe_bwd_mxfp8_weight_grads import single_load_stage

__all__ = ["compute_phase3_single_block_expert_mxfp8", "compute_phase3_single_block_grads_mxfp8", "filled_row_units"]


def filled_row_units(ctx) -> int:
    """Units of PASS_C_ROW_UNIT rows in a block whose padding-only ones pass C may leave out of K (1: none may): with
    the 1x32 MX scheme a K tile's MX groups are 32 consecutive rows, so a K of the filled units' rows groups them as
    the block's K does; wrapX's groups stride the whole K tile (rows p + 128 j), BF16 has no groups to keep but its K
    tiles are 128 rows already."""
    mx_1x32 = ctx.setup.is_mx and ctx.setup.scheme == "1x32" and ctx.B % PASS_C_ROW_UNIT == 0
    return ctx.B // PASS_C_ROW_UNIT if mx_1x32 else 1


def _row_panels(ctx, src, i, lo, hi, first=-1, rows=None):
    """[(c0, Panel)]: columns [lo, hi) of block i's rows of `src` (a BlockRowSource), loaded and quantized
    once in pieces of up to SINGLE_BLOCK_LOAD_WIDTH columns (long DMA runs), staged through ctx.stages: all
    pieces through ctx.stages' rotation per K tile (one K tile each: stages[0]), or, with first >= 0, piece q
    through the staging tile of load number first + q (single_load_stage). rows: the block's leading rows to read
    (K of the panels; default all B)."""
    pieces = blocks(lo, hi, SINGLE_BLOCK_LOAD_WIDTH)
    k_rows = ctx.B if rows == None else rows  # noqa: E711
    return [(c0, panel_from_row_loader(src.rows(i, c0, csz), k_rows, csz, csz, ctx.setup,
                                       stages=ctx.stages if first < 0 else single_load_stage(ctx, first + q),
                                       load_tile=src.tile(i, c0, csz)))
            for q, (c0, csz) in enumerate(pieces)]


def _columns(pieces, f0, width):
    """Columns [f0, f0 + width) of the pieces of _row_panels (a tile never straddles two pieces)."""
    for c0, panel in pieces:
        if c0 <= f0 < c0 + panel.f_pad:
            return panel_columns(panel, f0 - c0, width)
    return None


def compute_phase3_single_block_grads_mxfp8(ctx, e, i, out, lhs, rhs, m_total, n_total, wg_dtype, first=0,
                                            rows=None):
    """out[e] = wg(lhs_iᵀ @ rhs_i) for an expert whose only block is i (ExpertLoops.if_single): both
    operands of this core's tiles are loaded and quantized once (the moving one whole, the stationary one
    piece by piece in an m-major sweep), then every output tile is one matmul
    (K = the block), evicted with +0.0 (the reference's sum from +0) and stored -- no re-read of the
    block per tile group (compute_phase3_expert_weight_grads_mxfp8's price for accumulating in PSUM).

    Dimensions: as compute_phase3_expert_weight_grads_mxfp8.
    first: number of the first load (single_load_stage), the loads of the expert's gradients before this one.
    rows: the block's leading rows that hold its routed pairs, a multiple of PASS_C_ROW_UNIT (default B; the rows
    after them are padding, zero in all four operands): K = rows, so padding-only row units are neither loaded,
    quantized nor multiplied (compute_phase3_single_block_expert_mxfp8). Bit-exact: the MX groups of 32 rows are the
    reference's (rows is a multiple of 32, the 1x32 scheme's groups are consecutive rows), a zero row adds an
    exact zero to the K tile's exact sum, and the eviction's +0.0 takes the one difference, the sign of an
    all-zero sum, to the reference's +0.

    Returns:
        first plus this gradient's loads (the next gradient's first).
    """
    (m_lo, m_hi), (n_lo, n_hi) = ctx.split.ranges(m_total, n_total)
    if m_lo >= m_hi or n_lo >= n_hi:
        return first
    b_pieces = _row_panels(ctx, rhs, i, n_lo, n_hi, first=first, rows=rows)
    loads = first + len(b_pieces)  # loads so far (static: the same numbering in the traced body on hardware)
    t = 0
    a_pieces = []
    for m0, msz in blocks(m_lo, m_hi, PARTITIONS):
        if _columns(a_pieces, m0, ctx.f_pad(msz)) == None:  # noqa: E711
            # the next piece of stationary columns; the previous one is dropped (m-major sweep)
            a_pieces = None
            a_pieces = _row_panels(ctx, lhs, i, m0, min(m_hi, m0 + SINGLE_BLOCK_LOAD_WIDTH), first=loads, rows=rows)
            loads += len(a_pieces)
        a = _columns(a_pieces, m0, ctx.f_pad(msz))
        row = RowStore(out, e, m0, msz, n_lo, n_hi, wg_dtype)
        for n0, nsz in blocks(n_lo, n_hi, MOE_N_TILE):
            acc = nl.ndarray((PARTITIONS, MOE_N_TILE), dtype=nl.float32, buffer=nl.psum)
            # K=the block's B tokens, or its `rows` filled ones (one MX K tile; BF16: B/128 tiles), M=msz, N=nsz
            matmul_panels(acc[:a.f_pad, :nsz], a, _columns(b_pieces, n0, nsz), ctx.setup)
            row.tile(acc, n0, nsz, t)
            t += 1
            acc = None
    return loads


def compute_phase3_single_block_expert_mxfp8(ctx, e, i, grads, wg_dtype, first=0):
    """Both weight gradients of an expert whose only block is i (ExpertLoops.if_single), K = the block's filled rows:
    with the 1x32 MX scheme one traced variant of compute_phase3_single_block_grads_mxfp8 per count u of filled
    PASS_C_ROW_UNIT-row units (rows = u x unit), each in a 0/1-trip loop on MoeContext.filled_units' flag u - 1, so a
    part-filled block's padding-only units are neither loaded, quantized nor multiplied; where filled_row_units is 1
    (BF16, wrapX, B of one unit) K = B.

    Dimensions:
        grads: [(out, lhs, rhs, M, N)]: dW_gu (d_gate_up, X) and dW_down (dY, hs) (the kernel's pass C).
    first: number of the first load (single_load_stage); every variant starts from it (one of them runs).

    Returns:
        first plus the expert's loads (the same count in every variant: the pieces do not depend on rows).
    """
    unit, units = PASS_C_ROW_UNIT, filled_row_units(ctx)

    def both(rows):
        loads = first
        for out, lhs, rhs, m_total, n_total in grads:
            loads = compute_phase3_single_block_grads_mxfp8(ctx, e, i, out, lhs, rhs, m_total, n_total, wg_dtype,
                                                            first=loads, rows=rows)
        return loads

    if units == 1:
        return both(None)
    exact = ctx.filled_units(i, unit, units)
    loads = [first]
    for u in range(1, units + 1):
        reg = nisa.register_alloc()
        nisa.register_load(reg, exact[0:1, u - 1:u])

        def body(_, u=u):
            loads[0] = both(u * unit)

        nl.fori_loop(0, reg, body)
    return loads[0]
