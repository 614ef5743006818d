"""Engines of the MoE kernel's pass-A SwiGLU epilogue (docs/moe.md section 10, round 4).

Clamped on trn3, the clamps' tensor_scalar ops run on ScalarE and dh * uc on VectorE (GpSimd keeps dh * a
and the masks' products); without clamps, or on trn2 (whose ScalarE takes no min/max or comparison), the
round-2 engines. The engine never changes a bit: the outputs stay equal to mx_exact, with GPT-OSS's
clamped "gpt_oss" activation (gate clamped above, up on both sides, the +1 offset) included.
"""
from __future__ import annotations

import numpy as np
import pytest

from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8 import ClampLimits
from nkilib.examples.moe_backward_cost import PHASES
from nkilib.experimental.moe_mxfp8 import moe_bwd_mxfp8_kernel as kernel_module
from nkilib.experimental.moe_mxfp8.reference import moe_backward_reference
from nkilib.simulator.launcher import run_kernel
from nkilib.simulator.trace import label_phases
from simkit import assert_outputs_identical
from test_moe_bwd_kernel import CLAMPS, moe_case, routing

#: GPT-OSS's shape of clamps (limits scaled to the unit-scale test data so that both sides are crossed)
GPT_OSS_LIKE = ClampLimits(non_linear_upper=0.5, linear_lower=-0.5, linear_upper=0.5, activation="gpt_oss")


def _traced(kernel_kwargs, lnc=2):
    """(outputs, [(instr, engine, op0)] of the pass-A epilogue's elementwise records) of one simulator run."""
    with label_phases(kernel_module, PHASES):
        res = run_kernel(kernel_module.moe_backward_mxfp8_nki.fn, kwargs=kernel_kwargs, lnc=lnc, grid_ndim=1,
                         trace=True)
    ops = [(r.instr, r.engine, r.attrs.get("op0") or r.attrs.get("op")) for r in res.trace
           if r.instr in ("tensor_scalar", "tensor_tensor") and r.attrs.get("phase") == "A dI+epilogue"]
    return tuple(np.asarray(o) for o in res.outputs), ops


@pytest.mark.parametrize("clamp", [GPT_OSS_LIKE, CLAMPS], ids=["gpt_oss", "silu_clamped"])
def test_clamped_trn3_engines_and_bits(clamp):
    T, E, k, H, I = 48, 3, 2, 64, 96
    kernel, ref = moe_case(T, E, H, I, routing("random", T, E, k, seed=5), seed=23,
                           checkpoints=("gate_pre", "up"), clamp_limits=clamp)
    out, ops = _traced(kernel)
    assert_outputs_identical(out, moe_backward_reference(**ref), f"{clamp.activation} clamps vs mx_exact")
    clamp_ops = [(e, op) for instr, e, op in ops if instr == "tensor_scalar" and op in
                 ("minimum", "maximum", "less_equal", "greater_equal")]
    assert clamp_ops and all(e == "scalar" for e, _ in clamp_ops), clamp_ops
    products = {e for instr, e, op in ops if instr == "tensor_tensor" and op == "multiply"}
    assert {"vector", "gpsimd"} <= products, products


def test_unclamped_keeps_clamp_free_engines():
    T, E, k, H, I = 40, 3, 2, 64, 64
    kernel, ref = moe_case(T, E, H, I, routing("random", T, E, k, seed=6), seed=29, checkpoints=("gate_pre", "up"))
    out, ops = _traced(kernel)
    assert_outputs_identical(out, moe_backward_reference(**ref), "no clamps vs mx_exact")
    assert not [o for o in ops if o[0] == "tensor_scalar" and o[2] in ("minimum", "less_equal")]


def test_trn2_clamps_stay_off_scalar(set_target):
    """trn2's ScalarE refuses min/max/comparisons (the simulator raises): the kernel must keep them elsewhere."""
    set_target("trn2")
    T, E, k, H, I = 40, 3, 2, 64, 96
    kernel, ref = moe_case(T, E, H, I, routing("random", T, E, k, seed=9), seed=19, block_size=256,
                           checkpoints=("gate_pre", "up"), clamp_limits=GPT_OSS_LIKE, matmul_precision="bf16")
    out, ops = _traced(kernel)
    assert_outputs_identical(out, moe_backward_reference(**ref), "trn2 bf16 clamped vs mx_exact")
    assert all(e != "scalar" for instr, e, op in ops if instr == "tensor_scalar" and op in ("minimum", "maximum"))
