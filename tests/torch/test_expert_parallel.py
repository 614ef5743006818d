"""Expert parallelism (moe_swiglu_experts_mxfp8(..., ep_group=...)) on 2 and 4 gloo ranks against the single-process
op on the full weights, the global batch being the ranks' batches concatenated in rank order.

What is asserted (expert_parallel.py's module docstring says why):
    * payload "mxfp8": every result (y, dX, d_topk_weights, each rank's expert weight gradients) is bit-identical
      to the single-process op on Q(x) with output gradient Q(dY) (Q: MX round trip along H, 1x32), and within
      the MXFP8 error of the op on x and dY (errors printed);
    * payload "bf16": bit-identical to the single-process op on x and dY;
    * x already on the MX grid (scale rule rceil, where re-quantizing is provably the identity): the dY payload
      changes nothing but dW_down;
    * every backend and option of the op (recompute, e5m2, float32, the simulator backend);
    * adversarial routing (ranks receiving no rows, uneven batches, unused experts), a backward where only one
      rank needs dX, and bad input;
    * GPT-OSS's experts (gate_up and down biases, activation gpt_oss): bit-identical as above, each rank holding
      its experts' bias gradients.
"""
import pytest

torch = pytest.importorskip("torch")

from torchkit import rel  # noqa: E402

import numpy as np  # noqa: E402
from distkit import call_outcomes, run_ranks  # noqa: E402

from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8.mlp_bwd_mxfp8_emulate import (  # noqa: E402
    mx_dequantize_rows, mx_quantize_dequantize, mx_quantize_rows)
from nkilib.experimental.mlp_mxfp8.mlp_bwd_mxfp8.config import ClampLimits  # noqa: E402
from nkilib.experimental.moe_mxfp8 import moe_swiglu_experts_mxfp8  # noqa: E402
from nkilib.experimental.moe_mxfp8.expert_parallel import shard_experts  # noqa: E402
from nkilib.mx import quantize_mx  # noqa: E402

E, H, I = 8, 64, 64
GRADS = ("y", "dx", "dw", "dw_gu", "dw_down")


def _problem(tokens_per_rank, k=2, experts=tuple(range(E)), dtype=torch.bfloat16, seed=0):
    """Global batch (ranks' batches concatenated) with each token's k distinct experts drawn from `experts`."""
    g = torch.Generator().manual_seed(seed)
    t = sum(tokens_per_rank)
    pool = torch.tensor(experts)
    ids = torch.stack([pool[torch.randperm(len(experts), generator=g)[:k]] for _ in range(t)])
    return dict(x=torch.randn(t, H, generator=g).to(dtype), dy=torch.randn(t, H, generator=g).to(dtype), ids=ids,
                w=torch.rand(t, k, generator=g), w_gu=(torch.randn(E, 2 * I, H, generator=g) / 8).to(dtype),
                w_down=(torch.randn(E, H, I, generator=g) / 8).to(dtype))


def _q(v, **opts):
    """The payload's round trip Q: MX quantize-dequantize of bf16(v) along H in 1x32 groups, in v's dtype."""
    return mx_quantize_dequantize(v.to(torch.bfloat16), -1, quant_scheme="1x32", **opts).to(v.dtype)


BIAS_GRADS = {"gate_up_bias": "db_gu", "down_bias": "db_down"}


def _step(fn, x, ids, w, w_gu, w_down, dy, **kw):
    """One forward / backward; the biases among kw (gate_up_bias, down_bias) are leaves too (their gradients:
    db_gu, db_down)."""
    x, w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    w_gu, w_down = w_gu.clone().requires_grad_(True), w_down.clone().requires_grad_(True)
    biases = {n: kw.pop(n).clone().requires_grad_(True) for n in BIAS_GRADS if kw.get(n) is not None}
    y = fn(x, ids, w, w_gu, w_down, **biases, **kw)
    y.backward(dy)
    return dict(y=y.detach(), dx=x.grad, dw=w.grad, dw_gu=w_gu.grad, dw_down=w_down.grad,
                **{BIAS_GRADS[n]: b.grad for n, b in biases.items()})


