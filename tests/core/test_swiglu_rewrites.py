"""The SwiGLU epilogue's exact rewrites (nkilib/core/swiglu.py; docs/moe.md section 10, round 14e).

A two-limit clamp's mask is one instruction instead of (x >= lower) * (x <= upper): a tensor_scalar (|x| <= upper)
for symmetric limits, else a tensor_tensor (clamp(x) == x); and the
"gpt_oss" offset is applied inside the product dI * fp32(uc + 1) (one scalar_tensor_tensor) unless the
intermediate is computed on chip. Both must give the contract's bits (nkilib.core.numerics, the mx_exact
formulas) for every input, so the inputs here are adversarial: values exactly at the limits, the neighbouring
bf16 values just inside and outside, +-0, large magnitudes, +-inf and NaN, mixed with random values. The trace
assertions pin the new instruction counts (they fail on the old four-op masks and the separate offset pass).
"""
from __future__ import annotations

import numpy as np
import pytest

import nki.isa as nisa
from nkilib.core import numerics
from nkilib.core.swiglu import exact_in_bf16, intermediate_tile, swiglu_backward_tile, swiglu_forward_terms
from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8 import ClampLimits
from simkit import BF16, run_tiles

import nki.language as nl

P, F = 128, 64
#: GPT-OSS-20B's limits (gate above 7, up within +-7) plus a gate lower bound, so that both masks take the
#: two-limit path (symmetric: |x| <= 7); the same with asymmetric limits (clamp(x) == x); and an asymmetric silu
#: clamp (the kernels' test clamp)
GPT_OSS_BOTH = ClampLimits(non_linear_lower=-7.0, non_linear_upper=7.0, linear_lower=-7.0, linear_upper=7.0,
                           activation="gpt_oss")
GPT_OSS_ASYMMETRIC = ClampLimits(non_linear_lower=-6.5, non_linear_upper=7.0, linear_lower=-7.0, linear_upper=0.75,
                                 activation="gpt_oss")
SILU_ASYMMETRIC = ClampLimits(non_linear_lower=-3.0, non_linear_upper=0.75, linear_lower=-0.75, linear_upper=1.0)


def _neighbours(v):
    """v and the bf16 values just below and above it (as float32)."""
    b = np.array([v], np.float32).astype(BF16).view(np.uint16)
    up, down = (b + 1, b - 1) if v > 0 else (b - 1, b + 1)
    return [v] + [float(np.asarray(w, np.uint16).view(BF16).astype(np.float32)[0]) for w in (down, up)]


def _adversarial(limits, seed):
    """bf16 [P, F]: every limit and its bf16 neighbours, +-0, large, inf and NaN, the rest random."""
    special = [0.0, -0.0, 1.0, -1.0, 3.0e38, -3.0e38, np.inf, -np.inf, np.nan]
    for v in limits:
        if v != None:  # noqa: E711
            special += _neighbours(v) + _neighbours(-v)
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((P, F)) * 6.0).astype(np.float32)
    flat = x.reshape(-1)
    picks = rng.choice(flat.size, size=flat.size // 2, replace=False)
    flat[picks] = rng.choice(np.array(special, np.float32), size=picks.size)
    return x.astype(BF16)


def _epilogue_inputs(clamp, seed):
    """(gate_pre, up bf16 adversarial around clamp's limits (seeds seed, seed + 1); gate_act bf16 and d_i float32
    random (seed + 2), d_i with +-0 and +-3e38 in its first row) [P, F]."""
    limits = (clamp.non_linear_lower, clamp.non_linear_upper, clamp.linear_lower, clamp.linear_upper)
    gate_pre, up = _adversarial(limits, seed=seed), _adversarial(limits, seed=seed + 1)
    rng = np.random.default_rng(seed + 2)
    gate_act = (rng.standard_normal((P, F)) * 4.0).astype(BF16)
    d_i = rng.standard_normal((P, F)).astype(np.float32)
    d_i[0, :4] = [0.0, -0.0, 3.0e38, -3.0e38]
    return gate_pre, up, gate_act, d_i


def _expected(gate_pre, up, gate_act, d_i, clamp):
    """(d_gate, d_up, intermediate) by the mx_exact formulas of nkilib.core.numerics."""
    gc, mask_g = numerics.gate_terms(gate_pre, clamp, "mx_exact")
    lin, mask_u = numerics.up_terms(up, clamp, "mx_exact")
    act_dx = numerics.apply_activation(numerics.activation_fns64(clamp)[1], gc, "mx_exact")
    a = gate_act.astype(np.float32)
    with np.errstate(all="ignore"):
        d_up = ((d_i * a) * mask_u).astype(BF16)
        d_gate = (((d_i * lin) * act_dx) * mask_g).astype(BF16)
        inter = (a * lin).astype(BF16)
    return d_gate, d_up, inter


def _assert_same_bits(got, want, what):
    g, w = np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16)
    nan = np.isnan(np.asarray(want, np.float32))
    assert np.array_equal(np.isnan(np.asarray(got, np.float32)), nan), what
    assert np.array_equal(g[~nan], w[~nan]), f"{what}: {np.count_nonzero(g[~nan] != w[~nan])} elements differ"


