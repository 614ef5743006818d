"""The panel builder of the shared matmul layer: where the K tiles of one SBUF panel go (PanelPlacement) and the
object that allocates and collects them (PanelBuilder), with the Panel it returns and the on-chip transposes that
turn natural row tiles into a K tile (PanelBuilder.add_natural). panels.py and row_panels.py load through it.
"""
from __future__ import annotations

import nki.isa as nisa
import nki.language as nl

from ..kernel_helpers import kernel_assert
from .constants import (MX_PACK, MX_PANEL_PIECE_BYTES, MX_PANEL_WHOLE_MAX_BYTES, PARTITIONS, PLACEMENT_INTO,
                        PLACEMENT_PER_K_TILE, PLACEMENT_PIECES, PLACEMENT_SLOTS, PLACEMENT_WHOLE, SCALE_PACK_SLOTS,
                        SCALE_PACK_STRIDE)


class Panel(nl.NKIObject):
    """An operand's [K, F] panel resident in SBUF, one entry per K tile.

    data[t]: x4 words [P_t, F_pad] (MXFP8) or bf16 [T_t, F_pad]; scales[t]: scale view (MXFP8) or None.
    words_tile, scale_tile: the SBUF allocations behind data / scales when the panel's K tiles share one of each
    (PanelBuilder with PanelPlacement.whole(); store_panel_tiles copies them), else None.
    """

    def __init__(self, data, scales, f_pad, words_tile=None, scale_tile=None):
        self.data = data
        self.scales = scales
        self.f_pad = f_pad
        self.words_tile, self.scale_tile = words_tile, scale_tile



def _stage_mx_natural(chunks, k0, padded, f_size, f_pad, setup):
    """Interleaved staging tile [P, F_pad, 4] of K tile [k0, k0+padded) from natural row tiles.

    chunks: [(c0, rows, natural, k_lo)]: SBUF [rows, *] bf16 tiles holding columns k_lo.. of F rows
    c0..c0+rows of a K-contiguous operand (zero beyond K). Slot j of the interleaved layout is the
    column set k(p, j), p < P, of the natural tile, transposed on the PE array (bit-exact,
    https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.nc_transpose.html)
    into PSUM and copied to SBUF on ScalarE (VectorE carries quantize_mx).
    """
    P = padded // MX_PACK
    stage = nl.ndarray((PARTITIONS, f_pad, MX_PACK), dtype=nl.bfloat16, buffer=nl.sbuf)
    if f_size < f_pad:
        nisa.memset(dst=stage[:P, :, :], value=0.0)
    for c0, rows, natural, k_lo in chunks:
        lo = k0 - k_lo
        flipped = nl.ndarray((PARTITIONS, MX_PACK, PARTITIONS), dtype=nl.bfloat16, buffer=nl.psum)
        for j in range(MX_PACK):
            if setup.scheme == "1x32":
                cols = natural[:rows, lo + j:lo + padded:MX_PACK]  # k = 4p + j
            else:
                cols = natural[:rows, lo + P * j:lo + P * (j + 1)]  # k = p + P*j
            nisa.nc_transpose(dst=flipped[:P, j, :rows], data=cols, engine=nisa.engine.tensor)
        # PSUM [P, 4, rows] -> SBUF [P, rows, 4]
        nisa.tensor_copy(dst=stage[:P, c0:c0 + rows, :], src=flipped[:P, :, :rows].permute((0, 2, 1)),
                         engine=nisa.engine.scalar)
    return stage[:P, :, :]


def _bf16_tile_natural(tile, chunks, k0, valid, f_size, f_pad):
    """bf16 K tile [valid, F_pad] of a K-contiguous operand, transposed from natural row tiles into the
    SBUF tile `tile` [128, F_pad]."""
    if f_size < f_pad:
        nisa.memset(dst=tile[:valid, :], value=0.0)
    for c0, rows, natural, k_lo in chunks:
        flipped = nl.ndarray((PARTITIONS, PARTITIONS), dtype=nl.bfloat16, buffer=nl.psum)
        nisa.nc_transpose(dst=flipped[:valid, :rows], data=natural[:rows, k0 - k_lo:k0 - k_lo + valid],
                          engine=nisa.engine.tensor)
        nisa.tensor_copy(dst=tile[:valid, c0:c0 + rows], src=flipped[:valid, :rows], engine=nisa.engine.scalar)
    return tile[:valid, :]



