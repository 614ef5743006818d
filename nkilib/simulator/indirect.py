"""Indirect (vector_offset) access patterns: the view, its run-time rows, element-level access.

`T.ap(pattern, vector_offset=idx, indirect_dim=0)` on an HBM tensor `T` makes an *indirect view*:
its shape is the pattern's counts `[R, n1, ..., nk]` and element `[w, i1, ..., ik]` lives at storage
element `offset + flat[w] * stride_T(0) + sum(step_j * i_j)`, where `flat = idx.T.flatten()` (one
index per partition of the SBUF index tile `idx` [P, M], read column-major) and `stride_T(0)` is the
stride of `T`'s dim 0 ("indirect_dim: dimension in self.shape whose stride scales the indirect
offset"); the step of the pattern's first pair is not used.
Sources: `NkiTensor.ap` / `vector_select` in the 2.32 language API
(https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.language.NkiTensor.html),
the dma_copy page (vector indirection, DMA batching with a [P, M] index tile, indices read as
`indices.T.flatten()`:
https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.dma_copy.html).

Only DMA instructions consume indirect views (they resolve the rows at run time, with the
instruction's `oob_mode`); every other use of one is rejected (`checked_read` / `checked_write`,
view methods). Index values are only known when the launch computes numerics; a shape-only run
(`numerics=False`) assumes every row is in bounds and unique.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import runtime
from .errors import NkiValidationError, OutOfBoundsError, UninitializedReadError
from .storage import HBM_KINDS

# index tile dtypes of the documented examples: uint32 (dma_copy, dma_transpose), int32 (vector_select)
INDEX_DTYPES = ("int32", "uint32")


@dataclass(frozen=True)
class IndirectIndex:
    """What makes a view indirect: the SBUF index tile and how an index becomes a storage address."""

    index: object  # NkiTensor [P, M] in SBUF, int32 / uint32
    dim: int  # indirect_dim (only 0 is documented for vector_offset)
    row_stride: int  # storage elements (of the view's dtype) between consecutive indices
    num_rows: int  # size of the indexed tensor's dim: valid indices are [0, num_rows)
    indexed_name: str  # name of the tensor .ap() was called on (messages)


def _fail(where: str, msg: str):
    raise NkiValidationError(f"{where}: {msg}")


def make_indirect_view(base, pattern, offset, scalar_offset, vector_offset, indirect_dim, dtype):
    """`base.ap(pattern, offset, vector_offset=..., indirect_dim=..., dtype=...)` (see module doc)."""
    from .tensor import NkiTensor

    where = f"tensor '{base.name}'.ap"
    if base._vector_index is not None:
        _fail(where, "cannot specify an access pattern on an indirect (vector_offset) view")
    if scalar_offset is not None:
        _fail(where, "scalar_offset and vector_offset are mutually exclusive; got both")
    if base.storage.buffer_kind not in HBM_KINDS:
        _fail(where, f"vector_offset indexes HBM tensors only; '{base.name}' is in {base.storage.buffer_kind}")
    if indirect_dim != 0:
        _fail(where, f"vector_offset supports indirect_dim=0 only, got indirect_dim={indirect_dim!r}")
    idx = vector_offset
    if not isinstance(idx, NkiTensor):
        _fail(where, f"vector_offset must be an SBUF tensor, got {type(idx).__name__} {idx!r}")
    if idx._vector_index is not None or idx.storage.buffer_kind != "sbuf":
        _fail(where, f"vector_offset '{idx.name}' must be a plain SBUF tile, got buffer {idx.storage.buffer_kind}"
                     + (" (indirect view)" if idx._vector_index is not None else ""))
    if idx.ndim != 2:
        _fail(where, f"vector_offset '{idx.name}' must be 2-D [partitions, columns], got shape {idx.shape}")
    if str(idx.dtype) not in INDEX_DTYPES:
        _fail(where, f"vector_offset '{idx.name}' must have dtype int32 or uint32, got {idx.dtype}")
    try:
        idx.partition_info()
    except NkiValidationError as e:
        _fail(where, f"vector_offset: {e}")
    pairs = [tuple(p) for p in pattern]
    if len(pairs) < 2 or any(len(p) != 2 for p in pairs):
        _fail(where, f"an indirect pattern needs a row pair and >= 1 free [step, num] pair, got {pattern!r}")
    rows = int(pairs[0][1])
    p_idx, m_idx = idx.shape
    if rows < 1 or rows > p_idx * m_idx:
        _fail(where, f"the pattern selects {rows} rows but vector_offset '{idx.name}' {idx.shape} holds "
                     f"{p_idx * m_idx} indices")
    if m_idx > 1 and p_idx != 128:
        _fail(where, f"a [P, M] vector_offset with M={m_idx} > 1 needs P == 128 partitions, got P={p_idx}")
    # The row at index 0 through the ordinary .ap path: resolves offset and dtype exactly as a
    # direct pattern would and checks that one row fits the storage.
    template = base.ap([[int(pairs[0][0]), 1]] + [list(p) for p in pairs[1:]], offset=offset, dtype=dtype)
    stride_bytes = base.strides[indirect_dim] * base.itemsize_storage
    if stride_bytes % template.itemsize_storage:
        _fail(where, f"the row stride of '{base.name}' ({stride_bytes} bytes) is not a multiple of {template.dtype}")
    spec = IndirectIndex(idx, indirect_dim, stride_bytes // template.itemsize_storage, base.shape[indirect_dim],
                         base.name)
    return NkiTensor(base.storage, template.dtype, [rows] + list(template.shape[1:]),
                     [spec.row_stride] + list(template.strides[1:]), template.offset, vector_index=spec)


def reject_indirect(view, what: str) -> None:
    """View methods and non-DMA consumers: an indirect view cannot be re-viewed (APS, NkiTensor.slice/select)."""
    if view._vector_index is not None:
        raise NkiValidationError(
            f"{what}: '{view.name}' is an indirect (vector_offset) view; it can only be consumed as a whole by "
            "nisa.dma_copy / dma_transpose / dma_compute (its indexed dim cannot be sliced, selected or re-viewed)")


# ---------------------------------------------------------------------------------------------
# Run-time rows
# ---------------------------------------------------------------------------------------------

def index_position(view, w: int) -> tuple:
    """(partition, column) of flat row w in the index tile (column-major flattening)."""
    p = view._vector_index.index.shape[0]
    return w % p, w // p


def free_offsets(view) -> np.ndarray:
    """Storage element offsets of one row's elements relative to its start: shape view.shape[1:]."""
    off = np.zeros(view.shape[1:], np.int64)
    for axis, (n, s) in enumerate(zip(view.shape[1:], view.strides[1:])):
        shape = [1] * (view.ndim - 1)
        shape[axis] = n
        off = off + (np.arange(n, dtype=np.int64) * s).reshape(shape)
    return off


