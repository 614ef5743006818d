"""Dispatch of backend="neuron" with STUB torch_neuronx / torch_xla modules: the dense op (mlp_bwd_mxfp8_neuron.py)
and the MoE op (moe_bwd_mxfp8_neuron.py), both following nkilib/experimental/neuron_dispatch.py.

What these tests can and cannot show: no Neuron device or SDK exists here, so ``torch_neuronx`` and
``torch_xla`` are stub modules put into sys.modules, ``nkilib.BACKEND`` is patched to "neuron" and the
kernels ``mlp_backward_mxfp8_nki`` / ``moe_backward_mxfp8_nki`` are replaced by recorders that return fixed,
distinct tensors. The
stubs only check dispatch: which stack is chosen for which device type, which LNC degree, that the
TorchNeuron path registers its ops through ``nki_op`` with ``register_autograd`` and that the kernel is
launched once, by keyword, with the expected arguments, and that its outputs reach the right
gradients. Whether the real SDK accepts these calls is untested here.
"""
from __future__ import annotations

import dataclasses
import itertools
import sys
import types
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

import nki.language as nl  # noqa: E402  (nkilib's simulator here; it only names the dtypes)
import nkilib  # noqa: E402
from nkilib.experimental import neuron_dispatch  # noqa: E402
from nkilib.experimental.mlp_mxfp8 import swiglu_mlp_mxfp8  # noqa: E402
from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8 import mlp_bwd_mxfp8_kernel  # noqa: E402
from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8 import mlp_bwd_mxfp8_neuron as N  # noqa: E402
from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8 import mlp_bwd_mxfp8_torch as T  # noqa: E402
from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8.config import ClampLimits  # noqa: E402
from nkilib.experimental.moe_mxfp8 import moe_bwd_mxfp8_kernel, moe_swiglu_experts_mxfp8  # noqa: E402
from nkilib.experimental.moe_mxfp8 import moe_bwd_mxfp8_neuron as MN  # noqa: E402
from nkilib.experimental.moe_mxfp8 import moe_bwd_mxfp8_torch as M  # noqa: E402
from nkilib.experimental.moe_mxfp8.reference import checkpoints_to_blocks, weights_to_blocks  # noqa: E402
from nkilib.experimental.moe_mxfp8.routing import build_block_layout  # noqa: E402

S, H, I = 24, 64, 32
CLAMP = ClampLimits(non_linear_upper=0.5, linear_lower=-0.4, linear_upper=0.45)
CLAMP_ARGS = tuple(getattr(CLAMP, f.name) for f in dataclasses.fields(CLAMP))  # as the forward ops take it
KERNEL_KWARGS = {"output_grad", "hidden_states", "down_proj_weight", "gate_up_weights", "gate_pre", "gate_act", "up",
                 "intermediate", "clamp_limits", "fp8_x4_dtype", "quant_scheme", "weight_grad_dtype",
                 "matmul_precision"}
_NAMESPACES = itertools.count()


