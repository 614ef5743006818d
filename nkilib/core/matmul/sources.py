"""Where a MatmulPlan's operand panels come from, and the order of its output tiles.

PanelSource loads an operand's panels on demand through the panel builders of panels.py (keeping all of them,
or a bounded group, and sharing one LoadRing across its loads); ResidentPanels serves panels an earlier phase
built on chip; blocks and tile_order tile the output. plan.py composes these into a plan.
"""
from __future__ import annotations

import nki.language as nl

from ..kernel_helpers import kernel_assert
from .constants import NATURAL_BUFFERS, SCALE_PACK_SLOTS, STAGING_BUFFERS
from .descriptor import MatmulSetup
from .panel_builder import PanelPlacement, words_above_whole_max
from .panels import (LoadRing, Panel, PanelGroupBlock, PanelLoad, PanelWordsRing, k_tiles, load_panel,
                     panel_columns)


class PanelSource(nl.NKIObject):
    """Panels of one operand on demand, for columns inside [lo, hi).

    keep_all=True keeps every panel loaded (each quantized once); otherwise up to `capacity` loads are
    kept and all of them are dropped *before* the next one is loaded, so at most `capacity` are live
    (capacity > 1: a group of stationary panels reused across a sweep of moving panels).
    load_width: when set, columns are loaded and quantized in super-panels of that width (aligned to
    `lo`) and requests are served as column slices of them. For [K, F] operands this turns 256-byte
    DMA runs of a 128-column stationary tile into load_width*2-byte runs.
    The loaded panels are two parallel lists (first column, Panel): NKI dictionaries take string keys only.
    """

    resident = False  # panels are loaded on demand (ResidentPanels: built on chip by an earlier phase)

    def __init__(self, op, setup: MatmulSetup, pad_even: bool, keep_all: bool, lo: int = 0, hi: int = -1,
                 load_width: int = 0, capacity: int = 1):
        self.op = op
        self.capacity = capacity
        self.later_staging = 0  # when set, the ring shrinks to it after the first panel (MatmulPlan fenced_start)
        self.staging = STAGING_BUFFERS  # staging tiles of the ring its [K, F] loads share (MatmulPlan cold_staging)
        self.piece_bytes = 0  # words quantized on chip in pieces of this size (PanelPlacement; 0: the default)
        self.first_piece_bytes = 0  # the same for the next load only (a later K chunk's first panel: k_chunks.py)
        self.first_quantize_columns = 1  # the first load's K tiles quantized in this many column pieces (fenced_start)
        self.first_slot_dma_k_tiles = 0  # the first load's first K tiles staged by one DMA per slot (cold_staging)
        self.next_words_from = -1  # every load's K tiles from this one on quantize half their columns from a
        # unit-stride copy in the next K tile's words (PanelLoad; cold_staging: 0)
        self.first_next_words_from = -1  # the same for the first load only (fenced_start's pieces, span_columns.py)
        self.words_per_k_tile = False  # words in one allocation per K tile (PanelPlacement.per_k_tile; adopt_staging)
        self.switch_ahead_slots = 0  # > 0: every load's words in the K-tile slots of one PanelWordsRing with this
        # many slots beyond a panel (MatmulPlan interleave_switch with keep_whole: SWITCH_AHEAD_SLOTS), made at the
        # first load
        self.words_ring = None
        self.words_in_pieces = False  # an earlier panel's words went in pieces (_placement): so do the later ones'
        self.kept_slots = 0  # > 0 (keep_all): every panel in the next slot of one PanelGroupBlock of this many, made at
        # the first load (MatmulPlan interleave_switch with keep_whole: the stationary operand kept whole in one block)
        self.kept_block = None
        self.setup = setup
        self.pad_even = pad_even and setup.is_mx  # nc_matmul_mx needs an even M
        self.keep_all = keep_all
        self.lo = lo
        self.hi = op.f_extent if hi < 0 else hi
        self.load_width = load_width
        self.keys = []  # first column of each loaded panel
        self.panels = []  # the loaded Panels, parallel to keys
        # LoadRing shared by this source's loads (load_panel's `ring`: MXFP8 staging tiles, or natural row
        # tiles of a K-contiguous operand), dropped when a load completes the columns [lo, hi)
        self.ring = None
        self.loaded = 0
        self.pending = None  # PanelLoad of the next panel begun early (load_ahead), and its first column
        self.pending_key = -1

    def _padded(self, n: int) -> int:
        return n + (n % 2 if self.pad_even else 0)

    def _start_ring(self, natural: bool) -> None:
        if self.ring == None and self.capacity == 1 and self.setup.is_mx:  # noqa: E711
            # natural row tiles: one for the first load (its second half waits for the first half's PE
            # transposes, leaving the DMA bandwidth to the other operand's first K tiles), then up to
            # NATURAL_BUFFERS (the next load waits for this one's transposes). Groups of loads
            # (capacity > 1, e.g. K-streamed plans) load as before: each load its own tiles; so do BF16
            # panels (no quantize to pace: TP8 BF16 mode modeled 2.294 ms with the ring, 2.248 without).
            self.ring = LoadRing(1 if natural else self.staging)

    def _placement(self, f_pad: int) -> PanelPlacement:
        """Where the next load's words go: the next panel's slots of words_ring (switch_ahead_slots), else in pieces;
        once a panel's words went in pieces (above MX_PANEL_WHOLE_MAX_BYTES), every later panel's do, however
        narrow: a whole tail panel would need one gap wider than the pieces the earlier panels leave as they die
        (9216 x 4096 x 1536: phase 4's 384-column tail panel, 27 KiB, against a largest gap of 26.4 KiB among its
        13.5 KiB pieces: refused before round 50b)."""
        if not self.switch_ahead_slots:
            self.words_in_pieces = (self.words_in_pieces or
                                    words_above_whole_max(len(k_tiles(self.op.k_size, self.setup)), f_pad))
            piece, self.first_piece_bytes = self.first_piece_bytes or self.piece_bytes, 0
            return PanelPlacement.pieces(piece, self.words_in_pieces)
        if self.words_ring == None:  # noqa: E711
            self.words_ring = PanelWordsRing(self.op.k_size, f_pad, self.switch_ahead_slots, self.setup)
        return self.words_ring.placement(f_pad)

    def _next_words_from(self) -> int:
        """PanelLoad's next_words_from for the next load: first_next_words_from while it is the first, if set."""
        return self.first_next_words_from if self.first_next_words_from >= 0 else self.next_words_from

    def takes_words_ring(self) -> bool:
        """Whether switch_ahead_slots applies: panels loaded one at a time (can_load_ahead, not kept), of whole scale
        tiles (with scale packing, K tiles a multiple of SCALE_PACK_SLOTS: PanelWordsRing)."""
        n = len(k_tiles(self.op.k_size, self.setup))
        return (self.can_load_ahead() and not self.keep_all and
                (not self.setup.use_scale_packing or n % SCALE_PACK_SLOTS == 0))

    def can_load_ahead(self) -> bool:
        """Whether load_ahead applies: MXFP8 panels of a [K, F] bf16 operand quantized on chip, all of them kept
        or one at a time."""
        return (self.setup.is_mx and (self.keep_all or self.capacity == 1) and self.op.k_axis == 0 and
                not self.op.prequantized and not self.op.panel_layout)

    def holds(self, f0: int) -> bool:
        """Whether the panel serving column f0 is loaded (or its load begun)."""
        base = self.load_key(f0)
        return base in self.keys or (self.pending != None and self.pending_key == base)  # noqa: E711

    def load_ahead(self, f0: int, f_size: int, quantized: int) -> None:
        """Begin the load of the panel serving column f0 while the current one stays (it is still being
        read), and quantize its K tiles up to `quantized` (of all K tiles); the get that first asks for f0
        issues the rest. The SBUF of both panels is live meanwhile (the caller's budget must hold two)."""
        kernel_assert(self.can_load_ahead(), "load_ahead needs an MXFP8 [K, F] bf16 source kept whole or one panel "
                      f"at a time, got keep_all={self.keep_all}, capacity={self.capacity}, k_axis={self.op.k_axis}")
        base = self.load_key(f0)
        if base in self.keys:
            return
        if self.pending == None:  # noqa: E711
            width = min(self.load_width, self.hi - base) if self.load_width else f_size
            self._start_ring(False)
            self.pending = PanelLoad(self.op, base, width, self._padded(width), self.setup, ring=self.ring,
                                     placement=self._placement(self._padded(width)),
                                     quantize_columns=self.first_quantize_columns,
                                     slot_dma_k_tiles=self.first_slot_dma_k_tiles,
                                     next_words_from=self._next_words_from())
            self.pending_key, self.first_quantize_columns, self.first_slot_dma_k_tiles = base, 1, 0
            self.first_next_words_from = -1
        kernel_assert(self.pending_key == base, f"load_ahead of column {base} while column {self.pending_key}'s "
                      "load is pending")
        self.pending.advance(quantized - self.pending.next)

    def _load(self, f0: int, f_size: int, block=None, slot: int = 0, preloaded=None) -> Panel:
        if f0 in self.keys:
            return self.panels[self.keys.index(f0)]
        if self.pending != None and self.pending_key == f0:  # noqa: E711  begun by load_ahead
            panel, self.pending, self.pending_key = self.pending.finish(), None, -1
            if not self.keep_all and len(self.keys) >= self.capacity:
                self.release()
            return self._keep(f0, f_size, panel, False)
        if not self.keep_all and len(self.keys) >= self.capacity:
            self.release()
        natural = self.op.k_axis == 1 and not self.op.prequantized
        self._start_ring(natural)
        f_pad = self._padded(f_size)
        placement = PanelPlacement.per_k_tile() if self.words_per_k_tile else self._placement(f_pad)
        if block == None and self.kept_slots and preloaded == None:  # noqa: E711
            if self.kept_block == None:  # noqa: E711
                self.kept_block = PanelGroupBlock(self.kept_slots, self.op.k_size, f_pad, self.setup)
            block, slot = self.kept_block, len(self.keys)
        if block != None:  # noqa: E711
            words, scales = block.slot(slot, f_pad)
            placement = PanelPlacement.into(words, scales)
        panel = load_panel(self.op, f0, f_size, f_pad, self.setup, ring=self.ring, placement=placement,
                           preloaded=preloaded, quantize_columns=self.first_quantize_columns,
                           slot_dma_k_tiles=self.first_slot_dma_k_tiles,
                           next_words_from=self._next_words_from())
        self.first_quantize_columns, self.first_slot_dma_k_tiles, self.first_next_words_from = 1, 0, -1
        return self._keep(f0, f_size, panel, natural)

    def _keep(self, f0: int, f_size: int, panel: Panel, natural: bool) -> Panel:
        if self.later_staging and self.ring != None and not natural:  # noqa: E711
            self.ring.size = self.later_staging
        if natural and self.ring != None and self.ring.size < NATURAL_BUFFERS:  # noqa: E711
            self.ring.size += 1
        self.keys.append(f0)
        self.panels.append(panel)
        self.loaded += f_size
        if self.loaded >= self.hi - self.lo:
            self.ring, self.loaded = None, 0  # nothing left to load: the next phase's panels take its SBUF
        return panel

    def release(self) -> None:
        """Drop every loaded panel (its SBUF is free once no caller holds it)."""
        self.keys = []
        self.panels = []
        self.kept_block = None  # (keep_all: released only when the plan is)
        if self.loaded == 0:  # nothing left to load (_keep): the words ring goes with the last panel
            self.words_ring = None

    def load_key(self, f0: int) -> int:
        """First column of the load (super-panel) that serves column f0."""
        if not self.load_width:
            return f0
        return self.lo + (f0 - self.lo) // self.load_width * self.load_width

    def get(self, f0: int, f_size: int, block=None, slot: int = 0, preloaded=None) -> Panel:
        """The panel of columns [f0, f0 + f_size) (loaded if needed). block / slot: load it into slot `slot` of a
        PanelGroupBlock (whole panels without load_width; MatmulPlan's contiguous K-streamed groups). preloaded:
        row tiles already DMAed (load_panel; MatmulPlan.prefetch_own)."""
        kernel_assert(block == None or not self.load_width,  # noqa: E711
                      f"PanelSource.get: a group block takes whole panels, got load_width={self.load_width}")
        if not self.load_width:
            return self._load(f0, f_size, block, slot, preloaded)
        base = self.lo + (f0 - self.lo) // self.load_width * self.load_width
        whole = self._load(base, min(self.load_width, self.hi - base))
        return panel_columns(whole, f0 - base, self._padded(f_size))


