"""nisa.tensor_tensor, tensor_scalar, scalar_tensor_tensor, reciprocal, iota (docs/simulator.md entries).

Expected values are hand-computed or plain numpy float32 / Python-int computations; bf16 results
must equal the float32 reference rounded to bf16 (RNE, ml_dtypes) bit for bit.
"""
import numpy as np
import pytest

import nki.isa as nisa
import nki.language as nl
from nkilib.simulator.errors import NkiValidationError
from simkit import BF16, bits, oversized_tile, randn, rng, run_tiles

A = np.array([[1.5, -2.0, 3.0, 0.25], [0.0, 7.0, -1.0, 2.0]], np.float32)
B = np.array([[2.0, 4.0, -1.0, 0.5], [0.0, -7.0, -1.0, 3.0]], np.float32)


def _tt(op, engine=nisa.engine.unknown):
    return lambda x, y, o: nisa.tensor_tensor(dst=o, data1=x, data2=y, op=op, engine=engine)


def _assert_bf16_exact(got, ref32):
    assert got.dtype == BF16
    np.testing.assert_array_equal(bits(got), bits(np.asarray(ref32, np.float32).astype(BF16)))


# ------------------------------------------------------------------------------------------------
# tensor_tensor
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("op, expected", [
    (nl.add, [[3.5, 2.0, 2.0, 0.75], [0.0, 0.0, -2.0, 5.0]]),
    (nl.subtract, [[-0.5, -6.0, 4.0, -0.25], [0.0, 14.0, 0.0, -1.0]]),
    (nl.multiply, [[3.0, -8.0, -3.0, 0.125], [0.0, -49.0, 1.0, 6.0]]),
    (nl.maximum, [[2.0, 4.0, 3.0, 0.5], [0.0, 7.0, -1.0, 3.0]]),
    (nl.minimum, [[1.5, -2.0, -1.0, 0.25], [0.0, -7.0, -1.0, 2.0]]),
    (nl.greater, [[0, 0, 1, 0], [0, 1, 0, 0]]),
    (nl.equal, [[0, 0, 0, 0], [1, 0, 1, 0]]),
    (nl.less_equal, [[1, 1, 0, 1], [1, 0, 1, 1]]),
    (nl.logical_and, [[1, 1, 1, 1], [0, 1, 1, 1]]),
])
def test_tensor_tensor_hand_computed(op, expected):
    (out,), tr = run_tiles(_tt(op), (A, B), [((2, 4), nl.float32)], trace=True)
    np.testing.assert_array_equal(out, np.array(expected, np.float32))
    assert [(r.instr, r.engine, r.attrs["elems"]) for r in tr] == [("tensor_tensor", "vector", 4)]


@pytest.mark.parametrize("op, ref", [(nl.add, np.add), (nl.subtract, np.subtract), (nl.multiply, np.multiply),
                                     (nl.maximum, np.maximum), (nl.minimum, np.minimum)])
@pytest.mark.parametrize("out_dtype", [nl.float32, nl.bfloat16])
def test_tensor_tensor_random_matches_numpy(op, ref, out_dtype):
    a = randn(1, (64, 3, 32))
    b = randn(2, (64, 96), dtype=BF16)  # mixed dtypes and ranks with equal elements per partition
    (out,) = run_tiles(_tt(op), (a, b), [((64, 96), out_dtype)])
    want = ref(a.reshape(64, 96), b.astype(np.float32))
    if out_dtype == nl.float32:
        np.testing.assert_array_equal(out, want)
    else:
        _assert_bf16_exact(out, want)


def test_tensor_tensor_psum_operand_and_psum_dst():
    (out,), tr = run_tiles(_tt(nl.add), (A, B), [((2, 4), nl.float32, "psum")], psum_inputs=(1,), trace=True)
    np.testing.assert_array_equal(out, A + B)
    assert tr[0].engine == "vector"


def test_tensor_tensor_int32_default_gpsimd_is_exact_and_wraps():
    a = np.array([[16777217, 2 ** 31 - 1, -5, 123456789]], np.int32)
    b = np.array([[1, 1, 7, 1000]], np.int32)
    (s, d, m), tr = run_tiles(
        lambda x, y, o1, o2, o3: (nisa.tensor_tensor(dst=o1, data1=x, data2=y, op=nl.add),
                                  nisa.tensor_tensor(dst=o2, data1=x, data2=y, op=nl.subtract),
                                  nisa.tensor_tensor(dst=o3, data1=x, data2=y, op=nl.multiply)),
        (a, b), [((1, 4), nl.int32)] * 3, trace=True)
    # native 32-bit arithmetic: 2^31 - 1 + 1 wraps to -2^31; 123456789 * 1000 wraps modulo 2^32
    np.testing.assert_array_equal(s, [[16777218, -2 ** 31, 2, 123457789]])
    np.testing.assert_array_equal(d, [[16777216, 2 ** 31 - 2, -12, 123455789]])
    prod = (123456789 * 1000) % 2 ** 32
    prod = prod - 2 ** 32 if prod >= 2 ** 31 else prod
    np.testing.assert_array_equal(m, [[16777217, 2 ** 31 - 1, -35, prod]])
    assert [r.engine for r in tr] == ["gpsimd"] * 3


