"""The opt-in fast emulation (backend "emulate_fast", gemm="fast" / "fp32"): the exact emulation's MX operands,
float32-accumulating GEMMs; its measured distance from the exact emulation (bounded) and from the MXFP8
error; its plumbing through the dense and MoE ops and the recipes; the default stays bit-exact.

CPU here, so "fast" means "fp32" (IEEE float32 GEMMs); "bf16" (CUDA's tensor-core path) is measured by
simulations/emulate_speed.py on a GPU.
"""
import pytest

torch = pytest.importorskip("torch")

from moekit import make_routing, moe_inputs  # noqa: E402
from simkit import to_torch  # noqa: E402
from torchkit import rel  # noqa: E402

from nkilib.experimental.mlp_mxfp8 import swiglu_mlp_mxfp8  # noqa: E402
from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8 import mlp_bwd_mxfp8_emulate as emu  # noqa: E402
from nkilib.experimental.moe_mxfp8 import moe_swiglu_experts_mxfp8  # noqa: E402
from nkilib.recipe import Recipe, get_recipe  # noqa: E402

# K = H = 640 and K = 2I = 1536 span several 512-wide tiles (one 128 tail), K = S = 384 one tile
S, H, I = 384, 640, 768


def _inputs(seed=0):
    """bf16 operands of a trained-looking MLP (unit x, 1/sqrt(fan-in) weights, small dY) and the bf16
    checkpoints the layer's forward saves."""
    g = torch.Generator().manual_seed(seed)
    bf = torch.bfloat16
    x = torch.randn(S, H, generator=g).to(bf)
    dy = (torch.randn(S, H, generator=g) * 1e-2).to(bf)
    w_gu = (torch.randn(2 * I, H, generator=g) * H ** -0.5).to(bf)
    w_down = (torch.randn(H, I, generator=g) * I ** -0.5).to(bf)
    gate_pre = (x.float() @ w_gu[:I].float().t()).to(bf)  # K=H, M=S, N=I
    up = (x.float() @ w_gu[I:].float().t()).to(bf)  # K=H, M=S, N=I
    gate_act, intermediate = emu.swiglu_activations(gate_pre, up)
    return (dy, x, w_down, w_gu, gate_pre, gate_act, up, intermediate)


def _differences(fast, exact) -> dict:
    """`fast` against `exact`: the fraction of elements that differ, the mean elementwise relative error (over
    exact != 0), the largest difference relative to the largest |exact| and the relative Frobenius error.
    (The largest elementwise relative error is not a useful bound: where a sum cancels to a tiny value,
    any float32 summation order moves it by a large fraction of itself.)"""
    f, e = fast.double(), exact.double()
    d = (f - e).abs()
    nz = e != 0
    return {"differ": (f != e).double().mean().item(), "mean_rel": (d[nz] / e[nz].abs()).mean().item(),
            "max_vs_max": (d.max() / e.abs().max()).item(), "norm_rel": rel(f, e)}


def test_fast_gemm_takes_the_exact_emulations_mx_operands():
    """contract_matmul(gemm="fp32") is one float32 GEMM of mx_quantize_dequantize's operands (the same MX
    values as the exact path) and differs from the exact per-tile sums only by float32 summation."""
    g = torch.Generator().manual_seed(1)
    a = torch.randn(96, 1152, generator=g).to(torch.bfloat16)  # K = 1152: two full tiles and a 128 tail
    b = torch.randn(1152, 80, generator=g).to(torch.bfloat16)
    fast = emu.contract_matmul(a, b, gemm="fp32")
    a_q = emu.mx_quantize_dequantize(a, 1)
    b_q = emu.mx_quantize_dequantize(b, 0)
    assert torch.equal(fast, a_q @ b_q)  # K=1152, M=96, N=80
    exact = emu.contract_matmul(a, b)
    assert torch.equal(exact, emu.contract_matmul(a, b, gemm="exact"))
    diff = _differences(fast, exact)
    assert 0 < diff["differ"] and diff["norm_rel"] < 1e-6, diff  # float32 rounding, not quantization
    assert torch.equal(emu.contract_matmul(a, b, gemm="fast"), fast)  # "fast" is "fp32" off CUDA


