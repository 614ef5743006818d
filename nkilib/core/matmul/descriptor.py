"""What the matmul layer is told about one kernel call: operand descriptors and the numeric setup."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import nki.language as nl

from .constants import MX_PACK


@dataclass(frozen=True)
class TensorDescriptor(nl.NKIObject):
    """One matmul operand in HBM and how its contraction axis K lies.

    Dimensions:
        k_axis=0: `tensor` is [K, F] (K = rows, F contiguous), e.g. hidden_states [S, H] as the K=S operand.
        k_axis=1: `tensor` is [F, K] (K contiguous), e.g. output_grad [S, H] as the K=H operand.
        Pre-quantized (`scales` given, k_axis must be 1): `tensor` holds x4 words [F, Kp/4] (uint32) and
        `scales` uint8 [F, Kp/32], Kp = K padded to a multiple of 128 (see reference.prequantize).
        Panel layout (`panel_layout=True`, `scales` given, k_axis=0): MXFP8 K tiles as quantize_mx leaves them
        in SBUF, written by the kernel itself (panels.store_k_tile): `tensor` x4 words [Kt/4, F] (K tile t's
        partition p in row 128t + p; Kt = K in whole 512-row tiles, k_len = K where a last tile is partial),
        `scales` uint8 [128 * scale tiles, F] (panels.panel_scale_row); loaded with long runs and no quantize_mx.

    `f_base`/`f_size` select a window of F (e.g. the gate or up half of gate_up_weights); `k_base`/`k_len`
    a window of K (e.g. one expert's rows of stacked expert weights reshaped to [E*K, F], or one K chunk of a
    K-chunked plan; with scales only in the panel layout, from a multiple of MX_K_TILE * SCALE_PACK_SLOTS).
    """

    tensor: object
    k_axis: int
    scales: object = None
    f_base: int = 0
    f_size: int = -1  # -1: to the end of F
    k_base: int = 0
    k_len: int = -1  # -1: to the end of K
    panel_layout: bool = False

    @property
    def prequantized(self) -> bool:
        return self.scales != None  # noqa: E711  (NKI 0.3+ traced code has no `is not`; see panels.py)

    @property
    def k_size(self) -> int:
        if self.panel_layout:
            return self.k_len if self.k_len >= 0 else self.tensor.shape[0] * MX_PACK - self.k_base
        if self.prequantized:
            return self.scales.shape[1] * 32
        if self.k_len >= 0:
            return self.k_len
        return self.tensor.shape[self.k_axis] - self.k_base

    @property
    def f_total(self) -> int:
        """F extent of the underlying tensor (row length for k_axis=1 is K)."""
        return self.tensor.shape[1 - self.k_axis]

    @property
    def f_extent(self) -> int:
        return self.f_total - self.f_base if self.f_size < 0 else self.f_size

    def window(self, f_base: int, f_size: int) -> "TensorDescriptor":
        return dataclasses.replace(self, f_base=self.f_base + f_base, f_size=f_size)

    def k_window(self, k_base: int, k_len: int) -> "TensorDescriptor":
        """K rows [k_base, k_base + k_len) of this operand's K (a K chunk; see k_chunks.py)."""
        return dataclasses.replace(self, k_base=self.k_base + k_base, k_len=k_len)


class MatmulSetup(nl.NKIObject):
    """Numeric choices shared by all matmuls of one kernel call (immutable by convention)."""

    def __init__(self, precision: str, x4_dtype, scheme: str, use_scale_packing: bool):
        self.precision = precision
        self.x4_dtype = x4_dtype
        self.scheme = scheme
        self.use_scale_packing = use_scale_packing

    @property
    def is_mx(self) -> bool:
        return self.precision == "mxfp8"
