"""Pass B's d_gate_up rows read before the segment's pass A under the I split (dx.d_gate_up_rows_ahead; docs/moe.md
section 10, round 20a).

Where pass A splits experts along I (W_down loaded on use: forced here by a zero resident budget) and pass B loads W_gu
per block, each segment step reads B(e)'s d_gate_up rows of a one-block expert into tiles allocated outside e's
if_single loop, before A(a) where a is one full block, else in A(a)'s last epilogue (or at once where A(a) has no
blocks or the step has no A), and B(e)'s one-block path takes them instead of reading its own after A(a); an expert of
more blocks reads its own (the same rows). The outputs stay mx_exact's bit for bit under LNC2 (the race detector on).

| test                          | what                                                                         | fixed |
|-------------------------------|------------------------------------------------------------------------------|-------|
| test_d_gate_up_rows_ahead     | fence groups [0, 1], [2, 3], [4]: B(e)'s rows read once per step, in A(a)'s  | LNC2  |
|                               | last epilogue (a of two blocks), where a has none, before A(a) (one full     |       |
|                               | block), with no A; B(0), B(1) (padded), B(4) take them, B(2) reads its own   |       |
| test_w_gu_staged_ahead        | super-panels of 1024 columns: B(e)'s first W_gu K tile staged with the rows | LNC2  |
|                               | or, before A(a) of one full block, in A(a)'s last epilogue; B(e)'s first    |       |
|                               | wide load takes it (its other K tiles staged as before), == mx_exact         |       |
| test_w_gu_at_first_tile_      | test_moe_i_split_staging's routing, 1024-column super-panels: where A(a)    | LNC2  |
| unstaged                      | stages no later expert (B(2)'s step, a = 4), W_GU_K_TILES_AHEAD_UNSTAGED K   |       |
|                               | tiles staged at A(a)'s first I tile; where it stages one (B(0)'s, a = 2),    |       |
|                               | W_GU_K_TILES_AHEAD in A(a)'s last epilogue; taken by B(e), == mx_exact       |       |
| test_rows_ahead_need_bf16_path| compute_phase2 refuses read-ahead rows with stored panels or the resident    | host  |
|                               | path (which read other layouts), naming the arguments                        |       |
"""
from __future__ import annotations

import numpy as np
import pytest

from nkilib.experimental.moe_mxfp8 import moe_bwd_mxfp8_d_gate_up as G
from nkilib.experimental.moe_mxfp8 import moe_bwd_mxfp8_dx as D
from nkilib.experimental.moe_mxfp8 import moe_bwd_mxfp8_i_split as S
from nkilib.experimental.moe_mxfp8 import moe_bwd_mxfp8_kernel as K
from nkilib.experimental.moe_mxfp8.constants import W_GU_K_TILES_AHEAD, W_GU_K_TILES_AHEAD_UNSTAGED
from nkilib.experimental.moe_mxfp8.reference import moe_backward_reference
from moekit import dedupe_repeats, core_of_ctx, core_of_self, expert_routing
from simkit import assert_outputs_identical, spy, spy_per_core, spy_returns
from test_moe_bwd_kernel import moe_case, run
from test_moe_i_split import CHECKPOINTS
from test_moe_i_split_staging import _case as staging_case


def _record(monkeypatch):
    """Program-order events per core: ("rows", e) when DGateUpRowsAhead.read is traced for e (the simulator traces a
    0/1-trip loop's body only when it trips, so a read issued in an A branch that does not run records nothing),
    ("A", e, full) per block of the I split, ("B", e, taken) per block of pass B (taken: its rows_ahead are the very
    tiles of e's DGateUpRowsAhead on that core; None: it read its own)."""
    made = spy(monkeypatch, D.DGateUpRowsAhead, "__init__", lambda self, ctx, e, *args: ((ctx.split.shard_id, e), self))
    events = spy_per_core(monkeypatch, S.ExpertISplit, "block", core_of_self,
                          lambda self, e, i, w, full, **kwargs: ("A", e, full))

    def taken(ctx, e, rows_ahead):
        rows = dict(made).get((ctx.split.shard_id, e))
        return None if rows_ahead is None else rows is not None and rows_ahead is rows

    spy_per_core(monkeypatch, K, "compute_phase2_hidden_states_grad_mxfp8", core_of_ctx,
                 lambda ctx, e, i, *args, rows_ahead=None, **kwargs: ("B", e, taken(ctx, e, rows_ahead)), into=events)
    read = D.DGateUpRowsAhead.read

    def record_read(self, rows=True, w_gu=True):  # recorded in the read's 0/1-trip loop: only where it trips
        what = ("rows", self.e) if rows else ("w_gu", self.e)
        self.ctx.loops.if_used(self.e, lambda: events.setdefault(core_of_self(self), []).append(what))
        return read(self, rows=rows, w_gu=w_gu)

    monkeypatch.setattr(D.DGateUpRowsAhead, "read", record_read)
    return events



