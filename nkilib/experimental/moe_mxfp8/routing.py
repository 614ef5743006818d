"""Run-time routing -> the static-capacity block layout the MoE expert kernel consumes (NumPy).

The layout follows the conventions of AWS's blockwise MoE kernels (API pages, e.g.
https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.0/nki/library/api/blockwise-mm-backward-mxfp8.html,
https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.0/nki/library/api/moe-cte.html): routed tokens
are sorted by expert into fixed blocks of B positions, each block owned by one expert; the number of
blocks N (capacity) is static, the assignment is data. docs/moe.md describes every field.

Dimensions:
    T: tokens, k: experts per token, E: experts, B: block size, N: capacity in blocks.
    topk_ids [T, k] (int32 / int64), slot s = t * k + j (row-major position in topk_ids).
    token_position_to_id [N*B], token_position_to_slot [N*B], block_to_expert [N],
    expert_block_offsets [E+1] (all int32).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .constants import BLOCK_ALIGN, DEFAULT_BLOCK_SIZE, MAX_BLOCK_SIZE, TOPK_ID_DTYPES

__all__ = ["BlockLayout", "build_block_layout", "capacity_blocks", "check_block_size", "validate_topk_ids",
           "validate_topk_weights"]


class BlockLayout(NamedTuple):
    """Block layout of one routing (all index arrays int32).

    Attributes:
        token_position_to_id: [N*B] token id of each block position; padding = T (one past the last
            row of x / dY / dX, so an indirect DMA with oob_mode.skip leaves the row alone).
        token_position_to_slot: [N*B] slot t*k + j of each position (indexes topk_weights,
            d_topk_weights and the [T, k, I] checkpoints flattened to [T*k, ...]); padding = T*k.
        block_to_expert: [N] expert owning each block; blocks past the used ones hold E.
        expert_block_offsets: [E+1] expert e owns blocks [offsets[e], offsets[e+1]); offsets[E] is
            the number of used blocks (the trip count of the kernel's block loops).
        num_tokens: T.
        top_k: k.
        num_experts: E.
        block_size: B.
    """

    token_position_to_id: np.ndarray
    token_position_to_slot: np.ndarray
    block_to_expert: np.ndarray
    expert_block_offsets: np.ndarray
    num_tokens: int
    top_k: int
    num_experts: int
    block_size: int

    @property
    def capacity(self) -> int:
        """N, the static number of blocks."""
        return int(self.block_to_expert.shape[0])

    @property
    def num_used_blocks(self) -> int:
        return int(self.expert_block_offsets[-1])


def _positive_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
        raise ValueError(f"{name} must be a positive integer, got {v!r}")
    return int(v)


def check_block_size(block_size) -> int:
    """B must be a positive multiple of 128 and at most 512 (constants.py says why)."""
    b = _positive_int("block_size", block_size)
    if b % BLOCK_ALIGN or b > MAX_BLOCK_SIZE:
        raise ValueError(f"block_size must be a multiple of {BLOCK_ALIGN} in [{BLOCK_ALIGN}, {MAX_BLOCK_SIZE}], "
                         f"got {block_size}")
    return b


def validate_topk_ids(topk_ids, num_experts, name: str = "topk_ids") -> np.ndarray:
    """Checks a routing and returns it as int64 [T, k].

    Args:
        topk_ids: [T, k] numpy array of int32 or int64 expert ids.
        num_experts: E.
        name: the argument name used in error messages.

    Raises:
        TypeError: not an int32 / int64 array.
        ValueError: not 2-D, empty, k > E, an id out of [0, E), or an id repeated within a token.
    """
    e = _positive_int("num_experts", num_experts)
    if not isinstance(topk_ids, np.ndarray):
        raise TypeError(f"{name} must be a numpy array of {TOPK_ID_DTYPES}, got {type(topk_ids).__name__}")
    if topk_ids.dtype.name not in TOPK_ID_DTYPES:
        raise TypeError(f"{name} must have dtype int32 or int64, got {topk_ids.dtype}")
    if topk_ids.ndim != 2 or 0 in topk_ids.shape:
        raise ValueError(f"{name} must be a non-empty [T, k] array, got shape {topk_ids.shape}")
    k = topk_ids.shape[1]
    if k > e:
        raise ValueError(f"{name} has k={k} experts per token but num_experts={e}: k must be <= E "
                         f"(a token's experts are distinct)")
    ids = topk_ids.astype(np.int64)
    bad = np.argwhere((ids < 0) | (ids >= e))
    if bad.size:
        t, j = (int(v) for v in bad[0])
        kind = "negative" if ids[t, j] < 0 else "out of range"
        raise ValueError(f"{name}[{t}, {j}] = {ids[t, j]} is {kind}: expert ids must be in [0, {e}) "
                         f"(num_experts={e}); {len(bad)} bad id(s) in total")
    srt = np.sort(ids, axis=1)
    dup = np.argwhere(srt[:, 1:] == srt[:, :-1])
    if dup.size:
        t = int(dup[0, 0])
        val = int(srt[t, dup[0, 1]])
        cols = [int(c) for c in np.flatnonzero(ids[t] == val)]
        raise ValueError(f"{name}[{t}] = {ids[t].tolist()} repeats expert {val} (positions {cols}): a token's k "
                         f"expert ids must be distinct")
    return ids


def validate_topk_weights(topk_weights, shape, name: str = "topk_weights") -> np.ndarray:
    """Checks routing weights ([T, k], finite floats) and returns them as float32 (the kernel's dtype).

    Raises:
        TypeError: not a floating array.
        ValueError: wrong shape, or a NaN / Inf weight (named by position).
    """
    w = np.asarray(topk_weights)
    if w.dtype.kind != "f" and w.dtype.name != "bfloat16":
        raise TypeError(f"{name} must be a floating-point array, got dtype {w.dtype}")
    if tuple(w.shape) != tuple(shape):
        raise ValueError(f"{name} must have the shape of topk_ids {tuple(shape)}, got {tuple(w.shape)}")
    w32 = w.astype(np.float32)
    bad = np.argwhere(~np.isfinite(w32))
    if bad.size:
        t, j = (int(v) for v in bad[0])
        raise ValueError(f"{name}[{t}, {j}] = {w32[t, j]} is not finite (routing weights must be finite; "
                         f"values that overflow float32 count as infinite)")
    return w32


def capacity_blocks(num_tokens, top_k, num_experts, block_size) -> int:
    """Smallest static N that holds every routing of (T, k, E) in blocks of B.

    With m = min(E, T*k) non-empty experts at most, sum_e ceil(c_e / B) <= (T*k - m) // B + m
    (a non-empty expert with c tokens needs ceil(c / B) <= (c - 1) // B + 1 blocks; the bound grows
    with the number of non-empty experts and is reached when m - 1 experts get one token each).
    """
    t = _positive_int("num_tokens", num_tokens)
    k = _positive_int("top_k", top_k)
    e = _positive_int("num_experts", num_experts)
    b = check_block_size(block_size)
    m = min(e, t * k)
    return (t * k - m) // b + m


def build_block_layout(topk_ids, num_experts, block_size=DEFAULT_BLOCK_SIZE, capacity=None) -> BlockLayout:
    """Sorts the routed (token, expert) pairs by expert into blocks of B positions.

    Within an expert, positions follow ascending slot t*k + j (= ascending token id, since a token
    routes to an expert at most once); each expert's last block is padded with sentinels. Blocks are
    expert-major: expert e owns blocks [offsets[e], offsets[e+1]); an expert without tokens owns none.

    Args:
        topk_ids: [T, k] int32 / int64 expert ids (validated by ``validate_topk_ids``).
        num_experts: E.
        block_size: B (multiple of 128, at most 512).
        capacity: N; None = ``capacity_blocks(T, k, E, B)`` (enough for any routing).

    Returns:
        BlockLayout.

    Raises:
        ValueError: invalid ids (see validate_topk_ids), block size, or a capacity below the blocks
            this routing needs.
    """
    ids = validate_topk_ids(topk_ids, num_experts)
    b = check_block_size(block_size)
    t, k = ids.shape
    e = int(num_experts)
    flat = ids.reshape(-1)
    counts = np.bincount(flat, minlength=e)
    blocks = -(-counts // b)
    offsets = np.concatenate([[0], np.cumsum(blocks)]).astype(np.int64)
    used = int(offsets[-1])
    n = capacity_blocks(t, k, e, b) if capacity is None else _positive_int("capacity", capacity)
    if n < used:
        raise ValueError(f"capacity={n} blocks is too small: this routing needs {used} blocks of {b} "
                         f"(tokens per expert {counts.tolist()})")
    order = np.argsort(flat, kind="stable")  # slots grouped by expert, ascending within an expert
    sorted_e = flat[order]
    first_of_expert = np.concatenate([[0], np.cumsum(counts)[:-1]])
    rank = np.arange(t * k) - first_of_expert[sorted_e]
    pos = offsets[sorted_e] * b + rank
    to_slot = np.full(n * b, t * k, dtype=np.int64)
    to_slot[pos] = order
    to_id = np.where(to_slot < t * k, to_slot // k, t)
    block_to_expert = np.full(n, e, dtype=np.int64)
    block_to_expert[:used] = np.repeat(np.arange(e), blocks)
    i32 = np.int32
    return BlockLayout(to_id.astype(i32), to_slot.astype(i32), block_to_expert.astype(i32), offsets.astype(i32),
                       t, k, e, b)
