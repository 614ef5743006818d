"""Bit-exact tests of MX quantization (nkilib.mx.quantize_blocks / quantize_mx / dequantize_mx).

Hand-computed cases derive every expected scale byte and fp8 code in comments; a slow per-group
reference built on fractions.Fraction and an fp8 value table decoded from the bit fields (not from
ml_dtypes) checks random data bit for bit.
"""

import bisect
import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import nkilib.mx as mx

E4 = "float8_e4m3fn"
E5 = "float8_e5m2"
FORMATS = (E4, E5)
RULES = ("neuron", "ocp_floor", "rceil")
HSET = settings(derandomize=True, deadline=None, max_examples=60, database=None)


def q1(values, fmt, rule):
    """Quantizes a single group given as a list (padded with zeros to 32)."""
    v = np.zeros(32, np.float32)
    v[: len(values)] = values
    codes, scale = mx.quantize_blocks(v, fmt, rule)
    assert codes.shape == (32,) and scale.shape == ()
    return codes, int(scale)


# ------------------------------------------------------------------------------------------------
# independent slow reference
# ------------------------------------------------------------------------------------------------

_TABLES = {}


def fp8_table(fmt):
    """(values, codes) of all non-negative finite fp8 numbers, decoded from the bit fields."""
    if fmt not in _TABLES:
        ebits, mbits, bias = (4, 3, 7) if fmt == E4 else (5, 2, 15)
        vals, codes = [], []
        for code in range(128):
            E, M = code >> mbits, code & ((1 << mbits) - 1)
            if fmt == E4 and code == 0x7F:
                continue  # NaN
            if fmt == E5 and E == 31:
                continue  # Inf / NaN
            frac = Fraction(M, 1 << mbits)
            v = frac * Fraction(2) ** (1 - bias) if E == 0 else (1 + frac) * Fraction(2) ** (E - bias)
            vals.append(v)
            codes.append(code)
        assert vals == sorted(vals)
        _TABLES[fmt] = (vals, codes)
    return _TABLES[fmt]


def ref_rne_sat(q, negative, fmt):
    """Round Fraction q to nearest-even fp8 code, saturating to max_normal."""
    vals, codes = fp8_table(fmt)
    a = abs(q)
    if a >= vals[-1]:
        c = codes[-1]
    else:
        i = bisect.bisect_left(vals, a)
        if vals[i] == a:
            c = codes[i]
        else:
            d_lo, d_hi = a - vals[i - 1], vals[i] - a
            if d_lo != d_hi:
                c = codes[i - 1] if d_lo < d_hi else codes[i]
            else:  # tie: the even significand (code LSB = mantissa LSB)
                c = codes[i - 1] if codes[i - 1] % 2 == 0 else codes[i]
    return c | 0x80 if negative else c


def ref_group(values, fmt, rule):
    f = mx.ELEMENT_FORMATS[fmt]
    vals = [float(v) for v in values]
    if any(math.isnan(v) or math.isinf(v) for v in vals):
        return [f.nan_code] * len(vals), 255
    amax = max(abs(v) for v in vals)
    if amax == 0:
        byte = 0
    else:
        A = Fraction(amax)
        e = math.frexp(amax)[1] - 1
        assert Fraction(2) ** e <= A < Fraction(2) ** (e + 1)
        if rule == "neuron":
            s = e - (f.emax - 1)
        elif rule == "ocp_floor":
            s = e - f.emax
        else:
            s = e - f.emax - 3
            while A > Fraction(f.max_normal) * Fraction(2) ** s:
                s += 1
            assert A > Fraction(f.max_normal) * Fraction(2) ** (s - 1)
        byte = min(max(s + 127, 0), 254)
    X = Fraction(2) ** (byte - 127)
    codes = [ref_rne_sat(Fraction(v) / X, math.copysign(1.0, v) < 0, fmt) for v in vals]
    return codes, byte


def random_groups(rng, n, lo=-140, hi=120):
    sign = rng.choice([-1.0, 1.0], (n, 32))
    base = rng.integers(lo, hi, (n, 1))
    off = rng.integers(-14, 1, (n, 32))
    x = sign * np.ldexp(rng.uniform(1, 2, (n, 32)), base + off)
    x[rng.random((n, 32)) < 0.05] = 0.0
    x[rng.random((n, 32)) < 0.02] = -0.0
    return x


