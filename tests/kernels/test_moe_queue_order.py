"""Engine-queue choices of the MoE kernel's passes B and C (docs/moe.md section 10, round 7b).

Engines run their instructions in program order, so an instruction that waits for another engine holds back
everything queued behind it on its own engine. Pass B's dX PSUM evictions wait for pass B's matmuls; on VectorE
they held back the W_gu quantizes queued behind them (and through the staging ring the W_gu loads), so they run
on ScalarE only. The choice changes no bit: outputs equal mx_exact, LNC1 and LNC2.

| test                                  | what                                                          | fixed      |
|---------------------------------------|---------------------------------------------------------------|------------|
| test_pass_b_evictions_on_scalar       | every PSUM read of pass B is a ScalarE instruction            | LNC1, LNC2 |
"""
from __future__ import annotations

import numpy as np
import pytest

from nkilib.examples.moe_backward_cost import PHASES
from nkilib.experimental.moe_mxfp8 import moe_bwd_mxfp8_kernel as kernel_module
from nkilib.experimental.moe_mxfp8.reference import moe_backward_reference
from nkilib.simulator.launcher import run_kernel
from nkilib.simulator.trace import label_phases
from simkit import assert_outputs_identical
from test_moe_bwd_kernel import moe_case


def _traced(kernel, ref, lnc, what):
    with label_phases(kernel_module, PHASES):
        res = run_kernel(kernel_module.moe_backward_mxfp8_nki.fn, kwargs=kernel, lnc=lnc, grid_ndim=1, trace=True)
    assert_outputs_identical(tuple(np.asarray(o) for o in res.outputs), moe_backward_reference(**ref),
                             f"LNC{lnc} {what} vs mx_exact")
    return res.trace


@pytest.mark.parametrize("lnc", [1, 2])
def test_pass_b_evictions_on_scalar(lnc):
    """k = 2 (the read-modify-write scatter-add), three experts of one or two blocks, B = 128: pass B's dX tiles
    leave PSUM on ScalarE only (before: ScalarE and VectorE in turn)."""
    T, E, k, H, I = 160, 3, 2, 640, 96
    r = np.random.default_rng(71)
    ids = np.stack([r.permutation(E)[:k] for _ in range(T)]).astype(np.int32)
    kernel, ref = moe_case(T, E, H, I, ids, seed=43, checkpoints=("gate_pre", "up"))
    trace = _traced(kernel, ref, lnc, "pass B evictions")
    in_b = [rec for rec in trace if rec.attrs.get("phase") == "B dX"
            and any(o.buffer == "psum" for o in rec.reads) and rec.engine != "tensor"]
    assert in_b, "pass B read no PSUM tile"
    assert {rec.engine for rec in in_b} == {"scalar"}, sorted({(rec.instr, rec.engine) for rec in in_b})
