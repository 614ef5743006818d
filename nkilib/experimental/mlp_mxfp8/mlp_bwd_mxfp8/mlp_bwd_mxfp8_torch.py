"""PyTorch integration: a SwiGLU MLP whose backward is the MXFP8 NKI kernel.

API:
    swiglu_mlp_mxfp8(x, gate_up_weight, down_weight, *, checkpoint="all", clamp_limits=None, ...) -> y
    SwiGLUMLP(hidden_size, intermediate_size, *, checkpoint="all", backend="auto", ...)  (nn.Module)

Math (nn.Linear weight layout):
    gate_pre = x W_gate^T, up = x W_up^T   (W_gate, W_up = rows 0..I-1 / I..2I-1 of gate_up_weight [2I, H])
    gate_act = silu(clamp(gate_pre)), intermediate = gate_act * clamp(up), y = intermediate W_down^T
with down_weight W_down [H, I]. x is [..., H]; its leading dimensions are flattened to S tokens.

Forward: BF16 in torch (an NKI forward kernel is future work). The projections are torch bf16 matmuls
(``forward_numerics="torch"``, default) or the kernel's own matmul numerics emulated in torch
(``forward_numerics="kernel"``); gate_act / intermediate always use the kernel's phase-0 formulas
(float64 silu of the float32 clamped input, rounded once to float32, then bf16; intermediate =
bf16(f32(gate_act) * clamp(up))). y is the bf16 matmul ``intermediate @ W_down^T``, returned in x's dtype.
Only the checkpoints the policy keeps are saved for the backward (bf16, exactly as the forward made them):
    "all"  -> gate_pre, gate_act, up, intermediate (the kernel recomputes nothing),
    "none" -> nothing (the kernel recomputes everything from x and the weights),
    a subset, e.g. ("gate_pre", "up") -> those (the kernel recomputes the rest).

Backward: the NKI kernel ``mlp_backward_mxfp8_nki`` (or its exact torch emulation), returning dX,
dW_gate_up, dW_down in the dtypes of x and of the parameters. Weight gradients leave the kernel in
``weight_grad_dtype`` (default: float32 when a parameter is float32, so fp32 parameters accumulate
fp32 gradients that were never rounded to bf16; else bf16).

Which checkpoint policies give identical gradients (the kernel recomputes a missing checkpoint its
own way, so identity holds exactly when the saved tensor equals what the kernel would recompute):
    * gate_act and intermediate: the forward computes them with the kernel's phase-0 formulas, so a
      policy that keeps gate_pre and up gives gradients bit-identical to "all", whatever it keeps of
      gate_act / intermediate.
    * gate_pre and up: with ``forward_numerics="torch"`` the forward's projections are plain bf16
      matmuls, while the kernel recomputes them as MX-quantized matmuls (K = H). A policy without
      gate_pre or up ("none", ("gate_act", "intermediate"), ...) therefore differentiates at slightly
      different activations: its gradients differ from "all" by about as much as the MXFP8 backward
      differs from fp32 (measured on unit-scale data, relative Frobenius: ~5% for e4m3fn, ~10% for
      e5m2, and more with tight clamps, where recomputed projections cross a clamp limit and switch
      an element's gradient on or off; tests/torch/test_torch_mlp.py). "none" is also ~1.3x
      farther from the fp32 gradients than "all" (the recompute adds its own MX error).
    * ``forward_numerics="kernel"`` makes the forward compute gate_pre / up exactly as the kernel's
      phase 0 would (same quantization, same fp32 accumulation), so every policy gives bit-identical
      gradients (the forward then carries the MX error of the two projections, as an MXFP8 forward
      would).
    These identities are exact on the "simulator" and "emulate" backends (both implement the
    numerics contract). On hardware the kernel's silu is a piecewise approximation and its matmul
    accumulation order differs, so recomputed checkpoints match the saved ones only approximately.

Backends (``backend=``):
    "auto": CPU tensors -> "simulator"; Neuron / XLA tensors -> "neuron"; meta -> "emulate"
        (shapes only); any other device -> an error naming "emulate" as the portable choice.
    "simulator": the real kernel on the NKI CPU simulator (numpy conversion; slow, for correctness;
        scale rule "neuron" only, which is what quantize_mx implements).
    "emulate": a pure-torch implementation of exactly the kernel's numerics
        (mlp_bwd_mxfp8_emulate.py) on any device, fast, for training studies; supports the scale
        rules "neuron", "rceil" and "ocp_floor".
    "neuron": the kernel on a Neuron device: TorchNeuron (SDK 2.30+, ``torch_neuronx.nki_op``) or
        PyTorch/XLA (torch <= 2.9, an autograd.Function calling ``mlp_backward_mxfp8_nki[lnc]`` with
        XLA tensors). These paths are thin, import-guarded and UNTESTED in this repository (no
        Neuron device or SDK here).

Registration: two torch.library custom ops, ``nkilib::swiglu_mlp_mxfp8`` (forward; returns y and
the four checkpoints, autograd registered with ``register_autograd``) and
``nkilib::swiglu_mlp_mxfp8_backward`` (the kernel call), both with fake implementations, so the
function composes with torch.compile and torch.utils.checkpoint; both pass torch.library.opcheck.
"""
from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Optional

