"""``accepts_recipe``: give a functional op a ``recipe=`` keyword whose values explicit keywords override.

Kept apart from recipe.py (which imports the op modules) so that an op module can import it at the top
without an import cycle:

    from ....recipe_call import accepts_recipe

    @accepts_recipe
    def swiglu_mlp_mxfp8(x, gate_up_weight, down_weight, *, checkpoint="all", ...): ...

    swiglu_mlp_mxfp8(x, w_gu, w_down, recipe="mxfp8_e5m2", backend="emulate")  # backend overrides the recipe

Without ``recipe`` (or with recipe=None) the call is passed through unchanged, so the op's own
defaults apply; with a recipe, every option comes from ``recipe.to_kwargs(**explicit_keywords)``.
"""
import functools


def accepts_recipe(op):
    """Wrap `op` (positional tensors, keyword options) so that it also takes ``recipe=`` (Recipe / preset name)."""

    @functools.wraps(op)
    def with_recipe(*tensors, recipe=None, **options):
        if recipe is None:
            return op(*tensors, **options)
        from .recipe import as_recipe

        return op(*tensors, **as_recipe(recipe).to_kwargs(**options))

    return with_recipe
