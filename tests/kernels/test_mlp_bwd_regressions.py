"""Regression tests of issue 10 part 4 ("no silent wrong results", found by fuzzing): each input here once
gave a wrong result or a crash deep inside the kernel; now it gives the right result or an error naming the argument
(AssertionError from the traced kernel body, OptionError from config objects built on the host)."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import nki.language as nl
from nkilib.core.options import OptionError
from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8 import MatmulConfig, MlpBwdMatmulConfig
from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8.reference import prequantized_operands
from simkit import (BF16, assert_matches_mx_exact, assert_outputs_identical, bits, mlp_checkpoints, mlp_inputs,
                    mlp_inputs_with_checkpoints, mlp_reference, run_mlp)

BF16_MAX = float(ml_dtypes.finfo(BF16).max)  # (2 - 2**-7) * 2**127


def test_e8m0_scales_bytes_travel():
    """Scales given as ml_dtypes.float8_e8m0fnu hold the same E8M0 bytes as uint8 ones: the outputs are
    identical (they were value-converted into the uint8 scale tiles before, giving ~0 everywhere)."""
    inp = mlp_inputs(100, 160, 96, seed=30)
    names = ["down_weight_T", "gate_up_weight_T", "output_grad_T", "hidden_states_T"]
    pq = prequantized_operands(inp["output_grad"], inp["hidden_states"], inp["down_proj_weight"],
                               inp["gate_up_weights"], names=names)
    as_u8 = run_mlp({**inp, **pq}, lnc=2)
    e8m0 = {k: (v.view(ml_dtypes.float8_e8m0fnu) if k.endswith("_scales") else v) for k, v in pq.items()}
    assert all(e8m0[n + "_scales"].dtype == ml_dtypes.float8_e8m0fnu for n in names)
    out = run_mlp({**inp, **e8m0}, lnc=2)
    assert_outputs_identical(as_u8, out, "float8_e8m0fnu vs uint8 scales")
    assert_matches_mx_exact(out, mlp_reference(inp))


@pytest.mark.parametrize("where", ["output_grad", "hidden_states", "both"])
@pytest.mark.parametrize("lnc", [1, 2])
def test_bf16_maximum_inputs(where, lnc):
    """Elements at and just below the bf16 maximum (>= 1.9375 * 2**127: their fp8 code rounds up to 2**128,
    beyond float32) in dY and/or X: kernel and mx_exact agree bit for bit, Inf/NaN positions included.

    The product precision (nkilib.mx.mx_matmul, nc_matmul_mx in the simulator): products of dequantized
    values are exact and only the fp32 rounding of a tile's sum overflows, so e.g. 2**128 * 2**-3 stays
    finite. The mx_exact reference used to dequantize to float32 first (Inf) and gave Inf/NaN rows where
    the kernel was finite.
    """
    inp = mlp_inputs(64, 128, 96, seed=31)
    for name in (("output_grad", "hidden_states") if where == "both" else (where,)):
        a = inp[name].copy()
        a[3, 7], a[40, 100], a[41, 0] = BF16_MAX, -1.9375 * 2.0 ** 127, 1.9375 * 2.0 ** 127
        inp[name] = a
    out = run_mlp(inp, lnc=lnc)
    ref = mlp_reference(inp)
    assert_matches_mx_exact(out, ref)
    for o, r in zip(out, ref):
        assert np.array_equal(bits(o), bits(r))
    dx = out[0].astype(np.float32)
    others = np.delete(dx, [3, 40, 41], axis=0)
    assert np.isfinite(others).all()  # the other tokens' dX rows stay finite (no NaN poisoning through phase 2)


def test_weight_grad_dtype_strings():
    """weight_grad_dtype="float32" / "bfloat16" (strings, as reference.py takes them) work like nl.float32 /
    nl.bfloat16; an unknown string is rejected naming the argument (it crashed with AttributeError)."""
    inp = mlp_inputs(32, 64, 96, seed=32)
    assert_outputs_identical(run_mlp(inp, weight_grad_dtype=nl.float32), run_mlp(inp, weight_grad_dtype="float32"))
    assert_outputs_identical(run_mlp(inp), run_mlp(inp, weight_grad_dtype="bfloat16"))
    with pytest.raises(AssertionError, match=r"weight_grad_dtype must be nl.bfloat16 or nl.float32, got 'fp32'"):
        run_mlp(inp, weight_grad_dtype="fp32")


# Configs the validator accepted but that died with a simulator CapacityError naming an internal tile. PSUM
# has 8 banks of 2 KiB; allocations take whole banks; phase 1 holds 3 double-buffered accumulators when it
# recomputes gate_pre/up (1 otherwise) plus 2 banks of PE transposes; phases 3-4 hold 1 double-buffered.
@pytest.mark.parametrize("config,recompute,match", [
    (MlpBwdMatmulConfig(phase1=MatmulConfig(n_tile=1024)), True, r"phase1.n_tile=1024 .* at most 512 here"),
    (MlpBwdMatmulConfig(phase1=MatmulConfig(n_tile=2048)), False, r"phase1.n_tile=2048 .* at most 1536 here"),
    (MlpBwdMatmulConfig(phase3=MatmulConfig(n_tile=4096)), False, r"phase3.n_tile=4096 .* at most 2048 here"),
    (MatmulConfig(n_tile=513), True, r"phase1.n_tile=513 does not fit PSUM \(3 accumulator\(s\) x 2 buffers x 2 "
                                     r"PSUM banks \+ 2 banks of PE transposes exceed the 8 PSUM banks, phase 1 "
                                     r"recomputing gate_pre/up\): at most 512 here"),
], ids=["p1_recompute_1024", "p1_2048", "p3_4096", "all_513"])
def test_matmul_config_beyond_psum(config, recompute, match):
    inp = mlp_inputs(32, 64, 96, seed=33)
    if not recompute:
        inp = {**inp, **mlp_checkpoints(inp)}
    with pytest.raises(AssertionError, match=r"matmul_config\." + match):
        run_mlp(inp, matmul_config=config)


@pytest.mark.parametrize("config", [MatmulConfig(n_tile=513), MlpBwdMatmulConfig(
    phase1=MatmulConfig(n_tile=1536), phase2=MatmulConfig(n_tile=1536), phase3=MatmulConfig(n_tile=2048),
    phase4=MatmulConfig(n_tile=2048))], ids=["all_513", "widest"])
def test_matmul_config_at_psum_capacity_runs(config):
    """The widest configs the validator accepts (with checkpoints: phase 1 holds one accumulator) run
    and give the default config's outputs."""
    inp = mlp_inputs_with_checkpoints(32, 64, 96, seed=33)
    assert_outputs_identical(run_mlp(inp), run_mlp(inp, lnc=2, matmul_config=config), str(config))


