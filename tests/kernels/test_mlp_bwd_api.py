"""Both published signatures of mlp_backward_mxfp8_nki (api.py): the nki-library release's positional
order and the API reference's keyword names, with and without checkpoints, LNC1 and LNC2, transposed and
pre-quantized operands (both layouts), the reference's tiling arguments and scratch buffers.

Every call style must give the outputs of the plain keyword call bit for bit (same numerics, other
argument names), which matches mx_exact bit for bit and the fp32 reference within 1.1x the error measured
for these inputs (S=100, H=160, I=96, seed 356: rel_fro 0.0678 / 0.0691 / 0.0672 for dX / dW_gu / dW_down,
the same inputs as test_matches_references' (100, 160, 96) case).
"""
from __future__ import annotations

import numpy as np
import pytest

import nki
import nki.language as nl
from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8 import MatmulConfig, mlp_backward_mxfp8_nki
from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8.reference import prequantize, prequantized_operands
from simkit import (BF16, assert_matches_mx_exact, assert_outputs_identical, mlp_checkpoints, mlp_inputs,
                    mlp_reference, rel_fro, run_mlp)

S, H, I = 100, 160, 96
MEASURED_FP32 = (0.0678, 0.0691, 0.0672)


@pytest.fixture(scope="module")
def inp():
    return mlp_inputs(S, H, I, seed=S + H + I)


@pytest.fixture(scope="module")
def baseline(inp):
    """The plain keyword call (LNC1): the outputs every call style must reproduce."""
    out = run_mlp(inp)
    assert_matches_mx_exact(out, mlp_reference(inp))
    for o, ideal, measured in zip(out, mlp_reference(inp, mode="fp32"), MEASURED_FP32):
        assert rel_fro(o, ideal) <= 1.1 * measured
    return out


def _t(a):
    return np.ascontiguousarray(a.T)


def reference_style_args(inp, checkpoints=None):
    """The API reference's 16 required arguments (by its keyword names) plus optional checkpoints."""
    w_gu, dy, x = inp["gate_up_weights"], inp["output_grad"], inp["hidden_states"]
    ck = mlp_checkpoints(inp)

    def zeros(*shape):
        return np.zeros(shape, BF16)

    args = dict(output_hidden_states_grad=dy, hidden_states=x, gate_proj_weight_T=_t(w_gu[:I]),
                up_proj_weight_T=_t(w_gu[I:]), down_proj_weight_T=_t(inp["down_proj_weight"]), gate_up_weights=w_gu,
                d_gate_scratch=zeros(S, I), d_up_scratch=zeros(S, I), hidden_states_T=_t(x), output_grad_T=_t(dy),
                hidden_T=_t(ck["intermediate"]), silu_up_mul_gate_grad_T_scratch=zeros(2 * I, S),
                gate_pre_scratch=zeros(S, I), gate_act_scratch=zeros(S, I), up_scratch=zeros(S, I),
                hidden_scratch=zeros(S, I))
    if checkpoints:
        args.update(gate_pre=ck["gate_pre"], gate_act=ck["gate_act"], up=ck["up"], hidden=ck["intermediate"])
    return args


# ---- the nki-library release's signature ----


@pytest.mark.parametrize("checkpoints", [False, True], ids=["recompute", "checkpoints"])
@pytest.mark.parametrize("lnc", [1, 2])
def test_release_positional_call(inp, baseline, lnc, checkpoints):
    """Positional order output_grad, hidden_states, down_proj_weight, gate_up_weights, gate_up_weight_T,
    gate_up_weight_T_scales, gate_up_weights_scales, down_weight_T, down_weight_T_scales, output_grad_T,
    output_grad_T_scales, hidden_states_T, hidden_states_T_scales, gate_pre, gate_act, up, intermediate,
    run_with_lnc2, matmul_config, fp8_x4_dtype, spill_reload, use_scale_packing, clamp_limits."""
    ck = mlp_checkpoints(inp) if checkpoints else dict(gate_pre=None, gate_act=None, up=None, intermediate=None)
    args = (inp["output_grad"], inp["hidden_states"], inp["down_proj_weight"], inp["gate_up_weights"],
            None, None, None, None, None, None, None, None, None,
            ck["gate_pre"], ck["gate_act"], ck["up"], ck["intermediate"], True, None, nl.float8_e4m3fn_x4, True,
            True, None)
    out = nki.simulate(mlp_backward_mxfp8_nki)[lnc](*args)
    assert_outputs_identical(baseline, out, "release positional call")


