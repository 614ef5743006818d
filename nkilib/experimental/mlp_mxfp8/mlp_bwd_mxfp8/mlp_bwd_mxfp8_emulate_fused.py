"""The emulate backend's fused MX quantize-dequantize: float32 / int32 arithmetic that torch.compile fuses.

nkilib.experimental.emulate_numerics._qdq_blocks runs ``qdq_fused`` (compiled: ``compiled_qdq``) where
``set_fused_quantizer`` selects it, else its eager quantizer (torch's fp8 cast and a decode table). Both
give nkilib.mx's bits (tests/torch/test_emulate_numerics.py); this formulation avoids the fp8 dtype, whose
CPU casts do not vectorise, so that the compiled code is one reduction and one elementwise loop.

Dimensions:
    xv [...]: an operand viewed so that each MX group's members lie on the axes `dims`.
"""
from __future__ import annotations

import math
import os
import warnings

import torch

from ....core.options import check_choice


#: "auto": compiled for operands of at least FUSED_MIN_ELEMENTS elements (smaller ones: eager, no
#: compile latency), eager if torch.compile fails; "compile": always compiled; "eager": the fused
#: formulation run op by op (tests only: slower than the table path); "off": never.
FUSED_QUANTIZER_MODES = ("auto", "compile", "eager", "off")
FUSED_MIN_ELEMENTS = 1 << 18
#: "backend" is torch.compile's (tests swap in one that records the graphs Inductor would lower).
_fused_state = {"mode": os.environ.get("NKILIB_EMULATE_FUSED_QUANTIZER", "auto"), "compiled": None, "failed": False,
                "verified": set(), "backend": "inductor", "error": None}


def set_fused_quantizer(mode: str) -> str:
    """Selects the quantizer formulation (FUSED_QUANTIZER_MODES); returns the previous mode.

    The default comes from the environment variable NKILIB_EMULATE_FUSED_QUANTIZER ("auto" if unset).
    Every mode gives the same bits; only speed differs.
    """
    check_choice("mode", mode, FUSED_QUANTIZER_MODES)
    previous = _fused_state["mode"]
    _fused_state["mode"] = mode
    return previous


def f32_fraction_bits(v: float) -> int:
    """The 23 fraction bits of float32 `v` (normal)."""
    return int(torch.tensor(v, dtype=torch.float32).view(torch.int32).item()) & 0x7FFFFF


#: 2**23: the weight of the lowest bit of float32's exponent field, as an int32 multiplier / divisor.
_F32_EXP_UNIT = 1 << 23
#: The float32 bits of 2**-127 (a subnormal: the one power of two of the E8M0 range without an exponent field).
_F32_POW2_MIN_BITS = 1 << 22


def _f32_exponent_field(bits: torch.Tensor) -> torch.Tensor:
    """The biased exponent field (bits 23..30) of the int32 bits of a float32 >= 0 (NaN included), int32.

    Truncating division of the bits by 2**23 (= floor: the bits of a non-negative float are a non-negative
    int32): an int32 op on every backend (Triton's ``//``, C++'s ``/``, which vectorises; floor division
    did not, 20-40% slower on CPU), with no shift or bitwise op whose operand typing each Inductor backend
    decides on its own (the formulation that failed to compile for Triton mixed them with int64 values:
    "Cannot bitcast data-type of size 64 to data-type of size 32"; _dynamo_settings has the cause).
    """
    return torch.div(bits, _F32_EXP_UNIT, rounding_mode="trunc")


def _f32_from_fields(biased_exp: torch.Tensor, fraction: int = 0) -> torch.Tensor:
    """float32 with exponent field `biased_exp` (int32 in [1, 254]) and fraction bits `fraction`, built by
    int32 multiply-add (no shift, no int64: see _f32_exponent_field), then bitcast."""
    return (biased_exp * _F32_EXP_UNIT + fraction).view(torch.float32)


def _f32_pow2(biased: torch.Tensor) -> torch.Tensor:
    """2**(biased - 127) in float32 for int32 `biased` in [0, 254] (0 -> the subnormal 2**-127, exact)."""
    bits = torch.where(biased == 0, _F32_POW2_MIN_BITS, biased * _F32_EXP_UNIT)
    return bits.view(torch.float32)


