"""PhaseGraph: the order, sync points and overlaps are derived from what phases read and write.

Fake plans record the steps the graph asks for (no kernel), so each rule is checked on its own.
"""
import pytest

from nkilib.core.phase_graph import Phase, PhaseGraph


class FakePlan:
    def __init__(self, prefetchable=True, on_chip=False, first=0, streamed_tail=False):
        self.prefetchable = prefetchable
        self.on_chip = on_chip
        self.first = first
        self.streamed_tail = streamed_tail  # a K-streamed plan that takes the next one's first stationary loads
        self.tail_load = None
        self.fence = None  # set_fence's barrier, issued by the fake's "head" / "all" step (MatmulPlan: inside run)

    def can_fence(self):
        return True

    def set_fence(self, barrier):
        self.fence = barrier

    def fire_fence(self):
        if self.fence is not None:
            barrier, self.fence = self.fence, None
            barrier()

    def can_prefetch(self, nxt):
        return self.prefetchable and nxt.prefetchable and not self.streamed_tail

    def can_load_under_tail(self, nxt):
        return self.streamed_tail

    def set_tail_load(self, step, nxt):
        self.tail_load = (step, nxt)

    def carry_first_load(self, nxt):  # MatmulPlan's spread first load: nothing to carry here
        pass

    def prefetch_point(self, nxt):  # MatmulPlan's spread first load: nothing to decide here
        pass

    def first_bytes(self):
        return self.first

    def stationary_on_chip(self):
        return self.on_chip


def _graph(log, num_cores=2, shared=("shared",), barrier_under_tail=False):
    return PhaseGraph(num_cores, shared=shared, barrier=lambda: log.append("barrier"),
                      barrier_under_tail=barrier_under_tail)


def _phase(log, name, reads=(), writes=(), plan=None, stationary_reads=(), built=None, local_reads=()):
    plan = plan or FakePlan()

    def build(outputs):
        if built is not None:
            built.append((name, dict(outputs)))
        return plan

    def step(p, stage):
        assert p is plan
        log.append(f"{name}:{stage}")
        if stage in ("head", "all"):
            plan.fire_fence()
        if stage == "all" and plan.tail_load is not None:  # a K-streamed plan's last quad (streamed.run_streamed)
            tail_step, tail_plan = plan.tail_load
            log.append(f"{name}:last quad")
            tail_step(tail_plan, "first_stationary")
        return f"{name}-out"

    return Phase(name, build, step, reads=reads, writes=writes, stationary_reads=stationary_reads,
                 local_reads=local_reads)


def test_order_follows_dependencies_then_declaration():
    log = []
    g = _graph(log, shared=())
    g.add(_phase(log, "c", reads=("b_out",), writes=("c_out",)))
    g.add(_phase(log, "a", reads=("x",), writes=("a_out",)))
    g.add(_phase(log, "b", reads=("a_out",), writes=("b_out",)))
    g.add(_phase(log, "d", reads=("x",), writes=("d_out",)))
    assert [p.name for p in g.order()] == ["a", "b", "c", "d"]


def test_mlp_backward_shape_schedule():
    """The dense backward's declaration: phase 1 writes shared buffers; 2, 4, 3 read them. One barrier after
    phase 1; phase 2's first panels before it (stationary on chip); 2 -> 4 -> 3 overlapped."""
    log, built = [], []
    g = _graph(log, shared=("d_gate_up", "intermediate"))
    g.add(_phase(log, "p1", reads=("dY", "X"), writes=("d_gate_up", "intermediate"), built=built))
    g.add(_phase(log, "p2", reads=("d_gate_up", "W_gu"), writes=("dX",), stationary_reads=("d_gate_up",),
                 plan=FakePlan(on_chip=True), built=built))
    g.add(_phase(log, "p4", reads=("dY", "intermediate"), writes=("dW_down",), built=built))
    g.add(_phase(log, "p3", reads=("d_gate_up", "X"), writes=("dW_gu",), built=built))
    outputs = g.run()
    assert log == ["p1:all", "p2:first", "barrier", "p2:head", "p4:first", "p2:all", "p4:head", "p3:first",
                   "p4:all", "p3:all"]
    assert outputs == {"p1": "p1-out", "p2": "p2-out", "p4": "p4-out", "p3": "p3-out"}
    # a later phase is planned after the earlier phases it needs have run (phase 2 takes phase 1's panels)
    assert dict(built)["p2"] == {"p1": "p1-out"}


def test_sync_point_inside_a_phase_that_reads_only_its_own_rows():
    """Phase 2 reads only the d_gate_up rows its own core wrote (local_reads): no sync point before it; with
    barrier_under_tail the one barrier is issued inside phase 2's run (set_fence, before its last tiles), ahead of
    the first loads of phase 3 (which phase 2's tail takes, protected: it reads both cores' rows) and of phase 4."""
    log = []
    g = _graph(log, shared=("d_gate_up", "intermediate"), barrier_under_tail=True)
    g.add(_phase(log, "p1", reads=("dY", "X"), writes=("d_gate_up", "intermediate")))
    g.add(_phase(log, "p2", reads=("d_gate_up", "W_gu"), writes=("dX",), stationary_reads=("d_gate_up",),
                 local_reads=("d_gate_up",), plan=FakePlan(on_chip=True)))
    g.add(_phase(log, "p4", reads=("dY", "intermediate"), writes=("dW_down",), plan=FakePlan(first=10)))
    g.add(_phase(log, "p3", reads=("d_gate_up", "X"), writes=("dW_gu",), plan=FakePlan(first=20)))
    g.run()
    # p3 (the larger first load) goes under p2's tail and takes the protection p4 had in declaration order
    assert log == ["p1:all", "p2:head", "barrier", "p3:first", "p2:all", "p3:head", "p4:first", "p3:all", "p4:all"]
    # without barrier_under_tail the sync point stays before p3 and nothing loads across it
    log.clear()
    g2 = _graph(log, shared=("d_gate_up", "intermediate"))
    for ph in g.phases:
        g2.add(ph)
    g2.run()
    assert log == ["p1:all", "p2:all", "barrier", "p3:head", "p4:first", "p3:all", "p4:all"]


