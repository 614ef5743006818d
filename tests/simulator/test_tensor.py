"""NkiTensor views, indexing, .view/.ap, allocation, sentinels and storage precision
(docs/simulator.md#tensors-and-views)."""
import ml_dtypes
import numpy as np
import pytest

import nki.isa as nisa
import nki.language as nl
from simkit import BF16, bits, hbm_store, in_kernel, randn, sbuf_load, simulate

from nkilib.simulator.errors import NkiValidationError, OutOfBoundsError, UninitializedReadError


def _sbuf(shape, dtype=nl.float32):
    return nl.ndarray(shape, dtype, buffer=nl.sbuf)


def _geom(t):
    return t.shape, t.strides, t.offset


# ---------------------------------------------------------------------------------------------
# indexing (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.language.NkiTensor.html)
# ---------------------------------------------------------------------------------------------

def test_on_chip_indexing_shapes():
    def body():
        t = _sbuf((64, 64, 64))
        u = _sbuf((128, 64, 32))
        return [
            _geom(t[:, 0, 10]),
            _geom(t[0, 0, 10]),
            _geom(t[0]),
            _geom(t[3, :, 5]),
            _geom(u[:, 3]),
            _geom(u[5:9, :, 2]),
            _geom(u[-1]),
            _geom(u[..., 0]),
            _geom(u[1:3, ..., 4:6]),
        ]

    got = in_kernel(body)
    # int on a free dim keeps the last free dim as size 1 (its stride is irrelevant for a size-1 dim)
    assert (got[0][0], got[0][1][0], got[0][2]) == ((64, 1), 4096, 10)
    assert (got[1][0], got[1][1][0], got[1][2]) == ((1, 1), 4096, 10)
    assert got[2] == ((1, 64, 64), (4096, 64, 1), 0)  # int on dim 0 keeps a size-1 partition dim
    assert got[3] == ((1, 64), (4096, 64), 3 * 4096 + 5)
    assert got[4] == ((128, 32), (2048, 1), 3 * 32)
    assert got[5] == ((4, 64), (2048, 32), 5 * 2048 + 2)
    assert got[6] == ((1, 64, 32), (2048, 32, 1), 127 * 2048)
    assert got[7] == ((128, 64), (2048, 32), 0)
    assert got[8] == ((2, 64, 2), (2048, 32, 1), 2048 + 4)


def test_hbm_indexing_drops_dims():
    def k(h):
        assert _geom(h[1]) == ((6, 8), (8, 1), 48)
        assert _geom(h[1, 2]) == ((8,), (1,), 64)
        assert h[1, 2, 3].shape == (1,)
        assert _geom(h[-1, :, 7]) == ((6,), (8,), 3 * 48 + 7)
        t = _sbuf((1, 8))
        nisa.dma_copy(dst=t, src=h[1, 2])
        col = _sbuf((6, 1))
        nisa.dma_copy(dst=col, src=h[-1, :, 7])
        return hbm_store(t), hbm_store(col)

    h = randn(0, (4, 6, 8))
    row, col = simulate(k, h=h)
    np.testing.assert_array_equal(row, h[1, 2][None, :])
    np.testing.assert_array_equal(col, h[-1, :, 7][:, None])


def test_on_chip_index_values():
    def k(a):
        t = sbuf_load(a)
        out = _sbuf((8, 1))
        nisa.tensor_copy(dst=out, src=t[:, 2, 3])
        one = _sbuf((1, 1))
        nisa.tensor_copy(dst=one, src=t[7, 5, 1])
        return hbm_store(out), hbm_store(one)

    a = randn(1, (8, 6, 4))
    out, one = simulate(k, a=a)
    np.testing.assert_array_equal(out, a[:, 2, 3:4])
    np.testing.assert_array_equal(one, a[7:8, 5, 1:2])


