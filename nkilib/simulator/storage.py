"""Storage: the flat byte array behind every NKI allocation, with its bookkeeping masks.

Storage of every allocation is one flat row-major byte array (`Storage.data`), plus
- `written`: one bool per storage byte, set by every write (uninitialised-read detection, see
  `access.py`), or None when every byte is written: kernel inputs start so, which keeps shape-only runs
  of large weights from holding a byte mask per weight byte (`materialize_written` makes it an array
  again when a copy carries never-written elements into the tensor);
- `mm_written` (PSUM only): one bool per byte, set by matmul writes (nc_matmul accumulate=None rule,
  docs/simulator.md#choice-psum-accumulate);
- `race_state`: LNC2 race bookkeeping of a shared_hbm storage (`runtime.Launch.note_access`);
- `valued` (shape-only runs): one bool per byte, set where `data` holds a known value, or None when
  every byte of a non-None `data` does (a carried integer input). A shape-only allocation has no
  `data` until an instruction writes it with values computed from carried values (`hold_values`;
  docs/simulator.md#shape-only-runs-with-carried-integer-inputs).
Fresh allocations hold the official CPU simulator's fill pattern
(https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/guides/nki_simulator.html;
docs/simulator.md#choice-sentinels). On-chip (SBUF/PSUM) storages have a partition dim 0 whose stride
is the per-partition row length. Views over a storage: `tensor.py`.
"""
from __future__ import annotations

import math

import numpy as np

from . import runtime
from .dtypes import NkiDType

ON_CHIP = ("sbuf", "psum")
HBM_KINDS = ("private_hbm", "shared_hbm")


def prod(xs) -> int:
    """Product of sizes as a Python int (element counts of shapes)."""
    return int(math.prod(xs))


def _sentinel_bytes(dtype: NkiDType, np_dtype: np.dtype, count: int) -> np.ndarray:
    """Fill pattern of a fresh allocation: NaN for floats, 4 for integers (official CPU simulator guide)."""
    if dtype.category == "float":
        arr = np.full(count, np.nan, dtype=np_dtype)
    elif dtype.category == "scale":
        arr = np.full(count, 0xFF, dtype=np.uint8)  # E8M0 NaN
    else:
        arr = np.full(count, 4, dtype=np_dtype)
    return arr.view(np.uint8)


class Storage:
    """One allocation: raw bytes + written masks + bookkeeping."""

    __slots__ = (
        "id", "name", "shape", "dtype", "buffer_kind", "np_dtype", "nbytes", "data", "written",
        "mm_written", "valued", "race_state", "program_id", "host_array", "modified", "__weakref__",
    )

    def __init__(self, shape, dtype: NkiDType, buffer_kind: str, name: str, precise_fp: bool, numerics: bool,
                 program_id: int, init: np.ndarray | None = None):
        self.id = runtime.next_storage_id()
        self.name = name or f"t{self.id}"
        self.shape = tuple(int(s) for s in shape)
        self.dtype = dtype
        self.buffer_kind = buffer_kind
        self.np_dtype = dtype.storage_np(precise_fp)
        count = prod(self.shape)
        self.nbytes = count * self.np_dtype.itemsize
        self.program_id = program_id
        self.host_array = None
        self.modified = False
        self.race_state = {}
        if init is not None:
            self.data = np.ascontiguousarray(init).reshape(-1).view(np.uint8).copy() if numerics else None
            self.written = None  # every byte written
        else:
            self.data = _sentinel_bytes(dtype, self.np_dtype, count).copy() if numerics else None
            self.written = np.zeros(self.nbytes, np.bool_)
        self.mm_written = np.zeros(self.nbytes, np.bool_) if buffer_kind == "psum" else None
        self.valued = None  # every byte of `data` (if any) holds a known value

    def hold_values(self) -> None:
        """Shape-only run: give a storage without data the fill pattern of a fresh allocation and no known
        values yet, before its first write of computed values (numerics runs always hold data)."""
        if self.data is None:
            self.data = _sentinel_bytes(self.dtype, self.np_dtype, prod(self.shape)).copy()
            self.valued = np.zeros(self.nbytes, np.bool_)

    def materialize_written(self) -> np.ndarray:
        """The per-byte written mask as an array (all True if it was the all-written None)."""
        if self.written is None:
            self.written = np.ones(self.nbytes, np.bool_)
        return self.written

    @property
    def on_chip(self) -> bool:
        return self.buffer_kind in ON_CHIP

    @property
    def row_bytes(self) -> int:
        """Storage bytes per partition (on-chip)."""
        return self.nbytes // self.shape[0]

    @property
    def nki_bytes_per_partition(self) -> int:
        return prod(self.shape[1:]) * self.dtype.itemsize
