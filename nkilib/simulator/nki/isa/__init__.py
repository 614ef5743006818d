"""Simulated `nki.isa` (spec §5). One implementation per instruction, grouped by engine/topic."""
from ...errors import NkiValidationError  # noqa: F401
from ._common import NkiInstruction  # noqa: F401
from .constants import dge_mode, dma_engine, engine, matmul_perf_mode, nc_version, oob_mode, reduce_cmd  # noqa: F401
from .activation import activation, activation_reduce  # noqa: F401
from .copy import memset, tensor_copy  # noqa: F401
from .dma import dma_copy, dma_transpose  # noqa: F401
from .dma_compute import dma_compute  # noqa: F401
from .elementwise import iota, reciprocal, scalar_tensor_tensor, tensor_scalar, tensor_tensor  # noqa: F401
from .matmul import nc_matmul  # noqa: F401
from .reduce import tensor_reduce  # noqa: F401
from .mx import nc_matmul_mx, quantize_mx  # noqa: F401
from .registers import VirtualRegister, register_alloc, register_load, register_move, register_store  # noqa: F401
from .sync import core_barrier, get_nc_sub_version, get_nc_version  # noqa: F401
from .transpose import nc_transpose  # noqa: F401

# deprecated engine aliases still used by nki-library (spec §5.12)
tensor_engine = engine.tensor
vector_engine = engine.vector
scalar_engine = engine.scalar
gpsimd_engine = engine.gpsimd
unknown_engine = engine.unknown
