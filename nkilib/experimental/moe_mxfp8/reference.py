"""NumPy references of the MXFP8 MoE SwiGLU expert backward (no nki, no torch).

Two modes, as in the dense MLP reference (mlp_mxfp8/mlp_bwd_mxfp8/reference.py, whose phases 0 and 2 this
module reuses; the shared numerics, rounding points, SwiGLU / clamp math and the contract's matmul, are
nkilib/core/numerics.py):
    * ``"mx_exact"``: the numerics contract of docs/moe.md, bit for bit, walking the kernel's block
      layout (routing.BlockLayout) exactly as the kernel does: rows gathered per block (padding rows
      zero), phases 0-1 per block, dX scatter-added per block in block order with a bf16
      read-modify-write, weight gradients folded per expert over its blocks in fp32.
    * ``"fp32"``: the ideal backward (float64, no quantization, no bf16 rounding) of the same math.

Math (routing weight applied on the intermediate; e = topk_ids[t, j], p = topk_weights[t, j]):
    g = x W_gate[e]^T, u = x W_up[e]^T, h = silu(clampG(g)) * clampU(u),
    y[t] = sum_j (p h) W_down[e]^T.
Backward (per routed pair (t, j)):
    dI = dY[t] W_down[e]                   (gradient w.r.t. p h, before the weight)
    d_topk_weights[t, j] = <dI, h>         (= <dY[t], y_e[t]> with y_e = h W_down[e]^T)
    dh = p dI;  d_gate, d_up = SwiGLU'(dh);  dX[t] += [d_gate, d_up] W_gu[e]
    dW_gu[e] += [d_gate, d_up]^T x[t],  dW_down[e] += dY[t]^T (p h)

Dimensions:
    T: tokens, H: hidden, I: intermediate, E: experts, k: experts per token, B: block size,
    N: capacity in blocks. hidden_states / output_grad [T, H], topk_weights [T, k],
    gate_up_weight [E, 2I, H] (per expert gate rows then up rows), down_weight [E, H, I],
    checkpoints gate_pre / gate_act / up / intermediate [T, k, I] (one row per routed pair).
"""
from __future__ import annotations

import numpy as np

from ...core.numerics import (MODES, activation_fns64, apply_activation, contract_matmul, gate_terms,
                              reference_options, swiglu_intermediate, to_bf16, to_f32, to_f64, to_weight_grad, up_terms,
                              weight_grad_np_dtype)
from ..mlp_mxfp8.mlp_bwd_mxfp8.reference import (  # the dense contract's public phases and report
    error_report, reference_phase0_recompute, reference_phase2_hidden_states_grad)
from .constants import BF16_K_TILE, BIAS_GRAD_K_TILE, MX_K_TILE, ROUTING_GRAD_TILE
from .routing import BlockLayout, validate_block_layout, validate_topk_weights

__all__ = ["MODES", "CHECKPOINT_NAMES", "checkpoints_to_blocks", "weights_to_blocks", "weights_from_blocks",
           "gather_rows", "reference_block_phase1",
           "reference_dx_scatter_add", "reference_weight_grad_fold", "reference_bias_grad_fold",
           "moe_backward_reference", "error_report"]

CHECKPOINT_NAMES = ("gate_pre", "gate_act", "up", "intermediate")


def gather_rows(a: np.ndarray, index: np.ndarray) -> np.ndarray:
    """a[index] with zero rows where index is out of bounds (a padding sentinel): the kernel's
    indirect-DMA gather with oob_mode.skip into a zeroed tile.

    Dimensions:
        a [R, C], index [B] -> [B, C] of a's dtype.
    """
    index = np.asarray(index, dtype=np.int64)
    valid = (index >= 0) & (index < a.shape[0])
    out = np.zeros((index.shape[0],) + a.shape[1:], dtype=a.dtype)
    out[valid] = a[index[valid]]
    return out


def checkpoints_to_blocks(checkpoint, layout: BlockLayout):
    """A checkpoint in the kernel's block layout (checkpoint_layout="block"): row p = the slot-layout row of the
    routed pair at block position p, zero (+0.0) at padding positions and in unused blocks.

    Dimensions:
        checkpoint [T, k, I] (or [T*k, I]) -> [N*B, I] of its dtype; None -> None.
    """
    if checkpoint is None:
        return None
    c = np.asarray(checkpoint)
    return gather_rows(c.reshape(layout.num_tokens * layout.top_k, c.shape[-1]), layout.token_position_to_slot)


