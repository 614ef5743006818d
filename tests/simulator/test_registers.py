"""Registers (nisa.register_alloc / move / load / store) and `.ap(scalar_offset=reg)`."""
import numpy as np
import pytest

import nki.isa as nisa
import nki.language as nl
from simkit import in_kernel, randn, run_tiles, simulate

from nkilib.simulator.errors import NkiValidationError, OutOfBoundsError, UninitializedReadError
from nkilib.simulator.launcher import ShapeSpec, run_kernel


def loaded_register(value_tile):
    """Inside a kernel: a register loaded from a one-element tile."""
    reg = nisa.register_alloc()
    nisa.register_load(reg, value_tile)
    return reg


def store_kernel(src):
    """register_load the single element of `src` [1, 1] and register_store it into an int32 output."""
    t = nl.ndarray(src.shape, src.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=src)
    reg = loaded_register(t)
    out_t = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
    nisa.register_store(out_t, reg)
    out = nl.ndarray((1, 1), nl.int32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=out_t)
    return out


# ---------------------------------------------------------------------------------------------
# values through registers
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,value", [(np.int32, -5), (np.int32, 2 ** 31 - 1), (np.uint8, 200), (np.int16, -300),
                                         (np.float32, 96.0), (np.uint32, 7)])
def test_load_then_store_round_trips(dtype, value):
    out = simulate(store_kernel, src=np.array([[value]], dtype))
    assert out.dtype == np.int32 and int(out[0, 0]) == int(value)


def test_register_load_from_hbm_and_one_element_views():
    def k(src):
        reg = nisa.register_alloc()
        nisa.register_load(reg, src[2:3, 1:2])  # a [1, 1] view of a bigger HBM tensor
        t = nl.ndarray((1,), nl.int32, buffer=nl.private_hbm)  # shape [1] is documented too
        nisa.register_store(t, reg)
        reg2 = nisa.register_alloc(0)
        nisa.register_load(reg2, t)
        out_t = nl.ndarray((1, 1), nl.float32, buffer=nl.sbuf)
        nisa.register_store(out_t, reg2)
        out = nl.ndarray((1, 1), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=out_t)
        return out

    src = np.arange(12, dtype=np.int32).reshape(4, 3) - 6
    assert simulate(k, src=src)[0, 0] == np.float32(src[2, 1])


def test_register_move_and_alloc_values_reach_memory():
    def body(o1, o2):
        r = nisa.register_alloc(-7)
        nisa.register_store(o1, r)
        nisa.register_move(r, 123456)
        nisa.register_store(o2, r)

    o1, o2 = run_tiles(body, outputs=[((1, 1), nl.int32), ((1, 1), nl.int32)])
    assert int(o1[0, 0]) == -7 and int(o2[0, 0]) == 123456


def test_register_ops_trace_records():
    def body(src, o):
        r = nisa.register_alloc(3)
        nisa.register_move(r, 4)
        nisa.register_load(r, src)
        nisa.register_store(o, r)

    _, recs = run_tiles(body, inputs=[np.array([[9]], np.int32)], outputs=[((1, 1), nl.int32)], trace=True)
    assert [r.instr for r in recs] == ["register_alloc", "register_move", "register_load", "register_store"]
    assert {r.engine for r in recs} == {"sync"}
    reg_ids = {r.attrs["register"] for r in recs}
    assert len(reg_ids) == 1
    assert recs[0].attrs["value"] == 3 and recs[1].attrs["value"] == 4
    load, store = recs[2], recs[3]
    assert [o.arg for o in load.reads] == ["src"] and load.writes == ()
    assert load.reads[0].buffer == "sbuf" and load.reads[0].nbytes == 4
    assert [o.arg for o in store.writes] == ["dst"] and store.reads == ()


