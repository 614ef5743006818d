"""Simulated `nki.language` (spec §1.2, §2, §3, §4, §5.13, §6.4)."""
from __future__ import annotations

import enum
import operator

from ... import runtime
from ...errors import NkiValidationError
from ...tensor import NkiTensor, allocate  # noqa: F401  (nl.NkiTensor is public API, spec §2.3)
from .dtypes import (  # noqa: F401  (re-exported dtype names)
    ALL_DTYPES, NkiDType, bfloat16, bool_, float4_e2m1fn_x4, float8_e4m3, float8_e4m3fn, float8_e4m3fn_x4,
    float8_e5m2, float8_e5m2_x4, float8_e8m0fnu, float16, float32, int8, int16, int32, tfloat32, uint8, uint16,
    uint32,
)
from .ops import OPS, Op  # noqa: F401  (re-exported)
from .control import dynamic_range, fori_loop, while_loop  # noqa: F401  (dynamic loops)

bool = bool_  # noqa: A001 - nki-library writes nl.bool (spec §3.1)

# operator identifiers: nl.add, nl.silu, ... (spec §5.13)
globals().update(OPS)


class MemoryRegion(str, enum.Enum):
    """Buffers (spec §2.1). String names are rejected by nl.ndarray since 0.3.0."""

    sbuf = "sbuf"
    psum = "psum"
    private_hbm = "private_hbm"
    shared_hbm = "shared_hbm"


sbuf = MemoryRegion.sbuf
psum = MemoryRegion.psum
private_hbm = MemoryRegion.private_hbm
shared_hbm = MemoryRegion.shared_hbm
hbm = MemoryRegion.private_hbm  # nl.hbm is an alias of private_hbm (spec §1.2)


def is_hbm(buf) -> bool:
    return buf in (private_hbm, shared_hbm)


def is_on_chip(buf) -> bool:
    return buf in (sbuf, psum)


def is_psum(buf) -> bool:
    return buf == psum


def is_sbuf(buf) -> bool:
    return buf == sbuf


class NKIObject:
    """Base class for user classes used inside kernels (spec §1.1)."""


def _buffer_kind(buffer, what: str) -> str:
    if not isinstance(buffer, MemoryRegion):
        raise NkiValidationError(
            f"{what}: buffer must be one of nl.sbuf, nl.psum, nl.hbm, nl.private_hbm, nl.shared_hbm; got {buffer!r} "
            "(string buffer names are rejected since NKI 0.3.0)")
    return buffer.value


def ndarray(shape, dtype, buffer=sbuf, name="", address=None):
    """Allocate an uninitialised tensor (NaN / 4 sentinels). `address` is accepted and ignored
    (the official simulator also allocates each tensor independently, spec §2.2)."""
    return allocate(shape, dtype, _buffer_kind(buffer, "nl.ndarray"), name or "")


def _filled(shape, dtype, buffer, name, value, what):
    from ... import nki as _nki_pkg  # noqa: F401
    from ..isa import memset

    kind = _buffer_kind(buffer, what)
    if kind not in ("sbuf", "psum"):
        raise NkiValidationError(f"{what}: only on-chip buffers can be filled (memset), got {kind}")
    t = allocate(shape, dtype, kind, name or "")
    dt = t.dtype
    memset(dst=t, value=(int(value) if dt.is_int else float(value)))
    return t


def zeros(shape, dtype, buffer=sbuf, name=""):
    return _filled(shape, dtype, buffer, name, 0, "nl.zeros")


def ones(shape, dtype, buffer=sbuf, name=""):
    return _filled(shape, dtype, buffer, name, 1, "nl.ones")


def full(shape, fill_value, dtype, buffer=sbuf, name=""):
    return _filled(shape, dtype, buffer, name, fill_value, "nl.full")


def empty_like(x, dtype=None, buffer=None, name=""):
    return ndarray(x.shape, dtype or x.dtype, buffer or x.buffer, name)


def zeros_like(x, dtype=None, buffer=None, name=""):
    return zeros(x.shape, dtype or x.dtype, buffer or x.buffer, name)


# ---- SPMD (spec §1.2) ----
def program_id(axis=0):
    ctx = runtime.current()
    if axis not in (0,):
        raise NkiValidationError(f"nl.program_id: axis must be 0 for a 1-D launch grid, got {axis!r}")
    return ctx.program_id


def num_programs(axes=0):
    ctx = runtime.current()
    if axes not in (0, None):
        raise NkiValidationError(f"nl.num_programs: axes must be 0 for a 1-D launch grid, got {axes!r}")
    return ctx.num_programs


def program_ndim():
    return runtime.current().grid_ndim


# ---- loops (spec §4: all aliases of Python range, fully unrolled) ----
def affine_range(start, stop=None, step=1):
    return range(start, stop, step) if stop is not None else range(start)


sequential_range = affine_range
static_range = affine_range


def ds(start, size):
    """Dynamic slice == slice(start, start + size) for a static start (spec §2.4)."""
    start = operator.index(start)
    size = operator.index(size)
    if size < 1:
        raise NkiValidationError(f"nl.ds: size must be >= 1, got {size}")
    return slice(start, start + size)


def device_print(prefix, tensor):
    from ...tensor import checked_read

    print(prefix, checked_read(tensor, "nl.device_print", "tensor"))


class _TileSize:
    """`nl.tile_size` (spec §6.4). SBUF sizes are per target (INFERRED from §6.2)."""

    pmax = 128
    gemm_stationary_fmax = 128
    gemm_moving_fmax = 512
    bn_stats_fmax = 512
    psum_fmax = 512
    psum_bank_fmax = 512
    psum_bank_fmax_bytes = 2048
    psum_num_banks = 8

    @staticmethod
    def _target():
        ctx = runtime.current(optional=True)
        if ctx is not None:
            return ctx.target
        from ...settings import current_settings

        return current_settings().target

    @property
    def sbuf_fmax_bytes(self):
        return self._target().sbuf_bytes_per_partition

    total_available_sbuf_size = sbuf_fmax_bytes

    @property
    def sbuf_fmax(self):
        return self._target().sbuf_bytes_per_partition // 4

    @property
    def sbuf_size_bytes(self):
        t = self._target()
        return t.sbuf_bytes_per_partition * t.num_partitions


tile_size = _TileSize()

__all__ = [n for n in dir() if not n.startswith("_")]
