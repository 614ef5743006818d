"""NkiTensor: a strided view over a flat byte storage (`storage.py`), and `allocate`.

References:
    https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.language.NkiTensor.html
    https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/deep-dives/nki-aps.html (access patterns)

A view is (storage, dtype, offset, shape, strides) with offset/strides in elements of the view's
dtype, so reinterpretation (`.view`, `.ap(dtype=)`) is a byte-level re-view of the same storage.
On-chip (SBUF/PSUM) storages have a partition dim 0 whose stride is the per-partition row length.
Instructions read and write views through `access.py` (strict reads, race bookkeeping, casts).
"""
from __future__ import annotations

import operator

import numpy as np

from . import runtime
from .errors import NkiValidationError, OutOfBoundsError
from .dtypes import NkiDType, as_nki_dtype
from .indirect import make_indirect_view, reject_indirect
from .storage import ON_CHIP, Storage, prod

_APS_URL = "https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/deep-dives/nki-aps.html"
_NKITENSOR_URL = ("https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/"
                  "nki.language.NkiTensor.html")
# SBUF/PSUM access patterns address "up to four-dimensional arrays" in the free dimension (access-pattern guide)
MAX_FREE_DIMS = 4


def merged_free_dims(pairs) -> int:
    """Free dimensions a list of (size, stride) pairs needs in a hardware access pattern: size-1 dims
    vanish and a dim that continues its inner neighbour (stride == inner stride * inner size) merges
    into it, as the compiler lowers views (so [P, 2, 3, 4, 5, 6] contiguous is one free dim)."""
    merged = []
    for n, s in reversed([(n, s) for n, s in pairs if n > 1]):
        if merged and s == merged[-1][0] * merged[-1][1]:
            merged[-1] = (merged[-1][0] * n, merged[-1][1])
        else:
            merged.append((n, s))
    return len(merged)


def not_simulated(what: str) -> NkiValidationError:
    """The error for a documented NKI feature this simulator does not implement (README, 'Simulator limits')."""
    return NkiValidationError(f"{what} is part of the documented NKI API but is not simulated by nkilib's simulator "
                              "(README, 'Simulator limits')")


def _check_widened(storage: Storage, new_dtype: NkiDType, what: str) -> None:
    # Only a widened *storage* (bf16/fp8 kept as fp32 under NKI_PRECISE_FP=0) breaks reinterpretation;
    # the reinterpreted view itself always reads the raw bytes as new_dtype.precise_np (bit-exact).
    if storage.np_dtype != storage.dtype.precise_np:
        raise NkiValidationError(
            f"{what}: reinterpreting {storage.dtype} storage '{storage.name}' as {new_dtype} needs "
            "bit-exact storage; it is not supported with NKI_PRECISE_FP=0"
        )



def _resolve_sizes(shape, total: int, where: str, mismatch: str) -> list:
    """`shape` (an int or a sequence, at most one -1 inferred) as a list of sizes whose product is `total`."""
    sizes = list(shape if isinstance(shape, (tuple, list)) else (shape,))
    if sizes.count(-1) > 1:
        raise NkiValidationError(f"{where}: at most one -1 allowed, got {tuple(sizes)}")
    if -1 in sizes:
        known = prod(s for s in sizes if s != -1)
        sizes[sizes.index(-1)] = total // known if known and total % known == 0 else -1
    if any(s < 1 for s in sizes) or prod(sizes) != total:
        raise NkiValidationError(f"{where}: {mismatch}")
    return sizes


