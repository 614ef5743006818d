"""MoE expert backward study: modeled Trn3 MXFP8 time, MFU, padding and limiting engines on model presets.

    python simulations/moe_bwd_study.py [--presets qwen3-30b-a3b gpt-oss-20b deepseek-v3-ep8]
        [--tokens 4096 16384] [--routings balanced zipf] [--lnc 2] [--block-size B]
        [--band | --central | --pessimistic] [--no-dense] [--dense-max-tokens 32768] [--checkpoint-layout {block,slot}]
        [--weights-layout {block,slot}]
        [--out simulations/out/moe_bwd] [--plots] [--resume] [--jobs N] [--quick]

For each (preset, T, routing) it builds the routing (exactly balanced, or Zipf-skewed with a seed), runs
the NKI MoE kernel (nkilib/experimental/moe_mxfp8) in a shape-only simulator run that carries the real
int32 block layout, and schedules the trace with the engine-level cost model
(nkilib.examples.moe_backward_cost.moe_modeled_backward). It reports the modeled time at the central
estimate and the pessimistic end, the MXFP8 MFU on useful FLOPs only (12·P·H·I for P routed pairs;
padding excluded), the padding overhead of the blocks, the engines on each phase's critical path, HBM
bytes moved next to the compulsory minimum, and the dense kernel at S = P tokens (the same useful
FLOPs). A configuration whose plan or modeled overlap needs more SBUF/PSUM than trn3 has is refused:
no time, its plan errors, and the would-be time in the JSON/CSV. Results: --out/moe_bwd_study.json and
.csv (written after every configuration; --resume skips the ones already there), PNG plots with --plots.
A model-shape configuration takes 1-5 minutes of one core and 2-5.5 GB of memory: --jobs N models N at
once in separate processes (the committed table: --jobs 12 on a 16-core, 128 GB machine).
--quick runs a tiny shape (seconds; the default test suite runs it).

DeepSeek-V3 per EP-8 rank: T tokens per rank, 8 of 256 experts per token, 32 local experts: the rank's
experts receive T·8·32/256 = T routed pairs (balanced expectation), passed as T rows with k = 1
(MoePreset.kernel_routing_shape says why that prices the same work).

Checkpoints: all four given, block-ordered [N*B, I] by default (--checkpoint-layout block): the layout the torch
op's forward saves for the backends that run the kernel (docs/moe.md section 6); --checkpoint-layout slot models
the kernel API's default [T, k, I], gathered row by row. Routing weights and their gradient block-ordered by default
(--weights-layout block, what the torch op's kernel backends pass since round 30b); --weights-layout slot models
the kernel API's default, p gathered and d_topk_weights scattered by slot.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from nkilib.examples.moe_backward_cost import (MOE_PRESETS, SCENARIOS, MoeModeledResult, fmt_ms, fmt_pct,  # noqa: E402
                                               moe_modeled_backward, result_row)
from nkilib.examples.moe_routing_scenarios import DEFAULT_ZIPF_EXPONENT, ROUTINGS  # noqa: E402
from nkilib.experimental.moe_mxfp8.constants import CHECKPOINT_LAYOUTS, WEIGHTS_LAYOUTS  # noqa: E402

DEFAULT_PRESETS = ("qwen3-30b-a3b", "gpt-oss-20b", "deepseek-v3-ep8")
DEFAULT_TOKENS = (4096, 16384)


def key_of(preset, tokens, routing) -> str:
    return f"{preset}/T{tokens}/{routing}"


def format_rows(results: dict, scenarios) -> list:
    """Table lines as printed (and pasted into the README)."""
    head = ("| preset | T | routing | B | padding | max/mean load | time ms (" + " / ".join(scenarios) + ") | MXFP8 MFU ("
            + " / ".join(scenarios) + ") | vs balanced | dense at same FLOPs: ms / MFU | HBM MB / min | "
            "limiting engines per phase (central critical path) |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for key, r in results.items():
        s0 = r.scenarios[scenarios[0]]
        times = " / ".join(fmt_ms(r.scenarios[sc]["modeled_time_s"]) for sc in scenarios)
        mfus = " / ".join(fmt_pct(r.scenarios[sc]["mfu"]) for sc in scenarios)
        if s0["modeled_time_s"] is None and s0.get("invalid_modeled_time_s"):  # refused: the would-be numbers
            times = "refused (would be " + " / ".join(
                f"{r.scenarios[sc]['invalid_modeled_time_s'] * 1e3:.3f}" for sc in scenarios) + ")"
            mfus = "(would be " + " / ".join(fmt_pct(r.scenarios[sc]["invalid_mfu"]) for sc in scenarios) + ")"
        vs = ""
        base = results.get(key_of(r.preset, r.tokens, "balanced"))
        if r.routing != "balanced" and base is not None:
            tb = base.scenarios[scenarios[0]]["modeled_time_s"] or base.scenarios[scenarios[0]].get("invalid_modeled_time_s")
            tr = s0["modeled_time_s"] or s0.get("invalid_modeled_time_s")
            if tb and tr:
                vs = f"{(tr / tb - 1) * 100:+.1f}% time"
        dense = ""
        if r.dense:
            d = r.dense[scenarios[0]]
            dense = f"{fmt_ms(d['modeled_time_s'])} / {fmt_pct(d['mfu'])}"
            if r.dense_scaled_from_tokens:
                dense += f" (S={r.dense_scaled_from_tokens} scaled)"
        # "kernel" is the work outside the three passes (weight panel loads, dX zeroing, loop control, LNC2
        # fences): its shares are of that phase's own critical path, not of the whole kernel's
        limit = "; ".join(f"{'outside passes' if ph == 'kernel' else ph}: {v}"
                          for ph, v in r.limiting_engines(scenarios[0]).items())
        lines.append(f"| {r.preset} | {r.tokens} | {r.routing} | {r.block_size} | "
                     f"{r.padding['padding_overhead'] * 100:.1f}% | {r.expert_load['max_over_mean']:.2f} | {times} | "
                     f"{mfus} | {vs} | {dense} | {s0['hbm_bytes'] / 1e6:.0f} / {s0['hbm_compulsory_bytes'] / 1e6:.0f} | "
                     f"{limit} |")
        for e in s0["plan_errors"]:
            lines.append(f"|  | | | | | | refused: {e} | | | | | |")
    return lines


def write_outputs(results: dict, out: str, scenarios) -> tuple:
    os.makedirs(out, exist_ok=True)
    jpath, cpath = os.path.join(out, "moe_bwd_study.json"), os.path.join(out, "moe_bwd_study.csv")
    with open(jpath, "w") as f:
        json.dump({k: r.to_json() for k, r in results.items()}, f, indent=1, default=float)
    rows = [result_row(r, scenarios) for r in results.values()]
    if rows:
        fields = list(dict.fromkeys(k for row in rows for k in row))
        with open(cpath, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=fields)
            w.writeheader()
            w.writerows(rows)
    return jpath, cpath


def plot(results: dict, out: str, scenarios) -> list:
    """moe_bwd_mfu.png (MFU per configuration, band and dense), moe_bwd_phases.png (critical path by phase)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    keys = list(results)
    labels = [k.replace("/", "\n") for k in keys]
    x = np.arange(len(keys))
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(keys)), 4.5))
    for j, sc in enumerate(scenarios):
        vals = [100 * ((results[k].scenarios[sc]["mfu"]) or 0.0) for k in keys]
        ax.bar(x + (j - 0.5) * 0.35, vals, 0.35, label=f"MoE {sc}")
    if all(results[k].dense for k in keys):
        ax.scatter(x, [100 * (results[k].dense[scenarios[0]]["mfu"] or 0.0) for k in keys], color="k", marker="_",
                   s=400, label=f"dense, same useful FLOPs ({scenarios[0]})", zorder=3)
    for i, k in enumerate(keys):
        if results[k].refused:
            ax.text(x[i], 1, "refused", rotation=90, ha="center", va="bottom", fontsize=8)
    ax.axhline(65, color="grey", ls="--", lw=0.8, label="target 65%")
    ax.set_xticks(x, labels, fontsize=7)
    ax.set_ylabel("% of MXFP8 peak (useful FLOPs)")
    ax.set_title("MoE expert backward, trn3 MXFP8 (cost model)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    p1 = os.path.join(out, "moe_bwd_mfu.png")
    fig.savefig(p1, dpi=120)
    plt.close(fig)

    phases = sorted({ph for k in keys for ph in results[k].scenarios[scenarios[0]]["phases"]})
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(keys)), 4.5))
    bottom = np.zeros(len(keys))
    for ph in phases:
        vals = np.array([results[k].scenarios[scenarios[0]]["phases"].get(ph, {}).get("critical_path_s", 0.0) * 1e3
                         for k in keys])
        ax.bar(x, vals, 0.6, bottom=bottom, label=ph)
        bottom += vals
    ax.set_xticks(x, labels, fontsize=7)
    ax.set_ylabel(f"critical path, ms ({scenarios[0]})")
    ax.set_title("MoE expert backward: critical path by phase")
    ax.legend(fontsize=7)
    fig.tight_layout()
    p2 = os.path.join(out, "moe_bwd_phases.png")
    fig.savefig(p2, dpi=120)
    plt.close(fig)
    return [p1, p2]


