"""Operand validation shared by every instruction (one place for each rule).

Sources: the 2.32 nki.isa API pages
(https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/nki.isa.html), the access-pattern
guide (APS_URL below) and the NKI migration guides
(https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/migration/index.html).

Every error names the instruction, the argument and the offending value.
"""
from __future__ import annotations

import numbers

import numpy as np

from ... import runtime
from ...errors import NkiValidationError
from ...tensor import MAX_FREE_DIMS, NkiTensor
from .constants import engine

_MIGRATION_URL = "https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/migration/index.html"
APS_URL = "https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/deep-dives/nki-aps.html"


class NkiInstruction:
    """Handle returned by every ISA call (nki.isa API: `depends_on`); scheduling hints are no-ops here."""

    __slots__ = ("name",)

    def __init__(self, name):
        self.name = name

    def depends_on(self, *producers):
        return self


def ctx():
    return runtime.current()


def fail(instr: str, msg: str):
    raise NkiValidationError(f"nisa.{instr}: {msg}")


def tensor_arg(instr: str, arg: str, value) -> NkiTensor:
    if not isinstance(value, NkiTensor):
        fail(instr, f"argument '{arg}' must be an NKI tensor, got {type(value).__name__} {value!r}")
    return value


def on_chip(instr: str, arg: str, t, buffers=("sbuf", "psum")) -> NkiTensor:
    """Validate an SBUF/PSUM tile operand: buffer, partition limit, contiguous partitions."""
    t = tensor_arg(instr, arg, t)
    kind = t.storage.buffer_kind
    if kind not in buffers:
        fail(instr, f"argument '{arg}' ('{t.name}') must be in {' or '.join(b.upper() for b in buffers)}, got {kind}")
    if t.ndim < 2:
        fail(instr, f"argument '{arg}' ('{t.name}') must have a partition dim and >= 1 free dim, got shape {t.shape}")
    limit = ctx().target.num_partitions
    if t.shape[0] > limit:
        fail(instr, f"argument '{arg}' partition dimension {t.shape[0]} exceeds maximum {limit}")
    try:
        t.partition_info()
    except NkiValidationError as e:
        fail(instr, f"argument '{arg}': {e}")
    free_dims = t.free_access_dims()
    if free_dims > MAX_FREE_DIMS:
        fail(instr, f"argument '{arg}' ('{t.name}', shape {t.shape}, strides {t.strides}) needs {free_dims} free "
                    f"dimensions in its access pattern after merging contiguous ones; expected at most {MAX_FREE_DIMS} "
                    f"(SBUF/PSUM access patterns, {APS_URL})")
    return t


def hbm_or_sbuf(instr: str, arg: str, t) -> NkiTensor:
    t = tensor_arg(instr, arg, t)
    kind = t.storage.buffer_kind
    if kind == "psum":
        fail(instr, f"argument '{arg}' ('{t.name}') is in PSUM; DMA cannot access PSUM (NKI 0.3.0+, "
                    f"{_MIGRATION_URL})")
    if t.on_chip:
        on_chip(instr, arg, t, ("sbuf",))
    return t


def same_partitions_and_free(instr: str, a_name: str, a: NkiTensor, b_name: str, b: NkiTensor) -> None:
    """Equal partition counts and elements per partition (the tile-shape rule of the elementwise nki.isa pages,
    e.g. https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.tensor_tensor.html)."""
    if a.shape[0] != b.shape[0]:
        fail(instr, f"'{a_name}' has {a.shape[0]} partitions but '{b_name}' has {b.shape[0]} "
                    f"(shapes {a.shape} vs {b.shape})")
    if a.free_size != b.free_size:
        fail(instr, f"'{a_name}' has {a.free_size} elements per partition but '{b_name}' has {b.free_size} "
                    f"(shapes {a.shape} vs {b.shape})")


def not_both_psum(instr: str, a_name: str, a: NkiTensor, b_name: str, b: NkiTensor) -> None:
    if a.storage.buffer_kind == "psum" and b.storage.buffer_kind == "psum":
        fail(instr, f"'{a_name}' and '{b_name}' may not both be in PSUM")


