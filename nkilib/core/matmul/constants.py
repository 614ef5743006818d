"""Tile geometry, accepted numeric choices and SBUF/PSUM budgets of the shared matmul layer, in one place.

Kernels re-export what they use from here (e.g. the MLP backward's constants.py); nothing else defines them.
"""
import nki.language as nl

PARTITIONS = 128  # SBUF/PSUM partitions (nl.tile_size.pmax)
MX_GROUP = 32  # MX block size along K (OCP MX v1.0)
MX_PACK = 4  # fp8 values per x4 word
# MX tile geometry: https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.nc_matmul_mx.html
# and https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.quantize_mx.html
MX_K_TILE = 512  # logical K per nc_matmul_mx: 128 partitions x 4 packed values (nc_matmul_mx page)
MX_K_ALIGN = 128  # quantize_mx needs a multiple of 32 partitions -> K padded to 4 * 32
BF16_K_TILE = 128  # logical K per nc_matmul (partition dim)
# bf16 keeps 7 fraction bits: a normal value's significand in [1, 2) is a multiple of 1/128 (swiglu.exact_in_bf16,
# which decides whether a clamp's limits let it write bf16 without rounding)
BF16_SIGNIFICANT_STEPS = 2 ** 7
M_TILE = 128  # stationary free size limit (gemm_stationary_fmax)
N_TILE = 512  # moving free size per matmul: one fp32 PSUM bank (portable to trn2)
SCALE_PACK_SLOTS = 4  # K tiles sharing one scale tile at partition offsets 0/4/8/12 (quantize_mx page)
SCALE_PACK_STRIDE = 4  # scale rows per K tile in each quadrant: its 16 groups of 8 partitions, 4 per quadrant
SCALE_QUADRANT = 32  # partitions per SBUF quadrant: quantize_mx writes a 128-partition tile's scale rows at the start
# of each (rows 32q + SCALE_PACK_STRIDE x slot + 0..3), so a scale copy moves only those rows, quadrant by quadrant

FP8_X4_DTYPE_NAMES = ("float8_e4m3fn_x4", "float8_e5m2_x4")  # accepted fp8_x4_dtype values
QUANT_SCHEMES = ("1x32", "wrapX")
MATMUL_PRECISIONS = ("mxfp8", "bf16")


def usable_sbuf_bytes() -> int:
    """Usable SBUF bytes per partition of the target: nl.tile_size.sbuf_fmax_bytes. The tile_size page
    deprecates total_available_sbuf_size (since NKI 0.4.0b4) and names sbuf_fmax_bytes as "the usable
    per-partition size": https://awsdocs-neuron.readthedocs-hosted.com/en/v2.30.0/nki/api/nki.language.tile_size.html
    (same text on the v2.33.0 page). A function, not a constant: the size is the target's (trn2: 224 KiB,
    trn3: 256 KiB), which the simulator sets per run."""
    return nl.tile_size.sbuf_fmax_bytes


