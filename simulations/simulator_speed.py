"""Simulator speed benchmark: the MXFP8 matmul example kernel through the NKI CPU simulator.

Usage (from the repository root):
    python simulations/simulator_speed.py                       # [4096, 4096] x [4096, 1536], LNC1
    python simulations/simulator_speed.py --shape 256 512 512 --lnc 2

Times one full numeric run (no trace), then counts the instructions with a cheap shape-only
traced run (`run_kernel(..., trace=True, numerics=False)`: same instruction stream, no math),
and prints wall time, instruction count and instructions per second, plus the per-instruction mix.
This is a benchmark, not a test (tests/simulator/test_simulator_speed.py only smoke-tests main()).

BLAS threads: every nc_matmul_mx is one small float64 GEMM (at most [512 x 128]^T @ [512 x 512]),
where OpenBLAS threading costs more than it gains (measured 2-4x slower on a loaded 2-core
machine). The script therefore defaults OPENBLAS_NUM_THREADS / OMP_NUM_THREADS to 1 unless they
are already set; it must do so before numpy is imported, hence the environment lines below.
"""
from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import collections  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

try:
    import nkilib  # noqa: F401
except ImportError:  # running from a checkout without installing: add the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import nkilib  # noqa: F401

from nkilib.examples.mxfp8_matmul import make_inputs, mxfp8_matmul_kernel
from nkilib.simulator import run_kernel

DEFAULT_SHAPE = (4096, 4096, 1536)  # M, K, N


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", type=int, nargs=3, metavar=("M", "K", "N"), default=list(DEFAULT_SHAPE),
                   help="A is [M, K], B is [K, N] (default %(default)s)")
    p.add_argument("--lnc", type=int, choices=(1, 2), default=1, help="logical NeuronCore degree (default 1)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None):
    """Run the benchmark; returns a dict with wall_s, instructions, instr_per_s and the mix."""
    args = parse_args(argv)
    M, K, N = args.shape
    a, b = make_inputs(M, K, N, seed=args.seed)
    fn = mxfp8_matmul_kernel.fn if hasattr(mxfp8_matmul_kernel, "fn") else mxfp8_matmul_kernel
    t0 = time.perf_counter()
    res = run_kernel(fn, kwargs=dict(a=a, b=b), lnc=args.lnc)
    wall = time.perf_counter() - t0
    t1 = time.perf_counter()
    shape_only = run_kernel(fn, kwargs=dict(a=a, b=b), lnc=args.lnc, trace=True, numerics=False)
    count_s = time.perf_counter() - t1
    mix = collections.Counter(r.instr for r in shape_only.trace)
    n = sum(mix.values())
    threads = os.environ.get("OPENBLAS_NUM_THREADS", "default")
    print(f"mxfp8_matmul [{M}, {K}] x [{K}, {N}] LNC{args.lnc} on the simulator ({res.target}), "
          f"OPENBLAS_NUM_THREADS={threads}")
    print(f"  wall time (numerics, no trace): {wall:.2f} s")
    print(f"  instructions (all programs):    {n}   ({n / wall:.0f} instr/s)")
    print(f"  shape-only traced run:          {count_s:.2f} s")
    print("  mix: " + ", ".join(f"{k} {v}" for k, v in sorted(mix.items(), key=lambda kv: -kv[1])))
    return {"wall_s": wall, "instructions": n, "instr_per_s": n / wall, "mix": dict(mix),
            "output_shape": res.outputs.shape}


if __name__ == "__main__":
    main()
