"""Pass B's resident W_gu staged through pass C's kernel-scope ring (docs/moe.md section 10, round 9a): without the A/B
interleave (GPT-OSS-20B's path: both passes' weights over INTERLEAVE_PANEL_BUDGET_BYTES together), B(e)'s W_gu staging
DMAs write into pass C's staging tiles, which no tile of pass A(a) shares, instead of fresh tiles that next-fit placed
over A(a)'s. The bits do not change: the outputs equal mx_exact, LNC1 and LNC2.

| test                              | what                                                            | fixed      |
|-----------------------------------|-----------------------------------------------------------------|------------|
| test_w_gu_staged_in_pass_c_ring   | balanced, B = 512, two blocks per expert, all checkpoints, the  | LNC1, LNC2 |
|                                   | interleave off: every W_gu staging DMA writes a tile that pass  |            |
|                                   | C's operand loads also write (fails on main: fresh tiles), and  |            |
|                                   | pass A's tiles never; bit-exact vs mx_exact                     |            |
| test_w_gu_staging_ring_bit_exact  | unequal experts (a padded last block, one block, an empty one), | LNC1, LNC2 |
|                                   | with and without checkpoints: bit-exact vs mx_exact             |            |
| test_ring_weight_loads_per_slot   | whole K tiles (2I = H = 512), two fence groups: every W_gu      | LNC1, LNC2 |
|                                   | staging DMA and every W_down DMA into pass C's ring fills one   |            |
|                                   | MX slot (four per K tile; round 30c: fails on main, one DMA per |            |
|                                   | K tile); bit-exact vs mx_exact                                  |            |
"""
from __future__ import annotations

import numpy as np
import pytest

from nkilib.experimental.moe_mxfp8 import moe_bwd_mxfp8_kernel as kernel_module
from nkilib.experimental.moe_mxfp8.reference import moe_backward_reference
from nkilib.simulator.launcher import run_kernel
from simkit import assert_outputs_identical, sbuf_tiles_loaded, touches
from test_moe_bwd_kernel import CLAMPS, moe_case

CHECKPOINTS = ("gate_pre", "gate_act", "up", "intermediate")
T, E, H, I, B = 1024, 4, 256, 96, 512  # H: two SPLIT_ALIGN (128) units, pass B columns on both cores
# pass C's operand rows (block-ordered scratch) and pass A's gathered inputs, by HBM tensor name (not W_down: the
# first A after a fence has it loaded before the fence through pass C's ring too, round 26b)
PASS_C_SOURCES = ("moe_bwd_d_gate_up", "moe_bwd_x_blocks", "moe_bwd_dy_blocks", "moe_bwd_weighted_inter")
PASS_A_SOURCES = ("output_grad", "hidden_states")


def _run(kernel, lnc, monkeypatch, trace=False):
    # the interleave off: B(e) after A(a) with its own W_gu load, as for GPT-OSS-20B (whose panels exceed the budget)
    monkeypatch.setattr(kernel_module, "INTERLEAVE_PANEL_BUDGET_BYTES", 0)
    return run_kernel(kernel_module.moe_backward_mxfp8_nki.fn, kwargs=kernel, lnc=lnc, grid_ndim=1, trace=trace)


@pytest.mark.parametrize("lnc", [1, 2])
def test_w_gu_staged_in_pass_c_ring(lnc, monkeypatch):
    ids = np.tile(np.arange(E, dtype=np.int32), (T, 1))  # k = 4: every expert 1024 pairs, two full blocks
    kernel, ref = moe_case(T, E, H, I, ids, seed=91, block_size=B, checkpoints=CHECKPOINTS, clamp_limits=CLAMPS)
    res = _run(kernel, lnc, monkeypatch, trace=True)
    assert_outputs_identical(tuple(np.asarray(o) for o in res.outputs), moe_backward_reference(**ref),
                             f"W_gu staged in pass C's ring (balanced), LNC{lnc} vs mx_exact")
    for program in range(lnc):
        records = [r for r in res.trace if r.program == program]
        # with every checkpoint given pass A reads no W_gu: each DMA that reads it is pass B's staging load
        w_gu = sbuf_tiles_loaded(records, lambda r: touches(r, "gate_up_weight"))
        pass_c = sbuf_tiles_loaded(records, lambda r: any(touches(r, n) for n in PASS_C_SOURCES))
        pass_a = sbuf_tiles_loaded(records, lambda r: any(touches(r, n) for n in PASS_A_SOURCES))
        assert w_gu, f"core {program}: no W_gu staging load in the trace"
        assert w_gu <= pass_c, f"core {program}: W_gu staging tiles {sorted(w_gu - pass_c)} are not pass C's ring"
        assert not w_gu & pass_a, f"core {program}: W_gu staging shares tiles {sorted(w_gu & pass_a)} with pass A"


@pytest.mark.parametrize("lnc", [1, 2])
@pytest.mark.parametrize("checkpoints", [CHECKPOINTS, ()])
def test_w_gu_staging_ring_bit_exact(checkpoints, lnc, monkeypatch):
    ids = np.zeros((T, 2), np.int32)  # blocks per expert: 2 (a full and a padded) / 1 padded / 0 / 1 padded
    ids[:, 0], ids[:400, 1], ids[400:, 1] = 0, 1, 3
    kernel, ref = moe_case(T, E, H, I, ids, seed=92, block_size=B, checkpoints=checkpoints, clamp_limits=CLAMPS)
    res = _run(kernel, lnc, monkeypatch)
    assert_outputs_identical(tuple(np.asarray(o) for o in res.outputs), moe_backward_reference(**ref),
                             f"W_gu staged in pass C's ring (checkpoints {bool(checkpoints)}), LNC{lnc} vs mx_exact")


@pytest.mark.parametrize("lnc", [1, 2])
def test_ring_weight_loads_per_slot(lnc, monkeypatch):
    # whole K tiles (K = 2I = 512 for W_gu, K = H = 512 for W_down): main stages each by one [128, 4, F] DMA; round 30c
    # by one [128, F] DMA per MX slot (RING_WEIGHT_DMA_PER_SLOT), the same bytes into the same staging tile
    h, i = 512, 256
    ids = np.tile(np.arange(E, dtype=np.int32), (T, 1))  # k = 4: every expert two full blocks, two fence groups
    kernel, ref = moe_case(T, E, h, i, ids, seed=93, block_size=B, checkpoints=CHECKPOINTS, clamp_limits=CLAMPS)
    res = _run(kernel, lnc, monkeypatch, trace=True)
    assert_outputs_identical(tuple(np.asarray(o) for o in res.outputs), moe_backward_reference(**ref),
                             f"ring weight loads per MX slot, LNC{lnc} vs mx_exact")
    for program in range(lnc):
        records = [r for r in res.trace if r.program == program and r.instr == "dma_copy"]
        pass_c = sbuf_tiles_loaded(records, lambda r: any(touches(r, n) for n in PASS_C_SOURCES))

        def ring_loads(name):
            return [r for r in records if touches(r, name) and any(w.storage_id in pass_c for w in r.writes)]

        w_gu, w_down = ring_loads("gate_up_weight"), ring_loads("down_weight")
        assert w_gu and w_down, f"core {program}: {len(w_gu)} W_gu and {len(w_down)} W_down loads into pass C's ring"
        for name, loads in (("W_gu", w_gu), ("W_down", w_down)):
            shapes = sorted({tuple(w.shape) for r in loads for w in r.writes})
            assert all(len(s) == 2 and s[0] <= 128 for s in shapes), \
                f"core {program}: {name} ring loads write {shapes}, not one MX slot ([<= 128, F]) each"
