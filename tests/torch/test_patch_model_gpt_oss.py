"""patch_model on a tiny GPT-OSS model: GptOssExperts on moe_swiglu_experts_mxfp8 (activation "gpt_oss", biases,
interleaved gate/up), the model's router kept.

The ideal is the original model in float64 (transformers' own GptOssExperts.forward); the bounds are the measured
errors (emulate backend, E4M3, seed 0) with a margin, see the asserts.
"""
import copy

import pytest

torch = pytest.importorskip("torch")

from torchkit import rel, logits_and_grads  # noqa: E402
transformers = pytest.importorskip("transformers")

from nkilib import patch_model  # noqa: E402
from nkilib.training.moe import HFGptOssExperts  # noqa: E402
from nkilib.training.patch import PENDING_CLASSES  # noqa: E402

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, swiglu_limit=7.0,
            max_position_embeddings=64, sliding_window=8)


def _model(seed=0, limit=7.0, scale=1.0):
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**dict(TINY, swiglu_limit=limit)))
    model.set_experts_implementation("eager")  # the per-expert loop (float64 for the ideal)
    with torch.no_grad():  # the init (std 0.02, zero biases) would leave the experts' biases and clamps untested
        for layer in model.model.layers:
            ex = layer.mlp.experts
            ex.gate_up_proj.normal_(0.0, 64 ** -0.5 * scale)
            ex.down_proj.normal_(0.0, 32 ** -0.5)
            ex.gate_up_proj_bias.normal_(0.0, 0.2 * scale)
            ex.down_proj_bias.normal_(0.0, 0.2)
            layer.mlp.router.weight.normal_(0.0, 0.3)
    return model.eval()


def test_gpt_oss_experts_swapped_router_kept():
    assert "GptOssExperts" not in PENDING_CLASSES
    original = _model()
    patched = copy.deepcopy(original)
    ideal = copy.deepcopy(original).double()
    params_before = dict(patched.named_parameters())
    report = patch_model(patched, "mxfp8_e4m3_emulate")
    assert list(report.patched) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert not report.unsupported
    assert all(isinstance(patched.model.layers[i].mlp.experts, HFGptOssExperts) for i in (0, 1))
    assert list(patched.state_dict()) == list(original.state_dict())
    for n, p in patched.named_parameters():  # the model's Parameter objects, not copies
        assert p is params_before[n], n
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    logits_p, grads_p = logits_and_grads(patched, ids)
    logits_i, grads_i = logits_and_grads(ideal, ids)
    # the yardstick: all-bf16 model
    logits_b, grads_b = logits_and_grads(copy.deepcopy(original).to(torch.bfloat16), ids)
    errors = {n: rel(g, grads_i[n]) for n, g in grads_p.items() if g is not None}
    bf16_errors = {n: rel(g, grads_i[n]) for n, g in grads_b.items() if g is not None}
    print({n: f"{e:.2e} (bf16 model {bf16_errors[n]:.2e})" for n, e in errors.items()})
    print("logits", rel(logits_p, logits_i), "bf16 model", rel(logits_b, logits_i))
    # the forward is within bf16 error: below the error of the whole model cast to bf16 (measured 8.7e-3 vs 1.1e-2)
    assert 0 < rel(logits_p, logits_i) < rel(logits_b, logits_i)
    # gradients within the MXFP8 error (E4M3: 3 mantissa bits against bf16's 7): measured 0.3x..3.2x the all-bf16
    # model's error (expert weights 2.8e-2..6.4e-2; attention sinks of layer 0 1.9e-1, 1.05e-1 in bf16)
    for name, err in errors.items():
        assert err < 4 * bf16_errors[name], (name, err, bf16_errors[name])
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            assert 1e-2 < err < 8e-2, (name, err)
    for suffix in ("experts.gate_up_proj_bias", "experts.down_proj_bias", "router.weight", "router.bias"):
        assert f"model.layers.1.mlp.{suffix}" in errors, suffix  # biases and the router train
    assert type(patched.model.layers[1].mlp.router).__name__ == "GptOssTopKRouter"