def test_tensor_tensor_int32_forced_vector_uses_fp32():
    a = np.array([[16777217, 3]], np.int32)
    b = np.array([[1, 4]], np.int32)
    (out,), tr = run_tiles(_tt(nl.add, nisa.engine.vector), (a, b), [((1, 2), nl.int32)], trace=True)
    # fp32(16777217) = 16777216; 16777216 + 1 = 16777217 is not representable -> RNE to 16777216
    np.testing.assert_array_equal(out, [[16777216, 7]])
    assert tr[0].engine == "vector"


def test_tensor_tensor_int32_with_psum_operand_falls_back_to_vector():
    a = np.array([[16777217, 3]], np.int32)
    b = np.array([[1, 4]], np.int32)
    (out,), tr = run_tiles(_tt(nl.add), (a, b), [((1, 2), nl.int32)], psum_inputs=(1,), trace=True)
    assert tr[0].engine == "vector"
    np.testing.assert_array_equal(out, [[16777216, 7]])


def test_tensor_tensor_bitvec_hand_computed():
    a = np.array([[-8, 1, 0x0F0F, -1]], np.int32)
    b = np.array([[1, 31, 0x00FF, 4]], np.int32)
    outs, tr = run_tiles(
        lambda x, y, *o: [nisa.tensor_tensor(dst=d, data1=x, data2=y, op=op) for d, op in
                          zip(o, (nl.right_shift, nl.left_shift, nl.bitwise_and, nl.bitwise_xor))],
        (a, b), [((1, 4), nl.int32)] * 4, trace=True)
    rs, ls, band, bxor = outs
    # logical right shift: 0xFFFFFFF8 >> 1 = 0x7FFFFFFC; 1 >> 31 = 0; 0x0F0F >> 255 = 0; -1 >> 4 = 0x0FFFFFFF
    np.testing.assert_array_equal(rs, [[0x7FFFFFFC, 0, 0, 0x0FFFFFFF]])
    # left shift: -8 << 1 = -16; 1 << 31 = 0x80000000 = -2^31; shift by 255 -> 0; -1 << 4 = -16
    np.testing.assert_array_equal(ls, [[-16, -2 ** 31, 0, -16]])
    np.testing.assert_array_equal(band, [[0, 1, 0x000F, 4]])
    np.testing.assert_array_equal(bxor, [[-7, 30, 0x0FF0, -5]])
    assert {r.engine for r in tr} == {"vector"}


@pytest.mark.parametrize("op, ref", [(nl.bitwise_and, np.bitwise_and), (nl.bitwise_or, np.bitwise_or),
                                     (nl.bitwise_xor, np.bitwise_xor), (nl.left_shift, np.left_shift),
                                     (nl.right_shift, np.right_shift)])
def test_tensor_tensor_bitvec_random_uint32(op, ref):
    g = rng(3)
    a = g.integers(0, 2 ** 32, (32, 40), dtype=np.uint32)
    b = g.integers(0, 2 ** 32, (32, 40), dtype=np.uint32)
    if op in (nl.left_shift, nl.right_shift):
        b = b % 32
    (out,) = run_tiles(_tt(op), (a, b), [((32, 40), nl.uint32)])
    np.testing.assert_array_equal(out, ref(a, b))


def test_tensor_tensor_bitvec_narrow_dst_keeps_low_bits():
    a = np.array([[0x1234, 0x00FF]], np.int32)
    b = np.array([[0x0F0F, 0xFFFF]], np.int32)
    (out,) = run_tiles(_tt(nl.bitwise_and), (a, b), [((1, 2), nl.uint8)])
    np.testing.assert_array_equal(out, [[0x04, 0xFF]])  # 0x1234 & 0x0F0F = 0x0204 -> low byte 0x04


def test_tensor_tensor_power_runs_on_gpsimd():
    a = np.array([[2.0, 9.0, 4.0, 1.5]], np.float32)
    b = np.array([[10.0, 0.5, -1.0, 2.0]], np.float32)
    (out,), tr = run_tiles(_tt(nl.power), (a, b), [((1, 4), nl.float32)], trace=True)
    np.testing.assert_array_equal(out, [[1024.0, 3.0, 0.25, 2.25]])
    assert tr[0].engine == "gpsimd"


def test_tensor_tensor_abs_max_min_trn3(set_target):
    set_target("trn3")
    a = np.array([[1.0, -5.0, 2.0]], np.float32)
    b = np.array([[-3.0, 4.0, -2.0]], np.float32)
    mx, mn = run_tiles(lambda x, y, o1, o2: (nisa.tensor_tensor(dst=o1, data1=x, data2=y, op=nl.abs_max),
                                             nisa.tensor_tensor(dst=o2, data1=x, data2=y, op=nl.abs_min)),
                       (a, b), [((1, 3), nl.float32)] * 2)
    np.testing.assert_array_equal(mx, [[-3.0, -5.0, -2.0]])  # ties (|2| == |-2|) keep data2
    np.testing.assert_array_equal(mn, [[1.0, 4.0, -2.0]])


