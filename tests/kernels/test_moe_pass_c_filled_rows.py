"""Pass C of a single-block expert reads only its block's filled 128-row units (round 17d,
moe_bwd_mxfp8_single_block.compute_phase3_single_block_expert_mxfp8): K = the filled units' rows, one traced variant
per count chosen at run time (MoeContext.filled_units).

| test                                   | what                                                                  |
|----------------------------------------|-----------------------------------------------------------------------|
| test_single_block_k_is_the_filled_rows | B = 512, k = 1, one-block experts of 512 / 1 / 31 / 33 / 129 / 511 /  |
|                                        | 384 pairs and one of 600 (two blocks): the variant each ran, K of     |
|                                        | every pass-C matmul; LNC1 and LNC2 == mx_exact                        |
| test_wrapx_keeps_the_whole_block       | wrapX (its MX groups stride the whole K tile): K = B, == mx_exact     |
"""
from __future__ import annotations

import numpy as np
import pytest

from nkilib.experimental.moe_mxfp8 import moe_bwd_mxfp8_single_block as S1
from nkilib.experimental.moe_mxfp8.reference import moe_backward_reference
from moekit import expert_routing
from simkit import assert_outputs_identical, spy, spy_returns
from test_moe_bwd_kernel import moe_case, run

# pairs per expert: the full first expert's loads leave real data in every staging tile, so a later variant that read
# a staging partition its own loads did not write (a padding-only unit) would take that stale data into its sums
PAIRS = [512, 1, 31, 33, 129, 511, 384, 600]


def _case(seed=5, **options):
    T, E, H, I = sum(PAIRS), len(PAIRS), 128, 64
    ids = expert_routing(PAIRS, shuffle_seed=seed)
    kernel, ref = moe_case(T, E, H, I, ids, seed=seed + 30, block_size=512, checkpoints=("gate_pre", "up"),
                           **options)
    assert np.diff(kernel["expert_block_offsets"]).tolist() == [1] * (E - 1) + [2]
    return kernel, ref


def _record(monkeypatch):
    """[(core, expert, rows)] of every traced call of the single-block gradient (a 0-trip loop never calls its body),
    and [(K, rows)] of every matmul under it (K = 4 x the stationary's partitions, rows: the call's, B when None)."""
    running = []  # the rows of the single-block call in progress (empty outside one)

    def single_starts(ctx, e, i, out, *args, rows=None, **kwargs):
        running.append(rows)
        return ctx.split.shard_id, e, rows

    def single_ends(result, *args, **kwargs):
        running.pop()  # records nothing

    def matmul_under_single(dst, stationary, moving, setup, **kw):
        if not running:
            return None
        assert moving.data[0].shape[0] == stationary.data[0].shape[0]
        return 4 * stationary.data[0].shape[0], 512 if running[-1] == None else running[-1]  # noqa: E711

    calls = spy(monkeypatch, S1, "compute_phase3_single_block_grads_mxfp8", single_starts)
    spy_returns(monkeypatch, S1, "compute_phase3_single_block_grads_mxfp8", single_ends)
    ks = spy(monkeypatch, S1, "matmul_panels", matmul_under_single)
    return calls, ks


@pytest.mark.parametrize("lnc", [1, 2])
def test_single_block_k_is_the_filled_rows(monkeypatch, lnc):
    """Experts of 512 (full: 4 units), 1, 31, 33 (1 unit), 129 (2), 511 (4), 384 (3: its last unit padding only) pairs
    take the single-block path with K = 128 x their filled units (both gradients, every matmul), expert 7 (600 pairs:
    two blocks) the resident path; LNC1 and LNC2 equal mx_exact bit for bit. Fails on the old code (K = B for every
    block: no rows recorded) and on a variant of one unit too few (129 and 511 lose their last rows) or that reads
    the staging tiles' unwritten partitions."""
    kernel, ref = _case()
    calls, ks = _record(monkeypatch)
    out = run(kernel, lnc=lnc)
    assert_outputs_identical(out, moe_backward_reference(**ref), f"LNC{lnc} filled-row pass C vs mx_exact")
    rows = {0: 512, 1: 128, 2: 128, 3: 128, 4: 256, 5: 512, 6: 384}
    expected = sorted((core, e, r) for core in range(lnc) for e, r in rows.items() for _ in range(2))  # 2 gradients
    assert sorted(calls) == expected, calls
    assert len(ks) >= 2 * len(rows) and all(k == r for k, r in ks), ks  # core 0 holds a tile of each gradient


def test_wrapx_keeps_the_whole_block(monkeypatch):
    """wrapX groups rows p + 128 j of a 512-row K tile: a K of fewer rows would group them otherwise, so every
    single-block expert keeps K = B (rows None); LNC2 == mx_exact."""
    kernel, ref = _case(seed=9, quant_scheme="wrapX")
    calls, ks = _record(monkeypatch)
    out = run(kernel, lnc=2)
    assert_outputs_identical(out, moe_backward_reference(**ref), "wrapX pass C vs mx_exact")
    assert {r for _, _, r in calls} == {None} and len(calls) == 2 * 2 * 7 and {k for k, _ in ks} == {512}, (calls, ks)
