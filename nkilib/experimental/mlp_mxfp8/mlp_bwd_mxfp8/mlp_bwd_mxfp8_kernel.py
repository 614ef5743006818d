"""MXFP8 SwiGLU MLP backward: four phases, base kernel, checkpoint-aware entry point (LNC1/LNC2).

Math (design.md): Phase 1 dI = dY·W_down (K=H) and the SwiGLU derivative; Phase 2 dX = d_gu·W_gu
(K=2I); Phase 3 dW_gu = d_guᵀ·X (K=S); Phase 4 dW_down = dYᵀ·intermediate (K=S); Phase 0 (fused into
phase 1, per output tile) recomputes gate_pre/up (K=H) and gate_act/intermediate when not given.
Every matmul operand is quantized on-chip along that matmul's K (tiled_matmul.py); the exact numerics
are written down in reference.py (`mx_exact`), which the kernel matches to fp32 reassociation.

LNC2 sharding: every phase splits the larger dimension of its output [M, N] in halves (multiples of
128; the other one when the larger has fewer than 128 per core), which minimises the operand bytes a
core reads (split M: a/2 + b; split N: a + b/2). Phase 1 always splits S when it can (its dY is
transposed on the PE array: each core transposes only its own rows, and they can stay resident). For
model shapes (S >= I, S >= H):
- phase 0+1: the S tiles of [S, I] (each core transposes only its own dY rows; W_down is read by both);
- phase 2: the same S rows as phase 1 (its stationary d_gate_up rows never leave the chip, see below);
- phase 3: the larger of 2I and H of dW_gu [2I, H] (H for TP8 shapes: X is read once in total);
- phase 4: the larger of H and I of dW_down [H, I].
Order and the one core_barrier: phase 1 (+ the first W_gu panel of phase 2 when its stationary rows are
resident) -> core_barrier -> phase 2 -> phase 4 -> phase 3. The barrier is a fence (it waits for every
earlier instruction of the core), so it sits where little is in flight: after phase 1, whose d_gate_up
rows phases 2-4 read (both cores' rows for phases 3-4; phase 2 from HBM when not resident, always on
phase 1's row split so cores never overlap). No fence follows, so each phase's first panels load while
the previous phase runs its last tiles, the ones that load nothing (_TiledGemm stages "head" / "first" /
"all"), when both fit SBUF (can_prefetch; not for K-streamed plans, which budget all of SBUF).

Finite SBUF/PSUM (cost model: first-to-last-access liveness, next-fit placement): each plan allocates
its PSUM accumulators and RESULT_BUFFERS eviction tiles once and rotates them; a [K, F] panel load
stages through a ring of STAGING_BUFFERS tiles issued ahead of the quantizes, and an MXFP8 panel is
one words + one scales allocation (tiled_matmul._PanelBuilder), so freed staging leaves contiguous
room instead of holes between words tiles.

On-chip reuse: with W_down resident, phase 1 runs S-tile-major and gathers each finished [128, 2I]
d_gate_up row block in SBUF; it is stored once (2I-long DMA runs) for phase 3 and, one S tile later
(TensorE runs in program order), transposed and quantized along 2I into phase 2's stationary panel.

Operands that do not fit (_TiledGemm, e.g. TP1, I = 12288): moving panels all resident (m-major) >
stationary panels all resident (n-major) > K-streamed groups > stationary groups. K-streamed: g
stationary panels resident (up to STREAM_STATIONARY_BUDGET_BYTES) and the moving operand streamed in
quads of K tiles into g PSUM accumulators of STREAM_N_TILE columns, so each K slice is loaded once
per group (TP1 phase 2: d_gate_up rows transposed/quantized once, W_gu read S/(2*128*g) times per
core). Stationary groups: a group of stationary loads stays while the moving panels are swept. Phase
1 keeps its dY (and X) panels resident when W_down's are not.

Engines: PSUM evictions of phases 2-4 run on ScalarE (faster clock than VectorE in fp32, and idle
after phase 1), leaving VectorE to quantize_mx and the phase-1 epilogue; the K-streamed path
alternates VectorE/ScalarE. Phases 3-4 use MX_N_TILE_WEIGHT_GRAD-wide tiles (fewer stationary loads).

Modeled (trn3 LNC2, S=4096, checkpoints given; nkilib/simulator/cost.py with finite SBUF/PSUM):
Qwen3-8B TP8 642 us (76.5 % of MXFP8 peak, 3.49x the BF16 mode's 2239 us), TP1 5.12 ms (76.8 %).

HBM traffic (bf16; per core under LNC2, given checkpoints): phase 1 reads dY[S/2, H], W_down,
gate_pre/gate_act/up[S/2, I] and writes d_gate_up[S/2, 2I]; phase 2 reads W_gu once (moving panels
streamed n-major, stationary resident) and writes dX[S/2, H]; phase 3 reads d_gate_up and X (halves
of the split operand) and writes its dW_gu half; phase 4 likewise. Modeled Qwen3-8B TP8 (S=4096):
386 MB in total. No HBM->HBM transposes: K-contiguous operands are read as stored (NATURAL_LOAD_K
columns per DMA) and transposed on the PE array; [K, F] operands are interleaved by the DMA pattern.
"""
from __future__ import annotations

import nki
import nki.isa as nisa
import nki.language as nl

from ....core.kernel_helpers import ceil_div, kernel_assert, round_up, shard_range
from .api import matmul_config_from_tiles, phase_transposes, resolve_operands
from .config import ClampLimits, MatmulConfig, TensorDescriptor, resolve_matmul_config
from .constants import (FP8_X4_DTYPE_NAMES, MATMUL_PRECISIONS, MOVING_PANEL_BUDGET_BYTES,
                        MX_K_ALIGN, MX_PACK, PANEL_CACHE_BUDGET_BYTES,
                        PARTITIONS, PHASE2_STATIONARY_BUDGET_BYTES, PREFETCH_MARGIN_BYTES, PSUM_BUFFERS, QUANT_SCHEMES,
                        RESULT_BUFFERS, STAGING_BUFFERS,
                        SCALE_PACK_SLOTS, SPLIT_ALIGN, STATIONARY_GROUP_BUDGET_BYTES, STATIONARY_LOAD_WIDTH,
                        STATIONARY_PANEL_BUDGET_BYTES, STREAM_N_TILE, STREAM_STATIONARY_BUDGET_BYTES,
                        STREAM_STATIONARY_HEADROOM_BF16_BYTES, STREAM_STATIONARY_HEADROOM_BYTES, PSUM_BYTES)
from .tiled_matmul import (MatmulSetup, PanelSource, ResidentPanels, blocks, k_tiles, load_panel, matmul_panels,
                           panel_bytes_per_partition, panel_from_rows, tile_order)

__all__ = [
    "get_program_sharding_info", "compute_phase1_down_proj_mm_grad_mxfp8", "compute_phase2_hidden_states_grad_mxfp8",
    "compute_phase3_gate_up_weight_grad_mxfp8", "compute_phase4_down_weight_grad_mxfp8",
    "mlp_backward_mxfp8_base_nki", "mlp_backward_mxfp8_nki", "ClampLimits", "TensorDescriptor",
]


def get_program_sharding_info(run_with_lnc2):
    """(num_cores, shard_id) of this program: (2, program_id) under an LNC2 launch, else (1, 0)."""
    launched = nl.num_programs(0) if nl.program_ndim() > 0 else 1
    if not run_with_lnc2:
        kernel_assert(launched == 1, f"run_with_lnc2=False requires a kernel[1] launch, got {launched} programs")
        return 1, 0
    if launched == 1:
        return 1, 0
    return launched, nl.program_id(0)