class RecordingKernel:
    """Stands in for ``mlp_backward_mxfp8_nki``: ``kernel[lnc](**kw)`` records (lnc, kw) and returns
    dX = 1 + arange, dW_gate_up = 1000 + arange, dW_down = -arange (distinct values, so a swapped or
    transposed gradient is visible), in bf16 / the requested weight_grad_dtype."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, lnc):
        def launch(*args, **kw):
            assert not args, "the kernel must be called by keyword"
            self.calls.append((lnc, kw))
            wg = torch.float32 if kw["weight_grad_dtype"] == nl.float32 else torch.bfloat16
            return self.outputs(kw, wg)
        return launch

    def outputs(self, kw, wg):
        dy, w_gu, w_down = kw["output_grad"], kw["gate_up_weights"], kw["down_proj_weight"]
        return (expected_dx(dy.shape).to(torch.bfloat16), expected_dw_gu(w_gu.shape).to(wg),
                expected_dw_down(w_down.shape).to(wg))


def expected_dx(shape):
    return 1 + torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape) % 97


def expected_dw_gu(shape):
    return 1000 + torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape) % 89


def expected_dw_down(shape):
    return -(torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape) % 83)


@pytest.fixture
def stubs(monkeypatch):
    """Stub torch_neuronx (with or without nki_op) and torch_xla; a recording kernel; a clean op cache."""
    registered = []

    def nki_op(name, mutates_args=()):
        def register(fn):
            # a fresh namespace per test: torch.library refuses to define one op name twice
            op = torch.library.custom_op(f"nkilib_stub{next(_NAMESPACES)}::{name.split('::')[1]}",
                                         mutates_args=mutates_args)(fn)
            entry = {"name": name, "autograd": False}
            registered.append(entry)
            register_autograd = op.register_autograd

            def recording_register_autograd(*args, **kwargs):
                entry["autograd"] = True
                return register_autograd(*args, **kwargs)

            op.register_autograd = recording_register_autograd
            return op
        return register

    torchneuron = types.ModuleType("torch_neuronx")
    torchneuron.nki_op = nki_op
    xla_only_neuronx = types.ModuleType("torch_neuronx")  # the PyTorch/XLA stack's torch_neuronx: no nki_op
    monkeypatch.setitem(sys.modules, "torch_xla", types.ModuleType("torch_xla"))
    monkeypatch.setitem(sys.modules, "torch_neuronx", torchneuron)
    monkeypatch.setattr(nkilib, "BACKEND", "neuron")
    kernel, moe_kernel = RecordingKernel(), RecordingMoEKernel()
    monkeypatch.setattr(mlp_bwd_mxfp8_kernel, "mlp_backward_mxfp8_nki", kernel)
    monkeypatch.setattr(moe_bwd_mxfp8_kernel, "moe_backward_mxfp8_nki", moe_kernel)
    monkeypatch.setattr(N, "_TORCHNEURON_OPS", {})
    monkeypatch.setattr(MN, "_TORCHNEURON_OPS", {})
    monkeypatch.delenv(N.LNC_ENV_VAR, raising=False)
    return SimpleNamespace(registered=registered, kernel=kernel, moe_kernel=moe_kernel, torchneuron=torchneuron,
                           xla_only_neuronx=xla_only_neuronx, monkeypatch=monkeypatch)


def as_device(monkeypatch, kind):
    """Make both ops see CPU tensors as tensors of device type `kind` (the real stack selection of
    neuron_dispatch runs)."""
    real, device = neuron_dispatch.neuron_stack, SimpleNamespace(type=kind)
    monkeypatch.setattr(neuron_dispatch, "neuron_stack", lambda _: real(device))


def make(seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(S, H, generator=g).to(dtype).requires_grad_()
    wgu = (torch.randn(2 * I, H, generator=g) / 8).to(dtype).requires_grad_()
    wd = (torch.randn(H, I, generator=g) / 8).to(dtype).requires_grad_()
    return x, wgu, wd


def test_stack_follows_the_device_type_not_what_imports(stubs):
    assert N.neuron_stack(SimpleNamespace(type="neuron")) == "torchneuron"
    # torch_neuronx imports on the XLA stack too: XLA tensors still take the XLA path
    assert N.neuron_stack(torch.device("xla", 0)) == "xla"
    stubs.monkeypatch.setitem(sys.modules, "torch_neuronx", stubs.xla_only_neuronx)
    assert N.neuron_stack(torch.device("xla", 0)) == "xla"
    with pytest.raises(RuntimeError, match="device type 'neuron' need torch-neuronx with nki_op"):
        N.neuron_stack(SimpleNamespace(type="neuron"))
    stubs.monkeypatch.setitem(sys.modules, "torch_xla", None)  # import torch_xla -> ImportError
    with pytest.raises(RuntimeError, match="device type 'xla' need torch-xla"):
        N.neuron_stack(torch.device("xla", 0))
    with pytest.raises(RuntimeError, match="device type 'neuron' \\(TorchNeuron\\) or 'xla'.*got device type 'cpu'"):
        N.neuron_stack(torch.device("cpu"))


def test_lnc_comes_from_neuron_logical_nc_config(monkeypatch):
    monkeypatch.delenv(N.LNC_ENV_VAR, raising=False)
    assert N.resolve_neuron_lnc(None) == 1 and N.resolve_neuron_lnc(1) == 1  # documented default
    with pytest.raises(ValueError, match="lnc=2 does not match.*NEURON_LOGICAL_NC_CONFIG is unset"):
        N.resolve_neuron_lnc(2)
    monkeypatch.setenv(N.LNC_ENV_VAR, "2")
    assert N.resolve_neuron_lnc(None) == 2 and N.resolve_neuron_lnc(2) == 2
    with pytest.raises(ValueError, match="lnc=1 does not match.*NEURON_LOGICAL_NC_CONFIG=2"):
        N.resolve_neuron_lnc(1)
    monkeypatch.setenv(N.LNC_ENV_VAR, "4")
    with pytest.raises(ValueError, match="NEURON_LOGICAL_NC_CONFIG must be 1 or 2, got '4'"):
        N.resolve_neuron_lnc(None)


def _check_kernel_call(call, lnc, x, wgu, wd, wg):
    got_lnc, kw = call
    assert got_lnc == lnc
    assert set(kw) == KERNEL_KWARGS
    assert kw["output_grad"].shape == (S, H) and kw["output_grad"].dtype == torch.bfloat16
    assert torch.equal(kw["hidden_states"], x.detach().bfloat16())
    assert torch.equal(kw["gate_up_weights"], wgu.detach().bfloat16())
    assert torch.equal(kw["down_proj_weight"], wd.detach().bfloat16())
    # checkpoint=("gate_pre", "up"): those two are passed, the others recomputed by the kernel
    assert kw["gate_pre"].shape == (S, I) and kw["up"].shape == (S, I)
    assert kw["gate_act"] is None and kw["intermediate"] is None
    assert kw["clamp_limits"] == CLAMP
    assert kw["fp8_x4_dtype"] == nl.float8_e4m3fn_x4 and kw["weight_grad_dtype"] == getattr(nl, wg)
    assert kw["quant_scheme"] == "1x32" and kw["matmul_precision"] == "mxfp8"


def test_torchneuron_path_registers_nki_ops_with_autograd_and_launches_with_the_env_lnc(stubs):
    stubs.monkeypatch.setenv(N.LNC_ENV_VAR, "2")
    as_device(stubs.monkeypatch, "neuron")
    x, wgu, wd = make(0)
    y = swiglu_mlp_mxfp8(x, wgu, wd, backend="neuron", checkpoint=("gate_pre", "up"), clamp_limits=CLAMP)
    assert stubs.registered == [{"name": N.TORCHNEURON_BACKWARD_OP, "autograd": False},
                                {"name": N.TORCHNEURON_FORWARD_OP, "autograd": True}]
    assert stubs.kernel.calls == []  # the forward runs in torch
    y.backward(torch.ones_like(y))
    assert len(stubs.kernel.calls) == 1
    _check_kernel_call(stubs.kernel.calls[0], 2, x, wgu, wd, "bfloat16")
    assert torch.equal(x.grad, expected_dx((S, H)).bfloat16())
    assert torch.equal(wgu.grad, expected_dw_gu((2 * I, H)).bfloat16())
    assert torch.equal(wd.grad, expected_dw_down((H, I)).bfloat16())
    # a second call reuses the registration
    swiglu_mlp_mxfp8(x, wgu, wd, backend="neuron")
    assert len(stubs.registered) == 2
    # an explicit lnc that contradicts the runtime's is refused before anything runs
    with pytest.raises(ValueError, match="lnc=1 does not match"):
        swiglu_mlp_mxfp8(x, wgu, wd, backend="neuron", lnc=1)


def compiled_graphs(fn, *args):
    """Run fn(*args) under torch.compile(fullgraph) with an aot_autograd backend that records the forward and
    backward graphs, then backward(ones); returns {"fw": [targets], "bw": [targets]} of call_function nodes."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = {}

    def record(kind):
        def compiler(gm, example_inputs):
            graphs[kind] = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
            return make_boxed_func(gm.forward)
        return compiler

    torch._dynamo.reset()
    y = torch.compile(fn, backend=aot_autograd(fw_compiler=record("fw"), bw_compiler=record("bw")),
                      fullgraph=True)(*args)
    y.backward(torch.ones_like(y))
    torch._dynamo.reset()
    return graphs


