"""SBUF layouts of MX data: x4 packing, quadrant scale rows and K interleaving.

Contract: the x4 bit layout, the quantize_mx groups and the quadrant scale layout
r(g) = 32*(g//4) + g%4 of the pages below (docs/simulator.md, quantize_mx entry).

References:
    * https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.quantize_mx.html
    * https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/deep-dives/mxfp-matmul.html
    * https://github.com/aws-neuron/nki-samples/tree/main/src/nki_samples/tutorials/mxfp-matmul (`pack_mx_data_into_x4`)
"""

from __future__ import annotations

import numpy as np

from .formats import _check_uint

__all__ = [
    "pack_x4",
    "unpack_x4",
    "pack_fp4_x4",
    "unpack_fp4_x4",
    "scale_row",
    "scales_to_quadrant_rows",
    "scales_from_quadrant_rows",
    "k_index",
    "interleave_k",
    "deinterleave_k",
]

_LAYOUT_SCHEMES = ("1x32", "wrapX")


def _split4(a: np.ndarray, what: str) -> np.ndarray:
    if a.ndim == 0 or a.shape[-1] % 4 != 0:
        raise ValueError(f"{what}: last dimension must be a multiple of 4, got shape {a.shape}")
    return np.ascontiguousarray(a).reshape(a.shape[:-1] + (a.shape[-1] // 4, 4))


def pack_x4(codes_u8) -> np.ndarray:
    """Packs fp8 codes four to a 32-bit word (float8_*_x4; byte k of word j = element 4j + k).

    Byte k of little-endian word j is element 4j + k, i.e. word = sum_k code[4j+k] << 8k. The
    computation is arithmetic on values, so it does not depend on the host byte order; the result
    equals the in-memory fp8 bytes viewed as '<u4'.

    Args:
        codes_u8: uint8 [..., 4F].

    Returns:
        uint32 [..., F].
    """
    c = _split4(_check_uint(codes_u8, 8, "codes"), "pack_x4").astype(np.uint32)
    return c[..., 0] | (c[..., 1] << 8) | (c[..., 2] << 16) | (c[..., 3] << 24)


def unpack_x4(words) -> np.ndarray:
    """Unpacks 32-bit x4 words to fp8 codes (inverse of ``pack_x4``).

    Args:
        words: uint32 [..., F] (any byte order dtype; values are used).

    Returns:
        uint8 [..., 4F] with element 4j + k = byte k of little-endian word j.
    """
    w = _check_uint(words, 32, "words")
    if w.ndim == 0:
        raise ValueError("unpack_x4 needs an array with at least one dimension")
    # Explicit little-endian: the bytes of '<u4' are the value's bytes low to high.
    b = np.ascontiguousarray(w, dtype="<u4").view(np.uint8)
    return b.reshape(w.shape[:-1] + (w.shape[-1] * 4,))


def pack_fp4_x4(nibbles) -> np.ndarray:
    """Packs e2m1 (FP4) codes four to a 16-bit word (float4_e2m1fn_x4).

    Nibble k (bits 4k..4k+3) of word j is element 4j + k, low nibble first; in memory (little
    endian) byte 2j = e[4j] | e[4j+1] << 4 and byte 2j+1 = e[4j+2] | e[4j+3] << 4.

    Args:
        nibbles: integer [..., 4F] with values in [0, 15].

    Returns:
        uint16 [..., F].
    """
    n = _split4(_check_uint(nibbles, 4, "fp4 nibbles"), "pack_fp4_x4").astype(np.uint16)
    return n[..., 0] | (n[..., 1] << 4) | (n[..., 2] << 8) | (n[..., 3] << 12)


def unpack_fp4_x4(words) -> np.ndarray:
    """Unpacks 16-bit FP4 x4 words (inverse of ``pack_fp4_x4``).

    Args:
        words: uint16 [..., F].

    Returns:
        uint8 [..., 4F] nibbles, element 4j + k = (word_j >> 4k) & 0xF.
    """
    w = _check_uint(words, 16, "fp4 words")
    if w.ndim == 0:
        raise ValueError("unpack_fp4_x4 needs an array with at least one dimension")
    shifts = np.array([0, 4, 8, 12], dtype=np.uint16)
    n = ((w[..., None] >> shifts) & 0xF).astype(np.uint8)
    return n.reshape(w.shape[:-1] + (w.shape[-1] * 4,))


def scale_row(g):
    """Quadrant scale row of quantize_mx group row g: 32*(g//4) + g%4
    (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.quantize_mx.html).

    Args:
        g: int or integer array of group rows (0..15 for a 128-partition tile).

    Returns:
        int (for an int input) or int array of the same shape.
    """
    ga = np.asarray(g)
    if ga.dtype.kind not in "ui":
        raise TypeError(f"group index must be integer, got dtype {ga.dtype}")
    r = 32 * (ga // 4) + ga % 4
    return int(r) if ga.ndim == 0 and not isinstance(g, np.ndarray) else r


def scales_to_quadrant_rows(scale_bytes, fill: int = 0) -> np.ndarray:
    """Places group-order scales in the quantize_mx quadrant layout.

    Args:
        scale_bytes: uint8 [G, N] in group order (row g = data partitions 8g..8g+7).
        fill: value of the rows quantize_mx does not write (rows 4..31 of each quadrant).

    Returns:
        uint8 [scale_row(G-1) + 1, N] with row scale_row(g) = scale_bytes[g].
    """
    s = _check_uint(scale_bytes, 8, "scale_bytes")
    if s.ndim != 2 or s.shape[0] == 0:
        raise ValueError(f"scale_bytes must be [G, N] with G >= 1, got shape {s.shape}")
    G = s.shape[0]
    out = np.full((scale_row(G - 1) + 1, s.shape[1]), fill, dtype=np.uint8)
    out[scale_row(np.arange(G))] = s
    return out


def scales_from_quadrant_rows(rows_array, num_groups: int) -> np.ndarray:
    """Gathers group-order scales from the quadrant layout (inverse of ``scales_to_quadrant_rows``).

    Args:
        rows_array: uint8 [R, N] with R >= scale_row(num_groups - 1) + 1.
        num_groups: G.

    Returns:
        uint8 [G, N].
    """
    r = _check_uint(rows_array, 8, "rows_array")
    if num_groups <= 0:
        raise ValueError(f"num_groups must be positive, got {num_groups}")
    need = scale_row(num_groups - 1) + 1
    if r.ndim != 2 or r.shape[0] < need:
        raise ValueError(
            f"rows_array must be 2-D with at least {need} rows for {num_groups} groups, "
            f"got shape {r.shape}"
        )
    return r[scale_row(np.arange(num_groups))].copy()


def _check_scheme(scheme: str) -> None:
    if scheme not in _LAYOUT_SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; accepted: {', '.join(_LAYOUT_SCHEMES)}")


def k_index(p, j, T: int, scheme: str):
    """Logical K index (tile-local) held by SBUF partition p, packed slot j.

    Args:
        p: partition index (int or array), 0 <= p < T // 4.
        j: slot 0..3 (int or array, broadcast with p).
        T: K tile length (multiple of 4).
        scheme: "1x32" (k = 4p + j) or "wrapX" (k = p + (T // 4) * j).

    Returns:
        Integer (array) k.
    """
    _check_scheme(scheme)
    if T <= 0 or T % 4 != 0:
        raise ValueError(f"K tile length T must be a positive multiple of 4, got {T}")
    p = np.asarray(p)
    j = np.asarray(j)
    k = 4 * p + j if scheme == "1x32" else p + (T // 4) * j
    return int(k) if k.ndim == 0 else k


def interleave_k(x, scheme: str) -> np.ndarray:
    """Lays a logical K tile out as the quantize_mx source tile.

    out[p, 4n + j] = x[k_index(p, j, T, scheme), n]; then quantize_mx group (g, n) = partitions
    8g..8g+7 x free 4n..4n+3 is exactly logical group g of ``quantize_mx(x, axis=0, scheme)``.

    Args:
        x: array [T, N] (T % 4 == 0; T % 32 == 0 for "1x32" groups, T % 128 == 0 for "wrapX").
        scheme: "1x32" or "wrapX".

    Returns:
        array [T // 4, 4 * N] of x's dtype.
    """
    _check_scheme(scheme)
    a = np.asarray(x)
    if a.ndim != 2 or a.shape[0] == 0 or a.shape[0] % 4 != 0:
        raise ValueError(f"interleave_k expects [T, N] with T a positive multiple of 4, got {a.shape}")
    T, N = a.shape
    P = T // 4
    if scheme == "1x32":
        v = a.reshape(P, 4, N).transpose(0, 2, 1)  # [p, n, j], k = 4p + j
    else:
        v = a.reshape(4, P, N).transpose(1, 2, 0)  # [p, n, j], k = p + P*j
    return np.ascontiguousarray(v).reshape(P, 4 * N)


def deinterleave_k(y, scheme: str) -> np.ndarray:
    """Inverse of ``interleave_k``: [T // 4, 4 * N] -> [T, N].

    Args:
        y: array [P, 4N].
        scheme: "1x32" or "wrapX".

    Returns:
        array [4P, N].
    """
    _check_scheme(scheme)
    a = np.asarray(y)
    if a.ndim != 2 or a.shape[1] % 4 != 0:
        raise ValueError(f"deinterleave_k expects [P, 4N], got shape {a.shape}")
    P, N4 = a.shape
    N = N4 // 4
    v = a.reshape(P, N, 4)  # [p, n, j]
    if scheme == "1x32":
        out = v.transpose(0, 2, 1)  # [p, j, n] -> k = 4p + j
    else:
        out = v.transpose(2, 0, 1)  # [j, p, n] -> k = p + P*j
    return np.ascontiguousarray(out).reshape(4 * P, N)
