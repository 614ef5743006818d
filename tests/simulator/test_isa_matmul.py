"""nc_matmul (accumulation, bf16 PSUM, size limits, double_row, transpose mode, tiling) and the instruction trace
(copies: test_isa_copies.py).

Spec section §5.3 (nc_matmul).
"""
import numpy as np
import pytest

import nki.isa as nisa
import nki.language as nl
from simkit import BF16, bits, hbm_store, randn, sbuf_load, simulate

from nkilib.simulator import run_kernel
from nkilib.simulator.errors import NkiValidationError, UninitializedReadError
from test_isa_copies import E4M3, E4M3FN, E5M2, SPECIAL_BITS, with_specials


# ---------------------------------------------------------------------------------------------
# nc_matmul
# ---------------------------------------------------------------------------------------------

def _matmul_kernel(dst_dtype=nl.float32, **mm_kwargs):
    def k(s, v):
        st, mv = sbuf_load(s), sbuf_load(v)
        m, n = s.shape[-1], v.shape[-1]
        dst = nl.ndarray((m, n), dst_dtype, buffer=nl.psum)
        nisa.nc_matmul(dst=dst, stationary=st, moving=mv, **mm_kwargs)
        res = nl.ndarray((m, n), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=res, src=dst)
        return hbm_store(res)

    return k


def _ref(s, v):
    """float64 reference: dst[m, n] = sum_k s[k, m] v[k, n] (double_row: also over the size-2 dim)."""
    s64, v64 = s.astype(np.float64), v.astype(np.float64)
    if s.ndim == 3:
        return np.einsum("ktm,ktn->mn", s64, v64)
    return s64.T @ v64


@pytest.mark.parametrize("s_dt,v_dt,target", [
    (BF16, BF16, "trn2"), (BF16, BF16, "trn3"), (E4M3, E4M3, "trn2"), (E5M2, E5M2, "trn3"), (E4M3, E5M2, "trn2"),
    (BF16, E5M2, "trn3"), (np.float16, BF16, "trn3"), (np.float32, np.float32, "trn2"), (E4M3FN, E4M3FN, "trn3"),
    (E4M3FN, E5M2, "trn3"),
], ids=str)
def test_nc_matmul_vs_float64(set_target, s_dt, v_dt, target):
    set_target(target)
    s = randn(20, (128, 96), scale=2.0).astype(s_dt)
    v = randn(21, (128, 200), scale=2.0).astype(v_dt)
    out = simulate(_matmul_kernel(), s=s, v=v)
    ref = _ref(s, v)
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-5 * np.abs(ref).max())


def test_nc_matmul_small_k_hand_computed():
    s = np.array([[1, 2], [3, 4]], np.float32).astype(BF16)  # [K=2, M=2]
    v = np.array([[1, 0, 2], [0, 1, -1]], np.float32).astype(BF16)  # [K=2, N=3]
    out = simulate(_matmul_kernel(), s=s, v=v)
    np.testing.assert_array_equal(out, [[1, 3, -1], [2, 4, 0]])


A = np.array([[1, 2], [3, 4]], np.float32)
B = np.array([[10, 20], [30, 40]], np.float32)
C = np.array([[100, 200], [300, 400]], np.float32)
D = np.array([[1024, 2048], [3072, 4096]], np.float32)  # bf16-exact
E = np.array([[5, 6], [7, 8]], np.float32)


def test_accumulate_semantics_sequence():
    # stationary = I, so each matmul's result is its moving block
    def k(ident, v):
        st, mv = sbuf_load(ident), sbuf_load(v)
        p = nl.ndarray((2, 2), nl.float32, buffer=nl.psum)
        snaps = nl.ndarray((2, 10), nl.float32, buffer=nl.sbuf)
        for i, acc in enumerate((None, None, False, True, None)):
            nisa.nc_matmul(dst=p, stationary=st, moving=mv[:, 2 * i:2 * i + 2], accumulate=acc)
            nisa.tensor_copy(dst=snaps[:, 2 * i:2 * i + 2], src=p)
        return hbm_store(snaps)

    v = np.concatenate([A, B, C, D, E], axis=1).astype(BF16)
    out = simulate(k, ident=np.eye(2, dtype=BF16), v=v)
    expect = np.concatenate([
        [[1, 2], [3, 4]],  # None, first write: overwrite
        [[11, 22], [33, 44]],  # None: accumulate
        [[100, 200], [300, 400]],  # False: overwrite
        [[1124, 2248], [3372, 4496]],  # True: accumulate
        [[1129, 2254], [3379, 4504]],  # None: accumulate
    ], axis=1)
    np.testing.assert_array_equal(out, expect)


