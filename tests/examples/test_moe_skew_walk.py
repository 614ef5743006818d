"""simulations/moe_skew_shapes.py's `walk` (core 0's segments: DMAs by tensor / payload, the critical path walked
back through Schedule.blocker) on a tiny shape: it runs, and its numbers add up to the schedule's."""
import pytest

from nkilib.examples.moe_backward_cost import MoePreset
from nkilib.simulator.hardware import resolve_target
from scriptkit import load_script

#: H = I = 256, k = 1, B = 512: experts of 2, 1, 2 and 1 blocks (two groups: three core_barriers, four segments)
_TINY = ([1024, 300, 700, 100], 2124, MoePreset("tiny4", 256, 256, 4, 1))


@pytest.fixture(scope="module")
def walked():
    mss = load_script("moe_skew_shapes")
    mss.SHAPES["tiny"] = _TINY
    try:
        _, sch = mss.run("tiny")
    finally:
        del mss.SHAPES["tiny"]
    return mss, sch


def test_walk_adds_up(walked):
    mss, sch = walked
    for program in (0, 1):
        segs = mss.walk(sch, program)
        bars = [i for i, r in enumerate(sch.records) if r.program == program and r.instr == "core_barrier"]
        assert len(segs) == len(bars) + 1 and len(segs) >= 3, (len(segs), len(bars))
        # every DMA of the core in exactly one segment: the bytes are the schedule's
        dmas = [v for s in segs for v in s["dmas"].values()]
        assert sum(v[1] for v in dmas) == sch.dma_bytes[program], (sum(v[1] for v in dmas), sch.dma_bytes)
        assert sum(v[0] for v in dmas) == sum(1 for i, r in enumerate(sch.records)
                                              if r.program == program and sch.costs[i].kind == "dma")
        # the path's steps (own + wait) cover the core from 0 to its last end, each segment inside its span
        last = max(sch.end[i] for i, r in enumerate(sch.records) if r.program == program)
        total = sum(v[1] + v[2] for s in segs for v in s["path"].values())
        assert total == pytest.approx(last, rel=1e-9), (total, last)
        assert all(v[1] >= 0 and v[2] >= 0 for s in segs for v in s["path"].values())
        assert segs[-1]["span"][1] == last and all(a["span"][1] == b["span"][0] for a, b in zip(segs, segs[1:]))


def test_walk_dma_floor_and_routes(walked, capsys):
    mss, sch = walked
    segs = mss.walk(sch)
    engines = resolve_target(sch.target).dma_engines_per_core
    # pass B's dX stores of this k = 1 shape are the software-DGE scatters into hidden_states_grad
    assert any(k[:2] == ("B dX", "sbuf -> hidden_states_grad") and k[3] == "sw" for s in segs for k in s["dmas"])
    for s in segs:
        for (_, _, payload, _), (count, nbytes, engine_s) in s["dmas"].items():
            assert count > 0 and 0 < payload
            # one engine's rate is at most trn3's sustained 4 KiB rate: the floor is not below bytes / full rate
            assert engine_s >= nbytes / resolve_target(sch.target).dma_bytes_per_s_per_engine * (1 - 1e-9)
        # every segment of this shape moves bytes
        floor = sum(v[2] for v in s["dmas"].values()) / engines
        assert floor > 0
    mss.print_walk(sch, segments=[1])
    out = capsys.readouterr().out
    assert out.startswith("segment 1:") and "DMA-bound floor" in out and "segment 2:" not in out
