"""Option resolution and plumbing shared by the PyTorch layer: the dense op (mlp_mxfp8_torch), the MoE experts op
(moe_mxfp8) and nkilib.training.

    CHECKPOINT_NAMES, resolve_checkpoint_policy: the checkpoint policies of both ops.
    check_numeric_options, weight_grad_name: numeric options validated by nkilib.core.options, the weight
        gradients' dtype name.
    to_numpy / from_numpy: torch <-> numpy (bf16 through ml_dtypes) for the simulator backends.
    MainGradSink: fp32 gradient accumulation into ``param.main_grad`` (Megatron / NxD convention).
    RecipeLayer: the recipe and option keywords of the ops' nn.Modules (SwiGLUMLP, MoESwiGLUExperts), held and
        resolved one way.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Optional

import ml_dtypes
import numpy as np
import torch
from torch import Tensor

from ..core import options
from ..core.matmul.constants import MX_GROUP
from ..mx import SCALE_RULES
from ..recipe_call import effective_options, explicit_options

__all__ = ["CHECKPOINT_NAMES", "resolve_checkpoint_policy", "check_numeric_options", "weight_grad_name", "to_numpy",
           "from_numpy", "MainGradSink", "RecipeLayer"]

#: Forward activations the backward kernel accepts as checkpoints (kernel argument names).
CHECKPOINT_NAMES = ("gate_pre", "gate_act", "up", "intermediate")


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


def check_numeric_options(clamp_limits, fp8_dtype, quant_scheme, matmul_precision, scale_rule) -> tuple:
    """(clamps (4 floats or None), fp8 format name) of a torch op's numeric options (this layer's and the MoE
    experts' op), validated by nkilib.core.options like the kernels and references; scale_rule one of
    nkilib.mx.SCALE_RULES."""
    clamps = options.clamp_values(clamp_limits)
    fp8 = options.fp8_format(fp8_dtype)
    options.quant_scheme(quant_scheme)
    options.matmul_precision(matmul_precision)
    options.check_choice("scale_rule", scale_rule, SCALE_RULES)
    return clamps, fp8


def weight_grad_name(weight_grad_dtype, gate_up_weight: Tensor, down_weight: Tensor) -> str:
    """"float32" / "bfloat16": weight_grad_dtype validated, or for None float32 when a weight is float32."""
    if weight_grad_dtype is None:
        return "float32" if torch.float32 in (gate_up_weight.dtype, down_weight.dtype) else "bfloat16"
    return options.weight_grad_dtype(weight_grad_dtype, spelled="None, torch.bfloat16 or torch.float32")


def to_numpy(t: Optional[Tensor]):
    """Tensor -> numpy array on the host (bfloat16 as ml_dtypes.bfloat16); None -> None."""
    if t is None:
        return None
    t = t.detach().to("cpu").contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def from_numpy(a, device) -> Tensor:
    """numpy array -> tensor on `device`: ml_dtypes.bfloat16 as torch.bfloat16, anything else as float32."""
    a = np.ascontiguousarray(a)
    if a.dtype == ml_dtypes.bfloat16:
        t = torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    else:
        t = torch.from_numpy(a.astype(np.float32, copy=True))
    return t.to(device)


class MainGradSink(torch.autograd.Function):
    """param -> a zero-stride fp32 zero tensor of param's shape that carries param's fp32 gradient.

    The forward op takes this tensor as an extra input and returns the kernel's fp32 weight gradient
    for it (and None for the bf16 weight itself). The engine casts a gradient to its input's dtype, so
    only an fp32 input lets the fp32 gradient through unrounded; a zero-stride tensor costs no memory.
    The backward here adds that gradient to ``param.main_grad``. Like Megatron's fused gradient
    accumulation, ``param.grad`` is left alone, except that a parameter carrying the
    ``grad_added_to_main_grad`` attribute gets it set to True and a zero ``.grad`` contribution, so
    hooks on the gradient accumulator still fire (what Megatron-LM's distributed optimizer expects).
    """

    @staticmethod
    def forward(ctx, param):
        ctx.param = param
        return torch.zeros((), dtype=torch.float32, device=param.device).expand(param.shape)

    @staticmethod
    def backward(ctx, grad):
        param = ctx.param
        param.main_grad.add_(grad)
        if hasattr(param, "grad_added_to_main_grad"):
            param.grad_added_to_main_grad = True
            return torch.zeros_like(param)
        return None


class RecipeLayer:
    """Mixin of the ops' nn.Modules (the dense SwiGLUMLP, MoESwiGLUExperts): a recipe and the option keywords given
    explicitly, resolved against the module's op the one way (nkilib/recipe_call.py: a given option overrides the
    recipe's value; one left UNSET takes the recipe's, or without a recipe the op's default).

    A subclass names its functional op (wrapped by accepts_recipe) in `recipe_op` (a staticmethod) and itself in
    `layer_name` (error messages), calls _check_sizes and _set_recipe_options in __init__, and passes
    **self.op_options() to the op in forward.
    """

    recipe_op = None
    layer_name = "RecipeLayer"

    def _check_sizes(self, **sizes) -> None:
        """Each of `sizes` (name=value) a positive int multiple of MX_GROUP, else ValueError naming it."""
        for name, v in sizes.items():
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0 or v % MX_GROUP:
                raise ValueError(f"{self.layer_name}: {name} must be a positive multiple of {MX_GROUP}, got {v!r}")

    def _set_recipe_options(self, recipe, **option_keywords) -> dict:
        """Hold `recipe` (a Recipe, a preset name or None) and the option keywords not UNSET (self.options), resolve
        them now, so a bad recipe, option or checkpoint policy raises at construction, and return
        effective_options()."""
        self.recipe = recipe
        self.options = explicit_options(**option_keywords)
        effective = self.effective_options()
        resolve_checkpoint_policy(effective["checkpoint"])
        return effective

    def effective_options(self) -> dict:
        """Every option of the op as forward uses it (the recipe, then the explicit options, then defaults)."""
        return effective_options(self.recipe_op, self.recipe, self.options)

    def op_options(self) -> dict:
        """The keywords forward passes to the op: recipe= and the explicit options."""
        return dict(recipe=self.recipe, **self.options)
