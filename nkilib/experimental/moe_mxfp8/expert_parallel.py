"""Expert parallelism for ``moe_swiglu_experts_mxfp8(..., ep_group=group)``: MXFP8 all-to-all dispatch / combine.

Layout: the group's ep ranks shard the E experts in contiguous ranges (ep divides E): rank r holds experts
r*E/ep .. (r+1)*E/ep - 1 as gate_up_weight [E/ep, 2I, H] and down_weight [E/ep, H, I] (``shard_experts``
cuts them from full weights). Every rank has its own tokens x [T_r, H] and their routing
topk_ids / topk_weights [T_r, k] with global expert ids. Following torchao's MXFP8 expert-parallel pipeline
(https://github.com/pytorch/ao/blob/main/torchao/prototype/moe_training/ep/README.md):

Forward, on `group`:
    1. counts: every rank counts its routed pairs (t, j) per (destination rank, local expert) and exchanges the
       [ep, E/ep] counts with one all_to_all_single; the row splits of the payload all-to-alls come from them
       (or, padded, which rows of each rank's capacity are real: "Split modes" below).
    2. dispatch: x rows are MX-quantized along H in OCP 1x32 groups (nkilib's torch quantizer,
       ``mx_quantize_rows``: the op's fp8_dtype and scale_rule), once per token; one row per routed pair, sorted
       by global expert then token, goes to the expert's rank as bytes [H fp8 codes | H/32 E8M0 scales |
       the pair's routing weight as 4 fp32 bytes] in one all-to-all.
    3. the local experts: the op itself (``moe_swiglu_experts_mxfp8`` without a group) on the received rows,
       each a token with k = 1 (its local expert, its routing weight); received rows are ordered by source
       rank, then local expert, then token.
    4. combine: each row's weighted expert output (bf16: the op's bf16 down projection, sent exactly) returns
       by the inverse all-to-all; the source adds a token's k rows in fp32 in ascending expert order, as the
       op's y accumulator does, and rounds once to x's dtype.
Biases (GPT-OSS; the op's gate_up_bias / down_bias, here the local experts' [E/ep, 2I] / [E/ep, H]): gate_up_bias goes
into the local op (step 3), which returns its gradient; down_bias: each received row's p * down_bias[e] (float32) is
appended to the row's expert output in the combine's all-to-all, and the source adds a token's k terms as the op does
(an fp32 sum over its slots, added to the rounded y, one more rounding). Their gradients stay on the experts' rank:
d_down_bias[e] = sum over e's rows of p * dY (dY as decoded there), and <dY, down_bias[e]> joins the routing-weight
gradient that returns to the token's rank.
Backward (autograd), the mirror:
    combine's backward: dY rows are MX-quantized along H (1x32, once per token) and sent to the experts as
    codes + scales; the local op's backward runs there; dispatch's backward returns each row's dX part (bf16,
    exact) and its routing-weight gradient (fp32, exact) to the token's rank, which folds a token's dX parts
    in ascending expert order with the op's bf16 read-modify-write. Expert weight gradients stay local.

Numerics (Q(v) = MX quantize-dequantize of bf16(v) along H in 1x32 groups with the op's fp8_dtype and
scale_rule, i.e. ``mx_quantize_dequantize(v.bfloat16(), -1, fp8_dtype, "1x32", scale_rule)``):
    * exact contract: with the global batch the concatenation of the ranks' batches in rank order, every result
      (y, dX, d_topk_weights, each rank's expert weight and bias gradients) equals, bit for bit, the single-process op
      on the full weights applied to Q(x) with output gradient Q(dY), for every option, backend and checkpoint
      policy. Why: each expert sees the same rows in the same order (ascending global token) as in the
      single-process op, so its per-expert math is the same; the op's per-token sums (y in fp32, dX as bf16
      read-modify-writes) run in ascending expert order in both; what travels unquantized (expert outputs and
      dX parts in bf16, routing weights and their gradients in fp32) is already in that precision.
    * against the single-process op on x and dY themselves. Re-quantizing an MX-rounded row with the same groups and
      rule gives it back (rules rceil and ocp_floor: always, as the group's amax stays in the same binade or its
      scale halves, which doubles the codes exactly; rule neuron: except in groups whose amax rounds up to the next
      power of two, doubling the scale, and that hold a code on the finest subnormal step, measured: 1.7e-4 of e4m3
      groups of heavy-tailed random data, none of the same data in e5m2). So where the op quantizes the same rows
      along H in the same groups, the payload's rounding changes nothing. dY enters the backward through dI = mm(dY,
      W_down), an MX matmul over H: with matmul_precision="mxfp8" and quant_scheme="1x32" it quantizes dY in Q's
      groups, so dX, d_topk_weights and dW_gate_up are unchanged by the dY payload (tested, x on the grid); and
      through dW_down = mm(dY^T, hs), MX-quantized along tokens: fp8 elements are floating point, so both roundings
      keep a value's same 4 significant bits (e4m3) unless it lies in the subnormal range of one of its two groups
      (below ~2**-14 (e4m3) / ~2**-29 (e5m2) of that group's amax, e.g. next to an outlier): dW_down differs only
      there (tested with an outlier: 3e-6 relative). x is used by the op's BF16 forward, so Q(x) puts one MX
      rounding of x (relative 2**-4 / sqrt(3) per value for e4m3) into y and, through the forward's activations,
      into every gradient: 4-6e-2 relative on random data at ep 2 and 4 (measured in
      tests/torch/test_expert_parallel.py). Unchanged only for x already on the MX grid along H. ``ep_payload="bf16"``
      sends x and dY in bf16 instead (2x the bytes); then every result equals the single-process op on x and dY bit
      for bit (tested).

Split modes (``ep_capacity``; the counts exchange always has equal splits):
    * "exact": each payload all_to_all_single passes per-rank split lists (host lists read from the counts): each
      rank sends exactly its routed rows.
    * padded, an int C: every rank sends C rows to every rank: the rows routed to that rank (send order), then zero
      rows. Every payload all_to_all_single then has equal splits and the shape [ep * C, row bytes], fixed for a
      fixed C; the receiver keeps the real rows of each source's C (known from the exchanged counts) before the
      local experts, and the backward's exchanges scatter / gather through the same slots. The experts see the same
      rows in the same order as with "exact", so results are bit-identical (tested on 2 and 4 ranks). Overflow: a
      rank that routes more than C pairs to one rank raises a ValueError on every rank (the per-rank maxima travel
      in the peers all_gather, before any payload moves), naming C and the count; nothing is dropped (dropping, as
      training frameworks do with a capacity factor, is not built). Cost: ep * C rows per exchange instead of N.
    * "auto": padded with C = the smallest power of two >= the call's largest (source, destination) row count (from
      the same all_gather): never overflows; a few distinct shapes over a run.
    * None (default): "auto" on a process group whose backend is "xla" (EQUAL_SPLIT_BACKENDS), else "exact".
What still reads the host in the padded modes: the peers table (capacity, overflow), the routing's value checks
(the op's, as without a group) and the receiver's real-row indices (a dynamic [R] shape): the payload collectives
are static, the call as a whole is not one traced graph.

Constraints: every rank of the group calls with the same E/ep, H, I, ep_payload, fp8 format and ep_capacity (checked:
one all_gather of those, an error on every rank naming the mismatch); the ranks' backward passes must all run or all
not (each has two all-to-alls): the dispatch's backward runs wherever the experts, x or topk_weights need gradients,
so experts that train on every rank (or are frozen on every rank, with x and topk_weights alike) keep them in step. The
counts are read on the host once per forward (split lists or the peers table), so this path does not trace under
torch.compile. Neuron: untested (no device here). PyTorch/XLA's "xla" process group refuses split sizes in
all_to_all_single (https://github.com/pytorch/xla/blob/master/torch_xla/distributed/xla_backend.py,
ProcessGroupXla.alltoall_base), so there ep_capacity defaults to "auto" (equal splits; pass an int for one buffer
shape); that alltoall_base splits over the world size (xr.world_size()), not the group's, so ep_group must span every
process on that backend (read from its source, not run). Whether TorchNeuron's process group takes split sizes is
not known here ("exact" is its default; pass ep_capacity to pad).

Dimensions:
    T: this rank's tokens, k: experts per token, N = T*k: its routed pairs, R: pairs its experts receive,
    H: hidden, I: intermediate, E: experts, ep: group size, E/ep: local experts.
"""
from __future__ import annotations

