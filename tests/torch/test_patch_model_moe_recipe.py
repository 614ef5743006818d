"""patch_model's MoE blocks: the recipe reaches the MoE op, torch.autocast, bf16 experts with fp32 main_grad.

Expected values come from moe_swiglu_experts_mxfp8 called with loose keywords on the same Parameters
(recipe), the same module outside autocast (autocast), and the same experts with fp32 parameters holding
the same bf16 values, whose .grad is the op's fp32 gradient (main_grad).
"""
import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from nkilib import get_recipe, patch_model  # noqa: E402
from nkilib.experimental.moe_mxfp8 import moe_swiglu_experts_mxfp8  # noqa: E402
from nkilib.training.moe import HFMoEExperts  # noqa: E402

H, E, K, T = 64, 4, 2, 40
TINY = dict(vocab_size=128, hidden_size=H, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=64, intermediate_size=64, num_local_experts=E, num_experts_per_tok=K)


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**TINY))
    model.set_experts_implementation("eager")
    return model.to(dtype).eval()


def _routed(seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    return x, ids, w, torch.randn(T, H, generator=g)


def _experts_grads(experts, x, ids, w, dy):
    experts.zero_grad()
    y = experts(x, ids, w)
    y.backward(dy.to(y.dtype))
    return y.detach(), experts.gate_up_proj.grad.clone(), experts.down_proj.grad.clone()


def test_patch_model_passes_its_recipe_to_the_moe_op():
    model = _model()
    recipe = get_recipe("mxfp8_e5m2", backend="emulate", checkpoint="none")
    patch_model(model, recipe)
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts, HFMoEExperts) and experts.recipe == recipe
    x, ids, w, dy = _routed()
    got = _experts_grads(experts, x, ids, w, dy)
    experts.zero_grad()
    y = moe_swiglu_experts_mxfp8(x, ids, w, experts.gate_up_proj, experts.down_proj, fp8_dtype="float8_e5m2",
                                 backend="emulate", checkpoint="none")
    y.backward(dy)
    assert torch.equal(got[0], y.detach())
    assert torch.equal(got[1], experts.gate_up_proj.grad) and torch.equal(got[2], experts.down_proj.grad)
    patch_model(model, "mxfp8_e4m3_emulate")  # re-patching changes the recipe the op receives
    assert not torch.equal(_experts_grads(experts, x, ids, w, dy)[1], got[1])


def test_moe_blocks_under_autocast():
    original = _model()  # fp32 master weights
    patched = copy.deepcopy(original)
    patch_model(patched, "mxfp8_e4m3_emulate")
    block_o, block_p = original.model.layers[0].mlp, patched.model.layers[0].mlp
    x = torch.randn(2, 8, H, generator=torch.Generator().manual_seed(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_o, y_p = block_o(x), block_p(x)
    y_o, y_p = (y[0] if isinstance(y, tuple) else y for y in (y_o, y_p))
    assert y_p.dtype == y_o.dtype
    rel = ((y_p.double() - y_o.double()).norm() / y_o.double().norm()).item()
    assert rel <= 8e-3, rel  # bf16 rounding of both (the experts' projections are bf16 under autocast in both)
    y_p.float().sum().backward()
    experts = block_p.experts
    assert experts.gate_up_proj.grad.dtype == torch.float32  # fp32 params get fp32 gradients
    outside = experts.gate_up_proj.grad.clone()
    patched.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a backward run inside autocast is not re-cast
        out = block_p(x)
        (out[0] if isinstance(out, tuple) else out).float().sum().backward()
    assert torch.equal(experts.gate_up_proj.grad, outside)
    with torch.autocast("cpu", dtype=torch.float16), pytest.raises(TypeError, match="bfloat16"):
        block_p(x)


@pytest.mark.parametrize("megatron_flag", [False, True])
def test_bf16_experts_with_fp32_main_grad(megatron_flag):
    reference = _model(torch.bfloat16).float()  # fp32 parameters holding the bf16 values
    patch_model(reference, "mxfp8_e4m3_emulate")
    model = _model(torch.bfloat16)
    patch_model(model, get_recipe("mxfp8_e4m3_emulate", accumulate_main_grad=True))
    ref, experts = reference.model.layers[0].mlp.experts, model.model.layers[0].mlp.experts
    for p in (experts.gate_up_proj, experts.down_proj):
        p.main_grad = torch.zeros_like(p, dtype=torch.float32)
        if megatron_flag:
            p.grad_added_to_main_grad = False
    ref.zero_grad()
    for seed in (1, 2):  # accumulates over two micro-batches
        x, ids, w, dy = _routed(seed)
        ref(x, ids, w).backward(dy)
        y = experts(x.bfloat16(), ids, w)
        assert y.dtype == torch.bfloat16
        y.backward(dy.bfloat16())
    for name in ("gate_up_proj", "down_proj"):
        p, r = getattr(experts, name), getattr(ref, name)
        assert torch.equal(p.main_grad, r.grad), name
        if megatron_flag:
            assert p.grad_added_to_main_grad is True and torch.equal(p.grad, torch.zeros_like(p)), name
        else:
            assert p.grad is None, name  # fp32 gradients went to main_grad only
    bad = experts.gate_up_proj
    bad.main_grad = torch.zeros_like(bad)  # bf16: refused, named
    with pytest.raises(ValueError, match="main_grad must be a float32 tensor"):
        experts(*_routed()[:3])
