"""A plan's last output tile in column pieces: each piece's matmuls, then its eviction and store, so that the store of
one piece runs under the next piece's matmuls and only the last (smallest) piece's eviction and store follow the
kernel's last matmul (MatmulPlan.piece_last_tile: the kernel's last plan, PhaseGraph.run)."""
from __future__ import annotations

from ..kernel_helpers import kernel_assert
from .constants import LAST_TILE_COLUMN_SHARES
from .panels import matmul_panels, panel_columns


def last_tile_piece_widths(nsz: int) -> list:
    """Column widths of the pieces of an nsz-column tile, in LAST_TILE_COLUMN_SHARES (the last piece takes the
    remainder), e.g. 1536 -> [768, 512, 256]."""
    total = sum(LAST_TILE_COLUMN_SHARES)
    kernel_assert(nsz >= total, f"a pieced tile needs at least {total} columns, got nsz={nsz}")
    widths = [nsz * share // total for share in LAST_TILE_COLUMN_SHARES[:-1]]
    return widths + [nsz - sum(widths)]


def matmul_last_tile_by_columns(plan, i: int, k: int) -> None:
    """Tile i of `plan` (one product, no K-chunk reload) into accumulator k piece by piece, each piece handed to
    plan.epilogue.tile_columns once its K tiles are summed. Bit-exact with the whole tile: every output column
    sums the same K tiles in the same order (a column's sum does not depend on the columns beside it).

    Dimensions:
        stationary panel [K, m tile]; moving panel [K, n block] read as column windows [K, width].
    """
    kernel_assert(len(plan.products) == 1, f"a pieced tile has one product, got {len(plan.products)}")
    (m0, msz), (n0, nsz) = plan.order[i]
    s, m = plan.products[0]
    a = plan.stationary[s].get(m0, msz)
    b = plan.moving[m].get(n0, nsz)
    psum = plan.accumulators[0][k]
    c0 = 0
    for width in last_tile_piece_widths(nsz):
        # K=op K, M=m tile, N=width columns of the n block
        matmul_panels(psum[:a.f_pad, c0:c0 + width], a, panel_columns(b, c0, width), plan.setup)
        plan.epilogue.tile_columns(i, m0, msz, n0, c0, width, psum)
        c0 += width
