"""PanelPlacement: where load_panel puts an MXFP8 panel's K tiles (nkilib/core/matmul/panel_builder.py).

What is checked is which SBUF allocation each K tile's quantize_mx writes its words and scales to, on a tiny
[K = 2048, F = 64] panel (four K tiles) through the simulator. Bit-exactness of the kernels that use each placement
is covered by tests/kernels.
"""

import nki.language as nl
import numpy as np
import pytest
from nkilib.core.matmul import MatmulSetup, PanelPlacement, TensorDescriptor, load_panel
from nkilib.core.matmul import panel_builder
from nkilib.core.matmul.panels import PanelGroupBlock
from nkilib.core.numerics import contract_mm
from nkilib.simulator.launcher import run_kernel
from simkit import BF16, assert_outputs_identical, matmul_panels_to_hbm, randn

MX = MatmulSetup("mxfp8", nl.float8_e4m3fn_x4, "1x32", True)
K, F = 2048, 64  # four MXFP8 K tiles of [128, 64] x4 words: 256 bytes per partition each


def _quantize_destinations(make_placement):
    """(words storage ids, scale storage ids) of the panel's quantize_mx, one per K tile in K order, and the Panel."""
    got = {}

    def kernel(a):
        got["panel"] = load_panel(TensorDescriptor(a, k_axis=0), 0, F, F, MX, placement=make_placement())

    res = run_kernel(kernel, args=(randn(0, (K, F), BF16),), trace=True)
    quantizes = [r for r in res.trace if r.instr == "quantize_mx"]
    words = [r.writes[0].storage_id for r in quantizes]
    scales = [r.writes[1].storage_id for r in quantizes]
    return words, scales, got["panel"]


def test_whole_places_the_panel_in_one_words_and_one_scale_allocation():
    words, scales, panel = _quantize_destinations(PanelPlacement.whole)
    assert len(words) == 4 and len(set(words)) == 1 and len(set(scales)) == 1
    assert panel.words_tile is not None and panel.scale_tile is not None  # store_panel_tiles can copy it


def test_per_k_tile_allocates_one_words_tile_per_k_tile_and_one_scale_tile_per_quad():
    words, scales, panel = _quantize_destinations(PanelPlacement.per_k_tile)
    assert len(set(words)) == 4  # one words tile per K tile
    assert len(set(scales)) == 1  # scale packing: four K tiles share one scale tile
    assert panel.words_tile is None and panel.scale_tile is None


def test_pieces_group_k_tiles_into_allocations_of_the_piece_size(monkeypatch):
    """Above MX_PANEL_WHOLE_MAX_BYTES the words go in pieces of MX_PANEL_PIECE_BYTES (whole K tiles each);
    scaled down here (1 KiB of words > 512 bytes: pieces of 512 bytes, two K tiles) to keep the panel tiny."""
    monkeypatch.setattr(panel_builder, "MX_PANEL_WHOLE_MAX_BYTES", 512)
    monkeypatch.setattr(panel_builder, "MX_PANEL_PIECE_BYTES", 512)
    words, scales, panel = _quantize_destinations(PanelPlacement.pieces)
    assert words[0] == words[1] and words[2] == words[3] and words[0] != words[2]
    assert len(set(scales)) == 1
    monkeypatch.setattr(panel_builder, "MX_PANEL_WHOLE_MAX_BYTES", 1024)  # 1 KiB fits: one allocation
    words, _, _ = _quantize_destinations(PanelPlacement.pieces)
    assert len(set(words)) == 1


def test_into_writes_the_callers_allocation():
    block = {}

    def make():
        block["b"] = PanelGroupBlock(2, K, F, MX)
        words, scales = block["b"].slot(1, F)
        return PanelPlacement.into(words, scales)

    words, scales, _ = _quantize_destinations(make)
    assert set(words) == {block["b"].words.storage.id} and set(scales) == {block["b"].scales.storage.id}


def test_into_refuses_a_bf16_setup():
    bf16 = MatmulSetup("bf16", nl.float8_e4m3fn_x4, "1x32", True)

    def kernel(a):
        load_panel(TensorDescriptor(a, k_axis=0), 0, F, F, bf16, placement=PanelPlacement.into(None, None))

    with pytest.raises(Exception, match="MXFP8"):
        run_kernel(kernel, args=(randn(0, (K, F), BF16),))


def _column_pieces_inputs():
    """(a [K=1024, M=64], b [K, N=128]) bf16, b's columns [64, 128) scaled by 1024 so that the pieces' MX groups take
    other scales than the first columns'."""
    b = randn(32, (1024, 128), BF16)
    b[:, 64:] *= 1024
    return randn(31, (1024, 64), BF16), b


def _column_pieces_run(quantize_columns):
    """(out [M=64, N=128], trace) of _column_pieces_inputs' stationary panel a times its moving panel b, whose two K
    tiles are quantized in `quantize_columns` column pieces (load_panel)."""
    def kernel(a, b):
        stationary = load_panel(TensorDescriptor(a, k_axis=0), 0, 64, 64, MX)
        moving = load_panel(TensorDescriptor(b, k_axis=0), 0, 128, 128, MX, quantize_columns=quantize_columns)
        return matmul_panels_to_hbm(stationary, moving, MX, 64, 128)  # K=1024, M=64, N=128

    res = run_kernel(kernel, args=_column_pieces_inputs(), trace=True)
    return np.asarray(res.outputs[0] if isinstance(res.outputs, tuple) else res.outputs), res.trace


def test_quantize_columns_quantizes_each_k_tile_in_column_pieces_with_the_same_bits():
    """load_panel(quantize_columns=2) (PanelBuilder.quantize_columns; MatmulPlan.piece_first_span): each K tile of
    the moving panel is quantized in two column pieces, [0, 64) then [64, 128) of its words and scales, and the
    product is bit-identical to the whole-tile quantize's (MX groups run along K, never across columns); a piece that
    read or wrote the wrong columns changes the product. The stationary panel stays whole."""
    got, trace = _column_pieces_run(2)
    want, trace_whole = _column_pieces_run(1)
    assert_outputs_identical((got,), (want,), "quantize_columns=2 vs 1")
    a, b = _column_pieces_inputs()
    assert_outputs_identical((got,), (contract_mm(a.T, b, "mxfp8", "float8_e4m3fn", "1x32"),), "vs contract_mm")

    def moving_quantizes(records):  # (columns written, first column in its K tile) of the moving panel's quantize_mx
        q = [r.writes[0] for r in records if r.instr == "quantize_mx"]
        assert [w.shape[1] for w in q[:2]] == [64, 64]  # the stationary panel's two K tiles, whole
        return [(w.shape[1], w.byte_lo // 4 % 128) for w in q[2:]]  # words [128, 2, 128] x4: 4 bytes a column

    assert moving_quantizes(trace_whole) == [(128, 0)] * 2
    assert moving_quantizes(trace) == [(64, 0), (64, 64)] * 2
