"""Pass C of the MoE kernel (moe_bwd_mxfp8_weight_grads.py): which weight-gradient path an expert takes, and
that every path gives mx_exact's bits.

| test                                  | what                                                              |
|---------------------------------------|-------------------------------------------------------------------|
| test_resident_and_streamed_paths_...  | experts of 3 / 2 / 1 / 0 blocks with R = 2: streamed, resident,   |
|                                       | single-block, zeros in one launch; LNC1 == LNC2 == mx_exact       |
| test_resident_tiers_in_one_launch     | tiers (2,) under R = 3: experts of 4 / 3 / 2 / 1 / 0 blocks take |
|                                       | streamed, tier 3, tier 2, single, zeros; LNC2 == mx_exact        |
| test_windowed_path_experts_above_r    | R = 2, W = 3: experts of 5 / 3 / 4 blocks in windows, 7 streamed,  |
|                                       | 2 resident, 0 zeros; LNC1 and LNC2 == mx_exact                    |
| test_parts_tiers_experts_above_r      | R = 2 with part tiers R_2 = 3, R_3 = 4, W = 3: experts of 3 / 4  |
|                                       | blocks per part, 5 in windows, 2 resident; == mx_exact            |
| test_parts_reuse_the_boundary_...     | parts walk the stationary pieces in snake order, a part's first    |
|                                       | piece kept from the part before (not reloaded); == mx_exact       |
| test_resident_block_count_parts_...   | R, R_2, R_3 on the presets' shapes, each part within the budget   |
| test_resident_path_wrapx_b256         | resident path with the wrapX scheme, B = 256, 4 blocks            |
| test_resident_block_count_presets     | GPT-OSS-20B / DeepSeek-V3 rank shapes keep 4 blocks resident,     |
|                                       | within the SBUF budget; BF16 and an N wider than PSUM get none    |
| test_resident_loads_rotate_stages     | resident path: consecutive operand loads alternate staging tiles, |
|                                       | evictions on ScalarE; LNC1 and LNC2 == mx_exact                   |
| test_loads_above_r_rotate_all_stages  | parts tiers and windows: loads go round all 3 staging tiles, at   |
|                                       | most R blocks 2; LNC2 == mx_exact                                 |
| test_windowed_carries_and_evictions_  | windows: carry copies and last-window evictions on ScalarE only,  |
| on_scalar                             | one carry per tile and boundary; LNC1 and LNC2 == mx_exact        |
| test_windows_take_groups_n_tile_by_...| windows: groups n tile by n tile, moving operand piece by piece:  |
|                                       | 2R quantizes before the first matmul; LNC1 and LNC2 == mx_exact   |
| test_windows_after_the_first_load_    | windows w > 0: the next moving piece's slots split over two       |
| their_loads_between_the_adds          | groups, a stationary piece's slots 1.. after its first group's    |
|                                       | adds; LNC1 and LNC2 == mx_exact                                   |
"""
from __future__ import annotations

import numpy as np
import pytest

import nki.language as nl
from nkilib.core.matmul import CoreSplit, MatmulSetup, panel_bytes_per_partition
from nkilib.experimental.moe_mxfp8 import moe_bwd_mxfp8_weight_grads as W
from nkilib.experimental.moe_mxfp8.constants import PASS_C_RESIDENT_BUDGET_BYTES, SINGLE_BLOCK_LOAD_WIDTH
from nkilib.experimental.moe_mxfp8.reference import moe_backward_reference
from nkilib.examples.moe_backward_cost import PHASES
from nkilib.experimental.moe_mxfp8 import moe_bwd_mxfp8_kernel as kernel_module
from nkilib.experimental.moe_mxfp8.constants import PASS_C_RESIDENT_STAGES, PASS_C_STAGING_BUFFERS
from nkilib.simulator.launcher import run_kernel
from nkilib.simulator.trace import label_phases
from moekit import expert_routing
from simkit import assert_outputs_identical, count_calls, spy
from test_moe_bwd_kernel import CLAMPS, moe_case, run


def test_resident_and_streamed_paths_in_one_launch(monkeypatch):
    """R = 2 slots: expert 0 (3 blocks) re-reads its blocks per PSUM group, expert 1 (2 blocks) keeps them in its
    slots, expert 2 (1 block) takes the single-block path, expert 3 (no tokens) stores zeros; clamps and
    I = 160 (a partial last tile). Both multi-block paths run, and LNC1 == LNC2 == mx_exact bit for bit."""
    monkeypatch.setattr(W, "PASS_C_RESIDENT_BLOCKS", 2)
    monkeypatch.setattr(W, "PASS_C_RESIDENT_WINDOWS", 1)  # no windows: over R streams
    calls = count_calls(monkeypatch, W, ["compute_phase3_resident_grads_mxfp8",
                                         "compute_phase3_expert_weight_grads_mxfp8"])
    T, E, H, I = 520, 4, 96, 160
    ids = expert_routing([300, 200, 20], shuffle_seed=8)
    kernel, ref = moe_case(T, E, H, I, ids, seed=31, checkpoints=("gate_pre", "up"), clamp_limits=CLAMPS)
    assert np.diff(kernel["expert_block_offsets"]).tolist() == [3, 2, 1, 0]
    out2 = run(kernel, lnc=2)
    # per core: the two gradients of expert 1 resident, of expert 0 streamed
    assert calls == {"compute_phase3_resident_grads_mxfp8": 4, "compute_phase3_expert_weight_grads_mxfp8": 4}
    assert_outputs_identical(out2, moe_backward_reference(**ref), "R = 2 paths vs mx_exact")
    assert_outputs_identical(run(kernel, lnc=1), out2, "LNC1 vs LNC2")
    assert not out2[2][3].view(np.uint16).any() and not out2[3][3].view(np.uint16).any()


