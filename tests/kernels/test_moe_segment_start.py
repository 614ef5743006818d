"""The first fence segment's end and the next segment's start (docs/moe.md section 10, round 18a): with the chunk
pipeline and X deferred (gate_pre and up given), each expert's X rows but the first group's last expert's are gathered
into x_blocks right after its own pass A (under the next A's chunks) instead of all after the group's last A, and the
first A after each fence has its resident W_down loaded before that fence. The bits do not change: the outputs equal
mx_exact, LNC1 and LNC2.

| test                                 | what                                                            | fixed      |
|--------------------------------------|-----------------------------------------------------------------|------------|
| test_segment_start_bit_exact         | E = 4 (two fence groups), one full block each, all checkpoints, | LNC1, LNC2 |
|                                      | clamped; and a routing with an empty expert 2 (its W_down       |            |
|                                      | loaded early, never used)                                       |            |
| test_x_of_first_expert_before_last_a | on each core, expert 0's x_blocks writes come before expert 1's | LNC1, LNC2 |
|                                      | first d_gate_up store, expert 1's after its last                |            |
| test_first_a_weights_before_fence    | the DMAs of W_down read before the first core barrier are those | LNC2       |
|                                      | of experts 0, 1 and 2 (A(2) is the first A after the fence) and |            |
|                                      | core 0's of 3 (the exchange, round 25b); none after it          |            |
| test_every_fence_loads_next_a        | E = 8 (four fence groups of two): the W_down read in each       | LNC2       |
|                                      | segment is of experts {0, 1, 2, 3}, {4, 5}, {6, 7} on core 0    |            |
|                                      | and {0, 1, 2}, {4}, {6} on core 1; bit-exact                    |            |
| test_empty_first_a_loads_no_weights  | the empty expert 2 (first A after the fence): no byte of its    | LNC1, LNC2 |
|                                      | W_down is read (round 19c: the early load sits in its if_used), | (bf16:     |
|                                      | the other experts' W_down is read as before; MXFP8 and bf16     | LNC2)      |
| test_first_chunk_gathered_before_    | two blocks per expert, the interleave off (GPT-OSS-20B's path): | LNC1, LNC2 |
|   fence                              | the row positions gathered before the first barrier are A(0)'s  |            |
|                                      | and A(1)'s chunks and A(2)'s first (round 26b), and every       |            |
|                                      | W_down pass A loads on chip is staged in pass C's ring tiles    |            |
|                                      | (not fresh ones: A(2)'s early one and those at an A's start);   |            |
|                                      | bit-exact                                                       |            |
| test_first_b_weights_before_fence    | E = 8 (four fence groups of two), the A/B interleave: each      | LNC1, LNC2 |
|                                      | segment's first B(e) has its W_gu read in the segment before    |            |
|                                      | (round 38d), the last group's B(6) too (round 39b): per segment |            |
|                                      | {0}, {1, 2}, {3, 4}, {5, 6}, {7}; bit-exact                     |            |
| test_one_group_b_weights_before_     | E = 2 (one fence group, no interleave partner): B(0)'s W_gu is  | LNC2       |
|   fence                              | read before the only fence, B(1)'s after it (round 39b);        |            |
|                                      | bit-exact                                                       |            |
| test_x_head_gathered_after_its_a     | k = 1, experts of 1, 1, 4, 1 blocks: expert 2's x_blocks rows   | LNC1, LNC2 |
|                                      | of its first two blocks are written right after A(2), before    |            |
|                                      | C(0); of its last two after C(1) (round 39b); bit-exact         |            |
"""
from __future__ import annotations

import numpy as np
import pytest

from nkilib.experimental.moe_mxfp8 import moe_bwd_mxfp8_kernel as kernel_module
from nkilib.experimental.moe_mxfp8.reference import moe_backward_reference
from nkilib.simulator.launcher import run_kernel
from moekit import expert_routing
from simkit import assert_outputs_identical, sbuf_tiles_loaded, touches
from test_moe_bwd_kernel import CLAMPS, moe_case
from test_moe_gate_up_staging import PASS_C_SOURCES

CHECKPOINTS = ("gate_pre", "gate_act", "up", "intermediate")
T, E, H, I, B = 1024, 4, 64, 96, 512


def _routing(case):
    """topk_ids [T, 2]: "balanced": tokens 0..511 to experts 0 and 1, the rest to 2 and 3 (one full block each);
    "empty_2": tokens 0..511 to 0 and 1, the rest to 1 and 3 (expert 2 has no block, expert 1 two)."""
    ids = np.zeros((T, 2), np.int32)
    ids[:512] = (0, 1)
    ids[512:] = (2, 3) if case == "balanced" else (1, 3)
    return ids


