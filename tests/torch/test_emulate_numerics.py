"""The `emulate` backend (mlp_bwd_mxfp8_emulate.py): torch ops reproducing the kernel's numerics.

Expected values come from independent code: ml_dtypes casts, nkilib.mx (NumPy quantize_mx / mx_matmul),
reference.py (mode "mx_exact", which the kernel matches bit for bit) and the kernel on the simulator.
"""
from __future__ import annotations

import shutil
import warnings

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8 import mlp_bwd_mxfp8_emulate as emu  # noqa: E402
from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8 import mlp_bwd_mxfp8_emulate_fused as fused  # noqa: E402
from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8.config import ClampLimits  # noqa: E402
from nkilib.mx import mx_matmul, quantize_mx  # noqa: E402
from simkit import (  # noqa: E402
    MLP_CHECKPOINTS, MLP_OPERANDS, assert_bits_equal, assert_outputs_identical, bits, mlp_checkpoints, mlp_inputs,
    mlp_reference, run_mlp, to_numpy, to_torch)

FP8 = {"float8_e4m3fn": (torch.float8_e4m3fn, ml_dtypes.float8_e4m3fn, 448.0),
       "float8_e5m2": (torch.float8_e5m2, ml_dtypes.float8_e5m2, 57344.0)}
CLAMP = ClampLimits(non_linear_lower=-0.6, non_linear_upper=0.5, linear_lower=-0.4, linear_upper=0.45)


def _emulate(inputs, **options):
    """mlp_backward_emulate on the torch versions of numpy `inputs` (operands and optional checkpoints)."""
    args = [to_torch(inputs[k]) for k in MLP_OPERANDS]
    ckpts = {k: to_torch(inputs[k]) for k in MLP_CHECKPOINTS if inputs.get(k) is not None}
    return tuple(to_numpy(t) for t in emu.mlp_backward_emulate(*args, **ckpts, **options))


def _assert_same_values(got: np.ndarray, want: np.ndarray):
    """Bit equality, except that NaNs only need to be NaN at the same positions."""
    assert_bits_equal(got, want, nan_equal=True)


@pytest.fixture(params=["off", "eager"])
def quantizer(request):
    """Runs a test with each quantizer formulation: the eager one (fp8 cast, decode table) and the
    fused one (float32 / int32 arithmetic, run op by op here; compiled in test_compiled_quantizer_*)."""
    previous = emu.set_fused_quantizer(request.param)
    yield request.param
    emu.set_fused_quantizer(previous)


# ---------------------------------------------------------------------------------------------
# building blocks
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", sorted(FP8))
def test_torch_fp8_cast_is_rne_with_clamped_saturation(fmt):
    """The float32 -> fp8 cast the emulation relies on: RNE like ml_dtypes on exact ties, their
    neighbours, the fp8 values themselves and random log-uniform values inside +-max_normal."""
    tdt, mdt, max_normal = FP8[fmt]
    grid = np.arange(256, dtype=np.uint8).view(mdt).astype(np.float32)
    grid = np.unique(grid[np.isfinite(grid)])
    mids = ((grid[1:].astype(np.float64) + grid[:-1]) / 2).astype(np.float32)  # exact ties (fp32-representable)
    above, below = np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(-np.inf))
    r = np.random.default_rng(0)
    rand = (r.choice([-1.0, 1.0], 20000) * np.exp2(r.uniform(-24, np.log2(max_normal), 20000))).astype(np.float32)
    x = np.clip(np.concatenate([grid, mids, above, below, rand]), -max_normal, max_normal).astype(np.float32)
    got = torch.from_numpy(x).to(tdt).view(torch.uint8).numpy()
    want = x.astype(mdt).view(np.uint8)
    assert np.array_equal(got, want), f"{int(np.count_nonzero(got != want))} casts differ"
    # a tie rounds to the even code: halfway between 1.0 and the next value stays 1.0
    one_next = grid[np.searchsorted(grid, 1.0) + 1]
    assert torch.tensor([(1.0 + one_next) / 2]).to(tdt).float().item() == 1.0