def test_resident_tiers_in_one_launch(monkeypatch):
    """Resident tiers (ResidentBlocks): with tiers (2,) and R = 3, expert 1 (3 blocks) runs the 3-slot code, expert 2
    (2 blocks) the 2-slot code, expert 0 (4 blocks, over R) the streamed path, expert 3 the single-block path and
    expert 4 (no tokens) stores zeros: LNC2 == mx_exact bit for bit, and each tier is entered for its expert only."""
    monkeypatch.setattr(W, "PASS_C_RESIDENT_BLOCKS", 3)
    monkeypatch.setattr(W, "PASS_C_RESIDENT_TIERS", (2,))
    monkeypatch.setattr(W, "PASS_C_RESIDENT_WINDOWS", 1)
    slots_seen = spy(monkeypatch, W, "compute_phase3_resident_grads_mxfp8", lambda ctx, e, *args, **kw: (e, args[-1]))
    calls = count_calls(monkeypatch, W, ["compute_phase3_expert_weight_grads_mxfp8"])
    T, E, H, I = 930, 5, 96, 64
    ids = expert_routing([400, 300, 200, 30], shuffle_seed=9)
    kernel, ref = moe_case(T, E, H, I, ids, seed=41, checkpoints=("gate_pre", "up"))
    assert np.diff(kernel["expert_block_offsets"]).tolist() == [4, 3, 2, 1, 0]
    out2 = run(kernel, lnc=2)
    # per core and gradient: expert 1 with 3 slots, expert 2 with 2, expert 0 streamed
    assert sorted(slots_seen) == [(1, 3)] * 4 + [(2, 2)] * 4
    assert calls == {"compute_phase3_expert_weight_grads_mxfp8": 4}
    assert_outputs_identical(out2, moe_backward_reference(**ref), "resident tiers vs mx_exact")
    assert not out2[2][4].view(np.uint16).any() and not out2[3][4].view(np.uint16).any()


@pytest.mark.parametrize("lnc", [1, 2])
def test_windowed_path_experts_above_r(monkeypatch, lnc):
    """Windows (round 5b): R = 2 slots, W = 3 windows. Expert 0 (5 blocks: windows 2 + 2 + 1, the last of one block,
    a partial sum carried twice), expert 1 (3 blocks: 2 + 1), expert 2 (4: 2 + 2) take the windowed path, expert 3
    (7 blocks > W R) streams, expert 4 (2 blocks) stays resident, expert 5 has none; clamps and I = 160 (a partial
    last tile). Bit-exact vs mx_exact (acc = fp32(acc + mm(block)) block by block across windows)."""
    monkeypatch.setattr(W, "PASS_C_RESIDENT_BLOCKS", 2)
    monkeypatch.setattr(W, "PASS_C_RESIDENT_WINDOWS", 3)
    calls = count_calls(monkeypatch, W, ["compute_phase3_windowed_grads_mxfp8",
                                         "compute_phase3_expert_weight_grads_mxfp8", "add_partial"])
    T, E, H, I = 2400, 6, 96, 160
    ids = expert_routing([600, 300, 450, 850, 200], shuffle_seed=12)
    kernel, ref = moe_case(T, E, H, I, ids, seed=53, checkpoints=("gate_pre", "up"), clamp_limits=CLAMPS)
    assert np.diff(kernel["expert_block_offsets"]).tolist() == [5, 3, 4, 7, 2, 0]
    out = run(kernel, lnc=lnc)
    # per core and gradient: experts 0, 1, 2 windowed, expert 3 streamed; partial sums added in windows 1 and 2
    assert calls["compute_phase3_windowed_grads_mxfp8"] == 3 * 2 * lnc
    assert calls["compute_phase3_expert_weight_grads_mxfp8"] == 2 * lnc
    assert calls["add_partial"] > 0
    assert_outputs_identical(out, moe_backward_reference(**ref), f"windows LNC{lnc} vs mx_exact")
    assert not out[2][5].view(np.uint16).any() and not out[3][5].view(np.uint16).any()


