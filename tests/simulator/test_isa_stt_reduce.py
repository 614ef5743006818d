"""nisa.scalar_tensor_tensor's NKI 0.7 reduce arguments (reduce_op, reduce_res, reduce_cmd) and VectorE's accumulator
registers (docs/simulator.md, the scalar_tensor_tensor entry and #choice-vector-accumulate).

Expected values are hand-computed or plain numpy: the register of a lane holds fp32(reg <op> R), R the float64
reduction of the lane's fp32 results rounded once to float32.
"""
import numpy as np
import pytest

import nki.isa as nisa
import nki.language as nl
from nkilib.simulator.errors import NkiValidationError
from simkit import BF16, bits, randn, run_tiles

RC = nisa.reduce_cmd
X = np.array([[1.0, 2.0, 3.0], [4.0, -5.0, 6.0]], np.float32)
Y = np.array([[10.0, 20.0, 30.0], [-1.0, 2.0, 0.5]], np.float32)


def _stt(dst, data, operand1, **kw):
    """(data * 1.0) * operand1, the MoE routing gradient's product, with the given reduce arguments."""
    return nisa.scalar_tensor_tensor(dst=dst, data=data, op0=nl.multiply, operand0=1.0, op1=nl.multiply,
                                     operand1=operand1, **kw)


def test_product_and_sum_hand_computed():
    (o, r), tr = run_tiles(lambda d, t, o, r: _stt(o, d, t, reduce_op=nl.add, reduce_res=r),  # default reset_reduce
                           (X, Y), [((2, 3), nl.float32), ((2, 1), nl.float32)], psum_inputs=(0,), trace=True)
    np.testing.assert_array_equal(o, X * Y)
    np.testing.assert_array_equal(r[:, 0], [10.0 + 40.0 + 90.0, -4.0 - 10.0 + 3.0])
    assert [(t.instr, t.engine, t.attrs["reduce_op"], t.attrs["reduce_cmd"]) for t in tr] == [
        ("scalar_tensor_tensor", "vector", "add", "reset_reduce")]
    assert [w.arg for w in tr[0].writes] == ["dst", "reduce_res"]


def test_random_sum_equals_tensor_tensor_then_tensor_reduce_bits():
    # the kernel's claim: one instruction gives the bits of tensor_tensor's products and tensor_reduce's sum
    d_i = randn(31, (128, 512), scale=1e3)  # wide range: the fp32 order would matter, the float64 sum does not
    h = randn(32, (128, 512), dtype=BF16)

    def body(d, t, o1, r1, o2, r2):
        _stt(o1, d, t, reduce_op=nl.add, reduce_res=r1, reduce_cmd=RC.reset_reduce)
        nisa.tensor_tensor(dst=o2, data1=d, data2=t, op=nl.multiply)
        nisa.tensor_reduce(dst=r2, op=nl.add, data=o2, axis=1)

    o1, r1, o2, r2 = run_tiles(body, (d_i, h), [((128, 512), nl.float32), ((128, 1), nl.float32)] * 2,
                               psum_inputs=(0,))
    np.testing.assert_array_equal(bits(o1), bits(o2))
    np.testing.assert_array_equal(bits(r1), bits(r2))
    prod = (d_i * h.astype(np.float32)).astype(np.float32)
    np.testing.assert_array_equal(bits(r1[:, 0]), bits(prod.astype(np.float64).sum(axis=1).astype(np.float32)))


def test_sum_reads_fp32_results_before_the_dst_downcast():
    x = np.full((3, 4), 1.0 + 2.0 ** -8, np.float32)  # a bf16 tie that rounds to 1.0
    o, r = run_tiles(lambda d, t, o, r: _stt(o, d, t, reduce_op=nl.add, reduce_res=r),
                     (x, np.ones((3, 4), np.float32)), [((3, 4), nl.bfloat16), ((3, 1), nl.float32)])
    np.testing.assert_array_equal(o.astype(np.float32), np.ones((3, 4), np.float32))
    np.testing.assert_array_equal(r[:, 0], [4.015625] * 3)


def test_reduce_continues_and_reset_reduce_restarts():
    def body(d, t, o, r1, r2, r3):
        _stt(o, d, t, reduce_op=nl.add, reduce_cmd=RC.reset_reduce, reduce_res=r1)
        _stt(o, d, t, reduce_op=nl.add, reduce_cmd=RC.reduce, reduce_res=r2)  # += the same sums
        _stt(o, d, t, reduce_op=nl.add, reduce_cmd=RC.reset_reduce, reduce_res=r3)  # not 3x: reset first

    _, r1, r2, r3 = run_tiles(body, (X, Y), [((2, 3), nl.float32)] + [((2, 1), nl.float32)] * 3)
    np.testing.assert_array_equal(r1[:, 0], [140.0, -11.0])
    np.testing.assert_array_equal(r2[:, 0], [280.0, -22.0])
    np.testing.assert_array_equal(r3[:, 0], [140.0, -11.0])


