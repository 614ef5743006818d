"""BF16 tiled matmul NKI kernel: C[M, N] = A[M, K] @ B[K, N] (bf16 in HBM, fp32 PSUM accumulation).

This is the kernel the cost model is calibrated with (simulations/calibrate_bf16_gemm.py,
`predict_bf16_gemm_time` below). It is plain NKI (runs unchanged on the simulator).

Layout of A (`a_layout`):
- ``"km"`` (default): the caller passes A already K-major, ``a`` = A^T with shape [K, M]. TensorE
  contracts over the partition dim, so stationary tiles must be [K, M]; with A^T in HBM they are plain
  `dma_copy` loads. This is the layout the calibration models: the measured torch.matmul leaves the
  operand layout to the compiler and its times show no transpose cost (nc_matmul computes
  "stationary.T @ moving":
  https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.nc_matmul.html).
- ``"mk"``: ``a`` = A with shape [M, K]; each [M_tile, K_tile] block is loaded transposed with
  `nisa.dma_transpose` (2-byte dtype, dst in SBUF:
  https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.dma_transpose.html).

Tiling (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.nc_matmul.html,
https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/nki.language.tile_size.html):
K tiles of 128 partitions, M tiles of 128 (stationary free size),
N tiles of 512 (moving free size = one 2 KiB fp32 PSUM bank). An *M block* of up to 4 M tiles keeps
its whole A^T panel [K, <=512] resident in SBUF, so every B tile [128, 512] loaded from HBM feeds up to
4 matmuls (B traffic = K*N*2 bytes per M block). The PSUM accumulators of one N tile (one bank per M
tile) are evicted to bf16 SBUF tiles alternately by VectorE and ScalarE, and stored to HBM in chunks of
up to 2048 columns (4 KiB contiguous per partition, the DMA full-rate payload:
https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/deep-dives/nki-dma-bandwidth-guide.html).

LNC2: the M tiles are split into contiguous halves across the two programs; when there are fewer than
two M tiles the N range is split instead. Partial tiles (M, K, N not multiples of 128/512) are handled.
"""
from __future__ import annotations

import nki
import nki.isa as nisa
import nki.language as nl

TILE_K = 128  # contraction tile: partition dim of stationary and moving (pmax)
TILE_M = 128  # stationary free size (gemm_stationary_fmax)
TILE_N = 512  # moving free size: one fp32 PSUM bank (gemm_moving_fmax)
STORE_N = 2048  # output store chunk: 4 KiB bf16 per partition
MAX_M_BLOCK = 4  # M tiles sharing one B tile (PSUM: 4 banks live + 4 being evicted = 8 banks)
SBUF_RESERVE = 48 * 1024  # per-partition bytes left for B tiles and output chunks (double-buffered)


def _ceil_div(a, b):
    return (a + b - 1) // b


def _split(n_items, n_prog, prog):
    """Contiguous share [lo, hi) of n_items for program `prog` (first programs get the remainder)."""
    base, rem = divmod(n_items, n_prog)
    lo = prog * base + min(prog, rem)
    return lo, lo + base + (1 if prog < rem else 0)


