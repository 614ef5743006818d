"""dma_compute: element-wise sum of up to 16 tensors inside the DMA engines, and read-modify-write
scatter-add / gather-add through a vector_offset.

Source: https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.dma_compute.html
(2.29+ signature `dma_compute(dst, srcs, reduce_op, scales=None, unique_indices=True,
oob_mode=oob_mode.error, name=None)`): `dst = reduce_op(srcs[0]*scales[0], srcs[1]*scales[1], ...)`,
only `nl.add`, all scales 1.0 (or None), fp32 math, result cast to dst.dtype; element counts equal;
at most 16 sources. With a vector_offset (software DGE, the compiler picks it):
- scatter RMW `dst(HBM)[indices] = dst(HBM)[indices] + src(SB)`: dst is the indirect HBM view, one
  source is that same view, the other an SBUF tile;
- gather RMW `dst(SB) = dst(SB) + src(HBM)[indices]`: dst in SBUF, one source an indirect HBM view,
  the other source is dst;
exactly 2 sources, `unique_indices` must be True ("non-unique indices not yet supported").
Without a vector_offset the only DGE mode is none (static descriptors).

Choices (docs/simulator.md#dma_compute-read-modify-write): the sum is a left fold in `srcs` order in
fp32; a scatter-add whose indices repeat inside one instruction raises IndirectHazardError (unique
indices are required and the hardware would race on the read-modify-write); repeated indices in a
gather-add only read a row twice and are accepted.

Trace: instr "dma_compute", `bytes` = bytes written to dst, `rmw=True` when dst is also a source
(always for the indirect modes; the read-back of dst is implied), `srcs` = number of sources,
`dge_mode` ("none" direct, "swdge" indirect) and the indirect attrs of dma_indirect.record_indirect.
"""
from __future__ import annotations

import numbers

import numpy as np

from ...indirect import (check_unique_destination, cover_view, element_addresses, mark_written, read_elements,
                         write_elements)
from ...access import checked_read, checked_write, to_float32, valueless
from ._common import NkiInstruction, alu_op, ctx, fail, hbm_or_sbuf, require_nc_version
from . import constants as C
from .dma_indirect import IndirectAccess, record_indirect, resolve

MAX_SOURCES = 16
RMW_UNIQUE = ("dma_compute read-modify-write with vector_offset requires unique indices within one instruction "
              "(unique_indices=True; non-unique indices are not yet supported by the hardware path)")


def _same_access(a, b) -> bool:
    """Do two views address exactly the same elements (the docs' "one source matches dst")?"""
    if a.storage is not b.storage or a.dtype != b.dtype:
        return False
    if (a.shape, a.strides, a.offset) != (b.shape, b.strides, b.offset):
        return False
    ia, ib = a._vector_index, b._vector_index
    if (ia is None) != (ib is None):
        return False
    if ia is None:
        return True
    ta, tb = ia.index, ib.index
    return (ta.storage is tb.storage and (ta.shape, ta.strides, ta.offset) == (tb.shape, tb.strides, tb.offset)
            and ia.row_stride == ib.row_stride)


def _validate(instr, dst, srcs, reduce_op, scales, unique_indices, oob_mode):
    dst = hbm_or_sbuf(instr, "dst", dst)
    if not isinstance(srcs, (list, tuple)) or not 1 <= len(srcs) <= MAX_SOURCES:
        fail(instr, f"srcs must be a list of 1..{MAX_SOURCES} tensors, got {srcs!r}")
    srcs = [hbm_or_sbuf(instr, f"srcs[{i}]", s) for i, s in enumerate(srcs)]
    op = alu_op(instr, "reduce_op", reduce_op)
    if op.name != "add":
        fail(instr, f"reduce_op must be nl.add (the only supported reduction), got nl.{op.name}")
    if scales is not None:
        if not isinstance(scales, (list, tuple)) or len(scales) != len(srcs):
            fail(instr, f"scales must be None or a list of {len(srcs)} numbers (one per source), got {scales!r}")
        for i, s in enumerate(scales):
            if isinstance(s, bool) or not isinstance(s, numbers.Real) or float(s) != 1.0:
                fail(instr, f"scales[{i}] must be 1.0 (the only supported scale), got {s!r}")
    if not isinstance(unique_indices, bool):
        fail(instr, f"unique_indices must be a bool, got {unique_indices!r}")
    if not isinstance(oob_mode, C.oob_mode):
        fail(instr, f"oob_mode must be an nisa.oob_mode member, got {oob_mode!r}")
    for arg, t in [("dst", dst)] + [(f"srcs[{i}]", s) for i, s in enumerate(srcs)]:
        if t.dtype.is_x4 or (arg == "dst" and t.dtype.category == "scale"):
            fail(instr, f"argument '{arg}' ('{t.name}') has packed/scale dtype {t.dtype}; the DMA computes in float32 "
                        "and cannot convert to or from it")
        if t.size != dst.size:
            fail(instr, f"element counts differ: dst {dst.shape} has {dst.size}, {arg} {t.shape} has {t.size}")
    return dst, srcs


