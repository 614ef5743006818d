"""nkilib.recipe: validation naming the field, canonical (hashable, frozen) values, presets that run the op."""
import dataclasses

import pytest

torch = pytest.importorskip("torch")

from torchkit import rel  # noqa: E402

from nkilib.experimental.mlp_mxfp8 import swiglu_mlp_mxfp8  # noqa: E402
from nkilib.recipe import PRESETS, Recipe, as_recipe, get_recipe  # noqa: E402

S, H, I = 48, 64, 96


def _problem(dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(S, H, generator=g).to(dtype)
    w_gu = (torch.randn(2 * I, H, generator=g) / H ** 0.5).to(dtype)
    w_down = (torch.randn(H, I, generator=g) / I ** 0.5).to(dtype)
    dy = torch.randn(S, H, generator=g).to(dtype)
    return x, w_gu, w_down, dy


def _grads(**kwargs):
    x, w_gu, w_down, dy = (t.clone().requires_grad_(True) for t in _problem())
    swiglu_mlp_mxfp8(x, w_gu, w_down, **kwargs).backward(dy.detach())
    return x.grad, w_gu.grad, w_down.grad


def _ideal_grads():
    x, w_gu, w_down, dy = (t.double().requires_grad_(True) for t in _problem())
    gate, up = (x @ w_gu.t()).chunk(2, dim=-1)
    ((torch.nn.functional.silu(gate) * up) @ w_down.t()).backward(dy.detach())
    return x.grad, w_gu.grad, w_down.grad


def test_to_kwargs_is_the_ops_keywords():
    kwargs = get_recipe("mxfp8_e5m2").to_kwargs(backend="emulate")
    assert kwargs == dict(fp8_dtype="float8_e5m2", scale_rule="neuron", quant_scheme="1x32", matmul_precision="mxfp8",
                          weight_grad_dtype=None, checkpoint="all", backend="emulate", clamp_limits=None,
                          forward_numerics="torch", lnc=None)
    loose = _grads(fp8_dtype="float8_e5m2", backend="emulate")
    assert all(torch.equal(a, b) for a, b in zip(_grads(**kwargs), loose))
    e4m3 = _grads(**get_recipe("mxfp8_e4m3_emulate").to_kwargs())
    assert not torch.equal(e4m3[0], loose[0])  # the field reaches the op


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_runs_the_op(name):
    recipe = get_recipe(name)
    kwargs = recipe.to_kwargs(backend="emulate") if recipe.backend == "auto" else recipe.to_kwargs()
    grads, ideal = _grads(**kwargs), _ideal_grads()
    errors = [rel(g, i) for g, i in zip(grads, ideal)]
    # measured (this problem, relative Frobenius vs float64): bf16_backward <= 3.8e-3; E4M3 <= 5.4e-2
    # (recompute: 6.9e-2, the recomputed projections add their own MX error); E5M2 <= 1.1e-1
    bound = {"bf16_backward": 5e-3, "mxfp8_e4m3_recompute": 8e-2, "mxfp8_e5m2": 1.3e-1}.get(name, 6e-2)
    assert max(errors) < bound, (name, errors)
    if name != "bf16_backward":
        assert max(errors) > 1.5e-2, (name, errors)  # MX quantization is in effect


def test_save_preact_preset_gives_the_default_gradients():
    default = _grads(**get_recipe("mxfp8_e4m3_default").to_kwargs(backend="emulate"))
    preact = _grads(**get_recipe("mxfp8_e4m3_save_preact").to_kwargs(backend="emulate"))
    recompute = _grads(**get_recipe("mxfp8_e4m3_recompute").to_kwargs(backend="emulate"))
    assert all(torch.equal(a, b) for a, b in zip(default, preact))
    assert not torch.equal(default[1], recompute[1])


def test_canonical_values_equal_hashable_frozen():
    a = Recipe(fp8_dtype="e4m3fn", weight_grad_dtype=torch.float32, checkpoint=["up", "gate_pre"],
               clamp_limits={"linear_upper": 7.0})
    b = Recipe(fp8_dtype=torch.float8_e4m3fn, weight_grad_dtype="fp32", checkpoint=("gate_pre", "up"),
               clamp_limits=dict(linear_upper=7.0))
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a.checkpoint == ("gate_pre", "up") and a.weight_grad_dtype == "float32"
    assert Recipe(checkpoint=["gate_pre", "gate_act", "up", "intermediate"]).checkpoint == "all"
    assert Recipe(clamp_limits={}).clamp_limits is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.backend = "emulate"
    assert a.replace(backend="emulate").backend == "emulate" and a.backend == "auto"


@pytest.mark.parametrize("field, value, message", [
    ("fp8_dtype", "e3m4", "Recipe.fp8_dtype must be 'float8_e4m3fn' or 'float8_e5m2'"),
    ("scale_rule", "floor", r"Recipe.scale_rule must be one of \('neuron', 'ocp_floor', 'rceil'\), got 'floor'"),
    ("quant_scheme", "2x16", "Recipe.quant_scheme must be one of"),
    ("matmul_precision", "fp8", "Recipe.matmul_precision must be one of"),
    ("backend", "cuda", "Recipe.backend must be one of"),
    ("forward_numerics", "exact", "Recipe.forward_numerics must be one of"),
    ("weight_grad_dtype", "float16", "Recipe.weight_grad_dtype must be None, 'bfloat16' or 'float32'"),
    ("checkpoint", ("gate_pre", "silu"), "Recipe.checkpoint: unknown checkpoint name 'silu'"),
    ("clamp_limits", {"linear_lower": 3.0, "linear_upper": 1.0}, "Recipe.clamp_limits: .*linear_lower"),
    ("clamp_limits", {"upper": 1.0}, "Recipe.clamp_limits: .*unknown keys"),
    ("lnc", 4, "Recipe.lnc must be None, 1 or 2, got 4"),
    ("accumulate_main_grad", 1, "Recipe.accumulate_main_grad must be True or False, got 1"),
])
def test_invalid_field_is_named(field, value, message):
    with pytest.raises(ValueError, match=message):
        Recipe(**{field: value})


def test_cross_field_rules_and_overrides():
    with pytest.raises(ValueError, match="scale_rule='rceil' needs backend='emulate'"):
        Recipe(scale_rule="rceil")
    with pytest.raises(ValueError, match="weight_grad_dtype must be None or 'float32' with accumulate_main_grad"):
        Recipe(accumulate_main_grad=True, weight_grad_dtype="bfloat16")
    with pytest.raises(ValueError, match=r"Recipe has no field\(s\) \['fp8'\]"):
        get_recipe("mxfp8_e4m3_default").to_kwargs(fp8="e5m2")
    with pytest.raises(ValueError, match="Recipe.backend must be one of"):
        get_recipe("mxfp8_e4m3_default").to_kwargs(backend="gpu")
    with pytest.raises(ValueError, match=r"unknown recipe preset 'mxfp8'; presets: \["):
        get_recipe("mxfp8")
    with pytest.raises(TypeError, match="recipe must be a Recipe"):
        as_recipe(42)
    assert as_recipe(None) is PRESETS["mxfp8_e4m3_default"] and as_recipe("mxfp8_e5m2") is PRESETS["mxfp8_e5m2"]
    assert "accumulate_main_grad" not in Recipe().to_kwargs()
    assert Recipe(accumulate_main_grad=True).to_kwargs()["accumulate_main_grad"] is True
    assert get_recipe("mxfp8_e4m3_rceil_emulate").describe() == "Recipe(scale_rule='rceil', backend='emulate')"


def test_accepts_recipe_wrapper_lets_explicit_keywords_win():
    from nkilib.recipe_call import accepts_recipe

    op = accepts_recipe(swiglu_mlp_mxfp8)
    x, w_gu, w_down, _ = _problem()
    via_recipe = op(x, w_gu, w_down, recipe="mxfp8_e5m2", backend="emulate", forward_numerics="kernel")
    loose = swiglu_mlp_mxfp8(x, w_gu, w_down, fp8_dtype="float8_e5m2", backend="emulate", forward_numerics="kernel")
    assert torch.equal(via_recipe, loose)
    assert not torch.equal(via_recipe, op(x, w_gu, w_down, recipe="mxfp8_e4m3_emulate", forward_numerics="kernel"))
    assert torch.equal(op(x, w_gu, w_down, backend="emulate"), swiglu_mlp_mxfp8(x, w_gu, w_down, backend="emulate"))
    with pytest.raises(ValueError, match=r"Recipe has no field\(s\) \['fp8'\]"):
        op(x, w_gu, w_down, recipe="mxfp8_e5m2", fp8="e4m3fn")
