"""MXFP8 MoE SwiGLU expert backward with run-time routing (NKI): the kernel of reference.py's `mx_exact`.

One traced kernel serves every routing of the same static shapes (T, k, E, H, I), block size B and
capacity N: the routing arrives as the block layout of routing.py (build_block_layout) in HBM, and
the kernel walks it with run-time loops (nl.fori_loop) whose trip counts are register-loaded from
`expert_block_offsets`:

    for each expert e (static):  blocks [offsets[e], offsets[e+1])  (0 trips for an empty expert)

so every expert's weights are static inside its loop (loaded once per expert, not per block), and
only the token rows are data: they are gathered by indirect DMA (dma_copy with an `.ap(vector_offset=)`
view, oob_mode.skip for the padding sentinel T) straight into the on-chip layouts the matmuls need,
and dX contributions are scatter-added back to token rows by dma_compute (a read-modify-write DMA in
fp32, one bf16 rounding) -- no permute / unpermute pass over HBM.

Passes (reference.moe_backward_reference's order; docs/moe.md):
    A  compute_phase1_block_grads_mxfp8, per block: gather dY, X (and the given checkpoints by slot, or, with
       checkpoint_layout="block", read their block-ordered rows by plain DMA: docs/moe.md section 6);
       dI = dY_b W_down[e] (K=H) with the recompute products gate_pre / up (K=H); epilogue: the
       routing-weight gradient <dI, h> (fused, from values on chip), dh = p dI, the dense kernel's SwiGLU
       derivative on dh (nkilib/core/swiglu.py), hs = p h. d_gate_up, hs and the gathered dY / X rows go
       to HBM scratch in block-position order (pass C then reads its K = tokens operands by plain DMA,
       never gathering a row twice), d_topk_weights is scattered by slot (stored by block position with
       weights_layout="block", which also reads p by plain DMA: round 30b). Where all of I is one resident group,
       pass B's W_gu is resident and B is a multiple of 128 per core, each 128-row chunk's d_gate_up also becomes
       pass B's K=2I stationary panel here (PE transposes and quantize_mx along 2I, once per row), stored as words
       and scales (ctx.d_gu_mx; docs/moe.md section 10, round 7a); where W_down is loaded per block (DeepSeek-V3's),
       the same for the experts with one block, whose pass A runs all of I over every row (round 8c; not under the
       I split below). Under LNC2 with a W_down loaded on use (DeepSeek-V3's) the cores split I instead of rows for
       every expert, each loading and quantizing its I columns once per expert (moe_bwd_mxfp8_i_split.py; round 9b
       for one full block, round 14d for every expert, a block's chunks of padding only skipped); where that split
       does not apply (B / cores not a multiple of 128, one I tile) W_down comes quantized from HBM scratch for the
       experts after the first fence group: each core quantized half of its K tiles a segment earlier
       (moe_bwd_mxfp8_down_exchange.py), as for a small resident W_down's second A per segment (round 25b).
    B  compute_phase2_hidden_states_grad_mxfp8, per block: part = d_gate_up_b W_gu[e] (K=2I), rounded
       to bf16 and scatter-added into dX (block order = expert order per token, like the reference); the
       stationary panels are pass A's when it stored them, else built from the bf16 rows. With pass A's chunk pipeline
       and both passes' resident weights within INTERLEAVE_PANEL_BUDGET_BYTES, B(e) runs in pieces inside the loop
       bodies of the segment's pass A (moe_bwd_mxfp8_interleave.py; docs/moe.md section 10, round 8a).
    C  compute_phase3_expert_weight_grads_mxfp8, per expert: dW_gu[e] = sum_b d_gate_up_bᵀ X_b and
       dW_down[e] = sum_b dY_bᵀ hs_b (K = the block's tokens, both operands MX-quantized along tokens:
       B is a multiple of 128 so no MX group mixes two experts), accumulated over the expert's blocks in
       PSUM (groups of WEIGHT_GRAD_PSUM_TILES output tiles; the first block overwrites, later blocks add:
       the same fp32 sums as the reference) and stored once; an expert of 2..R blocks keeps them in SBUF
       slots, each block read once per core (moe_bwd_mxfp8_weight_grads.py: single / resident / streamed).
An expert without tokens runs none of A-C: every expert's work sits in a 0/1-trip run-time loop
(ExpertLoops.if_used: no weight load, no quantization), and a second one (if_unused) stores its zero
weight gradients (+0, exactly the reference's empty sum). Weights of A and B that do not stay resident are
loaded per block for an expert with one block, and once per expert for one with more (one block loop per
resident group of their tiles, per_block); with resident weights an expert's last block skips its
padding-only rows (0/1-trip loops on MoeContext.row_flags). docs/moe.md, section 10, round 3.

LNC2 (run_with_lnc2 and a kernel[2] launch): both cores run the same loops over the same register
bounds, so their run-time trip counts are identical for any routing (divergent dynamic control flow
across cores is undefined behaviour,
https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/get-started/about/lnc.html);
the work is split on free dimensions:
    A  each core takes one half of every block's rows (ROW_SPLIT_UNIT multiples; in an expert's last block
       with resident weights, its 128 rows of every 256-row unit): it writes only its rows of the scratch
       (and of the routing-gradient partial) and only their slots of d_topk_weights;
    B  each core takes a half of dX's H columns: two cores' scatter-adds touch disjoint bytes of a row,
       and one core's scatter-adds to a token row are issued in block order on that core;
    C  each core takes a half of each weight gradient's output tiles (CoreSplit.ranges).
The passes are software-pipelined over groups g of G = EXPERTS_PER_FENCE consecutive experts: A(first group), fence,
then per group g the segment [A(next group's j-th), B(g's j-th), C(g's j-th) for j < G], fence (a core_barrier;
none after the last group). B(e) and C(e) read scratch rows of expert e written by both cores in A(e), which ran in the
previous segment (or before the first fence) and so before the fence that opens e's segment; inside a segment
A writes only blocks of the next group's experts and slots of their pairs, B(e) only this core's dX columns,
C(e) only this core's tiles of expert e's gradients, so no byte is written by two cores or read by one while
the other writes it, for any routing (blocks are owned by one expert). The W_down exchange's scratch of expert e is
written (each core its K tiles) a segment before A(e), or before the first fence for the second group. The number
of accumulator groups in pass C (each a loop) is derived from core 0's (larger) share, so both cores enter the same
loops. Use B >= 256 with LNC2: a core's share of a B = 128 block is 64 rows, half the PE array's stationary width in
pass A (docs/moe.md, section 5, says why the rows and not I are split).

MXFP8 on trn3 (quantize_mx + nc_matmul_mx), BF16 on trn2 (nc_matmul) with the same API
(matmul_precision, default by target); the numerics are reference.py's per precision.
"""
from __future__ import annotations

