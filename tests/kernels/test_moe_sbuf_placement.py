"""SBUF placement of the MoE kernel under the cost model's next-fit allocator (docs/cost-model.md, "Allocator";
docs/moe.md section 10, round 6a): no MoE tile needs one wide contiguous gap, so a layout whose small tiles fragment
SBUF still has a plan.

| test                                        | what                                                              |
|---------------------------------------------|-------------------------------------------------------------------|
| test_fragmenting_layout_has_a_plan          | a layout whose one-allocation pass-C slots (32 KiB) found no gap  |
|                                             | in a 94 KiB SBUF: plan_errors empty, and LNC2 == mx_exact         |
"""
from __future__ import annotations

import dataclasses

import numpy as np

from nkilib.examples.moe_backward_cost import _kernel_inputs
from nkilib.experimental.moe_mxfp8 import moe_bwd_mxfp8_dx as D
from nkilib.experimental.moe_mxfp8.moe_bwd_mxfp8_kernel import moe_backward_mxfp8_nki
from nkilib.experimental.moe_mxfp8.reference import moe_backward_reference
from nkilib.experimental.moe_mxfp8.routing import build_block_layout
from nkilib.simulator.cost import model_kernel
from nkilib.simulator.hardware import resolve_target
from moekit import expert_routing
from simkit import assert_outputs_identical
from test_moe_bwd_kernel import moe_case, run

# Found by a sweep of SBUF sizes (91-100 KiB, where the plan's program-order peak, 90.5 KiB, fits) with the kernel
# before round 6a: at 94 KiB its pass C placed an expert's resident slots as one [128, 8, 1024] x4 tile (32 KiB per
# partition) and the allocator found no 32 KiB gap (UnplaceableTile on core 0); with one tile per slot it has a plan.
# The weights are loaded per block (resident budget 0), as DeepSeek-V3's W_down is at full size.
SHAPE = dict(H=1152, I=544, B=256)
COUNTS = (600, 100, 300, 50)  # routed pairs of experts 0..3 (k = 1): 3, 1, 2 and 1 blocks of 256
SBUF_KIB = 94


def test_fragmenting_layout_has_a_plan(monkeypatch):
    monkeypatch.setattr(D, "RESIDENT_WEIGHT_BUDGET_BYTES", 0)
    H, I, B = SHAPE["H"], SHAPE["I"], SHAPE["B"]
    ids, E = expert_routing(COUNTS, shuffle_seed=12), len(COUNTS)
    kernel, ref = moe_case(len(ids), E, H, I, ids, seed=41, block_size=B,
                           checkpoints=("gate_pre", "gate_act", "up", "intermediate"))
    assert np.diff(kernel["expert_block_offsets"]).tolist() == [3, 1, 2, 1]
    small = dataclasses.replace(resolve_target("trn3"), sbuf_bytes_per_partition=SBUF_KIB * 1024)
    inputs = _kernel_inputs(len(ids), 1, E, H, I, build_block_layout(ids, E, B))  # shape-only data, real layout
    report = model_kernel(moe_backward_mxfp8_nki, inputs, lnc=2, target=small, precision="mx", check_races=False,
                          kwargs={"block_size": B, "matmul_precision": "mxfp8", "run_with_lnc2": True})
    assert report.plan_errors == []
    assert max(p["sbuf"] for p in report.memory_peak) <= SBUF_KIB * 1024  # the test's premise: the live bytes fit
    assert_outputs_identical(run(kernel, lnc=2), moe_backward_reference(**ref), "fragmenting layout vs mx_exact")
