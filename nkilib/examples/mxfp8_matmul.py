"""End-to-end MXFP8 matmul on NeuronCore-v4: C[M, N] = A[M, K] @ B[K, N] with on-chip quantization.

Both bf16 operands are quantized on chip with `nisa.quantize_mx` (OCP-contiguous "1x32" groups
along K, float8_e4m3fn elements, E8M0 scales) and multiplied with `nisa.nc_matmul_mx`, accumulating
the K tiles in one fp32 PSUM tile per output tile.

SBUF layout of one K tile (nki.isa.quantize_mx / nc_matmul_mx docs, docs/simulator.md): a K tile of
T <= 512 logical rows lives on kp = T / 4 partitions; partition p, packed slot j holds logical row
k = k0 + 4p + j ("1x32", `nkilib.mx.k_index`). Loaded in this interleaved layout, the quantize_mx group
(8 partitions x 4 consecutive free elements) is exactly 32 consecutive logical K rows, so the
result equals `nkilib.mx.quantize_mx(x, axis=K, scheme="1x32")` and `nkilib.mx.mx_matmul`.

* A [M, K] row-major is brought to K-major form by one 3-D `dma_transpose` per [128 x T] tile:
  the source access pattern [[1, 4], [K, 128], [4, kp]] reads A[m0 + m, k0 + 4p + j] as
  [j, m, p], and the transpose writes it as [p, m, j] (axes (2, 1, 0):
  https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.dma_transpose.html).
* B [K, N] is DMA'd with contiguous rows as [p, j, n] (k = 4p + j), then re-ordered on chip to
  [p, n, j] with a strided `tensor_copy` (the deep-dive's `copy_data_strided` approach; an
  element-granular DMA would also work but moves 2-byte runs).

Schedule: B is quantized once per "B panel" of columns kept resident in SBUF (the whole N when it
fits the panel budget, else multiples of 512 columns); for each M tile of 128 rows the A row
panel is quantized once (all K tiles), then every 512-column block of the panel is computed as
sum over K tiles of nc_matmul_mx into one PSUM bank, evicted to an fp32 SBUF tile and stored.
Under LNC2 the M tiles are split between the two programs (tile i goes to program i % 2); each
program quantizes the B panels itself (no SBUF sharing between physical cores).

Shapes: M % 128 == 0 and K % 128 == 0. K is cut into 512-row tiles; the remainder tile
(128, 256 or 384 rows -> 32, 64 or 96 partitions) is handled (quantize_mx accepts
P in {32, 64, 96, 128}, nc_matmul_mx K in multiples of 32). N is cut into 512-column blocks plus
a remainder (any N >= 1 works; multiples of 128 are the intended use).

References:
    https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.quantize_mx.html
    https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.nc_matmul_mx.html
    https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/deep-dives/mxfp-matmul.html
"""
from __future__ import annotations

import nki
import nki.isa as nisa
import nki.language as nl

M_TILE = 128  # nc_matmul_mx stationary free size (output partitions)
K_TILE = 512  # logical K per nc_matmul_mx: 128 partitions x 4 packed elements
N_TILE = 512  # one 2 KiB PSUM bank of fp32
# SBUF bytes per partition for the resident quantized B panel (x4 data + scales): 96 KiB of the
# 256 KiB NC-v4 partition, leaving room for staging tiles and the A row panel.
B_PANEL_BYTES = 96 * 1024
ELEM_DTYPE = nl.float8_e4m3fn_x4


def _k_tiles(K):
    """[(k0, rows)] of the K tiling: 512-row tiles plus a 128/256/384-row remainder."""
    return [(k0, min(K_TILE, K - k0)) for k0 in range(0, K, K_TILE)]


