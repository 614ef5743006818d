"""Pass A of the MoE expert backward kernel (moe_bwd_mxfp8_kernel.py), per block: phase 0 (the recompute of
gate_pre / up when not given) and phase 1, dI = dY_b W_down[e] (K=H) with the SwiGLU derivative and the
routing-weight gradient <dI, h> fused in the epilogue; d_gate_up and hs rows (and the gathered dY / X rows)
go to block-ordered HBM scratch, d_topk_weights is scattered by slot (weights_layout "block": stored by position).
Numerics: docs/moe.md, section 4.
With gate_pre and up given (no recompute) X serves only pass C: in the pipeline its rows are gathered in a loop at
the end of the segment before the expert's (moe_bwd_mxfp8_deferred.gather_deferred_x), by one HBM -> HBM indirect
DMA per chunk (MoeContext.gather_to_blocks; round 8c; a chunk with padding after a store of zeros: round 38c), not
through SBUF. The pipeline's dY rows of the experts after the second fence group are copied so to dy_blocks a fence
ahead (moe_bwd_mxfp8_deferred.gather_deferred_rows, ctx.staged_dy; round 31a) and read back.

Rows (LNC2: each core its share of every block's rows) go in one of two ways:
    weights loaded per block: this core's contiguous rows in groups of PHASE1_ROW_GROUP (chunks of 128), the
        I tiles outside them, so a weight tile loads once per group;
    resident weights in an expert's last block (the only one that can hold padding): 128-row units per core,
        each run only when its first position holds a routed pair (MoeContext.row_flags, the same on both
        cores), a skipped unit's scratch rows stored as zeros (passes B and C read a block's padding rows).
The weights' I tiles may be a resident group of them (a multi-block expert, moe_bwd_mxfp8_dx.resident_tile_groups):
the first group gathers dY / X, later ones read the block-ordered copies back, and the routing-gradient fold
continues across groups through fp32 scratch (docs/moe.md, section 10, round 3).
With resident weights in one group and an even number of 128-row chunks per core, an expert's chunks run as one
pipeline (compute_phase1_pipelined_mxfp8, round 7c): each chunk's gathers are issued before the previous chunk's
epilogue, so GpSimd's software-DGE descriptors no longer queue behind that epilogue's products.
With all of I in one group, a chunk's d_gate_up rows are also quantized along 2I into pass B's stationary panel
and stored as words and scales when the kernel asks for them (ctx.d_gu_mx; round 7a): pass A holds the rows on chip
while TensorE idles, and each core makes only its own rows' panels (pass B used to transpose every row on both cores).
"""
from __future__ import annotations

import nki.isa as nisa
import nki.language as nl

from ...core.kernel_helpers import kernel_assert
from ...core.matmul import RowPanelByColumns, matmul_panels, panel_from_rows, store_panel_tiles
from ...core.matmul.sources import blocks as _blocks
from ...core.swiglu import intermediate_tile, swiglu_backward_tile, swiglu_forward_terms
from .constants import PARTITIONS, PHASE1_N_TILE, PHASE1_ROW_GROUP, PIPELINE_CHECKPOINT_COLUMNS
from .moe_bwd_mxfp8_single_block import padding_rows_read_by_c

__all__ = ["ChunkInputs", "RowChunk", "compute_phase1_block_grads_mxfp8", "compute_phase1_chunks_mxfp8",
           "compute_phase1_pipelined_mxfp8", "gather_first_chunk_ahead", "natural_rows", "zero_padding_rows"]


def natural_rows(ctx, k_size):
    """SBUF [128, Kp] bf16 tile for rows of K = k_size (Kp: K padded to the MX K alignment)."""
    return nl.ndarray((PARTITIONS, ctx.k_width(k_size)), dtype=nl.bfloat16, buffer=nl.sbuf)


def _block_natural(ctx, scratch, i, r0, m, k_size):
    """SBUF [128, Kp] bf16 tile: rows r0..r0+m of block i of a block-ordered [N, B, K] scratch (already gathered)."""
    nat = natural_rows(ctx, k_size)
    if nat.shape[1] > k_size:
        nisa.memset(dst=nat[:m, k_size:], value=0.0)
    nisa.dma_copy(dst=nat[:m, :k_size], src=ctx.block_rows(scratch, i, r0, m, 1, 0, k_size))
    return nat


def _checkpoint_tile(ctx, ckpt, i, r0, m, slots, i_lo, width, full=False):
    """SBUF [128, width] bf16 columns [i_lo, i_lo + width) of a checkpoint's rows r0..r0+m of block i (zero for
    padding), or None: MoeContext.checkpoint_rows (a gather by slot, or one plain DMA in the block layout)."""
    if ckpt == None:  # noqa: E711
        return None
    tile = nl.ndarray((PARTITIONS, width), dtype=nl.bfloat16, buffer=nl.sbuf)
    ctx.checkpoint_rows(tile[:m, :], ckpt, i, r0, m, slots, i_lo, width, full)
    return tile


def _projection_tile(ckpt_tile, psum, m, c0, nsz):
    """bf16 [m, nsz] view: the gathered checkpoint's columns from c0, or bf16(psum) of the recompute (RNE)."""
    if ckpt_tile != None:  # noqa: E711
        return ckpt_tile[:m, c0:c0 + nsz]
    tile = nl.ndarray((PARTITIONS, PHASE1_N_TILE), dtype=nl.bfloat16, buffer=nl.sbuf)
    nisa.tensor_copy(dst=tile[:m, :nsz], src=psum[:m, :nsz])
    return tile[:m, :nsz]


