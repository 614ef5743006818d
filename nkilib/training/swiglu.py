"""A SwiGLU MLP with Hugging Face's parameter names whose backward is the MXFP8 op.

``HFSwiGLUMLP`` keeps the three ``nn.Linear`` submodules of the model's own MLP (``gate_proj``,
``up_proj``, ``down_proj``, no biases), so its parameters are the model's parameter objects and its
state-dict keys are the model's keys (``...mlp.gate_proj.weight`` etc.). Its forward calls
``swiglu_mlp_mxfp8`` with the options of a ``Recipe``.

Weight mapping (the op takes gate_up_weight [2I, H] = gate rows then up rows, and down_weight [H, I]):
    * down_proj.weight [H, I] is passed as is (same layout; no copy).
    * gate_proj.weight and up_proj.weight [I, H] become one [2I, H] operand. When the two live back to
      back in one storage (``pack_gate_up_()`` arranges that once, in place, keeping the Parameter
      objects), the operand is a view of that storage: no copy per call, and the tensor the op saves
      for the backward is the parameters' own memory. Otherwise (parameters re-allocated by
      ``model.to(...)``, FSDP flattening, a loaded checkpoint assigned with ``assign=True``) it is a
      ``torch.cat`` per call: a [2I, H] copy made in every forward and kept until the backward,
      because the op's API takes the fused operand. Either way the gradient is split back into the
      two parameters' gradients. ``gate_up_is_view()`` says which path a module takes.

torch.autocast: under an enabled autocast region on the input's device, the input is cast to the
autocast dtype (bfloat16 only: the kernel computes in bf16; float16 is an error) and the op runs with
autocast disabled, so its internal fp32 steps stay fp32; parameters stay in their dtype (fp32 master
weights get fp32 gradients), and the output is bf16, as nn.Linear's is under autocast.

fp32 ``main_grad`` (recipe.accumulate_main_grad, Megatron / NxD convention; needs an op build with
that option): the op adds the kernel's fp32 gradient to ``t.main_grad`` of each weight operand ``t``
it is given. down_proj.weight is a parameter, so its ``main_grad`` is used directly. For the fused
gate/up operand, ``fused_gate_up`` gives the operand a ``main_grad``: a view of the parameters'
``main_grad`` tensors when those are adjacent in one storage, else a zero fp32 [2I, H] buffer (one per
module, reused) whose content the backward adds into ``gate_proj.weight.main_grad`` and
``up_proj.weight.main_grad`` (one extra fp32 add per call). Under the op's contract a parameter with a
``grad_added_to_main_grad`` attribute gets a zero ``.grad``; ``_FusedGateUp`` passes that zero gradient
on to both parameters.
"""
from __future__ import annotations

import contextlib

import torch
from torch import Tensor, nn

from ..experimental.mlp_mxfp8.mlp_bwd_mxfp8.constants import MX_GROUP
from ..experimental.mlp_mxfp8.mlp_bwd_mxfp8.mlp_bwd_mxfp8_torch import swiglu_mlp_mxfp8
from ..recipe import Recipe, as_recipe

__all__ = ["HFSwiGLUMLP", "RecipeModule", "fused_gate_up", "rows_are_adjacent", "outside_autocast"]

SILU_CLASSES = ("SiLU", "SiLUActivation")  # torch.nn.SiLU; transformers.activations.SiLUActivation


def rows_are_adjacent(first: Tensor, second: Tensor) -> bool:
    """True when `second` starts where `first` ends in one contiguous storage (so [first; second] is a view)."""
    return (first.is_contiguous() and second.is_contiguous() and first.dtype == second.dtype
            and first.device == second.device and first.shape[1:] == second.shape[1:]
            and first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()
            and second.storage_offset() == first.storage_offset() + first.numel())


def _stacked_view(first: Tensor, second: Tensor) -> Tensor:
    """[first; second] as a view of their shared storage (rows_are_adjacent must hold)."""
    shape = (first.shape[0] + second.shape[0], *first.shape[1:])
    return first.as_strided(shape, first.stride(), first.storage_offset())


