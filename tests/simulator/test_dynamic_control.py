"""Dynamic loops (nl.fori_loop, nl.while_loop, nl.dynamic_range) driven by tensor data, their trace
records, their rejections, and the LNC2 rule that both programs take the same trip counts."""
import numpy as np
import pytest

import nki.isa as nisa
import nki.language as nl
from simkit import in_kernel, randn, simulate

from nkilib.simulator.errors import DivergentControlFlowError, NkiValidationError, UninitializedReadError
from nkilib.simulator.launcher import run_kernel
from nkilib.simulator.nki.language import control


def load_register(src):
    """Inside a kernel: a register holding the single element of `src` ([1, 1], HBM or SBUF)."""
    t = nl.ndarray((1, 1), src.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=src)
    reg = nisa.register_alloc()
    nisa.register_load(reg, t)
    return reg


def row(t, reg, base_row=0):
    """The row `base_row + reg` of a 2-D tensor, as a [1, F] access pattern with a register offset."""
    F = t.shape[1]
    return t.ap([[F, 1], [1, F]], offset=base_row * F, scalar_offset=reg)


def zeroed_output(shape, dtype):
    out = nl.ndarray(shape, dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=nl.zeros(shape, dtype, buffer=nl.sbuf))
    return out


def copy_row(x, out, i, base_row=0):
    tile = nl.ndarray((1, x.shape[1]), x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=row(x, i, base_row))
    nisa.dma_copy(dst=row(out, i, base_row), src=tile)


def fori_rows_kernel(x, bounds, step=1):
    """out[i] = x[i] for i in range(bounds[0, 0], bounds[0, 1], step) (register bounds); other rows 0."""
    out = zeroed_output(x.shape, x.dtype)
    lower, upper = load_register(bounds[0:1, 0:1]), load_register(bounds[0:1, 1:2])
    nl.fori_loop(lower, upper, lambda i: copy_row(x, out, i), step=step)
    return out


def rows_taken(R, rows):
    mask = np.zeros((R, 1), bool)
    mask[list(rows)] = True
    return mask


# ---------------------------------------------------------------------------------------------
# fori_loop
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("count", [0, 1, 5, 8, -3])
def test_fori_loop_trip_count_from_data(count):
    x = randn(20, (8, 16))
    bounds = np.array([[0, count]], np.int32)
    res = run_kernel(fori_rows_kernel, args=(x, bounds), trace=True)
    expect = np.where(rows_taken(8, range(count)), x, 0)
    np.testing.assert_array_equal(res.outputs, expect)
    loops = [r for r in res.trace if r.instr == "dynamic_loop"]
    assert len(loops) == 1
    loop = loops[0]
    assert loop.engine == "sync"
    assert loop.attrs["loop_kind"] == "fori_loop" and loop.attrs["trip_count"] == max(count, 0)
    assert (loop.attrs["lower"], loop.attrs["upper"], loop.attrs["step"]) == (0, count, 1)
    assert loop.attrs["depth"] == 0 and len(loop.attrs["registers"]) == 2
    body = [r for r in res.trace if "loop_iteration" in r.attrs]
    assert all(r.seq > loop.seq for r in body)
    assert [r.attrs["loop_iteration"] for r in body] == [(0, i) for i in range(max(count, 0)) for _ in range(2)]
    assert {r.instr for r in body} <= {"dma_copy"}


def test_fori_loop_register_lower_and_step():
    x = randn(21, (8, 4))
    out = simulate(fori_rows_kernel, x=x, bounds=np.array([[1, 7]], np.int32), step=2)
    np.testing.assert_array_equal(out, np.where(rows_taken(8, [1, 3, 5]), x, 0))


def test_fori_loop_int_bounds_and_iteration_by_value():
    """Writing the iteration register does not change the loop (the docs: passed by value)."""
    x = randn(22, (6, 4))

    def k(x):
        out = zeroed_output(x.shape, x.dtype)

        def body(i):
            copy_row(x, out, i)
            nisa.register_move(i, 100)

        nl.fori_loop(2, 5, body)
        return out

    np.testing.assert_array_equal(simulate(k, x=x), np.where(rows_taken(6, [2, 3, 4]), x, 0))


