"""Running a kernel function on the simulator: argument conversion, launch, outputs.

`run_kernel` is the one entry used by `nki.simulate`, `NKI_SIMULATOR=1` plain calls and
nkilib's own tools (the cost model asks for `trace=True` and, for shape-only runs, `numerics=False`).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

from . import runtime
from .errors import NkiValidationError, UninitializedReadError
from .dtypes import as_nki_dtype
from .runtime import Launch
from .settings import current_settings
from .storage import Storage
from .tensor import NkiTensor, row_major


@dataclass
class RunResult:
    """Outputs plus what the launch observed."""

    outputs: object  # None, one array, or a tuple of arrays (same structure as the kernel's return)
    trace: list | None
    peak_bytes_per_partition: list = field(default_factory=list)  # per program: {"sbuf": n, "psum": n}
    target: str = ""
    lnc: int = 1


@dataclass(frozen=True)
class ShapeSpec:
    """A kernel input given only by shape and dtype, for shape-only runs (`numerics=False`).

    Lets the cost model run full model shapes without allocating host arrays; the tensor counts
    as fully written (like any kernel input). Inputs whose values the kernel reads into registers
    (integer index tables) are passed as numpy arrays instead: a shape-only run carries their values.
    """

    shape: tuple
    dtype: object


def _spec_tensor(spec: ShapeSpec, arg: str, buffer_kind: str, settings) -> NkiTensor:
    dtype = as_nki_dtype(spec.dtype, f"kernel argument '{arg}'")
    shape = tuple(int(s) for s in spec.shape) or (1,)
    st = Storage(shape, dtype, buffer_kind, arg, settings.precise_fp, False, -1)
    st.written = None  # every byte written (storage.py)
    return NkiTensor(st, dtype, shape, row_major(shape), 0)


# ---- host <-> simulator array conversion (numpy, and torch CPU tensors when torch is present) ----
def _is_torch(x) -> bool:
    mod = type(x).__module__
    return mod.startswith("torch") and hasattr(x, "detach")


_TORCH_VIEW = {"torch.bfloat16": ("int16", ml_dtypes.bfloat16),
               "torch.float8_e4m3fn": ("uint8", ml_dtypes.float8_e4m3fn),
               "torch.float8_e5m2": ("uint8", ml_dtypes.float8_e5m2)}


def _torch_to_numpy(t):
    import torch

    t = t.detach().cpu().contiguous()
    key = str(t.dtype)
    if key in _TORCH_VIEW:
        int_name, ml = _TORCH_VIEW[key]
        return t.view(getattr(torch, int_name)).numpy().view(ml)
    return t.numpy()


def _numpy_to_torch(a):
    import torch

    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    if a.dtype in (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2):
        name = "float8_e4m3fn" if a.dtype == ml_dtypes.float8_e4m3fn else "float8_e5m2"
        return torch.from_numpy(a.view(np.uint8).copy()).view(getattr(torch, name))
    return torch.from_numpy(np.ascontiguousarray(a))


def _input_tensor(arr: np.ndarray, arg: str, buffer_kind: str, settings, numerics: bool) -> NkiTensor:
    """An HBM input holding `arr`. In a shape-only run (numerics=False) float data is dropped, but an
    integer array keeps its values ("carried values": routing tables, offsets): instructions on carried
    values compute, and `register_load` reads them (docs/simulator.md#shape-only-runs-with-carried-integer-inputs)."""
    dtype = as_nki_dtype(arr.dtype, f"kernel argument '{arg}'")
    host = np.ascontiguousarray(arr)
    if dtype.category == "scale":
        host = host.view(np.uint8)
    init = host.astype(dtype.storage_np(settings.precise_fp), copy=False)
    shape = arr.shape if arr.ndim else (1,)
    carried = numerics or dtype.is_int
    st = Storage(shape, dtype, buffer_kind, arg, settings.precise_fp, carried, -1, init=init)
    st.host_array = arr
    return NkiTensor(st, dtype, shape, row_major(shape), 0)


def _to_output(value, inputs_by_storage, strict: bool, numerics: bool):
    if not isinstance(value, NkiTensor):
        raise NkiValidationError(f"kernel returned {type(value).__name__}; outputs must be NKI tensors")
    st = value.storage
    if st.buffer_kind != "shared_hbm" and st.id not in inputs_by_storage:
        raise NkiValidationError(
            f"kernel output '{value.name}' is in {st.buffer_kind}; outputs must be allocated with "
            "buffer=nl.shared_hbm (NKI 0.3.0+, "
            "https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/migration/index.html)")
    if strict:
        ok = value.written_elements()
        if not ok.all():
            raise UninitializedReadError(
                f"kernel output '{value.name}' has {int((~ok).sum())} of {ok.size} elements never written by the "
                "kernel")
    if not numerics:
        return None
    out = value._np().copy()
    if value.dtype.category == "scale":
        out = out.view(ml_dtypes.float8_e8m0fnu)
    return out


def _structure(ret):
    if ret is None:
        return ()
    if isinstance(ret, (tuple, list)):
        return tuple(ret)
    return (ret,)


def run_kernel(fn, args=(), kwargs=None, lnc: int = 1, grid_ndim: int = 1, trace: bool = False,
               numerics: bool = True, check_races: bool = True) -> RunResult:
    """Launch `fn` over `lnc` programs with numpy/torch inputs; see RunResult.

    `check_races=False` skips the LNC2 shared-HBM race bookkeeping (runtime.Launch.note_access: two byte
    masks per program per shared tensor). Only for shape-only cost runs of kernels whose race freedom is
    tested by numerics runs: at MoE model shapes those masks alone exceed the memory of a CI machine.
    """
    kwargs = dict(kwargs or {})
    if runtime.current(optional=True) is not None:
        # a nested launch would replace, then clear, the running program's context
        raise NkiValidationError(
            f"kernel {getattr(fn, '__name__', fn)}: nki.simulate / run_kernel called from inside a running kernel; "
            "call sub-kernels as plain functions "
            "(https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/migration/index.html)")
    if isinstance(lnc, bool) or not isinstance(lnc, int) or lnc not in (1, 2):
        raise NkiValidationError(
            f"LNC degree must be 1 or 2 on Trn2/Trn3, got {lnc!r} "
            "(https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/get-started/about/lnc.html)")
    settings = current_settings()
    buffer_kind = "shared_hbm" if lnc > 1 else "private_hbm"
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"kernel {getattr(fn, '__name__', fn)}: {e}") from None
    use_torch = False
    inputs_by_storage = {}

    def convert(name, value):
        nonlocal use_torch
        if _is_torch(value):
            use_torch = True
            value = _torch_to_numpy(value)
        if isinstance(value, ShapeSpec):
            if numerics:
                raise NkiValidationError(f"kernel argument '{name}': ShapeSpec inputs need numerics=False "
                                         "(shape-only run)")
            t = _spec_tensor(value, name, buffer_kind, settings)
            inputs_by_storage[t.storage.id] = t.storage
            return t
        if isinstance(value, np.ndarray):
            t = _input_tensor(value, name, buffer_kind, settings, numerics)
            inputs_by_storage[t.storage.id] = t.storage
            return t
        if isinstance(value, tuple):
            return tuple(convert(f"{name}[{i}]", v) for i, v in enumerate(value))
        return value

    call_args = {name: convert(name, v) for name, v in bound.arguments.items()}
    bound.arguments.update(call_args)
    launch = Launch(lnc, grid_ndim, settings, numerics=numerics, trace=trace, check_races=check_races)
    results = launch.run(lambda: fn(*bound.args, **bound.kwargs))
    outs = [_structure(r) for r in results]
    ids0 = [getattr(o, "storage", None) and o.storage.id for o in outs[0]]
    for p, o in enumerate(outs[1:], start=1):
        if [getattr(x, "storage", None) and x.storage.id for x in o] != ids0:
            raise NkiValidationError(f"LNC programs 0 and {p} returned different output tensors")
    converted = tuple(_to_output(v, inputs_by_storage, settings.strict, numerics) for v in outs[0])
    # write back inputs the kernel modified in place (official simulator behaviour,
    # https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/guides/nki_simulator.html)
    if numerics:
        for st in inputs_by_storage.values():
            host = st.host_array
            if st.modified and isinstance(host, np.ndarray) and host.flags.writeable:
                vals = st.data.view(st.np_dtype).reshape(host.shape)
                if st.dtype.category == "scale":
                    host.view(np.uint8)[...] = vals
                else:
                    host[...] = vals.astype(host.dtype, copy=False)
    if use_torch and numerics:
        converted = tuple(_numpy_to_torch(a) for a in converted)
    ret = results[0]
    if ret is None:
        outputs = None
    elif isinstance(ret, (tuple, list)):
        outputs = tuple(converted)
    else:
        outputs = converted[0]
    return RunResult(outputs=outputs, trace=launch.trace,
                     peak_bytes_per_partition=[dict(c.memory.peak) for c in launch.contexts],
                     target=settings.target.name, lnc=lnc)
