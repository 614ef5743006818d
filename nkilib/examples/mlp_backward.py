"""Main job: run the MXFP8 MLP backward on a model shape in the simulator and print its error table.

    python -m nkilib.examples.mlp_backward --model qwen3-8b-tp8 --seq 512 [--lnc 2] [--fp8 e4m3fn|e5m2]
        [--scheme 1x32|wrapX] [--target trn3|trn2] [--seed N] [--no-model]

Errors are reported against the MX-exact reference (same quantization, fp32 accumulation: should be
~0) and against the fp32 ideal backward (the quantization error of MXFP8). Then the cost model's
modeled time, MFU and band (central estimate, pessimistic end) of the same call
(`--no-model` skips it; see nkilib/examples/mlp_backward_cost.py).
"""
from __future__ import annotations

import argparse
import os
import time

import ml_dtypes
import numpy as np

import nkilib  # noqa: F401  (selects the nki backend)
import nki

from ..experimental.mlp_mxfp8.mlp_bwd_mxfp8 import mlp_backward_mxfp8_nki
from ..experimental.mlp_mxfp8.mlp_bwd_mxfp8.reference import error_report, mlp_backward_reference
from .mlp_backward_cost import band_line
from ..models import PRESETS, preset

OUTPUT_NAMES = ("hidden_states_grad", "gate_up_weight_grad", "down_proj_weight_grad")


def make_inputs(seq: int, hidden: int, intermediate: int, seed: int = 0) -> dict:
    """Seeded bf16 inputs with LLM-like scales (unit activations, 1/sqrt(fan_in) weights)."""
    rng = np.random.default_rng(seed)
    bf16 = ml_dtypes.bfloat16
    return {
        "output_grad": (rng.standard_normal((seq, hidden)) * 1e-2).astype(bf16),
        "hidden_states": rng.standard_normal((seq, hidden)).astype(bf16),
        "gate_up_weights": (rng.standard_normal((2 * intermediate, hidden)) / np.sqrt(hidden)).astype(bf16),
        "down_proj_weight": (rng.standard_normal((hidden, intermediate)) / np.sqrt(intermediate)).astype(bf16),
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-8b-tp8", choices=sorted(PRESETS))
    ap.add_argument("--seq", type=int, default=512, help="tokens S on this core pair")
    ap.add_argument("--lnc", type=int, default=2, choices=(1, 2))
    ap.add_argument("--fp8", default="e4m3fn", choices=("e4m3fn", "e5m2"))
    ap.add_argument("--scheme", default="1x32", choices=("1x32", "wrapX"))
    ap.add_argument("--target", default="trn3", choices=("trn3", "trn2"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-model", action="store_true", help="skip the cost-model estimate")
    args = ap.parse_args(argv)
    os.environ["NEURON_PLATFORM_TARGET_OVERRIDE"] = args.target
    shape = preset(args.model)
    precision = "mxfp8" if args.target == "trn3" else "bf16"
    fp8 = f"float8_{args.fp8}"
    inputs = make_inputs(args.seq, shape.hidden, shape.intermediate, args.seed)
    print(f"{shape.name}: S={args.seq} H={shape.hidden} I={shape.intermediate}  target={args.target} "
          f"lnc={args.lnc} precision={precision} fp8={fp8} scheme={args.scheme}")
    t0 = time.perf_counter()
    outputs = nki.simulate(mlp_backward_mxfp8_nki)[args.lnc](
        **inputs, fp8_x4_dtype=getattr(nki.language, f"{fp8}_x4"), quant_scheme=args.scheme,
        matmul_precision=precision)
    t_kernel = time.perf_counter() - t0
    common = dict(fp8_dtype=fp8, quant_scheme=args.scheme, matmul_precision=precision)
    exact = mlp_backward_reference(**inputs, mode="mx_exact", **common)
    ideal = mlp_backward_reference(**inputs, mode="fp32", **common)
    print(f"simulated in {t_kernel:.1f} s\n")
    header = f"{'output':<24}{'vs mx_exact: max|d|':>22}{'rel.frob':>12}{'vs fp32: rel.frob':>20}{'cosine':>12}"
    print(header)
    print("-" * len(header))
    table = {}
    for name, out, ex, idl in zip(OUTPUT_NAMES, outputs, exact, ideal):
        e_exact, e_ideal = error_report(out, ex), error_report(out, idl)
        table[name] = {"vs_mx_exact": e_exact, "vs_fp32": e_ideal}
        print(f"{name:<24}{e_exact['max_abs']:>22.3e}{e_exact['rel_fro']:>12.2e}"
              f"{e_ideal['rel_fro']:>20.3e}{e_ideal['cosine']:>12.6f}")
    if not args.no_model:
        # the call above passed no checkpoints: the kernel recomputed them (16·S·H·I model FLOPs)
        table["modeled"] = band_line(args.seq, shape.hidden, shape.intermediate, args.target, precision, args.lnc,
                                     recompute=True)
        print("\n" + table["modeled"])
    return table


if __name__ == "__main__":
    main()
