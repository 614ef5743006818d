"""Elementwise compute instructions: tensor_tensor, tensor_scalar, scalar_tensor_tensor, reciprocal
and iota; one nki.isa API page each:
https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.<name>.html

Numerics ("Supported Math Operators" of
https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/nki.api.shared.html): arithmetic operators cast every
input to float32, compute in float32 and round once to `dst.dtype` (RNE; integers saturate). Bitvec operators see raw
integer bit patterns: every input element is zero-extended to a 32-bit word, the operator works on words, and the low
`dst`-width bits are stored without conversion. The GpSimd path of `tensor_tensor` with all
int32/uint32 tiles uses native 32-bit integer arithmetic (wraps modulo 2^32).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

from ... import dtypes as D
from ...access import checked_read, checked_write, to_float32, valueless
from ...tensor import NkiTensor
from . import constants as C
from ._common import (NkiInstruction, alu_op, ctx, fail, gpsimd_no_psum, not_both_psum, numeric_operand, on_chip,
                      registers_or_none, require_nc_version, resolve_engine, same_partitions_and_free,
                      scalar_or_vector)

_INT32 = (D.int32, D.uint32)
_MASK32 = np.uint64(0xFFFFFFFF)
_INT32_MIN, _INT32_MAX = -(2 ** 31), 2 ** 31 - 1
# NKI 0.4.0 (Neuron 2.30) release notes: nl.abs_max / nl.abs_min are trn3-only and run on the Vector
# Engine; nl.square / nl.relu are accepted as tensor_scalar op0 on trn3 only.
# https://awsdocs-neuron.readthedocs-hosted.com/en/v2.30.0/release-notes/components/nki.html
_TRN3_ONLY_OPS = ("abs_max", "abs_min")
_TRN3_TS_OP0 = ("square", "relu")
# Scalar Engine on trn2 supports only these tensor_scalar (op0, op1) pairs
# (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.tensor_scalar.html).
_TRN2_SCALAR_PAIRS = (("multiply", "add"), ("multiply", None), ("add", None))


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------

def _rows_f32(t: NkiTensor, raw) -> np.ndarray:
    """[P, F] float32 values of a tile (free dims flattened row-major)."""
    return to_float32(t, raw).reshape(t.shape[0], -1)


def _rows_bits(t: NkiTensor, raw) -> np.ndarray:
    """[P, F] raw bit patterns zero-extended to uint64 words (bitvec ops do no dtype casting)."""
    return raw.view(f"u{raw.dtype.itemsize}").astype(np.uint64).reshape(t.shape[0], -1)


def _bitvec(op, a, b=None):
    """A bitvec operator on 32-bit words held in uint64 arrays."""
    if op.name == "invert":
        return ~a & _MASK32
    if op.name in ("left_shift", "right_shift"):
        # logical shifts of 32-bit words (arithmetic right shift is not supported:
        # https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/nki.api.shared.html);
        # a count >= 32 shifts every bit out (INFERRED, docs/simulator.md#choice-integer-wrap)
        sh = np.minimum(b, np.uint64(32))
        r = (a << sh) if op.name == "left_shift" else (a >> sh)
        return np.where(b >= 32, np.uint64(0), r & _MASK32)
    return op.binary(a, b) & _MASK32


def _from_bits(words: np.ndarray, dst: NkiTensor) -> np.ndarray:
    """The low dst-width bits of 32-bit words, reinterpreted as dst's integer dtype."""
    npd = dst.np_dtype
    return (words & np.uint64((1 << (8 * npd.itemsize)) - 1)).astype(f"u{npd.itemsize}").view(npd)


def _wrap32(values: np.ndarray, dst: NkiTensor) -> np.ndarray:
    """int64 results of native 32-bit integer arithmetic, wrapped modulo 2^32 into dst's int32/uint32."""
    words = (values.astype(np.int64) & 0xFFFFFFFF).astype(np.uint32)
    return words.view(np.int32) if dst.dtype == D.int32 else words


def _gate_op_target(instr: str, arg: str, op) -> None:
    if op.name in _TRN3_ONLY_OPS:
        require_nc_version(instr, 4, f"{arg}=nl.{op.name}")