class _FusedGateUp(torch.autograd.Function):
    """(gate [I, H], up [I, H]) -> [2I, H] (a view when adjacent, else a copy); backward splits the gradient
    and delivers what the op added to a main_grad buffer into the two parameters' main_grad."""

    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor, adjacent: bool, main_grad_mode: bool, main_grad_buffer) -> Tensor:
        ctx.set_materialize_grads(False)
        ctx.n_gate = gate.shape[0]
        ctx.params, ctx.main_grad_mode, ctx.buffer = (gate, up), main_grad_mode, main_grad_buffer
        if adjacent:
            return _stacked_view(gate, up)
        return torch.cat([gate, up])

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.params
        if ctx.buffer is not None:
            # linear, so a buffer shared by every call of one module is exact: whatever sits in it now
            # (this call's gradient, maybe another in-flight call's) moves to main_grad exactly once
            gate.main_grad.add_(ctx.buffer[:ctx.n_gate])
            up.main_grad.add_(ctx.buffer[ctx.n_gate:])
            ctx.buffer.zero_()
        if grad is None:
            return None, None, None, None, None
        if ctx.main_grad_mode:  # the op's sink set the fused operand's flag and sent this zero gradient
            for p in (gate, up):
                if hasattr(p, "grad_added_to_main_grad"):
                    p.grad_added_to_main_grad = True
        return grad[:ctx.n_gate], grad[ctx.n_gate:], None, None, None


def fused_gate_up(gate: Tensor, up: Tensor, accumulate_main_grad: bool = False, main_grad_buffers=None) -> Tensor:
    """[gate; up] [2I, H] for the op (module docstring): a view when the rows are adjacent, else a copy.

    Args:
        gate, up: the two [I, H] parameters.
        accumulate_main_grad: when True and both parameters carry an fp32 ``main_grad``, the result carries
            a ``main_grad`` [2I, H] for the op: a view of the two when adjacent, else a zero fp32 buffer
            whose content the backward adds to the parameters' main_grad.
        main_grad_buffers: a dict in which that buffer is kept and reused across calls (per module);
            None: a new buffer per call.
    """
    # torch.compile cannot trace storage pointers: compiled code takes the copy path (the compiler may
    # still fuse the cat away)
    eager = not torch.compiler.is_compiling()
    adjacent = eager and rows_are_adjacent(gate, up)
    mains = [getattr(p, "main_grad", None) for p in (gate, up)]
    if not (accumulate_main_grad and torch.is_grad_enabled() and all(isinstance(m, Tensor) for m in mains)):
        return _FusedGateUp.apply(gate, up, adjacent, False, None)
    if eager and rows_are_adjacent(*mains):
        fused = _FusedGateUp.apply(gate, up, adjacent, True, None)
        fused.main_grad = _stacked_view(*mains)
    else:
        shape = (gate.shape[0] + up.shape[0], *gate.shape[1:])
        store = main_grad_buffers if main_grad_buffers is not None else {}
        buffer = store.get("gate_up")
        if buffer is None or buffer.shape != shape or buffer.device != gate.device:
            buffer = store["gate_up"] = torch.zeros(shape, dtype=torch.float32, device=gate.device)
        fused = _FusedGateUp.apply(gate, up, adjacent, True, buffer)
        fused.main_grad = buffer
    if any(hasattr(p, "grad_added_to_main_grad") for p in (gate, up)):
        fused.grad_added_to_main_grad = False
    return fused


def check_hf_swiglu(mlp: nn.Module, where: str) -> None:
    """Raise ValueError (naming `where`) unless `mlp` is a bias-free SiLU-gated MLP with nn.Linear projections
    whose sizes the op accepts."""
    for name in ("gate_proj", "up_proj", "down_proj"):
        lin = getattr(mlp, name, None)
        if not isinstance(lin, nn.Linear):
            raise ValueError(f"{where}.{name} must be an nn.Linear, got {type(lin).__name__}")
        if lin.bias is not None:
            raise ValueError(f"{where}.{name} has a bias; the MXFP8 SwiGLU op has none (config.mlp_bias must be False)")
        if lin.weight.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"{where}.{name}.weight must be bfloat16 or float32, got {lin.weight.dtype}")
    act = getattr(mlp, "act_fn", None)
    if type(act).__name__ not in SILU_CLASSES:
        raise ValueError(f"{where}.act_fn must be SiLU (hidden_act='silu') for a SwiGLU MLP, got {type(act).__name__}")
    n_i, h = mlp.gate_proj.weight.shape
    if tuple(mlp.up_proj.weight.shape) != (n_i, h) or tuple(mlp.down_proj.weight.shape) != (h, n_i):
        raise ValueError(f"{where}: gate_proj/up_proj weights must be [I, H] and down_proj [H, I]; got "
                         f"{tuple(mlp.gate_proj.weight.shape)}, {tuple(mlp.up_proj.weight.shape)}, "
                         f"{tuple(mlp.down_proj.weight.shape)}")
    if h % MX_GROUP or n_i % MX_GROUP:
        raise ValueError(f"{where}: hidden size and intermediate size must be multiples of {MX_GROUP} (MX groups), "
                         f"got H={h}, I={n_i}")