def test_torchneuron_kernel_is_one_node_of_the_compiled_backward(stubs):
    """Under torch.compile the backward graph holds the kernel op as a single node (recorded with an
    aot_autograd backend; on Neuron this graph goes to backend="neuron")."""
    as_device(stubs.monkeypatch, "neuron")
    # what importing mlp_bwd_mxfp8_torch does on Neuron
    assert neuron_dispatch.register_ops_if_available(N.torchneuron_ops)
    x, wgu, wd = make(1)
    graphs = compiled_graphs(lambda a, b, c: swiglu_mlp_mxfp8(a, b, c, backend="neuron", checkpoint=("gate_pre", "up"),
                                                              clamp_limits=CLAMP), x, wgu, wd)
    assert len([t for t in graphs["bw"] if t.endswith("mlp_backward_mxfp8.default")]) == 1, graphs["bw"]
    assert not any(t.endswith("mlp_backward_mxfp8.default") for t in graphs["fw"])
    assert len(stubs.kernel.calls) == 1
    _check_kernel_call(stubs.kernel.calls[0], 1, x, wgu, wd, "bfloat16")
    assert torch.equal(wgu.grad, expected_dw_gu((2 * I, H)).bfloat16())


def test_xla_path_uses_the_autograd_function_and_no_nki_op(stubs):
    stubs.monkeypatch.setitem(sys.modules, "torch_neuronx", stubs.xla_only_neuronx)
    as_device(stubs.monkeypatch, "xla")
    x, wgu, wd = make(2, dtype=torch.float32)
    y = swiglu_mlp_mxfp8(x, wgu, wd, backend="neuron", checkpoint=("gate_pre", "up"), clamp_limits=CLAMP)
    assert "XlaSwiGLUMLP" in type(y.grad_fn.next_functions[0][0]).__name__  # y = view of the Function's output
    y.backward(torch.ones_like(y))
    assert stubs.registered == []
    assert len(stubs.kernel.calls) == 1
    _check_kernel_call(stubs.kernel.calls[0], 1, x, wgu, wd, "float32")  # fp32 parameters -> fp32 weight grads
    assert x.grad.dtype == torch.float32 and torch.equal(x.grad, expected_dx((S, H)))
    assert torch.equal(wgu.grad, expected_dw_gu((2 * I, H))) and torch.equal(wd.grad, expected_dw_down((H, I)))


