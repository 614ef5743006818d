"""recipe= on the modules and the MoE op (nkilib/recipe_call.py: one resolution path): a recipe equals its
loose keywords, explicit keywords win, bad fields are named; the MoE op and MoESwiGLUExperts under
torch.autocast. Expected values come from the same op called with loose keywords (the path that
predates recipes), so a recipe that reached the op with a wrong field would differ."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from moekit import make_routing, moe_inputs  # noqa: E402
from simkit import to_torch  # noqa: E402

from nkilib.experimental.mlp_mxfp8 import SwiGLUMLP, swiglu_mlp_mxfp8  # noqa: E402
from nkilib.experimental.moe_mxfp8 import MoESwiGLUExperts, moe_swiglu_experts_mxfp8  # noqa: E402
from nkilib.recipe import Recipe, get_recipe  # noqa: E402

H, I = 64, 32


def _moe_problem(seed=0):
    ids, e = make_routing("random", seed)
    inp = moe_inputs(ids, e, H=H, I=I, seed=seed)
    return (to_torch(inp["hidden_states"]), torch.from_numpy(ids), to_torch(inp["topk_weights"]),
            to_torch(inp["gate_up_weight"]), to_torch(inp["down_weight"]), to_torch(inp["output_grad"]))


def _moe_grads(recipe=None, **options):
    x, ids, w, wgu, wd, dy = _moe_problem()
    leaves = [t.clone().requires_grad_() for t in (x, w, wgu, wd)]
    y = moe_swiglu_experts_mxfp8(leaves[0], ids, *leaves[1:], recipe=recipe, **options)
    y.backward(dy)
    return (y.detach(), *(t.grad for t in leaves))


def _same(a, b):
    return all(torch.equal(p, q) for p, q in zip(a, b))


def test_moe_op_recipe_equals_loose_keywords_and_explicit_keywords_win():
    loose_e5m2 = _moe_grads(fp8_dtype="float8_e5m2", checkpoint="none", backend="emulate")
    assert _same(_moe_grads("mxfp8_e5m2", checkpoint="none"), loose_e5m2)  # "auto" = emulate for MoE
    assert _same(_moe_grads(Recipe(fp8_dtype="e5m2", checkpoint="none")), loose_e5m2)
    e4m3 = _moe_grads(backend="emulate")
    assert not torch.equal(e4m3[1], loose_e5m2[1])  # the fields reach the op
    # explicit keywords override the recipe: e5m2 recipe told e4m3 = plain e4m3; rceil recipe told neuron
    assert _same(_moe_grads("mxfp8_e5m2", fp8_dtype="float8_e4m3fn"), e4m3)
    assert _same(_moe_grads("mxfp8_e4m3_rceil_emulate", scale_rule="neuron"), e4m3)
    assert not _same(_moe_grads("mxfp8_e4m3_rceil_emulate"), e4m3)
    # an op-only keyword (no Recipe field) passes through with a recipe; a recipe's lnc is ignored
    assert _same(_moe_grads("bf16_backward", block_size=256), _moe_grads(matmul_precision="bf16", block_size=256))
    assert _same(_moe_grads(Recipe(lnc=2)), e4m3)


@pytest.mark.parametrize("recipe, options, message", [
    (Recipe(forward_numerics="kernel"), {},
     "Recipe.forward_numerics='kernel' is not available for MoE experts: moe_swiglu_experts_mxfp8 has no "
     "'forward_numerics' option"),
    (Recipe(accumulate_main_grad=True), {}, "Recipe.accumulate_main_grad=True is not available for MoE experts"),
    ("mxfp8_e5m2", dict(fp8_dtype="e3m4"), "Recipe.fp8_dtype must be 'float8_e4m3fn' or 'float8_e5m2'"),
    ("mxfp8_e5m2", dict(checkpoint=("gate",)), "Recipe.checkpoint: unknown checkpoint name 'gate'"),
    ("mxfp8_e4m3_rceil_emulate", dict(backend="simulator"), "Recipe.scale_rule='rceil' needs backend='emulate'"),
    ("no_such_preset", {}, "unknown recipe preset 'no_such_preset'"),
])
def test_moe_bad_recipe_or_override_names_the_field(recipe, options, message):
    x, ids, w, wgu, wd, _ = _moe_problem()
    with pytest.raises(ValueError, match=message):
        moe_swiglu_experts_mxfp8(x, ids, w, wgu, wd, recipe=recipe, **options)
    with pytest.raises(ValueError, match=message):  # the module resolves the same way, at construction
        MoESwiGLUExperts(6, H, I, recipe=recipe, **options)


def test_moe_op_with_recipe_refuses_unknown_keywords():
    x, ids, w, wgu, wd, _ = _moe_problem()
    with pytest.raises(ValueError, match=r"Recipe has no field\(s\) \['fp8'\]"):
        moe_swiglu_experts_mxfp8(x, ids, w, wgu, wd, recipe="mxfp8_e5m2", fp8="e4m3fn")


def _module_grads(module, x, *route, dy):
    module.zero_grad()
    xl = x.clone().requires_grad_()
    y = module(xl, *route)
    y.backward(dy)
    return (y.detach(), xl.grad, *(p.grad.clone() for p in module.parameters()))


def test_moe_module_recipe_equals_loose_keywords():
    x, ids, w, wgu, wd, dy = _moe_problem()

    def module(**kw):
        m = MoESwiGLUExperts(wgu.shape[0], H, I, **kw)
        with torch.no_grad():
            m.gate_up_weight.copy_(wgu)
            m.down_weight.copy_(wd)
        return m

    loose = module(fp8_dtype="float8_e5m2", checkpoint=("gate_pre", "up"), backend="emulate")
    via_recipe = module(recipe=get_recipe("mxfp8_e5m2", checkpoint=("gate_pre", "up")))
    override = module(recipe="mxfp8_e5m2", fp8_dtype="float8_e4m3fn")
    plain = module()
    ref = _module_grads(loose, x, ids, w, dy=dy)
    assert _same(_module_grads(via_recipe, x, ids, w, dy=dy), ref)
    assert _same(_module_grads(override, x, ids, w, dy=dy), _module_grads(plain, x, ids, w, dy=dy))
    assert not _same(_module_grads(plain, x, ids, w, dy=dy), ref)
    o = via_recipe.effective_options()
    assert (o["fp8_dtype"], o["checkpoint"], o["block_size"]) == ("float8_e5m2", ("gate_pre", "up"), 128)
    assert "checkpoint=('gate_pre', 'up')" in repr(via_recipe)
    assert plain.effective_options()["fp8_dtype"] == "float8_e4m3fn" and plain.options == {}


def test_dense_module_recipe_equals_loose_keywords_and_overrides_win():
    g = torch.Generator().manual_seed(1)
    x, dy = torch.randn(48, H, generator=g), torch.randn(48, H, generator=g)

    def module(**kw):
        torch.manual_seed(0)  # same initial weights for every module
        return SwiGLUMLP(H, 96, **kw)

    loose = _module_grads(module(fp8_dtype="float8_e5m2", backend="emulate", checkpoint="none"), x, dy=dy)
    assert _same(_module_grads(module(recipe=Recipe(fp8_dtype="e5m2", backend="emulate", checkpoint="none")), x,
                               dy=dy), loose)
    assert _same(_module_grads(module(recipe="mxfp8_e5m2", backend="emulate", checkpoint="none"), x, dy=dy), loose)
    overridden = _module_grads(module(recipe="mxfp8_e5m2", backend="emulate", fp8_dtype="float8_e4m3fn"), x, dy=dy)
    assert _same(overridden, _module_grads(module(backend="emulate"), x, dy=dy))
    assert not _same(overridden, loose)
    # the default recipe runs the simulator on CPU (its "auto"), bit-identical to emulate
    assert _same(_module_grads(module(recipe="mxfp8_e4m3_default"), x, dy=dy), overridden)
    m = module(recipe="mxfp8_e4m3_rceil_emulate", lnc=1)
    assert m.effective_options()["scale_rule"] == "rceil" and m.options == {"lnc": 1}
    assert "backend='emulate'" in repr(m)
    with pytest.raises(ValueError, match="Recipe.quant_scheme must be one of"):
        module(recipe="mxfp8_e5m2", quant_scheme="2x16")
    with pytest.raises(ValueError, match="Recipe.scale_rule='rceil' needs backend='emulate'"):
        module(recipe="mxfp8_e4m3_rceil_emulate", backend="simulator")


def test_dense_op_recipe_keeps_refusing_unknown_keywords():
    x = torch.randn(8, H)
    with pytest.raises(ValueError, match=r"Recipe has no field\(s\) \['block_size'\]"):
        swiglu_mlp_mxfp8(x, torch.randn(192, H), torch.randn(H, 96), recipe="mxfp8_e4m3_emulate", block_size=128)


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_moe_op_and_module_under_autocast(param_dtype):
    """Under a bf16 autocast the op computes as outside it (its math is bf16 with fp32 steps that autocast
    must not re-cast), in the forward and in a backward run inside the autocast region."""
    x, ids, w, wgu, wd, dy = _moe_problem()
    m = MoESwiGLUExperts(wgu.shape[0], H, I, recipe="mxfp8_e4m3_emulate", dtype=param_dtype)
    with torch.no_grad():
        m.gate_up_weight.copy_(wgu)
        m.down_weight.copy_(wd)
    x32 = x.float()
    outside = _module_grads(m, x32, ids, w, dy=dy.float())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = _module_grads(m, x32, ids, w, dy=dy.float())
    assert inside[0].dtype == torch.float32 and _same(inside, outside)
    assert m.gate_up_weight.grad.dtype == param_dtype  # parameter-dtype gradients (fp32 accumulators for fp32)


@pytest.mark.parametrize("module, make", [("SwiGLUMLP", lambda **sizes: SwiGLUMLP(**sizes)),
                                          ("MoESwiGLUExperts", lambda **sizes: MoESwiGLUExperts(2, **sizes))])
@pytest.mark.parametrize("name, value", [("hidden_size", 48), ("intermediate_size", 0), ("hidden_size", True),
                                         ("intermediate_size", 64.0)])
def test_modules_refuse_sizes_that_are_not_positive_multiples_of_32(module, make, name, value):
    """Both op modules check H and I the one way (RecipeLayer._check_sizes), naming themselves, the size and its
    value; a valid pair builds."""
    sizes = {"hidden_size": 64, "intermediate_size": 96, name: value}
    with pytest.raises(ValueError, match=rf"^{module}: {name} must be a positive multiple of 32, got {value!r}$"):
        make(**sizes)
    assert make(hidden_size=64, intermediate_size=96).intermediate_size == 96