# ---------------------------------------------------------------------------------------------
# register rejections
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("x,match", [
    (1.5, "must be a compile-time integer, got float 1.5"),
    (True, "must be a compile-time integer, got bool"),
    (2 ** 31, "= 2147483648 does not fit a 32-bit register"),
    (-(2 ** 31) - 1, "does not fit a 32-bit register"),
])
def test_register_alloc_rejects(x, match):
    with pytest.raises(NkiValidationError, match=f"nisa.register_alloc: argument 'x'.*{match}"):
        in_kernel(lambda: nisa.register_alloc(x))


def test_register_alloc_rejects_tensor():
    def body():
        t = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
        nisa.register_alloc(t)

    with pytest.raises(NkiValidationError, match="got tensor .*register_load"):
        in_kernel(body)


def test_register_move_rejects():
    def bad_imm():
        nisa.register_move(nisa.register_alloc(), nisa.register_alloc(1))

    with pytest.raises(NkiValidationError, match=r"register_move: argument 'imm' must be a compile-time integer, "
                                                 r"got VirtualRegister"):
        in_kernel(bad_imm)
    with pytest.raises(NkiValidationError, match="argument 'dst' must be a VirtualRegister .* got int 3"):
        in_kernel(lambda: nisa.register_move(3, 4))
    with pytest.raises(NkiValidationError, match="'imm' = -2147483649 does not fit"):
        in_kernel(lambda: nisa.register_move(nisa.register_alloc(), -(2 ** 31) - 1))


@pytest.mark.parametrize("shape,buffer,dtype,match", [
    ((2, 1), "sbuf", nl.int32, r"exactly one element \(shape \[1\] or \[1, 1\]\), got shape \(2, 1\)"),
    ((1, 1, 1), "private_hbm", nl.int32, r"got shape \(1, 1, 1\)"),
    ((1, 1), "psum", nl.float32, "is in PSUM; expected SBUF or HBM"),
    ((1, 1), "sbuf", nl.float8_e4m3fn_x4, "packed dtype float8_e4m3fn_x4"),
])
def test_register_load_rejects_operand(shape, buffer, dtype, match):
    def body():
        t = nl.ndarray(shape, dtype, buffer=getattr(nl, buffer))
        nisa.register_load(nisa.register_alloc(), t)

    with pytest.raises(NkiValidationError, match=f"nisa.register_load: argument 'src' .*{match}"):
        in_kernel(body)


@pytest.mark.parametrize("dtype,value,match", [
    (np.float32, 2.5, "holds 2.5; a register loaded from a float tensor must receive an exact integer"),
    (np.float32, np.inf, "holds inf"),
    (np.uint32, 2 ** 31, "holds 2147483648, outside the signed 32-bit register range"),
])
def test_register_load_rejects_value(dtype, value, match):
    with pytest.raises(NkiValidationError, match=match):
        simulate(store_kernel, src=np.array([[value]], dtype))


def test_register_load_needs_written_source_and_numerics():
    def never_written():
        t = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
        nisa.register_load(nisa.register_alloc(), t)

    with pytest.raises(UninitializedReadError, match="register_load: argument 'src' reads 1 element"):
        in_kernel(never_written)
    with pytest.raises(NkiValidationError, match="has no values in a shape-only run"):
        run_kernel(store_kernel, args=(ShapeSpec((1, 1), np.int32),), numerics=False)


def bounded_loop_kernel(offsets, data):
    """A fori_loop whose bounds are register_load-ed straight from an HBM int32 input `offsets` [2];
    each iteration copies one [1, 8] row of `data` (the record count shows the trip count)."""
    lo, hi = nisa.register_alloc(), nisa.register_alloc()
    nisa.register_load(lo, offsets[0:1])
    nisa.register_load(hi, offsets[1:2])
    out = nl.ndarray(data.shape, data.dtype, buffer=nl.shared_hbm)

    def body(i):
        t = nl.ndarray((1, 8), data.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=data.ap([[8, 1], [1, 8]], scalar_offset=i, indirect_dim=0))
        nisa.dma_copy(dst=out.ap([[8, 1], [1, 8]], scalar_offset=i, indirect_dim=0), src=t)

    zero = nl.ndarray(data.shape, data.dtype, buffer=nl.sbuf)
    nisa.memset(dst=zero, value=0.0)
    nisa.dma_copy(dst=out, src=zero)
    nl.fori_loop(lo, hi, body)
    return out


