"""The ``backend="neuron"`` path of the PyTorch layer: the MXFP8 backward kernel on a Neuron device.

NOT EXERCISED ON HARDWARE in this repository (no Neuron device or SDK here). The dispatch below is
tested with stub ``torch_neuronx`` / ``torch_xla`` modules (tests/torch/test_neuron_dispatch.py): the
stubs check which stack, LNC and kernel call are chosen, not that the SDK accepts them. Each rule
follows the Neuron documentation cited next to it.

Which stack (decided by the device type of the tensors, never by what imports: the PyTorch/XLA stack
ships a ``torch_neuronx`` module too, without ``nki_op``):
    * ``device.type == "neuron"``: TorchNeuron (torch-neuronx native device, Neuron SDK 2.33+, PyTorch
      2.14). The forward is registered with ``torch_neuronx.nki_op`` and its backward with
      ``register_autograd`` on that op; the backward calls the kernel through a second ``nki_op`` op, so
      under ``torch.compile(backend="neuron")`` the kernel call is one node of the captured graph
      (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/torch/guides/how-to-work-with-nki.html,
      https://awsdocs-neuron.readthedocs-hosted.com/en/latest/torch/get-started/quickstart-nki-kernel.html).
    * ``device.type == "xla"``: PyTorch/XLA (torch-neuronx with torch-xla). An ``autograd.Function``
      whose backward calls the ``@nki.jit`` kernel with XLA tensors, the NKI framework custom-op
      integration (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.28.0/nki/guides/framework_custom_op.html).

LNC degree: ``NEURON_LOGICAL_NC_CONFIG`` (1 or 2) configures it; unset means LNC=1, the documented
default (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.1/nki/api/generated/nki.jit.html). The
kernel's launch degree must equal the runtime's: a mismatch is a runtime error on 2.31
(https://awsdocs-neuron.readthedocs-hosted.com/en/v2.31.0/nki/api/generated/nki.jit.html) and NCC_EVRF066
inside a compiled graph (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/compiler/error-codes/EVRF066.html),
so an explicit ``lnc=`` that differs from the variable is rejected here, before anything compiles. The
launch is ``kernel[lnc](...)`` with that same degree, which is how nki.jit of SDK 2.31 sets it; the
bracket is being deprecated, but a grid that matches the LNC degree keeps working:
https://awsdocs-neuron.readthedocs-hosted.com/en/latest/about-neuron/announcements/neuron2.x/
announce-intent-eos-nki-spmd-launch-grid.html

Kernel arguments passed (all by keyword): output_grad, hidden_states, down_proj_weight, gate_up_weights,
gate_pre, gate_act, up, intermediate, clamp_limits, fp8_x4_dtype, quant_scheme, weight_grad_dtype,
matmul_precision.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
from torch import Tensor

#: Device type -> Neuron torch stack.
NEURON_DEVICE_STACKS = {"neuron": "torchneuron", "xla": "xla"}
#: The runtime variable that sets the LNC degree, and its documented default (nki.jit docs, 2.33.1).
LNC_ENV_VAR = "NEURON_LOGICAL_NC_CONFIG"
DEFAULT_LNC = 1
_LNC_VALUES = (1, 2)
#: Names of the torch ops registered through nki_op (namespace distinct from the CPU ops).
TORCHNEURON_FORWARD_OP = "nkilib_neuron::swiglu_mlp_mxfp8"
TORCHNEURON_BACKWARD_OP = "nkilib_neuron::mlp_backward_mxfp8"


def neuron_stack(device) -> str:
    """"torchneuron" or "xla" for tensors on `device` (anything with a ``.type``).

    Raises:
        RuntimeError: a device type with no Neuron stack, or the stack's package is missing.
    """
    kind = getattr(device, "type", device)
    stack = NEURON_DEVICE_STACKS.get(kind)
    if stack is None:
        raise RuntimeError(
            f"backend='neuron' needs tensors on a Neuron device: device type 'neuron' (TorchNeuron) or 'xla' "
            f"(PyTorch/XLA), got device type {kind!r}; off Trainium use backend='simulator' (CPU) or 'emulate'")
    if stack == "torchneuron":
        nki_op = torchneuron_nki_op()
        if nki_op is None:
            raise RuntimeError(
                "tensors on device type 'neuron' need torch-neuronx with nki_op (TorchNeuron, Neuron SDK 2.33+, "
                "https://awsdocs-neuron.readthedocs-hosted.com/en/latest/torch/get-started/quickstart-nki-kernel.html)")
    else:
        try:
            import torch_xla  # noqa: F401
        except ImportError as e:
            raise RuntimeError(f"tensors on device type 'xla' need torch-xla with the Neuron plugin: {e}") from e
    return stack


def torchneuron_nki_op():
    """``torch_neuronx.nki_op``, or None when torch_neuronx is missing or lacks it (the XLA stack's)."""
    try:
        import torch_neuronx
    except ImportError:
        return None
    return getattr(torch_neuronx, "nki_op", None)


def resolve_neuron_lnc(lnc: Optional[int]) -> int:
    """The LNC degree of the launch: ``NEURON_LOGICAL_NC_CONFIG`` (unset: 1), checked against `lnc`.

    Raises:
        ValueError: the variable is not 1 or 2, or `lnc` is given and differs from it.
    """
    raw = os.environ.get(LNC_ENV_VAR)
    if raw is None:
        env_lnc, source = DEFAULT_LNC, f"{LNC_ENV_VAR} is unset (documented default LNC={DEFAULT_LNC})"
    else:
        if raw.strip() not in {str(v) for v in _LNC_VALUES}:
            raise ValueError(f"{LNC_ENV_VAR} must be 1 or 2, got {raw!r}")
        env_lnc, source = int(raw), f"{LNC_ENV_VAR}={raw.strip()}"
    if lnc is not None and lnc != env_lnc:
        raise ValueError(
            f"lnc={lnc} does not match the Neuron runtime's LNC degree: {source}. The kernel's LNC must equal "
            f"the runtime's; set {LNC_ENV_VAR}={lnc} before the process starts, or pass lnc=None")
    return env_lnc


def kernel_kwargs(nl, ckpts, clamps, fp8: str, scheme: str, precision: str, wg: str) -> dict:
    """Keyword arguments of mlp_backward_mxfp8_nki besides the four main operands.

    Args:
        nl: the ``nki.language`` module (real or simulated) that names the dtypes.
        ckpts: (gate_pre, gate_act, up, intermediate), each an array / tensor [S, I] or None.
        clamps: (non_linear_lower, non_linear_upper, linear_lower, linear_upper), floats or None.
        fp8, scheme, precision, wg: option names ("float8_e4m3fn", "1x32", "mxfp8", "float32", ...).
    """
    from .config import ClampLimits

    clamp = ClampLimits(*clamps) if any(c is not None for c in clamps) else None
    kw = dict(zip(("gate_pre", "gate_act", "up", "intermediate"), ckpts))
    kw.update(clamp_limits=clamp, fp8_x4_dtype=getattr(nl, f"{fp8}_x4"), quant_scheme=scheme,
              weight_grad_dtype=getattr(nl, wg), matmul_precision=precision)
    return kw


def call_kernel(dy, x, w_gu, w_down, ckpts, clamps, fp8, scheme, precision, scale_rule, wg, lnc) -> tuple:
    """``mlp_backward_mxfp8_nki[lnc](...)`` on device tensors -> (dX, dW_gate_up, dW_down).

    Dimensions:
        dy / x [S, H], w_gu [2I, H], w_down [H, I], ckpts [S, I] or None.

    Raises:
        ValueError: scale_rule other than "neuron" (the hardware's quantize_mx rule).
        RuntimeError: this process uses nkilib's CPU simulator instead of the Neuron SDK's nki.
    """
    import nkilib

    if scale_rule != "neuron":
        raise ValueError(f"scale_rule={scale_rule!r} is only available with backend='emulate'; the hardware's "
                         f"quantize_mx uses the 'neuron' rule")
    if nkilib.BACKEND != "neuron":
        raise RuntimeError("backend='neuron' needs the Neuron SDK's nki package (this process uses nkilib's CPU "
                           "simulator); use backend='simulator' or 'emulate' off Trainium")
    import nki.language as nl

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
    nki_op = torchneuron_nki_op()
    if nki_op is None:
        raise RuntimeError("torch_neuronx.nki_op is not available (TorchNeuron, Neuron SDK 2.33+)")
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

    forward_op.register_fake(T.forward_fake)
    forward_op.register_autograd(T.make_backward_formula(backward_op), setup_context=T.setup_context)
    _TORCHNEURON_OPS.update(forward=forward_op, backward=backward_op)
    return forward_op, backward_op


def register_torchneuron_ops_if_available() -> bool:
    """Register the TorchNeuron ops now when ``torch_neuronx.nki_op`` exists (called at import of
    mlp_bwd_mxfp8_torch.py, so torch.compile never traces the registration). Returns whether it did."""
    if torchneuron_nki_op() is None:
        return False
    torchneuron_ops()
    return True


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
