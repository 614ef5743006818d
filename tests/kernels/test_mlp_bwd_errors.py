"""Bad input to mlp_backward_mxfp8_nki (and its config objects): an error naming the argument and the
expected / received value, never a crash or a silent wrong result. Checks inside the traced kernel body
raise the builtin AssertionError at trace time (kernel_assert); the config objects, built on the host before
the launch, raise OptionError (a ValueError). docs/kernel-structure.md, "raising exceptions"."""
from __future__ import annotations

import numpy as np
import pytest

import nki.language as nl
from nkilib.core.options import OptionError
from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8 import ClampLimits, MatmulConfig, MlpBwdMatmulConfig
from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8.reference import prequantized_operands
from simkit import BF16, mlp_checkpoints, mlp_inputs, run_mlp

S, H, I = 32, 64, 96  # all different, so a transposed or swapped operand cannot pass a shape check


@pytest.fixture
def inp():
    return mlp_inputs(S, H, I, seed=0)


@pytest.fixture
def pq(inp):
    return prequantized_operands(inp["output_grad"], inp["hidden_states"], inp["down_proj_weight"],
                                 inp["gate_up_weights"])


def _raises(inp, match, lnc=1, **options):
    with pytest.raises(AssertionError, match=match):
        run_mlp(inp, lnc=lnc, **options)


def _bf16(shape):
    return np.zeros(shape, BF16)


# ---- rank, shape and dtype of each operand ----


@pytest.mark.parametrize("name,match", [
    ("output_grad", r"output_grad must be a 2-D \[S, H\] tensor, got \(1, 32, 64\)"),
    ("hidden_states", r"hidden_states must be 2-D \[32, 64\], got shape \(1, 32, 64\)"),
    ("down_proj_weight", r"down_proj_weight must be a 2-D \[H, I\] tensor, got \(1, 64, 96\)"),
    ("gate_up_weights", r"gate_up_weights must be 2-D \[192, 64\], got shape \(1, 192, 64\)"),
    ("gate_pre", r"gate_pre must be 2-D \[32, 96\], got shape \(1, 32, 96\)"),
])
def test_wrong_rank(inp, name, match):
    inp[name] = (inp[name] if name in inp else _bf16((S, I)))[None]  # [1, ...]
    _raises(inp, match)


@pytest.mark.parametrize("name,match", [
    ("hidden_states", r"hidden_states must have shape \[32, 64\], got \[64, 32\]"),
    ("down_proj_weight", r"down_proj_weight must have shape \[64, 64\], got \[96, 64\]"),  # I read from dim 1
    ("gate_up_weights", r"gate_up_weights must have shape \[192, 64\], got \[64, 192\]"),
])
def test_wrong_shape_transposed_operand(inp, name, match):
    inp[name] = np.ascontiguousarray(inp[name].T)
    _raises(inp, match)


@pytest.mark.parametrize("name", ["gate_pre", "gate_act", "up", "intermediate"])
def test_checkpoint_wrong_shape(inp, name):
    inp[name] = _bf16((S, I + 32))
    _raises(inp, rf"{name} must have shape \[32, 96\], got \[32, 128\]")


@pytest.mark.parametrize("name,shape,match", [
    ("hidden_states", (S + 1, H), r"hidden_states must have shape \[32, 64\], got \[33, 64\]"),  # S
    ("gate_pre", (S + 1, I), r"gate_pre must have shape \[32, 96\], got \[33, 96\]"),  # S
    ("gate_up_weights", (2 * I, H + 32), r"gate_up_weights must have shape \[192, 64\], got \[192, 96\]"),  # H
    ("down_proj_weight", (H + 32, I), r"down_proj_weight must have shape \[64, 96\], got \[96, 96\]"),  # H
    ("gate_up_weights", (2 * I + 64, H), r"gate_up_weights must have shape \[192, 64\], got \[256, 64\]"),  # I
], ids=["S_hidden_states", "S_checkpoint", "H_gate_up", "H_down", "I_gate_up_vs_down"])
def test_mismatched_dimensions(inp, name, shape, match):
    inp[name] = _bf16(shape)
    _raises(inp, match)