def tie_groups(rng, n, fmt, rule):
    """Groups whose elements 1..31 are exact fp8 rounding midpoints after scaling."""
    vals, _ = fp8_table(fmt)
    out = np.zeros((n, 32), np.float32)
    for r in range(n):
        amax = np.float32(np.ldexp(rng.uniform(1, 2), int(rng.integers(-60, 60))))
        _, byte = ref_group([amax], fmt, rule)
        X = Fraction(2) ** (byte - 127)
        top = bisect.bisect_right(vals, Fraction(float(amax)) / X) - 1  # vals[top] <= amax/X
        idx = rng.integers(0, max(top, 1), 31)
        mids = [(vals[i] + vals[i + 1]) / 2 * X for i in idx]
        out[r, 0] = amax
        out[r, 1:] = [float(m) * rng.choice([-1, 1]) for m in mids]
        assert all(Fraction(float(np.float32(float(m)))) == m for m in mids)  # exact in float32
    return out


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rule", RULES)
def test_matches_slow_reference(fmt, rule):
    rng = np.random.default_rng(20260817)
    batches = [
        random_groups(rng, 400).astype(np.float32),
        random_groups(rng, 150, lo=-133, hi=100).astype(ml_dtypes.bfloat16),
        tie_groups(rng, 60, fmt, rule),
    ]
    for x in batches:
        codes, scales = mx.quantize_blocks(x, fmt, rule)
        x32 = x.astype(np.float32)
        for g in range(x.shape[0]):
            want_c, want_s = ref_group(x32[g].tolist(), fmt, rule)
            assert int(scales[g]) == want_s, (g, x32[g])
            assert codes[g].tolist() == want_c, (g, x32[g])


