"""The NumPy numerics contract shared by the kernels' references (dense MLP and MoE backward).

The building blocks of mode "mx_exact" (the kernels' numerics, bit for bit) and mode "fp32" (the ideal float64
backward) that nkilib/experimental/mlp_mxfp8/mlp_bwd_mxfp8/reference.py and nkilib/experimental/moe_mxfp8/reference.py
both use (the torch counterpart, for the emulate backends: nkilib/experimental/emulate_numerics.py):
    * rounding points: ``to_bf16`` (RNE from float32), ``to_f32``, ``to_f64``, ``to_weight_grad``;
    * the SwiGLU / clamp numerics: activations evaluated in float64 on a float32 input and rounded once to
      float32 (``activation_fns64``, ``apply_activation``: silu, or GPT-OSS's gelu_apprx_sigmoid), clamps with
      their masks (``clamp_and_mask``, ``gate_terms``, ``up_terms``), ``swiglu_intermediate``;
    * the contract's matmul ``contract_mm`` (MXFP8: K zero-padded to 128, MX quantization along K with
      nkilib.mx.quantize_mx, scale rule "neuron", exact per-512-K-tile sums rounded to float32 and accumulated in
      float32; BF16: exact per-128-K-tile sums) and ``contract_matmul`` (that, or the float64 product in mode
      "fp32");
    * option checks (``check_mode``, ``reference_options``, ``weight_grad_np_dtype``; the rest is
      nkilib.core.options).
No nki, no torch.

Dimensions: S (or T): tokens, I: intermediate size; elementwise operands [S, I]; matmul operands [M, K] @ [K, N].
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from ..mx import mx_matmul, quantize_mx
from . import options
from .matmul.constants import BF16_K_TILE, MATMUL_PRECISIONS, MX_K_ALIGN, MX_K_TILE

__all__ = [
    "BF16",
    "MODES",
    "check_mode",
    "reference_options",
    "weight_grad_np_dtype",
    "to_bf16",
    "to_f32",
    "to_f64",
    "to_weight_grad",
    "activation_fns64",
    "apply_activation",
    "clamp_limit",
    "clamp_and_mask",
    "gate_terms",
    "up_terms",
    "swiglu_intermediate",
    "quantize_k",
    "contract_mm",
    "contract_matmul",
]

BF16 = np.dtype(ml_dtypes.bfloat16)
#: Reference modes: the kernel's exact numerics, or the ideal float64 backward.
MODES = ("mx_exact", "fp32")
#: Accepted weight_grad_dtype spellings -> numpy dtype.
_WEIGHT_GRAD_DTYPES = {"bfloat16": BF16, "float32": np.dtype(np.float32)}


# ----------------------------------------------------------------------------------------------
# option handling and elementary numerics
# ----------------------------------------------------------------------------------------------


def check_mode(mode: str) -> str:
    """`mode` if it is one of MODES, else ValueError naming the value."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return mode


def weight_grad_np_dtype(weight_grad_dtype) -> np.dtype:
    """NumPy dtype (BF16 or float32) of a weight_grad_dtype spelling (nkilib.core.options.weight_grad_dtype)."""
    name = options.weight_grad_dtype(weight_grad_dtype, spelled=f"one of {tuple(_WEIGHT_GRAD_DTYPES)}")
    return _WEIGHT_GRAD_DTYPES[name]


def to_bf16(x) -> np.ndarray:
    """bf16(v) of the contract: RNE to bfloat16 from float32 (float64 is rounded to float32 first,
    so that a float64 input gives the same bits as its float32 rounding fed to the kernel)."""
    a = np.asarray(x)
    if a.dtype == BF16:
        return a
    with np.errstate(over="ignore", invalid="ignore"):
        return a.astype(np.float32).astype(BF16)


def to_f32(x) -> np.ndarray:
    """x as a float32 array (a copy)."""
    return np.asarray(x).astype(np.float32)


def to_f64(x) -> np.ndarray:
    """x as a float64 array (a copy; exact for bf16 / float32)."""
    return np.asarray(x).astype(np.float64)


def _sigmoid64(x64: np.ndarray) -> np.ndarray:
    # Contract form of the sigmoid: 0.5 * (tanh(0.5 x) + 1), no overflow for large |x|.
    return 0.5 * (np.tanh(0.5 * x64) + 1.0)


def _silu64(x64: np.ndarray) -> np.ndarray:
    return x64 * _sigmoid64(x64)


