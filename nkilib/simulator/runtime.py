"""Kernel launch runtime: program contexts, LNC scheduling, barriers, memory accounting, races.

Execution model (documented choice, issue 2 §3 "threads or cooperative scheduling"):
each LNC program runs in its own Python thread, but only one thread runs at a time. A baton is
passed deterministically: program 0 runs until it reaches `core_barrier` (or returns), then
program 1 runs until its barrier, and so on; when every program has arrived, the barrier opens,
a new *epoch* starts and the last arriver keeps running. Results are therefore deterministic,
and a barrier really blocks (program 1 cannot observe program 0's post-barrier writes early).
`nisa.sendrecv` is a rendezvous of the same kind (`exchange`): each program deposits its src at
the call and leaves with the peer's; it opens no epoch (docs/simulator.md#choice-sendrecv-pairing).
Every program must reach the same sequence of synchronisation points (core_barrier, sendrecv with
its pipe_id): points that do not pair up raise NkiValidationError instead of hanging.

Memory accounting rule (SBUF/PSUM capacity check, ours — the official simulator has none):
- a tensor is live from its `nl.ndarray` allocation until it becomes unreachable from Python
  (CPython frees it as soon as the last view of its storage is dropped);
- an SBUF tensor of shape [P, F...] occupies prod(F) * itemsize bytes in *every* partition
  (the NKI allocator reserves a free-byte range across partitions; budgets in nki-library are
  per-partition bytes);
- a PSUM tensor occupies its per-partition bytes rounded up to whole 2 KiB banks (an
  accumulation group lives in banks; 8 banks per partition, Trainium2/3 architecture guides);
- the sum over live tensors may not exceed the target's per-partition capacity
  (hardware.py: 224 KiB SBUF trn2, 256 KiB trn3, 16 KiB PSUM).

Dynamic control flow (LNC>1): the programs' logs of dynamic-loop trip counts must agree at every
barrier, when a program returns while another waits, and at the end (control_flow.py).

Race rule (LNC>1, ours): within one epoch (between two barriers), if one program writes bytes
of a `shared_hbm` tensor that another program reads or writes in the same epoch, a RaceError is
raised at the second access (whichever program runs second detects it). One exception: a write of
bytes identical to what the other program wrote in the epoch only warns (RaceWarning). The docs
(https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.core_barrier.html,
https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/get-started/about/lnc.html) describe the
barrier for "disjoint portions" written by each core and consumed afterwards; they do not call
overlapping writes of equal data a race, and the final memory is the same in either order, so the
result is defined. Differing values (order-dependent result) and read/write overlaps stay errors. In
shape-only runs (no numerics) the values are unknown and an overlapping write warns as well.
"""
from __future__ import annotations

import itertools
import threading
import warnings
import weakref
from dataclasses import dataclass, field

import numpy as np

from .control_flow import check_same_control_flow
from .errors import CapacityError, NkiValidationError, RaceError, RaceWarning
from .settings import Settings

_tls = threading.local()
_storage_ids = itertools.count(1)


def next_storage_id() -> int:
    return next(_storage_ids)


def current(optional: bool = False) -> "ProgramContext | None":
    """The ProgramContext of the running program; error outside a kernel launch."""
    ctx = getattr(_tls, "ctx", None)
    if ctx is None and not optional:
        raise NkiValidationError(
            "NKI API called outside a kernel launch: run the kernel with nki.simulate(kernel)[lnc](...)"
        )
    return ctx


class _Aborted(BaseException):
    """Raised in a waiting program thread when another program failed."""


