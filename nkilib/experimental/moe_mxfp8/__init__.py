"""MXFP8 Mixture-of-Experts SwiGLU expert backward: routing layout, NumPy references, NKI kernel, PyTorch op.

The NKI kernel is moe_bwd_mxfp8_kernel.moe_backward_mxfp8_nki (imported on demand: it needs `nki`).
``moe_swiglu_experts_mxfp8`` and ``MoESwiGLUExperts`` (moe_bwd_mxfp8_torch.py) are imported lazily, so this package
imports without torch.
"""
from .routing import BlockLayout, build_block_layout, capacity_blocks, validate_topk_ids  # noqa: F401

_TORCH_EXPORTS = ("moe_swiglu_experts_mxfp8", "MoESwiGLUExperts")

__all__ = ["BlockLayout", "build_block_layout", "capacity_blocks", "validate_topk_ids", *_TORCH_EXPORTS]


def __getattr__(name):
    if name in _TORCH_EXPORTS:
        from . import moe_bwd_mxfp8_torch

        return getattr(moe_bwd_mxfp8_torch, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
