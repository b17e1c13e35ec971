"""The scale benchmark's plot (matplotlib, imported here only: the plot is optional)."""

from __future__ import annotations

from typing import Any

from benchmarks.scale.report import all_figures

#: (label, color): (rayckpt's figure, DCP's, DCP's "estimated" flag), and the target at 4,096 ranks.
TIMES = {
    ("read + parse", "tab:blue"): ("rayckpt_read", "dcp_read", None, None),
    ("global save plan", "tab:red"): ("rayckpt_save_plan", "dcp_save_plan", "dcp_save_plan_est", 2.0),
    ("load plan N->N/2, job", "tab:green"): ("rayckpt_job_half", "dcp_job_half", "dcp_job_half_est", 1.0),
    ("load plan N->N/2, 1 rank", "tab:purple"): ("rayckpt_rank_half", "dcp_rank_half", None, 0.1),
}


def write_plot(report: dict[str, Any], path: str) -> None:
    """The plot, in the format ``path``'s extension names (``.svg``, ``.png``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figs = all_figures(report)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))

    def line(ax: Any, key: str, color: str, dashed: bool, label: str | None, est: str | None = None) -> None:
        pts = [(n, f[key], bool(est and f[est])) for n, f in figs.items() if f[key]]
        if not pts:
            return
        style = "--" if dashed else "-"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=color, label=label)
        for n, y, hollow in pts:
            ax.plot(n, y, "o", color=color, markerfacecolor="white" if hollow else color)

    for key, dashed, label in (("rayckpt_bytes", False, "rayckpt manifest"), ("dcp_bytes", True, "DCP .metadata")):
        pts = [(n, f[key] / 1e6) for n, f in figs.items() if f[key]]
        left.plot([p[0] for p in pts], [p[1] for p in pts], "--" if dashed else "-o", color="tab:blue", label=label)
        if dashed:
            left.plot([p[0] for p in pts], [p[1] / 2 for p in pts], ":", color="gray", label="target: DCP / 2")
    left.set(title="Metadata size", ylabel="MB")
    for (label, color), (ours, theirs, est, goal) in TIMES.items():
        line(right, ours, color, False, label)
        line(right, theirs, color, True, None, est)
        if goal:
            right.plot(4096, goal, "_", color=color, markersize=18, markeredgewidth=3)
    line(right, "dcp_save_plan_cached", "tab:orange", True, "DCP cached save plan")
    right.set(title="CPU seconds (solid: rayckpt, dashed: DCP)", ylabel="s")
    for ax in (left, right):
        ax.set(xscale="log", yscale="log", xlabel="saved ranks N")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
