"""Simulated top-level `nki` module: jit, simulate, cpu_simulate (spec §1.1, §1.3)."""
from __future__ import annotations

import functools
import os

from .. import runtime
from ..errors import NkiValidationError
from . import isa, language  # noqa: F401


def _check_lnc(lnc):
    if isinstance(lnc, bool) or not isinstance(lnc, int) or lnc not in (1, 2):
        raise NkiValidationError(f"kernel[lnc]: LNC degree must be 1 or 2 on Trn2/Trn3, got {lnc!r} (spec §1.1)")
    return lnc


class Kernel:
    """What `@nki.jit` returns. `kernel[lnc](...)` selects the LNC degree; `kernel(...)` is LNC 1."""

    def __init__(self, fn, options):
        if "platform_target" in options:
            raise NkiValidationError("nki.jit: platform_target= was removed in NKI 0.3.0; use "
                                     "NEURON_PLATFORM_TARGET_OVERRIDE (spec §1.1)")
        options.pop("mode", None)  # deprecated and ignored since 0.3.0 (spec §1.1)
        self.fn = fn
        self.options = options
        functools.update_wrapper(self, fn)

    def __getitem__(self, lnc):
        return LaunchSpec(self, _check_lnc(lnc), grid_ndim=1)

    def __call__(self, *args, **kwargs):
        return LaunchSpec(self, 1, grid_ndim=0)(*args, **kwargs)

    def __repr__(self):
        return f"<nki.jit kernel {self.fn.__name__}>"


class LaunchSpec:
    """A kernel bound to an LNC degree."""

    def __init__(self, kernel, lnc, grid_ndim):
        self.kernel, self.lnc, self.grid_ndim = kernel, lnc, grid_ndim

    def __call__(self, *args, **kwargs):
        if runtime.current(optional=True) is not None:
            raise NkiValidationError(
                f"{self.kernel.fn.__name__}: an @nki.jit kernel was called from inside a kernel; sub-kernels must "
                "not be decorated with nki.jit (spec §1.1)")
        if os.environ.get("NKI_SIMULATOR", "0") == "1":
            from ..launcher import run_kernel

            return run_kernel(self.kernel.fn, args, kwargs, lnc=self.lnc, grid_ndim=self.grid_ndim).outputs
        raise RuntimeError(
            f"{self.kernel.fn.__name__}: no Neuron device is available to this simulated nki; run it with "
            "nki.simulate(kernel)[lnc](...) or set NKI_SIMULATOR=1")


def jit(fn=None, **kwargs):
    """Decorate a kernel: `@nki.jit`, `@nki.jit()`, `@nki.jit(mode=...)` or `nki.jit(f)`."""
    if fn is None:
        return lambda f: Kernel(f, dict(kwargs))
    return Kernel(fn, dict(kwargs))


class Simulated:
    """`nki.simulate(kernel)`: callable, and indexable by LNC degree."""

    def __init__(self, fn, lnc, grid_ndim):
        self.fn, self.lnc, self.grid_ndim = fn, lnc, grid_ndim

    def __getitem__(self, lnc):
        return Simulated(self.fn, _check_lnc(lnc), 1)

    def __call__(self, *args, **kwargs):
        from ..launcher import run_kernel

        return run_kernel(self.fn, args, kwargs, lnc=self.lnc, grid_ndim=self.grid_ndim).outputs


def simulate(kernel):
    """Run a kernel on the CPU simulator: `nki.simulate(k)(...)`, `nki.simulate(k)[2](...)`,
    `nki.simulate(k[2])(...)`. NumPy (or torch CPU) in, same kind out; plain functions auto-wrapped."""
    if isinstance(kernel, LaunchSpec):
        return Simulated(kernel.kernel.fn, kernel.lnc, kernel.grid_ndim)
    if isinstance(kernel, Kernel):
        return Simulated(kernel.fn, 1, 0)
    if callable(kernel):
        return Simulated(kernel, 1, 0)
    raise TypeError(f"nki.simulate: expected a kernel or function, got {kernel!r}")


cpu_simulate = simulate  # nki-library harness spelling (spec §1.3 item 3)
