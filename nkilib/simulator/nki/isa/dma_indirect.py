"""Indirect DMA: dma_copy gather/scatter and dma_transpose gather through `.ap(vector_offset=...)`.

Semantics (2.32 API pages):
- dma_copy (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.dma_copy.html):
  vector indirection on src (gather) or dst (scatter), one index per partition of an SBUF [P, 1]
  index tile; "DMA batching": a [128, M] index tile on src only, read as `indices.T.flatten()`,
  src/dst contiguous and of one dtype. `oob_mode.error` raises, `oob_mode.skip` skips that row.
- dma_transpose (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.dma_transpose.html),
  "DMA Indirect Transpose Constraints": `dst = src[indices.T.flatten()[:src.shape[0]], ...].transpose(axes)`.
- DGE modes (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/deep-dives/nki-dge.html): only
  software DGE (GpSimd-generated descriptors) does indirect DMA; `unknown` selects it; NeuronCore-v3+.

Choices where the docs are silent (docs/simulator.md#indirect-dma-and-rmw): a scatter whose rows write
the same destination element twice raises IndirectHazardError (write order unspecified); for dma_copy the
pattern's row count must equal the number of indices; an indirect operand on both sides is rejected.

Trace contract (cost model): attrs `indirect=True`, `dge_mode="swdge"`, `rows` (rows transferred),
`descriptors` (rows x contiguous runs per row of the indexed tensor), `bytes` (bytes moved); the
indirect operand is recorded as the rows min..max it touches (all rows in a shape-only run) with its
exact byte count, and the index tile as a read named "vector_offset".
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from ...indirect import (check_unique_destination, contiguous_runs_per_row, cover_view, element_addresses,
                         mark_written, read_elements, resolve_rows, write_elements)
from ...access import checked_read, checked_write, to_float32
from ._common import ctx, fail, require_nc_version
from . import constants as C

SCATTER_HAZARD = ("the write order of one DMA is unspecified, so this is a data hazard: make the indices unique "
                  "within the instruction (or pre-combine duplicate rows)")


@dataclass
class IndirectAccess:
    """An indirect operand with its run-time rows (rows/valid None in a shape-only run)."""

    arg: str
    view: object
    rows: np.ndarray | None
    valid: np.ndarray | None

    @property
    def transferred(self) -> int:
        return int(self.valid.sum()) if self.rows is not None else self.view.shape[0]

    @property
    def row_elems(self) -> int:
        return int(np.prod(self.view.shape[1:]))

    def element_mask(self, axes=None) -> np.ndarray:
        """Per element of the view (optionally transposed by `axes`): is its row transferred?"""
        v = self.view
        m = np.broadcast_to(self.valid.reshape((-1,) + (1,) * (v.ndim - 1)), v.shape)
        return m if axes is None else np.transpose(m, axes)


def check_indirect_dge(instr: str, dge) -> None:
    if dge not in (C.dge_mode.unknown, C.dge_mode.swdge):
        fail(instr, f"an indirect (vector_offset) operand needs dge_mode=swdge or unknown (software DGE is the only "
                    f"mode with indirect support), got dge_mode={dge.name}")
    require_nc_version(instr, 3, "indirect DMA (vector_offset)")


def resolve(instr: str, arg: str, view, oob) -> IndirectAccess:
    rows, valid = resolve_rows(view, instr, arg, oob == C.oob_mode.skip)
    return IndirectAccess(arg, view, rows, valid)


def record_indirect(instr: str, acc: IndirectAccess, reads, writes, extra_reads=(), **attrs) -> None:
    """Record one indirect DMA: the indirect operand as its covering rows, plus the index tile."""
    c = ctx()
    view = acc.view
    cover = cover_view(view, acc.rows, acc.valid)
    replaced = set()

    def sub(pairs):
        out = []
        for a, v in pairs:
            if v is view:
                replaced.add(a)
                v = cover
            out.append((a, v))
        return out

    rows = acc.transferred
    attrs.update(indirect=True, dge_mode="swdge", rows=rows, descriptors=rows * contiguous_runs_per_row(view))
    c.record(instr=instr, engine="dma", reads=sub(reads) + [("vector_offset", view._vector_index.index)]
             + list(extra_reads), writes=sub(writes), **attrs)
    if c.trace is not None and cover is not None:
        exact = rows * acc.row_elems * view.dtype.itemsize

        def fix(ops):
            return tuple(dataclasses.replace(o, nbytes=exact) if o.arg in replaced else o for o in ops)

        rec = c.trace[-1]
        c.trace[-1] = dataclasses.replace(rec, reads=fix(rec.reads), writes=fix(rec.writes))


def _addresses(view, acc: IndirectAccess) -> np.ndarray:
    return element_addresses(view, acc.rows if view is acc.view else None)


def indirect_dma_copy(instr: str, dst, src, oob, dge) -> None:
    """Gather (src indirect) or scatter (dst indirect); already validated: buffers, modes, counts, dtypes."""
    if dst.is_indirect() and src.is_indirect():
        fail(instr, "src and dst are both indirect (vector_offset) views; gather and scatter need separate DMAs")
    check_indirect_dge(instr, dge)
    arg, view = ("src", src) if src.is_indirect() else ("dst", dst)
    idx = view._vector_index.index
    p_idx, m_idx = idx.shape
    if view.shape[0] != p_idx * m_idx:
        fail(instr, f"'{arg}' selects {view.shape[0]} rows but vector_offset '{idx.name}' {idx.shape} holds "
                    f"{p_idx * m_idx} indices; dma_copy transfers one row per index")
    if m_idx > 1:
        if arg == "dst":
            fail(instr, f"a 2-D vector_offset [{p_idx}, {m_idx}] (DMA batching) is only supported on src (gather), "
                        "not on dst (scatter)")
        if src.dtype != dst.dtype:
            fail(instr, f"DMA batching (vector_offset [{p_idx}, {m_idx}]) needs equal dtypes, got src {src.dtype} "
                        f"and dst {dst.dtype}")
        if contiguous_runs_per_row(src) != 1 or not dst.is_contiguous():
            fail(instr, "DMA batching (2-D vector_offset) needs src rows and dst contiguous in memory")
    acc = resolve(instr, arg, view, oob)
    if arg == "dst":
        check_unique_destination(view, acc.rows, acc.valid, instr, "dst", SCATTER_HAZARD)
    itemsize = max(dst.dtype.itemsize, src.dtype.itemsize)
    record_indirect(instr, acc, [("src", src)], [("dst", dst)], bytes=acc.transferred * acc.row_elems * itemsize)
    if acc.rows is None:  # shape-only run: no data, rows unknown
        if arg == "src":
            checked_write(dst, instr, "dst", None)
        else:
            checked_read(src, instr, "src")
            mark_written(cover_view(view, None, None))
        return
    # elements pair up in each view's row-major order (as for a direct dma_copy)
    mask = acc.element_mask().reshape(-1)
    raw = read_elements(src, _addresses(src, acc).reshape(-1), mask, instr, "src")
    values = raw if src.dtype == dst.dtype else to_float32(src, raw)
    write_elements(dst, _addresses(dst, acc).reshape(-1), values, mask, instr, "dst")


def _check_indirect_transpose(instr: str, src) -> None:
    """DMA Indirect Transpose Constraints of the 2.32 dma_transpose page."""
    idx = src._vector_index.index
    if src.ndim == 4 and src.shape[1] != 1 and src.shape[2] != 1:
        fail(instr, f"indirect 4-D transpose needs src.shape[1] == 1 or src.shape[2] == 1, got src shape {src.shape}")
    # "src.shape[-1] <= 128" holds already: it is dst's partition dim (checked against the partition limit)
    if src.dtype.itemsize != 2 or src.dtype.is_x4:
        fail(instr, f"indirect transpose needs a 2-byte src dtype, got {src.dtype}")
    if src.shape[0] % 16:
        fail(instr, f"indirect transpose needs src.shape[0] divisible by 16, got {src.shape[0]}")
    if not (16 <= idx.shape[0] <= 128 and idx.shape[0] % 16 == 0):
        fail(instr, f"indirect transpose needs indices.shape[0] in [16, 128] and divisible by 16, got indices "
                    f"'{idx.name}' shape {idx.shape}")
    if str(idx.dtype) != "uint32":
        fail(instr, f"indirect transpose needs uint32 indices, got '{idx.name}' dtype {idx.dtype}")


def indirect_dma_transpose(instr: str, dst, src, axes, oob, dge) -> None:
    """Gather rows through src's vector_offset, then transpose; dst/src shapes and dtypes already checked."""
    check_indirect_dge(instr, dge)
    _check_indirect_transpose(instr, src)
    acc = resolve(instr, "src", src, oob)
    record_indirect(instr, acc, [("src", src)], [("dst", dst)],
                    bytes=acc.transferred * acc.row_elems * dst.dtype.itemsize, transpose=True)
    if acc.rows is None:
        checked_write(dst, instr, "dst", None)
        return
    raw = read_elements(src, _addresses(src, acc), acc.element_mask(), instr, "src")
    write_elements(dst, element_addresses(dst), np.transpose(raw, axes), acc.element_mask(axes), instr, "dst")
