"""Issue 11 parts 2, 3b, 3c: leniencies closed, false rejections fixed, and the documented surface.

Each rejection asserts the message (instruction or method, argument, expected, received); each fixed
false rejection runs the valid program and checks its result.
"""
import numpy as np
import pytest

import nki
import nki.isa as nisa
import nki.language as nl
from simkit import BF16, hbm_store, in_kernel, randn, sbuf_load, simulate

from nkilib.simulator.errors import NkiValidationError, OutOfBoundsError


# ------------------------------------------------------------------------------------------------
# 3c: only documented names are public; documented-but-unsimulated ones say so when called
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("module,name", [
    (nl, "enum"), (nl, "operator"), (nl, "runtime"), (nl, "allocate"), (nl, "dtypes"), (nl, "ops"), (nl, "OPS"),
    (nl, "NkiValidationError"), (nisa, "copy"), (nisa, "dma"), (nisa, "mx"), (nisa, "matmul"), (nisa, "sync"),
    (nisa, "elementwise"), (nki, "os"), (nki, "functools"), (nki, "runtime"), (nki, "NkiValidationError"),
])
def test_undocumented_names_do_not_leak(module, name):
    assert not hasattr(module, name)


def test_no_submodules_leak_except_documented_ones():
    modules = {m.__name__: sorted(n for n in dir(m)
                                  if not n.startswith("_") and type(getattr(m, n)).__name__ == "module")
               for m in (nl, nisa)}
    assert modules == {nl.__name__: [], nisa.__name__: ["constants"]}
    from nki.isa.constants import dge_mode, oob_mode  # documented import path still works

    assert dge_mode is nisa.dge_mode and oob_mode is nisa.oob_mode


@pytest.mark.parametrize("call,what", [
    (lambda t: nl.load(t), "nl.load"),
    (lambda t: nl.softmax(t, axis=-1), "nl.softmax"),
    (lambda t: nl.add(t, t), "nl.add(...)"),
    (lambda t: nl.exp(t), "nl.exp(...)"),
    (lambda t: nisa.topk(t), "nisa.topk"),
    (lambda t: nisa.dropout(t, t, 0.5), "nisa.dropout"),
    (lambda t: t.flatten_dims(1, 2), "flatten_dims"),
    (lambda t: t.rearrange("p a b -> p b a"), "rearrange"),
    (lambda t: t.vector_select(0, t), "vector_select"),
    (lambda t: t.indirect(t), "indirect"),
])
def test_documented_but_unsimulated_calls_raise_not_simulated(call, what):
    def body():
        t = nl.ndarray((4, 2, 2), nl.float32, buffer=nl.sbuf)
        with pytest.raises(NkiValidationError, match="not simulated|outside the nkilib simulator") as info:
            call(t)
        return str(info.value)

    assert what.split("(")[0].split(".")[-1] in in_kernel(body)


def test_unknown_names_still_raise_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'not_an_nki_name'"):
        nl.not_an_nki_name  # noqa: B018
    with pytest.raises(AttributeError, match="no attribute 'not_an_nki_name'"):
        nisa.not_an_nki_name  # noqa: B018


def test_documented_parameter_names(capsys):
    def kernel(a):
        t = sbuf_load(a)
        nl.device_print(print_prefix="tile", tensor=t)  # 2.32: device_print(print_prefix, tensor)
        assert nl.is_sbuf(buffer=t.buffer) and nl.is_on_chip(buffer=t.buffer)
        assert not nl.is_psum(buffer=t.buffer) and not nl.is_hbm(buffer=t.buffer)
        return hbm_store(t)

    a = np.arange(4, dtype=np.float32).reshape(1, 4)
    np.testing.assert_array_equal(simulate(kernel, a=a), a)
    assert capsys.readouterr().out.startswith("tile [[0. 1. 2. 3.]]")


