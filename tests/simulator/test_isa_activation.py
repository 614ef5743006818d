"""nisa.activation / nisa.activation_reduce (docs/simulator.md: activation entry, choice-activation-reduce,
choice-activation-numerics).

Activation functions are checked against independent float64 numpy/math formulas; bf16 outputs of
exact functions (copy, relu, square) must equal the reference rounded to bf16 bit for bit, those of
transcendental functions within 1 bf16 ulp (the simulator evaluates them in float64 with its own
formulas, so the float32 intermediate may differ in the last bit).
"""
import math

import numpy as np
import pytest

import nki.isa as nisa
import nki.language as nl
from nkilib.simulator.errors import NkiValidationError
from simkit import BF16, bits, oversized_tile, randn, run_tiles

RC = nisa.reduce_cmd


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


_erf = np.vectorize(math.erf)

# independent float64 references (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/nki.api.shared.html;
# silu_dx = s(x)(1 + x(1 - s(x))))
REFS = {
    "copy": lambda x: x,
    "silu": lambda x: x * _sigmoid(x),
    "silu_dx": lambda x: _sigmoid(x) * (1.0 + x * (1.0 - _sigmoid(x))),
    # GELU's sigmoid approximation x s(1.702 x) (Hendrycks & Gimpel, arXiv:1606.08415 sec. 2; docs:
    # https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/api/generated/nki.language.gelu_apprx_sigmoid.html)
    "gelu_apprx_sigmoid": lambda x: x * _sigmoid(1.702 * x),
    "gelu_apprx_sigmoid_dx": lambda x: _sigmoid(1.702 * x) + 1.702 * x * _sigmoid(1.702 * x) * _sigmoid(-1.702 * x),
    "sigmoid": _sigmoid,
    "exp": np.exp,
    "gelu": lambda x: 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0))),
    "relu": lambda x: np.where(x > 0, x, 0.0),
    "tanh": np.tanh,
    "square": lambda x: x * x,
    "rsqrt": lambda x: 1.0 / np.sqrt(x),
}
EXACT = ("copy", "relu", "square")


def _act(op, **kw):
    return lambda d, o: nisa.activation(dst=o, op=op, data=d, **kw)


def test_activation_hand_computed_scale_bias_tile():
    x = np.array([[1.0, -2.0, 0.5], [3.0, 0.0, -1.0]], np.float32)
    b = np.array([[1.0], [-1.0]], np.float32)
    (out,), tr = run_tiles(lambda d, bb, o: nisa.activation(dst=o, op=nl.copy, data=d, bias=bb, scale=2.0),
                           (x, b), [((2, 3), nl.float32)], trace=True)
    np.testing.assert_array_equal(out, [[3.0, -3.0, 2.0], [5.0, -1.0, -3.0]])  # 2x + b
    assert (tr[0].instr, tr[0].engine, tr[0].attrs["elems"], tr[0].attrs["op"]) == ("activation", "scalar", 3, "copy")


def test_activation_hand_computed_relu_scale_tile_scalar_bias():
    x = np.array([[1.0, -2.0], [3.0, 4.0]], np.float32)
    s = np.array([[-1.0], [0.5]], np.float32)
    (out,) = run_tiles(lambda d, ss, o: nisa.activation(dst=o, op=nl.relu, data=d, scale=ss, bias=0.25),
                       (x, s), [((2, 2), nl.float32)])
    np.testing.assert_array_equal(out, [[0.0, 2.25], [1.75, 2.25]])  # relu(s*x + 0.25)


@pytest.mark.parametrize("fn", list(REFS))
@pytest.mark.parametrize("out_dtype", [nl.float32, nl.bfloat16])
def test_activation_functions_match_formulas(fn, out_dtype):
    x = randn(20, (32, 64), scale=1.5)
    if fn == "rsqrt":
        x = np.abs(x) + np.float32(0.05)
    (out,) = run_tiles(_act(getattr(nl, fn)), (x,), [((32, 64), out_dtype)])
    ref32 = REFS[fn](x.astype(np.float64)).astype(np.float32)
    if out_dtype == nl.float32:
        if fn in EXACT:
            np.testing.assert_array_equal(out, ref32)
        else:
            np.testing.assert_allclose(out, ref32, rtol=2e-6, atol=1e-7)
        return
    got, want = bits(out).astype(np.int32), bits(ref32.astype(BF16)).astype(np.int32)
    if fn in EXACT:
        np.testing.assert_array_equal(got, want)
    else:
        assert np.abs(got - want).max() <= 1