import dataclasses
import inspect

import torch
import torch.distributed as dist
from torch import Tensor

from ..emulate_numerics import FP8_DTYPES, mx_dequantize_rows, mx_quantize_rows
from ..mlp_mxfp8.mlp_bwd_mxfp8.constants import MX_GROUP
from ..torch_common import check_numeric_options, resolve_checkpoint_policy, weight_grad_name
from . import moe_bwd_mxfp8_torch as moe_op
from . import routing

__all__ = ["PAYLOADS", "CAPACITY_MODES", "shard_experts", "moe_swiglu_experts_expert_parallel",
           "check_ep_options", "default_capacity"]

#: ep_payload= values: "mxfp8" (x and dY rows as fp8 codes + E8M0 scales) or "bf16" (bit-exact reference path).
PAYLOADS = ("mxfp8", "bf16")
#: ep_capacity= values besides a positive int (rows per (source, destination) rank pair) and None (by backend):
#: "exact" (per-rank split lists) and "auto" (equal splits, the smallest power of two that fits this call).
CAPACITY_MODES = ("exact", "auto")
#: process-group backends whose all_to_all_single refuses split sizes: ep_capacity=None means "auto" there
EQUAL_SPLIT_BACKENDS = ("xla",)
_FP8_NAMES = tuple(FP8_DTYPES)
#: the op's keyword options and their defaults (one source of truth: the op's signature)
_OP_OPTIONS = {n: p.default for n, p in inspect.signature(moe_op.moe_swiglu_experts_mxfp8).parameters.items()
               if p.kind is p.KEYWORD_ONLY and n not in ("ep_group", "ep_payload", "ep_capacity", "gate_up_bias",
                                                         "down_bias")}
