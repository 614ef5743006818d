"""nkilib.core.matmul: K windows of a descriptor (TensorDescriptor.k_base / k_len) and panels whose K rows the
caller fetches (panel_from_row_loader; here by indirect-DMA gather, as the MoE kernel does). Expected values:
the NumPy contract matmul nkilib.core.numerics.contract_mm of the selected / gathered rows."""
import numpy as np
import pytest

import nki
import nki.isa as nisa
import nki.language as nl
from nkilib.core.matmul import MatmulSetup, TensorDescriptor, load_panel, panel_from_row_loader
from nkilib.core.numerics import contract_mm
from simkit import BF16, assert_outputs_identical, matmul_panels_to_hbm, randn, simulate


@nki.jit
def _gathered_matmul_kernel(a, b, idx, precision, scheme):
    """out [M, N] = a[idx]ᵀ @ b[k_base: k_base + K] with a [R, M] rows gathered by idx [K] (an index >= R is a
    zero row) and b a K window of a stacked [2K, N] operand (k_base = K)."""
    R, M = a.shape
    K, N = idx.shape[0], b.shape[1]
    setup = MatmulSetup(precision, nl.float8_e4m3fn_x4, scheme, True)

    def load_rows(dst, first, step, count):
        ids = nl.ndarray((count, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=ids, src=idx.ap([[step, count], [1, 1]], offset=first))
        view = a.ap([[M, count], [1, M]], offset=0, vector_offset=ids, indirect_dim=0)
        nisa.dma_copy(dst=dst, src=view, oob_mode=nisa.oob_mode.skip)

    stationary = panel_from_row_loader(load_rows, K, M, M, setup, zero_fill=True)
    moving = load_panel(TensorDescriptor(b, k_axis=0, k_base=K, k_len=K), 0, N, N, setup)
    return matmul_panels_to_hbm(stationary, moving, setup, M, N)  # K=K, M=M, N=N


@pytest.mark.parametrize("precision, scheme", [("mxfp8", "1x32"), ("mxfp8", "wrapX"), ("bf16", "1x32")])
def test_gathered_rows_and_k_window(precision, scheme):
    R, M, K, N = 50, 64, 256, 96
    a, b = randn(1, (R, M), BF16), randn(2, (2 * K, N), BF16)
    idx = np.random.default_rng(3).integers(0, R + 10, K).astype(np.int32)  # some sentinels >= R
    got = simulate(_gathered_matmul_kernel, 1, a=a, b=b, idx=idx, precision=precision, scheme=scheme)
    rows = np.where((idx < R)[:, None], a[np.minimum(idx, R - 1)], np.zeros((), BF16)).astype(BF16)
    want = contract_mm(rows.T, b[K:], precision, "float8_e4m3fn", scheme)
    assert_outputs_identical((got,), (want,), f"{precision} {scheme}")
