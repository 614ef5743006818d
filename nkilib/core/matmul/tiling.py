"""A matmul plan's tiling, decided once when the plan is built (MatmulPlan.__init__ calls these).

choose_tiling: which operand's panels stay resident (all moving panels, m-major > all stationary panels, n-major >
the smaller whole operand by the resident rule > K-streamed groups > stationary groups), the n tile that fits, the
PanelSources with their staging rings, and the tile order. plan_k_interleaved_spans: the PSUM accumulators and spans
of the K-interleaved tiles at moving panel switches (interleave_switch) and in the lead (interleave_lead). The
constants are constants.py's; the running plan (its steps, spans and fences) is plan.py's.
"""
from __future__ import annotations

from ..kernel_helpers import ceil_div, kernel_assert
from .constants import (COLD_PERMUTE_INTO_NEXT_WORDS, COLD_SLOT_DMA_K_TILES, COLD_STAGING_BUFFERS,
                        COLD_STAGING_MAX_M_TILES, FENCED_STAGING_BUFFERS, LEAD_INTERLEAVE_SKEW, LEAD_INTERLEAVE_TILES,
                        LEAD_PANEL_PIECE_BYTES, MOVING_PANEL_BUDGET_BYTES, PANEL_CACHE_BUDGET_BYTES, PSUM_BANK_BYTES,
                        PSUM_BUFFERS, PSUM_BYTES, RESIDENT_HEADROOM_BYTES, RESIDENT_KEPT_MOVING_IN_PIECES,
                        RESIDENT_OPERAND_BUDGET_BYTES, SPLIT_ALIGN,
                        STAGING_BUFFERS, STATIONARY_GROUP_BUDGET_BYTES, STATIONARY_LOAD_WIDTH,
                        STATIONARY_PANEL_BUDGET_BYTES, STREAM_N_TILE, STREAM_STATIONARY_BUDGET_BYTES,
                        STREAM_STATIONARY_HEADROOM_BF16_BYTES, STREAM_STATIONARY_HEADROOM_BYTES,
                        SWITCH_AHEAD_SLOTS, SWITCH_INTERLEAVE_TILES, SWITCH_NEXT_WORDS_FROM_K_TILE,
                        TRANSPOSE_PSUM_BANKS, usable_sbuf_bytes)
from .panels import panel_bytes_per_partition
from .sizing import fit_width
from .sources import PanelSource, blocks, tile_order


