"""Formats, decoding, x4 packing, quadrant scale rows and K interleaving (nkilib.mx)."""

import dataclasses

import ml_dtypes
import numpy as np
import pytest

import nkilib.mx as mx


# ------------------------------------------------------------------------------------------------
# formats
# ------------------------------------------------------------------------------------------------


def test_element_formats_table():
    e4 = mx.ELEMENT_FORMATS["float8_e4m3fn"]
    e5 = mx.ELEMENT_FORMATS["float8_e5m2"]
    assert (e4.name, e4.ml_dtype, e4.emax, e4.max_normal) == (
        "float8_e4m3fn", ml_dtypes.float8_e4m3fn, 8, 448.0)
    assert (e5.name, e5.ml_dtype, e5.emax, e5.max_normal) == (
        "float8_e5m2", ml_dtypes.float8_e5m2, 15, 57344.0)
    assert e4.mantissa_bits == 3 and e5.mantissa_bits == 2
    assert e4.nan_code == 0x7F and e5.nan_code == 0x7E
    # max_normal is exactly the largest finite value of the ml_dtypes type
    for f in (e4, e5):
        assert float(ml_dtypes.finfo(f.ml_dtype).max) == f.max_normal
    with pytest.raises(dataclasses.FrozenInstanceError):
        e4.emax = 3


@pytest.mark.parametrize("name,base", [
    ("float8_e4m3fn", "float8_e4m3fn"), ("float8_e4m3fn_x4", "float8_e4m3fn"),
    ("float8_e5m2", "float8_e5m2"), ("float8_e5m2_x4", "float8_e5m2"),
    (ml_dtypes.float8_e5m2, "float8_e5m2"), (np.dtype(ml_dtypes.float8_e4m3fn), "float8_e4m3fn"),
])
def test_element_format_lookup(name, base):
    assert mx.element_format(name) is mx.ELEMENT_FORMATS[base]
    assert mx.element_format(mx.ELEMENT_FORMATS[base]) is mx.ELEMENT_FORMATS[base]


@pytest.mark.parametrize("bad", ["float8_e4m3", "float4_e2m1fn_x4", "bfloat16", "e4m3", "", 7, None])
def test_element_format_rejects(bad):
    with pytest.raises(ValueError) as ei:
        mx.element_format(bad)
    msg = str(ei.value)
    assert repr(bad) in msg
    for ok in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fn_x4", "float8_e5m2_x4"):
        assert ok in msg


def test_scale_rules_and_bad_rule():
    assert mx.SCALE_RULES == ("neuron", "ocp_floor", "rceil")
    with pytest.raises(ValueError, match="'ocp'"):
        mx.quantize_blocks(np.ones((1, 32), np.float32), "float8_e4m3fn", "ocp")


def test_decode_elements_matches_ml_dtypes_all_codes():
    codes = np.arange(256, dtype=np.uint8)
    for name, fmt in mx.ELEMENT_FORMATS.items():
        got = mx.decode_elements(codes, name)
        want = codes.view(fmt.ml_dtype).astype(np.float32)
        assert got.dtype == np.float32
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    # a few by hand: e4m3fn 0x38 = 1.0, 0x7E = 448, 0x01 = 2**-9, 0x80 = -0.0, 0x7F = NaN
    v = mx.decode_elements(np.array([0x38, 0x7E, 0x01, 0x80, 0x7F], np.uint8), "float8_e4m3fn")
    assert v[:3].tolist() == [1.0, 448.0, 2.0 ** -9]
    assert v[3] == 0 and np.signbit(v[3]) and np.isnan(v[4])
    # e5m2 0x3C = 1.0, 0x7B = 57344, 0x7C = +Inf, 0x01 = 2**-16
    v = mx.decode_elements(np.array([0x3C, 0x7B, 0x7C, 0x01], np.uint8), "float8_e5m2_x4")
    assert v.tolist() == [1.0, 57344.0, np.inf, 2.0 ** -16]


