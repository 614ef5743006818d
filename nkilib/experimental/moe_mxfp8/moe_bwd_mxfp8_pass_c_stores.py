"""Pass C's stores out of PSUM (moe_bwd_mxfp8_weight_grads.py): a finished tile's +0.0 eviction and store, row
pieces of several tiles stored in one DMA, and a windowed expert's partial sums carried across windows through HBM
scratch (docs/moe.md sections 3-4 and section 10, rounds 5b, 6b, 11c, 12a)."""
from __future__ import annotations

import nki.isa as nisa
import nki.language as nl

from ...core.kernel_helpers import kernel_assert
from .constants import MOE_N_TILE, PARTITIONS, WEIGHT_GRAD_STORE_JOIN_MIN_COLUMNS, WEIGHT_GRAD_STORE_WIDTH

__all__ = ["RowStore", "add_partial", "evict_and_store", "store_pieces", "store_window"]


def evict_and_store(out, e, acc, m0, msz, n0, nsz, wg_dtype, t):
    """out[e, m0:m0+msz, n0:n0+nsz] = wg(acc + 0.0): the eviction adds +0.0 in fp32 (the reference's sum
    starts from +0, so a first product of -0 must leave +0; x + 0.0 == x otherwise), on ScalarE and VectorE
    in turn (t: the tile's count)."""
    res = nl.ndarray((PARTITIONS, MOE_N_TILE), dtype=wg_dtype, buffer=nl.sbuf)
    engine = nisa.engine.scalar if t % 2 == 0 else nisa.engine.vector
    nisa.tensor_scalar(dst=res[:msz, :nsz], data=acc[:msz, :nsz], op0=nl.add, operand0=0.0, engine=engine)
    nisa.dma_copy(dst=out[e, m0:m0 + msz, n0:n0 + nsz], src=res[:msz, :nsz])


def store_pieces(n_lo, n_hi):
    """[(p0, p_end)]: the column pieces of a weight-gradient row [n_lo, n_hi) that RowStore stores by one DMA each:
    WEIGHT_GRAD_STORE_WIDTH columns from n_lo; a last piece narrower than that but of at least
    WEIGHT_GRAD_STORE_JOIN_MIN_COLUMNS joins the piece before it (the DeepSeek-V3 rank's 3584-column core half of H goes
    out as one piece of 7 KiB runs, not 4 KiB + 3 KiB, where the cost model's per-descriptor overhead takes 4.5% of a
    3 KiB run's rate); a shorter one stays its own piece (GPT-OSS-20B's 832 of 2880; docs/moe.md section 10, round
    31c)."""
    pieces = []
    for p0 in range(n_lo, n_hi, WEIGHT_GRAD_STORE_WIDTH):
        p_end = min(n_hi, p0 + WEIGHT_GRAD_STORE_WIDTH)
        if pieces and WEIGHT_GRAD_STORE_JOIN_MIN_COLUMNS <= p_end - p0 < WEIGHT_GRAD_STORE_WIDTH:
            pieces[-1] = (pieces[-1][0], p_end)
        else:
            pieces.append((p0, p_end))
    return pieces


