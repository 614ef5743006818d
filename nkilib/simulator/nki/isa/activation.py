"""Scalar Engine activation instructions: activation, activation_reduce.

Sources: https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.activation.html
https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.activation_reduce.html

`dst = op(data * scale + bias)` with all math in float32 (the multiply and the add are separate
float32 roundings), the activation function evaluated by `ops.evaluate_activation`, and one RNE
rounding to `dst.dtype`.

Reduction registers (`ctx().act_reduce_regs`, one float32 per lane, persistent across calls):
- lane = physical partition of `data` (the docs: registers "corresponding to the 128 partitions of
  the input");
- `reset` -> regs = 0; `idle` -> untouched; `reduce` -> regs += sum; `reset_reduce` -> regs = sum,
  where sum = the free-axis sum of the float32 activation results *before* the dst downcast,
  accumulated in float64 and rounded once to float32 (INFERRED, docs/simulator.md#choice-activation-reduce: the
  docstring pseudo-code would double-count;
  https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.activation.html);
- `reduce_res` ([P, 1]) receives the registers of the active lanes after the update.
"""
from __future__ import annotations

import numpy as np

from ... import dtypes as D
from ..language.ops import evaluate_activation
from ...access import checked_read, checked_write, to_float32, valueless
from . import constants as C
from ._common import (NkiInstruction, alu_op, ctx, fail, numeric_operand, on_chip, registers_or_none,
                      require_nc_version, same_partitions_and_free, scalar_or_vector)

_ACT_REDUCE_CMDS = (C.reduce_cmd.idle, C.reduce_cmd.reset, C.reduce_cmd.reduce, C.reduce_cmd.reset_reduce)


