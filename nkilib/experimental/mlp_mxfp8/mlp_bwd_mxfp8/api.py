"""Both published call styles of mlp_backward_mxfp8_nki, normalised into one set of matmul operands.

The entry point (mlp_bwd_mxfp8_kernel.mlp_backward_mxfp8_nki) accepts the arguments of
    * the current nki-library release (positional order followed by our signature): output_grad,
      hidden_states, down_proj_weight, gate_up_weights, gate_up_weight_T, gate_up_weight_T_scales,
      gate_up_weights_scales, down_weight_T, down_weight_T_scales, output_grad_T, output_grad_T_scales,
      hidden_states_T, hidden_states_T_scales, gate_pre, gate_act, up, intermediate, run_with_lnc2,
      matmul_config, fp8_x4_dtype, spill_reload, use_scale_packing, clamp_limits;
    * the MLP-bwd MXFP8 API reference (keyword names; 2.31-era page
      https://awsdocs-neuron.readthedocs-hosted.com/en/v2.31.0/nki/library/api/mlp-bwd-mxfp8-kernel.html):
      output_hidden_states_grad, gate_proj_weight_T, up_proj_weight_T, down_proj_weight_T, hidden_T,
      hidden, the scratch buffers, phase{1..4}_tiles_{m,n,k}, recompute_tiles_{m,n,k} and every
      `*_scales` / `*_is_swizzled` pair.
A name means one thing in both styles; where the two styles name the same tensor differently they are
aliases (passing both is an error): output_grad / output_hidden_states_grad, down_weight_T /
down_proj_weight_T, down_weight_T_scales / down_weight_scales, intermediate / hidden.

Operand roles (every matmul operand of the kernel, `Kp` = K rounded up to 128):
| role (matmul, K)                 | read from, first match wins                                                |
|----------------------------------|----------------------------------------------------------------------------|
| dY, phase 1 (K=H)                | output_grad + output_grad_scales (pre-quantized [S, Hp/4]); output_grad    |
| X, recompute (K=H)               | hidden_states + hidden_states_scales; hidden_states                         |
| W_down, phase 1 (K=H)            | down_weight_T + scales; down_proj_weight [H, I]; down_weight_T bf16 [I, H] |
| W_gu, phase 2 (K=2I)             | gate_up_weight_T + scales; gate_proj_weight_T + gate_weight_scales with    |
|                                  | up_proj_weight_T + up_weight_scales (halves along I, fused in private HBM);|
|                                  | gate_up_weights [2I, H]; gate_up_weight_T [H, 2I]                          |
| W_gate / W_up, recompute (K=H)   | gate_up_weights (+ gate_up_weights_scales); gate_proj_weight_T /           |
|                                  | up_proj_weight_T [H, I]; gate_up_weight_T [H, 2I]                          |
| X, phase 3 (K=S)                 | hidden_states_T + scales; hidden_states [S, H]; hidden_states_T bf16 [H, S]|
| dY, phase 4 (K=S)                | output_grad_T + scales; output_grad [S, H]; output_grad_T bf16 [H, S]      |
Pre-transposed bf16 inputs are read only where no untransposed bf16 tensor serves the role: the
kernel reads [K, F] operands with one strided DMA and needs PE transposes for [F, K] ones, so e.g.
hidden_states [S, H] is cheaper than hidden_states_T [H, S] for phase 3. hidden_T [I, S] (bf16 or
pre-quantized) is validated and not read: phase 4 reads the intermediate [S, I] (`intermediate` /
`hidden`, or phase 1's recomputed one), which needs no transposes. The scratch buffers are validated
(shape) and not used: the kernel allocates only the HBM scratch it needs. gate_proj_weight_T /
up_proj_weight_T pre-quantized along I (gate_weight_scales / up_weight_scales with their *_is_swizzled flags,
the reference's phase-2 operands; both or neither) feed phase 2, which contracts over 2I with one operand:
each program copies the two halves' bytes side by side into W_gu^T [H, 2I] pre-quantized along 2I in its
private HBM (_fuse_halves; no dequantize / requantize). That is the same quantization for "1x32" (groups of
32 consecutive elements) and for "wrapX" when I % 512 == 0; wrapX with another I is rejected.

Pre-quantized operand ("MX operand" of a logical [F, K] matrix A quantized along K; reference.prequantize
builds both layouts): K zero-padded to Kp; elements MX-quantized in groups of 32 along K exactly as
nisa.quantize_mx does on chip (scale rule of SDK 2.31+, the kernel's quant_scheme grouping inside each
512-wide K tile; https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.quantize_mx.html);
codes are fp8 (fp8_x4_dtype's element format) packed four per 32-bit word, byte k of a little-endian
word = element k of the x4 group
(https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/deep-dives/mxfp-matmul.html); scales are
E8M0 bytes (value 2**(b - 127), 0xFF = NaN), dtype uint8 or float8_e8m0fnu (the bytes are used as is).
    * unswizzled (default): words [F, Kp/4] uint32 (or a float8_*_x4 dtype), word c = elements 4c..4c+3
      of row f in logical K order; scales [F, Kp/32], byte g = group g of the K tile's quantize_mx
      groups (for "1x32": elements 32g..32g+31).
    * swizzled (`*_is_swizzled=True`): the SBUF image of the quantized tiles stacked along K, F
      contiguous: words [Kp/4, F], row k0/4 + p = the x4 word quantize_mx writes at partition p for the
      K tile starting at k0 (its elements k_index(p, j), nkilib.mx.k_index; equal to the unswizzled
      order for "1x32", interleaved by 128 for "wrapX"); scales [Kp/32, F], row k0/32 + g = the scale
      of partition group g (partitions 8g..8g+7; nc_matmul_mx's quadrant rows without the gaps,
      https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.nc_matmul_mx.html).
      The kernel's loads read the unswizzled order, so each program first converts a swizzled operand
      with two HBM->HBM DMAs into its private HBM (correct, not faster).

Published internal names (kept; arguments differ from the API reference): get_program_sharding_info
(same); compute_phase1..4 take TensorDescriptors with our `k_axis` (not `is_f_by_k`), a MatmulConfig
`config` instead of TILES_IN_BLOCK_M/N/K, and phase 1 returns phase 2's resident panels (d_gate and d_up
are one [S, 2I] output); mlp_backward_mxfp8_base_nki takes the outputs first and the operand descriptors
this module builds (MlpBwdOperands), a MatmulSetup and a resolved MlpBwdMatmulConfig instead of the
phaseN_tiles_* integers, and allocates its own scratch (no d_gate / d_up / scratch descriptors).
"""
from __future__ import annotations

