"""Engine-sequencer registers: VirtualRegister, register_alloc / move / load / store, and the
resolution of `.ap(scalar_offset=register)` (`scalar_offset_elements`).

Semantics (NKI 0.6.0 / SDK 2.32 API docs):
https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.register_alloc.html
https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.register_move.html
https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.register_load.html
https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.register_store.html
https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/api/generated/nki.isa.VirtualRegister.html

- A register holds one 32-bit value ("64x 32-bit registers per engine sequencer"); the language
  guide lists u8..i32 and fp32 and says negative values are valid. Here a register holds a signed
  32-bit integer: immediates and loaded values outside [-2**31, 2**31 - 1] are rejected (the
  signedness of the hardware compare is not documented, so a uint32 value >= 2**31 is ambiguous).
- register_load reads "exactly one element (shape [1] or [1, 1])" from SBUF or HBM, any dtype
  except the packed x4 types (2.33 page). The 2.32 language guide says "a 1x1 SBUF tile"; the API
  pages (HBM or SBUF, for load and store) are followed. A float value must be an exact integer (the docs do not
  say whether the register receives the bits or a conversion, so anything else fails loudly).
- register_move takes a compile-time integer only (2.32 wording; 2.29 also allowed a register).
- register_store writes the value into a one-element SBUF/HBM tensor; a value the destination
  dtype cannot represent exactly is rejected (no documented truncation/saturation rule).
- Registers belong to the program (physical core) that allocated them; each engine sequencer has
  its own register file, and the two LNC programs run on different cores.
- Trace: each op records `instr=<function name>`, `engine="sync"` (the docs say only that the
  compiler places registers on "the appropriate engine sequencers"; we name the Sync engine's
  sequencer), `register=<id>`; register_load lists its source tensor in `reads`, register_store
  its destination in `writes`, so dependencies through the loaded value are tracked.
"""
from __future__ import annotations

import itertools
import numbers

import numpy as np

from ...errors import NkiValidationError, UninitializedReadError
from ...access import cast_values, checked_read, checked_write, to_float32
from ...tensor import NkiTensor
from ._common import NkiInstruction, ctx, fail

INT32_MIN = -(2 ** 31)
INT32_MAX = 2 ** 31 - 1
REGISTER_ENGINE = "sync"  # sequencer named in the trace (see module docstring)
# value of a never-written register in non-strict mode: the integer fill pattern of fresh tensors
UNINITIALIZED_REGISTER_VALUE = 4

_register_ids = itertools.count(1)


class VirtualRegister:
    """A 32-bit register of an engine sequencer, allocated with `nisa.register_alloc`.

    Its value is a run-time value: Python cannot branch on it (`if reg:` / `while reg:` raise;
    use `nl.while_loop`) or index with it (use `.ap(..., scalar_offset=reg)`).
    """

    __slots__ = ("id", "_value", "_owner", "_frozen")

    def __init__(self, value, owner, frozen: str | None = None):
        self.id = next(_register_ids)
        self._value = value  # int, or None while never written
        self._owner = owner  # the ProgramContext that allocated it
        self._frozen = frozen  # why writes are rejected (induction variable of a running loop)

    def __repr__(self):
        shown = "uninitialized" if self._value is None else self._value
        return f"VirtualRegister(id={self.id}, value={shown})"

    def __bool__(self):
        raise NkiValidationError(
            f"{self!r}: a register's truth value is a run-time value; a bare `while reg:` loop is deprecated in "
            "NKI 0.6.0 and removed in 0.7.0 and is not simulated: use nl.while_loop(init, body_fun)")

    def __index__(self):
        raise NkiValidationError(
            f"{self!r}: a register's value is a run-time value and cannot be used as a Python int; pass the "
            "register itself (loop bound of nl.fori_loop, .ap(..., scalar_offset=reg))")

    __int__ = __index__
    __hash__ = object.__hash__  # identity, as for any handle

    def _host_operator(self, *_):
        raise NkiValidationError(
            f"{self!r}: Python operators on a register would run at trace time on a run-time value; register "
            "arithmetic and comparisons (NkiScalar, NKI 0.7) are not simulated: compute through an SBUF tile and "
            "register_load the result")

    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = _host_operator
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __neg__ = _host_operator
    __floordiv__ = __rfloordiv__ = __mod__ = __rmod__ = _host_operator