def test_gpt_oss_block_clamped_gradients():
    """One GptOssMLP block whose clamps are hit (limit 0.5): gradients of x, the four expert parameters and the
    router against the float64 original; the down bias's gradient (sum of p * dY) is exact to float32."""
    block = _model(seed=6, limit=0.5, scale=2.0).model.layers[0].mlp
    ideal, bf16 = copy.deepcopy(block).double(), copy.deepcopy(block).to(torch.bfloat16)
    patch_model(block, "mxfp8_e4m3_emulate")
    x = torch.randn(1, 96, 64, generator=torch.Generator().manual_seed(7))
    dy = torch.randn(1, 96, 64, generator=torch.Generator().manual_seed(8))
    outs = []
    for m, dt in ((block, torch.float32), (ideal, torch.float64), (bf16, torch.bfloat16)):
        xx = x.to(dt).detach().requires_grad_()
        y, _ = m(xx)
        (y * dy.to(dt)).sum().backward()
        outs.append({"y": y.detach(), "dx": xx.grad, **{n: p.grad for n, p in m.named_parameters()}})
    got, want, yardstick = outs
    gate_up = x.reshape(96, 64).double() @ ideal.experts.gate_up_proj.detach() + \
        ideal.experts.gate_up_proj_bias.detach()[:, None]
    assert 0.1 < (gate_up[..., ::2] > 0.5).double().mean() < 0.7  # the gate's upper clamp is hit
    assert 0.1 < (gate_up[..., 1::2].abs() > 0.5).double().mean() < 0.9  # and up's two-sided one
    errors = {n: (rel(g, want[n]), rel(yardstick[n], want[n])) for n, g in got.items()}
    print({n: f"{e:.2e} (bf16 block {b:.2e})" for n, (e, b) in errors.items()})
    # measured (MXFP8 / the bf16 block): y 5.5e-3 / 6.9e-3; with the clamp masks hit, dx 9.6e-2 / 8.3e-2,
    # gate_up_proj 1.04e-1 / 8.9e-2, gate_up_proj_bias 9.4e-2 / 8.7e-2; down_proj 3.8e-2 / 7.5e-3 (MXFP8's usual
    # error, no mask on that path); router 4.0e-2..7.6e-2 / 1.0e-2..2.1e-2 (through d_topk_weights and the
    # softmax); down_proj_bias 1.7e-7: float32 sums of p * dY with the same dY
    assert errors["y"][0] < errors["y"][1]
    assert errors["experts.down_proj_bias"][0] < 1e-6
    for name in ("dx", "experts.gate_up_proj", "experts.gate_up_proj_bias", "experts.down_proj", "router.weight",
                 "router.bias"):
        err, bf16_err = errors[name]
        assert 1e-2 < err < 0.15 and err < 6 * bf16_err, (name, err, bf16_err)


def test_gpt_oss_experts_state_dict_round_trip():
    model = _model(seed=3)
    patch_model(model, "mxfp8_e4m3_emulate")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    fresh = _model(seed=4)
    patch_model(fresh, "mxfp8_e4m3_emulate")
    fresh.load_state_dict(state)
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(5))
    assert torch.equal(fresh(ids).logits, model(ids).logits)


@pytest.mark.parametrize("recipe,match", [(dict(checkpoint="none"), "keeps gate_pre and up"),
                                          (dict(checkpoint=("gate_pre", "gate_act")), "keeps gate_pre and up")])
def test_gpt_oss_refuses_recipes_it_cannot_run(recipe, match):
    from nkilib.recipe import Recipe

    with pytest.raises(ValueError, match=match):
        patch_model(_model(), Recipe(**recipe))
    patched = _model()
    patch_model(patched, "mxfp8_e4m3_emulate")
    with pytest.raises(ValueError, match=match):  # re-patching with a recipe it cannot run keeps the old one
        patch_model(patched, Recipe(**recipe))
    assert patched.model.layers[0].mlp.experts.recipe.backend == "emulate"


def test_gpt_oss_on_the_simulator_backend_equals_emulate():
    """GPT-OSS experts on the kernel (simulator backend; the gate_up bias gradient is the kernel's output): the
    same logits and the same gradients, bit for bit, as on the emulate backend."""
    from nkilib.recipe import Recipe

    runs = []
    for backend in ("emulate", "simulator"):
        model = _model(seed=9)
        patch_model(model, Recipe(backend=backend))
        assert model.model.layers[0].mlp.experts.recipe.backend == backend
        runs.append(logits_and_grads(model, torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(2))))
    (logits_e, grads_e), (logits_s, grads_s) = runs
    assert torch.equal(logits_e, logits_s)
    bias = "model.layers.0.mlp.experts.gate_up_proj_bias"
    assert grads_s[bias] is not None and grads_s[bias].abs().sum() > 0
    for name, g in grads_e.items():
        assert (g is None) == (grads_s[name] is None), name
        assert g is None or torch.equal(g, grads_s[name]), name


def test_gpt_oss_alpha_must_be_gelu_apprx_sigmoids():
    model = _model()
    model.model.layers[0].mlp.experts.alpha = 1.5
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.alpha .* must be 1\.702.*got 1\.5"):
        patch_model(model, "mxfp8_e4m3_emulate")