def test_tensor_tensor_abs_max_rejected_on_trn2(set_target):
    set_target("trn2")
    with pytest.raises(NkiValidationError, match=r"tensor_tensor: op=nl.abs_max requires NeuronCore-v4"):
        run_tiles(_tt(nl.abs_max), (A, B), [((2, 4), nl.float32)])


def test_tensor_tensor_rejects_hbm_dst():
    def body(x, y):
        out = nl.ndarray((2, 4), nl.float32, buffer=nl.shared_hbm)
        nisa.tensor_tensor(dst=out, data1=x, data2=y, op=nl.add)

    with pytest.raises(NkiValidationError, match=r"argument 'dst' .* must be in SBUF or PSUM, got shared_hbm"):
        run_tiles(body, (A, B))


def test_tensor_tensor_rejects_both_inputs_in_psum():
    with pytest.raises(NkiValidationError, match=r"'data1' and 'data2' may not both be in PSUM"):
        run_tiles(_tt(nl.add), (A, B), [((2, 4), nl.float32)], psum_inputs=(0, 1))


def test_tensor_tensor_rejects_partition_mismatch():
    with pytest.raises(NkiValidationError, match=r"'dst' has 2 partitions but 'data2' has 1"):
        run_tiles(_tt(nl.add), (A, B[:1]), [((2, 4), nl.float32)])


def test_tensor_tensor_rejects_free_size_mismatch():
    with pytest.raises(NkiValidationError, match=r"'dst' has 4 elements per partition but 'data1' has 3"):
        run_tiles(_tt(nl.add), (A[:, :3], B), [((2, 4), nl.float32)])


@pytest.mark.parametrize("op", [nl.silu, nl.abs, nl.exp])
def test_tensor_tensor_rejects_non_binary_op(op):
    with pytest.raises(NkiValidationError, match=rf"op=nl.{op.name} is not a binary ALU operator"):
        run_tiles(_tt(op), (A, B), [((2, 4), nl.float32)])


def test_tensor_tensor_rejects_non_op_object():
    with pytest.raises(NkiValidationError, match=r"argument 'op' must be an nl operator such as nl.add, got ufunc"):
        run_tiles(_tt(np.add), (A, B), [((2, 4), nl.float32)])


def test_tensor_tensor_rejects_gpsimd_on_psum():
    with pytest.raises(NkiValidationError, match=r"engine gpsimd cannot access PSUM \(argument 'data2'"):
        run_tiles(_tt(nl.add, nisa.engine.gpsimd), (A, B), [((2, 4), nl.float32)], psum_inputs=(1,))


def test_tensor_tensor_rejects_power_on_vector_and_in_psum():
    with pytest.raises(NkiValidationError, match=r"op=nl.power runs only on the GpSimd engine, got engine=vector"):
        run_tiles(_tt(nl.power, nisa.engine.vector), (A, B), [((2, 4), nl.float32)])
    with pytest.raises(NkiValidationError, match=r"engine gpsimd cannot access PSUM \(argument 'data1'"):
        run_tiles(_tt(nl.power), (A, B), [((2, 4), nl.float32)], psum_inputs=(0,))


def test_tensor_tensor_rejects_bitvec_on_float_tiles_and_on_gpsimd():
    with pytest.raises(NkiValidationError, match=r"bitwise_and needs integer tiles, but argument 'data1'.*float32"):
        run_tiles(_tt(nl.bitwise_and), (A, B), [((2, 4), nl.int32)])
    ai = A.astype(np.int32)
    with pytest.raises(NkiValidationError, match=r"bitvec operator op=nl.bitwise_or runs only on the Vector engine"):
        run_tiles(_tt(nl.bitwise_or, nisa.engine.gpsimd), (ai, ai), [((2, 4), nl.int32)])


def test_tensor_tensor_rejects_raw_int_engine_and_scalar_engine():
    with pytest.raises(NkiValidationError, match=r"engine must be an nisa.engine member, got 5"):
        run_tiles(_tt(nl.add, 5), (A, B), [((2, 4), nl.float32)])
    with pytest.raises(NkiValidationError, match=r"engine scalar is not supported"):
        run_tiles(_tt(nl.add, nisa.engine.scalar), (A, B), [((2, 4), nl.float32)])


def test_tensor_tensor_rejects_packed_x4_operand():
    def body(x, o):
        q = nl.ndarray((2, 4), nl.float8_e4m3fn_x4, buffer=nl.sbuf)
        nisa.memset(dst=q, value=0)
        nisa.tensor_tensor(dst=o, data1=x, data2=q, op=nl.add)

    with pytest.raises(NkiValidationError, match=r"argument 'data2' .* packed/scale dtype float8_e4m3fn_x4"):
        run_tiles(body, (A,), [((2, 4), nl.float32)])


# ------------------------------------------------------------------------------------------------
# tensor_scalar
# ------------------------------------------------------------------------------------------------

