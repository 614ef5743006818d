"""nkilib: MXFP8 SwiGLU MLP backward kernels for AWS Trainium, with a strict NKI CPU simulator.

Importing nkilib selects the NKI backend before any kernel module is imported (see _backend.py).
"""
from ._backend import select_backend

BACKEND = select_backend()

__version__ = "0.1.0"

# Training integration (needs torch): imported on first use, so `import nkilib` works without torch.
_LAZY_EXPORTS = {
    "patch_model": ("training.patch", "patch_model"),
    "Recipe": ("recipe", "Recipe"),
    "get_recipe": ("recipe", "get_recipe"),
    "RECIPE_PRESETS": ("recipe", "PRESETS"),
}


def __getattr__(name):
    if name in _LAZY_EXPORTS:
        import importlib

        module, attr = _LAZY_EXPORTS[name]
        return getattr(importlib.import_module(f".{module}", __name__), attr)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
