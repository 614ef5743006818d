"""Constants of the MLP backward kernels, in one place: the shared matmul layer's geometry, accepted
numeric choices and budgets (defined in nkilib/core/matmul/constants.py, re-exported here) and this
kernel's own tiling defaults."""

from ....core.matmul.constants import (  # noqa: F401  (re-exported for the kernel, references and torch layer)
    BF16_K_TILE, FP8_X4_DTYPE_NAMES, M_TILE, MATMUL_PRECISIONS, MX_GROUP, MX_K_ALIGN, MX_K_TILE, MX_PACK, N_TILE,
    PARTITIONS, PSUM_BANK_BYTES, PSUM_BUFFERS, PSUM_BYTES, QUANT_SCHEMES, SCALE_PACK_SLOTS, SCALE_PACK_STRIDE,
    SPLIT_ALIGN, TRANSPOSE_PSUM_BANKS,
)

MX_N_TILE = 1024  # default moving width for MXFP8 on trn3 (2 PSUM banks; double-buffered = 4 of 8)
MX_N_TILE_WEIGHT_GRAD = 2048  # phases 3-4 (no PE transposes): 2 x 8 KiB accumulators = all of PSUM
WEIGHT_GRAD_WIDE_MIN_K_TILES_AFTER_I_SPLIT = 2  # ... but where phase 1 splits along I (LNC2, W_down in no panel
# cache: TP1) and phases 3-4 contract over fewer K tiles than this (S <= MX_K_TILE), they take MX_N_TILE
# (config.fit_weight_grad_n_tile): their two accumulators fill PSUM at phase 4's head while phase 3's first loads are
# issued under its tail, and the allocator finds no placement (S = 512, H = 4096, I = 12288 refused; at MX_N_TILE
# 1.53704 / 1.69508 ms). From 2 K tiles the wide tiles fit (S = 1024 runs), and where phase 1 splits S they fit at
# S = 512 too (H = 4096, I = 1536: 0.22622 ms, 0.24887 at MX_N_TILE): only this case narrows (round 44 of
# docs/dense-performance.md)
MX_N_TILE_RECOMPUTE = 512  # phase 1 with recompute holds three PSUM accumulators (dI, gate_pre, up)
PHASE2_STATIONARY_BUDGET_BYTES = 64 * 1024  # phase 1's d_gate_up rows kept on chip as phase 2's stationary
PHASE2_STATIONARY_SEPARATE_PANELS = 16  # those panels (above) are one allocation per S tile up to this many per core;
# more go into one SBUF block (a slot per S tile, SwigluBackwardEpilogue.prepare): the allocator's next-fit strews
# separate panels, one per S tile of phase 1, over SBUF, and with more than this many the 16-30 KiB tiles of phase 2
# and of phase 3's first panel loaded under its tail found no gap: H = 2048, I = 768 refused at S = 5120, 6144, 6656,
# 7680, 8192 and 9216 (20-36 panels per core), H = 2048, I = 1536 at S = 4608. Not for all: the block, placed at
# phase 1's first panel, holds 26-48 KiB from phase 1's start (TP8 0.61649 / 0.65689 -> 0.63162 / 0.67899 ms;
# S = 4096, H = 2048, I = 768 0.26382 / 0.29242 -> 0.27476 / 0.30603), and 16 separate panels find their gaps at both
# (round 41 of docs/dense-performance.md)
CHECKPOINT_BUFFERS = 2  # phase 1's ring of checkpoint tile sets (gate_pre, up, gate_act): loads run this many tiles
# ahead of the epilogue (TP8 MXFP8 modeled 0.715 -> 0.708 ms; 1: 0.731, 3: 0.710, 4: 0.737)
ALONG_S_SPREAD_S_TILES = 2  # phase 1's quantize along S of a finished K tile spread over this many S tiles' epilogue
# calls (SwigluBackwardEpilogue.spreads_along_s), where it applies
ALONG_S_HALF_FROM_COPY = True  # phase 1's quantize along S reads its [P, 4, 2I] staging tile through a strided
# [P, cols, 4] view (the 4 packed values from 4 row blocks), which the cost model prices at half VectorE's rate
# (central) or a quarter (pessimistic), and at TP8's S tile switches VectorE's along-S chunks pace TensorE: each
# chunk's last half is quantized from a unit-stride copy ScalarE makes in words the chunk does not write
# (SwigluBackwardEpilogue._along_s_copy_home). TP8 MXFP8 modeled 0.61780 / 0.68107 -> 0.61670 / 0.67465 ms, Llama3-8B
# TP8 0.73083 / 0.80970 -> 0.72899 / 0.80611, S = 16384, H = I = 2880 4.53305 / 5.08757 -> 4.49649 / 5.00564 (round 36
# of docs/dense-performance.md)
ALONG_S_SPREAD_STAGING_BYTES = 24 * 1024  # ... only when a K tile's staging tile [128, 4, 2I] bf16 is at most this
# per partition: the spread keeps two live (Llama3-8B TP8's 28 KiB find no placement beside phase 1's panels)
ALONG_S_WORDS_WHOLE_MAX_BYTES = 16 * 1024  # a K tile's words along S [128, 2I] x4 above this per partition go in one
# allocation per along-S chunk (SwigluBackwardEpilogue.along_s_words_per_chunk) where phase 1 keeps phase 2's panels
# as separate allocations and quantizes more than one K tile along S per core: those panels, one per S tile, are
# strewn over SBUF by next-fit, and S = 2048, H = I = 2880's 22.5 KiB words found no gap among 8 of them (the largest
# 22.25 KiB with 89 KiB free; refused before round 52a of docs/dense-performance.md; in two halves its deferred last
# K tile's first 15 KiB half found none at phase 2's fence). With one K tile per core (S = 1024: the deferred one,
# quantized at phase 2's fence) the split cost 0.37407 / 0.44916 -> 0.37930 / 0.46411 ms; where phase 1 keeps no
# panels it was not needed (S = 3072, H = I = 2880 0.80772 -> 0.82489 ms in halves, round 48b's per-chunk 0.82600)
SWITCH_D_GATE_ON_VECTOR = True  # where phase 1 is split along S (each core all of I), the d_gate product of each S tile's
# last n block (the S tile switch), but the core's last S tile's, runs on VectorE instead of GpSimd: GpSimd's SBUF
# access holds the bus VectorE's perf modes share with it, and the next S tile's dY quantize (a perf mode) waited for
# it; an fp32 product on VectorE runs outside the perf modes. The last S tile's stays on GpSimd (VectorE then paces
# phase 2's first panel transposes: central +0.8 us). Split along I (TP1) off: its epilogue is VectorE-bound (4.50781
# / 4.67654 -> 4.51483 / 4.68489 ms). TP8 modeled 0.61670 / 0.67465 -> 0.61649 / 0.66834 ms, Llama3-8B TP8 0.72899 /
# 0.80611 -> 0.72838 / 0.80368 (round 37 of docs/dense-performance.md)
# Where it applies is SwigluBackwardEpilogue.switches_d_gate_on_vector's rule: more than one n block per S tile, or the
# rows kept for phase 2 (one n block, rows not kept: H = 2048, I = 768 at S = 32768 2.09204 / 2.42604 -> 2.03950 /
# 2.39976 ms off; round 41)
GATE_FIRST_S_TILES = 2  # where phase 1 spreads and defers its along-S quantize (TP8), its last this many S tiles issue
# d_gate's PSUM product first (SwigluBackwardEpilogue.last_tile_gate_first; the along-S staging copy on the software DGE
# stays the last tile's only). TP8 modeled: 1 0.62068 / 0.70053 ms, 2 0.62068 / 0.69975, 3 0.62142 / 0.69944 (with
# phase 2's first span in column pieces: 1 0.62024 / 0.70095, 2 0.62024 / 0.70017; round 29 of
# docs/dense-performance.md)
PLAIN_SWITCH_GATE_PSUM_FIRST = True  # where the last GATE_FIRST_S_TILES go gate-first (TP8), the first n block of every
# other S tile with no along-S chunk to quantize (a plain S tile switch) issues d_gate's PSUM product (dI * uc) before
# d_up's (swiglu_backward_tile gate_psum_first): GpSimd's d_gate product, whose SBUF access holds the bus the next S
# tile's dY quantize waits for, starts one VectorE product earlier (TensorE idled 0.78 us pessimistic at each such
# switch). Not gate_first there: its order of first accesses (both fp32 temporaries, then the row tile) moved phase 1's
# SBUF placements, and phase 2's first W_gu and phase 3's first X staging tiles then waited on memory reuse (TP8
# 0.61649 / 0.66239 -> 0.62540 / 0.66396 ms); gate_psum_first keeps the row tile between the two temporaries: 0.61649 /
# 0.65689 (round 39 of docs/dense-performance.md)
