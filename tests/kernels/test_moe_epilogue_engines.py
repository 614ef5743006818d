"""Engines of the MoE kernel's pass-A SwiGLU epilogue (docs/moe.md section 10, round 4).

Clamped on trn3, the clamps' tensor_scalar ops run on ScalarE, up's one-instruction mask and dh * uc on VectorE
(GpSimd keeps dh * a and the masks' products; round 14e for the masks and the folded "gpt_oss" offset; round 32a: the
clamps and masks in bf16 where exact, and up's symmetric mask on ScalarE with the clamps); without
clamps, or on trn2 (whose ScalarE takes no min/max or comparison), the round-2 engines. The engine never changes a
bit: the outputs stay equal to mx_exact, with GPT-OSS's clamped "gpt_oss" activation (gate clamped above, up on both
sides, the +1 offset) included.
"""
from __future__ import annotations

import numpy as np
import pytest

from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8 import ClampLimits
from nkilib.examples.moe_backward_cost import PHASES
from nkilib.experimental.moe_mxfp8 import moe_bwd_mxfp8_kernel as kernel_module
from nkilib.experimental.moe_mxfp8.reference import checkpoints_to_blocks, moe_backward_reference
from nkilib.simulator.launcher import run_kernel
from nkilib.simulator.trace import label_phases
from moekit import expert_routing
from simkit import assert_outputs_identical
from test_moe_bwd_kernel import CLAMPS, moe_case, routing

#: GPT-OSS's shape of clamps (limits scaled to the unit-scale test data so that both sides are crossed)
GPT_OSS_LIKE = ClampLimits(non_linear_upper=0.5, linear_lower=-0.5, linear_upper=0.5, activation="gpt_oss")


def _traced(kernel_kwargs, lnc=2):
    """(outputs, [(instr, engine, op0)] of the pass-A epilogue's elementwise records, pass A's records) of one
    simulator run."""
    with label_phases(kernel_module, PHASES):
        res = run_kernel(kernel_module.moe_backward_mxfp8_nki.fn, kwargs=kernel_kwargs, lnc=lnc, grid_ndim=1,
                         trace=True)
    ops = [(r.instr, r.engine, r.attrs.get("op0") or r.attrs.get("op")) for r in res.trace
           if r.instr in ("tensor_scalar", "tensor_tensor") and r.attrs.get("phase") == "A dI+epilogue"]
    in_a = [r for r in res.trace if r.attrs.get("phase") == "A dI+epilogue"]
    return tuple(np.asarray(o) for o in res.outputs), ops, in_a


@pytest.mark.parametrize("clamp", [GPT_OSS_LIKE, CLAMPS], ids=["gpt_oss", "silu_clamped"])
def test_clamped_trn3_engines_and_bits(clamp):
    T, E, k, H, I = 48, 3, 2, 64, 96
    kernel, ref = moe_case(T, E, H, I, routing("random", T, E, k, seed=5), seed=23,
                           checkpoints=("gate_pre", "up"), clamp_limits=clamp)
    out, ops, in_a = _traced(kernel)
    assert_outputs_identical(out, moe_backward_reference(**ref), f"{clamp.activation} clamps vs mx_exact")
    clamp_ops = [(e, op) for instr, e, op in ops if instr == "tensor_scalar" and op in
                 ("minimum", "maximum", "less_equal", "greater_equal")]
    assert clamp_ops and all(e == "scalar" for e, _ in clamp_ops), clamp_ops
    products = {e for instr, e, op in ops if instr == "tensor_tensor" and op == "multiply"}
    assert {"vector", "gpsimd"} <= products, products
    # round 14e: up's two-limit mask is one instruction (|u| <= 0.5 for GPT-OSS's symmetric limits, clamp(u) == u
    # for the asymmetric ones), no (>=, <=) pair; round 32a: the symmetric one on ScalarE with the clamps (bf16, its
    # 2x mode), the asymmetric one's tensor_tensor on VectorE (its only engine besides GpSimd)
    up_mask = [(instr, e) for instr, e, op in ops if op in ("abs", "equal")]
    assert up_mask and set(up_mask) == {("tensor_scalar", "scalar") if clamp is GPT_OSS_LIKE else
                                        ("tensor_tensor", "vector")}, ops
    assert not [o for o in ops if o[2] == "greater_equal"], ops
    # round 32a: every limit here is a bf16 value, so the clamps and masks of the bf16 gate_pre / up are bf16
    narrow = [r for r in in_a if (r.instr, r.attrs.get("op0") or r.attrs.get("op")) in
              (("tensor_scalar", "minimum"), ("tensor_scalar", "maximum"), ("tensor_scalar", "less_equal"),
               ("tensor_scalar", "abs"), ("tensor_tensor", "equal"))]
    assert narrow and {r.attrs["dst_dtype"] for r in narrow} == {"bfloat16"}, [(r.instr, r.attrs) for r in narrow]


