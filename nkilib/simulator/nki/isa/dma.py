"""DMA instructions: dma_copy, dma_transpose (direct; indirect operands go to dma_indirect.py).

Sources (2.32 API pages):
https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.dma_copy.html,
https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.dma_transpose.html;
DGE modes: https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/deep-dives/nki-dge.html.
"""
from __future__ import annotations

import numpy as np

from ...access import checked_copy_read, checked_read, checked_write, to_float32
from ._common import NkiInstruction, ctx, fail, hbm_or_sbuf, require_nc_version
from . import constants as C
from .dma_indirect import indirect_dma_copy, indirect_dma_transpose

# Parameters of dma_copy in the <= 2.28 docs, removed in NKI 0.3.0 (2.29): read-modify-write moved to
# nisa.dma_compute (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.28.0/nki/api/generated/nki.isa.dma_copy.html).
_REMOVED_DMA_COPY_ARGS = ("dst_rmw_op", "unique_indices")


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


def _reject_removed_args(instr, extra: dict) -> None:
    for arg in extra:
        if arg in _REMOVED_DMA_COPY_ARGS:
            fail(instr, f"argument '{arg}' was removed from dma_copy in NKI 0.3.0 (SDK 2.29) and is not in the 2.32 "
                        "API; accumulate with nisa.dma_compute(dst=d, srcs=[d, src], reduce_op=nl.add)")
    raise TypeError(f"nisa.{instr}() got an unexpected keyword argument '{next(iter(extra))}'")


def dma_copy(dst, src, priority=None, oob_mode=C.oob_mode.error, dge_mode=C.dge_mode.unknown, engine=C.engine.unknown,
             name=None, **removed):
    """dst = src between HBM and SBUF (never PSUM); dtype conversion via fp32 if dtypes differ.

    An operand made with `.ap(vector_offset=...)` makes this a gather (src) or scatter (dst):
    see `dma_indirect.indirect_dma_copy`. `dst_rmw_op` / `unique_indices` (<= 2.28) are rejected
    with a pointer to nisa.dma_compute.
    """
    instr = "dma_copy"
    if removed:
        _reject_removed_args(instr, removed)
    dst = hbm_or_sbuf(instr, "dst", dst)
    src = hbm_or_sbuf(instr, "src", src)
    _check_modes(instr, dge_mode, oob_mode, priority, engine)
    if dst.size != src.size:
        fail(instr, f"element counts differ: dst {dst.shape} has {dst.size}, src {src.shape} has {src.size}")
    if dst.dtype != src.dtype:
        if dst.dtype.is_x4 or src.dtype.is_x4:
            fail(instr,
                 f"dtype conversion {src.dtype} -> {dst.dtype} is not supported for MX x4 dtypes "
                 "(https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.dma_copy.html)")
        if dge_mode == C.dge_mode.hwdge:
            fail(instr, f"dge_mode=hwdge requires equal dtypes, got src {src.dtype} and dst {dst.dtype}")
    if dst.is_indirect() or src.is_indirect():
        indirect_dma_copy(instr, dst, src, oob_mode, dge_mode)
        return NkiInstruction(name)
    c = ctx()
    c.record(instr=instr, engine="dma", reads=[("src", src)], writes=[("dst", dst)],
             bytes=dst.size * max(dst.dtype.itemsize, src.dtype.itemsize), dge_mode=dge_mode.name)
    raw, written = checked_copy_read(src, instr, "src")  # a copy may move never-written values (access.py)
    if raw is None:
        checked_write(dst, instr, "dst", None, written=written)
        return NkiInstruction(name)
    # elements are paired in each view's row-major order (docs/simulator.md#choice-dma-pairing)
    values = raw.reshape(-1) if dst.dtype == src.dtype else to_float32(src, raw).reshape(-1)
    if dst.dtype == src.dtype and values.dtype != dst.np_dtype:
        values = values.astype(dst.np_dtype)
    checked_write(dst, instr, "dst", values, written=written)
    return NkiInstruction(name)


_DMA_T_AXES = {2: (1, 0), 3: (2, 1, 0), 4: (3, 1, 2, 0)}
_HWDGE_T_ROWS = (1, 2, 4, 8, 16)  # 3-D/4-D hwdge transpose: allowed src.shape[0] (2.32 page)


