"""MX element formats, scale rules and bit-exact element / scale decoding.

Contract: the dtype table and RNE conversions of
https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/nki.api.shared.html,
the x4 packing and e2m1 values of
https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/deep-dives/mxfp-matmul.html
(code: https://github.com/aws-neuron/nki-samples/tree/main/src/nki_samples/tutorials/mxfp-matmul),
and the quantize_mx scale rule (docs/simulator.md#choice-qmx-scale-rule).

References:
    * nki.isa.quantize_mx:
      https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.quantize_mx.html
    * OCP Microscaling Formats (MX) v1.0:
      https://www.opencompute.org/documents/ocp-microscaling-formats-mx-v1-0-spec-final-pdf
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

__all__ = [
    "BLOCK_SIZE",
    "ElementFormat",
    "ELEMENT_FORMATS",
    "FP4_E2M1_VALUES",
    "SCALE_RULES",
    "SCALE_NAN_BYTE",
    "element_format",
    "check_scale_rule",
    "decode_elements",
    "decode_fp4",
    "scale_bytes_to_float",
]

#: Number of elements sharing one E8M0 scale (OCP MX v1.0 block size k = 32).
BLOCK_SIZE = 32

#: E8M0 encoding of NaN (OCP MX v1.0 §5.4; nl.float8_e8m0fnu "NaN represented by 0xFF",
#: https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/_modules/nki/language.html).
SCALE_NAN_BYTE = 255

#: Scale-selection rules understood by :func:`nkilib.mx.quantize_blocks`.
#:
#: * ``"neuron"``: NKI >= 0.5.0 / SDK 2.31 quantize_mx ("alternative emax", docs/simulator.md#choice-qmx-scale-rule):
#:   exponent = floor(log2(amax)) - (emax - 1).
#: * ``"ocp_floor"``: OCP MX v1.0 §6.3 example algorithm (and quantize_mx before SDK 2.31):
#:   exponent = floor(log2(amax)) - emax, elements saturate to +-max_normal.
#: * ``"rceil"``: exponent = ceil(log2(amax / max_normal)) (round-up scale used by GPU stacks);
#:   guarantees |v / X| <= max_normal.
SCALE_RULES = ("neuron", "ocp_floor", "rceil")


@dataclasses.dataclass(frozen=True)
class ElementFormat:
    """An MX fp8 element format.

    Attributes:
        name: canonical NKI / ml_dtypes name, e.g. ``"float8_e4m3fn"`` (no ``_x4`` suffix).
        ml_dtype: the ml_dtypes scalar type used for RNE casts and decoding.
        emax: exponent of the largest power of two representable in the format
            (OCP MX v1.0 Table 1: 8 for E4M3, 15 for E5M2).
        max_normal: largest finite magnitude (448 for E4M3FN, 57344 for E5M2).
    """

    name: str
    ml_dtype: type
    emax: int
    max_normal: float

    @property
    def mantissa_bits(self) -> int:
        """Number of explicit mantissa bits (3 for e4m3fn, 2 for e5m2)."""
        return int(ml_dtypes.finfo(self.ml_dtype).nmant)

    @property
    def eps(self) -> float:
        """Spacing of the format just above 1.0, i.e. 2**-mantissa_bits."""
        return 2.0 ** -self.mantissa_bits

    @property
    def nan_code(self) -> int:
        """Canonical (positive, quiet) NaN bit pattern: 0x7F for e4m3fn, 0x7E for e5m2."""
        return int(np.array(np.nan, np.float32).astype(self.ml_dtype).view(np.uint8))

    @property
    def x4_name(self) -> str:
        """Name of the packed NKI dtype, e.g. ``"float8_e4m3fn_x4"``."""
        return self.name + "_x4"


ELEMENT_FORMATS: dict[str, ElementFormat] = {
    "float8_e4m3fn": ElementFormat("float8_e4m3fn", ml_dtypes.float8_e4m3fn, 8, 448.0),
    "float8_e5m2": ElementFormat("float8_e5m2", ml_dtypes.float8_e5m2, 15, 57344.0),
}

_ACCEPTED_NAMES = tuple(ELEMENT_FORMATS) + tuple(n + "_x4" for n in ELEMENT_FORMATS)


def element_format(name) -> ElementFormat:
    """Looks up an MX fp8 element format.

    Args:
        name: ``"float8_e4m3fn"``, ``"float8_e5m2"``, their ``_x4`` packed names, a numpy dtype /
            ml_dtypes type of one of those formats, or an :class:`ElementFormat` (returned as is).

    Returns:
        The :class:`ElementFormat`.

    Raises:
        ValueError: for any other value (the message names the value and the accepted names).
    """
    if isinstance(name, ElementFormat):
        return name
    key = name
    if not isinstance(key, str):
        try:
            key = np.dtype(key).name
        except TypeError:
            key = None
    if isinstance(key, str):
        base = key[:-3] if key.endswith("_x4") else key
        if base in ELEMENT_FORMATS:
            return ELEMENT_FORMATS[base]
    raise ValueError(
        f"unsupported MX element format {name!r}; accepted: {', '.join(_ACCEPTED_NAMES)}"
    )


def check_scale_rule(scale_rule: str) -> str:
    """Validates a scale rule name.

    Args:
        scale_rule: one of :data:`SCALE_RULES`.

    Returns:
        The rule name.

    Raises:
        ValueError: if the rule is unknown (the message names it and the accepted rules).
    """
    if not isinstance(scale_rule, str) or scale_rule not in SCALE_RULES:
        raise ValueError(
            f"unknown scale_rule {scale_rule!r}; accepted: {', '.join(SCALE_RULES)}"
        )
    return scale_rule


def _lut(fmt: ElementFormat) -> np.ndarray:
    return np.arange(256, dtype=np.uint8).view(fmt.ml_dtype).astype(np.float32)


_FP8_LUTS = {name: _lut(fmt) for name, fmt in ELEMENT_FORMATS.items()}
for _lut_arr in _FP8_LUTS.values():
    _lut_arr.setflags(write=False)

#: e2m1 (OCP FP4) code -> value (OCP MX v1.0; `_FP4_LUT` of the MXFP matmul tutorial code
#: https://github.com/aws-neuron/nki-samples/tree/main/src/nki_samples/tutorials/mxfp-matmul):
#: 0..7 positive, 8..15 negative (8 = -0).
FP4_E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=np.float32,
)
FP4_E2M1_VALUES.setflags(write=False)


def _check_uint(arr, nbits: int, what: str) -> np.ndarray:
    """Returns `arr` as a uint8/16/32 array after checking it is integer and in range."""
    a = np.asarray(arr)
    out_t = {4: np.uint8, 8: np.uint8, 16: np.uint16, 32: np.uint32}[nbits]
    if a.dtype.kind not in "ui":
        raise TypeError(f"{what} must be an integer array, got dtype {a.dtype}")
    if a.dtype.kind == "u" and a.dtype.itemsize * 8 <= nbits:
        return a.astype(out_t, copy=False)
    if a.size and (a.min() < 0 or a.max() > (1 << nbits) - 1):
        raise ValueError(f"{what} values must lie in [0, {(1 << nbits) - 1}]")
    return a.astype(out_t)


def decode_elements(codes, elem_format) -> np.ndarray:
    """Decodes raw fp8 bit patterns to float32 (exact; every fp8 value is a float32).

    Args:
        codes: uint8 array [...] of raw fp8 bit patterns.
        elem_format: fp8 format name (``_x4`` allowed) or :class:`ElementFormat`.

    Returns:
        float32 array [...] (NaN codes -> NaN, e5m2 Inf codes -> Inf).
    """
    fmt = element_format(elem_format)
    c = _check_uint(codes, 8, "codes")
    return _FP8_LUTS[fmt.name][c]


def decode_fp4(nibbles) -> np.ndarray:
    """Decodes e2m1 (FP4) codes to float32 using the OCP e2m1 value table (FP4_E2M1_VALUES).

    Args:
        nibbles: integer array [...] with values in [0, 15].

    Returns:
        float32 array [...].
    """
    n = _check_uint(nibbles, 4, "fp4 nibbles")
    return FP4_E2M1_VALUES[n]


def scale_bytes_to_float(b) -> np.ndarray:
    """Decodes E8M0 scale bytes.

    Args:
        b: uint8 array [...] (or integers in [0, 255]).

    Returns:
        float32 array [...] with value 2**(b - 127); byte 255 -> NaN. Byte 0 gives the float32
        subnormal 2**-127, which is exactly representable.
    """
    bb = _check_uint(b, 8, "scale bytes").astype(np.int32)
    with np.errstate(over="ignore"):  # byte 255 -> 2**128 overflows; replaced by NaN below
        out = np.ldexp(np.ones(bb.shape, np.float32), bb - 127)
    return np.where(bb == SCALE_NAN_BYTE, np.float32(np.nan), out).astype(np.float32)
