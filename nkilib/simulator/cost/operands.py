"""Operand helpers of the cost model: sizes, contiguity and names of trace operands (trace.OperandInfo)."""
from __future__ import annotations

import math

from ..dtypes import as_nki_dtype


class CostModelError(ValueError):
    """An instruction the cost model has no formula for, or an inconsistent trace."""


_COMPUTE_ENGINES = ("tensor", "vector", "scalar", "gpsimd")
_TWO_BYTE = ("bfloat16", "float16")
_FP8 = ("float8_e4m3", "float8_e5m2", "float8_e4m3fn")


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

