"""Indirect DMA: `.ap(vector_offset=...)` gather/scatter through nisa.dma_copy, oob_mode, duplicate rows,
the rejections of the access pattern and of dma_copy, LNC2 and the trace (nkilib/simulator/indirect.py,
nki/isa/dma_indirect.py). Expected values come from plain numpy fancy indexing.
"""
import numpy as np
import pytest

import nki.isa as nisa
import nki.language as nl
from simkit import BF16, bits, hbm_store, randn, rng, sbuf_load, simulate

from nkilib.simulator import run_kernel
from nkilib.simulator.errors import (IndirectHazardError, NkiValidationError, OutOfBoundsError, RaceError,
                                     UninitializedReadError)


def _gather_kernel(dst_dtype=None, pattern=None, offset=None, oob=nisa.oob_mode.error, dge=nisa.dge_mode.unknown,
                   fill=None):
    """dst[P, F'] = data.ap(pattern or [[F, P], [1, F]], vector_offset=idx)."""

    def k(data, idx):
        P, F = idx.shape[0] * idx.shape[1], data.shape[1]
        it = sbuf_load(idx)
        pat = pattern or [[F, P], [1, F]]
        cols = int(np.prod([n for _, n in pat[1:]]))
        t = nl.ndarray((P, cols), dst_dtype or data.dtype, buffer=nl.sbuf)
        if fill is not None:
            nisa.memset(dst=t, value=fill)
        nisa.dma_copy(dst=t, src=data.ap(pattern=pat, offset=offset, vector_offset=it, indirect_dim=0),
                      oob_mode=oob, dge_mode=dge)
        return hbm_store(t)

    return k


def _scatter_kernel(oob=nisa.oob_mode.error):
    """out = base; out.ap(vector_offset=idx) = src (rows of src land on rows idx of out)."""

    def k(src, idx, base):
        P, F = src.shape
        it, t = sbuf_load(idx), sbuf_load(src)
        out = nl.ndarray(base.shape, base.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=base)
        nisa.dma_copy(dst=out.ap(pattern=[[F, P], [1, F]], vector_offset=it, indirect_dim=0), src=t, oob_mode=oob)
        return out

    return k


# ---------------------------------------------------------------------------------------------
# gather
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("idx_dtype", [np.uint32, np.int32], ids=str)
@pytest.mark.parametrize("dtype", [np.float32, BF16, np.int16], ids=str)
def test_gather_rows_bit_exact(dtype, idx_dtype):
    data = randn(0, (50, 24), scale=30.0).astype(dtype)
    idx = rng(1).integers(0, 50, (128, 1)).astype(idx_dtype)  # duplicates included: a gather may read a row twice
    out = simulate(_gather_kernel(), data=data, idx=idx)
    np.testing.assert_array_equal(bits(out), bits(data[idx[:, 0]]))


def test_gather_converts_dtype_via_fp32():
    data = randn(2, (40, 16), scale=3.0).astype(BF16)
    idx = rng(3).integers(0, 40, (32, 1)).astype(np.uint32)
    out = simulate(_gather_kernel(dst_dtype=nl.float32), data=data, idx=idx)
    np.testing.assert_array_equal(out, data[idx[:, 0]].astype(np.float32))


def test_gather_column_window_with_offset_and_strided_free_pattern():
    data = randn(4, (30, 32))
    idx = rng(5).integers(0, 30, (16, 1)).astype(np.uint32)
    # columns 4, 6, ..., 18 of each selected row: offset 4, free pattern [2, 8]
    out = simulate(_gather_kernel(pattern=[[32, 16], [2, 8]], offset=4), data=data, idx=idx)
    np.testing.assert_array_equal(out, data[idx[:, 0]][:, 4:20:2])


def test_gather_row_stride_comes_from_the_indexed_view_and_dtype_reinterpretation():
    data = rng(6).integers(-2**31, 2**31, (24, 8), dtype=np.int64).astype(np.int32)
    idx = rng(7).integers(0, 12, (8, 1)).astype(np.uint32)

    def k(data, idx):
        it = sbuf_load(idx)
        pairs = data.reshape((12, 16))  # the indexed dim: 12 rows of 16 int32 = two rows of `data`
        t = nl.ndarray((8, 32), nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=pairs.ap(pattern=[[32, 8], [1, 32]], vector_offset=it, indirect_dim=0,
                                          dtype=nl.bfloat16))
        return hbm_store(t)

    out = simulate(k, data=data, idx=idx)
    expect = data.reshape(12, 16)[idx[:, 0]].view(np.uint16)
    np.testing.assert_array_equal(bits(out), expect)