def test_reshape_dim_splits_a_dim_as_a_view():
    def kernel(a):
        t = sbuf_load(a)                                  # [4, 12]
        v = t.reshape_dim(1, (3, -1))                     # [4, 3, 4] view of the same storage
        assert v.shape == (4, 3, 4) and not v.is_indirect()
        out = nl.ndarray((4, 4, 3), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=out, src=v.permute((0, 2, 1)))
        with pytest.raises(NkiValidationError, match=r"reshape_dim: cannot split dim 1 of size 12 into \(5, -1\)"):
            t.reshape_dim(1, (5, -1))
        with pytest.raises(NkiValidationError, match="partition dim of an on-chip tensor cannot be split"):
            t.reshape_dim(0, (2, 2))
        return hbm_store(out)

    a = randn(1, (4, 12))
    np.testing.assert_array_equal(simulate(kernel, a=a), a.reshape(4, 3, 4).transpose(0, 2, 1))


# ------------------------------------------------------------------------------------------------
# 2: access patterns: free dims and .ap(offset=) on a view
# ------------------------------------------------------------------------------------------------

def test_ap_offset_is_relative_to_the_view():
    def kernel(a):
        t = sbuf_load(a)                                          # [8, 16]
        view = t[2:6, 4:12]                                       # storage offset 2*16 + 4
        sub = view.ap([[16, 2], [1, 8]], offset=16)               # one row below the view's start
        out = nl.ndarray((2, 8), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=out, src=sub)
        return hbm_store(out)

    a = randn(2, (8, 16))
    np.testing.assert_array_equal(simulate(kernel, a=a), a[3:5, 4:12])


def test_ap_absolute_offset_on_a_view_fails_loudly():
    def body():
        t = nl.ndarray((8, 16), nl.float32, buffer=nl.sbuf)
        view = t[4:8, :]
        # written for the absolute reading (row 4 = element 64): relative, it lands on rows 8.. -> out of range
        with pytest.raises(OutOfBoundsError, match=r"offset=64 is relative to this view's storage offset 64 .*"
                                                   r"call .ap on the base tensor for an absolute offset"):
            view.ap([[16, 4], [1, 16]], offset=64)
        return True

    assert in_kernel(body)


def test_free_dims_beyond_four_rejected_in_ap_and_operands():
    def body():
        t = nl.ndarray((2, 64, 2), nl.float32, buffer=nl.sbuf)
        ok = t.ap([[128, 2], [64, 2], [16, 2], [4, 2], [1, 4]])            # 4 free dims
        assert ok.shape == (2, 2, 2, 2, 4)
        with pytest.raises(NkiValidationError, match=r"\.ap: pattern .* needs 5 free dimensions after merging "
                                                     r"contiguous ones; expected at most 4"):
            t.ap([[128, 2], [60, 2], [25, 2], [11, 2], [4, 2], [1, 3]])
        merged = t.ap([[128, 2], [64, 2], [32, 2], [16, 2], [8, 2], [4, 2], [1, 4]])  # all contiguous: 1 dim
        assert merged.free_access_dims() == 1
        strided = nl.ndarray((2, 3, 3, 3, 3, 3), nl.float32, buffer=nl.sbuf)[:, 0:2, 0:2, 0:2, 0:2, 0:2]
        dst = nl.ndarray((2, 32), nl.float32, buffer=nl.sbuf)
        with pytest.raises(NkiValidationError, match=r"tensor_copy: argument 'src' .* needs 5 free dimensions .*"
                                                     r"expected at most 4"):
            nisa.tensor_copy(dst=dst, src=strided)
        return True

    assert in_kernel(body)


# ------------------------------------------------------------------------------------------------
# 2: PSUM banks (matmul output on trn2, address= placement)
# ------------------------------------------------------------------------------------------------

