"""A run's checkpoint timeline as a picture (``rayckpt status --plot``, the job's ``--timeline``), with matplotlib.

Drawn from the MetadataActor's records of the run (``MetadataActor.timeline``): each
save's moments per tier (begun, staged: its ShardWriters took the ranks' copies,
written: the last rank's files durable, committed or failed), restores and worker
group restarts marked; below, per step, the longest stall a rank saw and the time from
the save's start to its commit.
"""

from __future__ import annotations

from typing import Any

#: Lane of each tier on the timeline (top to bottom).
TIERS = ("memory", "storage")
_COLORS = {"memory": "tab:blue", "storage": "tab:green"}


class PlotUnavailableError(RuntimeError):
    """matplotlib is not installed."""


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotUnavailableError(
            "drawing the timeline needs matplotlib: pip install 'rayckpt[plot]' (or matplotlib)"
        ) from None
    return plt


def moments(save: dict[str, Any]) -> dict[str, float | None]:
    """A save's ``begun``, ``staged`` (the first rank's), ``written`` (the last rank's) and ``settled`` times."""
    return {k: save.get(k) for k in ("begun", "staged", "written", "settled")}


def draw(timeline: dict[str, Any], path: str) -> int:
    """Draw ``timeline`` (``run``, ``saves``, ``events``) into the PNG file ``path``; the saves drawn.

    Raises:
        PlotUnavailableError: matplotlib is missing.
        ValueError: the run has no save to draw.
    """
    saves = [s for s in timeline["saves"] if s["begun"] is not None]
    if not saves:
        raise ValueError(f"run {timeline['run']!r} has no save on record to draw")
    plt = _pyplot()
    t0 = min(s["begun"] for s in saves)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, 7), gridspec_kw={"height_ratios": [1.3, 1]})
    lanes = {tier: i for i, tier in enumerate(TIERS)}
    for s in saves:
        m = {k: (v - t0 if v is not None else None) for k, v in moments(s).items()}
        y = lanes.get(s["tier"], len(TIERS))
        end = m["settled"] if m["settled"] is not None else max(v for v in m.values() if v is not None)
        top.plot([m["begun"], end], [y, y], color=_COLORS.get(s["tier"], "gray"), lw=6, alpha=0.35)
        top.plot([m["begun"]], [y], marker="|", color="black", ms=14)
        if m["staged"] is not None:
            top.plot([m["staged"]], [y], marker="o", color="orange", ms=5)
        if m["written"] is not None:
            top.plot([m["written"]], [y], marker="s", color="purple", ms=5)
        if s["status"] == "committed":
            top.plot([m["settled"]], [y], marker="D", color="green", ms=6)
        elif s["status"] == "failed":
            top.plot([m["settled"]], [y], marker="X", color="red", ms=9)
        if s["step"] is not None:
            top.annotate(str(s["step"]), (m["begun"], y + 0.18), fontsize=7, ha="left")
    for e in timeline["events"]:
        x = e["time"] - t0
        if e["kind"] == "restored":
            top.axvline(x, color="magenta", ls="-", lw=1.2)
            top.annotate(f"restored step {e.get('step')} from {e.get('tier')}", (x, len(TIERS) - 0.45), fontsize=8)
        elif e["kind"] == "started" and e.get("restarts"):
            top.axvline(x, color="black", ls="--", lw=1)
            top.annotate(f"restart {e['restarts']}", (x, -0.55), fontsize=8)
        elif e["kind"] == "restore_fallback":
            top.axvline(x, color="red", ls=":", lw=1)
    top.set_yticks(range(len(TIERS)), TIERS)
    top.set_ylim(-0.8, len(TIERS) - 0.2)
    top.set_xlabel("seconds since the first save began")
    top.set_title(
        f"run {timeline['run']}: each save from its start (|) to staged (o), written (square), "
        "committed (diamond) or failed (X)",
        fontsize=10,
    )
    _per_step(bottom, saves)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return len(saves)


def _per_step(ax: Any, saves: list[dict[str, Any]]) -> None:
    """Per step and tier: the longest rank stall and the save's start-to-commit time."""
    from matplotlib import ticker

    width = 0.2
    for i, tier in enumerate(TIERS):
        mine = [s for s in saves if s["tier"] == tier and s["step"] is not None]
        steps = [s["step"] for s in mine]
        stalls = [s.get("stall") or 0.0 for s in mine]
        commits = [(s["settled"] - s["begun"]) if s["status"] == "committed" else 0.0 for s in mine]
        offset = (i - 0.5) * 2 * width
        ax.bar([x + offset - width / 2 for x in steps], stalls, width, color=_COLORS[tier], label=f"{tier}: stall")
        ax.bar(
            [x + offset + width / 2 for x in steps],
            commits,
            width,
            color=_COLORS[tier],
            alpha=0.4,
            label=f"{tier}: start to commit",
        )
    ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.legend(fontsize=8, ncol=2)
