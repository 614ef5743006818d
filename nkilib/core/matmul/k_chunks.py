"""K-chunked matmul plans: out[M, N] = sum over K chunks of stationary[Kc, M]ᵀ @ moving[Kc, N], each chunk a
MatmulPlan that keeps one operand's chunk resident, the fp32 sums carried from chunk to chunk through HBM.

Why: when neither whole operand of a long-K plan fits SBUF (the MLP backward's phases 3 and 4, K = S, at
S = 32768, H = 2048, I = 768: X [S, H/2] takes 272 KiB per partition in MXFP8 and the intermediate [S, I]
204 KiB, beyond RESIDENT_OPERAND_BUDGET_BYTES), MatmulPlan falls back to groups of stationary panels and reads
(and quantizes) the moving operand once per group, with narrow stationary loads (128 columns: 256-byte DMA
runs). Cut along K into chunks whose smaller operand fits RESIDENT_OPERAND_BUDGET_BYTES, every chunk is the plan
a shorter K gets (the smaller chunk resident, the other streamed once) and each operand is read once; each
output tile's fp32 sums leave PSUM after a chunk and come back before the next (PartialSums): 8 bytes per output
element per chunk boundary instead of re-reading a K-long operand. Shorter chunks also widen the stationary
loads that STATIONARY_PANEL_BUDGET_BYTES narrows at long K even where an operand fits (S = 16384: dY loads 256
columns wide, 512 in chunks of 8192 rows), so that case is cut too (k_chunk_rows says when).

Bit-exactness: the reference (nkilib.mx.mx_matmul) adds each K tile's float32 sum, in K order, to one float32
accumulator. A later chunk's matmuls continue that accumulation (accumulate=True) from the exact fp32 value the
previous chunk left: the value goes back into PSUM through PE transposes (nc_transpose on the Tensor engine is
bit-exact and a matmul write, so nc_matmul_mx may accumulate onto it; a tensor_copy into PSUM may not:
docs/simulator.md#choice-psum-accumulate,
https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.nc_transpose.html). It is
spilled transposed (PE transposes as well), [n, m] per 128-column block, so that the reload's transposes give
[m, n] back. Chunks start at multiples of K_CHUNK_ALIGN (whole scale tiles): every K tile is quantized as in one
plan.
"""
from __future__ import annotations

import dataclasses

import nki.isa as nisa
import nki.language as nl

from ..kernel_helpers import ceil_div, kernel_assert, round_up
from .constants import (K_CHUNK_ALIGN, K_CHUNK_FIRST_DEFERRED_K_TILES, K_CHUNK_PANEL_PIECE_BYTES,
                        LAST_FETCH_RING_MAX_HELD_BYTES, PARTIAL_LAST_FETCH_SLOTS, PARTIAL_RING_SLOTS,
                        PARTIAL_SUM_HBM_BYTES, PARTITIONS, PSUM_BANK_BYTES, PSUM_BANK_COLUMNS, PSUM_BUFFERS, PSUM_BYTES,
                        RESIDENT_OPERAND_BUDGET_BYTES, STATIONARY_LOAD_WIDTH, STATIONARY_PANEL_BUDGET_BYTES)
from .overlap import prefetch_staging
from .panel_builder import words_above_whole_max
from .panels import k_tiles, panel_bytes_per_partition
from .plan import MatmulPlan