class PanelPlacement(nl.NKIObject):
    """Where an MXFP8 panel's K tiles put their words and scales in SBUF (PanelBuilder). Build one with:

    whole(): one allocation for all K tiles' words ([128, count, F_pad]) and one for their scales ([128, scale
        tiles, F_pad]), placed at the first write: the panel stays contiguous instead of interleaving small words
        tiles with the staging tiles, which would leave staging-sized holes behind.
    per_k_tile(): one words tile [128, F_pad] per K tile and one scale tile [128, F_pad] per scale tile (each
        placed at its own first write), for panels too large to ask for one contiguous gap: a kernel whose many
        small, differently-lived tiles fragment SBUF (the MoE kernel, docs/moe.md section 10, round 6a) then never
        needs a gap wider than one K tile's words (4 KiB per partition for 1024 columns).
    pieces(): as whole(), but words quantized on chip of more than MX_PANEL_WHOLE_MAX_BYTES per partition are
        allocated in pieces of MX_PANEL_PIECE_BYTES (whole K tiles each; the dense plans): a block that large finds
        no gap among the previous phase's live tiles and waits for all of them (TP8 phase 3's 64 KiB X panel waited
        for phase 2's last stores: modeled 0.685 -> 0.660 ms in pieces of 16 KiB; 32 KiB pieces: 0.688, 8 KiB:
        0.685; splitting every panel above 16 KiB, W_down's included: 0.671). piece_bytes: another piece size
        (0: MX_PANEL_PIECE_BYTES; MatmulPlan interleave_lead: LEAD_PANEL_PIECE_BYTES). always: in pieces whatever
        the panel's size (PanelSource: a narrower panel of a source whose earlier panel went in pieces).
    into(words, scales): the caller's allocation (SBUF views words [128, count, F_pad], scales [128, scale tiles,
        F_pad]; PanelGroupBlock.slot), laid out as whole().
    slots(words, scales): the caller's views, one per K tile (words [128, F_pad]; scales: the K tile's scale rows, as
        scale() returns them), anywhere in its allocations (PanelWordsRing.placement).
    BF16 panels ignore the placement: one tile per K tile (PanelBuilder.bf16_tile).
    """

    def __init__(self, kind: str, words=None, scales=None, piece_bytes=0, always=False):
        self.kind = kind
        self.words, self.scales = words, scales
        self.piece_bytes = piece_bytes
        self.always = always  # pieces(): also a panel of at most MX_PANEL_WHOLE_MAX_BYTES

    @staticmethod
    def whole():
        return PanelPlacement(PLACEMENT_WHOLE)

    @staticmethod
    def per_k_tile():
        return PanelPlacement(PLACEMENT_PER_K_TILE)

    @staticmethod
    def pieces(piece_bytes=0, always=False):
        return PanelPlacement(PLACEMENT_PIECES, piece_bytes=piece_bytes, always=always)

    @staticmethod
    def into(words, scales):
        return PanelPlacement(PLACEMENT_INTO, words, scales)

    @staticmethod
    def slots(words, scales):
        return PanelPlacement(PLACEMENT_SLOTS, words, scales)


def words_above_whole_max(count: int, f_pad: int) -> bool:
    """Whether a panel of `count` K tiles of f_pad x4 words (4 bytes each) per partition goes in pieces under
    PanelPlacement.pieces(): above MX_PANEL_WHOLE_MAX_BYTES."""
    return count * f_pad * 4 > MX_PANEL_WHOLE_MAX_BYTES


