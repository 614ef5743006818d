"""nisa.sendrecv: the exchange between the two cores of an LNC2 pair (isa/exchange.py, runtime.Launch.exchange),
its rejections, calls that do not pair up, and its cost record (cost/scheduler.py).

Pages: https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/api/generated/nki.isa.sendrecv.html (and the
v2.29.1 / v2.30.0 versions); choices: docs/simulator.md#choice-sendrecv-pairing.
"""
import ml_dtypes
import numpy as np
import pytest

import nki.isa as nisa
import nki.language as nl
from simkit import run_with_timeout, simulate

from nkilib.simulator import run_kernel
from nkilib.simulator.cost import schedule
from nkilib.simulator.errors import NkiValidationError, RaceError
from nkilib.simulator.hardware import resolve_target


def _swap_kernel(rows, np_dtype=None, **kw):
    """Each program loads its half of `a` rows into SBUF, sendrecv's it, and stores what it received in its
    own half of the output: out = a with the halves swapped."""

    def k(a):
        pid = nl.program_id(0)
        mine = nl.ndarray((rows,) + a.shape[1:], a.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=mine, src=a[pid * rows:(pid + 1) * rows])
        got = nl.ndarray(mine.shape, a.dtype, buffer=nl.sbuf)
        nisa.sendrecv(src=mine, dst=got, send_to_rank=1 - pid, recv_from_rank=1 - pid, pipe_id=0, **kw)
        out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out[pid * rows:(pid + 1) * rows], src=got)
        return out

    return k


def _bits(seed, shape, np_dtype):
    """Random bit patterns of `np_dtype` (NaNs with payloads, infinities and subnormals included)."""
    raw = np.random.default_rng(seed).integers(0, 256, size=shape + (np.dtype(np_dtype).itemsize,), dtype=np.uint8)
    return raw.view(np_dtype).reshape(shape)


@pytest.mark.parametrize("np_dtype", [np.float32, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, np.uint8])
def test_exchange_swaps_the_halves_bit_exactly(any_target, np_dtype):
    rows = 32
    a = _bits(1, (2 * rows, 24), np_dtype)
    out = run_with_timeout(lambda: simulate(_swap_kernel(rows), lnc=2, a=a))
    want = np.concatenate([a[rows:], a[:rows]])
    np.testing.assert_array_equal(out.view(np.uint8), want.view(np.uint8))


def test_gpsimd_dma_at_its_limits_exchanges():
    # 1024 bytes per partition of a 32-bit type, 16 partitions: the most gpsimd_dma allows
    a = _bits(2, (32, 256), np.float32)
    out = run_with_timeout(lambda: simulate(_swap_kernel(16, dma_engine=nisa.dma_engine.gpsimd_dma), lnc=2, a=a))
    np.testing.assert_array_equal(out.view(np.uint32), np.concatenate([a[16:], a[:16]]).view(np.uint32))


def test_pipes_pair_in_order_and_dst_is_written_for_the_strict_reader():
    """Two exchanges on different pipes, each pairing with the peer's call of the same pipe; the received
    tile is read by a compute instruction (strict mode: a never-written element would raise)."""

    def k(a):
        pid = nl.program_id(0)
        t = nl.ndarray((8, 4), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=a[pid * 8:(pid + 1) * 8])
        r1 = nl.ndarray((8, 4), nl.float32, buffer=nl.sbuf)
        r2 = nl.ndarray((8, 4), nl.float32, buffer=nl.sbuf)
        nisa.sendrecv(src=t, dst=r1, send_to_rank=1 - pid, recv_from_rank=1 - pid, pipe_id=3)
        nisa.tensor_scalar(dst=t, data=r1, op0=nl.multiply, operand0=2.0)
        nisa.sendrecv(src=t, dst=r2, send_to_rank=1 - pid, recv_from_rank=1 - pid, pipe_id=7)
        out = nl.ndarray((16, 4), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out[pid * 8:(pid + 1) * 8], src=r2)
        return out

    a = np.random.default_rng(3).standard_normal((16, 4)).astype(np.float32)
    np.testing.assert_array_equal(run_with_timeout(lambda: simulate(k, lnc=2, a=a)), 2 * a)  # sent twice: back home, doubled


