"""How a MatmulPlan overlaps the plans beside it: the answers PhaseGraph asks of it (nkilib/core/phase_graph.py).

The SBUF a plan holds while its last tiles run and the SBUF its first loads take decide whether the next plan's first
panels may load under this plan's tail (prefetch_fits) or under a K-streamed plan's last quad (tail_load_fits);
last_loading_tile says where this plan's own loads end, place_fence_after_first_panel where a sync point inside
its run leaves the next plan's first loads the DMA queues and issue_fence_work where the work that sync point waits
for goes; begin_spread_first_load / advance_spread_load spread the next plan's first panel's quantizes over this
plan's last tiles. MatmulPlan's methods of the same purpose (held_bytes, first_bytes, first_stationary_bytes,
can_prefetch, can_load_under_tail, last_load, fence_after_first_panel, spread_first_load, carry_first_load; run() for
set_fence_work's work) call these; tiling.py decides the tiling they read (order, stream, the PanelSources).
"""
from __future__ import annotations

from .constants import (FENCE_WORK_AFTER_K_TILES, MX_PACK, MX_PANEL_PIECE_BYTES, PREFETCH_MARGIN_BYTES,
                        PREFETCH_STAGING_BUFFERS, SHORT_TAIL_SPREAD_SHARE, SPREAD_COPIES_SPARE_PIECES,
                        SPREAD_COPIES_TAIL_SHARE, SPREAD_FIRST_K_TILES, SPREAD_NEXT_WORDS_FROM_K_TILE,
                        SPREAD_TILES_PER_K_TILE, STAGING_BUFFERS, SWITCH_AHEAD_TILES_PER_K_TILE, usable_sbuf_bytes)
from ..kernel_helpers import ceil_div, kernel_assert
from .panels import k_tiles, panel_bytes_per_partition
from .streamed import tail_held_bytes


def load_bytes(plan, source, width) -> int:
    """SBUF bytes per partition of one load of `source` (a PanelSource of `plan`) `width` columns wide."""
    if source.load_width:
        width = source.load_width
    return panel_bytes_per_partition(source.op.k_size, width, plan.setup)


def held_bytes_at_tail(plan) -> int:
    """Upper bound of the SBUF bytes per partition `plan` holds while its last tiles run (a K chunk that reloads an
    earlier chunk's sums: the fetched fp32 tile of the one it reloads, PartialSums.held_bytes, or a spilling chunk's
    ring of them, SpillEpilogue.held_bytes)."""
    if not plan.order:
        return 0
    total = 0
    for st, op in zip(plan.stationary, plan.stationary_ops):
        if st.resident:
            total += panel_bytes_per_partition(op.k_size, st.hi - st.lo, plan.setup)
        elif st.keep_all:
            total += panel_bytes_per_partition(st.op.k_size, st.hi - st.lo, plan.setup)
        else:
            total += st.capacity * load_bytes(plan, st, plan.order[0][0][1])
    for mv in plan.moving:
        total += panel_bytes_per_partition(mv.op.k_size, plan.n_width if mv.keep_all else plan.n_tile, plan.setup)
    if plan.reload != None and not hasattr(plan.epilogue, "rings_fetched_sums"):  # noqa: E711  (else in its ring)
        total += plan.reload.held_bytes()
    return total + plan.epilogue.held_bytes(plan.n_tile)


def staging_ring_bytes(source, width, buffers: int = 0) -> int:
    """SBUF bytes per partition of `source`'s own ring of bf16 [K, F] staging tiles (PanelSource.staging of them, or
    at most `buffers` when set; `width` columns or its load_width) when its loads are quantized on chip from [K, F]
    (can_load_ahead); else 0."""
    if not source.can_load_ahead():
        return 0
    staging = min(source.staging, buffers) if buffers else source.staging
    return staging * MX_PACK * 2 * (source.load_width or width)


