"""Engine-level cost model for Trn2/Trn3 (issue 4): per-instruction costs, a scheduler, reports.

Pipeline: `run_kernel(..., trace=True, numerics=False)` records one `InstrRecord` per ISA call
(trace.py) -> `instr_cost` prices each record on its engine -> `schedule` places the records on the
engines of each core -> `CostReport` summarises (JSON, table, PNG plots). `model_kernel` does all of
it for a kernel; `predict_bf16_gemm_time` models the calibrated BF16 GEMM kernel
(nkilib/examples/bf16_matmul.py) for one shape.

Per-instruction costs (hardware numbers from hardware.TargetSpec, each with its source there):
- Where the docs give an "estimated instruction cost" formula (spec §8, Beta-1 docs [LEGACY]) it is
  used as is, in cycles of the executing engine: e.g. nc_matmul `max(min(64, N_stationary), N_moving)`
  ... we use `max(MM_INIT=64, N_moving)` (stationary load runs in the background, spec §8),
  tensor_copy / tensor_scalar / activation `max(MIN_II, N)`, tensor_tensor `N` or `2N`, iota `150 + N`.
- Otherwise data-path width x clock (spec §6.2): TensorE 2.4 GHz, one 128-element moving column per
  cycle (79 BF16 TFLOPS/core), fp32 4x slower, fp8 double_row 2x and MX 4x the BF16 contraction per
  cycle; VectorE/ScalarE/GpSimd ~1 element per partition per cycle at their clocks, with the NC-v3
  VectorE perf modes (4x SBUF->SBUF BF16 unit stride, 2x strided or one PSUM side) and the NC-v4
  ScalarE 2x BF16 mode (spec §8); quantize_mx 4 elements/partition/cycle [TRN3].
- Every ACT/DVE/Pool instruction pays the documented ~60-cycle SBUF/PSUM access-initiation overhead
  (spec §8); the TensorE formula already is an initiation interval.
- DMA (dma_copy, dma_transpose, dma_compute, sendrecv): bytes at the rate of the DMA engines the
  transfer is split over (up to 16, ~8 partitions each, spec §6.2), each engine at
  `theoretical * p / (p + p0)` capped at its sustained rate, p = contiguous bytes per descriptor and
  p0 chosen so that a 4 KiB payload reaches the documented sustained rate ("≥4 KiB per partition to
  sustain peak", [DMABW]) — a fixed per-descriptor overhead derived from theoretical vs sustained
  rates (trn3: 38.4 vs 33 B/ns per engine => p0 = 670 B, ~17 ns). Plus a fixed ~1.3 us
  semaphore-to-start latency per transfer that uses no bandwidth. Transposing DMAs write 16-element
  pieces per partition (hwdge transpose blocks of 16 rows, spec §5.6): p = 16 x itemsize (INFERRED,
  the docs give no DMA-transpose throughput).

Scheduler (`schedule`):
- every compute engine (tensor / vector / scalar / gpsimd) of every core runs its instructions in
  program order; an instruction starts when its engine is free and its inputs are ready;
- dependencies come from operand regions (same storage, overlapping partition range and byte range;
  strided 2-D HBM tiles are compared as exact rectangles): read-after-write, write-after-read and
  write-after-write;
- finite SBUF/PSUM (`_memory_reuse_deps`): each on-chip allocation lives from its first to its last
  access in program order and is placed next-fit in its core's per-partition address space; a tile
  placed on bytes that an earlier dead tile used waits for that tile's last access. Overlap of loads
  with compute therefore needs buffers that really fit (the report also gives the occupancy the
  schedule needs: `scheduled_peak_bytes_per_partition`). The allocator policy is INFERRED;
- DMA: each core has `dma_queues_per_core` transfers in flight; a transfer becomes ready when its
  inputs are ready, waits for a free queue (ready order), spends the fixed latency, then moves its
  bytes. Transfers in flight share the core's 16 DMA engines (processor sharing weighted by the
  engines each one spans); transfers touching HBM also share the HBM stack of the LNC2 core pair
  (chip bandwidth / 4 stacks, [LNCdoc]);
- LNC2: one set of engines per program (physical core); `core_barrier` is a fence: it waits for all
  earlier instructions of its core, completes when both cores arrived (+ a semaphore latency), and
  every later instruction of the core waits for it;
- makespan = last end; modeled kernel time = makespan + `kernel_launch_overhead_s`.

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
from __future__ import annotations

import contextlib
import heapq
import json
import math
import os
from dataclasses import dataclass, field

from .dtypes import as_nki_dtype
from .hardware import TargetSpec, resolve_target


class CostModelError(ValueError):
    """An instruction the cost model has no formula for, or an inconsistent trace."""


_COMPUTE_ENGINES = ("tensor", "vector", "scalar", "gpsimd")
_TWO_BYTE = ("bfloat16", "float16")
_FP8 = ("float8_e4m3", "float8_e5m2", "float8_e4m3fn")


# =============================================================================================
# Operand helpers
# =============================================================================================
def _prod(xs) -> int:
    return int(math.prod(xs))


def _on_chip(op) -> bool:
    return op.buffer in ("sbuf", "psum")


def _free_elems(op) -> int:
    return _prod(op.shape[1:]) if _on_chip(op) else _prod(op.shape)


def _parts(op) -> int:
    return op.shape[0] if _on_chip(op) else 1


def _itemsize(dtype: str) -> int:
    return as_nki_dtype(dtype, "cost model").itemsize


def _contig_run_elems(op) -> int:
    """Elements in the innermost contiguous run of an operand (per partition for on-chip operands)."""
    isz = op.storage_itemsize
    dims = list(zip(op.shape, op.strides))
    if _on_chip(op):
        dims = dims[1:]
    dims = [(n, s) for n, s in dims if n != 1]
    if not isz or not op.strides:
        return op.shape[-1] if op.shape else 1
    run, expect = 1, isz
    for n, s in reversed(dims):
        if s != expect:
            break
        run *= n
        expect *= n
    return run


def _is_contiguous(op) -> bool:
    return _contig_run_elems(op) >= _free_elems(op)


def _ops(rec):
    return tuple(rec.reads) + tuple(rec.writes)


def _onchip_ops(rec):
    return [o for o in _ops(rec) if _on_chip(o)]


def _elems_per_partition(rec) -> int:
    """N of the documented formulas: elements per partition of the largest on-chip data operand."""
    ops = _onchip_ops(rec)
    if not ops:
        raise CostModelError(f"{rec.instr}: no on-chip operand to size the instruction")
    return max(_free_elems(o) for o in ops)


def _find(ops, *names):
    for n in names:
        for o in ops:
            if o.arg == n:
                return o
    return None


def _op_name(rec, key) -> str:
    v = rec.attrs.get(key)
    if v is None:
        return ""
    return str(getattr(v, "name", v)).lower()


def _phase_label(rec) -> str | None:
    ph = rec.attrs.get("phase")
    if ph:
        return str(ph)
    name = rec.attrs.get("name")
    if name:
        for sep in ("/", ":"):
            if sep in str(name):
                return str(name).split(sep)[0]
        return str(name)
    return None


# =============================================================================================
# Per-instruction costs
# =============================================================================================
@dataclass
class DmaWork:
    """What a DMA transfer asks of the DMA engines."""

    nbytes: int
    payload: int  # contiguous bytes per descriptor
    engines: int  # DMA engines the transfer is split over
    hbm_bytes: int  # bytes read from + written to HBM
    rate_per_engine: float  # bytes/s of one engine at this payload
    transpose: bool = False

    @property
    def max_rate(self) -> float:
        return self.engines * self.rate_per_engine


@dataclass
class InstrCost:
    """Cost of one instruction: fixed-duration engine work, a DMA transfer, or a barrier."""

    kind: str  # "compute" / "dma" / "barrier"
    engine: str
    seconds: float = 0.0  # compute: duration on its engine
    cycles: float = 0.0
    flops: float = 0.0  # model FLOPs (matmuls, not transposes)
    dma: DmaWork | None = None


def _engine_clock(target: TargetSpec, engine: str) -> float:
    clocks = {"tensor": target.tensor_clock_hz, "vector": target.vector_clock_hz,
              "scalar": target.scalar_clock_hz, "gpsimd": target.gpsimd_clock_hz}
    if engine not in clocks:
        raise CostModelError(f"unknown compute engine {engine!r}")
    return clocks[engine]


def _act_like(rec, target, work_cycles, floor=True, overhead=True) -> InstrCost:
    """ACT/DVE/Pool instruction: (access overhead) + max(MIN_II, work) cycles at the engine clock."""
    eng = rec.engine
    cyc = max(target.min_ii_cycles, work_cycles) if floor else work_cycles
    if overhead:
        cyc += target.engine_access_overhead_cycles
    return InstrCost("compute", eng, cyc / _engine_clock(target, eng), cyc)


def _perf_factor(rec, target) -> float:
    """Elementwise speed-up of tensor_copy / tensor_scalar (spec §8, [TRN2]/[TRN3] perf modes)."""
    ops = _onchip_ops(rec)
    narrow = all(o.dtype in _TWO_BYTE or (target.has_mx and o.dtype in _FP8) for o in ops)
    if not narrow:
        return 1.0
    if rec.engine == "vector" and target.vector_fast_modes:
        psum = sum(o.buffer == "psum" for o in ops)
        if psum == 0 and all(_is_contiguous(o) for o in ops):
            return 4.0
        return 2.0 if psum <= 1 else 1.0
    if rec.engine == "scalar" and target.scalar_fast_modes:
        return 2.0
    return 1.0


def _stationary_load_cycles(m, target) -> float:
    """LoadStationary of an [K, M] stationary: M/4 cycles (4x a MultiplyMoving of equal free size, spec §8).

    The perf guide says it "can run in the background"; the measured BF16 GEMMs peak at ~94 % of the
    BF16 roof, which is what an exposed M/4 = 32-cycle load per 512-column matmul gives, so it is
    modeled as exposed (INFERRED).
    """
    return -(-m // target.matmul_stationary_load_speedup)


def _cost_nc_matmul(rec, target):
    a = rec.attrs
    st = _find(rec.reads, "stationary")
    mv = _find(rec.reads, "moving")
    n = a.get("N", _free_elems(mv) if mv else None)
    m = a.get("M", _free_elems(st) if st else None)
    k = a.get("K", _parts(st) if st else None)
    if n is None or m is None or k is None:
        raise CostModelError("nc_matmul: trace record lacks K/M/N and stationary/moving operands")
    cyc = max(target.matmul_min_cycles, n)  # [LEGACY] max(min(64, N_stationary), N_moving) ~ max(64, N)
    cyc += _stationary_load_cycles(m, target)
    dts = {a.get("in_dtype", st.dtype if st else ""), a.get("moving_dtype", mv.dtype if mv else "")}
    if dts & {"float32", "tfloat32"}:
        cyc *= target.matmul_fp32_factor  # fp32 ~4x slower (spec §8)
    # double_row: contraction 2K in the same cycles (2x FP8 throughput, spec §8); K already is 2K in the trace
    transpose = bool(a.get("transpose", False))
    flops = 0.0 if transpose else 2.0 * k * m * n
    return InstrCost("compute", "tensor", cyc / target.tensor_clock_hz, cyc, flops)


def _cost_nc_matmul_mx(rec, target):
    st = _find(rec.reads, "stationary")
    mv = _find(rec.reads, "moving")
    a = rec.attrs
    n = a.get("N", _free_elems(mv) if mv else None)
    m = a.get("M", _free_elems(st) if st else None)
    k = _parts(st) if st else a.get("K")
    if n is None or m is None or k is None:
        raise CostModelError("nc_matmul_mx: trace record lacks stationary/moving operands")
    # x4 words: each partition row holds 4 contraction elements -> 4K contraction in N cycles (4x BF16, [TRN3])
    cyc = max(target.matmul_min_cycles, n) + _stationary_load_cycles(m, target)
    return InstrCost("compute", "tensor", cyc / target.tensor_clock_hz, cyc, 2.0 * 4 * k * m * n)


def _cost_nc_transpose(rec, target):
    data = _find(rec.reads, "data", "src") or rec.reads[0]
    p, f = _parts(data), _free_elems(data)
    if rec.engine == "tensor":
        cyc = max(p, min(target.matmul_min_cycles, f))  # [LEGACY] Tensor: max(P, min(64, F))
        return InstrCost("compute", "tensor", cyc / target.tensor_clock_hz, cyc)
    return _act_like(rec, target, f)  # Vector: max(MIN_II, N)


def _cost_quantize_mx(rec, target):
    src = _find(rec.reads, "src") or rec.reads[0]
    per = target.quantize_mx_elems_per_cycle or 1
    return _act_like(rec, target, _free_elems(src) / per)


def _cost_copy_like(rec, target):
    return _act_like(rec, target, _elems_per_partition(rec) / _perf_factor(rec, target))


def _cost_memset(rec, target):
    dst = rec.writes[0]
    n = _free_elems(dst)
    value = rec.attrs.get("value", 0)
    # [LEGACY] zero into bf16/fp16: max(MIN_II, N/2); else max(MIN_II, N). value not recorded -> zero-fill
    if dst.dtype in _TWO_BYTE and (value == 0 or value is None):
        n = n / 2
    return _act_like(rec, target, n)


def _cost_tensor_tensor(rec, target):
    n = _elems_per_partition(rec)
    ins = [o for o in rec.reads if _on_chip(o)][:2]
    psum_in = sum(o.buffer == "psum" for o in ins)
    op = _op_name(rec, "op")
    all_bf16 = all(o.dtype == "bfloat16" for o in _onchip_ops(rec))
    fast_op = any(k in op for k in ("add", "multiply", "subtract"))
    # [LEGACY] N if one input PSUM + one SBUF, or both SBUF, all bf16, add/mul/sub, unit stride; else 2N
    if (psum_in == 1 and len(ins) == 2) or (psum_in == 0 and all_bf16 and fast_op
                                            and all(_is_contiguous(o) for o in _onchip_ops(rec))):
        return _act_like(rec, target, n)
    return _act_like(rec, target, 2 * n)


def _cost_scalar_tensor_tensor(rec, target):
    n = _elems_per_partition(rec)
    data = _find(rec.reads, "data")
    op1 = _find(rec.reads, "operand1")
    fast = (data is not None and op1 is not None and data.dtype == "bfloat16" and op1.dtype == "bfloat16"
            and "subtract" in _op_name(rec, "op0") and "multiply" in _op_name(rec, "op1") and n % 2 == 0)
    return _act_like(rec, target, n if fast else 2 * n)  # [LEGACY] N if bf16 sub/mul and N even, else 2N


def _cost_activation(rec, target):
    n = _elems_per_partition(rec)
    reducing = (rec.instr == "activation_reduce" or len(rec.writes) > 1 or rec.attrs.get("reduce_readout")
                or _op_name(rec, "reduce_cmd") not in ("", "idle", "reset"))
    extra = target.min_ii_cycles if reducing else 0
    c = _act_like(rec, target, n)  # [LEGACY] activation max(MIN_II, N); *_reduce + MIN_II
    if extra:
        c.cycles += extra
        c.seconds = c.cycles / _engine_clock(target, rec.engine)
    return c


def _cost_tensor_reduce(rec, target):
    data = _find(rec.reads, "data") or rec.reads[0]
    n = _free_elems(data)
    op = _op_name(rec, "op")
    bf16 = all(o.dtype == "bfloat16" for o in _onchip_ops(rec))
    if bf16 and ("add" in op or "max" in op):
        n = n / 2  # [LEGACY] N/2 if bf16 in/out and add/max
    return _act_like(rec, target, n, floor=False)


def _cost_reciprocal(rec, target):
    n = _elems_per_partition(rec)
    return _act_like(rec, target, n if rec.engine == "scalar" else 8 * n)  # [LEGACY] Vector max(MIN_II, 8N)


def _cost_gpsimd_start(rec, target):
    n = _elems_per_partition(rec)
    cyc = target.gpsimd_start_cycles + n  # [LEGACY] iota / affine_select: GPSIMD_START + N
    return InstrCost("compute", rec.engine, cyc / _engine_clock(target, rec.engine), cyc)


def _cost_factor(factor, floor=True, extra_min_ii=False):
    def fn(rec, target):
        c = _act_like(rec, target, factor * _elems_per_partition(rec), floor=floor)
        if extra_min_ii:
            c.cycles += target.min_ii_cycles
            c.seconds = c.cycles / _engine_clock(target, rec.engine)
        return c
    return fn


def _cost_exponential(rec, target):
    # exponential: 4x the ScalarE exp throughput [TRN3] (spec §8)
    return _act_like(rec, target, _elems_per_partition(rec) / 4)


def dma_work(rec, target: TargetSpec) -> DmaWork:
    """Bytes, descriptor payload, engines and per-engine rate of one DMA record."""
    ops = _ops(rec)
    if not ops:
        raise CostModelError(f"{rec.instr}: DMA record without operands")
    nbytes = int(rec.attrs.get("bytes") or max(o.nbytes for o in ops))
    transpose = bool(rec.attrs.get("transpose")) or rec.instr == "dma_transpose"
    if transpose:
        # hwdge transpose moves [16 x n] blocks: every partition receives 16-element pieces (spec §5.6; INFERRED)
        dst = rec.writes[0] if rec.writes else ops[0]
        payload = target.dma_transpose_block_elems * _itemsize(dst.dtype)
    else:
        payload = min(_contig_run_elems(o) * _itemsize(o.dtype) for o in ops)
    payload = max(1, min(payload, nbytes))
    chip = [o for o in ops if _on_chip(o)]
    parts = max((_parts(o) for o in chip), default=target.num_partitions)
    engines = min(target.dma_engines_per_core, max(1, -(-parts // target.dma_partitions_per_engine)))
    hbm = sum(o.nbytes for o in ops if not _on_chip(o))
    # per-descriptor overhead p0 such that a 4 KiB payload runs at the sustained rate [DMABW]
    theo, sust = target.dma_theoretical_bytes_per_s_per_engine, target.dma_bytes_per_s_per_engine
    p0 = target.dma_payload_full_rate_bytes * (theo / sust - 1.0)
    rate = min(sust, theo * payload / (payload + p0))
    return DmaWork(nbytes, payload, engines, hbm, rate, transpose)


def _cost_dma(rec, target):
    return InstrCost("dma", "dma", dma=dma_work(rec, target))


def _cost_barrier(rec, target):
    return InstrCost("barrier", "barrier", seconds=target.barrier_latency_s)


COST_FUNCTIONS = {
    "nc_matmul": _cost_nc_matmul,
    "nc_matmul_mx": _cost_nc_matmul_mx,
    "nc_transpose": _cost_nc_transpose,
    "quantize_mx": _cost_quantize_mx,
    "tensor_copy": _cost_copy_like,
    "tensor_scalar": _cost_copy_like,
    "memset": _cost_memset,
    "tensor_tensor": _cost_tensor_tensor,
    "scalar_tensor_tensor": _cost_scalar_tensor_tensor,
    "activation": _cost_activation,
    "activation_reduce": _cost_activation,
    "activate2": _cost_activation,
    "tensor_reduce": _cost_tensor_reduce,
    "reciprocal": _cost_reciprocal,
    "iota": _cost_gpsimd_start,
    "affine_select": _cost_gpsimd_start,
    "exponential": _cost_exponential,
    # further documented [LEGACY] formulas (spec §8)
    "tensor_scalar_reduce": _cost_factor(1, extra_min_ii=True),
    "tensor_tensor_scan": _cost_factor(2),
    "bn_stats": _cost_factor(1),
    "bn_aggr": _cost_factor(13 / 3),
    "max8": _cost_factor(1, floor=False),
    "nc_find_index8": _cost_factor(1, floor=False),
    "nc_stream_shuffle": _cost_factor(1),
    "range_select": _cost_factor(1),
    "dropout": _cost_factor(1),
    "tensor_copy_predicated": _cost_factor(2),
    "dma_copy": _cost_dma,
    "dma_transpose": _cost_dma,
    "dma_compute": _cost_dma,
    "sendrecv": _cost_dma,
    "core_barrier": _cost_barrier,
}


def instr_cost(rec, target: TargetSpec) -> InstrCost:
    """Cost of one trace record on `target` (see module docstring for the formulas)."""
    fn = COST_FUNCTIONS.get(rec.instr)
    if fn is None:
        raise CostModelError(
            f"no cost formula for instruction '{rec.instr}' (engine {rec.engine}, trace seq {rec.seq}); "
            f"add one to nkilib.simulator.cost.COST_FUNCTIONS (known: {sorted(COST_FUNCTIONS)})")
    if fn not in (_cost_dma, _cost_barrier, _cost_nc_matmul, _cost_nc_matmul_mx) and rec.engine not in _COMPUTE_ENGINES:
        raise CostModelError(f"{rec.instr}: engine {rec.engine!r} is not a compute engine")
    return fn(rec, target)


# =============================================================================================
# Dependencies: operand regions
# =============================================================================================
def _region(op):
    """('chip', plo, phi, blo, bhi) | ('rect', R, r0, r1, c0, c1) | ('int', lo, hi)."""
    if _on_chip(op):
        return ("chip", op.partition_lo, op.partition_hi, op.byte_lo, op.byte_hi)
    isz = op.storage_itemsize
    if isz and op.strides:
        dims = [(n, s) for n, s in zip(op.shape, op.strides) if n != 1]
        merged = []
        for n, s in reversed(dims):  # innermost first; merge contiguous neighbours
            if merged and s == merged[-1][0] * merged[-1][1]:
                merged[-1] = (merged[-1][0] * n, merged[-1][1])
            else:
                merged.append((n, s))
        off = op.byte_offset
        if not merged:
            return ("int", off, off + isz)
        if len(merged) == 1 and merged[0][1] == isz:
            return ("int", off, off + merged[0][0] * isz)
        if len(merged) == 2 and merged[0][1] == isz and merged[1][1] > 0:
            (ni, _), (no, so) = merged
            c0 = off % so
            c1 = c0 + ni * isz
            if c1 <= so:
                r0 = off // so
                return ("rect", so, r0, r0 + no, c0, c1)
    return ("int", op.byte_lo, op.byte_hi)


def _bounds(r):
    if r[0] == "rect":
        _, R, r0, r1, c0, c1 = r
        return r0 * R + c0, (r1 - 1) * R + c1
    return r[1], r[2]


def _overlap(a, b) -> bool:
    if a[0] == "chip":
        return a[1] < b[2] and b[1] < a[2] and a[3] < b[4] and b[3] < a[4]
    if a[0] == "rect" and b[0] == "rect" and a[1] == b[1]:
        return a[2] < b[3] and b[2] < a[3] and a[4] < b[5] and b[4] < a[5]
    if a[0] == "rect" and b[0] == "int":
        a, b = b, a
    if a[0] == "int" and b[0] == "rect":
        lo, hi = a[1], a[2]
        _, R, r0, r1, c0, c1 = b
        if hi - lo >= R:
            return lo < _bounds(b)[1] and _bounds(b)[0] < hi
        # an interval shorter than a row touches at most two rows: test them exactly
        for row in (lo // R, (hi - 1) // R):
            if r0 <= row < r1 and lo < row * R + c1 and row * R + c0 < hi:
                return True
        return False
    alo, ahi = _bounds(a)
    blo, bhi = _bounds(b)
    return alo < bhi and blo < ahi


def _contains(a, b) -> bool:
    """True if region a covers region b (only same-form comparisons; else False, conservative)."""
    if a[0] != b[0]:
        return a[0] == "int" and _bounds(a)[0] <= _bounds(b)[0] and _bounds(b)[1] <= _bounds(a)[1]
    if a[0] == "chip":
        return a[1] <= b[1] and b[2] <= a[2] and a[3] <= b[3] and b[4] <= a[4]
    if a[0] == "rect":
        return a[1] == b[1] and a[2] <= b[2] and b[3] <= a[3] and a[4] <= b[4] and b[5] <= a[5]
    return a[1] <= b[1] and b[2] <= a[2]


def _union(a, b):
    if a[0] == "chip" and b[0] == "chip":
        return ("chip", min(a[1], b[1]), max(a[2], b[2]), min(a[3], b[3]), max(a[4], b[4]))
    if a[0] == "rect" and b[0] == "rect" and a[1] == b[1]:
        return ("rect", a[1], min(a[2], b[2]), max(a[3], b[3]), min(a[4], b[4]), max(a[5], b[5]))
    (alo, ahi), (blo, bhi) = _bounds(a), _bounds(b)
    return ("int", min(alo, blo), max(ahi, bhi))


_READ_CAP = 24  # read entries kept per storage before the oldest are merged (conservatively)


class _Tracker:
    """Last accesses per (program, storage): yields RAW/WAR/WAW predecessors of a new instruction."""

    def __init__(self):
        self.writes = {}  # key -> list of [region, seqs]
        self.reads = {}  # key -> list of [region, seqs, engine]

    def deps(self, prog, rec, engine):
        out = set()
        rregs = [((prog, o.storage_id), _region(o)) for o in rec.reads]
        wregs = [((prog, o.storage_id), _region(o)) for o in rec.writes]
        for key, reg in rregs:
            for w in self.writes.get(key, ()):
                if _overlap(reg, w[0]):
                    out.update(w[1])
        for key, reg in wregs:
            for w in self.writes.get(key, ()):
                if _overlap(reg, w[0]):
                    out.update(w[1])
            for r in self.reads.get(key, ()):
                if _overlap(reg, r[0]):
                    out.update(r[1])
        # update: a write covering an older access subsumes it (the new write is ordered after it)
        for key, reg in wregs:
            ws = self.writes.setdefault(key, [])
            ws[:] = [w for w in ws if not _contains(reg, w[0])]
            ws.append([reg, (rec.seq,)])
            rs = self.reads.get(key)
            if rs:
                rs[:] = [r for r in rs if not _contains(reg, r[0])]
        for key, reg in rregs:
            rs = self.reads.setdefault(key, [])
            rs.append([reg, (rec.seq,), engine])
            if len(rs) > _READ_CAP:
                self._merge(rs)
        out.discard(rec.seq)
        return out

    @staticmethod
    def _merge(rs):
        half = rs[: len(rs) // 2]
        keep = rs[len(rs) // 2:]
        merged = {}
        for reg, seqs, eng in half:
            m = merged.get(eng)
            if m is None:
                merged[eng] = [reg, seqs if isinstance(seqs, list) else list(seqs), eng]
            else:
                m[0] = _union(m[0], reg)
                if eng == "dma":
                    m[1].extend(seqs)  # DMA queues complete out of order: keep every predecessor
                else:
                    m[1] = [max(max(m[1]), max(seqs))]  # in-order engine: the last read ends last
        rs[:] = list(merged.values()) + keep


# =============================================================================================
# Scheduler
# =============================================================================================
@dataclass
class Schedule:
    """Result of `schedule`: per-instruction times (seconds from kernel start) and engine totals."""

    target: str
    lnc: int
    records: list
    costs: list
    start: list
    end: list
    blocker: list  # seq of the instruction/event that determined each start (None: time 0)
    makespan: float
    engine_busy: dict  # (program, engine) -> busy seconds (DMA: time with >= 1 transfer in flight)
    dma_bytes: dict  # program -> bytes moved
    hbm_bytes: dict  # program -> HBM bytes

    def engine_of(self, i) -> str:
        return self.costs[i].engine


def _memory_reuse_deps(records, target: TargetSpec) -> dict:
    """Dependencies that finite SBUF/PSUM impose: seq -> predecessor seqs.

    Each on-chip allocation lives from the first to the last trace record that touches it (the
    liveness a compiler's allocator sees, in program order) and is placed first-fit in its core's
    per-partition address space (PSUM in whole 2 KiB banks). When a tile is placed on bytes that
    an earlier, dead tile occupied, its first access must wait for that tile's last access (WAR/WAW
    through the reused memory). Without this every allocation would be fresh memory and the
    schedule could overlap more buffers than the core holds.
    Placement is next-fit: the search starts where the previous allocation of that space ended and
    wraps around, so the memory freed longest ago is reused first (an allocator that leaves room
    for overlap when there is space; the NKI allocator's policy is not documented — INFERRED).
    If fragmentation leaves no gap, the tile waits for every tile live at that point (conservative).
    """
    first, last, size = {}, {}, {}
    for r in records:
        for op in r.reads + r.writes:
            if op.buffer not in ("sbuf", "psum") or not op.alloc_bytes_per_partition:
                continue
            key = (r.program, op.buffer, op.storage_id)
            first.setdefault(key, r.seq)
            last[key] = r.seq
            nbytes = op.alloc_bytes_per_partition
            if op.buffer == "psum":
                nbytes = -(-nbytes // target.psum_bank_bytes) * target.psum_bank_bytes
            size[key] = nbytes
    capacity = {"sbuf": target.sbuf_bytes_per_partition, "psum": target.psum_bytes_per_partition}
    starts, ends = {}, {}
    for key, seq in first.items():
        starts.setdefault(seq, []).append(key)
    for key, seq in last.items():
        ends.setdefault(seq, []).append(key)
    live = {}  # (program, buffer) -> {key: (lo, hi)}
    dead = {}  # (program, buffer) -> list of (lo, hi, last_seq)
    cursor = {}  # (program, buffer) -> end of the previous placement (next-fit)
    deps = {}

    def fit(ranges, nbytes, begin, limit):
        lo = begin
        for a, b in ranges:
            if b <= begin:
                continue
            if lo + nbytes <= a:
                break
            lo = max(lo, b)
        return lo if lo + nbytes <= limit else None

    for r in records:
        for key in starts.get(r.seq, ()):
            space = (key[0], key[1])
            ranges = sorted(live.setdefault(space, {}).values())
            nbytes, cap = size[key], capacity[key[1]]
            lo = fit(ranges, nbytes, cursor.get(space, 0), cap)
            if lo is None:
                lo = fit(ranges, nbytes, 0, cap)  # wrap around
            graveyard = dead.setdefault(space, [])
            if lo is None:  # fragmented: wait for every live tile, reuse from 0
                deps.setdefault(r.seq, set()).update(last[k] for k in live[space] if last[k] < r.seq)
                lo = 0
            hi = lo + nbytes
            cursor[space] = hi
            kept = []
            for a, b, q in graveyard:
                if a < hi and lo < b:
                    deps.setdefault(r.seq, set()).add(q)
                    if a < lo:
                        kept.append((a, lo, q))
                    if hi < b:
                        kept.append((hi, b, q))
                else:
                    kept.append((a, b, q))
            dead[space] = kept
            live[space][key] = (lo, hi)
        for key in ends.get(r.seq, ()):
            space = (key[0], key[1])
            lo, hi = live[space].pop(key)
            dead[space].append((lo, hi, r.seq))
    return deps


def schedule(trace, target="trn3", lnc: int | None = None) -> Schedule:
    """Place every trace record on its core's engines (rules in the module docstring)."""
    target = resolve_target(target) if isinstance(target, str) else target
    records = list(trace)
    for i, r in enumerate(records):
        if r.seq != i:
            raise CostModelError(f"trace record {i} has seq {r.seq}; pass the launch's full trace in order")
    programs = sorted({r.program for r in records}) or [0]
    lnc = lnc or (max(programs) + 1)
    n = len(records)
    costs = [instr_cost(r, target) for r in records]

    # ---- dependencies (per program) + barrier fences ----
    preds = [()] * n
    tracker = _Tracker()
    since_fence = {p: [] for p in programs}
    last_fence = {}
    barrier_index = [None] * n
    barrier_count = {p: 0 for p in programs}
    for i, r in enumerate(records):
        p = r.program
        if costs[i].kind == "barrier":
            d = set(since_fence[p])
            if p in last_fence:
                d.add(last_fence[p])
            since_fence[p] = []
            last_fence[p] = i
            barrier_index[i] = barrier_count[p]
            barrier_count[p] += 1
        else:
            d = tracker.deps(p, r, costs[i].engine)
            if p in last_fence:
                d.add(last_fence[p])
            since_fence[p].append(i)
        preds[i] = tuple(d)
    if len(set(barrier_count.values())) > 1:
        raise CostModelError(f"programs reached different numbers of core_barriers: {barrier_count}")
    for i, extra in _memory_reuse_deps(records, target).items():
        preds[i] = tuple(set(preds[i]) | {q for q in extra if q != i})
    succ = [[] for _ in range(n)]
    for i, ps in enumerate(preds):
        for q in ps:
            succ[q].append(i)

    start = [None] * n
    end = [None] * n
    blocker = [None] * n
    cnt = [len(ps) for ps in preds]
    dep_ready = [0.0] * n
    dep_arg = [None] * n  # predecessor with the latest end

    queues = {}  # (p, engine) -> list of seqs (program order)
    for i, r in enumerate(records):
        if costs[i].kind == "compute":
            queues.setdefault((r.program, costs[i].engine), []).append(i)
    qpos = {k: 0 for k in queues}
    free = {k: 0.0 for k in queues}
    last_on = {k: None for k in queues}
    busy = {k: 0.0 for k in queues}

    dma_pending = {p: [] for p in programs}  # heap of (ready, seq)
    barrier_arrivals = {}  # k -> {p: (time, seq)}
    known = []  # stack of seqs whose end just became known

    def set_end(i, s, e, why):
        start[i], end[i], blocker[i] = s, e, why
        known.append(i)

    def on_deps_known(i):
        c = costs[i]
        if c.kind == "dma":
            heapq.heappush(dma_pending[records[i].program], (dep_ready[i], i))
        elif c.kind == "barrier":
            k = barrier_index[i]
            arr = barrier_arrivals.setdefault(k, {})
            arr[records[i].program] = (dep_ready[i], i)
            if len(arr) == len(programs):
                t_all, who = max(arr.values())
                for p, (t, j) in arr.items():
                    set_end(j, t, t_all + c.seconds, who if who != j else dep_arg[j])

    def drain():
        """Propagate known ends; start compute instructions whose inputs are known."""
        progress = True
        while progress:
            progress = False
            while known:
                i = known.pop()
                for s in succ[i]:
                    if dep_arg[s] is None or end[i] >= dep_ready[s]:
                        dep_ready[s], dep_arg[s] = end[i], i
                    cnt[s] -= 1
                    if cnt[s] == 0:
                        on_deps_known(s)
            for k, seqs in queues.items():
                pos = qpos[k]
                while pos < len(seqs) and cnt[seqs[pos]] == 0:
                    i = seqs[pos]
                    if free[k] >= dep_ready[i]:
                        s, why = free[k], last_on[k]
                    else:
                        s, why = dep_ready[i], dep_arg[i]
                    e = s + costs[i].seconds
                    busy[k] += costs[i].seconds
                    free[k], last_on[k] = e, i
                    set_end(i, s, e, why)
                    pos += 1
                    progress = True
                qpos[k] = pos
            progress = progress or bool(known)

    for i in range(n):
        if cnt[i] == 0 and costs[i].kind != "compute":
            on_deps_known(i)
    drain()

    # ---- DMA fluid simulation ----
    hbm_stack_bw = target.hbm_bytes_per_s_per_chip / target.hbm_stacks_per_chip
    active = {p: {} for p in programs}  # seq -> [remaining, lat_end, rate]
    slot_freed_by = {p: None for p in programs}
    dma_busy = {p: 0.0 for p in programs}
    dma_bytes = {p: 0 for p in programs}
    hbm_bytes = {p: 0 for p in programs}
    clock = 0.0

    def rates():
        hbm_load = 0.0
        for p in programs:
            xfer = [(i, a) for i, a in active[p].items() if a[1] <= clock + 1e-15]
            want = sum(costs[i].dma.engines for i, _ in xfer)
            scale = min(1.0, target.dma_engines_per_core / want) if want else 1.0
            for i, a in xfer:
                w = costs[i].dma
                a[2] = w.engines * scale * w.rate_per_engine
                if w.hbm_bytes:
                    hbm_load += a[2] * w.hbm_bytes / max(1, w.nbytes)
            for i, a in active[p].items():
                if a[1] > clock + 1e-15:
                    a[2] = 0.0
        if hbm_load > hbm_stack_bw:
            f = hbm_stack_bw / hbm_load
            for p in programs:
                for i, a in active[p].items():
                    if costs[i].dma.hbm_bytes:
                        a[2] *= f

    remaining_total = sum(1 for c in costs if c.kind == "dma")
    while remaining_total:
        # start ready transfers on free queues
        for p in programs:
            pend, act = dma_pending[p], active[p]
            while pend and len(act) < target.dma_queues_per_core and pend[0][0] <= clock + 1e-15:
                ready, i = heapq.heappop(pend)
                s = max(clock, ready)
                why = dep_arg[i] if ready >= clock - 1e-15 and dep_arg[i] is not None else slot_freed_by[p]
                start[i], blocker[i] = s, why
                w = costs[i].dma
                act[i] = [float(w.nbytes), s + target.dma_fixed_latency_s, 0.0]
        rates()
        # next event
        t_next = math.inf
        for p in programs:
            if dma_pending[p] and len(active[p]) < target.dma_queues_per_core:
                t_next = min(t_next, max(clock, dma_pending[p][0][0]))
            for i, a in active[p].items():
                if a[1] > clock + 1e-15:
                    t_next = min(t_next, a[1])
                elif a[2] > 0:
                    t_next = min(t_next, clock + a[0] / a[2])
                else:
                    t_next = min(t_next, clock)  # zero-byte or stalled: settle now
        if t_next == math.inf:
            raise CostModelError("scheduler deadlock: DMA transfers wait on instructions that never run")
        dt = t_next - clock
        for p in programs:
            if active[p]:
                dma_busy[p] += dt
            for i, a in active[p].items():
                if a[2] > 0:
                    a[0] -= a[2] * dt
        clock = t_next
        for p in programs:
            done = [i for i, a in active[p].items() if a[1] <= clock + 1e-15 and a[0] <= 1e-6 * max(1.0, costs[i].dma.nbytes) + 1e-9]
            for i in done:
                del active[p][i]
                end[i] = clock
                known.append(i)
                slot_freed_by[p] = i
                dma_bytes[p] += costs[i].dma.nbytes
                hbm_bytes[p] += costs[i].dma.hbm_bytes
                remaining_total -= 1
        if known:
            drain()

    missing = [i for i in range(n) if end[i] is None]
    if missing:
        r = records[missing[0]]
        raise CostModelError(f"scheduler: {len(missing)} instruction(s) never ran (first: seq {r.seq} {r.instr})")
    engine_busy = {k: v for k, v in busy.items()}
    for p in programs:
        engine_busy[(p, "dma")] = dma_busy[p]
    makespan = max(end) if n else 0.0
    return Schedule(target.name, lnc, records, costs, start, end, blocker, makespan, engine_busy, dma_bytes,
                    hbm_bytes)


# =============================================================================================
# Reports
# =============================================================================================
def _peak_flops_per_core(target: TargetSpec, precision: str) -> float:
    bf16 = 2.0 * 128 * 128 * target.tensor_clock_hz  # 79 TFLOPS BF16 per NeuronCore (spec §6.2)
    return {"bf16": bf16, "fp8": 2 * bf16, "mx": 4 * bf16, "fp32": bf16 / target.matmul_fp32_factor}[precision]


def _infer_precision(records) -> str:
    kinds = set()
    for r in records:
        if r.instr == "nc_matmul_mx":
            kinds.add("mx")
        elif r.instr == "nc_matmul" and not r.attrs.get("transpose"):
            kinds.add("fp8" if r.attrs.get("perf_mode") == "double_row" else
                      "fp32" if r.attrs.get("in_dtype") in ("float32", "tfloat32") else "bf16")
    for p in ("mx", "fp8", "bf16", "fp32"):
        if p in kinds:
            return p
    return "bf16"


def scheduled_occupancy(sched: Schedule, target: TargetSpec) -> list:
    """Peak SBUF/PSUM bytes per partition per core *under the modeled schedule*.

    The simulator's capacity check counts a tile live while Python can reach it (program order),
    but the schedule overlaps loads of the next tile with work on the previous one, which on
    hardware needs both buffers at once. Here an on-chip allocation is live from the start of the
    first instruction touching it to the end of the last one (PSUM rounded to whole banks, as in
    the capacity rule); the sweep gives the occupancy the modeled overlap really requires.
    """
    spans = {}
    for i, r in enumerate(sched.records):
        for op in r.reads + r.writes:
            if op.buffer not in ("sbuf", "psum") or not op.alloc_bytes_per_partition:
                continue
            key = (r.program, op.storage_id)
            lo, hi, buf, nbytes = spans.get(key, (sched.start[i], sched.end[i], op.buffer, op.alloc_bytes_per_partition))
            spans[key] = (min(lo, sched.start[i]), max(hi, sched.end[i]), buf, nbytes)
    bank = target.psum_bank_bytes
    events = {}
    for (prog, _), (lo, hi, buf, nbytes) in spans.items():
        if buf == "psum":
            nbytes = -(-nbytes // bank) * bank
        events.setdefault((prog, buf), []).extend([(lo, nbytes), (hi, -nbytes)])
    peaks = [{"sbuf": 0, "psum": 0} for _ in range(sched.lnc)]
    for (prog, buf), evs in events.items():
        live = 0
        for _, delta in sorted(evs, key=lambda e: (e[0], e[1])):  # frees before allocations at equal times
            live += delta
            peaks[prog][buf] = max(peaks[prog][buf], live)
    return peaks


@dataclass
class CostReport:
    """Modeled cost of one kernel call. Build with `CostReport.from_schedule` or `model_kernel`."""

    schedule: Schedule
    target: TargetSpec
    phases: list  # phase label per instruction
    precision: str
    model_flops: float
    memory_peak: list = field(default_factory=list)  # per program {"sbuf": bytes, "psum": bytes} per partition
    launch_overhead_s: float = 0.0

    @classmethod
    def from_schedule(cls, sched: Schedule, target=None, phase_of=None, precision=None, model_flops=None,
                      memory_peak=None, include_launch_overhead=True):
        target = resolve_target(target or sched.target) if not isinstance(target, TargetSpec) else target
        phases = []
        for r in sched.records:
            ph = _phase_label(r)
            if ph is None and phase_of is not None:
                ph = phase_of(r)
            phases.append(ph or "kernel")
        flops = sum(c.flops for c in sched.costs) if model_flops is None else float(model_flops)
        return cls(sched, target, phases, precision or _infer_precision(sched.records), flops,
                   list(memory_peak or []), target.kernel_launch_overhead_s if include_launch_overhead else 0.0)

    # ---- derived numbers ----
    @property
    def scheduled_peak(self) -> list:
        return scheduled_occupancy(self.schedule, self.target)

    @property
    def scheduled_capacity_exceeded(self) -> bool:
        """True when the modeled overlap needs more SBUF/PSUM than the core has: the modeled time
        is then optimistic (the kernel would have to serialise some loads)."""
        return any(p["sbuf"] > self.target.sbuf_bytes_per_partition or p["psum"] > self.target.psum_bytes_per_partition
                   for p in self.scheduled_peak)

    @property
    def makespan_s(self) -> float:
        return self.schedule.makespan

    @property
    def modeled_time_s(self) -> float:
        return self.schedule.makespan + self.launch_overhead_s

    @property
    def peak_flops(self) -> float:
        return _peak_flops_per_core(self.target, self.precision) * self.schedule.lnc

    @property
    def hbm_bandwidth(self) -> float:
        """Peak HBM throughput available to the launch: its stack, limited by its cores' DMA engines."""
        t = self.target
        dma = self.schedule.lnc * t.dma_engines_per_core * t.dma_bytes_per_s_per_engine
        return min(t.hbm_bytes_per_s_per_chip / t.hbm_stacks_per_chip, dma)

    def _critical_path(self):
        s = self.schedule
        if not s.records:
            return []
        i = max(range(len(s.end)), key=lambda j: s.end[j])
        path, seen = [], set()
        while i is not None and i not in seen:
            seen.add(i)
            path.append(i)
            i = s.blocker[i]
        return path[::-1]

    def to_json(self) -> dict:
        s = self.schedule
        t = self.modeled_time_s
        engines = {}
        for (p, eng), b in sorted(s.engine_busy.items()):
            engines.setdefault(str(p), {})[eng] = {
                "busy_s": b, "utilisation": b / s.makespan if s.makespan else 0.0,
                "instructions": sum(1 for r, c in zip(s.records, s.costs) if r.program == p and c.engine == eng)}
        phases = {}
        for i, (r, c) in enumerate(zip(s.records, s.costs)):
            ph = phases.setdefault(self.phases[i], {"start_s": math.inf, "end_s": 0.0, "flops": 0.0, "hbm_bytes": 0,
                                                    "instructions": 0, "critical_path_s": 0.0,
                                                    "critical_path_by_engine_s": {}})
            ph["start_s"] = min(ph["start_s"], s.start[i])
            ph["end_s"] = max(ph["end_s"], s.end[i])
            ph["flops"] += c.flops
            ph["hbm_bytes"] += c.dma.hbm_bytes if c.dma else 0
            ph["instructions"] += 1
        for i in self._critical_path():
            ph = phases[self.phases[i]]
            d = s.end[i] - s.start[i]
            ph["critical_path_s"] += d
            eng = s.costs[i].engine
            ph["critical_path_by_engine_s"][eng] = ph["critical_path_by_engine_s"].get(eng, 0.0) + d
        for ph in phases.values():
            span = max(ph["end_s"] - ph["start_s"], 1e-30)
            ph["span_s"] = span
            ph["achieved_flops_per_s"] = ph["flops"] / span
            ph["hbm_bytes_per_s"] = ph["hbm_bytes"] / span
            ph["arithmetic_intensity"] = ph["flops"] / ph["hbm_bytes"] if ph["hbm_bytes"] else None
        hbm = sum(s.hbm_bytes.values())
        return {
            "target": self.target.name, "lnc": s.lnc, "instructions": len(s.records),
            "makespan_s": s.makespan, "launch_overhead_s": self.launch_overhead_s, "modeled_time_s": t,
            "precision": self.precision, "model_flops": self.model_flops, "peak_flops_per_s": self.peak_flops,
            "mfu": self.model_flops / (t * self.peak_flops) if t else 0.0,
            "mfu_kernel_only": self.model_flops / (s.makespan * self.peak_flops) if s.makespan else 0.0,
            "hbm_bytes": hbm, "hbm_peak_bytes_per_s": self.hbm_bandwidth,
            "hbm_utilisation": hbm / (t * self.hbm_bandwidth) if t else 0.0,
            "dma_bytes": sum(s.dma_bytes.values()),
            "engines": engines, "phases": phases,
            "memory_peak_bytes_per_partition": self.memory_peak,
            "scheduled_peak_bytes_per_partition": self.scheduled_peak,
            "scheduled_capacity_exceeded": self.scheduled_capacity_exceeded,
        }

    def table(self) -> str:
        j = self.to_json()
        lines = [
            f"target {j['target']}  lnc {j['lnc']}  instructions {j['instructions']}",
            f"modeled time {j['modeled_time_s'] * 1e6:10.2f} us  (makespan {j['makespan_s'] * 1e6:.2f} us + launch "
            f"{j['launch_overhead_s'] * 1e6:.2f} us)",
            f"TensorE MFU ({j['precision']}) {j['mfu'] * 100:6.2f} %  (kernel only {j['mfu_kernel_only'] * 100:.2f} %), "
            f"model FLOPs {j['model_flops']:.4g}",
            f"HBM {j['hbm_bytes'] / 1e6:10.3f} MB  utilisation {j['hbm_utilisation'] * 100:6.2f} % of "
            f"{j['hbm_peak_bytes_per_s'] / 1e9:.0f} GB/s",
            "",
            f"{'core':>4} {'engine':<8} {'busy us':>10} {'util %':>7} {'instrs':>7}",
        ]
        for p, engs in j["engines"].items():
            for eng, v in engs.items():
                lines.append(f"{p:>4} {eng:<8} {v['busy_s'] * 1e6:10.2f} {v['utilisation'] * 100:7.1f} {v['instructions']:7d}")
        lines += ["", f"{'phase':<16} {'span us':>10} {'crit us':>10} {'GFLOP':>10} {'HBM MB':>10} {'TFLOP/s':>8}  critical path by engine"]
        for name, ph in j["phases"].items():
            crit = ", ".join(f"{e} {v * 1e6:.1f}" for e, v in sorted(ph["critical_path_by_engine_s"].items()))
            lines.append(f"{name:<16} {ph['span_s'] * 1e6:10.2f} {ph['critical_path_s'] * 1e6:10.2f} "
                         f"{ph['flops'] / 1e9:10.3f} {ph['hbm_bytes'] / 1e6:10.3f} "
                         f"{ph['achieved_flops_per_s'] / 1e12:8.2f}  {crit}")
        if self.memory_peak:
            lines.append("")
            for p, m in enumerate(self.memory_peak):
                lines.append(f"core {p} peak SBUF {m.get('sbuf', 0) / 1024:.1f} KiB / "
                             f"{self.target.sbuf_bytes_per_partition / 1024:.0f} KiB per partition, PSUM "
                             f"{m.get('psum', 0) / 1024:.1f} KiB / {self.target.psum_bytes_per_partition / 1024:.0f} KiB")
        for p, m in enumerate(self.scheduled_peak):
            lines.append(f"core {p} occupancy the modeled overlap needs: SBUF {m['sbuf'] / 1024:.1f} KiB, "
                         f"PSUM {m['psum'] / 1024:.1f} KiB per partition")
        if self.scheduled_capacity_exceeded:
            lines.append("WARNING: the modeled schedule overlaps more buffers than SBUF/PSUM hold; "
                         "the modeled time is optimistic")
        return "\n".join(lines)

    def plot(self, out_dir, prefix="cost") -> list:
        """Write `{prefix}_timeline_core{p}.png` per core and `{prefix}_roofline.png`; returns the paths."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        os.makedirs(out_dir, exist_ok=True)
        s = self.schedule
        paths = []
        lanes = ["tensor", "vector", "scalar", "gpsimd", "dma", "barrier"]
        phase_names = sorted(set(self.phases))
        cmap = plt.get_cmap("tab10")
        colors = {ph: cmap(k % 10) for k, ph in enumerate(phase_names)}
        for p in sorted({r.program for r in s.records}):
            fig, ax = plt.subplots(figsize=(12, 3.5))
            dma_rows = []  # greedy lanes so overlapping DMAs stay visible
            for i, r in enumerate(s.records):
                if r.program != p:
                    continue
                eng = s.costs[i].engine
                if eng == "dma":
                    row = next((k for k, e in enumerate(dma_rows) if e <= s.start[i]), None)
                    if row is None:
                        row = len(dma_rows)
                        dma_rows.append(0.0)
                    dma_rows[row] = s.end[i]
                    y = lanes.index("dma") + 0.8 * row / max(1, self.target.dma_queues_per_core)
                    h = 0.8 / max(1, self.target.dma_queues_per_core)
                else:
                    y, h = lanes.index(eng), 0.8
                ax.broken_barh([(s.start[i] * 1e6, max((s.end[i] - s.start[i]) * 1e6, 1e-4))], (y, h),
                               facecolors=colors[self.phases[i]])
            ax.set_yticks([k + 0.4 for k in range(len(lanes))], lanes)
            ax.set_xlabel("time (us)")
            ax.set_title(f"engine timeline, core {p} ({self.target.name}, lnc {s.lnc}); makespan "
                         f"{s.makespan * 1e6:.1f} us")
            handles = [plt.Rectangle((0, 0), 1, 1, color=colors[ph]) for ph in phase_names]
            ax.legend(handles, phase_names, loc="upper right", fontsize=7)
            fig.tight_layout()
            path = os.path.join(out_dir, f"{prefix}_timeline_core{p}.png")
            fig.savefig(path, dpi=110)
            plt.close(fig)
            paths.append(path)
        # roofline: one point per phase
        j = self.to_json()
        fig, ax = plt.subplots(figsize=(6, 4.5))
        peak, bw = self.peak_flops, self.hbm_bandwidth
        xs = [2 ** (k / 8) for k in range(-32, 112)]
        ax.loglog(xs, [min(peak, x * bw) / 1e12 for x in xs], "k-", label=f"roof ({self.precision}, HBM)")
        for name, ph in j["phases"].items():
            ai = ph["arithmetic_intensity"]
            if ai:
                ax.loglog([ai], [ph["achieved_flops_per_s"] / 1e12], "o", color=colors[name], label=name)
        ax.set_xlabel("arithmetic intensity (FLOP / HBM byte)")
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"roofline ({self.target.name}, lnc {s.lnc})")
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(out_dir, f"{prefix}_roofline.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
        return paths

    def save_json(self, path) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1, default=str)


# =============================================================================================
# Entry points
# =============================================================================================
@contextlib.contextmanager
def _target_env(target):
    name = target.name if isinstance(target, TargetSpec) else resolve_target(target).name
    old = os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE")
    os.environ["NEURON_PLATFORM_TARGET_OVERRIDE"] = name
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("NEURON_PLATFORM_TARGET_OVERRIDE", None)
        else:
            os.environ["NEURON_PLATFORM_TARGET_OVERRIDE"] = old


def model_kernel(kernel_fn, inputs, lnc: int = 1, target="trn3", numerics: bool = False, kwargs=None,
                 phase_of=None, precision=None, model_flops=None) -> CostReport:
    """Run `kernel_fn` on the simulator with a trace and model its cost.

    Args:
        kernel_fn: the NKI kernel function (plain or `nki.jit`-wrapped).
        inputs: positional inputs (tuple/list) or keyword inputs (dict): numpy arrays (np.empty is
            enough when numerics=False) or `ShapeSpec(shape, dtype)` (shape-only runs).
        lnc: 1 or 2.
        target: "trn2" / "trn3" (or a TargetSpec).
        numerics: False = shape-only run (no arithmetic; shapes, dtypes, trace and checks only).
        kwargs: extra keyword arguments for the kernel (non-tensor options).
        phase_of: optional callable(InstrRecord) -> phase label (see module docstring).
        precision: peak used for MFU: "bf16" / "fp8" / "mx" / "fp32" (default: from the matmuls).
        model_flops: FLOPs of the modeled computation (default: sum of matmul FLOPs in the trace).
    """
    from .launcher import run_kernel

    fn = getattr(kernel_fn, "fn", None) or getattr(kernel_fn, "func", None) or kernel_fn
    args, kw = ((), dict(inputs)) if isinstance(inputs, dict) else (tuple(inputs), {})
    kw.update(kwargs or {})
    spec = resolve_target(target) if not isinstance(target, TargetSpec) else target
    with _target_env(spec):
        res = run_kernel(fn, args, kw, lnc=lnc, trace=True, numerics=numerics)
    sched = schedule(res.trace, spec, lnc)
    return CostReport.from_schedule(sched, spec, phase_of=phase_of, precision=precision, model_flops=model_flops,
                                    memory_peak=res.peak_bytes_per_partition)


def predict_bf16_gemm_time_report(M: int, K: int, N: int, lnc: int = 2, target: str = "trn3") -> CostReport:
    """CostReport of nkilib's BF16 tiled matmul kernel for C[M,N] = A[M,K] @ B[K,N] (shape-only run)."""
    import ml_dtypes

    from ..examples.bf16_matmul import bf16_matmul  # lazy: the simulator core does not depend on kernels
    from .launcher import ShapeSpec

    bf16 = ml_dtypes.bfloat16
    return model_kernel(bf16_matmul, (ShapeSpec((K, M), bf16), ShapeSpec((K, N), bf16)), lnc=lnc, target=target,
                        model_flops=2.0 * M * K * N, precision="bf16")


def predict_bf16_gemm_time(M: int, K: int, N: int, lnc: int = 2, target: str = "trn3") -> float:
    """Modeled time (seconds) of C[M,N] = A[M,K] @ B[K,N] in BF16 with nkilib's tiled matmul kernel.

    Models nkilib/examples/bf16_matmul.py (A given K-major, see that module) shape-only, including
    the calibrated per-call launch overhead. Compare with new measurements via
    simulations/calibrate_bf16_gemm.py.
    """
    return predict_bf16_gemm_time_report(M, K, N, lnc=lnc, target=target).modeled_time_s