def dtype_in(instr: str, arg: str, t: NkiTensor, allowed) -> None:
    if t.dtype not in allowed:
        fail(instr, f"argument '{arg}' ('{t.name}') has dtype {t.dtype}; "
                    f"expected one of {sorted(str(a) for a in allowed)}")


def require_nc_version(instr: str, minimum: int, what: str = "") -> None:
    target = ctx().target
    if target.nc_version < minimum:
        gen = {3: "NeuronCore-v3 (trn2)", 4: "NeuronCore-v4 (trn3)"}[minimum]
        fail(instr, f"{what or 'this instruction'} requires {gen} or newer; the target is {target.name} "
                    f"(gen{target.nc_version})")


def scalar_or_vector(instr: str, arg: str, value, data: NkiTensor, allow_none=False):
    """A compile-time scalar or a [P, 1] tile (the scale/bias/operand docs of each instruction: shape
    (data.shape[0], 1)). Returns (float|None, tensor|None)."""
    if value is None:
        if allow_none:
            return None, None
        fail(instr, f"argument '{arg}' is required")
    if isinstance(value, NkiTensor):
        t = on_chip(instr, arg, value)
        if t.shape[0] != data.shape[0] or t.free_size != 1:
            fail(instr, f"argument '{arg}' must be a [{data.shape[0]}, 1] tile, got shape {t.shape}")
        return None, t
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        fail(instr, f"argument '{arg}' must be a number or a [P, 1] tile, got {value!r}")
    return float(value), None


def resolve_engine(instr: str, requested, allowed, default):
    """Validate an `engine=` argument; returns the engine used (for the trace)."""
    if requested is None:
        requested = engine.unknown
    if not isinstance(requested, engine):
        fail(instr, f"engine must be an nisa.engine member, got {requested!r} (raw ints rejected since NKI 0.3.0)")
    if requested == engine.unknown:
        return default
    if requested not in allowed:
        fail(instr, f"engine {requested.name} is not supported; expected one of {[e.name for e in allowed]}")
    return requested


def flat2d(values: np.ndarray, t: NkiTensor) -> np.ndarray:
    """[P, F] float/raw view of a tile's values (free dims flattened row-major)."""
    return values.reshape(t.shape[0], -1)


def alu_op(instr: str, arg: str, op):
    """An `nl.<op>` operator identifier; anything else is rejected by name
    (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/nki.api.shared.html)."""
    from ..language.ops import Op

    if not isinstance(op, Op):
        fail(instr, f"argument '{arg}' must be an nl operator such as nl.add, got {type(op).__name__} {op!r}")
    return op


def gpsimd_no_psum(instr: str, eng, *tiles) -> None:
    """GpSimd cannot access PSUM (GpSimd instruction pages of the 2.32 nki.isa API).

    `tiles` are (arg, view) pairs."""
    if eng == engine.gpsimd:
        for arg, t in tiles:
            if t is not None and t.storage.buffer_kind == "psum":
                fail(instr, f"engine gpsimd cannot access PSUM (argument '{arg}', '{t.name}')")


def numeric_operand(instr: str, arg: str, t: NkiTensor, write: bool = False) -> None:
    """Reject dtypes compute engines cannot do arithmetic on: packed MX x4 (and e8m0 as a destination)."""
    if t.dtype.is_x4 or (write and t.dtype.category == "scale"):
        fail(instr, f"argument '{arg}' ('{t.name}') has packed/scale dtype {t.dtype}; compute engines cannot "
                    "convert to or from it (use tensor_copy/DMA of raw words or quantize_mx)")


def registers_or_none(regs: np.ndarray, known: np.ndarray, lane0: int, p: int):
    """A copy of an engine's accumulator registers `regs` of lanes lane0..lane0+p (what reduce_res receives), or None
    when one of them holds a reduction of value-less data (`known` False: a shape-only run)."""
    if not known[lane0:lane0 + p].all():
        return None
    return regs[lane0:lane0 + p].copy()
