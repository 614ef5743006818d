"""patch_model on tiny Qwen3-MoE and Mixtral models: experts on moe_swiglu_experts_mxfp8, the model's router kept.

Needs the MoE op (nkilib.experimental.moe_mxfp8, merged separately from this module); the bounds are
the measured errors of these models (emulate backend, E4M3, seed 0) with a margin, see the asserts.
"""
import copy

import pytest

torch = pytest.importorskip("torch")

from torchkit import rel, logits_and_grads  # noqa: E402
transformers = pytest.importorskip("transformers")

from nkilib import get_recipe, patch_model  # noqa: E402
from nkilib.training import HFSwiGLUMLP  # noqa: E402
from nkilib.training.moe import HFMoEExperts  # noqa: E402

TINY = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=64)
MXFP8_GRAD_PARAMS = ("experts.gate_up_proj", "experts.down_proj", "gate_proj.weight", "up_proj.weight",
                     "down_proj.weight")


def _model(family, seed=0):
    torch.manual_seed(seed)
    if family == "qwen3_moe":  # layer 0 dense (Qwen3MoeMLP), layer 1 sparse
        config = transformers.Qwen3MoeConfig(**TINY, intermediate_size=96, num_experts=4, num_experts_per_tok=2,
                                             moe_intermediate_size=32, mlp_only_layers=[0])
        model = transformers.Qwen3MoeForCausalLM(config)
    else:
        config = transformers.MixtralConfig(**TINY, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2)
        model = transformers.MixtralForCausalLM(config)
    model.set_experts_implementation("eager")  # the per-expert loop (grouped_mm has no float64 for the oracle)
    return model.eval()


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_moe_experts_swapped_router_kept(family):
    original = _model(family)
    patched = copy.deepcopy(original)
    ideal = copy.deepcopy(original).double()
    report = patch_model(patched, "mxfp8_e4m3_emulate")
    experts = [n for n, m in patched.named_modules() if isinstance(m, HFMoEExperts)]
    assert list(report.patched) == (["model.layers.0.mlp", "model.layers.1.mlp.experts"] if family == "qwen3_moe"
                                    else ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"])
    assert experts == [n for n in report.patched if n.endswith("experts")] and not report.unsupported
    if family == "qwen3_moe":
        assert isinstance(patched.model.layers[0].mlp, HFSwiGLUMLP)
    assert list(patched.state_dict()) == list(original.state_dict())
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    logits_o, _ = logits_and_grads(original, ids)
    logits_p, grads_p = logits_and_grads(patched, ids)
    _, grads_i = logits_and_grads(ideal, ids)
    assert torch.equal(patched(ids).logits.argmax(-1), original(ids).logits.argmax(-1))
    errors = {n: rel(g, grads_i[n]) for n, g in grads_p.items() if g is not None}
    # measured (both families): logits 4.5e-4..6.1e-4; expert and dense MLP weights 3.1e-2..5.3e-2; the
    # norm feeding an MLP up to 6.4e-2; routers 3.3e-2..8.2e-2 (their gradient goes through the op's
    # d(topk_weights) and the softmax, which cancels); everything else up to 8.1e-3
    assert 0 < rel(logits_p, logits_o) < 2e-3  # our experts compute in bf16 (the fp32 original does not)
    for name, err in errors.items():
        if name.endswith(MXFP8_GRAD_PARAMS):
            assert 1.5e-2 < err < 7e-2, (name, err)
        elif name.endswith("post_attention_layernorm.weight"):
            assert err < 8e-2, (name, err)
        elif name.endswith("mlp.gate.weight"):
            assert err < 1e-1, (name, err)
        else:
            assert err < 2e-2, (name, err)
    # the router is the model's and trains: its gradient comes through the op's topk_weights gradient
    assert type(patched.model.layers[1].mlp.gate).__name__.endswith("TopKRouter")
    assert "model.layers.1.mlp.gate.weight" in errors


def test_moe_recipe_fields_without_counterpart_are_refused():
    model = _model("mixtral")
    with pytest.raises(ValueError, match="Recipe.forward_numerics='kernel' is not available for MoE experts"):
        patch_model(model, get_recipe("mxfp8_e4m3_emulate", forward_numerics="kernel"))


def test_moe_repatch_with_a_recipe_it_cannot_run_keeps_the_old_one():
    """Re-patching (RecipeModule.set_recipe) with a recipe the MoE op cannot run is refused naming the field, and the
    swapped experts keep the recipe they ran."""
    model = _model("mixtral")
    patch_model(model, "mxfp8_e4m3_emulate")
    experts = [m for m in model.modules() if isinstance(m, HFMoEExperts)]
    with pytest.raises(ValueError, match="Recipe.forward_numerics='kernel' is not available for MoE experts"):
        patch_model(model, get_recipe("mxfp8_e4m3_emulate", forward_numerics="kernel"))
    assert experts and all(e.recipe == get_recipe("mxfp8_e4m3_emulate") for e in experts), experts