import ml_dtypes
import numpy as np
import torch
from torch import Tensor, nn

from ....core import options
from . import mlp_bwd_mxfp8_emulate as emu
from .constants import MX_GROUP

__all__ = ["swiglu_mlp_mxfp8", "SwiGLUMLP", "CHECKPOINT_NAMES", "BACKENDS", "FORWARD_NUMERICS",
           "resolve_checkpoint_policy", "resolve_backend"]

#: Forward activations the backward kernel accepts as checkpoints (kernel argument names).
CHECKPOINT_NAMES = ("gate_pre", "gate_act", "up", "intermediate")
#: backend= choices.
BACKENDS = ("auto", "simulator", "emulate", "neuron")
#: forward_numerics= choices (see the module docstring).
FORWARD_NUMERICS = ("torch", "kernel")
_SCALE_RULES = ("neuron", "rceil", "ocp_floor")
_PARAM_DTYPES = (torch.bfloat16, torch.float32)


# ----------------------------------------------------------------------------------------------
# option resolution (plain Python, runs before the custom op so errors name the user's arguments)
# ----------------------------------------------------------------------------------------------


def resolve_checkpoint_policy(checkpoint) -> tuple:
    """Policy -> 4 bools (keep gate_pre, gate_act, up, intermediate).

    Args:
        checkpoint: "all", "none", one checkpoint name, or an iterable of names from CHECKPOINT_NAMES.

    Raises:
        ValueError: an unknown policy or name.
    """
    if isinstance(checkpoint, str):
        if checkpoint == "all":
            return (True, True, True, True)
        if checkpoint == "none":
            return (False, False, False, False)
        if checkpoint in CHECKPOINT_NAMES:
            names = {checkpoint}
        else:
            raise ValueError(f"checkpoint policy must be 'all', 'none', or a subset of {CHECKPOINT_NAMES}; "
                             f"got {checkpoint!r}")
    elif isinstance(checkpoint, Iterable):
        names = set()
        for n in checkpoint:
            if n not in CHECKPOINT_NAMES:
                raise ValueError(f"unknown checkpoint name {n!r} in checkpoint={checkpoint!r}; "
                                 f"accepted names: {CHECKPOINT_NAMES} (or the policies 'all' / 'none')")
            names.add(n)
    else:
        raise ValueError(f"checkpoint policy must be 'all', 'none', or a subset of {CHECKPOINT_NAMES}; "
                         f"got {checkpoint!r}")
    return tuple(n in names for n in CHECKPOINT_NAMES)


def _neuron_stack() -> str | None:
    """'torchneuron' or 'xla' when a Neuron torch stack is importable, else None."""
    for mod, name in (("torch_neuronx", "torchneuron"), ("torch_xla", "xla")):
        try:
            importlib.import_module(mod)
            return name
        except Exception:  # noqa: BLE001 - any import failure means "not available"
            continue
    return None


