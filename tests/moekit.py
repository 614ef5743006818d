"""MoE test helpers shared by the routing, reference, torch and kernel tests (import as `from moekit import ...`).

Adversarial routings: each case is (T, k, E, generator); generators return int32 topk_ids [T, k].
"""
from __future__ import annotations

import numpy as np

from simkit import BF16


def _distinct_rows(rng, t, k, experts):
    experts = np.asarray(experts)
    return np.stack([rng.permutation(experts)[:k] for _ in range(t)]).astype(np.int32)


def _skewed(rng, t, k, e):
    # every token picks expert 0 first (a hot expert); the rest uniformly among the others
    rest = np.stack([rng.permutation(np.arange(1, e))[:k - 1] for _ in range(t)])
    return np.concatenate([np.zeros((t, 1), np.int64), rest], axis=1).astype(np.int32)


#: name -> (T, k, E, generator(rng, T, k, E) -> topk_ids [T, k] int32)
ROUTINGS = {
    "random": (45, 2, 6, lambda r, t, k, e: _distinct_rows(r, t, k, np.arange(e))),
    "empty_experts": (40, 2, 6, lambda r, t, k, e: _distinct_rows(r, t, k, [0, 3, 5])),
    "all_to_one": (150, 1, 4, lambda r, t, k, e: np.full((t, k), 2, np.int32)),
    "k_equals_e": (37, 3, 3, lambda r, t, k, e: _distinct_rows(r, t, k, np.arange(e))),
    "k1": (50, 1, 4, lambda r, t, k, e: _distinct_rows(r, t, k, np.arange(e))),
    "k8": (20, 8, 10, lambda r, t, k, e: _distinct_rows(r, t, k, np.arange(e))),
    "skewed": (131, 2, 4, _skewed),
}


def make_routing(name: str, seed: int = 0):
    """(topk_ids [T, k] int32, num_experts) of an adversarial routing case (rows unsorted)."""
    t, k, e, gen = ROUTINGS[name]
    return gen(np.random.default_rng(seed), t, k, e), e


def expert_routing(counts, experts=None, shuffle_seed=None) -> np.ndarray:
    """topk_ids [T, 1] int32 (k = 1) with counts[i] tokens routed to experts[i], T = sum(counts).

    experts defaults to 0, 1, ...; shuffle_seed (a seed or a Generator) draws the token order as one permutation
    of the expert-sorted rows; None keeps the rows sorted by expert.
    """
    experts = np.arange(len(counts)) if experts is None else np.asarray(experts)
    if len(experts) != len(counts):
        raise ValueError(f"experts has {len(experts)} entries, counts {len(counts)}: expected one count per expert")
    ids = np.repeat(experts.astype(np.int32), counts)[:, None]
    if shuffle_seed is None:
        return ids
    return ids[np.random.default_rng(shuffle_seed).permutation(ids.shape[0])]


def core_of_self(self, *args, **kwargs) -> int:
    """The LNC core of a call of a kernel object's method (its self.ctx.split): simkit.spy_per_core's `core`."""
    return self.ctx.split.shard_id


def core_of_ctx(ctx, *args, **kwargs) -> int:
    """The LNC core of a call of a kernel function taking the kernel context first: simkit.spy_per_core's `core`."""
    return ctx.split.shard_id


def moe_inputs(topk_ids: np.ndarray, num_experts: int, H: int = 64, I: int = 32, seed: int = 0) -> dict:
    """Unit-scale bf16 inputs of the MoE backward for a routing (weights scaled like nn.Linear's)."""
    rng = np.random.default_rng(seed)
    t, k = topk_ids.shape
    bf = lambda a: a.astype(np.float32).astype(BF16)  # noqa: E731
    return dict(
        output_grad=bf(rng.standard_normal((t, H))),
        hidden_states=bf(rng.standard_normal((t, H))),
        topk_weights=rng.uniform(0.1, 1.0, (t, k)).astype(np.float32),
        gate_up_weight=bf(rng.standard_normal((num_experts, 2 * I, H)) / np.sqrt(H)),
        down_weight=bf(rng.standard_normal((num_experts, H, I)) / np.sqrt(I)),
    )


def dedupe_repeats(seq):
    """seq without immediate repeats (per-core event logs: an expert's blocks, a block's I tiles or chunks record one
    event each)."""
    out = []
    for ev in seq:
        if not out or out[-1] != ev:
            out.append(ev)
    return out
