"""The tiny byte-level language models of simulations/mxfp8_convergence.py and their gradient SQNR probes.

Model: byte embedding + learned positions -> L pre-norm blocks (causal self-attention in fp32 torch,
then a feed-forward layer) -> final RMSNorm -> LM head over the 256 byte values. Feed-forward layers:
    DenseFFN  ``SwiGLUMLP(backend="emulate")``: the dense op (nkilib swiglu_mlp_mxfp8);
    MoEFFN    a softmax top-k router (nn.Linear, probabilities renormalised over the k chosen experts,
              Qwen3-MoE style) and ``MoESwiGLUExperts(backend="emulate")``: the MoE op
              (moe_swiglu_experts_mxfp8), with a Switch-Transformer load-balancing loss.
Parameters are fp32 (weight gradients leave the ops as fp32 accumulators); the FFN forwards are BF16.

Gradient SQNR (dB, 10 log10(|g_ref|^2 / |g - g_ref|^2)) of every FFN, on a fixed probe batch:
    local       the layer's backward with the run's numerics vs fp64 autograd of the same layer, at the
                same input (and, for MoE, the same routing) and the same output gradient dY:
                dX, dW_gate_up, dW_down (MoE also d_topk_weights);
    end_to_end  the FFN's parameter gradients (MoE: also the router's) of the whole model's backward vs
                the same model whose FFNs run in fp64 autograd (errors of later layers propagate).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from nkilib.experimental.mlp_mxfp8 import SwiGLUMLP, swiglu_mlp_mxfp8
from nkilib.experimental.moe_mxfp8 import MoESwiGLUExperts, moe_swiglu_experts_mxfp8


def sqnr_db(g, ref) -> float:
    err = float((g.double() - ref.double()).square().sum())
    sig = float(ref.double().square().sum())
    return float("inf") if err == 0 else 10.0 * math.log10(sig / err)


def ideal_mlp(x, gate_up_weight, down_weight):
    """The SwiGLU MLP in fp64 autograd (the reference backward).

    Dimensions:
        x [..., H], gate_up_weight [2I, H], down_weight [H, I] -> [..., H] in x's dtype.
    """
    n_i = down_weight.shape[1]
    x64, w64, d64 = x.double(), gate_up_weight.double(), down_weight.double()
    h = F.silu(x64 @ w64[:n_i].T) * (x64 @ w64[n_i:].T)  # K = H, M = tokens, N = I
    return (h @ d64.T).to(x.dtype)  # K = I, M = tokens, N = H


def ideal_moe(x, topk_ids, topk_weights, gate_up_weight, down_weight):
    """Routed SwiGLU experts in fp64 autograd (the reference backward, differentiable in topk_weights).

    Dimensions:
        x [T, H], topk_ids / topk_weights [T, k], gate_up_weight [E, 2I, H], down_weight [E, H, I] -> [T, H].
    """
    n_i = down_weight.shape[2]
    x64, p64, w64, d64 = x.double(), topk_weights.double(), gate_up_weight.double(), down_weight.double()
    y = torch.zeros_like(x64)
    for e in range(gate_up_weight.shape[0]):
        tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        xe = x64[tok]
        h = F.silu(xe @ w64[e, :n_i].T) * (xe @ w64[e, n_i:].T)  # K = H, M = tokens of e, N = I
        y = y.index_add(0, tok, (p64[tok, slot, None] * h) @ d64[e].T)  # K = I, M = tokens of e, N = H
    return y.to(x.dtype)


class DenseFFN(nn.Module):
    """SwiGLU MLP on the dense op; `reference` switches it to fp64 autograd, `capture` records x and dY."""

    kind = "dense"

    def __init__(self, d_model, d_ff, options):
        super().__init__()
        self.mlp = SwiGLUMLP(d_model, d_ff, backend="emulate", **options)
        self.options = options
        self.reference, self.capture = False, None

    def forward(self, h):
        if self.capture is not None:
            self.capture["x"] = h.detach().reshape(-1, h.shape[-1])
        y = ideal_mlp(h, self.mlp.gate_up_weight, self.mlp.down_weight) if self.reference else self.mlp(h)
        _record_dy(self.capture, y)
        return y

    def aux_loss(self):
        return None

    def weight_params(self) -> dict:
        return {"dW_gate_up": self.mlp.gate_up_weight, "dW_down": self.mlp.down_weight}

    def local_sqnr(self, cap) -> dict:
        operands = (cap["x"], self.mlp.gate_up_weight, self.mlp.down_weight)
        leaves = [t.detach().clone().requires_grad_() for t in operands]
        run = torch.autograd.grad(swiglu_mlp_mxfp8(*leaves, backend="emulate", **self.options), leaves, cap["dy"])
        leaves64 = [t.detach().double().requires_grad_() for t in leaves]
        ref = torch.autograd.grad(ideal_mlp(*leaves64), leaves64, cap["dy"].double())
        return {n: sqnr_db(g, r) for n, g, r in zip(("dX", "dW_gate_up", "dW_down"), run, ref)}


class MoEFFN(nn.Module):
    """Top-k routed SwiGLU experts on the MoE op (module docstring)."""

    kind = "moe"

    def __init__(self, d_model, d_expert, experts, top_k, options):
        super().__init__()
        self.router = nn.Linear(d_model, experts, bias=False)
        self.experts = MoESwiGLUExperts(experts, d_model, d_expert, backend="emulate", **options)
        self.top_k, self.options = top_k, options
        self.reference, self.capture = False, None
        self._aux = None

    def forward(self, h):
        shape = h.shape
        x = h.reshape(-1, shape[-1])
        probs = torch.softmax(self.router(x).float(), dim=-1)  # [T, E]
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        n_e = probs.shape[-1]
        share = torch.bincount(ids.reshape(-1), minlength=n_e).float() / ids.numel()
        self._aux = n_e * (share * probs.mean(0)).sum()  # Switch load balancing: 1 when uniform
        if self.capture is not None:
            self.capture.update(x=x.detach(), ids=ids.detach(), w=weights.detach())
        if self.reference:
            y = ideal_moe(x, ids, weights, self.experts.gate_up_weight, self.experts.down_weight)
        else:
            y = self.experts(x, ids, weights)
        _record_dy(self.capture, y)
        return y.reshape(shape)

    def aux_loss(self):
        return self._aux

    def weight_params(self) -> dict:
        return {"dW_gate_up": self.experts.gate_up_weight, "dW_down": self.experts.down_weight,
                "dW_router": self.router.weight}

    def local_sqnr(self, cap) -> dict:
        ids = cap["ids"]
        leaves = [t.detach().clone().requires_grad_() for t in (cap["x"], cap["w"], self.experts.gate_up_weight,
                                                                self.experts.down_weight)]
        x, w, w_gu, w_down = leaves
        y = moe_swiglu_experts_mxfp8(x, ids, w, w_gu, w_down, backend="emulate", **self.options)
        run = torch.autograd.grad(y, leaves, cap["dy"])
        leaves64 = [t.detach().double().requires_grad_() for t in leaves]
        x, w, w_gu, w_down = leaves64
        ref = torch.autograd.grad(ideal_moe(x, ids, w, w_gu, w_down), leaves64, cap["dy"].double())
        return {n: sqnr_db(g, r) for n, g, r in zip(("dX", "d_topk_weights", "dW_gate_up", "dW_down"), run, ref)}


def _record_dy(capture, y):
    if capture is not None and y.requires_grad:
        y.register_hook(lambda g: capture.__setitem__("dy", g.detach().reshape(-1, g.shape[-1])))


class Block(nn.Module):
    def __init__(self, d_model, heads, ffn):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.RMSNorm(d_model), nn.RMSNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)
        self.ffn = ffn

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.ffn(self.norm2(x))


class TinyLM(nn.Module):
    """Byte LM (module docstring). `moe`: None (every FFN dense) or dict(experts, top_k, d_expert,
    dense_layers): the first `dense_layers` FFNs dense, the others MoE."""

    def __init__(self, vocab, d_model, d_ff, layers, heads, seq, options, moe=None):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.zeros(seq, d_model))
        ffns = [DenseFFN(d_model, d_ff, options) if moe is None or i < moe["dense_layers"] else
                MoEFFN(d_model, moe["d_expert"], moe["experts"], moe["top_k"], options) for i in range(layers)]
        self.blocks = nn.ModuleList(Block(d_model, heads, f) for f in ffns)
        self.norm = nn.RMSNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))

    def ffns(self):
        return [blk.ffn for blk in self.blocks]

    def aux_loss(self):
        losses = [a for a in (f.aux_loss() for f in self.ffns()) if a is not None]
        return sum(losses) / len(losses) if losses else None


def lm_loss(model, tokens):
    """Mean next-byte cross-entropy (nats) of tokens [B, seq + 1]."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def gradient_sqnr(model, probe) -> list:
    """Per-layer local and end-to-end gradient SQNR of the run's FFN backward (module docstring)."""
    ffns = model.ffns()
    for f in ffns:
        f.capture = {}
    model.zero_grad(set_to_none=True)
    lm_loss(model, probe).backward()
    run = [{n: p.grad.clone() for n, p in f.weight_params().items()} for f in ffns]
    captured = [dict(f.capture) for f in ffns]
    for f in ffns:
        f.capture, f.reference = None, True
    model.zero_grad(set_to_none=True)
    lm_loss(model, probe).backward()
    ref = [{n: p.grad.clone() for n, p in f.weight_params().items()} for f in ffns]
    for f in ffns:
        f.reference = False
    model.zero_grad(set_to_none=True)
    return [{"layer": i, "kind": f.kind, "local": f.local_sqnr(cap),
             "end_to_end": {n: sqnr_db(run[i][n], ref[i][n]) for n in run[i]}}
            for i, (f, cap) in enumerate(zip(ffns, captured))]
