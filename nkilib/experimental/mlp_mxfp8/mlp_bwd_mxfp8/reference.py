"""NumPy references of the MXFP8 SwiGLU MLP backward kernel (no nki, no torch).

Two modes:
    * ``"mx_exact"``: the kernel's numerics contract (written down in the docstrings below)
      reproduced bit for bit: K padded to 128, MX quantization along each matmul's
      contraction axis (``nkilib.mx.quantize_mx``, scale rule "neuron", K tiles of 512), per-tile
      float32 accumulation (``nkilib.mx.mx_matmul``), float32 elementwise math with activations
      evaluated in float64 and rounded once to float32, bf16 (RNE) at the contract's rounding points.
    * ``"fp32"``: the ideal backward for accuracy studies: no quantization and no bf16 rounding,
      float64 math throughout (analytic SwiGLU derivative, the same clamps and masks with the limits
      taken as exact float64 values, missing checkpoints recomputed in float64).

Forward being differentiated (clamped SwiGLU):
    gate_pre = X W_gate^T, up = X W_up^T, gc = clamp(gate_pre), uc = clamp(up),
    gate_act = silu(gc), intermediate = gate_act * uc, Y = intermediate W_down^T.

Dimensions:
    S: tokens, H: hidden size, I: intermediate size (per shard).
    X = hidden_states [S, H], dY = output_grad [S, H], W_gu = gate_up_weights [2I, H]
    (W_gate = rows 0..I-1, W_up = rows I..2I-1), W_down = down_proj_weight [H, I],
    checkpoints gate_pre, gate_act, up, intermediate [S, I].

The contract's building blocks (rounding points, SwiGLU / clamp numerics, the contract matmul) are
nkilib/core/numerics.py, shared with the MoE reference.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ....core.numerics import (MODES, activation_fns64, apply_activation, contract_matmul, gate_terms,  # noqa: F401
                               reference_options, swiglu_intermediate, to_bf16, to_f32, to_f64, to_weight_grad,
                               up_terms, weight_grad_np_dtype)
from .prequantized import (dequantize_prequantized, prequantize, prequantized_operands,  # noqa: F401  (public here)
                           swizzle_prequantized, unswizzle_prequantized)

__all__ = [
    "MODES",
    "Checkpoints",
    "mlp_backward_reference",
    "reference_phase0_recompute",
    "reference_phase1_down_proj_grad",
    "reference_phase2_hidden_states_grad",
    "reference_phase3_gate_up_weight_grad",
    "reference_phase4_down_weight_grad",
    "prequantize",
    "swizzle_prequantized",
    "unswizzle_prequantized",
    "dequantize_prequantized",
    "prequantized_operands",
    "error_report",
    "ulp_diff_bf16",
    "fraction_over_ulp",
]


class Checkpoints(NamedTuple):
    """The four forward activations the backward needs (or recomputes).

    Attributes:
        gate_pre: [S, I] pre-activation of the gate projection.
        gate_act: [S, I] silu(clamp(gate_pre)).
        up: [S, I] up projection.
        intermediate: [S, I] gate_act * clamp(up).
    """

    gate_pre: np.ndarray
    gate_act: np.ndarray
    up: np.ndarray
    intermediate: np.ndarray


# ----------------------------------------------------------------------------------------------
# option handling and operands (the elementary numerics and the contract's matmul: nkilib.core.numerics)
# ----------------------------------------------------------------------------------------------


# fp8 format / quant scheme / matmul precision / weight-grad dtype / clamps: validated by nkilib.core.options
# (reference_options), shared with the kernel, the torch emulation and the torch layer.


def _operand(x, mode: str) -> np.ndarray:
    """Kernel inputs are bf16 (mx_exact rounds other float inputs to bf16); fp32 mode keeps values."""
    return to_bf16(x) if mode == "mx_exact" else to_f64(x)


def _check_2d(name: str, x, shape) -> None:
    if x is not None and tuple(np.shape(x)) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(np.shape(x))}")


# ----------------------------------------------------------------------------------------------
# phases
# ----------------------------------------------------------------------------------------------


def reference_phase0_recompute(
    hidden_states,
    gate_up_weights,
    gate_pre=None,
    gate_act=None,
    up=None,
    intermediate=None,
    *,
    clamp_limits=None,
    fp8_dtype="float8_e4m3fn",
    quant_scheme="1x32",
    matmul_precision="mxfp8",
    mode="mx_exact",
) -> Checkpoints:
    """Phase 0: recomputes the missing forward checkpoints (given ones are passed through).

    mx_exact (contract):
        gate_pre = bf16(mm(X, W_gate^T)), up = bf16(mm(X, W_up^T))      (K = H)
        gc = clampG(f32(gate_pre)), uc = clampU(f32(up)) (+ 1 for activation "gpt_oss")
        gate_act = bf16(act(gc)), intermediate = bf16(f32(gate_act) * uc)   (act: silu or
        gelu_apprx_sigmoid, clamp_limits.activation)
    fp32: the same in float64 without any rounding.

    Dimensions:
        hidden_states [S, H], gate_up_weights [2I, H], checkpoints [S, I].

    Args:
        hidden_states: X [S, H].
        gate_up_weights: W_gu [2I, H].
        gate_pre, gate_act, up, intermediate: optional checkpoints [S, I].
        clamp_limits: ClampLimits-like object (attributes non_linear_lower, non_linear_upper,
            linear_lower, linear_upper; None = no bound) or None.
        fp8_dtype: "float8_e4m3fn" or "float8_e5m2".
        quant_scheme: "1x32" or "wrapX".
        matmul_precision: "mxfp8" or "bf16".
        mode: "mx_exact" or "fp32".

    Returns:
        Checkpoints of [S, I] arrays: bf16 (mx_exact; given bf16 checkpoints returned as is) or
        float64 (fp32).
    """
    mode, fp8, scheme, precision = reference_options(mode, fp8_dtype, quant_scheme, matmul_precision)
    x = _operand(hidden_states, mode)
    w = _operand(gate_up_weights, mode)
    if x.ndim != 2 or w.ndim != 2 or w.shape[1] != x.shape[1] or w.shape[0] % 2:
        raise ValueError(
            f"hidden_states [S, H] and gate_up_weights [2I, H] mismatch: {x.shape}, {w.shape}"
        )
    S, n_i = x.shape[0], w.shape[0] // 2
    for name, v in (("gate_pre", gate_pre), ("gate_act", gate_act), ("up", up),
                    ("intermediate", intermediate)):
        _check_2d(name, v, (S, n_i))
    rnd = to_bf16 if mode == "mx_exact" else to_f64

    def proj(rows):  # bf16(mm(X, W_rows^T)), K = H
        return rnd(contract_matmul(x, w[rows].T, mode, precision, fp8, scheme))

    gate_pre = proj(slice(0, n_i)) if gate_pre is None else _operand(gate_pre, mode)
    up = proj(slice(n_i, 2 * n_i)) if up is None else _operand(up, mode)
    if gate_act is None:
        gc, _ = gate_terms(gate_pre, clamp_limits, mode)
        gate_act = rnd(apply_activation(activation_fns64(clamp_limits)[0], gc, mode))
    else:
        gate_act = _operand(gate_act, mode)
    if intermediate is None:
        intermediate = swiglu_intermediate(gate_act, up, clamp_limits, mode)
    else:
        intermediate = _operand(intermediate, mode)
    return Checkpoints(gate_pre, gate_act, up, intermediate)


def reference_phase1_down_proj_grad(
    output_grad,
    down_proj_weight,
    gate_pre,
    up,
    gate_act=None,
    intermediate=None,
    *,
    clamp_limits=None,
    fp8_dtype="float8_e4m3fn",
    quant_scheme="1x32",
    matmul_precision="mxfp8",
    mode="mx_exact",
):
    """Phase 1: dI = dY W_down (K = H) and the SwiGLU backward epilogue.

    mx_exact (contract): dI = mm(dY, W_down) float32; g = f32(gate_pre), u = f32(up),
    gc, maskG = clampG(g), uc, maskU = clampU(u) (+ 1 for "gpt_oss"); a = f32(gate_act) (gate_act =
    bf16(act(gc)) if not given); sd = f32(act_dx(gc)) (silu / silu_dx, or gelu_apprx_sigmoid / its dx);
        d_up = bf16((dI * a) * maskU), d_gate = bf16(((dI * uc) * sd) * maskG)
    (each product a float32 multiply, left to right). If `intermediate` is not given it is
    bf16(a * uc) (the phase-0 formula) and returned for phase 4.
    fp32: the same formulas in float64, no rounding.

    Dimensions:
        output_grad [S, H], down_proj_weight [H, I], gate_pre / up / gate_act / intermediate [S, I].

    Args:
        output_grad: dY [S, H].
        down_proj_weight: W_down [H, I].
        gate_pre: [S, I] (required; phase 0 recomputes it when the caller has none).
        up: [S, I] (required, as gate_pre).
        gate_act: optional [S, I] checkpoint.
        intermediate: optional [S, I] checkpoint.
        clamp_limits, fp8_dtype, quant_scheme, matmul_precision, mode: as in
            ``reference_phase0_recompute``.

    Returns:
        (d_gate [S, I], d_up [S, I], intermediate [S, I] or None): bf16 arrays (mx_exact) or float64
        (fp32); the third item is the computed intermediate when none was given, else None.
    """
    mode, fp8, scheme, precision = reference_options(mode, fp8_dtype, quant_scheme, matmul_precision)
    dy = _operand(output_grad, mode)
    w_down = _operand(down_proj_weight, mode)
    if dy.ndim != 2 or w_down.ndim != 2 or w_down.shape[0] != dy.shape[1]:
        raise ValueError(f"output_grad [S, H] and down_proj_weight [H, I] mismatch: {dy.shape}, {w_down.shape}")
    shape = (dy.shape[0], w_down.shape[1])
    for name, v in (("gate_pre", gate_pre), ("up", up), ("gate_act", gate_act),
                    ("intermediate", intermediate)):
        _check_2d(name, v, shape)
    if gate_pre is None or up is None:
        raise ValueError("phase 1 needs gate_pre and up (run reference_phase0_recompute first)")
    gate_pre = _operand(gate_pre, mode)
    up = _operand(up, mode)

    d_i = contract_matmul(dy, w_down, mode, precision, fp8, scheme)  # [S, I], K = H
    gc, mask_g = gate_terms(gate_pre, clamp_limits, mode)
    uc, mask_u = up_terms(up, clamp_limits, mode)
    act_fn, act_dx_fn = activation_fns64(clamp_limits)
    if gate_act is None:
        act = apply_activation(act_fn, gc, mode)
        gate_act = to_bf16(act) if mode == "mx_exact" else act
    else:
        gate_act = _operand(gate_act, mode)
    a = to_f32(gate_act) if mode == "mx_exact" else to_f64(gate_act)
    sd = apply_activation(act_dx_fn, gc, mode)
    with np.errstate(over="ignore", invalid="ignore"):
        d_up = (d_i * a) * mask_u
        d_gate = ((d_i * uc) * sd) * mask_g
    if mode == "mx_exact":
        d_gate, d_up = to_bf16(d_gate), to_bf16(d_up)
    new_intermediate = None
    if intermediate is None:
        new_intermediate = swiglu_intermediate(gate_act, up, clamp_limits, mode)
    return d_gate, d_up, new_intermediate


def reference_phase2_hidden_states_grad(
    d_gate_up,
    gate_up_weights,
    *,
    fp8_dtype="float8_e4m3fn",
    quant_scheme="1x32",
    matmul_precision="mxfp8",
    mode="mx_exact",
) -> np.ndarray:
    """Phase 2: hidden_states_grad = bf16(mm(d_gu, W_gu)) (K = 2I; fp32 mode: float64 product).

    Dimensions:
        d_gate_up [S, 2I] = concat([d_gate, d_up], axis=1), gate_up_weights [2I, H] -> [S, H].

    Args:
        d_gate_up: [S, 2I] bf16 (mx_exact) / float (fp32).
        gate_up_weights: W_gu [2I, H].
        fp8_dtype, quant_scheme, matmul_precision, mode: as in ``reference_phase0_recompute``.

    Returns:
        [S, H] bf16 (mx_exact) or float64 (fp32).
    """
    mode, fp8, scheme, precision = reference_options(mode, fp8_dtype, quant_scheme, matmul_precision)
    out = contract_matmul(_operand(d_gate_up, mode), _operand(gate_up_weights, mode), mode, precision, fp8, scheme)
    return to_bf16(out) if mode == "mx_exact" else out


def reference_phase3_gate_up_weight_grad(
    d_gate_up,
    hidden_states,
    *,
    fp8_dtype="float8_e4m3fn",
    quant_scheme="1x32",
    matmul_precision="mxfp8",
    weight_grad_dtype="bfloat16",
    mode="mx_exact",
) -> np.ndarray:
    """Phase 3: gate_up_weight_grad = wg(mm(d_gu^T, X)) (K = S).

    d_gu^T [2I, S] is quantized along S (axis 1) and X [S, H] along S (axis 0).

    Dimensions:
        d_gate_up [S, 2I], hidden_states [S, H] -> [2I, H].

    Args:
        d_gate_up: [S, 2I].
        hidden_states: X [S, H].
        weight_grad_dtype: "bfloat16" (RNE) or "float32" (the float32 accumulator as is).
        fp8_dtype, quant_scheme, matmul_precision, mode: as in ``reference_phase0_recompute``.

    Returns:
        [2I, H] in weight_grad_dtype (mx_exact) or float64 (fp32).
    """
    mode, fp8, scheme, precision = reference_options(mode, fp8_dtype, quant_scheme, matmul_precision)
    wg = weight_grad_np_dtype(weight_grad_dtype)
    out = contract_matmul(_operand(d_gate_up, mode).T, _operand(hidden_states, mode), mode, precision, fp8, scheme)
    return to_weight_grad(out, mode, wg)


def reference_phase4_down_weight_grad(
    output_grad,
    intermediate,
    *,
    fp8_dtype="float8_e4m3fn",
    quant_scheme="1x32",
    matmul_precision="mxfp8",
    weight_grad_dtype="bfloat16",
    mode="mx_exact",
) -> np.ndarray:
    """Phase 4: down_proj_weight_grad = wg(mm(dY^T, intermediate)) (K = S).

    Dimensions:
        output_grad [S, H], intermediate [S, I] -> [H, I].

    Args:
        output_grad: dY [S, H].
        intermediate: [S, I] (checkpoint or recomputed).
        weight_grad_dtype: "bfloat16" or "float32".
        fp8_dtype, quant_scheme, matmul_precision, mode: as in ``reference_phase0_recompute``.

    Returns:
        [H, I] in weight_grad_dtype (mx_exact) or float64 (fp32).
    """
    mode, fp8, scheme, precision = reference_options(mode, fp8_dtype, quant_scheme, matmul_precision)
    wg = weight_grad_np_dtype(weight_grad_dtype)
    out = contract_matmul(_operand(output_grad, mode).T, _operand(intermediate, mode), mode, precision, fp8, scheme)
    return to_weight_grad(out, mode, wg)


def mlp_backward_reference(
    output_grad,
    hidden_states,
    down_proj_weight,
    gate_up_weights,
    gate_pre=None,
    gate_act=None,
    up=None,
    intermediate=None,
    clamp_limits=None,
    fp8_dtype="float8_e4m3fn",
    quant_scheme="1x32",
    matmul_precision="mxfp8",
    weight_grad_dtype="bfloat16",
    mode="mx_exact",
):
    """Reference of the whole MLP backward: phases 0 (missing checkpoints only), 1, 2, 3, 4.

    Dimensions:
        output_grad [S, H], hidden_states [S, H], down_proj_weight [H, I], gate_up_weights [2I, H],
        checkpoints [S, I].

    Args:
        output_grad: dY [S, H] (bf16; other float dtypes are rounded to bf16 in mx_exact mode).
        hidden_states: X [S, H].
        down_proj_weight: W_down [H, I].
        gate_up_weights: W_gu [2I, H] (gate rows first).
        gate_pre, gate_act, up, intermediate: optional checkpoints [S, I].
        clamp_limits: ClampLimits (config.py) or any object with its four attributes (and optionally its
            activation), a dict of them, or None.
        fp8_dtype: "float8_e4m3fn" or "float8_e5m2".
        quant_scheme: "1x32" or "wrapX".
        matmul_precision: "mxfp8" or "bf16".
        weight_grad_dtype: "bfloat16" or "float32".
        mode: "mx_exact" (the kernel's numerics) or "fp32" (ideal float64 backward).

    Returns:
        (hidden_states_grad [S, H], gate_up_weight_grad [2I, H], down_proj_weight_grad [H, I]):
        mx_exact: bf16, weight_grad_dtype, weight_grad_dtype; fp32: all float32.
    """
    mode, fp8, scheme, precision = reference_options(mode, fp8_dtype, quant_scheme, matmul_precision)
    weight_grad_np_dtype(weight_grad_dtype)
    opts = dict(fp8_dtype=fp8, quant_scheme=scheme, matmul_precision=precision, mode=mode)
    dy = _operand(output_grad, mode)
    x = _operand(hidden_states, mode)
    w_down = _operand(down_proj_weight, mode)
    w_gu = _operand(gate_up_weights, mode)
    S, H = x.shape
    n_i = w_gu.shape[0] // 2
    _check_2d("output_grad", dy, (S, H))
    _check_2d("down_proj_weight", w_down, (H, n_i))

    if gate_pre is None or up is None:
        # Phase 0 fills every missing checkpoint; with gate_pre and up given, a missing gate_act /
        # intermediate comes out of phase 1 instead (same formulas, same bits).
        gate_pre, gate_act, up, intermediate = reference_phase0_recompute(
            x, w_gu, gate_pre, gate_act, up, intermediate, clamp_limits=clamp_limits, **opts
        )
    d_gate, d_up, new_inter = reference_phase1_down_proj_grad(
        dy, w_down, gate_pre, up, gate_act, intermediate, clamp_limits=clamp_limits, **opts
    )
    if new_inter is not None:
        intermediate = new_inter
    d_gu = np.concatenate([d_gate, d_up], axis=1)
    dx = reference_phase2_hidden_states_grad(d_gu, w_gu, **opts)
    dw_gu = reference_phase3_gate_up_weight_grad(d_gu, x, weight_grad_dtype=weight_grad_dtype, **opts)
    dw_down = reference_phase4_down_weight_grad(
        dy, intermediate, weight_grad_dtype=weight_grad_dtype, **opts
    )
    if mode == "fp32":
        return dx.astype(np.float32), dw_gu.astype(np.float32), dw_down.astype(np.float32)
    return dx, dw_gu, dw_down


# ----------------------------------------------------------------------------------------------
# error metrics
# ----------------------------------------------------------------------------------------------


def error_report(result, ideal) -> dict:
    """Error of a result against an ideal (e.g. mx_exact vs fp32 mode), computed in float64.

    Dimensions:
        result, ideal: same shape [...].

    Args:
        result: array (any float dtype, bf16 included).
        ideal: array of the same shape.

    Returns:
        dict with float values: rel_fro = ||r - i||_F / ||i||_F, cosine = <r, i> / (||r|| ||i||),
        max_abs = max |r - i|, ideal_fro = ||i||_F (NaN inputs give NaN metrics).
    """
    r = to_f64(result)
    i = to_f64(ideal)
    if r.shape != i.shape:
        raise ValueError(f"error_report: shape mismatch {r.shape} vs {i.shape}")
    with np.errstate(divide="ignore", invalid="ignore"):
        d = r - i
        ideal_fro = float(np.linalg.norm(i.ravel()))
        rel = float(np.linalg.norm(d.ravel()) / ideal_fro)
        cos = float(np.dot(r.ravel(), i.ravel()) / (np.linalg.norm(r.ravel()) * ideal_fro))
        max_abs = float(np.max(np.abs(d))) if d.size else 0.0
    return {"rel_fro": rel, "cosine": cos, "max_abs": max_abs, "ideal_fro": ideal_fro}


def _bf16_ordinal(x) -> np.ndarray:
    """bf16 bit patterns mapped to a monotonic integer line (+0 and -0 both 0)."""
    b = to_bf16(x).view(np.uint16).astype(np.int64)
    mag = b & 0x7FFF
    return np.where(b & 0x8000, -mag, mag)


def ulp_diff_bf16(a, b) -> np.ndarray:
    """Distance between a and b in bf16 units in the last place.

    Both inputs are rounded to bf16 (RNE from float32) and their bit patterns are mapped to a
    monotonic integer line (negative values mirrored, +0 == -0), so the result counts the bf16
    values between them; across zero it counts the subnormals on both sides. Infinities sit one
    step beyond the largest finite value. NaN vs NaN gives 0, NaN vs a number gives
    iinfo(int64).max.

    Args:
        a, b: float arrays of one shape (broadcastable).

    Returns:
        int64 array of |ord(a) - ord(b)|.
    """
    a16, b16 = to_bf16(a), to_bf16(b)
    d = np.abs(_bf16_ordinal(a16) - _bf16_ordinal(b16))
    na, nb = np.isnan(a16.astype(np.float32)), np.isnan(b16.astype(np.float32))
    d = np.where(na & nb, 0, d)
    return np.where(na ^ nb, np.iinfo(np.int64).max, d)


def fraction_over_ulp(a, b, ulps: int = 1) -> float:
    """Fraction of elements whose bf16 distance ``ulp_diff_bf16(a, b)`` exceeds ``ulps``.

    Args:
        a, b: float arrays of one shape.
        ulps: tolerated distance (elements at exactly ``ulps`` do not count).

    Returns:
        float in [0, 1] (0.0 for empty inputs).
    """
    d = ulp_diff_bf16(a, b)
    return float(np.mean(d > ulps)) if d.size else 0.0
