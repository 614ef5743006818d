"""Phase 1's epilogue of the MXFP8 SwiGLU MLP backward (mlp_bwd_mxfp8_kernel.py): per output tile of [S, I],
the SwiGLU derivative, the intermediate for phase 4 and the d_gate_up stores; with S-tile-major plans also phase 2's
stationary panels (built on chip one S tile late) and phase 3's d_gate_up quantized along S (exchange_along_s).

The kernel module reads top to bottom like the algorithm (phase functions, then the phase graph); this module holds
the per-tile work of phase 1 that the matmul layer's MatmulPlan calls back (the epilogue protocol of
nkilib/core/matmul/plan.py).
"""
from __future__ import annotations

import nki.isa as nisa
import nki.language as nl

from ....core.kernel_helpers import ceil_div, kernel_assert, round_up
from ....core.matmul import (ResidentPanels, panel_bytes_per_partition, panels_from_row_blocks, stage_row_block,
                             store_k_tile)
from ....core.matmul.panels import PanelGroupBlock
from ....core.swiglu import intermediate_tile, swiglu_backward_tile, swiglu_forward_terms
from .constants import (ALONG_S_HALF_FROM_COPY, ALONG_S_SPREAD_S_TILES, ALONG_S_SPREAD_STAGING_BYTES,
                        ALONG_S_WORDS_WHOLE_MAX_BYTES, CHECKPOINT_BUFFERS, GATE_FIRST_S_TILES, MX_K_ALIGN, MX_K_TILE,
                        MX_PACK, PARTITIONS,
                        PHASE2_STATIONARY_BUDGET_BYTES, PHASE2_STATIONARY_SEPARATE_PANELS, PLAIN_SWITCH_GATE_PSUM_FIRST,
                        SWITCH_D_GATE_ON_VECTOR)

__all__ = ["SwigluBackwardEpilogue"]