@pytest.mark.parametrize("lnc", [1, 2])
def test_parts_tiers_experts_above_r(monkeypatch, lnc):
    """N-part tiers (round 8b): R = 2 slots, R_2 = 3 with 2 parts and R_3 = 4 with 3 parts of this core's N columns,
    W = 3 windows of R = 2; 64-column output tiles, so dW_gu's N (H = 96) has 2 tiles and
    dW_down's (I = 160) 3: a third part of dW_gu is empty. Expert 0 (3 blocks) runs the resident code once per part of
    2, expert 1 (4 blocks) once per part of 3, expert 2 (5 blocks, above R_3) takes windows of 2 + 2 + 1 blocks
    (two fp32 carries), expert 3 (2 blocks) stays resident with all its columns, expert 4 has none. Every tile sums its
    expert's blocks in order: bit-exact vs mx_exact."""
    monkeypatch.setattr(W, "PASS_C_RESIDENT_WINDOWS", 3)
    monkeypatch.setattr(W, "PASS_C_RESIDENT_PARTS", (2, 3))
    monkeypatch.setattr(W, "MOE_N_TILE", 64)
    monkeypatch.setattr(W, "resident_block_count", lambda ctx, grads, parts=1: {1: 2, 2: 3, 3: 4}[parts])
    seen = spy(monkeypatch, W, "compute_phase3_resident_grads_mxfp8",
               lambda ctx, e, out, lhs, rhs, m_total, n_total, wg_dtype, slots=None, window=None, part=None, carry=None:
               (e, slots, part, window != None))  # noqa: E711
    calls = count_calls(monkeypatch, W, ["compute_phase3_windowed_grads_mxfp8",
                                         "compute_phase3_expert_weight_grads_mxfp8"])
    T, E, H, I = 1420, 5, 96, 160
    ids = expert_routing([300, 450, 520, 150], shuffle_seed=14)
    kernel, ref = moe_case(T, E, H, I, ids, seed=59, checkpoints=("gate_pre", "up"), clamp_limits=CLAMPS)
    assert np.diff(kernel["expert_block_offsets"]).tolist() == [3, 4, 5, 2, 0]
    out = run(kernel, lnc=lnc)
    per_grad = 2 * lnc  # two gradients per core
    assert sorted(set(seen)) == sorted({(0, 3, (0, 2), False), (0, 3, (1, 2), False), (1, 4, (0, 3), False),
                                        (1, 4, (1, 3), False), (1, 4, (2, 3), False), (3, 2, None, False),
                                        (2, None, None, True)})
    assert seen.count((0, 3, (0, 2), False)) == per_grad and seen.count((1, 4, (2, 3), False)) == per_grad
    assert calls == {"compute_phase3_windowed_grads_mxfp8": per_grad, "compute_phase3_expert_weight_grads_mxfp8": 0}
    assert_outputs_identical(out, moe_backward_reference(**ref), f"parts tiers LNC{lnc} vs mx_exact")
    assert not out[2][4].view(np.uint16).any() and not out[3][4].view(np.uint16).any()


@pytest.mark.parametrize("lnc", [1, 2])
def test_parts_reuse_the_boundary_stationary_piece(monkeypatch, lnc):
    """Round 20c (docs/moe.md section 10): the parts of an expert above R walk the stationary pieces in snake order (odd
    parts backwards) and part p + 1 multiplies the piece part p ended on from its slots, without loading it again.
    R = 2 with R_2 = 3 (2 parts) and R_3 = 4 (3 parts), 64-column n tiles and 128-column stationary pieces, so each
    core's M range has several pieces (dW_gu [2I = 576, H = 320], dW_down [320, 288]): expert 0 (3 blocks) in parts of
    2, expert 1 (4) in parts of 3, expert 2 (2) resident. Per core, gradient and part, the pieces whose blocks are
    loaded: part 0 all in order, part 1 backwards without the first, part 2 forwards without the first (the old code:
    every part all pieces in order). At most one stationary piece's slots beside the part's moving ones at any time (a
    carry that kept its piece to the part's end overflowed SBUF on the full GPT-OSS-20B preset). LNC1 and LNC2 ==
    mx_exact bit for bit."""
    monkeypatch.setattr(W, "PASS_C_RESIDENT_WINDOWS", 3)
    monkeypatch.setattr(W, "PASS_C_RESIDENT_PARTS", (2, 3))
    monkeypatch.setattr(W, "MOE_N_TILE", 64)
    monkeypatch.setattr(W, "SINGLE_BLOCK_LOAD_WIDTH", 128)
    monkeypatch.setattr(W, "resident_block_count", lambda ctx, grads, parts=1: {1: 2, 2: 3, 3: 4}[parts])
    loaded, pieces = {}, {}  # (core, e, M, part) -> stationary piece columns loaded, in order; (core, M) -> its pieces
    live, peaks = [0], []  # PanelSlots alive now; per part call [the most alive, its moving pieces + 1, running]
    resident, slots_class = W.compute_phase3_resident_grads_mxfp8, W.PanelSlots

    class CountedSlots(slots_class):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            live[0] += 1
            if peaks and peaks[-1][-1]:  # inside a part's call
                peaks[-1][0] = max(peaks[-1][0], live[0])

        def __del__(self):
            live[0] -= 1

    class CountedRows:
        def __init__(self, src, key):
            self.src, self.key = src, key

        def rows(self, i, f0, f_size):
            seq = loaded.setdefault(self.key, [])
            if not seq or seq[-1] != f0:
                seq.append(f0)
            return self.src.rows(i, f0, f_size)

        def tile(self, i, f0, f_size):  # BlockRowSource's one-DMA K tile loader (round 30a), not counted
            return self.src.tile(i, f0, f_size)

    def recorded(ctx, e, out, lhs, rhs, m_total, n_total, wg_dtype, slots=None, window=None, part=None, carry=None):
        if part != None:  # noqa: E711
            core = (id(ctx), ctx.split.shard_id)
            (m_lo, m_hi), _ = ctx.split.ranges(m_total, n_total)
            pieces[core, m_total] = [p0 for p0, _ in W.blocks(m_lo, m_hi, W.SINGLE_BLOCK_LOAD_WIDTH)]
            loaded.setdefault((core, e, m_total, part), [])
            lhs = CountedRows(lhs, (core, e, m_total, part))
            _, (n_lo, n_hi) = ctx.split.ranges(m_total, n_total)
            peaks.append([live[0], len(W.blocks(*W._n_part(n_lo, n_hi, part), W.SINGLE_BLOCK_LOAD_WIDTH)) + 1, True])
        try:
            return resident(ctx, e, out, lhs, rhs, m_total, n_total, wg_dtype, slots, window, part, carry)
        finally:
            if peaks:
                peaks[-1][-1] = False

    monkeypatch.setattr(W, "compute_phase3_resident_grads_mxfp8", recorded)
    monkeypatch.setattr(W, "PanelSlots", CountedSlots)
    T, E, H, I = 900, 3, 320, 288
    ids = expert_routing([300, 450, 150], shuffle_seed=16)
    kernel, ref = moe_case(T, E, H, I, ids, seed=63, checkpoints=("gate_pre", "up"), clamp_limits=CLAMPS)
    assert np.diff(kernel["expert_block_offsets"]).tolist() == [3, 4, 2]
    out = run(kernel, lnc=lnc)
    assert_outputs_identical(out, moe_backward_reference(**ref), f"parts in snake order LNC{lnc} vs mx_exact")
    assert len({core for core, _ in pieces}) == lnc and max(len(p) for p in pieces.values()) >= 2, pieces
    expected = {}
    for (core, m_total), mine in pieces.items():
        count = max(len(p) for (c, m), p in pieces.items() if m == m_total)  # core 0's piece count (padding pieces)
        for e, parts in ((0, 2), (1, 3)):
            order = list(range(count))
            for p in range(parts):
                walk = order if p % 2 == 0 else order[::-1]
                walk = walk if p == 0 else walk[1:]
                expected[core, e, m_total, (p, parts)] = [mine[s] for s in walk if s < len(mine)]
    # one stationary piece in SBUF at a time: the carried piece is freed after its groups, before the next is allocated
    assert all(peak <= bound for peak, bound, _ in peaks) and any(peak == bound for peak, bound, _ in peaks), peaks
    assert loaded == expected, (loaded, expected)