@pytest.mark.parametrize("lo,hi", [(1, 4), (2, 2), (0, 6)])
def test_shape_only_run_carries_integer_input_values(lo, hi):
    """Shape-only run, float data as a ShapeSpec, int32 bounds as values: the loop takes hi - lo trips."""
    res = run_kernel(bounded_loop_kernel, args=(np.array([lo, hi], np.int32), ShapeSpec((6, 8), nl.bfloat16)),
                     numerics=False, trace=True)
    loops = [r for r in res.trace if r.instr == "dynamic_loop"]
    copies = [r for r in res.trace if r.instr == "dma_copy"]
    assert res.outputs is None  # shape-only: no output values
    assert [r.attrs["trip_count"] for r in loops] == [hi - lo]
    assert len(copies) == 1 + 2 * (hi - lo)


def test_shape_only_carried_values_only_for_integer_inputs_and_what_they_compute():
    """memset computes from no carried input: writing its tile over a carried input drops the values."""
    def written_then_loaded(offsets):
        t = nl.ndarray((1, 2), nl.int32, buffer=nl.sbuf)
        nisa.memset(dst=t, value=3)
        nisa.dma_copy(dst=offsets.reshape((1, 2)), src=t)
        nisa.register_load(nisa.register_alloc(), offsets[0:1])

    with pytest.raises(NkiValidationError, match="'offsets'.*has no values in a shape-only run"):
        run_kernel(written_then_loaded, args=(np.array([1, 2], np.int32),), numerics=False)
    with pytest.raises(NkiValidationError, match="float32.*has no values in a shape-only run"):
        run_kernel(lambda offsets: nisa.register_load(nisa.register_alloc(), offsets[0:1]),
                   args=(np.array([1.0], np.float32),), numerics=False)


def _loop_trips(trace) -> list:
    return [r.attrs["trip_count"] for r in trace if r.instr == "dynamic_loop"]


def computed_bounds_kernel(offsets, data):
    """Loop bounds computed on chip from the int32 input `offsets` [3] (as the MoE kernel does):
    lo = offsets[1] - offsets[0] (tensor_tensor, GpSimd integer arithmetic), hi = offsets[2] * 2 + 1
    (tensor_scalar on VectorE); one copy of `data` per iteration."""
    offs = nl.ndarray((1, 3), nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=offs, src=offsets.reshape((1, 3)))
    bounds = nl.ndarray((1, 2), nl.int32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=bounds[:, 0:1], data1=offs[:, 1:2], data2=offs[:, 0:1], op=nl.subtract)
    nisa.tensor_scalar(dst=bounds[:, 1:2], data=offs[:, 2:3], op0=nl.multiply, operand0=2.0, op1=nl.add,
                       operand1=1.0, engine=nisa.engine.vector)
    lo, hi = nisa.register_alloc(), nisa.register_alloc()
    nisa.register_load(lo, bounds[0:1, 0:1])
    nisa.register_load(hi, bounds[0:1, 1:2])
    t = nl.ndarray(data.shape, data.dtype, buffer=nl.sbuf)
    nl.fori_loop(lo, hi, lambda i: nisa.dma_copy(dst=t, src=data))


@pytest.mark.parametrize("offsets", [(3, 5, 4), (0, 0, 0), (2, 9, 10)])
def test_shape_only_values_flow_through_instructions_on_carried_inputs(offsets):
    """An int tile DMA'd from a carried input and modified on GpSimd/VectorE is readable by register_load in a
    shape-only run, with the value a numerics run computes."""
    a, b, c = offsets
    expected = [(2 * c + 1) - (b - a)]
    args = (np.array(offsets, np.int32), ShapeSpec((4, 8), nl.bfloat16))
    shape_only = run_kernel(computed_bounds_kernel, args=args, numerics=False, trace=True)
    assert _loop_trips(shape_only.trace) == expected
    full = run_kernel(computed_bounds_kernel, args=(args[0], np.zeros((4, 8), np.float32)), trace=True)
    assert _loop_trips(full.trace) == expected


