"""Hand-built trace operands and records for the cost-model tests (import as `from costkit import ...`)."""
from __future__ import annotations

from nkilib.simulator.trace import InstrRecord, OperandInfo

ISZ = {"bfloat16": 2, "float32": 4, "float16": 2, "uint8": 1, "float8_e4m3fn_x4": 4}
_ids = iter(range(10_000, 1_000_000))


def new_id() -> int:
    """A storage id no other hand-built operand uses."""
    return next(_ids)


def chip(arg, buffer, dtype, shape, sid=None, p0=0, f0=0, alloc=0):
    """OperandInfo of a contiguous [P, F] on-chip tile (free bytes f0.. of partitions p0..); `alloc`: the
    allocation's bytes per partition (0: not tracked by the allocator)."""
    s = ISZ[dtype]
    P, F = shape
    row = 1 << 20  # storage row length (bytes); only needs to exceed the tile
    return OperandInfo(arg, sid or new_id(), "t", buffer, dtype, shape, p0, p0 + P, f0, f0 + F * s, P * F * s,
                       p0 * row + f0, (row, s), s, alloc)


def chip_view(arg, dtype, shape, strides_elems, sid=None):
    """OperandInfo of an SBUF view [P, ...] with the given per-dim strides (elements; dim 0 = partition)."""
    s = ISZ[dtype]
    free = 1
    for n in shape[1:]:
        free *= n
    span = sum((n - 1) * st for n, st in zip(shape[1:], strides_elems[1:])) + 1
    return OperandInfo(arg, sid or new_id(), "t", "sbuf", dtype, tuple(shape), 0, shape[0], 0, span * s,
                       shape[0] * free * s, 0, tuple(st * s for st in strides_elems), s)


def hbm(arg, dtype, shape, row_elems, r0=0, c0=0, sid=None):
    """OperandInfo of a [R, C] tile of a row-major HBM matrix with `row_elems` columns."""
    s = ISZ[dtype]
    R, C = shape
    off = (r0 * row_elems + c0) * s
    return OperandInfo(arg, sid or new_id(), "h", "shared_hbm", dtype, shape, 0, 1, off,
                       off + ((R - 1) * row_elems + C) * s, R * C * s, off, (row_elems * s, s), s)


def rec(seq, instr, engine, reads=(), writes=(), program=0, **attrs):
    return InstrRecord(seq, program, instr, engine, tuple(reads), tuple(writes), attrs)
