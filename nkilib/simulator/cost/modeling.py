"""Entry point: run a kernel on the simulator with a trace and model its cost."""
from __future__ import annotations

import contextlib
import os

from ..hardware import TargetSpec, resolve_target, with_scenario
from .report import CostReport
from .scheduler import schedule


@contextlib.contextmanager
def _target_env(target):
    name = target.name if isinstance(target, TargetSpec) else resolve_target(target).name
    old = os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE")
    os.environ["NEURON_PLATFORM_TARGET_OVERRIDE"] = name
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("NEURON_PLATFORM_TARGET_OVERRIDE", None)
        else:
            os.environ["NEURON_PLATFORM_TARGET_OVERRIDE"] = old


def model_kernel(kernel_fn, inputs, lnc: int = 1, target="trn3", numerics: bool = False, kwargs=None,
                 phase_of=None, precision=None, model_flops=None, scenario: str | None = None,
                 check_races: bool = True) -> CostReport:
    """Run `kernel_fn` on the simulator with a trace and model its cost.

    Args:
        kernel_fn: the NKI kernel function (plain or `nki.jit`-wrapped).
        inputs: positional inputs (tuple/list) or keyword inputs (dict): numpy arrays (np.empty is
            enough when numerics=False) or `ShapeSpec(shape, dtype)` (shape-only runs).
        lnc: 1 or 2.
        target: "trn2" / "trn3" (or a TargetSpec).
        numerics: False = shape-only run (no arithmetic; shapes, dtypes, trace and checks only).
        kwargs: extra keyword arguments for the kernel (non-tensor options).
        phase_of: optional callable(InstrRecord) -> phase label (see module docstring).
        precision: peak used for MFU: "bf16" / "fp8" / "mx" / "fp32" (default: from the matmuls).
        model_flops: FLOPs of the modeled computation (default: sum of matmul FLOPs in the trace).
        scenario: "central" / "pessimistic": which end of the estimated constants (hardware.py) to use
            (default: the target's own, "central" for the named targets).
        check_races: False skips LNC2 race bookkeeping in the run (`run_kernel`; the trace is the same).
    """
    from ..launcher import run_kernel

    fn = getattr(kernel_fn, "fn", None) or getattr(kernel_fn, "func", None) or kernel_fn
    args, kw = ((), dict(inputs)) if isinstance(inputs, dict) else (tuple(inputs), {})
    kw.update(kwargs or {})
    spec = resolve_target(target) if not isinstance(target, TargetSpec) else target
    if scenario is not None:
        spec = with_scenario(spec, scenario)
    with _target_env(spec):
        res = run_kernel(fn, args, kw, lnc=lnc, trace=True, numerics=numerics, check_races=check_races)
    sched = schedule(res.trace, spec, lnc)
    return CostReport.from_schedule(sched, spec, phase_of=phase_of, precision=precision, model_flops=model_flops,
                                    memory_peak=res.peak_bytes_per_partition)


def rescore(report: CostReport, scenario: str) -> CostReport:
    """The same trace as `report`, scheduled again with the estimated constants at `scenario`'s end
    ("central" / "pessimistic"): a band without running the kernel twice."""
    spec = with_scenario(report.target, scenario)
    sched = schedule(report.schedule.records, spec, report.schedule.lnc)
    return CostReport(sched, spec, list(report.phases), report.precision, report.model_flops, list(report.memory_peak),
                      spec.kernel_launch_overhead_s if report.launch_overhead_s else 0.0)
