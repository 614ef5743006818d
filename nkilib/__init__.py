"""nkilib: MXFP8 SwiGLU MLP backward kernels for AWS Trainium, with a strict NKI CPU simulator.

Importing nkilib selects the NKI backend before any kernel module is imported (see _backend.py).
"""
from ._backend import select_backend

BACKEND = select_backend()

__version__ = "0.1.0"
