"""Pass C of the MoE expert backward kernel (moe_bwd_mxfp8_kernel.py): the per-expert weight gradients
dW_gu[e] = sum_b d_gate_up_bᵀ X_b and dW_down[e] = sum_b dY_bᵀ hs_b, K = the tokens of the expert's blocks
(both operands MX-quantized along tokens), from the block-ordered scratch rows pass A wrote.

Three paths, chosen per expert at run time by 0/1-trip loops (ExpertLoops in moe_bwd_mxfp8_loops.py, ResidentBlocks):
    single block (moe_bwd_mxfp8_single_block.py): both operands loaded and quantized once, every output tile one
    matmul;
    2..R blocks (MXFP8, ResidentBlocks.R > 1): every block's rows of this core's tiles loaded and quantized
    once into static SBUF slots (one guarded loop per slot), then each group of output tiles accumulates
    over the slots in PSUM (compute_phase3_resident_grads_mxfp8), in the code of the smallest slot tier that
    holds the expert's blocks (ResidentBlocks.tiers: 8 slot loops for most experts, R for a hot one);
    R < blocks <= W R (MXFP8, W = PASS_C_RESIDENT_WINDOWS > 1): the resident code once per window of R blocks,
    each tile's fp32 partial sum carried across windows through HBM scratch (compute_phase3_windowed_grads_mxfp8);
    more blocks (or BF16): groups of WEIGHT_GRAD_PSUM_TILES output tiles accumulate in PSUM across the
    block loop (first block overwrites, later blocks add), each group re-reading the blocks' rows;
and an expert without blocks stores zeros. Numerics and the LNC2 split: docs/moe.md, sections 3-5.
The optional gate_up bias gradient is moe_bwd_mxfp8_bias_grad.py's.
"""
from __future__ import annotations

import nki.isa as nisa
import nki.language as nl

from ...core.kernel_helpers import kernel_assert, shard_range
from ...core.matmul import (CoreSplit, PanelPlacement, PanelSlots, matmul_panels, panel_bytes_per_partition,
                            panel_columns, panel_from_row_loader)
from ...core.matmul.constants import MX_PACK
from ...core.matmul.sources import blocks
from .moe_bwd_mxfp8_pass_c_stores import RowStore, add_partial, evict_and_store, store_window
from .constants import (MOE_N_TILE, MX_K_TILE, PARTITIONS, PASS_C_RESIDENT_BLOCKS, PASS_C_RESIDENT_BUDGET_BYTES,
                        PASS_C_RESIDENT_PARTS, PASS_C_RESIDENT_STAGES, PASS_C_RESIDENT_TIERS, PASS_C_RESIDENT_WINDOWS,
                        PASS_C_STAGING_BUFFERS, SINGLE_BLOCK_LOAD_WIDTH, WEIGHT_GRAD_PSUM_TILES,
                        WINDOW_GROUP_M_TILES, WINDOW_NEXT_MOVING_AHEAD, WINDOW_REORDER_MAX_SLOTS)

__all__ = ["BlockRowSource", "ResidentBlocks", "compute_phase3_expert_weight_grads_mxfp8",
           "compute_phase3_multi_block_grads_mxfp8", "compute_phase3_resident_grads_mxfp8",
           "compute_phase3_windowed_grads_mxfp8", "resident_block_count", "single_load_stage",
           "store_zero_expert_grads"]


class BlockRowSource(nl.NKIObject):
    """A K = tokens operand of block i: rows of a [N, B, F] block-ordered scratch written by pass A.
    rows(i, f0, f_size) -> a load_rows callable for panel_from_row_loader (plain DMAs, no gather)."""

    def __init__(self, ctx, scratch):
        self.ctx, self.scratch = ctx, scratch

    def rows(self, i, f0, f_size):
        ctx, scratch = self.ctx, self.scratch

        def load_rows(dst, first, step, count):
            nisa.dma_copy(dst=dst, src=ctx.block_rows(scratch, i, first, count, step, f0, f_size))

        return load_rows

    def tile(self, i, f0, f_size):
        """panel_from_row_loader's load_tile for columns [f0, f0 + f_size) of block i where the scratch is
        slot-interleaved (MoeContext.slot_tile: one DMA per K tile, a partition's four rows in one run), else None."""
        ctx, scratch = self.ctx, self.scratch
        if not ctx.is_interleaved(scratch):
            return None

        def load_tile(dst, k0, partitions):
            nisa.dma_copy(dst=dst, src=ctx.slot_tile(scratch, i, k0, partitions, f0, f_size))

        return load_tile


def _tile_groups(ctx, m_total, n_total):
    """This core's output tiles of an [M, N] weight gradient in groups of at most WEIGHT_GRAD_PSUM_TILES
    (their fp32 accumulators stay in PSUM across the expert's block loop). A group is a run of m tiles
    under one n tile: its stationary rows are one wide load (long DMA runs), sliced per tile. Returns
    [(n block, [m blocks])]; the group count is core 0's (the larger share), so both cores run the same
    number of block loops (a core with fewer tiles runs empty groups)."""

    def groups_of(split):
        (m_lo, m_hi), (n_lo, n_hi) = split.ranges(m_total, n_total)
        m_blocks = blocks(m_lo, m_hi, PARTITIONS)
        return [(nb, m_blocks[g:g + WEIGHT_GRAD_PSUM_TILES]) for nb in blocks(n_lo, n_hi, MOE_N_TILE)
                for g in range(0, len(m_blocks), WEIGHT_GRAD_PSUM_TILES)]

    mine = groups_of(ctx.split)
    count = len(groups_of(CoreSplit(ctx.split.num_cores, 0)))
    return mine + [((0, 0), [])] * (count - len(mine))