import nki.isa as nisa
import nki.language as nl

from ....core.kernel_helpers import kernel_assert, round_up
from .config import MatmulConfig, MlpBwdMatmulConfig, TensorDescriptor, max_n_tile
from .constants import MX_GROUP, MX_K_ALIGN, MX_K_TILE, MX_PACK, N_TILE, PARTITIONS

WORD_DTYPES = ("uint32", "float8_e4m3fn_x4", "float8_e5m2_x4")
SCALE_DTYPES = ("uint8", "float8_e8m0fnu")
PHASE_TILE_NAMES = ("phase1", "phase2", "phase3", "phase4", "recompute")


class MlpBwdOperands(nl.NKIObject):
    """Every matmul operand of one call as a TensorDescriptor (None where not available).

    Dimensions:
        dy_k_h: dY [S, H] as the K=H operand; x_k_h: X [S, H] (K=H, recompute); down: W_down (K=H, F=I);
        gate_up: W_gu (K=2I, F=H); gate_w / up_w: W_gate / W_up (K=H, F=I); x_k_s: X (K=S, F=H);
        dy_k_s: dY (K=S, F=H); checkpoints gate_pre, gate_act, up, intermediate: [S, I] bf16 or None.
        prequantized: names of the pre-quantized operands given.
    """

    def __init__(self, S, H, I, dy_k_h, x_k_h, down, gate_up, gate_w, up_w, x_k_s, dy_k_s, gate_pre, gate_act,
                 up, intermediate, prequantized):
        self.S, self.H, self.I = S, H, I
        self.dy_k_h, self.x_k_h, self.down, self.gate_up = dy_k_h, x_k_h, down, gate_up
        self.gate_w, self.up_w, self.x_k_s, self.dy_k_s = gate_w, up_w, x_k_s, dy_k_s
        self.gate_pre, self.gate_act, self.up, self.intermediate = gate_pre, gate_act, up, intermediate
        self.prequantized = prequantized

    @property
    def recompute(self) -> bool:
        return self.gate_pre == None or self.up == None  # noqa: E711


