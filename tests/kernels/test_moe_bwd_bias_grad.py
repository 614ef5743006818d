"""The MoE kernel's optional gate_up bias gradient (gate_up_bias_grad=True, GPT-OSS) on the simulator.

Expected values: reference.moe_backward_reference(gate_up_bias_grad=True), mode "mx_exact" bit for bit
(reference_bias_grad_fold: per expert, 128-row tiles of its blocks summed and rounded to fp32 once each,
accumulated in fp32 from +0), mode "fp32" loosely (the error reported). The other four outputs must keep
their bits. LNC2 runs have the simulator's race detector and divergent-trip-count check on.

| test                              | routing / varied                                          | fixed          |
|-----------------------------------|-----------------------------------------------------------|----------------|
| test_bias_grad_bit_exact          | empty experts, a 2-block expert, single-block experts;    | B=128, e4m3fn  |
|                                   | LNC1 and LNC2 (2I = 320: both cores hold columns)         |                |
| test_bias_grad_groups_and_b256    | B = 256 (2 row tiles per block), 2I = 1088 in 1-tile PSUM | LNC1 and LNC2  |
|                                   | groups (core 1 runs an empty group), 3-block expert       |                |
| test_bias_grad_trn2_bf16          | trn2, matmul_precision bf16                               | LNC2           |
| test_bias_grad_flag_must_be_bool  | gate_up_bias_grad=1                                       | -              |
"""
from __future__ import annotations

import numpy as np
import pytest

from nkilib.experimental.moe_mxfp8.moe_bwd_mxfp8_kernel import moe_backward_mxfp8_nki
from nkilib.experimental.moe_mxfp8.reference import error_report, moe_backward_reference
from moekit import expert_routing
from simkit import assert_outputs_identical, simulate
from test_moe_bwd_kernel import moe_case, run

# Kernel bias gradient against the fp32 reference's, measured in test_bias_grad_bit_exact (printed with -s):
# rel_fro 0.034 and 1 - cosine 5.8e-4 (LNC1 and LNC2 alike: the MXFP8 dI = dY W_down dominates, as for
# the other outputs); the bounds are ~1.5x.
BIAS_REL_FRO_BOUND = 0.05
BIAS_ONE_MINUS_COS_BOUND = 1e-3


def _check(kernel, ref, lnc, what):
    out = run(dict(kernel, gate_up_bias_grad=True), lnc)
    want = moe_backward_reference(**ref, gate_up_bias_grad=True)
    assert len(out) == 5 and out[4].dtype == np.float32 and out[4].shape == want[4].shape
    assert_outputs_identical(out, want, what)
    return out


@pytest.mark.parametrize("lnc", [1, 2])
def test_bias_grad_bit_exact(lnc):
    counts = [200, 0, 90, 0, 1]  # expert 0: two blocks; 2 and 4: one block; 1 and 3: no tokens
    T, E, H, I = sum(counts), len(counts), 64, 160
    kernel, ref = moe_case(T, E, H, I, expert_routing(counts, shuffle_seed=3), seed=5, checkpoints=("gate_pre", "up"))
    assert np.diff(kernel["expert_block_offsets"]).tolist() == [2, 0, 1, 0, 1]
    out = _check(kernel, ref, lnc, f"LNC{lnc} vs mx_exact")
    bias = out[4]
    for e in (1, 3):  # empty experts: +0 exactly (not -0, not stale bytes)
        assert not bias[e].view(np.uint32).any()
    assert np.count_nonzero(bias[0]) > 0.9 * bias.shape[1]
    ideal = moe_backward_reference(**ref, gate_up_bias_grad=True, mode="fp32")[4]
    rep = error_report(bias, ideal)
    print(f"bias grad LNC{lnc} vs fp32: rel_fro {rep['rel_fro']:.2e}, 1 - cos {1 - rep['cosine']:.2e}")
    assert rep["rel_fro"] < BIAS_REL_FRO_BOUND and 1 - rep["cosine"] < BIAS_ONE_MINUS_COS_BOUND, rep
    # the other outputs do not depend on the flag
    assert_outputs_identical(out[:4], run(kernel, lnc), "without the flag")


@pytest.mark.parametrize("lnc", [1, 2])
def test_bias_grad_groups_and_b256(lnc, monkeypatch):
    from nkilib.experimental.moe_mxfp8 import moe_bwd_mxfp8_bias_grad as BG
    from nkilib.experimental.moe_mxfp8 import moe_bwd_mxfp8_weight_grads as W

    monkeypatch.setattr(W, "WEIGHT_GRAD_PSUM_TILES", 1)
    monkeypatch.setattr(BG, "WEIGHT_GRAD_PSUM_TILES", 1)
    counts = [600, 0, 40]  # expert 0: three blocks of 256 (two 128-row tiles each), expert 1 empty
    T, E, H, I = sum(counts), len(counts), 64, 544
    kernel, ref = moe_case(T, E, H, I, expert_routing(counts, shuffle_seed=8), seed=9, block_size=256,
                           checkpoints=("gate_pre", "up"))
    assert np.diff(kernel["expert_block_offsets"]).tolist() == [3, 0, 1]
    out = _check(kernel, ref, lnc, f"B=256 LNC{lnc} vs mx_exact")
    assert not out[4][1].view(np.uint32).any()


def test_bias_grad_trn2_bf16(set_target):
    set_target("trn2")
    counts = [150, 30, 0]
    T, E, H, I = sum(counts), len(counts), 64, 96
    kernel, ref = moe_case(T, E, H, I, expert_routing(counts, shuffle_seed=2), seed=4, checkpoints=("up",),
                           matmul_precision="bf16")
    _check(kernel, ref, 2, "trn2 bf16 vs mx_exact")


def test_bias_grad_flag_must_be_bool():
    kernel, _ = moe_case(8, 2, 64, 64, expert_routing([5, 3], shuffle_seed=1), seed=1)
    with pytest.raises(AssertionError, match="gate_up_bias_grad must be a bool, got 1"):
        simulate(moe_backward_mxfp8_nki, 1, gate_up_bias_grad=1, **kernel)
