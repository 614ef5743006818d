"""Pass B of the MoE expert backward kernel (moe_bwd_mxfp8_kernel.py), dX = d_gate_up_b W_gu[e] scatter-added to
token rows, and the expert weight panels that passes A and B stream (ExpertPanels).

Weights of one expert are static inside its run-time block loop. Panels that fit RESIDENT_WEIGHT_BUDGET_BYTES
stay on chip across the loop; larger ones (DeepSeek-V3's W_down in pass A, W_gu in pass B: 112 KiB per
partition quantized) are loaded per block. For an expert with two or more blocks the kernel instead splits
the weight's tiles into resident groups (resident_tile_groups) and runs the block loop once per group, so
the weight is loaded and quantized once per expert and only the block's activation rows are read again per
group (docs/moe.md, section 10, round 3); where pass B builds the chunks' d_gate_up panels from those rows, the first
group stores them and the later ones load them (ChunkPanels, round 22c). In an expert's last block, pass B skips the
work of 128-row chunks that hold only padding (compute_phase2_hidden_states_grad_mxfp8).
"""
from __future__ import annotations

import nki.isa as nisa
import nki.language as nl

from ...core.kernel_helpers import ceil_div, kernel_assert
from ...core.matmul import (Panel, PanelPlacement, PanelSlots, k_tiles, load_panel, load_panel_tiles, matmul_panels,
                            panel_bytes_per_partition, panel_columns, panel_from_rows, panel_tile_widths,
                            stage_ahead, store_panel_tiles)
from ...core.matmul.constants import MX_PACK, SCALE_PACK_SLOTS
from ...core.matmul.panels import LoadRing
from ...core.matmul.sources import blocks as _blocks
from .constants import (MOE_N_TILE, PARTITIONS, RESIDENT_WEIGHT_BUDGET_BYTES, RING_WEIGHT_DMA_PER_SLOT,
                        W_GU_K_TILES_AHEAD, WEIGHT_LOAD_WIDTH, WIDE_WEIGHT_LOAD_WIDTH, WIDE_WEIGHT_PANEL_BYTES,
                        WIDE_WEIGHT_STAGING_BUFFERS)

__all__ = ["ChunkPanels", "DGateUpRowsAhead", "ExpertPanels", "compute_phase2_hidden_states_grad_mxfp8",
           "resident_tile_groups"]


def _ring_slot_dmas(op, ring, setup) -> int:
    """K tiles of `op` that load_panel stages by one DMA per MX slot (slot_dma_k_tiles): all of them when they pass
    through a caller's ring (pass C's: pass B's W_gu, pass A's W_down) and RING_WEIGHT_DMA_PER_SLOT, else none.
    Why: at B's start and at the fence those few ring loads shared the DMA engines with many larger transfers and
    paced the load -> quantize_mx chain (docs/moe.md section 10, round 30c)."""
    if ring == None or not RING_WEIGHT_DMA_PER_SLOT or not setup.is_mx:  # noqa: E711
        return 0
    return len(k_tiles(op.k_size, setup))


