"""Engine-queue choices of the MoE kernel's passes B and C (docs/moe.md section 10, round 7b).

Engines run their instructions in program order, so an instruction that waits for another engine holds back
everything queued behind it on its own engine. Pass B's dX PSUM evictions wait for pass B's matmuls; on VectorE
they held back the W_gu quantizes queued behind them (and through the staging ring the W_gu loads), so they run
on ScalarE only. Pass C's single-block path numbers its operand loads and takes the staging tiles in turn, so a
load waits for the quantize PASS_C_STAGING_BUFFERS loads back instead of the one just before it. Neither choice
changes a bit: outputs equal mx_exact, LNC1 and LNC2.

| test                                  | what                                                          | fixed      |
|---------------------------------------|---------------------------------------------------------------|------------|
| test_pass_b_evictions_on_scalar       | every PSUM read of pass B is a ScalarE instruction            | LNC1, LNC2 |
| test_single_block_loads_rotate_stages | consecutive single-block loads take different staging tiles   | LNC1, LNC2 |
"""
from __future__ import annotations

import numpy as np
import pytest

from nkilib.examples.moe_backward_cost import PHASES
from nkilib.experimental.moe_mxfp8 import moe_bwd_mxfp8_kernel as kernel_module
from nkilib.experimental.moe_mxfp8.constants import PASS_C_STAGING_BUFFERS
from nkilib.experimental.moe_mxfp8.reference import moe_backward_reference
from nkilib.simulator.launcher import run_kernel
from nkilib.simulator.trace import label_phases
from moekit import expert_routing
from simkit import assert_outputs_identical
from test_moe_bwd_kernel import moe_case

SCRATCH = ("moe_bwd_d_gate_up", "moe_bwd_x_blocks", "moe_bwd_dy_blocks", "moe_bwd_weighted_inter")


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


@pytest.mark.parametrize("lnc", [1, 2])
def test_single_block_loads_rotate_stages(lnc):
    """Single-block experts (k = 1, B = 128; expert 2 empty), 2I = 2176 and H = 1152: per gradient and core the
    moving operand and the stationary one come in SINGLE_BLOCK_LOAD_WIDTH pieces (dW_gu: 2176 stationary columns in
    three pieces), so a gradient has at least three loads. Every load (one DMA per slot of the MX layout into its
    staging tile) takes another tile than the load before it, across the expert's two gradients too, and all
    PASS_C_STAGING_BUFFERS tiles are used (before: every load on the first tile)."""
    T, E, H, I = 230, 4, 1152, 1088
    ids = expert_routing([120, 70, 40], experts=[0, 1, 3], shuffle_seed=14)
    kernel, ref = moe_case(T, E, H, I, ids, seed=53, checkpoints=("gate_pre", "gate_act", "up", "intermediate"))
    assert np.diff(kernel["expert_block_offsets"]).tolist() == [1, 1, 0, 1]
    trace = _traced(kernel, ref, lnc, "single-block pass C")
    stages = [rec.writes[0].storage_id for rec in trace if rec.program == 0 and rec.attrs.get("phase") == "C dW"
              and rec.instr == "dma_copy" and any(o.name in SCRATCH for o in rec.reads)]
    lengths = [1]  # DMAs per run of one tile
    for n in range(1, len(stages)):
        lengths = lengths + [1] if stages[n] != stages[n - 1] else lengths[:-1] + [lengths[-1] + 1]
    assert len(set(stages)) == PASS_C_STAGING_BUFFERS, sorted(set(stages))
    # every run of one tile is one load (the same number of DMAs each: one per slot of the MX layout), so no two
    # consecutive loads share a tile, also where an expert's dW_down follows its dW_gu; per used expert and core at
    # least 7 loads (LNC2: dW_gu 1 moving + 3 stationary pieces, dW_down 2 + 1; LNC1 more)
    assert len(set(lengths)) == 1 and len(lengths) >= 3 * 7, lengths
