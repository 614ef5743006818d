"""Training integration: recipes applied to Hugging Face models (patch_model), tensor parallelism.

Modules:
    swiglu: HFSwiGLUMLP, a dense SwiGLU MLP with the model's own parameter names whose backward is the op.
    moe: HFMoEExperts, the experts of a sparse MoE block on the MoE op (the model's router kept).
    patch: patch_model (swap a model's MLPs / experts in place) and the registry of swappable classes.
    tensor_parallel: TensorParallelSwiGLUMLP (NxD column/row-parallel shards, any process group).
"""
from .moe import HFMoEExperts  # noqa: F401
from .patch import PatchReport, patch_model, register_swap, swappable_classes  # noqa: F401
from .swiglu import HFSwiGLUMLP  # noqa: F401
from .tensor_parallel import TensorParallelSwiGLUMLP  # noqa: F401