class ExpertPanels(nl.NKIObject):
    """One expert's weight panels (moving operands: F tiles of a static descriptor), resident across the
    expert's block loop when they fit RESIDENT_WEIGHT_BUDGET_BYTES, else loaded on use inside the loop.

    A [K, F] operand (k_axis=0, F contiguous in HBM) loads in super-panels of WEIGHT_LOAD_WIDTH columns
    (2 KiB DMA runs instead of a 512-column tile's 1 KiB), or, loaded on use, of WIDE_WEIGHT_LOAD_WIDTH (4 KiB
    runs) where such a panel fits WIDE_WEIGHT_PANEL_BYTES (load_width), served as column slices; on use, the current
    super-panel serves consecutive tiles. start_block() forgets it at the top of each loop body: the body is
    traced once on hardware, so each iteration must load what it uses (no Python state across iterations).
    Each MXFP8 K tile of a panel is its own SBUF allocation (PanelPlacement.per_k_tile(): 4 KiB per partition for 1024
    columns, not one 56 KiB tile for DeepSeek-V3's 14 K tiles of W_down), so a panel never needs one wide gap
    among the kernel's many small, differently-lived tiles (docs/moe.md section 10, round 6a).
    ring: a LoadRing that the resident panels' loads share for their MXFP8 staging tiles (pass B: pass C's kernel-scope
    ring, round 9a); None: a fresh ring per super-panel. A given ring's K tiles are staged by one DMA per MX slot
    (_ring_slot_dmas: RING_WEIGHT_DMA_PER_SLOT, round 30c).
    panels: the resident super-panels, loaded earlier by the caller (one Panel per super_panels load: the I split's
    W_down loaded a pass ahead, ExpertISplit.prefetch_down); None: loaded here when they fit.
    """

    def __init__(self, op, tiles, setup, ring=None, panels=None):
        self.op, self.tiles, self.setup = op, tiles, setup
        self.resident = panels != None or self.fits(op, tiles, setup)  # noqa: E711
        width = self.load_width(op, setup, wide=not self.resident)
        self.loads, self.load_of = self.super_panels(op, tiles, width)
        if panels != None:  # noqa: E711
            kernel_assert(len(panels) == len(self.loads),
                          f"{len(panels)} preloaded panels for {len(self.loads)} super-panel loads")
            self.panels = panels
        else:
            self.panels = [self._load(f0, w, ring, resident_ring=True) for f0, w in self.loads] if self.resident else []
        self.current = -1
        self.ring = LoadRing(WIDE_WEIGHT_STAGING_BUFFERS)  # renewed by start_block (its tiles: on first use)
        self.staged = None  # the first super-panel's K tiles staged ahead (start_block)

    @staticmethod
    def load_width(op, setup, wide=False):
        """Columns per super-panel load of a [K, F] bf16 operand: WEIGHT_LOAD_WIDTH, or with `wide` (panels loaded on
        use, one at a time) WIDE_WEIGHT_LOAD_WIDTH when its panel of that width fits WIDE_WEIGHT_PANEL_BYTES per
        partition (4 KiB DMA runs: DeepSeek-V3's W_gu in pass B); 0 (one load per tile) for other operands."""
        if op.k_axis != 0 or (op.prequantized and not op.panel_layout):
            return 0
        if wide and panel_bytes_per_partition(op.k_size, WIDE_WEIGHT_LOAD_WIDTH, setup) <= WIDE_WEIGHT_PANEL_BYTES:
            return WIDE_WEIGHT_LOAD_WIDTH
        return WEIGHT_LOAD_WIDTH

    @staticmethod
    def super_panels(op, tiles, width):
        """([(f0, width)] super-panel loads of `width` columns (0: one per tile), [index of the load serving each
        tile]); tiles are MOE_N_TILE-aligned from tiles[0]."""
        loads, load_of = [], []
        for n0, nsz in tiles:
            if not loads or n0 + nsz > loads[-1][0] + loads[-1][1]:
                end = tiles[-1][0] + tiles[-1][1]
                loads.append((n0, min(width, end - n0) if width else nsz))
            load_of.append(len(loads) - 1)
        return loads, load_of

    @staticmethod
    def bytes_of(ops, tiles, setup):
        """SBUF bytes per partition of the resident panels of `tiles` of every operand in `ops`."""
        total = 0
        for op in ops:
            loads, _ = ExpertPanels.super_panels(op, tiles, ExpertPanels.load_width(op, setup))
            total += sum(panel_bytes_per_partition(op.k_size, w, setup) for _, w in loads)
        return total

    @staticmethod
    def fits(op, tiles, setup):
        """Whether the panels of `tiles` stay resident (RESIDENT_WEIGHT_BUDGET_BYTES per partition)."""
        return ExpertPanels.bytes_of([op], tiles, setup) <= RESIDENT_WEIGHT_BUDGET_BYTES

    @staticmethod
    def loaded_if(ops, tiles, setup, run_if, ring=None):
        """Resident ExpertPanels of every operand in `ops`, loaded inside run_if, their tiles allocated outside it.

        The loads run inside run_if(body) (a run-time 0/1-trip loop: the expert's if_used, so an expert without blocks
        loads nothing); the panels' tiles are allocated here, outside that loop (PanelSlots, one per super-panel), so
        they stay live past it for the pass that reads them. The same loads and quantizes into the same per-K-tile
        layout as the resident panels ExpertPanels loads itself, so the bits are the same.

        Args:
            ops: static TensorDescriptors of one expert's weights (None: no such operand), each within
                RESIDENT_WEIGHT_BUDGET_BYTES (fits; asserted).
            tiles: the F tiles [(f0, width)] the panels serve, as ExpertPanels takes them.
            setup: the MatmulSetup (MXFP8: loaded and quantized on chip).
            run_if: run_if(body) traces body under the run-time condition of the expert having blocks.
            ring: a LoadRing for the staging tiles (pass C's kernel-scope ring, so that they are not placed over
                the tiles of the pass before: round 26b; each K tile by one DMA per MX slot: _ring_slot_dmas);
                None: load_panel's own.

        Returns:
            [ExpertPanels or None], one per operand of `ops`.

        Dimensions:
            an operand [K, F] (W_down [H, I] for pass A): PanelSlots per super-panel of F columns, per K tile.
        """
        slots = []
        for op in ops:
            if op == None:  # noqa: E711
                slots.append(None)
                continue
            # (the operand's layout is load_panel(into=)'s check, in the matmul layer)
            kernel_assert(ExpertPanels.fits(op, tiles, setup),
                          f"loaded_if takes resident operands, got {ExpertPanels.bytes_of([op], tiles, setup)} bytes "
                          f"per partition of RESIDENT_WEIGHT_BUDGET_BYTES = {RESIDENT_WEIGHT_BUDGET_BYTES}")
            loads, _ = ExpertPanels.super_panels(op, tiles, ExpertPanels.load_width(op, setup))
            count = len(k_tiles(op.k_size, setup))
            slots.append([(f0, w, PanelSlots(count, w, setup, PanelPlacement.per_k_tile())) for f0, w in loads])

        def load_all():
            for op, panels in zip(ops, slots):
                for f0, w, into in panels if panels != None else []:  # noqa: E711
                    load_panel(op, f0, w, w, setup, ring=ring, into=into,
                               slot_dma_k_tiles=_ring_slot_dmas(op, ring, setup))

        run_if(load_all)
        return [None if op == None else  # noqa: E711
                ExpertPanels(op, tiles, setup, panels=[into.panel(op.k_size) for _, _, into in panels])
                for op, panels in zip(ops, slots)]

    def _load(self, f0, w, ring=None, staged=None, resident_ring=False):
        """Panel of columns [f0, f0 + w): quantized on chip (split per K tile), or, for a panel-layout operand (words
        and scales quantized earlier: DownWeightExchange), loaded as they are, one DMA pair per scale tile's
        SCALE_PACK_SLOTS K tiles (not one allocation for the panel: round 6a), joined into one Panel. resident_ring: a
        resident panel's load (through `ring` when given: its K tiles by one DMA per MX slot, _ring_slot_dmas); the
        on-use wide loads' block ring keeps one DMA per K tile."""
        if not self.op.panel_layout:
            return load_panel(self.op, f0, w, w, self.setup, ring=ring, placement=PanelPlacement.per_k_tile(),
                              staged=staged,
                              slot_dma_k_tiles=_ring_slot_dmas(self.op, ring, self.setup) if resident_ring else 0)
        n = len(k_tiles(self.op.k_size, self.setup))
        data, scales = [], []
        for t in range(0, n, SCALE_PACK_SLOTS):
            part = load_panel(self.op, f0, w, w, self.setup, t_lo=t, t_hi=min(n, t + SCALE_PACK_SLOTS))
            data = data + part.data
            scales = scales + part.scales
        return Panel(data, scales, w)

    def start_block(self, ahead=None):
        """Forget the previous block's on-use panels. ahead: (ring, staged) of the block's first super-panel, its first
        K tiles staged earlier by the caller (stage_ahead into that ring: DGateUpRowsAhead), which its load and the
        block's later wide loads share; None: a fresh ring."""
        if not self.resident:
            self.panels, self.current = [], -1
            # one staging ring for the block's wide super-panels (created per traced body, like the panels)
            self.ring = LoadRing(WIDE_WEIGHT_STAGING_BUFFERS) if ahead == None else ahead[0]  # noqa: E711
            self.staged = None if ahead == None else ahead[1]  # noqa: E711

    def get(self, j):
        s = self.load_of[j]
        if not self.resident and self.current != s:
            f0, w = self.loads[s]
            self.panels, self.current = [], s  # drop the previous super-panel before loading the next
            # wide panels share the block's ring: the next panel's staging reuses the previous panel's tiles instead of
            # new ones beside them (WIDE_WEIGHT_STAGING_BUFFERS says why its size)
            ring = self.ring if w > WEIGHT_LOAD_WIDTH else None
            staged, self.staged = self.staged, None  # (the first load's only)
            kernel_assert(staged == None or (s == 0 and ring != None),  # noqa: E711
                          f"K tiles staged ahead serve the first wide super-panel, got load {s} of width {w}")
            self.panels = [self._load(f0, w, ring, staged)]
        whole = self.panels[s] if self.resident else self.panels[0]
        n0, nsz = self.tiles[j]
        return panel_columns(whole, n0 - self.loads[s][0], nsz)


