"""Engine-level cost model for Trn2/Trn3: per-instruction costs, a scheduler, reports.

Pipeline: `run_kernel(..., trace=True, numerics=False)` records one `InstrRecord` per ISA call
(trace.py) -> `instr_cost` prices each record on its engine (pricing.py) -> `schedule` places the
records on the engines of each core (scheduler.py, with dependencies.py and allocator.py) ->
`CostReport` summarises (report.py: JSON, table; plots.py: PNG). `model_kernel` (modeling.py) does
all of it for a kernel. `nkilib.examples.bf16_matmul.predict_bf16_gemm_time` models the calibrated
BF16 GEMM kernel for one shape (the simulator does not import kernels).

Source tags in brackets ([LEGACY], [TRN2], [DMABW], ...) are public Neuron documentation pages; the
table of tags and URLs is in the docstring of nkilib/simulator/hardware.py, which also holds every
number with its source.

Per-instruction costs (pricing.py):
- Where the docs give an "estimated instruction cost" formula ([LEGACY]: the Beta-1 API pages, the
  last to publish per-instruction formulas) it is used as is, in cycles of the executing engine:
  e.g. nc_matmul `max(min(64, N_stationary), N_moving)` ... we use `max(MM_INIT=64, N_moving)` plus
  the stationary load (see Calibration), tensor_copy / tensor_scalar / activation `max(MIN_II, N)`,
  tensor_tensor `N` or `2N`, iota `150 + N`.
- Otherwise data-path width x clock ([TRN2], [TRN3]): TensorE 2.4 GHz, one 128-element moving
  column per cycle (79 BF16 TFLOPS/core), fp32 4x slower, fp8 double_row 2x and MX 4x the BF16
  contraction per cycle; VectorE/ScalarE/GpSimd ~1 element per partition per cycle at their clocks,
  with the NC-v3 VectorE perf modes (4x SBUF->SBUF BF16 unit stride, 2x strided or one PSUM side,
  [TRN2]) and the NC-v4 ScalarE 2x BF16 mode ([TRN3]); quantize_mx 4 elements/partition/cycle [TRN3].
- Every ACT/DVE/Pool instruction pays the documented ~60-cycle SBUF/PSUM access-initiation overhead
  ([TRN1]); the TensorE formula already is an initiation interval.
- DMA (dma_copy, dma_transpose, dma_compute, sendrecv): bytes at the rate of the DMA engines the
  transfer is split over (up to 16, ~8 partitions each, [DMA]), each engine at
  `theoretical * p / (p + p0)` capped at its sustained rate, p = contiguous bytes per descriptor and
  p0 chosen so that a 4 KiB payload reaches the documented sustained rate ("≥4 KiB per partition to
  sustain peak", [DMABW]) — a fixed per-descriptor overhead derived from theoretical vs sustained
  rates (trn3: 38.4 vs 33 B/ns per engine => p0 = 670 B, ~17 ns). Plus a fixed ~1.3 us
  semaphore-to-start latency per transfer that uses no bandwidth ([DMA]), preceded by descriptor
  generation (dma.py): ~600 ns on one of the core's two hardware DGE instances [TRN2] (dge_mode
  hwdge/unknown), GpSimd cycles per descriptor in its program order (swdge, indirect DMAs [DGE]), or
  nothing (dge_mode none). DMA transposes run at the documented 90% (from HBM) / 50% (SBUF->SBUF) of
  the DMA rate [TRN2]; read-modify-write DMAs move the destination bytes twice (read + write), except
  into SBUF on NC-v4 [TRN3].
- TensorE transposes load their data as the stationary (nc_matmul(data, identity) [TRN1]);
  quantize_mx runs 4 elements/cycle only with unit-stride operands (VectorE's 4x mode [TRN2, TRN3]).
- Control records: dynamic_loop (per iteration taken) and register_* ops (ESTIMATE, hardware.py).

Scheduler (scheduler.py):
- every compute engine (tensor / vector / scalar / gpsimd) of every core runs its instructions in
  program order; an instruction starts when its engine is free and its inputs are ready;
- dependencies (dependencies.py) come from operand regions (same storage, overlapping partition
  range and byte range; strided 2-D HBM tiles are compared as exact rectangles): read-after-write,
  write-after-read and write-after-write;
- finite SBUF/PSUM (allocator.py, `_memory_reuse_deps`): each on-chip allocation lives from its
  first to its last access in program order and is placed next-fit in its core's per-partition
  address space; a tile placed on bytes that an earlier dead tile used waits for that tile's last
  access. Overlap of loads with compute therefore needs buffers that really fit (the report also
  gives the occupancy the schedule needs: `scheduled_peak_bytes_per_partition`). The allocator
  policy is INFERRED;
- a compute instruction waiting on another engine's instruction (or a DMA) pays a semaphore hop
  (ESTIMATE, hardware.py); at the pessimistic end VectorE perf-mode instructions and GpSimd SBUF
  instructions serialise on their shared bus [TRN2];
- DMA: each core has `dma_queues_per_core` transfers in flight; a transfer becomes ready when its
  inputs are ready, waits for a free queue (ready order), spends the fixed latency, then moves its
  bytes. Transfers in flight share the core's 16 DMA engines (processor sharing weighted by the
  engines each one spans); transfers touching HBM also share the HBM stack of the LNC2 core pair
  (chip bandwidth / 4 stacks, [LNCdoc]);
- LNC2: one set of engines per program (physical core); `core_barrier` is a fence: it waits for all
  earlier instructions of its core, completes when both cores arrived (+ a semaphore latency), and
  every later instruction of the core waits for it; a `sendrecv` pair (the k-th call on a pipe_id of
  each core) starts both cores' transfers once both calls are ready plus the barrier latency, and
  completes when both transfers have (docs/simulator.md#choice-sendrecv-pairing);
- makespan = last end; modeled kernel time = makespan + `kernel_launch_overhead_s`.

Band: constants the docs do not pin down are ESTIMATEs with a range (hardware.py); `scenario=
"central"` uses the central values, "pessimistic" the worst ends (`hardware.PESSIMISTIC_OVERRIDES`);
`rescore(report, scenario)` reschedules a report's trace at the other end.

Capacity: `CostReport.plan_errors` lists every core whose plan (program-order peak) or modeled overlap
needs more SBUF/PSUM than the target has, and every tile the allocator can place only over live tiles
it cannot wait for (fragmentation); such a report has no valid time (the study refuses it).
Choices where the docs are silent are recorded in docs/cost-model.md.

Calibration (simulations/calibrate_bf16_gemm.py, measured BF16 GEMMs on Trainium3 LNC2): all engine
and DMA numbers are the documented ones. Two choices were made against the measurements: the
per-call `kernel_launch_overhead_s` (hardware.py; fitted: a physically real fixed cost of launch,
instruction fetch and completion semaphores that the docs do not quantify, dominant in the smallest
GEMMs) and modeling the documented M/4-cycle LoadStationary as exposed rather than hidden
(`_stationary_load_cycles`; the best measured GEMMs peak at ~94% of the BF16 roof).

Phases: an instruction's phase is its `phase` trace attribute, else the prefix of its `name` trace
attribute before '/' or ':' (when the ISA layer records it), else `phase_of(record)` if given to
`model_kernel`/`CostReport`, else "kernel".
"""
from .allocator import scheduled_occupancy
from .modeling import model_kernel, rescore
from .operands import CostModelError
from .pricing import COST_FUNCTIONS, DmaWork, InstrCost, dma_work, instr_cost
from .report import CostReport
from .scheduler import Schedule, schedule

__all__ = [
    "COST_FUNCTIONS", "CostModelError", "CostReport", "DmaWork", "InstrCost", "Schedule", "dma_work", "instr_cost",
    "model_kernel", "rescore", "schedule", "scheduled_occupancy",
]
