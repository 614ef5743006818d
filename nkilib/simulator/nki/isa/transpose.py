"""Partition <-> free transpose on the Tensor or Vector engine: nc_transpose
(https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.nc_transpose.html)."""
from __future__ import annotations

from ...access import checked_read, checked_write
from . import constants as C
from ._common import NkiInstruction, ctx, fail, on_chip, resolve_engine

_TENSOR_MAX = 128  # Tensor Engine: input tile [128, 128] or smaller
_VECTOR_MAX = 32  # Vector Engine: 32x32 block transpose


def nc_transpose(dst, data, engine=C.engine.unknown, name=None):
    """dst[F, P] = data[P, F...]^T (free dims flattened first), bit-exact, dst dtype == data dtype.

    `engine.tensor`: data in SBUF, dst in PSUM, at most [128, 128] (a matmul against the identity,
    written like `nc_matmul(is_transpose=True)`). `engine.vector`: SBUF/PSUM in and out, at most
    [32, 32]. `engine.unknown` ("the compiler selects based on the input shape", docs) picks the
    Tensor engine when dst is in PSUM and data in SBUF, else the Vector engine (INFERRED: the only
    choice the memory rules leave open;
    https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.nc_transpose.html).
    """
    instr = "nc_transpose"
    dst = on_chip(instr, "dst", dst)
    data = on_chip(instr, "data", data)
    p, f = data.shape[0], data.free_size
    if dst.dtype != data.dtype:
        fail(instr, f"dst dtype {dst.dtype} must equal data dtype {data.dtype}")
    if dst.shape[0] != f or dst.free_size != p:
        fail(instr, f"dst ('{dst.name}') must be [{f}, {p}] (the transpose of data {data.shape} with free dims "
                    f"flattened), got shape {dst.shape}")
    dst_psum = dst.storage.buffer_kind == "psum"
    data_sbuf = data.storage.buffer_kind == "sbuf"
    default = C.engine.tensor if dst_psum and data_sbuf else C.engine.vector
    eng = resolve_engine(instr, engine, (C.engine.tensor, C.engine.vector), default)
    if eng == C.engine.tensor:
        if not data_sbuf:
            fail(instr, f"engine tensor reads data only from SBUF, got data ('{data.name}') in "
                        f"{data.storage.buffer_kind}")
        if not dst_psum:
            fail(instr, f"engine tensor writes dst only to PSUM, got dst ('{dst.name}') in {dst.storage.buffer_kind}")
        limit = _TENSOR_MAX
    else:
        limit = _VECTOR_MAX
    if p > limit or f > limit:
        fail(instr, f"data [{p}, {f}] (shape {data.shape}) exceeds the {eng.name} engine limit "
                    f"[{limit}, {limit}]")
    c = ctx()
    c.record(instr=instr, engine=eng.name, reads=[("data", data)], writes=[("dst", dst)], elems=f, partitions=p,
             data_dtype=str(data.dtype), dst_dtype=str(dst.dtype))
    raw = checked_read(data, instr, "data")
    values = None if raw is None else raw.reshape(p, f).T.copy()
    # a Tensor-engine transpose is a matmul write into PSUM (same bookkeeping as is_transpose)
    checked_write(dst, instr, "dst", values, matmul=eng == C.engine.tensor)
    return NkiInstruction(name)
