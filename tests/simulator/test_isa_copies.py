"""dma_copy, dma_transpose, tensor_copy and memset (nc_matmul and the instruction trace: test_isa_matmul.py).

Spec sections §3.3 (conversions), §5.5 (tensor_copy, memset), §5.6 (DMA).
"""
import ml_dtypes
import numpy as np
import pytest

import nki.isa as nisa
import nki.language as nl
from simkit import BF16, bits, hbm_store, randn, sbuf_load, simulate

from nkilib.simulator.errors import NkiValidationError

E4M3 = ml_dtypes.float8_e4m3  # legacy NKI float8_e4m3 (max 240)
E4M3FN = ml_dtypes.float8_e4m3fn
E5M2 = ml_dtypes.float8_e5m2


def with_specials(a, codes):
    """Copy of a with its first len(codes) elements replaced by the given raw bit patterns."""
    a = np.array(a)
    bits(a.reshape(-1))[:len(codes)] = codes
    return a


SPECIAL_BITS = {
    np.dtype(np.float32): [0x7FC00001, 0xFFA00000, 0x7F800001, 0x7F800000, 0xFF800000, 0x80000000, 0x1, 0x807FFFFF],
    np.dtype(BF16): [0x7FC1, 0xFF81, 0x7F80, 0xFF80, 0x8000, 0x0001, 0x7FA5],
    np.dtype(E5M2): [0x7D, 0x7E, 0x7F, 0xFD, 0x7C, 0x80, 0x01],
    np.dtype(E4M3FN): [0x7F, 0xFF, 0x80, 0x01],
    np.dtype(np.int32): [0x80000000, 0x7FFFFFFF, 0xFFFFFFFF, 0],
}


def roundtrip(a):
    return hbm_store(sbuf_load(a))


# ---------------------------------------------------------------------------------------------
# dma_copy
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", list(SPECIAL_BITS), ids=str)
def test_dma_copy_hbm_sbuf_hbm_bit_exact(dtype):
    a = with_specials(randn(0, (16, 24), scale=3.0).astype(dtype), SPECIAL_BITS[dtype])
    out = simulate(roundtrip, a=a)
    assert out.dtype == dtype
    np.testing.assert_array_equal(bits(out), bits(a))


def test_dma_copy_hbm_to_hbm_and_sbuf_to_sbuf_and_reshaped_pairing():
    def k(a):
        h = nl.ndarray((8, 4), a.dtype, buffer=nl.hbm)
        nisa.dma_copy(dst=h, src=a)  # HBM -> HBM, [4, 8] -> [8, 4] in row-major order
        t = sbuf_load(h)
        t2 = nl.ndarray((8, 2, 2), a.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t2, src=t)  # SBUF -> SBUF
        return hbm_store(t2)

    a = randn(1, (4, 8))
    np.testing.assert_array_equal(simulate(k, a=a), a.reshape(8, 2, 2))


def _convert_kernel(dtype):
    def k(a):
        return hbm_store(sbuf_load(a, dtype))

    return k


def test_dma_copy_fp32_to_bf16_rne():
    # hand-computed ties: 1 + 2^-8 -> 1 (even), 1 + 3*2^-8 -> 1 + 2^-6 (even), -(1 + 2^-8) -> -1
    ties = np.array([[1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2**-140, 3.0e38, 65535.0]], np.float32)
    out = simulate(_convert_kernel(nl.bfloat16), a=ties)
    assert out.dtype == BF16
    np.testing.assert_array_equal(out.astype(np.float32)[0, :3], [1.0, 1 + 2**-6, -1.0])
    np.testing.assert_array_equal(out.astype(np.float32)[0, 5], 65536.0)
    a = randn(2, (32, 64), scale=100.0)
    np.testing.assert_array_equal(bits(simulate(_convert_kernel(nl.bfloat16), a=a)), bits(a.astype(BF16)))


@pytest.mark.parametrize("dtype,np_dtype", [(nl.float8_e4m3fn, E4M3FN), (nl.float8_e5m2, E5M2),
                                            (nl.float8_e4m3, E4M3), (nl.float16, np.float16)])