def test_gather_dma_batching_reads_a_2d_index_tile_column_major():
    data = randn(8, (300, 16))
    idx = rng(9).integers(0, 300, (128, 2)).astype(np.uint32)

    def k(data, idx):
        it = sbuf_load(idx)
        t = nl.ndarray((128, 32), data.dtype, buffer=nl.sbuf)  # 256 rows of 16, paired row-major
        nisa.dma_copy(dst=t, src=data.ap(pattern=[[16, 256], [1, 16]], vector_offset=it, indirect_dim=0))
        return hbm_store(t)

    out = simulate(k, data=data, idx=idx)
    np.testing.assert_array_equal(out, data[idx.T.reshape(-1)].reshape(128, 32))


def test_gather_swdge_on_trn2(set_target):
    set_target("trn2")
    data = randn(10, (20, 8))
    idx = np.arange(19, -1, -1, dtype=np.uint32)[:16].reshape(16, 1)
    out = simulate(_gather_kernel(dge=nisa.dge_mode.swdge), data=data, idx=idx)
    np.testing.assert_array_equal(out, data[idx[:, 0]])


# ---------------------------------------------------------------------------------------------
# scatter
# ---------------------------------------------------------------------------------------------

def test_scatter_rows_unique_indices():
    base = randn(11, (64, 12))
    src = randn(12, (40, 12))
    idx = rng(13).permutation(64)[:40].astype(np.int32).reshape(40, 1)
    out = simulate(_scatter_kernel(), src=src, idx=idx, base=base)
    expect = base.copy()
    expect[idx[:, 0]] = src
    np.testing.assert_array_equal(out, expect)


def test_scatter_duplicate_destination_rows_is_a_hazard():
    idx = np.arange(12, dtype=np.uint32).reshape(12, 1)
    idx[9, 0] = 7  # rows 7 and 9 of the access both write row 7
    with pytest.raises(IndirectHazardError,
                       match=r"nisa.dma_copy: argument 'dst': rows 7 and 9 .*index 7 at vector_offset '.*'\[7, 0\] and "
                             r"index 7 at '.*'\[9, 0\]\); the write order of one DMA is unspecified"):
        simulate(_scatter_kernel(), src=randn(14, (12, 4)), idx=idx, base=randn(15, (16, 4)))


# ---------------------------------------------------------------------------------------------
# out-of-bounds indices
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad,idx_dtype", [(50, np.uint32), (-1, np.int32)])
def test_gather_out_of_bounds_index_raises_by_default(bad, idx_dtype):
    idx = np.zeros((16, 1), idx_dtype)
    idx[5, 0] = bad
    with pytest.raises(OutOfBoundsError, match=rf"nisa.dma_copy: argument 'src': index {bad} at vector_offset "
                                               rf"'.*'\[5, 0\] \(row 5 of the access\) is out of bounds for dim 0 of "
                                               rf"'data' \(50 rows\); oob_mode=error"):
        simulate(_gather_kernel(), data=randn(16, (50, 8)), idx=idx)


def test_gather_oob_skip_leaves_destination_rows_untouched():
    data = randn(17, (50, 8))
    idx = rng(18).integers(0, 50, (32, 1)).astype(np.uint32)
    idx[[3, 20, 31], 0] = [50, 1000, 2**32 - 1]
    out = simulate(_gather_kernel(oob=nisa.oob_mode.skip, fill=-7.0), data=data, idx=idx)
    ok = idx[:, 0] < 50
    expect = np.full((32, 8), -7.0, np.float32)
    expect[ok] = data[idx[ok, 0]]
    np.testing.assert_array_equal(out, expect)


def test_scatter_oob_skip_writes_only_valid_rows():
    base = randn(19, (20, 6))
    src = randn(20, (8, 6))
    idx = np.array([[3], [25], [0], [19], [20], [7], [11], [12]], np.int32)
    out = simulate(_scatter_kernel(oob=nisa.oob_mode.skip), src=src, idx=idx, base=base)
    expect = base.copy()
    ok = idx[:, 0] < 20
    expect[idx[ok, 0]] = src[ok]
    np.testing.assert_array_equal(out, expect)


