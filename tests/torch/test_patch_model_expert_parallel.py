"""patch_model(model, recipe, ep_group=...) on 2 gloo ranks: tiny Qwen3-MoE, Mixtral and GPT-OSS models whose
experts are sharded over the ranks, against the single-process patched model on the global batch.

Each rank builds the model from a different seed and loads the original model's full state dict (its experts
modules cut their slices out of the full tensors); rank r runs batch rows r and back-propagates
sum(logits * G) with G's same rows. The single-process reference is the same patched model without ep_group
whose experts get Q(x) in the forward and Q(dY) in the backward (straight-through, Q: the MXFP8 payload's round
trip along H, tests/torch/test_expert_parallel.py), so that the expert-parallel contract of expert_parallel.py
(bit-identical to the op on Q(x), Q(dY)) predicts: logits and every expert parameter's gradient (each rank: the
slice of its experts) bit-identical; replicated parameters' gradients (each rank: its rows' share) summing to the
reference's up to float32 summation order. With ep_payload="bf16" the plain patched model is the reference, bit
for bit.
"""
import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from distkit import call_outcomes, run_ranks  # noqa: E402
from test_expert_parallel import _q  # noqa: E402  (the payload's round trip Q)
from test_patch_model_gpt_oss import _model as gpt_oss_model  # noqa: E402
from test_patch_model_moe import _model as moe_model  # noqa: E402
from torchkit import rel  # noqa: E402

from nkilib import patch_model  # noqa: E402
from nkilib.training.moe import HFGptOssExperts, HFMoEExperts  # noqa: E402

RECIPE = "mxfp8_e4m3_emulate"
EXPERTS = (HFMoEExperts, HFGptOssExperts)


def _model(family, seed):
    return gpt_oss_model(seed=seed) if family == "gpt_oss" else moe_model(family, seed=seed)


class _QInput(torch.autograd.Function):
    """Forward Q(x), backward the identity: what the dispatch does to x (its dX is the op's, unquantized)."""

    @staticmethod
    def forward(ctx, x):
        return _q(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class _QGrad(torch.autograd.Function):
    """Forward the identity, backward Q(dY): what the combine's backward does to dY."""

    @staticmethod
    def forward(ctx, y):
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        return _q(grad)


def _quantize_experts_io(model):
    for m in model.modules():
        if isinstance(m, EXPERTS):
            m.register_forward_pre_hook(lambda _, args: (_QInput.apply(args[0]), *args[1:]))
            m.register_forward_hook(lambda _, args, out: _QGrad.apply(out))


def _step(model, ids, grad_logits):
    logits = model(ids).logits
    (logits * grad_logits).sum().backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters()}


def _patched_model_and_batch(family, batch_seed):
    """(full_state, plain, ids, grad_logits): the seed-0 model's state dict (cloned), that model patched
    without ep_group, and a batch of token ids [2, 16] with its logits' gradient [2, 16, 128] drawn from
    `batch_seed`."""
    original = _model(family, seed=0)
    full_state = {k: v.clone() for k, v in original.state_dict().items()}
    g = torch.Generator().manual_seed(batch_seed)
    ids = torch.randint(0, 128, (2, 16), generator=g)
    grad_logits = torch.randn(2, 16, 128, generator=g)
    plain = copy.deepcopy(original)
    patch_model(plain, RECIPE)
    return full_state, plain, ids, grad_logits


