"""nisa.tensor_reduce and nisa.nc_transpose (docs/simulator.md entries)."""
import numpy as np
import pytest

import nki.isa as nisa
import nki.language as nl
from nkilib.simulator.errors import NkiValidationError
from simkit import BF16, bits, oversized_tile, randn, rng, run_tiles

X = np.array([[1.0, 2.0, 3.0], [4.0, -5.0, 6.0]], np.float32)


def _red(op, axis, **kw):
    return lambda d, o: nisa.tensor_reduce(dst=o, op=op, data=d, axis=axis, **kw)


# ------------------------------------------------------------------------------------------------
# tensor_reduce
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("op, kw, expected", [
    (nl.add, {}, [6.0, 5.0]),
    (nl.add, dict(negate=True), [-6.0, -5.0]),
    (nl.maximum, {}, [3.0, 6.0]),
    (nl.minimum, dict(negate=True), [-1.0, 5.0]),
    (nl.multiply, {}, [6.0, -120.0]),
    (nl.subtract, {}, [-4.0, 3.0]),  # x0 - x1 - x2
])
def test_tensor_reduce_hand_computed(op, kw, expected):
    (out,), tr = run_tiles(_red(op, 1, **kw), (X,), [((2, 1), nl.float32)], trace=True)
    np.testing.assert_array_equal(out[:, 0], expected)
    assert (tr[0].instr, tr[0].engine, tr[0].attrs["elems"]) == ("tensor_reduce", "vector", 3)


def test_tensor_reduce_logical_ops():
    x = np.array([[1.0, 0.0, 3.0], [2.0, -2.0, 0.5]], np.float32)
    a, o, x_ = run_tiles(lambda d, o1, o2, o3: (nisa.tensor_reduce(dst=o1, op=nl.logical_and, data=d, axis=1),
                                               nisa.tensor_reduce(dst=o2, op=nl.logical_or, data=d, axis=(1,)),
                                               nisa.tensor_reduce(dst=o3, op=nl.logical_xor, data=d, axis=[1])),
                         (x,), [((2, 1), nl.float32)] * 3)
    np.testing.assert_array_equal(a[:, 0], [0.0, 1.0])
    np.testing.assert_array_equal(o[:, 0], [1.0, 1.0])
    np.testing.assert_array_equal(x_[:, 0], [0.0, 1.0])  # two / three non-zeros


def test_tensor_reduce_bitvec_hand_computed():
    x = np.array([[1, 2, 4], [7, 3, 5]], np.int32)
    a, o, x_ = run_tiles(lambda d, o1, o2, o3: (nisa.tensor_reduce(dst=o1, op=nl.bitwise_and, data=d, axis=1),
                                               nisa.tensor_reduce(dst=o2, op=nl.bitwise_or, data=d, axis=1),
                                               nisa.tensor_reduce(dst=o3, op=nl.bitwise_xor, data=d, axis=1)),
                         (x,), [((2, 1), nl.int32)] * 3)
    np.testing.assert_array_equal(a[:, 0], [0, 1])
    np.testing.assert_array_equal(o[:, 0], [7, 7])
    np.testing.assert_array_equal(x_[:, 0], [7, 1])


def test_tensor_reduce_bitvec_random_uint32():
    x = rng(30).integers(0, 2 ** 32, (16, 4, 8), dtype=np.uint32)
    (out,) = run_tiles(_red(nl.bitwise_xor, (2,)), (x,), [((16, 4), nl.uint32)])
    np.testing.assert_array_equal(out, np.bitwise_xor.reduce(x, axis=2))


@pytest.mark.parametrize("axis, out_shape, np_axis", [
    (3, (32, 2, 3), (3,)),
    ((3,), (32, 2, 3, 1), (3,)),  # keepdims-shaped dst
    ((2, 3), (32, 2), (2, 3)),
    ([1, 2, 3], (32, 1), (1, 2, 3)),
    (-1, (32, 6), (3,)),  # negative axis counts from the end
])
@pytest.mark.parametrize("out_dtype", [nl.float32, nl.bfloat16])
def test_tensor_reduce_add_multi_axis_exact_integers(axis, out_shape, np_axis, out_dtype):
    # integer-valued data: every partial sum is exact, so the expected sum is order-independent
    x = rng(31).integers(-40, 40, (32, 2, 3, 5)).astype(np.float32)
    keep = len(out_shape) == 4
    (out,) = run_tiles(_red(nl.add, axis, keepdims=keep), (x,), [(out_shape, out_dtype)])
    want = x.sum(axis=np_axis).reshape(out_shape)
    if out_dtype == nl.float32:
        np.testing.assert_array_equal(out, want)
    else:
        np.testing.assert_array_equal(bits(out), bits(want.astype(BF16)))


