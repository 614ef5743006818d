"""GPT-OSS's gated function (ClampLimits.activation="gpt_oss") in the shared SwiGLU epilogue.

gate_act = gc * sigmoid(1.702 gc) (ScalarE gelu_apprx_sigmoid), intermediate = gate_act * (uc + 1).

| test                                   | checks                                                         |
|----------------------------------------|----------------------------------------------------------------|
| test_dense_kernel_bit_exact            | dense kernel (LNC2, recompute / given checkpoints) == mx_exact; |
|                                        | differs from the silu variant                                   |
| test_dense_reference_fp32_vs_autograd  | reference fp32 mode == torch float64 autograd of GPT-OSS's math  |
| test_dense_emulate_bit_exact           | torch emulation == mx_exact                                     |
| test_moe_kernel_bit_exact              | MoE kernel (LNC1 / LNC2) == mx_exact; emulate == mx_exact       |
| test_option_errors                     | a bad activation is named                                       |
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from nkilib.core.options import OptionError, clamp_values
from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8 import ClampLimits
from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8.mlp_bwd_mxfp8_emulate import mlp_backward_emulate
from nkilib.experimental.moe_mxfp8.moe_bwd_mxfp8_emulate import moe_backward_emulate
from nkilib.experimental.moe_mxfp8.reference import moe_backward_reference
from simkit import (assert_matches_mx_exact, assert_outputs_identical, count_bits_differ, mlp_checkpoints,
                    mlp_inputs, mlp_reference, mlp_torch_oracle, rel_fro, run_mlp, to_numpy, to_torch)
from test_moe_bwd_kernel import moe_case, run

# GPT-OSS clamps the gate from above and up on both sides (swiglu_limit = 7 in the model; 0.6 here so that
# the O(1) test activations hit the limits)
GPT_OSS = ClampLimits(non_linear_upper=0.6, linear_lower=-0.6, linear_upper=0.6, activation="gpt_oss")
UNCLAMPED = ClampLimits(activation="gpt_oss")


@pytest.mark.parametrize("clamp", [GPT_OSS, UNCLAMPED], ids=["clamped", "unclamped"])
@pytest.mark.parametrize("given", [False, True], ids=["recompute", "checkpoints"])
def test_dense_kernel_bit_exact(clamp, given):
    inp = mlp_inputs(130, 96, 64, seed=3)
    if given:
        inp = {**inp, **mlp_checkpoints(inp, clamp_limits=clamp)}
    out = run_mlp(inp, lnc=2, clamp_limits=clamp)
    assert_matches_mx_exact(out, mlp_reference(inp, clamp_limits=clamp))
    silu = ClampLimits(*clamp_values(clamp))  # same clamps, silu
    silu_inp = inp if not given else {**inp, **mlp_checkpoints(inp, clamp_limits=silu)}
    assert count_bits_differ(out, run_mlp(silu_inp, lnc=2, clamp_limits=silu)) > 0


@pytest.mark.parametrize("clamp", [GPT_OSS, UNCLAMPED], ids=["clamped", "unclamped"])
def test_dense_reference_fp32_vs_autograd(clamp):
    inp = mlp_inputs(64, 64, 32, seed=4)
    ideal = mlp_reference(inp, mode="fp32", clamp_limits=clamp)
    for got, want in zip(ideal, mlp_torch_oracle(inp, clamp)):
        assert rel_fro(got, want) < 1e-6  # fp32 mode: float64 math returned as float32
    out = run_mlp(inp, lnc=1, clamp_limits=clamp)
    errs = [rel_fro(o, i) for o, i in zip(out, ideal)]
    print("kernel vs fp32 (dX, dW_gu, dW_down) rel_fro:", [f"{e:.3f}" for e in errs])
    # measured 0.29 / 0.065 (clamped / unclamped): the clamp masks are discontinuous, so MXFP8 gate_pre / up on the
    # other side of a limit move whole elements (test_mlp_bwd_kernel's clamped oracle measures 0.27 likewise)
    assert max(errs) < (0.4 if clamp.has_gate_clamp else 0.1)


@pytest.mark.parametrize("clamp", [GPT_OSS, {"linear_upper": 0.5, "activation": "gpt_oss"}], ids=["obj", "dict"])
def test_dense_emulate_bit_exact(clamp):
    inp = mlp_inputs(70, 64, 64, seed=5)
    ref = mlp_reference(inp, clamp_limits=clamp)
    got = mlp_backward_emulate(*(to_torch(inp[n]) for n in ("output_grad", "hidden_states", "down_proj_weight",
                                                             "gate_up_weights")), clamp_limits=clamp)
    assert_outputs_identical(tuple(to_numpy(g) for g in got), ref, "emulate gpt_oss vs mx_exact")


@pytest.mark.parametrize("lnc,checkpoints", [(1, ()), (2, ("gate_pre", "up")), (2, ("gate_pre", "up", "gate_act"))])
def test_moe_kernel_bit_exact(lnc, checkpoints):
    r = np.random.default_rng(11)
    T, E, k, H, I = 45, 4, 2, 64, 96
    ids = np.stack([r.permutation(E)[:k] for _ in range(T)]).astype(np.int32)
    kernel, ref = moe_case(T, E, H, I, ids, seed=12, checkpoints=checkpoints, clamp_limits=GPT_OSS)
    out = run(kernel, lnc=lnc)
    want = moe_backward_reference(**ref)
    assert_outputs_identical(out, want, "moe gpt_oss vs mx_exact")
    emu = moe_backward_emulate(
        *(to_torch(ref[n]) for n in ("output_grad", "hidden_states")), torch.from_numpy(ids),
        to_torch(ref["topk_weights"]), *(to_torch(ref[n]) for n in ("gate_up_weight", "down_weight")),
        *(to_torch(ref[n]) if n in ref else None for n in ("gate_pre", "gate_act", "up", "intermediate")),
        block_size=128, clamp_limits=GPT_OSS)
    assert_outputs_identical(tuple(to_numpy(g) for g in emu), want, "moe emulate gpt_oss vs mx_exact")
    silu_ref = dict(ref, clamp_limits=ClampLimits(*clamp_values(GPT_OSS)))
    if not checkpoints:
        assert count_bits_differ(out, moe_backward_reference(**silu_ref)) > 0


@pytest.mark.parametrize("value", ["gelu", None, 1])
def test_option_errors(value):
    with pytest.raises(OptionError, match=r"ClampLimits\.activation must be one of \('silu', 'gpt_oss'\)"):
        ClampLimits(activation=value)
    with pytest.raises(OptionError, match=r"clamp_limits\.activation must be one of"):
        clamp_values({"activation": value})
