"""Pass C's block-ordered X copy written HBM -> HBM (docs/moe.md section 10, round 8c): with gate_pre and up given, pass
A needs no X on chip (no recompute), and its chunk pipeline gathers X for x_blocks in a loop of its own
(moe_bwd_mxfp8_deferred.gather_deferred_x); there a full block's X rows go from hidden_states to x_blocks by one indirect DMA per chunk (the
gather by token id straight into the scratch) instead of a gather into SBUF and a copy out, which moved the same bytes
twice through the DMA queues. A chunk holding padding (its padding rows must be zeros, and a skipped sentinel leaves
its scratch row unwritten) has its rows zeroed first by a store from the kernel's zeroed SBUF tile, then gathered HBM ->
HBM the same way (round 38c; before, gathered into an SBUF tile zeroed on GpSimd and copied out: docs/moe.md section
10). Pass A's unpipelined path (the DeepSeek-V3 rank's) keeps the
copy through SBUF: the direct copy there cost the full rank 1.7% (round 8c). The bytes of x_blocks are the same, so
the outputs equal mx_exact.

| test                              | what                                                              | fixed      |
|-----------------------------------|-------------------------------------------------------------------|------------|
| test_pipeline_copies_x_directly   | pipelined pass A, every block full: every X row reaches x_blocks  | LNC1, LNC2 |
|                                   | HBM -> HBM (last blocks too), none through SBUF; bit-exact        |            |
| test_padded_blocks_zeroed_direct  | pipeline, full and padded blocks: every chunk direct, a padded    | LNC1, LNC2 |
|                                   | one after stores of zeros over its 32-row units holding padding   |            |
|                                   | (round 41d; rows of other units not); no gathered SBUF tile       |            |
|                                   | stored; exact                                                     |            |
| test_unpipelined_keeps_sbuf_path  | B = 256 under LNC2, and weights loaded on use: no HBM -> HBM copy | LNC2       |
|                                   | but the I split's staged blocks (round 14d: multi-block experts)  |            |
| test_recompute_keeps_x_on_chip    | up not given (X recomputes it): no HBM -> HBM copy                | LNC2       |
"""
from __future__ import annotations

import numpy as np
import pytest

from nkilib.experimental.moe_mxfp8 import moe_bwd_mxfp8_dx as D
from nkilib.experimental.moe_mxfp8 import moe_bwd_mxfp8_kernel as kernel_module
from nkilib.experimental.moe_mxfp8.reference import moe_backward_reference
from nkilib.simulator.launcher import run_kernel
from moekit import expert_routing
from simkit import assert_outputs_identical
from test_moe_bwd_kernel import moe_case

CHECKPOINTS = ("gate_pre", "gate_act", "up", "intermediate")
X_BLOCKS = "moe_bwd_x_blocks"


def _run(kernel_kwargs, lnc):
    res = run_kernel(kernel_module.moe_backward_mxfp8_nki.fn, kwargs=kernel_kwargs, lnc=lnc, grid_ndim=1, trace=True)
    return tuple(np.asarray(o) for o in res.outputs), res.trace


def _x_writes(trace):
    """(direct, through_sbuf): DMAs writing x_blocks that read hidden_states (HBM -> HBM; an indirect one whose rows
    are all skipped sentinels records no read of it) / anything else."""
    writes = [r for r in trace if any(getattr(t, "name", "") == X_BLOCKS for t in r.writes)]
    direct = [r for r in writes if (r.attrs or {}).get("indirect")
              or any(getattr(t, "name", "") == "hidden_states" for t in r.reads)]
    return direct, [r for r in writes if r not in direct]


def _full_blocks(kernel, B, T):
    used = int(kernel["expert_block_offsets"][-1])
    ids = np.asarray(kernel["token_position_to_id"]).reshape(-1, B)[:used]
    return int((ids < T).all(axis=1).sum()), used


def _balanced_case(B, H=128, I=96, seed=53):
    """k = 1, every expert's pairs a multiple of B (all blocks full): expert 0 one block, expert 2 three, expert 1
    none."""
    T = 4 * B
    ids = expert_routing([B, 3 * B], experts=[0, 2], shuffle_seed=seed)
    kernel, ref = moe_case(T, 3, H, I, ids, seed=59, block_size=B, checkpoints=CHECKPOINTS)
    full, used = _full_blocks(kernel, B, T)
    assert full == used == 4, (full, used)
    return kernel, ref, used


