"""Speed of the `emulate` backend (bit-exact MXFP8 backward in torch) against plain torch autograd.

Usage (from the repository root):
    python simulations/emulate_speed.py                  # CPU, and CUDA when present: both presets, one table
    python simulations/emulate_speed.py --devices cpu --threads 1
    python simulations/emulate_speed.py --quick          # smoke run: one tiny shape, one repeat, every device
    python simulations/emulate_speed.py --shape 256 512 768 --repeats 2

Shapes (S, H, I): "qwen3-8b-tp8" = (4096, 4096, 1536), Qwen3-8B's MLP with I split over 8 ranks (the
S=4096 class of issue 14), and "small" = (512, 1024, 2816), issue 14's first measurement.

What is compared (same SwiGLU MLP, same inputs; W_gu [2I, H], W_down [H, I], x and dY [S, H]):
    plain bwd:   torch autograd's backward of y = (silu(x W_gate^T) * (x W_up^T)) W_down^T with every
                 tensor in the plain dtype (`.backward()` only; the forward runs untimed).
    emulate bwd: mlp_backward_emulate(dY, x, W_down, W_gu, gate_pre, gate_act, up, intermediate): the
                 backward the layer runs with backend="emulate", checkpoint="all" (MXFP8 e4m3fn, 1x32,
                 scale rule "neuron"), bit-identical to the kernel.
    plain step:  forward + backward of the plain autograd MLP.
    emulate step: the same forward matmuls in the plain dtype, the kernel's SwiGLU formulas for the bf16
                 checkpoints (swiglu_activations), then emulate bwd: what a training step with the
                 emulate backend costs when its forward runs at plain speed.
    emulate_fast bwd / step: the same with backend="emulate_fast" (gemm="fast": NOT bit-exact; the same MX
                 quantization, one float32-accumulating GEMM per product: bf16 tensor cores with a float32
                 result on CUDA, IEEE float32 elsewhere), and its distance from the exact emulation at the
                 measured shape (per gradient: fraction of elements that differ, mean relative error,
                 largest difference / largest |value|, relative Frobenius error).
    Ratios are emulate / plain (the goal: <= 2).
    Breakdown of emulate bwd (--breakdown, default on): the MX quantize-dequantize of the eight operands
    with the selected quantizer and with the eager one, the exact per-tile float64 GEMMs alone (the
    floor of this design: see README "Emulation speed"), the fast GEMMs alone, and the same four GEMMs in
    the plain dtype.

The plain dtype (--plain-dtype auto) is bfloat16 on CUDA and float32 on CPU: torch's CPU bf16 GEMM is
~50x slower than its fp32 GEMM on CPUs without AVX512-BF16 / AMX (measured on an AVX2 EPYC: 3.2 s vs
60 ms for [512, 1024] x [1024, 2816], one thread), so a bf16 CPU baseline would flatter the emulation.
On CPU with --threads 1 the timer is the thread's CPU time (time.thread_time: robust on a loaded,
shared machine; the load average is recorded); otherwise wall time. On CUDA: torch.cuda.Event timing
after warmup, synchronised. With --check (default on CUDA) it also checks that the emulation gives
bit-identical gradients on the device and on the CPU (small shape).

The fused quantizer (mlp_bwd_mxfp8_emulate.set_fused_quantizer, --quantizer, default "auto": compiled with
torch.compile for large operands) compiles during the warmup runs, which are not timed.

Writes simulations/out/emulate_speed.json (one entry per device).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

# the checkout this script lives in, first: an installed nkilib (e.g. an editable install of another
# worktree) must not stand in for the code being measured
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import nkilib  # noqa: E402,F401

import numpy as np  # noqa: E402
import torch  # noqa: E402

from nkilib.mx import quantize_mx  # noqa: E402

from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8 import mlp_bwd_mxfp8_emulate as emu  # noqa: E402
from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8 import mlp_bwd_mxfp8_emulate_fused as emu_fused  # noqa: E402

#: name -> (S, H, I)
PRESETS = {
    "qwen3-8b-tp8": (4096, 4096, 1536),  # Qwen3-8B (H=4096, I=12288) with I split over 8 ranks
    "small": (512, 1024, 2816),  # the shape of issue 14's first measurement
}
QUICK_SHAPE = (128, 256, 192)
OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", nargs="+", choices=("cpu", "cuda"), default=None,
                   help="devices to measure (default: cpu, and cuda when available)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="one device (same as --devices X)")
    p.add_argument("--preset", choices=("all", *PRESETS), default="all")
    p.add_argument("--shape", type=int, nargs=3, metavar=("S", "H", "I"), help="one shape instead of the presets")
    p.add_argument("--quick", action="store_true", help=f"smoke run: shape {QUICK_SHAPE}, 1 repeat, 1 warmup")
    p.add_argument("--plain-dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    p.add_argument("--quantizer", choices=emu.FUSED_QUANTIZER_MODES, default="auto",
                   help="emulate's MX quantizer (mlp_bwd_mxfp8_emulate.set_fused_quantizer)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per measurement (median; CPU 3, CUDA 10)")
    p.add_argument("--warmup", type=int, default=None, help="untimed runs first (CPU 1, CUDA 3)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--breakdown", action=argparse.BooleanOptionalAction, default=True,
                   help="time emulate's quantizer and GEMMs alone (default on)")
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=None,
                   help="device vs CPU bit-identity check on a small shape (default: on for CUDA)")
    p.add_argument("--out", default=None, help="JSON path (default simulations/out/emulate_speed.json)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def make_inputs(S: int, H: int, I: int, device, seed: int) -> dict:
    """bf16 operands of a trained-looking MLP: unit-variance x, 1/sqrt(fan-in) weights, small dY."""
    g = torch.Generator().manual_seed(seed)
    bf = torch.bfloat16
    t = {"x": torch.randn(S, H, generator=g),
         "dy": torch.randn(S, H, generator=g) * 1e-2,
         "w_gu": torch.randn(2 * I, H, generator=g) * H ** -0.5,
         "w_down": torch.randn(H, I, generator=g) * I ** -0.5}
    return {k: v.to(bf).to(device) for k, v in t.items()}


class Timer:
    """Median milliseconds of `fn` over repeats, after warmup (CUDA events / thread CPU time / wall)."""

    def __init__(self, device: str, repeats: int, warmup: int, cpu_time: bool):
        self.device, self.repeats, self.warmup, self.cpu_time = device, repeats, warmup, cpu_time
        self.kind = "cuda_event" if device == "cuda" else ("thread_cpu_time" if cpu_time else "wall")

    def __call__(self, fn, setup=None) -> float:
        """`setup()` (untimed) runs before each call and its result is passed to `fn`."""
        times = []
        for i in range(self.warmup + self.repeats):
            arg = setup() if setup is not None else None
            if self.device == "cuda":
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn(arg)
                end.record()
                torch.cuda.synchronize()
                ms = start.elapsed_time(end)
            else:
                clock = time.thread_time if self.cpu_time else time.perf_counter
                t0 = clock()
                fn(arg)
                ms = (clock() - t0) * 1e3
            if i >= self.warmup:
                times.append(ms)
        return statistics.median(times)


def plain_forward(t: dict, dtype, requires_grad: bool):
    """(y, leaves) of the plain SwiGLU MLP in `dtype`."""
    leaves = [t[k].to(dtype, copy=True).requires_grad_(requires_grad) for k in ("x", "w_gu", "w_down")]
    x, w_gu, w_down = leaves
    n_i = w_gu.shape[0] // 2
    h = x @ w_gu.t()  # K=H, M=S, N=2I
    a = torch.nn.functional.silu(h[:, :n_i]) * h[:, n_i:]
    y = a @ w_down.t()  # K=I, M=S, N=H
    return y, leaves


def emulate_step(t: dict, dtype, gemm="exact"):
    """Forward matmuls in `dtype`, the kernel's bf16 checkpoints, then the emulated backward (`gemm`)."""
    with torch.no_grad():
        x, w_gu = t["x"].to(dtype), t["w_gu"].to(dtype)
        n_i = w_gu.shape[0] // 2
        gate_pre = (x @ w_gu[:n_i].t()).to(torch.bfloat16)  # K=H, M=S, N=I
        up = (x @ w_gu[n_i:].t()).to(torch.bfloat16)  # K=H, M=S, N=I
        gate_act, intermediate = emu.swiglu_activations(gate_pre, up)
        _y = (intermediate.to(dtype) @ t["w_down"].to(dtype).t())  # K=I, M=S, N=H
        return emu.mlp_backward_emulate(t["dy"], t["x"], t["w_down"], t["w_gu"], gate_pre, gate_act, up,
                                        intermediate, gemm=gemm)