def test_ds_is_a_static_slice():
    def body():
        t = _sbuf((128, 64))
        assert _geom(t[nl.ds(8, 16), nl.ds(2, 4)]) == _geom(t[8:24, 2:6]) == ((16, 4), (64, 1), 8 * 64 + 2)
        assert nl.ds(3, 5) == slice(3, 8)
        with pytest.raises(NkiValidationError, match="size must be >= 1"):
            nl.ds(0, 0)
        with pytest.raises(OutOfBoundsError):
            t[nl.ds(120, 16)]
        return True

    assert in_kernel(body)


@pytest.mark.parametrize("key", [
    (slice(0, 129),), (slice(120, 130),), (slice(None), slice(60, 70)), (128,), (-129,), (slice(5, 5),),
    (slice(6, 2),), (slice(None), 64), (0, 0, 0),
])
def test_out_of_range_index_rejected(key):
    def body():
        t = _sbuf((128, 64))
        with pytest.raises(OutOfBoundsError) as e:
            t[key]
        return e.value

    err = in_kernel(body)
    assert isinstance(err, IndexError) and isinstance(err, NkiValidationError)


def test_bad_slice_step_and_index_type_rejected():
    def body():
        t = _sbuf((128, 64))
        with pytest.raises(OutOfBoundsError, match="step must be >= 1"):
            t[:, ::-1]
        with pytest.raises(TypeError, match="unsupported index"):
            t[:, 1.5]
        with pytest.raises(NkiValidationError, match="item assignment"):
            t[0] = 1.0
        return t[:, 1:64:3].shape

    assert in_kernel(body) == (128, 21)


# ---------------------------------------------------------------------------------------------
# reshape / permute / broadcast
# ---------------------------------------------------------------------------------------------

def test_on_chip_reshape_rules():
    def body():
        t = _sbuf((128, 64))
        assert _geom(t.reshape((128, 8, 8))) == ((128, 8, 8), (64, 8, 1), 0)
        assert _geom(t[4:8].reshape((4, 8, 8))) == ((4, 8, 8), (64, 8, 1), 256)
        assert _geom(t[:, 32:64].reshape((128, 4, -1))) == ((128, 4, 8), (64, 8, 1), 32)
        with pytest.raises(NkiValidationError, match="keep the partition dim"):
            t.reshape((64, 128))
        with pytest.raises(NkiValidationError, match="not contiguous"):
            t[:, ::2].reshape((128, 4, 8))
        with pytest.raises(NkiValidationError, match="not contiguous"):
            t.reshape((128, 8, 8)).permute((0, 2, 1)).reshape((128, 64))
        with pytest.raises(NkiValidationError, match="cannot reshape"):
            t.reshape((128, 63))
        with pytest.raises(NkiValidationError, match="at most one -1"):
            t.reshape((128, -1, -1))
        return True

    assert in_kernel(body)


def test_hbm_reshape_values():
    def k(a):
        r = a.reshape((2, 12))
        assert r.shape == (2, 12) and a.reshape((-1,)).shape == (24,)
        with pytest.raises(NkiValidationError, match="not contiguous"):
            a.permute((1, 0)).reshape((24,))
        return hbm_store(sbuf_load(r))

    a = randn(2, (4, 6))
    np.testing.assert_array_equal(simulate(k, a=a), a.reshape(2, 12))


def test_permute_rules_and_values():
    def k(a):
        t = sbuf_load(a)  # [8, 4, 6]
        p = t.permute((0, 2, 1))
        assert p.shape == (8, 6, 4)
        with pytest.raises(NkiValidationError, match="keep dim 0 first"):
            t.permute((1, 0, 2))
        with pytest.raises(NkiValidationError, match="not a permutation"):
            t.permute((0, 1, 1))
        dst = _sbuf((8, 6, 4))
        nisa.tensor_copy(dst=dst, src=p)
        ht = a.permute((2, 0, 1))  # HBM: any order
        assert ht.shape == (6, 8, 4)
        ht_tile = _sbuf((6, 8, 4))
        nisa.dma_copy(dst=ht_tile, src=ht)
        return hbm_store(dst), hbm_store(ht_tile)

    a = randn(3, (8, 4, 6))
    p, ht = simulate(k, a=a)
    np.testing.assert_array_equal(p, a.transpose(0, 2, 1))
    np.testing.assert_array_equal(ht, a.transpose(2, 0, 1))


