"""Training recipes: every numeric and execution option of the MXFP8 SwiGLU op in one frozen object.

A ``Recipe`` replaces the loose keyword options of ``swiglu_mlp_mxfp8`` and ``moe_swiglu_experts_mxfp8``
(both take ``recipe=``, explicit keywords overriding its fields: nkilib/recipe_call.py) and of the modules
built on them (``SwiGLUMLP(recipe=...)``, ``MoESwiGLUExperts(recipe=...)``, ``nkilib.patch_model``,
``nkilib.training.TensorParallelSwiGLUMLP``). It is validated once, at
construction, with errors that name the field, the accepted values and the value received; it is
hashable and immutable (``recipe.replace(field=value)`` returns a new, re-validated recipe).

    recipe = nkilib.get_recipe("mxfp8_e4m3_default")
    y = swiglu_mlp_mxfp8(x, gate_up_weight, down_weight, **recipe.to_kwargs())
    y = swiglu_mlp_mxfp8(x, gate_up_weight, down_weight, **recipe.to_kwargs(backend="emulate"))  # override

Presets (``PRESETS``; ``get_recipe(name)``):
    "mxfp8_e4m3_default": the kernel's defaults: E4M3 elements, quantize_mx's "neuron" scale rule, OCP
        1x32 groups, all four checkpoints saved (the kernel recomputes nothing), backend "auto"
        (simulator on CPU, the kernel on Neuron). The recipe to train with on Trn3.
    "mxfp8_e4m3_save_preact": as the default but saves only gate_pre and up (half the activation
        memory); gradients are bit-identical to the default (the forward computes gate_act and
        intermediate with the kernel's own phase-0 formulas, see mlp_bwd_mxfp8_torch.py).
    "mxfp8_e4m3_recompute": saves nothing; the kernel recomputes the projections as MXFP8 matmuls (least
        memory; gradients differ from the default by about the MXFP8 error itself).
    "mxfp8_e5m2": E5M2 elements everywhere (more exponent range, one mantissa bit fewer: about twice
        the relative error of E4M3 on unit-scale data); for gradients with outliers.
    "mxfp8_e4m3_emulate": the default numerics on the pure-torch "emulate" backend (bit-identical to
        the kernel, any torch device): for convergence studies on CPU / CUDA.
    "mxfp8_e4m3_rceil_emulate": E4M3 with the "rceil" scale rule (round the scale up, the rule of
        NVIDIA's MXFP8 and torchao's default), emulate backend: to compare scale rules in studies.
    "mxfp8_e4m3_emulate_fast": the default quantization on the opt-in "emulate_fast" backend: the same fp8
        codes and scales, float32-accumulating GEMMs (bf16 tensor cores on CUDA) instead of the kernel's
        exact per-tile sums: NOT bit-identical (a small fraction of bf16 outputs differ, by ~1 ulp; README
        "Emulation speed"), several times faster on GPUs: for convergence studies there.
    "bf16_backward": the same kernel with BF16 matmuls (``matmul_precision="bf16"``, Trn2's path and the
        speed / accuracy baseline of the MXFP8 recipes).

Fields mirror the op's keyword arguments (``to_kwargs()`` returns exactly those), plus
``accumulate_main_grad`` (fp32 ``param.main_grad`` accumulation, Megatron / NxD convention), which is
emitted only when True so that recipes also drive op builds without that option.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Union

from .core import options
from .experimental.mlp_mxfp8.mlp_bwd_mxfp8 import mlp_bwd_mxfp8_emulate as emu
from .experimental.mlp_mxfp8.mlp_bwd_mxfp8 import mlp_bwd_mxfp8_torch as op_module
from .experimental.mlp_mxfp8.mlp_bwd_mxfp8.config import ClampLimits
from .experimental.mlp_mxfp8.mlp_bwd_mxfp8.constants import MATMUL_PRECISIONS, QUANT_SCHEMES
from .mx import SCALE_RULES

__all__ = ["Recipe", "PRESETS", "get_recipe", "as_recipe"]

_WEIGHT_GRAD_SPELLINGS = {"bf16": "bfloat16", "fp32": "float32", "bfloat16": "bfloat16", "float32": "float32"}


def _field_error(field: str, expected: str, got) -> ValueError:
    return ValueError(f"Recipe.{field} must be {expected}, got {got!r}")


def _canonical_checkpoint(value) -> Union[str, tuple]:
    """"all" / "none" / a tuple of checkpoint names in the op's canonical order (hashable)."""
    try:
        keep = op_module.resolve_checkpoint_policy(value)
    except ValueError as exc:
        raise ValueError(f"Recipe.checkpoint: {exc}") from None
    if all(keep):
        return "all"
    if not any(keep):
        return "none"
    return tuple(name for name, k in zip(op_module.CHECKPOINT_NAMES, keep) if k)