def autocast_input(x: Tensor) -> tuple:
    """(x cast for the op, whether autocast is enabled on x's device); bfloat16 is the only autocast dtype.

    Raises:
        TypeError: autocast enabled with a dtype other than bfloat16.
    """
    device_type = x.device.type
    if not torch.is_autocast_enabled(device_type):
        return x, False
    dtype = torch.get_autocast_dtype(device_type)
    if dtype != torch.bfloat16:
        raise TypeError(f"torch.autocast(dtype={dtype}) is not supported by the MXFP8 SwiGLU op (it computes in "
                        f"bfloat16); use torch.autocast(..., dtype=torch.bfloat16)")
    return x.to(torch.bfloat16), True


@contextlib.contextmanager
def outside_autocast(x: Tensor):
    """Yields x as the op takes it (autocast_input); inside the block autocast is disabled on x's device where it
    was enabled, so the op's fp32 steps stay fp32 (module docstring)."""
    x_op, autocasting = autocast_input(x)
    with torch.autocast(x.device.type, enabled=False) if autocasting else contextlib.nullcontext():
        yield x_op


class RecipeModule:
    """Mixin of the training layer's modules (HFSwiGLUMLP, TensorParallelSwiGLUMLP, HFMoEExperts, HFGptOssExperts):
    the Recipe they run (self.recipe), checked against the module's op when it is set (at construction and when
    patch_model re-patches), and shown in the module's repr.

    A subclass whose op cannot run every recipe overrides _check_recipe.
    """

    def set_recipe(self, recipe) -> None:
        """Run `recipe` (a Recipe, a preset name or None: the default preset) from now on.

        Raises:
            ValueError: a recipe this module's op cannot run (naming the field); the recipe held before stays.
        """
        recipe = as_recipe(recipe)
        self._check_recipe(recipe)
        self.recipe = recipe

    def _check_recipe(self, recipe: Recipe) -> None:
        """Raise ValueError (naming the field) when this module's op cannot run `recipe`; the base runs every one."""

    def _recipe_repr(self) -> str:
        return f"recipe={self.recipe.describe()}"


class HFSwiGLUMLP(RecipeModule, nn.Module):
    """Drop-in replacement of a Hugging Face SwiGLU MLP (LlamaMLP, Qwen2MLP, Qwen3MLP, MistralMLP, ...).

    Dimensions:
        x [..., H] -> y [..., H]; gate_proj.weight / up_proj.weight [I, H], down_proj.weight [H, I].

    Args:
        gate_proj, up_proj, down_proj: the model's bias-free nn.Linear modules (kept, not copied).
        recipe: a Recipe, a preset name or None (the default preset).
        pack: rebind gate_proj.weight and up_proj.weight to one [2I, H] storage now (one copy, same
            Parameter objects), so every forward takes the view path (module docstring).
    """

    def __init__(self, gate_proj: nn.Linear, up_proj: nn.Linear, down_proj: nn.Linear, recipe=None, pack=True):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj
        self.act_fn = nn.SiLU()  # documents the math; the op applies it
        check_hf_swiglu(self, type(self).__name__)
        self.set_recipe(recipe)
        self._main_grad_buffers = {}  # fp32 [2I, H] main_grad staging (fused_gate_up), allocated on first use
        if pack:
            self.pack_gate_up_()

    @classmethod
    def from_hf(cls, mlp: nn.Module, recipe=None, pack=True, where: str = "mlp") -> "HFSwiGLUMLP":
        """The replacement of `mlp` (checked; ValueError naming `where` when it is not a SwiGLU MLP)."""
        check_hf_swiglu(mlp, where)
        return cls(mlp.gate_proj, mlp.up_proj, mlp.down_proj, recipe=recipe, pack=pack)

    @torch.no_grad()
    def pack_gate_up_(self) -> "HFSwiGLUMLP":
        """Put gate_proj.weight and up_proj.weight back to back in one new storage (same Parameter objects)."""
        gate, up = self.gate_proj.weight, self.up_proj.weight
        if not rows_are_adjacent(gate, up):
            packed = torch.cat([gate.detach(), up.detach()])
            gate.data, up.data = packed[:gate.shape[0]], packed[gate.shape[0]:]
        return self

    def gate_up_is_view(self) -> bool:
        """Whether the forward passes a view of the parameters (True) or a per-call copy (False)."""
        return rows_are_adjacent(self.gate_proj.weight, self.up_proj.weight)

    def forward(self, x: Tensor) -> Tensor:
        kwargs = self.recipe.to_kwargs()
        with outside_autocast(x) as x_op:
            w_gu = fused_gate_up(self.gate_proj.weight, self.up_proj.weight, self.recipe.accumulate_main_grad,
                                 self._main_grad_buffers)
            return swiglu_mlp_mxfp8(x_op, w_gu, self.down_proj.weight, **kwargs)

    def extra_repr(self) -> str:
        n_i, h = self.gate_proj.weight.shape
        return f"hidden_size={h}, intermediate_size={n_i}, {self._recipe_repr()}"