def stationary_load_width(op, m_tile, setup):
    """Super-panel width for a [K, F] stationary operand: whole m tiles, about STATIONARY_LOAD_WIDTH
    columns within the stationary budget (K-contiguous and pre-quantized operands gain nothing from
    it: 0 = per tile; panel-layout operands get wider DMA runs from it)."""
    if op.k_axis != 0 or (op.prequantized and not op.panel_layout):
        return 0
    wanted = max(1, STATIONARY_LOAD_WIDTH // m_tile) * m_tile
    return fit_width(wanted, [op], setup, STATIONARY_PANEL_BUDGET_BYTES, m_tile)


def _resident_operand(moving_bytes, stationary_bytes):
    """(keep_moving, keep_stationary, moving panel budget) when neither operand fits PANEL_CACHE_BUDGET_BYTES:
    keep the smaller whole operand resident when it fits RESIDENT_OPERAND_BUDGET_BYTES, so that both are read
    and quantized once (instead of the moving panels swept once per stationary group). A resident stationary
    leaves the moving panels what SBUF has left, for two of them (the next one loads while the last m tiles
    of the current one run). Neither fits: (False, False, MOVING_PANEL_BUDGET_BYTES), groups as before.
    (TP1, I = 12288: phase 3 keeps X [S, H] and reads it once per core instead of 6 times; phase 4 keeps dY.)"""
    smaller = min(moving_bytes, stationary_bytes)
    if smaller > RESIDENT_OPERAND_BUDGET_BYTES:
        return False, False, MOVING_PANEL_BUDGET_BYTES
    if moving_bytes == smaller:
        return True, False, MOVING_PANEL_BUDGET_BYTES
    left = (usable_sbuf_bytes() - RESIDENT_HEADROOM_BYTES - stationary_bytes) // 2
    return False, True, min(MOVING_PANEL_BUDGET_BYTES, left)


def choose_tiling(plan, stationary, moving, config, products, resident, groups, keep_whole, lead_n_major,
                  cold_staging, fenced_start):
    """Set `plan`'s keep_moving, n_tile, m_tile, stationary / moving PanelSources, fenced_start, stream and order for
    its non-empty ranges (MatmulPlan's docstring says what each option does). Returns (lead, moving_by_rule): the
    m tiles of the lead run n-major (lead_n_major), and whether the moving operand is kept whole by
    _resident_operand rather than by the panel cache (interleave_lead's condition)."""
    setup = plan.setup
    (m_lo, m_hi), (n_lo, n_hi) = plan.ranges
    moving_bytes = sum(panel_bytes_per_partition(op.k_size, n_hi - n_lo, setup) for op in moving)
    stationary_bytes = sum(panel_bytes_per_partition(op.k_size, m_hi - m_lo, setup) for op in stationary)
    plan.keep_moving = moving_bytes <= PANEL_CACHE_BUDGET_BYTES
    keep_stationary = not plan.keep_moving and stationary_bytes <= PANEL_CACHE_BUDGET_BYTES
    moving_budget = MOVING_PANEL_BUDGET_BYTES
    moving_by_rule = False  # the moving operand kept whole by _resident_operand (interleave_lead)
    if ((groups or keep_whole) and resident == None and len(products) == 1 and not plan.keep_moving  # noqa: E711
            and not keep_stationary):
        plan.keep_moving, keep_stationary, moving_budget = _resident_operand(moving_bytes, stationary_bytes)
        moving_by_rule = plan.keep_moving
    plan.n_tile = fit_width(config.n_tile, moving, setup, moving_budget, SPLIT_ALIGN)
    m_group = 0
    if resident != None:  # noqa: E711
        plan.stationary, plan.m_tile = [resident], resident.m_tile
    else:
        for op in stationary:
            load_width = stationary_load_width(op, plan.m_tile, setup)
            # neither operand fits: keep a group of stationary loads (each quantized once) and sweep the
            # moving panels once per group instead of once per m tile
            capacity = 1
            if groups and not plan.keep_moving and not keep_stationary:
                load = load_width or plan.m_tile
                capacity = max(1, int(STATIONARY_GROUP_BUDGET_BYTES //
                                      panel_bytes_per_partition(op.k_size, load, setup)))
                m_group = capacity * load // plan.m_tile
            plan.stationary.append(PanelSource(op, setup, pad_even=True, keep_all=keep_stationary, lo=m_lo,
                                               hi=m_hi, load_width=load_width, capacity=capacity))
    plan.moving = [PanelSource(op, setup, pad_even=False, keep_all=plan.keep_moving, lo=n_lo, hi=n_hi)
                   for op in moving]
    if resident != None and plan.keep_moving and setup.is_mx:  # noqa: E711
        # the resident stationary panels (one allocation per m tile) are strewn over SBUF, and every moving panel
        # kept whole is live among them: their words go in pieces, however small (RESIDENT_KEPT_MOVING_IN_PIECES)
        for mv in plan.moving:
            mv.words_in_pieces = RESIDENT_KEPT_MOVING_IN_PIECES
    if cold_staging and plan.keep_moving and ceil_div(m_hi - m_lo, plan.m_tile) <= COLD_STAGING_MAX_M_TILES:
        # loaded once, all at the cold start: the first tile waits for every K tile of them, and a deeper ring
        # keeps more of their DMAs in flight while VectorE quantizes the first ones; the first panel's first K
        # tiles in one DMA per slot, so that they take more of the DMA queues' shares and land first; half of
        # each K tile quantized from a unit-stride copy that ScalarE makes
        for mv in plan.moving:
            mv.staging = COLD_STAGING_BUFFERS
            mv.first_slot_dma_k_tiles = COLD_SLOT_DMA_K_TILES
            mv.next_words_from = 0 if COLD_PERMUTE_INTO_NEXT_WORDS else -1
    plan.fenced_start = (fenced_start and resident != None and setup.is_mx and  # noqa: E711
                         not plan.keep_moving and all(mv.can_load_ahead() for mv in plan.moving))
    if plan.fenced_start:
        # step "first" runs before a fence (the core barrier waits for every earlier instruction): only the first
        # FENCED_FIRST_K_TILES K tiles of the first moving panel are quantized there; the first span of tiles
        # (interleave_switch, which MatmulPlan turns on) multiplies each later K tile as VectorE quantizes it
        # after the fence
        # the later panels' loads (issued after the kernel's fence inside this plan) back to STAGING_BUFFERS in
        # flight: the model shares the DMA queues evenly, so five at once all land late
        for mv in plan.moving:
            mv.staging, mv.later_staging = FENCED_STAGING_BUFFERS, STAGING_BUFFERS
    # K-streamed groups (see _run_streamed) when they hold more stationary panels than m_group
    b_op = moving[0]
    if m_group and len(products) == 1 and (b_op.k_axis == 0 or b_op.prequantized):
        per_tile = panel_bytes_per_partition(stationary[0].k_size, plan.m_tile, setup)
        # the budget is tuned for trn3's 256 KiB; smaller SBUFs (trn2: 224 KiB) keep the same headroom
        headroom = STREAM_STATIONARY_HEADROOM_BYTES if setup.is_mx else STREAM_STATIONARY_HEADROOM_BF16_BYTES
        budget = min(STREAM_STATIONARY_BUDGET_BYTES, usable_sbuf_bytes() - headroom)
        g = min(int(budget // per_tile), PSUM_BYTES // (STREAM_N_TILE * 4), ceil_div(m_hi - m_lo, plan.m_tile))
        if g > m_group:
            plan.stream = (g, blocks(m_lo, m_hi, plan.m_tile), blocks(n_lo, n_hi, STREAM_N_TILE))
            plan.stationary = [PanelSource(stationary[0], setup, pad_even=True, keep_all=False, lo=m_lo,
                                           hi=m_hi, capacity=g)]
    lead = 1
    if lead_n_major and plan.keep_moving and resident == None:  # noqa: E711
        lead = max(1, plan.stationary[0].load_width // plan.m_tile)
    plan.order = tile_order(blocks(m_lo, m_hi, plan.m_tile), blocks(n_lo, n_hi, plan.n_tile),
                            m_outer=plan.keep_moving, m_group=m_group, lead=lead)
    return lead, moving_by_rule


def plan_k_interleaved_spans(plan, stationary, moving, products, reload, interleave_switch, interleave_lead,
                             interleave_first_loads, keep_whole, lead, moving_by_rule):
    """Set `plan`'s PSUM accumulator count, extra accumulators, switch / first spans and span skew for its
    K-interleaved tiles (interleave_switch, interleave_lead: MatmulPlan's docstring), and the moving sources'
    unit-stride copies at switches; refuses either with reload (a K-chunked plan)."""
    plan.extra_accumulators = 0  # interleave_switch: accumulators added at the first switch
    plan.switch_ahead = 0  # the next moving panel's K tiles quantized ahead of each switch (overlap.switch_load_ahead)
    kernel_assert(not (interleave_switch and reload != None),  # noqa: E711
                  "interleave_switch and reload (a K-chunked plan) cannot be combined: the K-interleaved "
                  f"matmuls do not put earlier chunks' sums back, got interleave_switch={interleave_switch!r}")
    if interleave_switch and not plan.keep_moving:
        # the span's tiles must not take the accumulator of the tile before it, whose epilogue VectorE runs only
        # after the new panel's quantizes (program order): one accumulator more than the span. Beside them the
        # PE transposes of the first n block (which loads every stationary panel) take TRANSPOSE_PSUM_BANKS;
        # with the stationary operand kept whole and the moving panels quantized from [K, F] (no transposes),
        # none follow, and the first switch adds accumulators in their banks
        banks = ceil_div(plan.n_tile * 4, PSUM_BANK_BYTES) * len(products)
        total = PSUM_BYTES // PSUM_BANK_BYTES
        count = min(SWITCH_INTERLEAVE_TILES + 1, (total - TRANSPOSE_PSUM_BANKS) // banks)
        later = count
        if (all(st.resident or st.keep_all for st in plan.stationary) and
                all(op.k_axis == 0 or op.prequantized for op in moving)):
            later = min(SWITCH_INTERLEAVE_TILES + 1, total // banks)
        if count > PSUM_BUFFERS:
            plan.psum_count, plan.extra_accumulators, plan.switch_span = count, later - count, later - 1
            # cold first tiles meet their moving panel as it is quantized, like a switch (see the docstring); a
            # fenced start's span takes every accumulator: no tile of this plan precedes it, and four tiles'
            # matmuls per K tile match VectorE's quantize of the next one (TP8 phase 2: 0.6302 -> 0.6280 ms;
            # interleave_first_loads' cold span keeps switch_span: TP1's phase 4 models the same either way)
            if plan.fenced_start:
                plan.first_span = later
            elif interleave_first_loads and all(
                    op.k_axis == 0 or op.prequantized for op in list(stationary) + list(moving)):
                plan.first_span = plan.switch_span
    if interleave_switch and keep_whole and not plan.keep_moving:
        # the stationary operand kept whole, the moving panels streamed one at a time: each new panel's K tiles
        # are quantized at its switch, half of their columns from a unit-stride ScalarE copy
        for mv in plan.moving:
            if mv.can_load_ahead():
                mv.next_words_from = SWITCH_NEXT_WORDS_FROM_K_TILE
            if mv.takes_words_ring():  # the next panel's first K tiles in slots of their own, quantized ahead
                mv.switch_ahead_slots = SWITCH_AHEAD_SLOTS
                plan.switch_ahead = SWITCH_AHEAD_SLOTS - 1
        # and the stationary operand kept whole in one block (PanelSource.kept_slots): its panels, placed next-fit one
        # by one among the first moving panel's epilogues, left SBUF in gaps of at most 8 KiB, where the ring's ahead
        # slots found no placement
        m_blocks = []  # the plan's m blocks (a list: the restricted NKI subset, docs/kernel-structure.md)
        for m, _ in plan.order:
            if m not in m_blocks:
                m_blocks.append(m)
        for st in plan.stationary:
            if plan.switch_ahead and st.keep_all and not st.resident and st.setup.is_mx and not st.load_width:
                st.kept_slots = len(m_blocks)
    kernel_assert(not (interleave_lead and reload != None),  # noqa: E711
                  "interleave_lead and reload (a K-chunked plan) cannot be combined: the K-interleaved "
                  f"matmuls do not put earlier chunks' sums back, got interleave_lead={interleave_lead!r}")
    if interleave_lead and moving_by_rule and lead > 1:
        # the lead's tiles meet each moving panel as it is loaded and quantized for the first time: TensorE
        # multiplies each new K tile into LEAD_INTERLEAVE_TILES tiles instead of waiting for the next one
        plan.switch_span, plan.span_skew = LEAD_INTERLEAVE_TILES, LEAD_INTERLEAVE_SKEW
        plan.first_span = LEAD_INTERLEAVE_TILES
        for mv in plan.moving:
            mv.piece_bytes = LEAD_PANEL_PIECE_BYTES