def checkpoints(t: dict) -> dict:
    """bf16 checkpoints as the layer's forward saves them (bf16 matmuls computed in float32)."""
    x, w_gu = t["x"].float(), t["w_gu"].float()
    n_i = w_gu.shape[0] // 2
    gate_pre = (x @ w_gu[:n_i].t()).to(torch.bfloat16)  # K=H, M=S, N=I
    up = (x @ w_gu[n_i:].t()).to(torch.bfloat16)  # K=H, M=S, N=I
    gate_act, intermediate = emu.swiglu_activations(gate_pre, up)
    return dict(gate_pre=gate_pre, gate_act=gate_act, up=up, intermediate=intermediate)


def measure(S: int, H: int, I: int, device: str, dtype, timer: Timer, seed: int) -> dict:
    t = make_inputs(S, H, I, device, seed)
    ck = checkpoints(t)
    dy_plain = t["dy"].to(dtype)

    def plain_bwd(graph):
        graph[0].backward(dy_plain)

    def plain_step(_):
        y, _leaves = plain_forward(t, dtype, True)
        y.backward(dy_plain)

    def emu_bwd(gemm):
        with torch.no_grad():  # as inside the op's autograd backward
            return emu.mlp_backward_emulate(t["dy"], t["x"], t["w_down"], t["w_gu"], **ck, gemm=gemm)

    row = {}
    row["plain_bwd_ms"] = timer(plain_bwd, setup=lambda: plain_forward(t, dtype, True))
    row["emulate_bwd_ms"] = timer(lambda _: emu_bwd("exact"))
    row["emulate_fast_bwd_ms"] = timer(lambda _: emu_bwd("fast"))
    row["plain_step_ms"] = timer(plain_step)
    row["emulate_step_ms"] = timer(lambda _: emulate_step(t, dtype))
    row["emulate_fast_step_ms"] = timer(lambda _: emulate_step(t, dtype, gemm="fast"))
    for kind in ("bwd", "step"):
        row[f"ratio_{kind}"] = row[f"emulate_{kind}_ms"] / row[f"plain_{kind}_ms"]
        row[f"ratio_fast_{kind}"] = row[f"emulate_fast_{kind}_ms"] / row[f"plain_{kind}_ms"]
    row["fast_vs_exact"] = {name: differences(f, e) for name, f, e in
                            zip(("dX", "dW_gate_up", "dW_down"), emu_bwd("fast"), emu_bwd("exact"))}
    return row


