"""W_down quantized once per LNC2 core pair (moe_bwd_mxfp8_down_exchange.py; docs/moe.md sections 5 and 10, round 7b).

A W_down loaded on use (not resident) is quantized in halves of its K tiles, one half per core, a pipeline segment
before pass A reads it; the halves meet in an HBM scratch in the panel layout, with a core_barrier between every store
and every load. The words are quantize_mx's either way, so the outputs stay mx_exact's bit for bit, LNC1 (no
exchange) and LNC2 (under the simulator's race detector).

| test                                | what                                                              | fixed      |
|-------------------------------------|-------------------------------------------------------------------|------------|
| test_exchange_bit_exact             | experts after the first fence group exchanged, none under LNC1    | LNC1, LNC2 |
| test_exchange_applies_only_on_use   | resident W_down, LNC1, BF16 or H not whole K tiles: no exchange   | host side  |
| test_resident_exchange_partial_tile | the pipeline (resident W_down): each later group's second expert  | LNC1, LNC2 |
|                                     | exchanged, H = 832 (K tiles of 512 and 320 rows, one per core)    |            |
| test_resident_exchange_by_w_down_size | Qwen3's W_down exchanged when resident, GPT-OSS-20B's not       | host side  |
| test_exchange_of_picks_experts      | of(): on use every expert after the first group, resident each    | in kernel  |
|                                     | later group's experts after its first, None otherwise; BF16 fails |            |

The resident exchange (round 25b): each fence group's second A read W_down from HBM at its start (loaded and quantized
there); it now reads the scratch, including a partial last K tile (320 rows: 96 partitions stored and loaded).
"""
from __future__ import annotations

import numpy as np
import pytest

import nki.language as nl
from nkilib.core.matmul import CoreSplit, MatmulSetup
from nkilib.experimental.moe_mxfp8 import moe_bwd_mxfp8_down_exchange as X
from nkilib.experimental.moe_mxfp8 import moe_bwd_mxfp8_dx as D
from nkilib.experimental.moe_mxfp8.reference import moe_backward_reference
from moekit import expert_routing
from simkit import assert_outputs_identical, in_kernel, spy
from test_moe_bwd_kernel import CLAMPS, moe_case, run


def record_exchange(monkeypatch):
    """Lists, filled as the kernel traces, of (expert, t_lo, t_hi) the exchange quantized and of the HBM scratch names
    pass A loaded in the panel layout (the exchange's reads)."""
    quantized = spy(monkeypatch, X.DownWeightExchange, "quantize", lambda self, e: (e, self.t_lo, self.t_hi))
    loaded = spy(monkeypatch, D.ExpertPanels, "_load",
                 lambda self, *args, **kwargs: self.op.tensor.name if self.op.panel_layout else None)
    return quantized, loaded


@pytest.mark.parametrize("lnc", [1, 2])
def test_exchange_bit_exact(monkeypatch, lnc):
    """No resident budget (weights loaded on use), H = 1024 (two MX K tiles: one per core), five experts in fence
    groups [0, 1], [2, 3], [4] with expert 3 empty and expert 2 of two blocks (its W_down resident per I-tile group,
    loaded from the scratch once per group), B = 128, k = 1. Under LNC2 experts 2 and 4 are quantized by halves (in
    the prologue and in the first segment) and pass A reads their scratch; under LNC1 nothing is exchanged."""
    monkeypatch.setattr(D, "RESIDENT_WEIGHT_BUDGET_BYTES", 0)
    T, E, H, I = 440, 5, 1024, 544
    ids = expert_routing([100, 60, 200, 80], experts=[0, 1, 2, 4], shuffle_seed=17)
    kernel, ref = moe_case(T, E, H, I, ids, seed=61, checkpoints=("gate_pre", "gate_act", "up", "intermediate"))
    assert np.diff(kernel["expert_block_offsets"]).tolist() == [1, 1, 2, 0, 1]
    quantized, loaded = record_exchange(monkeypatch)
    out = run(kernel, lnc=lnc)
    assert_outputs_identical(out, moe_backward_reference(**ref), f"LNC{lnc} W_down exchange vs mx_exact")
    if lnc == 1:
        assert quantized == [] and loaded == []
        return
    # per core (each traces the kernel): its one K tile of experts 2 and 4 (the empty expert 3 runs no quantize)
    assert sorted(e for e, _, _ in quantized) == [2, 2, 4, 4], quantized
    assert sorted((lo, hi) for _, lo, hi in quantized) == [(0, 1), (0, 1), (1, 2), (1, 2)], quantized
    assert set(loaded) == {"moe_bwd_down_mx_2", "moe_bwd_down_mx_4"}, loaded


class _Ctx:
    def __init__(self, H, cores, precision="mxfp8", I=2048, E=6):
        self.H, self.I, self.E, self.split = H, I, E, CoreSplit(cores, 0)
        self.setup = MatmulSetup(precision, nl.float8_e4m3fn_x4, "1x32", True)