def test_shape_only_no_values_from_a_shapespec_or_a_mixed_instruction():
    """A tile computed from a ShapeSpec has no values, nor one whose instruction mixes it with carried
    values; a value-less write over part of a carried tile leaves the rest readable."""
    def derived(offsets, idx, which):
        offs = nl.ndarray((1, 2), nl.int32, buffer=nl.sbuf, name="offs")
        nisa.dma_copy(dst=offs, src=offsets.reshape((1, 2)))
        t = nl.ndarray((1, 2), nl.int32, buffer=nl.sbuf, name="t")
        nisa.dma_copy(dst=t, src=idx.reshape((1, 2)))
        nisa.tensor_scalar(dst=t, data=t, op0=nl.add, operand0=1.0)
        mixed = nl.ndarray((1, 2), nl.int32, buffer=nl.sbuf, name="mixed")
        nisa.tensor_tensor(dst=mixed, data1=offs, data2=t, op=nl.add)
        nisa.tensor_copy(dst=offs[:, 1:2], src=t[:, 1:2])  # offs[1] loses its value, offs[0] keeps it
        src = {"derived": t, "mixed": mixed, "overwritten": offs[:, 1:2], "kept": offs[:, 0:1]}[which]
        r = nisa.register_alloc()
        nisa.register_load(r, src[0:1, 0:1])
        nl.fori_loop(0, r, lambda i: None)

    args = (np.array([3, 4], np.int32), ShapeSpec((2,), nl.int32))
    for which, name in (("derived", "t"), ("mixed", "mixed"), ("overwritten", "offs")):
        with pytest.raises(NkiValidationError, match=rf"register_load: argument 'src' \('{name}', int32, sbuf\) "
                                                     "has no values in a shape-only run"):
            run_kernel(derived, args=args, kwargs={"which": which}, numerics=False)
    kept = run_kernel(derived, args=args, kwargs={"which": "kept"}, numerics=False, trace=True)
    assert _loop_trips(kept.trace) == [3]


def test_shape_only_float_math_on_carried_values_and_shapespec_data():
    """Float instructions on carried values compute (int -> fp32 -> ScalarE/VectorE/TensorE -> int32 gives the
    right bound); float data from a ShapeSpec stays without values, its tiles hold no data (memory)."""
    seen = {}

    def kernel(offsets, x):
        offs = nl.ndarray((2, 1), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=offs, src=offsets.reshape((2, 1)))
        f = nl.ndarray((2, 1), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=f, src=offs)
        nisa.activation(dst=f, op=nl.copy, data=f, scale=1.5)  # [1.5 a, 1.5 b]
        ones = nl.ndarray((2, 1), nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=ones, data=f, op0=nl.multiply, operand0=0.0, op1=nl.add, operand1=1.0)
        ps = nl.ndarray((1, 1), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=ps, stationary=ones, moving=f)  # K=2, M=1, N=1: 1.5 (a + b)
        total = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=total, src=ps)
        xt = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=xt, src=x)
        y = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=y, data1=xt, data2=xt, op=nl.multiply)
        seen["data"] = (xt.storage.data, y.storage.data)
        r = nisa.register_alloc()
        nisa.register_load(r, total)
        nl.fori_loop(0, r, lambda i: None)

    res = run_kernel(kernel, args=(np.array([4, 6], np.int32), ShapeSpec((128, 512), nl.bfloat16)),
                     numerics=False, trace=True)
    assert _loop_trips(res.trace) == [15]  # 1.5 * (4 + 6)
    assert seen["data"] == (None, None)


def test_uninitialized_register_strict_and_lenient(monkeypatch):
    def body(o):
        nisa.register_store(o, nisa.register_alloc())

    with pytest.raises(UninitializedReadError, match="allocated without a value and never written"):
        run_tiles(body, outputs=[((1, 1), nl.int32)])
    monkeypatch.setenv("NKILIB_SIM_STRICT", "0")
    (o,) = run_tiles(body, outputs=[((1, 1), nl.int32)])
    assert int(o[0, 0]) == 4  # the integer fill pattern of fresh tensors