def test_accumulate_none_is_per_element_and_memset_is_not_a_matmul_write():
    def k(ident, v):
        st, mv = sbuf_load(ident), sbuf_load(v)
        p = nl.ndarray((2, 3), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=p[:, 0:2], stationary=st, moving=mv[:, 0:2])  # A into columns 0-1
        nisa.nc_matmul(dst=p[:, 1:3], stationary=st, moving=mv[:, 2:4])  # B into 1-2: col 1 adds, col 2 overwrites
        q = nl.ndarray((2, 2), nl.float32, buffer=nl.psum)
        nisa.memset(dst=q, value=100.0)
        nisa.nc_matmul(dst=q, stationary=st, moving=mv[:, 0:2])  # first matmul write: overwrites the memset
        nisa.nc_matmul(dst=q, stationary=st, moving=mv[:, 2:4])
        out = nl.ndarray((2, 5), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=out[:, 0:3], src=p)
        nisa.tensor_copy(dst=out[:, 3:5], src=q)
        return hbm_store(out)

    out = simulate(k, ident=np.eye(2, dtype=BF16), v=np.concatenate([A, B], axis=1).astype(BF16))
    np.testing.assert_array_equal(out, [[1, 12, 20, 11, 22], [3, 34, 40, 33, 44]])


def _accumulate_true_first(ident, v):
    st, mv = sbuf_load(ident), sbuf_load(v)
    p = nl.ndarray((2, 2), nl.float32, buffer=nl.psum)
    nisa.memset(dst=p, value=0.0)  # a value write does not make the location matmul-initialised
    nisa.nc_matmul(dst=p, stationary=st, moving=mv, accumulate=True)
    r = nl.ndarray((2, 2), nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=r, src=p)
    return hbm_store(r)


def test_accumulate_true_on_unwritten_psum(monkeypatch):
    inputs = dict(ident=np.eye(2, dtype=BF16), v=A.astype(BF16))
    with pytest.raises(NkiValidationError, match="accumulate=True on PSUM tensor .* never written by a matmul"):
        simulate(_accumulate_true_first, **inputs)
    monkeypatch.setenv("NKILIB_SIM_STRICT", "0")
    np.testing.assert_array_equal(simulate(_accumulate_true_first, **inputs), A)


@pytest.mark.parametrize("value", [1, 0, "yes", 1.0])
def test_accumulate_value_validated(value):
    with pytest.raises(NkiValidationError, match=f"accumulate must be None, True or False, got {value!r}"):
        simulate(_matmul_kernel(accumulate=value), s=np.eye(2, dtype=BF16), v=A.astype(BF16))
    out = simulate(_matmul_kernel(accumulate=np.False_), s=np.eye(2, dtype=BF16), v=A.astype(BF16))
    np.testing.assert_array_equal(out, A)


def _bf16_psum_kernel(s, v):
    """Three bf16 PSUM results (see test): single-instruction 257, chain 256+1+1, chain 256+3."""
    st, mv = sbuf_load(s), sbuf_load(v)  # s [2, 1] = [[1], [1]]; v [2, 6]
    out = nl.ndarray((1, 3), nl.float32, buffer=nl.sbuf)
    p1 = nl.ndarray((1, 1), nl.bfloat16, buffer=nl.psum)
    nisa.nc_matmul(dst=p1, stationary=st, moving=mv[:, 0:1])  # 256 + 1 in one instruction
    p2 = nl.ndarray((1, 1), nl.bfloat16, buffer=nl.psum)
    for j in (1, 2, 3):  # 256, then + 1, then + 1 (row 1 of v is 0 in these columns)
        nisa.nc_matmul(dst=p2, stationary=st[0:1, :], moving=mv[0:1, j:j + 1])
    p3 = nl.ndarray((1, 1), nl.bfloat16, buffer=nl.psum)
    nisa.nc_matmul(dst=p3, stationary=st[0:1, :], moving=mv[0:1, 1:2])
    nisa.nc_matmul(dst=p3, stationary=st[0:1, :], moving=mv[0:1, 4:5], accumulate=True)  # + 3
    for i, p in enumerate((p1, p2, p3)):
        nisa.tensor_copy(dst=out[:, i:i + 1], src=p)
    return hbm_store(out)