@pytest.mark.parametrize("with_intermediate", [False, True], ids=["folded_offset", "intermediate"])
@pytest.mark.parametrize("clamp", [GPT_OSS_BOTH, GPT_OSS_ASYMMETRIC, SILU_ASYMMETRIC],
                         ids=["gpt_oss", "gpt_oss_asymmetric", "silu"])
@pytest.mark.parametrize("clamp_engine", [nisa.engine.unknown, nisa.engine.scalar], ids=["vector", "scalar"])
@pytest.mark.parametrize("psum_d_i", [False, True], ids=["sbuf_dI", "psum_dI"])
def test_epilogue_bits_on_adversarial_values(clamp, with_intermediate, clamp_engine, psum_d_i):
    gate_pre, up, gate_act, d_i = _epilogue_inputs(clamp, seed=3)

    def body(g, u, a, di, d_gate, d_up, inter):
        terms = swiglu_forward_terms(g, u, a, clamp, P, F, F, clamp_engine=clamp_engine)
        if with_intermediate:
            nisa.tensor_copy(dst=inter, src=intermediate_tile(terms))
        else:
            nisa.memset(dst=inter, value=0.0)
        swiglu_backward_tile(di, terms, d_gate, d_up)

    outs, trace = run_tiles(body, (gate_pre, up, gate_act, d_i), [((P, F), nl.bfloat16)] * 3,
                            psum_inputs=(3,) if psum_d_i else (), trace=True)
    d_gate, d_up, inter = _expected(gate_pre, up, gate_act, d_i, clamp)
    _assert_same_bits(outs[0], d_gate, "d_gate")
    _assert_same_bits(outs[1], d_up, "d_up")
    if with_intermediate:
        _assert_same_bits(outs[2], inter, "intermediate")

    ops = [(r.instr, r.attrs.get("op") or r.attrs.get("op0"), r.attrs.get("op1")) for r in trace]
    # both inputs have two limits: one mask instruction each (|x| <= upper where symmetric, else clamp(x) == x)
    symmetric = clamp is GPT_OSS_BOTH
    masks = (ops.count(("tensor_scalar", "abs", "less_equal")), ops.count(("tensor_tensor", "equal", None)))
    assert masks == ((2, 0) if symmetric else (0, 2)), ops
    assert not [o for o in ops if o[1] in ("greater_equal", "less_equal")], ops
    if symmetric:  # the masks run on the clamps' engine
        assert {r.engine for r in trace if r.attrs.get("op0") == "abs"} == {
            "scalar" if clamp_engine == nisa.engine.scalar else "vector"}
    offset_passes = [o for o in ops if o[0] == "tensor_scalar" and o[1] == "add"]
    folded = [o for o in ops if o == ("scalar_tensor_tensor", "add", "multiply")]
    if clamp.activation == "gpt_oss" and not with_intermediate:
        assert (len(offset_passes), len(folded)) == (0, 1), ops
    elif clamp.activation == "gpt_oss":  # the intermediate materializes fp32(uc + 1) once, for both products
        assert (len(offset_passes), len(folded)) == (1, 0), ops
    else:
        assert (len(offset_passes), len(folded)) == (0, 0), ops


