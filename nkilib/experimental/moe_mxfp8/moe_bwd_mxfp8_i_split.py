"""Pass A of the MoE expert backward kernel (moe_bwd_mxfp8_kernel.py) split along I (LNC2, W_down loaded on use).

Elsewhere pass A splits every block's rows between the two cores (docs/moe.md section 5), so both cores need all of
W_down[e] quantized along H; where W_down is loaded on use (the DeepSeek-V3 rank's [7168, 2048]) that took an exchange:
each core quantized half of it and both read all of it back from HBM scratch (moe_bwd_mxfp8_down_exchange.py). Here the
cores split I instead, for every expert: core c computes dI = dY_b W_down[e][:, I_c] (K=H) for all B rows of each of
the expert's blocks, I_c its contiguous share of the 512-column I tiles, with W_down's I_c columns loaded and quantized
on chip once per expert and resident across its blocks (each core half of W_down, read once: no exchange, no fence
between a quantize and its use). The epilogue of an I tile needs only that tile's columns (gate_pre, up, gate_act,
intermediate, dI) and the row's p, so each core writes d_gate_up's gate and up columns of I_c and hs's I_c columns for
every row: disjoint bytes. Round 9b split experts of one full block; round 14d every expert (docs/moe.md section 10).

The routing-weight gradient <dI, h> folds over all of I in tile order (docs/moe.md section 4: tile 0 overwrites, the
others add in fp32). Each core keeps its tiles' sums apart (RowChunk tile_sums) in ctx.d_w_tiles [N, B, I/512] fp32;
after the fence that precedes B(e), scatter() folds every row's tiles in order (the same fp32 adds as the reference)
and scatters d_topk_weights by slot, each core its rows (ctx.unit_rows).

The price: both cores read all B rows of dY and p, and gather the checkpoints' I_c columns of all B rows by slot
(software-DGE descriptors on GpSimd; with checkpoint_layout="block" one plain DMA per chunk instead, round 11b), and
no core holds a chunk's whole 2I, so pass B built its stationary d_gate_up panels from the bf16 rows (round 9b); where
I is whole 512-column tiles shared evenly, each core's pass A makes its own K tiles of them (SplitChunkPanels, round
25a) and pass B loads both cores'.
dY / X's block-ordered copies for pass C are written by one core per 128-row chunk (ctx.unit_rows: the rows the row
split gives it): in pass A for the first fence group's experts and for a block holding padding (gathered on both
cores), else a segment ahead by stage(), with p's, so that pass A reads every row of a full block back by plain DMA.
A block holding padding (an expert's last, if_full's complement, tested at run time on both cores) is never staged (an
HBM -> HBM gather skips padding rows, which pass C reads as zeros); its chunks after the first go one by one in 0/1-trip
loops on the flag of their first position, a chunk of padding only storing zero scratch rows instead (the row split
computed every row of such a block: W_down loaded per block there). A one-block expert's full block takes W_down's
I_c columns loaded and quantized a pass ahead (prefetch_down, round 14b: under exactly that branch's run-time
condition), so that its dI does not wait for them at A's start; padded and multi-block experts load their own.

Dimensions (per core, one block): dY_b [B, H] (K=H, stationary, chunks of 128 rows), W_down[e][:, I_c] [H, |I_c|]
(moving), checkpoints [B, |I_c|] bf16; outputs d_gu [B, 2I] columns I_c and I + I_c, hs [B, I] columns I_c,
d_w_tiles [B, tiles of I_c].
"""
from __future__ import annotations

import nki.isa as nisa
import nki.language as nl

from ...core.kernel_helpers import ceil_div, kernel_assert, shard_range
from ...core.matmul import Panel, PanelPlacement, k_tiles, load_panel
from ...core.matmul.constants import SCALE_PACK_SLOTS, STAGING_BUFFERS
from ...core.matmul.panels import LoadRing
from ...core.matmul.sources import blocks as _blocks
from .constants import PARTITIONS, D_W_POSITIONS_PER_PARTITION, SLOT_PIECE_COLUMNS
from .moe_bwd_mxfp8_d_gate_up import compute_phase1_chunks_mxfp8, zero_padding_rows
from .moe_bwd_mxfp8_dx import ExpertPanels
from .moe_bwd_mxfp8_split_panels import SplitChunkPanels