def compute_phase3_expert_weight_grads_mxfp8(ctx, e, out, lhs, rhs, m_total, n_total, wg_dtype):
    """out[e] [M, N] = wg(sum over expert e's blocks b of lhs_bᵀ [M, B] @ rhs_b [B, N]) (K = B tokens).

    Dimensions:
        lhs, rhs: BlockRowSource of F = M and F = N; out: [E, M, N] in wg_dtype (shared HBM).
        dW_gu: lhs = d_gate_up (F=2I), rhs = X (F=H); dW_down: lhs = dY (F=H), rhs = hs (F=I); all four
        block-ordered scratch rows written by pass A (padding rows zero).
    Runs inside the expert's "two or more blocks" loop (ExpertLoops.if_multi). Per group of output tiles, the fp32
    accumulators stay in PSUM across the block loop: the first block's matmul overwrites (a peeled loop
    of 0 or 1 trip, [lo, first)), every later block's adds ([first, hi)); each block's K tiles (MXFP8: the
    whole block, B <= 512; BF16: 128 rows) add in order, so acc = fp32(acc + mm(tile)) as the reference.
    The eviction adds +0.0 (fp32): the reference's sum starts from +0, so a first product of -0 must
    leave +0 (x + 0.0 == x otherwise).
    """
    setup, B = ctx.setup, ctx.B
    lo, first, hi = ctx.loops.bounds(e)
    for g, ((n0, nsz), m_blocks) in enumerate(_tile_groups(ctx, m_total, n_total)):
        accs = [nl.ndarray((PARTITIONS, MOE_N_TILE), dtype=nl.float32, buffer=nl.psum) for _ in m_blocks]

        def body(i, accumulate, n0=n0, nsz=nsz, m_blocks=m_blocks, accs=accs):
            if not m_blocks:
                return
            m_lo, m_hi = m_blocks[0][0], m_blocks[-1][0] + m_blocks[-1][1]
            wide = panel_from_row_loader(lhs.rows(i, m_lo, m_hi - m_lo), B, m_hi - m_lo, m_hi - m_lo, setup,
                                         stages=ctx.stages, load_tile=lhs.tile(i, m_lo, m_hi - m_lo))
            b = panel_from_row_loader(rhs.rows(i, n0, nsz), B, nsz, nsz, setup, stages=ctx.stages,
                                      load_tile=rhs.tile(i, n0, nsz))
            for (m0, msz), acc in zip(m_blocks, accs):
                a = panel_columns(wide, m0 - m_lo, ctx.f_pad(msz))
                # K=the block's B tokens (one MX K tile; BF16: B/128 tiles), M=msz, N=nsz
                matmul_panels(acc[:a.f_pad, :nsz], a, b, setup, accumulate=accumulate)

        nl.fori_loop(lo, first, lambda i, body=body: body(i, False))
        nl.fori_loop(first, hi, lambda i, body=body: body(i, True))
        for j, ((m0, msz), acc) in enumerate(zip(m_blocks, accs)):
            evict_and_store(out, e, acc, m0, msz, n0, nsz, wg_dtype, g + j)
        accs = acc = body = None  # drop the group's PSUM before the next group allocates its own


def _stage(ctx, k):
    """The k-th load's MXFP8 staging tile (of the first PASS_C_RESIDENT_STAGES of ctx.stages), as a one-tile ring for
    panel_from_row_loader (None in BF16).

    A pass-C operand is one K tile (B <= 512 tokens), so panel_from_row_loader's own rotation (K tile t takes
    stages[t % len]) puts every load on stages[0], each waiting for the quantize of the one before. The resident
    path numbers its loads in program order instead (k static in a traced body: the same on hardware, where a loop
    body is traced once), so consecutive loads take different tiles and a load overlaps the quantize before it
    (docs/moe.md section 10, round 6b). The single-block and streamed paths keep stages[0]."""
    return None if ctx.stages == None else [ctx.stages[k % PASS_C_RESIDENT_STAGES]]  # noqa: E711


def single_load_stage(ctx, k):
    """The k-th load's staging tile of the single-block path, as a one-tile ring (None in BF16): consecutive loads take
    the PASS_C_STAGING_BUFFERS tiles in turn, so a load waits for the quantize PASS_C_STAGING_BUFFERS loads before it
    instead of the one just before (_stage's reason; docs/moe.md section 10, round 7b)."""
    return None if ctx.stages == None else [ctx.stages[k % PASS_C_STAGING_BUFFERS]]  # noqa: E711


def _n_part(n_lo, n_hi, part):
    """Columns [lo, hi) of part p of P (part = (p, P); None: all) of this core's N columns [n_lo, n_hi): whole
    MOE_N_TILE tiles, split as evenly as shard_range splits them (an empty range where the core has fewer tiles)."""
    if part == None:  # noqa: E711
        return n_lo, n_hi
    tiles = blocks(n_lo, n_hi, MOE_N_TILE)
    a, b = shard_range(len(tiles), part[1], part[0])
    return (tiles[a][0], tiles[b - 1][0] + tiles[b - 1][1]) if a < b else (n_lo, n_lo)