def test_fast_backward_distance_from_exact_is_bounded():
    """Per gradient against the exact emulation, measured at (S, H, I) = (384, 640, 768):
        bf16 outputs (dX; weight gradients of bf16 parameters): 4.1e-5 (dX), 2.4e-5 (dW_gate_up), 1.2e-5
            (dW_down) of the elements differ (bf16 roundings flipped by the float32 summation, and what a
            flipped bf16 d_gate / d_up propagates into dX); mean relative error <= 2.3e-7; largest difference
            <= 6.7e-4 of the largest |value|; relative Frobenius error <= 8e-6;
        float32 weight gradients: 23% / 15% of the elements differ, relative Frobenius <= 4e-8, largest
            difference <= 1e-7 of the largest |value|.
    Bounds ~5x those. The MXFP8 error itself (against float64 autograd) is ~4-5%: 3-4 orders of magnitude
    more, and the fast mode carries it unchanged.
    Run with the table quantizer ("off"): every quantizer mode gives the same bits (test_emulate_numerics), and at
    this shape "auto" would torch.compile the fused one for each operand shape (compile latency, most of this
    test's cost on the CI machine before) without changing what it measures: the GEMMs' summation."""
    previous = emu.set_fused_quantizer("off")
    try:
        _check_fast_backward_distance()
    finally:
        emu.set_fused_quantizer(previous)


def _check_fast_backward_distance():
    args = _inputs()
    bounds = {"differ": 5e-4, "mean_rel": 2e-6, "max_vs_max": 5e-3, "norm_rel": 5e-5}
    exact = emu.mlp_backward_emulate(*args)
    fast = emu.mlp_backward_emulate(*args, gemm="fast")
    for name, f, e in zip(("dX", "dW_gate_up", "dW_down"), fast, exact):
        d = _differences(f, e)
        assert d["differ"] > 0, (name, d)  # the fast mode is really not the exact one
        assert all(d[k] <= v for k, v in bounds.items()), (name, d)
    exact32 = emu.mlp_backward_emulate(*args, weight_grad_dtype=torch.float32)
    fast32 = emu.mlp_backward_emulate(*args, weight_grad_dtype=torch.float32, gemm="fast")
    for name, f, e in zip(("dW_gate_up", "dW_down"), fast32[1:], exact32[1:]):
        d = _differences(f, e)
        assert 0.01 < d["differ"] < 0.6 and d["max_vs_max"] < 1e-6 and d["norm_rel"] < 5e-7, (name, d)
    # against the float64 ideal the fast mode carries the same MXFP8 error as the exact one
    dy, x, w_down, w_gu = (t.double() for t in args[:4])
    x.requires_grad_(True)
    w_gu.requires_grad_(True)
    w_down.requires_grad_(True)
    gate, up = (x @ w_gu.t()).chunk(2, dim=-1)  # K=H, M=S, N=2I
    ((torch.nn.functional.silu(gate) * up) @ w_down.t()).backward(dy)  # K=I, M=S, N=H
    for f, e, ideal in zip(fast, exact, (x.grad, w_gu.grad, w_down.grad)):
        mx_error = rel(e, ideal)
        assert 0.01 < mx_error < 0.1 and abs(rel(f, ideal) - mx_error) < 1e-3 * mx_error


def test_emulate_fast_backend_runs_the_op_and_recipes():
    """backend="emulate_fast" (and its preset) reaches the fast GEMMs; the default emulate stays exact; the
    study scale rules are allowed on it, as on emulate."""
    g = torch.Generator().manual_seed(2)
    x0 = torch.randn(64, 96, generator=g).to(torch.bfloat16)
    w_gu0 = (torch.randn(2 * 160, 96, generator=g) / 10).to(torch.bfloat16)
    w_down0 = (torch.randn(96, 160, generator=g) / 12).to(torch.bfloat16)
    dy = torch.randn(64, 96, generator=g).to(torch.bfloat16)

    def grads(**kwargs):
        x, w_gu, w_down = (t.clone().requires_grad_(True) for t in (x0, w_gu0, w_down0))
        swiglu_mlp_mxfp8(x, w_gu, w_down, **kwargs).backward(dy)
        return x.grad, w_gu.grad, w_down.grad

    exact, fast = grads(backend="emulate"), grads(backend="emulate_fast")
    preset = grads(**get_recipe("mxfp8_e4m3_emulate_fast").to_kwargs())
    assert all(torch.equal(a, b) for a, b in zip(fast, preset))
    assert not all(torch.equal(a, b) for a, b in zip(fast, exact))
    assert max(rel(a, b) for a, b in zip(fast, exact)) < 1e-4
    # forward_numerics="kernel" uses the backend's GEMMs too (and stays close)
    assert max(rel(a, b) for a, b in zip(grads(backend="emulate_fast", forward_numerics="kernel"),
                                         grads(backend="emulate", forward_numerics="kernel"))) < 1e-4
    rceil = grads(backend="emulate_fast", scale_rule="rceil")
    assert max(rel(a, b) for a, b in zip(rceil, grads(backend="emulate", scale_rule="rceil"))) < 1e-4
    assert Recipe(scale_rule="ocp_floor", backend="emulate_fast").backend == "emulate_fast"
    with pytest.raises(ValueError, match="needs backend='emulate' or 'emulate_fast'"):
        Recipe(scale_rule="rceil", backend="simulator")
    assert get_recipe("mxfp8_e4m3_emulate").backend == "emulate"  # the emulate presets stay exact