def test_release_positional_prequantized(inp, baseline):
    """The release's positional pre-quantized slots (gate_up_weight_T, its scales, gate_up_weights_scales,
    down_weight_T, its scales, output_grad_T, its scales, hidden_states_T, its scales), LNC2."""
    pq = prequantized_operands(inp["output_grad"], inp["hidden_states"], inp["down_proj_weight"],
                               inp["gate_up_weights"])
    args = (inp["output_grad"], inp["hidden_states"], None, pq["gate_up_weights"], pq["gate_up_weight_T"],
            pq["gate_up_weight_T_scales"], pq["gate_up_weights_scales"], pq["down_weight_T"],
            pq["down_weight_T_scales"], pq["output_grad_T"], pq["output_grad_T_scales"], pq["hidden_states_T"],
            pq["hidden_states_T_scales"])
    out = nki.simulate(mlp_backward_mxfp8_nki)[2](*args)
    assert_outputs_identical(baseline, out, "release positional, all pre-quantized")


@pytest.mark.parametrize("lnc", [1, 2])
def test_reference_keyword_call_trn2(inp, set_target, lnc):
    """On Trn2 (bf16 matmuls, no MX) the reference's call gives the release call's outputs, = mx_exact bf16."""
    set_target("trn2")
    base = run_mlp(inp)
    assert_matches_mx_exact(base, mlp_reference(inp, matmul_precision="bf16"))
    assert_outputs_identical(base, run_mlp(reference_style_args(inp), lnc=lnc), "trn2 reference")


def test_release_pretransposed_bf16_weights(inp, baseline):
    """Only transposed bf16 weights: down_weight_T [I, H] feeds phase 1, gate_up_weight_T [H, 2I] feeds
    phase 2 (PE transposes) and the recompute (column windows); the results are the same numbers."""
    given = dict(output_grad=inp["output_grad"], hidden_states=inp["hidden_states"],
                 down_weight_T=_t(inp["down_proj_weight"]), gate_up_weight_T=_t(inp["gate_up_weights"]))
    assert_outputs_identical(baseline, run_mlp(given, lnc=2), "transposed bf16 weights")


# ---- the API reference's signature ----


@pytest.mark.parametrize("checkpoints", [False, True], ids=["recompute", "checkpoints"])
@pytest.mark.parametrize("lnc", [1, 2])
def test_reference_keyword_call(inp, baseline, lnc, checkpoints):
    """The reference's keyword names and documented defaults (phase tiles 8/1/8 and 4/1/8, which map to
    512-wide output tiles), scratch buffers passed, checkpoints named `hidden` for the intermediate."""
    tiles = {f"phase{p}_tiles_{a}": v for p, (m, n, k) in ((1, (8, 1, 8)), (2, (8, 1, 8)), (3, (4, 1, 8)),
                                                           (4, (4, 1, 8))) for a, v in zip("mnk", (m, n, k))}
    tiles.update(recompute_tiles_m=8, recompute_tiles_n=1, recompute_tiles_k=8)
    out = run_mlp(reference_style_args(inp, checkpoints), lnc=lnc, run_with_lnc2=True,
                  fp8_x4_dtype=nl.float8_e4m3fn_x4, spill_reload=True, use_scale_packing=True, **tiles)
    assert_outputs_identical(baseline, out, "API reference keyword call")


def test_reference_recompute_from_transposed_gate_up(inp, baseline):
    """gate_proj_weight_T / up_proj_weight_T [H, I] feed the recompute when gate_up_weights is not given
    (phase 2 then reads gate_up_weight_T)."""
    args = reference_style_args(inp)
    args.pop("gate_up_weights")
    args["gate_up_weight_T"] = _t(inp["gate_up_weights"])
    assert_outputs_identical(baseline, run_mlp(args, lnc=2), "recompute from gate/up_proj_weight_T")