def _rank_step(rank, world, problem, tokens_per_rank, payload, kw):
    import torch.distributed as dist

    lo = sum(tokens_per_rank[:rank])
    rows = slice(lo, lo + tokens_per_rank[rank])
    w_gu, w_down = shard_experts(problem["w_gu"], problem["w_down"], dist.group.WORLD)
    if "b_gu" in problem:  # the local experts' biases
        kw = dict(kw, **dict(zip(("gate_up_bias", "down_bias"), shard_experts(problem["b_gu"], problem["b_down"]))))
    args = [problem[n][rows] for n in ("x", "ids", "w")]
    return _step(moe_swiglu_experts_mxfp8, *args, w_gu, w_down, problem["dy"][rows], ep_group=dist.group.WORLD,
                 ep_payload=payload, **kw)


def _run(world, problem, tokens_per_rank, payload="mxfp8", **kw):
    """(per-rank results, the same gathered as the single-process op's: y / dx / dw concatenated, weight (and
    bias) gradients of the ranks' shards concatenated along experts)."""
    ranks = run_ranks(world, _rank_step, problem, tokens_per_rank, payload, kw, timeout=60)
    return ranks, {n: torch.cat([r[n] for r in ranks]) for n in ranks[0]}


def _full(problem, x=None, dy=None, **kw):
    p = problem
    biases = {"gate_up_bias": p["b_gu"], "down_bias": p["b_down"]} if "b_gu" in p else {}
    return _step(moe_swiglu_experts_mxfp8, p["x"] if x is None else x, p["ids"], p["w"], p["w_gu"], p["w_down"],
                 p["dy"] if dy is None else dy, **{"backend": "emulate", **biases, **kw})


def _assert_identical(got, want, names=GRADS):
    for n in names:
        assert got[n].dtype == want[n].dtype and torch.equal(got[n], want[n]), n


@pytest.mark.parametrize("world", [2, 4])
def test_mxfp8_payload_equals_single_process_on_quantized_inputs(world):
    tokens = [24] * world
    problem = _problem(tokens)
    ref_q = _full(problem, x=_q(problem["x"]), dy=_q(problem["dy"]))  # first: the forked ranks inherit its imports
    ref = _full(problem)
    ranks, got = _run(world, problem, tokens, backend="emulate")
    _assert_identical(got, ref_q)
    errors = {n: rel(got[n], ref[n]) for n in GRADS}
    print(f"ep={world}, mxfp8 payload vs the op on unquantized x, dY: " + ", ".join(f"{n} {v:.1e}" for n, v in
                                                                                   errors.items()))
    # measured 4.1e-2 .. 5.5e-2 (one e4m3 rounding of x and dY: 2**-4 / sqrt(3) = 3.6e-2 per value)
    assert all(0 < v < 8e-2 for v in errors.values()), errors
    n_local = E // world
    for r, out in enumerate(ranks):  # weight gradients stay local: rank r's are the slice of its experts
        assert out["dw_gu"].shape == (n_local, 2 * I, H)
        assert torch.equal(out["dw_down"], ref_q["dw_down"][r * n_local:(r + 1) * n_local])


@pytest.mark.parametrize("world", [2, 4])
def test_bf16_payload_is_bit_identical_to_single_process(world):
    tokens = [24] * world
    problem = _problem(tokens, seed=1)
    ref = _full(problem)
    _, got = _run(world, problem, tokens, payload="bf16", backend="emulate")
    _assert_identical(got, ref)


