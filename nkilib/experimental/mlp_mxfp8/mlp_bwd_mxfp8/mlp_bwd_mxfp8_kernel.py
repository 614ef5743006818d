"""MXFP8 SwiGLU MLP backward: four phases, base kernel, checkpoint-aware entry point (LNC1/LNC2).

Math (reference.py writes it out): Phase 1 dI = dY·W_down (K=H) and the SwiGLU derivative; Phase 2 dX = d_gu·W_gu
(K=2I); Phase 3 dW_gu = d_guᵀ·X (K=S); Phase 4 dW_down = dYᵀ·intermediate (K=S); Phase 0 (fused into
phase 1, per output tile) recomputes gate_pre/up (K=H) and gate_act/intermediate when not given.
Every matmul operand is quantized on-chip along that matmul's K (nkilib/core/matmul); the exact numerics
are written down in reference.py (`mx_exact`), which the kernel matches to fp32 reassociation.

LNC2 sharding: every phase splits the larger dimension of its output [M, N] in halves (multiples of
128; the other one when the larger has fewer than 128 per core), which minimises the operand bytes a
core reads (split M: a/2 + b; split N: a + b/2). Phase 1 splits S when it can (its dY is
transposed on the PE array: each core transposes only its own rows, and they can stay resident), unless
W_down's panels fit no panel cache and split along I each core keeps all of dY resident
(phase1_split_along_i: TP1, I = 12288, reads half of W_down instead of all of it). For model shapes
(S >= I, S >= H):
- phase 0+1: the S tiles of [S, I] (each core transposes only its own dY rows; W_down is read by both), or
  (phase1_split_along_i) the I columns (each core all of dY, half of W_down);
- phase 2: the same S rows as phase 1 (its stationary d_gate_up rows never leave the chip, see below);
- phase 3: the larger of 2I and H of dW_gu [2I, H] (H for TP8 shapes: X is read once in total);
- phase 4: the larger of H and I of dW_down [H, I].
Order and the one core_barrier (a fence: it waits for every earlier instruction of the core): phase 1 (after its
split along I, + the DMAs of phase 2's first row tiles of the d_gate_up columns this core wrote,
MatmulPlan.prefetch_own) -> core_barrier -> phase 2 -> phases 3 and 4; when phase 2's stationary rows are phase 1's
resident panels (TP8), phase 2 reads only its own core's rows and the barrier goes inside it instead, before tile
FENCE_TILE's epilogue (MatmulPlan.set_fence; where phase 1 spreads its along-S quantize, before the epilogue of the
last tile of phase 2's first W_gu panel: MatmulPlan.fence_after_first_panel), after phase 1's last K tile along S
(deferred behind phase 2's first W_gu quantizes); derived by a PhaseGraph (nkilib/core/phase_graph.py) from what each
phase reads and writes; each phase's first panels load while the previous one runs its last tiles when both fit SBUF,
and of phases 3 and 4 the one with the larger first load goes under phase 2's tail (TP8: 3 then 4), or, after a
K-streamed phase 2 that takes no early loads, the smaller starts cold (TP1: 4 then 3).
Finite SBUF/PSUM: each plan allocates its PSUM accumulators and eviction tiles once and rotates them; a
[K, F] panel load stages through a ring of STAGING_BUFFERS tiles that an operand's successive loads share
(core/matmul/panels.py LoadRing: a load waits for the previous one's quantizes instead of taking DMA
bandwidth from the loads the next matmuls wait for); K-contiguous operands' row tiles likewise.

On-chip reuse (phase 1's epilogue, mlp_bwd_mxfp8_epilogue.py): with W_down resident, phase 1 runs S-tile-major and
gathers each finished [128, 2I] d_gate_up row block in SBUF. One S tile later (TensorE runs in program order) it is
transposed and quantized along 2I into phase 2's stationary panel. When every core's rows are whole 512-row K tiles
(mx_along_s_applies), each block is also DMAed SBUF -> SBUF into phase 3's interleaved staging layout and, per K
tile, quantized along S (spread over the next S tile's epilogues, or the next two S tiles':
SwigluBackwardEpilogue.spreads_along_s) and stored as MX words + scales chunk by chunk (panels.store_k_tile); phase 3
reads both cores' halves as they are, and no bf16 d_gate_up goes to HBM. Groups are the scheme's groups along S, as
before: numerics unchanged. Otherwise the rows are stored in bf16 (2I-long runs) for phase 3 (and phase 2 when not
resident).

Operands that do not fit (core/matmul/plan.py MatmulPlan, its tiling in tiling.py; e.g. TP1, I = 12288): moving panels all resident
(m-major) > stationary panels all resident (n-major) > the smaller whole operand resident (up to 144 KiB; TP1:
phase 3 keeps X, phase 4 keeps dY, each read once per core) > K-streamed groups (TP1 phase 2; each group's
stationary panels in one SBUF block, MatmulPlan contiguous_group) > stationary groups. Phase 1 keeps its dY (and X)
panels resident when W_down's are not. Phases 3 and 4 (K = S) at long sequences, where neither whole operand fits
(S = 32768, H = 2048, I = 768), run as chunks along S instead (core/matmul/k_chunks.py plan_matmul): each chunk
keeps its smaller operand resident, the fp32 sums pass from chunk to chunk through HBM, every operand is read once.

Engines: PSUM evictions of phases 2-4 run on ScalarE, leaving VectorE to quantize_mx and the phase-1
epilogue. Modeled time, MFU band and HBM bytes: README "Current kernel status" (simulations/mlp_bwd_study.py).

HBM traffic per core (LNC2, given checkpoints): phase 1 reads dY[S/2, H], W_down, its checkpoint rows and writes
its d_gate_up rows (split along I: dY, W_down[:, I/2], the checkpoints' and d_gate_up's I/2 columns); phase 2
reads W_gu and writes dX[S/2, H]; phase 3 reads all of d_gate_up and its half of X; phase 4 its half of dY along
S and the intermediate. K-contiguous operands are read as stored and transposed on the PE array, also when
output_grad_T / hidden_states_T are given (read as stored, their quantize_mx runs on a strided source at half
rate on VectorE, the scarcer engine: modeled TP8 0.80 vs 0.72 ms).
"""
from __future__ import annotations