def _core_ranges(m_total, n_total, num_cores, shard_id, prefer_m=False):
    """This core's ([m_lo, m_hi), [n_lo, n_hi)) of an [M, N] output: near-equal contiguous halves (in
    multiples of 128) of the larger dimension when it has at least 128 per core, else of the other.

    Splitting the larger of M and N minimises the operand bytes each core reads: out[M, N] = a[M, K] @
    b[K, N] split along M reads a/2 + b per core, along N a + b/2. prefer_m: split M whenever it has
    128 rows per core (phase 1: its stationary dY is transposed on the PE array, so halving it halves
    the transposes and lets the half stay resident; see compute_phase1_down_proj_mm_grad_mxfp8).
    """
    if num_cores == 1:
        return (0, m_total), (0, n_total)
    enough = SPLIT_ALIGN * num_cores
    split_m = ((m_total >= n_total or prefer_m) and m_total >= enough) or n_total < enough
    axis_total = m_total if split_m else n_total
    lo, hi = shard_range(ceil_div(axis_total, SPLIT_ALIGN), num_cores, shard_id)
    lo, hi = min(lo * SPLIT_ALIGN, axis_total), min(hi * SPLIT_ALIGN, axis_total)
    return ((lo, hi), (0, n_total)) if split_m else ((0, m_total), (lo, hi))


