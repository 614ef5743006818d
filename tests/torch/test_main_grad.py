"""fp32 gradient accumulation into ``param.main_grad`` for bf16 parameters (accumulate_main_grad=True).

Expected values: the same kernel run (simulator backend, the real kernel) with fp32 weight gradients,
taken from a layer with fp32 parameters holding the same (bf16-representable) values: its ``.grad`` is
the kernel's fp32 accumulator, never rounded (tests/torch/test_torch_mlp.py checks that against the
mx_exact reference). bf16 parameters with main_grad must receive exactly those numbers.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from nkilib.experimental.mlp_mxfp8 import SwiGLUMLP, swiglu_mlp_mxfp8  # noqa: E402
from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8 import mlp_bwd_mxfp8_torch as T  # noqa: E402
from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8.config import ClampLimits  # noqa: E402

H, I = 64, 64
CLAMP = ClampLimits(non_linear_upper=0.5, linear_lower=-0.4, linear_upper=0.45)


def layer(dtype, backend="simulator", **kw):
    """SwiGLUMLP with seeded bf16-representable weights in `dtype`."""
    g = torch.Generator().manual_seed(0)
    m = SwiGLUMLP(H, I, backend=backend, checkpoint=("gate_pre", "up"), clamp_limits=CLAMP, dtype=dtype, **kw)
    with torch.no_grad():
        m.gate_up_weight.copy_((torch.randn(2 * I, H, generator=g) / H ** 0.5).bfloat16())
        m.down_weight.copy_((torch.randn(H, I, generator=g) / I ** 0.5).bfloat16())
    return m


def batch(seed, S=40):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(S, H, generator=g).bfloat16(), torch.randn(S, H, generator=g).bfloat16()


def fp32_kernel_grads(x, dy, backend="simulator"):
    """(dW_gate_up, dW_down) fp32 from the kernel (fp32 parameters -> weight_grad_dtype float32)."""
    ref = layer(torch.float32, backend)
    ref(x).backward(dy.float())
    assert ref.gate_up_weight.grad.dtype == torch.float32
    return ref.gate_up_weight.grad, ref.down_weight.grad


def with_main_grads(m):
    for p in m.parameters():
        p.main_grad = torch.zeros_like(p, dtype=torch.float32)
    return m


def test_bf16_params_get_the_exact_fp32_kernel_gradients_in_main_grad_over_two_steps():
    (x1, dy1), (x2, dy2) = batch(1), batch(2, S=48)
    want1, want2 = fp32_kernel_grads(x1, dy1), fp32_kernel_grads(x2, dy2)
    m = with_main_grads(layer(torch.bfloat16, accumulate_main_grad=True))
    m(x1).backward(dy1)
    assert torch.equal(m.gate_up_weight.main_grad, want1[0]) and torch.equal(m.down_weight.main_grad, want1[1])
    # the fp32 values really are not bf16 numbers (the bf16 path would have rounded them)
    assert not torch.equal(m.down_weight.main_grad, m.down_weight.main_grad.bfloat16().float())
    m(x2).backward(dy2)  # second micro-batch: accumulates in fp32
    assert torch.equal(m.gate_up_weight.main_grad, want1[0] + want2[0])
    assert torch.equal(m.down_weight.main_grad, want1[1] + want2[1])
    # .grad is left alone (Megatron's fused accumulation convention)
    assert m.gate_up_weight.grad is None and m.down_weight.grad is None
    # without the option the same bf16 layer gets bf16 .grad and main_grad is untouched
    plain = with_main_grads(layer(torch.bfloat16))
    plain(x1).backward(dy1)
    assert plain.down_weight.grad.dtype == torch.bfloat16 and not plain.down_weight.main_grad.any()
    assert torch.equal(plain.down_weight.grad, want1[1].bfloat16())


def test_grad_added_to_main_grad_flag_and_params_without_main_grad():
    """A parameter with ``grad_added_to_main_grad`` (Megatron's DDP) gets the flag set and a zero
    ``.grad`` so hooks on its gradient accumulator fire; a parameter without main_grad gets its
    usual ``.grad`` in its own dtype."""
    x, dy = batch(3)
    want = fp32_kernel_grads(x, dy, backend="emulate")
    m = layer(torch.bfloat16, backend="emulate", accumulate_main_grad=True)
    m.gate_up_weight.main_grad = torch.zeros(2 * I, H)
    m.gate_up_weight.grad_added_to_main_grad = False
    fired = []
    m.gate_up_weight.register_post_accumulate_grad_hook(lambda p: fired.append(p.grad.clone()))
    m(x).backward(dy)
    assert m.gate_up_weight.grad_added_to_main_grad is True
    assert len(fired) == 1 and not fired[0].any() and fired[0].dtype == torch.bfloat16
    assert torch.equal(m.gate_up_weight.main_grad, want[0])
    assert m.down_weight.grad.dtype == torch.bfloat16  # no main_grad: plain .grad
    assert torch.equal(m.down_weight.grad, want[1].bfloat16())


def test_main_grad_under_torch_compile_and_no_grad():
    x, dy = batch(4)
    want = fp32_kernel_grads(x, dy, backend="emulate")
    m = with_main_grads(layer(torch.bfloat16, backend="emulate", accumulate_main_grad=True))
    torch._dynamo.reset()
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")  # AOTAutograd traces the sinks
    compiled(x).backward(dy)
    torch._dynamo.reset()
    assert torch.equal(m.gate_up_weight.main_grad, want[0]) and torch.equal(m.down_weight.main_grad, want[1])
    with torch.no_grad():  # inference: no sink, nothing accumulated
        y = m(x)
    assert not y.requires_grad and torch.equal(m.down_weight.main_grad, want[1])


def test_opcheck_with_main_grad_sinks():
    x, dy = batch(5, S=6)
    m = with_main_grads(layer(torch.bfloat16, backend="emulate"))
    sinks = [T._MainGradSink.apply(p) for p in m.parameters()]
    args = (x.clone().requires_grad_(), m.gate_up_weight, m.down_weight, *sinks, None, 0.5, -0.4, 0.45,
            "float8_e4m3fn", "1x32", "mxfp8", "neuron", "float32", "torch", "emulate", 1, True, False, True, False)
    torch.library.opcheck(T.swiglu_mlp_mxfp8_op, args)


def test_main_grad_errors_name_the_argument():
    x, _ = batch(6, S=8)
    m = layer(torch.bfloat16, backend="emulate", accumulate_main_grad=True)
    m.down_weight.main_grad = torch.zeros(H, I, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"down_weight.main_grad must be a float32 tensor of shape \(64, 64\).*"
                                         r"got torch.bfloat16 \(64, 64\)"):
        m(x)
    m.down_weight.main_grad = torch.zeros(H, 2 * I)
    with pytest.raises(ValueError, match=r"down_weight.main_grad must be .*got torch.float32 \(64, 128\)"):
        m(x)
    m.gate_up_weight.main_grad = torch.zeros(2 * I, H)
    with pytest.raises(ValueError, match="weight_grad_dtype must be None or torch.float32, got torch.bfloat16"):
        swiglu_mlp_mxfp8(x, m.gate_up_weight, m.down_weight.detach().requires_grad_(), backend="emulate",
                         accumulate_main_grad=True, weight_grad_dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="accumulate_main_grad must be True or False, got 'yes'"):
        swiglu_mlp_mxfp8(x, m.gate_up_weight, m.down_weight, backend="emulate", accumulate_main_grad="yes")


def test_main_grad_inside_torch_utils_checkpoint_is_added_once():
    """Activation checkpointing recomputes the forward (and so the sinks) but runs the original
    backward only: main_grad receives the gradient exactly once."""
    from torch.utils.checkpoint import checkpoint

    x, dy = batch(7)
    want = fp32_kernel_grads(x, dy, backend="emulate")
    m = with_main_grads(layer(torch.bfloat16, backend="emulate", accumulate_main_grad=True))
    checkpoint(m, x.clone().requires_grad_(), use_reentrant=False).backward(dy)
    assert torch.equal(m.gate_up_weight.main_grad, want[0]) and torch.equal(m.down_weight.main_grad, want[1])
