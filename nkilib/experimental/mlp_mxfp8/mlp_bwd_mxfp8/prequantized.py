"""Pre-quantized MXFP8 operands of the dense kernel (api.py): quantize a logical [F, K] bf16 matrix along K into
MX words and scales, swizzle / unswizzle them between the logical and the kernel's K-tile layout, dequantize them,
and build a whole call's pre-quantized operands. NumPy only; re-exported by reference.py, whose numerics
(nkilib/core/numerics.py) they share.
"""

from __future__ import annotations

import numpy as np

from ....core import options
from ....core.numerics import quantize_k
from ....mx import deinterleave_k, dequantize_mx, interleave_k, pack_x4, unpack_x4
from .constants import MX_K_ALIGN, MX_K_TILE

__all__ = ["prequantize", "swizzle_prequantized", "unswizzle_prequantized", "dequantize_prequantized",
           "prequantized_operands"]

_fp8_name = options.fp8_format
_check_scheme = options.quant_scheme



def prequantize(a_FK, fp8_dtype="float8_e4m3fn", quant_scheme="1x32", swizzled=False):
    """Pre-quantizes a logical [F, K] bf16 matrix along K (a pre-quantized kernel operand, api.py).

    K is zero-padded to Kp = ceil(K / 128) * 128 and quantized along axis 1 exactly as the
    mx_exact matmul (and the kernel's quantize_mx) quantizes an operand along its contraction axis.

    Dimensions:
        a_FK [F, K] -> unswizzled: words uint32 [F, Kp/4], scales uint8 [F, Kp/32];
        swizzled: words uint32 [Kp/4, F], scales uint8 [Kp/32, F] (``swizzle_prequantized``).

    Args:
        a_FK: [F, K] matrix (K contiguous); float inputs are rounded to bf16 first.
        fp8_dtype: "float8_e4m3fn" or "float8_e5m2".
        quant_scheme: "1x32" or "wrapX".
        swizzled: return the swizzled layout (the kernel's `*_is_swizzled=True`).

    Returns:
        (words, scales): unswizzled words = nkilib.mx.pack_x4(codes) (byte k of word j is element
        4j + k); scales in the MX module's logical group order (``nkilib.mx.group_positions``).
    """
    a = np.asarray(a_FK)
    if a.ndim != 2:
        raise ValueError(f"prequantize expects a 2-D [F, K] matrix, got shape {a.shape}")
    scheme = _check_scheme(quant_scheme)
    q = quantize_k(a, 1, _fp8_name(fp8_dtype), scheme)
    words, scales = pack_x4(q.codes), q.scales
    return swizzle_prequantized(words, scales, scheme) if swizzled else (words, scales)