def test_dy_payload_changes_only_dw_down_when_x_is_on_the_mx_grid():
    # rceil: re-quantizing an MX-rounded row is the identity (proof in expert_parallel.py), and the op's MX
    # matmul over H quantizes dY in the payload's groups, so only dW_down (dY quantized along tokens) can differ.
    # It differs only where the two roundings use different grids: a value in the subnormal range of its H group
    # but not of its token group. An outlier (1000) in token 5's first H group puts that group's values below
    # 2**-4 (the 1e-3 next to it, and any small N(0, 1) draw) into its subnormal range (step 2**-7), while along
    # tokens their neighbours are O(1) (step ~2**-16): only dW_down[e, h, :] for e in token 5's experts, h < 32.
    problem = _problem([24, 24], seed=2)
    problem["x"] = _q(problem["x"], scale_rule="rceil")
    problem["dy"][5, 0], problem["dy"][5, 1] = 1000.0, 1e-3
    ref = _full(problem, scale_rule="rceil")
    _, got = _run(2, problem, [24, 24], backend="emulate", scale_rule="rceil")
    _assert_identical(got, ref, ("y", "dx", "dw", "dw_gu"))
    experts = problem["ids"][5].tolist()
    differ = (got["dw_down"] != ref["dw_down"]).nonzero().tolist()
    assert differ and {e for e, h, _ in differ} <= set(experts) and all(h < 32 for _, h, _ in differ)
    assert [1, 1] in [[h, 1] for _, h, _ in differ]  # the 1e-3 value's row
    print(f"dW_down entries that differ: {len(differ)} (rows h < 32 of experts {experts}), rel. error "
          f"{rel(got['dw_down'], ref['dw_down']):.1e}")


def test_options_and_leading_dimensions():
    # recompute path (checkpoint "none"), e5m2, float32 activations and parameters, x [B, S, H]
    problem = _problem([16, 16], dtype=torch.float32, seed=3)
    kw = dict(checkpoint="none", fp8_dtype="float8_e5m2", block_size=256, backend="emulate")
    ref = _full(problem, x=_q(problem["x"], fp8_dtype="float8_e5m2"), dy=_q(problem["dy"], fp8_dtype="float8_e5m2"),
                **kw)
    shaped = {n: (v.reshape(2, 16, -1) if n in ("x", "dy", "ids", "w") else v) for n, v in problem.items()}
    _, got = _run(2, shaped, [1, 1], **kw)  # rank r takes batch row r: [1, 16, H]
    got = {n: v.reshape(ref[n].shape) for n, v in got.items()}
    _assert_identical(got, ref)


def test_simulator_backend():
    # the local experts run the NKI kernel on the simulator; the single-process reference is the emulate backend,
    # bit-identical to the simulator (tests/torch/test_moe_simulator_backend.py) and seconds faster here
    problem = _problem([8, 8], seed=8)
    ref = _full(problem, x=_q(problem["x"]), dy=_q(problem["dy"]))
    _, got = _run(2, problem, [8, 8], backend="simulator")
    _assert_identical(got, ref)


def test_all_tokens_to_one_ranks_experts():
    # every token routed to the last rank's two experts: ranks 0..2 receive no rows (their experts get exact
    # zero gradients), rank 3 receives every rank's tokens
    tokens = [8, 24, 1, 12]
    problem = _problem(tokens, experts=(E - 2, E - 1), seed=4)
    ref = _full(problem, x=_q(problem["x"]), dy=_q(problem["dy"]))
    ranks, got = _run(4, problem, tokens, backend="emulate")
    _assert_identical(got, ref)
    for out in ranks[:3]:
        assert not out["dw_gu"].any() and not out["dw_down"].any()
    assert ranks[3]["dw_gu"].any() and ranks[3]["dw_down"].any()


def test_uneven_batches_and_unused_experts():
    # rank 0 has one token; experts 1 and 6 get none; rank 1 receives rows only from its own tokens' experts
    tokens = [1, 40]
    problem = _problem(tokens, k=3, experts=(0, 2, 3, 4, 5, 7), seed=5)
    ref = _full(problem, x=_q(problem["x"]), dy=_q(problem["dy"]))
    ranks, got = _run(2, problem, tokens, backend="emulate")
    _assert_identical(got, ref)
    assert not ranks[0]["dw_gu"][1].any() and not ranks[1]["dw_down"][2].any()  # experts 1 and 6


