"""PyTorch integration (mlp_bwd_mxfp8_torch.py): swiglu_mlp_mxfp8 / SwiGLUMLP, custom ops, autograd.

Expected values: torch autograd of an fp64 SwiGLU MLP written here (the ideal), reference.py in mode
"mx_exact" (the kernel's exact numerics, tight) and "fp32" (to measure the MX error the loose bounds
use), and the kernel on the simulator. Backward runs use backend="simulator" (the real kernel) unless
a test is about the emulate backend.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torchkit import rel  # noqa: E402

from nkilib.experimental.mlp_mxfp8 import SwiGLUMLP, swiglu_mlp_mxfp8  # noqa: E402
from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8 import mlp_bwd_mxfp8_torch as T  # noqa: E402
from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8.config import ClampLimits  # noqa: E402
from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8.reference import (  # noqa: E402
    error_report, mlp_backward_reference, reference_phase0_recompute)
from simkit import assert_outputs_identical, bits_equal, to_numpy  # noqa: E402

CLAMP = ClampLimits(non_linear_lower=-0.6, non_linear_upper=0.5, linear_lower=-0.4, linear_upper=0.45)
SUBSETS = [tuple(n for n, k in zip(T.CHECKPOINT_NAMES, keep) if k)
           for keep in itertools.product((False, True), repeat=4)]


def make(S, H, I, seed, x_dtype=torch.bfloat16, w_dtype=torch.bfloat16):
    """Seeded (x [S, H], gate_up_weight [2I, H], down_weight [H, I], dy [S, H]) on CPU; values are
    bf16-representable whatever the dtype, so fp32 and bf16 variants carry the same numbers."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(S, H, generator=g).bfloat16().to(x_dtype)
    wgu = (torch.randn(2 * I, H, generator=g) / H ** 0.5).bfloat16().to(w_dtype)
    wd = (torch.randn(H, I, generator=g) / I ** 0.5).bfloat16().to(w_dtype)
    dy = torch.randn(S, H, generator=g).bfloat16().to(x_dtype)
    return x, wgu, wd, dy


def grads(fn, x, wgu, wd, dy, leaf_dtype=None):
    """(y, dX, dW_gate_up, dW_down) of y = fn(x, wgu, wd) under the cotangent dy (fresh leaves, of
    leaf_dtype if given)."""
    a, b, c = (t.detach().clone().to(leaf_dtype or t.dtype).requires_grad_() for t in (x, wgu, wd))
    y = fn(a, b, c)
    y.backward(dy.to(y.dtype).reshape(y.shape))
    return y.detach(), a.grad, b.grad, c.grad


def ideal_fn(clamp=None):
    """The ideal clamped SwiGLU MLP in float64 torch ops (autograd gives the fp64 gradients)."""
    c = clamp or ClampLimits()

    def clip(v, lo, hi):  # torch.clamp with inclusive-bound gradients, any bound may be None
        return v if lo is None and hi is None else torch.clamp(v, lo, hi)

    def fn(x, wgu, wd):
        x, wgu, wd = x.double(), wgu.double(), wd.double()
        n_i = wd.shape[1]
        g = clip(x @ wgu[:n_i].T, c.non_linear_lower, c.non_linear_upper)
        u = clip(x @ wgu[n_i:].T, c.linear_lower, c.linear_upper)
        return (torch.nn.functional.silu(g) * u) @ wd.T

    return fn


def mx(checkpoint="all", **kw):
    kw.setdefault("backend", "simulator")
    return lambda x, wgu, wd: swiglu_mlp_mxfp8(x, wgu, wd, checkpoint=checkpoint, **kw)


bitwise_equal = bits_equal  # simkit: dtype, shape and bit pattern


