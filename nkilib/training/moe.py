"""The experts of Hugging Face sparse MoE blocks (Qwen3-MoE, Mixtral, GPT-OSS) on ``moe_swiglu_experts_mxfp8``.

transformers 5.x keeps a block's router (``gate``) and its forward, and calls
``experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])``; the experts module holds
``gate_up_proj`` [E, 2I, H] (per expert gate rows then up rows: its forward does
``linear(x, gate_up_proj[e]).chunk(2)``) and ``down_proj`` [E, H, I]. That is the MoE op's signature and
weight layout, so ``HFMoEExperts`` keeps the two Parameter objects under the same names (no copy, the
model's state-dict keys) and calls the op; the router and the block stay the model's, and the routing
weights stay differentiable (the op returns their gradient), so the router trains as before.

Recipe mapping: the module calls the op with ``recipe=`` (the op's one resolution path,
nkilib/recipe_call.py; ``moe_kwargs`` shows its result). The MoE op takes checkpoint, clamp_limits,
fp8_dtype, quant_scheme, weight_grad_dtype, matmul_precision, scale_rule, backend ("auto" = "emulate"
off Neuron devices, "neuron" on them) and lnc (None: on Neuron the op reads NEURON_LOGICAL_NC_CONFIG);
there is no ``forward_numerics="kernel"``: recipes asking for that are refused when the module is built.

torch.autocast: as HFSwiGLUMLP (nkilib/training/swiglu.py): under an enabled bfloat16 autocast the input
is cast to bf16 and the op runs with autocast disabled (its fp32 steps stay fp32, also in a backward run
inside autocast); the output has hidden_states' dtype, as the transformers experts' (they accumulate into
``zeros_like(hidden_states)``). fp32 ``main_grad`` (recipe.accumulate_main_grad, Megatron / NxD
convention): the MoE op has no main_grad option, so the module passes each expert weight that carries an
fp32 ``main_grad`` as an fp32 copy (``_Fp32MainGradCopy``): the op then writes fp32 weight gradients (its
math rounds the copy back to the same bf16 values, so the numbers are those of weight_grad_dtype=float32),
and the copy's backward adds them to ``main_grad`` with the dense op's contract (``.grad`` left alone,
or a zero ``.grad`` and ``grad_added_to_main_grad = True`` where that attribute exists). Cost: one fp32
copy of the expert weights per forward, kept until the backward.

Expert parallelism (``ep_group=``, patch_model's keyword): the E experts are sharded over the ep ranks of a
torch.distributed process group in contiguous ranges (rank r: experts r*E/ep .. (r+1)*E/ep - 1,
nkilib/experimental/moe_mxfp8/expert_parallel.py). The swapped module then holds new Parameters, under the
model's names, with only the rank's experts (a copy of the slice; the full weights are no longer referenced, so
build the optimizer after patching), and calls the op with ``ep_group``: each rank passes its own tokens, routed
by the model's router with global expert ids, and they travel to their experts' ranks by all-to-alls (MXFP8, or
bf16 with ep_payload="bf16"; split per rank, or padded to equal splits with ep_capacity, the op's keywords). State
dicts keep the model's keys; a rank's holds its experts' slices ([E/ep, ...] along the expert axis) under them;
``load_state_dict`` takes either those slices or the full [E, ...] tensors (a full checkpoint loads on every rank:
the module cuts its experts out). Every other parameter of the model stays replicated: its gradient is the rank's
tokens' share and needs the data-parallel all-reduce, which the rank-local expert parameters must stay out of
(patch_model's report lists them).
"""
from __future__ import annotations

import importlib.util

import torch
from torch import Tensor, nn

from ..core import options
from ..experimental.mlp_mxfp8.mlp_bwd_mxfp8.config import ClampLimits
from ..experimental.mlp_mxfp8.mlp_bwd_mxfp8.constants import MX_GROUP
from ..experimental.torch_common import MainGradSink, resolve_checkpoint_policy
from ..recipe import Recipe, as_recipe
from ..recipe_call import resolve_options
from .swiglu import SILU_CLASSES, RecipeModule, outside_autocast