def test_exchange_applies_only_on_use():
    """The exchange only pays where W_down is loaded per use on two cores (DeepSeek-V3's rank); a resident W_down is
    quantized once per expert and core already, one core has no partner, BF16 has no quantize."""
    assert X.DownWeightExchange.applies(_Ctx(7168, 2), w_down_resident=False)
    assert not X.DownWeightExchange.applies(_Ctx(7168, 2), w_down_resident=True)
    assert not X.DownWeightExchange.applies(_Ctx(7168, 1), w_down_resident=False)
    assert not X.DownWeightExchange.applies(_Ctx(7168, 2, "bf16"), w_down_resident=False)
    assert not X.DownWeightExchange.applies(_Ctx(2880, 2), w_down_resident=False)  # GPT-OSS-20B: H % 512 != 0


@pytest.mark.parametrize("lnc", [1, 2])
def test_resident_exchange_partial_tile(monkeypatch, lnc):
    """The chunk pipeline with W_down resident (B = 512, clamped, every checkpoint), E = 4 in fence groups [0, 1],
    [2, 3] (tokens 0..511 to experts 0 and 1, the rest to 2 and 3: one full block each), H = 832: K tiles of 512 and
    320 rows.
    Under LNC2 expert 3 (the second group's second expert) is exchanged: core 0 quantizes K tile 0, core 1 the partial
    K tile 1, and A(3) loads both from the scratch; expert 2 (the first A after the fence) loads its own before it
    (round 18a), so only 3's scratch is read. Outputs == mx_exact. Fails on the old code (no exchange for a resident
    W_down: nothing quantized or loaded) and with the partial tile loaded on 128 partitions (nc_matmul_mx refuses a
    96-partition stationary against a 128-partition moving K tile)."""
    T, E, H, I = 1024, 4, 832, 96
    ids = np.zeros((T, 2), np.int32)
    ids[:512] = (0, 1)
    ids[512:] = (2, 3)
    kernel, ref = moe_case(T, E, H, I, ids, seed=251, block_size=512, clamp_limits=CLAMPS,
                           checkpoints=("gate_pre", "gate_act", "up", "intermediate"))
    quantized, loaded = record_exchange(monkeypatch)
    out = run(kernel, lnc=lnc)
    assert_outputs_identical(out, moe_backward_reference(**ref), f"LNC{lnc} resident W_down exchange vs mx_exact")
    if lnc == 1:
        assert quantized == [] and loaded == []
        return
    assert sorted(quantized) == [(3, 0, 1), (3, 1, 2)], quantized
    assert set(loaded) == {"moe_bwd_down_mx_3"}, loaded


def test_resident_exchange_by_w_down_size():
    """The resident exchange (round 25b) takes a pipelined pass A's W_down up to RESIDENT_DOWN_EXCHANGE_MAX_BYTES bf16:
    Qwen3-30B-A3B's [2048, 768] (3 MiB, whose full run gains), not GPT-OSS-20B's [2880, 2880] (15.8 MiB, whose full run
    loses); not without the pipeline, under LNC1 or in BF16."""
    assert X.DownWeightExchange.applies_resident(_Ctx(2048, 2, I=768), w_down_resident=True, pipelined=True)
    assert not X.DownWeightExchange.applies_resident(_Ctx(2880, 2, I=2880), w_down_resident=True, pipelined=True)
    assert not X.DownWeightExchange.applies_resident(_Ctx(2048, 2, I=768), w_down_resident=True, pipelined=False)
    assert not X.DownWeightExchange.applies_resident(_Ctx(2048, 1, I=768), w_down_resident=True, pipelined=True)
    assert not X.DownWeightExchange.applies_resident(_Ctx(2048, 2, "bf16", I=768), w_down_resident=True,
                                                     pipelined=True)
    assert not X.DownWeightExchange.applies_resident(_Ctx(2048, 2, I=768), w_down_resident=False, pipelined=True)


def test_exchange_of_picks_experts():
    """DownWeightExchange.of over three fence groups of two experts: loaded on use (H = 1024), every expert after the
    first group (its A runs before the first fence); resident in the pipeline (Qwen3's [2048, 768]), each later group's
    experts after its first (that one loads its own W_down before the fence, round 18a); None with one group, a
    resident W_down over RESIDENT_DOWN_EXCHANGE_MAX_BYTES (GPT-OSS-20B's [2880, 2880]) or LNC1. The constructor
    refuses BF16 (it stores MXFP8 words)."""
    groups = [[0, 1], [2, 3], [4, 5]]

    def body():
        of = X.DownWeightExchange.of
        picked = [of(_Ctx(1024, 2), groups, w_down_resident=False, pipelined=False),
                  of(_Ctx(2048, 2, I=768), groups, w_down_resident=True, pipelined=True)]
        none = [of(_Ctx(1024, 2), groups[:1], w_down_resident=False, pipelined=False),
                of(_Ctx(2880, 2, I=2880), groups, w_down_resident=True, pipelined=True),
                of(_Ctx(2048, 1, I=768), groups, w_down_resident=True, pipelined=True)]
        return [x.experts for x in picked], none

    picked, none = in_kernel(body)
    assert picked == [[2, 3, 4, 5], [3, 5]], picked
    assert none == [None, None, None], none
    with pytest.raises(AssertionError, match="DownWeightExchange stores MXFP8 words, got precision bf16"):
        X.DownWeightExchange(_Ctx(1024, 2, "bf16"), [2])
