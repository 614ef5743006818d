"""The fused MX quantizer's graphs are dtype-clean for Inductor's Triton lowering (no GPU needed).

On CUDA, torch.compile of an earlier formulation failed in Triton with "Cannot bitcast data-type of size 64
to data-type of size 32" (H100, torch 2.11, README "Emulation speed"). Found there: once the quantizer ran
with a second option set, Dynamo made the int options that changed (emax, mbits, emin) symbolic kernel
arguments, typed int64 in Triton, so ``y_exp - mbits`` became int64 while Inductor still typed it int32, and
the bitcast of the result to float32 saw 64 bits; the traced graph also held int64 values of its own
(``torch.where(cond, 151, 127)`` of two Python ints, the float64 scale's bits). The CPU's C++ backend casts
silently, so a CPU compile does not catch any of this; the graphs Inductor lowers do. These tests trace
qdq_fused with Inductor's decompositions (what Inductor lowers on every device), and record the graphs of
the package's own compile path over changing options, and check:
    * no int64 value anywhere (tensors and 0-dim scalar tensors alike);
    * no shift or bitwise op (their operand typing is each backend's own; the formulation needs none);
    * every dtype view (bitcast) keeps the element size (float32 <-> int32);
    * no symbolic scalar used in tensor arithmetic.
"""
import functools
import math

import pytest

torch = pytest.importorskip("torch")

from torch._inductor.decomposition import select_decomp_table  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8 import mlp_bwd_mxfp8_emulate as emu  # noqa: E402
from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8 import mlp_bwd_mxfp8_emulate_fused as fused  # noqa: E402

_BIT_OPS = {"bitwise_left_shift", "bitwise_right_shift", "__lshift__", "__rshift__", "bitwise_and", "bitwise_or",
            "bitwise_xor", "__and__", "__or__", "__xor__"}


def _traced_graph(fn, example):
    """The ATen graph of fn(example) after Inductor's decompositions (fake tensors: no compute)."""
    return make_fx(fn, tracing_mode="fake", decomposition_table=select_decomp_table())(example).graph


def _dtype_problems(graph) -> list:
    """Descriptions of the nodes that Inductor's Triton lowering would type wrongly (module docstring)."""
    problems = []
    for node in graph.nodes:
        val = node.meta.get("val")
        name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
        if isinstance(val, torch.Tensor) and val.dtype == torch.int64:
            problems.append(f"int64 value: {node.format_node()}")
        if name in _BIT_OPS:
            problems.append(f"shift / bitwise op: {node.format_node()}")
        if node.target is torch.ops.aten.view.dtype:
            src = node.args[0].meta["val"].dtype
            if src.itemsize != val.dtype.itemsize:
                problems.append(f"bitcast {src} -> {val.dtype}: {node.format_node()}")
    return problems


def _qdq_fn(fmt_name: str, rule: str, out_dtype, dims=(2,)):
    """qdq_fused with the options _qdq_blocks passes for this format (the tensor argument left open)."""
    fmt = emu.element_format(fmt_name)
    finfo = torch.finfo(emu.FP8_DTYPES[fmt_name])
    return functools.partial(fused.qdq_fused, dims=dims, emax=fmt.emax, mbits=fmt.mantissa_bits,
                             emin=int(math.log2(finfo.tiny)),
                             max_normal=float(fmt.max_normal), max_frac=fused.f32_fraction_bits(float(fmt.max_normal)),
                             scale_rule=rule, out_dtype=out_dtype)


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("rule", ["neuron", "rceil", "ocp_floor"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float64])
def test_fused_quantizer_graph_has_no_int64_and_no_64_to_32_bitcast(fmt, rule, out_dtype):
    graph = _traced_graph(_qdq_fn(fmt, rule, out_dtype), torch.randn(4, 2, 32, dtype=torch.bfloat16))
    assert not _dtype_problems(graph)
    # the check can fail: it sees the bitcasts it guards (amax, y -> int32; 2**-k, C, 2**k <- int32)
    views = [n for n in graph.nodes if n.target is torch.ops.aten.view.dtype]
    assert len(views) == 5


