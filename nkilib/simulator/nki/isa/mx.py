"""MX (microscaling) instructions of NeuronCore-v4: quantize_mx (Vector) and nc_matmul_mx (Tensor).

The numerics live in one place, `nkilib.mx` (`hw_quantize_tile`, `hw_matmul_mx`); this module only
validates operands, handles the SBUF quadrant layout of the scales and the PSUM accumulate rule
(shared with nc_matmul), so simulator and reference agree bit for bit.

Scale quadrant layout (quantize_mx docs; mxfp matmul guide): group row g (data partitions 8g..8g+7,
relative to the data start) owns scale row r(g) = 32*(g//4) + g%4 relative to the scale view start,
i.e. the first 4 partitions of each quadrant. quantize_mx writes ONLY those rows (the other rows keep
whatever they held: nki-library calls them "random garbage") and nc_matmul_mx reads only those rows,
so a matmul whose scales were never produced by quantize_mx trips the strict uninitialised-read check.
Copying a whole scale tile is legal: the never-written mark travels with the copy (access.py).

References:
    https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.quantize_mx.html
    https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.nc_matmul_mx.html
    https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/deep-dives/mxfp-matmul.html (mxfp matmul guide)
"""
from __future__ import annotations

import numpy as np

from .... import mx as mxlib
from ... import dtypes as D
from ...access import checked_read, checked_write, valueless
from ._common import NkiInstruction, ctx, dtype_in, fail, on_chip, require_nc_version
from .matmul import check_tiling, psum_accumulate

_MM_MX_URL = "https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.nc_matmul_mx.html"
_QMX_URL = "https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.quantize_mx.html"
_MXFP_GUIDE_URL = "https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/deep-dives/mxfp-matmul.html"
_QUADRANT = 32
_GROUP_PARTITIONS = 8  # an MX group spans 8 partitions x 4 packed elements
# packed scale views (mxfp matmul guide, "Packing Scale Values"; nki-library ALLOWED_P_SCALE_IDX_OFFSETS)
_SCALE_OFFSETS = (0, 4, 8, 12)
_QMX_SRC = (D.float16, D.bfloat16)
_QMX_DST = (D.float8_e4m3fn_x4, D.float8_e5m2_x4)
_MM_IN = (D.float8_e4m3fn_x4, D.float8_e5m2_x4, D.float4_e2m1fn_x4)
_SCALE = (D.uint8, D.float8_e8m0fnu)


def _scale_rows_needed(groups: int) -> int:
    """Rows a scale view must cover for `groups` group rows: r(groups - 1) + 1."""
    return mxlib.scale_row(groups - 1) + 1


