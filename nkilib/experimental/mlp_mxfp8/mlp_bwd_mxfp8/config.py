"""Immutable configuration and operand descriptors of the MLP backward kernels.

Nothing here is mutated after construction: resolution functions return new objects.

The config objects (ClampLimits, MatmulConfig, MlpBwdMatmulConfig) check their fields when constructed,
which users do on the host before the launch: a bad field raises nkilib.core.options.OptionError (a
ValueError). Inside the traced kernel they are only built from values already checked with kernel_assert
(AssertionError), so those raises cannot fire there; the resolve_* functions run in the traced body and use
kernel_assert (docs/kernel-structure.md, "raising exceptions").
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import nki.isa as nisa
import nki.language as nl

from ....core.kernel_helpers import kernel_assert
from ....core.matmul.descriptor import MatmulSetup
from ....core.matmul.descriptor import TensorDescriptor  # noqa: F401  (re-exported: the kernel's public name)
from ....core.options import clamp_values, host_fail, kernel_numerics
from .constants import (M_TILE, MX_K_TILE, MX_N_TILE, MX_N_TILE_RECOMPUTE, MX_N_TILE_WEIGHT_GRAD, N_TILE,
                        PSUM_BANK_BYTES, PSUM_BUFFERS, PSUM_BYTES, TRANSPOSE_PSUM_BANKS,
                        WEIGHT_GRAD_WIDE_MIN_K_TILES_AFTER_I_SPLIT)

N_TILE_MAX = 4096  # nc_matmul(_mx) moving limit for an fp32 PSUM dst on trn3 (docs/simulator.md#choice-mx-moving-limit)


@dataclass(frozen=True)
class ClampLimits(nl.NKIObject):
    """The gated function of the SwiGLU forward: its clamps (as in GPT-OSS), mirrored by the backward masks,
    and its activation.

    The forward computed `gate_act = silu(clamp(gate_pre, non_linear_lower, non_linear_upper))` and
    `intermediate = gate_act * clamp(up, linear_lower, linear_upper)`; the backward masks the gate
    gradient where gate_pre lies outside [non_linear_lower, non_linear_upper] and the up gradient
    where up lies outside [linear_lower, linear_upper] (bounds inclusive, like torch.clamp's gradient).
    Limits are compared in float32 against `float32(limit)`, so the mask agrees with the clamp exactly
    even when a limit is not representable in bf16. Any bound may be None (no bound).

    activation (nkilib.core.options.ACTIVATIONS): "silu" (default, as above) or "gpt_oss", GPT-OSS's experts:
    `gate_act = gc * sigmoid(1.702 * gc)` (ScalarE's gelu_apprx_sigmoid) and
    `intermediate = gate_act * (clamp(up) + 1)`; GPT-OSS clamps the gate from above only and up on both sides:
    `ClampLimits(non_linear_upper=limit, linear_lower=-limit, linear_upper=limit, activation="gpt_oss")`.
    """

    non_linear_lower: float | None = None
    non_linear_upper: float | None = None
    linear_lower: float | None = None
    linear_upper: float | None = None
    activation: str = "silu"

    def __post_init__(self):
        clamp_values(self, what="ClampLimits")  # the one clamp validation (nkilib.core.options)

    @property
    def has_gate_clamp(self) -> bool:
        return self.non_linear_lower != None or self.non_linear_upper != None  # noqa: E711

    @property
    def has_up_clamp(self) -> bool:
        return self.linear_lower != None or self.linear_upper != None  # noqa: E711


@dataclass(frozen=True)
class MatmulConfig(nl.NKIObject):
    """Output tiling of one phase's matmuls: [m_tile, n_tile] output tiles per PSUM accumulation group."""

    m_tile: int = M_TILE
    n_tile: int = N_TILE

    def __post_init__(self):
        if not (_is_int(self.m_tile) and 2 <= self.m_tile <= M_TILE and self.m_tile % 2 == 0):
            host_fail(f"MatmulConfig.m_tile must be an even int in [2, {M_TILE}], got {self.m_tile!r}")
        if not (_is_int(self.n_tile) and 1 <= self.n_tile <= N_TILE_MAX):
            host_fail(f"MatmulConfig.n_tile must be an int in [1, {N_TILE_MAX}], got {self.n_tile!r}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class MlpBwdMatmulConfig(nl.NKIObject):
    """Per-phase matmul configs (phase 1 also covers the phase-0 recompute it fuses); None = auto."""

    phase1: MatmulConfig | None = None
    phase2: MatmulConfig | None = None
    phase3: MatmulConfig | None = None
    phase4: MatmulConfig | None = None

    def __post_init__(self):
        for name in PHASES:
            v = getattr(self, name)
            if v != None and not isinstance(v, MatmulConfig):  # noqa: E711
                host_fail(f"MlpBwdMatmulConfig.{name} must be a MatmulConfig or None, got {v!r}")


PHASES = ("phase1", "phase2", "phase3", "phase4")


def psum_banks(n_tile: int) -> int:
    """PSUM banks (2 KiB per partition) of one fp32 accumulator [128, n_tile]: allocations take whole banks."""
    return -(-n_tile * 4 // PSUM_BANK_BYTES)


def max_n_tile(accumulators: int, transposes: bool) -> int:
    """Widest n_tile whose accumulators fit PSUM: `accumulators` x PSUM_BUFFERS accumulators of whole
    banks, plus TRANSPOSE_PSUM_BANKS when the phase transposes operands on the PE array."""
    free = PSUM_BYTES // PSUM_BANK_BYTES - (TRANSPOSE_PSUM_BANKS if transposes else 0)
    return free // (accumulators * PSUM_BUFFERS) * (PSUM_BANK_BYTES // 4)


def default_matmul_config(mx: bool, recompute: bool) -> MlpBwdMatmulConfig:
    """Tiling by precision: MXFP8 (trn3) uses 1024-wide moving tiles (512 in phase 1 when it also
    recomputes gate_pre/up: three double-buffered PSUM accumulators must fit 16 KiB); BF16 keeps
    512 (the trn2 nc_matmul limit, one PSUM bank)."""
    wide = MatmulConfig(n_tile=MX_N_TILE) if mx else MatmulConfig()
    first = MatmulConfig(n_tile=MX_N_TILE_RECOMPUTE) if (mx and recompute) else wide
    wider = MatmulConfig(n_tile=MX_N_TILE_WEIGHT_GRAD) if mx else wide
    return MlpBwdMatmulConfig(first, wide, wider, wider)


def resolve_matmul_config(config, mx: bool, recompute: bool, n_max: int,
                          transposes=(True, True, False, False)) -> MlpBwdMatmulConfig:
    """A concrete per-phase config (returns a new object; never mutates `config`).

    None -> default_matmul_config; a MatmulConfig -> used for every phase; an MlpBwdMatmulConfig ->
    its None phases filled with the defaults. Every n_tile must fit the target's moving limit n_max and
    PSUM (max_n_tile: phase 1 holds 3 accumulators when it recomputes gate_pre/up, else 1; every phase
    double-buffers them; `transposes[i]`: phase i+1 also transposes on the PE array). A default that
    does not fit is narrowed; a value the caller gave raises, naming matmul_config.
    """
    default = default_matmul_config(mx, recompute)
    if config == None:  # noqa: E711
        chosen = MlpBwdMatmulConfig()
    elif isinstance(config, MatmulConfig):
        chosen = MlpBwdMatmulConfig(config, config, config, config)
    elif isinstance(config, MlpBwdMatmulConfig):
        chosen = config
    else:
        kernel_assert(False, f"matmul_config must be None, MatmulConfig or MlpBwdMatmulConfig, got {config!r}")
    resolved = []
    for i, name in enumerate(PHASES):
        accumulators = 3 if (name == "phase1" and recompute) else 1
        limit = min(n_max, max_n_tile(accumulators, transposes[i]))
        given = getattr(chosen, name)
        if given == None:  # noqa: E711
            d = getattr(default, name)
            resolved.append(d if d.n_tile <= limit else dataclasses.replace(d, n_tile=limit))
            continue
        kernel_assert(given.n_tile <= n_max,
                      f"matmul_config.{name}.n_tile={given.n_tile} exceeds this target's matmul moving limit {n_max}")
        if given.n_tile > limit:
            why = (f"{accumulators} accumulator(s) x {PSUM_BUFFERS} buffers x {psum_banks(given.n_tile)} PSUM banks"
                   + (f" + {TRANSPOSE_PSUM_BANKS} banks of PE transposes" if transposes[i] else "")
                   + f" exceed the {PSUM_BYTES // PSUM_BANK_BYTES} PSUM banks")
            kernel_assert(False, f"matmul_config.{name}.n_tile={given.n_tile} does not fit PSUM ({why}"
                                 f"{', phase 1 recomputing gate_pre/up' if accumulators > 1 else ''}): "
                                 f"at most {limit} here")
        resolved.append(given)
    return MlpBwdMatmulConfig(*resolved)


def fit_weight_grad_n_tile(config: MlpBwdMatmulConfig, split_along_i: bool, S: int) -> MlpBwdMatmulConfig:
    """The PSUM fit check of phases 3-4 once phase 1's split is chosen (returns a new object, or `config`).

    Where phase 1 splits along I and phases 3-4 contract over fewer than WEIGHT_GRAD_WIDE_MIN_K_TILES_AFTER_I_SPLIT
    K tiles (K = S), their accumulators wider than MX_N_TILE find no PSUM placement (constants.py): both phases are
    narrowed to MX_N_TILE. Elsewhere, and where they are no wider already, `config` is returned unchanged.

    Args:
        config: the resolved per-phase config (resolve_matmul_config).
        split_along_i: phase 1 splits I across the cores (phase1_split_along_i taken).
        S: the sequence length, phases 3-4's K.
    """
    k_tiles = -(-S // MX_K_TILE)
    if not split_along_i or k_tiles >= WEIGHT_GRAD_WIDE_MIN_K_TILES_AFTER_I_SPLIT:
        return config
    narrowed = [dataclasses.replace(c, n_tile=MX_N_TILE) if c.n_tile > MX_N_TILE else c
                for c in (config.phase3, config.phase4)]
    return MlpBwdMatmulConfig(config.phase1, config.phase2, *narrowed)


def resolve_kernel_options(matmul_precision, fp8_x4_dtype, quant_scheme, use_scale_packing, weight_grad_dtype,
                           run_with_lnc2, clamp_limits) -> tuple:
    """The numeric and launch options of a kernel entry point (the dense MLP and the MoE backward), checked once.

    Returns (MatmulSetup, weight-gradient dtype nl.bfloat16 / nl.float32, on_trn3). Precision, fp8 format,
    quant scheme and weight-grad dtype go through nkilib.core.options.kernel_numerics (messages shared with the
    references and the torch layers); on_trn3: the target is NeuronCore-v4 (nc_version compared with ==,
    enums support equality only).
    """
    on_trn3 = nisa.get_nc_version() == nisa.nc_version.gen4
    precision, wg_name = kernel_numerics(matmul_precision, on_trn3, fp8_x4_dtype, quant_scheme, weight_grad_dtype)
    kernel_assert(isinstance(run_with_lnc2, bool), f"run_with_lnc2 must be a bool, got {run_with_lnc2!r}")
    kernel_assert(isinstance(use_scale_packing, bool), f"use_scale_packing must be a bool, got {use_scale_packing!r}")
    kernel_assert(clamp_limits == None or isinstance(clamp_limits, ClampLimits),  # noqa: E711
                  f"clamp_limits must be a ClampLimits or None, got {clamp_limits!r}")
    wg_dtype = nl.float32 if wg_name == "float32" else nl.bfloat16
    return MatmulSetup(precision, fp8_x4_dtype, quant_scheme, use_scale_packing), wg_dtype, on_trn3
