"""PyTorch integration: a SwiGLU MLP whose backward is the MXFP8 NKI kernel.

API:
    swiglu_mlp_mxfp8(x, gate_up_weight, down_weight, *, checkpoint="all", clamp_limits=None, ...) -> y
    SwiGLUMLP(hidden_size, intermediate_size, *, recipe=None, checkpoint=..., backend=..., ...)  (nn.Module)

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
fp32 gradients that were never rounded to bf16, or when ``accumulate_main_grad=True`` sends them to an
fp32 ``param.main_grad``; else bf16).

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
    "emulate_fast": opt-in, NOT bit-exact: "emulate" with the same MX quantization but float32-accumulating
        GEMMs instead of exact per-tile float64 sums (bf16 tensor-core GEMMs on CUDA, IEEE float32 GEMMs
        elsewhere; mlp_bwd_mxfp8_emulate_fast.py), for convergence studies on GPUs; same scale rules.
    "neuron": the kernel on a Neuron device, the stack chosen by the tensors' device type: "neuron"
        -> TorchNeuron (ops registered with ``torch_neuronx.nki_op`` + ``register_autograd``), "xla" ->
        PyTorch/XLA (an autograd.Function calling ``mlp_backward_mxfp8_nki[lnc]`` with XLA tensors); the
        LNC degree from NEURON_LOGICAL_NC_CONFIG. See mlp_bwd_mxfp8_neuron.py (rules and doc sources);
        UNTESTED on hardware here, the dispatch is tested with stub modules.

Registration: two torch.library custom ops, ``nkilib::swiglu_mlp_mxfp8`` (forward; returns y and
the four checkpoints, autograd registered with ``register_autograd``) and
``nkilib::swiglu_mlp_mxfp8_backward`` (the kernel call), both with fake implementations, so the
function composes with torch.compile and torch.utils.checkpoint; both pass torch.library.opcheck.

fp32 gradient accumulation (``accumulate_main_grad=True``, Megatron / NxD convention): a weight with
an fp32 ``main_grad`` receives the kernel's fp32 weight gradient there. The forward op takes, per such
weight, an fp32 zero-stride "sink" input made from the parameter by ``_MainGradSink``; the backward
formula returns the fp32 gradient for the sink (the autograd engine casts a gradient to its input's
dtype, so it must be an fp32 input) and None for the weight; the sink's backward adds it to
``main_grad``. The ops stay functional (opcheck, torch.compile).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from ....core import options
from ....recipe_call import UNSET, accepts_recipe
from . import mlp_bwd_mxfp8_emulate as emu
from .constants import MX_GROUP
from ...neuron_dispatch import check_lnc, launch_stack_and_lnc, register_ops_if_available
from .mlp_bwd_mxfp8_neuron import NEURON_DEVICE_STACKS, XlaSwiGLUMLP, kernel_kwargs, torchneuron_ops
from ...torch_common import CHECKPOINT_NAMES, check_numeric_options, resolve_checkpoint_policy
from ...torch_common import MainGradSink as _MainGradSink, from_numpy as _from_numpy, to_numpy as _to_numpy
from ...torch_common import RecipeLayer, weight_grad_name as _weight_grad_name

__all__ = ["swiglu_mlp_mxfp8", "SwiGLUMLP", "CHECKPOINT_NAMES", "BACKENDS", "EMULATE_BACKENDS", "FORWARD_NUMERICS",
           "resolve_checkpoint_policy", "resolve_backend"]

#: backend= choices.
BACKENDS = ("auto", "simulator", "emulate", "emulate_fast", "neuron")
#: The pure-torch backends and the emulation's GEMMs they run ("exact": bit-identical to the kernel).
EMULATE_BACKENDS = {"emulate": "exact", "emulate_fast": "fast"}
#: forward_numerics= choices (see the module docstring).
FORWARD_NUMERICS = ("torch", "kernel")
_PARAM_DTYPES = (torch.bfloat16, torch.float32)


# ----------------------------------------------------------------------------------------------
# option resolution (plain Python, runs before the custom op so errors name the user's arguments)
# ----------------------------------------------------------------------------------------------


def resolve_backend(backend: str, device: torch.device) -> str:
    """"auto" -> a concrete backend for tensors on `device` (module docstring); validates the others."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    kind = device.type
    if kind == "cpu":
        return "simulator"
    if kind in NEURON_DEVICE_STACKS:
        return "neuron"
    if kind == "meta":
        return "emulate"
    raise RuntimeError(
        f"swiglu_mlp_mxfp8: no NKI kernel path for tensors on device '{device}' (the kernel runs on Neuron "
        f"devices, and on CPU in the simulator); pass backend='emulate' for the pure-torch emulation of the "
        f"kernel's exact numerics on this device, or move the tensors to CPU / a Neuron device")


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