import nki
import nki.isa as nisa
import nki.language as nl

from ...core.kernel_helpers import ceil_div, kernel_assert, shard_range
from ...core.matmul.constants import MX_PACK
from ...core.matmul.panels import LoadRing
from ...core.matmul.sources import blocks as _blocks
from ...core.matmul import CoreSplit, TensorDescriptor, panel_tile_widths
from ..mlp_mxfp8.mlp_bwd_mxfp8.config import ClampLimits, resolve_kernel_options
from ..mlp_mxfp8.mlp_bwd_mxfp8.mlp_bwd_mxfp8_kernel import get_program_sharding_info
from .moe_bwd_mxfp8_d_gate_up import (compute_phase1_block_grads_mxfp8, compute_phase1_pipelined_mxfp8,
                                      gather_first_chunk_ahead)
from .moe_bwd_mxfp8_deferred import gather_deferred_rows, gather_expert_x, scatter_deferred_d_w
from .moe_bwd_mxfp8_down_exchange import DownWeightExchange
from .moe_bwd_mxfp8_dx import (ChunkPanels, DGateUpRowsAhead, ExpertPanels, compute_phase2_hidden_states_grad_mxfp8,
                               resident_tile_groups)
from .moe_bwd_mxfp8_bias_grad import GateUpBiasGrad
from .moe_bwd_mxfp8_block_runs import ExpertBlockRuns
from .moe_bwd_mxfp8_context import MoeContext
from .moe_bwd_mxfp8_inputs import check_moe_inputs
from .moe_bwd_mxfp8_i_split import ExpertISplit
from .moe_bwd_mxfp8_interleave import InterleavedDx
from .moe_bwd_mxfp8_loops import ExpertLoops
from .moe_bwd_mxfp8_single_block import compute_phase3_single_block_expert_mxfp8
from .moe_bwd_mxfp8_weight_grads import (BlockRowSource, ResidentBlocks, store_zero_expert_grads,
                                         compute_phase3_expert_weight_grads_mxfp8,
                                         compute_phase3_multi_block_grads_mxfp8)
from .constants import (CHECKPOINT_LAYOUTS, EXPERTS_PER_FENCE, GATE_UP_PANELS_BEFORE_FENCE,
                        INTERLEAVE_PANEL_BUDGET_BYTES, MOE_N_TILE, PARTITIONS, PASS_C_STAGING_BUFFERS, PHASE1_N_TILE,
                        ROW_SPLIT_UNIT, SINGLE_BLOCK_LOAD_WIDTH, SPLIT_ALIGN, STAGE_DY_A_FENCE_AHEAD,
                        WEIGHT_GRAD_PSUM_TILES, WEIGHTS_LAYOUTS, ZERO_ROWS_WIDTH)

__all__ = ["moe_backward_mxfp8_nki", "moe_backward_mxfp8_base_nki", "compute_phase1_block_grads_mxfp8",
           "compute_phase2_hidden_states_grad_mxfp8", "compute_phase3_expert_weight_grads_mxfp8", "ClampLimits"]