@pytest.mark.parametrize("field", ["phase1", "phase2", "phase3", "phase4"])
def test_mlp_bwd_matmul_config_fields_validated(field):
    with pytest.raises(OptionError, match=rf"MlpBwdMatmulConfig.{field} must be a MatmulConfig or None, "
                                               r"got \(64, 256\)"):
        MlpBwdMatmulConfig(**{field: (64, 256)})


@pytest.mark.parametrize("kwargs,match", [(dict(n_tile=True), r"n_tile must be an int .* got True"),
                                          (dict(m_tile=64.0), r"m_tile must be an even int .* got 64.0")])
def test_matmul_config_types(kwargs, match):
    with pytest.raises(OptionError, match=rf"MatmulConfig.{match}"):
        MatmulConfig(**kwargs)


def test_bf16_maximum_inputs_emulate_backend():
    """The torch emulate backend (bit-exact emulation of the kernel) agrees with mx_exact at the bf16 maximum
    too: its MX matmul multiplies float64 dequantized values, like nkilib.mx.mx_matmul."""
    pytest.importorskip("torch")
    from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8.mlp_bwd_mxfp8_emulate import mlp_backward_emulate
    from simkit import to_numpy, to_torch

    inp = mlp_inputs(64, 128, 96, seed=31)
    for name in ("output_grad", "hidden_states"):
        a = inp[name].copy()
        a[3, 7], a[41, 0] = BF16_MAX, 1.9375 * 2.0 ** 127
        inp[name] = a
    out = mlp_backward_emulate(*(to_torch(inp[n]) for n in ("output_grad", "hidden_states", "down_proj_weight",
                                                               "gate_up_weights")))
    # values and NaN / Inf positions equal (NaN payloads and signs of zero may differ between torch and numpy)
    assert_matches_mx_exact(tuple(to_numpy(o) for o in out), mlp_reference(inp))
