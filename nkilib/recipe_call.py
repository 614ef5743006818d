"""``accepts_recipe``: give a functional op a ``recipe=`` keyword whose values explicit keywords override.

Kept apart from recipe.py (which imports the op modules) so that an op module can import it at the top
without an import cycle:

    from ....recipe_call import accepts_recipe

    @accepts_recipe
    def swiglu_mlp_mxfp8(x, gate_up_weight, down_weight, *, checkpoint="all", ...): ...

    @accepts_recipe(label="MoE experts")
    def moe_swiglu_experts_mxfp8(x, topk_ids, topk_weights, w_gu, w_down, *, checkpoint="all", ...): ...

    swiglu_mlp_mxfp8(x, w_gu, w_down, recipe="mxfp8_e5m2", backend="emulate")  # backend overrides the recipe

Without ``recipe`` (or with recipe=None) the call is passed through unchanged, so the op's own
defaults apply. With a recipe, ``resolve_options`` is the one resolution path (the wrapper and the
modules built on the ops use it):
    * keywords that are Recipe fields override the recipe's values and are validated as fields;
    * the recipe's fields become the op's keywords; a field the op has no keyword for is dropped when
      it has the default Recipe's value or is in the op's `ignores`, else refused (ValueError naming
      the field, its value and the op);
    * the op's own keywords that are not Recipe fields (the MoE op's ``block_size``, ...) pass through;
      any other keyword is an unknown Recipe field (ValueError listing the fields).

Modules (``SwiGLUMLP``, ``MoESwiGLUExperts``) default their option keywords to ``UNSET``: an option left
unset takes the recipe's value, or without a recipe the op's default; ``explicit_options`` keeps those
given.
"""
import dataclasses
import functools
import inspect

__all__ = ["accepts_recipe", "resolve_options", "effective_options", "explicit_options", "UNSET"]


class _Unset:
    """The default of a module's option keywords: the recipe's value, else the op's default."""

    def __repr__(self):
        return "UNSET"


UNSET = _Unset()


def explicit_options(**options) -> dict:
    """`options` without the ones left UNSET."""
    return {k: v for k, v in options.items() if v is not UNSET}


def _spec(op) -> tuple:
    """(keyword-only option names, ignored recipe fields, label) of a function wrapped by accepts_recipe."""
    return getattr(op, "_recipe_spec", None) or (_keyword_options(op), (), op.__name__)


def _keyword_options(op) -> frozenset:
    params = inspect.signature(op).parameters.values()
    return frozenset(p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY)


def resolve_options(op, recipe, options: dict) -> dict:
    """The keyword arguments `op` receives for `recipe` (a Recipe, a preset name or None) and the explicit
    `options` (module docstring). With recipe=None, `options` unchanged.

    Raises:
        ValueError: an invalid field or override (named), a recipe field the op cannot honour, an unknown keyword.
        TypeError: `recipe` neither a Recipe, a preset name nor None.
    """
    if recipe is None:
        return dict(options)
    from .recipe import Recipe, as_recipe

    accepted, ignores, label = _spec(op)
    fields = {f.name for f in dataclasses.fields(Recipe)}
    passthrough = {k: v for k, v in options.items() if k in accepted and k not in fields}
    overrides = {k: v for k, v in options.items() if k not in passthrough}
    defaults = Recipe()
    kwargs = {}
    for name, value in as_recipe(recipe).to_kwargs(**overrides).items():
        if name in accepted:
            kwargs[name] = value
        elif name not in ignores and value != getattr(defaults, name):
            raise ValueError(f"Recipe.{name}={value!r} is not available for {label}: {op.__name__} has no "
                             f"{name!r} option (leave it at {getattr(defaults, name)!r})")
    kwargs.update(passthrough)
    return kwargs


def effective_options(op, recipe, options: dict) -> dict:
    """Every keyword option of `op` as a call with `recipe` and `options` would use it: the op's defaults
    updated with ``resolve_options`` (for module reprs and construction-time checks)."""
    params = inspect.signature(op).parameters.values()
    values = {p.name: p.default for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}
    values.update(resolve_options(op, recipe, options))
    return values


def accepts_recipe(op=None, *, label: str | None = None, ignores: tuple = ()):
    """Wrap `op` (positional tensors, keyword options) so that it also takes ``recipe=`` (Recipe / preset name).

    Args:
        op: the function (or None, to use ``@accepts_recipe(label=..., ignores=...)``).
        label: what error messages call the op's subject (default: the function's name).
        ignores: recipe fields the op has no keyword for and silently drops whatever their value.
    """
    if op is None:
        return functools.partial(accepts_recipe, label=label, ignores=tuple(ignores))

    @functools.wraps(op)
    def with_recipe(*tensors, recipe=None, **options):
        if recipe is None:
            return op(*tensors, **options)
        return op(*tensors, **resolve_options(with_recipe, recipe, options))

    with_recipe._recipe_spec = (_keyword_options(op), tuple(ignores), label or op.__name__)
    return with_recipe