def _fold(parts):
    """fp32 left fold srcs[0] + srcs[1] + ... (flat, row-major pairing)."""
    acc = parts[0].astype(np.float32)
    for p in parts[1:]:
        acc = acc + p
    return acc


def dma_compute(dst, srcs, reduce_op, scales=None, unique_indices=True, oob_mode=C.oob_mode.error, name=None):
    """dst = srcs[0] + srcs[1] + ... in fp32 (DMA engines); scatter-/gather-add with a vector_offset."""
    instr = "dma_compute"
    dst, srcs = _validate(instr, dst, srcs, reduce_op, scales, unique_indices, oob_mode)
    if dst.is_indirect() or any(s.is_indirect() for s in srcs):
        _dma_compute_rmw(instr, dst, srcs, unique_indices, oob_mode)
        return NkiInstruction(name)
    rmw = any(_same_access(s, dst) for s in srcs)
    ctx().record(instr=instr, engine="dma", reads=[(f"srcs[{i}]", s) for i, s in enumerate(srcs)],
                 writes=[("dst", dst)], bytes=dst.size * dst.dtype.itemsize, rmw=rmw, srcs=len(srcs),
                 dge_mode="none")
    raws = [checked_read(s, instr, f"srcs[{i}]") for i, s in enumerate(srcs)]
    if valueless(*raws):
        checked_write(dst, instr, "dst", None)
        return NkiInstruction(name)
    checked_write(dst, instr, "dst", _fold([to_float32(s, r).reshape(-1) for s, r in zip(srcs, raws)]))
    return NkiInstruction(name)


def _dma_compute_rmw(instr, dst, srcs, unique_indices, oob_mode):
    """Scatter RMW (dst indirect) or gather RMW (one source indirect), as on the dma_compute page."""
    modes = ("scatter RMW: dst = HBM .ap(vector_offset=...) view, srcs = [that same view, SBUF tile]; "
             "gather RMW: dst = SBUF tile, srcs = [dst, HBM .ap(vector_offset=...) view] (either order)")
    if len(srcs) != 2:
        fail(instr, f"read-modify-write with vector_offset takes exactly 2 sources, got {len(srcs)} ({modes})")
    if not unique_indices:
        fail(instr, "unique_indices=False is not supported: read-modify-write with vector_offset needs unique "
                    "indices (non-unique indices not yet supported)")
    require_nc_version(instr, 3, "indirect DMA (vector_offset)")
    if dst.is_indirect():
        k = next((i for i, s in enumerate(srcs) if _same_access(s, dst)), None)
        other = srcs[1 - k] if k is not None else None
        if k is None or other.is_indirect() or other.storage.buffer_kind != "sbuf":
            fail(instr, "an indirect dst needs one source that is the same vector_offset view and one SBUF tile "
                        f"({modes})")
        acc = resolve(instr, "dst", dst, oob_mode)
        check_unique_destination(dst, acc.rows, acc.valid, instr, "dst", RMW_UNIQUE)
    else:
        if dst.storage.buffer_kind != "sbuf":
            fail(instr, f"gather RMW needs dst in SBUF, got {dst.storage.buffer_kind} ({modes})")
        k = next((i for i, s in enumerate(srcs) if s.is_indirect()), None)
        if not _same_access(srcs[1 - k], dst):
            fail(instr, f"gather RMW needs the non-indirect source to be dst itself ({modes})")
        acc = resolve(instr, f"srcs[{k}]", srcs[k], oob_mode)
    reads = [(f"srcs[{i}]", s) for i, s in enumerate(srcs)]
    record_indirect(instr, acc, reads, [("dst", dst)], bytes=acc.transferred * acc.row_elems * dst.dtype.itemsize,
                    rmw=True, srcs=2)
    _rmw_data(instr, dst, srcs, acc)


def _rmw_data(instr, dst, srcs, acc: IndirectAccess):
    if acc.rows is None:  # shape-only run
        for i, s in enumerate(srcs):
            if not s.is_indirect():
                checked_read(s, instr, f"srcs[{i}]")
        if dst.is_indirect():
            mark_written(cover_view(dst, None, None))
        else:
            checked_write(dst, instr, "dst", None)
        return
    mask = acc.element_mask().reshape(-1)

    def addrs(v):
        return element_addresses(v, acc.rows if v.is_indirect() else None).reshape(-1)

    parts = [to_float32(s, read_elements(s, addrs(s), mask, instr, f"srcs[{i}]")) for i, s in enumerate(srcs)]
    write_elements(dst, addrs(dst), _fold(parts), mask, instr, "dst")
