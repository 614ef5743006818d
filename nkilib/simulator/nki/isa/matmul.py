"""Tensor Engine matmul: nc_matmul. nc_matmul_mx lives in mx.py, nc_transpose in transpose.py.

References:
    https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.nc_matmul.html (nc_matmul docs)
    https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/guides/architecture/trainium2_arch.html
    https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/guides/architecture/trainium3_arch.html ([TRN3])

Numerics model (documented choice): within one instruction the contraction is computed exactly
(float64 products and sums of fp32-exact inputs) and rounded once to float32 — the hardware
accumulates in fp32 in an undocumented order (nc_matmul docs); across instructions PSUM
accumulation is a float32 add (bf16 PSUM on v4: fp32 add then RNE to bf16, [TRN3]).
"""
from __future__ import annotations

import numpy as np

from ...errors import NkiValidationError
from ...access import carries_values, checked_read, checked_write, to_float32, valueless
from ... import dtypes as D
from . import constants as C
from ._common import NkiInstruction, ctx, dtype_in, fail, on_chip, require_nc_version

_FP8 = (D.float8_e4m3, D.float8_e5m2, D.float8_e4m3fn)
_WIDE = (D.float32, D.tfloat32)


def check_tiling(instr, tile_position, tile_size, k, m, allow_column=True):
    """Validate PE-array tiling (nc_matmul docs, tile_position/tile_size); returns True when column tiling is used."""
    tp, ts = tuple(tile_position or ()), tuple(tile_size or ())
    if bool(tp) != bool(ts):
        fail(instr, f"tile_position and tile_size must be set together, got {tp!r} and {ts!r}")
    if not tp:
        return False
    if len(tp) != 2 or len(ts) != 2:
        fail(instr, f"tile_position/tile_size must be 2-tuples, got {tp!r} / {ts!r}")
    sizes = (32, 64, 128) if ctx().target.nc_version >= 3 else (64, 128)  # 32-tiles need v3+
    for label, size, start in (("row", ts[0], tp[0]), ("column", ts[1], tp[1])):
        if size not in sizes:
            fail(instr, f"tile_size {label} {size} must be one of {sizes}")
        if start % size or start + size > 128:
            fail(instr, f"tile_position {label} {start} must be a multiple of the tile size {size} within 128")
    if k > ts[0]:
        fail(instr, f"contraction partitions {k} exceed the row tile size {ts[0]}")
    if m > ts[1]:
        fail(instr, f"stationary free size {m} exceeds the column tile size {ts[1]}")
    column = ts[1] != 128
    if column and not allow_column:
        fail(instr, f"column tiling (tile_size {ts}) is not allowed here")
    return column


_NC_MATMUL_URL = "https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.nc_matmul.html"
_TRN2_ARCH_URL = "https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/guides/architecture/trainium2_arch.html"


def check_psum_bank(instr, dst):
    """NeuronCore-v3 (trn2): a matmul output must fit in one 2 KiB PSUM bank per partition (Trainium2
    architecture guide, PSUM section). NeuronCore-v4 matmuls may span banks (nc_matmul_mx's N limit is
    the whole PSUM in the 2.32 docs), so the rule is checked on v3 only. PSUM tensors start on a bank
    boundary (nl.ndarray), so bank k of a partition row is bytes [2048k, 2048(k+1)) of the tensor."""
    target = ctx().target
    if target.nc_version != 3:
        return
    row = dst.row_elems
    lo = hi = dst.offset % row
    for n, s in zip(dst.shape[1:], dst.strides[1:]):
        lo += min(0, (n - 1) * s)
        hi += max(0, (n - 1) * s)
    isz = dst.dtype.itemsize
    byte_lo, byte_hi = lo * isz, (hi + 1) * isz - 1
    bank = target.psum_bank_bytes
    if byte_lo // bank != byte_hi // bank:
        fail(instr, f"argument 'dst' ('{dst.name}', shape {dst.shape}) covers bytes [{byte_lo}, {byte_hi}] of each "
                    f"PSUM partition, crossing from bank {byte_lo // bank} into bank {byte_hi // bank}; expected the "
                    f"matmul output to fit one {bank}-byte PSUM bank per partition on {target.name} ({_TRN2_ARCH_URL})")