def _fit_width(requested, ops, setup, budget, quantum):
    """Largest width <= requested (a multiple of `quantum`, at least one quantum) whose panels of all
    `ops` (every K tile) fit `budget` SBUF bytes per partition. Large K (e.g. 2I = 24576) narrows the
    tiles instead of overflowing SBUF."""
    per_column = sum(panel_bytes_per_partition(op.k_size, quantum, setup) for op in ops) / quantum
    fitting = int(budget // per_column) // quantum * quantum
    return max(quantum, min(requested, fitting))


def _stationary_load_width(op, m_tile, setup):
    """Super-panel width for a [K, F] stationary operand: whole m tiles, about STATIONARY_LOAD_WIDTH
    columns within the stationary budget (K-contiguous and pre-quantized operands gain nothing from
    it: 0 = per tile)."""
    if op.k_axis != 0 or op.prequantized:
        return 0
    wanted = max(1, STATIONARY_LOAD_WIDTH // m_tile) * m_tile
    return _fit_width(wanted, [op], setup, STATIONARY_PANEL_BUDGET_BYTES, m_tile)


def _psum_buffers(n_tile):
    """PSUM_BUFFERS fp32 accumulators [128, n_tile], used round-robin across output tiles."""
    return [nl.ndarray((PARTITIONS, n_tile), dtype=nl.float32, buffer=nl.psum) for _ in range(PSUM_BUFFERS)]


class _TiledGemm(nl.NKIObject):
    """out[M, N] = a[M, K] @ b[K, N] for this core's output tiles, runnable in slices around a barrier.

    Every moving panel of this core stays resident (quantized once) when they fit the SBUF budget,
    and tiles run m-major so each stationary panel is also quantized once; else, when all stationary
    panels fit, they stay resident and tiles run n-major (each moving panel loaded once); otherwise
    K-streamed groups (_run_streamed) when the moving operand can be loaded by K tile and that holds
    more stationary panels, else n-major inside groups of stationary loads (STATIONARY_GROUP_BUDGET_BYTES;
    each stationary panel quantized once, the moving panels swept once per group).
    `resident`: ResidentPanels already on chip (built by phase 1) for rows [lo, hi) of a; this core
    then computes exactly those rows, all N columns. `rows`: (lo, hi) likewise without resident panels
    (the same row split on every core, whichever of them has its rows resident).
    """

    def __init__(self, out_hbm, a_op, b_op, m_total, n_total, setup, config, num_cores, shard_id, out_dtype,
                 resident=None, rows=None):
        self.out_hbm, self.setup, self.out_dtype = out_hbm, setup, out_dtype
        self.done = 0
        self.accumulators = self.results = None
        self.stationary = self.moving = self.stream = None
        self.a_k_size = a_op.k_size
        if resident is not None:
            rows = (resident.lo, resident.hi)
        if rows is not None:
            (m_lo, m_hi), (n_lo, n_hi) = rows, (0, n_total)
        else:
            (m_lo, m_hi), (n_lo, n_hi) = _core_ranges(m_total, n_total, num_cores, shard_id)
        self.n_width = n_hi - n_lo
        if m_lo >= m_hi or n_lo >= n_hi:
            self.order = []
            return
        self.keep_moving = panel_bytes_per_partition(b_op.k_size, n_hi - n_lo, setup) <= PANEL_CACHE_BUDGET_BYTES
        keep_stationary = (not self.keep_moving and
                           panel_bytes_per_partition(a_op.k_size, m_hi - m_lo, setup) <= PANEL_CACHE_BUDGET_BYTES)
        self.n_tile = _fit_width(config.n_tile, [b_op], setup, MOVING_PANEL_BUDGET_BYTES, SPLIT_ALIGN)
        m_tile = config.m_tile
        m_group = 0
        if resident is not None:
            self.stationary, m_tile = resident, resident.m_tile
        else:
            load_width = _stationary_load_width(a_op, m_tile, setup)
            # neither operand fits: keep a group of stationary loads (each quantized once) and sweep the
            # moving panels once per group instead of once per m tile
            capacity = 1
            if not self.keep_moving and not keep_stationary:
                load = load_width or m_tile
                capacity = max(1, int(STATIONARY_GROUP_BUDGET_BYTES //
                                      panel_bytes_per_partition(a_op.k_size, load, setup)))
                m_group = capacity * load // m_tile
            self.stationary = PanelSource(a_op, setup, pad_even=True, keep_all=keep_stationary, lo=m_lo, hi=m_hi,
                                          load_width=load_width, capacity=capacity)
        self.moving = PanelSource(b_op, setup, pad_even=False, keep_all=self.keep_moving)
        # K-streamed groups (see _run_streamed) when they hold more stationary panels than m_group
        self.stream = None
        if m_group and (b_op.k_axis == 0 or b_op.prequantized):
            per_tile = panel_bytes_per_partition(a_op.k_size, m_tile, setup)
            # the budget is tuned for trn3's 256 KiB; smaller SBUFs (trn2: 224 KiB) keep the same headroom
            headroom = STREAM_STATIONARY_HEADROOM_BYTES if setup.is_mx else STREAM_STATIONARY_HEADROOM_BF16_BYTES
            budget = min(STREAM_STATIONARY_BUDGET_BYTES, nl.tile_size.total_available_sbuf_size - headroom)
            g = min(int(budget // per_tile), PSUM_BYTES // (STREAM_N_TILE * 4),
                    ceil_div(m_hi - m_lo, m_tile))
            if g > m_group:
                self.stream = (g, blocks(m_lo, m_hi, m_tile), blocks(n_lo, n_hi, STREAM_N_TILE))
                self.stationary = PanelSource(a_op, setup, pad_even=True, keep_all=False, lo=m_lo, hi=m_hi,
                                              capacity=g)
        self.order = tile_order(blocks(m_lo, m_hi, m_tile), blocks(n_lo, n_hi, self.n_tile),
                                m_outer=self.keep_moving, m_group=m_group)

    def _load_bytes(self, source, width) -> int:
        """SBUF bytes per partition of one load of `source` (a PanelSource) `width` columns wide."""
        if source.load_width:
            width = source.load_width
        return panel_bytes_per_partition(source.op.k_size, width, self.setup)

    def held_bytes(self) -> int:
        """Upper bound of the SBUF bytes per partition this plan holds while its last tiles run."""
        if not self.order:
            return 0
        st, mv = self.stationary, self.moving
        if isinstance(st, ResidentPanels):
            st_bytes = panel_bytes_per_partition(self.a_k_size, st.hi - st.lo, self.setup)
        elif st.keep_all:
            st_bytes = panel_bytes_per_partition(st.op.k_size, st.hi - st.lo, self.setup)
        else:
            st_bytes = st.capacity * self._load_bytes(st, self.order[0][0][1])
        mv_bytes = panel_bytes_per_partition(mv.op.k_size, self.n_width if mv.keep_all else self.n_tile, self.setup)
        return st_bytes + mv_bytes + RESULT_BUFFERS * self.n_tile * self.out_dtype.itemsize

    def first_bytes(self) -> int:
        """SBUF bytes per partition that loading the first tile's panels takes (with MXFP8 staging)."""
        if not self.order:
            return 0
        (_, msz), (_, nsz) = self.order[0]
        total = self._load_bytes(self.moving, nsz)
        widest = nsz
        if not isinstance(self.stationary, ResidentPanels):
            total += self._load_bytes(self.stationary, msz)
            widest = max(widest, self.stationary.load_width or msz)
        staging = STAGING_BUFFERS * MX_PACK * 2 * widest if self.setup.is_mx else 0
        return total + staging

    def can_prefetch(self, nxt) -> bool:
        """Whether `nxt`'s first panels may load while this plan's last tiles run: neither is K-streamed
        (those budget all of SBUF) and both fit SBUF with PREFETCH_MARGIN_BYTES to spare."""
        if self.stream is not None or nxt.stream is not None or not nxt.order:
            return False
        budget = nl.tile_size.total_available_sbuf_size - PREFETCH_MARGIN_BYTES
        return self.held_bytes() + nxt.first_bytes() <= budget

    def stationary_on_chip(self) -> bool:
        """Whether the stationary panels are phase 1's resident ones (the first tile's loads then read
        only inputs and may be issued before the core_barrier)."""
        return isinstance(self.stationary, ResidentPanels)

    def last_load(self) -> int:
        """Index of the last tile whose panels are not all loaded by earlier tiles (mirrors PanelSource's
        caching): after it this plan loads nothing, so the next plan's first panels can load then."""
        if self.stream is not None:
            return len(self.order) - 1
        last = 0
        caches = ({}, {})
        for i, ((m0, _), (n0, _)) in enumerate(self.order):
            for source, cache, key in ((self.stationary, caches[0], m0), (self.moving, caches[1], n0)):
                if isinstance(source, ResidentPanels):
                    continue
                key = source.load_key(key)
                if key not in cache:
                    if not source.keep_all and len(cache) >= source.capacity:
                        cache.clear()
                    cache[key] = True
                    last = i
        return last

    def prefetch(self, lo: int, hi: int, stationary: bool = True) -> None:
        """Issue the loads of tiles [lo, hi) now (e.g. before a core_barrier that fences later DMAs)."""
        for (m0, msz), (n0, nsz) in self.order[lo:hi]:
            if stationary:
                self.stationary.get(m0, msz)
            self.moving.get(n0, nsz)

    def _run_streamed(self) -> None:
        """All tiles with a group of g stationary panels resident and the moving operand streamed in
        quads of K tiles: for each n block, every K slice is loaded once and multiplied into the g
        PSUM accumulators of the group (each accumulates its K tiles in order, like matmul_panels).

        For a stationary too large to keep and moving panels too large to sweep often (TP1 phase 2:
        K = 2I = 24576): PSUM, not SBUF, bounds the moving width (g accumulators of STREAM_N_TILE),
        so g stationary panels share each moving pass (W_gu is read m_tiles / g times).
        """
        g, m_blocks, n_blocks = self.stream
        setup, b_op = self.setup, self.moving.op
        n_k = len(k_tiles(b_op.k_size, setup))
        evictions = 0
        a_panels = accs = None
        for lo in range(0, len(m_blocks), g):
            group = m_blocks[lo:lo + g]
            # drop the previous group's panels and accumulators (all of PSUM) before loading this group
            # (its PE transposes use PSUM too)
            a_panels = accs = acc = None
            a_panels = [self.stationary.get(m0, msz) for m0, msz in group]
            # the next n block's first matmuls wait for these tiles' evictions (WAR)
            accs = [nl.ndarray((PARTITIONS, STREAM_N_TILE), dtype=nl.float32, buffer=nl.psum) for _ in group]
            for n0, nsz in n_blocks:
                for t0 in range(0, n_k, SCALE_PACK_SLOTS):
                    t1 = min(n_k, t0 + SCALE_PACK_SLOTS)
                    b = load_panel(b_op, n0, nsz, nsz, setup, t0, t1)
                    for a, acc in zip(a_panels, accs):
                        matmul_panels(acc[:a.f_pad, :nsz], a, b, setup, t0, t1)  # K=4 K tiles, M=m tile, N=n block
                    b = None
                for (m0, msz), acc in zip(group, accs):
                    res = nl.ndarray((PARTITIONS, STREAM_N_TILE), dtype=self.out_dtype, buffer=nl.sbuf)
                    # alternate VectorE / ScalarE: the group's evictions gate the next n block's matmuls
                    engine = nisa.engine.vector if evictions % 2 == 0 else nisa.engine.scalar
                    nisa.tensor_copy(dst=res[:msz, :nsz], src=acc[:msz, :nsz], engine=engine)
                    nisa.dma_copy(dst=self.out_hbm[m0:m0 + msz, n0:n0 + nsz], src=res[:msz, :nsz])
                    evictions += 1
        self.done = len(self.order)

    def run(self, hi: int = -1) -> None:
        """Compute the tiles not done yet, up to (excluding) hi (-1: all)."""
        hi = len(self.order) if hi < 0 else hi
        if self.done >= hi:
            return
        if self.stream is not None:
            assert self.done == 0 and hi == len(self.order), "K-streamed plans run in one step"
            self._run_streamed()
            return
        if self.accumulators is None:
            # allocated once per plan (PSUM_BUFFERS accumulators, RESULT_BUFFERS eviction tiles used
            # round-robin), so a run split around another plan's prefetch allocates nothing new mid-phase
            self.accumulators = _psum_buffers(self.n_tile)
            self.results = [nl.ndarray((PARTITIONS, self.n_tile), dtype=self.out_dtype, buffer=nl.sbuf)
                            for _ in range(RESULT_BUFFERS)]
        for i in range(self.done, hi):
            (m0, msz), (n0, nsz) = self.order[i]
            a = self.stationary.get(m0, msz)
            b = self.moving.get(n0, nsz)
            psum = self.accumulators[i % PSUM_BUFFERS]
            matmul_panels(psum[:a.f_pad, :nsz], a, b, self.setup)  # K=op K, M=m tile, N=n block
            # RESULT_BUFFERS eviction tiles: a tile's store may trail the next tiles' evictions
            res = self.results[i % RESULT_BUFFERS]
            nisa.tensor_copy(dst=res[:msz, :nsz], src=psum[:msz, :nsz], engine=nisa.engine.scalar)
            nisa.dma_copy(dst=self.out_hbm[m0:m0 + msz, n0:n0 + nsz], src=res[:msz, :nsz])
            a = b = None  # hold no panel across the next get (a dropped panel's SBUF is then free)
        self.done = hi

    def release(self) -> None:
        """Drop every panel and buffer this plan holds (their SBUF/PSUM is free for the next phase)."""
        self.accumulators = self.results = None
        for source in (self.stationary, self.moving):
            for cache in (getattr(source, "cache", None), getattr(source, "panels", None)):
                if cache is not None:
                    cache.clear()

    def step(self, stage: str) -> "_TiledGemm":
        """stage "plan": nothing; "head": run the tiles up to the last one that loads a panel (last_load);
        "first": load the first tile's panels (prefetch while another plan computes); "all": run the
        remaining tiles and release the panels."""
        if stage == "head":
            if self.stream is None and self.order:
                self.run(max(self.done, self.last_load() + 1))
        elif stage == "first":
            if self.stream is None and self.order:
                self.prefetch(0, 1)
        elif stage == "all":
            self.run()
            self.release()
        return self


def _clamp_and_mask(x, lower, upper, msz, nsz, ncols):
    """(clamped [msz, nsz] fp32 view, mask view or None): clamp(x, lower, upper) and 1.0 where inside.

    x: bf16 or fp32 [msz, nsz] view; without limits it is returned as is (and no mask).
    """
    if lower is None and upper is None:
        return x, None
    clamped = nl.ndarray((PARTITIONS, ncols), dtype=nl.float32, buffer=nl.sbuf)
    mask = nl.ndarray((PARTITIONS, ncols), dtype=nl.float32, buffer=nl.sbuf)
    c, m = clamped[:msz, :nsz], mask[:msz, :nsz]
    if lower is not None and upper is not None:
        nisa.tensor_scalar(dst=c, data=x, op0=nl.maximum, operand0=float(lower), op1=nl.minimum,
                           operand1=float(upper))
        lo_ok = nl.ndarray((PARTITIONS, ncols), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=lo_ok[:msz, :nsz], data=x, op0=nl.greater_equal, operand0=float(lower))
        # mask = (x <= upper) * (x >= lower); comparisons in fp32 against fp32(limit) like the clamp
        nisa.scalar_tensor_tensor(dst=m, data=x, op0=nl.less_equal, operand0=float(upper), op1=nl.multiply,
                                  operand1=lo_ok[:msz, :nsz])
    elif lower is not None:
        nisa.tensor_scalar(dst=c, data=x, op0=nl.maximum, operand0=float(lower))
        nisa.tensor_scalar(dst=m, data=x, op0=nl.greater_equal, operand0=float(lower))
    else:
        nisa.tensor_scalar(dst=c, data=x, op0=nl.minimum, operand0=float(upper))
        nisa.tensor_scalar(dst=m, data=x, op0=nl.less_equal, operand0=float(upper))
    return c, m


def _bf16_tile(src_hbm, psum_or_none, m0, msz, n0, nsz, ncols):
    """A bf16 [msz, nsz] SBUF tile: loaded from a checkpoint in HBM, or rounded from a PSUM result."""
    tile = nl.ndarray((PARTITIONS, ncols), dtype=nl.bfloat16, buffer=nl.sbuf)
    if src_hbm is not None:
        nisa.dma_copy(dst=tile[:msz, :nsz], src=src_hbm[m0:m0 + msz, n0:n0 + nsz])
    else:
        nisa.tensor_copy(dst=tile[:msz, :nsz], src=psum_or_none[:msz, :nsz])
    return tile[:msz, :nsz]


def compute_phase1_down_proj_mm_grad_mxfp8(output_grad_td, gate_pre_td, gate_act_td, up_td, d_gate_up_td, scratch_td,
                                           down_weight_td, s_base, dtype, fp8_x4_dtype, config=None,
                                           spill_reload=True, use_scale_packing=True, run_with_lnc2=True,
                                           clamp_limits=None, hidden_states_td=None, gate_weight_td=None,
                                           up_weight_td=None, setup=None, keep_for_phase2=False):
    """Phase 1 (with the phase-0 recompute fused per tile): d_gate, d_up [S, I] and the intermediate.

    Dimensions:
        output_grad_td: dY [S, H] (K=H, k_axis=1); down_weight_td: W_down [H, I] (k_axis=0) or the
        pre-quantized W_downᵀ [I, H]; gate_pre/gate_act/up: [S, I] bf16 HBM tensors or None (recomputed);
        d_gate_up_td: [S, 2I] bf16 output (d_gate | d_up); scratch_td: [S, I] bf16 intermediate output,
        or None when the intermediate is not needed / given.
        Recompute operands (only when gate_pre/up are None): hidden_states_td X [S, H] (k_axis=1),
        gate_weight_td / up_weight_td: W_gate / W_up [I, H] windows of gate_up_weights (k_axis=1).

    Args:
        s_base: first token row (the kernel processes all S rows from s_base; 0 for a full call).
        dtype: dtype of d_gate_up (bf16). fp8_x4_dtype: MX element dtype. spill_reload: accepted for API
        compatibility; a no-op (panels stay in SBUF, nothing is spilled). Epilogue math is fp32.
    keep_for_phase2: also keep this core's d_gate_up rows on chip as phase 2's stationary
            panels (quantized along 2I) when every I column is on this core, the moving panels are
            resident and the panels fit PHASE2_STATIONARY_BUDGET_BYTES.

    Returns:
        ResidentPanels for compute_phase2_hidden_states_grad_mxfp8 (rows [lo, hi) of this core), or None.
    """
    config = config or MatmulConfig()
    num_cores, shard_id = get_program_sharding_info(run_with_lnc2)
    S = output_grad_td.tensor.shape[0] - s_base
    I = down_weight_td.f_extent
    (m_lo, m_hi), (n_lo, n_hi) = _core_ranges(S, I, num_cores, shard_id, prefer_m=True)
    if m_lo >= m_hi or n_lo >= n_hi:
        return None
    clamp = clamp_limits or ClampLimits()
    need_gate_pre, need_up = gate_pre_td is None, up_td is None
    moving_ops = [down_weight_td] + ([gate_weight_td] if need_gate_pre else []) + ([up_weight_td] if need_up else [])
    keep = sum(panel_bytes_per_partition(op.k_size, n_hi - n_lo, setup) for op in moving_ops) <= PANEL_CACHE_BUDGET_BYTES
    w_down, w_gate, w_up = (PanelSource(op, setup, pad_even=False, keep_all=keep) if op is not None else None
                            for op in (down_weight_td, gate_weight_td if need_gate_pre else None,
                                       up_weight_td if need_up else None))
    # moving panels not resident (n-major, e.g. TP1 W_down): keep the stationary dY (and X) panels of this
    # core's S rows instead, so each is transposed and quantized once rather than once per I block
    stationary_ops = [output_grad_td] + ([hidden_states_td] if (need_gate_pre or need_up) else [])
    keep_st = (not keep and sum(panel_bytes_per_partition(op.k_size, m_hi - m_lo, setup) for op in stationary_ops)
               <= PANEL_CACHE_BUDGET_BYTES)
    dy = PanelSource(output_grad_td, setup, pad_even=True, keep_all=keep_st)
    x = PanelSource(hidden_states_td, setup, pad_even=True, keep_all=keep_st) if (need_gate_pre or need_up) else None
    n_acc = 1 + int(need_gate_pre) + int(need_up)
    ncols = _fit_width(config.n_tile, moving_ops, setup, MOVING_PANEL_BUDGET_BYTES, SPLIT_ALIGN)
    accumulators = [_psum_buffers(ncols) for _ in range(n_acc)]
    # m-major (moving panels resident): a whole d_gate_up row block [msz, 2I] is finished per S tile, so it
    # is gathered in SBUF, stored with 2I-long runs and, when asked, kept as phase 2's stationary panel
    two_i = 2 * I
    fused = (keep_for_phase2 and keep and (n_lo, n_hi) == (0, I) and
             ceil_div(m_hi - m_lo, config.m_tile) * panel_bytes_per_partition(two_i, config.m_tile, setup)
             <= PHASE2_STATIONARY_BUDGET_BYTES)
    row_width = round_up(two_i, MX_K_ALIGN) if (fused and setup.is_mx) else two_i
    panels, pending = {}, []  # pending: finished row blocks whose phase-2 panels are not built yet
    order = tile_order(blocks(m_lo, m_hi, config.m_tile), blocks(n_lo, n_hi, ncols), m_outer=keep)
    for i, ((m_rel, msz), (n0, nsz)) in enumerate(order):
        m0 = s_base + m_rel
        a_dy = dy.get(m0, msz)
        d_i = accumulators[0][i % PSUM_BUFFERS]
        matmul_panels(d_i[:a_dy.f_pad, :nsz], a_dy, w_down.get(n0, nsz), setup)  # K=H, M=S tile, N=I block
        g_psum = u_psum = None
        if x is not None:
            a_x = x.get(m0, msz)
            if need_gate_pre:
                g_psum = accumulators[1][i % PSUM_BUFFERS]
                matmul_panels(g_psum[:a_x.f_pad, :nsz], a_x, w_gate.get(n0, nsz), setup)  # K=H, M=S, N=I block
            if need_up:
                u_psum = accumulators[-1][i % PSUM_BUFFERS]
                matmul_panels(u_psum[:a_x.f_pad, :nsz], a_x, w_up.get(n0, nsz), setup)  # K=H, M=S, N=I block
        if pending and n0 == n_lo:
            # built one S tile late, after this tile's matmuls: TensorE runs in program order and would
            # otherwise wait for the previous tile's epilogue before these transposes
            panels.update(_phase2_panels(pending, setup))
        gate_pre = _bf16_tile(gate_pre_td, g_psum, m0, msz, n0, nsz, ncols)
        up = _bf16_tile(up_td, u_psum, m0, msz, n0, nsz, ncols)
        if keep:
            if n0 == n_lo:
                rows = nl.ndarray((PARTITIONS, row_width), dtype=dtype, buffer=nl.sbuf)
                if row_width > two_i:  # zero K padding of phase 2's operand
                    nisa.memset(dst=rows[:msz, two_i:], value=0.0)
            d_gate, d_up = rows[:msz, n0:n0 + nsz], rows[:msz, I + n0:I + n0 + nsz]
        else:
            d_gate = nl.ndarray((PARTITIONS, ncols), dtype=dtype, buffer=nl.sbuf)[:msz, :nsz]
            d_up = nl.ndarray((PARTITIONS, ncols), dtype=dtype, buffer=nl.sbuf)[:msz, :nsz]
        _swiglu_backward_tile(d_i[:msz, :nsz], gate_pre, up, gate_act_td, scratch_td, clamp, m0, msz, n0, nsz,
                              ncols, d_gate, d_up)
        if not keep:
            nisa.dma_copy(dst=d_gate_up_td[m0:m0 + msz, n0:n0 + nsz], src=d_gate)
            nisa.dma_copy(dst=d_gate_up_td[m0:m0 + msz, I + n0:I + n0 + nsz], src=d_up)
        elif n0 + nsz == n_hi:  # row block complete
            if (n_lo, n_hi) == (0, I):
                nisa.dma_copy(dst=d_gate_up_td[m0:m0 + msz, :], src=rows[:msz, :two_i])
            else:
                for c in (n_lo, I + n_lo):
                    nisa.dma_copy(dst=d_gate_up_td[m0:m0 + msz, c:c + n_hi - n_lo], src=rows[:msz, c:c + n_hi - n_lo])
            if fused:
                pending.append((m_rel, msz, rows, two_i))
    panels.update(_phase2_panels(pending, setup))
    return ResidentPanels(m_lo, m_hi, config.m_tile, panels) if fused else None


def _phase2_panels(pending, setup):
    """{m_rel: Panel} of finished d_gate_up row blocks (quantized along 2I); empties `pending`."""
    out = {}
    for m_rel, msz, rows, two_i in pending:
        f_pad = msz + (msz % 2 if setup.is_mx else 0)  # nc_matmul_mx needs an even M
        out[m_rel] = panel_from_rows(rows[:msz, :], msz, two_i, f_pad, setup)
    pending.clear()
    return out


def _swiglu_backward_tile(d_i, gate_pre, up, gate_act_td, scratch_td, clamp, m0, msz, n0, nsz, ncols, d_gate_dst,
                          d_up_dst):
    """Epilogue of one [msz, nsz] tile in fp32: SwiGLU derivative, clamp masks, intermediate.

    Writes bf16 d_gate / d_up into the SBUF views d_gate_dst / d_up_dst (the caller stores them) and
    stores the intermediate to scratch_td when given. gate_pre / up are bf16 tiles read as is (bf16 ->
    fp32 is exact, so no fp32 copies are made). The products with the PSUM tile dI run on VectorE (one
    PSUM input: N cycles); products of two SBUF tiles run on GpSimd (idle otherwise) and the
    activations on ScalarE, so the three engines share the epilogue.
    """
    gc, mask_g = _clamp_and_mask(gate_pre, clamp.non_linear_lower, clamp.non_linear_upper, msz, nsz, ncols)
    uc, mask_u = _clamp_and_mask(up, clamp.linear_lower, clamp.linear_upper, msz, nsz, ncols)
    act = nl.ndarray((PARTITIONS, ncols), dtype=nl.bfloat16, buffer=nl.sbuf)
    if gate_act_td is not None:
        nisa.dma_copy(dst=act[:msz, :nsz], src=gate_act_td[m0:m0 + msz, n0:n0 + nsz])
    else:
        nisa.activation(dst=act[:msz, :nsz], op=nl.silu, data=gc)  # gate_act = bf16(silu(gc))
    a = act[:msz, :nsz]
    if scratch_td is not None:  # intermediate = bf16(gate_act * uc) for phase 4
        inter = nl.ndarray((PARTITIONS, ncols), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=inter[:msz, :nsz], data1=a, data2=uc, op=nl.multiply, engine=nisa.engine.gpsimd)
        nisa.dma_copy(dst=scratch_td[m0:m0 + msz, n0:n0 + nsz], src=inter[:msz, :nsz])
    # d_up = bf16((dI * a) * mask_u)
    if mask_u is None:
        nisa.tensor_tensor(dst=d_up_dst, data1=d_i, data2=a, op=nl.multiply)
    else:
        t_up = nl.ndarray((PARTITIONS, ncols), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=t_up[:msz, :nsz], data1=d_i, data2=a, op=nl.multiply)
        nisa.tensor_tensor(dst=d_up_dst, data1=t_up[:msz, :nsz], data2=mask_u, op=nl.multiply,
                           engine=nisa.engine.gpsimd)
    # d_gate = bf16(((dI * uc) * silu'(gc)) * mask_g)
    sd = nl.ndarray((PARTITIONS, ncols), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=sd[:msz, :nsz], op=nl.silu_dx, data=gc)
    t_g = nl.ndarray((PARTITIONS, ncols), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=t_g[:msz, :nsz], data1=d_i, data2=uc, op=nl.multiply)
    if mask_g is None:
        nisa.tensor_tensor(dst=d_gate_dst, data1=t_g[:msz, :nsz], data2=sd[:msz, :nsz], op=nl.multiply,
                           engine=nisa.engine.gpsimd)
    else:
        t_g2 = nl.ndarray((PARTITIONS, ncols), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=t_g2[:msz, :nsz], data1=t_g[:msz, :nsz], data2=sd[:msz, :nsz], op=nl.multiply,
                           engine=nisa.engine.gpsimd)
        nisa.tensor_tensor(dst=d_gate_dst, data1=t_g2[:msz, :nsz], data2=mask_g, op=nl.multiply,
                           engine=nisa.engine.gpsimd)


def compute_phase2_hidden_states_grad_mxfp8(hidden_states_grad_td, gate_up_weight_td, d_gate_up_td, s_base, dtype,
                                            fp8_x4_dtype, config=None, run_with_lnc2=True, setup=None,
                                            resident=None, rows=None, plan=None, stage="all"):
    """Phase 2: dX [S, H] = d_gate_up [S, 2I] @ gate_up_weights [2I, H] (K=2I).

    Dimensions:
        d_gate_up_td: [S, 2I] (k_axis=1); gate_up_weight_td: W_gu [2I, H] (k_axis=0) or pre-quantized
        W_guᵀ [H, 2I]; hidden_states_grad_td: [S, H] output in `dtype`.
        resident: phase 1's ResidentPanels (d_gate_up rows already quantized on chip) or None (read
        d_gate_up from HBM; needs a core_barrier after phase 1 under LNC2).
        rows: (lo, hi) S rows of this core (phase 1's row split, so that cores with and without resident
        panels compute disjoint rows), or None (_core_ranges).
        plan / stage: run the phase in steps (see _TiledGemm.step); returns the plan.
    """
    if plan is None:
        config = config or MatmulConfig()
        num_cores, shard_id = get_program_sharding_info(run_with_lnc2)
        S = d_gate_up_td.tensor.shape[0] - s_base
        H = hidden_states_grad_td.shape[1]
        a_op = d_gate_up_td.window(s_base, S) if s_base else d_gate_up_td
        out = hidden_states_grad_td if not s_base else hidden_states_grad_td[s_base:, :]
        plan = _TiledGemm(out, a_op, gate_up_weight_td, S, H, setup, config, num_cores, shard_id, dtype, resident,
                          rows)
    return plan.step(stage)


def compute_phase3_gate_up_weight_grad_mxfp8(weight_grad_td, hidden_states_T_td, grad_T_td, dtype, fp8_x4_dtype,
                                             config=None, run_with_lnc2=True, setup=None, plan=None, stage="all"):
    """Phase 3: dW_gu [2I, H] = d_gate_upᵀ [2I, S] @ X [S, H] (K=S).

    Dimensions:
        grad_T_td: d_gate_up [S, 2I] read as the K=S operand (k_axis=0); hidden_states_T_td: X [S, H]
        (k_axis=0) or pre-quantized Xᵀ [H, S]; weight_grad_td: [2I, H] output in `dtype`.
        plan / stage: run the phase in steps around a core_barrier (see _TiledGemm.step); returns the plan.
    """
    if plan is None:
        config = config or MatmulConfig()
        num_cores, shard_id = get_program_sharding_info(run_with_lnc2)
        two_i, H = weight_grad_td.shape
        plan = _TiledGemm(weight_grad_td, grad_T_td, hidden_states_T_td, two_i, H, setup, config, num_cores, shard_id,
                          dtype)
    return plan.step(stage)


def compute_phase4_down_weight_grad_mxfp8(down_weight_grad_td, output_grad_T_td, intermediate_T_td, h_base, dtype,
                                          fp8_x4_dtype, config=None, run_with_lnc2=True, setup=None, plan=None,
                                          stage="all"):
    """Phase 4: dW_down [H, I] = dYᵀ [H, S] @ intermediate [S, I] (K=S).

    Dimensions:
        output_grad_T_td: dY [S, H] (k_axis=0) or pre-quantized dYᵀ [H, S]; intermediate_T_td: [S, I]
        (k_axis=0); down_weight_grad_td: [H, I] output in `dtype`. h_base: first H row (0 for a full call).
        plan / stage: run the phase in steps around a core_barrier (see _TiledGemm.step); returns the plan.
    """
    if plan is None:
        config = config or MatmulConfig()
        num_cores, shard_id = get_program_sharding_info(run_with_lnc2)
        H, I = down_weight_grad_td.shape
        a_op = output_grad_T_td.window(h_base, H - h_base) if h_base else output_grad_T_td
        out = down_weight_grad_td if not h_base else down_weight_grad_td[h_base:, :]
        plan = _TiledGemm(out, a_op, intermediate_T_td, H - h_base, I, setup, config, num_cores, shard_id, dtype)
    return plan.step(stage)


def mlp_backward_mxfp8_base_nki(hidden_states_grad, gate_up_weight_grad, down_proj_weight_grad, output_grad_td,
                                hidden_states_td, hidden_states_T_td, output_grad_T_td, down_weight_td,
                                gate_up_weight_td, gate_weight_td, up_weight_td, gate_pre, gate_act, up, intermediate,
                                setup, config, run_with_lnc2, clamp_limits, weight_grad_dtype):
    """All phases in order for validated descriptors; allocates only the scratch that is needed."""
    S, two_i = output_grad_td.tensor.shape[0], gate_up_weight_grad.shape[0]
    num_cores, shard_id = get_program_sharding_info(run_with_lnc2)
    d_gate_up = nl.ndarray((S, two_i), dtype=nl.bfloat16, buffer=nl.shared_hbm, name="mlp_bwd_d_gate_up")
    scratch = None
    if intermediate is None:
        scratch = nl.ndarray((S, two_i // 2), dtype=nl.bfloat16, buffer=nl.shared_hbm, name="mlp_bwd_intermediate")
    resident = compute_phase1_down_proj_mm_grad_mxfp8(
        output_grad_td, gate_pre, gate_act, up, d_gate_up, scratch, down_weight_td, 0, nl.bfloat16, setup.x4_dtype,
        config=config.phase1, use_scale_packing=setup.use_scale_packing, run_with_lnc2=run_with_lnc2,
        clamp_limits=clamp_limits, hidden_states_td=hidden_states_td, gate_weight_td=gate_weight_td,
        up_weight_td=up_weight_td, setup=setup, keep_for_phase2=True)
    d_gu_k_cols = TensorDescriptor(d_gate_up, k_axis=1)
    d_gu_k_rows = TensorDescriptor(d_gate_up, k_axis=0)
    inter_td = TensorDescriptor(intermediate if intermediate is not None else scratch, k_axis=0)
    p2 = dict(config=config.phase2, run_with_lnc2=run_with_lnc2, setup=setup)
    p3 = dict(config=config.phase3, run_with_lnc2=run_with_lnc2, setup=setup)
    p4 = dict(config=config.phase4, run_with_lnc2=run_with_lnc2, setup=setup)
    # phase 2 takes phase 1's S rows when phase 1 split S (every core alike, resident panels or not)
    rows1, cols1 = _core_ranges(S, two_i // 2, num_cores, shard_id, prefer_m=True)
    rows2 = rows1 if num_cores > 1 and cols1 == (0, two_i // 2) else None
    phase2_args = (hidden_states_grad, gate_up_weight_td, d_gu_k_cols, 0, nl.bfloat16, setup.x4_dtype)
    phase3_args = (gate_up_weight_grad, hidden_states_T_td, d_gu_k_rows, weight_grad_dtype, setup.x4_dtype)
    phase4_args = (down_proj_weight_grad, output_grad_T_td, inter_td, 0, weight_grad_dtype, setup.x4_dtype)
    plan2 = compute_phase2_hidden_states_grad_mxfp8(*phase2_args, resident=resident, rows=rows2, stage="plan", **p2)
    resident = None
    plan4 = compute_phase4_down_weight_grad_mxfp8(*phase4_args, stage="plan", **p4)
    plan3 = compute_phase3_gate_up_weight_grad_mxfp8(*phase3_args, stage="plan", **p3)
    # The one core_barrier, right after phase 1: phases 2 (from HBM), 3 and 4 (recomputed intermediate)
    # read rows of both cores. Little is in flight there (the fence waits for every earlier instruction
    # of the core), and the later phases are barrier-free: each phase's first panels load while the
    # previous phase runs its last tiles, which load nothing (stages "head", "first", "all").
    if plan2.stationary_on_chip():
        compute_phase2_hidden_states_grad_mxfp8(*phase2_args, plan=plan2, stage="first", **p2)
    if num_cores > 1:
        nisa.core_barrier(data=d_gate_up, cores=(0, 1))
    if plan2.can_prefetch(plan4):
        compute_phase2_hidden_states_grad_mxfp8(*phase2_args, plan=plan2, stage="head", **p2)
        compute_phase4_down_weight_grad_mxfp8(*phase4_args, plan=plan4, stage="first", **p4)
    compute_phase2_hidden_states_grad_mxfp8(*phase2_args, plan=plan2, stage="all", **p2)
    if plan4.can_prefetch(plan3):
        compute_phase4_down_weight_grad_mxfp8(*phase4_args, plan=plan4, stage="head", **p4)
        compute_phase3_gate_up_weight_grad_mxfp8(*phase3_args, plan=plan3, stage="first", **p3)
    compute_phase4_down_weight_grad_mxfp8(*phase4_args, plan=plan4, stage="all", **p4)
    compute_phase3_gate_up_weight_grad_mxfp8(*phase3_args, plan=plan3, stage="all", **p3)


@nki.jit
def mlp_backward_mxfp8_nki(output_grad=None, hidden_states=None, down_proj_weight=None, gate_up_weights=None,
                           gate_up_weight_T=None, gate_up_weight_T_scales=None, gate_up_weights_scales=None,
                           down_weight_T=None, down_weight_T_scales=None, output_grad_T=None, output_grad_T_scales=None,
                           hidden_states_T=None, hidden_states_T_scales=None, gate_pre=None, gate_act=None, up=None,
                           intermediate=None, run_with_lnc2=True, matmul_config=None, fp8_x4_dtype=nl.float8_e4m3fn_x4,
                           spill_reload=True, use_scale_packing=True, clamp_limits=None, *,
                           output_hidden_states_grad=None, gate_proj_weight_T=None, up_proj_weight_T=None,
                           down_proj_weight_T=None, hidden_T=None, hidden=None, d_gate_scratch=None, d_up_scratch=None,
                           silu_up_mul_gate_grad_T_scratch=None, gate_pre_scratch=None, gate_act_scratch=None,
                           up_scratch=None, hidden_scratch=None,
                           phase1_tiles_m=None, phase1_tiles_n=None, phase1_tiles_k=None, phase2_tiles_m=None,
                           phase2_tiles_n=None, phase2_tiles_k=None, phase3_tiles_m=None, phase3_tiles_n=None,
                           phase3_tiles_k=None, phase4_tiles_m=None, phase4_tiles_n=None, phase4_tiles_k=None,
                           recompute_tiles_m=None, recompute_tiles_n=None, recompute_tiles_k=None,
                           output_grad_scales=None, output_grad_is_swizzled=False, down_weight_scales=None,
                           down_weight_is_swizzled=False, gate_weight_scales=None, gate_weight_is_swizzled=False,
                           up_weight_scales=None, up_weight_is_swizzled=False, hidden_states_T_is_swizzled=False,
                           hidden_states_scales=None, hidden_states_is_swizzled=False,
                           gate_up_weights_is_swizzled=False, output_grad_T_is_swizzled=False, hidden_T_scales=None,
                           hidden_T_is_swizzled=False, gate_up_weight_T_is_swizzled=False,
                           quant_scheme="1x32", weight_grad_dtype=nl.bfloat16, matmul_precision=None):
    """Backward of Y = (silu(X·W_gateᵀ) ⊙ X·W_upᵀ)·W_downᵀ in MXFP8, recomputing missing checkpoints.

    Takes both published signatures unchanged (api.py maps them onto one set of operands): the current
    nki-library release's, positionally or by keyword (the parameters up to clamp_limits), and the API
    reference's keyword names (the keyword-only block from output_hidden_states_grad to
    gate_up_weight_T_is_swizzled; its positional order is not accepted, a reference-ordered positional call
    fails the shape checks). Aliases: output_grad / output_hidden_states_grad, down_weight_T /
    down_proj_weight_T, down_weight_T_scales / down_weight_scales, intermediate / hidden.

    Dimensions:
        output_grad dY [S, H], hidden_states X [S, H], gate_up_weights W_gu [2I, H] (gate rows first),
        down_proj_weight W_down [H, I], checkpoints gate_pre / gate_act / up / intermediate [S, I]; bf16.
        Transposed inputs: down_weight_T [I, H], gate_up_weight_T [H, 2I], gate_proj_weight_T /
        up_proj_weight_T [H, I], output_grad_T / hidden_states_T [H, S], hidden_T [I, S]: bf16, or
        pre-quantized along their last (contiguous) dimension when their `*_scales` are given (api.py
        defines the layouts: unswizzled words [F, Kp/4] + scales [F, Kp/32], or `*_is_swizzled`:
        [Kp/4, F] + [Kp/32, F]; Kp = K rounded up to 128; reference.prequantize makes both).
        output_grad, hidden_states and gate_up_weights are pre-quantized along H with output_grad_scales,
        hidden_states_scales, gate_up_weights_scales. Which tensor each matmul reads: api.py's table.

    Args:
        gate_pre, gate_act, up, intermediate: any subset may be None; only what is missing is recomputed.
        run_with_lnc2: shard across the two cores of a kernel[2] launch (see the module docstring).
        matmul_config: None, a MatmulConfig for every phase, or an MlpBwdMatmulConfig per phase.
        fp8_x4_dtype: nl.float8_e4m3fn_x4 (default) or nl.float8_e5m2_x4: the MX element format.
        spill_reload: accepted for API compatibility with nki-library; a no-op (panels stay in SBUF).
        use_scale_packing: share one scale tile between four K tiles (partition offsets 0/4/8/12).
        clamp_limits: ClampLimits of a clamped SwiGLU forward, or None.
        Scratch buffers (d_gate_scratch, ...): None or tensors of the documented shapes; not used (the
            kernel allocates the HBM scratch it needs). phase{1..4}_tiles_* / recompute_tiles_*: mapped
            onto MatmulConfig (api.matmul_config_from_tiles); exclusive with matmul_config.
        quant_scheme (ours, keyword-only): "1x32" (OCP-contiguous groups of 32 along K, default) or
            "wrapX" (groups strided by K/4 inside each 512-wide K tile, the nki-library layout).
        weight_grad_dtype (ours): nl.bfloat16 (default) or nl.float32 (or the strings "bfloat16" /
            "float32") for both weight gradients.
        matmul_precision (ours): "mxfp8" (default on trn3) or "bf16" (nc_matmul; the only choice on trn2).

    Returns:
        (hidden_states_grad [S, H] bf16, gate_up_weight_grad [2I, H], down_proj_weight_grad [H, I]) in
        shared HBM; weight gradients in weight_grad_dtype.

    NaN/Inf in the inputs propagate like the reference (an MX group containing NaN/Inf quantizes to a
    NaN scale, so the whole group's products are NaN); nothing raises on them.
    """
    # ---- options ----
    on_trn3 = nisa.get_nc_version() == nisa.nc_version.gen4
    precision = matmul_precision if matmul_precision is not None else ("mxfp8" if on_trn3 else "bf16")
    kernel_assert(precision in MATMUL_PRECISIONS,
                  f"matmul_precision must be one of {MATMUL_PRECISIONS}, got {matmul_precision!r}")
    kernel_assert(precision != "mxfp8" or on_trn3,
                  "matmul_precision='mxfp8' needs Trn3 (NeuronCore-v4) MX instructions; the target is Trn2 (NeuronCore-v3): use matmul_precision='bf16'")
    kernel_assert(str(fp8_x4_dtype) in FP8_X4_DTYPE_NAMES,
                  f"fp8_x4_dtype must be one of {list(FP8_X4_DTYPE_NAMES)}, got {fp8_x4_dtype!r}")
    kernel_assert(quant_scheme in QUANT_SCHEMES, f"quant_scheme must be one of {QUANT_SCHEMES}, got {quant_scheme!r}")
    kernel_assert(str(weight_grad_dtype) in ("bfloat16", "float32"),
                  f"weight_grad_dtype must be nl.bfloat16 or nl.float32, got {weight_grad_dtype!r}")
    wg_dtype = nl.float32 if str(weight_grad_dtype) == "float32" else nl.bfloat16
    kernel_assert(isinstance(run_with_lnc2, bool), f"run_with_lnc2 must be a bool, got {run_with_lnc2!r}")
    kernel_assert(isinstance(use_scale_packing, bool), f"use_scale_packing must be a bool, got {use_scale_packing!r}")
    kernel_assert(clamp_limits is None or isinstance(clamp_limits, ClampLimits),
                  f"clamp_limits must be a ClampLimits or None, got {clamp_limits!r}")
    setup = MatmulSetup(precision, fp8_x4_dtype, quant_scheme, use_scale_packing)

    # ---- operands of either call style (api.py) ----
    swizzled = dict(output_grad=output_grad_is_swizzled, hidden_states=hidden_states_is_swizzled,
                    down_weight_T=down_weight_is_swizzled, gate_up_weight_T=gate_up_weight_T_is_swizzled,
                    gate_up_weights=gate_up_weights_is_swizzled, output_grad_T=output_grad_T_is_swizzled,
                    hidden_states_T=hidden_states_T_is_swizzled, hidden_T=hidden_T_is_swizzled)
    for name in swizzled:
        kernel_assert(isinstance(swizzled[name], bool), f"{name}_is_swizzled must be a bool, got {swizzled[name]!r}")
    kernel_assert(not gate_weight_is_swizzled and not up_weight_is_swizzled,
                  "gate_weight_is_swizzled / up_weight_is_swizzled: pre-quantized gate_proj_weight_T / "
                  "up_proj_weight_T are not supported (see api.py); pass gate_up_weight_T pre-quantized along 2I")
    ops = resolve_operands(dict(
        output_grad=output_grad, output_hidden_states_grad=output_hidden_states_grad, hidden_states=hidden_states,
        down_proj_weight=down_proj_weight, gate_up_weights=gate_up_weights, gate_up_weight_T=gate_up_weight_T,
        gate_up_weight_T_scales=gate_up_weight_T_scales, gate_up_weights_scales=gate_up_weights_scales,
        down_weight_T=down_weight_T, down_proj_weight_T=down_proj_weight_T, down_weight_T_scales=down_weight_T_scales,
        down_weight_scales=down_weight_scales, output_grad_T=output_grad_T, output_grad_T_scales=output_grad_T_scales,
        hidden_states_T=hidden_states_T, hidden_states_T_scales=hidden_states_T_scales,
        output_grad_scales=output_grad_scales, hidden_states_scales=hidden_states_scales,
        gate_proj_weight_T=gate_proj_weight_T, up_proj_weight_T=up_proj_weight_T, gate_weight_scales=gate_weight_scales,
        up_weight_scales=up_weight_scales, hidden_T=hidden_T, hidden_T_scales=hidden_T_scales, gate_pre=gate_pre,
        gate_act=gate_act, up=up, intermediate=intermediate, hidden=hidden, d_gate_scratch=d_gate_scratch,
        d_up_scratch=d_up_scratch, silu_up_mul_gate_grad_T_scratch=silu_up_mul_gate_grad_T_scratch,
        gate_pre_scratch=gate_pre_scratch, gate_act_scratch=gate_act_scratch, up_scratch=up_scratch,
        hidden_scratch=hidden_scratch, is_swizzled=swizzled), quant_scheme, precision == "mxfp8")
    tiles = dict(phase1=(phase1_tiles_m, phase1_tiles_n, phase1_tiles_k),
                 phase2=(phase2_tiles_m, phase2_tiles_n, phase2_tiles_k),
                 phase3=(phase3_tiles_m, phase3_tiles_n, phase3_tiles_k),
                 phase4=(phase4_tiles_m, phase4_tiles_n, phase4_tiles_k),
                 recompute=(recompute_tiles_m, recompute_tiles_n, recompute_tiles_k))
    n_max = 4096 if on_trn3 else 512  # fp32 PSUM moving limit (hardware.py / spec §5.3)
    transposes = phase_transposes(ops)
    config = resolve_matmul_config(matmul_config_from_tiles(tiles, matmul_config, ops.recompute, n_max, transposes),
                                   precision == "mxfp8", ops.recompute, n_max, transposes)

    S, H, I = ops.S, ops.H, ops.I
    hidden_states_grad = nl.ndarray((S, H), dtype=nl.bfloat16, buffer=nl.shared_hbm, name="hidden_states_grad")
    gate_up_weight_grad = nl.ndarray((2 * I, H), dtype=wg_dtype, buffer=nl.shared_hbm, name="gate_up_weight_grad")
    down_proj_weight_grad = nl.ndarray((H, I), dtype=wg_dtype, buffer=nl.shared_hbm, name="down_proj_weight_grad")
    mlp_backward_mxfp8_base_nki(hidden_states_grad, gate_up_weight_grad, down_proj_weight_grad, ops.dy_k_h, ops.x_k_h,
                                ops.x_k_s, ops.dy_k_s, ops.down, ops.gate_up, ops.gate_w, ops.up_w, ops.gate_pre,
                                ops.gate_act, ops.up, ops.intermediate, setup, config, run_with_lnc2, clamp_limits,
                                wg_dtype)
    return hidden_states_grad, gate_up_weight_grad, down_proj_weight_grad
