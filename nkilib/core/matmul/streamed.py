"""K-streamed matmul plans (MatmulPlan's stream): the run, and what such a plan holds at its end.

For a stationary operand too large to keep and moving panels too large to sweep often (the MLP backward's phase 2
at I = 12288: K = 2I = 24576), MatmulPlan keeps a group of g stationary panels and streams the moving operand in quads
of K tiles (tiling.py decides; this module runs it).
"""
from __future__ import annotations

import nki.isa as nisa
import nki.language as nl

from .constants import (MX_K_TILE, PARTITIONS, SCALE_PACK_SLOTS, STREAM_N_TILE, STREAM_STAGING_BUFFERS,
                        STREAM_TAIL_PIECES)
from .panels import LoadRing, PanelGroupBlock, k_tiles, load_panel, matmul_panels, panel_bytes_per_partition


def run_streamed(plan) -> None:
    """All tiles with a group of g stationary panels resident and the moving operand streamed in
    quads of K tiles: for each n block, every K slice is loaded once and multiplied into the g
    PSUM accumulators of the group (each accumulates its K tiles in order, like matmul_panels).

    For a stationary too large to keep and moving panels too large to sweep often (e.g. the MLP
    backward's phase 2 at I = 12288: K = 2I = 24576): PSUM, not SBUF, bounds the moving width (g
    accumulators of STREAM_N_TILE), so g stationary panels share each moving pass (the moving operand
    is read m_tiles / g times). The group's evictions alternate VectorE / ScalarE: they gate the next
    n block's matmuls (ScalarE only once plan.tail_load has issued the next plan's first stationary loads, which
    VectorE quantizes meanwhile; those loads take over this plan's staging ring, MatmulPlan.adopt_staging).
    contiguous_group: the group's panels are slots of one PanelGroupBlock.
    """
    g, m_blocks, n_blocks = plan.stream
    setup, b_op = plan.setup, plan.moving[0].op
    n_k = len(k_tiles(b_op.k_size, setup))
    evictions = 0
    source = plan.stationary[0]
    a_panels = accs = ring = block = None
    tail = False  # the next plan's first loads were issued (tail_load): VectorE quantizes them, evict on ScalarE
    for lo in range(0, len(m_blocks), g):
        group = m_blocks[lo:lo + g]
        # drop the previous group's panels and accumulators (all of PSUM) before loading this group
        # (its PE transposes use PSUM too)
        a_panels = accs = acc = ring = a = block = None
        if plan.contiguous_group:
            # the previous group's block is dead before this one is allocated (program order), so the new
            # block can take its place
            source.release()
            # the last group of a plan whose tail loads the next plan's first panels: in K pieces that die during
            # the last n block, so those loads find SBUF before the last matmul
            last_group = lo + g >= len(m_blocks)
            pieces = STREAM_TAIL_PIECES if last_group and plan.tail_load != None else 1  # noqa: E711
            block = PanelGroupBlock(len(group), source.op.k_size, plan.m_tile, setup, pieces)
            a_panels = []
            for i, (m0, msz) in enumerate(group):
                early = None
                if lo == 0 and plan.preloaded != None and i < len(plan.preloaded):  # noqa: E711
                    early = plan.preloaded[i]
                a_panels.append(source.get(m0, msz, block, i, early))
            plan.preloaded = None
        else:
            a_panels = [source.get(m0, msz) for m0, msz in group]
        # one staging ring for the group's moving quads (placed after its stationary panels): a quad's loads
        # wait for the previous quads' quantizes instead of running ahead into SBUF the group holds
        ring = LoadRing(STREAM_STAGING_BUFFERS)
        # the next n block's first matmuls wait for these tiles' evictions (WAR)
        accs = [nl.ndarray((PARTITIONS, STREAM_N_TILE), dtype=nl.float32, buffer=nl.psum) for _ in group]
        nxt = None  # the next n block's first K quad, loaded before this block's evictions
        for bi, (n0, nsz) in enumerate(n_blocks):
            for t0 in range(0, n_k, SCALE_PACK_SLOTS):
                t1 = min(n_k, t0 + SCALE_PACK_SLOTS)
                if t0 == 0 and nxt != None:  # noqa: E711
                    b, nxt = nxt, None
                else:
                    b = load_panel(b_op, n0, nsz, nsz, setup, t0, t1, ring=ring)
                last = lo + g >= len(m_blocks) and bi + 1 == len(n_blocks) and t1 == n_k
                if last and plan.tail_load != None:  # noqa: E711
                    # the plan's last quad is loaded: its staging ring is free, and the next plan's first
                    # stationary panels load and quantize while the last matmuls and evictions run, staged through
                    # that ring (its tiles free with the last quad's quantizes; fresh ones were placed over tiles
                    # that phase 2's later matmuls read: TP1 phase 4's first dY DMAs waited ~7 us longer)
                    step, nxt_plan = plan.tail_load
                    nxt_plan.adopt_staging(ring.tiles)
                    ring = None
                    step(nxt_plan, "first_stationary")
                    plan.tail_load = step = nxt_plan = None
                    tail = True
                for a, acc in zip(a_panels, accs):
                    matmul_panels(acc[:a.f_pad, :nsz], a, b, setup, t0, t1)  # K=4 K tiles, M=m tile, N=n block
                b = None
            if bi + 1 < len(n_blocks):
                # VectorE runs in program order: quantizing the next block's first quad after this block's
                # evictions left TensorE idle for both at every n block (TP1 phase 2: ~5 us x 16 per core)
                n1, nsz1 = n_blocks[bi + 1]
                nxt = load_panel(b_op, n1, nsz1, nsz1, setup, 0, min(n_k, SCALE_PACK_SLOTS), ring=ring)
            for (m0, msz), acc in zip(group, accs):
                engine = nisa.engine.vector if evictions % 2 == 0 and not tail else nisa.engine.scalar
                plan.epilogue.store_streamed(m0, msz, n0, nsz, acc, engine)
                evictions += 1
    plan.done = len(plan.order)


def tail_held_bytes(plan) -> int:
    """SBUF bytes per partition a K-streamed plan holds once its last quad is loaded: the group's stationary panels,
    that quad (its staging ring is dropped then) and the epilogue's tiles (MatmulPlan.can_load_under_tail)."""
    g, m_blocks, _ = plan.stream
    group = panel_bytes_per_partition(plan.stationary[0].op.k_size, plan.m_tile, plan.setup) * min(g, len(m_blocks))
    quad = panel_bytes_per_partition(SCALE_PACK_SLOTS * MX_K_TILE, STREAM_N_TILE, plan.setup)
    return group + quad + plan.epilogue.held_bytes(STREAM_N_TILE)