def test_resident_path_wrapx_b256():
    """The wrapX scheme (groups strided inside the K tile) and B = 256 (64-partition K tiles, scale slots packed
    at offsets 0/4/8/12): an expert of 4 blocks in the resident slots, LNC2 == mx_exact."""
    T, E, H, I = 1100, 2, 128, 64
    ids = expert_routing([900, 200])
    kernel, ref = moe_case(T, E, H, I, ids, seed=37, block_size=256, quant_scheme="wrapX",
                           checkpoints=("gate_pre", "up", "gate_act", "intermediate"))
    assert np.diff(kernel["expert_block_offsets"]).tolist() == [4, 1]
    assert_outputs_identical(run(kernel, lnc=2), moe_backward_reference(**ref), "wrapX B=256 vs mx_exact")


class _Ctx:
    def __init__(self, precision, cores=2, shard=0):
        self.setup = MatmulSetup(precision, nl.float8_e4m3fn_x4, "1x32", True)
        self.split = CoreSplit(cores, shard)


def _grads(H, I):
    return ((None, None, None, 2 * I, H), (None, None, None, H, I))


@pytest.mark.parametrize("H, I", [(2880, 2880), (7168, 2048)])
def test_resident_block_count_presets(H, I):
    """The full presets' experts of 4 blocks (GPT-OSS-20B at T = 16384, balanced) fit the slots, and what R
    slots hold (each core's moving columns in load pieces plus one stationary piece, every K tile) stays within
    PASS_C_RESIDENT_BUDGET_BYTES; one more slot would not fit or R is at its cap."""
    ctx = _Ctx("mxfp8")
    r = W.resident_block_count(ctx, _grads(H, I))
    assert r >= 4

    def held(slots):
        worst = 0
        for _, _, _, m_total, n_total in _grads(H, I):
            for core in (0, 1):
                _, (n_lo, n_hi) = CoreSplit(2, core).ranges(m_total, n_total)
                widths = [min(SINGLE_BLOCK_LOAD_WIDTH, n_hi - c) for c in range(n_lo, n_hi, SINGLE_BLOCK_LOAD_WIDTH)]
                widths.append(SINGLE_BLOCK_LOAD_WIDTH)
                worst = max(worst, sum(panel_bytes_per_partition(512 * slots, w, ctx.setup) for w in widths))
        return worst

    assert held(r) <= PASS_C_RESIDENT_BUDGET_BYTES
    assert r == W.PASS_C_RESIDENT_BLOCKS or held(r + 1) > PASS_C_RESIDENT_BUDGET_BYTES


@pytest.mark.parametrize("H, I, expected", [(2880, 2880, (8, 12, 16)), (7168, 2048, (7, 10, 12)),
                                            (2048, 768, (16, 16, 16))])
