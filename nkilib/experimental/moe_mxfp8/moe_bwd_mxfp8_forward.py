"""The BF16 forward math of the MoE torch op (moe_bwd_mxfp8_torch.py): y and the checkpoints its backward reads,
in the checkpoint layout the backward's backend consumes (docs/moe.md section 6).

Dimensions: x2 [T, H], ids / w [T, k], w_gu [E, 2I, H], w_down [E, H, I]; checkpoints gate_pre / gate_act / up /
intermediate bf16, [T, k, I] by slot (the emulate backends) or [N*B, I] by block position (the backends that run
the kernel, simulator and neuron: its checkpoint_layout="block", read by plain DMA instead of gathered by slot).
Those backends' backward also passes the routing weights block-ordered and takes the kernel's block-ordered
d_topk_weights back to [T, k] (weights_layout="block": kernel_weights_blocks / weights_grad_from_blocks, two torch
index ops of T*k elements outside the kernel, built from topk_weights and the layout the backward makes anyway).
"""
from __future__ import annotations

import torch

from ...core import options
from ..emulate_numerics import swiglu_activations
from ..torch_common import CHECKPOINT_NAMES
from . import routing

__all__ = ["forward_math", "checkpoint_rows", "kernel_checkpoint_layout", "kernel_weights_blocks",
           "weights_grad_from_blocks"]


def checkpoint_rows(t: int, k: int, num_experts: int, block_size=None) -> int:
    """Rows of a saved checkpoint: T*k by slot, or N*B by block position (N = routing.capacity_blocks, the capacity
    routing.build_block_layout gives the backward by default) when block_size is given."""
    if block_size is None:
        return t * k
    return routing.capacity_blocks(t, k, num_experts, block_size) * block_size


def kernel_checkpoint_layout(ckpts, t: int, k: int, n_i: int) -> tuple:
    """(shape, checkpoint_layout) to pass the saved checkpoints to moe_backward_mxfp8_nki: 2-D ones were saved
    block-ordered ([N*B, I], forward_math with a block_size) -> ((-1, I), "block"); otherwise by slot ->
    ((T, k, I), "slot"). One rule for the simulator backend and the Neuron path."""
    blocked = any(c is not None and c.dim() == 2 for c in ckpts)
    return ((-1, n_i), "block") if blocked else ((t, k, n_i), "slot")


def kernel_weights_blocks(w, slots):
    """The kernel's topk_weights_blocks (weights_layout="block"): entry p = w's weight of the pair at block position p,
    +0.0 at padding positions and in unused blocks (their slot is the sentinel T*k, which indexes an appended zero),
    as reference.weights_to_blocks.

    Dimensions:
        w [T, k], slots [N*B] int64 (token_position_to_slot on w's device) -> [N*B] float32.
    """
    flat = w.reshape(-1).to(torch.float32)
    return torch.cat([flat, flat.new_zeros(1)])[slots]


def weights_grad_from_blocks(d_blocks, slots, t: int, k: int):
    """d_topk_weights [T, k] from the kernel's block-ordered output (weights_layout="block"): each slot's value copied
    from the one position holding it (no sum: a slot is at exactly one position), as reference.weights_from_blocks;
    the padding entries all land on the sentinel's extra row, which is dropped.

    Dimensions:
        d_blocks [N*B] float32, slots [N*B] int64 on its device -> [T, k] float32.
    """
    out = d_blocks.new_zeros(t * k + 1)
    out.index_copy_(0, slots, d_blocks.reshape(-1))
    return out[:t * k].reshape(t, k)


def forward_math(x2, ids, w, w_gu, w_down, clamps, gate_up_bias=None, block_size=None):
    """y [T, H] (x2's dtype) and the bf16 checkpoints of the clamped SwiGLU experts; clamps: the four limits and the
    activation; gate_up_bias [E, 2I] or None (added to the bf16 projections in bf16, as GPT-OSS).

    block_size None: checkpoints [T, k, I], row t*k + j = pair (t, j). Else [N*B, I] in the block layout of
    routing.build_block_layout(ids, E, B): expert e's pairs, in ascending slot order, at positions from
    offsets[e] * B (offsets: the cumulative ceil(pairs / B) of the experts before e), +0 elsewhere (padding and
    unused blocks) -- each expert's rows written where the kernel reads them, no scatter by slot."""
    bf, f32 = torch.bfloat16, torch.float32
    t, h_dim = x2.shape
    k = ids.shape[1]
    e_num, two_i, _ = w_gu.shape
    n_i = two_i // 2
    xb, wgu, wd = x2.to(bf), w_gu.to(bf), w_down.to(bf)
    flat = ids.reshape(-1).to(torch.int64)
    p = w.reshape(-1).to(f32)
    ckpts = [x2.new_zeros((checkpoint_rows(t, k, e_num, block_size), n_i), dtype=bf) for _ in CHECKPOINT_NAMES]
    y = torch.zeros(t, h_dim, dtype=f32, device=x2.device)
    clamp_dict = dict(zip(options.CLAMP_NAMES + ("activation",), clamps))
    b_gu = None if gate_up_bias is None else gate_up_bias.to(bf)
    first = 0  # block layout: expert e's first position
    for e in range(e_num):
        slots = torch.nonzero(flat == e).squeeze(1)
        if slots.numel() == 0:
            continue
        if block_size is None:
            rows = slots
        else:
            rows = torch.arange(first, first + slots.numel(), device=x2.device)
            first += -(-slots.numel() // block_size) * block_size  # the expert's blocks, its last one padded
        tok = slots // k
        x_e = xb[tok]
        gate_pre = x_e @ wgu[e, :n_i].t()  # K = H, M = tokens of e, N = I
        up = x_e @ wgu[e, n_i:].t()  # K = H, M = tokens of e, N = I
        if b_gu is not None:
            gate_pre, up = gate_pre + b_gu[e, :n_i], up + b_gu[e, n_i:]
        gate_act, inter = swiglu_activations(gate_pre, up, clamp_dict)
        hs = (inter.to(f32) * p[slots, None]).to(bf)
        y.index_add_(0, tok, (hs @ wd[e].t()).to(f32))  # K = I, M = tokens of e, N = H
        for c, v in zip(ckpts, (gate_pre, gate_act, up, inter)):
            c[rows] = v
    if block_size is None:
        ckpts = [c.reshape(t, k, n_i) for c in ckpts]
    return (y.to(x2.dtype), *ckpts)
