"""Pass B's stationary d_gate_up panels made by pass A (docs/moe.md section 10, round 7a): where pass A holds all of a
128-row chunk's d_gate_up on chip (all of I in one group), it transposes and quantizes the chunk along 2I once (each
core its own rows) and stores the panel's words and scales (core/matmul/row_panels.store_panel_tiles); pass B loads them
(load_panel_tiles) instead of transposing and quantizing every row on both cores. The bits are those of the panel
pass B built before (the same panel_from_rows on the same rows), so the outputs equal mx_exact.

| test                               | what                                                               | fixed      |
|------------------------------------|--------------------------------------------------------------------|------------|
| test_pass_b_loads_pass_a_panels    | bit-exact; pass B issues no nc_transpose / quantize_mx, loads the  | LNC1, LNC2 |
|                                    | panels pass A stored (one per computed chunk and core); 2I = 192:  |            |
|                                    | a K tile of 64 partitions and zero columns up to the K padding     |            |
| test_panels_of_several_scale_tiles | 2I = 2112 (five K tiles, the last of 32 partitions: two scale      | LNC2       |
|                                    | tiles with packing, five without), clamped; the K tiles the last I |            |
|                                    | tile completes built last (round 17b: 0, 1, 3, 2, 4)               |            |
| test_unaligned_rows_keep_          | B = 128 under LNC2 (64 rows per core in pass A): no panels stored, | LNC2       |
|   pass_b_panels                    | pass B transposes and quantizes as before                          |            |
| test_single_block_experts_panels   | weights loaded on use (the DeepSeek-V3 rank's path, round 8c):     | LNC1, LNC2 |
|                                    | one-block experts (full and padded) take pass A's panels, the      |            |
|                                    | two-block expert's pass B builds its own; bit-exact                |            |
"""
from __future__ import annotations

import numpy as np
import pytest

from nkilib.experimental.moe_mxfp8 import moe_bwd_mxfp8_dx as D
from nkilib.experimental.moe_mxfp8 import moe_bwd_mxfp8_i_split as S
from nkilib.experimental.moe_mxfp8 import moe_bwd_mxfp8_kernel as kernel_module
from nkilib.experimental.moe_mxfp8.reference import moe_backward_reference
from nkilib.simulator.launcher import run_kernel
from nkilib.simulator.trace import label_phases
from moekit import expert_routing
from simkit import assert_outputs_identical
from test_moe_bwd_kernel import CLAMPS, moe_case, routing

CHECKPOINTS = ("gate_pre", "gate_act", "up", "intermediate")
PANELS, SCALES = "moe_bwd_d_gate_up_panels", "moe_bwd_d_gate_up_panel_scales"
PHASES = {"compute_phase1_block_grads_mxfp8": "A", "compute_phase1_pipelined_mxfp8": "A",
          "compute_phase2_hidden_states_grad_mxfp8": "B"}


def _run(kernel_kwargs, lnc):
    with label_phases(kernel_module, PHASES):
        res = run_kernel(kernel_module.moe_backward_mxfp8_nki.fn, kwargs=kernel_kwargs, lnc=lnc, grid_ndim=1,
                         trace=True)
    return tuple(np.asarray(o) for o in res.outputs), res.trace


def _touches(records, name, side):
    return [r for r in records if any(getattr(t, "name", "") == name for t in getattr(r, side))]


def _pass(trace, label):
    return [r for r in trace if r.attrs.get("phase") == label]


def _check_panels_used(trace, lnc):
    """Pass B builds no panel on chip and loads pass A's; pass A stores one words + one scales copy per chunk."""
    a, b = _pass(trace, "A"), _pass(trace, "B")
    assert b and not [r for r in b if r.instr in ("nc_transpose", "quantize_mx")], \
        sorted({r.instr for r in b})
    stored, loaded = _touches(a, PANELS, "writes"), _touches(b, PANELS, "reads")
    assert stored and loaded, (len(stored), len(loaded))
    assert len(_touches(a, SCALES, "writes")) == len(stored)
    for p in range(lnc):  # each core stores only its own chunks; both cores load the chunks of their H columns
        assert [r for r in stored if r.program == p], p
    return stored, loaded