def test_broadcast_rules_and_values():
    def k(a):
        t = sbuf_load(a)  # [8, 1]
        b = t.broadcast(1, 5)
        assert _geom(b) == ((8, 5), (1, 0), 0)
        with pytest.raises(NkiValidationError, match="size-1 free dim"):
            t.broadcast(0, 4)
        wide = _sbuf((8, 5))
        with pytest.raises(NkiValidationError, match="size-1 free dim"):
            wide.broadcast(1, 10)
        nisa.tensor_copy(dst=wide, src=b)
        e = t.expand_dim(1)
        assert e.shape == (8, 1, 1)
        assert e.squeeze_dim(1).shape == (8, 1)
        with pytest.raises(NkiValidationError):
            t.expand_dim(0)
        return hbm_store(wide)

    a = randn(4, (8, 1))
    np.testing.assert_array_equal(simulate(k, a=a), np.repeat(a, 5, axis=1))


# ---------------------------------------------------------------------------------------------
# .view (bit reinterpretation,
# https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.language.NkiTensor.html)
# ---------------------------------------------------------------------------------------------

def _special_fp32(seed, shape):
    """Random fp32 values plus NaN payloads, infinities, signed zeros and subnormals."""
    a = randn(seed, shape)
    flat = a.reshape(-1).view(np.uint32)
    flat[:8] = [0x7FC00001, 0xFFA00000, 0x7F800001, 0x7F800000, 0xFF800000, 0x80000000, 0x00000001, 0x807FFFFF]
    return a


def test_view_fp32_uint8_round_trip_bit_exact():
    def k(a):
        t = sbuf_load(a)  # fp32 [128, 64]
        u8 = t.view(nl.uint8)
        assert _geom(u8) == ((128, 256), (256, 1), 0)
        assert u8.dtype == nl.uint8
        back = u8.view(nl.float32)
        assert _geom(back) == ((128, 64), (64, 1), 0) and back.dtype == "float32"
        assert _geom(t[:, 16:32].view(nl.uint8)) == ((128, 64), (256, 1), 64)
        raw = nl.ndarray((128, 256), nl.uint8, buffer=nl.sbuf)
        nisa.tensor_copy(dst=raw, src=u8)  # same dtype: bit-exact
        f = _sbuf((128, 64))
        nisa.tensor_copy(dst=f, src=raw.view(nl.float32))
        return hbm_store(raw), hbm_store(f)

    a = _special_fp32(5, (128, 64))
    raw, f = simulate(k, a=a)
    assert raw.dtype == np.uint8
    np.testing.assert_array_equal(raw, a.view(np.uint8))
    np.testing.assert_array_equal(bits(f), bits(a))


def test_view_divisibility_rules():
    def body():
        u = nl.ndarray((128, 6), nl.uint8, buffer=nl.sbuf)
        with pytest.raises(NkiValidationError, match="not divisible"):
            u.view(nl.float32)
        with pytest.raises(NkiValidationError, match="not divisible"):
            nl.ndarray((128, 8), nl.uint8, buffer=nl.sbuf)[:, 1:5].view(nl.int32)
        with pytest.raises(NkiValidationError, match="last dim must be contiguous"):
            _sbuf((128, 8))[:, ::2].view(nl.uint8)
        return _geom(u.view(nl.uint16)), _geom(nl.ndarray((128, 8), nl.uint8, buffer=nl.sbuf)[:, 4:8].view(nl.int32))

    assert in_kernel(body) == (((128, 3), (3, 1), 0), ((128, 1), (2, 1), 1))


# ---------------------------------------------------------------------------------------------
# .ap (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/deep-dives/nki-aps.html;
# docs/simulator.md#choice-ap-offset)
# ---------------------------------------------------------------------------------------------

