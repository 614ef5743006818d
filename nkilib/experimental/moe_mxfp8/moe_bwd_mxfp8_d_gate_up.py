"""Pass A of the MoE expert backward kernel (moe_bwd_mxfp8_kernel.py), per block: phase 0 (the recompute of
gate_pre / up when not given) and phase 1, dI = dY_b W_down[e] (K=H) with the SwiGLU derivative and the
routing-weight gradient <dI, h> fused in the epilogue; d_gate_up and hs rows (and the gathered dY / X rows)
go to block-ordered HBM scratch, d_topk_weights is scattered by slot. Numerics: docs/moe.md, section 4.

Rows (LNC2: each core its share of every block's rows) go in one of two ways:
    weights loaded per block: this core's contiguous rows in groups of PHASE1_ROW_GROUP (chunks of 128), the
        I tiles outside them, so a weight tile loads once per group;
    resident weights in an expert's last block (the only one that can hold padding): 128-row units per core,
        each run only when its first position holds a routed pair (MoeContext.row_flags, the same on both
        cores), a skipped unit's scratch rows stored as zeros (passes B and C read a block's padding rows).
The weights' I tiles may be a resident group of them (a multi-block expert, moe_bwd_mxfp8_dx.resident_tile_groups):
the first group gathers dY / X, later ones read the block-ordered copies back, and the routing-gradient fold
continues across groups through fp32 scratch (docs/moe.md, section 10, round 3).
With all of I in one group, a chunk's d_gate_up rows are also quantized along 2I into pass B's stationary panel
and stored as words and scales when the kernel asks for them (ctx.d_gu_mx; round 7a): pass A holds the rows on chip
while TensorE idles, and each core makes only its own rows' panels (pass B used to transpose every row on both cores).
"""
from __future__ import annotations

import nki.isa as nisa
import nki.language as nl

from ...core.kernel_helpers import kernel_assert
from ...core.matmul import matmul_panels, panel_from_rows, store_panel_tiles
from ...core.matmul.sources import blocks as _blocks
from ...core.swiglu import intermediate_tile, swiglu_backward_tile, swiglu_forward_terms
from .constants import PARTITIONS, PHASE1_N_TILE, PHASE1_ROW_GROUP

__all__ = ["RowChunk", "compute_phase1_block_grads_mxfp8"]


def _natural_rows(ctx, k_size):
    """SBUF [128, Kp] bf16 tile for rows of K = k_size (Kp: K padded to the MX K alignment)."""
    return nl.ndarray((PARTITIONS, ctx.k_width(k_size)), dtype=nl.bfloat16, buffer=nl.sbuf)


def _gathered_natural(ctx, src2d, ids, m, k_size, full=False):
    """SBUF [128, Kp] bf16 tile: rows src2d[ids] (zero rows for padding, zero columns beyond K). full: every id
    is a routed pair (a full block), so only the columns beyond K are zeroed."""
    nat = _natural_rows(ctx, k_size)
    if not full:
        nisa.memset(dst=nat[:m, :], value=0.0)
    elif nat.shape[1] > k_size:
        nisa.memset(dst=nat[:m, k_size:], value=0.0)
    ctx.gather(nat[:m, :k_size], src2d, ids, 0, k_size)
    return nat


def _block_natural(ctx, scratch, i, r0, m, k_size):
    """SBUF [128, Kp] bf16 tile: rows r0..r0+m of block i of a block-ordered [N, B, K] scratch (already gathered)."""
    nat = _natural_rows(ctx, k_size)
    if nat.shape[1] > k_size:
        nisa.memset(dst=nat[:m, k_size:], value=0.0)
    nisa.dma_copy(dst=nat[:m, :k_size], src=ctx.block_rows(scratch, i, r0, m, 1, 0, k_size))
    return nat


