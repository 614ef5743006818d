"""Load a script of simulations/ as a module (import as `from scriptkit import load_script`)."""
from __future__ import annotations

import importlib.util
import os
import sys

SIMULATIONS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "simulations")


def load_script(name: str):
    """simulations/<name>.py, run as a module named `name`.

    The module is registered in sys.modules before it runs, as an import would: a dataclass in a module with postponed
    annotations looks its module up there (else AttributeError: 'NoneType' object has no attribute '__dict__', in
    whichever xdist worker had not imported the script by name already)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(SIMULATIONS, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