@pytest.mark.parametrize("swizzled", [False, True], ids=["unswizzled", "swizzled"])
def test_reference_prequantized(inp, baseline, swizzled):
    """The reference's pre-quantized pairs: dY and X along H (output_grad_scales, hidden_states_scales),
    down_proj_weight_T (down_weight_scales), gate_up_weights along H, hidden_states_T, output_grad_T and
    hidden_T along S, each with its *_is_swizzled flag; phase 2 reads the bf16 gate_up_weight_T."""
    pq = prequantized_operands(inp["output_grad"], inp["hidden_states"], inp["down_proj_weight"],
                               inp["gate_up_weights"], swizzled=swizzled)
    args = reference_style_args(inp)
    args.update(output_hidden_states_grad=pq["output_grad"], output_grad_scales=pq["output_grad_scales"],
                hidden_states=pq["hidden_states"], hidden_states_scales=pq["hidden_states_scales"],
                down_proj_weight_T=pq["down_weight_T"], down_weight_scales=pq["down_weight_T_scales"],
                gate_up_weights=pq["gate_up_weights"], gate_up_weights_scales=pq["gate_up_weights_scales"],
                hidden_states_T=pq["hidden_states_T"], hidden_states_T_scales=pq["hidden_states_T_scales"],
                output_grad_T=pq["output_grad_T"], output_grad_T_scales=pq["output_grad_T_scales"],
                gate_up_weight_T=_t(inp["gate_up_weights"]))
    # hidden_T pre-quantized along S: validated, not read (phase 4 reads the recomputed intermediate)
    args["hidden_T"], args["hidden_T_scales"] = prequantize(_t(mlp_checkpoints(inp)["intermediate"]), swizzled=swizzled)
    flags = ("output_grad", "hidden_states", "down_weight", "gate_up_weights", "hidden_states_T", "output_grad_T",
             "hidden_T")
    args.update({f"{f}_is_swizzled": swizzled for f in flags})
    assert_outputs_identical(baseline, run_mlp(args, lnc=2), f"reference pre-quantized (swizzled={swizzled})")


def test_prequantized_activations_bf16_transposes(inp, baseline):
    """dY and X pre-quantized along H: phases 4 and 3 read the bf16 output_grad_T / hidden_states_T [H, S]
    with PE transposes (their default 2048-wide tiles narrowed to fit PSUM beside the transposes)."""
    pq = prequantized_operands(inp["output_grad"], inp["hidden_states"], inp["down_proj_weight"],
                               inp["gate_up_weights"], names=["output_grad", "hidden_states"])
    given = dict(output_grad=pq["output_grad"], output_grad_scales=pq["output_grad_scales"],
                 hidden_states=pq["hidden_states"], hidden_states_scales=pq["hidden_states_scales"],
                 output_grad_T=_t(inp["output_grad"]), hidden_states_T=_t(inp["hidden_states"]),
                 down_proj_weight=inp["down_proj_weight"], gate_up_weights=inp["gate_up_weights"])
    assert_outputs_identical(baseline, run_mlp(given, lnc=2), "pre-quantized dY / X along H")


def test_reference_tiles_mapping(inp, baseline):
    """phaseN_tiles_n x 512 = our n_tile; tiles_m / tiles_k only schedule. Other widths, same numbers."""
    ck = mlp_checkpoints(inp)
    out = run_mlp({**inp, **ck}, lnc=2, phase1_tiles_n=3, phase2_tiles_n=2, phase3_tiles_n=4, phase4_tiles_n=1,
                  phase1_tiles_m=2, phase3_tiles_k=1)
    assert_outputs_identical(baseline, out, "reference tiles")


@pytest.mark.parametrize("options,match", [
    (dict(phase2_tiles_n=2, matmul_config=MatmulConfig()), r"either matmul_config or the API reference's phase2_tiles"),
    (dict(phase1_tiles_n=1, recompute_tiles_n=2), r"recompute_tiles_n=2 and phase1_tiles_n=1 differ"),
    (dict(phase3_tiles_n=5), r"phase3_tiles_n=5 asks for 5 x 512-column output tiles; phase 3 fits at most 4 here"),
    (dict(recompute_tiles_n=2), r"recompute_tiles_n=2 asks for .* phase 1 fits at most 1 here"),
    (dict(phase1_tiles_m=0), r"phase1_tiles_m must be a positive int or None, got 0"),
    (dict(recompute_tiles_k=1.5), r"recompute_tiles_k must be a positive int or None, got 1.5"),
])
def test_reference_tiles_errors(inp, options, match):
    with pytest.raises(AssertionError, match=match):
        run_mlp(inp, **options)


