"""Pass A split along I for experts of one full block under LNC2 (moe_bwd_mxfp8_i_split.py; docs/moe.md sections 5 and
10, round 9b).

Where W_down is loaded on use (the DeepSeek-V3 rank's path; here forced by a zero resident budget), an expert of one
full block has each core compute dI for its I tiles over all rows of the block, from its own W_down columns loaded and
quantized on chip: no W_down exchange for it. The routing-weight gradient's per-tile sums meet in HBM scratch and are
folded in tile order after the fence. Experts of more blocks and one-block experts holding padding keep the row split
and the exchange. The outputs stay mx_exact's bit for bit, LNC1 (no split) and LNC2 (under the race detector).

| test                   | what                                                                        | fixed      |
|------------------------|-----------------------------------------------------------------------------|------------|
| test_i_split_bit_exact | experts: one full block (two, one in an exchanged group), one padded block, | LNC1, LNC2 |
|                        | two blocks, none; the I split runs for the full ones only, and the exchange |            |
|                        | is neither quantized nor read for them                                      |            |
| test_i_split_recompute | gate_pre / up not given (recomputed from X over each core's I tiles), X     | LNC2       |
|                        | gathered (first fence group) and staged (second)                            |            |
| test_i_split_padded_block_skips_padding_chunks | one-block experts holding padding split too (round 14d): | LNC1, LNC2 |
|                        | chunks of padding only skipped and zeroed, slot and block checkpoints       |            |
| test_i_split_applies   | LNC1, resident W_down, BF16, 64 rows per core or one I tile: no split       | host side  |
"""
from __future__ import annotations

import numpy as np
import pytest

import nki.language as nl
from nkilib.core.matmul import CoreSplit, MatmulSetup
from nkilib.experimental.moe_mxfp8 import moe_bwd_mxfp8_dx as D
from nkilib.experimental.moe_mxfp8 import moe_bwd_mxfp8_i_split as S
from nkilib.experimental.moe_mxfp8.reference import checkpoints_to_blocks, moe_backward_reference
from simkit import assert_outputs_identical
from test_moe_bwd_kernel import moe_case, run
from test_moe_down_exchange import record_exchange

CHECKPOINTS = ("gate_pre", "gate_act", "up", "intermediate")


def _record(monkeypatch):
    """Lists of (expert, j_lo, j_hi) the I split ran for, (expert, t_lo, t_hi) quantized by the exchange, scratch
    names pass A loaded in the panel layout and the cores that staged a block's rows."""
    split, staged = [], []
    block, stage = S.SingleBlockISplit.block, S.SingleBlockISplit.stage

    def record_stage(self, i):
        staged.append(self.ctx.split.shard_id)
        return stage(self, i)

    def record_block(self, e, i, descs, full=True):
        split.append((e, self.j_lo, self.j_hi))
        return block(self, e, i, descs, full)

    monkeypatch.setattr(S.SingleBlockISplit, "block", record_block)
    monkeypatch.setattr(S.SingleBlockISplit, "stage", record_stage)
    quantized, loaded = record_exchange(monkeypatch)
    return split, quantized, loaded, staged


def i_split_case(monkeypatch):
    """(kernel kwargs, reference kwargs) of test_i_split_bit_exact's routing: no resident budget, T = 912, B = 256,
    k = 1, H = 1024, I = 544, all four checkpoints; experts of 256 / 100 / 300 / 0 / 256 pairs (blocks 1, 1, 2, 0, 1)."""
    monkeypatch.setattr(D, "RESIDENT_WEIGHT_BUDGET_BYTES", 0)
    T, E, H, I, B = 912, 5, 1024, 544, 256
    ids = np.repeat(np.array([[0], [1], [2], [4]], np.int32), [256, 100, 300, 256], axis=0)
    ids = ids[np.random.default_rng(23).permutation(T)]
    kernel, ref = moe_case(T, E, H, I, ids, seed=71, block_size=B, checkpoints=CHECKPOINTS)
    assert np.diff(kernel["expert_block_offsets"]).tolist() == [1, 1, 2, 0, 1]
    return kernel, ref


