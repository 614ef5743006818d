"""Data movement on compute engines: tensor_copy, memset (spec §5.5)."""
from __future__ import annotations

import numbers

import numpy as np

from ...tensor import checked_read, checked_write, to_float32
from . import constants as C
from ._common import NkiInstruction, ctx, fail, on_chip, resolve_engine, same_partitions_and_free


def _engine_buffers(instr, eng, *tiles):
    if eng == C.engine.gpsimd:
        for arg, t in tiles:
            if t.storage.buffer_kind == "psum":
                fail(instr, f"engine gpsimd cannot access PSUM (argument '{arg}', '{t.name}')")


def tensor_copy(dst, src, engine=C.engine.unknown, name=None):
    """Copy a tile: same dtype -> bit-exact; otherwise through fp32 then RNE to dst (spec §5.5)."""
    instr = "tensor_copy"
    dst = on_chip(instr, "dst", dst)
    src = on_chip(instr, "src", src)
    same_partitions_and_free(instr, "dst", dst, "src", src)
    eng = resolve_engine(instr, engine, (C.engine.vector, C.engine.scalar, C.engine.gpsimd), C.engine.vector)
    _engine_buffers(instr, eng, ("dst", dst), ("src", src))
    if dst.dtype != src.dtype and (dst.dtype.is_x4 or src.dtype.is_x4):
        fail(instr, f"cannot convert packed {src.dtype} to {dst.dtype}; x4 tiles copy only to the same dtype")
    c = ctx()
    c.record(instr=instr, engine=eng.name, reads=[("src", src)], writes=[("dst", dst)],
             elems=dst.free_size, src_dtype=str(src.dtype), dst_dtype=str(dst.dtype))
    raw = checked_read(src, instr, "src")
    if raw is None:
        values = None
    elif dst.dtype == src.dtype:
        values = raw.reshape(-1)
    else:
        values = to_float32(src, raw).reshape(-1)
    checked_write(dst, instr, "dst", values)
    return NkiInstruction(name)


def memset(dst, value, engine=C.engine.unknown, name=None):
    """Fill a tile with a compile-time constant; value type must match dst dtype (0.3.0+, spec §5.5)."""
    instr = "memset"
    dst = on_chip(instr, "dst", dst)
    eng = resolve_engine(instr, engine, (C.engine.vector, C.engine.gpsimd), C.engine.vector)
    _engine_buffers(instr, eng, ("dst", dst))
    dt = dst.dtype
    is_int_value = isinstance(value, (numbers.Integral, np.integer)) and not isinstance(value, (bool, np.bool_))
    is_float_value = isinstance(value, (float, np.floating))
    if dt.is_x4:
        if not ((is_int_value or is_float_value) and value == 0):
            fail(instr, f"packed dtype {dt} can only be set to 0, got {value!r}")
        fill = np.zeros(1, dtype=dst.np_dtype)
    elif dt.category == "scale":
        if not is_float_value or value <= 0 or np.frexp(value)[0] != 0.5:
            fail(instr, f"value for {dt} must be a float power of two, got {value!r}")
        fill = np.array([int(np.frexp(value)[1]) - 1 + 127], np.uint8)
        if not 0 <= int(fill[0]) <= 254:
            fail(instr, f"value {value!r} is outside the float8_e8m0fnu range")
    elif dt.is_int:
        if not (is_int_value or (dt == "bool_" and isinstance(value, (bool, np.bool_)))):
            fail(instr, f"value for integer dtype {dt} must be an int, got {type(value).__name__} {value!r}")
        fill = np.array([int(value)])
    else:
        if not is_float_value:
            fail(instr, f"value for float dtype {dt} must be a float, got {type(value).__name__} {value!r}")
        fill = np.array([value], np.float32)
    c = ctx()
    c.record(instr=instr, engine=eng.name, writes=[("dst", dst)], elems=dst.free_size, dst_dtype=str(dt))
    values = None if not c.numerics else np.broadcast_to(fill, (dst.size,))
    checked_write(dst, instr, "dst", values)
    return NkiInstruction(name)