def test_nested_fori_loops_with_index_computed_in_sbuf():
    """out[i, j] = x[i, j] for i < n_r, j < n_c; the flat row i * C + j travels through SBUF."""
    R, C, F = 4, 3, 8
    x = randn(23, (R, C, F))
    counts = np.array([[3, 2]], np.int32)

    def k(x, counts):
        flat = x.reshape((R * C, F))
        out = zeroed_output((R * C, F), x.dtype)
        n_r, n_c = load_register(counts[0:1, 0:1]), load_register(counts[0:1, 1:2])
        i_t, j_t, k_t = (nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf) for _ in range(3))

        def outer(i):
            nisa.register_store(i_t, i)

            def inner(j):
                nisa.register_store(j_t, j)
                nisa.tensor_scalar(dst=k_t, data=i_t, op0=nl.multiply, operand0=float(C))
                nisa.tensor_tensor(dst=k_t, data1=k_t, data2=j_t, op=nl.add)
                kreg = nisa.register_alloc()
                nisa.register_load(kreg, k_t)
                copy_row(flat, out, kreg)

            nl.fori_loop(0, n_c, inner)

        nl.fori_loop(0, n_r, outer)
        return out

    res = run_kernel(k, args=(x, counts), trace=True)
    expect = np.zeros_like(x)
    expect[:3, :2] = x[:3, :2]
    np.testing.assert_array_equal(res.outputs.reshape(R, C, F), expect)
    loops = [r for r in res.trace if r.instr == "dynamic_loop"]
    assert [(r.attrs["depth"], r.attrs["trip_count"]) for r in loops] == [(0, 3), (1, 2), (1, 2), (1, 2)]
    assert [r.attrs["loop_iteration"] for r in loops[1:]] == [(0, 0), (0, 1), (0, 2)]
    assert [r.attrs["loop_index"] for r in loops] == [0, 1, 2, 3]


@pytest.mark.parametrize("lower,upper,step,match", [
    (0, 2.5, 1, "argument 'upper' must be an int or a VirtualRegister, got float 2.5"),
    (True, 3, 1, "argument 'lower' must be an int or a VirtualRegister, got bool"),
    (0, 2 ** 31, 1, "argument 'upper' = 2147483648 is not a 32-bit value"),
    (0, 4, 0, "argument 'step' must be a compile-time positive int, got 0"),
    (0, 4, 1.0, "argument 'step' must be a compile-time positive int, got 1.0"),
])
def test_fori_loop_rejects_bounds(lower, upper, step, match):
    with pytest.raises(NkiValidationError, match=f"nl.fori_loop: {match}"):
        in_kernel(lambda: nl.fori_loop(lower, upper, lambda i: None, step=step))


def test_fori_loop_rejects_register_step_body_and_uninitialized_bound():
    with pytest.raises(NkiValidationError, match="'step' must be a compile-time positive int, got VirtualRegister"):
        in_kernel(lambda: nl.fori_loop(0, 4, lambda i: None, step=nisa.register_alloc(2)))
    with pytest.raises(NkiValidationError, match="'body_fun' must be callable, got int"):
        in_kernel(lambda: nl.fori_loop(0, 4, 7))
    with pytest.raises(UninitializedReadError, match="fori_loop argument 'upper': reads VirtualRegister"):
        in_kernel(lambda: nl.fori_loop(0, nisa.register_alloc(), lambda i: None))


def test_bound_register_is_frozen_while_its_loop_runs():
    def body():
        n = nisa.register_alloc(3)
        nl.fori_loop(0, n, lambda i: nisa.register_move(n, 10))

    with pytest.raises(NkiValidationError, match=r"register_move: argument 'dst' VirtualRegister\(.*value=3\) is "
                                                 r"frozen: it bounds the running nl.fori_loop #0 at "
                                                 r"test_dynamic_control.py:\d+"):
        in_kernel(body)

    def after():
        n = nisa.register_alloc(2)
        nl.fori_loop(0, n, lambda i: None)
        nisa.register_move(n, 5)  # writable again once the loop ended
        return n

    assert repr(in_kernel(after)).endswith("value=5)")


# ---------------------------------------------------------------------------------------------
# while_loop
# ---------------------------------------------------------------------------------------------