@pytest.mark.parametrize("kind", ["neuron", "xla"])
def test_main_grad_accumulation_on_both_stacks(stubs, kind):
    """accumulate_main_grad=True routes the kernel's fp32 weight gradients into main_grad on both
    Neuron stacks (weight_grad_dtype float32 is requested from the kernel)."""
    as_device(stubs.monkeypatch, kind)
    x, wgu, wd = make(3)
    wgu.main_grad = torch.full(wgu.shape, 0.5)
    wd.main_grad = torch.zeros(wd.shape)
    y = swiglu_mlp_mxfp8(x, wgu, wd, backend="neuron", checkpoint=("gate_pre", "up"), clamp_limits=CLAMP,
                         accumulate_main_grad=True)
    y.backward(torch.ones_like(y))
    _check_kernel_call(stubs.kernel.calls[0], 1, x, wgu, wd, "float32")
    assert torch.equal(wgu.main_grad, expected_dw_gu((2 * I, H)) + 0.5)
    assert torch.equal(wd.main_grad, expected_dw_down((H, I)))
    assert wgu.grad is None and wd.grad is None


def test_cpu_backward_op_refuses_the_neuron_backend():
    """The torch.library backward op is the CPU path; Neuron tensors never reach it (a direct call says so)."""
    x, wgu, wd = (t.detach() for t in make(4))
    with pytest.raises(RuntimeError, match="does not run the Neuron path"):
        T.swiglu_mlp_mxfp8_backward_op(x, x, wgu, wd, None, None, None, None, None, None, None, None,
                                       "float8_e4m3fn", "1x32", "mxfp8", "neuron", "bfloat16", "neuron", 1)