def forward_checkpoints(x, wgu, wd, clamp=None) -> dict:
    """The four bf16 checkpoints the default forward saves, as numpy: gate_pre / up are torch bf16
    matmuls; gate_act / intermediate follow from them by the contract's phase-0 formulas, computed
    here by the NumPy reference (independent of the torch layer's own code)."""
    n_i = wd.shape[1]
    xb, wb = x.bfloat16(), wgu.bfloat16()
    gp, up = to_numpy(xb @ wb[:n_i].T), to_numpy(xb @ wb[n_i:].T)
    return reference_phase0_recompute(to_numpy(xb), to_numpy(wb), gate_pre=gp, up=up, clamp_limits=clamp)._asdict()


def np_inputs(x, wgu, wd, dy):
    return dict(output_grad=to_numpy(dy.bfloat16()), hidden_states=to_numpy(x.bfloat16()),
                down_proj_weight=to_numpy(wd.bfloat16()), gate_up_weights=to_numpy(wgu.bfloat16()))


# ---------------------------------------------------------------------------------------------
# gradients: ideal (loose, bounded by the measured MX error) and mx_exact (tight)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fp8", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("clamp", [None, CLAMP], ids=["noclamp", "clamp"])
def test_gradients_vs_fp64_autograd_bounded_by_measured_mx_error(fp8, clamp):
    x, wgu, wd, dy = make(96, 128, 160, seed=1)
    _, *ideal = grads(ideal_fn(clamp), x, wgu, wd, dy, torch.float64)
    # the MX error of the kernel's numerics on these inputs, measured with the NumPy references
    ref_in = np_inputs(x, wgu, wd, dy)
    exact = mlp_backward_reference(**ref_in, clamp_limits=clamp, fp8_dtype=fp8, mode="mx_exact")
    fp32 = mlp_backward_reference(**ref_in, clamp_limits=clamp, fp8_dtype=fp8, mode="fp32")
    for f, i in zip(fp32, ideal):  # the two ideals agree (independent code)
        assert rel(torch.from_numpy(f), i) < 1e-6
    # (with clamps the MX recompute of gate_pre / up moves elements across the clamp limits, which
    # switches their gradient on or off: the measured error of policy "none" grows to ~0.25-0.4)
    measured = [error_report(e, f)["rel_fro"] for e, f in zip(exact, fp32)]
    assert all(0.01 < m < (0.09 if fp8 == "float8_e4m3fn" else 0.18) * (5 if clamp else 1) for m in measured), measured
    for policy in ("all", "none"):
        _, *got = grads(mx(policy, fp8_dtype=fp8, clamp_limits=clamp), x, wgu, wd, dy)
        for name, g, i, m in zip(("dX", "dW_gate_up", "dW_down"), got, ideal, measured):
            assert g.dtype == torch.bfloat16
            assert rel(g, i) <= 1.25 * m + 2e-3, f"{policy} {name}: {rel(g, i):.4f} vs measured MX error {m:.4f}"


@pytest.mark.parametrize("lnc", [1, 2])
@pytest.mark.parametrize("clamp", [None, CLAMP], ids=["noclamp", "clamp"])
def test_every_policy_matches_mx_exact_bit_for_bit(lnc, clamp):
    """All 16 checkpoint subsets: the gradients are exactly mx_exact fed with what the policy saves
    (gate_pre / up from the torch forward; missing ones recomputed by the reference)."""
    x, wgu, wd, dy = make(70, 96, 64, seed=2)
    ckpts = forward_checkpoints(x, wgu, wd, clamp)
    ref_in = np_inputs(x, wgu, wd, dy)
    for subset in SUBSETS:
        _, *got = grads(mx(subset, clamp_limits=clamp, lnc=lnc), x, wgu, wd, dy)
        want = mlp_backward_reference(**ref_in, **{k: ckpts[k] for k in subset}, clamp_limits=clamp)
        assert_outputs_identical(tuple(to_numpy(g) for g in got), want, f"policy {subset} lnc={lnc}")


