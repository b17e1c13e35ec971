"""The scale benchmark's plot as a standalone SVG (no plotting library: matplotlib is not in the venv).

Two log-log panels against the saved rank count: metadata bytes (with the target,
half of DCP's ``.metadata``), and seconds of each planning and parsing step (with
the targets at 4,096 ranks). rayckpt solid, DCP dashed; an estimated point is hollow.
"""

from __future__ import annotations

import math
from typing import Any

from benchmarks.scale.report import all_figures

W, H, PAD_L, PAD_R, PAD_T, PAD_B = 470, 380, 62, 16, 34, 96
COLORS = {"read": "#1f77b4", "save": "#d62728", "job": "#2ca02c", "rank": "#9467bd", "cached": "#ff7f0e"}


def _ticks(lo: float, hi: float) -> list[float]:
    return [10.0**e for e in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)]


def _label(v: float) -> str:
    return f"{v:g}" if 1e-3 <= v < 1e5 else f"1e{round(math.log10(v))}"


class Panel:
    """One log-log panel at horizontal offset ``x0``."""

    def __init__(self, x0: float, title: str, unit: str, xs: list[float], ys: list[float]) -> None:
        self.x0, self.out = x0, []
        self.xt = _ticks(min(xs), max(xs))
        self.yt = _ticks(min(ys), max(ys))
        self.lx = (math.log10(self.xt[0]), math.log10(self.xt[-1]))
        self.ly = (math.log10(self.yt[0]), math.log10(self.yt[-1]))
        self._frame(title, unit, xs)

    def at(self, x: float, y: float) -> tuple[float, float]:
        fx = (math.log10(x) - self.lx[0]) / ((self.lx[1] - self.lx[0]) or 1)
        fy = (math.log10(y) - self.ly[0]) / ((self.ly[1] - self.ly[0]) or 1)
        return self.x0 + PAD_L + fx * (W - PAD_L - PAD_R), PAD_T + (1 - fy) * (H - PAD_T - PAD_B)

    def _frame(self, title: str, unit: str, xs: list[float]) -> None:
        o = self.out
        left, right, top, bottom = self.x0 + PAD_L, self.x0 + W - PAD_R, PAD_T, H - PAD_B
        o.append(
            f'<rect x="{left}" y="{top}" width="{right - left}" height="{bottom - top}" fill="none" stroke="#888"/>'
        )
        o.append(f'<text x="{self.x0 + W / 2}" y="20" text-anchor="middle" font-weight="bold">{title}</text>')
        for y in self.yt:
            _, py = self.at(xs[0], y)
            o.append(f'<line x1="{left}" y1="{py:.1f}" x2="{right}" y2="{py:.1f}" stroke="#eee"/>')
            o.append(f'<text x="{left - 4}" y="{py + 4:.1f}" text-anchor="end">{_label(y)}</text>')
        for x in sorted(set(xs)):
            px, _ = self.at(x, self.yt[0])
            o.append(f'<text x="{px:.1f}" y="{bottom + 16}" text-anchor="middle">{int(x):,}</text>')
        o.append(f'<text x="{self.x0 + W / 2}" y="{bottom + 31}" text-anchor="middle">saved ranks N</text>')
        o.append(
            f'<text x="{self.x0 + 14}" y="{(top + bottom) / 2}" transform="rotate(-90 {self.x0 + 14} '
            f'{(top + bottom) / 2})" text-anchor="middle">{unit}</text>'
        )

    def line(self, points: list[tuple[float, float, bool]], color: str, dashed: bool) -> None:
        pts = [(self.at(x, y), est) for x, y, est in points]
        path = " ".join(f"{px:.1f},{py:.1f}" for (px, py), _ in pts)
        dash = ' stroke-dasharray="6 4"' if dashed else ""
        self.out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"{dash}/>')
        for (px, py), est in pts:
            fill = "white" if est else color
            self.out.append(f'<circle cx="{px:.1f}" cy="{py:.1f}" r="3.5" fill="{fill}" stroke="{color}"/>')

    def target(self, x: float, y: float, color: str, text: str) -> None:
        px, py = self.at(x, y)
        self.out.append(f'<path d="M{px - 9:.1f},{py:.1f} h18" stroke="{color}" stroke-width="3"/>')
        self.out.append(f'<text x="{px - 12:.1f}" y="{py + 4:.1f}" text-anchor="end" fill="{color}">{text}</text>')

    def legend(self, rows: list[tuple[str, str, bool]]) -> None:
        for i, (text, color, dashed) in enumerate(rows):
            x = self.x0 + PAD_L + (i % 2) * 190
            y = H - PAD_B + 52 + (i // 2) * 15
            dash = ' stroke-dasharray="6 4"' if dashed else ""
            self.out.append(
                f'<line x1="{x}" y1="{y - 4}" x2="{x + 18}" y2="{y - 4}" stroke="{color}" stroke-width="2"{dash}/>'
            )
            self.out.append(f'<text x="{x + 22}" y="{y}">{text}</text>')


def write_plot(report: dict[str, Any], path: str) -> None:
    figs = all_figures(report)
    sizes = {
        "rayckpt": [(n, f["rayckpt_bytes"] / 1e6, False) for n, f in figs.items() if f["rayckpt_bytes"]],
        "DCP": [(n, f["dcp_bytes"] / 1e6, False) for n, f in figs.items() if f["dcp_bytes"]],
    }
    times = {
        ("read + parse", "read"): ("rayckpt_read", "dcp_read", None),
        ("global save plan", "save"): ("rayckpt_save_plan", "dcp_save_plan", "dcp_save_plan_est"),
        ("load plan N->N/2, job", "job"): ("rayckpt_job_half", "dcp_job_half", "dcp_job_half_est"),
        ("load plan N->N/2, 1 rank", "rank"): ("rayckpt_rank_half", "dcp_rank_half", None),
    }
    lines: list[tuple[str, str, bool, list[tuple[float, float, bool]]]] = []
    for (label, color), (ours, theirs, est) in times.items():
        lines.append((label, COLORS[color], False, [(n, f[ours], False) for n, f in figs.items() if f[ours]]))
        pts = [(n, f[theirs], bool(est and f[est])) for n, f in figs.items() if f[theirs]]
        lines.append((label, COLORS[color], True, pts))
    cached = [(n, f["dcp_save_plan_cached"], False) for n, f in figs.items() if f["dcp_save_plan_cached"]]
    lines.append(("DCP cached save plan", COLORS["cached"], True, cached))
    lines = [x for x in lines if x[3]]
    xs = [float(n) for n in figs] + [4096.0]
    left = Panel(0, "Metadata size", "MB", xs, [y for pts in sizes.values() for _, y, _ in pts] or [1.0])
    left.line(sizes["rayckpt"], "#1f77b4", False)
    left.line(sizes["DCP"], "#1f77b4", True)
    left.line([(x, y / 2, e) for x, y, e in sizes["DCP"]], "#999", True)
    left.legend(
        [("rayckpt manifest", "#1f77b4", False), ("DCP .metadata", "#1f77b4", True), ("target: DCP / 2", "#999", True)]
    )
    ys = [y for *_, pts in lines for _, y, _ in pts] + [0.1, 2.0]
    right = Panel(W, "CPU seconds (solid: rayckpt, dashed: DCP)", "s", xs, ys)
    for _, color, dashed, pts in lines:
        right.line(pts, color, dashed)
    right.target(4096, 2.0, COLORS["save"], "2 s")
    right.target(4096, 1.0, COLORS["job"], "1 s")
    right.target(4096, 0.1, COLORS["rank"], "0.1 s")
    right.legend(
        [(label, color, False) for label, color, dashed, _ in lines if not dashed]
        + [("DCP cached save plan", COLORS["cached"], True)] * bool(cached)
    )
    body = "\n".join(left.out + right.out)
    svg = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{2 * W}" height="{H}" font-family="sans-serif" '
        f'font-size="11">\n<rect width="100%" height="100%" fill="white"/>\n{body}\n</svg>\n'
    )
    with open(path, "w") as f:
        f.write(svg)
