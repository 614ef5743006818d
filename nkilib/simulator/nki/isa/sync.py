"""Synchronisation and target queries: core_barrier, get_nc_version (spec §1.2, §1.4)."""
from __future__ import annotations

from ...tensor import NkiTensor
from . import constants as C
from ._common import NkiInstruction, ctx, fail, require_nc_version


def core_barrier(data, cores, engine=C.engine.gpsimd, name=None):
    """Both LNC2 cores block until both reach the barrier; `data` is the shared_hbm tensor they sync on."""
    instr = "core_barrier"
    require_nc_version(instr, 3)
    c = ctx()
    if c.num_programs != 2:
        fail(instr, f"is LNC2-only; this launch has {c.num_programs} program(s) (launch with kernel[2])")
    if tuple(cores) != (0, 1):
        fail(instr, f"cores must be (0, 1), got {tuple(cores)!r}")
    if not isinstance(data, NkiTensor) or data.storage.buffer_kind != "shared_hbm":
        where = data.storage.buffer_kind if isinstance(data, NkiTensor) else type(data).__name__
        fail(instr, f"data must be a shared_hbm tensor, got {where}")
    if not isinstance(engine, C.engine):
        fail(instr, f"engine must be an nisa.engine member, got {engine!r}")
    c.record(instr=instr, engine=engine.name, barrier=True)
    c.launch.barrier(c.program_id)
    return NkiInstruction(name)


def get_nc_version():
    """NeuronCore version of the target; outside a launch, of the target the environment selects."""
    from ... import runtime
    from ...settings import current_settings

    c = runtime.current(optional=True)
    target = c.target if c is not None else current_settings().target
    return C.nc_version(target.nc_version)


def get_nc_sub_version():
    return 0