def test_scatter_with_every_row_skipped_writes_nothing():
    """All indices are padding sentinels (e.g. an LNC2 core's rows of a block that is all padding): no row
    is transferred, no hazard to check."""
    base = randn(21, (20, 6))
    idx = np.full((4, 1), 20, np.int32)
    out = simulate(_scatter_kernel(oob=nisa.oob_mode.skip), src=randn(22, (4, 6)), idx=idx, base=base)
    np.testing.assert_array_equal(out, base)


def test_row_that_leaves_the_storage_is_out_of_bounds():
    # index 9 is a valid row of the [10, 8] tensor, but offset 4 makes its 8 elements run past the end
    idx = np.array([[1], [9]], np.uint32)
    with pytest.raises(OutOfBoundsError, match=r"index 9 at vector_offset '.*'\[1, 0\]"):
        simulate(_gather_kernel(pattern=[[8, 2], [1, 8]], offset=4), data=randn(21, (10, 8)), idx=idx)


def test_uninitialised_index_tile_is_rejected_in_strict_mode():
    def k(data):
        it = nl.ndarray((4, 1), nl.uint32, buffer=nl.sbuf)
        t = nl.ndarray((4, 8), data.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=data.ap(pattern=[[8, 4], [1, 8]], vector_offset=it, indirect_dim=0))
        return hbm_store(t)

    with pytest.raises(UninitializedReadError, match=r"dma_copy: argument 'src.vector_offset' reads 4 element"):
        simulate(k, data=randn(22, (10, 8)))


# ---------------------------------------------------------------------------------------------
# rejections: the access pattern and the view
# ---------------------------------------------------------------------------------------------

def _ap_error(case):
    def k(data, idx):
        it = sbuf_load(idx)
        sb = sbuf_load(data)
        pat = [[8, 4], [1, 8]]
        if case == "sbuf_indexed":
            sb.ap(pattern=pat, vector_offset=it, indirect_dim=0)
        elif case == "indirect_dim":
            data.ap(pattern=pat, vector_offset=it, indirect_dim=1)
        elif case == "idx_dtype":
            f = nl.ndarray((4, 1), nl.float32, buffer=nl.sbuf)
            nisa.memset(dst=f, value=0.0)
            data.ap(pattern=pat, vector_offset=f, indirect_dim=0)
        elif case == "idx_hbm":
            data.ap(pattern=pat, vector_offset=idx, indirect_dim=0)
        elif case == "idx_3d":
            t3 = nl.ndarray((4, 1, 1), nl.uint32, buffer=nl.sbuf)
            data.ap(pattern=pat, vector_offset=t3, indirect_dim=0)
        elif case == "both_offsets":
            data.ap(pattern=pat, scalar_offset=it, vector_offset=it, indirect_dim=0)
        elif case == "too_many_rows":
            data.ap(pattern=[[8, 5], [1, 8]], vector_offset=it, indirect_dim=0)
        elif case == "batch_not_128":
            i2 = nl.ndarray((4, 2), nl.uint32, buffer=nl.sbuf)
            data.ap(pattern=[[8, 8], [1, 8]], vector_offset=i2, indirect_dim=0)
        elif case == "no_free_pair":
            data.ap(pattern=[[8, 4]], vector_offset=it, indirect_dim=0)
        else:
            view = data.ap(pattern=pat, vector_offset=it, indirect_dim=0)
            if case == "re_ap":
                view.ap(pattern=pat)
            elif case == "slice":
                view[0:2, :]
            elif case == "reshape":
                view.reshape((4, 2, 4))
            elif case == "reinterpret":
                view.view(nl.int32)

    simulate(k, data=randn(23, (10, 8)), idx=np.zeros((4, 1), np.uint32))