@pytest.mark.parametrize("out_dtype", [nl.float32, nl.bfloat16])
def test_activation_random_scale_and_bias_tiles(out_dtype):
    x = randn(21, (64, 2, 24), dtype=BF16)
    s = randn(22, (64, 1), scale=0.5)
    b = randn(23, (64, 1), dtype=BF16)
    (out,) = run_tiles(lambda d, ss, bb, o: nisa.activation(dst=o, op=nl.copy, data=d, scale=ss, bias=bb),
                       (x, s, b), [((64, 48), out_dtype)], psum_inputs=(0,))
    # two float32 roundings: data*scale, then + bias
    want = (x.astype(np.float32).reshape(64, 48) * s).astype(np.float32) + b.astype(np.float32)
    if out_dtype == nl.float32:
        np.testing.assert_array_equal(out, want)
    else:
        np.testing.assert_array_equal(bits(out), bits(want.astype(BF16)))


def test_activation_reduce_registers_across_calls():
    x1 = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], np.float32)
    x2 = np.array([[10.0, 20.0, 30.0], [-1.0, -1.0, -1.0]], np.float32)

    def body(a, b, o1, o2, o3, r1, r2, r3, r4):
        nisa.activation(dst=o1, op=nl.copy, data=a, reduce_op=nl.add, reduce_cmd=RC.reset_reduce, reduce_res=r1)
        nisa.activation(dst=o2, op=nl.square, data=b, reduce_op=nl.add, reduce_cmd=RC.reduce, reduce_res=r2)
        nisa.activation(dst=o3, op=nl.copy, data=b, reduce_cmd=RC.idle, reduce_res=r3)  # idle: regs untouched
        nisa.activation(dst=o3, op=nl.copy, data=b, reduce_cmd=RC.reset)
        nisa.activation(dst=o3, op=nl.copy, data=b, reduce_res=r4)

    o1, o2, o3, r1, r2, r3, r4 = run_tiles(body, (x1, x2), [((2, 3), nl.float32)] * 3 + [((2, 1), nl.float32)] * 4)
    np.testing.assert_array_equal(r1[:, 0], [6.0, 15.0])
    np.testing.assert_array_equal(r2[:, 0], [6.0 + 1400.0, 15.0 + 3.0])  # += sum of squares
    np.testing.assert_array_equal(r3[:, 0], [1406.0, 18.0])
    np.testing.assert_array_equal(r4[:, 0], [0.0, 0.0])  # reset zeroes the registers
    np.testing.assert_array_equal(o2, x2 * x2)


def test_activation_reduce_sums_fp32_results_before_downcast():
    # 1 + 2^-8 is a bf16 tie that rounds to 1.0; the register sums the float32 values (4.015625)
    x = np.full((3, 4), 1.0 + 2.0 ** -8, np.float32)
    o, r = run_tiles(lambda d, dst, res: nisa.activation(dst=dst, op=nl.copy, data=d, reduce_op=nl.add,
                                                         reduce_cmd=RC.reset_reduce, reduce_res=res),
                     (x,), [((3, 4), nl.bfloat16), ((3, 1), nl.float32)])
    np.testing.assert_array_equal(o.astype(np.float32), np.ones((3, 4), np.float32))
    np.testing.assert_array_equal(r[:, 0], [4.015625] * 3)