def differences(fast, exact) -> dict:
    """`fast` against `exact` (same shape): fraction of elements that differ, mean elementwise relative error
    (over exact != 0), largest difference / largest |exact|, relative Frobenius error."""
    f, e = fast.double(), exact.double()
    d = (f - e).abs()
    nz = e != 0
    return {"differ": (f != e).double().mean().item(), "mean_rel": (d[nz] / e[nz].abs()).mean().item(),
            "max_vs_max": (d.max() / e.abs().max()).item(), "norm_rel": (d.norm() / e.norm()).item()}


def products(t: dict, ck: dict, d_gu) -> dict:
    """The backward's four MX products (a [M, K], b [K, N]) as mlp_backward_emulate forms them."""
    return {"dI": (t["dy"], t["w_down"]), "dX": (d_gu, t["w_gu"]), "dW_gu": (d_gu.t(), t["x"]),
            "dW_down": (t["dy"].t(), ck["intermediate"])}


def breakdown(S: int, H: int, I: int, device: str, dtype, timer: Timer, seed: int, quantizer: str) -> dict:
    """Milliseconds of emulate bwd's parts: quantize-dequantize of the eight operands (selected and eager
    quantizer), the per-tile float64 GEMMs on the dequantized operands, and the four GEMMs in `dtype`."""
    t = make_inputs(S, H, I, device, seed)
    ck = checkpoints(t)
    g = torch.Generator().manual_seed(seed + 1)
    d_gu = (torch.randn(S, 2 * I, generator=g) * 1e-3).to(torch.bfloat16).to(device)
    prods = products(t, ck, d_gu)
    opts = dict(fmt=emu.element_format("float8_e4m3fn"), quant_scheme="1x32", scale_rule="neuron",
                k_tile=emu.MX_K_TILE, out_dtype=torch.float64)

    def quantize_all(_):
        return [(emu._quantize_dequantize(a, 1, **opts), emu._quantize_dequantize(b, 0, **opts))
                for a, b in prods.values()]

    row = {"quantize_ms": timer(quantize_all)}
    previous = emu.set_fused_quantizer("off")
    try:
        row["quantize_eager_ms"] = timer(quantize_all)
    finally:
        emu.set_fused_quantizer(previous)
    deq = quantize_all(None)
    row["gemm_f64_ms"] = timer(lambda _: [emu._tiled_sum(a, b, emu.MX_K_TILE) for a, b in deq])
    gemm = emu.resolve_gemm("fast", device)
    deq32 = [(a.float(), b.float()) for a, b in deq]
    row["gemm_fast"] = gemm
    row["gemm_fast_ms"] = timer(lambda _: [emu.fast_gemm(a, b, gemm) for a, b in deq32])
    plain = [(a.to(dtype), b.to(dtype)) for a, b in prods.values()]
    row["gemm_plain_ms"] = timer(lambda _: [a @ b for a, b in plain])  # K=H, 2I, S, S
    return row


