"""MXFP8 SwiGLU MLP backward (public names follow AWS nki-library 2.31/2.32)."""
from .config import ClampLimits, MatmulConfig, MlpBwdMatmulConfig, TensorDescriptor  # noqa: F401
from .mlp_bwd_mxfp8_kernel import (  # noqa: F401
    compute_phase1_down_proj_mm_grad_mxfp8,
    compute_phase2_hidden_states_grad_mxfp8,
    compute_phase3_gate_up_weight_grad_mxfp8,
    compute_phase4_down_weight_grad_mxfp8,
    get_program_sharding_info,
    mlp_backward_mxfp8_base_nki,
    mlp_backward_mxfp8_nki,
)