def test_accumulate_without_readout_then_read_on_a_later_call():
    def body(d, t, o, r):
        _stt(o, d, t, reduce_op=nl.add)  # reset_reduce, no reduce_res: the registers hold the sums
        _stt(o, d, t, reduce_op=nl.add, reduce_cmd=RC.reduce, reduce_res=r)

    _, r = run_tiles(body, (X, Y), [((2, 3), nl.float32), ((2, 1), nl.float32)])
    np.testing.assert_array_equal(r[:, 0], [280.0, -22.0])


@pytest.mark.parametrize("op, want", [
    (nl.multiply, [10.0 * 40.0 * 90.0, -4.0 * -10.0 * 3.0]),  # identity 1: not 0
    (nl.maximum, [90.0, 3.0]),
    (nl.minimum, [10.0, -10.0]),
])
def test_reset_reduce_starts_from_the_operator_identity(op, want):
    _, r = run_tiles(lambda d, t, o, r: _stt(o, d, t, reduce_op=op, reduce_res=r),
                     (X, Y), [((2, 3), nl.float32), ((2, 1), nl.float32)])
    np.testing.assert_array_equal(r[:, 0], want)


def test_registers_are_per_lane_and_apart_from_scalar_engine_ones():
    x = np.arange(8, dtype=np.float32).reshape(4, 2)  # row sums 1, 5, 9, 13
    ones = np.ones((4, 2), np.float32)

    def body(d, t, o, r):
        _stt(o, d, t, reduce_op=nl.add, reduce_cmd=RC.reset_reduce)
        # ScalarE's registers are others: resetting them leaves VectorE's sums
        nisa.activation(dst=o, op=nl.copy, data=d, reduce_cmd=RC.reset)
        # lanes 2..3 accumulate again; lanes 0..1 keep their first sums
        _stt(o[2:4, :], d[2:4, :], t[2:4, :], reduce_op=nl.add, reduce_cmd=RC.reduce)
        _stt(o, d, t, reduce_op=nl.add, reduce_cmd=RC.reduce, reduce_res=r)

    _, r = run_tiles(body, (x, ones), [((4, 2), nl.float32), ((4, 1), nl.float32)])
    np.testing.assert_array_equal(r[:, 0], [2.0, 10.0, 27.0, 39.0])


def test_without_reduce_op_the_registers_are_untouched():
    def body(d, t, o, r):
        _stt(o, d, t, reduce_op=nl.add)
        _stt(o, d, t)  # no reduce_op (the default reduce_cmd is reset_reduce): nothing reduced
        _stt(o, d, t, reduce_cmd=RC.idle)
        _stt(o, d, t, reduce_op=nl.add, reduce_cmd=RC.reduce, reduce_res=r)

    (_, r), tr = run_tiles(body, (X, Y), [((2, 3), nl.float32), ((2, 1), nl.float32)], trace=True)
    np.testing.assert_array_equal(r[:, 0], [280.0, -22.0])
    assert "reduce_op" not in tr[1].attrs and [w.arg for w in tr[1].writes] == ["dst"]


@pytest.mark.parametrize("kw, res_shape, match", [
    (dict(reduce_op=nl.add), (2, 2), r"reduce_res must be a \[2, 1\] tile .* got shape \(2, 2\)"),
    (dict(reduce_op=nl.add), (1, 1), r"reduce_res must be a \[2, 1\] tile .* got shape \(1, 1\)"),
    (dict(reduce_op=nl.subtract), (2, 1),
     r"reduce_op must be one of \['nl.add', 'nl.multiply', 'nl.maximum', 'nl.minimum'\], got nl.subtract"),
    (dict(reduce_op=np.add), (2, 1), r"argument 'reduce_op' must be an nl operator"),
    (dict(reduce_op=nl.add, reduce_cmd=RC.load_reduce), (2, 1),
     r"reduce_cmd must be one of \['reset_reduce', 'reduce'\] with reduce_op, got load_reduce \(load_reduce loads"),
    (dict(reduce_op=nl.add, reduce_cmd=RC.idle), (2, 1),
     r"reduce_cmd must be one of .* got idle \(idle does not accumulate"),
    (dict(reduce_op=nl.add, reduce_cmd=RC.reset), (2, 1),
     r"reduce_cmd must be one of .* got reset \(reset does not accumulate"),
    (dict(reduce_op=nl.add, reduce_cmd=3), (2, 1), r"reduce_cmd must be an nisa.reduce_cmd member, got 3"),
    (dict(), (2, 1), r"reduce_res needs reduce_op"),
    (dict(reduce_cmd=RC.reduce, reduce_res=None), None, r"reduce_cmd=reduce needs reduce_op"),
])
def test_rejections_name_the_argument(kw, res_shape, match):
    def body(d, t, o, *res):
        extra = {} if "reduce_res" in kw else {"reduce_res": res[0]}
        _stt(o, d, t, **kw, **extra)

    outs = [((2, 3), nl.float32)] + ([(res_shape, nl.float32)] if res_shape else [])
    with pytest.raises(NkiValidationError, match=r"nisa.scalar_tensor_tensor: " + match):
        run_tiles(body, (X, Y), outs)
