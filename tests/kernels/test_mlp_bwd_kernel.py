"""Tests of the MXFP8 SwiGLU MLP backward kernel (mlp_backward_mxfp8_nki) on the simulator.

Expected values come from reference.py's mode "mx_exact" (the numerics contract, bit for bit) and, for
accuracy, from torch float64 autograd of the forward (simkit.mlp_torch_oracle), which shares no code with
reference.py or nkilib.mx (the reference module is tested on its own in test_mlp_reference.py).
Option matrix (pairwise, not the full product):

| test                                  | varied                                   | fixed                           |
|---------------------------------------|------------------------------------------|---------------------------------|
| test_matches_references               | shape (small S, remainder, aligned, S    | e4m3fn, 1x32, bf16 wg           |
|                                       | over 2-3 K tiles) x LNC                  |                                 |
| test_clamped_against_oracle           | LNC                                      | all clamps, S=777               |
| test_scale_rule_golden                | LNC (hand-derived phase-4 values)        | fp32 weight grads               |
| test_checkpoint_combinations_identical| 16 checkpoint subsets                    | all four clamps, LNC2           |
| test_given_checkpoints_are_used       | each checkpoint replaced                 | LNC1                            |
| test_lnc2_odd_tile_counts             | odd tile grids, LNC1 vs LNC2             | e4m3fn, 1x32                    |
| test_fp8_formats                      | e4m3fn / e5m2                            | LNC1 and LNC2                   |
| test_quant_schemes_wide_range         | 1x32 / wrapX, two shapes (pow2 inputs)   | e4m3fn                          |
| test_prequantized_operands            | each pre-quantized operand, all, weights | e4m3fn+1x32, e5m2+wrapX         |
|                                       | None; swizzled layout                    |                                 |
| test_clamp_patterns                   | 5 clamp patterns                         | LNC2                            |
| test_clamp_boundary_values            | 4 patterns, values exactly at the limits | given checkpoints               |
| test_trn2_* / test_trn3_bf16          | target x matmul_precision                | LNC1 and LNC2                   |
| test_weight_grad_dtype                | bf16 / fp32 weight grads                 | LNC2                            |
| test_matmul_config_variants           | MatmulConfig / MlpBwdMatmulConfig        | LNC1 and LNC2                   |
| test_scale_packing                    | use_scale_packing False / True           | 3 K tiles along H, 2 along 2I   |
| test_nan_inf_propagate                | NaN in X, Inf in dY                      | LNC1 and LNC2                   |

Every LNC2 run has the simulator's race detector on (a race raises) and strict uninitialised-read
checks on (the tests/conftest.py default, asserted in test_strict_mode_is_on).
"""
from __future__ import annotations

import numpy as np
import pytest

import nki.language as nl
from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8 import ClampLimits, MatmulConfig, MlpBwdMatmulConfig
from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8.reference import error_report, prequantized_operands
from nkilib.simulator.settings import current_settings
from simkit import (BF16, MLP_CHECKPOINTS, assert_matches_mx_exact, assert_outputs_identical, bits,
                    count_bits_differ, mlp_checkpoints, mlp_inputs, mlp_reference, mlp_torch_oracle, rel_fro, run_mlp)

