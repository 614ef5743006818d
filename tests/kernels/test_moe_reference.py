"""NumPy references of the MoE expert backward (reference.py): agreement with the dense contract, the
dX / routing-gradient accumulation order, exact zeros for empty experts and padding rows, the MXFP8
error against the fp32 reference, and input errors."""
import numpy as np
import pytest
from moekit import ROUTINGS, make_routing, moe_inputs
from simkit import BF16, assert_outputs_identical

from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8 import ClampLimits
from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8.reference import (mlp_backward_reference,
                                                                   reference_phase0_recompute,
                                                                   reference_phase1_down_proj_grad)
from nkilib.experimental.moe_mxfp8.reference import error_report, moe_backward_reference, reference_block_phase1
from nkilib.experimental.moe_mxfp8.routing import build_block_layout

GPT_OSS = ClampLimits(non_linear_upper=7.0, linear_lower=-7.0, linear_upper=7.0)


def _run(ids, e, inp, block_size=128, **kw):
    return moe_backward_reference(layout=build_block_layout(ids, e, block_size), **inp, **kw)


@pytest.mark.parametrize("clamp", [None, ClampLimits(non_linear_upper=0.5, linear_lower=-0.4, linear_upper=0.3)])
def test_top1_moe_with_unit_weights_equals_the_dense_reference_per_expert(clamp):
    # k = 1, p = 1, at most one block per expert: every MoE output is the dense kernel's contract on
    # that expert's tokens (dx rows bf16(mm) = bf16(0 + bf16(mm)); dW = 0 + one MX tile = the dense dW)
    ids, e = make_routing("k1", seed=3)
    inp = moe_inputs(ids, e, H=64, I=96, seed=3)
    inp["topk_weights"][:] = 1.0
    dx, d_w, dw_gu, dw_down = _run(ids, e, inp, block_size=512, clamp_limits=clamp, weight_grad_dtype="float32")
    for ex in range(e):
        tok = np.flatnonzero(ids[:, 0] == ex)
        dense = mlp_backward_reference(inp["output_grad"][tok], inp["hidden_states"][tok], inp["down_weight"][ex],
                                       inp["gate_up_weight"][ex], clamp_limits=clamp, weight_grad_dtype="float32")
        for got, want in zip((dx[tok], dw_gu[ex], dw_down[ex]), dense):
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))


def test_block_phase1_with_unit_weights_is_the_dense_phase1():
    rng = np.random.default_rng(4)
    dy = rng.standard_normal((128, 64)).astype(BF16)
    x = rng.standard_normal((128, 64)).astype(BF16)
    w_gu = (rng.standard_normal((64, 64)) / 8).astype(BF16)
    w_down = (rng.standard_normal((64, 32)) / 8).astype(BF16)
    ck = reference_phase0_recompute(x, w_gu, clamp_limits=GPT_OSS)
    d_gate, d_up, _ = reference_phase1_down_proj_grad(dy, w_down, ck.gate_pre, ck.up, ck.gate_act, ck.intermediate,
                                                      clamp_limits=GPT_OSS)
    d_gu, hs, _ = reference_block_phase1(dy, w_down, np.ones(128, np.float32), ck.gate_pre, ck.up, ck.gate_act,
                                         ck.intermediate, clamp_limits=GPT_OSS)
    assert_outputs_identical((d_gu, hs), (np.concatenate([d_gate, d_up], axis=1), ck.intermediate))


def test_padding_rows_are_exact_zeros_even_where_the_clamp_makes_h_nonzero():
    # lower limits > 0: h(0) = silu(1) * 0.5 != 0, but p = 0 on padding rows zeroes hs and d_gate_up
    clamp = ClampLimits(non_linear_lower=1.0, linear_lower=0.5)
    zeros = np.zeros((128, 32), BF16)
    args = (np.zeros((128, 64), BF16), np.ones((64, 32), BF16))
    d_gu, hs, d_w = reference_block_phase1(*args, np.zeros(128, np.float32), zeros, zeros, clamp_limits=clamp)
    assert not np.any(d_gu.astype(np.float32)) and not np.any(hs.astype(np.float32)) and not np.any(d_w)
    _, hs_unit, _ = reference_block_phase1(*args, np.ones(128, np.float32), zeros, zeros, clamp_limits=clamp)
    assert np.all(hs_unit.astype(np.float32) > 0)  # with p = 1 the same rows have h = silu(1) * 0.5 != 0