def _bad(kind):
    def k(a):
        pid = nl.program_id(0)
        s = nl.ndarray((16, 8), nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=s, value=0.0)
        d = nl.ndarray((16, 8), nl.float32, buffer=nl.sbuf)
        args = dict(src=s, dst=d, send_to_rank=1 - pid, recv_from_rank=1 - pid, pipe_id=0)
        if kind == "psum_dst":
            args["dst"] = nl.ndarray((16, 8), nl.float32, buffer=nl.psum)
        elif kind == "hbm_src":
            args["src"] = a
        elif kind == "dtype":
            args["dst"] = nl.ndarray((16, 8), nl.bfloat16, buffer=nl.sbuf)
        elif kind == "shape":
            args["dst"] = nl.ndarray((16, 4, 2), nl.float32, buffer=nl.sbuf)
        elif kind == "rank2":
            args["send_to_rank"] = 2
        elif kind == "self_send":
            args["send_to_rank"] = pid
        elif kind == "self_recv":
            args["recv_from_rank"] = pid
        elif kind == "pipe":
            args["pipe_id"] = -1
        elif kind == "pipe_bool":
            args["pipe_id"] = True
        elif kind == "engine":
            args["dma_engine"] = 2
        elif kind == "gpsimd_fp32":  # 257 x 4 bytes > 1024
            big = nl.ndarray((16, 257), nl.float32, buffer=nl.sbuf)
            args.update(src=big, dst=nl.ndarray((16, 257), nl.float32, buffer=nl.sbuf))
        elif kind == "gpsimd_bf16":  # 257 x 2 bytes > 512
            big = nl.ndarray((16, 257), nl.bfloat16, buffer=nl.sbuf)
            args.update(src=big, dst=nl.ndarray((16, 257), nl.bfloat16, buffer=nl.sbuf))
        elif kind == "gpsimd_u8":  # 257 bytes > 256
            big = nl.ndarray((16, 257), nl.uint8, buffer=nl.sbuf)
            args.update(src=big, dst=nl.ndarray((16, 257), nl.uint8, buffer=nl.sbuf))
        elif kind == "gpsimd_parts":  # 8 partitions: not a multiple of 16
            args.update(src=s[:8], dst=d[:8])
        if kind.startswith("gpsimd"):
            args["dma_engine"] = nisa.dma_engine.gpsimd_dma
        nisa.sendrecv(**args)
        return a

    return k


@pytest.mark.parametrize("kind, msg", [
    ("psum_dst", "argument 'dst' .* must be in SBUF, got psum"),
    ("hbm_src", "argument 'src' .* must be in SBUF, got shared_hbm"),
    ("dtype", "src and dst must have the same dtype, got src float32 and dst bfloat16"),
    ("shape", r"src and dst must have the same shape, got src \(16, 8\) and dst \(16, 4, 2\)"),
    ("rank2", "send_to_rank must be 0 or 1 .* got 2"),
    ("self_send", "send_to_rank=0 is this core's own rank"),
    ("self_recv", "recv_from_rank=0 is this core's own rank"),
    ("pipe", "pipe_id must be a non-negative integer, got -1"),
    ("pipe_bool", "pipe_id must be a non-negative integer, got True"),
    ("engine", "dma_engine must be an nisa.dma_engine member, got 2"),
    ("gpsimd_fp32", "dma_engine=gpsimd_dma moves at most 1024 bytes per partition of a 32-bit type, got 1028"),
    ("gpsimd_bf16", "dma_engine=gpsimd_dma moves at most 512 bytes per partition of a 16-bit type, got 514"),
    ("gpsimd_u8", "dma_engine=gpsimd_dma moves at most 256 bytes per partition of a 8-bit type, got 257"),
    ("gpsimd_parts", "dma_engine=gpsimd_dma requires a partition dimension that is a multiple of 16, got 8"),
])
def test_rejections_name_the_argument(kind, msg):
    with pytest.raises(NkiValidationError, match=f"nisa.sendrecv: {msg}"):
        run_with_timeout(lambda: simulate(_bad(kind), lnc=2, a=np.zeros((16, 8), np.float32)))


def test_rejected_under_lnc1():
    with pytest.raises(NkiValidationError, match=r"only allowed when LNC is enabled .* runs 1 program"):
        simulate(_swap_kernel(8), lnc=1, a=np.zeros((16, 4), np.float32))


def _unpaired(kind):
    def k(a):
        pid = nl.program_id(0)
        t = nl.ndarray((8, 4), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=a[0:8])
        r = nl.ndarray((8, 4), nl.float32, buffer=nl.sbuf)
        out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
        if kind == "pipes":
            nisa.sendrecv(src=t, dst=r, send_to_rank=1 - pid, recv_from_rank=1 - pid, pipe_id=pid)
        elif kind == "barrier":
            if pid == 0:
                nisa.sendrecv(src=t, dst=r, send_to_rank=1, recv_from_rank=1, pipe_id=0)
            else:
                nisa.core_barrier(out, (0, 1))
        elif kind == "returns":
            if pid == 1:
                nisa.sendrecv(src=t, dst=r, send_to_rank=0, recv_from_rank=0, pipe_id=0)
        elif kind == "peer_shape":
            n = 4 if pid == 0 else 2
            nisa.sendrecv(src=t[:, :n], dst=r[:, :n], send_to_rank=1 - pid, recv_from_rank=1 - pid, pipe_id=0)
        elif kind == "peer_engine":
            eng = nisa.dma_engine.dma if pid == 0 else nisa.dma_engine.gpsimd_dma
            t16 = nl.ndarray((16, 4), nl.float32, buffer=nl.sbuf)
            nisa.memset(dst=t16, value=1.0)
            r16 = nl.ndarray((16, 4), nl.float32, buffer=nl.sbuf)
            nisa.sendrecv(src=t16, dst=r16, send_to_rank=1 - pid, recv_from_rank=1 - pid, pipe_id=0, dma_engine=eng)
        nisa.dma_copy(dst=out[pid * 8:(pid + 1) * 8], src=t)
        return out

    return k


