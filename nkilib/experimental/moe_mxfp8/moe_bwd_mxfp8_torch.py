"""PyTorch integration: MoE SwiGLU experts whose backward follows the MXFP8 MoE kernel's numerics.

API:
    moe_swiglu_experts_mxfp8(x, topk_ids, topk_weights, gate_up_weight, down_weight, *, checkpoint="all", ...)
    MoESwiGLUExperts(num_experts, hidden_size, intermediate_size, ...)  (nn.Module)

Math (docs/moe.md; per routed pair (t, j), e = topk_ids[t, j], p = topk_weights[t, j]):
    gate_pre = x[t] W_gate[e]^T, up = x[t] W_up[e]^T, h = silu(clamp(gate_pre)) * clamp(up),
    y[t] = sum_j (p h) W_down[e]^T
with gate_up_weight [E, 2I, H] (per expert gate rows then up rows) and down_weight [E, H, I]. x is
[..., H] (leading dimensions flattened to T tokens); topk_ids / topk_weights are [..., k] with the
same leading dimensions (or [T, k]).

Forward: BF16 in torch (per expert: bf16 projections, the kernel's formulas for gate_act and
intermediate, hs = bf16(f32(h) * p), bf16 down projection, fp32 sum over a token's experts).
It saves the checkpoints the policy keeps, one row per routed pair ([T, k, I] bf16 for the emulate backends; for
the backends that run the kernel, simulator and neuron, [N*B, I] in the kernel's block-position order,
moe_bwd_mxfp8_forward.py, read by plain DMA):
"all", "none" or any subset of (gate_pre, gate_act, up, intermediate). Policies that keep gate_pre and
up give gradients bit-identical to "all"; without them the backward recomputes the projections as
MX matmuls (K = H), which differ from the forward's BF16 matmuls by about the MXFP8 error.

Backward: the MoE expert backward of docs/moe.md, returning dX (x's dtype), d_topk_weights
(topk_weights' dtype, computed in fp32), d_gate_up_weight and d_down_weight (parameter dtypes; the
kernel writes them in weight_grad_dtype: float32 when a parameter is float32, else bf16).

Backends (``backend=``):
    "emulate": pure torch, bit-identical to reference.moe_backward_reference(mode="mx_exact"), on any
        device (CPU, CUDA).
    "emulate_fast": opt-in, NOT bit-exact: "emulate" with the same MX quantization and float32-accumulating
        GEMMs (the dense op's "emulate_fast", mlp_bwd_mxfp8_emulate_fast.py), for studies on GPUs.
    "simulator": the NKI kernel (moe_bwd_mxfp8_kernel.moe_backward_mxfp8_nki, lnc=1 or 2) on the CPU simulator
        (torch -> numpy -> torch; the routing becomes routing.build_block_layout; slow, for correctness;
        bit-identical to "emulate"; scale_rule "neuron" only). The routing weights go in by block position and
        d_topk_weights comes back so (the kernel's weights_layout="block"), taken back to [T, k] here
        (moe_bwd_mxfp8_forward.kernel_weights_blocks / weights_grad_from_blocks; the Neuron path the same).
    "neuron": the kernel on a Neuron device (moe_bwd_mxfp8_neuron.py), the stack chosen by the tensors'
        device type like the dense op's: "neuron" -> TorchNeuron (ops registered with
        ``torch_neuronx.nki_op`` + ``register_autograd``), "xla" -> PyTorch/XLA (an autograd.Function
        calling ``moe_backward_mxfp8_nki[lnc]``); the LNC degree from NEURON_LOGICAL_NC_CONFIG
        (nkilib/experimental/neuron_dispatch.py). UNTESTED on hardware; the dispatch is tested with stubs.
    "auto": "neuron" for tensors on a Neuron / XLA device, else "emulate" (fast on any device).

Input checks: shapes, dtypes and devices before the op (errors name the argument); the routing's
values (ids in [0, E), no id twice in a token, finite weights) inside the op, on the actual data
(this reads topk_ids / topk_weights back to the host once per forward).

Registration: torch.library custom ops ``nkilib::moe_swiglu_experts_mxfp8`` (forward, autograd
registered) and ``nkilib::moe_swiglu_experts_mxfp8_backward``, both with fake implementations, so the
function works under torch.compile (fullgraph) and passes torch.library.opcheck. On TorchNeuron the same
schemas are registered through ``nki_op`` (moe_bwd_mxfp8_neuron.torchneuron_ops) and reuse forward_impl,
the fakes, setup_context and make_backward_formula from here.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from ...core import options
from ...recipe_call import UNSET, accepts_recipe
from ..mlp_mxfp8.mlp_bwd_mxfp8.constants import MX_GROUP
from ..mlp_mxfp8.mlp_bwd_mxfp8.mlp_bwd_mxfp8_torch import EMULATE_BACKENDS
from ..neuron_dispatch import (NEURON_DEVICE_STACKS, check_lnc, kernel_kwargs, launch_stack_and_lnc,
                               register_ops_if_available)
from ..torch_common import CHECKPOINT_NAMES, RecipeLayer, check_numeric_options, resolve_checkpoint_policy
from ..torch_common import from_numpy as _from_numpy, to_numpy as _to_numpy, weight_grad_name as _weight_grad_name
from . import routing
from .constants import DEFAULT_BLOCK_SIZE
from .moe_bwd_mxfp8_emulate import moe_backward_emulate
from .moe_bwd_mxfp8_forward import (checkpoint_rows, forward_math as _forward_math, kernel_checkpoint_layout,
                                    kernel_weights_blocks, weights_grad_from_blocks)
from .moe_bwd_mxfp8_neuron import XlaMoESwiGLUExperts, torchneuron_ops

__all__ = ["moe_swiglu_experts_mxfp8", "MoESwiGLUExperts", "BACKENDS", "UNAVAILABLE_BACKENDS", "resolve_backend"]

#: backend= values accepted.
BACKENDS = ("auto", "emulate", "emulate_fast", "simulator", "neuron")
#: Backends accepted by name but not available (none: "neuron" runs the kernel on a Neuron device).
UNAVAILABLE_BACKENDS = ()
_PARAM_DTYPES = (torch.bfloat16, torch.float32)


def resolve_backend(backend, device=None) -> str:
    """'auto' -> 'neuron' for tensors on a Neuron / XLA `device`, else 'emulate'; the others as is;
    anything else -> ValueError."""
    if backend not in BACKENDS:
        raise ValueError(f"moe_swiglu_experts_mxfp8: backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    return "neuron" if getattr(device, "type", None) in NEURON_DEVICE_STACKS else "emulate"


def _check_inputs(x, topk_ids, topk_weights, gate_up_weight, down_weight, num_experts=None) -> tuple:
    """Shapes / dtypes / devices; returns (T, H, I, E, k). num_experts: E when the weights hold only some
    experts (expert parallelism), else gate_up_weight.shape[0]."""
    for name, t in (("x", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights),
                    ("gate_up_weight", gate_up_weight), ("down_weight", down_weight)):
        if not isinstance(t, Tensor):
            raise TypeError(f"moe_swiglu_experts_mxfp8: {name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t in (("x", x), ("gate_up_weight", gate_up_weight), ("down_weight", down_weight)):
        if t.dtype not in _PARAM_DTYPES:
            raise TypeError(f"moe_swiglu_experts_mxfp8: {name} must be torch.bfloat16 or torch.float32, got {t.dtype}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"moe_swiglu_experts_mxfp8: topk_ids must be torch.int32 or torch.int64, got {topk_ids.dtype}")
    if not topk_weights.dtype.is_floating_point:
        raise TypeError(f"moe_swiglu_experts_mxfp8: topk_weights must be a floating-point tensor, got "
                        f"{topk_weights.dtype}")
    if gate_up_weight.dim() != 3 or gate_up_weight.shape[1] % 2:
        raise ValueError(f"moe_swiglu_experts_mxfp8: gate_up_weight must be [E, 2I, H] (per expert gate rows, then "
                         f"up rows), got shape {tuple(gate_up_weight.shape)}")
    e, two_i, h = gate_up_weight.shape
    n_i = two_i // 2
    if tuple(down_weight.shape) != (e, h, n_i):
        raise ValueError(f"moe_swiglu_experts_mxfp8: down_weight must be [E, H, I] = [{e}, {h}, {n_i}] to match "
                         f"gate_up_weight {tuple(gate_up_weight.shape)}, got {tuple(down_weight.shape)}")
    if h % MX_GROUP or n_i % MX_GROUP or n_i == 0:
        raise ValueError(f"moe_swiglu_experts_mxfp8: H and I must be positive multiples of {MX_GROUP}, got H={h}, "
                         f"I={n_i}")
    if x.dim() < 1 or x.shape[-1] != h:
        raise ValueError(f"moe_swiglu_experts_mxfp8: x must be [..., H] with H = {h}, got shape {tuple(x.shape)}")
    if x.numel() == 0:
        raise ValueError(f"moe_swiglu_experts_mxfp8: x has no tokens (shape {tuple(x.shape)})")
    t = x.numel() // h
    lead = tuple(x.shape[:-1])
    if topk_ids.dim() < 1 or tuple(topk_ids.shape[:-1]) not in (lead, (t,)) or topk_ids.shape[-1] == 0:
        raise ValueError(f"moe_swiglu_experts_mxfp8: topk_ids must be [..., k] with the leading dimensions of x "
                         f"{lead} (or [T, k] with T = {t}), got shape {tuple(topk_ids.shape)}")
    k = topk_ids.shape[-1]
    e = e if num_experts is None else num_experts
    if k > e:
        raise ValueError(f"moe_swiglu_experts_mxfp8: topk_ids has k={k} experts per token but there are E={e} "
                         f"experts (a token's experts are distinct, so k <= E)")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"moe_swiglu_experts_mxfp8: topk_weights must have the shape of topk_ids "
                         f"{tuple(topk_ids.shape)}, got {tuple(topk_weights.shape)}")
    devices = {t_.device for t_ in (x, topk_ids, topk_weights, gate_up_weight, down_weight)}
    if len(devices) != 1:
        raise ValueError(f"moe_swiglu_experts_mxfp8: all tensors must be on one device, got "
                         f"{sorted(str(d) for d in devices)}")
    return t, h, n_i, e, k


def _check_routing_values(topk_ids: Tensor, topk_weights: Tensor, num_experts: int) -> None:
    """Value checks on the real data (routing.validate_*: messages name the argument and position)."""
    routing.validate_topk_ids(topk_ids.detach().to("cpu").numpy(), num_experts)
    routing.validate_topk_weights(topk_weights.detach().to("cpu", torch.float32).numpy(), tuple(topk_weights.shape))


# ----------------------------------------------------------------------------------------------
# custom ops
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("nkilib::moe_swiglu_experts_mxfp8_backward", mutates_args=())
def moe_swiglu_experts_mxfp8_backward_op(
    output_grad: Tensor, hidden_states: Tensor, topk_ids: Tensor, topk_weights: Tensor, gate_up_weight: Tensor,
    down_weight: Tensor, gate_pre: Optional[Tensor], gate_act: Optional[Tensor], up: Optional[Tensor],
    intermediate: Optional[Tensor], gate_lower: Optional[float], gate_upper: Optional[float],
    up_lower: Optional[float], up_upper: Optional[float], activation: str, fp8_dtype: str, quant_scheme: str,
    matmul_precision: str, scale_rule: str, weight_grad_dtype: str, block_size: int, backend: str, lnc: int,
    gate_up_bias: Optional[Tensor],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The MoE expert backward on [T, H] / [T, k] operands (reference.moe_backward_reference's meaning).

    Dimensions:
        output_grad / hidden_states [T, H], topk_ids / topk_weights [T, k], gate_up_weight [E, 2I, H],
        down_weight [E, H, I], checkpoints [T, k, I] or None, gate_up_bias [E, 2I] or None -> (dX [T, H] bf16,
        d_topk_weights [T, k] float32, dW_gate_up [E, 2I, H], dW_down [E, H, I] in weight_grad_dtype,
        d_gate_up_bias [E, 2I] float32, or [0] without a bias). The bias only asks for its gradient (its value
        is in the gate_pre / up checkpoints): the kernel's gate_up_bias_grad output (simulator), bias_grad of
        the emulation (emulate), the same bits.
    """
    clamps = (gate_lower, gate_upper, up_lower, up_upper, activation)
    no_bias = output_grad.new_zeros((0,), dtype=torch.float32)
    if backend == "simulator":
        outs = _simulator_backward(output_grad, hidden_states, topk_ids, topk_weights, gate_up_weight, down_weight,
                                   (gate_pre, gate_act, up, intermediate), clamps, fp8_dtype, quant_scheme,
                                   matmul_precision, scale_rule, weight_grad_dtype, block_size, lnc,
                                   gate_up_bias is not None)
        return outs + (() if gate_up_bias is not None else (no_bias,))
    if backend == "neuron":
        raise RuntimeError("nkilib::moe_swiglu_experts_mxfp8_backward does not run the Neuron path: "
                           "moe_swiglu_experts_mxfp8 sends Neuron tensors to the nki_op registration (TorchNeuron) or "
                           "the XLA autograd.Function (moe_bwd_mxfp8_neuron.py)")
    if backend not in EMULATE_BACKENDS:
        raise ValueError(f"nkilib::moe_swiglu_experts_mxfp8_backward: backend must be 'emulate', 'emulate_fast' or "
                         f"'simulator' here, "
                         f"got {backend!r}")
    outs = moe_backward_emulate(
        output_grad, hidden_states, topk_ids, topk_weights, gate_up_weight, down_weight, gate_pre, gate_act, up,
        intermediate, block_size=block_size,
        clamp_limits=dict(zip(options.CLAMP_NAMES + ("activation",), clamps)),
        fp8_dtype=fp8_dtype, quant_scheme=quant_scheme, matmul_precision=matmul_precision,
        weight_grad_dtype=getattr(torch, weight_grad_dtype), scale_rule=scale_rule,
        bias_grad=gate_up_bias is not None, gemm=EMULATE_BACKENDS[backend])
    return tuple(o.contiguous() for o in outs) + (() if gate_up_bias is not None else (no_bias,))