def test_scale_bytes_to_float():
    b = np.array([0, 1, 119, 126, 127, 128, 254, 255], np.uint8)
    f = mx.scale_bytes_to_float(b)
    assert f.dtype == np.float32
    assert f[:7].tolist() == [2.0 ** -127, 2.0 ** -126, 2.0 ** -8, 0.5, 1.0, 2.0, 2.0 ** 127]
    assert np.isnan(f[7])
    assert mx.scale_bytes_to_float(np.arange(256, dtype=np.uint8))[:255].min() > 0


def test_decode_fp4_lut():
    # OCP e2m1 values (nkilib/mx/formats.py FP4_E2M1_VALUES):
    # 0->0, 1->0.5, 2->1, 3->1.5, 4->2, 5->3, 6->4, 7->6, 8..15 negatives (8 = -0)
    v = mx.decode_fp4(np.arange(16, dtype=np.uint8))
    assert v.dtype == np.float32
    assert v[:8].tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert (-v[8:]).tolist() == v[:8].tolist()
    assert np.signbit(v[8]) and not np.signbit(v[0])
    with pytest.raises(ValueError):
        mx.decode_fp4(np.array([16]))


def test_decode_fp4_agrees_with_ml_dtypes():
    # ml_dtypes stores one e2m1 value per byte (low nibble)
    want = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    got = mx.decode_fp4(np.arange(16, dtype=np.uint8))
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


# ------------------------------------------------------------------------------------------------
# x4 packing
# ------------------------------------------------------------------------------------------------


def test_pack_x4_byte_order():
    w = mx.pack_x4(np.array([1, 2, 3, 4, 0xFF, 0, 0, 0x80], np.uint8))
    assert w.dtype == np.uint32
    assert w.tolist() == [0x04030201, 0x800000FF]
    # in memory, little-endian words reproduce the unpacked fp8 bytes (x4 layout, docs/simulator.md#dtypes)
    assert w.astype("<u4").tobytes() == bytes([1, 2, 3, 4, 0xFF, 0, 0, 0x80])
    assert mx.unpack_x4(np.array([0x04030201], np.uint32)).tolist() == [1, 2, 3, 4]
    # a big-endian input dtype is read by value
    assert mx.unpack_x4(np.array([0x04030201], ">u4")).tolist() == [1, 2, 3, 4]


def test_pack_fp4_x4_nibble_order():
    w = mx.pack_fp4_x4(np.array([1, 2, 3, 4, 0xF, 0, 8, 7], np.uint8))
    assert w.dtype == np.uint16
    assert w.tolist() == [0x4321, 0x780F]
    # bytes: 2j = e[4j] | e[4j+1] << 4, 2j+1 = e[4j+2] | e[4j+3] << 4
    assert w.astype("<u2").tobytes() == bytes([0x21, 0x43, 0x0F, 0x78])
    assert mx.unpack_fp4_x4(np.array([0x4321], np.uint16)).tolist() == [1, 2, 3, 4]


def test_pack_round_trips():
    rng = np.random.default_rng(1234)
    c = rng.integers(0, 256, size=(3, 5, 16), dtype=np.uint8)
    w = mx.pack_x4(c)
    assert w.shape == (3, 5, 4) and w.dtype == np.uint32
    assert np.array_equal(mx.unpack_x4(w), c)
    # packing == viewing the contiguous bytes as '<u4'
    assert np.array_equal(w, c.view("<u4").astype(np.uint32))
    n = rng.integers(0, 16, size=(7, 12), dtype=np.uint8)
    h = mx.pack_fp4_x4(n)
    assert h.shape == (7, 3) and h.dtype == np.uint16
    assert np.array_equal(mx.unpack_fp4_x4(h), n)
    ws = rng.integers(0, 2 ** 32, size=(4, 6), dtype=np.uint64).astype(np.uint32)
    assert np.array_equal(mx.pack_x4(mx.unpack_x4(ws)), ws)
    hs = rng.integers(0, 2 ** 16, size=(4, 6), dtype=np.uint32).astype(np.uint16)
    assert np.array_equal(mx.pack_fp4_x4(mx.unpack_fp4_x4(hs)), hs)