import nki
import nki.isa as nisa
import nki.language as nl

from ....core.kernel_helpers import kernel_assert
from ....core.matmul import CoreSplit, MatmulPlan, StoreEpilogue, panel_layout_hbm, plan_matmul
from ....core.phase_graph import Phase, PhaseGraph
from .api import matmul_config_from_tiles, phase_transposes, resolve_operands
from .config import (ClampLimits, MatmulConfig, TensorDescriptor, fit_weight_grad_n_tile, resolve_kernel_options,
                     resolve_matmul_config)
from .constants import MX_K_TILE, PARTITIONS, SPLIT_ALIGN
from .mlp_bwd_mxfp8_epilogue import SwigluBackwardEpilogue

__all__ = [
    "get_program_sharding_info", "compute_phase1_down_proj_mm_grad_mxfp8", "compute_phase2_hidden_states_grad_mxfp8",
    "compute_phase3_gate_up_weight_grad_mxfp8", "compute_phase4_down_weight_grad_mxfp8",
    "mlp_backward_mxfp8_base_nki", "mlp_backward_mxfp8_nki", "ClampLimits", "TensorDescriptor",
]


def get_program_sharding_info(run_with_lnc2):
    """(num_cores, shard_id) of this program: (2, program_id) under an LNC2 launch, else (1, 0)."""
    launched = nl.num_programs(0) if nl.program_ndim() > 0 else 1
    if not run_with_lnc2:
        kernel_assert(launched == 1, f"run_with_lnc2=False requires a kernel[1] launch, got {launched} programs")
        return 1, 0
    if launched == 1:
        return 1, 0
    return launched, nl.program_id(0)


def _split(split, run_with_lnc2) -> CoreSplit:
    """The launch's CoreSplit: the one the base kernel computed, or this program's own (standalone calls)."""
    if split != None:  # noqa: E711  (NKI traced code: no `is not`)
        return split
    return CoreSplit(*get_program_sharding_info(run_with_lnc2))


