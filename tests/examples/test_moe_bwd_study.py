"""The MoE backward study (simulations/moe_bwd_study.py, nkilib.examples.moe_backward_cost): routing
generators, the useful-FLOP and padding counts against hand computations, capacity refusal, --quick."""
import csv
import dataclasses
import json
import os
import re
import warnings

import numpy as np
import pytest

from nkilib.examples.moe_backward_cost import (MOE_PRESETS, choose_block_size, moe_modeled_backward, padding_counts,
                                               useful_flops)
from nkilib.examples.moe_routing_scenarios import balanced_topk_ids, expert_token_counts, make_topk_ids, zipf_topk_ids
from nkilib.simulator.hardware import resolve_target
from scriptkit import load_script

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def _study():
    return load_script("moe_bwd_study")


def _distinct_per_token(ids):
    srt = np.sort(ids, axis=1)
    return bool(np.all(srt[:, 1:] != srt[:, :-1]))


# ---- routing generators ----
@pytest.mark.parametrize("T,k,E", [(4096, 8, 128), (4096, 4, 32), (4096, 1, 32), (64, 32, 32)])
def test_balanced_routing_is_exactly_balanced(T, k, E):
    ids = balanced_topk_ids(T, k, E)
    assert ids.shape == (T, k) and ids.dtype == np.int32
    assert _distinct_per_token(ids)
    assert np.all(expert_token_counts(ids, E) == T * k // E)  # E divides T*k in these cases


def test_balanced_routing_when_e_does_not_divide():
    counts = expert_token_counts(balanced_topk_ids(100, 3, 7), 7)  # 300 slots over 7 experts: 42 or 43 each
    assert counts.sum() == 300 and set(counts.tolist()) == {42, 43}


def test_zipf_routing_reproducible_and_skewed():
    a = zipf_topk_ids(4096, 4, 32, exponent=1.0, seed=3)
    assert np.array_equal(a, zipf_topk_ids(4096, 4, 32, exponent=1.0, seed=3))
    assert not np.array_equal(a, zipf_topk_ids(4096, 4, 32, exponent=1.0, seed=4))
    assert np.array_equal(a, make_topk_ids("zipf", 4096, 4, 32, seed=3, zipf_exponent=1.0))
    assert a.dtype == np.int32 and a.min() >= 0 and a.max() < 32 and _distinct_per_token(a)
    counts = expert_token_counts(a, 32)
    # rank-1 popularity 1/H_32 = 0.246 vs mean 1/32: with 4 distinct picks the top expert is in most tokens
    assert counts.max() > 3 * counts.mean()
    flat = expert_token_counts(zipf_topk_ids(16384, 4, 32, exponent=0.0, seed=0), 32)  # exponent 0 = uniform
    assert flat.max() < 1.1 * flat.mean()


def test_routing_bad_input_named():
    with pytest.raises(ValueError, match="top_k=9 must be <= num_experts=8"):
        balanced_topk_ids(16, 9, 8)
    with pytest.raises(ValueError, match="routing must be one of"):
        make_topk_ids("uniform", 16, 2, 8)
    with pytest.raises(ValueError, match="exponent must be a finite number >= 0"):
        zipf_topk_ids(16, 2, 8, exponent=-1.0)


# ---- FLOP and padding counts (hand computations) ----
def test_padding_counts_by_hand():
    # blocks of 128: 0 -> 0, 1 -> 1, 128 -> 1, 129 -> 2, 300 -> 3: 7 blocks, 896 positions, 558 pairs
    got = padding_counts([0, 1, 128, 129, 300], 128)
    assert got == {"pairs": 558, "used_blocks": 7, "positions": 896, "padding_positions": 338,
                   "padding_overhead": pytest.approx(896 / 558 - 1)}


def test_useful_flops_and_kernel_shapes_by_hand():
    assert useful_flops(4096, 7168, 2048) == 12 * 4096 * 7168 * 2048
    # DeepSeek-V3 per EP-8 rank: 4096 tokens x 8 experts x 32 of 256 experts local = 4096 pairs, k = 1 rows
    assert MOE_PRESETS["deepseek-v3-ep8"].kernel_routing_shape(4096) == (4096, 1)
    assert MOE_PRESETS["qwen3-30b-a3b"].kernel_routing_shape(4096) == (4096, 8)
    # balanced load per expert: Qwen3 4096*8/128 = 256, 16384*8/128 = 1024, DeepSeek 4096/32 = 128, tiny 256*2/8 = 64
    assert [choose_block_size(4096 * 8, 128), choose_block_size(16384 * 8, 128), choose_block_size(4096, 32),
            choose_block_size(512, 8)] == [256, 512, 128, 128]


# ---- the study ----
def test_quick_study_smoke(tmp_path):
    """--quick: tiny shape, both routings, band, dense comparison, JSON + CSV + plots; the counts match the
    hand computation (tiny: H=256, I=128, E=8, k=2, T=256)."""
    results = _study().main(["--quick", "--out", str(tmp_path)])
    assert sorted(os.listdir(tmp_path)) == ["moe_bwd_mfu.png", "moe_bwd_phases.png", "moe_bwd_study.csv",
                                            "moe_bwd_study.json"]
    bal, zipf = results["tiny/T256/balanced"], results["tiny/T256/zipf"]
    pairs = 256 * 2
    assert bal.useful_flops == 12 * pairs * 256 * 128
    # balanced: 64 pairs per expert -> one 128-row block each: 8 blocks, 1024 positions, overhead 100%
    assert bal.padding["used_blocks"] == 8 and bal.padding["padding_overhead"] == pytest.approx(1.0)
    # the kernel multiplies every block position: executed matmul FLOPs = useful x (1 + padding overhead)
    for r in (bal, zipf):
        assert r.executed_matmul_flops == pytest.approx(r.useful_flops * (1 + r.padding["padding_overhead"]))
        c, p = r.scenarios["central"], r.scenarios["pessimistic"]
        assert not r.refused and 0 < c["modeled_time_s"] < p["modeled_time_s"]
        assert c["mfu"] == pytest.approx(r.useful_flops / (c["modeled_time_s"] * 4 * 2 * 2 * 128 * 128 * 2.4e9),
                                         rel=1e-6)
        assert r.dense["central"]["modeled_time_s"] > 0
    assert zipf.expert_load["max_over_mean"] > 1.5 and zipf.padding["used_blocks"] > 8
    with open(tmp_path / "moe_bwd_study.json") as f:
        assert set(json.load(f)) == {"tiny/T256/balanced", "tiny/T256/zipf"}
    with open(tmp_path / "moe_bwd_study.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["routing"] for r in rows] == ["balanced", "zipf"] and float(rows[0]["padding_overhead"]) == 1.0


def test_capacity_refusal_reports_no_time():
    """A plan whose modeled overlap needs more SBUF than the target has is refused: no time, no MFU, the
    plan errors and the would-be time kept (the same run on the real trn3 is not refused)."""
    # the tiny plan needs more than 8.5 KiB of SBUF per partition (program order and modeled overlap; the
    # run itself uses the real trn3 capacity), so a target of 8.5 KiB refuses it
    small = dataclasses.replace(resolve_target("trn3"), sbuf_bytes_per_partition=8704)
    r = moe_modeled_backward("tiny", 256, "balanced", dense=False, target=small, scenarios=("central",))
    c = r.scenarios["central"]
    assert r.refused and r.time() is None and r.mfu() is None
    assert c["invalid_modeled_time_s"] > 0
    for what in ("plan", "modeled overlap"):
        needs = [re.fullmatch(rf"core 0: the {what} needs (\d+\.\d) KiB of SBUF per partition, the target has 8 KiB", e)
                 for e in c["plan_errors"]]
        assert any(m and float(m.group(1)) > 8.5 for m in needs), (what, c["plan_errors"])
    lines = _study().format_rows({"tiny/T256/balanced": r}, ("central",))
    assert "refused (would be" in lines[2] and any("refused: core 0" in ln for ln in lines[3:])
    ok = moe_modeled_backward("tiny", 256, "balanced", dense=False, scenarios=("central",))
    assert not ok.refused and ok.time() > 0


def test_readme_moe_table_matches_the_committed_study_data():
    """The README's MoE table quotes simulations/data/moe_bwd_study.json (central / pessimistic ms, % of peak);
    a refused configuration is quoted as refused, with the would-be time the study reports beside it."""
    with open(os.path.join(ROOT, "simulations", "data", "moe_bwd_study.json")) as f:
        data = json.load(f)
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    section = readme.split("### MoE backward, modeled", 1)[1].split("\n## ", 1)[0]
    rows = [ln for ln in section.splitlines() if ln.startswith("| ") and " | " in ln]
    quoted = 0
    for key, r in data.items():
        c, p = r["scenarios"]["central"], r["scenarios"]["pessimistic"]
        if c["modeled_time_s"] is None:
            assert c["plan_errors"], key
            cell = (f"| refused (would be {c['invalid_modeled_time_s'] * 1e3:.1f} / "
                    f"{p['invalid_modeled_time_s'] * 1e3:.1f}) |")
        else:
            cell = (f"| {c['modeled_time_s'] * 1e3:.1f} / {p['modeled_time_s'] * 1e3:.1f} | "
                    f"{c['mfu'] * 100:.1f} / {p['mfu'] * 100:.1f} |")
        assert any(cell in ln and f"| {r['tokens']} |" in ln for ln in rows), (key, cell)
        quoted += 1
    assert quoted == len(data) == 12  # every configuration of the committed study is quoted


def test_block_size_whose_run_overflows_sbuf_is_refused_and_a_smaller_one_tried(monkeypatch):
    """A run that raises CapacityError (the kernel's own allocations overflow SBUF) refuses that B and the
    next smaller multiple of 128 is tried; every B refused -> no time at all."""
    from nkilib.examples import moe_backward_cost as mbc
    from nkilib.simulator.errors import CapacityError

    real = mbc.model_kernel

    def overflow_above_128(fn, inputs, **kw):
        if kw["kwargs"]["block_size"] > 128:
            raise CapacityError(f"nl.ndarray: block_size {kw['kwargs']['block_size']} overflows")
        return real(fn, inputs, **kw)

    monkeypatch.setattr(mbc, "model_kernel", overflow_above_128)
    # 1024 tokens x 2 / 8 experts = 256 per expert: B = 256 chosen, refused, then 128 runs
    with pytest.warns(UserWarning, match=r"'tiny', tokens=1024.*block_size 256 refused .*modeled at block_size 128"):
        r = moe_modeled_backward("tiny", 1024, "balanced", dense=False, scenarios=("central",))
    assert list(r.refused_block_sizes) == [256] and "block_size 256 overflows" in r.refused_block_sizes[256]
    assert r.block_size == 128 and not r.refused and r.padding["used_blocks"] == 16

    def always(fn, inputs, **kw):
        raise CapacityError("nl.ndarray: no room")

    monkeypatch.setattr(mbc, "model_kernel", always)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every B refused: the result says so (no time), no fallback to warn about
        r = moe_modeled_backward("tiny", 256, "balanced", dense=False, scenarios=("central",))
    assert r.refused and r.time() is None and list(r.refused_block_sizes) == [128]
    assert "overflow on-chip memory in the run: nl.ndarray: no room" in r.scenarios["central"]["plan_errors"][0]


def test_jobs_run_configurations_in_processes_with_the_same_numbers(tmp_path):
    """--jobs 2 (spawned processes) gives the numbers of the in-process run, in the study's order."""
    args = ["--presets", "tiny", "--tokens", "256", "--central", "--no-dense"]
    one = _study().main(args + ["--out", str(tmp_path / "one")])
    two = _study().main(args + ["--jobs", "2", "--out", str(tmp_path / "two")])
    assert list(two) == list(one) == ["tiny/T256/balanced", "tiny/T256/zipf"]
    for k in one:
        assert two[k].time() == one[k].time() and two[k].padding == one[k].padding


def test_sbuf_reuse_diagnostic_separates_reuse_waits_on_the_tiny_shape():
    """simulations/moe_sbuf_reuse.py (docs/moe.md round 9) wraps the cost model's private _memory_reuse_deps: it must
    still find it, restore it, see data edges on the critical path and per-phase live SBUF within the target's."""
    import nkilib.examples.moe_backward_cost as cost_module
    import nkilib.simulator.cost.scheduler as scheduler
    from nkilib.simulator.hardware import TRN3

    diag = load_script("moe_sbuf_reuse")
    before = (scheduler._memory_reuse_deps, cost_module.model_kernel)
    res, waits = diag.run("tiny", "waits")
    assert (scheduler._memory_reuse_deps, cost_module.model_kernel) == before
    assert res.scenarios["central"]["modeled_time_s"] > 0
    assert waits["critical_path_edges"].get("data", 0) > 0, waits
    peaks = waits["peak_live_sbuf_bytes"]
    assert peaks and all(0 < b <= TRN3.sbuf_bytes_per_partition for b in peaks.values()), peaks


def test_skew_shapes_keep_the_full_zipf_block_histogram():
    """simulations/moe_skew_shapes.py (docs/moe.md round 9c): each hand-made routing gives every expert its pairs, no
    token one expert twice, and the blocks the round's table names (gzp 36 for 32, gwz 51 for 48 at B = 512)."""
    diag = load_script("moe_skew_shapes")
    blocks = {"gzp": [4, 3, 3, 2, 2, 14, 6, 2], "gwz": [3, 6, 3, 23, 4, 3, 5, 4]}
    for name, expected in blocks.items():
        counts, T, preset = diag.SHAPES[name]
        ids = diag.handmade_topk_ids(counts, T, preset.top_k)
        assert ids.shape == (T, preset.top_k) and all(len(set(row)) == preset.top_k for row in ids)
        assert expert_token_counts(ids, preset.experts).tolist() == counts
        assert [-(-c // 512) for c in counts] == expected
        assert padding_counts(np.array(counts), 512)["used_blocks"] == sum(expected)


def test_qwen_skew_shape_is_every_8th_expert_of_the_full_zipf():
    """simulations/moe_skew_shapes.py's qz (docs/moe.md round 15c): Qwen3-30B-A3B's full Zipf routing at T = 16384
    (seed 0), its experts of load rank 0, 8, ..., 120 (the hottest, 27 blocks at B = 512, kept) in a seeded order;
    qb its balanced counterpart of about as many pairs at the full balanced run's 2 blocks per expert."""
    diag = load_script("moe_skew_shapes")
    preset = MOE_PRESETS["qwen3-30b-a3b"]
    full = expert_token_counts(make_topk_ids("zipf", 16384, preset.top_k, preset.experts, seed=0), preset.experts)
    every_8th = sorted(full.tolist(), reverse=True)[::8]
    counts, T, qz = diag.SHAPES["qz"]
    order = np.random.default_rng(0).permutation(len(every_8th))
    assert counts == [every_8th[i] for i in order] and (qz.hidden, qz.intermediate) == (2048, 768)
    assert [-(-c // 512) for c in counts] == [4, 1, 3, 1, 27, 2, 1, 2, 1, 1, 2, 1, 1, 1, 6, 1]
    ids = diag.handmade_topk_ids(counts, T, qz.top_k)
    assert expert_token_counts(ids, qz.experts).tolist() == counts
    balanced, T_b, qb = diag.SHAPES["qb"]
    assert balanced is None and T_b * qb.top_k == 1024 * qb.experts and abs(T_b - T) < 0.01 * T