def test_activation_registers_are_per_partition_lane():
    x = np.arange(8, dtype=np.float32).reshape(4, 2)  # row sums 1, 5, 9, 13

    def body(d, o, r):
        nisa.activation(dst=o, op=nl.copy, data=d, reduce_op=nl.add, reduce_cmd=RC.reset_reduce)
        # lanes 2..3 accumulate again; lanes 0..1 keep their first sums
        nisa.activation(dst=o[2:4, :], op=nl.copy, data=d[2:4, :], reduce_op=nl.add, reduce_cmd=RC.reduce)
        nisa.activation(dst=o, op=nl.copy, data=d, reduce_res=r)

    _, r = run_tiles(body, (x,), [((4, 2), nl.float32), ((4, 1), nl.float32)])
    np.testing.assert_array_equal(r[:, 0], [1.0, 5.0, 18.0, 26.0])


def test_activation_reduce_matches_numpy_sum():
    x = randn(24, (128, 96))
    b = randn(25, (128, 1))
    (o, r), tr = run_tiles(lambda d, bb, dst, res: nisa.activation_reduce(dst=dst, op=nl.exp, data=d, reduce_op=nl.add,
                                                                          reduce_res=res, bias=bb, scale=0.5),
                           (x, b), [((128, 96), nl.bfloat16), ((128, 1), nl.float32)], trace=True)
    y = np.exp(((x * np.float32(0.5)).astype(np.float32) + b).astype(np.float64))
    np.testing.assert_allclose(r[:, 0], y.sum(axis=1), rtol=1e-6)
    assert (tr[0].instr, tr[0].engine, tr[0].attrs["reduce_cmd"]) == ("activation_reduce", "scalar", "reset_reduce")


def test_activation_reduce_resets_registers():
    x = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)

    def body(d, o, r):
        nisa.activation(dst=o, op=nl.copy, data=d, reduce_op=nl.add, reduce_cmd=RC.reset_reduce)
        nisa.activation_reduce(dst=o, op=nl.copy, data=d, reduce_op=nl.add, reduce_res=r)

    _, r = run_tiles(body, (x,), [((2, 2), nl.float32), ((2, 1), nl.float32)])
    np.testing.assert_array_equal(r[:, 0], [3.0, 7.0])  # not 6 / 14: the registers were reset first


X = np.ones((2, 4), np.float32)


@pytest.mark.parametrize("kw, match", [
    (dict(op=nl.add), r"op=nl.add is not an activation function"),
    (dict(op=nl.bitwise_and), r"op=nl.bitwise_and is not an activation function"),
    (dict(op=np.exp), r"argument 'op' must be an nl operator"),
    (dict(op=nl.copy, reduce_op=nl.maximum, reduce_cmd=RC.reset_reduce), r"reduce_op must be nl.add, got nl.maximum"),
    (dict(op=nl.copy, reduce_cmd=RC.reduce), r"reduce_cmd=reduce accumulates .* needs reduce_op=nl.add"),
    (dict(op=nl.copy, reduce_op=nl.add, reduce_cmd=2), r"reduce_cmd must be an nisa.reduce_cmd member, got 2"),
    (dict(op=nl.copy, reduce_op=nl.add, reduce_cmd=RC.load_reduce), r"reduce_cmd=load_reduce is not supported"),
    (dict(op=nl.copy, scale="2"), r"argument 'scale' must be a number or a \[P, 1\] tile, got '2'"),
    (dict(op=nl.copy, bias=True), r"argument 'bias' must be a number or a \[P, 1\] tile, got True"),
])
def test_activation_rejects_bad_arguments(kw, match):
    with pytest.raises(NkiValidationError, match=r"nisa.activation: " + match):
        run_tiles(lambda d, o: nisa.activation(dst=o, data=d, **kw), (X,), [((2, 4), nl.float32)])


