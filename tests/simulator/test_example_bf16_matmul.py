"""Numerics of the BF16 tiled matmul example kernel (nkilib/examples/bf16_matmul.py) vs numpy."""
import numpy as np
import pytest

from simkit import BF16, randn, simulate
from nkilib.examples.bf16_matmul import bf16_matmul


def _reference(a, b):
    """fp32 product of the bf16 inputs, rounded to bf16 like the kernel's output."""
    return (a.astype(np.float32) @ b.astype(np.float32)).astype(BF16).astype(np.float32)


# partial tiles on every axis (M 200 = 128 + 72, K 300 = 2x128 + 44, N 700 = 512 + 188) and
# more than one M tile per program under LNC2 (M 520 -> 5 M tiles)
@pytest.mark.parametrize("M,K,N", [(200, 300, 700), (520, 128, 2100), (64, 96, 40)])
@pytest.mark.parametrize("lnc", [1, 2])
def test_bf16_matmul_km_layout(M, K, N, lnc):
    a = randn(10 + M, (M, K), BF16)
    b = randn(20 + N, (K, N), BF16)
    out = simulate(bf16_matmul, lnc=lnc, a=np.ascontiguousarray(a.T), b=b)
    assert out.shape == (M, N) and out.dtype == BF16
    ref = _reference(a, b)
    # fp32 accumulation in a different order than numpy, then one bf16 rounding: within 1 bf16 ulp
    np.testing.assert_allclose(out.astype(np.float32), ref, rtol=2 ** -7, atol=1e-3 * np.abs(ref).max())


@pytest.mark.parametrize("lnc", [1, 2])
def test_bf16_matmul_mk_layout_uses_dma_transpose(lnc):
    M, K, N = 200, 300, 600
    a = randn(3, (M, K), BF16)
    b = randn(4, (K, N), BF16)
    out = simulate(bf16_matmul, lnc=lnc, a=a, b=b, a_layout="mk")
    ref = _reference(a, b)
    np.testing.assert_allclose(out.astype(np.float32), ref, rtol=2 ** -7, atol=1e-3 * np.abs(ref).max())


def test_bf16_matmul_rejects_mismatched_k():
    with pytest.raises(ValueError, match="contraction sizes differ"):
        simulate(bf16_matmul, a=randn(1, (128, 64), BF16), b=randn(2, (96, 64), BF16))