def _silu_dx64(x64: np.ndarray) -> np.ndarray:
    s = _sigmoid64(x64)
    return s * (1.0 + x64 * (1.0 - s))


def _gelu_apprx_sigmoid64(x64: np.ndarray) -> np.ndarray:
    # ScalarE gelu_apprx_sigmoid: x * sigmoid(1.702 x)
    return x64 * _sigmoid64(options.GATE_ALPHAS["gpt_oss"] * x64)


def _gelu_apprx_sigmoid_dx64(x64: np.ndarray) -> np.ndarray:
    # d/dx [x s(ax)] = s(ax) (1 + a x (1 - s(ax))), a = 1.702
    alpha = options.GATE_ALPHAS["gpt_oss"]
    s = _sigmoid64(alpha * x64)
    return s * (1.0 + alpha * x64 * (1.0 - s))


def activation_fns64(clamp_limits) -> tuple:
    """(act, act_dx) float64 functions of the clamp's activation (options.ACTIVATIONS)."""
    if options.clamp_activation(clamp_limits) == "gpt_oss":
        return _gelu_apprx_sigmoid64, _gelu_apprx_sigmoid_dx64
    return _silu64, _silu_dx64


def apply_activation(fn, x32: np.ndarray, mode: str) -> np.ndarray:
    """Activation: float64 evaluation of a float32 input, rounded once to float32 (mx_exact), or
    plain float64 (fp32 mode)."""
    with np.errstate(invalid="ignore", over="ignore"):
        y = fn(to_f64(x32))
    return y.astype(np.float32) if mode == "mx_exact" else y


def clamp_limit(clamp_limits, name: str, mode: str):
    v = options.clamp_values(clamp_limits)[options.CLAMP_NAMES.index(name)]
    if v is None:
        return None
    # mx_exact: limits enter as np.float32(limit) (contract); fp32 mode keeps the exact float.
    return np.float32(v) if mode == "mx_exact" else np.float64(v)


def clamp_and_mask(v: np.ndarray, lower, upper):
    """clamp(v) = min(max(v, lower), upper) and mask = 1 where lower <= v <= upper, else 0.

    Both use the same (already rounded) limit values, so the mask is 1 exactly where the clamp is
    the identity. A missing bound is no bound / true. np.maximum / np.minimum propagate NaN, and a
    NaN compares false, so a NaN input gives clamp NaN and (with any bound) mask 0.

    Args:
        v: float32 (mx_exact) or float64 (fp32) [S, I].
        lower, upper: limit scalars of v's dtype, or None.

    Returns:
        (clamped [S, I] v.dtype, mask [S, I] v.dtype of 0.0 / 1.0).
    """
    c = v
    ok = np.ones(v.shape, dtype=bool)
    with np.errstate(invalid="ignore"):
        if lower is not None:
            c = np.maximum(c, lower)
            ok &= v >= lower
        if upper is not None:
            c = np.minimum(c, upper)
            ok &= v <= upper
    return c.astype(v.dtype, copy=False), ok.astype(v.dtype)


def gate_terms(gate_pre, clamp_limits, mode):
    """g -> (gc, maskG) in the mode's working precision."""
    g = to_f32(gate_pre) if mode == "mx_exact" else to_f64(gate_pre)
    return clamp_and_mask(
        g, clamp_limit(clamp_limits, "non_linear_lower", mode), clamp_limit(clamp_limits, "non_linear_upper", mode)
    )


def up_terms(up, clamp_limits, mode):
    """u -> (linear factor uc + offset, maskU) in the mode's working precision; the offset is
    options.UP_OFFSETS of the clamp's activation (1 for "gpt_oss": an fp32 add in mx_exact)."""
    u = to_f32(up) if mode == "mx_exact" else to_f64(up)
    uc, mask = clamp_and_mask(
        u, clamp_limit(clamp_limits, "linear_lower", mode), clamp_limit(clamp_limits, "linear_upper", mode)
    )
    offset = options.UP_OFFSETS[options.clamp_activation(clamp_limits)]
    if offset:
        uc = (uc + uc.dtype.type(offset)).astype(uc.dtype)
    return uc, mask


def swiglu_intermediate(gate_act, up, clamp_limits, mode):
    """intermediate = bf16(f32(gate_act) * uc) (mx_exact) or gate_act * uc in float64."""
    uc, _ = up_terms(up, clamp_limits, mode)
    if mode == "mx_exact":
        with np.errstate(over="ignore", invalid="ignore"):
            return to_bf16(to_f32(gate_act) * uc)
    return to_f64(gate_act) * uc


