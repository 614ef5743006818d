"""Profile the MLP backward kernel on a real Trn2/Trn3 instance, next to the cost model's prediction.

    python simulations/profile_mlp_bwd_neuron.py --model qwen3-8b-tp8 --seq 4096 [--lnc 2]
        [--precision mxfp8|bf16] [--recompute none|all] [--warmup 5] [--iters 20] [--out DIR]
    python simulations/profile_mlp_bwd_neuron.py --shape 4096 4096 1536 --predict-only   # any machine

What it does where the Neuron SDK is installed (genuine `nki` importable, a Neuron device present):
  1. builds seeded bf16 inputs of the chosen shape (S, H, I) and benchmarks the kernel with
     ``nki.benchmark`` (warm-up + timed iterations; saves the NEFF and an NTFF trace),
  2. captures a device profile with ``neuron-explorer capture`` (or ``neuron-profile capture`` on SDKs
     without Neuron Explorer) and reads per-engine utilisation from ``neuron-profile view
     --output-format summary-json`` when available,
  3. prints latency p50 / p99, MFU (model FLOPs 12*S*H*I, 16*S*H*I with full recompute, over the
     peak of the precision x LNC cores) and per-engine utilisation, next to nkilib's engine-level cost
     model prediction for the same shape (computed in a child process on the bundled simulator,
     NKILIB_SIMULATOR=1, because the cost model needs the simulator's instruction trace).
Off Neuron it exits with status 2 and a message saying so (``--predict-only`` still works anywhere).

NOT EXERCISED BY CI: this repository has no Neuron device or SDK. The nki.benchmark API and the
profiler command lines follow the Neuron documentation (SDK 2.2x-2.3x):
https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/api/generated/nki.benchmark.html
https://awsdocs-neuron.readthedocs-hosted.com/en/latest/tools/neuron-explorer/how-to-profile-workload.html
https://awsdocs-neuron.readthedocs-hosted.com/en/v2.28.1/tools/profiler/neuron-profile-user-guide.html
The capture command can be overridden with --capture-cmd when an SDK spells it differently.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

NOT_ON_NEURON_EXIT = 2


def parse_args(argv=None):
    from nkilib.models import PRESETS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--model", choices=sorted(PRESETS), default="qwen3-8b-tp8", help="H, I from a model preset")
    g.add_argument("--shape", type=int, nargs=3, metavar=("S", "H", "I"), help="explicit shape")
    p.add_argument("--seq", type=int, default=4096, help="S with --model")
    p.add_argument("--lnc", type=int, default=2, choices=(1, 2))
    p.add_argument("--target", choices=("trn3", "trn2"), default=None,
                   help="cost-model target (default: trn3 for mxfp8, else trn2)")
    p.add_argument("--precision", choices=("mxfp8", "bf16"), default="mxfp8")
    p.add_argument("--recompute", choices=("none", "all"), default="none",
                   help="'all': no checkpoints given (the kernel recomputes gate_pre/up/...)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "profile"))
    p.add_argument("--capture-cmd", default=None,
                   help="profile capture command template with {neff} and {ntff} (default: neuron-explorer "
                        "capture -n {neff} -s {ntff}, else neuron-profile capture -n {neff} -s {ntff})")
    p.add_argument("--predict-only", action="store_true", help="print the cost model prediction (JSON) and exit")
    args = p.parse_args(argv)
    if args.shape:
        args.S, args.H, args.I = args.shape
    else:
        from nkilib.models import preset

        shape = preset(args.model)
        args.S, args.H, args.I = args.seq, shape.hidden, shape.intermediate
    args.target = args.target or ("trn3" if args.precision == "mxfp8" else "trn2")
    return args


def model_flops(S, H, I, recompute: bool) -> float:
    return float((16 if recompute else 12) * S * H * I)


# ---------------------------------------------------------------------------------------------
# cost model prediction (runs on the bundled simulator)
# ---------------------------------------------------------------------------------------------


def predict(S, H, I, lnc, target, precision, recompute) -> dict:
    """nkilib cost model for the kernel at this shape (shape-only simulator run). Needs the simulator backend."""
    import nkilib

    if nkilib.BACKEND != "simulator":
        raise RuntimeError("the cost model needs the bundled simulator: run with NKILIB_SIMULATOR=1")
    import nki.language as nl

    from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8 import mlp_backward_mxfp8_nki
    from nkilib.simulator import ShapeSpec
    from nkilib.simulator.cost import model_kernel

    inputs = {"output_grad": ShapeSpec((S, H), nl.bfloat16), "hidden_states": ShapeSpec((S, H), nl.bfloat16),
              "gate_up_weights": ShapeSpec((2 * I, H), nl.bfloat16),
              "down_proj_weight": ShapeSpec((H, I), nl.bfloat16)}
    if not recompute:
        for name in ("gate_pre", "gate_act", "up", "intermediate"):
            inputs[name] = ShapeSpec((S, I), nl.bfloat16)
    report = model_kernel(mlp_backward_mxfp8_nki, inputs, lnc=lnc, target=target,
                          kwargs={"matmul_precision": precision}, precision="mx" if precision == "mxfp8" else "bf16",
                          model_flops=model_flops(S, H, I, recompute))
    j = report.to_json()
    util = {}
    for core, engines in j["engines"].items():
        for eng, v in engines.items():
            util.setdefault(eng, []).append(v["utilisation"])
    return {"modeled_time_s": j["modeled_time_s"], "mfu": j["mfu"], "peak_flops_per_s": j["peak_flops_per_s"],
            "model_flops": j["model_flops"], "hbm_utilisation": j["hbm_utilisation"],
            "engine_utilisation": {e: sum(v) / len(v) for e, v in util.items()}}


def predict_in_child(args) -> dict:
    """The prediction from a child process forced onto the simulator (works on Neuron hosts too)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--shape", str(args.S), str(args.H), str(args.I), "--lnc",
           str(args.lnc), "--target", args.target, "--precision", args.precision, "--recompute", args.recompute,
           "--predict-only"]
    env = dict(os.environ, NKILIB_SIMULATOR="1")
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        return {"error": res.stderr.strip().splitlines()[-1] if res.stderr.strip() else f"exit {res.returncode}"}
    return json.loads(res.stdout)