def test_dma_copy_fp32_to_low_precision_matches_ml_dtypes(dtype, np_dtype):
    a = randn(3, (16, 32), scale=20.0)
    out = simulate(_convert_kernel(dtype), a=a)
    assert out.dtype == np_dtype
    np.testing.assert_array_equal(bits(out), bits(a.astype(np_dtype)))


def test_dma_copy_float_to_int_rne_and_saturation():
    a = np.array([[2.5, 3.5, -2.5, -0.5, 1e10, -1e10, np.nan, 7.49]], np.float32)
    out = simulate(_convert_kernel(nl.int32), a=a)
    np.testing.assert_array_equal(out, [[2, 4, -2, 0, 2**31 - 1, -2**31, 0, 7]])
    out8 = simulate(_convert_kernel(nl.uint8), a=a)
    np.testing.assert_array_equal(out8, [[2, 4, 0, 0, 255, 0, 0, 7]])


def test_dma_copy_bf16_to_fp32_exact():
    a = randn(4, (8, 8)).astype(BF16)
    out = simulate(_convert_kernel(nl.float32), a=a)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, a.astype(np.float32))


def _dma_error(body, **inputs):
    def k(a):
        body(a)

    return simulate(k, a=inputs.get("a", randn(5, (4, 8))))


@pytest.mark.parametrize("case,msg", [
    ("psum_dst", "'dst'.*is in PSUM; DMA cannot access PSUM"),
    ("psum_src", "'src'.*is in PSUM; DMA cannot access PSUM"),
    ("count", r"element counts differ: dst \(4, 7\) has 28, src \(4, 8\) has 32"),
    ("x4", "not supported for MX x4 dtypes"),
    ("hwdge", "hwdge requires equal dtypes"),
    ("engine_no_hwdge", "only valid with dge_mode=hwdge"),
    ("engine_raw_int", "must be an nisa.engine member"),
    ("dge_raw", "dge_mode must be an nisa.dge_mode member"),
    ("priority_range", "priority must be 0..3"),
    ("not_tensor", "must be an NKI tensor"),
])
def test_dma_copy_rejections(case, msg):
    def body(a):
        t = nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf)
        if case == "psum_dst":
            nisa.dma_copy(dst=nl.ndarray((4, 8), nl.float32, buffer=nl.psum), src=a)
        elif case == "psum_src":
            p = nl.ndarray((4, 8), nl.float32, buffer=nl.psum)
            nisa.memset(dst=p, value=0.0)
            nisa.dma_copy(dst=t, src=p)
        elif case == "count":
            nisa.dma_copy(dst=t[:, 0:7], src=a)
        elif case == "x4":
            words = nl.ndarray((4, 8), nl.uint32, buffer=nl.sbuf)
            nisa.memset(dst=words, value=0)
            nisa.dma_copy(dst=t, src=words.view(nl.float8_e4m3fn_x4))
        elif case == "hwdge":
            nisa.dma_copy(dst=nl.ndarray((4, 8), nl.bfloat16, buffer=nl.sbuf), src=a, dge_mode=nisa.dge_mode.hwdge)
        elif case == "engine_no_hwdge":
            nisa.dma_copy(dst=t, src=a, engine=nisa.engine.sync)
        elif case == "engine_raw_int":
            nisa.dma_copy(dst=t, src=a, engine=6, dge_mode=nisa.dge_mode.hwdge)
        elif case == "dge_raw":
            nisa.dma_copy(dst=t, src=a, dge_mode=2)
        elif case == "priority_range":
            nisa.dma_copy(dst=t, src=a, priority=4)
        elif case == "not_tensor":
            nisa.dma_copy(dst=t, src=np.zeros((4, 8), np.float32))

    with pytest.raises(NkiValidationError, match=msg):
        _dma_error(body)


def test_dma_copy_modes_accepted(set_target):
    def k(a):
        t = nl.ndarray(a.shape, a.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=a, dge_mode=nisa.dge_mode.hwdge, engine=nisa.engine.scalar)
        u = nl.ndarray(a.shape, a.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=u, src=t, dge_mode=nisa.dge_mode.swdge, oob_mode=nisa.oob_mode.skip)
        return hbm_store(u)

    a = randn(6, (4, 8))
    set_target("trn2")
    np.testing.assert_array_equal(simulate(k, a=a), a)

    def prio(a):
        t = nl.ndarray(a.shape, a.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=a, priority=2)
        return hbm_store(t)

    with pytest.raises(NkiValidationError, match="priority requires NeuronCore-v4"):
        simulate(prio, a=a)
    set_target("trn3")
    np.testing.assert_array_equal(simulate(prio, a=a), a)


