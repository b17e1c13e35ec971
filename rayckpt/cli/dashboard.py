"""``rayckpt dashboard``: files for watching rayckpt's metrics, made from their definitions.

``export`` writes the Grafana dashboard's JSON (``observe.dashboard``); ``alerts`` writes the
Prometheus alert rules on checkpoint age (``observe.alerts``). Each writes FILE whole or not at all
(``-``: stdout) and prints one line saying what it wrote, or JSON with ``--json``. A bad argument is
a ``UsageError`` (exit 2), a file that cannot be written an ``OSError`` (exit 1). ``observe`` is
imported by the action that runs, so the other commands start without it.
"""

from __future__ import annotations

import argparse
import sys

from .text import UsageError, count, print_json

EXIT_OK = 0


def _write(path: str, text: str) -> None:
    from ..observe.dashboard import write_atomic

    try:
        write_atomic(path, text)
    except OSError as exc:  # a missing folder too: the file cannot be written (exit 1)
        raise OSError(f"cannot write {path}: {exc.strerror or exc}") from exc


def cmd_export(args: argparse.Namespace) -> int:
    from ..observe import dashboard

    if args.file == "-":
        if args.json:
            raise UsageError("--json needs a FILE: `-` writes the dashboard itself to stdout")
        sys.stdout.write(dashboard.dashboard_json())
        return EXIT_OK
    _write(args.file, dashboard.dashboard_json())
    panels = len(dashboard.PANELS)
    if args.json:
        print_json({"path": args.file, "panels": panels})
    else:
        print(f"wrote the rayckpt Grafana dashboard ({count(panels, 'panel')}) to {args.file}")
    return EXIT_OK


def cmd_alerts(args: argparse.Namespace) -> int:
    from ..observe import alerts

    if args.file == "-" and args.json:
        raise UsageError("--json needs a FILE: `-` writes the alert rules themselves to stdout")
    rules = alerts.rules(args.max_age, for_s=args.for_)
    text = alerts.rules_yaml(args.max_age, for_s=args.for_)
    if args.file == "-":
        sys.stdout.write(text)
        return EXIT_OK
    _write(args.file, text)
    if args.json:
        print_json({"path": args.file, "alerts": len(rules), "max_age_s": args.max_age})
    else:
        print(
            f"wrote the rayckpt Prometheus alert rules ({count(len(rules), 'alert')}: a live run's checkpoint "
            f"older than {alerts.format_duration(args.max_age)}) to {args.file}"
        )
    return EXIT_OK


def duration(text: str) -> float:
    """An argument's seconds from a Prometheus duration (``30m``) or a number of seconds."""
    from ..observe.alerts import parse_duration

    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def positive_duration(text: str) -> float:
    """``duration`` that must be more than nothing (to the millisecond the rule file holds)."""
    seconds = duration(text)
    if seconds < 0.001:
        raise argparse.ArgumentTypeError(f"must be more than 0s (at least 1ms), got {text!r}")
    return seconds


def add_actions(
    p: argparse.ArgumentParser, formatter_class: type[argparse.HelpFormatter]
) -> list[argparse.ArgumentParser]:
    """Add the actions of ``rayckpt dashboard`` to ``p``; return their parsers."""
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True, help="what to do")
    e = actions.add_parser(
        "export",
        help="write the dashboard's JSON to FILE (import it into Grafana)",
        description="Write the Grafana dashboard of rayckpt's metrics as JSON to FILE, to import into Grafana. "
        "The head node's MetadataActor also installs it where Ray's Grafana set-up looks.",
        formatter_class=formatter_class,
    )
    e.add_argument("file", metavar="FILE", help="where to write it; - for stdout")
    e.add_argument("--json", action="store_true", help='print {"path": ..., "panels": N}')
    e.set_defaults(func=cmd_export)
    a = actions.add_parser(
        "alerts",
        help="write Prometheus alert rules on checkpoint age to FILE (list it under rule_files:)",
        description="Write Prometheus alert rules to FILE: RayckptCheckpointTooOld when a live run's newest "
        "checkpoint in a tier is older than --max-age, RayckptNoCheckpoint when a run has been active that long "
        "without one. Name FILE under rule_files: in prometheus.yml. Label filters: "
        "RAY_GRAFANA_RAYCKPT_DASHBOARD_GLOBAL_FILTERS, as for the dashboard.",
        formatter_class=formatter_class,
    )
    a.add_argument("file", metavar="FILE", help="where to write it; - for stdout")
    a.add_argument(
        "--max-age",
        type=positive_duration,
        default="30m",
        metavar="DURATION",
        help="the checkpoint age that alerts (90s, 30m, 1h30m, 2h, 1d, or seconds)",
    )
    a.add_argument(
        "--for",
        dest="for_",
        type=duration,
        default="0s",
        metavar="DURATION",
        help="how long an age must stay over --max-age before RayckptCheckpointTooOld fires",
    )
    a.add_argument("--json", action="store_true", help='print {"path": ..., "alerts": 2, "max_age_s": SECONDS}')
    a.set_defaults(func=cmd_alerts)
    return [e, a]