def test_ap_int32_as_bf16():
    def k(a):
        t = sbuf_load(a)  # int32 [128, 256]
        v = t.ap([[512, 128], [1, 512]], dtype=nl.bfloat16)
        assert v.shape == (128, 512) and v.dtype == nl.bfloat16
        out = nl.ndarray((128, 512), nl.bfloat16, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=v)
        return out

    a = np.random.default_rng(6).integers(-2**31, 2**31, (128, 256), dtype=np.int64).astype(np.int32)
    out = simulate(k, a=a)
    assert out.dtype == BF16
    np.testing.assert_array_equal(bits(out), a.view(np.uint16))


def test_ap_fp32_to_bf16_stub_example():
    def k(a):
        t = sbuf_load(a)  # fp32 [128, 32]
        v = t.ap([[64, 128], [1, 16]], dtype=nl.bfloat16)
        assert v.shape == (128, 16)
        return hbm_store(v)

    a = randn(7, (128, 32))
    np.testing.assert_array_equal(bits(simulate(k, a=a)), a.view(np.uint16)[:, :16])


def test_ap_partition_offset_and_inherited_offset():
    def k(a):
        t = sbuf_load(a)  # fp32 [128, 32]
        quad = t.ap([[32, 4], [1, 32]], offset=8 * 32)  # partitions 8..11
        inherit = t[4:8, 2:4].ap([[32, 2], [1, 8]])  # offset=None: the view's storage offset (row 4, col 2)
        assert inherit.offset == 4 * 32 + 2
        return hbm_store(quad), hbm_store(inherit)

    a = randn(8, (128, 32))
    quad, inherit = simulate(k, a=a)
    np.testing.assert_array_equal(quad, a[8:12])
    np.testing.assert_array_equal(inherit, a[4:6, 2:10])


def test_ap_rejections():
    def body():
        t = _sbuf((128, 32))
        with pytest.raises(NkiValidationError, match="partition step"):
            t.ap([[64, 64], [1, 32]])  # every other partition
        with pytest.raises(OutOfBoundsError, match="leaves the partition row"):
            t.ap([[32, 128], [1, 33]])
        with pytest.raises(OutOfBoundsError, match="leaves the partition row"):
            t.ap([[32, 4], [1, 16]], offset=20)
        with pytest.raises(OutOfBoundsError, match="outside its storage"):
            t.ap([[32, 128], [1, 32]], offset=32)  # partitions 1..128
        with pytest.raises(OutOfBoundsError, match="outside its storage"):
            t.ap([[32, 4], [1, 32]], offset=-32)
        with pytest.raises(NkiValidationError, match="partition pair"):
            t.ap([[32, 1]])
        with pytest.raises(NkiValidationError, match="pairs"):
            t.ap([[32, 128, 1]])
        with pytest.raises(NkiValidationError, match="scalar_offset"):
            t.ap([[32, 128], [1, 32]], scalar_offset=t[0:1, 0:1])
        with pytest.raises(NkiValidationError, match="not a multiple"):
            nl.ndarray((128, 8), nl.uint8, buffer=nl.sbuf)[:, 1:5].ap([[4, 128], [1, 2]], dtype=nl.uint16)
        return t.ap(((32, 128), (1, 32))).shape  # tuples accepted

    assert in_kernel(body) == (128, 32)


def test_ap_on_hbm_any_pattern():
    def k(h):
        tr = h.ap([[1, 8], [8, 4]])  # transpose of a [4, 8] HBM tensor
        t = _sbuf((8, 4))
        nisa.dma_copy(dst=t, src=tr)
        with pytest.raises(OutOfBoundsError):
            h.ap([[8, 5], [1, 8]])
        return hbm_store(t)

    h = randn(9, (4, 8))
    np.testing.assert_array_equal(simulate(k, h=h), h.T)


# ---------------------------------------------------------------------------------------------
# allocation: sentinels, limits, buffers
# ---------------------------------------------------------------------------------------------

def _sentinel_kernel(x):
    outs = []
    for dt in (nl.float32, nl.bfloat16, nl.int32, nl.uint8, nl.int16):
        t = nl.ndarray((4, 8), dt, buffer=nl.sbuf)
        outs.append(hbm_store(t))
    return tuple(outs)