def test_one_limit_masks_keep_their_comparison():
    """GPT-OSS's real gate clamp has an upper limit only: its mask stays one comparison (no clamp needed twice)."""
    clamp = ClampLimits(non_linear_upper=7.0, linear_lower=-7.0, linear_upper=7.0, activation="gpt_oss")
    gate_pre, up = _adversarial((7.0, -7.0), seed=8), _adversarial((7.0, -7.0), seed=9)
    rng = np.random.default_rng(10)
    gate_act = (rng.standard_normal((P, F)) * 4.0).astype(BF16)
    d_i = rng.standard_normal((P, F)).astype(np.float32)

    def body(g, u, a, di, d_gate, d_up):
        terms = swiglu_forward_terms(g, u, a, clamp, P, F, F, clamp_engine=nisa.engine.scalar)
        swiglu_backward_tile(di, terms, d_gate, d_up)

    outs, trace = run_tiles(body, (gate_pre, up, gate_act, d_i), [((P, F), nl.bfloat16)] * 2, trace=True)
    d_gate, d_up, _ = _expected(gate_pre, up, gate_act, d_i, clamp)
    _assert_same_bits(outs[0], d_gate, "d_gate")
    _assert_same_bits(outs[1], d_up, "d_up")
    ops = [(r.instr, r.attrs.get("op") or r.attrs.get("op0")) for r in trace]
    assert ops.count(("tensor_scalar", "less_equal")) == 1 and ops.count(("tensor_scalar", "abs")) == 1, ops


@pytest.mark.parametrize("gate_limit", ["upper", "lower"])
@pytest.mark.parametrize("later", [False, True], ids=["issued_now", "issued_later"])
def test_one_limit_gate_mask_in_its_product(gate_limit, later):
    """gate_mask_in_product (docs/moe.md section 10, round 19a): a one-limit gate mask is not materialized; d_gate's
    last product compares (scalar_tensor_tensor: (g op limit) * product). Same bits as the contract's
    bf16(product * mask) on adversarial values (the limit and its bf16 neighbours, +-0, +-3e38, +-inf, NaN) with dI
    large enough that the fp32 product overflows where the mask is 0 (inf * 0 = NaN: the mask must multiply the
    fp32 product, as in the contract, not a rounded one). Issued later (the MaskedProduct the MoE kernel issues a tile
    on), the bits are the same. Fails with < for <= (the values at the limit) or without the mask."""
    upper = gate_limit == "upper"
    clamp = ClampLimits(non_linear_upper=7.0 if upper else None, non_linear_lower=None if upper else -7.0,
                        linear_lower=-7.0, linear_upper=7.0, activation="gpt_oss")
    gate_pre, up = _adversarial((7.0, -7.0), seed=11), _adversarial((7.0, -7.0), seed=12)
    rng = np.random.default_rng(13)
    gate_act = (rng.standard_normal((P, F)) * 4.0).astype(BF16)
    d_i = rng.standard_normal((P, F)).astype(np.float32)
    d_i[:, :8] = [3.0e38, -3.0e38, 1.0e38, -1.0e38, 0.0, -0.0, np.inf, np.nan]

    def body(g, u, a, di, d_gate, d_up):
        terms = swiglu_forward_terms(g, u, a, clamp, P, F, F, clamp_engine=nisa.engine.scalar,
                                     gate_mask_in_product=True)
        pending = swiglu_backward_tile(di, terms, d_gate, d_up, gate_mask_later=later)
        assert (pending != None) == later  # noqa: E711
        if later:
            pending.issue()

    outs, trace = run_tiles(body, (gate_pre, up, gate_act, d_i), [((P, F), nl.bfloat16)] * 2, trace=True)
    d_gate, d_up, _ = _expected(gate_pre, up, gate_act, d_i, clamp)
    _assert_same_bits(outs[0], d_gate, "d_gate")
    _assert_same_bits(outs[1], d_up, "d_up")
    ops = [(r.instr, r.attrs.get("op") or r.attrs.get("op0"), r.attrs.get("op1")) for r in trace]
    cmp = "less_equal" if upper else "greater_equal"
    assert [o for o in ops if o[0] == "tensor_scalar" and o[1] == cmp] == [], ops  # no mask pass
    assert ops.count(("scalar_tensor_tensor", cmp, "multiply")) == 1, ops
    assert ops.count(("tensor_scalar", "abs", "less_equal")) == 1, ops  # up's two-limit mask is unchanged
    products = [o for o in ops if o[0] == "tensor_tensor" and o[1] == "multiply"]
    assert len(products) == 3, ops  # dI * a, (dI * a) * mask_u, (dI * (uc + 1)) * act'(gc): no gate mask product