def _matmul_into(col0, cols):
    def kernel(a, b):
        st, mv = sbuf_load(a), sbuf_load(b)                       # [K, M], [K, N]
        acc = nl.ndarray((a.shape[1], 1024), nl.float32, buffer=nl.psum)   # 2 banks per partition
        nisa.nc_matmul(dst=acc[:, col0:col0 + cols], stationary=st, moving=mv)  # K=32, M=16, N=cols
        out = nl.ndarray((a.shape[1], cols), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=out, src=acc[:, col0:col0 + cols])
        return hbm_store(out)

    return kernel


def test_trn2_matmul_output_crossing_a_psum_bank_rejected(set_target):
    set_target("trn2")
    a, b = randn(3, (32, 16)), randn(4, (32, 256))
    with pytest.raises(NkiValidationError,
                       match=r"nc_matmul: argument 'dst' .* covers bytes \[1536, 2559\] of each PSUM partition, "
                       r"crossing from bank 0 into bank 1; expected the matmul output to fit one 2048-byte PSUM bank"):
        simulate(_matmul_into(384, 256), a=a, b=b)
    expect = (a.astype(np.float64).T @ b.astype(np.float64)).astype(np.float32)
    np.testing.assert_array_equal(simulate(_matmul_into(512, 256), a=a, b=b), expect)  # bank 1 exactly


def test_trn3_matmul_output_may_span_banks(set_target):
    set_target("trn3")
    a, b = randn(5, (32, 16)), randn(6, (32, 256))
    expect = (a.astype(np.float64).T @ b.astype(np.float64)).astype(np.float32)
    np.testing.assert_array_equal(simulate(_matmul_into(384, 256), a=a, b=b), expect)


def test_psum_address_must_start_at_a_bank_boundary():
    def body():
        with pytest.raises(NkiValidationError, match=r"nl.ndarray: argument 'address' places PSUM tensor \(128, 512\) "
                                                     r"at free byte offset 1024; expected a multiple of the 2048-byte"):
            nl.ndarray((128, 512), nl.float32, buffer=nl.psum, address=(0, 1024))
        with pytest.raises(NkiValidationError, match="address must be a \\(partition_offset, free_offset\\) pair"):
            nl.ndarray((128, 512), nl.float32, buffer=nl.psum, address=4096)
        ok = nl.ndarray((128, 512), nl.float32, buffer=nl.psum, address=(0, 2 * 2048))
        sb = nl.ndarray((128, 8), nl.float32, buffer=nl.sbuf, address=(0, 128))  # SBUF: any byte offset
        return ok.shape, sb.shape

    assert in_kernel(body) == ((128, 512), (128, 8))


# ------------------------------------------------------------------------------------------------
# 3b: memset int values on float tiles; kernel outputs must be shared_hbm
# ------------------------------------------------------------------------------------------------

def test_memset_float_tile_with_an_int_value_runs():
    def kernel(x):
        t = nl.ndarray((4, 8), nl.bfloat16, buffer=nl.sbuf)
        nisa.memset(dst=t, value=0)  # nki-library spelling
        u = nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=u, value=-3)
        return hbm_store(t), hbm_store(u)

    t, u = simulate(kernel, x=np.zeros((1, 1), np.float32))
    assert t.dtype == BF16
    np.testing.assert_array_equal(t.astype(np.float32), np.zeros((4, 8), np.float32))
    np.testing.assert_array_equal(u, np.full((4, 8), -3.0, np.float32))


def test_kernel_output_in_nl_hbm_rejected_as_documented():
    # NKI 0.3.0 migration guide: "Using nl.hbm for output tensors will cause compilation failures"
    def kernel(a):
        out = nl.ndarray(a.shape, a.dtype, buffer=nl.hbm)
        nisa.dma_copy(dst=out, src=sbuf_load(a))
        return out

    with pytest.raises(NkiValidationError, match=r"kernel output '\w+' is in private_hbm; outputs must be allocated "
                                                 r"with buffer=nl.shared_hbm"):
        simulate(kernel, a=randn(7, (2, 4)))