@pytest.mark.parametrize("kind, msg", [
    ("pipes", r"do not pair up: program 0 waits at nisa.sendrecv #0 on pipe_id 0; program 1 waits at "
              r"nisa.sendrecv #0 on pipe_id 1"),
    ("barrier", r"do not pair up: program 0 waits at nisa.sendrecv #0 on pipe_id 0; program 1 waits at "
                r"nisa.core_barrier #0"),
    ("returns", r"nisa.sendrecv: program\(s\) \[1\] wait at sendrecv #0 on pipe_id 0 but program\(s\) \[0\] "
                r"returned without reaching it"),
    ("peer_shape", r"program 0 sends a \(8, 4\) float32 src on pipe_id 0 but program 1's dst is \(8, 2\) float32"),
    ("peer_engine", "program 0 uses dma_engine=dma on pipe_id 0 but program 1 uses dma_engine=gpsimd_dma"),
])
def test_calls_that_do_not_pair_up_raise_instead_of_hanging(kind, msg):
    with pytest.raises(NkiValidationError, match=msg):
        run_with_timeout(lambda: simulate(_unpaired(kind), lnc=2, a=np.zeros((16, 4), np.float32)))


def test_sendrecv_opens_no_epoch_for_shared_hbm():
    """A shared-HBM write by one core and a read by the other still need a core_barrier: sendrecv
    synchronises the SBUF exchange only (docs/simulator.md#choice-sendrecv-pairing)."""

    def k(a):
        pid = nl.program_id(0)
        scratch = nl.ndarray((8, 4), nl.float32, buffer=nl.shared_hbm, name="scratch")
        t = nl.ndarray((8, 4), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=a[0:8])
        if pid == 1:
            nisa.dma_copy(dst=scratch, src=t)
        r = nl.ndarray((8, 4), nl.float32, buffer=nl.sbuf)
        nisa.sendrecv(src=t, dst=r, send_to_rank=1 - pid, recv_from_rank=1 - pid, pipe_id=0)
        if pid == 0:
            nisa.dma_copy(dst=t, src=scratch)
        out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out[pid * 8:(pid + 1) * 8], src=t)
        return out

    with pytest.raises(RaceError, match="program 0 reads shared_hbm tensor 'scratch' bytes that program 1 wrote"):
        run_with_timeout(lambda: simulate(k, lnc=2, a=np.zeros((16, 4), np.float32)))


def _late_peer_kernel(a):
    """Program 1 loads a large tile before its sendrecv; program 0's sendrecv must wait for it."""
    pid = nl.program_id(0)
    t = nl.ndarray((128, 64), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=a[0:128, 0:64])
    if pid == 1:
        big = nl.ndarray((128, 4096), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=big, src=a)
        nisa.tensor_copy(dst=t, src=big[:, 0:64])
    r = nl.ndarray((128, 64), nl.float32, buffer=nl.sbuf)
    nisa.sendrecv(src=t, dst=r, send_to_rank=1 - pid, recv_from_rank=1 - pid, pipe_id=0)
    out = nl.ndarray((256, 64), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out[pid * 128:(pid + 1) * 128], src=r)
    return out


def test_cost_record_and_rendezvous_schedule():
    a = np.zeros((128, 4096), np.float32)
    res = run_kernel(_late_peer_kernel, (a,), lnc=2, trace=True, numerics=False)
    recs = [r for r in res.trace if r.instr == "sendrecv"]
    assert [r.program for r in recs] == [0, 1]
    for r in recs:
        assert r.attrs["bytes"] == 128 * 64 * 4 and r.attrs["pipe_id"] == 0 and r.attrs["dma_engine"] == "dma"
        assert [o.arg for o in r.reads] == ["src"] and [o.arg for o in r.writes] == ["dst"]
        assert r.writes[0].buffer == "sbuf"
    target = resolve_target("trn3")
    sch = schedule(res.trace, target, lnc=2)
    s0, s1 = (r.seq for r in recs)
    # program 1's tensor_copy feeds its sendrecv; program 0's transfer cannot start before it plus the
    # cross-core synchronisation (core_barrier's latency)
    copy1 = next(r.seq for r in res.trace if r.instr == "tensor_copy" and r.program == 1)
    assert sch.start[s0] >= sch.end[copy1] + target.barrier_latency_s
    assert sch.start[s1] >= sch.end[copy1] + target.barrier_latency_s
    assert sch.end[s0] == sch.end[s1]  # the pair completes together
    # each core moves its src's bytes over its own DMA engines, no HBM traffic
    assert sch.costs[s0].dma.nbytes == 128 * 64 * 4 and sch.costs[s0].dma.hbm_bytes == 0
    # the received tile's consumer (the store) waits for the pair
    store0 = next(r.seq for r in res.trace if r.seq > s0 and r.program == 0 and r.instr == "dma_copy")
    assert sch.start[store0] >= sch.end[s0]