def _program_register(instr: str, arg: str, reg) -> VirtualRegister:
    if not isinstance(reg, VirtualRegister):
        fail(instr, f"argument '{arg}' must be a VirtualRegister from nisa.register_alloc, got "
                    f"{type(reg).__name__} {reg!r}")
    c = ctx()
    if reg._owner is not c:
        fail(instr, f"argument '{arg}' {reg!r} was allocated by another program or launch; registers belong to "
                    f"the core that allocated them (this is program {c.program_id})")
    return reg


def _writable(instr: str, reg: VirtualRegister) -> None:
    if reg._frozen is not None:
        fail(instr, f"argument 'dst' {reg!r} is frozen: {reg._frozen}")


def _int32_immediate(instr: str, arg: str, value) -> int:
    if isinstance(value, VirtualRegister):
        fail(instr, f"argument '{arg}' must be a compile-time integer, got {value!r} (a register)")
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        fail(instr, f"argument '{arg}' must be a compile-time integer, got {type(value).__name__} {value!r}")
    value = int(value)
    if not INT32_MIN <= value <= INT32_MAX:
        fail(instr, f"argument '{arg}' = {value} does not fit a 32-bit register [{INT32_MIN}, {INT32_MAX}]")
    return value


def register_value(reg: VirtualRegister, what: str) -> int:
    """The current value of a register of the running program (its reader is named in `what`)."""
    c = ctx()
    if not isinstance(reg, VirtualRegister):
        raise NkiValidationError(f"{what}: expected a VirtualRegister, got {type(reg).__name__} {reg!r}")
    if reg._owner is not c:
        raise NkiValidationError(f"{what}: {reg!r} was allocated by another program or launch "
                                 f"(this is program {c.program_id})")
    if reg._value is None:
        if c.settings.strict:
            raise UninitializedReadError(
                f"{what}: reads {reg!r}, which was allocated without a value and never written "
                "(register_move / register_load first)")
        return UNINITIALIZED_REGISTER_VALUE
    return reg._value


def new_register(value: int | None, frozen: str | None = None) -> VirtualRegister:
    """A register of the running program (used by the loop constructs for their iteration values)."""
    return VirtualRegister(value, ctx(), frozen)


def _one_element(instr: str, arg: str, t) -> NkiTensor:
    if not isinstance(t, NkiTensor):
        fail(instr, f"argument '{arg}' must be an NKI tensor, got {type(t).__name__} {t!r}")
    kind = t.storage.buffer_kind
    if kind == "psum":
        fail(instr, f"argument '{arg}' ('{t.name}') is in PSUM; expected SBUF or HBM")
    if t.shape not in ((1,), (1, 1)):
        fail(instr, f"argument '{arg}' ('{t.name}') must hold exactly one element (shape [1] or [1, 1]), "
                    f"got shape {t.shape}")
    if t.dtype.is_x4:
        fail(instr, f"argument '{arg}' ('{t.name}') has packed dtype {t.dtype}; x4 types are only defined for "
                    "quantize_mx / nc_matmul_mx")
    return t


def register_alloc(x=None):
    """Allocate a register of this program, optionally initialised with the integer `x`."""
    instr = "register_alloc"
    if isinstance(x, NkiTensor):
        fail(instr, f"argument 'x' must be an integer or None, got tensor '{x.name}'; load a tensor value with "
                    "nisa.register_load(reg, tensor)")
    value = None if x is None else _int32_immediate(instr, "x", x)
    reg = new_register(value)
    ctx().record(instr=instr, engine=REGISTER_ENGINE, register=reg.id, value=value)
    return reg


def register_move(dst, imm):
    """dst = imm (a compile-time 32-bit integer)."""
    instr = "register_move"
    dst = _program_register(instr, "dst", dst)
    _writable(instr, dst)
    value = _int32_immediate(instr, "imm", imm)
    ctx().record(instr=instr, engine=REGISTER_ENGINE, register=dst.id, value=value)
    dst._value = value
    return NkiInstruction(None)


def _as_register_int(instr: str, src: NkiTensor, raw: np.ndarray) -> int:
    if src.dtype.is_int:
        value = int(np.asarray(raw).reshape(-1)[0])
    else:
        f = float(to_float32(src, np.asarray(raw)).reshape(-1)[0])
        if not np.isfinite(f) or f != int(f):
            fail(instr, f"argument 'src' ('{src.name}', {src.dtype}) holds {f!r}; a register loaded from a float "
                        "tensor must receive an exact integer in this simulator (float register values are not "
                        "simulated)")
        value = int(f)
    if not INT32_MIN <= value <= INT32_MAX:
        fail(instr, f"argument 'src' ('{src.name}', {src.dtype}) holds {value}, outside the signed 32-bit "
                    f"register range [{INT32_MIN}, {INT32_MAX}]")
    return value