def _activation(instr, dst, op, data, bias, scale, reduce_op, reduce_res, reduce_cmd, name):
    dst = on_chip(instr, "dst", dst)
    data = on_chip(instr, "data", data)
    same_partitions_and_free(instr, "dst", dst, "data", data)
    numeric_operand(instr, "data", data)
    numeric_operand(instr, "dst", dst, write=True)
    op = alu_op(instr, "op", op)
    if op.activation is None:
        fail(instr, f"op={op!r} is not an activation function (ALU operators go to tensor_scalar/tensor_tensor)")
    scale_value, scale_tile = scalar_or_vector(instr, "scale", scale, data)
    if scale_tile is not None and scale_tile.dtype != D.float32:
        fail(instr, f"scale tile ('{scale_tile.name}') must be float32, got {scale_tile.dtype}")
    bias_value, bias_tile = scalar_or_vector(instr, "bias", bias, data, allow_none=True)
    if bias_tile is not None:
        if bias_tile.dtype == D.tfloat32:
            fail(instr, f"bias tile ('{bias_tile.name}') may have any dtype except tfloat32, got {bias_tile.dtype}")
        numeric_operand(instr, "bias", bias_tile)
    elif bias_value is not None:
        require_nc_version(instr, 3, "a scalar bias")
    if not isinstance(reduce_cmd, C.reduce_cmd):
        fail(instr, f"reduce_cmd must be an nisa.reduce_cmd member, got {reduce_cmd!r}")
    if reduce_cmd not in _ACT_REDUCE_CMDS:
        fail(instr, f"reduce_cmd={reduce_cmd.name} is not supported; expected one of "
                    f"{[r.name for r in _ACT_REDUCE_CMDS]}")
    if reduce_op is not None:
        reduce_op = alu_op(instr, "reduce_op", reduce_op)
        if reduce_op.name != "add":
            fail(instr, f"reduce_op must be nl.add, got {reduce_op!r}")
    elif reduce_cmd in (C.reduce_cmd.reduce, C.reduce_cmd.reset_reduce):
        fail(instr, f"reduce_cmd={reduce_cmd.name} accumulates into the reduce registers and needs reduce_op=nl.add")
    if reduce_res is not None:
        reduce_res = on_chip(instr, "reduce_res", reduce_res)
        if reduce_res.shape[0] != data.shape[0] or reduce_res.free_size != 1:
            fail(instr, f"reduce_res must be a [{data.shape[0]}, 1] tile, got shape {reduce_res.shape}")
        numeric_operand(instr, "reduce_res", reduce_res, write=True)

    c = ctx()
    reads = [("data", data)] + [(a, t) for a, t in (("scale", scale_tile), ("bias", bias_tile)) if t is not None]
    writes = [("dst", dst)] + ([("reduce_res", reduce_res)] if reduce_res is not None else [])
    c.record(instr=instr, engine="scalar", reads=reads, writes=writes, elems=dst.free_size, op=op.name,
             data_dtype=str(data.dtype), dst_dtype=str(dst.dtype), reduce_cmd=reduce_cmd.name,
             reduce_readout=reduce_res is not None)
    raw = checked_read(data, instr, "data")
    scale_raw = checked_read(scale_tile, instr, "scale") if scale_tile is not None else None
    bias_raw = checked_read(bias_tile, instr, "bias") if bias_tile is not None else None
    lane0, p = data.partition_start, data.shape[0]
    regs = c.act_reduce_regs[lane0:lane0 + p]  # view: updates persist in the program context
    known = c.act_reduce_known[lane0:lane0 + p]  # view: do the reduce registers hold known values?
    if reduce_cmd in (C.reduce_cmd.reset, C.reduce_cmd.reset_reduce):
        regs[...] = 0.0
        known[...] = True
    if valueless(raw, *(r for t, r in ((scale_tile, scale_raw), (bias_tile, bias_raw)) if t is not None)):
        if reduce_cmd in (C.reduce_cmd.reduce, C.reduce_cmd.reset_reduce):
            known[...] = False  # shape-only run: a sum of unknown values
        checked_write(dst, instr, "dst", None)
        if reduce_res is not None:
            checked_write(reduce_res, instr, "reduce_res",
                          registers_or_none(c.act_reduce_regs, c.act_reduce_known, lane0, p))
        return NkiInstruction(name)

    with np.errstate(all="ignore"):
        x = to_float32(data, raw).reshape(p, -1)
        s = np.float32(scale_value) if scale_tile is None else to_float32(scale_tile, scale_raw).reshape(p, 1)
        x = (x * s).astype(np.float32)
        if bias_tile is not None:
            x = (x + to_float32(bias_tile, bias_raw).reshape(p, 1)).astype(np.float32)
        elif bias_value is not None:
            x = (x + np.float32(bias_value)).astype(np.float32)
        y = evaluate_activation(op, x)
    checked_write(dst, instr, "dst", y)

    if reduce_cmd in (C.reduce_cmd.reduce, C.reduce_cmd.reset_reduce):
        total = y.astype(np.float64).sum(axis=1).astype(np.float32)
        with np.errstate(all="ignore"):
            regs[...] = regs + total
    if reduce_res is not None:
        checked_write(reduce_res, instr, "reduce_res",
                      registers_or_none(c.act_reduce_regs, c.act_reduce_known, lane0, p))
    return NkiInstruction(name)


def activation(dst, op, data, bias=None, scale=1.0, reduce_op=None, reduce_res=None,
               reduce_cmd=C.reduce_cmd.idle, name=None):
    """dst = op(data * scale + bias) on the Scalar engine, with optional register reduction
    (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.activation.html)."""
    return _activation("activation", dst, op, data, bias, scale, reduce_op, reduce_res, reduce_cmd, name)


def activation_reduce(dst, op, data, reduce_op, reduce_res, bias=None, scale=1.0, name=None):
    """activation(..., reduce_cmd=reset_reduce) with reduce_res required: reduce_res = sum over all free
    dims of the activation results
    (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.activation_reduce.html)."""
    instr = "activation_reduce"
    if reduce_op is None:
        fail(instr, "reduce_op is required (nl.add)")
    if reduce_res is None:
        fail(instr, "reduce_res is required (a [P, 1] tile)")
    return _activation(instr, dst, op, data, bias, scale, reduce_op, reduce_res, C.reduce_cmd.reset_reduce, name)