def resident_block_count(ctx, grads, parts=1) -> int:
    """R: the most blocks of one expert whose pass-C operands stay in SBUF (compute_phase3_resident_grads_mxfp8),
    or 0 where that path does not apply: BF16 (its K tiles are 128 rows, PanelSlots holds MXFP8 tiles), a core's
    N columns of a gradient beyond one PSUM of accumulators (WEIGHT_GRAD_PSUM_TILES x MOE_N_TILE), or fewer
    than 2 blocks within PASS_C_RESIDENT_BUDGET_BYTES.

    Per block and partition the slots take this core's N columns of the moving operand and one
    SINGLE_BLOCK_LOAD_WIDTH piece of the stationary one (panel_bytes_per_partition of R K tiles); the two
    gradients run one after the other, so the larger of them counts. Every core's split is checked: both
    must take the same path. parts > 1: the slots hold one of `parts` parts of the N columns (_n_part), the
    resident tiers above R (ResidentBlocks.tier_parts).

    Dimensions:
        grads: [(out, lhs, rhs, M, N)] as the kernel's pass C (dW_gu [2I, H], dW_down [H, I]).
    """
    if not ctx.setup.is_mx:
        return 0
    widths = []
    for _, _, _, m_total, n_total in grads:
        for core in range(ctx.split.num_cores):
            _, (n_lo, n_hi) = CoreSplit(ctx.split.num_cores, core).ranges(m_total, n_total)
            if n_hi - n_lo > WEIGHT_GRAD_PSUM_TILES * MOE_N_TILE:
                return 0
            for p in range(parts):
                p_lo, p_hi = _n_part(n_lo, n_hi, (p, parts))
                widths.append(
                    [csz for _, csz in blocks(p_lo, p_hi, SINGLE_BLOCK_LOAD_WIDTH)] + [SINGLE_BLOCK_LOAD_WIDTH])

    def fits(r):
        return all(sum(panel_bytes_per_partition(r * MX_K_TILE, w, ctx.setup) for w in ws)
                   <= PASS_C_RESIDENT_BUDGET_BYTES for ws in widths)

    return max([0] + [r for r in range(2, PASS_C_RESIDENT_BLOCKS + 1) if fits(r)])