@dataclass
class MemoryTracker:
    """Live and peak bytes per partition for one physical core's SBUF and PSUM."""

    capacity: dict
    live: dict = field(default_factory=lambda: {"sbuf": 0, "psum": 0})
    peak: dict = field(default_factory=lambda: {"sbuf": 0, "psum": 0})
    tensors: dict = field(default_factory=dict)  # storage id -> (buffer, bytes, description)

    def allocate(self, storage, nbytes: int, description: str) -> None:
        buf = storage.buffer_kind
        if self.live[buf] + nbytes > self.capacity[buf]:
            live = sorted(self.tensors.values(), key=lambda t: -t[1])
            top = ", ".join(f"{d} {b} B" for kind, b, d in live if kind == buf)[:600]
            raise CapacityError(
                f"nl.ndarray: allocating {description} needs {nbytes} bytes per partition in {buf.upper()}, "
                f"but {self.live[buf]} of {self.capacity[buf]} bytes per partition are live "
                f"(largest live: {top or 'none'})"
            )
        self.live[buf] += nbytes
        self.peak[buf] = max(self.peak[buf], self.live[buf])
        self.tensors[storage.id] = (buf, nbytes, description)
        weakref.finalize(storage, self._free, storage.id)

    def _free(self, sid: int) -> None:
        entry = self.tensors.pop(sid, None)
        if entry is not None:
            self.live[entry[0]] -= entry[1]


class ProgramContext:
    """State of one LNC program (one physical NeuronCore) during a launch."""

    def __init__(self, launch: "Launch", program_id: int):
        self.launch = launch
        self.program_id = program_id
        self.settings: Settings = launch.settings
        self.target = launch.settings.target
        self.numerics = launch.numerics
        self.trace = launch.trace  # list or None (shared by programs; records carry program id)
        self.memory = MemoryTracker(
            capacity={
                "sbuf": self.target.sbuf_bytes_per_partition,
                "psum": self.target.psum_bytes_per_partition,
            }
        )
        self.phase = None  # label attached to trace records (set by trace.label_phases)
        self.unnamed_shared = 0  # per-program counter to link unnamed shared_hbm allocations
        self.private_hbm = []  # keep private allocations alive for the launch
        # ScalarE reduce registers (activation reduce_cmd), one fp32 per partition (nki.isa.activation page)
        self.act_reduce_regs = np.zeros(128, np.float32)
        # whether each holds a known value (False after a value-less activation of a shape-only run)
        self.act_reduce_known = np.ones(128, np.bool_)
        # VectorE accumulator registers (scalar_tensor_tensor reduce_cmd, NKI 0.7), one fp32 per partition
        # (nki.isa.tensor_scalar_reduce / tensor_scalar_cumulative pages, "internal accumulator registers"),
        # and whether each holds a known value (see act_reduce_known)
        self.vec_reduce_regs = np.zeros(128, np.float32)
        self.vec_reduce_known = np.ones(128, np.bool_)
        # dynamic loops entered so far (control_flow.LoopEntry), compared across LNC programs
        self.dynamic_loops = []
        self.loop_stack = []  # LoopEntry of each running dynamic loop, outermost first

    @property
    def num_programs(self) -> int:
        return self.launch.lnc

    @property
    def grid_ndim(self) -> int:
        return self.launch.grid_ndim

    def record(self, **kw) -> None:
        if self.trace is not None:
            from .trace import make_record

            if self.loop_stack:  # instructions of a dynamic loop's body name the loop and iteration
                inner = self.loop_stack[-1]
                kw.setdefault("loop_iteration", (inner.ordinal, inner.trips - 1))

            self.trace.append(make_record(self, **kw))


