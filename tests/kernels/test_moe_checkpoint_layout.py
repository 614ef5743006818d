"""Checkpoints in block-position order (checkpoint_layout="block"; docs/moe.md sections 6 and 10, round 11b).

The default layout is the forward's [T, k, I], one row per routed pair, which pass A gathers by slot (one
software-DGE descriptor per row on GpSimd; under the I split of one-block experts both cores gather every row's I_c
columns). With checkpoint_layout="block" the caller passes [N*B, I], row p being the pair at block position p
(reference.checkpoints_to_blocks: zero at padding positions and in unused blocks), and pass A reads a chunk's rows by
one plain DMA. The bits do not change: the outputs equal mx_exact (computed from the slot layout) and the slot
layout's outputs, LNC1 and LNC2 (the race detector on under LNC2).

| test                                  | what                                                            | fixed      |
|---------------------------------------|-----------------------------------------------------------------|------------|
| test_block_layout_i_split             | no resident budget, B = 256, k = 1: one full block, one padded  | LNC1, LNC2 |
|                                       | block, two blocks (all I split under LNC2, gathered / staged),  |            |
|                                       | none; no indirect DMA reads a checkpoint, the slot layout's do; |            |
|                                       | the I split reads them after its W_down loads (LNC2)            |            |
| test_block_layout_pipeline            | resident weights, B = 512, k = 2, clamps: pass A's pipeline     | LNC2       |
|                                       | (block i + 1's first chunk read a block ahead), a padded last   |            |
|                                       | block, an empty expert, two checkpoints (recompute of up)       |            |
| test_checkpoints_to_blocks            | the reference's converter: rows by position, +0 at padding      | host side  |
| test_block_layout_bad_shape_and_value | a [T, k, I] checkpoint with "block", an unknown layout:         | LNC1       |
|                                       | errors naming the argument and the layout                       |            |
"""
from __future__ import annotations

import numpy as np
import pytest

from nkilib.experimental.moe_mxfp8 import moe_bwd_mxfp8_kernel as kernel_module
from nkilib.experimental.moe_mxfp8.reference import checkpoints_to_blocks, moe_backward_reference
from nkilib.experimental.moe_mxfp8.routing import build_block_layout
from nkilib.simulator.launcher import run_kernel
from simkit import BF16, assert_outputs_identical, simulate
from test_moe_bwd_kernel import CLAMPS, moe_case, routing
from test_moe_i_split import CHECKPOINTS, i_split_case



def _blocked(kernel, ref, names):
    """The kernel kwargs with the named checkpoints converted to the block layout."""
    out = dict(kernel, checkpoint_layout="block")
    for n in names:
        out[n] = checkpoints_to_blocks(kernel[n], ref["layout"])
    return out


def _run(kernel_kwargs, lnc):
    res = run_kernel(kernel_module.moe_backward_mxfp8_nki.fn, kwargs=kernel_kwargs, lnc=lnc, grid_ndim=1, trace=True)
    return tuple(np.asarray(o) for o in res.outputs), res.trace


def _checkpoint_reads(trace, names):
    """(indirect, plain) DMA records reading one of the named checkpoints, all programs."""
    reads = [r for r in trace if r.instr.startswith("dma") and any(getattr(o, "name", "") in names for o in r.reads)]
    return [r for r in reads if r.attrs.get("indirect")], [r for r in reads if not r.attrs.get("indirect")]