@pytest.mark.parametrize("name,dtype", [("output_grad", np.float32), ("hidden_states", np.float16),
                                        ("down_proj_weight", np.float32), ("gate_act", np.float32)])
def test_wrong_dtype(inp, name, dtype):
    inp[name] = inp.get(name, _bf16((S, I))).astype(dtype)
    _raises(inp, rf"{name} must have dtype bfloat16, got {np.dtype(dtype).name}")


@pytest.mark.parametrize("h,i", [(48, 64), (64, 40)], ids=["H48", "I40"])
def test_h_or_i_not_multiple_of_32(h, i):
    _raises(mlp_inputs(S, h, i, seed=1), rf"H and I must be multiples of 32.*got H={h}, I={i}")


# ---- pre-quantized operands ----


PQ_NAMES = ("down_weight_T", "gate_up_weight_T", "output_grad_T", "hidden_states_T", "gate_up_weights")


@pytest.mark.parametrize("name", PQ_NAMES)
def test_prequantized_scales_without_data(inp, pq, name):
    inp.pop(name, None)
    _raises(inp, rf"{name}_scales is given but {name} is None: pass the x4 words too",
            **{name + "_scales": pq[name + "_scales"]})


@pytest.mark.parametrize("name,match", [("down_weight_T", r"must have shape \[96, 64\], got \[96, 32\]"),
                                        ("output_grad_T", r"must have dtype bfloat16, got uint32")])
def test_prequantized_words_without_scales(inp, pq, name, match):
    """Without its scales an operand is bf16 (the format is inferred from the scales): words fail its checks."""
    _raises(inp, rf"{name} {match}", **{name: pq[name]})


def test_prequantized_wrong_shape(inp, pq):
    """Words quantized along the wrong K (W_down rather than W_down^T): Kp/4 columns do not match."""
    bad = prequantized_operands(inp["output_grad"], inp["hidden_states"], inp["down_proj_weight"].T.copy(),
                                inp["gate_up_weights"], names=["down_weight_T"])  # [H, I] words: K = I -> [64, 32]
    _raises(inp, r"down_weight_T must have shape \[96, 32\], got \[64, 32\]",
            down_weight_T=bad["down_weight_T"], down_weight_T_scales=pq["down_weight_T_scales"])


def test_prequantized_swizzled_shape(inp, pq):
    """is_swizzled=True expects [Kp/4, F] words: unswizzled [F, Kp/4] words are rejected by shape."""
    _raises(inp, r"output_grad_T must have shape \[32, 64\], got \[64, 32\]", output_grad_T=pq["output_grad_T"],
            output_grad_T_scales=pq["output_grad_T_scales"], output_grad_T_is_swizzled=True)


def test_swizzled_flag_without_scales(inp):
    _raises(inp, r"output_grad_T_is_swizzled=True needs the pre-quantized scales of output_grad_T",
            output_grad_T_is_swizzled=True)


def test_prequantized_scales_wrong_shape(inp, pq):
    _raises(inp, r"output_grad_T_scales must have shape \[64, 4\], got \[64, 8\]",
            output_grad_T=pq["output_grad_T"], output_grad_T_scales=np.zeros((H, 8), np.uint8))


def test_prequantized_wrong_dtype(inp, pq):
    _raises(inp, r"hidden_states_T must have dtype uint32 or .*, got float32",
            hidden_states_T=pq["hidden_states_T"].astype(np.float32),
            hidden_states_T_scales=pq["hidden_states_T_scales"])


def test_prequantized_scales_wrong_dtype(inp, pq):
    _raises(inp, r"hidden_states_T_scales must have dtype uint8 or float8_e8m0fnu, got float32",
            hidden_states_T=pq["hidden_states_T"],
            hidden_states_T_scales=pq["hidden_states_T_scales"].astype(np.float32))


def test_prequantized_with_bf16_precision(inp, pq):
    _raises(inp, r"pre-quantized operands \['output_grad_T'\] need matmul_precision='mxfp8', got 'bf16'",
            matmul_precision="bf16", output_grad_T=pq["output_grad_T"], output_grad_T_scales=pq["output_grad_T_scales"])


