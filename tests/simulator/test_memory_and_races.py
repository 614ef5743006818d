"""SBUF/PSUM capacity accounting, LNC2 scheduling, barriers, private/shared HBM and races (runtime.py)."""
import numpy as np
import pytest

import nki.isa as nisa
import nki.language as nl
from simkit import hbm_store, in_kernel, randn, sbuf_load, simulate
from simkit import run_with_timeout as _run_with_timeout

from nkilib.simulator import run_kernel
from nkilib.simulator.errors import CapacityError, NkiValidationError, RaceError, RaceWarning, UninitializedReadError

KIB = 1024


# ---------------------------------------------------------------------------------------------
# capacity (runtime.MemoryTracker)
# ---------------------------------------------------------------------------------------------

def _big_sbuf_alloc():
    # 240000 bytes per partition: above 224 KiB (229376, trn2) and below 256 KiB (262144, trn3)
    return nl.ndarray((128, 240000), nl.uint8, buffer=nl.sbuf).shape


def test_sbuf_capacity_trn2_vs_trn3(set_target):
    set_target("trn2")
    with pytest.raises(CapacityError, match=r"240000 bytes per partition in SBUF.*of 229376"):
        in_kernel(_big_sbuf_alloc)
    set_target("trn3")
    assert in_kernel(_big_sbuf_alloc) == (128, 240000)


def test_capacity_is_per_partition_bytes_not_total(set_target):
    set_target("trn2")

    def body():
        # [1, 200 KiB] and [128, 20 KiB] live together: 220 KiB per partition fits 224 KiB
        a = nl.ndarray((1, 200 * KIB), nl.uint8, buffer=nl.sbuf)
        b = nl.ndarray((128, 5 * KIB), nl.float32, buffer=nl.sbuf)
        with pytest.raises(CapacityError, match="SBUF"):
            nl.ndarray((2, 8 * KIB), nl.bfloat16, buffer=nl.sbuf)  # +16 KiB -> 236 KiB
        return a.shape, b.shape

    in_kernel(body)


def test_tensors_freed_when_unreachable(set_target):
    set_target("trn2")

    def body():
        # 100 KiB per partition per iteration, 40 iterations = 4000 KiB >> 224 KiB
        for i in range(40):
            t = nl.ndarray((128, 100 * KIB), nl.uint8, buffer=nl.sbuf)
            nisa.memset(dst=t[:, 0:4], value=i)
        del t  # the loop variable keeps the last tile alive
        keep = [nl.ndarray((128, 100 * KIB), nl.uint8, buffer=nl.sbuf) for _ in range(2)]
        with pytest.raises(CapacityError):
            keep.append(nl.ndarray((128, 100 * KIB), nl.uint8, buffer=nl.sbuf))  # third live one: 300 KiB
        return len(keep)

    assert in_kernel(body) == 2


def test_views_keep_storage_alive():
    def body():
        t = nl.ndarray((128, 130 * KIB), nl.uint8, buffer=nl.sbuf)
        v = t[:, 0:16]
        del t  # the view still references the storage
        with pytest.raises(CapacityError):
            nl.ndarray((128, 130 * KIB), nl.uint8, buffer=nl.sbuf)
        del v
        return nl.ndarray((128, 130 * KIB), nl.uint8, buffer=nl.sbuf).shape

    assert in_kernel(body) == (128, 130 * KIB)


def test_psum_bank_rounding(any_target):
    def eight():
        tiles = [nl.ndarray((128, 1), nl.float32, buffer=nl.psum) for _ in range(8)]
        return len(tiles)

    def nine():
        tiles = [nl.ndarray((128, 1), nl.float32, buffer=nl.psum) for _ in range(8)]
        with pytest.raises(CapacityError, match=r"2048 bytes per partition in PSUM, but 16384 of 16384"):
            tiles.append(nl.ndarray((128, 1), nl.float32, buffer=nl.psum))
        # a 2-bank tile needs two free banks
        del tiles[0]
        with pytest.raises(CapacityError, match="4096 bytes per partition in PSUM"):
            nl.ndarray((128, 513), nl.float32, buffer=nl.psum)
        return True

    assert in_kernel(eight) == 8
    assert in_kernel(nine)


