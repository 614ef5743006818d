"""The pass A pipeline's dY rows staged a fence ahead (docs/moe.md section 10, round 31a): with the chunk pipeline and X
deferred (gate_pre and up given) and the unclamped SwiGLU's d_gate products on GpSimd, the dY rows of the group after
next are copied by token id into dy_blocks after the segment's first pass C, and that group's A (after the next fence)
reads them by plain DMA instead of gathering them beside its epilogue's GpSimd products. The bits do not change: the outputs equal mx_exact, LNC1 and LNC2.

| test                          | what                                                                  | fixed      |
|-------------------------------|-----------------------------------------------------------------------|------------|
| test_dy_staging_bit_exact     | E = 8 (four fence groups of two), one full block each; and a routing  | LNC1, LNC2 |
|                               | whose staged groups hold an empty expert and two padded last blocks   |            |
|                               | (a chunk of padding only among them)                                  |            |
| test_dy_gathered_a_fence_     | per core, the token rows of dY read by indirect DMA in each segment   | LNC2       |
|   ahead                       | between core barriers: group 2's move into segment 1 (beside group    |            |
|                               | 1's), group 3's into segment 2; every dY gather of a staged group     |            |
|                               | writes dy_blocks (HBM -> HBM), none of them SBUF                      |            |
| test_staging_off_is_main      | STAGE_DY_A_FENCE_AHEAD = False: main's segments (each group's dY      | LNC2       |
|                               | gathered in its own A's segment), bit-exact                           |            |
| test_clamped_epilogue_not_    | GPT-OSS-20B's clamped epilogue (d_gate products on VectorE): main's   | LNC2       |
|   staged                      | segments, bit-exact                                                   |            |
"""
from __future__ import annotations

import numpy as np
import pytest

from nkilib.experimental.moe_mxfp8 import moe_bwd_mxfp8_kernel as kernel_module
from nkilib.experimental.moe_mxfp8.reference import moe_backward_reference
from nkilib.simulator.launcher import run_kernel
from simkit import assert_outputs_identical
from test_moe_bwd_kernel import CLAMPS, moe_case

CHECKPOINTS = ("gate_pre", "gate_act", "up", "intermediate")
T, E, H, I, B = 2048, 8, 64, 96, 512
GROUP_TOKENS = 512  # tokens 512 q .. 512 q + 511 go to fence group q's two experts (2 q, 2 q + 1)


def _routing(case):
    """topk_ids [T, 2]. "full": group q's tokens to experts 2q and 2q + 1, one full block each. "padded": the same for
    groups 0 and 1; group 2's tokens to expert 4 and (the first 276) expert 6 or (the rest) expert 7, group 3's to 6
    and 7: expert 5 empty, experts 6 and 7 of two blocks, the last one padded (276 and 236 rows: 6's last 128-row
    chunk holds only padding)."""
    ids = np.zeros((T, 2), np.int32)
    for q in range(4):
        ids[GROUP_TOKENS * q:GROUP_TOKENS * (q + 1)] = (2 * q, 2 * q + 1)
    if case == "padded":
        g2 = slice(2 * GROUP_TOKENS, 3 * GROUP_TOKENS)
        ids[g2, 0] = 4
        ids[g2, 1] = np.where(np.arange(GROUP_TOKENS) < 276, 6, 7)
    return ids


def _run(case, lnc, clamp_limits=None):
    kernel, ref = moe_case(T, E, H, I, _routing(case), seed=311, block_size=B, checkpoints=CHECKPOINTS,
                           clamp_limits=clamp_limits)
    res = run_kernel(kernel_module.moe_backward_mxfp8_nki.fn, kwargs=kernel, lnc=lnc, grid_ndim=1, trace=True)
    assert_outputs_identical(tuple(np.asarray(o) for o in res.outputs), moe_backward_reference(**ref),
                             f"dY staging ({case}), LNC{lnc} vs mx_exact")
    return res.trace


def _dy_gathers(trace, program):
    """Per segment between `program`'s core barriers: [(token groups read, names written)] of its indirect DMAs that
    read output_grad (dY [T, H] bf16: a row's group is its token // GROUP_TOKENS)."""
    segments = [[]]
    for r in trace:
        if r.program != program:
            continue
        if r.instr == "core_barrier":
            segments.append([])
            continue
        dy = [t for t in r.reads if getattr(t, "name", "") == "output_grad"]
        if dy and r.attrs.get("indirect"):
            groups = {t.byte_lo // (H * 2) // GROUP_TOKENS for t in dy} | \
                {(t.byte_hi - 1) // (H * 2) // GROUP_TOKENS for t in dy}
            segments[-1].append((groups, {getattr(t, "name", "") for t in r.writes}))
    return segments


def _groups_per_segment(segments):
    return [set().union(*(g for g, _ in seg)) if seg else set() for seg in segments]


@pytest.mark.parametrize("lnc", [1, 2])
@pytest.mark.parametrize("case", ["full", "padded"])
def test_dy_staging_bit_exact(case, lnc):
    _run(case, lnc)


def test_dy_gathered_a_fence_ahead():
    """LNC2, "full": segment 0 (before the first barrier) runs A of group 0, segment 1 A of group 1 with B and C of
    group 0, and so on. Group 2's dY rows are gathered in segment 1 and group 3's in segment 2, into dy_blocks by
    HBM -> HBM copies; groups 0 and 1 (whose A runs before a staging segment exists) are gathered by their A into SBUF
    as before (fails on main: [{0}, {1}, {2}, {3}, set()], every gather into SBUF)."""
    trace = _run("full", 2)
    for p in range(2):
        segments = _dy_gathers(trace, p)
        assert _groups_per_segment(segments) == [{0}, {1, 2}, {3}, set(), set()], (p, segments)
        for seg in segments:
            for groups, written in seg:
                if groups <= {2, 3}:
                    assert written == {"moe_bwd_dy_blocks"}, (p, groups, written)
                else:
                    assert "moe_bwd_dy_blocks" not in written, (p, groups, written)


def test_staging_off_is_main(monkeypatch):
    """STAGE_DY_A_FENCE_AHEAD = False gives main's order: each group's dY gathered in its own A's segment."""
    monkeypatch.setattr(kernel_module, "STAGE_DY_A_FENCE_AHEAD", False)
    trace = _run("full", 2)
    for p in range(2):
        assert _groups_per_segment(_dy_gathers(trace, p)) == [{0}, {1}, {2}, {3}, set()], p


def test_clamped_epilogue_not_staged():
    """GPT-OSS-20B's clamped epilogue (its d_gate products on VectorE, not GpSimd) keeps main's gathers, bit-exact."""
    trace = _run("full", 2, clamp_limits=CLAMPS)
    for p in range(2):
        assert _groups_per_segment(_dy_gathers(trace, p)) == [{0}, {1}, {2}, {3}, set()], p