class ChunkInputs(nl.NKIObject):
    """SBUF tiles of what pass A gathers for m <= 128 rows of a block with all of I in one group: token ids and slots,
    dY and X rows, p and the given checkpoints (zero rows for padding unless the block is full).

    Dimensions: ids, slots [m, 1] int32; dy_nat, x_nat [128, Hp] bf16; p [m, 1] fp32; checkpoints [128, I] bf16.
    RowChunk allocates and fills one per chunk; compute_phase1_pipelined_mxfp8 allocates two per expert and fills one
    a chunk ahead of the chunk being computed (the tiles are reused across its run-time loop's iterations).
    """

    def __init__(self, ctx, m, width, values=True, own=True, gather_x=True, dy_staged=False):
        """values=False: ids, slots and rows only (RowChunk gathers p and the checkpoints itself, after the panels).
        own=False: another core writes these rows' block-ordered dY / X copies (the I split). gather_x=False: no X rows
        (the I split where neither this core's copy nor a recompute needs them). dy_staged: the rows' dY was copied to
        dy_blocks a fence earlier (gather_deferred_rows, ctx.staged_dy): read from there by plain DMA, not gathered,
        and not stored again."""
        self.m = m
        self.dy_staged = dy_staged
        self.ids = nl.ndarray((m, 1), dtype=nl.int32, buffer=nl.sbuf)
        # slots: read by the gathers / scatters by slot only, so none when p, d_p and the checkpoints are block-ordered
        self.slots = (None if ctx.checkpoints_blocked and ctx.weights_blocked else
                      nl.ndarray((m, 1), dtype=nl.int32, buffer=nl.sbuf))
        self.dy_nat = natural_rows(ctx, ctx.H)
        self.x_nat = None if ctx.defer_x or not gather_x else natural_rows(ctx, ctx.H)  # (defer_x: no recompute)
        self.own = own
        self.p, self.ckpts = None, None
        if values:
            self.p = nl.ndarray((m, 1), dtype=nl.float32, buffer=nl.sbuf)
            given = (ctx.gate_pre, ctx.gate_act, ctx.up, ctx.intermediate)
            self.ckpts = [None if c == None else nl.ndarray((PARTITIONS, width), dtype=nl.bfloat16,  # noqa: E711
                                                            buffer=nl.sbuf) for c in given]

    def gather(self, ctx, i, r0, full, ahead=0, pieces=False):
        """Fill the tiles with rows r0..r0+m of block i + ahead (ahead: a static block offset on the register i).
        pieces: the checkpoints by column pieces (gather_pair_values), for tiles that an earlier chunk read."""
        self.gather_rows(ctx, i, r0, full, ahead)
        self.gather_pair_values(ctx, i, ahead * ctx.B + r0, full, pieces)

    def gather_rows(self, ctx, i, r0, full, ahead=0):
        """The token ids, slots and the dY / X rows (gather's first part)."""
        m, H, first = self.m, ctx.H, ahead * ctx.B + r0
        ctx.positions(ctx.ids2d, i, first, 1, m, dst=self.ids)
        if self.slots != None:  # noqa: E711
            ctx.positions(ctx.slots2d, i, first, 1, m, dst=self.slots)
        if self.dy_staged:  # copied by token id a fence earlier (gather_deferred_rows): padding zero where computed
            if self.dy_nat.shape[1] > H:
                nisa.memset(dst=self.dy_nat[:m, H:], value=0.0)
            nisa.dma_copy(dst=self.dy_nat[:m, :H], src=ctx.block_rows(ctx.dy_blocks, i, first, m, 1, 0, H))
        gathered = (() if self.dy_staged else ((self.dy_nat, ctx.dy),)) + \
            (() if self.x_nat == None else ((self.x_nat, ctx.x),))  # noqa: E711
        for nat, src in gathered:
            if not full:
                nisa.memset(dst=nat[:m, :], value=0.0, engine=ctx.padding_zero_engine)
            elif nat.shape[1] > H:
                nisa.memset(dst=nat[:m, H:], value=0.0)
            ctx.gather(nat[:m, :H], src, self.ids, 0, H)

    def gather_pair_values(self, ctx, i, first, full, pieces=False):
        """p and the given checkpoints' rows at positions first..first+m of block i (gather's second part); pieces:
        block-ordered checkpoints by PIPELINE_CHECKPOINT_COLUMNS-wide DMAs (each waits only for the previous reader of
        its own columns), else one DMA each."""
        m = self.m
        ctx.pair_weights(self.p, i, first, m, self.slots, full)
        given = [(t, c) for t, c in zip(self.ckpts, (ctx.gate_pre, ctx.gate_act, ctx.up, ctx.intermediate))
                 if t != None]  # noqa: E711
        if not given:
            return
        for f0, fsz in self._pieces(ctx, given[0][0].shape[1], pieces):  # piece-major: the first I tile's columns first
            for tile, src in given:
                ctx.checkpoint_rows(tile[:m, f0:f0 + fsz], src, i, first, m, self.slots, f0, fsz, full)

    @staticmethod
    def _pieces(ctx, width, pieces):
        """The column pieces [(f0, size)] of a checkpoint's rows loaded by one DMA each (gather_pair_values)."""
        if not pieces or not ctx.checkpoints_blocked or PIPELINE_CHECKPOINT_COLUMNS == 0:
            return [(0, width)]
        return _blocks(0, width, PIPELINE_CHECKPOINT_COLUMNS)


def chunk_outputs(ctx, width):
    """SBUF tiles of a chunk's epilogue outputs for `width` columns of I: (d_gate_up [128, k_width(2 width)], hs
    [128, width]) bf16."""
    return (nl.ndarray((PARTITIONS, ctx.k_width(2 * width)), dtype=nl.bfloat16, buffer=nl.sbuf),
            nl.ndarray((PARTITIONS, width), dtype=nl.bfloat16, buffer=nl.sbuf))


