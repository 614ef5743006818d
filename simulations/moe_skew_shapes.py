"""MoE backward: reduced GPT-OSS-20B and Qwen3-30B-A3B shapes for skewed routing, and where a run's time goes per pipeline segment.

Diagnostic for docs/moe.md section 10, round 9c. Usage (from the repository root, 1-5 minutes per shape):
    PYTHONPATH=$PWD python simulations/moe_skew_shapes.py time gb gzp      # central / pessimistic, per-phase critical path
    PYTHONPATH=$PWD python simulations/moe_skew_shapes.py segments gzp     # core 0's segments (split by core_barrier)
    SEGMENTS=4,5 PYTHONPATH=$PWD python simulations/moe_skew_shapes.py walk qz  # per segment (all without SEGMENTS):
        # core 0's DMAs by tensor / payload against a DMA-bound floor, its critical path walked through Schedule.blocker

Shapes: GPT-OSS-20B's H = I = 2880 (clamped), 8 experts, k = 2, B = 512, LNC2, all checkpoints. The full preset's Zipf
routing at T = 16384 (seed 0) gives its 32 experts 23, 15, 11, 9, 7, 6, 6, 5, 4 x 4, 6 x 3 and 14 x 2 blocks: 144 blocks
for 128 blocks' pairs (+12.5%). The hand-made routings below keep that histogram's shape on 8 experts (k = 2, because a
token routes to k distinct experts and an expert may hold at most T pairs):
    gb   balanced, T = 8192: 8 x 2048 pairs (4 blocks each, 32 blocks)
    gzp  T = 8192: 1950 / 1100 / 1400 / 700 / 900 / 6900 / 2900 / 534 pairs = 4, 3, 3, 2, 2, 14 (parts of 3), 6, 2 blocks
         (36 blocks, +12.5%), in the order of default_rng(0).permutation(8) of the sorted counts
    gwb  balanced, T = 12288: 8 x 3072 pairs (6 blocks each, 48 blocks)
    gwz  T = 12288: the full Zipf's hottest expert (11725 pairs: 23 blocks, windows 8 + 8 + 7) and seven of its others,
         1514 / 3000 / 1337 / 11725 / 1980 / 1025 / 2332 / 1663 pairs = 3, 6, 3, 23, 4, 3, 5, 4 blocks (51 for 48)
    dsz  the DeepSeek-V3 rank's H = 7168, I = 2048, k = 1: round 8b's 4054 / 1288 / 333 / 162 / 154 / 136 pairs
    qb   Qwen3-30B-A3B's H = 2048, I = 768, k = 1, balanced: 24 x 1024 pairs (2 blocks each, as the full preset's
         balanced run at T = 16384), T = 24576 (48 blocks); 20 s
    qz   the same H, I, k = 1: the full Qwen3 Zipf's (T = 16384, seed 0) experts of load rank 0, 8, ..., 120, its hottest
         (13754 pairs: 27 blocks, windows 16 + 11) included: 24719 pairs in 4, 1, 3, 1, 27, 2, 1, 2, 1, 1, 2, 1, 1, 1, 6,
         1 blocks (55 for 48.3 blocks' pairs; the full preset 314 for 256), in a seeded order (round 15c); 20 s
Checkpoints are block-ordered (the study's default) unless LAYOUT=slot (the API default, rounds 9c-12a's numbers);
the routing weights too (round 30b) unless WEIGHTS_LAYOUT=slot (the numbers before round 30b).
The routed pairs of each expert are laid out over the tokens column by column (no token gets one expert twice) and the
tokens shuffled (seed 0). Wraps moe_backward_cost.make_topk_ids and model_kernel: a diagnostic, not an API.
"""
import bisect
import collections
import os
import re
import sys
import time

import numpy as np

import nkilib.examples.moe_backward_cost as M
from nkilib.examples.moe_backward_cost import MoePreset

GPT_OSS = MoePreset("gptoss8", 2880, 2880, 8, 2, clamped=True)
#: Qwen3-30B-A3B's Zipf pairs at T = 16384 (seed 0), its experts of load rank 0, 8, ..., 120 (27, 6, 4, 3, 2, 2, 2 and
#: 9 x 1 blocks) in the order of default_rng(0).permutation(16)
QWEN_ZIPF_EVERY_8TH = [1598, 331, 1149, 357, 13754, 855, 504, 680, 265, 305, 575, 401, 287, 444, 2978, 236]
#: name -> (pairs per expert or None for balanced, tokens T, preset)
SHAPES = {"gb": (None, 8192, GPT_OSS), "gzp": ([1950, 1100, 1400, 700, 900, 6900, 2900, 534], 8192, GPT_OSS),
          "gwb": (None, 12288, GPT_OSS), "gwz": ([1514, 3000, 1337, 11725, 1980, 1025, 2332, 1663], 12288, GPT_OSS),
          # round 8b's skewed DeepSeek-V3 rank shape (k = 1 rows): 8 blocks (parts of 2), 3, and four single blocks
          "dsz": ([4054, 1288, 333, 162, 154, 136], 6127, MoePreset("ds6", 7168, 2048, 6, 1)),
          # Qwen3-30B-A3B's H, I with k = 1 rows (round 15c): the full Zipf's every 8th expert by load, its hottest first
          "qb": (None, 24576, MoePreset("qwen24", 2048, 768, 24, 1)),
          "qz": (QWEN_ZIPF_EVERY_8TH, sum(QWEN_ZIPF_EVERY_8TH), MoePreset("qwen16", 2048, 768, 16, 1))}


