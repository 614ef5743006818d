"""Scheduler: places every trace record on its core's engines, DMA queues and barriers."""
from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass, field

from ..hardware import resolve_target
from .allocator import _memory_reuse_deps
from .dependencies import _Tracker
from .operands import CostModelError
from .pricing import _engine_clock, instr_cost


@dataclass
class Schedule:
    """Result of `schedule`: per-instruction times (seconds from kernel start) and engine totals."""

    target: str
    lnc: int
    records: list
    costs: list
    start: list
    end: list
    blocker: list  # seq of the instruction/event that determined each start (None: time 0)
    makespan: float
    engine_busy: dict  # (program, engine) -> busy seconds (DMA: time with >= 1 transfer in flight)
    dma_bytes: dict  # program -> bytes moved
    hbm_bytes: dict  # program -> HBM bytes
    unplaceable: list = field(default_factory=list)  # allocator.UnplaceableTile: plan errors (no valid placement)

    def engine_of(self, i) -> str:
        return self.costs[i].engine



class _Timeline:
    """Busy intervals of one resource (a DGE instance, the shared SBUF bus); earliest-fit placement."""

    def __init__(self):
        self.starts, self.ends = [], []

    def earliest(self, t: float, duration: float) -> float:
        """Earliest start >= t of a free interval of `duration`."""
        k = bisect.bisect_right(self.ends, t)
        while k < len(self.starts) and self.starts[k] < t + duration:
            t = max(t, self.ends[k])
            k += 1
        return t

    def add(self, start: float, end: float) -> None:
        k = bisect.bisect_left(self.starts, start)
        self.starts.insert(k, start)
        self.ends.insert(k, end)


def _sendrecv_pairs(records, programs):
    """sendrecv records by rendezvous: the k-th call on a pipe_id of each program pairs with the k-th of the
    other (docs/simulator.md#choice-sendrecv-pairing). Returns ({seq: pair}, {pair: [seqs]})."""
    pair_of, pairs, count = {}, {}, {}
    for i, r in enumerate(records):
        if r.instr == "sendrecv":
            pipe = r.attrs.get("pipe_id", 0)
            k = count.get((r.program, pipe), 0)
            count[(r.program, pipe)] = k + 1
            pair_of[i] = (pipe, k)
            pairs.setdefault((pipe, k), []).append(i)
    for key, seqs in pairs.items():
        if sorted(records[i].program for i in seqs) != list(programs):
            raise CostModelError(f"sendrecv #{key[1]} on pipe_id {key[0]} is not made by every program once "
                                 f"(programs {sorted(records[i].program for i in seqs)} of {list(programs)})")
    return pair_of, pairs