def qdq_fused(xv: torch.Tensor, dims: tuple, emax: int, mbits: int, emin: int, max_normal: float, max_frac: int,
              scale_rule: str, out_dtype) -> torch.Tensor:
    """Quantize-dequantize in elementwise float32 / int32 arithmetic, no fp8 dtype (fuses under torch.compile).

    Same bits as emulate_numerics._qdq_eager and nkilib.mx (tests/torch/test_emulate_numerics.py), by these steps:
        * amax = max |v| over the group (abs and max exact; NaN propagates; +-Inf -> non-finite group);
        * floor(log2 amax) from the float32 exponent field (a subnormal amax is first scaled by 2**24,
          exact), and rceil's "amax > max_normal * 2**s" test from the fraction bits (the significands
          are compared, exactly as nkilib.mx compares frexp mantissas);
        * y = v * 2**-k clamped to +-max_normal: as in emulate_numerics._qdq_eager;
        * RNE of y to the fp8 grid: the grid step at |y| is q = 2**(max(floor(log2 |y|), emin) - mbits)
          (emin = exponent of the smallest normal: below it the subnormal step); with C = 1.5 * 2**23 * q,
          C + y lies in [2**23 q, 2**24 q) where float32's step is q, so the float32 sum is y rounded to
          a multiple of q, ties to even (C / q is even), and (C + y) - C is exact; |y| <= max_normal,
          a grid point, so no rounding passes it (saturation as RNE-then-saturate); copysign keeps -0;
        * codes * 2**k in out_dtype (2**k in [2**-127, 2**127] is exact in float32), then NaN for the
          non-finite groups.
    No contraction can change this (the clamp separates the one product from the sums), nor reassociation:
    torch.compile's C++ is built without unsafe-math or fp-contract, Triton's LLVM without reassociation;
    and compiled_qdq checks the compiled code against this eager formulation before using it.

    Every integer intermediate is int32 and every bitcast is float32 <-> int32: bit fields are read by
    truncating division and written by multiply-add, never by shifts or bitwise ops, and no Python-int pair
    makes an int64 (tests/torch/test_emulate_fused_graph.py checks the graph Inductor lowers).
    The integers stay far from overflow: exponent fields <= 255, |y| <= max_normal, so every field written
    is in [1, 254] and every product below 2**31.

    Dimensions:
        xv [...] (bf16 / fp16 / fp32), groups on axes `dims` -> out_dtype [same shape].
    """
    x = xv.to(torch.float32)
    amax = x.abs().amax(dim=dims, keepdim=True)
    finite = torch.isfinite(amax)
    amax = torch.where(finite, amax, 0.0)
    tiny = amax < 2.0 ** -126
    a_bits = torch.where(tiny, amax * 2.0 ** 24, amax).view(torch.int32)
    a_field = _f32_exponent_field(a_bits)
    e = torch.where(tiny, a_field - (127 + 24), a_field - 127)  # floor(log2 amax) for amax > 0
    if scale_rule == "neuron":
        sexp = e - (emax - 1)
    elif scale_rule == "ocp_floor":
        sexp = e - emax
    else:  # rceil: smallest s with amax <= max_normal * 2**s (the fraction bits compare the significands)
        a_frac = a_bits - a_field * _F32_EXP_UNIT
        sexp = e - int(math.floor(math.log2(max_normal))) + (a_frac > max_frac).to(torch.int32)
    byte = torch.where(amax == 0, 0, torch.clamp(sexp + 127, 0, 254))  # E8M0 byte, int32
    inv = _f32_pow2(254 - byte)  # 2**-k with k = byte - 127: biased exponent 127 - k
    y = torch.clamp(x * inv, -max_normal, max_normal)
    top = int(math.floor(math.log2(max_normal)))  # floor(log2 |y|) <= top (NaN y: any value, the group is NaN)
    y_exp = torch.clamp(_f32_exponent_field(y.abs().view(torch.int32)) - 127, emin, top)
    c = _f32_from_fields(y_exp - mbits + 150, _F32_POW2_MIN_BITS)  # 1.5 * 2**(y_exp - mbits + 23)
    codes = torch.copysign((y + c) - c, y)
    out = codes.to(out_dtype) * _f32_pow2(byte).to(out_dtype)
    return torch.where(finite, out, float("nan"))


def probe_values(device) -> torch.Tensor:
    """[16, 64] float32 groups of 32 that reach every branch: scale extremes (2**-140 .. 2**127 leads),
    float32 subnormals, exact fp8 ties, saturation, zero, -0, NaN and Inf groups."""
    g = torch.Generator().manual_seed(14)
    base = torch.randn(16, 64, generator=g)
    lead = torch.tensor([-140.0, -133.0, -126.0, -100.0, -20.0, -3.0, 0.0, 1.0, 8.0, 9.0, 15.0, 16.0, 60.0, 100.0,
                         126.0, 127.0])
    v = base * torch.exp2(lead[:, None] - 2.0)
    v[:, 0] = torch.exp2(lead) * 1.9375  # a lead whose quotient sits near a code boundary
    ties = torch.tensor([1.0625, 1.1875, 0.5625, 2.0 ** -7 * 1.5, 2.0 ** -8 * 3.0]) * 2.0 ** 8  # e4m3 / e5m2 ties
    v[6, 1:6], v[7, 33:38] = ties, -ties
    v[3, 40:] = 0.0
    v[3, 41] = -0.0
    v[4, 7], v[5, 45], v[8, 3] = float("nan"), float("inf"), -float("inf")
    return v.to(device)


