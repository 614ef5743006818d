"""Pass A split along I under LNC2 (moe_bwd_mxfp8_i_split.py; docs/moe.md sections 5 and 10, rounds 9b and 14d).

Where W_down is loaded on use (the DeepSeek-V3 rank's path; here forced by a zero resident budget), every expert has
each core compute dI for its I tiles over all rows of each of its blocks, from its own W_down columns loaded and
quantized on chip once per expert: no W_down exchange. The routing-weight gradient's per-tile sums meet in HBM scratch
and are folded in tile order after the fence. A block holding padding computes its chunks one by one and skips those of
padding only (zero scratch rows instead). The outputs stay mx_exact's bit for bit, LNC1 (no split) and LNC2 (under the
race detector).

| test                   | what                                                                        | fixed      |
|------------------------|-----------------------------------------------------------------------------|------------|
| test_i_split_bit_exact | experts: one full block (two, one in an exchanged group), one padded block, | LNC1, LNC2 |
|                        | two blocks, none; every used expert split, the exchange neither quantized   |            |
|                        | nor read, full blocks of the second group staged                            |            |
| test_i_split_recompute | gate_pre / up not given (recomputed from X over each core's I tiles), X     | LNC2       |
|                        | gathered (first fence group) and staged (second)                            |            |
| test_i_split_padded_   | padded one-block experts and a two-block one: chunks of padding only        | LNC1, LNC2 |
|   block_skips_padding_ | skipped and zeroed, slot and block checkpoints (round 14d)                  |            |
|   chunks               |                                                                             |            |
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
from moekit import expert_routing
from simkit import assert_outputs_identical, spy
from test_moe_bwd_kernel import moe_case, run
from test_moe_down_exchange import record_exchange

CHECKPOINTS = ("gate_pre", "gate_act", "up", "intermediate")


def _record(monkeypatch):
    """Lists of (expert, j_lo, j_hi) the I split ran for, (expert, t_lo, t_hi) quantized by the exchange, scratch
    names pass A loaded in the panel layout and the cores that staged a block's rows."""
    split = spy(monkeypatch, S.ExpertISplit, "expert", lambda self, e, descs, *args: (e, self.j_lo, self.j_hi))
    staged = spy(monkeypatch, S.ExpertISplit, "stage", lambda self, i: self.ctx.split.shard_id)
    quantized, loaded = record_exchange(monkeypatch)
    return split, quantized, loaded, staged


def i_split_case(monkeypatch, last_pairs=256, permutation_seed=23, data_seed=71):
    """(kernel kwargs, reference kwargs) of test_i_split_bit_exact's routing: no resident budget, B = 256, k = 1,
    H = 1024, I = 544, all four checkpoints; experts of 256 / 100 / 300 / 0 / last_pairs pairs (blocks 1, 1, 2, 0, 1;
    last_pairs <= 256, T = 656 + last_pairs: 912 by default, a full last block)."""
    monkeypatch.setattr(D, "RESIDENT_WEIGHT_BUDGET_BYTES", 0)
    T, E, H, I, B = 656 + last_pairs, 5, 1024, 544, 256
    ids = expert_routing([256, 100, 300, last_pairs], experts=[0, 1, 2, 4], shuffle_seed=permutation_seed)
    kernel, ref = moe_case(T, E, H, I, ids, seed=data_seed, block_size=B, checkpoints=CHECKPOINTS)
    assert np.diff(kernel["expert_block_offsets"]).tolist() == [1, 1, 2, 0, 1]
    return kernel, ref


@pytest.mark.parametrize("lnc", [1, 2])
def test_i_split_bit_exact(monkeypatch, lnc):
    """No resident budget, B = 256, k = 1, H = 1024 (two MX K tiles), I = 544 (I tiles of 512 and 32: core 0 takes the
    first, core 1 the 32-column one). Experts of 256 (one full block), 100 (one block, its second chunk padding only),
    300 (two blocks), 0 and 256 pairs, fence groups [0, 1], [2, 3], [4]. Under LNC2 every used expert runs the I split
    (round 14d; round 9b split experts 0 and 4 only and exchanged expert 2's W_down); the full blocks of the second and
    third groups' experts (expert 2's first, expert 4's) have their dY / X rows staged to the block-ordered scratch a
    fence ahead, the others' are gathered in pass A; under LNC1 nothing is split along I. Fails on the old code
    (expert 2 took the row split and the exchange)."""
    kernel, ref = i_split_case(monkeypatch)
    split, quantized, loaded, staged = _record(monkeypatch)
    out = run(kernel, lnc=lnc)
    assert_outputs_identical(out, moe_backward_reference(**ref), f"LNC{lnc} I split vs mx_exact")
    if lnc == 1:
        assert split == [] and quantized == [] and loaded == [] and staged == []
        return
    # each core traces the kernel: every used expert's pass A (one full block, one padded, two blocks: round 14d), core
    # 0 with I tile 0, core 1 with tile 1
    assert sorted(split) == [(0, 0, 1), (0, 1, 2), (1, 0, 1), (1, 1, 2), (2, 0, 1), (2, 1, 2), (4, 0, 1),
                             (4, 1, 2)], split
    # no exchange: nothing quantized into its scratch, nothing loaded from it (round 9b kept it for expert 2)
    assert quantized == [] and loaded == [], (quantized, loaded)
    # the full blocks of the exchanged group's experts, once per core (its own chunks): expert 2's first block (its
    # second holds padding: gathered in pass A) and expert 4's
    assert sorted(staged) == [0, 0, 1, 1], staged