def test_tensor_scalar_hand_computed_scalars_and_reverse():
    x = np.array([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]], np.float32)
    (out,), tr = run_tiles(
        lambda d, o: nisa.tensor_scalar(dst=o, data=d, op0=nl.multiply, operand0=2.0, op1=nl.subtract,
                                        operand1=1.0, reverse1=True),
        (x,), [((2, 4), nl.float32)], trace=True)
    np.testing.assert_array_equal(out, 1.0 - 2.0 * x)  # 1 - (2x)
    assert (tr[0].engine, tr[0].attrs["elems"], tr[0].attrs["op0"], tr[0].attrs["op1"]) == \
        ("vector", 4, "multiply", "subtract")


def test_tensor_scalar_hand_computed_vector_operands():
    x = np.array([[1.0, 2.0, 3.0], [5.0, 6.0, 7.0]], np.float32)
    v0 = np.array([[10.0], [20.0]], np.float32)
    v1 = np.array([[2.0], [0.5]], np.float32)
    (out,) = run_tiles(
        lambda d, a, b, o: nisa.tensor_scalar(dst=o, data=d, op0=nl.subtract, operand0=a, reverse0=True,
                                              op1=nl.multiply, operand1=b),
        (x, v0, v1), [((2, 3), nl.float32)])
    np.testing.assert_array_equal(out, [[18.0, 16.0, 14.0], [7.5, 7.0, 6.5]])  # (v0 - x) * v1


@pytest.mark.parametrize("out_dtype", [nl.float32, nl.bfloat16])
def test_tensor_scalar_random_matches_numpy(out_dtype):
    x = randn(4, (96, 2, 40))
    v = randn(5, (96, 1))
    (out,) = run_tiles(
        lambda d, a, o: nisa.tensor_scalar(dst=o, data=d, op0=nl.multiply, operand0=a, op1=nl.add, operand1=0.375),
        (x, v), [((96, 80), out_dtype)])
    want = x.reshape(96, 80) * v + np.float32(0.375)
    if out_dtype == nl.float32:
        np.testing.assert_array_equal(out, want)
    else:
        _assert_bf16_exact(out, want)


def test_tensor_scalar_unary_ops():
    x = np.array([[4.0, -0.25, 16.0, -2.0]], np.float32)
    a, r, g = run_tiles(
        lambda d, o1, o2, o3: (nisa.tensor_scalar(dst=o1, data=d, op0=nl.abs, operand0=None),
                               nisa.tensor_scalar(dst=o2, data=d, op0=nl.reciprocal, operand0=0,
                                                  op1=nl.add, operand1=1.0),
                               nisa.tensor_scalar(dst=o3, data=d, op0=nl.multiply, operand0=-1.0, op1=nl.abs,
                                                  operand1=None)),
        (x,), [((1, 4), nl.float32)] * 3)
    np.testing.assert_array_equal(a, [[4.0, 0.25, 16.0, 2.0]])
    np.testing.assert_array_equal(r, [[1.25, -3.0, 1.0625, 0.5]])
    np.testing.assert_array_equal(g, [[4.0, 0.25, 16.0, 2.0]])


def test_tensor_scalar_rsqrt_on_gpsimd():
    x = np.array([[4.0, 0.25, 16.0, 64.0]], np.float32)
    (out,), tr = run_tiles(lambda d, o: nisa.tensor_scalar(dst=o, data=d, op0=nl.rsqrt, operand0=None,
                                                           engine=nisa.engine.gpsimd),
                           (x,), [((1, 4), nl.float32)], trace=True)
    np.testing.assert_array_equal(out, [[0.5, 2.0, 0.25, 0.125]])
    assert tr[0].engine == "gpsimd"


@pytest.mark.parametrize("ops", [(nl.multiply, nl.add), (nl.multiply, None), (nl.add, None)])
def test_tensor_scalar_scalar_engine_trn2_pairs(set_target, ops):
    set_target("trn2")
    x = randn(6, (16, 24))
    op0, op1 = ops
    kw = dict(op1=op1, operand1=-0.5) if op1 is not None else {}
    (out,), tr = run_tiles(lambda d, o: nisa.tensor_scalar(dst=o, data=d, op0=op0, operand0=1.25,
                                                           engine=nisa.engine.scalar, **kw),
                           (x,), [((16, 24), nl.bfloat16)], trace=True)
    t = x * np.float32(1.25) if op0 is nl.multiply else x + np.float32(1.25)
    want = t + np.float32(-0.5) if op1 is not None else t
    _assert_bf16_exact(out, want)
    assert tr[0].engine == "scalar"


