"""Modeled time of the dense MLP backward kernel (shape-only simulator run + the cost model).

Shared by the main job (`python -m nkilib.examples.mlp_backward`) and the study
(`simulations/mlp_bwd_study.py`), so both print the same numbers for the same configuration.

Dimensions:
    S tokens, H hidden size, I intermediate size; inputs dY, X [S, H], W_gate_up [2I, H],
    W_down [H, I] and (when given) the checkpoints gate_pre / gate_act / up / intermediate [S, I].
"""
from __future__ import annotations

import nkilib  # noqa: F401  (selects the nki backend)
import nki

from ..experimental.mlp_mxfp8.mlp_bwd_mxfp8 import mlp_bwd_mxfp8_kernel as kernel_module
from ..simulator import ShapeSpec
from ..simulator.cost import model_kernel, rescore
from ..simulator.hardware import SCENARIOS
from ..simulator.trace import label_phases

#: phase function -> label in the cost report
PHASES = {
    "compute_phase1_down_proj_mm_grad_mxfp8": "phase0+1",
    "compute_phase2_hidden_states_grad_mxfp8": "phase2",
    "compute_phase3_gate_up_weight_grad_mxfp8": "phase3",
    "compute_phase4_down_weight_grad_mxfp8": "phase4",
}


def shape_inputs(S: int, H: int, I: int, recompute: bool) -> dict:
    """ShapeSpec inputs of one kernel call; `recompute=True` gives no checkpoints."""
    bf16 = nki.language.bfloat16
    inputs = {
        "output_grad": ShapeSpec((S, H), bf16), "hidden_states": ShapeSpec((S, H), bf16),
        "gate_up_weights": ShapeSpec((2 * I, H), bf16), "down_proj_weight": ShapeSpec((H, I), bf16),
    }
    if not recompute:
        for name in ("gate_pre", "gate_act", "up", "intermediate"):
            inputs[name] = ShapeSpec((S, I), bf16)
    return inputs


def model_mlp_backward(S: int, H: int, I: int, target: str, precision: str, lnc: int, recompute: bool,
                       scenarios=("central",)) -> dict:
    """{scenario: CostReport} of the kernel at one shape (one shape-only run, scheduled per scenario).

    Model FLOPs: 12·S·H·I, +4·S·H·I when every checkpoint is recomputed.
    """
    flops = (16 if recompute else 12) * S * H * I
    with label_phases(kernel_module, PHASES):
        report = model_kernel(kernel_module.mlp_backward_mxfp8_nki, shape_inputs(S, H, I, recompute), lnc=lnc,
                              target=target, kwargs={"matmul_precision": precision},
                              precision="mx" if precision == "mxfp8" else "bf16", model_flops=flops,
                              scenario=scenarios[0])
    out = {scenarios[0]: report}
    for sc in scenarios[1:]:
        out[sc] = rescore(report, sc)
    return out


def summarize(report) -> dict:
    """The study's numbers for one report; a report with plan errors gets no time (refused)."""
    j = report.to_json()
    crit = {}
    for ph in j["phases"].values():
        for eng, v in ph["critical_path_by_engine_s"].items():
            crit[eng] = crit.get(eng, 0.0) + v
    out = {"modeled_time_s": None, "mfu": None, "plan_errors": j["plan_errors"], "hbm_bytes": j["hbm_bytes"],
           "hbm_compulsory_bytes": j["hbm_compulsory_bytes"], "hbm_scratch_bytes": j["hbm_scratch_bytes"],
           "critical_path_by_engine_s": crit, "phases": j["phases"], "engines": j["engines"],
           "memory_peak": j["memory_peak_bytes_per_partition"],
           "scheduled_peak": j["scheduled_peak_bytes_per_partition"]}
    if j["plan_errors"]:
        out["invalid_modeled_time_s"], out["invalid_mfu"] = j["modeled_time_s"], j["mfu"]
    else:
        out["modeled_time_s"], out["mfu"] = j["modeled_time_s"], j["mfu"]
    return out


def band_line(S: int, H: int, I: int, target: str, precision: str, lnc: int, recompute: bool) -> str:
    """One line: modeled time and MFU at the central estimate and the pessimistic end, or the refusal."""
    reports = model_mlp_backward(S, H, I, target, precision, lnc, recompute, SCENARIOS)
    central, pessimistic = (summarize(reports[sc]) for sc in SCENARIOS)
    if central["modeled_time_s"] is None or pessimistic["modeled_time_s"] is None:
        errors = central["plan_errors"] or pessimistic["plan_errors"]
        return f"modeled ({target}, LNC{lnc}, {precision}): refused, the plan does not fit: {'; '.join(errors)}"
    return (f"modeled ({target}, LNC{lnc}, {precision}): {central['modeled_time_s'] * 1e3:.3f} ms central "
            f"({central['mfu'] * 100:.1f}% of {precision.upper()} peak), {pessimistic['modeled_time_s'] * 1e3:.3f} ms "
            f"pessimistic ({pessimistic['mfu'] * 100:.1f}%); HBM {central['hbm_bytes'] / 1e6:.0f} MB moved, "
            f"{central['hbm_compulsory_bytes'] / 1e6:.0f} MB minimum. A cost-model estimate, not a measurement "
            "(README, 'Performance').")