def test_peak_bytes_reported():
    def k(a):
        t = sbuf_load(a)  # 64 fp32 = 256 B
        scratch = [nl.ndarray((128, 1000), nl.bfloat16, buffer=nl.sbuf),  # 2000 B
                   nl.ndarray((4, 500), nl.float32, buffer=nl.sbuf)]  # 2000 B
        p = nl.ndarray((64, 10), nl.float32, buffer=nl.psum)  # 40 B -> one 2 KiB bank
        del scratch, p
        small = nl.ndarray((128, 8), nl.int32, buffer=nl.sbuf)  # 32 B, after the peak
        nisa.memset(dst=small, value=1)
        return hbm_store(t)

    res = run_kernel(k, (randn(0, (16, 64)),))
    assert res.peak_bytes_per_partition == [{"sbuf": 256 + 4000, "psum": 2048}]
    assert res.lnc == 1 and res.target == "trn3"


def test_peak_bytes_per_program_under_lnc2():
    def k(a):
        pid = nl.program_id(0)
        t = nl.ndarray((8, 100 * (pid + 1)), nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=t, value=0.0)
        return half_copy(a)

    res = run_kernel(k, (randn(1, (8, 4)),), lnc=2)
    assert [p["sbuf"] for p in res.peak_bytes_per_partition] == [400 + 16, 800 + 16]


# ---------------------------------------------------------------------------------------------
# LNC2: scheduling, barriers, private/shared HBM, races
# ---------------------------------------------------------------------------------------------

def half_copy(a):
    """Each program copies its half of the rows of a [2R, F] input into the shared output."""
    out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
    rows = a.shape[0] // nl.num_programs(0)
    r0 = nl.program_id(0) * rows
    t = nl.ndarray((rows, a.shape[1]), a.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=a[r0:r0 + rows, :])
    nisa.dma_copy(dst=out[r0:r0 + rows, :], src=t)
    return out


def _exchange_kernel(with_barrier):
    """Program 1 writes a shared scratch; program 0 reads it (after the barrier when with_barrier)."""

    def k(a):
        pid = nl.program_id(0)
        scratch = nl.ndarray((2, 8), nl.float32, buffer=nl.shared_hbm, name="scratch")
        out = nl.ndarray((2, 8), nl.float32, buffer=nl.shared_hbm)
        if pid == 1:
            nisa.dma_copy(dst=scratch[1:2, :], src=sbuf_load(a[1:2, :]))
        if with_barrier:
            nisa.core_barrier(scratch, (0, 1))
        t = nl.ndarray((1, 8), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=scratch[1:2, :] if pid == 0 else a[0:1, :])
        nisa.dma_copy(dst=out[pid:pid + 1, :], src=t)
        return out

    return k


def test_barrier_orders_cross_program_reads(set_target):
    # Program 0 runs first and reaches the barrier before program 1 writes; after the barrier it must
    # see program 1's value (the barrier really blocks).
    a = randn(2, (2, 8))
    for target in ("trn2", "trn3"):
        set_target(target)
        out = _run_with_timeout(lambda: simulate(_exchange_kernel(True), lnc=2, a=a))
        np.testing.assert_array_equal(out, np.stack([a[1], a[0]]))


def test_read_without_barrier_sees_no_foreign_write():
    # program 0 runs first: without the barrier it copies scratch before program 1 wrote it (a copy of
    # never-written bytes is legal); program 1's write then races with that read
    with pytest.raises(RaceError, match="program 1 writes shared_hbm tensor 'scratch' bytes that program 0 read"):
        _run_with_timeout(lambda: simulate(_exchange_kernel(False), lnc=2, a=randn(3, (2, 8))))


