"""nkilib.core.matmul: K windows of a descriptor (TensorDescriptor.k_base / k_len) and panels whose K rows the
caller fetches (panel_from_row_loader; here by indirect-DMA gather, as the MoE kernel does), and the panel of an
on-chip row tile written span by span (RowPanelByColumns). Expected values: the NumPy contract matmul
nkilib.core.numerics.contract_mm of the selected / gathered rows."""
import numpy as np
import pytest

import nki
import nki.isa as nisa
import nki.language as nl
from nkilib.core.matmul import (MatmulSetup, PanelPlacement, PanelSlots, RowPanelByColumns, TensorDescriptor,
                                load_panel, panel_from_row_loader, panel_from_rows)
from nkilib.core.matmul import matmul_panels
from nkilib.core.matmul.constants import PARTITIONS
from nkilib.core.numerics import contract_mm
from nkilib.simulator.launcher import run_kernel
from simkit import BF16, assert_outputs_identical, in_kernel, matmul_panels_to_hbm, randn, simulate


@nki.jit
def _gathered_matmul_kernel(a, b, idx, precision, scheme):
    """out [M, N] = a[idx]ᵀ @ b[k_base: k_base + K] with a [R, M] rows gathered by idx [K] (an index >= R is a
    zero row) and b a K window of a stacked [2K, N] operand (k_base = K)."""
    R, M = a.shape
    K, N = idx.shape[0], b.shape[1]
    setup = MatmulSetup(precision, nl.float8_e4m3fn_x4, scheme, True)

    def load_rows(dst, first, step, count):
        ids = nl.ndarray((count, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=ids, src=idx.ap([[step, count], [1, 1]], offset=first))
        view = a.ap([[M, count], [1, M]], offset=0, vector_offset=ids, indirect_dim=0)
        nisa.dma_copy(dst=dst, src=view, oob_mode=nisa.oob_mode.skip)

    stationary = panel_from_row_loader(load_rows, K, M, M, setup, zero_fill=True)
    moving = load_panel(TensorDescriptor(b, k_axis=0, k_base=K, k_len=K), 0, N, N, setup)
    return matmul_panels_to_hbm(stationary, moving, setup, M, N)  # K=K, M=M, N=N


@pytest.mark.parametrize("precision, scheme", [("mxfp8", "1x32"), ("mxfp8", "wrapX"), ("bf16", "1x32")])
def test_gathered_rows_and_k_window(precision, scheme):
    R, M, K, N = 50, 64, 256, 96
    a, b = randn(1, (R, M), BF16), randn(2, (2 * K, N), BF16)
    idx = np.random.default_rng(3).integers(0, R + 10, K).astype(np.int32)  # some sentinels >= R
    got = simulate(_gathered_matmul_kernel, 1, a=a, b=b, idx=idx, precision=precision, scheme=scheme)
    rows = np.where((idx < R)[:, None], a[np.minimum(idx, R - 1)], np.zeros((), BF16)).astype(BF16)
    want = contract_mm(rows.T, b[K:], precision, "float8_e4m3fn", scheme)
    assert_outputs_identical((got,), (want,), f"{precision} {scheme}")


# load_panel(..., into=PanelSlots) (docs/moe.md section 10, round 19c): a whole panel loaded inside a run-time 0/1-trip
# loop into tiles allocated before it, and read after the loop (the MoE kernel's W_down of an expert that may be empty).
@nki.jit
def _slots_kernel(a, b, flag, precision, scheme, k_axis):
    """out [M, N] = aᵀ @ b (K=K, M=M, N=N) with b's panel loaded into PanelSlots in a fori_loop of `flag` trips and
    the matmul after it in another (b [K, N], or [N, K] with k_axis=1: the transposing path); out stays 0 without
    trips."""
    K, M = a.shape
    N = b.shape[1] if k_axis == 0 else b.shape[0]
    setup = MatmulSetup(precision, nl.float8_e4m3fn_x4, scheme, True)
    op = TensorDescriptor(b, k_axis=k_axis)
    stationary = load_panel(TensorDescriptor(a, k_axis=0), 0, M, M, setup)
    count = -(-K // (512 if setup.is_mx else PARTITIONS))
    slots = PanelSlots(count, N, setup, PanelPlacement.per_k_tile())
    trips = nisa.register_alloc()
    nisa.register_load(trips, flag[0:1, 0:1])
    nl.fori_loop(0, trips, lambda _: load_panel(op, 0, N, N, setup, into=slots))
    moving = slots.panel(K)
    res = nl.ndarray((PARTITIONS, N), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=res[:M, :], value=0.0)

    def product():
        acc = nl.ndarray((PARTITIONS, N), dtype=nl.float32, buffer=nl.psum)
        matmul_panels(acc[:M, :], stationary, moving, setup)  # K=K, M=M, N=N
        nisa.tensor_copy(dst=res[:M, :], src=acc[:M, :])

    trips2 = nisa.register_alloc()
    nisa.register_load(trips2, flag[0:1, 0:1])
    nl.fori_loop(0, trips2, lambda _: product())
    out = nl.ndarray((M, N), dtype=nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=res[:M, :])
    return out


@pytest.mark.parametrize("precision, scheme, k_axis", [("mxfp8", "1x32", 0), ("mxfp8", "wrapX", 0),
                                                       ("mxfp8", "1x32", 1), ("bf16", "1x32", 0)])
def test_panel_loaded_into_slots_in_a_loop(precision, scheme, k_axis):
    """One trip: the product equals the contract matmul (the slots hold what load_panel builds; K = 640: two MXFP8 K
    tiles, the second part-filled; five bf16 ones). No trip: b is never read and out stays 0."""
    K, M, N = 640, 64, 96
    a, b = randn(11, (K, M), BF16), randn(12, (K, N), BF16)
    b_in = b if k_axis == 0 else np.ascontiguousarray(b.T)
    kwargs = dict(a=a, b=b_in, precision=precision, scheme=scheme, k_axis=k_axis)
    got = simulate(_slots_kernel, 1, flag=np.ones((1, 1), np.int32), **kwargs)
    assert_outputs_identical((got,), (contract_mm(a.T, b, precision, "float8_e4m3fn", scheme),),
                             f"{precision} {scheme} k_axis={k_axis}")
    res = run_kernel(_slots_kernel.fn,
                     kwargs=dict(flag=np.zeros((1, 1), np.int32), **kwargs), lnc=1, grid_ndim=1, trace=True)
    assert not np.any(np.asarray(res.outputs[0]))
    assert not [r.instr for r in res.trace if any(getattr(t, "name", "") == "b" for t in r.reads)]


def test_slots_refuse_another_panel_shape():
    """A PanelSlots takes only the panel it was made for (K tiles and width)."""
    setup = MatmulSetup("mxfp8", nl.float8_e4m3fn_x4, "1x32", True)
    with pytest.raises(Exception, match="cannot take a panel"):
        in_kernel(lambda: PanelSlots(2, 96, setup).builder(3, 96))


# RowPanelByColumns (docs/moe.md section 10, round 17b): the panel of a row tile written I tile by I tile, as the
# MoE kernel's pass A writes d_gate_up (gate columns [0, I), up columns [I, 2I)); I = 1088 is not a multiple of
# 128, so K tile 2 straddles the gate / up boundary and completes with the last I tile, after K tile 3 (up only).
SPAN_I, SPAN_W = 1088, 128  # I and the epilogue's tile width (the kernel's 512 scaled down)
BUILD_ORDER = [0, 1, 3, 2, 4]  # K tiles of 512 over 2I = 2176 (the last one 128): the last write's (2, 4) last


def _gate_up_writes(I, width):
    """[[(lo, hi)] per write]: per I tile of the epilogue its gate columns and its up columns."""
    return [[(n0, n0 + min(width, I - n0)), (I + n0, I + n0 + min(width, I - n0))] for n0 in range(0, I, width)]


def _panel_by_columns_run(rows, b, by_columns):
    """(out, trace) of rows [M, K] (as the stationary panel, K=K, M=M) times b [K, N]: the panel built with
    RowPanelByColumns over _gate_up_writes (by_columns) or with panel_from_rows."""

    def kernel(rows, b):
        M, K = rows.shape
        N = b.shape[1]
        setup = MatmulSetup("mxfp8", nl.float8_e4m3fn_x4, "1x32", True)
        tile = nl.ndarray((PARTITIONS, K), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile[:M, :], src=rows)
        if by_columns:
            builder = RowPanelByColumns(tile[:M, :], M, K, M, setup)
            for spans in _gate_up_writes(K // 2, SPAN_W):
                builder.written(spans)
            builder.build_ready()
            stationary = builder.panel()
        else:
            stationary = panel_from_rows(tile[:M, :], M, K, M, setup)
        moving = load_panel(TensorDescriptor(b, k_axis=0), 0, N, N, setup)
        return matmul_panels_to_hbm(stationary, moving, setup, M, N)  # K=K, M=M, N=N

    res = run_kernel(kernel, args=(rows, b), trace=True)
    return np.asarray(res.outputs[0] if isinstance(res.outputs, tuple) else res.outputs), res.trace


def test_panel_by_columns_bits_and_build_order():
    M, K, N = 64, 2 * SPAN_I, 96
    rows, b = randn(11, (M, K), BF16), randn(12, (K, N), BF16)
    got, trace = _panel_by_columns_run(rows, b, by_columns=True)
    want, trace_k_order = _panel_by_columns_run(rows, b, by_columns=False)
    assert_outputs_identical((got,), (want,), "RowPanelByColumns vs panel_from_rows")
    assert_outputs_identical((got,), (contract_mm(rows, b, "mxfp8", "float8_e4m3fn", "1x32"),), "vs contract_mm")

    def k_tile_order(records):  # the quantize_mx of each K tile, by its words' offset (one [M] x4 row per K tile)
        return [r.writes[0].byte_lo // (M * 4) for r in records if r.instr == "quantize_mx"
                and r.writes[0].dtype != "uint8"][:5]

    assert k_tile_order(trace) == BUILD_ORDER
    assert k_tile_order(trace_k_order) == [0, 1, 2, 3, 4]
    assert len([r for r in trace if r.instr == "nc_transpose"]) == 4 * 5  # four per K tile, none repeated


def test_panel_by_columns_refuses_misuse():
    def body(twice):
        setup = MatmulSetup("mxfp8", nl.float8_e4m3fn_x4, "1x32", True)
        tile = nl.ndarray((PARTITIONS, 1024), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.memset(dst=tile, value=0.0)
        builder = RowPanelByColumns(tile[:64, :], 64, 1024, 64, setup)
        builder.written([(0, 600)])
        if twice:
            builder.written([(700, 800), (512, 701)])  # columns 512..600 and 700 again
        builder.build_ready()  # K tile 0 only: K tile 1 still misses columns
        return builder.panel()

    with pytest.raises(AssertionError, match="written twice"):
        in_kernel(lambda: body(True))
    with pytest.raises(AssertionError, match=r"K tiles not built: \[1\]"):
        in_kernel(lambda: body(False))
