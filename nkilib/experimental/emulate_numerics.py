"""The torch numerics contract shared by the emulate backends (dense MLP and MoE backward).

Pure torch, on any device: the kernels' MX quantizer (``mx_quantize_dequantize``; ``mx_quantize_rows`` /
``mx_dequantize_rows`` for codes and scale bytes themselves), the contract's matmul (``contract_matmul``:
exact per-K-tile sums), the SwiGLU / clamp numerics (``clamp_and_mask``, ``activation_fns32``,
``linear_factor``, ``swiglu_activations``) and the phase-0 recompute (``recompute_projection``), used by
mlp_mxfp8/mlp_bwd_mxfp8/mlp_bwd_mxfp8_emulate.py, moe_mxfp8/moe_bwd_mxfp8_emulate.py, the torch ops and the
expert-parallel payload. The NumPy counterpart (the references): nkilib/core/numerics.py.

This is the numerics contract of the kernels (the references' mode ``"mx_exact"``) written in torch ops:

This is the numerics contract of the kernel (reference.py, mode ``"mx_exact"``) written in torch ops,
so that it runs on any torch device (CPU, CUDA) at torch speed, for training studies:

    mm(A [M, K], B [K, N]):
      mxfp8: K zero-padded to Kp = ceil(K / 128) * 128; A quantized along axis 1 and B along axis 0
        (MX groups of 32 by ``quant_scheme``, one E8M0 scale per group by ``scale_rule``, elements
        RNE-cast with saturation to the fp8 format); per K tile of 512 the exact sum of the
        dequantized products (float64) rounded once to float32; float32 accumulation across tiles
        in order (the last tile holds Kp % 512 elements when nonzero).
      bf16: the bf16 operands as is; per K tile of 128 the float64 sum rounded to float32; float32
        accumulation across tiles in order.
    Elementwise math in float32 (each binary op rounded to float32); activations evaluated in
    float64 on the float32 input and rounded once to float32; bf16(v) = RNE from float32.

Exactness argument (why this matches the NumPy reference and the simulator bit for bit):
    * scale: amax of a group and its exponent come from torch.frexp (exact, also for float32
      subnormals), so the E8M0 byte is exact integer arithmetic, as in nkilib.mx.quantize;
    * element cast: v * 2**-k (k in [-127, 127]) is one float32 multiplication by an exact power of
      two, i.e. the exact quotient rounded once to float32, which is what nkilib.mx.quantize computes
      (exact float64 quotient, then float32; see its _cast_elements for why that step is harmless); values
      are clamped to +-max_normal before the float32 -> fp8 cast, which makes torch's RNE cast
      saturating (clip-then-round equals round-then-saturate, proof in nkilib.mx.quantize);
      torch's float32 -> float8_e4m3fn / float8_e5m2 casts are RNE (checked against ml_dtypes in
      tests/torch/test_emulate_numerics.py);
    * dequantized values (fp8 value * 2**k) are exact in float32 and in float64, and their
      products are exact in float64 (<= 8 significant bits); the per-tile float64 sum is exact
      unless one tile's products span more than ~2**44 in magnitude (then the float64 rounding,
      and BLAS summation order, can differ from NumPy's: "up to fp32 reassociation").
    * activations: float64 tanh of torch and NumPy may differ in the last float64 ulp, which
      changes the float32 rounding with probability ~2**-29 per element.

The vectorised quantizer (``_quantize_dequantize``) changes no arithmetic, only how it is laid out:
    * groups are views of the operand (``_group_views``): a reshape of the quantized axis into
      [K/32, 32] ("1x32") or, per K tile, into [4, P/8, 8] whose axes 1 and 3 are exactly the members
      8g + i + P*j of nkilib.mx.group_positions ("wrapX"); no gather, no copy of a transposed operand;
    * amax = max(amax(v), -amin(v)) over those axes: negation and max are exact, a NaN anywhere
      propagates, +-Inf gives Inf (then the group is marked non-finite);
    * powers of two are built from their float64 bits ((k + 1023) << 52), exact by construction;
    * a group holding NaN/Inf gets a NaN multiplier instead of a mask: NaN survives the clamp and
      the fp8 cast, so all its values come out NaN, as in nkilib.mx;
    * fp8 codes are decoded through a 256-entry table made by torch's own (exact) fp8 -> float cast.
    tests/torch/test_emulate_numerics.py checks all of this bit for bit against nkilib.mx on
    adversarial values (ties, saturation, subnormals, zero / NaN / Inf groups, strided inputs).

The fused quantizer (mlp_bwd_mxfp8_emulate_fused.py, selected by ``set_fused_quantizer``; "auto" by default) computes
the same bits in float32 / int32 arithmetic without an fp8 dtype, so that torch.compile fuses it into one
or two loops (C++ on CPU, Triton on CUDA). "auto" compiles it for operands of FUSED_MIN_ELEMENTS or more
(small ones stay eager: no compile latency in tests), checks the compiled code once per device and option
set against the eager formulation on adversarial probe values, and falls back to the
eager quantizer, with a warning, if compiling fails or the bits differ.

Speed (simulations/emulate_speed.py, README "Emulation speed"): the per-tile exact sums are float64 GEMMs,
which bounds the emulation from below by the float64 / plain-dtype GEMM throughput ratio (measured
2.2-2.7x float32 on an AVX2 CPU, ~10x bf16 on an H100). Why not float32 GEMMs: an e4m3 group spans
2**-9..448 times its scale (18-bit integers in units of its smallest step), a product of two such values
36 bits, a 512-term tile sum 45 bits plus the spread of the tile's 16 group scales; float32 keeps 24, so
its sums round (measured: a float32 GEMM on the same dequantized operands differs from the exact
result in 5-22% of the outputs of the four products), while float64's 53 bits hold them when the
scales of one tile row span at most 8 binades. ``gemm="fast"`` (backend "emulate_fast") trades exactly that
for speed: same quantization, float32-accumulating GEMMs (mlp_bwd_mxfp8_emulate_fast.py; not bit-exact).

No NKI and no simulator here: only torch and the scale-rule constants of nkilib.mx.

Dimensions:
    S: tokens, H: hidden size, I: intermediate size.
    X = hidden_states [S, H], dY = output_grad [S, H], W_gu = gate_up_weights [2I, H]
    (W_gate = rows 0..I-1, W_up = rows I..2I-1), W_down = down_proj_weight [H, I],
    checkpoints gate_pre / gate_act / up / intermediate [S, I].
"""
from __future__ import annotations