def test_resident_block_count_parts_presets(H, I, expected):
    """Round 8b's N-part tiers on the presets' shapes: R, R_2, R_3 (GPT-OSS-20B 8 / 12 / 16: its 9- and 11-block Zipf
    experts fit parts of 2, the 15-block one parts of 3; the DeepSeek-V3 rank's 8-block expert parts of 2; Qwen3-30B-A3B
    at the cap of 16 already), and what the slots of a part hold stays within PASS_C_RESIDENT_BUDGET_BYTES on every core
    and part (the moving operand's part in load pieces plus one stationary piece)."""
    ctx = _Ctx("mxfp8")
    counts = tuple(W.resident_block_count(ctx, _grads(H, I), parts) for parts in (1, 2, 3))
    assert counts == expected
    for parts, r in zip((2, 3), counts[1:]):
        for _, _, _, m_total, n_total in _grads(H, I):
            for core in (0, 1):
                _, (n_lo, n_hi) = CoreSplit(2, core).ranges(m_total, n_total)
                for p in range(parts):
                    p_lo, p_hi = W._n_part(n_lo, n_hi, (p, parts))
                    assert (p_lo - n_lo) % 512 == 0 and p_hi <= n_hi
                    widths = [min(SINGLE_BLOCK_LOAD_WIDTH, p_hi - c)
                              for c in range(p_lo, p_hi, SINGLE_BLOCK_LOAD_WIDTH)]
                    held = sum(panel_bytes_per_partition(512 * r, w, ctx.setup)
                               for w in widths + [SINGLE_BLOCK_LOAD_WIDTH])
                    assert held <= PASS_C_RESIDENT_BUDGET_BYTES, (parts, core, p, held)


def test_resident_block_count_off():
    """BF16 (128-row K tiles) and a core's N beyond one PSUM of accumulators (8 x 512 columns) take the
    streamed path: R = 0."""
    assert W.resident_block_count(_Ctx("bf16"), _grads(2880, 2880)) == 0
    assert W.resident_block_count(_Ctx("mxfp8"), ((None, None, None, 256, 2 * 8 * 512 + 256),)) == 0
    assert W.resident_block_count(_Ctx("mxfp8", cores=1), _grads(8192, 256)) == 0


@pytest.mark.parametrize("lnc", [1, 2])
def test_resident_loads_rotate_stages(lnc):
    """Round 6b (docs/moe.md section 10): a pass-C operand is one K tile, so the staging ring's own per-K-tile
    rotation put every load on one tile, each load waiting for the quantize before it. The resident path's loads now
    take PASS_C_RESIDENT_STAGES tiles in turn (no two consecutive loads share one) and its evictions run on ScalarE
    (VectorE keeps the quantizes, so the next stationary piece's quantizes do not queue behind them). Experts of 3
    and 2 blocks (resident), B = 128; bit-exact against mx_exact."""
    T, E, H, I = 600, 3, 64, 96
    ids = expert_routing([330, 250, 20], shuffle_seed=12)
    kernel, ref = moe_case(T, E, H, I, ids, seed=37, checkpoints=("gate_pre", "up"), clamp_limits=CLAMPS)
    assert np.diff(kernel["expert_block_offsets"]).tolist() == [3, 2, 1]
    with label_phases(kernel_module, PHASES):
        res = run_kernel(kernel_module.moe_backward_mxfp8_nki.fn, kwargs=kernel, lnc=lnc, grid_ndim=1, trace=True)
    assert_outputs_identical(tuple(np.asarray(o) for o in res.outputs), moe_backward_reference(**ref),
                             f"LNC{lnc} resident path vs mx_exact")
    scratch = ("moe_bwd_d_gate_up", "moe_bwd_x_blocks", "moe_bwd_dy_blocks", "moe_bwd_weighted_inter")
    in_c = [r for r in res.trace if r.program == 0 and r.attrs.get("phase") == "C dW"]
    stages = [r.writes[0].storage_id for r in in_c
              if r.instr == "dma_copy" and any(o.name in scratch for o in r.reads)]
    # a load is one DMA per slot of the MX layout into its staging tile: runs of one tile, one run per load
    runs = [s for n, s in enumerate(stages) if n == 0 or stages[n - 1] != s]
    # experts 0 and 1 (resident): per gradient the moving and the stationary operand of each of 5 blocks (20 loads),
    # slot j's loads on tile j % 2 (slot 0's stationary load follows the last slot's moving one on the same tile
    # when the expert's block count is odd); before the rotation every load took one tile (a single run)
    # expert 2 (one block, traced last) takes the single-block path, whose 4 loads (moving and stationary operand of
    # each gradient, one run each) go round all PASS_C_STAGING_BUFFERS tiles (round 7b)
    assert len(set(runs[:-4])) == PASS_C_RESIDENT_STAGES and len(runs) >= 16 + 4, runs
    # round 20b: the resident loads go round all of the ring's tiles (2 of the 3 before), so expert 0's three slot
    # loads of its first operand (one K tile and one piece each here) take three different tiles
    assert PASS_C_RESIDENT_STAGES == PASS_C_STAGING_BUFFERS == 3
    assert len(set(runs[:3])) == 3, runs
    evictions = {r.engine for r in in_c if r.instr == "tensor_scalar" and r.attrs.get("op0") == "add"
                 and any(o.buffer == "psum" for o in r.reads)}
    assert evictions and "scalar" in evictions