@pytest.mark.parametrize("clamp, in_product", [(GPT_OSS_BOTH, False), (GPT_OSS_ASYMMETRIC, False),
                                               (ClampLimits(non_linear_upper=7.0, linear_lower=-7.0,
                                                            linear_upper=7.0, activation="gpt_oss"), True)],
                         ids=["two_limit_masks", "asymmetric_masks", "one_limit_in_product"])
@pytest.mark.parametrize("order", ["d_up_first", "d_gate_first", "gate_psum_first"])
def test_gate_first_same_bits_other_order(clamp, in_product, order):
    """swiglu_backward_tile(gate_first=True) (the dense kernel's last S tile, docs/dense-performance.md round 28)
    issues d_gate's PSUM product (dI * fp32(uc + 1), a scalar_tensor_tensor) before d_up's (dI * a) and still issues
    every product of both, masks included: the same bits as the contract on adversarial values (with the masks, a
    d_up left out or written unmasked fails). The default order is unchanged (d_up's product first).
    gate_psum_first=True (the dense kernel's plain S tile switches, round 39) issues the same PSUM products in
    gate_first's order but d_gate's activation derivative (ScalarE's fp32 act'(gc)) after both of them, where
    gate_first issues it before both and the default between them; the same bits. Round 38's code has no
    gate_psum_first (TypeError)."""
    gate_pre, up, gate_act, d_i = _epilogue_inputs(clamp, seed=21)
    flags = dict(gate_first=order == "d_gate_first", gate_psum_first=order == "gate_psum_first")

    def body(g, u, a, di, d_gate, d_up):
        terms = swiglu_forward_terms(g, u, a, clamp, P, F, F, clamp_engine=nisa.engine.scalar,
                                     gate_mask_in_product=in_product)
        assert swiglu_backward_tile(di, terms, d_gate, d_up, **flags) == None  # noqa: E711

    outs, trace = run_tiles(body, (gate_pre, up, gate_act, d_i), [((P, F), nl.bfloat16)] * 2, psum_inputs=(3,),
                            trace=True)
    d_gate, d_up, _ = _expected(gate_pre, up, gate_act, d_i, clamp)
    _assert_same_bits(outs[0], d_gate, "d_gate")
    _assert_same_bits(outs[1], d_up, "d_up")
    reads_d_i = [r.instr for r in trace if any(o.buffer == "psum" for o in r.reads)]
    gate_psum = ["scalar_tensor_tensor", "tensor_tensor"]
    assert reads_d_i == (gate_psum[::-1] if order == "d_up_first" else gate_psum), reads_d_i
    # where act'(gc) (the activation writing an fp32 tile after the forward terms) stands among the PSUM products
    steps = [("psum" if any(o.buffer == "psum" for o in r.reads) else "act'")
             for r in trace if any(o.buffer == "psum" for o in r.reads) or
             (r.instr == "activation" and r.writes[0].dtype == "float32" and r.attrs.get("op") != "copy")]
    expected = {"d_up_first": ["psum", "act'", "psum"], "d_gate_first": ["act'", "psum", "psum"],
                "gate_psum_first": ["psum", "psum", "act'"]}[order]
    assert steps[-3:] == expected, steps


def test_gate_first_and_gate_psum_first_are_exclusive():
    """Both orders at once are refused with the flags' values (kernel_assert)."""
    gate_pre, up, gate_act, d_i = _epilogue_inputs(GPT_OSS_BOTH, seed=22)

    def body(g, u, a, di, d_gate, d_up):
        terms = swiglu_forward_terms(g, u, a, GPT_OSS_BOTH, P, F, F, clamp_engine=nisa.engine.scalar)
        swiglu_backward_tile(di, terms, d_gate, d_up, gate_first=True, gate_psum_first=True)

    with pytest.raises(Exception, match="gate_first=True, gate_psum_first=True"):
        run_tiles(body, (gate_pre, up, gate_act, d_i), [((P, F), nl.bfloat16)] * 2, psum_inputs=(3,))