def _simulator_backward(dy, x, w_gu, w_down, ckpts, clamps, fp8, scheme, precision, scale_rule, wg, lnc):
    """The real kernel on the NKI CPU simulator (torch -> numpy -> torch)."""
    if scale_rule != "neuron":
        raise ValueError(f"scale_rule={scale_rule!r} is only available with backend='emulate'; the kernel (and so the "
                         f"simulator) uses quantize_mx's 'neuron' rule")
    import nki
    import nki.language as nl

    from .mlp_bwd_mxfp8_kernel import mlp_backward_mxfp8_nki

    kw = kernel_kwargs(nl, [_to_numpy(c) for c in ckpts], clamps, fp8, scheme, precision, wg)
    outs = nki.simulate(mlp_backward_mxfp8_nki)[lnc](
        output_grad=_to_numpy(dy), hidden_states=_to_numpy(x), down_proj_weight=_to_numpy(w_down),
        gate_up_weights=_to_numpy(w_gu), **kw)
    return tuple(_from_numpy(o, dy.device) for o in outs)


def _run_backward(backend, dy, x, w_gu, w_down, ckpts, clamps, fp8, scheme, precision, scale_rule, wg, lnc):
    if backend in EMULATE_BACKENDS:
        return emu.mlp_backward_emulate(
            dy, x, w_down, w_gu, *ckpts, clamp_limits=dict(zip(emu.CLAMP_NAMES, clamps)), fp8_dtype=fp8,
            quant_scheme=scheme, matmul_precision=precision, weight_grad_dtype=getattr(torch, wg),
            scale_rule=scale_rule, gemm=EMULATE_BACKENDS[backend])
    if backend == "simulator":
        return _simulator_backward(dy, x, w_gu, w_down, ckpts, clamps, fp8, scheme, precision, scale_rule, wg, lnc)
    if backend == "neuron":
        raise RuntimeError("nkilib::swiglu_mlp_mxfp8_backward does not run the Neuron path: swiglu_mlp_mxfp8 sends "
                           "Neuron tensors to the nki_op registration (TorchNeuron) or the XLA autograd.Function "
                           "(mlp_bwd_mxfp8_neuron.py)")
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


def backward_fake(output_grad, hidden_states, gate_up_weight, down_weight, gate_pre, gate_act, up, intermediate,
                  gate_lower, gate_upper, up_lower, up_upper, fp8_dtype, quant_scheme, matmul_precision, scale_rule,
                  weight_grad_dtype, backend, lnc):
    """Shapes / dtypes of the backward op: (dX [S, H] bf16, dW_gate_up [2I, H], dW_down [H, I] in
    weight_grad_dtype). Shared by the CPU op and the TorchNeuron nki_op registration."""
    wg = getattr(torch, weight_grad_dtype)
    return (torch.empty_like(hidden_states, dtype=torch.bfloat16, memory_format=torch.contiguous_format),
            gate_up_weight.new_empty(gate_up_weight.shape, dtype=wg),
            down_weight.new_empty(down_weight.shape, dtype=wg))