@pytest.mark.parametrize("out_dtype", [nl.float32, nl.bfloat16])
def test_tensor_reduce_random_max_and_sum(out_dtype):
    x = randn(32, (128, 200), dtype=BF16)
    mx, sm = run_tiles(lambda d, o1, o2: (nisa.tensor_reduce(dst=o1, op=nl.maximum, data=d, axis=1),
                                          nisa.tensor_reduce(dst=o2, op=nl.add, data=d, axis=1, negate=True)),
                       (x,), [((128, 1), out_dtype)] * 2, psum_inputs=(0,))
    xf = x.astype(np.float32)
    np.testing.assert_array_equal(bits(mx[:, 0]), bits(xf.max(axis=1).astype(mx.dtype)))
    np.testing.assert_allclose(sm[:, 0].astype(np.float32), -xf.astype(np.float64).sum(axis=1),
                               rtol=1e-6 if out_dtype == nl.float32 else 4e-3, atol=1e-5)


@pytest.mark.parametrize("axis, match", [
    (0, r"axis 0 includes the partition axis 0, which cannot be reduced"),
    ((0, 1, 2), r"axis \(0, 1, 2\) includes the partition axis 0"),
    ((1,), r"axis \(1,\) must be the trailing contiguous free axes ending at the last axis 2"),
    ((1, 3), r"axis 3 is out of range for a 3-D tile"),
    (1.0, r"axis must be an int or a tuple/list of ints, got 1.0"),
    ((), r"axis must name at least one free axis"),
])
def test_tensor_reduce_rejects_bad_axis(axis, match):
    x = np.ones((4, 2, 3), np.float32)
    with pytest.raises(NkiValidationError, match=r"nisa.tensor_reduce: " + match):
        run_tiles(_red(nl.add, axis), (x,), [((4, 2), nl.float32)])


def test_tensor_reduce_rejects_non_contiguous_axes_4d():
    x = np.ones((4, 2, 3, 2), np.float32)
    with pytest.raises(NkiValidationError, match=r"axis \(1, 3\) must be the trailing contiguous free axes.*"
                                                 r"\(3,\), \(2, 3\), \(1, 2, 3\)"):
        run_tiles(_red(nl.add, (1, 3)), (x,), [((4, 3), nl.float32)])


@pytest.mark.parametrize("op, kw, dtype, match", [
    (nl.power, {}, np.float32, r"op=nl.power is not a legal reduction operator"),
    (nl.abs_max, {}, np.float32, r"op=nl.abs_max is not a legal reduction operator"),
    (nl.exp, {}, np.float32, r"op=nl.exp is not a legal reduction operator"),
    (nl.bitwise_or, dict(negate=True), np.int32, r"negate=True applies only to arithmetic operators"),
    (nl.bitwise_or, {}, np.float32, r"bitvec operator nl.bitwise_or needs integer tiles, but argument 'data'"),
    (nl.add, dict(negate=1), np.float32, r"negate and keepdims must be bools"),
])
def test_tensor_reduce_rejects_bad_op(op, kw, dtype, match):
    with pytest.raises(NkiValidationError, match=r"nisa.tensor_reduce: " + match):
        run_tiles(_red(op, 1, **kw), (X.astype(dtype),), [((2, 1), nl.int32)])


def test_tensor_reduce_rejects_dst_shape_mismatch():
    x = np.ones((4, 2, 3), np.float32)
    with pytest.raises(NkiValidationError, match=r"dst .* has 3 elements per partition but reducing data "
                                                 r"\(4, 2, 3\) over axis \(2,\) leaves 2"):
        run_tiles(_red(nl.add, 2), (x,), [((4, 3), nl.float32)])
    with pytest.raises(NkiValidationError, match=r"'dst' has 2 partitions but 'data' has 4"):
        run_tiles(_red(nl.add, 2), (x,), [((2, 2), nl.float32)])


def test_tensor_reduce_rejects_hbm_and_oversized():
    def body(o):
        h = nl.ndarray((2, 3), nl.float32, buffer=nl.shared_hbm)
        nisa.tensor_reduce(dst=o, op=nl.add, data=h, axis=1)

    with pytest.raises(NkiValidationError, match=r"argument 'data' .* must be in SBUF or PSUM, got shared_hbm"):
        run_tiles(body, (), [((2, 1), nl.float32)])

    def body2(o):
        nisa.tensor_reduce(dst=o, op=nl.add, data=oversized_tile((256, 3), nl.float32), axis=1)

    with pytest.raises(NkiValidationError, match=r"argument 'data' partition dimension 256 exceeds maximum 128"):
        run_tiles(body2, (), [((2, 1), nl.float32)])


# ------------------------------------------------------------------------------------------------
# nc_transpose
# ------------------------------------------------------------------------------------------------