class NkiTensor:
    """A view of a Storage. Mirrors `nki.language.NkiTensor`."""

    __slots__ = ("_storage", "dtype", "shape", "strides", "offset", "_vector_index")

    def __init__(self, storage: Storage, dtype: NkiDType, shape, strides, offset: int, vector_index=None):
        self._storage = storage
        self.dtype = dtype
        self.shape = tuple(int(s) for s in shape)
        self.strides = tuple(int(s) for s in strides)
        self.offset = int(offset)
        # indirect (vector_offset) views: rows resolved at run time by the consuming DMA (indirect.py);
        # their static bounds were checked for one row when the view was made
        self._vector_index = vector_index
        if vector_index is None:
            self._check_bounds()

    # ---- basic attributes ----
    @property
    def buffer(self):
        from .nki.language import MemoryRegion

        return MemoryRegion(self._storage.buffer_kind)

    @property
    def name(self) -> str:
        return self._storage.name

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return prod(self.shape)

    @property
    def storage(self) -> Storage:
        return self._storage

    @property
    def on_chip(self) -> bool:
        return self._storage.on_chip

    @property
    def np_dtype(self) -> np.dtype:
        if self.dtype == self._storage.dtype:
            return self._storage.np_dtype
        return self.dtype.precise_np

    @property
    def itemsize_storage(self) -> int:
        return self.np_dtype.itemsize

    def __repr__(self) -> str:
        return (f"NkiTensor(name={self.name!r}, shape={self.shape}, dtype={self.dtype}, "
                f"buffer={self._storage.buffer_kind}, offset={self.offset}, strides={self.strides})")

    def __len__(self) -> int:
        return self.shape[0]

    def is_indirect(self) -> bool:
        """True for a view made with `.ap(vector_offset=...)` (NkiTensor.is_indirect, 2.32 language API)."""
        return self._vector_index is not None

    def __bool__(self):
        raise NkiValidationError(f"the truth value of tensor '{self.name}' is a runtime value; "
                                 "use a compile-time condition")

    # ---- geometry ----
    def _elem_count_storage(self) -> int:
        return self._storage.nbytes // self.itemsize_storage

    def _check_bounds(self) -> None:
        lo = hi = self.offset
        for n, s in zip(self.shape, self.strides):
            if n <= 0:
                raise OutOfBoundsError(f"tensor '{self.name}': dimension sizes must be >= 1, got shape {self.shape}")
            if s >= 0:
                hi += (n - 1) * s
            else:
                lo += (n - 1) * s
        limit = self._elem_count_storage()
        if lo < 0 or hi >= limit:
            raise OutOfBoundsError(
                f"tensor '{self.name}': access [{lo}, {hi}] (elements of {self.dtype}) is outside its storage "
                f"of {limit} elements (shape {self._storage.shape}); view shape {self.shape}, strides {self.strides}, "
                f"offset {self.offset}"
            )

    @property
    def row_elems(self) -> int:
        """Storage elements (of this view's dtype) per partition."""
        return self._storage.row_bytes // self.itemsize_storage

    @property
    def partition_start(self) -> int:
        return self.offset // self.row_elems

    def partition_info(self):
        """(start, count) of the partitions an on-chip view touches; validates contiguous partitions."""
        row = self.row_elems
        start = self.offset // row
        count = self.shape[0]
        if count > 1 and self.strides[0] != row:
            raise NkiValidationError(
                f"tensor '{self.name}': on-chip views must cover contiguous partitions (partition stride "
                f"{self.strides[0]} != row length {row}); strided partition access is illegal ({_APS_URL})"
            )
        return start, count

    @property
    def free_size(self) -> int:
        return prod(self.shape[1:])

    def is_contiguous(self) -> bool:
        dims = list(zip(self.shape, self.strides))
        if self.on_chip:
            dims = dims[1:]
        expect = 1
        for n, s in reversed(dims):
            if n != 1 and s != expect:
                return False
            expect *= n
        return True

    def get_pattern(self):
        return [[s, n] for s, n in zip(self.strides, self.shape)]

    def free_access_dims(self) -> int:
        """Free dims of this on-chip view's hardware access pattern (see merged_free_dims)."""
        return merged_free_dims(list(zip(self.shape[1:], self.strides[1:])))

    def reshape_dim(self, dim, shape):
        """Split dim `dim` into `shape` (one -1 allowed); a view, no copy. On-chip tensors keep their
        partition dim (only a trivial split of dim 0 into itself)."""
        dim = operator.index(dim)
        if not -self.ndim <= dim < self.ndim:
            raise NkiValidationError(
                f"tensor '{self.name}'.reshape_dim: dim {dim} is out of range for shape {self.shape}")
        dim %= self.ndim
        n = self.shape[dim]
        wanted = tuple(shape) if isinstance(shape, (tuple, list)) else (shape,)
        sizes = _resolve_sizes(shape, n, f"tensor '{self.name}'.reshape_dim",
                               f"cannot split dim {dim} of size {n} into {wanted}")
        if self.on_chip and dim == 0 and len(sizes) != 1:
            raise NkiValidationError(
                f"tensor '{self.name}'.reshape_dim: the partition dim of an on-chip tensor cannot be split, "
                f"got {tuple(sizes)}")
        inner = row_major(sizes)
        shape_ = list(self.shape[:dim]) + sizes + list(self.shape[dim + 1:])
        strides = list(self.strides[:dim]) + [st * self.strides[dim] for st in inner] + list(self.strides[dim + 1:])
        return NkiTensor(self._storage, self.dtype, shape_, strides, self.offset)

    def flatten_dims(self, *args, **kwargs):
        # whether the end bound is inclusive is not stated in the 2.32 API; refuse rather than guess
        raise not_simulated(f"tensor '{self.name}'.flatten_dims ({_NKITENSOR_URL})")

    def rearrange(self, *args, **kwargs):
        raise not_simulated(f"tensor '{self.name}'.rearrange ({_NKITENSOR_URL}); use reshape/permute")

    def vector_select(self, *args, **kwargs):
        raise not_simulated(f"tensor '{self.name}'.vector_select (indirect addressing, {_NKITENSOR_URL})")

    def indirect(self, *args, **kwargs):
        raise not_simulated(f"tensor '{self.name}'.indirect (tensor indirection, {_NKITENSOR_URL})")

    # ---- raw numpy access (used by the isa layer only) ----
    def _np(self) -> np.ndarray:
        isz = self.itemsize_storage
        return np.ndarray(self.shape, self.np_dtype, buffer=self._storage.data, offset=self.offset * isz,
                          strides=tuple(s * isz for s in self.strides))

    def byte_mask_view(self, mask: np.ndarray) -> np.ndarray:
        """View of a per-storage-byte mask restricted to this view's bytes: shape = self.shape + (itemsize,)."""
        isz = self.itemsize_storage
        return np.ndarray(self.shape + (isz,), np.bool_, buffer=mask, offset=self.offset * isz,
                          strides=tuple(s * isz for s in self.strides) + (1,))

    def elements_all(self, mask: np.ndarray) -> np.ndarray:
        """Per element of this view: are all of its storage bytes set in `mask` (one bool per byte)?

        Reads each element's bytes as one unsigned word (bools are 0/1 bytes, so "all set" is the
        word 0x01..01): much faster than reducing a [..., itemsize] bool view.
        """
        isz = self.itemsize_storage
        word = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[isz]
        words = np.ndarray(self.shape, word, buffer=mask, offset=self.offset * isz,
                           strides=tuple(s * isz for s in self.strides))
        return words == word(int.from_bytes(b"\x01" * isz, "little"))

    def written_elements(self) -> np.ndarray:
        if self._storage.written is None:  # every byte written (storage.py)
            return np.ones(self.shape, np.bool_)
        return self.elements_all(self._storage.written)

    # ---- indexing (NkiTensor page: numpy-style keys) ----
    def __getitem__(self, key):
        reject_indirect(self, f"tensor '{self.name}'.__getitem__")
        if not isinstance(key, tuple):
            key = (key,)
        if any(k is Ellipsis for k in key):
            i = next(i for i, k in enumerate(key) if k is Ellipsis)
            fill = self.ndim - (len(key) - 1)
            key = key[:i] + (slice(None),) * fill + key[i + 1:]
        if len(key) > self.ndim:
            raise OutOfBoundsError(f"tensor '{self.name}': too many indices ({len(key)}) for shape {self.shape}")
        key = key + (slice(None),) * (self.ndim - len(key))
        offset = self.offset
        shape, strides, kept_int = [], [], []
        for dim, (k, n, s) in enumerate(zip(key, self.shape, self.strides)):
            if isinstance(k, slice):
                start, stop, step = k.start, k.stop, k.step
                step = 1 if step is None else operator.index(step)
                if step < 1:
                    raise OutOfBoundsError(f"tensor '{self.name}': slice step must be >= 1, got {step} on dim {dim}")
                start = 0 if start is None else operator.index(start)
                stop = n if stop is None else operator.index(stop)
                if start < 0:
                    start += n
                if stop < 0:
                    stop += n
                # strict: no silent clipping like numpy (an out-of-range tile is a kernel bug)
                if not (0 <= start < stop <= n):
                    raise OutOfBoundsError(
                        f"tensor '{self.name}': slice {k.start}:{k.stop} on dim {dim} is out of range for size {n} "
                        f"(shape {self.shape})")
                offset += start * s
                shape.append(len(range(start, stop, step)))
                strides.append(s * step)
            else:
                try:
                    idx = operator.index(k)
                except TypeError:
                    raise TypeError(f"tensor '{self.name}': unsupported index {k!r} on dim {dim}") from None
                if idx < 0:
                    idx += n
                if not 0 <= idx < n:
                    raise OutOfBoundsError(
                        f"tensor '{self.name}': index {k} out of range for dim {dim} of size {n} (shape {self.shape})")
                offset += idx * s
                kept_int.append(dim)
                if self.on_chip and dim == 0:
                    shape.append(1)  # on-chip: int on dim 0 keeps a size-1 partition dim
                    strides.append(s)
        if self.on_chip and len(shape) < 2:
            # int on a free dim drops it unless the result would become < 2-D: keep the last free dim as 1
            last = max(d for d in kept_int if d > 0)
            shape.append(1)
            strides.append(self.strides[last])
        if not shape:
            shape, strides = [1], [1]
        return NkiTensor(self._storage, self.dtype, shape, strides, offset)

    def __setitem__(self, key, value):
        raise NkiValidationError(
            f"tensor '{self.name}': item assignment is not an NKI operation; write through an nisa instruction's dst=")

    def slice(self, dim, start, end, step=1):
        key = [slice(None)] * self.ndim
        key[dim] = slice(start, end, step)
        return self[tuple(key)]

    def select(self, dim, index):
        if not isinstance(index, int):
            raise NkiValidationError(f"tensor '{self.name}'.select: only static int indices are simulated, "
                                     f"got {index!r}")
        if self.on_chip and dim == 0:
            raise NkiValidationError(f"tensor '{self.name}'.select: cannot remove the partition dim of an "
                                     "on-chip tensor")
        key = [slice(None)] * self.ndim
        key[dim] = index
        return self[tuple(key)]

    # ---- reshaping views ----
    def reshape(self, shape):
        reject_indirect(self, f"tensor '{self.name}'.reshape")
        total = self.size
        shape = _resolve_sizes(shape, total, f"tensor '{self.name}'.reshape",
                               f"cannot reshape {self.shape} ({total} elements) to "
                               f"{tuple(shape) if isinstance(shape, (tuple, list)) else (shape,)}")
        if not self.is_contiguous():
            raise NkiValidationError(
                f"tensor '{self.name}'.reshape: view with shape {self.shape} and strides {self.strides} is not "
                "contiguous; reshape cannot be expressed without a copy")
        if self.on_chip:
            if shape[0] != self.shape[0]:
                raise NkiValidationError(
                    f"tensor '{self.name}'.reshape: on-chip reshape must keep the partition dim {self.shape[0]}, "
                    f"got {tuple(shape)}")
            free = row_major(shape[1:])
            return NkiTensor(self._storage, self.dtype, shape, [self.strides[0]] + free, self.offset)
        return NkiTensor(self._storage, self.dtype, shape, row_major(shape), self.offset)

    def permute(self, dims):
        reject_indirect(self, f"tensor '{self.name}'.permute")
        dims = tuple(dims)
        if sorted(dims) != list(range(self.ndim)):
            raise NkiValidationError(f"tensor '{self.name}'.permute: {dims} is not a permutation of {self.ndim} dims")
        if self.on_chip and dims[0] != 0:
            raise NkiValidationError(f"tensor '{self.name}'.permute: on-chip tensors must keep dim 0 first, got {dims}")
        return NkiTensor(self._storage, self.dtype, [self.shape[d] for d in dims], [self.strides[d] for d in dims],
                         self.offset)

    def broadcast(self, dim, size):
        reject_indirect(self, f"tensor '{self.name}'.broadcast")
        if self.shape[dim] != 1 or (self.on_chip and dim == 0):
            raise NkiValidationError(
                f"tensor '{self.name}'.broadcast: dim {dim} must be a size-1 free dim (shape {self.shape})")
        shape, strides = list(self.shape), list(self.strides)
        shape[dim], strides[dim] = size, 0
        return NkiTensor(self._storage, self.dtype, shape, strides, self.offset)

    def expand_dim(self, dim):
        reject_indirect(self, f"tensor '{self.name}'.expand_dim")
        if self.on_chip and dim == 0:
            raise NkiValidationError(f"tensor '{self.name}'.expand_dim: cannot insert before the partition dim")
        shape, strides = list(self.shape), list(self.strides)
        shape.insert(dim, 1)
        strides.insert(dim, 1)
        return NkiTensor(self._storage, self.dtype, shape, strides, self.offset)

    def squeeze_dim(self, dim):
        reject_indirect(self, f"tensor '{self.name}'.squeeze_dim")
        if self.shape[dim] != 1 or (self.on_chip and dim == 0):
            raise NkiValidationError(f"tensor '{self.name}'.squeeze_dim: dim {dim} must be a size-1 free dim")
        shape, strides = list(self.shape), list(self.strides)
        del shape[dim], strides[dim]
        return NkiTensor(self._storage, self.dtype, shape, strides, self.offset)

    def view(self, dtype):
        """Bit reinterpretation; the last dim scales by the size ratio (NkiTensor page, view)."""
        reject_indirect(self, f"tensor '{self.name}'.view")
        new = as_nki_dtype(dtype, "view(dtype)")
        if new == self.dtype:
            return self
        _check_widened(self._storage, new, f"tensor '{self.name}'.view")
        old_sz, new_sz = self.dtype.itemsize, new.itemsize
        shape, strides, offset = list(self.shape), list(self.strides), self.offset
        if self.strides[-1] != 1 and self.shape[-1] != 1:
            raise NkiValidationError(
                f"tensor '{self.name}'.view({new}): the last dim must be contiguous, got stride {self.strides[-1]}")
        if new_sz > old_sz:
            r = new_sz // old_sz
            if shape[-1] % r or offset % r or any(s % r for s in strides[:-1]):
                raise NkiValidationError(
                    f"tensor '{self.name}'.view({new}): shape {self.shape}, strides {self.strides}, offset {offset} "
                    f"are not divisible by the size ratio {r}")
            shape[-1] //= r
            strides = [s // r for s in strides[:-1]] + [1]
            offset //= r
        else:
            r = old_sz // new_sz
            shape[-1] *= r
            strides = [s * r for s in strides[:-1]] + [1]
            offset *= r
        return NkiTensor(self._storage, new, shape, strides, offset)

    reinterpret_cast = view

    def ap(self, pattern, offset=None, scalar_offset=None, vector_offset=None, indirect_dim=0, dtype=None):
        """Raw access pattern over the underlying storage.

        `pattern` ([step, num] pairs, outermost first) addresses the storage, ignoring this view's
        shape and strides. `offset` (elements of the pattern's dtype) is RELATIVE to this view's storage
        offset: the 2.32 `NkiTensor.ap` docstring (offset "added to the view's base storage offset",
        offset=0 keeps the base; the 2.30 docstring still said "from start of storage"), newest meaning,
        chosen over the access-pattern guide's absolute reading (docs/simulator.md#choice-ap-offset; both URLs:
        https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.language.NkiTensor.html,
        https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/deep-dives/nki-aps.html). On a base
        allocation (offset 0: every nki-library use) both readings agree; on a sliced view an
        out-of-range result names both readings.
        `vector_offset=` (an SBUF index tile, HBM tensors, indirect_dim=0) makes an indirect view whose
        rows a DMA instruction resolves at run time: see `nkilib/simulator/indirect.py`. `scalar_offset=`
        (a VirtualRegister) moves the start by its current value along `indirect_dim` (registers.py).
        """
        if vector_offset is not None:
            return make_indirect_view(self, pattern, offset, scalar_offset, vector_offset, indirect_dim, dtype)
        reject_indirect(self, f"tensor '{self.name}'.ap")
        new = self.dtype if dtype is None else as_nki_dtype(dtype, "ap(dtype=)")
        if new != self.dtype:
            _check_widened(self._storage, new, f"tensor '{self.name}'.ap")
        pairs = [tuple(p) for p in pattern]
        if not pairs or any(len(p) != 2 for p in pairs):
            raise NkiValidationError(f"tensor '{self.name}'.ap: pattern must be a list of [step, num] pairs, "
                                     f"got {pattern!r}")
        steps = [int(p[0]) for p in pairs]
        nums = [int(p[1]) for p in pairs]
        new_isz = new.storage_np(True).itemsize if new != self._storage.dtype else self._storage.np_dtype.itemsize
        byte_off = self.offset * self.itemsize_storage
        if byte_off % new_isz:
            raise NkiValidationError(
                f"tensor '{self.name}'.ap: the view's storage offset of {byte_off} bytes is not a multiple of "
                f"{new} size")
        base = byte_off // new_isz
        start = base + (0 if offset is None else operator.index(offset))
        hint = ""
        if offset is not None and base:
            hint = (f"; note: offset={offset} is relative to this view's storage offset {base} (2.32 NkiTensor.ap "
                    f"docstring), not absolute as in the access-pattern guide: call .ap on the base tensor for an "
                    f"absolute offset ({_NKITENSOR_URL}, {_APS_URL})")
        dynamic = None
        if scalar_offset is not None:
            from .nki.isa.registers import scalar_offset_elements

            dynamic = scalar_offset_elements(self, scalar_offset, indirect_dim, new, new_isz)
            start += dynamic[1]
        if self.on_chip:
            # row checks before the storage bounds check, so a pattern leaving its row gets this message
            row = self._storage.row_bytes // new_isz
            if nums[0] > 1 and steps[0] != row:
                raise NkiValidationError(
                    f"tensor '{self.name}'.ap: the partition step must equal the per-partition element count {row} "
                    f"of the storage (in {new} elements), got {steps[0]}; strided partition access is illegal "
                    f"({_APS_URL})")
            if len(nums) < 2:
                raise NkiValidationError(f"tensor '{self.name}'.ap: on-chip patterns need a partition pair and "
                                         ">= 1 free pair")
            free = merged_free_dims(list(zip(nums[1:], steps[1:])))
            if free > MAX_FREE_DIMS:
                raise NkiValidationError(
                    f"tensor '{self.name}'.ap: pattern {pairs} needs {free} free dimensions after merging contiguous "
                    f"ones; expected at most {MAX_FREE_DIMS} (SBUF/PSUM access patterns, {_APS_URL})")
            free_lo = start % row + sum(min(0, (n - 1) * s) for s, n in zip(steps[1:], nums[1:]))
            free_hi = start % row + sum(max(0, (n - 1) * s) for s, n in zip(steps[1:], nums[1:]))
            if free_lo < 0 or free_hi >= row:
                dyn = "" if dynamic is None else f", including scalar_offset register value {dynamic[0]}"
                raise OutOfBoundsError(
                    f"tensor '{self.name}'.ap: free access [{free_lo}, {free_hi}] leaves the partition row of {row} "
                    f"elements (pattern {pairs}, storage offset {start}{dyn}){hint}")
        try:
            return NkiTensor(self._storage, new, nums, steps, start)
        except OutOfBoundsError as e:
            if dynamic is not None:
                raise OutOfBoundsError(f"tensor '{self.name}'.ap: scalar_offset register value {dynamic[0]} "
                                       f"(indirect_dim {indirect_dim}) addresses outside the tensor: {e}") from None
            raise OutOfBoundsError(f"{e}{hint}") from None


def row_major(shape):
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return list(reversed(strides))


# Allocation (nki.language.ndarray)

def allocate(shape, dtype, buffer_kind: str, name: str = "", init: np.ndarray | None = None) -> NkiTensor:
    """Allocate a tensor in the running program (nki.language.ndarray)."""
    ctx = runtime.current()
    dtype = as_nki_dtype(dtype, "nl.ndarray dtype")
    try:
        shape = tuple(operator.index(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
    except TypeError:
        raise TypeError(f"nl.ndarray: shape must be a tuple of ints, got {shape!r}") from None
    if not shape or any(s < 1 for s in shape):
        raise NkiValidationError(f"nl.ndarray: shape must be non-empty with sizes >= 1, got {shape}")
    if buffer_kind in ON_CHIP:
        if len(shape) < 2:
            raise NkiValidationError(f"nl.ndarray: {buffer_kind} tensors need >= 2 dims (partition first), got {shape}")
        if shape[0] > ctx.target.num_partitions:
            raise NkiValidationError(
                f"nl.ndarray: {buffer_kind} partition dimension {shape[0]} exceeds the hardware limit of "
                f"{ctx.target.num_partitions} partitions (tensor '{name}', shape {shape})")

    def make():
        return Storage(shape, dtype, buffer_kind, name, ctx.settings.precise_fp, ctx.numerics, ctx.program_id, init)

    if buffer_kind == "shared_hbm" and ctx.num_programs > 1 and init is None:
        if name:
            key = ("name", name)
        else:
            key = ("unnamed", ctx.unnamed_shared)
            ctx.unnamed_shared += 1
        storage = ctx.launch.link_shared(key, make, shape, dtype, ctx.program_id)
    else:
        storage = make()
    if buffer_kind in ON_CHIP:
        per_part = storage.nki_bytes_per_partition
        if buffer_kind == "psum":
            bank = ctx.target.psum_bank_bytes
            per_part = -(-per_part // bank) * bank
        ctx.memory.allocate(storage, per_part, f"'{storage.name}' {shape} {dtype}")
    elif buffer_kind == "private_hbm":
        ctx.private_hbm.append(storage)
    return NkiTensor(storage, dtype, shape, row_major(shape), 0)