def weights_to_blocks(topk_weights, layout: BlockLayout) -> np.ndarray:
    """The routing weights in the kernel's block layout (weights_layout="block", its topk_weights_blocks): entry p =
    topk_weights of the routed pair at block position p, +0.0 at padding positions and in unused blocks.

    Dimensions:
        topk_weights [T, k] (or [T*k]) -> [N*B] float32.
    """
    w = np.asarray(topk_weights, dtype=np.float32).reshape(layout.num_tokens * layout.top_k, 1)
    return gather_rows(w, layout.token_position_to_slot).reshape(-1)


def weights_from_blocks(d_weights_blocks, layout: BlockLayout) -> np.ndarray:
    """d_topk_weights [T, k] from the kernel's block-ordered output (weights_layout="block"): slot s takes entry p of
    the position p holding it (every slot is at exactly one position; padding entries are not read).

    Dimensions:
        d_weights_blocks [N*B] float32 -> [T, k] float32.
    """
    d = np.asarray(d_weights_blocks).reshape(-1)
    slots = np.asarray(layout.token_position_to_slot, dtype=np.int64)
    routed = slots < layout.num_tokens * layout.top_k
    out = np.zeros(layout.num_tokens * layout.top_k, dtype=np.float32)
    out[slots[routed]] = d[routed]
    return out.reshape(layout.num_tokens, layout.top_k)


def _routing_grad(d_i, h, mode: str) -> np.ndarray:
    """<dI, h> per row.

    mx_exact: fp32 products dI * f32(h); per tile of ROUTING_GRAD_TILE columns the float64 sum of the
    products rounded once to fp32 (a VectorE/ScalarE reduce); fp32 accumulation across tiles in order,
    the first tile overwriting. fp32: the float64 dot product.

    Dimensions:
        d_i [B, I] (float32 / float64), h [B, I] -> [B].
    """
    if mode == "fp32":
        return (to_f64(d_i) * to_f64(h)).sum(axis=1)
    with np.errstate(over="ignore", invalid="ignore"):
        prod = (d_i * to_f32(h)).astype(np.float32)
        acc = None
        for i0 in range(0, prod.shape[1], ROUTING_GRAD_TILE):
            part = prod[:, i0:i0 + ROUTING_GRAD_TILE].astype(np.float64).sum(axis=1).astype(np.float32)
            acc = part if acc is None else (acc + part).astype(np.float32)
    return acc


def reference_block_phase1(output_grad_b, down_weight_e, weights_b, gate_pre_b, up_b, gate_act_b=None,
                           intermediate_b=None, *, clamp_limits=None, fp8_dtype="float8_e4m3fn",
                           quant_scheme="1x32", matmul_precision="mxfp8", mode="mx_exact"):
    """Phase 1 of one block (expert e): dI, the routing-weight gradient, the weighted SwiGLU derivative.

    mx_exact (docs/moe.md "Numerics"):
        dI = mm(dY_b, W_down[e])                                       (K = H, fp32)
        h = intermediate or bf16(f32(gate_act) * uc)  (gate_act = bf16(act(gc)) if missing; act and the
            offset of uc are the clamp's activation, as in the dense reference)
        d_w = <dI, h> per row (_routing_grad)
        dh = dI * p                                                    (fp32 multiply)
        d_up = bf16((dh * a) * maskU), d_gate = bf16(((dh * uc) * sd) * maskG)   (the dense epilogue on dh)
        hs = bf16(f32(h) * p)                      (weighted intermediate: dW_down's operand)
    fp32: the same in float64 without rounding.

    Dimensions:
        output_grad_b [B, H], down_weight_e [H, I], weights_b [B], gate_pre_b / up_b / gate_act_b /
        intermediate_b [B, I] -> (d_gate_up [B, 2I], hs [B, I], d_weights [B]).

    Args:
        output_grad_b: dY rows of the block (padding rows zero).
        down_weight_e: W_down[e].
        weights_b: routing weights of the block's positions (padding 0), float32.
        gate_pre_b, up_b: required (recompute them with the dense phase 0 when not checkpointed).
        gate_act_b, intermediate_b: optional checkpoints.
        clamp_limits, fp8_dtype, quant_scheme, matmul_precision, mode: as in the dense reference.

    Returns:
        (d_gate_up, hs, d_weights): bf16, bf16, float32 (mx_exact) or float64 (fp32).
    """
    mode, fp8, scheme, precision = reference_options(mode, fp8_dtype, quant_scheme, matmul_precision)
    exact = mode == "mx_exact"
    cast = to_bf16 if exact else to_f64
    dy, w_down = cast(output_grad_b), cast(down_weight_e)
    gate_pre, up = cast(gate_pre_b), cast(up_b)
    d_i = contract_matmul(dy, w_down, mode, precision, fp8, scheme)  # [B, I]: K = H, M = B, N = I
    gc, mask_g = gate_terms(gate_pre, clamp_limits, mode)
    uc, mask_u = up_terms(up, clamp_limits, mode)
    act_fn, act_dx_fn = activation_fns64(clamp_limits)
    gate_act = cast(apply_activation(act_fn, gc, mode)) if gate_act_b is None else cast(gate_act_b)
    h = swiglu_intermediate(gate_act, up, clamp_limits, mode) if intermediate_b is None else cast(intermediate_b)
    a = to_f32(gate_act) if exact else gate_act
    sd = apply_activation(act_dx_fn, gc, mode)
    p = (np.asarray(weights_b, dtype=np.float32) if exact else to_f64(weights_b))[:, None]
    d_w = _routing_grad(d_i, h, mode)
    with np.errstate(over="ignore", invalid="ignore"):
        dh = d_i * p
        d_up = (dh * a) * mask_u
        d_gate = ((dh * uc) * sd) * mask_g
        hs = (to_f32(h) if exact else h) * p
    return np.concatenate([cast(d_gate), cast(d_up)], axis=1), cast(hs), d_w


