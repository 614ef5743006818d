"""Operand panels of the shared matmul layer: HBM operand -> SBUF panel (quantized on-chip along K for
MXFP8, or plain bf16) -> accumulating matmuls into a PSUM tile. plan.py tiles whole matmuls with these.

MXFP8 K tiles (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.quantize_mx.html,
https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.nc_matmul_mx.html): a K tile of
up to 512 logical rows lives on P = T/4 partitions with 4 values per x4 word. The logical index of
(partition p, slot j) is
    "1x32":  k = 4p + j        (groups of 8 partitions x 4 slots = 32 consecutive k: OCP-contiguous)
    "wrapX": k = p + P*j       (groups strided by P inside the tile)
so quantize_mx's hardware group (8 partitions x 4 free) is exactly the scheme's group. K is padded
with zeros to a multiple of 128 (quantize_mx needs 32, 64, 96 or 128 partitions); zero padding adds
nothing to the sums and, inside a group with data, does not change its amax.

Layouts (how a bf16 operand reaches quantize_mx's [P, F, 4] source):
    k_axis=0 ([K, F] in HBM, F contiguous): DMA straight into stage [P, 4, F] (F-long runs);
        quantize_mx reads it through the permuted view [P, F, 4].
    k_axis=1 ([F, K] in HBM, K contiguous): DMA 128 rows as stored, NATURAL_LOAD_K columns at a time
        (4 KiB runs), transpose each slot's column set on the PE array into PSUM, copy to stage
        [P, F, 4] on ScalarE. (Interleaving by DMA alone would move 8-byte runs, far below DMA
        efficiency: the cost model showed phases 1-2 DMA-bound that way.) panel_from_rows does the
        same for rows already in SBUF (e.g. the MLP backward's d_gate_up rows become phase 2's stationary).

Traced-code idioms (NKI 0.3+ compiler; the kernel must trace on 2.32 as well as 2.33): no `is` / `is not`
(`==` / `!=` instead,
https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/migration/nki-0-3-0-update-guide.html),
dictionaries only with string keys and classes derived from NKIObject alone
(https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/get-started/nki-language-guide.html): panels are
kept in lists indexed by position, never in int-keyed dicts.
"""
from __future__ import annotations

import nki.isa as nisa
import nki.language as nl

from ..kernel_helpers import kernel_assert, round_up
from .constants import (BF16_K_TILE, MX_K_ALIGN, MX_K_TILE, MX_PACK, NATURAL_LOAD_K, PARTITIONS,
                        PLACEMENT_PER_K_TILE, SCALE_PACK_SLOTS, SCALE_PACK_STRIDE, STAGING_BUFFERS)
from .descriptor import MatmulSetup
from .panel_builder import Panel, PanelBuilder, PanelPlacement


class LoadRing(nl.NKIObject):
    """Up to `size` SBUF bf16 tiles that successive loads take in turn, least recently used first: a load
    into a taken tile waits for the instructions that read its previous contents, which bounds how far an
    operand's loads run ahead of their consumers (PanelSource shares one across its loads, see there).
    `size` may grow between loads (a new tile is taken before any old one). `tiles`: SBUF tiles the ring starts with
    (oldest first; e.g. another phase's ring, idle while this one's loads run), taken before any new one."""

    def __init__(self, size: int, tiles=None):
        self.size = size
        self.tiles = [] if tiles == None else list(tiles)  # noqa: E711  (oldest first)

    def take(self, shape):
        """The next tile, viewed as `shape` (a shape larger than the ring's tiles starts a new ring)."""
        if len(self.tiles) > 0:
            larger = False
            for d in range(len(shape)):
                larger = larger or shape[d] > self.tiles[0].shape[d]
            if larger:
                self.tiles = []
        if len(self.tiles) < self.size:
            tile = nl.ndarray(shape, dtype=nl.bfloat16, buffer=nl.sbuf)
        else:
            # the least recently used of the newest `size` tiles (a ring that shrank drops its oldest ones)
            first = len(self.tiles) - self.size
            tile = self.tiles[first]
            self.tiles = self.tiles[first + 1:]
        self.tiles = self.tiles + [tile]
        if len(shape) == 2:
            return tile[:, :shape[1]]
        return tile[:, :, :shape[2]]


def k_tiles(k_size: int, setup: MatmulSetup):
    """[(k0, valid, padded)] K tiles: MXFP8 tiles of 512 over K padded to 128; bf16 tiles of 128."""
    if setup.is_mx:
        kp = round_up(k_size, MX_K_ALIGN)
        return [(k0, min(MX_K_TILE, k_size - k0), min(MX_K_TILE, kp - k0)) for k0 in range(0, kp, MX_K_TILE)]
    return [(k0, min(BF16_K_TILE, k_size - k0), min(BF16_K_TILE, k_size - k0)) for k0 in range(0, k_size, BF16_K_TILE)]


