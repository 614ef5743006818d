"""The SwiGLU backward epilogue on chip, shared by the dense MLP backward and the grouped MoE expert backward.

Per [msz, nsz] output tile of the down-projection gradient dI (fp32, PSUM or SBUF), with the forward's
gate_pre / up (bf16 tiles) and optionally its gate_act / intermediate:
    gc, maskG = clampG(gate_pre), uc, maskU = clampU(up)
    a = gate_act or bf16(act(gc)),  intermediate = bf16(a * uc)
    d_up = bf16((dI * a) * maskU),  d_gate = bf16(((dI * uc) * act'(gc)) * maskG)
every product a float32 multiply, left to right. The activation is the clamp's (ClampLimits.activation):
"silu" (act = nl.silu, act' = nl.silu_dx) or "gpt_oss" (act = nl.gelu_apprx_sigmoid = x*sigmoid(1.702x),
act' = nl.gelu_apprx_sigmoid_dx, and uc replaced by the linear factor fp32(uc + 1), so that
intermediate = a * (uc + 1) and d_gate's factor is (uc + 1); d_up is unchanged) (the numerics contract of
nkilib/experimental/mlp_mxfp8/mlp_bwd_mxfp8/reference.py, reference_phase1_down_proj_grad). The MoE kernel
applies its routing weight to dI first (dh = dI * p) and feeds dh here.

Split in two so a kernel can use the forward terms (e.g. the intermediate, for the routing-weight gradient)
between them: swiglu_forward_terms, then intermediate_tile (optional), then swiglu_backward_tile.
Engines: products with a PSUM operand on VectorE, products of two SBUF tiles on GpSimd, activations on
ScalarE, so the three share the epilogue; clamps (tensor_scalar) on VectorE unless the caller passes another
engine (clamp_engine, d_up_engine: the MoE kernel rebalances its pass A with them, docs/moe.md section 10).
Two exact rewrites save elementwise passes (docs/moe.md section 10, round 14e): a two-limit mask is
(clamp(x) == x), one tensor_tensor, instead of (x >= lower) and (x <= upper) * that; and the "gpt_oss"
offset is applied inside the product that uses it (scalar_tensor_tensor: fp32(fp32(uc + 1) * dI), the same
bits as dI * fp32(uc + 1) since an fp32 multiply commutes) unless the intermediate is computed on chip, which
materializes fp32(uc + 1) once for both products. On request (gate_mask_in_product, round 19a) a one-limit gate
mask is not materialized: d_gate's last product compares, (g <= limit) * t in one scalar_tensor_tensor.
On request (narrow, round 32a) the clamps and masks of bf16 inputs are written as bf16 where that is exact (every
limit a bf16 value; masks are 0 / 1), so their tensor_scalar passes qualify for the engines' 2-byte modes.
"""
from __future__ import annotations

import nki.isa as nisa
import nki.language as nl

from .matmul.constants import BF16_SIGNIFICANT_STEPS, PARTITIONS
from .kernel_helpers import kernel_assert, kernel_fail
from .options import UP_OFFSETS, clamp_activation


class SwigluTerms(nl.NKIObject):
    """Forward terms of one [msz, nsz] tile: gc (clamped gate), uc (clamped up; fp32 views, or the bf16
    inputs when unclamped), offset (the linear factor is fp32(uc + offset): 1.0 for "gpt_oss", else 0.0),
    lin (that factor as an fp32 view once materialized, else None; uc itself when offset is 0), masks (fp32
    0/1 views or None), a = gate_act (bf16 view), act_dx: the ScalarE derivative of the activation
    (nl.silu_dx or nl.gelu_apprx_sigmoid_dx), offset_engine: the engine that materializes lin."""

    def __init__(self, gc, mask_g, uc, mask_u, act, act_dx, msz, nsz, ncols, offset=0.0,
                 offset_engine=nisa.engine.unknown):
        self.gc, self.mask_g, self.uc, self.mask_u, self.act = gc, mask_g, uc, mask_u, act
        self.act_dx, self.msz, self.nsz, self.ncols = act_dx, msz, nsz, ncols
        self.offset, self.offset_engine = offset, offset_engine
        self.lin = uc if offset == 0.0 else None
        self.gate_cmp = None  # the gate's one-limit mask left to its product (MaskComparison), else None

    def linear_factor(self):
        """fp32(uc + offset) [msz, nsz], materialized once (tensor_scalar on offset_engine)."""
        if self.lin == None:  # noqa: E711
            lin = nl.ndarray((PARTITIONS, self.ncols), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=lin[:self.msz, :self.nsz], data=self.uc, op0=nl.add, operand0=self.offset,
                               engine=self.offset_engine)  # fp32(uc + 1)
            self.lin = lin[:self.msz, :self.nsz]
        return self.lin


