"""MXFP8 SwiGLU MLP kernels.

``swiglu_mlp_mxfp8`` and ``SwiGLUMLP`` (the PyTorch integration, mlp_bwd_mxfp8/mlp_bwd_mxfp8_torch.py)
are imported lazily, so this package imports without torch.
"""

_TORCH_EXPORTS = ("swiglu_mlp_mxfp8", "SwiGLUMLP")

__all__ = list(_TORCH_EXPORTS)


def __getattr__(name):
    if name in _TORCH_EXPORTS:
        from .mlp_bwd_mxfp8 import mlp_bwd_mxfp8_torch

        return getattr(mlp_bwd_mxfp8_torch, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
