"""Kernel entry and launching: nki.jit, nki.simulate, NKI_SIMULATOR, outputs, targets (docs/simulator.md#launching)."""
import numpy as np
import pytest

import nki
import nki.isa as nisa
import nki.language as nl
from simkit import hbm_store, randn, sbuf_load, simulate

from nkilib.simulator import run_kernel
from nkilib.simulator.errors import NkiValidationError, UninitializedReadError


def copy_kernel(a):
    return hbm_store(sbuf_load(a))


def fill_kernel(a, factor):
    """Non-array argument passed through: returns a when factor == 1, else a tile filled with factor."""
    t = sbuf_load(a)
    f = nl.ndarray(a.shape, nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=f, value=float(factor))
    return hbm_store(t) if factor == 1 else hbm_store(f)


# ---------------------------------------------------------------------------------------------
# nki.jit forms
# ---------------------------------------------------------------------------------------------

def test_jit_forms_and_simulate():
    a = randn(0, (4, 8))

    @nki.jit
    def k1(a):
        return copy_kernel(a)

    @nki.jit()
    def k2(a):
        return copy_kernel(a)

    # mode= is deprecated, accepted and ignored
    # (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/migration/index.html)
    @nki.jit(mode="trace")
    def k3(a):
        return copy_kernel(a)

    k4 = nki.jit(copy_kernel)
    for k in (k1, k2, k3, k4):
        assert isinstance(k, nki.Kernel)
        np.testing.assert_array_equal(nki.simulate(k)(a), a)
    assert k1.__name__ == "k1"
    assert "mode" not in k3.options


def test_jit_platform_target_rejected():
    with pytest.raises(NkiValidationError, match="platform_target"):
        nki.jit(platform_target="trn2")(copy_kernel)


def test_simulate_entry_points():
    a = randn(1, (8, 16))
    k = nki.jit(copy_kernel)
    np.testing.assert_array_equal(nki.simulate(k)(a), a)
    np.testing.assert_array_equal(nki.simulate(k)(a=a), a)
    np.testing.assert_array_equal(nki.cpu_simulate(k)[1](a=a), a)
    # plain (undecorated) function is auto-wrapped
    np.testing.assert_array_equal(nki.simulate(copy_kernel)(a), a)
    # non-array arguments pass through unchanged
    np.testing.assert_array_equal(nki.simulate(fill_kernel)(a, 1), a)
    np.testing.assert_array_equal(nki.simulate(fill_kernel)(a, factor=3), np.full_like(a, 3.0))


def half_kernel(a):
    """LNC-aware copy: each program copies its half of the rows of a [2R, F] input."""
    out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
    n, pid = nl.num_programs(axes=0), nl.program_id(axis=0)
    rows = a.shape[0] // n
    t = nl.ndarray((rows, a.shape[1]), a.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=a[nl.ds(pid * rows, rows), :])
    nisa.dma_copy(dst=out[nl.ds(pid * rows, rows), :], src=t)
    return out


def test_simulate_lnc2_forms():
    a = randn(2, (8, 16))
    k = nki.jit(half_kernel)
    np.testing.assert_array_equal(nki.simulate(k)[2](a), a)
    np.testing.assert_array_equal(nki.simulate(k[2])(a), a)
    np.testing.assert_array_equal(nki.simulate(half_kernel)[2](a=a), a)
    np.testing.assert_array_equal(nki.simulate(k)[1](a), a)


@pytest.mark.parametrize("lnc", [0, 3, 8, True, "2", 2.0])
def test_bad_lnc_rejected(lnc):
    k = nki.jit(copy_kernel)
    with pytest.raises(NkiValidationError, match="LNC degree"):
        k[lnc]
    with pytest.raises(NkiValidationError, match="LNC degree"):
        nki.simulate(copy_kernel)[lnc]


def test_program_ndim_and_ids():
    seen = []

    def k(a):
        seen.append((nl.program_ndim(), nl.num_programs(), nl.program_id()))
        return half_kernel(a)

    a = randn(3, (4, 4))
    nki.simulate(k)(a)
    assert seen == [(0, 1, 0)]
    seen.clear()
    nki.simulate(k)[1](a)
    assert seen == [(1, 1, 0)]
    seen.clear()
    nki.simulate(nki.jit(k)[2])(a)
    assert sorted(seen) == [(1, 2, 0), (1, 2, 1)]


