"""W_down quantized once per LNC2 core pair for pass A of the MoE expert backward (moe_bwd_mxfp8_kernel.py).

Pass A splits every block's rows between the two cores (docs/moe.md section 5), so each core needs all of
W_down[e] quantized along H (K = H of dI = dY_b W_down[e]). A W_down that does not stay resident (DeepSeek-V3's
[7168, 2048]: 112 KiB per partition quantized) was loaded and quantized by both cores: ~47 us of VectorE per core and
expert on quantize_mx (strided source, half rate), with VectorE on the critical path (docs/moe.md section 10, round 6c).

Here each core quantizes half of W_down[e]'s K tiles (whole I rows: 4 KiB DMA runs) one pipeline segment before
A(e) and stores the x4 words and scales in the matmul layer's panel layout (panels.store_k_tile) in a per-expert
HBM scratch; after the next core_barrier both cores load every K tile of it with long runs and no quantize_mx
(TensorDescriptor(panel_layout=True), ExpertPanels). The words are quantize_mx's for the same K tile either way, so
the bits do not change (LNC1 keeps quantizing on chip: one core gains nothing). Race-freedom: docs/moe.md section 5.

A resident W_down of the pipelined pass A up to RESIDENT_DOWN_EXCHANGE_MAX_BYTES (Qwen3-30B-A3B's) is exchanged for
each later fence group's experts after its first (docs/moe.md round 25b): the first A after a fence loads its W_down
before the fence (round 18a), but the second (A(a1)) loaded and quantized it at its start with TensorE idle, where
W_down and pass C's slots do not fit together earlier (rounds 19c, 20b). From the scratch A(a1) loads half the bytes
(x4 words) and quantizes nothing. H need not be whole K tiles there (e.g. H = 2880 ends with a 320-row one, stored
and loaded on its 96 partitions: panels.store_k_tile).

Dimensions:
    W_down[e] [H, I] bf16 (rows e*H.. of the stacked [E*H, I]); scratch per exchanged expert: words [Ht/4, I] x4,
    scales [128 * ceil(Ht/512/4), I] uint8 (panels.panel_layout_hbm), Ht = H in whole 512-row K tiles.
"""
from __future__ import annotations

import nki.language as nl

from ...core.kernel_helpers import kernel_assert, shard_range
from ...core.matmul import PanelPlacement, TensorDescriptor, k_tiles, load_panel, panel_layout_hbm, store_k_tile
from ...core.matmul.panels import LoadRing
from ...core.matmul.sources import blocks as _blocks
from .constants import MX_K_TILE, RESIDENT_DOWN_EXCHANGE_MAX_BYTES, WIDE_WEIGHT_LOAD_WIDTH, WIDE_WEIGHT_STAGING_BUFFERS

__all__ = ["DownWeightExchange"]


class DownWeightExchange(nl.NKIObject):
    """Per-expert HBM scratch of W_down quantized in the panel layout, each core writing half of its K tiles.

    Dimensions: as the module docstring; `experts` are the experts whose pass A reads the scratch (static).
    """

    def __init__(self, ctx, experts):
        self.ctx = ctx
        self.experts = list(experts)
        H, I, split = ctx.H, ctx.I, ctx.split
        kernel_assert(ctx.setup.is_mx, f"DownWeightExchange stores MXFP8 words, got precision {ctx.setup.precision}")
        self.words = [None] * ctx.E
        self.scales = [None] * ctx.E
        for e in self.experts:
            self.words[e], self.scales[e] = panel_layout_hbm(H, I, ctx.setup, f"moe_bwd_down_mx_{e}")
        # this core's K tiles (the cores' ranges are disjoint, so are their words and scale rows in the scratch)
        self.t_lo, self.t_hi = shard_range(len(k_tiles(H, ctx.setup)), split.num_cores, split.shard_id)

    @staticmethod
    def applies(ctx, w_down_resident) -> bool:
        """Used under LNC2 with MXFP8 when W_down is loaded on use (not resident) and H is whole MX K tiles."""
        return (ctx.split.num_cores > 1 and ctx.setup.is_mx and not w_down_resident
                and ctx.H % MX_K_TILE == 0)

    @staticmethod
    def of(ctx, groups, w_down_resident, pipelined):
        """The exchange for the fence groups `groups` (lists of experts) or None: on use (`applies`), every expert
        after the first group; resident (`applies_resident`), each later group's experts after its first (that one
        loads its own before the fence: round 18a)."""
        if len(groups) < 2:
            return None
        if DownWeightExchange.applies(ctx, w_down_resident):
            return DownWeightExchange(ctx, [e for g in groups[1:] for e in g])
        if DownWeightExchange.applies_resident(ctx, w_down_resident, pipelined):
            return DownWeightExchange(ctx, [e for g in groups[1:] for e in g[1:]])
        return None

    @staticmethod
    def applies_resident(ctx, w_down_resident, pipelined) -> bool:
        """Under LNC2 with MXFP8, a resident W_down of the pipelined pass A of at most RESIDENT_DOWN_EXCHANGE_MAX_BYTES
        (bf16): above it the exchange's extra DMA costs more than the quantize chain it saves (round 25b)."""
        return (ctx.split.num_cores > 1 and ctx.setup.is_mx and w_down_resident and pipelined
                and ctx.H * ctx.I * 2 <= RESIDENT_DOWN_EXCHANGE_MAX_BYTES)

    def exchanged(self, e) -> bool:
        return e in self.experts

    def quantize(self, e):
        """This core's K tiles of W_down[e]: loaded in WIDE_WEIGHT_LOAD_WIDTH-column pieces through one staging ring,
        quantized (quantize_mx along H) and stored to the scratch. Must precede a core_barrier before A(e)."""
        ctx = self.ctx
        op = TensorDescriptor(ctx.down_rows, k_axis=0, k_base=e * ctx.H, k_len=ctx.H)
        ring = LoadRing(WIDE_WEIGHT_STAGING_BUFFERS)
        for t in range(self.t_lo, self.t_hi):
            for f0, fsz in _blocks(0, ctx.I, WIDE_WEIGHT_LOAD_WIDTH):
                # one K tile at a time: its words die at their store instead of a whole half panel staying live
                panel = load_panel(op, f0, fsz, fsz, ctx.setup, t_lo=t, t_hi=t + 1, ring=ring,
                                   placement=PanelPlacement.per_k_tile())
                store_k_tile(panel.data[0], panel.scales[0], self.words[e], self.scales[e], t, ctx.setup, f0=f0)
                panel = None

    def descriptor(self, e):
        """W_down[e] as pass A's K = H operand read from the scratch (all K tiles, both cores' halves)."""
        return TensorDescriptor(self.words[e], k_axis=0, scales=self.scales[e], panel_layout=True, k_len=self.ctx.H)
