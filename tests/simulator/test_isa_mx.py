"""nisa.quantize_mx and nisa.nc_matmul_mx (spec §5.1, §5.2, §7 rule 9, §10 Q1-Q6): numerics and semantics.

Bit-exactness is checked against nkilib.mx (hw_quantize_tile / hw_matmul_mx) and, where the
inputs allow it, against independent hand-computed values or plain ml_dtypes/numpy references. The rejections (one
per validation rule) are in test_isa_mx_rejections.py.
"""
import ml_dtypes
import numpy as np
import pytest

import nki.isa as nisa
import nki.language as nl
from nkilib import mx
from nkilib.simulator.errors import UninitializedReadError
from simkit import BF16, randn, rng, simulate

E4 = "float8_e4m3fn_x4"
E5 = "float8_e5m2_x4"
FP4 = "float4_e2m1fn_x4"
_ML = {E4: ml_dtypes.float8_e4m3fn, E5: ml_dtypes.float8_e5m2}
_EMAX = {E4: 8, E5: 15}
_FILL = 77  # sentinel byte memset into scale tiles before quantize_mx


def _r(g):
    return 32 * (g // 4) + g % 4


def _to_tile(blocks):
    """Logical groups [G, J, 32] -> quantize_mx source tile [8G, 4J] (group (g, j) = 8 x 4 block)."""
    G, J, _ = blocks.shape
    return blocks.reshape(G, J, 8, 4).transpose(0, 2, 1, 3).reshape(8 * G, 4 * J)


# ------------------------------------------------------------------------------------------------
# kernels
# ------------------------------------------------------------------------------------------------

def _quantize_kernel(fmt, scale_dtype=nl.uint8, offset=0, scale_rows=128):
    """Quantize src [P, F] into a memset [scale_rows, F/4] scale tile at partition `offset`."""

    def kernel(src):
        P, F = src.shape
        s = nl.ndarray((P, F), src.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=s, src=src)
        q = nl.ndarray((P, F // 4), fmt, buffer=nl.sbuf)
        sc = nl.ndarray((scale_rows, F // 4), scale_dtype, buffer=nl.sbuf)
        fill = _FILL if scale_dtype == nl.uint8 else float(2.0 ** (_FILL - 127))
        nisa.memset(dst=sc, value=fill)
        nisa.quantize_mx(dst=q, src=s, dst_scale=sc[offset:, :])
        oq = nl.ndarray(q.shape, fmt, buffer=nl.shared_hbm)
        osc = nl.ndarray(sc.shape, scale_dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=oq, src=q)
        nisa.dma_copy(dst=osc, src=sc)
        return oq, osc

    return kernel


def _expected_scale_tile(scales, offset, rows=128):
    out = np.full((rows, scales.shape[1]), _FILL, np.uint8)
    for g in range(scales.shape[0]):
        out[offset + _r(g)] = scales[g]
    return out


def _matmul_kernel(sfmt, mfmt, dst_dtype=nl.float32, accumulate=None):
    """dst = sum over K tiles of nc_matmul_mx(st[t], mv[t]); words/scales come from HBM.

    st: uint32/uint16 [T, K, M]; mv: [T, K, N]; ss: uint8 [T, R, M]; ms: [T, R, N] (quadrant rows).
    """

    def kernel(st, mv, ss, ms):
        T, K, M = st.shape
        N = mv.shape[2]
        ps = nl.ndarray((M, N), dst_dtype, buffer=nl.psum)
        for t in nl.affine_range(T):
            a = nl.ndarray((K, M), sfmt, buffer=nl.sbuf)
            b = nl.ndarray((K, N), mfmt, buffer=nl.sbuf)
            nisa.dma_copy(dst=a, src=st[t].view(sfmt))
            nisa.dma_copy(dst=b, src=mv[t].view(mfmt))
            a_s = nl.ndarray(ss.shape[1:], ss.dtype, buffer=nl.sbuf)
            b_s = nl.ndarray(ms.shape[1:], ms.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=a_s, src=ss[t])
            nisa.dma_copy(dst=b_s, src=ms[t])
            acc = accumulate if accumulate is None else (t > 0)
            nisa.nc_matmul_mx(dst=ps, stationary=a, moving=b, stationary_scale=a_s, moving_scale=b_s,
                              accumulate=acc)
        r = nl.ndarray((M, N), dst_dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=r, src=ps)
        out = nl.ndarray((M, N), dst_dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=r)
        return out

    return kernel


def _random_words(seed, shape, fmt):
    """Random x4 words whose elements are finite (no fp8 NaN codes)."""
    g = rng(seed)
    if fmt == FP4:
        return g.integers(0, 1 << 16, size=shape, dtype=np.uint32).astype(np.uint16)
    codes = g.integers(0, 256, size=shape + (4,), dtype=np.uint16).astype(np.uint8)
    vals = codes.view(_ML[fmt]).astype(np.float32)
    codes[~np.isfinite(vals)] = 0x38  # replace NaN / Inf codes by a finite value
    return mx.pack_x4(codes.reshape(shape[:-1] + (shape[-1] * 4,)))


def _random_scales(seed, groups, free, lo=110, hi=140):
    return rng(seed).integers(lo, hi, size=(groups, free), dtype=np.int32).astype(np.uint8)


def _quadrant_tile(scales, rows=128, offset=0, pad=255):
    """Scale tile [rows, X] with group g at offset + r(g); pad rows hold `pad` (255 = NaN scale)."""
    out = np.full((rows, scales.shape[1]), pad, np.uint8)
    for g in range(scales.shape[0]):
        out[offset + _r(g)] = scales[g]
    return out


def _independent_matmul(sw, mw, ss, ms, sfmt, mfmt):
    """float64 einsum reference using ml_dtypes decoding (independent of nkilib.mx's LUTs)."""

    def decode(words, fmt):
        if fmt == FP4:
            b = np.ascontiguousarray(words, "<u2").view(np.uint8).reshape(words.shape + (2,))
            nib = np.stack([b & 15, b >> 4], -1).reshape(words.shape + (4,))
            mag = np.array([0, .5, 1, 1.5, 2, 3, 4, 6])[nib & 7]
            return np.where(nib & 8, -mag, mag)
        b = np.ascontiguousarray(words, "<u4").view(np.uint8).reshape(words.shape + (4,))
        return b.view(_ML[fmt]).astype(np.float64)

    S = decode(sw, sfmt) * np.ldexp(1.0, np.repeat(ss.astype(np.int64), 8, 0) - 127)[:, :, None]
    V = decode(mw, mfmt) * np.ldexp(1.0, np.repeat(ms.astype(np.int64), 8, 0) - 127)[:, :, None]
    return np.einsum("pmk,pnk->mn", S, V).astype(np.float32)


# ------------------------------------------------------------------------------------------------
# quantize_mx numerics
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", [E4, E5])
@pytest.mark.parametrize("P", [32, 64, 96, 128])
def test_quantize_random_matches_module_and_independent_reference(fmt, P):
    x = randn(P * 7 + (fmt == E5), (P, 128), BF16, scale=3.0)
    oq, osc = simulate(_quantize_kernel(fmt), src=x)
    words, scales = mx.hw_quantize_tile(x, fmt, "neuron")
    np.testing.assert_array_equal(oq, words)
    np.testing.assert_array_equal(osc, _expected_scale_tile(scales, 0))
    # independent reference (finite, normal inputs): byte = floor(log2(amax)) - (Emax - 1) + 127
    blocks = x.astype(np.float32).reshape(P // 8, 8, 32, 4).transpose(0, 2, 1, 3).reshape(P // 8, 32, 32)
    e = np.floor(np.log2(np.abs(blocks).max(-1))).astype(np.int64)
    byte = e - (_EMAX[fmt] - 1) + 127
    np.testing.assert_array_equal(osc[_r(np.arange(P // 8))], byte)
    X = np.ldexp(1.0, np.repeat(np.repeat(byte - 127, 8, 0), 4, 1)).astype(np.float32)
    codes = (x.astype(np.float32) / X).astype(_ML[fmt]).view(np.uint8)
    np.testing.assert_array_equal(mx.unpack_x4(oq), codes)


@pytest.mark.parametrize("fmt", [E4, E5])
def test_quantize_adversarial_groups(fmt):
    fp8max = float(ml_dtypes.finfo(_ML[fmt]).max)
    G, J = 16, 12
    g = rng(5)
    blocks = g.standard_normal((G, J, 32)).astype(np.float32)
    blocks[0, 0] = 0.0                                     # all zero
    blocks[0, 1] = -0.0
    blocks[1, 0] = 2.0 ** g.integers(-20, 20, 32)          # exact powers of two
    blocks[1, 1] = 4.0                                     # amax exactly 2^2 everywhere
    blocks[2, 0] = 1e-40 * g.standard_normal(32)           # bf16 subnormals
    blocks[2, 1, :] = 0.0
    blocks[2, 1, 7] = 2.0 ** -133                          # a single tiny subnormal
    blocks[3, 0] = fp8max * np.sign(g.standard_normal(32))  # fp8 max values
    blocks[3, 1] = fp8max * 2.0 ** 20
    blocks[4, 0, :] = 1.0                                  # ties around amax 1.0
    blocks[4, 0, 1:8] = [1.0625, 1.1875, -1.0625, 1.5625, 0.5 + 1 / 32, 3 / 256, 1 + 2 ** -5]
    blocks[5, 0, 3] = np.nan                               # NaN / Inf
    blocks[5, 1, 30] = np.inf
    blocks[5, 2, 0] = -np.inf
    blocks[6, 0] = np.where(np.arange(32) % 2, 1e30, 1e-30)  # huge dynamic range within a group
    blocks[6, 1] = 3e38 * np.sign(g.standard_normal(32))    # near the bf16 max
    x = _to_tile(blocks).astype(BF16)
    oq, osc = simulate(_quantize_kernel(fmt), src=x)
    words, scales = mx.hw_quantize_tile(x, fmt, "neuron")
    np.testing.assert_array_equal(oq, words)
    np.testing.assert_array_equal(osc, _expected_scale_tile(scales, 0))

    got_s = osc[_r(np.arange(G))]  # [G, J]
    codes = mx.unpack_x4(oq).reshape(G, 8, J, 4).transpose(0, 2, 1, 3).reshape(G, J, 32)
    emax = _EMAX[fmt]
    # hand-computed: all-zero groups -> byte 0 and +-0 codes
    assert got_s[0, 0] == 0 and got_s[0, 1] == 0
    assert (codes[0, 0] == 0).all() and (codes[0, 1] == 0x80).all()
    # amax = 4 = 2^2: byte 2 - (emax - 1) + 127; every element 4 / X = 2^(emax - 1)
    assert got_s[1, 1] == 2 - (emax - 1) + 127
    two_pow = np.array([2.0 ** (emax - 1)], np.float32).astype(_ML[fmt]).view(np.uint8)[0]
    assert (codes[1, 1] == two_pow).all()
    # a single 2^-133 (below fp32 normal range after the exponent clamp): byte clamps to 0 (spec §10 Q2)
    assert got_s[2, 1] == 0
    # fp8-max values: never saturate under the neuron rule (|v / X| < 2^emax), decode back exactly
    deq = codes[3, 0].view(_ML[fmt]).astype(np.float64) * 2.0 ** (int(got_s[3, 0]) - 127)
    np.testing.assert_array_equal(deq, blocks[3, 0])
    # ties: amax 1 -> X = 2^-(emax-1); in e4m3 1.0625 is a tie 1 | 1.125 -> 1 (even), 1.1875 -> 1.25
    if fmt == E4:
        vals = codes[4, 0, 1:4].view(_ML[fmt]).astype(np.float64) * 2.0 ** -7
        np.testing.assert_array_equal(vals, [1.0, 1.25, -1.0])
    assert codes[4, 0, 0] == np.array([2.0 ** (emax - 1)], np.float32).astype(_ML[fmt]).view(np.uint8)[0]
    # NaN / Inf groups: NaN scale byte 0xFF and NaN element codes (spec §10 Q2, INFERRED)
    assert (got_s[5, :3] == 255).all()
    assert np.isnan(codes[5, :3].view(_ML[fmt]).astype(np.float32)).all()
    assert got_s[5, 3] != 255
    # huge range: the 1e-30 values flush to zero, the 1e30 values survive
    vals6 = codes[6, 0].view(_ML[fmt]).astype(np.float32)
    assert (vals6[0::2] == 0).all() and (vals6[1::2] > 0).all()


def test_quantize_fp16_source_and_e8m0_scale():
    x = randn(11, (64, 64), np.float16)
    oq, osc = simulate(_quantize_kernel(E4, scale_dtype=nl.float8_e8m0fnu), src=x)
    words, scales = mx.hw_quantize_tile(x, E4, "neuron")
    assert osc.dtype == ml_dtypes.float8_e8m0fnu
    np.testing.assert_array_equal(oq, words)
    np.testing.assert_array_equal(osc.view(np.uint8), _expected_scale_tile(scales, 0))


@pytest.mark.parametrize("offset", [0, 4, 8, 12])
def test_quantize_scale_offsets_write_only_quadrant_rows(offset):
    x = randn(20 + offset, (128, 32), BF16)
    _, osc = simulate(_quantize_kernel(E5, offset=offset), src=x)
    _, scales = mx.hw_quantize_tile(x, E5, "neuron")
    written = offset + _r(np.arange(16))  # rows offset + {0..3, 32..35, 64..67, 96..99}
    assert list(written[:5]) == [offset, offset + 1, offset + 2, offset + 3, offset + 32]
    np.testing.assert_array_equal(osc[written], scales)
    pad = np.setdiff1d(np.arange(128), written)
    assert (osc[pad] == _FILL).all()  # untouched pad rows keep the sentinel


def test_quantize_p32_four_row_scale_tile():
    x = randn(3, (32, 16), BF16)
    oq, osc = simulate(_quantize_kernel(E4, scale_rows=4), src=x)
    words, scales = mx.hw_quantize_tile(x, E4, "neuron")
    np.testing.assert_array_equal(oq, words)
    np.testing.assert_array_equal(osc, scales)


def test_quantize_ocp_floor_switch(monkeypatch):
    x = randn(8, (128, 64), BF16)
    _, new = simulate(_quantize_kernel(E4), src=x)
    monkeypatch.setenv("NKILIB_QMX_SCALE_RULE", "ocp_floor")
    oq, old = simulate(_quantize_kernel(E4), src=x)
    rows = _r(np.arange(16))
    np.testing.assert_array_equal(old[rows].astype(int), new[rows].astype(int) - 1)
    words, scales = mx.hw_quantize_tile(x, E4, "ocp_floor")
    np.testing.assert_array_equal(oq, words)
    np.testing.assert_array_equal(old[rows], scales)


def _copy_whole_scale_tile_kernel(use_pad_row):
    """quantize_mx P=64, then move the WHOLE scale tile (pad rows 4..31, 36..63 never written) through
    SBUF (tensor_copy) and HBM scratch (dma_copy); optionally compute with a pad row."""
    def kernel(src):
        s = nl.ndarray((64, 32), src.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=s, src=src)
        q = nl.ndarray((64, 8), nl.float8_e4m3fn_x4, buffer=nl.sbuf)
        sc = nl.ndarray((64, 8), nl.uint8, buffer=nl.sbuf)
        nisa.quantize_mx(dst=q, src=s, dst_scale=sc)
        sc2 = nl.ndarray((64, 8), nl.uint8, buffer=nl.sbuf)
        nisa.tensor_copy(dst=sc2, src=sc)                   # whole tile, pad rows included: legal
        scratch = nl.ndarray((64, 8), nl.uint8, buffer=nl.private_hbm)
        nisa.dma_copy(dst=scratch, src=sc2)                 # whole tile to HBM: legal
        back = nl.ndarray((64, 8), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=back, src=scratch)                # and back, converted: still a copy
        out = nl.ndarray((8, 8), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out[0:4, :], src=back[0:4, :])    # the written rows
        nisa.dma_copy(dst=out[4:8, :], src=back[32:36, :])
        if use_pad_row:
            bumped = nl.ndarray((1, 8), nl.float32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=bumped, data=back[4:5, :], op0=nl.add, operand0=1.0)  # a use of garbage
        return out

    return kernel


def test_quantize_pad_rows_copy_whole_tile_is_legal():
    x = randn(0, (64, 32), BF16)
    out = simulate(_copy_whole_scale_tile_kernel(use_pad_row=False), src=x)
    _, scales = mx.hw_quantize_tile(x, E4, "neuron")
    np.testing.assert_array_equal(out, scales.astype(np.float32))


def test_quantize_pad_rows_poison_travels_and_use_raises():
    # the never-written mark follows the data through both copies; the computation names itself
    with pytest.raises(UninitializedReadError,
                       match=r"tensor_scalar: argument 'data' reads 8 element\(s\) of tensor .* never written"):
        simulate(_copy_whole_scale_tile_kernel(use_pad_row=True), src=randn(0, (64, 32), BF16))


# ------------------------------------------------------------------------------------------------
# nc_matmul_mx numerics
# ------------------------------------------------------------------------------------------------

def test_matmul_mx_hand_computed_ones():
    """All elements 1.0 (e4m3fn 0x38), scales 2^1 and 2^-2: dst = 4K * 2 * 0.25 = 2K."""
    K, M, N = 128, 16, 24
    st = np.full((1, K, M), 0x38383838, np.uint32)
    mv = np.full((1, K, N), 0x38383838, np.uint32)
    ss = _quadrant_tile(np.full((16, M), 128, np.uint8))[None]
    ms = _quadrant_tile(np.full((16, N), 125, np.uint8))[None]
    out = simulate(_matmul_kernel(E4, E4), st=st, mv=mv, ss=ss, ms=ms)
    np.testing.assert_array_equal(out, np.full((M, N), 2.0 * K, np.float32))


@pytest.mark.parametrize("sfmt,mfmt", [(E4, E4), (E5, E5), (E4, E5), (FP4, E4), (E5, FP4)])
@pytest.mark.parametrize("K", [32, 64, 128])
def test_matmul_mx_random_bit_exact(sfmt, mfmt, K):
    M, N = 64, 96
    seed = K + len(sfmt) * 3 + len(mfmt)
    sw = _random_words(seed, (K, M), sfmt)
    mw = _random_words(seed + 1, (K, N), mfmt)
    ss = _random_scales(seed + 2, K // 8, M)
    ms = _random_scales(seed + 3, K // 8, N)
    out = simulate(_matmul_kernel(sfmt, mfmt), st=sw[None], mv=mw[None],
                   ss=_quadrant_tile(ss)[None], ms=_quadrant_tile(ms)[None])
    np.testing.assert_array_equal(out, mx.hw_matmul_mx(sw, mw, ss, ms, sfmt, mfmt))
    # independent reference: same products, float64 sums in another order (agree to float32 rounding)
    ind = _independent_matmul(sw, mw, ss, ms, sfmt, mfmt)
    np.testing.assert_allclose(out, ind, rtol=1e-6, atol=1e-6 * np.abs(ind).max())


def test_matmul_mx_adversarial_scales_nan_and_range():
    K, M, N = 64, 8, 16
    sw = _random_words(40, (K, M), E4)
    mw = _random_words(41, (K, N), E5)
    ss = _random_scales(42, K // 8, M, lo=0, hi=255)  # huge dynamic range, including byte 0
    ms = _random_scales(43, K // 8, N, lo=0, hi=255)
    ss[3, 2] = 255                                      # NaN scale -> column 2 of dst rows NaN
    out = simulate(_matmul_kernel(E4, E5), st=sw[None], mv=mw[None],
                   ss=_quadrant_tile(ss)[None], ms=_quadrant_tile(ms)[None])
    ref = mx.hw_matmul_mx(sw, mw, ss, ms, E4, E5)
    np.testing.assert_array_equal(out, ref)
    assert np.isnan(out[2]).all() and not np.isnan(np.delete(out, 2, 0)).any()


def test_matmul_mx_reads_only_quadrant_rows():
    """Pad rows hold 255 (NaN scale) in HBM input; if they were read the result would be NaN."""
    K, M, N = 128, 32, 32
    sw, mw = _random_words(1, (K, M), E4), _random_words(2, (K, N), E4)
    ss, ms = _random_scales(3, 16, M), _random_scales(4, 16, N)
    out = simulate(_matmul_kernel(E4, E4), st=sw[None], mv=mw[None],
                   ss=_quadrant_tile(ss, pad=255)[None], ms=_quadrant_tile(ms, pad=255)[None])
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out, mx.hw_matmul_mx(sw, mw, ss, ms, E4, E4))


def _k_tiled_matmul_mx(T, K, M, N, sfmt, mfmt, seed, **kernel_kw):
    """(simulated dst, per-tile hw_matmul_mx products) of `T` K tiles of random words and scales.

    Dimensions:
        stationary words [T, K, M], moving words [T, K, N], scales [K/8, M] / [K/8, N] per tile; dst [M, N].

    Seeds: stationary words seed + t, moving words seed + 10 + t, their scales seed + 20 + t / seed + 30 + t.
    `kernel_kw` goes to _matmul_kernel (dst_dtype, accumulate).
    """
    sw = np.stack([_random_words(seed + t, (K, M), sfmt) for t in range(T)])
    mw = np.stack([_random_words(seed + 10 + t, (K, N), mfmt) for t in range(T)])
    ss = [_random_scales(seed + 20 + t, K // 8, M) for t in range(T)]
    ms = [_random_scales(seed + 30 + t, K // 8, N) for t in range(T)]
    out = simulate(_matmul_kernel(sfmt, mfmt, **kernel_kw), st=sw, mv=mw,
                   ss=np.stack([_quadrant_tile(s) for s in ss]), ms=np.stack([_quadrant_tile(s) for s in ms]))
    return out, [mx.hw_matmul_mx(sw[t], mw[t], ss[t], ms[t], sfmt, mfmt) for t in range(T)]


@pytest.mark.parametrize("dst_dtype", [nl.float32, nl.bfloat16])
def test_matmul_mx_accumulates_over_k_tiles(dst_dtype):
    out, parts = _k_tiled_matmul_mx(3, 128, 32, 64, E4, E5, seed=10, dst_dtype=dst_dtype)
    if dst_dtype == nl.float32:
        acc = parts[0]
        for p in parts[1:]:
            acc = (acc + p).astype(np.float32)
    else:  # bf16 PSUM: fp32 add of the upcast bf16 value, then RNE to bf16 (spec §5.3, [TRN3])
        acc = parts[0].astype(BF16)
        for p in parts[1:]:
            acc = (acc.astype(np.float32) + p).astype(BF16)
        assert out.dtype == BF16
    np.testing.assert_array_equal(out, acc)


def test_matmul_mx_explicit_accumulate_flags():
    out, parts = _k_tiled_matmul_mx(2, 64, 16, 16, E4, E4, seed=50, accumulate=True)
    np.testing.assert_array_equal(out, (parts[0] + parts[1]).astype(np.float32))


# ------------------------------------------------------------------------------------------------
# on-chip pipeline: quantize_mx -> nc_matmul_mx, packed scales
# ------------------------------------------------------------------------------------------------

def _pipeline_kernel(fmt_a, fmt_b, offsets, P):
    """Quantize four [P, 4X] tiles into one shared scale tile at `offsets`; dst = mm(t0, t1) + mm(t2, t3)."""

    def kernel(x0, x1, x2, x3):
        F = x0.shape[1]
        X = F // 4
        packed = nl.ndarray((128, X), nl.uint8, buffer=nl.sbuf)
        qs = []
        for i, (x, fmt) in enumerate(zip((x0, x1, x2, x3), (fmt_a, fmt_b, fmt_a, fmt_b))):
            s = nl.ndarray((P, F), x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=s, src=x)
            q = nl.ndarray((P, X), fmt, buffer=nl.sbuf)
            nisa.quantize_mx(dst=q, src=s, dst_scale=packed[offsets[i]:, :])
            qs.append(q)
        ps = nl.ndarray((X, X), nl.float32, buffer=nl.psum)
        # K=4P, M=X, N=X
        nisa.nc_matmul_mx(dst=ps, stationary=qs[0], moving=qs[1], stationary_scale=packed[offsets[0]:, :],
                          moving_scale=packed[offsets[1]:, :])
        # K=4P, M=X, N=X (accumulates: the PSUM elements were matmul-written)
        nisa.nc_matmul_mx(dst=ps, stationary=qs[2], moving=qs[3], stationary_scale=packed[offsets[2]:, :],
                          moving_scale=packed[offsets[3]:, :])
        r = nl.ndarray((X, X), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=r, src=ps)
        out = nl.ndarray((X, X), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=r)
        return out

    return kernel


@pytest.mark.parametrize("P", [32, 64, 128])
def test_pipeline_packed_scales_offsets(P):
    offsets = (0, 4, 8, 12)
    xs = [randn(100 + i + P, (P, 128), BF16, scale=10.0 ** (i - 1)) for i in range(4)]
    out = simulate(_pipeline_kernel(E4, E5, offsets, P), x0=xs[0], x1=xs[1], x2=xs[2], x3=xs[3])
    q = [mx.hw_quantize_tile(x, f, "neuron") for x, f in zip(xs, (E4, E5, E4, E5))]
    r0 = mx.hw_matmul_mx(q[0][0], q[1][0], q[0][1], q[1][1], E4, E5)
    r1 = mx.hw_matmul_mx(q[2][0], q[3][0], q[2][1], q[3][1], E4, E5)
    np.testing.assert_array_equal(out, (r0 + r1).astype(np.float32))
    # and it approximates the exact matmul of the logical [4P, X] operands (k = 4p + j, "1x32")
    lg = [mx.deinterleave_k(x.astype(np.float64), "1x32") for x in xs]
    exact = lg[0].T @ lg[1] + lg[2].T @ lg[3]
    rel = np.linalg.norm(out - exact) / np.linalg.norm(exact)
    assert rel < 0.12, rel  # e4m3 x e5m2 inputs: ~2-6 % per-element error (2-3 mantissa bits)


def test_matmul_mx_unquantized_scale_tile_raises():
    """A kernel that forgot quantize_mx for the moving scales trips the uninitialised-read check."""

    def kernel(x):
        s = nl.ndarray((128, 64), x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=s, src=x)
        q = nl.ndarray((128, 16), nl.float8_e4m3fn_x4, buffer=nl.sbuf)
        sc = nl.ndarray((128, 16), nl.uint8, buffer=nl.sbuf)
        nisa.quantize_mx(dst=q, src=s, dst_scale=sc)
        other = nl.ndarray((128, 16), nl.uint8, buffer=nl.sbuf)  # never written
        ps = nl.ndarray((16, 16), nl.float32, buffer=nl.psum)
        # K=512, M=16, N=16
        nisa.nc_matmul_mx(dst=ps, stationary=q, moving=q, stationary_scale=sc, moving_scale=other)
        return None

    with pytest.raises(UninitializedReadError, match="moving_scale"):
        simulate(kernel, x=randn(0, (128, 64), BF16))


def test_matmul_mx_trace_attrs():
    from nkilib.simulator import run_kernel

    K, M, N = 64, 32, 48
    sw, mw = _random_words(1, (K, M), E4), _random_words(2, (K, N), FP4)
    ss, ms = _random_scales(3, 8, M), _random_scales(4, 8, N)
    res = run_kernel(_matmul_kernel(E4, FP4), kwargs=dict(st=sw[None], mv=mw[None], ss=_quadrant_tile(ss)[None],
                                                          ms=_quadrant_tile(ms)[None]), trace=True)
    rec = [r for r in res.trace if r.instr == "nc_matmul_mx"]
    assert len(rec) == 1
    a = rec[0].attrs
    assert (a["K"], a["M"], a["N"]) == (4 * K, M, N)
    assert (a["in_dtype"], a["moving_dtype"], a["dst_dtype"]) == (E4, FP4, "float32")
    assert rec[0].engine == "tensor"
    # scale reads are the 4-row quadrant blocks only (K=64 -> 2 quadrants)
    scale_reads = [o for o in rec[0].reads if o.arg == "stationary_scale"]
    assert [(o.partition_lo, o.partition_hi) for o in scale_reads] == [(0, 4), (32, 36)]


def test_quantize_shape_only_mode():
    from nkilib.simulator import run_kernel

    res = run_kernel(_quantize_kernel(E4), kwargs=dict(src=randn(0, (128, 64), BF16)), numerics=False, trace=True)
    assert res.outputs == (None, None)
    assert [r.instr for r in res.trace].count("quantize_mx") == 1