def _load(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return {k: MoeModeledResult(**v) for k, v in json.load(f).items()}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", nargs="+", default=list(DEFAULT_PRESETS), choices=sorted(MOE_PRESETS))
    ap.add_argument("--tokens", nargs="+", type=int, default=list(DEFAULT_TOKENS))
    ap.add_argument("--routings", nargs="+", default=list(ROUTINGS), choices=ROUTINGS)
    ap.add_argument("--lnc", type=int, default=2, choices=(1, 2))
    ap.add_argument("--block-size", type=int, default=None, help="B (default: moe_backward_cost.choose_block_size)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--checkpoint-layout", default="block", choices=CHECKPOINT_LAYOUTS,
                    help="the kernel's checkpoint_layout: [N*B, I] block-ordered, as the torch op's forward saves them "
                         "for the backends that run the kernel (default), or [T, k, I] gathered by slot (the kernel "
                         "API's default; docs/moe.md section 6)")
    ap.add_argument("--weights-layout", default="block", choices=WEIGHTS_LAYOUTS,
                    help="the kernel's weights_layout: p and d_topk_weights by block position, as the torch op's "
                         "kernel backends pass them (default), or [T, k] by slot (the kernel API's default; "
                         "docs/moe.md round 30b)")
    ap.add_argument("--zipf-exponent", type=float, default=DEFAULT_ZIPF_EXPONENT)
    ap.add_argument("--no-dense", dest="dense", action="store_false")
    ap.add_argument("--dense-max-tokens", type=int, default=32768,
                    help="model the dense comparison at most at this S and scale its time linearly")
    ap.add_argument("--out", default=os.path.join("simulations", "out", "moe_bwd"))
    ap.add_argument("--plots", action="store_true")
    ap.add_argument("--resume", action="store_true", help="keep the configurations already in --out's JSON")
    ap.add_argument("--jobs", type=int, default=1, help="configurations modeled in parallel processes")
    ap.add_argument("--quick", action="store_true", help="tiny shape (smoke test): --presets tiny --tokens 256 --plots")
    band = ap.add_mutually_exclusive_group()
    band.add_argument("--band", dest="scenarios", action="store_const", const=SCENARIOS)
    band.add_argument("--central", dest="scenarios", action="store_const", const=("central",))
    band.add_argument("--pessimistic", dest="scenarios", action="store_const", const=("pessimistic",))
    args = ap.parse_args(argv)
    scenarios = args.scenarios or SCENARIOS
    if args.quick:
        args.presets, args.tokens, args.plots = ["tiny"], [256], True
    jpath = os.path.join(args.out, "moe_bwd_study.json")
    results = _load(jpath) if args.resume else {}
    jobs = [(p, t, r) for p in args.presets for t in args.tokens for r in args.routings if key_of(p, t, r) not in results]
    kw = dict(block_size=args.block_size, lnc=args.lnc, scenarios=scenarios, seed=args.seed,
              zipf_exponent=args.zipf_exponent, dense=args.dense, dense_max_tokens=args.dense_max_tokens,
              checkpoint_layout=args.checkpoint_layout, weights_layout=args.weights_layout)
    if args.jobs > 1:  # one fresh process per configuration (each needs up to ~5.5 GB at model shapes)
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed

        with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn"),
                                 max_tasks_per_child=1) as pool:
            futures = {pool.submit(moe_modeled_backward, p, t, r, **kw): key_of(p, t, r) for p, t, r in jobs}
            for fut in as_completed(futures):
                print(f"modeled {futures[fut]}", flush=True)
                results[futures[fut]] = fut.result()
                write_outputs(results, args.out, scenarios)
        order = [key_of(p, t, r) for p in args.presets for t in args.tokens for r in args.routings]
        results = {k: results[k] for k in order if k in results} | {k: v for k, v in results.items() if k not in order}
    else:
        for p, t, r in jobs:
            print(f"modeling {key_of(p, t, r)} ...", flush=True)
            results[key_of(p, t, r)] = moe_modeled_backward(p, t, r, **kw)
            write_outputs(results, args.out, scenarios)
    print()
    print("\n".join(format_rows(results, scenarios)))
    paths = write_outputs(results, args.out, scenarios)
    if args.plots and results:
        paths += tuple(plot(results, args.out, scenarios))
    print("\nwrote " + ", ".join(paths))
    return results


if __name__ == "__main__":
    main()