class PanelBuilder(nl.NKIObject):
    """Allocates and collects the K tiles [t_lo, t_lo + count) of one panel, placed as `placement` says
    (PanelPlacement, default whole()). quantize_columns > 1: each K tile quantized in that many equal column pieces
    (quantize_mx_tile), so a matmul over the first columns waits for their piece only."""

    def __init__(self, f_pad, setup, t_lo, count, placement=None, quantize_columns=1):
        self.placement = PanelPlacement.whole() if placement == None else placement  # noqa: E711
        self.quantize_columns = quantize_columns  # quantize_mx_tile's column pieces per K tile
        kernel_assert(self.placement.kind not in (PLACEMENT_INTO, PLACEMENT_SLOTS) or setup.is_mx,
                      f"PanelPlacement.{self.placement.kind} holds MXFP8 words and scales, got a BF16 setup")
        self.f_pad = f_pad
        self.setup = setup
        self.t_lo = t_lo
        self.count = count
        self.data, self.scales = [], []
        self._data_tile, self._scale_tile = self.placement.words, self.placement.scales  # into: the caller's
        self._scale_tiles = [None] * count  # per_k_tile: one per scale tile
        self._pieces = [None] * count  # words allocated in pieces of whole K tiles (per_k_tile: 1; pieces: piece_tiles)
        self._bf16_tiles = [None] * count  # bf16 K tiles allocated early (allocate()), else one per bf16_tile call
        self.piece_tiles = max(1, (self.placement.piece_bytes or MX_PANEL_PIECE_BYTES) // (f_pad * 4))

    def tiles_per_words_allocation(self, quantized: bool) -> int:
        """K tiles whose words share one SBUF allocation: the one place that reads the placement's kind for words."""
        kind = self.placement.kind
        if kind == PLACEMENT_PER_K_TILE:
            return 1
        large = self.placement.always or words_above_whole_max(self.count, self.f_pad)
        if kind == PLACEMENT_PIECES and quantized and large:
            return min(self.piece_tiles, self.count)
        return self.count

    def words(self, t, P, quantized=False):
        """SBUF [P, F_pad] x4 words (MXFP8) for K tile t. quantized: the words are quantized on chip (only
        those go in pieces with PanelPlacement.pieces(); loaded words keep the panel's one allocation)."""
        i = t - self.t_lo
        if self.placement.kind == PLACEMENT_SLOTS:
            return self.placement.words[i][:P, :]
        per = self.tiles_per_words_allocation(quantized)
        if per < self.count or self.placement.kind == PLACEMENT_PER_K_TILE:
            g = i // per
            if self._pieces[g] == None:  # noqa: E711  allocated at its first write
                tiles = min(per, self.count - g * per)
                self._pieces[g] = nl.ndarray((PARTITIONS, tiles, self.f_pad), dtype=self.setup.x4_dtype,
                                             buffer=nl.sbuf)
            return self._pieces[g][:P, i % per, :]
        if self._data_tile == None:  # noqa: E711
            self._data_tile = nl.ndarray((PARTITIONS, self.count, self.f_pad), dtype=self.setup.x4_dtype,
                                         buffer=nl.sbuf)
        return self._data_tile[:P, i, :]

    def scale(self, t):
        """Scale destination for K tile t; with packing, four K tiles share a tile at offsets 0/4/8/12."""
        i = t - self.t_lo
        if self.placement.kind == PLACEMENT_SLOTS:
            return self.placement.scales[i]
        packing = self.setup.use_scale_packing
        if self.placement.kind == PLACEMENT_PER_K_TILE:
            s = i // SCALE_PACK_SLOTS if packing else i
            if self._scale_tiles[s] == None:  # noqa: E711
                self._scale_tiles[s] = nl.ndarray((PARTITIONS, self.f_pad), dtype=nl.uint8, buffer=nl.sbuf)
            tile = self._scale_tiles[s]
            return tile[SCALE_PACK_STRIDE * (i % SCALE_PACK_SLOTS):, :] if packing else tile
        if self._scale_tile == None:  # noqa: E711
            n = -(-self.count // SCALE_PACK_SLOTS) if packing else self.count
            self._scale_tile = nl.ndarray((PARTITIONS, n, self.f_pad), dtype=nl.uint8, buffer=nl.sbuf)
        if packing:
            return self._scale_tile[SCALE_PACK_STRIDE * (i % SCALE_PACK_SLOTS):, i // SCALE_PACK_SLOTS, :]
        return self._scale_tile[:, i, :]

    def allocate(self) -> None:
        """Allocate every K tile's words and scales (bf16: every K tile) now (PanelSlots: outside the loops that
        fill them later)."""
        if not self.setup.is_mx:
            self._bf16_tiles = [self.bf16_tile(t) for t in range(self.t_lo, self.t_lo + self.count)]
            return
        per_k_tile = self.placement.kind == PLACEMENT_PER_K_TILE
        for t in range(self.t_lo, self.t_lo + (self.count if per_k_tile else 1)):
            self.words(t, PARTITIONS)
            self.scale(t)

    def bf16_tile(self, t):
        """SBUF [128, F_pad] bf16 tile for K tile t: one allocation per K tile (bf16 panels need no
        staging, and a whole-panel allocation would make its first load wait for all the memory), or the one
        allocate() made."""
        early = self._bf16_tiles[t - self.t_lo]
        if early != None:  # noqa: E711
            return early
        return nl.ndarray((PARTITIONS, self.f_pad), dtype=nl.bfloat16, buffer=nl.sbuf)

    def add_mx(self, t, padded, src, next_words_as_source=False):
        """Quantize stage view `src` [P, F_pad, 4] as K tile t (appended: the K tiles come in order);
        next_words_as_source: see quantize_mx_tile."""
        words, scale = self.quantize_mx_tile(t, padded, src, next_words_as_source)
        self.data.append(words)
        self.scales.append(scale)

    def quantize_mx_tile(self, t, padded, src, next_words_as_source=False):
        """(words, scale) of K tile t, quantized from stage view `src` [P, F_pad, 4] into its place; the caller
        collects them (add_mx appends; RowPanelByColumns builds its K tiles out of order).

        next_words_as_source: where a later K tile of this builder exists (not the last), ScalarE first copies the
        last columns of `src` (a strided view of the [P, 4, F] staging tile) into the words allocation of K tile t + 1
        as a unit-stride bf16 [P, copied, 4] (at most the bytes per partition of its [P, F_pad] x4 words, written only
        by its own quantize, after this one's read), and VectorE quantizes those columns from that copy: quantize_mx
        runs at full rate from a unit-stride source only (pricing.py _cost_quantize_mx; COLD_PERMUTE_INTO_NEXT_WORDS,
        FENCED_NEXT_WORDS_FROM_K_TILE). Copied: the last F_pad // 2 columns of a K tile quantized whole, or the last
        quantize_columns // 2 column pieces; VectorE quantizes the strided columns first (no wait for the copy). The
        copy moves bf16 values unchanged, so the words and scales are the whole tile's, bit for bit.
        """
        P = padded // MX_PACK
        words = self.words(t, P, quantized=True)
        scale = self.scale(t)
        # MX groups run along K (partitions x the 4 slots), never across columns: a column piece's words and scales
        # are those of the whole K tile's quantize, bit for bit
        width = self.f_pad // self.quantize_columns
        kernel_assert(width * self.quantize_columns == self.f_pad,
                      f"{self.quantize_columns} column pieces do not divide f_pad={self.f_pad}")
        c0, staged = self.f_pad, None  # columns from c0 on are quantized from `staged`
        if next_words_as_source and t + 1 < self.t_lo + self.count:
            copied = self.f_pad // 2 if self.quantize_columns == 1 else self.quantize_columns // 2 * width
            c0 = self.f_pad - copied
            # the next K tile's words as bf16 [P, copied, 4]: 2 bf16 per x4 word, so copied * 4 <= 2 * F_pad values
            staged = self.words(t + 1, P, quantized=True).view(nl.bfloat16)[:, :copied * MX_PACK]
            staged = staged.reshape((P, copied, MX_PACK))
            nisa.tensor_copy(dst=staged, src=src[:, c0:, :], engine=nisa.engine.scalar)
        pieces = [(c, min(c + width, c0)) for c in range(0, c0, width)]
        if c0 < self.f_pad:
            pieces = pieces + [(c, min(c + width, self.f_pad)) for c in range(c0, self.f_pad, width)]
        for lo, hi in pieces:
            source = src[:, lo:hi, :] if lo < c0 else staged[:, lo - c0:hi - c0, :]
            nisa.quantize_mx(dst=words[:, lo:hi], src=source, dst_scale=scale[:, lo:hi])
        return words, scale

    def add_natural(self, t, tile, chunks, f_size):
        """K tile t (k0, valid, padded) from natural row tiles (see _stage_mx_natural)."""
        k0, valid, padded = tile
        if self.setup.is_mx:
            self.add_mx(t, padded, _stage_mx_natural(chunks, k0, padded, f_size, self.f_pad, self.setup))
        else:
            self.data.append(_bf16_tile_natural(self.bf16_tile(t), chunks, k0, valid, f_size, self.f_pad))
            self.scales.append(None)

    def panel(self):
        whole = self.placement.kind == PLACEMENT_WHOLE
        return Panel(self.data, self.scales, self.f_pad, self._data_tile if whole else None,
                     self._scale_tile if whole else None)