def k_chunk_rows(plan, stationary, moving, setup) -> int:
    """K rows per chunk for `plan` (a MatmulPlan of one product), or 0 when it should run as it is: it keeps an
    operand's panels resident already and loads its [K, F] stationary operand at full width (or it uses an earlier
    phase's panels), or an operand cannot be cut along K (pre-quantized along a contiguous K; BF16 setups are not
    chunked), or the chunks' fp32 sums would move more HBM bytes than they save: the moving operand's re-reads (at
    equal bytes the chunks win: a re-read of a bf16 operand is quantized again; H = 7168, I = 2048, S = 16384
    modeled 7.667 ms chunked against 8.182 ms without phase 3's), or, with an operand resident, the stationary
    operand's bytes, whose loads STATIONARY_PANEL_BUDGET_BYTES narrowed (S = 16384, H = 2048, I = 768: dY 256
    columns wide, 512-byte DMA runs; two chunks of 8192 rows modeled 1.016 ms against 1.132).

    Chunks: as few as let (a) the smaller operand's chunk fit RESIDENT_OPERAND_BUDGET_BYTES and (b) a [K, F]
    stationary operand's chunk load STATIONARY_LOAD_WIDTH columns within STATIONARY_PANEL_BUDGET_BYTES (its DMA runs
    stay 1 KiB long: S = 32768, H = 2048, I = 768 modeled 2.197 ms in two chunks of 16384 rows, whose dY loads were
    256 columns wide, against 2.040 in four of 8192; 4096-row chunks: 2.087), in whole multiples of K_CHUNK_ALIGN,
    all of one length when at most twice as many chunks give that and pass the bytes rule (else the last is
    shorter: H = I = 2880, S = 16384, phase 3 in 6144 + 6144 + 4096 rows; four of 4096 would spill more than the
    re-reads)."""
    if (not setup.is_mx or len(stationary) != 1 or len(moving) != 1 or not plan.order
            or plan.stationary[0].resident):
        return 0
    if any(op.prequantized and not op.panel_layout for op in (stationary[0], moving[0])):
        return 0
    (m_lo, m_hi), (n_lo, n_hi) = plan.ranges
    k, narrower = stationary[0].k_size, min(m_hi - m_lo, n_hi - n_lo)
    load = min(STATIONARY_LOAD_WIDTH, m_hi - m_lo) if stationary[0].k_axis == 0 else 0
    kept = plan.keep_moving or plan.stationary[0].keep_all
    if kept and not (load and (plan.stationary[0].load_width or plan.m_tile) < load):
        return 0  # an operand resident and full-width stationary loads: nothing to gain
    # what the chunks save: the moving operand's re-reads, or (an operand resident already, the stationary loads
    # narrowed by a long K) the stationary operand's bytes, whose DMA runs at least double
    saved = _hbm_bytes(stationary[0], m_hi - m_lo) if kept else _moving_rereads(plan, moving[0])
    fitting = []
    for chunks in range(2, ceil_div(k, K_CHUNK_ALIGN) + 1):
        rows = round_up(ceil_div(k, chunks), K_CHUNK_ALIGN)
        if (panel_bytes_per_partition(rows, narrower, setup) <= RESIDENT_OPERAND_BUDGET_BYTES and
                panel_bytes_per_partition(rows, load, setup) <= STATIONARY_PANEL_BUDGET_BYTES):
            fitting.append(rows)
    if not fitting:
        return 0
    # chunks of one length where up to twice as many give that: the chunk plans then hold the same tiles (S = 65536:
    # seven of 10240 rows and a last of 4096 left a tile with no SBUF placement; eight of 8192 modeled 3.974 ms)
    few = ceil_div(k, fitting[0])
    equal = [r for r in fitting if round_up(k, K_CHUNK_ALIGN) % r == 0 and ceil_div(k, r) <= 2 * few]
    for rows in equal[:1] + fitting[:1]:
        spilled = PARTIAL_SUM_HBM_BYTES * (m_hi - m_lo) * (n_hi - n_lo) * (ceil_div(k, rows) - 1)
        if rows < k and spilled <= saved:
            return rows
    return 0


