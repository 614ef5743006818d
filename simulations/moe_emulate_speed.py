"""Speed of the MoE op's `emulate` backend (bit-exact MXFP8 expert backward in torch) against plain torch autograd,
and the emulation's bit-identity across devices.

Usage (from the repository root):
    python simulations/moe_emulate_speed.py                 # CPU, and CUDA when present
    python simulations/moe_emulate_speed.py --quick         # smoke run: one tiny shape, one repeat
    python simulations/moe_emulate_speed.py --devices cuda --preset qwen3-30b-a3b

Shapes (T, H, I, E, k): "qwen3-30b-a3b" = (4096, 2048, 768, 128, 8), one Qwen3-30B-A3B MoE layer at 4096
tokens; "gpt-oss-20b" = (4096, 2880, 2880, 32, 4) with GPT-OSS's clamped SwiGLU; "small" = (1024, 512, 256, 16,
2), the CPU's default. Routing: each token's k experts drawn without replacement, uniformly (seeded); weights
softmax-normalised.

What is compared (the same routed SwiGLU experts, the same inputs, loss = <y, dY>):
    plain:        torch autograd through a per-expert loop (gather the expert's tokens, gate / up matmuls,
                  SiLU (or the clamped GPT-OSS function) * up, down matmul, scatter-add weighted by the routing
                  weight), every tensor in the plain dtype (bf16 on CUDA, float32 on CPU: see emulate_speed.py).
    emulate:      moe_swiglu_experts_mxfp8(..., backend="emulate", checkpoint="all"): the forward in bf16 torch
                  ops, the backward bit-identical to the kernel (MXFP8 e4m3fn, 1x32, scale rule "neuron").
    emulate_fast: the same with backend="emulate_fast" (float32-accumulating GEMMs: NOT bit-exact).
Each is timed as a step (forward + backward) and as the backward alone (the forward untimed before it); ratios
are emulate / plain. The timer is emulate_speed.Timer (CUDA events after warmup on CUDA; the thread's CPU time
with --threads 1 on CPU).

--check (default on CUDA): the emulate backend's gradients (dX, d_topk_weights, dW_gate_up, dW_down) on the
device are bit-identical to the CPU's, at a small shape with T not a multiple of 32, an empty expert and both
the plain and the clamped GPT-OSS SwiGLU.

Writes simulations/out/moe_emulate_speed.json (one entry per device).
"""
from __future__ import annotations

import argparse
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
# the checkout this script lives in, first (see emulate_speed.py)
sys.path.insert(0, os.path.join(_HERE, ".."))
sys.path.insert(0, _HERE)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import nkilib  # noqa: E402,F401
from emulate_speed import Timer, device_env, write_result  # noqa: E402
from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8 import mlp_bwd_mxfp8_emulate as emu  # noqa: E402
from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8 import mlp_bwd_mxfp8_emulate_fused as emu_fused  # noqa: E402
from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8.config import ClampLimits  # noqa: E402
from nkilib.experimental.moe_mxfp8 import moe_swiglu_experts_mxfp8  # noqa: E402
from nkilib.experimental.moe_mxfp8.constants import DEFAULT_BLOCK_SIZE  # noqa: E402
from nkilib.experimental.moe_mxfp8.moe_bwd_mxfp8_emulate import moe_backward_emulate  # noqa: E402
from nkilib.experimental.moe_mxfp8.moe_bwd_mxfp8_forward import forward_math  # noqa: E402