__all__ = ["HFMoEExperts", "HFGptOssExperts", "moe_kwargs", "moe_op_available", "MOE_EXPERTS_CLASSES",
           "GPT_OSS_EXPERTS_CLASSES"]

#: transformers classes of concatenated-layout SwiGLU experts (gate_up_proj [E, 2I, H], down_proj [E, H, I]).
MOE_EXPERTS_CLASSES = ("Qwen3MoeExperts", "MixtralExperts")
#: transformers classes of GPT-OSS experts (interleaved gate_up_proj [E, H, 2I], biases, gelu_apprx_sigmoid gate).
GPT_OSS_EXPERTS_CLASSES = ("GptOssExperts",)
_MOE_OP_MODULE = "nkilib.experimental.moe_mxfp8.moe_bwd_mxfp8_torch"


def moe_op_available() -> bool:
    """Whether this build has ``moe_swiglu_experts_mxfp8``."""
    try:
        return importlib.util.find_spec(_MOE_OP_MODULE) is not None
    except ModuleNotFoundError:  # the moe_mxfp8 package itself is absent
        return False


def moe_kwargs(recipe: Recipe) -> dict:
    """Keyword arguments ``moe_swiglu_experts_mxfp8`` receives for `recipe` (the op's own resolution,
    nkilib/recipe_call.resolve_options), accumulate_main_grad aside (the module handles it, see the module
    docstring).

    Raises:
        ValueError: a recipe field the MoE op has no counterpart for (named).
    """
    from ..experimental.moe_mxfp8 import moe_swiglu_experts_mxfp8

    return resolve_options(moe_swiglu_experts_mxfp8, _op_recipe(as_recipe(recipe)), {})


def _op_recipe(recipe: Recipe) -> Recipe:
    return recipe.replace(accumulate_main_grad=False) if recipe.accumulate_main_grad else recipe


class _Fp32MainGradCopy(MainGradSink):
    """param -> an fp32 copy of it whose gradient goes to ``param.main_grad`` (the dense op's sink contract,
    whose backward this inherits)."""

    @staticmethod
    def forward(ctx, param):
        ctx.param = param
        return param.detach().to(torch.float32, copy=True)


def _main_grad_operand(param: nn.Parameter) -> Tensor:
    """`param` itself, or its fp32 main_grad copy when it carries an fp32 main_grad and needs a gradient."""
    main_grad = getattr(param, "main_grad", None)
    if main_grad is None or not (torch.is_grad_enabled() and param.requires_grad):
        return param
    if not isinstance(main_grad, Tensor) or main_grad.dtype != torch.float32 or main_grad.shape != param.shape:
        got = (f"{main_grad.dtype} {tuple(main_grad.shape)}" if isinstance(main_grad, Tensor)
               else type(main_grad).__name__)
        raise ValueError(f"experts parameter main_grad must be a float32 tensor of shape {tuple(param.shape)} "
                         f"(accumulate_main_grad=True), got {got}")
    return _Fp32MainGradCopy.apply(param)


