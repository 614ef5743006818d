"""Pass B's K=2I stationary d_gate_up panels made by pass A under the I split (moe_bwd_mxfp8_i_split.py; docs/moe.md
section 10, round 25a).

Under the I split core c computes the gate columns I_c and the up columns I + I_c of every row of a block: whole 512-row
K tiles of pass B's K = 2I when I is a multiple of 512 and the cores hold whole I tiles. Each K tile of pass B's panel
is transposed and quantized along K inside its own 512 columns (quantize_mx's groups of 32 never cross a K tile), so
core c can make its own K tiles of every chunk's panel from the d_gate_up rows it holds on chip (RowPanelByColumns over
its [128, 2 |I_c|] tile) and store their words and scales; pass B, on both cores, loads the two cores' K tiles (words
in one DMA, scales in one per quadrant) instead of reading the chunk's bf16 rows and transposing and quantizing all 2I
columns on each core.
Bit-exact: the same transposes and quantize_mx of the same columns; a K tile's scales may sit at another of the four
packing offsets of its scale tile, which nc_matmul_mx reads from wherever the view points (the scale's quadrant is
the data's, as quantize_mx wrote it).

Dimensions: words [N, B, cores x n x 128] x4, scales [N, B, cores x s x 128] uint8 (n = 2 |I_c| / 512 K tiles and s
scale tiles per core, core after core in each row; per core the layout of ctx.d_gu_mx: partition p of a chunk's panel
in row r0 + p).
"""
from __future__ import annotations

import nki.isa as nisa
import nki.language as nl

from ...core.kernel_helpers import kernel_assert, shard_range
from ...core.matmul import Panel, panel_tile_widths
from ...core.matmul.constants import MX_K_TILE, SCALE_PACK_SLOTS, SCALE_PACK_STRIDE, SCALE_QUADRANT
from .constants import PARTITIONS, PHASE1_N_TILE

__all__ = ["SplitChunkPanels"]