def _case(monkeypatch):
    """test_moe_i_split's routing and data (T = 912, B = 256, I = 544, k = 1, all four checkpoints, no resident
    budget; experts of 256 / 100 / 300 / 0 / 256 pairs) with H = 2048: each core's 1024 columns are two W_gu tiles,
    so pass B loads W_gu per block for a one-block expert (the kernel's b_groups: the path that takes the rows; with
    H = 1024 one tile is one group and pass B's single loop runs the per-block path without them)."""
    monkeypatch.setattr(D, "RESIDENT_WEIGHT_BUDGET_BYTES", 0)
    T, E, H, I, B = 912, 5, 2048, 544, 256
    ids = expert_routing([256, 100, 300, 256], experts=[0, 1, 2, 4], shuffle_seed=23)
    kernel, ref = moe_case(T, E, H, I, ids, seed=71, block_size=B, checkpoints=CHECKPOINTS)
    assert np.diff(kernel["expert_block_offsets"]).tolist() == [1, 1, 2, 0, 1]
    return kernel, ref


def test_d_gate_up_rows_ahead(monkeypatch):
    """_case's routing (experts of one full block, one padded block, two blocks, none, one full block; fence groups
    [0, 1], [2, 3], [4]). Each segment step reads B(e)'s rows once, on the path its A takes: rows(0) in A(2)'s last
    epilogue (two blocks, the second padded: after its chunks), rows(1) where A(3) has no blocks, rows(2) before A(4)
    (one full block), rows(3) and rows(4) with no A in their steps (rows(3): an expert without blocks, whose read loop
    runs no trip, so nothing is recorded). B(0), B(1) (padded: pass B reads every chunk) and B(4) take the rows read
    for them, B(2) runs the multi-block path and reads its own. Fails on the old code (no DGateUpRowsAhead) and on a
    path that does not read (B(e) then multiplies unread tiles: the outputs). Round 22a: where the rows go before
    A(4), W_gu's staged K tiles (none at these widths) go in A(4)'s last epilogue (("w_gu", 2), after ("A", 4, True));
    elsewhere with the rows."""
    kernel, ref = _case(monkeypatch)
    events = _record(monkeypatch)
    out = run(kernel, lnc=2)
    assert_outputs_identical(out, moe_backward_reference(**ref), "LNC2 d_gate_up rows ahead vs mx_exact")
    for core in (0, 1):
        seq = dedupe_repeats(events[core])
        assert seq == [("A", 0, True), ("A", 1, False), ("A", 2, True), ("A", 2, False), ("rows", 0), ("B", 0, True),
                       ("rows", 1), ("B", 1, True), ("rows", 2), ("A", 4, True), ("w_gu", 2), ("B", 2, None),
                       ("rows", 4), ("B", 4, True)], seq


def test_rows_ahead_need_bf16_path():
    """Rows read ahead serve only the weights-per-block path that builds its panels from bf16 rows: with pass A's
    stored panels or the resident path (skip_padding) compute_phase2 raises before tracing anything."""
    class Ctx:
        I, B = 544, 256
        d_gu_mx = ("words", "scales")

    class Weights:
        tiles = [(0, 512)]

    class Rows:
        tiles = [None, None]

    for kwargs in ({"stored_panels": True}, {"skip_padding": True, "stored_panels": False}):
        with pytest.raises(AssertionError, match="rows read ahead"):
            D.compute_phase2_hidden_states_grad_mxfp8(Ctx(), 0, 0, Weights(), rows_ahead=Rows(), **kwargs)


def _spy_w_gu_staging(monkeypatch):
    """Pass B's wide W_gu super-panels patched down to 1024 columns (each core's whole 1024 columns of H = 2048; the
    rank's 2048 / 1024), and ([((W_gu's first row, first column), the staged views)] of each stage_ahead, the same of
    each load_panel that takes staged views)."""
    monkeypatch.setattr(D, "WIDE_WEIGHT_LOAD_WIDTH", 1024)
    monkeypatch.setattr(D, "WEIGHT_LOAD_WIDTH", 512)
    staged = spy_returns(monkeypatch, D, "stage_ahead", lambda views, op, f0, *args, **kwargs: ((op.k_base, f0), views))
    taken = spy(monkeypatch, D, "load_panel", lambda op, f0, *args, staged=None, **kwargs:
                None if staged is None else ((op.k_base, f0), staged))
    return staged, taken


