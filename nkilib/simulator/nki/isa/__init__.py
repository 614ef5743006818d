"""Simulated `nki.isa` (2.32 API: https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/nki.isa.html).

One implementation per instruction, grouped by engine/topic in private submodules; only documented
names are public. Documented instructions that are not simulated resolve (module `__getattr__`) to a
stub that raises "not simulated" when called, never an AttributeError (README, "Simulator limits").
"""
from ...errors import NkiValidationError  # noqa: F401
from ...errors import not_simulated_stub as _not_simulated_stub
from ._common import NkiInstruction  # noqa: F401
from .constants import dge_mode, dma_engine, engine, matmul_perf_mode, nc_version, oob_mode, reduce_cmd  # noqa: F401
from .activation import activation, activation_reduce  # noqa: F401
from .copy import memset, tensor_copy  # noqa: F401
from .dma import dma_copy, dma_transpose  # noqa: F401
from .dma_compute import dma_compute  # noqa: F401
from .exchange import sendrecv  # noqa: F401
from .elementwise import iota, reciprocal, scalar_tensor_tensor, tensor_scalar, tensor_tensor  # noqa: F401
from .matmul import nc_matmul  # noqa: F401
from .reduce import tensor_reduce  # noqa: F401
from .mx import nc_matmul_mx, quantize_mx  # noqa: F401
from .registers import VirtualRegister, register_alloc, register_load, register_move, register_store  # noqa: F401
from .sync import core_barrier, get_nc_sub_version, get_nc_version  # noqa: F401
from .transpose import nc_transpose  # noqa: F401

# deprecated engine aliases still used by nki-library (listed in the 2.32 nki.isa API)
tensor_engine = engine.tensor
vector_engine = engine.vector
scalar_engine = engine.scalar
gpsimd_engine = engine.gpsimd
unknown_engine = engine.unknown


# Documented in the 2.32 nki.isa API but not simulated here (full list: the 2.32 nki.isa index above;
# docs/simulator.md#not-simulated lists the same names).
_NOT_SIMULATED = frozenset({
    "activate2", "tensor_partition_reduce", "tensor_tensor_scan", "tensor_scalar_reduce", "tensor_scalar_cumulative",
    "tensor_copy_predicated", "exponential", "dropout", "affine_select", "range_select", "select_reduce",
    "sequence_bounds", "bn_stats", "bn_aggr", "local_gather", "nc_n_gather", "max8", "nc_find_index8",
    "nc_match_replace8", "nc_stream_shuffle", "rng", "rand2", "rand_set_state", "rand_get_state",
    "set_rng_seed", "nonzero_with_count", "topk",
})


def __getattr__(name):
    if name in _NOT_SIMULATED:
        return _not_simulated_stub(f"nisa.{name}", "nki.isa")
    raise AttributeError(f"module 'nki.isa' has no attribute {name!r}")


def _drop_submodule_names():
    """The engine submodules (copy, dma, mx, ...) are implementation files, not documented names;
    `constants` stays (documented: `from nki.isa.constants import oob_mode`)."""
    import types

    for key, value in list(globals().items()):
        if isinstance(value, types.ModuleType) and not key.startswith("_") and key != "constants":
            del globals()[key]


_drop_submodule_names()