@pytest.mark.parametrize("lnc", [1, 2])
def test_i_split_bit_exact(monkeypatch, lnc):
    """No resident budget, B = 256, k = 1, H = 1024 (two MX K tiles), I = 544 (I tiles of 512 and 32: core 0 takes the
    first, core 1 the 32-column one). Experts of 256 (one full block), 100 (one block, its second chunk padding only),
    300 (two blocks), 0 and 256 pairs, fence groups [0, 1], [2, 3], [4]. Under LNC2 experts 0 and 4 run the I split
    (expert 4 is in an exchanged group but is neither quantized nor read from the exchange's scratch; its dY / X rows
    are staged to the block-ordered scratch a fence ahead, expert 0's are gathered in pass A), experts 1 and 2 the row
    split (2 with the exchange); under LNC1 nothing is split along I. Fails on the old code (no I split: expert 4's
    W_down is exchanged)."""
    kernel, ref = i_split_case(monkeypatch)
    split, quantized, loaded, staged = _record(monkeypatch)
    out = run(kernel, lnc=lnc)
    assert_outputs_identical(out, moe_backward_reference(**ref), f"LNC{lnc} I split vs mx_exact")
    if lnc == 1:
        assert split == [] and quantized == [] and loaded == [] and staged == []
        return
    # each core traces the kernel: the one-block experts' bodies (full and padded: round 14d), core 0 with I tile 0,
    # core 1 with tile 1
    assert sorted(split) == [(0, 0, 1), (0, 1, 2), (1, 0, 1), (1, 1, 2), (4, 0, 1), (4, 1, 2)], split
    # the exchange quantizes expert 2 (two blocks) on each core, not expert 4 (its padded-block branch does not run),
    # and pass A reads only expert 2's scratch (expert 4's panel-layout loads are gone)
    assert [e for e, _, _ in quantized] == [2, 2], quantized
    assert set(loaded) == {"moe_bwd_down_mx_2"}, loaded
    assert sorted(staged) == [0, 1], staged  # expert 4's block, once per core (its own chunks)


def test_i_split_recompute(monkeypatch):
    """gate_pre and up not given: each core recomputes them for its I tiles over all rows (expert 0: X gathered for
    every chunk, its block-ordered copy written by one core per chunk; expert 2, in the second fence group: X staged
    and read back); LNC2 bit-exact, with a padded one-block expert between them."""
    monkeypatch.setattr(D, "RESIDENT_WEIGHT_BUDGET_BYTES", 0)
    T, E, H, I, B = 612, 3, 1024, 544, 256
    ids = np.repeat(np.array([[0], [1], [2]], np.int32), [256, 100, 256], axis=0)
    ids = ids[np.random.default_rng(5).permutation(T)]
    kernel, ref = moe_case(T, E, H, I, ids, seed=13, block_size=B, checkpoints=("gate_act",))
    split, _, _, staged = _record(monkeypatch)
    out = run(kernel, lnc=2)
    assert_outputs_identical(out, moe_backward_reference(**ref), "LNC2 I split with recompute vs mx_exact")
    assert sorted({e for e, _, _ in split}) == [0, 1, 2] and sorted(staged) == [0, 1], (split, staged)