def test_sentinels_visible_without_strict(monkeypatch):
    monkeypatch.setenv("NKILIB_SIM_STRICT", "0")
    f32, b16, i32, u8, i16 = simulate(_sentinel_kernel, x=np.zeros((1, 1), np.float32))
    assert np.isnan(f32).all() and np.isnan(b16.astype(np.float32)).all()
    assert b16.dtype == BF16
    for arr, dt in ((i32, np.int32), (u8, np.uint8), (i16, np.int16)):
        assert arr.dtype == dt
        np.testing.assert_array_equal(arr, np.full((4, 8), 4, dt))


def test_uninitialised_read_raises_in_strict_mode():
    # copying never-written memory is legal (garbage on hardware); handing it to the host as an output is not
    with pytest.raises(UninitializedReadError, match=r"kernel output '\w+' has 32 of 32 elements never written"):
        simulate(_sentinel_kernel, x=np.zeros((1, 1), np.float32))

    def partial(a):
        t = _sbuf((4, 8))
        nisa.dma_copy(dst=t[:, 0:6], src=a[:, 0:6])
        return hbm_store(t)

    with pytest.raises(UninitializedReadError, match=r"has 8 of 32 elements never written"):
        simulate(partial, a=randn(10, (4, 8)))

    def used(a):
        t = _sbuf((4, 8))
        nisa.dma_copy(dst=t[:, 0:6], src=a[:, 0:6])
        r = _sbuf((4, 8))
        nisa.tensor_scalar(dst=r, data=t, op0=nl.multiply, operand0=2.0)  # a computation uses the garbage
        return hbm_store(r)

    msg = r"tensor_scalar: argument 'data' reads 8 element\(s\) of tensor '\w+'.*first at view index \(0, 6\)"
    with pytest.raises(UninitializedReadError, match=msg):
        simulate(used, a=randn(10, (4, 8)))


def test_allocation_rules():
    def body():
        with pytest.raises(NkiValidationError, match="partition dimension 129 exceeds"):
            nl.ndarray((129, 4), nl.float32, buffer=nl.sbuf)
        with pytest.raises(NkiValidationError, match="partition dimension 256 exceeds"):
            nl.ndarray((256, 4), nl.float32, buffer=nl.psum)
        with pytest.raises(NkiValidationError, match="string buffer names are rejected"):
            nl.ndarray((4, 4), nl.float32, buffer="sbuf")
        with pytest.raises(NkiValidationError, match="string buffer names are rejected"):
            nl.ndarray((4, 4), nl.float32, buffer="shared_hbm")
        with pytest.raises(NkiValidationError, match=">= 2 dims"):
            nl.ndarray((128,), nl.float32, buffer=nl.sbuf)
        with pytest.raises(NkiValidationError, match="sizes >= 1"):
            nl.ndarray((4, 0), nl.float32, buffer=nl.sbuf)
        with pytest.raises(TypeError, match="unknown NKI dtype"):
            nl.ndarray((4, 4), "float31", buffer=nl.sbuf)
        h = nl.ndarray((200, 3), nl.float32, buffer=nl.hbm)  # HBM has no partition limit
        t = nl.ndarray((128, 4), "bfloat16")  # default buffer sbuf, dtype by name
        return h.buffer, h.shape, t.buffer, t.dtype, nl.hbm == nl.private_hbm

    assert in_kernel(body) == (nl.private_hbm, (200, 3), nl.sbuf, nl.bfloat16, True)


def _precision_kernel(a):
    return hbm_store(sbuf_load(a, nl.bfloat16), nl.float32)


