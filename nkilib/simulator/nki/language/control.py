"""Dynamic (run-time) loops: nl.fori_loop, nl.while_loop and the deprecated nl.dynamic_range.

Docs:
https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.0/nki/api/generated/nki.language.fori_loop.html
https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/api/generated/nki.language.while_loop.html
https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.language.dynamic_range.html
https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/deep-dives/nki-dynamic-loops.html
https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/migration/index.html (0.6.0 deprecates
dynamic_range and bare `while reg:`; 0.7.0 / SDK 2.33 removes them)

On hardware these compile to a compare-and-branch loop run by the engine sequencers; the body is
traced once. The simulator runs them eagerly: the bounds are read from their registers when the
loop starts, and the body runs once per iteration with the current iteration value, so the trace
holds the instructions of the iterations actually taken.

Choices where the docs are silent (docs/simulator.md#registers-and-dynamic-control-flow):
- the body receives a VirtualRegister in every case (2.32 semantics; 2.33's NkiScalar, used when
  both bounds are ints, is not simulated);
- a register that bounds a running loop is frozen until the loop ends (whether the hardware
  compare re-reads a rewritten bound is undocumented);
- `while_loop` stops after MAX_WHILE_TRIPS iterations with an error: a simulator guard against a
  hung test, not a hardware limit;
- trace: one record per executed loop, `instr="dynamic_loop"`, `engine="sync"` (the deep dive says
  every iteration ends "with a drain and a barrier across all engines"; no single engine is named),
  attrs `loop_kind`, `trip_count`, `loop_index`, `depth`, `registers` (ids of the bound / condition
  registers) and, for counted loops, `lower`, `upper`, `step`. It is emitted when the loop starts
  (before its body's records) and its `trip_count` is final when the loop ends. Every record
  issued inside a body carries `loop_iteration=(loop_index, iteration)` of the innermost loop.
"""
from __future__ import annotations

import numbers
import warnings

import numpy as np

from ... import runtime
from ...control_flow import LoopEntry, call_site
from ...errors import NkiValidationError
from ..isa.registers import INT32_MAX, INT32_MIN, VirtualRegister, new_register, register_value

LOOP_ENGINE = "sync"
MAX_WHILE_TRIPS = 1 << 20  # simulator guard against a never-ending while_loop (not a hardware limit)


def _bound(what: str, arg: str, value) -> tuple[int, VirtualRegister | None]:
    """(value, register or None) of a loop bound: a Python int or a VirtualRegister of this program."""
    if isinstance(value, VirtualRegister):
        return register_value(value, f"{what} argument '{arg}'"), value
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise NkiValidationError(
            f"{what}: argument '{arg}' must be an int or a VirtualRegister, got {type(value).__name__} {value!r}")
    value = int(value)
    if not INT32_MIN <= value <= INT32_MAX:
        raise NkiValidationError(
            f"{what}: argument '{arg}' = {value} is not a 32-bit value; a loop bound compiles into a 32-bit "
            "compare-and-branch")
    return value, None


def _step(what: str, step) -> int:
    if isinstance(step, VirtualRegister):
        raise NkiValidationError(
            f"{what}: argument 'step' must be a compile-time positive int, got {step!r}; the hardware loop encodes "
            "the step as an immediate")
    if isinstance(step, (bool, np.bool_)) or not isinstance(step, numbers.Integral) or not 1 <= step <= INT32_MAX:
        raise NkiValidationError(f"{what}: argument 'step' must be a compile-time positive int, got {step!r}")
    return int(step)


class _DynamicLoop:
    """Bookkeeping of one executed dynamic loop: trace record, loop log entry, frozen bound registers."""

    def __init__(self, kind: str, where: str, registers=(), **bounds):
        self.ctx = runtime.current()
        ctx = self.ctx
        self.entry = LoopEntry(kind, where, len(ctx.dynamic_loops))
        ctx.dynamic_loops.append(self.entry)
        self.registers = [r for r in registers if r is not None]
        self.saved_frozen = [r._frozen for r in self.registers]
        for r in self.registers:
            r._frozen = f"it bounds the running {self.entry.describe()}"
        if ctx.trace is not None:
            ctx.record(instr="dynamic_loop", engine=LOOP_ENGINE, loop_kind=kind, trip_count=None,
                       loop_index=self.entry.ordinal, depth=len(ctx.loop_stack),
                       registers=tuple(r.id for r in self.registers), **bounds)
            self.entry.record = ctx.trace[-1]
        ctx.loop_stack.append(self.entry)

    def iteration(self) -> None:
        self.entry.trips += 1

    def finish(self) -> None:
        self.ctx.loop_stack.pop()
        for r, frozen in zip(self.registers, self.saved_frozen):
            r._frozen = frozen
        self.entry.done = True
        if self.entry.record is not None:
            self.entry.record.attrs["trip_count"] = self.entry.trips