# ---------------------------------------------------------------------------------------------
# on-device measurement (UNTESTED here)
# ---------------------------------------------------------------------------------------------


def neuron_problem() -> str | None:
    """None when a genuine Neuron nki and a Neuron device are available, else why not."""
    import nkilib

    if nkilib.BACKEND != "neuron":
        return ("the Neuron SDK's nki is not installed (nkilib is using its CPU simulator); run on a Trn2/Trn3 "
                "instance with the Neuron SDK (neuronx-cc, aws-neuronx-tools)")
    if not (os.path.exists("/dev/neuron0") or shutil.which("neuron-ls")):
        return "no Neuron device found (/dev/neuron0 missing)"
    return None


def measure(args) -> dict:
    """Benchmark and profile on the device: latency percentiles, NEFF/NTFF paths, engine utilisation."""
    import ml_dtypes
    import numpy as np
    import nki

    from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8 import mlp_backward_mxfp8_nki

    os.makedirs(args.out, exist_ok=True)
    os.environ.setdefault("NEURON_PLATFORM_TARGET_OVERRIDE", args.target)
    os.environ["NEURON_LOGICAL_NC_CONFIG"] = str(args.lnc)  # must match the kernel[lnc] launch (nki.jit docs)
    r = np.random.default_rng(0)
    bf16 = ml_dtypes.bfloat16
    S, H, I = args.S, args.H, args.I
    inputs = {"output_grad": (r.standard_normal((S, H)) * 1e-2).astype(bf16),
              "hidden_states": r.standard_normal((S, H)).astype(bf16),
              "gate_up_weights": (r.standard_normal((2 * I, H)) / np.sqrt(H)).astype(bf16),
              "down_proj_weight": (r.standard_normal((H, I)) / np.sqrt(I)).astype(bf16)}
    if args.recompute == "none":
        for name in ("gate_pre", "gate_act", "up", "intermediate"):
            inputs[name] = r.standard_normal((S, I)).astype(bf16)
    neff = os.path.join(args.out, "mlp_bwd.neff")
    ntff = os.path.join(args.out, "mlp_bwd.ntff")
    bench = nki.benchmark(warmup=args.warmup, iters=args.iters, save_neff_name=neff,
                          save_trace_name=ntff)(mlp_backward_mxfp8_nki)
    launch = bench[args.lnc] if args.lnc > 1 else bench
    launch(**inputs, matmul_precision=args.precision)
    lat = bench.benchmark_result.nc_latency
    p50, p99 = lat.get_latency_percentile(50) * 1e-6, lat.get_latency_percentile(99) * 1e-6  # us -> s
    out = {"p50_s": p50, "p99_s": p99, "neff": neff, "ntff": ntff}
    out.update(capture_profile(args, neff, os.path.join(args.out, "capture.ntff")))
    return out