@pytest.mark.parametrize("lnc,layout", [(1, "slot"), (2, "slot"), (2, "block")])
def test_i_split_padded_block_skips_padding_chunks(monkeypatch, lnc, layout):
    """Round 14d: a one-block expert holding padding takes the I split too, its 128-row chunks one by one, a chunk of
    padding only skipped (its scratch rows zeroed, zero_chunk) on both cores. B = 512 (four chunks), experts of 300
    (chunks 0-2 computed, chunk 2 partly padding; chunk 3 skipped), 512 (full), 130 (chunk 1 holds two pairs; chunks
    2-3 skipped) and 600 pairs (two blocks: the row split and the exchange), fence groups [0, 1], [2, 3]; all four
    checkpoints in the slot and the block layout. Bit-exact against mx_exact (LNC2 under the race detector); fails on
    the old code (padded experts took the row split: no chunk calls for experts 0 and 2) and on a zero_chunk that
    leaves the skipped rows unwritten (pass C reads them)."""
    monkeypatch.setattr(D, "RESIDENT_WEIGHT_BUDGET_BYTES", 0)
    T, E, H, I, B = 1542, 4, 1024, 544, 512
    ids = np.repeat(np.array([[0], [1], [2], [3]], np.int32), [300, 512, 130, 600], axis=0)
    ids = ids[np.random.default_rng(31).permutation(T)]
    kernel, ref = moe_case(T, E, H, I, ids, seed=37, block_size=B, checkpoints=CHECKPOINTS)
    assert np.diff(kernel["expert_block_offsets"]).tolist() == [1, 1, 1, 2]
    if layout == "block":
        kernel = dict(kernel, checkpoint_layout="block")
        for n in CHECKPOINTS:
            kernel[n] = checkpoints_to_blocks(kernel[n], ref["layout"])
    chunks, zeroed = [], []
    compute, zero = S.compute_phase1_chunks_mxfp8, S.SingleBlockISplit.zero_chunk

    def record_compute(ctx, e, i, rows, *args, **kwargs):
        chunks.append((ctx.split.shard_id, e, tuple(r0 for r0, _ in rows)))
        return compute(ctx, e, i, rows, *args, **kwargs)

    def record_zero(self, i, r0, m):
        zeroed.append((self.ctx.split.shard_id, r0))
        return zero(self, i, r0, m)

    monkeypatch.setattr(S, "compute_phase1_chunks_mxfp8", record_compute)
    monkeypatch.setattr(S.SingleBlockISplit, "zero_chunk", record_zero)
    out = run(kernel, lnc=lnc)
    assert_outputs_identical(out, moe_backward_reference(**ref), f"LNC{lnc} {layout}: padded I split vs mx_exact")
    if lnc == 1:
        assert chunks == [] and zeroed == []
        return
    for core in (0, 1):
        assert [(e, r) for c, e, r in chunks if c == core] == [
            (0, (0,)), (0, (128,)), (0, (256,)), (1, (0, 128, 256, 384)), (2, (0,)), (2, (128,))], chunks
        assert [r0 for c, r0 in zeroed if c == core] == [384, 256, 384], zeroed


class _Ctx:
    def __init__(self, cores, B, precision="mxfp8"):
        self.split, self.B = CoreSplit(cores, 0), B
        self.setup = MatmulSetup(precision, nl.float8_e4m3fn_x4, "1x32", True)


def test_i_split_applies():
    """Only under LNC2 with MXFP8, W_down loaded on use, 128-row chunks per core and at least one I tile per core."""
    tiles = [(0, 512), (512, 512), (1024, 512), (1536, 512)]  # the DeepSeek-V3 rank's I = 2048
    assert S.SingleBlockISplit.applies(_Ctx(2, 512), False, tiles)
    assert not S.SingleBlockISplit.applies(_Ctx(2, 512), True, tiles)  # resident W_down (GPT-OSS-20B, Qwen3)
    assert not S.SingleBlockISplit.applies(_Ctx(1, 512), False, tiles)
    assert not S.SingleBlockISplit.applies(_Ctx(2, 512, "bf16"), False, tiles)
    assert not S.SingleBlockISplit.applies(_Ctx(2, 128), False, tiles)  # 64 rows per core
    assert not S.SingleBlockISplit.applies(_Ctx(2, 512), False, tiles[:1])