import functools
import math

import torch

from ..core import options
from ..core.matmul.constants import BF16_K_TILE, MX_GROUP, MX_K_ALIGN, MX_K_TILE
from ..core.options import check_choice
from ..mx import SCALE_NAN_BYTE, SCALE_RULES, element_format, group_positions
from .mlp_mxfp8.mlp_bwd_mxfp8.mlp_bwd_mxfp8_emulate_fast import fast_gemm, resolve_gemm
from .mlp_mxfp8.mlp_bwd_mxfp8.mlp_bwd_mxfp8_emulate_fused import (  # noqa: F401
    FUSED_QUANTIZER_MODES, f32_fraction_bits, fused_quantizer_for, set_fused_quantizer)

__all__ = [
    "FP8_DTYPES",
    "fp8_name",
    "clamp_tuple",
    "mx_quantize_dequantize",
    "mx_quantize_rows",
    "mx_dequantize_rows",
    "FUSED_QUANTIZER_MODES",
    "set_fused_quantizer",
    "contract_matmul",
    "clamp_and_mask",
    "activation_fns32",
    "linear_factor",
    "swiglu_activations",
    "recompute_projection",
]

#: torch dtypes of the MX element formats.
FP8_DTYPES = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


# ----------------------------------------------------------------------------------------------
# option handling: nkilib.core.options (shared with the kernel, the NumPy reference and the torch layer)
# ----------------------------------------------------------------------------------------------


def fp8_name(fp8_dtype) -> str:
    """Canonical fp8 format name from a string ("float8_e4m3fn", "e4m3fn", "..._x4") or a torch dtype."""
    return options.fp8_format(fp8_dtype)


clamp_tuple = options.clamp_values  # (gate_lower, gate_upper, up_lower, up_upper) of a ClampLimits / dict / None