def _no_values(instr: str, src: NkiTensor):
    """Shape-only run: `src` holds no known value (docs/simulator.md#shape-only-runs-with-carried-integer-inputs)."""
    fail(instr, f"argument 'src' ('{src.name}', {src.dtype}, {src.storage.buffer_kind}) has no values in a shape-only "
                "run (numerics=False): only integer kernel inputs passed as numpy arrays carry their values, and "
                "tiles computed by instructions whose every data input carries values; a ShapeSpec, a float input, "
                "memset/iota and anything computed from a value-less input do not")


def register_load(dst, src):
    """dst = the single element of `src` (SBUF or HBM)."""
    instr = "register_load"
    dst = _program_register(instr, "dst", dst)
    _writable(instr, dst)
    src = _one_element(instr, "src", src)
    c = ctx()
    c.record(instr=instr, engine=REGISTER_ENGINE, reads=[("src", src)], register=dst.id)
    raw = checked_read(src, instr, "src")
    if raw is None:
        _no_values(instr, src)
    dst._value = _as_register_int(instr, src, raw)
    return NkiInstruction(None)


def register_store(dst, src):
    """Write the value of register `src` into the one-element tensor `dst` (SBUF or HBM)."""
    instr = "register_store"
    src = _program_register(instr, "src", src)
    dst = _one_element(instr, "dst", dst)
    value = register_value(src, f"nisa.{instr} argument 'src'")
    if dst.dtype.category == "scale":
        fail(instr, f"argument 'dst' ('{dst.name}') has scale dtype {dst.dtype}; a register value is an integer")
    stored = cast_values(np.asarray([value], dtype=np.int64 if dst.dtype.is_int else np.float64)
                         .astype(np.int64 if dst.dtype.is_int else np.float32), dst.dtype, dst.np_dtype)
    back = int(stored[0]) if dst.dtype.is_int else float(stored[0].astype(np.float64))
    if back != value:
        fail(instr, f"register value {value} is not representable in argument 'dst' ('{dst.name}', {dst.dtype}); "
                    f"it would be stored as {back}")
    c = ctx()
    c.record(instr=instr, engine=REGISTER_ENGINE, writes=[("dst", dst)], register=src.id)
    checked_write(dst, instr, "dst", stored)
    return NkiInstruction(None)


def scalar_offset_elements(view: NkiTensor, reg, indirect_dim, new, new_isz: int):
    """(register value, element offset) of `.ap(scalar_offset=reg, indirect_dim=d)`, resolved now.

    The access starts `value` elements along dim d of the tensor `.ap` is called on, i.e. at
    `offset + value * prod(shape[d+1:])` elements (in the pattern's dtype); see
    https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/deep-dives/nki-dynamic-loops.html
    (`input_tensor.ap([[512, 128], [1, 512]], scalar_offset=i)` steps i rows of 512) and
    docs/simulator.md#registers-and-dynamic-control-flow. Only a VirtualRegister is simulated as the
    offset. Called by `NkiTensor.ap`; `new` is the pattern's dtype and `new_isz` its storage itemsize.
    """
    what = f"tensor '{view.name}'.ap"
    if not isinstance(reg, VirtualRegister):
        raise NkiValidationError(
            f"{what}: scalar_offset must be a VirtualRegister (nisa.register_alloc / register_load, or a loop's "
            f"iteration register), got {type(reg).__name__}; a 1x1 SBUF tensor offset is not simulated")
    if isinstance(indirect_dim, bool) or not isinstance(indirect_dim, int) or not 0 <= indirect_dim < view.ndim:
        raise NkiValidationError(
            f"{what}: indirect_dim must be a dim of the tensor's shape {view.shape} (0..{view.ndim - 1}), "
            f"got {indirect_dim!r}")
    inner = int(np.prod(view.shape[indirect_dim + 1:], dtype=np.int64))
    if view.strides[indirect_dim] != inner:
        raise NkiValidationError(
            f"{what}: scalar_offset steps dim {indirect_dim} by prod(shape[{indirect_dim + 1}:]) = {inner} elements, "
            f"but this view's stride on that dim is {view.strides[indirect_dim]} (a sliced or re-strided view); "
            "call .ap on a contiguous tensor so the two readings agree")
    value = register_value(reg, f"{what} scalar_offset")
    step_bytes = inner * view.itemsize_storage
    if step_bytes % new_isz:
        raise NkiValidationError(
            f"{what}: one step of dim {indirect_dim} ({step_bytes} bytes) is not a whole number of {new} elements")
    return value, value * (step_bytes // new_isz)