# ---- the MoE op (moe_bwd_mxfp8_neuron.py) ----

T_TOK, E_NUM, K_TOP = 10, 4, 2
MOE_KERNEL_KWARGS = {"output_grad", "hidden_states", "topk_weights", "gate_up_weight", "down_weight",
                     "token_position_to_id", "token_position_to_slot", "expert_block_offsets", "block_size",
                     "run_with_lnc2", "gate_pre", "gate_act", "up", "intermediate", "clamp_limits", "fp8_x4_dtype",
                     "quant_scheme", "weight_grad_dtype", "matmul_precision", "gate_up_bias_grad",
                     "checkpoint_layout", "weights_layout", "topk_weights_blocks"}


class RecordingMoEKernel(RecordingKernel):
    """Stands in for ``moe_backward_mxfp8_nki``: records (lnc, kw) and returns dX, d_topk_weights (float32; by block
    position with weights_layout="block": position p holds the pattern's value of its slot, NaN at padding, which
    the op must drop), dW_gate_up, dW_down (bf16 / the requested weight_grad_dtype) from the expected_* patterns
    above, and with gate_up_bias_grad=True d_gate_up_bias (float32, expected_moe_bias_grad)."""

    def outputs(self, kw, wg):
        d_w = expected_dw_down(kw["topk_weights"].shape)
        if kw.get("weights_layout") == "block":
            slots = kw["token_position_to_slot"].to(torch.int64)
            d_w = torch.cat([d_w.reshape(-1), torch.tensor([float("nan")])])[slots]
        outs = (expected_dx(kw["output_grad"].shape).to(torch.bfloat16),
                d_w, expected_moe_dw(kw["gate_up_weight"].shape).to(wg),
                -expected_moe_dw(kw["down_weight"].shape).to(wg))
        return outs + ((expected_moe_bias_grad(kw["gate_up_weight"].shape[:2]),) if kw["gate_up_bias_grad"] else ())


def expected_moe_bias_grad(shape):
    return 0.5 + torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape) % 31


def expected_moe_dw(shape):
    return expected_dw_gu((shape[0] * shape[1], shape[2])).reshape(shape)


def make_moe(seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T_TOK, H, generator=g).to(dtype).requires_grad_()
    ids = torch.stack([torch.randperm(E_NUM, generator=g)[:K_TOP] for _ in range(T_TOK)])
    w = torch.rand(T_TOK, K_TOP, generator=g).requires_grad_()
    wgu = (torch.randn(E_NUM, 2 * I, H, generator=g) / 8).to(dtype).requires_grad_()
    wd = (torch.randn(E_NUM, H, I, generator=g) / 8).to(dtype).requires_grad_()
    return x, ids, w, wgu, wd


