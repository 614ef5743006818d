"""Pure-torch emulation of the MXFP8 SwiGLU MLP backward kernel's numerics (the `emulate` backend).

This is the numerics contract of the kernel (reference.py, mode ``"mx_exact"``) written in torch ops,
so that it runs on any torch device (CPU, CUDA) at torch speed, for training studies. Its building blocks,
shared with the MoE emulation (the MX quantizer, the contract's matmul with exact per-tile sums, the SwiGLU /
clamp numerics), and the exactness argument are in nkilib/experimental/emulate_numerics.py; this module
composes them into phases 0-4 and re-exports their public names (and the quantizer internals that
simulations/emulate_speed.py and tests/torch/test_emulate_numerics.py reach as ``emu._...``).

No NKI and no simulator here: only torch.

Dimensions:
    S: tokens, H: hidden size, I: intermediate size.
    X = hidden_states [S, H], dY = output_grad [S, H], W_gu = gate_up_weights [2I, H]
    (W_gate = rows 0..I-1, W_up = rows I..2I-1), W_down = down_proj_weight [H, I],
    checkpoints gate_pre / gate_act / up / intermediate [S, I].
"""
from __future__ import annotations

import functools

import torch

from ....core import options
from ....core.options import CLAMP_NAMES, check_choice  # noqa: F401  (re-exported: the torch layer's names)
from ....mx import element_format  # noqa: F401  (re-exported for simulations/emulate_speed.py)
from ...emulate_numerics import (FP8_DTYPES, FUSED_QUANTIZER_MODES, activation_fns32, clamp_and_mask,  # noqa: F401
                                 clamp_tuple, contract_matmul, fp8_name, linear_factor, mx_dequantize_rows,
                                 mx_quantize_dequantize, mx_quantize_rows, recompute_projection, set_fused_quantizer,
                                 swiglu_activations)
from ...emulate_numerics import _decode, _quantize_dequantize, _tiled_sum  # noqa: F401  (emulate_speed, tests)
from .constants import MX_K_TILE  # noqa: F401  (re-exported for simulations/emulate_speed.py)
from .mlp_bwd_mxfp8_emulate_fast import EMULATE_GEMMS, fast_gemm, resolve_gemm  # noqa: F401

# The numerics names imported above are re-exported for the torch layer and simulations/emulate_speed.py; their
# home and list is emulate_numerics.__all__.
__all__ = ["mlp_backward_emulate", "CLAMP_NAMES", "EMULATE_GEMMS"]


# ----------------------------------------------------------------------------------------------
# the backward
# ----------------------------------------------------------------------------------------------


def mlp_backward_emulate(output_grad, hidden_states, down_proj_weight, gate_up_weights, gate_pre=None,
                         gate_act=None, up=None, intermediate=None, *, clamp_limits=None,
                         fp8_dtype="float8_e4m3fn", quant_scheme="1x32", matmul_precision="mxfp8",
                         weight_grad_dtype=torch.bfloat16, scale_rule="neuron", gemm="exact"):
    """The kernel's backward (phases 0-4 of the numerics contract) in torch ops.

    Dimensions:
        output_grad dY [S, H], hidden_states X [S, H], down_proj_weight W_down [H, I],
        gate_up_weights W_gu [2I, H], optional checkpoints [S, I]; all rounded to bf16 on entry
        (the kernel's inputs are bf16).

    Args:
        output_grad, hidden_states, down_proj_weight, gate_up_weights: tensors on one device.
        gate_pre, gate_act, up, intermediate: optional checkpoints; missing ones are recomputed
            with the kernel's phase-0 numerics.
        clamp_limits: ClampLimits, a dict of its four fields, or None.
        fp8_dtype: "float8_e4m3fn" or "float8_e5m2".
        quant_scheme: "1x32" or "wrapX".
        matmul_precision: "mxfp8" (Trn3) or "bf16" (Trn2).
        weight_grad_dtype: torch.bfloat16 or torch.float32 (both weight gradients).
        scale_rule: "neuron" (the hardware's rule, default), "ocp_floor" or "rceil" (studies only).
        gemm: "exact" (bit-identical to the kernel, default) or "fast" / "fp32" / "bf16" (the backend
            "emulate_fast": same quantization, float32-accumulating GEMMs, not bit-exact; see
            mlp_bwd_mxfp8_emulate_fast.py).

    Returns:
        (hidden_states_grad [S, H] bf16, gate_up_weight_grad [2I, H], down_proj_weight_grad [H, I])
        with the weight gradients in weight_grad_dtype.
    """
    weight_grad_dtype = getattr(torch, options.weight_grad_dtype(weight_grad_dtype,
                                                                 spelled="torch.bfloat16 or torch.float32"))
    gemm = resolve_gemm(gemm, output_grad.device)
    mm = functools.partial(contract_matmul, matmul_precision=matmul_precision, fp8_dtype=fp8_dtype,
                           quant_scheme=quant_scheme, scale_rule=scale_rule, gemm=gemm)
    gl, gu, ul, uu = clamp_tuple(clamp_limits)
    bf = torch.bfloat16
    dy, x = output_grad.to(bf), hidden_states.to(bf)
    w_down, w_gu = down_proj_weight.to(bf), gate_up_weights.to(bf)
    n_i = w_gu.shape[0] // 2
    # phase 0: only what is missing
    if gate_pre is None:
        gate_pre = mm(x, w_gu[:n_i].t()).to(bf)
    if up is None:
        up = mm(x, w_gu[n_i:].t()).to(bf)
    gc, mask_g = clamp_and_mask(gate_pre.to(bf).to(torch.float32), gl, gu)
    uc, mask_u = clamp_and_mask(up.to(bf).to(torch.float32), ul, uu)
    uc = linear_factor(uc, clamp_limits)
    act_fn, act_dx_fn = activation_fns32(clamp_limits)
    gate_act = act_fn(gc).to(bf) if gate_act is None else gate_act.to(bf)
    a = gate_act.to(torch.float32)
    if intermediate is None:
        intermediate = (a * uc).to(bf)
    # phase 1: dI and the SwiGLU derivative (float32, left-to-right products)
    d_i = mm(dy, w_down)  # [S, I], K = H
    sd = act_dx_fn(gc)
    d_up = ((d_i * a) * mask_u).to(bf)
    d_gate = (((d_i * uc) * sd) * mask_g).to(bf)
    d_gu = torch.cat([d_gate, d_up], dim=1)  # [S, 2I]
    # phases 2-4
    dx = mm(d_gu, w_gu).to(bf)  # K = 2I
    dw_gu = mm(d_gu.t(), x).to(weight_grad_dtype)  # K = S
    dw_down = mm(dy.t(), intermediate.to(bf)).to(weight_grad_dtype)  # K = S
    return dx, dw_gu, dw_down