def exact_in_bf16(value) -> bool:
    """Whether the float `value` is a normal bf16 number or zero (8 significant bits, exponent -126..127): then
    fp32(value) = bf16(value) = value. Plain Python (traced at specialization)."""
    if value == 0:
        return True
    m, e = abs(float(value)), 0
    if m != m or m == float("inf"):
        return False
    while m >= 2.0:
        m, e = m / 2.0, e + 1
    while m < 1.0:
        m, e = m * 2.0, e - 1
    return -126 <= e <= 127 and m * BF16_SIGNIFICANT_STEPS == int(m * BF16_SIGNIFICANT_STEPS)


def clamp_and_mask(x, lower, upper, msz, nsz, ncols, engine=nisa.engine.unknown, mask_engine=None, with_mask=True,
                   narrow=False):
    """(clamped [msz, nsz] fp32 view, mask view or None): clamp(x, lower, upper) and 1.0 where inside.

    x: bf16 or fp32 [msz, nsz] view; without limits it is returned as is (and no mask). The on-chip
    counterpart of nkilib.core.numerics.clamp_and_mask (NumPy) and nkilib.experimental.emulate_numerics'
    (torch). engine: of the tensor_scalar ops (unknown = the default, VectorE; ScalarE takes any operator
    pair on trn3 and (multiply/add) only on trn2, nki.isa.tensor_scalar page: a comparison or min/max there
    is trn3 only). mask_engine: of the mask when it is a tensor_scalar (None: engine); the two-limit mask's
    tensor_tensor runs on VectorE (on GpSimd it costs GPT-OSS's pipelined pass A more: docs/moe.md section 10,
    round 14e). Comparisons and clamps are exact in fp32, so the engine does not change a bit.

    The two-limit mask is (clamp(x) == x), one tensor_tensor
    (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.tensor_tensor.html),
    equal to (x >= lower) * (x <= upper) for every x: the clamp is max then min against the same fp32
    limits, so for lower <= x <= upper it returns x (a signed zero compares equal to either zero), for
    x < lower it returns lower != x (or upper, when upper < lower: also != x), for x > upper it returns
    upper != x; for x = NaN both are 0 (NaN == anything is false, whatever max / min return for NaN).
    With symmetric limits (lower == -upper, GPT-OSS's +-7) the mask is (|x| <= upper) instead, one tensor_scalar
    (cheaper than a tensor_tensor, and it can run on ScalarE): |x| is exact (the sign bit cleared) and
    fp32(-upper) = -fp32(upper), so |x| <= upper exactly when -upper <= x <= upper; +-0 give 1, and NaN gives 0
    (|NaN| is NaN, which compares false).
    with_mask: False for a one-limit x whose mask its product computes (MaskComparison): no mask pass, mask None.
    narrow: with a bf16 x, the mask is written as bf16 (1.0 and 0.0 are bf16 values) and, where every given limit
    is a bf16 value (exact_in_bf16), the clamped values too: clamp(x) is x or a limit, so bf16 holds it exactly and
    every reader (which computes in fp32) sees the same value; the passes then run in the engines' 2-byte modes
    (ScalarE's 2x on trn3: docs/moe.md section 10, round 32a). Otherwise fp32 as before.
    """
    has_lower, has_upper = lower != None, upper != None  # noqa: E711
    mask_engine = engine if mask_engine == None else mask_engine  # noqa: E711
    if not has_lower and not has_upper:
        return x, None
    narrow = narrow and x.dtype == nl.bfloat16
    exact = narrow and all(exact_in_bf16(v) for v in (lower, upper) if v != None)  # noqa: E711
    clamped = nl.ndarray((PARTITIONS, ncols), dtype=nl.bfloat16 if exact else nl.float32, buffer=nl.sbuf)
    c = clamped[:msz, :nsz]
    if with_mask or (has_lower and has_upper):
        mask = nl.ndarray((PARTITIONS, ncols), dtype=nl.bfloat16 if narrow else nl.float32, buffer=nl.sbuf)
        m = mask[:msz, :nsz]
    if has_lower and has_upper:
        nisa.tensor_scalar(dst=c, data=x, op0=nl.maximum, operand0=float(lower), op1=nl.minimum,
                           operand1=float(upper), engine=engine)
        if float(lower) == -float(upper):
            # symmetric limits: mask = (|x| <= upper) = (x >= -upper) * (x <= upper) (docstring), one tensor_scalar
            # on the clamps' engine (nl.abs: an arithmetic unary operator of "Supported Math Operators",
            # https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/nki.api.shared.html)
            nisa.tensor_scalar(dst=m, data=x, op0=nl.abs, operand0=0.0, op1=nl.less_equal, operand1=float(upper),
                               engine=mask_engine)
        else:
            # mask = (clamp(x) == x) = (x >= lower) * (x <= upper) (docstring): one pass instead of two
            nisa.tensor_tensor(dst=m, data1=c, data2=x, op=nl.equal, engine=nisa.engine.vector)
    elif has_lower:
        nisa.tensor_scalar(dst=c, data=x, op0=nl.maximum, operand0=float(lower), engine=engine)
        if not with_mask:
            return c, None
        nisa.tensor_scalar(dst=m, data=x, op0=nl.greater_equal, operand0=float(lower), engine=mask_engine)
    else:
        nisa.tensor_scalar(dst=c, data=x, op0=nl.minimum, operand0=float(upper), engine=engine)
        if not with_mask:
            return c, None
        nisa.tensor_scalar(dst=m, data=x, op0=nl.less_equal, operand0=float(upper), engine=mask_engine)
    return c, m