class ResidentBlocks(nl.NKIObject):
    """Run-time bounds of the resident pass-C path, derived once (outside every loop) from ExpertLoops' offsets.

    Tiers: an expert of nb blocks takes the smallest tier r in `tiers` (PASS_C_RESIDENT_TIERS capped at R, then R)
    with nb <= r, whose code runs r slot loops (a slot loop costs its loop control and register loads even when
    it runs no trip, so a 2-block expert does not pay R = 16 of them); over R blocks it takes the streamed path.
    Parts tiers (with windows): R_P = resident_block_count with P parts of the N columns (P in PASS_C_RESIDENT_PARTS),
    capped at W R, a tier where it exceeds the tiers before (tier_parts[R_P] = P); an expert of those blocks runs the
    resident code once per part (compute_phase3_multi_block_grads_mxfp8) instead of windows, so windows start one
    block above the largest tier.

    Dimensions (SBUF int32 tiles, one column per expert, nb = offsets[e+1] - offsets[e]):
        fits[t] [1, E] = min(max(r_t + 1 - nb, 0), 1) - (the same for r_{t-1}): tier t is the expert's (used with
        if_multi: nb >= 2); over [1, E] = 1 - min(max(R + 1 - nb, 0), 1); slot_lo[j], slot_hi[j] [1, E] =
        min(offsets[e] + j (+ 1), offsets[e+1]) for j < R: slot j holds block offsets[e] + j when the expert has
        one (a 0/1-trip loop per slot).
    Windows (PASS_C_RESIDENT_WINDOWS = W > 1): window_used[w] [1, E] = min(max(nb - w R, 0), 1) for 1 <= w <= W;
    windowed = 1 - within[largest tier] - over (largest tier < nb <= W R); window_last[w] = window_used[w] -
    window_used[w+1];
    over = window_used[W] (streamed); slot bounds for W R slots (slot w R + j: block offsets[e] + w R + j);
    partials: one [M, N] fp32 HBM scratch per gradient (each core uses its own tiles).
    Integer values < 2^24, exact in VectorE's fp32 arithmetic (as ExpertLoops).
    """

    def __init__(self, ctx, grads):
        self.ctx, self.R, E = ctx, resident_block_count(ctx, grads), ctx.E
        self.W = max(1, PASS_C_RESIDENT_WINDOWS)
        self.tiers = sorted({min(r, self.R) for r in PASS_C_RESIDENT_TIERS} | {self.R})
        # the tiers of N parts (R_{P-1} < nb <= R_P): only with windows (their slots use window 0 .. W-1's bounds)
        self.tier_parts = {}  # tier -> its part count
        for parts in PASS_C_RESIDENT_PARTS if self.R >= 2 and self.W > 1 else ():
            r = min(resident_block_count(ctx, grads, parts), self.R * self.W)
            if r > self.tiers[-1]:
                self.tiers.append(r)
                self.tier_parts[r] = parts
        self.windowed = None
        if self.R < 2:
            return
        offs = ctx.loops.offs
        nb = nl.ndarray((1, E), dtype=nl.int32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=nb, data1=offs[:, 1:E + 1], data2=offs[:, 0:E], op=nl.subtract)
        within = []  # within[t] = 1 where nb <= tiers[t]
        for r in self.tiers:
            le = nl.ndarray((1, E), dtype=nl.int32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=le, data=nb, op0=nl.multiply, operand0=-1.0, op1=nl.add, operand1=float(r + 1))
            nisa.tensor_scalar(dst=le, data=le, op0=nl.maximum, operand0=0.0, op1=nl.minimum, operand1=1.0)
            within.append(le)
        self.fits = [within[0]]
        for t in range(1, len(within)):
            tier = nl.ndarray((1, E), dtype=nl.int32, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=tier, data1=within[t], data2=within[t - 1], op=nl.subtract)
            self.fits.append(tier)
        # window_used[w] [1, E] = min(max(nb - w R, 0), 1): the expert has a block in window w
        # (slots w R .. w R + R - 1)
        self.window_used = [None]
        for w in range(1, self.W + 1):
            used = nl.ndarray((1, E), dtype=nl.int32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=used, data=nb, op0=nl.add, operand0=float(-w * self.R), op1=nl.maximum, operand1=0.0)
            nisa.tensor_scalar(dst=used, data=used, op0=nl.minimum, operand0=1.0)
            self.window_used.append(used)
        # above the largest tier: windowed (nb <= W R) when W > 1, else streamed; streamed: nb > W R
        self.over = self.window_used[self.W]
        self.windowed = None
        if self.W > 1:
            # windowed = 1 - within[largest tier] - over
            self.windowed = nl.ndarray((1, E), dtype=nl.int32, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=self.windowed, data1=within[-1], data2=self.over, op=nl.add)
            nisa.tensor_scalar(dst=self.windowed, data=self.windowed, op0=nl.multiply, operand0=-1.0, op1=nl.add,
                               operand1=1.0)
            # the expert's last window is w: used[w] - used[w+1]
            self.window_last = [None] + [nl.ndarray((1, E), dtype=nl.int32, buffer=nl.sbuf) for _ in range(1, self.W)]
            for w in range(1, self.W):
                nisa.tensor_tensor(dst=self.window_last[w], data1=self.window_used[w], data2=self.window_used[w + 1],
                                   op=nl.subtract)
            self.partials = [nl.ndarray((m_total, n_total), dtype=nl.float32, buffer=nl.shared_hbm,
                                        name=f"moe_bwd_weight_grad_partial{g}")
                             for g, (_, _, _, m_total, n_total) in enumerate(grads)]
        self.slot_lo, self.slot_hi = [], []
        for j in range(self.R * self.W):
            for bounds, plus in ((self.slot_lo, j), (self.slot_hi, j + 1)):
                tile = nl.ndarray((1, E), dtype=nl.int32, buffer=nl.sbuf)
                nisa.tensor_scalar(dst=tile, data=offs[:, 0:E], op0=nl.add, operand0=float(plus))
                nisa.tensor_tensor(dst=tile, data1=tile, data2=offs[:, 1:E + 1], op=nl.minimum)
                bounds.append(tile)

    # registers are loaded from one element of these tiles where a loop needs them (ExpertLoops._reg)
    def if_fits(self, e, body):
        """body(r) once, r = the tier of expert e's blocks, when they fit the R slots."""
        for t, r in enumerate(self.tiers):
            nl.fori_loop(0, self.ctx.loops._reg(self.fits[t], e), lambda _, r=r: body(r))

    def if_over(self, e, body):
        """body() once when expert e has more blocks than slots."""
        nl.fori_loop(0, self.ctx.loops._reg(self.over, e), lambda _: body())

    def if_windowed(self, e, body):
        """body() once when expert e has more blocks than R but at most W R (PASS_C_RESIDENT_WINDOWS)."""
        if self.windowed != None:  # noqa: E711
            nl.fori_loop(0, self.ctx.loops._reg(self.windowed, e), lambda _: body())

    def if_window(self, e, w, body):
        """body() once when expert e has a block in window w >= 1 (window 0 always has: nb > R)."""
        nl.fori_loop(0, self.ctx.loops._reg(self.window_used[w], e), lambda _: body())

    def if_last_window(self, e, w, last, body):
        """body() once when window w is (last=True) or is not (last=False) expert e's last (inside if_windowed)."""
        tile = self.window_last[w] if last else self.window_used[w + 1]
        nl.fori_loop(0, self.ctx.loops._reg(tile, e), lambda _: body())

    def for_slots(self, e, body, slots=None, window=0, first=0):
        """body(i, j) for each slot j in [first, slots) (default R) of window `window` that holds a block of expert e
        (block offsets[e] + window R + j; i: the block's register)."""
        reg = self.ctx.loops._reg
        for j in range(first, self.R if slots == None else slots):  # noqa: E711
            s = window * self.R + j
            nl.fori_loop(reg(self.slot_lo[s], e), reg(self.slot_hi[s], e), lambda i, j=j: body(i, j))