class Launch:
    """One kernel launch over `lnc` programs (see module docstring for the schedule)."""

    def __init__(self, lnc: int, grid_ndim: int, settings: Settings, numerics: bool = True, trace: bool = False,
                 check_races: bool = True):
        self.lnc = lnc
        self.grid_ndim = grid_ndim
        self.settings = settings
        self.numerics = numerics
        self.check_races = check_races
        self.trace = [] if trace else None
        self.epoch = 0
        self.barriers_passed = 0
        self.shared = {}  # key -> Storage (shared_hbm allocations linked across programs)
        self._cond = threading.Condition()
        self._turn = 0
        self._arrived = set()
        self._points = {}  # program -> (key, description) of the synchronisation point it waits at
        self._payloads = {}  # program -> what it deposited at that point (sendrecv: its src)
        self._delivered = {}  # program -> every program's payload, once the point opened
        self.sendrecv_done = {}  # pipe_id -> sendrecv pairs completed on that pipe
        self._done = set()
        self._failed = None
        self.contexts = [ProgramContext(self, p) for p in range(lnc)]

    # ---- shared HBM linking (inferred: unnamed shared_hbm tensors link by allocation order, docs/simulator.md) ----
    def link_shared(self, key, make, shape, dtype, program_id):
        """Return the shared storage for `key`, creating it on first use; checks the other program agrees."""
        existing = self.shared.get(key)
        if existing is None:
            storage = make()
            self.shared[key] = storage
            return storage
        if tuple(existing.shape) != tuple(shape) or existing.dtype != dtype:
            raise NkiValidationError(
                f"nl.ndarray(buffer=nl.shared_hbm): program {program_id} allocates shared tensor {key!r} as "
                f"{tuple(shape)} {dtype} but another program allocated it as {tuple(existing.shape)} "
                f"{existing.dtype}; LNC programs must allocate shared_hbm tensors identically"
            )
        return existing

    # ---- scheduling ----
    def run(self, fn):
        results = [None] * self.lnc
        errors = [None] * self.lnc

        def body(p):
            _tls.ctx = self.contexts[p]
            try:
                with self._cond:
                    self._cond.wait_for(lambda: self._turn == p or self._failed is not None)
                    if self._failed is not None:
                        return
                results[p] = fn()
                with self._cond:
                    self._done.add(p)
                    self._check_stuck(p)
                    self._pass_turn(p)
            except _Aborted:
                pass
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller thread
                errors[p] = e
                with self._cond:
                    if self._failed is None:
                        self._failed = p
                    self._done.add(p)
                    self._cond.notify_all()
            finally:
                _tls.ctx = None

        if self.lnc == 1:
            body(0)
        else:
            threads = [threading.Thread(target=body, args=(p,), name=f"nki-program-{p}") for p in range(self.lnc)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        for e in errors:
            if e is not None:
                raise e
        if self.lnc > 1:
            check_same_control_flow(self.contexts, "end of kernel")
        return results

    def _pass_turn(self, p):
        for step in range(1, self.lnc + 1):
            q = (p + step) % self.lnc
            if q not in self._done and q not in self._arrived:
                self._turn = q
                self._cond.notify_all()
                return
        self._cond.notify_all()

    def _check_stuck(self, p):
        if self._arrived and all(q in self._arrived or q in self._done for q in range(self.lnc)):
            waiting = sorted(self._arrived)
            key, what = self._points[waiting[0]]
            # a data-dependent trip count is the likelier cause: name it if the loop logs differ
            check_same_control_flow(self.contexts, self._label(key, what))
            # name the program(s) that returned, not `p` (p may be the one that just arrived)
            returned = sorted(q for q in self._done if q not in self._arrived)
            raise NkiValidationError(
                f"nisa.{key[0]}: program(s) {waiting} wait at {what} but program(s) "
                f"{returned} returned without reaching it; LNC programs must execute identical control flow "
                f"(https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/get-started/about/lnc.html)"
            )

    def barrier(self, p):
        self._rendezvous(p, ("core_barrier",), f"barrier #{self.barriers_passed}")

    def exchange(self, p, pipe_id, payload):
        """nisa.sendrecv rendezvous on `pipe_id`: returns {program: payload} of every program."""
        what = f"sendrecv #{self.sendrecv_done.get(pipe_id, 0)} on pipe_id {pipe_id}"
        return self._rendezvous(p, ("sendrecv", pipe_id), what, payload)

    def _rendezvous(self, p, key, what, payload=None):
        with self._cond:
            self._arrived.add(p)
            self._points[p] = (key, what)
            self._payloads[p] = payload
            if len(self._arrived) == self.lnc:
                self._open(key, what)
                return self._delivered.pop(p)
            self._check_stuck(p)
            self._pass_turn(p)
            self._cond.wait_for(lambda: (self._turn == p and p not in self._arrived) or self._failed is not None)
            if self._failed is not None:
                raise _Aborted()
            return self._delivered.pop(p)

    def _label(self, key, what):
        return f"nisa.core_barrier #{self.barriers_passed}" if key[0] == "core_barrier" else f"nisa.{what}"

    def _open(self, key, what):
        """Every program arrived: check they wait at the same point, then open it (the caller holds _cond)."""
        points = sorted(self._points.items())
        if len({k for _, (k, _) in points}) > 1:
            where = "; ".join(f"program {q} waits at {self._label(k, w)}" for q, (k, w) in points)
            raise NkiValidationError(
                f"LNC programs reached synchronisation points that do not pair up: {where}. Each program must "
                "reach the same sequence of nisa.core_barrier and nisa.sendrecv calls (sendrecv: the same pipe_id "
                "in the same order); on hardware these calls would wait for each other forever "
                "(docs/simulator.md#choice-sendrecv-pairing)")
        check_same_control_flow(self.contexts, self._label(key, what))
        self._arrived.clear()
        if key[0] == "core_barrier":
            self.epoch += 1
            self.barriers_passed += 1
        else:
            self.sendrecv_done[key[1]] = self.sendrecv_done.get(key[1], 0) + 1
        payloads = dict(self._payloads)
        self._delivered = {q: payloads for q in range(self.lnc)}
        self._points.clear()
        self._payloads.clear()
        self._cond.notify_all()

    # ---- race detection on shared_hbm ----
    def note_access(self, storage, byte_index_view_fn, write: bool, p: int, what: str, new_bytes=None):
        """Record program p's access to `storage` bytes; raise RaceError on a same-epoch conflict.

        `byte_index_view_fn(mask)` returns a view of `mask` (flat, one entry per storage byte)
        restricted to the accessed bytes. `new_bytes` (writes with numerics): the bytes about to be
        written, shaped like that view, to tell a write of identical values (RaceWarning) from a real
        write-write race (module docstring).
        """
        if not self.check_races:  # run_kernel(check_races=False): a cost run of a kernel verified elsewhere
            return
        state = storage.race_state
        mine = state.get(p)
        if mine is None or mine[0] != self.epoch:
            mine = [self.epoch, np.zeros(storage.nbytes, np.bool_), np.zeros(storage.nbytes, np.bool_)]
            state[p] = mine
        for q, other in state.items():
            if q == p or other[0] != self.epoch:
                continue
            conflict = byte_index_view_fn(other[2])  # other program's writes
            if conflict.any():
                kind = "writes" if write else "reads"
                if write and self._same_bytes(storage, byte_index_view_fn, conflict, new_bytes):
                    warnings.warn(RaceWarning(
                        f"{what}: program {p} writes shared_hbm tensor '{storage.name}' bytes that program {q} also "
                        f"wrote in the same epoch (after barrier #{self.barriers_passed}); "
                        + ("the values are identical, so the result does not depend on the order"
                           if new_bytes is not None else "values are not simulated in this run")), stacklevel=4)
                else:
                    raise RaceError(
                        f"{what}: program {p} {kind} shared_hbm tensor '{storage.name}' bytes that program {q} "
                        f"wrote in the same epoch (after barrier #{self.barriers_passed}); add nisa.core_barrier "
                        "between them")
            if write and byte_index_view_fn(other[1]).any():
                raise RaceError(
                    f"{what}: program {p} writes shared_hbm tensor '{storage.name}' bytes that program {q} read "
                    f"in the same epoch (after barrier #{self.barriers_passed}); add nisa.core_barrier between them"
                )
        byte_index_view_fn(mine[2 if write else 1])[...] = True

    def _same_bytes(self, storage, byte_index_view_fn, conflict, new_bytes) -> bool:
        """Do the bytes about to be written equal the bytes now in storage wherever they overlap another
        program's writes? Without numerics (no values; a shape-only run's carried integer inputs too) the
        answer is taken as yes (module docstring)."""
        if storage.data is None or not self.numerics:
            return True
        if new_bytes is None:  # numerics on but the writer did not pass its bytes: cannot prove equal
            return False
        current = byte_index_view_fn(storage.data).view(np.uint8)
        return bool(np.array_equal(current[conflict], new_bytes[conflict]))