# ---------------------------------------------------------------------------------------------------
# Phase 0+1: dI = dY·W_down (and gate_pre / up when recomputed), the SwiGLU derivative as epilogue
# ---------------------------------------------------------------------------------------------------
def compute_phase1_down_proj_mm_grad_mxfp8(output_grad_td, gate_pre_td, gate_act_td, up_td, d_gate_up_td, scratch_td,
                                           down_weight_td, s_base, dtype, fp8_x4_dtype, config=None,
                                           spill_reload=True, use_scale_packing=True, run_with_lnc2=True,
                                           clamp_limits=None, hidden_states_td=None, gate_weight_td=None,
                                           up_weight_td=None, setup=None, keep_for_phase2=False, split=None,
                                           ranges=None, plan=None, stage="all", keep_whole=False):
    """Phase 1 (with the phase-0 recompute fused per tile): d_gate, d_up [S, I] and the intermediate.

    One MatmulPlan over this core's [S, I] tiles with up to three products sharing each output tile:
    dI = dY @ W_down (K=H), and when not given gate_pre = X @ W_gateᵀ, up = X @ W_upᵀ (K=H); its
    epilogue (SwigluBackwardEpilogue) is the SwiGLU derivative. Tiles run S-tile-major when the moving
    panels (W_down, W_gate, W_up) are resident, else n-major with the dY (and X) panels of this core's rows
    resident when they fit, so each is transposed and quantized once rather than once per I block.

    Dimensions:
        output_grad_td: dY [S, H] (K=H, k_axis=1); down_weight_td: W_down [H, I] (k_axis=0) or the
        pre-quantized W_downᵀ [I, H]; gate_pre/gate_act/up: [S, I] bf16 HBM tensors or None (recomputed);
        d_gate_up_td: [S, 2I] bf16 output (d_gate | d_up); scratch_td: [S, I] bf16 intermediate output,
        or None when the intermediate is not needed / given.
        Recompute operands (only when gate_pre/up are None): hidden_states_td X [S, H] (k_axis=1),
        gate_weight_td / up_weight_td: W_gate / W_up (K=H, F=I): [I, H] windows of gate_up_weights (k_axis=1,
        bf16 or pre-quantized) or gate_proj_weight_T / up_proj_weight_T [H, I] (k_axis=0; api.py's table).

    Args:
        s_base: first token row (the kernel processes all S rows from s_base; 0 for a full call).
        dtype: dtype of d_gate_up (bf16). fp8_x4_dtype: MX element dtype. spill_reload: accepted for API
            compatibility; a no-op (panels stay in SBUF, nothing is spilled). Epilogue math is fp32.
        keep_for_phase2: also keep this core's d_gate_up rows on chip as phase 2's stationary
            panels (quantized along 2I) when every I column is on this core, the moving panels are
            resident and the panels fit PHASE2_STATIONARY_BUDGET_BYTES.
        split: the kernel's CoreSplit (default: from run_with_lnc2); ranges: this core's ((s_lo, s_hi),
            (i_lo, i_hi)) (default: split.ranges(S, I, prefer_m=True): S split whenever it can be, so each
            core transposes only its own dY rows).
        plan / stage: "plan" returns the MatmulPlan without running it; "all" (default) runs the rest.
        keep_whole: when neither dY's panels nor W_down's fit the panel cache, keep the smaller whole operand
            resident (MatmulPlan keep_whole; the split along I, phase1_split_along_i).

    Returns:
        stage "all": ResidentPanels for compute_phase2_hidden_states_grad_mxfp8 (rows [lo, hi) of this
        core), or None; stage "plan": the plan.
    """
    if plan == None:  # noqa: E711
        config = config or MatmulConfig()
        split = _split(split, run_with_lnc2)
        S = output_grad_td.tensor.shape[0] - s_base
        I = down_weight_td.f_extent
        if ranges == None:  # noqa: E711
            ranges = split.ranges(S, I, prefer_m=True)
        need_gate_pre, need_up = gate_pre_td == None, up_td == None  # noqa: E711
        stationary = [output_grad_td.window(s_base, S) if s_base else output_grad_td]
        moving = [down_weight_td]
        products = [(0, 0)]  # dI
        if need_gate_pre or need_up:
            stationary.append(hidden_states_td.window(s_base, S) if s_base else hidden_states_td)
        if need_gate_pre:
            moving.append(gate_weight_td)
            products.append((1, len(moving) - 1))  # gate_pre
        if need_up:
            moving.append(up_weight_td)
            products.append((1, len(moving) - 1))  # up
        epilogue = SwigluBackwardEpilogue(gate_pre_td, gate_act_td, up_td, d_gate_up_td, scratch_td,
                                          clamp_limits or ClampLimits(), s_base, I, dtype, setup, keep_for_phase2)
        plan = MatmulPlan(stationary, moving, S, I, setup, config, split, epilogue, products=products,
                          ranges=ranges, groups=False, keep_whole=keep_whole, interleave_switch=keep_whole,
                          cold_staging=True)
    if stage == "plan":
        return plan
    plan.step(stage)
    return plan.epilogue.resident if stage == "all" else plan


# ---------------------------------------------------------------------------------------------------
# Phases 2-4: plain matmul plans stored to HBM
# ---------------------------------------------------------------------------------------------------
def compute_phase2_hidden_states_grad_mxfp8(hidden_states_grad_td, gate_up_weight_td, d_gate_up_td, s_base, dtype,
                                            fp8_x4_dtype, config=None, run_with_lnc2=True, setup=None,
                                            resident=None, rows=None, plan=None, stage="all", split=None,
                                            own_k_ranges=()):
    """Phase 2: dX [S, H] = d_gate_up [S, 2I] @ gate_up_weights [2I, H] (K=2I).

    Dimensions:
        d_gate_up_td: [S, 2I] (k_axis=1); gate_up_weight_td: W_gu [2I, H] (k_axis=0) or pre-quantized
        W_guᵀ [H, 2I]; hidden_states_grad_td: [S, H] output in `dtype`.
        resident: phase 1's ResidentPanels (d_gate_up rows already quantized on chip) or None (read
        d_gate_up from HBM; needs a core_barrier after phase 1 under LNC2). With them the plan is a fenced start
        (MatmulPlan fenced_start: its first tiles multiply the first W_gu panel K tile by K tile as VectorE quantizes
        it, through a ring of FENCED_STAGING_BUFFERS); the kernel's core barrier then goes inside this plan's run
        (MatmulPlan.set_fence), not before it.
        rows: (lo, hi) S rows of this core (phase 1's row split, so that cores with and without resident
        panels compute disjoint rows), or None (split.ranges).
        plan / stage: "plan" returns the MatmulPlan; "head" / "first" / "all" run that step of it (see
        MatmulPlan.step) and return it. split: the kernel's CoreSplit (default: from run_with_lnc2).
        own_k_ranges: the d_gate_up columns [(k_lo, k_hi)] this core wrote in phase 1 (split along I), whose first
            rows MatmulPlan.prefetch_own loads before the core barrier.
    """
    if plan == None:  # noqa: E711
        config = config or MatmulConfig()
        S = d_gate_up_td.tensor.shape[0] - s_base
        H = hidden_states_grad_td.shape[1]
        a_op = d_gate_up_td.window(s_base, S) if s_base else d_gate_up_td
        out = hidden_states_grad_td if not s_base else hidden_states_grad_td[s_base:, :]
        ranges = (rows, (0, H)) if rows != None else None  # noqa: E711
        plan = MatmulPlan([a_op], [gate_up_weight_td], S, H, setup, config, _split(split, run_with_lnc2),
                          StoreEpilogue(out, dtype), ranges=ranges, resident=resident, contiguous_group=True,
                          own_k_ranges=own_k_ranges, fenced_start=resident != None)  # noqa: E711
    return plan if stage == "plan" else plan.step(stage)


