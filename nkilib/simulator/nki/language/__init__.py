"""Simulated `nki.language`
(2.32 API: https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/nki.language.html).

Only the documented names are public: helpers this module needs are imported under `_` names, and
documented functions that are not simulated resolve (module `__getattr__`) to a stub that raises
"not simulated" when called, never an AttributeError (README, "Simulator limits").
"""
import enum as _enum
import operator as _operator

from ... import runtime as _runtime
from ...errors import NkiValidationError as _NkiValidationError
from ...errors import not_simulated_stub as _not_simulated_stub
from ...tensor import NkiTensor, allocate as _allocate  # noqa: F401  (nl.NkiTensor is public API)
from .dtypes import (  # noqa: F401  (re-exported dtype names)
    bfloat16, bool_, float4_e2m1fn_x4, float8_e4m3, float8_e4m3fn, float8_e4m3fn_x4, float8_e5m2, float8_e5m2_x4,
    float8_e8m0fnu, float16, float32, int8, int16, int32, tfloat32, uint8, uint16, uint32,
)
from .ops import OPS as _OPS
from .control import dynamic_range, fori_loop, while_loop  # noqa: F401  (dynamic loops)

bool = bool_  # noqa: A001 - nki-library writes nl.bool

# operator identifiers: nl.add, nl.silu, ...
# (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/nki.api.shared.html)
globals().update(_OPS)


class MemoryRegion(str, _enum.Enum):
    """Buffers (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/nki.language.html).
    String names are rejected by nl.ndarray since 0.3.0 (migration guide)."""

    sbuf = "sbuf"
    psum = "psum"
    private_hbm = "private_hbm"
    shared_hbm = "shared_hbm"


sbuf = MemoryRegion.sbuf
psum = MemoryRegion.psum
private_hbm = MemoryRegion.private_hbm
shared_hbm = MemoryRegion.shared_hbm
hbm = MemoryRegion.private_hbm  # nl.hbm is an alias of private_hbm (nki.language.hbm page)


def is_hbm(buffer) -> bool:
    return buffer in (private_hbm, shared_hbm)


def is_on_chip(buffer) -> bool:
    return buffer in (sbuf, psum)


def is_psum(buffer) -> bool:
    return buffer == psum


def is_sbuf(buffer) -> bool:
    return buffer == sbuf


class NKIObject:
    """Base class for user classes used inside kernels (NKI language guide)."""


def _buffer_kind(buffer, what: str) -> str:
    if not isinstance(buffer, MemoryRegion):
        raise _NkiValidationError(
            f"{what}: buffer must be one of nl.sbuf, nl.psum, nl.hbm, nl.private_hbm, nl.shared_hbm; got {buffer!r} "
            "(string buffer names are rejected since NKI 0.3.0)")
    return buffer.value


_MIGRATION_URL = "https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/migration/index.html"


def _check_address(address, kind: str, shape) -> None:
    """`address=(partition_offset, free_byte_offset)` (NKI 0.3.0+). PSUM placements must start at a 2 KiB
    bank boundary (migration guide, "Address Placement": a PSUM tensor at `(0, bank * 2048)`; any other free
    offset is a compiler error)."""
    if address is None:
        return
    try:
        p_off, f_off = (_operator.index(a) for a in address)
    except (TypeError, ValueError):
        raise _NkiValidationError(
            f"nl.ndarray: address must be a (partition_offset, free_offset) pair of ints, got {address!r}") from None
    if p_off < 0 or f_off < 0:
        raise _NkiValidationError(f"nl.ndarray: address offsets must be >= 0, got {address!r}")
    bank = _runtime.current().target.psum_bank_bytes
    if kind == "psum" and f_off % bank:
        raise _NkiValidationError(
            f"nl.ndarray: argument 'address' places PSUM tensor {tuple(shape)} at free byte offset {f_off}; expected "
            f"a multiple of the {bank}-byte PSUM bank (a PSUM tensor starts at a bank boundary, "
            f"{_MIGRATION_URL})")


def ndarray(shape, dtype, buffer=sbuf, name="", address=None):
    """Allocate an uninitialised tensor (NaN / 4 sentinels). A valid `address` is otherwise ignored (the
    official simulator also allocates each tensor independently)."""
    kind = _buffer_kind(buffer, "nl.ndarray")
    _check_address(address, kind, shape)
    return _allocate(shape, dtype, kind, name or "")


def _filled(shape, dtype, buffer, name, value, what):
    from ... import nki as _nki_pkg  # noqa: F401
    from ..isa import memset

    kind = _buffer_kind(buffer, what)
    if kind not in ("sbuf", "psum"):
        raise _NkiValidationError(f"{what}: only on-chip buffers can be filled (memset), got {kind}")
    t = _allocate(shape, dtype, kind, name or "")
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


# ---- SPMD (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/get-started/about/lnc.html) ----
def program_id(axis=0):
    ctx = _runtime.current()
    if axis not in (0,):
        raise _NkiValidationError(f"nl.program_id: axis must be 0 for a 1-D launch grid, got {axis!r}")
    return ctx.program_id


def num_programs(axes=0):
    ctx = _runtime.current()
    if axes not in (0, None):
        raise _NkiValidationError(f"nl.num_programs: axes must be 0 for a 1-D launch grid, got {axes!r}")
    return ctx.num_programs


def program_ndim():
    return _runtime.current().grid_ndim


# ---- loops (static loops: all aliases of Python range, fully unrolled) ----
def affine_range(start, stop=None, step=1):
    return range(start, stop, step) if stop is not None else range(start)


sequential_range = affine_range
static_range = affine_range


def ds(start, size):
    """Dynamic slice == slice(start, start + size) for a static start (nki.language.ds page)."""
    start = _operator.index(start)
    size = _operator.index(size)
    if size < 1:
        raise _NkiValidationError(f"nl.ds: size must be >= 1, got {size}")
    return slice(start, start + size)


def device_print(print_prefix, tensor):
    """Print `print_prefix` and the tile's values to stdout, as the official CPU simulator does
    (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.language.device_print.html)."""
    from ...access import checked_read

    print(print_prefix, checked_read(tensor, "nl.device_print", "tensor"))


class _TileSize:
    """`nl.tile_size` (nki.language.tile_size page). SBUF sizes are per target (inferred from the
    Trainium2/3 architecture guides; hardware.py)."""

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
        ctx = _runtime.current(optional=True)
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

# the submodules holding the dtype table and operator objects are not part of the documented namespace
del dtypes, ops  # noqa: F821 - bound by the relative imports above

# Documented in the 2.32 nki.language API but not simulated here: accessing them works (kernels may
# reference them at import), calling them raises (README, "Simulator limits").
_NOT_SIMULATED = frozenset({
    "load", "store", "load_transpose2d", "matmul", "transpose", "divide", "cos", "tan", "ceil", "floor",
    "trunc", "negative", "fmod", "mod", "sum", "max", "min", "mean", "prod", "var", "all", "softmax",
    "rms_norm", "where", "dropout", "broadcast_to", "expand_dims", "gather_flattened", "rand", "random_seed",
    "shared_constant", "shared_identity_matrix", "prelu",
})


def __getattr__(name):
    if name in _NOT_SIMULATED:
        return _not_simulated_stub(f"nl.{name}", "nki.language", "; express it with nki.isa instructions")
    raise AttributeError(f"module 'nki.language' has no attribute {name!r}")


del control  # the implementation submodule bound by the import above; not a documented name

__all__ = [n for n in dir() if not n.startswith("_")]
