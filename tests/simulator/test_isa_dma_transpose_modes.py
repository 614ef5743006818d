"""dma_transpose: DGE modes and the 2.32 hwdge shape rules of a direct transpose, 1-byte dtypes, and the
indirect (gather) transpose through `src.ap(vector_offset=...)` (nki/isa/dma.py, dma_indirect.py).
Expected values: numpy indexing and transposes.
"""
import ml_dtypes
import numpy as np
import pytest

import nki.isa as nisa
import nki.language as nl
from simkit import BF16, bits, hbm_store, randn, rng, sbuf_load, simulate

from nkilib.simulator import run_kernel
from nkilib.simulator.errors import NkiValidationError, OutOfBoundsError

E4M3FN = ml_dtypes.float8_e4m3fn


def _direct_kernel(dge=nisa.dge_mode.unknown, from_sbuf=False):
    def k(a):
        src = sbuf_load(a) if from_sbuf else a
        t = nl.ndarray(a.shape[::-1] if a.ndim < 4 else (a.shape[3], a.shape[1], a.shape[2], a.shape[0]), a.dtype,
                       buffer=nl.sbuf)
        nisa.dma_transpose(dst=t, src=src, dge_mode=dge)
        return hbm_store(t)

    return k


@pytest.mark.parametrize("shape", [(16, 40), (4, 3, 5), (2, 3, 4, 6)])
def test_direct_transpose_of_fp8_bytes(shape):
    a = rng(0).integers(0, 256, shape).astype(np.uint8).view(E4M3FN)  # every byte pattern, NaNs included
    out = simulate(_direct_kernel(from_sbuf=len(shape) == 2), a=a)
    axes = {2: (1, 0), 3: (2, 1, 0), 4: (3, 1, 2, 0)}[len(shape)]
    np.testing.assert_array_equal(bits(out), bits(a).transpose(axes))


@pytest.mark.parametrize("shape", [(16, 128), (1, 16, 32), (2, 8, 128), (16, 1, 64), (4, 2, 4, 96)])
def test_hwdge_shapes_the_docs_allow(shape):
    a = randn(1, shape).astype(BF16)
    out = simulate(_direct_kernel(dge=nisa.dge_mode.hwdge), a=a)
    axes = {2: (1, 0), 3: (2, 1, 0), 4: (3, 1, 2, 0)}[len(shape)]
    np.testing.assert_array_equal(bits(out), bits(a).transpose(axes))


@pytest.mark.parametrize("shape,dge,msg", [
    ((16, 8), "swdge", "a direct .* transpose supports dge_mode unknown or hwdge only, got swdge"),
    ((16, 8), "none", "a direct .* transpose supports dge_mode unknown or hwdge only, got none"),
    ((3, 16, 8), "hwdge", r"hwdge 3-D transpose requires src.shape\[0\] in \{1, 2, 4, 8, 16\}, got 3"),
    ((2, 4, 8), "hwdge", r"\(src.shape\[0\] \* src.shape\[-2\]\) % 16 == 0, got 2 \* 4 = 8"),
    ((4, 1, 2, 8), "hwdge", r"hwdge 4-D transpose requires .* % 16 == 0, got 4 \* 2 = 8"),
])
def test_direct_transpose_mode_rejections(shape, dge, msg):
    with pytest.raises(NkiValidationError, match=msg):
        simulate(_direct_kernel(dge=getattr(nisa.dge_mode, dge)), a=randn(2, shape).astype(BF16))


def test_oob_skip_needs_an_indirect_src():
    def k(a):
        t = nl.ndarray((8, 16), a.dtype, buffer=nl.sbuf)
        nisa.dma_transpose(dst=t, src=a, oob_mode=nisa.oob_mode.skip)

    with pytest.raises(NkiValidationError, match="oob_mode=skip is only valid when src uses indirect indexing"):
        simulate(k, a=randn(3, (16, 8)).astype(BF16))


# ---------------------------------------------------------------------------------------------
# indirect (gather) transpose
# ---------------------------------------------------------------------------------------------

def _gather_t_kernel(rows, dge=nisa.dge_mode.unknown, oob=nisa.oob_mode.error):
    """dst[F, rows] = data[idx.T.flatten()[:rows], :].T with data [N, F]."""

    def k(data, idx):
        F = data.shape[1]
        it = sbuf_load(idx)
        t = nl.ndarray((F, rows), data.dtype, buffer=nl.sbuf)
        nisa.memset(dst=t, value=0.0)
        nisa.dma_transpose(dst=t, src=data.ap(pattern=[[F, rows], [1, F]], vector_offset=it, indirect_dim=0),
                           axes=(1, 0), dge_mode=dge, oob_mode=oob)
        return hbm_store(t)

    return k