class MaskComparison(nl.NKIObject):
    """A one-limit mask left to the product that applies it: 1.0 where (x op limit), x a bf16 or fp32 [msz, nsz]
    view, op nl.less_equal (an upper limit) or nl.greater_equal (a lower one), limit an fp32 constant."""

    def __init__(self, x, op, limit):
        self.x, self.op, self.limit = x, op, limit

    def apply(self, dst, product):
        """dst = product * (x op limit): one scalar_tensor_tensor on VectorE (its only engine),
        fp32((x op limit) * product), where the comparison gives fp32 1.0 or 0.0 (an arithmetic operator of
        "Supported Math Operators",
        https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/nki.api.shared.html;
        https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.0/nki/api/generated/nki.isa.scalar_tensor_tensor.html):
        the bits of tensor_tensor(product, mask), the comparison being clamp_and_mask's tensor_scalar on the same x and
        limit (exact in fp32; NaN compares false: 0) and an fp32 multiply commuting; the one rounding is dst's."""
        nisa.scalar_tensor_tensor(dst=dst, data=self.x, op0=self.op, operand0=self.limit, op1=nl.multiply,
                                  operand1=product)


class MaskedProduct(nl.NKIObject):
    """A mask product not yet issued: dst = product * (the MaskComparison), by issue()."""

    def __init__(self, comparison, dst, product):
        self.comparison, self.dst, self.product = comparison, dst, product

    def issue(self):
        self.comparison.apply(self.dst, self.product)