@pytest.mark.parametrize("lnc", [1, 2])
def test_pass_b_loads_pass_a_panels(lnc):
    """T = 300, k = 2, B = 256 (full and padded blocks), H = 192 (LNC2: core 0 128 columns, core 1 64), I = 96:
    2I = 192 pads to one K tile of 256 (64 partitions; pass A's d_gate_up tile zeroed from column 192)."""
    T, E, k, H, I, B = 300, 3, 2, 192, 96, 256
    kernel, ref = moe_case(T, E, H, I, routing("random", T, E, k, seed=3), seed=21, block_size=B,
                           checkpoints=CHECKPOINTS)
    out, trace = _run(kernel, lnc)
    assert_outputs_identical(out, moe_backward_reference(**ref), f"d_gate_up panels, LNC{lnc} vs mx_exact")
    stored, loaded = _check_panels_used(trace, lnc)
    # pass B runs (and loads) a 128-row chunk when its first position holds a routed pair, on each core (both hold
    # H columns); pass A stores the chunks it computed: LNC1 the same ones (128-row units), LNC2 both chunks of
    # every used block (a core's 128 rows of a 256-row unit, which runs when position 0 holds a pair)
    used = int(kernel["expert_block_offsets"][-1])
    ids = np.asarray(kernel["token_position_to_id"]).reshape(-1, B)[:used]
    routed_chunks = int((ids[:, ::128] < T).sum())
    assert len(loaded) == routed_chunks * lnc, (len(loaded), routed_chunks)
    assert len(stored) == (routed_chunks if lnc == 1 else used * (B // 128)), (len(stored), routed_chunks, used)


@pytest.mark.parametrize("scale_packing", [True, False])
def test_panels_of_several_scale_tiles(scale_packing):
    """2I = 2112: K tiles of 512 x 4 and 128 (32 partitions); with scale packing two scale tiles (the second holds
    one K tile at offset 0), without five. GPT-OSS-style clamps, B = 256, LNC2."""
    T, E, k, H, I, B = 160, 2, 2, 128, 1056, 256
    kernel, ref = moe_case(T, E, H, I, routing("random", T, E, k, seed=8), seed=4, block_size=B,
                           checkpoints=("gate_pre", "up"), clamp_limits=CLAMPS, use_scale_packing=scale_packing)
    out, trace = _run(kernel, 2)
    assert_outputs_identical(out, moe_backward_reference(**ref), f"2I = 2112, packing {scale_packing} vs mx_exact")
    _check_panels_used(trace, 2)
    # round 17b: each chunk's K tiles are quantized in K order, those the last I tile completes after the others.
    # I tiles of 512 over I = 1056: K tile 3 (up columns 480..992) completes with I tile 1, K tile 2 (gate
    # 1024..1056, up 0..480) and K tile 4 (up 992..1056) with I tile 2, so K tile 3 goes before K tile 2
    words_bytes = 5 * 128 * 4  # the panel's words allocation per partition: five K tiles of [128] x4 words
    orders = {}
    for r in _pass(trace, "A"):
        w = r.writes[0] if r.instr == "quantize_mx" else None
        if w != None and w.dtype != "uint8" and w.alloc_bytes_per_partition == words_bytes:  # noqa: E711
            orders.setdefault((r.program, w.storage_id), []).append(w.byte_lo // (128 * 4))
    assert orders and all(o == [0, 1, 3, 2, 4] for o in orders.values()), orders


def test_unaligned_rows_keep_pass_b_panels():
    """B = 128 under LNC2: pass A's chunks are 64 rows per core, not pass B's 128-row chunks, so no panel is stored
    and pass B transposes and quantizes its d_gate_up rows as before (bit-exact either way)."""
    T, E, k, H, I, B = 150, 3, 2, 128, 64, 128
    kernel, ref = moe_case(T, E, H, I, routing("random", T, E, k, seed=6), seed=9, block_size=B,
                           checkpoints=CHECKPOINTS)
    out, trace = _run(kernel, 2)
    assert_outputs_identical(out, moe_backward_reference(**ref), "B = 128, LNC2 vs mx_exact")
    assert not _touches(trace, PANELS, "writes")
    b = _pass(trace, "B")
    assert [r for r in b if r.instr == "nc_transpose"] and [r for r in b if r.instr == "quantize_mx"]


@pytest.mark.parametrize("lnc", [1, 2])
def test_single_block_experts_panels(monkeypatch, lnc):
    """No resident budget (W_down and W_gu loaded on use, pass A's I tiles in resident groups: the DeepSeek-V3 rank's
    path), B = 256, k = 1, H = 2048 (LNC2: two H tiles per core), I = 544 (2I = 1088: three K tiles, zero columns up to
    1536). Experts of 256 (one full block), 100 (one block, its second chunk padding only), 300 (two blocks), 0 and 80
    pairs. Pass A computes all of I for every row of a one-block expert and stores its chunks' panels; pass B loads them
    for those experts (both chunks of each block, padding-only ones too: pass A computed them) and builds the two-block
    expert's panels from its bf16 rows (pass A ran that expert per I-tile group). Before round 8c no panel was made on
    this path. Since round 9b a full one-block expert splits I under LNC2, since round 14d every expert
    (tests/kernels/test_moe_i_split.py), so that split is off here."""
    monkeypatch.setattr(D, "RESIDENT_WEIGHT_BUDGET_BYTES", 0)
    monkeypatch.setattr(S.ExpertISplit, "applies", staticmethod(lambda ctx, w_down_resident, i_tiles: False))
    T, E, H, I, B = 736, 5, 2048, 544, 256
    ids = expert_routing([256, 100, 300, 80], experts=[0, 1, 2, 4], shuffle_seed=29)
    kernel, ref = moe_case(T, E, H, I, ids, seed=37, block_size=B, checkpoints=CHECKPOINTS)
    assert np.diff(kernel["expert_block_offsets"]).tolist() == [1, 1, 2, 0, 1]
    out, trace = _run(kernel, lnc)
    assert_outputs_identical(out, moe_backward_reference(**ref), f"one-block experts' panels, LNC{lnc} vs mx_exact")
    a, b = _pass(trace, "A"), _pass(trace, "B")
    stored, loaded = _touches(a, PANELS, "writes"), _touches(b, PANELS, "reads")
    single_chunks = 3 * (B // 128)  # experts 0, 1 and 4: one block of two 128-row chunks each
    assert len(stored) == single_chunks and len(_touches(a, SCALES, "writes")) == single_chunks, len(stored)
    assert len(loaded) == single_chunks * lnc, (len(loaded), lnc)
    for p in range(lnc):  # each core stores its own chunks (LNC2: one of every block's two)
        assert len([r for r in stored if r.program == p]) == single_chunks // lnc, p
    # pass B still transposes and quantizes the two-block expert's rows, read from the bf16 scratch once per
    # resident group of its H tiles: its 2 blocks x 2 chunks per core and group
    assert [r for r in b if r.instr == "nc_transpose"] and [r for r in b if r.instr == "quantize_mx"]
    bf16_reads = _touches([r for r in b if r.instr == "dma_copy"], "moe_bwd_d_gate_up", "reads")
    assert bf16_reads and len(bf16_reads) % (2 * (B // 128) * lnc) == 0, len(bf16_reads)