def _quant_data(seed: int, rows: int, k: int) -> np.ndarray:
    """Rows that exercise every scale path: normal, a 2**24 dynamic range, all-zero groups, float32
    subnormals, values at the fp8 limits, NaN and Inf groups."""
    r = np.random.default_rng(seed)
    x = r.standard_normal((rows, k)).astype(np.float32)
    x[1] = r.choice([-1.0, 1.0], k) * np.exp2(r.integers(-12, 13, k))
    x[2, :64] = 0.0
    x[3] = r.standard_normal(k) * np.float32(2.0 ** -140)  # float32 subnormals
    x[4] = r.choice([-1.0, 1.0], k) * r.uniform(400.0, 60000.0, k)
    x[5, 7] = np.nan
    x[6, 40] = np.inf
    x[7, 100] = -np.inf
    return x


@pytest.mark.parametrize("fmt", sorted(FP8))
@pytest.mark.parametrize("scheme", ["1x32", "wrapX"])
@pytest.mark.parametrize("rule", ["neuron", "rceil", "ocp_floor"])
def test_quantize_dequantize_matches_nkilib_mx(fmt, scheme, rule, quantizer):
    """Same groups, scales and element codes as nkilib.mx.quantize_mx, along either axis; K = 640 is
    one full 512 tile plus a 128 tile, so the wrapX geometry of a short last tile is covered."""
    x = _quant_data(1, 12, 640)
    want = quantize_mx(x, axis=1, elem_format=fmt, scale_rule=rule, scheme=scheme, k_tile=512).dequantize()
    got = emu.mx_quantize_dequantize(torch.from_numpy(x), 1, fmt, scheme, rule).numpy()
    _assert_same_values(got, want)
    want0 = quantize_mx(x.T.copy(), axis=0, elem_format=fmt, scale_rule=rule, scheme=scheme).dequantize()
    got0 = emu.mx_quantize_dequantize(torch.from_numpy(x.T.copy()), 0, fmt, scheme, rule).numpy()
    _assert_same_values(got0, want0)


@pytest.mark.parametrize("rule", ["rceil", "ocp_floor"])
def test_contract_matmul_with_study_scale_rules(rule):
    """mxfp8 contract matmul under the non-default rules equals nkilib.mx.mx_matmul of the NumPy
    quantization (K = 300 is zero-padded to 384: one partial 512 tile). Operands span 2**24, so that
    "rceil" (which differs from "neuron" only where small elements of a group fall into the fp8
    subnormal range: both keep the top binade's spacing) gives different results."""
    r = np.random.default_rng(2)
    a = (r.choice([-1.0, 1.0], (20, 300)) * np.exp2(r.uniform(-12, 12, (20, 300)))).astype(ml_dtypes.bfloat16)
    b = r.standard_normal((300, 24)).astype(np.float32).astype(ml_dtypes.bfloat16)
    ap, bp = np.pad(a, ((0, 0), (0, 84))), np.pad(b, ((0, 84), (0, 0)))
    want = mx_matmul(quantize_mx(ap, 1, "float8_e4m3fn", rule), quantize_mx(bp, 0, "float8_e4m3fn", rule))
    got = emu.contract_matmul(to_torch(a), to_torch(b), scale_rule=rule).numpy()
    assert np.array_equal(bits(got), bits(want))
    # the rules really differ on these operands (else the test would not distinguish them)
    neuron = emu.contract_matmul(to_torch(a), to_torch(b), scale_rule="neuron").numpy()
    assert not np.array_equal(bits(got), bits(neuron))


