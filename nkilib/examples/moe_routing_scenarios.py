"""Routings for the MoE backward study: exactly balanced, and Zipf-skewed (seeded).

Dimensions:
    T tokens, k experts per token (distinct), E experts; topk_ids [T, k] int32.
"""
from __future__ import annotations

import numpy as np

__all__ = ["ROUTINGS", "balanced_topk_ids", "expert_token_counts", "make_topk_ids", "zipf_topk_ids"]

#: Zipf exponent of the skewed routing: expert popularity ∝ 1 / rank**s. s = 1 is the classic Zipf law;
#: with k distinct experts per token it gives the most popular experts several times the mean load.
DEFAULT_ZIPF_EXPONENT = 1.0


def _check(tokens, top_k, num_experts):
    for name, v in (("tokens", tokens), ("top_k", top_k), ("num_experts", num_experts)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if top_k > num_experts:
        raise ValueError(f"top_k={top_k} must be <= num_experts={num_experts} (a token's experts are distinct)")


def balanced_topk_ids(tokens: int, top_k: int, num_experts: int) -> np.ndarray:
    """[T, k] int32: slot s = t*k + j goes to expert s mod E.

    A token's k consecutive slots hit k distinct experts (k <= E), and every expert receives
    floor(T*k / E) or ceil(T*k / E) slots (exactly T*k / E when E divides T*k).
    """
    _check(tokens, top_k, num_experts)
    slots = np.arange(tokens * top_k, dtype=np.int64).reshape(tokens, top_k)
    return (slots % num_experts).astype(np.int32)


def zipf_topk_ids(tokens: int, top_k: int, num_experts: int, exponent: float = DEFAULT_ZIPF_EXPONENT,
                  seed: int = 0) -> np.ndarray:
    """[T, k] int32: each token draws k distinct experts without replacement, with probability ∝ the
    Zipf popularity 1 / rank**exponent (ranks assigned to experts by a seeded permutation).

    Sampling without replacement is the Gumbel-top-k trick (k largest of log p + Gumbel noise), which
    equals sequential draws renormalised after each pick. Same (T, k, E, exponent, seed) -> same ids.
    """
    _check(tokens, top_k, num_experts)
    if not np.isfinite(exponent) or exponent < 0:
        raise ValueError(f"exponent must be a finite number >= 0, got {exponent!r}")
    rng = np.random.default_rng(seed)
    rank = rng.permutation(num_experts) + 1
    log_p = -float(exponent) * np.log(rank.astype(np.float64))
    keys = log_p[None, :] + rng.gumbel(size=(tokens, num_experts))
    ids = np.argpartition(-keys, top_k - 1, axis=1)[:, :top_k]
    return ids.astype(np.int32)


def expert_token_counts(topk_ids: np.ndarray, num_experts: int) -> np.ndarray:
    """[E] routed (token, expert) pairs per expert."""
    return np.bincount(np.asarray(topk_ids).reshape(-1), minlength=num_experts)


ROUTINGS = ("balanced", "zipf")


def make_topk_ids(routing: str, tokens: int, top_k: int, num_experts: int, seed: int = 0,
                  zipf_exponent: float = DEFAULT_ZIPF_EXPONENT) -> np.ndarray:
    """The study's routing by name: "balanced" or "zipf"."""
    if routing == "balanced":
        return balanced_topk_ids(tokens, top_k, num_experts)
    if routing == "zipf":
        return zipf_topk_ids(tokens, top_k, num_experts, zipf_exponent, seed)
    raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
