"""Panels from rows: MXFP8 / bf16 panels of operands whose rows only the caller can fetch (gathered rows, run-time
offsets: panel_from_row_loader, into room allocated earlier: PanelSlots) or that are already on chip (panel_from_rows,
panels_from_row_blocks), and on-chip panels copied to HBM and back as they are (store_panel_tiles, load_panel_tiles);
row tiles of a K-contiguous operand DMAed ahead of their panel's load (preload_natural_rows); the panel of a row tile
written a few spans at a time, its K tiles ordered by when they complete (RowPanelByColumns).
The same K tiles, scale layout and panel builder (panel_builder.py) as panels.py's load_panel, so the bits are the same.
"""
from __future__ import annotations

import nki.isa as nisa
import nki.language as nl

from ..kernel_helpers import kernel_assert
from .constants import MX_PACK, PARTITIONS, SCALE_PACK_SLOTS
from .descriptor import MatmulSetup
from .panel_builder import Panel, PanelBuilder, PanelPlacement, _stage_mx_natural
from .panels import _load_rows_natural, _natural_groups, _rows_in_slot, _slot_geometry, k_tiles


class PanelSlots(nl.NKIObject):
    """SBUF room for `count` K tiles of one [K, f_pad] panel, allocated now and filled later, so the tiles outlive
    the run-time loops that wrote them: one MXFP8 K tile at a time (panel_from_row_loader(..., into=(slots, t)): e.g.
    one K tile per trip of a run-time loop, each into a static slot), or a whole panel of an operand in HBM
    (load_panel(..., into=slots): e.g. inside a 0/1-trip loop, a weight loaded only when it is used). Layout of
    PanelBuilder (placement: a PanelPlacement, default whole(): words [128, count, f_pad], scales shared by K-tile
    quads with scale packing; per_k_tile(): one allocation per slot's words and per scale tile; bf16: one tile per
    K tile)."""

    def __init__(self, count: int, f_pad: int, setup: MatmulSetup, placement=None):
        self.f_pad, self.count, self.setup = f_pad, count, setup
        self._builder = PanelBuilder(f_pad, setup, 0, count, placement)
        self._builder.allocate()  # the tiles now, outside any loop

    def tile(self, t: int, P: int = PARTITIONS) -> Panel:
        """MXFP8 K tile t ([P, f_pad] words, P = its padded K / 4) as a one-tile Panel."""
        kernel_assert(self.setup.is_mx, "PanelSlots.tile holds one MXFP8 K tile; got a bf16 setup")
        return Panel([self._builder.words(t, P)], [self._builder.scale(t)], self.f_pad)

    def builder(self, count: int, f_pad: int) -> PanelBuilder:
        """The builder that places a whole panel of `count` K tiles of width f_pad into these slots (load_panel's
        into=): its K tiles write the tiles allocated here."""
        kernel_assert((count, f_pad) == (self.count, self.f_pad),
                      f"PanelSlots of {self.count} K tiles x {self.f_pad} columns cannot take a panel of {count} x "
                      f"{f_pad}")
        return self._builder

    def panel(self, k_size: int) -> Panel:
        """The whole panel of K = k_size rows the slots hold (every K tile's [P_t, f_pad] words and scales, or
        bf16 [valid_t, f_pad] tiles), as load_panel returns it: for reads after the loop that filled them."""
        tiles = k_tiles(k_size, self.setup)
        kernel_assert(len(tiles) == self.count, f"K={k_size} has {len(tiles)} K tiles, the slots {self.count}")
        if not self.setup.is_mx:
            return Panel([self._builder.bf16_tile(t)[:valid, :] for t, (_, valid, _) in enumerate(tiles)],
                         [None] * self.count, self.f_pad)
        return Panel([self._builder.words(t, padded // MX_PACK) for t, (_, _, padded) in enumerate(tiles)],
                     [self._builder.scale(t) for t in range(self.count)], self.f_pad)


def panel_from_row_loader(load_rows, k_size: int, f_size: int, f_pad: int, setup: MatmulSetup,
                          zero_fill: bool = False, stages=None, into=None, load_tile=None) -> Panel:
    """The [K, F] panel (K = rows, e.g. tokens) of an operand whose rows only the caller can fetch: rows
    gathered by indirect DMA, or at a run-time register offset (the grouped-expert kernels' blocks).

    load_rows(dst, first, step, count) must DMA the F columns of rows first, first + step, ...
    (count rows) into the SBUF view dst [count, f_size]. MXFP8: one call per slot j of each K tile
    (rows k(p, j) of the scheme, see _slot_geometry) straight into the interleaved staging tile, then
    quantize_mx as load_panel does for a [K, F] operand in HBM; bf16: one call per K tile.
    zero_fill: zero the destination first (a gather that skips rows, e.g. oob_mode.skip padding,
    leaves them untouched; zero rows add nothing and do not move a group's scale).
    stages: optional ring of MXFP8 staging tiles [128, 4, >= f_pad] bf16 the caller reuses across
    panels (K tile t uses stages[t % len]): a load then waits for the quantize that last read its
    stage, which bounds how far loads run ahead (default: a fresh staging tile per K tile).
    into: (PanelSlots, t): quantize the operand's single K tile (k_size <= 512, MXFP8) into slot t of
    room allocated earlier, and return that slot's Panel.
    load_tile: optional load_tile(dst, k0, P) that DMAs a whole K tile's rows k0 + 4p + j (the 1x32 scheme) into
    dst [P, 4, f_size] at once, for a source that keeps each partition's four rows in one run (MXFP8, 1x32, K tiles
    without padding; the others, and without it, one load_rows call per slot). The same bytes in the same places.

    Dimensions:
        result: K tiles of [P, f_pad] (bit-identical to load_panel of the same rows stored in HBM).
    """
    tiles = k_tiles(k_size, setup)
    builder = PanelBuilder(f_pad, setup, 0, len(tiles))
    if into != None:  # noqa: E711
        kernel_assert(setup.is_mx and len(tiles) == 1 and into[0].f_pad == f_pad,
                      f"into= takes one MXFP8 K tile of width {into[0].f_pad}; got K={k_size}, f_pad={f_pad}, "
                      f"{setup.precision}")
        builder = into[0]._builder
    for t in range(len(tiles)):
        k0, valid, padded = tiles[t]
        if setup.is_mx:
            P = padded // MX_PACK
            step_p, step_j = _slot_geometry(setup.scheme, P)
            if stages == None:  # noqa: E711
                stage = nl.ndarray((PARTITIONS, MX_PACK, f_pad), dtype=nl.bfloat16, buffer=nl.sbuf)
            else:
                stage = stages[t % len(stages)]
            if zero_fill or valid < padded or f_size < f_pad:
                nisa.memset(dst=stage[:P, :, :], value=0.0)
            if load_tile != None and valid == padded and step_p == MX_PACK:  # noqa: E711
                load_tile(stage[:P, :, :f_size], k0, P)
            else:
                for j in range(MX_PACK):
                    rows = _rows_in_slot(valid, j, step_p, step_j, P)
                    if rows:
                        load_rows(stage[:rows, j, :f_size], k0 + step_j * j, step_p, rows)
            if into != None:  # noqa: E711
                nisa.quantize_mx(dst=builder.words(into[1], P), src=stage[:P, :, :f_pad].permute((0, 2, 1)),
                                 dst_scale=builder.scale(into[1]))
                return into[0].tile(into[1], P)
            builder.add_mx(t, padded, stage[:P, :, :f_pad].permute((0, 2, 1)))
        else:
            tile = builder.bf16_tile(t)
            if zero_fill or f_size < f_pad:
                nisa.memset(dst=tile[:valid, :], value=0.0)
            load_rows(tile[:valid, :f_size], k0, 1, valid)
            builder.data.append(tile[:valid, :])
            builder.scales.append(None)
    return builder.panel()


def preload_natural_rows(op, f0: int, rows: int, k_ranges, count: int, setup: MatmulSetup) -> list:
    """[(natural group index, row tile)] of the first `count` natural groups (NATURAL_LOAD_K columns each) of a
    K-contiguous bf16 operand's rows [f0, f0 + rows) that lie inside one of k_ranges [(k_lo, k_hi)], each DMAed now
    into a tile of its own (load_panel(preloaded=...) transposes them later; MatmulPlan.prefetch_own)."""
    tiles = k_tiles(op.k_size, setup)
    out = []
    for gi, group in enumerate(_natural_groups(tiles, setup)):
        k_lo = tiles[group[0]][0]
        k_last, valid_last, padded_last = tiles[group[-1]]
        if len(out) < count and any(lo <= k_lo and k_last + valid_last <= hi for lo, hi in k_ranges):
            out.append((gi, _load_rows_natural(op, f0, rows, k_lo, k_last + valid_last, k_last + padded_last)))
    return out


def panel_from_rows(rows_tile, f_size: int, k_size: int, f_pad: int, setup: MatmulSetup, placement=None) -> Panel:
    """The [K, f_size] panel of an on-chip K-contiguous bf16 tile rows_tile [f_size, Kp] (Kp = K rounded
    up to the MXFP8 padding, zero beyond K): what load_panel builds for the same rows in HBM (placement: a
    PanelPlacement, default whole())."""
    tiles = k_tiles(k_size, setup)
    builder = PanelBuilder(f_pad, setup, 0, len(tiles), placement)
    chunks = [(0, f_size, rows_tile, 0)]
    for t in range(len(tiles)):
        builder.add_natural(t, tiles[t], chunks, f_size)
    return builder.panel()


class RowPanelByColumns(nl.NKIObject):
    """panel_from_rows's MXFP8 [K, f_size] panel of an on-chip K-contiguous bf16 tile rows_tile [f_size, Kp] whose
    columns are written a few spans at a time (an epilogue's output tiles): written(spans) records one write,
    build_ready() transposes and quantizes every K tile whose columns [k0, k0 + valid) are all written (columns from K
    to Kp are the caller's zeros, written before), and panel() returns the whole panel. The same K tiles, staging and
    quantize_mx as panel_from_rows, in one words and one scale allocation (store_panel_tiles), so the bits are the
    same; only the order of the K tiles changes: in K order, except that the K tiles the last write completed go after
    all the others. Why: TensorE runs the transposes in program order, each as soon as the columns it reads are
    written, so a K tile that waits for the last write (in the MoE kernel's d_gate_up, the K tile across the gate / up
    boundary when I is not a multiple of 512) would hold up the K tiles after it that earlier writes completed.

    Dimensions: rows_tile [f_size <= 128, Kp] bf16; panel K tiles [P, f_pad] x4 words with their scales.
    """

    def __init__(self, rows_tile, f_size: int, k_size: int, f_pad: int, setup: MatmulSetup):
        kernel_assert(setup.is_mx, f"RowPanelByColumns builds MXFP8 panels; got {setup.precision}")
        self.tiles = k_tiles(k_size, setup)
        self.unwritten = [valid for _, valid, _ in self.tiles]  # columns of each K tile still to be written
        self.completed_by = [None] * len(self.tiles)  # the write (1, 2, ...) that completed each K tile
        self.built = [False] * len(self.tiles)
        self.writes, self.spans = 0, []
        self.builder = PanelBuilder(f_pad, setup, 0, len(self.tiles))
        self.chunks = [(0, f_size, rows_tile, 0)]
        self.f_size, self.f_pad, self.setup = f_size, f_pad, setup
        self.data, self.scales = [None] * len(self.tiles), [None] * len(self.tiles)

    def written(self, spans) -> None:
        """One write: the columns [lo, hi) of each of `spans` [(lo, hi)] (no column may be written twice)."""
        self.writes += 1
        for lo, hi in spans:
            kernel_assert(all(hi <= a or b <= lo for a, b in self.spans),
                          f"columns [{lo}, {hi}) written twice: earlier spans {self.spans}")
            self.spans.append((lo, hi))
            for t, (k0, valid, _) in enumerate(self.tiles):
                overlap = max(0, min(hi, k0 + valid) - max(lo, k0))
                self.unwritten[t] -= overlap
                if overlap and self.unwritten[t] == 0:
                    self.completed_by[t] = self.writes

    def build_order(self) -> list:
        """The complete K tiles not yet built, in K order, those the last write completed after the others."""
        ready = [t for t in range(len(self.tiles)) if self.completed_by[t] != None and not self.built[t]]  # noqa: E711
        return ([t for t in ready if self.completed_by[t] != self.writes] +
                [t for t in ready if self.completed_by[t] == self.writes])

    def build_ready(self) -> None:
        """Transpose and quantize the complete K tiles not yet built, in build_order()."""
        for t in self.build_order():
            k0, _, padded = self.tiles[t]
            stage = _stage_mx_natural(self.chunks, k0, padded, self.f_size, self.f_pad, self.setup)
            self.data[t], self.scales[t] = self.builder.quantize_mx_tile(t, padded, stage)
            self.built[t] = True

    def panel(self) -> Panel:
        """The whole panel; every K tile must be built (build_ready after the last write)."""
        kernel_assert(all(self.built), f"K tiles not built: {[t for t, b in enumerate(self.built) if not b]}")
        self.builder.data, self.builder.scales = self.data, self.scales  # in K order, as add_mx leaves them
        return self.builder.panel()


def panel_tile_widths(k_size: int, f_pad: int, setup: MatmulSetup):
    """(K tiles, scale tiles) of an MXFP8 [K, f_pad] panel built on chip in one allocation of each (panel_from_rows):
    its words are [128, K tiles, f_pad] x4 and its scales [128, scale tiles, f_pad] uint8 (store_panel_tiles)."""
    n = len(k_tiles(k_size, setup))
    return n, (-(-n // SCALE_PACK_SLOTS) if setup.use_scale_packing else n)


def store_panel_tiles(panel: Panel, words_dst, scales_dst) -> None:
    """Copy an MXFP8 panel built on chip (panel_from_rows) to HBM as its SBUF allocations hold it: words_dst
    [128, K tiles, f_pad] x4 and scales_dst [128, scale tiles, f_pad] uint8 views (panel_tile_widths), one DMA
    each (per partition one contiguous run). A K tile of fewer than 128 partitions (K padded to 128, not 512)
    and the scale rows quantize_mx does not write are copied as they are (a copy may move never-written bytes;
    no matmul reads them); load_panel_tiles rebuilds the same Panel from the copy."""
    kernel_assert(panel.words_tile != None and panel.scale_tile != None,  # noqa: E711
                  "store_panel_tiles needs an MXFP8 panel held in one words and one scale allocation "
                  f"(panel_from_rows), got words_tile={panel.words_tile!r}, scale_tile={panel.scale_tile!r}")
    nisa.dma_copy(dst=words_dst, src=panel.words_tile)
    nisa.dma_copy(dst=scales_dst, src=panel.scale_tile)


def load_panel_tiles(words_src, scales_src, k_size: int, f_pad: int, setup: MatmulSetup) -> Panel:
    """The Panel that store_panel_tiles stored in HBM (words_src [128, K tiles, f_pad] x4, scales_src [128, scale
    tiles, f_pad] uint8 views): two DMAs, no transposes and no quantize_mx; bit-identical to the stored panel."""
    tiles = k_tiles(k_size, setup)
    builder = PanelBuilder(f_pad, setup, 0, len(tiles))
    builder.words(0, PARTITIONS)  # allocates words [128, K tiles, f_pad]
    builder.scale(0)  # and scales [128, scale tiles, f_pad]
    nisa.dma_copy(dst=builder._data_tile, src=words_src)
    nisa.dma_copy(dst=builder._scale_tile, src=scales_src)
    for t in range(len(tiles)):
        builder.data.append(builder.words(t, tiles[t][2] // MX_PACK))
        builder.scales.append(builder.scale(t))
    return builder.panel()


class DeferredRowPanel(nl.NKIObject):
    """panel_from_rows's MXFP8 [K, f_size] panel of an on-chip K-contiguous bf16 tile rows_tile [f_size, Kp], built in
    two steps: the constructor stages every K tile now (PE transposes into PSUM, ScalarE copies into a bf16 staging
    tile each) and quantizes only the first it stages; panel() quantizes the rest at its first call (VectorE) and
    returns the Panel. Why: VectorE runs in program order, so a panel first read much later (the MLP backward's last
    phase-2 stationary panel, read by phase 2's last tile of its first n block) would put its quantizes ahead of the
    next plan's first quantizes, which that plan's first matmuls wait for; TensorE still runs the transposes where
    panel_from_rows did. One K tile is quantized now because its words' first write places the panel's words and
    scales (the cost model's allocator places a tile at its first access): deferring it too put them after the next
    plan's staging ring, whose first tile then waited on a memory reuse (TP8 modeled 0.6265 / 0.7153 ms against
    0.6248 / 0.7026).
    first_cols (lo, hi): the K tiles inside columns [lo, hi) are staged first (the caller's columns written first,
    e.g. the MLP backward's d_up half, which VectorE's first product writes while GpSimd still computes d_gate's):
    TensorE, in program order, then transposes them while the other columns are being written.
    The same transposes, copies and quantize_mx of the same K tiles as panel_from_rows (each K tile on its own, the
    Panel in K order): the same bits. The other K tiles' staging tiles (bf16 [128, f_pad, 4] each) stay live until
    panel().

    Dimensions: rows_tile [f_size <= 128, Kp] bf16; panel K tiles [P, f_pad] x4 words with their scales.
    """

    deferred = True  # ResidentPanels.get calls panel() at the first read

    def __init__(self, rows_tile, f_size: int, k_size: int, f_pad: int, setup: MatmulSetup, first_cols=None,
                 placement=None):
        kernel_assert(setup.is_mx, f"DeferredRowPanel defers MXFP8 quantizes; got {setup.precision}")
        self.tiles = k_tiles(k_size, setup)
        n = len(self.tiles)
        self.builder = PanelBuilder(f_pad, setup, 0, n, placement)
        self.order = list(range(n))  # the K tiles in the order they are staged
        if first_cols != None:  # noqa: E711
            lo, hi = first_cols
            first = [t for t, (k0, valid, _) in enumerate(self.tiles) if lo <= k0 and k0 + valid <= hi]
            self.order = first + [t for t in range(n) if t not in first]
        chunks = [(0, f_size, rows_tile, 0)]
        self.stages = [None] * n
        for t in self.order:
            k0, _, padded = self.tiles[t]
            self.stages[t] = _stage_mx_natural(chunks, k0, padded, f_size, f_pad, setup)
        self.data, self.scales = [None] * n, [None] * n
        self._quantize(self.order[0])
        self.built = None

    def _quantize(self, t: int) -> None:
        self.data[t], self.scales[t] = self.builder.quantize_mx_tile(t, self.tiles[t][2], self.stages[t])
        self.stages[t] = None

    def panel(self) -> Panel:
        """The Panel; the first call issues the quantize_mx of the K tiles not quantized yet (in staging order)."""
        if self.built == None:  # noqa: E711
            for t in self.order[1:]:
                self._quantize(t)
            self.builder.data, self.builder.scales = self.data, self.scales  # in K order, as add_mx leaves them
            self.built = self.builder.panel()
        return self.built


def panels_from_row_blocks(row_blocks: list, setup: MatmulSetup, defer_quantize: bool = False,
                           first_cols=None, block=None, m_lo: int = 0, m_tile: int = 0) -> list:
    """[Panel] of finished on-chip row blocks [(m_rel, msz, rows_tile, k_size)] in their order (panel_from_rows:
    each block's msz rows become the F axis, quantized along K); empties `row_blocks`. defer_quantize (MXFP8): a
    DeferredRowPanel per block instead (staged now, the K tiles of columns first_cols first; quantized when
    ResidentPanels.get first reads it). block (MXFP8, a PanelGroupBlock of m_tile-row panels): each block's panel
    goes into slot (m_rel - m_lo) // m_tile of it instead of an allocation of its own."""
    out = []
    for m_rel, msz, rows, k_size in row_blocks:
        f_pad = msz + (msz % 2 if setup.is_mx else 0)  # nc_matmul_mx needs an even M
        placement = None
        if block != None and setup.is_mx:  # noqa: E711
            words, scales = block.slot((m_rel - m_lo) // m_tile, f_pad)
            placement = PanelPlacement.into(words, scales)
        if defer_quantize and setup.is_mx:
            out.append(DeferredRowPanel(rows[:msz, :], msz, k_size, f_pad, setup, first_cols, placement))
        else:
            out.append(panel_from_rows(rows[:msz, :], msz, k_size, f_pad, setup, placement))
    row_blocks.clear()
    return out