def test_option_errors():
    t = torch.zeros(4, 64)
    with pytest.raises(ValueError, match="fp8_dtype"):
        emu.mx_quantize_dequantize(t, 1, "float8_e4m3")
    with pytest.raises(ValueError, match="quant_scheme"):
        emu.mx_quantize_dequantize(t, 1, quant_scheme="2x16")
    with pytest.raises(ValueError, match="scale_rule"):
        emu.mx_quantize_dequantize(t, 1, scale_rule="ceil")
    with pytest.raises(ValueError, match="multiple of 32"):
        emu.mx_quantize_dequantize(torch.zeros(4, 40), 1)
    with pytest.raises(ValueError, match="incompatible"):
        emu.contract_matmul(torch.zeros(2, 64), torch.zeros(32, 2))
    with pytest.raises(ValueError, match="weight_grad_dtype"):
        emu.mlp_backward_emulate(*(torch.zeros(2, 2),) * 4, weight_grad_dtype=torch.float16)


# ---------------------------------------------------------------------------------------------
# the whole backward
# ---------------------------------------------------------------------------------------------

CASES = [
    # (S, H, I, options, checkpoints given)
    (130, 160, 96, dict(), ()),
    (64, 128, 64, dict(clamp_limits=CLAMP), MLP_CHECKPOINTS),
    (37, 96, 160, dict(fp8_dtype="float8_e5m2", quant_scheme="wrapX"), ("gate_pre", "up")),
    (200, 256, 128, dict(quant_scheme="wrapX", clamp_limits=CLAMP, weight_grad_dtype="float32"), ("gate_act",)),
    (96, 64, 96, dict(matmul_precision="bf16", clamp_limits=CLAMP), ("intermediate", "up")),
    (300, 128, 64, dict(matmul_precision="bf16", weight_grad_dtype="float32"), ()),
]


@pytest.mark.parametrize("S,H,I,options,given", CASES)
def test_emulate_matches_mx_exact_bit_for_bit(S, H, I, options, given):
    inputs = mlp_inputs(S, H, I, seed=S + H)
    ck = mlp_checkpoints(inputs, **{k: v for k, v in options.items() if k in ("clamp_limits", "quant_scheme",
                                                                           "matmul_precision")},
                         **({"fp8_x4_dtype": options["fp8_dtype"] + "_x4"} if "fp8_dtype" in options else {}))
    inputs.update({k: ck[k] for k in given})
    want = mlp_reference(inputs, **{k: v for k, v in options.items() if k != "fp8_dtype"},
                         **({"fp8_x4_dtype": options["fp8_dtype"]} if "fp8_dtype" in options else {}))
    opts = dict(options)
    if "weight_grad_dtype" in opts:
        opts["weight_grad_dtype"] = getattr(torch, opts["weight_grad_dtype"])
    got = _emulate(inputs, **opts)
    assert_outputs_identical(got, want, f"emulate vs mx_exact S={S} H={H} I={I} {options} given={given}")


def test_emulate_propagates_nan_like_the_reference():
    inputs = mlp_inputs(64, 64, 64, seed=5)
    inputs["hidden_states"][3, 10] = np.nan
    got, want = _emulate(inputs), mlp_reference(inputs)
    for g, w in zip(got, want):
        assert np.isnan(w.astype(np.float32)).any()
        _assert_same_values(g, w)


@pytest.mark.parametrize("lnc", [1, 2])
@pytest.mark.parametrize("options", [dict(), dict(clamp_limits=CLAMP, quant_scheme="wrapX")])
def test_emulate_equals_simulated_kernel(lnc, options):
    """The emulate backend and the real kernel on the simulator agree bit for bit on small shapes."""
    inputs = mlp_inputs(70, 128, 96, seed=11 + lnc)
    sim = run_mlp(inputs, lnc=lnc, **options)
    assert_outputs_identical(_emulate(inputs, **options), sim, f"emulate vs simulator lnc={lnc}")


def test_emulate_scale_rules_change_the_gradients():
    """The study's rules are really different from the hardware rule (and from each other)."""
    inputs = mlp_inputs(64, 128, 64, seed=3)
    outs = {rule: _emulate(inputs, scale_rule=rule) for rule in ("neuron", "rceil", "ocp_floor")}
    for a, b in (("neuron", "rceil"), ("neuron", "ocp_floor"), ("rceil", "ocp_floor")):
        assert not np.array_equal(bits(outs[a][0]), bits(outs[b][0])), (a, b)