# (S, H, I): measured rel_fro of (dX, dW_gu, dW_down) against the torch float64 autograd oracle
# (simkit.mlp_torch_oracle, independent of reference.py and nkilib.mx), e4m3fn, 1x32, seed S + H + I.
# test_matches_references bounds each at ORACLE_MARGIN x its measured value.
SHAPE_ERRORS = {
    (1, 64, 64): (0.0731, 0.0801, 0.0750),  # single token
    (7, 96, 160): (0.0697, 0.0679, 0.0632),  # small S, H and I not multiples of 128
    (32, 128, 128): (0.0669, 0.0672, 0.0672),
    (100, 160, 96): (0.0678, 0.0691, 0.0672),  # remainder tiles everywhere (S, H, I, 2I)
    (128, 256, 128): (0.0685, 0.0676, 0.0668),  # aligned
    (256, 384, 256): (0.0675, 0.0678, 0.0651),  # aligned, several tiles per dimension
    (128, 128, 384): (0.0682, 0.0684, 0.0662),  # I > H
    # token contraction (K = S, phases 3 and 4) over several 512-wide K tiles, odd remainders
    (640, 64, 32): (0.0672, 0.0648, 0.0683),  # 512 + 128
    (777, 64, 96): (0.0665, 0.0679, 0.0670),  # 512 + 265 (padded to 384)
    (1100, 96, 64): (0.0685, 0.0679, 0.0675),  # 512 + 512 + 76 (padded to 128)
}
SHAPES = list(SHAPE_ERRORS)
ORACLE_MARGIN = 1.1  # seeds are fixed: the margin covers only platform BLAS differences in the oracle

# Clamp limits that are not bf16 values (bf16 RNE would give -0.25, 0.5, -0.75, 0.5), chosen so that
# silu of the gate limits lands on another bf16 value than silu of its bf16 rounding: a kernel that
# rounded any limit to bf16 would differ from mx_exact (test_clamp_patterns checks this on the reference).
GATE_LOWER = -(0.25 + 2.0 ** -11)
GATE_UPPER = 0.5 + 2.0 ** -11
UP_LOWER = -(0.75 + 2.0 ** -11)
UP_UPPER = 0.5 + 2.0 ** -12
CLAMP_PATTERNS = {
    "none": None,
    "gate_upper": ClampLimits(non_linear_upper=GATE_UPPER),
    "gate_lower": ClampLimits(non_linear_lower=GATE_LOWER),
    "up_both": ClampLimits(linear_lower=UP_LOWER, linear_upper=UP_UPPER),
    "all": ClampLimits(non_linear_lower=GATE_LOWER, non_linear_upper=GATE_UPPER, linear_lower=UP_LOWER,
                       linear_upper=UP_UPPER),
}
ALL_CLAMPS = CLAMP_PATTERNS["all"]


def _fp32_errors(out, ideal):
    """[(rel_fro, 1 - cosine)] per output against the fp32-mode reference."""
    reps = [error_report(o, i) for o, i in zip(out, ideal)]
    return [(r["rel_fro"], 1.0 - r["cosine"]) for r in reps]


def _matmul_counts(result):
    """Matmul work per program of a traced run: PSUM bytes written over all matmul instructions (partitions x
    bytes per partition of each dst window), so a tile run in column pieces (the kernel's last tile,
    MatmulPlan.piece_last_tile) counts as the whole tile."""
    counts = [0] * result.lnc
    for rec in result.trace:
        if rec.instr in ("nc_matmul_mx", "nc_matmul"):
            dst = rec.writes[0]
            counts[rec.program] += (dst.partition_hi - dst.partition_lo) * (dst.byte_hi - dst.byte_lo)
    return counts


_n_differ = count_bits_differ


# ----------------------------------------------------------------------------------------------
# accuracy: every output against mx_exact (tight) and fp32 (bounded); LNC1 == LNC2
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("S,H,I", SHAPES, ids=[f"S{s}_H{h}_I{i}" for s, h, i in SHAPES])
def test_matches_references(S, H, I):
    """All three outputs vs mx_exact (bit-exact), LNC1 == LNC2, and vs the torch float64 autograd oracle
    within ORACLE_MARGIN of the error measured for this shape (SHAPE_ERRORS); the fp32-mode reference
    agrees with the oracle to 1e-6 (it is the same ideal backward, written independently)."""
    inp = mlp_inputs(S, H, I, seed=S + H + I)
    out1 = run_mlp(inp, lnc=1)
    out2 = run_mlp(inp, lnc=2)
    assert [o.dtype for o in out1] == [BF16, BF16, BF16]
    assert [o.shape for o in out1] == [(S, H), (2 * I, H), (H, I)]
    assert_matches_mx_exact(out1, mlp_reference(inp))
    assert_outputs_identical(out1, out2, "LNC1 vs LNC2")
    oracle = mlp_torch_oracle(inp)
    for k, (o, want, measured) in enumerate(zip(out1, oracle, SHAPE_ERRORS[(S, H, I)])):
        err = rel_fro(o, want)
        assert 0.01 < err <= ORACLE_MARGIN * measured, f"output {k}: rel_fro {err:.4f} vs oracle, measured {measured}"
    for k, (ideal, want) in enumerate(zip(mlp_reference(inp, mode="fp32"), oracle)):
        assert rel_fro(ideal, want) < 1e-6, f"output {k}: fp32 reference vs oracle"


