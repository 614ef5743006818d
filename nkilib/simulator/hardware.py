"""Hardware facts of the simulated targets, in one place.

Every number carries its source (tags refer to ../shared/nki-spec.md §0 and §6).
The cost model (cost.py) reads its engine numbers from here too.
"""
from __future__ import annotations

from dataclasses import dataclass

KIB = 1024


@dataclass(frozen=True)
class TargetSpec:
    """Static description of one NeuronCore generation."""

    name: str  # "trn2" / "trn3"
    nc_version: int  # nisa.nc_version value: 3 (NeuronCore-v3) / 4 (NeuronCore-v4)
    num_partitions: int
    sbuf_bytes_per_partition: int
    psum_bytes_per_partition: int
    psum_bank_bytes: int
    # nc_matmul / nc_matmul_mx moving free-size limits by dst dtype size (bytes -> elements)
    matmul_moving_fmax_fp32: int
    matmul_moving_fmax_bf16: int | None  # None: bf16 PSUM dst not supported
    has_mx: bool  # quantize_mx / nc_matmul_mx / float8_e4m3fn matmul input
    has_transpose_mode: bool  # nc_matmul is_transpose / double_row / core_barrier (v3+)
    # clocks (Hz) used by the cost model
    tensor_clock_hz: float
    vector_clock_hz: float
    scalar_clock_hz: float
    gpsimd_clock_hz: float
    hbm_bytes_per_s_per_chip: float
    dma_engines_per_core: int
    dma_bytes_per_s_per_engine: float


# NeuronCore-v3 (Trainium2). SBUF 128 x 224 KiB, PSUM 128 x 16 KiB = 8 banks x 2 KiB [TRN2] (spec §6.2).
# Matmul moving free <= 512 on v2/v3 = one fp32 PSUM bank; fp32 dst only (spec §5.3).
# TensorE 2.4 GHz; VectorE 0.96 GHz; ScalarE/GpSimd 1.2 GHz [TRN2] (spec §6.2).
# HBM 2.9 TB/s/chip ([CHIP2]; [TRN2] says 3.0; spec §10 Q17 — the lower figure is used);
# 16 DMA engines/core at 23 B/ns sustained each [DMABW].
TRN2 = TargetSpec(
    name="trn2",
    nc_version=3,
    num_partitions=128,
    sbuf_bytes_per_partition=224 * KIB,
    psum_bytes_per_partition=16 * KIB,
    psum_bank_bytes=2 * KIB,
    matmul_moving_fmax_fp32=512,
    matmul_moving_fmax_bf16=None,
    has_mx=False,
    has_transpose_mode=True,
    tensor_clock_hz=2.4e9,
    vector_clock_hz=0.96e9,
    scalar_clock_hz=1.2e9,
    gpsimd_clock_hz=1.2e9,
    hbm_bytes_per_s_per_chip=2.9e12,
    dma_engines_per_core=16,
    dma_bytes_per_s_per_engine=23e9,
)

# NeuronCore-v4 (Trainium3). SBUF 32 MiB -> 128 x 256 KiB (INFERRED by division, spec §6.2 / §10 Q17);
# PSUM same as v3. nc_matmul(_mx) moving free <= 4096 fp32 / 8192 bf16 dst (2.31+ docs, spec §5.2/§5.3,
# OPEN Q5: the larger limit is enforced). TensorE 2.4 GHz, VectorE/ScalarE/GpSimd 1.2 GHz [TRN3].
# HBM 4.7 TB/s ([TRN3]; [CHIP3] says 4.9 — the lower figure is used); 16 DMA engines at 33 B/ns [DMABW].
TRN3 = TargetSpec(
    name="trn3",
    nc_version=4,
    num_partitions=128,
    sbuf_bytes_per_partition=256 * KIB,
    psum_bytes_per_partition=16 * KIB,
    psum_bank_bytes=2 * KIB,
    matmul_moving_fmax_fp32=4096,
    matmul_moving_fmax_bf16=8192,
    has_mx=True,
    has_transpose_mode=True,
    tensor_clock_hz=2.4e9,
    vector_clock_hz=1.2e9,
    scalar_clock_hz=1.2e9,
    gpsimd_clock_hz=1.2e9,
    hbm_bytes_per_s_per_chip=4.7e12,
    dma_engines_per_core=16,
    dma_bytes_per_s_per_engine=33e9,
)

TARGETS = {"trn2": TRN2, "trn3": TRN3}

# Accepted spellings of NEURON_PLATFORM_TARGET_OVERRIDE / NKI_NC_VERSION (spec §1.4).
# trn1/inf2/gen2 exist in NKI but are not modelled here (this project targets Trn2/Trn3).
TARGET_ALIASES = {"trn2": "trn2", "gen3": "trn2", "trn3": "trn3", "gen4": "trn3"}


def resolve_target(name: str) -> TargetSpec:
    """Return the TargetSpec for a target name or alias ("trn2", "gen3", "trn3", "gen4")."""
    key = TARGET_ALIASES.get(str(name).strip().lower())
    if key is None:
        raise ValueError(
            f"unsupported Neuron target {name!r}: expected one of {sorted(TARGET_ALIASES)} "
            "(trn1/inf2 are not modelled by the nkilib simulator)"
        )
    return TARGETS[key]
