"""A kernel declared as a graph of matmul phases; the instruction order is derived from it.

Each Phase names the buffers it reads and writes. The graph orders the phases by their data
dependencies (a stable topological sort: among ready phases, declaration order decides), puts a
sync point before a phase that reads a buffer other cores wrote since the last one (`shared` buffers,
written piecewise by every core: the barrier is emitted only under LNC2), and overlaps neighbours:
  * a phase's first panels load while the previous phase runs its last tiles, the ones that load
    nothing (MatmulPlan.step "head" / "first" / "all"), when no sync point separates them, the next
    phase reads nothing the previous writes, and both fit SBUF (MatmulPlan.can_prefetch);
  * after a K-streamed phase (which holds all of SBUF until its last quad, so the above is refused) the next
    phase's first stationary panels load under its last quad when they fit (MatmulPlan.can_load_under_tail);
  * the first panels of the phase right after a sync point load before it when they read no buffer
    the sync point protects (e.g. phase 1's on-chip panels as stationary and an input as moving);
  * phases that may run in any order (independent, no sync point between them) are taken so that the
    one with the largest first load runs where its loads can go under the previous phase's last tiles,
    or, when the previous plan takes no early loads, the one with the smallest starts cold (_choose_next).
A barrier is a fence (it waits for every earlier instruction of the core), so fewer and later is better.

Phases run through their `step` callables (the kernel's phase functions), so each instruction is
issued inside the phase function that owns it (cost reports label instructions by phase function).
"""
from __future__ import annotations

import nki.language as nl

from .kernel_helpers import kernel_assert


class Phase(nl.NKIObject):
    """One node of a PhaseGraph.

    Args:
        name: unique name (string).
        build: callable(outputs) -> MatmulPlan; issues no instruction. `outputs` holds the values that
            earlier phases' "all" steps returned, by phase name.
        step: callable(plan, stage) -> value; runs stage "head", "first" or "all" of the plan (the value
            of "all" is recorded in outputs[name]).
        reads / writes: names of the buffers the phase reads / writes.
        stationary_reads: the subset of `reads` its stationary operand comes from; the first tile's loads
            do not read it when the plan's stationary panels are already on chip.
        local_reads: the subset of `reads` of which each core reads only the part it wrote itself (a dependency
            that orders the phases, but needs no sync point: no other core's write is awaited).
    """

    def __init__(self, name, build, step, reads=(), writes=(), stationary_reads=(), local_reads=()):
        self.name = name
        self.build = build
        self.step = step
        self.reads = reads
        self.writes = writes
        self.stationary_reads = stationary_reads
        self.local_reads = local_reads
        self.plan = None

    def shared_reads(self):
        """Buffers it reads that other cores may have written a part of (a sync point must precede it)."""
        return [r for r in self.reads if r not in self.local_reads]

    def first_reads(self):
        """Buffers that loading the first tile's panels reads."""
        if self.plan.stationary_on_chip():
            return [r for r in self.reads if r not in self.stationary_reads]
        return list(self.reads)


