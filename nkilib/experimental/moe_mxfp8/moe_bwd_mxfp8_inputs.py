"""Argument checks of the MoE backward kernel's entry point (moe_bwd_mxfp8_kernel.moe_backward_mxfp8_nki).

Every check is a kernel_assert at trace time that names the argument, the expected and the received value; the
routing index values themselves are data the kernel trusts (routing.py validates topk_ids on the host).
"""
from __future__ import annotations

from ...core.kernel_helpers import kernel_assert
from .constants import BLOCK_ALIGN, CHECKPOINT_LAYOUTS, MAX_BLOCK_SIZE, WEIGHTS_LAYOUTS

__all__ = ["check_moe_inputs"]


def _check(name, t, shape, dtypes):
    kernel_assert(t != None and hasattr(t, "shape"), f"{name} must be an HBM tensor, got {t!r}")  # noqa: E711
    kernel_assert(tuple(t.shape) == tuple(shape), f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    kernel_assert(str(t.dtype) in dtypes, f"{name} must have dtype {' or '.join(dtypes)}, got {t.dtype}")


def check_moe_inputs(output_grad, hidden_states, topk_weights, gate_up_weight, down_weight, token_position_to_id,
                     token_position_to_slot, expert_block_offsets, checkpoints, block_size, gate_up_bias_grad,
                     checkpoint_layout, topk_weights_blocks=None, weights_layout=WEIGHTS_LAYOUTS[0]):
    """Checks the entry point's tensors and static options; returns their sizes.

    Args:
        checkpoints: the optional checkpoints by argument name (gate_pre, gate_act, up, intermediate), each an HBM
            tensor or None; every other argument is moe_backward_mxfp8_nki's of the same name.

    Dimensions:
        as moe_backward_mxfp8_nki's: output_grad / hidden_states [T, H], topk_weights [T, k], gate_up_weight
        [E, 2I, H], down_weight [E, H, I], token_position_to_id / token_position_to_slot [N*B],
        expert_block_offsets [E+1], checkpoints (name -> tensor or None) [T, k, I] or [N*B, I] (block layout),
        topk_weights_blocks [N*B] float32 with weights_layout "block", else None.

    Returns:
        (T, H, k, E, I, N, blocked, weights_blocked): blocked is checkpoint_layout == "block", weights_blocked is
        weights_layout == "block".
    """
    kernel_assert(isinstance(block_size, int) and block_size % BLOCK_ALIGN == 0 and
                  BLOCK_ALIGN <= block_size <= MAX_BLOCK_SIZE,
                  f"block_size must be a multiple of {BLOCK_ALIGN} in [{BLOCK_ALIGN}, {MAX_BLOCK_SIZE}], "
                  f"got {block_size!r}")
    kernel_assert(isinstance(gate_up_bias_grad, bool), f"gate_up_bias_grad must be a bool, got {gate_up_bias_grad!r}")
    # ---- shapes ----
    kernel_assert(output_grad != None and hasattr(output_grad, "shape") and len(output_grad.shape) == 2,  # noqa: E711
                  f"output_grad must be a 2-D [T, H] tensor, got {getattr(output_grad, 'shape', output_grad)!r}")
    T, H = output_grad.shape
    _check("output_grad", output_grad, (T, H), ("bfloat16",))
    _check("hidden_states", hidden_states, (T, H), ("bfloat16",))
    kernel_assert(gate_up_weight != None and hasattr(gate_up_weight, "shape")  # noqa: E711
                  and len(gate_up_weight.shape) == 3,
                  f"gate_up_weight must be a 3-D [E, 2I, H] tensor, got {getattr(gate_up_weight, 'shape', None)!r}")
    E, two_i = gate_up_weight.shape[0], gate_up_weight.shape[1]
    kernel_assert(two_i % 2 == 0,
                  f"gate_up_weight must be [E, 2I, H] with an even 2I, got {list(gate_up_weight.shape)}")
    I = two_i // 2
    _check("gate_up_weight", gate_up_weight, (E, 2 * I, H), ("bfloat16",))
    _check("down_weight", down_weight, (E, H, I), ("bfloat16",))
    kernel_assert(H % 32 == 0 and I % 32 == 0,
                  f"H and I must be multiples of 32 (MX groups along H and I); got H={H}, I={I}")
    kernel_assert(topk_weights != None and hasattr(topk_weights, "shape") and len(topk_weights.shape) == 2  # noqa: E711
                  and topk_weights.shape[0] == T,
                  f"topk_weights must be [T, k] with T={T}, got {getattr(topk_weights, 'shape', None)!r}")
    k = topk_weights.shape[1]
    _check("topk_weights", topk_weights, (T, k), ("float32",))
    kernel_assert(k <= E, f"topk_weights has k={k} experts per token but E={E} experts: k must be <= E")
    kernel_assert(token_position_to_id != None and hasattr(token_position_to_id, "shape")  # noqa: E711
                  and len(token_position_to_id.shape) == 1 and token_position_to_id.shape[0] % block_size == 0,
                  f"token_position_to_id must be [N*B] with B=block_size={block_size}, got "
                  f"{getattr(token_position_to_id, 'shape', None)!r}")
    N = token_position_to_id.shape[0] // block_size
    _check("token_position_to_id", token_position_to_id, (N * block_size,), ("int32",))
    _check("token_position_to_slot", token_position_to_slot, (N * block_size,), ("int32",))
    _check("expert_block_offsets", expert_block_offsets, (E + 1,), ("int32",))
    kernel_assert(checkpoint_layout in CHECKPOINT_LAYOUTS,
                  f"checkpoint_layout must be one of {list(CHECKPOINT_LAYOUTS)}, got {checkpoint_layout!r}")
    blocked = checkpoint_layout == "block"
    ckpt_shape = (N * block_size, I) if blocked else (T, k, I)
    for name, ckpt in checkpoints.items():
        if ckpt != None:  # noqa: E711
            _check(f"{name} (checkpoint_layout={checkpoint_layout!r}: [N*B, I] by block position)" if blocked else
                   name, ckpt, ckpt_shape, ("bfloat16",))
    kernel_assert(weights_layout in WEIGHTS_LAYOUTS,
                  f"weights_layout must be one of {list(WEIGHTS_LAYOUTS)}, got {weights_layout!r}")
    weights_blocked = weights_layout == "block"
    if weights_blocked:
        _check("topk_weights_blocks (weights_layout='block': [N*B] by block position)", topk_weights_blocks,
               (N * block_size,), ("float32",))
    else:
        kernel_assert(topk_weights_blocks == None,  # noqa: E711
                      f"topk_weights_blocks is read only with weights_layout='block', got weights_layout="
                      f"{weights_layout!r} and a tensor of shape {list(getattr(topk_weights_blocks, 'shape', []))}")
    return T, H, k, E, I, N, blocked, weights_blocked