def test_bf16_psum_dst_trn3_rounds_each_write(set_target):
    set_target("trn3")
    s = np.ones((2, 1), BF16)
    v = np.array([[256, 256, 1, 1, 3, 0], [1, 0, 0, 0, 0, 0]], np.float32).astype(BF16)
    out = simulate(_bf16_psum_kernel, s=s, v=v)
    # bf16 spacing in [256, 512) is 2: 257 -> 256 (tie to even), 256+1 -> 256 twice, 259 -> 260 (tie to even)
    np.testing.assert_array_equal(out, [[256, 256, 260]])


def test_bf16_psum_dst_rejected_on_trn2(set_target):
    set_target("trn2")
    with pytest.raises(NkiValidationError, match="dst dtype must be float32 on trn2, got bfloat16"):
        simulate(_matmul_kernel(nl.bfloat16), s=np.eye(2, dtype=BF16), v=A.astype(BF16))


@pytest.mark.parametrize("target,dst_dtype,n,ok", [
    ("trn2", nl.float32, 512, True), ("trn2", nl.float32, 513, False),
    ("trn3", nl.float32, 4096, True), ("trn3", nl.float32, 4097, False),
    ("trn3", nl.bfloat16, 8192, True), ("trn3", nl.bfloat16, 8193, False),
])
def test_moving_free_size_limits(set_target, target, dst_dtype, n, ok):
    set_target(target)

    def k(s, v):
        st, mv = sbuf_load(s), sbuf_load(v)
        # a [1, n] dst that cannot exist in PSUM is replaced by a [1, 1] one: the size check comes first
        dst = nl.ndarray((1, n if ok else 1), dst_dtype, buffer=nl.psum)
        nisa.nc_matmul(dst=dst, stationary=st, moving=mv)
        res = nl.ndarray((1, n), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=res, src=dst)
        return hbm_store(res)

    s = np.full((1, 1), 2.0, BF16)
    v = (np.arange(n, dtype=np.float32) % 64).reshape(1, n).astype(BF16)
    if ok:
        np.testing.assert_array_equal(simulate(k, s=s, v=v), 2.0 * v.astype(np.float32))
    else:
        with pytest.raises(NkiValidationError, match=rf"moving free size {n} exceeds the {target} limit"):
            simulate(k, s=s, v=v)


def _mm_error(s_shape, v_shape, s_dt=BF16, v_dt=BF16, dst_shape=None, dst_dtype=nl.float32, where=("sbuf", "sbuf"),
              dst_buf="psum", **kw):
    def k(s, v):
        st, mv = sbuf_load(s), sbuf_load(v)
        if where[0] == "psum":
            st2 = nl.ndarray(s.shape, nl.float32, buffer=nl.psum)
            nisa.tensor_copy(dst=st2, src=st)
            st = st2
        if where[1] == "psum":
            mv2 = nl.ndarray(v.shape, nl.float32, buffer=nl.psum)
            nisa.tensor_copy(dst=mv2, src=mv)
            mv = mv2
        shape = dst_shape or (s.shape[-1], v.shape[-1])
        dst = nl.ndarray(shape, dst_dtype, buffer=getattr(nl, dst_buf))
        nisa.nc_matmul(dst=dst, stationary=st, moving=mv, **kw)

    return simulate(k, s=randn(30, s_shape).astype(s_dt), v=randn(31, v_shape).astype(v_dt))