def resident_tile_groups(tiles, ops, setup, count=0):
    """Consecutive groups of `tiles` (the F tiles [(f0, size)] shared by the operands `ops`, TensorDescriptors)
    in which every operand's panels stay resident (ExpertPanels.fits: the budget is per operand): the fewest
    such groups, of near-equal tile counts (a tile over the budget alone is a group of its own), padded with
    empty groups to `count` (LNC2: both cores run one block loop per group of core 0's share).
    """
    groups = [[t] for t in tiles]
    for n in range(1, len(tiles) + 1):
        size = ceil_div(len(tiles), n)
        candidate = [tiles[g:g + size] for g in range(0, len(tiles), size)]
        if all(ExpertPanels.fits(op, g, setup) for op in ops for g in candidate):
            groups = candidate
            break
    return groups + [[]] * (count - len(groups))


def _d_gate_up_rows(ctx, i, r0, m, nat=None):
    """SBUF [128, Kp] bf16 tile (nat when given) holding rows r0..r0+m of block i of the d_gate_up scratch [N*B, 2I]
    (zero from 2I to the MX K padding Kp): pass B's K=2I stationary rows, as pass A stored them."""
    two_i = 2 * ctx.I
    if nat == None:  # noqa: E711
        nat = nl.ndarray((PARTITIONS, ctx.k_width(two_i)), dtype=nl.bfloat16, buffer=nl.sbuf)
    if nat.shape[1] > two_i:
        nisa.memset(dst=nat[:m, two_i:], value=0.0)
    nisa.dma_copy(dst=nat[:m, :two_i], src=ctx.block_rows(ctx.d_gu, i, r0, m, 1, 0, two_i))
    return nat


