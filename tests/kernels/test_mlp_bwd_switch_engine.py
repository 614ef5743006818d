"""Phase 1's d_gate product at an S tile switch on VectorE (SwigluBackwardEpilogue._d_gate_engine).

The SwiGLU epilogue's d_gate product (dI * uc) * act'(gc) runs on GpSimd, whose SBUF access holds the bus that
VectorE's perf modes share with it; at an S tile switch (the S tile's last n block) the next S tile's dY quantize
(a perf mode) waited for it. With SWITCH_D_GATE_ON_VECTOR, where each core's phase 1 covers all of I (split along S),
that product runs on VectorE (an fp32 product, outside the perf modes) at every S tile switch but the core's last S
tile. The same fp32 multiply on either engine: bit-exact against mx_exact (reference.py mode "mx_exact")."""
from __future__ import annotations

from simkit import (assert_matches_mx_exact, assert_mlp_traced_bit_exact_on_lnc1_and_lnc2, mlp_inputs_with_checkpoints,
                    mlp_reference, run_mlp)

from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8 import mlp_bwd_mxfp8_epilogue as epilogue_module


def _d_gate_product_engines(trace, p):
    """Engines of core p's d_gate products in program order: the tensor_tensor that reads act'(gc), the fp32 result
    of an activation (swiglu_backward_tile's sd)."""
    records = [r for r in trace if r.program == p]
    derivatives = {(o.storage_id, o.byte_lo) for r in records if r.instr == "activation"
                   for o in r.writes if o.dtype == "float32"}
    return [r.engine for r in records if r.instr == "tensor_tensor" and
            any((o.storage_id, o.byte_lo) in derivatives for o in r.reads)]


def test_d_gate_product_at_s_tile_switches_runs_on_vector_engine(monkeypatch):
    """Phase 1 in two n blocks of 512 columns (I = 1024, phase1_tiles_n=1), S tiles of 128 rows: per core the second
    n block's d_gate product of every S tile but the last on VectorE, the rest on GpSimd. The old code (every d_gate
    product on GpSimd) fails; so does the constant off. Bit-exact against mx_exact, LNC1 equal to LNC2."""
    S, H, I = 1024, 128, 1024
    n_blocks = 2
    assert epilogue_module.SWITCH_D_GATE_ON_VECTOR

    def s_tiles(lnc):
        return S // lnc // 128

    def check(trace, lnc):
        expected = [("vector" if b == n_blocks - 1 and s < s_tiles(lnc) - 1 else "gpsimd")
                    for s in range(s_tiles(lnc)) for b in range(n_blocks)]
        for p in range(lnc):
            assert _d_gate_product_engines(trace, p) == expected, (lnc, p)

    inp = mlp_inputs_with_checkpoints(S, H, I, seed=S + H + I + 37, kind="pow2")
    assert_mlp_traced_bit_exact_on_lnc1_and_lnc2(inp, check, phase1_tiles_n=1)
    monkeypatch.setattr(epilogue_module, "SWITCH_D_GATE_ON_VECTOR", False)
    for lnc in (1, 2):
        res = run_mlp(inp, lnc=lnc, trace=True, phase1_tiles_n=1)
        for p in range(lnc):
            assert _d_gate_product_engines(res.trace, p) == ["gpsimd"] * (s_tiles(lnc) * n_blocks), (lnc, p)
        assert_matches_mx_exact(res.outputs, mlp_reference(inp))