@pytest.mark.parametrize("target,kwargs,msg", [
    ("trn3", dict(s_shape=(4, 129), v_shape=(4, 8), dst_shape=(128, 8)), "stationary free size 129 exceeds"),
    ("trn3", dict(s_shape=(4, 8), v_shape=(4, 8), where=("psum", "sbuf")),
     "argument 'stationary' .* must be in SBUF, got psum"),
    ("trn3", dict(s_shape=(4, 8), v_shape=(4, 8), where=("sbuf", "psum")), "argument 'moving' .* must be in SBUF"),
    ("trn3", dict(s_shape=(4, 8), v_shape=(4, 8), dst_buf="sbuf"), "argument 'dst' .* must be in PSUM, got sbuf"),
    ("trn2", dict(s_shape=(4, 8), v_shape=(4, 8), s_dt=E4M3FN, v_dt=E4M3FN),
     "has dtype float8_e4m3fn; expected one of"),
    ("trn3", dict(s_shape=(4, 8), v_shape=(4, 8), s_dt=E4M3, v_dt=E4M3FN),
     "legacy float8_e4m3 and OCP float8_e4m3fn inputs may not be mixed"),
    ("trn3", dict(s_shape=(4, 8), v_shape=(4, 8), s_dt=np.float32, v_dt=BF16),
     "if either input is float32/tfloat32 both must be"),
    ("trn3", dict(s_shape=(4, 8), v_shape=(4, 8), s_dt=np.int8, v_dt=np.int8), "has dtype int8"),
    ("trn3", dict(s_shape=(4, 8), v_shape=(3, 8)), "same partition \\(contraction\\) size, got 4 and 3"),
    ("trn3", dict(s_shape=(4, 8), v_shape=(4, 8), dst_shape=(8, 4)), r"dst must be \[8, 8\]"),
    ("trn3", dict(s_shape=(4, 8), v_shape=(4, 8), dst_dtype=nl.float16), "dst dtype must be float32 or bfloat16"),
    ("trn3", dict(s_shape=(4, 8), v_shape=(4, 8), perf_mode="fast"), "perf_mode must be 'none' or 'double_row'"),
])
def test_nc_matmul_rejections(set_target, target, kwargs, msg):
    set_target(target)
    with pytest.raises(NkiValidationError, match=msg):
        _mm_error(**kwargs)


@pytest.mark.parametrize("target,s_dt,v_dt", [
    ("trn2", E4M3, E5M2), ("trn3", E4M3, E5M2), ("trn2", E5M2, E5M2), ("trn3", E5M2, E5M2),
    ("trn3", E4M3FN, E4M3FN),  # float8_e4m3fn is a NeuronCore-v4 input only
], ids=str)
def test_double_row_fp8_vs_numpy(set_target, target, s_dt, v_dt):
    set_target(target)
    s = randn(40, (128, 2, 64), scale=4.0).astype(s_dt)
    v = randn(41, (128, 2, 300), scale=4.0).astype(v_dt)
    out = simulate(_matmul_kernel(perf_mode=nisa.matmul_perf_mode.double_row), s=s, v=v)
    ref = _ref(s, v)
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-5 * np.abs(ref).max())
    out_str = simulate(_matmul_kernel(perf_mode="double_row"), s=s, v=v)
    np.testing.assert_array_equal(out_str, out)


@pytest.mark.parametrize("kwargs,msg", [
    (dict(s_shape=(4, 2, 8), v_shape=(4, 2, 8), perf_mode=nisa.matmul_perf_mode.double_row),
     "double_row requires fp8 inputs"),
    (dict(s_shape=(4, 3, 8), v_shape=(4, 3, 8), s_dt=E5M2, v_dt=E5M2, perf_mode=nisa.matmul_perf_mode.double_row),
     r"requires \[K, 2, M\] / \[K, 2, N\] operands"),
    (dict(s_shape=(4, 2, 8), v_shape=(4, 2, 8), s_dt=E5M2, v_dt=E5M2, perf_mode=nisa.matmul_perf_mode.double_row,
          tile_position=(0, 0), tile_size=(32, 32)), "double_row cannot be combined with column tiling"),
    (dict(s_shape=(4, 8), v_shape=(4, 4), dst_shape=(8, 4), is_transpose=True,
          perf_mode=nisa.matmul_perf_mode.double_row), "is_transpose cannot be combined with perf_mode double_row"),
])
def test_double_row_rejections(kwargs, msg):
    with pytest.raises(NkiValidationError, match=msg):
        _mm_error(**kwargs)


