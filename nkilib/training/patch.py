"""``patch_model``: put the MXFP8 SwiGLU op into a Hugging Face model, in place, in one call.

    report = nkilib.patch_model(model, recipe="mxfp8_e4m3_default")

Every submodule whose class is registered (``swappable_classes()``) is replaced by the module its swap
function returns; the replacement keeps the model's parameter objects and names, so ``state_dict()``
and ``load_state_dict()`` use the model's own keys and an optimizer built before the swap still holds
the right parameters. Calling ``patch_model`` again on a patched model changes the recipe of every
swapped module.

Registered (dense SwiGLU MLPs; ``nn.Linear`` gate_proj / up_proj / down_proj without bias, SiLU):
    LlamaMLP, MistralMLP, Qwen2MLP, Qwen3MLP, Qwen3MoeMLP (the dense layers of Qwen3-MoE).

MoE experts (``Qwen3MoeExperts``, ``MixtralExperts``; nkilib/training/moe.py): the ``experts`` module of a
sparse MoE block is replaced by ``HFMoEExperts`` (same two Parameters, same keys) calling
``moe_swiglu_experts_mxfp8``; ``GptOssExperts`` by ``HFGptOssExperts`` (same four Parameters, same keys; the
op's activation "gpt_oss" with the model's limit, biases). The router and the block's forward stay the model's.
Registered only when this build has the MoE op; otherwise those classes are listed in ``PENDING_CLASSES`` with
the reason. Further classes: ``register_swap(class_name, swap_fn)``.

Expert parallelism: ``patch_model(model, recipe, ep_group=pg)`` on every rank of `pg` makes the swapped experts
modules keep only the rank's E/ep experts and run the op with ``ep_group`` (nkilib/training/moe.py says what a
rank's state dict holds); dense MLPs are swapped as without it. ``ep_payload="bf16"`` sends tokens and output
gradients in bf16 instead of MXFP8 (bit-identical to one process); ``ep_capacity`` pads the all-to-alls to equal
splits (the op's keyword; by default on an "xla" process group). Swap functions that take ``ep_group`` /
``ep_payload`` / ``ep_capacity`` keywords receive them; the others are called as without.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable

from torch import nn

from ..recipe import Recipe, as_recipe
from .moe import GPT_OSS_EXPERTS_CLASSES, MOE_EXPERTS_CLASSES, HFGptOssExperts, HFMoEExperts, moe_op_available
from .swiglu import HFSwiGLUMLP

__all__ = ["PatchReport", "patch_model", "register_swap", "swappable_classes", "DENSE_SWIGLU_CLASSES",
           "PENDING_CLASSES"]

#: Hugging Face classes of dense SwiGLU MLPs (transformers 4.4x-5.x: LlamaMLP and its copies).
DENSE_SWIGLU_CLASSES = ("LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP", "Qwen3MoeMLP")

#: Known MoE classes not swapped yet, with the reason (reported by patch_model).
PENDING_CLASSES = {
    **({} if moe_op_available() else {
        name: "needs moe_swiglu_experts_mxfp8 (nkilib.experimental.moe_mxfp8), not in this build"
        for name in MOE_EXPERTS_CLASSES + GPT_OSS_EXPERTS_CLASSES}),
}

#: swap_fn(module, recipe, qualified_name) -> the replacement module (may be `module` itself).
SwapFn = Callable[[nn.Module, Recipe, str], nn.Module]

_SWAPS: dict = {}


@dataclass(frozen=True)
class PatchReport:
    """What patch_model did: qualified names of the swapped modules and of known modules left as they are.

    Attributes:
        patched: names of swapped (or re-configured) modules, in model order.
        unsupported: name -> reason, for modules of a PENDING_CLASSES class (only with strict=False).
        rank_local_parameters: with ep_group, the names of the parameters that hold only this rank's experts
            (leave them out of the data-parallel gradient all-reduce); () without.
    """

    patched: tuple = ()
    unsupported: dict = field(default_factory=dict)
    rank_local_parameters: tuple = ()


def register_swap(class_name: str, swap_fn: SwapFn, *, replace: bool = False) -> None:
    """Make patch_model replace modules whose class is named `class_name` by ``swap_fn(module, recipe, name)``.

    Raises:
        ValueError: `class_name` already registered and replace is False.
    """
    if class_name in _SWAPS and not replace:
        raise ValueError(f"a swap for {class_name!r} is already registered; pass replace=True to override it")
    _SWAPS[class_name] = swap_fn


def swappable_classes() -> tuple:
    """Class names patch_model swaps, sorted."""
    return tuple(sorted(_SWAPS))


def _swap_dense(module: nn.Module, recipe: Recipe, name: str) -> nn.Module:
    return HFSwiGLUMLP.from_hf(module, recipe=recipe, where=name or type(module).__name__)


def _swap_experts(module: nn.Module, recipe: Recipe, name: str, ep_group=None, ep_payload="mxfp8",
                  ep_capacity=None) -> nn.Module:
    return HFMoEExperts(module, recipe=recipe, where=name or type(module).__name__, ep_group=ep_group,
                        ep_payload=ep_payload, ep_capacity=ep_capacity)


def _swap_gpt_oss_experts(module: nn.Module, recipe: Recipe, name: str, ep_group=None, ep_payload="mxfp8",
                          ep_capacity=None) -> nn.Module:
    return HFGptOssExperts(module, recipe=recipe, where=name or type(module).__name__, ep_group=ep_group,
                           ep_payload=ep_payload, ep_capacity=ep_capacity)


def _reconfigure(module: nn.Module, recipe: Recipe, name: str, ep_group=None, ep_payload="mxfp8",
                 ep_capacity=None) -> nn.Module:
    held = getattr(module, "ep_group", None)
    if ep_group is not None and isinstance(module, (HFMoEExperts, HFGptOssExperts)):
        if ep_group is not held:
            raise ValueError(f"patch_model: {name} is already swapped with "
                             f"{'all experts' if held is None else 'another ep_group'}; its experts cannot be "
                             f"re-sharded over a new ep_group (patch the original model instead)")
        for option, value in (("ep_payload", ep_payload), ("ep_capacity", ep_capacity)):
            if value != getattr(module, option):
                raise ValueError(f"patch_model: {name} runs with {option}={getattr(module, option)!r}; re-patching "
                                 f"cannot change it to {value!r}")
    module.set_recipe(recipe)  # refuses a recipe the module's op cannot run (names the field)
    return module


for _cls in DENSE_SWIGLU_CLASSES:
    register_swap(_cls, _swap_dense)
if moe_op_available():
    for _cls in MOE_EXPERTS_CLASSES:
        register_swap(_cls, _swap_experts)
    for _cls in GPT_OSS_EXPERTS_CLASSES:
        register_swap(_cls, _swap_gpt_oss_experts)
register_swap(HFSwiGLUMLP.__name__, _reconfigure)
register_swap(HFMoEExperts.__name__, _reconfigure)
register_swap(HFGptOssExperts.__name__, _reconfigure)


def _call_swap(swap_fn: SwapFn, module: nn.Module, recipe: Recipe, name: str, ep_options: dict) -> nn.Module:
    """swap_fn(module, recipe, name), plus the ep_options (ep_group, ep_payload, ep_capacity) it takes, where a
    group is given."""
    if ep_options["ep_group"] is None:
        return swap_fn(module, recipe, name)
    params = inspect.signature(swap_fn).parameters
    any_keyword = any(p.kind is p.VAR_KEYWORD for p in params.values())
    extra = {k: v for k, v in ep_options.items() if any_keyword or k in params}
    return swap_fn(module, recipe, name, **extra)


def patch_model(model: nn.Module, recipe=None, *, strict: bool = True, ep_group=None,
                ep_payload: str = "mxfp8", ep_capacity=None) -> PatchReport:
    """Swap, in place, every registered module of `model` for one whose backward is the MXFP8 op.

    Args:
        model: a torch module (typically a transformers PreTrainedModel); changed in place.
        recipe: a Recipe, a preset name (nkilib.recipe.PRESETS) or None (the default preset).
        strict: raise on modules of a known but not yet supported class (PENDING_CLASSES); False leaves
            them as they are and lists them in the report.
        ep_group: None, or a torch.distributed process group over which the MoE experts are sharded (expert
            parallelism; call on every rank of the group with the same model): the swapped experts modules keep
            this rank's E/ep experts (E divisible by the group size) under the model's parameter names and run
            ``moe_swiglu_experts_mxfp8(..., ep_group=ep_group)``; each rank feeds its own tokens.
        ep_payload: with ep_group, how tokens and output gradients travel: "mxfp8" (fp8 codes + E8M0 scales, the
            op's) or "bf16" (twice the bytes, results bit-identical to the single-process patched model);
            nkilib/experimental/moe_mxfp8/expert_parallel.py.
        ep_capacity: with ep_group, how the all-to-alls split their rows: None (by the group's backend: padded on
            "xla", else exact), "exact", "auto" or a positive int (rows per rank pair, padded, equal splits; more
            routed pairs raise); the op's ep_capacity.

    Returns:
        PatchReport.

    Raises:
        ValueError: a registered module that does not fit the op (bias, activation, sizes; the message
            names the module), a model with nothing to swap, E not divisible by the ep_group size, a bad
            ep_payload / ep_capacity (or one without ep_group), or an already swapped experts module asked to change
            its ep_group, ep_payload or ep_capacity.
        TypeError / RuntimeError: ep_group not a ProcessGroup / torch.distributed not initialised.
        NotImplementedError: strict and a PENDING_CLASSES module is present.
    """
    recipe = as_recipe(recipe)
    if moe_op_available():  # before any swap: a bad option must not leave the model half patched
        from ..experimental.moe_mxfp8.expert_parallel import check_ep_options

        check_ep_options(ep_group, ep_payload, ep_capacity, "patch_model")
    ep_options = dict(ep_group=ep_group, ep_payload=ep_payload, ep_capacity=ep_capacity)
    if not isinstance(model, nn.Module):
        raise TypeError(f"patch_model: model must be a torch.nn.Module, got {type(model).__name__}")
    found = [(name, m) for name, m in model.named_modules() if type(m).__name__ in _SWAPS or
             type(m).__name__ in PENDING_CLASSES]
    pending = {name: f"{type(m).__name__}: {PENDING_CLASSES[type(m).__name__]}" for name, m in found
               if type(m).__name__ not in _SWAPS}
    if pending and strict:
        lines = "\n".join(f"  {n}: {r}" for n, r in pending.items())
        raise NotImplementedError(f"patch_model: these modules cannot be swapped yet (strict=True):\n{lines}\n"
                                  f"pass strict=False to swap the rest and leave these as they are")
    patched = []
    for name, module in found:
        if name in pending:
            continue
        swapped = _call_swap(_SWAPS[type(module).__name__], module, recipe, name, ep_options)
        if swapped is not module:
            _set_submodule(model, name, swapped)
        patched.append(name)
    if not patched:
        raise ValueError(f"patch_model: no module of a swappable class {swappable_classes()} in "
                         f"{type(model).__name__}")
    local = tuple(f"{name}.{p}" if name else p for name, m in model.named_modules()
                  if getattr(m, "ep_group", None) is not None for p, _ in m.named_parameters(recurse=False))
    return PatchReport(patched=tuple(patched), unsupported=pending, rank_local_parameters=local)


def _set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    if not name:
        raise ValueError(f"patch_model: the model itself is a {type(model).__name__}; wrap it in a parent module "
                         f"or use HFSwiGLUMLP.from_hf(model) directly")
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name), child, new)
