"""Hardware facts of the simulated targets, in one place.

Every number carries its source as a tag; the tags are public Neuron documentation pages:

- [LEGACY] Beta-1 API pages with "Estimated instruction cost" formulas (the last to publish them; the same URL per
  instruction), e.g. https://awsdocs-neuron.readthedocs-hosted.com/en/v2.26.1/nki/api/generated/nki.isa.nc_matmul.html
- [MATMUL] https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.nc_matmul.html
- [MATMULMX] https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.nc_matmul_mx.html
- [QMX] https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.quantize_mx.html
- [DMAT] https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.dma_transpose.html
- [TRN1] Trainium/Inferentia2 architecture guide:
  https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/guides/architecture/trainium_inferentia2_arch.html
- [TRN2] Trainium2 architecture guide:
  https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/guides/architecture/trainium2_arch.html
- [TRN3] Trainium3 architecture guide:
  https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/guides/architecture/trainium3_arch.html
- [PERF] NKI performance guide:
  https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/deep-dives/nki_perf_guide.html
- [DMA] DMA overview:
  https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/get-started/about/nki-dma-overview.html
- [DMABW] DMA bandwidth guide:
  https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/deep-dives/nki-dma-bandwidth-guide.html
- [DGE] DGE reference: https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/deep-dives/nki-dge.html
- [CHIP2] / [CHIP3] Trainium2 / Trainium3 hardware pages:
  https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/about-neuron/arch/neuron-hardware/trainium2.html,
  .../trainium3.html
- [LNCdoc] Logical NeuronCore configuration (the one URL longer than a line):
  https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/about-neuron/arch/neuron-features/logical-neuroncore-config.html
- [STT07] NKI 0.7 (SDK 2.33) scalar_tensor_tensor, with reduce_res:
  https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.0/nki/api/generated/nki.isa.scalar_tensor_tensor.html
- [TSR07] NKI 0.7 (SDK 2.33) tensor_scalar_reduce:
  https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.0/nki/api/generated/nki.isa.tensor_scalar_reduce.html
- [SIM] NKI CPU simulator guide: https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/guides/nki_simulator.html

INFERRED marks a number we derived (the reasoning is given); ESTIMATE marks a number the docs do not
give, with the range we believe and why. The cost model (nkilib/simulator/cost/) reads its engine
numbers from here.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

KIB = 1024

# Fixed cost of one kernel call on the device (runtime launch, instruction fetch, final semaphore and
# completion wait), added to the modeled makespan. Not documented: CALIBRATED against the measured
# Trainium3 BF16 GEMM times (simulations/data/trn3_bf16_gemm_measured.json) by
# simulations/calibrate_bf16_gemm.py: median of (measured - modeled makespan, central estimate) over
# the 22 launch-dominated shapes (makespan < 40 us) = 13.4 us; the smallest GEMMs take >= 25 us
# although their data movement and compute model at ~10 us. The other 37 shapes are the holdout
# (their error is what the calibration script reports). See nkilib/simulator/cost "Calibration".
KERNEL_LAUNCH_OVERHEAD_S = 13.4e-6


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
    # ---- cost model (nkilib/simulator/cost); every value below carries its source where it is set: in
    # _SHARED_COST_MODEL (both targets) or at the TRN2/TRN3 definitions ----
    dma_theoretical_bytes_per_s_per_engine: float  # peak of one DMA engine (descriptor overhead excluded)
    dma_payload_full_rate_bytes: int  # contiguous bytes per descriptor at which an engine sustains its rate
    dma_partitions_per_engine: int  # a transfer is split over up to 16 engines, ~8 SBUF partitions each
    dma_queues_per_core: int  # DMA instructions in flight per core (FIFO queues)
    dma_fixed_latency_s: float  # per-DMA semaphore-to-start latency (no bandwidth used)
    dma_transpose_block_elems: int  # DMA transpose moves [16 x n] blocks: 16 elements per partition write
    hbm_stacks_per_chip: int  # an LNC2 core pair shares one stack (its bandwidth share)
    min_ii_cycles: int  # MIN_II of the documented ACT/DVE/Pool cost formulas
    matmul_min_cycles: int  # MM_INIT_LATENCY: TensorE initiation interval floor
    matmul_fp32_factor: int  # fp32/tf32 matmul passes
    matmul_stationary_load_speedup: int  # LoadStationary vs MultiplyMoving of equal free size
    engine_access_overhead_cycles: int  # fixed SBUF/PSUM access-initiation cost of an ACT/DVE/Pool instruction
    gpsimd_start_cycles: int  # GPSIMD_START of iota/affine_select
    vector_fast_modes: bool  # VectorE 2x/4x BF16 perf modes (NC-v3+)
    scalar_fast_modes: bool  # ScalarE 2x BF16 mode for tensor_copy/tensor_scalar (NC-v4)
    quantize_mx_elems_per_cycle: int  # quantize_mx input elements per partition per VectorE cycle
    barrier_latency_s: float  # core_barrier cost once both cores arrived (semaphore round trip through HBM)
    kernel_launch_overhead_s: float  # fixed per-kernel-call cost added to the makespan (CALIBRATED)
    # ---- charges that keep the model from flattering a kernel (issue 13); same on both targets unless
    # set there. Documented values carry their tag; ESTIMATE values give the range and the reasoning, and
    # PESSIMISTIC_OVERRIDES below holds the worst end used by `with_scenario(target, "pessimistic")`.
    scenario: str = "central"  # "central" / "pessimistic": which end of the ESTIMATE ranges is in use
    # Hardware DGE: "Each DGE-based DMA instruction takes about 600 ns to execute", two DGE instances per
    # core commanded by SyncE or ScalarE [TRN2], [DGE]; NC-v4 not restated (INFERRED same). Every DMA whose
    # dge_mode is hwdge or unknown (the compiler picks hwdge on v3+ when it can) occupies one instance for
    # that time before its transfer starts; dge_mode=none (host-built descriptors) does not. (One instance
    # at the pessimistic end was tried and rejected: it overshoots the measured small-N GEMMs by 2.6x.)
    dge_instruction_s: float = 600e-9
    dge_instances_per_core: int = 2
    # quantize_mx reads its source at 4 elements/partition/cycle [TRN3] in VectorE's 4x mode, which needs
    # unit-stride SBUF operands; with strides VectorE runs its 2x mode [TRN2] ("not 1c"): 2 elements.
    quantize_mx_strided_elems_per_cycle: float = 2
    # Cross-engine dependency: engines synchronise through hardware semaphores [TRN1]; no latency is
    # documented. ESTIMATE 100 cycles of the waiting engine (range 50-200): the arch guide's static
    # overhead for back-to-back dependent VectorE instructions is 100 cycles [TRN1], the nearest figure.
    semaphore_hop_cycles: int = 100
    # VectorE perf modes use a memory bus shared with GpSimd; "the hardware automatically coordinates
    # access ... arbitrating between GpsimdE and relevant VectorE instructions" [TRN2]. No figure: central
    # charges nothing (ESTIMATE), pessimistic serialises them (as NC-v2 did, [TRN1]).
    vector_gpsimd_shared_bus: bool = False
    # Fraction of the documented sustained DMA rate reached. ESTIMATE 1.0 (the [DMABW] figure is already a
    # sustained one); pessimistic 0.9 (refresh, read/write turnaround; no figure in the docs).
    dma_efficiency: float = 1.0
    # DMA transpose: "up to 90% DMA throughput" from HBM, "up to 50%" SBUF->SBUF [TRN2].
    dma_transpose_hbm_efficiency: float = 0.9
    dma_transpose_sbuf_efficiency: float = 0.5
    # Read-add-write DMA into SBUF runs "at full DMA throughput" on NC-v4 [TRN3]: 1 pass of the bytes;
    # into HBM (and SBUF before NC-v4) the destination is read and written: 2 passes (INFERRED).
    rmw_sbuf_passes: int = 2
    # Software DGE (dge_mode=swdge, the only mode for indirect DMA [DGE]): GpSimd builds the descriptors
    # ("consumes GpSimd Engine cycles", no figure [DGE]). ESTIMATE GPSIMD_START (150 cycles, [LEGACY]) per
    # instruction + 32 GpSimd cycles per descriptor (range 16-64: a descriptor is a few 32-bit words per
    # row written by one of 8 processors).
    swdge_descriptor_cycles: int = 32
    # Dynamic loops compile to a hardware loop: compare-and-branch per iteration on each engine sequencer
    # (nki-loops deep dive); no figure. ESTIMATE 64 cycles per iteration (range 32-128: MIN_II-like).
    dynamic_loop_iteration_cycles: int = 64
    # Register ops (register_alloc/move: sequencer ALU; register_load/store: one SBUF access). ESTIMATE
    # 8 cycles for ALU ops (range 4-16) and the ~60-cycle access overhead [TRN1] for load/store.
    register_alu_cycles: int = 8
    # Free-axis reduce of a VectorE instruction with reduce_res (scalar_tensor_tensor, NKI 0.7): the 2.33 pages give
    # no figure, only "at a small additional performance cost" [TSR07]. ESTIMATE: central MIN_II on top of the
    # instruction (the [LEGACY] tensor_scalar_reduce formula, max(MIN_II, N) + MIN_II, quantifies that phrase);
    # pessimistic a separate reduce pass (True: + N + the access overhead, what a tensor_reduce of the result costs).
    vector_reduce_separate_pass: bool = False


# The cost model's numbers that the two targets share (the same documented figures for NC-v3 and NC-v4).
_SHARED_COST_MODEL = dict(
    # DMA payload rule: >= 4 KiB contiguous per descriptor "to sustain peak" [DMABW].
    dma_payload_full_rate_bytes=4096,
    # "each transfer is split over up to 16 engines, ~8 SBUF partitions per engine" [DMA].
    dma_partitions_per_engine=8,
    # 16 DMA queues per engine, FIFO within a queue [DMA]: up to 16 DMAs in flight per core.
    dma_queues_per_core=16,
    # "~1300 ns semaphore-to-start latency per transfer across engines" [DMA], [DMABW].
    dma_fixed_latency_s=1.3e-6,
    # hwdge transpose needs src.shape[0] == 16 [DMAT]: each partition receives 16-element pieces.
    dma_transpose_block_elems=16,
    # 4 HBM stacks per chip; an LNC2 pair shares one stack [LNCdoc].
    hbm_stacks_per_chip=4,
    # MIN_II ~= 64 cycles; MM_INIT_LATENCY = 64; fp32 matmul ~4x slower [LEGACY].
    min_ii_cycles=64,
    matmul_min_cycles=64,
    matmul_fp32_factor=4,
    # "LoadStationary up to 4x faster than MM of equal free size" [PERF]: a [K, M]
    # stationary costs M/4 cycles; INFERRED not hidden behind the previous MultiplyMoving.
    matmul_stationary_load_speedup=4,
    # "SBUF/PSUM access-initiation overhead ~60 cycles (v2)" [TRN1].
    engine_access_overhead_cycles=60,
    # GPSIMD_START ~= 150 cycles [LEGACY].
    gpsimd_start_cycles=150,
    # core_barrier: INFERRED one semaphore round trip through shared HBM ~ the DMA start latency [DMA].
    barrier_latency_s=1.3e-6,
)

# NeuronCore-v3 (Trainium2). SBUF 128 x 224 KiB, PSUM 128 x 16 KiB = 8 banks x 2 KiB [TRN2].
# Matmul moving free <= 512 on v2/v3 = one fp32 PSUM bank; fp32 dst only [MATMUL].
# TensorE 2.4 GHz; VectorE 0.96 GHz; ScalarE/GpSimd 1.2 GHz [TRN2].
# HBM 2.9 TB/s/chip ([CHIP2]; [TRN2] says 3.0; the docs disagree — the lower figure is used);
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
    # 27.2 GB/s theoretical per engine (NC-v2/v3) [DMA].
    dma_theoretical_bytes_per_s_per_engine=27.2e9,
    # cost model ------------------------------------------------------------------------------
    **_SHARED_COST_MODEL,
    # VectorE perf modes 2x/4x BF16 [TRN2]; ScalarE 2x mode is NC-v4 only [TRN3].
    vector_fast_modes=True,
    scalar_fast_modes=False,
    quantize_mx_elems_per_cycle=0,  # no quantize_mx on NC-v3
    # Not measured on trn2: the trn3 calibration value is reused (see TRN3; INFERRED).
    kernel_launch_overhead_s=KERNEL_LAUNCH_OVERHEAD_S,
)

# NeuronCore-v4 (Trainium3). SBUF 32 MiB -> 128 x 256 KiB (INFERRED by division: [TRN3] gives 32 MiB per core, no
# per-partition figure); PSUM same as v3. nc_matmul(_mx) moving free <= 4096 fp32 / 8192 bf16 dst ([MATMUL],
# [MATMULMX] 2.31+, the larger limit of the newest docs is enforced). TensorE 2.4 GHz, VectorE/ScalarE/GpSimd 1.2 GHz
# [TRN3]. HBM 4.7 TB/s ([TRN3]; [CHIP3] says 4.9 — the lower figure is used); 16 DMA engines at 33 B/ns [DMABW].
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
    # 38.4 GB/s theoretical per engine (NC-v4) [DMA].
    dma_theoretical_bytes_per_s_per_engine=38.4e9,
    # cost model ------------------------------------------------------------------------------
    **_SHARED_COST_MODEL,
    # VectorE perf modes [TRN2] carried to v4; ScalarE 2x BF16 tensor_copy/tensor_scalar [TRN3].
    vector_fast_modes=True,
    scalar_fast_modes=True,
    # quantize_mx: 4 input elements per partition per cycle [TRN3].
    quantize_mx_elems_per_cycle=4,
    kernel_launch_overhead_s=KERNEL_LAUNCH_OVERHEAD_S,
    # DMA read-add-write into SBUF at full DMA throughput on NC-v4 [TRN3], [NCv4].
    rmw_sbuf_passes=1,
)

TARGETS = {"trn2": TRN2, "trn3": TRN3}

# Worst ends of the ESTIMATE ranges above (and of the documented "about"/"up to" figures where the docs
# leave room): `with_scenario(target, "pessimistic")`. Each line says why.
PESSIMISTIC_OVERRIDES = {
    # strided quantize_mx source: on top of the 2x mode, a most-minor stride > 16 B halves the SBUF read
    # bandwidth (NC-v2 rule [TRN1], not restated for v3/v4)
    "quantize_mx_strided_elems_per_cycle": 1,
    "semaphore_hop_cycles": 200,
    "vector_gpsimd_shared_bus": True,
    "dma_efficiency": 0.9,
    "swdge_descriptor_cycles": 64,
    "dynamic_loop_iteration_cycles": 128,
    "register_alu_cycles": 16,
    "vector_reduce_separate_pass": True,
}
SCENARIOS = ("central", "pessimistic")


def with_scenario(target: "TargetSpec", scenario: str) -> "TargetSpec":
    """`target` with the ESTIMATE constants at the named end: "central" (as defined) or "pessimistic"."""
    if scenario == "central":
        base = TARGETS[target.name]
        return replace(target, scenario="central", **{k: getattr(base, k) for k in PESSIMISTIC_OVERRIDES})
    if scenario == "pessimistic":
        return replace(target, scenario="pessimistic", **PESSIMISTIC_OVERRIDES)
    raise ValueError(f"unknown cost-model scenario {scenario!r}: expected one of {SCENARIOS}")

# Accepted spellings of NEURON_PLATFORM_TARGET_OVERRIDE / NKI_NC_VERSION ([SIM]).
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