def resolve_backend(backend: str, device: torch.device) -> str:
    """"auto" -> a concrete backend for tensors on `device` (module docstring); validates the others."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    kind = device.type
    if kind == "cpu":
        return "simulator"
    if kind in ("neuron", "xla", "privateuseone"):
        return "neuron"
    if kind == "meta":
        return "emulate"
    raise RuntimeError(
        f"swiglu_mlp_mxfp8: no NKI kernel path for tensors on device '{device}' (the kernel runs on Neuron "
        f"devices, and on CPU in the simulator); pass backend='emulate' for the pure-torch emulation of the "
        f"kernel's exact numerics on this device, or move the tensors to CPU / a Neuron device")


def _weight_grad_name(weight_grad_dtype, gate_up_weight: Tensor, down_weight: Tensor) -> str:
    if weight_grad_dtype is None:
        return "float32" if torch.float32 in (gate_up_weight.dtype, down_weight.dtype) else "bfloat16"
    return options.weight_grad_dtype(weight_grad_dtype, spelled="None, torch.bfloat16 or torch.float32")


def _check_inputs(x: Tensor, gate_up_weight: Tensor, down_weight: Tensor) -> tuple:
    """Shapes / dtypes / devices; returns (H, I)."""
    for name, t in (("x", x), ("gate_up_weight", gate_up_weight), ("down_weight", down_weight)):
        if not isinstance(t, Tensor):
            raise TypeError(f"swiglu_mlp_mxfp8: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _PARAM_DTYPES:
            raise TypeError(f"swiglu_mlp_mxfp8: {name} must be torch.bfloat16 or torch.float32 (the kernel computes "
                            f"in bf16), got {t.dtype}")
    if gate_up_weight.dim() != 2 or gate_up_weight.shape[0] % 2:
        raise ValueError(f"swiglu_mlp_mxfp8: gate_up_weight must be [2I, H] (gate rows, then up rows), got shape "
                         f"{tuple(gate_up_weight.shape)}")
    n_i, h = gate_up_weight.shape[0] // 2, gate_up_weight.shape[1]
    if tuple(down_weight.shape) != (h, n_i):
        raise ValueError(f"swiglu_mlp_mxfp8: down_weight must be [H, I] = [{h}, {n_i}] to match gate_up_weight "
                         f"{tuple(gate_up_weight.shape)}, got {tuple(down_weight.shape)}")
    if x.dim() < 1 or x.shape[-1] != h:
        raise ValueError(f"swiglu_mlp_mxfp8: x must be [..., H] with H = {h}, got shape {tuple(x.shape)}")
    if x.numel() == 0:
        raise ValueError(f"swiglu_mlp_mxfp8: x has no tokens (shape {tuple(x.shape)})")
    if h % MX_GROUP or n_i % MX_GROUP:
        raise ValueError(f"swiglu_mlp_mxfp8: H and I must be multiples of {MX_GROUP} (MX groups along H and I), "
                         f"got H={h}, I={n_i}")
    if not (x.device == gate_up_weight.device == down_weight.device):
        raise ValueError(f"swiglu_mlp_mxfp8: x, gate_up_weight and down_weight must be on one device, got "
                         f"{x.device}, {gate_up_weight.device}, {down_weight.device}")
    return h, n_i


# ----------------------------------------------------------------------------------------------
# forward math (shared by the custom op and the XLA autograd.Function)
# ----------------------------------------------------------------------------------------------


def _forward_math(x2: Tensor, gate_up_weight: Tensor, down_weight: Tensor, clamps: tuple, forward_numerics: str,
                  mm_opts: dict):
    """y [S, H] (x2's dtype) and the bf16 checkpoints [S, I] of the clamped SwiGLU forward."""
    bf = torch.bfloat16
    xb, w_gu, w_down = x2.to(bf), gate_up_weight.to(bf), down_weight.to(bf)
    n_i = w_gu.shape[0] // 2
    if forward_numerics == "kernel":
        gate_pre = emu.recompute_projection(xb, w_gu[:n_i], **mm_opts)
        up = emu.recompute_projection(xb, w_gu[n_i:], **mm_opts)
    else:
        gate_pre = xb @ w_gu[:n_i].t()
        up = xb @ w_gu[n_i:].t()
    gate_act, intermediate = emu.swiglu_activations(gate_pre, up, dict(zip(emu.CLAMP_NAMES, clamps)))
    y = (intermediate @ w_down.t()).to(x2.dtype)
    return y, gate_pre, gate_act, up, intermediate


# ----------------------------------------------------------------------------------------------
# backends of the backward
# ----------------------------------------------------------------------------------------------


def _to_numpy(t: Optional[Tensor]):
    if t is None:
        return None
    t = t.detach().to("cpu").contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _from_numpy(a, device) -> Tensor:
    a = np.ascontiguousarray(a)
    if a.dtype == ml_dtypes.bfloat16:
        t = torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    else:
        t = torch.from_numpy(a.astype(np.float32, copy=True))
    return t.to(device)


def _kernel_kwargs(nl, ckpts, clamps, fp8, scheme, precision, wg):
    from .config import ClampLimits

    clamp = ClampLimits(*clamps) if any(c is not None for c in clamps) else None
    kw = dict(zip(CHECKPOINT_NAMES, ckpts))
    kw.update(clamp_limits=clamp, fp8_x4_dtype=getattr(nl, f"{fp8}_x4"), quant_scheme=scheme,
              weight_grad_dtype=getattr(nl, wg), matmul_precision=precision)
    return kw


def _simulator_backward(dy, x, w_gu, w_down, ckpts, clamps, fp8, scheme, precision, scale_rule, wg, lnc):
    """The real kernel on the NKI CPU simulator (torch -> numpy -> torch)."""
    if scale_rule != "neuron":
        raise ValueError(f"scale_rule={scale_rule!r} is only available with backend='emulate'; the kernel (and so the "
                         f"simulator) uses quantize_mx's 'neuron' rule")
    import nki
    import nki.language as nl

    from .mlp_bwd_mxfp8_kernel import mlp_backward_mxfp8_nki

    kw = _kernel_kwargs(nl, [_to_numpy(c) for c in ckpts], clamps, fp8, scheme, precision, wg)
    outs = nki.simulate(mlp_backward_mxfp8_nki)[lnc](
        output_grad=_to_numpy(dy), hidden_states=_to_numpy(x), down_proj_weight=_to_numpy(w_down),
        gate_up_weights=_to_numpy(w_gu), **kw)
    return tuple(_from_numpy(o, dy.device) for o in outs)


_TORCHNEURON_OPS = {}


def _torchneuron_kernel_op(lnc: int):
    """The kernel registered with ``torch_neuronx.nki_op`` (TorchNeuron, SDK 2.30+). UNTESTED here.

    https://awsdocs-neuron.readthedocs-hosted.com/en/latest/torch/guides/how-to-work-with-nki.html
    """
    if lnc in _TORCHNEURON_OPS:
        return _TORCHNEURON_OPS[lnc]
    from torch_neuronx import nki_op

    from .mlp_bwd_mxfp8_kernel import mlp_backward_mxfp8_nki

    @nki_op(f"nkilib_neuron::mlp_backward_mxfp8_lnc{lnc}", mutates_args=())
    def op(output_grad: Tensor, hidden_states: Tensor, down_proj_weight: Tensor, gate_up_weights: Tensor,
           gate_pre: Optional[Tensor], gate_act: Optional[Tensor], up: Optional[Tensor],
           intermediate: Optional[Tensor], gate_lower: Optional[float], gate_upper: Optional[float],
           up_lower: Optional[float], up_upper: Optional[float], fp8_dtype: str, quant_scheme: str,
           matmul_precision: str, weight_grad_dtype: str) -> tuple[Tensor, Tensor, Tensor]:
        import nki.language as nl

        kw = _kernel_kwargs(nl, (gate_pre, gate_act, up, intermediate),
                            (gate_lower, gate_upper, up_lower, up_upper), fp8_dtype, quant_scheme,
                            matmul_precision, weight_grad_dtype)
        return mlp_backward_mxfp8_nki[lnc](output_grad=output_grad, hidden_states=hidden_states,
                                           down_proj_weight=down_proj_weight, gate_up_weights=gate_up_weights, **kw)

    _TORCHNEURON_OPS[lnc] = op
    return op


def _neuron_backward(dy, x, w_gu, w_down, ckpts, clamps, fp8, scheme, precision, scale_rule, wg, lnc):
    """The kernel on a Neuron device (TorchNeuron via nki_op, else a direct nki.jit call). UNTESTED here."""
    import nkilib

    if scale_rule != "neuron":
        raise ValueError(f"scale_rule={scale_rule!r} is only available with backend='emulate'; the hardware's "
                         f"quantize_mx uses the 'neuron' rule")
    if nkilib.BACKEND != "neuron":
        raise RuntimeError("backend='neuron' needs the Neuron SDK's nki package (this process uses nkilib's CPU "
                           "simulator); use backend='simulator' or 'emulate' off Trainium")
    stack = _neuron_stack()
    if stack is None:
        raise RuntimeError("backend='neuron' needs torch-neuronx (TorchNeuron) or torch-xla with the Neuron plugin")
    if stack == "torchneuron":
        return tuple(_torchneuron_kernel_op(lnc)(dy, x, w_down, w_gu, *ckpts, *clamps, fp8, scheme, precision, wg))
    import nki.language as nl

    from .mlp_bwd_mxfp8_kernel import mlp_backward_mxfp8_nki

    kw = _kernel_kwargs(nl, ckpts, clamps, fp8, scheme, precision, wg)
    return tuple(mlp_backward_mxfp8_nki[lnc](output_grad=dy, hidden_states=x, down_proj_weight=w_down,
                                             gate_up_weights=w_gu, **kw))


def _run_backward(backend, dy, x, w_gu, w_down, ckpts, clamps, fp8, scheme, precision, scale_rule, wg, lnc):
    if backend == "emulate":
        return emu.mlp_backward_emulate(
            dy, x, w_down, w_gu, *ckpts, clamp_limits=dict(zip(emu.CLAMP_NAMES, clamps)), fp8_dtype=fp8,
            quant_scheme=scheme, matmul_precision=precision, weight_grad_dtype=getattr(torch, wg),
            scale_rule=scale_rule)
    if backend == "simulator":
        return _simulator_backward(dy, x, w_gu, w_down, ckpts, clamps, fp8, scheme, precision, scale_rule, wg, lnc)
    if backend == "neuron":
        return _neuron_backward(dy, x, w_gu, w_down, ckpts, clamps, fp8, scheme, precision, scale_rule, wg, lnc)
    raise ValueError(f"backend must be one of {BACKENDS[1:]} here, got {backend!r}")


# ----------------------------------------------------------------------------------------------
# custom ops
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("nkilib::swiglu_mlp_mxfp8_backward", mutates_args=())
def swiglu_mlp_mxfp8_backward_op(
    output_grad: Tensor, hidden_states: Tensor, gate_up_weight: Tensor, down_weight: Tensor,
    gate_pre: Optional[Tensor], gate_act: Optional[Tensor], up: Optional[Tensor], intermediate: Optional[Tensor],
    gate_lower: Optional[float], gate_upper: Optional[float], up_lower: Optional[float], up_upper: Optional[float],
    fp8_dtype: str, quant_scheme: str, matmul_precision: str, scale_rule: str, weight_grad_dtype: str,
    backend: str, lnc: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """The kernel's backward on 2-D bf16 operands (see mlp_backward_mxfp8_nki for the argument meaning).

    Dimensions:
        output_grad / hidden_states [S, H], gate_up_weight [2I, H], down_weight [H, I], checkpoints
        [S, I] or None -> (dX [S, H] bf16, dW_gate_up [2I, H], dW_down [H, I] in weight_grad_dtype).
    """
    for name, t in (("output_grad", output_grad), ("hidden_states", hidden_states),
                    ("gate_up_weight", gate_up_weight), ("down_weight", down_weight), ("gate_pre", gate_pre),
                    ("gate_act", gate_act), ("up", up), ("intermediate", intermediate)):
        if t is not None and t.dtype != torch.bfloat16:
            raise TypeError(f"nkilib::swiglu_mlp_mxfp8_backward: {name} must be bfloat16, got {t.dtype}")
    ckpts = (gate_pre, gate_act, up, intermediate)
    clamps = (gate_lower, gate_upper, up_lower, up_upper)
    outs = _run_backward(backend, output_grad, hidden_states, gate_up_weight, down_weight, ckpts, clamps, fp8_dtype,
                         quant_scheme, matmul_precision, scale_rule, weight_grad_dtype, lnc)
    # fresh tensors (custom ops must not alias their inputs)
    return tuple(o.contiguous() for o in outs)


@swiglu_mlp_mxfp8_backward_op.register_fake
def _backward_fake(output_grad, hidden_states, gate_up_weight, down_weight, gate_pre, gate_act, up, intermediate,
                   gate_lower, gate_upper, up_lower, up_upper, fp8_dtype, quant_scheme, matmul_precision, scale_rule,
                   weight_grad_dtype, backend, lnc):
    wg = getattr(torch, weight_grad_dtype)
    return (torch.empty_like(hidden_states, dtype=torch.bfloat16, memory_format=torch.contiguous_format),
            gate_up_weight.new_empty(gate_up_weight.shape, dtype=wg),
            down_weight.new_empty(down_weight.shape, dtype=wg))


@torch.library.custom_op("nkilib::swiglu_mlp_mxfp8", mutates_args=())
def swiglu_mlp_mxfp8_op(
    x: Tensor, gate_up_weight: Tensor, down_weight: Tensor,
    gate_lower: Optional[float], gate_upper: Optional[float], up_lower: Optional[float], up_upper: Optional[float],
    fp8_dtype: str, quant_scheme: str, matmul_precision: str, scale_rule: str, weight_grad_dtype: str,
    forward_numerics: str, backend: str, lnc: int,
    save_gate_pre: bool, save_gate_act: bool, save_up: bool, save_intermediate: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Forward of the clamped SwiGLU MLP on x [S, H]: (y [S, H] in x's dtype, gate_pre, gate_act, up,
    intermediate [S, I] bf16). The options after the clamps are carried for the backward; the save_*
    flags choose what the autograd formula keeps."""
    mm_opts = dict(matmul_precision=matmul_precision, fp8_dtype=fp8_dtype, quant_scheme=quant_scheme,
                   scale_rule=scale_rule)
    return _forward_math(x, gate_up_weight, down_weight, (gate_lower, gate_upper, up_lower, up_upper),
                         forward_numerics, mm_opts)


@swiglu_mlp_mxfp8_op.register_fake
def _forward_fake(x, gate_up_weight, down_weight, *args):
    s, n_i = x.shape[0], gate_up_weight.shape[0] // 2
    ck = [x.new_empty((s, n_i), dtype=torch.bfloat16) for _ in CHECKPOINT_NAMES]
    return (x.new_empty((s, down_weight.shape[0])), *ck)


def _setup_context(ctx, inputs, output):
    x, w_gu, w_down = inputs[:3]
    options = inputs[3:15]  # clamps (4), fp8, scheme, precision, scale_rule, wg, forward_numerics, backend, lnc
    keep = inputs[15:19]
    _, *ckpts = output
    ctx.mark_non_differentiable(*ckpts)
    ctx.save_for_backward(x, w_gu, w_down, *[c if k else None for c, k in zip(ckpts, keep)])
    ctx.options = options


def _backward(ctx, grad_y, *unused_checkpoint_grads):
    x, w_gu, w_down, *ckpts = ctx.saved_tensors
    (gl, gu, ul, uu, fp8, scheme, precision, rule, wg, _fwd_numerics, backend, lnc) = ctx.options
    bf = torch.bfloat16
    dx, dw_gu, dw_down = swiglu_mlp_mxfp8_backward_op(
        grad_y.to(bf), x.to(bf), w_gu.to(bf), w_down.to(bf), *ckpts, gl, gu, ul, uu, fp8, scheme, precision, rule,
        wg, backend, lnc)
    return (dx.to(x.dtype), dw_gu.to(w_gu.dtype), dw_down.to(w_down.dtype)) + (None,) * 16


swiglu_mlp_mxfp8_op.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------
# PyTorch/XLA path (torch <= 2.9 with torch-xla): autograd.Function, UNTESTED here
# ----------------------------------------------------------------------------------------------


class _XlaSwiGLUMLP(torch.autograd.Function):
    """Forward in torch ops on XLA tensors; backward calls ``mlp_backward_mxfp8_nki[lnc]`` with XLA tensors
    (the NKI PyTorch/XLA integration, https://awsdocs-neuron.readthedocs-hosted.com/en/v2.28.0/nki/guides/
    framework_custom_op.html). Not exercised in this repository (no Neuron device)."""

    @staticmethod
    def forward(ctx, x2, gate_up_weight, down_weight, clamps, options, keep):
        fp8, scheme, precision, rule, wg, forward_numerics, lnc = options
        mm_opts = dict(matmul_precision=precision, fp8_dtype=fp8, quant_scheme=scheme, scale_rule=rule)
        y, *ckpts = _forward_math(x2, gate_up_weight, down_weight, clamps, forward_numerics, mm_opts)
        ctx.save_for_backward(x2, gate_up_weight, down_weight, *[c if k else None for c, k in zip(ckpts, keep)])
        ctx.clamps, ctx.options = clamps, options
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, w_gu, w_down, *ckpts = ctx.saved_tensors
        fp8, scheme, precision, rule, wg, _, lnc = ctx.options
        bf = torch.bfloat16
        dx, dw_gu, dw_down = _neuron_backward(grad_y.to(bf), x.to(bf), w_gu.to(bf), w_down.to(bf), ckpts, ctx.clamps,
                                              fp8, scheme, precision, rule, wg, lnc)
        return dx.to(x.dtype), dw_gu.to(w_gu.dtype), dw_down.to(w_down.dtype), None, None, None


# ----------------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------------


def swiglu_mlp_mxfp8(x: Tensor, gate_up_weight: Tensor, down_weight: Tensor, *, checkpoint="all",
                     clamp_limits=None, fp8_dtype="float8_e4m3fn", quant_scheme="1x32", weight_grad_dtype=None,
                     matmul_precision="mxfp8", scale_rule="neuron", forward_numerics="torch", backend="auto",
                     lnc: int | None = None) -> Tensor:
    """Clamped SwiGLU MLP y = (silu(clamp(x W_gate^T)) * clamp(x W_up^T)) W_down^T with the MXFP8 NKI backward.

    Dimensions:
        x [..., H] -> y [..., H]; gate_up_weight [2I, H] (gate rows first), down_weight [H, I]
        (nn.Linear layout). H and I multiples of 32.

    Args:
        x: activations, bfloat16 or float32 (rounded to bf16 for the math).
        gate_up_weight, down_weight: parameters, bfloat16 or float32.
        checkpoint: "all", "none" or a subset of CHECKPOINT_NAMES: what the forward saves for the
            backward (the kernel recomputes the rest; see the module docstring on identity).
        clamp_limits: ClampLimits (or a dict of its fields) of a clamped SwiGLU, or None.
        fp8_dtype: "float8_e4m3fn" (default) or "float8_e5m2" (or the torch float8 dtype).
        quant_scheme: "1x32" (OCP groups, default) or "wrapX".
        weight_grad_dtype: None (float32 if a parameter is float32, else bfloat16), torch.bfloat16 or
            torch.float32: the dtype the kernel writes the weight gradients in.
        matmul_precision: "mxfp8" (Trn3, default) or "bf16" (Trn2's path).
        scale_rule: "neuron" (quantize_mx's rule, default); "rceil" / "ocp_floor" need backend="emulate".
        forward_numerics: "torch" (bf16 torch projections) or "kernel" (the kernel's recompute numerics).
        backend: "auto", "simulator", "emulate" or "neuron" (module docstring).
        lnc: LNC degree of the kernel launch (1 or 2); None: 2 on Neuron, 1 elsewhere.

    Returns:
        y [..., H] in x's dtype.

    Raises:
        TypeError / ValueError: wrong types, shapes, dtypes, devices, option values or policy names.
        RuntimeError: a device with no kernel path under backend="auto", or backend="neuron" off Neuron.
    """
    h, _ = _check_inputs(x, gate_up_weight, down_weight)
    keep = resolve_checkpoint_policy(checkpoint)
    clamps = options.clamp_values(clamp_limits)
    fp8 = options.fp8_format(fp8_dtype)
    options.quant_scheme(quant_scheme)
    options.matmul_precision(matmul_precision)
    options.check_choice("scale_rule", scale_rule, _SCALE_RULES)
    options.check_choice("forward_numerics", forward_numerics, FORWARD_NUMERICS)
    wg = _weight_grad_name(weight_grad_dtype, gate_up_weight, down_weight)
    resolved = resolve_backend(backend, x.device)
    if scale_rule != "neuron" and resolved != "emulate":
        raise ValueError(f"scale_rule={scale_rule!r} needs backend='emulate' (the kernel's quantize_mx implements "
                         f"the 'neuron' rule); got backend={backend!r} (-> {resolved!r})")
    if lnc is None:
        lnc = 2 if resolved == "neuron" else 1
    if lnc not in (1, 2) or isinstance(lnc, bool):
        raise ValueError(f"lnc must be 1 or 2, got {lnc!r}")
    x2 = x.reshape(-1, h)
    if x.device.type == "xla":
        y2 = _XlaSwiGLUMLP.apply(x2, gate_up_weight, down_weight, clamps,
                                 (fp8, quant_scheme, matmul_precision, scale_rule, wg, forward_numerics, lnc), keep)
    else:
        y2, *_ = swiglu_mlp_mxfp8_op(x2, gate_up_weight, down_weight, *clamps, fp8, quant_scheme, matmul_precision,
                                     scale_rule, wg, forward_numerics, resolved, lnc, *keep)
    return y2.reshape(x.shape)


class SwiGLUMLP(nn.Module):
    """SwiGLU MLP block with the MXFP8 NKI backward (``swiglu_mlp_mxfp8``).

    Parameters (nn.Linear layout, initialised like nn.Linear without bias):
        gate_up_weight [2I, H] (gate rows 0..I-1, up rows I..2I-1), down_weight [H, I].

    Args:
        hidden_size: H (multiple of 32).
        intermediate_size: I (multiple of 32).
        checkpoint, backend, clamp_limits, fp8_dtype, quant_scheme, weight_grad_dtype,
            matmul_precision, scale_rule, forward_numerics, lnc: as in ``swiglu_mlp_mxfp8``.
        device, dtype: of the parameters (dtype bfloat16 or float32; default torch's default dtype).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, *, checkpoint="all", backend="auto",
                 clamp_limits=None, fp8_dtype="float8_e4m3fn", quant_scheme="1x32", weight_grad_dtype=None,
                 matmul_precision="mxfp8", scale_rule="neuron", forward_numerics="torch", lnc=None, device=None,
                 dtype=None):
        super().__init__()
        for name, v in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0 or v % MX_GROUP:
                raise ValueError(f"SwiGLUMLP: {name} must be a positive multiple of {MX_GROUP}, got {v!r}")
        resolve_checkpoint_policy(checkpoint)  # fail at construction, not at the first forward
        if backend not in BACKENDS:
            raise ValueError(f"SwiGLUMLP: backend must be one of {BACKENDS}, got {backend!r}")
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.options = dict(checkpoint=checkpoint, backend=backend, clamp_limits=clamp_limits, fp8_dtype=fp8_dtype,
                            quant_scheme=quant_scheme, weight_grad_dtype=weight_grad_dtype,
                            matmul_precision=matmul_precision, scale_rule=scale_rule,
                            forward_numerics=forward_numerics, lnc=lnc)
        factory = dict(device=device, dtype=dtype)
        self.gate_up_weight = nn.Parameter(torch.empty(2 * intermediate_size, hidden_size, **factory))
        self.down_weight = nn.Parameter(torch.empty(hidden_size, intermediate_size, **factory))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's default init: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (kaiming_uniform_ with a=sqrt(5))."""
        for w in (self.gate_up_weight, self.down_weight):
            nn.init.kaiming_uniform_(w, a=5 ** 0.5)

    def forward(self, x: Tensor) -> Tensor:
        return swiglu_mlp_mxfp8(x, self.gate_up_weight, self.down_weight, **self.options)

    def extra_repr(self) -> str:
        o = self.options
        return (f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
                f"checkpoint={o['checkpoint']!r}, backend={o['backend']!r}, fp8_dtype={o['fp8_dtype']!r}, "
                f"quant_scheme={o['quant_scheme']!r}, matmul_precision={o['matmul_precision']!r}")
