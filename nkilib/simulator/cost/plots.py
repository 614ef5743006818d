"""Plots of a cost report: one engine timeline per core and a roofline of the phases (matplotlib)."""
from __future__ import annotations

import os


def plot_report(report, out_dir, prefix="cost") -> list:
    """Write `{prefix}_timeline_core{p}.png` per core and `{prefix}_roofline.png` for `report`; returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    s = report.schedule
    paths = []
    lanes = ["tensor", "vector", "scalar", "gpsimd", "sync", "dma", "barrier"]
    phase_names = sorted(set(report.phases))
    cmap = plt.get_cmap("tab10")
    colors = {ph: cmap(k % 10) for k, ph in enumerate(phase_names)}
    for p in sorted({r.program for r in s.records}):
        fig, ax = plt.subplots(figsize=(12, 3.5))
        dma_rows = []  # greedy lanes so overlapping DMAs stay visible
        for i, r in enumerate(s.records):
            if r.program != p:
                continue
            eng = s.costs[i].engine
            if eng == "dma":
                row = next((k for k, e in enumerate(dma_rows) if e <= s.start[i]), None)
                if row is None:
                    row = len(dma_rows)
                    dma_rows.append(0.0)
                dma_rows[row] = s.end[i]
                y = lanes.index("dma") + 0.8 * row / max(1, report.target.dma_queues_per_core)
                h = 0.8 / max(1, report.target.dma_queues_per_core)
            else:
                y, h = lanes.index(eng), 0.8
            ax.broken_barh([(s.start[i] * 1e6, max((s.end[i] - s.start[i]) * 1e6, 1e-4))], (y, h),
                           facecolors=colors[report.phases[i]])
        ax.set_yticks([k + 0.4 for k in range(len(lanes))], lanes)
        ax.set_xlabel("time (us)")
        ax.set_title(f"engine timeline, core {p} ({report.target.name}, lnc {s.lnc}); makespan "
                     f"{s.makespan * 1e6:.1f} us")
        handles = [plt.Rectangle((0, 0), 1, 1, color=colors[ph]) for ph in phase_names]
        ax.legend(handles, phase_names, loc="upper right", fontsize=7)
        fig.tight_layout()
        path = os.path.join(out_dir, f"{prefix}_timeline_core{p}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    # roofline: one point per phase
    j = report.to_json()
    fig, ax = plt.subplots(figsize=(6, 4.5))
    peak, bw = report.peak_flops, report.hbm_bandwidth
    xs = [2 ** (k / 8) for k in range(-32, 112)]
    ax.loglog(xs, [min(peak, x * bw) / 1e12 for x in xs], "k-", label=f"roof ({report.precision}, HBM)")
    for name, ph in j["phases"].items():
        ai = ph["arithmetic_intensity"]
        if ai:
            ax.loglog([ai], [ph["achieved_flops_per_s"] / 1e12], "o", color=colors[name], label=name)
    ax.set_xlabel("arithmetic intensity (FLOP / HBM byte)")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(f"roofline ({report.target.name}, lnc {s.lnc})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(out_dir, f"{prefix}_roofline.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)
    return paths