def compute_phase3_gate_up_weight_grad_mxfp8(weight_grad_td, hidden_states_T_td, grad_T_td, dtype, fp8_x4_dtype,
                                             config=None, run_with_lnc2=True, setup=None, plan=None, stage="all",
                                             split=None):
    """Phase 3: dW_gu [2I, H] = d_gate_upᵀ [2I, S] @ X [S, H] (K=S).

    Dimensions:
        grad_T_td: d_gate_up [S, 2I] read as the K=S operand (k_axis=0), or its MX words along S in the
        panel layout (phase 1's exchange_along_s); hidden_states_T_td: X [S, H]
        (k_axis=0) or pre-quantized Xᵀ [H, S]; weight_grad_td: [2I, H] output in `dtype`.
        plan / stage / split: as in compute_phase2_hidden_states_grad_mxfp8.
    """
    if plan == None:  # noqa: E711
        config = config or MatmulConfig()
        two_i, H = weight_grad_td.shape
        plan = plan_matmul([grad_T_td], [hidden_states_T_td], two_i, H, setup, config, _split(split, run_with_lnc2),
                           StoreEpilogue(weight_grad_td, dtype), k_chunks=True, lead_n_major=True,
                           interleave_lead=True)
    return plan if stage == "plan" else plan.step(stage)


def compute_phase4_down_weight_grad_mxfp8(down_weight_grad_td, output_grad_T_td, intermediate_T_td, h_base, dtype,
                                          fp8_x4_dtype, config=None, run_with_lnc2=True, setup=None, plan=None,
                                          stage="all", split=None):
    """Phase 4: dW_down [H, I] = dYᵀ [H, S] @ intermediate [S, I] (K=S).

    Dimensions:
        output_grad_T_td: dY [S, H] (k_axis=0) or pre-quantized dYᵀ [H, S]; intermediate_T_td: [S, I]
        (k_axis=0); down_weight_grad_td: [H, I] output in `dtype`. h_base: first H row (0 for a full call).
        plan / stage / split: as in compute_phase2_hidden_states_grad_mxfp8.
    """
    if plan == None:  # noqa: E711
        config = config or MatmulConfig()
        H, I = down_weight_grad_td.shape
        a_op = output_grad_T_td.window(h_base, H - h_base) if h_base else output_grad_T_td
        out = down_weight_grad_td if not h_base else down_weight_grad_td[h_base:, :]
        plan = plan_matmul([a_op], [intermediate_T_td], H - h_base, I, setup, config, _split(split, run_with_lnc2),
                           StoreEpilogue(out, dtype), k_chunks=True, lead_n_major=True,
                           interleave_first_loads=True, stationary_lookahead=True,
                           interleave_switch=setup.is_mx)
    return plan if stage == "plan" else plan.step(stage)


def phase1_split_along_i(plan_s, plan_i) -> bool:
    """Whether phase 1 (LNC2) splits I instead of S: W_down's panels fit neither split's panel cache, and split
    along I each core keeps all of dY resident (MatmulPlan keep_whole) while streaming its half of W_down once.
    Split along S each core reads and quantizes all of W_down (TP1, I = 12288: 101 MB per core) for half of
    dY; along I, half of W_down for all of dY (34 MB) and twice the dY transposes (TP1 modeled 4.684 -> 4.635 ms
    central, 4.953 -> 4.823 pessimistic; HBM 2517 -> 2449 MB). Phase 2 then reads its S rows of d_gate_up
    from HBM (never resident when W_down is not)."""
    return (not plan_s.keep_moving and not plan_i.keep_moving and len(plan_i.stationary) == 1 and
            plan_i.stationary[0].keep_all)


def mx_along_s_applies(plan1, S, I, split, setup) -> bool:
    """Whether phase 1 can quantize d_gate_up along S on chip for phase 3 (SwigluBackwardEpilogue.
    exchange_along_s): MXFP8, phase 1 runs S-tile-major in 128-row tiles, and every core's rows are whole
    512-row K tiles of phase 3 with all I columns (checked for all cores: phase 3 reads every core's part)."""
    return (setup.is_mx and plan1.keep_moving and plan1.m_tile == PARTITIONS and
            split.whole_row_blocks(S, I, MX_K_TILE))