# ---------------------------------------------------------------------------------------------
# dma_transpose
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, BF16, np.int16], ids=str)
def test_dma_transpose_2d_exact(dtype):
    def k(a):
        t = nl.ndarray((a.shape[1], a.shape[0]), a.dtype, buffer=nl.sbuf)
        nisa.dma_transpose(dst=t, src=a)  # HBM -> SBUF
        t2 = nl.ndarray(a.shape, a.dtype, buffer=nl.sbuf)
        nisa.dma_transpose(dst=t2, src=t, axes=(1, 0))  # SBUF -> SBUF
        return hbm_store(t), hbm_store(t2)

    a = randn(7, (16, 40), scale=50.0).astype(dtype)
    if np.dtype(dtype) in SPECIAL_BITS:
        a = with_specials(a, SPECIAL_BITS[np.dtype(dtype)])
    t, t2 = simulate(k, a=a)
    np.testing.assert_array_equal(bits(t), bits(a).T)
    np.testing.assert_array_equal(bits(t2), bits(a))


def test_dma_transpose_3d():
    def k(a):
        t = nl.ndarray((5, 3, 4), a.dtype, buffer=nl.sbuf)
        nisa.dma_transpose(dst=t, src=a)
        return hbm_store(t)

    a = randn(8, (4, 3, 5)).astype(BF16)
    np.testing.assert_array_equal(bits(simulate(k, a=a)), bits(a).transpose(2, 1, 0))


@pytest.mark.parametrize("case,msg", [
    ("shape", r"dst shape \(8, 4\) must equal the transposed src shape \(16, 4\)"),
    ("packed_x4", r"dtype float8_e4m3fn_x4 unsupported; dma_transpose moves 1-, 2- or 4-byte elements "
                  r"\(not packed x4\)"),
    ("dtype", "src dtype float32 must equal dst dtype bfloat16"),
    ("axes", r"axes \(0, 1\) unsupported"),
    ("dst_hbm", "dst must be in SBUF"),
    ("hwdge_rows", r"hwdge 2-D transpose requires src.shape\[0\] == 16, got 4"),
    ("hwdge_4byte", "hwdge requires a 2-byte dtype"),
])
def test_dma_transpose_rejections(case, msg):
    def k(a):
        if case == "shape":
            nisa.dma_transpose(dst=nl.ndarray((8, 4), nl.float32, buffer=nl.sbuf), src=a)
        elif case == "packed_x4":
            t = sbuf_load(a).view(nl.float8_e4m3fn_x4)
            nisa.dma_transpose(dst=nl.ndarray((16, 4), nl.float8_e4m3fn_x4, buffer=nl.sbuf), src=t)
        elif case == "dtype":
            nisa.dma_transpose(dst=nl.ndarray((16, 4), nl.bfloat16, buffer=nl.sbuf), src=a)
        elif case == "axes":
            nisa.dma_transpose(dst=nl.ndarray((16, 4), nl.float32, buffer=nl.sbuf), src=a, axes=(0, 1))
        elif case == "dst_hbm":
            nisa.dma_transpose(dst=nl.ndarray((16, 4), nl.float32, buffer=nl.shared_hbm), src=a)
        elif case == "hwdge_rows":
            t = sbuf_load(a, nl.bfloat16)
            nisa.dma_transpose(dst=nl.ndarray((16, 4), nl.bfloat16, buffer=nl.sbuf), src=t,
                               dge_mode=nisa.dge_mode.hwdge)
        elif case == "hwdge_4byte":
            nisa.dma_transpose(dst=nl.ndarray((16, 4), nl.float32, buffer=nl.sbuf), src=a,
                               dge_mode=nisa.dge_mode.hwdge)

    with pytest.raises(NkiValidationError, match=msg):
        simulate(k, a=randn(9, (4, 16)))