# torch >= 2.10 names the tensor all-gather all_gather_single; older releases all_gather_into_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _group_size(group, what: str) -> tuple:
    """(rank in group, group size), or a clear error when `group` is not a usable process group."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{what}: ep_group needs an initialised torch.distributed process group "
                           f"(dist.init_process_group), got ep_group={group!r} with none initialised")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{what}: ep_group must be a torch.distributed ProcessGroup (e.g. dist.group.WORLD or "
                        f"dist.new_group(...)), got {type(group).__name__}")
    return dist.get_rank(group), dist.get_world_size(group)


def check_ep_options(ep_group, ep_payload, ep_capacity, what: str) -> None:
    """The one validation of the expert-parallel options (the op, ``MoESwiGLUExperts`` and ``patch_model`` call it).

    Raises:
        ValueError: ep_payload not in PAYLOADS, ep_capacity neither None, "exact", "auto" nor a positive int, or
            either given a non-default value without an ep_group (each names the argument, the accepted values and
            the value received).
    """
    if ep_payload not in PAYLOADS:
        raise ValueError(f"{what}: ep_payload must be one of {PAYLOADS}, got {ep_payload!r}")
    if not (ep_capacity is None or ep_capacity in CAPACITY_MODES or
            (isinstance(ep_capacity, int) and not isinstance(ep_capacity, bool) and ep_capacity > 0)):
        raise ValueError(f"{what}: ep_capacity must be None, one of {CAPACITY_MODES} or a positive int (rows per "
                         f"(source, destination) rank pair), got {ep_capacity!r}")
    if ep_group is None and (ep_payload != "mxfp8" or ep_capacity is not None):
        raise ValueError(f"{what}: ep_payload / ep_capacity need an ep_group (they set how tokens travel between the "
                         f"expert-parallel ranks), got ep_group=None with ep_payload={ep_payload!r}, "
                         f"ep_capacity={ep_capacity!r}")


def _backend_name(group) -> str:
    """The backend of `group`: torch.distributed's record of it, else the group's own name() (a group created
    outside init_process_group / new_group)."""
    try:
        return str(dist.get_backend(group))
    except (ValueError, RuntimeError):
        return str(group.name())


def default_capacity(group) -> str:
    """What ep_capacity=None means on `group`: "auto" (padded, equal splits) on a backend in EQUAL_SPLIT_BACKENDS
    (PyTorch/XLA's "xla" process group, whose all_to_all_single refuses split sizes), else "exact"."""
    return "auto" if _backend_name(group) in EQUAL_SPLIT_BACKENDS else "exact"


def local_expert_range(num_experts: int, group, what: str, source: str = "num_experts") -> tuple:
    """(first global expert id, number of local experts) of this rank for E = num_experts over `group`.

    Raises:
        ValueError: E not divisible by the group size (names both).
    """
    rank, world = _group_size(group, what)
    if num_experts % world:
        raise ValueError(f"{what}: the number of experts E={num_experts} ({source}) must be divisible by the "
                         f"ep_group size {world}")
    n = num_experts // world
    return rank * n, n


def shard_experts(gate_up_weight: Tensor, down_weight: Tensor, group=None) -> tuple:
    """This rank's experts of full weights: views [E/ep, 2I, H] and [E/ep, H, I] (rank r: experts r*E/ep ..).

    Args:
        gate_up_weight: [E, 2I, H], the same on every rank.
        down_weight: [E, H, I].
        group: the expert-parallel process group (None: the default group).

    Raises:
        ValueError: E not divisible by the group size, or the two weights disagree on E.
    """
    group = dist.group.WORLD if group is None else group
    e = gate_up_weight.shape[0]
    if down_weight.shape[0] != e:
        raise ValueError(f"shard_experts: gate_up_weight and down_weight must have the same number of experts E, "
                         f"got {e} and {down_weight.shape[0]}")
    lo, n = local_expert_range(e, group, "shard_experts", "gate_up_weight.shape[0]")
    return gate_up_weight[lo:lo + n], down_weight[lo:lo + n]


# ----------------------------------------------------------------------------------------------
# payload rows: byte rows [N, C] uint8 (one collective per exchange, no e8m0 / fp8 dtype on the wire)
# ----------------------------------------------------------------------------------------------


def _as_bytes(t: Tensor) -> Tensor:
    """[N, c] of any dtype -> [N, c * itemsize] uint8 (a view of a contiguous copy)."""
    return t.contiguous().view(torch.uint8)


def _columns(buf: Tensor, start: int, stop=None) -> Tensor:
    """buf[..., start:stop] in fresh contiguous storage: a dtype view needs an aligned storage offset, which a
    contiguous slice (0 or 1 rows) need not have."""
    return buf[..., start:stop].clone(memory_format=torch.contiguous_format)


#: the internal wire format of exact float32 dY rows (payload "bf16" with a down bias and float32 dY, _Combine)
_F32_ROWS = "float32"


def _row_bytes(h: int, payload: str) -> int:
    """Bytes of one encoded activation row of H values."""
    return h + h // MX_GROUP if payload == "mxfp8" else (4 if payload == _F32_ROWS else 2) * h


def _encode_rows(rows: Tensor, payload: str, fp8: str, scale_rule: str) -> Tensor:
    """[N, H] -> [N, _row_bytes] uint8: bf16(rows) as fp8 codes | E8M0 scales (mxfp8), or as bf16 (float32) bytes."""
    if payload == _F32_ROWS:
        return _as_bytes(rows.to(torch.float32))
    rows = rows.to(torch.bfloat16)
    if payload == "bf16":
        return _as_bytes(rows)
    codes, scales = mx_quantize_rows(rows, fp8, scale_rule)
    return torch.cat([codes.view(torch.uint8), scales], dim=1)


def _decode_rows(buf: Tensor, h: int, payload: str, fp8: str) -> Tensor:
    """_encode_rows' inverse -> [N, H] bf16 (mxfp8: bf16 of the exact float32 dequantized values; float32 rows as
    float32)."""
    if payload == _F32_ROWS:
        return _columns(buf, 0, 4 * h).view(torch.float32)
    if payload == "bf16":
        return _columns(buf, 0, 2 * h).view(torch.bfloat16)
    codes = _columns(buf, 0, h).view(FP8_DTYPES[fp8])
    scales = _columns(buf, h, h + h // MX_GROUP)
    return mx_dequantize_rows(codes, scales, torch.float32).to(torch.bfloat16)


def _all_to_all(buf: Tensor, out_splits, in_splits, group) -> Tensor:
    """all_to_all_single of byte rows: in_splits rows to each rank, out_splits rows from each rank (None: equal
    splits, out the shape of buf)."""
    out = buf.new_empty((buf.shape[0] if out_splits is None else sum(out_splits), buf.shape[1]))
    dist.all_to_all_single(out, buf.contiguous(), out_splits, in_splits, group=group)
    return out


# ----------------------------------------------------------------------------------------------
# routing plan: counts exchanged first
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Plan:
    """One call's routing on this rank.

    Attributes:
        order: [N] routed pairs (flat t*k + j) sorted by global expert, then token: the send order.
        local_ids: [R] local expert of each received row.
        expert_order: [T, k] a token's j in ascending expert order (the op's per-token summation order).
        num_tokens, top_k, hidden: T, k, H.
        group: the process group.
        capacity: None (exact splits) or C, the rows per (source, destination) rank pair of the padded exchanges.
        token_splits: exact: rows this rank's tokens send to each rank ([ep] host list); padded: None.
        expert_splits: exact: rows this rank's experts receive from each rank ([ep] host list); padded: None.
        send_slots: padded: [N] row of each sent pair (send order) in the [ep * C] send buffer; exact: None.
        recv_slots: padded: [R] row of each received row in the [ep * C] receive buffer; exact: None.
    """

    order: Tensor
    local_ids: Tensor
    expert_order: Tensor
    num_tokens: int
    top_k: int
    hidden: int
    group: object
    capacity: object = None
    token_splits: object = None
    expert_splits: object = None
    send_slots: object = None
    recv_slots: object = None

    def _padded_exchange(self, rows: Tensor, slots: Tensor, out_slots: Tensor) -> Tensor:
        """rows into `slots` of a zero [ep * C, c] buffer -> equal-split all_to_all_single -> rows `out_slots`."""
        world = dist.get_world_size(self.group)
        buf = rows.new_zeros((world * self.capacity, rows.shape[1]))
        buf[slots] = rows
        return _all_to_all(buf, None, None, self.group)[out_slots]

    def to_experts(self, rows: Tensor) -> Tensor:
        """[N, c] rows in send order -> [R, c] rows received by this rank's experts (source, expert, token order)."""
        if self.capacity is None:
            return _all_to_all(rows, self.expert_splits, self.token_splits, self.group)
        return self._padded_exchange(rows, self.send_slots, self.recv_slots)

    def to_tokens(self, rows: Tensor) -> Tensor:
        """to_experts' inverse: [R, c] rows of this rank's experts -> [N, c] rows in send order."""
        if self.capacity is None:
            return _all_to_all(rows, self.token_splits, self.expert_splits, self.group)
        return self._padded_exchange(rows, self.recv_slots, self.send_slots)

    def to_slots(self, rows: Tensor) -> Tensor:
        """Rows in send order [N, C] -> [T, k, C] in (token, j) order."""
        out = torch.empty_like(rows)
        out[self.order] = rows
        return out.reshape(self.num_tokens, self.top_k, -1)

    def by_expert(self, slots: Tensor, j: int) -> Tensor:
        """[T, C]: for every token, its j-th row in ascending expert order."""
        return slots[torch.arange(self.num_tokens, device=slots.device), self.expert_order[:, j]]


def _slots(counts: Tensor, capacity: int) -> Tensor:
    """[sum(counts)] rows of consecutive runs: run r (counts[r] rows) at r * capacity, r * capacity + 1, ..."""
    rank = torch.repeat_interleave(torch.arange(len(counts), device=counts.device), counts)
    first = torch.cumsum(counts, 0) - counts  # index of each run's first row
    return rank * capacity + torch.arange(len(rank), device=counts.device) - first[rank]


def _exchange_counts(ids: Tensor, sent: Tensor, local_experts: int, hidden: int, group, capacity) -> _Plan:
    """sent: [ep * E/ep] counts per (destination rank, local expert) -> all_to_all_single -> the plan of this call
    (capacity None: exact split lists, read on the host; else C: padded slots, tensors)."""
    world = dist.get_world_size(group)
    t, k = ids.shape
    flat = ids.reshape(-1).to(torch.int64)
    order = torch.argsort(flat, stable=True)  # by expert, then slot (= token: one slot per expert and token)
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent, group=group)  # equal splits of E/ep counts
    per_rank = lambda c: c.reshape(world, local_experts).sum(dim=1)  # noqa: E731
    local_ids = torch.repeat_interleave(torch.arange(local_experts, device=sent.device).repeat(world), received)
    common = dict(order=order, local_ids=local_ids.to(ids.device),
                  expert_order=torch.argsort(flat.reshape(t, k), dim=1), num_tokens=t, top_k=k, hidden=hidden,
                  group=group)
    if capacity is None:
        return _Plan(**common, token_splits=per_rank(sent).tolist(), expert_splits=per_rank(received).tolist())
    return _Plan(**common, capacity=capacity, send_slots=_slots(per_rank(sent), capacity).to(ids.device),
                 recv_slots=_slots(per_rank(received), capacity).to(ids.device))


def _capacity_code(capacity) -> int:
    """The peers table's encoding of a resolved capacity: -1 "exact", 0 "auto", C > 0 an int."""
    return {"exact": -1, "auto": 0}.get(capacity, capacity)


def _check_peers(local_experts: int, hidden: int, inter: int, payload: str, fp8: str, capacity, pair_rows: Tensor,
                 group) -> int:
    """All ranks agree on E/ep, H, I, payload, fp8 format and capacity (one all_gather; every rank raises alike);
    returns the largest number of rows any rank sends to one rank (pair_rows: this rank's, a 0-d tensor)."""
    mine = torch.cat([torch.tensor([local_experts, hidden, inter, PAYLOADS.index(payload), _FP8_NAMES.index(fp8),
                                    _capacity_code(capacity)]), pair_rows.reshape(1).to("cpu", torch.int64)])
    table = mine.new_empty(dist.get_world_size(group) * mine.numel())
    _all_gather_single(table, mine, group=group)
    table = table.reshape(-1, mine.numel())
    names = ("local experts E/ep (gate_up_weight.shape[0])", "H", "I", "ep_payload", "fp8_dtype", "ep_capacity")
    for col, name in enumerate(names):
        if not torch.all(table[:, col] == table[0, col]):
            values = table[:, col].tolist()
            if name == "ep_payload":
                values = [PAYLOADS[v] for v in values]
            elif name == "fp8_dtype":
                values = [_FP8_NAMES[v] for v in values]
            elif name == "ep_capacity":
                values = [{-1: "exact", 0: "auto"}.get(v, v) for v in values]
            raise ValueError(f"moe_swiglu_experts_mxfp8(ep_group=...): every rank must pass the same {name}, got "
                             f"{values} on ranks 0..{len(values) - 1}")
    return int(table[:, -1].max())


def _resolve_capacity(capacity, pair_rows_max: int, what: str):
    """None (exact splits) or the padded exchanges' C for this call; an int capacity smaller than the largest
    (source, destination) row count raises (on every rank alike: pair_rows_max is the group's)."""
    if capacity == "exact":
        return None
    if capacity == "auto":  # a power of two: few distinct buffer shapes over a training run
        return 1 << max(pair_rows_max - 1, 0).bit_length()
    if pair_rows_max > capacity:
        raise ValueError(f"{what}: ep_capacity={capacity} rows per (source, destination) rank pair is too small: a "
                         f"rank routes {pair_rows_max} pairs (token, expert) to one rank's experts in this call; pass "
                         f"ep_capacity >= {pair_rows_max} or 'auto' (routed pairs are never dropped)")
    return capacity


# ----------------------------------------------------------------------------------------------
# autograd functions
# ----------------------------------------------------------------------------------------------


class _Dispatch(torch.autograd.Function):
    """x rows and routing weights to the experts' ranks; backward: dX parts and weight gradients back.

    `anchor` (the local gate_up_weight) is not read: it makes the outputs require grad whenever the experts train,
    so this backward, and its collective, runs on every such rank even where x and topk_weights need no gradient.
    """

    @staticmethod
    def forward(ctx, x2, weights, anchor, plan, payload, fp8, scale_rule):
        ctx.plan = plan
        ctx.x_dtype, ctx.w_dtype = x2.dtype, weights.dtype
        h = plan.hidden
        rows = _encode_rows(x2, payload, fp8, scale_rule)[plan.order // plan.top_k]  # quantized once per token
        p = weights.reshape(-1, 1).to(torch.float32)[plan.order]
        recv = plan.to_experts(torch.cat([rows, _as_bytes(p)], dim=1))
        c = _row_bytes(h, payload)
        return _decode_rows(recv, h, payload, fp8), _columns(recv, c).view(torch.float32)

    @staticmethod
    def backward(ctx, grad_rows, grad_p):
        plan = ctx.plan
        r = len(plan.local_ids)
        # both exchanges always run (the other ranks wait for them), with zeros for a missing gradient
        grad_rows = grad_rows if grad_rows is not None else torch.zeros(r, plan.hidden, device=plan.order.device)
        grad_p = grad_p if grad_p is not None else torch.zeros(r, 1, device=plan.order.device)
        send = torch.cat([_as_bytes(grad_rows.to(torch.bfloat16)), _as_bytes(grad_p.to(torch.float32))], dim=1)
        slots = plan.to_slots(plan.to_tokens(send))
        dx_parts = _columns(slots, 0, 2 * plan.hidden).view(torch.bfloat16)  # [T, k, H]
        dx = torch.zeros(plan.num_tokens, plan.hidden, dtype=torch.bfloat16, device=dx_parts.device)
        for j in range(plan.top_k):  # the op's bf16 read-modify-write, ascending expert per token
            dx = (dx.to(torch.float32) + plan.by_expert(dx_parts, j).to(torch.float32)).to(torch.bfloat16)
        d_w = _columns(slots, 2 * plan.hidden).view(torch.float32).reshape(plan.num_tokens, plan.top_k)
        return dx.to(ctx.x_dtype), d_w.to(ctx.w_dtype), None, None, None, None, None


class _Combine(torch.autograd.Function):
    """Expert outputs (bf16) back to their tokens' ranks, summed per token; backward: dY to the experts.

    With `bias_rows` ([R, H] float32 p * down_bias[e] of each received row, or None) those travel in the same
    all-to-all and are added as the op's down bias is (nothing else changes); their gradient is the decoded dY row
    (payload "bf16" with float32 dY: dY travels as float32, since the bias's gradients use it unrounded).
    """

    @staticmethod
    def forward(ctx, y_rows, bias_rows, plan, out_dtype, payload, fp8, scale_rule):
        ctx.plan, ctx.options = plan, (payload, fp8, scale_rule)
        ctx.has_bias = bias_rows is not None
        send = [_as_bytes(y_rows.to(torch.bfloat16))] + ([_as_bytes(bias_rows)] if ctx.has_bias else [])
        slots = plan.to_slots(plan.to_tokens(torch.cat(send, dim=1)))
        parts = _columns(slots, 0, 2 * plan.hidden).view(torch.bfloat16)  # [T, k, H]
        y = torch.zeros(plan.num_tokens, plan.hidden, dtype=torch.float32, device=parts.device)
        for j in range(plan.top_k):  # the op's fp32 accumulator, ascending expert per token
            y = y + plan.by_expert(parts, j).to(torch.float32)
        y = y.to(out_dtype)
        if ctx.has_bias:  # the op's _add_down_bias: fp32 sum over a token's k slots in (token, j) order, one rounding
            bias_slots = _columns(slots, 2 * plan.hidden).view(torch.float32)  # [T, k, H]
            y = (y.to(torch.float32) + bias_slots.sum(dim=-2)).to(out_dtype)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        plan = ctx.plan
        payload, fp8, scale_rule = ctx.options
        if payload == "bf16" and ctx.has_bias and grad_y.dtype == torch.float32:
            payload = _F32_ROWS  # the down bias's gradients use dY itself, as the single-process op's do
        rows = _encode_rows(grad_y, payload, fp8, scale_rule)[plan.order // plan.top_k]  # quantized once per token
        d_rows = _decode_rows(plan.to_experts(rows), plan.hidden, payload, fp8)
        d_bias_rows = d_rows.to(torch.float32) if ctx.has_bias else None
        return d_rows, d_bias_rows, None, None, None, None, None


class _NoRows(torch.autograd.Function):
    """The local experts when this rank receives no rows: empty output, exact zero gradients for the expert
    parameters (as the single-process op gives an expert without tokens), and the autograd edges that keep this
    rank's backward collectives in step with the others'."""

    @staticmethod
    def forward(ctx, rows, p, *params):
        ctx.like = [None if t is None else (t.shape, t.dtype, t.device) for t in (rows, p, *params)]
        return rows.new_zeros(rows.shape)

    @staticmethod
    def backward(ctx, grad):
        return tuple(None if like is None else torch.zeros(like[0], dtype=like[1], device=like[2])
                     for like in ctx.like)


# ----------------------------------------------------------------------------------------------
# entry point
# ----------------------------------------------------------------------------------------------


def moe_swiglu_experts_expert_parallel(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, gate_up_weight: Tensor,
                                       down_weight: Tensor, *, group, ep_payload: str = "mxfp8", ep_capacity=None,
                                       gate_up_bias=None, down_bias=None, **options) -> Tensor:
    """``moe_swiglu_experts_mxfp8`` with the experts sharded over `group` (module docstring).

    Dimensions:
        x [..., H] -> y [..., H]; topk_ids, topk_weights [..., k] (or [T, k]) with global ids in [0, E);
        gate_up_weight [E/ep, 2I, H], down_weight [E/ep, H, I], gate_up_bias [E/ep, 2I], down_bias [E/ep, H]:
        this rank's experts.

    Args:
        x, topk_ids, topk_weights: this rank's tokens and their routing (as in the op).
        gate_up_weight, down_weight: this rank's E/ep experts (``shard_experts``).
        group: the expert-parallel torch.distributed process group (ep ranks, E = ep * E/ep).
        ep_payload: "mxfp8" (default: x and dY travel as fp8 codes + E8M0 scales) or "bf16" (bit-identical to
            the single-process op; 2x the bytes).
        ep_capacity: how the payload all-to-alls split their rows. "exact": per-rank split lists (each rank
            sends exactly its routed rows). An int C: every rank sends C rows to every rank (the routed rows, then
            zero padding), so every all_to_all_single has equal splits and the static shape [ep * C, row bytes];
            a rank that routes more than C pairs to one rank raises ValueError on every rank, naming C and the
            count (no pair is ever dropped). "auto": C = the smallest power of two >= the call's largest
            (source, destination) row count (agreed in the peers all_gather). None (default): "auto" on a
            process group whose backend is "xla" (EQUAL_SPLIT_BACKENDS: PyTorch/XLA's all_to_all_single refuses
            split sizes), else "exact". Results are bit-identical across modes (the receiver drops the padding
            before the local experts, using the exchanged counts).
        gate_up_bias: None or this rank's experts' [E/ep, 2I] bias (the op's gate_up_bias: it goes into the local
            op, which returns its gradient on this rank).
        down_bias: None or this rank's experts' [E/ep, H] bias: each received row's p * down_bias[e] (float32)
            travels back with the expert output and is added as the op adds it; its gradient (the sum over e's
            rows of p * dY, dY as the experts receive it) stays on this rank, and <dY, down_bias[e]> joins the
            routing-weight gradient.
        **options: the op's keyword options (checkpoint, clamp_limits, fp8_dtype, quant_scheme,
            weight_grad_dtype, matmul_precision, scale_rule, block_size, backend).

    Returns:
        y [..., H] in x's dtype.

    Raises:
        TypeError / ValueError / RuntimeError: as the op, plus a bad group, ep_payload or ep_capacity, and (raised
            on every rank) ranks that disagree on E/ep, H, I, ep_payload, fp8_dtype or the resolved ep_capacity,
            or an int ep_capacity too small for the call's routing. Every check but those runs before the first
            collective.
    """
    what = "moe_swiglu_experts_mxfp8(ep_group=...)"
    _, world = _group_size(group, what)
    check_ep_options(group, ep_payload, ep_capacity, what)
    local_experts = gate_up_weight.shape[0] if gate_up_weight.dim() == 3 else 0
    t, h, n_i, e, k = moe_op._check_inputs(x, topk_ids, topk_weights, gate_up_weight, down_weight,
                                           num_experts=local_experts * world)
    unknown = sorted(set(options) - set(_OP_OPTIONS))
    if unknown:
        raise TypeError(f"{what}: unexpected keyword arguments {unknown}")
    opts = {**_OP_OPTIONS, **options}
    moe_op.resolve_backend(opts["backend"])  # every option checked before the first collective
    keep = resolve_checkpoint_policy(opts["checkpoint"])
    _, fp8 = check_numeric_options(opts["clamp_limits"], opts["fp8_dtype"], opts["quant_scheme"],
                                   opts["matmul_precision"], opts["scale_rule"])
    weight_grad_name(opts["weight_grad_dtype"], gate_up_weight, down_weight)
    routing.check_block_size(opts["block_size"])
    moe_op._check_gate_up_bias(gate_up_bias, gate_up_weight, keep)  # [E/ep, 2I]: the local experts'
    if down_bias is not None:
        moe_op._check_down_bias(down_bias, gate_up_weight.shape, gate_up_weight.device)  # [E/ep, H]
    ids2, w2 = topk_ids.reshape(t, k), topk_weights.reshape(t, k)
    moe_op._check_routing_values(ids2, w2, e)  # global ids in [0, E)

    sent = torch.bincount(ids2.reshape(-1).to(torch.int64), minlength=e)  # [ep * E/ep] per (rank, local expert)
    capacity = default_capacity(group) if ep_capacity is None else ep_capacity
    pair_rows_max = _check_peers(local_experts, h, n_i, ep_payload, fp8, capacity,
                                 sent.reshape(world, local_experts).sum(dim=1).max(), group)
    plan = _exchange_counts(ids2, sent, local_experts, h, group,
                            _resolve_capacity(capacity, pair_rows_max, what))
    wire = (ep_payload, fp8, opts["scale_rule"])
    rows, p = _Dispatch.apply(x.reshape(t, h), w2, gate_up_weight, plan, *wire)
    if rows.shape[0]:
        y_rows = moe_op.moe_swiglu_experts_mxfp8(rows, plan.local_ids[:, None], p, gate_up_weight, down_weight,
                                                 gate_up_bias=gate_up_bias, **opts)
    else:
        y_rows = _NoRows.apply(rows, p, gate_up_weight, down_weight, gate_up_bias)
    # the op's down-bias term, per received row: p * down_bias[e] in float32 (its gradients by autograd)
    bias_rows = None if down_bias is None else p.to(torch.float32) * down_bias.to(torch.float32)[plan.local_ids]
    return _Combine.apply(y_rows, bias_rows, plan, x.dtype, *wire).reshape(x.shape)