__all__ = ["ExpertISplit"]


class ExpertISplit(nl.NKIObject):
    """Pass A of every expert with I split between the cores, and its deferred d_topk_weights scatter.

    Dimensions: as the module docstring; i_tiles are pass A's [(n0, 512)] tiles of I, this core's [j_lo, j_hi).
    """

    def __init__(self, ctx, i_tiles, staged=()):
        self.ctx = ctx
        cores, shard = ctx.split.num_cores, ctx.split.shard_id
        self.j_lo, self.j_hi = shard_range(len(i_tiles), cores, shard)
        self.tiles = i_tiles[self.j_lo:self.j_hi]
        self.n_tiles = len(i_tiles)
        self.chunks = _blocks(0, ctx.B, PARTITIONS)
        kernel_assert(all(m == PARTITIONS for _, m in ctx.unit_rows),
                      f"the I split needs 128-row chunks per core, got {ctx.unit_rows}")
        self.staged = list(staged)  # experts whose dY / X rows are staged a fence ahead of their pass A (stage)
        if self.staged:  # block-ordered weights (round 30b) are their own staged copy
            ctx.p_blocks = ctx.weights_blocks if ctx.weights_blocked else nl.ndarray(
                (ctx.N, ctx.B, 1), dtype=nl.float32, buffer=nl.shared_hbm, name="moe_bwd_routing_weight_blocks")
        ctx.d_w_tiles = nl.ndarray((ctx.N, ctx.B, self.n_tiles), dtype=nl.float32, buffer=nl.shared_hbm,
                                   name="moe_bwd_routing_grad_tiles")
        ctx.split_panels = SplitChunkPanels.of(ctx, i_tiles)  # each core's K tiles of pass B's panels (round 25a)
        if ctx.split_panels != None and ctx.setup.scheme == "1x32" and ctx.I % SLOT_PIECE_COLUMNS == 0:  # noqa: E711
            # pass B reads no d_gate_up rows, pass C reads d_gate_up and hs one K tile per DMA (round 30a)
            ctx.interleaved = [ctx.d_gu, ctx.hs]

    @staticmethod
    def applies(ctx, w_down_resident, i_tiles) -> bool:
        """Under LNC2 with MXFP8 where W_down is loaded on use (not resident: the W_down exchange's case) and every
        core gets whole 128-row chunks of a block and at least one I tile (the DeepSeek-V3 rank at B = 512)."""
        cores = ctx.split.num_cores
        return (cores > 1 and ctx.setup.is_mx and not w_down_resident and len(i_tiles) >= cores
                and ctx.B % (PARTITIONS * cores) == 0)

    def if_full(self, i, body, complement=False):
        """body() when block i holds no padding (its last position holds a routed pair; complement: when it does),
        a 0/1-trip run-time loop with the same trip count on both cores."""
        self.ctx.if_flag(self.ctx.row_flags(i, self.ctx.B - 1, 2), 1, body, complement)

    def stage_expert(self, e):
        """stage() of a staged expert e's full blocks: all but its last, and the last one when it holds no padding."""
        if e not in self.staged:
            return
        b_lo, _, b_hi = self.ctx.loops.bounds(e)
        last = self.ctx.loops.last_block(e)
        nl.fori_loop(b_lo, last, self.stage)
        nl.fori_loop(last, b_hi, lambda i: self.if_full(i, lambda: self.stage(i)))

    def prefetch_down(self, e, desc):
        """W_down[e][:, I_c]'s resident panels (what ExpertPanels loads at A(e)'s start) loaded and quantized now, in
        a 0/1-trip loop of exactly the run-time conditions of expert()'s full branch (one block, if_single, whose last
        position holds a routed pair: if_full's flag, the one expert() tests once for both branches), into words and
        scales allocated here (outside that loop, so they outlive it) in groups of SCALE_PACK_SLOTS K tiles (16 KiB of
        words per 1024 columns: no one 56 KiB gap asked for, docs/moe.md section 10, round 6a). Issued a pass ahead of
        A(e), its DMAs and quantizes run while the previous pass's do, instead of at A(e)'s start with dI waiting for
        them (round 14b). Each K tile is quantize_mx's of the same staged rows: the same words and scales.

        Returns:
            the list of super-panels (Panel per ExpertPanels load) that expert(w_down=...) takes, filled when the loop
            body is traced (the simulator runs a 0/1-trip loop's body only when it trips, as expert()'s full branch's:
            the same flag, so the panels exist whenever that branch uses them).
        """
        setup = self.ctx.setup
        loads, _ = ExpertPanels.super_panels(desc, self.tiles, ExpertPanels.load_width(desc, setup))
        n = len(k_tiles(desc.k_size, setup))
        quads = [(t, min(n, t + SCALE_PACK_SLOTS)) for t in range(0, n, SCALE_PACK_SLOTS)]
        room = [[(nl.ndarray((PARTITIONS, hi - lo, w), dtype=setup.x4_dtype, buffer=nl.sbuf),
                  nl.ndarray((PARTITIONS, ceil_div(hi - lo, SCALE_PACK_SLOTS) if setup.use_scale_packing else hi - lo,
                              w), dtype=nl.uint8, buffer=nl.sbuf)) for lo, hi in quads] for _, w in loads]
        panels = []

        def load():
            ring = LoadRing(STAGING_BUFFERS)  # one ring across the quads: as one load_panel call of all K tiles
            for (f0, w), parts in zip(loads, room):
                data, scales = [], []
                for (lo, hi), (words, scale) in zip(quads, parts):
                    part = load_panel(desc, f0, w, w, setup, t_lo=lo, t_hi=hi, ring=ring,
                                      placement=PanelPlacement.into(words, scale))
                    data = data + part.data
                    scales = scales + part.scales
                panels.append(Panel(data, scales, w))

        self.ctx.loops.if_single(e, lambda i: self.if_full(i, load))
        return panels

    def with_rows(self, a, rows, run_a, w_gu_at_first_tile=False):
        """Pass B's rows read ahead (DGateUpRowsAhead `rows`) issued once on every run-time path of the segment step
        whose A is A(a) (None: no A): before A(a) where a is one full block (the branch that takes prefetch_down's
        W_down, under its condition: A(a)'s start loads no weights and its matmuls leave the DMA queues room), else
        in A(a)'s last epilogue, before its stores (run_a(then, first): expert(then=then, at_first_tile=first); a
        padded or multi-block A(a) loads its own W_down at its start, where the rows read before it cost the full
        rank's Zipf routing 1.2%: docs/moe.md section 10, round 20a), or now where a has no blocks or there is no A.
        W_gu's first K tiles staged ahead (rows.read(w_gu=True)) go with the rows except before A(a): there in A(a)'s
        last epilogue (expert's then(True)), where the DMA queues idle (read with the rows before A(a), they took the
        queues from A(a)'s dY reads: round 22a); with w_gu_at_first_tile (a step whose A(a) stages no later expert)
        at A(a)'s first I tile on every path that runs A(a) (`first`, else None), under its dI matmuls (round 36b).
        The branches' run-time conditions exclude one another and cover every routing, the same on both cores."""
        if a == None:  # noqa: E711
            rows.read()
            return
        self.ctx.loops.if_single(a, lambda i: self.if_full(i, lambda: rows.read(w_gu=False)))
        self.ctx.loops.if_unused(a, rows.read)
        if w_gu_at_first_tile:
            run_a(lambda rows_read_before: None if rows_read_before else rows.read(w_gu=False),
                  lambda: rows.read(rows=False))
            return
        run_a(lambda rows_read_before: rows.read(rows=not rows_read_before), None)

    def expert(self, e, descs, w_down=None, then=None, at_first_tile=None):
        """Pass A of expert e for this core's I tiles, every block: each row's dI, epilogue and stores. An expert of
        more blocks loads its panels once for all of them; the blocks before the last are full (every position a routed
        pair), the last one (a one-block expert's only one) runs as full or as padded by its final position's flag
        (the same on both cores).

        Args:
            descs: [W_down[e] (K=H, bf16 in HBM), W_gate[e] or None, W_up[e] or None] (TensorDescriptors over I).
            w_down: W_down[e]'s super-panels loaded a pass ahead (prefetch_down), taken by a one-block expert's full
                branch only (the prefetch's loop trips exactly when that branch does); None: loaded here.
            then: then(one_full_block), issued in the last block's epilogue, before its stores, in every branch:
                then(True) in a one-block expert's full one (with_rows read the rows before A(e) there), else
                then(False); None: nothing.
            at_first_tile: issued once on every run-time path of A(e): in a one-block expert's block after its
                chunks' reads, before its first I tile's matmuls (the first chunk's, for a padded block), in a
                multi-block expert's before its blocks' loops; None: nothing. The kernel's staging of a later
                expert's rows goes there (docs/moe.md section 10, round 34b).
        """
        ctx = self.ctx

        def panels(ahead=None):
            # this core's I_c columns of the weights stay resident across the expert's blocks (ExpertPanels.fits:
            # 56 KiB per partition of quantized W_down for DeepSeek-V3), so the chunks' 0/1 loops load no weights
            return [None if d == None else ExpertPanels(d, self.tiles, ctx.setup,  # noqa: E711
                                                        panels=ahead if k == 0 else None) for k, d in enumerate(descs)]

        def last_block(i, w=None, first=None):
            # one flag for both branches; a one-block expert loads its panels inside the flag's loop (round 14d: the
            # panels issued before the flags and a flag per branch cost the full rank's balanced routing 0.9%), its
            # full branch's W_down taken from prefetch_down where given (round 14b: loaded under this same flag)
            full = ctx.row_flags(i, ctx.B - 1, 2)  # positions 0 and B - 1
            # then(True) in a one-block expert's full branch (with_rows read the rows before A(e) there)
            before = None if then == None else lambda: then(not w)  # noqa: E711
            ctx.if_flag(full, 1, lambda: self.block(e, i, w or panels(w_down), True, then=before, first=first))
            after = None if then == None else lambda: then(False)  # noqa: E711
            ctx.if_flag(full, 1, lambda: self.block(e, i, w or panels(), False, then=after, first=first),
                        complement=True)

        def blocks():
            w = panels()  # once for all the expert's blocks
            if at_first_tile != None:  # noqa: E711  (once, outside the blocks' loops)
                at_first_tile()
            b_lo, _, b_hi = ctx.loops.bounds(e)
            last = ctx.loops.last_block(e)
            nl.fori_loop(b_lo, last, lambda i: self.block(e, i, w, True))
            nl.fori_loop(last, b_hi, lambda i: last_block(i, w))
        ctx.loops.if_single(e, lambda i: last_block(i, first=at_first_tile))
        ctx.loops.if_multi(e, blocks)

    def scatter_expert(self, e):
        """scatter() of every block of expert e (after the fence that follows its pass A)."""
        b_lo, _, b_hi = self.ctx.loops.bounds(e)
        nl.fori_loop(b_lo, b_hi, self.scatter)

    def block(self, e, i, w, full, then=None, first=None):
        """Block i (register) of expert e over this core's I tiles, with its weight panels w (ExpertPanels). A block
        holding padding (full False) computes its 128-row chunks one by one, each after the first (whose first position
        always holds a routed pair) in a 0/1-trip loop on the flag of its first position; a chunk of padding only
        stores zero scratch rows instead (both cores: the same flags, so identical trip counts). first: expert()'s
        at_first_tile, issued before the first I tile's matmuls (of the first chunk, for a padded block)."""
        ctx = self.ctx
        # each chunk gathers its rows as it is made (RowChunk), so one chunk's [128, H] rows are live at a time
        # the product dh * a on VectorE here: GpSimd generates every row's gather descriptors on both cores (round
        # 9b: ds4 1416.5 / 1981.8 -> 1407.9 / 1967.5 us)
        if full:
            compute_phase1_chunks_mxfp8(ctx, e, i, self.chunks, *w, True, None, tile_sums=True,
                                        staged=e in self.staged, d_up_engine=nisa.engine.vector, before_store=then,
                                        at_first_tile=first)
            return
        # a padded block: never staged (an HBM -> HBM gather skips padding rows, which pass C reads as zeros)
        flags = ctx.row_flags(i, PARTITIONS, len(self.chunks))
        for q, chunk in enumerate(self.chunks):
            def rows(chunk=chunk, q=q):
                compute_phase1_chunks_mxfp8(ctx, e, i, [chunk], *w, False, None, tile_sums=True,
                                            d_up_engine=nisa.engine.vector, at_first_tile=first if q == 0 else None)
            if q == 0:
                rows()
                continue
            ctx.if_flag(flags, q, rows)
            ctx.if_flag(flags, q, lambda chunk=chunk: self.zero_chunk(i, *chunk), complement=True)
        if then != None:  # noqa: E711
            then()

    def zero_chunk(self, i, r0, m):
        """Rows r0..r0+m of block i hold only padding: zeros for this core's columns of their d_gate_up and hs rows
        and their routing-weight tile sums, and for their dY / X copies where this core writes them (ctx.unit_rows),
        as the computed rows of a gathered padding chunk would be."""
        ctx = self.ctx
        i_lo, i_hi = self.tiles[0][0], self.tiles[-1][0] + self.tiles[-1][1]
        zero_padding_rows(ctx, i, r0, m, i_lo, i_hi, copies=r0 in [r for r, _ in ctx.unit_rows])
        sums = nl.ndarray((m, self.j_hi - self.j_lo), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=sums, value=0.0)
        nisa.dma_copy(dst=ctx.block_rows(ctx.d_w_tiles, i, r0, m, 1, self.j_lo, self.j_hi - self.j_lo), src=sums)
        if ctx.split_panels != None:  # noqa: E711
            ctx.split_panels.zero(i, r0)

    def stage(self, i):
        """Block i's dY and X rows, this core's chunks (ctx.unit_rows), to dy_blocks / x_blocks (pass C's copies), and
        their routing weights p by slot to p_blocks, by one HBM -> HBM indirect DMA each, so that pass A reads all rows
        back by plain DMA instead of gathering them on both cores (the checkpoints are not staged: their scratch round
        trip cost more DMA time than their descriptors cost GpSimd, docs/moe.md round 9b; pass A gathers them, or
        reads them by plain DMA in the block layout, round 11b; block-ordered weights need no copy, round 30b). Only
        for a full block (a skipped sentinel would leave a scratch row unwritten); must precede a fence before the
        block's pass A, which reads both cores' rows."""
        ctx = self.ctx
        for r0, m in ctx.unit_rows:
            ids = ctx.positions(ctx.ids2d, i, r0, 1, m)
            ctx.gather_to_blocks(ctx.dy_blocks, i, r0, m, ctx.dy, ids)
            ctx.gather_to_blocks(ctx.x_blocks, i, r0, m, ctx.x, ids)
            if not ctx.weights_blocked:
                slots = ctx.positions(ctx.slots2d, i, r0, 1, m)
                ctx.gather_to_blocks(ctx.p_blocks, i, r0, m, ctx.weights, slots)

    def scatter(self, i):
        """d_topk_weights of block i's slots (this core's chunks): fold of the I tiles' sums both cores wrote (tile 0,
        then + tile 1, ... in fp32: the reference's order), scattered by slot (padding slots skipped), or stored by
        block position (weights_layout "block"). Must follow the fence after the block's pass A.

        With weights_layout "block" partition p folds the chunk's positions r0 + 4p .. r0 + 4p + 3
        (D_W_POSITIONS_PER_PARTITION): the sums load as one 4 x n_tiles x 4-byte run per partition and d_topk_weights
        stores as one 16-byte run, a quarter of the descriptors of a position per partition (docs/moe.md section 10,
        round 32c); the same fp32 adds per position in the same order."""
        ctx = self.ctx
        for r0, m in ctx.unit_rows:
            per = D_W_POSITIONS_PER_PARTITION if ctx.weights_blocked and m % D_W_POSITIONS_PER_PARTITION == 0 else 1
            rows, n = m // per, self.n_tiles
            slots = None if ctx.weights_blocked else ctx.positions(ctx.slots2d, i, r0, 1, m)
            sums = nl.ndarray((rows, per, n), dtype=nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(dst=sums, src=ctx.d_w_tiles.ap([[per * n, rows], [n, per], [1, n]], offset=r0 * n,
                                                         scalar_offset=i, indirect_dim=0))
            d_w = nl.ndarray((rows, per, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_copy(dst=d_w, src=sums[:, :, 0:1])
            for j in range(1, n):
                nisa.tensor_tensor(dst=d_w, data1=d_w, data2=sums[:, :, j:j + 1], op=nl.add)
            if per == 1:
                ctx.store_pair_grads(d_w[:, 0, :], i, r0, m, slots)
            else:
                nisa.dma_copy(dst=ctx.d_weights.ap([[per, rows], [1, per], [1, 1]], offset=r0, scalar_offset=i,
                                                   indirect_dim=0), src=d_w)