# ---------------------------------------------------------------------------------------------
# tensor_copy
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", list(SPECIAL_BITS), ids=str)
@pytest.mark.parametrize("engine", ["vector", "scalar", "gpsimd", "unknown"])
def test_tensor_copy_same_dtype_bit_exact(dtype, engine):
    def k(a):
        t = sbuf_load(a)
        u = nl.ndarray(a.shape, a.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=u, src=t, engine=getattr(nisa.engine, engine))
        return hbm_store(u)

    a = with_specials(randn(10, (8, 16), scale=4.0).astype(dtype), SPECIAL_BITS[dtype])
    np.testing.assert_array_equal(bits(simulate(k, a=a)), bits(a))


def test_tensor_copy_cross_dtype_rne_and_psum_and_shapes():
    def k(a):
        t = sbuf_load(a)  # fp32 [8, 2, 16]
        p = nl.ndarray((8, 32), nl.bfloat16, buffer=nl.psum)
        nisa.tensor_copy(dst=p, src=t)  # SBUF -> PSUM, shapes differ, same free size; fp32 -> bf16 RNE
        b = nl.ndarray((8, 4, 8), nl.bfloat16, buffer=nl.sbuf)
        nisa.tensor_copy(dst=b, src=p, engine=nisa.engine.scalar)  # PSUM -> SBUF, same dtype
        i = nl.ndarray((8, 32), nl.int8, buffer=nl.sbuf)
        nisa.tensor_copy(dst=i, src=t)  # fp32 -> int8: RNE + saturation
        return hbm_store(b), hbm_store(i)

    a = randn(11, (8, 2, 16), scale=100.0)
    a.reshape(-1)[:4] = [1 + 2**-8, 1 + 3 * 2**-8, 127.5, -300.0]
    b, i = simulate(k, a=a)
    np.testing.assert_array_equal(bits(b), bits(a.astype(BF16)).reshape(8, 4, 8))
    assert list(b.reshape(-1)[:2].astype(np.float32)) == [1.0, 1 + 2**-6]
    expect_i = np.clip(np.rint(a.reshape(8, 32)), -128, 127).astype(np.int8)
    np.testing.assert_array_equal(i, expect_i)
    assert list(i.reshape(-1)[2:4]) == [127, -128]


@pytest.mark.parametrize("case,msg", [
    ("partitions", "'dst' has 4 partitions but 'src' has 8"),
    ("free", "'dst' has 15 elements per partition but 'src' has 16"),
    ("gpsimd_psum", "engine gpsimd cannot access PSUM"),
    ("tensor_engine", "engine tensor is not supported"),
    ("raw_engine", "raw ints rejected"),
    ("hbm", "must be in SBUF or PSUM, got private_hbm"),
    ("x4", "x4 tiles copy only to the same dtype"),
])
def test_tensor_copy_rejections(case, msg):
    def k(a):
        t = sbuf_load(a)  # [8, 16]
        if case == "partitions":
            nisa.tensor_copy(dst=nl.ndarray((4, 32), nl.float32, buffer=nl.sbuf), src=t)
        elif case == "free":
            nisa.tensor_copy(dst=nl.ndarray((8, 15), nl.float32, buffer=nl.sbuf), src=t)
        elif case == "gpsimd_psum":
            nisa.tensor_copy(dst=nl.ndarray((8, 16), nl.float32, buffer=nl.psum), src=t, engine=nisa.engine.gpsimd)
        elif case == "tensor_engine":
            nisa.tensor_copy(dst=nl.ndarray((8, 16), nl.float32, buffer=nl.sbuf), src=t, engine=nisa.engine.tensor)
        elif case == "raw_engine":
            nisa.tensor_copy(dst=nl.ndarray((8, 16), nl.float32, buffer=nl.sbuf), src=t, engine=5)
        elif case == "hbm":
            nisa.tensor_copy(dst=nl.ndarray((8, 16), nl.float32, buffer=nl.sbuf), src=a)
        elif case == "x4":
            w = nl.ndarray((8, 16), nl.uint32, buffer=nl.sbuf)
            nisa.memset(dst=w, value=0)
            nisa.tensor_copy(dst=nl.ndarray((8, 16), nl.float32, buffer=nl.sbuf), src=w.view(nl.float8_e5m2_x4))

    with pytest.raises(NkiValidationError, match=msg):
        simulate(k, a=randn(12, (8, 16)))


