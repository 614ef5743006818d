"""Pass B in pieces between pass A's chunks (docs/moe.md section 10, round 8a; moe_bwd_mxfp8_interleave.py): in a fence
segment, B(e) runs its chunks of one block of e with each of the chunk pipeline's A(a) chunks (a block counter in
SBUF), and the blocks A(a) did not reach after A(a). The bits do not change: the outputs equal mx_exact, LNC1 and LNC2.

| test                           | what                                                              | fixed      |
|--------------------------------|-------------------------------------------------------------------|------------|
| test_interleave_bit_exact      | B = 512, E = 4 (two fence groups), block counts of A(a) and B(e)  | LNC1, LNC2 |
|                                | unequal both ways, an empty A(a), an empty B(e), padded last      |            |
|                                | blocks, single-block experts; with and without checkpoints        |            |
| test_b_pieces_between_a_chunks | balanced, two blocks per expert: before A(2)'s j-th d_gate_up     | LNC1, LNC2 |
|                                | store come the B(0) panel loads of pieces 0..j (cores per piece), |            |
|                                | likewise A(3) and B(1); none before A(2)                          |            |
"""
from __future__ import annotations

import numpy as np
import pytest

from nkilib.experimental.moe_mxfp8 import moe_bwd_mxfp8_kernel as kernel_module
from nkilib.experimental.moe_mxfp8.reference import moe_backward_reference
from nkilib.simulator.launcher import run_kernel
from simkit import assert_outputs_identical, reads_before_writes
from test_moe_bwd_kernel import CLAMPS, moe_case

CHECKPOINTS = ("gate_pre", "gate_act", "up", "intermediate")
T, E, H, I, B = 1024, 4, 64, 96, 512


def _routing(case):
    """topk_ids [T, 2] (blocks per expert e0 / e1 / e2 / e3 at B = 512; segment 0 runs A(2) with B(0), A(3) with B(1)):
    "b_more": 2 full / 0 / 1 padded / 2 (a full and a padded): B(0) has a block more than A(2) (the rest after A),
        B(1) is empty (A(3) alone);
    "a_empty": 1 padded / 2 full / 0 / 2 padded: A(2) is empty (all of B(0) after it), A(3) and B(1) 2 blocks each;
    "a_more": 1 full / 0 / 2 full / 1 full: A(2) has a block more than B(0) (B's pieces run out), B(1) empty."""
    ids = np.zeros((T, 2), np.int32)
    if case == "b_more":
        ids[:, 0], ids[:400, 1], ids[400:, 1] = 0, 2, 3
    elif case == "a_empty":
        ids[:300] = (0, 1)
        ids[300:] = (1, 3)
    else:
        ids[:512], ids[512:] = (0, 2), (2, 3)
    return ids


def _run(kernel, lnc, trace=False):
    return run_kernel(kernel_module.moe_backward_mxfp8_nki.fn, kwargs=kernel, lnc=lnc, grid_ndim=1, trace=trace)


@pytest.mark.parametrize("lnc", [1, 2])
@pytest.mark.parametrize("case,checkpoints", [("b_more", CHECKPOINTS), ("a_empty", CHECKPOINTS), ("a_more", ()),
                                              ("b_more", ())])
def test_interleave_bit_exact(case, checkpoints, lnc):
    kernel, ref = moe_case(T, E, H, I, _routing(case), seed=83, block_size=B, checkpoints=checkpoints,
                           clamp_limits=CLAMPS)
    res = _run(kernel, lnc)
    assert_outputs_identical(tuple(np.asarray(o) for o in res.outputs), moe_backward_reference(**ref),
                             f"A/B interleave ({case}, checkpoints {bool(checkpoints)}), LNC{lnc} vs mx_exact")


@pytest.mark.parametrize("lnc", [1, 2])
def test_b_pieces_between_a_chunks(lnc):
    ids = np.tile(np.arange(E, dtype=np.int32), (T, 1))  # k = 4: every expert 1024 pairs, two full blocks
    kernel, ref = moe_case(T, E, H, I, ids, seed=84, block_size=B, checkpoints=CHECKPOINTS, clamp_limits=CLAMPS)
    res = _run(kernel, lnc, trace=True)
    assert_outputs_identical(tuple(np.asarray(o) for o in res.outputs), moe_backward_reference(**ref),
                             f"A/B interleave (balanced), LNC{lnc} vs mx_exact")
    # program 0 in program order: pass A stores each chunk's d_gate_up rows once, pass B loads each of its chunks'
    # stationary panels (made by pass A) once. A(0), A(1) run first (2 blocks x B / 128 / lnc chunks each), then A(2)
    # with B(0) in pieces of lnc chunks: before A(2)'s j-th store come the B(0) loads of pieces 0..j
    before = reads_before_writes(res.trace, "moe_bwd_d_gate_up_panels", "moe_bwd_d_gate_up")
    per_expert = 2 * (B // 128) // lnc  # A's chunks of one expert on this core
    assert len(before) == E * per_expert, len(before)
    a2 = before[2 * per_expert:3 * per_expert]
    assert before[:2 * per_expert] == [0] * (2 * per_expert), before
    assert a2 == [lnc * (j + 1) for j in range(per_expert)], a2
    # B(1) runs with A(3) the same way, after B(0)'s 2 x B / 128 chunks and C(0)
    a3 = before[3 * per_expert:]
    assert a3 == [2 * (B // 128) + lnc * (j + 1) for j in range(per_expert)], a3
