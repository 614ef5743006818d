"""The numeric options of the MXFP8 kernels, validated once for every layer that takes them.

The kernel entry point, the NumPy reference (reference.py), the torch emulation (mlp_bwd_mxfp8_emulate.py)
and the torch layer (mlp_bwd_mxfp8_torch.py) all accept the same choices: the fp8 element format, the MX
quantization scheme, the matmul precision, the weight-gradient dtype and the SwiGLU clamps. Each layer
calls these functions, which return the canonical value (a string or a tuple of floats) or fail with a
message naming the argument, the accepted values and the value received. How they fail is the caller's:
`fail=host_fail` (the default; host-side layers: references, emulation, torch ops, option objects built
before a launch) raises OptionError, a ValueError; the kernel entry points' check (kernel_numerics, called
inside the traced kernel body) fails through nkilib.core.kernel_helpers.kernel_fail, a builtin
AssertionError (docs/kernel-structure.md, "raising exceptions").

Pure Python on purpose (no numpy, no torch): it runs at NKI trace time, inside torch.compile graphs and in
the references alike. Dtype-like values (nl / numpy / ml_dtypes / torch dtypes) are recognised by their
name (`.name`, `__name__` or `str()`, a leading "torch." dropped).
"""
from __future__ import annotations

from .kernel_helpers import kernel_fail
from .matmul.constants import FP8_X4_DTYPE_NAMES, MATMUL_PRECISIONS, QUANT_SCHEMES

FP8_FORMATS = ("float8_e4m3fn", "float8_e5m2")  # MX element formats (OCP MX v1.0 FP8 E4M3 / E5M2)
FP8_SHORT_NAMES = ("e4m3fn", "e5m2")
WEIGHT_GRAD_DTYPES = ("bfloat16", "float32")
WEIGHT_GRAD_ALIASES = (("bf16", "bfloat16"), ("fp32", "float32"))  # short names the torch layer has accepted
CLAMP_NAMES = ("non_linear_lower", "non_linear_upper", "linear_lower", "linear_upper")
#: Gated functions of the SwiGLU epilogue (ClampLimits.activation), gc / uc the clamped gate / up:
#:   "silu": gate_act = silu(gc) = gc*sigmoid(gc), intermediate = gate_act * uc (Llama, Qwen, Mixtral);
#:   "gpt_oss": gate_act = gelu_apprx_sigmoid(gc) = gc*sigmoid(1.702*gc) (the ScalarE function of that name),
#:              intermediate = gate_act * (uc + 1) (GPT-OSS's experts, swiglu_alpha = 1.702; the 1.702 of
#:              gelu_apprx_sigmoid: docs/simulator.md#choice-activation-numerics).
ACTIVATIONS = ("silu", "gpt_oss")
#: The linear factor's offset of each activation: intermediate = gate_act * (uc + UP_OFFSETS[activation]).
UP_OFFSETS = {"silu": 0.0, "gpt_oss": 1.0}
#: The gate sigmoid's slope of each activation (silu: 1; gelu_apprx_sigmoid: 1.702, fixed by the ScalarE function).
GATE_ALPHAS = {"silu": 1.0, "gpt_oss": 1.702}


class OptionError(ValueError):
    """An invalid option or argument found by host-side code (never raised inside traced kernel code)."""


def host_fail(msg: str) -> None:
    """Raise OptionError(msg): the failure of a host-side check."""
    raise OptionError(msg)


def check_choice(what: str, value, choices, fail=host_fail):
    """`value` when it is one of `choices`, else fail("<what> must be one of (...), got <value>")."""
    if not _is_str(value) or value not in choices:
        fail(f"{what} must be one of {tuple(choices)}, got {value!r}")
    return value


def quant_scheme(value, fail=host_fail) -> str:
    """"1x32" (OCP-contiguous groups of 32 along K) or "wrapX" (groups strided by K/4 in each 512-wide K tile)."""
    return check_choice("quant_scheme", value, QUANT_SCHEMES, fail)


def matmul_precision(value, fail=host_fail) -> str:
    """"mxfp8" (quantize_mx + nc_matmul_mx, Trn3) or "bf16" (nc_matmul)."""
    return check_choice("matmul_precision", value, MATMUL_PRECISIONS, fail)


def dtype_name(value) -> str:
    """The name of a dtype-like value: "bfloat16" for nl.bfloat16, np.dtype(ml_dtypes.bfloat16), the
    ml_dtypes type itself, torch.bfloat16 or the string; "" when it has none."""
    if _is_str(value):
        return value
    for attr in ("name", "__name__"):
        name = getattr(value, attr, None)
        if _is_str(name):
            return name
    text = str(value)
    return text[len("torch."):] if text.startswith("torch.") else text


def fp8_format(value, what: str = "fp8_dtype", x4_only: bool = False, fail=host_fail) -> str:
    """The MX element format "float8_e4m3fn" or "float8_e5m2" of `value`.

    Accepted: the format names, their packed "_x4" names (nl.float8_e4m3fn_x4), the short names
    "e4m3fn" / "e5m2" and dtypes of those formats (ml_dtypes, numpy, torch). x4_only: only the packed x4
    dtypes (the kernel's fp8_x4_dtype; the message then lists FP8_X4_DTYPE_NAMES).
    """
    if isinstance(value, bool):
        name = ""
    else:
        name = dtype_name(value)
    if x4_only:
        if name not in FP8_X4_DTYPE_NAMES:
            fail(f"{what} must be one of {list(FP8_X4_DTYPE_NAMES)}, got {value!r}")
        return name[:-len("_x4")]
    if name.endswith("_x4"):
        name = name[:-len("_x4")]
    if name in FP8_SHORT_NAMES:
        name = "float8_" + name
    if name not in FP8_FORMATS:
        fail(f"{what} must be one of {FP8_FORMATS} (or their _x4 / short names / dtypes), got {value!r}")
    return name