def _require_int(instr: str, arg: str, t: NkiTensor, op) -> None:
    if not t.dtype.is_int:
        fail(instr, f"bitvec operator nl.{op.name} needs integer tiles, but argument '{arg}' ('{t.name}') "
                    f"has dtype {t.dtype}")


def _is_zero_or_none(value) -> bool:
    if value is None:
        return True
    return (isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
            and not isinstance(value, NkiTensor) and value == 0)


def _check_bool(instr: str, arg: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        fail(instr, f"argument '{arg}' must be a bool, got {value!r}")
    return bool(value)


@dataclass
class _Stage:
    """One `x <op> operand` stage of tensor_scalar / scalar_tensor_tensor."""

    op_arg: str
    op: object
    operand_arg: str
    scalar: object  # float (arithmetic) / np.uint64 word (bitvec) / None
    tile: NkiTensor | None
    reverse: bool

    @property
    def unary(self) -> bool:
        return self.op.binary is None


def _stage(instr, op_arg, op, operand_arg, operand, reverse, data, bitvec, fp32_tiles=True) -> _Stage:
    """Validate one op/operand pair (nki.isa.tensor_scalar docs): unary ops take operand None or 0, binary ops need a
    scalar or a [P, 1] tile (float32 for arithmetic tensor_scalar, integer for bitvec)."""
    reverse = _check_bool(instr, f"reverse{op_arg[-1]}", reverse)
    if op.binary is None and op.unary is None:
        fail(instr, f"{op_arg}={op!r} is not an ALU operator (activation functions go to nisa.activation)")
    if op.name == "power":
        fail(instr,
             f"{op_arg}=nl.power is not supported here; nl.power runs only in nisa.tensor_tensor on GpSimd "
             "(https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.tensor_tensor.html)")
    _gate_op_target(instr, op_arg, op)
    if op.binary is None:
        if not _is_zero_or_none(operand):
            fail(instr, f"{operand_arg} must be None or 0 when {op_arg} is the unary operator {op!r}, got {operand!r}")
        return _Stage(op_arg, op, operand_arg, None, None, reverse)
    if operand is None:
        fail(instr, f"{operand_arg} is required for the binary operator {op_arg}={op!r}")
    scalar, tile = scalar_or_vector(instr, operand_arg, operand, data)
    if tile is not None:
        if bitvec:
            _require_int(instr, operand_arg, tile, op)
        elif fp32_tiles and tile.dtype != D.float32:
            fail(instr, f"{operand_arg} tile ('{tile.name}') must be float32 for arithmetic operators, "
                        f"got {tile.dtype}")
        else:
            numeric_operand(instr, operand_arg, tile)
    elif bitvec:
        if not isinstance(operand, numbers.Integral):
            fail(instr, f"{operand_arg} for bitvec operator {op!r} must be an int scalar or an integer [P, 1] tile, "
                        f"got {operand!r}")
        scalar = np.uint64(int(operand) & 0xFFFFFFFF)
    return _Stage(op_arg, op, operand_arg, scalar, tile, reverse)


def _apply_stages(stages, x, tiles_raw, bitvec):
    """Run the stages on [P, F] values (float32, or uint64 words for bitvec)."""
    with np.errstate(all="ignore"):
        for st in stages:
            if st.unary:
                x = _bitvec(st.op, x) if bitvec else np.asarray(st.op.unary(x), np.float32)
                continue
            if st.tile is not None:
                raw = tiles_raw[st.operand_arg]
                operand = _rows_bits(st.tile, raw) if bitvec else _rows_f32(st.tile, raw)
            else:
                operand = st.scalar if bitvec else np.float32(st.scalar)
            lhs, rhs = (operand, x) if st.reverse else (x, operand)
            x = _bitvec(st.op, lhs, rhs) if bitvec else np.asarray(st.op.binary(lhs, rhs), np.float32)
    return x


def _read_stage_tiles(instr, stages):
    return {st.operand_arg: checked_read(st.tile, instr, st.operand_arg) for st in stages if st.tile is not None}


# ---------------------------------------------------------------------------------------------
# instructions
# ---------------------------------------------------------------------------------------------

def tensor_tensor(dst, data1, data2, op, engine=C.engine.unknown, name=None):
    """dst = data1 <op> data2 elementwise.

    Engine choice (nki.isa.tensor_tensor docs,
    https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.tensor_tensor.html):
    bitvec ops run on Vector; nl.power runs only on GpSimd (fp32 math); otherwise, when every tile is
    int32/uint32 and none is in PSUM the default is GpSimd with native integer arithmetic, else Vector.
    Native integer overflow wraps modulo 2^32 (INFERRED: "native integer arithmetic", no saturation).
    """
    instr = "tensor_tensor"
    dst = on_chip(instr, "dst", dst)
    d1 = on_chip(instr, "data1", data1)
    d2 = on_chip(instr, "data2", data2)
    same_partitions_and_free(instr, "dst", dst, "data1", d1)
    same_partitions_and_free(instr, "dst", dst, "data2", d2)
    not_both_psum(instr, "data1", d1, "data2", d2)
    op = alu_op(instr, "op", op)
    if op.binary is None:
        fail(instr, f"op={op!r} is not a binary ALU operator (use tensor_scalar for unary operators, "
                    "activation for activation functions)")
    _gate_op_target(instr, "op", op)
    tiles = (("dst", dst), ("data1", d1), ("data2", d2))
    any_psum = any(t.storage.buffer_kind == "psum" for _, t in tiles)
    all_int32 = all(t.dtype in _INT32 for _, t in tiles)
    eng = resolve_engine(instr, engine, (C.engine.vector, C.engine.gpsimd), None)
    if op.bitvec:
        if eng not in (None, C.engine.vector):
            fail(instr, f"bitvec operator op={op!r} runs only on the Vector engine, got engine={eng.name}")
        eng = C.engine.vector
        for arg, t in tiles:
            _require_int(instr, arg, t, op)
    elif op.name == "power":
        if eng not in (None, C.engine.gpsimd):
            fail(instr, f"op=nl.power runs only on the GpSimd engine, got engine={eng.name}")
        eng = C.engine.gpsimd
    elif eng is None:
        eng = C.engine.gpsimd if all_int32 and not any_psum else C.engine.vector
    if op.name in _TRN3_ONLY_OPS and eng != C.engine.vector:
        fail(instr, f"op={op!r} runs only on the Vector engine, got engine={eng.name}")
    gpsimd_no_psum(instr, eng, *tiles)
    if not op.bitvec:
        for arg, t in tiles:
            numeric_operand(instr, arg, t, write=arg == "dst")
    native_int = eng == C.engine.gpsimd and all_int32 and not op.bitvec and op.name != "power"
    c = ctx()
    c.record(instr=instr, engine=eng.name, reads=[("data1", d1), ("data2", d2)], writes=[("dst", dst)],
             elems=dst.free_size, op=op.name, data1_dtype=str(d1.dtype), data2_dtype=str(d2.dtype),
             dst_dtype=str(dst.dtype))
    r1 = checked_read(d1, instr, "data1")
    r2 = checked_read(d2, instr, "data2")
    if valueless(r1, r2):
        checked_write(dst, instr, "dst", None)
        return NkiInstruction(name)
    with np.errstate(all="ignore"):
        if op.bitvec:
            out = _from_bits(_bitvec(op, _rows_bits(d1, r1), _rows_bits(d2, r2)), dst)
        elif native_int:
            a = r1.reshape(d1.shape[0], -1).astype(np.int64)
            b = r2.reshape(d2.shape[0], -1).astype(np.int64)
            out = _wrap32(np.asarray(op.binary(a, b)), dst)
        else:
            out = np.asarray(op.binary(_rows_f32(d1, r1), _rows_f32(d2, r2)), np.float32)
    checked_write(dst, instr, "dst", out)
    return NkiInstruction(name)


def tensor_scalar(dst, data, op0, operand0, reverse0=False, op1=None, operand1=None, reverse1=False,
                  engine=C.engine.unknown, name=None):
    """dst = (data <op0> operand0) <op1> operand1, operands scalars or [P, 1] tiles.

    Engines (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.tensor_scalar.html):
    default Vector; bitvec only on Vector; GpSimd only for rsqrt; Scalar on trn2 only (multiply, add),
    (multiply, None), (add, None). A unary op1 (e.g. nl.abs) takes operand1 None or 0 like a unary op0
    (INFERRED by symmetry with the documented op0 rule).
    """
    instr = "tensor_scalar"
    dst = on_chip(instr, "dst", dst)
    data = on_chip(instr, "data", data)
    same_partitions_and_free(instr, "dst", dst, "data", data)
    op0 = alu_op(instr, "op0", op0)
    if op1 is None:
        if operand1 is not None:
            fail(instr, f"operand1 must be None when op1 is None (unused), got {operand1!r}")
    else:
        op1 = alu_op(instr, "op1", op1)
        if op1.bitvec != op0.bitvec:
            fail(instr, f"op0={op0!r} and op1={op1!r} must both be bitvec or both arithmetic operators")
        if op1.name in _TRN3_TS_OP0:
            fail(instr, f"op1={op1!r} is not supported; nl.{op1.name} is accepted only as op0 (trn3)")
    if op0.name in _TRN3_TS_OP0:
        require_nc_version(instr, 4, f"op0=nl.{op0.name}")
    bitvec = op0.bitvec
    stages = [_stage(instr, "op0", op0, "operand0", operand0, reverse0, data, bitvec)]
    if op1 is not None:
        stages.append(_stage(instr, "op1", op1, "operand1", operand1, reverse1, data, bitvec))
    else:
        _check_bool(instr, "reverse1", reverse1)
    eng = resolve_engine(instr, engine, (C.engine.vector, C.engine.scalar, C.engine.gpsimd), C.engine.vector)
    pair = (op0.name, None if op1 is None else op1.name)
    if bitvec:
        if eng != C.engine.vector:
            fail(instr, f"bitvec operators ({op0!r}) run only on the Vector engine, got engine={eng.name}")
        _require_int(instr, "data", data, op0)
        _require_int(instr, "dst", dst, op0)
    else:
        numeric_operand(instr, "data", data)
        numeric_operand(instr, "dst", dst, write=True)
    if eng == C.engine.gpsimd and pair != ("rsqrt", None):
        fail(instr, f"engine gpsimd is only allowed for rsqrt (op0=nl.rsqrt, op1=None), got op0={op0!r}, op1={op1!r}")
    if eng == C.engine.scalar and ctx().target.nc_version < 4 and pair not in _TRN2_SCALAR_PAIRS:
        fail(instr, f"the Scalar engine on trn2 supports only (op0, op1) in (multiply, add), (multiply, None), "
                    f"(add, None); got ({op0!r}, {op1!r})")
    if eng != C.engine.vector and any(st.op.name in _TRN3_ONLY_OPS for st in stages):
        fail(instr, f"nl.abs_max / nl.abs_min run only on the Vector engine, got engine={eng.name}")
    tile_args = [(st.operand_arg, st.tile) for st in stages if st.tile is not None]
    gpsimd_no_psum(instr, eng, ("dst", dst), ("data", data), *tile_args)
    c = ctx()
    c.record(instr=instr, engine=eng.name, reads=[("data", data)] + tile_args, writes=[("dst", dst)],
             elems=dst.free_size, op0=pair[0], op1=pair[1], data_dtype=str(data.dtype), dst_dtype=str(dst.dtype))
    raw = checked_read(data, instr, "data")
    tiles_raw = _read_stage_tiles(instr, stages)
    if valueless(raw, *tiles_raw.values()):
        checked_write(dst, instr, "dst", None)
        return NkiInstruction(name)
    if bitvec:
        out = _from_bits(_apply_stages(stages, _rows_bits(data, raw), tiles_raw, True), dst)
    else:
        out = _apply_stages(stages, _rows_f32(data, raw), tiles_raw, False)
    checked_write(dst, instr, "dst", out)
    return NkiInstruction(name)


# The 2.33 (NKI 0.7) scalar_tensor_tensor adds a free-axis reduction of its result into VectorE's accumulator
# registers:
# https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.0/nki/api/generated/nki.isa.scalar_tensor_tensor.html
# (signature: reduce_cmd=reset_reduce, reduce_op=..., reduce_res=None). The reduce operators and the [P, 1]
# reduce_res are those of the same engine's tensor_scalar_reduce
# (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.0/nki/api/generated/nki.isa.tensor_scalar_reduce.html:
# "nl.add, nl.multiply, nl.max or nl.min", the ALU operators nl.maximum / nl.minimum here); the register
# commands those of tensor_scalar_cumulative
# (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.0/nki/api/generated/nki.isa.tensor_scalar_cumulative.html:
# reset_reduce starts from the operator's identity, reduce continues, load_reduce loads a given value).
_STT_REDUCE_OPS = ("add", "multiply", "maximum", "minimum")
_STT_REDUCE_CMDS = (C.reduce_cmd.reset_reduce, C.reduce_cmd.reduce)
_STT_NO_REDUCE_CMDS = (C.reduce_cmd.reset_reduce, C.reduce_cmd.idle)  # without reduce_op: registers untouched


def _stt_reduce_args(instr, reduce_op, reduce_res, reduce_cmd, data):
    """Validate scalar_tensor_tensor's reduce arguments; returns (reduce_op or None, reduce_res view or None)."""
    if not isinstance(reduce_cmd, C.reduce_cmd):
        fail(instr, f"reduce_cmd must be an nisa.reduce_cmd member, got {reduce_cmd!r}")
    if reduce_op is ...:
        if reduce_res is not None:
            fail(instr, f"reduce_res needs reduce_op (one of {['nl.' + n for n in _STT_REDUCE_OPS]}), got no reduce_op")
        if reduce_cmd not in _STT_NO_REDUCE_CMDS:
            fail(instr, f"reduce_cmd={reduce_cmd.name} needs reduce_op (one of "
                        f"{['nl.' + n for n in _STT_REDUCE_OPS]}), got no reduce_op")
        return None, None
    reduce_op = alu_op(instr, "reduce_op", reduce_op)
    if reduce_op.name not in _STT_REDUCE_OPS:
        fail(instr, f"reduce_op must be one of {['nl.' + n for n in _STT_REDUCE_OPS]}, got {reduce_op!r}")
    if reduce_cmd not in _STT_REDUCE_CMDS:
        why = ("load_reduce loads a value that scalar_tensor_tensor has no argument for"
               if reduce_cmd == C.reduce_cmd.load_reduce else
               f"{reduce_cmd.name} does not accumulate this instruction's results")
        fail(instr, f"reduce_cmd must be one of {[r.name for r in _STT_REDUCE_CMDS]} with reduce_op, got "
                    f"{reduce_cmd.name} ({why})")
    if reduce_res is not None:
        reduce_res = on_chip(instr, "reduce_res", reduce_res)
        if reduce_res.shape[0] != data.shape[0] or reduce_res.free_size != 1:
            fail(instr, f"reduce_res must be a [{data.shape[0]}, 1] tile (data's partitions, one element each), "
                        f"got shape {reduce_res.shape}")
        numeric_operand(instr, "reduce_res", reduce_res, write=True)
    return reduce_op, reduce_res


def _stt_accumulate(c, reduce_op, reduce_cmd, lane0, p, values):
    """Update VectorE's accumulator registers of lanes lane0..lane0+p with the free-axis reduction of
    `values` ([p, F] float32, before the dst downcast; None in a shape-only run). add / multiply reduce in
    float64 rounded once to float32, max / min exactly, then combine with the register in one float32 operation
    (docs/simulator.md#choice-vector-accumulate)."""
    regs = c.vec_reduce_regs[lane0:lane0 + p]  # views: updates persist in the program context
    known = c.vec_reduce_known[lane0:lane0 + p]
    if reduce_cmd == C.reduce_cmd.reset_reduce:
        regs[...] = np.float32(reduce_op.reduce_identity)
        known[...] = True
    if values is None:
        known[...] = False
        return
    with np.errstate(all="ignore"):
        if reduce_op.name in ("add", "multiply"):
            total = reduce_op.binary.reduce(values.astype(np.float64), axis=1).astype(np.float32)
        else:
            total = reduce_op.binary.reduce(values, axis=1).astype(np.float32)
        regs[...] = np.asarray(reduce_op.binary(regs, total), np.float32)


def scalar_tensor_tensor(dst, data, op0, operand0, op1, operand1, reverse0=False, reverse1=False,
                         reduce_cmd=C.reduce_cmd.reset_reduce, reduce_op=..., reduce_res=None, name=None):
    """dst = (data <op0> operand0) <op1> operand1 on Vector; operand0 scalar or [P, 1], operand1 a full
    tile; arithmetic operators only, fp32 math; any input dtype (
    https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.scalar_tensor_tensor.html).

    With reduce_op (NKI 0.7, the 2.33 page; see _STT_REDUCE_OPS) the fp32 results are also reduced along the
    free axis into VectorE's accumulator registers (reduce_cmd reset_reduce: from reduce_op's identity; reduce:
    onto the registers' values), and reduce_res ([P, 1], optional) receives the registers after the update."""
    instr = "scalar_tensor_tensor"
    dst = on_chip(instr, "dst", dst)
    data = on_chip(instr, "data", data)
    same_partitions_and_free(instr, "dst", dst, "data", data)
    if not isinstance(operand1, NkiTensor):
        fail(instr, f"operand1 must be a tile with the same shape as data, got {operand1!r}")
    t1 = on_chip(instr, "operand1", operand1)
    same_partitions_and_free(instr, "data", data, "operand1", t1)
    not_both_psum(instr, "data", data, "operand1", t1)
    op0 = alu_op(instr, "op0", op0)
    op1 = alu_op(instr, "op1", op1)
    for arg, op in (("op0", op0), ("op1", op1)):
        if op.bitvec:
            fail(instr, f"{arg}={op!r} is a bitvec operator; scalar_tensor_tensor supports arithmetic operators only")
    if op1.binary is None:
        fail(instr, f"op1={op1!r} must be a binary operator (it combines with the operand1 tile)")
    st0 = _stage(instr, "op0", op0, "operand0", operand0, reverse0, data, False, fp32_tiles=False)
    if op1.name == "power":
        fail(instr,
             "op1=nl.power is not supported; nl.power runs only in nisa.tensor_tensor on GpSimd "
             "(https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.tensor_tensor.html)")
    _gate_op_target(instr, "op1", op1)
    st1 = _Stage("op1", op1, "operand1", None, t1, _check_bool(instr, "reverse1", reverse1))
    for arg, t in (("dst", dst), ("data", data), ("operand1", t1)):
        numeric_operand(instr, arg, t, write=arg == "dst")
    reduce_op, reduce_res = _stt_reduce_args(instr, reduce_op, reduce_res, reduce_cmd, data)
    reads = [("data", data)] + ([("operand0", st0.tile)] if st0.tile is not None else []) + [("operand1", t1)]
    writes = [("dst", dst)] + ([("reduce_res", reduce_res)] if reduce_res is not None else [])
    reduce_attrs = {} if reduce_op is None else dict(reduce_op=reduce_op.name, reduce_cmd=reduce_cmd.name)
    c = ctx()
    c.record(instr=instr, engine="vector", reads=reads, writes=writes, elems=dst.free_size,
             op0=op0.name, op1=op1.name, data_dtype=str(data.dtype), dst_dtype=str(dst.dtype), **reduce_attrs)
    raw = checked_read(data, instr, "data")
    tiles_raw = _read_stage_tiles(instr, (st0,))
    raw1 = checked_read(t1, instr, "operand1")
    lane0, p = data.partition_start, data.shape[0]
    out = None
    if not valueless(raw, raw1, *tiles_raw.values()):
        tiles_raw["operand1"] = raw1
        out = _apply_stages((st0, st1), _rows_f32(data, raw), tiles_raw, False)
    checked_write(dst, instr, "dst", out)
    if reduce_op is not None:
        _stt_accumulate(c, reduce_op, reduce_cmd, lane0, p, out)
    if reduce_res is not None:
        checked_write(reduce_res, instr, "reduce_res",
                      registers_or_none(c.vec_reduce_regs, c.vec_reduce_known, lane0, p))
    return NkiInstruction(name)


def reciprocal(dst, data, name=None):
    """dst = 1 / data in float32 on Vector
    (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.reciprocal.html)."""
    instr = "reciprocal"
    dst = on_chip(instr, "dst", dst)
    data = on_chip(instr, "data", data)
    same_partitions_and_free(instr, "dst", dst, "data", data)
    numeric_operand(instr, "data", data)
    numeric_operand(instr, "dst", dst, write=True)
    c = ctx()
    c.record(instr=instr, engine="vector", reads=[("data", data)], writes=[("dst", dst)], elems=dst.free_size,
             data_dtype=str(data.dtype), dst_dtype=str(dst.dtype))
    raw = checked_read(data, instr, "data")
    if raw is None:
        checked_write(dst, instr, "dst", None)
        return NkiInstruction(name)
    with np.errstate(all="ignore"):
        out = np.float32(1.0) / _rows_f32(data, raw)
    checked_write(dst, instr, "dst", out)
    return NkiInstruction(name)


def _int32_arg(instr: str, arg: str, value) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        fail(instr, f"argument '{arg}' must be an int32 compile-time constant, got {value!r}")
    if not _INT32_MIN <= int(value) <= _INT32_MAX:
        fail(instr, f"argument '{arg}' = {value} is outside the int32 range")
    return int(value)


def iota(dst, pattern, offset=0, channel_multiplier=0, name=None):
    """dst[c, i] = offset + c * channel_multiplier + sum_k idx_k * step_k on GpSimd.

    `pattern` is up to four [step, num] pairs, outermost first (padded with size-1 dims); values are
    computed in int32 arithmetic (wrapping, INFERRED) and then cast to dst.dtype
    (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.iota.html).
    """
    instr = "iota"
    dst = on_chip(instr, "dst", dst, ("sbuf",))
    numeric_operand(instr, "dst", dst, write=True)
    if not isinstance(pattern, (list, tuple)) or not 1 <= len(pattern) <= 4:
        fail(instr, f"pattern must be a list of 1 to 4 [step, num] pairs, got {pattern!r}")
    steps, nums = [], []
    for i, pair in enumerate(pattern):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            fail(instr, f"pattern[{i}] must be a [step, num] pair, got {pair!r}")
        steps.append(_int32_arg(instr, f"pattern[{i}] step", pair[0]))
        nums.append(_int32_arg(instr, f"pattern[{i}] num", pair[1]))
        if nums[-1] < 1:
            fail(instr, f"pattern[{i}] num must be >= 1, got {nums[-1]}")
    offset = _int32_arg(instr, "offset", offset)
    channel_multiplier = _int32_arg(instr, "channel_multiplier", channel_multiplier)
    if math.prod(nums) != dst.free_size:
        fail(instr, f"pattern {pattern!r} generates {math.prod(nums)} elements per partition but dst "
                    f"('{dst.name}', shape {dst.shape}) has {dst.free_size}")
    c = ctx()
    c.record(instr=instr, engine="gpsimd", writes=[("dst", dst)], elems=dst.free_size, dst_dtype=str(dst.dtype))
    if not c.numerics:
        checked_write(dst, instr, "dst", None)
        return NkiInstruction(name)
    p = dst.shape[0]
    values = np.full((p,) + tuple(nums), offset, np.int64)
    values += (np.arange(p, dtype=np.int64) * channel_multiplier).reshape((p,) + (1,) * len(nums))
    for k, (step, num) in enumerate(zip(steps, nums)):
        shape = [1] * (len(nums) + 1)
        shape[k + 1] = num
        values += (np.arange(num, dtype=np.int64) * step).reshape(shape)
    values = ((values - _INT32_MIN) % (1 << 32) + _INT32_MIN).astype(np.int32)  # int32 arithmetic wraps
    checked_write(dst, instr, "dst", values.reshape(p, -1))
    return NkiInstruction(name)
