"""nkilib's NKI CPU simulator: a strict, pure-NumPy drop-in for the `nki` module tree.

`install()` registers it under the module names that nki-library's simulation harness aliases
(`test/utils/simulation_setup.py` in https://github.com/aws-neuron/nki-library; docs/simulator.md#backend-selection):
`nki`, `nki.language`, `nki.isa`, `nki.isa.constants`, `nki.typing`, `nki.compiler`, `nki.dtype`,
`nki.tensor`. `run_kernel` is the programmatic entry (trace, shape-only runs).
"""
from __future__ import annotations

import sys

from .errors import (  # noqa: F401
    CapacityError, NkiValidationError, OutOfBoundsError, RaceError, RaceWarning, UninitializedReadError,
)
from .launcher import RunResult, ShapeSpec, run_kernel  # noqa: F401
from .settings import current_settings  # noqa: F401

MODULE_NAMES = ("nki", "nki.language", "nki.isa", "nki.isa.constants", "nki.typing", "nki.compiler", "nki.dtype",
                "nki.tensor")


def install() -> None:
    """Make `import nki` (and submodules) resolve to this simulator."""
    from . import nki as sim_nki
    from .nki import compiler, isa, language, tensor, typing
    from .nki.isa import constants
    from .nki.language import dtypes

    modules = {
        "nki": sim_nki, "nki.language": language, "nki.isa": isa, "nki.isa.constants": constants,
        "nki.typing": typing, "nki.compiler": compiler, "nki.dtype": dtypes, "nki.tensor": tensor,
    }
    sys.modules.update(modules)
    sim_nki.dtype = dtypes


def is_installed() -> bool:
    from . import nki as sim_nki

    return sys.modules.get("nki") is sim_nki
