"""nkilib.core.options: the one validation of the numeric options every layer accepts."""
import ml_dtypes
import numpy as np
import pytest

import nki.language as nl
from nkilib.core import options
from nkilib.core.options import OptionError
from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8 import ClampLimits


@pytest.mark.parametrize("value, want", [
    ("float8_e4m3fn", "float8_e4m3fn"), ("float8_e5m2_x4", "float8_e5m2"), ("e4m3fn", "float8_e4m3fn"),
    (nl.float8_e4m3fn_x4, "float8_e4m3fn"), (nl.float8_e5m2, "float8_e5m2"),
    (np.dtype(ml_dtypes.float8_e4m3fn), "float8_e4m3fn"), (ml_dtypes.float8_e5m2, "float8_e5m2"),
])
def test_fp8_format_spellings(value, want):
    assert options.fp8_format(value) == want


@pytest.mark.parametrize("value", ["float8_e4m3", "fp8", nl.float8_e4m3, nl.bfloat16, True, None, 8])
def test_fp8_format_rejects(value):
    with pytest.raises(OptionError, match=r"fp8_dtype must be one of \('float8_e4m3fn', 'float8_e5m2'\)"):
        options.fp8_format(value)


def test_fp8_x4_only_takes_packed_dtypes():
    assert options.fp8_format(nl.float8_e5m2_x4, "fp8_x4_dtype", x4_only=True) == "float8_e5m2"
    for value in (nl.float8_e4m3fn, "float8_e4m3fn", "e4m3fn"):
        with pytest.raises(OptionError, match=r"fp8_x4_dtype must be one of \['float8_e4m3fn_x4', "
                                                   r"'float8_e5m2_x4'\], got"):
            options.fp8_format(value, "fp8_x4_dtype", x4_only=True)


def test_scheme_and_precision():
    assert options.quant_scheme("wrapX") == "wrapX" and options.matmul_precision("bf16") == "bf16"
    with pytest.raises(OptionError, match=r"quant_scheme must be one of \('1x32', 'wrapX'\), got '1X32'"):
        options.quant_scheme("1X32")
    with pytest.raises(OptionError, match=r"matmul_precision must be one of \('mxfp8', 'bf16'\), got None"):
        options.matmul_precision(None)
    with pytest.raises(OptionError, match=r"scale_rule must be one of \('a', 'b'\), got \['a'\]"):
        options.check_choice("scale_rule", ["a"], ("a", "b"))


@pytest.mark.parametrize("value, want", [
    (nl.bfloat16, "bfloat16"), (nl.float32, "float32"), ("float32", "float32"), ("fp32", "float32"),
    ("bf16", "bfloat16"), (np.float32, "float32"), (np.dtype(ml_dtypes.bfloat16), "bfloat16"),
])
def test_weight_grad_dtype_spellings(value, want):
    assert options.weight_grad_dtype(value) == want


@pytest.mark.parametrize("value", [nl.float16, "float16", None, False])
def test_weight_grad_dtype_rejects(value):
    with pytest.raises(OptionError, match=r"weight_grad_dtype must be nl.bfloat16 or nl.float32, got"):
        options.weight_grad_dtype(value, spelled="nl.bfloat16 or nl.float32")


def test_weight_grad_dtype_without_short_names():
    """The kernel entry point takes dtypes and their full names only (short_names=False)."""
    assert options.weight_grad_dtype("float32", short_names=False) == "float32"
    with pytest.raises(OptionError, match=r"weight_grad_dtype must be bfloat16 or float32, got 'bf16'"):
        options.weight_grad_dtype("bf16", short_names=False)


def test_clamp_values_from_limits_dict_and_none():
    assert options.clamp_values(None) == (None, None, None, None)
    assert options.clamp_values(ClampLimits(non_linear_upper=7, linear_lower=-7.0)) == (None, 7.0, -7.0, None)
    got = options.clamp_values({"linear_upper": 2})
    assert got == (None, None, None, 2.0) and isinstance(got[3], float)


@pytest.mark.parametrize("limits, match", [
    ({"upper": 1.0}, r"clamp_limits: unknown keys \['upper'\]"),
    ((1.0, 2.0), r"clamp_limits must be a ClampLimits, a dict with keys"),
    ({"linear_lower": float("nan")}, r"clamp_limits.linear_lower must not be NaN"),
    ({"non_linear_upper": True}, r"clamp_limits.non_linear_upper must be a float or None, got True"),
    ({"non_linear_lower": "1"}, r"clamp_limits.non_linear_lower must be a float or None, got '1'"),
    ({"linear_lower": 1.0, "linear_upper": 1.0}, r"linear_lower \(1.0\) must be smaller than linear_upper \(1.0\)"),
])
def test_clamp_values_rejects(limits, match):
    with pytest.raises(OptionError, match=match):
        options.clamp_values(limits)


def test_host_checks_raise_a_value_error():
    """Host-side layers keep ValueError semantics (OptionError derives from it); the kernel-side failure
    (fail=kernel_fail) is the builtin AssertionError, not an OptionError."""
    from nkilib.core.kernel_helpers import kernel_fail

    assert issubclass(OptionError, ValueError) and not issubclass(OptionError, AssertionError)
    with pytest.raises(ValueError, match=r"quant_scheme must be one of"):
        options.quant_scheme("2x16")
    with pytest.raises(AssertionError, match=r"quant_scheme must be one of") as info:
        options.quant_scheme("2x16", fail=kernel_fail)
    assert type(info.value) is AssertionError


def test_every_layer_rejects_alike():
    """The NumPy reference and the torch emulation validate through options (same message)."""
    from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8 import reference

    x = np.zeros((32, 32), ml_dtypes.bfloat16)
    with pytest.raises(OptionError, match=r"quant_scheme must be one of \('1x32', 'wrapX'\), got '2x16'"):
        reference.prequantize(x, quant_scheme="2x16")
    with pytest.raises(OptionError, match=r"fp8_dtype must be one of"):
        reference.prequantize(x, fp8_dtype="float8_e4m3")
    import torch

    from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8 import mlp_bwd_mxfp8_emulate as emu

    with pytest.raises(OptionError, match=r"quant_scheme must be one of \('1x32', 'wrapX'\), got '2x16'"):
        emu.mx_quantize_dequantize(torch.zeros(4, 64), 1, quant_scheme="2x16")


def test_kernel_numerics_defaults_and_target():
    """The kernels' precision default follows the target; MXFP8 on Trn2 is refused with the way out.
    kernel_numerics runs inside the traced kernel body: it fails with the builtin AssertionError."""
    assert options.kernel_numerics(None, True, nl.float8_e4m3fn_x4, "1x32", nl.bfloat16) == ("mxfp8", "bfloat16")
    assert options.kernel_numerics(None, False, nl.float8_e4m3fn_x4, "wrapX", "float32") == ("bf16", "float32")
    with pytest.raises(AssertionError, match=r"matmul_precision='mxfp8' needs Trn3 .* use matmul_precision='bf16'"):
        options.kernel_numerics("mxfp8", False, nl.float8_e4m3fn_x4, "1x32", nl.bfloat16)
    with pytest.raises(AssertionError, match=r"fp8_x4_dtype must be one of \['float8_e4m3fn_x4', "):
        options.kernel_numerics("mxfp8", True, nl.float8_e4m3fn, "1x32", nl.bfloat16)
    with pytest.raises(AssertionError, match=r"weight_grad_dtype must be nl.bfloat16 or nl.float32, got 'fp32'"):
        options.kernel_numerics("bf16", True, nl.float8_e4m3fn_x4, "1x32", "fp32")