class ResidentPanels(nl.NKIObject):
    """Stationary panels built on chip by an earlier phase for rows [lo, hi) in tiles of m_tile rows:
    panels[j] is the Panel of rows [lo + j*m_tile, lo + (j+1)*m_tile) (a PanelSource-like `get`)."""

    resident = True

    def __init__(self, lo: int, hi: int, m_tile: int, panels: list):
        self.lo = lo
        self.hi = hi
        self.m_tile = m_tile
        self.panels = panels

    def get(self, f0: int, f_size: int) -> Panel:
        j = (f0 - self.lo) // self.m_tile
        if hasattr(self.panels[j], "deferred"):  # a DeferredRowPanel (row_panels.py): quantized at its first read
            self.panels[j] = self.panels[j].panel()
        return self.panels[j]

    def release(self) -> None:
        self.panels.clear()  # in place: the phase that built them holds the same list


def blocks(lo: int, hi: int, size: int):
    """[(start, length)] covering [lo, hi) in blocks of `size` (the last may be shorter)."""
    return [(b, min(size, hi - b)) for b in range(lo, hi, size)]


def tile_order(m_blocks, n_blocks, m_outer: bool, m_group: int = 0, lead: int = 1):
    """Output tiles in the order that reuses the cached operand: m-major when moving panels are all
    resident (each stationary panel loaded once), else n-major (each moving panel loaded once).
    m_group > 0 (n-major only): n-major inside consecutive groups of m_group m blocks, so a group of
    stationary panels stays resident while the moving panels are swept once per group.
    lead > 1 (m-major only): the first `lead` m blocks (one stationary load) run n-major, so the first moving
    panel serves them while the next ones are loaded and quantized for the first time."""
    if m_outer:
        return ([(m, n) for n in n_blocks for m in m_blocks[:lead]] +
                [(m, n) for m in m_blocks[lead:] for n in n_blocks])
    group = m_group or len(m_blocks)
    return [(m, n) for g in range(0, len(m_blocks), group) for n in n_blocks for m in m_blocks[g:g + group]]


def tile_spans(order, lo: int, hi: int, switch_span: int, first: int = 0):
    """[(i, span)] covering tiles [lo, hi) of `order` (tile_order's): span > 1 for the first `switch_span` tiles of an
    n block whose moving panel is new (not the plan's first tile, whose panels load cold), and for the plan's first
    `first` tiles when first > 1 (MatmulPlan first_span: no tile before them holds an accumulator they must leave);
    MatmulPlan interleave_switch runs their matmuls K tile by K tile in turn. 1 elsewhere."""
    spans, nxt = [], lo
    for j in range(lo, hi):
        if j < nxt:
            continue
        span, n0 = 1, order[j][1][0]
        width = 1
        if j == 0:
            width = first
        elif order[j - 1][1][0] != n0:
            width = switch_span
        for d in range(1, width):
            if span == d and j + d < hi and order[j + d][1][0] == n0:
                span += 1
        spans.append((j, span))
        nxt = j + span
    return spans
