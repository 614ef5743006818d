"""Exceptions raised by the nkilib NKI CPU simulator.

`NkiValidationError` is the documented exception type of `nki.isa` ("raised when hardware
constraints are violated",
https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/nki.isa.html). Every stricter check this simulator adds
derives from it so that `pytest.raises(nisa.NkiValidationError)` catches all of them.
"""


class NkiValidationError(Exception):
    """A kernel violated a hardware or compiler rule."""


class UninitializedReadError(NkiValidationError):
    """An instruction read tensor elements that were never written (strict mode)."""


class CapacityError(NkiValidationError):
    """Live SBUF or PSUM bytes per partition exceeded the target's capacity."""


class RaceError(NkiValidationError):
    """Two LNC programs touched overlapping shared_hbm bytes with no core_barrier between."""


class OutOfBoundsError(NkiValidationError, IndexError):
    """An index, slice or access pattern reaches outside its tensor's storage."""


class DivergentControlFlowError(NkiValidationError):
    """The programs of an LNC2 launch took different dynamic control flow (trip counts of run-time loops)."""


class IndirectHazardError(NkiValidationError):
    """One indirect DMA would write the same destination element twice (duplicate indices): the
    write order is unspecified on hardware, so the result would be a hazard, not last-writer-wins."""


class RaceWarning(UserWarning):
    """Two LNC programs wrote identical values to overlapping shared_hbm bytes in one epoch (defined
    result; see runtime.py's race rule)."""


def not_simulated_stub(qualname: str, api: str, hint: str = ""):
    """Stand-in for a documented NKI function the simulator does not implement: resolving the name
    works (kernels may reference it at import time), calling it raises (README, 'Simulator limits')."""
    def not_simulated(*args, **kwargs):
        raise NkiValidationError(f"{qualname} is part of the documented {api} API but is not simulated by nkilib's "
                                 f"simulator (README, 'Simulator limits'){hint}")

    not_simulated.__name__ = qualname.rsplit(".", 1)[-1]
    return not_simulated