class SplitChunkPanels(nl.NKIObject):
    """Each core's K tiles of pass B's d_gate_up panels, stored by pass A (store, zero) and loaded by pass B on both
    cores (load, or allocate / read_into / panel for rows read ahead: DGateUpRowsAhead).

    Race-free (docs/moe.md section 5): core c writes only its range of the scratch, in A(e), before the fence that
    opens B(e)'s segment; both cores read both ranges in that segment (as they read d_gate_up's bf16 rows).

    Dimensions: as the module docstring (nk K tiles and ns scale tiles per core and chunk row).
    """

    def __init__(self, ctx, i_tiles):
        """Allocates the HBM scratch of every block's chunk rows.

        Args:
            ctx: the kernel's MoeContext (N blocks of B rows, I, the core split, the matmul setup).
            i_tiles: pass A's I tiles [(i0, width)] of 512 columns (applies() holds), split evenly between the cores.
        """
        self.ctx = ctx
        cores, n_i = ctx.split.num_cores, len(i_tiles)
        self.ranges = [shard_range(n_i, cores, c) for c in range(cores)]
        self.nk, self.ns = panel_tile_widths(2 * (n_i // cores) * PHASE1_N_TILE, PARTITIONS, ctx.setup)
        # scale rows quantize_mx writes at the start of each quadrant: SCALE_PACK_STRIDE per K tile of a scale tile
        # (up to SCALE_PACK_SLOTS with packing, one without); the rest of the quadrant is never written nor read
        slots = min(self.nk, SCALE_PACK_SLOTS) if ctx.setup.use_scale_packing else 1
        self.scale_rows = SCALE_PACK_STRIDE * slots
        # global K tile t of 2I -> (core, local K tile): gate tiles t < n_i, up tiles n_i + u (local: gate tiles of
        # the core's I tiles, then its up tiles, RowChunk's d_gu layout)
        self.k_tile_owners = []
        for t in range(2 * n_i):
            u = t % n_i
            for c, (lo, hi) in enumerate(self.ranges):
                if lo <= u < hi:
                    self.k_tile_owners.append((c, u - lo + (hi - lo if t >= n_i else 0)))
        # one row per chunk row holding both cores' K tiles, core after core: pass B reads a chunk's words in one DMA
        self.words = nl.ndarray((ctx.N, ctx.B, cores * self.nk * PARTITIONS), dtype=ctx.setup.x4_dtype,
                                buffer=nl.shared_hbm, name="moe_bwd_d_gate_up_split_panels")
        self.scales = nl.ndarray((ctx.N, ctx.B, cores * self.ns * PARTITIONS), dtype=nl.uint8, buffer=nl.shared_hbm,
                                 name="moe_bwd_d_gate_up_split_panel_scales")

    @staticmethod
    def applies(ctx, i_tiles) -> bool:
        """MXFP8, I in whole MX K tiles (pass A's I tiles are the K tiles of each half of 2I) and the same count of I
        tiles per core (one panel width per core), 128-row chunks."""
        cores = ctx.split.num_cores
        return (ctx.setup.is_mx and PHASE1_N_TILE == MX_K_TILE and ctx.I % PHASE1_N_TILE == 0
                and len(i_tiles) % cores == 0 and ctx.B % PARTITIONS == 0)

    @staticmethod
    def of(ctx, i_tiles):
        """SplitChunkPanels(ctx, i_tiles) where it applies, else None."""
        return SplitChunkPanels(ctx, i_tiles) if SplitChunkPanels.applies(ctx, i_tiles) else None

    def _rows(self, scratch, i, r0, tiles, core=None):
        """View [128, tiles, 128] of rows r0..r0+128 of block i: every core's tiles (core None) or core's own."""
        F = scratch.shape[2]
        skip = 0 if core == None else core * tiles * PARTITIONS  # noqa: E711
        return scratch.ap([[F, PARTITIONS], [PARTITIONS, tiles], [1, PARTITIONS]], offset=r0 * F + skip,
                          scalar_offset=i, indirect_dim=0)

    def store(self, panel, i, r0):
        """This core's K tiles (panel: RowPanelByColumns's, K = 2 |I_c|) of rows r0..r0+128 of block i."""
        kernel_assert(len(panel.data) == self.nk, f"a core's panel has {self.nk} K tiles, got {len(panel.data)}")
        kernel_assert(r0 % PARTITIONS == 0,
                      f"split chunk panels hold 128-row chunks from a multiple of 128, got r0={r0}")
        kernel_assert(panel.words_tile != None and panel.scale_tile != None,  # noqa: E711
                      "split chunk panels store a panel held in one words and one scale allocation (panel_from_rows), "
                      f"got words_tile={panel.words_tile!r}, scale_tile={panel.scale_tile!r}")
        core = self.ctx.split.shard_id
        nisa.dma_copy(dst=self._rows(self.words, i, r0, self.nk, core), src=panel.words_tile)
        self._copy_scales(self._rows(self.scales, i, r0, self.ns, core), panel.scale_tile)

    def zero(self, i, r0):
        """Zero words and scales for a chunk of padding only (ExpertISplit.zero_chunk): pass B loads every chunk's
        panel before its flags skip the chunk's matmuls, so the bytes are read but never multiplied."""
        kernel_assert(r0 % PARTITIONS == 0,
                      f"split chunk panels hold 128-row chunks from a multiple of 128, got r0={r0}")
        words = nl.ndarray((PARTITIONS, self.nk, PARTITIONS), dtype=self.ctx.setup.x4_dtype, buffer=nl.sbuf)
        scales = nl.ndarray((PARTITIONS, self.ns, PARTITIONS), dtype=nl.uint8, buffer=nl.sbuf)
        nisa.memset(dst=words, value=0.0)
        nisa.memset(dst=scales, value=0)
        core = self.ctx.split.shard_id
        nisa.dma_copy(dst=self._rows(self.words, i, r0, self.nk, core), src=words)
        self._copy_scales(self._rows(self.scales, i, r0, self.ns, core), scales)

    def allocate(self):
        """SBUF room for one chunk's panel: words [128, cores x n, 128] x4 and scales [128, cores x s, 128] uint8."""
        cores = len(self.ranges)
        return (nl.ndarray((PARTITIONS, cores * self.nk, PARTITIONS), dtype=self.ctx.setup.x4_dtype, buffer=nl.sbuf),
                nl.ndarray((PARTITIONS, cores * self.ns, PARTITIONS), dtype=nl.uint8, buffer=nl.sbuf))

    def read_into(self, room, i, r0):
        """Both cores' K tiles of rows r0..r0+128 of block i into room (allocate()): the words in one DMA, the
        scale rows quantize_mx wrote in one per quadrant (_copy_scales)."""
        words, scales = room
        nisa.dma_copy(dst=words, src=self._rows(self.words, i, r0, words.shape[1]))
        self._copy_scales(scales, self._rows(self.scales, i, r0, scales.shape[1]))

    def _copy_scales(self, dst, src):
        """dst = src for the scale rows quantize_mx writes (scale_rows at the start of each 32-partition quadrant):
        one DMA per quadrant, as an SBUF access pattern may not stride partitions; the other rows of a scale tile
        are never written (quantize_mx) nor read (nc_matmul_mx), so moving them is waste (round 30a)."""
        for q0 in range(0, PARTITIONS, SCALE_QUADRANT):
            nisa.dma_copy(dst=dst[q0:q0 + self.scale_rows], src=src[q0:q0 + self.scale_rows])

    def panel(self, room, f_pad):
        """The chunk's K=2I panel (global K order) from room holding both cores' K tiles (core c's local K tile t:
        words c n + t, scales at offset 4 (t % 4) of scale tile c s + t / 4 with packing, as PanelBuilder.scale)."""
        words, scales = room
        packing = self.ctx.setup.use_scale_packing
        data = [words[:, c * self.nk + t, :f_pad] for c, t in self.k_tile_owners]
        scale = [scales[SCALE_PACK_STRIDE * (t % SCALE_PACK_SLOTS):, c * self.ns + t // SCALE_PACK_SLOTS, :f_pad]
                 if packing else scales[:, c * self.nk + t, :f_pad] for c, t in self.k_tile_owners]
        return Panel(data, scale, f_pad)

    def load(self, i, r0, m):
        """The K=2I panel of rows r0..r0+128 of block i, read now (pass B without rows read ahead)."""
        kernel_assert(r0 % PARTITIONS == 0 and m == PARTITIONS,
                      f"split chunk panels cover 128-row chunks from a multiple of 128, got r0={r0}, m={m}")
        room = self.allocate()
        self.read_into(room, i, r0)
        return self.panel(room, self.ctx.f_pad(m))
