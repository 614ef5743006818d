"""The I split's W_down loaded a pass ahead of A(e) (ExpertISplit.prefetch_down; docs/moe.md section 10, round 14b).

Where pass A splits experts along I (moe_bwd_mxfp8_i_split.py, W_down loaded on use: forced here by a zero resident
budget), the kernel loads and quantizes a one-block expert's W_down columns after the B that precedes A(e) in program
order (before that segment's C), into words and scales allocated outside the run-time loops, under the run-time
condition of expert()'s full branch, which takes them instead of loading its own. Padded and multi-block experts
load their own (round 14d's paths). The outputs stay mx_exact's bit for bit under LNC2 (the race detector on).

| test                           | what                                                                     | fixed |
|--------------------------------|--------------------------------------------------------------------------|-------|
| test_down_prefetch_order       | fence groups [0, 1], [2, 3], [4]: W_down[4] prefetched after C(0), before | LNC2  |
|                                | C(1), after the segment's staging (in A(2): round 34b); A(4) takes the   |       |
|                                | prefetched panels, A(0), A(1) and A(2) load their own; bit-exact         |       |
| test_down_prefetch_padded_next | the prefetched expert holds padding: its prefetch loop runs no trip and  | LNC2  |
|                                | A(4) takes the padded I split path with its own panels; bit-exact        |       |
"""
from __future__ import annotations

from nkilib.experimental.moe_mxfp8 import moe_bwd_mxfp8_i_split as S
from nkilib.experimental.moe_mxfp8 import moe_bwd_mxfp8_single_block as S1
from nkilib.experimental.moe_mxfp8.reference import moe_backward_reference
from moekit import core_of_ctx, core_of_self
from simkit import assert_outputs_identical, spy_per_core, spy_results
from test_moe_bwd_kernel import run
from test_moe_i_split import i_split_case


def _record(monkeypatch):
    """Program-order events per core: ("prefetch", e), ("A", e, full?, prefetched?) per block of the I split (whether
    the block's W_down panels are the very list prefetch_down returned for e on that core), ("C", e) of pass C's
    single-block path (its first gradient), ("stage", e) per expert the I split stages."""
    ahead = spy_results(monkeypatch, S.ExpertISplit, "prefetch_down", lambda self, e, desc: (core_of_self(self), e))
    events = spy_per_core(monkeypatch, S.ExpertISplit, "prefetch_down", core_of_self,
                          lambda self, e, desc: ("prefetch", e))
    spy_per_core(monkeypatch, S.ExpertISplit, "block", core_of_self, lambda self, e, i, w, full, **kwargs: (
        "A", e, full, w[0].panels is ahead.get((core_of_self(self), e))), into=events)
    spy_per_core(monkeypatch, S.ExpertISplit, "stage_expert", core_of_self, lambda self, e: ("stage", e), into=events)
    spy_per_core(monkeypatch, S1, "compute_phase3_single_block_grads_mxfp8", core_of_ctx,
                 lambda ctx, e, i, out, *args, **kwargs: ("C", e) if out is ctx.d_gate_up_weight else None, into=events)
    return events


def test_down_prefetch_order(monkeypatch):
    """test_moe_i_split's routing (T = 912, B = 256, H = 1024, I = 544; experts of 256 / 100 / 300 / 0 / 256 pairs,
    fence groups [0, 1], [2, 3], [4]): A(3) is the first expert's next A (prefetched, no blocks: its loop runs no trip),
    A(4) the second's (the next segment's first A); A(2), right after the first fence, loads its own. A(4) takes the
    prefetched panels, A(0) (before the first fence) its own, A(1) (one padded block) and A(2) (a full block, then a
    padded one) take round 14d's I split with their own. Fails on the old code (no prefetch_down)."""
    kernel, ref = i_split_case(monkeypatch)
    events = _record(monkeypatch)
    out = run(kernel, lnc=2)
    assert_outputs_identical(out, moe_backward_reference(**ref), "LNC2 W_down prefetch vs mx_exact")
    for core in (0, 1):
        seq = events[core]
        assert [ev for ev in seq if ev[0] not in ("C", "stage")] == [
            ("A", 0, True, False), ("A", 1, False, False), ("A", 2, True, False), ("A", 2, False, False),
            ("prefetch", 3), ("prefetch", 4), ("A", 4, True, True)], seq
        # W_down[4] is loaded in the first segment's second part (A(3), B(1), prefetch, C(1)): after C(0), before C(1)
        assert seq.index(("C", 0)) < seq.index(("prefetch", 4)) < seq.index(("C", 1)), seq
        # the segment's staging of the group after next (expert 4's dY / X rows) goes inside A(2), before its blocks'
        # loops (round 34b; it followed B(0) and the prefetch before): stage(4), A(2), B(0), prefetch(3), C(0)
        assert seq.index(("stage", 4)) < seq.index(("A", 2, True, False)) < seq.index(("prefetch", 3)) < \
            seq.index(("C", 0)), seq


def test_down_prefetch_padded_next(monkeypatch):
    """As above with expert 4 of 100 pairs (one padded block): its prefetch loop runs no trip (the I split's full-block
    flag, tested at run time) and A(4) takes round 14d's padded I split path (before the merge with round 14d: the
    row split with the W_down exchange), loading its own panels; LNC2 bit-exact."""
    kernel, ref = i_split_case(monkeypatch, last_pairs=100, permutation_seed=29, data_seed=37)
    events = _record(monkeypatch)
    out = run(kernel, lnc=2)
    assert_outputs_identical(out, moe_backward_reference(**ref), "LNC2 W_down prefetch, padded next expert")
    # the prefetch is issued, but its loop and A(4)'s full branch run no trip (the simulator runs what trips): the
    # padded branch runs with W_down loaded there
    for core in (0, 1):
        runs = [ev for ev in events[core] if ev[0] in ("A", "prefetch")]
        assert runs == [("A", 0, True, False), ("A", 1, False, False), ("A", 2, True, False), ("A", 2, False, False),
                        ("prefetch", 3), ("prefetch", 4), ("A", 4, False, False)], events[core]