def weight_grad_dtype(value, what: str = "weight_grad_dtype", spelled: str = "bfloat16 or float32",
                      short_names: bool = True, fail=host_fail) -> str:
    """"bfloat16" or "float32": the dtype both weight gradients are written in (a dtype, its name or, with
    short_names, "bf16" / "fp32").
    `spelled` is how the layer's message names the accepted values (e.g. "nl.bfloat16 or nl.float32");
    the kernel entry point passes short_names=False (it takes dtypes and their names only)."""
    name = "" if isinstance(value, bool) or value == None else dtype_name(value)  # noqa: E711
    for alias, full in WEIGHT_GRAD_ALIASES:
        if short_names and name == alias:
            name = full
    if name not in WEIGHT_GRAD_DTYPES:
        fail(f"{what} must be {spelled}, got {value!r}")
    return name


def kernel_numerics(precision_arg, on_trn3: bool, fp8_x4_dtype, scheme, weight_grad_dtype_arg) -> tuple:
    """(matmul precision, weight-grad dtype name) of an NKI kernel entry point (dense MLP and MoE backward),
    from their matmul_precision, fp8_x4_dtype, quant_scheme and weight_grad_dtype arguments.

    matmul_precision None picks "mxfp8" on Trn3 and "bf16" on Trn2 (on_trn3: the target is NeuronCore-v4);
    "mxfp8" on Trn2 is rejected (no MX instructions). fp8_x4_dtype must be a packed x4 dtype, weight_grad_dtype
    a dtype or its full name (no short names). Runs inside the traced kernel body, so a bad value fails
    through kernel_fail (AssertionError), not OptionError.
    """
    precision = matmul_precision(precision_arg if precision_arg != None  # noqa: E711
                                 else ("mxfp8" if on_trn3 else "bf16"), fail=kernel_fail)
    if precision == "mxfp8" and not on_trn3:
        kernel_fail("matmul_precision='mxfp8' needs Trn3 (NeuronCore-v4) MX instructions; the target is "
                    "Trn2 (NeuronCore-v3): use matmul_precision='bf16'")
    fp8_format(fp8_x4_dtype, what="fp8_x4_dtype", x4_only=True, fail=kernel_fail)
    quant_scheme(scheme, fail=kernel_fail)
    wg = weight_grad_dtype(weight_grad_dtype_arg, spelled="nl.bfloat16 or nl.float32", short_names=False,
                           fail=kernel_fail)
    return precision, wg


def clamp_values(clamp_limits, what: str = "clamp_limits", fail=host_fail) -> tuple:
    """(non_linear_lower, non_linear_upper, linear_lower, linear_upper) as floats or None (no bound).

    clamp_limits: None, a ClampLimits (or any object with those four attributes) or a dict with a
    subset of those keys (and optionally "activation", checked by clamp_activation). Each bound is a real number (not
    bool, not NaN) or None, and each lower bound is smaller than its upper bound.
    """
    if clamp_limits == None:  # noqa: E711
        return (None, None, None, None)
    if isinstance(clamp_limits, dict):
        unknown = sorted(k for k in clamp_limits if k not in CLAMP_NAMES + ("activation",))
        if unknown:
            fail(f"{what}: unknown keys {unknown}; accepted: {list(CLAMP_NAMES + ('activation',))}")
        values = tuple(clamp_limits.get(n) for n in CLAMP_NAMES)
    elif all(hasattr(clamp_limits, n) for n in CLAMP_NAMES):
        values = tuple(getattr(clamp_limits, n) for n in CLAMP_NAMES)
    else:
        fail(f"{what} must be a ClampLimits, a dict with keys {list(CLAMP_NAMES)}, or None; got {clamp_limits!r}")
    out = []
    for name, v in zip(CLAMP_NAMES, values):
        if v == None:  # noqa: E711
            out.append(None)
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            fail(f"{what}.{name} must be a float or None, got {v!r}")
        if v != v:  # NaN (math.isnan is not traceable by torch.compile's dynamo)
            fail(f"{what}.{name} must not be NaN")
        out.append(float(v))
    for lo, hi, side in ((out[0], out[1], "non_linear"), (out[2], out[3], "linear")):
        if lo != None and hi != None and not lo < hi:  # noqa: E711
            fail(f"{what}: {side}_lower ({lo}) must be smaller than {side}_upper ({hi})")
    clamp_activation(clamp_limits, what, fail)  # the activation travels with the clamps; checked here once
    return tuple(out)


def activation(value, what: str = "activation", fail=host_fail) -> str:
    """"silu" (default) or "gpt_oss": the SwiGLU epilogue's gated function (ACTIVATIONS)."""
    return check_choice(what, value, ACTIVATIONS, fail)


def clamp_activation(clamp_limits, what: str = "clamp_limits", fail=host_fail) -> str:
    """The activation carried by `clamp_limits` (its `activation` attribute or key; "silu" when None or
    absent), checked with activation()."""
    if clamp_limits == None:  # noqa: E711
        return "silu"
    value = clamp_limits.get("activation", "silu") if isinstance(clamp_limits, dict) else \
        getattr(clamp_limits, "activation", "silu")
    return activation(value, what=f"{what}.activation", fail=fail)


def _is_str(value) -> bool:
    return isinstance(value, str)
