"""Tests of the NumPy references of the MXFP8 SwiGLU MLP backward (mlp_bwd_mxfp8/reference.py).

Expected values come from an independent float64 implementation written here, from central finite
differences of the forward loss, or are derived by hand (MX codes, tile rounding, clamp masks).
"""
from __future__ import annotations

import itertools

import ml_dtypes
import numpy as np
import pytest

from nkilib.core import numerics as N
from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8 import reference as R
from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8.config import ClampLimits
from nkilib.mx import MXTensor, mx_matmul, quantize_mx, unpack_x4
from simkit import BF16, bits, mlp_inputs

FP8S = ("float8_e4m3fn", "float8_e5m2")


make_inputs = mlp_inputs  # simkit: seeded bf16 inputs, unit activations and 1/sqrt(fan_in) weights


def _clip(v, lo, hi):
    c = v if lo is None else np.maximum(v, lo)
    c = c if hi is None else np.minimum(c, hi)
    m = np.ones(v.shape, bool)
    if lo is not None:
        m &= v >= lo
    if hi is not None:
        m &= v <= hi
    return c, m.astype(np.float64)


def naive_backward64(dY, X, Wd, Wgu, lim=None):
    """Straightforward float64 clamped-SwiGLU backward (analytic derivative), independent of R."""
    lim = lim or ClampLimits()
    dY, X, Wd, Wgu = (np.asarray(a, np.float64) for a in (dY, X, Wd, Wgu))
    I = Wd.shape[1]
    Wg, Wu = Wgu[:I], Wgu[I:]
    gc, mg = _clip(X @ Wg.T, lim.non_linear_lower, lim.non_linear_upper)
    uc, mu = _clip(X @ Wu.T, lim.linear_lower, lim.linear_upper)
    sig = 1.0 / (1.0 + np.exp(-gc))
    act = gc * sig
    dsilu = sig + gc * sig * (1.0 - sig)
    dI = dY @ Wd
    d_gate = dI * uc * dsilu * mg
    d_up = dI * act * mu
    dX = d_gate @ Wg + d_up @ Wu
    dWgu = np.concatenate([d_gate.T @ X, d_up.T @ X], axis=0)
    dWd = dY.T @ (act * uc)
    return dX, dWgu, dWd


def forward_loss64(X, Wgu, Wd, dY, lim):
    """sum(Y * dY) of the clamped SwiGLU MLP forward, float64."""
    I = Wd.shape[1]
    gc, _ = _clip(X @ Wgu[:I].T, lim.non_linear_lower, lim.non_linear_upper)
    uc, _ = _clip(X @ Wgu[I:].T, lim.linear_lower, lim.linear_upper)
    Y = (gc / (1.0 + np.exp(-gc)) * uc) @ Wd.T
    return float(np.sum(Y * dY))


# ----------------------------------------------------------------------------------------------
# fp32 (ideal) mode
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("with_clamp", [False, True])
def test_fp32_mode_matches_naive_float64(with_clamp):
    inp = make_inputs(48, 64, 40, seed=1)
    lim = ClampLimits(-0.6, 0.5, -0.7, 0.4) if with_clamp else None
    got = R.mlp_backward_reference(**inp, clamp_limits=lim, mode="fp32")
    want = naive_backward64(
        inp["output_grad"], inp["hidden_states"], inp["down_proj_weight"], inp["gate_up_weights"], lim
    )
    for g, w in zip(got, want):
        assert g.dtype == np.float32 and g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6 * np.abs(w).max())
    if with_clamp:  # the clamps must actually have masked something for this case to mean anything
        free = naive_backward64(
            inp["output_grad"], inp["hidden_states"], inp["down_proj_weight"], inp["gate_up_weights"]
        )
        assert not np.allclose(free[0], want[0])


