"""``rayckpt status``: the one command that joins a running Ray cluster (the others read storage only).

It reads what the MetadataActor and each node's ShardWriter publish (``rayckpt.ray.status.reader``)
and prints one screen (``render``: per run its newest committed checkpoint per tier, saves in
flight, recent failures, restores after restarts; then each node's memory tier against its
budget), JSON with ``--json``, again every N seconds with ``--watch N``; ``--plot FILE.png``
draws a run's checkpoint timeline instead (``observe.timeline``). Exit 0: shown; 1: no cluster
answers, or it runs no rayckpt (one line on stderr); 2: bad arguments.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from .text import human_bytes, positive_int, print_json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--address",
        default=None,
        help="the Ray cluster (HOST:PORT); default: RAY_ADDRESS, else the one `ray start` left on this machine",
    )
    p.add_argument("--json", action="store_true", help="print the status as JSON")
    p.add_argument("--watch", type=positive_int, metavar="N", help="print it again every N seconds until Ctrl-C")
    p.add_argument("--plot", metavar="FILE.png", help="draw a run's checkpoint timeline into FILE.png instead")
    p.add_argument("--run", help="the run to --plot (default: the only run, or the last one active)")


def _fail(message: str) -> int:
    print(f"rayckpt status: {message}", file=sys.stderr)
    return 1


def cmd_status(args: argparse.Namespace) -> int:
    from ..ray.joining import ClusterUnreachableError
    from ..ray.status import reader as status

    try:
        address = status.join(args.address)
    except ClusterUnreachableError as exc:
        return _fail(str(exc))
    except ConnectionError as exc:
        return _fail(f"no Ray cluster to ask: {exc}")
    try:
        if args.plot:
            return _plot(args, status)
        while True:
            report = status.gather()
            if args.json:
                print_json(report)
            else:
                if args.watch and sys.stdout.isatty():
                    print("\033[H\033[J", end="")  # a fresh screen each time
                print(render(report, address), flush=True)
            if not args.watch:
                return 0
            time.sleep(args.watch)
    except status.NoRayckptError as exc:
        return _fail(str(exc))
    except KeyboardInterrupt:
        return 0


def _plot(args: argparse.Namespace, status) -> int:  # noqa: ANN001 - rayckpt.ray.status.reader, imported by the caller
    from ..observe.timeline import PlotUnavailableError, draw

    run = args.run
    if run is None:
        runs = [r["run"] for r in status.gather()["runs"]]
        if not runs:
            return _fail("no run to plot: the MetadataActor has seen no save")
        run = runs[-1]
    try:
        drawn = draw(status.timeline(run), args.plot)
    except (PlotUnavailableError, ValueError) as exc:
        return _fail(str(exc))
    except OSError as exc:
        return _fail(f"cannot write {args.plot}: {exc.strerror or exc}")
    print(f"wrote {args.plot}: {drawn} saves of run {run}")
    return 0


# ---------------------------------------------------------------------------
# The screen


#: A snapshot older than this is flagged (the actors publish every second).
STALE_S = 5.0


def age(seconds: float) -> str:
    """``4.2 s``, ``12 min``, ``3.5 h``: how long ago, in the unit that reads best."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


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
            size = human_bytes(r.get("bytes_read") or 0)
            peer = f", {human_bytes(r['peer_bytes'])} from a peer" if r.get("peer_bytes") else ""
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
                f"  {n['node']}  {human_bytes(n['held'])} of {human_bytes(n['budget'])} held ({share:.0f}%), "
                f"room {human_bytes(n['room'])} ({n['bound']})"
            )
    return "\n".join(lines)