def _rank(rank, world, family, full_state, ids, grad_logits, payload="mxfp8", capacity=None):
    import torch.distributed as dist

    model = _model(family, seed=100 + rank)  # other weights than the reference: load_state_dict must fix them
    report = patch_model(model, RECIPE, ep_group=dist.group.WORLD, ep_payload=payload, ep_capacity=capacity)
    keys_after_patch = list(model.state_dict())
    model.load_state_dict(full_state)  # full [E, ...] expert tensors: each module cuts out its slice
    shard_state = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(shard_state)  # a rank's own state dict loads back as well
    rows = slice(rank * ids.shape[0] // world, (rank + 1) * ids.shape[0] // world)
    logits, grads = _step(model, ids[rows], grad_logits[rows])
    return dict(local=report.rank_local_parameters, keys=keys_after_patch,
                shapes={k: tuple(v.shape) for k, v in shard_state.items()}, logits=logits, grads=grads)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_patch_model_with_ep_group_equals_single_process(family):
    full_state, plain, ids, grad_logits = _patched_model_and_batch(family, batch_seed=1)
    reference = copy.deepcopy(plain)
    _quantize_experts_io(reference)
    ref_logits, ref_grads = _step(reference, ids, grad_logits)  # first: the forked ranks inherit its imports
    plain_logits, plain_grads = _step(plain, ids, grad_logits)

    ranks = run_ranks(2, _rank, family, full_state, ids, grad_logits, timeout=120)

    expert_params = {n for n, _ in reference.named_parameters() if ".experts." in n}
    assert expert_params
    for rank, out in enumerate(ranks):
        assert out["keys"] == list(full_state)  # the model's own keys
        assert set(out["local"]) == expert_params
        for name in full_state:  # a rank's state dict: its experts' slices, everything else whole
            want = tuple(full_state[name].shape)
            assert out["shapes"][name] == ((want[0] // 2,) + want[1:] if name in expert_params else want), name
        assert torch.equal(out["logits"], ref_logits[rank:rank + 1]), rank
        for name in expert_params:
            n_local = full_state[name].shape[0] // 2
            assert torch.equal(out["grads"][name], ref_grads[name][rank * n_local:(rank + 1) * n_local]), name
    errors = {}
    for name, want in ref_grads.items():
        if name in expert_params or want is None:
            continue
        errors[name] = rel(ranks[0]["grads"][name] + ranks[1]["grads"][name], want)
    print(f"{family}: replicated parameters, sum of the ranks' gradients vs the reference: max rel. error "
          f"{max(errors.values()):.1e}")
    assert max(errors.values()) < 1e-5, errors  # float32 summation order only
    # against the plain single-process patched model (x and dY of the experts not rounded): the MXFP8 payload's
    # error, one E4M3 rounding of the experts' input (in their BF16 forward) and output gradient. Measured:
    # Qwen3-MoE / Mixtral logits 8.8e-4 / 3.0e-3, expert weights 4.3e-2..5.8e-2; GPT-OSS (this test's weights
    # hit the clamps, whose masks the rounding moves) logits 8.0e-2, expert weights and biases 1.3e-1..2.8e-1
    bounds = (0.15, 0.4) if family == "gpt_oss" else (5e-3, 8e-2)
    logits = torch.cat([r["logits"] for r in ranks])
    vs_plain = {n: rel(torch.cat([r["grads"][n] for r in ranks]), plain_grads[n]) for n in sorted(expert_params)}
    print(f"{family}: vs the plain patched model: logits {rel(logits, plain_logits):.1e}, expert parameters "
          + ", ".join(f"{n.split('.experts.')[1]} {e:.1e}" for n, e in vs_plain.items()))
    assert 0 < rel(logits, plain_logits) < bounds[0]
    assert all(0 < e < bounds[1] for e in vs_plain.values()), vs_plain


@pytest.mark.parametrize("family,capacity", [("qwen3_moe", None), ("gpt_oss", "auto")])
def test_patch_model_with_bf16_payload_is_bit_identical_to_the_plain_patched_model(family, capacity):
    # ep_payload="bf16": x and dY travel unrounded, so the expert-parallel model equals the plain single-process
    # patched model (no Q) bit for bit, GPT-OSS's biases and clamps included; with ep_capacity="auto" the
    # all-to-alls are padded to equal splits (the exchanges only move rows: still bit for bit)
    full_state, plain, ids, grad_logits = _patched_model_and_batch(family, batch_seed=2)
    ref_logits, ref_grads = _step(plain, ids, grad_logits)
    ranks = run_ranks(2, _rank, family, full_state, ids, grad_logits, "bf16", capacity, timeout=120)
    for rank, out in enumerate(ranks):
        assert torch.equal(out["logits"], ref_logits[rank:rank + 1]), rank
        for name in out["local"]:
            n_local = full_state[name].shape[0] // 2
            assert torch.equal(out["grads"][name], ref_grads[name][rank * n_local:(rank + 1) * n_local]), name


def _bad_ep_calls(rank, world):
    import torch.distributed as dist

    from nkilib.training.moe import HFMoEExperts

    model = moe_model("mixtral", seed=0)
    experts = model.model.layers[0].mlp.experts
    odd = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=3, num_experts_per_tok=2))
    patched = moe_model("mixtral", seed=0)
    patch_model(patched, RECIPE)
    return call_outcomes({
        "indivisible": lambda: patch_model(odd, RECIPE, ep_group=dist.group.WORLD),
        "not_a_group": lambda: HFMoEExperts(experts, RECIPE, ep_group=object()),
        "reshard": lambda: patch_model(patched, RECIPE, ep_group=dist.group.WORLD),
        "payload": lambda: patch_model(moe_model("mixtral", seed=0), RECIPE, ep_group=dist.group.WORLD,
                                       ep_payload="fp4"),
    })


def test_patch_model_ep_group_errors():
    with pytest.raises(ValueError, match=r"patch_model: ep_payload / ep_capacity need an ep_group .* "
                                         r"ep_payload='bf16'"):
        patch_model(moe_model("mixtral", seed=0), RECIPE, ep_payload="bf16")
    for m in run_ranks(2, _bad_ep_calls, timeout=60):
        assert "model.layers.0.mlp.experts: the number of experts E=3 (gate_up_proj.shape[0]) must be divisible " \
               "by the ep_group size 2" in m["indivisible"]
        assert m["not_a_group"].startswith("TypeError: ") and "ep_group must be a torch.distributed ProcessGroup" \
            in m["not_a_group"]
        assert "model.layers.0.mlp.experts is already swapped with all experts" in m["reshard"]
        assert "patch_model: ep_payload must be one of ('mxfp8', 'bf16'), got 'fp4'" in m["payload"]