class SwigluBackwardEpilogue(nl.NKIObject):
    """Phase 1's MatmulPlan epilogue per [msz, nsz] tile of [S, I]: d_gate / d_up from dI (and the
    recomputed gate_pre / up), the intermediate for phase 4, stores of d_gate_up.

    With the moving panels resident (m-major), a whole d_gate_up row block [msz, 2I] is finished per S
    tile: it is gathered in SBUF, stored once with 2I-long runs and, when asked (keep_for_phase2), one S
    tile later transposed and quantized along 2I into phase 2's stationary panel (TensorE runs in program
    order, so building it right after the tile's own matmuls keeps the transposes off the epilogue's path).
    """

    def __init__(self, gate_pre_td, gate_act_td, up_td, d_gate_up_td, scratch_td, clamp, s_base, I, dtype, setup,
                 keep_for_phase2):
        self.gate_pre_td, self.gate_act_td, self.up_td = gate_pre_td, gate_act_td, up_td
        self.d_gate_up_td, self.scratch_td = d_gate_up_td, scratch_td
        self.clamp, self.s_base, self.I, self.dtype, self.setup = clamp, s_base, I, dtype, setup
        self.keep_for_phase2 = keep_for_phase2
        self.fused = False
        self.along_s = None  # (words, scales) HBM panel layout of d_gate_up quantized along S (exchange_along_s)
        self.defer_last_along_s = False  # the last K tile's quantize along S waits for flush_along_s
        self.stage = None  # interleaved staging tile [128, 4, 2I] of the current 512-row K tile
        self.along_s_pending = None  # (K tile, stage, words, scale, next column) of a K tile being quantized
        self.resident = None  # ResidentPanels for phase 2 after finish() (fused only)
        self.defer_last_panel = False  # the last S tile's panel quantized when phase 2 reads it (prepare, finish)
        self.pending, self.panels = [], []  # finished row blocks whose phase-2 panels are not built yet; panels
        self.rows = None
        self.block = None  # PanelGroupBlock of the kept panels (prepare: more than PHASE2_STATIONARY_SEPARATE_PANELS)
        self.chunks_after_products = False  # chunks along S quantized after their call's products (prepare)
        self.spread_along_s = False  # spreads_along_s(plan), set by prepare
        self.last_tile_gate_first = False  # the last GATE_FIRST_S_TILES S tiles' d_gate products first, the last
        # tile's staging copy on swdge

    def exchange_along_s(self, words_hbm, scales_hbm, defer_last=False) -> None:
        """Also quantize each finished 512-row block of d_gate_up along S (phase 3's K) on chip and store it
        in the panel layout (words_hbm [S/4, 2I] x4, scales_hbm, TensorDescriptor.panel_layout) instead of
        storing the bf16 rows: phase 3 then reads both cores' halves quantized (half the bytes, no second
        quantize_mx). Only for S-tile-major plans over whole rows whose S range is in whole 512-row K tiles
        (the caller checks: mx_along_s_applies).

        defer_last: finish() leaves the last K tile's quantize along S and its store to flush_along_s (the caller
        issues it before the sync point that precedes phase 3's reads, later in program order than the next phase's
        first quantizes, which VectorE then runs first)."""
        self.along_s = (words_hbm, scales_hbm)
        self.defer_last_along_s = defer_last

    def prepare(self, plan) -> None:
        (m_lo, m_hi), (n_lo, n_hi) = plan.ranges
        self.m_lo, self.m_hi, self.n_lo, self.n_hi = m_lo, m_hi, n_lo, n_hi
        self.m_tile, self.ncols, self.keep = plan.m_tile, plan.n_tile, plan.keep_moving
        # gate_pre / up / gate_act tiles in a ring of CHECKPOINT_BUFFERS sets: tile i's loads wait for tile
        # i - CHECKPOINT_BUFFERS's epilogue instead of running ahead and sharing the DMA queues with the
        # operand loads the next matmuls wait for (phase 1's start waits on W_down)
        kinds = 3 if self.gate_act_td != None else 2  # noqa: E711
        self.checkpoints = [[nl.ndarray((PARTITIONS, plan.n_tile), dtype=nl.bfloat16, buffer=nl.sbuf)
                             for _ in range(kinds)] for _ in range(CHECKPOINT_BUFFERS)]
        two_i = 2 * self.I
        self.fused = self.keeps_for_phase2(plan)
        self.d_gate_switch = self.switches_d_gate_on_vector(plan)
        # more kept S tiles than PHASE2_STATIONARY_SEPARATE_PANELS: phase 2's stationary panels in one SBUF block (a
        # slot per S tile) instead of one allocation each, which next-fit strews over SBUF
        kept = ceil_div(m_hi - m_lo, plan.m_tile)
        if self.fused and self.setup.is_mx and kept > PHASE2_STATIONARY_SEPARATE_PANELS:
            self.block = PanelGroupBlock(kept, two_i, plan.m_tile + plan.m_tile % 2, self.setup)
        self.row_width = round_up(two_i, MX_K_ALIGN) if (self.fused and self.setup.is_mx) else two_i
        # epilogue calls a finished K tile's quantize along S is spread over (one chunk of 2I / calls columns each)
        n_blocks = ceil_div(n_hi - n_lo, self.ncols)
        self.along_s_calls = n_blocks * (ALONG_S_SPREAD_S_TILES if self.spreads_along_s(plan) else 1)
        self.defer_last_panel = self.fused and self.spreads_along_s(plan)  # see finish()
        # spread over two S tiles, a K tile's last chunk along S (and chunk 1 of this core's first K tile) is quantized
        # after its epilogue call's products, not before them: VectorE (program order) then computes them first, and
        # GpSimd's d_gate product and the PE transposes that wait for it start earlier; the other chunks stay before
        # the products (_chunk_after_products). TP8 modeled 0.6219 / 0.7005 -> 0.6211 / 0.7005 ms (last chunks), ->
        # 0.6208 / 0.7014 (and the first K tile's chunk 1); chunk 1 of every K tile 0.6208 / 0.7033, the first n
        # block's chunks 0.6408 (round 27 of docs/dense-performance.md). Not spread: unchanged (the second n block's
        # chunk after its products there: S = 16384, H = I = 2880 4.5330 / 5.0876 -> 4.5332 / 5.1347 ms)
        self.spread_along_s = self.spreads_along_s(plan)
        self.chunks_after_products = self.spread_along_s
        # spread and deferred (LNC2), the last S tile's d_gate products go before d_up's, so GpSimd's d_gate product
        # and the last panel's transposes start earlier (phase 1's TensorE ends 0.9 us earlier), and that tile's
        # along-S staging copy (768 KB SBUF -> SBUF, read only by flush_along_s at the barrier) goes through
        # GpSimd's software DGE: queued behind the last GpSimd product, it no longer shares the DMA queues with
        # phase 2's first W_gu K tiles (on the hardware DGE it lands them ~0.6 us late and phase 2's first span
        # waits). TP8 modeled 0.62082 / 0.70143 -> 0.62068 / 0.70053 ms; d_gate first alone 0.62141 / 0.70053
        # (round 28 of docs/dense-performance.md); the products of the last GATE_FIRST_S_TILES (2) S tiles d_gate first:
        # the pessimistic case's VectorE reaches the last S tile's dY quantize earlier (0.70053 -> 0.69975 ms, round 29)
        self.last_tile_gate_first = self.chunks_after_products and self.defer_last_along_s

    def _d_gate_engine(self, m0: int, msz: int, n0: int, nsz: int):
        """Engine of tile (m0, n0)'s d_gate product: VectorE at an S tile switch (the S tile's last n block, not the
        core's last S tile) where switches_d_gate_on_vector holds, so the next S tile's dY quantize does not wait for
        the SBUF bus GpSimd's product would hold; GpSimd otherwise."""
        switch = self.d_gate_switch and n0 + nsz == self.n_hi and m0 + msz < self.s_base + self.m_hi
        return nisa.engine.vector if switch else nisa.engine.gpsimd

    def switches_d_gate_on_vector(self, plan) -> bool:
        """Whether the S tile switches' d_gate products run on VectorE (SWITCH_D_GATE_ON_VECTOR): all of I on this
        core (split along S), and either more than one n block per S tile (a switch every few tiles) or the rows kept
        for phase 2 (keeps_for_phase2, whose panel transposes and quantizes fill phase 1's switches). With one n block
        and the rows not kept every tile is a switch and VectorE, which also quantizes dY and the rows along S, takes
        every d_gate product: H = 2048, I = 768 at S = 12288 / 16384 modeled 0.76336 / 0.87900 -> 0.78373 / 0.88881
        and 1.01583 / 1.19523 -> 1.04263 / 1.20833 ms with it (round 41 of docs/dense-performance.md)."""
        (_, _), (n_lo, n_hi) = plan.ranges
        return (SWITCH_D_GATE_ON_VECTOR and (n_lo, n_hi) == (0, self.I) and
                (ceil_div(n_hi - n_lo, plan.n_tile) > 1 or self.keeps_for_phase2(plan)))

    def spreads_along_s(self, plan) -> bool:
        """Whether a finished K tile's quantize along S (exchange_along_s) is spread over ALONG_S_SPREAD_S_TILES S
        tiles instead of one: phase 1 has more than one n block and two K tiles' staging tiles (the spread one and the
        next one's first row blocks) fit ALONG_S_SPREAD_STAGING_BYTES each. VectorE then quantizes a quarter of 2I per
        epilogue call instead of a half (two n blocks: TP8), and TensorE stops waiting for it every fourth S tile
        (TP8: phase 1 ends 6.5 us earlier), paid out where phase 2's fence follows its second W_gu panel's loads
        (MatmulPlan.fence_after_first_panel). One n block (H = 2048, I = 768): 0.2571 -> 0.2581 ms, not spread."""
        (_, _), (n_lo, n_hi) = plan.ranges
        staging = MX_PACK * 2 * self.I * 2  # bf16 [128, 4, 2I] per partition
        return (self.along_s != None and ceil_div(n_hi - n_lo, plan.n_tile) > 1 and  # noqa: E711
                staging <= ALONG_S_SPREAD_STAGING_BYTES)

    def keeps_for_phase2(self, plan) -> bool:
        """Whether this core's d_gate_up rows stay on chip as phase 2's stationary panels (keep_for_phase2, every I
        column on this core, the moving panels resident, the panels within PHASE2_STATIONARY_BUDGET_BYTES)."""
        (m_lo, m_hi), (n_lo, n_hi) = plan.ranges
        return (self.keep_for_phase2 and plan.keep_moving and (n_lo, n_hi) == (0, self.I) and
                ceil_div(m_hi - m_lo, plan.m_tile) * panel_bytes_per_partition(2 * self.I, plan.m_tile, self.setup)
                <= PHASE2_STATIONARY_BUDGET_BYTES)

    def tile(self, i, m_rel, msz, n0, nsz, accumulators) -> None:
        m0 = self.s_base + m_rel
        I, two_i, ncols, dtype = self.I, 2 * self.I, self.ncols, self.dtype
        d_i = accumulators[0]
        g_psum = accumulators[1] if self.gate_pre_td == None else None  # noqa: E711
        u_psum = accumulators[-1] if self.up_td == None else None  # noqa: E711
        if self.pending and n0 == self.n_lo:
            # built one S tile late, after this tile's matmuls: TensorE runs in program order and would
            # otherwise wait for the previous tile's epilogue before these transposes
            self.panels.extend(panels_from_row_blocks(self.pending, self.setup, block=self.block,
                                                      m_lo=self.m_lo, m_tile=self.m_tile))
        chunk_after = self._chunk_after_products()
        plain_switch = self.along_s_pending == None and n0 == self.n_lo  # noqa: E711  (before this call's chunk)
        if self.along_s_pending != None and not chunk_after:  # noqa: E711
            self._quantize_along_s_chunk()
        ring = self.checkpoints[i % CHECKPOINT_BUFFERS]
        gate_pre = _bf16_tile(ring[0], self.gate_pre_td, g_psum, m0, msz, n0, nsz)
        up = _bf16_tile(ring[1], self.up_td, u_psum, m0, msz, n0, nsz)
        if self.keep:
            if n0 == self.n_lo:
                self.rows = nl.ndarray((PARTITIONS, self.row_width), dtype=dtype, buffer=nl.sbuf)
                if self.row_width > two_i:  # zero K padding of phase 2's operand
                    nisa.memset(dst=self.rows[:msz, two_i:], value=0.0)
            rows = self.rows
            d_gate, d_up = rows[:msz, n0:n0 + nsz], rows[:msz, I + n0:I + n0 + nsz]
        else:
            d_gate = nl.ndarray((PARTITIONS, ncols), dtype=dtype, buffer=nl.sbuf)[:msz, :nsz]
            d_up = nl.ndarray((PARTITIONS, ncols), dtype=dtype, buffer=nl.sbuf)[:msz, :nsz]
        last_tile = self.last_tile_gate_first and m0 + msz >= self.s_base + self.m_hi
        gate_first = (self.last_tile_gate_first and
                      m0 + msz + (GATE_FIRST_S_TILES - 1) * self.m_tile >= self.s_base + self.m_hi)
        # where the last tiles go gate-first (TP8), every other S tile's first n block with no along-S chunk to quantize
        # (a plain S tile switch) issues d_gate's PSUM product first (PLAIN_SWITCH_GATE_PSUM_FIRST)
        gate_psum_first = (PLAIN_SWITCH_GATE_PSUM_FIRST and self.last_tile_gate_first and plain_switch and
                           not gate_first)
        _swiglu_backward_tile(d_i[:msz, :nsz], gate_pre, up, self.gate_act_td, ring[-1], self.scratch_td, self.clamp,
                              m0, msz, n0, nsz, ncols, d_gate, d_up, gate_first=gate_first,
                              d_gate_engine=self._d_gate_engine(m0, msz, n0, nsz), gate_psum_first=gate_psum_first)
        if chunk_after:
            self._quantize_along_s_chunk()
        out = self.d_gate_up_td
        if not self.keep:
            nisa.dma_copy(dst=out[m0:m0 + msz, n0:n0 + nsz], src=d_gate)
            nisa.dma_copy(dst=out[m0:m0 + msz, I + n0:I + n0 + nsz], src=d_up)
        elif n0 + nsz == self.n_hi:  # row block complete
            if self.along_s != None:  # noqa: E711
                self._quantize_along_s(m0, rows, two_i, nisa.dge_mode.swdge if last_tile else nisa.dge_mode.unknown)
            # bf16 rows in HBM only for a reader: phase 2 when they are not its resident panels, phase 3
            # when it does not read the MX words
            if self.along_s == None or not self.fused:  # noqa: E711
                if (self.n_lo, self.n_hi) == (0, I):
                    nisa.dma_copy(dst=out[m0:m0 + msz, :], src=rows[:msz, :two_i])
                else:
                    width = self.n_hi - self.n_lo
                    for c in (self.n_lo, I + self.n_lo):
                        nisa.dma_copy(dst=out[m0:m0 + msz, c:c + width], src=rows[:msz, c:c + width])
            if self.fused:
                self.pending.append((m_rel, msz, rows, two_i))

    def _quantize_along_s(self, m0, rows, two_i, dge_mode) -> None:
        """Row block [m0, m0 + 128) of d_gate_up into its K tile's staging tile (a DMA of `dge_mode`); after the K
        tile's fourth block, mark it pending: the next epilogue calls quantize it along S (K=S of phase 3) and store it
        in the panel layout chunk by chunk (_quantize_along_s_chunk)."""
        block = (m0 % MX_K_TILE) // PARTITIONS
        if block == 0:
            self.stage = nl.ndarray((PARTITIONS, MX_PACK, two_i), dtype=nl.bfloat16, buffer=nl.sbuf)
        stage_row_block(self.stage, rows, block, two_i, self.setup, dge_mode=dge_mode)
        if block == MX_PACK - 1:
            words = self._along_s_words(two_i)
            scale = nl.ndarray((PARTITIONS, two_i), dtype=nl.uint8, buffer=nl.sbuf)
            self.along_s_pending = (m0 // MX_K_TILE, self.stage, words, scale, 0)
            self.stage = None

    def along_s_words_per_chunk(self) -> bool:
        """Whether a K tile's words along S go in one allocation per along-S chunk instead of one [P, 2I] x4: where
        phase 1 keeps phase 2's panels as separate allocations (strewn over SBUF by next-fit), quantizes K tiles along
        S among its own tiles (more than one K tile on this core: all but the last are quantized during phase 1) and
        the words are above ALONG_S_WORDS_WHOLE_MAX_BYTES. Each chunk's columns, and the unit-stride copy it borrows
        from the next chunk's (_along_s_copy_home), then lie in one allocation."""
        return (self.fused and self.block == None and self.along_s_calls >= 2 and  # noqa: E711
                2 * self.I * MX_PACK > ALONG_S_WORDS_WHOLE_MAX_BYTES and self.m_hi - self.m_lo > MX_K_TILE)

    def _along_s_words(self, two_i):
        """A K tile's words along S as [(first column, [P, columns] x4 tile)]: one [P, 2I] tile, or one per along-S
        chunk where along_s_words_per_chunk holds."""
        x4 = self.setup.x4_dtype
        if not self.along_s_words_per_chunk():
            return [(0, nl.ndarray((PARTITIONS, two_i), dtype=x4, buffer=nl.sbuf))]
        width = ceil_div(two_i, self.along_s_calls)
        return [(c, nl.ndarray((PARTITIONS, min(width, two_i - c)), dtype=x4, buffer=nl.sbuf))
                for c in range(0, two_i, width)]

    def _quantize_along_s_chunk(self, from_copy=True) -> None:
        """Quantize the next columns of the pending K tile: 2I / along_s_calls columns per epilogue call of the
        next S tile, or of the next ALONG_S_SPREAD_S_TILES S tiles (spreads_along_s) (VectorE runs in program
        order: one 2I-wide quantize_mx would hold back that tile's quantizes and epilogue), and store those
        columns right after their quantize: the DMA queues then carry the K tile's words as shorter stores
        spread over the S tile(s) instead of one 2I-wide store after its last chunk (which shared the queues
        with phase 2's first W_gu K tiles at phase 1's end and held up the barrier in the pessimistic case).
        Each column's words and scales are the same either way.

        from_copy: the chunk's last half is quantized from a unit-stride copy that ScalarE makes where
        _along_s_copy_home finds room (ALONG_S_HALF_FROM_COPY). flush_along_s passes False: its chunks run at phase 1's
        end or at the barrier, where ScalarE's copies would wait behind phase 2's start (TP8 modeled 0.61670 / 0.67465
        -> 0.62364 / 0.68000 ms with them; round 36 of docs/dense-performance.md)."""
        t, stage, words, scale, c0 = self.along_s_pending
        two_i = 2 * self.I
        c1 = min(two_i, c0 + ceil_div(two_i, self.along_s_calls))
        src = stage[:, :, c0:c1].permute((0, 2, 1))  # strided: the 4 packed values from the 4 row blocks
        h0, staged = c1, None  # columns from h0 on are quantized from the unit-stride copy `staged`
        home = self._along_s_copy_home(c0, c1) if from_copy else None
        if home != None:  # noqa: E711
            h0 = c1 - (c1 - c0) // 2
            # words columns [home, home + 2 (c1 - h0)) as bf16 [P, c1 - h0, 4]: 2 bf16 per x4 word
            part, off = _words_columns(words, home, home + (c1 - h0) * MX_PACK // 2)
            staged = part.view(nl.bfloat16)[:, 2 * off:2 * off + (c1 - h0) * MX_PACK]
            staged = staged.reshape((PARTITIONS, c1 - h0, MX_PACK))
            nisa.tensor_copy(dst=staged, src=src[:, h0 - c0:, :], engine=nisa.engine.scalar)
        # MX groups run along S (partitions x the 4 slots), never across columns: two column ranges quantized apart give
        # the whole chunk's words and scales bit for bit
        part, off = _words_columns(words, c0, c1)
        nisa.quantize_mx(dst=part[:, off:off + h0 - c0], src=src[:, :h0 - c0, :], dst_scale=scale[:, c0:h0])
        if staged != None:  # noqa: E711
            nisa.quantize_mx(dst=part[:, off + h0 - c0:off + c1 - c0], src=staged, dst_scale=scale[:, h0:c1])
        store_k_tile(part[:, off:off + c1 - c0], scale[:, c0:c1], self.along_s[0], self.along_s[1], t, self.setup,
                     f0=c0)
        self.along_s_pending = (t, stage, words, scale, c1) if c1 < two_i else None

    def _along_s_copy_home(self, c0, c1):
        """The first words column of the SBUF room where ScalarE copies the last half of along-S chunk [c0, c1) as a
        unit-stride bf16 [P, half, 4] (ALONG_S_HALF_FROM_COPY), or None: the next chunk's words (written only by that
        chunk's own quantize, later on VectorE), or for the K tile's last chunk its first chunk's words (stored one S
        tile earlier; the copy waits for that store). None with one chunk per K tile (no other words to borrow), for
        the last chunk where the chunks are not spread (the first chunk's store is then one epilogue call old and
        ScalarE, in order, would wait for it: Llama3-8B TP8 modeled 0.72899 -> 0.73916 ms central), or where the
        borrowed columns would not hold the copy (2 x half words columns)."""
        two_i = 2 * self.I
        width = ceil_div(two_i, self.along_s_calls)
        need = 2 * ((c1 - c0) // 2)
        if not ALONG_S_HALF_FROM_COPY or self.along_s_calls < 2 or need == 0:
            return None
        if c1 >= two_i and not self.spread_along_s:
            return None
        home = c1 if c1 < two_i else 0
        room = min(two_i, home + width) - home
        return home if need <= room and (home >= c1 or home + need <= c0) else None

    def _chunk_after_products(self) -> bool:
        """Whether the pending K tile's next chunk along S goes after this epilogue call's products (where spread,
        chunks_after_products): its last chunk, and chunk 1 of this core's first K tile. Chunk 1 of the later K tiles
        stays before them: there the shifted SBUF placements put the next panel's copies behind a row block's staging
        DMA (TP8 modeled, chunk 1 of K tile 0 / 1 / 2 after the products: 0.6208 / 0.6210 / 0.6212 ms)."""
        if not self.chunks_after_products or self.along_s_pending == None:  # noqa: E711
            return False
        two_i = 2 * self.I
        width = ceil_div(two_i, self.along_s_calls)  # _quantize_along_s_chunk's columns per call
        t, _, _, _, c0 = self.along_s_pending
        first_k_tile = (self.s_base + self.m_lo) // MX_K_TILE  # this core's first K tile along S
        return c0 + width >= two_i or (c0 == width and t == first_k_tile)

    def held_bytes(self, n_tile) -> int:
        """Not needed: phase 1 is never overlapped with another plan (a sync point follows it)."""
        return 0

    def flush_along_s(self) -> None:
        """Quantize along S and store what is left of the last K tile (exchange_along_s)."""
        while self.along_s_pending != None:  # noqa: E711
            self._quantize_along_s_chunk(from_copy=False)

    def finish(self) -> None:
        # where phase 1 spreads its along-S quantize (TP8), the last S tile's panel is transposed now (TensorE runs it
        # before phase 2's matmuls) and quantized when phase 2 first reads it (the last tile of its first n block), so
        # phase 2's first W_gu quantizes go ahead of it on VectorE (DeferredRowPanel; TP8 modeled 0.6272 / 0.7117 ->
        # 0.6248 / 0.7026 ms; Llama3-8B TP8, no spread: 0.7340 / 0.8274 -> 0.7417 / 0.8235, phase 3 then waits on
        # a DMA); d_up's K tiles are transposed first: VectorE's first product writes them while GpSimd still computes
        # d_gate's last one (swiglu_backward_tile), so TensorE does not wait for it (0.6248 -> 0.6243 ms)
        if self.block == None:  # noqa: E711  (prepare did not run, or no block: separate panels)
            self.panels.extend(panels_from_row_blocks(self.pending, self.setup, defer_quantize=self.defer_last_panel,
                                                      first_cols=(self.I, 2 * self.I)))
        else:
            self.panels.extend(panels_from_row_blocks(self.pending, self.setup, defer_quantize=self.defer_last_panel,
                                                      first_cols=(self.I, 2 * self.I), block=self.block,
                                                      m_lo=self.m_lo, m_tile=self.m_tile))
        if not self.defer_last_along_s:
            self.flush_along_s()
        if self.fused:
            self.resident = ResidentPanels(self.m_lo, self.m_hi, self.m_tile, self.panels)
        self.rows = self.checkpoints = self.block = None  # the block lives on in the panels' views until released


def _words_columns(words, c0, c1):
    """(tile, the column of c0 in it) of the part of a K tile's words along S (SwigluBackwardEpilogue._along_s_words)
    that holds words columns [c0, c1): a chunk's columns, or the copy it borrows, never straddle two parts."""
    for lo, part in words:
        if lo <= c0 and c1 <= lo + part.shape[1]:
            return part, c0 - lo
    kernel_assert(False, f"along-S words columns [{c0}, {c1}) straddle the parts starting at "
                  f"{[lo for lo, _ in words]}")


def _bf16_tile(tile, src_hbm, psum_or_none, m0, msz, n0, nsz):
    """The bf16 [msz, nsz] view of SBUF `tile`, loaded from a checkpoint in HBM or rounded from a PSUM result."""
    if src_hbm != None:  # noqa: E711
        nisa.dma_copy(dst=tile[:msz, :nsz], src=src_hbm[m0:m0 + msz, n0:n0 + nsz])
    else:
        nisa.tensor_copy(dst=tile[:msz, :nsz], src=psum_or_none[:msz, :nsz])
    return tile[:msz, :nsz]


def _swiglu_backward_tile(d_i, gate_pre, up, gate_act_td, act_tile, scratch_td, clamp, m0, msz, n0, nsz, ncols,
                          d_gate_dst, d_up_dst, gate_first=False, d_gate_engine=nisa.engine.gpsimd,
                          gate_psum_first=False):
    """Epilogue of one [msz, nsz] tile in fp32 (nkilib/core/swiglu.py, shared with the MoE kernel): SwiGLU
    derivative, clamp masks, intermediate.

    Writes bf16 d_gate / d_up into the SBUF views d_gate_dst / d_up_dst (the caller stores them) and
    stores the intermediate to scratch_td when given. gate_pre / up are bf16 tiles read as is (bf16 ->
    fp32 is exact, so no fp32 copies are made); gate_act, when given, is loaded into act_tile [128, >= nsz].
    """
    act = None
    if gate_act_td != None:  # noqa: E711
        act = act_tile
        nisa.dma_copy(dst=act[:msz, :nsz], src=gate_act_td[m0:m0 + msz, n0:n0 + nsz])
        act = act[:msz, :nsz]
    terms = swiglu_forward_terms(gate_pre, up, act, clamp, msz, nsz, ncols)
    if scratch_td != None:  # noqa: E711  intermediate = bf16(gate_act * uc) for phase 4
        nisa.dma_copy(dst=scratch_td[m0:m0 + msz, n0:n0 + nsz], src=intermediate_tile(terms))
    swiglu_backward_tile(d_i, terms, d_gate_dst, d_up_dst, gate_first=gate_first, d_gate_engine=d_gate_engine,
                         gate_psum_first=gate_psum_first)
