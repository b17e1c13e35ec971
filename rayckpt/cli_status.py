"""``rayckpt status``: the one command that joins a running Ray cluster (the others read storage only).

It asks the MetadataActor and each node's ShardWriter (``rayckpt.ray.status``) and
prints one screen (``observe.status_view``), JSON with ``--json``, again every N seconds
with ``--watch N``; ``--plot FILE.png`` draws a run's checkpoint timeline instead
(``observe.timeline``). Exit 0: shown; 1: no cluster answers, or it runs no rayckpt
(one line on stderr); 2: bad arguments.
"""

from __future__ import annotations

import argparse
import sys
import time

from .cli_text import positive_int, print_json


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
    from .observe.status_view import render
    from .ray import status
    from .ray.joining import ClusterUnreachableError

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


def _plot(args: argparse.Namespace, status) -> int:  # noqa: ANN001 - rayckpt.ray.status, imported by the caller
    from .observe.timeline import PlotUnavailableError, draw

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