@pytest.mark.parametrize("lnc", [1, 2])
def test_clamped_against_oracle(lnc):
    """With all four clamps the kernel stays within ORACLE_MARGIN of its measured error against the torch
    oracle (S=777: two K tiles of the token contraction). Measured rel_fro 0.2655 / 0.2626 / 0.0803: the
    recomputed gate_pre / up carry the MX error, so values near a limit (+-0.25..0.75, inside the bulk of
    the distribution) land on the other side of it and flip their mask bit against the exact forward."""
    inp = mlp_inputs(777, 64, 96, seed=21)
    out = run_mlp(inp, lnc=lnc, clamp_limits=ALL_CLAMPS)
    assert_matches_mx_exact(out, mlp_reference(inp, clamp_limits=ALL_CLAMPS))
    for k, (o, want, measured) in enumerate(zip(out, mlp_torch_oracle(inp, ALL_CLAMPS), (0.2655, 0.2626, 0.0803))):
        assert 0.01 < rel_fro(o, want) <= ORACLE_MARGIN * measured, f"output {k}"


@pytest.mark.parametrize("lnc", [1, 2])
def test_scale_rule_golden(lnc):
    """Hand-derived golden values of phase 4 (dW_down = dY^T @ intermediate, K = S), independent of
    reference.py and nkilib.mx: pins the quantize_mx scale rule, which kernel and mx_exact share.

    Every dY column is [1.875, 2**-16, 0, ...] along S (one MX group), the intermediate checkpoint's columns
    [1, 1, 0, ...]. Under the SDK 2.31+ rule the group scale is 2**(0 - 7): 1.875 -> code 240 and 2**-16 ->
    2**-9 (the smallest e4m3fn subnormal), both exact, so every dW_down element is 1.875 + 2**-16 (fp32
    weight grads hold it exactly). A scale one step larger flushes 2**-16 to 0 (1.875); one step smaller
    saturates 480 -> 448 (1.75 + 2**-16)."""
    S, H, I = 32, 64, 64
    dy = np.zeros((S, H), np.float32)
    dy[0], dy[1] = 1.875, 2.0 ** -16
    inter = np.zeros((S, I), np.float32)
    inter[:2] = 1.0
    zeros = np.zeros((S, I), BF16)
    inp = dict(output_grad=dy.astype(BF16), hidden_states=np.zeros((S, H), BF16),
               down_proj_weight=np.zeros((H, I), BF16), gate_up_weights=np.zeros((2 * I, H), BF16),
               gate_pre=zeros, gate_act=zeros, up=zeros, intermediate=inter.astype(BF16))
    out = run_mlp(inp, lnc=lnc, weight_grad_dtype=nl.float32)
    assert np.all(out[2] == np.float32(1.875 + 2.0 ** -16)), np.unique(out[2])


def test_strict_mode_is_on():
    """The suite runs with strict uninitialised-read checks (the launcher also checks every output
    element was written); LNC2 runs additionally check cross-core races (a race raises)."""
    assert current_settings().strict