@pytest.mark.parametrize("cols,rows", [(1, 128), (2, 256), (1, 64)])
def test_indirect_transpose_gathers_then_transposes(cols, rows):
    data = randn(4, (300, 96)).astype(BF16)
    idx = rng(5).integers(0, 300, (128, cols)).astype(np.uint32)
    out = simulate(_gather_t_kernel(rows), data=data, idx=idx)
    flat = idx.T.reshape(-1)[:rows]
    np.testing.assert_array_equal(bits(out), bits(data[flat]).T)


def test_indirect_transpose_4d():
    data = randn(6, (40, 3, 1, 16)).astype(BF16)  # [T, d1, d2, d3] with d2 == 1
    idx = rng(7).integers(0, 40, (128, 1)).astype(np.uint32)

    def k(data, idx):
        T, d1, d2, d3 = data.shape
        F = 128
        it = sbuf_load(idx)
        t = nl.ndarray((d3, d1, d2, F), data.dtype, buffer=nl.sbuf)
        src = data.ap(pattern=[[d1 * d2 * d3, F], [d2 * d3, d1], [d3, d2], [1, d3]], vector_offset=it, indirect_dim=0)
        nisa.dma_transpose(dst=t, src=src, axes=(3, 1, 2, 0), dge_mode=nisa.dge_mode.swdge)
        return hbm_store(t)

    out = simulate(k, data=data, idx=idx)
    np.testing.assert_array_equal(bits(out), bits(data[idx[:, 0]]).transpose(3, 1, 2, 0))


def test_indirect_transpose_oob_skip_leaves_columns_untouched_and_error_names_the_index():
    data = randn(8, (50, 32)).astype(BF16)
    idx = rng(9).integers(0, 50, (16, 1)).astype(np.uint32)
    idx[6, 0] = 50
    with pytest.raises(OutOfBoundsError,
                       match=r"dma_transpose: argument 'src': index 50 at vector_offset '.*'\[6, 0\]"):
        simulate(_gather_t_kernel(16), data=data, idx=idx)
    out = simulate(_gather_t_kernel(16, oob=nisa.oob_mode.skip), data=data, idx=idx)
    ok = idx[:, 0] < 50
    expect = np.zeros((32, 16), BF16)
    expect[:, ok] = data[idx[ok, 0]].T
    np.testing.assert_array_equal(bits(out), bits(expect))


def test_indirect_transpose_trace_attrs():
    idx = np.arange(16, dtype=np.uint32).reshape(16, 1)
    res = run_kernel(_gather_t_kernel(16), (randn(10, (20, 8)).astype(BF16), idx), trace=True)
    rec = next(r for r in res.trace if r.instr == "dma_transpose")
    assert {k: rec.attrs[k] for k in ("indirect", "dge_mode", "rows", "descriptors", "bytes", "transpose")} == \
        {"indirect": True, "dge_mode": "swdge", "rows": 16, "descriptors": 16, "bytes": 16 * 8 * 2, "transpose": True}


def _indirect_t_error(case):
    def k(data, idx):
        F = data.shape[1]
        it = sbuf_load(idx)
        rows = 8 if case == "rows_16" else 16
        if case in ("idx_rows", "idx_int32"):
            it = nl.ndarray((24 if case == "idx_rows" else 16, 1), nl.uint32 if case == "idx_rows" else nl.int32,
                            buffer=nl.sbuf)
            nisa.memset(dst=it, value=0)
        if case == "four_byte":  # the bf16 rows re-read as fp32 words
            src = data.ap(pattern=[[F // 2, rows], [1, F // 2]], vector_offset=it, indirect_dim=0, dtype=nl.float32)
        else:
            src = data.ap(pattern=[[F, rows], [1, F]], vector_offset=it, indirect_dim=0)
        t = nl.ndarray((src.shape[1], rows), src.dtype, buffer=nl.sbuf)
        dge = nisa.dge_mode.hwdge if case == "hwdge" else nisa.dge_mode.unknown
        nisa.dma_transpose(dst=t, src=src, dge_mode=dge)

    simulate(k, data=randn(11, (20, 8)).astype(BF16), idx=np.zeros((16, 1), np.uint32))


@pytest.mark.parametrize("case,msg", [
    ("hwdge", "needs dge_mode=swdge or unknown .*got dge_mode=hwdge"),
    ("four_byte", "indirect transpose needs a 2-byte src dtype, got float32"),
    ("rows_16", r"indirect transpose needs src.shape\[0\] divisible by 16, got 8"),
    ("idx_rows", r"indices.shape\[0\] in \[16, 128\] and divisible by 16, got indices '.*' shape \(24, 1\)"),
    ("idx_int32", "indirect transpose needs uint32 indices, got '.*' dtype int32"),
])
def test_indirect_transpose_rejections(case, msg):
    with pytest.raises(NkiValidationError, match=msg):
        _indirect_t_error(case)