def test_reference_positional_order_is_not_silently_accepted(inp):
    """The reference's positional order (gate_proj_weight_T, up_proj_weight_T, ... after hidden_states)
    lands in the release's slots (up_proj_weight_T [H, I] in gate_up_weights): detected by shape and rejected
    with an error that says so, instead of computing with swapped operands."""
    args = reference_style_args(inp)
    order = ("output_hidden_states_grad", "hidden_states", "gate_proj_weight_T", "up_proj_weight_T",
             "down_proj_weight_T", "gate_up_weights")
    with pytest.raises(AssertionError, match=r"this looks like the API reference's positional order .* by keyword"):
        nki.simulate(mlp_backward_mxfp8_nki)[1](*[args[n] for n in order])


def test_readme_switching_snippet_runs():
    """The README's "Switching from nki-library" snippet runs as written: both call styles, equal outputs."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = text.split("### Switching from nki-library", 1)[1]
    snippet = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    scope = {}
    exec(compile(snippet, "README.md#switching", "exec"), scope)
    assert scope["dX"].shape == (128, 256) and scope["dW_gu"].shape == (256, 256)


@pytest.mark.parametrize("scheme", ["1x32", "wrapX"])
def test_swizzled_multi_tile_k(scheme):
    """Swizzled operands whose K spans a full and a partial K tile (S=640: 512 + 128; 2I=576: 512 + 128 after
    padding to 640), converted by the kernel's DMAs: equal to in-kernel quantization bit for bit."""
    inp = mlp_inputs(640, 64, 288, seed=40)
    names = ["output_grad_T", "hidden_states_T", "gate_up_weight_T"]
    pq = prequantized_operands(inp["output_grad"], inp["hidden_states"], inp["down_proj_weight"],
                               inp["gate_up_weights"], quant_scheme=scheme, names=names, swizzled=True)
    flags = {f"{n}_is_swizzled": True for n in names}
    out = run_mlp({**inp, **pq}, lnc=2, quant_scheme=scheme, **flags)
    assert_outputs_identical(run_mlp(inp, quant_scheme=scheme), out, f"swizzled multi-tile ({scheme})")


# ---- the API reference's pre-quantized phase-2 halves gate_proj_weight_T / up_proj_weight_T ----


def _prequantized_halves(w_gu, i, quant_scheme="1x32", gate_swizzled=False, up_swizzled=False):
    """W_gate^T and W_up^T [H, I] each pre-quantized along I, as the reference's keyword arguments."""
    gate, gate_scales = prequantize(_t(w_gu[:i]), quant_scheme=quant_scheme, swizzled=gate_swizzled)
    up, up_scales = prequantize(_t(w_gu[i:]), quant_scheme=quant_scheme, swizzled=up_swizzled)
    return dict(gate_proj_weight_T=gate, gate_weight_scales=gate_scales, gate_weight_is_swizzled=gate_swizzled,
                up_proj_weight_T=up, up_weight_scales=up_scales, up_weight_is_swizzled=up_swizzled)


@pytest.mark.parametrize("gate_swizzled,up_swizzled", [(False, False), (True, True), (True, False)],
                         ids=["unswizzled", "swizzled", "mixed_layouts"])
@pytest.mark.parametrize("lnc", [1, 2])
def test_reference_prequantized_gate_up_halves(inp, baseline, lnc, gate_swizzled, up_swizzled):
    """gate_proj_weight_T / up_proj_weight_T pre-quantized along I (gate_weight_scales / up_weight_scales, each
    layout as its *_is_swizzled says), every other operand bf16: phase 2 reads the halves' bytes (I = 96, so
    2I = 192 is padded to 256 after them). Equal to the fused gate_up_weight_T + gate_up_weight_T_scales
    call on the same data, and (baseline) to in-kernel quantization and mx_exact, bit for bit."""
    args = reference_style_args(inp)
    args.update(_prequantized_halves(inp["gate_up_weights"], I, gate_swizzled=gate_swizzled,
                                     up_swizzled=up_swizzled))
    out = run_mlp(args, lnc=lnc)
    assert_outputs_identical(baseline, out, "pre-quantized gate/up halves")
    fused = prequantized_operands(inp["output_grad"], inp["hidden_states"], inp["down_proj_weight"],
                                  inp["gate_up_weights"], names=["gate_up_weight_T"])
    assert_outputs_identical(run_mlp({**inp, **fused}, lnc=lnc), out, "halves vs fused gate_up_weight_T")