def check_2d(name, t, shape, dtypes):
    """t is a 2-D tensor of `shape` with a dtype named in `dtypes` (else AssertionError naming `name`)."""
    kernel_assert(t != None and hasattr(t, "shape"), f"{name} must be an HBM tensor, got {t!r}")  # noqa: E711
    kernel_assert(len(t.shape) == 2, f"{name} must be 2-D {list(shape)}, got shape {tuple(t.shape)}")
    kernel_assert(tuple(t.shape) == tuple(shape), f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    kernel_assert(str(t.dtype) in dtypes, f"{name} must have dtype {' or '.join(dtypes)}, got {t.dtype}")


def _alias(name_a, a, name_b, b):
    """The one of two names for the same tensor that was given (release name, API-reference name)."""
    kernel_assert(a == None or b == None,  # noqa: E711
                  f"{name_a} and {name_b} name the same tensor (nki-library release / API reference); pass one")
    return a if a != None else b  # noqa: E711


def _rank2(name, t, what):
    kernel_assert(hasattr(t, "shape") and len(t.shape) == 2,
                  f"{name} must be a 2-D {what} tensor, got {getattr(t, 'shape', t)!r}")
    return t.shape


def prequantized_td(name, words, scales, f, k, swizzled, scheme, read=True):
    """Descriptor of a pre-quantized [F, K] operand (module docstring), or None when `scales` == None.  # noqa: E711

    Swizzled operands are first converted into this program's private HBM (unswizzle) when `read`;
    read=False only validates (an operand the kernel does not read)."""
    if scales == None:  # noqa: E711
        kernel_assert(not swizzled, f"{name}_is_swizzled=True needs the pre-quantized scales of {name}")
        return None
    kernel_assert(words != None, f"{name}_scales is given but {name} is None: pass the x4 words too")  # noqa: E711
    kp = round_up(k, MX_K_ALIGN)
    wshape = (kp // MX_PACK, f) if swizzled else (f, kp // MX_PACK)
    sshape = (kp // MX_GROUP, f) if swizzled else (f, kp // MX_GROUP)
    check_2d(name, words, wshape, WORD_DTYPES)
    check_2d(f"{name}_scales", scales, sshape, SCALE_DTYPES)
    if not read:
        return TensorDescriptor(words, k_axis=1, scales=scales)
    if str(words.dtype) != "uint32":
        words = words.view(nl.uint32)
    if str(scales.dtype) != "uint8":
        scales = scales.view(nl.uint8)  # the E8M0 bytes travel as is (a dtype-converting DMA would not)
    if swizzled:
        words, scales = _unswizzle(words, scales, f, kp, scheme)
    return TensorDescriptor(words, k_axis=1, scales=scales)


def _unswizzle(words, scales, f, kp, scheme):
    """Private-HBM copies of a swizzled operand in the unswizzled layout: words [F, Kp/4], scales [F, Kp/32].

    Per K tile [k0, k0 + T) (T = 512, the last one Kp % 512 if nonzero, P = T/4 partitions): logical
    element k0 + k_index(p, j) of row f is byte j of swizzled word row k0/4 + p, column f.
    """
    out_words = nl.ndarray((f, kp // MX_PACK), dtype=nl.uint32, buffer=nl.private_hbm)
    out_scales = nl.ndarray((f, kp // MX_GROUP), dtype=nl.uint8, buffer=nl.private_hbm)
    src = words.view(nl.uint8)  # [Kp/4, 4F]: byte (r, 4f + j)
    dst = out_words.view(nl.uint8)  # [F, Kp]
    for k0 in range(0, kp, MX_K_TILE):
        T = min(MX_K_TILE, kp - k0)
        P = T // MX_PACK
        if scheme == "1x32":  # k = 4p + j: dst order (f, p, j)
            pattern = [[MX_PACK, f], [MX_PACK * f, P], [1, MX_PACK]]
        else:  # wrapX, k = p + P*j: dst order (f, j, p)
            pattern = [[MX_PACK, f], [1, MX_PACK], [MX_PACK * f, P]]
        nisa.dma_copy(dst=dst[:, k0:k0 + T], src=src.ap(pattern=pattern, offset=k0 * f))
    nisa.dma_copy(dst=out_scales[:, :], src=scales.ap(pattern=[[1, f], [f, kp // MX_GROUP]], offset=0))
    return out_words, out_scales


def _prequantized_halves(a, fused_given, H, I, scheme):
    """[(words name, scales name)] of the API reference's pre-quantized phase-2 halves gate_proj_weight_T /
    up_proj_weight_T (W_gate^T, W_up^T [H, I] quantized along I, gate_weight_scales / up_weight_scales), or []
    when neither scales tensor is given. Both halves or none; not with a pre-quantized gate_up_weight_T."""
    names = (("gate_proj_weight_T", "gate_weight_scales"), ("up_proj_weight_T", "up_weight_scales"))
    given = [sn for n, sn in names if a[sn] != None]  # noqa: E711
    if not given:
        return []
    kernel_assert(len(given) == 2, f"{given[0]} is given without {'up' if given[0][0] == 'g' else 'gate'}"
                                   "_weight_scales: phase 2 reads W_gate^T and W_up^T as one operand, pass both "
                                   "halves pre-quantized along I (or neither)")
    kernel_assert(not fused_given, "gate_up_weight_T_scales and gate_weight_scales / up_weight_scales both give a "
                                   "pre-quantized phase-2 W_gu^T: pass one of them")
    kernel_assert(scheme == "1x32" or I % MX_K_TILE == 0,
                  f"gate_weight_scales / up_weight_scales with quant_scheme='wrapX' need I % {MX_K_TILE} == 0, got "
                  f"I={I}: wrapX groups stride across each {MX_K_TILE}-wide K tile of 2I, so halves quantized along I "
                  "are a different quantization; pass gate_up_weight_T [H, 2I] pre-quantized along 2I "
                  "(reference.prequantize(W_gu.T, quant_scheme='wrapX')) with gate_up_weight_T_scales")
    return list(names)


def _fuse_halves(halves, f, i):
    """Phase 2's W_gu^T [H, 2I] pre-quantized along 2I, assembled in this program's private HBM from the two
    halves [H, I] pre-quantized along I (descriptors of unswizzled words [H, Ip/4] + scales [H, Ip/32]).

    Halves quantized along I are the fused operand's quantization whenever the MX groups of 2I never span the
    gate/up boundary and group each half alike: "1x32" groups are 32 consecutive elements (I is a multiple of
    32); "wrapX" groups depend on the 512-wide K tiles, which coincide when I % 512 == 0 (checked by
    _prequantized_halves). So the fused codes and scales are the halves' own bytes side by side: word columns
    [0, I/4) of each half, scale columns [0, I/32), then zero codes (and scale byte 0) up to Kp = 2I rounded up
    to 128. No values are dequantized or requantized; the copies are HBM->HBM DMAs (correct, not faster).
    """
    kp = round_up(2 * i, MX_K_ALIGN)
    words = nl.ndarray((f, kp // MX_PACK), dtype=nl.uint32, buffer=nl.private_hbm)
    scales = nl.ndarray((f, kp // MX_GROUP), dtype=nl.uint8, buffer=nl.private_hbm)
    wi, si = i // MX_PACK, i // MX_GROUP
    for half in range(2):
        nisa.dma_copy(dst=words[:, half * wi:(half + 1) * wi], src=halves[half].tensor[:, 0:wi])
        nisa.dma_copy(dst=scales[:, half * si:(half + 1) * si], src=halves[half].scales[:, 0:si])
    pad_words, pad_scales = kp // MX_PACK - 2 * wi, kp // MX_GROUP - 2 * si
    if pad_words > 0:
        zero_words = nl.ndarray((PARTITIONS, pad_words), dtype=nl.uint32, buffer=nl.sbuf)
        zero_scales = nl.ndarray((PARTITIONS, pad_scales), dtype=nl.uint8, buffer=nl.sbuf)
        nisa.memset(dst=zero_words, value=0)
        nisa.memset(dst=zero_scales, value=0)
        for f0 in range(0, f, PARTITIONS):
            rows = min(PARTITIONS, f - f0)
            nisa.dma_copy(dst=words[f0:f0 + rows, 2 * wi:], src=zero_words[:rows, :])
            nisa.dma_copy(dst=scales[f0:f0 + rows, 2 * si:], src=zero_scales[:rows, :])
    return TensorDescriptor(words, k_axis=1, scales=scales)


def _first(prequantized, bf16, k_axis):
    """The pre-quantized descriptor when given, else a descriptor of the bf16 tensor (or None)."""
    if prequantized != None:  # noqa: E711
        return prequantized
    return TensorDescriptor(bf16, k_axis=k_axis) if bf16 != None else None  # noqa: E711


def _bf16_td(name, t, shape, k_axis, f_base=0, f_size=-1):
    check_2d(name, t, shape, ("bfloat16",))
    return TensorDescriptor(t, k_axis=k_axis, f_base=f_base, f_size=f_size)


def resolve_operands(a, scheme, mx):
    """MlpBwdOperands of one call; `a` maps every tensor argument name of the entry point to its value
    (None when not given). `scheme`: quant_scheme; `mx`: matmul_precision == "mxfp8"."""
    dy = _alias("output_grad", a["output_grad"], "output_hidden_states_grad", a["output_hidden_states_grad"])
    down_t = _alias("down_weight_T", a["down_weight_T"], "down_proj_weight_T", a["down_proj_weight_T"])
    down_t_scales = _alias("down_weight_T_scales", a["down_weight_T_scales"], "down_weight_scales",
                           a["down_weight_scales"])
    intermediate = _alias("intermediate", a["intermediate"], "hidden", a["hidden"])
    x, gu, gu_t = a["hidden_states"], a["gate_up_weights"], a["gate_up_weight_T"]
    x_t, dy_t = a["hidden_states_T"], a["output_grad_T"]
    sw = a["is_swizzled"]
    w_down = a["down_proj_weight"]
    same = (w_down != None and gu != None and hasattr(gu, "shape") and hasattr(w_down, "shape")  # noqa: E711
            and tuple(gu.shape) == tuple(w_down.shape))
    kernel_assert(not same,
                  f"gate_up_weights [2I, H] has down_proj_weight's shape [H, I] {list(getattr(gu, 'shape', ()))}: "
                  "this looks like the API reference's positional order (gate_proj_weight_T, up_proj_weight_T, "
                  "down_proj_weight_T, gate_up_weights, ... after hidden_states); pass the reference's arguments by "
                  "keyword")

    # ---- S, H from a bf16 dY or X (else S from pre-quantized dY rows, H from a bf16 tensor); I from a weight ----
    dy_pq, x_pq = a["output_grad_scales"] != None, a["hidden_states_scales"] != None  # noqa: E711
    if dy != None and not dy_pq:  # noqa: E711
        S, H = _rank2("output_grad", dy, "[S, H]")
    elif x != None and not x_pq:  # noqa: E711
        S, H = _rank2("hidden_states", x, "[S, H]")
    else:
        kernel_assert(dy != None, "output_grad (or output_hidden_states_grad) [S, H] is required")  # noqa: E711
        S = _rank2("output_grad", dy, "[S, Hp/4] words")[1 if sw["output_grad"] else 0]
        H = None
        for name, t, axis in (("down_proj_weight", a["down_proj_weight"], 0), ("gate_up_weights", gu, 1),
                              ("output_grad_T", dy_t, 0), ("hidden_states_T", x_t, 0),
                              ("gate_proj_weight_T", a["gate_proj_weight_T"], 0)):
            if H == None and t != None and str(t.dtype) == "bfloat16":  # noqa: E711
                H = _rank2(name, t, "bf16")[axis]
        kernel_assert(H != None, "output_grad and hidden_states are pre-quantized: H is read from a bf16 "  # noqa: E711
                                     "down_proj_weight, gate_up_weights, output_grad_T or hidden_states_T; none given")
    if a["down_proj_weight"] != None:  # noqa: E711
        I = _rank2("down_proj_weight", a["down_proj_weight"], "[H, I]")[1]
    elif gu != None and a["gate_up_weights_scales"] == None:  # noqa: E711
        I = _rank2("gate_up_weights", gu, "[2I, H]")[0] // 2
    elif down_t != None:  # noqa: E711
        shape = _rank2("down_weight_T", down_t, "[I, H]")
        I = shape[1] if (down_t_scales != None and sw["down_weight_T"]) else shape[0]  # noqa: E711
    else:
        kernel_assert(False, "down_proj_weight [H, I] (or down_weight_T [I, H], bf16 or pre-quantized with "
                             "down_weight_T_scales) is required")
    kernel_assert(H % 32 == 0 and I % 32 == 0,
                  f"H and I must be multiples of 32 (MX groups along H and I); got H={H}, I={I}")

    def pq(name, words, scales, f, k, read=True):
        return prequantized_td(name, words, scales, f, k, sw[name], scheme, read)

    # ---- pre-quantized operands (recognised by their scales) ----
    pre = {
        "output_grad": pq("output_grad", dy, a["output_grad_scales"], S, H),
        "hidden_states": pq("hidden_states", x, a["hidden_states_scales"], S, H),
        "down_weight_T": pq("down_weight_T", down_t, down_t_scales, I, H),
        "gate_up_weight_T": pq("gate_up_weight_T", gu_t, a["gate_up_weight_T_scales"], H, 2 * I),
        "gate_up_weights": pq("gate_up_weights", gu, a["gate_up_weights_scales"], 2 * I, H),
        "output_grad_T": pq("output_grad_T", dy_t, a["output_grad_T_scales"], H, S),
        "hidden_states_T": pq("hidden_states_T", x_t, a["hidden_states_T_scales"], H, S),
        "hidden_T": pq("hidden_T", a["hidden_T"], a["hidden_T_scales"], I, S, read=False),  # validated only
    }
    halves = _prequantized_halves(a, pre["gate_up_weight_T"] != None, H, I, scheme)  # noqa: E711
    given = [k for k in pre if pre[k] != None] + (  # noqa: E711
        ["gate_proj_weight_T", "up_proj_weight_T"] if halves else [])
    kernel_assert(mx or not given, f"pre-quantized operands {given} need matmul_precision='mxfp8', got 'bf16'")
    if halves:
        pre["gate_up_weight_T"] = _fuse_halves([pq(n, a[n], a[sn], H, I) for n, sn in halves], H, I)
    gate_t_bf16 = None if halves else a["gate_proj_weight_T"]
    up_t_bf16 = None if halves else a["up_proj_weight_T"]

    # ---- bf16 tensors (shape and dtype checked where read) ----
    dy_bf16 = dy if pre["output_grad"] == None else None  # noqa: E711
    x_bf16 = x if pre["hidden_states"] == None else None  # noqa: E711
    gu_bf16 = gu if pre["gate_up_weights"] == None else None  # noqa: E711
    # (the halves leave it bf16 for recompute)
    gu_t_bf16 = gu_t if a["gate_up_weight_T_scales"] == None else None  # noqa: E711
    down_t_bf16 = down_t if pre["down_weight_T"] == None else None  # noqa: E711
    x_t_bf16 = x_t if pre["hidden_states_T"] == None else None  # noqa: E711
    dy_t_bf16 = dy_t if pre["output_grad_T"] == None else None  # noqa: E711
    if dy_bf16 != None:  # noqa: E711
        check_2d("output_grad", dy_bf16, (S, H), ("bfloat16",))
    if x_bf16 != None:  # noqa: E711
        check_2d("hidden_states", x_bf16, (S, H), ("bfloat16",))

    dy_k_h = _first(pre["output_grad"], dy_bf16, 1)
    kernel_assert(dy_k_h != None, "output_grad (or output_hidden_states_grad) [S, H] is required")  # noqa: E711
    x_k_h = _first(pre["hidden_states"], x_bf16, 1)

    down = pre["down_weight_T"]
    if down == None and a["down_proj_weight"] != None:  # noqa: E711
        down = _bf16_td("down_proj_weight", a["down_proj_weight"], (H, I), 0)
    if down == None and down_t_bf16 != None:  # noqa: E711
        down = _bf16_td("down_weight_T", down_t_bf16, (I, H), 1)

    gate_up = pre["gate_up_weight_T"]
    if gate_up == None and gu_bf16 != None:  # noqa: E711
        gate_up = _bf16_td("gate_up_weights", gu_bf16, (2 * I, H), 0)
    if gate_up == None and gu_t_bf16 != None:  # noqa: E711
        gate_up = _bf16_td("gate_up_weight_T", gu_t_bf16, (H, 2 * I), 1)
    kernel_assert(gate_up != None,  # noqa: E711
                  "phase 2 needs W_gu: pass gate_up_weights [2I, H] in bf16, or gate_up_weight_T [H, 2I] (bf16, or "
                  "pre-quantized along 2I with gate_up_weight_T_scales)")

    gate_w = up_w = None
    if pre["gate_up_weights"] != None:  # noqa: E711
        gate_w, up_w = pre["gate_up_weights"].window(0, I), pre["gate_up_weights"].window(I, I)
    elif gu_bf16 != None:  # noqa: E711
        gate_w, up_w = (TensorDescriptor(gu_bf16, k_axis=1, f_base=0, f_size=I),
                        TensorDescriptor(gu_bf16, k_axis=1, f_base=I, f_size=I))
    elif gate_t_bf16 != None or up_t_bf16 != None:  # noqa: E711
        gate_w = _bf16_td("gate_proj_weight_T", gate_t_bf16, (H, I), 0)
        up_w = _bf16_td("up_proj_weight_T", up_t_bf16, (H, I), 0)
    elif gu_t_bf16 != None:  # noqa: E711
        gate_w, up_w = (TensorDescriptor(gu_t_bf16, k_axis=0, f_base=0, f_size=I),
                        TensorDescriptor(gu_t_bf16, k_axis=0, f_base=I, f_size=I))

    x_k_s = _first(pre["hidden_states_T"], x_bf16, 0)
    if x_k_s == None and x_t_bf16 != None:  # noqa: E711
        x_k_s = _bf16_td("hidden_states_T", x_t_bf16, (H, S), 1)
    kernel_assert(x_k_s != None,  # noqa: E711
                  "phase 3 needs X: pass hidden_states [S, H] in bf16, or hidden_states_T [H, S] "
                  "(bf16, or pre-quantized along S with hidden_states_T_scales)")
    dy_k_s = _first(pre["output_grad_T"], dy_bf16, 0)
    if dy_k_s == None and dy_t_bf16 != None:  # noqa: E711
        dy_k_s = _bf16_td("output_grad_T", dy_t_bf16, (H, S), 1)
    kernel_assert(dy_k_s != None,  # noqa: E711
                  "phase 4 needs dY along S: pass output_grad_T [H, S] (bf16, or pre-quantized "
                  "with output_grad_T_scales) when output_grad is pre-quantized")

    # validated, not read (module docstring): pre-transposed bf16 tensors another operand already serves
    for name, t, shape in (("down_weight_T", down_t_bf16, (I, H)), ("gate_up_weight_T", gu_t_bf16, (H, 2 * I)),
                           ("hidden_states_T", x_t_bf16, (H, S)), ("output_grad_T", dy_t_bf16, (H, S)),
                           ("gate_up_weights", gu_bf16, (2 * I, H)), ("down_proj_weight", w_down, (H, I)),
                           ("gate_proj_weight_T", gate_t_bf16, (H, I)), ("up_proj_weight_T", up_t_bf16, (H, I))):
        if t != None:  # noqa: E711
            check_2d(name, t, shape, ("bfloat16",))
    if pre["hidden_T"] == None and a["hidden_T"] != None:  # noqa: E711
        check_2d("hidden_T", a["hidden_T"], (I, S), ("bfloat16",))
    for name, shape in (("d_gate_scratch", (S, I)), ("d_up_scratch", (S, I)), ("gate_pre_scratch", (S, I)),
                        ("gate_act_scratch", (S, I)), ("up_scratch", (S, I)), ("hidden_scratch", (S, I)),
                        ("silu_up_mul_gate_grad_T_scratch", (2 * I, S))):
        if a[name] != None:  # noqa: E711
            kernel_assert(hasattr(a[name], "shape") and tuple(a[name].shape) == shape,
                          f"{name} must be None or a {list(shape)} tensor, got shape {getattr(a[name], 'shape', None)}")

    ckpt = {}
    for name, t in (("gate_pre", a["gate_pre"]), ("gate_act", a["gate_act"]), ("up", a["up"]),
                    ("intermediate", intermediate)):
        if t != None:  # noqa: E711
            check_2d(name, t, (S, I), ("bfloat16",))
        ckpt[name] = t
    kernel_assert(down != None, "down_proj_weight [H, I] (or down_weight_T [I, H]) is required")  # noqa: E711
    if ckpt["gate_pre"] == None or ckpt["up"] == None:  # noqa: E711
        kernel_assert(gate_w != None and x_k_h != None,  # noqa: E711
                      "recomputing gate_pre/up needs X along H (hidden_states) and W_gate/W_up along H "
                      "(gate_up_weights, gate_proj_weight_T + up_proj_weight_T or gate_up_weight_T); pass them or "
                      "both the gate_pre and up checkpoints")
    return MlpBwdOperands(S, H, I, dy_k_h, x_k_h, down, gate_up, gate_w, up_w, x_k_s, dy_k_s, ckpt["gate_pre"],
                          ckpt["gate_act"], ckpt["up"], ckpt["intermediate"], given)


def matmul_config_from_tiles(tiles, matmul_config, recompute, n_max, transposes):
    """The API reference's phase{1..4}_tiles_{m,n,k} / recompute_tiles_{m,n,k} as a MlpBwdMatmulConfig,
    or `matmul_config` when none is given.

    Mapping onto our tiling (MatmulConfig: one [m_tile, n_tile] output tile per PSUM accumulation group):
    n_tile = tiles_n x 512 (the reference's N tile is one 512-column PSUM bank); tiles_m (blocking of
    128-row M tiles) and tiles_k (K tiles per PSUM pass; we always accumulate all of K in PSUM, in K
    order) change scheduling only and are accepted and ignored; m_tile stays 128. recompute_tiles_* is
    fused into phase 1 (one tile loop): recompute_tiles_n, when given and recomputing, sets phase 1's
    n_tile and must then agree with phase1_tiles_n if that is given too.

    Args:
        tiles: {"phase1": (m, n, k), ..., "recompute": (m, n, k)}, entries None where not given.
        matmul_config: the matmul_config argument.
        recompute: whether gate_pre/up are recomputed.
        n_max, transposes: the target's moving limit and phase_transposes (config.max_n_tile's PSUM rule).
    """
    for name in PHASE_TILE_NAMES:
        for axis, v in zip("mnk", tiles[name]):
            kernel_assert(v == None or (isinstance(v, int) and not isinstance(v, bool) and v >= 1),  # noqa: E711
                          f"{name}_tiles_{axis} must be a positive int or None, got {v!r}")
    given = [name for name in PHASE_TILE_NAMES if any(v != None for v in tiles[name])]  # noqa: E711
    if not given:
        return matmul_config
    kernel_assert(matmul_config == None,  # noqa: E711
                  f"pass either matmul_config or the API reference's {given[0]}_tiles_* arguments, not both")
    n1, nr = tiles["phase1"][1], tiles["recompute"][1]
    if recompute and nr != None:  # noqa: E711
        kernel_assert(n1 == None or n1 == nr,  # noqa: E711
                      f"recompute_tiles_n={nr} and phase1_tiles_n={n1} differ: the recompute is fused into phase 1's "
                      "tiles, which have one width")
        n1 = nr
    widths = [n1] + [tiles[f"phase{i}"][1] for i in (2, 3, 4)]
    for i, n in enumerate(widths):
        name = "recompute" if (i == 0 and recompute and nr != None) else f"phase{i + 1}"  # noqa: E711
        limit = min(n_max, max_n_tile(3 if (i == 0 and recompute) else 1, transposes[i]))
        kernel_assert(n == None or n * N_TILE <= limit,  # noqa: E711
                      f"{name}_tiles_n={n} asks for {n} x {N_TILE}-column output tiles; phase {i + 1} fits at most "
                      f"{limit // N_TILE} here (PSUM: {limit} fp32 columns per double-buffered accumulator)")
    return MlpBwdMatmulConfig(*[None if n == None else MatmulConfig(n_tile=n * N_TILE) for n in widths])  # noqa: E711


def phase_transposes(ops):
    """Which phases transpose an operand on the PE array (PSUM they need besides the accumulators):
    phase 1 (dY / X along H are K-contiguous) and phase 2 (d_gate_up rows) always; phases 3 / 4 when
    their X / dY operand is a bf16 [F, K] tensor."""
    def k_contiguous_bf16(td):
        return td.k_axis == 1 and not td.prequantized

    return (True, True, k_contiguous_bf16(ops.x_k_s), k_contiguous_bf16(ops.dy_k_s))