def test_ties_are_present_in_tie_groups():
    # sanity check of the generator: ml_dtypes' own RNE agrees on the midpoints
    rng = np.random.default_rng(5)
    x = tie_groups(rng, 3, E4, "neuron")
    codes, scales = mx.quantize_blocks(x, E4, "neuron")
    X = np.ldexp(1.0, scales.astype(int) - 127)[:, None]
    q = x / X
    expected = np.clip(q, -448, 448).astype(np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    assert np.array_equal(codes, expected)


# ------------------------------------------------------------------------------------------------
# hand-computed cases
# ------------------------------------------------------------------------------------------------


def test_hand_e4m3fn_amax_one():
    # amax = 1.0 = 2**0: e = 0.
    # neuron: exponent 0 - 7 = -7 -> byte 120 (= biased fp32 exp 127 - 7); X = 2**-7.
    #   1.0/X = 128 = 2**7 -> E field 7+7 = 14 -> 0_1110_000 = 0x70
    #   0.5/X = 64 -> field 13 -> 0x68;  -0.25/X = -32 -> field 12 -> 0x60 | 0x80 = 0xE0
    #   0.3/X = 38.4 -> in [32, 64) spacing 4: 36 or 40, 38.4 nearer 40 = 1.25*32 -> 0_1100_010 = 0x62
    vals = [1.0, 0.5, -0.25, np.float32(0.3)]
    c, s = q1(vals, E4, "neuron")
    assert s == 120 and c[:4].tolist() == [0x70, 0x68, 0xE0, 0x62] and not c[4:].any()
    # ocp_floor: exponent 0 - 8 -> byte 119, X = 2**-8: 256 -> 0x78, 128 -> 0x70, -64 -> 0xE8,
    #   0.3*256 = 76.8 in [64, 128) spacing 8: 72 or 80 -> 80 = 1.25*64 -> 0_1101_010 = 0x6A
    c, s = q1(vals, E4, "ocp_floor")
    assert s == 119 and c[:4].tolist() == [0x78, 0x70, 0xE8, 0x6A]
    # rceil: smallest s with 1 <= 448 * 2**s: 448*2**-9 = 0.875 < 1, 448*2**-8 = 1.75 -> s = -8
    c, s = q1(vals, E4, "rceil")
    assert s == 119 and c[:4].tolist() == [0x78, 0x70, 0xE8, 0x6A]


def test_hand_e4m3fn_448_449():
    # 448 = 1.75 * 2**8: e = 8.
    # ocp_floor: exponent 0 -> byte 127, X = 1, 448 -> 0_1111_110 = 0x7E (max normal).
    # neuron: exponent 1 -> byte 128, X = 2, 224 = 1.75*2**7 -> 0_1110_110 = 0x76.
    # rceil: 448 <= 448 * 2**0 and 448 > 448 * 2**-1 -> s = 0 -> byte 127, 0x7E.
    assert q1([448.0], E4, "ocp_floor")[1] == 127 and q1([448.0], E4, "ocp_floor")[0][0] == 0x7E
    assert q1([448.0], E4, "neuron")[1] == 128 and q1([448.0], E4, "neuron")[0][0] == 0x76
    assert q1([448.0], E4, "rceil")[1] == 127 and q1([448.0], E4, "rceil")[0][0] == 0x7E
    # 449 (float32): e = 8 still.
    # ocp_floor: byte 127, 449 > 448 -> saturates to 448 = 0x7E (ml_dtypes alone: NaN).
    # rceil: 449 > 448 -> s = 1 -> byte 128, 224.5 -> RNE (spacing 16 in [128, 256)) -> 224 = 0x76.
    # neuron: byte 128, same 0x76.
    c, s = q1([449.0], E4, "ocp_floor")
    assert s == 127 and c[0] == 0x7E
    c, s = q1([449.0], E4, "rceil")
    assert s == 128 and c[0] == 0x76
    c, s = q1([449.0], E4, "neuron")
    assert s == 128 and c[0] == 0x76
    # ocp_floor saturation for 480 (would overflow to NaN) and -511 -> 0xFE; 464 is the tie between
    # 448 and 480 (not representable) -> 448
    c, s = q1([480.0, -511.0, 464.0, 1.0], E4, "ocp_floor")
    assert s == 127 and c[:4].tolist() == [0x7E, 0xFE, 0x7E, 0x38]


def test_hand_e5m2():
    # amax 1.0: neuron exponent 0 - 14 -> byte 113, 1/X = 2**14 -> field 29 -> 0_11101_00 = 0x74
    # ocp_floor: byte 112, 2**15 -> field 30 -> 0x78
    # rceil: 57344 = 1.75*2**15; 57344*2**-15 = 1.75 >= 1 > 0.875 = 57344*2**-16 -> s = -15 -> 112
    assert q1([1.0], E5, "neuron")[1] == 113 and q1([1.0], E5, "neuron")[0][0] == 0x74
    assert q1([1.0], E5, "ocp_floor")[1] == 112 and q1([1.0], E5, "ocp_floor")[0][0] == 0x78
    assert q1([1.0], E5, "rceil")[1] == 112 and q1([1.0], E5, "rceil")[0][0] == 0x78
    # 57344: ocp byte 127 -> 0_11110_11 = 0x7B; neuron byte 128, 28672 = 1.75*2**14 -> 0x77;
    # rceil byte 127 -> 0x7B; 57345: rceil byte 128 -> 28672.5 -> 28672 (spacing 4096) -> 0x77
    assert q1([57344.0], E5, "ocp_floor")[0][0] == 0x7B and q1([57344.0], E5, "ocp_floor")[1] == 127
    assert q1([57344.0], E5, "neuron")[0][0] == 0x77 and q1([57344.0], E5, "neuron")[1] == 128
    assert q1([57344.0], E5, "rceil")[0][0] == 0x7B and q1([57344.0], E5, "rceil")[1] == 127
    c, s = q1([57345.0], E5, "rceil")
    assert s == 128 and c[0] == 0x77
    # ocp_floor saturation: 65000 -> e = 15, byte 127, 65000 > 57344 -> 0x7B (ml_dtypes: Inf)
    c, s = q1([65000.0, -65000.0], E5, "ocp_floor")
    assert s == 127 and c[:2].tolist() == [0x7B, 0xFB]


def test_neuron_byte_is_fp32_exponent_minus_7_or_14():
    rng = np.random.default_rng(7)
    x = random_groups(rng, 300, lo=-100, hi=100).astype(np.float32)
    amax = np.abs(x).max(axis=1)
    biased = ((amax.view(np.uint32) >> 23) & 0xFF).astype(int)
    for fmt, d in ((E4, 7), (E5, 14)):
        _, s = mx.quantize_blocks(x, fmt, "neuron")
        assert np.array_equal(s.astype(int), biased - d)
        _, s = mx.quantize_blocks(x, fmt, "ocp_floor")
        assert np.array_equal(s.astype(int), biased - d - 1)


def test_rceil_boundary_sweep():
    # rceil equals ocp_floor while the amax significand is <= 1.75 and neuron above it
    for fmt in FORMATS:
        for m in (1.0, 1.5, 1.75, np.nextafter(np.float32(1.75), np.float32(2)), 1.875, 1.9999999):
            a = np.float32(m) * np.float32(2.0 ** 10)
            r = q1([a], fmt, "rceil")[1]
            o, n = q1([a], fmt, "ocp_floor")[1], q1([a], fmt, "neuron")[1]
            assert r == (o if np.float32(m) <= 1.75 else n) and n == o + 1


# ------------------------------------------------------------------------------------------------
# adversarial cases
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rule", RULES)
def test_zero_and_negative_zero(fmt, rule):
    c, s = q1([], fmt, rule)
    assert s == 0 and not c.any()
    c, s = q1([-0.0, 0.0, -0.0], fmt, rule)
    assert s == 0 and c[:3].tolist() == [0x80, 0x00, 0x80]
    # -0.0 inside a normal group stays -0.0; a tiny negative flushes to -0.0
    c, s = q1([1.0, -0.0, np.float32(-1e-30)], fmt, rule)
    assert c[1] == 0x80 and c[2] == 0x80


@pytest.mark.parametrize("rule", RULES)
def test_bf16_subnormals(rule):
    bf = ml_dtypes.bfloat16
    x = np.zeros(32, bf)
    x[:3] = np.array([2.0 ** -133, 3 * 2.0 ** -133, -(2.0 ** -130)], np.float64).astype(bf)
    assert x[:3].astype(np.float64).tolist() == [2.0 ** -133, 3 * 2.0 ** -133, -(2.0 ** -130)]
    # amax = 2**-130 -> every rule's exponent < -127 -> byte clamps to 0, X = 2**-127:
    # e4m3fn: 2**-6 -> 0x08 (min normal), 3*2**-6 = 1.5*2**-5 -> 0_0010_100 = 0x14,
    #         -2**-3 -> field 4 -> 0x20 | 0x80 = 0xA0
    # e5m2:   2**-6 -> field 9 -> 0x24, 1.5*2**-5 -> field 10, m=10 -> 0x2A, -2**-3 -> 0x30|0x80 = 0xB0
    c, s = mx.quantize_blocks(x, E4, rule)
    assert int(s) == 0 and c[:3].tolist() == [0x08, 0x14, 0xA0]
    c, s = mx.quantize_blocks(x, E5, rule)
    assert int(s) == 0 and c[:3].tolist() == [0x24, 0x2A, 0xB0]


def test_byte_zero_boundary():
    # neuron e4m3fn: amax 2**-120 -> exponent -127 -> byte 0 exactly (no clamp), 2**7 -> 0x70;
    # 2**-119 -> byte 1; 2**-121 -> clamped to 0 and 2**-121 / 2**-127 = 64 -> 0x68.
    assert q1([2.0 ** -120], E4, "neuron")[1] == 0 and q1([2.0 ** -120], E4, "neuron")[0][0] == 0x70
    assert q1([2.0 ** -119], E4, "neuron")[1] == 1
    c, s = q1([2.0 ** -121], E4, "neuron")
    assert s == 0 and c[0] == 0x68
    # fp32 subnormal amax works (frexp is exact there): 2**-149 -> byte 0, 2**-22 -> 0 in fp8
    c, s = q1([2.0 ** -149], E4, "neuron")
    assert s == 0 and c[0] == 0


@pytest.mark.parametrize("k", [-100, -37, -1, 0, 1, 9, 100, 127])
def test_exact_powers_of_two(k):
    a = 2.0 ** k
    # neuron: byte k + 127 - (emax - 1); amax/X = 2**(emax-1): e4m3fn 128 -> 0x70, e5m2 2**14 -> 0x74
    # ocp_floor & rceil (2**k <= max_normal * 2**(k-emax)): byte k + 127 - emax, amax/X = 2**emax
    #   -> e4m3fn 256 -> 0x78, e5m2 2**15 -> 0x78
    for fmt, emax, cn, co in ((E4, 8, 0x70, 0x78), (E5, 15, 0x74, 0x78)):
        c, s = q1([a, -a / 2], fmt, "neuron")
        assert s == k + 127 - emax + 1 and c[0] == cn
        # -a/2 is one binade lower: code minus one exponent step (8 for e4m3fn, 4 for e5m2)
        step = 8 if fmt == E4 else 4
        assert c[1] == (cn - step) | 0x80
        for rule in ("ocp_floor", "rceil"):
            c, s = q1([a, -a / 2], fmt, rule)
            assert s == k + 127 - emax and c[0] == co and c[1] == (co - step) | 0x80


@pytest.mark.parametrize("fmt", FORMATS)
def test_values_at_fp8_max(fmt):
    m = mx.ELEMENT_FORMATS[fmt].max_normal
    c, s = q1([m, -m], fmt, "ocp_floor")
    top = 0x7E if fmt == E4 else 0x7B
    assert s == 127 and c[:2].tolist() == [top, top | 0x80]


def test_rne_ties_explicit():
    # e4m3fn with X = 1 (neuron byte 127 needs amax in [128, 256); use 128):
    #   1 + 1/16 is halfway between 1.0 (0x38, even) and 1.125 (0x39) -> 0x38
    #   1 + 3/16 halfway between 1.125 (0x39) and 1.25 (0x3A, even) -> 0x3A
    #   2**-10 halfway between 0 and 2**-9 (0x01) -> 0x00 ; 3*2**-10 between 0x01 and 0x02 -> 0x02
    #   248 halfway between 240 (0x77) and 256 (0x78, even) -> 0x78 (crosses a binade)
    #   negatives mirror: -(1 + 1/16) -> 0xB8
    c, s = q1([128.0, 1 + 1 / 16, 1 + 3 / 16, 2.0 ** -10, 3 * 2.0 ** -10, -(1 + 1 / 16)], E4, "neuron")
    assert s == 127 and c[:6].tolist() == [0x70, 0x38, 0x3A, 0x00, 0x02, 0xB8]
    c, s = q1([248.0], E4, "neuron")
    assert s == 127 and c[0] == 0x78
    # e5m2 with X = 1 (neuron byte 127 needs amax in [2**14, 2**15)):
    #   1.125 between 1.0 (0x3C) and 1.25 (0x3D) -> 0x3C ; 1.375 between 0x3D and 1.5 (0x3E) -> 0x3E
    #   2**-17 between 0 and 2**-16 -> 0 ; 3*2**-17 between 0x01 and 0x02 -> 0x02
    c, s = q1([16384.0, 1.125, 1.375, 2.0 ** -17, 3 * 2.0 ** -17, -1.375], E5, "neuron")
    assert s == 127 and c[:6].tolist() == [0x74, 0x3C, 0x3E, 0x00, 0x02, 0xBE]
    # one float32 ulp off the tie rounds to the nearer side
    up = np.nextafter(np.float32(1 + 1 / 16), np.float32(2))
    assert q1([128.0, up], E4, "neuron")[0][1] == 0x39


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_inf_groups(fmt, rule, bad):
    # INFERRED (docs/simulator.md#choice-qmx-edge-cases): NaN scale 0xFF and NaN elements for the whole group only
    x = np.ones((3, 32), np.float32)
    x[1, 5] = bad
    c, s = mx.quantize_blocks(x, fmt, rule)
    nan = mx.ELEMENT_FORMATS[fmt].nan_code
    assert s[1] == 255 and np.all(c[1] == nan)
    assert s[0] == s[2] != 255 and np.array_equal(c[0], c[2]) and not np.any(c[0] == nan)
    deq = mx.dequantize_mx(c, s[:, None], axis=1, elem_format=fmt)
    assert np.all(np.isnan(deq[1])) and np.all(deq[[0, 2]] == 1.0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_huge_dynamic_range(fmt):
    # 1e30 (float32: 2**99 <= 1e30 < 2**100) sets the scale; 1e-30 is ~2**-199 relative -> +-0
    x = np.float32([1e30, 1e-30, -1e-30, -1e30])
    emax = mx.ELEMENT_FORMATS[fmt].emax
    for rule, d in (("neuron", emax - 1), ("ocp_floor", emax)):
        c, s = q1(x, fmt, rule)
        assert s == 127 + 99 - d
        assert c[1] == 0x00 and c[2] == 0x80 and c[3] == c[0] | 0x80
        want, _ = ref_group(np.concatenate([x, np.zeros(28, np.float32)]).tolist(), fmt, rule)
        assert c.tolist() == want


def test_input_dtypes():
    rng = np.random.default_rng(11)
    x32 = random_groups(rng, 50, lo=-20, hi=20).astype(ml_dtypes.bfloat16).astype(np.float32)
    ref = mx.quantize_blocks(x32, E4)
    for dt in (ml_dtypes.bfloat16, np.float64):
        got = mx.quantize_blocks(x32.astype(dt), E4)
        assert np.array_equal(got[0], ref[0]) and np.array_equal(got[1], ref[1])
    x16 = rng.standard_normal((4, 32)).astype(np.float16)
    a = mx.quantize_blocks(x16, E5, "rceil")
    b = mx.quantize_blocks(x16.astype(np.float32), E5, "rceil")
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    with pytest.raises(TypeError):
        mx.quantize_blocks(np.ones((1, 32), np.int32), E4)
    with pytest.raises(ValueError, match="32"):
        mx.quantize_blocks(np.ones((2, 16), np.float32), E4)


# ------------------------------------------------------------------------------------------------
# hypothesis properties
# ------------------------------------------------------------------------------------------------

_mag = st.floats(min_value=2.0 ** -60, max_value=2.0 ** 60, width=32)
_elem = st.one_of(st.just(0.0), _mag, _mag.map(lambda v: -v))
_groups = hnp.arrays(np.float32, st.tuples(st.integers(1, 4), st.just(32)), elements=_elem)


@HSET
@given(x=_groups, fmt=st.sampled_from(FORMATS), rule=st.sampled_from(RULES))
def test_error_bound(x, fmt, rule):
    f = mx.ELEMENT_FORMATS[fmt]
    c, s = mx.quantize_blocks(x, fmt, rule)
    X = np.ldexp(1.0, s.astype(int) - 127)[:, None]
    deq = mx.decode_elements(c, fmt).astype(np.float64) * X
    err = np.abs(deq - x)
    amax = np.abs(x).astype(np.float64).max(axis=1, keepdims=True)
    half_eps = f.eps / 2
    if rule == "neuron":  # |v/X| < 2**emax: half an ulp at the top binade = eps/2 * 2**e <= eps/2*amax
        assert np.all(err <= half_eps * amax)
    elif rule == "rceil":  # |v/X| <= max_normal, amax > max_normal*X/2 -> err < eps/1.75 * amax
        assert np.all(err <= f.eps / 1.75 * amax)
    else:  # ocp_floor: unsaturated elements eps/2; saturated ones lose < amax/8 (2 - 1.75 of 2)
        sat = np.abs(x) > f.max_normal * X
        assert np.all(err[~sat] <= np.broadcast_to(half_eps * amax, err.shape)[~sat])
        assert np.all(err <= amax / 8)


@HSET
@given(x=_groups, fmt=st.sampled_from(FORMATS), rule=st.sampled_from(RULES))
def test_scale_monotonicity(x, fmt, rule):
    c1, s1 = mx.quantize_blocks(x, fmt, rule)
    c2, s2 = mx.quantize_blocks(x * np.float32(2), fmt, rule)
    nz = np.abs(x).max(axis=1) > 0
    assert np.array_equal(s2[nz].astype(int), s1[nz].astype(int) + 1)
    assert np.all(s2[~nz] == 0)
    assert np.array_equal(c1, c2)  # v/X is unchanged, so are the codes


def _requantize(x, fmt, rule):
    c, s = mx.quantize_blocks(x, fmt, rule)
    t = mx.MXTensor(c.reshape(-1), s.reshape(-1), 0, fmt)
    d = t.dequantize().reshape(x.shape)
    c2, s2 = mx.quantize_blocks(d, fmt, rule)
    return c, s, c2, s2


@HSET
@given(x=_groups, fmt=st.sampled_from(FORMATS))
def test_idempotence_ocp_floor(x, fmt):
    # ocp_floor: max |code| lies in [2**emax, max_normal] (saturation stops the next binade), so
    # the dequantized amax has the same floor(log2) -> same scale, same codes. Always idempotent.
    c, s, c2, s2 = _requantize(x, fmt, "ocp_floor")
    assert np.array_equal(c, c2) and np.array_equal(s, s2)


@HSET
@given(x=_groups, fmt=st.sampled_from(FORMATS))
def test_idempotence_neuron(x, fmt):
    # neuron: amax/X in [2**(emax-1), 2**emax) can round UP to 2**emax (code 0x78 in both formats);
    # then the dequantized amax is 2**(e+1) and the scale byte grows by one. Idempotent otherwise.
    c, s, c2, s2 = _requantize(x, fmt, "neuron")
    bumped = np.any((c & 0x7F) == 0x78, axis=1)
    keep = ~bumped
    assert np.array_equal(c[keep], c2[keep]) and np.array_equal(s[keep], s2[keep])
    assert np.array_equal(s2[bumped].astype(int), s[bumped].astype(int) + 1)


@HSET
@given(x=_groups, fmt=st.sampled_from(FORMATS))
def test_idempotence_rceil(x, fmt):
    # rceil: max |code| lies in [max_normal/2, max_normal]; exactly max_normal/2 (e.g. 224.5 rounding
    # to 224) makes the requantized scale one smaller. Idempotent otherwise.
    f = mx.ELEMENT_FORMATS[fmt]
    c, s, c2, s2 = _requantize(x, fmt, "rceil")
    half = int(np.float32(f.max_normal / 2).astype(f.ml_dtype).view(np.uint8))
    maxcode = (c & 0x7F).max(axis=1)
    drop = (maxcode == half) & (s > 0)
    assert np.array_equal(c[~drop], c2[~drop]) and np.array_equal(s[~drop], s2[~drop])
    assert np.array_equal(s2[drop].astype(int), s[drop].astype(int) - 1)


def test_idempotence_counterexamples():
    # neuron: 255.9 -> e = 7, X = 1, rounds to 256 (0x78) -> requantized: byte 128, code 0x70
    c, s, c2, s2 = _requantize(np.float32([[255.9] + [0] * 31]), E4, "neuron")
    assert (int(s[0]), c[0, 0], int(s2[0]), c2[0, 0]) == (127, 0x78, 128, 0x70)
    # rceil: 449 -> byte 128, 224.5 -> 224 (0x76) ; 448 then fits X = 1 -> byte 127, 0x7E
    c, s, c2, s2 = _requantize(np.float32([[449.0] + [0] * 31]), E4, "rceil")
    assert (int(s[0]), c[0, 0], int(s2[0]), c2[0, 0]) == (128, 0x76, 127, 0x7E)


# ------------------------------------------------------------------------------------------------
# quantize_mx / dequantize_mx along an axis
# ------------------------------------------------------------------------------------------------


def test_quantize_mx_axis_and_shapes():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 64, 5)).astype(np.float32)
    for axis in (1, -2):
        t = mx.quantize_mx(x, axis=axis, elem_format="float8_e5m2_x4", scale_rule="ocp_floor")
        assert t.codes.shape == x.shape and t.scales.shape == (3, 2, 5)
        assert t.axis == 1 and t.elem_format == E5 and t.scheme == "1x32" and t.k_tile == 512
        blocks = np.moveaxis(x, 1, -1).reshape(3, 5, 2, 32)
        c, s = mx.quantize_blocks(blocks, E5, "ocp_floor")
        assert np.array_equal(t.codes, np.moveaxis(c.reshape(3, 5, 64), -1, 1))
        assert np.array_equal(t.scales, np.moveaxis(s, -1, 1))
    d = t.dequantize()
    assert d.dtype == np.float32 and d.shape == x.shape
    dd = mx.dequantize_mx(t.codes, t.scales, 1, E5)
    assert np.array_equal(d, dd)
    # exact: decode * 2**(s - 127) in float64 equals the float32 result
    sc = np.repeat(t.scales.astype(int), 32, axis=1)
    want = mx.decode_elements(t.codes, E5).astype(np.float64) * np.ldexp(1.0, sc - 127)
    assert np.array_equal(d.astype(np.float64), want)