def psum_accumulate(instr, dst, result, accumulate):
    """Write a fp32 matmul result into PSUM with the `accumulate` rule (nc_matmul docs; the
    per-element first-write model is our choice, docs/simulator.md)."""
    # `1 in (None, True, False)` is true in Python: check the type so 0/1/"yes" are rejected too
    if accumulate is not None and not isinstance(accumulate, (bool, np.bool_)):
        fail(instr, f"accumulate must be None, True or False, got {accumulate!r}")
    accumulate = None if accumulate is None else bool(accumulate)
    if result is None:  # shape-only run, an operand without values
        if accumulate is True and not dst.byte_mask_view(dst.storage.mm_written).all():
            _uninit_accumulate(instr, dst)
        checked_write(dst, instr, "dst", None, matmul=True)
        return
    flags = dst.elements_all(dst.storage.mm_written).reshape(result.shape)
    if accumulate is not False and flags.any() and not carries_values(dst):
        checked_write(dst, instr, "dst", None, matmul=True)  # shape-only: adds to value-less partial sums
        return
    if accumulate is False:
        out = result
    else:
        if accumulate is True and not flags.all():
            _uninit_accumulate(instr, dst)
        existing = dst._np().astype(np.float32).reshape(result.shape)
        out = np.where(flags, existing + result, result).astype(np.float32)
    checked_write(dst, instr, "dst", out, matmul=True)


def _uninit_accumulate(instr, dst):
    if ctx().settings.strict:
        raise NkiValidationError(
            f"nisa.{instr}: accumulate=True on PSUM tensor '{dst.name}' elements never written by a matmul; "
            f"undefined on hardware ({_NC_MATMUL_URL})")


