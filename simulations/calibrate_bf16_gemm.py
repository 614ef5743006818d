"""Calibrate the cost model against BF16 GEMM times measured on Trainium3 (LNC2) by AWS.

Models every shape of simulations/data/trn3_bf16_gemm_measured.json (mirrored from the public
aws-neuron/nki-library test cache, see its "source" field) with
`nkilib.examples.bf16_matmul.predict_bf16_gemm_time` (that kernel, shape-only simulation +
engine-level schedule) at the model's central estimate and its pessimistic end, prints predicted vs
measured per shape and the median absolute percentage error, and writes the table as JSON.

    python simulations/calibrate_bf16_gemm.py [--subset N] [--out DIR] [--data PATH] [--max-flops F]

Parameters: engine and DMA numbers are the documented ones or labelled estimates
(nkilib/simulator/hardware.py); the only fitted number is `kernel_launch_overhead_s` (hardware.py),
fitted on the launch-dominated shapes (modeled makespan < 40 us, see `fit_launch_overhead`). The
other shapes are the holdout: their error is reported separately, as the model's error on shapes
that played no part in the fit.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if REPO not in sys.path:
    sys.path.insert(0, REPO)
DEFAULT_DATA = os.path.join(HERE, "data", "trn3_bf16_gemm_measured.json")


def load_entries(path):
    with open(path) as f:
        data = json.load(f)
    return data["entries"]


def pick_subset(entries, n):
    """n shapes spread over the FLOP range (smallest, largest, evenly in between), deterministic."""
    if n is None or n >= len(entries):
        return list(entries)
    order = sorted(entries, key=lambda e: 2.0 * e["M"] * e["K"] * e["N"])
    if n == 1:
        return [order[0]]
    idx = sorted({round(i * (len(order) - 1) / (n - 1)) for i in range(n)})
    return [order[i] for i in idx]


LAUNCH_DOMINATED_MAKESPAN_S = 40e-6


def fit_launch_overhead(rows):
    """The one fitted parameter: a fixed per-call time, estimated as the median of (measured - modeled
    makespan) over the launch-dominated shapes (makespan < 40 us), where it is most of the measured
    time. Returned for reference; the value used lives in hardware.KERNEL_LAUNCH_OVERHEAD_S."""
    diffs = [r["measured_s"] - r["makespan_s"] for r in rows if r["makespan_s"] < LAUNCH_DOMINATED_MAKESPAN_S]
    return statistics.median(diffs) if diffs else None


def run(entries, target="trn3", progress=True):
    from nkilib.examples.bf16_matmul import predict_bf16_gemm_time_report
    from nkilib.simulator.cost import rescore

    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is optional (extra "sim")
        def tqdm(x, **_):
            return x
    rows = []
    for e in tqdm(entries, desc="modeling GEMMs", disable=not progress):
        t0 = time.time()
        rep = predict_bf16_gemm_time_report(e["M"], e["K"], e["N"], lnc=e.get("num_lnc", 2), target=target)
        pess = rescore(rep, "pessimistic")
        pred = rep.modeled_time_s
        meas = e["time_s"]
        rows.append({
            "name": e["name"], "M": e["M"], "K": e["K"], "N": e["N"], "lnc": e.get("num_lnc", 2),
            "measured_s": meas, "predicted_s": pred, "makespan_s": rep.makespan_s,
            "predicted_pessimistic_s": pess.modeled_time_s,
            "error_pct": 100.0 * (pred - meas) / meas,
            "error_pessimistic_pct": 100.0 * (pess.modeled_time_s - meas) / meas,
            "fit_set": rep.makespan_s < LAUNCH_DOMINATED_MAKESPAN_S,
            "measured_mfu_pct": e.get("mfu_percent"), "predicted_mfu_pct": 100.0 * rep.to_json()["mfu"],
            "instructions": len(rep.schedule.records), "model_wall_s": time.time() - t0,
        })
    return rows


def _abs_stats(errs):
    errs = [abs(e) for e in errs]
    return {"shapes": len(errs), "median_abs_error_pct": statistics.median(errs) if errs else None,
            "mean_abs_error_pct": statistics.fmean(errs) if errs else None,
            "max_abs_error_pct": max(errs) if errs else None}


def summarize(rows):
    stats = _abs_stats([r["error_pct"] for r in rows])
    errs = [abs(r["error_pct"]) for r in rows]
    return {
        **stats,
        "within_20pct": sum(e <= 20 for e in errs),
        "fit_set": _abs_stats([r["error_pct"] for r in rows if r["fit_set"]]),
        "holdout": _abs_stats([r["error_pct"] for r in rows if not r["fit_set"]]),
        "holdout_pessimistic": _abs_stats([r["error_pessimistic_pct"] for r in rows if not r["fit_set"]]),
        "best_fit_launch_overhead_s": fit_launch_overhead(rows),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--subset", type=int, default=None, help="model only N shapes spread over the FLOP range")
    ap.add_argument("--out", default=os.path.join(HERE, "out"), help="output directory (default simulations/out)")
    ap.add_argument("--data", default=DEFAULT_DATA, help="measured GEMM JSON")
    ap.add_argument("--target", default="trn3")
    ap.add_argument("--max-flops", type=float, default=None, help="skip shapes above this many FLOPs (2MKN)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)

    import nkilib  # noqa: F401  (installs the simulator as `nki`)
    from nkilib.simulator.hardware import resolve_target

    entries = load_entries(args.data)
    if args.max_flops is not None:
        entries = [e for e in entries if 2.0 * e["M"] * e["K"] * e["N"] <= args.max_flops]
    entries = pick_subset(entries, args.subset)
    rows = run(entries, args.target, progress=not args.quiet)
    summary = summarize(rows)
    spec = resolve_target(args.target)
    print(f"{'shape':<52} {'M':>6} {'K':>6} {'N':>6} {'meas us':>9} {'pred us':>9} {'err %':>7} "
          f"{'pess us':>9} {'MFU meas':>8} {'MFU pred':>8}")
    for r in rows:
        print(f"{r['name'][:52]:<52} {r['M']:6d} {r['K']:6d} {r['N']:6d} {r['measured_s'] * 1e6:9.1f} "
              f"{r['predicted_s'] * 1e6:9.1f} {r['error_pct']:7.1f} {r['predicted_pessimistic_s'] * 1e6:9.1f} "
              f"{r['measured_mfu_pct'] or 0:8.1f} "
              f"{r['predicted_mfu_pct']:8.1f}")
    print(f"\nshapes {summary['shapes']}  median |error| {summary['median_abs_error_pct']:.1f} %  "
          f"mean {summary['mean_abs_error_pct']:.1f} %  max {summary['max_abs_error_pct']:.1f} %  "
          f"within 20 %: {summary['within_20pct']}/{summary['shapes']}")
    for name in ("fit_set", "holdout", "holdout_pessimistic"):
        st = summary[name]
        if st["shapes"]:
            print(f"{name:<20} shapes {st['shapes']:3d}  median |error| {st['median_abs_error_pct']:.1f} %  "
                  f"max {st['max_abs_error_pct']:.1f} %")
    fit = summary["best_fit_launch_overhead_s"]
    print(f"launch overhead used {spec.kernel_launch_overhead_s * 1e6:.1f} us; fitted on this run: "
          + (f"{fit * 1e6:.1f} us" if fit is not None else "n/a (no launch-dominated shape)"))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "calibrate_bf16_gemm.json")
    with open(path, "w") as f:
        json.dump({"target": args.target, "data": os.path.abspath(args.data),
                   "launch_overhead_s": spec.kernel_launch_overhead_s, "summary": summary, "shapes": rows}, f,
                  indent=1)
    print(f"wrote {path}")
    return summary, rows


if __name__ == "__main__":
    main()
