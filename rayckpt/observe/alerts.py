"""Prometheus alert rules on checkpoint age, generated from the metric definitions.

Two alerts, in one rule group ``rayckpt`` (``rules_yaml`` writes the rule file):

- ``RayckptCheckpointTooOld``: a run's newest committed checkpoint in a tier (``memory`` or
  ``storage``) is older than ``max_age`` (``time()`` minus ``ray_rayckpt_last_commit_timestamp_seconds``,
  per Ray session, run and tier): a failure now would lose more than that much training.
- ``RayckptNoCheckpoint``: a run has been active for ``max_age`` and has committed no checkpoint
  in any tier.

Both hold only while ``ray_rayckpt_run_active`` says the run's rank 0 is alive: a finished run's
timestamp gauge may linger on the export and age, and that alerts nobody. Series names come from
``metric_defs`` (``MetricDef.exported``), so a renamed metric changes the rules with it; every
selector carries the global filters (``RAY_GRAFANA_RAYCKPT_DASHBOARD_GLOBAL_FILTERS``, as the
Grafana dashboard reads them, ``observe.dashboard``).

Load the file by naming it under ``rule_files:`` in ``prometheus.yml`` (Ray's generated one is
``/tmp/ray/session_latest/metrics/prometheus/prometheus.yml``), then restart Prometheus or send it
SIGHUP; ``promtool check rules FILE`` checks it. ``rayckpt dashboard alerts FILE`` writes it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import yaml

from .dashboard import global_filters_from_env
from .metric_defs import GAUGE, metric

GROUP = "rayckpt"
TOO_OLD = "RayckptCheckpointTooOld"
NO_CHECKPOINT = "RayckptNoCheckpoint"
SEVERITY = "warning"
TIMESTAMP_METRIC = "rayckpt_last_commit_timestamp_seconds"
ACTIVE_METRIC = "rayckpt_run_active"
#: What one alert is about: a Ray session's run (and, for ages, its tier).
RUN_LABELS = ("SessionName", "run")
DURATION_FORM = "a Prometheus duration such as 90s, 30m, 1h30m, 2h or 1d, or a number of seconds"

# Prometheus's duration grammar (model.ParseDuration): each unit at most once, largest first.
_UNITS = (("y", 365 * 86400), ("w", 7 * 86400), ("d", 86400), ("h", 3600), ("m", 60), ("s", 1), ("ms", 0.001))
_DURATION = re.compile("".join(f"(?:(?P<{u}>[0-9]+){u})?" for u, _ in _UNITS))
_SECONDS = re.compile(r"[0-9]+(?:\.[0-9]+)?")
# The annotations' Prometheus templates: an alert's labels, and its value (an age) as "31m 0s".
_RUN, _TIER, _SESSION = "{{ $labels.run }}", "{{ $labels.tier }}", "{{ $labels.SessionName }}"
_AGE_NOW = "{{ $value | humanizeDuration }}"
_FORMAT_UNITS = (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000), ("ms", 1))


@dataclass(frozen=True, kw_only=True)
class AlertRule:
    """One alerting rule: its ``name``, PromQL ``expr``, ``for_s`` (seconds the expression must hold before
    the alert fires) and the ``summary`` and ``description`` annotations (Prometheus templates)."""

    name: str
    expr: str
    for_s: float
    summary: str
    description: str

    def as_dict(self) -> dict[str, object]:
        """The rule as Prometheus's rule file has it."""
        return {
            "alert": self.name,
            "expr": self.expr,
            "for": format_duration(self.for_s),
            "labels": {"severity": SEVERITY},
            "annotations": {"summary": self.summary, "description": self.description},
        }


def parse_duration(text: str) -> float:
    """Seconds in a Prometheus duration (``90s``, ``30m``, ``1h30m``, ``2h``, ``1d``; also ``y``, ``w``,
    ``ms``) or a plain number of seconds (``90``, ``1.5``); a ``ValueError`` naming ``text`` otherwise."""
    s = text.strip()
    if _SECONDS.fullmatch(s):
        return float(s)
    match = _DURATION.fullmatch(s) if s else None
    if not match or not any(match.groupdict().values()):
        raise ValueError(f"invalid duration {text!r}: use {DURATION_FORM}")
    return sum(int(n) * size for (unit, size), n in zip(_UNITS, match.groups()) if n)