def test_cross_policy_identity_and_the_recompute_difference():
    """What is true across policies (module docstring): every policy keeping gate_pre and up gives
    gradients bit-identical to "all"; a policy without them differs by the MXFP8 recompute of the
    projections, by an amount of the order of the MX backward error itself (measured bounds)."""
    x, wgu, wd, dy = make(96, 128, 96, seed=3)
    _, *ideal = grads(ideal_fn(), x, wgu, wd, dy, torch.float64)
    _, *base = grads(mx("all"), x, wgu, wd, dy)
    differing = []
    for subset in SUBSETS:
        _, *got = grads(mx(subset), x, wgu, wd, dy)
        same = all(bitwise_equal(g, b) for g, b in zip(got, base))
        if "gate_pre" in subset and "up" in subset:
            assert same, f"policy {subset} should equal 'all' bit for bit"
        else:
            assert not same, f"policy {subset} recomputes a projection in MXFP8, so it should differ from 'all'"
            differing.append(subset)
            for g, b, i in zip(got, base, ideal):
                assert rel(g, b) < 0.09  # of the order of the MX error (~0.05 here)
                assert rel(g, i) < 0.09  # and still that close to the ideal
    assert len(differing) == 12


@pytest.mark.parametrize("backend", ["simulator", "emulate"])
def test_forward_numerics_kernel_makes_every_policy_identical(backend):
    """forward_numerics="kernel" saves exactly what the kernel recomputes: all 16 policies agree."""
    x, wgu, wd, dy = make(48, 64, 96, seed=4)
    outs = [grads(mx(s, forward_numerics="kernel", clamp_limits=CLAMP, backend=backend), x, wgu, wd, dy)
            for s in SUBSETS]
    for o in outs[1:]:
        for a, b in zip(o, outs[0]):
            assert bitwise_equal(a, b)
    # and differs from the default torch forward (so the option does something)
    default = grads(mx("all", clamp_limits=CLAMP, backend=backend), x, wgu, wd, dy)
    assert not bitwise_equal(default[0], outs[0][0])


def test_emulate_backend_equals_simulator_backend():
    x, wgu, wd, dy = make(66, 96, 128, seed=5)
    for policy, clamp in (("all", None), ("none", CLAMP), (("gate_pre", "intermediate"), CLAMP)):
        a = grads(mx(policy, clamp_limits=clamp, backend="simulator", quant_scheme="wrapX"), x, wgu, wd, dy)
        b = grads(mx(policy, clamp_limits=clamp, backend="emulate", quant_scheme="wrapX"), x, wgu, wd, dy)
        assert all(bitwise_equal(p, q) for p, q in zip(a, b)), policy


def test_bf16_matmul_precision_path():
    """matmul_precision="bf16" (Trn2's path) on the simulator target trn2 equals mx_exact's bf16 mode and
    is ~10x closer to the ideal than MXFP8."""
    x, wgu, wd, dy = make(64, 64, 64, seed=6)
    _, *got = grads(mx("none", matmul_precision="bf16", backend="emulate"), x, wgu, wd, dy)
    want = mlp_backward_reference(**np_inputs(x, wgu, wd, dy), matmul_precision="bf16")
    assert_outputs_identical(tuple(to_numpy(g) for g in got), want, "bf16 precision")
    _, *ideal = grads(ideal_fn(), x, wgu, wd, dy, torch.float64)
    assert all(rel(g, i) < 0.01 for g, i in zip(got, ideal))


def test_bf16_matmul_precision_on_trn2_simulator(set_target):
    set_target("trn2")
    x, wgu, wd, dy = make(40, 64, 64, seed=7)
    a = grads(mx("none", matmul_precision="bf16"), x, wgu, wd, dy)
    b = grads(mx("none", matmul_precision="bf16", backend="emulate"), x, wgu, wd, dy)
    assert all(bitwise_equal(p, q) for p, q in zip(a, b))
    with pytest.raises(Exception, match="Trn3"):  # the kernel's own error: no MX hardware on trn2
        grads(mx("none"), x, wgu, wd, dy)


# ---------------------------------------------------------------------------------------------
# forward, dtypes, fp32 main-grad accumulation
# ---------------------------------------------------------------------------------------------


