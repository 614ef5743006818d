"""The experts of Hugging Face sparse MoE blocks (Qwen3-MoE, Mixtral) on ``moe_swiglu_experts_mxfp8``.

transformers 5.x keeps a block's router (``gate``) and its forward, and calls
``experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])``; the experts module holds
``gate_up_proj`` [E, 2I, H] (per expert gate rows then up rows: its forward does
``linear(x, gate_up_proj[e]).chunk(2)``) and ``down_proj`` [E, H, I]. That is the MoE op's signature and
weight layout, so ``HFMoEExperts`` keeps the two Parameter objects under the same names (no copy, the
model's state-dict keys) and calls the op; the router and the block stay the model's, and the routing
weights stay differentiable (the op returns their gradient), so the router trains as before.

Recipe mapping (``moe_kwargs``): the MoE op takes checkpoint, clamp_limits, fp8_dtype, quant_scheme,
weight_grad_dtype, matmul_precision, scale_rule and backend ("auto" = "emulate" off Neuron devices,
"neuron" on them). The recipe's ``lnc`` is not passed (on Neuron the op reads NEURON_LOGICAL_NC_CONFIG);
there is no ``forward_numerics="kernel"`` and no ``accumulate_main_grad``: recipes asking for those are
refused when the module is built.
"""
from __future__ import annotations

import contextlib
import importlib.util

import torch
from torch import Tensor, nn

from ..experimental.mlp_mxfp8.mlp_bwd_mxfp8.constants import MX_GROUP
from ..recipe import Recipe, as_recipe
from .swiglu import SILU_CLASSES, autocast_input

__all__ = ["HFMoEExperts", "moe_kwargs", "moe_op_available", "MOE_EXPERTS_CLASSES"]

#: transformers classes of concatenated-layout SwiGLU experts (gate_up_proj [E, 2I, H], down_proj [E, H, I]).
MOE_EXPERTS_CLASSES = ("Qwen3MoeExperts", "MixtralExperts")
_MOE_OP_MODULE = "nkilib.experimental.moe_mxfp8.moe_bwd_mxfp8_torch"
_MOE_FIELDS = ("checkpoint", "clamp_limits", "fp8_dtype", "quant_scheme", "weight_grad_dtype", "matmul_precision",
               "scale_rule", "backend")


def moe_op_available() -> bool:
    """Whether this build has ``moe_swiglu_experts_mxfp8``."""
    try:
        return importlib.util.find_spec(_MOE_OP_MODULE) is not None
    except ModuleNotFoundError:  # the moe_mxfp8 package itself is absent
        return False


def moe_kwargs(recipe: Recipe) -> dict:
    """Keyword arguments of ``moe_swiglu_experts_mxfp8`` for `recipe` (module docstring).

    Raises:
        ValueError: a recipe field the MoE op has no counterpart for (named).
    """
    if recipe.forward_numerics != "torch":
        raise ValueError(f"Recipe.forward_numerics={recipe.forward_numerics!r} is not available for MoE experts "
                         f"(moe_swiglu_experts_mxfp8 has a BF16 torch forward only)")
    if recipe.accumulate_main_grad:
        raise ValueError("Recipe.accumulate_main_grad=True is not available for MoE experts "
                         "(moe_swiglu_experts_mxfp8 has no main_grad option)")
    kwargs = recipe.to_kwargs()
    return {name: kwargs[name] for name in _MOE_FIELDS}


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


class HFMoEExperts(nn.Module):
    """Drop-in replacement of a transformers experts module (Qwen3MoeExperts, MixtralExperts).

    Dimensions:
        hidden_states [T, H], top_k_index [T, k] (int), top_k_weights [T, k] -> [T, H] in hidden_states' dtype;
        gate_up_proj [E, 2I, H], down_proj [E, H, I].

    Args:
        experts: the model's experts module (its two Parameters are kept, not copied).
        recipe: a Recipe, a preset name or None (the default preset).
        where: the module's qualified name, for error messages.
    """

    def __init__(self, experts: nn.Module, recipe=None, where: str = "experts"):
        super().__init__()
        check_hf_experts(experts, where)
        self.gate_up_proj, self.down_proj = experts.gate_up_proj, experts.down_proj
        self.num_experts = self.gate_up_proj.shape[0]
        self.act_fn = nn.SiLU()  # documents the math; the op applies it
        self.recipe = as_recipe(recipe)
        moe_kwargs(self.recipe)  # refuse an unsupported recipe now, not at the first forward

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        from ..experimental.moe_mxfp8 import moe_swiglu_experts_mxfp8

        x_op, autocasting = autocast_input(hidden_states)
        with torch.autocast(hidden_states.device.type, enabled=False) if autocasting else contextlib.nullcontext():
            y = moe_swiglu_experts_mxfp8(x_op, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj,
                                         **moe_kwargs(self.recipe))
        return y.to(hidden_states.dtype)

    def extra_repr(self) -> str:
        n_e, two_i, h = self.gate_up_proj.shape
        return (f"num_experts={n_e}, hidden_size={h}, intermediate_size={two_i // 2}, "
                f"recipe={self.recipe.describe()}")
