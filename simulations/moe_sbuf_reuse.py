"""MoE backward: memory-reuse (WAR/WAW) waits in the modeled schedule and each pass's SBUF working set.

Diagnostic for docs/moe.md section 10, round 9 (groundwork). Usage (from the repository root):
    PYTHONPATH=$PWD python simulations/moe_sbuf_reuse.py waits gpt4        # reuse waits + per-pass peak live SBUF
    PYTHONPATH=$PWD python simulations/moe_sbuf_reuse.py sbuf384 ds4       # the same trace, 384 KiB SBUF per partition
    PYTHONPATH=$PWD python simulations/moe_sbuf_reuse.py nowar gpt4        # no memory-reuse waits at all (SBUF, PSUM)

The cost model adds the allocator's memory-reuse dependencies to the data dependencies without a label
(nkilib/simulator/cost/scheduler.py: `_memory_reuse_deps` merged into `preds`); this script wraps that function
to keep both sets, so an instruction whose blocker (the predecessor that set its start) is only a reuse
predecessor is a memory-reuse wait. Shapes: the coordinator harness's ds4 and gpt4 (B = 512, LNC2, balanced) and the study's tiny one.
Wraps private functions of the cost model: a diagnostic, not an API.
"""
import collections
import dataclasses
import sys

import nkilib.examples.moe_backward_cost as M
import nkilib.simulator.cost.scheduler as S
from nkilib.examples.moe_backward_cost import MOE_PRESETS, MoePreset
from nkilib.simulator.hardware import TRN3

SHAPES = {"ds4": (MoePreset("ds4", 7168, 2048, 4, 8, global_experts=32), 2048, "balanced", 512),
          "gpt4": (MoePreset("gptoss4", 2880, 2880, 4, 4, clamped=True), 2048, "balanced", 512),
          # the study's --quick shape (seconds; the default test suite runs it)
          "tiny": (MOE_PRESETS["tiny"], 256, "balanced", 128)}


def run(name, mode):
    """Model shape `name` in `mode` (waits / sbuf<KiB> / nowar) and print the findings; returns (the
    moe_modeled_backward result, in waits mode {"critical_path_edges": {kind: count}, "peak_live_sbuf_bytes":
    {phase: bytes per partition}}, else None). The cost model's functions are restored on return."""
    cap = {}
    orig = S._memory_reuse_deps

    def spy(records, target, preds=None, **kw):
        cap["data"] = [set(p) for p in preds]
        out = orig(records, target, preds, **kw)
        cap["extra"] = {i: set(v) for i, v in out.items()}
        return {} if mode == "nowar" else out

    S._memory_reuse_deps = spy
    model_kernel = M.model_kernel

    def keep(*a, **k):
        cap["report"] = model_kernel(*a, **k)
        return cap["report"]

    M.model_kernel = keep
    target = dataclasses.replace(TRN3, sbuf_bytes_per_partition=int(mode[4:]) * 1024) if mode.startswith("sbuf") \
        else "trn3"
    p, t, r, block_size = SHAPES[name]
    try:
        res = M.moe_modeled_backward(p, t, r, block_size=block_size, dense=False, target=target)
    finally:
        S._memory_reuse_deps, M.model_kernel = orig, model_kernel
    c, pe = res.scenarios["central"], res.scenarios["pessimistic"]
    sch = cap["report"].schedule
    fmt = lambda s: f"{s['modeled_time_s'] * 1e6:.1f}" if s["modeled_time_s"] else "refused"
    print(f"{name} {mode}: {fmt(c)} / {fmt(pe)} us; central makespan {sch.makespan * 1e6:.1f} us "
          f"(without the launch overhead); plan errors {c['plan_errors'][:2]}")
    waits = report_waits(sch, cap["data"], cap["extra"]) if mode == "waits" else None
    return res, waits


def report_waits(sch, data, extra):
    """Print core 0's memory-reuse waits, its critical path's edges by kind and each phase's peak live SBUF."""
    recs, st, en, bl = sch.records, sch.start, sch.end, sch.blocker
    ph = lambda i: (recs[i].attrs or {}).get("phase", "kernel")
    reuse = lambda i, b: b is not None and b in extra.get(i, ()) and b not in data[i]
    n = collections.Counter()
    for i in range(len(recs)):
        if recs[i].program == 0 and reuse(i, bl[i]):
            n[(ph(bl[i]), ph(i))] += 1
    print("core 0, instructions whose start a memory-reuse predecessor set (its phase -> theirs):")
    for k, v in n.most_common(12):
        print(f"  {k[0]:>14} -> {k[1]:<14} {v:5d}")
    # critical path: from core 0's last instruction back along the blockers
    i = max((j for j in range(len(recs)) if recs[j].program == 0), key=lambda j: en[j])
    edges, busy, on_reuse = collections.Counter(), collections.Counter(), collections.Counter()
    while bl[i] is not None:
        b = bl[i]
        kind = "reuse" if reuse(i, b) else "data" if b in data[i] else "queue/other"
        edges[kind] += 1
        busy[kind] += en[i] - st[i]
        if kind == "reuse":
            on_reuse[(ph(b), ph(i))] += en[i] - st[i]
        i = b
    print("critical path, edges by kind:", dict(edges), "busy us of the instructions they start:",
          {k: round(v * 1e6, 1) for k, v in busy.items()})
    print("  its reuse edges (phase -> phase: us of the waiters):", {k: round(v * 1e6, 1) for k, v in on_reuse.items()})
    # peak live SBUF bytes per partition while each phase runs (program order, core 0), by tile
    first, last, size, what = {}, {}, {}, {}
    for rr in recs:
        if rr.program != 0:
            continue
        for op in rr.reads + rr.writes:
            if op.buffer == "sbuf" and op.alloc_bytes_per_partition:
                first.setdefault(op.storage_id, rr.seq)
                last[op.storage_id] = rr.seq
                size[op.storage_id] = op.alloc_bytes_per_partition
                what.setdefault(op.storage_id, (ph(rr.seq), rr.instr))
    events = sorted([(first[k], 1, k) for k in first] + [(last[k] + 0.5, -1, k) for k in first])
    live, peak = {}, {}
    for s, d, k in events:
        if d == 1:
            live[k] = size[k]
        else:
            live.pop(k)
        total = sum(live.values())
        if total > peak.get(ph(int(s)), (0,))[0]:
            peak[ph(int(s))] = (total, dict(live))
    for p_, (b, lv) in peak.items():
        print(f"phase {p_}: peak live SBUF {b / 1024:.1f} KiB per partition")
        groups, count = collections.Counter(), collections.Counter()
        for k, v in lv.items():
            key = (what[k][0], what[k][1], v)
            groups[key] += v
            count[key] += 1
        for (pk, instr, v), tot in groups.most_common(12):
            print(f"  {tot / 1024:7.2f} KiB = {count[(pk, instr, v)]:3d} x {v / 1024:.2f} KiB, first written by {instr} "
                  f"in {pk}")
    return {"critical_path_edges": dict(edges), "peak_live_sbuf_bytes": {k: b for k, (b, _) in peak.items()}}


if __name__ == "__main__":
    run(sys.argv[2], sys.argv[1])