def test_gpt_oss_offset_folded_into_the_product():
    """With every checkpoint given (no intermediate computed), the "gpt_oss" +1 is applied inside d_gate's product
    dh * (uc + 1): one scalar_tensor_tensor (add, multiply) per epilogue tile, no separate offset pass (round 14e)."""
    T, E, k, H, I = 48, 3, 2, 64, 96
    kernel, ref = moe_case(T, E, H, I, routing("random", T, E, k, seed=7), seed=31,
                           checkpoints=("gate_pre", "gate_act", "up", "intermediate"), clamp_limits=GPT_OSS_LIKE)
    with label_phases(kernel_module, PHASES):
        res = run_kernel(kernel_module.moe_backward_mxfp8_nki.fn, kwargs=kernel, lnc=2, grid_ndim=1, trace=True)
    assert_outputs_identical(tuple(np.asarray(o) for o in res.outputs), moe_backward_reference(**ref),
                             "folded offset vs mx_exact")
    in_a = [r for r in res.trace if r.attrs.get("phase") == "A dI+epilogue"]
    folded = [r for r in in_a if r.instr == "scalar_tensor_tensor" and (r.attrs.get("op0"), r.attrs.get("op1")) ==
              ("add", "multiply")]
    tiles = [r for r in in_a if r.instr == "activation"]  # act' (gelu_apprx_sigmoid_dx), once per epilogue tile
    assert tiles and len(folded) == len(tiles), (len(folded), len(tiles))
    assert not [r for r in in_a if r.instr == "tensor_scalar" and r.attrs.get("op0") == "add"
                and r.attrs.get("data_dtype") == "float32" and r.attrs.get("op1") == None]  # noqa: E711


def test_unclamped_keeps_clamp_free_engines():
    T, E, k, H, I = 40, 3, 2, 64, 64
    kernel, ref = moe_case(T, E, H, I, routing("random", T, E, k, seed=6), seed=29, checkpoints=("gate_pre", "up"))
    out, ops, _ = _traced(kernel)
    assert_outputs_identical(out, moe_backward_reference(**ref), "no clamps vs mx_exact")
    assert not [o for o in ops if o[0] == "tensor_scalar" and o[2] in ("minimum", "less_equal")]


def test_trn2_clamps_stay_off_scalar(set_target):
    """trn2's ScalarE refuses min/max/comparisons (the simulator raises): the kernel must keep them elsewhere."""
    set_target("trn2")
    T, E, k, H, I = 40, 3, 2, 64, 96
    kernel, ref = moe_case(T, E, H, I, routing("random", T, E, k, seed=9), seed=19, block_size=256,
                           checkpoints=("gate_pre", "up"), clamp_limits=GPT_OSS_LIKE, matmul_precision="bf16")
    out, ops, _ = _traced(kernel)
    assert_outputs_identical(out, moe_backward_reference(**ref), "trn2 bf16 clamped vs mx_exact")
    assert all(e != "scalar" for instr, e, op in ops if instr == "tensor_scalar" and op in ("minimum", "maximum"))