def _moving_rereads(plan, op) -> int:
    """HBM bytes `plan` reads its moving operand `op` beyond once: it sweeps it once per group of stationary panels
    (K-streamed: the group's g panels; else the m tiles of one group of stationary loads)."""
    (m_lo, m_hi), (n_lo, n_hi) = plan.ranges
    m_tiles = ceil_div(m_hi - m_lo, plan.m_tile)
    if plan.stream != None:  # noqa: E711
        group = plan.stream[0]
    else:
        source = plan.stationary[0]
        group = max(1, source.capacity * (source.load_width or plan.m_tile) // plan.m_tile)
    return (ceil_div(m_tiles, group) - 1) * _hbm_bytes(op, n_hi - n_lo)


def _hbm_bytes(op, width: int) -> int:
    """HBM bytes of `width` columns of operand `op` over its K: MX words (+ 1/32 scales) or bf16."""
    return op.k_size * width * (1 if op.panel_layout else 2)


class PartialSums(nl.NKIObject):
    """fp32 sums of a K-chunked plan's output tiles between two chunks, in this core's private HBM.

    Dimensions:
        hbm [tiles, 128, n_tile rounded up to 128] fp32: tile (m0, n0)'s sums transposed per 128-column block:
        row r, column c0 + m holds out[m0 + m, n0 + c0 + r] (c0 a multiple of 128).
        ring [128, PARTIAL_RING_SLOTS x width] fp32 in SBUF, one per tail of a chunk that spills (its tiles after its
        last load, MatmulPlan.last_load, and that tile's spill): slot FETCH_SLOT the fetched sums of the next tile to
        reload (the next chunk's first tile's too, once this chunk's last was reloaded), EVICT_SLOT / FLIP_SLOT the
        tile being spilled (as evicted from PSUM, as transposed). Allocated at the tail's first access, before the
        next chunk's first loads (prefetched under this tail), the tail's short-lived tiles take no new SBUF after
        them (constants.py PARTIAL_RING_SLOTS). The last chunk (it only reloads) fetches into one allocation of
        last_slots [128, width] tiles, taken in turn, for the same reason under the next plan's first loads (two where
        plan_matmul finds them room, PARTIAL_LAST_FETCH_SLOTS: a fetch then need not wait for the tile before's
        reload). Elsewhere (a spilling chunk's head) a tile per spill and per fetch, placed as they come: a ring live
        across a chunk's own panel loads put S = 16384 / 32768, H = I = 2880 past SBUF (round 51a of
        docs/dense-performance.md).
    """

    FETCH_SLOT, EVICT_SLOT, FLIP_SLOT = 0, 1, 2

    def __init__(self, ranges, m_tile: int, n_tile: int):
        (m_lo, m_hi), (n_lo, n_hi) = ranges
        self.m_lo, self.n_lo, self.m_tile, self.n_tile = m_lo, n_lo, m_tile, n_tile
        self.n_count = ceil_div(n_hi - n_lo, n_tile)
        self.width = round_up(n_tile, PARTITIONS)
        count = ceil_div(m_hi - m_lo, m_tile) * self.n_count
        self.hbm = nl.ndarray((count, PARTITIONS, self.width), dtype=nl.float32, buffer=nl.private_hbm)
        self.fetched = []  # [(tile index, SBUF tile)] DMAed ahead of their reload (at most one)
        self.deferred = []  # [(m0, n0, nsz)] a fetch waiting for the ring's fetch slot (the next chunk's first tile)
        self.tail_tiles = []  # tile indices of the running spilling chunk's tail (open_chunk)
        self.in_tail = False  # that chunk's tail began: spills and fetches go through the ring
        self.ring = None
        self.last_chunk = False  # the last spilling chunk closed: the chunk running only reloads
        self.last_fetch = None  # its fetch ring [128, last_slots x width], its slots reused in turn by its fetches
        self.last_slots = 1  # that ring's slots (plan_matmul: PARTIAL_LAST_FETCH_SLOTS where they fit)
        self.last_turn = 0  # fetches into that ring so far

    def index(self, m0: int, n0: int) -> int:
        return (m0 - self.m_lo) // self.m_tile * self.n_count + (n0 - self.n_lo) // self.n_tile

    def open_chunk(self, tail_tiles) -> None:
        """A chunk that spills begins (SpillEpilogue.prepare): `tail_tiles`, its (m0, n0) after its last load."""
        self.tail_tiles = [self.index(m0, n0) for m0, n0 in tail_tiles]
        self.in_tail, self.ring, self.last_chunk = False, None, False

    def close_chunk(self) -> None:
        """That chunk ended (SpillEpilogue.finish): until another opens, the chunk running (the last) fetches into one
        tile of its own, reused."""
        self.fetch_deferred()
        self.tail_tiles, self.in_tail, self.ring, self.last_chunk = [], False, None, True

    def _slot(self, slot: int):
        """The ring's slot `slot`, a [128, width] fp32 view (a ring allocated at its first use in a tail)."""
        if self.ring == None:  # noqa: E711
            self.ring = nl.ndarray((PARTITIONS, PARTIAL_RING_SLOTS * self.width), dtype=nl.float32, buffer=nl.sbuf)
        return self.ring[:, slot * self.width:(slot + 1) * self.width]

    def _tile(self, slot: int):
        """Where the next spill (EVICT_SLOT, FLIP_SLOT) or fetch (FETCH_SLOT) goes: the ring's slot in a tail; the
        last chunk's fetch tile; else a new [128, width] fp32 tile."""
        if self.in_tail:
            return self._slot(slot)
        if slot == self.FETCH_SLOT and self.last_chunk:
            if self.last_fetch == None:  # noqa: E711
                self.last_fetch = nl.ndarray((PARTITIONS, self.last_slots * self.width), dtype=nl.float32,
                                             buffer=nl.sbuf)
            k0 = self.last_turn % self.last_slots * self.width
            self.last_turn += 1
            return self.last_fetch[:, k0:k0 + self.width]
        return nl.ndarray((PARTITIONS, self.width), dtype=nl.float32, buffer=nl.sbuf)

    def spill(self, m0: int, msz: int, n0: int, nsz: int, acc) -> None:
        """Store tile (m0, n0)'s sums (acc [:rows, :nsz] in PSUM, rows = msz padded to the even M the matmuls
        wrote) transposed: evict on ScalarE, transpose each 128-column block on the PE array, copy, DMA."""
        rows = msz + msz % 2
        whole = rows == PARTITIONS and nsz % PARTITIONS == 0
        natural, flipped = self._tile(self.EVICT_SLOT), self._tile(self.FLIP_SLOT)
        nisa.tensor_copy(dst=natural[:rows, :nsz], src=acc[:rows, :nsz], engine=nisa.engine.scalar)
        for c0 in range(0, nsz, PSUM_BANK_COLUMNS):
            cw = min(PSUM_BANK_COLUMNS, nsz - c0)
            span = round_up(cw, PARTITIONS)
            bank = nl.ndarray((PARTITIONS, PSUM_BANK_COLUMNS), dtype=nl.float32, buffer=nl.psum)
            if not whole:  # blocks narrower than [128, 128]: the copy below reads the whole span
                nisa.memset(dst=bank[:, :span], value=0.0)
            for j0 in range(0, cw, PARTITIONS):
                w = min(PARTITIONS, cw - j0)
                nisa.nc_transpose(dst=bank[:w, j0:j0 + rows], data=natural[:rows, c0 + j0:c0 + j0 + w],
                                  engine=nisa.engine.tensor)
            nisa.tensor_copy(dst=flipped[:, c0:c0 + span], src=bank[:, :span], engine=nisa.engine.scalar)
        span = round_up(nsz, PARTITIONS)
        nisa.dma_copy(dst=self.hbm[self.index(m0, n0), :, :span], src=flipped[:, :span])

    def fetch(self, m0: int, n0: int, nsz: int) -> None:
        """DMA tile (m0, n0)'s spilled sums into SBUF ahead of its reload (MatmulPlan.prefetch). In a spilling chunk's
        tail (from the fetch of its first tail tile on) into the ring's fetch slot, or, that slot taken by a sum not
        reloaded yet (the next chunk's first tile, prefetched under the tail), once it is free (fetch_deferred)."""
        idx = self.index(m0, n0)
        if any(i == idx for i, _ in self.fetched) or any(self.index(a, b) == idx for a, b, _ in self.deferred):
            return
        self.in_tail = self.in_tail or any(i == idx for i in self.tail_tiles)
        if self.in_tail and self.fetched:
            self.deferred = self.deferred + [(m0, n0, nsz)]
            return
        waiting = [i for i, _ in self.fetched]
        kernel_assert(not waiting, f"PartialSums.fetch: tile {idx} fetched while tiles {waiting} wait for their "
                                   f"reload (one fetch ahead)")
        tile = self._tile(self.FETCH_SLOT)
        span = round_up(nsz, PARTITIONS)
        nisa.dma_copy(dst=tile[:, :span], src=self.hbm[idx, :, :span])
        self.fetched = [(idx, tile)]

    def fetch_deferred(self) -> None:
        """The fetch that waited for the ring's fetch slot, once that slot's sums were reloaded (SpillEpilogue at its
        chunk's last tile; reload)."""
        kernel_assert(len(self.deferred) <= 1, f"PartialSums: {len(self.deferred)} fetches deferred, at most one (the "
                                               f"next chunk's first tile)")
        if self.deferred and not self.fetched:
            (m0, n0, nsz), self.deferred = self.deferred[0], []
            self.fetch(m0, n0, nsz)

    def held_bytes(self) -> int:
        """SBUF bytes per partition the fetched sums take while the last chunk, which only reloads them, runs its last
        tiles (overlap.held_bytes_at_tail; a spilling chunk's are in its ring, SpillEpilogue.held_bytes): one
        [128, width] fp32 tile, the sums of the tile being reloaded. Uncounted, phase 4's first load under phase 3's
        last chunk at S = 28672, H = 2048, I = 768 fitted with 1.5 KiB to spare while such a 4.5 KiB tile was live,
        and two of its 15 KiB words pieces found no gap (refused; round 48b of docs/dense-performance.md). A second
        fetch tile (last_slots) is not counted: plan_matmul gives it only within LAST_FETCH_RING_MAX_HELD_BYTES."""
        return self.width * 4

    def ring_bytes(self) -> int:
        """SBUF bytes per partition of a tail's ring (PARTIAL_RING_SLOTS fp32 tiles)."""
        return PARTIAL_RING_SLOTS * self.width * 4

    def reload(self, m0: int, rows: int, n0: int, nsz: int, acc) -> None:
        """Put tile (m0, n0)'s sums back into acc [:rows, :nsz] (PSUM) by PE transposes, bit-exactly."""
        self.fetch_deferred()
        self.fetch(m0, n0, nsz)
        idx = self.index(m0, n0)
        flipped = [t for i, t in self.fetched if i == idx][0]
        for j0 in range(0, nsz, PARTITIONS):
            w = min(PARTITIONS, nsz - j0)
            nisa.nc_transpose(dst=acc[:rows, j0:j0 + w], data=flipped[:w, j0:j0 + rows], engine=nisa.engine.tensor)
        self.fetched = [(i, t) for i, t in self.fetched if i != idx]


class SpillEpilogue(nl.NKIObject):
    """Epilogue of a K-chunked plan's chunks but the last (MatmulPlan's epilogue protocol): spill each finished
    tile's sums to PartialSums, from its last loading tile on through the ring of its tail."""

    rings_fetched_sums = True  # held_bytes counts the reloaded sums (overlap.held_bytes_at_tail)

    def __init__(self, partials: PartialSums):
        self.partials = partials
        self.last_load = 0
        self.tiles = 0

    def prepare(self, plan) -> None:
        self.last_load, self.tiles = plan.last_load(), len(plan.order)
        self.partials.open_chunk([(m0, n0) for (m0, _), (n0, _) in plan.order[self.last_load + 1:]])

    def tile(self, i, m0, msz, n0, nsz, accumulators) -> None:
        if i >= self.last_load:  # the tail's ring (a reloading chunk's opens at its first tail tile's fetch)
            self.partials.in_tail = True
        if i == self.tiles - 1:  # the chunk's last reload is issued: the next chunk's first sums may take the slot
            self.partials.fetch_deferred()
        self.partials.spill(m0, msz, n0, nsz, accumulators[0])

    def finish(self) -> None:
        self.partials.close_chunk()

    def held_bytes(self, n_tile) -> int:
        """The tail's ring: the spilled tile (evicted, transposed) and the fetched sums of the tile reloaded or of the
        next chunk's first one (PARTIAL_RING_SLOTS tiles; the first chunk fetches the second's under its tail)."""
        return self.partials.ring_bytes()


class KChunkedPlan(nl.NKIObject):
    """A MatmulPlan cut along K (module docstring): `chunks` run one after the other, chunk c's first panels
    loading under chunk c - 1's last tiles when both fit SBUF. Offers MatmulPlan's interface to PhaseGraph
    (step, first_bytes, first_stationary_bytes, held_bytes, can_prefetch, can_load_under_tail, set_tail_load,
    adopt_staging, can_fence, fire_fence, stationary_on_chip, stream, order, spread_first_load, carry_first_load)."""

    def __init__(self, chunks):
        self.chunks = chunks
        self.done = 0  # chunks run to the end
        self.stream = None
        self.spread_first = False  # its first loads are taken whole (spread_first_load does not apply)
        self.order = chunks[-1].order
        self.ranges = chunks[0].ranges

    def first_bytes(self, own_rings: bool = False, moving_staging: int = 0) -> int:
        return self.chunks[0].first_bytes(own_rings, moving_staging)

    def stage_first_load(self, buffers: int) -> None:
        self.chunks[0].stage_first_load(buffers)

    def spread_first_load(self) -> None:
        """No change: a K-chunked plan's first chunk loads its first panels as before (MatmulPlan.spread_first_load
        spreads a single plan's)."""

    def carry_first_load(self, nxt) -> None:
        """No change: this plan's chunks do not carry the next plan's spread first load
        (MatmulPlan.carry_first_load)."""

    def short_tail_loads_whole(self) -> None:
        """The last chunk's (MatmulPlan.short_tail_loads_whole)."""
        self.chunks[-1].short_tail_loads_whole()

    def prefetch_point(self, nxt) -> None:
        """The last chunk's (MatmulPlan.prefetch_point): nxt's spread first load quantized whole after a short tail,
        its copies where overlap.spread_copies_fit allows them, its moving rings as the last chunk's prefetch_fits
        counted them. (Round 45 repeated only the short-tail rule here, leaving the copies on; no dense shape measured
        in round 48b begins a spread load under a K-chunked plan: unchanged there.)"""
        self.chunks[-1].prefetch_point(nxt)

    def first_stationary_bytes(self) -> int:
        return self.chunks[0].first_stationary_bytes()

    def held_bytes(self) -> int:
        return self.chunks[-1].held_bytes()

    def can_prefetch(self, nxt) -> bool:
        return self.chunks[-1].can_prefetch(nxt)

    def can_load_under_tail(self, nxt) -> bool:
        return self.chunks[-1].can_load_under_tail(nxt)

    def set_tail_load(self, step, nxt) -> None:
        self.chunks[-1].set_tail_load(step, nxt)

    def adopt_staging(self, tiles) -> None:
        self.chunks[0].adopt_staging(tiles)

    def can_fence(self) -> bool:
        return False

    def fire_fence(self) -> None:
        """Nothing to issue: set_fence does not apply (can_fence)."""

    def stationary_on_chip(self) -> bool:
        return False

    def _run_chunks(self, last: int) -> None:
        """Run chunks [done, last) to the end, each next one's first panels under its predecessor's tail."""
        while self.done < last:
            chunk, nxt = self.chunks[self.done], self.chunks[self.done + 1]
            # own staging rings only (prefetch_staging -1): the shallower first ring is PhaseGraph's, between phases
            if prefetch_staging(chunk, nxt) < 0:
                chunk.step("head")
                nxt.prefetch_first_deferring(K_CHUNK_FIRST_DEFERRED_K_TILES)
            chunk.step("all")
            self.done += 1

    def step(self, stage: str) -> "KChunkedPlan":
        """MatmulPlan.step's stages: "first" / "first_stationary" load the first chunk's first (stationary) panels;
        "head" runs every chunk but the last and the last one's head; "all" the rest."""
        if stage == "first" or stage == "first_stationary":
            self.chunks[0].step(stage)
        else:
            self._run_chunks(len(self.chunks) - 1)
            self.chunks[-1].step(stage)
        return self


def plan_matmul(stationary, moving, m_total, n_total, setup, config, split, epilogue, k_chunks=False, **options):
    """MatmulPlan(stationary, moving, m_total, n_total, setup, config, split, epilogue, **options), or with
    k_chunks=True, when k_chunk_rows cuts it, a KChunkedPlan of MatmulPlans over K windows of the operands
    (each keeping its smaller operand's chunk resident; the same tiles in every chunk). Chunk plans keep two
    accumulators and a PSUM bank for the spill's transposes: their n_tile is capped to fit.
    (The MLP backward's phases 3 and 4, K = S: at S = 32768, H = 2048, I = 768 each reads X, dY and the
    intermediate once instead of X and the intermediate twice.)"""
    plan = MatmulPlan(stationary, moving, m_total, n_total, setup, config, split, epilogue, **options)
    rows = k_chunk_rows(plan, stationary, moving, setup) if k_chunks else 0
    if not rows:
        return plan
    k = stationary[0].k_size
    widest = (PSUM_BYTES // PSUM_BANK_BYTES - 1) // PSUM_BUFFERS * PSUM_BANK_COLUMNS
    chunk_config = dataclasses.replace(config, n_tile=min(config.n_tile, widest))
    options = dict(options)
    options["ranges"] = plan.ranges
    options["interleave_lead"] = False  # later chunks reload their sums first (not K-interleaved)
    options["interleave_switch"] = False  # nor at moving panel switches (it does not take reload either)
    windows = [([stationary[0].k_window(k0, min(rows, k - k0))], [moving[0].k_window(k0, min(rows, k - k0))])
               for k0 in range(0, k, rows)]
    probes = [MatmulPlan(st, mv, m_total, n_total, setup, chunk_config, split, epilogue, **options)
              for st, mv in windows]
    first = probes[0]
    for probe in probes:
        resident = probe.keep_moving or probe.stationary[0].keep_all
        if probe.stream != None or not resident or probe.order != first.order:  # noqa: E711
            return plan  # a chunk would not keep an operand resident, or its tiles differ: no gain / no match
    partials = PartialSums(plan.ranges, first.m_tile, first.n_tile)
    chunks = []
    for c, (st, mv) in enumerate(windows):
        chunk_epilogue = epilogue if c == len(windows) - 1 else SpillEpilogue(partials)
        chunks.append(MatmulPlan(st, mv, m_total, n_total, setup, chunk_config, split, chunk_epilogue,
                                 reload=partials if c else None, **options))
        if c:  # its first panel loads under the chunk before's tail, in its holes (K_CHUNK_PANEL_PIECE_BYTES)
            for source in chunks[-1].moving:
                source.first_piece_bytes = K_CHUNK_PANEL_PIECE_BYTES
                # a shorter last chunk's panels in pieces too where the full chunks' are (PanelSource._placement's
                # rule across chunks: the same operand's panels, a gap no wider than the earlier pieces leave)
                source.words_in_pieces = words_above_whole_max(len(k_tiles(rows, setup)), chunks[0].n_tile)
    # the last chunk's fetches alternate between two tiles where the second fits beside what it holds at its tail
    if chunks[-1].held_bytes() + partials.held_bytes() <= LAST_FETCH_RING_MAX_HELD_BYTES:
        partials.last_slots = PARTIAL_LAST_FETCH_SLOTS
    return KChunkedPlan(chunks)