def while_rows_kernel(x, flags):
    """Copy rows 0, 1, ... while flags[k] != 0 (flags [R + 1, 1] int32); seen[k] = the condition value
    the body received in iteration k. The row counter travels through SBUF."""
    R, F = x.shape
    out = zeroed_output(x.shape, x.dtype)
    seen = nl.zeros((R, 1), nl.int32, buffer=nl.sbuf)
    counter = nl.zeros((1, 1), nl.int32, buffer=nl.sbuf)
    flag = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)

    def body(cond):
        k = nisa.register_alloc()
        nisa.register_load(k, counter)
        copy_row(x, out, k)
        nisa.register_store(seen.ap([[1, 1], [1, 1]], scalar_offset=k), cond)
        nisa.tensor_scalar(dst=counter, data=counter, op0=nl.add, operand0=1.0)
        nxt = nisa.register_alloc()
        nisa.register_load(nxt, counter)
        nisa.dma_copy(dst=flag, src=flags.ap([[1, 1], [1, 1]], scalar_offset=nxt))
        cond_next = nisa.register_alloc()
        nisa.register_load(cond_next, flag)
        return cond_next

    nl.while_loop(load_register(flags[0:1, :]), body)
    seen_out = nl.ndarray((R, 1), nl.int32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=seen_out, src=seen)
    return out, seen_out


@pytest.mark.parametrize("flags", [[0, 5, 5, 0], [3, 0, 1, 0], [3, 7, -2, 0], [1, 1, 1, 0]])
def test_while_loop_runs_until_condition_is_zero(flags):
    x = randn(30, (3, 8))
    flags = np.array(flags, np.int32).reshape(-1, 1)
    trips = int(np.argmax(flags[:, 0] == 0))
    res = run_kernel(while_rows_kernel, args=(x, flags), trace=True)
    out, seen = res.outputs
    np.testing.assert_array_equal(out, np.where(rows_taken(3, range(trips)), x, 0))
    np.testing.assert_array_equal(seen[:trips, 0], flags[:trips, 0])
    np.testing.assert_array_equal(seen[trips:, 0], 0)
    (loop,) = [r for r in res.trace if r.instr == "dynamic_loop"]
    assert loop.attrs["loop_kind"] == "while_loop" and loop.attrs["trip_count"] == trips
    assert "lower" not in loop.attrs and len(loop.attrs["registers"]) == 1


def test_while_loop_rejections(monkeypatch):
    with pytest.raises(NkiValidationError,
                       match="nl.while_loop: argument 'init' must be a VirtualRegister .*got int 1"):
        in_kernel(lambda: nl.while_loop(1, lambda r: r))
    with pytest.raises(NkiValidationError, match="body_fun must return the next condition as a VirtualRegister, got "
                                                 "int 0 \\(iteration 0 of nl.while_loop #0"):
        in_kernel(lambda: nl.while_loop(nisa.register_alloc(1), lambda r: 0))
    monkeypatch.setattr(control, "MAX_WHILE_TRIPS", 5)
    with pytest.raises(NkiValidationError, match="did not end after 5 iterations"):
        in_kernel(lambda: nl.while_loop(nisa.register_alloc(1), lambda r: r))


# ---------------------------------------------------------------------------------------------
# dynamic_range (2.32, deprecated)
# ---------------------------------------------------------------------------------------------

def test_dynamic_range_from_data_is_deprecated_and_frozen():
    x = randn(40, (6, 4))

    def k(x, count):
        out = zeroed_output(x.shape, x.dtype)
        for i in nl.dynamic_range(load_register(count)):
            copy_row(x, out, i)
            with pytest.raises(NkiValidationError, match="frozen: it is the induction variable of "
                                                         "nl.dynamic_range #0"):
                nisa.register_move(i, 0)
        return out

    with pytest.deprecated_call(match="use nl.fori_loop"):
        res = run_kernel(k, args=(x, np.array([[4]], np.int32)), trace=True)
    np.testing.assert_array_equal(res.outputs, np.where(rows_taken(6, range(4)), x, 0))
    (loop,) = [r for r in res.trace if r.instr == "dynamic_loop"]
    assert loop.attrs["loop_kind"] == "dynamic_range" and loop.attrs["trip_count"] == 4


def test_dynamic_range_start_stop_step_and_rejections():
    def steps():
        return [1 for _ in nl.dynamic_range(nisa.register_alloc(1), 8, 3)]

    with pytest.deprecated_call():
        assert len(in_kernel(steps)) == 3  # 1, 4, 7
        with pytest.raises(NkiValidationError, match="nl.dynamic_range: argument 'step' must be a compile-time "
                                                     "positive int, got VirtualRegister"):
            in_kernel(lambda: nl.dynamic_range(0, 4, nisa.register_alloc(1)))
        with pytest.raises(NkiValidationError, match="nl.dynamic_range: argument 'stop' must be an int or a "
                                                     "VirtualRegister, got str"):
            in_kernel(lambda: nl.dynamic_range("4"))


# ---------------------------------------------------------------------------------------------
# LNC2: both programs must take the same dynamic trip counts
# ---------------------------------------------------------------------------------------------

