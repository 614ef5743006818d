"""Free-axis reduction on the Vector engine: tensor_reduce
(https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.tensor_reduce.html).

Numerics: arithmetic reductions cast to float32; add/subtract/multiply accumulate in float64 and
round once to float32 (the hardware accumulates in float32 in an undocumented order, so exact
rounding is the order-independent choice); maximum/minimum/logical ops are exact. `subtract`
folds left from the first element (x0 - x1 - ... - xn, numpy's `subtract.reduce`; INFERRED, the
docs only list subtract as legal; docs/simulator.md#choice-reduce-numerics). Bitvec reductions work on
raw 32-bit words (see elementwise.py).
"""
from __future__ import annotations

import math
import numbers

import numpy as np

from ...access import checked_read, checked_write, to_float32
from ._common import NkiInstruction, alu_op, ctx, fail, numeric_operand, on_chip
from .elementwise import _MASK32, _from_bits, _rows_bits

_FLOAT64_ACC = ("add", "subtract", "multiply")


def _axes(instr: str, axis, ndim: int) -> tuple:
    """Normalise `axis` and check it is the trailing contiguous free dims (nki.isa.tensor_reduce docs).

    Negative axes count from the end like numpy (INFERRED; the docs only show non-negative axes;
    docs/simulator.md#choice-reduce-axes).
    """
    items = list(axis) if isinstance(axis, (list, tuple)) else [axis]
    if not items:
        fail(instr, f"axis must name at least one free axis, got {axis!r}")
    out = []
    for a in items:
        if isinstance(a, (bool, np.bool_)) or not isinstance(a, numbers.Integral):
            fail(instr, f"axis must be an int or a tuple/list of ints, got {axis!r}")
        a = int(a)
        a2 = a + ndim if a < 0 else a
        if not 0 <= a2 < ndim:
            fail(instr, f"axis {a} is out of range for a {ndim}-D tile")
        if a2 == 0:
            fail(instr, f"axis {axis!r} includes the partition axis 0, which cannot be reduced "
                        "(use nc_transpose or nc_matmul with ones)")
        out.append(a2)
    out = sorted(out)
    if len(set(out)) != len(out) or out != list(range(out[0], ndim)):
        want = ", ".join(str(tuple(range(k, ndim))) for k in range(ndim - 1, 0, -1))
        fail(instr, f"axis {axis!r} must be the trailing contiguous free axes ending at the last axis {ndim - 1}; "
                    f"valid for this {ndim}-D tile: {want}")
    return tuple(out)


def tensor_reduce(dst, op, data, axis, negate=False, keepdims=False, name=None):
    """dst = op-reduction of data over trailing free axes; optional negate for arithmetic ops (
    https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.tensor_reduce.html)."""
    instr = "tensor_reduce"
    dst = on_chip(instr, "dst", dst)
    data = on_chip(instr, "data", data)
    op = alu_op(instr, "op", op)
    if op.reduce_identity is None:
        fail(instr, f"op={op!r} is not a legal reduction operator; expected one of nl.add, nl.subtract, "
                    "nl.multiply, nl.maximum, nl.minimum, nl.logical_and/or/xor, nl.bitwise_and/or/xor")
    if not isinstance(negate, (bool, np.bool_)) or not isinstance(keepdims, (bool, np.bool_)):
        fail(instr, f"negate and keepdims must be bools, got negate={negate!r}, keepdims={keepdims!r}")
    if negate and op.bitvec:
        fail(instr, f"negate=True applies only to arithmetic operators, got bitvec op={op!r}")
    axes = _axes(instr, axis, data.ndim)
    p = data.shape[0]
    kept = math.prod(data.shape[1:axes[0]])
    if dst.shape[0] != p:
        fail(instr, f"'dst' has {dst.shape[0]} partitions but 'data' has {p} (shapes {dst.shape} vs {data.shape})")
    if dst.free_size != kept:
        fail(instr, f"dst ('{dst.name}', shape {dst.shape}) has {dst.free_size} elements per partition but reducing "
                    f"data {data.shape} over axis {axes} leaves {kept}")
    if op.bitvec:
        for arg, t in (("data", data), ("dst", dst)):
            if not t.dtype.is_int:
                fail(instr, f"bitvec operator {op!r} needs integer tiles, but argument '{arg}' ('{t.name}') has "
                            f"dtype {t.dtype}")
    else:
        numeric_operand(instr, "data", data)
        numeric_operand(instr, "dst", dst, write=True)
    c = ctx()
    c.record(instr=instr, engine="vector", reads=[("data", data)], writes=[("dst", dst)], elems=data.free_size,
             op=op.name, axis=axes, data_dtype=str(data.dtype), dst_dtype=str(dst.dtype))
    raw = checked_read(data, instr, "data")
    if raw is None:
        checked_write(dst, instr, "dst", None)
        return NkiInstruction(name)
    n_red = data.free_size // kept
    if op.bitvec:
        words = _rows_bits(data, raw).reshape(p, kept, n_red)
        out = _from_bits(op.binary.reduce(words, axis=-1) & _MASK32, dst)
    else:
        x = to_float32(data, raw).reshape(p, kept, n_red)
        with np.errstate(all="ignore"):
            if op.name in _FLOAT64_ACC:
                out = op.binary.reduce(x.astype(np.float64), axis=-1).astype(np.float32)
            elif op.name.startswith("logical_"):
                out = getattr(np, op.name).reduce(x != 0, axis=-1).astype(np.float32)
            else:
                out = op.binary.reduce(x, axis=-1).astype(np.float32)
            if negate:
                out = -out
    checked_write(dst, instr, "dst", out)
    return NkiInstruction(name)