swiglu_mlp_mxfp8_backward_op.register_fake(backward_fake)


def forward_impl(x, gate_up_weight, down_weight, gate_lower, gate_upper, up_lower, up_upper, fp8_dtype, quant_scheme,
                 matmul_precision, scale_rule, forward_numerics, gemm="exact"):
    """Body of the forward ops: (y [S, H] in x's dtype, gate_pre, gate_act, up, intermediate [S, I] bf16).
    gemm: the emulation's GEMMs for forward_numerics="kernel" (EMULATE_BACKENDS)."""
    mm_opts = dict(matmul_precision=matmul_precision, fp8_dtype=fp8_dtype, quant_scheme=quant_scheme,
                   scale_rule=scale_rule, gemm=gemm)
    return _forward_math(x, gate_up_weight, down_weight, (gate_lower, gate_upper, up_lower, up_upper),
                         forward_numerics, mm_opts)


@torch.library.custom_op("nkilib::swiglu_mlp_mxfp8", mutates_args=())
def swiglu_mlp_mxfp8_op(
    x: Tensor, gate_up_weight: Tensor, down_weight: Tensor, gate_up_grad_sink: Optional[Tensor],
    down_grad_sink: Optional[Tensor],
    gate_lower: Optional[float], gate_upper: Optional[float], up_lower: Optional[float], up_upper: Optional[float],
    fp8_dtype: str, quant_scheme: str, matmul_precision: str, scale_rule: str, weight_grad_dtype: str,
    forward_numerics: str, backend: str, lnc: int,
    save_gate_pre: bool, save_gate_act: bool, save_up: bool, save_intermediate: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Forward of the clamped SwiGLU MLP on x [S, H]: (y [S, H] in x's dtype, gate_pre, gate_act, up,
    intermediate [S, I] bf16). The *_grad_sink inputs (fp32 [2I, H] / [H, I] or None) only receive the
    fp32 weight gradients in the backward (see _MainGradSink); the options after the clamps are carried
    for the backward; the save_* flags choose what the autograd formula keeps."""
    return forward_impl(x, gate_up_weight, down_weight, gate_lower, gate_upper, up_lower, up_upper, fp8_dtype,
                        quant_scheme, matmul_precision, scale_rule, forward_numerics,
                        gemm=EMULATE_BACKENDS.get(backend, "exact"))


def forward_fake(x, gate_up_weight, down_weight, *args):
    """Shapes / dtypes of the forward ops (CPU custom op and TorchNeuron nki_op)."""
    s, n_i = x.shape[0], gate_up_weight.shape[0] // 2
    ck = [x.new_empty((s, n_i), dtype=torch.bfloat16) for _ in CHECKPOINT_NAMES]
    return (x.new_empty((s, down_weight.shape[0])), *ck)


swiglu_mlp_mxfp8_op.register_fake(forward_fake)


def setup_context(ctx, inputs, output):
    """Autograd context of the forward ops: saves x, the weights and the kept checkpoints."""
    x, w_gu, w_down, sink_gu, sink_down = inputs[:5]
    call_options = inputs[5:17]  # clamps (4), fp8, scheme, precision, scale_rule, wg, forward_numerics, backend, lnc
    keep = inputs[17:21]
    _, *ckpts = output
    ctx.mark_non_differentiable(*ckpts)
    ctx.save_for_backward(x, w_gu, w_down, *[c if k else None for c, k in zip(ckpts, keep)])
    ctx.options = call_options
    ctx.sinks = (sink_gu is not None, sink_down is not None)


def route_weight_grads(sinks: tuple, weights: tuple, weight_grads: tuple) -> tuple:
    """Gradients for (gate_up_weight, down_weight, gate_up_grad_sink, down_grad_sink).

    A weight with a sink gets None (its fp32 gradient goes to the sink, i.e. to param.main_grad);
    one without gets the kernel's gradient cast to the weight's dtype.
    """
    (sink_gu, sink_down), (w_gu, w_down), (dw_gu, dw_down) = sinks, weights, weight_grads
    return (None if sink_gu else dw_gu.to(w_gu.dtype), None if sink_down else dw_down.to(w_down.dtype),
            dw_gu if sink_gu else None, dw_down if sink_down else None)


def make_backward_formula(backward_op):
    """The register_autograd backward of a forward op, calling `backward_op` (the CPU custom op, or the
    TorchNeuron nki_op whose body is the kernel)."""

    def backward(ctx, grad_y, *unused_checkpoint_grads):
        x, w_gu, w_down, *ckpts = ctx.saved_tensors
        (gl, gu, ul, uu, fp8, scheme, precision, rule, wg, _fwd_numerics, backend, lnc) = ctx.options
        bf = torch.bfloat16
        dx, dw_gu, dw_down = backward_op(
            grad_y.to(bf), x.to(bf), w_gu.to(bf), w_down.to(bf), *ckpts, gl, gu, ul, uu, fp8, scheme, precision,
            rule, wg, backend, lnc)
        return (dx.to(x.dtype), *route_weight_grads(ctx.sinks, (w_gu, w_down), (dw_gu, dw_down))) + (None,) * 16

    return backward


swiglu_mlp_mxfp8_op.register_autograd(make_backward_formula(swiglu_mlp_mxfp8_backward_op),
                                      setup_context=setup_context)

# TorchNeuron: register the nki_op ops at import, like the documented module-level decorators, so that
# torch.compile never traces a registration (no-op where torch_neuronx or its nki_op is missing).
register_ops_if_available(torchneuron_ops)


# ----------------------------------------------------------------------------------------------
# fp32 gradient accumulation into param.main_grad (Megatron / NxD convention)
# ----------------------------------------------------------------------------------------------


def _main_grad_sinks(accumulate_main_grad: bool, params: dict) -> list:
    """One sink per parameter (None where no fp32 main_grad accumulation applies).

    Raises:
        TypeError: accumulate_main_grad not a bool.
        ValueError: a main_grad that is not an fp32 tensor of the parameter's shape and device.
    """
    if not isinstance(accumulate_main_grad, bool):
        raise TypeError(f"accumulate_main_grad must be True or False, got {accumulate_main_grad!r}")
    sinks = []
    for name, p in params.items():
        main_grad = getattr(p, "main_grad", None) if accumulate_main_grad else None
        if main_grad is None or not (torch.is_grad_enabled() and p.requires_grad):
            sinks.append(None)
            continue
        if not isinstance(main_grad, Tensor) or main_grad.dtype != torch.float32 or \
                main_grad.shape != p.shape or main_grad.device != p.device:
            got = (f"{main_grad.dtype} {tuple(main_grad.shape)} on {main_grad.device}" if isinstance(main_grad, Tensor)
                   else type(main_grad).__name__)
            raise ValueError(f"{name}.main_grad must be a float32 tensor of shape {tuple(p.shape)} on {p.device} "
                             f"(accumulate_main_grad=True), got {got}")
        sinks.append(_MainGradSink.apply(p))
    return sinks


# ----------------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------------


@accepts_recipe
def swiglu_mlp_mxfp8(x: Tensor, gate_up_weight: Tensor, down_weight: Tensor, *, checkpoint="all",
                     clamp_limits=None, fp8_dtype="float8_e4m3fn", quant_scheme="1x32", weight_grad_dtype=None,
                     matmul_precision="mxfp8", scale_rule="neuron", forward_numerics="torch", backend="auto",
                     lnc: int | None = None, accumulate_main_grad: bool = False) -> Tensor:
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
        weight_grad_dtype: None (float32 if a parameter is float32 or accumulates into main_grad, else
            bfloat16), torch.bfloat16 or torch.float32: the dtype the kernel writes the weight gradients in.
        matmul_precision: "mxfp8" (Trn3, default) or "bf16" (Trn2's path).
        scale_rule: "neuron" (quantize_mx's rule, default); "rceil" / "ocp_floor" need backend="emulate" or
            "emulate_fast".
        forward_numerics: "torch" (bf16 torch projections) or "kernel" (the kernel's recompute numerics).
        backend: "auto", "simulator", "emulate", "emulate_fast" (not bit-exact) or "neuron" (module docstring).
        lnc: LNC degree of the kernel launch (1 or 2). None: 1 off Neuron; on Neuron the value of
            NEURON_LOGICAL_NC_CONFIG (unset: 1, the documented default). On Neuron an lnc that differs
            from NEURON_LOGICAL_NC_CONFIG is an error (the launch must match the runtime).
        accumulate_main_grad: opt-in fp32 gradient accumulation (Megatron / NxD convention): a weight
            that has a ``main_grad`` attribute (an fp32 tensor of its shape) gets the kernel's fp32
            weight gradient added to ``main_grad`` (never rounded to the parameter's dtype) and its
            ``.grad`` is left alone (a parameter with ``grad_added_to_main_grad`` gets that flag set and
            a zero ``.grad``); a weight without ``main_grad`` gets its ``.grad`` as usual. The kernel
            then writes fp32 weight gradients (weight_grad_dtype must be None or float32).

    Returns:
        y [..., H] in x's dtype.

    Raises:
        TypeError / ValueError: wrong types, shapes, dtypes, devices, option values or policy names,
            an lnc that contradicts NEURON_LOGICAL_NC_CONFIG, a malformed main_grad.
        RuntimeError: a device with no kernel path under backend="auto", or backend="neuron" off a
            Neuron device.
    """
    h, _ = _check_inputs(x, gate_up_weight, down_weight)
    keep = resolve_checkpoint_policy(checkpoint)
    clamps, fp8 = check_numeric_options(clamp_limits, fp8_dtype, quant_scheme, matmul_precision, scale_rule)
    if options.clamp_activation(clamp_limits) != "silu":  # the kernels have it; this layer's forward does not yet
        raise ValueError("swiglu_mlp_mxfp8: clamp_limits.activation must be 'silu' here ('gpt_oss' is available in "
                         "moe_swiglu_experts_mxfp8 and the kernels)")
    options.check_choice("forward_numerics", forward_numerics, FORWARD_NUMERICS)
    wg = _weight_grad_name(weight_grad_dtype, gate_up_weight, down_weight)
    resolved = resolve_backend(backend, x.device)
    if scale_rule != "neuron" and resolved not in EMULATE_BACKENDS:
        raise ValueError(f"scale_rule={scale_rule!r} needs backend='emulate' or 'emulate_fast' (the kernel's "
                         f"quantize_mx implements the 'neuron' rule); got backend={backend!r} (-> {resolved!r})")
    check_lnc(lnc, "swiglu_mlp_mxfp8")
    stack, lnc = launch_stack_and_lnc(resolved, x.device, lnc)
    sink_gu, sink_down = _main_grad_sinks(accumulate_main_grad, {"gate_up_weight": gate_up_weight,
                                                                 "down_weight": down_weight})
    if sink_gu is not None or sink_down is not None:
        if weight_grad_dtype is not None and wg != "float32":
            raise ValueError(f"accumulate_main_grad=True accumulates fp32 weight gradients; weight_grad_dtype must "
                             f"be None or torch.float32, got {weight_grad_dtype!r}")
        wg = "float32"
    x2 = x.reshape(-1, h)
    if stack == "xla":
        y2 = XlaSwiGLUMLP.apply(x2, gate_up_weight, down_weight, sink_gu, sink_down, clamps,
                                (fp8, quant_scheme, matmul_precision, scale_rule, wg, forward_numerics, lnc), keep)
    else:
        forward_op = torchneuron_ops()[0] if stack == "torchneuron" else swiglu_mlp_mxfp8_op
        y2, *_ = forward_op(x2, gate_up_weight, down_weight, sink_gu, sink_down, *clamps, fp8, quant_scheme,
                            matmul_precision, scale_rule, wg, forward_numerics, resolved, lnc, *keep)
    return y2.reshape(x.shape)


class SwiGLUMLP(RecipeLayer, nn.Module):
    """SwiGLU MLP block with the MXFP8 NKI backward (``swiglu_mlp_mxfp8``).

    Parameters (nn.Linear layout, initialised like nn.Linear without bias):
        gate_up_weight [2I, H] (gate rows 0..I-1, up rows I..2I-1), down_weight [H, I].

    Args:
        hidden_size: H (multiple of 32).
        intermediate_size: I (multiple of 32).
        recipe: a nkilib Recipe or preset name (nkilib/recipe.py), or None (the op's defaults).
        checkpoint, backend, clamp_limits, fp8_dtype, quant_scheme, weight_grad_dtype,
            matmul_precision, scale_rule, forward_numerics, lnc, accumulate_main_grad: as in
            ``swiglu_mlp_mxfp8`` (with accumulate_main_grad=True, give the parameters an fp32
            ``main_grad`` before the forward, as Megatron / NxD optimizers do); left unset, the
            recipe's value (without a recipe the op's default); given, they override the recipe.
        device, dtype: of the parameters (dtype bfloat16 or float32; default torch's default dtype).
    """

    recipe_op = staticmethod(swiglu_mlp_mxfp8)
    layer_name = "SwiGLUMLP"

    def __init__(self, hidden_size: int, intermediate_size: int, *, recipe=None, checkpoint=UNSET, backend=UNSET,
                 clamp_limits=UNSET, fp8_dtype=UNSET, quant_scheme=UNSET, weight_grad_dtype=UNSET,
                 matmul_precision=UNSET, scale_rule=UNSET, forward_numerics=UNSET, lnc=UNSET,
                 accumulate_main_grad=UNSET, device=None, dtype=None):
        super().__init__()
        self._check_sizes(hidden_size=hidden_size, intermediate_size=intermediate_size)
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        o = self._set_recipe_options(recipe, checkpoint=checkpoint, backend=backend, clamp_limits=clamp_limits,
                                     fp8_dtype=fp8_dtype, quant_scheme=quant_scheme,
                                     weight_grad_dtype=weight_grad_dtype, matmul_precision=matmul_precision,
                                     scale_rule=scale_rule, forward_numerics=forward_numerics, lnc=lnc,
                                     accumulate_main_grad=accumulate_main_grad)
        if o["backend"] not in BACKENDS:
            raise ValueError(f"SwiGLUMLP: backend must be one of {BACKENDS}, got {o['backend']!r}")
        factory = dict(device=device, dtype=dtype)
        self.gate_up_weight = nn.Parameter(torch.empty(2 * intermediate_size, hidden_size, **factory))
        self.down_weight = nn.Parameter(torch.empty(hidden_size, intermediate_size, **factory))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's default init: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (kaiming_uniform_ with a=sqrt(5))."""
        for w in (self.gate_up_weight, self.down_weight):
            nn.init.kaiming_uniform_(w, a=5 ** 0.5)

    def forward(self, x: Tensor) -> Tensor:
        return swiglu_mlp_mxfp8(x, self.gate_up_weight, self.down_weight, **self.op_options())

    def extra_repr(self) -> str:
        o = self.effective_options()
        return (f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
                f"checkpoint={o['checkpoint']!r}, backend={o['backend']!r}, fp8_dtype={o['fp8_dtype']!r}, "
                f"quant_scheme={o['quant_scheme']!r}, matmul_precision={o['matmul_precision']!r}, "
                f"accumulate_main_grad={o['accumulate_main_grad']!r}")