class DGateUpRowsAhead(nl.NKIObject):
    """Every 128-row chunk's d_gate_up rows of a one-block expert e, read before B(e) into tiles allocated now (outside
    the run-time loops that read them, so that they live on to B(e)'s one-block path: compute_phase2_hidden_states_
    grad_mxfp8(rows_ahead=self), under e's if_single, the condition read() tests too). Read at B(e)'s start, these
    tiles were placed over the tiles the segment's A(a) had just freed, and each read waited for A(a)'s last access of
    the tile it replaced (its epilogue's stores), leaving the DMA queues idle through A(a)'s epilogue (docs/moe.md
    section 10, rounds 19b and 20a). The caller issues read() once on every run-time path: before A(a) (placed apart
    from A(a)'s tiles, read while A(a) computes) or in A(a)'s epilogue. Race-free: A(e) wrote these rows a fence
    earlier (both cores, each its I columns) and A(a) (a != e) writes only its own blocks' rows.

    With w_gu (W_gu[e]'s descriptor and this core's H tiles, loaded on use in wide super-panels), read() also stages
    the first W_GU_K_TILES_AHEAD K tiles of B(e)'s first W_gu super-panel (stage_ahead) into staging tiles allocated
    now: B(e)'s first wide load (w_gu_ahead) takes them and stages only its later K tiles. Staged at B(e)'s start,
    those DMAs waited for the allocator's reuse of tiles that B's own d_gate_up panel transposes had just read; the
    caller stages them in A(a)'s last epilogue, where the DMA queues idle, or with the rows (round 22a). Race-free:
    W_gu is a read-only input, each core stages into its own SBUF.

    With ctx.split_panels (round 25a) the tiles hold each chunk's K=2I panel as the I split's pass A stored it (both
    cores' K tiles: SplitChunkPanels.allocate / read_into, two DMAs, half the bytes of the rows) instead of its rows.

    Dimensions: d_gate_up rows [B, 2I] bf16 (scratch) -> B / 128 SBUF tiles [128, Kp] (Kp: 2I padded to the MX K
    alignment, zero beyond 2I), or with ctx.split_panels B / 128 pairs (words [128, cores x n, 128] x4, scales
    [128, cores x s, 128] uint8: SplitChunkPanels.allocate); W_gu[e] [2I, H] bf16 -> W_GU_K_TILES_AHEAD staging tiles
    [128, 4, width] bf16."""

    def __init__(self, ctx, e, w_gu=None, h_tiles=()):
        self.ctx, self.e = ctx, e
        self.chunks = _blocks(0, ctx.B, PARTITIONS)
        self.tiles = [nl.ndarray((PARTITIONS, ctx.k_width(2 * ctx.I)), dtype=nl.bfloat16, buffer=nl.sbuf)
                      if ctx.split_panels == None else ctx.split_panels.allocate()  # noqa: E711  (K tiles by core)
                      for _ in self.chunks]
        self.w_gu, self.first_load, self.stages, self.staged = w_gu, None, [], None
        if w_gu != None and h_tiles and not ExpertPanels.fits(w_gu, h_tiles, ctx.setup):  # noqa: E711
            width = ExpertPanels.load_width(w_gu, ctx.setup, wide=True)
            loads, _ = ExpertPanels.super_panels(w_gu, h_tiles, width)
            if loads[0][1] > WEIGHT_LOAD_WIDTH:  # a wide super-panel: ExpertPanels.get stages it through its ring
                self.first_load = loads[0]
                self.stages = [nl.ndarray((PARTITIONS, MX_PACK, loads[0][1]), dtype=nl.bfloat16, buffer=nl.sbuf)
                               for _ in range(W_GU_K_TILES_AHEAD)]

    def read(self, rows=True, w_gu=True):
        """The rows' DMAs (rows) and W_gu's first K tiles' staging DMAs (w_gu), in e's if_single loop (the block
        register of its one block). The caller issues each once on every run-time path (ExpertISplit.with_rows)."""
        def body(i):
            for (r0, m), nat in zip(self.chunks, self.tiles) if rows else []:
                if self.ctx.split_panels == None:  # noqa: E711
                    _d_gate_up_rows(self.ctx, i, r0, m, nat)
                else:  # both cores' K tiles of the chunk's panel, as pass A stored them (SplitChunkPanels)
                    self.ctx.split_panels.read_into(nat, i, r0)
            if self.stages and w_gu:
                f0, w = self.first_load
                # the same views on every path (the same tiles): the last traced serves B(e)
                self.staged = stage_ahead(self.w_gu, f0, w, w, self.ctx.setup, self.stages)
        self.ctx.loops.if_single(self.e, body)

    def w_gu_ahead(self):
        """(ring, staged views) for ExpertPanels.start_block: B(e)'s wide staging ring, holding the staged tiles as
        taken (its next K tiles take new tiles up to WIDE_WEIGHT_STAGING_BUFFERS, then these); None: nothing
        staged."""
        if not self.stages:
            return None
        return LoadRing(WIDE_WEIGHT_STAGING_BUFFERS, self.stages), self.staged