@pytest.mark.parametrize("lnc", [1, 2])
def test_full_blocks_gather_without_zeroing(lnc):
    """Blocks known full (before an expert's last, or a last block whose final position is routed) gather
    into tiles that are not zeroed first; padded last blocks still zero theirs. Expert 0: two full blocks,
    expert 1: two full and a padded one, expert 2: empty. Bit-exact, and pass A issues fewer memsets than
    gathers (the simulator would also refuse a read of a never-written padding row)."""
    B, H, I = 128, 64, 64
    ids = expert_routing([2 * B, 2 * B + 44], shuffle_seed=4)
    kernel, ref = moe_case(ids.shape[0], 3, H, I, ids, seed=41, block_size=B,
                           checkpoints=("gate_pre", "gate_act", "up", "intermediate"), clamp_limits=GPT_OSS_LIKE)
    with label_phases(kernel_module, PHASES):
        res = run_kernel(kernel_module.moe_backward_mxfp8_nki.fn, kwargs=kernel, lnc=lnc, grid_ndim=1, trace=True)
    assert_outputs_identical(tuple(np.asarray(o) for o in res.outputs), moe_backward_reference(**ref),
                             "full blocks vs mx_exact")
    in_a = [r.instr for r in res.trace if r.attrs.get("phase") == "A dI+epilogue"]
    gathers = sum(1 for r in res.trace if r.attrs.get("phase") == "A dI+epilogue" and r.instr == "dma_copy"
                  and r.attrs.get("indirect") and any(getattr(o, "name", "") == "output_grad" for o in r.reads))
    # a chunk of a padded block zeroes its 7 gathered tiles (dY, X, p, four checkpoints); of a full block only
    # the K padding columns of dY and X (H = 64 < the MX K alignment)
    assert gathers > 0 and in_a.count("memset") < 7 * gathers, (in_a.count("memset"), gathers)
    if lnc == 1:  # one chunk per block (B = 128): 4 full chunks x 2 memsets + the padded chunk's 7 (was 5 x 7)
        assert (gathers, in_a.count("memset")) == (5, 4 * 2 + 7)



@pytest.mark.parametrize("lnc", [1, 2])
def test_padding_rows_zeroed_on_gpsimd_with_block_checkpoints(lnc):
    """Round 16a (docs/moe.md section 10): with block-ordered checkpoints (read by plain DMA), the zeroing of an
    expert's part-filled block's gathered dY / X rows and p runs on GpSimd (which generates the gathers' descriptors
    next), not on VectorE, which bounds pass A under skewed routing; with checkpoints gathered by slot (GpSimd also
    makes their descriptors) it keeps the compiler's engine (VectorE in the simulator). Expert loads of 70 / 50 / 80
    pairs at B = 128 leave every expert's block part-filled; LNC1 and LNC2 == mx_exact bit for bit in both layouts.
    The K-padding columns (H = 64 < 128) stay on VectorE."""
    T, E, H, I = 100, 3, 64, 96
    ids = np.stack([np.repeat([0, 1, 2], [70, 30, 0]), np.repeat([1, 2], [20, 80])], axis=1).astype(np.int32)
    ids = ids[np.random.default_rng(41).permutation(T)]
    names = ("gate_pre", "up")
    kernel, ref = moe_case(T, E, H, I, ids, seed=43, checkpoints=names, clamp_limits=GPT_OSS_LIKE)
    assert np.diff(kernel["expert_block_offsets"]).tolist() == [1, 1, 1]
    blocked = dict(kernel, checkpoint_layout="block", **{n: checkpoints_to_blocks(kernel[n], ref["layout"])
                                                         for n in names})
    for kwargs, engine in ((blocked, "gpsimd"), (kernel, "vector")):
        with label_phases(kernel_module, PHASES):
            res = run_kernel(kernel_module.moe_backward_mxfp8_nki.fn, kwargs=kwargs, lnc=lnc, grid_ndim=1, trace=True)
        assert_outputs_identical(tuple(np.asarray(o) for o in res.outputs), moe_backward_reference(**ref),
                                 f"LNC{lnc} padded blocks, {engine} zeroing, vs mx_exact")
        memsets = [r for r in res.trace if r.instr == "memset" and r.attrs.get("phase") == "A dI+epilogue"]
        rows = [r for r in memsets if r.writes[0].byte_lo == 0]  # a whole tile: padding rows; else K-padding columns
        p_zeroing = [r for r in rows if r.writes[0].dtype == "float32" and r.writes[0].shape[1] == 1]
        # per core and part-filled chunk at least dY's rows and p (the old code: all on VectorE in both layouts)
        assert p_zeroing and len(rows) >= 2 * len(p_zeroing), (len(rows), len(p_zeroing))
        assert {r.engine for r in rows} == {engine}, sorted({(r.engine, r.writes[0].shape) for r in rows})
        assert {r.engine for r in memsets if r.writes[0].byte_lo > 0} <= {"vector"}