# ---------------------------------------------------------------------------------------------
# the vectorised quantizer and the matmul's fast paths (groups as views, fp8 decode by table,
# strided operands): bit equality with nkilib.mx on adversarial values
# ---------------------------------------------------------------------------------------------


def _fp8_grid(fmt: str) -> np.ndarray:
    """The finite non-negative values of an fp8 format, float32, sorted."""
    grid = np.arange(256, dtype=np.uint8).view(FP8[fmt][1]).astype(np.float32)
    return np.unique(np.abs(grid[np.isfinite(grid)]))


def _adversarial_groups(fmt: str, rule: str, seed: int) -> np.ndarray:
    """Groups [n, 32] float32 whose quotients v / 2**k hit fp8 ties (exact midpoints, both parities),
    their float32 neighbours, fp8 values, saturating values, fp8 and float32 subnormals, signed zeros;
    plus all-zero groups, groups with a float32-subnormal amax, groups at the top of float32, and
    NaN / +Inf / -Inf groups. The group scale k is read from nkilib.mx (test data, not expectations)."""
    r = np.random.default_rng(seed)
    grid = _fp8_grid(fmt)
    mids = ((grid[1:].astype(np.float64) + grid[:-1]) / 2).astype(np.float32)
    q = np.concatenate([grid, mids, np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(0)),
                        grid[-1:] * np.float32(1.5), np.float32([2.0 ** -140, 0.0])])
    leads = [m * np.float32(2.0) ** e for e in (-133, -120, -60, -3, 0, 9, 60, 120) for m in (1.0, 1.5, 1.75, 1.96875)]
    groups = []
    for lead in leads:
        lead = np.float32(lead)
        byte = quantize_mx(np.full((1, 32), lead, np.float32), 1, fmt, rule).scales[0, 0]
        scale = np.float32(2.0) ** (int(byte) - 127)
        vals = q[np.abs(q) * scale < lead] * scale  # quotients exact (powers of two), below the lead
        for _ in range(3):
            g = r.choice(vals, 31) * r.choice(np.float32([-1.0, 1.0]), 31)
            groups.append(np.concatenate([[lead * r.choice([-1, 1])], g]).astype(np.float32))
    special = np.zeros((6, 32), np.float32)
    special[1, 3] = -0.0
    special[2] = r.standard_normal(32) * np.float32(2.0 ** -135)  # amax a float32 subnormal
    special[3] = np.float32(3.4e38) * r.choice([-1.0, 1.0], 32)
    special[4] = r.standard_normal(32)
    special[4, 9] = np.nan
    special[5] = r.standard_normal(32)
    special[5, 31] = -np.inf
    inf_group = r.standard_normal(32).astype(np.float32)
    inf_group[0] = np.inf
    return np.concatenate([np.stack(groups), special, inf_group[None]]).astype(np.float32)


