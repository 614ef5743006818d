"""Synchronisation and target queries: core_barrier, get_nc_version.

References:
    https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.0/nki/api/generated/nki.isa.core_barrier.html
    https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.get_nc_version.html
"""
from __future__ import annotations

from ...tensor import NkiTensor
from . import constants as C
from ._common import NkiInstruction, ctx, fail, require_nc_version


def core_barrier(data, cores, engine=C.engine.gpsimd, name=None):
    """Both cores block until both reach the barrier; `data` is the shared_hbm tensor they sync on.

    LNC degree: the 2.33 page says cores=(0, 1) "applies at LNC degree 1 and 2" (at LNC1 the two physical
    cores of an HBM stack run separate kernels); older pages said "only ... when LNC is enabled". We follow
    the newest: under LNC1 the call is validated and recorded, and there is no second program in this
    launch to wait for, so it returns at once (docs/simulator.md#choice-core-barrier-lnc1).
    """
    instr = "core_barrier"
    require_nc_version(instr, 3)
    c = ctx()
    if tuple(cores) != (0, 1):
        fail(instr, f"cores must be (0, 1), got {tuple(cores)!r}")
    if not isinstance(data, NkiTensor) or data.storage.buffer_kind != "shared_hbm":
        where = data.storage.buffer_kind if isinstance(data, NkiTensor) else type(data).__name__
        fail(instr, f"data must be a shared_hbm tensor, got {where}")
    if not isinstance(engine, C.engine):
        fail(instr, f"engine must be an nisa.engine member, got {engine!r}")
    c.record(instr=instr, engine=engine.name, barrier=True)
    if c.num_programs > 1:
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
