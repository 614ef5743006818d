"""Profile the MLP backward kernel on a real Trn2/Trn3 instance, next to the cost model's prediction.

    python simulations/profile_mlp_bwd_neuron.py --model qwen3-8b-tp8 --seq 4096 [--lnc 2]
        [--precision mxfp8|bf16] [--recompute none|all] [--out DIR] [--neff PATH]
    python simulations/profile_mlp_bwd_neuron.py --shape 4096 4096 1536 --predict-only   # any machine

What it does where the Neuron SDK is installed (genuine `nki`, torch-neuronx with a Neuron device):
  1. runs the kernel twice on seeded bf16 inputs of the chosen shape (S, H, I), in a child process
     started with NEURON_FRAMEWORK_DEBUG=1 (kernel source tracking in the profile),
     NEURON_LOGICAL_NC_CONFIG=<lnc> (the launch's LNC degree must match it) and
     TORCH_NEURONX_NEFF_CACHE_DIR=<out>/neff (where torch-neuronx keeps the compiled NEFF); the kernel is
     called on TorchNeuron tensors exactly as the PyTorch layer calls it (mlp_bwd_mxfp8_neuron.call_kernel),
  2. captures a device profile of that NEFF's second execution:
     ``neuron-explorer capture -n <neff> -s <ntff> --profile-nth-exec=2``,
  3. summarises it: ``neuron-explorer view -n <neff> -s <ntff> --output-format summary-json``, and prints
     the kernel's device time, MFU (model FLOPs 12*S*H*I, 16*S*H*I with full recompute, over the peak of
     the precision x LNC cores) and the summary's utilisation fields next to nkilib's engine-level cost
     model prediction for the same shape (computed in a child process on the bundled simulator,
     NKILIB_SIMULATOR=1, because the cost model needs the simulator's instruction trace).
Off Neuron it exits with status 2 and a message saying so (``--predict-only`` still works anywhere).
``nki.benchmark`` is not used: the NKI release notes list nki.benchmark and nki.profile as not
available since NKI Beta 2 (SDK 2.27/2.28+).

NOT EXERCISED BY CI: this repository has no Neuron device or SDK; the flow follows the docs:
https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/nki_rn.html (nki.benchmark / nki.profile unavailable)
https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.0/nki/guides/use-neuron-profile.html (neuron-explorer capture)
https://awsdocs-neuron.readthedocs-hosted.com/en/latest/tools/neuron-explorer/how-to-profile-workload.html
    (NEURON_FRAMEWORK_DEBUG=1 for NKI source tracking)
https://awsdocs-neuron.readthedocs-hosted.com/en/latest/tools/neuron-explorer/profile-artifacts.html
    (NEFF/NTFF pairing; TORCH_NEURONX_NEFF_CACHE_DIR)
https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.1/nki/api/generated/nki.jit.html (NEURON_LOGICAL_NC_CONFIG)
The summary JSON's field names are not documented; every numeric field is kept, and the device time
is read from the first of TIME_KEYS present (pass --time-key to choose another).
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
#: summary-json fields tried, in order, for the kernel's device time (seconds or microseconds, by name).
TIME_KEYS = ("total_time", "total_time_s", "total_duration", "kernel_time", "device_time", "total_time_us")
#: how many times the child runs the kernel: capture profiles execution 2 (the first one compiles/loads).
KERNEL_RUNS = 2


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
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "profile"))
    p.add_argument("--neff", default=None, help="profile this NEFF instead of the one the kernel run compiles")
    p.add_argument("--time-key", default=None, help="summary-json field holding the device time (default: TIME_KEYS)")
    p.add_argument("--run-kernel", action="store_true", help=argparse.SUPPRESS)  # the child process of measure()
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
    from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8 import mlp_bwd_mxfp8_neuron as neuron

    if neuron.torchneuron_nki_op() is None:
        return "torch-neuronx with nki_op (TorchNeuron, Neuron SDK 2.33+) is not installed"
    return None


def run_kernel(args) -> None:
    """Child process: the kernel KERNEL_RUNS times on TorchNeuron tensors (compiles the NEFF on the first run)."""
    import torch
    import torch_neuronx  # noqa: F401  (TorchNeuron: registers the "neuron" device)

    from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8 import mlp_bwd_mxfp8_neuron as neuron

    g = torch.Generator().manual_seed(0)
    S, H, I = args.S, args.H, args.I
    dev = torch.device("neuron")  # TorchNeuron's device (torch-neuronx native device)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16).to(dev)

    dy, x = rand(S, H, scale=1e-2), rand(S, H)
    w_gu, w_down = rand(2 * I, H, scale=H ** -0.5), rand(H, I, scale=I ** -0.5)
    ckpts = (None,) * 4 if args.recompute == "all" else tuple(rand(S, I) for _ in range(4))
    lnc = neuron.resolve_neuron_lnc(args.lnc)
    for _ in range(KERNEL_RUNS):
        outs = neuron.call_kernel(dy, x, w_gu, w_down, ckpts, (None,) * 4, "float8_e4m3fn", "1x32", args.precision,
                                  "neuron", "bfloat16", lnc)
        _ = [o.cpu() for o in outs]  # wait for the device


def kernel_env(args) -> dict:
    """Environment of the kernel run (see the module docstring for each variable's source)."""
    return dict(os.environ, NEURON_FRAMEWORK_DEBUG="1", NEURON_LOGICAL_NC_CONFIG=str(args.lnc),
                NEURON_PLATFORM_TARGET_OVERRIDE=os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE", args.target),
                TORCH_NEURONX_NEFF_CACHE_DIR=os.path.join(args.out, "neff"))


def find_neff(neff_dir: str) -> str | None:
    """The largest NEFF under neff_dir (the MLP backward kernel dwarfs any helper graph), or None."""
    found = [os.path.join(root, f) for root, _, files in os.walk(neff_dir) for f in files if f.endswith(".neff")]
    return max(found, key=os.path.getsize) if found else None


def capture_commands(neff: str, ntff: str) -> tuple:
    """(capture, view) command lines of the documented Neuron Explorer flow."""
    return (["neuron-explorer", "capture", "-n", neff, "-s", ntff, "--profile-nth-exec=2"],
            ["neuron-explorer", "view", "-n", neff, "-s", ntff, "--output-format", "summary-json"])


def summary_numbers(summary) -> dict:
    """Every numeric field of a summary-json document, flattened to dotted keys."""
    out = {}

    def walk(node, prefix):
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}{k}.")
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{prefix}{i}.")
        elif isinstance(node, (int, float)) and not isinstance(node, bool):
            out[prefix[:-1]] = float(node)

    walk(summary, "")
    return out