class _ExpertShard(RecipeModule, nn.Module):
    """Base of the swapped experts modules: this rank's slice of the model's expert Parameters under ep_group.

    Attributes set by ``_take_experts``: ep_group (None: all experts here), num_experts (E, global),
    expert_offset (the first local expert's global id), num_local_experts (E/ep).
    """

    def _take_experts(self, experts: nn.Module, names: tuple, ep_group, where: str, ep_payload: str,
                      ep_capacity) -> None:
        """Hold `experts`' Parameters `names` (leading axis E): the same objects, or with ep_group new Parameters
        holding a copy of this rank's slice (E divisible by the group size, else ValueError naming `where`);
        ep_payload / ep_capacity: the op's (checked by expert_parallel.check_ep_options)."""
        from ..experimental.moe_mxfp8.expert_parallel import check_ep_options

        check_ep_options(ep_group, ep_payload, ep_capacity, where)
        params = [getattr(experts, n) for n in names]
        self.ep_group, self.ep_payload, self.ep_capacity = ep_group, ep_payload, ep_capacity
        self.num_experts = params[0].shape[0]
        self.expert_offset, self.num_local_experts = 0, self.num_experts
        self._expert_param_names = names
        if ep_group is not None:
            from ..experimental.moe_mxfp8.expert_parallel import local_expert_range

            self.expert_offset, self.num_local_experts = local_expert_range(self.num_experts, ep_group, where,
                                                                            f"{names[0]}.shape[0]")
            local = slice(self.expert_offset, self.expert_offset + self.num_local_experts)
            params = [nn.Parameter(p.detach()[local].clone(), requires_grad=p.requires_grad) for p in params]
        for n, p in zip(names, params):
            setattr(self, n, p)

    def _run_op(self, x: Tensor, ids: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor, **kwargs) -> Tensor:
        """moe_swiglu_experts_mxfp8 on all experts, or on this rank's under ep_group with ep_payload and
        ep_capacity (kwargs: the op's resolved keywords, no recipe)."""
        from ..experimental.moe_mxfp8 import moe_swiglu_experts_mxfp8

        return moe_swiglu_experts_mxfp8(x, ids, weights, gate_up, down, ep_group=self.ep_group,
                                        ep_payload=self.ep_payload, ep_capacity=self.ep_capacity, **kwargs)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """Under ep_group, full [E, ...] expert tensors load as this rank's slice (a rank's own slices load as is)."""
        if self.ep_group is not None and self.num_local_experts != self.num_experts:
            local = slice(self.expert_offset, self.expert_offset + self.num_local_experts)
            for n in self._expert_param_names:
                v = state_dict.get(prefix + n)
                if isinstance(v, Tensor) and v.dim() and v.shape[0] == self.num_experts:
                    state_dict[prefix + n] = v[local]
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _ep_repr(self) -> str:
        return "" if self.ep_group is None else (f", ep_group size {self.num_experts // self.num_local_experts}, "
                                                 f"local experts {self.expert_offset}.."
                                                 f"{self.expert_offset + self.num_local_experts - 1}, "
                                                 f"ep_payload={self.ep_payload!r}, ep_capacity={self.ep_capacity!r}")


