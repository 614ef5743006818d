"""LNC2's shares of pass C's two weight gradients, dW_gu [2I, H] and dW_down [H, I] (docs/moe.md section 10, round 41a).

CoreSplit.ranges splits each gradient along its larger dimension in SPLIT_ALIGN units, the first core taking the extra
unit. A core's TensorE work per block is its 128-row m tiles times its N columns (a matmul's time is its moving
columns, whatever its M up to 128), so where both gradients leave core 0 an extra m tile (GPT-OSS-20B, H = I = 2880:
23 + 12 of dW_gu's 45 and dW_down's 23 tiles against 22 + 11) core 1 reaches every fence that much earlier. There
dW_down's shares go to the cores in reverse order (core c takes CoreSplit's share of core P - 1 - c): 34 + 34.
The shares stay CoreSplit's (only their owners change), so every loop count decided on CoreSplit's core 0 (the larger
share) still bounds both cores, and each output element still has one writer.
"""
from __future__ import annotations

from ...core.matmul import CoreSplit
from ...core.matmul.sources import blocks
from .constants import PARTITIONS

__all__ = ["down_grad_reversed", "grad_split"]


def _tensor_work(split, m_total, n_total):
    """The m tiles x N columns of `split`'s share of an [m_total, n_total] weight gradient."""
    (m_lo, m_hi), (n_lo, n_hi) = split.ranges(m_total, n_total)
    return len(blocks(m_lo, m_hi, PARTITIONS)) * (n_hi - n_lo)


def down_grad_reversed(num_cores, H, I) -> bool:
    """Whether dW_down's shares go to the cores in reverse order: where that lowers the busiest core's work of the two
    gradients together."""
    if num_cores == 1:
        return False
    gu = [_tensor_work(CoreSplit(num_cores, c), 2 * I, H) for c in range(num_cores)]
    down = [_tensor_work(CoreSplit(num_cores, c), H, I) for c in range(num_cores)]
    return max(g + d for g, d in zip(gu, reversed(down))) < max(g + d for g, d in zip(gu, down))


def grad_split(ctx, m_total, n_total):
    """This core's CoreSplit of pass C's [m_total, n_total] gradient: ctx.split, or for dW_down ([H, I]; dW_gu is
    [2I, H], never that shape) core P - 1 - c's where down_grad_reversed."""
    split = ctx.split
    if (m_total, n_total) == (ctx.H, ctx.I) and down_grad_reversed(split.num_cores, ctx.H, ctx.I):
        return CoreSplit(split.num_cores, split.num_cores - 1 - split.shard_id)
    return split