def test_quantize_mx_errors():
    with pytest.raises(ValueError, match="K=48"):
        mx.quantize_mx(np.ones((2, 48), np.float32))
    with pytest.raises(ValueError, match="32"):  # 544 = 512 + 32: the 32-long tile is not % 128
        mx.quantize_mx(np.ones((544, 2), np.float32), axis=0, scheme="wrapX")
    with pytest.raises(ValueError, match="scheme"):
        mx.quantize_mx(np.ones((2, 64), np.float32), scheme="2x16")
    with pytest.raises(ValueError, match="axis"):
        mx.quantize_mx(np.ones((2, 64), np.float32), axis=2)
    with pytest.raises(ValueError):
        mx.quantize_mx(np.ones((2, 64), np.float32), elem_format="float4_e2m1fn_x4")


def test_wrapx_group_positions():
    pos = mx.group_positions(128, "wrapX")
    assert pos.shape == (4, 32)
    assert sorted(pos[0].tolist()) == list(range(8)) + list(range(32, 40)) + list(range(64, 72)) + list(range(96, 104))
    pos = mx.group_positions(640, "wrapX", 512)  # tiles 512 (P=128, 16 groups) and 128 (4 groups)
    assert pos.shape == (20, 32)
    assert sorted(pos[1].tolist()) == sorted(p + 128 * j for p in range(8, 16) for j in range(4))
    assert sorted(pos[16].tolist()) == sorted(512 + p + 32 * j for p in range(8) for j in range(4))
    assert sorted(pos.ravel().tolist()) == list(range(640))
    assert np.array_equal(mx.group_positions(64, "1x32"), np.arange(64).reshape(2, 32))