def first_load_bytes(plan, own_rings: bool = False, moving_staging: int = 0) -> int:
    """SBUF bytes per partition that loading `plan`'s first tile's panels takes (with MXFP8 staging): one ring of
    STAGING_BUFFERS tiles as wide as the widest load, or with own_rings, where more, each [K, F] source's own ring
    (PanelSource keeps one per source: the MLP backward's phase 4 loads dY^T and the intermediate through two;
    counting one let its first loads under phase 2's tail at S = 6144, H = 4096, I = 1536 run 12 KiB past SBUF).
    prefetch_fits takes own_rings; PhaseGraph's choice of the next phase compares the one-ring figures (own rings
    there put phase 4 before phase 3 at S = 8192, H = 4096, I = 1536: 1.40518 -> 1.42396 ms, round 40).
    moving_staging: the moving sources' rings at most this deep (MatmulPlan.stage_first_load); the own rings are
    then the count where every load is quantized on chip from [K, F] (the one-ring figure assumes STAGING_BUFFERS and
    stays the floor where a source stages otherwise)."""
    if not plan.order:
        return 0
    (_, msz), (_, nsz) = plan.order[0]
    total, widest, rings, ahead = 0, nsz, 0, True
    for mv in plan.moving:
        total += load_bytes(plan, mv, nsz)
        rings += staging_ring_bytes(mv, nsz, moving_staging)
        ahead = ahead and mv.can_load_ahead()
    for st in plan.stationary:
        if not st.resident:
            total += load_bytes(plan, st, msz)
            widest = max(widest, st.load_width or msz)
            rings += staging_ring_bytes(st, msz)
            ahead = ahead and st.can_load_ahead()
    staging = STAGING_BUFFERS * MX_PACK * 2 * widest if plan.setup.is_mx else 0
    if moving_staging and ahead:
        return total + rings
    return total + (max(staging, rings) if own_rings else staging)


def first_stationary_load_bytes(plan) -> int:
    """SBUF bytes per partition of `plan`'s first tile's stationary loads with their MXFP8 staging ring, when every
    stationary operand is a [K, F] bf16 operand quantized on chip (PanelSource.can_load_ahead); else more than
    SBUF holds (no such load under another plan)."""
    if not plan.order or not all(st.can_load_ahead() for st in plan.stationary):
        return usable_sbuf_bytes() + 1
    (_, msz), _ = plan.order[0]
    total = 0
    for st in plan.stationary:
        total += load_bytes(plan, st, msz) + STAGING_BUFFERS * MX_PACK * 2 * (st.load_width or msz)
    return total


def prefetch_staging(plan, nxt) -> int:
    """How `nxt`'s first panels may load while `plan`'s last tiles run: 0 where they may not (either plan
    K-streamed: those budget all of SBUF; or no fit), -1 where they fit SBUF with PREFETCH_MARGIN_BYTES to spare with
    each [K, F] source's own staging ring (first_load_bytes own_rings), else PREFETCH_STAGING_BUFFERS where they fit
    with nxt's moving rings that deep for its first panel (MatmulPlan.stage_first_load; S = 4096, H = 7168,
    I = 2048: phase 4's 48 KiB ring for its one [4096, 2048] intermediate panel was 5 KiB too many under phase 2).
    Not for a spread first load (MatmulPlan.spread_first_load): its schedule issues each K tile's quantize and copy
    STAGING_BUFFERS K tiles after the staging DMA a ring of that depth began (H = I = 2880, S = 4096: phase 3 under
    phase 4 with the shallower ring 1.09892 / 1.25350 -> 1.11382 / 1.26044 ms)."""
    if plan.stream != None or nxt.stream != None or not nxt.order:  # noqa: E711
        return 0
    budget = usable_sbuf_bytes() - PREFETCH_MARGIN_BYTES
    held = plan.held_bytes()
    if held + nxt.first_bytes(own_rings=True) <= budget:
        return -1
    if not nxt.spread_first and (held + nxt.first_bytes(own_rings=True, moving_staging=PREFETCH_STAGING_BUFFERS) <=
                                 budget):
        return PREFETCH_STAGING_BUFFERS
    return 0


def prefetch_fits(plan, nxt) -> bool:
    """Whether `nxt`'s first panels may load while `plan`'s last tiles run (prefetch_staging)."""
    return prefetch_staging(plan, nxt) != 0


def stage_prefetch(plan, nxt) -> None:
    """Before `nxt`'s first panels load under `plan`'s tail (PhaseGraph's prefetch point): their moving rings as
    prefetch_staging counted them."""
    buffers = prefetch_staging(plan, nxt)
    if buffers > 0:
        nxt.stage_first_load(buffers)


def tail_load_fits(plan, nxt) -> bool:
    """Whether `nxt`'s first stationary panels may load during K-streamed `plan`'s last quad (set_tail_load, where
    prefetch_fits refuses: a K-streamed plan budgets all of SBUF): nxt is not K-streamed, its stationary operand is
    [K, F] quantized on chip (first_stationary_load_bytes), and that load fits beside what `plan` holds once its last
    quad is loaded (streamed.tail_held_bytes) with PREFETCH_MARGIN_BYTES to spare."""
    if plan.stream == None or nxt.stream != None or not nxt.order:  # noqa: E711
        return False
    budget = usable_sbuf_bytes() - PREFETCH_MARGIN_BYTES - tail_held_bytes(plan)
    return nxt.first_stationary_bytes() <= budget


