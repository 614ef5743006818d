"""Tensor-parallel SwiGLU MLP over any torch.distributed process group, with the MXFP8 op per rank.

Layout (the one NeuronX Distributed gives a fused gate/up ``ColumnParallelLinear(stride=2)`` and a
``RowParallelLinear``; NxD's ``create_local_weight`` splits the full weight along the partition
dimension into chunks of per_partition_size / stride and gives rank r the chunks r, r + tp, ...:
https://github.com/aws-neuron/neuronx-distributed/blob/main/src/neuronx_distributed/parallel_layers/layers.py,
layer API: https://awsdocs-neuron.readthedocs-hosted.com/en/latest/libraries/neuronx-distributed/api_guide.html):
    gate_up_proj.weight [2I/tp, H] on rank r = [W_gate[r*I/tp:(r+1)*I/tp]; W_up[r*I/tp:(r+1)*I/tp]]
        (with stride=2 the two chunks of rank r are its gate slice and its up slice, so the local shard
        is itself a [gate; up] operand of the op: no re-layout, no copy);
    down_proj.weight [H, I/tp] on rank r = W_down[:, r*I/tp:(r+1)*I/tp] (RowParallelLinear: the input
        dimension of the [H, I] weight is split).
Each rank runs the op on its shard, which is exactly an MLP with intermediate size I/tp; the outputs
are partial sums over I.

Collectives (Megatron-style, as NxD's layers do), on `group`:
    no sequence parallelism: x [..., H] is replicated. Forward: y = all_reduce(y_partial). Backward:
        dX = all_reduce(dX_partial) (the input's gradient gets every rank's share of I).
    sequence parallelism: x is the rank's slice of the sequence dimension (`sequence_dim`, 0 as in NxD's
        [S, B, H] layout). Forward: all_gather(x) along the sequence, y = reduce_scatter(y_partial).
        Backward: the transposes: all_gather(dY), reduce_scatter(dX_partial).
    Weight gradients are local to their shard (no collective).

Numerics against the single-process op on the full weights (MX groups of 32 along I must not straddle
ranks: I/tp is a multiple of 32):
    * the weight gradients of a shard are bit-identical to the matching rows / columns of the full
      op's gradients: each is a contraction over tokens of per-column quantities (gate_pre, up, dY W_down)
      that the shard computes exactly as the full op does (contraction over H, same MX groups);
    * y and dX are contractions over I, split across ranks: each rank rounds its partial sum (bf16 out
      of the kernel / the bf16 matmul) and the collective adds the partials, so they differ from the
      full op by bf16 rounding of partial sums (not bit-identical; measured in the tests).
Under ``quant_scheme="wrapX"`` the MX groups along I depend on the K tile layout, so the weight
gradients are not bit-identical there either.

On Neuron the same code runs on the XLA / TorchNeuron process group; that path is untested here.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..experimental.mlp_mxfp8.mlp_bwd_mxfp8.constants import MX_GROUP
from ..experimental.mlp_mxfp8.mlp_bwd_mxfp8.mlp_bwd_mxfp8_torch import swiglu_mlp_mxfp8
from .swiglu import RecipeModule, outside_autocast

__all__ = ["TensorParallelSwiGLUMLP", "shard_gate_up_stride2", "shard_down_rows"]

# torch >= 2.10 names the tensor collectives *_single; older releases only have *_into_tensor / *_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _all_reduce(t: Tensor, group) -> Tensor:
    t = t.contiguous().clone()
    dist.all_reduce(t, group=group)
    return t


def _all_gather(t: Tensor, group, dim: int) -> Tensor:
    world = dist.get_world_size(group)
    moved = t.movedim(dim, 0).contiguous()
    out = moved.new_empty((world * moved.shape[0], *moved.shape[1:]))
    _all_gather_single(out, moved, group=group)
    return out.movedim(0, dim)


def _reduce_scatter(t: Tensor, group, dim: int) -> Tensor:
    world = dist.get_world_size(group)
    moved = t.movedim(dim, 0).contiguous()
    if moved.shape[0] % world:
        raise ValueError(f"sequence parallelism: dimension {dim} of size {moved.shape[0]} must be divisible by the "
                         f"group size {world}")
    out = moved.new_empty((moved.shape[0] // world, *moved.shape[1:]))
    _reduce_scatter_single(out, moved, group=group)
    return out.movedim(0, dim)


class _CopyToGroup(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient (a replicated input used by every rank's shard)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromGroup(torch.autograd.Function):
    """All-reduce forward (sum of partial outputs); identity backward (the sum is replicated)."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherSequence(torch.autograd.Function):
    """All-gather along the sequence dimension; backward: reduce-scatter of the gradient."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.group, ctx.dim), None, None


class _ReduceScatterSequence(torch.autograd.Function):
    """Reduce-scatter along the sequence dimension; backward: all-gather of the gradient."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.group, ctx.dim), None, None