def test_w_gu_staged_ahead(monkeypatch):
    """Round 22a (docs/moe.md section 10): with pass B's W_gu loaded in wide super-panels (here 1024 columns, each
    core's whole 1024 columns of H = 2048: the widths patched down from DeepSeek-V3's 2048 / 1024), each one-block
    expert's first W_GU_K_TILES_AHEAD K tile(s) of W_gu are staged (stage_ahead) on the paths of
    test_d_gate_up_rows_ahead, in A(4)'s last epilogue for B(2)'s step (A(4) one full block), and B(0), B(1), B(4)'s
    first wide load takes exactly those staged views (B(2), of two blocks, loads its own). LNC2 == mx_exact bit for
    bit under the race detector. Fails on the old code (nothing staged), on a load that restages them or ignores them
    (the views taken), and on staged tiles filled from the wrong W_gu rows or columns (the outputs)."""
    kernel, ref = _case(monkeypatch)
    staged, taken = _spy_w_gu_staging(monkeypatch)
    events = _record(monkeypatch)
    out = run(kernel, lnc=2)
    assert_outputs_identical(out, moe_backward_reference(**ref), "LNC2 W_gu staged ahead vs mx_exact")
    two_i = 2 * 544
    for core in (0, 1):
        seq = dedupe_repeats(events[core])
        assert seq.index(("w_gu", 2)) == seq.index(("A", 4, True)) + 1, seq
    # one staging per one-block expert and core (e's W_gu rows from e * 2I, each core's H columns from 0 or 1024),
    # each taken once by B(e)'s first load, as the same views; B(0)'s step stages expert 4's rows in A(2), B(1)'s and
    # B(4)'s stage none (round 36b: W_GU_K_TILES_AHEAD_UNSTAGED K tiles there)
    expected = [(e * two_i, f0) for e in (0, 1, 4) for f0 in (0, 1024)]
    assert sorted(k for k, _ in staged) == sorted(k for k, _ in taken) == expected, (staged, taken)
    taken_views = dict(taken)
    for key, views in staged:
        k_ahead = W_GU_K_TILES_AHEAD if key[0] == 0 else W_GU_K_TILES_AHEAD_UNSTAGED
        assert taken_views[key] is views and len(views) == k_ahead, (key, views)


def test_w_gu_at_first_tile_unstaged(monkeypatch):
    """Round 36b (docs/moe.md section 10): test_moe_i_split_staging's routing (experts of 1, 1, 1, 0, 1, 2 blocks of
    256; fence groups [0, 1], [2, 3], [4, 5]; H = 2048) with pass B's W_gu in 1024-column super-panels (each core's
    whole 1024 columns, the widths patched down as test_w_gu_staged_ahead's). B(0)'s step stages expert 4's rows in
    A(2) (one full block): B(0)'s first W_GU_K_TILES_AHEAD W_gu K tile(s) go in A(2)'s last epilogue, after its I
    tiles. B(2)'s step stages nothing (no group after next): B(2)'s first W_GU_K_TILES_AHEAD_UNSTAGED K tiles go at
    A(4)'s first I tile, after its block's reads and before its first epilogue. Each is taken by B(e)'s first wide
    load as the same views; LNC2 == mx_exact bit for bit under the race detector. Fails on the old code (B(2)'s one
    K tile in A(4)'s last epilogue)."""
    kernel, ref = staging_case(monkeypatch)
    staged, taken = _spy_w_gu_staging(monkeypatch)
    events = _record(monkeypatch)
    # each chunk's epilogue of an I tile, right after its dI matmul (RowChunk.epilogue)
    spy_per_core(monkeypatch, G.RowChunk, "epilogue", lambda self, ctx, *args, **kwargs: ctx.split.shard_id,
                 lambda self, ctx, *args, **kwargs: ("tile",), into=events)
    out = run(kernel, lnc=2)
    assert_outputs_identical(out, moe_backward_reference(**ref), "LNC2 W_gu staged at A's first I tile vs mx_exact")
    for core in (0, 1):
        seq = dedupe_repeats(events[core])
        a4, a2 = seq.index(("A", 4, True)), seq.index(("A", 2, True))
        assert seq[a4 + 1:a4 + 3] == [("w_gu", 2), ("tile",)], seq  # before A(4)'s first epilogue
        assert seq[a2 + 1:a2 + 3] == [("tile",), ("w_gu", 0)], seq  # after A(2)'s epilogues
    two_i = 2 * 544
    taken_views = dict(taken)
    for e, k_ahead in ((0, W_GU_K_TILES_AHEAD), (2, W_GU_K_TILES_AHEAD_UNSTAGED)):
        for f0 in (0, 1024):
            views = dict(staged)[(e * two_i, f0)]
            assert taken_views[(e * two_i, f0)] is views and len(views) == k_ahead, (e, f0, views)
