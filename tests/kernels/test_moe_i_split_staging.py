"""Where the I split stages a later expert's dY / X rows (docs/moe.md section 10, round 34b).

Under the I split (W_down loaded on use: forced here by a zero resident budget) the full blocks of the experts after the
first fence group have their dY and X rows copied HBM -> HBM into the block-ordered scratch a fence ahead of their pass
A (ExpertISplit.stage). Segment step j stages expert later[j] (the group after next): since round 34b inside
A(ahead[j]), after its chunks' reads and before its first I tile's matmuls (ExpertISplit.expert's at_first_tile), or at
once where A(ahead[j]) has no blocks; before, it went after B(e). Since round 35a the second group's experts are staged
the same way inside the first group's A (second[n] in A(groups[0][n])), not after it. The outputs stay mx_exact's bit
for bit, LNC1 and LNC2 (the race detector on).

| test                           | what                                                                     | fixed      |
|--------------------------------|--------------------------------------------------------------------------|------------|
| test_stage_in_a_first_tile     | fence groups [0, 1], [2, 3], [4, 5] (expert 3 without blocks, expert 5   | LNC2       |
|                                | of two blocks): per core, stage(4) between A(2)'s block and its first I   |            |
|                                | tile, stage(5) in A(3)'s unused path, both before B(0) / B(1);           |            |
|                                | == mx_exact                                                              |            |
| test_second_group_staged_in_   | fence groups [0, 1], [2, 3], [4, 5], expert 0 without blocks: per core,  | LNC2       |
| first_group_a                  | stage(2) in A(0)'s unused path, stage(3) between A(1)'s block and its    |            |
|                                | first I tile, both before the first fence's A(2); == mx_exact            |            |
| test_staging_bit_exact_lnc1    | the same routing under LNC1 (no split, nothing staged): == mx_exact      | LNC1       |
"""
from __future__ import annotations

import numpy as np

from nkilib.experimental.moe_mxfp8 import moe_bwd_mxfp8_d_gate_up as G
from nkilib.experimental.moe_mxfp8 import moe_bwd_mxfp8_dx as D
from nkilib.experimental.moe_mxfp8 import moe_bwd_mxfp8_i_split as S
from nkilib.experimental.moe_mxfp8 import moe_bwd_mxfp8_kernel as K
from nkilib.experimental.moe_mxfp8.reference import moe_backward_reference
from moekit import dedupe_repeats, core_of_ctx, core_of_self, expert_routing
from simkit import assert_outputs_identical, spy_per_core
from test_moe_bwd_kernel import moe_case, run
from test_moe_i_split import CHECKPOINTS


def _case(monkeypatch):
    """(kernel kwargs, reference kwargs): no resident budget, B = 256, k = 1, H = 2048 (pass B loads W_gu per block,
    the path that reads B(e)'s rows ahead, as on the DeepSeek-V3 rank), I = 544 (core 0 takes the 512-column I tile,
    core 1 the 32-column one), all four checkpoints; experts of 256 / 256 / 256 / 0 / 256 / 300 pairs (blocks 1, 1,
    1, 0, 1, 2: expert 5's second block holds padding), fence groups [0, 1], [2, 3], [4, 5]."""
    monkeypatch.setattr(D, "RESIDENT_WEIGHT_BUDGET_BYTES", 0)
    T, E, H, I, B = 1324, 6, 2048, 544, 256
    ids = expert_routing([256, 256, 256, 256, 300], experts=[0, 1, 2, 4, 5], shuffle_seed=341)
    kernel, ref = moe_case(T, E, H, I, ids, seed=342, block_size=B, checkpoints=CHECKPOINTS)
    assert np.diff(kernel["expert_block_offsets"]).tolist() == [1, 1, 1, 0, 1, 2]
    return kernel, ref


def _record(monkeypatch):
    """Program-order events per core: ("A", e) per block of the I split's pass A, ("stage",) per staged block,
    ("tile",) per chunk and I tile of pass A (its epilogue, right after its dI matmul), ("B", e) per block of pass B. The simulator traces a 0/1-trip
    loop's body only when it trips, so events of a path not taken are not recorded."""
    events = spy_per_core(monkeypatch, S.ExpertISplit, "block", core_of_self, lambda self, e, *args, **kwargs: ("A", e))
    spy_per_core(monkeypatch, S.ExpertISplit, "stage", core_of_self, lambda self, i: ("stage",), into=events)
    spy_per_core(monkeypatch, K, "compute_phase2_hidden_states_grad_mxfp8", core_of_ctx,
                 lambda ctx, e, *args, **kwargs: ("B", e), into=events)
    # each chunk's epilogue of an I tile, issued right after the tile's dI matmul (RowChunk.epilogue)
    spy_per_core(monkeypatch, G.RowChunk, "epilogue", lambda self, ctx, *args, **kwargs: ctx.split.shard_id,
                 lambda self, ctx, *args, **kwargs: ("tile",), into=events)
    return events


