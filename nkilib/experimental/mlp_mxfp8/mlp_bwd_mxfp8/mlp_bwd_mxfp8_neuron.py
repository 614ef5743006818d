"""The ``backend="neuron"`` path of the PyTorch layer: the MXFP8 backward kernel on a Neuron device.

NOT EXERCISED ON HARDWARE in this repository (no Neuron device or SDK here). The rules (stack chosen by
the tensors' device type, LNC from NEURON_LOGICAL_NC_CONFIG, nki_op + register_autograd) and their doc
sources are in nkilib/experimental/neuron_dispatch.py, shared with the MoE op (moe_bwd_mxfp8_neuron.py);
this module holds the dense op's registrations and kernel call. Tested with stub modules
(tests/torch/test_neuron_dispatch.py): the stubs check dispatch only.

Kernel arguments passed (all by keyword): output_grad, hidden_states, down_proj_weight, gate_up_weights,
gate_pre, gate_act, up, intermediate, clamp_limits, fp8_x4_dtype, quant_scheme, weight_grad_dtype,
matmul_precision.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ...neuron_dispatch import (DEFAULT_LNC, LNC_ENV_VAR, NEURON_DEVICE_STACKS, finish_torchneuron_ops,  # noqa: F401
                                kernel_kwargs, neuron_nki_language, neuron_stack, require_torchneuron_nki_op,
                                resolve_neuron_lnc, torchneuron_nki_op)

#: Names of the torch ops registered through nki_op (namespace distinct from the CPU ops).
TORCHNEURON_FORWARD_OP = "nkilib_neuron::swiglu_mlp_mxfp8"
TORCHNEURON_BACKWARD_OP = "nkilib_neuron::mlp_backward_mxfp8"


def call_kernel(dy, x, w_gu, w_down, ckpts, clamps, fp8, scheme, precision, scale_rule, wg, lnc) -> tuple:
    """``mlp_backward_mxfp8_nki[lnc](...)`` on device tensors -> (dX, dW_gate_up, dW_down).

    Dimensions:
        dy / x [S, H], w_gu [2I, H], w_down [H, I], ckpts [S, I] or None.

    Raises:
        ValueError: scale_rule other than "neuron" (the hardware's quantize_mx rule).
        RuntimeError: this process uses nkilib's CPU simulator instead of the Neuron SDK's nki.
    """
    nl = neuron_nki_language(scale_rule)
    from . import mlp_bwd_mxfp8_kernel

    kw = kernel_kwargs(nl, ckpts, clamps, fp8, scheme, precision, wg)
    outs = mlp_bwd_mxfp8_kernel.mlp_backward_mxfp8_nki[lnc](
        output_grad=dy, hidden_states=x, down_proj_weight=w_down, gate_up_weights=w_gu, **kw)
    return tuple(outs)


# ----------------------------------------------------------------------------------------------
# TorchNeuron: nki_op registration (one registration per process, lazily: torch_neuronx only
# exists on a Neuron instance)
# ----------------------------------------------------------------------------------------------

_TORCHNEURON_OPS: dict = {}


def torchneuron_ops() -> tuple:
    """(forward_op, backward_op) registered with ``torch_neuronx.nki_op``.

    The forward op computes the SwiGLU forward in torch ops (there is no NKI forward kernel yet) and
    carries ``register_autograd``; its backward formula calls the backward op, whose body is the
    kernel call, so the kernel is one graph node. Both get fake implementations for torch.compile.
    """
    if _TORCHNEURON_OPS:
        return _TORCHNEURON_OPS["forward"], _TORCHNEURON_OPS["backward"]
    nki_op = require_torchneuron_nki_op()
    from . import mlp_bwd_mxfp8_torch as T

    @nki_op(TORCHNEURON_BACKWARD_OP, mutates_args=())
    def backward_op(
        output_grad: Tensor, hidden_states: Tensor, gate_up_weight: Tensor, down_weight: Tensor,
        gate_pre: Optional[Tensor], gate_act: Optional[Tensor], up: Optional[Tensor], intermediate: Optional[Tensor],
        gate_lower: Optional[float], gate_upper: Optional[float], up_lower: Optional[float],
        up_upper: Optional[float], fp8_dtype: str, quant_scheme: str, matmul_precision: str, scale_rule: str,
        weight_grad_dtype: str, backend: str, lnc: int,
    ) -> tuple[Tensor, Tensor, Tensor]:
        outs = call_kernel(output_grad, hidden_states, gate_up_weight, down_weight,
                           (gate_pre, gate_act, up, intermediate), (gate_lower, gate_upper, up_lower, up_upper),
                           fp8_dtype, quant_scheme, matmul_precision, scale_rule, weight_grad_dtype, lnc)
        return tuple(o.contiguous() for o in outs)

    backward_op.register_fake(T.backward_fake)

    @nki_op(TORCHNEURON_FORWARD_OP, mutates_args=())
    def forward_op(
        x: Tensor, gate_up_weight: Tensor, down_weight: Tensor, gate_up_grad_sink: Optional[Tensor],
        down_grad_sink: Optional[Tensor], gate_lower: Optional[float], gate_upper: Optional[float],
        up_lower: Optional[float], up_upper: Optional[float], fp8_dtype: str, quant_scheme: str,
        matmul_precision: str, scale_rule: str, weight_grad_dtype: str, forward_numerics: str, backend: str,
        lnc: int, save_gate_pre: bool, save_gate_act: bool, save_up: bool, save_intermediate: bool,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        return T.forward_impl(x, gate_up_weight, down_weight, gate_lower, gate_upper, up_lower, up_upper, fp8_dtype,
                              quant_scheme, matmul_precision, scale_rule, forward_numerics)

    return finish_torchneuron_ops(_TORCHNEURON_OPS, forward_op, backward_op, T)


# ----------------------------------------------------------------------------------------------
# PyTorch/XLA: autograd.Function calling the @nki.jit kernel with XLA tensors
# ----------------------------------------------------------------------------------------------


class XlaSwiGLUMLP(torch.autograd.Function):
    """Forward in torch ops on XLA tensors; backward ``mlp_backward_mxfp8_nki[lnc]`` on XLA tensors.

    Inputs: x2 [S, H], gate_up_weight [2I, H], down_weight [H, I], the two main-grad sinks (fp32
    zero-stride tensors of the weight shapes, or None; see mlp_bwd_mxfp8_torch.py), then the clamps,
    options and keep flags as tuples.
    """

    @staticmethod
    def forward(ctx, x2, gate_up_weight, down_weight, gate_up_grad_sink, down_grad_sink, clamps, options, keep):
        from . import mlp_bwd_mxfp8_torch as T

        fp8, scheme, precision, rule, wg, forward_numerics, lnc = options
        y, *ckpts = T.forward_impl(x2, gate_up_weight, down_weight, *clamps, fp8, scheme, precision, rule,
                                   forward_numerics)
        ctx.save_for_backward(x2, gate_up_weight, down_weight, *[c if k else None for c, k in zip(ckpts, keep)])
        ctx.clamps, ctx.options = clamps, options
        ctx.sinks = (gate_up_grad_sink is not None, down_grad_sink is not None)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        from . import mlp_bwd_mxfp8_torch as T

        x, w_gu, w_down, *ckpts = ctx.saved_tensors
        fp8, scheme, precision, rule, wg, _, lnc = ctx.options
        bf = torch.bfloat16
        dx, dw_gu, dw_down = call_kernel(grad_y.to(bf), x.to(bf), w_gu.to(bf), w_down.to(bf), ckpts, ctx.clamps,
                                         fp8, scheme, precision, rule, wg, lnc)
        weight_grads = T.route_weight_grads(ctx.sinks, (w_gu, w_down), (dw_gu, dw_down))
        return (dx.to(x.dtype), *weight_grads, None, None, None)
