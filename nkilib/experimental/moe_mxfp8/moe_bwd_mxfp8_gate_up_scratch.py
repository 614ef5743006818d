"""W_gu quantized to MXFP8 a segment ahead of pass B, through HBM (MoE expert backward, moe_bwd_mxfp8_kernel.py).

Pass B (dX = d_gate_up_b W_gu[e], K = 2I) holds W_gu[e] resident, quantized along 2I. Without this module each core
loads its H columns of W_gu[e] in bf16 through pass C's ring at B(e)'s start and quantizes them there (quantize_mx on
VectorE), and B's first matmuls wait for that load -> quantize chain (GPT-OSS-20B 6 x 2048: ~140 us of TensorE idle
per core over the run; docs/moe.md section 10, rounds 30c, 32a and 34a).

Here each core quantizes its own H columns of W_gu[e] (all of 2I's K tiles) one pipeline segment before B(e), while
VectorE and the DMA queues have room (pass B holds no VectorE work of its own), and stores the x4 words and scales
in the matmul layer's panel layout (panels.store_k_tile) in a per-expert HBM scratch; B(e) loads them with long runs
and no quantize_mx (TensorDescriptor(panel_layout=True), ExpertPanels), half of the bf16 bytes. The words are
quantize_mx's for the same K tile and the same columns either way (load_panel quantizes each K tile on its own), so
the bits do not change. Race-free: pass B splits H between the cores (each core reads only the columns it wrote,
on the same core, in program order: a RAW through HBM), and the columns of the two cores are disjoint.

Dimensions:
    W_gu[e] [2I, H] bf16 (rows e*2I.. of the stacked [E*2I, H]); scratch per expert: words [Kt/4 * 4, H] x4 and
    scales [128 * scale tiles, H] uint8 (panels.panel_layout_hbm), Kt = 2I in whole 512-row K tiles.
"""
from __future__ import annotations

import nki.language as nl

from ...core.kernel_helpers import kernel_assert
from ...core.matmul import PanelPlacement, TensorDescriptor, k_tiles, load_panel, panel_layout_hbm, store_k_tile
from ...core.matmul.panels import LoadRing
from ...core.matmul.sources import blocks as _blocks
from .constants import (GATE_UP_SCRATCH, GATE_UP_SCRATCH_SLOTS, PARTITIONS, RING_WEIGHT_DMA_PER_SLOT,
                        WIDE_WEIGHT_LOAD_WIDTH,
                        WIDE_WEIGHT_STAGING_BUFFERS)

__all__ = ["GateUpWeightScratch", "quantize_to_panel_layout"]


def quantize_to_panel_layout(op, words, scales, t_lo, t_hi, f_lo, f_hi, setup, ring=None, slots=None):
    """K tiles [t_lo, t_hi) and columns [f_lo, f_hi) of the bf16 [K, F] operand `op`, loaded in column pieces through
    one staging ring, quantized (quantize_mx along K) and stored to the panel-layout HBM tensors `words` / `scales`
    (panel_layout_hbm) at the same K tiles and columns.

    Args:
        ring: the staging LoadRing (pieces of at most its tiles' width); None: a fresh ring of
            WIDE_WEIGHT_STAGING_BUFFERS tiles, pieces of WIDE_WEIGHT_LOAD_WIDTH columns.
        slots: [(words [128, 1, W] x4, scales [128, 1, W] uint8)] SBUF tiles allocated by the caller (W >= a piece),
            which the pieces' quantized words take in turn; None: one fresh allocation per piece.
    """
    width, slot_dmas = WIDE_WEIGHT_LOAD_WIDTH, 1 if ring != None and RING_WEIGHT_DMA_PER_SLOT else 0  # noqa: E711
    if ring == None:  # noqa: E711
        ring = LoadRing(WIDE_WEIGHT_STAGING_BUFFERS)
    elif ring.tiles:
        width = ring.tiles[0].shape[2]
    if slots != None:  # noqa: E711
        width = min(width, slots[0][0].shape[2])
    n = 0
    for t in range(t_lo, t_hi):
        for f0, fsz in _blocks(f_lo, f_hi, width):
            placement = PanelPlacement.per_k_tile()
            if slots != None:  # noqa: E711
                w, sc = slots[n % len(slots)]
                placement = PanelPlacement.into(w[:, :, :fsz], sc[:, :, :fsz])
            n += 1
            # one K tile at a time: its words die at their store instead of a whole panel staying live
            panel = load_panel(op, f0, fsz, fsz, setup, t_lo=t, t_hi=t + 1, ring=ring, placement=placement,
                               slot_dma_k_tiles=slot_dmas)
            store_k_tile(panel.data[0], panel.scales[0], words, scales, t, setup, f0=f0)
            panel = None