def handmade_topk_ids(counts, T, k, seed=0):
    """[T, k] int32 expert ids with counts[e] pairs for expert e: the pairs expert by expert, column by column."""
    assert sum(counts) == T * k and max(counts) <= T, (sum(counts), T * k, max(counts))
    ids = np.concatenate([np.full(c, e, np.int32) for e, c in enumerate(counts)]).reshape(k, T).T.copy()
    assert all(len(set(row)) == k for row in ids)
    return ids[np.random.default_rng(seed).permutation(T)]


def run(name):
    """Model shape `name`; returns (the moe_modeled_backward result, the central schedule)."""
    counts, T, preset = SHAPES[name]
    kept, make_ids, model_kernel = {}, M.make_topk_ids, M.model_kernel

    def keep(*a, **k):
        kept["report"] = model_kernel(*a, **k)
        return kept["report"]

    M.model_kernel = keep
    if counts:
        M.make_topk_ids = lambda routing, T, k, E, seed=0, zipf_exponent=1.0: handmade_topk_ids(counts, T, k)
    try:
        res = M.moe_modeled_backward(preset, T, "balanced", block_size=512, dense=False,
                                     checkpoint_layout=os.environ.get("LAYOUT", "block"),
                                     weights_layout=os.environ.get("WEIGHTS_LAYOUT", "block"))
    finally:
        M.make_topk_ids, M.model_kernel = make_ids, model_kernel
    return res, kept["report"].schedule


def print_time(name, res):
    c, p = res.scenarios["central"], res.scenarios["pessimistic"]
    print(f"{name}: {c['modeled_time_s'] * 1e6:.1f} / {p['modeled_time_s'] * 1e6:.1f} us, blocks "
          f"{res.padding['used_blocks']}, MFU {100 * c['mfu']:.1f}%, HBM {c['hbm_bytes'] / 1e6:.0f} MB, "
          f"plan errors {len(c['plan_errors'])}")
    for phase, v in c["phases"].items():
        print(f"  {phase}: critical path {v['critical_path_s'] * 1e6:.0f} us",
              {e: round(s * 1e6) for e, s in v["critical_path_by_engine_s"].items()})


def _phase(rec):
    return (rec.attrs or {}).get("phase", "kernel")


def segment_bounds(sch, program=0):
    """Core `program`'s segment boundaries (its core_barriers' ends) and a time -> segment index function."""
    recs, en = sch.records, sch.end
    bars = sorted(en[i] for i in range(len(recs)) if recs[i].program == program and "barrier" in str(recs[i].instr))
    return bars, lambda t: bisect.bisect_right(bars, t)


def print_segments(sch):
    """Core 0's segments between core_barriers: span, and the critical path's us in it by phase / engine."""
    recs, st, en, bl = sch.records, sch.start, sch.end, sch.blocker
    bars, seg = segment_bounds(sch)
    crit = collections.defaultdict(float)
    i = max(range(len(recs)), key=lambda j: en[j])
    while i is not None:
        crit[(seg(st[i]), _phase(recs[i]), sch.costs[i].engine)] += en[i] - st[i]
        i = bl[i]
    for s, (t0, t1) in enumerate(zip([0.0] + bars, bars + [sch.makespan])):
        items = sorted(((k[1], k[2], v) for k, v in crit.items() if k[0] == s), key=lambda x: -x[2])
        print(f"segment {s}: {t0 * 1e6:.0f} -> {t1 * 1e6:.0f} us ({(t1 - t0) * 1e6:.0f}); critical path:",
              {f"{p}/{e}": round(v * 1e6) for p, e, v in items if v > 3e-6})


def dma_route(rec):
    """'source -> destination' of a DMA record: an HBM operand by its tensor name (a numbered scratch name such as
    moe_bwd_down_mx_11 without its number), an on-chip one as its buffer; '+=' for an accumulating DMA."""
    def name(o):
        return re.sub(r"_\d+$", "", o.name) if o.buffer.endswith("hbm") else o.buffer
    dst_id = rec.writes[0].storage_id if rec.writes else None
    srcs = [o for o in rec.reads if o.storage_id != dst_id] or list(rec.reads)  # an accumulating DMA reads its dst
    src = name(srcs[0]) if srcs else "?"
    dst = name(rec.writes[0]) if rec.writes else "?"
    return f"{src} {'+=' if rec.attrs.get('rmw') or rec.instr == 'dma_compute' else '->'} {dst}"


