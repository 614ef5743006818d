"""StoreEpilogue: a plan's default epilogue (evict each output tile and store it to HBM)."""
from __future__ import annotations

import nki.isa as nisa
import nki.language as nl

from ..kernel_helpers import kernel_assert
from .constants import PARTITIONS, RESULT_BUFFERS, STREAM_N_TILE


class StoreEpilogue(nl.NKIObject):
    """The default epilogue (see MatmulPlan for the protocol). Evict each tile to SBUF on ScalarE (faster clock
    than VectorE in fp32; VectorE carries quantize_mx) in `out_dtype` and store it to out_hbm [M, N], through
    RESULT_BUFFERS tiles used round-robin (a tile's store may trail the next tiles' evictions). A plan with a sync
    point inside its run (MatmulPlan.set_fence) holds the store of the tile before the fence until after it
    (defer_next_store / store_deferred)."""

    def __init__(self, out_hbm, out_dtype):
        self.out_hbm = out_hbm
        self.out_dtype = out_dtype
        self.results = None
        self.defer = False  # the next tile's store waits for store_deferred
        self.deferred = None  # (m0, msz, n0, nsz, result tile) of that store

    def prepare(self, plan) -> None:
        self.results = [nl.ndarray((PARTITIONS, plan.n_tile), dtype=self.out_dtype, buffer=nl.sbuf)
                        for _ in range(RESULT_BUFFERS)]

    def tile(self, i, m0, msz, n0, nsz, accumulators) -> None:
        """Tile i (rows [m0, m0 + msz), columns [n0, n0 + nsz) of out) evicted from accumulators[0] on ScalarE into
        result buffer i % RESULT_BUFFERS and stored to out_hbm, or held for store_deferred (defer_next_store).

        Dimensions: accumulators[0] PSUM [128, n_tile] fp32 (its [:msz, :nsz] read); result [128, n_tile].
        """
        self.tile_by_columns(i, m0, msz, n0, nsz, accumulators, 1)

    def tile_by_columns(self, i, m0, msz, n0, nsz, accumulators, pieces) -> None:
        """Tile i as tile() stores it, evicted in `pieces` equal column pieces (a span multiplied column piece by
        column piece, span_columns.py: each piece's eviction waits only for its own columns' last matmul)."""
        res = self.results[i % RESULT_BUFFERS]
        width = nsz // pieces
        kernel_assert(width * pieces == nsz, f"{pieces} column pieces do not divide nsz={nsz}")
        for c0 in range(0, nsz, width):
            nisa.tensor_copy(dst=res[:msz, c0:c0 + width], src=accumulators[0][:msz, c0:c0 + width],
                             engine=nisa.engine.scalar)
        if self.defer:
            self.defer, self.deferred = False, (m0, msz, n0, nsz, res)
            return
        nisa.dma_copy(dst=self.out_hbm[m0:m0 + msz, n0:n0 + nsz], src=res[:msz, :nsz])

    def tile_columns(self, i, m0, msz, n0, c0, width, acc) -> None:
        """Columns [c0, c0 + width) of tile i (MatmulPlan pieced_last_tile): evicted on ScalarE and stored now."""
        kernel_assert(not self.defer, f"tile {i} is pieced and its store deferred: a fence inside the last tile")
        res = self.results[i % RESULT_BUFFERS]
        nisa.tensor_copy(dst=res[:msz, c0:c0 + width], src=acc[:msz, c0:c0 + width], engine=nisa.engine.scalar)
        nisa.dma_copy(dst=self.out_hbm[m0:m0 + msz, n0 + c0:n0 + c0 + width], src=res[:msz, c0:c0 + width])

    def defer_next_store(self) -> None:
        """Evict the next tile as usual but hold its store until store_deferred: a fence issued in between then waits
        for the eviction only, not for the store's DMA (TP8's phase 2: the fence cost TensorE 2.1 us, now the
        barrier's 1.3)."""
        self.defer = True

    def store_deferred(self) -> None:
        """Issue the store held by defer_next_store, if any."""
        if self.deferred != None:  # noqa: E711
            m0, msz, n0, nsz, res = self.deferred
            self.deferred = None
            nisa.dma_copy(dst=self.out_hbm[m0:m0 + msz, n0:n0 + nsz], src=res[:msz, :nsz])

    def store_streamed(self, m0, msz, n0, nsz, acc, engine) -> None:
        """Eviction of a K-streamed group's tile (one SBUF tile each, on `engine`)."""
        res = nl.ndarray((PARTITIONS, STREAM_N_TILE), dtype=self.out_dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=res[:msz, :nsz], src=acc[:msz, :nsz], engine=engine)
        nisa.dma_copy(dst=self.out_hbm[m0:m0 + msz, n0:n0 + nsz], src=res[:msz, :nsz])

    def finish(self) -> None:
        self.results = None

    def held_bytes(self, n_tile) -> int:
        return RESULT_BUFFERS * n_tile * self.out_dtype.itemsize