@pytest.mark.parametrize("dtype,value,stored", [(nl.int8, 300, "127"), (nl.uint16, -1, "0"),
                                                (nl.bfloat16, 257, "256.0"), (nl.float32, 2 ** 24 + 1, "16777216.0")])
def test_register_store_rejects_unrepresentable(dtype, value, stored):
    def body():
        t = nl.ndarray((1, 1), dtype, buffer=nl.sbuf)
        nisa.register_store(t, nisa.register_alloc(value))

    with pytest.raises(NkiValidationError, match=f"register value {value} is not representable in argument 'dst'.*"
                                                 f"stored as {stored}"):
        in_kernel(body)


def test_register_store_rejects_operands():
    def not_register():
        nisa.register_store(nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf), 5)

    with pytest.raises(NkiValidationError, match="register_store: argument 'src' must be a VirtualRegister"):
        in_kernel(not_register)

    def scale_dst():
        nisa.register_store(nl.ndarray((1, 1), nl.float8_e8m0fnu, buffer=nl.sbuf), nisa.register_alloc(1))

    with pytest.raises(NkiValidationError, match="scale dtype float8_e8m0fnu"):
        in_kernel(scale_dst)


def test_register_is_not_a_python_value():
    def branch():
        if nisa.register_alloc(1):
            pass

    with pytest.raises(NkiValidationError, match=r"bare `while reg:` loop is deprecated .* use nl.while_loop"):
        in_kernel(branch)
    with pytest.raises(NkiValidationError, match="cannot be used as a Python int"):
        in_kernel(lambda: range(nisa.register_alloc(3)))
    with pytest.raises(NkiValidationError, match="Python operators on a register .* not simulated"):
        in_kernel(lambda: nisa.register_alloc(3) == 3)
    with pytest.raises(NkiValidationError, match="Python operators on a register"):
        in_kernel(lambda: nisa.register_alloc(3) * 4 + 1)
    with pytest.raises(NkiValidationError, match="Python operators on a register"):
        in_kernel(lambda: 2 < nisa.register_alloc(3))


def test_register_belongs_to_its_launch():
    leaked = in_kernel(lambda: nisa.register_alloc(2))
    with pytest.raises(NkiValidationError, match="allocated by another program or launch"):
        in_kernel(lambda: nisa.register_move(leaked, 3))
    with pytest.raises(NkiValidationError, match="outside a kernel launch"):
        nisa.register_alloc(1)


# ---------------------------------------------------------------------------------------------
# .ap(scalar_offset=register)
# ---------------------------------------------------------------------------------------------

def offset_copy_kernel(x, idx, rows, indirect_dim=0):
    """out = `rows` rows of x [R, F] starting at row idx[0, 0], read with x.ap(scalar_offset=reg)."""
    R, F = x.shape
    t = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=idx)
    reg = loaded_register(t)
    tile = nl.ndarray((rows, F), x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=x.ap([[F, rows], [1, F]], scalar_offset=reg, indirect_dim=indirect_dim))
    out = nl.ndarray((rows, F), x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=tile)
    return out


@pytest.mark.parametrize("start", [0, 3, 6])
def test_scalar_offset_selects_rows_of_hbm(start):
    x = randn(10, (8, 16))
    out = simulate(offset_copy_kernel, x=x, idx=np.array([[start]], np.int32), rows=2)
    np.testing.assert_array_equal(out, x[start:start + 2])