def _panel_cols(K, N):
    """Columns of B kept quantized in SBUF at once (a multiple of N_TILE, or all of N)."""
    per_col = 5 * len(_k_tiles(K))  # per K tile: one x4 word + one scale byte per column and partition
    cols = max(N_TILE, (B_PANEL_BYTES // per_col) // N_TILE * N_TILE)
    return min(N, cols)


def _quantize_b_panel(b, n0, cols, k_tiles):
    """Quantize B[:, n0:n0+cols] tile by tile; returns [(data [kp, cols] x4, scale [kp, cols] u8)]."""
    N = b.shape[1]
    panel = []
    for k0, rows in k_tiles:
        kp = rows // 4
        # contiguous rows: stage[p, j, n] = B[k0 + 4p + j, n0 + n]
        stage = nl.ndarray((kp, 4, cols), b.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=stage, src=b.ap([[4 * N, kp], [N, 4], [1, cols]], offset=k0 * N + n0))
        # interleave on chip: il[p, n, j] = stage[p, j, n] -> quantize groups = 32 consecutive k
        il = nl.ndarray((kp, cols, 4), b.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=il, src=stage.permute((0, 2, 1)))
        q = nl.ndarray((kp, cols), ELEM_DTYPE, buffer=nl.sbuf)
        s = nl.ndarray((kp, cols), nl.uint8, buffer=nl.sbuf)
        nisa.quantize_mx(dst=q, src=il, dst_scale=s)
        panel.append((q, s))
    return panel


def _quantize_a_rows(a, m0, k_tiles):
    """Quantize A[m0:m0+128, :] K tile by K tile; returns [(data [kp, 128] x4, scale [kp, 128] u8)]."""
    K = a.shape[1]
    rows_q = []
    for k0, rows in k_tiles:
        kp = rows // 4
        # il[p, m, j] = A[m0 + m, k0 + 4p + j]: source pattern [j, m, p], 3-D transpose (2, 1, 0)
        il = nl.ndarray((kp, M_TILE, 4), a.dtype, buffer=nl.sbuf)
        nisa.dma_transpose(dst=il, src=a.ap([[1, 4], [K, M_TILE], [4, kp]], offset=m0 * K + k0))
        q = nl.ndarray((kp, M_TILE), ELEM_DTYPE, buffer=nl.sbuf)
        s = nl.ndarray((kp, M_TILE), nl.uint8, buffer=nl.sbuf)
        nisa.quantize_mx(dst=q, src=il, dst_scale=s)
        rows_q.append((q, s))
    return rows_q


@nki.jit
def mxfp8_matmul_kernel(a, b):
    """C = A @ B with MXFP8 (e4m3fn, 1x32 groups along K) quantization on chip.

    Args:
        a: HBM bfloat16 (or float16) [M, K], row-major; M % 128 == 0, K % 128 == 0.
        b: HBM bfloat16 (or float16) [K, N].

    Returns:
        shared_hbm float32 [M, N].
    """
    M, K = a.shape
    K2, N = b.shape
    assert K == K2, f"contraction mismatch: a is [{M}, {K}], b is [{K2}, {N}]"
    assert M % M_TILE == 0, f"M={M} must be a multiple of {M_TILE}"
    assert K % 128 == 0, f"K={K} must be a multiple of 128 (quantize_mx needs 32-partition multiples)"
    assert a.dtype in (nl.bfloat16, nl.float16) and b.dtype in (nl.bfloat16, nl.float16), (a.dtype, b.dtype)
    out = nl.ndarray((M, N), nl.float32, buffer=nl.shared_hbm)
    k_tiles = _k_tiles(K)
    pid = nl.program_id(0)
    nprog = nl.num_programs(0)
    panel_cols = _panel_cols(K, N)
    for p0 in range(0, N, panel_cols):
        cols = min(panel_cols, N - p0)
        b_panel = _quantize_b_panel(b, p0, cols, k_tiles)
        for mi in range(pid, M // M_TILE, nprog):  # LNC2: M tiles alternate between programs
            m0 = mi * M_TILE
            a_rows = _quantize_a_rows(a, m0, k_tiles)
            for c0 in range(0, cols, N_TILE):
                nt = min(N_TILE, cols - c0)
                acc = nl.ndarray((M_TILE, nt), nl.float32, buffer=nl.psum)
                for t, (k0, rows) in enumerate(k_tiles):
                    (aq, a_s), (bq, b_s) = a_rows[t], b_panel[t]
                    # K=rows (<= 512: rows/4 partitions x 4 packed), M=128, N=nt (<= 512)
                    nisa.nc_matmul_mx(dst=acc, stationary=aq, moving=bq[:, c0:c0 + nt],
                                      stationary_scale=a_s, moving_scale=b_s[:, c0:c0 + nt])
                res = nl.ndarray((M_TILE, nt), nl.float32, buffer=nl.sbuf)
                nisa.tensor_copy(dst=res, src=acc)
                nisa.dma_copy(dst=out[m0:m0 + M_TILE, p0 + c0:p0 + c0 + nt], src=res)
    return out


# ------------------------------------------------------------------------------------------------
# host side
# ------------------------------------------------------------------------------------------------

def reference(a, b, scale_rule="neuron"):
    """MX reference of the kernel: nkilib.mx.mx_matmul of the same "1x32" e4m3fn quantization.

    Args:
        a: [M, K] bf16/fp16 array; b: [K, N].
        scale_rule: quantize_mx scale rule ("neuron" = SDK 2.31+, "ocp_floor" = SDK <= 2.30).

    Returns:
        float32 [M, N].
    """
    from .. import mx

    qa = mx.quantize_mx(a, axis=1, elem_format="float8_e4m3fn", scale_rule=scale_rule, scheme="1x32")
    qb = mx.quantize_mx(b, axis=0, elem_format="float8_e4m3fn", scale_rule=scale_rule, scheme="1x32")
    return mx.mx_matmul(qa, qb, k_tile=K_TILE)


def errors(got, ref):
    """(max |got - ref|, ||got - ref||_F / ||ref||_F)."""
    import numpy as np

    d = got.astype(np.float64) - ref.astype(np.float64)
    return float(np.abs(d).max()), float(np.linalg.norm(d) / np.linalg.norm(ref.astype(np.float64)))


def make_inputs(M, K, N, seed=0):
    """Seeded bf16 inputs a [M, K], b [K, N] (standard normal)."""
    import ml_dtypes
    import numpy as np

    g = np.random.default_rng(seed)
    a = g.standard_normal((M, K), dtype=np.float32).astype(ml_dtypes.bfloat16)
    b = g.standard_normal((K, N), dtype=np.float32).astype(ml_dtypes.bfloat16)
    return a, b


def main(M=256, K=1024, N=512, lnc=2):
    """Run the kernel on the simulator for a small shape and print its errors."""
    import os

    import numpy as np

    a, b = make_inputs(M, K, N)
    out = nki.simulate(mxfp8_matmul_kernel)[lnc](a=a, b=b)
    rule = os.environ.get("NKILIB_QMX_SCALE_RULE", "neuron")
    ref_mx = reference(a, b, rule)
    ref_fp32 = a.astype(np.float32) @ b.astype(np.float32)
    print(f"mxfp8_matmul [{M}, {K}] x [{K}, {N}], LNC{lnc}, scale rule {rule}")
    for label, ref in (("vs MX reference (mx_matmul)", ref_mx), ("vs fp32 matmul", ref_fp32)):
        mx_abs, rel = errors(out, ref)
        print(f"  {label:30s} max abs {mx_abs:.3e}   rel Frobenius {rel:.3e}")
    return out, ref_mx, ref_fp32


if __name__ == "__main__":
    main()
