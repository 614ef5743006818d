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
It saves the checkpoints the policy keeps, one row per routed pair ([T, k, I] bf16):
"all", "none" or any subset of (gate_pre, gate_act, up, intermediate). Policies that keep gate_pre and
up give gradients bit-identical to "all"; without them the backward recomputes the projections as
MX matmuls (K = H), which differ from the forward's BF16 matmuls by about the MXFP8 error.

Backward: the MoE expert backward of docs/moe.md, returning dX (x's dtype), d_topk_weights
(topk_weights' dtype, computed in fp32), d_gate_up_weight and d_down_weight (parameter dtypes; the
kernel writes them in weight_grad_dtype: float32 when a parameter is float32, else bf16).

Backends (``backend=``):
    "emulate": pure torch, bit-identical to reference.moe_backward_reference(mode="mx_exact"), on any
        device (CPU, CUDA).
    "simulator": the NKI kernel (moe_bwd_mxfp8_kernel.moe_backward_mxfp8_nki, LNC1) on the CPU simulator
        (torch -> numpy -> torch; the routing becomes routing.build_block_layout; slow, for correctness;
        bit-identical to "emulate"; scale_rule "neuron" only).
    "auto": "emulate" (fast on any device).
    "neuron": not in this release (NotImplementedError).

Input checks: shapes, dtypes and devices before the op (errors name the argument); the routing's
values (ids in [0, E), no id twice in a token, finite weights) inside the op, on the actual data
(this reads topk_ids / topk_weights back to the host once per forward).

Registration: torch.library custom ops ``nkilib::moe_swiglu_experts_mxfp8`` (forward, autograd
registered) and ``nkilib::moe_swiglu_experts_mxfp8_backward``, both with fake implementations, so the
function works under torch.compile (fullgraph) and passes torch.library.opcheck.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from ...core import options
from ...recipe_call import UNSET, accepts_recipe, effective_options, explicit_options
from ..mlp_mxfp8.mlp_bwd_mxfp8 import mlp_bwd_mxfp8_emulate as dense_emu
from ..mlp_mxfp8.mlp_bwd_mxfp8.constants import MX_GROUP
from ..mlp_mxfp8.mlp_bwd_mxfp8.mlp_bwd_mxfp8_neuron import kernel_kwargs
from ..mlp_mxfp8.mlp_bwd_mxfp8.mlp_bwd_mxfp8_torch import (CHECKPOINT_NAMES, _from_numpy, _to_numpy, _weight_grad_name,
                                                           check_numeric_options, resolve_checkpoint_policy)
from . import routing
from .constants import DEFAULT_BLOCK_SIZE
from .moe_bwd_mxfp8_emulate import moe_backward_emulate

__all__ = ["moe_swiglu_experts_mxfp8", "MoESwiGLUExperts", "BACKENDS", "UNAVAILABLE_BACKENDS", "resolve_backend"]

#: backend= values accepted in this release.
BACKENDS = ("auto", "emulate", "simulator")
#: Backends not in this release (the kernel on a Neuron device).
UNAVAILABLE_BACKENDS = ("neuron",)
_PARAM_DTYPES = (torch.bfloat16, torch.float32)
_NO_KERNEL = ("the NKI MoE kernel does not run on a Neuron device in this release; use backend='simulator' (the "
              "kernel on the CPU simulator) or backend='emulate', the pure-torch implementation of exactly the "
              "kernel's numerics")


def resolve_backend(backend) -> str:
    """'auto' -> 'emulate'; 'emulate' / 'simulator' as is; 'neuron' -> NotImplementedError; anything else ->
    ValueError."""
    if backend in UNAVAILABLE_BACKENDS:
        raise NotImplementedError(f"moe_swiglu_experts_mxfp8: backend={backend!r} is not available: {_NO_KERNEL}")
    if backend not in BACKENDS:
        raise ValueError(f"moe_swiglu_experts_mxfp8: backend must be one of {BACKENDS}, got {backend!r}")
    return "emulate" if backend == "auto" else backend


def _check_inputs(x, topk_ids, topk_weights, gate_up_weight, down_weight) -> tuple:
    """Shapes / dtypes / devices; returns (T, H, I, E, k)."""
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


def _forward_math(x2, ids, w, w_gu, w_down, clamps):
    """y [T, H] (x2's dtype) and the bf16 checkpoints [T, k, I] of the clamped SwiGLU experts."""
    bf, f32 = torch.bfloat16, torch.float32
    t, h_dim = x2.shape
    k = ids.shape[1]
    e_num, two_i, _ = w_gu.shape
    n_i = two_i // 2
    xb, wgu, wd = x2.to(bf), w_gu.to(bf), w_down.to(bf)
    flat = ids.reshape(-1).to(torch.int64)
    p = w.reshape(-1).to(f32)
    ckpts = [x2.new_zeros((t * k, n_i), dtype=bf) for _ in CHECKPOINT_NAMES]
    y = torch.zeros(t, h_dim, dtype=f32, device=x2.device)
    clamp_dict = dict(zip(options.CLAMP_NAMES, clamps))
    for e in range(e_num):
        slots = torch.nonzero(flat == e).squeeze(1)
        if slots.numel() == 0:
            continue
        tok = slots // k
        x_e = xb[tok]
        gate_pre = x_e @ wgu[e, :n_i].t()  # K = H, M = tokens of e, N = I
        up = x_e @ wgu[e, n_i:].t()  # K = H, M = tokens of e, N = I
        gate_act, inter = dense_emu.swiglu_activations(gate_pre, up, clamp_dict)
        hs = (inter.to(f32) * p[slots, None]).to(bf)
        y.index_add_(0, tok, (hs @ wd[e].t()).to(f32))  # K = I, M = tokens of e, N = H
        for c, v in zip(ckpts, (gate_pre, gate_act, up, inter)):
            c[slots] = v
    return (y.to(x2.dtype), *(c.reshape(t, k, n_i) for c in ckpts))


# ----------------------------------------------------------------------------------------------
# custom ops
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("nkilib::moe_swiglu_experts_mxfp8_backward", mutates_args=())
def moe_swiglu_experts_mxfp8_backward_op(
    output_grad: Tensor, hidden_states: Tensor, topk_ids: Tensor, topk_weights: Tensor, gate_up_weight: Tensor,
    down_weight: Tensor, gate_pre: Optional[Tensor], gate_act: Optional[Tensor], up: Optional[Tensor],
    intermediate: Optional[Tensor], gate_lower: Optional[float], gate_upper: Optional[float],
    up_lower: Optional[float], up_upper: Optional[float], fp8_dtype: str, quant_scheme: str, matmul_precision: str,
    scale_rule: str, weight_grad_dtype: str, block_size: int, backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The MoE expert backward on [T, H] / [T, k] operands (reference.moe_backward_reference's meaning).

    Dimensions:
        output_grad / hidden_states [T, H], topk_ids / topk_weights [T, k], gate_up_weight [E, 2I, H],
        down_weight [E, H, I], checkpoints [T, k, I] or None -> (dX [T, H] bf16, d_topk_weights [T, k]
        float32, dW_gate_up [E, 2I, H], dW_down [E, H, I] in weight_grad_dtype).
    """
    if backend == "simulator":
        return _simulator_backward(output_grad, hidden_states, topk_ids, topk_weights, gate_up_weight, down_weight,
                                   (gate_pre, gate_act, up, intermediate), (gate_lower, gate_upper, up_lower, up_upper),
                                   fp8_dtype, quant_scheme, matmul_precision, scale_rule, weight_grad_dtype, block_size)
    if backend != "emulate":
        raise NotImplementedError(f"nkilib::moe_swiglu_experts_mxfp8_backward: backend={backend!r}: {_NO_KERNEL}")
    outs = moe_backward_emulate(
        output_grad, hidden_states, topk_ids, topk_weights, gate_up_weight, down_weight, gate_pre, gate_act, up,
        intermediate, block_size=block_size,
        clamp_limits=dict(zip(options.CLAMP_NAMES, (gate_lower, gate_upper, up_lower, up_upper))),
        fp8_dtype=fp8_dtype, quant_scheme=quant_scheme, matmul_precision=matmul_precision,
        weight_grad_dtype=getattr(torch, weight_grad_dtype), scale_rule=scale_rule)
    return tuple(o.contiguous() for o in outs)


def _simulator_backward(dy, x, ids, w, w_gu, w_down, ckpts, clamps, fp8, scheme, precision, scale_rule, wg,
                        block_size):
    """moe_backward_mxfp8_nki on the NKI CPU simulator (LNC1): torch -> numpy, the block layout of the
    routing, the kernel, numpy -> torch (outputs on dy's device)."""
    if scale_rule != "neuron":
        raise ValueError(f"scale_rule={scale_rule!r} is only available with backend='emulate'; the kernel (and so the "
                         f"simulator) uses quantize_mx's 'neuron' rule")
    import nki
    import nki.language as nl

    from .moe_bwd_mxfp8_kernel import moe_backward_mxfp8_nki

    layout = routing.build_block_layout(_to_numpy(ids), w_gu.shape[0], block_size)
    t, k, n_i = ids.shape[0], ids.shape[1], w_gu.shape[1] // 2
    kw = kernel_kwargs(nl, [None if c is None else _to_numpy(c.to(torch.bfloat16)).reshape(t, k, n_i) for c in ckpts],
                       clamps, fp8, scheme, precision, wg)
    outs = nki.simulate(moe_backward_mxfp8_nki)[1](
        output_grad=_to_numpy(dy.to(torch.bfloat16)), hidden_states=_to_numpy(x.to(torch.bfloat16)),
        topk_weights=_to_numpy(w.to(torch.float32)), gate_up_weight=_to_numpy(w_gu.to(torch.bfloat16)),
        down_weight=_to_numpy(w_down.to(torch.bfloat16)), token_position_to_id=layout.token_position_to_id,
        token_position_to_slot=layout.token_position_to_slot, expert_block_offsets=layout.expert_block_offsets,
        block_size=block_size, run_with_lnc2=False, **kw)
    return tuple(_from_numpy(o, dy.device).contiguous() for o in outs)


@moe_swiglu_experts_mxfp8_backward_op.register_fake
def _backward_fake(output_grad, hidden_states, topk_ids, topk_weights, gate_up_weight, down_weight, *rest):
    wg = getattr(torch, rest[-3])
    return (hidden_states.new_empty(hidden_states.shape, dtype=torch.bfloat16),
            topk_weights.new_empty(topk_weights.shape, dtype=torch.float32),
            gate_up_weight.new_empty(gate_up_weight.shape, dtype=wg),
            down_weight.new_empty(down_weight.shape, dtype=wg))


@torch.library.custom_op("nkilib::moe_swiglu_experts_mxfp8", mutates_args=())
def moe_swiglu_experts_mxfp8_op(
    x: Tensor, topk_ids: Tensor, topk_weights: Tensor, gate_up_weight: Tensor, down_weight: Tensor,
    gate_lower: Optional[float], gate_upper: Optional[float], up_lower: Optional[float], up_upper: Optional[float],
    fp8_dtype: str, quant_scheme: str, matmul_precision: str, scale_rule: str, weight_grad_dtype: str,
    block_size: int, backend: str, save_gate_pre: bool, save_gate_act: bool, save_up: bool, save_intermediate: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Forward on x [T, H], topk_ids / topk_weights [T, k]: (y [T, H] in x's dtype, gate_pre, gate_act, up,
    intermediate [T, k, I] bf16). Validates the routing's values first. The options after the clamps are
    carried for the backward; the save_* flags choose what the autograd formula keeps."""
    _check_routing_values(topk_ids, topk_weights, gate_up_weight.shape[0])
    return _forward_math(x, topk_ids, topk_weights, gate_up_weight, down_weight,
                         (gate_lower, gate_upper, up_lower, up_upper))


@moe_swiglu_experts_mxfp8_op.register_fake
def _forward_fake(x, topk_ids, topk_weights, gate_up_weight, down_weight, *args):
    t, k, n_i = x.shape[0], topk_ids.shape[1], gate_up_weight.shape[1] // 2
    ck = [x.new_empty((t, k, n_i), dtype=torch.bfloat16) for _ in CHECKPOINT_NAMES]
    return (x.new_empty((t, down_weight.shape[1])), *ck)


_N_OPTIONS = 11  # clamps (4), fp8, scheme, precision, scale_rule, wg, block_size, backend


def _setup_context(ctx, inputs, output):
    x, ids, w, w_gu, w_down = inputs[:5]
    keep = inputs[5 + _N_OPTIONS:]
    _, *ckpts = output
    ctx.mark_non_differentiable(*ckpts)
    ctx.save_for_backward(x, ids, w, w_gu, w_down, *[c if k else None for c, k in zip(ckpts, keep)])
    ctx.options = inputs[5:5 + _N_OPTIONS]


def _backward(ctx, grad_y, *unused_checkpoint_grads):
    x, ids, w, w_gu, w_down, *ckpts = ctx.saved_tensors
    bf = torch.bfloat16
    dx, d_w, dw_gu, dw_down = moe_swiglu_experts_mxfp8_backward_op(
        grad_y.to(bf), x.to(bf), ids, w, w_gu.to(bf), w_down.to(bf), *ckpts, *ctx.options)
    grads = (dx.to(x.dtype), None, d_w.to(w.dtype), dw_gu.to(w_gu.dtype), dw_down.to(w_down.dtype))
    return grads + (None,) * (_N_OPTIONS + len(CHECKPOINT_NAMES))


moe_swiglu_experts_mxfp8_op.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------------


@accepts_recipe(label="MoE experts", ignores=("lnc",))
def moe_swiglu_experts_mxfp8(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, gate_up_weight: Tensor,
                             down_weight: Tensor, *, checkpoint="all", clamp_limits=None, fp8_dtype="float8_e4m3fn",
                             quant_scheme="1x32", weight_grad_dtype=None, matmul_precision="mxfp8",
                             scale_rule="neuron", block_size: int = DEFAULT_BLOCK_SIZE, backend="auto") -> Tensor:
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
        clamp_limits: ClampLimits (or a dict of its fields) of a clamped SwiGLU (GPT-OSS), or None.
        fp8_dtype: "float8_e4m3fn" (default) or "float8_e5m2" (or the torch float8 dtype).
        quant_scheme: "1x32" (default) or "wrapX".
        weight_grad_dtype: None (float32 if a parameter is float32, else bfloat16), torch.bfloat16 or torch.float32.
        matmul_precision: "mxfp8" (Trn3, default) or "bf16" (Trn2's path).
        scale_rule: "neuron" (quantize_mx's rule, default), "rceil" or "ocp_floor" (studies).
        block_size: B of the kernel's block layout (multiple of 128, <= 512); fixes the order of the
            weight-gradient sums.
        backend: "auto" (= "emulate"), "emulate" or "simulator" ("neuron": NotImplementedError in this release).
        recipe: a nkilib Recipe or preset name (nkilib/recipe.py) giving the options above; explicit
            keywords override its fields (nkilib/recipe_call.py). Its ``lnc`` is ignored; a recipe with
            forward_numerics="kernel" or accumulate_main_grad=True is refused (no such option here).

    Returns:
        y [..., H] in x's dtype.

    Raises:
        TypeError / ValueError: wrong types, shapes, dtypes, devices, option values, routing values
            (ids out of range, negative or repeated within a token; non-finite weights).
        NotImplementedError: backend "neuron" (not in this release).
    """
    t, h, _, e, k = _check_inputs(x, topk_ids, topk_weights, gate_up_weight, down_weight)
    resolved = resolve_backend(backend)
    keep = resolve_checkpoint_policy(checkpoint)
    clamps, fp8 = check_numeric_options(clamp_limits, fp8_dtype, quant_scheme, matmul_precision, scale_rule)
    wg = _weight_grad_name(weight_grad_dtype, gate_up_weight, down_weight)
    b = routing.check_block_size(block_size)
    y2, *_ = moe_swiglu_experts_mxfp8_op(
        x.reshape(t, h), topk_ids.reshape(t, k), topk_weights.reshape(t, k), gate_up_weight, down_weight, *clamps,
        fp8, quant_scheme, matmul_precision, scale_rule, wg, b, resolved, *keep)
    return y2.reshape(x.shape)


class MoESwiGLUExperts(nn.Module):
    """E SwiGLU experts applied to routed tokens, with the MXFP8 MoE backward (``moe_swiglu_experts_mxfp8``).

    Parameters (per expert the nn.Linear layout, initialised like nn.Linear without bias):
        gate_up_weight [E, 2I, H] (gate rows 0..I-1, up rows I..2I-1), down_weight [E, H, I].

    Args:
        num_experts: E.
        hidden_size: H (multiple of 32).
        intermediate_size: I (multiple of 32).
        recipe: a nkilib Recipe or preset name, or None (the op's defaults).
        checkpoint, backend, clamp_limits, fp8_dtype, quant_scheme, weight_grad_dtype, matmul_precision,
            scale_rule, block_size: as in ``moe_swiglu_experts_mxfp8``; left unset, the recipe's value (or
            without a recipe the op's default); given, they override the recipe.
        device, dtype: of the parameters (bfloat16 or float32).

    forward(x [..., H], topk_ids [..., k], topk_weights [..., k]) -> y [..., H].
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, recipe=None,
                 checkpoint=UNSET, backend=UNSET, clamp_limits=UNSET, fp8_dtype=UNSET, quant_scheme=UNSET,
                 weight_grad_dtype=UNSET, matmul_precision=UNSET, scale_rule=UNSET, block_size=UNSET, device=None,
                 dtype=None):
        super().__init__()
        if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts <= 0:
            raise ValueError(f"MoESwiGLUExperts: num_experts must be a positive integer, got {num_experts!r}")
        for name, v in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0 or v % MX_GROUP:
                raise ValueError(f"MoESwiGLUExperts: {name} must be a positive multiple of {MX_GROUP}, got {v!r}")
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.recipe = recipe
        self.options = explicit_options(checkpoint=checkpoint, backend=backend, clamp_limits=clamp_limits,
                                        fp8_dtype=fp8_dtype, quant_scheme=quant_scheme,
                                        weight_grad_dtype=weight_grad_dtype, matmul_precision=matmul_precision,
                                        scale_rule=scale_rule, block_size=block_size)
        o = self.effective_options()  # the recipe and its overrides resolved now: errors at construction
        resolve_checkpoint_policy(o["checkpoint"])
        resolve_backend(o["backend"])
        routing.check_block_size(o["block_size"])
        factory = dict(device=device, dtype=dtype)
        self.gate_up_weight = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size, **factory))
        self.down_weight = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, **factory))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's default init per expert: U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
        with torch.no_grad():
            for w in (self.gate_up_weight, self.down_weight):
                for e in range(self.num_experts):
                    nn.init.kaiming_uniform_(w[e], a=5 ** 0.5)

    def forward(self, x: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> Tensor:
        return moe_swiglu_experts_mxfp8(x, topk_ids, topk_weights, self.gate_up_weight, self.down_weight,
                                        recipe=self.recipe, **self.options)

    def effective_options(self) -> dict:
        """Every option of the op as forward uses it (the recipe, then the explicit options, then defaults)."""
        return effective_options(moe_swiglu_experts_mxfp8, self.recipe, self.options)

    def extra_repr(self) -> str:
        o = self.effective_options()
        return (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}, checkpoint={o['checkpoint']!r}, "
                f"backend={o['backend']!r}, block_size={o['block_size']}")