# ---------------------------------------------------------------------------------------------------
# The backward as a phase graph
# ---------------------------------------------------------------------------------------------------
def mlp_backward_mxfp8_base_nki(hidden_states_grad, gate_up_weight_grad, down_proj_weight_grad, output_grad_td,
                                hidden_states_td, hidden_states_T_td, output_grad_T_td, down_weight_td,
                                gate_up_weight_td, gate_weight_td, up_weight_td, gate_pre, gate_act, up, intermediate,
                                setup, config, run_with_lnc2, clamp_limits, weight_grad_dtype):
    """All phases for validated descriptors, declared as a PhaseGraph, with their HBM scratch (d_gate_up as
    bf16 rows or as MX words along S, whichever phase 1 plans; the intermediate when recomputed).

    The graph derives the order phase 1 -> (core_barrier) -> phase 2 -> phases 3 and 4: phases 2-4
    depend only on phase 1 (phase 2 first by declaration; 3 and 4 in the order PhaseGraph chooses from their
    first loads); d_gate_up and the recomputed
    intermediate are written by both cores, so the one sync point sits before the first phase that reads another
    core's part: phase 2, or, when its stationary d_gate_up rows are phase 1's resident panels (it then reads only
    its own core's rows: Phase local_reads), phase 3 or 4, and the barrier is issued inside phase 2 (PhaseGraph
    barrier_under_tail, MatmulPlan.set_fence) after phase 1's deferred last K tile along S. Phase 1 is planned
    first: whether its epilogue can quantize d_gate_up along S for phase 3 (mx_along_s_applies) decides
    phase 3's operand.
    """
    S, two_i = output_grad_td.tensor.shape[0], gate_up_weight_grad.shape[0]
    I = two_i // 2
    split = CoreSplit(*get_program_sharding_info(run_with_lnc2))  # the one core split of this launch
    d_gate_up = nl.ndarray((S, two_i), dtype=nl.bfloat16, buffer=nl.shared_hbm, name="mlp_bwd_d_gate_up")
    scratch = None
    if intermediate == None:  # noqa: E711
        scratch = nl.ndarray((S, I), dtype=nl.bfloat16, buffer=nl.shared_hbm, name="mlp_bwd_intermediate")
    d_gu_k_cols = TensorDescriptor(d_gate_up, k_axis=1)
    d_gu_k_rows = TensorDescriptor(d_gate_up, k_axis=0)
    inter_td = TensorDescriptor(intermediate if intermediate != None else scratch, k_axis=0)  # noqa: E711
    # phase 1 splits S when it can (or I: phase1_split_along_i); phase 2 then takes the same S rows (every core
    # alike, resident panels or not), or its own S split after an I split
    rows1, cols1 = split.ranges(S, I, prefer_m=True)
    phase2_args = (hidden_states_grad, gate_up_weight_td, d_gu_k_cols, 0, nl.bfloat16, setup.x4_dtype)
    phase3_args = (gate_up_weight_grad, hidden_states_T_td, d_gu_k_rows, weight_grad_dtype, setup.x4_dtype)
    phase4_args = (down_proj_weight_grad, output_grad_T_td, inter_td, 0, weight_grad_dtype, setup.x4_dtype)
    common = dict(run_with_lnc2=run_with_lnc2, setup=setup, split=split)

    def phase1(plan, stage, ranges=None, keep_whole=False):
        return compute_phase1_down_proj_mm_grad_mxfp8(
            output_grad_td, gate_pre, gate_act, up, d_gate_up, scratch, down_weight_td, 0, nl.bfloat16,
            setup.x4_dtype, config=config.phase1, use_scale_packing=setup.use_scale_packing,
            clamp_limits=clamp_limits, hidden_states_td=hidden_states_td, gate_weight_td=gate_weight_td,
            up_weight_td=up_weight_td, keep_for_phase2=True, ranges=ranges, plan=plan, stage=stage,
            keep_whole=keep_whole, **common)

    def phase2(plan, stage):
        return compute_phase2_hidden_states_grad_mxfp8(*phase2_args, config=config.phase2, plan=plan, stage=stage,
                                                       **common)

    def phase3(plan, stage):
        return compute_phase3_gate_up_weight_grad_mxfp8(*phase3_args, config=config.phase3, plan=plan, stage=stage,
                                                        **common)

    def phase4(plan, stage):
        return compute_phase4_down_weight_grad_mxfp8(*phase4_args, config=config.phase4, plan=plan, stage=stage,
                                                     **common)

    # planned first: whether phase 3 can take d_gate_up quantized on chip
    plan1 = phase1(None, "plan", (rows1, cols1))
    if split.num_cores > 1 and not plan1.keep_moving and I >= SPLIT_ALIGN * split.num_cores:
        # W_down does not fit: split along I instead when each core then keeps all of dY (phase1_split_along_i)
        _, cols_i = split.ranges(1, I)  # one row cannot be split, I has SPLIT_ALIGN columns per core: the I split
        plan_i = phase1(None, "plan", ((0, S), cols_i), keep_whole=True)
        if phase1_split_along_i(plan1, plan_i):
            plan1, rows1, cols1 = plan_i, (0, S), cols_i
            # phases 3-4 then fit PSUM at their wide n_tile only from two K tiles (S): narrowed below that
            config = fit_weight_grad_n_tile(config, True, S)
    rows2 = rows1 if split.num_cores > 1 and cols1 == (0, I) else None
    # split along I, this core wrote d_gate's and d_up's columns cols1 of every row: phase 2 may load those before
    # the barrier (MatmulPlan.prefetch_own)
    own2 = (cols1, (I + cols1[0], I + cols1[1])) if split.num_cores > 1 and cols1 != (0, I) else ()
    built = []

    def build_phase1(outputs):
        return plan1

    def build_phase2(outputs):
        plan2 = compute_phase2_hidden_states_grad_mxfp8(*phase2_args, config=config.phase2,
                                                        resident=outputs["phase1"], rows=rows2, stage="plan",
                                                        own_k_ranges=own2, **common)
        if plan1.epilogue.spreads_along_s(plan1):
            # phase 1 ends earlier: the fence then goes after phase 2's second W_gu panel is issued, so phase 3's
            # first loads (issued after it) do not share the DMA queues with that panel. Only in an n-major order:
            # a grouped one (long S, m_group) comes back to the first panel, and keeps set_fence's FENCE_TILE
            if plan2.first_panel_once():
                plan2.fence_after_first_panel()
                # phase 1's last K tile along S (quantized and stored for phase 3, which the fence protects) goes
                # ahead of the second panel's quantizes on VectorE: the fence then waits for TensorE, not its store
                plan2.set_fence_work(plan1.epilogue.flush_along_s)
            # and its first span in column pieces (TP8 0.62068 / 0.70053 -> 0.62024 / 0.70017 ms with phase 1's
            # last two S tiles gate-first; Llama3-8B TP8, no spread: 0.73232 / 0.82569 -> 0.73158 / 0.82604, left out)
            plan2.piece_first_span()
        built.append(plan2)
        return plan2

    sync_data = d_gate_up
    if mx_along_s_applies(plan1, S, I, split, setup):
        # each core quantizes its own d_gate_up rows along S in phase 1's epilogue and stores the MX words;
        # phase 3 reads both cores' halves as they are (panels.py panel layout)
        words, scales = panel_layout_hbm(S, two_i, setup, "mlp_bwd_d_gate_up_mx")
        plan1.epilogue.exchange_along_s(words, scales, defer_last=split.num_cores > 1)
        phase3_args = phase3_args[:2] + (TensorDescriptor(words, k_axis=0, scales=scales, panel_layout=True),) + \
            phase3_args[3:]
        sync_data = words

    def build_phase3(outputs):
        plan3 = phase3(None, "plan")
        # loaded under phase 2's tail: its first X panel's quantizes spread over phase 2's last tiles, half of each K
        # tile from a unit-stride ScalarE copy (constants.py SPREAD_FIRST_K_TILES; a K-chunked plan is unchanged)
        plan3.spread_first_load()
        return plan3

    def build_phase4(outputs):
        plan4 = phase4(None, "plan")
        # phase 3 after it (where PhaseGraph puts phase 4 first) loads its first X panel whole at the prefetch point
        # where phase 4's tiles left take under half the spread's schedule (SHORT_TAIL_SPREAD_SHARE): they hide those
        # quantizes, the spread held K tiles back for phase 3's first get (S = 4096, H = 7168, I = 2048: 1.63229 /
        # 1.78763 -> 1.62009 / 1.76908 ms, round 45)
        plan4.short_tail_loads_whole()
        return plan4

    def barrier():
        # phase 1's last K tile along S (exchange_along_s defer_last), read after it; a no-op where phase 2's fence
        # work (set_fence_work) issued it already
        plan1.epilogue.flush_along_s()
        if built:  # phase 2's prefetch_own (split along I: the barrier precedes phase 2)
            built[0].prefetch_own()
        nisa.core_barrier(data=sync_data, cores=(0, 1))

    # with phase 1's rows resident as its stationary panels, each core's phase 2 reads only the d_gate_up rows it wrote
    # itself: no sync point before it; the one barrier goes inside phase 2 (MatmulPlan.set_fence), before phase 3's
    # and 4's reads of the other core's rows
    own_rows2 = ("d_gate_up",) if rows2 != None and plan1.epilogue.keeps_for_phase2(plan1) else ()  # noqa: E711
    graph = PhaseGraph(split.num_cores, shared=("d_gate_up", "intermediate"), barrier=barrier,
                       barrier_under_tail=True)
    graph.add(Phase("phase1", build_phase1, phase1,
                    reads=("output_grad", "hidden_states", "down_proj_weight", "gate_up_weights", "gate_pre",
                           "gate_act", "up"),
                    writes=("d_gate_up", "intermediate")))
    graph.add(Phase("phase2", build_phase2, phase2, reads=("d_gate_up", "gate_up_weights"),
                    writes=("hidden_states_grad",), stationary_reads=("d_gate_up",), local_reads=own_rows2))
    graph.add(Phase("phase4", build_phase4, phase4, reads=("output_grad", "intermediate"),
                    writes=("down_proj_weight_grad",)))
    graph.add(Phase("phase3", build_phase3, phase3, reads=("d_gate_up", "hidden_states"),
                    writes=("gate_up_weight_grad",)))
    graph.run()


