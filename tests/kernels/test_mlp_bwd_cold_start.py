"""Phase 1's cold start (MatmulPlan cold_staging: the MLP backward's W_down at TP8, all of it quantized before the
first S tile's matmuls): how VectorE's W_down quantizes read their sources, bit-exact on LNC1 and LNC2.
"""
from nkilib.core.matmul import plan as plan_module
from simkit import assert_matches_mx_exact, mlp_checkpoints, mlp_inputs, mlp_reference, run_mlp

W_DOWN = "down_proj_weight"


def _unit_stride(op) -> bool:
    """Whether an on-chip operand's free dims are one unit-stride run (row-major, no gaps)."""
    expect = op.storage_itemsize
    for n, s in reversed(list(zip(op.shape[1:], op.strides[1:]))):
        if n != 1 and s != expect:
            return False
        expect *= n
    return True


def _w_down_quantize_sources(trace):
    """{program: [(unit stride, source elements per partition, engine that wrote the source)]} of every quantize_mx
    whose source holds W_down: a staging tile its DMAs wrote, or a copy of one (the copy's engine)."""
    out = {}
    for p in sorted({r.program for r in trace}):
        records = [r for r in trace if r.program == p]
        staging = {r.writes[0].storage_id for r in records
                   if r.engine == "dma" and r.reads and r.reads[0].name == W_DOWN}
        copies = {r.writes[0].storage_id: r.engine for r in records
                  if r.instr == "tensor_copy" and r.reads[0].storage_id in staging}
        sources = []
        for r in records:
            if r.instr != "quantize_mx":
                continue
            src = next(o for o in r.reads if o.arg == "src")
            if src.storage_id in staging:
                sources.append((_unit_stride(src), src.nbytes // src.shape[0] // 2, "dma"))
            elif src.storage_id in copies:
                sources.append((_unit_stride(src), src.nbytes // src.shape[0] // 2, copies[src.storage_id]))
        out[p] = sources
    return out


def _quantized_words(trace, program):
    """Storage ids of the SBUF tiles that quantize_mx writes words into on one core."""
    return {next(o for o in r.writes if o.arg == "dst").storage_id for r in trace
            if r.program == program and r.instr == "quantize_mx"}


def test_cold_start_w_down_quantizes_half_of_each_k_tile_from_a_unit_stride_copy(monkeypatch):
    """At phase 1's cold start VectorE quantizes every K tile of W_down before the first S tile's matmuls, from the
    [P, 4, F] staging tile through a strided [P, F, 4] view (half VectorE's quantize rate in the cost model, a quarter
    pessimistic). With COLD_PERMUTE_INTO_NEXT_WORDS, ScalarE copies the last F // 2 columns of each K tile but the
    panel's last into the next K tile's words allocation as a unit-stride [P, F // 2, 4] bf16 tile, and VectorE
    quantizes those columns from it (TP8 modeled 0.61912 / 0.69893 -> 0.61780 / 0.68619 ms). H = 3072, I = 256: six
    K tiles of W_down in one n block (F = 256), S = 256 cold-staged. Per core: 4F source elements per partition and K
    tile, each K tile's 4F elements quantized, half (2F) of K tiles 0-4's from ScalarE copies, unit stride, into
    words that a later quantize_mx writes; K tile 5 whole from its staging tile. The old code quantized every K tile
    whole from the strided view: fails there. Bit-exact against mx_exact on LNC1 and LNC2, LNC1 equal to LNC2.
    Without cold staging (COLD_STAGING_MAX_M_TILES = 1), or with the constant off, no W_down source is a copy."""
    S, H, I = 256, 3072, 256
    k_tiles, elems = H // 512, 4 * I  # per K tile: [128, 4, I] bf16 staged, per partition
    assert plan_module.COLD_PERMUTE_INTO_NEXT_WORDS
    inp = mlp_inputs(S, H, I, seed=S + H + I + 33)
    inp = {**inp, **mlp_checkpoints(inp, matmul_precision="mxfp8")}
    reference = mlp_reference(inp, matmul_precision="mxfp8")
    strided_half, copied_half = (False, elems // 2, "dma"), (True, elems // 2, "scalar")
    expected = [strided_half, copied_half] * (k_tiles - 1) + [(False, elems, "dma")]
    outputs = []
    for lnc in (1, 2):
        res = run_mlp(inp, lnc=lnc, trace=True, matmul_precision="mxfp8")
        sources = _w_down_quantize_sources(res.trace)
        assert sources == {p: expected for p in range(lnc)}, sources
        for p in range(lnc):  # the copies' tiles are words that quantize_mx writes later
            copy_dsts = {r.writes[0].storage_id for r in res.trace if r.program == p and r.instr == "tensor_copy"
                         and r.engine == "scalar" and r.writes[0].dtype == "bfloat16"
                         and r.reads[0].storage_id in {s.writes[0].storage_id for s in res.trace
                                                       if s.program == p and s.engine == "dma" and s.reads
                                                       and s.reads[0].name == W_DOWN}}
            assert copy_dsts and copy_dsts <= _quantized_words(res.trace, p), copy_dsts
        measured = assert_matches_mx_exact(res.outputs, reference)
        assert all(m == (0, 0.0) for m in measured), measured
        outputs.append(res.outputs)
    for a, b in zip(*outputs):
        assert a.tobytes() == b.tobytes()

    whole = [(False, elems, "dma")] * k_tiles
    monkeypatch.setattr(plan_module, "COLD_PERMUTE_INTO_NEXT_WORDS", False)
    res = run_mlp(inp, lnc=1, trace=True, matmul_precision="mxfp8")
    assert _w_down_quantize_sources(res.trace) == {0: whole}
    monkeypatch.setattr(plan_module, "COLD_PERMUTE_INTO_NEXT_WORDS", True)
    monkeypatch.setattr(plan_module, "COLD_STAGING_MAX_M_TILES", 1)  # not cold-staged
    res = run_mlp(inp, lnc=1, trace=True, matmul_precision="mxfp8")
    assert _w_down_quantize_sources(res.trace) == {0: whole}