def format_duration(seconds: float) -> str:
    """``seconds`` as a Prometheus duration (``30m``, ``1h30m``, ``90.5`` -> ``1m30s500ms``, ``0s``), to the
    millisecond; a ``ValueError`` for a negative or non-finite number."""
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"a duration is a finite number of seconds >= 0, not {seconds!r}")
    left = round(seconds * 1000)
    parts = []
    for unit, size in _FORMAT_UNITS:
        n, left = divmod(left, size)
        if n:
            parts.append(f"{n}{unit}")
    return "".join(parts) or "0s"


def _selector(name: str, tags: tuple[str, ...], filters: Sequence[str]) -> str:
    """The exported series of gauge ``name``, which must have ``tags``, selected by ``filters``."""
    m = metric(name)
    if m.kind != GAUGE:
        raise ValueError(f"metric {m.name} is a {m.kind}; the alert rules read gauges")
    missing = [t for t in tags if t not in m.tags]
    if missing:
        raise ValueError(f"metric {m.name} lacks the tags {missing} the alert rules group by")
    return f"{m.exported()}{{{', '.join(filters)}}}" if filters else m.exported()


def _number(x: float) -> str:
    return str(int(x)) if x == int(x) else repr(x)


def rules(
    max_age_s: float, *, for_s: float = 0.0, global_filters: Sequence[str] | None = None
) -> tuple[AlertRule, ...]:
    """The two alert rules for checkpoints older than ``max_age_s`` seconds (at least 1ms); ``for_s`` (>= 0) is how
    long an age must stay over it before ``RayckptCheckpointTooOld`` fires; ``global_filters``: label
    matchers every selector gets (None: ``RAY_GRAFANA_RAYCKPT_DASHBOARD_GLOBAL_FILTERS``, as the dashboard)."""
    if not math.isfinite(max_age_s) or max_age_s < 0.001:  # the rule file holds durations to the millisecond
        raise ValueError(f"max_age_s must be a finite number of seconds, at least 0.001 (1ms), not {max_age_s!r}")
    if not math.isfinite(for_s) or for_s < 0:
        raise ValueError(f"for_s must be a finite number of seconds >= 0, not {for_s!r}")
    filters = global_filters_from_env() if global_filters is None else [f.strip() for f in global_filters if f.strip()]
    stamp = _selector(TIMESTAMP_METRIC, ("run", "tier"), filters)
    by_run = ", ".join(RUN_LABELS)
    active = f"max by ({by_run}) ({_selector(ACTIVE_METRIC, ('run',), filters)}) > 0"
    age = format_duration(max_age_s)
    too_old = AlertRule(
        name=TOO_OLD,
        expr=f"(time() - max by ({by_run}, tier) ({stamp}) > {_number(max_age_s)}) and on ({by_run}) ({active})",
        for_s=for_s,
        summary=f"rayckpt run {_RUN}: newest {_TIER} checkpoint older than {age}",
        description=f"The newest {_TIER} checkpoint of run {_RUN} (Ray session {_SESSION}) committed {_AGE_NOW} "
        f"ago, more than {age}: a failure now would lose that much training.",
    )
    no_checkpoint = AlertRule(
        name=NO_CHECKPOINT,
        expr=f"({active}) unless on ({by_run}) (max by ({by_run}) ({stamp}))",
        for_s=max_age_s,
        summary=f"rayckpt run {_RUN}: no checkpoint in {age}",
        description=f"Run {_RUN} (Ray session {_SESSION}) has been active for {age} without committing a "
        "checkpoint in any tier: a failure now would lose all its training.",
    )
    return too_old, no_checkpoint


def rules_yaml(max_age_s: float, *, for_s: float = 0.0, global_filters: Sequence[str] | None = None) -> str:
    """The rule file (YAML, group ``rayckpt``) of ``rules(max_age_s, for_s=..., global_filters=...)``."""
    found = rules(max_age_s, for_s=for_s, global_filters=global_filters)
    group = {"name": GROUP, "rules": [r.as_dict() for r in found]}
    header = (
        f"# rayckpt's alert rules (`rayckpt dashboard alerts`): checkpoints older than {format_duration(max_age_s)}.\n"
        "# Load: name this file under rule_files: in prometheus.yml, then restart Prometheus or send it SIGHUP.\n"
    )
    return header + yaml.safe_dump({"groups": [group]}, sort_keys=False, width=10_000, allow_unicode=True)