@nki.jit
def mlp_backward_mxfp8_nki(output_grad=None, hidden_states=None, down_proj_weight=None, gate_up_weights=None,
                           gate_up_weight_T=None, gate_up_weight_T_scales=None, gate_up_weights_scales=None,
                           down_weight_T=None, down_weight_T_scales=None, output_grad_T=None, output_grad_T_scales=None,
                           hidden_states_T=None, hidden_states_T_scales=None, gate_pre=None, gate_act=None, up=None,
                           intermediate=None, run_with_lnc2=True, matmul_config=None, fp8_x4_dtype=nl.float8_e4m3fn_x4,
                           spill_reload=True, use_scale_packing=True, clamp_limits=None, *,
                           output_hidden_states_grad=None, gate_proj_weight_T=None, up_proj_weight_T=None,
                           down_proj_weight_T=None, hidden_T=None, hidden=None, d_gate_scratch=None, d_up_scratch=None,
                           silu_up_mul_gate_grad_T_scratch=None, gate_pre_scratch=None, gate_act_scratch=None,
                           up_scratch=None, hidden_scratch=None,
                           phase1_tiles_m=None, phase1_tiles_n=None, phase1_tiles_k=None, phase2_tiles_m=None,
                           phase2_tiles_n=None, phase2_tiles_k=None, phase3_tiles_m=None, phase3_tiles_n=None,
                           phase3_tiles_k=None, phase4_tiles_m=None, phase4_tiles_n=None, phase4_tiles_k=None,
                           recompute_tiles_m=None, recompute_tiles_n=None, recompute_tiles_k=None,
                           output_grad_scales=None, output_grad_is_swizzled=False, down_weight_scales=None,
                           down_weight_is_swizzled=False, gate_weight_scales=None, gate_weight_is_swizzled=False,
                           up_weight_scales=None, up_weight_is_swizzled=False, hidden_states_T_is_swizzled=False,
                           hidden_states_scales=None, hidden_states_is_swizzled=False,
                           gate_up_weights_is_swizzled=False, output_grad_T_is_swizzled=False, hidden_T_scales=None,
                           hidden_T_is_swizzled=False, gate_up_weight_T_is_swizzled=False,
                           quant_scheme="1x32", weight_grad_dtype=nl.bfloat16, matmul_precision=None):
    """Backward of Y = (silu(X·W_gateᵀ) ⊙ X·W_upᵀ)·W_downᵀ in MXFP8, recomputing missing checkpoints.

    Takes both published signatures unchanged (api.py maps them onto one set of operands): the current
    nki-library release's, positionally or by keyword (the parameters up to clamp_limits), and the API
    reference's keyword names (the keyword-only block from output_hidden_states_grad to
    gate_up_weight_T_is_swizzled; its positional order is not accepted, a reference-ordered positional call
    fails the shape checks). Aliases: output_grad / output_hidden_states_grad, down_weight_T /
    down_proj_weight_T, down_weight_T_scales / down_weight_scales, intermediate / hidden.

    Dimensions:
        output_grad dY [S, H], hidden_states X [S, H], gate_up_weights W_gu [2I, H] (gate rows first),
        down_proj_weight W_down [H, I], checkpoints gate_pre / gate_act / up / intermediate [S, I]; bf16.
        Transposed inputs: down_weight_T [I, H], gate_up_weight_T [H, 2I], gate_proj_weight_T /
        up_proj_weight_T [H, I], output_grad_T / hidden_states_T [H, S], hidden_T [I, S]: bf16, or
        pre-quantized along their last (contiguous) dimension when their `*_scales` are given (api.py
        defines the layouts: unswizzled words [F, Kp/4] + scales [F, Kp/32], or `*_is_swizzled`:
        [Kp/4, F] + [Kp/32, F]; Kp = K rounded up to 128; reference.prequantize makes both).
        output_grad, hidden_states and gate_up_weights are pre-quantized along H with output_grad_scales,
        hidden_states_scales, gate_up_weights_scales; gate_proj_weight_T / up_proj_weight_T along I with
        gate_weight_scales / up_weight_scales (phase 2, both halves). Which tensor each matmul reads: api.py's table.

    Args:
        gate_pre, gate_act, up, intermediate: any subset may be None; only what is missing is recomputed.
        run_with_lnc2: shard across the two cores of a kernel[2] launch (see the module docstring).
        matmul_config: None, a MatmulConfig for every phase, or an MlpBwdMatmulConfig per phase.
        fp8_x4_dtype: nl.float8_e4m3fn_x4 (default) or nl.float8_e5m2_x4: the MX element format.
        spill_reload: accepted for API compatibility with nki-library; a no-op (panels stay in SBUF).
        use_scale_packing: share one scale tile between four K tiles (partition offsets 0/4/8/12).
        clamp_limits: ClampLimits of a clamped SwiGLU forward, or None.
        Scratch buffers (d_gate_scratch, ...): None or tensors of the documented shapes; not used (the
            kernel allocates the HBM scratch it needs). phase{1..4}_tiles_* / recompute_tiles_*: mapped
            onto MatmulConfig (api.matmul_config_from_tiles); exclusive with matmul_config.
        quant_scheme (ours, keyword-only): "1x32" (OCP-contiguous groups of 32 along K, default) or
            "wrapX" (groups strided by K/4 inside each 512-wide K tile, the nki-library layout).
        weight_grad_dtype (ours): nl.bfloat16 (default) or nl.float32 (or the strings "bfloat16" /
            "float32") for both weight gradients.
        matmul_precision (ours): "mxfp8" (default on trn3) or "bf16" (nc_matmul; the only choice on trn2).

    Returns:
        (hidden_states_grad [S, H] bf16, gate_up_weight_grad [2I, H], down_proj_weight_grad [H, I]) in
        shared HBM; weight gradients in weight_grad_dtype.

    NaN/Inf in the inputs propagate like the reference (an MX group containing NaN/Inf quantizes to a
    NaN scale, so the whole group's products are NaN); nothing raises on them.
    """
    # ---- options (config.resolve_kernel_options: shared with the MoE kernel, messages with the references) ----
    setup, wg_dtype, on_trn3 = resolve_kernel_options(matmul_precision, fp8_x4_dtype, quant_scheme, use_scale_packing,
                                                      weight_grad_dtype, run_with_lnc2, clamp_limits)

    # ---- operands of either call style (api.py) ----
    swizzled = dict(output_grad=output_grad_is_swizzled, hidden_states=hidden_states_is_swizzled,
                    down_weight_T=down_weight_is_swizzled, gate_up_weight_T=gate_up_weight_T_is_swizzled,
                    gate_up_weights=gate_up_weights_is_swizzled, output_grad_T=output_grad_T_is_swizzled,
                    hidden_states_T=hidden_states_T_is_swizzled, hidden_T=hidden_T_is_swizzled,
                    gate_proj_weight_T=gate_weight_is_swizzled, up_proj_weight_T=up_weight_is_swizzled)
    for name in swizzled:
        kernel_assert(isinstance(swizzled[name], bool), f"{name}_is_swizzled must be a bool, got {swizzled[name]!r}")
    ops = resolve_operands(dict(
        output_grad=output_grad, output_hidden_states_grad=output_hidden_states_grad, hidden_states=hidden_states,
        down_proj_weight=down_proj_weight, gate_up_weights=gate_up_weights, gate_up_weight_T=gate_up_weight_T,
        gate_up_weight_T_scales=gate_up_weight_T_scales, gate_up_weights_scales=gate_up_weights_scales,
        down_weight_T=down_weight_T, down_proj_weight_T=down_proj_weight_T, down_weight_T_scales=down_weight_T_scales,
        down_weight_scales=down_weight_scales, output_grad_T=output_grad_T, output_grad_T_scales=output_grad_T_scales,
        hidden_states_T=hidden_states_T, hidden_states_T_scales=hidden_states_T_scales,
        output_grad_scales=output_grad_scales, hidden_states_scales=hidden_states_scales,
        gate_proj_weight_T=gate_proj_weight_T, up_proj_weight_T=up_proj_weight_T, gate_weight_scales=gate_weight_scales,
        up_weight_scales=up_weight_scales, hidden_T=hidden_T, hidden_T_scales=hidden_T_scales, gate_pre=gate_pre,
        gate_act=gate_act, up=up, intermediate=intermediate, hidden=hidden, d_gate_scratch=d_gate_scratch,
        d_up_scratch=d_up_scratch, silu_up_mul_gate_grad_T_scratch=silu_up_mul_gate_grad_T_scratch,
        gate_pre_scratch=gate_pre_scratch, gate_act_scratch=gate_act_scratch, up_scratch=up_scratch,
        hidden_scratch=hidden_scratch, is_swizzled=swizzled), quant_scheme, setup.is_mx)
    tiles = dict(phase1=(phase1_tiles_m, phase1_tiles_n, phase1_tiles_k),
                 phase2=(phase2_tiles_m, phase2_tiles_n, phase2_tiles_k),
                 phase3=(phase3_tiles_m, phase3_tiles_n, phase3_tiles_k),
                 phase4=(phase4_tiles_m, phase4_tiles_n, phase4_tiles_k),
                 recompute=(recompute_tiles_m, recompute_tiles_n, recompute_tiles_k))
    n_max = 4096 if on_trn3 else 512  # fp32 PSUM moving limit (hardware.py; docs/simulator.md#choice-mx-moving-limit)
    transposes = phase_transposes(ops)
    config = resolve_matmul_config(matmul_config_from_tiles(tiles, matmul_config, ops.recompute, n_max, transposes),
                                   setup.is_mx, ops.recompute, n_max, transposes)

    S, H, I = ops.S, ops.H, ops.I
    hidden_states_grad = nl.ndarray((S, H), dtype=nl.bfloat16, buffer=nl.shared_hbm, name="hidden_states_grad")
    gate_up_weight_grad = nl.ndarray((2 * I, H), dtype=wg_dtype, buffer=nl.shared_hbm, name="gate_up_weight_grad")
    down_proj_weight_grad = nl.ndarray((H, I), dtype=wg_dtype, buffer=nl.shared_hbm, name="down_proj_weight_grad")
    mlp_backward_mxfp8_base_nki(hidden_states_grad, gate_up_weight_grad, down_proj_weight_grad, ops.dy_k_h, ops.x_k_h,
                                ops.x_k_s, ops.dy_k_s, ops.down, ops.gate_up, ops.gate_w, ops.up_w, ops.gate_pre,
                                ops.gate_act, ops.up, ops.intermediate, setup, config, run_with_lnc2, clamp_limits,
                                wg_dtype)
    return hidden_states_grad, gate_up_weight_grad, down_proj_weight_grad
