"""End-to-end MXFP8 matmul example (nkilib/examples/mxfp8_matmul.py) on the simulator.

Measured (seed 0, standard normal bf16 inputs, e4m3fn elements, "neuron" scale rule):
relative Frobenius error vs the fp32 matmul ~3.8e-2 for [256, 1024] x [1024, 512]
(two e4m3fn operands with 3 mantissa bits each); the bound asserted below is 5e-2.
Against the MX reference (nkilib.mx.mx_matmul of the same quantization) the result is
bit-identical in these runs; the asserted bound is the fp32-reassociation bound of the brief.
"""
import numpy as np
import pytest

from nkilib import mx
from nkilib.examples.mxfp8_matmul import errors, main, make_inputs, mxfp8_matmul_kernel, reference
from nkilib.simulator import run_kernel
from simkit import simulate


@pytest.mark.parametrize("M,K,N", [(256, 1024, 512), (128, 640, 640), (256, 384, 128)])
def test_mxfp8_matmul_matches_mx_reference_lnc1_lnc2(M, K, N):
    a, b = make_inputs(M, K, N, seed=M + K + N)
    out1 = simulate(mxfp8_matmul_kernel, lnc=1, a=a, b=b)
    out2 = simulate(mxfp8_matmul_kernel, lnc=2, a=a, b=b)
    ref = reference(a, b)
    assert out1.dtype == np.float32 and out1.shape == (M, N)
    bound = 1e-5 * np.abs(ref).max()
    assert np.abs(out1 - ref).max() <= bound
    # LNC2 computes every output tile with the same instruction sequence as LNC1
    np.testing.assert_array_equal(out1, out2)
    # close to the ideal fp32 matmul (MXFP8 quantization error, see module docstring)
    ideal = a.astype(np.float64) @ b.astype(np.float64)
    _, rel = errors(out1, ideal)
    assert rel < 5e-2, rel
    assert rel > 1e-3  # the inputs really went through fp8 (not a bf16 passthrough)


def test_quantization_is_1x32_along_k():
    """A group spike at logical k in [32, 64) only affects that group's scale: detectable in the result."""
    M, K, N = 128, 512, 128
    a, b = make_inputs(M, K, N, seed=3)
    a = a.copy()
    a[5, 40] = 2.0 ** 20  # group 1 (k 32..63) of row 5 gets a huge scale -> its other entries flush
    out = simulate(mxfp8_matmul_kernel, lnc=1, a=a, b=b)
    ref = reference(a, b)
    assert np.abs(out - ref).max() <= 1e-5 * np.abs(ref).max()
    # independently: quantizing with a wrong grouping (wrapX) gives a different row 5
    qa_w = mx.quantize_mx(a, axis=1, elem_format="float8_e4m3fn", scheme="wrapX", k_tile=512)
    qb_w = mx.quantize_mx(b, axis=0, elem_format="float8_e4m3fn", scheme="wrapX", k_tile=512)
    wrong = mx.mx_matmul(qa_w, qb_w)
    assert not np.array_equal(out[5], wrong[5])


def test_mxfp8_matmul_instruction_mix():
    M, K, N = 256, 1024, 512
    a, b = make_inputs(M, K, N)
    res = run_kernel(mxfp8_matmul_kernel.fn, kwargs=dict(a=a, b=b), lnc=2, trace=True, numerics=False)
    names = [r.instr for r in res.trace]
    # per program: B panel 2 K tiles x (dma, tensor_copy, quantize); 1 M tile x (2 x (dma_transpose,
    # quantize) + 2 matmuls + eviction + store)
    per_prog = {"dma_copy": 2 + 1, "tensor_copy": 2 + 1, "quantize_mx": 2 + 2, "dma_transpose": 2,
                "nc_matmul_mx": 2}
    for k, v in per_prog.items():
        assert names.count(k) == 2 * v, (k, names.count(k))
    mm = [r for r in res.trace if r.instr == "nc_matmul_mx"]
    assert {(r.attrs["K"], r.attrs["M"], r.attrs["N"]) for r in mm} == {(512, 128, 512)}


def test_main_prints_errors(capsys):
    out, ref_mx, ref32 = main(M=128, K=512, N=256, lnc=1)
    text = capsys.readouterr().out
    assert "vs MX reference" in text and "vs fp32 matmul" in text and "rel Frobenius" in text
    assert np.abs(out - ref_mx).max() <= 1e-5 * np.abs(ref_mx).max()
