"""nisa.quantize_mx and nisa.nc_matmul_mx: the validation rules, one rejection each (spec §5.1, §5.2, §7 rule 9).

Each kernel here breaks one documented rule (or sits at its edge and must pass); the error must name the
instruction, the argument and the values. The numerics of both instructions are in test_isa_mx.py.
"""
import pytest

import nki.isa as nisa
import nki.language as nl
from nkilib.simulator.errors import NkiValidationError, UninitializedReadError
from simkit import simulate


def _qmx(src_shape=(128, 64), src_dtype=nl.bfloat16, src_buf=nl.sbuf, dst_dtype=nl.float8_e4m3fn_x4,
         dst_shape=None, scale_dtype=nl.uint8, scale_shape=None, scale_offset=0, dst_offset=0):
    def kernel():
        P, F = src_shape
        src = nl.ndarray(src_shape, src_dtype, buffer=src_buf)
        dshape = dst_shape or (P + dst_offset, max(F // 4, 1))
        dst = nl.ndarray(dshape, dst_dtype, buffer=nl.sbuf)
        sshape = scale_shape or (128, max(F // 4, 1))
        sc = nl.ndarray(sshape, scale_dtype, buffer=nl.sbuf)
        nisa.quantize_mx(dst=dst[dst_offset:dst_offset + P, :] if dst_offset else dst, src=src,
                         dst_scale=sc[scale_offset:, :])

    return kernel


def _mm(k=128, m=128, n=512, sdt=nl.float8_e4m3fn_x4, mdt=nl.float8_e4m3fn_x4, dst_dtype=nl.float32,
        dst_buf=nl.psum, dst_shape=None, ss_free=None, ms_free=None, scale_dtype=nl.uint8, ss_rows=128,
        ss_offset=0, **kw):
    def kernel():
        st = nl.ndarray((k, m), sdt, buffer=nl.sbuf)
        mv = nl.ndarray((k, n), mdt, buffer=nl.sbuf)
        ss = nl.ndarray((ss_rows, ss_free or m), scale_dtype, buffer=nl.sbuf)
        ms = nl.ndarray((128, ms_free or n), scale_dtype, buffer=nl.sbuf)
        dst = nl.ndarray(dst_shape or (m, min(n, 512)), dst_dtype, buffer=dst_buf)
        nisa.nc_matmul_mx(dst=dst, stationary=st, moving=mv, stationary_scale=ss[ss_offset:, :],
                          moving_scale=ms, **kw)

    return kernel


def _rejects(kernel, match, exc=NkiValidationError):
    with pytest.raises(exc, match=match):
        simulate(kernel)


def test_reject_trn2_quantize(set_target):
    set_target("trn2")
    _rejects(_qmx(), r"quantize_mx.*NeuronCore-v4.*trn2")


def test_reject_trn2_matmul(set_target):
    set_target("trn2")
    _rejects(_mm(n=128), r"nc_matmul_mx.*NeuronCore-v4.*trn2")


def test_reject_src_in_psum():
    _rejects(_qmx(src_buf=nl.psum, src_shape=(128, 64)), r"quantize_mx: argument 'src'.*SBUF, got psum")


def test_reject_fp32_src():
    _rejects(_qmx(src_dtype=nl.float32), r"argument 'src'.*dtype float32")


def test_reject_p48():
    _rejects(_qmx(src_shape=(48, 64)), r"src partition count 48")


def test_reject_free_not_multiple_of_4():
    _rejects(_qmx(src_shape=(128, 6), dst_shape=(128, 1), scale_shape=(128, 1)), r"free size 6 .*multiple of 4")


def test_reject_fp4_dst():
    _rejects(_qmx(dst_dtype=nl.float4_e2m1fn_x4), r"dst dtype float4_e2m1fn_x4 is not supported")


def test_reject_unpacked_fp8_dst():
    _rejects(_qmx(dst_dtype=nl.float8_e4m3fn), r"argument 'dst'.*dtype float8_e4m3fn;")


def test_reject_wrong_scale_dtype():
    _rejects(_qmx(scale_dtype=nl.bfloat16), r"argument 'dst_scale'.*dtype bfloat16")


def test_reject_scale_free_mismatch_quantize():
    _rejects(_qmx(scale_shape=(128, 15)), r"'dst_scale'.*16 elements per partition.*got 15")


def test_reject_scale_offset_not_in_0_4_8_12():
    _rejects(_qmx(scale_offset=2), r"quadrant offset \[0, 4, 8, 12\]")


def test_reject_scale_view_too_short():
    _rejects(_qmx(src_shape=(64, 64), scale_shape=(32, 16)),
             r"quantize_mx: argument 'dst_scale' .* has 32 partitions; expected at least 64 rows \(P=64 > 32")


def test_reject_scale_view_covering_only_the_written_rows_when_p_over_32():
    # rows 0..3 and 32..35 hold the scales of P=64, but the documented oversize rule wants [P, F/4]
    _rejects(_qmx(src_shape=(64, 64), scale_shape=(36, 16)), r"has 36 partitions; expected at least 64 rows")


def test_packed_scale_view_spans_p_minus_its_offset(monkeypatch):
    monkeypatch.setenv("NKILIB_SIM_STRICT", "0")  # _qmx's src is never written; only validation matters here
    for offset in (4, 12):
        kernel = _qmx(src_shape=(64, 64), scale_shape=(64, 16), scale_offset=offset)
        simulate(kernel)  # 64 - offset rows: exactly the oversize rule for a packed view
    _rejects(_qmx(src_shape=(64, 64), scale_shape=(63, 16), scale_offset=4),
             r"has 59 partitions; expected at least 60 rows .*quadrant offset 4")


def test_reject_scale_other_quadrant():
    _rejects(_qmx(src_shape=(32, 64), scale_offset=32), r"\(quadrant 1\) but src starts in quadrant 0")


def test_reject_dst_partitions_mismatch():
    _rejects(_qmx(dst_shape=(64, 16)), r"dst must have 128 partitions")


def test_reject_dst_other_quadrant():
    _rejects(_qmx(src_shape=(32, 64), dst_offset=32), r"dst starts at partition 32 but src at 0")


def test_reject_matmul_k_not_multiple_of_32():
    _rejects(_mm(k=48), r"K=48 must be a multiple of 32")


def test_reject_matmul_k_mismatch():
    def kernel():
        st = nl.ndarray((64, 32), nl.float8_e4m3fn_x4, buffer=nl.sbuf)
        mv = nl.ndarray((32, 32), nl.float8_e4m3fn_x4, buffer=nl.sbuf)
        s = nl.ndarray((128, 32), nl.uint8, buffer=nl.sbuf)
        d = nl.ndarray((32, 32), nl.float32, buffer=nl.psum)
        nisa.nc_matmul_mx(dst=d, stationary=st, moving=mv, stationary_scale=s, moving_scale=s)

    _rejects(kernel, r"same partition \(contraction\) size, got 64 and 32")


def test_reject_matmul_m_odd():
    _rejects(_mm(m=63), r"M=63 must be even")


def test_reject_matmul_n_over_limit():
    _rejects(_mm(n=4097), r"N=4097 exceeds the trn3 limit of 4096 for a float32")


def test_reject_matmul_n_over_bf16_limit():
    _rejects(_mm(m=2, n=8193, dst_dtype=nl.bfloat16, dst_shape=(2, 1024)), r"N=8193 exceeds the trn3 limit of 8192")


def test_reject_matmul_non_x4_input():
    _rejects(_mm(sdt=nl.float8_e4m3fn), r"'stationary'.*float8_e4m3fn; nc_matmul_mx takes MX x4")
    _rejects(_mm(mdt=nl.bfloat16), r"'moving'.*bfloat16; nc_matmul_mx takes MX x4")


def test_reject_matmul_scale_free_mismatch():
    _rejects(_mm(ss_free=64), r"'stationary_scale'.*128 elements per partition.*got 64")
    _rejects(_mm(ms_free=256), r"'moving_scale'.*512 elements per partition.*got 256")


def test_reject_matmul_scale_dtype():
    _rejects(_mm(scale_dtype=nl.int8), r"'stationary_scale'.*dtype int8")


def test_reject_matmul_scale_too_few_rows():
    _rejects(_mm(k=128, ss_rows=64), r"nc_matmul_mx: argument 'stationary_scale' .* has 64 partitions; expected at "
                                     r"least 128 rows \(P=128 > 32")
    _rejects(_mm(k=64, ss_rows=36), r"'stationary_scale' .* has 36 partitions; expected at least 64 rows")


def test_reject_matmul_scales_in_another_quadrant():
    def kernel():
        st = nl.ndarray((128, 32), nl.float8_e4m3fn_x4, buffer=nl.sbuf)
        mv = nl.ndarray((128, 32), nl.float8_e4m3fn_x4, buffer=nl.sbuf)
        ss = nl.ndarray((128, 32), nl.uint8, buffer=nl.sbuf)
        ms = nl.ndarray((128, 32), nl.uint8, buffer=nl.sbuf)
        dst = nl.ndarray((32, 32), nl.float32, buffer=nl.psum)
        # K=32 data in quadrant 0, its 4 scale rows taken from quadrant 1
        nisa.nc_matmul_mx(dst=dst, stationary=st[0:32, :], moving=mv[0:32, :], stationary_scale=ss[32:36, :],
                          moving_scale=ms[0:4, :])

    _rejects(kernel, r"nc_matmul_mx: argument 'stationary_scale' starts at partition 32 \(quadrant 1\) but "
                     r"'stationary' .* starts at partition 0 \(quadrant 0\); "
                     r"expected the scales in the data's quadrant")


def test_reject_matmul_dst_not_psum():
    _rejects(_mm(n=128, dst_buf=nl.sbuf), r"nc_matmul_mx: argument 'dst'.*PSUM, got sbuf")


def test_reject_matmul_dst_dtype():
    _rejects(_mm(n=128, dst_dtype=nl.float16), r"dst dtype must be float32 or bfloat16, got float16")


def test_reject_matmul_dst_shape():
    _rejects(_mm(n=128, dst_shape=(128, 64)), r"dst must be \[128, 128\]")


def test_reject_matmul_column_tiling():
    _rejects(_mm(m=64, n=128, tile_position=(0, 0), tile_size=(128, 64)), r"column tiling")


def test_matmul_row_tiling_accepted_and_checked():
    K, M, N = 32, 16, 16
    kern_ok = _mm(k=K, m=M, n=N, tile_position=(32, 0), tile_size=(32, 128))
    # validation passes; the (uninitialised) operands are then caught by the strict read check
    with pytest.raises(UninitializedReadError, match="stationary"):
        simulate(kern_ok)
    _rejects(_mm(k=64, m=M, n=N, tile_position=(0, 0), tile_size=(32, 128)), r"contraction partitions 64 exceed")