def bf16_matmul(a, b, a_layout="km"):
    """C = A @ B with A given as A^T [K, M] (a_layout="km") or A [M, K] (a_layout="mk"); B [K, N].

    Returns C [M, N] bf16 in shared HBM.
    """
    if a_layout == "km":
        K, M = a.shape
    elif a_layout == "mk":
        M, K = a.shape
    else:
        raise ValueError(f"bf16_matmul: a_layout must be 'km' or 'mk', got {a_layout!r}")
    K2, N = b.shape
    if K2 != K:
        raise ValueError(f"bf16_matmul: contraction sizes differ: A has K={K}, B has K={K2}")
    c = nl.ndarray((M, N), dtype=nl.bfloat16, buffer=nl.shared_hbm, name="c")

    if nl.program_ndim() == 0:
        n_prog, prog = 1, 0
    else:
        n_prog, prog = nl.num_programs(axes=0), nl.program_id(axis=0)
    m_tiles, k_tiles = _ceil_div(M, TILE_M), _ceil_div(K, TILE_K)
    if m_tiles >= n_prog:
        mt_lo, mt_hi = _split(m_tiles, n_prog, prog)
        n_lo, n_hi = 0, N
    else:
        mt_lo, mt_hi = 0, m_tiles
        nt_lo, nt_hi = _split(_ceil_div(N, TILE_N), n_prog, prog)
        n_lo, n_hi = nt_lo * TILE_N, min(N, nt_hi * TILE_N)

    # M block size: as many M tiles as fit their A^T panel [K, 128] (2 bytes x k_tiles x 128 per partition),
    # twice (the next block's panel loads while this one computes)
    panel_bytes = k_tiles * TILE_M * 2
    budget = nl.tile_size.sbuf_fmax_bytes - SBUF_RESERVE
    m_block = max(1, min(MAX_M_BLOCK, budget // (2 * panel_bytes)))
    if 2 * panel_bytes > budget:
        raise ValueError(f"bf16_matmul: K={K} too large for a double-buffered SBUF A^T panel "
                         f"(max K {budget // (4 * TILE_M) // TILE_K * TILE_K})")

    for mb0 in range(mt_lo, mt_hi, m_block):
        mts = list(range(mb0, min(mb0 + m_block, mt_hi)))
        m0 = mb0 * TILE_M
        bm = min(M, (mts[-1] + 1) * TILE_M) - m0
        msz = [min(TILE_M, M - t * TILE_M) for t in mts]
        # A^T panel of this M block: a_t[k, kt, m] = A[m0 + m, kt * 128 + k]
        a_t = nl.ndarray((TILE_K, k_tiles, bm), dtype=nl.bfloat16, buffer=nl.sbuf, name="a_t")
        for kt in range(k_tiles):
            k0 = kt * TILE_K
            ksz = min(TILE_K, K - k0)
            if a_layout == "km":
                nisa.dma_copy(dst=a_t[0:ksz, kt, 0:bm], src=a[k0:k0 + ksz, m0:m0 + bm])
            else:
                nisa.dma_transpose(dst=a_t[0:ksz, kt, 0:bm], src=a[m0:m0 + bm, k0:k0 + ksz])

        for nc0 in range(n_lo, n_hi, STORE_N):
            ncsz = min(STORE_N, n_hi - nc0)
            outs = [nl.ndarray((TILE_M, ncsz), dtype=nl.bfloat16, buffer=nl.sbuf, name="c_sb") for _ in mts]
            for n0 in range(nc0, nc0 + ncsz, TILE_N):
                nsz = min(TILE_N, nc0 + ncsz - n0)
                acc = [nl.ndarray((TILE_M, nsz), dtype=nl.float32, buffer=nl.psum, name="acc") for _ in mts]
                for kt in range(k_tiles):
                    k0 = kt * TILE_K
                    ksz = min(TILE_K, K - k0)
                    b_sb = nl.ndarray((TILE_K, nsz), dtype=nl.bfloat16, buffer=nl.sbuf, name="b_sb")
                    nisa.dma_copy(dst=b_sb[0:ksz, :], src=b[k0:k0 + ksz, n0:n0 + nsz])
                    for j in range(len(mts)):
                        col = j * TILE_M
                        # first matmul into a fresh PSUM tile overwrites, later ones accumulate
                        # (docs/simulator.md#choice-psum-accumulate)
                        nisa.nc_matmul(dst=acc[j][0:msz[j], :], stationary=a_t[0:ksz, kt, col:col + msz[j]],
                                       moving=b_sb[0:ksz, :])
                for j in range(len(mts)):
                    # alternate the PSUM eviction between VectorE and ScalarE so neither limits small-K shapes
                    eng = nisa.engine.vector if (j + n0 // TILE_N) % 2 == 0 else nisa.engine.scalar
                    nisa.tensor_copy(dst=outs[j][0:msz[j], n0 - nc0:n0 - nc0 + nsz], src=acc[j][0:msz[j], :],
                                     engine=eng)
            for j, t in enumerate(mts):
                r0 = t * TILE_M
                nisa.dma_copy(dst=c[r0:r0 + msz[j], nc0:nc0 + ncsz], src=outs[j][0:msz[j], :])
    return c


bf16_matmul_kernel = nki.jit(bf16_matmul)


def predict_bf16_gemm_time_report(M: int, K: int, N: int, lnc: int = 2, target: str = "trn3"):
    """CostReport of this kernel for C[M,N] = A[M,K] @ B[K,N] (A given K-major; shape-only simulator run)."""
    import ml_dtypes

    from ..simulator.cost import model_kernel  # lazy: only the cost model needs the simulator here
    from ..simulator.launcher import ShapeSpec

    bf16 = ml_dtypes.bfloat16
    return model_kernel(bf16_matmul, (ShapeSpec((K, M), bf16), ShapeSpec((K, N), bf16)), lnc=lnc, target=target,
                        model_flops=2.0 * M * K * N, precision="bf16")


def predict_bf16_gemm_time(M: int, K: int, N: int, lnc: int = 2, target: str = "trn3") -> float:
    """Modeled time (seconds) of C[M,N] = A[M,K] @ B[K,N] in BF16 with this kernel.

    Includes the calibrated per-call launch overhead. Compare with new measurements via
    simulations/calibrate_bf16_gemm.py.
    """
    return predict_bf16_gemm_time_report(M, K, N, lnc=lnc, target=target).modeled_time_s