def test_private_hbm_per_program_shared_hbm_shared():
    def k(dummy):
        pid = nl.program_id(0)
        out = nl.ndarray((2, 4), nl.int32, buffer=nl.shared_hbm)
        priv = nl.ndarray((1, 4), nl.int32, buffer=nl.private_hbm, name="mine")
        hbm = nl.ndarray((1, 4), nl.int32, buffer=nl.hbm)  # alias of private_hbm
        t = nl.ndarray((1, 4), nl.int32, buffer=nl.sbuf)
        nisa.memset(dst=t, value=pid + 10)
        nisa.dma_copy(dst=priv, src=t)
        nisa.memset(dst=t, value=pid + 20)
        nisa.dma_copy(dst=hbm, src=t)
        nisa.core_barrier(out, (0, 1))  # the other program has written its private tensors now
        back = nl.ndarray((1, 4), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=back[:, 0:2], src=priv[:, 0:2])
        nisa.dma_copy(dst=back[:, 2:4], src=hbm[:, 2:4])
        nisa.dma_copy(dst=out[pid:pid + 1, :], src=back)
        return out

    out = _run_with_timeout(lambda: simulate(k, lnc=2, dummy=np.zeros((1, 1), np.float32)))
    np.testing.assert_array_equal(out, np.array([[10, 10, 20, 20], [11, 11, 21, 21]], np.int32))


def test_inputs_are_shared_under_lnc2_and_private_under_lnc1():
    seen = []

    def k(a):
        seen.append(a.buffer)
        return half_copy(a)

    a = randn(4, (4, 2))
    np.testing.assert_array_equal(simulate(k, lnc=2, a=a), a)
    np.testing.assert_array_equal(simulate(k, lnc=1, a=a), a)
    assert seen == [nl.shared_hbm, nl.shared_hbm, nl.private_hbm]


def _write_write_kernel(with_barrier, overlap, values_differ=False):
    def k(a):
        pid = nl.program_id(0)
        out = nl.ndarray((4, 8), nl.float32, buffer=nl.shared_hbm, name="result")
        t = sbuf_load(a)
        # rows [0, 3) for program 0, rows [2, 4) (overlap) or [3, 4) for program 1
        rows = (0, 3) if pid == 0 else ((2, 4) if overlap else (3, 4))
        # values_differ: program 1 writes the source rows one above, so the overlapping row 2 differs
        shift = 1 if (pid == 1 and values_differ) else 0
        if pid == 1 and with_barrier:
            nisa.core_barrier(out, (0, 1))
        nisa.dma_copy(dst=out[rows[0]:rows[1], :], src=t[rows[0] - shift:rows[1] - shift, :])
        if pid == 0 and with_barrier:
            nisa.core_barrier(out, (0, 1))
        return out

    return k


def test_write_write_race_detected():
    with pytest.raises(RaceError, match=r"program 1 writes shared_hbm tensor 'result' bytes that program 0 wrote"):
        _run_with_timeout(lambda: simulate(_write_write_kernel(False, True, values_differ=True), lnc=2,
                                           a=randn(5, (4, 8))))


def test_identical_overlapping_writes_warn_not_raise():
    # both programs write the same values to row 2: defined result in either order -> RaceWarning only
    a = randn(5, (4, 8))
    with pytest.warns(RaceWarning, match=r"program 1 writes shared_hbm tensor 'result' bytes that program 0 also "
                                         r"wrote in the same epoch .*values are identical"):
        out = _run_with_timeout(lambda: simulate(_write_write_kernel(False, True), lnc=2, a=a))
    np.testing.assert_array_equal(out, a)


def test_disjoint_writes_and_barrier_separated_writes_are_fine():
    a = randn(6, (4, 8))
    np.testing.assert_array_equal(_run_with_timeout(lambda: simulate(_write_write_kernel(False, False), lnc=2, a=a)), a)
    np.testing.assert_array_equal(_run_with_timeout(lambda: simulate(_write_write_kernel(True, True), lnc=2, a=a)), a)