def _check_moe_kernel_call(call, lnc, x, ids, w, wgu, wd, wg, bias_grad=False):
    got_lnc, kw = call
    assert got_lnc == lnc and kw["run_with_lnc2"] == (lnc == 2)
    assert set(kw) == MOE_KERNEL_KWARGS and kw["gate_up_bias_grad"] is bias_grad
    assert kw["output_grad"].shape == (T_TOK, H) and kw["output_grad"].dtype == torch.bfloat16
    assert torch.equal(kw["hidden_states"], x.detach().bfloat16())
    assert torch.equal(kw["topk_weights"], w.detach().float())
    assert torch.equal(kw["gate_up_weight"], wgu.detach().bfloat16())
    assert torch.equal(kw["down_weight"], wd.detach().bfloat16())
    layout = build_block_layout(ids.numpy(), E_NUM, kw["block_size"])  # the routing, as block layout tensors
    for name in ("token_position_to_id", "token_position_to_slot", "expert_block_offsets"):
        assert torch.equal(kw[name], torch.from_numpy(getattr(layout, name))), name
    # checkpoint=("gate_pre", "up"), saved by the forward op block-ordered [N*B, I] (checkpoint_layout="block"):
    # row p is the slot-layout row of the routed pair at block position p (the forward by slot, as the emulate
    # backends save it), +0 at padding; the other two are recomputed by the kernel
    assert kw["checkpoint_layout"] == "block"
    bf = torch.bfloat16
    _, *by_slot = M.forward_impl(x.detach().to(bf), ids, w.detach(), wgu.detach().to(bf), wd.detach().to(bf),
                                 *CLAMP_ARGS)
    for name, slot_rows in (("gate_pre", by_slot[0]), ("up", by_slot[2])):
        expected = torch.from_numpy(checkpoints_to_blocks(slot_rows.float().numpy(), layout)).to(bf)
        assert kw[name].shape == (layout.token_position_to_id.shape[0], I), (name, kw[name].shape)
        assert torch.equal(kw[name].view(torch.int16), expected.view(torch.int16)), name
    assert kw["gate_act"] is None and kw["intermediate"] is None
    # the routing weights by block position (weights_layout="block", round 30b): +0 at padding; the kernel's
    # block-ordered d_topk_weights goes back to [T, k] (_check_moe_grads, the recorder's NaN padding dropped)
    assert kw["weights_layout"] == "block"
    expected_p = torch.from_numpy(weights_to_blocks(w.detach().float().numpy(), layout))
    assert kw["topk_weights_blocks"].dtype == torch.float32
    assert torch.equal(kw["topk_weights_blocks"].view(torch.int32), expected_p.view(torch.int32))
    assert kw["clamp_limits"] == CLAMP and kw["weight_grad_dtype"] == getattr(nl, wg)
    assert kw["fp8_x4_dtype"] == nl.float8_e4m3fn_x4 and kw["quant_scheme"] == "1x32"


def _check_moe_grads(x, w, wgu, wd, dtype):
    assert x.grad.dtype == dtype and torch.equal(x.grad, expected_dx((T_TOK, H)).to(dtype))
    assert torch.equal(w.grad, expected_dw_down((T_TOK, K_TOP)))
    assert torch.equal(wgu.grad, expected_moe_dw((E_NUM, 2 * I, H)).to(dtype))
    assert torch.equal(wd.grad, -expected_moe_dw((E_NUM, H, I)).to(dtype))


def test_moe_torchneuron_path_registers_nki_ops_with_autograd_and_launches_with_the_env_lnc(stubs):
    stubs.monkeypatch.setenv(N.LNC_ENV_VAR, "2")
    as_device(stubs.monkeypatch, "neuron")
    x, ids, w, wgu, wd = make_moe(5)
    y = moe_swiglu_experts_mxfp8(x, ids, w, wgu, wd, backend="neuron", checkpoint=("gate_pre", "up"),
                                 clamp_limits=CLAMP)
    assert stubs.registered == [{"name": MN.TORCHNEURON_BACKWARD_OP, "autograd": False},
                                {"name": MN.TORCHNEURON_FORWARD_OP, "autograd": True}]
    assert stubs.moe_kernel.calls == []  # the forward runs in torch
    y.backward(torch.ones_like(y))
    assert len(stubs.moe_kernel.calls) == 1 and stubs.kernel.calls == []
    _check_moe_kernel_call(stubs.moe_kernel.calls[0], 2, x, ids, w, wgu, wd, "bfloat16")
    _check_moe_grads(x, w, wgu, wd, torch.bfloat16)
    with pytest.raises(ValueError, match="lnc=1 does not match"):
        moe_swiglu_experts_mxfp8(x, ids, w, wgu, wd, backend="neuron", lnc=1)


def test_moe_auto_backend_on_a_neuron_device_is_neuron(stubs):
    assert M.resolve_backend("auto", SimpleNamespace(type="neuron")) == "neuron"
    assert M.resolve_backend("auto", torch.device("xla", 0)) == "neuron"
    as_device(stubs.monkeypatch, "neuron")
    stubs.monkeypatch.setattr(M, "resolve_backend", lambda backend, device=None: "neuron")  # CPU tensors here
    x, ids, w, wgu, wd = make_moe(6)
    moe_swiglu_experts_mxfp8(x, ids, w, wgu, wd).sum().backward()
    assert len(stubs.moe_kernel.calls) == 1 and stubs.moe_kernel.calls[0][0] == 1  # LNC unset: 1