PSUM_BUFFERS = 2  # double-buffer PSUM accumulators so eviction overlaps the next tile's matmuls
PANEL_CACHE_BUDGET_BYTES = 96 * 1024  # SBUF bytes per partition for keeping every moving panel resident
MOVING_PANEL_BUDGET_BYTES = 96 * 1024  # one moving panel (all K tiles) when panels are not resident
RESIDENT_OPERAND_BUDGET_BYTES = 144 * 1024  # one whole operand kept resident when neither fits PANEL_CACHE_BUDGET_BYTES
# (the other is then streamed once instead of swept once per group): TP1 phase 3's X [S, H] (136 KiB at S = H = 4096)
RESIDENT_HEADROOM_BYTES = 48 * 1024  # SBUF left beside such a resident operand and its streamed panels (staging,
# eviction tiles, the next phase's first loads)
STATIONARY_PANEL_BUDGET_BYTES = 48 * 1024  # one stationary (super-)panel
STATIONARY_LOOKAHEAD_TILES = 6  # tiles ahead that MatmulPlan(stationary_lookahead=True) loads a kept-whole stationary
# operand's panels (TP1 MXFP8 modeled 4.616 ms at 1 (the plain prefetch), 3: 4.616, 4: 4.606, 6: 4.603, 8: 4.613)
STATIONARY_GROUP_BUDGET_BYTES = 72 * 1024  # stationary loads kept while the moving panels are swept (neither fits);
# sized so the modeled overlap fits SBUF: at 112 KiB TP1 (I = 12288) phase 3 needed 294 KiB per partition
STREAM_STATIONARY_BUDGET_BYTES = 208 * 1024  # stationary group of a K-streamed plan (moving needs only K-tile quads)
STREAM_STATIONARY_HEADROOM_BYTES = 48 * 1024  # SBUF the K-streamed plan leaves for everything else (MXFP8)
STREAM_STATIONARY_HEADROOM_BF16_BYTES = 64 * 1024  # the same for BF16 panels (one tile per 128-row K tile)
STREAM_N_TILE = 512  # moving width of a K-streamed plan: one PSUM bank per accumulator of the group
STREAM_STAGING_BUFFERS = 4  # staging ring of a K-streamed group's moving K-tile quads (TP1 MXFP8 modeled, with the
# contiguous group: 2: 4.881, 3: 4.572, 4: 4.567, 5: 4.569, 6: 4.580 ms central)
K_CHUNK_ALIGN = 2048  # K rows a K-chunked plan's chunks start at multiples of (MX_K_TILE x SCALE_PACK_SLOTS: whole
# scale tiles, so a chunk's K tiles are quantized and packed as in one plan; k_chunks.py)
PARTIAL_SUM_HBM_BYTES = 8  # HBM bytes per output element and K-chunk boundary: an fp32 sum stored and loaded back
K_CHUNK_PANEL_PIECE_BYTES = 8 * 1024  # a later K chunk's first moving panel's words quantized on chip in pieces of
# this size (PanelSource.first_piece_bytes; MX_PANEL_PIECE_BYTES elsewhere): it loads under the chunk before's tail,
# among the holes that chunk's dead panels leave (S = 32768, H = I = 2880, phase 3: a 12 KiB piece of X against holes
# of 12032 B and less, refused with round 51a's ring alone; 9.12927 / 10.09939 ms in 8 KiB pieces. Every panel of a
# later chunk in them: 9.13535 / 10.11763, S = 16384 4.48471 / 4.97573 against 4.46272 / 4.96006; round 51a)
K_CHUNK_FIRST_DEFERRED_K_TILES = 3  # K tiles at the end of a later K chunk's first moving panel quantized only
# when that chunk's first tile runs, not under the chunk before's tail (MatmulPlan.prefetch_first_deferring): their
# words pieces are placed after that chunk's last matmuls in program order, over its dead pieces. Under the tail every
# live tile's last access depends on the quantize, so a piece that finds no gap has no placement it may wait for:
# S = 28160 / 31232 / 32256, H = I = 2880, phase 3's eighth 6 KiB piece of X (one K tile) against 236-242 KiB live in
# holes of 5.4 KiB and less (refused; round 53a of docs/dense-performance.md). S = 28160 / 32768 there, ms: 2 tiles
# 8.15009 / 8.63859, 9.10257 / 10.10021 (main 9.11543 / 10.09780); 3: 8.04309 / 8.58037, 9.09124 / 10.09297; 4: 8.06596
# / 8.77858, 9.12653 / 10.11470. One is too few (S = 28160's seventh piece was refused too)
PARTIAL_RING_SLOTS = 3  # [128, n_tile] fp32 slots of the SBUF ring a spilling K chunk's tail passes its sums through
# (k_chunks.PartialSums): the tile being spilled as evicted and as transposed, and the fetched sums of the next tile to
# reload (the next chunk's first tile's once this chunk's last is reloaded). One allocation from the tail's first
# access, before the next chunk's first loads, so those leave no holes that the tail's short-lived tiles must find
# (S = 9728, H = 4096, I = 1536 and S = 10240, I = 1792: a 6 KiB eviction tile's fallback placement closed a
# dependency cycle; round 51a of docs/dense-performance.md). The same bytes as the tail's count before (two spill
# tiles, one fetched), now the next chunk's first fetched sums among them (they were uncounted, round 50c).
PARTIAL_LAST_FETCH_SLOTS = 2  # [128, n_tile] fp32 tiles the last K chunk (it only reloads) fetches its sums into, in
# turn (k_chunks.PartialSums): with one, each fetch waited for the tile before's reload, one tile's matmuls ahead
# of its own reload, behind the next plan's loads on the DMA queues (S = 9216, H = 4096, I = 1536: 1.73887 ->
# 1.69016 ms central; S = 28672 / 24576, H = 2048, I = 768 1.84930 -> 1.81759, 2.00680 -> 1.94858; round 51d).
LAST_FETCH_RING_MAX_HELD_BYTES = 196 * 1024  # the last chunk's fetches take PARTIAL_LAST_FETCH_SLOTS tiles only where
# its held bytes at its tail (overlap.held_bytes_at_tail, one fetched tile counted) and one more tile stay within this
# (S = 32768, H = I = 2880: phase 3's last chunk holds 201216 B; a second 5.5 KiB tile there put SBUF past its
# capacity in program order; the plans that gain hold 193792 B and less; round 51d)
PSUM_BYTES = 16 * 1024  # PSUM bytes per partition (8 banks x 2 KiB)
PSUM_BANK_BYTES = 2 * 1024  # a PSUM allocation takes whole banks (nl.tile_size.psum_bank_fmax_bytes)
PSUM_BANK_COLUMNS = PSUM_BANK_BYTES // 4  # fp32 columns of one PSUM bank
TRANSPOSE_PSUM_BANKS = 2  # PE-transpose tiles live while a phase's accumulators are (two in flight)
SPLIT_ALIGN = 128  # LNC2 splits rows/columns in multiples of 128 when possible
STATIONARY_LOAD_WIDTH = 512  # columns per stationary load of a [K, F] operand (1 KiB bf16 DMA runs; 1024 made
# the quantize_mx bursts at phase starts longer: TP8 MXFP8 modeled 0.734 -> 0.716 ms at 512)
NATURAL_LOAD_K = 2048  # K columns per DMA of a K-contiguous bf16 operand (4 KiB runs: full DMA rate)
NATURAL_BUFFERS = 2  # row tiles of a K-contiguous operand that a PanelSource's loads share (one for its first
# load, then this many: the next load waits for the previous one's PE transposes). TP8 MXFP8 modeled 0.692 ms;
# 3: 0.698, 4: 0.715; 2 from the first load on: 0.711; not shared: 0.722
MX_PANEL_WHOLE_MAX_BYTES = 32 * 1024  # a plan's MX panel words above this (per partition) are allocated in pieces
MX_PANEL_PIECE_BYTES = 16 * 1024  # of this size (panel_builder.py PanelPlacement.pieces: TP8 modeled 0.685 -> 0.660 ms)
OWN_PREFETCH_GROUPS = 6  # natural row tiles (4 KiB per partition each) of a K-streamed plan's first group that
# MatmulPlan.prefetch_own DMAs before the core barrier (columns this core wrote itself). TP1 MXFP8 modeled (none:
# 4.567 / 4.730 ms) 2: 4.565 / 4.727, 4: 4.5625 / 4.7251, 5: 4.5625 / 4.7253, 6 (the first panel's own tiles): 4.5618 /
# 4.7258; 8 and 9: refused (the group's 192 KiB block unplaceable); 12: beyond SBUF
SWITCH_INTERLEAVE_TILES = 3  # at most this many tiles of a new moving panel multiply it K tile by K tile in turn
# (MatmulPlan interleave_switch), with one PSUM accumulator more than the span. TP1 MXFP8 modeled (from 4.562 / 4.726
# ms): 2 tiles, 3 accumulators: 4.555 / 4.729; 3 tiles, the 4th accumulator added at the first switch in the PE
# transposes' banks: 4.537 / 4.712; 3 tiles with 3 accumulators: 4.591 / 4.765 and 2 tiles with 2: 4.585 / 4.749 (the
# last tile of the span then waits for the epilogue of the tile before the switch)
SWITCH_NEXT_WORDS_FROM_K_TILE = 0  # MatmulPlan(keep_whole=True, interleave_switch=True) with the moving panels
# streamed one at a time (the MLP backward's phase 1 split along I at TP1: dY kept whole, six W_down panels per core):
# from this K tile on (all but each panel's last) half of each K tile quantized from a unit-stride copy ScalarE makes in
# the next K tile's words (PanelLoad next_words_from, as COLD_PERMUTE_INTO_NEXT_WORDS). At each panel switch VectorE
# quantizes the new panel's K tiles from the strided [P, F, 4] view (half its rate in the cost model, a quarter
# pessimistic) while TensorE waits; ScalarE only evicts there. TP1 MXFP8 modeled 4.50781 / 4.67654 -> 4.50202 / 4.63161
# ms (phase 1's TensorE idle 77.3 / 158.8 -> 71.5 / 113.9 us); from K tile 1: 4.51120 / 4.63933. Not for phase 4's
# switches (its epilogue evicts on ScalarE: 4.52649 / 4.65636; round 46 of docs/dense-performance.md)
SWITCH_AHEAD_SLOTS = 4  # ... and those moving panels' words in one SBUF ring of K-tile slots for the whole plan, this
# many more than a panel's K tiles (PanelSource.switch_ahead_slots, PanelWordsRing; a multiple of SCALE_PACK_SLOTS, so
# a K tile keeps its scale tile's quadrant): the next panel's first K tiles have slots of their own ahead of its
# switch instead of a next-fit placement over the old panel or over the epilogue's dead temporaries; its first
# SWITCH_AHEAD_SLOTS - 1 K tiles are quantized ahead (the last one's unit-stride copy takes the last free slot), one
# after each of the epilogues before the switch tile's prefetch (overlap.switch_load_ahead). The plan's kept-whole
# stationary operand (dY) then takes one block (PanelSource.kept_slots): its 32 panels placed one by one left SBUF in
# gaps of at most 8 KiB, where no ahead slot fitted. TP1 MXFP8 modeled 4.50202 / 4.63161 -> 4.49093 / 4.61953 ms
# (phase 1's TensorE idle 79.8 -> 68.7 us central, one K tile after each of the last 3 epilogues); 8 (the next panel
# whole ahead): beyond SBUF (round 48a of docs/dense-performance.md)
SWITCH_AHEAD_TILES_PER_K_TILE = 6  # ... one of those K tiles quantized after every this many epilogues (from 18 tiles
# before the switch): each frees its staging tile earlier, so the ring of STAGING_BUFFERS DMAs K tiles 3-5 long before
# the switch instead of under it. TP1 modeled central 4.49093 (1), 4.47835 (3), 4.47016 ms (6; 10 the same)
LEAD_INTERLEAVE_TILES = 2  # tiles of a lead_n_major lead that multiply each new moving panel K tile by K tile in turn
# (MatmulPlan interleave_lead, with the moving operand kept whole by the resident rule; the two accumulators of
# PSUM_BUFFERS, so no third fits beside phase 3's [128, 2048] ones at TP1)
LEAD_INTERLEAVE_SKEW = 2  # K tiles the second tile of such a span trails the first (it takes the accumulator of the
# tile before the span). MXFP8 modeled, TP1 / H = 7168, I = 2048 at S = 4096 (main 4.5372 / 4.7115, 1.6195 / 1.7785
# ms): skew 0 4.532 / 4.707, 1.622 / 1.775; 1: 4.5321 / 4.7066, 1.6202 / 1.7748; 2: 4.5329 / 4.7072, 1.6195 / 1.7752;
# 3: 4.5337 / 4.7081, 1.6195 / 1.7759; 2 gains on TP1 and costs H = 7168 nothing
LEAD_PANEL_PIECE_BYTES = 8 * 1024  # the moving panels' words of an interleave_lead plan in pieces of this size (one
# K tile of a 2048-column panel): TP1 phase 3's first X panel, quantized after phase 4's tail, then finds gaps beside
# phase 4's tiles. MXFP8 modeled (16 KiB): TP1 4.5195 / 4.6875 -> 4.5161 / 4.6806 ms, H = 7168, I = 2048 1.6195 / 1.7752
# -> 1.6195 / 1.7727; 8 KiB for every plan cost Llama3-8B TP8 5 us central (round 16 of docs/dense-performance.md)
RESIDENT_KEPT_MOVING_IN_PIECES = True  # a plan whose stationary operand is resident (ResidentPanels: panels an
# earlier phase built on chip, one allocation per m tile, which next-fit strews over SBUF) and whose moving operand is
# kept whole quantizes every moving panel's words in MX_PANEL_PIECE_BYTES pieces, also below MX_PANEL_WHOLE_MAX_BYTES:
# all of those panels are live among the strewn ones at once. The MLP backward's phase 2 beside phase 1's kept panels
# at H = 2048, I = 1536: S = 3584's second 24 KiB W_gu panel found no gap among 14 of them (the largest 23.1 KiB with
# 160 KiB free: refused); S = 3072 0.32571 / 0.37459 -> 0.32235 / 0.36912 ms, S = 4096 unchanged. In 8 KiB pieces
# S = 4096 was refused. Streamed moving panels (TP8's phase 2) stay whole below that size: in 8 KiB pieces TP8 0.61649
# -> 0.62563 ms (round 52a of docs/dense-performance.md)
STAGING_BUFFERS = 3  # ring of bf16 staging tiles per [K, F] panel load (DMA runs this many K tiles ahead)
COLD_STAGING_BUFFERS = 6  # the same ring for moving panels kept resident (MatmulPlan cold_staging: all of them
# load at the plan's cold start, where the first tile waits for every K tile of them; the MLP backward's phase 1,
# W_down). TP8 MXFP8 modeled, central / pessimistic ms (3: 0.660 / 0.740): 4: 0.669, 5: 0.672, 6: 0.653 / 0.718,
# 7: 0.657, 8: 0.664, 10: 0.677, 12: 0.680 (central; round 12 of docs/dense-performance.md)
COLD_SLOT_DMA_K_TILES = 2  # the first K tiles of such a plan's first moving panel, each staged by one DMA per slot
# (MX_PACK DMAs of [128, F] rows instead of one of [128, 4, F]; panels.py _stage_mx_rows). The cost model gives every
# DMA in flight a share of the core's 16 DMA engines in proportion to the engines it spans (scheduler.py; a [128, *]
# DMA spans all 16: equal shares), and at the cold start W_down's
# whole ring, dY's first rows and the first checkpoints are in flight together, so the first K tile landed with the
# others at ~19 us; in four DMAs it takes four shares and lands at ~9 us, and dY's second half, which VectorE's first
# W_down quantize follows, lands ~1.1 us earlier. TP8 MXFP8 modeled (0.62024 / 0.70017 ms): 1: 0.61923 / 0.69927,
# 2: 0.61912 / 0.69893, 3: 0.61954 / 0.69934, 6: 0.62208 / 0.70190; two DMAs per K tile (pairs of slots) at 2: 0.61971
# / 0.69957 (docs/dense-performance.md round 31)
COLD_PERMUTE_INTO_NEXT_WORDS = True  # such a plan's moving K tiles (all but each panel's last) quantize their last
# F_pad // 2 columns from a unit-stride copy that ScalarE makes in the next K tile's words allocation (free until that
# K tile's own quantize; PanelBuilder.quantize_mx_tile). quantize_mx reads the [P, 4, F] staging tile through a
# strided [P, F, 4] view, which the cost model prices at half VectorE's rate (central) or a quarter (pessimistic),
# and at the cold start VectorE's W_down quantizes pace TensorE while ScalarE only evicts dY's transposes. TP8 MXFP8
# modeled 0.61912 / 0.69893 -> 0.61780 / 0.68619 ms, Llama3-8B TP8 0.73143 / 0.82468 -> 0.73083 / 0.80970 (round 33 of
# docs/dense-performance.md; the last K tile from a copy too: round 35)
COLD_STAGING_MAX_M_TILES = 16  # ... only in plans of at most this many m tiles per core, where the start is a share
# of the plan worth it (S = 4096 at LNC2: 16). At S = 16384, H = I = 2880 (64 m tiles: the start under 0.2% of the
# kernel) the shifted timing pushed the K-chunked phase 4's modeled overlap to 268 KiB of SBUF: refused
FENCED_FIRST_K_TILES = 4  # K tiles of a fenced-start plan's first moving panel quantized before the fence (MatmulPlan
# fenced_start: the MLP backward's phase 2 after the core barrier); the rest are quantized after it, under the first
# span's K-interleaved matmuls. TP8 MXFP8 modeled makespan, us (main 639.5; Llama3-8B TP8 746.7), ring 3 / 5: q 2:
# 640.0 / 635.9, q 3: 636.6 / 632.8, q 4: 636.6 / 632.8 (Llama3 744.9 / 743.8); ring 4: 633.1-634.3 (Llama3 752-759)
FENCED_STAGING_BUFFERS = 5  # staging ring of such a plan's first moving panel (later panels: STAGING_BUFFERS); 6:
# 633.1 at q 3 but Llama3-8B TP8 775.6. With the fence after the second panel's loads (fence_after_first_panel) the
# later panels took a ring of 4 from round 20 to round 26 (TP8 then 0.6302 / 0.7139 ms against 0.6339 / 0.7215 at 3);
# round 27 went back to 3: 0.6229 / 0.7011 -> 0.6219 / 0.7005 (the second panel's loads begin as the first panel's
# quantizes free ring tiles, ~30 us before their first matmul; four in flight shared the DMA queues with the first
# panel's last K tile, 7.5 us for 1 MB, which phase 2's first span waited for: 1.0 us of TensorE idle)
FENCED_COLUMN_PIECES = 2  # a fenced start's first moving panel quantized, its first span multiplied and evicted in
# this many column pieces (MatmulPlan.piece_first_span, span_columns.py; the MLP backward's phase 2 where phase 1
# spreads): TensorE waits for half a K tile's quantize before the span instead of a whole one and then trails VectorE
# by half a K tile. TP8 MXFP8 modeled 0.62068 / 0.70053 ms -> 0.62024 / 0.70095 (0.62059 / 0.70083 with whole-tile
# evictions; 4 pieces 0.62094 / 0.70179: VectorE pays each quantize's access overhead, and is the pessimistic bound
# up to the fence; round 29 of docs/dense-performance.md)
FENCED_NEXT_WORDS_FROM_K_TILE = 1  # from this K tile of that first panel on (all but its last), ScalarE copies the
# last FENCED_COLUMN_PIECES // 2 pieces of each K tile into the next K tile's words allocation as a unit-stride source
# for VectorE's quantize (as COLD_PERMUTE_INTO_NEXT_WORDS; PanelBuilder.quantize_mx_tile). K tile 0 is quantized while
# ScalarE still evicts phase 1's last dY transposes, so its copy would make VectorE wait (TP8 +0.9 us central). TP8
# MXFP8 modeled (0.61780 / 0.68619 ms): from 0: 0.61874 / 0.67979, 1: 0.61780 / 0.68107, 2: 0.61780 / 0.68235, 4:
# 0.61780 / 0.68491; only K tiles 0-3: 0.61874 / 0.68107 (round 35 of docs/dense-performance.md)
SPREAD_FIRST_K_TILES = 2  # a plan whose first moving panel is spread under the previous plan's tail
# (MatmulPlan.spread_first_load, overlap.py; the MLP backward's phase 3 under phase 2): K tiles of that panel quantized
# where PhaseGraph prefetches it (their staging DMAs, issued after the fence, landed long before: ScalarE's copies
# there wait for nothing) ...
SPREAD_TILES_PER_K_TILE = 2  # ... then one more K tile after every this many of the previous plan's remaining tiles'
# epilogues, so each K tile's ScalarE copy is issued in that plan's program after its staging DMA (begun when the ring
# freed its tile, STAGING_BUFFERS K tiles earlier) has landed, between the evictions the previous plan waits for ...
SPREAD_COPIES_TAIL_SHARE = 2  # ... those copies only where the previous plan has at most 1 / this of its tiles left
# at the prefetch point (MatmulPlan.prefetch_point): a load begun at that plan's head (H = 2048: phase 2's two n
# blocks, its head ends at tile 2) has its whole run to hide VectorE's strided quantizes, and each copy, the first
# access of a new words piece (MX_PANEL_PIECE_BYTES), is placed among that plan's early live tiles: S = 4096, H = 2048,
# I = 1536 found no placement for it (refused; without the copies 0.40370 / 0.45026 ms), S = 3072 there 0.34479 /
# 0.38285 -> 0.32571 / 0.37459 ms without them. Under a tail (TP8: tile 49 of 64) the copies stay (round 43 of
# docs/dense-performance.md) ...
SPREAD_COPIES_SPARE_PIECES = 1  # ... and only where the spread load fits beside the previous plan's held bytes with
# this many words pieces (MX_PANEL_PIECE_BYTES) to spare beyond PREFETCH_MARGIN_BYTES (overlap.spread_copies_fit): each
# copy is the first access of the next K tile's words piece, placed before its own K tile's quantize, out of the order
# the byte count assumes. S = 4608, H = 4096, I = 1536 fits with 0 B spare and its copy found no placement (refused;
# TP8 31 KiB spare, S = 3584 there 35.5 KiB: copies kept; round 47 of docs/dense-performance.md)
SPREAD_NEXT_WORDS_FROM_K_TILE = 1  # ... and from this K tile on (all but the panel's last) half of each K tile
# quantized from a unit-stride copy ScalarE makes in the next K tile's words (PanelBuilder.quantize_mx_tile), half of
# VectorE's strided-source price (docs/cost-model.md). Issued all at the prefetch point (round 37) the copies put
# phase 2's evictions behind the staging DMAs they wait for. TP8 MXFP8 modeled 0.61649 / 0.66834 -> 0.61649 / 0.66239
# ms, Llama3-8B TP8 0.72838 / 0.80368 -> 0.72541 / 0.78709 (round 38 of docs/dense-performance.md)
SHORT_TAIL_SPREAD_SHARE = 2  # a spread first load (SPREAD_FIRST_K_TILES) under a plan marked short_tail_loads_whole
# (the MLP backward's phase 4, phase 3 after it) is quantized whole at the prefetch point where that plan's tiles left
# take under 1 / this of its schedule (SPREAD_TILES_PER_K_TILE tiles per K tile beyond SPREAD_FIRST_K_TILES;
# overlap.spread_fits_tail): the spread then holds most K tiles back for the first get, where TensorE waits.
# S = 4096, H = 7168, I = 2048 (3 tiles left of 12) 1.63229 / 1.78763 -> 1.62009 / 1.76908 ms; share 1 also took
# S = 3584, H = I = 2880 (5 and 7 of 10) 0.90319 / 1.01208 -> 0.90016 / 1.01942 (round 45 of docs/dense-performance.md)
FENCE_TILE = 6  # MatmulPlan.set_fence: the sync point goes before this tile's epilogue (after its matmuls), so the
# plan's first tiles run while the fence waits for the previous phase's last work (the MLP backward's phase 2 before
# phases 3 and 4). TP8 MXFP8 modeled makespan, us (fence before phase 2: 632.8; Llama3-8B TP8 743.8): 4: 628.6 /
# 730.3, 6: 625.8 / 726.6, 8: 629.5 / 728.6 (with the staging ring of 3: 628.2 / 741.2, 624.9 / 737.5, 626.1 / 737.5)
FENCE_WORK_AFTER_K_TILES = 1  # MatmulPlan.set_fence_work: at the fence tile, work the fence waits for (the MLP
# backward's phase 1's last K tile along S, quantized and stored at the barrier: flush_along_s) goes after this many K
# tiles of the next tile's new moving panel are quantized and before its other K tiles, instead of after all of them:
# VectorE (program order) then quantizes and stores it while the first panel's last tiles multiply, and the fence waits
# for TensorE instead of that store (TP8 pessimistic: 3.97 us of TensorE idle at the fence, 1.30 after). The first K
# tile goes first so the new panel's staging ring and words take their SBUF placements before the work's words do, as
# they did (allocator.py places at first access, next-fit). TP8 MXFP8 modeled (0.61649 / 0.65689 ms): 0 0.62541 /
# 0.66658 (placements moved: phase 3's second stationary panel waits for phase 2's last matmul), 1-5 0.61649 /
# 0.65422, 6 (all: the old order) 0.61649 / 0.65689 (round 42 of docs/dense-performance.md)
LAST_TILE_COLUMN_SHARES = (3, 2, 1)  # MatmulPlan.piece_last_tile: the last tile's column pieces (1536 columns:
# 768, 512, 256); each piece's store (1.3 us DMA latency + its bytes) runs under the next piece's matmuls. TP8 MXFP8
# modeled central ms (whole tile 0.6243): 3 equal pieces 0.6233, 2 0.6235, 3-2-1 0.6229, 4-2-2-1 0.6230
RESULT_BUFFERS = 3  # SBUF eviction tiles per plan, used round-robin (stores trail evictions by up to 2 tiles)
# SBUF left for small tiles when a phase's tail and the next phase's first panels coexist
PREFETCH_MARGIN_BYTES = 8 * 1024
PREFETCH_STAGING_BUFFERS = 2  # where the next plan's first panels fit under a plan's tail only with a shallower ring:
# its moving sources' staging rings this deep for the first panel (then their own again; overlap.prefetch_staging,
# MatmulPlan.stage_first_load); not for a spread first load, whose schedule assumes STAGING_BUFFERS. S = 4096,
# H = 7168, I = 2048 (phase 4 under phase 2, 5 KiB over with its ring of 3; round 40's honest count of each ring
# refused it there): 1.67279 / 1.84104 -> 1.63229 / 1.78763 ms (round 45 of docs/dense-performance.md)
# Where a panel's MXFP8 K tiles go in SBUF (panel_builder.py PanelPlacement): one allocation for the panel, one per
# K tile (and per scale tile), on-chip-quantized words in pieces of MX_PANEL_PIECE_BYTES, or a caller's allocation
PLACEMENT_WHOLE, PLACEMENT_PER_K_TILE = "whole", "per_k_tile"
PLACEMENT_PIECES, PLACEMENT_INTO = "pieces", "into"
PLACEMENT_SLOTS = "slots"