def walk(sch, program=0):
    """Per segment of core `program` (split at its core_barriers): the critical path walked back from the core's
    last instruction through Schedule.blocker, and the DMAs that start in the segment.

    Returns a list, one dict per segment: span (t0, t1) in seconds; path {(phase, engine, instr, route): [steps, own
    seconds, wait seconds]} (wait: from the blocker's end to the step's start: a semaphore hop, a DGE or a queue
    slot; for a software-DGE DMA also its descriptors' time on GpSimd and GpSimd's queue before them, since the
    scheduler names the DMA's data dependence as its blocker; engine@p: a step on the other core, reached through a
    barrier), so that the path's own + wait seconds over all segments sum to the core's last end; dmas {(phase, route, payload bytes, dge): [count, bytes, engine-seconds]}, where a DMA's engine-seconds
    are its bytes over one engine's rate at its payload, so that engine-seconds / dma_engines_per_core is the time
    the segment's DMAs need with every DMA engine of the core busy (its DMA-bound floor)."""
    recs, costs, st, en, bl = sch.records, sch.costs, sch.start, sch.end, sch.blocker
    bars, seg = segment_bounds(sch, program)
    mine = [i for i in range(len(recs)) if recs[i].program == program]
    out = [{"span": (t0, t1), "path": collections.defaultdict(lambda: [0, 0.0, 0.0]),
            "dmas": collections.defaultdict(lambda: [0, 0, 0.0])}
           for t0, t1 in zip([0.0] + bars, bars + [max(en[i] for i in mine)])]
    for i in mine:
        if costs[i].kind == "dma":
            w = costs[i].dma
            d = out[seg(st[i])]["dmas"][(_phase(recs[i]), dma_route(recs[i]), w.payload, w.dge)]
            d[0] += 1
            d[1] += w.nbytes
            d[2] += w.nbytes / w.rate_per_engine if w.nbytes else 0.0
    i = max(mine, key=lambda j: en[j])
    while i is not None:
        j = bl[i]
        route = dma_route(recs[i]) if costs[i].kind == "dma" else ""
        engine = costs[i].engine if recs[i].program == program else f"{costs[i].engine}@{recs[i].program}"
        step = out[seg(st[i])]["path"][(_phase(recs[i]), engine, recs[i].instr, route)]
        ready = en[j] if j is not None else 0.0
        step[0] += 1
        step[1] += en[i] - max(st[i], ready)  # a barrier's own time: after the last core's arrival
        step[2] += max(0.0, st[i] - ready)
        i = j
    return out


def print_walk(sch, segments=None, top=12, program=0):
    """walk()'s segments as tables: span, DMA bytes against the DMA-bound floor, the DMAs by tensor / payload and
    the critical path by step (us)."""
    from nkilib.simulator.hardware import resolve_target
    engines = resolve_target(sch.target).dma_engines_per_core
    for s, rec in enumerate(walk(sch, program)):
        if segments and s not in segments:
            continue
        t0, t1 = rec["span"]
        span = t1 - t0
        nbytes = sum(v[1] for v in rec["dmas"].values())
        floor = sum(v[2] for v in rec["dmas"].values()) / engines
        print(f"segment {s}: {t0 * 1e6:.1f} -> {t1 * 1e6:.1f} us ({span * 1e6:.1f}); DMAs "
              f"{sum(v[0] for v in rec['dmas'].values())}, {nbytes / 1e6:.2f} MB ({nbytes / max(span, 1e-12) / 1e9:.0f}"
              f" GB/s over the span), DMA-bound floor {floor * 1e6:.1f} us ({100 * floor / max(span, 1e-12):.0f}%)")
        print("  DMAs (phase, route, payload B, DGE): count, MB, floor us")
        for k, v in sorted(rec["dmas"].items(), key=lambda kv: -kv[1][2])[:top]:
            print(f"    {k[0]:>14} {k[1]:<62} {k[2]:>6} {k[3]:>4}: {v[0]:5d} {v[1] / 1e6:8.3f} "
                  f"{v[2] / engines * 1e6:8.1f}")
        print("  critical path (phase, engine, instr, route): steps, own us, wait us")
        for k, v in sorted(rec["path"].items(), key=lambda kv: -(kv[1][1] + kv[1][2]))[:top]:
            print(f"    {k[0]:>14} {k[1]:>7} {k[2]:<22} {k[3]:<50}: {v[0]:4d} {v[1] * 1e6:8.1f} {v[2] * 1e6:8.1f}")


if __name__ == "__main__":
    mode, names = sys.argv[1], sys.argv[2:]
    for name in names:
        t0 = time.time()
        res, sch = run(name)
        print_time(name, res)
        if mode == "segments":
            print_segments(sch)
        if mode == "walk":
            print_walk(sch, [int(a) for a in os.environ.get("SEGMENTS", "").split(",") if a])
        print(f"  ({time.time() - t0:.0f} s)", flush=True)