# ----------------------------------------------------------------------------------------------
# the contract's matmul
# ----------------------------------------------------------------------------------------------


def _pad_k(a: np.ndarray, axis: int, kp: int) -> np.ndarray:
    k = a.shape[axis]
    if k == kp:
        return a
    widths = [(0, 0), (0, 0)]
    widths[axis] = (0, kp - k)
    return np.pad(a, widths)


def _padded_k(k: int) -> int:
    return -(-k // MX_K_ALIGN) * MX_K_ALIGN


def quantize_k(a, axis: int, fp8: str, scheme: str):
    """Zero-pads axis `axis` of a 2-D bf16 operand to a multiple of 128 and MX-quantizes along it.

    Args:
        a: [R, C] bf16 (or float) array; `axis` is its contraction axis K.
        axis: 0 or 1.
        fp8: element format name.
        scheme: "1x32" or "wrapX".

    Returns:
        nkilib.mx.MXTensor of the padded [.., Kp, ..] operand (scale rule "neuron", k_tile 512).
    """
    a = to_bf16(a)
    kp = _padded_k(a.shape[axis])
    return quantize_mx(
        _pad_k(a, axis, kp), axis=axis, elem_format=fp8, scale_rule="neuron", scheme=scheme,
        k_tile=MX_K_TILE,
    )


def contract_mm(a, b, precision: str, fp8: str, scheme: str) -> np.ndarray:
    """The contract's matmul mm(A, B) = A @ B.

    mxfp8: K zero-padded to Kp = ceil(K / 128) * 128; A quantized along axis 1 and B along axis 0
    (quantize_mx, scale rule "neuron", k_tile 512); nkilib.mx.mx_matmul with k_tile 512 (per 512-K
    tile exact sum rounded to float32, float32 accumulation across tiles in order, last tile Kp % 512
    if nonzero).
    bf16: the bf16 values as is; per K tile of 128 (last tile = remainder) float64 sum of the exact
    products rounded to float32, float32 accumulation across tiles in order.

    Dimensions:
        a: [M, K] bf16, b: [K, N] bf16 -> [M, N] float32.

    Args:
        a: left operand [M, K].
        b: right operand [K, N].
        precision: "mxfp8" or "bf16".
        fp8: fp8 element format name (mxfp8 only).
        scheme: "1x32" or "wrapX" (mxfp8 only).

    Returns:
        float32 [M, N].
    """
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"contract_mm: incompatible operand shapes {a.shape} @ {b.shape}")
    if precision == "mxfp8":
        return mx_matmul(
            quantize_k(a, 1, fp8, scheme), quantize_k(b, 0, fp8, scheme), k_tile=MX_K_TILE
        )
    if precision != "bf16":
        raise ValueError(f"matmul precision must be one of {MATMUL_PRECISIONS}, got {precision!r}")
    a64 = to_f64(to_bf16(a))
    b64 = to_f64(to_bf16(b))
    k = a64.shape[1]
    acc = None
    with np.errstate(over="ignore", invalid="ignore"):
        for k0 in range(0, k, BF16_K_TILE):
            part = (a64[:, k0:k0 + BF16_K_TILE] @ b64[k0:k0 + BF16_K_TILE, :]).astype(np.float32)
            acc = part if acc is None else (acc + part).astype(np.float32)
    return acc


def contract_matmul(a, b, mode: str, precision: str, fp8: str, scheme: str) -> np.ndarray:
    """mm of the contract (mx_exact, float32 result) or the float64 product (fp32 mode)."""
    if mode == "fp32":
        with np.errstate(over="ignore", invalid="ignore"):
            return to_f64(a) @ to_f64(b)
    return contract_mm(to_bf16(a), to_bf16(b), precision, fp8, scheme)


def to_weight_grad(v: np.ndarray, mode: str, wg_dtype: np.dtype) -> np.ndarray:
    """wg of the contract: float32 -> weight_grad_dtype (bf16 RNE or as is); fp32 mode: unchanged."""
    if mode == "fp32":
        return v
    return to_bf16(v) if wg_dtype == BF16 else v.astype(np.float32)


def reference_options(mode, fp8_dtype, quant_scheme, matmul_precision):
    """(mode, fp8 format name, quant scheme, matmul precision), each validated (errors name the option)."""
    return (check_mode(mode), options.fp8_format(fp8_dtype), options.quant_scheme(quant_scheme),
            options.matmul_precision(matmul_precision))