def test_forward_values_and_leading_dims():
    x, wgu, wd, _ = make(24, 64, 96, seed=8)
    x3 = x.reshape(2, 3, 4, 64)
    y = swiglu_mlp_mxfp8(x3, wgu, wd, clamp_limits=CLAMP)
    assert y.shape == (2, 3, 4, 64) and y.dtype == torch.bfloat16
    ideal = ideal_fn(CLAMP)(x, wgu, wd)
    assert rel(y.reshape(24, 64), ideal) < 0.01  # bf16 forward
    # forward_numerics="kernel" carries the MX error of the projections
    yk = swiglu_mlp_mxfp8(x3, wgu, wd, clamp_limits=CLAMP, forward_numerics="kernel")
    assert 0.005 < rel(yk.reshape(24, 64), ideal) < 0.08


def test_dtypes_follow_inputs_and_fp32_main_grads_accumulate():
    """fp32 parameters get fp32 gradients straight from the kernel's fp32 accumulator (never
    rounded to bf16) and accumulate across micro-batches in fp32; fp32 x gets an fp32 dX."""
    x1, wgu, wd, dy1 = make(64, 64, 96, seed=9, x_dtype=torch.float32, w_dtype=torch.float32)
    x2, _, _, dy2 = make(64, 64, 96, seed=10, x_dtype=torch.float32)
    m = SwiGLUMLP(64, 96, backend="simulator")
    with torch.no_grad():
        m.gate_up_weight.copy_(wgu)
        m.down_weight.copy_(wd)
    a1 = x1.clone().requires_grad_()
    y1 = m(a1)
    assert y1.dtype == torch.float32
    y1.backward(dy1)
    assert a1.grad.dtype == torch.float32 and m.gate_up_weight.grad.dtype == torch.float32
    first = (m.gate_up_weight.grad.clone(), m.down_weight.grad.clone())
    m(x2).backward(dy2)
    want1 = mlp_backward_reference(**np_inputs(x1, wgu, wd, dy1), **forward_checkpoints(x1, wgu, wd),
                                   weight_grad_dtype="float32")
    want2 = mlp_backward_reference(**np_inputs(x2, wgu, wd, dy2), **forward_checkpoints(x2, wgu, wd),
                                   weight_grad_dtype="float32")
    assert np.array_equal(to_numpy(first[0]), want1[1]) and np.array_equal(to_numpy(first[1]), want1[2])
    assert np.array_equal(to_numpy(a1.grad), want1[0].astype(np.float32))
    assert np.array_equal(to_numpy(m.gate_up_weight.grad), want1[1] + want2[1])
    assert np.array_equal(to_numpy(m.down_weight.grad), want1[2] + want2[2])
    # not representable in bf16: the fp32 path really kept the fp32 accumulator
    assert not torch.equal(m.down_weight.grad, m.down_weight.grad.bfloat16().float())


def test_bf16_params_get_bf16_grads_and_explicit_fp32_weight_grads_are_cast():
    x, wgu, wd, dy = make(32, 64, 64, seed=11)
    _, dx, dgu, dd = grads(mx("all"), x, wgu, wd, dy)
    assert (dx.dtype, dgu.dtype, dd.dtype) == (torch.bfloat16,) * 3
    _, _, dgu32, dd32 = grads(mx("all", weight_grad_dtype=torch.float32), x, wgu, wd, dy)
    assert dgu32.dtype == torch.bfloat16  # cast to the parameter's dtype
    assert torch.equal(dgu32, dgu)  # RNE(fp32 accumulator) either way