def _canonical_clamps(value) -> Optional[ClampLimits]:
    if value is None or isinstance(value, ClampLimits):
        return value
    try:
        limits = ClampLimits(*emu.clamp_tuple(value), activation=options.clamp_activation(value))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"Recipe.clamp_limits: {exc}") from None
    return None if limits == ClampLimits() else limits


def _canonical_weight_grad(value) -> Optional[str]:
    if value is None:
        return None
    name = getattr(value, "__name__", None) or str(value)
    name = name[len("torch."):] if name.startswith("torch.") else name
    if name not in _WEIGHT_GRAD_SPELLINGS:
        raise _field_error("weight_grad_dtype", "None, 'bfloat16' or 'float32' (or the torch dtype)", value)
    return _WEIGHT_GRAD_SPELLINGS[name]


@dataclass(frozen=True)
class Recipe:
    """Numeric and execution options of the MXFP8 SwiGLU op (module docstring).

    Attributes:
        fp8_dtype: MX element format of the backward matmuls: "float8_e4m3fn" or "float8_e5m2".
        scale_rule: E8M0 scale rule: "neuron" (quantize_mx, the kernel), "rceil" or "ocp_floor" (the
            last two only on backend="emulate" / "emulate_fast").
        quant_scheme: "1x32" (OCP contiguous groups of 32) or "wrapX".
        matmul_precision: "mxfp8" (Trn3) or "bf16" (the BF16 backward, Trn2's path).
        weight_grad_dtype: None (float32 when a parameter is float32, else bfloat16), "bfloat16" or
            "float32": the dtype the kernel writes weight gradients in.
        checkpoint: "all", "none" or a tuple of names from ("gate_pre", "gate_act", "up",
            "intermediate"): the activations the forward saves for the backward.
        backend: "auto", "simulator", "emulate", "emulate_fast" (not bit-exact) or "neuron".
        clamp_limits: ClampLimits of a clamped SwiGLU (a dict of its fields is accepted) or None.
        forward_numerics: "torch" (bf16 torch projections) or "kernel" (the kernel's MX numerics).
        lnc: LNC degree of the kernel launch (1, 2) or None (the op's default).
        accumulate_main_grad: add fp32 weight gradients to ``param.main_grad`` (needs an op build with
            that option; weight_grad_dtype must then be None or "float32").
    """

    fp8_dtype: str = "float8_e4m3fn"
    scale_rule: str = "neuron"
    quant_scheme: str = "1x32"
    matmul_precision: str = "mxfp8"
    weight_grad_dtype: Optional[str] = None
    checkpoint: Union[str, tuple] = "all"
    backend: str = "auto"
    clamp_limits: Optional[ClampLimits] = None
    forward_numerics: str = "torch"
    lnc: Optional[int] = None
    accumulate_main_grad: bool = False

    def __post_init__(self):
        set_ = object.__setattr__  # frozen: canonical values are stored once, here
        try:
            set_(self, "fp8_dtype", emu.fp8_name(self.fp8_dtype))
        except (TypeError, ValueError):
            raise _field_error("fp8_dtype", "'float8_e4m3fn' or 'float8_e5m2' (or 'e4m3fn' / 'e5m2' / the torch "
                               "dtype)", self.fp8_dtype) from None
        for field, choices in (("scale_rule", SCALE_RULES), ("quant_scheme", QUANT_SCHEMES),
                               ("matmul_precision", MATMUL_PRECISIONS), ("backend", op_module.BACKENDS),
                               ("forward_numerics", op_module.FORWARD_NUMERICS)):
            value = getattr(self, field)
            if not isinstance(value, str) or value not in choices:
                raise _field_error(field, f"one of {tuple(choices)}", value)
        set_(self, "weight_grad_dtype", _canonical_weight_grad(self.weight_grad_dtype))
        set_(self, "checkpoint", _canonical_checkpoint(self.checkpoint))
        set_(self, "clamp_limits", _canonical_clamps(self.clamp_limits))
        if self.lnc is not None and (isinstance(self.lnc, bool) or self.lnc not in (1, 2)):
            raise _field_error("lnc", "None, 1 or 2", self.lnc)
        if not isinstance(self.accumulate_main_grad, bool):
            raise _field_error("accumulate_main_grad", "True or False", self.accumulate_main_grad)
        # cross-field rules the op would otherwise report only at the first forward / backward
        if self.scale_rule != "neuron" and self.backend not in op_module.EMULATE_BACKENDS:
            raise ValueError(f"Recipe.scale_rule={self.scale_rule!r} needs backend='emulate' or 'emulate_fast' (the "
                             f"kernel's quantize_mx implements the 'neuron' rule), got backend={self.backend!r}")
        if self.accumulate_main_grad and self.weight_grad_dtype == "bfloat16":
            raise ValueError("Recipe.weight_grad_dtype must be None or 'float32' with accumulate_main_grad=True "
                             "(main_grad receives the kernel's fp32 gradients), got 'bfloat16'")

    def replace(self, **changes) -> "Recipe":
        """A new recipe with `changes` applied (validated like a new one).

        Raises:
            ValueError: an unknown field name or an invalid value.
        """
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise ValueError(f"Recipe has no field(s) {unknown}; fields: {[f.name for f in dataclasses.fields(self)]}")
        return dataclasses.replace(self, **changes)

    def to_kwargs(self, **overrides) -> dict:
        """Keyword arguments of ``swiglu_mlp_mxfp8`` for this recipe; `overrides` (the op's keyword names)
        win over the recipe's values and are validated as recipe fields.

        ``accumulate_main_grad`` appears only when True (op builds without that option keep working).
        """
        recipe = self.replace(**overrides) if overrides else self
        kwargs = {f.name: getattr(recipe, f.name) for f in dataclasses.fields(recipe)}
        if not kwargs.pop("accumulate_main_grad"):
            return kwargs
        kwargs["accumulate_main_grad"] = True
        return kwargs

    def describe(self) -> str:
        """One line naming every non-default field (for logs and module reprs)."""
        defaults = Recipe()
        diff = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(defaults, f.name)]
        return "Recipe(" + ", ".join(diff) + ")"