def test_loads_above_r_rotate_all_stages(monkeypatch):
    """Round 9c (docs/moe.md section 10): the loads of an expert above R (a tier of N parts or windows: its stationary
    operand read once per part, DMA-bound under skewed routing) go round all PASS_C_STAGING_BUFFERS staging tiles, so a
    load waits for the quantize that many loads before it; experts of at most R blocks keep PASS_C_RESIDENT_STAGES tiles
    (round 6b). R = 3 with a tier of 2 parts (R_2 = 4) and W = 3 windows: expert 0 (4 blocks) runs per part, expert 1
    (7 blocks) in windows of 3 + 3 + 1, expert 2 (3 blocks) resident, expert 3 single-block; LNC2 == mx_exact. Per core
    (each has its own ring): 3 staging tiles above R (2 on the old code); PASS_C_RESIDENT_STAGES at most R (2 before
    round 20b, 3 since: then both paths go round the whole ring)."""
    monkeypatch.setattr(W, "PASS_C_RESIDENT_WINDOWS", 3)
    monkeypatch.setattr(W, "PASS_C_RESIDENT_PARTS", (2,))
    monkeypatch.setattr(W, "MOE_N_TILE", 64)
    monkeypatch.setattr(W, "resident_block_count", lambda ctx, grads, parts=1: {1: 3, 2: 4}[parts])
    path, tiles = [None], {}
    resident, loader = W.compute_phase3_resident_grads_mxfp8, W.panel_from_row_loader

    def recorded(ctx, e, out, lhs, rhs, m_total, n_total, wg_dtype, slots=None, window=None, part=None, carry=None):
        path[0] = ("parts" if part != None else "windows" if window != None else "resident", id(ctx))  # noqa: E711
        try:
            return resident(ctx, e, out, lhs, rhs, m_total, n_total, wg_dtype, slots, window, part, carry)
        finally:
            path[0] = None

    def staged(*args, stages=None, **kw):
        if path[0] != None:  # noqa: E711
            tiles.setdefault(path[0], set()).update(id(s) for s in stages)
        return loader(*args, stages=stages, **kw)

    monkeypatch.setattr(W, "compute_phase3_resident_grads_mxfp8", recorded)
    monkeypatch.setattr(W, "panel_from_row_loader", staged)
    T, E, H, I = 1630, 4, 96, 160
    ids = expert_routing([450, 850, 300, 30], shuffle_seed=15)
    kernel, ref = moe_case(T, E, H, I, ids, seed=61, checkpoints=("gate_pre", "up"), clamp_limits=CLAMPS)
    assert np.diff(kernel["expert_block_offsets"]).tolist() == [4, 7, 3, 1]
    out = run(kernel, lnc=2)
    assert_outputs_identical(out, moe_backward_reference(**ref), "loads above R vs mx_exact")
    assert len({c for _, c in tiles}) == 2  # the two cores' traces
    assert {key: len(s) for key, s in tiles.items()} == {
        (p, c): W.PASS_C_STAGING_BUFFERS if p != "resident" else PASS_C_RESIDENT_STAGES for p, c in tiles}, tiles
    assert {p for p, _ in tiles} == {"parts", "windows", "resident"}


def _windowed_pass_c(monkeypatch, lnc, H, I, order_seed, seed, label):
    """Core 0's pass C trace records of a run with R = 2, W = 3 and experts of 600 / 450 / 250 pairs (k = 1, T = 1300,
    B = 128: 5 blocks in windows 2 + 2 + 1, 4 in 2 + 2, 2 resident), gate_pre / up given, clamped; asserts LNC`lnc`
    == mx_exact bit for bit first."""
    monkeypatch.setattr(W, "PASS_C_RESIDENT_BLOCKS", 2)
    monkeypatch.setattr(W, "PASS_C_RESIDENT_WINDOWS", 3)
    T, E = 1300, 3
    ids = expert_routing([600, 450, 250], shuffle_seed=order_seed)
    kernel, ref = moe_case(T, E, H, I, ids, seed=seed, checkpoints=("gate_pre", "up"), clamp_limits=CLAMPS)
    assert np.diff(kernel["expert_block_offsets"]).tolist() == [5, 4, 2]
    with label_phases(kernel_module, PHASES):
        res = run_kernel(kernel_module.moe_backward_mxfp8_nki.fn, kwargs=kernel, lnc=lnc, grid_ndim=1, trace=True)
    assert_outputs_identical(tuple(np.asarray(o) for o in res.outputs), moe_backward_reference(**ref),
                             f"LNC{lnc} {label} vs mx_exact")
    return [r for r in res.trace if r.program == 0 and r.attrs.get("phase") == "C dW"]


@pytest.mark.parametrize("lnc", [1, 2])
def test_windowed_carries_and_evictions_on_scalar(monkeypatch, lnc):
    """Round 11c (docs/moe.md section 10): a windowed expert's PSUM reads (the fp32 carries copied out between windows
    and the last window's +0.0 evictions) run on ScalarE only, as the resident path's evictions since round 6b, so
    VectorE (the next stationary piece's quantizes, the carries' adds into PSUM) never queues behind a group's last
    matmuls. R = 2, W = 3: experts of 5 (windows 2 + 2 + 1: two carries) and 4 blocks (2 + 2: one) windowed, one of
    2 resident; LNC1 and LNC2 == mx_exact bit for bit. Per core: one carry copy per output tile and boundary, each
    tile's carry store its own DMA into the partial-sum scratch; on the old code half of the copies and evictions ran
    on VectorE."""
    H, I = 96, 160
    in_c = _windowed_pass_c(monkeypatch, lnc, H, I, order_seed=21, seed=71, label="windows")
    reads_psum = [r for r in in_c if r.instr in ("tensor_copy", "tensor_scalar")
                  and any(o.buffer == "psum" for o in r.reads)]
    carries = [r for r in reads_psum if r.instr == "tensor_copy"]
    carry_stores = [r for r in in_c if r.instr == "dma_copy"
                    and any(o.name.startswith("moe_bwd_weight_grad_partial") for o in r.writes)]
    # per core: dW_gu [2I = 320, H = 96] and dW_down [96, 160] split along M under LNC2; experts 0 (two boundaries)
    # and 1 (one) carry every tile of this core's share: 3 boundaries x its tiles
    ranges = [CoreSplit(lnc, 0).ranges(m, n) for m, n in ((2 * I, H), (H, I))]
    tiles = sum(len(W.blocks(*m_range, 128)) * len(W.blocks(*n_range, 512)) for m_range, n_range in ranges)
    assert len(carries) == len(carry_stores) == 3 * tiles, (len(carries), len(carry_stores), tiles)
    assert {r.engine for r in reads_psum} == {"scalar"}, sorted({r.engine for r in reads_psum})
    adds = [r for r in in_c if r.instr == "tensor_tensor" and any(o.buffer == "psum" for o in r.writes)]
    assert len(adds) == 3 * tiles and {r.engine for r in adds} == {"vector"}


