"""DMA pricing: bytes, descriptor payload, engines, rate and descriptor generation of one DMA record.

Covers dma_copy, dma_transpose, dma_compute and sendrecv records, including the attributes that the
indirect / read-modify-write DMA trace records carry (all optional; absent attributes price as a plain
static DMA):
- `dge_mode`: "hwdge" / "unknown" -> hardware DGE ([TRN2]: ~600 ns per instruction on one of two
  DGE instances per core); "swdge" -> GpSimd builds the descriptors ([DGE]); "none" -> host-built
  descriptors, no on-device generation. Indirect DMAs (`indirect=True`) always use software DGE
  ([DGE]: the only mode that supports vector_offset).
- `indirect=True`, `descriptors=<n>`, `rows=<n>`, `bytes=<n>`: a gather/scatter moving `bytes` in
  `descriptors` pieces (bytes per descriptor = the contiguous payload).
- `rmw=True` (instr dma_compute) with `bytes=<bytes written>`: read-modify-write; the destination is
  read and written (two passes of its bytes over the DMA engines and, in HBM, over HBM), except into
  SBUF on NC-v4, which adds near memory at full DMA throughput ([TRN3]).
Tags: see the table in nkilib/simulator/hardware.py.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..hardware import TargetSpec
from .operands import CostModelError, _contig_run_elems, _itemsize, _on_chip, _ops, _parts

_HW_DGE_MODES = ("hwdge", "unknown", "")


@dataclass
class DmaWork:
    """What a DMA transfer asks of the DMA engines (and of the descriptor generator before it)."""

    nbytes: int  # bytes the DMA engines move (read-modify-write: both passes)
    payload: int  # contiguous bytes per descriptor
    engines: int  # DMA engines the transfer is split over
    hbm_bytes: int  # bytes read from + written to HBM
    rate_per_engine: float  # bytes/s of one engine at this payload
    transpose: bool = False
    dge: str = "hw"  # "hw": hardware DGE instance; "sw": GpSimd; "none": host-built descriptors
    dge_seconds: float = 0.0  # hw: time on one DGE instance; sw: time on GpSimd; before the transfer
    descriptors: int = 0  # descriptors the transfer needs (sw DGE work)

    @property
    def max_rate(self) -> float:
        return self.engines * self.rate_per_engine


def _mode(rec) -> str:
    v = rec.attrs.get("dge_mode")
    return str(getattr(v, "name", v) if v is not None else "").lower()


def _payload_rate(payload, target) -> float:
    """Per-engine rate at `payload` contiguous bytes per descriptor: theoretical x p / (p + p0), capped at
    the sustained rate, p0 such that a 4 KiB payload reaches the sustained rate [DMA], [DMABW]."""
    theo, sust = target.dma_theoretical_bytes_per_s_per_engine, target.dma_bytes_per_s_per_engine
    p0 = target.dma_payload_full_rate_bytes * (theo / sust - 1.0)
    return min(sust, theo * payload / (payload + p0))


def dma_work(rec, target: TargetSpec) -> DmaWork:
    """Bytes, descriptor payload, engines, per-engine rate and descriptor generation of one DMA record."""
    a = rec.attrs
    ops = _ops(rec)
    if not ops:
        raise CostModelError(f"{rec.instr}: DMA record without operands")
    # an indirect DMA whose rows are all skipped (oob_mode.skip) records bytes=0: it moves nothing
    nbytes = int(a["bytes"]) if a.get("bytes") is not None else max(o.nbytes for o in ops)
    transpose = bool(a.get("transpose")) or rec.instr == "dma_transpose"
    indirect = bool(a.get("indirect"))
    descriptors = int(a.get("descriptors") or 0)
    chip = [o for o in ops if _on_chip(o)]
    parts = max((_parts(o) for o in chip), default=target.num_partitions)
    engines = min(target.dma_engines_per_core, max(1, -(-parts // target.dma_partitions_per_engine)))
    if indirect and descriptors:
        payload = nbytes // descriptors  # one gathered/scattered row piece per descriptor
    elif transpose and target.scenario == "pessimistic":
        # [16 x n] blocks: every partition receives 16-element pieces ([DMAT] hwdge shape rule; INFERRED)
        dst = rec.writes[0] if rec.writes else ops[0]
        payload = target.dma_transpose_block_elems * _itemsize(dst.dtype)
    else:
        payload = min(_contig_run_elems(o) * _itemsize(o.dtype) for o in ops)
    payload = max(1, min(payload, nbytes))
    rate = _payload_rate(payload, target) * target.dma_efficiency
    if transpose and target.scenario != "pessimistic":
        # "up to 90%" of DMA throughput from HBM, "up to 50%" SBUF->SBUF [TRN2]
        src = rec.reads[0] if rec.reads else None
        eff = target.dma_transpose_sbuf_efficiency if src is not None and _on_chip(src) else \
            target.dma_transpose_hbm_efficiency
        rate = target.dma_bytes_per_s_per_engine * eff * target.dma_efficiency
    hbm = sum(o.nbytes for o in ops if not _on_chip(o))
    if a.get("rmw"):
        dst = rec.writes[0] if rec.writes else None
        into_hbm = dst is not None and not _on_chip(dst)
        passes = 2 if into_hbm else target.rmw_sbuf_passes
        src_hbm = sum(o.nbytes for o in rec.reads
                      if not _on_chip(o) and (dst is None or o.storage_id != dst.storage_id))
        hbm = max(hbm, src_hbm + (2 * nbytes if into_hbm else 0))  # read + write of the destination rows
        nbytes *= passes
    mode = _mode(rec)
    if indirect or mode == "swdge":
        if not descriptors:
            descriptors = max(1, -(-nbytes // payload))
        cycles = target.gpsimd_start_cycles + descriptors * target.swdge_descriptor_cycles
        return DmaWork(nbytes, payload, engines, hbm, rate, transpose, "sw", cycles / target.gpsimd_clock_hz,
                       descriptors)
    if mode == "none" or target.nc_version < 3:  # host-built descriptors; NC-v2 has no hardware DGE
        return DmaWork(nbytes, payload, engines, hbm, rate, transpose, "none", 0.0, descriptors)
    if mode not in _HW_DGE_MODES:
        raise CostModelError(f"{rec.instr}: unknown dge_mode {mode!r} (trace seq {rec.seq})")
    return DmaWork(nbytes, payload, engines, hbm, rate, transpose, "hw", target.dge_instruction_s, descriptors)