def last_loading_tile(plan) -> int:
    """Index of `plan`'s last tile whose panels are not all loaded by earlier tiles (mirrors PanelSource's
    caching): after it the plan loads nothing, so the next plan's first panels can load then."""
    if plan.stream != None:  # noqa: E711
        return len(plan.order) - 1
    last = 0
    sources = ([(s, 0) for s in plan.stationary] + [(m, 1) for m in plan.moving])
    loaded = [[] for _ in sources]  # first columns each source holds, as its cache would
    for i, ((m0, _), (n0, _)) in enumerate(plan.order):
        for (source, axis), keys in zip(sources, loaded):
            if source.resident:
                continue
            key = source.load_key(n0 if axis else m0)
            if key not in keys:
                if not source.keep_all and len(keys) >= source.capacity:
                    keys.clear()
                keys.append(key)
                last = i
    return last


def place_fence_after_first_panel(plan) -> None:
    """Move set_fence's sync point to the last tile of `plan`'s first moving panel (n-major plans): run() issues the
    next tile's loads, the second panel's, before it checks the fence, so the fence follows them and the next
    phase's first loads, which the fence protects and which start as soon as it passes, do not share the DMA
    queues with that panel (the MLP backward's phase 2 when phase 1 ends earlier: its along-S spread). The later
    panels keep the fenced start's STAGING_BUFFERS ring: a ring of 4 there (rounds 20-26) put four of the second
    panel's loads, begun ~30 us before their first matmul, beside the first panel's last K tile (constants.py
    FENCED_STAGING_BUFFERS). TP8 with the spread, central / pessimistic ms (round 20, ring 4): the fence one tile
    earlier (before the second panel's loads) 0.6600 / 0.7345, here 0.6302 / 0.7139, one / two tiles later 0.6330 /
    0.7190, 0.6330 / 0.7216. No change with one moving panel."""
    second, back = first_panel_return(plan)
    if second == None:  # noqa: E711
        return
    kernel_assert(not back, f"place_fence_after_first_panel needs an n-major plan (the first moving panel's tiles "
                            f"first, then never again; MatmulPlan.first_panel_once), got tiles {back[:4]} back on "
                            f"the panel at n0={plan.order[0][1][0]} after tile {second} left it")
    plan.fence_tile = second - 1


def issue_fence_work(plan, j: int) -> None:
    """At tile j, the fence tile of `plan` (set_fence), before the next tile's loads: begin the next tile's new moving
    panels (PanelSource.load_ahead: their staging DMAs and first FENCE_WORK_AFTER_K_TILES quantizes), then issue the
    work set_fence_work gave, which the fence waits for; the next tile's loads (MatmulPlan.prefetch) issue the rest.
    The same instructions as before in another program order (the work reads and writes nothing the loads touch)."""
    if plan.fence_work == None or plan.fence == None or j != plan.fence[0]:  # noqa: E711
        return
    if j + 1 < len(plan.order):
        (_, _), (n0, nsz) = plan.order[j + 1]
        for _, m in plan.products:
            source = plan.moving[m]
            if source.can_load_ahead() and not source.holds(n0):
                source.load_ahead(n0, nsz, FENCE_WORK_AFTER_K_TILES)
    work, plan.fence_work = plan.fence_work, None
    work()


def switch_load_ahead(plan, j: int) -> None:
    """After tile j's epilogue (plan.switch_ahead > 0: MatmulPlan interleave_switch with the moving panels in a words
    ring, PanelSource.switch_ahead_slots): where the moving panel changes at tile s > j + 1 (the prefetch of tile s - 1
    loads it), begin the new panel's load into its ring slots (PanelSource.load_ahead: its first staging DMAs) and
    quantize its first K tiles, one more after every SWITCH_AHEAD_TILES_PER_K_TILE epilogues, switch_ahead of them by
    that prefetch (the first switch too: the kept stationary operand's block leaves the ring's slots a place). The same
    DMAs and quantizes into the same slots as at the switch, earlier in program order: no bit changes."""
    if not plan.switch_ahead:
        return
    n_cur = plan.order[j][1][0]
    later = [k for k in range(j + 1, len(plan.order)) if plan.order[k][1][0] != n_cur]
    s = later[0] if later else len(plan.order)  # the next panel's first tile
    left = s - j - 1  # tiles of the current panel after j
    per = SWITCH_AHEAD_TILES_PER_K_TILE
    if s >= len(plan.order) or left < 1 or left > plan.switch_ahead * per:
        return
    (_, _), (n0, nsz) = plan.order[s]
    for _, m in plan.products:
        source = plan.moving[m]
        if source.switch_ahead_slots:  # one more K tile every `per` tiles, the last with `left` = 1
            source.load_ahead(n0, nsz, plan.switch_ahead - ceil_div(left, per) + 1)