def check_hf_experts(experts: nn.Module, where: str) -> None:
    """Raise ValueError (naming `where`) unless `experts` holds SiLU SwiGLU experts the op accepts."""
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not isinstance(gate_up, nn.Parameter) or not isinstance(down, nn.Parameter) or gate_up.dim() != 3 or \
            down.dim() != 3:
        raise ValueError(f"{where} must hold 3-D parameters gate_up_proj [E, 2I, H] and down_proj [E, H, I]")
    n_e, two_i, h = gate_up.shape
    if two_i % 2 or tuple(down.shape) != (n_e, h, two_i // 2):
        raise ValueError(f"{where}: gate_up_proj must be [E, 2I, H] and down_proj [E, H, I]; got "
                         f"{tuple(gate_up.shape)} and {tuple(down.shape)}")
    if h % MX_GROUP or (two_i // 2) % MX_GROUP:
        raise ValueError(f"{where}: hidden size and expert intermediate size must be multiples of {MX_GROUP}, got "
                         f"H={h}, I={two_i // 2}")
    if type(getattr(experts, "act_fn", None)).__name__ not in SILU_CLASSES:
        raise ValueError(f"{where}.act_fn must be SiLU (hidden_act='silu'), got {type(experts.act_fn).__name__}")


class HFMoEExperts(_ExpertShard):
    """Drop-in replacement of a transformers experts module (Qwen3MoeExperts, MixtralExperts).

    Dimensions:
        hidden_states [T, H], top_k_index [T, k] (int, global expert ids), top_k_weights [T, k] -> [T, H] in
        hidden_states' dtype; gate_up_proj [E, 2I, H], down_proj [E, H, I] ([E/ep, ...] under ep_group).

    Args:
        experts: the model's experts module (its two Parameters are kept, not copied; under ep_group replaced by
            this rank's slices, module docstring).
        recipe: a Recipe, a preset name or None (the default preset).
        where: the module's qualified name, for error messages.
        ep_group: None, or the expert-parallel torch.distributed process group (module docstring).
        ep_payload: under ep_group, how x and dY travel: "mxfp8" (codes + scales) or "bf16" (bit-identical to
            the single-process op, twice the bytes); the op's ep_payload.
        ep_capacity: under ep_group, None (by the group's backend), "exact", "auto" or an int: the op's
            ep_capacity (padded, equal-split all-to-alls).
    """

    def __init__(self, experts: nn.Module, recipe=None, where: str = "experts", ep_group=None,
                 ep_payload: str = "mxfp8", ep_capacity=None):
        super().__init__()
        check_hf_experts(experts, where)
        self._take_experts(experts, ("gate_up_proj", "down_proj"), ep_group, where, ep_payload, ep_capacity)
        self.act_fn = nn.SiLU()  # documents the math; the op applies it
        self.set_recipe(recipe)  # refuse an unsupported recipe now, not at the first forward

    def _check_recipe(self, recipe: Recipe) -> None:
        moe_kwargs(recipe)

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        weights = (self.gate_up_proj, self.down_proj)
        if self.recipe.accumulate_main_grad:
            weights = tuple(_main_grad_operand(w) for w in weights)
        with outside_autocast(hidden_states) as x_op:
            y = self._run_op(x_op, top_k_index, top_k_weights, *weights, **moe_kwargs(self.recipe))
        return y.to(hidden_states.dtype)

    def extra_repr(self) -> str:
        _, two_i, h = self.gate_up_proj.shape
        return (f"num_experts={self.num_experts}, hidden_size={h}, intermediate_size={two_i // 2}, "
                f"{self._recipe_repr()}{self._ep_repr()}")


class HFGptOssExperts(_ExpertShard):
    """Drop-in replacement of transformers' GptOssExperts on ``moe_swiglu_experts_mxfp8`` (activation "gpt_oss").

    GPT-OSS's experts (transformers' GptOssExperts.forward, per routed pair (t, j), e = index, p = weight):
        gate_up = x[t] gate_up_proj[e] + gate_up_proj_bias[e];  gate, up = gate_up[::2], gate_up[1::2]
        h = clamp(gate, max=limit) * sigmoid(alpha clamp(gate, max=limit)) * (clamp(up, -limit, limit) + 1)
        y[t] += p * (h down_proj[e] + down_proj_bias[e])
    with alpha = 1.702: the op's activation "gpt_oss" with ClampLimits(non_linear_upper=limit,
    linear_lower=-limit, linear_upper=limit). The router (GptOssTopKRouter) and the block (GptOssMLP) stay the
    model's; they call ``experts(hidden [T, H], router_indices [T, k], routing_weights [T, k])``.

    Parameters: the model's four, the same objects under the same names (state-dict keys unchanged, no copy
    held). Layout at the call: down_proj [E, I, H] enters the op as its transpose view [E, H, I]; gate_up_proj
    [E, H, 2I] interleaves gate and up columns, which no strided view turns into the op's [E, 2I, H] gate-then-up
    rows, so each forward de-interleaves it (one copy of E*H*2I elements, then the op's bf16 cast; its gradient
    re-interleaves through autograd, one more copy) and likewise the [E, 2I] bias. The down bias is added in
    float32 torch ops outside the op (autograd: d_down_proj_bias = sum over pairs of p dY, and <dY, bias> added
    to the routing-weight gradient).

    Recipe: moe_kwargs(recipe), with clamp_limits replaced by the module's limit and activation; the checkpoint
    policy must keep gate_pre and up (they hold the bias); any backend (the kernel returns the gate_up bias
    gradient, moe_backward_mxfp8_nki's gate_up_bias_grad).

    Expert parallelism (ep_group): the four Parameters become this rank's slices (module docstring), the biases
    included: the op takes them as the local experts' and their gradients stay on this rank.

    Args:
        experts: the model's GptOssExperts.
        recipe: a Recipe, a preset name or None (the default preset).
        where: the module's qualified name, for error messages.
        ep_group: None, or the expert-parallel torch.distributed process group (module docstring).
        ep_payload, ep_capacity: under ep_group, as HFMoEExperts.
    """

    def __init__(self, experts: nn.Module, recipe=None, where: str = "experts", ep_group=None,
                 ep_payload: str = "mxfp8", ep_capacity=None):
        super().__init__()
        names = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
        params = [getattr(experts, n, None) for n in names]
        if not all(isinstance(p, nn.Parameter) for p in params):
            raise ValueError(f"{where} must hold Parameters {list(names)}")
        gate_up, gate_up_bias, down, down_bias = params
        n_e, h, two_i = gate_up.shape if gate_up.dim() == 3 else (0, 0, 1)
        if not n_e or two_i % 2 or tuple(down.shape) != (n_e, two_i // 2, h) or \
                tuple(gate_up_bias.shape) != (n_e, two_i) or tuple(down_bias.shape) != (n_e, h):
            raise ValueError(f"{where}: want gate_up_proj [E, H, 2I], gate_up_proj_bias [E, 2I], down_proj [E, I, H], "
                             f"down_proj_bias [E, H]; got {[tuple(p.shape) for p in params]}")
        if h % MX_GROUP or (two_i // 2) % MX_GROUP:
            raise ValueError(f"{where}: hidden size and intermediate size must be multiples of {MX_GROUP}, got "
                             f"H={h}, I={two_i // 2}")
        alpha = float(getattr(experts, "alpha", float("nan")))
        if alpha != options.GATE_ALPHAS["gpt_oss"]:
            raise ValueError(f"{where}.alpha (swiglu_alpha) must be {options.GATE_ALPHAS['gpt_oss']} (the slope of "
                             f"ScalarE's gelu_apprx_sigmoid), got {alpha}")
        limit = getattr(experts, "limit", None)
        self.clamp_limits = ClampLimits(non_linear_upper=limit, linear_lower=None if limit is None else -limit,
                                        linear_upper=limit, activation="gpt_oss")
        self._take_experts(experts, names, ep_group, where, ep_payload, ep_capacity)
        self.hidden_size, self.intermediate_size = h, two_i // 2
        self.alpha, self.limit = alpha, limit
        self.where = where
        self.set_recipe(recipe)  # refuse an unsupported recipe now, not at the first forward

    def _check_recipe(self, recipe: Recipe) -> None:
        self._op_kwargs(recipe)

    def _op_kwargs(self, recipe: Recipe | None = None) -> dict:
        """The op's keywords for `recipe` (None: the one held): moe_kwargs with the module's clamp_limits.

        Raises:
            ValueError: a recipe field the op has no counterpart for, or a checkpoint policy that drops gate_pre or
                up (both hold the gate_up bias).
        """
        kwargs = dict(moe_kwargs(self.recipe if recipe is None else recipe), clamp_limits=self.clamp_limits)
        keep = resolve_checkpoint_policy(kwargs["checkpoint"])
        if not (keep[0] and keep[2]):
            raise ValueError(f"{self.where}: GPT-OSS experts need a recipe whose checkpoint keeps gate_pre and up "
                             f"(they hold the gate_up bias), got checkpoint={kwargs['checkpoint']!r}")
        return kwargs

    def _op_weights(self) -> tuple:
        """(gate_up_weight [E, 2I, H] gate rows then up rows, down_weight [E, H, I] view, gate_up_bias [E, 2I])."""
        n_e, h, n_i = self.num_local_experts, self.hidden_size, self.intermediate_size
        # [E, H, I, 2] (last: gate, up) -> [E, 2, I, H] -> [E, 2I, H]: a copy (the interleave is not one stride)
        gate_up = self.gate_up_proj.view(n_e, h, n_i, 2).permute(0, 3, 2, 1).reshape(n_e, 2 * n_i, h)
        bias = self.gate_up_proj_bias.view(n_e, n_i, 2).transpose(1, 2).reshape(n_e, 2 * n_i)
        return gate_up, self.down_proj.transpose(1, 2), bias

    def forward(self, hidden_states: Tensor, router_indices: Tensor, routing_weights: Tensor) -> Tensor:
        gate_up, down, gate_up_bias = self._op_weights()
        with outside_autocast(hidden_states) as x_op:
            y = self._run_op(x_op, router_indices, routing_weights, gate_up, down, gate_up_bias=gate_up_bias,
                             down_bias=self.down_proj_bias, **self._op_kwargs())
        return y.to(hidden_states.dtype)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}, alpha={self.alpha}, limit={self.limit}, "
                f"{self._recipe_repr()}{self._ep_repr()}")