def _write_read_kernel(with_barrier, reader_first):
    def k(a):
        pid = nl.program_id(0)
        shared = nl.ndarray((2, 8), nl.float32, buffer=nl.shared_hbm, name="mailbox")
        out = nl.ndarray((2, 8), nl.float32, buffer=nl.shared_hbm)
        writer = 1 if reader_first else 0
        t = sbuf_load(a)
        if pid == writer:
            nisa.dma_copy(dst=shared, src=t)
        if with_barrier:
            nisa.core_barrier(shared, (0, 1))
        if pid != writer:
            back = nl.ndarray((2, 8), nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(dst=back, src=shared)
        nisa.dma_copy(dst=out[pid:pid + 1, :], src=t[pid:pid + 1, :])
        return out

    return k


def test_write_read_race_detected():
    # program 0 writes, program 1 reads in the same epoch: detected at the read
    with pytest.raises(RaceError, match=r"program 1 reads shared_hbm tensor 'mailbox' bytes that program 0 wrote"):
        _run_with_timeout(lambda: simulate(_write_read_kernel(False, False), lnc=2, a=randn(7, (2, 8))))


def test_read_then_foreign_write_race_detected(monkeypatch):
    # program 0 reads (non-strict, so the unwritten read itself is allowed), then program 1 writes
    monkeypatch.setenv("NKILIB_SIM_STRICT", "0")
    with pytest.raises(RaceError, match=r"program 1 writes shared_hbm tensor 'mailbox' bytes that program 0 read"):
        _run_with_timeout(lambda: simulate(_write_read_kernel(False, True), lnc=2, a=randn(8, (2, 8))))


def test_write_barrier_read_is_fine():
    a = randn(9, (2, 8))
    for reader_first in (False, True):
        out = _run_with_timeout(lambda: simulate(_write_read_kernel(True, reader_first), lnc=2, a=a))
        np.testing.assert_array_equal(out, a)


def test_shared_input_write_race():
    def k(a):
        pid = nl.program_id(0)
        nisa.dma_copy(dst=a[0:1, :], src=sbuf_load(a[pid:pid + 1, :]))  # different values per program

    with pytest.raises(RaceError, match="'a'"):
        _run_with_timeout(lambda: simulate(k, lnc=2, a=randn(10, (2, 4))))


@pytest.mark.parametrize("skipper", [0, 1])
def test_divergent_barrier_count_errors_without_hanging(skipper):
    def k(a):
        out = half_copy(a)
        if nl.program_id(0) != skipper:
            nisa.core_barrier(out, (0, 1))
        return out

    msg = rf"program\(s\) \[{1 - skipper}\] wait at barrier #0 but program\(s\) \[{skipper}\] returned"
    with pytest.raises(NkiValidationError, match=msg):
        _run_with_timeout(lambda: simulate(k, lnc=2, a=randn(11, (4, 4))))


def test_extra_barrier_in_one_program_errors():
    def k(a):
        out = half_copy(a)
        nisa.core_barrier(out, (0, 1))
        if nl.program_id(0) == 0:
            nisa.core_barrier(out, (0, 1))
        return out

    with pytest.raises(NkiValidationError, match=r"program\(s\) \[0\] wait at barrier #1"):
        _run_with_timeout(lambda: simulate(k, lnc=2, a=randn(12, (4, 4))))


def test_error_in_one_program_does_not_hang_the_other():
    def k(a):
        out = half_copy(a)
        if nl.program_id(0) == 1:
            raise ValueError("boom in program 1")
        nisa.core_barrier(out, (0, 1))
        return out

    with pytest.raises(ValueError, match="boom in program 1"):
        _run_with_timeout(lambda: simulate(k, lnc=2, a=randn(13, (4, 4))))


def test_core_barrier_under_lnc1_is_accepted(set_target):
    # 2.33 core_barrier page: cores=(0, 1) "applies at LNC degree 1 and 2" (unconditional barriers in
    # nki-library kernels run at LNC1 too); one program here, so it returns at once
    def lnc1(a):
        out = hbm_store(sbuf_load(a))
        nisa.core_barrier(out, (0, 1))
        return out

    a = randn(14, (2, 2))
    for target in ("trn2", "trn3"):
        set_target(target)
        np.testing.assert_array_equal(simulate(lnc1, a=a), a)
    res = run_kernel(lnc1, (a,), trace=True)
    assert [r.instr for r in res.trace].count("core_barrier") == 1


def test_core_barrier_argument_rules():

    def bad(kind):
        def k(a):
            out = half_copy(a)
            if kind == "cores":
                nisa.core_barrier(out, (0, 2))
            elif kind == "sbuf":
                nisa.core_barrier(nl.ndarray((2, 2), nl.float32, buffer=nl.sbuf), (0, 1))
            else:
                nisa.core_barrier(out, (0, 1), engine=3)
            return out
        return k

    for kind, msg in (("cores", "cores must be"), ("sbuf", "shared_hbm tensor, got sbuf"), ("engine", "engine")):
        with pytest.raises(NkiValidationError, match=msg):
            _run_with_timeout(lambda: simulate(bad(kind), lnc=2, a=randn(15, (4, 4))))


def test_shared_allocation_mismatch_between_programs_rejected():
    def k(a):
        pid = nl.program_id(0)
        nl.ndarray((2, 4 + pid), nl.float32, buffer=nl.shared_hbm, name="x")
        return half_copy(a)

    with pytest.raises(NkiValidationError, match="allocate shared_hbm tensors identically"):
        _run_with_timeout(lambda: simulate(k, lnc=2, a=randn(16, (4, 4))))


def test_programs_must_return_the_same_outputs():
    def k(a):
        out = half_copy(a)
        return out if nl.program_id(0) == 0 else hbm_store(sbuf_load(a))

    with pytest.raises(NkiValidationError, match="returned different output tensors"):
        _run_with_timeout(lambda: simulate(k, lnc=2, a=randn(17, (4, 4))))


def test_check_races_false_skips_race_bookkeeping_same_trace():
    """run_kernel(check_races=False) (cost runs): the racy kernel runs, its trace equals a race-free twin's
    instruction for instruction, and the default still raises."""
    from nkilib.simulator import ShapeSpec, run_kernel

    racy = _write_write_kernel(False, True)
    spec = ShapeSpec((4, 8), nl.float32)
    with pytest.raises(RaceError, match="'result'"):
        _run_with_timeout(lambda: run_kernel(_write_write_kernel(False, True, values_differ=True),
                                             args=(randn(5, (4, 8)),), lnc=2))
    res = _run_with_timeout(lambda: run_kernel(racy, args=(spec,), lnc=2, trace=True, numerics=False,
                                               check_races=False))
    assert [(r.program, r.instr) for r in res.trace] == [(0, "dma_copy"), (0, "dma_copy"), (1, "dma_copy"),
                                                          (1, "dma_copy")]
    assert res.trace[3].writes[0].name == "result"


def test_inputs_hold_no_written_mask_until_a_copy_brings_unwritten_bytes(set_target):
    """Kernel inputs are 'every byte written' without a per-byte mask; copying never-written SBUF bytes
    into one materialises the mask, and strict mode then rejects a computation that reads them."""
    seen = {}

    def k(a):
        seen["before"] = a.storage.written
        t = nl.ndarray((2, 4), nl.float32, buffer=nl.sbuf)  # never written
        nisa.dma_copy(dst=a[0:2, :], src=t)
        seen["after"] = a.storage.written.copy()
        u = nl.ndarray((2, 4), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=u, src=a[0:2, :])
        v = nl.ndarray((2, 4), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=v, src=u)
        nisa.tensor_scalar(dst=v, data=u, op0=nl.add, operand0=1.0)

    with pytest.raises(UninitializedReadError, match="tensor_scalar"):
        simulate(k, a=randn(3, (3, 4)))
    assert seen["before"] is None
    assert seen["after"][:32].sum() == 0 and seen["after"][32:].all()  # rows 0-1 (2 x 4 x 4 B) now unwritten
