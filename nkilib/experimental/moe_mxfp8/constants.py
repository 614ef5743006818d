"""Constants of the MoE expert backward (block layout and numerics), in one place.

The MX geometry (groups of 32, K padded to 128, 512-long MX K tiles, 128-long BF16 K tiles) is the
dense MLP backward's; it is imported from there so both kernels share one definition.
"""
from ..mlp_mxfp8.mlp_bwd_mxfp8.constants import BF16_K_TILE, MX_GROUP, MX_K_ALIGN, MX_K_TILE  # noqa: F401

#: A block of B routed tokens is the K of the weight-gradient matmuls: B is a multiple of the MX
#: K alignment (32-element groups packed x4 -> 128) so no group mixes two experts' tokens.
BLOCK_ALIGN = MX_K_ALIGN
#: B <= one MX K tile: each block is exactly one nc_matmul_mx per weight-gradient output tile, so
#: the per-expert fp32 sum over blocks has one order whatever loop nest the kernel uses (docs/moe.md).
MAX_BLOCK_SIZE = MX_K_TILE
#: Default B: the smallest aligned block (least padding for small per-expert token counts).
DEFAULT_BLOCK_SIZE = 128
#: Columns of I per partial sum of the routing-weight gradient <dI, h> (one fp32 PSUM bank).
ROUTING_GRAD_TILE = 512
#: Rows per partial sum of the gate_up bias gradient (GPT-OSS): one BF16 nc_matmul's K (128 partitions),
#: each tile's column sums rounded once to fp32 and accumulated in order (reference_bias_grad_fold).
BIAS_GRAD_K_TILE = BF16_K_TILE
#: Accepted dtypes of topk_ids.
TOPK_ID_DTYPES = ("int32", "int64")
#: Layouts of the checkpoints the kernel accepts (checkpoint_layout; the first is the default): "slot" [T, k, I], one
#: row per routed pair, gathered by slot; "block" [N*B, I], one row per block position (padding rows zero), read by
#: plain DMA (docs/moe.md section 6).
CHECKPOINT_LAYOUTS = ("slot", "block")
#: Layouts of the routing weights and their gradient (weights_layout; the first is the default): "slot": topk_weights
#: [T, k] gathered by slot and d_topk_weights [T, k] scattered by slot (one software-DGE descriptor per row each, on
#: GpSimd); "block": p also passed as topk_weights_blocks [N*B] by block position (+0 at padding) and read by plain
#: DMA, d_topk_weights returned as [N*B] by block position, written by plain DMA (the caller scatters it back to
#: [T, k]: reference.weights_from_blocks; docs/moe.md section 6, round 30b).
WEIGHTS_LAYOUTS = ("slot", "block")

# ---- the NKI kernel (moe_bwd_mxfp8_kernel.py) ----
from ...core.matmul.constants import MX_PACK, PARTITIONS, SPLIT_ALIGN  # noqa: E402,F401