#: name -> (T, H, I, E, k, clamped)
PRESETS = {
    "qwen3-30b-a3b": (4096, 2048, 768, 128, 8, False),
    "gpt-oss-20b": (4096, 2880, 2880, 32, 4, True),
    "small": (1024, 512, 256, 16, 2, False),
}
QUICK_SHAPE = (96, 128, 64, 4, 2, False)
#: GPT-OSS-20B's SwiGLU: gate clamped above at 7, up to [-7, 7], gate * sigmoid(1.702 gate) * (up + 1)
GPT_OSS_CLAMPS = ClampLimits(non_linear_upper=7.0, linear_lower=-7.0, linear_upper=7.0, activation="gpt_oss")
OUT_DIR = os.path.join(_HERE, "out")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", nargs="+", choices=("cpu", "cuda"), default=None,
                   help="default: cpu, and cuda when present")
    p.add_argument("--preset", choices=("default", "all", *PRESETS), default="default",
                   help="default: 'small' on CPU, qwen3-30b-a3b and gpt-oss-20b on CUDA")
    p.add_argument("--quick", action="store_true", help=f"smoke run: shape {QUICK_SHAPE}, 1 repeat")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per measurement (median; CPU 3, CUDA 10)")
    p.add_argument("--warmup", type=int, default=None, help="untimed runs first (CPU 1, CUDA 3)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=None,
                   help="device vs CPU bit-identity of the emulated gradients (default: on for CUDA)")
    p.add_argument("--out", default=None, help="JSON path (default simulations/out/moe_emulate_speed.json)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def make_inputs(T: int, H: int, I: int, E: int, k: int, device, seed: int, empty_expert: bool = False) -> dict:
    """bf16 activations and weights (unit-variance x, 1/sqrt(fan-in) weights, small dY), uniform top-k routing
    without replacement (expert E-1 never chosen when empty_expert), softmax routing weights in float32."""
    g = torch.Generator().manual_seed(seed)
    choices = E - 1 if empty_expert else E
    ids = torch.argsort(torch.rand(T, choices, generator=g), dim=1)[:, :k]
    bf = torch.bfloat16
    t = {"x": torch.randn(T, H, generator=g).to(bf),
         "dy": (torch.randn(T, H, generator=g) * 1e-2).to(bf),
         "topk_ids": ids.to(torch.int64),
         "topk_weights": torch.softmax(torch.randn(T, k, generator=g), dim=1),
         "gate_up_weight": (torch.randn(E, 2 * I, H, generator=g) * H ** -0.5).to(bf),
         "down_weight": (torch.randn(E, H, I, generator=g) * I ** -0.5).to(bf)}
    return {name: v.to(device) for name, v in t.items()}


def plain_moe(x, topk_ids, topk_weights, gate_up_weight, down_weight, clamps):
    """y [T, H] of the routed SwiGLU experts in plain torch autograd ops, in the inputs' dtype."""
    n_i = gate_up_weight.shape[1] // 2
    y = torch.zeros_like(x)
    for e in range(gate_up_weight.shape[0]):
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        gu = x[tok] @ gate_up_weight[e].T
        gate, up = gu[:, :n_i], gu[:, n_i:]
        if clamps is None:
            h = F.silu(gate) * up
        else:  # GPT-OSS: gate clamped above, up clamped both ways, gate * sigmoid(1.702 gate) * (up + 1)
            gate = gate.clamp(max=clamps.non_linear_upper)
            up = up.clamp(clamps.linear_lower, clamps.linear_upper)
            h = gate * torch.sigmoid(1.702 * gate) * (up + 1)
        out = (h @ down_weight[e].T) * topk_weights[tok, slot, None].to(x.dtype)
        y = y.index_add(0, tok, out)
    return y


def _leaves(t: dict, dtype, device) -> list:
    names = ("x", "topk_weights", "gate_up_weight", "down_weight")
    return [t[n].detach().to(device=device, dtype=dtype if n != "topk_weights" else torch.float32)
            .requires_grad_(True) for n in names]


def measure(shape, device: str, dtype, timer: Timer, seed: int) -> dict:
    T, H, I, E, k, clamped = shape
    t = make_inputs(T, H, I, E, k, device, seed)
    clamps = GPT_OSS_CLAMPS if clamped else None
    dy_plain = t["dy"].to(dtype)

    def plain_forward():
        x, w, wgu, wd = _leaves(t, dtype, device)
        return plain_moe(x, t["topk_ids"], w, wgu, wd, clamps)

    def op_forward(backend):
        def fwd():
            x, w, wgu, wd = _leaves(t, torch.bfloat16, device)
            return moe_swiglu_experts_mxfp8(x, t["topk_ids"], w, wgu, wd, checkpoint="all", clamp_limits=clamps,
                                            backend=backend)
        return fwd

    row = {}
    for name, fwd, dy in (("plain", plain_forward, dy_plain), ("emulate", op_forward("emulate"), t["dy"]),
                          ("emulate_fast", op_forward("emulate_fast"), t["dy"])):
        row[f"{name}_step_ms"] = timer(lambda _: fwd().backward(dy))
        row[f"{name}_bwd_ms"] = timer(lambda y: y.backward(dy), setup=fwd)
    for name in ("emulate", "emulate_fast"):
        for kind in ("step", "bwd"):
            row[f"ratio_{name}_{kind}"] = row[f"{name}_{kind}_ms"] / row[f"plain_{kind}_ms"]
    return row


GRAD_NAMES = ("dX", "d_topk_weights", "dW_gate_up", "dW_down")


def _differing(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many elements of b (any device) differ in their bits from a's (CPU); -1 for another dtype / shape."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return -1
    bits = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return int((a.view(bits) != b.cpu().view(bits)).sum())


def _clamp_args(clamps) -> tuple:
    """forward_math's clamps: the four limits and the activation."""
    c = clamps or ClampLimits()
    return (c.non_linear_lower, c.non_linear_upper, c.linear_lower, c.linear_upper, c.activation)


def device_matches_cpu(device: str, seed: int) -> dict:
    """Bit-identity of the emulation on `device` and on the CPU: T = 200 (not a multiple of 32), H = 256, I = 160,
    E = 8 with expert 7 empty, k = 3; plain and clamped GPT-OSS SwiGLU. Per SwiGLU:
    Each entry: how many elements differ in their bits (0: identical).
        backward: moe_backward_emulate (what backend "emulate" runs) from the same inputs and the CPU's checkpoints,
                  per gradient, eager quantizer on the CPU, the compiled one on an accelerator: the claim of the
                  backend (bit-identical on any device);
        forward:  the bf16 torch forward (y and the four checkpoints) on both devices: torch's bf16 GEMMs are
                  not bit-reproducible across devices (cuBLAS and the CPU sum in other orders), so this may differ;
        op:       the whole op (forward then backward) on both devices: differs where the forward does."""
    t = make_inputs(200, 256, 160, 8, 3, "cpu", seed, empty_expert=True)
    names = ("dy", "x", "topk_ids", "topk_weights", "gate_up_weight", "down_weight")
    result = {}
    for name, clamps in (("swiglu", None), ("gpt_oss_clamped", GPT_OSS_CLAMPS)):
        def forward(dev):
            return forward_math(*(t[n].to(dev) for n in names[1:]), _clamp_args(clamps))

        def backward(dev, ck):
            return moe_backward_emulate(*(t[n].to(dev) for n in names), *(c.to(dev) for c in ck),
                                        block_size=DEFAULT_BLOCK_SIZE, clamp_limits=clamps)

        y_ref, *ck = forward(torch.device("cpu"))
        y_dev, *ck_dev = forward(device)
        previous = emu.set_fused_quantizer("off")  # the CPU reference: the eager quantizer
        try:
            ref = backward("cpu", ck)
            # on an accelerator the compiled quantizer (what "auto" runs on large operands there)
            emu.set_fused_quantizer("compile" if torch.device(device).type != "cpu" else "off")
            got = backward(device, ck)
        finally:
            emu.set_fused_quantizer(previous)
        op_ref, op_got = emulate_grads(t, "cpu", clamps), emulate_grads(t, device, clamps)
        result[name] = {
            "backward": {g: _differing(r, d) for g, r, d in zip(GRAD_NAMES, ref, got)},
            "forward": {n: _differing(r, d) for n, r, d in zip(("y", "gate_pre", "gate_act", "up", "intermediate"),
                                                                (y_ref, *ck), (y_dev, *ck_dev))},
            "op": {g: _differing(r, d) for g, r, d in zip(GRAD_NAMES, op_ref, op_got)}}
    return result


def emulate_grads(t: dict, device: str, clamps) -> list:
    """dX, d_topk_weights, dW_gate_up, dW_down of the op with backend "emulate" on `device` (on the CPU)."""
    x, w, wgu, wd = _leaves(t, torch.bfloat16, device)
    y = moe_swiglu_experts_mxfp8(x, t["topk_ids"].to(device), w, wgu, wd, checkpoint="all", clamp_limits=clamps,
                                 backend="emulate")
    y.backward(t["dy"].to(device))
    return [v.grad.detach().cpu() for v in (x, w, wgu, wd)]


def run_device(device: str, args, shapes) -> dict:
    """Table and JSON entry for one device."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else (10 if device == "cuda" else 3))
    warmup = args.warmup if args.warmup is not None else (3 if device == "cuda" and not args.quick else 1)
    timer = Timer(device, repeats, warmup, cpu_time=(device == "cpu" and torch.get_num_threads() == 1))
    env = device_env(device, dtype, timer, repeats, warmup)
    print(f"\nMoE emulate backend vs plain autograd on {env['device_name']} ({device}), plain dtype "
          f"{env['plain_dtype']}, timer {timer.kind}, threads {env['threads']}, median of {repeats} after {warmup} "
          f"warmup (ms; fast = emulate_fast, not bit-exact)")
    print(f"{'T':>6} {'H':>5} {'I':>5} {'E':>4} {'k':>2} | {'plain step':>10} {'emu step':>10} {'ratio':>6} "
          f"{'fast step':>10} {'ratio':>6} | {'plain bwd':>10} {'emu bwd':>10} {'ratio':>6} {'fast bwd':>10} "
          f"{'ratio':>6}", flush=True)
    rows = []
    for shape in shapes:
        T, H, I, E, k, clamped = shape
        r = {"T": T, "H": H, "I": I, "E": E, "k": k, "clamped": clamped}
        r.update(measure(shape, device, dtype, timer, args.seed))
        print(f"{T:>6} {H:>5} {I:>5} {E:>4} {k:>2} | {r['plain_step_ms']:>10.1f} {r['emulate_step_ms']:>10.1f} "
              f"{r['ratio_emulate_step']:>6.2f} {r['emulate_fast_step_ms']:>10.1f} "
              f"{r['ratio_emulate_fast_step']:>6.2f} | {r['plain_bwd_ms']:>10.1f} {r['emulate_bwd_ms']:>10.1f} "
              f"{r['ratio_emulate_bwd']:>6.2f} {r['emulate_fast_bwd_ms']:>10.1f} {r['ratio_emulate_fast_bwd']:>6.2f}"
              + ("  (clamped)" if clamped else ""), flush=True)
        rows.append(r)
    env["loadavg_after"] = os.getloadavg()
    result = {"env": env, "rows": rows, "quantizer_status": emu_fused.fused_quantizer_status()}
    print(f"MX quantizer used for the timings above: {result['quantizer_status']}", flush=True)
    if args.check if args.check is not None else device == "cuda":
        result["device_matches_cpu_bitwise"] = same = device_matches_cpu(device, args.seed)
        for name, parts in same.items():
            print(f"{name}: bit-identical on {device} and the CPU: " + "; ".join(
                f"{part} " + ", ".join(f"{k} {'yes' if v == 0 else f'NO ({v} differ)'}" for k, v in flags.items())
                for part, flags in parts.items()), flush=True)
    return result


def main(argv=None) -> dict:
    args = parse_args(argv)
    devices = args.devices or (["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
    if "cuda" in devices and not torch.cuda.is_available():
        raise SystemExit("cuda: torch.cuda.is_available() is False on this machine")
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    def shapes(device):
        if args.quick:
            return [QUICK_SHAPE]
        if args.preset == "all":
            return list(PRESETS.values())
        if args.preset != "default":
            return [PRESETS[args.preset]]
        return [PRESETS["qwen3-30b-a3b"], PRESETS["gpt-oss-20b"]] if device == "cuda" else [PRESETS["small"]]

    result = {"runs": [run_device(d, args, shapes(d)) for d in devices]}
    write_result(result, args.out or os.path.join(OUT_DIR, "moe_emulate_speed.json"))
    return result


if __name__ == "__main__":
    main()
