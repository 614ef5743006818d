"""trace.label_phases attaches phase labels to trace records without touching kernel code."""
import types

import numpy as np

import nki.isa as nisa
import nki.language as nl
from nkilib.simulator import run_kernel
from nkilib.simulator.trace import label_phases


def _load(src):
    t = nl.ndarray(src.shape, dtype=src.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=src)
    return t


def _store(t):
    out = nl.ndarray(t.shape, dtype=t.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=t)
    return out


module = types.ModuleType("phase_label_test_module")
module.load, module.store = _load, _store


def kernel(a):
    return module.store(module.load(a))


def test_label_phases_tags_records_and_restores_functions():
    a = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)
    with label_phases(module, {"load": "load-phase", "store": "store-phase"}):
        res = run_kernel(kernel, (a,), lnc=1, trace=True)
    phases = [r.attrs.get("phase") for r in res.trace]
    assert phases == ["load-phase", "store-phase"]
    assert module.load is _load and module.store is _store  # unpatched afterwards
    np.testing.assert_array_equal(res.outputs, a)
    res2 = run_kernel(kernel, (a,), lnc=1, trace=True)
    assert all("phase" not in r.attrs for r in res2.trace)
