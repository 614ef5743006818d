"""Sizes a MatmulPlan takes from its budgets: the widest panel width whose K tiles fit an SBUF budget (fit_width)
and the plan's fp32 PSUM accumulators (psum_buffers)."""
from __future__ import annotations

import nki.language as nl

from .constants import PARTITIONS, PSUM_BUFFERS
from .panels import panel_bytes_per_partition


def fit_width(requested, ops, setup, budget, quantum):
    """Largest width <= requested (a multiple of `quantum`, at least one quantum) whose panels of all
    `ops` (every K tile) fit `budget` SBUF bytes per partition. Large K (e.g. 2I = 24576) narrows the
    tiles instead of overflowing SBUF."""
    per_column = sum(panel_bytes_per_partition(op.k_size, quantum, setup) for op in ops) / quantum
    fitting = int(budget // per_column) // quantum * quantum
    return max(quantum, min(requested, fitting))


def psum_buffers(n_tile, count=PSUM_BUFFERS):
    """`count` (default PSUM_BUFFERS) fp32 accumulators [128, n_tile], used round-robin across output tiles."""
    return [nl.ndarray((PARTITIONS, n_tile), dtype=nl.float32, buffer=nl.psum) for _ in range(count)]