def first_panel_return(plan):
    """(second, back): the first tile of `plan`'s order on another moving panel than tile 0's (None: one panel
    only), and the later tiles back on tile 0's panel (none in an n-major plan; a grouped n-major plan, m_group, sweeps
    the moving panels once per group of m blocks and comes back to it at each later group)."""
    n_first = plan.order[0][1][0] if plan.order else 0
    second = [j for j in range(len(plan.order)) if plan.order[j][1][0] != n_first]
    if not second:
        return None, []
    return second[0], [j for j in range(second[0], len(plan.order)) if plan.order[j][1][0] == n_first]


def begin_spread_first_load(plan) -> bool:
    """Step "first" of a plan with spread_first (MatmulPlan.spread_first_load), when its first tile's moving panels are
    MXFP8 [K, F] bf16 panels quantized on chip (PanelSource.can_load_ahead): load the first tile's stationary panels,
    begin each moving panel's load (PanelSource.load_ahead: its first STAGING_BUFFERS staging DMAs) and quantize its
    first SPREAD_FIRST_K_TILES K tiles now, from K tile SPREAD_NEXT_WORDS_FROM_K_TILE on (all but the last) half from a
    unit-stride ScalarE copy where plan.spread_copies (MatmulPlan.prefetch_point; else whole); the previous plan's
    run quantizes the rest (advance_spread_load), the first get the remainder. The same DMAs and quantizes of the
    same K tiles as prefetch's, later in program order: no bit changes.
    Returns whether it applied (else the caller prefetches as usual)."""
    if not plan.spread_first or plan.stream != None or plan.reload != None or not plan.order:  # noqa: E711
        return False
    (m0, msz), (n0, nsz) = plan.order[0]
    if not all(plan.moving[m].can_load_ahead() for _, m in plan.products):
        return False
    for s, m in plan.products:
        plan.stationary[s].get(m0, msz)
        mv = plan.moving[m]
        if mv.pending == None and not mv.holds(n0) and plan.spread_copies:  # noqa: E711  (shared operand: once)
            mv.first_next_words_from = SPREAD_NEXT_WORDS_FROM_K_TILE
        mv.load_ahead(n0, nsz, SPREAD_FIRST_K_TILES)
    return True


def spread_fits_tail(plan, nxt) -> bool:
    """Whether `plan`'s tiles left at the prefetch point (after its step "head") take at least 1 /
    SHORT_TAIL_SPREAD_SHARE of nxt's spread first load's schedule: SPREAD_TILES_PER_K_TILE tiles per K tile of its
    first moving panels beyond the SPREAD_FIRST_K_TILES quantized at that point (MatmulPlan.short_tail_loads_whole;
    constants.py)."""
    k_tiles_left = max(len(k_tiles(mv.op.k_size, nxt.setup)) for mv in nxt.moving) - SPREAD_FIRST_K_TILES
    return (len(plan.order) - plan.done) * SHORT_TAIL_SPREAD_SHARE >= k_tiles_left * SPREAD_TILES_PER_K_TILE


def spread_copies_fit(plan, nxt) -> bool:
    """Whether nxt's spread first load, begun at the prefetch point under `plan`'s tail, takes its unit-stride copies
    (MatmulPlan.prefetch_point, SPREAD_NEXT_WORDS_FROM_K_TILE): where at most 1 / SPREAD_COPIES_TAIL_SHARE of `plan`'s
    tiles are left, and where that load fits beside what `plan` holds at its tail (held_bytes, first_bytes with own
    rings) with SPREAD_COPIES_SPARE_PIECES words pieces (MX_PANEL_PIECE_BYTES) to spare beyond PREFETCH_MARGIN_BYTES:
    each copy is the first access of the next K tile's words piece, placed before its own K tile's quantize
    (constants.py)."""
    if (len(plan.order) - plan.done) * SPREAD_COPIES_TAIL_SHARE > len(plan.order):
        return False
    spare = usable_sbuf_bytes() - PREFETCH_MARGIN_BYTES - plan.held_bytes() - nxt.first_bytes(own_rings=True)
    return spare >= SPREAD_COPIES_SPARE_PIECES * MX_PANEL_PIECE_BYTES


def advance_spread_load(plan, j: int) -> None:
    """After tile j's epilogue of `plan`, whose run carries the next plan's spread first load
    (MatmulPlan.carry_first_load, from tile lo on): one more K tile of each of its begun moving loads after every
    SPREAD_TILES_PER_K_TILE tiles."""
    nxt, lo = plan.carried
    if (j - lo) % SPREAD_TILES_PER_K_TILE != SPREAD_TILES_PER_K_TILE - 1:
        return
    for mv in nxt.moving:
        if mv.pending != None:  # noqa: E711
            mv.pending.advance(1)