def _with_biases(problem, seed):
    """`problem` plus GPT-OSS-like biases b_gu [E, 2I] and b_down [E, H] (bf16, N(0, 0.2))."""
    g = torch.Generator().manual_seed(seed)
    return dict(problem, b_gu=(torch.randn(E, 2 * I, generator=g) * 0.2).to(torch.bfloat16),
                b_down=(torch.randn(E, H, generator=g) * 0.2).to(torch.bfloat16))


GPT_OSS = dict(clamp_limits=ClampLimits(non_linear_upper=7.0, linear_lower=-7.0, linear_upper=7.0,
                                        activation="gpt_oss"))


@pytest.mark.parametrize("payload,dtype", [("mxfp8", torch.bfloat16), ("bf16", torch.bfloat16),
                                           ("bf16", torch.float32)])
def test_biases_bias_gradients_stay_on_the_owning_rank(payload, dtype):
    # GPT-OSS's experts (activation gpt_oss, clamps, gate_up and down biases) on 2 ranks: every result, the bias
    # gradients of each rank's experts included, equals the single-process op bit for bit (on Q(x), Q(dY) for the
    # mxfp8 payload, on x, dY for the bf16 one, where float32 dY travels unrounded for the down bias's gradients)
    tokens = [24, 24]
    problem = _with_biases(_problem(tokens, dtype=dtype, seed=9), seed=10)
    if payload == "mxfp8":
        ref = _full(problem, x=_q(problem["x"]), dy=_q(problem["dy"]), **GPT_OSS)
    else:
        ref = _full(problem, **GPT_OSS)
    ranks, got = _run(2, problem, tokens, payload=payload, backend="emulate", **GPT_OSS)
    _assert_identical(got, ref, GRADS + ("db_gu", "db_down"))
    for r, out in enumerate(ranks):  # each rank holds its experts' bias gradients, [E/2, 2I] and [E/2, H]
        assert out["db_gu"].shape == (E // 2, 2 * I) and out["db_down"].shape == (E // 2, H)
        assert out["db_gu"].any() and out["db_down"].any()


def test_biases_with_a_rank_that_receives_no_rows():
    # every token to rank 1's experts: rank 0's experts, their biases included, get exact zero gradients
    tokens = [8, 16]
    problem = _with_biases(_problem(tokens, experts=(E - 2, E - 1), seed=11), seed=12)
    ref = _full(problem, x=_q(problem["x"]), dy=_q(problem["dy"]), **GPT_OSS)
    ranks, got = _run(2, problem, tokens, backend="emulate", **GPT_OSS)
    _assert_identical(got, ref, GRADS + ("db_gu", "db_down"))
    assert not ranks[0]["db_gu"].any() and not ranks[0]["db_down"].any()


def _rank_x_grad_on_rank_0_only(rank, world, problem):
    import torch.distributed as dist

    rows = slice(rank * 24, (rank + 1) * 24)
    w_gu, w_down = (t.clone().requires_grad_(True) for t in shard_experts(problem["w_gu"], problem["w_down"]))
    x = problem["x"][rows].clone().requires_grad_(rank == 0)  # topk_weights without gradient on both ranks
    y = moe_swiglu_experts_mxfp8(x, problem["ids"][rows], problem["w"][rows], w_gu, w_down, ep_group=dist.group.WORLD)
    y.backward(problem["dy"][rows])
    return dict(dx=x.grad, dw_gu=w_gu.grad, dw_down=w_down.grad)


def test_backward_in_step_when_only_some_ranks_need_dx():
    # rank 1 needs no input gradient: its dispatch backward still runs (the experts train), so rank 0 gets dX
    problem = _problem([24, 24], seed=7)
    ref = _full(problem, x=_q(problem["x"]), dy=_q(problem["dy"]))
    ranks = run_ranks(2, _rank_x_grad_on_rank_0_only, problem, timeout=60)
    assert torch.equal(ranks[0]["dx"], ref["dx"][:24]) and ranks[1]["dx"] is None
    assert torch.equal(torch.cat([r["dw_gu"] for r in ranks]), ref["dw_gu"])
    assert torch.equal(torch.cat([r["dw_down"] for r in ranks]), ref["dw_down"])


def test_row_quantizer_matches_nkilib_mx():
    g = torch.Generator().manual_seed(6)
    x = (torch.randn(6, 128, generator=g) * torch.logspace(-30, 30, 128)).to(torch.bfloat16)
    x[0, :32] = 0  # all-zero group
    x[1, 5] = float("nan")  # NaN group
    x[2, 70] = float("-inf")  # Inf group
    x[3, 96:] = torch.tensor(3.0e38).to(torch.bfloat16)  # near the bf16 maximum: codes round up to 2**128
    finite_groups = torch.ones(6, 4, dtype=torch.bool)
    finite_groups[1, 0] = finite_groups[2, 2] = False
    for fmt in ("float8_e4m3fn", "float8_e5m2"):
        for rule in ("neuron", "rceil", "ocp_floor"):
            codes, scales = mx_quantize_rows(x, fmt, rule)
            want = quantize_mx(x.float().numpy(), -1, fmt, rule, "1x32")
            np.testing.assert_array_equal(scales.numpy(), want.scales)
            finite = finite_groups.repeat_interleave(32, dim=1).numpy()
            np.testing.assert_array_equal(codes.view(torch.uint8).numpy()[finite], want.codes[finite])
            back = mx_dequantize_rows(codes, scales, torch.float64)
            assert torch.equal(back.isnan(), ~finite_groups.repeat_interleave(32, dim=1))
            assert torch.equal(back.nan_to_num(), mx_quantize_dequantize(x, -1, fmt, "1x32", rule,
                                                                         dtype=torch.float64).nan_to_num())
    with pytest.raises(ValueError, match=r"last axis must be a positive multiple of 32, got shape \(2, 48\)"):
        mx_quantize_rows(torch.zeros(2, 48))
    with pytest.raises(ValueError, match=r"scales must be uint8 \[\.\.\., K/32\] = \(2, 2\)"):
        mx_dequantize_rows(*mx_quantize_rows(torch.zeros(2, 64))[:1], torch.zeros(2, 3, dtype=torch.uint8))


def _bad_calls(rank, world):
    import torch.distributed as dist

    p = _problem([4] * world)
    w_gu, w_down = shard_experts(p["w_gu"], p["w_down"], dist.group.WORLD)
    x, ids, w = p["x"][:4], p["ids"][:4], p["w"][:4]
    calls = {
        "indivisible": lambda: shard_experts(p["w_gu"][:3], p["w_down"][:3], dist.group.WORLD),
        "group": lambda: moe_swiglu_experts_mxfp8(x, ids, w, w_gu, w_down, ep_group=1),
        "payload": lambda: moe_swiglu_experts_mxfp8(x, ids, w, w_gu, w_down, ep_group=dist.group.WORLD,
                                                    ep_payload="fp4"),
        "id_range": lambda: moe_swiglu_experts_mxfp8(x, ids + E // 2, w, w_gu, w_down, ep_group=dist.group.WORLD),
        "k": lambda: moe_swiglu_experts_mxfp8(x, torch.zeros(4, E + 1, dtype=torch.int64), torch.ones(4, E + 1),
                                              w_gu, w_down, ep_group=dist.group.WORLD),
        # rank 1 passes one local expert, rank 0 four: caught by the peers' all_gather on every rank
        "peers": lambda: moe_swiglu_experts_mxfp8(x, torch.tensor([[0, 1]] * 4), w, w_gu[:E // world - rank],
                                                  w_down[:E // world - rank], ep_group=dist.group.WORLD),
    }
    return call_outcomes(calls)


def test_bad_input_errors():
    with pytest.raises(RuntimeError, match="ep_group needs an initialised torch.distributed process group"):
        moe_swiglu_experts_mxfp8(torch.zeros(2, H), torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, 1),
                                 torch.zeros(1, 2 * I, H), torch.zeros(1, H, I), ep_group=object())
    messages = run_ranks(2, _bad_calls, timeout=60)
    for m in messages:
        assert "E=3 (gate_up_weight.shape[0]) must be divisible by the ep_group size 2" in m["indivisible"]
        assert m["group"].startswith("TypeError: ") and "ep_group must be a torch.distributed ProcessGroup" in \
            m["group"] and "got int" in m["group"]
        assert "ep_payload must be one of ('mxfp8', 'bf16'), got 'fp4'" in m["payload"]
        assert "expert ids must be in [0, 8) (num_experts=8)" in m["id_range"]  # global ids, E = ep * E/ep
        assert "k=9 experts per token but there are E=8 experts" in m["k"]
        assert ("every rank must pass the same local experts E/ep (gate_up_weight.shape[0]), got [4, 3]"
                in m["peers"])


def _module_rank(rank, world):
    """MoESwiGLUExperts(ep_group=WORLD) on this rank vs the op with ep_group on the same local weights; its
    parameters are the local shard; the construction errors."""
    import torch.distributed as dist

    from nkilib.experimental.moe_mxfp8 import MoESwiGLUExperts

    p = _problem([4] * world, seed=3)
    rows = slice(4 * rank, 4 * rank + 4)
    torch.manual_seed(0)
    module = MoESwiGLUExperts(E, H, I, ep_group=dist.group.WORLD, dtype=torch.bfloat16)
    shapes = (tuple(module.gate_up_weight.shape), tuple(module.down_weight.shape), module.expert_offset)
    w_gu, w_down = shard_experts(p["w_gu"], p["w_down"], dist.group.WORLD)
    with torch.no_grad():
        module.gate_up_weight.copy_(w_gu)
        module.down_weight.copy_(w_down)
    x = p["x"][rows].clone().requires_grad_(True)
    w = p["w"][rows].clone().requires_grad_(True)
    y = module(x, p["ids"][rows], w)
    y.backward(p["dy"][rows])
    got = dict(y=y.detach(), dx=x.grad, dw=w.grad, dw_gu=module.gate_up_weight.grad, dw_down=module.down_weight.grad)
    want = _step(moe_swiglu_experts_mxfp8, p["x"][rows], p["ids"][rows], p["w"][rows], w_gu, w_down,
                 p["dy"][rows], ep_group=dist.group.WORLD)
    equal = {n: torch.equal(got[n], want[n]) for n in GRADS}
    # the module's ep_payload / ep_capacity reach the op: equal to the op called with them
    torch.manual_seed(0)
    padded = MoESwiGLUExperts(E, H, I, ep_group=dist.group.WORLD, ep_payload="bf16", ep_capacity=8,
                              dtype=torch.bfloat16)
    padded.load_state_dict(module.state_dict())
    y_padded = padded(p["x"][rows], p["ids"][rows], p["w"][rows])
    y_op = moe_swiglu_experts_mxfp8(p["x"][rows], p["ids"][rows], p["w"][rows], w_gu, w_down,
                                    ep_group=dist.group.WORLD, ep_payload="bf16", ep_capacity="exact")
    equal["padded_bf16"] = torch.equal(y_padded, y_op) and not torch.equal(y_padded, got["y"])
    biased = MoESwiGLUExperts(E, H, I, bias=True, ep_group=dist.group.WORLD)
    bias_shapes = {n: tuple(v.shape) for n, v in biased.state_dict().items()}
    try:
        MoESwiGLUExperts(E + 1, H, I, ep_group=dist.group.WORLD)
        error = "accepted"
    except ValueError as exc:
        error = str(exc)
    return shapes, equal, bias_shapes, error


def test_module_with_ep_group_holds_the_local_shard_and_equals_the_op():
    for rank, (shapes, equal, bias_shapes, error) in enumerate(run_ranks(2, _module_rank, timeout=60)):
        assert shapes == ((E // 2, 2 * I, H), (E // 2, H, I), rank * E // 2)
        assert equal == {n: True for n in GRADS + ("padded_bf16",)}
        assert bias_shapes == {"gate_up_weight": (E // 2, 2 * I, H), "down_weight": (E // 2, H, I),
                               "gate_up_bias": (E // 2, 2 * I), "down_bias": (E // 2, H)}
        assert "E=9 (num_experts) must be divisible by the ep_group size 2" in error


# ----------------------------------------------------------------------------------------------
# ep_capacity: padded, equal-split all-to-alls (what PyTorch/XLA's "xla" process group accepts)
# ----------------------------------------------------------------------------------------------


def _rank_capacities(rank, world, problem, tokens_per_rank, capacities, too_small, kw):
    """_rank_step once per ep_capacity, recording the split arguments of every all_to_all_single; then
    ep_capacity=too_small, whose error message is returned."""
    import torch.distributed as dist

    from nkilib.experimental.moe_mxfp8 import expert_parallel

    calls, real = [], dist.all_to_all_single

    def recording(out, inp, out_splits=None, in_splits=None, **k):
        calls.append((out_splits, in_splits, tuple(out.shape)))
        return real(out, inp, out_splits, in_splits, **k)

    results = {}
    expert_parallel.dist.all_to_all_single = recording
    try:
        for cap in capacities:
            calls.clear()
            results[cap] = (_rank_step(rank, world, problem, tokens_per_rank, "mxfp8", dict(kw, ep_capacity=cap)),
                            list(calls))
    finally:
        expert_parallel.dist.all_to_all_single = real
    try:
        _rank_step(rank, world, problem, tokens_per_rank, "mxfp8", dict(kw, ep_capacity=too_small))
        error = "accepted"
    except ValueError as exc:
        error = str(exc)
    return results, error


def _pair_rows_max(problem, tokens_per_rank, world):
    """The largest number of routed pairs one rank sends to one rank (from the global routing)."""
    dest = problem["ids"] // (E // world)
    lo = np.cumsum([0] + list(tokens_per_rank))
    return max(int((dest[lo[r]:lo[r + 1]] == d).sum()) for r in range(world) for d in range(world))


@pytest.mark.parametrize("world,tokens,experts", [(2, [24, 24], tuple(range(E))),
                                                  (4, [8, 24, 1, 12], (E - 3, E - 2, E - 1))])
def test_padded_capacity_is_bit_identical_to_exact_splits(world, tokens, experts):
    # 4 ranks: every token to the last two ranks' experts, so ranks 0 and 1 receive only padding
    problem = _problem(tokens, experts=experts, seed=13)
    m = _pair_rows_max(problem, tokens, world)
    caps = ("exact", m, "auto", 4 * m)
    out = run_ranks(world, _rank_capacities, problem, tokens, caps, m - 1, dict(backend="emulate"), timeout=90)
    auto = 1 << (m - 1).bit_length()
    for rank, (results, error) in enumerate(out):
        exact, exact_calls = results["exact"]
        assert any(c[0] is not None for c in exact_calls)  # the exact path does pass split lists
        for cap, padded_rows in ((m, m), ("auto", auto), (4 * m, 4 * m)):
            got, calls = results[cap]
            _assert_identical(got, exact)
            # 1 counts + 2 forward + 2 backward exchanges, all equal splits; payloads [ep * C, row bytes]
            assert len(calls) == 5 and all(c[0] is None and c[1] is None for c in calls), calls
            assert [c[2][0] for c in calls[1:]] == [world * padded_rows] * 4, (cap, calls)
        assert f"ep_capacity={m - 1} rows per (source, destination) rank pair is too small" in error, error
        assert f"routes {m} pairs (token, expert) to one rank's experts" in error
    if world == 4:
        assert not out[0][0]["auto"][0]["dw_gu"].any()  # rank 0 received only padding: zero gradients


def test_padded_capacity_with_biases_and_bf16_payload():
    # GPT-OSS's experts and both biases, ep_payload "bf16": the padded exchange equals the single-process op
    tokens = [16, 16]
    problem = _with_biases(_problem(tokens, seed=14), seed=15)
    ref = _full(problem, **GPT_OSS)
    _, got = _run(2, problem, tokens, payload="bf16", backend="emulate", ep_capacity="auto", **GPT_OSS)
    _assert_identical(got, ref, GRADS + ("db_gu", "db_down"))


class _StubGroup(torch.distributed.ProcessGroup):
    """A process group object that torch.distributed never registered (as a backend's own class would be),
    naming its backend."""

    def __init__(self, backend):
        super().__init__(0, 2)
        self._backend = backend

    def getBackendName(self):
        return self._backend


def test_default_capacity_by_backend_and_option_errors():
    from nkilib.experimental.moe_mxfp8.expert_parallel import check_ep_options, default_capacity

    assert default_capacity(_StubGroup("xla")) == "auto"  # PyTorch/XLA: equal splits only
    assert default_capacity(_StubGroup("gloo")) == "exact" and default_capacity(_StubGroup("nccl")) == "exact"
    for bad in (0, -3, 2.5, True, "padded"):
        with pytest.raises(ValueError, match=r"ep_capacity must be None, one of \('exact', 'auto'\) or a positive "
                                             rf"int .*got {bad!r}"):
            check_ep_options(_StubGroup("gloo"), "mxfp8", bad, "f")
    from nkilib.experimental.moe_mxfp8 import MoESwiGLUExperts

    with pytest.raises(ValueError, match=r"MoESwiGLUExperts: ep_capacity must be None, .* got 'big'"):
        MoESwiGLUExperts(E, H, I, ep_capacity="big")
    with pytest.raises(ValueError, match="MoESwiGLUExperts: ep_payload / ep_capacity need an ep_group .* "
                                         "ep_payload='bf16'"):
        MoESwiGLUExperts(E, H, I, ep_payload="bf16")
    with pytest.raises(ValueError, match="ep_payload / ep_capacity need an ep_group .* ep_capacity=8"):
        moe_swiglu_experts_mxfp8(torch.zeros(2, H), torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, 1),
                                 torch.zeros(1, 2 * I, H), torch.zeros(1, H, I), ep_capacity=8)


def _rank_default_on_an_xla_like_backend(rank, world, problem):
    """ep_capacity=None with the rank's gloo group listed as an equal-split backend (as "xla" is): every
    all_to_all_single gets equal splits; and the world group's own default."""
    import torch.distributed as dist

    from nkilib.experimental.moe_mxfp8 import expert_parallel

    own_default = expert_parallel.default_capacity(dist.group.WORLD)
    calls, real = [], dist.all_to_all_single
    expert_parallel.EQUAL_SPLIT_BACKENDS = ("gloo",)
    expert_parallel.dist.all_to_all_single = lambda out, inp, o=None, i=None, **k: (calls.append((o, i)),
                                                                                    real(out, inp, o, i, **k))[1]
    try:
        got = _rank_step(rank, world, problem, [24, 24], "mxfp8", dict(backend="emulate"))
    finally:
        expert_parallel.dist.all_to_all_single = real
    return own_default, calls, got


def test_default_capacity_is_padded_on_an_equal_split_backend():
    problem = _problem([24, 24], seed=16)
    ref = _full(problem, x=_q(problem["x"]), dy=_q(problem["dy"]))
    out = run_ranks(2, _rank_default_on_an_xla_like_backend, problem, timeout=60)
    for own_default, calls, _ in out:
        assert own_default == "exact"  # gloo keeps per-rank splits by default
        assert len(calls) == 5 and all(o is None and i is None for o, i in calls)
    _assert_identical({n: torch.cat([r[2][n] for r in out]) for n in GRADS}, ref)
