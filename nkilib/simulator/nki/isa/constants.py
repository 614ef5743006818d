"""`nki.isa` enums (spec §5.12; values as published in 2.32)."""
import enum


class engine(enum.IntEnum):
    unknown = 0
    tensor = 1
    scalar = 2
    gpsimd = 3
    dma = 4
    vector = 5
    sync = 6


class reduce_cmd(enum.IntEnum):
    idle = 0
    reset = 1
    reduce = 2
    reset_reduce = 3
    load_reduce = 4


class dge_mode(enum.IntEnum):
    unknown = 0
    swdge = 1
    hwdge = 2
    none = 3


class oob_mode(enum.IntEnum):
    error = 0
    skip = 1


class matmul_perf_mode(str, enum.Enum):
    none = "none"
    double_row = "double_row"


# Kernels compare versions with <, >= and ints, so an IntEnum (spec §1.4 INFERRED).
class nc_version(enum.IntEnum):
    gen2 = 2
    gen3 = 3
    gen4 = 4


class dma_engine(enum.IntEnum):
    dma = 1
    gpsimd_dma = 2