def device_matches_cpu(device: str, seed: int, quantizer: str) -> bool:
    """Bit-identity of the emulated gradients on `device` (quantizer `quantizer`) and on the CPU (eager
    quantizer), small shape, two option sets; and of the device's quantizer with nkilib.mx (NumPy) on
    adversarial values (scale extremes, subnormals, ties, saturation, NaN / Inf groups), every format and rule."""
    t = make_inputs(256, 384, 320, "cpu", seed)  # K = 320 -> padded to 384; 2I = 640 (a 512 + 128 tile)
    ck = checkpoints(t)
    same = True
    for opts in (dict(), dict(quant_scheme="wrapX", fp8_dtype="float8_e5m2", scale_rule="rceil")):
        previous = emu.set_fused_quantizer("off")
        try:
            ref = emu.mlp_backward_emulate(t["dy"], t["x"], t["w_down"], t["w_gu"], **ck, **opts)
            emu.set_fused_quantizer(quantizer)
            got = emu.mlp_backward_emulate(*(t[k].to(device) for k in ("dy", "x", "w_down", "w_gu")),
                                           **{k: v.to(device) for k, v in ck.items()}, **opts)
            v = emu_fused.probe_values(device)
            for fmt in ("float8_e4m3fn", "float8_e5m2"):
                for rule in ("neuron", "rceil", "ocp_floor"):
                    q = emu.mx_quantize_dequantize(v, 1, fmt, "1x32", rule).cpu().numpy()
                    want = quantize_mx(v.cpu().numpy(), 1, fmt, rule).dequantize()
                    nan = np.isnan(want)
                    same &= bool(np.array_equal(np.isnan(q), nan)
                                 and np.array_equal(q[~nan].view(np.int32), want[~nan].view(np.int32)))
        finally:
            emu.set_fused_quantizer(previous)
        same &= all(torch.equal(r.view(torch.int16), g.cpu().view(torch.int16)) for r, g in zip(ref, got))
    return same


def device_env(device: str, dtype, timer: Timer, repeats: int, warmup: int, **extra) -> dict:
    """What a run's JSON records of its machine and timing (also simulations/moe_emulate_speed.py's)."""
    env = {"device": device, "device_name": torch.cuda.get_device_name() if device == "cuda" else platform.processor()
           or platform.machine(), "torch": torch.__version__, "threads": torch.get_num_threads(),
           "plain_dtype": str(dtype).replace("torch.", ""), "timer": timer.kind, "repeats": repeats,
           "warmup": warmup}
    env.update(extra)
    env.update(loadavg_before=os.getloadavg(), cpu_count=os.cpu_count())
    return env


def write_result(result: dict, out: str) -> None:
    """The JSON at `out` (its folder made if missing)."""
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}")


