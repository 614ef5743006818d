"""Bit-exact MX (microscaling) quantization, dequantization and the MX matmul reference.

Contract: the quantize_mx scale value and the nc_matmul_mx math of the pages below; undocumented cases
follow docs/simulator.md#choice-qmx-scale-rule, docs/simulator.md#choice-qmx-edge-cases and
docs/simulator.md#choice-mx-numerics.

References:
    * nki.isa.quantize_mx (2.32):
      https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.quantize_mx.html
    * nki.isa.nc_matmul_mx (2.32):
      https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.nc_matmul_mx.html
    * MXFP matmul deep dive:
      https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/deep-dives/mxfp-matmul.html
    * OCP Microscaling Formats (MX) v1.0:
      https://www.opencompute.org/documents/ocp-microscaling-formats-mx-v1-0-spec-final-pdf

Group geometry along a tensor axis of length K (``scheme``):
    * ``"1x32"``: OCP-contiguous groups, group g = logical indices [32g, 32g + 32).
    * ``"wrapX"``: the axis is cut into tiles of ``k_tile`` elements (the last tile may be shorter);
      inside a tile of length T (T % 128 == 0) with P = T // 4, tile-local index k maps to
      (partition p, packed slot j) with k = p + P*j, and group g is
      {p + P*j : p in [8g, 8g + 8), j in 0..3} -- exactly the 8-partition x 4-element group of
      nisa.quantize_mx when the tile is loaded with ``interleave_k(..., "wrapX")``.
      Groups are numbered tile-major.
"""

from __future__ import annotations

import dataclasses
import functools

import ml_dtypes
import numpy as np

from .formats import (
    BLOCK_SIZE,
    SCALE_NAN_BYTE,
    ElementFormat,
    _check_uint,
    check_scale_rule,
    decode_elements,
    element_format,
)

__all__ = [
    "SCHEMES",
    "MXTensor",
    "quantize_blocks",
    "quantize_mx",
    "dequantize_mx",
    "group_positions",
    "mx_matmul",
]

#: Group geometries along a tensor axis, see the module docstring.
SCHEMES = ("1x32", "wrapX")


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------


def _is_ml_float(dtype: np.dtype) -> bool:
    if dtype.kind != "V":
        return False
    try:
        ml_dtypes.finfo(dtype)
    except (TypeError, ValueError):
        return False
    return True


def _as_float32(x, what: str = "x") -> np.ndarray:
    """Converts a float array to float32.

    float16, bfloat16, fp8 etc. upcast exactly. float64 (and longdouble) are rounded to float32
    (RNE, overflow -> Inf) first: the hardware operates on fp32-representable values.
    """
    a = np.asarray(x)
    if a.dtype == np.float32:
        return a
    if a.dtype.kind == "f" or _is_ml_float(a.dtype):
        with np.errstate(over="ignore"):
            return a.astype(np.float32)
    raise TypeError(f"{what} must be a floating-point array, got dtype {a.dtype}")


def _normalize_axis(axis, ndim: int) -> int:
    if not isinstance(axis, (int, np.integer)) or not -ndim <= axis < ndim:
        raise ValueError(f"axis {axis!r} is out of range for an array with {ndim} dimensions")
    return int(axis) % ndim


def _check_geometry(K: int, scheme: str, k_tile: int) -> None:
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; accepted: {', '.join(SCHEMES)}")
    if not isinstance(k_tile, (int, np.integer)) or k_tile <= 0:
        raise ValueError(f"k_tile must be a positive integer, got {k_tile!r}")
    if K <= 0 or K % BLOCK_SIZE != 0:
        raise ValueError(
            f"the quantized axis length K={K} must be a positive multiple of {BLOCK_SIZE}"
        )
    if scheme == "wrapX":
        for start in range(0, K, int(k_tile)):
            T = min(int(k_tile), K - start)
            if T % 128 != 0:
                raise ValueError(
                    f"scheme 'wrapX' needs every K tile to be a multiple of 128 "
                    f"(4 packed slots x 32 partitions); K={K}, k_tile={k_tile} gives a tile of "
                    f"length {T} at offset {start}"
                )


