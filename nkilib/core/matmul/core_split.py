"""CoreSplit: the LNC split of one kernel launch, decided once per kernel and given to every plan."""
from __future__ import annotations

import nki.language as nl

from ..kernel_helpers import ceil_div, shard_range
from .constants import SPLIT_ALIGN


class CoreSplit(nl.NKIObject):
    """The LNC split of one kernel launch (num_cores programs; this one is shard_id), decided once.

    ranges() gives each core near-equal contiguous halves (in multiples of SPLIT_ALIGN) of the larger
    output dimension when it has at least SPLIT_ALIGN per core, else of the other: out[M, N] = a[M, K] @
    b[K, N] split along M reads a/2 + b per core, along N a + b/2, so splitting the larger one minimises
    the operand bytes a core reads.
    """

    def __init__(self, num_cores: int, shard_id: int):
        self.num_cores = num_cores
        self.shard_id = shard_id

    def ranges(self, m_total: int, n_total: int, prefer_m: bool = False):
        """This core's ([m_lo, m_hi), [n_lo, n_hi)) of an [M, N] output. prefer_m: split M whenever it has
        SPLIT_ALIGN rows per core (e.g. a stationary operand transposed on the PE array: halving it halves
        the transposes and lets the half stay resident)."""
        if self.num_cores == 1:
            return (0, m_total), (0, n_total)
        enough = SPLIT_ALIGN * self.num_cores
        split_m = ((m_total >= n_total or prefer_m) and m_total >= enough) or n_total < enough
        axis_total = m_total if split_m else n_total
        lo, hi = shard_range(ceil_div(axis_total, SPLIT_ALIGN), self.num_cores, self.shard_id)
        lo, hi = min(lo * SPLIT_ALIGN, axis_total), min(hi * SPLIT_ALIGN, axis_total)
        return ((lo, hi), (0, n_total)) if split_m else ((0, m_total), (lo, hi))


    def whole_row_blocks(self, m_total: int, n_total: int, block: int) -> bool:
        """Whether every core's part of ranges(m_total, n_total, prefer_m=True) is whole `block`-row blocks
        with all n_total columns (checked for every core: a later phase may read all cores' parts)."""
        if m_total % block:
            return False
        for core in range(self.num_cores):
            (lo, hi), cols = CoreSplit(self.num_cores, core).ranges(m_total, n_total, prefer_m=True)
            if cols != (0, n_total) or lo % block or hi % block:
                return False
        return True
