"""The emulation's opt-in fast GEMMs (backend "emulate_fast"): the same MX operands, NOT the kernel's bits.

The exact emulation (mlp_bwd_mxfp8_emulate.contract_matmul, gemm="exact") sums each 512-wide K tile of
the dequantized MX products exactly (float64 GEMMs) and rounds once to float32, as nc_matmul_mx does:
bit-identical to the kernel, but bounded below by the float64 / plain GEMM throughput ratio (README
"Emulation speed": ~2.2x fp32 on a CPU, ~10x bf16 on an H100). For convergence studies on a GPU, where
that ratio is the whole cost, the fast GEMMs keep the quantization bit-identical (the same fp8 codes and
E8M0 scales: one quantizer, mx_quantize_dequantize) and only change how the products of the dequantized
operands are summed:

    "fp32": one float32 GEMM over all of K, TF32 off (IEEE float32 products and sums: every MX value is
        exact in float32, so only the summation rounds, in BLAS / cuBLAS order instead of per tile);
    "bf16": one bf16 GEMM with float32 accumulation and a float32 result (torch.mm(..., out_dtype=float32),
        CUDA only; bf16 reduced-precision split-K reductions off). MX values have at most 4 (e4m3) / 3
        (e5m2) significant bits, so they are exact in bf16 in its normal range (|v| >= 2**-126; smaller
        values, i.e. groups whose scale is below ~2**-117, round to bf16's subnormal grid): the products
        are the same exact products, summed in the tensor cores' float32 accumulation. It runs at bf16
        tensor-core speed, where "fp32" does not: an H100's non-tensor float32 rate (67 TFLOP/s, SXM) is
        its float64 tensor-core rate;
    "fast": "bf16" for CUDA tensors, else "fp32" (torch's CPU bf16 GEMM is ~50x slower than its fp32 one
        on CPUs without AVX512-BF16 / AMX).

How far from the exact emulation: the sums differ by float32 rounding (relative ~2**-24 per addition,
so ~K * 2**-24 of the sum of |products| at worst, far less on random data), and outputs that the kernel
rounds to bf16 (dX, the bf16 checkpoint gradients d_gate / d_up, bf16 weight gradients) differ where
that changes a bf16 rounding: a small fraction of elements by one bf16 ulp, plus what those propagate
(tests/torch/test_emulate_fast.py and README "Emulation speed" give measured bounds). That is ~2-3
orders of magnitude below the MXFP8 quantization error itself (~5% relative for e4m3), but it is not
the kernel: use "emulate" (exact) where bit-identity matters.

Dimensions:
    a [M, K], b [K, N] (dequantized MX operands or bf16) -> [M, N] float32.
"""
from __future__ import annotations

import contextlib

import torch

from ....core.options import check_choice

__all__ = ["EMULATE_GEMMS", "resolve_gemm", "fast_gemm"]

#: gemm= choices of the emulation ("exact": the kernel's bits; the others: module docstring).
EMULATE_GEMMS = ("exact", "fast", "fp32", "bf16")


def resolve_gemm(gemm: str, device) -> str:
    """"fast" -> "bf16" on CUDA, else "fp32"; the others validated as is.

    Raises:
        ValueError: an unknown gemm, or "bf16" off CUDA (torch.mm's float32 out_dtype is CUDA only).
    """
    check_choice("gemm", gemm, EMULATE_GEMMS)
    is_cuda = torch.device(device).type == "cuda"
    if gemm == "fast":
        return "bf16" if is_cuda else "fp32"
    if gemm == "bf16" and not is_cuda:
        raise ValueError(f"gemm='bf16' needs CUDA tensors (torch.mm with a float32 out_dtype), got device "
                         f"{torch.device(device)}; use gemm='fp32' or 'fast' (fp32 off CUDA)")
    return gemm


@contextlib.contextmanager
def _ieee_float32_accumulation():
    """float32 GEMMs in IEEE float32 (TF32 off) and bf16 GEMMs without reduced-precision reductions, restored
    afterwards (torch's global matmul settings)."""
    precision = torch.get_float32_matmul_precision()
    reduced = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(precision)
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = reduced


def fast_gemm(a: torch.Tensor, b: torch.Tensor, gemm: str) -> torch.Tensor:
    """a @ b in one GEMM with float32 accumulation ("fp32" or "bf16", resolved): module docstring.

    Dimensions:
        a [M, K], b [K, N] (values exact in the GEMM's operand dtype) -> [M, N] float32.
    """
    with _ieee_float32_accumulation():
        if gemm == "bf16":
            return torch.mm(a.to(torch.bfloat16), b.to(torch.bfloat16), out_dtype=torch.float32)  # K=K, M=M, N=N
        return torch.mm(a.to(torch.float32), b.to(torch.float32))  # K=K, M=M, N=N
