"""Pass B's chunk panels built once per expert where W_gu runs in resident tile groups (moe_bwd_mxfp8_dx.ChunkPanels;
docs/moe.md section 10, round 22c).

Where W_gu does not stay resident whole (the DeepSeek-V3 rank's; here forced by a zero resident budget) an expert of two
or more blocks runs pass B's block loop once per resident group of W_gu's H tiles. Under the I split (LNC2) pass A makes
no d_gate_up panels, so pass B built every 128-row chunk's K=2I panel from the bf16 rows (transposes and quantize_mx)
in every group; now the first group stores each panel to this core's range of an HBM scratch and the later groups load
it (LNC1 too: there pass A runs per group of W_down's I tiles and stores no multi-block expert's panels). The outputs
stay mx_exact's bit for bit, LNC1 and LNC2 (under the race detector).

| test                              | what                                                          | fixed      |
|-----------------------------------|---------------------------------------------------------------|------------|
| test_chunk_panels_built_once      | experts of 3 (last block padded), 1, 2 (padded) and 1 padded  | LNC1, LNC2 |
|                                   | blocks: bit-exact; per core each multi-block expert's chunk    |            |
|                                   | panels built and stored once, loaded by the later groups      |            |
| test_chunk_panels_apply           | only with more than one W_gu group, MXFP8, 128-row chunks     | host side  |
"""
from __future__ import annotations

import numpy as np
import pytest

import nki.language as nl
from nkilib.core.matmul import CoreSplit, MatmulSetup
from nkilib.experimental.moe_mxfp8 import moe_bwd_mxfp8_dx as D
from nkilib.experimental.moe_mxfp8.reference import moe_backward_reference
from moekit import expert_routing
from simkit import assert_outputs_identical, spy
from test_moe_bwd_kernel import moe_case, run

CHECKPOINTS = ("gate_pre", "gate_act", "up", "intermediate")


@pytest.mark.parametrize("lnc", [1, 2])
def test_chunk_panels_built_once(monkeypatch, lnc):
    """A resident budget of one H tile of W_gu (8 KiB: the groups take pass B's chunk-by-chunk path, whose padding-only
    chunks are skipped, as on the DeepSeek-V3 rank; W_down is not resident either, so LNC2 takes the I split), B = 256
    (two 128-row chunks), k = 1, H = 2048 (under LNC2 two 512-column H tiles per core: two W_gu groups; LNC1 four),
    I = 544. Experts of 600 (blocks of
    256, 256 and 88 pairs: 5 chunks with a routed pair), 256, 300 (256 + 44: 3 chunks) and 100 pairs. Each core builds
    the 8 chunk panels of experts 0 and 2 once (stored by the first group, loaded by the later ones) where the old code
    built them once per group (fails on it); a load that read another chunk's panel, or one never stored, breaks the
    bit-exact check (the simulator fails an unwritten read)."""
    monkeypatch.setattr(D, "RESIDENT_WEIGHT_BUDGET_BYTES", 8192)
    T, E, H, I, B = 1256, 4, 2048, 544, 256
    ids = expert_routing([600, 256, 300, 100], shuffle_seed=41)
    kernel, ref = moe_case(T, E, H, I, ids, seed=43, block_size=B, checkpoints=CHECKPOINTS)
    assert np.diff(kernel["expert_block_offsets"]).tolist() == [3, 1, 2, 1]
    built = spy(monkeypatch, D, "panel_from_rows", lambda rows, f_size, k_size, f_pad, setup: k_size)
    stored = spy(monkeypatch, D.ChunkPanels, "store", lambda self, panel, i, r0: (self.ctx.split.shard_id, r0))
    loaded = spy(monkeypatch, D.ChunkPanels, "load", lambda self, i, r0, m: (self.ctx.split.shard_id, r0))
    out = run(kernel, lnc=lnc)
    assert_outputs_identical(out, moe_backward_reference(**ref), f"LNC{lnc}: chunk panels built once vs mx_exact")
    # per core (each traces the kernel): expert 0's chunks 0, 128 of two full blocks and chunk 0 of its last (chunk
    # 128 holds padding only: skipped), expert 2's chunks 0, 128 and chunk 0 of its last, each stored by the first
    # group and loaded by each later one (LNC1: four H tiles, four groups; LNC2: two per core)
    expert0, expert2, later = [0, 128, 0, 128, 0], [0, 128, 0], 4 // lnc - 1
    for core in range(lnc):
        assert [r0 for c, r0 in stored if c == core] == expert0 + expert2, stored
        assert [r0 for c, r0 in loaded if c == core] == expert0 * later + expert2 * later, loaded
    # LNC1: pass A stored the one-block experts' panels (ctx.d_gu_mx); LNC2: the I split stores none, so pass B builds
    # the one-block experts' 2 + 2 panels (once each: weights per block, no group, every chunk) beside the 8 above
    assert len(built) == (8 if lnc == 1 else 2 * 12) and set(built) == {2 * I}, (len(built), set(built))


class _Ctx:
    def __init__(self, cores, B, precision="mxfp8"):
        self.split, self.B = CoreSplit(cores, 0), B
        self.setup = MatmulSetup(precision, nl.float8_e4m3fn_x4, "1x32", True)
        self.split_panels = None  # the I split's pass A stores no panels of pass B (SplitChunkPanels)


def test_chunk_panels_apply():
    """Only with W_gu in more than one resident group, MXFP8 and 128-row chunks, where the I split's pass A stored no
    panels of pass B (SplitChunkPanels, round 25a)."""
    groups = [[(0, 512)], [(512, 512)]]
    assert D.ChunkPanels.applies(_Ctx(2, 512), groups)
    assert not D.ChunkPanels.applies(_Ctx(2, 512), None)  # W_gu resident whole (GPT-OSS-20B, Qwen3)
    assert not D.ChunkPanels.applies(_Ctx(2, 512), groups[:1])
    assert not D.ChunkPanels.applies(_Ctx(2, 512, precision="bf16"), groups)
    split = _Ctx(2, 512)
    split.split_panels = object()
    assert not D.ChunkPanels.applies(split, groups)
    assert not D.ChunkPanels.applies(_Ctx(2, 192), groups)