class ChunkPanels(nl.NKIObject):
    """Pass B's K=2I stationary panels of an expert's 128-row chunks, built once per expert where its W_gu runs in
    resident tile groups (an expert of two or more blocks whose panels pass A did not store: the DeepSeek-V3 rank's, by
    the I split under LNC2, by W_down's I-tile groups under LNC1): the first group builds each chunk's panel from the
    bf16 rows (transposes and quantize_mx along 2I) and stores it to this core's range of an HBM scratch
    (store_panel_tiles), the later groups load it (load_panel_tiles: two DMAs) instead of reading, transposing and
    quantizing the rows again (docs/moe.md section 10, round 22c). Each core writes and reads only its own range
    (both cores build every chunk's panel: pass B splits H), a group's stores precede the next group's loads of the
    same rows in program order on that core.

    Dimensions: words [cores x N, B, K tiles x 128] x4, scales [cores x N, B, scale tiles x 128] uint8 (K=2I, the
    layout of ctx.d_gu_mx per core: partition p of a chunk's panel in row r0 + p); groups: this core's resident
    tile groups of W_gu's H tiles (resident_tile_groups), the first one stores.
    """

    def __init__(self, ctx, groups):
        self.ctx, self.groups = ctx, groups
        nk, ns = panel_tile_widths(2 * ctx.I, PARTITIONS, ctx.setup)
        cores = ctx.split.num_cores
        self.base = ctx.split.shard_id * ctx.N  # this core's blocks in the scratch
        self.words = nl.ndarray((cores * ctx.N, ctx.B, nk * PARTITIONS), dtype=ctx.setup.x4_dtype,
                                buffer=nl.shared_hbm, name="moe_bwd_chunk_panels")
        self.scales = nl.ndarray((cores * ctx.N, ctx.B, ns * PARTITIONS), dtype=nl.uint8, buffer=nl.shared_hbm,
                                 name="moe_bwd_chunk_panel_scales")
        self.nk, self.ns = nk, ns

    @staticmethod
    def applies(ctx, groups) -> bool:
        """Where W_gu runs in more than one resident group (`groups`, None: resident whole) with MXFP8 and 128-row
        chunks from multiples of 128 (the multi-block experts whose panels pass A did not store: pass B's
        compute_phase2_hidden_states_grad_mxfp8 takes a stored panel first)."""
        return (groups != None and len(groups) > 1 and ctx.setup.is_mx and ctx.B % PARTITIONS == 0  # noqa: E711
                and ctx.split_panels == None)  # noqa: E711  (the I split's pass A stored them: SplitChunkPanels)

    @staticmethod
    def of(ctx, groups):
        """ChunkPanels(ctx, groups) where it applies, else None."""
        return ChunkPanels(ctx, groups) if ChunkPanels.applies(ctx, groups) else None

    def role(self, tiles):
        """'store' for the first resident group's tiles, 'load' for a later group's, None for others (a one-block
        expert's weights-per-block tiles: its panels are built once already)."""
        if tiles == self.groups[0]:
            return "store"
        return "load" if tiles in self.groups[1:] else None

    def store(self, panel, i, r0):
        store_panel_tiles(panel, self.ctx.block_tiles(self.words, i, r0, self.nk, self.base),
                          self.ctx.block_tiles(self.scales, i, r0, self.ns, self.base))

    def load(self, i, r0, m):
        kernel_assert(r0 % PARTITIONS == 0 and m == PARTITIONS,
                      f"stored chunk panels cover 128-row chunks from a multiple of 128, got r0={r0}, m={m}")
        return load_panel_tiles(self.ctx.block_tiles(self.words, i, r0, self.nk, self.base),
                                self.ctx.block_tiles(self.scales, i, r0, self.ns, self.base), 2 * self.ctx.I,
                                self.ctx.f_pad(m), self.ctx.setup)