def device_time_s(numbers: dict, time_key: str | None) -> float | None:
    """The kernel's device time in seconds from the flattened summary (a '_us' / '_ms' suffix gives the unit)."""
    keys = [time_key] if time_key else list(TIME_KEYS)
    for want in keys:
        for k, v in numbers.items():
            if k == want or k.endswith("." + want):
                scale = 1e-6 if want.endswith("_us") else 1e-3 if want.endswith("_ms") else 1.0
                return v * scale
    return None


def measure(args) -> dict:
    """Run, capture, summarise on the device: NEFF/NTFF paths, device time, utilisation-like fields."""
    os.makedirs(args.out, exist_ok=True)
    neff = args.neff
    if neff is None:
        child = [sys.executable, os.path.abspath(__file__), "--shape", str(args.S), str(args.H), str(args.I),
                 "--lnc", str(args.lnc), "--target", args.target, "--precision", args.precision, "--recompute",
                 args.recompute, "--out", args.out, "--run-kernel"]
        res = subprocess.run(child, env=kernel_env(args), capture_output=True, text=True, check=False)
        if res.returncode != 0:
            return {"error": f"kernel run failed: {res.stderr.strip()[-800:]}"}
        neff = find_neff(os.path.join(args.out, "neff"))
        if neff is None:
            return {"error": f"no .neff under {os.path.join(args.out, 'neff')}; pass --neff PATH"}
    ntff = os.path.join(args.out, "mlp_bwd.ntff")
    capture, view = capture_commands(neff, ntff)
    if shutil.which("neuron-explorer") is None:
        return {"neff": neff, "error": "neuron-explorer is not on PATH (aws-neuronx-tools)"}
    res = subprocess.run(capture, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        return {"neff": neff, "error": f"{' '.join(capture)} failed: {res.stderr.strip()[-500:]}"}
    res = subprocess.run(view, capture_output=True, text=True, check=False)
    try:
        numbers = summary_numbers(json.loads(res.stdout))
    except json.JSONDecodeError:
        return {"neff": neff, "ntff": ntff, "error": f"{' '.join(view)} gave no JSON: {res.stderr.strip()[-500:]}"}
    return {"neff": neff, "ntff": ntff, "time_s": device_time_s(numbers, args.time_key),
            "utilisation": {k: v for k, v in numbers.items() if "util" in k.lower()}, "summary": numbers}


def report(args, measured, predicted) -> str:
    """Measured (device profile) next to modeled: time, MFU, engine utilisation."""
    flops = model_flops(args.S, args.H, args.I, args.recompute == "all")
    lines = [f"MLP backward S={args.S} H={args.H} I={args.I}  precision={args.precision} lnc={args.lnc} "
             f"recompute={args.recompute}  model FLOPs {flops:.4g}", ""]
    peak = predicted.get("peak_flops_per_s")
    measured = measured or {}
    t = measured.get("time_s")
    lines.append(f"{'':<28}{'measured':>14}{'cost model':>14}")
    lines.append(f"{'device time (us)':<28}{t * 1e6 if t else float('nan'):>14.1f}"
                 f"{predicted.get('modeled_time_s', float('nan')) * 1e6:>14.1f}")
    if peak:
        lines.append(f"{'MFU (%)':<28}{flops / (t * peak) * 100 if t else float('nan'):>14.2f}"
                     f"{predicted['mfu'] * 100:>14.2f}")
    for eng, u in sorted(predicted.get("engine_utilisation", {}).items()):
        lines.append(f"{'util ' + eng + ' (%)':<28}{'':>14}{u * 100:>14.1f}")
    for k, v in sorted(measured.get("utilisation", {}).items()):
        lines.append(f"{k:<28}{v:>14.4g}{'':>14}")
    if "error" in predicted:
        lines.append(f"cost model unavailable: {predicted['error']}")
    if "error" in measured:
        lines.append(f"measurement: {measured['error']}")
    elif measured and t is None:
        lines.append(f"measurement: no device time among {TIME_KEYS} in the summary; pass --time-key "
                     f"(fields: {', '.join(sorted(measured.get('summary', {}))[:20])})")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.run_kernel:
        run_kernel(args)
        return 0
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
