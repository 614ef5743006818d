"""Instruction trace for the cost model (issue 4).

A launch with `trace=True` collects one `InstrRecord` per ISA instruction, per program.
Records hold only plain data (no tensor references) so they never keep tiles alive.
Operand regions are exact enough for dependency tracking: on-chip operands give the partition
range and the byte range inside each partition; HBM operands give the byte range in the storage.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field


@dataclass(frozen=True)
class OperandInfo:
    arg: str
    storage_id: int
    name: str
    buffer: str  # sbuf / psum / private_hbm / shared_hbm
    dtype: str
    shape: tuple
    partition_lo: int  # on-chip: first partition; HBM: 0
    partition_hi: int  # on-chip: one past the last partition; HBM: 1
    byte_lo: int  # on-chip: within a partition; HBM: within the storage
    byte_hi: int
    nbytes: int  # bytes the operand touches (elements x NKI itemsize)
    # exact access pattern (storage bytes), so the cost model can tell apart disjoint strided HBM tiles
    byte_offset: int = 0  # first element's byte offset in the storage
    strides: tuple = ()  # per-dim strides in bytes (dim 0 = partition dim for on-chip operands)
    storage_itemsize: int = 0  # bytes per element in the storage (strides/offset unit); 0 = unknown
    alloc_bytes_per_partition: int = 0  # on-chip: the whole allocation's bytes per partition (capacity rule)


@dataclass(frozen=True)
class InstrRecord:
    seq: int
    program: int
    instr: str  # e.g. "nc_matmul_mx"
    engine: str  # tensor / vector / scalar / gpsimd / dma / sync
    reads: tuple
    writes: tuple
    attrs: dict = field(default_factory=dict)


def operand_info(arg: str, view) -> OperandInfo:
    st = view.storage
    isz = view.itemsize_storage
    lo = hi = view.offset
    for n, s in zip(view.shape, view.strides):
        if s >= 0:
            hi += (n - 1) * s
        else:
            lo += (n - 1) * s
    byte_lo, byte_hi = lo * isz, (hi + 1) * isz
    nbytes = view.size * view.dtype.itemsize
    if st.on_chip:
        row = st.row_bytes
        p0 = byte_lo // row
        p1 = p0 + view.shape[0]
        free_lo = byte_lo - p0 * row
        free_hi = free_lo + (byte_hi - byte_lo) - (view.shape[0] - 1) * row if view.shape[0] > 1 else byte_hi - p0 * row
        return OperandInfo(arg, st.id, st.name, st.buffer_kind, str(view.dtype), view.shape, p0, p1, free_lo,
                           free_hi, nbytes, view.offset * isz, tuple(s * isz for s in view.strides), isz,
                           st.nki_bytes_per_partition)
    return OperandInfo(arg, st.id, st.name, st.buffer_kind, str(view.dtype), view.shape, 0, 1, byte_lo, byte_hi,
                       nbytes, view.offset * isz, tuple(s * isz for s in view.strides), isz)


def make_record(ctx, instr, engine, reads=(), writes=(), **attrs) -> InstrRecord:
    trace = ctx.trace
    if ctx.phase is not None:
        attrs.setdefault("phase", ctx.phase)
    return InstrRecord(
        seq=len(trace),
        program=ctx.program_id,
        instr=instr,
        engine=engine,
        reads=tuple(operand_info(a, v) for a, v in reads if v is not None),
        writes=tuple(operand_info(a, v) for a, v in writes if v is not None),
        attrs=attrs,
    )


@contextlib.contextmanager
def label_phases(module, labels: dict):
    """While active, instructions issued inside `module.<function>` carry `attrs["phase"] = label`.

    A tooling hook for the cost report (critical path by phase) that leaves kernel code untouched:
    it wraps the named module-level functions, so calls made through the module's globals (as a
    base kernel calling its phase functions does) are labelled. Nested labels: the innermost wins.
    """
    from . import runtime

    originals = {name: getattr(module, name) for name in labels}

    def wrap(fn, label):
        @functools.wraps(fn)
        def labelled(*args, **kwargs):
            ctx = runtime.current()
            outer, ctx.phase = ctx.phase, label
            try:
                return fn(*args, **kwargs)
            finally:
                ctx.phase = outer

        return labelled

    try:
        for name, label in labels.items():
            setattr(module, name, wrap(originals[name], label))
        yield
    finally:
        for name, fn in originals.items():
            setattr(module, name, fn)