@pytest.mark.parametrize("lnc", [1, 2])
def test_block_layout_i_split(monkeypatch, lnc):
    """test_moe_i_split's routing (T = 912, experts of 256 / 100 / 300 / 0 / 256 pairs at B = 256, H = 1024, I = 544,
    fence groups [0, 1], [2, 3], [4]; under LNC2 every used expert takes the I split (round 14d; experts 0 and 4 before
    it), the full blocks of experts 2 and 4 have their dY / X staged a fence ahead) with all four checkpoints in the
    block layout: == mx_exact and == the slot layout's outputs bit for bit; every checkpoint read is a plain DMA (the
    slot layout's are all indirect); under LNC2 the I split's first checkpoint read follows its first W_down load in
    program order (read at the first epilogue). Fails on the old code (no checkpoint_layout argument; a kernel that
    gathered the block layout by slot would read rows past the padding) and without the deferred read (checkpoints
    first: trace positions 330 against W_down's 354)."""
    kernel, ref = i_split_case(monkeypatch)
    slot_out, slot_trace = _run(kernel, lnc)
    out, trace = _run(_blocked(kernel, ref, CHECKPOINTS), lnc)
    assert_outputs_identical(out, moe_backward_reference(**ref), f"LNC{lnc} block-layout checkpoints vs mx_exact")
    assert_outputs_identical(out, slot_out, f"LNC{lnc} block vs slot layout")
    indirect, plain = _checkpoint_reads(trace, CHECKPOINTS)
    assert not indirect and plain, (len(indirect), len(plain))
    slot_indirect, slot_plain = _checkpoint_reads(slot_trace, CHECKPOINTS)
    assert slot_indirect and not slot_plain, (len(slot_indirect), len(slot_plain))
    # every read is a chunk's rows of one block (at most 128 rows): no DMA reaches past a chunk
    assert all(r.writes[0].partition_hi - r.writes[0].partition_lo <= 128 for r in plain)
    if lnc == 2:  # the I split (expert 0 first) reads its checkpoints after its W_down loads are queued
        seq = [r for r in trace if r.program == 0]

        def first_read(names):
            return min(n for n, r in enumerate(seq) if r.instr.startswith("dma")
                       and any(getattr(o, "name", "") in names for o in r.reads))
        assert first_read(CHECKPOINTS) > first_read(("down_weight",)), (first_read(CHECKPOINTS),
                                                                        first_read(("down_weight",)))


def test_block_layout_pipeline():
    """The resident path's chunk pipeline (test_moe_pass_a_pipeline's routing: expert 0 two full blocks of 512,
    expert 1 a full and a padded block, expert 2 one padded block, expert 3 none; k = 2, clamps) with gate_pre and
    gate_act in the block layout (up recomputed, intermediate from the phase-0 formula): LNC2 == mx_exact, == the
    slot layout, and no indirect checkpoint read."""
    T, E, H, I, B = 1024, 4, 64, 96, 512
    ids = np.zeros((T, 2), np.int32)
    ids[:700, 1], ids[700:, 1] = 1, 2
    given = ("gate_pre", "gate_act")
    kernel, ref = moe_case(T, E, H, I, ids, seed=41, block_size=B, checkpoints=given, clamp_limits=CLAMPS)
    slot_out, _ = _run(kernel, 2)
    out, trace = _run(_blocked(kernel, ref, given), 2)
    assert_outputs_identical(out, moe_backward_reference(**ref), "LNC2 pipeline, block layout vs mx_exact")
    assert_outputs_identical(out, slot_out, "LNC2 pipeline, block vs slot layout")
    indirect, plain = _checkpoint_reads(trace, given)
    assert not indirect and plain, (len(indirect), len(plain))


def test_checkpoints_to_blocks():
    """Row p of the block layout is the slot layout's row of position p's pair; padding and unused blocks are +0."""
    T, E, k, I, B = 37, 4, 2, 8, 128
    ids = routing("empty_experts", T, E, k, seed=3)
    layout = build_block_layout(ids, E, B, capacity=5)
    ck = (np.random.default_rng(1).standard_normal((T, k, I)) - 5).astype(BF16)  # no zero entry
    blocks = checkpoints_to_blocks(ck, layout)
    assert blocks.shape == (5 * B, I) and blocks.dtype == ck.dtype
    slots = layout.token_position_to_slot
    real = slots < T * k
    assert np.array_equal(blocks[real].view(np.uint16), ck.reshape(T * k, I)[slots[real]].view(np.uint16))
    assert not blocks[~real].view(np.uint16).any() and (~real).sum() > B  # +0 bits; an unused block among them
    assert checkpoints_to_blocks(None, layout) is None


@pytest.mark.parametrize("change, match", [
    (dict(checkpoint_layout="block"),
     r"gate_pre \(checkpoint_layout='block': \[N\*B, I\] by block position\) must have shape \[256, 64\], "
     r"got \[8, 2, 64\]"),
    (dict(checkpoint_layout="token"), r"checkpoint_layout must be one of \['slot', 'block'\], got 'token'"),
])
def test_block_layout_bad_shape_and_value(change, match):
    kernel, _ = moe_case(8, 2, 64, 64, routing("random", 8, 2, 2, seed=1), seed=1, checkpoints=("gate_pre",))
    kernel.update(change)
    with pytest.raises(AssertionError, match=match):
        simulate(kernel_module.moe_backward_mxfp8_nki, 1, **kernel)
