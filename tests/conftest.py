"""Shared test setup: importing nkilib selects the backend (the bundled simulator here) before
any test imports `nki`. Every test starts from the documented defaults: target trn3, strict
uninitialised-read checks on, precise floating point, the current quantize_mx scale rule."""
import os
import sys

# One BLAS thread per test process: `pytest -n auto` already runs one worker per core, and the
# simulator's many small float64 GEMMs run 2-6x slower when each worker also spawns BLAS threads
# (measured on the 2-core CI machine size). Must be set before numpy is first imported.
if "numpy" not in sys.modules:
    for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, "1")

import pytest

import nkilib  # noqa: F401  (installs the simulator as `nki` when the Neuron SDK is absent)

sys.path.insert(0, os.path.dirname(__file__))

_SIM_ENV = ("NEURON_PLATFORM_TARGET_OVERRIDE", "NKI_NC_VERSION", "NKI_PRECISE_FP", "NKILIB_SIM_STRICT",
            "NKILIB_QMX_SCALE_RULE", "NKI_SIMULATOR")


@pytest.fixture(autouse=True)
def _default_simulator_env(monkeypatch):
    for name in _SIM_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NKILIB_SIM_STRICT", "1")


@pytest.fixture
def set_target(monkeypatch):
    """Call set_target("trn2") / set_target("trn3") to choose the simulated NeuronCore."""

    def _set(name):
        monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", name)

    return _set


@pytest.fixture(params=["trn2", "trn3"])
def any_target(request, set_target):
    """Parametrise a test over both targets; yields the target name."""
    set_target(request.param)
    return request.param