def test_precise_fp_rounds_bf16(monkeypatch):
    # 1 + 2^-8 is a tie between bf16 neighbours 1 and 1 + 2^-7: RNE -> 1; 1 + 3*2^-8 -> 1 + 2^-6
    a = np.array([[1 + 2**-8, 1 + 3 * 2**-8, 1 / 3, 1e-3]], np.float32)
    expect = np.array([[1.0, 1 + 2**-6, 0.333984375, 0.00099945068359375]], np.float32)
    np.testing.assert_array_equal(simulate(_precision_kernel, a=a), expect)
    monkeypatch.setenv("NKI_PRECISE_FP", "1")
    np.testing.assert_array_equal(simulate(_precision_kernel, a=a), expect)
    monkeypatch.setenv("NKI_PRECISE_FP", "0")
    np.testing.assert_array_equal(simulate(_precision_kernel, a=a), a)  # stored as fp32: no rounding
    monkeypatch.setenv("NKI_PRECISE_FP", "2")
    with pytest.raises(ValueError, match="NKI_PRECISE_FP"):
        simulate(_precision_kernel, a=a)


def test_reinterpret_rejected_without_precise_fp(monkeypatch):
    monkeypatch.setenv("NKI_PRECISE_FP", "0")

    def body():
        t = nl.ndarray((4, 8), nl.bfloat16, buffer=nl.sbuf)
        with pytest.raises(NkiValidationError, match="NKI_PRECISE_FP=0"):
            t.view(nl.uint16)
        with pytest.raises(NkiValidationError, match="NKI_PRECISE_FP=0"):
            t.ap([[8, 4], [1, 8]], dtype=nl.int16)
        # exact storages may still be reinterpreted, also as a low-precision float (raw bytes)
        u = nl.ndarray((4, 8), nl.uint16, buffer=nl.sbuf).ap([[8, 4], [1, 8]], dtype=nl.bfloat16)
        return nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf).view(nl.uint8).shape, u.shape

    assert in_kernel(body) == ((4, 32), (4, 8))


def test_bf16_view_of_uint16_input_bit_exact_without_precise_fp(monkeypatch):
    monkeypatch.setenv("NKI_PRECISE_FP", "0")

    def k(a):
        t = sbuf_load(a)  # uint16 storage is exact in both modes
        return hbm_store(t.view(nl.bfloat16), nl.float32)

    a = np.array([[0x3F80, 0x3F81, 0xC000, 0x0001]], np.uint16)
    np.testing.assert_array_equal(simulate(k, a=a), a.view(BF16).astype(np.float32))


def test_dtype_objects_equal_their_names():
    names = ["bool_", "int8", "uint8", "int16", "uint16", "int32", "uint32", "float16", "bfloat16", "float32",
             "tfloat32", "float8_e4m3", "float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu", "float8_e4m3fn_x4",
             "float8_e5m2_x4", "float4_e2m1fn_x4"]
    sizes = [1, 1, 1, 2, 2, 4, 4, 2, 2, 4, 4, 1, 1, 1, 1, 4, 4, 2]
    for name, size in zip(names, sizes):
        d = getattr(nl, name)
        assert d == name and str(d) == name and hash(d) == hash(name)
        assert d.itemsize == size
        assert {name: 1}[d] == 1
    assert nl.bool == nl.bool_
    assert nl.float32 != nl.bfloat16
    assert np.dtype(nl.float32) == np.float32 and np.dtype(nl.int32) == np.int32
    assert nl.float8_e4m3fn_x4.is_x4 and not nl.float32.is_x4
    assert nl.float8_e4m3.precise_np == np.dtype(ml_dtypes.float8_e4m3)


def test_input_dtypes_map_to_nki_dtypes():
    got = []

    def kernel(a, b, c, d):
        got.append((a.dtype, b.dtype, c.dtype, d.dtype, a.buffer))

    simulate(kernel, a=np.zeros((2, 2), BF16), b=np.zeros((2, 2), ml_dtypes.float8_e4m3fn),
             c=np.zeros((2, 2), np.uint32), d=np.zeros((2, 2), ml_dtypes.float8_e8m0fnu))
    assert got == [("bfloat16", "float8_e4m3fn", "uint32", "float8_e8m0fnu", nl.private_hbm)]
    with pytest.raises(TypeError, match="no NKI equivalent"):
        simulate(kernel, a=np.zeros((2, 2), np.float64), b=np.zeros(1), c=np.zeros(1), d=np.zeros(1))