@pytest.mark.parametrize("lnc", [1, 2])
def test_windows_take_groups_n_tile_by_n_tile(monkeypatch, lnc):
    """Round 12a (docs/moe.md section 10): a windowed expert's output tiles go n tile by n tile (one group per n tile
    of a stationary piece's m tiles) and its moving operand loads piece by piece, so a window's first matmul waits for
    one moving piece's loads (R slots) and the stationary piece's (R), not every moving piece's. R = 2, W = 3, n tiles
    of 64 columns and load pieces of 256 (several moving pieces and m tiles per piece at a small H, I): expert 0
    (5 blocks: 2 + 2 + 1) and expert 1 (4: 2 + 2) windowed, expert 2 (2) resident; LNC1 and LNC2 == mx_exact. On the
    old code the first matmul came after 2 x R loads per moving piece (dW_gu: 2 pieces, 6 loads), and each group's
    matmuls covered all of a core's n tiles."""
    monkeypatch.setattr(W, "MOE_N_TILE", 64)
    monkeypatch.setattr(W, "SINGLE_BLOCK_LOAD_WIDTH", 256)
    H, I = 320, 288
    in_c = _windowed_pass_c(monkeypatch, lnc, H, I, order_seed=23, seed=73, label="windows by n tile")
    matmuls = [g for g, r in enumerate(in_c) if r.instr == "nc_matmul_mx"]
    quantizes = [g for g, r in enumerate(in_c) if r.instr == "quantize_mx"]  # one per operand load
    # expert 0's dW_gu window 0 comes first in pass C: moving piece 0 (R = 2 slots), then the stationary piece (2)
    assert sum(1 for g in quantizes if g < matmuls[0]) == 2 * 2, sorted({r.instr for r in in_c[:matmuls[0]]})
    # its first group: the stationary piece's m tiles (dW_gu: 2 I = 576 rows, core 0's first 256: 2 m tiles) under one
    # n tile, slot 0 (overwrites) then the earlier group's slot 1: 2 matmuls of one n tile each before the next load
    first = [in_c[g] for g in matmuls[:2]]
    assert len({o.name for r in first for o in r.writes}) == 2 and all(
        o.shape[-1] == 64 for r in first for o in r.writes), [(o.name, o.shape) for r in first for o in r.writes]


def _quantizes_between_add_runs(records):
    """Per run of partial-sum adds (tensor_tensor into PSUM; a run ends at the next matmul): the quantize_mx issued
    between the run before it (or the start) and it, in program order."""
    counts, quantizes, in_run = [], 0, False
    for r in records:
        if r.instr == "tensor_tensor" and any(o.buffer == "psum" for o in r.writes):
            if not in_run:
                counts.append(quantizes)
                quantizes, in_run = 0, True
        elif r.instr == "nc_matmul_mx":
            in_run = False
        elif r.instr == "quantize_mx":
            quantizes += 1
    return counts


@pytest.mark.parametrize("lnc", [1, 2])
def test_windows_after_the_first_load_their_loads_between_the_adds(monkeypatch, lnc):
    """Round 26c (docs/moe.md section 10): in a window w > 0 each group adds the earlier windows' partial sums on
    VectorE right after its slot-0 matmuls, in program order with the quantizes issued before it, and its slot-1 matmuls
    wait for those adds. So the next moving piece's slots load half after the first group on a piece and half after the
    second, and a stationary piece loads slot 0 before its first group and slots 1.. after that group's adds. R = 2, W =
    3, n tiles of 64 and load pieces of 256 (H = 320: moving pieces of 4 and 1 n tiles; I = 288: core 0's dW_gu rows in
    stationary pieces of 256); expert 0 (5 blocks: 2 + 2 + 1) and expert 1 (4: 2 + 2) windowed; LNC1 and LNC2 ==
    mx_exact. Expert 0's dW_gu window 1 comes first with adds: its first group's adds after moving piece 0 (2
    quantizes) and the stationary piece's slot 0 (1); then 1 (the stationary slot 1) + 1 (moving piece 1's slot 0)
    before the second group's adds, 1 (piece 1's slot 1) before the third's, none before the fourth's. On the old code
    4, then 2 (all of piece 1), 0, 0."""
    monkeypatch.setattr(W, "MOE_N_TILE", 64)
    monkeypatch.setattr(W, "SINGLE_BLOCK_LOAD_WIDTH", 256)
    # round 41b loads a window's moving piece 0 in the window before: this test keeps round 26c's order in isolation
    monkeypatch.setattr(W, "WINDOW_NEXT_MOVING_AHEAD", False, raising=False)
    in_c = _windowed_pass_c(monkeypatch, lnc, 320, 288, order_seed=29, seed=79, label="window loads between adds")
    counts = _quantizes_between_add_runs(in_c)
    # window 1's first quantizes: after window 0's last carry store (into the partial-sum scratch), before its first add
    first_add = next(g for g, r in enumerate(in_c) if r.instr == "tensor_tensor"
                     and any(o.buffer == "psum" for o in r.writes))
    last_carry = max(g for g, r in enumerate(in_c[:first_add]) if r.instr == "dma_copy"
                     and any(o.name.startswith("moe_bwd_weight_grad_partial") for o in r.writes))
    assert sum(r.instr == "quantize_mx" for r in in_c[last_carry:first_add]) == 3
    assert counts[1:4] == [2, 1, 0], counts