@pytest.mark.parametrize("lnc", [1, 2])
def test_pipeline_copies_x_directly(lnc):
    """B = 512 (the pipeline under LNC1 and LNC2): every chunk's X rows go HBM -> HBM once (one DMA of 128 rows per
    chunk, each core its own chunks), the expert's last block included (its final position tested at run time), and
    no x_blocks row is written from SBUF."""
    B = 512
    kernel, ref, used = _balanced_case(B)
    out, trace = _run(kernel, lnc)
    assert_outputs_identical(out, moe_backward_reference(**ref), f"X copied HBM -> HBM, LNC{lnc} vs mx_exact")
    direct, through_sbuf = _x_writes(trace)
    assert not through_sbuf, [(r.instr, [getattr(t, "name", "") for t in r.reads]) for r in through_sbuf][:4]
    assert len(direct) == used * (B // 128), (len(direct), used)
    for p in range(lnc):
        assert len([r for r in direct if r.program == p]) == used * (B // 128) // lnc, p


@pytest.mark.parametrize("lnc", [1, 2])
def test_padded_blocks_zeroed_direct(lnc):
    """B = 512, k = 2: expert 0 takes every token (two full blocks), expert 1 the first 700 (a full and a padded
    block), expert 2 the other 324 (a padded block), expert 3 none. Every chunk's X rows reach x_blocks HBM -> HBM, the
    padded blocks' chunks too (round 38c); each of those after stores of zeros over its rows in 32-row units that
    hold padding, and no others (round 41d; its padding rows stay zero where the gather skips their sentinels), and no x_blocks row is stored from an SBUF tile that a DMA wrote
    (main gathered a padded chunk into SBUF, zeroed on GpSimd, and copied it out). Outputs equal mx_exact."""
    T, E, H, I, B = 1024, 4, 64, 96, 512
    ids = np.zeros((T, 2), np.int32)
    ids[:700, 1], ids[700:, 1] = 1, 2
    kernel, ref = moe_case(T, E, H, I, ids, seed=23, block_size=B, checkpoints=CHECKPOINTS)
    full, used = _full_blocks(kernel, B, T)
    assert (full, used) == (3, 5), (full, used)
    out, trace = _run(kernel, lnc)
    assert_outputs_identical(out, moe_backward_reference(**ref), f"padded blocks, LNC{lnc} vs mx_exact")
    direct, from_sbuf = _x_writes(trace)
    assert len(direct) > full * (B // 128), (len(direct), full)
    dma_written = {(r.program, t.storage_id) for r in trace if r.engine == "dma" for t in r.writes}
    stored_gathers = [r for r in from_sbuf if any((r.program, t.storage_id) in dma_written for t in r.reads)]
    assert not stored_gathers, [(r.seq, r.instr) for r in stored_gathers][:4]
    # the padded blocks' chunks: gathered over rows that stores of zeros wrote before (same core, program order): since
    # round 41d only the rows of its 32-row units that hold padding (a unit's last position is padding)
    row_bytes = H * 2
    pairs = (np.asarray(kernel["token_position_to_id"]).reshape(-1, B) < T).sum(axis=1)

    def zeroed_rows(g):
        lo, hi = next((t.byte_lo, t.byte_hi) for t in g.writes if getattr(t, "name", "") == X_BLOCKS)
        rows = np.arange(lo // row_bytes, hi // row_bytes)
        covered = [any(r.program == g.program and r.seq < g.seq and
                       any(getattr(t, "name", "") == X_BLOCKS and t.byte_lo <= q * row_bytes < t.byte_hi
                           for t in r.writes) for r in from_sbuf) for q in rows]
        return rows, np.array(covered)

    padded = 0
    for g in direct:
        rows, covered = zeroed_rows(g)
        block, pos = rows // B, rows % B
        want = (pos // 32 * 32 + 31) >= pairs[block]
        assert (covered == want).all(), (g.seq, rows[0], covered.astype(int).tolist(), want.astype(int).tolist())
        padded += bool(want.any())
    # blocks 3 (188 pairs) and 4 (324): at least the chunk holding each one's first padding row
    assert padded >= 2 and len(direct) >= full * (B // 128) + padded, (padded, len(direct))


@pytest.mark.parametrize("on_use", [False, True])
def test_unpipelined_keeps_sbuf_path(monkeypatch, on_use):
    """B = 256 under LNC2 (one chunk per core: no pipeline) and, on_use, no resident budget (weights loaded on use:
    the DeepSeek-V3 rank's path): pass A gathers X into SBUF and copies it out, except, on_use, where the I split
    (moe_bwd_mxfp8_i_split.py) stages the full blocks of the experts after the first fence group a fence ahead by
    HBM -> HBM copies: since round 14d expert 2's three blocks too (one DMA per 128-row chunk), not expert 0's (first
    group, gathered in pass A through SBUF)."""
    if on_use:
        monkeypatch.setattr(D, "RESIDENT_WEIGHT_BUDGET_BYTES", 0)
    kernel, ref, _ = _balanced_case(256, H=1024 if on_use else 128, I=544 if on_use else 96)
    out, trace = _run(kernel, 2)
    assert_outputs_identical(out, moe_backward_reference(**ref), f"unpipelined (on use {on_use}), LNC2 vs mx_exact")
    direct, through_sbuf = _x_writes(trace)
    assert (len(direct), len(through_sbuf)) == ((6, 2) if on_use else (0, len(through_sbuf))), (direct, through_sbuf)
    assert through_sbuf


def test_recompute_keeps_x_on_chip():
    """up recomputed from X (K = H), B = 512 under LNC2: X is needed on chip, so its rows are gathered into SBUF and
    copied out as before (no deferred loop)."""
    T, E, H, I, B = 1024, 2, 128, 96, 512
    ids = expert_routing([512, 512])
    kernel, ref = moe_case(T, E, H, I, ids, seed=31, block_size=B, checkpoints=("gate_pre",))
    out, trace = _run(kernel, 2)
    assert_outputs_identical(out, moe_backward_reference(**ref), "recompute, LNC2 vs mx_exact")
    direct, through_sbuf = _x_writes(trace)
    assert not direct and through_sbuf, (len(direct), len(through_sbuf))
