"""nisa.dma_compute: fp32 sum of sources in the DMA engines, scatter-add / gather-add read-modify-write
through a vector_offset, its rejections and trace attrs (nki/isa/dma_compute.py). Expected values:
numpy (np.add.at for the accumulations).
"""
import numpy as np
import pytest

import nki.isa as nisa
import nki.language as nl
from simkit import BF16, bits, hbm_store, randn, rng, sbuf_load, simulate

from nkilib.simulator import run_kernel
from nkilib.simulator.errors import IndirectHazardError, NkiValidationError, OutOfBoundsError


def test_sum_of_sources_in_fp32_cast_once_to_dst():
    def k(a, b, c):
        out = nl.ndarray(a.shape, nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_compute(dst=out, srcs=[sbuf_load(a), b, sbuf_load(c)], reduce_op=nl.add, scales=[1.0, 1.0, 1])
        return hbm_store(out)

    a, b, c = randn(0, (16, 24)), randn(1, (16, 24)).astype(BF16), randn(2, (16, 24), scale=1e-3)
    expect = ((a + b.astype(np.float32)) + c).astype(BF16)  # left fold in fp32, one RNE cast
    np.testing.assert_array_equal(bits(simulate(k, a=a, b=b, c=c)), bits(expect))


def _scatter_add_kernel(oob=nisa.oob_mode.error, order=(0, 1)):
    """out = base; out[idx[p]] += src[p] through dma_compute's scatter RMW."""

    def k(src, idx, base):
        P, F = src.shape
        it, t = sbuf_load(idx), sbuf_load(src)
        out = nl.ndarray(base.shape, base.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=base)
        view = out.ap(pattern=[[F, P], [1, F]], vector_offset=it, indirect_dim=0)
        pair = [view, t]
        nisa.dma_compute(dst=view, srcs=[pair[i] for i in order], reduce_op=nl.add, oob_mode=oob)
        return out

    return k


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_scatter_add_unique_indices(order):
    base, src = randn(3, (64, 16)), randn(4, (48, 16))
    idx = rng(5).permutation(64)[:48].astype(np.uint32).reshape(48, 1)
    out = simulate(_scatter_add_kernel(order=order), src=src, idx=idx, base=base)
    expect = base.copy()
    np.add.at(expect, idx[:, 0], src)
    np.testing.assert_array_equal(out, expect)


def test_scatter_add_bf16_accumulates_in_fp32():
    base, src = randn(6, (20, 8)).astype(BF16), randn(7, (20, 8), scale=1e-2).astype(BF16)
    idx = rng(8).permutation(20).astype(np.int32).reshape(20, 1)
    out = simulate(_scatter_add_kernel(), src=src, idx=idx, base=base)
    expect = base.astype(np.float32)
    np.add.at(expect, idx[:, 0], src.astype(np.float32))
    np.testing.assert_array_equal(bits(out), bits(expect.astype(BF16)))


def test_scatter_add_duplicate_indices_are_rejected_not_last_writer_wins():
    idx = np.array([[4], [1], [4], [0]], np.uint32)
    with pytest.raises(IndirectHazardError, match=r"nisa.dma_compute: argument 'dst': rows 0 and 2 .*index 4 at "
                                                  r"vector_offset '.*'\[0, 0\] and index 4 at '.*'\[2, 0\].*requires "
                                                  r"unique indices"):
        simulate(_scatter_add_kernel(), src=randn(9, (4, 8)), idx=idx, base=randn(10, (6, 8)))


def test_scatter_add_oob_error_and_skip():
    base, src = randn(11, (10, 4)), randn(12, (6, 4))
    idx = np.array([[0], [9], [10], [3], [77], [5]], np.uint32)
    with pytest.raises(OutOfBoundsError, match=r"dma_compute: argument 'dst': index 10 at vector_offset '.*'\[2, 0\]"):
        simulate(_scatter_add_kernel(), src=src, idx=idx, base=base)
    out = simulate(_scatter_add_kernel(oob=nisa.oob_mode.skip), src=src, idx=idx, base=base)
    ok = idx[:, 0] < 10
    expect = base.copy()
    np.add.at(expect, idx[ok, 0], src[ok])
    np.testing.assert_array_equal(out, expect)


def _gather_add_kernel(oob=nisa.oob_mode.error):
    """acc[p] += data[idx[p]] through dma_compute's gather RMW into SBUF."""

    def k(data, idx, acc):
        P, F = acc.shape
        it, a = sbuf_load(idx), sbuf_load(acc)
        view = data.ap(pattern=[[F, P], [1, F]], vector_offset=it, indirect_dim=0)
        nisa.dma_compute(dst=a, srcs=[a, view], reduce_op=nl.add, oob_mode=oob)
        return hbm_store(a)

    return k


def test_gather_add_accepts_repeated_source_rows_and_skips_oob():
    data, acc = randn(13, (30, 12)), randn(14, (40, 12))
    idx = rng(15).integers(0, 30, (40, 1)).astype(np.uint32)  # repeats: each partition reads its own row
    np.testing.assert_array_equal(simulate(_gather_add_kernel(), data=data, idx=idx, acc=acc), acc + data[idx[:, 0]])
    idx[[1, 7], 0] = 30
    out = simulate(_gather_add_kernel(oob=nisa.oob_mode.skip), data=data, idx=idx, acc=acc)
    ok = idx[:, 0] < 30
    expect = acc.copy()
    expect[ok] += data[idx[ok, 0]]
    np.testing.assert_array_equal(out, expect)


def test_lnc2_scatter_add_into_disjoint_rows():
    def k(src, idx, base):
        pid = nl.program_id(0)
        half, F = src.shape[0] // 2, src.shape[1]
        it = nl.ndarray((half, 1), idx.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=it, src=idx[pid * half:(pid + 1) * half, :])
        t = nl.ndarray((half, F), src.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=src[pid * half:(pid + 1) * half, :])
        out = nl.ndarray(base.shape, base.dtype, buffer=nl.shared_hbm, name="grad")
        nisa.dma_copy(dst=out[pid * 16:(pid + 1) * 16, :], src=base[pid * 16:(pid + 1) * 16, :])
        nisa.core_barrier(out, (0, 1))
        view = out.ap(pattern=[[F, half], [1, F]], vector_offset=it, indirect_dim=0)
        nisa.dma_compute(dst=view, srcs=[view, t], reduce_op=nl.add)
        return out

    base, src = randn(16, (32, 8)), randn(17, (24, 8))
    idx = rng(18).permutation(32)[:24].astype(np.uint32).reshape(24, 1)
    out = simulate(k, lnc=2, src=src, idx=idx, base=base)
    expect = base.copy()
    np.add.at(expect, idx[:, 0], src)
    np.testing.assert_array_equal(out, expect)


def test_trace_attrs_of_scatter_add_and_plain_sum():
    idx = np.array([[2], [0], [5]], np.uint32)
    res = run_kernel(_scatter_add_kernel(), (randn(19, (3, 8)), idx, randn(20, (6, 8))), trace=True)
    rec = next(r for r in res.trace if r.instr == "dma_compute")
    assert rec.engine == "dma"
    assert {k: rec.attrs[k] for k in ("rmw", "indirect", "dge_mode", "rows", "descriptors", "bytes", "srcs")} == \
        {"rmw": True, "indirect": True, "dge_mode": "swdge", "rows": 3, "descriptors": 3, "bytes": 3 * 8 * 4, "srcs": 2}
    assert sorted(o.arg for o in rec.reads) == ["srcs[0]", "srcs[1]", "vector_offset"]
    assert rec.writes[0].arg == "dst" and rec.writes[0].nbytes == 3 * 8 * 4

    def plain(a):
        t = sbuf_load(a)
        u = sbuf_load(a)
        nisa.dma_compute(dst=t, srcs=[t, u], reduce_op=nl.add)
        nisa.dma_compute(dst=u, srcs=[t, t], reduce_op=nl.add)
        return hbm_store(u)

    res = run_kernel(plain, (randn(21, (4, 8)),), trace=True)
    recs = [r for r in res.trace if r.instr == "dma_compute"]
    assert [r.attrs["rmw"] for r in recs] == [True, False]
    assert all(r.attrs["dge_mode"] == "none" and "indirect" not in r.attrs for r in recs)
    np.testing.assert_array_equal(res.outputs, 4 * randn(21, (4, 8)))


def _error(case):
    def k(data, idx):
        it = sbuf_load(idx)
        t = sbuf_load(data[0:4, :])
        view = data.ap(pattern=[[8, 4], [1, 8]], vector_offset=it, indirect_dim=0)
        out = nl.ndarray((10, 8), data.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=data)
        oview = out.ap(pattern=[[8, 4], [1, 8]], vector_offset=it, indirect_dim=0)
        if case == "multiply":
            nisa.dma_compute(dst=t, srcs=[t, t], reduce_op=nl.multiply)
        elif case == "scale":
            nisa.dma_compute(dst=t, srcs=[t, t], reduce_op=nl.add, scales=[1.0, 2.0])
        elif case == "too_many":
            nisa.dma_compute(dst=t, srcs=[t] * 17, reduce_op=nl.add)
        elif case == "not_list":
            nisa.dma_compute(dst=t, srcs=t, reduce_op=nl.add)
        elif case == "count":
            nisa.dma_compute(dst=t, srcs=[t, t[:, 0:4]], reduce_op=nl.add)
        elif case == "x4":
            w = nl.ndarray((4, 8), nl.float8_e4m3fn_x4, buffer=nl.sbuf)
            nisa.dma_compute(dst=t, srcs=[t, w], reduce_op=nl.add)
        elif case == "psum":
            p = nl.ndarray((4, 8), nl.float32, buffer=nl.psum)
            nisa.dma_compute(dst=p, srcs=[t, t], reduce_op=nl.add)
        elif case == "oob_raw":
            nisa.dma_compute(dst=t, srcs=[t, t], reduce_op=nl.add, oob_mode=1)
        elif case == "non_unique":
            nisa.dma_compute(dst=oview, srcs=[oview, t], reduce_op=nl.add, unique_indices=False)
        elif case == "three_sources":
            nisa.dma_compute(dst=oview, srcs=[oview, t, t], reduce_op=nl.add)
        elif case == "scatter_other_hbm":
            nisa.dma_compute(dst=oview, srcs=[oview, data[0:4, :]], reduce_op=nl.add)
        elif case == "scatter_no_match":
            nisa.dma_compute(dst=oview, srcs=[view, t], reduce_op=nl.add)
        elif case == "gather_not_dst":
            u = sbuf_load(data[0:4, :])
            nisa.dma_compute(dst=t, srcs=[u, view], reduce_op=nl.add)
        elif case == "gather_dst_hbm":
            nisa.dma_compute(dst=out[0:4, :], srcs=[out[0:4, :], view], reduce_op=nl.add)

    simulate(k, data=randn(22, (10, 8)), idx=np.array([[1], [3], [5], [7]], np.uint32))


@pytest.mark.parametrize("case,msg", [
    ("multiply", "nisa.dma_compute: reduce_op must be nl.add .*got nl.multiply"),
    ("scale", r"scales\[1\] must be 1.0 .*got 2.0"),
    ("too_many", "srcs must be a list of 1..16 tensors"),
    ("not_list", "srcs must be a list of 1..16 tensors"),
    ("count", r"element counts differ: dst \(4, 8\) has 32, srcs\[1\] \(4, 4\) has 16"),
    ("x4", r"argument 'srcs\[1\]' .* has packed/scale dtype float8_e4m3fn_x4"),
    ("psum", "argument 'dst' .* is in PSUM"),
    ("oob_raw", "oob_mode must be an nisa.oob_mode member, got 1"),
    ("non_unique", "unique_indices=False is not supported"),
    ("three_sources", "takes exactly 2 sources, got 3"),
    ("scatter_other_hbm", "an indirect dst needs one source that is the same vector_offset view and one SBUF tile"),
    ("scatter_no_match", "an indirect dst needs one source that is the same vector_offset view"),
    ("gather_not_dst", "gather RMW needs the non-indirect source to be dst itself"),
    ("gather_dst_hbm", "gather RMW needs dst in SBUF, got shared_hbm"),
])
def test_dma_compute_rejections(case, msg):
    with pytest.raises(NkiValidationError, match=msg):
        _error(case)


def test_shape_only_run_of_scatter_add_gather_add_and_gather_transpose():
    """The cost model runs kernels without numerics: index values are unknown, every index counts as a row."""
    from nkilib.simulator.launcher import ShapeSpec

    def k(data, idx, src):
        it, t = sbuf_load(idx), sbuf_load(src)
        out = nl.ndarray(data.shape, data.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=data)
        view = out.ap(pattern=[[32, 64], [1, 32]], vector_offset=it, indirect_dim=0)
        nisa.dma_compute(dst=view, srcs=[view, t], reduce_op=nl.add)
        nisa.dma_compute(dst=t, srcs=[t, data.ap(pattern=[[32, 64], [1, 32]], vector_offset=it, indirect_dim=0)],
                         reduce_op=nl.add)
        tt = nl.ndarray((32, 64), data.dtype, buffer=nl.sbuf)
        nisa.dma_transpose(dst=tt, src=out.ap(pattern=[[32, 64], [1, 32]], vector_offset=it, indirect_dim=0))
        nisa.dma_copy(dst=out[0:64, :], src=t)
        return out

    specs = (ShapeSpec((100, 32), nl.bfloat16), ShapeSpec((64, 1), np.uint32), ShapeSpec((64, 32), nl.bfloat16))
    res = run_kernel(k, specs, trace=True, numerics=False)
    recs = [r for r in res.trace if r.attrs.get("indirect")]
    assert [r.instr for r in recs] == ["dma_compute", "dma_compute", "dma_transpose"]
    assert all(r.attrs["rows"] == 64 and r.attrs["bytes"] == 64 * 32 * 2 for r in recs)
    # unknown rows: the dependency region of the indirect operand is the whole indexed tensor
    dst = recs[0].writes[0]
    assert (dst.byte_lo, dst.byte_hi, dst.nbytes) == (0, 100 * 32 * 2, 64 * 32 * 2)