def _quadrant_row_views(scale, groups: int):
    """Sub-views of `scale` holding exactly the rows r(g), g < groups: one 4-row block per quadrant."""
    views = []
    for q in range(-(-groups // 4)):
        rows = min(4, groups - 4 * q)
        views.append(scale[_QUADRANT * q:_QUADRANT * q + rows])
    return views


def _check_scale(instr, arg, scale, groups, free, free_what):
    """Scale operand rules shared by quantize_mx and nc_matmul_mx (quantize_mx / nc_matmul_mx docs)."""
    scale = on_chip(instr, arg, scale, ("sbuf",))
    dtype_in(instr, arg, scale, _SCALE)
    if scale.free_size != free:
        fail(instr, f"argument '{arg}' ('{scale.name}') must have {free} elements per partition ({free_what}), "
                    f"got {scale.free_size} (shape {scale.shape})")
    start, count = scale.partition_info()
    if start % _QUADRANT not in _SCALE_OFFSETS:
        fail(instr, f"argument '{arg}' starts at partition {start} (offset {start % _QUADRANT} in its quadrant); "
                    f"scale views must start at quadrant offset {list(_SCALE_OFFSETS)} (packing scale values, "
                    f"{_MXFP_GUIDE_URL})")
    data_partitions = groups * _GROUP_PARTITIONS
    if data_partitions <= _QUADRANT:
        need = _scale_rows_needed(groups)
        rule = f"{need} rows (a [P/8, F/4] tile is enough for P <= 32 data partitions)"
    else:
        # Oversize rule: for P > 32 the scale tile is [P, F/4] (quantize_mx docs; mxfp matmul guide,
        # "P <= 32: [P//8, F//4]; P > 32: [P, F//4]"); a packed view starting at quadrant offset o
        # (0/4/8/12) spans the P rows of its quadrants from there on: P - o rows.
        need = data_partitions - start % _QUADRANT
        rule = (f"{need} rows (P={data_partitions} > 32 data partitions need a [P, F/4] scale tile, "
                f"less its quadrant offset {start % _QUADRANT})")
    if count < need:
        fail(instr, f"argument '{arg}' ('{scale.name}') has {count} partitions; expected at least {rule}; "
                    f"see {_QMX_URL} and {_MXFP_GUIDE_URL}")
    return scale, start


def quantize_mx(dst, src, dst_scale, name=None):
    """MX-quantize an SBUF tile (Vector Engine, NeuronCore-v4; quantize_mx docs).

    Group (g, j) = src[8g:8g+8, 4j:4j+4] shares one E8M0 scale byte, written to dst_scale row
    32*(g//4) + g%4 (relative to the scale view), column j; dst[p, j] packs the four fp8 codes of
    src[p, 4j:4j+4]. Scale rule: settings.qmx_scale_rule ("neuron" = SDK 2.31+ default,
    "ocp_floor" = SDK <= 2.30), env NKILIB_QMX_SCALE_RULE (2.31 release notes: "alternative emax"; docs/simulator.md).

    Args:
        dst: SBUF float8_e4m3fn_x4 / float8_e5m2_x4 [P, F/4].
        src: SBUF float16 / bfloat16 [P, F] (extra free dims flattened), P in {32, 64, 96, 128},
            F % 4 == 0, starting at a quadrant boundary.
        dst_scale: SBUF uint8 / float8_e8m0fnu [R, F/4], starting at quadrant offset 0/4/8/12 in
            the same quadrant as src; R >= 4 for P = 32, R >= P - (quadrant offset) for P > 32
            (`_check_scale`).
        name: instruction name (unused by the simulator).
    """
    instr = "quantize_mx"
    require_nc_version(instr, 4)
    c = ctx()
    src = on_chip(instr, "src", src, ("sbuf",))
    dtype_in(instr, "src", src, _QMX_SRC)
    p = src.shape[0]
    if p not in mxlib.QMX_PARTITIONS:
        fail(instr, f"src partition count {p} must be one of {list(mxlib.QMX_PARTITIONS)} (multiple of 32, <= 128)")
    f = src.free_size
    if f % 4:
        fail(instr, f"src free size {f} (shape {src.shape}) must be a multiple of 4")
    src_start, _ = src.partition_info()
    if src_start % _QUADRANT:
        # nki-library: "data at quadrant start q*32": groups never straddle quadrants.
        fail(instr, f"src starts at partition {src_start}; quantize_mx data must start at a quadrant boundary "
                    "(multiple of 32)")
    dst = on_chip(instr, "dst", dst, ("sbuf",))
    if dst.dtype == D.float4_e2m1fn_x4:
        fail(instr, f"dst dtype {dst.dtype} is not supported: quantize_mx produces fp8 only "
                    f"(expected one of {[str(d) for d in _QMX_DST]})")
    dtype_in(instr, "dst", dst, _QMX_DST)
    if dst.shape[0] != p or dst.free_size != f // 4:
        fail(instr, f"dst must have {p} partitions and {f // 4} x4 elements per partition (src {src.shape}), "
                    f"got shape {dst.shape}")
    dst_start, _ = dst.partition_info()
    if dst_start != src_start:
        fail(instr, f"dst starts at partition {dst_start} but src at {src_start}; data and output must start in "
                    f"the same quadrant ({_QMX_URL})")
    groups = p // _GROUP_PARTITIONS
    dst_scale, scale_start = _check_scale(instr, "dst_scale", dst_scale, groups, f // 4, "src free size / 4")
    if scale_start // _QUADRANT != src_start // _QUADRANT:
        # 2.28 docs: "dst and dst_scale must reside in the same SBUF quadrant(s)"; newer nki-library:
        # "data and scales must start at the same quadrant offset".
        fail(instr, f"dst_scale starts at partition {scale_start} (quadrant {scale_start // _QUADRANT}) but src "
                    f"starts in quadrant {src_start // _QUADRANT}; scales must start in the data's quadrant")
    rule = c.settings.qmx_scale_rule
    row_views = _quadrant_row_views(dst_scale, groups)
    c.record(instr=instr, engine="vector", reads=[("src", src)],
             writes=[("dst", dst)] + [("dst_scale", v) for v in row_views],
             elems=f, P=p, src_dtype=str(src.dtype), dst_dtype=str(dst.dtype), scale_rule=rule)
    raw = checked_read(src, instr, "src")
    if raw is None:
        checked_write(dst, instr, "dst", None)
        for v in row_views:
            checked_write(v, instr, "dst_scale", None)
        return NkiInstruction(name)
    words, scales = mxlib.hw_quantize_tile(raw.reshape(p, f), str(dst.dtype), rule)
    checked_write(dst, instr, "dst", words)
    for q, v in enumerate(row_views):
        checked_write(v, instr, "dst_scale", scales[4 * q:4 * q + v.shape[0]])
    return NkiInstruction(name)


def _read_scales(instr, arg, scale, groups):
    """Group-order scale bytes uint8 [groups, X] read from the quadrant rows only (or None)."""
    parts = []
    for v in _quadrant_row_views(scale, groups):
        raw = checked_read(v, instr, arg)
        if raw is None:  # shape-only run, rows without values: read the others (bookkeeping), return None
            parts = None
        elif parts is not None:
            parts.append(raw.reshape(v.shape[0], -1).view(np.uint8))
    return np.concatenate(parts, axis=0) if parts else None


def nc_matmul_mx(dst, stationary, moving, stationary_scale, moving_scale, tile_position=None, tile_size=None,
                 accumulate=None, name=None):
    """MX matmul with built-in dequantization (Tensor Engine, NeuronCore-v4; nc_matmul_mx docs).

    dst[m, n] (=/+=) sum_{p<K} sum_{k<4} S[p,m,k] 2^(ss[r(p//8),m]-127) V[p,n,k] 2^(ms[r(p//8),n]-127),
    with S/V the decoded x4 elements and r(g) = 32*(g//4) + g%4. Effective contraction 4K.

    Args:
        dst: PSUM float32 / bfloat16 [M, N].
        stationary: SBUF x4 [K, M] (fp8 or fp4 x4), K in {32, 64, 96, 128}, M even <= 128.
        moving: SBUF x4 [K, N], N <= the target's moving limit for the dst dtype.
        stationary_scale: SBUF uint8 / float8_e8m0fnu, M elements per partition, quadrant layout.
        moving_scale: SBUF uint8 / float8_e8m0fnu, N elements per partition, quadrant layout.
        tile_position, tile_size: row tiling only: tile_size=(row, 128), tile_position=(start, 0).
        accumulate: None (first write overwrites, then accumulate), True or False (nc_matmul docs).
        name: instruction name (unused by the simulator).
    """
    instr = "nc_matmul_mx"
    require_nc_version(instr, 4)
    c = ctx()
    target = c.target
    dst = on_chip(instr, "dst", dst, ("psum",))
    st = on_chip(instr, "stationary", stationary, ("sbuf",))
    mv = on_chip(instr, "moving", moving, ("sbuf",))
    for arg, t in (("stationary", st), ("moving", mv)):
        if not t.dtype.is_x4:
            fail(instr, f"argument '{arg}' ('{t.name}') has dtype {t.dtype}; nc_matmul_mx takes MX x4 data "
                        f"({[str(d) for d in _MM_IN]}); use nc_matmul for unpacked dtypes")
        dtype_in(instr, arg, t, _MM_IN)
    k = st.shape[0]
    if mv.shape[0] != k:
        fail(instr, f"stationary and moving must have the same partition (contraction) size, got {k} and {mv.shape[0]}")
    if k % _QUADRANT or k > 128:
        fail(instr, f"contraction partitions K={k} must be a multiple of 32 and <= 128 ({_MM_MX_URL})")
    m, n = st.free_size, mv.free_size
    if m % 2 or m > 128:
        fail(instr, f"stationary free size M={m} must be even and <= 128 ({_MM_MX_URL})")
    # N limit: the 2.31+ "entire PSUM" limit (4096 fp32 / 8192 bf16) from hardware.py (nc_matmul_mx docs
    # v2.32.0; docs <= 2.30 said one bank).
    if dst.dtype == D.float32:
        n_max = target.matmul_moving_fmax_fp32
    elif dst.dtype == D.bfloat16:
        n_max = target.matmul_moving_fmax_bf16
    else:
        fail(instr, f"dst dtype must be float32 or bfloat16, got {dst.dtype}")
    if n > n_max:
        fail(instr, f"moving free size N={n} exceeds the {target.name} limit of {n_max} for a {dst.dtype} PSUM dst")
    if dst.shape[0] != m or dst.free_size != n:
        fail(instr, f"dst must be [{m}, {n}] (stationary free x moving free), got {dst.shape}")
    groups = k // _GROUP_PARTITIONS
    ss, ss_start = _check_scale(instr, "stationary_scale", stationary_scale, groups, m, "stationary free size M")
    ms, ms_start = _check_scale(instr, "moving_scale", moving_scale, groups, n, "moving free size N")
    for arg, data, scale_start in (("stationary", st, ss_start), ("moving", mv, ms_start)):
        # mxfp matmul guide: the scales of a group live in the 32-partition quadrant the group's data
        # came from (quantize_mx checks the same for its output).
        data_start, _ = data.partition_info()
        if scale_start // _QUADRANT != data_start // _QUADRANT:
            fail(instr, f"argument '{arg}_scale' starts at partition {scale_start} "
                        f"(quadrant {scale_start // _QUADRANT}) but '{arg}' ('{data.name}') starts at partition "
                        f"{data_start} (quadrant {data_start // _QUADRANT}); expected the scales in the data's "
                        f"quadrant ({_MXFP_GUIDE_URL})")
    check_tiling(instr, tile_position, tile_size, k, m, allow_column=False)
    ss_rows = _quadrant_row_views(ss, groups)
    ms_rows = _quadrant_row_views(ms, groups)
    c.record(instr=instr, engine="tensor",
             reads=[("stationary", st), ("moving", mv)] + [("stationary_scale", v) for v in ss_rows]
             + [("moving_scale", v) for v in ms_rows],
             writes=[("dst", dst)], K=4 * k, M=m, N=n, partitions=k, in_dtype=str(st.dtype),
             moving_dtype=str(mv.dtype), dst_dtype=str(dst.dtype), perf_mode="mx", transpose=False)
    s_raw = checked_read(st, instr, "stationary")
    m_raw = checked_read(mv, instr, "moving")
    s_scale = _read_scales(instr, "stationary_scale", ss, groups)
    m_scale = _read_scales(instr, "moving_scale", ms, groups)
    if valueless(s_raw, m_raw, s_scale, m_scale):
        psum_accumulate(instr, dst, None, accumulate)
        return NkiInstruction(name)
    result = mxlib.hw_matmul_mx(s_raw.reshape(k, m), m_raw.reshape(k, n), s_scale, m_scale,
                                str(st.dtype), str(mv.dtype))
    psum_accumulate(instr, dst, result, accumulate)
    return NkiInstruction(name)
