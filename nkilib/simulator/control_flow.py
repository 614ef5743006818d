"""Per-program log of dynamic (run-time) loops, and the LNC rule that both programs follow it alike.

"The Neuron SDK assumes that when running a kernel on multiple cores, the program on each core is
'the same' ... if you use dynamic control flow, and this control-flow is different on the different
cores, then the behavior is undefined, and you will likely receive an error at runtime."
(https://awsdocs-neuron.readthedocs-hosted.com/en/v2.28.0/_sources/nki/get-started/about/lnc.rst,
"Final Notes"; same text at https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/get-started/about/lnc.html).

Here that undefined case raises `DivergentControlFlowError`. Every dynamic loop a program enters
appends a `LoopEntry` (kind, call site, iterations started, finished or not). The launch runtime
compares the programs' logs whenever all programs meet at a `core_barrier`, when a program returns
while another waits at a barrier, and at the end of the launch: the logs must agree entry by entry
(same loops in the same order, same trip counts; a loop still running at a barrier must be in the
same iteration on both cores).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

from .errors import DivergentControlFlowError


@dataclass
class LoopEntry:
    kind: str  # fori_loop / dynamic_range / while_loop
    where: str  # call site "file.py:line"
    ordinal: int  # per-program index of the dynamic loops entered (0-based)
    trips: int = 0  # iterations started so far
    done: bool = False
    record: object = None  # the trace record of the loop (its trip_count is filled in at exit)

    def describe(self) -> str:
        return f"nl.{self.kind} #{self.ordinal} at {self.where}"


def call_site(depth: int) -> str:
    """'file.py:line' of the frame `depth` levels above the caller."""
    frame = sys._getframe(depth + 1)
    return f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno}"


def _state(entry: LoopEntry) -> str:
    if entry.done:
        return f"ran {entry.trips} iteration(s)"
    return f"is in iteration {entry.trips} (still running)"


def check_same_control_flow(contexts, when: str) -> None:
    """Raise DivergentControlFlowError unless every program's loop log equals program 0's."""
    ref = contexts[0].dynamic_loops
    for ctx in contexts[1:]:
        log, p = ctx.dynamic_loops, ctx.program_id
        for a, b in zip(ref, log):
            if a.kind != b.kind or a.where != b.where:
                raise DivergentControlFlowError(
                    f"{when}: LNC programs diverged at dynamic loop #{a.ordinal}: program 0 entered "
                    f"{a.describe()}, program {p} entered {b.describe()}; divergent dynamic control flow across "
                    "cores is undefined behaviour (NKI LNC guide)")
            if a.trips != b.trips or a.done != b.done:
                raise DivergentControlFlowError(
                    f"{when}: LNC programs took different trip counts in {a.describe()}: program 0 {_state(a)}, "
                    f"program {p} {_state(b)}; divergent dynamic control flow across cores is undefined "
                    "behaviour (NKI LNC guide)")
        if len(log) != len(ref):
            longer, extra = (0, ref[len(log)]) if len(ref) > len(log) else (p, log[len(ref)])
            raise DivergentControlFlowError(
                f"{when}: program 0 entered {len(ref)} dynamic loop(s) but program {p} entered {len(log)}; program "
                f"{longer} also ran {extra.describe()}; divergent dynamic control flow across cores is undefined "
                "behaviour (NKI LNC guide)")
