"""backend="simulator" of moe_swiglu_experts_mxfp8 (the NKI kernel on the CPU simulator) against
backend="emulate" (pure torch): the four gradients bit for bit through autograd, and the backend's errors."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8.config import ClampLimits  # noqa: E402
from nkilib.experimental.moe_mxfp8 import moe_swiglu_experts_mxfp8  # noqa: E402
from simkit import assert_outputs_identical, to_numpy  # noqa: E402


def make(T, E, k, H, I, seed):
    """Seeded leaves (bf16 x and weights, float32 routing weights), distinct unsorted ids, and dY."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int64)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    w = torch.rand(T, k, generator=g)
    w_gu = (torch.randn(E, 2 * I, H, generator=g) * H ** -0.5).to(torch.bfloat16)
    w_down = (torch.randn(E, H, I, generator=g) * I ** -0.5).to(torch.bfloat16)
    dy = torch.randn(T, H, generator=g).to(torch.bfloat16)
    return x, ids, w, w_gu, w_down, dy


def gradients(backend, x, ids, w, w_gu, w_down, dy, **options):
    leaves = [t.clone().requires_grad_(True) for t in (x, w, w_gu, w_down)]
    y = moe_swiglu_experts_mxfp8(leaves[0], ids, leaves[1], leaves[2], leaves[3], backend=backend, **options)
    y.backward(dy)
    return tuple(to_numpy(t.grad) for t in leaves)


@pytest.mark.parametrize("options", [
    dict(checkpoint="all"),
    dict(checkpoint=("gate_act",), clamp_limits=ClampLimits(non_linear_upper=0.75, linear_lower=-0.75)),
])
def test_simulator_and_emulate_gradients_bit_identical(options):
    case = make(T=37, E=3, k=2, H=64, I=64, seed=5)
    sim = gradients("simulator", *case, **options)
    emu = gradients("emulate", *case, **options)
    assert_outputs_identical(sim, emu, f"simulator vs emulate {options}")
    assert all(g.any() for g in sim)  # every gradient is populated (not a vacuous comparison of zeros)
    if options["checkpoint"] == "all":  # the simulator backend's lnc=2 launch: the same gradients
        assert_outputs_identical(gradients("simulator", *case, lnc=2, **options), sim, "simulator LNC2 vs LNC1")


def test_simulator_backend_errors():
    x, ids, w, w_gu, w_down, _ = make(T=4, E=2, k=1, H=32, I=32, seed=1)
    with pytest.raises(RuntimeError, match="backend='neuron' needs tensors on a Neuron device"):
        moe_swiglu_experts_mxfp8(x, ids, w, w_gu, w_down, backend="neuron")
    y = moe_swiglu_experts_mxfp8(x.requires_grad_(True), ids, w, w_gu, w_down, backend="simulator",
                                 scale_rule="rceil")
    with pytest.raises(ValueError, match="scale_rule='rceil' is only available with backend='emulate'"):
        y.sum().backward()


def test_simulator_forward_saves_block_ordered_checkpoints():
    """For the simulator backend the forward saves the checkpoints as [N*B, I] in the kernel's block layout
    (checkpoint_layout="block", read by plain DMA): equal bit for bit to reference.checkpoints_to_blocks of the slot
    layout's [T, k, I] (an expert of two blocks, an empty one, a padded one), y unchanged, and the op's fake gives the
    same shapes. Fails on the old forward (always [T, k, I])."""
    import numpy as np
    from nkilib.experimental.moe_mxfp8 import moe_bwd_mxfp8_torch as M, routing
    from nkilib.experimental.moe_mxfp8.reference import checkpoints_to_blocks
    T, E, k, H, I, B = 300, 4, 1, 64, 64, 128
    x, _, w, w_gu, w_down, _ = make(T=T, E=E, k=k, H=H, I=I, seed=3)
    ids = torch.tensor([0] * 200 + [2] * 100, dtype=torch.int64)[torch.randperm(T, generator=torch.Generator()
                                                                                 .manual_seed(2))].reshape(T, k)
    clamps = (None,) * 4 + ("silu",)
    slot = M.forward_impl(x, ids, w, w_gu, w_down, *clamps)
    blocked = M.forward_impl(x, ids, w, w_gu, w_down, *clamps, None, B)
    layout = routing.build_block_layout(ids.numpy(), E, B)
    assert np.diff(layout.expert_block_offsets).tolist() == [2, 0, 1, 0]
    assert_outputs_identical((to_numpy(blocked[0]),), (to_numpy(slot[0]),), "y, block vs slot checkpoints")
    for s, b in zip(slot[1:], blocked[1:]):
        assert tuple(b.shape) == (layout.capacity * B, I), b.shape
        assert_outputs_identical((to_numpy(b),), (checkpoints_to_blocks(to_numpy(s), layout),), "block layout")
    opts = (None,) * 4 + ("silu", "float8_e4m3fn", "1x32", "mxfp8", "neuron", "bfloat16", B)
    fake = M.forward_fake(x, ids, w, w_gu, w_down, *opts, "simulator", 1)
    assert [tuple(c.shape) for c in fake[1:]] == [tuple(b.shape) for b in blocked[1:]]
    assert tuple(M.forward_fake(x, ids, w, w_gu, w_down, *opts, "emulate", 1)[1].shape) == (T, k, I)