#: limits that bf16 cannot hold (fp32(0.3) and fp32(7.1) need more than 8 significant bits): the clamped values stay
#: fp32 with narrow=True, only the masks go to bf16
INEXACT_LIMITS = ClampLimits(non_linear_upper=7.1, linear_lower=-0.3, linear_upper=0.3, activation="gpt_oss")


@pytest.mark.parametrize("with_intermediate", [False, True], ids=["folded_offset", "intermediate"])
@pytest.mark.parametrize("clamp", [GPT_OSS_BOTH, GPT_OSS_ASYMMETRIC, SILU_ASYMMETRIC, INEXACT_LIMITS],
                         ids=["gpt_oss", "gpt_oss_asymmetric", "silu", "inexact_limits"])
def test_narrow_clamps_and_masks_keep_the_bits(clamp, with_intermediate):
    """narrow=True (docs/moe.md section 10, round 32a): the clamps of the bf16 gate_pre / up are written as bf16 where
    every limit is a bf16 value (clamp(x) is x or a limit: no rounding), the masks always (1.0 / 0.0), so ScalarE's
    tensor_scalar passes run in its 2x mode. Every reader computes in fp32 from the same values: the contract's bits
    on adversarial values (the limits and their bf16 neighbours, +-0, +-3e38, +-inf, NaN), and the clamped dtype
    falls back to fp32 for limits bf16 cannot hold (a bf16 clamp there would round the limit: 0.3 -> 0.30078)."""
    gate_pre, up, gate_act, d_i = _epilogue_inputs(clamp, seed=17)

    def body(g, u, a, di, d_gate, d_up, inter):
        terms = swiglu_forward_terms(g, u, a, clamp, P, F, F, clamp_engine=nisa.engine.scalar, narrow=True)
        if with_intermediate:
            nisa.tensor_copy(dst=inter, src=intermediate_tile(terms))
        else:
            nisa.memset(dst=inter, value=0.0)
        swiglu_backward_tile(di, terms, d_gate, d_up)

    outs, trace = run_tiles(body, (gate_pre, up, gate_act, d_i), [((P, F), nl.bfloat16)] * 3, psum_inputs=(3,),
                            trace=True)
    d_gate, d_up, inter = _expected(gate_pre, up, gate_act, d_i, clamp)
    _assert_same_bits(outs[0], d_gate, "d_gate")
    _assert_same_bits(outs[1], d_up, "d_up")
    if with_intermediate:
        _assert_same_bits(outs[2], inter, "intermediate")
    clamps = [r for r in trace if r.instr == "tensor_scalar" and r.attrs["op0"] in ("maximum", "minimum")]
    masks = [r for r in trace if (r.instr, r.attrs.get("op0") or r.attrs.get("op")) in
             (("tensor_scalar", "abs"), ("tensor_scalar", "less_equal"), ("tensor_scalar", "greater_equal"),
              ("tensor_tensor", "equal"))]
    assert len(clamps) == 2 and len(masks) == 2, [(r.instr, r.attrs) for r in trace]
    exact = clamp is not INEXACT_LIMITS
    assert {r.attrs["dst_dtype"] for r in clamps} == {"bfloat16" if exact else "float32"}, clamps
    assert {r.attrs["dst_dtype"] for r in masks} == {"bfloat16"}, masks


def test_exact_in_bf16_matches_numpy():
    """exact_in_bf16 (plain Python, traced) against NumPy's bf16 round trip on limits of every kind: small integers,
    halves, values of 8 and 9 significant bits, tiny and huge normals, subnormals (refused: kept fp32), +-inf."""
    rng = np.random.default_rng(4)
    values = [0.0, -0.0, 7.0, -7.0, 6.5, 0.75, 1.0, 0.3, 7.1, 255.0, 257.0, 2.0 ** -126, 2.0 ** -127, 3.0e38,
              float(np.finfo(np.float32).max), np.inf, -np.inf]
    values += [float(v) for v in (rng.standard_normal(200) * 10.0).astype(BF16).astype(np.float32)]
    values += [float(v) for v in rng.standard_normal(50) * 10.0]
    for v in values:
        want = bool(np.isfinite(v)) and (v == 0 or abs(v) >= 2.0 ** -126) and float(
            np.array([v], np.float64).astype(BF16).astype(np.float64)[0]) == v
        assert exact_in_bf16(v) == want, v
