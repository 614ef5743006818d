"""Dependency tracking: operand regions and the RAW/WAR/WAW predecessors of each instruction."""
from __future__ import annotations

from .operands import _on_chip


def _region(op):
    """('chip', plo, phi, blo, bhi) | ('rect', R, r0, r1, c0, c1) | ('int', lo, hi)."""
    if _on_chip(op):
        return ("chip", op.partition_lo, op.partition_hi, op.byte_lo, op.byte_hi)
    isz = op.storage_itemsize
    if isz and op.strides:
        dims = [(n, s) for n, s in zip(op.shape, op.strides) if n != 1]
        merged = []
        for n, s in reversed(dims):  # innermost first; merge contiguous neighbours
            if merged and s == merged[-1][0] * merged[-1][1]:
                merged[-1] = (merged[-1][0] * n, merged[-1][1])
            else:
                merged.append((n, s))
        off = op.byte_offset
        if not merged:
            return ("int", off, off + isz)
        if len(merged) == 1 and merged[0][1] == isz:
            return ("int", off, off + merged[0][0] * isz)
        if len(merged) == 2 and merged[0][1] == isz and merged[1][1] > 0:
            (ni, _), (no, so) = merged
            c0 = off % so
            c1 = c0 + ni * isz
            if c1 <= so:
                r0 = off // so
                return ("rect", so, r0, r0 + no, c0, c1)
    return ("int", op.byte_lo, op.byte_hi)


def _bounds(r):
    if r[0] == "rect":
        _, R, r0, r1, c0, c1 = r
        return r0 * R + c0, (r1 - 1) * R + c1
    return r[1], r[2]


def _overlap(a, b) -> bool:
    if a[0] == "chip":
        return a[1] < b[2] and b[1] < a[2] and a[3] < b[4] and b[3] < a[4]
    if a[0] == "rect" and b[0] == "rect" and a[1] == b[1]:
        return a[2] < b[3] and b[2] < a[3] and a[4] < b[5] and b[4] < a[5]
    if a[0] == "rect" and b[0] == "int":
        a, b = b, a
    if a[0] == "int" and b[0] == "rect":
        lo, hi = a[1], a[2]
        _, R, r0, r1, c0, c1 = b
        if hi - lo >= R:
            return lo < _bounds(b)[1] and _bounds(b)[0] < hi
        # an interval shorter than a row touches at most two rows: test them exactly
        for row in (lo // R, (hi - 1) // R):
            if r0 <= row < r1 and lo < row * R + c1 and row * R + c0 < hi:
                return True
        return False
    alo, ahi = _bounds(a)
    blo, bhi = _bounds(b)
    return alo < bhi and blo < ahi


def _contains(a, b) -> bool:
    """True if region a covers region b (only same-form comparisons; else False, conservative)."""
    if a[0] != b[0]:
        return a[0] == "int" and _bounds(a)[0] <= _bounds(b)[0] and _bounds(b)[1] <= _bounds(a)[1]
    if a[0] == "chip":
        return a[1] <= b[1] and b[2] <= a[2] and a[3] <= b[3] and b[4] <= a[4]
    if a[0] == "rect":
        return a[1] == b[1] and a[2] <= b[2] and b[3] <= a[3] and a[4] <= b[4] and b[5] <= a[5]
    return a[1] <= b[1] and b[2] <= a[2]


def _union(a, b):
    if a[0] == "chip" and b[0] == "chip":
        return ("chip", min(a[1], b[1]), max(a[2], b[2]), min(a[3], b[3]), max(a[4], b[4]))
    if a[0] == "rect" and b[0] == "rect" and a[1] == b[1]:
        return ("rect", a[1], min(a[2], b[2]), max(a[3], b[3]), min(a[4], b[4]), max(a[5], b[5]))
    (alo, ahi), (blo, bhi) = _bounds(a), _bounds(b)
    return ("int", min(alo, blo), max(ahi, bhi))


_READ_CAP = 24  # read entries kept per storage before the oldest are merged (conservatively)


class _Tracker:
    """Last accesses per (program, storage): yields RAW/WAR/WAW predecessors of a new instruction."""

    def __init__(self):
        self.writes = {}  # key -> list of [region, seqs]
        self.reads = {}  # key -> list of [region, seqs, engine]

    def deps(self, prog, rec, engine):
        out = set()
        rregs = [((prog, o.storage_id), _region(o)) for o in rec.reads]
        wregs = [((prog, o.storage_id), _region(o)) for o in rec.writes]
        for key, reg in rregs:
            for w in self.writes.get(key, ()):
                if _overlap(reg, w[0]):
                    out.update(w[1])
        for key, reg in wregs:
            for w in self.writes.get(key, ()):
                if _overlap(reg, w[0]):
                    out.update(w[1])
            for r in self.reads.get(key, ()):
                if _overlap(reg, r[0]):
                    out.update(r[1])
        # update: a write covering an older access subsumes it (the new write is ordered after it)
        for key, reg in wregs:
            ws = self.writes.setdefault(key, [])
            ws[:] = [w for w in ws if not _contains(reg, w[0])]
            ws.append([reg, (rec.seq,)])
            rs = self.reads.get(key)
            if rs:
                rs[:] = [r for r in rs if not _contains(reg, r[0])]
        for key, reg in rregs:
            rs = self.reads.setdefault(key, [])
            rs.append([reg, (rec.seq,), engine])
            if len(rs) > _READ_CAP:
                self._merge(rs)
        out.discard(rec.seq)
        return out

    @staticmethod
    def _merge(rs):
        half = rs[: len(rs) // 2]
        keep = rs[len(rs) // 2:]
        merged = {}
        for reg, seqs, eng in half:
            m = merged.get(eng)
            if m is None:
                merged[eng] = [reg, seqs if isinstance(seqs, list) else list(seqs), eng]
            else:
                m[0] = _union(m[0], reg)
                if eng == "dma":
                    m[1].extend(seqs)  # DMA queues complete out of order: keep every predecessor
                else:
                    m[1] = [max(max(m[1]), max(seqs))]  # in-order engine: the last read ends last
        rs[:] = list(merged.values()) + keep