def shard_gate_up_stride2(gate_up_weight: Tensor, rank: int, world: int) -> Tensor:
    """Rank `rank`'s [2I/tp, H] shard of a full [gate; up] weight [2I, H] in NxD's stride-2 layout (a copy).

    Raises:
        ValueError: 2I not divisible by 2 * world.
    """
    rows = gate_up_weight.shape[0]
    if rows % (2 * world):
        raise ValueError(f"gate_up_weight rows ({rows}) must be divisible by 2 * world size ({2 * world})")
    chunk = rows // (2 * world)
    chunks = torch.split(gate_up_weight, chunk, dim=0)
    return torch.cat(chunks[rank::world], dim=0)


def shard_down_rows(down_weight: Tensor, rank: int, world: int) -> Tensor:
    """Rank `rank`'s [H, I/tp] shard of a full down weight [H, I] (RowParallelLinear: input dim split; a copy)."""
    cols = down_weight.shape[1]
    if cols % world:
        raise ValueError(f"down_weight columns ({cols}) must be divisible by the world size ({world})")
    return down_weight[:, rank * (cols // world):(rank + 1) * (cols // world)].clone()


class _Weight(nn.Module):
    """Holds one parameter as ``weight`` so that state-dict keys read ``gate_up_proj.weight`` / ``down_proj.weight``
    (NxD's Llama MLP names)."""

    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight


class TensorParallelSwiGLUMLP(RecipeModule, nn.Module):
    """SwiGLU MLP sharded over a process group (module docstring), MXFP8 backward per rank.

    Dimensions:
        x [..., H] (replicated) or the rank's sequence slice of it (sequence_parallel) -> y of x's shape;
        gate_up_proj.weight [2I/tp, H] (stride-2 shard), down_proj.weight [H, I/tp].

    Args:
        gate_up_weight: the local [2I/tp, H] shard (an nn.Parameter is adopted as is, e.g. an NxD
            ColumnParallelLinear(stride=2).weight; a tensor is wrapped in a new Parameter).
        down_weight: the local [H, I/tp] shard (likewise, e.g. RowParallelLinear.weight).
        group: the tensor-parallel process group (None: the default group).
        sequence_parallel: x and y are split along `sequence_dim` across the group.
        sequence_dim: the sequence dimension of x (0: NxD's [S, B, H]).
        recipe: a Recipe, a preset name or None (nkilib.recipe).

    Raises:
        ValueError: shards of inconsistent shapes, or I/tp not a multiple of 32.
        RuntimeError: torch.distributed not initialised.
    """

    def __init__(self, gate_up_weight: Tensor, down_weight: Tensor, *, group=None, sequence_parallel: bool = False,
                 sequence_dim: int = 0, recipe=None):
        super().__init__()
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("TensorParallelSwiGLUMLP needs an initialised torch.distributed process group")
        self.group = group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        local_i = down_weight.shape[1] if down_weight.dim() == 2 else -1
        if gate_up_weight.dim() != 2 or down_weight.dim() != 2 or gate_up_weight.shape[0] != 2 * local_i or \
                down_weight.shape[0] != gate_up_weight.shape[1]:
            raise ValueError(f"TensorParallelSwiGLUMLP: shards must be gate_up [2I/tp, H] and down [H, I/tp], got "
                             f"{tuple(gate_up_weight.shape)} and {tuple(down_weight.shape)}")
        if local_i % MX_GROUP:
            raise ValueError(f"TensorParallelSwiGLUMLP: the local intermediate size I/tp must be a multiple of "
                             f"{MX_GROUP} (MX groups must not straddle ranks), got {local_i}")
        as_param = (lambda t: t if isinstance(t, nn.Parameter) else nn.Parameter(t))
        self.gate_up_proj = _Weight(as_param(gate_up_weight))
        self.down_proj = _Weight(as_param(down_weight))
        self.sequence_parallel, self.sequence_dim = bool(sequence_parallel), sequence_dim
        self.set_recipe(recipe)

    @classmethod
    def from_full(cls, gate_up_weight: Tensor, down_weight: Tensor, *, group=None,
                  **kwargs) -> "TensorParallelSwiGLUMLP":
        """This rank's module from the full weights [2I, H] and [H, I] (copies the local shards)."""
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        with torch.no_grad():
            return cls(shard_gate_up_stride2(gate_up_weight.detach(), rank, world),
                       shard_down_rows(down_weight.detach(), rank, world), group=group, **kwargs)

    @property
    def local_intermediate_size(self) -> int:
        return self.down_proj.weight.shape[1]

    def forward(self, x: Tensor) -> Tensor:
        with outside_autocast(x) as x_op:
            if self.sequence_parallel:
                x_full = _GatherSequence.apply(x_op, self.group, self.sequence_dim)
            else:
                x_full = _CopyToGroup.apply(x_op, self.group)
            y_partial = swiglu_mlp_mxfp8(x_full, self.gate_up_proj.weight, self.down_proj.weight,
                                         **self.recipe.to_kwargs())
            if self.sequence_parallel:
                return _ReduceScatterSequence.apply(y_partial, self.group, self.sequence_dim)
            return _ReduceFromGroup.apply(y_partial, self.group)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.down_proj.weight.shape[0]}, "
                f"local_intermediate_size={self.local_intermediate_size}, "
                f"tp={self.world}, rank={self.rank}, sequence_parallel={self.sequence_parallel}, "
                f"{self._recipe_repr()}")
