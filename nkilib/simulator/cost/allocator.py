"""Finite SBUF/PSUM: the allocator's reuse dependencies and the occupancy a schedule needs."""
from __future__ import annotations

from dataclasses import dataclass

from ..hardware import TargetSpec


@dataclass(frozen=True)
class UnplaceableTile:
    """An on-chip tile the allocator model could place only over live tiles it cannot wait for: the
    kernel's plan does not fit the target (fragmentation), so its modeled time is not valid."""

    program: int
    buffer: str  # "sbuf" / "psum"
    name: str
    bytes_per_partition: int  # PSUM rounded to whole banks
    capacity_bytes_per_partition: int
    reason: str

    def message(self) -> str:
        return (f"core {self.program}: {self.buffer.upper()} tile '{self.name}' "
                f"({self.bytes_per_partition / 1024:.1f} KiB per partition) has no placement in the target's "
                f"{self.capacity_bytes_per_partition / 1024:.0f} KiB that does not overlap live tiles it cannot "
                f"wait for ({self.reason}; docs/cost-model.md, Allocator)")


def _memory_reuse_deps(records, target: TargetSpec, preds=None, placements: dict | None = None,
                       queue_of=None, unplaceable: list | None = None) -> dict:
    """Dependencies that finite SBUF/PSUM impose: seq -> predecessor seqs.

    Each on-chip allocation lives from the first to the last trace record that touches it (the
    liveness a compiler's allocator sees, in program order) and is placed in its core's
    per-partition address space (PSUM in whole 2 KiB banks; placement policy below). When a tile is placed on bytes that
    an earlier, dead tile occupied, every access of it (not only the first in program order: two DMAs
    filling disjoint parts of a tile have no data dependency between them) must wait for the final accesses of that tile
    (WAR/WAW through the reused memory): the last one on each in-order engine and every DMA (DMA
    queues complete out of order, so the last access in program order need not end last). Without
    this every allocation would be fresh memory and the schedule could overlap more buffers than
    the core holds.
    Placement is next-fit: the search starts where the previous allocation of that space ended and
    wraps around, so the memory freed longest ago is reused first (an allocator that leaves room
    for overlap when there is space; the NKI allocator's policy is not documented — INFERRED). A PSUM
    tile of 2, 4 or 8 banks starts at a multiple of its own size (`_psum_alignment`: two 4-bank
    accumulators always fit PSUM's 8 banks together, wherever the cursor stands — INFERRED,
    docs/simulator.md#choice-psum-multi-bank-placement).
    If fragmentation leaves no gap (the program-order live set fits, the simulator checks that, but not
    in one piece), the tile is placed over live tiles that die soonest and waits for their final
    accesses (a compiler would have placed them apart; waiting is what the overlap would cost), at the
    lowest address where none of those accesses depends on the tile's first access (`preds`: the data
    dependencies, else no such placement is tried). If there is none, the plan has no placement for the
    tile: it is placed at 0 without waiting (so the schedule still completes) and reported in
    `unplaceable`, a plan error (the scheduled occupancy need not show it: the live bytes may fit, only
    not in one piece). So is a tile whose wait for a later access a later wait turned into a cycle (that
    wait is dropped at the end; the tile then overlaps a live tile it does not wait for).
    `queue_of` (optional, seq -> in-order engine queue or None): the scheduler's queues, where a
    software-DGE DMA waits in GpSimd's queue; default: an instruction's engine, DMAs in none. The
    "depends" test above follows these queues too, else a wait could close a cycle through one.
    `placements` (optional dict, for diagnostics) receives key -> (lo, hi, first seq) and, under
    "fragmented", one (key, bytes, waited) entry per fragmentation fallback.
    `unplaceable` (optional list) receives one `UnplaceableTile` per tile placed over live tiles it
    cannot wait for (the rule: docs/cost-model.md, "Allocator"); `CostReport.plan_errors` reports them.
    """
    first, last, size, names = {}, {}, {}, {}
    tails = {}  # key -> {engine: last seq} (in-order engines) and {("dma", seq): seq} (every DMA)
    for r in records:
        for op in r.reads + r.writes:
            if op.buffer not in ("sbuf", "psum") or not op.alloc_bytes_per_partition:
                continue
            key = (r.program, op.buffer, op.storage_id)
            first.setdefault(key, r.seq)
            last[key] = r.seq
            tails.setdefault(key, {})[("dma", r.seq) if r.engine == "dma" else r.engine] = r.seq
            nbytes = op.alloc_bytes_per_partition
            if op.buffer == "psum":
                nbytes = -(-nbytes // target.psum_bank_bytes) * target.psum_bank_bytes
            size[key] = nbytes
            names.setdefault(key, op.name)
    capacity = {"sbuf": target.sbuf_bytes_per_partition, "psum": target.psum_bytes_per_partition}
    starts, ends = {}, {}
    for key, seq in first.items():
        starts.setdefault(seq, []).append(key)
    for key, seq in last.items():
        ends.setdefault(seq, []).append(key)
    live = {}  # (program, buffer) -> {key: (lo, hi)}
    dead = {}  # (program, buffer) -> list of (lo, hi, final access seqs)
    cursor = {}  # (program, buffer) -> end of the previous placement (next-fit)
    deps = {}

    prev_on_engine, last_on_engine = {}, {}
    for r in records:
        queue = queue_of(r.seq) if queue_of is not None else (r.engine if r.engine != "dma" else None)
        if queue is not None:
            key = (r.program, queue)
            prev_on_engine[r.seq] = last_on_engine.get(key)
            last_on_engine[key] = r.seq

    waits_later = set()  # seqs given a wait for a later access (fragmentation fallback)
    fallback_waits = {}  # seq -> [(key, its waits)] for the tiles the fragmentation fallback placed at that seq

    def report_unplaceable(key, reason):
        if unplaceable is not None:
            unplaceable.append(UnplaceableTile(key[0], key[1], names[key], size[key], capacity[key[1]], reason))

    def depends(later, first):
        """True if `later` waits (data dependency, in-order engine queue or a wait added here) on `first`,
        transitively. Below `first` only a seq with a wait for a later access can lead back to it."""
        if preds is None:
            return True
        stack, seen = [later], set()
        while stack:
            q = stack.pop()
            if q == first:
                return True
            if (q < first and q not in waits_later) or q in seen:
                continue
            seen.add(q)
            stack.extend(preds[q])
            stack.extend(deps.get(q, ()))
            if prev_on_engine.get(q) is not None:
                stack.append(prev_on_engine[q])
        return False

    def fit(ranges, nbytes, begin, limit, align):
        lo = -(-begin // align) * align
        for a, b in ranges:
            if b <= lo:
                continue
            if lo + nbytes <= a:
                break
            lo = -(-max(lo, b) // align) * align
        return lo if lo + nbytes <= limit else None

    reuse_waits = {}  # key -> final accesses of the tiles whose bytes it took (every access of it waits)
    for r in records:
        for key in starts.get(r.seq, ()):
            waited = set()
            space = (key[0], key[1])
            ranges = sorted(live.setdefault(space, {}).values())
            nbytes, cap = size[key], capacity[key[1]]
            align = _psum_alignment(nbytes, target.psum_bank_bytes) if key[1] == "psum" else 1
            lo = fit(ranges, nbytes, cursor.get(space, 0), cap, align)
            if lo is None:
                lo = fit(ranges, nbytes, 0, cap, align)  # wrap around
            graveyard = dead.setdefault(space, [])
            if lo is None:  # fragmented: wait for the live tiles it covers (see docstring)
                lo, waits = _place_over_live(live[space], tails, last, nbytes, cap, r.seq, depends, align)
                deps.setdefault(r.seq, set()).update(waits)  # may include accesses after r (none depends on r)
                if any(q > r.seq for q in waits):
                    waits_later.add(r.seq)
                waited.update(waits)
                fallback_waits.setdefault(r.seq, []).append((key, set(waits)))
                if lo is None:
                    lo = 0
                    report_unplaceable(key, "every placement overlaps live tiles whose final accesses depend "
                                            "on this tile's first access")
                if placements is not None:
                    placements.setdefault("fragmented", []).append((key, nbytes, bool(waits)))
            hi = lo + nbytes
            cursor[space] = hi
            kept = []
            for a, b, q in graveyard:
                if a < hi and lo < b:
                    waited.update(q)
                    if a < lo:
                        kept.append((a, lo, q))
                    if hi < b:
                        kept.append((hi, b, q))
                else:
                    kept.append((a, b, q))
            dead[space] = kept
            live[space][key] = (lo, hi)
            if waited:
                reuse_waits[key] = waited
            if placements is not None:
                placements[key] = (lo, hi, r.seq)
        if reuse_waits:
            for op in r.reads + r.writes:
                waited = reuse_waits.get((r.program, op.buffer, op.storage_id))
                if waited:
                    deps.setdefault(r.seq, set()).update(q for q in waited if q < r.seq)  # later ones: see above
        for key in ends.get(r.seq, ()):
            reuse_waits.pop(key, None)
            space = (key[0], key[1])
            lo, hi = live[space].pop(key)
            dead[space].append((lo, hi, tuple(tails[key].values())))
    # a wait for a later access, chosen before later waits existed, may now close a cycle (that access
    # waits, through them, for the waiting one): drop it; the tile is then placed without waiting and
    # the scheduled occupancy shows the excess (as when no placement was valid). Every cycle holds
    # such a wait (all other edges point back in program order), so none remains.
    for seq in sorted(waits_later):
        dropped = set()
        for q in sorted(q for q in deps[seq] if q > seq):
            if depends(q, seq):
                deps[seq].discard(q)
                dropped.add(q)
        for key, waits in fallback_waits.get(seq, ()):
            if waits & dropped:
                report_unplaceable(key, "its wait for a live tile's final access closed a dependency cycle")
    return deps



def _psum_alignment(nbytes: int, bank_bytes: int) -> int:
    """The byte alignment of a PSUM tile's start (nbytes in whole banks): a tile of 2, 4 or 8 banks starts at a
    multiple of its own size, any other at a bank boundary (docs/simulator.md#choice-psum-multi-bank-placement).
    Aligned power-of-two slots do not straddle each other, so two 4-bank tiles live together find banks 0-3 and 4-7
    wherever next-fit's cursor stands (phase 4's accumulators at N = 1792 fp32); tiles of 3, 5-7 banks keep next-fit's
    placement (aligning them too moved a README figure: docs/dense-performance.md round 50b)."""
    banks = nbytes // bank_bytes
    return nbytes if banks & (banks - 1) == 0 else bank_bytes


def _place_over_live(live, tails, last, nbytes, cap, first_seq, depends, align=1):
    """(lo, seqs to wait for) for a tile that fits no gap: candidate starts are 0 and the ends of live
    tiles (rounded up to `align`); the covered live tiles must not depend on `first_seq`; the one whose covered tiles die
    soonest (program order) wins. No valid candidate: (None, ()) — no placement (a plan error)."""
    best = None
    for lo in sorted({0} | {-(-b // align) * align for a, b in live.values()}):
        hi = lo + nbytes
        if hi > cap:
            continue
        covered = [k for k, (a, b) in live.items() if a < hi and lo < b]
        waits = [q for k in covered for q in tails[k].values()]
        if any(q > first_seq and depends(q, first_seq) for q in waits):
            continue
        cost = max((last[k] for k in covered), default=-1)
        if best is None or cost < best[0]:
            best = (cost, lo, [q for q in waits if q != first_seq])
    return (best[1], best[2]) if best else (None, ())


def scheduled_occupancy(sched, target: TargetSpec) -> list:
    """Peak SBUF/PSUM bytes per partition per core *under the modeled schedule*.

    The simulator's capacity check counts a tile live while Python can reach it (program order),
    but the schedule overlaps loads of the next tile with work on the previous one, which on
    hardware needs both buffers at once. Here an on-chip allocation is live from the start of the
    first instruction touching it to the end of the last one (PSUM rounded to whole banks, as in
    the capacity rule); the sweep gives the occupancy the modeled overlap really requires.
    """
    spans = {}
    for i, r in enumerate(sched.records):
        for op in r.reads + r.writes:
            if op.buffer not in ("sbuf", "psum") or not op.alloc_bytes_per_partition:
                continue
            key = (r.program, op.storage_id)
            lo, hi, buf, nbytes = spans.get(key, (sched.start[i], sched.end[i], op.buffer,
                                                  op.alloc_bytes_per_partition))
            spans[key] = (min(lo, sched.start[i]), max(hi, sched.end[i]), buf, nbytes)
    bank = target.psum_bank_bytes
    events = {}
    for (prog, _), (lo, hi, buf, nbytes) in spans.items():
        if buf == "psum":
            nbytes = -(-nbytes // bank) * bank
        events.setdefault((prog, buf), []).extend([(lo, nbytes), (hi, -nbytes)])
    peaks = [{"sbuf": 0, "psum": 0} for _ in range(sched.lnc)]
    for (prog, buf), evs in events.items():
        live = 0
        for _, delta in sorted(evs, key=lambda e: (e[0], e[1])):  # frees before allocations at equal times
            live += delta
            peaks[prog][buf] = max(peaks[prog][buf], live)
    return peaks