def _gathered_checkpoint(ctx, ckpt, slots, m, i_lo, width, full=False):
    """SBUF [128, width] bf16 columns [i_lo, i_lo + width) of a [T*k, I] checkpoint's rows by slot (zero for
    padding, unless the block is full), or None."""
    if ckpt == None:  # noqa: E711
        return None
    tile = nl.ndarray((PARTITIONS, width), dtype=nl.bfloat16, buffer=nl.sbuf)
    if not full:
        nisa.memset(dst=tile[:m, :], value=0.0)
    ctx.gather(tile[:m, :], ckpt, slots, i_lo, width)
    return tile


def _projection_tile(ckpt_tile, psum, m, c0, nsz):
    """bf16 [m, nsz] view: the gathered checkpoint's columns from c0, or bf16(psum) of the recompute (RNE)."""
    if ckpt_tile != None:  # noqa: E711
        return ckpt_tile[:m, c0:c0 + nsz]
    tile = nl.ndarray((PARTITIONS, PHASE1_N_TILE), dtype=nl.bfloat16, buffer=nl.sbuf)
    nisa.tensor_copy(dst=tile[:m, :nsz], src=psum[:m, :nsz])
    return tile[:m, :nsz]


class RowChunk(nl.NKIObject):
    """The on-chip state of m <= 128 rows (positions r0..r0+m) of block i in pass A, for the I columns
    [i_lo, i_hi) (all of I, or one resident weight group of a multi-block expert): gathered inputs, their
    K=H panels, and the epilogue's outputs until they are stored.

    The group at i_lo = 0 gathers dY / X by token id and writes the block-ordered copies; later groups read
    those copies back (plain DMA, this core's own rows). The routing-weight gradient's fold over I tiles
    continues across groups through ctx.d_w_partial (fp32, exact), so its order is the reference's.
    """

    def __init__(self, ctx, i, r0, m, recompute, i_lo, i_hi, full=False):
        I, H = ctx.I, ctx.H
        self.r0, self.m, self.f_pad = r0, m, ctx.f_pad(m)
        self.i_lo, self.i_hi, width = i_lo, i_hi, i_hi - i_lo
        self.ids = ctx.positions(ctx.ids2d, i, r0, 1, m)
        self.slots = ctx.positions(ctx.slots2d, i, r0, 1, m)
        x_nat = None
        if i_lo == 0:
            dy_nat = _gathered_natural(ctx, ctx.dy, self.ids, m, H, full)
            x_nat = _gathered_natural(ctx, ctx.x, self.ids, m, H, full)
            # block-ordered copies for pass C (its K = tokens operands then load by plain DMA, no second gather);
            # padding rows are the zeroed rows of the gathered tiles
            nisa.dma_copy(dst=ctx.block_rows(ctx.dy_blocks, i, r0, m, 1, 0, H), src=dy_nat[:m, :H])
            nisa.dma_copy(dst=ctx.block_rows(ctx.x_blocks, i, r0, m, 1, 0, H), src=x_nat[:m, :H])
        else:
            dy_nat = _block_natural(ctx, ctx.dy_blocks, i, r0, m, H)
            if recompute:
                x_nat = _block_natural(ctx, ctx.x_blocks, i, r0, m, H)
        self.dy_panel = panel_from_rows(dy_nat[:m, :], m, H, self.f_pad, ctx.setup)
        self.x_panel = panel_from_rows(x_nat[:m, :], m, H, self.f_pad, ctx.setup) if recompute else None
        self.p = nl.ndarray((m, 1), dtype=nl.float32, buffer=nl.sbuf)
        if not full:  # padding rows' p = 0 (a full block gathers every row)
            nisa.memset(dst=self.p, value=0.0)
        ctx.gather(self.p, ctx.weights, self.slots, 0, 1)
        self.ckpts = [_gathered_checkpoint(ctx, c, self.slots, m, i_lo, width, full)
                      for c in (ctx.gate_pre, ctx.gate_act, ctx.up, ctx.intermediate)]
        # gate cols, up cols; with pass B's panels made here (ctx.d_gu_mx), zero up to the MX K padding of 2I
        self.d_gu = nl.ndarray((PARTITIONS, ctx.k_width(2 * width)), dtype=nl.bfloat16, buffer=nl.sbuf)
        if self.d_gu.shape[1] > 2 * width:
            nisa.memset(dst=self.d_gu[:m, 2 * width:], value=0.0)
        self.hs = nl.ndarray((PARTITIONS, width), dtype=nl.bfloat16, buffer=nl.sbuf)
        self.d_w = nl.ndarray((m, 1), dtype=nl.float32, buffer=nl.sbuf)
        if i_lo > 0:  # the fold so far (tiles below i_lo), from this core's earlier group
            nisa.dma_copy(dst=self.d_w, src=ctx.block_rows(ctx.d_w_partial, i, r0, m, 1, 0, 1))

    def epilogue(self, ctx, j, n0, nsz, d_i, g_psum, u_psum):
        """I tile j ([n0, n0+nsz), global) of the rows: SwiGLU terms, routing-weight gradient, dh, d_gate_up, hs."""
        m, c0, width = self.m, n0 - self.i_lo, self.i_hi - self.i_lo
        g_ck, a_ck, u_ck, h_ck = self.ckpts
        gate_pre = _projection_tile(g_ck, g_psum, m, c0, nsz)
        up = _projection_tile(u_ck, u_psum, m, c0, nsz)
        act = a_ck[:m, c0:c0 + nsz] if a_ck != None else None  # noqa: E711
        terms = swiglu_forward_terms(gate_pre, up, act, ctx.clamp, m, nsz, PHASE1_N_TILE,
                                     clamp_engine=ctx.clamp_engine)
        h = h_ck[:m, c0:c0 + nsz] if h_ck != None else intermediate_tile(terms)  # noqa: E711
        _routing_grad_tile(d_i[:m, :nsz], h, self.d_w, j, m, nsz)
        # dh = dI * p (fp32), then the dense SwiGLU derivative on dh
        dh = nl.ndarray((PARTITIONS, PHASE1_N_TILE), dtype=nl.float32, buffer=nl.sbuf)
        # dh and hs on ScalarE (fp32 multiplies, the same bits on any engine): VectorE bounds the epilogue
        nisa.tensor_scalar(dst=dh[:m, :nsz], data=d_i[:m, :nsz], op0=nl.multiply, operand0=self.p,
                           engine=nisa.engine.scalar)
        swiglu_backward_tile(dh[:m, :nsz], terms, self.d_gu[:m, c0:c0 + nsz],
                             self.d_gu[:m, width + c0:width + c0 + nsz],
                             d_i_engine=ctx.d_gate_engine,  # dh is in SBUF: off VectorE unless clamped
                             d_up_engine=nisa.engine.gpsimd)  # (MoeContext's engines, in the kernel file)
        # hs = bf16(f32(h) * p): dW_down's operand (the routing weight applied on the intermediate)
        nisa.tensor_scalar(dst=self.hs[:m, c0:c0 + nsz], data=h, op0=nl.multiply, operand0=self.p,
                           engine=nisa.engine.scalar)

    def store(self, ctx, i):
        I, m, r0, lo, width = ctx.I, self.m, self.r0, self.i_lo, self.i_hi - self.i_lo
        if width == I:
            nisa.dma_copy(dst=ctx.block_rows(ctx.d_gu, i, r0, m, 1, 0, 2 * I), src=self.d_gu[:m, :2 * I])
            if ctx.d_gu_mx != None:  # noqa: E711  pass B's stationary panel of these rows (K=2I, M=m)
                kernel_assert(r0 % PARTITIONS == 0 and m == PARTITIONS,
                              "pass B's d_gate_up panels need 128-row chunks from a multiple of 128, "
                              f"got r0={r0}, m={m}")
                panel = panel_from_rows(self.d_gu[:m, :], m, 2 * I, self.f_pad, ctx.setup)
                words, scales = ctx.d_gu_mx
                store_panel_tiles(panel, ctx.block_tiles(words, i, r0, len(panel.data)),
                                  ctx.block_tiles(scales, i, r0, panel.scale_tile.shape[1]))
                panel = None
        else:
            nisa.dma_copy(dst=ctx.block_rows(ctx.d_gu, i, r0, m, 1, lo, width), src=self.d_gu[:m, :width])
            nisa.dma_copy(dst=ctx.block_rows(ctx.d_gu, i, r0, m, 1, I + lo, width), src=self.d_gu[:m, width:2 * width])
        nisa.dma_copy(dst=ctx.block_rows(ctx.hs, i, r0, m, 1, lo, width), src=self.hs[:m, :])
        if self.i_hi < I:  # more groups follow: keep the partial fold
            nisa.dma_copy(dst=ctx.block_rows(ctx.d_w_partial, i, r0, m, 1, 0, 1), src=self.d_w)
            return
        out = ctx.d_weights.ap([[1, m], [1, 1]], offset=0, vector_offset=self.slots, indirect_dim=0)
        nisa.dma_copy(dst=out, src=self.d_w, oob_mode=nisa.oob_mode.skip)


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
        ctx.if_flag(flags, u, lambda r0=r0, m=m: _zero_rows(ctx, i, r0, m, i_lo, i_hi), complement=True)


