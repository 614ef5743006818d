"""Phase 1's d_gate product at an S tile switch on VectorE (SwigluBackwardEpilogue._d_gate_engine).

The SwiGLU epilogue's d_gate product (dI * uc) * act'(gc) runs on GpSimd, whose SBUF access holds the bus that
VectorE's perf modes share with it; at an S tile switch (the S tile's last n block) the next S tile's dY quantize
(a perf mode) waited for it. With SWITCH_D_GATE_ON_VECTOR, where each core's phase 1 covers all of I (split along S),
that product runs on VectorE (an fp32 product, outside the perf modes) at every S tile switch but the core's last S
tile. The same fp32 multiply on either engine: bit-exact against mx_exact (reference.py mode "mx_exact")."""
from __future__ import annotations

from simkit import (assert_matches_mx_exact, assert_mlp_traced_bit_exact_on_lnc1_and_lnc2, mlp_inputs_with_checkpoints,
                    mlp_reference, run_mlp, spy_returns)

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


def _call_orders(trace, p):
    """Per epilogue call of core p (program order), where d_gate's activation derivative act'(gc) stands among the two
    products that read PSUM: "PAP" (d_up's product first, the default), "APP" (gate_first) or "PPA"
    (gate_psum_first). act'(gc) is the fp32 activation that a product of a PSUM product's result reads."""
    records = [r for r in trace if r.program == p]

    def product(r):  # the epilogue's products of dI (evictions and transposes read PSUM through other instructions)
        return r.instr in ("tensor_tensor", "scalar_tensor_tensor") and any(o.buffer == "psum" for o in r.reads)

    from_psum = {o.storage_id for r in records if product(r) for o in r.writes}
    derivative_reads = {o.storage_id for r in records if r.instr == "tensor_tensor" and
                        any(o.storage_id in from_psum for o in r.reads) for o in r.reads}
    steps = "".join("P" if product(r) else "A" for r in records if product(r) or
                    (r.instr == "activation" and any(o.dtype == "float32" and o.storage_id in derivative_reads
                                                     for o in r.writes)))
    return [steps[i:i + 3] for i in range(0, len(steps), 3)]


def test_plain_switch_gate_psum_product_first(monkeypatch):
    """Phase 1 spread and deferred along S (LNC2; I = 1024 in two n blocks of 512, phase1_tiles_n=1; S = 2048: eight
    S tiles per core, K tiles of four): the first n block of each S tile with no along-S chunk to quantize (S tiles
    0-3; S tiles 4-5 quantize K tile 0's chunks) but the last GATE_FIRST_S_TILES (2, gate_first) issues d_gate's PSUM
    product before d_up's and act'(gc) after both (gate_psum_first, PLAIN_SWITCH_GATE_PSUM_FIRST); every other call
    d_up's first. LNC1 (no deferred flush): d_up first everywhere. With the constant off, round 38's orders (which the
    old code gives: it fails). Bit-exact against mx_exact on LNC1 and LNC2, LNC1 equal to LNC2."""
    S, H, I = 2048, 128, 1024
    assert epilogue_module.PLAIN_SWITCH_GATE_PSUM_FIRST and epilogue_module.GATE_FIRST_S_TILES == 2

    def expected(lnc, psum_first):
        tiles = S // lnc // 128
        if lnc == 1:
            return ["PAP"] * (tiles * 2)
        return [("APP" if s >= tiles - 2 else "PPA" if psum_first and b == 0 and s < 4 else "PAP")
                for s in range(tiles) for b in range(2)]

    def check(trace, lnc):
        for p in range(lnc):
            assert _call_orders(trace, p) == expected(lnc, True), (lnc, p, _call_orders(trace, p))

    inp = mlp_inputs_with_checkpoints(S, H, I, seed=S + H + I + 39, kind="pow2")
    assert_mlp_traced_bit_exact_on_lnc1_and_lnc2(inp, check, phase1_tiles_n=1)
    monkeypatch.setattr(epilogue_module, "PLAIN_SWITCH_GATE_PSUM_FIRST", False)
    res = run_mlp(inp, lnc=2, trace=True, phase1_tiles_n=1)
    for p in range(2):
        assert _call_orders(res.trace, p) == expected(2, False), (p, _call_orders(res.trace, p))
    assert_matches_mx_exact(res.outputs, mlp_reference(inp))


def test_d_gate_switch_with_one_n_block_only_where_rows_are_kept(monkeypatch):
    """Round 41's rule (SwigluBackwardEpilogue.switches_d_gate_on_vector): with one n block per S tile (I = 512, every
    tile a switch) the d_gate products go to VectorE only where phase 1 keeps its d_gate_up rows for phase 2
    (keeps_for_phase2): kept (the default here), every S tile's but the core's last on VectorE; not kept
    (PHASE2_STATIONARY_BUDGET_BYTES 0: the long-S case, H = 2048, I = 768 at S >= 10240), all on GpSimd. The old code
    (VectorE wherever a core covers all of I) fails the second. Bit-exact against mx_exact both ways, LNC1 equal to
    LNC2 where kept."""
    S, H, I = 1024, 128, 512
    assert epilogue_module.SWITCH_D_GATE_ON_VECTOR
    kept = spy_returns(monkeypatch, epilogue_module.SwigluBackwardEpilogue, "keeps_for_phase2")

    def check(trace, lnc):
        tiles = S // lnc // 128
        for p in range(lnc):
            assert _d_gate_product_engines(trace, p) == ["vector"] * (tiles - 1) + ["gpsimd"], (lnc, p)

    inp = mlp_inputs_with_checkpoints(S, H, I, seed=S + H + I + 41, kind="pow2")
    assert_mlp_traced_bit_exact_on_lnc1_and_lnc2(inp, check)
    assert kept and all(kept), kept
    monkeypatch.setattr(epilogue_module, "PHASE2_STATIONARY_BUDGET_BYTES", 0)
    kept.clear()
    res = run_mlp(inp, lnc=2, trace=True)
    assert kept and not any(kept), kept
    for p in range(2):
        assert _d_gate_product_engines(res.trace, p) == ["gpsimd"] * (S // 2 // 128), p
    assert_matches_mx_exact(res.outputs, mlp_reference(inp))