def test_nki_simulator_env_plain_call(monkeypatch):
    k = nki.jit(copy_kernel)
    a = randn(4, (4, 8))
    with pytest.raises(RuntimeError, match="NKI_SIMULATOR=1"):
        k(a)
    with pytest.raises(RuntimeError, match="nki.simulate"):
        nki.jit(half_kernel)[2](a)
    monkeypatch.setenv("NKI_SIMULATOR", "1")
    np.testing.assert_array_equal(k(a), a)
    np.testing.assert_array_equal(nki.jit(half_kernel)[2](a), a)


def test_torch_tensors_in_torch_out():
    torch = pytest.importorskip("torch", reason="torch is not installed; the torch I/O path is not exercised")
    a = torch.arange(32, dtype=torch.float32).reshape(4, 8)
    out = nki.simulate(copy_kernel)(a)
    assert isinstance(out, torch.Tensor)
    assert torch.equal(out, a)
    b = (torch.arange(32, dtype=torch.float32).reshape(4, 8) / 3).to(torch.bfloat16)
    out = nki.simulate(copy_kernel)(b)
    assert out.dtype == torch.bfloat16 and torch.equal(out, b)


# ---------------------------------------------------------------------------------------------
# outputs
# ---------------------------------------------------------------------------------------------

def test_inputs_modified_in_place_are_written_back():
    def k(a, acc):
        t = sbuf_load(a)
        nisa.dma_copy(dst=acc[1:3, :], src=t[1:3, :])

    a = randn(5, (4, 8))
    acc = np.zeros((4, 8), np.float32)
    assert nki.simulate(k)(a, acc) is None
    expect = np.zeros((4, 8), np.float32)
    expect[1:3] = a[1:3]
    np.testing.assert_array_equal(acc, expect)


def test_lnc2_in_place_halves_written_back_and_list_return():
    def k(a, acc):
        pid = nl.program_id(0)
        nisa.dma_copy(dst=acc[pid:pid + 1, :], src=sbuf_load(a[pid:pid + 1, :]))
        return [acc]

    a = randn(11, (2, 4))
    acc = np.zeros((2, 4), np.float32)
    out = nki.simulate(k)[2](a, acc)
    assert isinstance(out, tuple) and len(out) == 1
    np.testing.assert_array_equal(out[0], a)
    np.testing.assert_array_equal(acc, a)


def test_inputs_not_written_are_untouched_and_returned_input_allowed():
    def k(a, acc):
        t = sbuf_load(a)
        nisa.dma_copy(dst=acc, src=t)
        return acc

    a = randn(6, (4, 8))
    acc = np.zeros((4, 8), np.float32)
    a_before = a.copy()
    out = nki.simulate(k)(a, acc)
    np.testing.assert_array_equal(out, a)
    np.testing.assert_array_equal(acc, a)
    np.testing.assert_array_equal(a, a_before)


@pytest.mark.parametrize("buf", ["sbuf", "private_hbm", "hbm"])
def test_output_not_in_shared_hbm_rejected(buf):
    def k(a):
        t = sbuf_load(a)
        if buf == "sbuf":
            return t
        out = nl.ndarray(a.shape, a.dtype, buffer=getattr(nl, buf))
        nisa.dma_copy(dst=out, src=t)
        return out

    with pytest.raises(NkiValidationError, match="shared_hbm"):
        simulate(k, a=randn(7, (4, 8)))


def test_output_with_unwritten_elements_rejected():
    def k(a):
        out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out[0:3, :], src=sbuf_load(a[0:3, :]))
        return out

    with pytest.raises(UninitializedReadError, match=r"8 of 32 elements never written"):
        simulate(k, a=randn(8, (4, 8)))


def test_tuple_outputs():
    def k(a):
        t = sbuf_load(a)
        return hbm_store(t), hbm_store(t, nl.bfloat16)

    a = randn(9, (4, 8))
    o1, o2 = simulate(k, a=a)
    np.testing.assert_array_equal(o1, a)
    assert o2.dtype == np.dtype("bfloat16")
    np.testing.assert_array_equal(o2, a.astype(o2.dtype))