def test_scalar_offset_on_sbuf_partitions_and_free_dim():
    x = randn(11, (16, 4, 8))

    def k(x):
        sb = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=sb, src=x)
        p_reg, f_reg = nisa.register_alloc(5), nisa.register_alloc(2)
        a = nl.ndarray((3, 8), x.dtype, buffer=nl.sbuf)  # partitions 5..7, free block 0
        nisa.tensor_copy(dst=a, src=sb.ap([[32, 3], [1, 8]], scalar_offset=p_reg))
        b = nl.ndarray((16, 8), x.dtype, buffer=nl.sbuf)  # every partition, free block 2 (indirect_dim=1)
        nisa.tensor_copy(dst=b, src=sb.ap([[32, 16], [1, 8]], scalar_offset=f_reg, indirect_dim=1))
        out_a = nl.ndarray(a.shape, x.dtype, buffer=nl.shared_hbm)
        out_b = nl.ndarray(b.shape, x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out_a, src=a)
        nisa.dma_copy(dst=out_b, src=b)
        return out_a, out_b

    a, b = simulate(k, x=x)
    np.testing.assert_array_equal(a, x[5:8, 0, :])
    np.testing.assert_array_equal(b, x[:, 2, :])


def test_scalar_offset_with_dtype_reinterpretation():
    """int32 [4, 8] read as uint16: one row step is 16 uint16 elements."""
    x = np.arange(32, dtype=np.int32).reshape(4, 8) * 65537

    def k(x):
        reg = nisa.register_alloc(2)
        t = nl.ndarray((1, 16), nl.uint16, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x.ap([[16, 1], [1, 16]], scalar_offset=reg, dtype=nl.uint16))
        out = nl.ndarray((1, 16), nl.uint16, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t)
        return out

    np.testing.assert_array_equal(simulate(k, x=x), x[2:3].view(np.uint16))


@pytest.mark.parametrize("start,match", [
    (7, "scalar_offset register value 7 .*addresses outside the tensor"),
    (-1, "scalar_offset register value -1 .*addresses outside the tensor"),
])
def test_scalar_offset_out_of_bounds_names_value(start, match):
    with pytest.raises(OutOfBoundsError, match=match):
        simulate(offset_copy_kernel, x=randn(12, (8, 4)), idx=np.array([[start]], np.int32), rows=2)


def test_scalar_offset_rejections():
    def body():
        t = nl.ndarray((8, 16), nl.float32, buffer=nl.private_hbm)
        sb = nl.ndarray((4, 16), nl.float32, buffer=nl.sbuf)
        reg = nisa.register_alloc(1)
        with pytest.raises(NkiValidationError, match="indirect_dim must be a dim of the tensor's shape .* got 2"):
            t.ap([[16, 2], [1, 16]], scalar_offset=reg, indirect_dim=2)
        with pytest.raises(NkiValidationError, match="scalar_offset must be a VirtualRegister .* got int"):
            t.ap([[16, 2], [1, 16]], scalar_offset=1)
        with pytest.raises(NkiValidationError, match="1x1 SBUF tensor offset is not simulated"):
            t.ap([[16, 2], [1, 16]], scalar_offset=sb[0:1, 0:1])
        with pytest.raises(NkiValidationError, match="scalar_offset and vector_offset are mutually exclusive"):
            t.ap([[16, 2], [1, 16]], scalar_offset=reg, vector_offset=sb[:, 0:1])
        with pytest.raises(NkiValidationError, match="stride on that dim is 16 .*sliced or re-strided view"):
            t[:, 0:8].ap([[16, 2], [1, 8]], scalar_offset=reg, indirect_dim=0)
        with pytest.raises(NkiValidationError, match=r"prod\(shape\[1:\]\) = 8 elements, but this view's stride "
                                                     "on that dim is 16"):
            sb[0:1, 0:8].ap([[16, 1], [1, 8]], scalar_offset=reg, indirect_dim=0)  # a size-1 dim is not exempt
        with pytest.raises(OutOfBoundsError, match="leaves the partition row .*scalar_offset register value 9"):
            sb.ap([[16, 4], [1, 8]], scalar_offset=nisa.register_alloc(9), indirect_dim=1)
        with pytest.raises(UninitializedReadError, match="scalar_offset: reads VirtualRegister"):
            t.ap([[16, 2], [1, 16]], scalar_offset=nisa.register_alloc())
        return True

    assert in_kernel(body)
