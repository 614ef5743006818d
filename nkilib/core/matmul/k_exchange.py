"""KTileExchange: the two cores of an LNC2 pair quantize half of an MXFP8 panel's K tiles each and swap the words and
scales on chip (nisa.sendrecv), instead of both loading and quantizing all of them (PanelLoad's `exchange`).

In each group of EXCHANGE_GROUP_K_TILES K tiles (two scale-tile quads), core r quantizes quad r and receives the other
quad: after its i-th own K tile it sends that K tile's words into the other core's place for it and receives the other
core's i-th K tile into its own place for that one (one sendrecv), and after its quad's last K tile it swaps the quad's
scale tiles the same way (a whole [128, F_pad] scale tile: the four K tiles' scale rows, nothing else the other core
keeps there). A K tile's words and scales depend only on its own bf16 values, so the panel is the one each core would
have quantized itself, bit for bit.
https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/api/generated/nki.isa.sendrecv.html
"""
from __future__ import annotations

import nki.isa as nisa
import nki.language as nl

from ..kernel_helpers import kernel_assert
from .constants import EXCHANGE_GROUP_K_TILES, EXCHANGE_PIPE_ID, MX_K_TILE, PARTITIONS
from .panel_builder import PanelPlacement


class KTileExchange(nl.NKIObject):
    """The K-tile exchange of one panel load on core `rank` of an LNC2 pair (see the module docstring)."""

    def __init__(self, rank: int):
        kernel_assert(rank == 0 or rank == 1, f"KTileExchange: an LNC2 core's rank is 0 or 1, got {rank}")
        self.rank = rank

    @staticmethod
    def applies(tiles, t_lo: int, t_hi: int, setup) -> bool:
        """Whether K tiles [t_lo, t_hi) of `tiles` (k_tiles') are an even number of full MXFP8 K tiles (every words
        and scale view of the same shape on both cores)."""
        if not setup.is_mx or (t_hi - t_lo) % 2 or t_hi <= t_lo:
            return False
        for t in range(t_lo, t_hi):
            if tiles[t][1] != MX_K_TILE or tiles[t][2] != MX_K_TILE:
                return False
        return True

    def placement(self, count: int, f_pad: int, setup) -> PanelPlacement:
        """One words tile [128, F_pad] and one scale tile [128, F_pad] per K tile (scales not packed: a packed scale
        tile's rows interleave four K tiles', two of them the other core's)."""
        words, scales = [], []
        for _ in range(count):
            words.append(nl.ndarray((PARTITIONS, f_pad), dtype=setup.x4_dtype, buffer=nl.sbuf))
            scales.append(nl.ndarray((PARTITIONS, f_pad), dtype=nl.uint8, buffer=nl.sbuf))
        return PanelPlacement.slots(words, scales)

    def own_tiles(self, t_lo: int, t_hi: int) -> list:
        """The K tiles this core quantizes, in order: every other one from t_lo + rank."""
        return list(range(t_lo + self.rank, t_hi, EXCHANGE_GROUP_K_TILES))

    def peer_tile(self, t: int) -> int:
        """The other core's K tile that this core receives in the sendrecv of its own K tile t."""
        return t + 1 - 2 * self.rank

    def swap(self, builder, t: int, P: int) -> None:
        """After own K tile t's quantize: its words and scales to the other core, the other core's K tile into their
        places here."""
        peer = self.peer_tile(t)
        other = 1 - self.rank
        nisa.sendrecv(src=builder.words(t, P, quantized=True), dst=builder.words(peer, P, quantized=True),
                      send_to_rank=other, recv_from_rank=other, pipe_id=EXCHANGE_PIPE_ID)
        nisa.sendrecv(src=builder.scale(t), dst=builder.scale(peer), send_to_rank=other, recv_from_rank=other,
                      pipe_id=EXCHANGE_PIPE_ID)

    def collect(self, builder, t_lo: int, t_hi: int, P: int) -> None:
        """Append every K tile's words and scales to `builder` in K order (its own quantizes appended nothing)."""
        for t in range(t_lo, t_hi):
            builder.data.append(builder.words(t, P, quantized=True))
            builder.scales.append(builder.scale(t))
