"""moe_swiglu_experts_mxfp8 with GPT-OSS's experts: activation "gpt_oss" and the two biases.

Gradients against torch float64 autograd of the math written here (GPT-OSS's per-expert formula); the emulate
backend against mx_exact (d_gate_up_bias included) and the simulator backend (the kernel's gate_up_bias_grad)
against emulate, bit for bit; the bias gradient's summation order; errors.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torchkit import rel  # noqa: E402

from moekit import make_routing, moe_inputs  # noqa: E402
from simkit import BF16, assert_outputs_identical, to_numpy, to_torch  # noqa: E402

from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8.config import ClampLimits  # noqa: E402
from nkilib.experimental.moe_mxfp8 import MoESwiGLUExperts, moe_swiglu_experts_mxfp8  # noqa: E402
from nkilib.experimental.moe_mxfp8.reference import moe_backward_reference  # noqa: E402
from nkilib.experimental.moe_mxfp8.routing import build_block_layout  # noqa: E402

GPT_OSS = ClampLimits(non_linear_upper=0.6, linear_lower=-0.6, linear_upper=0.6, activation="gpt_oss")


def _case(seed=0, routing="random"):
    ids, e = make_routing(routing, seed)
    inp = moe_inputs(ids, e, H=64, I=32, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    leaves = dict(x=to_torch(inp["hidden_states"]).float(), w=to_torch(inp["topk_weights"]),
                  wgu=to_torch(inp["gate_up_weight"]).float(), wd=to_torch(inp["down_weight"]).float(),
                  b_gu=0.3 * torch.randn(e, 64, generator=g), b_d=0.3 * torch.randn(e, 64, generator=g))
    return torch.from_numpy(ids), leaves, to_torch(inp["output_grad"]).float(), inp


def gpt_oss_float64(x, ids, w, wgu, wd, b_gu, b_d, lim):
    """y[t] = sum_j p * ((gc * sigmoid(1.702 gc)) * (uc + 1) W_down[e]^T + b_d[e]), gc / uc the clamped
    projections with their biases, in float64 (GPT-OSS's experts with the op's weight layout)."""
    n_i = wgu.shape[1] // 2
    y = torch.zeros_like(x)
    for j in range(ids.shape[1]):
        for e in range(wgu.shape[0]):
            tok = torch.nonzero(ids[:, j] == e).squeeze(1)
            if tok.numel():
                g = torch.clamp(x[tok] @ wgu[e, :n_i].t() + b_gu[e, :n_i], max=lim.non_linear_upper)
                u = torch.clamp(x[tok] @ wgu[e, n_i:].t() + b_gu[e, n_i:], lim.linear_lower, lim.linear_upper)
                out = (g * torch.sigmoid(1.702 * g) * (u + 1)) @ wd[e].t() + b_d[e]
                y = y.index_add(0, tok, w[tok, j:j + 1] * out)
    return y


def _grads(fn, leaves, dy):
    ts = {n: t.detach().clone().requires_grad_() for n, t in leaves.items()}
    y = fn(**ts)
    y.backward(dy.to(y.dtype))
    return y.detach(), {n: t.grad for n, t in ts.items()}


def test_gradients_vs_float64_autograd():
    ids, leaves, dy, _ = _case(seed=1)
    y, got = _grads(lambda x, w, wgu, wd, b_gu, b_d: moe_swiglu_experts_mxfp8(
        x, ids, w, wgu, wd, gate_up_bias=b_gu, down_bias=b_d, clamp_limits=GPT_OSS, backend="emulate"), leaves, dy)
    y64, want = _grads(lambda **t: gpt_oss_float64(ids=ids, lim=GPT_OSS, **t), {n: t.double() for n, t in
                                                                            leaves.items()}, dy.double())
    errors = {"y": rel(y, y64), **{n: rel(got[n], want[n]) for n in got}}
    print({n: f"{e:.2e}" for n, e in errors.items()})
    # measured: y 2.5e-3 (BF16 forward); b_d 8.3e-8 (float32 sums of p * dY); x, wgu, b_gu 6.9e-2..8.5e-2 (MXFP8
    # with the clamp masks: an element whose MXFP8 gate / up lands across a limit moves entirely; 3.9e-2..5.3e-2
    # with limits out of reach), w 2.4e-2, wd 3.8e-2 (MXFP8)
    assert errors["y"] < 8e-3
    assert errors["b_d"] < 1e-6
    for name in ("x", "w", "wgu", "wd", "b_gu"):
        assert 1e-2 < errors[name] < 0.15, (name, errors[name])


def test_biased_op_matches_mx_exact_on_its_checkpoints():
    """With biases, dX / dW_gu / dW_down and d_gate_up_bias equal bit for bit the mx_exact reference run on the
    op's (biased) checkpoints, and d_topk_weights is the reference's <dI, h> plus <dY, b_d[e]> (float32)."""
    from nkilib.experimental.moe_mxfp8 import moe_bwd_mxfp8_torch as M

    ids, leaves, dy, inp = _case(seed=2)
    bf = torch.bfloat16
    leaves = {n: (t.to(bf) if n in ("x", "wgu", "wd") else t) for n, t in leaves.items()}
    _, got = _grads(lambda x, w, wgu, wd, b_gu, b_d: moe_swiglu_experts_mxfp8(
        x, ids, w, wgu, wd, gate_up_bias=b_gu, down_bias=b_d, clamp_limits=GPT_OSS, backend="emulate"), leaves, dy)
    clamps = (None, 0.6, -0.6, 0.6, "gpt_oss")
    _, *ckpts = M._forward_math(leaves["x"], ids, leaves["w"], leaves["wgu"], leaves["wd"], clamps, leaves["b_gu"])
    layout = build_block_layout(ids.numpy(), leaves["wgu"].shape[0], 128)
    ref = moe_backward_reference(to_numpy(dy.to(bf)), to_numpy(leaves["x"]), inp["topk_weights"],
                                 to_numpy(leaves["wgu"]), to_numpy(leaves["wd"]), layout,
                                 *(to_numpy(c) for c in ckpts), clamp_limits=GPT_OSS, gate_up_bias_grad=True)
    assert_outputs_identical(tuple(to_numpy(got[n]) for n in ("x", "wgu", "wd", "b_gu")),
                             (ref[0], ref[2], ref[3], ref[4]), "biased op vs mx_exact")
    bias_term = (dy.to(bf).float()[:, None, :] * leaves["b_d"][ids]).sum(-1)  # <dY[t], b_d[e]>
    assert torch.allclose(got["w"], torch.from_numpy(ref[1]) + bias_term, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(got["w"], torch.from_numpy(ref[1]), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("lnc", [1, 2])
def test_simulator_backend_equals_emulate_with_gate_up_bias(lnc):
    """The kernel on the simulator (its gate_up_bias_grad output) gives the emulate backend's gradients bit for
    bit, the bias's included: routing "skewed" (expert 0 takes all 131 tokens: two blocks) with expert 3's pairs
    moved to expert 2 (expert 3 empty)."""
    ids, leaves, dy, _ = _case(seed=6, routing="skewed")
    ids = torch.where(ids == 3, 2, ids)
    counts = torch.bincount(ids.reshape(-1), minlength=leaves["wgu"].shape[0])
    assert counts[0] > 128 and counts[3] == 0
    grads = {}
    for backend in ("emulate", "simulator"):
        _, grads[backend] = _grads(lambda x, w, wgu, wd, b_gu, b_d: moe_swiglu_experts_mxfp8(
            x, ids, w, wgu, wd, gate_up_bias=b_gu, down_bias=b_d, clamp_limits=GPT_OSS, backend=backend, lnc=lnc),
            leaves, dy)
    names = list(grads["emulate"])
    assert_outputs_identical(tuple(to_numpy(grads["simulator"][n]) for n in names),
                             tuple(to_numpy(grads["emulate"][n]) for n in names), f"simulator LNC{lnc} vs emulate")
    b_gu = grads["simulator"]["b_gu"]
    assert not b_gu[counts == 0].view(torch.int32).any() and b_gu[counts > 0].abs().sum() > 0


@pytest.mark.parametrize("kw,match", [
    (dict(checkpoint="none"), "keeps gate_pre and up"),
    (dict(checkpoint=("gate_pre", "gate_act")), "keeps gate_pre and up"),
    (dict(gate_up_bias=torch.zeros(3, 64)), r"gate_up_bias must be .* \[E, 2I\] = \[6, 64\] on cpu, got "
                                            r"torch.float32 \(3, 64\)"),
    (dict(down_bias=torch.zeros(6, 32)), r"down_bias must be .* \[E, H\] = \[6, 64\]"),
])
def test_bias_errors(kw, match):
    ids, leaves, _, _ = _case(seed=3)
    args = {**dict(gate_up_bias=leaves["b_gu"], down_bias=leaves["b_d"], clamp_limits=GPT_OSS), **kw}
    with pytest.raises(ValueError, match=match):
        moe_swiglu_experts_mxfp8(leaves["x"], ids, leaves["w"], leaves["wgu"], leaves["wd"], **args)


def test_module_with_bias():
    torch.manual_seed(0)
    m = MoESwiGLUExperts(6, 64, 32, bias=True, clamp_limits=GPT_OSS, backend="emulate")
    assert [n for n, _ in m.named_parameters()] == ["gate_up_weight", "down_weight", "gate_up_bias", "down_bias"]
    assert m.gate_up_bias.abs().max() <= 64 ** -0.5 and m.gate_up_bias.abs().max() > 0
    ids, leaves, dy, _ = _case(seed=4)
    y = m(leaves["x"], ids, leaves["w"])
    y.backward(dy)
    assert m.gate_up_bias.grad.abs().sum() > 0 and m.down_bias.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="bias=True needs a checkpoint keeping gate_pre and up"):
        MoESwiGLUExperts(4, 64, 32, bias=True, checkpoint="none")


def test_bias_grad_summation_order_is_128_row_tiles_rounded_once():
    """reference_bias_grad_fold and the emulation's bias_grad_fold (the kernel's order): each 128-row tile's sum
    is rounded to fp32 on its own. Column 0: 1 and 2^-24 in tile 0 (1 + 2^-24 rounds to 1, ties to even), 2^-24
    in tile 1 -> 1.0, where one float32 rounding of the whole sum gives 1 + 2^-23. Column 1: all -0 -> +0 (the
    fold starts from +0). Column 2: 3 in the second block of 256 rows (its second tile)."""
    import numpy as np

    from nkilib.experimental.moe_mxfp8.moe_bwd_mxfp8_emulate import bias_grad_fold
    from nkilib.experimental.moe_mxfp8.reference import reference_bias_grad_fold

    rows = np.zeros((400, 3), np.float32)
    rows[0, 0], rows[1, 0], rows[128, 0] = 1.0, 2.0 ** -24, 2.0 ** -24
    rows[:, 1] = -0.0
    rows[384, 2] = 3.0
    bf = rows.astype(BF16)
    padded = np.concatenate([bf, np.zeros((112, 3), bf.dtype)]).reshape(2, 256, 3)  # two blocks of B = 256
    want = np.array([1.0, 0.0, 3.0], np.float32)
    got_ref = reference_bias_grad_fold(padded)
    got_emu = to_numpy(bias_grad_fold(to_torch(bf)))
    for got in (got_ref, got_emu):
        assert got.dtype == np.float32 and got.view(np.uint32).tolist() == want.view(np.uint32).tolist()
    assert np.float32(rows[:, 0].astype(np.float64).sum()) == np.float32(1 + 2.0 ** -23)  # the other order
