"""Per-instruction costs: what one trace record asks of its engine (see the package docstring)."""
from __future__ import annotations

from dataclasses import dataclass

from ..hardware import TargetSpec
from .dma import DmaWork, dma_work
from .operands import (CostModelError, _elems_per_partition, _find, _free_elems, _is_contiguous, _on_chip, _onchip_ops,
                       _op_name, _parts)

_COMPUTE_ENGINES = ("tensor", "vector", "scalar", "gpsimd")
_TWO_BYTE = ("bfloat16", "float16")
_FP8 = ("float8_e4m3", "float8_e5m2", "float8_e4m3fn")


@dataclass
class InstrCost:
    """Cost of one instruction: fixed-duration engine work, a DMA transfer, or a barrier."""

    kind: str  # "compute" / "dma" / "barrier"
    engine: str
    seconds: float = 0.0  # compute: duration on its engine
    cycles: float = 0.0
    flops: float = 0.0  # model FLOPs (matmuls, not transposes)
    dma: DmaWork | None = None
    shared_bus: bool = False  # uses the SBUF bus VectorE's perf modes share with GpSimd [TRN2]


def _engine_clock(target: TargetSpec, engine: str) -> float:
    # the Sync engine is a sequencer without a data path [TRN1]; its clock is not documented: the
    # GpSimd/ScalarE clock is used (INFERRED)
    clocks = {"tensor": target.tensor_clock_hz, "vector": target.vector_clock_hz,
              "scalar": target.scalar_clock_hz, "gpsimd": target.gpsimd_clock_hz, "sync": target.gpsimd_clock_hz}
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
        # [LEGACY] Tensor: max(P, min(64, F)) for the MultiplyMoving of the identity; the data is the
        # stationary ("nc_matmul(transpose_input, identity)", [TRN1]): its F columns load first, exposed
        # like every LoadStationary here (see _stationary_load_cycles). NC-v4 background transposes [TRN3]
        # are not modeled (the hardware decides when they run).
        cyc = max(p, min(target.matmul_min_cycles, f)) + _stationary_load_cycles(f, target)
        return InstrCost("compute", "tensor", cyc / target.tensor_clock_hz, cyc)
    return _act_like(rec, target, f)  # Vector: max(MIN_II, N)


def _cost_quantize_mx(rec, target):
    """4 source elements / partition / cycle in VectorE's 4x mode [TRN3], which needs unit-stride data
    operands [TRN2]; a strided source (e.g. the 4 packed elements taken from 4 rows) runs slower
    (`quantize_mx_strided_elems_per_cycle`)."""
    src = _find(rec.reads, "src") or rec.reads[0]
    dst = _find(rec.writes, "dst")
    contiguous = all(_is_contiguous(o) for o in (src, dst) if o is not None)
    per = target.quantize_mx_elems_per_cycle if contiguous else target.quantize_mx_strided_elems_per_cycle
    c = _act_like(rec, target, _free_elems(src) / (per or 1))
    c.shared_bus = True  # a VectorE perf mode (4x / 2x)
    return c


def _cost_copy_like(rec, target):
    factor = _perf_factor(rec, target)
    c = _act_like(rec, target, _elems_per_partition(rec) / factor)
    c.shared_bus = rec.engine == "vector" and factor > 1
    return c


def _cost_memset(rec, target):
    dst = rec.writes[0]
    n = _free_elems(dst)
    value = rec.attrs.get("value", 0)
    # [LEGACY] zero into bf16/fp16: max(MIN_II, N/2); else max(MIN_II, N). value not recorded -> zero-fill
    if dst.dtype in _TWO_BYTE and (value == 0 or value is None):
        n = n / 2
    return _act_like(rec, target, n)


def _tensor_tensor_work(n, ins, ops, op, engine):
    """Cycles (before the access overhead) and shared-bus use of an elementwise pass over two input tiles."""
    psum_in = sum(o.buffer == "psum" for o in ins)
    all_bf16 = all(o.dtype == "bfloat16" for o in ops)
    fast_op = any(k in op for k in ("add", "multiply", "subtract"))
    # [LEGACY] N if one input PSUM + one SBUF, or both SBUF, all bf16, add/mul/sub, unit stride; else 2N
    if (psum_in == 1 and len(ins) == 2) or (psum_in == 0 and all_bf16 and fast_op
                                            and all(_is_contiguous(o) for o in ops)):
        return n, engine == "vector" and psum_in == 0  # the 2x perf mode [TRN2]
    return 2 * n, False