def compute_phase2_hidden_states_grad_mxfp8(ctx, e, i, w_gu, skip_padding=False, flag_tiles=0, only_chunks=None,
                                            stored_panels=None, rows_ahead=None):
    """dX[ids_b, h_lo:h_hi] += bf16(d_gate_up_b @ W_gu[e]) for block i (expert e), this core's H columns.

    Dimensions:
        d_gate_up_b [B, 2I] (scratch, K=2I stationary, chunks of <= 128 rows), W_gu[e] [2I, H] (moving,
        ExpertPanels over this core's H tiles) -> part [m, H_c] bf16 -> dma_compute scatter-add into
        dX [T, H] (fp32 add, one RNE to bf16; padding rows skipped; a block holds a token once); with k = 1 a
        plain scatter of bf16(part + 0.0) (every row written once: the same bits as the add on a zero row).
    Weights loaded per block (skip_padding False): the H tiles are the outer loop (every chunk's d_gate_up
    panel stays on chip), so a weight tile loads once per block. Resident weights (skip_padding True, decided
    on core 0's share so both cores run the same loops): chunk by chunk, and a chunk past the block's last
    routed pair is skipped by a 0/1-trip loop (ctx.row_flags; chunk 0 always holds one). Weights loaded per
    block with flag_tiles > 0 (core 0's tile count: both cores run that many tiles' loops, empty past their
    own): H tiles outer as above, each chunk's matmul and its scatter-add in such a loop (the weight tile loads
    before them, with chunk 0's unconditional matmul). Each chunk's H_c columns go out in one
    read-modify-write (one descriptor per row); with weights loaded on use in wide super-panels, one per super-panel,
    issued after the chunk's last tile of it (the same bytes: each dX element written or added once).
    only_chunks (resident weights only): the indices of the 128-row chunks to run, None for all (pass B in pieces
    between pass A's chunks: moe_bwd_mxfp8_interleave.py).
    With ctx.split_panels (the I split's pass A made each core's K tiles of every chunk's panel: round 25a) every
    chunk's panel is loaded from them, on every path, instead of being built from the bf16 rows.

    Args:
        stored_panels: load every chunk's K=2I panel as pass A stored it (ctx.d_gu_mx, rounds 7a and 8c) instead of
            transposing and quantizing the bf16 rows; None: whenever the kernel made them.
        rows_ahead: DGateUpRowsAhead of block i: every 128-row chunk's d_gate_up rows (with ctx.split_panels: both
            cores' K tiles of its panel), read earlier (its tiles), for the weights-per-block path, and W_gu's first K
            tiles staged earlier (w_gu_ahead, where it staged them); None: read here.
    """
    kernel_assert(only_chunks == None or skip_padding,  # noqa: E711
                  f"a subset of pass B's chunks ({only_chunks}) needs the resident path")
    two_i = 2 * ctx.I
    tiles = w_gu.tiles
    if stored_panels == None:  # noqa: E711
        stored_panels = ctx.d_gu_mx != None  # noqa: E711
    kernel_assert(not stored_panels or ctx.d_gu_mx != None,  # noqa: E711
                  f"pass B reads pass A's d_gate_up panels of block {i} but the kernel made none")
    kernel_assert(rows_ahead == None or (not skip_padding and not stored_panels  # noqa: E711
                                         and len(rows_ahead.tiles) == len(_blocks(0, ctx.B, PARTITIONS))),
                  f"d_gate_up rows read ahead serve the weights-per-block path from bf16 rows, one tile per 128-row "
                  f"chunk ({len(_blocks(0, ctx.B, PARTITIONS))}), got "
                  f"{None if rows_ahead == None else len(rows_ahead.tiles)} tiles, "  # noqa: E711
                  f"skip_padding={skip_padding}, stored_panels={stored_panels}")
    h_lo = tiles[0][0] if tiles else 0
    h_width = tiles[-1][0] + tiles[-1][1] - h_lo if tiles else 0

    # an expert's chunk panels built by its first resident W_gu group and loaded by the later ones (ChunkPanels)
    cached = None if stored_panels or ctx.chunk_panels == None else ctx.chunk_panels.role(tiles)  # noqa: E711

    def chunk_panel(r0, m):
        if ctx.split_panels != None and not stored_panels:  # noqa: E711  each core's K tiles, made by pass A
            if rows_ahead != None:  # noqa: E711  (read before the segment's A: DGateUpRowsAhead)
                return ctx.split_panels.panel(rows_ahead.tiles[r0 // PARTITIONS], ctx.f_pad(m))
            return ctx.split_panels.load(i, r0, m)
        if cached == "load":
            return ctx.chunk_panels.load(i, r0, m)
        if stored_panels:  # quantized by pass A (rounds 7a, 8c): words and scales as stored
            kernel_assert(r0 % PARTITIONS == 0 and m == PARTITIONS,
                          f"pass A's d_gate_up panels cover 128-row chunks from a multiple of 128, got r0={r0}, m={m}")
            words, scales = ctx.d_gu_mx
            nk, ns = panel_tile_widths(two_i, PARTITIONS, ctx.setup)
            return load_panel_tiles(ctx.block_tiles(words, i, r0, nk), ctx.block_tiles(scales, i, r0, ns), two_i,
                                    ctx.f_pad(m), ctx.setup)
        nat = _d_gate_up_rows(ctx, i, r0, m) if rows_ahead == None else rows_ahead.tiles[r0 // PARTITIONS]  # noqa: E711
        panel = panel_from_rows(nat[:m, :], m, two_i, ctx.f_pad(m), ctx.setup)
        if cached == "store":
            ctx.chunk_panels.store(panel, i, r0)
        return panel

    def chunk_tile(c, j, panel, part, m):
        h0, hsz = tiles[j]
        acc = nl.ndarray((PARTITIONS, MOE_N_TILE), dtype=nl.float32, buffer=nl.psum)
        matmul_panels(acc[:panel.f_pad, :hsz], panel, w_gu.get(j), ctx.setup)  # K=2I, M=m, N=hsz
        # on ScalarE only: an eviction waits for its matmul, and on VectorE's in-order queue that wait held back the
        # W_gu quantizes behind it (and, through the staging ring, W_gu's loads): docs/moe.md section 10, round 7b
        nisa.tensor_copy(dst=part[:m, h0 - h_lo:h0 - h_lo + hsz], src=acc[:m, :hsz], engine=nisa.engine.scalar)

    def scatter_add(r0, m, part, c_lo=0, c_hi=None, ids=None, load_ids=True):
        """Columns [c_lo, c_hi) of the chunk's part (default: all) into dX[ids, h_lo + c_lo:h_lo + c_hi). ids: the
        chunk's token-id tile, loaded here when load_ids (its first scatter) and taken as loaded otherwise (a later
        super-panel's scatter of the same chunk); None: a tile of this call's own."""
        if c_hi == None:  # noqa: E711
            c_hi = h_width
        part = part[:, c_lo:c_hi]
        if load_ids:
            ids = ctx.positions(ctx.ids2d, i, r0, 1, m, dst=ids)
        rows = ctx.dx.ap([[ctx.H, m], [1, c_hi - c_lo]], offset=h_lo + c_lo, vector_offset=ids, indirect_dim=0)
        if ctx.k == 1:
            # one routed pair per token: its dX row is written exactly once (no zeroed dX, no read-modify-write):
            # dx[t] = bf16(fp32(+0 + part)), i.e. part with -0 made +0 (the fp32 add of the RMW on a zero row; on
            # ScalarE, which has room in pass B: docs/moe.md section 10, round 6c)
            nisa.tensor_scalar(dst=part[:m, :], data=part[:m, :], op0=nl.add, operand0=0.0,
                               engine=nisa.engine.scalar)
            nisa.dma_copy(dst=rows, src=part[:m, :], oob_mode=nisa.oob_mode.skip)
            return
        nisa.dma_compute(dst=rows, srcs=[rows, part[:m, :]], reduce_op=nl.add, oob_mode=nisa.oob_mode.skip)

    row_chunks = _blocks(0, ctx.B, PARTITIONS)
    if skip_padding:
        def one_chunk(c, r0, m):
            if not tiles:
                return
            panel = chunk_panel(r0, m)
            part = nl.ndarray((PARTITIONS, h_width), dtype=nl.bfloat16, buffer=nl.sbuf)
            for j in range(len(tiles)):
                chunk_tile(c, j, panel, part, m)
            scatter_add(r0, m, part)

        run = range(len(row_chunks)) if only_chunks == None else only_chunks  # noqa: E711
        flags = ctx.row_flags(i, PARTITIONS, len(row_chunks)) if max(run) > 0 else None
        for c, (r0, m) in enumerate(row_chunks):
            if c not in run:
                continue
            if c == 0:
                one_chunk(c, r0, m)
            else:
                ctx.if_flag(flags, c, lambda c=c, r0=r0, m=m: one_chunk(c, r0, m))
        return
    if not tiles and not flag_tiles:
        return
    w_gu.start_block(None if rows_ahead == None else rows_ahead.w_gu_ahead())  # noqa: E711
    chunks = []
    for r0, m in row_chunks if tiles else []:
        part = nl.ndarray((PARTITIONS, h_width), dtype=nl.bfloat16, buffer=nl.sbuf)
        chunks.append((r0, m, chunk_panel(r0, m), part))
    # each chunk's token ids, loaded by its first scatter and taken by its later super-panels' (one [m, 1] int32 load,
    # one 4-byte descriptor per row, per chunk instead of per super-panel: docs/moe.md section 10, round 27a)
    chunk_ids = [nl.ndarray((m, 1), dtype=nl.int32, buffer=nl.sbuf) for _, m, _, _ in chunks]
    flags = ctx.row_flags(i, PARTITIONS, len(row_chunks)) if flag_tiles and len(row_chunks) > 1 else None

    def run(c, work):
        if flags == None or c == 0:  # noqa: E711
            work()
        else:
            ctx.if_flag(flags, c, work)

    # weights loaded on use: a chunk's dX columns of each super-panel go out right after the chunk's last tile of that
    # super-panel, not all chunks' whole rows after the block's last matmul (where they burst beside pass C's first
    # loads and stores: docs/moe.md section 10, round 19b). The cuts fall at multiples of the load width in tiles, the
    # same on both cores (a core past its own columns runs an empty body, like chunk_tile's)
    n_tiles = max(len(tiles), flag_tiles)
    width = 0 if w_gu.resident else ExpertPanels.load_width(w_gu.op, ctx.setup, wide=True)
    per_load = width // MOE_N_TILE if width == WIDE_WEIGHT_LOAD_WIDTH else 0  # tiles per super-panel; 0: no cuts
    done = 0  # columns of this core's dX rows scattered so far
    for j in range(n_tiles):
        is_cut = per_load and (j + 1) % per_load == 0 and j + 1 < n_tiles
        cut = min((j + 1) * MOE_N_TILE, h_width)
        for c in range(len(row_chunks)):
            run(c, lambda c=c, j=j: chunk_tile(c, j, chunks[c][2], chunks[c][3], chunks[c][1]) if j < len(tiles)
                else None)
            if is_cut:
                run(c, lambda c=c, lo=done, hi=cut: scatter_add(chunks[c][0], chunks[c][1], chunks[c][3], lo, hi,
                                                                ids=chunk_ids[c], load_ids=lo == 0)
                    if lo < hi else None)
            if j == n_tiles - 1:
                run(c, lambda c=c, lo=done: scatter_add(chunks[c][0], chunks[c][1], chunks[c][3], lo,
                                                        ids=chunk_ids[c], load_ids=lo == 0)
                    if lo < h_width else None)
        if is_cut:
            done = cut
