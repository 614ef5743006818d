"""KTileExchange: the two cores of an LNC2 pair quantize half of an MXFP8 panel each and swap the halves on chip
(nisa.sendrecv), instead of both loading and quantizing all of it (PanelLoad's `exchange`).

Core r loads and quantizes columns [r F/2, (r + 1) F/2) of every K tile (MX groups run along K, never across columns:
a column half's words and scales are those of the whole K tile's quantize, bit for bit). After each K tile it sends
that K tile's words in its half into the other core's words tile and receives the other half into its own (one
sendrecv); after each scale tile's last K tile (a quad with scale packing, else every K tile) it swaps the scale tile's
halves the same way: all 128 rows of its columns, each of them written by this core's own quantizes (rows a quantize
does not write are never read). Both cores keep the panel in the same SBUF allocations as without the exchange.
https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/api/generated/nki.isa.sendrecv.html
"""
from __future__ import annotations

import nki.isa as nisa
import nki.language as nl

from ..kernel_helpers import kernel_assert
from .constants import EXCHANGE_PIPE_ID, EXCHANGE_WORDS_BY_SCALE_TILE, MX_PACK, SCALE_PACK_SLOTS


class KTileExchange(nl.NKIObject):
    """The column-half exchange of one panel load of f_pad columns on core `rank` of an LNC2 pair (module docstring)."""

    def __init__(self, rank: int, f_pad: int):
        kernel_assert(rank == 0 or rank == 1, f"KTileExchange: an LNC2 core's rank is 0 or 1, got {rank}")
        kernel_assert(f_pad % 2 == 0, f"KTileExchange: the panel's columns split in two halves, got f_pad={f_pad}")
        self.rank = rank
        self.half = f_pad // 2
        self.lo = rank * self.half  # this core's columns [lo, lo + half)
        self.peer_lo = (1 - rank) * self.half

    def quantize(self, builder, t: int, padded: int, src, scratch: bool) -> None:
        """Quantize this core's half of K tile t from stage view `src` [P, half, 4], then swap the halves."""
        builder.quantize_mx_tile(t, padded, src, scratch, self.lo, self.lo + self.half)
        P = padded // MX_PACK
        other = 1 - self.rank
        packing = builder.setup.use_scale_packing
        i = t - builder.t_lo
        last = not packing or i % SCALE_PACK_SLOTS == SCALE_PACK_SLOTS - 1 or i == builder.count - 1
        first = t - i % SCALE_PACK_SLOTS if packing else t
        span = builder.words_span(first, t + 1, P) if EXCHANGE_WORDS_BY_SCALE_TILE and last else None
        if span != None:  # noqa: E711  the scale tile's K tiles' words in one sendrecv
            nisa.sendrecv(src=span[:, :, self.lo:self.lo + self.half],
                          dst=span[:, :, self.peer_lo:self.peer_lo + self.half], send_to_rank=other,
                          recv_from_rank=other, pipe_id=EXCHANGE_PIPE_ID)
        elif not EXCHANGE_WORDS_BY_SCALE_TILE or builder.words_span(first, first + SCALE_PACK_SLOTS, P) == None:  # noqa: E711
            words = builder.words(t, P, quantized=True)
            nisa.sendrecv(src=words[:, self.lo:self.lo + self.half],
                          dst=words[:, self.peer_lo:self.peer_lo + self.half], send_to_rank=other,
                          recv_from_rank=other, pipe_id=EXCHANGE_PIPE_ID)
        if last:
            scale = builder.scale(first)  # slot 0's view: every row of the tile
            nisa.sendrecv(src=scale[:, self.lo:self.lo + self.half],
                          dst=scale[:, self.peer_lo:self.peer_lo + self.half], send_to_rank=other,
                          recv_from_rank=other, pipe_id=EXCHANGE_PIPE_ID)

    def collect(self, builder, tiles, t_lo: int, t_hi: int) -> None:
        """Append every K tile's words and scales to `builder` in K order (the half quantizes appended nothing)."""
        for t in range(t_lo, t_hi):
            builder.data.append(builder.words(t, tiles[t][2] // MX_PACK, quantized=True))
            builder.scales.append(builder.scale(t))