def _cost_tensor_tensor(rec, target):
    ins = [o for o in rec.reads if _on_chip(o)][:2]
    work, shared = _tensor_tensor_work(_elems_per_partition(rec), ins, _onchip_ops(rec), _op_name(rec, "op"),
                                       rec.engine)
    c = _act_like(rec, target, work)
    c.shared_bus = shared
    return c


def _cost_scalar_tensor_tensor(rec, target):
    n = _elems_per_partition(rec)
    data = _find(rec.reads, "data")
    op1 = _find(rec.reads, "operand1")
    if rec.attrs.get("reduce_op"):
        return _cost_scalar_tensor_tensor_reduce(rec, target, n, data, op1)
    fast = (data is not None and op1 is not None and data.dtype == "bfloat16" and op1.dtype == "bfloat16"
            and "subtract" in _op_name(rec, "op0") and "multiply" in _op_name(rec, "op1") and n % 2 == 0)
    return _act_like(rec, target, n if fast else 2 * n)  # [LEGACY] N if bf16 sub/mul and N even, else 2N


def _cost_scalar_tensor_tensor_reduce(rec, target, n, data, op1):
    """NKI 0.7's scalar_tensor_tensor with a free-axis reduce (reduce_op): "approximately the same latency as a
    regular tensor_tensor instruction" [STT07], i.e. tensor_tensor's [LEGACY] formula on data and operand1, plus
    the reduce's "small additional performance cost" [TSR07]: MIN_II (central) or, with no figure in the docs,
    a separate reduce pass at the pessimistic end (hardware.vector_reduce_separate_pass)."""
    ins = [o for o in (data, op1) if o is not None]
    ops = [o for o in _onchip_ops(rec) if o.arg != "reduce_res"]
    work, shared = _tensor_tensor_work(n, ins, ops, _op_name(rec, "op1"), rec.engine)
    if target.vector_reduce_separate_pass:
        work += n + target.engine_access_overhead_cycles  # a tensor_reduce of the N fp32 results
    else:
        work = max(target.min_ii_cycles, work) + target.min_ii_cycles
    c = _act_like(rec, target, work)
    c.shared_bus = shared
    return c


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


def _cost_dma(rec, target):
    return InstrCost("dma", "dma", dma=dma_work(rec, target))


def _control_engine(rec) -> str:
    """Engine whose sequencer runs a control instruction: its own when it is a compute engine, else Sync."""
    return rec.engine if rec.engine in _COMPUTE_ENGINES else "sync"


def _cost_dynamic_loop(rec, target):
    """Hardware loop overhead: `trip_count` compare-and-branch iterations (ESTIMATE, hardware.py). The body's
    instructions are traced (and priced) once per iteration taken; this prices only the loop control."""
    eng = _control_engine(rec)
    cyc = int(rec.attrs.get("trip_count") or 0) * target.dynamic_loop_iteration_cycles
    return InstrCost("compute", eng, cyc / _engine_clock(target, eng), cyc)


def _cost_register(rec, target):
    """register_alloc / register_move: a sequencer ALU op; register_load / register_store: one SBUF access
    (the ~60-cycle access-initiation overhead [TRN1]). ESTIMATE, see hardware.py."""
    eng = _control_engine(rec)
    memory = rec.instr in ("register_load", "register_store")
    cyc = target.engine_access_overhead_cycles if memory else target.register_alu_cycles
    return InstrCost("compute", eng, cyc / _engine_clock(target, eng), cyc)


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
    "dynamic_loop": _cost_dynamic_loop,
    "register_alloc": _cost_register,
    "register_move": _cost_register,
    "register_load": _cost_register,
    "register_store": _cost_register,
}
_ANY_ENGINE = (_cost_dma, _cost_barrier, _cost_nc_matmul, _cost_nc_matmul_mx, _cost_dynamic_loop, _cost_register)


def instr_cost(rec, target: TargetSpec) -> InstrCost:
    """Cost of one trace record on `target` (see module docstring for the formulas)."""
    fn = COST_FUNCTIONS.get(rec.instr)
    if fn is None:
        raise CostModelError(
            f"no cost formula for instruction '{rec.instr}' (engine {rec.engine}, trace seq {rec.seq}); "
            f"add one to nkilib.simulator.cost.COST_FUNCTIONS (known: {sorted(COST_FUNCTIONS)})")
    if fn not in _ANY_ENGINE and rec.engine not in _COMPUTE_ENGINES:
        raise CostModelError(f"{rec.instr}: engine {rec.engine!r} is not a compute engine")
    cost = fn(rec, target)
    if cost.kind == "compute" and rec.engine == "gpsimd" and any(o.buffer == "sbuf" for o in _onchip_ops(rec)):
        cost.shared_bus = True  # GpSimd's SBUF access shares the bus with VectorE's perf modes [TRN2]
    return cost