@pytest.mark.parametrize("S,H,I,config", [
    (384, 384, 384, MatmulConfig(m_tile=128, n_tile=128)),  # 3 N blocks in every phase: split 2 / 1
    (384, 128, 96, None),  # a single N block in phases 1, 2 and 4: the 3 S / H tiles are split instead
], ids=["3_blocks_each_phase", "3_m_tiles"])
def test_lnc2_odd_tile_counts(S, H, I, config):
    """LNC2 with an odd number of tiles (split unevenly, nothing must be halved): the outputs equal
    LNC1's and mx_exact, both cores issue matmuls, and together exactly as much matmul work as LNC1 (no tile is
    computed twice or skipped)."""
    inp = mlp_inputs(S, H, I, seed=11)
    r1 = run_mlp(inp, lnc=1, trace=True, matmul_config=config)
    r2 = run_mlp(inp, lnc=2, trace=True, matmul_config=config)
    assert_matches_mx_exact(r1.outputs, mlp_reference(inp))
    assert_outputs_identical(r1.outputs, r2.outputs, "LNC1 vs LNC2")
    (n1,), (c0, c1) = _matmul_counts(r1), _matmul_counts(r2)
    assert c0 > 0 and c1 > 0 and c0 != c1, (c0, c1)  # both cores work; the odd grid is split unevenly
    assert c0 + c1 == n1, (c0, c1, n1)


# ----------------------------------------------------------------------------------------------
# checkpoints
# ----------------------------------------------------------------------------------------------


def test_checkpoint_combinations_identical():
    """All 16 subsets of {gate_pre, gate_act, up, intermediate} given (each given one computed by
    reference_phase0_recompute, i.e. exactly what the kernel would recompute) give bit-identical
    outputs, equal to mx_exact; with all four clamps on and LNC2 (S=200: two S tiles, one per core)."""
    S, H, I = 200, 160, 96
    inp = mlp_inputs(S, H, I, seed=5)
    ckpt = mlp_checkpoints(inp, clamp_limits=ALL_CLAMPS)
    base = run_mlp(inp, lnc=2, clamp_limits=ALL_CLAMPS)
    assert_matches_mx_exact(base, mlp_reference(inp, clamp_limits=ALL_CLAMPS))
    for mask in range(1, 16):
        given = {name: ckpt[name] for b, name in enumerate(MLP_CHECKPOINTS) if mask >> b & 1}
        out = run_mlp({**inp, **given}, lnc=2, clamp_limits=ALL_CLAMPS)
        assert_outputs_identical(base, out, f"checkpoints {sorted(given)} vs none")


@pytest.mark.parametrize("name", MLP_CHECKPOINTS)
def test_given_checkpoints_are_used(name):
    """A given checkpoint is read, not recomputed: replacing it with other values changes the outputs,
    exactly as the reference given the same checkpoint predicts."""
    S, H, I = 100, 160, 96
    inp = mlp_inputs(S, H, I, seed=6)
    other = np.random.default_rng(60).standard_normal((S, I)).astype(np.float32).astype(BF16)
    base = run_mlp(inp)
    out = run_mlp({**inp, name: other})
    assert_matches_mx_exact(out, mlp_reference({**inp, name: other}))
    assert _n_differ(base, out) > 0
    if name == "intermediate":  # only phase 4 reads it
        assert_outputs_identical(base[:2], out[:2], "dX, dW_gu with another intermediate")


