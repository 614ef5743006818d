"""Data movement on compute engines: tensor_copy, memset.

References:
    https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.tensor_copy.html
    https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.memset.html
"""
from __future__ import annotations

import numbers

import numpy as np

from ...access import checked_copy_read, checked_write, to_float32
from . import constants as C
from ._common import NkiInstruction, ctx, fail, on_chip, resolve_engine, same_partitions_and_free


def _engine_buffers(instr, eng, *tiles):
    if eng == C.engine.gpsimd:
        for arg, t in tiles:
            if t.storage.buffer_kind == "psum":
                fail(instr, f"engine gpsimd cannot access PSUM (argument '{arg}', '{t.name}')")


def tensor_copy(dst, src, engine=C.engine.unknown, name=None):
    """Copy a tile: same dtype -> bit-exact; otherwise through fp32 then RNE to dst.

    Never-written source elements are copied as never-written (access.checked_copy_read): a copy is not
    a use; the instruction that computes with them raises in strict mode.
    """
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
    raw, written = checked_copy_read(src, instr, "src")
    if raw is None:
        values = None
    elif dst.dtype == src.dtype:
        values = raw.reshape(-1)
    else:
        values = to_float32(src, raw).reshape(-1)
    checked_write(dst, instr, "dst", values, written=written)
    return NkiInstruction(name)


def _represents(value, dt) -> bool:
    """Does float dtype `dt` represent the int `value` exactly (the value survives the round trip)?"""
    if abs(value) > 2 ** 128:  # beyond every NKI float format (and float64's exact int range is irrelevant)
        return False
    with np.errstate(over="ignore", invalid="ignore"):
        back = np.array([value], np.float64).astype(dt.precise_np).astype(np.float64)[0]
    return bool(np.isfinite(back)) and int(back) == value


def memset(dst, value, engine=C.engine.unknown, name=None):
    """Fill a tile with a compile-time constant.

    Value rules (NKI 0.3.0+, https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/migration/index.html,
    "memset strict type matching"): integer dtypes take an int (a float such as 2.0 is rejected); float
    dtypes take a float, or an int the dtype represents exactly (`memset(bf16_tile, value=0)` as nki-library
    writes it; the guide's example only forbids floats for integer tiles); x4 dtypes only 0; float8_e8m0fnu
    a float power of two.
    """
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
        info = np.iinfo(dst.np_dtype)
        if not info.min <= int(value) <= info.max:
            fail(instr, f"argument 'value' {value!r} is outside the range [{info.min}, {info.max}] of dtype {dt}")
        fill = np.array([int(value)])
    else:
        if is_int_value:
            if not _represents(int(value), dt):
                fail(instr, f"argument 'value': int {value!r} is not exactly representable in dtype {dt}; "
                            "expected a float or an int the dtype represents")
        elif not is_float_value:
            fail(instr, f"value for float dtype {dt} must be a float, got {type(value).__name__} {value!r} "
                        "(an int the dtype represents exactly is accepted too)")
        fill = np.array([value], np.float32)
    c = ctx()
    c.record(instr=instr, engine=eng.name, writes=[("dst", dst)], elems=dst.free_size, dst_dtype=str(dt))
    values = None if not c.numerics else np.broadcast_to(fill, (dst.size,))
    checked_write(dst, instr, "dst", values)
    return NkiInstruction(name)