def _dynamo_settings() -> dict:
    """torch._dynamo.config values for compiling qdq_fused.

    One graph per operand layout and option set (a generous recompile limit), and every Python int
    argument (emax, mbits, emin, max_frac) specialized: by default Dynamo turns an int that changed between
    calls into a symbolic kernel argument, which Triton types int64, so ``y_exp - mbits`` became int64 and
    its bitcast to float32 failed ("Cannot bitcast data-type of size 64 to data-type of size 32", H100,
    torch 2.11, once a second fp8 format was quantized). Shapes stay dynamic (one graph for many S).
    """
    settings = {name: 256 for name in ("recompile_limit", "cache_size_limit") if hasattr(torch._dynamo.config, name)}
    if hasattr(torch._dynamo.config, "specialize_int"):
        settings["specialize_int"] = True
    return settings


def compiled_qdq(*args):
    """``qdq_fused`` through torch.compile; None (and a warning, once) when compiling fails or when the
    compiled code, on this device and options, differs from the eager quantizer on probe_values."""
    if _fused_state["compiled"] is None:
        _fused_state["compiled"] = torch.compile(qdq_fused, backend=_fused_state["backend"])
    limits = _dynamo_settings()
    xv, _dims, emax, mbits, emin, max_normal, max_frac, rule, out_dtype = args
    key = (xv.device.type, emax, mbits, rule, out_dtype)
    try:
        with torch._dynamo.config.patch(**limits):
            if key not in _fused_state["verified"]:
                probe = probe_values(xv.device).reshape(16, 2, 32)
                opts = (emax, mbits, emin, max_normal, max_frac, rule, out_dtype)
                got = _fused_state["compiled"](probe, (2,), *opts)
                want = qdq_fused(probe, (2,), *opts)  # eager: the formulation the tests check
                same = torch.equal(got.isnan(), want.isnan()) and torch.equal(
                    torch.nan_to_num(got).view(torch.int64 if out_dtype == torch.float64 else torch.int32),
                    torch.nan_to_num(want).view(torch.int64 if out_dtype == torch.float64 else torch.int32))
                if not same:
                    raise RuntimeError(f"compiled code differs from eager on the probe values ({key})")
                _fused_state["verified"].add(key)
            return _fused_state["compiled"](*args)
    except Exception as err:  # noqa: BLE001  (no C++ compiler / Triton, unsupported platform, wrong bits)
        _fused_state["failed"] = True
        last_line = str(err).strip().splitlines()[-1][:200] if str(err).strip() else ""
        _fused_state["error"] = f"{type(err).__name__}: {last_line}"
        warnings.warn(f"emulate: torch.compile of the fused MX quantizer failed ({type(err).__name__}: {err}); "
                      "using the eager quantizer (same bits, slower)", RuntimeWarning, stacklevel=3)
        return None


def fused_quantizer_status() -> str:
    """One line saying which quantizer the emulation has been running (for logs and benchmarks)."""
    mode = _fused_state["mode"]
    if _fused_state["failed"]:
        return f"eager (torch.compile of the fused quantizer failed: {_fused_state['error']}; same bits, slower)"
    if mode in ("off", "eager"):
        return f"eager (mode {mode!r})"
    if _fused_state["verified"]:
        devices = sorted({key[0] for key in _fused_state["verified"]})
        return (f"compiled (torch.compile, mode {mode!r}; checked against eager on the probe values on "
                f"{', '.join(devices)})")
    return (f"eager so far (mode {mode!r}: nothing compiled yet; 'auto' compiles operands of >= "
            f"{FUSED_MIN_ELEMENTS} elements)")


def fused_quantizer_for(xv: torch.Tensor):
    """The fused quantizer to run on `xv` under the current mode, or None for the eager one."""
    mode = _fused_state["mode"]
    if mode == "eager":
        return qdq_fused
    if mode == "off" or _fused_state["failed"] or (mode == "auto" and xv.numel() < FUSED_MIN_ELEMENTS):
        return None
    return compiled_qdq