# ----------------------------------------------------------------------------------------------
# numeric options
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lnc", [1, 2])
def test_fp8_formats(lnc):
    """e4m3fn and e5m2 each match their mx_exact reference (bit-exact) and give different outputs.

    Measured vs fp32 (S=100, H=160, I=96): e4m3fn rel_fro 0.066 / 0.067 / 0.067, e5m2 0.129 / 0.132 /
    0.130 (one mantissa bit less); bounded here at ORACLE_MARGIN x the largest: 0.074 and 0.146.
    """
    inp = mlp_inputs(100, 160, 96, seed=3)
    ideal = mlp_reference(inp, mode="fp32")
    outs = {}
    for dt, bound in ((nl.float8_e4m3fn_x4, 0.074), (nl.float8_e5m2_x4, 0.146)):
        outs[dt] = run_mlp(inp, lnc=lnc, fp8_x4_dtype=dt)
        assert_matches_mx_exact(outs[dt], mlp_reference(inp, fp8_x4_dtype=dt))
        assert max(rel for rel, _ in _fp32_errors(outs[dt], ideal)) <= bound
    e4, e5 = outs.values()
    for k in range(3):
        assert np.mean(bits(e4[k]) != bits(e5[k])) > 0.5, f"output {k}: formats give the same bits"


@pytest.mark.parametrize("S,H,I", [(128, 256, 256), (100, 160, 96)], ids=["aligned", "remainder"])
def test_quant_schemes_wide_range(S, H, I):
    """1x32 and wrapX differ in which K elements share an MX scale; with +-2**e inputs (e in [-12, 12],
    wider than an fp8 group holds) they give different outputs (measured: 0.6..1.7% of the elements),
    and each matches its own mx_exact reference (bit-exact)."""
    inp = mlp_inputs(S, H, I, seed=4, kind="pow2")
    out = {}
    for scheme in ("1x32", "wrapX"):
        out[scheme] = run_mlp(inp, lnc=2, quant_scheme=scheme)
        assert_matches_mx_exact(out[scheme], mlp_reference(inp, quant_scheme=scheme))
        assert all(np.isfinite(o.astype(np.float32)).all() for o in out[scheme])
    for k in range(3):
        assert np.count_nonzero(bits(out["1x32"][k]) != bits(out["wrapX"][k])) > 0, f"output {k}"


PREQ_NAMES = ("down_weight_T", "gate_up_weight_T", "output_grad_T", "hidden_states_T", "gate_up_weights")
PREQ_CASES = {  # id: (pre-quantized operands, bf16 tensors passed as None)
    "down_T": (("down_weight_T",), ()),
    "down_T_no_bf16": (("down_weight_T",), ("down_proj_weight",)),
    "gate_up_T": (("gate_up_weight_T",), ()),
    "gate_up_recompute_rhs": (("gate_up_weights",), ()),  # W_gu along H: recompute; phase 2 from gate_up_weight_T
    "output_grad_T": (("output_grad_T",), ()),
    "hidden_states_T": (("hidden_states_T",), ()),
    "all": (PREQ_NAMES, ("down_proj_weight",)),
}


@pytest.mark.parametrize("fp8,scheme", [(nl.float8_e4m3fn_x4, "1x32"), (nl.float8_e5m2_x4, "wrapX")],
                         ids=["e4m3fn_1x32", "e5m2_wrapX"])
@pytest.mark.parametrize("case,swizzled", [(c, False) for c in PREQ_CASES] + [("all", True), ("down_T_no_bf16", True)],
                         ids=[c for c in PREQ_CASES] + ["all-swizzled", "down_T_no_bf16-swizzled"])