def test_stage_in_a_first_tile(monkeypatch):
    """Per core, the staging of segment 0's later group ([4, 5]) runs inside its A steps: stage(4) after A(2)'s block
    starts (its chunks' reads) and before A(2)'s first I tile (its dI matmul and epilogue), stage(5) where A(3) has no blocks; both before
    B(0) / B(1) of the same step. Group 1's experts ([2, 3]) are staged before the first fence inside A(0) / A(1)
    (round 35a: stage(2) after A(0)'s block starts, expert 3 has no blocks to stage); group 2's expert 5 stages its
    first (full) block only. LNC2 == mx_exact bit for bit under the race detector.
    Fails on the old code (stage(4) after B(0), stage(5) after B(1); before round 35a stage(2) after A(1))."""
    kernel, ref = _case(monkeypatch)
    events = _record(monkeypatch)
    out = run(kernel, lnc=2)
    assert_outputs_identical(out, moe_backward_reference(**ref), "LNC2 I split staging in A vs mx_exact")
    for core in (0, 1):
        seq = dedupe_repeats(events[core])
        assert seq == [("A", 0), ("stage",), ("tile",), ("A", 1), ("tile",), ("A", 2), ("stage",), ("tile",),
                       ("B", 0), ("stage",), ("B", 1), ("A", 4), ("tile",), ("B", 2), ("A", 5), ("tile",),
                       ("A", 5), ("tile",), ("B", 4), ("B", 5)], seq


def test_second_group_staged_in_first_group_a(monkeypatch):
    """The second fence group's staging inside the first group's A (round 35a): experts of 0 / 256 / 256 / 256 / 256 /
    256 pairs (one block each but expert 0's), fence groups [0, 1], [2, 3], [4, 5]. Per core, stage(2) runs in A(0)'s
    unused path (before A(1)), stage(3) after A(1)'s block starts (its chunks' reads) and before its first I tile,
    both before the first fence's A(2); the segment steps stage 4 and 5 in A(2) / A(3) as in round 34b. LNC2 ==
    mx_exact bit for bit under the race detector. Fails on the old code (stage(2), stage(3) after A(1)'s tiles)."""
    monkeypatch.setattr(D, "RESIDENT_WEIGHT_BUDGET_BYTES", 0)
    T, E, H, I, B = 1280, 6, 2048, 544, 256
    ids = expert_routing([256] * 5, experts=[1, 2, 3, 4, 5], shuffle_seed=351)
    kernel, ref = moe_case(T, E, H, I, ids, seed=352, block_size=B, checkpoints=CHECKPOINTS)
    assert np.diff(kernel["expert_block_offsets"]).tolist() == [0, 1, 1, 1, 1, 1]
    events = _record(monkeypatch)
    out = run(kernel, lnc=2)
    assert_outputs_identical(out, moe_backward_reference(**ref), "LNC2 second group staged in A vs mx_exact")
    for core in (0, 1):
        seq = dedupe_repeats(events[core])
        assert seq == [("stage",), ("A", 1), ("stage",), ("tile",), ("A", 2), ("stage",), ("tile",), ("A", 3),
                       ("stage",), ("tile",), ("B", 1), ("A", 4), ("tile",), ("B", 2), ("A", 5), ("tile",), ("B", 3),
                       ("B", 4), ("B", 5)], seq


def test_staging_bit_exact_lnc1(monkeypatch):
    """The same routing under LNC1: no I split, nothing staged, == mx_exact bit for bit (so LNC1 == LNC2)."""
    kernel, ref = _case(monkeypatch)
    events = spy_per_core(monkeypatch, S.ExpertISplit, "stage", core_of_self, lambda self, i: ("stage",))
    out = run(kernel, lnc=1)
    assert_outputs_identical(out, moe_backward_reference(**ref), "LNC1 vs mx_exact")
    assert events == {}, events