def _traced_against_mx_exact(T_, E_, h, ids, seed, lnc, what, **options):
    """The kernel on (T_, E_, h, I, ids) (B, CHECKPOINTS, CLAMPS) traced at `lnc`; outputs == mx_exact. Returns the
    trace."""
    kernel, ref = moe_case(T_, E_, h, I, ids, seed=seed, block_size=B, checkpoints=CHECKPOINTS, clamp_limits=CLAMPS,
                           **options)
    res = run_kernel(kernel_module.moe_backward_mxfp8_nki.fn, kwargs=kernel, lnc=lnc, grid_ndim=1, trace=True)
    assert_outputs_identical(tuple(np.asarray(o) for o in res.outputs), moe_backward_reference(**ref),
                             f"{what}, LNC{lnc} vs mx_exact")
    return res.trace


def _run(case, lnc, **options):
    return _traced_against_mx_exact(T, E, H, _routing(case), 181, lnc, f"segment start ({case})", **options)


def _down_weight_experts(trace, program):
    """The experts whose W_down bytes `program`'s instructions read (down_weight [E, H, I] bf16)."""
    expert_bytes = H * I * 2
    return {t.byte_lo // expert_bytes for r in trace if r.program == program for t in r.reads
            if getattr(t, "name", "") == "down_weight"}


def _run_eight_experts(lnc, seed, what):
    """E = 8, T = 2048, k = 2, one full block per expert (tokens 512q..512q+511 to experts 2q and 2q + 1): four fence
    groups of two. Outputs == mx_exact; returns the trace."""
    T8, E8 = 2048, 8
    ids = np.zeros((T8, 2), np.int32)
    for q in range(4):
        ids[512 * q:512 * (q + 1)] = (2 * q, 2 * q + 1)
    return _traced_against_mx_exact(T8, E8, H, ids, seed, lnc, f"{what}, E = 8")


