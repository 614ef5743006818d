"""Matmul plans: out[M, N] = stationary[K, M]ᵀ @ moving[K, N] for this core's output tiles, with tiling,
core split and epilogue decided once, runnable in steps around other plans.

A plan is built from operand descriptors (TensorDescriptor, one per stationary and moving operand), the
products to form (pairs of a stationary and a moving operand sharing the output tile, e.g. the MLP
backward's dI, gate_pre and up all tile [S, I] with dY or X stationary), the output extent [M, N], the
core split (CoreSplit, computed once per kernel) and an epilogue that consumes each tile's PSUM
accumulators (StoreEpilogue: evict and store to HBM; a kernel passes its own, e.g. the SwiGLU derivative).
Kernels with a run-time loop over blocks (grouped MoE experts) build one plan per block from windowed
descriptors (TensorDescriptor.window) and the same split.

Operands that do not fit SBUF: moving panels all resident (m-major) > stationary panels all resident
(n-major) > the smaller whole operand resident beside the other's streamed panels (RESIDENT_OPERAND_BUDGET_BYTES)
> K-streamed groups > stationary groups (see MatmulPlan). A long K that leaves only the last two can be cut into
chunks that each keep an operand resident instead (k_chunks.py plan_matmul, the caller's choice).

What a plan holds at its end and takes for its first loads, which PhaseGraph weighs to overlap it with the plans
beside it, is computed in overlap.py; the tiling decided when it is built is tiling.py's; the K-streamed run is
streamed.py's.
"""
from __future__ import annotations

import nki.language as nl

from ..kernel_helpers import kernel_assert
from .constants import (FENCE_TILE, FENCED_FIRST_K_TILES, OWN_PREFETCH_GROUPS, PSUM_BUFFERS,
                        STATIONARY_LOOKAHEAD_TILES)
from .last_tile import matmul_last_tile_by_columns
from .overlap import (advance_spread_load, begin_spread_first_load, first_load_bytes, first_stationary_load_bytes,
                      first_panel_return, held_bytes_at_tail, issue_fence_work, last_loading_tile, switch_load_ahead,
                      place_fence_after_first_panel, prefetch_fits, spread_copies_fit, spread_fits_tail, stage_prefetch,
                      tail_load_fits)
from .panels import LoadRing, k_tiles, matmul_panels, single_k_tile
from .row_panels import preload_natural_rows
from .sources import tile_spans
from .span_columns import matmul_k_tile_by_columns, piece_span_columns, span_tile_epilogue
from .sizing import psum_buffers
from .streamed import run_streamed
from .tiling import choose_tiling, plan_k_interleaved_spans