def test_jit_subkernel_inside_kernel_rejected():
    sub = nki.jit(copy_kernel)

    def k(a):
        return sub(a)

    with pytest.raises(NkiValidationError, match="sub-kernels must not be decorated"):
        simulate(k, a=randn(10, (4, 8)))


def test_nested_simulate_inside_kernel_rejected():
    def k(a):
        nki.simulate(copy_kernel)(np.zeros((2, 2), np.float32))
        return copy_kernel(a)

    with pytest.raises(NkiValidationError, match="called from inside a running kernel"):
        simulate(k, a=randn(10, (4, 8)))
    np.testing.assert_array_equal(simulate(copy_kernel, a=np.ones((2, 2), np.float32)), np.ones((2, 2)))


def test_nki_api_outside_kernel_rejected():
    with pytest.raises(NkiValidationError, match="outside a kernel launch"):
        nl.ndarray((4, 4), nl.float32, buffer=nl.sbuf)


# ---------------------------------------------------------------------------------------------
# target selection (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/guides/nki_simulator.html)
# ---------------------------------------------------------------------------------------------

def _version_kernel(seen):
    def k(a):
        seen.append(nisa.get_nc_version())
        return copy_kernel(a)

    return k


@pytest.mark.parametrize("value,version", [("trn2", 3), ("gen3", 3), ("trn3", 4), ("gen4", 4), ("TRN2", 3)])
def test_platform_target_override(monkeypatch, value, version):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", value)
    seen = []
    res = run_kernel(_version_kernel(seen), (randn(11, (2, 2)),))
    assert seen == [nisa.nc_version(version)]
    assert res.target == ("trn2" if version == 3 else "trn3")
    assert nisa.get_nc_version() == nisa.nc_version(version)  # outside a launch: the environment's target


def test_default_target_is_trn3():
    seen = []
    simulate(_version_kernel(seen), a=randn(12, (2, 2)))
    assert seen == [nisa.nc_version.gen4]


def test_enums_are_plain_enums_as_documented():
    # 2.32 API: plain Enum; ordering, int() and comparison with ints do not work on the real toolchain
    version = nisa.nc_version.gen4
    with pytest.raises(TypeError):
        version >= nisa.nc_version.gen3  # noqa: B015
    with pytest.raises(TypeError):
        int(version)
    assert version != 4 and version == nisa.nc_version.gen4
    for enum_cls in (nisa.engine, nisa.dge_mode, nisa.oob_mode, nisa.reduce_cmd, nisa.dma_engine, nisa.nc_version):
        member = next(iter(enum_cls))
        with pytest.raises(TypeError):
            int(member)
        with pytest.raises(TypeError):
            member < member  # noqa: B015


@pytest.mark.parametrize("value", ["trn1", "gen2", "inf2", "trn9", "bogus"])
def test_invalid_platform_target(monkeypatch, value):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", value)
    with pytest.raises(ValueError, match="unsupported Neuron target"):
        simulate(copy_kernel, a=randn(13, (2, 2)))
    with pytest.raises(ValueError, match=value):
        nisa.get_nc_version()


def test_nki_nc_version_honoured(monkeypatch):
    monkeypatch.setenv("NKI_NC_VERSION", "gen3")
    seen = []
    simulate(_version_kernel(seen), a=randn(14, (2, 2)))
    assert seen == [nisa.nc_version.gen3]
    # the documented override wins when both are set
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    simulate(_version_kernel(seen), a=randn(14, (2, 2)))
    assert seen == [nisa.nc_version.gen3, nisa.nc_version.gen4]
    monkeypatch.delenv("NEURON_PLATFORM_TARGET_OVERRIDE")
    monkeypatch.setenv("NKI_NC_VERSION", "gen2")
    with pytest.raises(ValueError, match="gen2"):
        simulate(copy_kernel, a=randn(14, (2, 2)))


def test_settings_read_per_launch(set_target):
    seen = []
    k = _version_kernel(seen)
    set_target("trn2")
    simulate(k, a=randn(15, (2, 2)))
    set_target("trn3")
    simulate(k, a=randn(15, (2, 2)))
    assert seen == [nisa.nc_version.gen3, nisa.nc_version.gen4]
