"""NKI dtypes ("Supported Data Types" of
https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/nki.api.shared.html).

Each `nl.<dtype>` is an `NkiDType`, a `str` subclass equal to its name (`nl.float32 == "float32"`,
INFERRED from `DType = str` in https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/_modules/nki/language.html;
docs/simulator.md#choice-dtype-strings) that also carries the facts the simulator needs: NKI byte size,
the NumPy storage dtype (ml_dtypes for bfloat16/fp8/e8m0), and its category.

MX x4 dtypes are stored as raw little-endian words: uint32 for `float8_*_x4`, uint16 for
`float4_e2m1fn_x4` (docs/simulator.md#choice-x4-inputs). Kernel inputs for x4 operands are passed
as uint32 / uint16 arrays and reinterpreted in the kernel with `.view(x4_dtype)` or `.ap(dtype=...)`.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np


class NkiDType(str):
    """An NKI dtype: compares equal to its name string."""

    itemsize: int
    category: str  # "float", "int", "uint", "bool", "x4", "scale"
    precise_np: np.dtype  # storage dtype with NKI_PRECISE_FP=1

    def __new__(cls, name: str, itemsize: int, category: str, precise_np):
        obj = super().__new__(cls, name)
        obj.itemsize = itemsize
        obj.category = category
        obj.precise_np = np.dtype(precise_np)
        return obj

    @property
    def name(self) -> str:
        return str(self)

    @property
    def is_float(self) -> bool:
        return self.category == "float"

    @property
    def is_int(self) -> bool:
        return self.category in ("int", "uint", "bool")

    @property
    def is_x4(self) -> bool:
        return self.category == "x4"

    @property
    def is_fp8(self) -> bool:
        return self.startswith("float8_") and self.category == "float"

    def storage_np(self, precise_fp: bool) -> np.dtype:
        """NumPy dtype used to store this dtype (fp32 for low-precision floats when not precise)."""
        if not precise_fp and self.category == "float" and self.itemsize < 4:
            return np.dtype(np.float32)
        return self.precise_np

    def __repr__(self) -> str:
        return f"nl.{str(self)}"

    def __reduce__(self):
        return (_lookup, (str(self),))


bool_ = NkiDType("bool_", 1, "bool", np.uint8)
int8 = NkiDType("int8", 1, "int", np.int8)
uint8 = NkiDType("uint8", 1, "uint", np.uint8)
int16 = NkiDType("int16", 2, "int", np.int16)
uint16 = NkiDType("uint16", 2, "uint", np.uint16)
int32 = NkiDType("int32", 4, "int", np.int32)
uint32 = NkiDType("uint32", 4, "uint", np.uint32)
float16 = NkiDType("float16", 2, "float", np.float16)
bfloat16 = NkiDType("bfloat16", 2, "float", ml_dtypes.bfloat16)
float32 = NkiDType("float32", 4, "float", np.float32)
# tfloat32 (1-8-10) lives in a 32-bit container (INFERRED, docs/simulator.md#choice-tf32-fp32-matmul); rounded to 10
# mantissa bits on write (see access.cast_values).
tfloat32 = NkiDType("tfloat32", 4, "float", np.float32)
# Legacy Trn2 "float8_e4m3": IEEE-like e4m3 with Inf/NaN, max finite 240
# (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/nki.api.shared.html footnote; nki-library
# FP8_E4M3_MAX = 240.0) == ml_dtypes.float8_e4m3.
float8_e4m3 = NkiDType("float8_e4m3", 1, "float", ml_dtypes.float8_e4m3)
float8_e4m3fn = NkiDType("float8_e4m3fn", 1, "float", ml_dtypes.float8_e4m3fn)
float8_e5m2 = NkiDType("float8_e5m2", 1, "float", ml_dtypes.float8_e5m2)
float8_e8m0fnu = NkiDType("float8_e8m0fnu", 1, "scale", np.uint8)
float8_e4m3fn_x4 = NkiDType("float8_e4m3fn_x4", 4, "x4", np.uint32)
float8_e5m2_x4 = NkiDType("float8_e5m2_x4", 4, "x4", np.uint32)
float4_e2m1fn_x4 = NkiDType("float4_e2m1fn_x4", 2, "x4", np.uint16)

__all__ = [
    "NkiDType", "ALL_DTYPES", "as_nki_dtype", "bool_", "int8", "uint8", "int16", "uint16", "int32", "uint32",
    "float16", "bfloat16", "float32", "tfloat32", "float8_e4m3", "float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu",
    "float8_e4m3fn_x4", "float8_e5m2_x4", "float4_e2m1fn_x4",
]

ALL_DTYPES = {
    str(d): d
    for d in (
        bool_, int8, uint8, int16, uint16, int32, uint32, float16, bfloat16, float32, tfloat32,
        float8_e4m3, float8_e4m3fn, float8_e5m2, float8_e8m0fnu,
        float8_e4m3fn_x4, float8_e5m2_x4, float4_e2m1fn_x4,
    )
}
ALL_DTYPES["bool"] = bool_  # nki-library also writes nl.bool (INFERRED alias, docs/simulator.md#choice-dtype-strings)

# NumPy dtype of a kernel input -> NKI dtype
_FROM_NUMPY = {
    np.dtype(np.bool_): bool_,
    np.dtype(np.int8): int8,
    np.dtype(np.uint8): uint8,
    np.dtype(np.int16): int16,
    np.dtype(np.uint16): uint16,
    np.dtype(np.int32): int32,
    np.dtype(np.uint32): uint32,
    np.dtype(np.float16): float16,
    np.dtype(ml_dtypes.bfloat16): bfloat16,
    np.dtype(np.float32): float32,
    np.dtype(ml_dtypes.float8_e4m3): float8_e4m3,
    np.dtype(ml_dtypes.float8_e4m3fn): float8_e4m3fn,
    np.dtype(ml_dtypes.float8_e5m2): float8_e5m2,
    np.dtype(ml_dtypes.float8_e8m0fnu): float8_e8m0fnu,
}


def _lookup(name: str) -> NkiDType:
    return ALL_DTYPES[name]


def as_nki_dtype(dtype, what: str = "dtype") -> NkiDType:
    """Normalise a dtype spec (NkiDType, name string or NumPy dtype) to an NkiDType."""
    if isinstance(dtype, NkiDType):
        return dtype
    if isinstance(dtype, str):
        if dtype in ALL_DTYPES:
            return ALL_DTYPES[dtype]
        raise TypeError(f"{what}: unknown NKI dtype {dtype!r}; expected one of {sorted(ALL_DTYPES)}")
    try:
        npd = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{what}: expected an NKI dtype, got {dtype!r}") from None
    if npd in _FROM_NUMPY:
        return _FROM_NUMPY[npd]
    raise TypeError(
        f"{what}: NumPy dtype {npd} has no NKI equivalent; supported: {sorted(str(k) for k in _FROM_NUMPY)}"
    )