@pytest.mark.parametrize("lnc", [1, 2])
def test_window_groups_copy_out_by_parts(monkeypatch, lnc):
    """Round 41b (docs/moe.md section 10): a windowed expert's group (a stationary piece's m tiles under one n tile)
    runs its slots 1.. and its carry copies (ScalarE) in parts of WINDOW_GROUP_M_TILES m tiles, so a part's copies
    free its PSUM banks while the next part multiplies. Here WINDOW_GROUP_M_TILES = 1 on the shape of
    test_windows_take_groups_n_tile_by_n_tile (two m tiles per stationary piece, R = 2), LNC1 and LNC2 == mx_exact:
    expert 0's dW_gu window 0 (first in pass C) multiplies both tiles' slot 0, then the first tile's slot 1, copies that
    tile out, then multiplies the second tile's slot 1 and copies it out. On the old code both tiles' slot-1 matmuls
    came before the first copy (4 matmuls, then 2 copies in a row)."""
    monkeypatch.setattr(W, "MOE_N_TILE", 64)
    monkeypatch.setattr(W, "SINGLE_BLOCK_LOAD_WIDTH", 256)
    monkeypatch.setattr(W, "WINDOW_GROUP_M_TILES", 1, raising=False)
    in_c = _windowed_pass_c(monkeypatch, lnc, 320, 288, order_seed=23, seed=73, label="window groups by parts")
    copies = [g for g, r in enumerate(in_c) if r.instr == "tensor_copy" and any(o.buffer == "psum" for o in r.reads)]
    tile = lambda g: next(o.name for o in in_c[g].writes)  # noqa: E731  (a matmul's PSUM tile)
    first = [g for g in range(copies[0]) if in_c[g].instr == "nc_matmul_mx"]
    between = [g for g in range(copies[0], copies[1]) if in_c[g].instr == "nc_matmul_mx"]
    assert len(first) == 3 and len(between) == 1, (len(first), len(between))
    # slot 0 of tiles a, b, slot 1 of a, copy of a; slot 1 of b, copy of b
    assert tile(first[0]) == tile(first[2]) != tile(first[1]) == tile(between[0])
    assert {o.name for o in in_c[copies[0]].reads} >= {tile(first[0])}


@pytest.mark.parametrize("lnc", [1, 2])
def test_next_window_moving_piece0_loads_in_the_window_before(monkeypatch, lnc):
    """Round 41b (docs/moe.md section 10): a windowed expert's next window's moving piece 0 loads into this window's
    piece-0 slots once their last group (the last stationary piece's last n tile on piece 0) has multiplied, under this
    window's remaining groups, instead of after its last carry copies. The shape of
    test_windows_after_the_first_load_their_loads_between_the_adds (R = 2, W = 3; H = 320: moving pieces of 4 and 1
    n tiles of 64 columns), LNC1 and LNC2 == mx_exact: expert 0's dW_gu (first in pass C) loads 6 slots of X rows before
    window 0's last carry store (window 0's two pieces x 2 slots and window 1's piece 0 x 2; 4 on the old code), and
    window 1 quantizes only its stationary piece's slot 0 between that store and its first partial-sum add (3 on the
    old code: moving piece 0's two slots too)."""
    monkeypatch.setattr(W, "MOE_N_TILE", 64)
    monkeypatch.setattr(W, "SINGLE_BLOCK_LOAD_WIDTH", 256)
    in_c = _windowed_pass_c(monkeypatch, lnc, 320, 288, order_seed=29, seed=79, label="next window's piece 0 ahead")
    first_add = next(g for g, r in enumerate(in_c) if r.instr == "tensor_tensor"
                     and any(o.buffer == "psum" for o in r.writes))
    last_carry = max(g for g, r in enumerate(in_c[:first_add]) if r.instr == "dma_copy"
                     and any(o.name.startswith("moe_bwd_weight_grad_partial") for o in r.writes))
    x_loads = lambda end: sum(r.instr == "dma_copy" and any(o.name.startswith("moe_bwd_x_blocks")  # noqa: E731
                                                            for o in r.reads) for r in in_c[:end])
    # before window 0's first matmul: its moving piece 0 (2 slots), whatever the DMAs per slot
    per_piece = x_loads(next(g for g, r in enumerate(in_c) if r.instr == "nc_matmul_mx"))
    assert per_piece > 0 and x_loads(last_carry) == 3 * per_piece, (per_piece, x_loads(last_carry))
    assert sum(r.instr == "quantize_mx" for r in in_c[last_carry:first_add]) == 1
