"""Modeled time of the MoE expert backward kernel (shape-only simulator run with real routing + the cost model).

`moe_modeled_backward(preset, tokens, routing)` is the study's core (simulations/moe_bwd_study.py) and
the entry point for kernel work: it builds a routing, runs the NKI kernel in a shape-only simulator run
(data as ShapeSpecs, the int32 block layout as real values: docs/simulator.md, "Shape-only runs with
carried integer inputs"), schedules the trace with the cost model at the central estimate and the
pessimistic end, and compares with the dense kernel at the same useful FLOPs.

Dimensions:
    T tokens, k experts per token, E experts, H hidden, I intermediate, B block size;
    P = T*k routed (token, expert) pairs; U = used blocks (sum_e ceil(P_e / B)).
    Kernel inputs: dY, X [T, H]; topk_weights [T, k]; W_gate_up [E, 2I, H]; W_down [E, H, I];
    checkpoints gate_pre / gate_act / up / intermediate (all given, as the dense study): [T, k, I] by slot, or
    [N*B, I] block-ordered (checkpoint_layout="block": what the torch op saves for the kernel; the study's default);
    with weights_layout="block" also topk_weights_blocks [N*B] (p by block position; the study's default).

FLOPs (matmul, 2 per multiply-add): useful = 12·P·H·I (dI 2HI, dX 4HI, dW_gate_up 4HI, dW_down 2HI per
pair: the dense formula 12·S·H·I with S = P). The kernel computes every position of its U blocks, so
the padded matmul work is 12·U·B·H·I; padding overhead = U·B / P - 1. MFU counts useful FLOPs only.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass, field

import numpy as np

import nkilib  # noqa: F401  (selects the nki backend)
import nki

from ..experimental.mlp_mxfp8.mlp_bwd_mxfp8.config import ClampLimits
from ..experimental.moe_mxfp8 import moe_bwd_mxfp8_kernel as kernel_module
from ..experimental.moe_mxfp8.routing import build_block_layout
from ..simulator import ShapeSpec
from ..simulator.cost import model_kernel, rescore
from ..simulator.errors import CapacityError
from ..simulator.hardware import SCENARIOS
from ..simulator.trace import label_phases
from .mlp_backward_cost import model_mlp_backward, summarize
from .moe_routing_scenarios import DEFAULT_ZIPF_EXPONENT, expert_token_counts, make_topk_ids

__all__ = ["MOE_PRESETS", "MoePreset", "MoeModeledResult", "choose_block_size", "moe_modeled_backward",
           "padding_counts", "result_row", "useful_flops"]

#: phase function of the kernel -> label in the cost report (unlabelled: dX zeroing, expert weight
#: panel loads, loop control and the LNC2 barrier, reported as "kernel")
PHASES = {
    "compute_phase1_block_grads_mxfp8": "A dI+epilogue",
    "compute_phase1_pipelined_mxfp8": "A dI+epilogue",
    "compute_phase2_hidden_states_grad_mxfp8": "B dX",
    "compute_phase3_single_block_expert_mxfp8": "C dW",
    "compute_phase3_multi_block_grads_mxfp8": "C dW",
}
#: GPT-OSS's gated function: gate clamped above at 7, linear part to [-7, 7], gate * sigmoid(1.702 gate) * (up + 1).
GPT_OSS_CLAMP = ClampLimits(non_linear_upper=7.0, linear_lower=-7.0, linear_upper=7.0, activation="gpt_oss")


@dataclass(frozen=True)
class MoePreset:
    """One model's expert layer as the kernel sees it on one device.

    Attributes:
        hidden, intermediate: H, I of one expert.
        experts: E experts on this device (local experts under expert parallelism).
        top_k: k experts per token (global).
        clamped: GPT-OSS's clamped gated function (activation "gpt_oss").
        global_experts: experts of the whole layer (E·EP under expert parallelism; = experts without).
    """

    name: str
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    clamped: bool = False
    global_experts: int | None = None

    @property
    def expert_parallel(self) -> int:
        return (self.global_experts or self.experts) // self.experts

    def kernel_routing_shape(self, tokens: int) -> tuple:
        """(T_kernel, k_kernel) of the kernel call for `tokens` tokens per device.

        Without expert parallelism: (T, k). Under EP-n (DeepSeek-V3 per EP-8 rank): a rank's T tokens pick
        k of the E_global experts, so the rank's E_local experts receive T·k·E_local / E_global routed pairs
        in expectation (= T for EP-8, k = 8, 32 of 256 experts), whichever rank the tokens came from. The
        dispatched pairs are passed as T·k/EP rows with k_kernel = 1 (one row per received pair): the
        per-pair work, FLOPs and padding are the same as with a token's local experts grouped in one row;
        what differs is that a token with two local experts has its two dX rows summed after the combine
        instead of by the kernel's scatter-add (the kernel does it per row either way).
        """
        ep = self.expert_parallel
        if ep == 1:
            return tokens, self.top_k
        pairs = tokens * self.top_k * self.experts // (self.global_experts)
        return pairs, 1


MOE_PRESETS = {
    "qwen3-30b-a3b": MoePreset("qwen3-30b-a3b", 2048, 768, 128, 8),
    "gpt-oss-20b": MoePreset("gpt-oss-20b", 2880, 2880, 32, 4, clamped=True),
    "deepseek-v3-ep8": MoePreset("deepseek-v3-ep8", 7168, 2048, 32, 8, global_experts=256),
    # tiny shape for the --quick smoke run (not a model)
    "tiny": MoePreset("tiny", 256, 128, 8, 2),
}


def useful_flops(pairs: int, hidden: int, intermediate: int) -> int:
    """Matmul FLOPs of the backward for `pairs` routed pairs, checkpoints given: 12·P·H·I."""
    return 12 * pairs * hidden * intermediate


def padding_counts(counts, block_size: int) -> dict:
    """Routed pairs, used blocks and padded positions of per-expert pair counts in blocks of B.

    Returns {"pairs": P, "used_blocks": U, "positions": U·B, "padding_positions": U·B - P,
    "padding_overhead": U·B / P - 1}.
    """
    counts = np.asarray(counts, dtype=np.int64)
    pairs = int(counts.sum())
    used = int((-(-counts // block_size)).sum())
    positions = used * block_size
    return {"pairs": pairs, "used_blocks": used, "positions": positions, "padding_positions": positions - pairs,
            "padding_overhead": positions / pairs - 1.0 if pairs else 0.0}


def choose_block_size(pairs: int, experts: int) -> int:
    """B: the largest of 128 / 256 / 512 not above the balanced load P / E (128 at least).

    A block is one MX K tile of the weight-gradient matmuls, so a larger B means fewer, longer pass-C
    matmuls and fewer per-block overheads, while a B above the per-expert load only adds padding. Under
    LNC2 each core takes half of a block's rows in pass A, so B = 128 gives 64-row stationaries
    (the kernel's docstring recommends B >= 256 with LNC2 where the load allows).
    """
    load = pairs / experts
    return max([128] + [b for b in (256, 512) if b <= load])


@dataclass
class MoeModeledResult:
    """The study's numbers for one (preset, T, routing). Times in seconds; None where refused.

    `scenarios[sc]` holds summarize()'s fields of the cost report at that end of the band ("central",
    "pessimistic"): modeled_time_s / mfu (None when the plan violates on-chip capacity: see
    plan_errors, with the would-be numbers under invalid_*), hbm_bytes, critical_path_by_engine_s and
    per-phase numbers. `dense[sc]` is the dense kernel at S = P tokens (the same useful FLOPs).
    """

    preset: str
    tokens: int
    routing: str
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    kernel_tokens: int
    kernel_top_k: int
    block_size: int
    lnc: int
    seed: int
    zipf_exponent: float
    useful_flops: int
    executed_matmul_flops: float
    padding: dict
    expert_load: dict
    scenarios: dict = field(default_factory=dict)
    dense: dict = field(default_factory=dict)
    dense_tokens: int = 0
    dense_scaled_from_tokens: int | None = None
    refused_block_sizes: dict = field(default_factory=dict)
    checkpoint_layout: str = "slot"
    weights_layout: str = "slot"
    dense_refused_tokens: dict = field(default_factory=dict)

    def time(self, scenario="central"):
        return self.scenarios[scenario]["modeled_time_s"]

    def mfu(self, scenario="central"):
        return self.scenarios[scenario]["mfu"]

    @property
    def refused(self) -> bool:
        return any(s["plan_errors"] for s in self.scenarios.values())

    def limiting_engines(self, scenario="central", top=2) -> dict:
        """{phase: "engine share%, ..."}: the engines on the critical path of each phase."""
        out = {}
        for name, ph in self.scenarios[scenario]["phases"].items():
            crit = ph["critical_path_by_engine_s"]
            total = sum(crit.values())
            if total <= 0:
                continue
            out[name] = ", ".join(f"{e} {100 * v / total:.0f}%" for e, v in
                                  sorted(crit.items(), key=lambda kv: -kv[1])[:top])
        return out

    def to_json(self) -> dict:
        return asdict(self)


def _kernel_inputs(T: int, k: int, E: int, H: int, I: int, layout, checkpoint_layout: str = "slot",
                   weights_layout: str = "slot") -> dict:
    """ShapeSpecs for data, real int32 arrays for the block layout (the kernel loads them into registers);
    checkpoints [T, k, I] (checkpoint_layout "slot") or [N*B, I] ("block": saved by the forward in block order);
    with weights_layout "block" also topk_weights_blocks [N*B] float32 (the torch op's backward builds it)."""
    bf16 = nki.language.bfloat16
    inputs = {
        "output_grad": ShapeSpec((T, H), bf16), "hidden_states": ShapeSpec((T, H), bf16),
        "topk_weights": ShapeSpec((T, k), np.float32),
        "gate_up_weight": ShapeSpec((E, 2 * I, H), bf16), "down_weight": ShapeSpec((E, H, I), bf16),
        "token_position_to_id": layout.token_position_to_id, "token_position_to_slot": layout.token_position_to_slot,
        "expert_block_offsets": layout.expert_block_offsets,
    }
    if weights_layout == "block":
        inputs["topk_weights_blocks"] = ShapeSpec((len(layout.token_position_to_slot),), np.float32)
    for name in ("gate_pre", "gate_act", "up", "intermediate"):
        inputs[name] = ShapeSpec((T, k, I) if checkpoint_layout == "slot" else
                                 (len(layout.token_position_to_slot), I), bf16)
    return inputs


def _summaries(report, scenarios) -> dict:
    out = {scenarios[0]: summarize(report)}
    for sc in scenarios[1:]:
        out[sc] = summarize(rescore(report, sc))
    return out


def moe_modeled_backward(preset, tokens: int, routing: str = "balanced", *, block_size: int | None = None,
                         lnc: int = 2, scenarios=SCENARIOS, seed: int = 0,
                         zipf_exponent: float = DEFAULT_ZIPF_EXPONENT, dense: bool = True,
                         dense_max_tokens: int | None = None, target="trn3",
                         checkpoint_layout: str = "slot", weights_layout: str = "slot") -> MoeModeledResult:
    """Modeled MXFP8 MoE expert backward (trn3) of one preset, token count and routing.

    Args:
        preset: a MOE_PRESETS name or a MoePreset.
        tokens: T tokens on the device (per EP rank for an expert-parallel preset).
        routing: "balanced" (exactly balanced) or "zipf" (Zipf-skewed, seeded).
        block_size: B; None = choose_block_size(P, E).
        lnc: 1 or 2.
        scenarios: ends of the band, the first is modeled, the others rescored from its trace.
        seed, zipf_exponent: of the Zipf routing.
        dense: also model the dense kernel at S = P tokens (the same useful FLOPs).
        dense_max_tokens: model the dense kernel at most at this S and scale its time linearly to P
            (recorded in dense_scaled_from_tokens); None = always at S = P.
        target: "trn3" or a TargetSpec (tests shrink SBUF to exercise the capacity refusal).
        checkpoint_layout: the kernel's checkpoint_layout: "slot" ([T, k, I], gathered by slot) or "block"
            ([N*B, I] in block-position order, read by plain DMA: a forward that saves them so; docs/moe.md round 11b).
        weights_layout: the kernel's weights_layout: "slot" (p gathered, d_topk_weights scattered by slot) or "block"
            (both by block position, plain DMA: what the torch op's kernel backends pass; docs/moe.md round 30b).

    Returns:
        MoeModeledResult. A configuration whose plan or modeled overlap needs more SBUF/PSUM than the
        target has gets modeled_time_s = None (refused) and its plan_errors.
    """
    p = MOE_PRESETS[preset] if isinstance(preset, str) else preset
    T, k = p.kernel_routing_shape(tokens)
    E, H, I = p.experts, p.hidden, p.intermediate
    topk_ids = make_topk_ids(routing, T, k, E, seed=seed, zipf_exponent=zipf_exponent)
    counts = expert_token_counts(topk_ids, E)
    flops = useful_flops(T * k, H, I)
    # B: the given one, else the chosen one and, while the kernel's allocations overflow SBUF in the run
    # (a CapacityError: the plan does not fit), the next smaller multiple of 128 (refusals recorded)
    sizes = [block_size] if block_size else [b for b in (512, 256, 128) if b <= choose_block_size(T * k, E)]
    refused_block_sizes = {}
    for B in sizes:
        layout = build_block_layout(topk_ids, E, B)
        kwargs = {"block_size": B, "clamp_limits": GPT_OSS_CLAMP if p.clamped else None,
                  "matmul_precision": "mxfp8", "run_with_lnc2": lnc == 2, "checkpoint_layout": checkpoint_layout,
                  "weights_layout": weights_layout}
        try:
            with label_phases(kernel_module, PHASES):
                inputs = _kernel_inputs(T, k, E, H, I, layout, checkpoint_layout, weights_layout)
                report = model_kernel(kernel_module.moe_backward_mxfp8_nki, inputs, lnc=lnc, target=target,
                                      kwargs=kwargs, precision="mx", model_flops=flops, scenario=scenarios[0],
                                      check_races=False)
        except CapacityError as e:
            refused_block_sizes[B] = f"the kernel's allocations overflow on-chip memory in the run: {str(e)[:240]}..."
            report = None
            continue
        break
    if report is not None and refused_block_sizes:
        # a smaller B than asked for or chosen changes the padding and the time: say so where it happens, not only
        # in refused_block_sizes (a harness reading modeled_time_s alone would compare two block sizes unawares)
        warnings.warn(f"moe_modeled_backward({p.name!r}, tokens={tokens}, routing={routing!r}): block_size "
                      f"{', '.join(map(str, refused_block_sizes))} refused (the kernel's allocations overflow on-chip "
                      f"memory in the run); modeled at block_size {B}", stacklevel=2)
    pad = padding_counts(counts, B)
    if report is None:
        executed = float("nan")
        summaries = {sc: {"modeled_time_s": None, "mfu": None, "plan_errors": [refused_block_sizes[B]],
                          "hbm_bytes": 0, "hbm_compulsory_bytes": 0, "hbm_scratch_bytes": 0,
                          "critical_path_by_engine_s": {}, "phases": {}} for sc in scenarios}
    else:
        executed = float(sum(c.flops for c in report.schedule.costs))
        summaries = _summaries(report, scenarios)
        del report
    mean = counts.mean()
    result = MoeModeledResult(
        preset=p.name, tokens=tokens, routing=routing, hidden=H, intermediate=I, experts=E, top_k=p.top_k,
        kernel_tokens=T, kernel_top_k=k, block_size=B, lnc=lnc, seed=seed, zipf_exponent=zipf_exponent,
        useful_flops=flops, executed_matmul_flops=executed, padding=pad,
        expert_load={"max": int(counts.max()), "mean": float(mean), "min": int(counts.min()),
                     "max_over_mean": float(counts.max() / mean), "empty_experts": int((counts == 0).sum())},
        scenarios=summaries, refused_block_sizes=refused_block_sizes, checkpoint_layout=checkpoint_layout,
        weights_layout=weights_layout)
    if dense:
        result.dense_tokens = P = T * k
        S = P if dense_max_tokens is None else min(P, max(128, dense_max_tokens // 128 * 128))
        while True:  # a dense run that overflows SBUF (CapacityError) is retried at half the tokens, scaled
            try:
                reports = model_mlp_backward(S, H, I, "trn3", "mxfp8", lnc, False, tuple(scenarios))
                break
            except CapacityError as e:
                result.dense_refused_tokens[S] = str(e)[:240]
                if S <= 1024:
                    raise
                S = S // 2 // 128 * 128
        if S != P:
            result.dense_scaled_from_tokens = S
        scale = P / S
        for sc, rep in reports.items():
            d = summarize(rep)
            for key in ("modeled_time_s", "invalid_modeled_time_s"):
                if d.get(key) is not None:
                    d[key] *= scale  # linear in S (only when dense_max_tokens applies; scale = 1 otherwise)
            result.dense[sc] = {"modeled_time_s": d["modeled_time_s"], "mfu": d["mfu"], "plan_errors": d["plan_errors"],
                                "hbm_bytes": d["hbm_bytes"] * scale,
                                "invalid_modeled_time_s": d.get("invalid_modeled_time_s")}
    return result


def result_row(r: MoeModeledResult, scenarios=SCENARIOS) -> dict:
    """One flat row (CSV / table) of a result."""
    row = {"preset": r.preset, "tokens": r.tokens, "routing": r.routing, "block_size": r.block_size,
           "kernel_tokens": r.kernel_tokens, "kernel_top_k": r.kernel_top_k, "pairs": r.padding["pairs"],
           "used_blocks": r.padding["used_blocks"], "padding_overhead": r.padding["padding_overhead"],
           "max_over_mean_load": r.expert_load["max_over_mean"], "useful_gflop": r.useful_flops / 1e9,
           "executed_gflop": r.executed_matmul_flops / 1e9}
    for sc in scenarios:
        s = r.scenarios[sc]
        row[f"{sc}_time_ms"] = None if s["modeled_time_s"] is None else s["modeled_time_s"] * 1e3
        row[f"{sc}_mfu"] = s["mfu"]
        row[f"{sc}_would_be_time_ms"] = (s.get("invalid_modeled_time_s") or 0) * 1e3 or None
        if r.dense:
            d = r.dense[sc]
            row[f"dense_{sc}_time_ms"] = None if d["modeled_time_s"] is None else d["modeled_time_s"] * 1e3
            row[f"dense_{sc}_mfu"] = d["mfu"]
    c = r.scenarios[scenarios[0]]
    row["hbm_mb"] = c["hbm_bytes"] / 1e6
    row["hbm_min_mb"] = c["hbm_compulsory_bytes"] / 1e6
    row["plan_errors"] = "; ".join(c["plan_errors"])
    row["limiting"] = " | ".join(f"{ph}: {v}" for ph, v in r.limiting_engines(scenarios[0]).items())
    row["dense_scaled_from_tokens"] = r.dense_scaled_from_tokens
    return row


def fmt_ms(t) -> str:
    return "refused" if t is None else f"{t * 1e3:.3f}"


def fmt_pct(v) -> str:
    return "" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v * 100:.1f}%"
