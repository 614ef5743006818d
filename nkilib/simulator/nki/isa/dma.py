"""DMA instructions: dma_copy, dma_transpose (spec §5.6)."""
from __future__ import annotations

import numpy as np

from ...tensor import checked_copy_read, checked_read, checked_write, to_float32
from ._common import NkiInstruction, ctx, fail, hbm_or_sbuf, require_nc_version
from . import constants as C


def _check_modes(instr, dge, oob, priority, eng=None):
    if not isinstance(dge, C.dge_mode):
        fail(instr, f"dge_mode must be an nisa.dge_mode member, got {dge!r}")
    if not isinstance(oob, C.oob_mode):
        fail(instr, f"oob_mode must be an nisa.oob_mode member, got {oob!r}")
    if dge == C.dge_mode.hwdge:
        require_nc_version(instr, 3, "dge_mode=hwdge")
    if priority is not None:
        require_nc_version(instr, 4, "priority")
        if priority not in (0, 1, 2, 3):
            fail(instr, f"priority must be 0..3, got {priority!r}")
    if eng is not None:
        if not isinstance(eng, C.engine):
            fail(instr, f"engine must be an nisa.engine member, got {eng!r}")
        if eng not in (C.engine.unknown, C.engine.sync, C.engine.scalar):
            fail(instr, f"engine must be sync or scalar (hwdge trigger), got {eng.name}")
        if eng != C.engine.unknown and dge != C.dge_mode.hwdge:
            fail(instr, f"engine={eng.name} is only valid with dge_mode=hwdge, got dge_mode={dge.name}")


def dma_copy(dst, src, priority=None, oob_mode=C.oob_mode.error, dge_mode=C.dge_mode.unknown, engine=C.engine.unknown,
             name=None):
    """dst = src between HBM and SBUF (never PSUM); dtype conversion via fp32 if dtypes differ."""
    instr = "dma_copy"
    dst = hbm_or_sbuf(instr, "dst", dst)
    src = hbm_or_sbuf(instr, "src", src)
    _check_modes(instr, dge_mode, oob_mode, priority, engine)
    if dst.size != src.size:
        fail(instr, f"element counts differ: dst {dst.shape} has {dst.size}, src {src.shape} has {src.size}")
    if dst.dtype != src.dtype:
        if dst.dtype.is_x4 or src.dtype.is_x4:
            fail(instr, f"dtype conversion {src.dtype} -> {dst.dtype} is not supported for MX x4 dtypes (spec §5.6)")
        if dge_mode == C.dge_mode.hwdge:
            fail(instr, f"dge_mode=hwdge requires equal dtypes, got src {src.dtype} and dst {dst.dtype}")
    c = ctx()
    c.record(instr=instr, engine="dma", reads=[("src", src)], writes=[("dst", dst)],
             bytes=dst.size * max(dst.dtype.itemsize, src.dtype.itemsize), dge_mode=dge_mode.name)
    raw, written = checked_copy_read(src, instr, "src")  # a copy may move never-written values (tensor.py)
    if raw is None:
        checked_write(dst, instr, "dst", None, written=written)
        return NkiInstruction(name)
    # elements are paired in each view's row-major order (spec §10 Q18)
    values = raw.reshape(-1) if dst.dtype == src.dtype else to_float32(src, raw).reshape(-1)
    if dst.dtype == src.dtype and values.dtype != dst.np_dtype:
        values = values.astype(dst.np_dtype)
    checked_write(dst, instr, "dst", values, written=written)
    return NkiInstruction(name)


_DMA_T_AXES = {2: (1, 0), 3: (2, 1, 0), 4: (3, 1, 2, 0)}


def dma_transpose(dst, src, axes=None, priority=None, dge_mode=C.dge_mode.unknown, oob_mode=C.oob_mode.error,
                  name=None):
    """dst = src.transpose(axes); dst in SBUF, src in HBM or SBUF (spec §5.6)."""
    instr = "dma_transpose"
    dst = hbm_or_sbuf(instr, "dst", dst)
    src = hbm_or_sbuf(instr, "src", src)
    _check_modes(instr, dge_mode, oob_mode, priority)
    if dst.storage.buffer_kind != "sbuf":
        fail(instr, f"dst must be in SBUF, got {dst.storage.buffer_kind}")
    if src.ndim not in _DMA_T_AXES:
        fail(instr, f"src must be 2-D, 3-D or 4-D, got shape {src.shape}")
    expect_axes = _DMA_T_AXES[src.ndim]
    axes = expect_axes if axes is None else tuple(axes)
    if axes != expect_axes:
        fail(instr, f"axes {axes} unsupported for a {src.ndim}-D src; supported: {expect_axes}")
    if src.dtype != dst.dtype:
        fail(instr, f"src dtype {src.dtype} must equal dst dtype {dst.dtype}")
    # Transposing DMA is documented bit-accurate for 2- and 4-byte dtypes [TRN2] (spec §5.6).
    if src.dtype.itemsize not in (2, 4) or src.dtype.is_x4:
        fail(instr, f"dtype {src.dtype} unsupported; dma_transpose moves 2- or 4-byte elements")
    want = tuple(src.shape[a] for a in axes)
    if dst.shape != want:
        fail(instr, f"dst shape {dst.shape} must equal the transposed src shape {want} (src {src.shape}, axes {axes})")
    if dge_mode == C.dge_mode.hwdge:
        if src.dtype.itemsize != 2:
            fail(instr, f"dge_mode=hwdge requires a 2-byte dtype, got {src.dtype}")
        if src.ndim == 2 and src.shape[0] != 16:
            fail(instr, f"dge_mode=hwdge 2-D transpose requires src.shape[0] == 16, got {src.shape[0]}")
    c = ctx()
    c.record(instr=instr, engine="dma", reads=[("src", src)], writes=[("dst", dst)],
             bytes=dst.size * dst.dtype.itemsize, transpose=True)
    raw = checked_read(src, instr, "src")
    checked_write(dst, instr, "dst", None if raw is None else np.transpose(raw, axes))
    return NkiInstruction(name)