@pytest.mark.parametrize("ops", [(nl.subtract, None), (nl.add, nl.multiply), (nl.maximum, None)])
def test_tensor_scalar_scalar_engine_other_pairs_by_target(any_target, ops):
    x = randn(7, (8, 12))
    op0, op1 = ops
    kw = dict(op1=op1, operand1=3.0) if op1 is not None else {}

    def body(d, o):
        nisa.tensor_scalar(dst=o, data=d, op0=op0, operand0=0.5, engine=nisa.engine.scalar, **kw)

    if any_target == "trn2":
        with pytest.raises(NkiValidationError,
                           match=rf"Scalar engine on trn2 supports only .* got \(nl.{op0.name}, "):
            run_tiles(body, (x,), [((8, 12), nl.float32)])
        return
    (out,), tr = run_tiles(body, (x,), [((8, 12), nl.float32)], trace=True)
    t = {"subtract": np.subtract, "add": np.add, "maximum": np.maximum}[op0.name](x, np.float32(0.5))
    want = t * np.float32(3.0) if op1 is not None else t
    np.testing.assert_array_equal(out, want)
    assert tr[0].engine == "scalar"


def test_tensor_scalar_square_relu_op0_by_target(any_target):
    x = np.array([[-3.0, 2.0, 0.5]], np.float32)

    def body(d, o1, o2):
        nisa.tensor_scalar(dst=o1, data=d, op0=nl.square, operand0=None, op1=nl.add, operand1=1.0)
        nisa.tensor_scalar(dst=o2, data=d, op0=nl.relu, operand0=0)

    if any_target == "trn2":
        with pytest.raises(NkiValidationError, match=r"op0=nl.square requires NeuronCore-v4"):
            run_tiles(body, (x,), [((1, 3), nl.float32)] * 2)
        return
    sq, re = run_tiles(body, (x,), [((1, 3), nl.float32)] * 2)
    np.testing.assert_array_equal(sq, [[10.0, 5.0, 1.25]])
    np.testing.assert_array_equal(re, [[0.0, 2.0, 0.5]])


def test_tensor_scalar_bitvec():
    x = np.array([[0x1234, -1, 7, 0x0100]], np.int32)
    m = np.array([[0xF0]], np.int32)
    a, b = run_tiles(
        lambda d, mk, o1, o2: (
            nisa.tensor_scalar(dst=o1, data=d, op0=nl.bitwise_and, operand0=0xFF, op1=nl.left_shift, operand1=4),
            nisa.tensor_scalar(dst=o2, data=d, op0=nl.bitwise_or, operand0=mk, op1=nl.right_shift, operand1=28)),
        (x, m), [((1, 4), nl.int32)] * 2)
    np.testing.assert_array_equal(a, [[0x340, 0xFF0, 0x70, 0x0]])  # (x & 0xFF) << 4
    np.testing.assert_array_equal(b, [[0, 0xF, 0, 0]])  # (x | 0xF0) >>> 28


def test_tensor_scalar_bitvec_random_matches_numpy():
    x = rng(8).integers(0, 2 ** 32, (32, 50), dtype=np.uint32)
    (out,) = run_tiles(
        lambda d, o: nisa.tensor_scalar(dst=o, data=d, op0=nl.bitwise_xor, operand0=0x5A5A5A5A, op1=nl.right_shift,
                                        operand1=3),
        (x,), [((32, 50), nl.uint32)])
    np.testing.assert_array_equal(out, (x ^ np.uint32(0x5A5A5A5A)) >> np.uint32(3))


def _ts(**kw):
    return lambda d, o: nisa.tensor_scalar(dst=o, data=d, **kw)


@pytest.mark.parametrize("kw, match", [
    (dict(op0=nl.add, operand0=1.0, op1=nl.add), r"operand1 is required for the binary operator op1=nl.add"),
    (dict(op0=nl.add, operand0=1.0, operand1=2.0), r"operand1 must be None when op1 is None \(unused\), got 2.0"),
    (dict(op0=nl.add, operand0=None), r"operand0 is required for the binary operator op0=nl.add"),
    (dict(op0=nl.abs, operand0=2.0), r"operand0 must be None or 0 when op0 is the unary operator nl.abs, got 2.0"),
    (dict(op0=nl.add, operand0=1.0, op1=nl.bitwise_and, operand1=3),
     r"op0=nl.add and op1=nl.bitwise_and must both be bitvec or both arithmetic"),
    (dict(op0=nl.exp, operand0=None), r"op0=nl.exp is not an ALU operator"),
    (dict(op0=nl.power, operand0=2.0), r"op0=nl.power is not supported here"),
    (dict(op0=nl.add, operand0=1.0, engine=nisa.engine.gpsimd),
     r"engine gpsimd is only allowed for rsqrt .* got op0=nl.add"),
    (dict(op0=nl.add, operand0="x"), r"argument 'operand0' must be a number or a \[P, 1\] tile, got 'x'"),
    (dict(op0=nl.add, operand0=1.0, reverse0=1), r"argument 'reverse0' must be a bool, got 1"),
    (dict(op0=nl.add, operand0=1.0, op1=nl.square, operand1=None), r"op1=nl.square is not supported"),
])
def test_tensor_scalar_rejects_bad_op_operand_combinations(kw, match):
    with pytest.raises(NkiValidationError, match=r"nisa.tensor_scalar: " + match):
        run_tiles(_ts(**kw), (A,), [((2, 4), nl.float32)])