def test_simulator_backward_passes_block_ordered_weights(monkeypatch):
    """The simulator backend's backward passes the routing weights block-ordered (weights_layout="block",
    topk_weights_blocks == reference.weights_to_blocks) and takes the kernel's block-ordered d_topk_weights back to
    [T, k]: the gradients equal emulate's bit for bit (an expert of two blocks, an empty one, a padded one, unused
    blocks). Fails on the old backend (slot layout: no weights_layout argument)."""
    import nki
    import numpy as np
    from nkilib.experimental.moe_mxfp8 import routing
    from nkilib.experimental.moe_mxfp8.reference import weights_to_blocks
    T, E, k, H, I, B = 300, 4, 1, 64, 64, 128
    x, _, w, w_gu, w_down, dy = make(T=T, E=E, k=k, H=H, I=I, seed=3)
    ids = torch.tensor([0] * 200 + [2] * 100, dtype=torch.int64)[torch.randperm(T, generator=torch.Generator()
                                                                                 .manual_seed(2))].reshape(T, k)
    calls, real = [], nki.simulate

    def recording(fn):
        launch = real(fn)

        class Grid:
            def __getitem__(self, lnc):
                def run(**kw):
                    calls.append(kw)
                    return launch[lnc](**kw)
                return run
        return Grid()

    monkeypatch.setattr(nki, "simulate", recording)
    sim = gradients("simulator", x, ids, w, w_gu, w_down, dy, block_size=B)
    layout = routing.build_block_layout(ids.numpy(), E, B)
    assert len(calls) == 1 and calls[0]["weights_layout"] == "block"
    assert layout.capacity > layout.expert_block_offsets[-1]  # unused blocks among the positions
    assert np.array_equal(calls[0]["topk_weights_blocks"].view(np.uint32),
                          weights_to_blocks(w.numpy(), layout).view(np.uint32))
    monkeypatch.setattr(nki, "simulate", real)
    assert_outputs_identical(sim, gradients("emulate", x, ids, w, w_gu, w_down, dy, block_size=B),
                             "simulator (block-ordered weights) vs emulate")
    assert sim[1].any()


def test_torch_weights_converters_match_the_reference():
    """moe_bwd_mxfp8_forward's torch converters (simulator and Neuron backends) == reference.weights_to_blocks /
    weights_from_blocks: +0 at padding; padding entries of the kernel's output (NaN here) never reach [T, k]."""
    import numpy as np
    from nkilib.experimental.moe_mxfp8 import routing
    from nkilib.experimental.moe_mxfp8.moe_bwd_mxfp8_forward import kernel_weights_blocks, weights_grad_from_blocks
    from nkilib.experimental.moe_mxfp8.reference import weights_from_blocks, weights_to_blocks
    T, E, k, B = 37, 4, 2, 128
    _, ids, w, *_ = make(T=T, E=E, k=k, H=32, I=32, seed=9)
    layout = routing.build_block_layout(ids.numpy(), E, B)
    slots = torch.from_numpy(layout.token_position_to_slot).to(torch.int64)
    blocks = kernel_weights_blocks(w, slots)
    assert blocks.dtype == torch.float32
    assert np.array_equal(blocks.numpy().view(np.uint32), weights_to_blocks(w.numpy(), layout).view(np.uint32))
    d = torch.randn(len(slots), generator=torch.Generator().manual_seed(4))
    d[slots >= T * k] = float("nan")
    back = weights_grad_from_blocks(d, slots, T, k)
    assert back.shape == (T, k) and not back.isnan().any()
    assert np.array_equal(back.numpy(), weights_from_blocks(d.numpy(), layout))