def capture_profile(args, neff, ntff) -> dict:
    """neuron-explorer capture (or neuron-profile capture), then a summary JSON with engine utilisation."""
    if args.capture_cmd:
        cmd = args.capture_cmd.format(neff=neff, ntff=ntff).split()
    elif shutil.which("neuron-explorer"):
        cmd = ["neuron-explorer", "capture", "-n", neff, "-s", ntff]
    elif shutil.which("neuron-profile"):
        cmd = ["neuron-profile", "capture", "-n", neff, "-s", ntff]
    else:
        return {"profile_error": "neither neuron-explorer nor neuron-profile is on PATH (aws-neuronx-tools)"}
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        return {"profile_error": f"{' '.join(cmd)} failed: {res.stderr.strip()[-500:]}"}
    out = {"profile_cmd": " ".join(cmd), "profile_ntff": ntff}
    if shutil.which("neuron-profile"):
        view = subprocess.run(["neuron-profile", "view", "-n", neff, "-s", ntff, "--output-format", "summary-json"],
                              capture_output=True, text=True, check=False)
        try:
            summary = json.loads(view.stdout)
        except json.JSONDecodeError:
            summary = None
        if isinstance(summary, dict):
            # summary keys differ between SDKs: keep every utilisation-like number
            flat = summary.get("summary", [summary])
            flat = flat[0] if isinstance(flat, list) and flat else flat
            out["engine_utilisation"] = {k: v for k, v in flat.items()
                                         if "util" in k.lower() and isinstance(v, (int, float))}
    return out


def report(args, measured, predicted) -> str:
    flops = model_flops(args.S, args.H, args.I, args.recompute == "all")
    lines = [f"MLP backward S={args.S} H={args.H} I={args.I}  precision={args.precision} lnc={args.lnc} "
             f"recompute={args.recompute}  model FLOPs {flops:.4g}", ""]
    peak = predicted.get("peak_flops_per_s")
    lines.append(f"{'':<28}{'measured':>14}{'cost model':>14}")
    if measured:
        lines.append(f"{'latency p50 (us)':<28}{measured['p50_s'] * 1e6:>14.1f}"
                     f"{predicted.get('modeled_time_s', float('nan')) * 1e6:>14.1f}")
        lines.append(f"{'latency p99 (us)':<28}{measured['p99_s'] * 1e6:>14.1f}{'':>14}")
        if peak:
            lines.append(f"{'MFU (%)':<28}{flops / (measured['p50_s'] * peak) * 100:>14.2f}"
                         f"{predicted['mfu'] * 100:>14.2f}")
    else:
        lines.append(f"{'latency (us)':<28}{'-':>14}{predicted.get('modeled_time_s', float('nan')) * 1e6:>14.1f}")
        if peak:
            lines.append(f"{'MFU (%)':<28}{'-':>14}{predicted['mfu'] * 100:>14.2f}")
    meas_u = (measured or {}).get("engine_utilisation", {})
    for eng, u in sorted(predicted.get("engine_utilisation", {}).items()):
        lines.append(f"{'util ' + eng + ' (%)':<28}{'':>14}{u * 100:>14.1f}")
    for k, v in sorted(meas_u.items()):
        lines.append(f"{k:<28}{v:>14}{'':>14}")
    if "error" in predicted:
        lines.append(f"cost model unavailable: {predicted['error']}")
    if measured and "profile_error" in measured:
        lines.append(f"profile: {measured['profile_error']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.predict_only:
        print(json.dumps(predict(args.S, args.H, args.I, args.lnc, args.target, args.precision,
                                 args.recompute == "all")))
        return 0
    problem = neuron_problem()
    if problem is not None:
        print(f"profile_mlp_bwd_neuron: not on a Neuron instance: {problem}.\n"
              f"Nothing was measured. For the cost model's prediction alone, add --predict-only.", file=sys.stderr)
        return NOT_ON_NEURON_EXIT
    predicted = predict_in_child(args)
    measured = measure(args)
    print(report(args, measured, predicted))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "profile.json"), "w") as f:
        json.dump({"args": vars(args), "measured": measured, "predicted": predicted}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