@pytest.mark.parametrize("scheme,i", [("1x32", 288), ("wrapX", 512)])
def test_prequantized_halves_span_k_tiles(scheme, i):
    """2I over more than one 512-wide K tile: with "1x32" (I = 288) the first K tile holds all of W_gate and
    part of W_up; with "wrapX" (I = 512) each K tile is one half's. Same outputs as in-kernel quantization,
    which match mx_exact."""
    small = mlp_inputs(32, 64, i, seed=41)
    base = run_mlp(small, quant_scheme=scheme)
    assert_matches_mx_exact(base, mlp_reference(small, quant_scheme=scheme))
    given = {**small, **_prequantized_halves(small["gate_up_weights"], i, scheme, gate_swizzled=True)}
    given.pop("gate_up_weights")  # phase 2 reads the halves; the recompute reads gate_up_weight_T's windows
    given["gate_up_weight_T"] = _t(small["gate_up_weights"])
    assert_outputs_identical(base, run_mlp(given, lnc=2, quant_scheme=scheme), f"halves over K tiles ({scheme})")


def test_prequantized_halves_errors(inp, set_target):
    halves = _prequantized_halves(inp["gate_up_weights"], I)
    args = {**reference_style_args(inp), **halves}
    with pytest.raises(AssertionError, match=r"gate_weight_scales is given without up_weight_scales"):
        run_mlp({**args, "up_weight_scales": None})
    with pytest.raises(AssertionError, match=r"up_weight_scales is given without gate_weight_scales"):
        run_mlp({**args, "gate_weight_scales": None})
    fused = prequantized_operands(inp["output_grad"], inp["hidden_states"], inp["down_proj_weight"],
                                  inp["gate_up_weights"], names=["gate_up_weight_T"])
    with pytest.raises(AssertionError, match=r"gate_up_weight_T_scales and gate_weight_scales / up_weight_scales"):
        run_mlp({**args, **fused})
    with pytest.raises(AssertionError, match=r"quant_scheme='wrapX' need I % 512 == 0, got I=96"):
        run_mlp({**args, **_prequantized_halves(inp["gate_up_weights"], I, "wrapX")}, quant_scheme="wrapX")
    with pytest.raises(AssertionError, match=r"gate_proj_weight_T must have shape \[160, 32\], got \[32, 160\]"):
        run_mlp({**args, "gate_proj_weight_T": _t(halves["gate_proj_weight_T"])})
    with pytest.raises(AssertionError, match=r"\['gate_proj_weight_T', 'up_proj_weight_T'\] need "
                                             r"matmul_precision='mxfp8', got 'bf16'"):
        run_mlp(args, matmul_precision="bf16")


def test_readme_calling_the_kernel_snippet_runs():
    """The README's "Calling the kernel" snippet, its inputs bound to small seeded tensors: the clamped
    call runs as written and matches mx_exact with the same clamps bit for bit."""
    import pathlib
    import re

    from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8 import ClampLimits

    text = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = text.split("## Calling the kernel", 1)[1]
    snippet = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    inp = mlp_inputs(64, 128, 64, seed=7)
    scope = {"dY": inp["output_grad"], "X": inp["hidden_states"], "W_gu": inp["gate_up_weights"],
             "W_down": inp["down_proj_weight"]}
    exec(compile(snippet, "README.md#calling-the-kernel", "exec"), scope)
    clamps = ClampLimits(non_linear_upper=7.0, linear_lower=-7.0, linear_upper=7.0)
    assert_matches_mx_exact((scope["dX"], scope["dW_gate_up"], scope["dW_down"]),
                            mlp_reference(inp, clamp_limits=clamps))
