"""Pass B of one expert issued in pieces between pass A's chunks of another (docs/moe.md section 10, round 8a).

Engine queues run in program order and every pass is its own run-time loop, so pass B(e), issued after pass A of the
next group's expert a, waited on TensorE for A's last chunk, while A (gathers, the SwiGLU epilogue on GpSimd, ScalarE
and VectorE) left TensorE ~70% idle. Here the segment's A(a) and B(e) share A's loop bodies (its chunk pipeline,
compute_phase1_pipelined_mxfp8): with each of A's 128-row chunks comes a piece of B(e), pass B's chunks of one block of
e (the block a register loaded from an SBUF counter), issued after that A chunk's dI matmuls and before its stores.

Pass A runs len(ctx.unit_rows) chunks per block and core, pass B B / 128 chunks per block (every core all rows, its H
columns): A's chunk q of any block runs B's chunks [q·s, (q + 1)·s), s = (B / 128) / len(unit_rows), of the counter's
block, and the counter moves on after A's last chunk of the block. Each piece runs in a 0/1-trip loop
[next, min(next + 1, end)), so an expert e with fewer blocks than a runs out; the rest of e's blocks (more blocks than
a, or an a without blocks) run after A(a) in one loop from the counter (finish). Blocks go in ascending order, each
block's chunks in order, and B(e) completes before B(e + 1) is issued: per token the dX adds keep the reference's
ascending expert order, and every chunk is pass B's resident chunk path (a chunk past the block's last routed pair
skipped by the same row flags), so the bits are pass B's. The counter and bounds are SBUF values derived from
expert_block_offsets on VectorE, the same on both cores (identical trip counts under LNC2).
"""
from __future__ import annotations

import nki.isa as nisa
import nki.language as nl

from ...core.kernel_helpers import kernel_assert
from ...core.matmul.sources import blocks as _blocks
from .constants import PARTITIONS

__all__ = ["InterleavedDx"]


def _register(tile):
    """A register holding the value of a one-element int32 SBUF tile."""
    reg = nisa.register_alloc()
    nisa.register_load(reg, tile)
    return reg


class InterleavedDx(nl.NKIObject):
    """Pass B of expert e (resident W_gu panels, this core's H tiles) as pieces for pass A's chunk pipeline.

    Dimensions: counter `next` and piece end [1, 1] int32 (SBUF): e's next block and min(next + 1, offsets[e + 1]).
    """

    def __init__(self, ctx, e, w_gu, block_dx):
        """block_dx: moe_bwd_mxfp8_dx.compute_phase2_hidden_states_grad_mxfp8, passed by the base kernel from its module
        globals (so that a tool wrapping the kernel module's phase functions, the cost report's labels, sees B's
        pieces as pass B)."""
        self.ctx, self.e, self.w_gu, self.block_dx = ctx, e, w_gu, block_dx
        b_chunks, a_chunks = len(_blocks(0, ctx.B, PARTITIONS)), len(ctx.unit_rows)
        kernel_assert(b_chunks % a_chunks == 0,
                      f"pass B's {b_chunks} chunks per block must split evenly over pass A's {a_chunks}")
        self.a_chunks, self.per_piece = a_chunks, b_chunks // a_chunks
        offs = ctx.loops.offs
        self.end = offs[:, e + 1:e + 2]
        self.next = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=self.next, data=offs[:, e:e + 1], op0=nl.add, operand0=0.0)
        self.piece_end = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)

    def piece(self, q):
        """B's chunks of pass A's chunk q (static) in the counter's block, if e has one left; after A's last chunk of
        a block the counter moves on (integers < 2^24: exact in VectorE's fp32 arithmetic)."""
        ctx = self.ctx
        if q == 0:
            nisa.tensor_scalar(dst=self.piece_end, data=self.next, op0=nl.add, operand0=1.0)
            nisa.tensor_tensor(dst=self.piece_end, data1=self.piece_end, data2=self.end, op=nl.minimum)
        chunks = range(q * self.per_piece, (q + 1) * self.per_piece)
        nl.fori_loop(_register(self.next), _register(self.piece_end),
                     lambda i: self.block_dx(ctx, self.e, i, self.w_gu, skip_padding=True, only_chunks=chunks))
        if q == self.a_chunks - 1:
            nisa.tensor_scalar(dst=self.next, data=self.piece_end, op0=nl.add, operand0=0.0)

    def finish(self):
        """e's blocks the pieces did not reach, [next, offsets[e + 1]) (after A(a))."""
        nl.fori_loop(_register(self.next), _register(self.end),
                     lambda i: self.block_dx(self.ctx, self.e, i, self.w_gu, skip_padding=True))