def test_tensor_scalar_rejects_bitvec_on_scalar_engine_and_float_data():
    ai = A.astype(np.int32)
    with pytest.raises(NkiValidationError, match=r"bitvec operators \(nl.bitwise_and\) run only on the Vector engine, "
                                                 r"got engine=scalar"):
        run_tiles(_ts(op0=nl.bitwise_and, operand0=3, engine=nisa.engine.scalar), (ai,), [((2, 4), nl.int32)])
    with pytest.raises(NkiValidationError, match=r"needs integer tiles, but argument 'data'.*float32"):
        run_tiles(_ts(op0=nl.bitwise_and, operand0=3), (A,), [((2, 4), nl.int32)])
    with pytest.raises(NkiValidationError, match=r"operand0 for bitvec operator nl.bitwise_and must be an int"):
        run_tiles(_ts(op0=nl.bitwise_and, operand0=1.5), (ai,), [((2, 4), nl.int32)])


def test_tensor_scalar_rejects_bad_operand_tiles():
    with pytest.raises(NkiValidationError, match=r"operand0 tile .* must be float32 for arithmetic operators, "
                                                 r"got bfloat16"):
        run_tiles(lambda d, v, o: nisa.tensor_scalar(dst=o, data=d, op0=nl.add, operand0=v),
                  (A, np.ones((2, 1), BF16)), [((2, 4), nl.float32)])
    with pytest.raises(NkiValidationError, match=r"argument 'operand1' must be a \[2, 1\] tile, got shape \(2, 2\)"):
        run_tiles(lambda d, v, o: nisa.tensor_scalar(dst=o, data=d, op0=nl.add, operand0=1.0, op1=nl.add,
                                                     operand1=v),
                  (A, np.ones((2, 2), np.float32)), [((2, 4), nl.float32)])


def test_tensor_scalar_rejects_gpsimd_psum_and_mismatched_dst():
    with pytest.raises(NkiValidationError, match=r"engine gpsimd cannot access PSUM \(argument 'data'"):
        run_tiles(_ts(op0=nl.rsqrt, operand0=None, engine=nisa.engine.gpsimd), (A,), [((2, 4), nl.float32)],
                  psum_inputs=(0,))
    with pytest.raises(NkiValidationError, match=r"'dst' has 3 partitions but 'data' has 2"):
        run_tiles(_ts(op0=nl.add, operand0=1.0), (A,), [((3, 4), nl.float32)])


def test_tensor_scalar_abs_max_only_on_vector_trn3(set_target):
    set_target("trn3")
    x = np.array([[1.0, -5.0]], np.float32)
    (out,) = run_tiles(_ts(op0=nl.abs_max, operand0=-2.0), (x,), [((1, 2), nl.float32)])
    np.testing.assert_array_equal(out, [[-2.0, -5.0]])
    with pytest.raises(NkiValidationError, match=r"nl.abs_max / nl.abs_min run only on the Vector engine"):
        run_tiles(_ts(op0=nl.abs_max, operand0=-2.0, engine=nisa.engine.scalar), (x,), [((1, 2), nl.float32)])


# ------------------------------------------------------------------------------------------------
# scalar_tensor_tensor
# ------------------------------------------------------------------------------------------------

def test_scalar_tensor_tensor_hand_computed():
    x = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], np.float32)
    y = np.array([[10.0, 20.0, 30.0], [1.0, 1.0, 1.0]], np.float32)
    v = np.array([[2.0], [-1.0]], np.float32)
    a, b = run_tiles(
        lambda d, t, s, o1, o2: (
            nisa.scalar_tensor_tensor(dst=o1, data=d, op0=nl.multiply, operand0=s, op1=nl.add, operand1=t),
            nisa.scalar_tensor_tensor(dst=o2, data=d, op0=nl.subtract, operand0=0.5, op1=nl.subtract, operand1=t,
                                      reverse0=True, reverse1=True)),
        (x, y, v), [((2, 3), nl.float32)] * 2)
    np.testing.assert_array_equal(a, [[12.0, 24.0, 36.0], [-3.0, -4.0, -5.0]])  # x * v + y
    np.testing.assert_array_equal(b, [[10.5, 21.5, 32.5], [4.5, 5.5, 6.5]])  # y - (0.5 - x)


@pytest.mark.parametrize("out_dtype", [nl.float32, nl.bfloat16])
def test_scalar_tensor_tensor_random_matches_numpy(out_dtype):
    x = randn(9, (64, 48), dtype=BF16)
    y = randn(10, (64, 48))
    v = randn(11, (64, 1), dtype=BF16)  # any dtype for the [P, 1] operand0 (docs: all inputs any dtype)
    (out,), tr = run_tiles(
        lambda d, t, s, o: nisa.scalar_tensor_tensor(dst=o, data=d, op0=nl.add, operand0=s, op1=nl.maximum,
                                                     operand1=t),
        (x, y, v), [((64, 48), out_dtype)], psum_inputs=(0,), trace=True)
    want = np.maximum(x.astype(np.float32) + v.astype(np.float32), y)
    if out_dtype == nl.float32:
        np.testing.assert_array_equal(out, want)
    else:
        _assert_bf16_exact(out, want)
    assert (tr[0].engine, tr[0].attrs["elems"]) == ("vector", 48)