@pytest.mark.parametrize("case,msg", [
    ("sbuf_indexed", r"tensor '.*'.ap: vector_offset indexes HBM tensors only; '.*' is in sbuf"),
    ("indirect_dim", "vector_offset supports indirect_dim=0 only, got indirect_dim=1"),
    ("idx_dtype", "must have dtype int32 or uint32, got float32"),
    ("idx_hbm", "must be a plain SBUF tile, got buffer private_hbm"),
    ("idx_3d", r"must be 2-D \[partitions, columns\], got shape \(4, 1, 1\)"),
    ("both_offsets", "scalar_offset and vector_offset are mutually exclusive"),
    ("too_many_rows", r"the pattern selects 5 rows but vector_offset '.*' \(4, 1\) holds 4 indices"),
    ("batch_not_128", "M=2 > 1 needs P == 128 partitions, got P=4"),
    ("no_free_pair", r"needs a row pair and >= 1 free \[step, num\] pair"),
    ("re_ap", r"tensor 'data'.ap: 'data' is an indirect \(vector_offset\) view"),
    ("slice", r"__getitem__: 'data' is an indirect \(vector_offset\) view"),
    ("reshape", r"reshape: 'data' is an indirect \(vector_offset\) view"),
    ("reinterpret", r"view: 'data' is an indirect \(vector_offset\) view"),
])
def test_indirect_access_pattern_rejections(case, msg):
    with pytest.raises(NkiValidationError, match=msg):
        _ap_error(case)


# ---------------------------------------------------------------------------------------------
# rejections: dma_copy with an indirect operand
# ---------------------------------------------------------------------------------------------

def _copy_error(case):
    def k(data, idx):
        it = sbuf_load(idx)
        view = data.ap(pattern=[[8, 4], [1, 8]], vector_offset=it, indirect_dim=0)
        t = nl.ndarray((4, 8), data.dtype, buffer=nl.sbuf)
        if case in ("hwdge", "none"):
            nisa.dma_copy(dst=t, src=view, dge_mode=getattr(nisa.dge_mode, case))
        elif case == "both_indirect":
            out = nl.ndarray((10, 8), data.dtype, buffer=nl.shared_hbm)
            nisa.dma_copy(dst=out.ap(pattern=[[8, 4], [1, 8]], vector_offset=it, indirect_dim=0), src=view)
        elif case == "fewer_rows_than_indices":
            i8 = nl.ndarray((8, 1), nl.uint32, buffer=nl.sbuf)
            nisa.memset(dst=i8, value=0)
            nisa.dma_copy(dst=t, src=data.ap(pattern=[[8, 4], [1, 8]], vector_offset=i8, indirect_dim=0))
        elif case in ("batch_on_dst", "batch_dtype", "batch_strided"):
            i2 = nl.ndarray((128, 2), nl.uint32, buffer=nl.sbuf)
            nisa.memset(dst=i2, value=0)
            big = nl.ndarray((128, 16), data.dtype, buffer=nl.sbuf)
            nisa.memset(dst=big, value=0.0)
            if case == "batch_on_dst":
                out = nl.ndarray((10, 8), data.dtype, buffer=nl.shared_hbm)
                nisa.dma_copy(dst=out.ap(pattern=[[8, 256], [1, 8]], vector_offset=i2, indirect_dim=0), src=big)
            elif case == "batch_dtype":
                big16 = nl.ndarray((128, 16), nl.bfloat16, buffer=nl.sbuf)
                nisa.dma_copy(dst=big16, src=data.ap(pattern=[[8, 256], [1, 8]], vector_offset=i2, indirect_dim=0))
            else:
                half = nl.ndarray((128, 8), data.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=half, src=data.ap(pattern=[[8, 256], [2, 4]], vector_offset=i2, indirect_dim=0))
        elif case == "rmw_op":
            nisa.dma_copy(dst=t, src=view, dst_rmw_op=nl.add)
        elif case == "unknown_kwarg":
            nisa.dma_copy(dst=t, src=view, bogus=1)

    simulate(k, data=randn(24, (10, 8)), idx=np.zeros((4, 1), np.uint32))


@pytest.mark.parametrize("case,msg", [
    ("hwdge", "nisa.dma_copy: an indirect .* needs dge_mode=swdge or unknown .*got dge_mode=hwdge"),
    ("none", "needs dge_mode=swdge or unknown .*got dge_mode=none"),
    ("both_indirect", "src and dst are both indirect"),
    ("fewer_rows_than_indices", r"'src' selects 4 rows but vector_offset '.*' \(8, 1\) holds 8 indices"),
    ("batch_on_dst", r"2-D vector_offset \[128, 2\] \(DMA batching\) is only supported on src"),
    ("batch_dtype", "DMA batching .* needs equal dtypes, got src float32 and dst bfloat16"),
    ("batch_strided", "DMA batching .* needs src rows and dst contiguous"),
    ("rmw_op", r"argument 'dst_rmw_op' was removed from dma_copy in NKI 0.3.0.*nisa.dma_compute"),
])
def test_indirect_dma_copy_rejections(case, msg):
    with pytest.raises(NkiValidationError, match=msg):
        _copy_error(case)