def test_i_split_recompute(monkeypatch):
    """gate_pre and up not given: each core recomputes them for its I tiles over all rows (expert 0: X gathered for
    every chunk, its block-ordered copy written by one core per chunk; expert 2, in the second fence group: X staged
    and read back); LNC2 bit-exact, with a padded one-block expert between them."""
    monkeypatch.setattr(D, "RESIDENT_WEIGHT_BUDGET_BYTES", 0)
    T, E, H, I, B = 612, 3, 1024, 544, 256
    ids = expert_routing([256, 100, 256], shuffle_seed=5)
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
    2-3 skipped) and 600 pairs (two blocks: the first full and staged, the second padded: chunk 0 computed, 1-3
    skipped), fence groups [0, 1], [2, 3]; all four checkpoints in the slot and the block layout. Bit-exact against
    mx_exact (LNC2 under the race detector); fails on the old code (padded and multi-block experts took the row split:
    no chunk calls for experts 0, 2 and 3) and on a zero_chunk that leaves the skipped rows unwritten (pass C reads
    them)."""
    monkeypatch.setattr(D, "RESIDENT_WEIGHT_BUDGET_BYTES", 0)
    T, E, H, I, B = 1542, 4, 1024, 544, 512
    ids = expert_routing([300, 512, 130, 600], shuffle_seed=31)
    kernel, ref = moe_case(T, E, H, I, ids, seed=37, block_size=B, checkpoints=CHECKPOINTS)
    assert np.diff(kernel["expert_block_offsets"]).tolist() == [1, 1, 1, 2]
    if layout == "block":
        kernel = dict(kernel, checkpoint_layout="block")
        for n in CHECKPOINTS:
            kernel[n] = checkpoints_to_blocks(kernel[n], ref["layout"])
    chunks = spy(monkeypatch, S, "compute_phase1_chunks_mxfp8",
                 lambda ctx, e, i, rows, *args, **kwargs: (ctx.split.shard_id, e, tuple(r0 for r0, _ in rows)))
    zeroed = spy(monkeypatch, S.ExpertISplit, "zero_chunk", lambda self, i, r0, m: (self.ctx.split.shard_id, r0))
    out = run(kernel, lnc=lnc)
    assert_outputs_identical(out, moe_backward_reference(**ref), f"LNC{lnc} {layout}: padded I split vs mx_exact")
    if lnc == 1:
        assert chunks == [] and zeroed == []
        return
    for core in (0, 1):
        assert [(e, r) for c, e, r in chunks if c == core] == [
            (0, (0,)), (0, (128,)), (0, (256,)), (1, (0, 128, 256, 384)), (2, (0,)), (2, (128,)),
            (3, (0, 128, 256, 384)), (3, (0,))], chunks
        assert [r0 for c, r0 in zeroed if c == core] == [384, 256, 384, 128, 256, 384], zeroed


class _Ctx:
    def __init__(self, cores, B, precision="mxfp8"):
        self.split, self.B = CoreSplit(cores, 0), B
        self.setup = MatmulSetup(precision, nl.float8_e4m3fn_x4, "1x32", True)


def test_i_split_applies():
    """Only under LNC2 with MXFP8, W_down loaded on use, 128-row chunks per core and at least one I tile per core."""
    tiles = [(0, 512), (512, 512), (1024, 512), (1536, 512)]  # the DeepSeek-V3 rank's I = 2048
    assert S.ExpertISplit.applies(_Ctx(2, 512), False, tiles)
    assert not S.ExpertISplit.applies(_Ctx(2, 512), True, tiles)  # resident W_down (GPT-OSS-20B, Qwen3)
    assert not S.ExpertISplit.applies(_Ctx(1, 512), False, tiles)
    assert not S.ExpertISplit.applies(_Ctx(2, 512, "bf16"), False, tiles)
    assert not S.ExpertISplit.applies(_Ctx(2, 128), False, tiles)  # 64 rows per core
    assert not S.ExpertISplit.applies(_Ctx(2, 512), False, tiles[:1])