def _stt(**kw):
    return lambda d, t, o: nisa.scalar_tensor_tensor(dst=o, data=d, operand1=t, **kw)


@pytest.mark.parametrize("kw, psum, match", [
    (dict(op0=nl.add, operand0=1.0, op1=nl.add), (0, 1), r"'data' and 'operand1' may not both be in PSUM"),
    (dict(op0=nl.bitwise_and, operand0=1, op1=nl.add), (), r"op0=nl.bitwise_and is a bitvec operator"),
    (dict(op0=nl.add, operand0=1.0, op1=nl.abs), (), r"op1=nl.abs must be a binary operator"),
    (dict(op0=nl.add, operand0=1.0, op1=nl.power), (), r"op1=nl.power is not supported"),
])
def test_scalar_tensor_tensor_rejections(kw, psum, match):
    with pytest.raises(NkiValidationError, match=r"nisa.scalar_tensor_tensor: " + match):
        run_tiles(_stt(**kw), (A, B), [((2, 4), nl.float32)], psum_inputs=psum)


def test_scalar_tensor_tensor_rejects_scalar_or_mismatched_operand1():
    with pytest.raises(NkiValidationError, match=r"operand1 must be a tile with the same shape as data, got 2.0"):
        run_tiles(lambda d, o: nisa.scalar_tensor_tensor(dst=o, data=d, op0=nl.add, operand0=1.0, op1=nl.add,
                                                         operand1=2.0), (A,), [((2, 4), nl.float32)])
    with pytest.raises(NkiValidationError, match=r"'data' has 4 elements per partition but 'operand1' has 3"):
        run_tiles(_stt(op0=nl.add, operand0=1.0, op1=nl.add), (A, B[:, :3]), [((2, 4), nl.float32)])


# ------------------------------------------------------------------------------------------------
# reciprocal
# ------------------------------------------------------------------------------------------------

def test_reciprocal_hand_computed():
    x = np.array([[2.0, -4.0, 0.5, 0.0]], np.float32)
    (out,), tr = run_tiles(lambda d, o: nisa.reciprocal(dst=o, data=d), (x,), [((1, 4), nl.float32)], trace=True)
    np.testing.assert_array_equal(out, [[0.5, -0.25, 2.0, np.inf]])
    assert (tr[0].instr, tr[0].engine, tr[0].attrs["elems"]) == ("reciprocal", "vector", 4)


@pytest.mark.parametrize("out_dtype", [nl.float32, nl.bfloat16])
def test_reciprocal_random_matches_numpy(out_dtype):
    x = randn(12, (128, 64)) + np.float32(3.0)
    (out,) = run_tiles(lambda d, o: nisa.reciprocal(dst=o, data=d), (x,), [((128, 64), out_dtype)])
    want = np.float32(1.0) / x
    if out_dtype == nl.float32:
        np.testing.assert_array_equal(out, want)
    else:
        _assert_bf16_exact(out, want)


def test_reciprocal_rejects_mismatch_and_hbm():
    with pytest.raises(NkiValidationError, match=r"reciprocal: 'dst' has 3 elements per partition but 'data' has 4"):
        run_tiles(lambda d, o: nisa.reciprocal(dst=o, data=d), (A,), [((2, 3), nl.float32)])

    def body(d):
        h = nl.ndarray((2, 4), nl.float32, buffer=nl.shared_hbm)
        nisa.reciprocal(dst=d, data=h)

    with pytest.raises(NkiValidationError, match=r"reciprocal: argument 'data' .* must be in SBUF or PSUM"):
        run_tiles(body, (A,))


# ------------------------------------------------------------------------------------------------
# iota
# ------------------------------------------------------------------------------------------------

def test_iota_doc_example_channel_multiplier():
    (out,), tr = run_tiles(lambda o: nisa.iota(dst=o, pattern=[[1, 1]], offset=0, channel_multiplier=2),
                           (), [((64, 1), nl.int32)], trace=True)
    np.testing.assert_array_equal(out[:, 0], 2 * np.arange(64))
    assert (tr[0].engine, tr[0].attrs["elems"]) == ("gpsimd", 1)


def test_iota_multi_dim_pattern_matches_loops():
    pattern = [[100, 2], [-3, 3], [1, 4]]
    (out,) = run_tiles(lambda o: nisa.iota(dst=o, pattern=pattern, offset=7, channel_multiplier=1000),
                       (), [((5, 2, 12), nl.int32)])
    want = np.zeros((5, 24), np.int64)
    for c in range(5):
        i = 0
        for w in range(2):
            for z in range(3):
                for x in range(4):
                    want[c, i] = 7 + 1000 * c + 100 * w - 3 * z + x
                    i += 1
    np.testing.assert_array_equal(out.reshape(5, 24), want)


