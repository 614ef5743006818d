"""Test helpers shared by all test files (import as `from simkit import ...`)."""
from __future__ import annotations

import ml_dtypes
import numpy as np

import nki

BF16 = ml_dtypes.bfloat16


def simulate(kernel, lnc=1, **inputs):
    """Run a kernel the official way: nki.simulate(kernel)[lnc](**inputs)."""
    return nki.simulate(kernel)[lnc](**inputs)


def rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def randn(seed: int, shape, dtype=np.float32, scale=1.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32).astype(dtype)


def sbuf_load(src, dtype=None):
    """Inside a kernel: DMA an HBM tensor [P, F...] into a new SBUF tile (dtype converts via the DMA)."""
    import nki.isa as nisa
    import nki.language as nl

    tile = nl.ndarray(src.shape, dtype or src.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=src)
    return tile


def hbm_store(tile, dtype=None):
    """Inside a kernel: DMA an SBUF tile into a new shared_hbm output tensor and return it."""
    import nki.isa as nisa
    import nki.language as nl

    out = nl.ndarray(tile.shape, dtype or tile.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=tile)
    return out


def bits(a: np.ndarray) -> np.ndarray:
    """Raw bit pattern of an array (unsigned int of the same itemsize), for bit-exact comparisons."""
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def in_kernel(body):
    """Run `body()` inside a simulated LNC1 launch (for view/allocation checks); returns its result as is."""
    result = []

    def kernel():
        result.append(body())

    nki.simulate(kernel)()
    return result[0]


def run_tiles(body, inputs=(), outputs=(), psum_inputs=(), trace=False):
    """Run `body(*in_tiles, *out_tiles)` inside an LNC1 kernel and return the output arrays.

    Each input array is DMA'd into an SBUF tile (then copied into a PSUM tile if its index is in
    `psum_inputs`). `outputs` are (shape, dtype) or (shape, dtype, "psum") specs of fresh tiles that
    `body` writes; they go back to shared_hbm (PSUM via an SBUF tensor_copy) and are returned as a
    tuple of arrays. With trace=True returns (outputs, trace records of `body`'s instructions only).
    """
    import nki.isa as nisa
    import nki.language as nl
    from nkilib.simulator import runtime
    from nkilib.simulator.launcher import run_kernel

    span = {}

    def kernel(ins):
        tiles = []
        for i, t in enumerate(ins):
            tile = sbuf_load(t)
            if i in psum_inputs:
                ps = nl.ndarray(t.shape, t.dtype, buffer=nl.psum)
                nisa.tensor_copy(dst=ps, src=tile)
                tile = ps
            tiles.append(tile)
        outs = [nl.ndarray(s[0], s[1], buffer=nl.psum if len(s) > 2 and s[2] == "psum" else nl.sbuf)
                for s in outputs]
        ctx = runtime.current()
        span["start"] = len(ctx.trace or ())
        body(*tiles, *outs)
        span["end"] = len(ctx.trace or ())
        results = []
        for o in outs:
            if o.buffer == nl.psum:
                sb = nl.ndarray(o.shape, o.dtype, buffer=nl.sbuf)
                nisa.tensor_copy(dst=sb, src=o)
                o = sb
            results.append(hbm_store(o))
        return tuple(results)

    res = run_kernel(kernel, args=(tuple(inputs),), trace=trace)
    if trace:
        return res.outputs, res.trace[span["start"]:span["end"]]
    return res.outputs


def oversized_tile(shape, dtype, buffer="sbuf"):
    """Inside a kernel: an initialised on-chip tile with more partitions than the hardware has, built
    behind nl.ndarray's back (which rejects it) so tests can check that instructions reject it too."""
    from nkilib.simulator import runtime
    from nkilib.simulator.dtypes import as_nki_dtype
    from nkilib.simulator.tensor import NkiTensor, Storage

    ctx = runtime.current()
    dt = as_nki_dtype(dtype)
    init = np.zeros(shape, dt.storage_np(ctx.settings.precise_fp))
    st = Storage(shape, dt, buffer, "oversized", ctx.settings.precise_fp, ctx.numerics, ctx.program_id, init=init)
    strides = [int(np.prod(shape[i + 1:])) for i in range(len(shape))]
    return NkiTensor(st, dt, shape, strides, 0)