@pytest.mark.parametrize("K,k_tile", [(128, 512), (512, 512), (640, 512), (768, 256), (384, 384)])
def test_wrapx_quantize_matches_groups(K, k_tile):
    rng = np.random.default_rng(K)
    x = (rng.standard_normal((K, 3)) * np.exp2(rng.integers(-8, 8, (K, 1)))).astype(np.float32)
    t = mx.quantize_mx(x, axis=0, scheme="wrapX", k_tile=k_tile, scale_rule="rceil")
    pos = mx.group_positions(K, "wrapX", k_tile)
    c, s = mx.quantize_blocks(np.moveaxis(x[pos], 2, 0), E4, "rceil")  # [3, G, 32]
    assert np.array_equal(t.scales, s.T)
    assert np.array_equal(t.codes[pos], np.moveaxis(c, 0, 2))
    d = t.dequantize()
    assert np.array_equal(d[pos], np.moveaxis(mx.decode_elements(c, E4) * mx.scale_bytes_to_float(s)[..., None], 0, 2))


def test_mxtensor_validation():
    with pytest.raises(ValueError):
        mx.MXTensor(np.zeros((2, 64), np.uint8), np.zeros((2, 3), np.uint8), 1, E4)
    with pytest.raises(TypeError):
        mx.MXTensor(np.zeros((2, 64), np.float32), np.zeros((2, 2), np.uint8), 1, E4)
    t = mx.MXTensor(np.zeros((2, 64), np.uint8), np.zeros((2, 2), np.uint8), -1, "float8_e4m3fn_x4")
    assert t.axis == 1 and t.elem_format == E4 and t.shape == (2, 64)


def test_dequantize_nan_scale():
    c = np.full((1, 32), 0x38, np.uint8)
    d = mx.dequantize_mx(c, np.array([[255]], np.uint8), 1, E4)
    assert np.all(np.isnan(d))
    d = mx.dequantize_mx(c, np.array([[0]], np.uint8), 1, E4)
    assert np.all(d == np.float32(2.0 ** -127))