def run_device(device: str, args, shapes) -> dict:
    """Table and JSON entry for one device."""
    dtype = getattr(torch, args.plain_dtype) if args.plain_dtype != "auto" else (
        torch.bfloat16 if device == "cuda" else torch.float32)
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else (10 if device == "cuda" else 3))
    warmup = args.warmup if args.warmup is not None else (3 if device == "cuda" and not args.quick else 1)
    timer = Timer(device, repeats, warmup, cpu_time=(device == "cpu" and torch.get_num_threads() == 1))
    env = device_env(device, dtype, timer, repeats, warmup, quantizer=args.quantizer)
    print(f"\nemulate backend vs plain autograd on {env['device_name']} ({device}), plain dtype "
          f"{env['plain_dtype']}, quantizer {args.quantizer}, timer {timer.kind}, threads {env['threads']}, "
          f"load {env['loadavg_before'][0]:.1f} on {env['cpu_count']} CPUs, median of {repeats} after {warmup} warmup")
    print(f"{'S':>6} {'H':>6} {'I':>6} | {'plain bwd':>10} {'emu bwd':>10} {'ratio':>6} {'fast bwd':>10} "
          f"{'ratio':>6} | {'plain step':>10} {'emu step':>10} {'ratio':>6} {'fast step':>10} {'ratio':>6}   (ms; "
          f"fast = backend emulate_fast, not bit-exact)", flush=True)
    rows = []
    for S, H, I in shapes:
        r = {"S": S, "H": H, "I": I}
        r.update(measure(S, H, I, device, dtype, timer, args.seed))
        print(f"{S:>6} {H:>6} {I:>6} | {r['plain_bwd_ms']:>10.1f} {r['emulate_bwd_ms']:>10.1f} "
              f"{r['ratio_bwd']:>6.2f} {r['emulate_fast_bwd_ms']:>10.1f} {r['ratio_fast_bwd']:>6.2f} | "
              f"{r['plain_step_ms']:>10.1f} {r['emulate_step_ms']:>10.1f} {r['ratio_step']:>6.2f} "
              f"{r['emulate_fast_step_ms']:>10.1f} {r['ratio_fast_step']:>6.2f}", flush=True)
        print(f"{'':>20}   emulate_fast vs emulate: " + "; ".join(
            f"{name} differ {d['differ']:.2e}, mean rel {d['mean_rel']:.1e}, max/max {d['max_vs_max']:.1e}, "
            f"Frobenius {d['norm_rel']:.1e}" for name, d in r["fast_vs_exact"].items()), flush=True)
        if args.breakdown:
            r["breakdown"] = b = breakdown(S, H, I, device, dtype, timer, args.seed, args.quantizer)
            rest = r["emulate_bwd_ms"] - b["quantize_ms"] - b["gemm_f64_ms"]
            print(f"{'':>20}   emu bwd = quantize {b['quantize_ms']:.1f} "
                  f"(eager quantizer {b['quantize_eager_ms']:.1f})"
                  f" + float64 GEMMs {b['gemm_f64_ms']:.1f} + rest {rest:.1f}; the same GEMMs in {env['plain_dtype']}"
                  f" {b['gemm_plain_ms']:.1f} (float64 / plain {b['gemm_f64_ms'] / b['gemm_plain_ms']:.2f}x); "
                  f"fast GEMMs ({b['gemm_fast']}) {b['gemm_fast_ms']:.1f}", flush=True)
        rows.append(r)
    env["loadavg_after"] = os.getloadavg()
    result = {"env": env, "rows": rows}
    result["quantizer_status"] = emu_fused.fused_quantizer_status()
    print(f"MX quantizer used for the timings above: {result['quantizer_status']}", flush=True)
    if args.check if args.check is not None else device == "cuda":
        # on an accelerator "auto" means the compiled quantizer: check that one
        mode = "compile" if device != "cpu" and args.quantizer == "auto" else args.quantizer
        result["device_matches_cpu_bitwise"] = device_matches_cpu(device, args.seed, mode)
        print(f"emulated gradients on {device} bit-identical to the CPU's: {result['device_matches_cpu_bitwise']}")
        result["quantizer_status_check"] = emu_fused.fused_quantizer_status()
        print(f"MX quantizer in that check ({mode!r}): {result['quantizer_status_check']}")
    # True when torch.compile failed (or gave other bits on the probe values) and the eager quantizer ran instead
    result["fused_quantizer_fell_back"] = emu_fused._fused_state["failed"]
    if result["fused_quantizer_fell_back"]:
        print("the compiled quantizer was not used (see the warning above): eager quantizer timed")
    return result


def main(argv=None) -> dict:
    args = parse_args(argv)
    devices = args.devices or ([args.device] if args.device else
                               ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
    if "cuda" in devices and not torch.cuda.is_available():
        raise SystemExit("cuda: torch.cuda.is_available() is False on this machine")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    emu.set_fused_quantizer(args.quantizer)
    shapes = [tuple(args.shape)] if args.shape else [QUICK_SHAPE] if args.quick else (
        list(PRESETS.values()) if args.preset == "all" else [PRESETS[args.preset]])
    result = {"runs": [run_device(d, args, shapes) for d in devices]}
    write_result(result, args.out or os.path.join(OUT_DIR, "emulate_speed.json"))
    return result


if __name__ == "__main__":
    main()