def test_wrapx_view_graph_is_dtype_clean():
    """The "wrapX" group views reduce over two axes (dims 1 and 3 of [tiles, 4, P/8, 8]): same checks."""
    graph = _traced_graph(_qdq_fn("float8_e4m3fn", "neuron", torch.float64, dims=(1, 3)),
                          torch.randn(2, 4, 16, 8, dtype=torch.bfloat16))
    assert not _dtype_problems(graph)


def test_graph_check_flags_the_constructs_that_broke_triton():
    """The checker rejects what the old formulation did: a shift by a Python int, an int64 where of two
    Python ints, and a 64 -> 32-bit bitcast."""

    def old_style(v):
        bits = v.float().view(torch.int32)
        e = (bits >> 23) - torch.where(v.float() < 1.0, 151, 127).to(torch.int32)
        wide = (e.to(torch.int64) + 1023) * 2
        return ((e + 127) << 23).view(torch.float32), wide.view(torch.float64)

    problems = _dtype_problems(_traced_graph(old_style, torch.randn(8, dtype=torch.bfloat16)))
    assert any(p.startswith("int64 value") for p in problems)
    assert any(p.startswith("shift / bitwise op") for p in problems)
    bitcast = _traced_graph(lambda v: (v.float().view(torch.int32).to(torch.int64) * 3).view(torch.float32),
                            torch.randn(8))
    assert any(p.startswith("bitcast torch.int64 -> torch.float32") for p in _dtype_problems(bitcast))


def _symbolic_arithmetic(graph) -> list:
    """Nodes that use a symbolic int / float (a kernel argument at run time) as an operand of tensor math:
    Triton types those int64 / float64 (only shape ops may take them)."""
    shape_ops = {"view", "reshape", "expand", "empty", "full", "sym_size", "sym_stride", "sym_numel"}
    bad = []
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
        if name in shape_ops or not any(isinstance(a, torch.fx.Node) and isinstance(
                a.meta.get("val"), (torch.SymInt, torch.SymFloat)) for a in node.args):
            continue
        bad.append(node.format_node())
    return bad


def test_compiled_quantizer_specializes_its_options(monkeypatch):
    """compiled_qdq's graphs, recorded the way Inductor receives them, over two formats / rules (whose ints
    differ: emax, mbits, emin, max_frac) and several shapes (dynamic after the first): the options are
    constants in every graph, no graph does tensor math with a symbolic scalar, and all are dtype-clean.
    Without specialize_int, Dynamo turns the ints that changed into symbolic kernel arguments (int64 in
    Triton): the second format's graph fails this test."""
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def record(gm, _example_inputs):
        graphs.append(gm.graph)
        return gm.forward

    torch._dynamo.reset()
    monkeypatch.setitem(fused._fused_state, "backend",
                        aot_autograd(fw_compiler=record, decompositions=select_decomp_table()))
    monkeypatch.setitem(fused._fused_state, "compiled", None)
    monkeypatch.setitem(fused._fused_state, "failed", False)
    monkeypatch.setitem(fused._fused_state, "verified", set())
    monkeypatch.setitem(fused._fused_state, "mode", "compile")
    g = torch.Generator().manual_seed(3)
    try:
        with torch.no_grad():
            for fmt, rule in (("float8_e4m3fn", "neuron"), ("float8_e5m2", "rceil")):
                for rows in (64, 96):
                    x = torch.randn(rows, 64, generator=g).to(torch.bfloat16)
                    got = emu.mx_quantize_dequantize(x, 1, fmt, "1x32", rule)
                    monkeypatch.setitem(fused._fused_state, "mode", "off")
                    want = emu.mx_quantize_dequantize(x, 1, fmt, "1x32", rule)
                    monkeypatch.setitem(fused._fused_state, "mode", "compile")
                    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    finally:
        torch._dynamo.reset()
    assert not fused._fused_state["failed"]
    assert len(graphs) >= 4  # static and dynamic graphs of both option sets (the probe's among them)
    for graph in graphs:
        assert not _symbolic_arithmetic(graph), _symbolic_arithmetic(graph)
        assert not _dtype_problems(graph)