def _transpose_kernel(s, ident):
    st, mv = sbuf_load(s), sbuf_load(ident)
    k_, m = s.shape
    p = nl.ndarray((m, k_), s.dtype, buffer=nl.psum)
    nisa.nc_matmul(dst=p, stationary=st, moving=mv, is_transpose=True)
    r = nl.ndarray((m, k_), s.dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=r, src=p)
    return hbm_store(r)


@pytest.mark.parametrize("dtype", [BF16, np.float32, np.float16], ids=str)
def test_transpose_mode_bit_exact(any_target, dtype):
    s = randn(50, (64, 96), scale=1e3).astype(dtype)
    if np.dtype(dtype) in SPECIAL_BITS:
        s = with_specials(s, SPECIAL_BITS[np.dtype(dtype)])
    out = simulate(_transpose_kernel, s=s, ident=np.eye(64, dtype=dtype))
    assert out.dtype == dtype
    np.testing.assert_array_equal(bits(out), bits(s).T)


def test_transpose_mode_rejections():
    s = randn(51, (8, 16)).astype(BF16)
    with pytest.raises(NkiValidationError, match="moving must be an identity matrix"):
        simulate(_transpose_kernel, s=s, ident=(2 * np.eye(8)).astype(BF16))
    perm = np.eye(8)[::-1].astype(BF16)
    with pytest.raises(NkiValidationError, match="moving must be an identity matrix"):
        simulate(_transpose_kernel, s=s, ident=perm)
    with pytest.raises(NkiValidationError, match=r"moving must be a \[8, 8\] identity"):
        _mm_error((8, 16), (8, 4), dst_shape=(16, 8), dst_dtype=nl.bfloat16, is_transpose=True)
    with pytest.raises(NkiValidationError, match="dst dtype float32 must equal the stationary dtype bfloat16"):
        _mm_error((8, 16), (8, 8), dst_shape=(16, 8), is_transpose=True)
    with pytest.raises(NkiValidationError, match=r"is_transpose: dst must be \[16, 8\]"):
        _mm_error((8, 16), (8, 8), dst_shape=(8, 16), dst_dtype=nl.bfloat16, is_transpose=True)


def test_tiling_valid_has_no_numeric_effect():
    s = randn(60, (64, 32)).astype(BF16)
    v = randn(61, (64, 48)).astype(BF16)
    plain = simulate(_matmul_kernel(), s=s, v=v)
    tiled = simulate(_matmul_kernel(tile_position=(64, 32), tile_size=(64, 32)), s=s, v=v)
    np.testing.assert_array_equal(tiled, plain)
    np.testing.assert_allclose(plain, _ref(s, v), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kwargs,msg", [
    (dict(tile_position=(0, 0)), "must be set together"),
    (dict(tile_size=(64, 128)), "must be set together"),
    (dict(tile_position=(0, 0, 0), tile_size=(64, 128, 1)), "must be 2-tuples"),
    (dict(tile_position=(0, 0), tile_size=(48, 128)), "tile_size row 48 must be one of"),
    (dict(tile_position=(32, 0), tile_size=(64, 128)), "tile_position row 32 must be a multiple of the tile size 64"),
    (dict(tile_position=(96, 0), tile_size=(64, 128)), "tile_position row 96 must be a multiple"),
    (dict(tile_position=(0, 0), tile_size=(32, 128)), "contraction partitions 64 exceed the row tile size 32"),
    (dict(tile_position=(0, 0), tile_size=(64, 32)), "stationary free size 40 exceeds the column tile size 32"),
])
def test_tiling_rejections(kwargs, msg):
    with pytest.raises(NkiValidationError, match=msg):
        _mm_error((64, 40), (64, 16), **kwargs)


# ---------------------------------------------------------------------------------------------
# trace (run_kernel(trace=True))
# ---------------------------------------------------------------------------------------------

def _trace_kernel(a, s):
    t = nl.ndarray((16, 32), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=a)
    part = nl.ndarray((4, 8), nl.bfloat16, buffer=nl.sbuf)
    nisa.tensor_copy(dst=part, src=t[4:8, 8:16])
    st = sbuf_load(s)  # bf16 [16, 8]
    mv = nl.ndarray((16, 32), nl.bfloat16, buffer=nl.sbuf)
    nisa.tensor_copy(dst=mv, src=t, engine=nisa.engine.scalar)
    p = nl.ndarray((8, 32), nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=p, stationary=st, moving=mv)
    r = nl.ndarray((8, 32), nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=r, src=p)
    out = nl.ndarray((8, 32), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=r)
    return out