def test_prequantized_operands(case, fp8, scheme, swizzled):
    """Operands pre-quantized with reference.prequantized_operands (both layouts) give outputs bit-equal to
    the run that quantizes the same bf16 tensors in-kernel (S=100, H=160, I=96: K padded in every
    orientation); the activations stay bf16 where not listed (mixed). gate_up_weights pre-quantized along
    H serves the recompute only, so phase 2 reads gate_up_weight_T (bf16 [H, 2I], PE-transposed)."""
    names, dropped = PREQ_CASES[case]
    inp = mlp_inputs(100, 160, 96, seed=7)
    opts = dict(fp8_x4_dtype=fp8, quant_scheme=scheme)
    pq = prequantized_operands(inp["output_grad"], inp["hidden_states"], inp["down_proj_weight"],
                               inp["gate_up_weights"], fp8_dtype=str(fp8), quant_scheme=scheme, names=names,
                               swizzled=swizzled)
    swz = {"down_weight_T": "down_weight_is_swizzled", "gate_up_weight_T": "gate_up_weight_T_is_swizzled",
           "output_grad_T": "output_grad_T_is_swizzled", "hidden_states_T": "hidden_states_T_is_swizzled",
           "gate_up_weights": "gate_up_weights_is_swizzled"}
    given = {k: pq[k] for n in names for k in (n, n + "_scales")}
    if swizzled:
        given.update({swz[n]: True for n in names})
    if "gate_up_weights" in names and "gate_up_weight_T" not in names:
        given["gate_up_weight_T"] = np.ascontiguousarray(inp["gate_up_weights"].T)
    base = run_mlp(inp, lnc=2, **opts)
    out = run_mlp({**{k: v for k, v in inp.items() if k not in dropped and k not in given}, **given}, lnc=2, **opts)
    assert_outputs_identical(base, out, f"pre-quantized {names} vs in-kernel quantization")
    assert_matches_mx_exact(out, mlp_reference(inp, **opts))


def _limits_map(limits, fn):
    """ClampLimits with fn applied to every given limit."""
    names = ("non_linear_lower", "non_linear_upper", "linear_lower", "linear_upper")
    return ClampLimits(**{n: fn(n, getattr(limits, n)) for n in names if getattr(limits, n) is not None})


@pytest.mark.parametrize("pattern", list(CLAMP_PATTERNS))
def test_clamp_patterns(pattern):
    """Each clamp pattern matches mx_exact (bit-exact); a clamp changes the outputs, and its limits are
    hit by the inputs (some recomputed gate_pre / up values fall outside, most inside). The reference
    with the limits rounded to bf16 differs, so the exact match pins the float32 limits."""
    limits = CLAMP_PATTERNS[pattern]
    inp = mlp_inputs(100, 160, 96, seed=9)
    out = run_mlp(inp, lnc=2, clamp_limits=limits)
    assert_matches_mx_exact(out, mlp_reference(inp, clamp_limits=limits))
    if limits is None:
        return
    ckpt = mlp_checkpoints(inp)  # unclamped gate_pre / up are what the limits are compared against
    for side, lo, hi in (("gate_pre", limits.non_linear_lower, limits.non_linear_upper),
                         ("up", limits.linear_lower, limits.linear_upper)):
        v = ckpt[side].astype(np.float32)
        for lim, sign in ((lo, -1.0), (hi, 1.0)):
            if lim is not None:
                assert float(np.float32(lim).astype(BF16)) != lim  # the limit is not a bf16 value
                outside = float(np.mean(sign * v > sign * np.float32(lim)))
                assert 0.05 < outside < 0.75, f"{side} limit {lim}: {outside:.2f} outside"
    assert _n_differ(out, run_mlp(inp, lnc=2)) > 0
    rounded = _limits_map(limits, lambda n, v: float(np.float32(v).astype(BF16)))
    assert _n_differ(out, mlp_reference(inp, clamp_limits=rounded)) > 0


BOUNDARY_PATTERNS = {  # bf16-representable limits (present in the checkpoints exactly), except GATE_UPPER
    "gate_lower": ClampLimits(non_linear_lower=-1.0),
    "gate_upper": ClampLimits(non_linear_upper=0.5),
    "up_both": ClampLimits(linear_lower=-0.75, linear_upper=0.75),
    "all": ClampLimits(non_linear_lower=-1.0, non_linear_upper=GATE_UPPER, linear_lower=-0.75, linear_upper=0.75),
}


