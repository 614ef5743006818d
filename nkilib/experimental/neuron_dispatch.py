"""The Neuron-device dispatch shared by the PyTorch ops' ``backend="neuron"`` paths (dense MLP and MoE experts).

NOT EXERCISED ON HARDWARE in this repository (no Neuron device or SDK here). The dispatch is tested with
stub ``torch_neuronx`` / ``torch_xla`` modules (tests/torch/test_neuron_dispatch.py,
tests/torch/test_moe_neuron_dispatch.py): the stubs check which stack, LNC and kernel call are chosen, not
that the SDK accepts them. Each rule follows the Neuron documentation cited next to it.

Which stack (decided by the device type of the tensors, never by what imports: the PyTorch/XLA stack
ships a ``torch_neuronx`` module too, without ``nki_op``):
    * ``device.type == "neuron"``: TorchNeuron (torch-neuronx native device, Neuron SDK 2.33+, PyTorch
      2.14). An op's forward is registered with ``torch_neuronx.nki_op`` and its backward with
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

No torch import here: the op modules own their torch code; this module holds the rules both follow.
"""
from __future__ import annotations

import os
from typing import Optional

#: Device type -> Neuron torch stack.
NEURON_DEVICE_STACKS = {"neuron": "torchneuron", "xla": "xla"}
#: The runtime variable that sets the LNC degree, and its documented default (nki.jit docs, 2.33.1).
LNC_ENV_VAR = "NEURON_LOGICAL_NC_CONFIG"
DEFAULT_LNC = 1
_LNC_VALUES = (1, 2)


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
        if torchneuron_nki_op() is None:
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


def check_lnc(lnc, what: str) -> None:
    """`lnc` as an op keyword: None (the backend's default), 1 or 2; else ValueError naming `what`."""
    if lnc is not None and (isinstance(lnc, bool) or lnc not in _LNC_VALUES):
        raise ValueError(f"{what}: lnc must be None, 1 or 2, got {lnc!r}")


def launch_stack_and_lnc(backend: str, device, lnc: Optional[int]) -> tuple:
    """(stack, lnc) of a resolved backend: "neuron" -> (neuron_stack(device), resolve_neuron_lnc(lnc));
    any other backend -> (None, lnc, default 1)."""
    if backend == "neuron":
        return neuron_stack(device), resolve_neuron_lnc(lnc)
    return None, 1 if lnc is None else lnc


def require_torchneuron_nki_op():
    """``torch_neuronx.nki_op`` for an op module's TorchNeuron registration.

    Raises:
        RuntimeError: torch_neuronx is missing or lacks nki_op.
    """
    nki_op = torchneuron_nki_op()
    if nki_op is None:
        raise RuntimeError("torch_neuronx.nki_op is not available (TorchNeuron, Neuron SDK 2.33+)")
    return nki_op


def finish_torchneuron_ops(registry: dict, forward_op, backward_op, op_module) -> tuple:
    """The last step of an op module's TorchNeuron registration (dense MLP and MoE experts alike).

    Gives `forward_op` the CPU op's fake (``op_module.forward_fake``) and its autograd formula
    (``op_module.make_backward_formula(backward_op)`` with ``op_module.setup_context``), so that the
    forward op's backward calls the kernel op, then caches both ops in `registry`.

    Args:
        registry: the op module's cache of registered ops (filled with keys "forward" and "backward").
        forward_op, backward_op: the ops ``torch_neuronx.nki_op`` returned.
        op_module: the op's CPU torch module (mlp_bwd_mxfp8_torch or moe_bwd_mxfp8_torch).

    Returns:
        (forward_op, backward_op).
    """
    forward_op.register_fake(op_module.forward_fake)
    forward_op.register_autograd(op_module.make_backward_formula(backward_op), setup_context=op_module.setup_context)
    registry.update(forward=forward_op, backward=backward_op)
    return forward_op, backward_op


def register_ops_if_available(build_ops) -> bool:
    """Call `build_ops()` (an op module's TorchNeuron registration) now when ``torch_neuronx.nki_op`` exists,
    so that it runs at import and torch.compile never traces it. Returns whether it did."""
    if torchneuron_nki_op() is None:
        return False
    build_ops()
    return True


def neuron_nki_language(scale_rule: str):
    """The Neuron SDK's ``nki.language`` module, after checking that a kernel can run on the device.

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

    return nl


def kernel_kwargs(nl, ckpts, clamps, fp8: str, scheme: str, precision: str, wg: str) -> dict:
    """Keyword arguments both backward kernels (mlp_backward_mxfp8_nki, moe_backward_mxfp8_nki) take besides
    their operands: the four checkpoints, clamp_limits and the numeric options.

    Args:
        nl: the ``nki.language`` module (real or simulated) that names the dtypes.
        ckpts: (gate_pre, gate_act, up, intermediate), each an array / tensor or None.
        clamps: (non_linear_lower, non_linear_upper, linear_lower, linear_upper), floats or None, optionally
            followed by the activation (ClampLimits' fields in order).
        fp8, scheme, precision, wg: option names ("float8_e4m3fn", "1x32", "mxfp8", "float32", ...).
    """
    from .mlp_mxfp8.mlp_bwd_mxfp8.config import ClampLimits

    clamp = ClampLimits(*clamps)
    clamp = None if clamp == ClampLimits() else clamp
    kw = dict(zip(("gate_pre", "gate_act", "up", "intermediate"), ckpts))
    kw.update(clamp_limits=clamp, fp8_x4_dtype=getattr(nl, f"{fp8}_x4"), quant_scheme=scheme,
              weight_grad_dtype=getattr(nl, wg), matmul_precision=precision)
    return kw