class RowStore(nl.NKIObject):
    """Rows [m0, m0+msz) of out[e], columns [n_lo, n_hi), from [128, MOE_N_TILE] fp32 accumulators fed in column
    order: each is evicted (evict_and_store's +0.0 on ScalarE / VectorE in turn) into an SBUF piece (store_pieces:
    WEIGHT_GRAD_STORE_WIDTH columns, a narrower last one of at least WEIGHT_GRAD_STORE_JOIN_MIN_COLUMNS joined to the
    piece before), which goes out in one DMA when its last tile is in: 4 KiB bf16 runs per row or longer instead of one
    tile's 1 KiB (DMA payload rule, >= 4 KiB per descriptor to sustain the rate:
    https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/deep-dives/nki-dma-bandwidth-guide.html)."""

    def __init__(self, out, e, m0, msz, n_lo, n_hi, wg_dtype, engines=(nisa.engine.scalar, nisa.engine.vector)):
        self.out, self.e, self.m0, self.msz, self.n_hi, self.wg_dtype = out, e, m0, msz, n_hi, wg_dtype
        self.engines = engines
        self.pieces = store_pieces(n_lo, n_hi)
        self.piece, self.p0, self.p_end = None, n_lo, n_lo

    def tile(self, acc, n0, nsz, t):
        if n0 >= self.p_end:  # first tile of the next piece (pieces start at n_lo: a tile never straddles two)
            for p0, p_end in self.pieces:
                if p0 == n0:
                    self.p0, self.p_end = p0, p_end
            kernel_assert(self.p0 == n0, f"tile at column {n0} does not start a store piece of {self.pieces}")
            # a piece tile of at least WEIGHT_GRAD_STORE_WIDTH columns, a narrower piece's too: the allocator's
            # placements stay as they were (tiles of the piece's own width cost GPT-OSS-20B's gpt4 5%: docs/moe.md,
            # round 31c)
            width = max(WEIGHT_GRAD_STORE_WIDTH, self.p_end - self.p0)
            self.piece = nl.ndarray((PARTITIONS, width), dtype=self.wg_dtype, buffer=nl.sbuf)
        msz, off = self.msz, n0 - self.p0
        engine = self.engines[t % len(self.engines)]
        nisa.tensor_scalar(dst=self.piece[:msz, off:off + nsz], data=acc[:msz, :nsz], op0=nl.add, operand0=0.0,
                           engine=engine)
        if n0 + nsz >= self.p_end:
            nisa.dma_copy(dst=self.out[self.e, self.m0:self.m0 + msz, self.p0:self.p_end],
                          src=self.piece[:msz, :self.p_end - self.p0])
            self.piece = None


def add_partial(partial, m_group, n_tiles, accs):
    """acc = fp32(acc + partial[tile]) for the group's PSUM accumulators (after their slot-0 matmul overwrote them):
    the earlier windows' fp32 sums, loaded from this core's tiles of the HBM scratch, added on VectorE."""
    for (m0, msz), row in zip(m_group, accs):
        for (n0, nsz, _, _), acc in zip(n_tiles, row):
            part = nl.ndarray((PARTITIONS, MOE_N_TILE), dtype=nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(dst=part[:msz, :nsz], src=partial[m0:m0 + msz, n0:n0 + nsz])
            nisa.tensor_tensor(dst=acc[:msz, :nsz], data1=acc[:msz, :nsz], data2=part[:msz, :nsz], op=nl.add)


def store_window(ctx, e, w, out, partial, m_group, n_tiles, accs, n_lo, n_hi, wg_dtype, t):
    """After window w's slots: the expert's last window stores wg(acc + 0.0) (RowStore), any other the fp32 sums
    as they are into this core's tiles of `partial`. Both read PSUM on ScalarE only, as the resident path's evictions
    (round 6b): VectorE holds the quantizes of the next stationary piece and window and the carries' adds, which would
    otherwise queue behind a group's copies and so behind its last matmuls (docs/moe.md section 10, round 11c)."""

    def final():
        tt = t
        for (m0, msz), row in zip(m_group, accs):
            store = RowStore(out, e, m0, msz, n_lo, n_hi, wg_dtype, engines=(nisa.engine.scalar,))
            for (n0, nsz, _, _), acc in zip(n_tiles, row):
                store.tile(acc, n0, nsz, tt)
                tt += 1

    def carry():
        for (m0, msz), row in zip(m_group, accs):
            for (n0, nsz, _, _), acc in zip(n_tiles, row):
                part = nl.ndarray((PARTITIONS, MOE_N_TILE), dtype=nl.float32, buffer=nl.sbuf)
                nisa.tensor_copy(dst=part[:msz, :nsz], src=acc[:msz, :nsz], engine=nisa.engine.scalar)
                nisa.dma_copy(dst=partial[m0:m0 + msz, n0:n0 + nsz], src=part[:msz, :nsz])

    if w == 0:
        carry()  # window 0 is never the last (nb > R)
        return
    ctx.resident.if_last_window(e, w, True, final)
    if w < ctx.resident.W - 1:
        ctx.resident.if_last_window(e, w, False, carry)