def test_prequantized_on_trn2_default_precision(inp, pq, set_target):
    set_target("trn2")
    _raises(inp, r"need matmul_precision='mxfp8', got 'bf16'",
            down_weight_T=pq["down_weight_T"], down_weight_T_scales=pq["down_weight_T_scales"])


@pytest.mark.parametrize("given", [(), ("gate_pre",), ("up",)], ids=["none", "gate_pre_only", "up_only"])
def test_recompute_needs_weights_along_h(inp, pq, given):
    """Without W_gate / W_up along H (only W_gu^T pre-quantized along 2I) gate_pre / up cannot be recomputed."""
    ckpt = mlp_checkpoints(inp)
    inp.update({k: ckpt[k] for k in given})
    inp["gate_up_weights"] = None
    _raises(inp, r"recomputing gate_pre/up needs X along H .* and W_gate/W_up along H",
            gate_up_weight_T=pq["gate_up_weight_T"], gate_up_weight_T_scales=pq["gate_up_weight_T_scales"])


def test_weight_none_without_alternative(inp):
    inp["down_proj_weight"] = None
    _raises(inp, r"down_proj_weight \[H, I\] \(or down_weight_T \[I, H\]\) is required")
    inp.update(gate_up_weights=None, gate_up_weight_T=np.zeros((H, 2 * I), BF16))
    _raises(inp, r"down_proj_weight \[H, I\] \(or down_weight_T \[I, H\], bf16 or pre-quantized with "
                 r"down_weight_T_scales\) is required")
    inp = mlp_inputs(S, H, I, seed=0)
    inp["gate_up_weights"] = None
    _raises(inp, r"phase 2 needs W_gu: pass gate_up_weights \[2I, H\] in bf16, or gate_up_weight_T")


@pytest.mark.parametrize("a,b,value", [("output_grad", "output_hidden_states_grad", None),
                                       ("intermediate", "hidden", None),
                                       ("down_weight_T", "down_proj_weight_T", None)])
def test_alias_given_twice(inp, a, b, value):
    t = inp["output_grad"] if a == "output_grad" else _bf16((S, I) if a == "intermediate" else (I, H))
    _raises({**inp, a: t}, rf"{a} and {b} name the same tensor .*; pass one", **{b: t})


def test_scratch_wrong_shape(inp):
    _raises(inp, r"d_gate_scratch must be None or a \[32, 96\] tensor, got shape \(96, 32\)",
            d_gate_scratch=_bf16((I, S)))
    _raises(inp, r"silu_up_mul_gate_grad_T_scratch must be None or a \[192, 32\] tensor",
            silu_up_mul_gate_grad_T_scratch=_bf16((S, 2 * I)))


# ---- options ----


@pytest.mark.parametrize("dtype", [nl.float8_e4m3, nl.float8_e4m3fn, "fp8"], ids=["legacy_e4m3", "not_x4", "str"])
def test_unsupported_fp8_dtype(inp, dtype):
    _raises(inp, r"fp8_x4_dtype must be one of \['float8_e4m3fn_x4', 'float8_e5m2_x4'\], got", fp8_x4_dtype=dtype)


@pytest.mark.parametrize("scheme", ["2x16", "1X32", None])
def test_bad_quant_scheme(inp, scheme):
    _raises(inp, rf"quant_scheme must be one of \('1x32', 'wrapX'\), got {scheme!r}", quant_scheme=scheme)


@pytest.mark.parametrize("dtype", [nl.float16, nl.float8_e4m3fn])
def test_bad_weight_grad_dtype(inp, dtype):
    _raises(inp, r"weight_grad_dtype must be nl.bfloat16 or nl.float32, got", weight_grad_dtype=dtype)


@pytest.mark.parametrize("precision", ["fp8", "fp32"])
def test_bad_matmul_precision(inp, precision):
    _raises(inp, rf"matmul_precision must be one of \('mxfp8', 'bf16'\), got '{precision}'", matmul_precision=precision)


