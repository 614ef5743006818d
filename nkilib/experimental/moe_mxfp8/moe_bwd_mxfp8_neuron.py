"""The ``backend="neuron"`` path of the MoE PyTorch op: the MXFP8 MoE backward kernel on a Neuron device.

NOT EXERCISED ON HARDWARE in this repository (no Neuron device or SDK here). It follows the dense op's
pattern (mlp_bwd_mxfp8_neuron.py) with the rules and doc sources of nkilib/experimental/neuron_dispatch.py:
the stack is chosen by the tensors' device type ("neuron" -> TorchNeuron: forward registered with
``torch_neuronx.nki_op`` + ``register_autograd``, backward a second ``nki_op`` op whose body is the kernel
call, one node under ``torch.compile(backend="neuron")``; "xla" -> PyTorch/XLA: an autograd.Function whose
backward calls ``moe_backward_mxfp8_nki[lnc]`` with XLA tensors), and the LNC degree comes from
``NEURON_LOGICAL_NC_CONFIG``. Tested with stub modules (tests/torch/test_neuron_dispatch.py): the stubs
check dispatch only, not that the SDK accepts the calls.

Routing on the device: the kernel takes the block layout (routing.build_block_layout: token_position_to_id,
token_position_to_slot, expert_block_offsets, int32) at the capacity that fits any routing of (T, k, E, B),
so one traced kernel serves every routing. The layout is built on the host from topk_ids (one
device-to-host copy per backward, as the forward's routing validation already makes one) and copied to the
tensors' device.

Kernel arguments passed (all by keyword): output_grad, hidden_states, topk_weights (float32),
gate_up_weight, down_weight, token_position_to_id, token_position_to_slot, expert_block_offsets,
block_size, run_with_lnc2 (lnc == 2), gate_pre, gate_act, up, intermediate ([N*B, I] saved block-ordered by the
forward ops here, or [T, k, I], or None) with checkpoint_layout, clamp_limits, fp8_x4_dtype, quant_scheme,
weight_grad_dtype, matmul_precision, gate_up_bias_grad (True when the op has a gate_up_bias: the kernel then returns
d_gate_up_bias [E, 2I] float32 as a fifth output), and weights_layout="block" with topk_weights_blocks [N*B] float32
(the weights by block position, one torch index op on the device): the kernel's d_topk_weights [N*B] is taken back
to [T, k] by a second one (moe_bwd_mxfp8_forward.weights_grad_from_blocks).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..neuron_dispatch import finish_torchneuron_ops, kernel_kwargs, neuron_nki_language, require_torchneuron_nki_op
from . import routing
from .moe_bwd_mxfp8_forward import kernel_checkpoint_layout, kernel_weights_blocks, weights_grad_from_blocks

#: Names of the torch ops registered through nki_op (namespace distinct from the CPU ops).
TORCHNEURON_FORWARD_OP = "nkilib_neuron::moe_swiglu_experts_mxfp8"
TORCHNEURON_BACKWARD_OP = "nkilib_neuron::moe_backward_mxfp8"


def call_kernel(dy, x, ids, w, w_gu, w_down, ckpts, clamps, fp8, scheme, precision, scale_rule, wg, block_size,
                lnc, bias_grad=False) -> tuple:
    """``moe_backward_mxfp8_nki[lnc](...)`` on device tensors -> (dX, d_topk_weights, dW_gate_up, dW_down) and,
    with bias_grad, d_gate_up_bias [E, 2I] float32.

    Dimensions:
        dy / x [T, H] bf16, ids / w [T, k], w_gu [E, 2I, H] and w_down [E, H, I] bf16, ckpts [N*B, I] (saved
        block-ordered by the forward ops here) or [T, k, I], or None.

    Raises:
        ValueError: scale_rule other than "neuron" (the hardware's quantize_mx rule).
        RuntimeError: this process uses nkilib's CPU simulator instead of the Neuron SDK's nki.
    """
    nl = neuron_nki_language(scale_rule)
    from . import moe_bwd_mxfp8_kernel

    layout = routing.build_block_layout(ids.detach().to("cpu").numpy(), w_gu.shape[0], block_size)
    shape, ckpt_layout = kernel_checkpoint_layout(ckpts, ids.shape[0], ids.shape[1], w_gu.shape[1] // 2)
    kw = kernel_kwargs(nl, [None if c is None else c.reshape(shape) for c in ckpts], clamps, fp8, scheme,
                       precision, wg)
    kw["checkpoint_layout"] = ckpt_layout

    def on_device(a):
        return torch.from_numpy(a).to(dy.device)

    slots = on_device(layout.token_position_to_slot)
    slots64 = slots.to(torch.int64)
    w32 = w.to(torch.float32)
    outs = list(moe_bwd_mxfp8_kernel.moe_backward_mxfp8_nki[lnc](
        output_grad=dy, hidden_states=x, topk_weights=w32, gate_up_weight=w_gu, down_weight=w_down,
        token_position_to_id=on_device(layout.token_position_to_id), token_position_to_slot=slots,
        expert_block_offsets=on_device(layout.expert_block_offsets), block_size=block_size,
        run_with_lnc2=lnc == 2, gate_up_bias_grad=bias_grad, weights_layout="block",
        topk_weights_blocks=kernel_weights_blocks(w32, slots64), **kw))
    outs[1] = weights_grad_from_blocks(outs[1], slots64, *ids.shape)
    return tuple(outs)


# ----------------------------------------------------------------------------------------------
# TorchNeuron: nki_op registration (once per process; torch_neuronx only exists on a Neuron instance)
# ----------------------------------------------------------------------------------------------

_TORCHNEURON_OPS: dict = {}


def torchneuron_ops() -> tuple:
    """(forward_op, backward_op) registered with ``torch_neuronx.nki_op``, with the CPU ops' schemas.

    The forward op runs the BF16 forward in torch ops (moe_bwd_mxfp8_torch.forward_impl) and carries
    ``register_autograd``; its backward formula calls the backward op, whose body is the kernel call.
    Both get the CPU ops' fake implementations for torch.compile.
    """
    if _TORCHNEURON_OPS:
        return _TORCHNEURON_OPS["forward"], _TORCHNEURON_OPS["backward"]
    nki_op = require_torchneuron_nki_op()
    from . import moe_bwd_mxfp8_torch as M

    @nki_op(TORCHNEURON_BACKWARD_OP, mutates_args=())
    def backward_op(
        output_grad: Tensor, hidden_states: Tensor, topk_ids: Tensor, topk_weights: Tensor, gate_up_weight: Tensor,
        down_weight: Tensor, gate_pre: Optional[Tensor], gate_act: Optional[Tensor], up: Optional[Tensor],
        intermediate: Optional[Tensor], gate_lower: Optional[float], gate_upper: Optional[float],
        up_lower: Optional[float], up_upper: Optional[float], activation: str, fp8_dtype: str, quant_scheme: str,
        matmul_precision: str, scale_rule: str, weight_grad_dtype: str, block_size: int, backend: str, lnc: int,
        gate_up_bias: Optional[Tensor],
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        outs = call_kernel(output_grad, hidden_states, topk_ids, topk_weights, gate_up_weight, down_weight,
                           (gate_pre, gate_act, up, intermediate),
                           (gate_lower, gate_upper, up_lower, up_upper, activation),
                           fp8_dtype, quant_scheme, matmul_precision, scale_rule, weight_grad_dtype, block_size, lnc,
                           gate_up_bias is not None)
        no_bias = () if gate_up_bias is not None else (output_grad.new_zeros((0,), dtype=torch.float32),)
        return tuple(o.contiguous() for o in outs) + no_bias

    backward_op.register_fake(M.backward_fake_with_bias)

    @nki_op(TORCHNEURON_FORWARD_OP, mutates_args=())
    def forward_op(
        x: Tensor, topk_ids: Tensor, topk_weights: Tensor, gate_up_weight: Tensor, down_weight: Tensor,
        gate_lower: Optional[float], gate_upper: Optional[float], up_lower: Optional[float],
        up_upper: Optional[float], activation: str, fp8_dtype: str, quant_scheme: str, matmul_precision: str,
        scale_rule: str, weight_grad_dtype: str, block_size: int, backend: str, lnc: int, save_gate_pre: bool,
        save_gate_act: bool, save_up: bool, save_intermediate: bool, gate_up_bias: Optional[Tensor],
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        return M.forward_impl(x, topk_ids, topk_weights, gate_up_weight, down_weight, gate_lower, gate_upper,
                              up_lower, up_upper, activation, gate_up_bias,
                              M.checkpoint_block_size(block_size, backend))

    return finish_torchneuron_ops(_TORCHNEURON_OPS, forward_op, backward_op, M)


# ----------------------------------------------------------------------------------------------
# PyTorch/XLA: autograd.Function calling the @nki.jit kernel with XLA tensors
# ----------------------------------------------------------------------------------------------


class XlaMoESwiGLUExperts(torch.autograd.Function):
    """Forward in torch ops on XLA tensors; backward ``moe_backward_mxfp8_nki[lnc]`` on XLA tensors.

    Inputs: x2 [T, H], topk_ids / topk_weights [T, k], gate_up_weight [E, 2I, H], down_weight [E, H, I],
    then the clamps (the four limits and the activation), options (fp8, scheme, precision, scale_rule, wg, block_size,
    lnc) and keep flags as tuples;
    gate_up_bias [E, 2I] or None (its gradient: the kernel's gate_up_bias_grad output).
    """

    @staticmethod
    def forward(ctx, x2, ids, w, gate_up_weight, down_weight, clamps, options, keep, gate_up_bias=None):
        from . import moe_bwd_mxfp8_torch as M

        block_size = options[5]  # fp8, scheme, precision, scale_rule, wg, block_size, lnc
        y, *ckpts = M.forward_impl(x2, ids, w, gate_up_weight, down_weight, *clamps, gate_up_bias,
                                   M.checkpoint_block_size(block_size, "neuron"))  # block-ordered for the kernel
        ctx.save_for_backward(x2, ids, w, gate_up_weight, down_weight,
                              *[c if k else None for c, k in zip(ckpts, keep)], gate_up_bias)
        ctx.clamps, ctx.options = clamps, options
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, ids, w, w_gu, w_down, *ckpts, bias = ctx.saved_tensors
        fp8, scheme, precision, rule, wg, block_size, lnc = ctx.options
        bf = torch.bfloat16
        dx, d_w, dw_gu, dw_down, *d_bias = call_kernel(grad_y.to(bf), x.to(bf), ids, w, w_gu.to(bf), w_down.to(bf),
                                                       ckpts, ctx.clamps, fp8, scheme, precision, rule, wg,
                                                       block_size, lnc, bias is not None)
        return (dx.to(x.dtype), None, d_w.to(w.dtype), dw_gu.to(w_gu.dtype), dw_down.to(w_down.dtype), None, None,
                None, None if bias is None else d_bias[0].to(bias.dtype))