def fori_loop(lower, upper, body_fun, step=1):
    """Run `body_fun(i)` for i in range(lower, upper, step); bounds are ints or VirtualRegisters.

    `i` is a fresh VirtualRegister per iteration, passed by value: writing it does not change the
    loop. Returns None; carry other loop state through SBUF/HBM.
    """
    what = "nl.fori_loop"
    lo, lo_reg = _bound(what, "lower", lower)
    hi, hi_reg = _bound(what, "upper", upper)
    step = _step(what, step)
    if not callable(body_fun):
        raise NkiValidationError(f"{what}: argument 'body_fun' must be callable, got {type(body_fun).__name__}")
    values = range(lo, hi, step)
    loop = _DynamicLoop("fori_loop", call_site(1), (lo_reg, hi_reg), lower=lo, upper=hi, step=step)
    if loop.entry.record is not None:
        loop.entry.record.attrs["trip_count"] = len(values)
    try:
        for i in values:
            loop.iteration()
            body_fun(new_register(i))
    finally:
        loop.finish()


def while_loop(init, body_fun):
    """While the condition register is nonzero: `r = body_fun(r)` (checked before each iteration).

    The body receives the current condition value as a fresh VirtualRegister and returns the
    register holding the next condition. Returns None.
    """
    what = "nl.while_loop"
    if not isinstance(init, VirtualRegister):
        raise NkiValidationError(
            f"{what}: argument 'init' must be a VirtualRegister (the condition register), got "
            f"{type(init).__name__} {init!r}")
    if not callable(body_fun):
        raise NkiValidationError(f"{what}: argument 'body_fun' must be callable, got {type(body_fun).__name__}")
    cond = register_value(init, f"{what} argument 'init'")
    loop = _DynamicLoop("while_loop", call_site(1), (init,))
    try:
        while cond != 0:
            if loop.entry.trips >= MAX_WHILE_TRIPS:
                raise NkiValidationError(
                    f"{what}: {loop.entry.describe()} did not end after {MAX_WHILE_TRIPS} iterations (the "
                    "simulator's guard against a never-ending loop; the condition register stayed nonzero)")
            loop.iteration()
            nxt = body_fun(new_register(cond))
            if not isinstance(nxt, VirtualRegister):
                raise NkiValidationError(
                    f"{what}: body_fun must return the next condition as a VirtualRegister, got "
                    f"{type(nxt).__name__} {nxt!r} (iteration {loop.entry.trips - 1} of {loop.entry.describe()})")
            cond = register_value(nxt, f"{what} condition returned by body_fun")
    finally:
        loop.finish()


def dynamic_range(start, stop=None, step=1):
    """Deprecated (NKI 0.6.0; removed in 0.7.0): iterate on device from start to stop.

    Yields one frozen VirtualRegister per iteration (the language guide: the induction variable
    of a dynamic_range loop cannot be written with register_move / register_load).
    """
    what = "nl.dynamic_range"
    warnings.warn("nl.dynamic_range is deprecated since NKI 0.6.0 and removed in 0.7.0; use nl.fori_loop",
                  DeprecationWarning, stacklevel=2)
    if stop is None:
        start, stop = 0, start
    lo, lo_reg = _bound(what, "start", start)
    hi, hi_reg = _bound(what, "stop", stop)
    step = _step(what, step)
    where = call_site(1)
    return _dynamic_range_iter(range(lo, hi, step), where, (lo_reg, hi_reg), lo, hi, step)


def _dynamic_range_iter(values, where, registers, lo, hi, step):
    loop = _DynamicLoop("dynamic_range", where, registers, lower=lo, upper=hi, step=step)
    if loop.entry.record is not None:
        loop.entry.record.attrs["trip_count"] = len(values)
    try:
        for i in values:
            loop.iteration()
            yield new_register(i, frozen=f"it is the induction variable of {loop.entry.describe()}")
    finally:
        # a `break` closes the generator early: the log keeps the iterations actually started
        loop.finish()
