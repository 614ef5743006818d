"""hw_quantize_tile, the K-interleave invariant, hw_matmul_mx and mx_matmul (nkilib.mx)."""


import ml_dtypes
import numpy as np
import pytest

import nkilib.mx as mx
import simkit

E4 = "float8_e4m3fn"
E5 = "float8_e5m2"
RULES = ("neuron", "ocp_floor", "rceil")


def bits_equal(a, b):
    """Bit equality of the float32 values of a and b (simkit.bits_equal after the cast)."""
    return simkit.bits_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def hw_dequant_tile(words, scales, fmt):
    """[P, F/4] words + group-order scales [P/8, F/4] -> float32 [P, F] (straightforward)."""
    vals = mx.decode_elements(mx.unpack_x4(words), fmt)
    f = mx.scale_bytes_to_float(scales)
    return (vals * np.repeat(np.repeat(f, 8, axis=0), 4, axis=1)).astype(np.float32)


# ------------------------------------------------------------------------------------------------
# hw_quantize_tile
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("P,F", [(32, 4), (64, 24), (96, 8), (128, 64)])
@pytest.mark.parametrize("fmt", ["float8_e4m3fn_x4", "float8_e5m2_x4"])
def test_hw_quantize_tile_groups(P, F, fmt):
    rng = np.random.default_rng(P * F)
    src = (rng.standard_normal((P, F)) * np.exp2(rng.integers(-10, 10, (P, 1)))).astype(ml_dtypes.bfloat16)
    words, scales = mx.hw_quantize_tile(src, fmt)
    assert words.shape == (P, F // 4) and words.dtype == np.uint32
    assert scales.shape == (P // 8, F // 4) and scales.dtype == np.uint8
    codes = mx.unpack_x4(words)
    for g in range(P // 8):
        for j in range(F // 4):
            blk = src[8 * g: 8 * g + 8, 4 * j: 4 * j + 4]
            c, s = mx.quantize_blocks(blk.reshape(32), fmt)
            assert int(scales[g, j]) == int(s)
            assert np.array_equal(codes[8 * g: 8 * g + 8, 4 * j: 4 * j + 4], c.reshape(8, 4))


def test_hw_quantize_tile_flattens_and_rules():
    rng = np.random.default_rng(0)
    src = rng.standard_normal((32, 2, 8)).astype(np.float32)
    for rule in RULES:
        a = mx.hw_quantize_tile(src, E5, rule)
        b = mx.hw_quantize_tile(src.reshape(32, 16), E5, rule)
        assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    # rules differ as specified: neuron byte = ocp_floor byte + 1
    assert np.array_equal(mx.hw_quantize_tile(src, E4, "neuron")[1],
                          mx.hw_quantize_tile(src, E4, "ocp_floor")[1] + 1)


@pytest.mark.parametrize("shape,match", [((16, 8), "P=16"), ((48, 8), "P=48"), ((256, 8), "P=256"),
                                         ((32, 6), "F=6"), ((32, 0), "F=0")])
def test_hw_quantize_tile_errors(shape, match):
    with pytest.raises(ValueError, match=match):
        mx.hw_quantize_tile(np.ones(shape, np.float32), E4)


def test_hw_quantize_tile_rejects_fp4():
    with pytest.raises(ValueError, match="float4_e2m1fn_x4"):
        mx.hw_quantize_tile(np.ones((32, 8), np.float32), "float4_e2m1fn_x4")


# ------------------------------------------------------------------------------------------------
# interleave invariant: quantize_mx(axis=0, scheme) == hw_quantize_tile(interleave_k(tile, scheme))
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["1x32", "wrapX"])
@pytest.mark.parametrize("K,k_tile,N", [(128, 128, 1), (256, 256, 5), (512, 512, 16),
                                        (1024, 512, 3), (896, 512, 4), (640, 256, 2)])
@pytest.mark.parametrize("rule", RULES)
def test_interleave_invariant(scheme, K, k_tile, N, rule):
    rng = np.random.default_rng(K * 7 + N)
    x = (rng.standard_normal((K, N)) * np.exp2(rng.integers(-20, 20, (K // 8, 1)).repeat(8, 0)))
    x = x.astype(ml_dtypes.bfloat16)
    x[rng.random((K, N)) < 0.03] = 0
    for fmt in (E4, E5):
        t = mx.quantize_mx(x, axis=0, elem_format=fmt, scale_rule=rule, scheme=scheme, k_tile=k_tile)
        deq = t.dequantize()
        for start in range(0, K, k_tile):
            T = min(k_tile, K - start)
            tile = x[start: start + T]
            words, sc = mx.hw_quantize_tile(mx.interleave_k(tile, scheme), fmt, rule)
            # codes, bit for bit
            codes = mx.deinterleave_k(mx.unpack_x4(words), scheme)
            assert np.array_equal(codes, t.codes[start: start + T])
            # scales: hw group g of this tile == logical group start/32 + g
            assert np.array_equal(sc, t.scales[start // 32: start // 32 + T // 32])
            # dequantized values, bit for bit
            hw = mx.deinterleave_k(hw_dequant_tile(words, sc, fmt), scheme)
            assert bits_equal(hw, deq[start: start + T])


# ------------------------------------------------------------------------------------------------
# hw_matmul_mx
# ------------------------------------------------------------------------------------------------


def decode_operand_ref(words, fmt):
    if fmt == "float4_e2m1fn_x4":
        return mx.decode_fp4(mx.unpack_fp4_x4(words))
    return mx.decode_elements(mx.unpack_x4(words), fmt)


def hw_matmul_ref(sw, mw, ss, ms, sf, mf):
    """Straightforward float64 dequantize-then-matmul of nc_matmul_mx operands."""
    K, M = sw.shape
    N = mw.shape[1]
    S = decode_operand_ref(sw, sf).astype(np.float64).reshape(K, M, 4)
    V = decode_operand_ref(mw, mf).astype(np.float64).reshape(K, N, 4)
    S = S * np.repeat(mx.scale_bytes_to_float(ss).astype(np.float64), 8, axis=0)[:, :, None]
    V = V * np.repeat(mx.scale_bytes_to_float(ms).astype(np.float64), 8, axis=0)[:, :, None]
    out = np.einsum("pmk,pnk->mn", S, V)
    absout = np.einsum("pmk,pnk->mn", np.abs(S), np.abs(V))
    return out, absout


def random_words(rng, shape, fmt):
    if fmt == "float4_e2m1fn_x4":
        return rng.integers(0, 2 ** 16, shape, dtype=np.uint32).astype(np.uint16)
    f = mx.element_format(fmt)
    codes = rng.integers(0, 256, shape[:-1] + (4 * shape[-1],), dtype=np.uint8)
    bad = ~np.isfinite(mx.decode_elements(codes, f))  # no NaN / Inf codes here
    codes[bad] = 0x01
    return mx.pack_x4(codes)


@pytest.mark.parametrize("sf,mf", [("float8_e4m3fn_x4", "float8_e4m3fn_x4"),
                                   ("float8_e5m2_x4", "float8_e4m3fn_x4"),
                                   ("float8_e5m2_x4", "float8_e5m2_x4"),
                                   ("float4_e2m1fn_x4", "float8_e5m2_x4"),
                                   ("float4_e2m1fn_x4", "float4_e2m1fn_x4")])
@pytest.mark.parametrize("K,M,N", [(32, 2, 8), (128, 128, 512), (96, 16, 40)])
def test_hw_matmul_vs_reference(sf, mf, K, M, N):
    rng = np.random.default_rng(K + M + N)
    sw, mw = random_words(rng, (K, M), sf), random_words(rng, (K, N), mf)
    ss = rng.integers(100, 150, (K // 8, M)).astype(np.uint8)
    ms = rng.integers(100, 150, (K // 8, N)).astype(np.uint8)
    got = mx.hw_matmul_mx(sw, mw, ss, ms, sf, mf)
    assert got.dtype == np.float32 and got.shape == (M, N)
    ref, absref = hw_matmul_ref(sw, mw, ss, ms, sf, mf)
    # both are float64 sums rounded once to float32: they differ by at most one float32 ulp
    assert np.all(np.abs(got - ref) <= 2.0 ** -22 * absref)


def test_hw_matmul_exact_when_sums_are_exact():
    # e4m3fn codes (multiples of 2**-9, |c| <= 448) x scales in [2**-9, 2**-6]: every product is a
    # multiple of 2**-36 and every partial sum is below 512 * 7 * 7 < 2**15, a 51-bit window, so
    # any float64 summation order is exact -> bit equality with the reference.
    rng = np.random.default_rng(99)
    K, M, N = 128, 64, 96
    sw, mw = random_words(rng, (K, M), E4), random_words(rng, (K, N), E4)
    ss = rng.integers(118, 122, (K // 8, M)).astype(np.uint8)
    ms = rng.integers(118, 122, (K // 8, N)).astype(np.uint8)
    ref, _ = hw_matmul_ref(sw, mw, ss, ms, E4, E4)
    assert bits_equal(mx.hw_matmul_mx(sw, mw, ss, ms, "float8_e4m3fn_x4", "float8_e4m3fn_x4"),
                      ref.astype(np.float32))


def test_hw_matmul_by_hand():
    # K = 8 partitions (one group): stationary column 0 holds 1.0 (0x38) in every byte with scale
    # byte 128 (x2); moving column 0 holds 0.5 (0x30) in byte 0 only, scale 126 (x0.5).
    # dst[0, 0] = 8 partitions * (2 * 0.25) * 1 element = 4.0
    sw = np.full((8, 1), 0x38383838, np.uint32)
    mw = np.full((8, 1), 0x00000030, np.uint32)
    out = mx.hw_matmul_mx(sw, mw, np.array([[128]], np.uint8), np.array([[126]], np.uint8),
                          "float8_e4m3fn_x4", "float8_e4m3fn_x4")
    assert out.tolist() == [[4.0]]
    # fp4: nibble 7 = 6.0 in slot 3 of stationary, moving e5m2 1.0 (0x3C) in slot 3: 8 * 6 = 48
    out = mx.hw_matmul_mx(np.full((8, 1), 0x7000, np.uint16), np.full((8, 1), 0x3C000000, np.uint32),
                          np.array([[127]], np.uint8), np.array([[127]], np.uint8),
                          "float4_e2m1fn_x4", "float8_e5m2_x4")
    assert out.tolist() == [[48.0]]


def test_hw_matmul_nan_scale_and_e8m0_dtype():
    rng = np.random.default_rng(4)
    K, M, N = 64, 6, 10
    sw, mw = random_words(rng, (K, M), E4), random_words(rng, (K, N), E4)
    ss = np.full((K // 8, M), 127, np.uint8)
    ms = np.full((K // 8, N), 127, np.uint8)
    ss[3, 2] = 255  # INFERRED (docs/simulator.md#choice-mx-numerics): a NaN scale poisons its output row / column
    ms[0, 7] = 255
    out = mx.hw_matmul_mx(sw, mw, ss, ms, E4, E4)
    nan = np.zeros((M, N), bool)
    nan[2, :] = True
    nan[:, 7] = True
    assert np.array_equal(np.isnan(out), nan)
    # float8_e8m0fnu scale arrays are accepted (same bytes)
    out2 = mx.hw_matmul_mx(sw, mw, ss.view(ml_dtypes.float8_e8m0fnu), ms, E4, E4)
    assert bits_equal(out, out2)


def test_hw_matmul_errors():
    w = np.zeros((32, 4), np.uint32)
    s = np.zeros((4, 4), np.uint8)
    with pytest.raises(ValueError, match="float8_e4m3"):
        mx.hw_matmul_mx(w, w, s, s, "float8_e4m3", E4)
    with pytest.raises(TypeError):
        mx.hw_matmul_mx(w.astype(np.uint16), w, s, s, E4, E4)  # fp8 needs 32-bit words
    with pytest.raises(TypeError):
        mx.hw_matmul_mx(w, w, s, s, "float4_e2m1fn_x4", E4)  # fp4 needs 16-bit words
    with pytest.raises(ValueError, match="shape"):
        mx.hw_matmul_mx(w, w, np.zeros((32, 4), np.uint8), s, E4, E4)  # quadrant rows, not groups
    with pytest.raises(ValueError, match="K="):
        mx.hw_matmul_mx(w, np.zeros((64, 4), np.uint32), s, np.zeros((8, 4), np.uint8), E4, E4)


# ------------------------------------------------------------------------------------------------
# mx_matmul
# ------------------------------------------------------------------------------------------------


def _operands(rng, M, K, N, fmt, scheme="1x32", rule="neuron", k_tile=512):
    A = rng.standard_normal((M, K)).astype(np.float32)
    B = rng.standard_normal((K, N)).astype(np.float32)
    a = mx.quantize_mx(A, axis=1, elem_format=fmt, scale_rule=rule, scheme=scheme, k_tile=k_tile)
    b = mx.quantize_mx(B, axis=0, elem_format=fmt, scale_rule=rule, scheme=scheme, k_tile=k_tile)
    return a, b


@pytest.mark.parametrize("fmt", [E4, E5])
def test_mx_matmul_vs_dequantized_matmul(fmt):
    rng = np.random.default_rng(21)
    M, K, N = 24, 1536, 40
    a, b = _operands(rng, M, K, N, fmt)
    A, B = a.dequantize().astype(np.float64), b.dequantize().astype(np.float64)
    out = mx.mx_matmul(a, b)
    assert out.dtype == np.float32 and out.shape == (M, N)
    ref = A @ B
    # 3 tiles: each tile sum rounded to fp32 once, then 2 fp32 adds -> <= 3 half-ulps of the partial
    # magnitudes, all bounded by |A| @ |B|
    assert np.all(np.abs(out - ref) <= 3 * 2.0 ** -24 * (np.abs(A) @ np.abs(B)))
    # exactly reproducible
    assert bits_equal(out, mx.mx_matmul(a, b))
    # the documented accumulation model, step by step
    acc = (A[:, :512] @ B[:512]).astype(np.float32)
    for s in (512, 1024):
        acc = acc + (A[:, s: s + 512] @ B[s: s + 512]).astype(np.float32)
    assert acc.dtype == np.float32
    assert np.all(np.abs(out - acc) <= 2.0 ** -23 * np.abs(acc))
    # k_tile >= K: a single rounding of the float64 sum
    one = mx.mx_matmul(a, b, k_tile=K)
    assert np.all(np.abs(one - ref) <= 2.0 ** -23 * np.abs(ref) + 1e-30)


def test_mx_matmul_single_tile_exact():
    # e4m3fn with randn data: products are multiples of ~2**-38 and |sum| < 2**13, so float64 sums
    # are exact in any order; one tile -> bit-identical to float64 matmul rounded to float32.
    rng = np.random.default_rng(5)
    a, b = _operands(rng, 16, 512, 24, E4)
    ref = (a.dequantize().astype(np.float64) @ b.dequantize().astype(np.float64)).astype(np.float32)
    assert bits_equal(mx.mx_matmul(a, b), ref)


@pytest.mark.parametrize("scheme", ["1x32", "wrapX"])
def test_mx_matmul_equals_hw_tiles(scheme):
    # End to end: load each 512-long K tile with interleave_k, quantize with hw_quantize_tile, run
    # hw_matmul_mx and accumulate in float32 as PSUM would. With e4m3fn randn data all float64 sums
    # are exact (see test above), so the result equals mx_matmul bit for bit.
    rng = np.random.default_rng(77)
    M, K, N = 32, 1024, 48
    A = rng.standard_normal((M, K)).astype(ml_dtypes.bfloat16)
    B = rng.standard_normal((K, N)).astype(ml_dtypes.bfloat16)
    a = mx.quantize_mx(A, axis=1, scheme=scheme)
    b = mx.quantize_mx(B, axis=0, scheme=scheme)
    acc = None
    for s in range(0, K, 512):
        sw, ss = mx.hw_quantize_tile(mx.interleave_k(A[:, s: s + 512].T, scheme), "float8_e4m3fn_x4")
        mw, ms = mx.hw_quantize_tile(mx.interleave_k(B[s: s + 512], scheme), "float8_e4m3fn_x4")
        part = mx.hw_matmul_mx(sw, mw, ss, ms, "float8_e4m3fn_x4", "float8_e4m3fn_x4")
        acc = part if acc is None else acc + part
    assert bits_equal(acc, mx.mx_matmul(a, b))


def test_mx_matmul_errors():
    rng = np.random.default_rng(1)
    a, b = _operands(rng, 4, 64, 8, E4)
    with pytest.raises(ValueError, match="axis 1"):
        mx.mx_matmul(mx.quantize_mx(rng.standard_normal((64, 4)), axis=0), b)
    with pytest.raises(ValueError, match="axis 0"):
        mx.mx_matmul(a, mx.quantize_mx(rng.standard_normal((8, 64)), axis=1))
    with pytest.raises(ValueError, match="K=64"):
        mx.mx_matmul(a, mx.quantize_mx(rng.standard_normal((96, 8)), axis=0))
    with pytest.raises(ValueError):
        mx.mx_matmul(a, b, k_tile=0)
    with pytest.raises(TypeError):
        mx.mx_matmul(a.dequantize(), b)