# ---------------------------------------------------------------------------------------------
# memset
# ---------------------------------------------------------------------------------------------

def test_memset_values():
    def k(x):
        outs = []
        for dtype, value in ((nl.int32, 7), (nl.int32, np.int16(-3)), (nl.bfloat16, 1.5), (nl.float32, -0.25),
                             (nl.float32, np.float32(2.0)), (nl.uint8, 255), (nl.float8_e8m0fnu, 0.25)):
            t = nl.ndarray((4, 3), dtype, buffer=nl.sbuf)
            nisa.memset(dst=t, value=value)
            outs.append(hbm_store(t))
        w = nl.ndarray((4, 3), nl.uint32, buffer=nl.sbuf)
        nisa.memset(dst=w.view(nl.float8_e4m3fn_x4), value=0)  # x4: raw zero words
        outs.append(hbm_store(w))
        p = nl.ndarray((4, 3), nl.float32, buffer=nl.psum)
        nisa.memset(dst=p, value=3.0, engine=nisa.engine.vector)
        r = nl.ndarray((4, 3), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=r, src=p)
        outs.append(hbm_store(r))
        return tuple(outs)

    outs = simulate(k, x=np.zeros((1, 1), np.float32))
    expect = [(np.int32, 7), (np.int32, -3), (BF16, 1.5), (np.float32, -0.25), (np.float32, 2.0), (np.uint8, 255)]
    for out, (dt, v) in zip(outs, expect):
        assert out.dtype == dt
        np.testing.assert_array_equal(out, np.full((4, 3), v, dt))
    e8 = outs[6]
    assert e8.dtype == ml_dtypes.float8_e8m0fnu
    np.testing.assert_array_equal(e8.view(np.uint8), np.full((4, 3), 125, np.uint8))  # 2^(125-127)
    np.testing.assert_array_equal(outs[7], np.zeros((4, 3), np.uint32))
    np.testing.assert_array_equal(outs[8], np.full((4, 3), 3.0, np.float32))


@pytest.mark.parametrize("dtype,value,msg", [
    (nl.int32, 1.0, "value for integer dtype int32 must be an int, got float 1.0"),
    (nl.uint8, True, "must be an int, got bool"),
    (nl.float32, 16777217, "int 16777217 is not exactly representable in dtype float32"),
    (nl.bfloat16, 257, "int 257 is not exactly representable in dtype bfloat16"),
    (nl.int8, 128, r"value' 128 is outside the range \[-128, 127\] of dtype int8"),
    (nl.bfloat16, "1.0", "must be a float, got str"),
    (nl.float8_e4m3fn_x4, 1, "packed dtype float8_e4m3fn_x4 can only be set to 0"),
    (nl.float4_e2m1fn_x4, 0.5, "can only be set to 0"),
    (nl.float8_e8m0fnu, 3.0, "float power of two"),
])
def test_memset_value_type_rules(dtype, value, msg):
    def k(x):
        t = nl.ndarray((4, 4), dtype, buffer=nl.sbuf)
        nisa.memset(dst=t, value=value)

    with pytest.raises(NkiValidationError, match=msg):
        simulate(k, x=np.zeros((1, 1), np.float32))


def test_memset_engine_rules():
    def k(x):
        p = nl.ndarray((4, 4), nl.float32, buffer=nl.psum)
        nisa.memset(dst=p, value=0.0, engine=nisa.engine.gpsimd)

    with pytest.raises(NkiValidationError, match="engine gpsimd cannot access PSUM"):
        simulate(k, x=np.zeros((1, 1), np.float32))

    def k2(x):
        nisa.memset(dst=nl.ndarray((4, 4), nl.float32, buffer=nl.sbuf), value=0.0, engine=nisa.engine.scalar)

    with pytest.raises(NkiValidationError, match="engine scalar is not supported"):
        simulate(k2, x=np.zeros((1, 1), np.float32))
