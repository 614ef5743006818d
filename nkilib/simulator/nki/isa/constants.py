"""`nki.isa` enums, as published in the 2.32 API (member values preserved).

The 2.32 API declares every one of them as a plain `enum.Enum`
(https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/nki.isa.html, e.g.
https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.nc_version.html),
so kernels may compare members with `==` / `!=` only: `nisa.get_nc_version() >= nisa.nc_version.gen4`,
`int(nisa.dge_mode.hwdge)` or `nisa.engine.vector == 5` fail (or are False) here as they do on the real
toolchain. Raw integers are rejected for enum parameters since NKI 0.3.0
(https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/migration/index.html,
"Integer enum constants no longer supported").
"""
import enum


class engine(enum.Enum):
    unknown = 0
    tensor = 1
    scalar = 2
    gpsimd = 3
    dma = 4
    vector = 5
    sync = 6


class reduce_cmd(enum.Enum):
    idle = 0
    reset = 1
    reduce = 2
    reset_reduce = 3
    load_reduce = 4


class dge_mode(enum.Enum):
    unknown = 0
    swdge = 1
    hwdge = 2
    none = 3


class oob_mode(enum.Enum):
    error = 0
    skip = 1


class matmul_perf_mode(enum.Enum):
    none = "none"
    double_row = "double_row"


class nc_version(enum.Enum):
    gen2 = 2
    gen3 = 3
    gen4 = 4


class dma_engine(enum.Enum):
    dma = 1
    gpsimd_dma = 2
