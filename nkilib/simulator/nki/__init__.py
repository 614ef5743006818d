"""Simulated top-level `nki` module: jit, simulate, cpu_simulate
(https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/nki.html,
https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/guides/nki_simulator.html).

Helpers are imported under `_` names so that only documented names (and the submodules `isa`,
`language`, `typing`, `compiler`, `tensor`) are public.
"""
import functools as _functools
import os as _os

from .. import runtime as _runtime
from ..errors import NkiValidationError as _NkiValidationError
from . import isa, language  # noqa: F401

_LNC_URL = "https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/get-started/about/lnc.html"
_MIGRATION_URL = "https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/migration/index.html"


def _check_lnc(lnc):
    if isinstance(lnc, bool) or not isinstance(lnc, int) or lnc not in (1, 2):
        raise _NkiValidationError(f"kernel[lnc]: LNC degree must be 1 or 2 on Trn2/Trn3, got {lnc!r} ({_LNC_URL})")
    return lnc


class Kernel:
    """What `@nki.jit` returns. `kernel[lnc](...)` selects the LNC degree; `kernel(...)` is LNC 1."""

    def __init__(self, fn, options):
        if "platform_target" in options:
            raise _NkiValidationError("nki.jit: platform_target= was removed in NKI 0.3.0; use "
                                     f"NEURON_PLATFORM_TARGET_OVERRIDE ({_MIGRATION_URL})")
        options.pop("mode", None)  # deprecated and ignored since 0.3.0 (_MIGRATION_URL)
        self.fn = fn
        self.options = options
        _functools.update_wrapper(self, fn)

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
        if _runtime.current(optional=True) is not None:
            raise _NkiValidationError(
                f"{self.kernel.fn.__name__}: an @nki.jit kernel was called from inside a kernel; sub-kernels must "
                f"not be decorated with nki.jit ({_MIGRATION_URL})")
        if _os.environ.get("NKI_SIMULATOR", "0") == "1":
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


cpu_simulate = simulate  # nki-library's test harness spelling (aws-neuron/nki-library test/utils/simulation_setup.py)