@pytest.mark.parametrize("arg, arr, match", [
    ("scale", np.ones((2, 1), BF16), r"scale tile .* must be float32, got bfloat16"),
    ("scale", np.ones((2, 2), np.float32), r"argument 'scale' must be a \[2, 1\] tile, got shape \(2, 2\)"),
    ("bias", np.ones((1, 1), np.float32), r"argument 'bias' must be a \[2, 1\] tile, got shape \(1, 1\)"),
    ("reduce_res", np.ones((2, 2), np.float32), r"reduce_res must be a \[2, 1\] tile, got shape \(2, 2\)"),
])
def test_activation_rejects_bad_vector_operands(arg, arr, match):
    def body(d, t, o):
        nisa.activation(dst=o, op=nl.copy, data=d, **{arg: t})

    with pytest.raises(NkiValidationError, match=r"nisa.activation: " + match):
        run_tiles(body, (X, arr), [((2, 4), nl.float32)])


def test_activation_rejects_tfloat32_bias():
    def body(d, o):
        b = nl.ndarray((2, 1), nl.tfloat32, buffer=nl.sbuf)
        nisa.memset(dst=b, value=0.0)
        nisa.activation(dst=o, op=nl.copy, data=d, bias=b)

    with pytest.raises(NkiValidationError, match=r"bias tile .* may have any dtype except tfloat32"):
        run_tiles(body, (X,), [((2, 4), nl.float32)])


def test_activation_rejects_shapes_and_buffers():
    with pytest.raises(NkiValidationError, match=r"activation: 'dst' has 3 partitions but 'data' has 2"):
        run_tiles(_act(nl.copy), (X,), [((3, 4), nl.float32)])
    with pytest.raises(NkiValidationError, match=r"activation: 'dst' has 8 elements per partition but 'data' has 4"):
        run_tiles(_act(nl.copy), (X,), [((2, 8), nl.float32)])

    def body(o):
        h = nl.ndarray((2, 4), nl.float32, buffer=nl.private_hbm)
        nisa.activation(dst=o, op=nl.copy, data=h)

    with pytest.raises(NkiValidationError, match=r"activation: argument 'data' .* must be in SBUF or PSUM, got "
                                                 r"private_hbm"):
        run_tiles(body, (), [((2, 4), nl.float32)])


def test_activation_reduce_requires_reduce_res_and_add():
    with pytest.raises(NkiValidationError, match=r"activation_reduce: reduce_res is required"):
        run_tiles(lambda d, o: nisa.activation_reduce(dst=o, op=nl.copy, data=d, reduce_op=nl.add, reduce_res=None),
                  (X,), [((2, 4), nl.float32)])
    with pytest.raises(NkiValidationError, match=r"activation_reduce: reduce_op must be nl.add, got nl.multiply"):
        run_tiles(lambda d, o, r: nisa.activation_reduce(dst=o, op=nl.copy, data=d, reduce_op=nl.multiply,
                                                         reduce_res=r),
                  (X,), [((2, 4), nl.float32), ((2, 1), nl.float32)])


@pytest.mark.parametrize("instr", [nisa.activation, nisa.activation_reduce])
def test_activation_rejects_more_than_128_partitions(instr):
    def body(r):
        big = oversized_tile((256, 4), nl.float32)
        instr(dst=big, op=nl.copy, data=big, reduce_op=nl.add, reduce_res=r)

    with pytest.raises(NkiValidationError, match=r"argument 'dst' partition dimension 256 exceeds maximum 128"):
        run_tiles(body, (), [((2, 1), nl.float32)])


@pytest.mark.parametrize("fn", ["silu", "gelu_apprx_sigmoid"])
def test_activation_dx_is_the_derivative(fn):
    """<fn>_dx agrees with a central difference of <fn> (both run on the simulator, float32 outputs)."""
    x = randn(21, (32, 64), scale=3.0)
    h = np.float32(2.0 ** -6)
    (f_hi,) = run_tiles(_act(getattr(nl, fn)), (x + h,), [((32, 64), nl.float32)])
    (f_lo,) = run_tiles(_act(getattr(nl, fn)), (x - h,), [((32, 64), nl.float32)])
    (dx,) = run_tiles(_act(getattr(nl, fn + "_dx")), (x,), [((32, 64), nl.float32)])
    step = ((x + h).astype(np.float64) - (x - h).astype(np.float64))
    np.testing.assert_allclose(dx, (f_hi.astype(np.float64) - f_lo) / step, rtol=0, atol=2e-3)
