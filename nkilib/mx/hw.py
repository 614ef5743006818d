"""Exact math of the NeuronCore-v4 MX instructions on SBUF-layout operands.

* ``hw_quantize_tile``: nisa.quantize_mx on a [P, F] source tile.
* ``hw_matmul_mx``: nisa.nc_matmul_mx on x4-packed operands with group-order scales.

The simulator handles operand placement (quadrant scale rows, PSUM accumulate); these functions
only do the numerics.

References:
    * https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.quantize_mx.html
    * https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.nc_matmul_mx.html
    * https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/deep-dives/mxfp-matmul.html
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from .formats import (
    ELEMENT_FORMATS,
    FP4_E2M1_VALUES,
    SCALE_NAN_BYTE,
    check_scale_rule,
    element_format,
)
from .layout import pack_x4
from .quantize import _as_float32, quantize_blocks

__all__ = ["QMX_PARTITIONS", "MATMUL_MX_FORMATS", "hw_quantize_tile", "hw_matmul_mx"]

#: Partition counts accepted by quantize_mx (multiple of 32, <= 128:
#: https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.quantize_mx.html;
#: nki-library ALLOWED_QMX_P_DIM).
QMX_PARTITIONS = (32, 64, 96, 128)

#: Operand dtypes of nc_matmul_mx
#: (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.nc_matmul_mx.html).
MATMUL_MX_FORMATS = ("float8_e4m3fn_x4", "float8_e5m2_x4", "float4_e2m1fn_x4")

_FP8_LUT64 = {
    name: np.arange(256, dtype=np.uint8).view(fmt.ml_dtype).astype(np.float64)
    for name, fmt in ELEMENT_FORMATS.items()
}
_FP4_LUT64 = FP4_E2M1_VALUES.astype(np.float64)


def hw_quantize_tile(src, elem_format, scale_rule: str = "neuron"):
    """Exact math of nisa.quantize_mx on one SBUF tile.

    Group (g, j) = src[8g:8g+8, 4j:4j+4] (8 partitions x 4 consecutive free elements) shares one
    E8M0 scale; element src[p, 4j+k] becomes byte k of output word [p, j] (quantize_mx docs).
    Scale and element rules as in ``quantize_blocks``.

    Args:
        src: float array [P, F] (bf16 / fp16 on hardware; float32 accepted; extra free dims are
            flattened), P in {32, 64, 96, 128}, F % 4 == 0.
        elem_format: "float8_e4m3fn_x4" / "float8_e5m2_x4" (or the unpacked names).
        scale_rule: one of SCALE_RULES ("neuron" = SDK >= 2.31 hardware behaviour).

    Returns:
        (words, scale_bytes): words uint32 [P, F // 4]; scale_bytes uint8 [P // 8, F // 4] in
        GROUP order (use ``scales_to_quadrant_rows`` for the SBUF quadrant layout).

    Raises:
        ValueError: invalid P, F, format or rule (the message names the value).
    """
    fmt = element_format(elem_format)
    check_scale_rule(scale_rule)
    a = np.asarray(src)
    if a.ndim < 2:
        raise ValueError(f"quantize_mx source must be [P, F], got shape {a.shape}")
    P = a.shape[0]
    if P not in QMX_PARTITIONS:
        raise ValueError(f"quantize_mx partition count P={P} must be one of {QMX_PARTITIONS}")
    x = _as_float32(a, "src").reshape(P, -1)
    F = x.shape[1]
    if F == 0 or F % 4 != 0:
        raise ValueError(f"quantize_mx free size F={F} must be a positive multiple of 4")
    G, J = P // 8, F // 4
    blocks = x.reshape(G, 8, J, 4).transpose(0, 2, 1, 3).reshape(G, J, 32)
    codes_b, scales = quantize_blocks(blocks, fmt, scale_rule)
    codes = codes_b.reshape(G, J, 8, 4).transpose(0, 2, 1, 3).reshape(P, F)
    return pack_x4(codes), scales


def _int_words(words, itemsize: int, fmt_name: str, what: str) -> np.ndarray:
    w = np.asarray(words)
    if w.dtype.kind not in "ui" or w.dtype.itemsize != itemsize:
        raise TypeError(
            f"{what}: {fmt_name} data must be {8 * itemsize}-bit integer words, got dtype {w.dtype}"
        )
    if w.ndim != 2:
        raise ValueError(f"{what} must be 2-D [K, free], got shape {w.shape}")
    return w


def _decode_operand(words, fmt_name, what: str) -> np.ndarray:
    """x4 words [K, X] -> float64 values [K, X, 4] (element k of word = slot k)."""
    name = str(fmt_name)
    if name in ("float4_e2m1fn_x4", "float4_e2m1fn"):
        # INFERRED (docs/simulator.md#choice-mx-numerics): FP4 -> FP8 mapping is "programmer-defined" on NC-v4; we use
        # the standard e2m1 values (all exactly representable in e4m3fn).
        w = _int_words(words, 2, name, what)
        b = np.ascontiguousarray(w, dtype="<u2").view(np.uint8).reshape(w.shape + (2,))
        nib = np.stack([b & 0xF, b >> 4], axis=-1).reshape(w.shape + (4,))
        return _FP4_LUT64[nib]
    try:
        fmt = element_format(name)
    except ValueError:
        raise ValueError(
            f"{what}: unsupported nc_matmul_mx dtype {fmt_name!r}; accepted: "
            f"{', '.join(MATMUL_MX_FORMATS)}"
        ) from None
    w = _int_words(words, 4, name, what)
    b = np.ascontiguousarray(w, dtype="<u4").view(np.uint8).reshape(w.shape + (4,))
    return _FP8_LUT64[fmt.name][b]


def _scale_factors(scale, K: int, X: int, what: str) -> np.ndarray:
    """Group-order scales [K//8, X] -> float64 factors [K, X] (byte 255 -> NaN)."""
    s = np.asarray(scale)
    if s.dtype == ml_dtypes.float8_e8m0fnu:
        s = s.view(np.uint8)
    if s.dtype.kind not in "ui":
        raise TypeError(f"{what} must be uint8 (or float8_e8m0fnu), got dtype {s.dtype}")
    if s.shape != (K // 8, X):
        raise ValueError(f"{what} shape {s.shape} != expected {(K // 8, X)} (group order)")
    if s.size and (s.min() < 0 or s.max() > 255):
        raise ValueError(f"{what} values must lie in [0, 255]")
    si = s.astype(np.int32)
    f = np.ldexp(np.ones(si.shape), si - 127)
    # INFERRED (docs/simulator.md#choice-mx-numerics): an E8M0 NaN scale makes its whole group NaN
    # (OCP MX v1.0 §5.4).
    f[si == SCALE_NAN_BYTE] = np.nan
    return np.repeat(f, 8, axis=0)


def hw_matmul_mx(
    stationary_words,
    moving_words,
    stationary_scale,
    moving_scale,
    stationary_format,
    moving_format,
) -> np.ndarray:
    """Exact math of nisa.nc_matmul_mx
    (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.nc_matmul_mx.html).

    dst[m, n] = sum_p sum_k S[p,m,k] * 2**(ss[p//8,m]-127) * V[p,n,k] * 2**(ms[p//8,n]-127),
    where S[p,m,k] / V[p,n,k] is element k (byte or nibble k of the x4 word) of word [p, m] / [p, n].
    Every product is exact in float64 (<= 4-bit significands, power-of-two scales); the 4K products
    are summed in float64 (one BLAS matmul over the flattened [4K] contraction) and the result is
    rounded once to float32 (INFERRED fp32-or-better internal accumulation, docs/simulator.md#choice-mx-numerics).
    NaN scale bytes / NaN codes propagate; overflow beyond float32 gives +-Inf.

    Args:
        stationary_words: [K, M] uint32 (fp8 x4) or uint16 (fp4 x4) words.
        moving_words: [K, N] uint32 / uint16 words.
        stationary_scale: uint8 [K // 8, M] E8M0 bytes in GROUP order.
        moving_scale: uint8 [K // 8, N] E8M0 bytes in GROUP order.
        stationary_format: "float8_e4m3fn_x4", "float8_e5m2_x4" or "float4_e2m1fn_x4".
        moving_format: same choices (may differ from stationary_format).

    Returns:
        float32 [M, N].

    Raises:
        ValueError / TypeError: unsupported formats, word dtypes or inconsistent shapes.
    """
    S = _decode_operand(stationary_words, stationary_format, "stationary")
    V = _decode_operand(moving_words, moving_format, "moving")
    K, M = S.shape[:2]
    N = V.shape[1]
    if V.shape[0] != K:
        raise ValueError(f"nc_matmul_mx: stationary has K={K} partitions, moving has {V.shape[0]}")
    if K == 0 or K % 8 != 0:
        raise ValueError(f"nc_matmul_mx: K={K} must be a positive multiple of 8")
    with np.errstate(over="ignore", invalid="ignore"):
        S = S * _scale_factors(stationary_scale, K, M, "stationary_scale")[:, :, None]
        V = V * _scale_factors(moving_scale, K, N, "moving_scale")[:, :, None]
        S2 = S.transpose(0, 2, 1).reshape(4 * K, M)
        V2 = V.transpose(0, 2, 1).reshape(4 * K, N)
        return (S2.T @ V2).astype(np.float32)