def _resident_schedule(ctx, m_total, n_total, part=None):
    """This core's stationary pieces and output-tile groups of the resident path: [((p0, psz), [[m blocks]])],
    pieces of SINGLE_BLOCK_LOAD_WIDTH columns of its M range, groups of m tiles under all of its N tiles (at
    most WEIGHT_GRAD_PSUM_TILES accumulators). Piece and group counts are core 0's (the larger share): a core
    with fewer runs empty ones, so both cores enter the same loops. part: of the N columns (_n_part)."""

    def schedule(split):
        (m_lo, m_hi), (n_lo, n_hi) = split.ranges(m_total, n_total)
        n_lo, n_hi = _n_part(n_lo, n_hi, part)
        return [(piece, blocks(piece[0], piece[0] + piece[1], PARTITIONS))
                for piece in blocks(m_lo, m_hi, SINGLE_BLOCK_LOAD_WIDTH)], len(blocks(n_lo, n_hi, MOE_N_TILE))

    first, n_tiles = schedule(CoreSplit(ctx.split.num_cores, 0))
    per_group = max(1, WEIGHT_GRAD_PSUM_TILES // max(1, n_tiles))
    mine, _ = schedule(ctx.split)
    out = []
    for p, (_, tiles0) in enumerate(first):
        piece, tiles = mine[p] if p < len(mine) else ((0, 0), [])
        groups = [tiles[g:g + per_group] for g in range(0, len(tiles), per_group)]
        out.append((piece, groups + [[]] * (len(range(0, len(tiles0), per_group)) - len(groups))))
    return out


def compute_phase3_resident_grads_mxfp8(ctx, e, out, lhs, rhs, m_total, n_total, wg_dtype, slots=None, window=None,
                                        part=None, carry=None):
    """out[e] = wg(sum over expert e's blocks b of lhs_bᵀ @ rhs_b) for an expert of 2..R blocks, each block's rows
    read from HBM and quantized once per core (the streamed path re-reads them once per PSUM group).

    Dimensions: as compute_phase3_expert_weight_grads_mxfp8; this core's output [M_c, N_c] with N_c <=
    WEIGHT_GRAD_PSUM_TILES x MOE_N_TILE (resident_block_count).
    Slots: block lo + j of the expert goes to static slot j < R of SBUF room allocated here (PanelSlots, one
    allocation per slot: PanelPlacement.per_k_tile(), so R slots never need one R x 4 KiB gap; docs/moe.md section 10,
    round 6a),
    written in a 0/1-trip loop per slot (ResidentBlocks.for_slots): first the moving operand (rhs: all N_c columns,
    in SINGLE_BLOCK_LOAD_WIDTH pieces), then per piece of SINGLE_BLOCK_LOAD_WIDTH stationary columns (lhs)
    its K tiles, and per group of m tiles under all N_c columns one slot loop of matmuls into the group's PSUM
    accumulators: slot 0 (always present: the expert has >= 2 blocks) overwrites, slot j > 0 adds, so each
    tile's sum runs over the blocks in order as the reference's; evicted with +0.0 and stored.

    Windows (window = (w, partial), an expert of R < nb <= W R blocks: compute_phase3_windowed_grads_mxfp8): the
    slots hold blocks lo + w R + j; in window w > 0 each tile's slot-0 matmul overwrites PSUM, then the fp32
    partial sum of the earlier windows (partial [M, N] fp32 HBM scratch, this core's tiles) is added to it on VectorE
    (fp32(mm + acc) == fp32(acc + mm): the reference's next step), then slots 1.. add. A window that is not the
    expert's last stores its tiles' fp32 sums to `partial` (as they are); the last one evicts with +0.0 and stores.
    A window takes its tiles n tile by n tile and loads the moving operand piece by piece (_window_by_n_tiles).

    Parts (part = (p, P), a tier above R: ResidentBlocks.tier_parts): only the output tiles of part p of this core's N
    columns (_n_part), so the slots hold that part of the moving operand; the stationary pieces are loaded again per
    part. Each tile still sums all of the expert's blocks in order in PSUM: the same bits as one pass.
    Carry (parts only: a one-element list the caller keeps across the parts of one gradient): the parts walk the
    stationary pieces in snake order (odd parts backwards), so part p + 1 starts on the piece part p ended on; that
    piece's slots stay in SBUF across the boundary (carry[0]) and part p + 1 multiplies them without a load or
    quantize (the same blocks in the same slots: the same bits; docs/moe.md section 10, round 20c).
    """
    setup, B = ctx.setup, ctx.B
    R = ctx.resident.R if slots == None else slots  # noqa: E711  (the expert's tier: ResidentBlocks.if_fits)
    (m_lo, m_hi), (n_lo, n_hi) = ctx.split.ranges(m_total, n_total)
    n_lo, n_hi = _n_part(n_lo, n_hi, part)
    # a window whose moving piece 0 the window before loaded into its own slots (handoff [slots, flag]) takes them
    handoff = window[2] if window != None else None  # noqa: E711
    moving = [(c0, handoff[0] if q == 0 and handoff != None and handoff[0] != None  # noqa: E711
               else PanelSlots(R, csz, setup, PanelPlacement.per_k_tile()))
              for q, (c0, csz) in enumerate(blocks(n_lo, n_hi, SINGLE_BLOCK_LOAD_WIDTH)) if m_lo < m_hi]
    # each n tile and the moving piece that holds it (pieces start at n_lo, so a tile never straddles two)
    n_tiles = [(n0, nsz, c0, slots) for n0, nsz in blocks(n_lo, n_hi, MOE_N_TILE) for c0, slots in moving
               if c0 <= n0 < c0 + slots.f_pad]

    def load(src, i, j, c0, slots, k):
        # an expert above R (parts: its stationary operand read once per part; windows) is DMA-bound: its loads go
        # round all the ring's tiles, a load waiting for the quantize PASS_C_STAGING_BUFFERS loads back (round 9c)
        stages = _stage(ctx, k) if part == None and window == None else single_load_stage(ctx, k)  # noqa: E711
        panel_from_row_loader(src.rows(i, c0, slots.f_pad), B, slots.f_pad, slots.f_pad, setup, stages=stages,
                              into=(slots, j), load_tile=src.tile(i, c0, slots.f_pad))

    def load_moving(i, j):  # slot j's loads numbered j * pieces + q: consecutive slots rotate the staging tiles
        for q, (c0, slots) in enumerate(moving):
            load(rhs, i, j, c0, slots, j * len(moving) + q)

    if window != None:  # noqa: E711
        _window_by_n_tiles(ctx, e, window, out, lhs, rhs, m_total, n_total, wg_dtype, R, moving, n_tiles, load)
        return
    ctx.resident.for_slots(e, load_moving, R)
    t = 0
    schedule = _resident_schedule(ctx, m_total, n_total, part)
    # odd parts walk the pieces backwards; the decision is static (part index, piece position), so both cores skip
    # the same loads (a core's padding piece carries None)
    snake = carry != None and part != None  # noqa: E711
    if snake and part[0] % 2:
        schedule = schedule[::-1]
    for s, ((p0, psz), groups) in enumerate(schedule):
        if snake and part[0] > 0 and s == 0:
            # the piece the part before ended on, still in its slots; the carry lets go of it, so it is freed after
            # its groups as any piece (one stationary piece in SBUF at a time, as without the carry)
            stationary, carry[0] = carry[0], None
        else:
            stationary = PanelSlots(R, ctx.f_pad(psz), setup, PanelPlacement.per_k_tile()) if psz else None

            def load_stationary(i, j, p0=p0, stationary=stationary):
                if stationary != None:  # noqa: E711  (a padding piece: the loop runs, empty)
                    load(lhs, i, j, p0, stationary, j)

            ctx.resident.for_slots(e, load_stationary, R)
        for m_group in groups:
            accs = [[nl.ndarray((PARTITIONS, MOE_N_TILE), dtype=nl.float32, buffer=nl.psum) for _ in n_tiles]
                    for _ in m_group]

            body = _group_matmuls(ctx, stationary, p0, m_group, n_tiles, accs)
            ctx.resident.for_slots(e, body, R)
            for (m0, msz), row in zip(m_group, accs):
                store = RowStore(out, e, m0, msz, n_lo, n_hi, wg_dtype, engines=(nisa.engine.scalar,))
                for (n0, nsz, _, _), acc in zip(n_tiles, row):
                    store.tile(acc, n0, nsz, t)
                    t += 1
            accs = row = acc = body = store = None  # drop the group's PSUM before the next group allocates its own
        if snake and s == len(schedule) - 1:
            carry[0] = stationary  # kept for the next part's first piece
        stationary = load_stationary = None


def _group_matmuls(ctx, stationary, p0, m_group, n_group, accs):
    """body(i, j) for ResidentBlocks.for_slots: slot j's matmuls into the PSUM accumulators accs[m][n] of the output
    tiles m_group x n_group (n tiles as compute_phase3_resident_grads_mxfp8's: (n0, nsz, c0, moving slots)); slot 0
    overwrites, later slots add (the reference's block order)."""
    P = ctx.B // MX_PACK

    def body(i, j):
        for (m0, msz), row in zip(m_group, accs):
            a = panel_columns(stationary.tile(j, P), m0 - p0, ctx.f_pad(msz))
            for (n0, nsz, c0, slots), acc in zip(n_group, row):
                # K=the block's B tokens (one MX K tile), M=msz, N=nsz
                matmul_panels(acc[:a.f_pad, :nsz], a, panel_columns(slots.tile(j, P), n0 - c0, nsz), ctx.setup,
                              accumulate=j > 0)

    return body


def _window_by_n_tiles(ctx, e, window, out, lhs, rhs, m_total, n_total, wg_dtype, R, moving, n_tiles, load):
    """Window w of a windowed expert (window = (w, partial); compute_phase3_resident_grads_mxfp8's moving pieces
    `moving`, n tiles `n_tiles` and `load`), its output tiles taken n tile by n tile: per stationary piece, one group
    per n tile of the piece's m tiles (at most SINGLE_BLOCK_LOAD_WIDTH / PARTITIONS accumulators). The moving operand is
    loaded piece by piece (all slots of piece 0, then the stationary piece, then the first group; piece q + 1 once the
    first group on piece q has its slot-0 matmuls and partial-sum adds issued), so a window's first group waits for one
    moving piece's loads instead of all of them (docs/moe.md section 10, round 12a). In a window w > 0, whose groups add
    the partial sums on VectorE right after their slot-0 matmuls, no group's adds queue behind more quantizes than they
    must (round 26c): piece q + 1's first R / 2 slots load after the first group on piece q and the others after the
    second (where piece q has two n tiles), and each stationary piece loads slot 0 before its first group and slots 1..
    after that group's adds. Each tile's sum is the resident
    path's: slot 0 overwrites, the earlier windows' fp32 partial sum is added (w > 0), slots 1.. add, in block order.
    The expert's last window stores its tiles one by one; the others carry them (store_window), a group's slots 1..
    and copies in parts of WINDOW_GROUP_M_TILES m tiles; the next window's moving piece 0 loads here (round 41b).

    Dimensions: as compute_phase3_resident_grads_mxfp8 (this core's [M_c, N_c] tiles)."""
    w, partial, handoff = window
    # core 0's n tiles and moving pieces (the larger share): a core with fewer runs empty groups and loads, so both
    # enter the same loops; n tile g of core 0 is the first on its piece q: piece q + 1 loads after its slot 0
    (m_lo0, m_hi0), (n_lo0, n_hi0) = CoreSplit(ctx.split.num_cores, 0).ranges(m_total, n_total)
    tiles0, pieces0 = blocks(n_lo0, n_hi0, MOE_N_TILE), blocks(n_lo0, n_hi0, SINGLE_BLOCK_LOAD_WIDTH)
    groups = n_tiles + [None] * (len(tiles0) - len(n_tiles))
    # after group g: [(moving piece, first slot, end slot)]. Where w > 0 VectorE runs each group's partial-sum adds in
    # program order with the quantizes issued before them, and a group's slot-1 matmuls wait for its adds: piece q + 1's
    # slots split over the two groups on piece q, so neither group's adds wait for all R of its quantizes (round 26c)
    load_after = {}
    for q, (c0, _) in enumerate(pieces0[:-1]):
        first = next(g for g, (n0, _) in enumerate(tiles0) if n0 >= c0)
        split = w > 0 and tiles0[first + 1][0] < pieces0[q + 1][0]
        load_after.setdefault(first, []).append((q + 1, 0, R // 2 if split else R))
        if split:
            load_after.setdefault(first + 1, []).append((q + 1, R // 2, R))

    def load_moving(q, lo=0, hi=None, window=w):  # window w + 1: the next window's blocks into these slots
        def body(i, j):
            if q < len(moving):
                c0, slots = moving[q]
                load(rhs, i, j, c0, slots, q * R + j)

        ctx.resident.for_slots(e, body, R if hi == None else hi, window, first=lo)  # noqa: E711

    # core 0's m tiles per stationary piece (_resident_schedule's pieces): the window group's parts count on them
    m_tiles0 = [len(blocks(c0, c0 + csz, PARTITIONS)) for c0, csz in blocks(m_lo0, m_hi0, SINGLE_BLOCK_LOAD_WIDTH)]
    # the next window's moving piece 0 loads into this window's piece-0 slots after their last group (the last
    # stationary piece's last n tile on piece 0; core 0's tiles), under this window's remaining groups (round 41b)
    g_next = max(g for g, (n0, _) in enumerate(tiles0) if len(pieces0) < 2 or n0 < pieces0[1][0])
    ahead = WINDOW_NEXT_MOVING_AHEAD and R <= WINDOW_REORDER_MAX_SLOTS and w + 1 < ctx.resident.W
    if not handoff[1]:
        load_moving(0)
    handoff[0], handoff[1] = None, False
    schedule = _resident_schedule(ctx, m_total, n_total)
    t = 0
    for s, ((p0, psz), m_groups) in enumerate(schedule):
        m_group = [m for group in m_groups for m in group]
        kernel_assert(len(m_group) <= WEIGHT_GRAD_PSUM_TILES,
                      f"{len(m_group)} m tiles of a stationary piece > {WEIGHT_GRAD_PSUM_TILES} PSUM accumulators")
        stationary = PanelSlots(R, ctx.f_pad(psz), ctx.setup, PanelPlacement.per_k_tile()) if psz else None

        def load_stationary(i, j, p0=p0, stationary=stationary):
            if stationary != None:  # noqa: E711  (a padding piece: the loop runs, empty)
                load(lhs, i, j, p0, stationary, j)

        # w > 0: slot 0 only before the first group, slots 1.. after its adds (which would otherwise wait on VectorE
        # for all R of the piece's quantizes, where its slot-0 matmuls need one)
        ctx.resident.for_slots(e, load_stationary, 1 if w > 0 else R, w)
        # slots 1.. and the carry copies / evictions in parts of WINDOW_GROUP_M_TILES m tiles where R is at most
        # WINDOW_REORDER_MAX_SLOTS (core 0's count: a core with fewer runs shorter or empty parts); slot 0, the adds
        # and the loads between them as before (round 26c)
        size = WINDOW_GROUP_M_TILES if R <= WINDOW_REORDER_MAX_SLOTS else WEIGHT_GRAD_PSUM_TILES
        parts = [(h, h + size) for h in range(0, max(1, m_tiles0[s]), size)]
        kernel_assert(parts[-1][1] >= len(m_group),
                      f"window group parts {parts} leave m tiles of this core's {len(m_group)} uncomputed")
        for g, n_tile in enumerate(groups):
            n_group = [] if n_tile == None or not m_group else [n_tile]  # noqa: E711
            accs = [[nl.ndarray((PARTITIONS, MOE_N_TILE), dtype=nl.float32, buffer=nl.psum) for _ in n_group]
                    for _ in (m_group if n_group else [])]
            body = _group_matmuls(ctx, stationary, p0, m_group, n_group, accs)
            ctx.resident.for_slots(e, body, 1, w)  # slot 0 overwrites
            if w > 0:
                add_partial(partial, m_group, n_group, accs)
                if g == 0:
                    ctx.resident.for_slots(e, load_stationary, R, w, first=1)
            if s == 0 and g in load_after:
                for q, lo, hi in load_after[g]:
                    load_moving(q, lo, hi)
            n_lo, n_hi = (n_tile[0], n_tile[0] + n_tile[1]) if n_group else (0, 0)
            for a, b in parts:
                body = _group_matmuls(ctx, stationary, p0, m_group[a:b], n_group, accs[a:b])
                ctx.resident.for_slots(e, body, R, w, first=1)
                store_window(ctx, e, w, out, partial, m_group[a:b], n_group, accs[a:b], n_lo, n_hi, wg_dtype, t)
                t += len(accs[a:b]) * len(n_group)
            accs = body = None  # drop the group's PSUM before the next group allocates its own
            if ahead and s == len(schedule) - 1 and g == g_next:
                ctx.resident.if_window(e, w + 1, lambda: load_moving(0, window=w + 1))  # 0/1 trip, both cores
                handoff[0], handoff[1] = moving[0][1] if moving else None, True
        stationary = load_stationary = None


def compute_phase3_windowed_grads_mxfp8(ctx, e, out, lhs, rhs, m_total, n_total, wg_dtype, partial):
    """out[e] for an expert of R < nb <= W R blocks (ResidentBlocks.if_windowed): its blocks in windows of R resident
    slots (each block read and quantized once per core), the output tiles' fp32 partial sums carried across windows
    through `partial` [M, N] fp32 HBM scratch (this core's tiles only: no other core reads or writes them), in the
    reference's order (compute_phase3_resident_grads_mxfp8, window). Window 0 always runs; window w > 0 in a 0/1-trip
    loop (the expert has a block there).

    Dimensions: as compute_phase3_resident_grads_mxfp8; partial [M, N] float32 (shared HBM).
    """
    handoff = [None, False]  # moving piece 0's slots loaded ahead by the window before, and whether it did
    compute_phase3_resident_grads_mxfp8(ctx, e, out, lhs, rhs, m_total, n_total, wg_dtype,
                                        window=(0, partial, handoff))
    for w in range(1, ctx.resident.W):
        ctx.resident.if_window(e, w, lambda w=w: compute_phase3_resident_grads_mxfp8(
            ctx, e, out, lhs, rhs, m_total, n_total, wg_dtype, window=(w, partial, handoff)))


def compute_phase3_multi_block_grads_mxfp8(ctx, e, grads, wg_dtype):
    """Both weight gradients of an expert with two or more blocks (inside ExpertLoops.if_multi): the resident
    path when its blocks fit ctx.resident's R slots, else the streamed one (compute_phase3_expert_weight_grads_mxfp8).

    Dimensions:
        grads: [(out, lhs, rhs, M, N)]: dW_gu (d_gate_up, X) and dW_down (dY, hs) (the kernel's pass C).
    """

    def streamed():
        for out, lhs, rhs, m_total, n_total in grads:
            compute_phase3_expert_weight_grads_mxfp8(ctx, e, out, lhs, rhs, m_total, n_total, wg_dtype)

    if ctx.resident.R < 2:
        streamed()
        return

    def resident(slots):
        # a parts tier (slots > R): once per part of the N columns, each part's slots loaded from the blocks again
        parts = ctx.resident.tier_parts.get(slots, 1)
        for out, lhs, rhs, m_total, n_total in grads:
            if parts == 1:
                compute_phase3_resident_grads_mxfp8(ctx, e, out, lhs, rhs, m_total, n_total, wg_dtype, slots)
            carry = [None]  # the last stationary piece of one part, the first of the next (snake order)
            for p in range(parts if parts > 1 else 0):
                compute_phase3_resident_grads_mxfp8(ctx, e, out, lhs, rhs, m_total, n_total, wg_dtype, slots,
                                                    part=(p, parts), carry=carry)
            carry = None

    def windowed():
        for (out, lhs, rhs, m_total, n_total), partial in zip(grads, ctx.resident.partials):
            compute_phase3_windowed_grads_mxfp8(ctx, e, out, lhs, rhs, m_total, n_total, wg_dtype, partial)

    ctx.resident.if_fits(e, resident)
    ctx.resident.if_windowed(e, windowed)
    ctx.resident.if_over(e, streamed)


def store_zero_expert_grads(ctx, e, zeros):
    """Expert e has no blocks (runs inside ExpertLoops.if_unused): its weight gradients are +0 (the
    reference's empty sum), stored from the zeroed SBUF tile `zeros` [128, MOE_N_TILE] (this core's tiles)."""
    for out, m_total, n_total in ((ctx.d_gate_up_weight, 2 * ctx.I, ctx.H), (ctx.d_down_weight, ctx.H, ctx.I)):
        for (n0, nsz), m_blocks in _tile_groups(ctx, m_total, n_total):
            for m0, msz in m_blocks:
                nisa.dma_copy(dst=out[e, m0:m0 + msz, n0:n0 + nsz], src=zeros[:msz, :nsz])