def _zero_rows(ctx, i, r0, m, i_lo, i_hi):
    """Rows r0..r0+m of block i hold only padding: their scratch rows (the columns RowChunk.store would
    write for I columns [i_lo, i_hi), and dY / X with the first group) become zeros, as a gathered padding
    row would be."""
    I, H = ctx.I, ctx.H
    spans = [(ctx.d_gu, i_lo, i_hi), (ctx.d_gu, I + i_lo, I + i_hi), (ctx.hs, i_lo, i_hi)]
    if i_lo == 0:
        spans += [(ctx.dy_blocks, 0, H), (ctx.x_blocks, 0, H)]
    for scratch, f_lo, f_hi in spans:
        for f0, fsz in _blocks(f_lo, f_hi, ctx.zeros.shape[1]):
            nisa.dma_copy(dst=ctx.block_rows(scratch, i, r0, m, 1, f0, fsz), src=ctx.zeros[:m, :fsz])


def _phase1_rows(ctx, e, i, rows, w_down, w_gate, w_up, full=False):
    """compute_phase1_block_grads_mxfp8 for the chunks `rows` [(r0, m <= 128)] of block i, kept on chip
    together: the I tiles loop outside them, so a weight tile that is not resident loads once for all."""
    recompute = w_gate != None or w_up != None  # noqa: E711
    i_lo, i_hi = w_down.tiles[0][0], w_down.tiles[-1][0] + w_down.tiles[-1][1]
    for w in (w_down, w_gate, w_up):
        if w != None:  # noqa: E711
            w.start_block()
    chunks = [RowChunk(ctx, i, r0, m, recompute, i_lo, i_hi, full) for r0, m in rows]
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
        wd = wg = wu = None
    for c in chunks:
        c.store(ctx, i)
    chunks = c = None


def _routing_grad_tile(d_i, h, acc, j, m, nsz):
    """acc [m, 1] (+)= sum over the tile's columns of dI * f32(h): fp32 products, one fp32 reduce per
    PHASE1_N_TILE (= ROUTING_GRAD_TILE) columns, fp32 accumulation across tiles (tile 0 overwrites)."""
    prod = nl.ndarray((PARTITIONS, PHASE1_N_TILE), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=prod[:m, :nsz], data1=d_i, data2=h, op=nl.multiply)
    if j == 0:
        nisa.tensor_reduce(dst=acc, op=nl.add, data=prod[:m, :nsz], axis=1)
        return
    part = nl.ndarray((m, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=part, op=nl.add, data=prod[:m, :nsz], axis=1)
    nisa.tensor_tensor(dst=acc, data1=acc, data2=part, op=nl.add)