def test_pack_errors():
    with pytest.raises(ValueError, match="multiple of 4"):
        mx.pack_x4(np.zeros(6, np.uint8))
    with pytest.raises(ValueError):
        mx.pack_fp4_x4(np.array([0, 1, 2, 16]))
    with pytest.raises(ValueError):
        mx.pack_x4(np.array([0, 1, 2, 256]))
    with pytest.raises(TypeError):
        mx.pack_x4(np.zeros(4, np.float32))


# ------------------------------------------------------------------------------------------------
# quadrant scale rows
# ------------------------------------------------------------------------------------------------


def test_scale_row():
    g = np.arange(16)
    assert mx.scale_row(g).tolist() == [0, 1, 2, 3, 32, 33, 34, 35, 64, 65, 66, 67, 96, 97, 98, 99]
    assert mx.scale_row(5) == 33 and isinstance(mx.scale_row(5), int)


@pytest.mark.parametrize("G", [1, 4, 5, 8, 12, 16])
def test_quadrant_rows_round_trip(G):
    rng = np.random.default_rng(G)
    s = rng.integers(0, 256, size=(G, 7), dtype=np.uint8)
    rows = mx.scales_to_quadrant_rows(s, fill=0xAA)
    assert rows.shape == (mx.scale_row(G - 1) + 1, 7)
    used = np.zeros(rows.shape[0], bool)
    used[mx.scale_row(np.arange(G))] = True
    assert np.all(rows[~used] == 0xAA)
    for g in range(G):
        assert np.array_equal(rows[32 * (g // 4) + g % 4], s[g])
    assert np.array_equal(mx.scales_from_quadrant_rows(rows, G), s)
    # a full 128-row tile works too
    full = np.zeros((128, 7), np.uint8)
    full[: rows.shape[0]] = rows
    assert np.array_equal(mx.scales_from_quadrant_rows(full, G), s)
    with pytest.raises(ValueError):
        mx.scales_from_quadrant_rows(rows[:-1], G)


# ------------------------------------------------------------------------------------------------
# K interleave
# ------------------------------------------------------------------------------------------------


def test_k_index():
    p = np.arange(32)[:, None]
    j = np.arange(4)[None, :]
    assert np.array_equal(mx.k_index(p, j, 128, "1x32"), 4 * p + j)
    assert np.array_equal(mx.k_index(p, j, 128, "wrapX"), p + 32 * j)
    assert mx.k_index(3, 2, 512, "wrapX") == 3 + 256
    for s in ("1x32", "wrapX"):  # a bijection onto range(T)
        assert sorted(mx.k_index(p, j, 128, s).ravel().tolist()) == list(range(128))
    with pytest.raises(ValueError):
        mx.k_index(0, 0, 128, "2x16")


@pytest.mark.parametrize("scheme", ["1x32", "wrapX"])
@pytest.mark.parametrize("T,N", [(128, 1), (256, 3), (512, 8)])
def test_interleave_definition_and_inverse(scheme, T, N):
    rng = np.random.default_rng(T + N)
    x = rng.standard_normal((T, N)).astype(np.float32)
    y = mx.interleave_k(x, scheme)
    assert y.shape == (T // 4, 4 * N)
    p = np.arange(T // 4)[:, None, None]
    n = np.arange(N)[None, :, None]
    j = np.arange(4)[None, None, :]
    k = mx.k_index(p, j, T, scheme)
    want = x[k, n].reshape(T // 4, 4 * N)  # out[p, 4n + j] = x[k(p, j), n]
    assert np.array_equal(y, want)
    assert np.array_equal(mx.deinterleave_k(y, scheme), x)