def test_dma_copy_unknown_keyword_is_a_type_error():
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        _copy_error("unknown_kwarg")


# ---------------------------------------------------------------------------------------------
# LNC2
# ---------------------------------------------------------------------------------------------

def _lnc2_scatter_kernel(overlap):
    def k(src, idx):
        pid = nl.program_id(0)
        half = idx.shape[0] // 2
        lo = 0 if overlap else pid * half  # overlap: both programs scatter the first half's rows
        it = nl.ndarray((half, 1), idx.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=it, src=idx[lo:lo + half, :])
        t = nl.ndarray((half, src.shape[1]), src.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=src[pid * half:(pid + 1) * half, :])
        out = nl.ndarray((32, src.shape[1]), src.dtype, buffer=nl.shared_hbm, name="routed")
        F = src.shape[1]
        nisa.dma_copy(dst=out.ap(pattern=[[F, half], [1, F]], vector_offset=it, indirect_dim=0), src=t)
        return out

    return k


def test_lnc2_programs_scatter_disjoint_rows_of_a_shared_output():
    src = randn(25, (32, 8))
    idx = rng(26).permutation(32).astype(np.uint32).reshape(32, 1)
    out = simulate(_lnc2_scatter_kernel(False), lnc=2, src=src, idx=idx)
    expect = np.empty_like(src)
    expect[idx[:, 0]] = src
    np.testing.assert_array_equal(out, expect)


def test_lnc2_programs_scattering_to_the_same_rows_race():
    src = randn(27, (32, 8))
    idx = rng(28).permutation(32).astype(np.uint32).reshape(32, 1)
    with pytest.raises(RaceError, match=r"dma_copy 'dst': program 1 writes shared_hbm tensor 'routed' bytes that "
                                        r"program 0 wrote"):
        simulate(_lnc2_scatter_kernel(True), lnc=2, src=src, idx=idx)


# ---------------------------------------------------------------------------------------------
# trace contract (cost model)
# ---------------------------------------------------------------------------------------------

def _trace_kernel(data, idx):
    it = sbuf_load(idx)
    t = nl.ndarray((idx.shape[0], 8), data.dtype, buffer=nl.sbuf)
    nisa.memset(dst=t, value=0.0)
    nisa.dma_copy(dst=t, src=data.ap(pattern=[[32, idx.shape[0]], [4, 8]], offset=1, vector_offset=it,
                                     indirect_dim=0), oob_mode=nisa.oob_mode.skip)
    return hbm_store(t)


def test_trace_attrs_of_an_indirect_gather():
    idx = np.array([[9], [2], [60], [5], [2], [7]], np.uint32)  # 60 is out of bounds (skipped)
    res = run_kernel(_trace_kernel, (randn(29, (20, 32)), idx), trace=True)
    rec = next(r for r in res.trace if r.instr == "dma_copy" and r.attrs.get("indirect"))
    assert rec.attrs["dge_mode"] == "swdge"
    assert rec.attrs["rows"] == 5
    assert rec.attrs["descriptors"] == 5 * 8  # a stride-4 row is 8 runs of one element
    assert rec.attrs["bytes"] == 5 * 8 * 4
    src = next(o for o in rec.reads if o.arg == "src")
    assert src.name == "data" and src.nbytes == 5 * 8 * 4
    # the dependency region spans rows 2..9 of the indexed tensor (32 fp32 per row, offset 1 element)
    assert (src.byte_lo, src.byte_hi) == ((2 * 32 + 1) * 4, (9 * 32 + 1 + 28) * 4 + 4)
    vo = next(o for o in rec.reads if o.arg == "vector_offset")
    assert vo.buffer == "sbuf" and vo.shape == (6, 1) and vo.dtype == "uint32"


def test_shape_only_run_records_every_index_as_a_row():
    from nkilib.simulator.launcher import ShapeSpec

    res = run_kernel(_trace_kernel, (ShapeSpec((20, 32), np.float32), ShapeSpec((6, 1), np.uint32)),
                     trace=True, numerics=False)
    rec = next(r for r in res.trace if r.instr == "dma_copy" and r.attrs.get("indirect"))
    assert (rec.attrs["rows"], rec.attrs["descriptors"], rec.attrs["bytes"]) == (6, 48, 6 * 8 * 4)
