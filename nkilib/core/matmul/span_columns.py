"""A fenced start's first span in column pieces (MatmulPlan fenced_start, FENCED_COLUMN_PIECES): the first moving
panel's K tiles are quantized in equal column pieces (PanelBuilder quantize_columns) and the span multiplies each K
tile piece by piece, so TensorE starts on a K tile's first columns while VectorE still quantizes the others, and the
span's tiles are evicted piece by piece too (StoreEpilogue.tile_by_columns)."""
from __future__ import annotations

from .constants import FENCED_COLUMN_PIECES, FENCED_NEXT_WORDS_FROM_K_TILE
from .panels import matmul_panels, panel_columns, single_k_tile
from .sources import tile_spans


def piece_span_columns(plan) -> None:
    """MatmulPlan.piece_first_span: with a fenced start's first span (fenced_start, first_span > 1) whose n block
    FENCED_COLUMN_PIECES divides, the first moving panel's K tiles are quantized in that many column pieces and the
    span runs piece by piece (plan.span_columns); from K tile FENCED_NEXT_WORDS_FROM_K_TILE on, the last half of those
    pieces is quantized from a unit-stride copy (PanelBuilder.quantize_mx_tile next_words_as_source). Before the first
    tile's loads (the caller's phase function plans, this is set, then the plan runs). The span is the one run()
    takes (tile_spans): in an order whose second tile is on another moving panel (a grouped n-major plan of one m
    block per group) it is a single tile, and nothing changes."""
    if plan.fenced_start and plan.first_span > 1 and plan.done == 0 and \
            plan.order[0][1][1] % FENCED_COLUMN_PIECES == 0 and \
            tile_spans(plan.order, 0, len(plan.order), plan.switch_span, plan.first_span)[0][1] > 1:
        plan.span_columns = FENCED_COLUMN_PIECES
        for source in plan.moving:
            source.first_quantize_columns = FENCED_COLUMN_PIECES
            source.first_next_words_from = FENCED_NEXT_WORDS_FROM_K_TILE


def matmul_k_tile_by_columns(psums, a_panels, b, t: int, nsz: int, pieces: int, setup) -> None:
    """K tile t of every tile of a K-interleaved span (stationary a_panels[j] into psums[j]), column piece by column
    piece of the moving panel b: the pieces' matmuls of every tile, then the next piece's. Bit-exact with one matmul
    per tile: every output column sums the same K tiles in the same order (a column's sum does not depend on the
    columns beside it), and t == 0 starts each piece's columns.

    Dimensions:
        a_panels[j]: stationary panel [K, m tile]; b: moving panel [K, nsz] read as column windows [K, nsz / pieces].
    """
    width = nsz // pieces
    for c0 in range(0, nsz, width):
        for j in range(len(a_panels)):
            a = a_panels[j]
            # K=one K tile, M=m tile, N=width columns of the n block
            matmul_panels(psums[j][:a.f_pad, c0:c0 + width], single_k_tile(a, t),
                          panel_columns(single_k_tile(b, t), c0, width), setup, accumulate=t > 0)


def span_tile_epilogue(plan, j: int, accumulators, first_span: bool) -> None:
    """Tile j's epilogue: in plan.span_columns column pieces when it belongs to the plan's first span (first_span)
    and the epilogue can evict by columns (tile_by_columns, an optional part of the protocol), else epilogue.tile."""
    (m0, msz), (n0, nsz) = plan.order[j]
    if first_span and plan.span_columns > 1 and hasattr(plan.epilogue, "tile_by_columns"):
        plan.epilogue.tile_by_columns(j, m0, msz, n0, nsz, accumulators, plan.span_columns)
    else:
        plan.epilogue.tile(j, m0, msz, n0, nsz, accumulators)