#: Columns of I per phase-1 output tile: one fp32 PSUM bank, and the routing-gradient partial sums'
#: tile (each phase-1 tile is exactly one ROUTING_GRAD_TILE, so the fold order is the reference's).
PHASE1_N_TILE = ROUTING_GRAD_TILE
#: Rows of a block whose pass-A state stays on chip together (chunks of 128): the I tiles loop outside
#: them, so a weight tile that does not stay resident is loaded once per group of rows.
PHASE1_ROW_GROUP = 256
#: Columns of H per dX tile and per weight-gradient output tile (one fp32 PSUM bank).
MOE_N_TILE = 512
#: LNC2 splits a block's rows in units of this many tokens (even M for nc_matmul_mx).
ROW_SPLIT_UNIT = 32
#: SBUF bytes per partition of one expert's weight panels kept resident across its block loop; above
#: it the panels are loaded per block inside the loop.
RESIDENT_WEIGHT_BUDGET_BYTES = 96 * 1024
#: Largest W_down[e] (bf16 bytes, H * I * 2) whose resident copy goes through DownWeightExchange for each later fence
#: group's second pass A (round 25b). The exchange adds DMA (half of it loaded and its words stored a fence ahead, then
#: all words loaded: 1.25x the bf16 bytes per core) to save A's load -> quantize_mx chain at its start: Qwen3-30B-A3B's
#: 3 MiB gains (full balanced run 17.513 -> 17.053 ms), GPT-OSS-20B's 15.8 MiB loses (19.564 -> 19.855 ms).
RESIDENT_DOWN_EXCHANGE_MAX_BYTES = 8 * 1024 * 1024
#: SBUF bytes per partition that pass A's resident weight panels and pass B's W_gu panels (this core's H tiles) may
#: take together for pass B to run in pieces between pass A's chunks (round 8a, moe_bwd_mxfp8_interleave.py): both
#: stay on chip through the segment's A. Qwen3-30B-A3B (12 + 12 KiB) interleaves; GPT-OSS-20B (~65 + ~65 KiB) does
#: not: with both resident, pass A's chunk tiles find no placement, and with a third of W_gu (one H tile) interleaved
#: it ran 3038.5 -> 3066.6 us (docs/moe.md section 10, round 8a).
INTERLEAVE_PANEL_BUDGET_BYTES = 96 * 1024
#: With that interleave, each segment's first B loads its resident W_gu panels before the fence ahead of it instead of
#: at its start (round 38d): Qwen3-30B-A3B's segments of one-block experts started on W_gu's 3 MiB per core, the
#: longest load after the fence (qz 3234.4 -> 3196.2 us, q8 980.8 -> 958.6).
GATE_UP_PANELS_BEFORE_FENCE = True
#: With the pass A pipeline and X deferred, an expert's x_blocks rows of its blocks before the last two (all full) are
#: gathered right after its pass A, under the segment's pass C, instead of at the segment's end with the rest: a hot
#: expert's tens of blocks of HBM -> HBM copies queued last ran up to the fence (round 39b: qz 3181.7 -> 3132.5 us;
#: experts of at most two blocks, balanced Qwen3-30B-A3B's, gather as before).
X_BLOCKS_HEAD_AFTER_A = True
#: Weight-gradient output tiles ([128, MOE_N_TILE] fp32, one PSUM bank each) accumulated together across
#: an expert's block loop (PSUM has 8 banks); larger outputs take several block loops (each re-reads the
#: blocks' rows of its tiles).
WEIGHT_GRAD_PSUM_TILES = 8
#: m tiles per part of a windowed expert's pass-C group (moe_bwd_mxfp8_weight_grads._window_by_n_tiles: a stationary
#: piece's m tiles under one n tile, up to WEIGHT_GRAD_PSUM_TILES accumulators): the group's slots 1.. and its carry
#: copies or evictions (ScalarE) go part by part, so one part's copies free its PSUM banks while the next part
#: multiplies and the next group's slot-0 matmuls find them free, where the whole group's copies came after its last
#: matmuls and the next group waited for them bank by bank (docs/moe.md section 10, round 41b). The same matmuls, loads
#: and adds.
WINDOW_GROUP_M_TILES = 4
#: A windowed expert's next window's moving piece 0 loads into this window's piece-0 slots as soon as their last group
#: has multiplied (under the window's remaining groups) instead of at the next window's start, where its R loads and
#: quantizes left TensorE idle ~20 us per window boundary (docs/moe.md section 10, rounds 26c and 41b).
WINDOW_NEXT_MOVING_AHEAD = True
#: WINDOW_GROUP_M_TILES' parts and WINDOW_NEXT_MOVING_AHEAD only where the window's slots R are at most this
#: (GPT-OSS-20B's R = 8; not Qwen3-30B-A3B's R = 16, whose windowed expert's segment is DMA-bound, round 40b: a group's
#: copy wait, ~2 us, is ~7% of its matmuls there against ~14% at R = 8). Both at R = 16: qz +21.0 / +20.7 us; the
#: moving piece ahead alone: qz -0.9 / +0.3, the full Qwen3-30B-A3B Zipf run +9.3 / +4.9 (round 41b).
WINDOW_REORDER_MAX_SLOTS = 8
#: Columns per load of a single-block expert's pass-C operand (loaded and quantized once, then sliced into
#: tiles): 2 KiB bf16 DMA runs, and a [128, 4, 1024] bf16 staging tile (8 KiB per partition).
SINGLE_BLOCK_LOAD_WIDTH = 1024
#: Block positions per partition where the I split folds and stores d_topk_weights by block position (weights_layout
#: "block"): partition p takes positions 4p .. 4p + 3 of a chunk (the 1x32 scheme's rows of a partition), so the I
#: tiles' sums load and the gradient stores as one run per partition (64 and 16 bytes for the DeepSeek-V3 rank's 4 I
#: tiles) instead of a descriptor per position (docs/moe.md section 10, round 32c).
D_W_POSITIONS_PER_PARTITION = MX_PACK
#: Columns per piece of a slot-interleaved block scratch (pass A's d_gate_up and hs rows under the I split, docs/moe.md
#: round 30a): each 4 consecutive rows' columns of a piece are one contiguous run, so pass C's load of a K tile's
#: four slots (rows 4p + j, the 1x32 scheme) of one SINGLE_BLOCK_LOAD_WIDTH piece is one DMA of 8 KiB runs, not four
#: of 2 KiB.
SLOT_PIECE_COLUMNS = SINGLE_BLOCK_LOAD_WIDTH
#: Rows per unit of a single-block expert's pass-C K (the 1x32 scheme): its block's routed pairs fill 1..B / unit
#: leading units and only those are loaded, quantized and multiplied (K = the filled units' rows; one traced variant of
#: the single-block path per count, chosen at run time). MX_K_ALIGN: quantize_mx takes multiples of 32 partitions
#: (docs/moe.md section 10, round 17d).
PASS_C_ROW_UNIT = MX_K_ALIGN
#: Columns per load of a [K, F] weight operand (W_down in pass A, W_gu in pass B), a multiple of
#: MOE_N_TILE: 2 KiB bf16 DMA runs (75% of the sustained DMA rate by the cost model's payload rule, against
#: 60% for a 512-column tile's 1 KiB runs).
WEIGHT_LOAD_WIDTH = 1024
#: Columns per super-panel load of a weight operand loaded on use (not resident) whose quantized
#: [K, WIDE_WEIGHT_LOAD_WIDTH] panel takes at most WIDE_WEIGHT_PANEL_BYTES per partition: 4 KiB bf16 DMA runs (the
#: sustained rate by the payload rule, against 75% for 2 KiB). DeepSeek-V3's W_gu in pass B (K = 2I = 4096: 68 KiB)
#: loads this way; its W_down in pass A (K = H = 7168: 120 KiB) does not fit beside pass A's other tiles, and resident
#: panels keep WEIGHT_LOAD_WIDTH (docs/moe.md section 10, round 6c).
WIDE_WEIGHT_LOAD_WIDTH = 2048
WIDE_WEIGHT_PANEL_BYTES = 72 * 1024
#: Staging tiles ([128, 4, WIDE_WEIGHT_LOAD_WIDTH] bf16, 16 KiB per partition) of the one ring that a block's wide
#: super-panel loads share: 3 lets a K tile's DMA run two quantizes ahead (DeepSeek-V3 rank, 8 x 512: 3303 -> 3216 us
#: central). Round 6c's shared ring of 3 found no SBUF placement on 8 experts; since round 6's merge (no resident tier
#: of 4) it places (docs/moe.md section 10, round 7b).
WIDE_WEIGHT_STAGING_BUFFERS = 3
#: K tiles of pass B's first wide W_gu super-panel staged before B(e), in A(a)'s last epilogue (DGateUpRowsAhead; of the
#: WIDE_WEIGHT_STAGING_BUFFERS its ring holds): 16 KiB per partition each. 2 lost on the 8-expert shape (2611.1 against
#: 2564.6 us; 3 overflow SBUF): docs/moe.md section 10, round 22a.
W_GU_K_TILES_AHEAD = 1
#: MXFP8 staging tiles ([128, 4, 1024] bf16, 8 KiB per partition each) that pass C's operand loads take in
#: turn: a load waits for the quantize that last read its tile, so loads run at most this far ahead (the single-block
#: path numbers its loads across gradients and experts for this: docs/moe.md section 10, round 7b).
PASS_C_STAGING_BUFFERS = 3
#: Whether the resident weight panels staged through pass C's ring (pass B's W_gu, round 9a; pass A's W_down at the
#: segment's A and before each fence, round 26b) load every K tile by one DMA per MX slot (four [128, width] DMAs)
#: instead of one: the cost model shares the DMA engines per transfer in flight, and at B's start and at the fence
#: these ring loads (three in flight) shared them with B's 16 chunk-panel loads and the next group's X gathers, so
#: each took 20-23 us for 2-4 us of bytes and paced the load -> quantize_mx chain (GPT-OSS-20B gpt6 3755.5 / 4244.5
#: -> 3740.4 / 4182.8 us; docs/moe.md section 10, round 30c). The same bytes into the same staging tile.
RING_WEIGHT_DMA_PER_SLOT = True
#: Staging tiles (of those PASS_C_STAGING_BUFFERS) that the resident path's consecutive loads take in turn, so a
#: block's load need not wait for the quantize of the load before it (each pass-C operand is one K tile, and a
#: panel's own ring rotation is per K tile). Round 6b kept 2 (3 then left a later 48 KiB weight panel no placement on
#: GPT-OSS-20B's 4 x 2048 shape); since round 20b all 3: the loads that fill an expert's slots at C's start wait for
#: the quantize three loads back instead of two (docs/moe.md section 10, round 20b). Experts above R (parts tiers,
#: windows) take all PASS_C_STAGING_BUFFERS tiles in turn too (round 9c).
PASS_C_RESIDENT_STAGES = 3
#: Most blocks of one expert whose pass-C operands stay in SBUF (MXFP8): an expert with 2..R blocks reads and
#: quantizes each of its blocks' rows once per core (moe_bwd_mxfp8_weight_grads.compute_phase3_resident_grads_mxfp8);
#: a larger one runs windows of R blocks (PASS_C_RESIDENT_WINDOWS) or, beyond them, re-reads its blocks per PSUM
#: group. R is also bounded by PASS_C_RESIDENT_BUDGET_BYTES: R = 16 for Qwen3-30B-A3B, 8 for GPT-OSS-20B, 7 for the
#: DeepSeek-V3 rank (16 instead of 8: docs/moe.md section 10, round 4).
PASS_C_RESIDENT_BLOCKS = 16
#: SBUF bytes per partition for those resident K tiles (R blocks of the moving operand's columns plus R blocks of
#: one SINGLE_BLOCK_LOAD_WIDTH stationary piece). Modeled (docs/moe.md section 10, rounds 3 and 4) without plan
#: errors; 80 KiB (R = 4) gave the same times on 2-4 block experts.
PASS_C_RESIDENT_BUDGET_BYTES = 136 * 1024
#: Slot counts of the resident path's code variants (ResidentBlocks): an expert takes the smallest that holds its
#: blocks, so the many small experts run 8 slot loops while a hot one (up to R) runs R (docs/moe.md, round 4). A tier
#: of 4 (round 6b: +0.2 points on GPT-OSS-20B balanced at T = 16384) made the full study's GPT-OSS-20B T = 16384 Zipf
#: run unplaceable (two 11.2 KiB tiles whose waits closed a dependency cycle), so it is not used.
PASS_C_RESIDENT_TIERS = (8,)
#: Windows of R resident blocks for an expert of more than R blocks (MXFP8): up to W R blocks are read and quantized
#: once per core, the output tiles' fp32 partial sums carried across windows through HBM scratch (docs/moe.md
#: section 10, round 5b); larger experts (and W = 1) take the streamed path. Each window is traced code (W x the
#: resident path's loops), so W bounds the kernel's size.
PASS_C_RESIDENT_WINDOWS = 4
#: N-part counts of the resident path's tiers above R (MXFP8): with P parts of this core's output columns (whole
#: MOE_N_TILE tiles) a slot holds one part of the moving operand, so R_P > R blocks fit the budget; an expert of
#: R_{P-1} < nb <= R_P blocks runs the resident code once per part, reading its stationary operand P times instead of
#: carrying every output tile's fp32 partial sum through HBM between windows (docs/moe.md section 10, round 8b).
#: () = no such tiers.
PASS_C_RESIDENT_PARTS = (2, 3)
#: Columns of a weight-gradient row stored by one DMA in pass C's single-block and resident paths (a multiple of
#: MOE_N_TILE): 4 KiB bf16 runs, the DMA payload that sustains the full rate (the streamed path stores per tile). A
#: row's last piece narrower than this joins the piece before it when it has at least
#: WEIGHT_GRAD_STORE_JOIN_MIN_COLUMNS (pass_c_stores.store_pieces).
WEIGHT_GRAD_STORE_WIDTH = 2048
#: Columns from which a row's short last store piece joins the one before (one DMA): the DeepSeek-V3 rank's 1536 of its
#: 3584 columns of H per core (7 KiB runs instead of 4 KiB + 3 KiB: ds16 -0.47% / -0.87%); GPT-OSS-20B's 832 of 2880
#: stay apart (joined, gpt4 lost 4.9% / 4.6%: the resident path's placements; docs/moe.md section 10, round 31c).
WEIGHT_GRAD_STORE_JOIN_MIN_COLUMNS = WEIGHT_GRAD_STORE_WIDTH // 2
#: Columns of the zeroed bf16 SBUF tile [128, ZERO_ROWS_WIDTH] from which pass A stores the scratch rows of a
#: skipped all-padding row unit (4 KiB per partition; wider rows go in pieces).
ZERO_ROWS_WIDTH = 2048
#: Rows per unit in which the deferred HBM -> HBM gathers of a padded block's chunks (x_blocks, the staged dY) store
#: their zeros first: only the units that hold padding (a block's padding is its tail), each under its own 0/1 flag,
#: the same flags on both cores (a core runs the other core's units' loops empty). ROW_SPLIT_UNIT: every core's chunk
#: of a block is whole such units. Round 41d: the whole 128-row chunk was zeroed before (Qwen3-30B-A3B Zipf).
ZERO_PADDING_UNIT = ROW_SPLIT_UNIT
#: Experts per software-pipeline segment under LNC2: A of the next group, B and C of this one, then one
#: core_barrier (docs/moe.md section 5; section 10, round 5 measures 1, 2 and 4).
EXPERTS_PER_FENCE = 2
#: The pass A pipeline's dY rows of the group after next copied by token id into dy_blocks after the segment's first
#: pass C (HBM -> HBM, where GpSimd has room), so that their A reads them by plain DMA instead of gathering them beside
#: the epilogue's GpSimd products: the same descriptors, moved a fence ahead (docs/moe.md section 10, round 31a).
STAGE_DY_A_FENCE_AHEAD = True
#: Columns of I per DMA of the pass A pipeline's block-ordered checkpoint rows (a multiple of PHASE1_N_TILE; 0: one
#: DMA for all of I). The pipeline loads a chunk's checkpoints a chunk ahead into the tiles the chunk before it read:
#: one DMA over all of I waits for that chunk's last I tile, a DMA per column piece only for the tile that reads its
#: columns, so the first pieces arrive while the previous epilogue still runs (docs/moe.md section 10, round 31b).
PIPELINE_CHECKPOINT_COLUMNS = 1024
