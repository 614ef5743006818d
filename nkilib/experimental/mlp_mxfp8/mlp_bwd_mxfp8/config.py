"""Immutable configuration and operand descriptors of the MLP backward kernels.

Nothing here is mutated after construction: resolution functions return new objects.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import nki.language as nl

from ....core.kernel_helpers import KernelInputError
from ....core.matmul.descriptor import TensorDescriptor  # noqa: F401  (re-exported: the kernel's public name)
from .constants import M_TILE, MX_N_TILE, MX_N_TILE_RECOMPUTE, MX_N_TILE_WEIGHT_GRAD, N_TILE

N_TILE_MAX = 4096  # nc_matmul(_mx) moving limit for an fp32 PSUM dst on trn3 (spec §5.2/§5.3)


@dataclass(frozen=True)
class ClampLimits(nl.NKIObject):
    """Forward clamps of a clamped SwiGLU (as in GPT-OSS), mirrored by the backward masks.

    The forward computed `gate_act = silu(clamp(gate_pre, non_linear_lower, non_linear_upper))` and
    `intermediate = gate_act * clamp(up, linear_lower, linear_upper)`; the backward masks the gate
    gradient where gate_pre lies outside [non_linear_lower, non_linear_upper] and the up gradient
    where up lies outside [linear_lower, linear_upper] (bounds inclusive, like torch.clamp's gradient).
    Limits are compared in float32 against `float32(limit)`, so the mask agrees with the clamp exactly
    even when a limit is not representable in bf16. Any bound may be None (no bound).
    """

    non_linear_lower: float | None = None
    non_linear_upper: float | None = None
    linear_lower: float | None = None
    linear_upper: float | None = None

    def __post_init__(self):
        for name in ("non_linear_lower", "non_linear_upper", "linear_lower", "linear_upper"):
            v = getattr(self, name)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise KernelInputError(f"ClampLimits.{name} must be a float or None, got {v!r}")
            if math.isnan(v):
                raise KernelInputError(f"ClampLimits.{name} must not be NaN")
        for side in ("non_linear", "linear"):
            lo, hi = getattr(self, f"{side}_lower"), getattr(self, f"{side}_upper")
            if lo is not None and hi is not None and not lo < hi:
                raise KernelInputError(
                    f"ClampLimits: {side}_lower ({lo}) must be smaller than {side}_upper ({hi})")

    @property
    def has_gate_clamp(self) -> bool:
        return self.non_linear_lower is not None or self.non_linear_upper is not None

    @property
    def has_up_clamp(self) -> bool:
        return self.linear_lower is not None or self.linear_upper is not None


@dataclass(frozen=True)
class MatmulConfig(nl.NKIObject):
    """Output tiling of one phase's matmuls: [m_tile, n_tile] output tiles per PSUM accumulation group."""

    m_tile: int = M_TILE
    n_tile: int = N_TILE

    def __post_init__(self):
        if not (isinstance(self.m_tile, int) and 2 <= self.m_tile <= M_TILE and self.m_tile % 2 == 0):
            raise KernelInputError(f"MatmulConfig.m_tile must be an even int in [2, {M_TILE}], got {self.m_tile!r}")
        if not (isinstance(self.n_tile, int) and 1 <= self.n_tile <= N_TILE_MAX):
            raise KernelInputError(f"MatmulConfig.n_tile must be an int in [1, {N_TILE_MAX}], got {self.n_tile!r}")


@dataclass(frozen=True)
class MlpBwdMatmulConfig(nl.NKIObject):
    """Per-phase matmul configs (phase 1 also covers the phase-0 recompute it fuses); None = auto."""

    phase1: MatmulConfig | None = None
    phase2: MatmulConfig | None = None
    phase3: MatmulConfig | None = None
    phase4: MatmulConfig | None = None


def default_matmul_config(mx: bool, recompute: bool) -> MlpBwdMatmulConfig:
    """Tiling by precision: MXFP8 (trn3) uses 1024-wide moving tiles (512 in phase 1 when it also
    recomputes gate_pre/up: three double-buffered PSUM accumulators must fit 16 KiB); BF16 keeps
    512 (the trn2 nc_matmul limit, one PSUM bank)."""
    wide = MatmulConfig(n_tile=MX_N_TILE) if mx else MatmulConfig()
    first = MatmulConfig(n_tile=MX_N_TILE_RECOMPUTE) if (mx and recompute) else wide
    wider = MatmulConfig(n_tile=MX_N_TILE_WEIGHT_GRAD) if mx else wide
    return MlpBwdMatmulConfig(first, wide, wider, wider)


def resolve_matmul_config(config, mx: bool, recompute: bool, n_max: int) -> MlpBwdMatmulConfig:
    """A concrete per-phase config (returns a new object; never mutates `config`).

    None -> default_matmul_config; a MatmulConfig -> used for every phase; an MlpBwdMatmulConfig ->
    its None phases filled with the defaults. Every n_tile must fit the target's moving limit n_max.
    """
    default = default_matmul_config(mx, recompute)
    if config is None:
        resolved = default
    elif isinstance(config, MatmulConfig):
        resolved = MlpBwdMatmulConfig(config, config, config, config)
    elif isinstance(config, MlpBwdMatmulConfig):
        resolved = MlpBwdMatmulConfig(*[getattr(config, f) or getattr(default, f)
                                        for f in ("phase1", "phase2", "phase3", "phase4")])
    else:
        raise KernelInputError(f"matmul_config must be None, MatmulConfig or MlpBwdMatmulConfig, got {config!r}")
    for name in ("phase1", "phase2", "phase3", "phase4"):
        n_tile = getattr(resolved, name).n_tile
        if n_tile > n_max:
            raise KernelInputError(
                f"matmul_config.{name}.n_tile={n_tile} exceeds this target's matmul moving limit {n_max}")
    return resolved