def swiglu_forward_terms(gate_pre, up, gate_act, clamp, msz, nsz, ncols,
                         clamp_engine=nisa.engine.unknown, up_mask_engine=None,
                         gate_mask_in_product=False, narrow=False) -> SwigluTerms:
    """Clamps, masks and gate_act of one tile.

    Dimensions:
        gate_pre, up: bf16 [msz, nsz] SBUF views; gate_act: bf16 [msz, nsz] view of the checkpoint, or
        None (computed: bf16(act(gc)) on ScalarE); clamp: ClampLimits-like (four bounds, None = no bound, and
        its activation).
    clamp_engine: engine of the clamps' and the offset's tensor_scalar ops (clamp_and_mask): the default
    (VectorE) for the dense kernel; the MoE kernel passes ScalarE to unload VectorE (the same fp32 bits).
    up_mask_engine: engine of up's mask when it is a tensor_scalar (one limit, or symmetric limits; None:
    clamp_engine), so a kernel can move that pass alone off ScalarE. The "gpt_oss" offset is not applied here:
    the products add it (SwigluTerms.linear_factor, swiglu_backward_tile).
    gate_mask_in_product: where the gate has one limit (GPT-OSS: above 7), its mask is not materialized; d_gate's
    last product compares (MaskComparison.apply): one ScalarE / VectorE mask pass and one GpSimd product become one
    VectorE scalar_tensor_tensor (docs/moe.md section 10, round 19a).
    narrow: clamp_and_mask's (bf16 clamps and masks where exact; round 32a).
    """
    activation = clamp_activation(clamp, fail=kernel_fail)
    g_lo, g_hi = clamp.non_linear_lower, clamp.non_linear_upper
    gate_cmp = None
    if gate_mask_in_product and (g_lo == None) != (g_hi == None):  # noqa: E711  one limit
        gate_cmp = (MaskComparison(gate_pre, nl.less_equal, float(g_hi)) if g_hi != None else  # noqa: E711
                    MaskComparison(gate_pre, nl.greater_equal, float(g_lo)))
    act_fn, act_dx = (nl.silu, nl.silu_dx) if activation == "silu" else (nl.gelu_apprx_sigmoid,
                                                                         nl.gelu_apprx_sigmoid_dx)
    gc, mask_g = clamp_and_mask(gate_pre, g_lo, g_hi, msz, nsz, ncols, engine=clamp_engine,
                                with_mask=gate_cmp == None, narrow=narrow)  # noqa: E711
    uc, mask_u = clamp_and_mask(up, clamp.linear_lower, clamp.linear_upper, msz, nsz, ncols, engine=clamp_engine,
                                mask_engine=up_mask_engine, narrow=narrow)
    if gate_act == None:  # noqa: E711
        act = nl.ndarray((PARTITIONS, ncols), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.activation(dst=act[:msz, :nsz], op=act_fn, data=gc)  # gate_act = bf16(act(gc))
        gate_act = act[:msz, :nsz]
    terms = SwigluTerms(gc, mask_g, uc, mask_u, gate_act, act_dx, msz, nsz, ncols, offset=UP_OFFSETS[activation],
                        offset_engine=clamp_engine)
    terms.gate_cmp = gate_cmp
    return terms


def intermediate_tile(terms: SwigluTerms):
    """intermediate = bf16(gate_act * fp32(uc + offset)) [msz, nsz] (GpSimd), a new SBUF view (the linear
    factor is materialized here, so d_gate's product reuses it)."""
    inter = nl.ndarray((PARTITIONS, terms.ncols), dtype=nl.bfloat16, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=inter[:terms.msz, :terms.nsz], data1=terms.act, data2=terms.linear_factor(),
                       op=nl.multiply, engine=nisa.engine.gpsimd)
    return inter[:terms.msz, :terms.nsz]


def swiglu_backward_tile(d_i, terms: SwigluTerms, d_gate_dst, d_up_dst, d_i_engine=nisa.engine.vector,
                         d_up_engine=None, gate_mask_later=False, gate_first=False,
                         d_gate_engine=nisa.engine.gpsimd, gate_psum_first=False):
    """d_up = bf16((dI * a) * maskU), d_gate = bf16(((dI * uc) * act'(gc)) * maskG) into the bf16 SBUF
    views d_gate_dst / d_up_dst (the caller stores them).

    Dimensions:
        d_i: fp32 [msz, nsz] (PSUM or SBUF); d_gate_dst, d_up_dst: bf16 [msz, nsz].
    d_i_engine: engine of the two products that read d_i: VectorE by default (it reads PSUM; GpSimd cannot), so
    only an SBUF d_i such as the MoE kernel's dh may take GpSimd to unload VectorE (the same fp32 multiply).
    d_up_engine: engine of the product dI * a alone (None: d_i_engine), so a kernel can balance the two.
    d_gate_engine: engine of d_gate's SBUF product (dI * uc) * act'(gc): GpSimd by default (it unloads VectorE), or
    VectorE where GpSimd's SBUF access would hold the bus VectorE's perf modes share with it (an fp32 product runs
    outside VectorE's perf modes); the same fp32 multiply on either engine, so the same bits.
    gate_first: d_gate's products issued before d_up's (the same instructions, so the same bits): VectorE, which runs in
    program order, then computes dI * uc first and GpSimd's d_gate product that follows it starts one product earlier.
    gate_psum_first (exclusive with gate_first): only d_gate's PSUM product (dI * uc) goes before d_up's products, and
    its activation derivative act'(gc) and the rest after them: VectorE's order is gate_first's (the same engines, the
    same bits), but the tiles are first written in the order dI * uc, d_up_dst, act'(gc) instead of act'(gc), dI * uc,
    the destinations: a destination tile written first here (the dense kernel's d_gate_up row tile) is placed between
    the two fp32 temporaries, where without either flag it comes before both, not after both (an allocator placing in
    order of first access then keeps its later placements where they were; docs/dense-performance.md round 39).
    With an offset not yet materialized (no intermediate_tile), dI * fp32(uc + 1) is one scalar_tensor_tensor
    on VectorE (its only engine,
    https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.scalar_tensor_tensor.html):
    fp32(fp32(uc + 1) * dI), the bits of the reference's dI * (uc + 1) (an fp32 multiply commutes).
    With the gate's mask left to its product (terms.gate_cmp: swiglu_forward_terms' gate_mask_in_product), the last
    product of d_gate is that comparison's scalar_tensor_tensor; gate_mask_later: returned as a MaskedProduct for the
    caller to issue (before anything reads d_gate_dst) instead of issued here, so that VectorE, which runs in program
    order, does not wait for GpSimd's product it reads. Returns that MaskedProduct, else None.
    """
    msz, nsz, ncols = terms.msz, terms.nsz, terms.ncols
    a, mask_u, mask_g = terms.act, terms.mask_u, terms.mask_g
    up_engine = d_i_engine if d_up_engine == None else d_up_engine  # noqa: E711
    kernel_assert(not (gate_first and gate_psum_first), "swiglu_backward_tile: gate_first and gate_psum_first are "
                  f"exclusive, got gate_first={gate_first}, gate_psum_first={gate_psum_first}")
    t_g = _gate_psum_product(d_i, terms, d_i_engine) if gate_psum_first else None
    if not gate_first:  # d_up = bf16((dI * a) * mask_u)
        _d_up_product(d_i, a, mask_u, d_up_dst, up_engine, msz, nsz, ncols)
    # d_gate = bf16(((dI * uc) * act'(gc)) * mask_g)
    sd = nl.ndarray((PARTITIONS, ncols), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=sd[:msz, :nsz], op=terms.act_dx, data=terms.gc)
    if t_g == None:  # noqa: E711
        t_g = _gate_psum_product(d_i, terms, d_i_engine)
    masked = None
    if mask_g == None and terms.gate_cmp == None:  # noqa: E711
        nisa.tensor_tensor(dst=d_gate_dst, data1=t_g[:msz, :nsz], data2=sd[:msz, :nsz], op=nl.multiply,
                           engine=d_gate_engine)
    else:
        t_g2 = nl.ndarray((PARTITIONS, ncols), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=t_g2[:msz, :nsz], data1=t_g[:msz, :nsz], data2=sd[:msz, :nsz], op=nl.multiply,
                           engine=d_gate_engine)
        if terms.gate_cmp == None:  # noqa: E711
            nisa.tensor_tensor(dst=d_gate_dst, data1=t_g2[:msz, :nsz], data2=mask_g, op=nl.multiply,
                               engine=nisa.engine.gpsimd)
        else:  # the one-limit mask compared in its product
            masked = MaskedProduct(terms.gate_cmp, d_gate_dst, t_g2[:msz, :nsz])
            if not gate_mask_later:
                masked.issue()
                masked = None
    if gate_first:
        _d_up_product(d_i, a, mask_u, d_up_dst, up_engine, msz, nsz, ncols)
    return masked


def _gate_psum_product(d_i, terms: SwigluTerms, d_i_engine):
    """d_gate's product that reads PSUM, dI * uc (dI * fp32(uc + offset) without a linear factor), into a fresh fp32
    [P, ncols] SBUF tile; returns it (swiglu_backward_tile)."""
    msz, nsz = terms.msz, terms.nsz
    t_g = nl.ndarray((PARTITIONS, terms.ncols), dtype=nl.float32, buffer=nl.sbuf)
    if terms.lin == None:  # noqa: E711  (dI * fp32(uc + offset), the offset applied in the same pass)
        nisa.scalar_tensor_tensor(dst=t_g[:msz, :nsz], data=terms.uc, op0=nl.add, operand0=terms.offset,
                                  op1=nl.multiply, operand1=d_i)
    else:
        nisa.tensor_tensor(dst=t_g[:msz, :nsz], data1=d_i, data2=terms.lin, op=nl.multiply, engine=d_i_engine)
    return t_g


def _d_up_product(d_i, a, mask_u, d_up_dst, up_engine, msz, nsz, ncols):
    """d_up = bf16((dI * a) * mask_u) into d_up_dst (swiglu_backward_tile)."""
    if mask_u == None:  # noqa: E711
        nisa.tensor_tensor(dst=d_up_dst, data1=d_i, data2=a, op=nl.multiply, engine=up_engine)
    else:
        t_up = nl.ndarray((PARTITIONS, ncols), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=t_up[:msz, :nsz], data1=d_i, data2=a, op=nl.multiply, engine=up_engine)
        nisa.tensor_tensor(dst=d_up_dst, data1=t_up[:msz, :nsz], data2=mask_u, op=nl.multiply,
                           engine=nisa.engine.gpsimd)
