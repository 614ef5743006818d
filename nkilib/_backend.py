"""Backend selection: the real Neuron `nki` when importable and genuine, else our simulator.

NKILIB_SIMULATOR=1 forces the simulator; NKILIB_SIMULATOR=0 forbids it (ImportError naming
what is missing). Unset: real `nki` if genuine, otherwise the simulator. One log line says which.
"""
from __future__ import annotations

import importlib
import logging
import os
import sys

log = logging.getLogger("nkilib")


def _real_nki_problem() -> str | None:
    """None if a genuine `nki` imports; otherwise why not (the PyPI placeholder raises 'WRONG PACKAGE')."""
    try:
        nki = importlib.import_module("nki")
        nl = importlib.import_module("nki.language")
        nisa = importlib.import_module("nki.isa")
    except Exception as e:  # noqa: BLE001 - the placeholder may raise anything at import
        return f"import nki failed: {type(e).__name__}: {e}"
    missing = [n for mod, n in ((nki, "jit"), (nl, "ndarray"), (nisa, "nc_matmul_mx"), (nisa, "nc_matmul"))
               if not hasattr(mod, n)]
    if missing:
        return f"the installed nki ({getattr(nki, '__file__', '?')}) is not genuine: missing {missing}"
    return None


def select_backend() -> str:
    from . import simulator

    mode = os.environ.get("NKILIB_SIMULATOR", "").strip()
    if mode not in ("", "0", "1"):
        raise ValueError(f"NKILIB_SIMULATOR must be '0', '1' or unset, got {mode!r}")
    if simulator.is_installed():
        return "simulator"
    if mode == "1":
        for name in simulator.MODULE_NAMES:
            sys.modules.pop(name, None)
        simulator.install()
        log.info("nkilib backend: bundled NKI CPU simulator (forced by NKILIB_SIMULATOR=1)")
        return "simulator"
    problem = _real_nki_problem()
    if problem is None:
        log.info("nkilib backend: Neuron nki from %s", sys.modules["nki"].__file__)
        return "neuron"
    if mode == "0":
        raise ImportError(f"NKILIB_SIMULATOR=0 forbids the bundled simulator, but the Neuron nki is unusable: "
                          f"{problem}. Install neuronx-cc from the Neuron SDK or unset NKILIB_SIMULATOR.")
    for name in simulator.MODULE_NAMES:
        sys.modules.pop(name, None)
    simulator.install()
    log.info("nkilib backend: bundled NKI CPU simulator (%s)", problem)
    return "simulator"