PRESETS = {
    "mxfp8_e4m3_default": Recipe(),
    "mxfp8_e4m3_save_preact": Recipe(checkpoint=("gate_pre", "up")),
    "mxfp8_e4m3_recompute": Recipe(checkpoint="none"),
    "mxfp8_e5m2": Recipe(fp8_dtype="float8_e5m2"),
    "mxfp8_e4m3_emulate": Recipe(backend="emulate"),
    "mxfp8_e4m3_rceil_emulate": Recipe(scale_rule="rceil", backend="emulate"),
    "mxfp8_e4m3_emulate_fast": Recipe(backend="emulate_fast"),
    "bf16_backward": Recipe(matmul_precision="bf16"),
}


def get_recipe(name: str, **overrides) -> Recipe:
    """The preset `name` (module docstring), with `overrides` applied.

    Raises:
        ValueError: an unknown preset name (the message lists the presets) or an invalid override.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown recipe preset {name!r}; presets: {sorted(PRESETS)}")
    return PRESETS[name].replace(**overrides) if overrides else PRESETS[name]


def as_recipe(recipe) -> Recipe:
    """None -> the default preset; a preset name -> that preset; a Recipe -> itself.

    Raises:
        TypeError: anything else.
    """
    if recipe is None:
        return PRESETS["mxfp8_e4m3_default"]
    if isinstance(recipe, Recipe):
        return recipe
    if isinstance(recipe, str):
        return get_recipe(recipe)
    raise TypeError(f"recipe must be a Recipe, a preset name from {sorted(PRESETS)} or None, got "
                    f"{type(recipe).__name__}")

