"""The text of ``rayckpt status``: one screen from the report ``rayckpt.ray.status.gather`` returns.

Per run: its newest committed checkpoint per tier (step, age), saves in flight (tier,
step, phase, age), recent failures with their reason, restores after restarts; then
each node's memory tier against its budget.
"""

from __future__ import annotations

import time
from typing import Any

#: A snapshot older than this is flagged (the actors publish every second).
STALE_S = 5.0


def age(seconds: float) -> str:
    """``4.2 s``, ``12 min``, ``3.5 h``: how long ago, in the unit that reads best."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


def _one_line(text: str, limit: int = 100) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def render(report: dict[str, Any], address: str = "") -> str:
    """The screen for ``report`` (``gather``'s: ``now``, ``runs``, ``nodes``...), read from the cluster ``address``."""
    now = report.get("now", report["time"])
    where = f" at {address}" if address else ""
    lines = [f"rayckpt status{where}, {_clock(now)} (MetadataActor pid {report.get('pid', '?')})"]
    late = report.get("published_age_s", 0.0)
    if late > STALE_S:
        lines.append(
            f"the MetadataActor last published its status {age(late)} ago (every second when well): it is busy, "
            "or gone; what follows is as of then"
        )
    runs = report["runs"]
    if not runs:
        lines.append("no runs yet: the MetadataActor has seen no save or restore since it started")
    for run in runs:
        lines += ["", f"run {run['run']}"]
        if not run["tiers"]:
            lines.append("  no committed checkpoint yet")
        for tier, n in run["tiers"].items():
            lines.append(f"  {tier:<8} newest step {n['step']}, committed {age(n['age_s'])} ago  {n['path']}")
        for s in run["in_flight"]:
            lines.append(f"  in flight: {s['tier']} step {s['step']}, {s['phase']}, for {age(s['age_s'])}")
        for f in run["failures"]:
            step = f"step {f['step']}" if f["step"] is not None else "a save"
            lines.append(f"  failed {age(now - f['time'])} ago: {f['tier']} {step}: {_one_line(f['error'])}")
        if run["restarts"]:
            lines.append(f"  worker group restarts: {run['restarts']}")
        for r in run["restores"]:
            took = f"{r['seconds']:.2f} s" if r.get("seconds") is not None else "?"
            size = _bytes(r.get("bytes_read") or 0)
            peer = f", {_bytes(r['peer_bytes'])} from a peer" if r.get("peer_bytes") else ""
            lines.append(
                f"  restored {age(now - r['time'])} ago: step {r['step']} from {r['tier']} "
                f"in {took} on {r.get('world_size') or '?'} worker(s) (rank 0 read {size}{peer})"
            )
        if run["fallbacks"]:
            lines.append(f"  restores that passed over a damaged checkpoint: {run['fallbacks']}")
    nodes = report.get("nodes", [])
    if nodes:
        lines += ["", "memory tier per node"]
        for n in nodes:
            if "error" in n:
                lines.append(f"  {n['node']}  not answering: {_one_line(n['error'])}")
                continue
            share = 100 * n["held"] / n["budget"] if n["budget"] else 0.0
            lines.append(
                f"  {n['node']}  {_bytes(n['held'])} of {_bytes(n['budget'])} held ({share:.0f}%), "
                f"room {_bytes(n['room'])} ({n['bound']})"
            )
    return "\n".join(lines)