def element_addresses(view, rows: np.ndarray | None = None) -> np.ndarray:
    """Storage element address of every element of `view` (shape view.shape).

    For an indirect view `rows` are its resolved indices; a direct view needs none.
    """
    if view._vector_index is not None:
        starts = view.offset + rows.astype(np.int64) * view._vector_index.row_stride
    else:
        starts = view.offset + np.arange(view.shape[0], dtype=np.int64) * view.strides[0]
    return starts.reshape((-1,) + (1,) * (view.ndim - 1)) + free_offsets(view)[None]


def storage_elements(view) -> int:
    return view.storage.nbytes // view.itemsize_storage


def resolve_rows(view, instr: str, arg: str, oob_skip: bool):
    """Read the index tile of an indirect operand: (rows [R] int64, valid [R] bool), or (None, None)
    in a shape-only run. Raises OutOfBoundsError naming the index value and its position unless
    `oob_skip` (then out-of-bounds rows are marked invalid and not transferred)."""
    from .access import checked_read

    spec = view._vector_index
    raw = checked_read(spec.index, f"{instr}", f"{arg}.vector_offset")
    if not runtime.current().numerics:  # indices of a shape-only run are not read, even carried ones
        return None, None
    rows = np.asarray(raw).T.reshape(-1)[:view.shape[0]].astype(np.int64)
    fo = free_offsets(view)
    lo, hi = int(fo.min()), int(fo.max())
    starts = view.offset + rows * spec.row_stride
    valid = (rows >= 0) & (rows < spec.num_rows) & (starts + lo >= 0) & (starts + hi < storage_elements(view))
    if not oob_skip and not valid.all():
        w = int(np.argmin(valid))
        p, m = index_position(view, w)
        raise OutOfBoundsError(
            f"nisa.{instr}: argument '{arg}': index {int(rows[w])} at vector_offset '{spec.index.name}'[{p}, {m}] "
            f"(row {w} of the access) is out of bounds for dim {spec.dim} of '{spec.indexed_name}' "
            f"({spec.num_rows} rows); oob_mode=error (pass oob_mode=nisa.oob_mode.skip to skip such rows)")
    return rows, valid


def check_unique_destination(view, rows, valid, instr: str, arg: str, why: str) -> None:
    """Reject two transferred rows of one instruction writing the same destination element."""
    if rows is None or not valid.any():  # shape-only run, or every row skipped (oob_mode.skip)
        return
    addrs = element_addresses(view, rows)
    live = np.flatnonzero(valid)
    flat = addrs[live].reshape(len(live), -1)
    owner = np.repeat(live, flat.shape[1])
    order = np.argsort(flat.reshape(-1), kind="stable")
    sorted_addrs = flat.reshape(-1)[order]
    dup = np.flatnonzero(sorted_addrs[1:] == sorted_addrs[:-1])
    if dup.size == 0:
        return
    w0, w1 = int(owner[order[dup[0]]]), int(owner[order[dup[0] + 1]])
    (p0, m0), (p1, m1) = index_position(view, w0), index_position(view, w1)
    from .errors import IndirectHazardError

    idx_name = view._vector_index.index.name
    raise IndirectHazardError(
        f"nisa.{instr}: argument '{arg}': rows {w0} and {w1} of one instruction write the same elements of "
        f"'{view.name}' (index {int(rows[w0])} at vector_offset '{idx_name}'[{p0}, {m0}] and index {int(rows[w1])} "
        f"at '{idx_name}'[{p1}, {m1}]); {why}")