@pytest.mark.parametrize("mode", ["mx_exact", "fp32"])
def test_empty_experts_get_exact_zero_weight_gradients(mode):
    ids, e = make_routing("empty_experts", seed=5)
    dx, d_w, dw_gu, dw_down = _run(ids, e, moe_inputs(ids, e, seed=5), mode=mode)
    used = set(np.unique(ids).tolist())
    assert used == {0, 3, 5}
    for ex in range(e):
        for dw in (dw_gu[ex], dw_down[ex]):
            vals = dw.astype(np.float32)
            if ex in used:
                assert np.count_nonzero(vals) > 0.9 * vals.size
            else:
                assert np.all(vals == 0) and not np.any(np.signbit(vals)), f"expert {ex}"


@pytest.mark.parametrize("name", ["random", "k8", "skewed"])
def test_dx_and_routing_grad_do_not_depend_on_token_or_slot_order(name):
    # dX of a token is its experts' contributions added in ascending expert order (= block order),
    # and d_topk_weights is per routed pair: shuffling tokens and each token's k slots permutes them
    ids, e = make_routing(name, seed=6)
    inp = moe_inputs(ids, e, seed=6)
    rng = np.random.default_rng(7)
    perm = rng.permutation(ids.shape[0])
    slot_perm = np.stack([rng.permutation(ids.shape[1]) for _ in perm])
    rows = perm[:, None]
    shuffled = dict(inp, output_grad=inp["output_grad"][perm], hidden_states=inp["hidden_states"][perm],
                    topk_weights=inp["topk_weights"][rows, slot_perm])
    dx, d_w, *_ = _run(ids, e, inp)
    dx2, d_w2, *_ = _run(ids[rows, slot_perm], e, shuffled)
    assert_outputs_identical((dx[perm], d_w[rows, slot_perm]), (dx2, d_w2))


@pytest.mark.parametrize("name", sorted(ROUTINGS))
def test_mx_exact_is_within_the_mxfp8_error_of_the_fp32_reference(name):
    ids, e = make_routing(name, seed=8)
    inp = moe_inputs(ids, e, H=128, I=64, seed=8)
    exact = _run(ids, e, inp, clamp_limits=GPT_OSS)
    ideal = _run(ids, e, inp, clamp_limits=GPT_OSS, mode="fp32")
    errs = [error_report(a, b)["rel_fro"] for a, b in zip(exact, ideal)]
    # measured (e4m3fn, unit-scale data): 0.05-0.09 relative Frobenius for every output
    assert all(0.02 < err < 0.10 for err in errs), errs


def test_bf16_precision_is_close_to_fp32_and_block_size_changes_only_the_weight_gradient_sums():
    ids, e = make_routing("skewed", seed=9)
    inp = moe_inputs(ids, e, seed=9)
    ideal = _run(ids, e, inp, mode="fp32")
    bf = _run(ids, e, inp, matmul_precision="bf16", weight_grad_dtype="float32")
    errs = [error_report(a, b)["rel_fro"] for a, b in zip(bf, ideal)]
    assert max(errs) < 6e-3, errs  # measured ~2e-3-4e-3 (bf16 roundings only)
    b256 = _run(ids, e, inp, block_size=256, matmul_precision="bf16", weight_grad_dtype="float32")
    assert_outputs_identical(bf[:2], b256[:2])  # row-wise passes: independent of B
    assert np.allclose(bf[2], b256[2], rtol=0, atol=1e-5 * np.abs(bf[2]).max())


def test_input_errors():
    ids, e = make_routing("random", seed=10)
    inp = moe_inputs(ids, e, seed=10)
    lay = build_block_layout(ids, e)
    with pytest.raises(ValueError, match=r"down_weight must be \[E, H, I\]"):
        moe_backward_reference(layout=lay, **dict(inp, down_weight=inp["down_weight"][:, :, :16]))
    with pytest.raises(ValueError, match=r"hidden_states and output_grad must both be \[T, H\]"):
        moe_backward_reference(layout=lay, **dict(inp, output_grad=inp["output_grad"][:-1]))
    with pytest.raises(ValueError, match=r"layout \(T=44, k=2, E=6\) does not match hidden_states \(45, 64\)"):
        moe_backward_reference(layout=build_block_layout(ids[:-1], e), **inp)
    w = inp["topk_weights"].copy()
    w[3, 1] = np.inf
    with pytest.raises(ValueError, match=r"topk_weights\[3, 1\] = inf is not finite"):
        moe_backward_reference(layout=lay, **dict(inp, topk_weights=w))
    with pytest.raises(ValueError, match=r"gate_pre must be \[T, k, I\]"):
        moe_backward_reference(layout=lay, gate_pre=np.zeros((45, 32), BF16), **inp)