def test_emulate_fast_moe_op_is_close_to_emulate():
    ids, e = make_routing("random", 0)
    inp = moe_inputs(ids, e, H=64, I=96, seed=0)
    bf = torch.bfloat16
    base = (to_torch(inp["hidden_states"]).to(bf), to_torch(inp["topk_weights"]),
            to_torch(inp["gate_up_weight"]).to(bf), to_torch(inp["down_weight"]).to(bf))
    dy = to_torch(inp["output_grad"]).to(bf)

    def grads(backend):
        x, w, w_gu, w_down = (t.clone().requires_grad_(True) for t in base)
        moe_swiglu_experts_mxfp8(x, torch.from_numpy(ids), w, w_gu, w_down, backend=backend).backward(dy)
        return x.grad, w.grad, w_gu.grad, w_down.grad

    exact, fast = grads("emulate"), grads("emulate_fast")
    assert not all(torch.equal(a, b) for a, b in zip(fast, exact))
    assert max(rel(a, b) for a, b in zip(fast, exact)) < 1e-4


def test_fast_gemm_restores_torch_matmul_settings_and_checks_gemm():
    previous = torch.get_float32_matmul_precision()
    reduced = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    torch.set_float32_matmul_precision("high")  # a user's TF32 setting must not leak into, nor be lost by, the call
    try:
        a = torch.randn(32, 64).to(torch.bfloat16)
        emu.contract_matmul(a, a.t(), gemm="fp32")
        assert torch.get_float32_matmul_precision() == "high"
        assert torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction == reduced
    finally:
        torch.set_float32_matmul_precision(previous)
    with pytest.raises(ValueError, match="gemm must be one of"):
        emu.contract_matmul(a, a.t(), gemm="tf32")
    with pytest.raises(ValueError, match="gemm='bf16' needs CUDA tensors"):
        emu.contract_matmul(a, a.t(), gemm="bf16")


@pytest.mark.parametrize("quantizer", ["off", "eager"])
@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
def test_bf16_dequantized_operands_are_the_float32_ones_rounded_once(quantizer, fmt):
    """gemm="bf16" (CUDA) asks the quantizer for bf16 values directly: they equal the float32 values rounded to
    bf16 (exact wherever bf16's range holds them), with either quantizer, on adversarial values."""
    from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8 import mlp_bwd_mxfp8_emulate_fused as fused

    previous = emu.set_fused_quantizer(quantizer)
    try:
        v = fused.probe_values("cpu").to(torch.bfloat16)
        opts = dict(fmt=emu.element_format(fmt), quant_scheme="1x32", scale_rule="neuron", k_tile=512)
        got = emu._quantize_dequantize(v, 1, out_dtype=torch.bfloat16, **opts)
        want = emu._quantize_dequantize(v, 1, out_dtype=torch.float32, **opts).to(torch.bfloat16)
    finally:
        emu.set_fused_quantizer(previous)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(torch.nan_to_num(got).view(torch.int16), torch.nan_to_num(want).view(torch.int16))
    finite = want[~want.isnan()]
    assert (finite != 0).sum() > 500 and finite.abs().max() > 2.0 ** 100  # the probe reaches the scale extremes