def schedule(trace, target="trn3", lnc: int | None = None) -> Schedule:
    """Place every trace record on its core's engines (rules in the module docstring)."""
    target = resolve_target(target) if isinstance(target, str) else target
    records = list(trace)
    for i, r in enumerate(records):
        if r.seq != i:
            raise CostModelError(f"trace record {i} has seq {r.seq}; pass the launch's full trace in order")
    programs = sorted({r.program for r in records}) or [0]
    lnc = lnc or (max(programs) + 1)
    n = len(records)
    costs = [instr_cost(r, target) for r in records]

    # ---- dependencies (per program) + barrier fences ----
    preds = [()] * n
    tracker = _Tracker()
    since_fence = {p: [] for p in programs}
    last_fence = {}
    barrier_index = [None] * n
    barrier_count = {p: 0 for p in programs}
    pair_of, pairs = _sendrecv_pairs(records, programs)
    for i, r in enumerate(records):
        p = r.program
        if costs[i].kind == "barrier":
            d = set(since_fence[p])
            if p in last_fence:
                d.add(last_fence[p])
            since_fence[p] = []
            last_fence[p] = i
            barrier_index[i] = barrier_count[p]
            barrier_count[p] += 1
        else:
            d = tracker.deps(p, r, costs[i].engine)
            if p in last_fence:
                d.add(last_fence[p])
            since_fence[p].append(i)
        preds[i] = tuple(d)
    if len(set(barrier_count.values())) > 1:
        raise CostModelError(f"programs reached different numbers of core_barriers: {barrier_count}")
    def sw_dge(i):
        return costs[i].kind == "dma" and costs[i].dma.dge == "sw"

    def queue_engine(i):
        """In-order engine queue an instruction occupies: its engine; software-DGE DMAs: GpSimd [DGE]."""
        return costs[i].engine if costs[i].kind == "compute" else "gpsimd" if sw_dge(i) else None

    unplaceable = []
    for i, extra in _memory_reuse_deps(records, target, preds, queue_of=queue_engine, unplaceable=unplaceable).items():
        preds[i] = tuple(set(preds[i]) | {q for q in extra if q != i})
    succ = [[] for _ in range(n)]
    for i, ps in enumerate(preds):
        for q in ps:
            succ[q].append(i)

    start = [None] * n
    end = [None] * n
    blocker = [None] * n
    cnt = [len(ps) for ps in preds]
    dep_ready = [0.0] * n
    dep_arg = [None] * n  # predecessor with the latest end

    queues = {}  # (p, engine) -> list of seqs (program order)
    for i, r in enumerate(records):
        if queue_engine(i):
            queues.setdefault((r.program, queue_engine(i)), []).append(i)
    qpos = {k: 0 for k in queues}
    free = {k: 0.0 for k in queues}
    last_on = {k: None for k in queues}
    busy = {k: 0.0 for k in queues}

    dma_pending = {p: [] for p in programs}  # heap of (ready, seq)
    dge_units = {p: [_Timeline() for _ in range(max(1, target.dge_instances_per_core))] for p in programs}
    shared_bus = {p: _Timeline() for p in programs}  # VectorE perf modes + GpSimd SBUF access [TRN2]
    hop_clock = {}

    def hop(i, j):
        """Semaphore latency when j (on an in-order engine) waits for i on another engine [TRN1]."""
        eng_j = queue_engine(j)
        if eng_j is None or costs[i].kind == "barrier" or costs[i].engine == eng_j:
            return 0.0
        if eng_j not in hop_clock:
            hop_clock[eng_j] = target.semaphore_hop_cycles / _engine_clock(target, eng_j)
        return hop_clock[eng_j]
    barrier_arrivals = {}  # k -> {p: (time, seq)}
    pair_arrivals = {}  # sendrecv pair -> {seq: (inputs ready, blocker)}
    pair_released = set()  # sendrecv records whose pair met: their transfer may start
    pair_finished = {}  # sendrecv pair -> seqs whose transfer completed
    known = []  # stack of seqs whose end just became known

    def set_end(i, s, e, why):
        start[i], end[i], blocker[i] = s, e, why
        known.append(i)

    def on_deps_known(i):
        c = costs[i]
        if i in pair_of and i not in pair_released:
            # sendrecv: the transfers start once both cores' calls are ready plus the cross-core
            # synchronisation, priced as core_barrier's (docs/simulator.md#choice-sendrecv-pairing)
            arr = pair_arrivals.setdefault(pair_of[i], {})
            arr[i] = (dep_ready[i], dep_arg[i])
            if len(arr) < len(programs):
                return
            t_all, who = max((t, j) for j, (t, _) in arr.items())
            for j, (_, own_blocker) in arr.items():
                dep_ready[j] = t_all + target.barrier_latency_s
                dep_arg[j] = who if who != j else own_blocker
                pair_released.add(j)
                on_deps_known(j)
            return
        if c.kind == "dma" and c.dma.dge == "hw":  # one of the core's DGE instances, earliest free [TRN2]
            units = dge_units[records[i].program]
            begin, unit = min((u.earliest(dep_ready[i], c.dma.dge_seconds), k) for k, u in enumerate(units))
            units[unit].add(begin, begin + c.dma.dge_seconds)
            heapq.heappush(dma_pending[records[i].program], (begin + c.dma.dge_seconds, i))
        elif c.kind == "dma" and c.dma.dge == "none":
            heapq.heappush(dma_pending[records[i].program], (dep_ready[i], i))
        elif c.kind == "barrier":
            k = barrier_index[i]
            arr = barrier_arrivals.setdefault(k, {})
            arr[records[i].program] = (dep_ready[i], i)
            if len(arr) == len(programs):
                t_all, who = max(arr.values())
                for p, (t, j) in arr.items():
                    set_end(j, t, t_all + c.seconds, who if who != j else dep_arg[j])

    def drain():
        """Propagate known ends; start compute instructions whose inputs are known."""
        progress = True
        while progress:
            progress = False
            while known:
                i = known.pop()
                for s in succ[i]:
                    t = end[i] + hop(i, s)
                    if dep_arg[s] is None or t >= dep_ready[s]:
                        dep_ready[s], dep_arg[s] = t, i
                    cnt[s] -= 1
                    if cnt[s] == 0:
                        on_deps_known(s)
            for k, seqs in queues.items():
                pos = qpos[k]
                while pos < len(seqs) and cnt[seqs[pos]] == 0:
                    i = seqs[pos]
                    if free[k] >= dep_ready[i]:
                        s, why = free[k], last_on[k]
                    else:
                        s, why = dep_ready[i], dep_arg[i]
                    c = costs[i]
                    duration = c.dma.dge_seconds if c.kind == "dma" else c.seconds
                    if c.shared_bus and target.vector_gpsimd_shared_bus:
                        bus = shared_bus[k[0]]
                        s = bus.earliest(s, duration)
                        bus.add(s, s + duration)
                    e = s + duration
                    busy[k] += duration
                    free[k], last_on[k] = e, i
                    if c.kind == "dma":  # descriptors built: the transfer waits for a DMA queue
                        heapq.heappush(dma_pending[k[0]], (e, i))
                    else:
                        set_end(i, s, e, why)
                    pos += 1
                    progress = True
                qpos[k] = pos
            progress = progress or bool(known)

    for i in range(n):
        if cnt[i] == 0 and not queue_engine(i):
            on_deps_known(i)
    drain()

    # ---- DMA fluid simulation ----
    hbm_stack_bw = target.hbm_bytes_per_s_per_chip / target.hbm_stacks_per_chip
    active = {p: {} for p in programs}  # seq -> [remaining, lat_end, rate]
    slot_freed_by = {p: None for p in programs}
    dma_busy = {p: 0.0 for p in programs}
    dma_bytes = {p: 0 for p in programs}
    hbm_bytes = {p: 0 for p in programs}
    clock = 0.0

    def rates():
        hbm_load = 0.0
        for p in programs:
            xfer = [(i, a) for i, a in active[p].items() if a[1] <= clock + 1e-15]
            want = sum(costs[i].dma.engines for i, _ in xfer)
            scale = min(1.0, target.dma_engines_per_core / want) if want else 1.0
            for i, a in xfer:
                w = costs[i].dma
                a[2] = w.engines * scale * w.rate_per_engine
                if w.hbm_bytes:
                    hbm_load += a[2] * w.hbm_bytes / max(1, w.nbytes)
            for i, a in active[p].items():
                if a[1] > clock + 1e-15:
                    a[2] = 0.0
        if hbm_load > hbm_stack_bw:
            f = hbm_stack_bw / hbm_load
            for p in programs:
                for i, a in active[p].items():
                    if costs[i].dma.hbm_bytes:
                        a[2] *= f

    remaining_total = sum(1 for c in costs if c.kind == "dma")
    while remaining_total:
        # start ready transfers on free queues
        for p in programs:
            pend, act = dma_pending[p], active[p]
            while pend and len(act) < target.dma_queues_per_core and pend[0][0] <= clock + 1e-15:
                ready, i = heapq.heappop(pend)
                s = max(clock, ready)
                why = dep_arg[i] if ready >= clock - 1e-15 and dep_arg[i] is not None else slot_freed_by[p]
                start[i], blocker[i] = s, why
                w = costs[i].dma
                act[i] = [float(w.nbytes), s + target.dma_fixed_latency_s, 0.0]
        rates()
        # next event
        t_next = math.inf
        for p in programs:
            if dma_pending[p] and len(active[p]) < target.dma_queues_per_core:
                t_next = min(t_next, max(clock, dma_pending[p][0][0]))
            for i, a in active[p].items():
                if a[1] > clock + 1e-15:
                    t_next = min(t_next, a[1])
                elif a[2] > 0:
                    t_next = min(t_next, clock + a[0] / a[2])
                else:
                    t_next = min(t_next, clock)  # zero-byte or stalled: settle now
        if t_next == math.inf:
            raise CostModelError("scheduler deadlock: DMA transfers wait on instructions that never run")
        dt = t_next - clock
        for p in programs:
            if active[p]:
                dma_busy[p] += dt
            for i, a in active[p].items():
                if a[2] > 0:
                    a[0] -= a[2] * dt
        clock = t_next
        for p in programs:
            done = [i for i, a in active[p].items()
                    if a[1] <= clock + 1e-15 and a[0] <= 1e-6 * max(1.0, costs[i].dma.nbytes) + 1e-9]
            for i in done:
                del active[p][i]
                slot_freed_by[p] = i
                dma_bytes[p] += costs[i].dma.nbytes
                hbm_bytes[p] += costs[i].dma.hbm_bytes
                remaining_total -= 1
                if i in pair_of:  # a sendrecv completes when both cores' transfers have (its dst is the peer's)
                    fin = pair_finished.setdefault(pair_of[i], set())
                    fin.add(i)
                    if len(fin) < len(programs):
                        continue
                    for j in fin:
                        end[j] = clock
                        known.append(j)
                    continue
                end[i] = clock
                known.append(i)
        if known:
            drain()

    missing = [i for i in range(n) if end[i] is None]
    if missing:
        r = records[missing[0]]
        raise CostModelError(f"scheduler: {len(missing)} instruction(s) never ran (first: seq {r.seq} {r.instr})")
    engine_busy = {k: v for k, v in busy.items()}
    for p in programs:
        engine_busy[(p, "dma")] = dma_busy[p]
    makespan = max(end) if n else 0.0
    return Schedule(target.name, lnc, records, costs, start, end, blocker, makespan, engine_busy, dma_bytes,
                    hbm_bytes, unplaceable)