def reference_dx_scatter_add(dx, part, token_ids, mode="mx_exact") -> None:
    """dX[token_ids[r]] += part[r] for the block's valid rows, in place (padding ids >= T skipped).

    mx_exact: the dma_compute read-modify-write on a bf16 dX: bf16(fp32(f32(dX) + f32(part))), with
    part the block's bf16 dX rows. fp32: float64 add. A block holds each token at most once.

    Dimensions:
        dx [T, H], part [B, H], token_ids [B].
    """
    ids = np.asarray(token_ids, dtype=np.int64)
    valid = ids < dx.shape[0]
    rows = ids[valid]
    if mode == "fp32":
        dx[rows] = dx[rows] + part[valid]
        return
    with np.errstate(over="ignore", invalid="ignore"):
        dx[rows] = to_bf16((to_f32(dx[rows]) + to_f32(part[valid])).astype(np.float32))


def reference_weight_grad_fold(lhs_blocks, rhs_blocks, *, fp8_dtype="float8_e4m3fn", quant_scheme="1x32",
                               matmul_precision="mxfp8", weight_grad_dtype="bfloat16", mode="mx_exact"):
    """One expert's weight gradient: wg(sum over its blocks of lhs_b^T rhs_b), K = tokens.

    mx_exact: acc = +0 (fp32); for each block in order, for each K tile of the block (MX: the whole
    block, B <= 512; BF16: 128 rows): acc = fp32(acc + mm(lhs_tile^T, rhs_tile)), both operands
    MX-quantized along the tokens (padding rows are zero, so they neither contribute nor move a
    group's scale); then wg(acc). No blocks (an empty expert): exact zeros. fp32: float64 sum.

    Dimensions:
        lhs_blocks [nb, B, M], rhs_blocks [nb, B, N] -> [M, N].

    Returns:
        [M, N] in weight_grad_dtype (mx_exact) or float64 (fp32).
    """
    mode, fp8, scheme, precision = reference_options(mode, fp8_dtype, quant_scheme, matmul_precision)
    wg = weight_grad_np_dtype(weight_grad_dtype)
    nb, b, m = lhs_blocks.shape
    n = rhs_blocks.shape[2]
    acc = np.zeros((m, n), dtype=np.float32 if mode == "mx_exact" else np.float64)
    tile = MX_K_TILE if precision == "mxfp8" else BF16_K_TILE
    with np.errstate(over="ignore", invalid="ignore"):
        for i in range(nb):
            for k0 in range(0, b, tile):
                part = contract_matmul(lhs_blocks[i, k0:k0 + tile].T, rhs_blocks[i, k0:k0 + tile],  # K = tile, M, N
                               mode, precision, fp8, scheme)
                acc = (acc + part).astype(acc.dtype)
    return to_weight_grad(acc, mode, wg)


