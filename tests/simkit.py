"""Test helpers shared by all test files (import as `from simkit import ...`)."""
from __future__ import annotations

import ml_dtypes
import numpy as np

import nki

BF16 = ml_dtypes.bfloat16


def simulate(kernel, lnc=1, **inputs):
    """Run a kernel the official way: nki.simulate(kernel)[lnc](**inputs)."""
    return nki.simulate(kernel)[lnc](**inputs)


def rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def randn(seed: int, shape, dtype=np.float32, scale=1.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32).astype(dtype)