def _check_hwdge_transpose(instr, src):
    """DMA Direct Transpose Constraints of the 2.32 dma_transpose page, for dge_mode=hwdge."""
    if src.dtype.itemsize != 2:
        fail(instr, f"dge_mode=hwdge requires a 2-byte dtype, got {src.dtype}")
    if src.ndim == 2 and src.shape[0] != 16:
        fail(instr, f"dge_mode=hwdge 2-D transpose requires src.shape[0] == 16, got {src.shape[0]}")
    if src.ndim > 2:
        if src.shape[0] not in _HWDGE_T_ROWS:
            fail(instr, f"dge_mode=hwdge {src.ndim}-D transpose requires src.shape[0] in {{1, 2, 4, 8, 16}}, "
                        f"got {src.shape[0]} (src shape {src.shape})")
        if (src.shape[0] * src.shape[-2]) % 16:
            fail(instr, f"dge_mode=hwdge {src.ndim}-D transpose requires (src.shape[0] * src.shape[-2]) % 16 == 0, "
                        f"got {src.shape[0]} * {src.shape[-2]} = {src.shape[0] * src.shape[-2]} "
                        f"(src shape {src.shape})")
    # "src.shape[-1] <= 128" holds already: it is dst's partition dim (checked against the partition limit)


def dma_transpose(dst, src, axes=None, priority=None, dge_mode=C.dge_mode.unknown, oob_mode=C.oob_mode.error,
                  name=None):
    """dst = src.transpose(axes); dst in SBUF, src in HBM or SBUF.

    Direct: dge_mode unknown or hwdge (hwdge: the 2.32 shape rules, 2-byte dtype); 1-, 2- and
    4-byte dtypes under dge_mode=unknown. An `src.ap(vector_offset=...)` makes it an indirect
    (gather) transpose: see `dma_indirect.indirect_dma_transpose`.
    """
    instr = "dma_transpose"
    dst = hbm_or_sbuf(instr, "dst", dst)
    src = hbm_or_sbuf(instr, "src", src)
    _check_modes(instr, dge_mode, oob_mode, priority)
    if dst.storage.buffer_kind != "sbuf":
        fail(instr, f"dst must be in SBUF, got {dst.storage.buffer_kind}")
    if dst.is_indirect():
        fail(instr, "dst cannot be an indirect (vector_offset) view; only src may be indirect (gather transpose)")
    if src.ndim not in _DMA_T_AXES:
        fail(instr, f"src must be 2-D, 3-D or 4-D, got shape {src.shape}")
    expect_axes = _DMA_T_AXES[src.ndim]
    axes = expect_axes if axes is None else tuple(axes)
    if axes != expect_axes:
        fail(instr, f"axes {axes} unsupported for a {src.ndim}-D src; supported: {expect_axes}")
    if src.dtype != dst.dtype:
        fail(instr, f"src dtype {src.dtype} must equal dst dtype {dst.dtype}")
    if src.dtype.is_x4 or src.dtype.itemsize not in (1, 2, 4):
        fail(instr, f"dtype {src.dtype} unsupported; dma_transpose moves 1-, 2- or 4-byte elements (not packed x4)")
    want = tuple(src.shape[a] for a in axes)
    if dst.shape != want:
        fail(instr, f"dst shape {dst.shape} must equal the transposed src shape {want} (src {src.shape}, axes {axes})")
    if src.is_indirect():
        indirect_dma_transpose(instr, dst, src, axes, oob_mode, dge_mode)
        return NkiInstruction(name)
    if dge_mode not in (C.dge_mode.unknown, C.dge_mode.hwdge):
        fail(instr, f"a direct (non-indirect) transpose supports dge_mode unknown or hwdge only, got {dge_mode.name}")
    if oob_mode == C.oob_mode.skip:
        fail(instr, "oob_mode=skip is only valid when src uses indirect indexing (.ap(vector_offset=...))")
    if dge_mode == C.dge_mode.hwdge:
        _check_hwdge_transpose(instr, src)
    c = ctx()
    c.record(instr=instr, engine="dma", reads=[("src", src)], writes=[("dst", dst)],
             bytes=dst.size * dst.dtype.itemsize, transpose=True)
    raw = checked_read(src, instr, "src")
    checked_write(dst, instr, "dst", None if raw is None else np.transpose(raw, axes))
    return NkiInstruction(name)