def test_module_layout_and_init():
    torch.manual_seed(0)
    m = SwiGLUMLP(64, 96, checkpoint=("gate_pre", "up"), backend="emulate")
    assert m.gate_up_weight.shape == (192, 64) and m.down_weight.shape == (64, 96)
    assert m.gate_up_weight.abs().max() <= 1 / 64 ** 0.5 and m.down_weight.abs().max() <= 1 / 96 ** 0.5
    assert m.gate_up_weight.std() > 0.5 / (3 * 64) ** 0.5  # uniform, not zero
    x = torch.randn(5, 64)
    lin_g = torch.nn.functional.linear(x.bfloat16(), m.gate_up_weight[:96].bfloat16())
    lin_u = torch.nn.functional.linear(x.bfloat16(), m.gate_up_weight[96:].bfloat16())
    ref = torch.nn.functional.linear((torch.nn.functional.silu(lin_g.float()) * lin_u.float()).bfloat16(),
                                     m.down_weight.bfloat16())
    assert rel(m(x).detach(), ref) < 0.01
    assert "checkpoint=('gate_pre', 'up')" in repr(m)


# ---------------------------------------------------------------------------------------------
# custom op machinery: opcheck, torch.utils.checkpoint, torch.compile
# ---------------------------------------------------------------------------------------------


def _op_args(x, wgu, wd, backend, keep, clamp=(None, 0.5, -0.4, None)):
    return (x, wgu, wd, None, None, *clamp, "float8_e4m3fn", "1x32", "mxfp8", "neuron", "bfloat16", "torch", backend, 1,
            *keep)


@pytest.mark.parametrize("backend", ["simulator", "emulate"])
def test_opcheck(backend):
    x, wgu, wd, dy = make(6, 64, 32, seed=12)
    leaves = [t.clone().requires_grad_() for t in (x, wgu, wd)]
    for keep in ((True,) * 4, (False,) * 4, (True, False, True, False)):
        torch.library.opcheck(T.swiglu_mlp_mxfp8_op, _op_args(*leaves, backend, keep))
    torch.library.opcheck(T.swiglu_mlp_mxfp8_backward_op,
                          (dy, x, wgu, wd, None, None, None, None, None, None, None, None, "float8_e5m2", "wrapX",
                           "mxfp8", "neuron", "float32", backend, 2))


def test_inside_torch_utils_checkpoint():
    from torch.utils.checkpoint import checkpoint

    x, wgu, wd, dy = make(40, 64, 64, seed=13)
    fn = mx("none", clamp_limits=CLAMP)
    want = grads(fn, x, wgu, wd, dy)
    got = grads(lambda a, b, c: checkpoint(fn, a, b, c, use_reentrant=False), x, wgu, wd, dy)
    assert all(bitwise_equal(p, q) for p, q in zip(got, want))


def test_torch_compile_cpu():
    """torch.compile (inductor, CPU, dynamic shapes) traces the custom ops in one graph
    (fullgraph=True) and gives the eager results for two token counts (the ops are opaque: their fake
    implementations give the shapes)."""
    model = SwiGLUMLP(64, 64, checkpoint=("gate_act",), clamp_limits=CLAMP, backend="simulator",
                      dtype=torch.bfloat16)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    for S in (24, 40):
        x, wgu, wd, dy = make(S, 64, 64, seed=14 + S)
        with torch.no_grad():
            model.gate_up_weight.copy_(wgu)
            model.down_weight.copy_(wd)
        model.zero_grad()
        got = grads(lambda a, b, c: compiled(a.reshape(2, -1, 64)), x, wgu, wd, dy)
        got_w = (model.gate_up_weight.grad.clone(), model.down_weight.grad.clone())
        model.zero_grad()
        want = grads(lambda a, b, c: model(a.reshape(2, -1, 64)), x, wgu, wd, dy)
        assert bitwise_equal(got[0], want[0]) and bitwise_equal(got[1], want[1]), S
        assert bitwise_equal(got_w[0], model.gate_up_weight.grad) and bitwise_equal(got_w[1], model.down_weight.grad)


# ---------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------


