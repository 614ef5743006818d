"""The kernel tests' call recorders simkit.spy, spy_per_core, spy_results, spy_returns and count_calls (record, call
through)."""
import types

from simkit import count_calls, spy, spy_per_core, spy_results, spy_returns


class Counter:
    """A method to spy on: adds n * scale to its total and returns the total."""

    def __init__(self, core=0):
        self.core, self.total = core, 0

    def add(self, n, scale=1):
        self.total += n * scale
        return self.total


def test_spy_helper(monkeypatch):
    """simkit.spy (the kernel tests' call recorder): key(*args, **kwargs) per call, in call order, into one list
    when several spies share it; the original runs with the same arguments (a method bound to its instance) and its
    result is returned; monkeypatch puts the originals back at the end of the test."""
    double = lambda n: 2 * n  # noqa: E731
    owner = types.SimpleNamespace(double=double)  # a module's function
    added = spy(monkeypatch, Counter, "add", lambda self, n, scale=1: (id(self), n, scale))
    doubled = spy(monkeypatch, owner, "double", lambda n: ("double", n), into=added)
    counter = Counter()
    assert counter.add(3) == 3 and counter.add(2, scale=5) == 13 and counter.total == 13
    assert owner.double(4) == 8
    assert doubled is added and added == [(id(counter), 3, 1), (id(counter), 2, 5), ("double", 4)]
    monkeypatch.undo()
    assert owner.double is double and Counter().add(1) == 1 and len(added) == 3


def test_spy_skips_none_keys(monkeypatch):
    """A key of None records nothing (a filter); the call still runs and returns the original's result."""
    added = spy(monkeypatch, Counter, "add", lambda self, n, scale=1: n if n > 1 else None)
    counter = Counter()
    assert [counter.add(n) for n in (1, 2, 0, 3)] == [1, 3, 3, 6] and added == [2, 3], added


def test_spy_per_core_and_results(monkeypatch):
    """spy_per_core: one list per core(*args), in call order, events of several spies interleaved through `into`;
    spy_results: the last result per key, after the call (the very object returned)."""
    double = lambda n: [2 * n]  # noqa: E731  (a new list per call: identity tells the calls apart)
    owner = types.SimpleNamespace(double=double)
    events = spy_per_core(monkeypatch, Counter, "add", lambda self, *args, **kwargs: self.core,
                          lambda self, n, scale=1: ("add", n) if scale else None)
    spy_per_core(monkeypatch, owner, "double", lambda n: n % 2, lambda n: ("double", n), into=events)
    results = spy_results(monkeypatch, owner, "double", lambda n: n % 2)
    core0, core1 = Counter(0), Counter(1)
    core1.add(5)
    core0.add(1)
    core0.add(7, scale=0)
    first = owner.double(2)
    core1.add(4)
    last_even = owner.double(4)
    odd = owner.double(3)
    assert events == {1: [("add", 5), ("add", 4), ("double", 3)], 0: [("add", 1), ("double", 2), ("double", 4)]}
    assert results == {0: [8], 1: [6]} and results[0] is last_even and results[1] is odd and first == [4]
    monkeypatch.undo()
    assert owner.double is double and Counter().add(1) == 1 and len(events[0]) == 3


def test_count_calls(monkeypatch):
    """count_calls: name -> calls so far, updated as they run, each call through to the original."""
    double = lambda n: 2 * n  # noqa: E731
    owner = types.SimpleNamespace(double=double, triple=lambda n: 3 * n)
    counts = count_calls(monkeypatch, owner, ["double", "triple"])
    assert counts == {"double": 0, "triple": 0}
    assert owner.double(1) + owner.double(2) + owner.triple(5) == 21
    assert counts == {"double": 2, "triple": 1}, counts
    monkeypatch.undo()
    assert owner.double is double


def test_spy_returns(monkeypatch):
    """spy_returns: key(result, *args, **kwargs) after each call, in call order (the state a method left behind is
    seen), into one list with a spy's events when `into` is given; a key of None records nothing; the original's
    result is returned."""
    added = spy_returns(monkeypatch, Counter, "add", lambda total, self, n, scale=1: (total, self.total, n, scale)
                        if n else None)
    before = spy(monkeypatch, Counter, "add", lambda self, n, scale=1: ("before", self.total), into=added)
    counter = Counter()
    assert counter.add(3) == 3 and counter.add(0) == 3 and counter.add(2, scale=5) == 13
    # the spy installed last wraps the first: its event comes first, spy_returns' after the call
    assert before is added and added == [("before", 0), (3, 3, 3, 1), ("before", 3), ("before", 3), (13, 13, 2, 5)]
    monkeypatch.undo()
    assert Counter().add(1) == 1 and len(added) == 5
