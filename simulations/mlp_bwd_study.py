"""MLP backward study: modeled Trn2/Trn3 time, MFU and phase breakdown on model presets.

    python simulations/mlp_bwd_study.py [--models qwen3-8b-tp8 ...] [--seq 4096] [--lnc 2]
        [--recompute none|all] [--band | --central | --pessimistic] [--numerics-max-flops 2e10]
        [--out simulations/out/mlp_bwd] [--plots]

For each preset it models the whole backward (quantization, transposes and epilogue included) with
the engine-level cost model in shape-only mode: MXFP8 and BF16 modes on trn3, BF16 on trn2. It
reports modeled time and TensorE MFU (model FLOPs 12·S·H·I, +4·S·H·I with full recompute, over the
peak of the chosen precision) as a band: the model's central estimate and its pessimistic end (the
estimated constants of nkilib/simulator/hardware.py at their worst ends; `--central` or
`--pessimistic` prints one end only). Also the MXFP8/BF16 speedup (central), HBM bytes moved next to
the compulsory minimum (inputs read once, outputs written once), and the engines on the critical
path. A shape whose plan or modeled overlap needs more SBUF/PSUM than the target has is refused: its
row says what it needs and no time is reported (the JSON keeps the would-be numbers under
"invalid_modeled_time_s"). When a shape is small enough (--numerics-max-flops) it also runs the
kernel numerically and reports its error against the mx_exact and fp32 references. Results go to
--out as JSON (plus PNG plots with --plots).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import nkilib  # noqa: E402,F401
import nki  # noqa: E402
from nkilib.examples.mlp_backward import make_inputs  # noqa: E402
from nkilib.examples.mlp_backward_cost import SCENARIOS, model_mlp_backward, summarize  # noqa: E402
from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8 import mlp_bwd_mxfp8_kernel as kernel_module  # noqa: E402
from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8.reference import error_report, mlp_backward_reference  # noqa: E402
from nkilib.models import PRESETS, preset  # noqa: E402

DEFAULT_MODELS = ("qwen3-8b-tp1", "qwen3-8b-tp4", "qwen3-8b-tp8", "qwen3-32b-tp1", "qwen3-32b-tp4", "qwen3-32b-tp8",
                  "llama3-8b-tp8",
                  "llama3-70b-tp8", "gpt-oss-20b-expert", "deepseek-v3-expert")
MODES = (("trn3", "mxfp8"), ("trn3", "bf16"), ("trn2", "bf16"))


def format_rows(results, models, scenarios) -> list:
    """Table lines as printed by main (also used by tests that compare the README with the study)."""
    lines = [f"{'model':<22}{'mode':<14}" + "".join(f"{sc + ' ms':>16}{'MFU %':>7}" for sc in scenarios)
             + f"{'MX/BF16':>9}{'HBM MB / min':>16}  limiting engines on the critical path (central)"]
    for model in models:
        base = results[f"{model}/trn3/bf16"][scenarios[0]]["modeled_time_s"]
        for target, precision in MODES:
            r = results[f"{model}/{target}/{precision}"]
            first = r[scenarios[0]]
            cells = ""
            for sc in scenarios:
                t, m = r[sc]["modeled_time_s"], r[sc]["mfu"]
                cells += f"{t * 1e3:>16.3f}{m * 100:>7.1f}" if t is not None else f"{'refused':>16}{'':>7}"
            t0 = first["modeled_time_s"]
            speed = f"{base / t0:.2f}x" if (target, precision) == ("trn3", "mxfp8") and base and t0 else ""
            hbm = f"{first['hbm_bytes'] / 1e6:.0f} / {first['hbm_compulsory_bytes'] / 1e6:.0f}"
            crit = first["critical_path_by_engine_s"]
            total = sum(crit.values()) or 1.0
            limit = ", ".join(f"{e} {100 * v / total:.0f}%" for e, v in sorted(crit.items(), key=lambda kv: -kv[1])[:3])
            lines.append(f"{model:<22}{target + '/' + precision:<14}{cells}{speed:>9}{hbm:>16}  {limit}")
            for sc in scenarios:
                lines.extend(f"{'':<36}refused ({sc}): {e}" for e in r[sc]["plan_errors"])
    return lines


def numerics(S, H, I, lnc):
    inputs = make_inputs(S, H, I, seed=0)
    outs = nki.simulate(kernel_module.mlp_backward_mxfp8_nki)[lnc](**inputs)
    exact = mlp_backward_reference(**inputs, mode="mx_exact")
    ideal = mlp_backward_reference(**inputs, mode="fp32")
    return {name: {"vs_mx_exact": error_report(o, e), "vs_fp32": error_report(o, i)}
            for name, o, e, i in zip(("dX", "dW_gate_up", "dW_down"), outs, exact, ideal)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), choices=sorted(PRESETS))
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--lnc", type=int, default=2, choices=(1, 2))
    ap.add_argument("--recompute", default="none", choices=("none", "all"),
                    help="none: all checkpoints given (12·S·H·I FLOPs); all: recompute everything")
    ap.add_argument("--numerics-max-flops", type=float, default=2e10)
    ap.add_argument("--out", default=os.path.join("simulations", "out", "mlp_bwd"))
    ap.add_argument("--plots", action="store_true")
    band = ap.add_mutually_exclusive_group()
    band.add_argument("--band", dest="scenarios", action="store_const", const=SCENARIOS,
                      help="central estimate and pessimistic end (default)")
    band.add_argument("--central", dest="scenarios", action="store_const", const=("central",))
    band.add_argument("--pessimistic", dest="scenarios", action="store_const", const=("pessimistic",),
                      help="estimated constants at their worst ends (nkilib/simulator/hardware.py)")
    args = ap.parse_args(argv)
    scenarios = args.scenarios or SCENARIOS
    try:
        from tqdm import tqdm
    except ImportError:  # progress bar is optional (pip install .[sim])
        def tqdm(x, **_):
            return x
    os.makedirs(args.out, exist_ok=True)
    results = {}
    jobs = [(m, t, p) for m in args.models for t, p in MODES]
    for model, target, precision in tqdm(jobs, desc="modeling", unit="run"):
        shape = preset(model)
        S, H, I = args.seq, shape.hidden, shape.intermediate
        reports = model_mlp_backward(S, H, I, target, precision, args.lnc, args.recompute == "all", scenarios)
        key = f"{model}/{target}/{precision}"
        results[key] = {"S": S, "H": H, "I": I, **{sc: summarize(rep) for sc, rep in reports.items()}}
        with open(os.path.join(args.out, key.replace("/", "_") + ".txt"), "w") as f:
            f.write("\n\n".join(rep.table() for rep in reports.values()) + "\n")
        if args.plots:
            reports[scenarios[0]].plot(args.out, prefix=key.replace("/", "_"))
    print()
    print("\n".join(format_rows(results, args.models, scenarios)))
    for model in args.models:
        shape = preset(model)
        flops = 12 * args.seq * shape.hidden * shape.intermediate
        if flops <= args.numerics_max_flops:
            results[f"{model}/numerics"] = numerics(args.seq, shape.hidden, shape.intermediate, args.lnc)
            print(f"{model} numerics (rel. Frobenius vs fp32): " + ", ".join(
                f"{k} {v['vs_fp32']['rel_fro']:.3e}" for k, v in results[f"{model}/numerics"].items()))
    path = os.path.join(args.out, "mlp_bwd_study.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1, default=float)
    print(f"\nwrote {path}")
    return results


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