class PhaseGraph(nl.NKIObject):
    """Phases with data dependencies, run in a derived order with sync points and overlap (module docstring).

    Args:
        num_cores: programs of the launch (the barrier is issued only when > 1).
        shared: names of buffers every core writes a part of and other cores read (need a sync point).
        barrier: callable() issuing the kernel's core barrier.
    """

    def __init__(self, num_cores, shared, barrier, barrier_under_tail=False):
        self.num_cores = num_cores
        self.shared = shared
        self.barrier = barrier
        self.barrier_under_tail = barrier_under_tail
        self.phases = []
        self.outputs = dict()  # phase name -> value of its "all" step (string keys: NKI dictionaries)

    def add(self, phase) -> Phase:
        kernel_assert(all(p.name != phase.name for p in self.phases),
                      f"PhaseGraph.add: phase names must be unique, got {phase.name!r} twice")
        self.phases.append(phase)
        return phase

    def _depends(self, later, earlier) -> bool:
        return any(w in later.reads for w in earlier.writes)

    def order(self):
        """The phases in dependency order; ties (independent phases) keep declaration order."""
        done, pending = [], list(self.phases)
        while pending:
            ready = [p for p in pending if not any(self._depends(p, q) for q in pending if q.name != p.name)]
            kernel_assert(len(ready) > 0, f"PhaseGraph: cyclic dependencies among {[p.name for p in pending]}")
            done.append(ready[0])
            pending = [p for p in pending if p.name != ready[0].name]
        return done

    def schedule(self):
        """[(phase, protected)] in run order: `protected` lists the shared buffers other cores wrote since
        the last sync point when the phase reads one of them (a sync point precedes it), else is empty."""
        dirty, out = [], []
        for phase in self.order():
            protected = dirty if any(r in dirty for r in phase.shared_reads()) else []
            if protected:
                dirty = []
            out.append((phase, protected))
            dirty = dirty + [w for w in phase.writes if w in self.shared and w not in dirty]
        return out

    def _plan(self, phase):
        if phase.plan == None:  # noqa: E711  (NKI traced code: no `is`)
            phase.plan = phase.build(self.outputs)
        return phase.plan

    def _choose_next(self, steps, i, plan):
        """steps with the phase to run after steps[i] (whose plan is `plan`) moved to i + 1, chosen among
        the phases that follow it and may run in any order (no sync point, no shared writes, no dependency
        on steps[i] or on each other): the one with the largest first load that can load under `plan`'s
        last tiles (MatmulPlan.can_prefetch), or, when none can, the one with the smallest first load (its
        cold start is the cheapest, and the larger ones may then load under it). Ties: declaration order."""
        phase = steps[i][0]
        cands = []
        for j in range(i + 1, len(steps)):
            ph, prot = steps[j]
            # the sync point before steps[i + 1] protects whichever of the candidates runs first
            free = ((not prot or j == i + 1) and not any(w in self.shared for w in ph.writes)
                    and not self._depends(ph, phase) and not any(self._depends(ph, steps[c][0]) for c in cands))
            if not free:
                break
            cands.append(j)
        if len(cands) < 2:
            return steps
        best, best_bytes, best_pre = cands[0], -1, False
        for c in cands:
            nxt = self._plan(steps[c][0])
            pre, size = plan.can_prefetch(nxt), nxt.first_bytes()
            if (pre and not best_pre) or (pre and size > best_bytes) or (not pre and not best_pre and
                                                                         (best_bytes < 0 or size < best_bytes)):
                best, best_bytes, best_pre = c, size, pre
        if best == i + 1:
            return steps
        protected = steps[i + 1][1]
        rest = [steps[k] if k != i + 1 else (steps[k][0], []) for k in range(i + 1, len(steps)) if k != best]
        return steps[:i + 1] + [(steps[best][0], protected)] + rest

    def run(self) -> dict:
        """Run every phase; returns the outputs of their "all" steps by name."""
        steps = self.schedule()
        for i in range(len(steps)):
            phase, protected = steps[i]
            plan = self._plan(phase)
            if protected:
                # the first panels may load before the fence when they read nothing it protects
                if not any(r in protected for r in phase.first_reads()):
                    phase.step(plan, "first")
                if self.num_cores > 1:
                    self.barrier()
            if i + 1 < len(steps):
                steps = self._choose_next(steps, i, plan)
                nxt, nxt_protected = steps[i + 1]
                if (nxt_protected and self.barrier_under_tail and self.num_cores > 1 and plan.can_fence() and
                        not any(w in nxt_protected for w in phase.writes)):
                    # the sync point early inside this phase (which reads nothing it protects, MatmulPlan.set_fence):
                    # the fence waits for the previous phase's last work while this one's first tiles run
                    plan.set_fence(self.barrier)
                    steps = steps[:i + 1] + [(nxt, [])] + steps[i + 2:]
                    nxt_protected = []
                if not nxt_protected and not any(w in nxt.reads for w in phase.writes):
                    nxt_plan = self._plan(nxt)
                    if plan.can_prefetch(nxt_plan):
                        phase.step(plan, "head")
                        plan.fire_fence()  # before the next plan's first loads when the head ends before it
                        plan.prefetch_point(nxt_plan)  # where the head ended: a spread first load's copies
                        nxt.step(nxt_plan, "first")
                        plan.carry_first_load(nxt_plan)  # the rest of a spread first load (MatmulPlan)
                    elif plan.can_load_under_tail(nxt_plan):
                        # a K-streamed plan holds all of SBUF until its last quad: the next plan's first stationary
                        # panels load from there on, issued inside that plan's step (its phase function)
                        plan.set_tail_load(nxt.step, nxt_plan)
            if i + 1 == len(steps) and hasattr(plan, "piece_last_tile"):
                plan.piece_last_tile()  # the kernel's last store: only its last column piece follows the last matmul
            self.outputs[phase.name] = phase.step(plan, "all")
            phase.plan = None
        return self.outputs