def test_fp32_mode_matches_finite_differences():
    """Central differences of L = sum(Y * dY) wrt X, W_gu, W_down (float64, tiny shape, with clamps)."""
    r = np.random.default_rng(2)
    S, H, I = 3, 5, 4
    X = r.standard_normal((S, H))
    dY = r.standard_normal((S, H))
    Wgu = r.standard_normal((2 * I, H)) / 2
    Wd = r.standard_normal((H, I)) / 2
    lim = ClampLimits(non_linear_upper=0.8, linear_lower=-0.5, linear_upper=0.9)
    g, u = X @ Wgu[:I].T, X @ Wgu[I:].T
    # Precondition: the clamps are active somewhere and no value is near a kink.
    assert (g > 0.8).any() and ((u < -0.5) | (u > 0.9)).any()
    assert min(np.abs(g - 0.8).min(), np.abs(u + 0.5).min(), np.abs(u - 0.9).min()) > 1e-3
    dX, dWgu, dWd = R.mlp_backward_reference(dY, X, Wd, Wgu, clamp_limits=lim, mode="fp32")

    eps = 1e-6

    def fd(which):
        args = {"X": X, "Wgu": Wgu, "Wd": Wd}
        base = args[which]
        out = np.empty_like(base)
        for idx in np.ndindex(base.shape):
            p, m = base.copy(), base.copy()
            p[idx] += eps
            m[idx] -= eps
            lp = forward_loss64(**{**args, which: p}, dY=dY, lim=lim)
            lm = forward_loss64(**{**args, which: m}, dY=dY, lim=lim)
            out[idx] = (lp - lm) / (2 * eps)
        return out

    np.testing.assert_allclose(dX, fd("X"), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dWgu, fd("Wgu"), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dWd, fd("Wd"), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# mx_exact accuracy and option sensitivity
# ----------------------------------------------------------------------------------------------

# Measured on make_inputs(256, 256, 256, seed=7), quant_scheme "1x32", weight_grad_dtype bf16
# (outputs dX, dW_gu, dW_down against mode="fp32"):
#   float8_e4m3fn: rel_fro 0.06757 / 0.06796 / 0.06662, cosine 0.997716 / 0.997689 / 0.997782
#   float8_e5m2:   rel_fro 0.13395 / 0.13395 / 0.13178, cosine 0.990993 / 0.990995 / 0.991282
#   (wrapX gives the same values to 5 digits: the scale only matters for fp8-subnormal elements)
#   matmul_precision "bf16": rel_fro 0.003255 / 0.00326 / 0.003931, cosine 0.9999947 / 0.9999947 /
#   0.9999923
# Bounds are 1.5x the measured error (rel_fro, and 1 - cosine).
MEASURED = {
    "float8_e4m3fn": ((0.06757, 0.997716), (0.06796, 0.997689), (0.06662, 0.997782)),
    "float8_e5m2": ((0.13395, 0.990993), (0.13395, 0.990995), (0.13178, 0.991282)),
}


@pytest.fixture(scope="module")
def inputs256():
    inp = make_inputs(256, 256, 256, seed=7)
    return inp, R.mlp_backward_reference(**inp, mode="fp32")


@pytest.mark.parametrize("fp8", FP8S)
def test_mx_exact_error_vs_fp32(inputs256, fp8):
    """mx_exact vs ideal: see MEASURED above for the numbers the bounds derive from."""
    inp, ideal = inputs256
    out = R.mlp_backward_reference(**inp, fp8_dtype=fp8)
    assert [o.dtype for o in out] == [np.dtype(BF16)] * 3
    assert [o.shape for o in out] == [(256, 256), (512, 256), (256, 256)]
    for o, i, (rel, cos) in zip(out, ideal, MEASURED[fp8]):
        rep = R.error_report(o, i)
        assert rep["rel_fro"] < 1.5 * rel
        assert rep["cosine"] > 1 - 1.5 * (1 - cos)
        # the quantization error is real: far above bf16 output rounding (~2**-9)
        assert rep["rel_fro"] > 0.5 * rel


def test_bf16_precision_differs_and_is_closer(inputs256):
    inp, ideal = inputs256
    mx = R.mlp_backward_reference(**inp)
    b16 = R.mlp_backward_reference(**inp, matmul_precision="bf16")
    for m, b, i in zip(mx, b16, ideal):
        assert np.any(bits(m) != bits(b))
        e_b = R.error_report(b, i)["rel_fro"]
        assert e_b < 0.006  # measured 0.0033-0.0039
        assert e_b < 0.1 * R.error_report(m, i)["rel_fro"]


def test_fp8_formats_differ(inputs256):
    inp, _ = inputs256
    a = R.mlp_backward_reference(**inp, fp8_dtype="float8_e4m3fn")
    b = R.mlp_backward_reference(**inp, fp8_dtype="float8_e5m2")
    for x, y in zip(a, b):
        assert np.mean(bits(x) != bits(y)) > 0.5


def test_quant_schemes_differ_full_k_tiles():
    """1x32 vs wrapX on K = 512 tiles. Inputs span a wide dynamic range (random power-of-two
    factors) so that elements that are fp8-subnormal relative to their group's scale are common:
    only those are affected by which group an element belongs to."""
    r = np.random.default_rng(3)
    S = H = I = 512

    def wide(shape, s=1.0):
        return (r.standard_normal(shape) * s * np.exp2(r.integers(-8, 9, shape))).astype(np.float32).astype(BF16)

    args = (wide((S, H)), wide((S, H)), wide((H, I), 1 / 16), wide((2 * I, H), 1 / 16))
    a = R.mlp_backward_reference(*args, quant_scheme="1x32")
    b = R.mlp_backward_reference(*args, quant_scheme="wrapX")
    for x, y in zip(a, b):
        assert np.mean(bits(x) != bits(y)) > 0.005  # measured 2.8-4.0 %


@pytest.mark.parametrize("fp8", FP8S)
def test_mm_scheme_groups_by_hand(fp8):
    """Row [2**15 at k=0, 2**-20 at k=128]: wrapX puts k=0 and k=128 in one group (p = k mod 128 in
    0..7), so 2**-20 underflows (half the smallest subnormal relative to the scale 2**(15-emax+1)
    is >= 2**-17); 1x32 puts them in different groups and both are exact."""
    a = np.zeros((1, 512), np.float32)
    a[0, 0], a[0, 128] = 2.0**15, 2.0**-20
    b = np.zeros((512, 1), np.float32)
    b[128, 0] = 1.0
    a, b = a.astype(BF16), b.astype(BF16)
    assert N.contract_mm(a, b, "mxfp8", fp8, "1x32")[0, 0] == np.float32(2.0**-20)
    assert N.contract_mm(a, b, "mxfp8", fp8, "wrapX")[0, 0] == 0.0


def test_mm_tile_rounding_by_hand():
    """Tile sums are rounded to fp32 and accumulated in fp32: products 2**24 (k=0), 1 (k=1) and 1
    (k=256). bf16 tiles of 128: tile 0 = fp32(2**24 + 1) = 2**24 (tie to even), + tile 2 (1) ->
    2**24. mxfp8 tiles of 512: one tile, exact 2**24 + 2. Moving the last 1 to k=512 makes the
    mxfp8 result 2**24 too."""
    for k_last, want_mx in ((256, 2.0**24 + 2), (512, 2.0**24)):
        a = np.zeros((1, 640), np.float32)
        b = np.zeros((640, 1), np.float32)
        a[0, 0] = b[0, 0] = 2.0**12
        a[0, 1] = b[1, 0] = a[0, k_last] = b[k_last, 0] = 1.0
        a, b = a.astype(BF16), b.astype(BF16)
        assert N.contract_mm(a, b, "bf16", None, None)[0, 0] == np.float32(2.0**24)
        for fp8 in FP8S:  # 2**12 and 1 are exact in both formats at these scales
            assert N.contract_mm(a, b, "mxfp8", fp8, "1x32")[0, 0] == np.float32(want_mx)


def test_mm_pads_k_to_128():
    """K = 200 pads to 256: the same as explicit zero padding, also for wrapX (strided groups)."""
    r = np.random.default_rng(4)
    a = r.standard_normal((16, 200)).astype(np.float32).astype(BF16)
    b = r.standard_normal((200, 24)).astype(np.float32).astype(BF16)
    ap = np.pad(a.astype(np.float32), ((0, 0), (0, 56))).astype(BF16)
    bp = np.pad(b.astype(np.float32), ((0, 56), (0, 0))).astype(BF16)
    for scheme in ("1x32", "wrapX"):
        assert np.array_equal(bits(N.contract_mm(a, b, "mxfp8", "float8_e4m3fn", scheme)),
                              bits(N.contract_mm(ap, bp, "mxfp8", "float8_e4m3fn", scheme)))


def test_weight_grad_dtype_float32_is_unrounded():
    inp = make_inputs(64, 128, 96, seed=5)
    b = R.mlp_backward_reference(**inp, weight_grad_dtype="bfloat16")
    f = R.mlp_backward_reference(**inp, weight_grad_dtype="float32")
    assert f[1].dtype == np.float32 and f[2].dtype == np.float32
    assert np.array_equal(bits(b[0]), bits(f[0]))  # dX does not depend on it
    for x, y in zip(b[1:], f[1:]):
        assert np.array_equal(bits(x), bits(y.astype(BF16)))
        assert np.any(y != y.astype(BF16).astype(np.float32))


# ----------------------------------------------------------------------------------------------
# checkpoints
# ----------------------------------------------------------------------------------------------

CKPT_NAMES = ("gate_pre", "gate_act", "up", "intermediate")


@pytest.mark.parametrize("precision,scheme", [("mxfp8", "1x32"), ("mxfp8", "wrapX"), ("bf16", "1x32")])
def test_checkpoints_from_phase0_give_identical_outputs(precision, scheme):
    inp = make_inputs(96, 160, 72, seed=6)  # K = 160 and 96 exercise the 128 padding
    lim = ClampLimits(non_linear_upper=0.9, linear_lower=-0.8)
    opts = dict(clamp_limits=lim, matmul_precision=precision, quant_scheme=scheme)
    ck = R.reference_phase0_recompute(inp["hidden_states"], inp["gate_up_weights"], **opts)
    assert all(getattr(ck, n).dtype == np.dtype(BF16) and getattr(ck, n).shape == (96, 72) for n in CKPT_NAMES)
    base = R.mlp_backward_reference(**inp, **opts)
    for r in range(1, 5):
        for subset in itertools.combinations(CKPT_NAMES, r):
            out = R.mlp_backward_reference(**inp, **{n: getattr(ck, n) for n in subset}, **opts)
            for x, y in zip(base, out):
                assert np.array_equal(bits(x), bits(y)), subset


def test_given_checkpoints_are_used():
    """A different (given) intermediate changes dW_down only; the phases compose to the whole."""
    inp = make_inputs(64, 128, 64, seed=8)
    ck = R.reference_phase0_recompute(inp["hidden_states"], inp["gate_up_weights"])
    other = (ck.intermediate.astype(np.float32) * 2).astype(BF16)
    a = R.mlp_backward_reference(**inp, intermediate=ck.intermediate)
    b = R.mlp_backward_reference(**inp, intermediate=other)
    assert np.array_equal(bits(a[0]), bits(b[0])) and np.array_equal(bits(a[1]), bits(b[1]))
    assert np.array_equal(b[2].astype(np.float32), (a[2].astype(np.float32) * 2))  # exact power of 2
    d_gate, d_up, inter = R.reference_phase1_down_proj_grad(
        inp["output_grad"], inp["down_proj_weight"], ck.gate_pre, ck.up)
    assert np.array_equal(bits(inter), bits(ck.intermediate))
    _, _, none = R.reference_phase1_down_proj_grad(
        inp["output_grad"], inp["down_proj_weight"], ck.gate_pre, ck.up, ck.gate_act, ck.intermediate)
    assert none is None
    d_gu = np.concatenate([d_gate, d_up], axis=1)
    assert np.array_equal(bits(R.reference_phase2_hidden_states_grad(d_gu, inp["gate_up_weights"])), bits(a[0]))
    assert np.array_equal(bits(R.reference_phase3_gate_up_weight_grad(d_gu, inp["hidden_states"])), bits(a[1]))
    assert np.array_equal(bits(R.reference_phase4_down_weight_grad(inp["output_grad"], inter)), bits(a[2]))


# ----------------------------------------------------------------------------------------------
# clamps and NaN
# ----------------------------------------------------------------------------------------------

# bf16 values around 1: 1 - 2**-8, 1, 1 + 2**-7, 1 + 2**-6 (1 and 1 + 2**-7 are bf16-adjacent).
_VALS = np.array([1 - 2.0**-8, 1.0, 1 + 2.0**-7, 1 + 2.0**-6])
LO = 1 + 2.0**-10  # not bf16: rounds to 1.0 in bf16 (a bf16 compare would wrongly keep g = 1.0)
HI = 1 + 2.0**-7 - 2.0**-10  # not bf16: rounds to 1 + 2**-7 (a bf16 compare would keep 1 + 2**-7)

# (lower, upper) -> hand-derived mask over _VALS
CLAMP_CASES = [
    ((None, LO), [1, 1, 0, 0]),
    ((LO, None), [0, 0, 1, 1]),
    ((None, HI), [1, 1, 0, 0]),
    ((HI, None), [0, 0, 1, 1]),
    ((LO, 1 + 2.0**-6), [0, 0, 1, 1]),
    ((1 - 2.0**-8, HI), [1, 1, 0, 0]),
    ((None, None), [1, 1, 1, 1]),
]


def _clamp_problem():
    """Phase-1 operands with dI exactly known: H = 32, dY row s = e_s, W_down rows of fp8-exact
    values, so dI[s, :] = W_down[s, :] exactly (mx and bf16 paths)."""
    S, H, I = 4, 32, 4
    dy = np.zeros((S, H), np.float32)
    dy[np.arange(S), np.arange(S)] = 1.0
    wd = np.zeros((H, I), np.float32)
    wd[:S] = np.array([0.5, -0.75, 1.25, 1.5], np.float32)[None, :] * np.array([1, 2, -1, 0.5])[:, None]
    return dy.astype(BF16), wd.astype(BF16)


@pytest.mark.parametrize("side", ["gate", "up"])
@pytest.mark.parametrize("limits,mask", CLAMP_CASES)
def test_clamp_masks_by_hand(side, limits, mask):
    dy, wd = _clamp_problem()
    vals = np.tile(_VALS.astype(np.float32).astype(BF16)[None, :], (4, 1))  # each row all 4 values
    other = np.full((4, 4), 0.5, np.float32).astype(BF16)
    lo, hi = limits
    if side == "gate":
        lim = ClampLimits(non_linear_lower=lo, non_linear_upper=hi)
        gate_pre, up = vals, other
    else:
        lim = ClampLimits(linear_lower=lo, linear_upper=hi)
        gate_pre, up = other, vals
    d_gate, d_up, _ = R.reference_phase1_down_proj_grad(dy, wd, gate_pre, up, clamp_limits=lim)
    masked = d_gate if side == "gate" else d_up
    free = d_up if side == "gate" else d_gate
    want = np.tile(np.array(mask, bool)[None, :], (4, 1))
    assert np.array_equal(masked.astype(np.float32) != 0, want)
    assert np.all(free.astype(np.float32) != 0)
    # mask agrees with the clamp: the clamp moves a value exactly where the mask is 0, onto the
    # float32 limit; same decisions in the internal helper
    lo32 = None if lo is None else np.float32(lo)
    hi32 = None if hi is None else np.float32(hi)
    c, m = N.clamp_and_mask(_VALS.astype(np.float32), lo32, hi32)
    assert np.array_equal(m, np.array(mask, np.float32))
    moved = c != _VALS.astype(np.float32)
    assert np.array_equal(moved, ~np.array(mask, bool))
    assert all(v in (lo32, hi32) for v in c[moved])


def test_clamp_values_enter_d_gate_by_hand():
    """Upper gate limit HI: d_gate = bf16(((dI * uc) * sd) * maskG) with sd = silu'(g) where kept."""
    dy, wd = _clamp_problem()
    gate_pre = np.tile(_VALS.astype(np.float32).astype(BF16)[None, :], (4, 1))
    up = np.full((4, 4), 0.75, np.float32).astype(BF16)
    d_gate, d_up, inter = R.reference_phase1_down_proj_grad(
        dy, wd, gate_pre, up, clamp_limits=ClampLimits(non_linear_upper=HI))
    d_i = wd[:4].astype(np.float32)
    g = gate_pre.astype(np.float64)
    gc = np.minimum(g, np.float64(np.float32(HI)))
    s = 1 / (1 + np.exp(-gc))
    sd = (s * (1 + gc * (1 - s))).astype(np.float32)
    act = (gc * s).astype(np.float32).astype(BF16).astype(np.float32)
    mask = (g <= HI).astype(np.float32)
    want_gate = (((d_i * np.float32(0.75)) * sd) * mask).astype(BF16)
    want_up = (d_i * act).astype(BF16)
    assert np.array_equal(d_gate.astype(np.float32), want_gate.astype(np.float32))
    assert np.array_equal(d_up.astype(np.float32), want_up.astype(np.float32))
    assert np.array_equal(inter.astype(np.float32), (act * np.float32(0.75)).astype(BF16).astype(np.float32))


def test_limit_rounds_to_float32_in_mx_exact_only():
    """A lower limit 1 + 2**-30 is float32 1.0: mx_exact keeps g = 1.0 (contract compares against
    np.float32(limit)); fp32 mode uses the exact limit and masks it."""
    dy, wd = _clamp_problem()
    gate_pre = np.ones((4, 4), np.float32).astype(BF16)
    up = np.full((4, 4), 0.5, np.float32).astype(BF16)
    lim = ClampLimits(non_linear_lower=1 + 2.0**-30)
    g_mx, _, _ = R.reference_phase1_down_proj_grad(dy, wd, gate_pre, up, clamp_limits=lim)
    g_64, _, _ = R.reference_phase1_down_proj_grad(dy, wd, gate_pre, up, clamp_limits=lim, mode="fp32")
    assert np.all(g_mx.astype(np.float32) != 0)
    assert np.all(g_64 == 0)


@pytest.mark.parametrize("mode", R.MODES)
def test_nan_propagates(mode):
    """NaN in X[0, 0]: gate_pre/up row 0 become NaN (NaN MX group / NaN sum), so dX row 0 is NaN,
    the other rows finite; dW_gu and dW_down contract over S through row 0 and are all NaN."""
    inp = make_inputs(64, 96, 48, seed=9)
    inp["hidden_states"][0, 0] = np.nan
    lim = ClampLimits(non_linear_upper=0.5, linear_lower=-0.5)
    dx, dwgu, dwd = (o.astype(np.float32) for o in R.mlp_backward_reference(**inp, clamp_limits=lim, mode=mode))
    assert np.isnan(dx[0]).all() and np.isfinite(dx[1:]).all()
    assert np.isnan(dwgu).all() and np.isnan(dwd).all()


def test_nan_checkpoint_with_clamps():
    """NaN checkpoints with two-sided gate / lower-only up clamps (contract: clamp = min(max(.)), NaN
    propagating; mask 0 for NaN). gate_pre[1, 2] = NaN: sd and gate_act NaN -> d_gate and d_up NaN
    there. up[2, 0] = NaN: uc NaN -> d_gate NaN and intermediate NaN, but d_up = (dI * a) * 0 = 0."""
    dy, wd = _clamp_problem()
    gate_pre = np.full((4, 4), 0.25, np.float32)
    gate_pre[1, 2] = np.nan
    up = np.full((4, 4), 0.5, np.float32)
    up[2, 0] = np.nan
    lim = ClampLimits(non_linear_lower=-1.0, non_linear_upper=1.0, linear_lower=-1.0)
    d_gate, d_up, inter = (o.astype(np.float32) for o in R.reference_phase1_down_proj_grad(
        dy, wd, gate_pre.astype(BF16), up.astype(BF16), clamp_limits=lim))
    want_gate = np.zeros((4, 4), bool)
    want_gate[1, 2] = want_gate[2, 0] = True
    assert np.array_equal(np.isnan(d_gate), want_gate)
    want_up = np.zeros((4, 4), bool)
    want_up[1, 2] = True
    assert np.array_equal(np.isnan(d_up), want_up) and d_up[2, 0] == 0
    assert np.array_equal(np.isnan(inter), want_gate)


# ----------------------------------------------------------------------------------------------
# pre-quantized operands
# ----------------------------------------------------------------------------------------------


def test_prequantize_codes_by_hand():
    """e4m3fn, neuron rule: amax 2**10 -> scale byte 127 + 10 - 7 = 130 (X = 8). 2**10 / 8 = 128 ->
    code 0x70 (exp 7 + bias 7 = 14, mantissa 0); 1 / 8 -> 0x20; -3 / 8 = -0.375 -> 0x80 | 0x2C
    (0.375 = 1.5 * 2**-2: exp field 5, mantissa 4). K = 32 pads to 128: 3 zero groups (byte 0)."""
    a = np.zeros((1, 32), np.float32)
    a[0, :3] = [2.0**10, 1.0, -3.0]
    words, scales = R.prequantize(a.astype(BF16), "float8_e4m3fn", "1x32")
    assert words.dtype == np.uint32 and words.shape == (1, 32)
    assert scales.dtype == np.uint8 and scales.shape == (1, 4)
    assert scales.tolist() == [[130, 0, 0, 0]]
    assert int(words[0, 0]) == 0x70 | (0x20 << 8) | (0xAC << 16)
    assert not words[0, 1:].any()


@pytest.mark.parametrize("fp8", FP8S)
@pytest.mark.parametrize("scheme", ["1x32", "wrapX"])
def test_prequantized_operands_round_trip(fp8, scheme):
    S, H, I = 192, 200, 96  # K = 200 and 192 need padding; 2I = 192 too
    inp = make_inputs(S, H, I, seed=10)
    ops = R.prequantized_operands(**inp, fp8_dtype=fp8, quant_scheme=scheme)
    forms = {  # kernel argument -> ([K, F] matrix, its K axis)
        "down_weight_T": (inp["down_proj_weight"], 0),  # K = H along axis 0 of W_down
        "gate_up_weight_T": (inp["gate_up_weights"], 0),  # K = 2I
        "gate_up_weights": (inp["gate_up_weights"].T, 0),  # K = H (recompute)
        "output_grad_T": (inp["output_grad"], 0),  # K = S
        "hidden_states_T": (inp["hidden_states"], 0),
        "output_grad": (inp["output_grad"].T, 0),  # K = H (phase 1)
        "hidden_states": (inp["hidden_states"].T, 0),
    }
    assert set(ops) == {n for f in forms for n in (f, f + "_scales")}
    for name, (mat, axis) in forms.items():
        F, K = mat.shape[1], mat.shape[0]
        kp = -(-K // 128) * 128
        words, scales = ops[name], ops[name + "_scales"]
        assert words.shape == (F, kp // 4) and words.dtype == np.uint32
        assert scales.shape == (F, kp // 32) and scales.dtype == np.uint8
        deq = R.dequantize_prequantized(words, scales, fp8, scheme)
        # the mx_exact matmul quantizes the [K, F] operand along its axis 0 after padding
        want = N.quantize_k(mat, axis, fp8, scheme).dequantize().T
        assert np.array_equal(bits(deq), bits(want))
        assert not deq[:, K:].any() and not unpack_x4(words)[:, K:].any()
        # the quantization is faithful: within an e5m2 half-ulp (2**-3 relative) of the bf16 values,
        # plus half an fp8 subnormal step for elements tiny against their group (<= amax * 2**-17)
        m = mat.astype(np.float32).T
        assert np.all(np.abs(deq[:, :K] - m) <= 2.0**-3 * np.abs(m) + 2.0**-16 * np.abs(m).max())


@pytest.mark.parametrize("scheme", ["1x32", "wrapX"])
def test_swizzled_layout(scheme):
    """prequantize(..., swizzled=True) follows the documented layout (api.py), checked element by element:
    word row k0/4 + p, column f, byte j holds code [f, k0 + k(p, j)] with k = 4p + j ("1x32") or
    p + (T/4) j ("wrapX") in each K tile [k0, k0 + T); scale row r, column f = unswizzled scale [f, r];
    unswizzle_prequantized inverts it."""
    a = np.random.default_rng(3).standard_normal((5, 700)).astype(np.float32).astype(BF16)  # Kp = 768: 512 + 256
    words, scales = R.prequantize(a, quant_scheme=scheme)
    sw_words, sw_scales = R.prequantize(a, quant_scheme=scheme, swizzled=True)
    codes, sw_bytes = unpack_x4(words), unpack_x4(sw_words.T.copy())  # [F, Kp], [F, Kp] in swizzled order
    assert sw_words.shape == (192, 5) and sw_scales.shape == (24, 5)
    for k0, T in ((0, 512), (512, 256)):
        for p in range(T // 4):
            for j in range(4):
                k = 4 * p + j if scheme == "1x32" else p + (T // 4) * j
                assert np.array_equal(sw_bytes[:, k0 + 4 * p + j], codes[:, k0 + k])
    assert np.array_equal(sw_scales, scales.T)
    assert all(np.array_equal(x, y) for x, y in zip(R.unswizzle_prequantized(sw_words, sw_scales, scheme),
                                                    (words, scales)))
    assert (scheme == "1x32") == np.array_equal(sw_words, words.T)


def test_prequantized_operand_reproduces_phase4():
    """mx_matmul(MXTensor(prequantized dY^T), quantize(intermediate along S)) = phase 4 bit for bit."""
    S, H, I = 192, 128, 64
    inp = make_inputs(S, H, I, seed=11)
    ck = R.reference_phase0_recompute(inp["hidden_states"], inp["gate_up_weights"], quant_scheme="wrapX")
    ops = R.prequantized_operands(**inp, quant_scheme="wrapX")
    a = MXTensor(unpack_x4(ops["output_grad_T"]), ops["output_grad_T_scales"], 1, "float8_e4m3fn", "wrapX", 512)
    inter = np.pad(ck.intermediate.astype(np.float32), ((0, 64), (0, 0)))  # S 192 -> 256
    b = quantize_mx(inter, axis=0, elem_format="float8_e4m3fn", scheme="wrapX", k_tile=512)
    want = mx_matmul(a, b, k_tile=512).astype(BF16)
    got = R.reference_phase4_down_weight_grad(inp["output_grad"], ck.intermediate, quant_scheme="wrapX")
    assert np.array_equal(bits(got), bits(want))


# ----------------------------------------------------------------------------------------------
# metrics and option validation
# ----------------------------------------------------------------------------------------------


def test_error_report_by_hand():
    rep = R.error_report(np.array([3.0, 4.5], np.float32).astype(BF16), np.array([3.0, 4.0]))
    assert rep["rel_fro"] == pytest.approx(0.1, rel=1e-12)
    assert rep["max_abs"] == 0.5
    assert rep["cosine"] == pytest.approx(27 / (5 * np.sqrt(29.25)), rel=1e-12)


def test_ulp_diff_bf16_by_hand():
    tiny = 2.0**-133  # smallest positive bf16 subnormal
    big = float(ml_dtypes.finfo(BF16).max)
    a = np.array([1.0, 1.0, 0.0, tiny, 1.0, big, -1.0, np.nan, np.nan])
    b = np.array([1.0078125, 1.0, -0.0, -tiny, 2.0, np.inf, -1.0078125, np.nan, 1.0])
    d = R.ulp_diff_bf16(a, b)
    assert d.tolist()[:7] == [1, 0, 0, 2, 128, 1, 1]
    assert d[7] == 0 and d[8] == np.iinfo(np.int64).max
    assert R.fraction_over_ulp([1.0, 1.0, 1.0, 1.0], [1.0, 1.0078125, 1.015625, 2.0]) == 0.5
    assert R.fraction_over_ulp([1.0, 1.0], [1.0, 2.0], ulps=128) == 0.0


@pytest.mark.parametrize("kw", [dict(mode="fp16"), dict(fp8_dtype="float16"), dict(quant_scheme="2x16"),
                                dict(matmul_precision="fp8"), dict(weight_grad_dtype="float16")])
def test_bad_options_rejected(kw):
    inp = make_inputs(32, 32, 32, seed=12)
    with pytest.raises(ValueError):
        R.mlp_backward_reference(**inp, **kw)