@pytest.mark.parametrize("pattern", list(BOUNDARY_PATTERNS))
def test_clamp_boundary_values(pattern):
    """gate_pre / up checkpoints made only of the limits and their bf16 neighbours: bounds are inclusive
    and compared in float32 against float32(limit), as in mx_exact (bit-exact match). The reference with
    exclusive bounds (each limit moved one float32 ulp inward) differs, so the match pins inclusivity."""
    limits = BOUNDARY_PATTERNS[pattern]
    S, H, I = 64, 128, 96
    inp = mlp_inputs(S, H, I, seed=10)
    r = np.random.default_rng(100)
    specials = np.array([0.5, 0.50390625, 0.49609375, -1.0, -1.0078125, -0.9921875, 0.75, -0.75,
                         0.7578125, -0.7578125, 0.0, 2.0], np.float32)
    ck = {**inp, "gate_pre": r.choice(specials, (S, I)).astype(BF16), "up": r.choice(specials, (S, I)).astype(BF16)}
    out = run_mlp(ck, clamp_limits=limits)
    assert_matches_mx_exact(out, mlp_reference(ck, clamp_limits=limits))
    exclusive = _limits_map(limits, lambda n, v: float(
        np.nextafter(np.float32(v), np.float32(-np.inf if n.endswith("upper") else np.inf))))
    assert _n_differ(out, mlp_reference(ck, clamp_limits=exclusive)) > 0


# ----------------------------------------------------------------------------------------------
# targets and precision
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lnc", [1, 2])
def test_trn2_defaults_to_bf16(set_target, lnc):
    """Trn2 has no MX instructions: the default precision there is bf16 (nc_matmul), matching the
    bf16 mx_exact reference bit-exactly; equal to an explicit matmul_precision='bf16' on trn3.

    Measured vs fp32 (S=100, H=160, I=96): rel_fro 0.0032 / 0.0032 / 0.0040, 1 - cosine <= 8e-6 (only
    the bf16 roundings of d_gate_up, checkpoints and outputs); bounded at 0.0045 / 1e-5.
    """
    inp = mlp_inputs(100, 160, 96, seed=3)
    set_target("trn2")
    out = run_mlp(inp, lnc=lnc)
    assert_matches_mx_exact(out, mlp_reference(inp, matmul_precision="bf16"))
    for rel, one_minus_cos in _fp32_errors(out, mlp_reference(inp, mode="fp32")):
        assert rel <= 0.0045 and one_minus_cos <= 1e-5
    set_target("trn3")
    assert_outputs_identical(out, run_mlp(inp, lnc=lnc, matmul_precision="bf16"), "trn2 default vs trn3 bf16")


def test_trn2_mxfp8_raises(set_target):
    """matmul_precision='mxfp8' on Trn2 is rejected with an error naming the platform."""
    set_target("trn2")
    with pytest.raises(AssertionError, match=r"mxfp8.*Trn2"):
        run_mlp(mlp_inputs(32, 64, 64, seed=0), matmul_precision="mxfp8")


@pytest.mark.parametrize("lnc", [1, 2])
def test_weight_grad_dtype(lnc):
    """weight_grad_dtype=fp32: weight grads are float32 and bit-equal to mx_exact; the bf16 run's weight
    grads are exactly their RNE rounding and dX is unchanged."""
    inp = mlp_inputs(100, 160, 96, seed=12)
    o16 = run_mlp(inp, lnc=lnc)
    o32 = run_mlp(inp, lnc=lnc, weight_grad_dtype=nl.float32)
    assert [o.dtype for o in o32] == [BF16, np.float32, np.float32]
    assert_matches_mx_exact(o32, mlp_reference(inp, weight_grad_dtype=nl.float32))
    assert_outputs_identical(o16, (o32[0], o32[1].astype(BF16), o32[2].astype(BF16)), "bf16 vs rounded fp32")


