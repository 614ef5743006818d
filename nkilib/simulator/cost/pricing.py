"""Per-instruction costs: what one trace record asks of its engine (see the package docstring)."""
from __future__ import annotations

from dataclasses import dataclass

from ..hardware import TargetSpec
from .operands import (CostModelError, _contig_run_elems, _elems_per_partition, _find, _free_elems, _is_contiguous,
                       _itemsize, _on_chip, _onchip_ops, _op_name, _ops, _parts)

_COMPUTE_ENGINES = ("tensor", "vector", "scalar", "gpsimd")
_TWO_BYTE = ("bfloat16", "float16")
_FP8 = ("float8_e4m3", "float8_e5m2", "float8_e4m3fn")


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
    """Elementwise speed-up of tensor_copy / tensor_scalar ([TRN2]/[TRN3] perf modes)."""
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
    """LoadStationary of an [K, M] stationary: M/4 cycles (4x a MultiplyMoving of equal free size, [PERF]).

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
        cyc *= target.matmul_fp32_factor  # fp32 ~4x slower [LEGACY]
    # double_row: contraction 2K in the same cycles (2x FP8 throughput, [TRN2]); K already is 2K in the trace
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
    # exponential: 4x the ScalarE exp throughput [TRN3]
    return _act_like(rec, target, _elems_per_partition(rec) / 4)


def dma_work(rec, target: TargetSpec) -> DmaWork:
    """Bytes, descriptor payload, engines and per-engine rate of one DMA record."""
    ops = _ops(rec)
    if not ops:
        raise CostModelError(f"{rec.instr}: DMA record without operands")
    nbytes = int(rec.attrs.get("bytes") or max(o.nbytes for o in ops))
    transpose = bool(rec.attrs.get("transpose")) or rec.instr == "dma_transpose"
    if transpose:
        # hwdge transpose moves [16 x n] blocks: every partition receives 16-element pieces ([DMAT]; INFERRED)
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
    # further documented [LEGACY] formulas
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