def nc_matmul(dst, stationary, moving, is_stationary_onezero=False, is_moving_onezero=False, is_transpose=False,
              accumulate=None, tile_position=(), tile_size=(), perf_mode=C.matmul_perf_mode.none, name=None):
    """dst[m, n] (=/+=) sum_k stationary[k, m] * moving[k, n] (nc_matmul docs)."""
    instr = "nc_matmul"
    c = ctx()
    target = c.target
    dst = on_chip(instr, "dst", dst, ("psum",))
    st = on_chip(instr, "stationary", stationary, ("sbuf",))
    mv = on_chip(instr, "moving", moving, ("sbuf",))
    allowed_in = (D.float8_e4m3, D.float8_e5m2, D.bfloat16, D.float16, D.tfloat32, D.float32)
    if target.has_mx:
        allowed_in = allowed_in + (D.float8_e4m3fn,)
    dtype_in(instr, "stationary", st, allowed_in)
    dtype_in(instr, "moving", mv, allowed_in)
    if (st.dtype in _WIDE) != (mv.dtype in _WIDE):
        fail(instr, f"if either input is float32/tfloat32 both must be: stationary {st.dtype}, moving {mv.dtype}")
    if {st.dtype, mv.dtype} == {D.float8_e4m3, D.float8_e4m3fn}:
        fail(instr, "legacy float8_e4m3 and OCP float8_e4m3fn inputs may not be mixed")
    try:
        perf = C.matmul_perf_mode(perf_mode)
    except ValueError:
        fail(instr, f"perf_mode must be 'none' or 'double_row', got {perf_mode!r}")
    k = st.shape[0]
    if mv.shape[0] != k:
        fail(instr, f"stationary and moving must have the same partition (contraction) size, got {k} and {mv.shape[0]}")

    if is_transpose:
        require_nc_version(instr, 3, "is_transpose")
        if perf != C.matmul_perf_mode.none:
            fail(instr, "is_transpose cannot be combined with perf_mode double_row")
        m = st.free_size
        if mv.shape != (k, k) and not (mv.shape[0] == k and mv.free_size == k):
            fail(instr, f"is_transpose: moving must be a [{k}, {k}] identity, got shape {mv.shape}")
        if dst.dtype != st.dtype:
            fail(instr, f"is_transpose: dst dtype {dst.dtype} must equal the stationary dtype {st.dtype} "
                        f"({_NC_MATMUL_URL})")
        if dst.shape[0] != m or dst.free_size != k:
            fail(instr, f"is_transpose: dst must be [{m}, {k}], got {dst.shape}")
        check_tiling(instr, tile_position, tile_size, k, m)
        check_psum_bank(instr, dst)
        c.record(instr=instr, engine="tensor", reads=[("stationary", st), ("moving", mv)], writes=[("dst", dst)],
                 K=k, M=m, N=k, in_dtype=str(st.dtype), transpose=True, perf_mode="none")
        raw = checked_read(st, instr, "stationary")
        ident = checked_read(mv, instr, "moving")
        if valueless(raw, ident):
            checked_write(dst, instr, "dst", None, matmul=True)
            return NkiInstruction(name)
        if not np.array_equal(to_float32(mv, ident).reshape(k, k), np.eye(k, dtype=np.float32)):
            fail(instr, f"is_transpose: moving must be an identity matrix (bit-accurate transpose mode, "
                        f"{_NC_MATMUL_URL})")
        checked_write(dst, instr, "dst", raw.reshape(k, m).T.copy(), matmul=True)
        return NkiInstruction(name)

    if perf == C.matmul_perf_mode.double_row:
        require_nc_version(instr, 3, "perf_mode double_row")
        if st.dtype not in _FP8 or mv.dtype not in _FP8:
            fail(instr, f"perf_mode double_row requires fp8 inputs, got {st.dtype} and {mv.dtype}")
        if st.ndim != 3 or st.shape[1] != 2 or mv.ndim != 3 or mv.shape[1] != 2:
            fail(instr, f"perf_mode double_row requires [K, 2, M] / [K, 2, N] operands, got {st.shape} and {mv.shape}")
        m, n, k_eff = st.shape[2], mv.shape[2], 2 * k
    else:
        m, n, k_eff = st.free_size, mv.free_size, k
    if k > 128:
        fail(instr, f"contraction partitions {k} exceed 128")
    if m > 128:
        fail(instr, f"stationary free size {m} exceeds gemm_stationary_fmax 128")
    if dst.dtype == D.float32:
        n_max = target.matmul_moving_fmax_fp32
    elif dst.dtype == D.bfloat16 and target.matmul_moving_fmax_bf16:
        n_max = target.matmul_moving_fmax_bf16
    else:
        allowed = "float32" + (" or bfloat16" if target.matmul_moving_fmax_bf16 else "")
        fail(instr, f"dst dtype must be {allowed} on {target.name}, got {dst.dtype}")
    if n > n_max:
        fail(instr, f"moving free size {n} exceeds the {target.name} limit of {n_max} for a {dst.dtype} PSUM dst")
    if dst.shape[0] != m or dst.free_size != n:
        fail(instr, f"dst must be [{m}, {n}] (stationary free x moving free), got {dst.shape}")
    column = check_tiling(instr, tile_position, tile_size, k, m)
    check_psum_bank(instr, dst)
    if column and perf == C.matmul_perf_mode.double_row:
        fail(instr, "perf_mode double_row cannot be combined with column tiling")
    c.record(instr=instr, engine="tensor", reads=[("stationary", st), ("moving", mv)], writes=[("dst", dst)],
             K=k_eff, M=m, N=n, in_dtype=str(st.dtype), moving_dtype=str(mv.dtype), dst_dtype=str(dst.dtype),
             perf_mode=perf.value, transpose=False)
    s_raw = checked_read(st, instr, "stationary")
    m_raw = checked_read(mv, instr, "moving")
    if valueless(s_raw, m_raw):
        psum_accumulate(instr, dst, None, accumulate)
        return NkiInstruction(name)
    s = to_float32(st, s_raw).reshape(k_eff, m).astype(np.float64)
    v = to_float32(mv, m_raw).reshape(k_eff, n).astype(np.float64)
    result = (s.T @ v).astype(np.float32)
    psum_accumulate(instr, dst, result, accumulate)
    return NkiInstruction(name)