# ---------------------------------------------------------------------------------------------------
# Base kernel: the three passes over the experts
# ---------------------------------------------------------------------------------------------------
def moe_backward_mxfp8_base_nki(ctx, wg_dtype):
    """Passes A, B, C (module docstring) for a validated MoeContext; outputs are ctx.dx, ctx.d_weights,
    ctx.d_gate_up_weight, ctx.d_down_weight and, when not None, ctx.d_gate_up_bias."""
    E, H, I, setup, split = ctx.E, ctx.H, ctx.I, ctx.setup, ctx.split
    # this core's rows of each block (pass A) and H columns of dX (pass B)
    lo, hi = shard_range(ctx.B // ROW_SPLIT_UNIT, split.num_cores, split.shard_id)
    ctx.row_lo, ctx.row_hi = lo * ROW_SPLIT_UNIT, hi * ROW_SPLIT_UNIT
    ctx.zeros = nl.ndarray((PARTITIONS, ZERO_ROWS_WIDTH), dtype=nl.bfloat16, buffer=nl.sbuf)  # skipped rows' scratch
    nisa.memset(dst=ctx.zeros, value=0.0)
    # with resident weights: units of 128 rows per core (the last may be smaller), this core's rows of each
    ctx.row_unit = min(ctx.B, PARTITIONS * split.num_cores)
    ctx.unit_rows = []
    for u0, usz in _blocks(0, ctx.B, ctx.row_unit):
        lo, hi = shard_range(usz // ROW_SPLIT_UNIT, split.num_cores, split.shard_id)
        ctx.unit_rows.append((u0 + lo * ROW_SPLIT_UNIT, (hi - lo) * ROW_SPLIT_UNIT))
    c_lo, c_hi = shard_range(ceil_div(H, SPLIT_ALIGN), split.num_cores, split.shard_id)
    h_lo, h_hi = min(c_lo * SPLIT_ALIGN, H), min(c_hi * SPLIT_ALIGN, H)
    # dX starts at zero (this core's columns; its scatter-adds follow on the same core). With k = 1 every token
    # has exactly one routed pair (the layout holds every slot once), so pass B writes each row once instead
    if ctx.k > 1:
        zeros = nl.ndarray((PARTITIONS, max(1, h_hi - h_lo)), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.memset(dst=zeros, value=0.0)
        for t0, tsz in _blocks(0, ctx.T if h_hi > h_lo else 0, PARTITIONS):
            nisa.dma_copy(dst=ctx.dx[t0:t0 + tsz, h_lo:h_hi], src=zeros[:tsz, :])
        zeros = None
    i_tiles = _blocks(0, I, PHASE1_N_TILE)
    gu_rows, down_rows = ctx.gu_rows, ctx.down_rows
    ctx.loops = ExpertLoops(ctx.offsets, E)
    if ctx.weights_blocked:  # the blocks no expert owns: +0 d_topk_weights (every entry of that output is written)
        ctx.loops.unused_blocks(ctx.N, lambda i: [ctx.zero_pair_grads(i, r0, m) for r0, m in ctx.unit_rows if m])

    runs = ExpertBlockRuns(ctx)  # an expert's block loops with its weight panels (resident, per block, per group)
    fits, panels_of, per_block = runs.fits, runs.panels_of, runs.per_block

    # ---- pass A (an expert without blocks loads no weights: the whole expert sits in its if_used) ----
    # software pipeline over groups of EXPERTS_PER_FENCE consecutive experts (the schedule at the end)
    groups = [list(range(g, min(g + EXPERTS_PER_FENCE, E))) for g in range(0, E, EXPERTS_PER_FENCE)]
    exchange = None  # W_down quantized once per core pair (moe_bwd_mxfp8_down_exchange.py), set below

    def a_descs(e):
        """W_down[e] [H, I] (K=H; from the exchange's scratch for its experts), and W_gate[e] / W_up[e] [I, H] for
        the recompute (None when given)."""
        gate = TensorDescriptor(gu_rows, k_axis=1, f_base=e * 2 * I, f_size=I)
        up = TensorDescriptor(gu_rows, k_axis=1, f_base=e * 2 * I + I, f_size=I)
        down = TensorDescriptor(down_rows, k_axis=0, k_base=e * H, k_len=H)
        if exchange != None and exchange.exchanged(e):  # noqa: E711
            down = exchange.descriptor(e)
        return [down, None if ctx.gate_pre != None else gate, None if ctx.up != None else up]  # noqa: E711

    # more than one resident group of I tiles: per_block's split (the same I tiles on both cores)
    a_ops = [d for d in a_descs(0) if d != None]  # noqa: E711
    a_groups = resident_tile_groups(i_tiles, a_ops, setup)
    a_skip = (fits(a_ops, [i_tiles]), fits(a_ops, a_groups))
    a_groups = a_groups if len(a_groups) > 1 else None
    # W_down loaded on use under LNC2: every expert splits I between the cores instead of rows, each core loading and
    # quantizing only its I columns of W_down once per expert (moe_bwd_mxfp8_i_split.py; round 9b for one full block,
    # round 14d for every expert: a block holding padding skips its chunks of padding only on both cores), no exchange
    # (the experts after the first group have their full blocks' dY / X rows and p staged a fence ahead instead)
    w_down_resident = ExpertPanels.fits(a_ops[0], i_tiles, setup)
    i_split = (ExpertISplit(ctx, i_tiles, [e for g in groups[1:] for e in g])
               if ExpertISplit.applies(ctx, w_down_resident, i_tiles) else None)

    def quantize_down(e):
        """A(e)'s inputs made a fence ahead of it: W_down's exchange, or the I split's staged rows."""
        if i_split != None:  # noqa: E711
            i_split.stage_expert(e)
        if exchange != None and exchange.exchanged(e):  # noqa: E711
            ctx.loops.if_used(e, lambda: exchange.quantize(e))

    # resident weights, all of I in one group and an even number of 128-row chunks per core: the chunks of the
    # expert's blocks run as one pipeline (each chunk's gathers before the previous chunk's epilogue: round 7c)
    pipelined = (a_groups == None and a_skip[0] and ctx.B % (2 * PARTITIONS * split.num_cores) == 0)  # noqa: E711
    # W_down loaded on use elsewhere (LNC2 without whole 128-row chunks per core or with one I tile), or resident in the
    # pipeline up to RESIDENT_DOWN_EXCHANGE_MAX_BYTES for a segment's second A (round 25b: Qwen3-30B-A3B): each core
    # quantizes half of it a fence ahead (A of the first group runs before the first fence, so it quantizes on chip as
    # before); the same panel bytes (a_groups holds)
    exchange = None if i_split != None else DownWeightExchange.of(ctx, groups, w_down_resident, pipelined)  # noqa: E711
    # the pipeline is GpSimd-bound (the gathers' descriptors and the epilogue's products), so there the product dh * a
    # moves to VectorE (round 7c: GPT-OSS 4 x 2048 3244.0 -> 3127.7 us, Qwen3 8 x 1024 1695.7 -> 1619.3 us)
    # With the gate's mask in its product (clamped: a VectorE scalar_tensor_tensor instead of a GpSimd product), dh * a
    # goes back to GpSimd, so each engine keeps its passes per I tile (round 19a; on VectorE too: gpt4 2681.9 us)
    ctx.d_up_engine = (nisa.engine.vector if pipelined and not ctx.gate_mask_in_product else nisa.engine.gpsimd)
    # GpSimd bounds the pipeline, so its d_topk_weights scatters (software DGE) wait in HBM scratch (d_w_partial, this
    # core's rows, plain DMA) until B(e)'s segment, where GpSimd idles (pass B and C are TensorE-bound): round 7c.
    # Block-ordered weights (round 30b) write the output by plain DMA at once: nothing to defer
    ctx.defer_d_w = pipelined and not ctx.weights_blocked
    # with gate_pre and up given, pass A gathers X only for pass C's x_blocks copy: the pipeline leaves it to a loop
    # at the end of the segment before the expert's (behind B and C, where GpSimd idles; before the fence, since
    # C(e) reads both cores' rows): round 7c
    ctx.defer_x = pipelined and ctx.gate_pre != None and ctx.up != None  # noqa: E711

    def x_ahead(experts, part="all"):
        """x_blocks rows of `experts` (the next group's; this core's chunks) when the pipeline does not gather X."""
        for a in experts if ctx.defer_x else []:
            gather_expert_x(ctx, a, part)

    def dy_ahead(experts):
        """dy_blocks rows of `experts` (the group after next; this core's chunks, padding-only ones too) copied by token
        id where the pipeline would gather them beside its GpSimd products; their A (after the next fence) reads
        them by plain DMA (ctx.staged_dy). Only where GpSimd runs the epilogue's d_gate products (the unclamped SwiGLU,
        Qwen3-30B-A3B): the clamped one moved them to VectorE, and there the copies only took pass C's DMA queues
        (GPT-OSS-20B gwz +1.0% / +1.2%). Round 31a."""
        stage = ctx.defer_x and i_split == None and ctx.d_gate_engine == nisa.engine.gpsimd  # noqa: E711
        for a in experts if stage and STAGE_DY_A_FENCE_AHEAD else []:
            ctx.staged_dy.add(a)

            def gather(a=a):
                lo, _, hi = ctx.loops.bounds(a)
                gather_deferred_rows(ctx, ctx.dy, ctx.dy_blocks, lo, ctx.loops.last_block(a), hi, every_chunk=True)
            ctx.loops.if_used(a, gather)

    # the I split's W_down[a] loaded a pass ahead of A(a) for a one-block full expert (the branch of ExpertISplit.expert
    # that takes it): after the B that precedes A(a) in program order, before that segment's staging and C (round
    # 14b); A(a) of the first group and the second group's first expert load their own
    prefetched = {}

    def prefetch_down(a):
        if i_split != None and a != None:  # noqa: E711  (no exchange under the split: a_descs' W_down is HBM's)
            prefetched[a] = i_split.prefetch_down(a, a_descs(a)[0])

    def first_a_panels(group):
        """{a: (A(a)'s weight panels, its first chunk's ChunkInputs or None)} for the first expert a of `group`, the
        first A after the next fence, loaded now (before that fence) where A runs as the pipeline with resident panels
        and W_down[a] is the kernel's input (not the exchange's scratch, which the other core writes before the
        fence); else {} (A loads its own). The loads run in a's if_used (an expert without blocks loads no weights, as
        in rounds 1-2), into tiles allocated outside it that live on to A(a); the first chunk is gathered here only
        without the interleave (gather_first_chunk_ahead, round 26b)."""
        if not pipelined or not group or (exchange != None and exchange.exchanged(group[0])):  # noqa: E711
            return {}
        a = group[0]
        # round 26b, without the interleave (GPT-OSS-20B): W_down staged in pass C's ring and A(a)'s first chunk
        # gathered here, so that neither waits for the barrier (with it, Qwen3 8 x 1024 lost 1.2%: the gathers
        # delayed the W_down load A(a)'s first matmul waits for)
        ring = None if ctx.stages == None else LoadRing(len(ctx.stages), ctx.stages)  # noqa: E711
        w = ExpertPanels.loaded_if(a_descs(a), i_tiles, setup, lambda body: ctx.loops.if_used(a, body), ring)
        return {a: (w, None if interleave else gather_first_chunk_ahead(ctx, a))}

    def pass_a(e, between=None, panels=None, then=None, at_first_tile=None):
        """panels: (A(e)'s weight panels, its first chunk's inputs) from first_a_panels (None: loaded and gathered
        here); then, at_first_tile: I split's expert()."""
        kernel_assert(at_first_tile == None or i_split != None,  # noqa: E711
                      f"pass A of expert {e} takes work at its first I tile only under the I split")
        if pipelined:
            b_lo, _, _ = ctx.loops.bounds(e)
            # W_down staged in pass C's ring, not over C's freed tiles (round 26b: A(a1)'s start, as B's W_gu)
            ring = None if ctx.stages == None else LoadRing(len(ctx.stages), ctx.stages)  # noqa: E711
            w, first = (panels_of(a_descs(e), i_tiles, ring), None) if panels == None else panels  # noqa: E711
            compute_phase1_pipelined_mxfp8(ctx, e, b_lo, ctx.loops.before_last_block(e), ctx.loops.last_block(e), *w,
                                           between=between, first=first)
            return
        def rows(i, w, skip, full):
            compute_phase1_block_grads_mxfp8(ctx, e, i, *w, skip_padding=skip, full=full)

        if i_split != None:  # noqa: E711  (W_down[e] from HBM as it is; a one-block full expert's maybe prefetched)
            i_split.expert(e, a_descs(e), prefetched.get(e), then, at_first_tile)
            prefetched.pop(e, None)  # its panels die after A(e) (the allocator frees a tile its last reference drops)
            return
        per_block(e, a_descs(e), i_tiles, a_groups, rows, a_skip)

    # ---- pass B (split decided and groups counted on core 0's share, the larger: both cores run the same loops) ----
    h_tiles = _blocks(h_lo, h_hi, MOE_N_TILE)
    c0_lo, c0_hi = shard_range(ceil_div(H, SPLIT_ALIGN), split.num_cores, 0)
    h0_tiles = _blocks(min(c0_lo * SPLIT_ALIGN, H), min(c0_hi * SPLIT_ALIGN, H), MOE_N_TILE)

    def b_desc(e):
        return TensorDescriptor(gu_rows, k_axis=0, k_base=e * 2 * I, k_len=2 * I)

    b_groups0 = resident_tile_groups(h0_tiles, [b_desc(0)], setup)
    # skip: (resident: chunk by chunk, flag_tiles: weights per block, core 0's tile count) or False
    b_skip = ((True, 0) if fits([b_desc(0)], [h0_tiles]) else (False, len(h0_tiles)),
              (True, 0) if fits([b_desc(0)], b_groups0) else False)
    b_groups = resident_tile_groups(h_tiles, [b_desc(0)], setup, len(b_groups0)) if len(b_groups0) > 1 else None

    # pass B's stationary d_gate_up panels, quantized along 2I in pass A (docs/moe.md section 10, round 7a): pass A
    # holds every d_gate_up row of its chunks on chip (all of I in one group) while TensorE idles there, so it
    # transposes and quantizes each 128-row chunk once (each core its own rows) and stores the panel's words and
    # scales; pass B loads them instead of transposing and quantizing every row on both cores. Needs pass A's chunks
    # to be pass B's (128 rows from a multiple of 128: B a multiple of 128 per core, so one writer per chunk) and pass
    # B's resident path (it runs only the chunks whose first position holds a routed pair, which pass A computed).
    # Where W_down is loaded per block (a_skip[0] False: the DeepSeek-V3 rank), an expert with one block runs pass A
    # over all of I for every row of the block (no padding skipped), so it makes the panels of every chunk pass B
    # may read, whichever of pass B's paths runs; experts of more blocks run pass A per resident group of I tiles
    # (no chunk's d_gate_up on chip whole) and pass B builds their panels from the bf16 rows (round 8c).
    ctx.d_gu_mx, one_i_group = None, a_groups == None  # noqa: E711
    whole_chunks = setup.is_mx and ctx.B % (PARTITIONS * split.num_cores) == 0
    every_block_panels = whole_chunks and one_i_group and fits([b_desc(0)], [h0_tiles])
    # (not under ExpertISplit: no core holds a chunk's whole 2I; each stores its K tiles there, SplitChunkPanels)
    single_block_panels = (whole_chunks and not a_skip[0] and b_groups != None  # noqa: E711  (else `single` unused)
                           and i_split == None)  # noqa: E711
    if every_block_panels or single_block_panels:
        nk, ns = panel_tile_widths(2 * I, PARTITIONS, setup)
        ctx.d_gu_mx = (nl.ndarray((ctx.N, ctx.B, nk * PARTITIONS), dtype=setup.x4_dtype, buffer=nl.shared_hbm,
                                  name="moe_bwd_d_gate_up_panels"),
                       nl.ndarray((ctx.N, ctx.B, ns * PARTITIONS), dtype=nl.uint8, buffer=nl.shared_hbm,
                                  name="moe_bwd_d_gate_up_panel_scales"))
    ctx.chunk_panels = ChunkPanels.of(ctx, b_groups)  # a multi-block expert's pass-B panels built once (round 22c)

    def b_block(e, i, w, skip, stored_panels, rows=None):
        resident, flag_tiles = skip if skip else (False, 0)
        compute_phase2_hidden_states_grad_mxfp8(ctx, e, i, *w, skip_padding=resident, flag_tiles=flag_tiles,
                                                stored_panels=stored_panels, rows_ahead=rows)

    def pass_b(e, rows=None):  # rows: a one-block expert's DGateUpRowsAhead
        # resident W_gu staged through pass C's kernel-scope ring (when there is one: not with the interleave), idle
        # from C(e - 1)'s last load to C(e)'s first: fresh staging tiles were placed over A(a)'s freed tiles and their
        # DMAs waited for A(a)'s last accesses, so the DMA -> quantize_mx chain of W_gu started only after A(a) and
        # B's first matmul waited for it (round 9a: GPT-OSS 4 x 2048 2962.9 -> 2885.3 us)
        ring = None if ctx.stages == None else LoadRing(len(ctx.stages), ctx.stages)  # noqa: E711
        per_block(e, [b_desc(e)], h_tiles, b_groups,
                  lambda i, w, skip, full: b_block(e, i, w, skip, every_block_panels), b_skip,
                  single=lambda i, w, skip, full: b_block(e, i, w, skip, stored_single(full), rows), ring=ring,
                  loaded=[gu_early.pop(e)] if e in gu_early else None)  # the last group's first B (gu_ahead)

    def stored_single(full):
        """Whether pass A stored a one-block expert's panels: not where it split the block along I (every one-block
        expert under ExpertISplit: no core holds a chunk's whole 2I)."""
        return ctx.d_gu_mx != None and i_split == None  # noqa: E711

    # pass B(e) in pieces between the chunks of the segment's pipelined pass A(a) (round 8a, moe_bwd_mxfp8_interleave)
    # where both passes' resident weight panels fit INTERLEAVE_PANEL_BUDGET_BYTES together: B's matmuls then queue on
    # TensorE between A's chunks instead of after A's last one. Decided on core 0's share (both cores: the same loops)
    interleave = (pipelined and b_skip[0] == (True, 0) and
                  ExpertPanels.bytes_of(a_ops, i_tiles, setup) + ExpertPanels.bytes_of([b_desc(0)], h0_tiles, setup)
                  <= INTERLEAVE_PANEL_BUDGET_BYTES)

    gu_early = {}  # {e: B(e)'s W_gu panels loaded before the fence by gu_ahead}

    def gu_ahead(group):
        """With the interleave, the resident W_gu of B(group[0]), the next segment's first B, loaded before the fence
        (in its if_used; W_gu is a kernel input, read only): a segment of one-block experts started on it
        (round 38d). The last group's first B too (pass_b, no A to interleave with: round 39b)."""
        if interleave and group and GATE_UP_PANELS_BEFORE_FENCE:
            gu_early[group[0]] = ExpertPanels.loaded_if([b_desc(group[0])], h_tiles, setup,
                                                        lambda body, e=group[0]: ctx.loops.if_used(e, body))[0]

    def pass_a_with_b(a, e, a_panels=None):
        """A(a) with B(e)'s pieces between its chunks, then e's blocks that A(a) did not reach; A(a) alone when e has
        no blocks (the segment's order of A(a) and B(e) as without the interleave). a_panels: pass_a's panels."""
        def both():
            w_gu = gu_early.pop(e) if e in gu_early else panels_of([b_desc(e)], h_tiles)[0]
            dx = InterleavedDx(ctx, e, w_gu, compute_phase2_hidden_states_grad_mxfp8)
            ctx.loops.if_used(a, lambda: pass_a(a, between=dx.piece, panels=a_panels))
            if ctx.defer_d_w:  # A(e)'s d_topk_weights (as without the interleave: after A(a), before B(e)'s rest)
                b_lo, _, b_hi = ctx.loops.bounds(e)
                scatter_deferred_d_w(ctx, b_lo, b_hi)
            dx.finish()

        ctx.loops.if_used(e, both)
        ctx.loops.if_unused(e, lambda: ctx.loops.if_used(a, lambda: pass_a(a, panels=a_panels)))

    # ---- pass C (an expert without blocks stores zeros) ----
    d_gu_src, x_src = BlockRowSource(ctx, ctx.d_gu), BlockRowSource(ctx, ctx.x_blocks)
    dy_src, hs_src = BlockRowSource(ctx, ctx.dy_blocks), BlockRowSource(ctx, ctx.hs)
    zeros = nl.ndarray((PARTITIONS, MOE_N_TILE), dtype=wg_dtype, buffer=nl.sbuf)
    nisa.memset(dst=zeros, value=0.0)
    # one ring of MXFP8 staging tiles for all of pass C's operand loads (bounds their run-ahead). With the A/B
    # interleave a ring per pass C(e) instead, so that its 24 KiB are free while A and B hold their weights
    # (round 8a: Qwen3 8 x 1024 1605.9 -> 1597.6 us; without the interleave it does not pay: 1630.7 -> 1635.7 us)
    width = max(SINGLE_BLOCK_LOAD_WIDTH, WEIGHT_GRAD_PSUM_TILES * PARTITIONS, MOE_N_TILE)

    def staging():
        return [nl.ndarray((PARTITIONS, MX_PACK, width), dtype=nl.bfloat16, buffer=nl.sbuf)
                for _ in range(PASS_C_STAGING_BUFFERS)] if setup.is_mx else None
    ctx.stages = None if interleave else staging()

    grads = ((ctx.d_gate_up_weight, d_gu_src, x_src, 2 * I, H), (ctx.d_down_weight, dy_src, hs_src, H, I))
    ctx.resident = ResidentBlocks(ctx, grads)  # an expert of 2..R blocks: pass C reads each block once per core

    single_loads = [0]  # pass C's single-block loads traced so far (each expert's body is traced once): the staging
    # tiles go round across gradients and experts, so no two consecutive loads share one

    def pass_c_single(e, i):
        single_loads[0] = compute_phase3_single_block_expert_mxfp8(ctx, e, i, grads, wg_dtype, first=single_loads[0])

    bias = None if ctx.d_gate_up_bias == None else GateUpBiasGrad(ctx, ctx.d_gate_up_bias)  # noqa: E711

    def pass_c(e):
        if interleave:
            ctx.stages = staging()
        if bias != None:  # noqa: E711  (reads e's d_gate_up scratch rows: after the fence that follows A(e))
            bias.expert(e)
        ctx.loops.if_single(e, lambda i: pass_c_single(e, i))
        ctx.loops.if_multi(e, lambda: compute_phase3_multi_block_grads_mxfp8(ctx, e, grads, wg_dtype))
        ctx.loops.if_unused(e, lambda: store_zero_expert_grads(ctx, e, zeros))
        if interleave:
            ctx.stages = None

    def fence():
        if split.num_cores > 1:
            nisa.core_barrier(data=ctx.d_gu, cores=(0, 1))  # B(e) and C(e) read both cores' scratch rows of e

    # software pipeline over groups of EXPERTS_PER_FENCE consecutive experts: A(first group), fence, then per
    # group A of the next group interleaved with B, C of this one, fence (module docstring and docs/moe.md
    # section 5: why no race; per token the dX adds stay in ascending expert order). Scratch rows are per
    # block (no ring to recycle), so A may run a whole group ahead: one fence per group, not per expert.
    # With the W_down exchange, each core's half of W_down for the group after next is quantized in the segment
    # (for the second group: before the first fence), so a fence lies between its store and every A that reads it.
    # Round 18a (pipelined pass A, X deferred): the first segment holds no B or C, so its X gathers (HBM -> HBM, on the
    # DMA queues only) ran between its last A and the fence with every compute engine idle (GPT-OSS 4 x 2048: 56 us per
    # core); each expert's but the last's now follows its own A and runs under the next A's chunks. And the first A
    # after each fence loads its resident W_down before it (first_a_panels), issued after the segment's last X
    # gathers (so that they keep the queues first: before them, the GPT-OSS Zipf shape lost 133 us) and before the
    # barrier, instead of after it (30 us of loads and 24 us of quantize_mx per core on GPT-OSS). Race-free:
    # X and W_down are kernel inputs (read only), the gathers' x_blocks rows are still written before the fence that
    # precedes every pass C reading them, and an exchanged W_down (written by the other core) is never loaded early.
    # the I split stages the second group's rows in the first group's A, second[n] at A(groups[0][n])'s first I tile
    # (its if_unused where it has no blocks), as the segments stage later[j] in A(ahead[j]); after the first group's A
    # they ran with the compute engines idle (round 35a). Race-free: nothing reads those rows before the first fence
    second = groups[1] if len(groups) > 1 else []
    for n, e in enumerate(groups[0]):
        stage = None if i_split == None or n >= len(second) else (  # noqa: E711
            lambda x=second[n]: i_split.stage_expert(x))
        if stage != None:  # noqa: E711
            ctx.loops.if_unused(e, stage)
        ctx.loops.if_used(e, lambda e=e, s=stage: pass_a(e, at_first_tile=s))
        if ctx.defer_x and n + 1 < len(groups[0]):
            x_ahead([e])
    for e in second if i_split == None else []:  # noqa: E711
        quantize_down(e)
    x_ahead(groups[0][-1:])  # (nothing without ctx.defer_x)
    early = first_a_panels(groups[1] if len(groups) > 1 else [])
    gu_ahead(groups[0])  # (B(groups[0][0]) runs interleaved with A(groups[1][0]), or alone where it is the last)
    fence()
    for n, group in enumerate(groups):
        ahead = groups[n + 1] if n + 1 < len(groups) else []
        later = groups[n + 2] if n + 2 < len(groups) else []
        for j, e in enumerate(group):  # A of the next group's j-th expert, then B and C of this group's
            a_panels = early.pop(ahead[j], None) if j < len(ahead) else None
            if interleave and j < len(ahead):
                pass_a_with_b(ahead[j], e, a_panels)
            else:
                # the I split, W_gu per block: B(e)'s d_gate_up rows (round 20a) and first W_gu K tile (22a) read ahead
                rows = DGateUpRowsAhead(ctx, e, b_desc(e), h_tiles) if i_split and b_groups else None
                # the I split: the staging of later[j]'s rows (HBM -> HBM, no SBUF) issued in A(ahead[j]) after its
                # chunks' reads, before its first I tile's matmuls, where the queues have room; after B(e) it took
                # them from C(e)'s loads (round 34b: ds16 -3.1% / -1.0%; before A(a) in program order only
                # -0.4% / +0.8%, at its last I tile -0.2% / +1.7%)
                stage = None
                if i_split != None and j < len(later):  # noqa: E711
                    stage = lambda x=later[j]: i_split.stage_expert(x)  # noqa: E731
                if stage != None and j < len(ahead):  # noqa: E711  (an unused A(ahead[j]) runs none of its paths)
                    ctx.loops.if_unused(ahead[j], stage)
                elif stage != None:  # noqa: E711
                    stage()
                if rows != None:  # noqa: E711
                    i_split.with_rows(ahead[j] if j < len(ahead) else None, rows, lambda then, a=ahead[j:j + 1],
                                      w=a_panels, s=stage: ctx.loops.if_used(
                                          a[0], lambda: pass_a(a[0], panels=w, then=then, at_first_tile=s)))
                elif j < len(ahead):
                    ctx.loops.if_used(ahead[j], lambda a=ahead[j], w=a_panels, s=stage: pass_a(a, panels=w,
                                                                                           at_first_tile=s))
                if ctx.defer_d_w:  # A(e)'s d_topk_weights: this core wrote and reads its rows (no other core's)
                    b_lo, _, b_hi = ctx.loops.bounds(e)
                    scatter_deferred_d_w(ctx, b_lo, b_hi)
                if i_split != None:  # noqa: E711  (both cores' I tiles of e's blocks, written before the fence)
                    i_split.scatter_expert(e)
                ctx.loops.if_used(e, lambda e=e, r=rows: pass_b(e, r))
                rows = None  # its tiles die after B(e) (the allocator frees a tile when its last reference drops)
            a_panels = None  # and A's early panels and first chunk's inputs after A
            x_ahead(ahead[j:j + 1], "head")  # its blocks before the last two, under this segment's C (round 39b)
            # the next A in program order: this segment's next, or the next segment's first
            prefetch_down(ahead[j + 1] if j + 1 < len(ahead) else (later[0] if later and j == len(group) - 1
                                                                   else None))
            if j < len(later) and i_split == None:  # noqa: E711  (the I split staged later[j] in A(ahead[j]))
                quantize_down(later[j])
            pass_c(e)
            if j == 0:  # after C(e_0), not at the segment's end behind the X copies (q8 1800.0 vs 1870.1 us)
                dy_ahead(later)
        x_ahead(ahead, "tail")
        if n + 1 < len(groups):
            early = first_a_panels(later)
            gu_ahead(ahead)  # (the last group's first B, without the interleave, takes them in pass_b)
            fence()


# ---------------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------------
@nki.jit
def moe_backward_mxfp8_nki(output_grad, hidden_states, topk_weights, gate_up_weight, down_weight,
                           token_position_to_id, token_position_to_slot, expert_block_offsets, gate_pre=None,
                           gate_act=None, up=None, intermediate=None, block_size=128, run_with_lnc2=True,
                           fp8_x4_dtype=nl.float8_e4m3fn_x4, use_scale_packing=True, clamp_limits=None,
                           quant_scheme="1x32", weight_grad_dtype=nl.bfloat16, matmul_precision=None,
                           gate_up_bias_grad=False, checkpoint_layout=CHECKPOINT_LAYOUTS[0], topk_weights_blocks=None,
                           weights_layout=WEIGHTS_LAYOUTS[0]):
    """Backward of y[t] = sum_j p[t, j] · W_down[e]·(silu(W_gate[e]·x[t]) ⊙ W_up[e]·x[t]) over the routed experts.

    Dimensions:
        output_grad dY [T, H], hidden_states X [T, H] (bf16); topk_weights p [T, k] float32;
        gate_up_weight [E, 2I, H] (per expert gate rows then up rows), down_weight [E, H, I] (bf16);
        routing (routing.build_block_layout, int32): token_position_to_id [N*B], token_position_to_slot
        [N*B], expert_block_offsets [E+1]; checkpoints gate_pre / gate_act / up / intermediate [T, k, I]
        bf16 (one row per routed pair, slot t*k + j), or [N*B, I] with checkpoint_layout="block".

    Args:
        block_size: B (static; multiple of 128, at most 512); N = len(token_position_to_id) / B.
        gate_pre, gate_act, up, intermediate: any subset may be None (recomputed per block).
        run_with_lnc2: shard across the two cores of a kernel[2] launch (module docstring).
        fp8_x4_dtype, use_scale_packing, clamp_limits, quant_scheme, weight_grad_dtype, matmul_precision:
            as in the dense mlp_backward_mxfp8_nki (matmul_precision default: "mxfp8" on trn3, "bf16" on trn2).
        gate_up_bias_grad: also return d_gate_up_bias [E, 2I] float32 (GPT-OSS's gate_up bias: per expert the
            sum of its d_gate_up rows; moe_bwd_mxfp8_bias_grad.GateUpBiasGrad, computed in pass C).
        checkpoint_layout: "slot" (default): the checkpoints are [T, k, I], gathered by slot (one software-DGE
            descriptor per row). "block": they are [N*B, I] in block-position order (row p = the pair at position p
            of the routing layout, reference.checkpoints_to_blocks), every padding position's row and every row of an
            unused block +0.0; pass A reads them by plain DMA (docs/moe.md sections 6 and 10, round 11b). The kernel
            cannot check the zeros: a padding row that is not zero enters the weight gradients.
        topk_weights_blocks: with weights_layout="block", p [N*B] float32 in block-position order (row p = the weight
            of the pair at position p, reference.weights_to_blocks), +0.0 at every padding position and in unused
            blocks; None otherwise. topk_weights is then read for its shape only.
        weights_layout: "slot" (default): pass A gathers p from topk_weights by slot and scatters d_topk_weights
            [T, k] by slot (one software-DGE descriptor per row each). "block": it reads p from topk_weights_blocks
            and writes d_topk_weights [N*B] by block position, by plain DMA (docs/moe.md sections 6 and 10, round
            30b); the rows of padding positions and unused blocks are left unwritten (not specified): the caller
            takes the routed positions' rows back to [T, k] (reference.weights_from_blocks, one copy per pair).

    Returns:
        (dx [T, H] bf16, d_topk_weights [T, k] float32 ([N*B] by block position with weights_layout="block"),
        d_gate_up_weight [E, 2I, H], d_down_weight [E, H, I]) in shared HBM, weight gradients in weight_grad_dtype;
        with gate_up_bias_grad
        a fifth output d_gate_up_bias [E, 2I] float32.

    The routing index values are data: the kernel trusts the layout (routing.py validates topk_ids on the
    host); an id >= T or slot >= T*k is a padding sentinel and is skipped. The layout's block_to_expert is
    not an argument: the loops are expert-major (static expert, run-time block range from
    expert_block_offsets), which keeps each expert's weights static and loaded once per expert.
    """
    setup, wg_dtype, on_trn3 = resolve_kernel_options(matmul_precision, fp8_x4_dtype, quant_scheme,
                                                      use_scale_packing, weight_grad_dtype, run_with_lnc2,
                                                      clamp_limits)
    T, H, k, E, I, N, blocked, weights_blocked = check_moe_inputs(
        output_grad, hidden_states, topk_weights, gate_up_weight, down_weight, token_position_to_id,
        token_position_to_slot, expert_block_offsets, dict(gate_pre=gate_pre, gate_act=gate_act, up=up,
                                                           intermediate=intermediate),
        block_size, gate_up_bias_grad, checkpoint_layout, topk_weights_blocks, weights_layout)
    ctx = MoeContext(T, k, E, H, I, block_size, N, setup, CoreSplit(*get_program_sharding_info(run_with_lnc2)),
                     clamp_limits or ClampLimits(), checkpoints_blocked=blocked, weights_blocked=weights_blocked)
    ctx.choose_epilogue_engines(on_trn3)
    ctx.dy, ctx.x = output_grad, hidden_states
    ctx.weights = topk_weights.reshape((T * k, 1))
    # block-ordered p (weights_layout "block"): the [N, B, 1] view MoeContext.pair_weights reads by plain DMA
    ctx.weights_blocks = topk_weights_blocks.reshape((N, block_size, 1)) if weights_blocked else None
    ctx.ids2d = token_position_to_id.reshape((N, block_size))
    ctx.slots2d = token_position_to_slot.reshape((N, block_size))
    ctx.offsets = expert_block_offsets
    ctx.gu_rows = gate_up_weight.reshape((E * 2 * I, H))
    ctx.down_rows = down_weight.reshape((E * H, I))
    ckpt_view = (N, block_size, I) if blocked else (T * k, I)  # MoeContext.checkpoint_rows reads either
    ctx.gate_pre, ctx.gate_act, ctx.up, ctx.intermediate = (
        None if c == None else c.reshape(ckpt_view) for c in (gate_pre, gate_act, up, intermediate))  # noqa: E711
    dx, d_weights = ctx.allocate_hbm(wg_dtype, gate_up_bias_grad)
    moe_backward_mxfp8_base_nki(ctx, wg_dtype)
    if gate_up_bias_grad:
        return dx, d_weights, ctx.d_gate_up_weight, ctx.d_down_weight, ctx.d_gate_up_bias
    return dx, d_weights, ctx.d_gate_up_weight, ctx.d_down_weight