@functools.lru_cache(maxsize=256)
def _group_positions_cached(K: int, scheme: str, k_tile: int) -> np.ndarray:
    if scheme == "1x32":
        pos = np.arange(K, dtype=np.intp).reshape(K // BLOCK_SIZE, BLOCK_SIZE)
    else:
        parts = []
        for start in range(0, K, k_tile):
            T = min(k_tile, K - start)
            P = T // 4
            g = np.arange(P // 8, dtype=np.intp)[:, None, None]
            j = np.arange(4, dtype=np.intp)[None, :, None]
            i = np.arange(8, dtype=np.intp)[None, None, :]
            parts.append((start + 8 * g + i + P * j).reshape(P // 8, BLOCK_SIZE))
        pos = np.concatenate(parts, axis=0)
    pos.setflags(write=False)
    return pos


def group_positions(K: int, scheme: str = "1x32", k_tile: int = 512) -> np.ndarray:
    """Logical indices of the members of each scale group along an axis of length K.

    Args:
        K: axis length (positive multiple of 32; for "wrapX" every K tile a multiple of 128).
        scheme: "1x32" or "wrapX".
        k_tile: K tile length used by "wrapX".

    Returns:
        Read-only int array [K // 32, 32]; row g lists the 32 logical indices of group g
        (groups in storage order, tile-major for "wrapX").

    Raises:
        ValueError: on an invalid geometry.
    """
    _check_geometry(int(K), scheme, k_tile)
    return _group_positions_cached(int(K), scheme, int(k_tile))


# ----------------------------------------------------------------------------------------------
# core: 32-element blocks
# ----------------------------------------------------------------------------------------------


def _scale_bytes(x: np.ndarray, fmt: ElementFormat, scale_rule: str):
    """E8M0 scale bytes of float32 blocks [..., 32] -> (uint8 [...], nonfinite mask [...])."""
    nonfinite = ~np.isfinite(x).all(axis=-1)
    ax = np.abs(x)  # exact
    amax = np.where(np.isfinite(ax), ax, np.float32(0)).max(axis=-1)
    # frexp is exact (also for float32 subnormals): amax = mant * 2**ex, mant in [0.5, 1),
    # hence floor(log2(amax)) = ex - 1 with no floating-point log error.
    mant, ex = np.frexp(amax)
    ex = ex.astype(np.int64)
    e = ex - 1
    if scale_rule == "neuron":
        # SDK >= 2.31 "alternative emax" (docs/simulator.md#choice-qmx-scale-rule): X = 2**(e - (Emax - 1)).
        # https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.quantize_mx.html
        sexp = e - (fmt.emax - 1)
    elif scale_rule == "ocp_floor":
        # OCP MX v1.0 §6.3 example algorithm (quantize_mx before SDK 2.31): X = 2**(e - Emax).
        sexp = e - fmt.emax
    else:  # "rceil": smallest s with amax <= max_normal * 2**s, computed exactly.
        # With max_normal = mn * 2**mex (mn in [0.5, 1)) and d = ex - mex:
        #   amax <= max_normal * 2**s  <=>  mant * 2**d <= mn * 2**s.
        # s = d works iff mant <= mn; s = d - 1 never works (mn/2 < 0.5 <= mant);
        # s = d + 1 always works (2*mn >= 1 > mant). So s = d + (mant > mn).
        mn, mex = np.frexp(np.float64(fmt.max_normal))
        sexp = ex - int(mex) + (mant.astype(np.float64) > mn)
    # INFERRED (docs/simulator.md#choice-qmx-edge-cases): an exponent below -127 (e.g. bf16/fp32
    # subnormal amax) clamps to byte 0; 254 is the largest finite E8M0 byte (unreachable from float32 inputs).
    byte = np.clip(sexp + 127, 0, 254)
    byte = np.where(amax == 0, 0, byte)  # all-zero group: X = 2**-127, byte 0 (documented)
    # INFERRED (docs/simulator.md#choice-qmx-edge-cases, follows OCP MX v1.0 §6.3 / §5.4): a group
    # with NaN or +-Inf
    # gets the E8M0 NaN scale 0xFF and NaN elements. The hardware behaviour is undocumented
    # (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.quantize_mx.html).
    byte = np.where(nonfinite, SCALE_NAN_BYTE, byte).astype(np.uint8)
    return byte, nonfinite


def _cast_elements(x: np.ndarray, byte: np.ndarray, nonfinite: np.ndarray, fmt: ElementFormat):
    """RNE-with-saturation cast of x / 2**(byte - 127) to fp8 codes; x float32 [..., 32].

    Exactness of v / X: X = 2**k with k = byte - 127 in [-127, 127]. v is a float32 (24-bit
    significand, exponent in [-149, 127]), so v * 2**-k has the same significand and an exponent in
    [-276, 254], inside float64's normal range: np.ldexp in float64 is exact. The float64 ->
    float32 step (ml_dtypes converts float64 to fp8 through float32, so we make that hop explicit)
    is exact whenever |v / X| >= 2**-126; smaller magnitudes are far below half the smallest fp8
    subnormal (2**-10 for e4m3fn, 2**-17 for e5m2), so both the exact value and its float32
    rounding round to the same signed zero. Hence the fp8 result is RNE of the exact quotient.

    Saturation: clip(y, -M, M) followed by RNE equals RNE followed by saturation to +-M (M =
    max_normal, itself representable). Proof: RNE (in the format with unbounded exponent range)
    is monotone non-decreasing and fixes representable values. If |y| <= M, clipping is the
    identity. If y > M, clip-then-round gives RNE(M) = M, while RNE(y) >= RNE(M) = M, so
    saturating gives M as well; y < -M is symmetric. ml_dtypes alone would produce NaN (e4m3fn)
    or Inf (e5m2) for |y| beyond the overflow threshold, hence the clip. Signed zeros and fp8
    subnormals are preserved by both steps.
    """
    k = np.where(nonfinite, 0, byte.astype(np.int32) - 127)
    y = np.ldexp(x.astype(np.float64), -k[..., None])
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        y32 = y.astype(np.float32)
        m = np.float32(fmt.max_normal)
        y32 = np.minimum(np.maximum(y32, -m), m)
        codes = y32.astype(fmt.ml_dtype).view(np.uint8)
    codes[nonfinite] = fmt.nan_code
    return codes


def quantize_blocks(blocks, elem_format, scale_rule: str = "neuron"):
    """Quantizes 32-element blocks to MX (fp8 element codes + one E8M0 scale byte per block).

    Scale exponent per block (amax = max |v|, e = floor(log2(amax)), exact via frexp):
        * "neuron": e - (emax - 1)  (byte = biased fp32 exponent of amax - 7 / - 14).
        * "ocp_floor": e - emax.
        * "rceil": ceil(log2(amax / max_normal)).
    byte = exponent + 127 clamped to [0, 254]; all-zero block -> 0; block with NaN/Inf -> 255 and all
    its codes NaN (INFERRED, docs/simulator.md#choice-qmx-edge-cases). Elements: RNE(v / 2**(byte - 127)) saturated to
    +-max_normal; fp8 subnormals and signed zeros kept.

    Args:
        blocks: float array [..., 32] (float16 / bfloat16 / float32 upcast exactly; float64 is
            rounded to float32 first).
        elem_format: "float8_e4m3fn" or "float8_e5m2" (``_x4`` names accepted).
        scale_rule: one of SCALE_RULES.

    Returns:
        (codes, scale_bytes): codes uint8 [..., 32] raw fp8 bit patterns, scale_bytes uint8 [...].

    Raises:
        ValueError: bad last dimension, format or rule.
        TypeError: non-float input.
    """
    fmt = element_format(elem_format)
    check_scale_rule(scale_rule)
    x = _as_float32(blocks, "blocks")
    if x.ndim == 0 or x.shape[-1] != BLOCK_SIZE:
        raise ValueError(f"blocks must have a last dimension of {BLOCK_SIZE}, got shape {x.shape}")
    byte, nonfinite = _scale_bytes(x, fmt, scale_rule)
    codes = _cast_elements(x, byte, nonfinite, fmt)
    return codes, byte


# ----------------------------------------------------------------------------------------------
# along a tensor axis
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class MXTensor:
    """An MX-quantized tensor (logical layout).

    Attributes:
        codes: uint8 [*shape] raw fp8 bit patterns, same shape as the original tensor.
        scales: uint8 [*shape with shape[axis] // 32] E8M0 bytes in logical group order
            (see ``group_positions``).
        axis: the quantized axis (non-negative).
        elem_format: canonical fp8 format name ("float8_e4m3fn" or "float8_e5m2").
        scheme: group geometry, "1x32" or "wrapX".
        k_tile: K tile length of the "wrapX" geometry.
    """

    codes: np.ndarray
    scales: np.ndarray
    axis: int
    elem_format: str
    scheme: str = "1x32"
    k_tile: int = 512

    def __post_init__(self):
        codes = np.asarray(self.codes)
        scales = np.asarray(self.scales)
        if codes.dtype != np.uint8 or scales.dtype != np.uint8:
            raise TypeError("MXTensor codes and scales must be uint8 arrays")
        if codes.ndim == 0:
            raise ValueError("MXTensor codes must have at least one dimension")
        axis = _normalize_axis(self.axis, codes.ndim)
        K = codes.shape[axis]
        _check_geometry(K, self.scheme, self.k_tile)
        expect = codes.shape[:axis] + (K // BLOCK_SIZE,) + codes.shape[axis + 1 :]
        if scales.shape != expect:
            raise ValueError(f"MXTensor scales shape {scales.shape} != expected {expect}")
        object.__setattr__(self, "codes", codes)
        object.__setattr__(self, "scales", scales)
        object.__setattr__(self, "axis", axis)
        object.__setattr__(self, "elem_format", element_format(self.elem_format).name)
        object.__setattr__(self, "k_tile", int(self.k_tile))

    @property
    def shape(self) -> tuple:
        """Logical shape (same as the quantized tensor)."""
        return self.codes.shape

    def dequantize(self, dtype=np.float32) -> np.ndarray:
        """Returns the values codes * 2**(scale - 127) [*shape] in ``dtype`` (see ``dequantize_mx``)."""
        return dequantize_mx(
            self.codes, self.scales, self.axis, self.elem_format, self.scheme, self.k_tile, dtype
        )


def quantize_mx(
    x,
    axis: int = -1,
    elem_format="float8_e4m3fn",
    scale_rule: str = "neuron",
    scheme: str = "1x32",
    k_tile: int = 512,
) -> MXTensor:
    """MX-quantizes a tensor along one axis.

    Args:
        x: float array [..., K, ...] (K on ``axis``; K a multiple of 32, and for "wrapX" every
            K tile a multiple of 128).
        axis: the axis carrying the groups.
        elem_format: "float8_e4m3fn" or "float8_e5m2" (``_x4`` names accepted).
        scale_rule: one of SCALE_RULES.
        scheme: "1x32" or "wrapX" (module docstring).
        k_tile: K tile length for "wrapX" (also recorded in the result).

    Returns:
        MXTensor with codes uint8 [same shape as x] and scales uint8 [x.shape with K -> K // 32].

    Raises:
        ValueError: invalid axis length / geometry / format / rule.
    """
    fmt = element_format(elem_format)
    check_scale_rule(scale_rule)
    x32 = _as_float32(x)
    if x32.ndim == 0:
        raise ValueError("quantize_mx needs an array with at least one dimension")
    ax = _normalize_axis(axis, x32.ndim)
    K = x32.shape[ax]
    pos = group_positions(K, scheme, k_tile)
    xm = np.moveaxis(x32, ax, -1)
    codes_b, s = quantize_blocks(xm[..., pos], fmt, scale_rule)  # [..., G, 32], [..., G]
    codes_m = np.empty(xm.shape, np.uint8)
    codes_m[..., pos] = codes_b
    codes = np.ascontiguousarray(np.moveaxis(codes_m, -1, ax))
    scales = np.ascontiguousarray(np.moveaxis(s, -1, ax))
    return MXTensor(codes, scales, ax, fmt.name, scheme, int(k_tile))


def dequantize_mx(
    codes, scales, axis: int, elem_format, scheme: str = "1x32", k_tile: int = 512, dtype=np.float32
) -> np.ndarray:
    """Dequantizes MX codes: value = fp8(code) * 2**(scale - 127), scale byte 255 -> NaN.

    The float32 result is exact (fp8 values are multiples of 2**-9 / 2**-16 with <= 4 significant
    bits, times 2**(b - 127) >= 2**-127 stays a multiple of 2**-149) except that magnitudes beyond
    the float32 range become +-Inf (only possible for groups whose amax is within one rounding
    step of the float32 maximum, e.g. a bf16 value >= 1.9375 * 2**127 whose fp8 code rounds up to
    2**128). dtype=np.float64 is exact for every code and scale (what mx_matmul multiplies: the
    Tensor Engine's products are not limited to the float32 range, see ``mx_matmul``).

    Args:
        codes: uint8 [..., K, ...] raw fp8 bit patterns (K on ``axis``).
        scales: uint8 [..., K // 32, ...] E8M0 bytes in logical group order.
        axis: the quantized axis.
        elem_format: fp8 format name (``_x4`` accepted).
        scheme: "1x32" or "wrapX".
        k_tile: K tile length for "wrapX".
        dtype: np.float32 (default) or np.float64 (exact, no overflow).

    Returns:
        array of ``dtype`` with the shape of ``codes``.
    """
    if np.dtype(dtype) not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise ValueError(f"dtype must be float32 or float64, got {dtype!r}")
    fmt = element_format(elem_format)
    c = _check_uint(codes, 8, "codes")
    s = _check_uint(scales, 8, "scales")
    if c.ndim == 0:
        raise ValueError("codes must have at least one dimension")
    ax = _normalize_axis(axis, c.ndim)
    K = c.shape[ax]
    pos = group_positions(K, scheme, k_tile)
    G = pos.shape[0]
    expect = c.shape[:ax] + (G,) + c.shape[ax + 1 :]
    if s.shape != expect:
        raise ValueError(f"scales shape {s.shape} != expected {expect} for codes {c.shape}")
    vals = decode_elements(np.moveaxis(c, ax, -1), fmt)  # [..., K]
    gidx = np.empty(K, np.intp)
    gidx[pos] = np.arange(G, dtype=np.intp)[:, None]
    se = np.moveaxis(s, ax, -1).astype(np.int32)[..., gidx]  # [..., K]
    with np.errstate(over="ignore"):
        out = np.ldexp(vals.astype(np.float64), se - 127).astype(dtype)
    out[se == SCALE_NAN_BYTE] = np.nan
    return np.ascontiguousarray(np.moveaxis(out, -1, ax))


def mx_matmul(a: MXTensor, b: MXTensor, k_tile: int = 512) -> np.ndarray:
    """Reference MX matmul a @ b with PSUM-style float32 accumulation.

    Numerics model (INFERRED from "accumulation precision internal to Tensor Engine is float32",
    docs/simulator.md#choice-mx-numerics,
    https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.nc_matmul_mx.html):
    the contraction is split into consecutive K tiles of ``k_tile`` elements (one nc_matmul_mx
    each). Within a tile, the products of dequantized values are exact in float64 (<= 4-bit
    significands each) and are summed in float64; the tile sum is rounded once to float32 and
    added, in tile order, to a float32 accumulator with a float32 add (PSUM accumulate). The first
    tile overwrites the accumulator. NaN scales / NaN codes propagate as NaN. The operands are
    dequantized in float64, so a dequantized value beyond the float32 range (an fp8 code rounded up
    to 2**128 in a group whose amax is >= 1.9375 * 2**127, e.g. the bf16 maximum) enters the
    products exactly instead of as Inf, as in nisa.nc_matmul_mx's products (nkilib.mx.hw_matmul_mx;
    docs/kernel-api.md records the choice); only a tile sum beyond float32 becomes +-Inf.

    Args:
        a: MXTensor [M, K] quantized along axis 1.
        b: MXTensor [K, N] quantized along axis 0.
        k_tile: contraction tile length (positive integer).

    Returns:
        float32 [M, N].

    Raises:
        ValueError: wrong ranks, quantization axes, K mismatch or k_tile.
    """
    if not isinstance(a, MXTensor) or not isinstance(b, MXTensor):
        raise TypeError("mx_matmul expects two MXTensor operands")
    if a.codes.ndim != 2 or a.axis != 1:
        raise ValueError(
            f"mx_matmul: a must be [M, K] quantized along axis 1, got shape {a.shape} axis {a.axis}"
        )
    if b.codes.ndim != 2 or b.axis != 0:
        raise ValueError(
            f"mx_matmul: b must be [K, N] quantized along axis 0, got shape {b.shape} axis {b.axis}"
        )
    K = a.shape[1]
    if b.shape[0] != K:
        raise ValueError(f"mx_matmul: contraction mismatch, a has K={K}, b has K={b.shape[0]}")
    if not isinstance(k_tile, (int, np.integer)) or k_tile <= 0:
        raise ValueError(f"k_tile must be a positive integer, got {k_tile!r}")
    A = a.dequantize(np.float64)
    B = b.dequantize(np.float64)
    acc = None
    with np.errstate(over="ignore", invalid="ignore"):
        for start in range(0, K, int(k_tile)):
            stop = min(K, start + int(k_tile))
            part = (A[:, start:stop] @ B[start:stop, :]).astype(np.float32)
            acc = part if acc is None else (acc + part).astype(np.float32)
    return acc
