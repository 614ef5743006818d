"""Cross-core exchange between the two cores of an LNC2 pair: sendrecv.

References (the three pages agree on everything used here; `latest` adds the multiple-of-16 partition rule
of gpsimd_dma):
    https://awsdocs-neuron.readthedocs-hosted.com/en/v2.29.1/nki/api/generated/nki.isa.sendrecv.html
    https://awsdocs-neuron.readthedocs-hosted.com/en/v2.30.0/nki/api/generated/nki.isa.sendrecv.html
    https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/api/generated/nki.isa.sendrecv.html
    https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/api/generated/nki.isa.dma_engine.html
Choices where the pages are silent: docs/simulator.md#choice-sendrecv-pairing (one place).
"""
from __future__ import annotations

import numbers

from ...access import checked_copy_read, checked_write
from . import constants as C
from ._common import NkiInstruction, ctx, fail, on_chip, require_nc_version

# dma_engine.gpsimd_dma: most bytes per partition by element width in bytes ("1024 bytes for 32-bit types,
# 512 bytes for 16-bit types, 256 bytes for 8-bit types", sendrecv page); other widths are not documented
_GPSIMD_DMA_MAX_BYTES = {4: 1024, 2: 512, 1: 256}
# dma_engine.gpsimd_dma: "the partition dimension size of src/dst must be a multiple of 16" (latest page)
_GPSIMD_DMA_PARTITION_MULTIPLE = 16


def _rank(instr, arg, value, me):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) not in (0, 1):
        fail(instr, f"{arg} must be 0 or 1 (the two cores of the LNC2 pair), got {value!r}")
    if int(value) == me:
        fail(instr, f"{arg}={int(value)} is this core's own rank; sendrecv exchanges data with the other core "
                    f"of the pair (rank {1 - me}): use nisa.tensor_copy for a copy within one core")
    return int(value)


def _check_gpsimd_dma(instr, t):
    if t.shape[0] % _GPSIMD_DMA_PARTITION_MULTIPLE:
        fail(instr, f"dma_engine=gpsimd_dma requires a partition dimension that is a multiple of "
                    f"{_GPSIMD_DMA_PARTITION_MULTIPLE}, got {t.shape[0]} (src/dst shape {t.shape})")
    width = t.dtype.itemsize
    if width not in _GPSIMD_DMA_MAX_BYTES:
        fail(instr, f"dma_engine=gpsimd_dma limits are documented for 8-, 16- and 32-bit types only, got {t.dtype} "
                    f"({8 * width}-bit)")
    per_partition = t.free_size * width
    if per_partition > _GPSIMD_DMA_MAX_BYTES[width]:
        fail(instr, f"dma_engine=gpsimd_dma moves at most {_GPSIMD_DMA_MAX_BYTES[width]} bytes per partition of a "
                    f"{8 * width}-bit type, got {per_partition} ({t.free_size} x {t.dtype}, shape {t.shape})")


def sendrecv(src, dst, send_to_rank, recv_from_rank, pipe_id, dma_engine=C.dma_engine.dma, name=None):
    """Send this core's `src` into the peer's `dst` and receive the peer's `src` into this core's `dst`.

    NeuronCore-v3+, LNC2 only, both tiles in SBUF with the same dtype and shape. A call is a rendezvous
    on `pipe_id`: it returns once the peer made its matching call (runtime.Launch.exchange); calls that
    do not pair up raise instead of hanging (docs/simulator.md#choice-sendrecv-pairing).
    """
    instr = "sendrecv"
    require_nc_version(instr, 3)
    c = ctx()
    if c.num_programs != 2:
        fail(instr, f"is only allowed when LNC is enabled (LNC2, two programs); this launch runs {c.num_programs} "
                    "program(s)")
    src = on_chip(instr, "src", src, ("sbuf",))
    dst = on_chip(instr, "dst", dst, ("sbuf",))
    for arg, t in (("src", src), ("dst", dst)):
        if t.is_indirect():
            fail(instr, f"argument '{arg}' cannot be an indirect (vector_offset) view")
    if src.dtype != dst.dtype:
        fail(instr, f"src and dst must have the same dtype, got src {src.dtype} and dst {dst.dtype}")
    if tuple(src.shape) != tuple(dst.shape):
        fail(instr, f"src and dst must have the same shape, got src {src.shape} and dst {dst.shape}")
    me = c.program_id
    send_to = _rank(instr, "send_to_rank", send_to_rank, me)
    recv_from = _rank(instr, "recv_from_rank", recv_from_rank, me)
    if isinstance(pipe_id, bool) or not isinstance(pipe_id, numbers.Integral) or pipe_id < 0:
        fail(instr, f"pipe_id must be a non-negative integer, got {pipe_id!r}")
    if not isinstance(dma_engine, C.dma_engine):
        fail(instr, f"dma_engine must be an nisa.dma_engine member, got {dma_engine!r}")
    if dma_engine == C.dma_engine.gpsimd_dma:
        _check_gpsimd_dma(instr, src)
    nbytes = src.size * src.dtype.itemsize
    c.record(instr=instr, engine="dma", reads=[("src", src)], writes=[("dst", dst)], bytes=nbytes,
             pipe_id=int(pipe_id), dma_engine=dma_engine.name, dge_mode="unknown")
    raw, written = checked_copy_read(src, instr, "src")
    mine = {"raw": raw, "written": written, "dtype": src.dtype, "shape": tuple(src.shape),
            "dma_engine": dma_engine, "send_to": send_to}
    peer = c.launch.exchange(me, int(pipe_id), mine)[recv_from]
    if peer["send_to"] != me:  # unreachable at LNC2 (ranks are 0/1, never one's own); kept for a wider LNC
        fail(instr, f"program {recv_from} sends to rank {peer['send_to']}, not to this core ({me})")
    if (peer["dtype"], peer["shape"]) != (dst.dtype, tuple(dst.shape)):
        fail(instr, f"program {recv_from} sends a {peer['shape']} {peer['dtype']} src on pipe_id {pipe_id} but "
                    f"program {me}'s dst is {tuple(dst.shape)} {dst.dtype}; the two cores' tiles must match")
    if peer["dma_engine"] != dma_engine:
        fail(instr, f"program {recv_from} uses dma_engine={peer['dma_engine'].name} on pipe_id {pipe_id} but program "
                    f"{me} uses dma_engine={dma_engine.name}; a pair moves through one mechanism "
                    "(docs/simulator.md#choice-sendrecv-pairing)")
    values = None if peer["raw"] is None else peer["raw"].reshape(-1)
    checked_write(dst, instr, "dst", values, written=peer["written"])
    return NkiInstruction(name)