def test_bad_bool_options(inp):
    _raises(inp, r"run_with_lnc2 must be a bool, got 1", run_with_lnc2=1)
    _raises(inp, r"use_scale_packing must be a bool, got 'yes'", use_scale_packing="yes")


def test_run_with_lnc2_false_under_lnc2_launch(inp):
    _raises(inp, r"run_with_lnc2=False requires a kernel\[1\] launch, got 2 programs", lnc=2, run_with_lnc2=False)


def test_bad_matmul_config(inp):
    _raises(inp, r"matmul_config must be None, MatmulConfig or MlpBwdMatmulConfig, got \(64, 256\)",
            matmul_config=(64, 256))
    with pytest.raises(OptionError, match=r"MatmulConfig.m_tile must be an even int in \[2, 128\], got 63"):
        MatmulConfig(m_tile=63)
    with pytest.raises(OptionError, match=r"MatmulConfig.n_tile must be an int in \[1, 4096\], got 8192"):
        MatmulConfig(n_tile=8192)


def test_matmul_config_beyond_target_limit(inp, set_target):
    """trn2's nc_matmul takes at most 512 moving columns (one fp32 PSUM bank)."""
    set_target("trn2")
    _raises(inp, r"matmul_config.phase2.n_tile=1024 exceeds this target's matmul moving limit 512",
            matmul_config=MlpBwdMatmulConfig(phase2=MatmulConfig(n_tile=1024)))


# ---- clamp limits ----


@pytest.mark.parametrize("name", ["non_linear_lower", "non_linear_upper", "linear_lower", "linear_upper"])
def test_nan_clamp_limit(name):
    with pytest.raises(OptionError, match=rf"ClampLimits.{name} must not be NaN"):
        ClampLimits(**{name: float("nan")})


@pytest.mark.parametrize("side", ["non_linear", "linear"])
@pytest.mark.parametrize("lo,hi", [(1.0, 1.0), (2.0, -1.0)])
def test_clamp_lower_not_below_upper(side, lo, hi):
    with pytest.raises(OptionError, match=rf"{side}_lower \({lo}\) must be smaller than {side}_upper \({hi}\)"):
        ClampLimits(**{f"{side}_lower": lo, f"{side}_upper": hi})


def test_clamp_limit_wrong_type():
    with pytest.raises(OptionError, match=r"ClampLimits.linear_upper must be a float or None, got '1.0'"):
        ClampLimits(linear_upper="1.0")
    with pytest.raises(OptionError, match=r"ClampLimits.non_linear_lower must be a float or None, got True"):
        ClampLimits(non_linear_lower=True)


@pytest.mark.parametrize("limits", [{"linear_upper": 1.0}, (None, 1.0, None, None)], ids=["dict", "tuple"])
def test_clamp_limits_wrong_type(inp, limits):
    _raises(inp, r"clamp_limits must be a ClampLimits or None, got", clamp_limits=limits)


# ---- the kernel's checks under python -O ----

_OPTIMIZED_CHECK = """
import sys
import numpy as np
import ml_dtypes
import nkilib  # noqa: F401  (installs the nki modules: the simulator here)
import nki
from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8 import mlp_backward_mxfp8_nki
try:
    assert False
except AssertionError:
    sys.exit("python -O did not remove a bare assert: this test would not show anything")
z = lambda *shape: np.zeros(shape, ml_dtypes.bfloat16)
try:
    nki.simulate(mlp_backward_mxfp8_nki)[1](output_grad=z(32, 64), hidden_states=z(32, 64),
                                            down_proj_weight=z(64, 96), gate_up_weights=z(64, 192))
except Exception as exc:
    print(type(exc).__name__, exc)
else:
    print("no error")
"""


def test_kernel_check_fires_under_python_optimize():
    """kernel_assert raises explicitly, so the trace-time checks survive `python -O` (a bare `assert`, as
    nki-library writes kernel_assert, would be compiled away and the transposed gate_up_weights would run)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    done = subprocess.run([sys.executable, "-O", "-c", _OPTIMIZED_CHECK], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("AssertionError gate_up_weights must have shape [192, 64], got [64, 192]"), \
        done.stdout + done.stderr
