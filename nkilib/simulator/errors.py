"""Exceptions raised by the nkilib NKI CPU simulator.

`NkiValidationError` is the documented exception type of `nki.isa` ("raised when hardware
constraints are violated", nki-spec.md §1.3). Every stricter check this simulator adds derives
from it so that `pytest.raises(nisa.NkiValidationError)` catches all of them.
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


class RaceWarning(UserWarning):
    """Two LNC programs wrote identical values to overlapping shared_hbm bytes in one epoch (defined
    result; see runtime.py's race rule)."""