def test_trace_records():
    a = randn(70, (16, 32))
    s = randn(71, (16, 8)).astype(BF16)
    res = run_kernel(_trace_kernel, (a, s), trace=True)
    np.testing.assert_allclose(res.outputs, _ref(s, a.astype(BF16)), rtol=1e-6, atol=1e-6)
    recs = res.trace
    assert [(r.instr, r.engine) for r in recs] == [
        ("dma_copy", "dma"), ("tensor_copy", "vector"), ("dma_copy", "dma"), ("tensor_copy", "scalar"),
        ("nc_matmul", "tensor"), ("tensor_copy", "vector"), ("dma_copy", "dma")]
    assert [r.seq for r in recs] == list(range(7)) and all(r.program == 0 for r in recs)

    load = recs[0]
    (src,), (dst,) = load.reads, load.writes
    assert (src.arg, src.buffer, src.shape, src.byte_lo, src.byte_hi, src.nbytes) == (
        "src", "private_hbm", (16, 32), 0, 2048, 2048)
    assert (dst.arg, dst.buffer, dst.dtype, dst.partition_lo, dst.partition_hi, dst.byte_lo, dst.byte_hi) == (
        "dst", "sbuf", "float32", 0, 16, 0, 128)
    assert load.attrs["bytes"] == 2048

    sub = recs[1]
    (src,), (dst,) = sub.reads, sub.writes
    # t[4:8, 8:16] of a [16, 32] fp32 tile: partitions 4..8, bytes 32..64 of each partition
    assert (src.partition_lo, src.partition_hi, src.byte_lo, src.byte_hi, src.nbytes) == (4, 8, 32, 64, 128)
    assert (dst.dtype, dst.shape, dst.nbytes) == ("bfloat16", (4, 8), 64)
    assert sub.attrs["src_dtype"] == "float32" and sub.attrs["dst_dtype"] == "bfloat16"

    mm = recs[4]
    assert (mm.attrs["K"], mm.attrs["M"], mm.attrs["N"]) == (16, 8, 32)
    assert mm.attrs["in_dtype"] == "bfloat16" and mm.attrs["dst_dtype"] == "float32"
    assert [o.arg for o in mm.reads] == ["stationary", "moving"] and mm.writes[0].buffer == "psum"
    assert mm.writes[0].byte_hi - mm.writes[0].byte_lo == 128
    assert recs[6].writes[0].buffer == "shared_hbm" and recs[6].attrs["bytes"] == 8 * 32 * 4


def test_trace_off_by_default_and_shape_only_runs():
    a = randn(72, (16, 32))
    s = randn(73, (16, 8)).astype(BF16)
    assert run_kernel(_trace_kernel, (a, s)).trace is None
    res = run_kernel(_trace_kernel, (a, s), trace=True, numerics=False)
    assert res.outputs is None
    assert len(res.trace) == 7 and res.trace[4].attrs["N"] == 32


def test_trace_lnc2_records_program_ids():
    def k(a):
        out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
        pid = nl.program_id(0)
        t = sbuf_load(a[pid:pid + 1, :])
        nisa.dma_copy(dst=out[pid:pid + 1, :], src=t)
        nisa.core_barrier(out, (0, 1))
        return out

    res = run_kernel(k, (randn(74, (2, 4)),), lnc=2, trace=True)
    assert [(r.program, r.instr) for r in res.trace] == [
        (0, "dma_copy"), (0, "dma_copy"), (0, "core_barrier"), (1, "dma_copy"), (1, "dma_copy"), (1, "core_barrier")]
    assert res.trace[2].engine == "gpsimd"


def test_uninitialised_sbuf_read_by_matmul_rejected():
    def k(s):
        st = sbuf_load(s)
        mv = nl.ndarray((4, 8), nl.bfloat16, buffer=nl.sbuf)
        p = nl.ndarray((8, 8), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=p, stationary=st, moving=mv)

    with pytest.raises(UninitializedReadError, match="nc_matmul: argument 'moving' reads 32 element"):
        simulate(k, s=randn(75, (4, 8)).astype(BF16))
