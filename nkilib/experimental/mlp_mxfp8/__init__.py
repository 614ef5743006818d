"""MXFP8 SwiGLU MLP kernels."""
