"""Helpers shared by the torch tests (import after ``pytest.importorskip("torch")``)."""
import torch


def rel(a, b) -> float:
    """Relative Frobenius error ||a - b|| / ||b||, computed in float64 on detached tensors."""
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm()).item()


def logits_and_grads(model, ids):
    """One forward / backward of a causal LM on token ids with loss mean(logits^2): (logits, {name: grad})."""
    logits = model(ids).logits
    logits.float().pow(2).mean().backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters()}