def test_moe_xla_path_uses_the_autograd_function_and_no_nki_op(stubs):
    stubs.monkeypatch.setitem(sys.modules, "torch_neuronx", stubs.xla_only_neuronx)
    as_device(stubs.monkeypatch, "xla")
    x, ids, w, wgu, wd = make_moe(7, dtype=torch.float32)
    y = moe_swiglu_experts_mxfp8(x, ids, w, wgu, wd, backend="neuron", checkpoint=("gate_pre", "up"),
                                 clamp_limits=CLAMP)
    assert "XlaMoESwiGLUExperts" in type(y.grad_fn.next_functions[0][0]).__name__
    y.backward(torch.ones_like(y))
    assert stubs.registered == []
    assert len(stubs.moe_kernel.calls) == 1
    _check_moe_kernel_call(stubs.moe_kernel.calls[0], 1, x, ids, w, wgu, wd, "float32")  # fp32 params
    _check_moe_grads(x, w, wgu, wd, torch.float32)


@pytest.mark.parametrize("kind", ["neuron", "xla"])
def test_moe_gate_up_bias_gradient_comes_from_the_kernel_on_both_stacks(stubs, kind):
    """With gate_up_bias the op asks the kernel for its bias gradient (gate_up_bias_grad=True) and returns the
    kernel's fifth output as the bias's gradient (in the bias's dtype); the down bias stays outside the op."""
    if kind == "xla":
        stubs.monkeypatch.setitem(sys.modules, "torch_neuronx", stubs.xla_only_neuronx)
    as_device(stubs.monkeypatch, kind)
    x, ids, w, wgu, wd = make_moe(10)
    b_gu = torch.zeros(E_NUM, 2 * I, dtype=torch.bfloat16).requires_grad_()
    y = moe_swiglu_experts_mxfp8(x, ids, w, wgu, wd, backend="neuron", checkpoint=("gate_pre", "up"),
                                 clamp_limits=CLAMP, gate_up_bias=b_gu)
    y.backward(torch.ones_like(y))
    assert len(stubs.moe_kernel.calls) == 1
    _check_moe_kernel_call(stubs.moe_kernel.calls[0], 1, x, ids, w, wgu, wd, "bfloat16", bias_grad=True)
    _check_moe_grads(x, w, wgu, wd, torch.bfloat16)
    assert b_gu.grad.dtype == torch.bfloat16
    assert torch.equal(b_gu.grad, expected_moe_bias_grad((E_NUM, 2 * I)).to(torch.bfloat16))


def test_moe_cpu_backward_op_refuses_the_neuron_backend():
    x, ids, w, wgu, wd = (t.detach() for t in make_moe(8))
    with pytest.raises(RuntimeError, match="does not run the Neuron path"):
        M.moe_swiglu_experts_mxfp8_backward_op(x, x, ids, w, wgu, wd, None, None, None, None, None, None, None, None,
                                               "silu", "float8_e4m3fn", "1x32", "mxfp8", "neuron", "bfloat16", 128,
                                               "neuron", 1, None)


def test_moe_torchneuron_kernel_is_one_node_of_the_compiled_backward(stubs):
    as_device(stubs.monkeypatch, "neuron")
    # what importing moe_bwd_mxfp8_torch does on Neuron
    assert neuron_dispatch.register_ops_if_available(MN.torchneuron_ops)
    x, ids, w, wgu, wd = make_moe(9)
    graphs = compiled_graphs(lambda a, p, b, c: moe_swiglu_experts_mxfp8(a, ids, p, b, c, backend="neuron",
                                                                         checkpoint=("gate_pre", "up"),
                                                                         clamp_limits=CLAMP), x, w, wgu, wd)
    assert len([t for t in graphs["bw"] if t.endswith("moe_backward_mxfp8.default")]) == 1, graphs["bw"]
    assert not any(t.endswith("moe_backward_mxfp8.default") for t in graphs["fw"])
    assert len(stubs.moe_kernel.calls) == 1
    _check_moe_kernel_call(stubs.moe_kernel.calls[0], 1, x, ids, w, wgu, wd, "bfloat16")
    _check_moe_grads(x, w, wgu, wd, torch.bfloat16)