def test_iota_casts_int32_to_bf16_and_float32():
    b, f = run_tiles(lambda o1, o2: (nisa.iota(dst=o1, pattern=[[1, 4]], offset=256),
                                     nisa.iota(dst=o2, pattern=[[-1, 3]], offset=0, channel_multiplier=-2)),
                     (), [((1, 4), nl.bfloat16), ((2, 3), nl.float32)])
    # 256..259 in bf16 (8 significant bits): 256, 257->256 (tie, even), 258, 259->260 (tie, even)
    np.testing.assert_array_equal(b.astype(np.float32), [[256.0, 256.0, 258.0, 260.0]])
    np.testing.assert_array_equal(f, [[0.0, -1.0, -2.0], [-2.0, -3.0, -4.0]])


@pytest.mark.parametrize("kw, match", [
    (dict(pattern=[[1, 3]]), r"pattern \[\[1, 3\]\] generates 3 elements per partition but dst .* has 4"),
    (dict(pattern=[[1, 1]] * 5), r"pattern must be a list of 1 to 4 \[step, num\] pairs"),
    (dict(pattern=[[1, 2, 3]]), r"pattern\[0\] must be a \[step, num\] pair"),
    (dict(pattern=[[1, 4]], offset=1.5), r"argument 'offset' must be an int32 compile-time constant, got 1.5"),
    (dict(pattern=[[1, 4]], channel_multiplier=2 ** 31),
     r"argument 'channel_multiplier' = 2147483648 is outside the int32"),
    (dict(pattern=[[1, 0]]), r"pattern\[0\] num must be >= 1"),
])
def test_iota_rejections(kw, match):
    with pytest.raises(NkiValidationError, match=r"nisa.iota: " + match):
        run_tiles(lambda o: nisa.iota(dst=o, **kw), (), [((2, 4), nl.int32)])


def test_iota_rejects_psum_dst():
    with pytest.raises(NkiValidationError, match=r"iota: argument 'dst' .* must be in SBUF, got psum"):
        run_tiles(lambda o: nisa.iota(dst=o, pattern=[[1, 4]]), (), [((2, 4), nl.int32, "psum")])


# ------------------------------------------------------------------------------------------------
# > 128 partitions
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("call", [
    lambda big, t: nisa.tensor_tensor(dst=big, data1=big, data2=big, op=nl.add),
    lambda big, t: nisa.tensor_scalar(dst=big, data=big, op0=nl.add, operand0=1.0),
    lambda big, t: nisa.scalar_tensor_tensor(dst=big, data=big, op0=nl.add, operand0=1.0, op1=nl.add, operand1=big),
    lambda big, t: nisa.reciprocal(dst=t, data=big),
    lambda big, t: nisa.iota(dst=big, pattern=[[1, 4]]),
], ids=["tensor_tensor", "tensor_scalar", "scalar_tensor_tensor", "reciprocal", "iota"])
def test_more_than_128_partitions_rejected(call):
    def body(t):
        call(oversized_tile((256, 4), nl.float32), t)

    with pytest.raises(NkiValidationError, match=r"partition dimension 256 exceeds maximum 128"):
        run_tiles(body, (A,))


def test_shape_only_mode_validates_and_traces_without_values():
    """numerics=False (cost-model runs): instructions still validate, trace and mark dst written."""
    from nkilib.simulator.launcher import run_kernel
    from simkit import hbm_store, sbuf_load

    def kernel(a, i):
        x, xi = sbuf_load(a), sbuf_load(i)
        o = nl.ndarray(x.shape, nl.bfloat16, buffer=nl.sbuf)
        oi = nl.ndarray(xi.shape, nl.int32, buffer=nl.sbuf)
        r = nl.ndarray((4, 1), nl.float32, buffer=nl.sbuf)
        ps = nl.ndarray((8, 4), nl.float32, buffer=nl.psum)
        nisa.tensor_tensor(dst=oi, data1=xi, data2=xi, op=nl.add)
        nisa.tensor_scalar(dst=o, data=x, op0=nl.multiply, operand0=2.0)
        nisa.scalar_tensor_tensor(dst=o, data=x, op0=nl.add, operand0=1.0, op1=nl.add, operand1=x)
        nisa.reciprocal(dst=o, data=x)
        nisa.iota(dst=oi, pattern=[[1, 8]])
        nisa.activation(dst=o, op=nl.exp, data=x, reduce_op=nl.add, reduce_cmd=nisa.reduce_cmd.reset_reduce,
                        reduce_res=r)
        nisa.tensor_reduce(dst=r, op=nl.add, data=x, axis=1)
        nisa.nc_transpose(dst=ps, data=x)
        return hbm_store(o), hbm_store(oi), hbm_store(r)

    res = run_kernel(kernel, (np.ones((4, 8), np.float32), np.ones((4, 8), np.int32)), numerics=False, trace=True)
    assert res.outputs == (None, None, None)
    got = [(t.instr, t.engine) for t in res.trace if t.engine != "dma"]
    assert got == [("tensor_tensor", "gpsimd"), ("tensor_scalar", "vector"), ("scalar_tensor_tensor", "vector"),
                   ("reciprocal", "vector"), ("iota", "gpsimd"), ("activation", "scalar"),
                   ("tensor_reduce", "vector"), ("nc_transpose", "tensor")]
