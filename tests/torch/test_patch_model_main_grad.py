"""patch_model with fp32 param.main_grad (Megatron / NxD convention) through the op's accumulate_main_grad.

Needs the op with ``accumulate_main_grad`` (main after the NEURON merge). Expected values: the same patched
model with fp32 parameters holding the same (bf16) values: its .grad is the kernel's fp32 gradient, so
bf16 parameters with main_grad must receive exactly those numbers, on the view path (gate/up packed)
and on the copy path, with adjacent or separate main_grad tensors.
"""
import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from nkilib import patch_model  # noqa: E402
from nkilib.recipe import get_recipe  # noqa: E402

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)
RECIPE = get_recipe("mxfp8_e4m3_emulate", accumulate_main_grad=True)


def _mlp(dtype):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).to(torch.bfloat16).to(dtype)
    patch_model(model, RECIPE)
    return model.model.layers[0].mlp


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 16, 64, generator=g).bfloat16(), torch.randn(2, 16, 64, generator=g).bfloat16()


@pytest.mark.parametrize("adjacent_main_grads", [True, False])
@pytest.mark.parametrize("packed", [True, False])
def test_main_grad_receives_the_fp32_kernel_gradients(adjacent_main_grads, packed):
    reference = _mlp(torch.float32)
    mlp = _mlp(torch.bfloat16)
    if not packed:
        mlp.gate_proj.weight.data = mlp.gate_proj.weight.data.clone()  # the per-call copy path
    assert mlp.gate_up_is_view() == packed
    names = ("gate_proj", "up_proj", "down_proj")
    if adjacent_main_grads:
        flat = torch.zeros(2 * 96 + 64, 64)  # gate, up back to back, then down's [64, 96] elsewhere
        mlp.gate_proj.weight.main_grad, mlp.up_proj.weight.main_grad = flat[:96], flat[96:192]
        mlp.down_proj.weight.main_grad = torch.zeros(64, 96)
    else:
        for n in names:
            getattr(mlp, n).weight.main_grad = torch.zeros_like(getattr(mlp, n).weight, dtype=torch.float32)
    for seed in (1, 2):
        x, dy = _batch(seed)
        reference(x.float()).backward(dy.float())
        mlp(x).backward(dy)
    for n in names:
        p = getattr(mlp, n).weight
        assert torch.equal(p.main_grad, getattr(reference, n).weight.grad), n
        assert p.grad is None, n  # fp32 gradients went to main_grad only