@pytest.mark.parametrize("fmt", sorted(FP8))
@pytest.mark.parametrize("rule", ["neuron", "rceil", "ocp_floor"])
def test_vectorised_quantizer_on_adversarial_values(fmt, rule, quantizer):
    """1x32 groups as views of the quantized axis, along the last, the first and a middle axis of a
    3-D tensor, on contiguous and transposed (strided) inputs, float32 and bf16 / fp16 inputs."""
    g = _adversarial_groups(fmt, rule, seed=7)
    n = g.shape[0] - g.shape[0] % 4
    x = g[:n].reshape(4, n // 4 * 32)  # [4, K]: consecutive groups along K
    want = quantize_mx(x, 1, fmt, rule).dequantize()
    _assert_same_values(emu.mx_quantize_dequantize(torch.from_numpy(x), 1, fmt, "1x32", rule).numpy(), want)
    # the same groups along axis 0 of a transposed (column-major) view, and along the middle axis of a 3-D tensor
    xt = torch.from_numpy(x).t()  # [K, 4] with strides (1, K)
    assert not xt.is_contiguous()
    _assert_same_values(emu.mx_quantize_dequantize(xt, 0, fmt, "1x32", rule).numpy(), want.T)
    x3 = np.ascontiguousarray(np.broadcast_to(x.T[None], (2, *x.T.shape)))  # [2, K, 4]
    got3 = emu.mx_quantize_dequantize(torch.from_numpy(x3), 1, fmt, "1x32", rule).numpy()
    _assert_same_values(got3[1], want.T)
    # narrower input dtypes upcast exactly: same result as their float32 values
    for tdt, ndt in ((torch.bfloat16, ml_dtypes.bfloat16), (torch.float16, np.float16)):
        with np.errstate(over="ignore"):
            xn = x.astype(ndt)
        want_n = quantize_mx(xn.astype(np.float32), 1, fmt, rule).dequantize()
        got_n = emu.mx_quantize_dequantize(torch.from_numpy(xn.astype(np.float32)).to(tdt), 1, fmt, "1x32", rule)
        _assert_same_values(got_n.numpy(), want_n)


@pytest.mark.parametrize("fmt", sorted(FP8))
@pytest.mark.parametrize("K", [128, 640, 1024, 1152])
def test_wrapx_groups_as_views_match_nkilib_mx(fmt, K, quantizer):
    """wrapX without gathers: full 512 tiles and a short last tile (128 / 640 / 1152) of adversarial
    groups scattered over the wrapped positions, along either axis of a [K, N] operand."""
    g = _adversarial_groups(fmt, "neuron", seed=K)
    r = np.random.default_rng(K)
    rows = [g[r.integers(0, g.shape[0], K // 32)].reshape(-1) for _ in range(3)]
    x = np.stack(rows).astype(np.float32)  # [3, K]
    x = x[:, r.permutation(K)]  # wrapX groups gather strided positions: mix the groups' members
    want = quantize_mx(x, 1, fmt, "neuron", scheme="wrapX", k_tile=512).dequantize()
    _assert_same_values(emu.mx_quantize_dequantize(torch.from_numpy(x), 1, fmt, "wrapX").numpy(), want)
    xt = torch.from_numpy(x.T.copy())  # [K, 3] contiguous: quantized along axis 0
    _assert_same_values(emu.mx_quantize_dequantize(xt, 0, fmt, "wrapX").numpy(), want.T)


@pytest.mark.parametrize("fmt", sorted(FP8))
def test_fp8_decode_table_equals_torch_cast(fmt):
    """The 256-entry decode table gives torch's own fp8 -> float values (NaN codes NaN, -0 kept), in
    memory order for permuted layouts and through the shape-indexed fallback for other strides."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8[fmt][0]).reshape(16, 16)
    for layout in (codes, codes.t(), codes[::2, ::3]):
        for dtype in (torch.float32, torch.float64):
            got, want = emu._decode(layout, fmt, dtype), layout.to(dtype)
            assert got.shape == want.shape and torch.equal(torch.isnan(got), torch.isnan(want))
            ok = ~torch.isnan(want)
            assert torch.equal(got[ok].view(torch.int64 if dtype == torch.float64 else torch.int32),
                               want[ok].view(torch.int64 if dtype == torch.float64 else torch.int32))


def test_contract_matmul_is_layout_independent_and_exact(quantizer):
    """Strided operands (the backward passes transposed views) give the same bits as contiguous ones,
    and both equal nkilib.mx.mx_matmul (wrapX, e5m2: K = 640 is a 512 tile plus a 128 tile)."""
    r = np.random.default_rng(4)
    a = (r.standard_normal((48, 640)) * np.exp2(r.integers(-8, 8, (48, 1)))).astype(ml_dtypes.bfloat16)
    b = r.standard_normal((640, 40)).astype(ml_dtypes.bfloat16)
    opts = dict(fp8_dtype="float8_e5m2", quant_scheme="wrapX")
    want = mx_matmul(quantize_mx(a, 1, "float8_e5m2", scheme="wrapX"), quantize_mx(b, 0, "float8_e5m2", scheme="wrapX"))
    ta, tb = to_torch(a), to_torch(b)
    for aa, bb in ((ta, tb), (ta.t().contiguous().t(), tb.t().contiguous().t())):
        got = emu.contract_matmul(aa, bb, **opts).numpy()
        assert np.array_equal(bits(got), bits(want))


def test_contract_matmul_tiles_round_then_accumulate_in_order():
    """Cancellation across K tiles (the tile buffers are reused): tile sums 2**30, 1, -2**30, 2**-20 (each
    exact) accumulate in float32 in order, so the 1 is lost against 2**30 (half an ulp is 64) and the
    result is 2**-20, not the exact 1 + 2**-20; equal to nkilib.mx.mx_matmul. Columns 1-2 flip the signs
    and column 2 holds bf16 subnormals
    at E8M0's smallest scale."""
    k = 4 * 512
    a = np.ones((2, k), np.float32)
    b = np.zeros((k, 3), np.float32)
    b[:512, 0], b[512:1024, 0], b[1024:1536, 0], b[1536:, 0] = 2.0 ** 21, 2.0 ** -9, -2.0 ** 21, 2.0 ** -29
    b[:, 1] = -b[:, 0]
    b[:512, 2], b[512:1024, 2], b[1024:1536, 2], b[1536:, 2] = 2.0 ** -130, 2.0 ** -133, -2.0 ** -130, 0.0
    a, b = a.astype(ml_dtypes.bfloat16), b.astype(ml_dtypes.bfloat16)
    want = mx_matmul(quantize_mx(a, 1, "float8_e4m3fn"), quantize_mx(b, 0, "float8_e4m3fn"))
    got = emu.contract_matmul(to_torch(a), to_torch(b)).numpy()
    assert np.array_equal(bits(got), bits(want))
    # operands that require grad take the unbuffered path (matmul's out= records no graph): same bits
    with_grad = emu.contract_matmul(to_torch(a).requires_grad_(), to_torch(b).requires_grad_())
    assert np.array_equal(bits(with_grad.detach().numpy()), bits(want))
    assert got[0, 0] == np.float32(2.0 ** -20) and got[0, 1] == -np.float32(2.0 ** -20)
    assert got[0, 2] == np.float32(2.0 ** -124)  # bf16's smallest subnormal, E8M0's smallest scale


def test_quantize_dequantize_float64_keeps_codes_rounded_past_float32(quantizer):
    """amax = 1.9375 * 2**127 (neuron rule, e4m3fn): scale 2**120, quotient 248 is a tie between 240 and
    256 and rounds to the even code 256, i.e. 2**128: Inf in float32, finite (and exact) in float64;
    all other values agree between the two output dtypes."""
    r = np.random.default_rng(9)
    x = r.standard_normal((2, 64)).astype(np.float32)
    x[0, 5] = np.float32(1.9375 * 2.0 ** 127)
    t = torch.from_numpy(x)
    f32 = emu.mx_quantize_dequantize(t, 1)
    f64 = emu.mx_quantize_dequantize(t, 1, dtype=torch.float64)
    assert f64.dtype == torch.float64 and f64[0, 5].item() == 2.0 ** 128 and torch.isinf(f32[0, 5])
    keep = torch.isfinite(f32)
    assert int((~keep).sum()) == 1 and torch.equal(f32[keep].double(), f64[keep])
    with pytest.raises(ValueError, match="dtype"):
        emu.mx_quantize_dequantize(t, 1, dtype=torch.float16)


def _compiled_quantizer_case(fmt: str, rule: str, transposed_float64: bool):
    """Adversarial groups along axis 1 (and, if asked, along axis 0 with float64 output) through the
    compiled fused quantizer: bit-equal to nkilib.mx."""
    g = _adversarial_groups(fmt, rule, seed=3)
    n = g.shape[0] - g.shape[0] % 4
    x = g[:n].reshape(4, n // 4 * 32)
    want = quantize_mx(x, 1, fmt, rule).dequantize()
    previous = emu.set_fused_quantizer("compile")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # a failed compile (eager fallback) fails the test
            got = emu.mx_quantize_dequantize(torch.from_numpy(x), 1, fmt, "1x32", rule)
            if transposed_float64:
                got_t = emu.mx_quantize_dequantize(torch.from_numpy(x.T.copy()), 0, fmt, "1x32", rule,
                                                   dtype=torch.float64)
    finally:
        emu.set_fused_quantizer(previous)
    _assert_same_values(got.numpy(), want)
    if transposed_float64:
        want64 = quantize_mx(x, 1, fmt, rule).dequantize(dtype=np.float64).T
        got64, nan = got_t.numpy(), np.isnan(want64)
        assert np.array_equal(np.isnan(got64), nan)
        assert np.array_equal(got64[~nan].view(np.int64), want64[~nan].view(np.int64))  # float64 bits


_NO_CXX = pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "c++", "clang++")),
                             reason="torch.compile on CPU needs a C++ compiler (without one, 'auto' runs eager)")


@_NO_CXX
def test_compiled_quantizer_matches_nkilib_mx():
    """The fused quantizer as torch.compile builds it (C++ on CPU) gives nkilib.mx's bits (one graph:
    e4m3fn, "neuron", float32 out; every format, rule, axis 0 and float64: the slow test below)."""
    _compiled_quantizer_case("float8_e4m3fn", "neuron", transposed_float64=False)


@_NO_CXX
@pytest.mark.slow
@pytest.mark.parametrize("fmt", sorted(FP8))
@pytest.mark.parametrize("rule", ["neuron", "rceil", "ocp_floor"])
def test_compiled_quantizer_matches_nkilib_mx_all_options(fmt, rule):
    _compiled_quantizer_case(fmt, rule, transposed_float64=True)


def test_fused_quantizer_modes_and_compile_fallback(monkeypatch):
    """"auto" compiles only operands of FUSED_MIN_ELEMENTS or more; a torch.compile that fails warns
    once and falls back to the eager quantizer (same bits); unknown modes are rejected by name."""
    small = torch.zeros(4, 64)
    monkeypatch.setitem(fused._fused_state, "mode", "auto")
    monkeypatch.setitem(fused._fused_state, "failed", False)
    monkeypatch.setitem(fused._fused_state, "verified", set())
    assert fused.fused_quantizer_for(small) is None
    monkeypatch.setattr(fused, "FUSED_MIN_ELEMENTS", small.numel())
    assert fused.fused_quantizer_for(small) is fused.compiled_qdq

    def broken(*args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setitem(fused._fused_state, "compiled", broken)
    x = torch.from_numpy(_quant_data(5, 8, 128))
    with pytest.warns(RuntimeWarning, match="torch.compile of the fused MX quantizer failed"):
        got = emu.mx_quantize_dequantize(x, 1)
    assert fused._fused_state["failed"] and fused.fused_quantizer_for(small) is None
    _assert_same_values(got.numpy(), quantize_mx(x.numpy(), 1, "float8_e4m3fn").dequantize())
    # compiled code that runs but gives other bits (e.g. a compiler flushing subnormals) is caught by the probe
    monkeypatch.setitem(fused._fused_state, "failed", False)
    monkeypatch.setitem(fused._fused_state, "verified", set())
    monkeypatch.setitem(fused._fused_state, "compiled", lambda xv, *rest: fused.qdq_fused(xv * 0.75, *rest))
    with pytest.warns(RuntimeWarning, match="differs from eager on the probe values"):
        got = emu.mx_quantize_dequantize(x, 1)
    _assert_same_values(got.numpy(), quantize_mx(x.numpy(), 1, "float8_e4m3fn").dequantize())
    with pytest.raises(ValueError, match="mode"):
        emu.set_fused_quantizer("fast")