def _slot_geometry(scheme: str, partitions: int):
    """(partition step, slot step) of logical k = p*step_p + j*step_j inside a tile."""
    return (MX_PACK, 1) if scheme == "1x32" else (1, partitions)


def _rows_in_slot(valid: int, j: int, step_p: int, step_j: int, partitions: int) -> int:
    """How many leading partitions of slot j hold a logical k < valid (always a prefix)."""
    if step_p == MX_PACK:  # 1x32: k = 4p + j
        return max(0, min(partitions, (valid - j + MX_PACK - 1) // MX_PACK))
    return max(0, min(partitions, valid - step_j * j))  # wrapX: k = p + P*j


def _stage_mx_rows(op, k0, valid, padded, f0, f_size, f_pad, setup, stage, per_slot=False):
    """Load a K tile of a [K, F] bf16 operand (k_axis=0) into the interleaved staging tile `stage`
    [128, 4, >= F_pad] bf16; returns quantize_mx's src view [P, F_pad, 4]. per_slot: one DMA per slot
    ([P, F] rows each) instead of one for the whole tile (the same bytes into the same places; MatmulPlan
    cold_staging: the cold start's first K tiles, COLD_SLOT_DMA_K_TILES)."""
    P = padded // MX_PACK
    step_p, step_j = _slot_geometry(setup.scheme, P)
    t = op.tensor
    partial = valid < padded
    row = op.f_total
    if partial or f_size < f_pad:
        nisa.memset(dst=stage[:P, :, :], value=0.0)
    base = (op.k_base + k0) * row + op.f_base + f0
    if not partial and not per_slot:
        src = t.ap(pattern=[[step_p * row, P], [step_j * row, MX_PACK], [1, f_size]], offset=base)
        nisa.dma_copy(dst=stage[:P, :, :f_size], src=src)
    else:
        for j in range(MX_PACK):
            rows = _rows_in_slot(valid, j, step_p, step_j, P)
            if rows:
                src = t.ap(pattern=[[step_p * row, rows], [1, f_size]], offset=base + step_j * j * row)
                nisa.dma_copy(dst=stage[:rows, j, :f_size], src=src)
    return stage[:P, :, :f_pad].permute((0, 2, 1))  # [P, F_pad, 4]: (p, f, j) order for quantize_mx


def _load_rows_natural(op, f0, rows, k_lo, k_hi, k_pad_hi, natural=None):
    """SBUF [rows, k_pad_hi - k_lo] bf16 tile of a K-contiguous operand ([F, K] in HBM): columns
    [k_lo, k_hi) as stored (one DMA, long runs), zero up to k_pad_hi; into `natural` when given."""
    width = k_pad_hi - k_lo
    if natural == None:  # noqa: E711
        natural = nl.ndarray((PARTITIONS, width), dtype=nl.bfloat16, buffer=nl.sbuf)
    if k_hi < k_pad_hi:
        nisa.memset(dst=natural[:rows, k_hi - k_lo:width], value=0.0)
    c, kb = op.f_base + f0, op.k_base
    nisa.dma_copy(dst=natural[:rows, :k_hi - k_lo], src=op.tensor[c:c + rows, kb + k_lo:kb + k_hi])
    return natural


def _load_prequantized(op, k0, padded, f0, f_size, f_pad, words, scale, setup):
    """DMA pre-quantized x4 codes and E8M0 scales of one K tile into the interleaved SBUF layout."""
    P = padded // MX_PACK
    step_p, step_j = _slot_geometry(setup.scheme, P)
    kp = op.k_size
    if f_size < f_pad:
        nisa.memset(dst=words[:P, :], value=0)
        nisa.memset(dst=scale, value=0)
    codes_hbm = op.tensor.view(nl.uint8)  # [F, Kp] bytes in logical k order
    codes_sb = words[:P, :].view(nl.uint8).reshape((P, f_pad, MX_PACK))
    src = codes_hbm.ap(pattern=[[step_p, P], [kp, f_size], [step_j, MX_PACK]],
                       offset=(op.f_base + f0) * kp + k0)
    nisa.dma_copy(dst=codes_sb[:, :f_size, :], src=src)
    groups_row = kp // 32
    for quadrant in range(P // 32):
        # groups 4q..4q+3 of this tile -> scale rows 32q..32q+3 (quadrant layout, quantize_mx page above)
        src = op.scales.ap(pattern=[[1, 4], [groups_row, f_size]],
                           offset=(op.f_base + f0) * groups_row + k0 // 32 + 4 * quadrant)
        nisa.dma_copy(dst=scale[32 * quadrant:32 * quadrant + 4, :f_size], src=src)


def stage_row_block(stage, rows_tile, block: int, f_size: int, setup: MatmulSetup,
                    dge_mode=nisa.dge_mode.unknown) -> None:
    """Rows already in SBUF as one [K, F] operand's K rows: the 128-row block `block` (0..3) of a 512-row
    MXFP8 K tile (rows_tile [128, >= f_size] bf16, row r on partition r) into the K tile's interleaved
    staging tile stage [128, 4, >= f_size] by one SBUF -> SBUF DMA: what _stage_mx_rows loads for the
    same rows from HBM (logical k = 128*block + r, geometry of _slot_geometry), so quantize_mx gives the
    same words and scales.
        "1x32":  k = 4p + j: partitions [32*block, 32*block + 32) take rows 4q + j as slot j (dst [32, 4, F]
                 and src [128, F] pair in row-major order, docs/simulator.md#choice-dma-pairing);
        "wrapX": k = p + 128*j: slot `block` takes the block as it is.
    dge_mode: the DMA's descriptor generation (nki.isa.dge_mode); swdge puts the copy in GpSimd's in-order queue.
    """
    if setup.scheme == "1x32":
        q = PARTITIONS // MX_PACK
        nisa.dma_copy(dst=stage[q * block:q * (block + 1), :, :f_size], src=rows_tile[:PARTITIONS, :f_size],
                      dge_mode=dge_mode)
    else:
        nisa.dma_copy(dst=stage[:PARTITIONS, block, :f_size], src=rows_tile[:PARTITIONS, :f_size], dge_mode=dge_mode)


def panel_scale_row(t: int, setup: MatmulSetup) -> int:
    """First row of K tile t's scales in a panel-layout scale tensor: the scale tile rows its panel
    holds (four K tiles per 128-row tile at offsets 0/4/8/12 with scale packing, else one each)."""
    if setup.use_scale_packing:
        return PARTITIONS * (t // SCALE_PACK_SLOTS) + SCALE_PACK_STRIDE * (t % SCALE_PACK_SLOTS)
    return PARTITIONS * t


def panel_layout_hbm(k_size: int, f_size: int, setup: MatmulSetup, name: str):
    """(words [Kt/4, F] x4, scales [128 * scale tiles, F] uint8) in shared HBM: a [K, F] operand in the panel
    layout (TensorDescriptor.panel_layout), to be written with store_k_tile. Kt = K rounded up to whole MX_K_TILE
    tiles: a last partial K tile (e.g. K = 2880: 320 rows on 96 partitions) keeps a whole tile's rows, so every
    K tile starts at row 128t; read it with TensorDescriptor(k_len=K)."""
    n_k = -(-k_size // MX_K_TILE)
    scale_tiles = -(-n_k // SCALE_PACK_SLOTS) if setup.use_scale_packing else n_k
    words = nl.ndarray((n_k * PARTITIONS, f_size), dtype=setup.x4_dtype, buffer=nl.shared_hbm, name=name)
    scales = nl.ndarray((PARTITIONS * scale_tiles, f_size), dtype=nl.uint8, buffer=nl.shared_hbm,
                        name=name + "_scales")
    return words, scales


def store_k_tile(words, scale, words_hbm, scales_hbm, t: int, setup: MatmulSetup, f0: int = 0) -> None:
    """Store one MXFP8 K tile (words [P, F] x4, P = 128 or a last partial tile's P, a multiple of 32; scale [128, F]
    uint8 as quantize_mx wrote it at partition offset 0: rows 32q + r, q < P/32, r < 4) in the panel layout
    (TensorDescriptor.panel_layout), at columns [f0, f0 + F) of the HBM tensors (default: from column 0, all of
    their F). A partial tile's rows from P on are not written (its matmuls read P partitions)."""
    P, f1 = words.shape[0], f0 + words.shape[1]
    kernel_assert(P % 32 == 0 and P <= PARTITIONS, f"store_k_tile takes whole 32-partition quadrants, got P={P}")
    nisa.dma_copy(dst=words_hbm[PARTITIONS * t:PARTITIONS * t + P, f0:f1], src=words)
    r0 = panel_scale_row(t, setup)
    for q in range(P // 32):
        nisa.dma_copy(dst=scales_hbm[r0 + 32 * q:r0 + 32 * q + 4, f0:f1], src=scale[32 * q:32 * q + 4, :])


def _load_panel_layout(op, f0, f_size, f_pad, setup, builder, t_lo, t_hi):
    """K tiles [t_lo, t_hi) of a panel-layout operand: one DMA for the words of all of them (F-long
    runs of 4-byte words) and one for their scale tiles."""
    count, cols = t_hi - t_lo, op.f_total
    builder.words(t_lo, PARTITIONS)  # allocates the panel's words [128, count, f_pad]
    builder.scale(t_lo)  # and its scale tiles [128, n, f_pad]
    words, scales = builder._data_tile, builder._scale_tile
    if f_size < f_pad:
        nisa.memset(dst=words[:, :, :], value=0)
        nisa.memset(dst=scales[:, :, :], value=0)
    c0, t0 = op.f_base + f0, t_lo + op.k_base // MX_K_TILE  # a K window starts at a whole scale tile (k_window)
    src = op.tensor.ap(pattern=[[cols, PARTITIONS], [PARTITIONS * cols, count], [1, f_size]],
                       offset=PARTITIONS * t0 * cols + c0)
    nisa.dma_copy(dst=words[:, :, :f_size], src=src)
    n_scale = scales.shape[1]
    src = op.scales.ap(pattern=[[cols, PARTITIONS], [PARTITIONS * cols, n_scale], [1, f_size]],
                       offset=panel_scale_row(t0, setup) * cols + c0)
    nisa.dma_copy(dst=scales[:, :, :f_size], src=src)
    tiles = k_tiles(op.k_size, setup)
    for t in range(t_lo, t_hi):  # a last partial K tile: its P partitions (the rows past them were not stored)
        builder.data.append(builder.words(t, tiles[t][2] // MX_PACK))
        builder.scales.append(builder.scale(t))
    return builder.panel()


def _natural_groups(tiles, setup):
    """Consecutive K tiles grouped so one natural-row DMA covers up to NATURAL_LOAD_K columns."""
    per = max(1, NATURAL_LOAD_K // (MX_K_TILE if setup.is_mx else BF16_K_TILE))
    return [list(range(g, min(g + per, len(tiles)))) for g in range(0, len(tiles), per)]


class PanelLoad(nl.NKIObject):
    """The MXFP8 panel of a [K, F] bf16 operand (k_axis=0) for K tiles [t_lo, t_hi), loaded in steps: advance(count)
    issues the next `count` K tiles' quantizes, finish() the rest and returns the Panel. load_panel runs it in one
    go; PanelSource.load_ahead advances it a few K tiles at a time (MatmulPlan's interleave_first_loads: the first
    tile's stationary and moving panels, one K tile of each in turn).

    Each K tile is DMAed into a ring of staging tiles (`ring`, default a fresh STAGING_BUFFERS ring), issued up to
    STAGING_BUFFERS K tiles ahead of its quantize. The ring is placed before the panel's words, so it frees one
    contiguous block when the panel is done (no staging-sized holes between the words: next-fit placement). A
    caller's ring (PanelSource: one per operand) is shared by its successive loads, so a load's DMAs wait for the
    quantizes of the previous load's K tiles instead of every load of a phase start sharing the DMA bandwidth at
    once. The instructions do not depend on how the steps are cut: the same DMAs and quantizes in the same order.
    slot_dma_k_tiles: the first this many K tiles of the load are staged by one DMA per slot (_stage_mx_rows).
    next_words_from: the K tiles from this one on (counted from t_lo; -1: none), but the last, quantize half of their
    columns from a unit-stride copy in the next K tile's words (PanelBuilder.quantize_mx_tile; MatmulPlan cold_staging:
    0, COLD_PERMUTE_INTO_NEXT_WORDS; a fenced start's first panel: FENCED_NEXT_WORDS_FROM_K_TILE).
    """

    def __init__(self, op, f0, f_size, f_pad, setup, t_lo=0, t_hi=-1, ring=None, placement=None, builder=None,
                 staged=None, quantize_columns=1, slot_dma_k_tiles=0, next_words_from=-1):
        self.tiles = k_tiles(op.k_size, setup)
        t_hi = len(self.tiles) if t_hi < 0 else t_hi
        if builder == None:  # noqa: E711  (load_panel passes its own)
            builder = PanelBuilder(f_pad, setup, t_lo, t_hi - t_lo, placement, quantize_columns)
        self.op, self.f0, self.f_size, self.f_pad, self.setup = op, f0, f_size, f_pad, setup
        self.builder, self.t_lo, self.t_hi = builder, t_lo, t_hi
        self.ring = ring if ring != None else LoadRing(STAGING_BUFFERS)  # noqa: E711
        self.staged = [None] * (t_hi - t_lo)  # staged[t - t_lo]: quantize_mx's source view of K tile t
        self.ahead = min(STAGING_BUFFERS, self.ring.size)  # a smaller ring: a stage is not retaken before its quantize
        self.next = t_lo  # the next K tile to quantize
        self.slot_dma_k_tiles = slot_dma_k_tiles
        self.next_words_from = next_words_from
        given = [] if staged == None else staged  # noqa: E711
        kernel_assert(len(given) <= min(t_hi - t_lo, self.ahead),
                      f"{len(given)} K tiles staged ahead, more than the {min(t_hi - t_lo, self.ahead)} staged at once")
        for t in range(len(given)):
            self.staged[t] = given[t]
        for t in range(t_lo + len(given), min(t_hi, t_lo + self.ahead)):
            self._stage(t)

    def _stage(self, t) -> None:
        k0, valid, padded = self.tiles[t]
        stage = self.ring.take((PARTITIONS, MX_PACK, self.f_pad))
        self.staged[t - self.t_lo] = _stage_mx_rows(self.op, k0, valid, padded, self.f0, self.f_size, self.f_pad,
                                                    self.setup, stage,
                                                    per_slot=t - self.t_lo < self.slot_dma_k_tiles)

    def remaining(self) -> int:
        """K tiles not quantized yet."""
        return self.t_hi - self.next

    def advance(self, count: int) -> None:
        """Quantize the next `count` K tiles (fewer when fewer remain), staging the ones `ahead` of them."""
        for _ in range(min(count, self.remaining())):
            t = self.next
            src, self.staged[t - self.t_lo] = self.staged[t - self.t_lo], None
            self.builder.add_mx(t, self.tiles[t][2], src, 0 <= self.next_words_from <= t - self.t_lo)
            src = None
            if t + self.ahead < self.t_hi:
                self._stage(t + self.ahead)
            self.next = t + 1

    def finish(self) -> Panel:
        self.advance(self.remaining())
        return self.builder.panel()


def stage_ahead(op, f0: int, f_size: int, f_pad: int, setup: MatmulSetup, stages) -> list:
    """The DMAs of the first len(stages) K tiles of a later load_panel(op, f0, f_size, f_pad, setup,
    ring=LoadRing(size, stages), staged=<this list>) of a [K, F] bf16 operand (MXFP8), issued now into `stages`
    (SBUF [128, 4, >= f_pad] bf16 tiles the caller allocated, so that a load issued in any of several run-time
    branches fills the same tiles). That ring holds them as taken, oldest first: the load's further K tiles take new
    tiles up to its size, then these, as if it had staged them itself. The same DMAs into the same staging layout,
    earlier in program order: no bit changes.

    Dimensions: op [K, F] in HBM -> len(stages) staging views (quantize_mx's sources) of K tiles 0, 1, ...
    """
    tiles = k_tiles(op.k_size, setup)
    kernel_assert(setup.is_mx and op.k_axis == 0 and not op.prequantized and len(stages) <= len(tiles),
                  f"stage_ahead stages at most the {len(tiles)} K tiles of a [K, F] bf16 operand for MXFP8, got "
                  f"{len(stages)} tiles, k_axis={op.k_axis}, prequantized={op.prequantized}, is_mx={setup.is_mx}")
    views = []
    for (k0, valid, padded), stage in zip(tiles, stages):
        views.append(_stage_mx_rows(op, k0, valid, padded, f0, f_size, f_pad, setup, stage[:, :, :f_pad]))
    return views


def load_panel(op, f0: int, f_size: int, f_pad: int, setup: MatmulSetup, t_lo: int = 0, t_hi: int = -1,
               ring=None, placement=None, preloaded=None, into=None, staged=None, quantize_columns=1,
               slot_dma_k_tiles=0, next_words_from=-1) -> Panel:
    """Bring F columns [f0, f0+f_size) of an operand into SBUF for K tiles [t_lo, t_hi) (default: all;
    padded to f_pad).

    Dimensions:
        op: [K, F] or [F, K] in HBM (TensorDescriptor); result: K tiles of [P, f_pad] (data[0] is t_lo).
    K-contiguous bf16 operands are read as stored, NATURAL_LOAD_K columns of 128 rows per DMA (long
    runs), and transposed on the PE array (whole panels only). A K-tile range must start at a multiple
    of SCALE_PACK_SLOTS (scale tiles are shared by aligned K-tile quads).
    ring: a LoadRing for the MXFP8 staging tiles ([K, F] operands) or the natural row tiles (K-contiguous
    bf16 operands), shared with the caller's other loads (default: a fresh STAGING_BUFFERS ring for this
    load's staging tiles; fresh natural tiles).
    placement: where the MXFP8 K tiles' words and scales go (PanelPlacement, default whole(): one allocation of
    each for the panel). per_k_tile() is not for panel-layout operands (all their K tiles' words load in one DMA);
    pieces(): MatmulPlan's panels; into(words [128, t_hi - t_lo, f_pad], scales [128, scale tiles, f_pad]): a
    caller's allocation (PanelGroupBlock: a K-streamed group's panels in one block; MXFP8 only).
    preloaded: [(natural group index, row tile)] of a K-contiguous operand whose rows preload_natural_rows already
    DMAed (MatmulPlan.prefetch_own): those groups are transposed and quantized first, the rest in K order. Every K
    tile is quantized on its own into its own words and scale rows, so the order changes no bit.
    into: a PanelSlots (row_panels.py) allocated earlier for the whole panel (its placement instead of `placement`):
    the K tiles are written there, so a load issued inside a run-time loop (an expert's 0/1-trip "if") leaves a
    panel that is read after it (PanelSlots.panel).
    staged: the first K tiles' staging views from stage_ahead (its DMAs issued earlier into `ring`'s tiles; MXFP8
    [K, F] bf16 operands from K tile 0); None: every K tile staged here.
    quantize_columns: each K tile quantized on chip in that many equal column pieces (PanelBuilder; default 1).
    slot_dma_k_tiles: the first this many K tiles of a [K, F] bf16 operand (MXFP8) staged by one DMA per slot
    (PanelLoad; default 0).
    next_words_from: a [K, F] bf16 operand's K tiles (MXFP8) from this one on, but the last, quantize half of their
    columns from a unit-stride copy in the next K tile's words (PanelLoad; default -1: none).
    """
    tiles = k_tiles(op.k_size, setup)
    t_hi = len(tiles) if t_hi < 0 else t_hi
    kernel_assert(staged == None or (t_lo == 0 and setup.is_mx and op.k_axis == 0  # noqa: E711
                                     and not op.prequantized and not op.panel_layout and ring != None),  # noqa: E711
                  f"load_panel staged= takes stage_ahead's K tiles of a [K, F] bf16 operand (MXFP8) from K tile 0 "
                  f"with its ring, got t_lo={t_lo}, k_axis={op.k_axis}, prequantized={op.prequantized}, "
                  f"panel_layout={op.panel_layout}, ring={ring}")
    if into != None:  # noqa: E711
        kernel_assert(t_lo == 0 and t_hi == len(tiles) and not op.panel_layout,
                      f"load_panel into= takes a whole panel of a bf16 or per-K-tile operand, got K tiles [{t_lo}, "
                      f"{t_hi}) of {len(tiles)}, panel_layout={op.panel_layout}")
        builder = into.builder(len(tiles), f_pad)
    else:
        builder = PanelBuilder(f_pad, setup, t_lo, t_hi - t_lo, placement, quantize_columns)
    kernel_assert(not (builder.placement.kind == PLACEMENT_PER_K_TILE and op.panel_layout),
                  "load_panel: PanelPlacement.per_k_tile() needs a bf16 or per-K-tile operand, got a panel-layout "
                  "operand (its K tiles load in one DMA into one allocation)")
    if op.panel_layout:
        return _load_panel_layout(op, f0, f_size, f_pad, setup, builder, t_lo, t_hi)
    if op.k_axis == 1 and not op.prequantized:
        kernel_assert((t_lo, t_hi) == (0, len(tiles)),
                      f"K-contiguous bf16 operands load whole panels, got K tiles [{t_lo}, {t_hi}) of {len(tiles)}")
        if ring != None:  # noqa: E711  a group's chunks are all read by its transposes: one tile each
            ring.size = max(ring.size, -(-f_size // PARTITIONS))
        groups = _natural_groups(tiles, setup)
        preloaded = preloaded or []
        kernel_assert(not preloaded or f_size <= PARTITIONS,
                      f"load_panel: preloaded row tiles hold one chunk of 128 rows, got f_size={f_size}")
        early = [gi for gi, _ in preloaded]
        built = []  # K tiles in the order they are built (the Panel lists them in K order)
        for gi in early + [g for g in range(len(groups)) if g not in early]:
            group = groups[gi]
            k_lo = tiles[group[0]][0]
            k_last, valid_last, padded_last = tiles[group[-1]]
            chunks = []
            for c0 in range(0, f_size, PARTITIONS):
                rows = min(PARTITIONS, f_size - c0)
                if gi in early:
                    natural = preloaded[early.index(gi)][1]
                else:
                    dst = None
                    if ring != None:  # noqa: E711
                        dst = ring.take((PARTITIONS, k_last + padded_last - k_lo))
                    natural = _load_rows_natural(op, f0 + c0, rows, k_lo, k_last + valid_last, k_last + padded_last,
                                                 dst)
                chunks.append((c0, rows, natural, k_lo))
            for t in group:
                builder.add_natural(t, tiles[t], chunks, f_size)
                built.append(t)
        if early:
            builder.data = [builder.data[built.index(t)] for t in range(len(tiles))]
            builder.scales = [builder.scales[built.index(t)] for t in range(len(tiles))]
        return builder.panel()
    if setup.is_mx and not op.prequantized:
        # [K, F] operand: DMA into a ring of staging tiles, quantize K tile by K tile (PanelLoad)
        return PanelLoad(op, f0, f_size, f_pad, setup, t_lo, t_hi, ring, builder=builder, staged=staged,
                         slot_dma_k_tiles=slot_dma_k_tiles, next_words_from=next_words_from).finish()
    for t in range(t_lo, t_hi):
        k0, valid, padded = tiles[t]
        if setup.is_mx:
            if op.prequantized:
                P = padded // MX_PACK
                words = builder.words(t, P)
                scale = builder.scale(t)
                _load_prequantized(op, k0, padded, f0, f_size, f_pad, words, scale, setup)
                builder.data.append(words)
                builder.scales.append(scale)
        else:
            tile = builder.bf16_tile(t)
            if f_size < f_pad:
                nisa.memset(dst=tile[:valid, :], value=0.0)
            c0, r0 = op.f_base + f0, op.k_base + k0
            nisa.dma_copy(dst=tile[:valid, :f_size], src=op.tensor[r0:r0 + valid, c0:c0 + f_size])
            builder.data.append(tile[:valid, :])
            builder.scales.append(None)
    return builder.panel()


def single_k_tile(panel: Panel, t: int) -> Panel:
    """K tile t of a panel as a one-tile Panel (a fold that adds each K tile's product separately)."""
    return Panel([panel.data[t]], [panel.scales[t]], panel.f_pad)


def matmul_panels(dst, stationary: Panel, moving: Panel, setup: MatmulSetup, t_lo: int = 0, t_hi: int = -1,
                  accumulate: bool = False) -> None:
    """dst [M, N] (PSUM, fp32) = sum over K tiles of stationary[K, M]^T @ moving[K, N].

    t_lo/t_hi: only K tiles [t_lo, t_hi) (default: all), moving holding exactly those tiles (a K-streamed
    slice from load_panel); tile 0 starts the accumulation, so calls in K order sum like one call.
    accumulate: tile 0 adds to dst too (dst += ...: a sum continued from earlier calls, e.g. across the
    blocks of a run-time loop).
    """
    t_hi = len(stationary.data) if t_hi < 0 else t_hi
    for t in range(t_lo, t_hi):
        b = t - t_lo
        if setup.is_mx:
            # K=4*P (<=512) logical, M=stationary f_pad (<=128), N=moving f_pad (<=4096)
            nisa.nc_matmul_mx(dst=dst, stationary=stationary.data[t], moving=moving.data[b],
                              stationary_scale=stationary.scales[t], moving_scale=moving.scales[b],
                              accumulate=accumulate or t > 0)
        else:
            # K=T (<=128), M=stationary f_pad (<=128), N=moving f_pad (<=512)
            nisa.nc_matmul(dst=dst, stationary=stationary.data[t], moving=moving.data[b],
                           accumulate=accumulate or t > 0)


def panel_columns(panel: Panel, off: int, width: int) -> Panel:
    """Columns [off, off + width) of a panel (every K tile, scales alike) as a Panel: one wide load
    (long DMA runs, one quantize per K tile) served as narrower stationary/moving operands."""
    scales = [None if sc == None else sc[:, off:off + width] for sc in panel.scales]  # noqa: E711
    return Panel([d[:, off:off + width] for d in panel.data], scales, width)


def panel_bytes_per_partition(k_size: int, f_pad: int, setup: MatmulSetup) -> int:
    """SBUF bytes per partition that a [K, f_pad] panel occupies (data words + scale tiles)."""
    n = len(k_tiles(k_size, setup))
    if not setup.is_mx:
        return n * f_pad * 2
    scale_tiles = -(-n // SCALE_PACK_SLOTS) if setup.use_scale_packing else n
    return n * f_pad * 4 + scale_tiles * f_pad


class PanelGroupBlock(nl.NKIObject):
    """One SBUF allocation for the MXFP8 words (and one for the scales) of `count` whole panels of equal shape
    [K, f_pad]: a K-streamed group's stationary panels (MatmulPlan(contiguous_group=True)). Each panel is a slot
    (`slot(i, f_pad)`, load_panel's PanelPlacement.into). Separate panel allocations, placed next-fit one by one
    among the group's transient natural row and staging tiles, find no gap and wait for tiles of the previous group
    (TP1's phase 2: each group start); one block is placed once, where the previous group's block was.

    Dimensions:
        words [128, count, K tiles, f_pad] x4; scales [128, count, scale tiles, f_pad] uint8.
    """

    def __init__(self, count: int, k_size: int, f_pad: int, setup: MatmulSetup):
        kernel_assert(setup.is_mx, "PanelGroupBlock holds MXFP8 panels, got a BF16 setup")
        n = len(k_tiles(k_size, setup))
        scale_tiles = -(-n // SCALE_PACK_SLOTS) if setup.use_scale_packing else n
        self.count = count
        self.words = nl.ndarray((PARTITIONS, count, n, f_pad), dtype=setup.x4_dtype, buffer=nl.sbuf)
        self.scales = nl.ndarray((PARTITIONS, count, scale_tiles, f_pad), dtype=nl.uint8, buffer=nl.sbuf)

    def slot(self, i: int, f_pad: int):
        """(words, scales) views of panel i, its first f_pad columns (PanelPlacement.into's arguments)."""
        kernel_assert(0 <= i < self.count, f"PanelGroupBlock: slot {i} of {self.count} panels")
        return self.words[:, i, :, :f_pad], self.scales[:, i, :, :f_pad]


class PanelWordsRing(nl.NKIObject):
    """K-tile slots (words and scale rows) that successive MXFP8 panels of a [K, f_pad] operand take in turn, K tile t
    of the panel after a panel in slot t of `ahead` beyond that panel's last K tile's (mod the ring): its first `ahead`
    K tiles never touch the slots of the panel before it, so they can be quantized while that panel is read, and its
    later ones wait only for that panel's K tile t - ahead (PanelSource.switch_ahead_slots: MatmulPlan
    interleave_switch with the stationary operand kept whole). The first panel's K tiles take one allocation as a panel
    of their own would; the `ahead` slots are a second one, made when the second panel first takes them (ahead of the
    first switch; round 48a of docs/dense-performance.md).

    Dimensions:
        words [128, K tiles, f_pad] and [128, ahead, f_pad] x4; scales [128, slots / SCALE_PACK_SLOTS, f_pad] uint8 of
        each (with scale packing: a K tile's scale rows at quadrant offset SCALE_PACK_STRIDE x (slot %
        SCALE_PACK_SLOTS), as in a panel of its own, K tiles and `ahead` being multiples of SCALE_PACK_SLOTS), else
        one per slot.
    """

    def __init__(self, k_size: int, f_pad: int, ahead: int, setup: MatmulSetup):
        self.n, self.ahead = len(k_tiles(k_size, setup)), ahead
        self.f_pad, self.setup, self.packing = f_pad, setup, setup.use_scale_packing
        kernel_assert(setup.is_mx and (not self.packing or (ahead % SCALE_PACK_SLOTS == 0 and
                                                            self.n % SCALE_PACK_SLOTS == 0)),
                      f"PanelWordsRing holds MXFP8 panels in whole scale tiles: {self.n} K tiles + {ahead} ahead, "
                      f"scale packing {self.packing}, is_mx {setup.is_mx}")
        self.parts = [self._allocate(self.n)]  # (words, scales) of slots [0, n), then of [n, n + ahead)
        self.next = 0  # slot of the next panel's K tile 0

    def _allocate(self, slots: int):
        scale_tiles = slots // SCALE_PACK_SLOTS if self.packing else slots
        return (nl.ndarray((PARTITIONS, slots, self.f_pad), dtype=self.setup.x4_dtype, buffer=nl.sbuf),
                nl.ndarray((PARTITIONS, scale_tiles, self.f_pad), dtype=nl.uint8, buffer=nl.sbuf))

    def placement(self, f_pad: int) -> PanelPlacement:
        """The next panel's K tiles' slots (PanelPlacement.slots), its first f_pad columns."""
        kernel_assert(f_pad <= self.f_pad, f"a {f_pad}-column panel in a ring of {self.f_pad}-column slots")
        words, scales = [], []
        for t in range(self.n):
            slot = (self.next + t) % (self.n + self.ahead)
            if slot >= self.n and len(self.parts) == 1:
                self.parts.append(self._allocate(self.ahead))
            part_words, part_scales = self.parts[0] if slot < self.n else self.parts[1]
            i = slot if slot < self.n else slot - self.n
            words.append(part_words[:, i, :f_pad])
            if self.packing:
                scales.append(part_scales[SCALE_PACK_STRIDE * (i % SCALE_PACK_SLOTS):, i // SCALE_PACK_SLOTS, :f_pad])
            else:
                scales.append(part_scales[:, i, :f_pad])
        self.next = (self.next + self.n) % (self.n + self.ahead)
        return PanelPlacement.slots(words, scales)
