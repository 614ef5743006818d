"""The panel layout's HBM tensors and stores (panels.panel_layout_hbm, panels.store_k_tile; TensorDescriptor
panel_layout).

A [K, F] operand in the panel layout keeps K tile t's partition p in row 128t + p of its x4 words, so a last partial K
tile (K = 832: 320 rows, padded to the MX alignment of 128 rows, on P = 96 partitions) still starts at row 128t: the
tensors hold K in whole 512-row tiles (round 25b, docs/moe.md). store_k_tile stores whole 32-partition quadrants only
(quantize_mx's scales sit in rows 32q + r of each quadrant). Bit-exactness of the kernels that store and load the
layout is covered by tests/kernels/test_moe_down_exchange.py and test_mlp_bwd_dgu_along_s.py.
"""
from __future__ import annotations

import pytest

import nki.language as nl
from nkilib.core.matmul import MatmulSetup, panel_layout_hbm, store_k_tile
from simkit import in_kernel

MX = MatmulSetup("mxfp8", nl.float8_e4m3fn_x4, "1x32", True)
MX_UNPACKED = MatmulSetup("mxfp8", nl.float8_e4m3fn_x4, "1x32", False)


@pytest.mark.parametrize("k_size, setup, words_rows, scale_rows", [
    (1024, MX, 256, 128),  # two whole K tiles, one packed scale tile
    (832, MX, 256, 128),  # 512 + 320 rows: the partial tile keeps a whole tile's 128 word rows
    (832, MX_UNPACKED, 256, 256),  # a scale tile per K tile without packing
    (2880, MX, 768, 256),  # GPT-OSS-20B's H: five whole K tiles and one of 320 rows, two packed scale tiles
])
def test_panel_layout_hbm_holds_whole_k_tiles(k_size, setup, words_rows, scale_rows):
    """Words [Kt/4, F] with Kt = K rounded up to whole 512-row K tiles (K / 4 = 208 rows for K = 832 before round 25b:
    fails there), scales [128 * scale tiles, F]."""
    words, scales = in_kernel(lambda: panel_layout_hbm(k_size, 64, setup, "w"))
    assert tuple(words.shape) == (words_rows, 64), words.shape
    assert tuple(scales.shape) == (scale_rows, 64), scales.shape


@pytest.mark.parametrize("P", [80, 100])
def test_store_k_tile_takes_whole_quadrants(P):
    """A K tile on P partitions that are not whole 32-partition quadrants is refused, with P in the message."""
    def body():
        words_hbm, scales_hbm = panel_layout_hbm(832, 64, MX, "w")
        words = nl.ndarray((P, 64), dtype=MX.x4_dtype, buffer=nl.sbuf)
        scale = nl.ndarray((128, 64), dtype=nl.uint8, buffer=nl.sbuf)
        store_k_tile(words, scale, words_hbm, scales_hbm, 1, MX)

    with pytest.raises(AssertionError, match=f"store_k_tile takes whole 32-partition quadrants, got P={P}"):
        in_kernel(body)