@pytest.mark.parametrize("lnc", [1, 2])
def test_routing_gradient_is_one_vector_pass_per_tile(lnc):
    """Round 17a: the routing gradient's product dI * h and its sum over the tile's columns are one
    scalar_tensor_tensor with reduce_res (NKI 0.7) per epilogue tile, no tensor_reduce left in pass A; I = 640 gives
    each row a second I tile, whose sum folds onto the first in fp32. The bits stay mx_exact's."""
    T, E, k, H, I = 40, 3, 2, 64, 640
    kernel, ref = moe_case(T, E, H, I, routing("random", T, E, k, seed=8), seed=37, checkpoints=("gate_pre", "up"))
    with label_phases(kernel_module, PHASES):
        res = run_kernel(kernel_module.moe_backward_mxfp8_nki.fn, kwargs=kernel, lnc=lnc, grid_ndim=1, trace=True)
    assert_outputs_identical(tuple(np.asarray(o) for o in res.outputs), moe_backward_reference(**ref),
                             f"fused routing gradient vs mx_exact, LNC{lnc}")
    in_a = [r for r in res.trace if r.attrs.get("phase") == "A dI+epilogue"]
    fused = [r for r in in_a if r.instr == "scalar_tensor_tensor" and r.attrs.get("reduce_op") == "add"]
    dh = [r for r in in_a if r.instr == "tensor_scalar" and r.reads[0].buffer == "psum"]  # dh = dI * p, once a tile
    assert fused and len(fused) == len(dh), (len(fused), len(dh))
    assert all(r.attrs["reduce_cmd"] == "reset_reduce" and [w.arg for w in r.writes] == ["dst", "reduce_res"]
               and r.reads[0].buffer == "psum" for r in fused)
    assert not [r for r in in_a if r.instr == "tensor_reduce"]
    folds = [r for r in in_a if r.instr == "tensor_tensor" and r.attrs.get("op") == "add"]
    assert len(folds) == len(fused) // 2, (len(folds), len(fused))  # one fold per row chunk's second tile


@pytest.mark.parametrize("lnc", [1, 2])
def test_gate_mask_in_its_product_a_tile_late(lnc):
    """Round 19a: GPT-OSS's one-limit gate mask (gate_pre <= limit) is not a ScalarE pass; d_gate's last product
    compares, one VectorE scalar_tensor_tensor (less_equal, multiply) per epilogue tile writing the bf16 d_gate
    columns, and no GpSimd product by a gate mask is left. It is issued a tile late in VectorE's program order (after
    the next tile's dh * (uc + 1), the chunk's last one at its store): with I = 640 (two I tiles) each chunk's VectorE
    products run (add, add, less_equal, less_equal), where issuing it at once gives (add, less_equal, add, less_equal).
    The bits stay mx_exact's at LNC1 and LNC2."""
    T, E, k, H, I = 40, 3, 2, 64, 640
    kernel, ref = moe_case(T, E, H, I, routing("random", T, E, k, seed=9), seed=41,
                           checkpoints=("gate_pre", "gate_act", "up", "intermediate"), clamp_limits=GPT_OSS_LIKE)
    with label_phases(kernel_module, PHASES):
        res = run_kernel(kernel_module.moe_backward_mxfp8_nki.fn, kwargs=kernel, lnc=lnc, grid_ndim=1, trace=True)
    assert_outputs_identical(tuple(np.asarray(o) for o in res.outputs), moe_backward_reference(**ref),
                             f"gate mask in its product vs mx_exact, LNC{lnc}")
    in_a = [r for r in res.trace if r.attrs.get("phase") == "A dI+epilogue" and r.program == 0]
    tiles = [r for r in in_a if r.instr == "activation"]  # act', once per epilogue tile
    masked = [r for r in in_a if r.instr == "scalar_tensor_tensor" and r.attrs.get("op0") == "less_equal"]
    assert tiles and len(masked) == len(tiles), (len(masked), len(tiles))
    assert all(r.attrs["op1"] == "multiply" and r.attrs["dst_dtype"] == "bfloat16" and r.engine == "vector"
               for r in masked)
    assert not [r for r in in_a if r.instr == "tensor_scalar" and r.attrs.get("op0") == "less_equal"]
    products = [r for r in in_a if r.instr == "tensor_tensor" and r.attrs.get("op") == "multiply"]
    assert len(products) == 3 * len(tiles), (len(products), len(tiles))  # dh * a, its mask product, * act'
    order = [r.attrs["op0"] for r in in_a if r.instr == "scalar_tensor_tensor" and r.attrs.get("op0") in
             ("add", "less_equal")]
    assert order == ["add", "add", "less_equal", "less_equal"] * (len(tiles) // 2), order