def cover_view(view, rows, valid):
    """A direct view spanning every row an indirect access may touch, for the trace's dependency regions.

    Rows min..max of the transferred indices; in a shape-only run (rows unknown) all rows of the
    indexed dim that fit the storage. None when no row is transferred.
    """
    from .tensor import NkiTensor

    spec = view._vector_index
    if rows is not None:
        if not valid.any():
            return None
        lo, hi = int(rows[valid].min()), int(rows[valid].max())
    else:
        fo = free_offsets(view)
        room = storage_elements(view) - 1 - view.offset - int(fo.max())
        lo, hi = 0, max(0, min(spec.num_rows - 1, room // spec.row_stride if spec.row_stride > 0 else 0))
    return NkiTensor(view.storage, view.dtype, [hi - lo + 1] + list(view.shape[1:]),
                     [spec.row_stride] + list(view.strides[1:]), view.offset + lo * spec.row_stride)


def contiguous_runs_per_row(view) -> int:
    """Contiguous storage runs in one row of a view (its free dims): one DMA descriptor each."""
    runs, expect = 1, 1
    dims = list(zip(view.shape[1:], view.strides[1:]))
    merged = True
    for n, s in reversed(dims):
        if n == 1:
            continue
        if merged and s == expect:
            expect *= n
        else:
            merged = False
            runs *= n
    return runs


# ---------------------------------------------------------------------------------------------
# Element-level checked access (masked, any addresses)
# ---------------------------------------------------------------------------------------------

class _ByteSelection:
    """The subset of a per-storage-byte mask an access touches (what runtime.note_access expects)."""

    def __init__(self, mask: np.ndarray, index: np.ndarray):
        self._mask, self._index = mask, index

    def any(self) -> bool:
        return bool(self._mask[self._index].any())

    def __setitem__(self, key, value):
        self._mask[self._index] = value


def _byte_index(view, addrs: np.ndarray) -> np.ndarray:
    isz = view.itemsize_storage
    return (addrs.reshape(-1, 1) * isz + np.arange(isz, dtype=np.int64)).reshape(-1)


def _elements(view) -> np.ndarray:
    return view.storage.data.view(view.np_dtype)


def read_elements(view, addrs: np.ndarray, mask: np.ndarray, instr: str, arg: str):
    """Values (storage dtype, shape addrs.shape; zeros where not `mask`) or None in a shape-only run.

    Strict mode rejects reading never-written elements; LNC2 shared_hbm reads join race tracking.
    """
    ctx = runtime.current()
    st = view.storage
    sel = addrs[mask]
    if ctx.settings.strict and st.written is not None:
        isz = view.itemsize_storage
        ok = st.written[_byte_index(view, sel)].reshape(-1, isz).all(axis=1)
        if not ok.all():
            raise UninitializedReadError(
                f"{instr}: argument '{arg}' reads {int((~ok).sum())} element(s) of tensor '{st.name}' that were never "
                f"written (first at storage element {int(sel[np.argmin(ok)])})")
    if st.buffer_kind == "shared_hbm" and ctx.num_programs > 1:
        index = _byte_index(view, sel)
        ctx.launch.note_access(st, lambda m: _ByteSelection(m, index), False, ctx.program_id, f"{instr} '{arg}'")
    if not ctx.numerics:
        return None
    out = np.zeros(addrs.shape, view.np_dtype)
    out[mask] = _elements(view)[sel]
    return out


def write_elements(view, addrs: np.ndarray, values, mask: np.ndarray, instr: str, arg: str) -> None:
    """Write `values` (shape addrs.shape) where `mask`, casting to the view's dtype; marks bytes written."""
    from .access import cast_values

    ctx = runtime.current()
    st = view.storage
    sel = addrs[mask]
    index = _byte_index(view, sel)
    if st.buffer_kind == "shared_hbm" and ctx.num_programs > 1:
        ctx.launch.note_access(st, lambda m: _ByteSelection(m, index), True, ctx.program_id, f"{instr} '{arg}'")
    st.modified = True
    if ctx.numerics and values is not None:
        vals = cast_values(np.asarray(values)[mask], view.dtype, view.np_dtype)
        _elements(view)[sel] = vals
    if st.written is not None:
        st.written[index] = True


def mark_written(view) -> None:
    """Shape-only run: mark every byte of a (cover) view written, without data or race tracking; the
    view's elements hold no known value any more."""
    from .access import forget_or_know_values

    if view.storage.written is not None:
        view.byte_mask_view(view.storage.written)[...] = True
    view.storage.modified = True
    forget_or_know_values(view, False)