def test_independent_phases_largest_first_load_goes_under_the_previous_tail():
    """Phases that may run in any order: after a plan that can load the next one's first panels under its
    last tiles, the one with the largest first load runs next (its load is hidden)."""
    log = []
    g = _graph(log, shared=())
    g.add(_phase(log, "a", writes=("a_out",)))
    g.add(_phase(log, "small", reads=("x",), writes=("s_out",), plan=FakePlan(first=10)))
    g.add(_phase(log, "large", reads=("x",), writes=("l_out",), plan=FakePlan(first=20)))
    g.run()
    assert log == ["a:head", "large:first", "a:all", "large:head", "small:first", "large:all", "small:all"]


def test_independent_phases_smallest_cold_start_first_when_nothing_can_load_early():
    """When the previous plan cannot take the next one's first panels (e.g. a K-streamed plan), the phase
    with the smallest first load starts cold, and the larger one loads under its tail."""
    log = []
    g = _graph(log, shared=())
    g.add(_phase(log, "a", writes=("a_out",), plan=FakePlan(prefetchable=False)))
    g.add(_phase(log, "large", reads=("x",), writes=("l_out",), plan=FakePlan(first=20)))
    g.add(_phase(log, "small", reads=("x",), writes=("s_out",), plan=FakePlan(first=10)))
    g.run()
    assert log == ["a:all", "small:head", "large:first", "small:all", "large:all"]


def test_a_phase_is_not_moved_ahead_of_a_phase_it_depends_on():
    log = []
    g = _graph(log, shared=())
    g.add(_phase(log, "a", writes=("a_out",)))
    g.add(_phase(log, "b", reads=("x",), writes=("b_out",), plan=FakePlan(first=10)))
    g.add(_phase(log, "c", reads=("b_out",), writes=("c_out",), plan=FakePlan(first=20)))
    g.run()
    assert log == ["a:head", "b:first", "a:all", "b:all", "c:all"]  # c's larger first load would go first


def test_no_early_load_when_first_panels_read_protected_data():
    log = []
    g = _graph(log)
    g.add(_phase(log, "w", writes=("shared",)))
    g.add(_phase(log, "r", reads=("shared", "input"), stationary_reads=("shared",), plan=FakePlan(on_chip=False)))
    g.run()
    assert log == ["w:all", "barrier", "r:all"]


def test_lnc1_keeps_the_sync_point_but_issues_no_barrier():
    log = []
    g = _graph(log, num_cores=1)
    g.add(_phase(log, "w", writes=("shared",)))
    g.add(_phase(log, "r", reads=("shared",)))
    g.run()
    assert log == ["w:all", "r:all"]  # no overlap across the sync point either


def test_no_overlap_with_a_phase_that_reads_what_the_previous_writes():
    log = []
    g = _graph(log, shared=())
    g.add(_phase(log, "a", writes=("t",)))
    g.add(_phase(log, "b", reads=("t",)))
    g.add(_phase(log, "c", reads=("u",)))
    g.run()
    assert log == ["a:all", "b:head", "c:first", "b:all", "c:all"]


def test_no_overlap_when_sbuf_does_not_fit():
    log = []
    g = _graph(log, shared=())
    g.add(_phase(log, "a", plan=FakePlan(prefetchable=False)))
    g.add(_phase(log, "b"))
    g.run()
    assert log == ["a:all", "b:all"]


def test_second_sync_point_when_shared_data_is_written_again():
    log = []
    g = _graph(log)
    g.add(_phase(log, "w1", writes=("shared",)))
    g.add(_phase(log, "r1", reads=("shared",), writes=("shared",)))
    g.add(_phase(log, "r2", reads=("shared",)))
    g.run()
    assert log.count("barrier") == 2 and log.index("barrier") < log.index("r1:all") < log.index("r2:all")


def test_cycles_and_duplicate_names_are_errors():
    log = []
    g = _graph(log)
    g.add(_phase(log, "a", reads=("y",), writes=("x",)))
    g.add(_phase(log, "b", reads=("x",), writes=("y",)))
    with pytest.raises(AssertionError, match=r"cyclic dependencies among \['a', 'b'\]"):
        g.order()
    with pytest.raises(AssertionError, match=r"phase names must be unique, got 'a' twice"):
        g.add(_phase(log, "a"))


def test_after_a_k_streamed_phase_the_next_stationary_loads_under_its_last_quad():
    """A K-streamed plan refuses can_prefetch (it budgets all of SBUF) but may take the next phase's first stationary
    loads under its last quad: the graph hands it the next phase's step and plan (set_tail_load), which the plan
    calls inside its own "all" step (TP1's phase 2 -> phase 4); the next phase then runs as usual."""
    log = []
    g = _graph(log, shared=())
    g.add(_phase(log, "p2", reads=("W_gu",), writes=("dX",), plan=FakePlan(streamed_tail=True)))
    g.add(_phase(log, "p4", reads=("dY",), writes=("dW_down",)))
    g.run()
    assert log == ["p2:all", "p2:last quad", "p4:first_stationary", "p4:all"]