class RowChunk(nl.NKIObject):
    """The on-chip state of m <= 128 rows (positions r0..r0+m) of block i in pass A, for the I columns
    [i_lo, i_hi) (all of I, or one resident weight group of a multi-block expert): gathered inputs, their
    K=H panels, and the epilogue's outputs until they are stored.

    The group at i_lo = 0 gathers dY / X by token id and writes the block-ordered copies; later groups read
    those copies back (plain DMA, this core's own rows). The routing-weight gradient's fold over I tiles
    continues across groups through ctx.d_w_partial (fp32, exact), so its order is the reference's.
    tile_sums (the I split of one-block experts, moe_bwd_mxfp8_i_split.py): the rows' routing-weight gradient is
    kept per I tile (one fp32 sum per tile, not folded) and stored to ctx.d_w_tiles, whose reader folds every tile
    in order after the fence. staged (with tile_sums, a full block whose dY / X rows and p were copied to dy_blocks /
    x_blocks / p_blocks a fence earlier: ExpertISplit.stage): they are read from there by plain DMA, not
    gathered. d_up_engine: the epilogue's engine for the product dh * a (None: ctx.d_up_engine, the kernel's choice).
    outputs: chunk_outputs(ctx, i_hi - i_lo) tiles to write d_gate_up and hs into (None: allocated here).
    """

    def __init__(self, ctx, i, r0, m, recompute, i_lo, i_hi, full=False, inputs=None, tile_sums=False,
                 staged=False, d_up_engine=None, outputs=None):
        H = ctx.H
        self.r0, self.m, self.f_pad = r0, m, ctx.f_pad(m)
        self.i_lo, self.i_hi, width = i_lo, i_hi, i_hi - i_lo
        if inputs == None and (i_lo == 0 or tile_sums) and not staged:  # noqa: E711
            # rows only: p and the checkpoints are gathered after the panels below, as before round 7c (every
            # gather first: DeepSeek-V3 4 x 512 1515.2 us instead of 1497.2). The I split: every core gathers every
            # row of dY, and X where it writes the copy (one core per chunk) or recomputes
            own = not tile_sums or r0 in [r for r, _ in ctx.unit_rows]
            inputs = ChunkInputs(ctx, m, width, values=False, own=own, gather_x=own or recompute)
            inputs.gather_rows(ctx, i, r0, full)
        x_nat = None
        if inputs != None:  # noqa: E711  (gathered here or, in the pipeline, one chunk ahead)
            self.ids, self.slots = inputs.ids, inputs.slots
            dy_nat, x_nat = inputs.dy_nat, inputs.x_nat
            # block-ordered copies for pass C (its K = tokens operands then load by plain DMA, no second gather);
            # padding rows are the zeroed rows of the gathered tiles
            if inputs.own and not inputs.dy_staged:
                nisa.dma_copy(dst=ctx.block_rows(ctx.dy_blocks, i, r0, m, 1, 0, H), src=dy_nat[:m, :H])
            if x_nat != None and inputs.own:  # noqa: E711  (else deferred: gather_deferred_x)
                nisa.dma_copy(dst=ctx.block_rows(ctx.x_blocks, i, r0, m, 1, 0, H), src=x_nat[:m, :H])
        else:
            # rows read back by plain DMA: no token ids (nothing here reads them), and slots only where a reader
            # follows (p's and the slot-layout checkpoints' gathers, the fold's scatter); the I split's staged rows
            # with block-ordered checkpoints have none (its scatter loads its own after the fence), nor rows with
            # block-ordered p and d_p too. Each [m, 1] int32 load: one 4-byte descriptor per row (round 27a)
            self.ids = None
            needs_slots = not ctx.checkpoints_blocked or not (tile_sums or ctx.weights_blocked)
            self.slots = ctx.positions(ctx.slots2d, i, r0, 1, m) if needs_slots else None
            dy_nat = _block_natural(ctx, ctx.dy_blocks, i, r0, m, H)
            if recompute:
                x_nat = _block_natural(ctx, ctx.x_blocks, i, r0, m, H)
        self.dy_panel = panel_from_rows(dy_nat[:m, :], m, H, self.f_pad, ctx.setup)
        self.x_panel = panel_from_rows(x_nat[:m, :], m, H, self.f_pad, ctx.setup) if recompute else None
        # the I split with block-ordered checkpoints: their plain DMAs (ready at once) wait for the first epilogue,
        # after the first dI matmul, so that they do not take the DMA queues from W_down's loads and the dY rows that
        # matmul waits for (slot layout: the gathers' descriptors on GpSimd already held them back; deferred there
        # they queue behind the epilogue's products: ds4 1406.4 -> 1497.0 us; the row split's padded blocks lose
        # too: ds4z 1704.4 -> 1720.5 us, docs/moe.md round 11b)
        defer_checkpoints = ctx.checkpoints_blocked and tile_sums
        self.p_deferred = False  # p read at the first epilogue (below)
        if inputs != None and inputs.p != None:  # noqa: E711  (the pipeline gathered them a chunk ahead)
            self.p, self.ckpts = inputs.p, inputs.ckpts
        elif staged:
            self.p = nl.ndarray((m, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(dst=self.p, src=ctx.block_rows(ctx.p_blocks, i, r0, m, 1, 0, 1))
            self.ckpts = None if defer_checkpoints else self._checkpoints(ctx, i, full)
        else:
            self.p = nl.ndarray((m, 1), dtype=nl.float32, buffer=nl.sbuf)
            # block-ordered p waits with them (dsz 4838.5 -> 4802.0 us central, docs/moe.md round 30b)
            self.p_deferred = defer_checkpoints and ctx.weights_blocked
            if not self.p_deferred:
                ctx.pair_weights(self.p, i, r0, m, self.slots, full)
            self.ckpts = None if defer_checkpoints else self._checkpoints(ctx, i, full)
        self.block, self.full = i, full
        # gate cols, up cols; with pass B's panels made here (ctx.d_gu_mx), zero up to the MX K padding of 2I
        self.d_gu, self.hs = outputs if outputs != None else chunk_outputs(ctx, width)  # noqa: E711
        if self.d_gu.shape[1] > 2 * width:
            nisa.memset(dst=self.d_gu[:m, 2 * width:], value=0.0)
        self.d_gu_panel = None
        whole_panel = width == ctx.I and ctx.d_gu_mx != None  # noqa: E711  pass B's stationary panel (K=2I, M=m)
        # the I split (SplitChunkPanels): this core's K tiles of that panel, its gate and up columns
        self.split_panel = tile_sums and ctx.split_panels != None  # noqa: E711
        if whole_panel:
            kernel_assert(r0 % PARTITIONS == 0 and m == PARTITIONS,
                          f"pass B's d_gate_up panels need 128-row chunks from a multiple of 128, got r0={r0}, m={m}")
        if whole_panel or self.split_panel:
            self.d_gu_panel = RowPanelByColumns(self.d_gu[:m, :], m, 2 * width, self.f_pad, ctx.setup)
        self.tile_sums = tile_sums
        self.stored_to = 0  # columns (local to [i_lo, i_hi)) whose d_gate_up and hs are stored (store_done)
        self.gate_masked = None  # this chunk's last gate mask product not yet issued (issue_gate_mask)
        # engine of the epilogue's product dh * a: the kernel's choice (MoeContext.d_up_engine) unless the caller's
        self.d_up_engine = ctx.d_up_engine if d_up_engine == None else d_up_engine  # noqa: E711
        self.d_w = nl.ndarray((m, len(_blocks(i_lo, i_hi, PHASE1_N_TILE)) if tile_sums else 1), dtype=nl.float32,
                              buffer=nl.sbuf)
        if i_lo > 0 and not tile_sums:  # the fold so far (tiles below i_lo), from this core's earlier group
            nisa.dma_copy(dst=self.d_w, src=ctx.block_rows(ctx.d_w_partial, i, r0, m, 1, 0, 1))

    def _checkpoints(self, ctx, i, full):
        """The given checkpoints' tiles [128, width] of the rows (None for each one not given)."""
        return [_checkpoint_tile(ctx, c, i, self.r0, self.m, self.slots, self.i_lo, self.i_hi - self.i_lo, full)
                for c in (ctx.gate_pre, ctx.gate_act, ctx.up, ctx.intermediate)]

    def epilogue(self, ctx, j, n0, nsz, d_i, g_psum, u_psum):
        """I tile j ([n0, n0+nsz), global) of the rows: SwiGLU terms, routing-weight gradient, dh, d_gate_up, hs."""
        m, c0, width = self.m, n0 - self.i_lo, self.i_hi - self.i_lo
        if self.p_deferred:
            ctx.pair_weights(self.p, self.block, self.r0, m, None, self.full)
            self.p_deferred = False
        if self.ckpts == None:  # noqa: E711
            self.ckpts = self._checkpoints(ctx, self.block, self.full)
        g_ck, a_ck, u_ck, h_ck = self.ckpts
        gate_pre = _projection_tile(g_ck, g_psum, m, c0, nsz)
        up = _projection_tile(u_ck, u_psum, m, c0, nsz)
        act = a_ck[:m, c0:c0 + nsz] if a_ck != None else None  # noqa: E711
        terms = swiglu_forward_terms(gate_pre, up, act, ctx.clamp, m, nsz, PHASE1_N_TILE,
                                     clamp_engine=ctx.clamp_engine, up_mask_engine=ctx.up_mask_engine,
                                     gate_mask_in_product=ctx.gate_mask_in_product, narrow=ctx.narrow_clamps)
        h = h_ck[:m, c0:c0 + nsz] if h_ck != None else intermediate_tile(terms)  # noqa: E711
        if self.tile_sums:  # this tile's sum alone (folded with the other core's tiles after the fence)
            c = c0 // PHASE1_N_TILE
            _routing_grad_tile(d_i[:m, :nsz], h, self.d_w[:, c:c + 1], 0, m, nsz)
        else:
            _routing_grad_tile(d_i[:m, :nsz], h, self.d_w, j, m, nsz)
        # dh = dI * p (fp32), then the dense SwiGLU derivative on dh
        dh = nl.ndarray((PARTITIONS, PHASE1_N_TILE), dtype=nl.float32, buffer=nl.sbuf)
        # dh and hs on ScalarE (fp32 multiplies, the same bits on any engine): VectorE bounds the epilogue
        nisa.tensor_scalar(dst=dh[:m, :nsz], data=d_i[:m, :nsz], op0=nl.multiply, operand0=self.p,
                           engine=nisa.engine.scalar)
        masked = swiglu_backward_tile(dh[:m, :nsz], terms, self.d_gu[:m, c0:c0 + nsz],
                                      self.d_gu[:m, width + c0:width + c0 + nsz],
                                      d_i_engine=ctx.d_gate_engine,  # dh is in SBUF: off VectorE unless clamped
                                      d_up_engine=self.d_up_engine, gate_mask_later=True)
        # the gate's mask product (a VectorE scalar_tensor_tensor, ctx.gate_mask_in_product) of the previous I tile:
        # issued here, a tile late, since it waits for GpSimd's product of that tile and VectorE runs in program
        # order (issued at once, VectorE waits: gpt4 2751.2 us; docs/moe.md section 10, round 19a)
        self.issue_gate_mask()
        self.gate_masked = masked
        # hs = bf16(f32(h) * p): dW_down's operand (the routing weight applied on the intermediate)
        nisa.tensor_scalar(dst=self.hs[:m, c0:c0 + nsz], data=h, op0=nl.multiply, operand0=self.p,
                           engine=nisa.engine.scalar)
        if self.d_gu_panel != None:  # noqa: E711  this tile's d_gate and d_up columns (the panel is built at the store)
            self.d_gu_panel.written([(c0, c0 + nsz), (width + c0, width + c0 + nsz)])

    def issue_gate_mask(self):
        """The last I tile's gate mask product, if one waits (swiglu_backward_tile's MaskedProduct)."""
        if self.gate_masked != None:  # noqa: E711
            self.gate_masked.issue()
            self.gate_masked = None

    def store_done(self, ctx, i, n_hi):
        """The I split (tile_sums, unclamped): the rows' d_gate, d_up and hs columns of the I tiles done so far (up to
        n_hi, global) that are not stored yet, stored now instead of all at store(). Each core's epilogue DMAs nothing
        through its I tiles (its dY rows and checkpoints are read before), so its stores went out together after the
        last tile and the DMA queues idled meanwhile (docs/moe.md section 10, round 22a). The same bytes, written once
        (store() writes the rest). Not with the gate mask in its product: that product writes a tile's d_gate columns
        a tile late (issue_gate_mask)."""
        if self.tile_sums and not ctx.gate_mask_in_product and self.i_hi - self.i_lo < ctx.I:
            self.store_columns(ctx, i, self.stored_to, n_hi - self.i_lo)

    def store_columns(self, ctx, i, c_lo, c_hi):
        """Columns [c_lo, c_hi) (local to [i_lo, i_hi)) of the rows' d_gate and d_up, and of hs unless they are all of
        them (store() then stores hs whole), to the scratch."""
        I, m, r0, lo, width = ctx.I, self.m, self.r0, self.i_lo, self.i_hi - self.i_lo
        n = c_hi - c_lo
        nisa.dma_copy(dst=ctx.block_rows(ctx.d_gu, i, r0, m, 1, lo + c_lo, n), src=self.d_gu[:m, c_lo:c_hi])
        nisa.dma_copy(dst=ctx.block_rows(ctx.d_gu, i, r0, m, 1, I + lo + c_lo, n),
                      src=self.d_gu[:m, width + c_lo:width + c_hi])
        if c_lo > 0 or c_hi < width:
            nisa.dma_copy(dst=ctx.block_rows(ctx.hs, i, r0, m, 1, lo + c_lo, n), src=self.hs[:m, c_lo:c_hi])
            self.stored_to = c_hi

    def store(self, ctx, i):
        I, m, r0, lo, width = ctx.I, self.m, self.r0, self.i_lo, self.i_hi - self.i_lo
        self.issue_gate_mask()  # before the d_gate columns are stored and transposed into pass B's panel
        if width == I:
            nisa.dma_copy(dst=ctx.block_rows(ctx.d_gu, i, r0, m, 1, 0, 2 * I), src=self.d_gu[:m, :2 * I])
            if self.d_gu_panel != None:  # noqa: E711  the K tiles the last I tile completed after the others
                self.d_gu_panel.build_ready()
                panel = self.d_gu_panel.panel()
                words, scales = ctx.d_gu_mx
                store_panel_tiles(panel, ctx.block_tiles(words, i, r0, len(panel.data)),
                                  ctx.block_tiles(scales, i, r0, panel.scale_tile.shape[1]))
                panel = None
        elif self.stored_to < width:
            self.store_columns(ctx, i, self.stored_to, width)
        if self.split_panel:  # the I split's K tiles of pass B's panel
            self.d_gu_panel.build_ready()
            ctx.split_panels.store(self.d_gu_panel.panel(), i, r0)
        if self.stored_to < width:
            nisa.dma_copy(dst=ctx.block_rows(ctx.hs, i, r0, m, 1, lo, width), src=self.hs[:m, :])
        if self.tile_sums:  # this core's tiles' sums: columns [lo / 512, ...) of the rows in ctx.d_w_tiles
            cols = self.d_w.shape[1]
            nisa.dma_copy(dst=ctx.block_rows(ctx.d_w_tiles, i, r0, m, 1, lo // PHASE1_N_TILE, cols), src=self.d_w)
            return
        if self.i_hi < I or ctx.defer_d_w:  # more groups follow (or scattered later): keep the fold
            nisa.dma_copy(dst=ctx.block_rows(ctx.d_w_partial, i, r0, m, 1, 0, 1), src=self.d_w)
            return
        ctx.store_pair_grads(self.d_w, i, r0, m, self.slots)


def compute_phase1_block_grads_mxfp8(ctx, e, i, w_down, w_gate, w_up, skip_padding=False, full=False):
    """Phases 0-1 of block i (expert e) for this core's rows and the I tiles of w_down: d_gate_up and hs
    columns to the scratch, d_topk_weights of the block's slots (after the last I tile).

    Dimensions (per chunk of m <= 128 rows of the block):
        dY_b [m, H] gathered (K=H stationary), W_down[e] [H, I] (moving, ExpertPanels over I tiles);
        recompute: X_b [m, H], W_gate[e] / W_up[e] [I, H] (K=H); epilogue per [m, PHASE1_N_TILE] tile;
        outputs: d_gu rows [m, 2I] and hs rows [m, I] (scratch, block i; the tiles' columns), d_w [m] (by slot).
    Weights loaded per block (skip_padding False): this core's contiguous rows (ctx.row_lo, ctx.row_hi) go in
    groups of up to PHASE1_ROW_GROUP (chunks of 128) with the I tiles outside them, so a weight tile loads
    once per group. Resident weights (skip_padding True): the rows go by 128-row units per core
    (ctx.unit_rows), and a unit past the block's last routed pair is skipped by a 0/1-trip loop. Per row
    the epilogue still runs tile 0, 1, ... (the routing-gradient fold order of the reference); which core
    computes a row does not change its bits.

    Args:
        ctx: MoeContext. e: expert (static). i: block register. w_down / w_gate / w_up: ExpertPanels over the
            same I tiles (all of I, or a resident group; w_gate / w_up None when gate_pre / up are given).
        skip_padding: whether the panels are resident (on both cores: the same loops).
        full: block i is known to hold no padding (a block before the expert's last, or a last block whose final
            position holds a routed pair): the gathered tiles are not zeroed first (every row is gathered).
    """
    if not skip_padding:
        for g0, gsz in _blocks(ctx.row_lo, ctx.row_hi, PHASE1_ROW_GROUP):
            _phase1_rows(ctx, e, i, _blocks(g0, g0 + gsz, PARTITIONS), w_down, w_gate, w_up, full)
        return
    # resident weights: this core's rows of each row unit (ctx.unit_rows) run only when the unit holds a routed
    # pair (the flag is the unit's first position, the same on both cores: identical trip counts)
    # pair; a skipped unit's scratch rows are stored as zeros (passes B and C read a block's padding rows)
    i_lo, i_hi = w_down.tiles[0][0], w_down.tiles[-1][0] + w_down.tiles[-1][1]
    flags = ctx.row_flags(i, ctx.row_unit, len(ctx.unit_rows)) if len(ctx.unit_rows) > 1 else None
    for u, (r0, m) in enumerate(ctx.unit_rows):
        body = (lambda r0=r0, m=m: _phase1_rows(ctx, e, i, [(r0, m)], w_down, w_gate, w_up))
        if u == 0:
            body()
            continue
        ctx.if_flag(flags, u, body)
        ctx.if_flag(flags, u, lambda r0=r0, m=m: zero_padding_rows(ctx, i, r0, m, i_lo, i_hi), complement=True)


def compute_phase1_chunks_mxfp8(ctx, e, i, rows, w_down, w_gate, w_up, full, inputs, tile_sums=False, staged=False,
                                d_up_engine=None, before_store=None, at_first_tile=None):
    """Phases 0-1 of the chunks `rows` [(r0, m <= 128)] of block i (expert e) over the I tiles of w_down, all chunks
    on chip together with the I tiles outside them (each weight tile loaded once for all), from ChunkInputs already
    gathered (`inputs`, one per chunk). Dimensions as compute_phase1_block_grads_mxfp8. tile_sums, staged,
    d_up_engine: RowChunk's; before_store, at_first_tile: _phase1_rows's.
    """
    _phase1_rows(ctx, e, i, rows, w_down, w_gate, w_up, full, inputs, before_store=before_store, tile_sums=tile_sums,
                 staged=staged, d_up_engine=d_up_engine, at_first_tile=at_first_tile)


def gather_first_chunk_ahead(ctx, e):
    """Gather expert e's first 128-row chunk of pass A now, a fence before A(e), for its pipeline to start from.

    Issued beside first_a_panels' W_down: the gathers read only kernel inputs (routing, dY, p, the given
    checkpoints), so after the barrier the pipeline's first chunk no longer waits for them (the barrier holds every
    later instruction of the core: gathered after it, they sat between the barrier and A(e)'s first matmul;
    docs/moe.md section 10, round 26b). Gathered only for an expert of two or more blocks, as the pipeline does (a
    one-block expert's first chunk is gathered in the pipeline with its padding known).

    Args:
        ctx: the MoE kernel context.
        e: the expert (a static index) whose A runs after the next fence.

    Returns:
        ChunkInputs for compute_phase1_pipelined_mxfp8(first=): this core's first chunk of e's first block.

    Dimensions:
        ChunkInputs(m = 128, width = I): ids, slots [128, 1]; dY, X rows [128, Hp]; p [128, 1]; checkpoints
        [128, I] (Hp: H padded to the MX K alignment).
    """
    first = ChunkInputs(ctx, PARTITIONS, ctx.I, dy_staged=e in ctx.staged_dy)
    b_lo, _, _ = ctx.loops.bounds(e)
    ctx.loops.if_multi(e, lambda: first.gather(ctx, b_lo, ctx.unit_rows[0][0], True))
    return first


def compute_phase1_pipelined_mxfp8(ctx, e, b_lo, before_last, last, w_down, w_gate, w_up, between=None, first=None):
    """Pass A of expert e with resident weights (all of I in one group) over its blocks [b_lo, last] (last: the
    register of its last block), this core's 128-row chunks one after the other, each chunk's gathers issued before
    the previous chunk's epilogue (docs/moe.md section 10, round 7c).

    GpSimd generates the gathers' software-DGE descriptors in its program order, which also holds the epilogue's
    products: issued after a chunk's epilogue, the next chunk's gathers wait for it, and the epilogue then waits
    for them. Here two ChunkInputs sets alternate: chunk q + 1 is gathered into one while chunk q is computed from
    the other, and the last chunk of block i is followed by block i + 1's first chunk (the register i with a static
    offset of B positions), so the sets' roles are static in the loop body (an even number of chunks per block).
    Two pairs of epilogue output tiles (chunk_outputs: d_gate_up, hs) alternate likewise.
    The chunks are ctx.unit_rows (core c's 128 rows of every 128·cores-row unit): in the last block, the only one
    that can hold padding, a chunk is computed only when its unit's first position holds a routed pair (the same
    flag on both cores: identical trip counts), else its scratch rows are stored as zeros; its gathers are issued
    anyway (rows of padding are skipped: no descriptor, no byte). Only gathers that may meet padding zero their tiles
    first (the expert's first chunk, and the last block's chunks when its final position is padding): the blocks
    before the last and the block before the last are separate loops, the latter in two variants by that flag.

    Dimensions: per chunk as compute_phase1_block_grads_mxfp8 (m = 128 rows, dY_b [128, H], K=H).

    Args:
        ctx: MoeContext (ctx.unit_rows: this core's 128-row chunks of a block, an even count).
        e: expert (static). b_lo, before_last, last: registers, the expert's first block, max(last - 1, b_lo) and
            its last block.
        w_down / w_gate / w_up: ExpertPanels over all of I, resident.
        between: None, or between(q), issued once with every block's chunk q (static) whether the chunk runs or not:
            another pass's work in this pass's loop bodies (InterleavedDx.piece, round 8a). A chunk that runs issues
            it after its I tiles, before its stores: on TensorE after its dI matmuls, before its d_gate_up panel's
            transposes (which wait for its whole epilogue).
        first: gather_first_chunk_ahead(ctx, e), the expert's first chunk gathered earlier; None: gathered here.
    """
    rows = ctx.unit_rows
    kernel_assert(len(rows) % 2 == 0 and all(m == PARTITIONS for _, m in rows),
                  f"the pass A pipeline needs an even number of 128-row chunks per core, got {rows}")
    staged = e in ctx.staged_dy
    sets = [first or ChunkInputs(ctx, PARTITIONS, ctx.I, dy_staged=staged),
            ChunkInputs(ctx, PARTITIONS, ctx.I, dy_staged=staged)]
    # chunk q's epilogue writes output pair q % 2 (rewritten by chunk q + 2, long after chunk q's stores): with a fresh
    # pair per chunk, freed at its stores, the allocator placed the next chunk's epilogue tiles over the just-stored
    # d_gate_up, which then waited for its 1.5 MB store (GPT-OSS-20B gwb: on the critical path at most chunks;
    # docs/moe.md section 10, round 37a)
    outs = [chunk_outputs(ctx, ctx.I) for _ in sets]
    # the expert's first chunk: of a full block when the expert has more than one (a one-block expert's is gathered
    # with its padding known, below); a tile zeroed here would hold VectorE's queue until the previous expert's
    # last use of that SBUF
    if first == None:  # noqa: E711
        ctx.loops.if_multi(e, lambda: sets[0].gather(ctx, b_lo, rows[0][0], True))

    def block(i, full, next_full, flags=None):
        """Block i's chunks; next_full: block i + 1 holds no padding (None: no next block of this expert)."""
        for q, (r0, m) in enumerate(rows):
            # the set chunk q - 1 read: its checkpoints by column pieces (PIPELINE_CHECKPOINT_COLUMNS)
            if q + 1 < len(rows):
                sets[(q + 1) % 2].gather(ctx, i, rows[q + 1][0], full, pieces=True)
            elif next_full != None:  # noqa: E711  block i + 1's first chunk (i + 1 <= last: the same expert)
                sets[(q + 1) % 2].gather(ctx, i, rows[0][0], next_full, ahead=1, pieces=True)
            piece = None if between == None else (lambda q=q: between(q))  # noqa: E711
            if flags == None or q == 0:  # noqa: E711  (a block's first position holds a routed pair)
                _phase1_rows(ctx, e, i, [(r0, m)], w_down, w_gate, w_up, full, [sets[q % 2]], before_store=piece,
                             outputs=[outs[q % 2]])
                continue
            ctx.if_flag(flags, q, lambda r0=r0, m=m, q=q: _phase1_rows(ctx, e, i, [(r0, m)], w_down, w_gate, w_up,
                                                                       full, [sets[q % 2]], outputs=[outs[q % 2]]))
            ctx.if_flag(flags, q, lambda r0=r0, m=m: zero_padding_rows(ctx, i, r0, m, 0, ctx.I, expert=e),
                        complement=True)
            if piece != None:  # noqa: E711  (outside the flag: every block's chunk q issues it)
                piece()

    def last_two(next_full):
        """The block before the last (if any) and the last block, whose padding (next_full False) is known here."""
        ctx.loops.if_single(e, lambda i: sets[0].gather(ctx, i, rows[0][0], next_full))
        nl.fori_loop(before_last, last, lambda i: block(i, True, next_full))
        flags = None if next_full else ctx.row_flags(last, ctx.row_unit, len(rows))
        block(last, next_full, None, flags)

    nl.fori_loop(b_lo, before_last, lambda i: block(i, True, True))
    full = ctx.row_flags(last, ctx.B - 1, 2)  # position B - 1 of the last block holds a routed pair: no padding
    ctx.if_flag(full, 1, lambda: last_two(True))
    ctx.if_flag(full, 1, lambda: last_two(False), complement=True)
    sets = outs = None


def zero_padding_rows(ctx, i, r0, m, i_lo, i_hi, copies=None, expert=None):
    """Rows r0..r0+m of block i hold only padding: their scratch rows (the columns RowChunk.store would
    write for I columns [i_lo, i_hi), and dY / X with the first group, or where `copies` says so: the I split's
    writer of the chunk's copies) become zeros, as a gathered padding row would be. With block-ordered weights the
    rows' d_topk_weights too (after the last I group; not the I split's, whose scatter writes every row): every entry
    of that output is written (ctx.zero_pair_grads). expert: the pipeline's e (padding_rows_read_by_c; round 41c)."""
    I, H = ctx.I, ctx.H
    c_spans = [(ctx.hs, i_lo, i_hi)]
    if (i_lo == 0) if copies == None else copies:  # noqa: E711
        c_spans += [(ctx.dy_blocks, 0, H), (ctx.x_blocks, 0, H)]

    def zero(spans):
        for scratch, f_lo, f_hi in spans:
            ctx.zero_block_rows(scratch, i, r0, m, f_lo, f_hi)
    zero([(ctx.d_gu, i_lo, i_hi), (ctx.d_gu, I + i_lo, I + i_hi)])
    padding_rows_read_by_c(ctx, expert, lambda: zero(c_spans))
    if ctx.weights_blocked and copies == None and i_hi == I:  # noqa: E711
        ctx.zero_pair_grads(i, r0, m)


def _phase1_rows(ctx, e, i, rows, w_down, w_gate, w_up, full=False, inputs=None, before_store=None, tile_sums=False,
                 staged=False, d_up_engine=None, at_first_tile=None, outputs=None):
    """compute_phase1_block_grads_mxfp8 for the chunks `rows` [(r0, m <= 128)] of block i, kept on chip
    together: the I tiles loop outside them, so a weight tile that is not resident loads once for all.
    inputs: the chunks' ChunkInputs, already gathered (the pipeline), or None (gathered here).
    before_store: None, or a function issued after the I tiles, before the stores (the pipeline's `between`).
    at_first_tile: None, or a function issued after the chunks' reads, before the first I tile's matmuls (the I
    split's staging of a later expert's rows: docs/moe.md section 10, round 34b).
    tile_sums, staged, d_up_engine: RowChunk's (the I split of one-block experts).
    outputs: None, or the chunks' chunk_outputs tiles (the pipeline's; None: each chunk allocates its own)."""
    recompute = w_gate != None or w_up != None  # noqa: E711
    i_lo, i_hi = w_down.tiles[0][0], w_down.tiles[-1][0] + w_down.tiles[-1][1]
    for w in (w_down, w_gate, w_up):
        if w != None:  # noqa: E711
            w.start_block()
    inputs = inputs or [None] * len(rows)
    outputs = outputs or [None] * len(rows)
    chunks = [RowChunk(ctx, i, r0, m, recompute, i_lo, i_hi, full, inp, tile_sums, staged, d_up_engine, out)
              for (r0, m), inp, out in zip(rows, inputs, outputs)]
    if at_first_tile != None:  # noqa: E711
        at_first_tile()
    for jj, (n0, nsz) in enumerate(w_down.tiles):
        j = n0 // PHASE1_N_TILE  # the tile's index in I (the routing-gradient fold: tile 0 overwrites)
        wd = w_down.get(jj)
        wg = w_gate.get(jj) if w_gate != None else None  # noqa: E711
        wu = w_up.get(jj) if w_up != None else None  # noqa: E711
        for c in chunks:
            d_i = nl.ndarray((PARTITIONS, PHASE1_N_TILE), dtype=nl.float32, buffer=nl.psum)
            matmul_panels(d_i[:c.f_pad, :nsz], c.dy_panel, wd, ctx.setup)  # K=H, M=m, N=nsz
            g_psum = u_psum = None
            if wg != None:  # noqa: E711
                g_psum = nl.ndarray((PARTITIONS, PHASE1_N_TILE), dtype=nl.float32, buffer=nl.psum)
                matmul_panels(g_psum[:c.f_pad, :nsz], c.x_panel, wg, ctx.setup)  # K=H, M=m, N=nsz
            if wu != None:  # noqa: E711
                u_psum = nl.ndarray((PARTITIONS, PHASE1_N_TILE), dtype=nl.float32, buffer=nl.psum)
                matmul_panels(u_psum[:c.f_pad, :nsz], c.x_panel, wu, ctx.setup)  # K=H, M=m, N=nsz
            c.epilogue(ctx, j, n0, nsz, d_i, g_psum, u_psum)
            if jj + 1 < len(w_down.tiles):  # (the last tile's columns go with the rest in store)
                c.store_done(ctx, i, n0 + nsz)
        wd = wg = wu = None
    if before_store != None:  # noqa: E711
        before_store()
    for c in chunks:
        c.store(ctx, i)
    chunks = c = None


def _routing_grad_tile(d_i, h, acc, j, m, nsz):
    """acc [m, 1] (+)= sum over the tile's columns of dI * f32(h): fp32 products, one fp32 reduce per
    PHASE1_N_TILE (= ROUTING_GRAD_TILE) columns, fp32 accumulation across tiles (tile 0 overwrites).

    The product and its reduce are one VectorE pass: scalar_tensor_tensor's NKI 0.7 reduce_res
    (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.0/nki/api/generated/nki.isa.scalar_tensor_tensor.html)
    writes (dI * 1.0) * f32(h) (the bits of dI * f32(h): a multiply by 1.0 is exact) and, reset_reduce, the
    registers' 0 + the tile's sum (the bits of tensor_reduce's sum; docs/simulator.md#choice-vector-accumulate).
    The products stay fp32, so the sum is the same whether the reduce reads them before or after the dst write.

    Dimensions:
        d_i: fp32 [m, nsz] (PSUM), h: [m, nsz] (SBUF), acc: fp32 [m, 1] (SBUF).
    """
    prod = nl.ndarray((PARTITIONS, PHASE1_N_TILE), dtype=nl.float32, buffer=nl.sbuf)
    part = acc if j == 0 else nl.ndarray((m, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.scalar_tensor_tensor(dst=prod[:m, :nsz], data=d_i, op0=nl.multiply, operand0=1.0, op1=nl.multiply,
                              operand1=h, reduce_op=nl.add, reduce_res=part, reduce_cmd=nisa.reduce_cmd.reset_reduce)
    if j > 0:
        nisa.tensor_tensor(dst=acc, data1=acc, data2=part, op=nl.add)
