"""Pure-torch emulation of the MoE expert backward's numerics (the `emulate` backend).

Bit-identical to ``reference.moe_backward_reference(mode="mx_exact")`` (docs/moe.md "Numerics") on any
torch device, built on the emulate backends' shared quantizer, matmul and SwiGLU numerics
(nkilib/experimental/emulate_numerics.py, as the dense emulation).
It does not materialize the block layout: the contract depends on the layout only through
    * row-wise math (phases 0-2 treat every routed row independently: operands are quantized along
      H or 2I, never across rows), so the rows can be processed per expert in any grouping;
    * the token order inside an expert (ascending token id) and the block boundaries (every B
      consecutive tokens of an expert, the last block zero-padded), which fix the weight-gradient
      fold and the MX groups along tokens;
    * the dX read-modify-write order, ascending block index = ascending expert id per token.
Same exactness caveats as the dense emulation (float64 sums of one tile are exact for MX products;
the routing-gradient tile sum and the activations are float64 evaluations rounded to fp32, which
could differ from NumPy's in the last float64 ulp with probability ~2**-29 per element).

Dimensions:
    T: tokens, H: hidden, I: intermediate, E: experts, k: experts per token, B: block size.
    output_grad / hidden_states [T, H], topk_ids / topk_weights [T, k], gate_up_weight [E, 2I, H],
    down_weight [E, H, I], checkpoints [T, k, I].
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..emulate_numerics import (activation_fns32, clamp_and_mask, clamp_tuple, contract_matmul, linear_factor,
                               recompute_projection)
from .constants import BF16_K_TILE, BIAS_GRAD_K_TILE, MX_K_TILE, ROUTING_GRAD_TILE

__all__ = ["routing_grad", "bias_grad_fold", "moe_backward_emulate"]


def routing_grad(d_i: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """<dI, h> per row: fp32 products, float64 sum per ROUTING_GRAD_TILE columns rounded to fp32,
    fp32 accumulation across tiles (first tile overwrites).

    Dimensions:
        d_i [R, I] float32, h [R, I] bf16 -> [R] float32.
    """
    prod = d_i * h.to(torch.float32)
    acc = None
    for i0 in range(0, prod.shape[1], ROUTING_GRAD_TILE):
        part = prod[:, i0:i0 + ROUTING_GRAD_TILE].to(torch.float64).sum(dim=1).to(torch.float32)
        acc = part if acc is None else acc + part
    return acc


def bias_grad_fold(d_gu: torch.Tensor) -> torch.Tensor:
    """reference.reference_bias_grad_fold on one expert's rows: per tile of BIAS_GRAD_K_TILE consecutive rows
    (B is a multiple of it, so the tiles of the expert's blocks are its rows in runs of 128 from the first,
    the last zero-padded) the float64 column sum rounded to fp32, accumulated in fp32 from +0 in order.

    Dimensions:
        d_gu [R, 2I] bf16 (R > 0) -> [2I] float32.
    """
    r, two_i = d_gu.shape
    pad = -r % BIAS_GRAD_K_TILE
    tiles = F.pad(d_gu, (0, 0, 0, pad)).to(torch.float64).reshape(-1, BIAS_GRAD_K_TILE, two_i)
    parts = tiles.sum(dim=1).to(torch.float32)  # exact in float64 while a tile spans < 2^38: order-free
    acc = torch.zeros(two_i, dtype=torch.float32, device=d_gu.device)
    for part in parts:
        acc = acc + part
    return acc


def _fold_weight_grad(lhs: torch.Tensor, rhs: torch.Tensor, block_size: int, k_tile: int, mm) -> torch.Tensor:
    """fp32 fold over blocks (and K tiles inside a block) of mm(lhs_tile^T, rhs_tile), from +0.

    Dimensions:
        lhs [R, M], rhs [R, N] (R tokens of one expert, R > 0) -> [M, N] float32.
    """
    r = lhs.shape[0]
    pad = -r % block_size
    lhs, rhs = F.pad(lhs, (0, 0, 0, pad)), F.pad(rhs, (0, 0, 0, pad))  # zero padding rows of the last block
    acc = torch.zeros(lhs.shape[1], rhs.shape[1], dtype=torch.float32, device=lhs.device)
    for b0 in range(0, r + pad, block_size):
        for k0 in range(b0, b0 + block_size, k_tile):
            k1 = min(k0 + k_tile, b0 + block_size)
            acc.add_(mm(lhs[k0:k1].t(), rhs[k0:k1]))  # K = k1 - k0 tokens, M, N (a float32 add in place)
    return acc


def moe_backward_emulate(output_grad, hidden_states, topk_ids, topk_weights, gate_up_weight, down_weight,
                         gate_pre=None, gate_act=None, up=None, intermediate=None, *, block_size: int,
                         clamp_limits=None, fp8_dtype="float8_e4m3fn", quant_scheme="1x32", matmul_precision="mxfp8",
                         weight_grad_dtype=torch.bfloat16, scale_rule="neuron", bias_grad: bool = False,
                         gemm="exact"):
    """The MoE expert backward of docs/moe.md in torch ops (validated inputs assumed).

    Args:
        output_grad, hidden_states: dY, X [T, H] (rounded to bf16).
        topk_ids: [T, k] integer expert ids (in range, distinct per token).
        topk_weights: [T, k] routing weights (rounded to float32).
        gate_up_weight, down_weight: [E, 2I, H], [E, H, I] (rounded to bf16).
        gate_pre, gate_act, up, intermediate: optional [T, k, I] checkpoints.
        block_size: B of the kernel's layout (fixes the weight-gradient fold).
        clamp_limits, fp8_dtype, quant_scheme, matmul_precision, scale_rule: as in the dense emulation.
        weight_grad_dtype: torch.bfloat16 or torch.float32.
        bias_grad: also return d_gate_up_bias [E, 2I] float32: per expert the sum over its rows of the bf16
            d_gate_up (the pre-activation gradients the weight gradient folds) in the kernel's order
            (bias_grad_fold; the kernel's gate_up_bias_grad output, reference_bias_grad_fold).
        gemm: "exact" (bit-identical, default) or "fast" / "fp32" / "bf16": the MX matmuls as the dense
            emulation's fast GEMMs (backend "emulate_fast", not bit-exact; the routing-gradient and bias
            sums stay exact).

    Returns:
        (dx [T, H] bf16, d_topk_weights [T, k] float32, d_gate_up_weight [E, 2I, H],
        d_down_weight [E, H, I] in weight_grad_dtype[, d_gate_up_bias [E, 2I] float32]).
    """
    mm = functools.partial(contract_matmul, matmul_precision=matmul_precision, fp8_dtype=fp8_dtype,
                           quant_scheme=quant_scheme, scale_rule=scale_rule, gemm=gemm)
    k_tile = MX_K_TILE if matmul_precision == "mxfp8" else BF16_K_TILE
    gl, gu, ul, uu = clamp_tuple(clamp_limits)
    act_fn, act_dx_fn = activation_fns32(clamp_limits)
    bf, f32 = torch.bfloat16, torch.float32
    dy, x = output_grad.to(bf), hidden_states.to(bf)
    w_gu, w_down = gate_up_weight.to(bf), down_weight.to(bf)
    t, h_dim = x.shape
    k = topk_ids.shape[1]
    e_num, two_i, _ = w_gu.shape
    n_i = two_i // 2
    flat = topk_ids.reshape(-1).to(torch.int64)
    p_flat = topk_weights.reshape(-1).to(f32)
    ck_flat = [None if c is None else c.reshape(t * k, n_i).to(bf) for c in (gate_pre, gate_act, up, intermediate)]
    order = torch.argsort(flat, stable=True)  # slots grouped by expert, ascending token inside an expert
    counts = torch.bincount(flat, minlength=e_num).tolist()
    dx = torch.zeros(t, h_dim, dtype=bf, device=x.device)
    d_w = torch.zeros(t * k, dtype=f32, device=x.device)
    dw_gu = torch.zeros(e_num, two_i, h_dim, dtype=weight_grad_dtype, device=x.device)
    dw_down = torch.zeros(e_num, h_dim, n_i, dtype=weight_grad_dtype, device=x.device)
    d_bias = torch.zeros(e_num, two_i, dtype=f32, device=x.device)
    start = 0
    for e in range(e_num):  # ascending expert = the kernel's block order
        slots = order[start:start + counts[e]]
        start += counts[e]
        if slots.numel() == 0:
            continue  # empty expert: exact zero weight gradients, no dX contribution
        tok = slots // k
        x_e, dy_e, p = x[tok], dy[tok], p_flat[slots][:, None]
        g_pre, g_act, u, h = (None if c is None else c[slots] for c in ck_flat)
        if g_pre is None:
            g_pre = recompute_projection(x_e, w_gu[e, :n_i], **mm.keywords)  # K = H, M = R, N = I
        if u is None:
            u = recompute_projection(x_e, w_gu[e, n_i:], **mm.keywords)  # K = H, M = R, N = I
        gc, mask_g = clamp_and_mask(g_pre.to(f32), gl, gu)
        uc, mask_u = clamp_and_mask(u.to(f32), ul, uu)
        uc = linear_factor(uc, clamp_limits)
        g_act = act_fn(gc).to(bf) if g_act is None else g_act
        a = g_act.to(f32)
        h = (a * uc).to(bf) if h is None else h
        d_i = mm(dy_e, w_down[e])  # [R, I]: K = H, M = R, N = I
        d_w[slots] = routing_grad(d_i, h)
        dh = d_i * p
        d_up = ((dh * a) * mask_u).to(bf)
        d_gate = (((dh * uc) * act_dx_fn(gc)) * mask_g).to(bf)
        d_gu = torch.cat([d_gate, d_up], dim=1)  # [R, 2I]
        if bias_grad:
            d_bias[e] = bias_grad_fold(d_gu)
        hs = (h.to(f32) * p).to(bf)
        part = mm(d_gu, w_gu[e]).to(bf)  # [R, H]: K = 2I, M = R, N = H
        dx[tok] = (dx[tok].to(f32) + part.to(f32)).to(bf)  # the bf16 read-modify-write
        dw_gu[e] = _fold_weight_grad(d_gu, x_e, block_size, k_tile, mm).to(weight_grad_dtype)  # K=tokens, M=2I, N=H
        dw_down[e] = _fold_weight_grad(dy_e, hs, block_size, k_tile, mm).to(weight_grad_dtype)  # K=tokens, M=H, N=I
    return (dx, d_w.reshape(t, k), dw_gu, dw_down) + ((d_bias,) if bias_grad else ())
