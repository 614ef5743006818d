"""Optional gate_up bias gradient of the MoE expert backward kernel (moe_bwd_mxfp8_kernel.py, gate_up_bias_grad=True):
d_gate_up_bias[e] [2I] = sum over expert e's block rows of d_gate_up (GateUpBiasGrad), BF16 matmuls of the bf16 rows
with a ones column on TensorE accumulated in PSUM, run in pass C beside the weight gradients
(moe_bwd_mxfp8_weight_grads.py). Numerics: docs/moe.md section 6.
"""
from __future__ import annotations

import nki.isa as nisa
import nki.language as nl

from ...core.kernel_helpers import ceil_div, shard_range
from ...core.matmul.sources import blocks
from .constants import BIAS_GRAD_K_TILE, MOE_N_TILE, SPLIT_ALIGN, WEIGHT_GRAD_PSUM_TILES

__all__ = ["GateUpBiasGrad"]


class GateUpBiasGrad(nl.NKIObject):
    """d_gate_up_bias [E, 2I] float32 (GPT-OSS's gate_up bias): per expert the sum of its d_gate_up rows.

    Numerics (reference.reference_bias_grad_fold, the contract): acc = +0 (fp32); for each of the expert's
    blocks in order, for each tile of BIAS_GRAD_K_TILE (128) rows of the block in order (padding rows are zero):
    acc = fp32(acc + fp32(sum of the tile's bf16 values per column)); stored as is (float32). An expert
    without blocks stores +0.

    Kernel: per tile one BF16 nc_matmul with the bf16 rows as the moving operand and a ones column as the
    stationary one (K = the tile's 128 tokens, M = 1, N <= MOE_N_TILE columns): the products are exact
    (x * 1) and the PE array's fp32 result is the tile's column sum rounded once (the simulator sums in
    float64: exact while a tile's values span fewer than 2^38, so independent of the order). The result
    lands in one PSUM row and the expert's tiles accumulate there across its blocks (first tile of the
    first block overwrites, the rest add, as pass C's weight gradients); the eviction adds +0.0 so that an
    all -0 sum leaves +0 like the reference's. TensorE rather than a VectorE/GpSimd reduction: the rows
    arrive with tokens on partitions (the scratch layout), and a partition-axis sum is what the PE array
    does in one pass; a VectorE free-axis reduction would need the rows transposed first (a DMA
    transpose or a PE transpose per tile, each costlier than this matmul). Not MXFP8: nc_matmul_mx would
    quantize d_gate_up.

    LNC2: each core sums its share of the 2I columns (SPLIT_ALIGN multiples) and stores only those; the
    group count is core 0's, so both cores run the same loops. Reads pass A's scratch (after the barrier).

    Dimensions:
        ctx.d_gu scratch [N, B, 2I] bf16 -> out [E, 2I] float32 (shared HBM).
    """

    def __init__(self, ctx, out):
        self.ctx, self.out = ctx, out
        two_i = 2 * ctx.I
        self.ones = nl.ndarray((BIAS_GRAD_K_TILE, 1), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.memset(dst=self.ones, value=1.0)

        def groups_of(shard_id):
            lo, hi = shard_range(ceil_div(two_i, SPLIT_ALIGN), ctx.split.num_cores, shard_id)
            tiles = blocks(min(lo * SPLIT_ALIGN, two_i), min(hi * SPLIT_ALIGN, two_i), MOE_N_TILE)
            return [tiles[g:g + WEIGHT_GRAD_PSUM_TILES] for g in range(0, len(tiles), WEIGHT_GRAD_PSUM_TILES)]

        mine = groups_of(ctx.split.shard_id)
        self.groups = mine + [[]] * (len(groups_of(0)) - len(mine))
        width = max([t[-1][0] + t[-1][1] - t[0][0] for t in mine] + [1])
        self.zeros = nl.ndarray((1, width), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=self.zeros, value=0.0)

    def expert(self, e):
        """Expert e's bias gradient: summed when it has blocks, +0 when it has none."""
        self.ctx.loops.if_used(e, lambda: self._sum(e))
        self.ctx.loops.if_unused(e, lambda: self._store_zeros(e))

    def _sum(self, e):
        ctx, out = self.ctx, self.out
        lo, first, hi = ctx.loops.bounds(e)
        for tiles in self.groups:
            accs = [nl.ndarray((1, MOE_N_TILE), dtype=nl.float32, buffer=nl.psum) for _ in tiles]

            def body(i, accumulate, tiles=tiles, accs=accs):
                if not tiles:
                    return
                g_lo, g_hi = tiles[0][0], tiles[-1][0] + tiles[-1][1]
                for r0, m in blocks(0, ctx.B, BIAS_GRAD_K_TILE):
                    rows = nl.ndarray((BIAS_GRAD_K_TILE, g_hi - g_lo), dtype=nl.bfloat16, buffer=nl.sbuf)
                    for c0, csz in ctx.row_pieces(ctx.d_gu, g_lo, g_hi - g_lo):  # one DMA unless slot-interleaved
                        nisa.dma_copy(dst=rows[:m, c0 - g_lo:c0 - g_lo + csz],
                                      src=ctx.block_rows(ctx.d_gu, i, r0, m, 1, c0, csz))
                    for (c0, csz), acc in zip(tiles, accs):
                        # K=m tokens of the block, M=1 (ones column), N=csz columns of d_gate_up (BF16)
                        nisa.nc_matmul(dst=acc[0:1, :csz], stationary=self.ones[:m, :],
                                       moving=rows[:m, c0 - g_lo:c0 - g_lo + csz], accumulate=accumulate or r0 > 0)
                    rows = None

            nl.fori_loop(lo, first, lambda i, body=body: body(i, False))
            nl.fori_loop(first, hi, lambda i, body=body: body(i, True))
            if tiles:
                g_lo, g_hi = tiles[0][0], tiles[-1][0] + tiles[-1][1]
                res = nl.ndarray((1, g_hi - g_lo), dtype=nl.float32, buffer=nl.sbuf)
                for (c0, csz), acc in zip(tiles, accs):
                    nisa.tensor_scalar(dst=res[0:1, c0 - g_lo:c0 - g_lo + csz], data=acc[0:1, :csz], op0=nl.add,
                                       operand0=0.0)
                nisa.dma_copy(dst=out[e:e + 1, g_lo:g_hi], src=res)
            accs = body = None  # drop the group's PSUM before the next group allocates its own

    def _store_zeros(self, e):
        for tiles in self.groups:
            if tiles:
                g_lo, g_hi = tiles[0][0], tiles[-1][0] + tiles[-1][1]
                nisa.dma_copy(dst=self.out[e:e + 1, g_lo:g_hi], src=self.zeros[0:1, :g_hi - g_lo])