def _tp(engine=nisa.engine.unknown):
    return lambda d, o: nisa.nc_transpose(dst=o, data=d, engine=engine)


@pytest.mark.parametrize("buf, engine, want_engine", [
    ("psum", nisa.engine.unknown, "tensor"),
    ("psum", nisa.engine.tensor, "tensor"),
    ("sbuf", nisa.engine.unknown, "vector"),
    ("psum", nisa.engine.vector, "vector"),
])
def test_nc_transpose_hand_computed_engines(buf, engine, want_engine):
    (out,), tr = run_tiles(_tp(engine), (X,), [((3, 2), nl.float32, buf)], trace=True)
    np.testing.assert_array_equal(out, [[1.0, 4.0], [2.0, -5.0], [3.0, 6.0]])
    assert (tr[0].instr, tr[0].engine, tr[0].attrs["elems"]) == ("nc_transpose", want_engine, 3)


def test_nc_transpose_psum_input_defaults_to_vector():
    (out,), tr = run_tiles(_tp(), (X,), [((3, 2), nl.float32, "psum")], psum_inputs=(0,), trace=True)
    np.testing.assert_array_equal(out, X.T)
    assert tr[0].engine == "vector"


def test_nc_transpose_flattens_free_dims():
    x = np.arange(24, dtype=np.float32).reshape(4, 2, 3)
    (out,) = run_tiles(_tp(), (x,), [((6, 4), nl.float32, "psum")])
    np.testing.assert_array_equal(out, x.reshape(4, 6).T)


def test_nc_transpose_tensor_engine_bit_exact_bf16_with_nan_inf():
    raw = rng(33).integers(0, 2 ** 16, (128, 128), dtype=np.uint16)
    raw[0, :4] = [0x7FC1, 0xFF80, 0x7F80, 0x8000]  # NaN with payload, -inf, +inf, -0
    x = raw.view(BF16)
    (out,), tr = run_tiles(_tp(nisa.engine.tensor), (x,), [((128, 128), nl.bfloat16, "psum")], trace=True)
    np.testing.assert_array_equal(bits(out), raw.T)
    assert tr[0].engine == "tensor"


@pytest.mark.parametrize("dtype", [np.int32, np.float32, BF16])
def test_nc_transpose_vector_32x32_bit_exact(dtype):
    raw = rng(34).integers(0, 2 ** 32, (32, 32), dtype=np.uint32)
    x = raw.view(np.float32).astype(dtype) if dtype is BF16 else raw.view(dtype)
    (out,) = run_tiles(_tp(nisa.engine.vector), (x,), [((32, 32), x.dtype)])
    np.testing.assert_array_equal(bits(out), bits(x).T)


@pytest.mark.parametrize("data_shape, out_spec, engine, psum_in, match", [
    ((64, 16), ((16, 64), nl.float32), nisa.engine.unknown, (),
     r"data \[64, 16\] .* exceeds the vector engine limit \[32, 32\]"),
    ((8, 40), ((40, 8), nl.float32, "psum"), nisa.engine.vector, (),
     r"data \[8, 40\] .* exceeds the vector engine limit \[32, 32\]"),
    ((4, 8), ((8, 4), nl.float32), nisa.engine.tensor, (), r"engine tensor writes dst only to PSUM, got dst .* sbuf"),
    ((4, 8), ((8, 4), nl.float32, "psum"), nisa.engine.tensor, (0,),
     r"engine tensor reads data only from SBUF, got data .* psum"),
    ((4, 8), ((8, 4), nl.bfloat16, "psum"), nisa.engine.unknown, (),
     r"dst dtype bfloat16 must equal data dtype float32"),
    ((4, 8), ((4, 8), nl.float32, "psum"), nisa.engine.unknown, (),
     r"dst .* must be \[8, 4\] \(the transpose of data \(4, 8\)"),
    ((4, 8), ((8, 4), nl.float32, "psum"), nisa.engine.gpsimd, (), r"engine gpsimd is not supported"),
])
def test_nc_transpose_rejections(data_shape, out_spec, engine, psum_in, match):
    x = np.ones(data_shape, np.float32)
    with pytest.raises(NkiValidationError, match=r"nisa.nc_transpose: " + match):
        run_tiles(_tp(engine), (x,), [out_spec], psum_inputs=psum_in)


def test_nc_transpose_rejects_more_than_128_partitions():
    def body(o):
        nisa.nc_transpose(dst=o, data=oversized_tile((256, 4), nl.float32))

    with pytest.raises(NkiValidationError, match=r"nc_transpose: argument 'data' partition dimension 256 exceeds "
                                                 r"maximum 128"):
        run_tiles(body, (), [((4, 128), nl.float32, "psum")])