def lnc_rows_kernel(x, counts, barrier="none"):
    """Program p copies the first counts[p] rows of its half of x [R, F]; barrier: none / after / inside."""
    R, F = x.shape
    half, p = R // 2, nl.program_id(0)
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out[p * half:(p + 1) * half, :], src=nl.zeros((half, F), x.dtype, buffer=nl.sbuf))
    n = load_register(counts[p:p + 1, :])

    def body(i):
        copy_row(x, out, i, base_row=p * half)
        if barrier == "inside":
            nisa.core_barrier(out, (0, 1))

    nl.fori_loop(0, n, body)
    if barrier == "after":
        nisa.core_barrier(out, (0, 1))
    return out


@pytest.mark.parametrize("barrier", ["none", "after", "inside"])
def test_lnc2_equal_trip_counts_run(barrier):
    x = randn(50, (8, 4))
    res = run_kernel(lnc_rows_kernel, args=(x, np.array([[3], [3]], np.int32), barrier), lnc=2, trace=True)
    np.testing.assert_array_equal(res.outputs, np.where(rows_taken(8, [0, 1, 2, 4, 5, 6]), x, 0))
    loops = [(r.program, r.attrs["trip_count"]) for r in res.trace if r.instr == "dynamic_loop"]
    assert sorted(loops) == [(0, 3), (1, 3)]


@pytest.mark.parametrize("barrier,when,state1", [
    ("none", "end of kernel", "ran 3 iteration"),
    ("after", r"nisa.core_barrier #0", "ran 3 iteration"),
    ("inside", r"nisa.core_barrier #2", r"is in iteration 3 \(still running\)"),
])
def test_lnc2_divergent_trip_counts_raise(barrier, when, state1):
    x = randn(51, (8, 4))
    with pytest.raises(DivergentControlFlowError,
                       match=f"{when}: LNC programs took different trip counts in nl.fori_loop #0 at "
                             rf"test_dynamic_control.py:\d+: program 0 ran 2 iteration\(s\), program 1 {state1}"):
        simulate(lnc_rows_kernel, 2, x=x, counts=np.array([[2], [3]], np.int32), barrier=barrier)


def test_lnc2_loop_on_one_program_only_raises():
    def k(x):
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        p = nl.program_id(0)
        nisa.dma_copy(dst=out[p:p + 1, :], src=nl.zeros((1, x.shape[1]), x.dtype, buffer=nl.sbuf))
        if p == 1:
            nl.fori_loop(0, 1, lambda i: None)
        return out

    with pytest.raises(DivergentControlFlowError, match=r"end of kernel: program 0 entered 0 dynamic loop\(s\) but "
                                                        r"program 1 entered 1; program 1 also ran nl.fori_loop #0"):
        simulate(k, 2, x=randn(52, (2, 4)))


def test_lnc2_divergent_while_loop_raises():
    def k(x, flags):
        p = nl.program_id(0)
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out[p:p + 1, :], src=nl.zeros((1, x.shape[1]), x.dtype, buffer=nl.sbuf))
        budget = load_register(flags[p:p + 1, :])  # program p loops flags[p] times
        left = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
        nisa.register_store(left, budget)

        def body(r):
            nisa.tensor_scalar(dst=left, data=left, op0=nl.subtract, operand0=1.0)
            nxt = nisa.register_alloc()
            nisa.register_load(nxt, left)
            return nxt

        nl.while_loop(budget, body)
        return out

    with pytest.raises(DivergentControlFlowError, match=r"different trip counts in nl.while_loop #0 .*program 0 ran 4 "
                                                        r"iteration\(s\), program 1 ran 1 iteration"):
        simulate(k, 2, x=randn(53, (2, 4)), flags=np.array([[4], [1]], np.int32))


def test_shape_only_run_with_int_bounds_traces_every_iteration():
    """numerics=False (the cost model's full-shape runs): int bounds need no data."""
    from nkilib.simulator.launcher import ShapeSpec

    def k(x):
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        nl.fori_loop(0, x.shape[0], lambda i: copy_row(x, out, i))
        return out

    res = run_kernel(k, args=(ShapeSpec((5, 64), np.float32),), numerics=False, trace=True)
    (loop,) = [r for r in res.trace if r.instr == "dynamic_loop"]
    assert loop.attrs["trip_count"] == 5
    reads = [r.reads[0] for r in res.trace if r.instr == "dma_copy" and r.reads[0].name == "x"]
    assert [op.byte_offset for op in reads] == [i * 64 * 4 for i in range(5)]
