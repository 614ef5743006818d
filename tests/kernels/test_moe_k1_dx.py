"""The k = 1 dX path of the MoE kernel (docs/moe.md section 10, round 6c): with one routed pair per token every dX
row is written exactly once, so pass B scatters its bf16 rows with a plain indirect dma_copy instead of zeroing dX
and read-modify-writing it (dma_compute). The reference's dX is bf16(fp32(+0 + bf16(mm))): the kernel adds +0.0 to
the bf16 rows before the scatter so that a product that rounds to -0 in bf16 stores +0 as the add would.

| test                                  | what                                                           | fixed      |
|---------------------------------------|----------------------------------------------------------------|------------|
| test_k1_scatter_without_rmw           | no dma_compute, no dX zeroing for k = 1; k = 2 keeps both      | LNC1, LNC2 |
| test_k1_negative_zero_rows_bit_exact  | W_gu with subnormal negative entries: bf16(mm) = -0 elements   | LNC1, LNC2 |
| test_k1_trn2_bf16                     | trn2, BF16 matmuls                                             | LNC2       |
"""
from __future__ import annotations

import numpy as np
import pytest

from nkilib.experimental.moe_mxfp8 import moe_bwd_mxfp8_kernel as kernel_module
from nkilib.experimental.moe_mxfp8.reference import moe_backward_reference
from nkilib.simulator.launcher import run_kernel
from simkit import BF16, assert_outputs_identical
from test_moe_bwd_kernel import moe_case, routing

CHECKPOINTS = ("gate_pre", "gate_act", "up", "intermediate")


def _run(kernel_kwargs, lnc):
    res = run_kernel(kernel_module.moe_backward_mxfp8_nki.fn, kwargs=kernel_kwargs, lnc=lnc, grid_ndim=1, trace=True)
    return tuple(np.asarray(o) for o in res.outputs), res.trace


def _dx_writes(trace):
    """(dma_compute records on dX, plain dma_copy records writing dX) of a trace."""
    def on_dx(r):
        return any(getattr(o, "name", "") == "hidden_states_grad" for o in r.writes)
    rmw = [r for r in trace if r.instr == "dma_compute" and on_dx(r)]
    copies = [r for r in trace if r.instr == "dma_copy" and on_dx(r)]
    return rmw, copies


@pytest.mark.parametrize("lnc", [1, 2])
def test_k1_scatter_without_rmw(lnc):
    """k = 1 (T = 300 not a multiple of B, an empty expert): dX == mx_exact bit for bit with plain scatters only
    (one per 128-row chunk of each used block and core, all indirect: no zeroing store of dX); k = 2 keeps the
    zeroing and the read-modify-write."""
    T, E, H, I, B = 300, 4, 64, 64, 128
    ids = np.random.default_rng(5).choice([0, 1, 3], size=(T, 1)).astype(np.int32)  # expert 2 empty
    kernel, ref = moe_case(T, E, H, I, ids, seed=13, block_size=B, checkpoints=CHECKPOINTS)
    out, trace = _run(kernel, lnc)
    assert_outputs_identical(out, moe_backward_reference(**ref), f"k = 1, LNC{lnc} vs mx_exact")
    rmw, copies = _dx_writes(trace)
    used_blocks = int(kernel["expert_block_offsets"][-1])
    assert not rmw and copies and all(r.attrs.get("indirect") for r in copies), (len(rmw), len(copies))
    # B = 128: one scatter per used block on core 0 (H = 64 columns: core 0 holds all of them under LNC2)
    assert sum(1 for r in copies if r.program == 0) == used_blocks, (len(copies), used_blocks)
    ids2 = routing("random", 40, 3, 2, seed=2)
    kernel2, ref2 = moe_case(40, 3, H, I, ids2, seed=3, block_size=B)
    out2, trace2 = _run(kernel2, lnc)
    assert_outputs_identical(out2, moe_backward_reference(**ref2), f"k = 2, LNC{lnc} vs mx_exact")
    rmw2, copies2 = _dx_writes(trace2)
    assert rmw2 and copies2 and not any(r.attrs.get("indirect") for r in copies2), (len(rmw2), len(copies2))


@pytest.mark.parametrize("lnc", [1, 2])
def test_k1_negative_zero_rows_bit_exact(lnc):
    """W_gu of expert 0 holds one subnormal entry per column (-2^-133 or +2^-133, else 0), so dX_b's products are
    tiny and many of its fp32 sums round to -0 in bf16: the reference's dX there is +0 (+0 + -0), and the kernel
    must store +0, not the -0 of its bf16 row. The case is checked to contain such elements."""
    T, E, H, I = 96, 2, 64, 64
    ids = np.zeros((T, 1), np.int32)
    ids[::3] = 1
    kernel, ref = moe_case(T, E, H, I, ids, seed=17, checkpoints=CHECKPOINTS)
    r = np.random.default_rng(19)
    w = np.zeros((2 * I, H), np.float32)
    w[r.integers(0, 2 * I, size=H), np.arange(H)] = np.where(r.random(H) < 0.5, -1.0, 1.0) * 2.0 ** -133
    for d in (kernel, ref):
        d["gate_up_weight"] = d["gate_up_weight"].copy()
        d["gate_up_weight"][0] = w.astype(BF16)
    want = moe_backward_reference(**ref)
    dx_bits = want[0].view(np.uint16)
    assert (dx_bits == 0).sum() > 0 and not (dx_bits == 0x8000).any()  # +0 elements, never -0
    out, _ = _run(kernel, lnc)
    assert_outputs_identical(out, want, f"tiny W_gu, LNC{lnc} vs mx_exact")


def test_k1_trn2_bf16(set_target):
    """trn2 (BF16 matmuls, ScalarE's trn2 operator set): the k = 1 scatter path == mx_exact bit for bit under LNC2."""
    set_target("trn2")
    T, E, H, I = 70, 3, 64, 96
    ids = np.random.default_rng(23).integers(0, E, size=(T, 1)).astype(np.int32)
    kernel, ref = moe_case(T, E, H, I, ids, seed=29, block_size=256, checkpoints=("up",), matmul_precision="bf16")
    del kernel["matmul_precision"]  # the trn2 default
    out, trace = _run(kernel, 2)
    assert_outputs_identical(out, moe_backward_reference(**ref), "k = 1 trn2 bf16 vs mx_exact")
    rmw, copies = _dx_writes(trace)
    assert not rmw and copies, (len(rmw), len(copies))