class GateUpWeightScratch(nl.NKIObject):
    """Per-expert HBM scratch of W_gu quantized along 2I in the panel layout, each core writing its H columns.

    Dimensions: as the module docstring; `experts` are the experts whose pass B reads the scratch (static), [h_lo,
    h_hi) this core's columns of pass B.
    """

    def __init__(self, ctx, experts, h_lo, h_hi):
        self.ctx = ctx
        self.experts = list(experts)
        self.h_lo, self.h_hi = h_lo, h_hi
        kernel_assert(ctx.setup.is_mx, f"GateUpWeightScratch stores MXFP8 words, got precision {ctx.setup.precision}")
        self.words = [None] * ctx.E
        self.scales = [None] * ctx.E
        for e in self.experts:
            self.words[e], self.scales[e] = panel_layout_hbm(2 * ctx.I, ctx.H, ctx.setup, f"moe_bwd_gate_up_mx_{e}")

    @staticmethod
    def applies(ctx, w_gu_resident, interleave, i_split) -> bool:
        """Used with MXFP8 where pass B holds W_gu resident in one group of its H tiles and runs after the segment's
        pass A (not the interleave, which loads B's panels beside A's; not the I split, whose pass B loads W_gu per
        block), when GATE_UP_SCRATCH is on."""
        return GATE_UP_SCRATCH and ctx.setup.is_mx and w_gu_resident and not interleave and i_split == None  # noqa: E711

    @staticmethod
    def of(ctx, groups, h_lo, h_hi, w_gu_resident, interleave, i_split):
        """The scratch for the fence groups `groups` (lists of experts) or None: every expert after the first group
        (the first group's B runs right after the first fence, with no segment before it to quantize in)."""
        if len(groups) < 2 or not GateUpWeightScratch.applies(ctx, w_gu_resident, interleave, i_split):
            return None
        return GateUpWeightScratch(ctx, [e for g in groups[1:] for e in g], h_lo, h_hi)

    def holds(self, e) -> bool:
        return e in self.experts

    def reserve(self):
        """SBUF for one quantize (the staging ring and GATE_UP_SCRATCH_SLOTS word / scale tiles), allocated now, before
        the pass B that precedes the quantize in program order, and kept by the caller until after it: so that
        neither B's tiles are placed over the quantize's (B would wait for it) nor the quantize's over B's (it would
        wait for B's end). The staging ring is pass C's kernel-scope one when there is one (no extra SBUF)."""
        ctx = self.ctx
        width = WIDE_WEIGHT_LOAD_WIDTH if ctx.stages == None else ctx.stages[0].shape[2]  # noqa: E711
        ring = (LoadRing(WIDE_WEIGHT_STAGING_BUFFERS) if ctx.stages == None  # noqa: E711
                else LoadRing(len(ctx.stages), ctx.stages))
        cols = min(width, self.h_hi - self.h_lo)
        slots = [(nl.ndarray((PARTITIONS, 1, cols), dtype=ctx.setup.x4_dtype, buffer=nl.sbuf),
                  nl.ndarray((PARTITIONS, 1, cols), dtype=nl.uint8, buffer=nl.sbuf))
                 for _ in range(GATE_UP_SCRATCH_SLOTS)]
        return ring, slots

    def quantize(self, e, reserved=None):
        """This core's columns of W_gu[e], every K tile of 2I, quantized and stored to the scratch. Must precede
        B(e) in this core's program order. reserved: reserve()'s tiles (None: fresh ones)."""
        ctx = self.ctx
        op = TensorDescriptor(ctx.gu_rows, k_axis=0, k_base=e * 2 * ctx.I, k_len=2 * ctx.I)
        n = len(k_tiles(2 * ctx.I, ctx.setup))
        ring, slots = (None, None) if reserved == None else reserved  # noqa: E711
        quantize_to_panel_layout(op, self.words[e], self.scales[e], 0, n, self.h_lo, self.h_hi, ctx.setup, ring,
                                 slots)

    def descriptor(self, e):
        """W_gu[e] as pass B's K = 2I operand read from the scratch (all K tiles; this core reads its columns)."""
        return TensorDescriptor(self.words[e], k_axis=0, scales=self.scales[e], panel_layout=True, k_len=2 * self.ctx.I)
