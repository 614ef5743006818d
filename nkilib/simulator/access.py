"""Checked access to NkiTensor views: the reads and writes every instruction goes through, and the
value conversions between compute results and storage.

- `checked_read`: a computation's operand: strict mode (`NKILIB_SIM_STRICT=1`) raises
  `UninitializedReadError` on never-written elements; LNC2 race bookkeeping on shared HBM.
- `checked_copy_read` + `checked_write(written=)`: data movement (tensor_copy, dma_copy) may copy
  never-written elements; their never-written mark travels with the data
  (docs/simulator.md#strictness-decisions).
- `checked_write`: converts values to the view's dtype (`cast_values`), writes them, marks the bytes
  written (and matmul-written in PSUM), records the LNC2 write.
- `carries_values` / `valueless`: shape-only runs (numerics=False) compute an instruction only when
  every data input carries values (docs/simulator.md#shape-only-runs-with-carried-integer-inputs): a
  read returns None for a view that does not, and the instruction then writes no values.
- `cast_values` / `to_float32`: conversion rules of the 2.32 CPU simulator guide and release notes
  (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/guides/nki_simulator.html,
  https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/release-notes/components/nki.html).
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from . import runtime
from .dtypes import NkiDType
from .errors import NkiValidationError, UninitializedReadError
from .indirect import reject_indirect
from .tensor import NkiTensor


def cast_values(values: np.ndarray, dtype: NkiDType, np_dtype: np.dtype) -> np.ndarray:
    """Convert fp32 (or integer) compute results to `dtype` storage (the 2.32 CPU simulator guide and
    release notes).

    Floats: round-to-nearest-even via ml_dtypes. Overflow into fp8 follows ml_dtypes (Inf for
    e5m2/e4m3, NaN for e4m3fn): our choice, undocumented (docs/simulator.md#choice-fp8-overflow). tfloat32: RNE to 10
    mantissa bits. Integers: RNE then saturate to the destination range (0.6.0 simulator fix, 2.32 release notes); NaN
    -> 0. Values already in the storage dtype are written unchanged: same-dtype copies (dma_copy,
    tensor_copy, transpose mode) are bit-exact, NaN payloads included (tensor_copy / dma_copy pages);
    a float round trip through fp32 would canonicalise NaN payloads.
    """
    if isinstance(values, np.ndarray) and values.dtype == np_dtype and dtype != "tfloat32":
        return values
    if dtype.category == "float":
        v = np.asarray(values, dtype=np.float32)
        if dtype == "tfloat32":
            bits = v.view(np.uint32).astype(np.uint64)
            lsb = (bits >> 13) & 1
            rounded = ((bits + 0x0FFF + lsb) & ~np.uint64(0x1FFF)).astype(np.uint32)
            finite = np.isfinite(v)
            v = np.where(finite, rounded.view(np.float32), v)
        return v.astype(np_dtype)
    if dtype.category in ("int", "uint", "bool"):
        v = np.asarray(values)
        if v.dtype.kind == "f" or v.dtype == ml_dtypes.bfloat16:
            v = np.rint(np.nan_to_num(v.astype(np.float64), nan=0.0))
            info = np.iinfo(np_dtype)
            v = np.clip(v, info.min, info.max)
        else:
            info = np.iinfo(np_dtype)
            v = np.clip(v.astype(np.int64), info.min, info.max)
        return v.astype(np_dtype)
    # x4 / e8m0 scale: raw bits, no conversion
    v = np.asarray(values)
    if v.dtype != np_dtype:
        raise NkiValidationError(f"cannot convert {v.dtype} values to {dtype}: packed/scale dtypes are raw bits")
    return v


def to_float32(view: NkiTensor, raw: np.ndarray) -> np.ndarray:
    """Decode raw storage values of `view` to float32 for fp32 engine math."""
    cat = view.dtype.category
    if cat == "x4":
        raise NkiValidationError(f"tensor '{view.name}': packed {view.dtype} data cannot be used in arithmetic")
    if cat == "scale":
        b = raw.astype(np.int32)
        out = np.ldexp(np.ones(b.shape, np.float32), b - 127)
        return np.where(b == 255, np.float32(np.nan), out).astype(np.float32)
    return raw.astype(np.float32)


def checked_copy_read(view: NkiTensor, instr: str, arg: str):
    """Read the source of a data-movement instruction (tensor_copy, dma_copy): (raw values or None, written).

    Reading never-written memory is legal on hardware (the values are garbage): copying a whole
    quantize_mx scale tile whose padding rows were never written is valid NKI. So a copy does not raise;
    `written` (per source element in row-major order, or None when all were written) goes to
    `checked_write(..., written=)`, which keeps the destination elements marked never-written. The poison
    travels with the data, and strict mode raises where a compute instruction *uses* it (checked_read).
    """
    st = view.storage
    written = None
    if st.written is not None and not view.byte_mask_view(st.written).all():
        mask = view.written_elements()
        if not mask.all():
            written = mask.reshape(-1)
    return _read(view, instr, arg), written


def checked_read(view: NkiTensor, instr: str, arg: str):
    """Read a view for an instruction: uninitialised-read check, race bookkeeping; raw values or None."""
    reject_indirect(view, f"{instr}: argument '{arg}'")
    ctx = runtime.current()
    st = view.storage
    # one flat reduction over the byte mask first (fast); the per-element mask only to report an error
    if ctx.settings.strict and st.written is not None and not view.byte_mask_view(st.written).all():
        ok = view.written_elements()
        if not ok.all():
            bad = np.argwhere(~ok)
            raise UninitializedReadError(
                f"{instr}: argument '{arg}' reads {int((~ok).sum())} element(s) of tensor '{st.name}' that were never "
                f"written (first at view index {tuple(int(i) for i in bad[0])}; view shape {view.shape}); "
                "a copy may move never-written values, a computation may not use them")
    return _read(view, instr, arg)


def carries_values(view: NkiTensor) -> bool:
    """Does every element of `view` hold a known value? Always in a numerics run; in a shape-only run
    only a carried integer input and what instructions computed from carried values (storage.valued)."""
    if runtime.current().numerics:
        return True
    st = view.storage
    if st.data is None:
        return False
    return st.valued is None or bool(view.byte_mask_view(st.valued).all())


def valueless(*raws) -> bool:
    """True when one of an instruction's data reads returned None (shape-only run, an input without
    values): the instruction then writes its outputs without values. Pass only reads of given operands."""
    return any(r is None for r in raws)


def _read(view: NkiTensor, instr: str, arg: str):
    ctx = runtime.current()
    st = view.storage
    if st.buffer_kind == "shared_hbm" and ctx.num_programs > 1:
        ctx.launch.note_access(st, view.byte_mask_view, False, ctx.program_id, f"{instr} '{arg}'")
    if not carries_values(view):
        return None
    return view._np().copy()


def checked_write(view: NkiTensor, instr: str, arg: str, values, matmul: bool = False, written=None) -> None:
    """Write values (already in the view's shape or reshapeable to it) and mark bytes written.

    `written`: from checked_copy_read; elements copied from never-written memory stay never-written.
    `values` None (shape-only run, an input without values): the view's elements hold no known value.
    """
    reject_indirect(view, f"{instr}: argument '{arg}'")
    ctx = runtime.current()
    st = view.storage
    vals = None
    if values is not None:
        vals = cast_values(values, view.dtype, view.np_dtype).reshape(view.shape)
    if st.buffer_kind == "shared_hbm" and ctx.num_programs > 1:
        ctx.launch.note_access(st, view.byte_mask_view, True, ctx.program_id, f"{instr} '{arg}'",
                               new_bytes=None if vals is None else _as_bytes(view, vals))
    st.modified = True
    if vals is not None:
        st.hold_values()
        view._np()[...] = vals
    if not ctx.numerics:
        forget_or_know_values(view, vals is not None)
    if written is None:
        if st.written is not None:
            view.byte_mask_view(st.written)[...] = True
    else:
        view.byte_mask_view(st.materialize_written())[...] = \
            np.asarray(written, np.bool_).reshape(view.shape)[..., None]
    if matmul and st.mm_written is not None:
        view.byte_mask_view(st.mm_written)[...] = True


def forget_or_know_values(view: NkiTensor, known: bool) -> None:
    """Shape-only run: mark the view's bytes as holding known values (`known`) or not (a write without
    values over a storage that holds some)."""
    st = view.storage
    if st.data is None:
        return
    if st.valued is None:
        if known:
            return
        st.valued = np.ones(st.nbytes, np.bool_)
    view.byte_mask_view(st.valued)[...] = known


def _as_bytes(view: NkiTensor, vals: np.ndarray) -> np.ndarray:
    """Values in the view's storage dtype as bytes, shaped like byte_mask_view (view.shape + (itemsize,))."""
    return np.ascontiguousarray(vals, dtype=view.np_dtype).view(np.uint8).reshape(view.shape + (view.itemsize_storage,))