def _simulator_backward(dy, x, ids, w, w_gu, w_down, ckpts, clamps, fp8, scheme, precision, scale_rule, wg,
                        block_size, lnc, bias_grad=False):
    """moe_backward_mxfp8_nki on the NKI CPU simulator (LNC `lnc`): torch -> numpy, the block layout of the
    routing, the kernel, numpy -> torch (outputs on dy's device; with bias_grad a fifth, d_gate_up_bias). The routing
    weights go in block-ordered and d_topk_weights comes back so (weights_layout="block"), taken back to [T, k]."""
    if scale_rule != "neuron":
        raise ValueError(f"scale_rule={scale_rule!r} is only available with backend='emulate'; the kernel (and so the "
                         f"simulator) uses quantize_mx's 'neuron' rule")
    import nki
    import nki.language as nl

    from .moe_bwd_mxfp8_kernel import moe_backward_mxfp8_nki

    layout = routing.build_block_layout(_to_numpy(ids), w_gu.shape[0], block_size)
    shape, ckpt_layout = kernel_checkpoint_layout(ckpts, ids.shape[0], ids.shape[1], w_gu.shape[1] // 2)
    kw = kernel_kwargs(nl, [None if c is None else _to_numpy(c.to(torch.bfloat16)).reshape(shape) for c in ckpts],
                       clamps, fp8, scheme, precision, wg)
    kw["checkpoint_layout"] = ckpt_layout
    slots = torch.from_numpy(layout.token_position_to_slot).to(torch.int64)
    w32 = w.detach().to("cpu", torch.float32)
    outs = nki.simulate(moe_backward_mxfp8_nki)[lnc](
        output_grad=_to_numpy(dy.to(torch.bfloat16)), hidden_states=_to_numpy(x.to(torch.bfloat16)),
        topk_weights=_to_numpy(w32), gate_up_weight=_to_numpy(w_gu.to(torch.bfloat16)),
        down_weight=_to_numpy(w_down.to(torch.bfloat16)), token_position_to_id=layout.token_position_to_id,
        token_position_to_slot=layout.token_position_to_slot, expert_block_offsets=layout.expert_block_offsets,
        block_size=block_size, run_with_lnc2=lnc == 2, gate_up_bias_grad=bias_grad, weights_layout="block",
        topk_weights_blocks=_to_numpy(kernel_weights_blocks(w32, slots)), **kw)
    outs = [_from_numpy(o, "cpu") for o in outs]
    outs[1] = weights_grad_from_blocks(outs[1], slots, *ids.shape)
    return tuple(o.to(dy.device).contiguous() for o in outs)


def backward_fake(output_grad, hidden_states, topk_ids, topk_weights, gate_up_weight, down_weight, *rest):
    """Shapes / dtypes of the backward ops (CPU custom op and TorchNeuron nki_op)."""
    wg = getattr(torch, rest[-4])  # rest ends with weight_grad_dtype, block_size, backend, lnc
    return (hidden_states.new_empty(hidden_states.shape, dtype=torch.bfloat16),
            topk_weights.new_empty(topk_weights.shape, dtype=torch.float32),
            gate_up_weight.new_empty(gate_up_weight.shape, dtype=wg),
            down_weight.new_empty(down_weight.shape, dtype=wg))


def backward_fake_with_bias(*args):
    """backward_fake plus the bias gradient ([E, 2I] float32, or [0] without a bias): the CPU backward op."""
    bias, w_gu = args[-1], args[4]
    shape = (0,) if bias is None else (w_gu.shape[0], w_gu.shape[1])
    return (*backward_fake(*args[:-1]), w_gu.new_empty(shape, dtype=torch.float32))


moe_swiglu_experts_mxfp8_backward_op.register_fake(backward_fake_with_bias)


def forward_impl(x, topk_ids, topk_weights, gate_up_weight, down_weight, gate_lower, gate_upper, up_lower,
                 up_upper, activation, gate_up_bias=None, checkpoint_block_size=None):
    """Body of the forward ops: validates the routing's values, then (y [T, H] in x's dtype, gate_pre, gate_act,
    up, intermediate [T, k, I] bf16, or [N*B, I] by block position with checkpoint_block_size = B)."""
    _check_routing_values(topk_ids, topk_weights, gate_up_weight.shape[0])
    return _forward_math(x, topk_ids, topk_weights, gate_up_weight, down_weight,
                         (gate_lower, gate_upper, up_lower, up_upper, activation), gate_up_bias, checkpoint_block_size)


def checkpoint_block_size(block_size, backend):
    """B when the backward's backend runs the kernel, which reads block-ordered checkpoints (checkpoint_layout=
    "block": the simulator and the Neuron path), else None (by slot: the emulate backends compute per routed pair)."""
    return block_size if backend in ("simulator", "neuron") else None


@torch.library.custom_op("nkilib::moe_swiglu_experts_mxfp8", mutates_args=())
def moe_swiglu_experts_mxfp8_op(
    x: Tensor, topk_ids: Tensor, topk_weights: Tensor, gate_up_weight: Tensor, down_weight: Tensor,
    gate_lower: Optional[float], gate_upper: Optional[float], up_lower: Optional[float], up_upper: Optional[float],
    activation: str, fp8_dtype: str, quant_scheme: str, matmul_precision: str, scale_rule: str,
    weight_grad_dtype: str, block_size: int, backend: str, lnc: int, save_gate_pre: bool, save_gate_act: bool,
    save_up: bool, save_intermediate: bool, gate_up_bias: Optional[Tensor],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Forward on x [T, H], topk_ids / topk_weights [T, k]: (y [T, H] in x's dtype, gate_pre, gate_act, up,
    intermediate [T, k, I] bf16, or [N*B, I] by block position for the simulator backend). Validates the routing's
    values first. The options after the clamps are carried for the backward; the save_* flags choose what the
    autograd formula keeps; gate_up_bias [E, 2I] or None (GPT-OSS; in gate_pre / up)."""
    return forward_impl(x, topk_ids, topk_weights, gate_up_weight, down_weight, gate_lower, gate_upper, up_lower,
                        up_upper, activation, gate_up_bias, checkpoint_block_size(block_size, backend))


def forward_fake(x, topk_ids, topk_weights, gate_up_weight, down_weight, *args):
    """Shapes / dtypes of the forward ops (CPU custom op and TorchNeuron nki_op); args: the op's after down_weight
    (block_size and backend at 10 and 11)."""
    t, k, n_i = x.shape[0], topk_ids.shape[1], gate_up_weight.shape[1] // 2
    b = checkpoint_block_size(args[10], args[11]) if len(args) > 11 else None
    shape = (t, k, n_i) if b is None else (checkpoint_rows(t, k, gate_up_weight.shape[0], b), n_i)
    ck = [x.new_empty(shape, dtype=torch.bfloat16) for _ in CHECKPOINT_NAMES]
    return (x.new_empty((t, down_weight.shape[1])), *ck)


moe_swiglu_experts_mxfp8_op.register_fake(forward_fake)

_N_OPTIONS = 13  # clamps (4), activation, fp8, scheme, precision, scale_rule, wg, block_size, backend, lnc
_N_KEEP = len(CHECKPOINT_NAMES)


def setup_context(ctx, inputs, output):
    """Autograd context of the forward ops: saves x, the routing, the weights, the kept checkpoints and (CPU op)
    the gate_up_bias input that follows the keep flags."""
    x, ids, w, w_gu, w_down = inputs[:5]
    keep = inputs[5 + _N_OPTIONS:5 + _N_OPTIONS + _N_KEEP]
    ctx.has_bias_input = len(inputs) > 5 + _N_OPTIONS + _N_KEEP
    bias = inputs[-1] if ctx.has_bias_input else None
    _, *ckpts = output
    ctx.mark_non_differentiable(*ckpts)
    ctx.save_for_backward(x, ids, w, w_gu, w_down, *[c if k else None for c, k in zip(ckpts, keep)], bias)
    ctx.options = inputs[5:5 + _N_OPTIONS]


def make_backward_formula(backward_op):
    """The register_autograd backward of a forward op, calling `backward_op` (the CPU custom op, or the
    TorchNeuron nki_op whose body is the kernel)."""

    def backward(ctx, grad_y, *unused_checkpoint_grads):
        x, ids, w, w_gu, w_down, *ckpts, bias = ctx.saved_tensors
        bf = torch.bfloat16
        extra = (bias,) if ctx.has_bias_input else ()
        dx, d_w, dw_gu, dw_down, *d_bias = backward_op(
            grad_y.to(bf), x.to(bf), ids, w, w_gu.to(bf), w_down.to(bf), *ckpts, *ctx.options, *extra)
        grads = (dx.to(x.dtype), None, d_w.to(w.dtype), dw_gu.to(w_gu.dtype), dw_down.to(w_down.dtype))
        grads += (None,) * (_N_OPTIONS + _N_KEEP)
        if ctx.has_bias_input:
            grads += (None if bias is None else d_bias[0].to(bias.dtype),)
        return grads

    return backward


moe_swiglu_experts_mxfp8_op.register_autograd(make_backward_formula(moe_swiglu_experts_mxfp8_backward_op),
                                              setup_context=setup_context)

# TorchNeuron: register the nki_op ops at import (no-op where torch_neuronx or its nki_op is missing), so that
# torch.compile never traces a registration (as the dense op does).
register_ops_if_available(torchneuron_ops)


# ----------------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------------


@accepts_recipe(label="MoE experts")
def moe_swiglu_experts_mxfp8(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, gate_up_weight: Tensor,
                             down_weight: Tensor, *, checkpoint="all", clamp_limits=None, fp8_dtype="float8_e4m3fn",
                             quant_scheme="1x32", weight_grad_dtype=None, matmul_precision="mxfp8",
                             scale_rule="neuron", block_size: int = DEFAULT_BLOCK_SIZE, backend="auto",
                             lnc=None, ep_group=None, ep_payload="mxfp8", ep_capacity=None, gate_up_bias=None,
                             down_bias=None) -> Tensor:
    """Routed SwiGLU experts y[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]) with the MXFP8
    MoE backward (module docstring).

    Dimensions:
        x [..., H] -> y [..., H]; topk_ids, topk_weights [..., k] (or [T, k]); gate_up_weight [E, 2I, H];
        down_weight [E, H, I]; H and I multiples of 32; k <= E.

    Args:
        x: activations, bfloat16 or float32 (rounded to bf16 for the math).
        topk_ids: int32 / int64 expert ids, distinct within a token, in [0, E).
        topk_weights: routing weights (any float dtype, finite; the math uses float32). Differentiable.
        gate_up_weight, down_weight: expert parameters, bfloat16 or float32.
        checkpoint: "all", "none" or a subset of ("gate_pre", "gate_act", "up", "intermediate").
        clamp_limits: ClampLimits (or a dict of its fields) of a clamped SwiGLU, or None; its activation
            "gpt_oss" selects GPT-OSS's gated function (gate * sigmoid(1.702 gate) * (up + 1)).
        fp8_dtype: "float8_e4m3fn" (default) or "float8_e5m2" (or the torch float8 dtype).
        quant_scheme: "1x32" (default) or "wrapX".
        weight_grad_dtype: None (float32 if a parameter is float32, else bfloat16), torch.bfloat16 or torch.float32.
        matmul_precision: "mxfp8" (Trn3, default) or "bf16" (Trn2's path).
        scale_rule: "neuron" (quantize_mx's rule, default), "rceil" or "ocp_floor" (studies).
        block_size: B of the kernel's block layout (multiple of 128, <= 512); fixes the order of the
            weight-gradient sums.
        backend: "auto", "emulate", "emulate_fast" (not bit-exact), "simulator" or "neuron" (module docstring).
        lnc: the kernel's LNC degree: None (simulator: 1; neuron: NEURON_LOGICAL_NC_CONFIG, unset = 1), 1 or 2
            (neuron: must equal NEURON_LOGICAL_NC_CONFIG). Unused by "emulate".
        ep_group: None, or a torch.distributed process group of ep ranks over which the E experts are sharded
            (expert parallelism, expert_parallel.py): gate_up_weight / down_weight are then this rank's E/ep
            experts (rank r of the group: experts r*E/ep .. (r+1)*E/ep - 1), topk_ids hold global ids in [0, E),
            and tokens travel to their experts' ranks and back as MXFP8 all-to-alls; gate_up_bias / down_bias are
            then the local experts' [E/ep, 2I] / [E/ep, H] and their gradients stay on this rank.
        ep_payload: with ep_group, how x and dY travel: "mxfp8" (fp8 codes + E8M0 scales, default) or "bf16"
            (results bit-identical to the single-process op, twice the bytes).
        ep_capacity: with ep_group, how the payload all-to-alls split their rows: None (default: "auto" on a
            process group whose backend is "xla", whose all_to_all_single refuses split sizes, else "exact"),
            "exact" (per-rank split lists), a positive int C (equal splits: C rows per (source, destination) rank
            pair, padded, static shapes; a rank routing more than C pairs to one rank raises a ValueError on every
            rank, nothing is dropped) or "auto" (C = the smallest power of two that fits the call). Bit-identical
            results in every mode (expert_parallel.moe_swiglu_experts_expert_parallel).
        gate_up_bias: None or [E, 2I] (GPT-OSS): added to the projections (gate_pre = x W_gate[e]^T + b_gate[e]
            in bf16, likewise up); needs a checkpoint policy keeping gate_pre and up (the kernel's recompute has
            no bias), any backend. Its gradient, per expert the float32 sum of the bf16 d_gate_up rows in the
            order of reference.reference_bias_grad_fold, is the kernel's gate_up_bias_grad output (simulator,
            neuron; BF16 matmuls with a ones column in pass C) or the emulation's bias_grad_fold, the same bits.
        down_bias: None or [E, H] (GPT-OSS): y[t] += sum_j p_j * down_bias[e_j], in float32 torch ops outside
            the op, so autograd gives d_down_bias[e] = sum over e's pairs of p * dY (float32) and adds
            <dY[t], down_bias[e]> to d_topk_weights (the op's <dI, h> is the rest of <dY, y_e>).
        recipe: a nkilib Recipe or preset name (nkilib/recipe.py) giving the options above; explicit
            keywords override its fields (nkilib/recipe_call.py). A recipe with forward_numerics="kernel" or
            accumulate_main_grad=True is refused (no such option here).

    Returns:
        y [..., H] in x's dtype.

    Raises:
        TypeError / ValueError: wrong types, shapes, dtypes, devices, option values, routing values
            (ids out of range, negative or repeated within a token; non-finite weights), an lnc that
            contradicts NEURON_LOGICAL_NC_CONFIG.
        RuntimeError: backend "neuron" off a Neuron / XLA device or without its torch stack.
    """
    if ep_group is not None:
        from .expert_parallel import moe_swiglu_experts_expert_parallel

        return moe_swiglu_experts_expert_parallel(
            x, topk_ids, topk_weights, gate_up_weight, down_weight, group=ep_group, ep_payload=ep_payload,
            ep_capacity=ep_capacity, checkpoint=checkpoint,
            clamp_limits=clamp_limits, fp8_dtype=fp8_dtype, quant_scheme=quant_scheme,
            weight_grad_dtype=weight_grad_dtype, matmul_precision=matmul_precision, scale_rule=scale_rule,
            block_size=block_size, backend=backend, lnc=lnc, gate_up_bias=gate_up_bias, down_bias=down_bias)
    if ep_payload != "mxfp8" or ep_capacity is not None:
        from .expert_parallel import check_ep_options

        check_ep_options(None, ep_payload, ep_capacity, "moe_swiglu_experts_mxfp8")  # raises: no ep_group
    if down_bias is not None:
        y = moe_swiglu_experts_mxfp8(x, topk_ids, topk_weights, gate_up_weight, down_weight, checkpoint=checkpoint,
                                     clamp_limits=clamp_limits, fp8_dtype=fp8_dtype, quant_scheme=quant_scheme,
                                     weight_grad_dtype=weight_grad_dtype, matmul_precision=matmul_precision,
                                     scale_rule=scale_rule, block_size=block_size, backend=backend, lnc=lnc,
                                     gate_up_bias=gate_up_bias)
        return _add_down_bias(y, topk_ids, topk_weights, down_bias, gate_up_weight.shape)
    t, h, _, e, k = _check_inputs(x, topk_ids, topk_weights, gate_up_weight, down_weight)
    resolved = resolve_backend(backend, x.device)
    check_lnc(lnc, "moe_swiglu_experts_mxfp8")
    keep = resolve_checkpoint_policy(checkpoint)
    clamps, fp8 = check_numeric_options(clamp_limits, fp8_dtype, quant_scheme, matmul_precision, scale_rule)
    clamps = (*clamps, options.clamp_activation(clamp_limits))
    wg = _weight_grad_name(weight_grad_dtype, gate_up_weight, down_weight)
    b = routing.check_block_size(block_size)
    _check_gate_up_bias(gate_up_bias, gate_up_weight, keep)
    stack, lnc = launch_stack_and_lnc(resolved, x.device, lnc)
    args = (x.reshape(t, h), topk_ids.reshape(t, k), topk_weights.reshape(t, k), gate_up_weight, down_weight)
    if stack == "xla":
        y2 = XlaMoESwiGLUExperts.apply(*args, clamps, (fp8, quant_scheme, matmul_precision, scale_rule, wg, b, lnc),
                                       keep, gate_up_bias)
    else:
        forward_op = torchneuron_ops()[0] if stack == "torchneuron" else moe_swiglu_experts_mxfp8_op
        y2, *_ = forward_op(*args, *clamps, fp8, quant_scheme, matmul_precision, scale_rule, wg, b, resolved, lnc,
                            *keep, gate_up_bias)
    return y2.reshape(x.shape)


def _check_gate_up_bias(bias, gate_up_weight, keep) -> None:
    """gate_up_bias: None, or an [E, 2I] tensor of the weight's dtype class and device, with gate_pre and up
    kept (keep: the checkpoint flags). Every backend computes its gradient (the kernel's gate_up_bias_grad)."""
    if bias is None:
        return
    want = (gate_up_weight.shape[0], gate_up_weight.shape[1])
    if not isinstance(bias, Tensor) or tuple(bias.shape) != want or bias.dtype not in _PARAM_DTYPES or \
            bias.device != gate_up_weight.device:
        raise ValueError(f"moe_swiglu_experts_mxfp8: gate_up_bias must be a bfloat16 / float32 tensor [E, 2I] = "
                         f"{list(want)} on {gate_up_weight.device}, got "
                         f"{getattr(bias, 'dtype', type(bias).__name__)} {tuple(getattr(bias, 'shape', ()))}")
    if not (keep[0] and keep[2]):
        raise ValueError("moe_swiglu_experts_mxfp8: gate_up_bias needs a checkpoint policy that keeps gate_pre and "
                         "up (the kernel's recompute has no bias), got one without them")


def _check_down_bias(down_bias, gate_up_shape, device) -> None:
    """down_bias: an [E, H] bfloat16 / float32 tensor on `device` (E, H from gate_up_weight's shape)."""
    e, h = gate_up_shape[0], gate_up_shape[2]
    if not isinstance(down_bias, Tensor) or tuple(down_bias.shape) != (e, h) or \
            down_bias.dtype not in _PARAM_DTYPES or down_bias.device != device:
        raise ValueError(f"moe_swiglu_experts_mxfp8: down_bias must be a bfloat16 / float32 tensor [E, H] = "
                         f"{[e, h]} on {device}, got {getattr(down_bias, 'dtype', type(down_bias).__name__)} "
                         f"{tuple(getattr(down_bias, 'shape', ()))}")


def _add_down_bias(y, topk_ids, topk_weights, down_bias, gate_up_shape):
    """y + sum_j p_j * down_bias[e_j] (float32, then y's dtype), differentiable in p and down_bias."""
    _check_down_bias(down_bias, gate_up_shape, y.device)
    p = topk_weights.to(torch.float32).unsqueeze(-1)  # [..., k, 1]
    b = down_bias.to(torch.float32)[topk_ids.to(torch.int64)]  # [..., k, H]
    return (y.to(torch.float32) + (p * b).sum(dim=-2).reshape(y.shape)).to(y.dtype)


class MoESwiGLUExperts(RecipeLayer, nn.Module):
    """E SwiGLU experts applied to routed tokens, with the MXFP8 MoE backward (``moe_swiglu_experts_mxfp8``).

    Parameters (per expert the nn.Linear layout, initialised like nn.Linear):
        gate_up_weight [E, 2I, H] (gate rows 0..I-1, up rows I..2I-1), down_weight [E, H, I]; with bias=True also
        gate_up_bias [E, 2I] and down_bias [E, H] (GPT-OSS; nn.Linear's bias init).

    Args:
        num_experts: E.
        hidden_size: H (multiple of 32).
        intermediate_size: I (multiple of 32).
        recipe: a nkilib Recipe or preset name, or None (the op's defaults).
        checkpoint, backend, clamp_limits, fp8_dtype, quant_scheme, weight_grad_dtype, matmul_precision,
            scale_rule, block_size, lnc: as in ``moe_swiglu_experts_mxfp8``; left unset, the recipe's value (or
            without a recipe the op's default); given, they override the recipe (GPT-OSS's experts:
            clamp_limits=ClampLimits(non_linear_upper=7, linear_lower=-7, linear_upper=7, activation="gpt_oss")).
        bias: add gate_up_bias and down_bias (moe_swiglu_experts_mxfp8's; needs a checkpoint keeping gate_pre
            and up; any backend).
        ep_group: None, or a torch.distributed process group of ep ranks sharding the experts (expert
            parallelism, ``moe_swiglu_experts_mxfp8(..., ep_group=)``): the module then holds only this rank's
            E/ep experts (rank r of the group: experts r*E/ep .. (r+1)*E/ep - 1), so its parameters are
            [E/ep, 2I, H] / [E/ep, H, I] (biases [E/ep, 2I] / [E/ep, H]) and its state dict holds the local
            shard; topk_ids stay global ids in [0, E). E must be divisible by the group size.
        ep_payload, ep_capacity: with ep_group, the op's (how tokens travel: "mxfp8" / "bf16"; per-rank splits or
            padded equal splits); checked at construction.
        device, dtype: of the parameters (bfloat16 or float32).

    forward(x [..., H], topk_ids [..., k], topk_weights [..., k]) -> y [..., H].
    """

    recipe_op = staticmethod(moe_swiglu_experts_mxfp8)
    layer_name = "MoESwiGLUExperts"

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, recipe=None,
                 checkpoint=UNSET, backend=UNSET, clamp_limits=UNSET, fp8_dtype=UNSET, quant_scheme=UNSET,
                 weight_grad_dtype=UNSET, matmul_precision=UNSET, scale_rule=UNSET, block_size=UNSET, lnc=UNSET,
                 bias: bool = False, ep_group=None, ep_payload: str = "mxfp8", ep_capacity=None, device=None,
                 dtype=None):
        super().__init__()
        if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts <= 0:
            raise ValueError(f"MoESwiGLUExperts: num_experts must be a positive integer, got {num_experts!r}")
        self._check_sizes(hidden_size=hidden_size, intermediate_size=intermediate_size)
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        o = self._set_recipe_options(recipe, checkpoint=checkpoint, backend=backend, clamp_limits=clamp_limits,
                                     fp8_dtype=fp8_dtype, quant_scheme=quant_scheme,
                                     weight_grad_dtype=weight_grad_dtype, matmul_precision=matmul_precision,
                                     scale_rule=scale_rule, block_size=block_size, lnc=lnc)
        resolve_backend(o["backend"])
        routing.check_block_size(o["block_size"])
        check_lnc(o["lnc"], "MoESwiGLUExperts")
        if not isinstance(bias, bool):
            raise ValueError(f"MoESwiGLUExperts: bias must be a bool, got {bias!r}")
        self.ep_group, self.expert_offset, local = ep_group, 0, num_experts
        self.ep_payload, self.ep_capacity = ep_payload, ep_capacity
        if ep_group is not None or ep_payload != "mxfp8" or ep_capacity is not None:
            from .expert_parallel import check_ep_options, local_expert_range

            check_ep_options(ep_group, ep_payload, ep_capacity, "MoESwiGLUExperts")
            if ep_group is not None:
                self.expert_offset, local = local_expert_range(num_experts, ep_group, "MoESwiGLUExperts")
        self.num_local_experts = local
        factory = dict(device=device, dtype=dtype)
        self.gate_up_weight = nn.Parameter(torch.empty(local, 2 * intermediate_size, hidden_size, **factory))
        self.down_weight = nn.Parameter(torch.empty(local, hidden_size, intermediate_size, **factory))
        if bias:
            keep = resolve_checkpoint_policy(o["checkpoint"])
            if not (keep[0] and keep[2]):
                raise ValueError(f"MoESwiGLUExperts: bias=True needs a checkpoint keeping gate_pre and up, got "
                                 f"checkpoint={o['checkpoint']!r}")
            self.gate_up_bias = nn.Parameter(torch.empty(local, 2 * intermediate_size, **factory))
            self.down_bias = nn.Parameter(torch.empty(local, hidden_size, **factory))
        else:
            self.register_parameter("gate_up_bias", None)
            self.register_parameter("down_bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's default init per expert: U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
        with torch.no_grad():
            for w in (self.gate_up_weight, self.down_weight):
                for e in range(self.num_local_experts):
                    nn.init.kaiming_uniform_(w[e], a=5 ** 0.5)
            for b, fan_in in ((self.gate_up_bias, self.hidden_size), (self.down_bias, self.intermediate_size)):
                if b is not None:  # nn.Linear's bias init: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
                    nn.init.uniform_(b, -fan_in ** -0.5, fan_in ** -0.5)

    def forward(self, x: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> Tensor:
        return moe_swiglu_experts_mxfp8(x, topk_ids, topk_weights, self.gate_up_weight, self.down_weight,
                                        gate_up_bias=self.gate_up_bias, down_bias=self.down_bias,
                                        ep_group=self.ep_group, ep_payload=self.ep_payload,
                                        ep_capacity=self.ep_capacity, **self.op_options())

    def extra_repr(self) -> str:
        o = self.effective_options()
        return (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}, checkpoint={o['checkpoint']!r}, "
                f"backend={o['backend']!r}, block_size={o['block_size']}")
