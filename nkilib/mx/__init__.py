"""Bit-exact MX (microscaling, OCP MX v1.0) numerics for NKI kernels, in NumPy.

Modules:
    formats: element formats, scale rules, element / scale / FP4 decoding.
    quantize: block quantization, quantize_mx / dequantize_mx along an axis, mx_matmul reference.
    layout: x4 packing, quadrant scale rows, K interleaving for SBUF tiles.
    hw: exact math of nisa.quantize_mx / nisa.nc_matmul_mx on SBUF-layout operands.

Contract: https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.quantize_mx.html,
https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.nc_matmul_mx.html,
https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/deep-dives/mxfp-matmul.html;
choices where the docs are silent: docs/simulator.md (quantize_mx, nc_matmul_mx entries and "Choices").
"""

from .formats import (
    BLOCK_SIZE,
    ELEMENT_FORMATS,
    FP4_E2M1_VALUES,
    SCALE_NAN_BYTE,
    SCALE_RULES,
    ElementFormat,
    check_scale_rule,
    decode_elements,
    decode_fp4,
    element_format,
    scale_bytes_to_float,
)
from .hw import MATMUL_MX_FORMATS, QMX_PARTITIONS, hw_matmul_mx, hw_quantize_tile
from .layout import (
    deinterleave_k,
    interleave_k,
    k_index,
    pack_fp4_x4,
    pack_x4,
    scale_row,
    scales_from_quadrant_rows,
    scales_to_quadrant_rows,
    unpack_fp4_x4,
    unpack_x4,
)
from .quantize import (
    SCHEMES,
    MXTensor,
    dequantize_mx,
    group_positions,
    mx_matmul,
    quantize_blocks,
    quantize_mx,
)

__all__ = [
    "BLOCK_SIZE",
    "ELEMENT_FORMATS",
    "FP4_E2M1_VALUES",
    "MATMUL_MX_FORMATS",
    "QMX_PARTITIONS",
    "SCALE_NAN_BYTE",
    "SCALE_RULES",
    "SCHEMES",
    "ElementFormat",
    "MXTensor",
    "check_scale_rule",
    "decode_elements",
    "decode_fp4",
    "deinterleave_k",
    "dequantize_mx",
    "element_format",
    "group_positions",
    "hw_matmul_mx",
    "hw_quantize_tile",
    "interleave_k",
    "k_index",
    "mx_matmul",
    "pack_fp4_x4",
    "pack_x4",
    "quantize_blocks",
    "quantize_mx",
    "scale_bytes_to_float",
    "scale_row",
    "scales_from_quadrant_rows",
    "scales_to_quadrant_rows",
    "unpack_fp4_x4",
    "unpack_x4",
]