def _experts_read_per_segment(trace, program, tensor, expert_bytes):
    """Per fence segment of `program` (split at its core_barriers), the experts whose `tensor` bytes it reads."""
    segments = [set()]
    for r in trace:
        if r.program != program:
            continue
        if r.instr == "core_barrier":
            segments.append(set())
            continue
        segments[-1].update(t.byte_lo // expert_bytes for t in r.reads if getattr(t, "name", "") == tensor)
    return segments


def _names(ops):
    return [getattr(t, "name", "") for t in ops]


@pytest.mark.parametrize("lnc", [1, 2])
@pytest.mark.parametrize("case", ["balanced", "empty_2"])
def test_segment_start_bit_exact(case, lnc):
    _run(case, lnc)


@pytest.mark.parametrize("lnc", [1, 2])
def test_x_of_first_expert_before_last_a(lnc):
    """Per core, in program order: the d_gate_up stores of segment 0 (A(0)'s chunks, then A(1)'s) and the x_blocks
    writes of X's deferred gathers, up to the first core barrier (LNC2). Expert 0's gathers (B / 128 / lnc chunks per
    core) sit between A(0)'s last store and A(1)'s first, expert 1's after A(1)'s last (before the round: all of them
    after A(1)'s last store)."""
    trace = _run("balanced", lnc)
    per_core = B // 128 // lnc
    for p in range(lnc):
        mine = [r for r in trace if r.program == p]
        events = []
        for r in mine:
            if "moe_bwd_d_gate_up" in _names(r.writes):
                events.append("A")
            elif "moe_bwd_x_blocks" in _names(r.writes):
                events.append("X")
            elif r.instr == "core_barrier":
                break
        # segment 0: per_core d_gate_up stores of A(0), then X(0), then A(1)'s, then X(1) (LNC1 has no barrier: A(2)'s
        # stores follow)
        assert events[:4 * per_core] == (["A"] * per_core + ["X"] * per_core) * 2, (p, events)


def test_first_a_weights_before_fence():
    """LNC2: the first A after the first fence is A(2) (segment 1 runs A of the second group with B of the first);
    its resident W_down is read before that fence, with A(0)'s and A(1)'s (before the round: experts 0 and 1 only).
    A(3), the segment's second A, reads W_down[3] quantized from the exchange's scratch (round 25b; before it: after
    the fence, from down_weight), which the cores quantize by halves of its K tiles before the fence: H = 64 is one
    partial K tile, core 0's. So after the fence no core reads down_weight."""
    trace = _run("balanced", 2)
    expert_bytes = H * I * 2  # down_weight [E, H, I] bf16
    for p in range(2):
        mine = [r for r in trace if r.program == p]
        barrier = next(n for n, r in enumerate(mine) if r.instr == "core_barrier")
        before, after = set(), set()
        for n, r in enumerate(mine):
            for t in r.reads:
                if getattr(t, "name", "") == "down_weight":
                    (before if n < barrier else after).add(t.byte_lo // expert_bytes)
        assert before == ({0, 1, 2, 3} if p == 0 else {0, 1, 2}), (p, before)
        assert after == set(), (p, after)


def test_every_fence_loads_next_a():
    """LNC2, E = 8, one full block per expert: four fence groups of two experts. The first A after each fence (A(2),
    A(4), A(6)) has its W_down read before that fence (before round 18a: {0, 1}, {2, 3}, {4, 5}, {6, 7} per segment).
    Each segment's second A (A(3), A(5), A(7)) reads its W_down from the exchange's scratch (round 25b), quantized a
    fence ahead by the core holding its one K tile (H = 64: core 0), in the segment before: core 0 reads W_down[3]
    before the first fence, W_down[5] and W_down[7] in the segments of A(2) and A(4) (before round 25b: {0, 1, 2},
    {3, 4}, {5, 6}, {7} on both cores)."""
    trace = _run_eight_experts(2, 191, "segment start")
    for p in range(2):
        segments = _experts_read_per_segment(trace, p, "down_weight", H * I * 2)  # down_weight [E, H, I] bf16
        expected = ([{0, 1, 2, 3}, {4, 5}, {6, 7}, set(), set()] if p == 0
                    else [{0, 1, 2}, {4}, {6}, set(), set()])
        assert segments == expected, (p, segments)


@pytest.mark.parametrize("lnc, precision", [(1, "mxfp8"), (2, "mxfp8"), (2, "bf16")])
def test_empty_first_a_loads_no_weights(lnc, precision):
    """Routing "empty_2": expert 2 has no block and is the first expert of the second fence group, whose W_down round
    18a loaded before the fence whether or not it was used. Since round 19c the load runs in expert 2's 0/1-trip
    if_used: its W_down is never read, on any core, while experts 0, 1 and 3 read theirs (bit-exact: _run). bf16
    (trn2's precision) takes the same path with bf16 K tiles in the slots."""
    trace = _run("empty_2", lnc, matmul_precision=precision)
    for p in range(lnc):
        # LNC2 MXFP8: expert 3's W_down goes through the exchange (round 25b), H = 64 being core 0's one K tile
        expected = {0, 1} if (lnc, precision, p) == (2, "mxfp8", 1) else {0, 1, 3}
        assert _down_weight_experts(trace, p) == expected, (p, _down_weight_experts(trace, p))


@pytest.mark.parametrize("lnc", [1, 2])
def test_first_chunk_gathered_before_fence(lnc, monkeypatch):
    """Round 26b, E = 4 of two full blocks each (k = 4), the interleave off as for GPT-OSS-20B (both passes' panels
    over INTERLEAVE_PANEL_BUDGET_BYTES), H = 256 (two K tiles of W_down). Before the first core barrier each core
    gathers the ids and slots of A(0)'s and A(1)'s chunks (blocks 0-3) and of A(2)'s first chunk (block 4, this
    core's first 128 rows), which A(2)'s pipeline then starts from instead of gathering it after the barrier (fails
    on main: blocks 0-3 only). Every W_down pass A loads on chip (A(2)'s before the fence, the others at their A's
    start) is staged in pass C's kernel-scope ring (its staging DMAs write tiles that pass C's operand loads write;
    fails on main: fresh tiles). LNC1 has no barrier: bit-exact and the staging only."""
    monkeypatch.setattr(kernel_module, "INTERLEAVE_PANEL_BUDGET_BYTES", 0)
    h = 256
    ids = np.tile(np.arange(E, dtype=np.int32), (T, 1))
    trace = _traced_against_mx_exact(T, E, h, ids, 261, lnc, "first chunk gathered before the fence")
    expert_bytes = h * I * 2  # down_weight [E, H, I] bf16
    for p in range(lnc):
        mine = [r for r in trace if r.program == p]
        pass_c = sbuf_tiles_loaded(mine, lambda r: any(touches(r, n) for n in PASS_C_SOURCES))
        # LNC2: A(3) takes W_down[3] from the exchange (round 25b), which core 0 quantizes on its own path
        for e in range(E if lnc == 1 else 3):
            w_down = sbuf_tiles_loaded(mine, lambda r: any(t.name == "down_weight" and t.byte_lo // expert_bytes == e
                                                           for t in r.reads))
            assert w_down and w_down <= pass_c, (p, e, sorted(w_down - pass_c))
        if lnc == 1:
            continue
        barrier = next(n for n, r in enumerate(mine) if r.instr == "core_barrier")
        chunks = {(t.byte_lo // 4 // B, t.byte_lo // 4 % B) for r in mine[:barrier] for t in r.reads
                  if t.name == "token_position_to_slot"}
        rows = {p * 128, 256 + p * 128}  # core p's 128 rows of each 256-row unit
        assert chunks == {(b, r) for b in range(4) for r in rows} | {(4, p * 128)}, (p, sorted(chunks))


@pytest.mark.parametrize("lnc", [1, 2])
def test_first_b_weights_before_fence(lnc):
    """E = 8, one full block per expert: four fence groups of two; H = 64, I = 96 take the A/B interleave (round 8a).
    Each segment's first B interleaved with an A (B(0) with A(2), B(2) with A(4), B(4) with A(6)) has its resident W_gu
    read before the fence ahead of it (round 38d), in the segment before, and so has the last group's B(6), which runs
    alone (no A to interleave with; round 39b); the segments' second Bs read theirs after it. Before round 38d each
    segment read the W_gu of its own two Bs: [], {0, 1}, {2, 3}, {4, 5}, {6, 7}; before round 39b the last one read
    B(6)'s: ..., {5}, {6, 7}. Outputs == mx_exact (LNC1: no fences, bit-exact only)."""
    trace = _run_eight_experts(lnc, 383, "W_gu before the fence")
    if lnc == 1:
        return
    for p in range(2):
        # gate_up_weight [E, 2I, H] bf16, read by pass B only (every checkpoint given)
        segments = _experts_read_per_segment(trace, p, "gate_up_weight", 2 * I * H * 2)
        # pass B splits H between the cores in SPLIT_ALIGN columns: H = 64 is core 0's, core 1 reads no W_gu
        assert segments == ([{0}, {1, 2}, {3, 4}, {5, 6}, {7}] if p == 0 else [set()] * 5), (p, segments)


def test_one_group_b_weights_before_fence():
    """E = 2, one full block per expert: one fence group, so the only fence follows A(0), A(1) and both Bs run alone
    after it (no A to interleave with). B(0)'s resident W_gu is read before that fence (round 39b), B(1)'s after it:
    per segment {0}, {1} on core 0 (before round 39b: [], {0, 1}); outputs == mx_exact."""
    T2, E2 = 512, 2
    ids = np.tile(np.array([0, 1], np.int32), (T2, 1))
    trace = _traced_against_mx_exact(T2, E2, H, ids, 389, 2, "one fence group")
    segments = _experts_read_per_segment(trace, 0, "gate_up_weight", 2 * I * H * 2)
    assert segments == [{0}, {1}], segments


@pytest.mark.parametrize("lnc", [1, 2])
def test_x_head_gathered_after_its_a(lnc):
    """k = 1, E = 4 of 1, 1, 4 and 1 full blocks: groups {0, 1} and {2, 3}; the segment after the first fence runs A(2)
    and A(3) (X deferred: every checkpoint given) with B / C of experts 0 and 1. Expert 2's x_blocks rows of its blocks
    before the last two (its first two) are gathered right after A(2), before C(0) reads expert 0's in each core's
    program order; those of its last two after C(1) read expert 1's, as before (round 39b; before it all four of expert
    2's followed C(1)). Outputs == mx_exact."""
    counts = [B, B, 4 * B, B]
    trace = _traced_against_mx_exact(sum(counts), 4, H, expert_routing(counts, shuffle_seed=397), 401, lnc,
                                     "X head after its A")
    for p in range(lnc):
        mine = [r for r in trace if r.program == p]
        # x_blocks [N, B, H] bf16: experts 0, 1 own blocks 0, 1 (read by C(0), C(1)), expert 2 blocks 2..5
        def blocks(ops):
            return [t.byte_lo // (B * H * 2) for t in ops if getattr(t, "name", "") == "moe_bwd_x_blocks"]
        written = [(n, b) for n, r in enumerate(mine) for b in blocks(r.writes)]
        read = [(n, b) for n, r in enumerate(mine) for b in blocks(r.reads)]
        c0, c1 = min(n for n, b in read if b == 0), max(n for n, b in read if b == 1)
        head, tail = [n for n, b in written if b in (2, 3)], [n for n, b in written if b in (4, 5)]
        assert head and tail, (p, written)
        assert max(head) < c0 < c1 < min(tail), (p, min(head), max(head), c0, c1, min(tail))