@pytest.mark.parametrize("config", [
    MatmulConfig(m_tile=64, n_tile=256),
    MlpBwdMatmulConfig(phase1=MatmulConfig(m_tile=32, n_tile=128), phase2=MatmulConfig(m_tile=128, n_tile=64),
                       phase3=MatmulConfig(m_tile=96, n_tile=512), phase4=MatmulConfig(m_tile=34, n_tile=200)),
], ids=["m64_n256", "per_phase"])
@pytest.mark.parametrize("lnc", [1, 2])
def test_matmul_config_variants(config, lnc):
    """Output tiling does not change the numbers: outputs equal the default-config LNC1 run bit for bit
    (S=160, H=384, I=384: several and partial tiles with every config)."""
    inp = mlp_inputs(160, 384, 384, seed=13)
    base = run_mlp(inp)
    assert_matches_mx_exact(base, mlp_reference(inp))
    assert_outputs_identical(base, run_mlp(inp, lnc=lnc, matmul_config=config), f"{config}")


def test_scale_packing():
    """use_scale_packing False / True give identical outputs, matching mx_exact. H=1280 gives 3 K tiles
    of 512 (last partial) in the K=H matmuls and 2I=576 gives 2 in phase 2, so packed scale tiles
    really hold several K tiles."""
    inp = mlp_inputs(32, 1280, 288, seed=14)
    packed = run_mlp(inp, lnc=2, use_scale_packing=True)
    assert_matches_mx_exact(packed, mlp_reference(inp))
    assert_outputs_identical(packed, run_mlp(inp, lnc=2, use_scale_packing=False), "scale packing off vs on")


@pytest.mark.parametrize("lnc", [1, 2])
def test_nan_inf_propagate(lnc):
    """Documented behaviour: NaN/Inf in the inputs propagate like the reference (an MX group holding
    NaN/Inf gets a NaN scale), never a crash. The outputs equal mx_exact, NaN positions included."""
    inp = mlp_inputs(32, 128, 96, seed=15)
    x, dy = inp["hidden_states"].copy(), inp["output_grad"].copy()
    x[3, 5] = np.nan
    dy[10, 17] = np.inf
    inp = {**inp, "hidden_states": x, "output_grad": dy}
    out = run_mlp(inp, lnc=lnc)
    ref = mlp_reference(inp)
    for o, r in zip(out, ref):
        np.testing.assert_array_equal(o.astype(np.float32), r.astype(np.float32))  # NaN == NaN here
    nan_frac = [float(np.isnan(o.astype(np.float32)).mean()) for o in out]
    # dX: only the rows of the two poisoned tokens are NaN. Weight grads: the K=S groups holding those
    # rows are NaN for every column, so every weight-grad element is NaN (as in the reference).
    assert 0 < nan_frac[0] < 0.1, nan_frac
    assert nan_frac[1] == nan_frac[2] == 1.0, nan_frac


# ----------------------------------------------------------------------------------------------
# model shapes (pytest -m slow)
# ----------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("S,H,I", [(4096, 4096, 1536), (512, 2880, 2880)], ids=["qwen3_8b_tp8", "gpt_oss_expert"])
def test_model_shapes(S, H, I):
    """Model shapes under LNC2 vs mx_exact (bit-exact) and fp32 (ORACLE_MARGIN x the measured rel_fro).

    Measured vs fp32 (dX / dW_gu / dW_down): Qwen3-8B TP8 (S=4096, H=4096, I=1536) rel_fro 0.0677 /
    0.0677 / 0.0661, 1 - cosine 0.00229 / 0.00229 / 0.00219; GPT-OSS expert (S=512, H=2880, I=2880)
    rel_fro 0.0677 / 0.0676 / 0.0661, 1 - cosine 0.00229 / 0.00229 / 0.00218. Simulator time: kernel
    runs about 175 s and 31 s, the whole test 4-7 min on 2 cores.
    """
    inp = mlp_inputs(S, H, I, seed=8)
    out = run_mlp(inp, lnc=2)
    assert_matches_mx_exact(out, mlp_reference(inp))
    measured = {4096: (0.0677, 0.0677, 0.0661), 512: (0.0677, 0.0676, 0.0661)}[S]
    for (rel, _), bound in zip(_fp32_errors(out, mlp_reference(inp, mode="fp32")), measured):
        assert rel <= ORACLE_MARGIN * bound