def reference_bias_grad_fold(d_gate_up_blocks, mode="mx_exact") -> np.ndarray:
    """One expert's gate_up bias gradient: the sum of its d_gate_up rows (GPT-OSS's gate_up bias).

    mx_exact: acc = +0 (fp32); for each block in order, for each tile of BIAS_GRAD_K_TILE (128) rows of the
    block in order (padding rows are zero): acc = fp32(acc + fp32(float64 sum of the tile's bf16 values
    per column)) -- the kernel's BF16 matmul with a ones column, one fp32 rounding per tile, accumulated in
    PSUM. The float64 tile sum is exact (hence order-free) while a tile's values span fewer than 2^38. No
    blocks (an empty expert): +0. fp32: the float64 sum.

    Dimensions:
        d_gate_up_blocks [nb, B, 2I] (bf16 in mx_exact) -> [2I] float32 (mx_exact) or float64 (fp32).
    """
    nb, b, two_i = d_gate_up_blocks.shape
    if mode == "fp32":
        return to_f64(d_gate_up_blocks).reshape(nb * b, two_i).sum(axis=0)
    acc = np.zeros(two_i, dtype=np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        for i in range(nb):
            for k0 in range(0, b, BIAS_GRAD_K_TILE):
                part = to_f64(d_gate_up_blocks[i, k0:k0 + BIAS_GRAD_K_TILE]).sum(axis=0).astype(np.float32)
                acc = (acc + part).astype(np.float32)
    return acc


def _check_shapes(dy, x, w, w_gu, w_down, layout: BlockLayout, ckpts):
    if x.ndim != 2 or dy.shape != x.shape:
        raise ValueError(f"hidden_states and output_grad must both be [T, H], got {x.shape} and {dy.shape}")
    if w_gu.ndim != 3 or w_gu.shape[1] % 2 or w_gu.shape[2] != x.shape[1]:
        raise ValueError(f"gate_up_weight must be [E, 2I, H] with H = {x.shape[1]}, got {w_gu.shape}")
    e, two_i, h = w_gu.shape
    if w_down.shape != (e, h, two_i // 2):
        raise ValueError(f"down_weight must be [E, H, I] = {(e, h, two_i // 2)}, got {w_down.shape}")
    t, k = layout.num_tokens, layout.top_k
    if (t, k, e) != (x.shape[0], w.shape[1] if w.ndim == 2 else -1, layout.num_experts):
        raise ValueError(f"layout (T={t}, k={k}, E={layout.num_experts}) does not match hidden_states "
                         f"{x.shape}, topk_weights {w.shape}, gate_up_weight {w_gu.shape}")
    for name, c in zip(CHECKPOINT_NAMES, ckpts):
        if c is not None and tuple(np.shape(c)) != (t, k, two_i // 2):
            raise ValueError(f"{name} must be [T, k, I] = {(t, k, two_i // 2)}, got {tuple(np.shape(c))}")


def moe_backward_reference(output_grad, hidden_states, topk_weights, gate_up_weight, down_weight,
                           layout: BlockLayout, gate_pre=None, gate_act=None, up=None, intermediate=None, *,
                           clamp_limits=None, fp8_dtype="float8_e4m3fn", quant_scheme="1x32",
                           matmul_precision="mxfp8", weight_grad_dtype="bfloat16", mode="mx_exact",
                           gate_up_bias_grad=False):
    """The whole MoE expert backward, walking the block layout like the kernel (docs/moe.md).

    Order: pass A (every used block: gather, phase 0 for missing checkpoints, phase 1 -> d_gate_up
    and hs rows of the block, d_topk_weights of its valid positions); pass B (every used block in
    order: dX rows = mm(d_gate_up_b, W_gu[e]), scatter-added to dX); pass C (every expert: dW_gu and
    dW_down folded over its blocks).

    Dimensions:
        output_grad / hidden_states [T, H], topk_weights [T, k], gate_up_weight [E, 2I, H],
        down_weight [E, H, I], checkpoints [T, k, I] -> dx [T, H], d_topk_weights [T, k],
        d_gate_up_weight [E, 2I, H], d_down_weight [E, H, I].

    Args:
        output_grad, hidden_states: dY, X (bf16; other floats are rounded to bf16 in mx_exact).
        topk_weights: routing weights (finite; rounded to float32).
        gate_up_weight, down_weight: expert weights.
        layout: routing.build_block_layout of the routing.
        gate_pre, gate_act, up, intermediate: optional per-routed-pair checkpoints.
        clamp_limits, fp8_dtype, quant_scheme, matmul_precision, weight_grad_dtype, mode: as in the
            dense reference.
        gate_up_bias_grad: also return d_gate_up_bias [E, 2I] (reference_bias_grad_fold per expert, in pass C).

    Returns:
        (dx, d_topk_weights, d_gate_up_weight, d_down_weight[, d_gate_up_bias]): mx_exact: bf16, float32,
        weight_grad_dtype, weight_grad_dtype[, float32]; fp32: all float32 (computed in float64).
    """
    mode, fp8, scheme, precision = reference_options(mode, fp8_dtype, quant_scheme, matmul_precision)
    weight_grad_np_dtype(weight_grad_dtype)
    exact = mode == "mx_exact"
    cast = to_bf16 if exact else to_f64
    dy, x = cast(output_grad), cast(hidden_states)
    w_gu, w_down = cast(gate_up_weight), cast(down_weight)
    ckpts = (gate_pre, gate_act, up, intermediate)
    w = np.asarray(topk_weights)
    validate_block_layout(layout)
    _check_shapes(dy, x, w, w_gu, w_down, layout, ckpts)
    p_flat = validate_topk_weights(w, (layout.num_tokens, layout.top_k)).reshape(-1)
    if not exact:
        p_flat = to_f64(w).reshape(-1)
    t, h_dim = x.shape
    k, e_num, b = layout.top_k, layout.num_experts, layout.block_size
    n_i = w_gu.shape[1] // 2
    flat_ck = [None if c is None else cast(c).reshape(t * k, n_i) for c in ckpts]
    opts = dict(fp8_dtype=fp8, quant_scheme=scheme, matmul_precision=precision, mode=mode)
    used = layout.num_used_blocks
    rows_of = [slice(i * b, (i + 1) * b) for i in range(used)]
    d_gu = np.zeros((used * b, 2 * n_i), dtype=dy.dtype)  # the kernel's HBM scratch (block-position rows)
    hs = np.zeros((used * b, n_i), dtype=dy.dtype)
    d_w = np.zeros(t * k, dtype=np.float32 if exact else np.float64)
    # pass A: phases 0-1 per block
    for i, rows in enumerate(rows_of):
        e = int(layout.block_to_expert[i])
        ids, slots = layout.token_position_to_id[rows], layout.token_position_to_slot[rows]
        ck = [None if c is None else gather_rows(c, slots) for c in flat_ck]
        if ck[0] is None or ck[2] is None:
            ck = list(reference_phase0_recompute(gather_rows(x, ids), w_gu[e], *ck,  # K = H, M = B, N = I
                                                 clamp_limits=clamp_limits, **opts))
        g_pre, g_act, u, h = ck
        d_gu[rows], hs[rows], dw_b = reference_block_phase1(
            gather_rows(dy, ids), w_down[e], gather_rows(p_flat, slots), g_pre, u, g_act, h,
            clamp_limits=clamp_limits, **opts)
        valid = slots < t * k
        d_w[slots[valid]] = dw_b[valid]
    # pass B: dX, scatter-added in block order
    dx = np.zeros((t, h_dim), dtype=dy.dtype)
    for i, rows in enumerate(rows_of):
        e = int(layout.block_to_expert[i])
        part = reference_phase2_hidden_states_grad(d_gu[rows], w_gu[e], **opts)  # K = 2I, M = B, N = H
        reference_dx_scatter_add(dx, part, layout.token_position_to_id[rows], mode)
    # pass C: weight gradients, expert-major
    dw_gu, dw_down, d_bias = [], [], []
    for e in range(e_num):
        lo, hi = int(layout.expert_block_offsets[e]), int(layout.expert_block_offsets[e + 1])
        ids = layout.token_position_to_id[lo * b:hi * b]
        blk = (hi - lo, b)
        fold = dict(weight_grad_dtype=weight_grad_dtype, **opts)
        # dW_gu[e]: K = tokens, M = 2I, N = H; dW_down[e]: K = tokens, M = H, N = I
        dw_gu.append(reference_weight_grad_fold(d_gu[lo * b:hi * b].reshape(*blk, 2 * n_i),
                                                gather_rows(x, ids).reshape(*blk, h_dim), **fold))
        dw_down.append(reference_weight_grad_fold(gather_rows(dy, ids).reshape(*blk, h_dim),
                                                  hs[lo * b:hi * b].reshape(*blk, n_i), **fold))
        d_bias.append(reference_bias_grad_fold(d_gu[lo * b:hi * b].reshape(*blk, 2 * n_i), mode))
    outs = (dx, d_w.reshape(t, k), np.stack(dw_gu), np.stack(dw_down)) + ((np.stack(d_bias),) if gate_up_bias_grad
                                                                           else ())
    if not exact:
        return tuple(o.astype(np.float32) for o in outs)
    return outs