class MatmulPlan(nl.NKIObject):
    """Products out_p[M, N] = stationary[s_p][K, M]ᵀ @ moving[m_p][K, N] for this core's output tiles.

    Dimensions:
        stationary: TensorDescriptors whose F axis is M (rows [m_lo, m_hi) are this core's); moving:
        TensorDescriptors whose F axis is N; every product's operands share K. products: (s, m) index pairs
        (default one product of stationary[0] and moving[0]).

    Tiling, decided once: every moving panel of this core stays resident (quantized once) when all of
    them fit PANEL_CACHE_BUDGET_BYTES, and tiles run m-major so each stationary panel is also quantized
    once; else, when all stationary panels fit, they stay resident and tiles run n-major (each moving
    panel loaded once); else (groups=True, one product) when the smaller whole operand fits
    RESIDENT_OPERAND_BUDGET_BYTES it stays resident the same way (_resident_operand); otherwise
    K-streamed groups (_run_streamed) when the moving operand can be loaded by K tile and that holds more
    stationary panels, else n-major inside groups of stationary loads (STATIONARY_GROUP_BUDGET_BYTES; each
    stationary panel quantized once, the moving panels swept once per group).

    Args:
        split: the kernel's CoreSplit; ranges: this core's ((m_lo, m_hi), (n_lo, n_hi)) when the caller
            fixes them (default split.ranges(m_total, n_total)); resident: ResidentPanels already on chip
            (built by an earlier phase) as the one stationary operand, for its rows and all N columns.
        groups: neither operand fitting, keep the smaller whole one resident (_resident_operand) or else sweep
            groups of stationary loads (False: neither; the panels of the operand that fits stay resident).
        keep_whole: with groups=False, still keep the smaller whole operand resident by _resident_operand
            (the MLP backward's phase 1 split along I keeps all of dY; default off). With interleave_switch and the
            moving panels not kept (streamed one at a time, MXFP8 [K, F] quantized on chip), every moving K tile from
            SWITCH_NEXT_WORDS_FROM_K_TILE on but each panel's last quantizes half of its columns from a unit-stride
            ScalarE copy in the next K tile's words (PanelLoad next_words_from); their words take a ring of K-tile
            slots (PanelWordsRing, SWITCH_AHEAD_SLOTS), the next panel's first K tiles quantized ahead of its switch
            (overlap.switch_load_ahead), and the kept stationary operand one block (PanelSource.kept_slots).
        lead_n_major: with the moving panels resident (m-major), run the m tiles of the first stationary load
            n-major (tile_order's lead): every moving panel is loaded and quantized during the first m tile's
            row otherwise, one wait of TensorE per panel (the MLP backward's phases 3 and 4, whose epilogue
            takes tiles in any order; default off).
        interleave_first_loads: when the first tile needs a new stationary and a new moving panel of [K, F]
            operands quantized on chip, load them K tile by K tile in turn (_interleave_loads; the MLP backward's
            phase 4, which starts cold after TP1's K-streamed phase 2; default off).
        stationary_lookahead: with the stationary operand kept whole (loaded on demand), load each tile's stationary
            MXFP8 panels STATIONARY_LOOKAHEAD_TILES tiles ahead (_load_stationary_ahead; the MLP backward's phase 4
            at TP1, whose epilogue leaves VectorE to the quantizes; default off).
        contiguous_group: a K-streamed plan (MXFP8) places each group's stationary panels in one SBUF allocation
            (PanelGroupBlock) instead of one per panel (the MLP backward's phase 2 at TP1; default off).
        reload: PartialSums (k_chunks.py) whose earlier K chunk's fp32 sums each tile continues: they are put back
            into the tile's PSUM accumulator (bit-exact) before its matmuls, which then accumulate (one product;
            KChunkedPlan's later chunks; default none).
        own_k_ranges: K column ranges [(k_lo, k_hi)] of a K-contiguous stationary operand that this core wrote
            itself (the MLP backward's d_gate_up after phase 1's split along I): prefetch_own DMAs the first group's
            panels' rows there before the core barrier (OWN_PREFETCH_GROUPS natural row tiles in all; K-streamed
            plans with contiguous_group only; default none).
        interleave_switch: an n-major plan whose moving panels are not resident runs the matmuls of the first
            SWITCH_INTERLEAVE_TILES tiles of each new moving panel K tile by K tile across them
            (_matmuls_k_interleaved), with one PSUM accumulator more than the span: as many as fit beside
            TRANSPOSE_PSUM_BANKS (off below 3), and from the first switch on also in those banks when no PE transposes
            follow (stationary kept whole, moving [K, F]). With interleave_first_loads and no PE-transposed operand
            (every one [K, F] or pre-quantized) the plan's cold first tiles form such a span too, the accumulators
            added there. The caller's epilogue must take no PSUM (the MLP backward's phase 1 split along I, and its
            phase 4 at TP1; default off).
        interleave_lead: with the moving operand kept whole by _resident_operand (not by the panel cache) and a
            lead_n_major lead, the first LEAD_INTERLEAVE_TILES tiles of each new moving panel of the lead (the first
            included) run K tile by K tile across them (_matmuls_k_interleaved), with the PSUM_BUFFERS accumulators:
            the caller's epilogue evicts on ScalarE, which no quantize holds back, so the span may take the
            accumulator of the tile before it. Not with reload (k_chunks.plan_matmul drops it for chunked plans; the
            MLP backward's phase 3, which keeps X whole by the resident rule at TP1 and at H = 7168, I = 2048;
            default off).
        cold_staging: with the moving panels kept resident (m-major, each loaded and quantized once, all of them
            during the plan's first tile) and at most COLD_STAGING_MAX_M_TILES m tiles on this core, their [K, F]
            loads share a ring of COLD_STAGING_BUFFERS staging tiles instead of STAGING_BUFFERS (the MLP backward's
            phase 1, whose first S tile needs all of W_down; default off).
        fenced_start: the plan's "first" step runs before a fence (the caller's core barrier, which waits for every
            earlier instruction): with resident stationary panels and MXFP8 [K, F] moving panels quantized on chip
            and not kept (n-major), "first" quantizes only the first FENCED_FIRST_K_TILES K tiles (at most all) of the
            first moving panel (its DMAs all begin there, through a ring of FENCED_STAGING_BUFFERS) and the rest are
            quantized after the fence, where the first tiles run as an interleave_switch span (K tile by K tile in
            turn, over every PSUM accumulator: no tile of the plan precedes it), so TensorE starts after the fence on
            the quantized K tiles instead of waiting for the whole panel before it (the MLP backward's phase 2 at TP8;
            default off; ignored otherwise). piece_first_span: that panel and span in column pieces.
        epilogue: what happens to each finished output tile (StoreEpilogue writes out[M, N] to HBM). Any
            NKIObject with the methods
              prepare(plan): once, right after the plan allocates its PSUM accumulators (allocate
                  rotating tiles here);
              tile(i, m0, msz, n0, nsz, accumulators): tile i (rows [m0, m0+msz), columns [n0, n0+nsz))
                  is complete; accumulators[p] is product p's fp32 PSUM tile [128, n_tile], valid [:msz, :nsz];
              finish(): after the last tile;
              held_bytes(n_tile): SBUF bytes per partition it holds between tiles;
            and, optionally, defer_next_store() / store_deferred() (StoreEpilogue's): with a fence inside the run
            (set_fence) the tile before the fence holds its store until after it; an epilogue without them runs
            that tile as any other.
            (A protocol, not a base class: NKI before 0.7 takes classes derived from NKIObject alone, and
            class inheritance arrives with 0.7's Python tracing; see docs/kernel-structure.md.)
    """

    def __init__(self, stationary, moving, m_total, n_total, setup, config, split, epilogue, products=((0, 0),),
                 ranges=None, resident=None, groups=True, keep_whole=False, lead_n_major=False,
                 interleave_first_loads=False, stationary_lookahead=False, contiguous_group=False, own_k_ranges=(),
                 reload=None, interleave_switch=False, interleave_lead=False, cold_staging=False,
                 fenced_start=False):
        self.setup = setup
        self.reload = reload
        self.switch_span = 1  # tiles K-interleaved at each moving panel switch (interleave_switch)
        self.span_skew = 0  # K tiles each tile of such a span trails the one before it (interleave_lead)
        self.acc_order = []  # accumulator indices, least recently taken first
        self.psum_count = PSUM_BUFFERS  # accumulators per product, used round-robin
        self.own_k_ranges = own_k_ranges
        self.preloaded = None  # prefetch_own's row tiles per panel of the first group
        self.contiguous_group = contiguous_group and setup.is_mx
        self.epilogue = epilogue
        self.products = products
        self.pieced_last_tile = False  # the last tile in column pieces (piece_last_tile)
        self.done = 0
        self.accumulators = None
        self.stream = None
        self.tail_load = None  # K-streamed plans: (step, next plan) issuing its first stationary loads (set_tail_load)
        self.fence = None  # (tile, callable): a sync point issued inside this plan's run (set_fence)
        self.fence_tile = FENCE_TILE  # where set_fence puts it (fence_after_first_panel moves it)
        self.fence_work = None  # callable the fence waits for, issued at the fence tile (set_fence_work)
        self.spread_first, self.carried = False, None  # spread_first_load; (next plan, tile): carry_first_load
        self.short_tail_whole = False  # the next plan's spread first load whole after a short tail (prefetch_point)
        self.spread_copies = True  # the spread first load's unit-stride copies (prefetch_point of the previous plan)
        self.stationary_ops, self.moving_ops = stationary, moving
        if resident != None:  # noqa: E711  (NKI traced code: no `is not`)
            ranges = ((resident.lo, resident.hi), (0, n_total))
        if ranges == None:  # noqa: E711
            ranges = split.ranges(m_total, n_total)
        (m_lo, m_hi), (n_lo, n_hi) = ranges
        self.ranges = ranges
        self.n_width = n_hi - n_lo
        self.m_tile = config.m_tile
        self.n_tile = config.n_tile
        self.keep_moving = False
        self.interleave = interleave_first_loads
        self.first_span = 0  # tiles of the plan's first interleave_switch span (0: none; see interleave_switch)
        self.span_columns = 1  # column pieces of the first span's K tiles (fenced_start, span_columns.py)
        self.lookahead = STATIONARY_LOOKAHEAD_TILES if stationary_lookahead and setup.is_mx else 0
        self.stationary, self.moving = [], []
        if m_lo >= m_hi or n_lo >= n_hi:
            self.order = []
            return
        lead, moving_by_rule = choose_tiling(self, stationary, moving, config, products, resident, groups,
                                             keep_whole, lead_n_major, cold_staging, fenced_start)
        interleave_switch = interleave_switch or self.fenced_start  # a fenced start's first span (choose_tiling)
        plan_k_interleaved_spans(self, stationary, moving, products, reload, interleave_switch, interleave_lead,
                                 interleave_first_loads, keep_whole, lead, moving_by_rule)

    # ---- overlapping the plans beside it (PhaseGraph's questions, answered in overlap.py) ----
    def held_bytes(self) -> int:
        """Upper bound of the SBUF bytes per partition this plan holds while its last tiles run."""
        return held_bytes_at_tail(self)

    def first_bytes(self, own_rings: bool = False, moving_staging: int = 0) -> int:
        """SBUF bytes per partition that loading the first tile's panels takes (overlap.first_load_bytes)."""
        return first_load_bytes(self, own_rings, moving_staging)

    def stage_first_load(self, buffers: int) -> None:
        """The first moving panels' staging rings at most `buffers` deep (their own depth again from the next panel
        on: PanelSource.later_staging); before the first load (overlap.prefetch_staging)."""
        for mv in self.moving:
            if mv.staging > buffers:
                mv.later_staging = mv.later_staging or mv.staging
                mv.staging = buffers

    def first_stationary_bytes(self) -> int:
        """SBUF bytes per partition of the first tile's stationary loads (overlap.first_stationary_load_bytes)."""
        return first_stationary_load_bytes(self)

    def can_prefetch(self, nxt) -> bool:
        """Whether `nxt`'s first panels may load while this plan's last tiles run (overlap.prefetch_fits)."""
        return prefetch_fits(self, nxt)

    def can_load_under_tail(self, nxt) -> bool:
        """Whether `nxt`'s first stationary panels may load during this K-streamed plan's last quad
        (overlap.tail_load_fits)."""
        return tail_load_fits(self, nxt)

    def prefetch_stationary(self) -> None:
        """Load the first tile's stationary panels now (under the previous K-streamed plan's last quad)."""
        (m0, msz), _ = self.order[0]
        for s, _ in self.products:
            self.stationary[s].get(m0, msz)

    def adopt_staging(self, tiles) -> None:
        """Before the first stationary loads issued under a K-streamed plan's last quad (set_tail_load): the first
        tile's stationary sources stage through `tiles` (that plan's staging ring, free once its last quad is
        quantized; LoadRing's `tiles`, the ring at least that deep) and place their quantized words one K tile per
        allocation (PanelSource.words_per_k_tile). Fresh staging tiles and a whole-panel words block were placed
        next-fit over the K-streamed plan's dead tiles, whose last readers are its last matmuls: TP1's phase 4 then
        started its first dY DMAs ~7 us after phase 2's last quantizes, or quantized them only after phase 2's last
        matmul. Same instructions in the same order (other SBUF addresses, a staging ring of 4 instead of 3): no
        bit changes."""
        for s, _ in self.products:
            source = self.stationary[s]
            if not source.resident and source.ring == None and source.capacity == 1:  # noqa: E711
                source.ring = LoadRing(max(source.staging, len(tiles)), tiles)
                source.words_per_k_tile = True
                # the deeper ring only for the panel loaded under that plan's tail (tail_load_fits budgeted it; its
                # tiles are that plan's, so it takes no SBUF of its own): the later panels' loads share the ring at
                # the source's own depth, on which the rest of this plan was budgeted. Kept at 4 for the whole plan,
                # K-chunked phase 4 at S = 16384, H = I = 2880 then had no placement for a 20 KiB tile (262.5 KiB)
                source.later_staging = source.staging

    def set_tail_load(self, step, nxt) -> None:
        """K-streamed plans: call `step(nxt, "first_stationary")` (the next plan's first stationary loads, through its
        phase function) right after loading the last quad of the last n block, and evict that block's accumulators
        on ScalarE only: VectorE quantizes those loads meanwhile (PhaseGraph, when can_load_under_tail)."""
        self.tail_load = (step, nxt)

    def can_fence(self) -> bool:
        """Whether set_fence applies: a plan of tiles (not K-streamed) with more than fence_tile of them."""
        return self.stream == None and len(self.order) > self.fence_tile  # noqa: E711

    def set_fence(self, barrier) -> None:
        """Call `barrier()` (a fence: it waits for every earlier instruction of the core) inside this plan's run,
        right before tile fence_tile's epilogue (FENCE_TILE unless fence_after_first_panel): after that tile's
        matmuls, so the fence waits for the previous tile's eviction while TensorE multiplies (that tile's store goes
        out after the fence where the epilogue has defer_next_store / store_deferred, as StoreEpilogue does), and the
        tiles before it overlap the work the fence waits for (PhaseGraph, when a phase that reads nothing the sync point
        protects runs before one that does)."""
        self.fence = (self.fence_tile, barrier)

    def set_fence_work(self, work) -> None:
        """Call `work()` (instructions the set_fence sync point waits for) at the fence tile before the next tile's
        loads, after their first FENCE_WORK_AFTER_K_TILES quantizes (overlap.issue_fence_work); no change without
        a fence inside the run."""
        self.fence_work = work

    def first_panel_once(self) -> bool:
        """Whether the first moving panel's tiles come first and never again (n-major; not a grouped order that
        sweeps the moving panels once per m group): fence_after_first_panel's condition (overlap.first_panel_return)."""
        return not first_panel_return(self)[1]

    def fence_after_first_panel(self) -> None:
        """Move set_fence's sync point to the last tile of the first moving panel, after the second panel's loads
        (n-major plans; overlap.place_fence_after_first_panel)."""
        place_fence_after_first_panel(self)

    def piece_first_span(self) -> None:
        """A fenced start's first moving panel quantized, and its first span multiplied and evicted, in
        FENCED_COLUMN_PIECES column pieces (span_columns.py); no change without such a span."""
        piece_span_columns(self)

    def spread_first_load(self) -> None:
        """Step "first" (a prefetch under the previous plan's tail) quantizes only the first SPREAD_FIRST_K_TILES K
        tiles of the first moving panel, and the previous plan's run the others, half from unit-stride copies
        (overlap.begin_spread_first_load; the MLP backward's phase 3 under phase 2; no change where it does not
        apply)."""
        self.spread_first = True

    def short_tail_loads_whole(self) -> None:
        """A spread first load of the next plan (spread_first_load) of whose schedule this plan's tiles left at the
        prefetch point take under 1 / SHORT_TAIL_SPREAD_SHARE (overlap.spread_fits_tail) is quantized whole there
        instead (the MLP backward's phase 4, phase 3 after it). Under phase 2 a short tail keeps the spread
        (S = 4608, H = 2048, I = 1536: whole there 0.43592 / 0.49283 -> 0.43527 / 0.51040 ms; round 45)."""
        self.short_tail_whole = True

    def prefetch_point(self, nxt) -> None:
        """PhaseGraph, after this plan's step "head" and before nxt's step "first": a spread first load of nxt
        (spread_first_load) quantizes half of its K tiles from unit-stride copies only where at most 1 /
        SPREAD_COPIES_TAIL_SHARE of this plan's tiles are left and a words piece is spare (overlap.spread_copies_fit;
        else each K tile whole from its staging tile: the same words and scales, bit for bit); none where this plan
        quantizes a load its tail does not take whole (short_tail_loads_whole: all K tiles quantized here, as
        prefetch does)."""
        if nxt.spread_first and self.short_tail_whole and not spread_fits_tail(self, nxt):
            nxt.spread_first = False
        if nxt.spread_first:
            nxt.spread_copies = spread_copies_fit(self, nxt)
        stage_prefetch(self, nxt)

    def carry_first_load(self, nxt) -> None:
        """After nxt's step "first" (PhaseGraph): this plan's remaining tiles quantize the K tiles of nxt's spread
        first load, one every SPREAD_TILES_PER_K_TILE tiles (overlap.advance_spread_load)."""
        if not nxt.spread_first:  # e.g. a K-chunked plan (k_chunks.py: never spread)
            return
        if any(mv.pending != None for mv in nxt.moving):  # noqa: E711
            self.carried = (nxt, self.done)

    def fire_fence(self) -> None:
        """Issue a pending set_fence barrier now (before the next plan's first loads, which it protects)."""
        if self.fence != None:  # noqa: E711
            barrier = self.fence[1]
            self.fence = None
            barrier()
            if hasattr(self.epilogue, "store_deferred"):  # the optional part of the epilogue protocol
                self.epilogue.store_deferred()

    def stationary_on_chip(self) -> bool:
        """Whether the stationary panels are already on chip (built by an earlier phase): the first tile's
        loads then read only the moving operand."""
        return len(self.stationary) > 0 and self.stationary[0].resident

    def last_load(self) -> int:
        """Index of the last tile that loads a panel: after it this plan loads nothing (overlap.last_loading_tile)."""
        return last_loading_tile(self)

    def _interleave_loads(self, i: int) -> None:
        """interleave_first_loads: when tile i needs a new stationary and a new moving panel of [K, F] operands
        quantized on chip, load them K tile by K tile in turn (PanelLoad), so the first matmul waits for one K
        tile of each instead of all K tiles of the stationary panel and the first of the moving one (VectorE
        quantizes in program order). For a plan's cold start (TP1's phase 4 after the K-streamed phase 2: TensorE
        waited 25.7 us for its first matmul, now 14.2; modeled 4.619 -> 4.616 ms); the loads issue the same
        instructions as get's, in another order."""
        (m0, msz), (n0, nsz) = self.order[i]
        for s, m in self.products:
            st, mv = self.stationary[s], self.moving[m]
            if st.resident or not (st.can_load_ahead() and mv.can_load_ahead()) or st.holds(m0) or mv.holds(n0):
                continue
            n_k = len(k_tiles(st.op.k_size, self.setup))
            for t in range(1, n_k + 1):
                st.load_ahead(m0, msz, t)
                mv.load_ahead(n0, nsz, t)

    def _load_stationary_ahead(self, j: int) -> None:
        """stationary_lookahead: load tile j's stationary panels now when they are kept whole (a resident stationary
        operand loaded on demand in the first n block of an n-major plan), STATIONARY_LOOKAHEAD_TILES tiles early
        instead of at the tile before j: its DMAs and quantizes get a super-panel's matmuls of time. It takes no more
        SBUF than the whole operand the plan keeps (TP1's phase 4 keeps dY)."""
        (m0, msz), _ = self.order[j]
        for s, _ in self.products:
            st = self.stationary[s]
            if st.keep_all and not st.resident:
                st.get(m0, msz)

    def _take_accumulator(self) -> int:
        """Index of the accumulator (of every product) the next tile takes: the least recently taken one (round-robin
        with a fixed count; after interleave_switch's extra accumulators, those first)."""
        k = self.acc_order.pop(0)
        self.acc_order.append(k)
        return k

    def _matmuls_k_interleaved(self, i: int, span: int, finished) -> None:
        """interleave_switch: the matmuls of tiles [i, i + span) (one n block whose moving panel is new) K tile by K
        tile across the tiles. The new panel's K tiles can only be quantized once the previous panel's last matmuls
        have read the SBUF they take, and the first tile waits for each in turn; TensorE now multiplies each K tile
        into every tile of the span meanwhile (TP1 phase 1: 5 W_down panel switches per core). The same
        instructions as matmul_panels per tile, in another order across the tiles' accumulators: each still sums
        its K tiles 0..n-1 in order, so the bits do not change. interleave_lead uses it too (phase 3's lead meeting
        X's second panel), each tile of the span span_skew K tiles behind the one before it."""
        tiles = self.order[i:i + span]
        n0, nsz = tiles[0][1]
        if self.extra_accumulators:
            # the first switch: the stationary panels are all on chip, no PE transposes follow (see __init__)
            for accs in self.accumulators:
                accs.extend(psum_buffers(self.n_tile, self.extra_accumulators))
            self.acc_order = list(range(self.psum_count, self.psum_count + self.extra_accumulators)) + self.acc_order
            self.psum_count, self.extra_accumulators = self.psum_count + self.extra_accumulators, 0
        taken = [self._take_accumulator() for _ in range(span)]
        for p, (s, m) in enumerate(self.products):
            b = self.moving[m].get(n0, nsz)
            a_panels = [self.stationary[s].get(m0, msz) for (m0, msz), _ in tiles]
            psums = [self.accumulators[p][k] for k in taken]
            n_k = len(b.data)
            for step in range(n_k + (span - 1) * self.span_skew):
                if i == 0 and self.span_columns > 1:  # the fenced start's first span (span_skew 0)
                    matmul_k_tile_by_columns(psums, a_panels, b, step, nsz, self.span_columns, self.setup)
                    continue
                for j in range(span):
                    t = step - j * self.span_skew
                    if 0 <= t < n_k:
                        a = a_panels[j]
                        # K=one K tile, M=m tile, N=n block
                        matmul_panels(psums[j][:a.f_pad, :nsz], single_k_tile(a, t), single_k_tile(b, t),
                                      self.setup, accumulate=t > 0)
            for j in range(span):
                finished[j].append(psums[j])
            a_panels = b = None

    def prefetch(self, lo: int, hi: int) -> None:
        """Issue the loads of tiles [lo, hi) now (e.g. while another plan computes)."""
        for (m0, msz), (n0, nsz) in self.order[lo:hi]:
            for s, m in self.products:
                self.stationary[s].get(m0, msz)
                self.moving[m].get(n0, nsz)
            if self.reload != None:  # noqa: E711
                self.reload.fetch(m0, n0, nsz)

    def prefetch_first_deferring(self, deferred: int) -> None:
        """step("first") for a plan whose first panels load under another's tail, among the holes its dead panels
        leave: where the first tile has one moving panel that load_ahead may begin, only its K tiles before the last
        `deferred` are quantized now (their words pieces placed under the tail); the first tile's get quantizes the
        rest, after the other plan's last tiles in program order, when the pieces those tiles read are dead
        (k_chunks.KChunkedPlan: a later K chunk's first panel, K_CHUNK_FIRST_DEFERRED_K_TILES). Else step("first")."""
        source = self.moving[self.products[0][1]] if len(self.products) == 1 else None
        if (self.fenced_start or self.stream != None or not self.order or source == None  # noqa: E711
                or not source.can_load_ahead()):
            self.step("first")
            return
        (m0, msz), (n0, nsz) = self.order[0]
        self.stationary[self.products[0][0]].get(m0, msz)
        count = len(k_tiles(source.op.k_size, self.setup))
        source.load_ahead(n0, nsz, max(1, count - deferred))
        if self.reload != None:  # noqa: E711
            self.reload.fetch(m0, n0, nsz)

    def prefetch_own(self) -> None:
        """Before the core barrier: DMA the first OWN_PREFETCH_GROUPS natural row tiles (NATURAL_LOAD_K columns of
        128 rows each) of the first group's stationary panels, panel by panel, that lie in own_k_ranges (columns this
        core wrote, so no other core's write is awaited and no race). After the barrier TensorE transposes them
        first while the other core's columns load (load_panel's preloaded); every K tile is quantized on its own and
        the matmuls accumulate K in order as before, so the bits do not change."""
        if (self.stream == None or not self.contiguous_group or not self.own_k_ranges  # noqa: E711
                or self.preloaded != None):  # noqa: E711
            return
        source = self.stationary[0]
        g, m_blocks, _ = self.stream
        self.preloaded, left = [], OWN_PREFETCH_GROUPS
        for m0, msz in m_blocks[:g]:
            tiles = preload_natural_rows(source.op, m0, msz, self.own_k_ranges, left, self.setup)
            self.preloaded.append(tiles)
            left -= len(tiles)

    # ---- running ----
    def _run_streamed(self) -> None:
        """All tiles of a K-streamed plan (streamed.run_streamed)."""
        run_streamed(self)

    def run(self, hi: int = -1) -> None:
        """Compute the tiles not done yet, up to (excluding) hi (-1: all)."""
        hi = len(self.order) if hi < 0 else hi
        if self.done >= hi:
            return
        if self.stream != None:  # noqa: E711
            kernel_assert(self.done == 0 and hi == len(self.order),
                          f"K-streamed plans run in one step, got tiles [{self.done}, {hi}) of {len(self.order)}")
            self._run_streamed()
            return
        if self.accumulators == None:  # noqa: E711
            # allocated once per plan (psum_count accumulators per product; the epilogue's rotating tiles),
            # so a run split around another plan's prefetch allocates nothing new mid-phase
            self.accumulators = [psum_buffers(self.n_tile, self.psum_count) for _ in self.products]
            self.acc_order = list(range(self.psum_count))
            self.epilogue.prepare(self)
        for i, span in tile_spans(self.order, self.done, hi, self.switch_span, self.first_span):
            finished = [[] for _ in range(span)]
            if span > 1:
                if i == 0 and self.interleave:
                    self._interleave_loads(0)
                self._matmuls_k_interleaved(i, span, finished)
            else:
                (m0, msz), (n0, nsz) = self.order[i]
                if i == 0 and self.interleave:
                    self._interleave_loads(0)
                if (self.pieced_last_tile and i == len(self.order) - 1 and self.reload == None  # noqa: E711
                        and self.fence == None and hasattr(self.epilogue, "tile_columns")):  # noqa: E711
                    matmul_last_tile_by_columns(self, i, self._take_accumulator())
                    continue
                k = self._take_accumulator()
                for p, (s, m) in enumerate(self.products):
                    a = self.stationary[s].get(m0, msz)
                    psum = self.accumulators[p][k]
                    continued = self.reload != None  # noqa: E711  (a later K chunk: its sums so far come back first)
                    if continued:
                        self.reload.reload(m0, a.f_pad, n0, nsz, psum)
                    # K=op K, M=m tile, N=n block
                    matmul_panels(psum[:a.f_pad, :nsz], a, self.moving[m].get(n0, nsz), self.setup,
                                  accumulate=continued)
                    finished[0].append(psum)
                    a = None  # hold no panel across the next get (a dropped panel's SBUF is then free)
            for j in range(i, i + span):
                (m0, msz), (n0, nsz) = self.order[j]
                if self.lookahead and j + self.lookahead < len(self.order):
                    self._load_stationary_ahead(j + self.lookahead)
                issue_fence_work(self, j)
                if j + 1 < len(self.order):
                    # the next tile's loads before this tile's epilogue: the in-order engines (VectorE's
                    # quantize_mx, the PE transposes of K-contiguous operands) prepare the next matmuls' panels
                    # first instead of after the epilogue's work (TP8 MXFP8 modeled 0.692 -> 0.685 ms)
                    self.prefetch(j + 1, j + 2)
                if self.fence != None and j >= self.fence[0]:  # noqa: E711
                    self.fire_fence()
                defers = hasattr(self.epilogue, "defer_next_store")  # the optional part of the epilogue protocol
                if self.fence != None and j + 1 == self.fence[0] and defers:  # noqa: E711
                    # the tile before the fence: its store goes out after the fence (fire_fence), which then waits
                    # for its eviction only while TensorE runs the fence tile's matmuls
                    self.epilogue.defer_next_store()
                span_tile_epilogue(self, j, finished[j - i], i == 0 and span > 1)
                switch_load_ahead(self, j)
                if self.carried != None:  # noqa: E711
                    advance_spread_load(self, j)
        self.done = hi

    def piece_last_tile(self) -> None:
        """Run the last tile in column pieces, each stored once its matmuls are done (last_tile.py): for the kernel's
        last plan, whose last store nothing else hides (PhaseGraph.run). MXFP8 only: BF16's N <= 512 tiles gain
        nothing (the BF16 mode at TP8 2.2355 -> 2.2358 ms pieced)."""
        self.pieced_last_tile = self.setup.is_mx

    def release(self) -> None:
        """Drop every panel and buffer this plan holds (their SBUF/PSUM is free for the next phase)."""
        self.accumulators = None
        for source in self.stationary + self.moving:
            source.release()
            if not source.resident:
                source.ring = source.pending = None  # and the LoadRing its loads shared

    def step(self, stage: str) -> "MatmulPlan":
        """stage "head": run the tiles up to the last one that loads a panel (last_load); "first": load the
        first tile's panels (prefetch while another plan computes); "first_stationary": only its stationary panels
        (under a K-streamed plan's last quad, set_tail_load); "all": run the remaining tiles, finish
        the epilogue and release the panels. (PhaseGraph calls these; see nkilib/core/phase_graph.py.)"""
        if stage == "head":
            if self.stream == None and self.order:  # noqa: E711
                self.run(max(self.done, self.last_load() + 1))
        elif stage == "first":
            if self.fenced_start and self.order:
                (_, _), (n0, nsz) = self.order[0]
                for _, m in self.products:
                    self.moving[m].load_ahead(n0, nsz, FENCED_FIRST_K_TILES)
            elif self.stream == None and self.order and not begin_spread_first_load(self):  # noqa: E711
                self.prefetch(0, 1)
        elif stage == "first_stationary":
            if self.stream == None and self.order:  # noqa: E711
                self.prefetch_stationary()
        elif stage == "all":
            self.run()
            self.fire_fence()
            self.epilogue.finish()
            self.release()
        return self
