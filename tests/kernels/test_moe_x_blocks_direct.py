"""Pass C's block-ordered X copy written HBM -> HBM (docs/moe.md section 10, round 8c): with gate_pre and up given, pass
A needs no X on chip (no recompute), so a full block's X rows go from hidden_states to x_blocks by one indirect DMA per
chunk (the gather by token id straight into the scratch) instead of a gather into SBUF and a copy out, which moved the
same bytes twice through the DMA queues. A block holding padding keeps the SBUF path (its padding rows must be zeros,
and a skipped sentinel would leave its scratch row unwritten). The bytes of x_blocks are the same, so the outputs equal
mx_exact.

| test                                | what                                                               | fixed      |
|-------------------------------------|--------------------------------------------------------------------|------------|
| test_full_blocks_copy_x_directly    | unpipelined (B = 256), pipelined (B = 512) and weights-on-use      | LNC1, LNC2 |
|                                     | (the DeepSeek-V3 rank's path) pass A, every block full: every X    |            |
|                                     | row reaches x_blocks HBM -> HBM, none through SBUF; bit-exact      |            |
| test_padded_blocks_keep_sbuf_path   | random k = 2 routing (padded last blocks): full blocks direct,     | LNC1, LNC2 |
|                                     | padded ones through SBUF; bit-exact                                |            |
| test_recompute_keeps_x_on_chip      | up not given (X recomputes it): no HBM -> HBM copy                 | LNC2       |
"""
from __future__ import annotations

import numpy as np
import pytest

from nkilib.experimental.moe_mxfp8 import moe_bwd_mxfp8_dx as D
from nkilib.experimental.moe_mxfp8 import moe_bwd_mxfp8_kernel as kernel_module
from nkilib.experimental.moe_mxfp8.reference import moe_backward_reference
from nkilib.simulator.launcher import run_kernel
from simkit import assert_outputs_identical
from test_moe_bwd_kernel import moe_case, routing

CHECKPOINTS = ("gate_pre", "gate_act", "up", "intermediate")
X_BLOCKS = "moe_bwd_x_blocks"


def _run(kernel_kwargs, lnc):
    res = run_kernel(kernel_module.moe_backward_mxfp8_nki.fn, kwargs=kernel_kwargs, lnc=lnc, grid_ndim=1, trace=True)
    return tuple(np.asarray(o) for o in res.outputs), res.trace


def _x_writes(trace):
    """(direct, through_sbuf): DMAs writing x_blocks that read hidden_states (HBM -> HBM) / anything else."""
    writes = [r for r in trace if any(getattr(t, "name", "") == X_BLOCKS for t in r.writes)]
    direct = [r for r in writes if any(getattr(t, "name", "") == "hidden_states" for t in r.reads)]
    return direct, [r for r in writes if r not in direct]


def _full_blocks(kernel, B, T):
    used = int(kernel["expert_block_offsets"][-1])
    ids = np.asarray(kernel["token_position_to_id"]).reshape(-1, B)[:used]
    return int((ids < T).all(axis=1).sum()), used


@pytest.mark.parametrize("lnc", [1, 2])
@pytest.mark.parametrize("path", ["unpipelined", "pipelined", "on_use"])
def test_full_blocks_copy_x_directly(monkeypatch, lnc, path):
    """k = 1, every expert's pairs a multiple of B (all blocks full): every chunk's X rows go HBM -> HBM once (one
    DMA of 128 rows per chunk, the cores' chunks disjoint), and no x_blocks row is written from SBUF. unpipelined:
    B = 256 (LNC2: one chunk per core, an odd count: no pipeline); pipelined: B = 512; on_use: no resident budget
    (weights loaded per block, B = 256, H = 1024 so that I = 544 splits into resident groups)."""
    B = 512 if path == "pipelined" else 256
    T, E, H, I = 4 * B, 3, (1024 if path == "on_use" else 128), (544 if path == "on_use" else 96)
    if path == "on_use":
        monkeypatch.setattr(D, "RESIDENT_WEIGHT_BUDGET_BYTES", 0)
    ids = np.repeat(np.array([[0], [2]], np.int32), [B, 3 * B], axis=0)  # expert 0 one block, 2 three, 1 none
    ids = ids[np.random.default_rng(53).permutation(T)]
    kernel, ref = moe_case(T, E, H, I, ids, seed=59, block_size=B, checkpoints=CHECKPOINTS)
    full, used = _full_blocks(kernel, B, T)
    assert full == used == 4, (full, used)
    out, trace = _run(kernel, lnc)
    assert_outputs_identical(out, moe_backward_reference(**ref), f"{path} X copied HBM -> HBM, LNC{lnc} vs mx_exact")
    direct, through_sbuf = _x_writes(trace)
    assert not through_sbuf, [(r.instr, [getattr(t, "name", "") for t in r.reads]) for r in through_sbuf][:4]
    assert len(direct) == used * (B // 128), (len(direct), used)
    for p in range(lnc):  # each core its own chunks
        assert len([r for r in direct if r.program == p]) == used * (B // 128) // lnc, p


@pytest.mark.parametrize("lnc", [1, 2])
def test_padded_blocks_keep_sbuf_path(lnc):
    """T = 600, k = 2, E = 3, B = 256 (random routing, ~400 pairs per expert: a full and a padded block each): the full blocks' chunks go HBM -> HBM,
    the padded blocks' through SBUF (their padding rows zeros), and the outputs equal mx_exact."""
    T, E, k, H, I, B = 600, 3, 2, 128, 96, 256
    kernel, ref = moe_case(T, E, H, I, routing("random", T, E, k, seed=3), seed=23, block_size=B,
                           checkpoints=CHECKPOINTS)
    full, used = _full_blocks(kernel, B, T)
    assert 0 < full < used, (full, used)
    out, trace = _run(kernel, lnc)
    assert_outputs_identical(out, moe_backward_reference(**ref), f"padded blocks, LNC{lnc} vs mx_exact")
    direct, through_sbuf = _x_writes(trace)
    assert len(direct) == full * (B // 128), (len(direct), full)
    assert through_sbuf


def test_recompute_keeps_x_on_chip():
    """up recomputed from X (K = H): X is needed on chip, so its rows are gathered into SBUF and copied out as before."""
    T, E, k, H, I, B = 512, 2, 1, 128, 96, 256
    ids = np.repeat(np.array([[0], [1]], np.int32), [256, 256], axis=0)
    kernel, ref = moe_case(T, E, H, I, ids, seed=31, block_size=B, checkpoints=("gate_pre",))
    out, trace = _run(kernel, 2)
    assert_outputs_identical(out, moe_backward_reference(**ref), "recompute, LNC2 vs mx_exact")
    direct, through_sbuf = _x_writes(trace)
    assert not direct and through_sbuf, (len(direct), len(through_sbuf))