# ----------------------------------------------------------------------------------------------
# MX quantization (torch)
# ----------------------------------------------------------------------------------------------


def _group_views(x: torch.Tensor, dim: int, scheme: str, k_tile: int):
    """Views of `x` that put each MX group of axis `dim` on two or more axes, with no copy.

    "1x32": axis dim [K] -> [K/32, 32], the group members on the new axis dim+1.
    "wrapX" (nkilib.mx.group_positions): in a K tile of length T (P = T/4), group g holds the logical
    indices 8g + i + P*j (i < 8, j < 4), so the tile [T] -> [4, P/8, 8] puts group g at index g of
    axis dim+2 and its members on axes dim+1 (j) and dim+3 (i). Full tiles share one view; a last
    shorter tile (K % k_tile, a multiple of 128) gets its own.

    Returns:
        list of (view, reduce_dims) covering axis dim in order.
    """
    pre, post = x.shape[:dim], x.shape[dim + 1:]
    k = x.shape[dim]
    if scheme == "1x32":
        return [(x.reshape(*pre, k // MX_GROUP, MX_GROUP, *post), (dim + 1,))]
    parts = []
    n_full = k // k_tile
    for start, n_tiles, t in ((0, n_full, k_tile), (n_full * k_tile, 1, k - n_full * k_tile)):
        if n_tiles == 0 or t == 0:
            continue
        chunk = x.narrow(dim, start, n_tiles * t)
        p = t // 4
        parts.append((chunk.reshape(*pre, n_tiles, 4, p // 8, 8, *post), (dim + 1, dim + 3)))
    return parts


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """2**k as float64 built from its bits (exact by construction); k int64 in [-1022, 1023]."""
    return ((k + 1023) << 52).view(torch.float64)


@functools.lru_cache(maxsize=32)
def _code_table(fmt_name: str, dtype, device_str: str) -> torch.Tensor:
    """Value of each of the 256 fp8 codes (torch's own exact fp8 -> float cast), as a lookup table."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_DTYPES[fmt_name])
    return codes.to(dtype).to(device_str)


def _decode(codes: torch.Tensor, fmt_name: str, dtype) -> torch.Tensor:
    """fp8 codes -> float values, through a 256-entry table (same values as ``codes.to(dtype)``).

    Why a table: torch's CPU fp8 -> float cast runs ~10x slower than one gather of int32 indices
    (measured: 21 ms vs 2.4 ms for 1.4M values, one thread). The gather walks the codes in memory
    order (a permuted view where the codes are strided, e.g. quantized along a transposed operand).
    """
    table = _code_table(fmt_name, dtype, str(codes.device))
    order = sorted(range(codes.dim()), key=lambda d: -codes.stride(d))
    flat = codes.permute(order)
    if not flat.is_contiguous():  # not a permutation of a dense block: gather by shape
        return table[codes.view(torch.uint8).to(torch.int32)]
    vals = table.index_select(0, flat.view(torch.uint8).reshape(-1).to(torch.int32)).view(flat.shape)
    inverse = [order.index(d) for d in range(codes.dim())]
    return vals.permute(inverse)


def _encode_groups(xv: torch.Tensor, dims: tuple, fmt, scale_rule: str):
    """MX-encodes the groups of `xv` whose members lie on axes `dims`.

    Returns:
        (codes, byte, finite): fp8 codes of xv's shape (torch fp8 dtype of `fmt`), the E8M0 byte per group
        (int64, xv's shape with `dims` of size 1; 0..254, a group holding NaN/Inf gets the byte of amax 0 and
        NaN codes) and the per-group finiteness mask (bool, same shape as byte).
    """
    # float32 first (exact upcast): mixed bf16 x float32 products and torch.aminmax are several times
    # slower on CPU than float32 ops and separate amin / amax (measured, one thread).
    xv = xv.to(torch.float32)
    # amax with NaN/Inf propagation (max(hi, -lo) = max |v|; NaN anywhere in a group -> NaN)
    amax = torch.maximum(xv.amax(dim=dims, keepdim=True), -xv.amin(dim=dims, keepdim=True))
    finite = torch.isfinite(amax)
    amax = torch.where(finite, amax, torch.zeros((), dtype=torch.float32, device=amax.device))
    sexp = _scale_exponent(amax, fmt, scale_rule)
    byte = torch.clamp(sexp + 127, 0, 254)
    byte = torch.where(amax == 0, torch.zeros_like(byte), byte)
    kexp = byte - 127  # X = 2**kexp, kexp in [-127, 127]
    # 2**-kexp and 2**kexp lie in [2**-127, 2**127]: exact in float32 (2**-127 as a subnormal), and a
    # float32 product with a power of two is the exact product rounded once to float32: the exact
    # float64 quotient rounded to float32 of nkilib.mx.quantize. A NaN multiplier marks the groups
    # holding NaN/Inf: NaN survives the clamp and the fp8 cast, so all their values come out NaN.
    inv = torch.where(finite, _pow2(-kexp).to(torch.float32),
                      torch.full((), float("nan"), dtype=torch.float32, device=amax.device))
    m = float(fmt.max_normal)
    y = xv * inv
    y.clamp_(-m, m)  # saturation (clip-then-RNE = RNE-then-saturate, proof in nkilib.mx.quantize)
    return y.to(FP8_DTYPES[fmt.name]), byte, finite  # RNE


def _qdq_blocks(xv: torch.Tensor, dims: tuple, fmt, scale_rule: str, out_dtype) -> torch.Tensor:
    """Quantize-dequantize of the groups of `xv` whose members lie on axes `dims` (same shape out).

    Runs the fused formulation (mlp_bwd_mxfp8_emulate_fused.qdq_fused, compiled) where
    ``set_fused_quantizer`` selects it, else the eager one below (``_qdq_eager``); both give the same
    bits (tests/torch/test_emulate_numerics.py).
    """
    fused = fused_quantizer_for(xv)
    if fused is not None:
        finfo = torch.finfo(FP8_DTYPES[fmt.name])
        max_frac = f32_fraction_bits(float(fmt.max_normal))
        out = fused(xv, dims, fmt.emax, fmt.mantissa_bits, int(math.log2(finfo.tiny)), float(fmt.max_normal),
                    max_frac, scale_rule, out_dtype)
        if out is not None:
            return out
    return _qdq_eager(xv, dims, fmt, scale_rule, out_dtype)


def _qdq_eager(xv: torch.Tensor, dims: tuple, fmt, scale_rule: str, out_dtype) -> torch.Tensor:
    """Eager quantize-dequantize (torch's fp8 cast in ``_encode_groups``, decode by table): few, memory-bound
    passes."""
    codes, byte, _ = _encode_groups(xv, dims, fmt, scale_rule)
    deq = _decode(codes, fmt.name, out_dtype)  # exact upcast
    # codes * 2**kexp: exact (<= 4 significant bits, magnitude >= 2**-143 > float32's 2**-149), except that
    # in float32 a code rounded up to 2**128 or more (amax >= 1.9375 * 2**127) overflows to Inf; float64
    # (the matmul's operands) keeps it finite, as nc_matmul_mx's products and nkilib.mx.mx_matmul do
    return deq.mul_(_pow2(byte - 127).to(out_dtype))


def _quantize_dequantize(x: torch.Tensor, dim: int, fmt, quant_scheme: str, scale_rule: str, k_tile: int,
                         out_dtype) -> torch.Tensor:
    """mx_quantize_dequantize without option parsing; x bf16 / fp16 / fp32, any layout, no copy in."""
    k = x.shape[dim]
    if k == 0 or k % MX_GROUP:
        raise ValueError(f"the quantized axis length K={k} must be a positive multiple of {MX_GROUP}")
    group_positions(k, quant_scheme, k_tile)  # validates the wrapX geometry (cached)
    if x.dim() == 2 and not x.is_contiguous() and x.t().is_contiguous():
        # a transposed view (e.g. d_gu.t()): work on the row-major storage, whose reductions and
        # elementwise passes run 2-3x faster on CPU (measured); the values are the same, only the view differs
        return _quantize_dequantize(x.t(), 1 - dim, fmt, quant_scheme, scale_rule, k_tile, out_dtype).t()
    outs = [_qdq_blocks(v, dims, fmt, scale_rule, out_dtype).reshape(
        *x.shape[:dim], -1, *x.shape[dim + 1:]) for v, dims in _group_views(x, dim, quant_scheme, k_tile)]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=dim)


def _scale_exponent(amax: torch.Tensor, fmt, scale_rule: str) -> torch.Tensor:
    """Unbiased E8M0 exponent per group (int64) of float32 amax values (exact, via frexp)."""
    mant, ex = torch.frexp(amax)  # amax = mant * 2**ex, mant in [0.5, 1)
    ex = ex.to(torch.int64)
    e = ex - 1  # floor(log2(amax)) for amax > 0
    if scale_rule == "neuron":
        return e - (fmt.emax - 1)
    if scale_rule == "ocp_floor":
        return e - fmt.emax
    # rceil: smallest s with amax <= max_normal * 2**s (see nkilib.mx.quantize._scale_bytes)
    mn, mex = math.frexp(float(fmt.max_normal))
    return ex - mex + (mant.to(torch.float64) > mn).to(torch.int64)


_EXACT_INPUTS = (torch.bfloat16, torch.float16, torch.float32)


def mx_quantize_dequantize(t: torch.Tensor, dim: int, fp8_dtype="float8_e4m3fn", quant_scheme="1x32",
                           scale_rule="neuron", k_tile: int = MX_K_TILE, dtype=torch.float32) -> torch.Tensor:
    """MX-quantizes `t` along `dim` and returns the dequantized values (codes * 2**scale) in `dtype`.

    Same groups, scale bytes and element codes as ``nkilib.mx.quantize_mx(..., scheme=quant_scheme,
    k_tile=k_tile, scale_rule=scale_rule)``: byte = clip(exponent + 127, 0, 254), all-zero group ->
    byte 0, a group holding NaN/Inf -> NaN scale (all its values NaN). Vectorised over whole tensors:
    the groups are views of `t` (``_group_views``), never gathered.

    Dimensions:
        t [..., K, ...] with K = t.shape[dim] a multiple of 32 (for "wrapX" every K tile a multiple
        of 128) -> float32 of the same shape.

    Args:
        t: float tensor (bf16 / fp16 / fp32 upcast exactly; float64 rounded to float32 first).
        dim: the quantized (contraction) axis.
        fp8_dtype: "float8_e4m3fn" or "float8_e5m2" (or the torch dtype).
        quant_scheme: "1x32" or "wrapX".
        scale_rule: "neuron" (quantize_mx, SDK 2.31+), "ocp_floor" or "rceil".
        k_tile: K tile of the "wrapX" geometry.
        dtype: torch.float32 (a code rounded up to 2**128 becomes Inf) or torch.float64 (exact).

    Returns:
        `dtype` tensor [same shape as t].
    """
    fmt = element_format(fp8_name(fp8_dtype))
    options.quant_scheme(quant_scheme)
    check_choice("scale_rule", scale_rule, SCALE_RULES)
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    x = t if t.dtype in _EXACT_INPUTS else t.to(torch.float32)
    return _quantize_dequantize(x, dim % max(x.dim(), 1), fmt, quant_scheme, scale_rule, k_tile, dtype)


def mx_quantize_rows(t: torch.Tensor, fp8_dtype="float8_e4m3fn", scale_rule="neuron"):
    """MX-quantizes `t` along its last axis in OCP 1x32 groups: the fp8 codes and E8M0 scale bytes themselves.

    Same codes and bytes as ``nkilib.mx.quantize_mx(t, axis=-1, scheme="1x32", scale_rule=scale_rule)``
    (the groups and arithmetic of ``mx_quantize_dequantize``; a group holding NaN/Inf gets byte 255 and NaN
    codes, whose e5m2 bit pattern is torch's, not nkilib.mx's: both decode to NaN); ``mx_dequantize_rows`` inverts
    it to ``mx_quantize_dequantize(t, -1, ...)``'s values. For payloads that travel quantized (expert-parallel
    all-to-alls).

    Dimensions:
        t [..., K] (K a positive multiple of 32) -> codes [..., K] (torch fp8 dtype), scales [..., K/32] uint8.
    """
    fmt = element_format(fp8_name(fp8_dtype))
    check_choice("scale_rule", scale_rule, SCALE_RULES)
    k = t.shape[-1] if t.dim() else 0
    if k == 0 or k % MX_GROUP:
        raise ValueError(f"mx_quantize_rows: the last axis must be a positive multiple of {MX_GROUP}, got shape "
                         f"{tuple(t.shape)}")
    x = t if t.dtype in _EXACT_INPUTS else t.to(torch.float32)
    groups = x.reshape(*x.shape[:-1], k // MX_GROUP, MX_GROUP)
    codes, byte, finite = _encode_groups(groups, (groups.dim() - 1,), fmt, scale_rule)
    scales = torch.where(finite, byte, torch.full_like(byte, SCALE_NAN_BYTE)).to(torch.uint8)
    return codes.reshape(x.shape), scales.squeeze(-1)


def mx_dequantize_rows(codes: torch.Tensor, scales: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """codes * 2**(scale - 127) per 1x32 group of the last axis (scale byte 255 -> NaN); ``mx_quantize_rows``'s
    inverse. float32 is exact except for codes rounded up to 2**128 or more (Inf); float64 is exact.

    Dimensions:
        codes [..., K] (torch fp8 dtype), scales [..., K/32] uint8 -> [..., K] in `dtype`.
    """
    names = {v: k for k, v in FP8_DTYPES.items()}
    if codes.dtype not in names:
        raise TypeError(f"mx_dequantize_rows: codes must be one of {sorted(names.values())}, got {codes.dtype}")
    k = codes.shape[-1]
    if scales.dtype != torch.uint8 or tuple(scales.shape) != (*codes.shape[:-1], k // MX_GROUP) or k % MX_GROUP:
        raise ValueError(f"mx_dequantize_rows: scales must be uint8 [..., K/32] = {(*codes.shape[:-1], k // MX_GROUP)}"
                         f" for codes {tuple(codes.shape)}, got {scales.dtype} {tuple(scales.shape)}")
    byte = scales.to(torch.int64).unsqueeze(-1)
    deq = _decode(codes.reshape(*codes.shape[:-1], k // MX_GROUP, MX_GROUP), names[codes.dtype], dtype)
    deq = deq.mul_(_pow2(byte - 127).to(dtype))
    deq = torch.where(byte == SCALE_NAN_BYTE, torch.full((), float("nan"), dtype=dtype, device=deq.device), deq)
    return deq.reshape(codes.shape)


# ----------------------------------------------------------------------------------------------
# the contract's matmul
# ----------------------------------------------------------------------------------------------


def _tiled_sum(a64: torch.Tensor, b64: torch.Tensor, tile: int) -> torch.Tensor:
    """sum over K tiles of fp32(a[:, tile] @ b[tile, :] in float64), accumulated in float32 in order.

    The slices are strided views (row- or column-major operands alike): BLAS / cuBLAS read them in
    place, so no operand is copied per tile. Every tile writes into the same float64 and float32
    buffers: fresh [M, N] allocations per tile cost ~15% of the GEMM time on CPU (page faults, measured).
    """
    m, k, n = a64.shape[0], a64.shape[1], b64.shape[1]
    if k <= tile:  # one tile (K == 0 cannot reach the kernel; it gives zeros)
        return (a64 @ b64).to(torch.float32)  # K=k, M=M, N=N
    if torch.is_grad_enabled() and (a64.requires_grad or b64.requires_grad):
        # differentiable callers get the same sums without the reused buffers (out= cannot record a graph)
        acc = None
        for k0 in range(0, k, tile):
            part = (a64[:, k0:k0 + tile] @ b64[k0:k0 + tile, :]).to(torch.float32)  # K=tile, M=M, N=N
            acc = part if acc is None else acc + part
        return acc
    tile_sum = torch.empty(m, n, dtype=a64.dtype, device=a64.device)
    tile_f32 = torch.empty(m, n, dtype=torch.float32, device=a64.device)
    acc = None
    for k0 in range(0, k, tile):
        torch.matmul(a64[:, k0:k0 + tile], b64[k0:k0 + tile, :], out=tile_sum)  # K=tile, M=M, N=N
        if acc is None:
            acc = tile_sum.to(torch.float32)
        else:
            tile_f32.copy_(tile_sum)  # float64 -> float32 (RNE), then a float32 add: rounded once each, in order
            acc.add_(tile_f32)
    return acc


def contract_matmul(a: torch.Tensor, b: torch.Tensor, *, matmul_precision="mxfp8", fp8_dtype="float8_e4m3fn",
                    quant_scheme="1x32", scale_rule="neuron", gemm="exact") -> torch.Tensor:
    """The kernel's matmul mm(A, B) = A @ B (module docstring), float32 result.

    Operands may be any strided views (e.g. ``w.t()``): they are quantized in place along K and the
    dequantized values (float64) keep the operand's layout, which BLAS reads as is.

    Dimensions:
        a [M, K], b [K, N] (bf16 values; other float dtypes are rounded to bf16 first) -> [M, N] float32.

    Args:
        a: left operand [M, K] (quantized along K = axis 1).
        b: right operand [K, N] (quantized along K = axis 0).
        matmul_precision: "mxfp8" or "bf16".
        fp8_dtype, quant_scheme, scale_rule: MX options (mxfp8 only).
        gemm: "exact" (the kernel's bits, default) or, not bit-exact, "fast" / "fp32" / "bf16": the same
            quantized operands summed by one float32-accumulating GEMM (mlp_bwd_mxfp8_emulate_fast.py).

    Returns:
        float32 [M, N].
    """
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"contract_matmul: incompatible operand shapes {tuple(a.shape)} @ {tuple(b.shape)}")
    options.matmul_precision(matmul_precision)
    gemm = resolve_gemm(gemm, a.device)
    a = a.to(torch.bfloat16)
    b = b.to(torch.bfloat16)
    if matmul_precision == "bf16":
        if gemm != "exact":
            return fast_gemm(a, b, gemm)
        return _tiled_sum(a.to(torch.float64), b.to(torch.float64), BF16_K_TILE)
    fmt = element_format(fp8_name(fp8_dtype))
    options.quant_scheme(quant_scheme)
    check_choice("scale_rule", scale_rule, SCALE_RULES)
    k = a.shape[1]
    kp = -(-k // MX_K_ALIGN) * MX_K_ALIGN
    if kp != k:  # zero padding along K, as the kernel's K tiles
        a = torch.nn.functional.pad(a, (0, kp - k))
        b = torch.nn.functional.pad(b, (0, 0, 0, kp - k))
    # the fast GEMMs take the same MX values in float32 (exact, except codes rounded up to 2**128: Inf) or,
    # for "bf16", in bf16 straight from the quantizer (the float32 values rounded once: exact in bf16's range)
    out_dtype = {"exact": torch.float64, "bf16": torch.bfloat16}.get(gemm, torch.float32)
    opts = dict(fmt=fmt, quant_scheme=quant_scheme, scale_rule=scale_rule, k_tile=MX_K_TILE, out_dtype=out_dtype)
    a_q = _quantize_dequantize(a, 1, **opts)  # [M, Kp]
    b_q = _quantize_dequantize(b, 0, **opts)  # [Kp, N]
    if gemm != "exact":
        return fast_gemm(a_q, b_q, gemm)
    return _tiled_sum(a_q, b_q, MX_K_TILE)


# ----------------------------------------------------------------------------------------------
# elementwise numerics
# ----------------------------------------------------------------------------------------------


def _f32_limit(v):
    return None if v is None else torch.tensor(v, dtype=torch.float32)


def clamp_and_mask(v32: torch.Tensor, lower, upper):
    """(clamp(v), mask) in float32 with the limits rounded to float32; mask = 1 where lower <= v <= upper."""
    c = v32
    ok = torch.ones_like(v32, dtype=torch.bool)
    if lower is not None:
        lo = _f32_limit(lower).to(v32.device)
        c = torch.maximum(c, lo)
        ok = ok & (v32 >= lo)
    if upper is not None:
        hi = _f32_limit(upper).to(v32.device)
        c = torch.minimum(c, hi)
        ok = ok & (v32 <= hi)
    return c, ok.to(torch.float32)


def _sigmoid64(x64):
    return 0.5 * (torch.tanh(0.5 * x64) + 1.0)


def _silu32(x32: torch.Tensor) -> torch.Tensor:
    """silu evaluated in float64 on a float32 input, rounded once to float32."""
    x64 = x32.to(torch.float64)
    return (x64 * _sigmoid64(x64)).to(torch.float32)


def _silu_dx32(x32: torch.Tensor) -> torch.Tensor:
    """silu'(x) = s * (1 + x * (1 - s)) in float64, rounded once to float32."""
    x64 = x32.to(torch.float64)
    s = _sigmoid64(x64)
    return (s * (1.0 + x64 * (1.0 - s))).to(torch.float32)


def _gelu_apprx_sigmoid32(x32: torch.Tensor) -> torch.Tensor:
    """ScalarE gelu_apprx_sigmoid x * sigmoid(1.702 x) in float64, rounded once to float32."""
    x64 = x32.to(torch.float64)
    return (x64 * _sigmoid64(options.GATE_ALPHAS["gpt_oss"] * x64)).to(torch.float32)


def _gelu_apprx_sigmoid_dx32(x32: torch.Tensor) -> torch.Tensor:
    """Its derivative s * (1 + a x (1 - s)), s = sigmoid(a x), a = 1.702, in float64, rounded once to float32."""
    alpha = options.GATE_ALPHAS["gpt_oss"]
    x64 = x32.to(torch.float64)
    s = _sigmoid64(alpha * x64)
    return (s * (1.0 + alpha * x64 * (1.0 - s))).to(torch.float32)


def activation_fns32(clamp_limits) -> tuple:
    """(act, act_dx) of the clamp's activation (options.ACTIVATIONS), float32 -> float32."""
    if options.clamp_activation(clamp_limits) == "gpt_oss":
        return _gelu_apprx_sigmoid32, _gelu_apprx_sigmoid_dx32
    return _silu32, _silu_dx32


def linear_factor(uc: torch.Tensor, clamp_limits) -> torch.Tensor:
    """The float32 linear factor: uc, or fp32(uc + 1) for activation "gpt_oss" (options.UP_OFFSETS)."""
    offset = options.UP_OFFSETS[options.clamp_activation(clamp_limits)]
    return uc + offset if offset else uc


def swiglu_activations(gate_pre: torch.Tensor, up: torch.Tensor, clamp_limits=None):
    """gate_act = bf16(act(clampG(gate_pre))), intermediate = bf16(f32(gate_act) * clampU(up)) (act silu, or
    gelu_apprx_sigmoid with clampU(up) + 1 for activation "gpt_oss").

    These are the kernel's phase-0 formulas; a forward that produces its checkpoints with them
    saves exactly what the kernel would recompute from the same gate_pre / up.

    Dimensions:
        gate_pre, up [S, I] (bf16) -> gate_act, intermediate [S, I] bf16.
    """
    gl, gu, ul, uu = clamp_tuple(clamp_limits)
    gc, _ = clamp_and_mask(gate_pre.to(torch.bfloat16).to(torch.float32), gl, gu)
    uc, _ = clamp_and_mask(up.to(torch.bfloat16).to(torch.float32), ul, uu)
    uc = linear_factor(uc, clamp_limits)
    gate_act = activation_fns32(clamp_limits)[0](gc).to(torch.bfloat16)
    intermediate = (gate_act.to(torch.float32) * uc).to(torch.bfloat16)
    return gate_act, intermediate


def recompute_projection(hidden_states: torch.Tensor, weight_rows: torch.Tensor, **mm_opts) -> torch.Tensor:
    """bf16(mm(X, W^T)) with K = H: the kernel's phase-0 recompute of gate_pre (W_gate) or up (W_up).

    Dimensions:
        hidden_states [S, H], weight_rows [I, H] -> [S, I] bf16.
    """
    return contract_matmul(hidden_states, weight_rows.t(), **mm_opts).to(torch.bfloat16)