def test_clear_errors():
    x, wgu, wd, _ = make(8, 64, 32, seed=15)
    with pytest.raises(ValueError, match=r"x must be \[\.\.\., H\] with H = 64"):
        swiglu_mlp_mxfp8(x[:, :32], wgu, wd)
    with pytest.raises(ValueError, match=r"down_weight must be \[H, I\] = \[64, 32\]"):
        swiglu_mlp_mxfp8(x, wgu, wd.T)
    with pytest.raises(ValueError, match=r"gate_up_weight must be \[2I, H\]"):
        swiglu_mlp_mxfp8(x, wgu[:63], wd)
    with pytest.raises(TypeError, match="x must be torch.bfloat16 or torch.float32.*float16"):
        swiglu_mlp_mxfp8(x.half(), wgu, wd)
    with pytest.raises(ValueError, match="multiples of 32"):
        swiglu_mlp_mxfp8(x[:, :48], wgu[:, :48], wd[:48])
    with pytest.raises(ValueError, match="one device"):
        swiglu_mlp_mxfp8(x.to("meta"), wgu, wd)
    with pytest.raises(ValueError, match="no tokens"):
        swiglu_mlp_mxfp8(x[:0], wgu, wd)
    with pytest.raises(ValueError, match="unknown checkpoint name 'gate'"):
        swiglu_mlp_mxfp8(x, wgu, wd, checkpoint=("gate", "up"))
    with pytest.raises(ValueError, match="checkpoint policy must be 'all', 'none'"):
        swiglu_mlp_mxfp8(x, wgu, wd, checkpoint="some")
    with pytest.raises(ValueError, match="backend must be one of"):
        swiglu_mlp_mxfp8(x, wgu, wd, backend="cuda")
    with pytest.raises(ValueError, match="scale_rule='rceil' needs backend='emulate'"):
        swiglu_mlp_mxfp8(x, wgu, wd, scale_rule="rceil")
    with pytest.raises(ValueError, match="fp8_dtype"):
        swiglu_mlp_mxfp8(x, wgu, wd, fp8_dtype="float8_e4m3")
    with pytest.raises(ValueError, match="weight_grad_dtype"):
        swiglu_mlp_mxfp8(x, wgu, wd, weight_grad_dtype=torch.float16)
    with pytest.raises(ValueError, match=r"swiglu_mlp_mxfp8: lnc must be None, 1 or 2, got 4"):
        swiglu_mlp_mxfp8(x, wgu, wd, lnc=4)
    with pytest.raises(ValueError, match="non_linear_lower .* must be smaller"):
        swiglu_mlp_mxfp8(x, wgu, wd, clamp_limits={"non_linear_lower": 1.0, "non_linear_upper": 0.0})
    with pytest.raises(ValueError, match="hidden_size must be a positive multiple of 32"):
        SwiGLUMLP(60, 64)
    with pytest.raises(ValueError, match="unknown checkpoint name"):
        SwiGLUMLP(64, 64, checkpoint=["gate_pre", "act"])
    # a device without a kernel path under "auto" names the portable alternative
    with pytest.raises(RuntimeError, match="no NKI kernel path.*device 'cuda.*backend='emulate'"):
        T.resolve_backend("auto", torch.device("cuda", 0))
    assert T.resolve_backend("auto", torch.device("cpu")) == "simulator"
    assert T.resolve_backend("auto", torch.device("xla", 0)) == "neuron"
    # backend="neuron" on CPU tensors: a clear error at the call, naming the device types it needs
    with pytest.raises(RuntimeError, match="backend='neuron' needs tensors on a Neuron device.*got device type 'cpu'"):
        swiglu_mlp_mxfp8(x.clone().requires_grad_(), wgu, wd, backend="neuron")


def test_meta_tensors_give_shapes_only():
    x, wgu, wd = (torch.empty(s, device="meta", dtype=torch.bfloat16, requires_grad=True)
                  for s in ((3, 5, 64), (128, 64), (64, 64)))
    y = swiglu_mlp_mxfp8(x, wgu, wd)
    assert y.shape == (3, 5, 64) and y.device.type == "meta"
    y.sum().backward()
    assert x.grad.shape == x.shape and wgu.grad.shape == wgu.shape
