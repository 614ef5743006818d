"""Cost report: modeled time, MFU, HBM traffic, per-engine and per-phase numbers, as JSON or a table."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from ..hardware import TargetSpec, resolve_target
from .allocator import scheduled_occupancy
from .operands import _phase_label
from .scheduler import Schedule


def _peak_flops_per_core(target: TargetSpec, precision: str) -> float:
    bf16 = 2.0 * 128 * 128 * target.tensor_clock_hz  # 79 TFLOPS BF16 per NeuronCore [TRN2]/[TRN3]
    return {"bf16": bf16, "fp8": 2 * bf16, "mx": 4 * bf16, "fp32": bf16 / target.matmul_fp32_factor}[precision]


def _infer_precision(records) -> str:
    kinds = set()
    for r in records:
        if r.instr == "nc_matmul_mx":
            kinds.add("mx")
        elif r.instr == "nc_matmul" and not r.attrs.get("transpose"):
            kinds.add("fp8" if r.attrs.get("perf_mode") == "double_row" else
                      "fp32" if r.attrs.get("in_dtype") in ("float32", "tfloat32") else "bf16")
    for p in ("mx", "fp8", "bf16", "fp32"):
        if p in kinds:
            return p
    return "bf16"



@dataclass
class CostReport:
    """Modeled cost of one kernel call. Build with `CostReport.from_schedule` or `model_kernel`."""

    schedule: Schedule
    target: TargetSpec
    phases: list  # phase label per instruction
    precision: str
    model_flops: float
    memory_peak: list = field(default_factory=list)  # per program {"sbuf": bytes, "psum": bytes} per partition
    launch_overhead_s: float = 0.0

    @classmethod
    def from_schedule(cls, sched: Schedule, target=None, phase_of=None, precision=None, model_flops=None,
                      memory_peak=None, include_launch_overhead=True):
        target = resolve_target(target or sched.target) if not isinstance(target, TargetSpec) else target
        phases = []
        for r in sched.records:
            ph = _phase_label(r)
            if ph is None and phase_of is not None:
                ph = phase_of(r)
            phases.append(ph or "kernel")
        flops = sum(c.flops for c in sched.costs) if model_flops is None else float(model_flops)
        return cls(sched, target, phases, precision or _infer_precision(sched.records), flops,
                   list(memory_peak or []), target.kernel_launch_overhead_s if include_launch_overhead else 0.0)

    # ---- derived numbers ----
    @property
    def scheduled_peak(self) -> list:
        return scheduled_occupancy(self.schedule, self.target)

    @property
    def scheduled_capacity_exceeded(self) -> bool:
        """True when the modeled overlap needs more SBUF/PSUM than the core has: the modeled time
        is then optimistic (the kernel would have to serialise some loads)."""
        return any(p["sbuf"] > self.target.sbuf_bytes_per_partition or p["psum"] > self.target.psum_bytes_per_partition
                   for p in self.scheduled_peak)

    @property
    def plan_errors(self) -> list:
        """Capacity violations, each a message: the kernel's plan (program-order peak, as the simulator
        counts it) or the overlap the modeled schedule needs exceeds a core's SBUF/PSUM per partition, or
        a tile has no placement that does not overlap live tiles it cannot wait for (fragmentation:
        `allocator.UnplaceableTile`; the rule is docs/cost-model.md's "Allocator").
        Usable SBUF is the documented capacity ([TRN2]: 224 KiB, [TRN3]: 32 MiB / 128 = 256 KiB); the docs
        state no compiler reservation. A report with plan errors has no valid time."""
        t = self.target
        limits = {"sbuf": t.sbuf_bytes_per_partition, "psum": t.psum_bytes_per_partition}
        out = []
        for what, peaks in (("plan", self.memory_peak), ("modeled overlap", self.scheduled_peak)):
            for core, peak in enumerate(peaks):
                for buf, limit in limits.items():
                    if peak.get(buf, 0) > limit:
                        out.append(f"core {core}: the {what} needs {peak[buf] / 1024:.1f} KiB of {buf.upper()} per "
                                   f"partition, the target has {limit / 1024:.0f} KiB")
        out.extend(u.message() for u in self.schedule.unplaceable)
        return out

    def hbm_traffic(self) -> dict:
        """HBM bytes moved vs the compulsory minimum: every HBM tensor read before any write (an input) is
        read once and every written one is written once (outputs); tensors written then read back
        (scratch) add a write and a read. Extents are the byte ranges touched, deduplicated over cores."""
        seen = {}
        for r in self.schedule.records:
            for kind, ops in (("r", r.reads), ("w", r.writes)):
                for o in ops:
                    if o.buffer in ("sbuf", "psum"):
                        continue
                    st = seen.setdefault(o.storage_id, {"first": kind, "lo": o.byte_lo, "hi": o.byte_hi,
                                                        "read": False, "written": False})
                    st["lo"], st["hi"] = min(st["lo"], o.byte_lo), max(st["hi"], o.byte_hi)
                    st["read" if kind == "r" else "written"] = True
        compulsory = scratch = 0
        for st in seen.values():
            extent = st["hi"] - st["lo"]
            if st["first"] == "r":
                compulsory += extent * (2 if st["written"] else 1)
            elif st["read"]:
                scratch += 2 * extent
            else:
                compulsory += extent
        moved = sum(self.schedule.hbm_bytes.values())
        return {"moved_bytes": moved, "compulsory_bytes": compulsory, "scratch_bytes": scratch,
                "moved_over_compulsory": moved / compulsory if compulsory else None}

    @property
    def makespan_s(self) -> float:
        return self.schedule.makespan

    @property
    def modeled_time_s(self) -> float:
        return self.schedule.makespan + self.launch_overhead_s

    @property
    def peak_flops(self) -> float:
        return _peak_flops_per_core(self.target, self.precision) * self.schedule.lnc

    @property
    def hbm_bandwidth(self) -> float:
        """Peak HBM throughput available to the launch: its stack, limited by its cores' DMA engines."""
        t = self.target
        dma = self.schedule.lnc * t.dma_engines_per_core * t.dma_bytes_per_s_per_engine
        return min(t.hbm_bytes_per_s_per_chip / t.hbm_stacks_per_chip, dma)

    def _critical_path(self):
        s = self.schedule
        if not s.records:
            return []
        i = max(range(len(s.end)), key=lambda j: s.end[j])
        path, seen = [], set()
        while i is not None and i not in seen:
            seen.add(i)
            path.append(i)
            i = s.blocker[i]
        return path[::-1]

    def to_json(self) -> dict:
        s = self.schedule
        t = self.modeled_time_s
        engines = {}
        for (p, eng), b in sorted(s.engine_busy.items()):
            engines.setdefault(str(p), {})[eng] = {
                "busy_s": b, "utilisation": b / s.makespan if s.makespan else 0.0,
                "instructions": sum(1 for r, c in zip(s.records, s.costs) if r.program == p and c.engine == eng)}
        phases = {}
        for i, (r, c) in enumerate(zip(s.records, s.costs)):
            ph = phases.setdefault(self.phases[i], {"start_s": math.inf, "end_s": 0.0, "flops": 0.0, "hbm_bytes": 0,
                                                    "instructions": 0, "critical_path_s": 0.0,
                                                    "critical_path_by_engine_s": {}})
            ph["start_s"] = min(ph["start_s"], s.start[i])
            ph["end_s"] = max(ph["end_s"], s.end[i])
            ph["flops"] += c.flops
            ph["hbm_bytes"] += c.dma.hbm_bytes if c.dma else 0
            ph["instructions"] += 1
        for i in self._critical_path():
            ph = phases[self.phases[i]]
            d = s.end[i] - s.start[i]
            ph["critical_path_s"] += d
            eng = s.costs[i].engine
            ph["critical_path_by_engine_s"][eng] = ph["critical_path_by_engine_s"].get(eng, 0.0) + d
        for ph in phases.values():
            span = max(ph["end_s"] - ph["start_s"], 1e-30)
            ph["span_s"] = span
            ph["achieved_flops_per_s"] = ph["flops"] / span
            ph["hbm_bytes_per_s"] = ph["hbm_bytes"] / span
            ph["arithmetic_intensity"] = ph["flops"] / ph["hbm_bytes"] if ph["hbm_bytes"] else None
        hbm = sum(s.hbm_bytes.values())
        traffic = self.hbm_traffic()
        return {
            "target": self.target.name, "scenario": self.target.scenario, "lnc": s.lnc,
            "instructions": len(s.records), "plan_errors": self.plan_errors,
            "hbm_compulsory_bytes": traffic["compulsory_bytes"], "hbm_scratch_bytes": traffic["scratch_bytes"],
            "makespan_s": s.makespan, "launch_overhead_s": self.launch_overhead_s, "modeled_time_s": t,
            "precision": self.precision, "model_flops": self.model_flops, "peak_flops_per_s": self.peak_flops,
            "mfu": self.model_flops / (t * self.peak_flops) if t else 0.0,
            "mfu_kernel_only": self.model_flops / (s.makespan * self.peak_flops) if s.makespan else 0.0,
            "hbm_bytes": hbm, "hbm_peak_bytes_per_s": self.hbm_bandwidth,
            "hbm_utilisation": hbm / (t * self.hbm_bandwidth) if t else 0.0,
            "dma_bytes": sum(s.dma_bytes.values()),
            "engines": engines, "phases": phases,
            "memory_peak_bytes_per_partition": self.memory_peak,
            "scheduled_peak_bytes_per_partition": self.scheduled_peak,
            "scheduled_capacity_exceeded": self.scheduled_capacity_exceeded,
        }

    def table(self) -> str:
        j = self.to_json()
        lines = [
            f"target {j['target']} ({j['scenario']} estimate)  lnc {j['lnc']}  instructions {j['instructions']}",
            f"modeled time {j['modeled_time_s'] * 1e6:10.2f} us  (makespan {j['makespan_s'] * 1e6:.2f} us + launch "
            f"{j['launch_overhead_s'] * 1e6:.2f} us)",
            f"TensorE MFU ({j['precision']}) {j['mfu'] * 100:6.2f} %  "
            f"(kernel only {j['mfu_kernel_only'] * 100:.2f} %), model FLOPs {j['model_flops']:.4g}",
            f"HBM {j['hbm_bytes'] / 1e6:10.3f} MB  utilisation {j['hbm_utilisation'] * 100:6.2f} % of "
            f"{j['hbm_peak_bytes_per_s'] / 1e9:.0f} GB/s; compulsory {j['hbm_compulsory_bytes'] / 1e6:.3f} MB, "
            f"scratch round trips {j['hbm_scratch_bytes'] / 1e6:.3f} MB",
            "",
            f"{'core':>4} {'engine':<8} {'busy us':>10} {'util %':>7} {'instrs':>7}",
        ]
        for p, engs in j["engines"].items():
            for eng, v in engs.items():
                lines.append(f"{p:>4} {eng:<8} {v['busy_s'] * 1e6:10.2f} {v['utilisation'] * 100:7.1f} "
                             f"{v['instructions']:7d}")
        lines += ["", f"{'phase':<16} {'span us':>10} {'crit us':>10} {'GFLOP':>10} {'HBM MB':>10} {'TFLOP/s':>8}  "
                      "critical path by engine"]
        for name, ph in j["phases"].items():
            crit = ", ".join(f"{e} {v * 1e6:.1f}" for e, v in sorted(ph["critical_path_by_engine_s"].items()))
            lines.append(f"{name:<16} {ph['span_s'] * 1e6:10.2f} {ph['critical_path_s'] * 1e6:10.2f} "
                         f"{ph['flops'] / 1e9:10.3f} {ph['hbm_bytes'] / 1e6:10.3f} "
                         f"{ph['achieved_flops_per_s'] / 1e12:8.2f}  {crit}")
        if self.memory_peak:
            lines.append("")
            for p, m in enumerate(self.memory_peak):
                lines.append(f"core {p} peak SBUF {m.get('sbuf', 0) / 1024:.1f} KiB / "
                             f"{self.target.sbuf_bytes_per_partition / 1024:.0f} KiB per partition, PSUM "
                             f"{m.get('psum', 0) / 1024:.1f} KiB / "
                             f"{self.target.psum_bytes_per_partition / 1024:.0f} KiB")
        for p, m in enumerate(self.scheduled_peak):
            lines.append(f"core {p} occupancy the modeled overlap needs: SBUF {m['sbuf'] / 1024:.1f} KiB, "
                         f"PSUM {m['psum'] / 1024:.1f} KiB per partition")
        for e in j["plan_errors"]:
            lines.append(f"PLAN ERROR: {e}; the modeled time is not valid")
        return "\n".join(lines)

    def plot(self, out_dir, prefix="cost") -> list:
        """Write `{prefix}_timeline_core{p}.png` per core and `{prefix}_roofline.png`; returns the paths."""
        from .plots import plot_report

        return plot_report(self, out_dir, prefix)

    def save_json(self, path) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1, default=str)

