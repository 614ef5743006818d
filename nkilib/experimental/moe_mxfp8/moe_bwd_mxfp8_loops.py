"""Run-time loop bounds of the MoE expert backward kernel (moe_bwd_mxfp8_kernel.py): every expert's block range and the
0/1-trip loops that are the kernel's run-time "if" (an expert without tokens runs none of its passes), derived once
on VectorE from expert_block_offsets (docs/moe.md section 3)."""
from __future__ import annotations

import nki.isa as nisa
import nki.language as nl

__all__ = ["ExpertLoops"]


class ExpertLoops(nl.NKIObject):
    """Run-time loop bounds of every expert, derived once from expert_block_offsets on chip.

    Dimensions:
        offsets [E+1] int32 (HBM) -> SBUF [1, E+1]; first [1, E] = min(offsets[e] + 1, offsets[e+1]) (end of
        the expert's first block, or its start when it has none); used [1, E] = min(blocks_e, 1);
        unused [1, E] = 1 - used; multi [1, E] = min(max(blocks_e - 1, 0), 1); single = used - multi;
        single_end = offsets[e] + single; last [1, E] = offsets[e+1] - used (start of the expert's last block,
        the only one that can hold padding); before_last [1, E] = max(last - 1, offsets[e]).
    The registers are loaded from these tiles where a loop needs them (register_load of a one-element SBUF
    slice): a 0/1-trip fori_loop is the kernel's run-time "if" (an expert without tokens skips its weight
    loads), and the peeled first block lets pass C overwrite PSUM before it accumulates. Integer values
    < 2^24, exact in VectorE's fp32 arithmetic.
    """

    def __init__(self, offsets, E):
        self.E = E
        offs = nl.ndarray((1, E + 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=offs, src=offsets.reshape((1, E + 1)))
        self.offs = offs
        self.first = nl.ndarray((1, E), dtype=nl.int32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=self.first, data=offs[:, 0:E], op0=nl.add, operand0=1.0)
        nisa.tensor_tensor(dst=self.first, data1=self.first, data2=offs[:, 1:E + 1], op=nl.minimum)
        self.used = nl.ndarray((1, E), dtype=nl.int32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=self.used, data1=offs[:, 1:E + 1], data2=offs[:, 0:E], op=nl.subtract)
        nisa.tensor_scalar(dst=self.used, data=self.used, op0=nl.minimum, operand0=1.0)
        self.unused = nl.ndarray((1, E), dtype=nl.int32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=self.unused, data=self.used, op0=nl.multiply, operand0=-1.0, op1=nl.add,
                           operand1=1.0)
        # multi = min(max(blocks_e - 1, 0), 1) (two or more blocks), single = used - multi (exactly one)
        self.multi = nl.ndarray((1, E), dtype=nl.int32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=self.multi, data1=offs[:, 1:E + 1], data2=offs[:, 0:E], op=nl.subtract)
        nisa.tensor_scalar(dst=self.multi, data=self.multi, op0=nl.add, operand0=-1.0, op1=nl.maximum,
                           operand1=0.0)
        nisa.tensor_scalar(dst=self.multi, data=self.multi, op0=nl.minimum, operand0=1.0)
        self.single = nl.ndarray((1, E), dtype=nl.int32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=self.single, data1=self.used, data2=self.multi, op=nl.subtract)
        self.single_end = nl.ndarray((1, E), dtype=nl.int32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=self.single_end, data1=offs[:, 0:E], data2=self.single, op=nl.add)
        self.last = nl.ndarray((1, E), dtype=nl.int32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=self.last, data1=offs[:, 1:E + 1], data2=self.used, op=nl.subtract)
        # max(last - 1, offsets[e]): the block before the last one, or the expert's start when it has one block or none
        self.before_last = nl.ndarray((1, E), dtype=nl.int32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=self.before_last, data=self.last, op0=nl.add, operand0=-1.0)
        nisa.tensor_tensor(dst=self.before_last, data1=self.before_last, data2=offs[:, 0:E], op=nl.maximum)

    @staticmethod
    def _reg(tile, e):
        r = nisa.register_alloc()
        nisa.register_load(r, tile[0:1, e:e + 1])
        return r

    def bounds(self, e):
        """Registers (lo, first, hi): expert e's blocks are [lo, hi), its first block [lo, first)."""
        return self._reg(self.offs, e), self._reg(self.first, e), self._reg(self.offs, e + 1)

    def last_block(self, e):
        """Register with the start of expert e's last block ([last, hi): at most one block)."""
        return self._reg(self.last, e)

    def before_last_block(self, e):
        """Register with max(last - 1, offsets[e]): [before_last, last) is the block before the last, if any."""
        return self._reg(self.before_last, e)

    def if_used(self, e, body):
        """body() once when expert e has blocks, else never (a 0/1-trip run-time loop)."""
        nl.fori_loop(0, self._reg(self.used, e), lambda _: body())

    def if_unused(self, e, body):
        """body() once when expert e has no blocks."""
        nl.fori_loop(0, self._reg(self.unused, e), lambda _: body())

    def if_single(self, e, body):
        """body(i) once, i = the register of expert e's block, when it has exactly one block
        (loop [offsets[e], offsets[e] + single))."""
        nl.fori_loop(self._reg(self.offs, e), self._reg(self.single_end, e), body)

    def unused_blocks(self, num_blocks, body):
        """body(i) for every block i in [offsets[E], num_blocks): the blocks no expert owns (N, the layout's capacity,
        is static; the used count is data)."""
        nl.fori_loop(self._reg(self.offs, self.E), num_blocks, body)

    def if_multi(self, e, body):
        """body() once when expert e has two or more blocks."""
        nl.fori_loop(0, self._reg(self.multi, e), lambda _: body())