def swizzle_prequantized(words, scales, quant_scheme="1x32"):
    """Unswizzled pre-quantized operand -> the swizzled layout (api.py): the SBUF image of each
    512-wide K tile stacked along K, F contiguous.

    Swizzled word row k0/4 + p, column f packs elements k0 + k_index(p, j) (j = 0..3) of row f
    (``nkilib.mx.interleave_k``: the partition-p word quantize_mx writes for that tile); swizzled
    scale row k0/32 + g, column f is the scale of partition group g = unswizzled scale column
    k0/32 + g of row f (group order is the same in both layouts).

    Dimensions:
        words uint32 [F, Kp/4], scales uint8 [F, Kp/32] -> words uint32 [Kp/4, F], scales uint8 [Kp/32, F].
    """
    scheme = _check_scheme(quant_scheme)
    codes = unpack_x4(np.asarray(words))  # [F, Kp]
    kp = codes.shape[1]
    if kp % MX_K_ALIGN or np.shape(scales) != (codes.shape[0], kp // 32):
        raise ValueError(f"words [F, Kp/4] with Kp a multiple of {MX_K_ALIGN} and scales [F, Kp/32] expected, "
                         f"got {np.shape(words)} and {np.shape(scales)}")
    tiles = [pack_x4(interleave_k(codes[:, k0:k0 + MX_K_TILE].T, scheme))
             for k0 in range(0, kp, MX_K_TILE)]
    return np.ascontiguousarray(np.concatenate(tiles, axis=0)), np.ascontiguousarray(np.asarray(scales).T)


def unswizzle_prequantized(words, scales, quant_scheme="1x32"):
    """Inverse of ``swizzle_prequantized``: [Kp/4, F] words, [Kp/32, F] scales -> [F, Kp/4], [F, Kp/32]."""
    scheme = _check_scheme(quant_scheme)
    w = np.asarray(words)
    kp = w.shape[0] * 4
    cols = []
    for k0 in range(0, kp, MX_K_TILE):
        t = min(MX_K_TILE, kp - k0)
        b = unpack_x4(w[k0 // 4:(k0 + t) // 4])  # [P, 4F]: byte (p, 4f + j)
        cols.append(deinterleave_k(b, scheme).T)  # [F, T]
    return pack_x4(np.ascontiguousarray(np.concatenate(cols, axis=1))), np.ascontiguousarray(np.asarray(scales).T)


def dequantize_prequantized(words, scales, fp8_dtype="float8_e4m3fn", quant_scheme="1x32", swizzled=False):
    """Values of a pre-quantized operand (inverse view of ``prequantize``).

    Dimensions:
        words uint32 [F, Kp/4], scales uint8 [F, Kp/32] (swizzled: [Kp/4, F], [Kp/32, F]) -> float32 [F, Kp].

    Args:
        words: x4 words.
        scales: E8M0 bytes in logical group order.
        fp8_dtype: element format.
        quant_scheme: "1x32" or "wrapX".
        swizzled: the operand is in the swizzled layout.

    Returns:
        float32 [F, Kp] (the padding columns included).
    """
    if swizzled:
        words, scales = unswizzle_prequantized(words, scales, quant_scheme)
    return dequantize_mx(
        unpack_x4(words), scales, 1, _fp8_name(fp8_dtype), _check_scheme(quant_scheme), MX_K_TILE
    )


#: Kernel argument -> (logical [F, K] matrix of the operand, as a function of dY, X, W_down, W_gu).
PREQUANTIZED_OPERANDS = {
    "down_weight_T": lambda dy, x, w_down, w_gu: w_down.T,  # phase 1 RHS, K = H
    "gate_up_weight_T": lambda dy, x, w_down, w_gu: w_gu.T,  # phase 2 RHS, K = 2I
    "gate_up_weights": lambda dy, x, w_down, w_gu: w_gu,  # recompute RHS, K = H
    "output_grad_T": lambda dy, x, w_down, w_gu: dy.T,  # phase 4 LHS, K = S
    "hidden_states_T": lambda dy, x, w_down, w_gu: x.T,  # phase 3 RHS, K = S
    "output_grad": lambda dy, x, w_down, w_gu: dy,  # phase 1 LHS, K = H (API reference: output_grad_scales)
    "hidden_states": lambda dy, x, w_down, w_gu: x,  # recompute LHS, K = H (hidden_states_scales)
}


def prequantized_operands(
    output_grad,
    hidden_states,
    down_proj_weight,
    gate_up_weights,
    fp8_dtype="float8_e4m3fn",
    quant_scheme="1x32",
    names=None,
    swizzled=False,
) -> dict:
    """Operands the kernel accepts pre-quantized, keyed by the kernel's argument names.

    Dimensions:
        down_weight_T = W_down^T [I, H] (K = H), gate_up_weight_T = W_gu^T [H, 2I] (K = 2I),
        gate_up_weights = W_gu [2I, H] (K = H), output_grad_T = dY^T [H, S] (K = S),
        hidden_states_T = X^T [H, S] (K = S), output_grad = dY [S, H] (K = H), hidden_states = X [S, H] (K = H).

    Args:
        output_grad: dY [S, H].
        hidden_states: X [S, H].
        down_proj_weight: W_down [H, I].
        gate_up_weights: W_gu [2I, H].
        fp8_dtype: element format.
        quant_scheme: "1x32" or "wrapX".
        names: the operands to build (default: all of PREQUANTIZED_OPERANDS).
        swizzled: build the swizzled layout.

    Returns:
        dict with NAME (words) and NAME_scales (scales) for each name; the scales of "output_grad" and
        "hidden_states" are keyed "output_grad_scales" / "hidden_states_scales" (the kernel's names).
    """
    mats = tuple(np.asarray(m) for m in (output_grad, hidden_states, down_proj_weight, gate_up_weights))
    out = {}
    for name in names or PREQUANTIZED_OPERANDS:
        if name not in PREQUANTIZED_OPERANDS:
            raise ValueError(f"names: {name!r} is not one of {tuple(PREQUANTIZED_OPERANDS)}")
        out[name], out[name + "_scales"] = prequantize(PREQUANTIZED_OPERANDS[name](*mats), fp8_dtype, quant_scheme,
                                                       swizzled)
    return out
